// Merging partial attention results (split-KV decoding, and
// cuflash.merge_attention_states): state s of a row holds o_s, its output
// over a subset K_s of the row's keys normalised by its own softmax sum, and
// lse_s, the log-sum-exp of its scaled scores over K_s. Over the union of
// disjoint subsets, with m = max_s lse_s and w_s = exp(lse_s - m):
//   lse = m + log(sum_s w_s),   o = sum_s (w_s / sum_s w_s) o_s.
// Subtracting m keeps every exponent <= 0: no overflow, and the largest
// weight is exactly 1. A state with lse_s = -inf (no key seen) weighs 0 and
// its output is never read (it may be anything, NaN included); a row whose
// every state is -inf gets output 0 and log-sum-exp -inf, as a row that
// sees no key does in the forward.
//
// One warp per row; each lane holds kVec consecutive columns per step.
#include "numeric.cuh"
#include "params.cuh"

namespace cuflash {

// kVec elements of `Partial` at `src` (aligned to kVec elements), as
// floats: one 16-byte load for four float32 values.
template <int kVec, typename Partial>
__device__ __forceinline__ void load_as_float(const Partial* src, float (&dst)[kVec]) {
    if constexpr (kVec == 4 && sizeof(Partial) == 4) {
        const float4 v = *reinterpret_cast<const float4*>(src);
        dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            dst[i] = to_float(src[i]);
        }
    }
}

template <typename Partial, typename Out, int kVec, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) merge_attention_states_kernel(const MergeParams params) {
    const int lane = threadIdx.x % 32;
    const index_t rows = params.size.seqlen_q;
    const index_t row_index = static_cast<index_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row_index >= params.size.batch * params.size.nheads * rows) {
        return;
    }
    const index_t row = row_index % rows;
    const index_t head = row_index / rows % params.size.nheads;
    const index_t batch = row_index / rows / params.size.nheads;
    const int head_dim = params.size.head_dim_int();
    const int num_states = static_cast<int>(params.num_states);

    const float* lse_in = params.partial_lse + batch * params.partial_lse_batch_stride +
                          head * params.partial_lse_head_stride + row * params.partial_lse_row_stride;
    float max_lse = negative_infinity();
    for (int s = 0; s < num_states; ++s) {
        max_lse = fmaxf(max_lse, lse_in[s * params.partial_lse_state_stride]);
    }
    const bool seen = max_lse != negative_infinity();
    float sum = 0.0f;
    if (seen) {
        for (int s = 0; s < num_states; ++s) {
            sum += __expf(lse_in[s * params.partial_lse_state_stride] - max_lse);
        }
    }
    if (lane == 0) {
        params.lse[batch * params.lse_batch_stride + head * params.lse_head_stride + row * params.lse_row_stride] =
            seen ? max_lse + logf(sum) : negative_infinity();
    }
    const float inv_sum = seen ? 1.0f / sum : 0.0f;

    const Partial* in = params.partial.row_ptr<const Partial>(batch, head, row);
    Out* out = params.out.row_ptr<Out>(batch, head, row);
    for (int col = lane * kVec; col < head_dim; col += 32 * kVec) {
        float acc[kVec] = {};
        for (int s = 0; s < num_states && seen; ++s) {
            const float lse_s = lse_in[s * params.partial_lse_state_stride];
            if (lse_s == negative_infinity()) {
                continue;  // weight 0; its output is not read (see above)
            }
            const float weight = __expf(lse_s - max_lse) * inv_sum;
            float value[kVec];
            load_as_float<kVec>(in + s * params.partial_state_stride + col, value);
#pragma unroll
            for (int i = 0; i < kVec; ++i) {
                acc[i] += weight * value[i];
            }
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            out[col + i] = from_float<Out>(acc[i]);
        }
    }
}

}  // namespace cuflash
