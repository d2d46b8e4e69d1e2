// FlashAttention backward dK/dV (with atomic or ordered dQ) on Hopper's warpgroup tensor
// cores (wgmma, sm_90a; float16, bfloat16), warp-specialised. The algorithm is
// flash_bwd.cu's: one thread block per key block j keeps K_j, V_j and the
// dK_j, dV_j accumulators while it walks every query block i of every query
// head sharing this K/V head; the preprocessing (delta) and dQ conversion
// kernels of flash_bwd_elementwise.cu run before and after it (in the
// direct mode below, neither, where its O tiles fit).
//
// Warpgroup 0 is the producer; it hands most of its registers back
// (setmaxnreg) and two of its warps work (three in the claimed mode, four
// in the direct mode where it computes delta):
//  - the load warp copies K and V once and, through a ring of kStages
//    buffers, each step's Q and dO tiles with the Tensor Memory Accelerator
//    (tma.cuh), its lanes writing the rows' LSE and delta next to them; full
//    and empty mbarriers hand the buffers over (mbarrier.cuh);
//  - the dQ warp takes each step's float32 dQ tile from shared memory and
//    has the copy engine add it into the accumulator (cp.reduce.async.bulk,
//    tma_reduce_add_tile), waiting, in the ordered (deterministic) mode, for
//    this key block's turn first. The consumers never wait for those
//    additions to land, only for the tile to be read: adding dQ was the
//    previous kernel's bound (its warps all stalled in the same window of
//    every step, docs/perf-notes.md);
//  - in the direct mode, where this is the only key block (the launcher
//    picks it for one block of keys whose walk visits every query block),
//    the consumers write the tile in the input dtype and Q's layout and the
//    dQ warp has the copy engine store it into dq itself: no float32
//    accumulator, no conversion kernel after this one; and as each query
//    row meets this block alone, the load warp copies the step's O tile
//    with dO and warps 2 and 3 (the delta warps) compute the rows' delta
//    from the two (kComputesDelta: where the O tiles fit), so that no
//    preprocessing kernel runs before this one either;
//  - in the claimed mode, where this key block is the first to reach a
//    query block, the dQ warp hands the tile to the store warp, which
//    stores it over the unzeroed accumulator (tma_store_tile), so that no
//    pass zeroes it (first stores, ordered_accumulation.cuh), and waits for
//    the store to land before the other key blocks may add: a wait the dQ
//    warp's additions of the next steps need not sit behind.
// The other warpgroups are consumers (setmaxnreg: the producer's registers).
// Each owns 64 keys; per query block, in the transposed form that keeps the
// key-side products in registers:
//   S^T  = K Q^T, dP^T = V dO^T        both operands from swizzled shared memory
//   P^T  = exp2(S^T * scale log2(e) - LSE log2(e)),  dS^T = P^T (dP^T - delta)
//                                      (S^T after the score transform, dS^T
//                                      times its derivative)
//   dV  += P^T dO, dK += dS^T Q        A from registers (the S^T / dP^T
//                                      accumulators packed), B read MN-major
//   dQ_i = scale * dS K                dS^T staged in shared memory, both
//                                      operands MN-major, into the dQ tile;
//                                      up to head dim 128 one consumer takes
//                                      a step's whole tile, the two by turns
//                                      (WgmmaBackwardTraits::kDqByTurns)
// Between buckets (head dim 112 in 128, 80 in 96, 48 in 64) S^T, dP^T, dV
// and dK run over kProductDim columns, not the bucket's padded ones
// (WgmmaBackwardTraits::kProductDim).
// Above head dim 128 (WgmmaBackwardTraits::kSplitHeadDim) the consumers
// share one block of 64 keys instead: each computes S^T and dP^T for its
// share of the query block's rows and owns its share of dK's and dV's
// columns, so P^T is staged in shared memory next to dS^T and dV, dK take
// both A operands from there. The consumers meet at one named barrier per
// step (every consumer's dS^T staged; the producer never joins), and dK is
// scaled once at the end. Nothing of size seqlen_q x seqlen_k exists: two
// dS^T (and P^T) tiles and one dQ tile per block.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "tensor_core_traits.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "warp_roles.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "backward_steps.cuh"
#include "ordered_accumulation.cuh"

namespace cuflash {

// The producer keeps this many registers per thread (a walk, a ring
// position, coordinates and barrier addresses).
constexpr int kBackwardProducerRegisters = 24;
// The consumers' named barrier (ids from 1: 0 is __syncthreads').
constexpr int kConsumersBarrier = 1;

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kStages, int kProductDim, int kDqMode>
__global__ void __launch_bounds__(kWarps * 32, 1)
flash_backward_dkdv_wgmma_kernel(const __grid_constant__ WgmmaBackwardParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool kOrderedDq = kDqMode == kDqOrdered;
    // First stores need each query block's rows in one sequence: a packed
    // batch's tiles run into the next sequence's rows (the launcher never
    // asks for them there; a packed variant adds as kDqAtomic does).
    constexpr bool kClaimsDq = kDqMode == kDqClaimed && !Batch::kPacked;
    // Direct stores need each tile's rows in one sequence too.
    constexpr bool kDirectDq = kDqMode == kDqDirect && !Batch::kPacked;
    // The delta warps (kComputesDelta): the producer's warps 2 and 3.
    constexpr int kDeltaThreads = 64;
    using Traits = WgmmaBackwardTraits<Element, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kProductDim, kDirectDq>;
    // The direct mode computes delta itself where its O tiles fit.
    constexpr bool kComputesDelta = Traits::kComputesDelta;
    using KvTile = typename Traits::KvTile;
    using QTile = typename Traits::QTile;
    using DsTile = typename Traits::DsTile;
    using DqTile = typename Traits::DqTile;
    using Ring = RingPosition<kStages>;
    constexpr int kQTiles = Traits::kQTiles;
    constexpr int kDTiles = Traits::kDTiles;
    constexpr int kDqCols = Traits::kDqCols;
    constexpr int kDqChunk = Traits::kDqChunk;
    constexpr int kAccCols = Traits::kAccCols;
    constexpr int kScoreCols = Traits::kScoreCols;
    constexpr bool kSplitHeadDim = Traits::kSplitHeadDim;
    constexpr int kConsumerThreads = Traits::kConsumerThreads;
    constexpr int kConsumerRegisters =
        consumer_registers(kWarps * 32, kConsumerThreads, kBackwardProducerRegisters, 1);
    static_assert(kConsumerRegisters >= registers_at_entry(kWarps * 32, 1),
                  "setmaxnreg.inc may only raise the consumers' registers");

    require_shared_memory<Traits>();
    unsigned char* smem;
    const u32 base = aligned_shared_base<Traits::kAlignment>(smem);
    const u32 kv_full = base + Traits::kKvFull;
    const u32 dq_full = base + Traits::kDqFull;
    const u32 dq_empty = base + Traits::kDqEmpty;

    const int thread = threadIdx.x;
    // Role and warp indices through a shuffle from lane 0: warp-uniform to
    // the compiler, which then keeps the wgmma instructions asynchronous
    // (see flash_fwd_wgmma.cu).
    const int warpgroup = __shfl_sync(0xffffffffu, thread / 128, 0);
    const int lane = thread % 32;
    const KeyBlock block =
        key_block<Batch, kOrderedDq && Mask::kDqTurns == DqTurns::kLastKeyFirst>(params.size, params.num_n_blocks, kBlockN);
    const BlockContext<Mask, Score> ctx(params, block);
    // A packed batch's grid covers its longest sequence; the blocks past a
    // shorter one's end have no keys (the whole block leaves, before any barrier).
    if (Batch::kPacked && block.n_start >= ctx.seqlen_k) {
        return;
    }
    if (thread == 0) {
        mbarrier_init(kv_full, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            // Q full: the load warp's 32 lanes (each after its statistics)
            // and the tile's bytes; dO full: one arrival and the bytes;
            // empty: every consumer thread, once its products are done.
            mbarrier_init(Traits::q_full(base, s), 32);
            mbarrier_init(Traits::do_full(base, s), 1);
            mbarrier_init(Traits::q_empty(base, s), kConsumerThreads);
        }
        // dQ full: the threads of the consumer(s) writing the step's tile.
        mbarrier_init(dq_full, Traits::kDqByTurns ? kConsumerThreads / Traits::kConsumers : kConsumerThreads);
        mbarrier_init(dq_empty, 1);
        if constexpr (kClaimsDq) {
            mbarrier_init(base + Traits::kStoreJob, 1);
        }
        if constexpr (kComputesDelta) {
            // Each stage's delta written: the delta warps' lanes.
#pragma unroll
            for (int s = 0; s < kStages; ++s) {
                mbarrier_init(Traits::delta_full(base, s), kDeltaThreads);
            }
        }
        mbarrier_init_fence();
    }
    // The only block-wide barrier: after it the producer may leave early.
    __syncthreads();

    const int n_start = block.n_start;
    QueryBlockWalk walk(ctx.mask, block, kBlockN, kBlockM, walk_rotation<Mask>(params, block.n_block));

    if (warpgroup == 0) {
        release_registers<kBackwardProducerRegisters>();
        const int warp = __shfl_sync(0xffffffffu, thread / 32, 0);
        if (kComputesDelta && warp >= 2) {
            // The delta warps: each query row meets this block alone, so
            // delta = rowsum(dO * O) is computed here, in place of the
            // preprocessing kernel and its buffer, from the step's dO and O
            // tiles (same swizzle; rows past seqlen_q and columns past the
            // head dim filled with zeros by the copy engine, so they sum to
            // 0), a thread a row. The consumers wait for it only before the
            // step's softmax, after both products. Written so that the
            // producer's 24 registers hold it and the consumers' allocation
            // stays as it was: 16-byte chunks, two at a time, and this role
            // tested before the others (four at a time, this role after the
            // others, or the load warp waiting for a single O tile to be
            // free each made the consumers spill 8-40 bytes at head dims 64
            // or 256; ptxas allocates the roles' registers together).
            const int row0 = thread - 64;
            Ring ring;
            for (int step = 0; step < walk.steps; ++step) {
                mbarrier_wait(Traits::do_full(base, ring.stage), ring.phase);
                const u32 do_tile = base + Traits::kDo + ring.stage * QTile::kBytes;
                const u32 o_tile = base + Traits::kO + ring.stage * Traits::kOStride;
                const u32 delta = base + Traits::kStats + ring.stage * Traits::kStatsBytes + 4 * kBlockM;
#pragma unroll
                for (int r = 0; r < kBlockM / kDeltaThreads; ++r) {
                    const int row = row0 + r * kDeltaThreads;
                    float sum = 0.0f;
                    // A thread's second row, where it is past every
                    // sequence's end (a short sequence in 128-row tiles), is
                    // zeros whatever the step: not read, which halves the
                    // wait of such a sequence's one step.
                    if (r == 0 || row < params.size.seqlen_q_int()) {
#pragma unroll 2
                        for (int chunk = 0; chunk < kProductDim / 8; ++chunk) {
                            const u32 offset = QTile::chunk_offset(row, chunk);
                            sum = dot_chunk<Element>(load_shared_chunk(do_tile + offset),
                                                     load_shared_chunk(o_tile + offset), sum);
                        }
                    }
                    store_shared(delta + 4 * row, sum);
                }
                mbarrier_arrive(Traits::delta_full(base, ring.stage));
                ring.advance();
            }
        } else if (warp == 0) {
            // The load warp.
            if (walk.steps > 0 && lane == 0) {
                // Tensor-map coordinates are tensor rows: a packed batch's
                // tiles that run past a sequence's end copy the next
                // sequence's rows, which the mask hides (and its dQ rows get
                // exact zeros added: dS is 0 there).
                mbarrier_arrive_expect_tx(kv_full, 2 * KvTile::kBytes);
                tma_load_tile<KvTile>(base + Traits::kK, params.k_map, kv_full, block.k_row0 + n_start, block.kv_head,
                                      block.tensor_batch);
                tma_load_tile<KvTile>(base + Traits::kV, params.v_map, kv_full, block.k_row0 + n_start, block.kv_head,
                                      block.tensor_batch);
            }
            Ring ring;
            for (int step = 0; step < walk.steps; ++step) {
                const int m_start = walk.m_block * kBlockM;
                const u32 q_full = Traits::q_full(base, ring.stage), do_full = Traits::do_full(base, ring.stage);
                // The phase before the current one: on the first pass every buffer is free.
                mbarrier_wait(Traits::q_empty(base, ring.stage), ring.phase ^ 1);
                if (lane == 0) {
                    mbarrier_expect_tx(q_full, QTile::kBytes);
                    tma_load_tile<QTile>(base + Traits::kQ + ring.stage * QTile::kBytes, params.q_map, q_full,
                                         block.q_row0 + m_start, walk.head, block.tensor_batch);
                    if constexpr (kComputesDelta) {
                        // The step's rows of O too, for the delta warps, with dO.
                        mbarrier_arrive_expect_tx(do_full, 2 * QTile::kBytes);
                        tma_load_tile<QTile>(base + Traits::kO + ring.stage * Traits::kOStride, params.o_map, do_full,
                                             block.q_row0 + m_start, walk.head, block.tensor_batch);
                    } else {
                        mbarrier_arrive_expect_tx(do_full, QTile::kBytes);
                    }
                    tma_load_tile<QTile>(base + Traits::kDo + ring.stage * QTile::kBytes, params.do_map, do_full,
                                         block.q_row0 + m_start, walk.head, block.tensor_batch);
                }
                load_row_statistics<kBlockM, 32, true, !kComputesDelta>(
                    reinterpret_cast<float*>(smem + Traits::kStats + ring.stage * Traits::kStatsBytes), params,
                    block, walk.head, m_start, lane);
                mbarrier_arrive(q_full);  // after this lane's statistics
                walk.advance();
                ring.advance();
            }
        } else if (warp == 1 && lane == 0) {
            // The dQ warp: each step's tile, once the consumers have written it.
            u32 phase = 0;
            for (int step = 0; step < walk.steps; ++step) {
                const int m_start = walk.m_block * kBlockM;
                // kDqClaimed: the query block's counter (a dense batch's
                // entry is its tensor entry), claimed, and a store that
                // another block is making awaited, before the tile is ready,
                // so that the atomic's round trip and the proxy fence
                // overlap the wait for it.
                const auto claim_counter = [&]() {
                    return params.dq_counter(block.tensor_batch, walk.head, walk.m_block);
                };
                int claim = kStored;
                if constexpr (kClaimsDq) {
                    claim = claim_first_store(claim_counter());
                    if (claim == kClaimed) {
                        wait_until_stored(claim_counter());
                    }
                    if (claim != kUnclaimed) {
                        fence_async_global();  // the acquired store before the copy engine's additions
                    }
                }
                mbarrier_wait(dq_full, phase);
                int* counter = nullptr;
                if constexpr (kOrderedDq) {
                    counter = params.dq_counter(block.batch, walk.head, walk.m_block);
                    poll_until_turn(counter, dq_turn(ctx.mask, params, walk.head, walk.m_block, block.n_block, kBlockM, kBlockN));
                    fence_async_global();  // the acquired turn before the copy engine's additions
                }
                if (kClaimsDq && claim == kUnclaimed) {
                    // The store warp stores the tile and empties it.
                    post_first_store(base + Traits::kStoreSlot, static_cast<int>(walk.head), walk.m_block);
                    mbarrier_arrive(base + Traits::kStoreJob);
                } else {
                    if constexpr (kDirectDq) {  // params.dq_map: dq's own map, Q's boxes
                        tma_store_tile<QTile>(params.dq_map, base + Traits::kDq, block.q_row0 + m_start, walk.head,
                                              block.tensor_batch);
                    } else {
                        tma_reduce_add_tile<DqTile>(params.dq_map, base + Traits::kDq, block.q_row0 + m_start,
                                                    walk.head, block.tensor_batch);
                    }
                    bulk_commit();
                    bulk_wait_read<0>();
                    mbarrier_arrive(dq_empty);  // the consumers may write the next tile
                }
                if constexpr (kOrderedDq) {
                    // The additions must have landed, and be visible at gpu
                    // scope, before the next key block's turn.
                    bulk_wait<0>();
                    fence_async_global();
                    hand_on_turn(counter);
                }
                walk.advance();
                phase ^= 1;
            }
            if constexpr (kClaimsDq) {
                // The store warp has read the last job once the last tile
                // is emptied; only then may the slot take the end. (With no
                // steps this waits for the phase before the first: at once.)
                mbarrier_wait(dq_empty, phase ^ 1);
                post_first_store(base + Traits::kStoreSlot, 0, -1);
                mbarrier_arrive(base + Traits::kStoreJob);
            }
            bulk_wait<0>();
        } else if (kClaimsDq && warp == 2 && lane == 0) {
            // The store warp (kDqClaimed): the first stores the dQ warp hands
            // it, each waited for until it has landed and then marked stored
            // (the counter moves from claimed to stored) before the other
            // key blocks add. Waiting here holds up none of the dQ warp's
            // additions of the steps after it.
            for (u32 job_phase = 0;; job_phase ^= 1) {
                mbarrier_wait(base + Traits::kStoreJob, job_phase);
                const FirstStoreJob job = take_first_store(base + Traits::kStoreSlot);
                if (job.m_block < 0) {
                    break;
                }
                tma_store_tile<DqTile>(params.dq_map, base + Traits::kDq, block.q_row0 + job.m_block * kBlockM, job.head,
                                       block.tensor_batch);
                bulk_commit();
                bulk_wait_read<0>();
                mbarrier_arrive(dq_empty);  // the consumers may write the next tile
                bulk_wait<0>();
                fence_async_global();
                hand_on_turn(params.dq_counter(block.tensor_batch, job.head, job.m_block));
            }
        }
        return;
    }

    claim_registers<kConsumerRegisters>();
    // The claimed mode's dQ warp keeps more values across its loop; with
    // the consumers' keys taken from a copy made here, n_start itself need
    // not stay in a register both roles share (kept there, it spilled 4
    // bytes from the consumers at head dim 64, causal).
    const int consumer_n_start = kClaimsDq || kComputesDelta ? __shfl_sync(0xffffffffu, n_start, 0) : n_start;
    const int consumer = warpgroup - 1;
    const int warp = __shfl_sync(0xffffffffu, thread / 32 - 4, 0);  // among the consumer warps
    const float scale = params.softmax_scale;
    // The consumer's keys, its queries of S^T and dP^T inside the query
    // block, and its columns of dK and dV (see WgmmaBackwardTraits).
    const int key_group = kSplitHeadDim ? 0 : consumer;
    const int dim_group = kSplitHeadDim ? consumer : 0;
    const int warp_key0 = (kSplitHeadDim ? warp % 4 : warp) * 16;  // the warp's 16 accumulator rows (keys)
    const int score_col0 = dim_group * kScoreCols;
    const int acc_col0 = dim_group * Traits::kStorageCols;

    // Descriptors (wgmma.cuh). K-major: K and V as A of S^T / dP^T (this
    // consumer's 64 keys), Q and dO as their B (its queries), and, where the
    // head dim is split, P^T and dS^T as A of dV / dK. MN-major: dO and Q as
    // B of dV / dK (its columns), dS^T (this consumer's m64 tile of queries)
    // and K (its column block of dQ, or by turns all of K) for dQ.
    const u32 key_rows = key_group * 64 * KvTile::kSwizzleBytes;
    const u32 query_rows = score_col0 * QTile::kSwizzleBytes;
    const u32 acc_panel = acc_col0 / QTile::kPanelCols * QTile::kPanelBytes;
    const u64 k_descriptor = kmajor_descriptor<KvTile>(base, Traits::kK + key_rows);
    const u64 v_descriptor = kmajor_descriptor<KvTile>(base, Traits::kV + key_rows);
    const u64 q_descriptor = kmajor_descriptor<QTile>(base, Traits::kQ + query_rows);
    const u64 do_descriptor = kmajor_descriptor<QTile>(base, Traits::kDo + query_rows);
    const u64 q_mn_descriptor = mn_major_descriptor<QTile>(base, Traits::kQ + acc_panel);
    const u64 do_mn_descriptor = mn_major_descriptor<QTile>(base, Traits::kDo + acc_panel);
    const u64 ds_descriptor = kmajor_descriptor<DsTile>(base, Traits::kDs);
    const u64 pt_descriptor = ds_descriptor + (DsTile::kBytes >> 4);
    constexpr u64 kQBufferStep = QTile::kBytes >> 4;
    constexpr u64 kScoreBufferStep = Traits::kScoreBuffer >> 4;
    const int dq_m_tile = consumer % Traits::kDqMTiles;
    const int dq_col0 = Traits::kDqByTurns ? 0 : consumer / Traits::kDqMTiles * kDqCols;
    // Whether this consumer computes step `step`'s dQ: its share of every
    // step's, or by turns (WgmmaBackwardTraits::kDqByTurns) the whole tile
    // of every other step.
    const auto takes_dq = [&](int step) { return !Traits::kDqByTurns || (step & 1) == consumer; };
    const u64 ds_mn_descriptor = mn_major_descriptor<DsTile>(base, Traits::kDs + dq_m_tile * DsTile::kPanelBytes);
    const u64 k_mn_descriptor =
        mn_major_descriptor<KvTile>(base, Traits::kK + dq_col0 / KvTile::kPanelCols * KvTile::kPanelBytes);
    const int dq_row0 = dq_m_tile * 64 + (warp % 4) * 16;  // the warp's rows of the dQ tile

    float dk[1][kDTiles][4];
    float dv[1][kDTiles][4];
    fill_fragments(dk, 0.0f);
    fill_fragments(dv, 0.0f);
    float(&dk_flat)[kAccCols / 2] = reinterpret_cast<float(&)[kAccCols / 2]>(dk);
    float(&dv_flat)[kAccCols / 2] = reinterpret_cast<float(&)[kAccCols / 2]>(dv);

    // A step's dQ tile goes to the dQ warp once every thread of the
    // consumer(s) writing it has its stores visible to the copy engine (the
    // proxy fence waits for them to drain: 8% of the d128 kernel's warp
    // samples without a mask sat there, ncu). In the claimed mode (causal,
    // window), and in the atomic mode where the consumers take dQ by turns,
    // the hand-over waits until the next step's first products are issued,
    // so that the drain overlaps them; the dQ warp then still has most of
    // that step to take the tile before the next is written (H200, d128
    // causal 2k: 2% faster; by turns without a mask, d128 2k-16k: 5-6%
    // faster than by turns handing over at once). Before the turns, the
    // atomic mode at d128 measured 0.5-1% slower so (without a mask, 2k and
    // 4k), and where the consumers still split dQ (head dims 32, 64, 192,
    // 256) it hands over at once, as the ordered mode must (each key
    // block's turn waits for it) and the direct mode does (by turns, late
    // measured the same there). A packed batch's claimed and direct
    // variants (the launcher asks for neither) add as the atomic mode does,
    // and hand over as it does.
    constexpr bool kDqHandOverLate = kClaimsDq || (Traits::kDqByTurns && !kOrderedDq && !kDirectDq);
    const auto hand_over_dq_tile = [&]() {
        fence_async_shared();  // the dQ tile, written by ordinary stores, is read by the copy engine
        mbarrier_arrive(dq_full);
    };
    if (walk.steps > 0) {
        mbarrier_wait(kv_full, 0);
    }
    Ring ring;
    for (int step = 0; step < walk.steps; ++step) {
        const int m_start = walk.m_block * kBlockM;
        const int score_buffer = step & 1;
        const u32 ds_tile = base + Traits::kDs + score_buffer * Traits::kScoreBuffer;
        const u64 q_buffer = ring.stage * kQBufferStep;

        float s[1][kQTiles][4];
        float dp[1][kQTiles][4];
        float(&s_flat)[kScoreCols / 2] = reinterpret_cast<float(&)[kScoreCols / 2]>(s);
        float(&dp_flat)[kScoreCols / 2] = reinterpret_cast<float(&)[kScoreCols / 2]>(dp);
        mbarrier_wait(Traits::q_full(base, ring.stage), ring.phase);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            Wgmma<Element, kScoreCols>::ss(s_flat, k_descriptor + kmajor_k_step<KvTile>(ks),
                                           q_descriptor + q_buffer + kmajor_k_step<QTile>(ks), ks > 0);
        }
        mbarrier_wait(Traits::do_full(base, ring.stage), ring.phase);
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            Wgmma<Element, kScoreCols>::ss(dp_flat, v_descriptor + kmajor_k_step<KvTile>(ks),
                                           do_descriptor + q_buffer + kmajor_k_step<QTile>(ks), ks > 0);
        }
        wgmma_commit();
        if (kDqHandOverLate && step > 0 && takes_dq(step - 1)) {
            hand_over_dq_tile();  // the previous step's
        }
        wgmma_wait<0>();
        pin_registers(s_flat);
        pin_registers(dp_flat);

        if constexpr (kComputesDelta) {
            mbarrier_wait(Traits::delta_full(base, ring.stage), ring.phase);
        }
        const float* stats = reinterpret_cast<const float*>(smem + Traits::kStats + ring.stage * Traits::kStatsBytes);
        transposed_probabilities_and_gradients<kBlockM, kBlockN>(ctx, ctx.mask_of_head(walk.head),
                                                                 ctx.score_of_head(params, block.batch, walk.head),
                                                                 s, dp, stats, m_start, score_col0, consumer_n_start,
                                                                 consumer_n_start + warp_key0, lane_index_now());
        // P^T and dS^T rounded to the element type: dS^T to shared memory for
        // dQ (same swizzle as the tiles), and both as the A operands of dV
        // and dK, from registers, or where the consumers split the head dim
        // (each holding its queries' share), from shared memory too.
        u32 p_frag[kScoreCols / 16][4];
        u32 ds_frag[kScoreCols / 16][4];
#pragma unroll
        for (int ps = 0; ps < kScoreCols / 16; ++ps) {
            pack_a_fragment<Element>(p_frag[ps], s[0][2 * ps], s[0][2 * ps + 1]);
            pack_a_fragment<Element>(ds_frag[ps], dp[0][2 * ps], dp[0][2 * ps + 1]);
        }
        stage_swizzled_fragments<DsTile, kQTiles>(ds_tile, ds_frag, warp_key0, score_col0, lane_index_now());
        if constexpr (kSplitHeadDim) {
            stage_swizzled_fragments<DsTile, kQTiles>(ds_tile + DsTile::kBytes, p_frag, warp_key0, score_col0,
                                                      lane_index_now());
        }
        fence_async_shared();  // dS^T (P^T), written by ordinary stores, is read by the tensor cores
        if constexpr (kSplitHeadDim) {
            // Every consumer's queries of P^T and dS^T are in shared memory.
            named_barrier_sync(kConsumersBarrier, kConsumerThreads);
        }

        wgmma_fence();
#pragma unroll
        for (int ps = 0; ps < Traits::kRowSteps; ++ps) {
            const u64 do_step = do_mn_descriptor + q_buffer + mn_major_k_step<QTile>(ps);
            if constexpr (kSplitHeadDim) {
                Wgmma<Element, kAccCols>::ss_mn_major_b(
                    dv_flat, pt_descriptor + score_buffer * kScoreBufferStep + kmajor_k_step<DsTile>(ps), do_step, 1);
            } else {
                Wgmma<Element, kAccCols>::rs(dv_flat, p_frag[ps], do_step, 1);
            }
        }
#pragma unroll
        for (int ps = 0; ps < Traits::kRowSteps; ++ps) {
            const u64 q_step = q_mn_descriptor + q_buffer + mn_major_k_step<QTile>(ps);
            if constexpr (kSplitHeadDim) {
                Wgmma<Element, kAccCols>::ss_mn_major_b(
                    dk_flat, ds_descriptor + score_buffer * kScoreBufferStep + kmajor_k_step<DsTile>(ps), q_step, 1);
            } else {
                Wgmma<Element, kAccCols>::rs(dk_flat, ds_frag[ps], q_step, 1);
            }
        }
        wgmma_commit();
        if constexpr (!kSplitHeadDim) {
            // Every consumer's dS^T is in shared memory (split: passed before dV and dK).
            named_barrier_sync(kConsumersBarrier, kConsumerThreads);
        }
        // dV and dK are done before dQ's product starts: their A fragments
        // (P^T, dS^T) and dQ's accumulators would not fit in registers
        // together. They have read this step's Q and dO: the load warp may
        // refill the buffer.
        wgmma_wait<0>();
        pin_registers(dv_flat);
        pin_registers(dk_flat);
        mbarrier_arrive(Traits::q_empty(base, ring.stage));
        // dQ's product, where this consumer takes this step's (the other, by
        // turns, goes on to the next step's products meanwhile).
        if (takes_dq(step)) {
            // In chunks of kDqChunk columns (WgmmaBackwardTraits), each scaled
            // into the dQ tile once the dQ warp has read the previous one.
#pragma unroll
            for (int chunk = 0; chunk < kDqCols / kDqChunk; ++chunk) {
                const int chunk_col0 = dq_col0 + chunk * kDqChunk;
                const u64 k_chunk_descriptor =
                    k_mn_descriptor + ((chunk * kDqChunk / KvTile::kPanelCols * KvTile::kPanelBytes) >> 4);
                float dq[1][kDqChunk / 8][4];
                float(&dq_flat)[kDqChunk / 2] = reinterpret_cast<float(&)[kDqChunk / 2]>(dq);
#pragma unroll
                for (int ks = 0; ks < Traits::kKeySteps; ++ks) {
                    Wgmma<Element, kDqChunk>::ss_mn_major(
                        dq_flat, ds_mn_descriptor + score_buffer * kScoreBufferStep + mn_major_k_step<DsTile>(ks),
                        k_chunk_descriptor + mn_major_k_step<KvTile>(ks), ks > 0);
                }
                wgmma_commit();
                wgmma_wait<0>();
                pin_registers(dq_flat);
                pin_registers(dv_flat);
                pin_registers(dk_flat);
                if (chunk == 0) {
                    // The previous step's tile read (the phase before this
                    // step's). By turns the other consumer wrote it, and
                    // waited for the one before, ahead of this step's named
                    // barrier: so the barrier is past that phase, and this
                    // parity cannot match an older one.
                    mbarrier_wait(dq_empty, (step & 1) ^ 1);
                }
                if constexpr (kDirectDq) {
                    // dQ rounded once, to the input dtype, in Q's layout (the map's boxes).
                    const int lane_now = lane_index_now();
#pragma unroll
                    for (int j = 0; j < kDqChunk / 8; ++j) {
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int offset = QTile::chunk_offset(dq_row0 + lane_now / 4 + 8 * half, chunk_col0 / 8 + j) +
                                               4 * (lane_now % 4);
                            *reinterpret_cast<u32*>(smem + Traits::kDq + offset) =
                                pack_pair<Element>(dq[0][j][2 * half] * scale, dq[0][j][2 * half + 1] * scale);
                        }
                    }
                } else {
                    const auto dq_lane = DqTile::fragment_lane(dq_row0, lane_index_now());
#pragma unroll
                    for (int j = 0; j < kDqChunk / 8; ++j) {
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int offset = dq_lane.offset(chunk_col0 + 8 * j, half);
                            *reinterpret_cast<float2*>(smem + Traits::kDq + offset) =
                                make_float2(dq[0][j][2 * half] * scale, dq[0][j][2 * half + 1] * scale);
                        }
                    }
                }
            }
            if constexpr (!kDqHandOverLate) {
                hand_over_dq_tile();
            }
        }

        walk.advance();
        ring.advance();
    }
    if (kDqHandOverLate && walk.steps > 0 && takes_dq(walk.steps - 1)) {
        hand_over_dq_tile();  // the last step's
    }

    // Epilogue: once every consumer is past its last read of K and V (dQ's
    // product reads all of K), each warp stages its 16 rows of dK (scaled)
    // and dV there (same swizzle) and stores them 16 bytes at a time. Keys
    // past seqlen_k and padded columns are not written; with no visible
    // query the results are zeros.
    named_barrier_sync(kConsumersBarrier, kConsumerThreads);
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
    store_warp_rows<KvTile, kAccCols>(block.key_row<Element>(params.dk, block.kv_head, consumer_n_start),
                                      params.dk.row_stride, tiles[0], warp_key0, ctx.seqlen_k - consumer_n_start,
                                      ctx.head_dim, lane, acc_col0);
    store_warp_rows<KvTile, kAccCols>(block.key_row<Element>(params.dv, block.kv_head, consumer_n_start),
                                      params.dv.row_stride, tiles[1], warp_key0, ctx.seqlen_k - consumer_n_start,
                                      ctx.head_dim, lane, acc_col0);
#else
    // Built only for sm_90a (the launcher picks this kernel on compute capability 9.0 alone).
    __trap();
#endif
}

}  // namespace cuflash
