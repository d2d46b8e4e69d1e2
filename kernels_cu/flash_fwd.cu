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
// Template parameters are the compile-time choices of cuflash/_kernels.py:
// element type, padded head dim, tile sizes, warps and the mask mode.
#include "numeric.cuh"
#include "params.cuh"
#include "grid.cuh"
#include "kernel_traits.cuh"
#include "tile_copy.cuh"
#include "masking.cuh"
#include "online_softmax.cuh"
#include "tile_math.cuh"

namespace cuflash {

template <typename Element, int kHeadDimPadded, int kBlockM, int kBlockN, int kWarps, bool kIsCausal>
__global__ void __launch_bounds__(kWarps * 32)
flash_forward_kernel(const ForwardParams params) {
    using Traits = KernelTraits<Element, kHeadDimPadded, kBlockM, kBlockN, kWarps>;
    using Smem = ForwardSmem<Traits>;
    constexpr int kLanesPerRow = Traits::kLanesPerRow;
    constexpr int kStride = Traits::QTile::kStride;
    static_assert(Traits::KTile::kStride == kStride, "Q and K/V rows share one stride");

    require_shared_memory<Smem>();
    Element* q_tile = shared_tile<Element>(Smem::kQ);
    Element* k_tile = shared_tile<Element>(Smem::kK);
    Element* v_tile = shared_tile<Element>(Smem::kV);
    float* p_tile = shared_tile<float>(Smem::kP);

    const BlockCoordinates block = block_coordinates(params.num_m_blocks, params.size.nheads);
    const int m_block = block.tile;
    const index_t head = block.head;
    const index_t batch = block.batch;
    const index_t kv_head = params.size.kv_head_of(head);

    const int seqlen_q = params.size.seqlen_q_int();
    const int seqlen_k = params.size.seqlen_k_int();
    const int head_dim = params.size.head_dim_int();
    const float scale_log2 = static_cast<float>(params.softmax_scale_log2);

    const int thread = threadIdx.x;
    const int row_in_block = thread / kLanesPerRow;
    const int lane_in_row = thread % kLanesPerRow;
    const int m_start = m_block * kBlockM;
    const int row = m_start + row_in_block;

    const Element* q = params.q.row_ptr<const Element>(batch, head, m_start);
    const Element* k = params.k.row_ptr<const Element>(batch, kv_head, 0);
    const Element* v = params.v.row_ptr<const Element>(batch, kv_head, 0);

    load_tile_zero_padded<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(
        q_tile, q, params.q.row_stride, seqlen_q - m_start, head_dim, thread);

    float acc[Smem::kColsPerLane];
#pragma unroll
    for (int i = 0; i < Smem::kColsPerLane; ++i) {
        acc[i] = 0.0f;
    }
    OnlineSoftmax<kLanesPerRow> softmax;
    softmax.init();

    const int diagonal_offset = causal_diagonal_offset(seqlen_q, seqlen_k);
    const int n_blocks = visible_key_blocks<kIsCausal>(m_start, kBlockM, kBlockN, seqlen_q, seqlen_k);
    const Element* q_row = q_tile + row_in_block * kStride;
    float* p_row = p_tile + row_in_block * Traits::ScoreTile::kStride;

    for (int n_block = 0; n_block < n_blocks; ++n_block) {
        const int n_start = n_block * kBlockN;
        // Every warp has finished reading the previous K/V tile (and, on the
        // first pass, the Q tile is complete once the barrier below passes).
        __syncthreads();
        const index_t key_offset = static_cast<index_t>(n_start);
        load_tile_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
            k_tile, k + key_offset * params.k.row_stride, params.k.row_stride, seqlen_k - n_start, head_dim, thread);
        load_tile_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
            v_tile, v + key_offset * params.v.row_stride, params.v.row_stride, seqlen_k - n_start, head_dim, thread);
        __syncthreads();

        // S = Q K^T for this lane's keys lane_in_row + j * kLanesPerRow, in the log2 domain.
        float scores[Smem::kKeysPerLane];
        dot_with_tile_rows<Smem::kKeysPerLane, kLanesPerRow, kHeadDimPadded, kStride>(q_row, k_tile, lane_in_row,
                                                                                     scores);
#pragma unroll
        for (int j = 0; j < Smem::kKeysPerLane; ++j) {
            const int key = n_start + lane_in_row + j * kLanesPerRow;
            scores[j] = is_key_visible<kIsCausal>(row, key, seqlen_k, diagonal_offset)
                            ? scores[j] * scale_log2
                            : negative_infinity();
        }

        const float rescale = softmax.update(scores);
#pragma unroll
        for (int j = 0; j < Smem::kKeysPerLane; ++j) {
            p_row[lane_in_row + j * kLanesPerRow] = scores[j];
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
    if (lane_in_row == 0 && row < seqlen_q) {
        params.lse[batch * params.lse_batch_stride + head * params.lse_head_stride + row] =
            softmax.log_sum_exp(row_sum);
    }
    // Stage the normalised output in the Q tile, free once every warp is
    // past its last read of it, and store it coalesced.
    __syncthreads();
    stage_row<Smem::kColsPerLane, kLanesPerRow>(q_tile + row_in_block * kStride, acc, inv_sum, lane_in_row);
    __syncthreads();
    store_tile<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(params.out.row_ptr<Element>(batch, head, m_start),
                                                                   params.out.row_stride, q_tile, seqlen_q - m_start,
                                                                   head_dim, thread);
}

}  // namespace cuflash
