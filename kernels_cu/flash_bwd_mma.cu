// FlashAttention backward dK/dV (with atomic or ordered dQ) on the mma.sync
// tensor cores of sm_80 and later (float16, bfloat16): what Ampere and Ada
// GPUs run. The algorithm and the transposed form are flash_bwd_wgmma.cu's:
// one thread block per key block j keeps K_j, V_j and the dK_j, dV_j
// accumulators while it walks every query block i of every query head
// sharing this K/V head. Each warp owns 16 keys (above head dim 128 two
// warps share them; see below); per query block:
//   S^T  = K Q^T, dP^T = V dO^T        A (K, V) and B (Q, dO) by ldmatrix
//   P^T, dS^T                          as in the Hopper kernel (probability.cuh)
//   dV  += P^T dO, dK += dS^T Q        A from registers (the S^T / dP^T
//                                      accumulators packed), B by ldmatrix.trans
//   dQ_i += scale * dS K               dS^T staged in shared memory (A by
//                                      ldmatrix.trans), K as B; float32 atomics,
//                                      or added in a fixed order (ordered dQ)
// Above head dim 128 (MmaBackwardTraits::kSplitHeadDim) the two warps
// sharing 16 keys each compute S^T and dP^T for half of the query block's
// rows and own half of dK's and dV's columns: P^T is staged in shared memory
// next to dS^T, and dV, dK read both A operands from there by ldmatrix.
// Q, dO and their row statistics are double-buffered (kQStages = 2): the next
// query block is copied by cp.async while this one is computed; or, where
// shared memory is short (the largest head dims on an A100, 99 KiB GPUs),
// single-buffered: the next block is copied once every warp is past its last
// read of Q and dO (dK's product), while dQ is computed. dK is scaled once at the
// end. Nothing of size seqlen_q x seqlen_k exists: one dS^T tile per block.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "tensor_core_traits.cuh"
#include "async_copy.cuh"
#include "mma.cuh"
#include "mma_operands.cuh"
#include "backward_steps.cuh"
#include "ordered_accumulation.cuh"

namespace cuflash {

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kQStages, bool kOrderedDq>
__global__ void __launch_bounds__(kWarps * 32)
flash_backward_dkdv_mma_kernel(const BackwardParams params) {
    using Traits = MmaBackwardTraits<Element, kHeadDim, kBlockM, kBlockN, kWarps, kQStages>;
    constexpr int kQTiles = Traits::kQTiles;
    constexpr int kDTiles = Traits::kDTiles;
    constexpr int kDqCols = Traits::kDqCols;
    constexpr int kAccCols = Traits::kAccCols;
    constexpr int kScoreCols = Traits::kScoreCols;
    constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;
    constexpr int kStride = Traits::kStride;
    constexpr int kDsStride = Traits::kDsStride;
    constexpr int kElementBytes = Traits::kElementBytes;

    require_shared_memory<Traits>();
    Element* const k_tile = shared_tile<Element>(Traits::kK);
    Element* const v_tile = shared_tile<Element>(Traits::kV);
    Element* const q_tiles = shared_tile<Element>(Traits::kQ);
    Element* const do_tiles = shared_tile<Element>(Traits::kDo);
    Element* const ds_tile = shared_tile<Element>(Traits::kDs);
    Element* const pt_tile = shared_tile<Element>(Traits::kPt);
    float* const stats = shared_tile<float>(Traits::kStats);

    const KeyBlock block =
        key_block<Batch, kOrderedDq && Mask::kDqTurns == DqTurns::kLastKeyFirst>(params.size, params.num_n_blocks, kBlockN);
    const BlockContext<Mask, Score> ctx(params, block);
    // A packed batch's grid covers its longest sequence; the blocks past a
    // shorter one's end have no keys.
    if (Batch::kPacked && block.n_start >= ctx.seqlen_k) {
        return;
    }
    const float scale = params.softmax_scale;

    const int thread = threadIdx.x;
    const int warp = thread / 32;
    const int lane = thread % 32;
    const int n_start = block.n_start;
    // The warp's 16 accumulator rows (keys) inside the block, its queries of
    // S^T and dP^T inside the query block, and its columns of dK and dV.
    const int dim_group = kSplitHeadDim ? warp / Traits::kKeyTiles : 0;
    const int warp_key0 = (kSplitHeadDim ? warp % Traits::kKeyTiles : warp) * 16;
    const int score_col0 = dim_group * kScoreCols;
    const int acc_col0 = dim_group * kAccCols;

    load_tile_async<kBlockN, kHeadDim, kStride, Traits::kThreads>(
        k_tile, block.key_row<const Element>(params.k, block.kv_head, n_start), params.k.row_stride,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);
    load_tile_async<kBlockN, kHeadDim, kStride, Traits::kThreads>(
        v_tile, block.key_row<const Element>(params.v, block.kv_head, n_start), params.v.row_stride,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);

    // Copies Q, dO (cp.async) and the row statistics of query block m_block
    // of `head` into `buffer`.
    const auto load_query_block = [&](index_t head, int m_block, int buffer) {
        const int m_start = m_block * kBlockM;
        load_tile_async<kBlockM, kHeadDim, kStride, Traits::kThreads>(
            q_tiles + buffer * (Traits::kQTileBytes / kElementBytes),
            block.query_row<const Element>(params.q, head, m_start), params.q.row_stride, ctx.seqlen_q - m_start,
            ctx.head_dim, thread);
        load_tile_async<kBlockM, kHeadDim, kStride, Traits::kThreads>(
            do_tiles + buffer * (Traits::kQTileBytes / kElementBytes),
            block.query_row<const Element>(params.dout, head, m_start), params.dout.row_stride,
            ctx.seqlen_q - m_start, ctx.head_dim, thread);
        load_row_statistics<kBlockM, Traits::kThreads>(stats + buffer * 2 * kBlockM, params, block, head, m_start,
                                                       thread);
    };
    QueryBlockWalk walk(ctx.mask, block, kBlockN, kBlockM, walk_rotation<Mask>(params, block.n_block));
    if (walk.steps > 0) {
        load_query_block(walk.head, walk.m_block, 0);
    }
    cp_async_commit();

    // Per-lane ldmatrix addresses (bytes; mma.cuh has the fragment layouts).
    // A of S^T / dP^T: this warp's 16 rows of K or V, k16 steps along the head dim.
    const u32 key_a_offset = MmaLaneOffsets<kStride, kElementBytes>::a(lane, warp_key0);
    // B of S^T / dP^T: rows of Q or dO (this warp's queries), two n8 tiles per load.
    const u32 row_b_offset = MmaLaneOffsets<kStride, kElementBytes>::b(lane) + score_col0 * kStride * kElementBytes;
    // B of dV / dK / dQ, transposed: rows of dO, Q or K along k, two n8 tiles of the head dim per load.
    const u32 row_bt_offset = MmaLaneOffsets<kStride, kElementBytes>::b_trans(lane);
    // B of dV / dK: this warp's columns of dO and Q.
    const u32 acc_bt_offset = row_bt_offset + acc_col0 * kElementBytes;
    // A of dV / dK where the head dim is split: this warp's 16 rows (keys) of P^T or dS^T, k16 steps of queries.
    const u32 score_a_offset = MmaLaneOffsets<kDsStride, kElementBytes>::a(lane, warp_key0);
    // dQ: this warp's m16 row tile and column group; A = dS from dS^T, transposed.
    const int dq_row0 = warp % Traits::kDqRowTiles * 16;
    const int dq_col0 = warp / Traits::kDqRowTiles * kDqCols;
    const u32 ds_a_address = shared_address(ds_tile) +
        ((lane % 8 + lane / 16 * 8) * kDsStride + dq_row0 + (lane / 8) % 2 * 8) * kElementBytes;
    const u32 k_address = shared_address(k_tile);
    const u32 v_address = shared_address(v_tile);
    const u32 q_address = shared_address(q_tiles);
    const u32 do_address = shared_address(do_tiles);

    float dk[1][kDTiles][4];
    float dv[1][kDTiles][4];
    fill_fragments(dk, 0.0f);
    fill_fragments(dv, 0.0f);
    // Ordered dQ: the dQ block whose turn this block holds until it hands
    // it on, once the next step's S^T and dP^T are computed (the barrier at
    // the top of that step orders every thread's additions before thread
    // 0's release; its fence then waits on additions long since landed).
    HeldTurn held;
    for (int step = 0; step < walk.steps; ++step) {
        const int buffer = kQStages == 2 ? step & 1 : 0;
        // This step's Q, dO and statistics have landed for every thread;
        // every warp is done with the previous step (its buffers and dS^T).
        cp_async_wait<0>();
        __syncthreads();
        index_t next_head;
        int next_m_block;
        walk.following(next_head, next_m_block);
        const auto load_next_query_block = [&]() {
            if (step + 1 < walk.steps) {
                load_query_block(next_head, next_m_block, kQStages == 2 ? buffer ^ 1 : 0);
            }
            cp_async_commit();
        };
        if constexpr (kQStages == 2) {
            load_next_query_block();
        }
        const index_t head = walk.head;
        const int m_block = walk.m_block;
        const int m_start = m_block * kBlockM;
        const u32 buffer_offset = buffer * Traits::kQTileBytes;
        // Ordered dQ: this key block's turn in the dQ block's additions,
        // worked out while the mask's lengths are live anyway (one value
        // kept to the wait instead of three), by thread 0 alone, which polls
        // (the d96 and d128 causal variants spilled otherwise).
        const int turn =
            kOrderedDq && thread == 0 ? dq_turn(ctx.mask, params, head, m_block, block.n_block, kBlockM, kBlockN) : 0;

        // S^T = K Q^T and dP^T = V dO^T.
        float s[1][kQTiles][4];
        float dp[1][kQTiles][4];
        fill_fragments(s, 0.0f);
        fill_fragments(dp, 0.0f);
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            u32 k_a[4];
            u32 v_a[4];
            ldmatrix_x4(k_a, k_address + key_a_offset + ks * 16 * kElementBytes);
            ldmatrix_x4(v_a, v_address + key_a_offset + ks * 16 * kElementBytes);
#pragma unroll
            for (int np = 0; np < kQTiles / 2; ++np) {
                const u32 offset = buffer_offset + row_b_offset + (np * 16 * kStride + ks * 16) * kElementBytes;
                u32 b[4];
                ldmatrix_x4(b, q_address + offset);
                mma_two_n8_tiles<Element>(s, [&](int) -> const u32(&)[4] { return k_a; }, b, np);
                ldmatrix_x4(b, do_address + offset);
                mma_two_n8_tiles<Element>(dp, [&](int) -> const u32(&)[4] { return v_a; }, b, np);
            }
        }
        if constexpr (kOrderedDq) {
            held.hand_on(thread);
        }

        transposed_probabilities_and_gradients<kBlockM, kBlockN>(ctx, ctx.mask_of_head(head),
                                                                 ctx.score_of_head(params, block.batch, head), s,
                                                                 dp, stats + buffer * 2 * kBlockM, m_start,
                                                                 score_col0, n_start, n_start + warp_key0, lane);
        // P^T and dS^T rounded to the element type: dS^T to shared memory for
        // dQ, and both as the A operands of dV and dK, from registers, or
        // where two warps split the head dim (each holding its queries'
        // half), from shared memory too.
        u32 p_frag[kScoreCols / 16][4];
        u32 ds_frag[kScoreCols / 16][4];
#pragma unroll
        for (int ps = 0; ps < kScoreCols / 16; ++ps) {
            pack_a_fragment<Element>(p_frag[ps], s[0][2 * ps], s[0][2 * ps + 1]);
            pack_a_fragment<Element>(ds_frag[ps], dp[0][2 * ps], dp[0][2 * ps + 1]);
        }
        const auto stage_transposed = [&](Element* tile, const u32 (&frags)[kScoreCols / 16][4]) {
            stage_transposed_fragments<kQTiles>(reinterpret_cast<unsigned char*>(tile), frags, warp_key0, score_col0,
                                                lane, [](int row, int chunk) { return (row * kDsStride + 8 * chunk) * kElementBytes; });
        };
        stage_transposed(ds_tile, ds_frag);
        if constexpr (kSplitHeadDim) {
            stage_transposed(pt_tile, p_frag);
            __syncthreads();  // both warps' queries of P^T and dS^T are in shared memory
        }

        // dV += P^T dO, dK += dS^T Q.
#pragma unroll
        for (int ps = 0; ps < Traits::kRowSteps; ++ps) {
            u32 p_a[4];
            u32 ds_a[4];
            if constexpr (kSplitHeadDim) {
                ldmatrix_x4(p_a, shared_address(pt_tile) + score_a_offset + ps * 16 * kElementBytes);
                ldmatrix_x4(ds_a, shared_address(ds_tile) + score_a_offset + ps * 16 * kElementBytes);
            } else {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    p_a[r] = p_frag[ps][r];
                    ds_a[r] = ds_frag[ps][r];
                }
            }
#pragma unroll
            for (int dp_pair = 0; dp_pair < kDTiles / 2; ++dp_pair) {
                const u32 offset = buffer_offset + acc_bt_offset + (ps * 16 * kStride + dp_pair * 16) * kElementBytes;
                u32 b[4];
                ldmatrix_x4_trans(b, do_address + offset);
                mma_two_n8_tiles<Element>(dv, [&](int) -> const u32(&)[4] { return p_a; }, b, dp_pair);
                ldmatrix_x4_trans(b, q_address + offset);
                mma_two_n8_tiles<Element>(dk, [&](int) -> const u32(&)[4] { return ds_a; }, b, dp_pair);
            }
        }
        // Ordered dQ: the key blocks add into this dQ block one after
        // another (ordered_accumulation.cuh, dq_turn). The turn is awaited here, at the
        // barrier the step has anyway (waiting after dQ's product, with its
        // registers live, spilled at d128), and handed on one step later.
        const auto dq_counter = [&]() {
            return params.dq_counter(block.batch, head, m_block);
        };
        // The barrier also says, single-buffered, that every warp is past
        // its last read of Q, dO and the statistics.
        if constexpr (kOrderedDq) {
            wait_for_turn(dq_counter(), turn);  // includes the barrier
        } else if constexpr (!kSplitHeadDim || kQStages == 1) {  // (split: dS^T passed before dV and dK)
            __syncthreads();  // every warp's dS^T is in shared memory
        }
        if constexpr (kQStages == 1) {
            load_next_query_block();
        }

        // dQ_i (this warp's rows and columns) = dS K, in chunks of kDqChunk
        // columns (dq_chunk_columns, in both dQ modes).
        constexpr int kDqChunk = dq_chunk_columns(kAccCols, kDqCols);
        static_assert(kDqCols % kDqChunk == 0 && kDqChunk % 16 == 0, "chunks of whole n8 pairs");
        float* dq_rows = params.dq_accum_row(block.tensor_batch, head, block.q_row0 + m_start, ctx.head_dim);
        const index_t dq_row_stride = params.size.nheads * ctx.head_dim;
#pragma unroll
        for (int chunk = 0; chunk < kDqCols / kDqChunk; ++chunk) {
            const int chunk_col0 = dq_col0 + chunk * kDqChunk;
            float dq[1][kDqChunk / 8][4];
            fill_fragments(dq, 0.0f);
#pragma unroll
            for (int ks = 0; ks < Traits::kKeySteps; ++ks) {
                u32 ds_a[4];
                ldmatrix_x4_trans(ds_a, ds_a_address + ks * 16 * kDsStride * kElementBytes);
#pragma unroll
                for (int dp_pair = 0; dp_pair < kDqChunk / 16; ++dp_pair) {
                    u32 b[4];
                    ldmatrix_x4_trans(
                        b, k_address + row_bt_offset + (ks * 16 * kStride + chunk_col0 + dp_pair * 16) * kElementBytes);
                    mma_two_n8_tiles<Element>(dq, [&](int) -> const u32(&)[4] { return ds_a; }, b, dp_pair);
                }
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = dq_row0 + lane / 4 + half * 8;
                if (m_start + row < ctx.seqlen_q) {
#pragma unroll
                    for (int j = 0; j < kDqChunk / 8; ++j) {
                        const int col = chunk_col0 + 8 * j + 2 * (lane % 4);
                        if (col < ctx.head_dim) {
                            atomicAdd(dq_rows + row * dq_row_stride + col, dq[0][j][2 * half] * scale);
                            atomicAdd(dq_rows + row * dq_row_stride + col + 1, dq[0][j][2 * half + 1] * scale);
                        }
                    }
                }
            }
        }
        if constexpr (kOrderedDq) {
            held.counter = dq_counter();
        }
        walk.move_to(next_head, next_m_block);
    }

    // Epilogue: every warp is past its last read of K and V; each warp
    // stages its 16 rows (its columns) of dK (scaled) and dV there and
    // stores them 16 bytes at a time. Keys past seqlen_k and padded columns are not
    // written; with no visible query the results are zeros.
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (kOrderedDq) {
        held.hand_on(thread);  // the last step's dQ block
    }
    Element* const tiles[2] = {k_tile, v_tile};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key_row = warp_key0 + lane / 4 + half * 8;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
            const int offset = key_row * kStride + acc_col0 + 8 * dt + 2 * (lane % 4);
            *reinterpret_cast<u32*>(tiles[0] + offset) =
                pack_pair<Element>(dk[0][dt][2 * half] * scale, dk[0][dt][2 * half + 1] * scale);
            *reinterpret_cast<u32*>(tiles[1] + offset) = pack_pair<Element>(dv[0][dt][2 * half], dv[0][dt][2 * half + 1]);
        }
    }
    __syncwarp();
    constexpr int kChunksPerRow = kAccCols / 8;
    constexpr int kWarpChunks = 16 * kChunksPerRow;
    Element* const outputs[2] = {block.key_row<Element>(params.dk, block.kv_head, n_start),
                                 block.key_row<Element>(params.dv, block.kv_head, n_start)};
    const index_t row_strides[2] = {params.dk.row_stride, params.dv.row_stride};
#pragma unroll
    for (int which = 0; which < 2; ++which) {
#pragma unroll
        for (int i = 0; i < ceil_div(kWarpChunks, 32); ++i) {
            const int chunk = lane + i * 32;
            const int key_row = warp_key0 + chunk / kChunksPerRow;
            const int col = acc_col0 + chunk % kChunksPerRow * 8;
            if ((kWarpChunks % 32 == 0 || chunk < kWarpChunks) && n_start + key_row < ctx.seqlen_k &&
                col < ctx.head_dim) {
                *reinterpret_cast<uint4*>(outputs[which] + static_cast<index_t>(key_row) * row_strides[which] + col) =
                    *reinterpret_cast<const uint4*>(tiles[which] + key_row * kStride + col);
            }
        }
    }
}

}  // namespace cuflash
