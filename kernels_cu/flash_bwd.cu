// FlashAttention-2 backward pass, by recomputation from the saved log-sum-exp.
//
// Given dO, the forward's O and its LSE:
//   preprocess:  delta_i = rowsum(dO_i * O_i)           (and zero the dQ accumulator;
//                flash_bwd_elementwise.cu)
//   dK/dV:       one thread block per key block j, K_j and V_j on chip, walking
//                every query block i of every query head sharing this K/V head:
//                  P_ij  = exp(scale * Q_i K_j^T - LSE_i)   (recomputed, never stored)
//                  dV_j += P_ij^T dO_i
//                  dP_ij = dO_i V_j^T
//                  dS_ij = P_ij * (dP_ij - delta_i)
//                  dK_j += scale * dS_ij^T Q_i
//                  dQ_i += scale * dS_ij K_j     (float32 atomics, default mode)
//   dQ (deterministic mode): one thread block per query block, the same
//                recomputation over key blocks, dQ_i summed in a fixed order.
//   convert:     float32 dQ accumulator -> dq in the input dtype (flash_bwd_elementwise.cu).
// With a score transform, dS is further multiplied by its derivative (score_gradient).
// Nothing of size seqlen_q x seqlen_k exists: one tile of P and one of dS per block.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "simt_traits.cuh"
#include "tile_copy.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "probability.cuh"
#include "tile_math.cuh"

namespace cuflash {

// Loads LSE (converted to the log2 domain) and delta of the query rows
// [m_start, m_start + kRows) of `head` of the sequence at `rows` into shared
// memory; rows past its seqlen_q get 0 and are masked out by the caller.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_row_stats(float* lse_log2, float* delta, const BackwardParams& params,
                                               const SequenceRows& rows, index_t head, int m_start, int thread) {
    const float* lse_row = params.lse_row(rows.tensor_batch, head) + rows.q_row0;
    const float* delta_row = params.delta_row(rows.tensor_batch, head) + rows.q_row0;
    for (int i = thread; i < kRows; i += kThreads) {
        const int row = m_start + i;
        const bool valid = row < rows.seqlen_q;
        lse_log2[i] = valid ? lse_row[row] * kLog2e : 0.0f;
        delta[i] = valid ? delta_row[row] : 0.0f;
    }
}

template <typename Element, int kHeadDimPadded, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, bool kAccumulateDq>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_dkdv_kernel(const BackwardParams params) {
    using Traits = SimtTraits<Element, kHeadDimPadded, kBlockM, kBlockN, kWarps>;
    using Smem = BackwardDkDvSmem<Traits>;
    constexpr int kLanesPerKey = Traits::kLanesPerKey;
    constexpr int kStride = Traits::kStride;
    constexpr int kScoreStride = Traits::ScoreTileT::kStride;

    require_shared_memory<Smem>();
    const auto [k_tile, v_tile, q_tile, do_tile, pt_tile, dst_tile, lse_tile, delta_tile] = Smem::tiles();

    const KeyBlock block = key_block<Batch>(params.size, params.num_n_blocks, kBlockN);
    const BlockContext<Mask, Score> ctx(params, block);
    // A packed batch's grid covers its longest sequence; the blocks past a
    // shorter one's end have no keys.
    if (Batch::kPacked && block.n_start >= ctx.seqlen_k) {
        return;
    }
    const float scale = params.softmax_scale;

    const int thread = threadIdx.x;
    const int key_in_block = thread / kLanesPerKey;
    const int lane = thread % kLanesPerKey;
    const int n_start = block.n_start;
    const int key = n_start + key_in_block;

    load_tile_pair_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
        k_tile, block.key_row<const Element>(params.k, block.kv_head, n_start), params.k.row_stride, v_tile,
        block.key_row<const Element>(params.v, block.kv_head, n_start), params.v.row_stride,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);

    float dk[Smem::kColsPerLane];
    float dv[Smem::kColsPerLane];
#pragma unroll
    for (int i = 0; i < Smem::kColsPerLane; ++i) {
        dk[i] = 0.0f;
        dv[i] = 0.0f;
    }

    const BlockRange query_range = ctx.mask.query_blocks(n_start, kBlockN, kBlockM);
    const Element* k_row = k_tile + key_in_block * kStride;
    const Element* v_row = v_tile + key_in_block * kStride;
    float* pt_row = pt_tile + key_in_block * kScoreStride;
    float* dst_row = dst_tile + key_in_block * kScoreStride;

    // dK and dV of a shared K/V head are sums over the query heads of its group.
    for (index_t head = block.first_head; head < block.first_head + block.group; ++head) {
        const Score score = ctx.score_of_head(params, block.batch, head);
        const Mask mask = ctx.mask_of_head(head);
        for (int m_block = query_range.begin; m_block < query_range.end; ++m_block) {
            const int m_start = m_block * kBlockM;
            // The previous Q/dO/statistics tiles are fully consumed (and K/V are
            // loaded, on the first pass, once the barrier below passes).
            __syncthreads();
            load_tile_pair_zero_padded<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(
                q_tile, block.query_row<const Element>(params.q, head, m_start), params.q.row_stride, do_tile,
                block.query_row<const Element>(params.dout, head, m_start), params.dout.row_stride,
                ctx.seqlen_q - m_start, ctx.head_dim, thread);
            load_row_stats<kBlockM, Traits::kThreads>(lse_tile, delta_tile, params, block, head, m_start, thread);
            __syncthreads();

            // This lane's query rows lane + j * kLanesPerKey against its key:
            // S^T = K Q^T and dP^T = V dO^T.
            float qk[Smem::kRowsPerLane];
            float dp[Smem::kRowsPerLane];
            dot_with_tile_rows<Smem::kRowsPerLane, kLanesPerKey, kHeadDimPadded, kStride>(k_row, q_tile, lane, qk);
            dot_with_tile_rows<Smem::kRowsPerLane, kLanesPerKey, kHeadDimPadded, kStride>(v_row, do_tile, lane, dp);
#pragma unroll
            for (int j = 0; j < Smem::kRowsPerLane; ++j) {
                const int r = lane + j * kLanesPerKey;
                const int row = m_start + r;
                const ScoreGradient g = recompute_score_gradient(ctx, mask, score, qk[j], dp[j], row, key,
                                                                 row < ctx.seqlen_q, lse_tile[r], delta_tile[r]);
                pt_row[r] = g.p;
                dst_row[r] = g.ds;
            }
            // A key's P^T and dS^T rows are written and read by that key's
            // lanes only, which share a warp.
            __syncwarp();
            accumulate_weighted_rows<Smem::kColsPerLane, kLanesPerKey, kBlockM, kStride>(dv, pt_row, 1, do_tile, lane);
            accumulate_weighted_rows<Smem::kColsPerLane, kLanesPerKey, kBlockM, kStride>(dk, dst_row, 1, q_tile, lane);

            if constexpr (kAccumulateDq) {
                // dQ_i += scale * dS K_j needs every key's dS column: re-map
                // the threads onto query rows once all of dS^T is written.
                constexpr int kLanesPerRow = Traits::kLanesPerRow;
                __syncthreads();
                const int row_in_block = thread / kLanesPerRow;
                const int row_lane = thread % kLanesPerRow;
                const int row = m_start + row_in_block;
                float dq[Smem::kDqColsPerLane];
#pragma unroll
                for (int i = 0; i < Smem::kDqColsPerLane; ++i) {
                    dq[i] = 0.0f;
                }
                accumulate_weighted_rows<Smem::kDqColsPerLane, kLanesPerRow, kBlockN, kStride>(
                    dq, dst_tile + row_in_block, kScoreStride, k_tile, row_lane);
                if (row < ctx.seqlen_q) {
                    float* acc = params.dq_accum_row(block.tensor_batch, head, block.q_row0 + row, ctx.head_dim);
#pragma unroll
                    for (int i = 0; i < Smem::kDqColsPerLane; ++i) {
                        const int col = row_lane + i * kLanesPerRow;
                        if (col < ctx.head_dim) {
                            atomicAdd(acc + col, dq[i] * scale);
                        }
                    }
                }
            }
        }
    }

    // Stage dK and dV in the K/V tiles, free once every warp is past its
    // last read of them, and store them coalesced.
    __syncthreads();
    stage_row<Smem::kColsPerLane, kLanesPerKey>(k_tile + key_in_block * kStride, dk, scale, lane);
    stage_row<Smem::kColsPerLane, kLanesPerKey>(v_tile + key_in_block * kStride, dv, 1.0f, lane);
    __syncthreads();
    store_tile<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
        block.key_row<Element>(params.dk, block.kv_head, n_start), params.dk.row_stride, k_tile,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);
    store_tile<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
        block.key_row<Element>(params.dv, block.kv_head, n_start), params.dv.row_stride, v_tile,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);
}

// Deterministic dQ: one block per query block sums dS K over the key blocks
// in a fixed order, with no atomics.
template <typename Element, int kHeadDimPadded, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_dq_kernel(const BackwardParams params) {
    using Traits = SimtTraits<Element, kHeadDimPadded, kBlockM, kBlockN, kWarps>;
    using Smem = BackwardDqSmem<Traits>;
    constexpr int kLanesPerRow = Traits::kLanesPerRow;
    constexpr int kStride = Traits::kStride;

    require_shared_memory<Smem>();
    const auto [q_tile, do_tile, k_tile, v_tile, ds_tile] = Smem::tiles();

    const ProblemSize& size = params.size;
    const QueryBlock block = query_block<Batch, false>(size, params.num_m_blocks, kBlockM);
    const index_t head = block.head;
    const BlockContext<Mask, Score> ctx(params, block);
    const index_t kv_head = block.kv_head;
    // A packed batch's grid covers its longest sequence; the blocks past a
    // shorter one's end have no rows.
    if (Batch::kPacked && block.m_start >= ctx.seqlen_q) {
        return;
    }

    const int thread = threadIdx.x;
    const int row_in_block = thread / kLanesPerRow;
    const int lane = thread % kLanesPerRow;
    const int m_start = block.m_start;
    const int row = m_start + row_in_block;

    load_tile_pair_zero_padded<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(
        q_tile, block.query_row<const Element>(params.q, head, m_start), params.q.row_stride, do_tile,
        block.query_row<const Element>(params.dout, head, m_start), params.dout.row_stride, ctx.seqlen_q - m_start,
        ctx.head_dim, thread);
    const bool row_valid = row < ctx.seqlen_q;
    const float lse_log2 =
        row_valid ? params.lse_row(block.tensor_batch, head)[block.q_row0 + row] * kLog2e : 0.0f;
    const float delta = row_valid ? params.delta_row(block.tensor_batch, head)[block.q_row0 + row] : 0.0f;

    float dq[Smem::kColsPerLane];
#pragma unroll
    for (int i = 0; i < Smem::kColsPerLane; ++i) {
        dq[i] = 0.0f;
    }
    const BlockRange key_range = ctx.mask.key_blocks(m_start, kBlockM, kBlockN);
    const Element* q_row = q_tile + row_in_block * kStride;
    const Element* do_row = do_tile + row_in_block * kStride;
    float* ds_row = ds_tile + row_in_block * Traits::ScoreTile::kStride;

    for (int n_block = key_range.begin; n_block < key_range.end; ++n_block) {
        const int n_start = n_block * kBlockN;
        __syncthreads();  // previous K/V consumed; Q/dO complete on the first pass after the next barrier
        load_tile_pair_zero_padded<kBlockN, kHeadDimPadded, kStride, Traits::kThreads>(
            k_tile, block.key_row<const Element>(params.k, kv_head, n_start), params.k.row_stride, v_tile,
            block.key_row<const Element>(params.v, kv_head, n_start), params.v.row_stride,
            ctx.seqlen_k - n_start, ctx.head_dim, thread);
        __syncthreads();

        float qk[Smem::kKeysPerLane];
        float dp[Smem::kKeysPerLane];
        dot_with_tile_rows<Smem::kKeysPerLane, kLanesPerRow, kHeadDimPadded, kStride>(q_row, k_tile, lane, qk);
        dot_with_tile_rows<Smem::kKeysPerLane, kLanesPerRow, kHeadDimPadded, kStride>(do_row, v_tile, lane, dp);
#pragma unroll
        for (int j = 0; j < Smem::kKeysPerLane; ++j) {
            const int key_in_block = lane + j * kLanesPerRow;
            const ScoreGradient g =
                recompute_score_gradient(ctx, ctx.mask, ctx.score, qk[j], dp[j], row, n_start + key_in_block, row_valid,
                                         lse_log2, delta);
            ds_row[key_in_block] = g.ds;
        }
        __syncwarp();  // a row's dS is written and read by that row's lanes only
        accumulate_weighted_rows<Smem::kColsPerLane, kLanesPerRow, kBlockN, kStride>(dq, ds_row, 1, k_tile, lane);
    }

    // Stage dQ in the Q tile and store it coalesced.
    __syncthreads();
    stage_row<Smem::kColsPerLane, kLanesPerRow>(q_tile + row_in_block * kStride, dq,
                                                params.softmax_scale, lane);
    __syncthreads();
    store_tile<kBlockM, kHeadDimPadded, kStride, Traits::kThreads>(block.query_row<Element>(params.dq, head, m_start),
                                                                   params.dq.row_stride, q_tile, ctx.seqlen_q - m_start,
                                                                   ctx.head_dim, thread);
}

}  // namespace cuflash
