// FlashAttention backward dK/dV (with atomic or ordered dQ) on Hopper's warpgroup tensor
// cores (wgmma, sm_90a; float16, bfloat16). The algorithm is flash_bwd.cu's:
// one thread block per key block j keeps K_j, V_j and the dK_j, dV_j
// accumulators while it walks every query block i of every query head
// sharing this K/V head; the preprocessing (delta) and dQ conversion kernels
// of flash_bwd_elementwise.cu run before and after it.
//
// Each warpgroup owns 64 keys; per query block, in the transposed form that
// keeps the key-side products in registers:
//   S^T  = K Q^T, dP^T = V dO^T        both operands from swizzled shared memory
//   P^T  = exp2(S^T * scale log2(e) - LSE log2(e)),  dS^T = P^T (dP^T - delta)
//                                      (S^T after the score transform, dS^T
//                                      times its derivative)
//   dV  += P^T dO, dK += dS^T Q        A from registers (the S^T / dP^T
//                                      accumulators packed), B read MN-major
//   dQ_i += scale * dS K               dS^T staged in shared memory, both
//                                      operands MN-major; float32 reductions
//                                      of whole lines (dq_accumulation.cuh)
// Above head dim 128 (WgmmaBackwardTraits::kSplitHeadDim) the warpgroups
// share one block of 64 keys instead: each computes S^T and dP^T for its
// share of the query block's rows and owns its share of dK's and dV's
// columns, so P^T is staged in shared memory next to dS^T and dV, dK take
// both A operands from there.
// Q, dO and their row statistics are double-buffered: the next query block
// is copied by cp.async while this one is computed. dK is scaled once at the
// end. Nothing of size seqlen_q x seqlen_k exists: one dS^T (and P^T) tile
// per block.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "tensor_core_traits.cuh"
#include "async_copy.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "backward_steps.cuh"
#include "ordered_accumulation.cuh"
#include "dq_accumulation.cuh"

namespace cuflash {

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          bool kOrderedDq>
__global__ void __launch_bounds__(kWarps * 32, 1)
flash_backward_dkdv_wgmma_kernel(const BackwardParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Traits = WgmmaBackwardTraits<Element, kHeadDim, kBlockM, kBlockN, kWarps>;
    using KvTile = typename Traits::KvTile;
    using QTile = typename Traits::QTile;
    using DsTile = typename Traits::DsTile;
    constexpr int kQTiles = Traits::kQTiles;
    constexpr int kDTiles = Traits::kDTiles;
    constexpr int kDqCols = Traits::kDqCols;
    constexpr int kAccCols = Traits::kAccCols;
    constexpr int kScoreCols = Traits::kScoreCols;
    constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;

    require_shared_memory<Traits>();
    unsigned char* smem;
    const u32 base = aligned_shared_base<Traits::kAlignment>(smem);
    const u32 k_smem = base + Traits::kK;
    const u32 v_smem = base + Traits::kV;
    const u32 q_smem = base + Traits::kQ;
    const u32 do_smem = base + Traits::kDo;
    float* const stats = reinterpret_cast<float*>(smem + Traits::kStats);

    const KeyBlock block =
        key_block<kOrderedDq && Mask::kDqTurns == DqTurns::kLastKeyFirst>(params.size, params.num_n_blocks, kBlockN);
    const BlockContext<Mask, Score> ctx(params, block.batch);
    const float scale = static_cast<float>(params.softmax_scale);

    const int thread = threadIdx.x;
    const int warp = thread / 32;
    const int lane = thread % 32;
    const int warpgroup = warp / 4;
    const int n_start = block.n_start;
    // The warpgroup's keys, its queries of S^T and dP^T inside the query
    // block, and its columns of dK and dV (see WgmmaBackwardTraits).
    const int key_group = kSplitHeadDim ? 0 : warpgroup;
    const int dim_group = kSplitHeadDim ? warpgroup : 0;
    const int warp_key0 = (kSplitHeadDim ? warp % 4 : warp) * 16;  // the warp's 16 accumulator rows (keys)
    const int score_col0 = dim_group * kScoreCols;
    const int acc_col0 = dim_group * kAccCols;

    load_swizzled_tile_async<KvTile, Traits::kThreads>(
        k_smem, DenseKvSource::rows<Element>(params.k, block.batch, block.kv_head, n_start), params.k.row_stride,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);
    load_swizzled_tile_async<KvTile, Traits::kThreads>(
        v_smem, DenseKvSource::rows<Element>(params.v, block.batch, block.kv_head, n_start), params.v.row_stride,
        ctx.seqlen_k - n_start, ctx.head_dim, thread);

    // Copies Q, dO (cp.async) and the row statistics of query block m_block
    // of `head` into `buffer`.
    const auto load_query_block = [&](index_t head, int m_block, int buffer) {
        const int m_start = m_block * kBlockM;
        load_swizzled_tile_async<QTile, Traits::kThreads>(
            q_smem + buffer * QTile::kBytes, params.q.row_ptr<const Element>(block.batch, head, m_start),
            params.q.row_stride, ctx.seqlen_q - m_start, ctx.head_dim, thread);
        load_swizzled_tile_async<QTile, Traits::kThreads>(
            do_smem + buffer * QTile::kBytes, params.dout.row_ptr<const Element>(block.batch, head, m_start),
            params.dout.row_stride, ctx.seqlen_q - m_start, ctx.head_dim, thread);
        load_row_statistics<kBlockM, Traits::kThreads>(stats + buffer * 2 * kBlockM, params, block.batch, head, m_start,
                                                       ctx.seqlen_q, thread);
    };
    QueryBlockWalk walk(ctx.mask, block, kBlockN, kBlockM, static_cast<int>(params.num_m_blocks),
                        walk_rotation<Mask>(params, block.n_block));
    if (walk.steps > 0) {
        load_query_block(walk.head, walk.m_block, 0);
    }
    cp_async_commit();

    // Descriptors (wgmma.cuh). K-major: K and V as A of S^T / dP^T (this
    // warpgroup's 64 keys), Q and dO as their B (its queries), and, where the
    // head dim is split, P^T and dS^T as A of dV / dK. MN-major: dO and Q as
    // B of dV / dK (its columns), dS^T (this warpgroup's m64 tile of queries)
    // and K (its column block of dQ) for dQ.
    const u32 key_rows = key_group * 64 * KvTile::kSwizzleBytes;
    const u32 query_rows = score_col0 * QTile::kSwizzleBytes;
    const u32 acc_panel = acc_col0 / QTile::kPanelCols * QTile::kPanelBytes;
    const u64 k_descriptor = kmajor_descriptor<KvTile>(base, Traits::kK + key_rows);
    const u64 v_descriptor = kmajor_descriptor<KvTile>(base, Traits::kV + key_rows);
    const u64 q_descriptor = kmajor_descriptor<QTile>(base, Traits::kQ + query_rows);
    const u64 do_descriptor = kmajor_descriptor<QTile>(base, Traits::kDo + query_rows);
    const u64 q_mn_descriptor = mn_major_descriptor<QTile>(base, Traits::kQ + acc_panel);
    const u64 do_mn_descriptor = mn_major_descriptor<QTile>(base, Traits::kDo + acc_panel);
    const u64 pt_descriptor = kmajor_descriptor<DsTile>(base, Traits::kPt);
    const u64 ds_descriptor = kmajor_descriptor<DsTile>(base, Traits::kDs);
    constexpr u64 kQBufferStep = QTile::kBytes >> 4;
    const int dq_m_tile = warpgroup % Traits::kDqMTiles;
    const int dq_col0 = warpgroup / Traits::kDqMTiles * kDqCols;
    const u64 ds_mn_descriptor = mn_major_descriptor<DsTile>(base, Traits::kDs + dq_m_tile * DsTile::kPanelBytes);
    const u64 k_mn_descriptor =
        mn_major_descriptor<KvTile>(base, Traits::kK + dq_col0 / KvTile::kPanelCols * KvTile::kPanelBytes);

    float dk[1][kDTiles][4];
    float dv[1][kDTiles][4];
    fill_fragments(dk, 0.0f);
    fill_fragments(dv, 0.0f);
    float(&dk_flat)[kAccCols / 2] = reinterpret_cast<float(&)[kAccCols / 2]>(dk);
    float(&dv_flat)[kAccCols / 2] = reinterpret_cast<float(&)[kAccCols / 2]>(dv);
    unsigned char* const ds_tile = smem + Traits::kDs;
    unsigned char* const pt_tile = smem + Traits::kPt;
    float* const dq_staging = reinterpret_cast<float*>(smem + Traits::kDqStaging) + warp * kDqStagingFloatsPerWarp;

    // Ordered dQ: the dQ block whose turn this block holds until it hands
    // it on (one step later, once the next products are issued).
    HeldTurn held;
    for (int step = 0; step < walk.steps; ++step) {
        const int buffer = step & 1;
        // This step's Q, dO and statistics have landed for every thread;
        // every warpgroup is done with the previous step (its buffers and dS^T).
        cp_async_wait<0>();
        fence_async_shared();
        __syncthreads();
        index_t next_head;
        int next_m_block;
        walk.following(next_head, next_m_block);
        if (step + 1 < walk.steps) {
            load_query_block(next_head, next_m_block, buffer ^ 1);
        }
        cp_async_commit();
        const index_t head = walk.head;
        const int m_block = walk.m_block;
        const int m_start = m_block * kBlockM;

        float s[1][kQTiles][4];
        float dp[1][kQTiles][4];
        float(&s_flat)[kScoreCols / 2] = reinterpret_cast<float(&)[kScoreCols / 2]>(s);
        float(&dp_flat)[kScoreCols / 2] = reinterpret_cast<float(&)[kScoreCols / 2]>(dp);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            Wgmma<Element, kScoreCols>::ss(s_flat, k_descriptor + kmajor_k_step<KvTile>(ks),
                                        q_descriptor + buffer * kQBufferStep + kmajor_k_step<QTile>(ks),
                                        ks > 0);
        }
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            Wgmma<Element, kScoreCols>::ss(dp_flat, v_descriptor + kmajor_k_step<KvTile>(ks),
                                        do_descriptor + buffer * kQBufferStep + kmajor_k_step<QTile>(ks),
                                        ks > 0);
        }
        wgmma_commit();
        if constexpr (kOrderedDq) {
            // The previous step's dQ additions are ordered before the barrier
            // at the top of this step; its fence waits while S^T and dP^T run.
            held.hand_on(thread);
        }
        wgmma_wait<0>();
        pin_registers(s_flat);
        pin_registers(dp_flat);

        transposed_probabilities_and_gradients<kBlockM, kBlockN>(ctx, s, dp, stats + buffer * 2 * kBlockM, m_start,
                                                                 score_col0, n_start, n_start + warp_key0, lane);
        // P^T and dS^T rounded to the element type: dS^T to shared memory for
        // dQ (same swizzle as the tiles), and both as the A operands of dV
        // and dK, from registers, or where the warpgroups split the head dim
        // (each holding its queries' share), from shared memory too.
        u32 p_frag[kScoreCols / 16][4];
        u32 ds_frag[kScoreCols / 16][4];
#pragma unroll
        for (int ps = 0; ps < kScoreCols / 16; ++ps) {
            pack_a_fragment<Element>(p_frag[ps], s[0][2 * ps], s[0][2 * ps + 1]);
            pack_a_fragment<Element>(ds_frag[ps], dp[0][2 * ps], dp[0][2 * ps + 1]);
        }
        const auto stage_transposed = [&](unsigned char* tile, const u32 (&frags)[kScoreCols / 16][4]) {
            stage_transposed_fragments<kQTiles>(tile, frags, warp_key0, score_col0, lane,
                                                [](int row, int chunk) { return DsTile::chunk_offset(row, chunk); });
        };
        stage_transposed(ds_tile, ds_frag);
        if constexpr (kSplitHeadDim) {
            stage_transposed(pt_tile, p_frag);
        }
        fence_async_shared();  // dS^T (P^T), written by ordinary stores, is read by the tensor cores
        if constexpr (kSplitHeadDim) {
            __syncthreads();  // both warpgroups' queries of P^T and dS^T are in shared memory
        }

        wgmma_fence();
#pragma unroll
        for (int ps = 0; ps < Traits::kRowSteps; ++ps) {
            const u64 do_step = do_mn_descriptor + buffer * kQBufferStep + mn_major_k_step<QTile>(ps);
            if constexpr (kSplitHeadDim) {
                Wgmma<Element, kAccCols>::ss_mn_major_b(dv_flat, pt_descriptor + kmajor_k_step<DsTile>(ps), do_step, 1);
            } else {
                Wgmma<Element, kAccCols>::rs(dv_flat, p_frag[ps], do_step, 1);
            }
        }
#pragma unroll
        for (int ps = 0; ps < Traits::kRowSteps; ++ps) {
            const u64 q_step = q_mn_descriptor + buffer * kQBufferStep + mn_major_k_step<QTile>(ps);
            if constexpr (kSplitHeadDim) {
                Wgmma<Element, kAccCols>::ss_mn_major_b(dk_flat, ds_descriptor + kmajor_k_step<DsTile>(ps), q_step, 1);
            } else {
                Wgmma<Element, kAccCols>::rs(dk_flat, ds_frag[ps], q_step, 1);
            }
        }
        wgmma_commit();

        // Deterministic mode: the key blocks add into this dQ block one after
        // another, in the order of dq_turn (backward_steps.cuh). A key block
        // that waits trails the previous one by what it waits through, so
        // the turn is awaited after dQ's product (only the additions are
        // serialised), and handed on one step later (see hand_on_turn).
        const auto dq_counter = [&]() {
            return params.dq_semaphore + (block.batch * params.size.nheads + head) * params.num_m_blocks + m_block;
        };
        const auto turn = [&]() {
            return dq_turn(ctx.mask, params, m_block, block.n_block, kBlockM, kBlockN);
        };
        if constexpr (!kSplitHeadDim) {  // (split: passed before dV and dK)
            __syncthreads();  // every warpgroup's dS^T is in shared memory
        }
        // dQ's product in chunks of kDqChunk columns (dq_chunk_columns).
        constexpr int kDqChunk = dq_chunk_columns(kOrderedDq, kAccCols, kDqCols);
        static_assert(kDqCols % kDqChunk == 0 && kDqChunk % KvTile::kPanelCols == 0, "chunks of whole K panels");
        float* dq_rows = params.dq_accum_row(block.batch, head, m_start, ctx.head_dim);
        const index_t dq_row_stride = params.size.nheads * ctx.head_dim;
#pragma unroll
        for (int chunk = 0; chunk < kDqCols / kDqChunk; ++chunk) {
            const int chunk_col0 = dq_col0 + chunk * kDqChunk;
            const u64 k_chunk_descriptor = k_mn_descriptor + ((chunk * kDqChunk / KvTile::kPanelCols * KvTile::kPanelBytes) >> 4);
            float dq[1][kDqChunk / 8][4];
            float(&dq_flat)[kDqChunk / 2] = reinterpret_cast<float(&)[kDqChunk / 2]>(dq);
#pragma unroll
            for (int ks = 0; ks < Traits::kKeySteps; ++ks) {
                Wgmma<Element, kDqChunk>::ss_mn_major(dq_flat, ds_mn_descriptor + mn_major_k_step<DsTile>(ks),
                                                      k_chunk_descriptor + mn_major_k_step<KvTile>(ks), ks > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            pin_registers(dq_flat);
            pin_registers(dv_flat);
            pin_registers(dk_flat);
            if constexpr (kOrderedDq) {
                if (chunk == 0) {
                    wait_for_turn(dq_counter(), turn());
                }
            }
            add_dq_fragment<kDqChunk, Traits::kDqStaged>(dq_rows, dq_row_stride, dq_m_tile * 64 + (warp % 4) * 16,
                                                         chunk_col0, dq, scale, dq_staging, ctx.seqlen_q - m_start,
                                                         ctx.head_dim, lane);
        }
        if constexpr (kOrderedDq) {
            held.counter = dq_counter();
        }
        walk.head = next_head;
        walk.m_block = next_m_block;
    }

    // Epilogue: every warpgroup is past its last read of K and V; each warp
    // stages its 16 rows of dK (scaled) and dV there (same swizzle) and
    // stores them 16 bytes at a time. Keys past seqlen_k and padded columns
    // are not written; with no visible query the results are zeros.
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (kOrderedDq) {
        held.hand_on(thread);  // the last step's dQ block
    }
    unsigned char* const tiles[2] = {smem + Traits::kK, smem + Traits::kV};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int key_row = warp_key0 + lane / 4 + half * 8;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
            const int offset = KvTile::chunk_offset(key_row, acc_col0 / 8 + dt) + 4 * (lane % 4);
            *reinterpret_cast<u32*>(tiles[0] + offset) =
                pack_pair<Element>(dk[0][dt][2 * half] * scale, dk[0][dt][2 * half + 1] * scale);
            *reinterpret_cast<u32*>(tiles[1] + offset) = pack_pair<Element>(dv[0][dt][2 * half], dv[0][dt][2 * half + 1]);
        }
    }
    __syncwarp();
    store_warp_rows<KvTile, kAccCols>(params.dk.row_ptr<Element>(block.batch, block.kv_head, n_start),
                                      params.dk.row_stride, tiles[0], warp_key0, ctx.seqlen_k - n_start, ctx.head_dim,
                                      lane, acc_col0);
    store_warp_rows<KvTile, kAccCols>(params.dv.row_ptr<Element>(block.batch, block.kv_head, n_start),
                                      params.dv.row_stride, tiles[1], warp_key0, ctx.seqlen_k - n_start, ctx.head_dim,
                                      lane, acc_col0);
#else
    // Built only for sm_90a (the launcher picks this kernel on compute capability 9.0 alone).
    __trap();
#endif
}

}  // namespace cuflash
