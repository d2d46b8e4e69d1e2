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
// One warp per row (merge_row.cuh).
#include "numeric.cuh"
#include "params.cuh"
#include "merge_row.cuh"

namespace cuflash {

template <typename Partial, typename Out, int kVec, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) merge_attention_states_kernel(const MergeParams params) {
    const index_t rows = params.size.seqlen_q;
    const index_t row_index = static_cast<index_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row_index >= params.size.batch * params.size.nheads * rows) {
        return;  // a whole warp: merge_row's shuffles stay full-warp
    }
    const index_t row = row_index % rows;
    const index_t head = row_index / rows % params.size.nheads;
    const index_t batch = row_index / rows / params.size.nheads;
    merge_row<kVec, 16>(params.partial_lse + batch * params.partial_lse_batch_stride +
                        head * params.partial_lse_head_stride + row * params.partial_lse_row_stride,
                    params.partial_lse_state_stride, params.partial.row_ptr<const Partial>(batch, head, row),
                    params.partial_state_stride, static_cast<int>(params.num_states), params.size.head_dim_int(),
                    params.out.row_ptr<Out>(batch, head, row),
                    params.lse + batch * params.lse_batch_stride + head * params.lse_head_stride +
                        row * params.lse_row_stride,
                    threadIdx.x % 32);
}

}  // namespace cuflash
