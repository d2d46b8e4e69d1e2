// FlashAttention-2 forward pass on tensor cores (float16, bfloat16, and
// float32 by 3xTF32; sm_80+).
//
// One thread block per (query block, head, batch), kWarps warps, each owning
// kRowsPerWarp query rows. S = Q K^T and O += P V are mma.sync products
// (m16n8k16 on 16-bit inputs, three m16n8k8.tf32 per product on float32:
// MmaOperands in mma_operands.cuh) with float32 accumulators fed by
// ldmatrix (float32 V by 32-bit shared loads); the probabilities P go from
// the S accumulators to the A operand
// of P V in registers. The online softmax works on the accumulator
// fragments, so S never touches shared memory.
//
// Pipeline (kKvStages in MmaForwardTraits): with a ring of two or more K/V
// buffers, one barrier per key block; after it every warp is done with the
// previous block's buffers, which then take the K and V of the block
// kKvStages - 1 ahead by cp.async while this block is computed. With one
// buffer each (FlashAttention-2's schedule, two barriers per block), V_j is
// copied while S_j = Q K_j^T is computed and K_{j-1} while P_j V_j is. Key blocks are visited from the last to the
// first, so the blocks that need masking (the partial last block, the causal
// diagonal) come first and the rest run mask-free.
//
// Decoding's query blocks are one m16 tile (the query rows that share a
// K/V head) whose warps split each key block's keys (kWarpsSplitKeys,
// MmaForwardTraits), each with its own softmax state, merged at the end
// through shared memory (WarpStateMerge, forward_epilogue.cuh).
//
// Split-KV (kSplitKv, decoding): each query block's keys are cut into
// params.num_splits ranges (split_key_blocks), one thread block each, which
// writes its rows' float32 output and log-sum-exp for its range alone to
// the partial buffers; merge_states.cu combines them.
//
// KV caches (Batch CacheBatch or PagedBatch, block_info.cuh): each entry
// has its own key count; a paged cache's key tiles are gathered row by row
// through the block table: with two K/V buffers, the page numbers of the
// next tile are read while this one is computed (paged_keys.cuh).
//
// Copy-engine K/V (kKvTma, Hopper's decode tiles): K and V of each key
// block come by tensor maps (tma.cuh) into swizzled buffers
// (MmaForwardTraits), completing on the stage's mbarrier: one box of the
// block's rows, copied by thread 0, or in a paged cache one box per page
// the block spans (or the block's rows of one page), each box copied by its
// own thread, the warps taking turns, the pages looked up as the copies are
// issued. A stream of such copies reads HBM at the rate cuDNN's decoding
// does (3.06-3.14 TB/s measured on the H100, against 2.88-2.96 for cp.async
// rings: docs/perf-notes.md). Rows past the sequence's last key arrive as
// whatever the cache holds there (zeros past the tensor; a paged block's
// boxes past the last key are not copied): masking sends their scores to
// -inf, and V's rows are zeroed once landed, because a NaN there would
// survive its zero probability.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "tensor_core_traits.cuh"
#include "async_copy.cuh"
#include "mma.cuh"
#include "mma_operands.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "online_softmax.cuh"
#include "forward_epilogue.cuh"
#include "paged_keys.cuh"
#include "cluster_states.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "grid_dependency.cuh"

namespace cuflash {

// One thread block's work: the kernels below are its entry points.
// Params: ForwardParams, or WgmmaForwardParams (its K and V maps) with kKvTma.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kKvStages, bool kSplitKv, bool kWarpsSplitKeys, int kClusterSplits, bool kKvTma,
          typename Params>
__device__ __forceinline__ void forward_mma_block(const Params& params) {
    using Traits = MmaForwardTraits<Element, kHeadDim, kBlockM, kBlockN, kWarps, kKvStages, kWarpsSplitKeys, kKvTma>;
    using KvTile = typename Traits::KvTile;
    constexpr bool kClustered = kClusterSplits > 1;
    static_assert(!kKvTma || !Batch::kPacked, "copy-engine K/V: a tensor map over each entry's keys, or the pages");
    static_assert(!kClustered || (kSplitKv && kWarpsSplitKeys && !Batch::kPacked && sizeof(Element) == 2),
                  "cluster-merged splits: decoding's one-tile blocks on 16-bit inputs");
    static_assert(!kClustered || ClusterStateLayout<kBlockM, kHeadDim>::kBytes <= kKvStages * Traits::kKvTileBytes,
                  "a cluster block's staged rows fit in its V buffers");
    constexpr int kMTiles = Traits::kMTiles;
    constexpr int kNTiles = Traits::kNTiles;
    constexpr int kDTiles = Traits::kDTiles;
    constexpr int kStride = Traits::kStride;
    constexpr int kElementBytes = int(sizeof(Element));
    constexpr int kKStep = Traits::kKStep;
    using Operands = MmaOperands<Element, kStride>;
    static_assert(Operands::kKStep == kKStep, "one k step: 32 bytes of k in the traits and the operands");

    require_shared_memory<Traits>();
    unsigned char* smem = shared_tile<unsigned char>(0);
    if constexpr (kKvTma) {
        aligned_shared_base<Traits::kAlignment>(smem);
    }
    Element* q_tile = reinterpret_cast<Element*>(smem + Traits::kQ);
    Element* k_tile = reinterpret_cast<Element*>(smem + Traits::kK);
    Element* v_tile = reinterpret_cast<Element*>(smem + Traits::kV);
    const u32 kv_full = shared_address(smem + Traits::kKvFull);  // stage s's mbarrier: kv_full + 8 s (kKvTma)
    // Launched as a dependent (decoding on Hopper), this block may start
    // while the kernel ahead of it on the stream runs: every global access,
    // reads (the sequence lengths first) and writes alike, follows the
    // wait. The block's place in the grid (parameters and block index only)
    // is computed before it, its parameter reads and divisions overlapping
    // the kernel ahead. (The mbarriers are initialised below, not before
    // it: there the d128 causal two-block cluster variant spilled.)
    const index_t num_splits = kSplitKv ? params.num_splits : 1;
    const QueryCoordinates coordinates =
        query_coordinates<Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM, num_splits);
    coordinates.materialise();
    warm_sequence_parameters(params.size);
    wait_for_prerequisite_grids();

    // This block's query tile. Computed again for the epilogue (block_index
    // is volatile), so that batch, head and m_start do not hold registers
    // through the main loop, where the accumulators need every one.
    const QueryBlock origin = query_block_at<Batch>(params.size, coordinates);
    const BlockContext<Mask, Score> ctx(params, origin);
    // A packed batch's grid covers its longest sequence; the blocks past a
    // shorter one's end have no rows.
    if (Batch::kPacked && origin.m_start >= ctx.seqlen_q) {
        return;
    }

    const int thread = threadIdx.x;
    const int warp = thread / 32;
    const int lane = thread % 32;
    const int m_start = origin.m_start;
    const int warp_row0 = kWarpsSplitKeys ? 0 : warp * Traits::kRowsPerWarp;  // this warp's first row in the block
    const int warp_key0 = kWarpsSplitKeys ? warp * Traits::kWarpKeys : 0;  // this warp's first key in a key block

    const Element* q = origin.query_row<const Element>(params.q, origin.head, m_start);
    // The head's first key of K and V (not in a paged cache, whose rows are found per key).
    const Element* k = Batch::kPaged ? nullptr : origin.key_row<const Element>(params.k, origin.kv_head, 0);
    const Element* v = Batch::kPaged ? nullptr : origin.key_row<const Element>(params.v, origin.kv_head, 0);
    const BlockRange visible = ctx.mask.key_blocks(m_start, kBlockM, kBlockN);
    const BlockRange key_range =
        kSplitKv ? split_key_blocks(visible, ctx.seqlen_k, kBlockN, origin.split, static_cast<int>(num_splits))
                 : visible;
    const Mask block_mask = ctx.mask.rows_from(m_start);  // rows counted from m_start, see masks.cuh

    // A paged cache's page numbers, read a tile ahead where the K/V
    // buffers are two (the next tile's are fetched while this one is
    // computed; with one buffer K and V of a tile load an iteration apart).
    // Not with copy-engine K/V, whose issuing threads look the pages up as
    // they issue the boxes.
    using PagedRows = PagedKeyRows<kBlockN, kHeadDim, Traits::kThreads, Element>;
    constexpr bool kPrefetchPages = Batch::kPaged && !kKvTma && kKvStages >= 2 && PagedRows::kPrefetches;
    PagedRows pages;
    // Copies key block n_block of K or V (`t`, whose head's first key is
    // `rows`) into buffer `stage` of `tile`: rows a stride apart, or in a
    // paged cache gathered row by row through the block table (a page may
    // hold fewer rows than a block): from the prefetched page numbers, or
    // looked up as they are copied.
    const auto load_key_block = [&](Element* tile, const TensorRef& t, const Element* rows, int n_block,
                                    int stage) {
        const int n_start = n_block * kBlockN;
        Element* buffer = tile + stage * (Traits::kKvTileBytes / kElementBytes);
        if constexpr (kPrefetchPages) {
            pages.template load<kStride>(buffer, t, origin.kv_head, ctx.head_dim, thread);
        } else if constexpr (Batch::kPaged) {
            load_rows_async<kBlockN, kHeadDim, kStride, Traits::kThreads>(
                buffer,
                [&](int row) { return key_row<Batch, const Element>(origin, t, origin.kv_head, n_start + row); },
                ctx.seqlen_k - n_start, ctx.head_dim, thread);
        } else {
            load_tile_async<kBlockN, kHeadDim, kStride, Traits::kThreads>(
                buffer, rows + static_cast<index_t>(n_start) * t.row_stride, t.row_stride,
                ctx.seqlen_k - n_start, ctx.head_dim, thread);
        }
    };
    const auto load_keys = [&](int n_block, int stage) { load_key_block(k_tile, params.k, k, n_block, stage); };
    const auto load_values = [&](int n_block, int stage) { load_key_block(v_tile, params.v, v, n_block, stage); };
    // Copy-engine K/V over pages: a box each page's rows (or the block's
    // rows in a page), box b issued by lane b / kWarps of warp b % kWarps.
    // Spread over the warps, not issued by one: the warp that issues a
    // block's copies reaches the loop's next barrier late, by more the more
    // copies it issues (all from warp 0, 16-row pages took 17.5 us where
    // 32-row ones took 15.8, the bytes being the same: 1 x 16384 keys, 4 K/V
    // heads, K/V in L2; spread, 15.0 and 14.9, H100). Each thread reads its
    // box's page number for the block issued next as it issues this one's,
    // so the table read (a dependent global load) is off the loop's critical
    // path: nothing uses the loaded value until then (the clamp neither).
    const int box_rows = Batch::kPaged ? min(origin.page_size, kBlockN) : kBlockN;
    const int box_row0 = (lane * kWarps + warp) * box_rows;  // this thread's box's first row in a key block
    int next_box_page = 0;
    const auto read_box_page = [&](int n_block) {
        const int key = n_block * kBlockN + box_row0;
        if (n_block >= key_range.begin && box_row0 < kBlockN && key < ctx.seqlen_k) {
            next_box_page = __ldg(origin.pages + key / origin.page_size);
        }
    };
    // K and V of key block n_block into buffer `stage` of a ring.
    const auto load_key_values = [&](int n_block, int stage) {
        if constexpr (kKvTma) {
            const u32 full = kv_full + 8 * stage;
            const u32 k_buffer = shared_address(k_tile) + stage * Traits::kKvTileBytes;
            const u32 v_buffer = shared_address(v_tile) + stage * Traits::kKvTileBytes;
            const int n_start = n_block * kBlockN;
            if constexpr (Batch::kPaged) {
                // Boxes up to the last key, from the page numbers read when
                // the block before was issued (read_box_page). Boxes of other
                // warps may land before thread 0 expects their bytes: the
                // stage's tx-count may go below zero, and its phase cannot
                // complete before thread 0's arrival, which brings the total.
                const int rows = min(kBlockN, ceil_div(ctx.seqlen_k - n_start, box_rows) * box_rows);
                if (thread == 0) {
                    mbarrier_arrive_expect_tx(full, 2 * rows * (KvTile::kBytes / kBlockN));
                }
                if (box_row0 < rows) {
                    const int in_page = (n_start + box_row0) % origin.page_size;
                    const u32 offset = box_row0 * KvTile::kSwizzleBytes;
                    // Clamped as paged_key_row does: a bad page number reads a wrong page, inside the cache.
                    const int page = min(max(next_box_page, 0), origin.num_pages - 1);
                    tma_load_tile<KvTile>(k_buffer + offset, params.k_map, full, in_page, origin.kv_head, page);
                    tma_load_tile<KvTile>(v_buffer + offset, params.v_map, full, in_page, origin.kv_head, page);
                }
                read_box_page(n_block - 1);  // blocks are issued from the last to the first
            } else if (thread == 0) {
                const int row = static_cast<int>(origin.k_row0) + n_start;
                mbarrier_arrive_expect_tx(full, 2 * KvTile::kBytes);
                tma_load_tile<KvTile>(k_buffer, params.k_map, full, row, origin.kv_head, origin.tensor_batch);
                tma_load_tile<KvTile>(v_buffer, params.v_map, full, row, origin.kv_head, origin.tensor_batch);
            }
        } else {
            load_keys(n_block, stage);
            load_values(n_block, stage);
        }
    };
    if constexpr (kKvTma) {
        if (thread == 0) {
            for (int s = 0; s < kKvStages; ++s) {
                mbarrier_init(kv_full + 8 * s, 1);
            }
            mbarrier_init_fence();
        }
        __syncthreads();
    }
    // A block whose rows see no key (causal, seqlen_q > seqlen_k) loads
    // nothing and writes zeros and -inf.
    if (key_range.end > key_range.begin) {
        load_tile_async<kBlockM, kHeadDim, kStride, Traits::kThreads>(q_tile, q, params.q.row_stride,
                                                                      ctx.seqlen_q - m_start, ctx.head_dim, thread);
        if constexpr (kPrefetchPages) {
            pages.fetch(origin, (key_range.end - 1) * kBlockN, thread);
        }
        if constexpr (kKvTma && Batch::kPaged) {
            read_box_page(key_range.end - 1);
        }
        if constexpr (kKvStages >= 2) {
            load_key_values(key_range.end - 1, 0);
        } else {
            load_keys(key_range.end - 1, 0);
        }
        if constexpr (kPrefetchPages) {
            pages.fetch(origin, (key_range.end - 2) * kBlockN, thread);  // read while block end - 1 is computed
        }
    }
    cp_async_commit();
    // Copy groups (one per key block) that may still be in flight while a
    // block is used: the ones after it in a ring of kKvStages buffers.
    constexpr int kGroupsInFlight = kKvStages >= 2 ? kKvStages - 2 : 0;
    // A ring of more than two buffers starts with its first kKvStages - 1
    // blocks in flight, one copy group each (empty past the range's start).
#pragma unroll
    for (int ahead = 1; ahead < kKvStages - 1; ++ahead) {
        if (key_range.end - 1 - ahead >= key_range.begin) {
            load_key_values(key_range.end - 1 - ahead, ahead);
            if constexpr (kPrefetchPages) {
                pages.fetch(origin, (key_range.end - 2 - ahead) * kBlockN, thread);
            }
        }
        cp_async_commit();
    }

    // Per-lane shared addresses (bytes), see mma_operands.cuh for the layouts.
    // Q (A operand): matrices (rows 0-7 | 8-15) x (the k step's first | second 16 bytes).
    const u32 q_address = shared_address(q_tile) + Operands::a(lane, warp_row0);
    // K (B operand of Q K^T): matrices (keys 0-7: first | second 16 bytes), (keys 8-15: ...), two n8 tiles per load.
    // V (B operand of P V, k along the keys): two n8 tiles of d per load. The
    // swizzled buffers (kKvTma) address the same rows and chunks by
    // SwizzledLaneRow, the padded ones by a fixed offset a row.
    const u32 k_address = kKvTma ? shared_address(k_tile)
                                 : shared_address(k_tile) + Operands::b(lane) + warp_key0 * kStride * kElementBytes;
    const u32 v_address = kKvTma ? shared_address(v_tile)
                                 : shared_address(v_tile) + Operands::v_lane(lane) + warp_key0 * kStride * kElementBytes;
    const SwizzledLaneRow<KvTile> k_lane(lane % 8 + lane / 16 * 8, lane / 8 % 2);
    const SwizzledLaneRow<KvTile> v_lane(lane % 8 + lane / 8 % 2 * 8, lane / 16);

    float o[kMTiles][kDTiles][4];
    fill_fragments(o, 0.0f);
    FragmentOnlineSoftmax<kMTiles> softmax;
    softmax.init();
    u32 q_fragments[Traits::kQInRegisters ? kMTiles : 1][Traits::kQInRegisters ? Traits::kQkSteps : 1][4];
    if constexpr (Traits::kQInRegisters) {
        // Q's fragments, once: Q arrives with the first key block's copies.
        cp_async_wait<kGroupsInFlight>();
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
                ldmatrix_x4(q_fragments[mt][ks], q_address + (mt * 16 * kStride + ks * kKStep) * kElementBytes);
            }
        }
    }

    // Key blocks from the last to the first; `stage` is the buffer holding
    // block n_block. One counter, not two: the loop is short of registers.
    // tma_phases: bit s, the parity of the phase stage s's mbarrier completes next.
    int stage = 0;
    u32 tma_phases = 0;
    for (int n_block = key_range.end - 1; n_block >= key_range.begin; --n_block) {
        const int n_start = n_block * kBlockN;
        // This block's K (and V with a ring, Q first time round) has landed
        // for every thread: of the copy groups, only the kKvStages - 2 blocks
        // after it may still be in flight. Every warp is done with the
        // previous block, whose buffers take the block kKvStages - 1 ahead.
        cp_async_wait<kGroupsInFlight>();
        if constexpr (kKvTma) {
            mbarrier_wait(kv_full + 8 * stage, tma_phases >> stage & 1);
            tma_phases ^= 1u << stage;
            if (n_start + kBlockN > ctx.seqlen_k) {
                // V's rows past the last key to zeros (see the top of the
                // file), before the copy engine may overwrite the buffer.
                zero_swizzled_rows<KvTile, Traits::kThreads>(shared_address(v_tile) + stage * Traits::kKvTileBytes,
                                                             ctx.seqlen_k - n_start, thread);
                fence_async_shared();
            }
        }
        __syncthreads();
        if constexpr (kKvStages >= 2) {
            const int next = n_block - (kKvStages - 1);
            if (next >= key_range.begin) {
                const int next_stage = kKvStages == 2 ? stage ^ 1 : (stage == 0 ? kKvStages - 1 : stage - 1);
                load_key_values(next, next_stage);
                if constexpr (kPrefetchPages) {
                    pages.fetch(origin, (next - 1) * kBlockN, thread);
                }
            }
        } else {
            load_values(n_block, 0);
        }
        cp_async_commit();
        const u32 stage_offset = stage * Traits::kKvTileBytes;

        // S = Q K^T, raw scores.
        float s[kMTiles][kNTiles][4];
        fill_fragments(s, 0.0f);
#pragma unroll
        for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
            u32 a[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                if constexpr (Traits::kQInRegisters) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        a[mt][i] = q_fragments[mt][ks][i];
                    }
                } else {
                    ldmatrix_x4(a[mt], q_address + (mt * 16 * kStride + ks * kKStep) * kElementBytes);
                }
            }
#pragma unroll
            for (int np = 0; np < kNTiles / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, kKvTma ? k_lane.address(k_address + stage_offset, warp_key0 + np * 16, ks * kKStep / 8)
                                      : k_address + stage_offset + (np * 16 * kStride + ks * kKStep) * kElementBytes);
                Operands::mma_two_n8_tiles(s, [&](int mt) -> const u32(&)[4] { return a[mt]; }, b, np);
            }
        }

        apply_score_transform(ctx.score, s, m_start + warp_row0, n_start + warp_key0, lane);
        if (key_block_needs_mask(block_mask, 0, kBlockM, n_start, kBlockN)) {
            apply_mask_to_fragments(block_mask, s, warp_row0, n_start + warp_key0, lane);
        }
        float rescale[2 * kMTiles];
        softmax.update(s, ctx.scale_log2, rescale);
        drop_probabilities(ctx.score, s, m_start + warp_row0, n_start + warp_key0, lane);
        // Unconditional: the factors are mostly 1 (see FragmentOnlineSoftmax),
        // but skipping the multiplies behind a warp vote measured 1-4% slower
        // on the H100 (the branch splits the schedule around it).
        scale_fragment_rows(o, rescale);

        // P rounded to the element type for P V (as FlashAttention does; its
        // float32 row sums were taken before rounding), packed now so that
        // the float32 scores are dead before the V loop (3xTF32: P itself,
        // its k slots permuted, see mma_operands.cuh).
        u32 p[kMTiles][Traits::kPvSteps][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int ps = 0; ps < Traits::kPvSteps; ++ps) {
                Operands::p_a(p[mt][ps], s[mt], ps);
            }
        }

        if constexpr (kKvStages == 1) {
            // V_j has landed for every thread, and every warp is done with
            // K_j, whose buffer now takes K_{j-1} while P V runs.
            cp_async_wait<0>();
            __syncthreads();
            if (n_block > key_range.begin) {
                load_keys(n_block - 1, 0);
            }
            cp_async_commit();
        }

        // O += P V.
#pragma unroll
        for (int ps = 0; ps < Traits::kPvSteps; ++ps) {
#pragma unroll
            for (int dp = 0; dp < kDTiles / 2; ++dp) {
                u32 b[4];
                if constexpr (kKvTma) {
                    ldmatrix_x4_trans(b, v_lane.address(v_address + stage_offset, warp_key0 + ps * 16, dp * 2));
                } else {
                    Operands::v_b(b, v_address + stage_offset, ps, dp);
                }
                Operands::mma_two_n8_tiles(o, [&](int mt) -> const u32(&)[4] { return p[mt][ps]; }, b, dp);
            }
        }
        if constexpr (kKvStages >= 2) {
            // (The xor for two: the same code as before the ring was
            // generalised; its select spilled a d32 variant on sm_90a.)
            stage = kKvStages == 2 ? stage ^ 1 : (stage == kKvStages - 1 ? 0 : stage + 1);
        }
    }

    if constexpr (kWarpsSplitKeys) {
        // Every warp is done with the K/V buffers (and no copy is in
        // flight) before they take the warps' states (WarpStateMerge); every
        // thread then writes a share of the block's merged rows.
        cp_async_wait<0>();
        __syncthreads();
        using Merge = WarpStateMerge<kBlockM, kHeadDim, kWarps>;
        static_assert(Merge::kBytes <= 2 * kKvStages * Traits::kKvTileBytes, "the warps' states fit in the K/V buffers");
        // (Recomputed before the merge, not after: after it, ptxas spilled a
        // main-loop register of the d64 causal split variant.)
        const QueryBlock block =
            query_block<Batch, Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM, num_splits);
        Merge merged;
        merged.merge(softmax, o, reinterpret_cast<float*>(k_tile), warp, lane);
        const int rows = ctx.seqlen_q - block.m_start;  // of the block, in the problem
        const int head_dim = ctx.head_dim;
        float* lse = params.lse_row(block.tensor_batch, block.head) + block.q_row0 + block.m_start;
        if constexpr (kClustered) {
            // The block's rows, normalised, and their log-sum-exp staged in
            // the V buffers (the merge's buffer may reach into them: a
            // barrier first); every thread of the cluster then merges the
            // cluster's states, and stays until every block is done reading
            // the others' rows.
            using Staged = ClusterStateLayout<kBlockM, kHeadDim>;
            float* staged = reinterpret_cast<float*>(v_tile);
            __syncthreads();
            merged.for_each_pair(warp, lane, [&](int row, int col, float2 pair) {
                *reinterpret_cast<float2*>(staged + row * kHeadDim + col) = pair;
            });
            merged.for_each_row_lse(thread, [&](int row, float row_lse) { staged[Staged::kLse / 4 + row] = row_lse; });
            cluster_barrier();
            Element* out = block.query_row<Element>(params.out, block.head, block.m_start);
            merge_cluster_states<kClusterSplits, kBlockM, kHeadDim, Traits::kThreads>(
                shared_address(staged), rows, head_dim, thread,
                [&](int row, int col, float4 values) {
                    Element* dst = out + static_cast<index_t>(row) * params.out.row_stride + col;
                    if (col + 4 <= head_dim) {
                        *reinterpret_cast<uint2*>(dst) = make_uint2(pack_pair<Element>(values.x, values.y),
                                                                    pack_pair<Element>(values.z, values.w));
                    } else {
                        const float parts[4] = {values.x, values.y, values.z, values.w};
                        for (int i = 0; col + i < head_dim; ++i) {
                            dst[i] = from_float<Element>(parts[i]);
                        }
                    }
                },
                [&](int row, float row_lse) { lse[row] = row_lse; });
            cluster_barrier_before_exit();
        } else if constexpr (kSplitKv) {
            // A split's rows: float32 pairs, each quad's 32 bytes of a row at once.
            float* out = block.query_row<float>(params.out, block.head, block.m_start) +
                         block.split * params.out_split_stride;
            float* split_lse = lse + block.split * params.lse_split_stride;
            const index_t row_stride = params.out.row_stride;
            merged.for_each_pair(warp, lane, [=](int row, int col, float2 pair) {
                if (row < rows && col < head_dim) {
                    *reinterpret_cast<float2*>(out + static_cast<index_t>(row) * row_stride + col) = pair;
                }
            });
            merged.for_each_row_lse(thread, [=](int row, float row_lse) {
                if (row < rows) {
                    split_lse[row] = row_lse;
                }
            });
        } else {
            // Staged in the Q tile (free: Q was last read in the key loop,
            // before merge's first barrier), then 16-byte coalesced stores.
            using Pair = StagedPair<Element>;
            merged.for_each_pair(warp, lane, [&](int row, int col, float2 pair) {
                *reinterpret_cast<typename Pair::Type*>(q_tile + row * kStride + col) = Pair::make(pair.x, pair.y);
            });
            merged.for_each_row_lse(thread, [&](int row, float row_lse) {
                if (row < rows) {
                    lse[row] = row_lse;
                }
            });
            __syncthreads();
            constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;
            Element* out = block.query_row<Element>(params.out, block.head, block.m_start);
#pragma unroll
            for (int i = 0; i < ceil_div(kBlockM * kChunksPerRow, Traits::kThreads); ++i) {
                const int chunk = thread + i * Traits::kThreads;
                const int row = chunk / kChunksPerRow;
                const int col = chunk % kChunksPerRow * (16 / kElementBytes);
                if ((kBlockM * kChunksPerRow % Traits::kThreads == 0 || chunk < kBlockM * kChunksPerRow) &&
                    row < rows && col < head_dim) {
                    *reinterpret_cast<uint4*>(out + static_cast<index_t>(row) * params.out.row_stride + col) =
                        *reinterpret_cast<const uint4*>(q_tile + row * kStride + col);
                }
            }
        }
        return;
    }
    if constexpr (kSplitKv) {
        const QueryBlock block =
            query_block<Batch, Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM, num_splits);
        const int first_row = block.m_start;
        // A split's rows are a few float32 pairs each (decoding): written from
        // the fragments, each quad's 32 bytes of a row at once. Rows and
        // columns past the problem are not written.
        float* out = block.query_row<float>(params.out, block.head, first_row) + block.split * params.out_split_stride;
        finish_forward_rows<float>(softmax, o, params.lse_row(block.tensor_batch, block.head) + block.q_row0 +
                                                   block.split * params.lse_split_stride,
                                   first_row, warp_row0, ctx.seqlen_q, lane, [&](int row_in_block, int dt, float2 pair) {
                                       const int col = dt * 8 + 2 * (lane % 4);
                                       if (first_row + row_in_block < ctx.seqlen_q && col < ctx.head_dim) {
                                           *reinterpret_cast<float2*>(
                                               out + static_cast<index_t>(row_in_block) * params.out.row_stride + col) =
                                               pair;
                                       }
                                   });
        return;
    }
    // Epilogue. Every warp read only its own rows of the Q tile, so it can
    // stage its normalised output there once its own reads are done (and no
    // copy into shared memory is still in flight).
    cp_async_wait<0>();
    __syncwarp();
    const QueryBlock block = query_block<Batch, Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM);
    const int first_row = block.m_start;
    finish_forward_rows<Element>(softmax, o, params.lse_row(block.tensor_batch, block.head) + block.q_row0, first_row,
                                 warp_row0, ctx.seqlen_q, lane, [&](int row_in_block, int dt, auto pair) {
                                     // pair: two elements, so pair dt * 4 is element 8 dt of the row's n8 tiles
                                     reinterpret_cast<decltype(pair)*>(q_tile + row_in_block * kStride +
                                                                       2 * (lane % 4))[dt * 4] = pair;
                                 });
    __syncwarp();
    // 16-byte coalesced stores of the warp's rows; rows past seqlen_q and
    // padded head-dim columns are not written.
    constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;
    constexpr int kWarpChunks = Traits::kRowsPerWarp * kChunksPerRow;
    Element* out = block.query_row<Element>(params.out, block.head, first_row);
#pragma unroll
    for (int i = 0; i < ceil_div(kWarpChunks, 32); ++i) {
        const int chunk = lane + i * 32;
        const int row_in_block = warp_row0 + chunk / kChunksPerRow;
        const int col = chunk % kChunksPerRow * (16 / kElementBytes);
        if ((kWarpChunks % 32 == 0 || chunk < kWarpChunks) && first_row + row_in_block < ctx.seqlen_q &&
            col < ctx.head_dim) {
            *reinterpret_cast<uint4*>(out + static_cast<index_t>(row_in_block) * params.out.row_stride + col) =
                *reinterpret_cast<const uint4*>(q_tile + row_in_block * kStride + col);
        }
    }
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kKvStages, bool kSplitKv, bool kWarpsSplitKeys>
__global__ void __launch_bounds__(kWarps * 32) flash_forward_mma_kernel(const ForwardParams params) {
    forward_mma_block<Element, kHeadDim, kBlockM, kBlockN, kWarps, Mask, Score, Batch, kKvStages, kSplitKv,
                      kWarpsSplitKeys, 1, false>(params);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// Split-KV whose kClusterSplits key ranges of a query block run as one
// thread-block cluster (consecutive blocks: the grid's splits are its
// fastest index) and merge in it (cluster_states.cuh). Hopper on.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kKvStages, bool kWarpsSplitKeys, int kClusterSplits>
__global__ void __cluster_dims__(kClusterSplits, 1, 1) __launch_bounds__(kWarps * 32)
    flash_forward_mma_cluster_kernel(const ForwardParams params) {
    forward_mma_block<Element, kHeadDim, kBlockM, kBlockN, kWarps, Mask, Score, Batch, kKvStages, true,
                      kWarpsSplitKeys, kClusterSplits, false>(params);
}

// The same two with copy-engine K/V (kKvTma): the parameters carry the
// tensor maps of K and V (WgmmaForwardParams' maps; its Q map is unused),
// __grid_constant__ so that the copy engine reads them in place.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kKvStages, bool kSplitKv, bool kWarpsSplitKeys>
__global__ void __launch_bounds__(kWarps * 32) flash_forward_mma_tma_kernel(const __grid_constant__ WgmmaForwardParams params) {
    forward_mma_block<Element, kHeadDim, kBlockM, kBlockN, kWarps, Mask, Score, Batch, kKvStages, kSplitKv,
                      kWarpsSplitKeys, 1, true>(params);
}

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kKvStages, bool kWarpsSplitKeys, int kClusterSplits>
__global__ void __cluster_dims__(kClusterSplits, 1, 1) __launch_bounds__(kWarps * 32)
    flash_forward_mma_tma_cluster_kernel(const __grid_constant__ WgmmaForwardParams params) {
    forward_mma_block<Element, kHeadDim, kBlockM, kBlockN, kWarps, Mask, Score, Batch, kKvStages, true,
                      kWarpsSplitKeys, kClusterSplits, true>(params);
}
#endif

}  // namespace cuflash
