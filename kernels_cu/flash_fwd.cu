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
#include "kernel_traits.cuh"
#include "tile_copy.cuh"
#include "masking.cuh"
#include "online_softmax.cuh"

namespace cuflash {

template <typename Element, int kHeadDimPadded, int kBlockM, int kBlockN, int kWarps, bool kIsCausal>
__global__ void __launch_bounds__(kWarps * 32)
flash_forward_kernel(const ForwardParams params) {
    using Traits = KernelTraits<Element, kHeadDimPadded, kBlockM, kBlockN, kWarps>;
    constexpr int kThreadsPerRow = Traits::kThreadsPerRow;
    constexpr int kStride = Traits::kSmemRowStride;
    constexpr int kScoreStride = Traits::kScoreRowStride;

    require_shared_memory<Traits>();
    extern __shared__ __align__(16) unsigned char shared_memory[];
    Element* q_tile = reinterpret_cast<Element*>(shared_memory + Traits::kSmemQOffset);
    Element* k_tile = reinterpret_cast<Element*>(shared_memory + Traits::kSmemKOffset);
    Element* v_tile = reinterpret_cast<Element*>(shared_memory + Traits::kSmemVOffset);
    float* p_tile = reinterpret_cast<float*>(shared_memory + Traits::kSmemPOffset);

    // The grid is flattened with the query block fastest, so the blocks of one
    // head run side by side and their K/V reads hit in L2.
    index_t linear_block = blockIdx.x;
    const int m_block = static_cast<int>(linear_block % params.num_m_blocks);
    linear_block /= params.num_m_blocks;
    const index_t head = linear_block % params.nheads;
    const index_t batch = linear_block / params.nheads;
    // Grouped-query attention: nheads / nheads_k consecutive query heads share a K/V head.
    const index_t kv_head = head / (params.nheads / params.nheads_k);

    const int seqlen_q = static_cast<int>(params.seqlen_q);
    const int seqlen_k = static_cast<int>(params.seqlen_k);
    const int head_dim = static_cast<int>(params.head_dim);
    const float scale_log2 = static_cast<float>(params.softmax_scale_log2);

    const int thread = threadIdx.x;
    const int row_in_block = thread / kThreadsPerRow;
    const int lane_in_row = thread % kThreadsPerRow;
    const int m_start = m_block * kBlockM;
    const int row = m_start + row_in_block;

    const Element* q = static_cast<const Element*>(params.q) + batch * params.q_batch_stride +
                       head * params.q_head_stride + static_cast<index_t>(m_start) * params.q_row_stride;
    const Element* k = static_cast<const Element*>(params.k) + batch * params.k_batch_stride +
                       kv_head * params.k_head_stride;
    const Element* v = static_cast<const Element*>(params.v) + batch * params.v_batch_stride +
                       kv_head * params.v_head_stride;

    load_tile_zero_padded<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(
        q_tile, q, params.q_row_stride, seqlen_q - m_start, head_dim, thread);

    float acc[Traits::kColsPerThread];
#pragma unroll
    for (int i = 0; i < Traits::kColsPerThread; ++i) {
        acc[i] = 0.0f;
    }
    OnlineSoftmax<kThreadsPerRow> softmax;
    softmax.init();

    const int diagonal_offset = causal_diagonal_offset(seqlen_q, seqlen_k);
    const int n_blocks = visible_key_blocks<kIsCausal>(m_start, kBlockM, kBlockN, seqlen_q, seqlen_k);
    const Element* q_row = q_tile + row_in_block * kStride;
    float* p_row = p_tile + row_in_block * kScoreStride;

    for (int n_block = 0; n_block < n_blocks; ++n_block) {
        const int n_start = n_block * kBlockN;
        // Every warp has finished reading the previous K/V tile (and, on the
        // first pass, the Q tile is complete once the barrier below passes).
        __syncthreads();
        const index_t key_offset = static_cast<index_t>(n_start);
        load_tile_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
            k_tile, k + key_offset * params.k_row_stride, params.k_row_stride, seqlen_k - n_start, head_dim, thread);
        load_tile_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
            v_tile, v + key_offset * params.v_row_stride, params.v_row_stride, seqlen_k - n_start, head_dim, thread);
        __syncthreads();

        // S = Q K^T for this lane's keys lane_in_row + j * kThreadsPerRow.
        float scores[Traits::kKeysPerThread];
#pragma unroll
        for (int j = 0; j < Traits::kKeysPerThread; ++j) {
            scores[j] = 0.0f;
        }
#pragma unroll 4
        for (int d = 0; d < kHeadDimPadded; ++d) {
            const float q_value = to_float(q_row[d]);
#pragma unroll
            for (int j = 0; j < Traits::kKeysPerThread; ++j) {
                const int key = lane_in_row + j * kThreadsPerRow;
                scores[j] = fmaf(q_value, to_float(k_tile[key * kStride + d]), scores[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < Traits::kKeysPerThread; ++j) {
            const int key = n_start + lane_in_row + j * kThreadsPerRow;
            scores[j] = is_key_visible<kIsCausal>(row, key, seqlen_k, diagonal_offset)
                            ? scores[j] * scale_log2
                            : negative_infinity();
        }

        const float rescale = softmax.update(scores);
#pragma unroll
        for (int j = 0; j < Traits::kKeysPerThread; ++j) {
            p_row[lane_in_row + j * kThreadsPerRow] = scores[j];
        }
        // A row's probabilities are written and read only by the lanes of
        // that row, which share a warp.
        __syncwarp();

        // O = O * rescale + P V for this lane's columns.
#pragma unroll
        for (int i = 0; i < Traits::kColsPerThread; ++i) {
            acc[i] *= rescale;
        }
#pragma unroll 2
        for (int key = 0; key < kBlockN; ++key) {
            const float p = p_row[key];
            const Element* v_row = v_tile + key * kStride + lane_in_row;
#pragma unroll
            for (int i = 0; i < Traits::kColsPerThread; ++i) {
                acc[i] = fmaf(p, to_float(v_row[i * kThreadsPerRow]), acc[i]);
            }
        }
        __syncwarp();
    }

    const float row_sum = softmax.row_sum();
    if (row >= seqlen_q) {
        return;
    }
    // A row that saw no key has row_sum == 0; its output is defined as 0
    // rather than 0 / 0.
    const float inv_sum = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    Element* out = static_cast<Element*>(params.out) + batch * params.out_batch_stride +
                   head * params.out_head_stride + static_cast<index_t>(row) * params.out_row_stride;
#pragma unroll
    for (int i = 0; i < Traits::kColsPerThread; ++i) {
        const int col = lane_in_row + i * kThreadsPerRow;
        if (col < head_dim) {
            out[col] = from_float<Element>(acc[i] * inv_sum);
        }
    }
    if (lane_in_row == 0) {
        params.lse[batch * params.lse_batch_stride + head * params.lse_head_stride + row] =
            softmax.log_sum_exp(row_sum);
    }
}

}  // namespace cuflash
