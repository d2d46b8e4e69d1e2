// FlashAttention forward on Hopper's warpgroup tensor cores (wgmma, sm_90a;
// float16, bfloat16), warp-specialised.
//
// One thread block per (query block, head, batch), or persistent (the
// launcher's choice for short sequences on dense batches, without a mask or
// causal): one block per resident slot, walking the query tiles gridDim.x
// apart (causal: in pairs of a long and a short walk, PersistentTileWalk),
// Q double-buffered and the K/V rings running on across tiles, so that a
// tile's copies overlap the previous tile; the producer decodes each tile
// once and leaves its coordinates beside its Q buffer for the consumers
// (the end of the walk too). Warpgroup 0 is the
// producer: it hands most of its registers back (setmaxnreg) and one of its
// threads issues every copy with the Tensor Memory Accelerator (tma.cuh):
// the query tile once, then K and V tiles through a ring of kStages shared
// buffers, each guarded by a full and an empty mbarrier (mbarrier.cuh);
// where a head's rows start mid-sector its copies start 8 columns early
// (sector_aligned_shift), and the output is staged back in the head's
// columns. Where rows end mid-sector too (head_dim % 16 == 8, an even
// head count), K and V come through head-pair maps whose rows start and
// end on sectors, with the neighbouring head's 8 columns; the copy
// thread's warp zeroes K's before the consumers see it. The other
// warpgroups are consumers, each owning 64 query rows; they never copy,
// never wait for each other at a block-wide barrier, and take the registers
// the producer gave back.
//
// Within a consumer, S = Q K^T reads Q and K straight from swizzled shared
// memory, O += P V takes P from registers and V from shared memory,
// transposed by the instruction; the tensor cores run asynchronously to the
// issuing threads:
//
//   block i:  S_i = Q K_i^T  and  O += P_{i-1} V_{i-1}  are issued together;
//             the softmax of S_i runs while P_{i-1} V_{i-1} is still in the
//             tensor cores; O is rescaled once that product has landed.
//
// Both products stop at kProductDim columns of the head dim (the head dim
// rounded up to a k16 step, where that is below the bucket: 80 of 96, 112
// of 128, 48 of 64; WgmmaForwardTraits), not at the padded tile's width.
//
// Between consumers (ping-pong): a consumer issues its matrix products only
// in its turn, passed round by named barriers, so that one warpgroup's
// products run while the others compute their exponentials, instead of all
// of them contending for the exponential unit and then for the tensor cores.
//
// Key blocks are visited from the last to the first, so the blocks that need
// masking (the partial last block, the causal diagonal) come first. The
// online softmax, masking and P packing are those of the mma.sync kernel
// (flash_fwd_mma.cu): a warp's wgmma accumulators have exactly the layout of
// one m16 row of mma fragments (see wgmma.cuh).
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "tensor_core_traits.cuh"
#include "mbarrier.cuh"
#include "tma.cuh"
#include "warp_roles.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "online_softmax.cuh"
#include "forward_epilogue.cuh"

namespace cuflash {

// The producer keeps this many registers per thread (its loop holds a ring
// position, coordinates and a few barrier addresses).
constexpr int kForwardProducerRegisters = 24;

template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarps, typename Mask, typename Score,
          typename Batch, int kBlocksPerSm, int kStages, bool kPersistent, int kProductDim>
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSm)
flash_forward_wgmma_kernel(const __grid_constant__ WgmmaForwardParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Traits = WgmmaForwardTraits<Element, kHeadDim, kBlockM, kBlockN, kWarps, kStages, kPersistent, kProductDim>;
    using QTile = typename Traits::QTile;
    using KvTile = typename Traits::KvTile;
    using Ring = RingPosition<Traits::kStages>;
    using QRing = RingPosition<Traits::kQBuffers>;
    constexpr int kNTiles = Traits::kNTiles;
    constexpr int kDTiles = Traits::kDTiles;
    constexpr int kConsumers = Traits::kConsumerWarpgroups;
    constexpr int kConsumerRegisters =
        consumer_registers(kWarps * 32, Traits::kConsumerThreads, kForwardProducerRegisters, kBlocksPerSm);

    static_assert(kConsumerRegisters >= registers_at_entry(kWarps * 32, kBlocksPerSm),
                  "setmaxnreg.inc may only raise the consumers' registers (a 256-thread block alone on an SM "
                  "starts above the 240 its consumer may ask for: launch two per SM)");

    require_shared_memory<Traits>();
    unsigned char* smem;
    const u32 base = aligned_shared_base<Traits::kAlignment>(smem);

    const int thread = threadIdx.x;
    // Role and row indices through a shuffle from lane 0: the compiler then
    // knows them warp-uniform, and keeps the wgmma instructions in their
    // branches asynchronous (in a path it must treat as divergent it
    // serialises every wgmma, C7520).
    const int warpgroup = __shfl_sync(0xffffffffu, thread / 128, 0);
    // The query tiles of this block: its own (blockIdx.x), or persistent,
    // the steps of its walk (PersistentTileWalk: paired where a causal mask
    // makes the tiles' walks uneven), fewer than 2^31 tiles in all (the
    // launcher's grid of one block per tile would not fit otherwise).
    const int num_tiles = static_cast<int>(params.num_m_blocks * params.size.nheads * params.size.batch);
    const PersistentTileWalk<kPersistent && Mask::kLaterRowsSeeMore> walk{
        num_tiles, static_cast<int>(params.num_m_blocks), static_cast<int>(gridDim.x)};
    const int walk_end = kPersistent ? walk.end() : static_cast<int>(blockIdx.x) + 1;  // one step: its own tile
    const auto tile_block = [&](int tile) {
        return query_block_of<Batch, Mask::kLaterRowsSeeMore>(params.size, params.num_m_blocks, kBlockM, tile);
    };
    // A packed batch's grid covers its longest sequence; the tiles past a
    // shorter one's end have no rows (a block of one such tile leaves before
    // any barrier; a persistent block's producer skips it, so its consumers
    // never see it).
    const auto tile_is_empty = [&](const QueryBlock& block) {
        return Batch::kPacked && block.m_start >= block.seqlen_q;
    };
    if (!kPersistent && tile_is_empty(tile_block(block_index()))) {
        return;
    }
    if (thread == 0) {
#pragma unroll
        for (int b = 0; b < Traits::kQBuffers; ++b) {
            mbarrier_init(Traits::q_full(base, b), 1);
            mbarrier_init(Traits::q_empty(base, b), Traits::kConsumerThreads);
        }
#pragma unroll
        for (int s = 0; s < Traits::kStages; ++s) {
            // Full: the producer's arrival with the tile's bytes. Empty: every
            // consumer thread's, once its products no longer read the buffer
            // (all threads arrive: a lane-0 arrival would be a divergent
            // branch among the wgmma instructions).
            mbarrier_init(Traits::k_full(base, s), 1);
            mbarrier_init(Traits::k_empty(base, s), Traits::kConsumerThreads);
            mbarrier_init(Traits::v_full(base, s), 1);
            mbarrier_init(Traits::v_empty(base, s), Traits::kConsumerThreads);
            mbarrier_init(Traits::k_landed(base, s), 1);  // K with its neighbour's columns: the copy
        }
        mbarrier_init_fence();
    }
    // The only block-wide barrier: after it the producer may leave early.
    __syncthreads();

    if (warpgroup == 0) {
        release_registers<kForwardProducerRegisters>();
        // K and V through their head-pair maps (params.cuh): rows on whole
        // sectors, the neighbouring head's 8 columns in place of zeros.
        const bool k_pairs = head_pair_maps_serve(params.kv_pair_maps & 1, params.k);
        const bool v_pairs = head_pair_maps_serve(params.kv_pair_maps & 2, params.v);
        if (thread < 32) {
            // The copy warp: lane 0 issues every copy; where K comes with its
            // neighbour's columns, the whole warp zeroes them (below). The
            // lane is read afresh where needed (lane_index_now): kept in a
            // register it spilled from the producer's 24 at head dim 256.
            const auto first_lane = [] { return lane_index_now() == 0; };
            // The rings run on across tiles: a tile's first K/V copies start
            // as soon as the previous tile's consumers free their buffers.
            Ring k_ring, v_ring;
            QRing q_ring;
            // K with its neighbour's columns lands on K landed; Q's columns
            // facing them are zeros, but 0 x inf is NaN, so a neighbouring
            // head's non-finite key must not reach this head's scores: the
            // warp zeroes those 16 bytes of each K row and only then arrives
            // on K full. It does so at the next key block's turn, first
            // thing: the copy has landed meanwhile, and no wait for the
            // consumers comes between (zeroed after the next V copy, whose
            // buffer frees only as the step that needs this K starts, head
            // dim 200 ran 31% slower). An even head's neighbour columns
            // follow its own (chunk head_dim / 8), an odd head's come first
            // (chunk 0); a lane's rows, lane + 32 j, share one place in the
            // swizzle (it repeats every 8 rows), so one offset serves them.
            static_assert(kBlockN % 8 == 0, "whole swizzle atoms of rows");
            const auto zero_neighbour_columns = [&](const Ring& at, index_t kv_head) {
                mbarrier_wait(Traits::k_landed(base, at.stage), at.phase);
                const int chunk = (kv_head & 1) ? 0 : params.size.head_dim_int() / 8;
                const u32 rows =
                    base + Traits::kK + at.stage * KvTile::kBytes + KvTile::chunk_offset(lane_index_now(), chunk);
#pragma unroll
                for (int j = 0; j < ceil_div(kBlockN, 32); ++j) {
                    if (kBlockN % 32 == 0 || lane_index_now() + 32 * j < kBlockN) {
                        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                                         rows + j * 32 * KvTile::kSwizzleBytes),
                                     "r"(0u)
                                     : "memory");
                    }
                }
                fence_async_shared();  // the zeros, ordinary stores, are read by the tensor cores
                __syncwarp();
                if (first_lane()) {
                    mbarrier_arrive(Traits::k_full(base, at.stage));
                }
            };
            for (int step = blockIdx.x; step < walk_end; step += gridDim.x) {
                const int tile = walk.tile(step);
                if (tile < 0) {
                    continue;
                }
                const QueryBlock block = tile_block(tile);
                if (tile_is_empty(block)) {
                    continue;
                }
                const Mask mask = make_mask<Mask>(block, params.variant, block.batch, block.head);
                const VisitedKeyBlocks<Mask> visits(mask, block.m_start, kBlockM, kBlockN);
                // Q's columns follow K's (their products pair them up), the
                // output's V's (see sector_aligned_shift); each shift is
                // computed where a copy needs it, not held through the tile
                // (the producer's 24 registers). A shift needs room within
                // the products' columns, not only the tile's: a head dim
                // narrowed to itself (48, 80, 112) keeps its columns where
                // its rows start mid-sector.
                const auto shift_of = [&](const TensorRef& tensor) {
                    return sector_aligned_shift<Element, kProductDim>(tensor, block.tensor_batch, block.kv_head,
                                                                      params.size.head_dim_int());
                };
                // Q's buffer is free once the consumers have staged and
                // stored the output of the tile before last in it (and read
                // its coordinates for the last time).
                const u32 q_full = Traits::q_full(base, q_ring.stage);
                mbarrier_wait(Traits::q_empty(base, q_ring.stage), q_ring.phase ^ 1);
                if (first_lane()) {
                    if constexpr (kPersistent) {
                        store_query_coordinates(
                            Traits::q_coordinates(base, q_ring.stage),
                            QueryCoordinates{block.batch, block.head, block.kv_head, block.m_start, 0});
                    }
                    if (visits.count > 0) {
                        // Tensor-map coordinates are tensor rows: a packed
                        // batch's tiles that run past a sequence's end copy
                        // the next sequence's rows, which the mask hides like
                        // the zeros past a dense one.
                        mbarrier_arrive_expect_tx(q_full, QTile::kBytes);
                        tma_load_tile<QTile>(base + Traits::kQ + q_ring.stage * QTile::kBytes, params.q_map, q_full,
                                             block.q_row0 + block.m_start, block.head, block.tensor_batch,
                                             -shift_of(params.k));
                    } else {
                        mbarrier_arrive(q_full);  // no keys to see: the buffer only stages the output
                    }
                }
                q_ring.advance();
                // K_i and V_{i-1}, in the order the consumers take them (a
                // step multiplies by K_i and by V_{i-1}); V lags K by one
                // block. Through a head-pair map the tile's column 0 is the
                // head's column -shift as well, at the pair's coordinates.
                const auto load = [&](const TensorMap& map, const TensorMap* pair_maps, const TensorRef& tensor,
                                      int kv_base, u32 full, u32 empty, const Ring& at, int i) {
                    // Waiting for the phase before the current one: on the
                    // first pass over the ring every buffer is free at once.
                    mbarrier_wait(empty, at.phase ^ 1);
                    if (first_lane()) {
                        mbarrier_arrive_expect_tx(full, KvTile::kBytes);
                        const u32 buffer = base + kv_base + at.stage * KvTile::kBytes;
                        const int row = block.k_row0 + visits.n_block(i) * kBlockN;
                        if (pair_maps != nullptr) {
                            tma_load_tile<KvTile>(buffer, pair_maps[block.kv_head & 1], full, row, block.kv_head >> 1,
                                                  block.tensor_batch);
                        } else {
                            tma_load_tile<KvTile>(buffer, map, full, row, block.kv_head, block.tensor_batch,
                                                  -shift_of(tensor));
                        }
                    }
                };
                for (int i = 0; i <= visits.count; ++i) {
                    if (k_pairs && i > 0) {
                        // K_{i-1}, one position behind the next K's, before
                        // anything that waits for the consumers: a step
                        // needs its K before it frees the buffers the next
                        // copies wait for.
                        zero_neighbour_columns(k_ring.template behind<1>(), block.kv_head);
                    }
                    if (i < visits.count) {
                        load(params.k_map, k_pairs ? params.k_pair_maps : nullptr, params.k, Traits::kK,
                             k_pairs ? Traits::k_landed(base, k_ring.stage) : Traits::k_full(base, k_ring.stage),
                             Traits::k_empty(base, k_ring.stage), k_ring, i);
                        k_ring.advance();
                    }
                    if (i > 0) {
                        load(params.v_map, v_pairs ? params.v_pair_maps : nullptr, params.v, Traits::kV,
                             Traits::v_full(base, v_ring.stage), Traits::v_empty(base, v_ring.stage), v_ring, i - 1);
                        v_ring.advance();
                    }
                }
            }
            if constexpr (kPersistent) {
                // The walk's end, in the next Q buffer once it is free: no rows.
                mbarrier_wait(Traits::q_empty(base, q_ring.stage), q_ring.phase ^ 1);
                if (first_lane()) {
                    store_query_coordinates(Traits::q_coordinates(base, q_ring.stage),
                                            QueryCoordinates{0, 0, 0, -1, 0});
                    mbarrier_arrive(Traits::q_full(base, q_ring.stage));
                }
            }
        }
        return;
    }

    claim_registers<kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int warp = __shfl_sync(0xffffffffu, thread / 32 - 4, 0);  // among the consumer warps
    const int warp_row0 = warp * 16;  // a warp's 16 accumulator rows: consumer * 64 + (warp % 4) * 16

    // Ping-pong: consumer c issues its products after barrier 1 + c, which
    // the previous consumer (cyclically) arrives at once it has issued its
    // own. One tile a block: the last consumer hands the first turn out at
    // the tile's start and does not pass its last one on. Persistent: the
    // turns run on across tiles (the first handed out once a walk, consumer
    // 0 taking the last consumer's final pass after it), so that a consumer
    // issues its next tile's first S once its own epilogue is done instead
    // of waiting for the last consumer's last P V and epilogue as well.
    // Either way every arrival meets a wait.
    constexpr bool kTurnsRunOn = kPersistent && kConsumers > 1;
    const auto take_turn = [&]() {
        if constexpr (kConsumers > 1) {
            named_barrier_sync(1 + consumer, 256);
        }
    };
    // Persistent: consumer c's warps have staged their output rows at barrier kStagedBarrier + c.
    constexpr int kStagedBarrier = 1 + kConsumers;
    const auto pass_turn = [&](bool last) {
        if constexpr (kConsumers > 1) {
            if (kTurnsRunOn || !(last && consumer == kConsumers - 1)) {
                named_barrier_arrive(1 + (consumer + 1) % kConsumers, 256);
            }
        }
    };

    // Descriptors (wgmma.cuh): K-major Q (this consumer's 64 rows) and K,
    // MN-major V; k16 steps by kmajor_k_step and mn_major_k_step.
    const u64 k_descriptor = kmajor_descriptor<KvTile>(base, Traits::kK);
    const u64 v_descriptor = mn_major_descriptor<KvTile>(base, Traits::kV);
    constexpr u64 kBufferStep = KvTile::kBytes >> 4;  // the next K or V buffer, in descriptor units
    using PFragments = u32[Traits::kPvSteps][4];  // a key block's P, the A operand of its P V
    // P in two register sets: the softmax packs block i's into one while
    // P_{i-1} V_{i-1} still reads the other. With dropout one set: its
    // Philox rounds beside two sets spill the heaviest policies (window,
    // soft cap, ALiBi and dropout at head dims 96-256), so P_{i-1} V_{i-1}
    // lands before the softmax's P is dropped and packed, as P V then no
    // longer overlaps the softmax's end.
    constexpr bool kTwoPSets = !Score::kDropout;

    // Persistent: the tile whose Q is in buffer q_buffer (once it is full),
    // as the producer decoded it, through a shuffle from lane 0, so that the
    // compiler knows its values, and the walk's bounds, warp-uniform (see
    // `warpgroup`). One tile a block: the block's own, decoded from its index
    // where it is needed (at the tile's start and in the epilogue: twice a
    // block, nothing held in registers for it between).
    const auto tile_in = [&](int q_buffer) {
        QueryCoordinates c = load_query_coordinates(Traits::q_coordinates(base, q_buffer));
        c.m_start = __shfl_sync(0xffffffffu, c.m_start, 0);
        c.head = __shfl_sync(0xffffffffu, static_cast<int>(c.head), 0);
        c.kv_head = __shfl_sync(0xffffffffu, static_cast<int>(c.kv_head), 0);
        c.batch = __shfl_sync(0xffffffffu, static_cast<int>(c.batch), 0);
        return c;
    };
    const auto tile_block_in = [&](int q_buffer) {
        if constexpr (kPersistent) {
            return query_block_at<Batch>(params.size, tile_in(q_buffer));
        } else {
            return tile_block(block_index());
        }
    };

    // K_i's and V_i's buffer, running on across tiles as the producer's
    // rings do. Once scores_to_p has advanced it past block i-1, V_{i-1}'s
    // buffer is one position behind it and V_{i-2}'s two (RingPosition::behind).
    Ring ring;
    // Persistent: the Q buffer whose staged output rows the copy engine may
    // still be reading (-1: none). Freed at the next tile's first S, which
    // the consumer waits for anyway, rather than by waiting for the engine
    // before the next tile starts. Every thread waits for its bulk groups
    // (only the storing thread has one) and arrives: no divergent branch.
    int staged_q_buffer = -1;
    const auto free_staged_q_buffer = [&]() {
        if constexpr (kPersistent) {
            if (staged_q_buffer >= 0) {
                bulk_wait_read<0>();
                mbarrier_arrive(Traits::q_empty(base, staged_q_buffer));
                staged_q_buffer = -1;
            }
        }
    };
    // One query tile, Q in buffer q_buffer, which is full.
    const auto consume_tile = [&](int q_buffer) {
        // Read afresh in each tile: what a persistent block's compiler would
        // otherwise hoist out of the tile loop (the lane and what derives from
        // it) stays live through the main loop and spills (see lane_index_now).
        const int lane = lane_index_now();
        const QueryBlock origin = tile_block_in(q_buffer);
        const BlockContext<Mask, Score> ctx(params, origin);
        const int warp_row = origin.m_start + warp_row0;
        const VisitedKeyBlocks<Mask> visits(ctx.mask, origin.m_start, kBlockM, kBlockN);
        const int n_blocks = visits.count;
        const u64 q_descriptor = kmajor_descriptor<QTile>(
            base, Traits::kQ + q_buffer * QTile::kBytes + consumer * 64 * QTile::kSwizzleBytes);

        float o[1][kDTiles][4];
        fill_fragments(o, 0.0f);
        float(&o_flat)[kProductDim / 2] = reinterpret_cast<float(&)[kProductDim / 2]>(o);
        PFragments p_even, p_second;
        PFragments& p_odd = kTwoPSets ? p_second : p_even;
        float pending_rescale[2] = {1.0f, 1.0f};  // the factors for O before P_{i-1} V_{i-1} is added
        FragmentOnlineSoftmax<1> softmax;
        softmax.init();

        const auto issue_s = [&](float(&s_flat)[kBlockN / 2]) {
            wgmma_fence();  // O, rescaled, and P were written by this thread since the last wgmma
#pragma unroll
            for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
                Wgmma<Element, kBlockN>::ss(s_flat, q_descriptor + kmajor_k_step<QTile>(ks),
                                            k_descriptor + ring.stage * kBufferStep + kmajor_k_step<KvTile>(ks),
                                            ks > 0);
            }
            wgmma_commit();
        };
        const auto issue_pv = [&](const PFragments& p) {
#pragma unroll
            for (int ps = 0; ps < Traits::kPvSteps; ++ps) {
                Wgmma<Element, kProductDim>::rs(o_flat, p[ps],
                                             v_descriptor + ring.template behind<1>().stage * kBufferStep +
                                                 mn_major_k_step<KvTile>(ps),
                                             1);
            }
            wgmma_commit();
        };
        // Once P_{i-2} V_{i-2} has landed: frees V_{i-2}'s buffer and scales O
        // for block i-1, whose P V comes next.
        const auto land_and_rescale = [&](int i) {
            wgmma_wait<0>();
            pin_registers(o_flat);
            if (i > 1) {
                mbarrier_arrive(Traits::v_empty(base, ring.template behind<2>().stage));
            }
            // The factors are almost always 1 past the first blocks (see
            // FragmentOnlineSoftmax): a warp skips O's multiplies unless one of
            // its lanes has a factor other than 1.
            if (__any_sync(0xffffffffu, pending_rescale[0] != 1.0f || pending_rescale[1] != 1.0f)) {
                scale_fragment_rows(o, pending_rescale);
            }
            // Kept here: left free, the compiler sinks the products to their
            // use, past the wgmma fence, and ptxas then serialises the wgmma.
            pin_registers(o_flat);
        };
        // S_i has landed: scores to P_i in p_next, and the factors O needs before P_i V_i.
        const auto scores_to_p = [&](float(&s)[1][kNTiles][4], float(&s_flat)[kBlockN / 2], int n_start,
                                     PFragments& p_next) {
            pin_registers(s_flat);
            mbarrier_arrive(Traits::k_empty(base, ring.stage));
            apply_score_transform(ctx.score, s, warp_row, n_start, lane);
            if (key_block_needs_mask(ctx.mask, warp_row, 16, n_start, kBlockN)) {
                apply_mask_to_fragments(ctx.mask, s, warp_row, n_start, lane);
            }
            // P rounded to the element type (its float32 row sums were taken before rounding).
            if constexpr (kTwoPSets) {
                softmax.update_and_pack<Element>(s, ctx.scale_log2, pending_rescale, p_next);
            } else {
                softmax.update(s, ctx.scale_log2, pending_rescale);
                wgmma_wait<0>();  // P_{i-1} V_{i-1} has landed: its P's registers take P_i
                drop_probabilities(ctx.score, s, warp_row, n_start, lane);
                pack_a_fragments<Element>(p_next, s[0]);
            }
            ring.advance();
        };
        // Step i > 0: S_i and P_{i-1} V_{i-1} are issued together in the turn;
        // the softmax of S_i runs while P_{i-1} V_{i-1} is in the tensor
        // cores, and that product's wait comes only at the next step's start.
        // (A wait after the softmax, in the same basic block, ptxas hoists
        // above the exponentials: it schedules a wgmma wait as early as the
        // block allows, and the overlap is lost.)
        const auto step = [&](int i, const PFragments& p_pending, PFragments& p_next) {
            const int n_start = visits.n_block(i) * kBlockN;
            land_and_rescale(i);
            mbarrier_wait(Traits::k_full(base, ring.stage), ring.phase);
            const Ring previous = ring.template behind<1>();
            mbarrier_wait(Traits::v_full(base, previous.stage), previous.phase);
            float s[1][kNTiles][4];
            float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
            take_turn();
            issue_s(s_flat);
            issue_pv(p_pending);
            pass_turn(i == n_blocks - 1);
            wgmma_wait<1>();  // S_i is done; P_{i-1} V_{i-1} may still run
            scores_to_p(s, s_flat, n_start, p_next);
        };
        // The last block's P V, once the one before it has landed; then its
        // V buffer is free too.
        const auto finish = [&](const PFragments& p_last) {
            land_and_rescale(n_blocks);
            const Ring previous = ring.template behind<1>();
            mbarrier_wait(Traits::v_full(base, previous.stage), previous.phase);
            wgmma_fence();
            issue_pv(p_last);
            wgmma_wait<0>();
            pin_registers(o_flat);
            mbarrier_arrive(Traits::v_empty(base, previous.stage));
        };

        if (n_blocks > 0) {
            if (!kTurnsRunOn && kConsumers > 1 && consumer == kConsumers - 1) {
                named_barrier_arrive(1, 256);
            }
            mbarrier_wait(Traits::k_full(base, ring.stage), ring.phase);
            float s[1][kNTiles][4];
            float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
            take_turn();
            issue_s(s_flat);
            pass_turn(n_blocks == 1);
            free_staged_q_buffer();
            wgmma_wait<0>();
            scores_to_p(s, s_flat, visits.n_block(0) * kBlockN, p_even);
        } else {
            free_staged_q_buffer();
        }
        // Two steps a pass, so that each P set is named at compile time (a
        // runtime index would put both sets in local memory).
        for (int i = 1; n_blocks > 0; i += 2) {
            if (i == n_blocks) {
                finish(p_even);
                break;
            }
            step(i, p_even, p_odd);
            if (i + 1 == n_blocks) {
                finish(p_odd);
                break;
            }
            step(i + 1, p_odd, p_even);
        }

        // Epilogue. This warpgroup's last product reading Q finished before
        // its last wait, and no other warpgroup reads these rows, so each
        // warp stages its normalised output rows in its own rows of the Q
        // tile (same swizzle: conflict-free). One tile a block: each warp
        // stores its rows 16 bytes at a time. Persistent (dense batches): one
        // thread has the copy engine store the consumer's 64 rows (rows past
        // the sequence and columns past head_dim lie outside out_map), and
        // the consumer goes on to its next tile instead of reading the rows
        // back and storing them: at 512 keys this took d64 causal from 0.139
        // to 0.131 ms, d128 without a mask from 0.137 to 0.133 (H100).
        // The tile's rows read again rather than kept from `origin`, so
        // that they hold no registers through the main loop. Past
        // kProductDim the staging leaves the Q tile's columns as they were:
        // they lie past the head dim, which no store reaches.
        const QueryBlock block = tile_block_in(q_buffer);
        const int first_row = block.m_start;
        // O's columns are V's as the producer copied them, shift_chunks
        // 8-column chunks before the head's (sector_aligned_shift): staged
        // in the head's columns, so that the stores start at its first.
        const int shift_chunks = sector_aligned_shift<Element, kProductDim>(params.v, block.tensor_batch,
                                                                            block.kv_head, ctx.head_dim) / 8;
        unsigned char* const q_tile = Traits::q_tile(smem, q_buffer);
        finish_forward_rows<Element>(
            softmax, o, params.lse_row(block.tensor_batch, block.head) + block.q_row0, first_row, warp_row0,
            ctx.seqlen_q, lane,
            [&](int row_in_block, int dt, u32 packed) {
                if (dt >= shift_chunks) {  // the chunks before the head hold zeros
                    *reinterpret_cast<u32*>(q_tile + QTile::chunk_offset(row_in_block, dt - shift_chunks) +
                                            4 * (lane % 4)) = packed;
                }
            });
        if constexpr (kPersistent) {
            fence_async_shared();  // the staged rows, written by ordinary stores, are read by the copy engine
            named_barrier_sync(kStagedBarrier + consumer, 128);
            if (warp % 4 == 0 && lane == 0) {
                const u32 rows = base + Traits::kQ + q_buffer * QTile::kBytes + consumer * 64 * QTile::kSwizzleBytes;
                tma_store_tile<QTile>(params.out_map, rows, block.q_row0 + first_row + consumer * 64, block.head,
                                      block.tensor_batch);
                bulk_commit();
            }
            __syncwarp();
            // The buffer may take a later tile's Q once the engine has read the rows.
            staged_q_buffer = q_buffer;
        } else {
            __syncwarp();
            store_warp_rows<QTile>(block.query_row<Element>(params.out, block.head, first_row), params.out.row_stride,
                                   q_tile, warp_row0, ctx.seqlen_q - first_row, ctx.head_dim, lane);
            mbarrier_arrive(Traits::q_empty(base, q_buffer));
        }
    };
    if constexpr (kPersistent) {
        if (kTurnsRunOn && consumer == kConsumers - 1) {
            named_barrier_arrive(1, 256);  // the walk's first turn
        }
        for (QRing q_ring;; q_ring.advance()) {
            mbarrier_wait(Traits::q_full(base, q_ring.stage), q_ring.phase);
            if (tile_in(q_ring.stage).m_start < 0) {
                break;  // the walk's end
            }
            consume_tile(q_ring.stage);
        }
        if (kTurnsRunOn && consumer == 0) {
            named_barrier_sync(1, 256);  // the last consumer's final pass
        }
        bulk_wait<0>();  // the output's last stores are done
    } else {
        mbarrier_wait(Traits::q_full(base, 0), 0);
        consume_tile(0);
    }
#else
    // Built only for sm_90a (the launcher picks this kernel on compute capability 9.0 alone).
    __trap();
#endif
}

}  // namespace cuflash
