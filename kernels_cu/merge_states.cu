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
//
// After split-KV's forward the merge is launched as a dependent kernel
// (grid_dependency.cuh): scheduled once the forward's blocks have exited,
// its blocks wait for the forward's partial results before reading any. Neither
// lets the kernel after it start earlier: with the forward allowing it at
// its start (the merge's blocks placed beside the forward's), a call of
// 1 x 16384 keys over 4 K/V heads took 15.5 us against 14.6 without; with
// the merge allowing it, the next call's forward was placed beside this
// one's (up to 1.4 us slower).
#include "grid_dependency.cuh"
#include "numeric.cuh"
#include "params.cuh"
#include "warp_reduce.cuh"

namespace cuflash {

// The type of one 8- or 16-byte load.
template <int kBytes>
struct LoadChunk;
template <>
struct LoadChunk<8> {
    using Type = uint2;
};
template <>
struct LoadChunk<16> {
    using Type = uint4;
};

// kVec elements of `Partial` at `src` (aligned to kVec elements), as
// floats, in one load where kVec elements make 8 or 16 bytes (four float32,
// four or eight 16-bit values), else one at a time.
template <int kVec, typename Partial>
__device__ __forceinline__ void load_as_float(const Partial* src, float (&dst)[kVec]) {
    constexpr int kBytes = kVec * static_cast<int>(sizeof(Partial));
    if constexpr (kVec > 1 && (kBytes == 8 || kBytes == 16)) {
        using Chunk = typename LoadChunk<kBytes>::Type;
        const Chunk chunk = *reinterpret_cast<const Chunk*>(src);
        const Partial* elements = reinterpret_cast<const Partial*>(&chunk);
#pragma unroll
        for (int i = 0; i < kVec; i += 2) {
            const float2 pair = load_pair(elements + i);
            dst[i] = pair.x, dst[i + 1] = pair.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            dst[i] = to_float(src[i]);
        }
    }
}

// The merge is a chain of dependent memory reads (the log-sum-exps, then
// every state's output), so latency, not bytes, is its cost at decoding's
// sizes, and split-KV's partial results may have left L2 by the time they
// are merged. Each lane holds the log-sum-exp of one state of every 32
// (warp reductions give the maximum and the sum), and the reads of up to
// 32 states' columns are issued before anything is computed from them,
// the first 32 together with the log-sum-exps: decoding's usual 32 or
// fewer states cost one round trip, not three. Each state's weight is
// broadcast from its lane by a shuffle. Every one of kStatesInFlight
// reads is issued whether or not its state exists (unused ones read state
// 0 again), so few states (a ring's, a prefix cache's) take a variant
// with fewer in flight: 32 reads for two states would cost a large merge
// most of its bandwidth in issued instructions.
template <typename Partial, typename Out, int kVec, int kWarps, int kStatesInFlight>
__global__ void __launch_bounds__(kWarps * 32) merge_attention_states_kernel(const MergeParams params) {
    static_assert(kStatesInFlight >= 1 && kStatesInFlight <= 32, "a state's weight lives in one lane of the warp");
    wait_for_prerequisite_grids();
    const int lane = threadIdx.x % 32;
    const index_t rows = params.size.seqlen_q;
    const index_t row_index = static_cast<index_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row_index >= params.size.batch * params.size.nheads * rows) {
        return;  // a whole warp: the shuffles below stay full-warp
    }
    const index_t row = row_index % rows;
    const index_t head = row_index / rows % params.size.nheads;
    const index_t batch = row_index / rows / params.size.nheads;
    const int head_dim = params.size.head_dim_int();
    const int num_states = static_cast<int>(params.num_states);

    const float* lse_in = params.partial_lse + batch * params.partial_lse_batch_stride +
                          head * params.partial_lse_head_stride + row * params.partial_lse_row_stride;
    const auto state_lse = [&](int state) {
        return state < num_states ? lse_in[state * params.partial_lse_state_stride] : negative_infinity();
    };
    const Partial* in = params.partial.row_ptr<const Partial>(batch, head, row);
    Out* out = params.out.row_ptr<Out>(batch, head, row);
    // kStatesInFlight states' kVec columns from col (states first...): every
    // read is issued (one past the states or columns reads state 0's column
    // 0, inside the buffer) and weighed 0 where unused.
    float value[kStatesInFlight][kVec];
    const auto load_states = [&](int first, int col) {
#pragma unroll
        for (int j = 0; j < kStatesInFlight; ++j) {
            const bool used = first + j < num_states && col < head_dim;
            load_as_float<kVec>(in + (used ? (first + j) * params.partial_state_stride + col : 0), value[j]);
        }
    };
    // States lane, lane + 32, ...: the first in a register (decoding's
    // splits are mostly at most 32), the others read again where needed.
    const float first_lse = state_lse(lane);
    load_states(0, lane * kVec);
    float max_lse = first_lse;
    for (int s = lane + 32; s < num_states; s += 32) {
        max_lse = fmaxf(max_lse, state_lse(s));
    }
    max_lse = group_allreduce_max<32>(max_lse);
    const bool seen = max_lse != negative_infinity();
    // A state that saw no key (-inf) weighs exp(-inf) = 0; none at all: 0 everywhere.
    const auto weight_of = [&](float lse) { return seen ? __expf(lse - max_lse) : 0.0f; };
    float sum = weight_of(first_lse);
    for (int s = lane + 32; s < num_states; s += 32) {
        sum += weight_of(state_lse(s));
    }
    sum = group_allreduce_sum<32>(sum);
    if (lane == 0) {
        params.lse[batch * params.lse_batch_stride + head * params.lse_head_stride + row * params.lse_row_stride] =
            seen ? max_lse + logf(sum) : negative_infinity();
    }
    const float inv_sum = seen ? 1.0f / sum : 0.0f;

    // Column steps are warp-uniform (every lane takes the shuffles); lanes
    // past the head dim write nothing.
    for (int step = 0; step < head_dim; step += 32 * kVec) {
        const int col = step + lane * kVec;
        const bool has_columns = col < head_dim;
        float acc[kVec] = {};
        for (int first = 0; first < num_states; first += kStatesInFlight) {
            if (step > 0 || first > 0) {
                load_states(first, col);
            }
            // This lane's weight of state first + lane (0 past the states, or where none was seen).
            const float own_weight = weight_of(first == 0 ? first_lse : state_lse(first + lane)) * inv_sum;
#pragma unroll
            for (int j = 0; j < kStatesInFlight; ++j) {
                const float shared_weight = __shfl_sync(0xffffffffu, own_weight, j);  // every lane shuffles
                const float weight = first + j < num_states && has_columns ? shared_weight : 0.0f;
#pragma unroll
                for (int i = 0; i < kVec; ++i) {
                    // Not weight * value alone: 0 * NaN (an unread state's) is NaN.
                    acc[i] += weight != 0.0f ? weight * value[j][i] : 0.0f;
                }
            }
        }
        if (has_columns) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) {
                out[col + i] = from_float<Out>(acc[i]);
            }
        }
    }
}

}  // namespace cuflash
