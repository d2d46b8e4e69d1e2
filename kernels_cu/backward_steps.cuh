// What the tensor-core backward kernels (flash_bwd_wgmma.cu on Hopper,
// flash_bwd_mma.cu on sm_80+) do around their products, in their common
// transposed form (a warp's accumulator rows are keys, its columns queries):
// the walk over query blocks, the row statistics of a query block, and P^T
// and dS^T from S^T and dP^T.
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "probability.cuh"

namespace cuflash {

// The steps of one key block: every visible query block of every query head
// sharing its K/V head, head by head, advanced without divisions. Ordered dQ
// under a mask whose later rows see more keys (causal) walks each head's
// blocks last to first: every key block then starts on the same (last) query
// block and runs one step behind the previous key block; first to last, key
// block j would start on the block where key block j - 1 takes its second
// step, waiting two steps per key block down the chain.
template <bool kLastToFirst>
struct QueryBlockWalk {
    int first, last;  // the first and last query block of each head, in walking order
    int steps;
    index_t head;
    int m_block;

    template <typename Mask>
    __device__ __forceinline__ QueryBlockWalk(const Mask& mask, const KeyBlock& block, int block_n, int block_m,
                                              int num_m_blocks) {
        const BlockRange range = mask.query_blocks(block.n_start, block_n, block_m, num_m_blocks);
        const int per_head = max(0, range.end - range.begin);
        first = kLastToFirst ? range.begin + per_head - 1 : range.begin;
        last = kLastToFirst ? range.begin : range.begin + per_head - 1;
        steps = static_cast<int>(block.group) * per_head;
        head = block.first_head;
        m_block = first;
    }

    // The head and query block of the step after this one.
    __device__ __forceinline__ void following(index_t& next_head, int& next_m_block) const {
        next_head = head;
        next_m_block = kLastToFirst ? m_block - 1 : m_block + 1;
        if (m_block == last) {
            next_m_block = first;
            ++next_head;
        }
    }
};

// LSE (in the log2 domain) and delta of the kBlockM query rows from m_start
// of `head` into stats[0, kBlockM) and stats[kBlockM, 2 kBlockM), by plain
// stores; rows past seqlen_q get 0 (they are masked).
template <int kBlockM, int kThreads>
__device__ __forceinline__ void load_row_statistics(float* stats, const BackwardParams& params, index_t batch,
                                                    index_t head, int m_start, int seqlen_q, int thread) {
    const float* lse_row = params.lse_row(batch, head);
    const float* delta_row = params.delta_row(batch, head);
    for (int i = thread; i < kBlockM; i += kThreads) {
        const int row = m_start + i;
        const bool valid = row < seqlen_q;
        const float lse = valid ? lse_row[row] : 0.0f;
        // A row that sees no key (LSE -inf) has every score masked to -inf;
        // a finite stand-in keeps exp2(-inf - lse) = 0 instead of NaN.
        stats[i] = lse == negative_infinity() ? 0.0f : lse * kLog2e;
        stats[kBlockM + i] = valid ? delta_row[row] : 0.0f;
    }
}

// P^T and dS^T in place of one warp's S^T and dP^T: 16 keys from key0 (in
// the sequence) by kQTiles n8 tiles of queries from m_start + query0 (query0
// inside the block of kBlockM rows from m_start; the block's keys start at
// n_start). `stats` holds the block's LSE (log2) and delta
// (load_row_statistics). S^T gets the score transform, then the mask, but
// only in blocks that cross the causal diagonal or the end of either
// sequence (scores to -inf, so P^T = 0 there); dS^T = P^T (dP^T - delta)
// times the transform's derivative.
template <int kBlockM, int kBlockN, typename Mask, typename Score, int kQTiles>
__device__ __forceinline__ void transposed_probabilities_and_gradients(const BlockContext<Mask, Score>& ctx,
                                                                       float (&s)[1][kQTiles][4],
                                                                       float (&dp)[1][kQTiles][4], const float* stats,
                                                                       int m_start, int query0, int n_start, int key0,
                                                                       int lane) {
    apply_score_transform_transposed(ctx.score, s, key0, m_start + query0, lane);
    if (m_start + kBlockM > ctx.seqlen_q || key_block_needs_mask(ctx.mask, m_start, kBlockM, n_start, kBlockN)) {
        apply_mask_to_transposed_fragments(ctx.mask, s, key0, m_start + query0, lane);
    }
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
        const int col = query0 + 8 * j + 2 * (lane % 4);  // query row inside the block, and col + 1
        const float2 lse_pair = *reinterpret_cast<const float2*>(stats + col);
        const float2 delta_pair = *reinterpret_cast<const float2*>(stats + kBlockM + col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            // Masked scores are -inf: P^T = 0 there (recompute_probability's
            // explicit zero is not needed on this path).
            const float transformed = s[0][j][e];
            const float p = exp2_fast(fmaf(transformed, ctx.scale_log2, -(e % 2 ? lse_pair.y : lse_pair.x)));
            s[0][j][e] = p;
            dp[0][j][e] = score_gradient(ctx.score, p, dp[0][j][e], e % 2 ? delta_pair.y : delta_pair.x, transformed,
                                         m_start + col + e % 2, key0 + lane / 4 + (e / 2) * 8);
        }
    }
}

}  // namespace cuflash
