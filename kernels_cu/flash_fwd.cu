// FlashAttention-2 forward pass.
//
// One thread block per (query block, head, batch). The block's kBlockM query
// rows stay in shared memory while K/V tiles of kBlockN keys stream through
// shared memory; an online softmax per row keeps the running max and sum, the
// output accumulator lives in registers, and the output is normalised once at
// the end, when the log-sum-exp is written too. Nothing of size
// seqlen_q x seqlen_k exists anywhere: one kBlockM x kBlockN probability tile
// in shared memory is all.
//
// Template parameters are the compile-time choices of cuflash/_kernel_families.py:
// element type, padded head dim, tile sizes, warps, the mask and the score
// transform.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "simt_traits.cuh"
#include "tile_copy.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "online_softmax.cuh"
#include "tile_math.cuh"

namespace cuflash {

template <typename Element, int kHeadDimPadded, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch>
__global__ void __launch_bounds__(kWarps * 32)
flash_forward_kernel(const ForwardParams params) {
    using Traits = SimtTraits<Element, kHeadDimPadded, kBlockM, kBlockN, kWarps>;
    using Smem = ForwardSmem<Traits>;
    constexpr int kLanesPerRow = Traits::kLanesPerRow;
    constexpr int kStride = Traits::kStride;

    require_shared_memory<Smem>();
    const auto [q_tile, k_tile, v_tile, p_tile] = Smem::tiles();

    const QueryBlock block = query_block<Batch, false>(params.size, params.num_m_blocks, kBlockM);
    const index_t head = block.head;
    const BlockContext<Mask, Score> ctx(params, block);
    // A packed batch's grid covers its longest sequence; the blocks past a
    // shorter one's end have no rows.
    if (Batch::kPacked && block.m_start >= ctx.seqlen_q) {
        return;
    }

    const int thread = threadIdx.x;
    const int row_in_block = thread / kLanesPerRow;
    const int lane_in_row = thread % kLanesPerRow;
    const int m_start = block.m_start;
    const int row = m_start + row_in_block;

    const Element* q = block.query_row<const Element>(params.q, head, m_start);
    const Element* k = block.key_row<const Element>(params.k, block.kv_head, 0);
    const Element* v = block.key_row<const Element>(params.v, block.kv_head, 0);

    load_tile_zero_padded<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(
        q_tile, q, params.q.row_stride, ctx.seqlen_q - m_start, ctx.head_dim, thread);

    float acc[Smem::kColsPerLane];
#pragma unroll
    for (int i = 0; i < Smem::kColsPerLane; ++i) {
        acc[i] = 0.0f;
    }
    OnlineSoftmax<kLanesPerRow> softmax;
    softmax.init();

    const BlockRange key_range = ctx.mask.key_blocks(m_start, kBlockM, kBlockN);
    const Element* q_row = q_tile + row_in_block * kStride;
    float* p_row = p_tile + row_in_block * Traits::ScoreTile::kStride;

    for (int n_block = key_range.begin; n_block < key_range.end; ++n_block) {
        const int n_start = n_block * kBlockN;
        // Every warp has finished reading the previous K/V tile (and, on the
        // first pass, the Q tile is complete once the barrier below passes).
        __syncthreads();
        const index_t key_offset = static_cast<index_t>(n_start);
        load_tile_pair_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
            k_tile, k + key_offset * params.k.row_stride, params.k.row_stride, v_tile,
            v + key_offset * params.v.row_stride, params.v.row_stride, ctx.seqlen_k - n_start, ctx.head_dim, thread);
        __syncthreads();

        // S = Q K^T for this lane's keys lane_in_row + j * kLanesPerRow, in the log2 domain.
        float scores[Smem::kKeysPerLane];
        dot_with_tile_rows<Smem::kKeysPerLane, kLanesPerRow, kHeadDimPadded, kStride>(q_row, k_tile, lane_in_row,
                                                                                     scores);
#pragma unroll
        for (int j = 0; j < Smem::kKeysPerLane; ++j) {
            const int key = n_start + lane_in_row + j * kLanesPerRow;
            scores[j] = key_visible(ctx.mask, row, key)
                            ? transformed_score(ctx.score, scores[j], row, key) * ctx.scale_log2
                            : negative_infinity();
        }

        const float rescale = softmax.update(scores);
#pragma unroll
        for (int j = 0; j < Smem::kKeysPerLane; ++j) {
            const int key = n_start + lane_in_row + j * kLanesPerRow;
            p_row[lane_in_row + j * kLanesPerRow] = scores[j] * dropout_factor(ctx.score, row, key);
        }
        // A row's probabilities are written and read only by the lanes of
        // that row, which share a warp.
        __syncwarp();

        // O = O * rescale + P V for this lane's columns.
#pragma unroll
        for (int i = 0; i < Smem::kColsPerLane; ++i) {
            acc[i] *= rescale;
        }
        accumulate_weighted_rows<Smem::kColsPerLane, kLanesPerRow, kBlockN, kStride>(acc, p_row, 1, v_tile,
                                                                                    lane_in_row);
    }

    const float row_sum = softmax.row_sum();
    // A row that saw no key has row_sum == 0; its output is defined as 0
    // rather than 0 / 0.
    const float inv_sum = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    if (lane_in_row == 0 && row < ctx.seqlen_q) {
        params.lse_row(block.tensor_batch, head)[block.q_row0 + row] = softmax.log_sum_exp(row_sum);
    }
    // Stage the normalised output in the Q tile, free once every warp is
    // past its last read of it, and store it coalesced.
    __syncthreads();
    stage_row<Smem::kColsPerLane, kLanesPerRow>(q_tile + row_in_block * kStride, acc, inv_sum, lane_in_row);
    __syncthreads();
    store_tile<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(block.query_row<Element>(params.out, head, m_start),
                                                                   params.out.row_stride, q_tile,
                                                                   ctx.seqlen_q - m_start, ctx.head_dim, thread);
}

}  // namespace cuflash
