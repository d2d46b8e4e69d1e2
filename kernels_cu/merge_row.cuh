// One row's merge of partial attention results (see merge_states.cu for
// the arithmetic): the standalone merge kernel's body, and split-KV's merge
// by the last of a query block's splits to finish (flash_fwd_mma.cu).
#pragma once

#include "numeric.cuh"
#include "warp_reduce.cuh"

namespace cuflash {

// kVec elements of `Partial` at `src` (aligned to kVec elements), as
// floats: one 16-byte load for four float32 values. float32 partials are
// read through L2 only (ld.global.cg): split-KV's are written by other
// blocks of the running kernel, and this SM's L1 may hold the same
// addresses from an earlier call.
template <int kVec, typename Partial>
__device__ __forceinline__ void load_as_float(const Partial* src, float (&dst)[kVec]) {
    if constexpr (kVec == 4 && sizeof(Partial) == 4) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(src));
        dst[0] = v.x, dst[1] = v.y, dst[2] = v.z, dst[3] = v.w;
    } else if constexpr (sizeof(Partial) == 4) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            dst[i] = __ldcg(src + i);
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
// are merged: each lane holds the log-sum-exp of one state of every 32
// (read once; warp reductions give the maximum and the sum), and the output
// loop issues kStatesInFlight states' reads before it adds any, each
// state's weight broadcast from its lane by a shuffle.

// One warp (every lane calls it) merges one row: num_states states whose
// log-sum-exps are lse_in[s * lse_state_stride] and outputs in[s *
// state_stride + column], into out[column] (head_dim columns, kVec per lane
// a step; each state's row aligned to kVec elements and readable up to
// head_dim rounded up to kVec) and *lse_out (written by lane 0).
template <int kVec, int kStatesInFlight, typename Partial, typename Out>
__device__ __forceinline__ void merge_row(const float* lse_in, index_t lse_state_stride, const Partial* in,
                                          index_t state_stride, int num_states, int head_dim, Out* out,
                                          float* lse_out, int lane) {
    const auto state_lse = [&](int state) {
        return state < num_states ? __ldcg(lse_in + state * lse_state_stride) : negative_infinity();
    };
    // States lane, lane + 32, ...: the first in a register (decoding's
    // splits are mostly at most 32), the others read again where needed.
    const float first_lse = state_lse(lane);
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
        *lse_out = seen ? max_lse + logf(sum) : negative_infinity();
    }
    const float inv_sum = seen ? 1.0f / sum : 0.0f;

    // Column steps are warp-uniform (every lane takes the shuffles); lanes
    // past the head dim write nothing.
    for (int step = 0; step < head_dim; step += 32 * kVec) {
        const int col = step + lane * kVec;
        const bool has_columns = col < head_dim;
        float acc[kVec] = {};
        for (int first = 0; first < num_states && seen; first += 32) {
            // This lane's weight of state first + lane (0: never read, see above).
            const float own_weight = weight_of(first == 0 ? first_lse : state_lse(first + lane)) * inv_sum;
            const int count = min(32, num_states - first);
            for (int group = 0; group < count; group += kStatesInFlight) {
                float weight[kStatesInFlight];
                float value[kStatesInFlight][kVec];
#pragma unroll
                for (int j = 0; j < kStatesInFlight; ++j) {
                    const int state = group + j;
                    // Every read is issued (one past the states or columns
                    // reads state `first`'s column 0, inside the buffer) and
                    // used only where its weight is not 0.
                    const bool used = state < count && has_columns;
                    weight[j] = __shfl_sync(0xffffffffu, own_weight, state & 31);
                    weight[j] = used ? weight[j] : 0.0f;
                    load_as_float<kVec>(
                        in + (first + (used ? state : 0)) * state_stride + (used ? col : 0), value[j]);
                }
#pragma unroll
                for (int j = 0; j < kStatesInFlight; ++j) {
#pragma unroll
                    for (int i = 0; i < kVec; ++i) {
                        // Not weight * value alone: 0 * NaN (an unread state's) is NaN.
                        acc[i] += weight[j] != 0.0f ? weight[j] * value[j][i] : 0.0f;
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            if (col + i < head_dim) {
                out[col + i] = from_float<Out>(acc[i]);
            }
        }
    }
}

}  // namespace cuflash
