// Tiles, fragment counts and shared-memory layouts of the tensor-core
// kernels: the mma.sync forward (flash_fwd_mma.cu, sm_80+) and the Hopper
// wgmma forward and backward (flash_fwd_wgmma.cu, flash_bwd_wgmma.cu,
// sm_90a). Tile sizes arrive as template arguments from
// cuflash/_kernel_families.py; each traits struct places its tiles and
// static_asserts the register and shared-memory budgets.
#pragma once

#include "numeric.cuh"
#include "shared_memory.cuh"
#include "swizzled_tile.cuh"

namespace cuflash {

// Columns of dQ a warp (warpgroup) computes at once, of its dq_cols: all of
// them, or 64 at a time once dK and dV (acc_cols columns each: acc_cols
// registers together) and dQ pass 192 registers per thread counted as
// dK + dV + 2 dQ. Both tensor-core kernels chunk all their variants so (the
// mma.sync kernel's atomic d256 ones spilled unchunked on sm_90; the Hopper
// kernel's d256 writes each chunk into its dQ tile), but for the Hopper
// kernel's dQ by turns (WgmmaBackwardTraits::kDqChunk).
__host__ __device__ constexpr int dq_chunk_columns(int acc_cols, int dq_cols) {
    return acc_cols + dq_cols > 192 ? 64 : dq_cols;
}

// What the two tensor-core forwards share: tile sizes, threads, and the
// fragment counts of a warp's S = Q K^T and O accumulators (n8 column tiles
// of the mma / wgmma accumulator layout, see mma.cuh) and of their k steps
// (32 bytes of k: 16 elements of 16 bits, or 8 float32 for 3xTF32, see
// mma_operands.cuh).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct TensorCoreForwardShape {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;  // padded head dim; padded columns are zero
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;

    static constexpr int kKStep = 32 / int(sizeof(Element));  // k of one product
    static constexpr int kNTiles = kBlockN / 8;         // n8 tiles of S per 16 rows
    static constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of O per 16 rows
    static constexpr int kQkSteps = kHeadDim / kKStep;  // k steps of Q K^T
    static constexpr int kPvSteps = kBlockN / kKStep;   // k steps of P V

    static_assert(sizeof(Element) == 2 || sizeof(Element) == 4, "16-bit elements, or float32 (3xTF32)");
};

// Tensor-core forward (flash_fwd_mma.cu): the kWarps warps split the kBlockM
// query rows evenly, each warp owning kMTiles tiles of 16 rows; K and V tiles
// of kBlockN keys are shared by all warps. A K or V fragment read from shared
// memory feeds kMTiles products, which is what keeps shared-memory bandwidth
// below the tensor cores' appetite, and kMTiles * (kDTiles + kNTiles) * 4
// accumulators per lane is what limits it.
//
// With kWarpsSplitKeys (decoding: a query block of one m16 tile, the few
// query rows that share a K/V head), every warp owns all kBlockM rows and
// kWarpKeys = kBlockN / kWarps of each key block's keys instead: a warp's
// products are those of its own keys, so the block computes each score
// once rather than kWarps times over empty rows, and the warps' softmax
// states and outputs are merged through shared memory at the end
// (WarpStateMerge, forward_epilogue.cuh).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kKvStages_,
          bool kWarpsSplitKeys_ = false, bool kKvSwizzled_ = false>
struct MmaForwardTraits : TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
    using Shape = TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
    using typename Shape::Element;
    using Shape::kBlockM, Shape::kBlockN, Shape::kHeadDim, Shape::kWarps, Shape::kDTiles, Shape::kQkSteps,
        Shape::kKStep;

    static constexpr bool kWarpsSplitKeys = kWarpsSplitKeys_;
    static constexpr int kRowsPerWarp = kWarpsSplitKeys ? kBlockM : kBlockM / kWarps;
    static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
    static constexpr int kWarpKeys = kWarpsSplitKeys ? kBlockN / kWarps : kBlockN;  // a warp's keys of a block
    static constexpr int kNTiles = kWarpKeys / 8;       // n8 tiles of a warp's S per 16 rows
    static constexpr int kPvSteps = kWarpKeys / kKStep;  // k steps of a warp's P V

    // Every row is padded by one 16-byte chunk: ldmatrix reads one chunk from
    // each of 8 rows at once, and with an odd number of chunks per row those
    // 8 chunks fall in 8 different bank groups (no conflicts, no swizzle);
    // 3xTF32's 32-bit loads of V (lanes at rows 2q, columns g) then hit 32
    // different banks too.
    static constexpr int kStride = kHeadDim + 16 / int(sizeof(Element));
    // Buffers of K and V: with a ring of 2 or more, block j-(kKvStages-1)
    // is copied in while block j is used; with 1 (where registers are too tight for the longer-lived copy
    // state), V_j is copied during S_j and K_{j-1} during P_j V_j.
    static constexpr int kKvStages = kKvStages_;
    // Where the Tensor Memory Accelerator copies K and V (kKvSwizzled:
    // Hopper's decode tiles), their buffers are unpadded SwizzledTile panels
    // instead, in the swizzle the copy engine writes, each on a 1024-byte
    // swizzle atom (the launch asks for kAlignment bytes more and the kernel
    // rounds its base up), and one mbarrier per stage follows them.
    static constexpr bool kKvSwizzled = kKvSwizzled_;
    using KvTile = SwizzledTile<kBlockN, kHeadDim>;
    static constexpr int kAlignment = kKvSwizzled ? 1024 : 16;
    static constexpr int kKvTileBytes = kKvSwizzled ? KvTile::kBytes : kBlockN * kStride * int(sizeof(Element));
    static constexpr int kQ = 0;
    static constexpr int kK = ceil_div(kQ + kBlockM * kStride * int(sizeof(Element)), kAlignment) * kAlignment;
    static constexpr int kV = kK + kKvStages * kKvTileBytes;
    static constexpr int kKvFull = kV + kKvStages * kKvTileBytes;  // mbarriers, one per stage (kKvSwizzled)
    static constexpr int kBytes = kKvFull + (kKvSwizzled ? 8 * kKvStages + kAlignment : 0);

    // Q's A fragments stay in registers for the whole key loop when they fit
    // in 32 registers; otherwise they are re-read from shared memory per block.
    static constexpr bool kQInRegisters = kMTiles * kQkSteps * 4 <= 32;

    static_assert(kRowsPerWarp % 16 == 0 && (kWarpsSplitKeys || kBlockM % kWarps == 0), "each warp owns whole m16 tiles");
    static_assert(kWarpKeys % 16 == 0, "each warp owns whole k16 steps of keys");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0 && kHeadDim <= 256, "k16 steps over keys and head dim");
    static_assert((kStride * int(sizeof(Element)) / 16) % 2 == 1, "odd chunks per row: conflict-free ldmatrix");
    static_assert(kMTiles * (kDTiles + kNTiles) * 4 <= 192, "accumulators beyond this would spill");
    static_assert(kKvStages >= 1 && kKvStages <= 4, "single buffered K/V or a ring of up to four");
    static_assert(!kKvSwizzled || (sizeof(Element) == 2 && kKvStages >= 2 && KvTile::kBytes % 1024 == 0),
                  "copy-engine K/V: 16-bit tiles in a ring, each on a swizzle atom");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// What the two tensor-core backwards share: tile sizes, threads, and the k16
// steps of their products (S^T = K Q^T and dP^T = V dO^T over the head dim,
// dV += P^T dO and dK += dS^T Q over the queries, dQ = dS K over the keys).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct TensorCoreBackwardShape {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;  // padded head dim; padded columns are zero
    static constexpr int kBlockM = kBlockM_;    // query rows per step
    static constexpr int kBlockN = kBlockN_;    // keys per thread block
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kQkSteps = kHeadDim / 16;
    static constexpr int kRowSteps = kBlockM / 16;
    static constexpr int kKeySteps = kBlockN / 16;

    static_assert(sizeof(Element) == 2, "tensor-core path: float16 and bfloat16 only");
    static_assert(kBlockM % 16 == 0 && kHeadDim % 16 == 0, "k16 steps over the queries and the head dim");
};

// mma.sync backward dK/dV (flash_bwd_mma.cu, sm_80+): each warp owns 16 of
// the block's kBlockN keys (one m16 tile of S^T, dP^T, dK and dV) and walks
// query blocks of kBlockM rows. Up to head dim 128 each warp has its own 16
// keys; above it (kSplitHeadDim; dK and dV of 16 keys would take kHeadDim
// registers per lane) two warps share 16 keys, each computing S^T and dP^T
// for half of the query block's rows and owning half of dK's and dV's
// columns, as the Hopper kernel's warpgroups do. Per lane: dK and dV
// (kAccCols / 2 floats each), S^T and dP^T (kScoreCols / 2 each), then its
// share of dQ_i = dS_i K_j (kDqCols / 2 floats): the warps split dQ's kBlockM
// x kHeadDim into m16 row tiles first, then into column groups. Rows of every
// tile are padded by 16 bytes, as in the mma.sync forward (conflict-free
// ldmatrix without a swizzle). Q, dO and their statistics have kQStages
// buffers (2: the next block is copied during this one; 1: during dQ).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kQStages_>
struct MmaBackwardTraits : TensorCoreBackwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
    using Shape = TensorCoreBackwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
    using typename Shape::Element;
    using Shape::kBlockM, Shape::kBlockN, Shape::kHeadDim, Shape::kWarps;

    static constexpr bool kSplitHeadDim = kHeadDim > 128;
    static constexpr int kDimGroups = kSplitHeadDim ? 2 : 1;       // warps sharing 16 keys
    static constexpr int kKeyTiles = kWarps / kDimGroups;           // m16 tiles of keys
    static constexpr int kAccCols = kHeadDim / kDimGroups;          // dK, dV columns per warp
    static constexpr int kScoreCols = kBlockM / kDimGroups;         // S^T, dP^T queries per warp

    static constexpr int kQTiles = kScoreCols / 8;  // n8 tiles of a warp's S^T and dP^T
    static constexpr int kDTiles = kAccCols / 8;    // n8 tiles of a warp's dK and dV
    static constexpr int kDqRowTiles = kBlockM / 16;                 // m16 tiles of dQ
    static constexpr int kDqColGroups = kWarps / kDqRowTiles;        // warps sharing one row tile
    static constexpr int kDqCols = kHeadDim / kDqColGroups;          // dQ columns per warp

    static constexpr int kQStages = kQStages_;
    static constexpr int kStride = kHeadDim + 8;   // Q, dO, K, V rows (elements)
    static constexpr int kDsStride = kBlockM + 8;  // dS^T (P^T) rows: keys, columns queries
    static constexpr int kElementBytes = int(sizeof(Element));
    static constexpr int kKvTileBytes = kBlockN * kStride * kElementBytes;
    static constexpr int kQTileBytes = kBlockM * kStride * kElementBytes;
    static constexpr int kDsTileBytes = kBlockN * kDsStride * kElementBytes;
    static constexpr int kK = 0;
    static constexpr int kV = kK + kKvTileBytes;
    static constexpr int kQ = kV + kKvTileBytes;              // kQStages buffers
    static constexpr int kDo = kQ + kQStages * kQTileBytes;   // kQStages buffers
    static constexpr int kDs = kDo + kQStages * kQTileBytes;
    static constexpr int kPt = kDs + kDsTileBytes;     // P^T, where two warps split the head dim
    static constexpr int kStats = kPt + (kSplitHeadDim ? kDsTileBytes : 0);  // kQStages buffers of (LSE in log2, delta)
    static constexpr int kBytes = kStats + kQStages * 2 * kBlockM * 4;

    static_assert(kBlockN == 16 * kKeyTiles, "one m16 tile of keys per warp, or per pair of warps when split");
    static_assert(kScoreCols % 16 == 0 && kAccCols % 16 == 0, "whole k16 steps of P^T and n8 pairs of dK, dV");
    static_assert(kWarps % kDqRowTiles == 0 && kHeadDim % (16 * kDqColGroups) == 0,
                  "dQ splits into m16 row tiles and column groups of whole n8 pairs");
    static_assert((kStride * kElementBytes / 16) % 2 == 1 && (kDsStride * kElementBytes / 16) % 2 == 1,
                  "odd chunks per row: conflict-free ldmatrix");
    static_assert(kAccCols + kScoreCols <= 192, "dK, dV, S^T and dP^T accumulators beyond this would spill");
    static_assert(kQStages == 1 || kQStages == 2, "single or double buffered Q and dO");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Hopper forward (flash_fwd_wgmma.cu, sm_90a), warp-specialised: warpgroup
// 0 is the producer (one thread issues the tensor-memory copies of Q once
// and of K and V through a ring of kStages buffers), the other kWarps / 4 - 1
// warpgroups are consumers, each owning 64 query rows (one wgmma m64 tile)
// of the kBlockM. Per consumer thread the accumulators are S (kBlockN / 2
// floats), O (kHeadDim / 2) and two key blocks' P (kBlockN / 4 registers
// each: the one P V reads and the one the softmax packs), all live at once
// while P V overlaps the softmax. A persistent block (kPersistent: it
// walks query tiles gridDim.x apart) double-buffers Q, so that the next
// tile's arrives while this one's runs (and its output is staged in its
// own buffer). After the tiles come the mbarriers: Q full and Q empty per Q
// buffer, each pair followed by the buffer's tile coordinates (16 bytes),
// then per stage K full, K empty, V full, V empty, and last per stage K
// landed (where K is copied with its neighbour's columns, the copy lands
// there and a producer warp zeroes those columns before K full:
// flash_fwd_wgmma.cu).
//
// kProductDim: the head-dim columns S = Q K^T's k16 steps and O = P V's N
// run over. A head dim between buckets (112 in 128, 80 in 96, 48 in 64:
// cuflash/_tiling.py's wgmma_product_dim) would otherwise multiply padded
// columns that are zeros; O then holds kProductDim columns. Copies that
// start 8 columns early (sector_aligned_shift, which asks for room within
// kProductDim) or bring a neighbouring head's 8 (head-pair maps, only where
// head_dim % 16 == 8) end at head_dim + 8, within the rounded width. The
// tiles, their swizzles and the tensor maps stay the bucket's.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_, bool kPersistent_,
          int kProductDim_ = kHeadDim_>
struct WgmmaForwardTraits : TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
    using Shape = TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
    using Shape::kBlockM, Shape::kBlockN, Shape::kHeadDim, Shape::kWarps;
    static constexpr int kConsumerWarpgroups = kWarps / 4 - 1;
    static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
    static constexpr int kStages = kStages_;
    static constexpr bool kPersistent = kPersistent_;
    static constexpr int kQBuffers = kPersistent ? 2 : 1;
    static constexpr int kProductDim = kProductDim_;
    static constexpr int kQkSteps = kProductDim / 16;  // k16 steps of S = Q K^T
    static constexpr int kDTiles = kProductDim / 8;    // n8 tiles of O per 16 rows

    using QTile = SwizzledTile<kBlockM, kHeadDim>;
    using KvTile = SwizzledTile<kBlockN, kHeadDim>;
    static constexpr int kQ = 0;                                 // kQBuffers Q buffers
    static constexpr int kK = kQ + kQBuffers * QTile::kBytes;    // kStages K buffers
    static constexpr int kV = kK + kStages * KvTile::kBytes;     // kStages V buffers
    static constexpr int kBarriers = kV + kStages * KvTile::kBytes;
    // Per Q buffer: Q full, Q empty, its tile's coordinates (16 bytes, store_query_coordinates).
    static constexpr int kQFull = kBarriers;
    static constexpr int kKFull = kQFull + 32 * kQBuffers;       // per stage: K full, K empty, V full, V empty
    static constexpr int kKLanded = kKFull + 4 * 8 * kStages;    // per stage: K landed
    static constexpr int kLayoutBytes = kKLanded + 8 * kStages;
    // Swizzle atoms must be 1024-byte aligned; the dynamic shared memory is
    // only guaranteed 16, so the launch asks for this much more and the
    // kernel rounds its base up.
    static constexpr int kAlignment = 1024;
    static constexpr int kBytes = kLayoutBytes + kAlignment;

    // Shared addresses of stage s's barriers, from the aligned base.
    static __device__ __forceinline__ u32 k_full(u32 base, int s) { return base + kKFull + 32 * s; }
    static __device__ __forceinline__ u32 k_empty(u32 base, int s) { return base + kKFull + 32 * s + 8; }
    static __device__ __forceinline__ u32 v_full(u32 base, int s) { return base + kKFull + 32 * s + 16; }
    static __device__ __forceinline__ u32 v_empty(u32 base, int s) { return base + kKFull + 32 * s + 24; }
    static __device__ __forceinline__ u32 k_landed(u32 base, int s) { return base + kKLanded + 8 * s; }
    static __device__ __forceinline__ u32 q_full(u32 base, int b) { return base + kQFull + 32 * b; }
    static __device__ __forceinline__ u32 q_empty(u32 base, int b) { return base + kQFull + 32 * b + 8; }
    static __device__ __forceinline__ u32 q_coordinates(u32 base, int b) { return base + kQFull + 32 * b + 16; }
    static __device__ __forceinline__ unsigned char* q_tile(unsigned char* smem, int b) {
        return smem + kQ + b * QTile::kBytes;
    }

    static_assert(sizeof(typename Shape::Element) == 2, "wgmma forward: float16 and bfloat16");
    static_assert(kWarps % 4 == 0 && kConsumerWarpgroups >= 1 && kBlockM == 64 * kConsumerWarpgroups,
                  "a producer warpgroup, then one consumer warpgroup per 64 query rows");
    // Whole swizzle panels (SwizzledTile picks the widest that fits); S's N
    // (kBlockN) and O's (kProductDim) must be widths of the Wgmma table.
    static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0, "k16 steps over the head dim and the keys");
    static_assert(kBlockM <= 256 && kBlockN <= 256, "a tensor-memory box is at most 256 rows");
    static_assert(kProductDim % 16 == 0 && kProductDim <= kHeadDim, "products over whole k16 steps of the head dim");
    static_assert(kBlockN / 2 + kProductDim / 2 + 2 * (kBlockN / 4) <= 192, "accumulators beyond this would spill");
    static_assert(kStages == 2 || kStages == 3, "a ring of two or three K and V buffers");
    static_assert(QTile::kBytes % 1024 == 0 && KvTile::kBytes % 1024 == 0, "every tile starts on a swizzle atom");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Hopper backward dK/dV (flash_bwd_wgmma.cu, sm_90a), warp-specialised:
// warpgroup 0 is the producer (it loads and, for dQ, stores), the other
// kWarps / 4 - 1 are consumers sharing one block of kBlockN keys and
// walking query blocks of kBlockM rows. Up to head dim 128 each consumer
// owns 64 keys (one wgmma m64 tile of S^T, dP^T, dK and dV) with every
// column of their dK and dV; per thread dK and dV take kHeadDim / 2 floats
// each, S^T and dP^T kBlockM / 2 each. Above 128, dK and dV of 64 keys would
// not fit in one warpgroup's registers, so the consumers share the same 64
// keys and split the head dim of dK and dV (and the block's queries for S^T
// and dP^T, whose P^T and dS^T then reach both through shared memory). Each
// consumer's share of dQ_i = dS_i K_j (kDqCols / 2 floats) goes to a float32
// tile in shared memory, which the producer adds into the accumulator: the
// consumers split dQ's kBlockM x kHeadDim into m64 tiles first, then into
// column blocks (kDqSplitCols), or, with one m64 tile and their own keys,
// take the whole tile by turns (kDqByTurns); K's and Q's swizzle panels are
// narrowed (SwizzledTile) until the split's column blocks start on panels
// (head dim 96: two blocks of 48 columns, 32-byte panels). Q and dO (with their rows' LSE and delta) come
// through a ring of kStages buffers; dS^T (and P^T) are double-buffered by
// step so that one consumer may stage the next step's while the other still
// reads this one's.
//
// kProductDim: the columns the products run over where each consumer holds
// the whole head dim. A head dim between buckets (112 in 128, 80 in 96, 48
// in 64: cuflash/_tiling.py's wgmma_product_dim) would otherwise run
// S^T, dP^T, dV and dK over padded columns that are zeros: S^T's and dP^T's
// k16 steps stop at kProductDim, and dK and dV are kProductDim wide (an N of
// the Wgmma table). dQ keeps whole panels of K, and the tiles, their
// swizzles and the tensor maps stay the bucket's (kStorageCols).
//
// kDirectDq: the layout of the direct dQ mode (kDqDirect), whose kernel
// also computes delta where its O tiles fit (kComputesDelta).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kStages_,
          int kProductDim_ = kHeadDim_, bool kDirectDq_ = false>
struct WgmmaBackwardTraits : TensorCoreBackwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
    using Shape = TensorCoreBackwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
    using typename Shape::Element;
    using Shape::kBlockM, Shape::kBlockN, Shape::kHeadDim, Shape::kWarps;
    static constexpr int kStages = kStages_;
    static constexpr int kConsumers = kWarps / 4 - 1;  // consumer warpgroups
    static constexpr int kConsumerThreads = 128 * kConsumers;

    static constexpr bool kSplitHeadDim = kHeadDim > 128;
    static constexpr int kKeyGroups = kSplitHeadDim ? 1 : kConsumers;  // consumers with their own 64 keys
    static constexpr int kDimGroups = kConsumers / kKeyGroups;         // consumers sharing 64 keys
    static constexpr int kProductDim = kProductDim_;
    static constexpr int kStorageCols = kHeadDim / kDimGroups;         // dK, dV columns per consumer in the tiles
    static constexpr int kAccCols = kProductDim / kDimGroups;          // ... in its accumulators
    static constexpr int kQkSteps = kProductDim / 16;                  // k16 steps of S^T and dP^T
    static constexpr int kScoreCols = kBlockM / kDimGroups;            // S^T, dP^T queries per consumer

    static constexpr int kQTiles = kScoreCols / 8;  // n8 tiles of a warp's S^T and dP^T
    static constexpr int kDTiles = kAccCols / 8;    // n8 tiles of a warp's dK and dV
    static constexpr int kDqMTiles = kBlockM / 64;  // m64 tiles of dQ
    // One m64 tile of dQ and two consumers of their own keys (head dims 96
    // and 128): the consumers take a step's whole dQ tile by turns (step
    // parity) instead of half its columns each step. Half as many products,
    // each twice as wide (m64n128 reads 6 KB of shared memory a k16 step
    // where two m64n64 read 8), and the consumer without dQ starts the next
    // step's S^T and dP^T while the other's dQ is in the tensor cores, so
    // that the two no longer run each phase of a step in lockstep (H200,
    // bf16: d128 2k-16k 3-4.5% faster without a mask, 2-3% causal, d96
    // 6-11%).
    static constexpr bool kDqByTurns = !kSplitHeadDim && kDqMTiles == 1 && kConsumers == 2;
    static constexpr int kDqSplitCols = kHeadDim * kDqMTiles / kConsumers;  // a consumer's share, split
    static constexpr int kDqCols = kDqByTurns ? kHeadDim : kDqSplitCols;  // dQ columns a consumer computes
    // ... at once: by turns all of them (dQ's kHeadDim / 2 accumulators beside
    // dK's and dV's, once P^T's and dS^T's fragments are dead: no more than
    // S^T and dP^T take beside them), else dq_chunk_columns'.
    static constexpr int kDqChunk = kDqByTurns ? kDqCols : dq_chunk_columns(kAccCols, kDqCols);

    // K, V: rows are keys; K's column blocks of dQ start on panels.
    using KvTile = SwizzledTile<kBlockN, kHeadDim, widest_swizzle_bytes(kDqSplitCols)>;
    // Q, dO: rows are queries; a consumer's columns of dK and dV start on a panel.
    using QTile = SwizzledTile<kBlockM, kHeadDim, widest_swizzle_bytes(kStorageCols)>;
    using DsTile = SwizzledTile<kBlockN, kBlockM>;  // dS^T (and P^T): rows are keys, columns queries
    using DqTile = SwizzledFloatTile<kBlockM, kHeadDim>;
    static constexpr int kScoreBuffer = DsTile::kBytes * (kSplitHeadDim ? 2 : 1);  // dS^T, then P^T where split
    static constexpr int kK = 0;
    static constexpr int kV = kK + KvTile::kBytes;
    static constexpr int kQ = kV + KvTile::kBytes;               // kStages buffers
    static constexpr int kDo = kQ + kStages * QTile::kBytes;     // kStages buffers
    static constexpr int kDs = kDo + kStages * QTile::kBytes;    // two score buffers, by step parity
    static constexpr int kDq = kDs + 2 * kScoreBuffer;
    static constexpr int kStats = kDq + DqTile::kBytes;          // kStages buffers of (LSE in log2, delta)
    static constexpr int kStatsBytes = 2 * kBlockM * 4;
    static constexpr int kBarriers = kStats + kStages * kStatsBytes;
    // K and V full; per stage Q full, dO full, Q/dO empty; dQ full, dQ
    // empty; a first store handed to the store warp (kDqClaimed), then that
    // store's slot (FirstStoreJob); per stage, the direct dQ mode's rows'
    // delta written (kDqDirect; its O tile arrives with dO).
    static constexpr int kKvFull = kBarriers;
    static constexpr int kDqFull = kKvFull + 8 + 3 * 8 * kStages;
    static constexpr int kDqEmpty = kDqFull + 8;
    static constexpr int kStoreJob = kDqEmpty + 8;
    static constexpr int kStoreSlot = kStoreJob + 8;
    static constexpr int kDeltaFull = kStoreSlot + 8;
    static constexpr int kBarriersEnd = kDeltaFull + 8 * kStages;
    static constexpr int kAlignment = 1024;  // swizzle atoms; see WgmmaForwardTraits
    // The direct dQ mode's O tiles (Q's swizzle), one a stage, from which
    // it computes delta: the first in the float32 dQ tile's second half
    // (its dQ tile, in the input dtype, takes the first), the second after
    // the barriers; stage s's at kO + s kOStride. Where they do not fit
    // (head dim 192's two stages), the preprocessing kernel computes delta.
    static constexpr int kO = kDq + QTile::kBytes;
    static constexpr int kOSecond = (kBarriersEnd + kAlignment - 1) / kAlignment * kAlignment;
    static constexpr int kOStride = kOSecond - kO;
    static constexpr int kDirectLayoutBytes = kStages > 1 ? kOSecond + QTile::kBytes : kBarriersEnd;
    static constexpr bool kComputesDelta = kDirectDq_ && kDirectLayoutBytes + kAlignment <= kMaxSmemBytes;
    static constexpr int kLayoutBytes = kComputesDelta ? kDirectLayoutBytes : kBarriersEnd;
    static constexpr int kBytes = kLayoutBytes + kAlignment;

    static __device__ __forceinline__ u32 q_full(u32 base, int s) { return base + kKvFull + 8 + 24 * s; }
    static __device__ __forceinline__ u32 do_full(u32 base, int s) { return base + kKvFull + 16 + 24 * s; }
    static __device__ __forceinline__ u32 q_empty(u32 base, int s) { return base + kKvFull + 24 + 24 * s; }
    static __device__ __forceinline__ u32 delta_full(u32 base, int s) { return base + kDeltaFull + 8 * s; }

    static_assert(kWarps % 4 == 0 && kConsumers >= 1 && kBlockN == 64 * kKeyGroups,
                  "a producer warpgroup, then consumers of 64 keys each, or sharing 64 keys when split");
    static_assert(kBlockM % 64 == 0 && kHeadDim % 32 == 0 && kScoreCols % 16 == 0,
                  "m64 tiles of dQ; whole 32-column panels of it; k16 steps over the queries");
    static_assert(kConsumers % kDqMTiles == 0 && kDqSplitCols * (kConsumers / kDqMTiles) == kHeadDim &&
                      kDqCols % 16 == 0 && kDqCols <= 128,
                  "dQ splits into whole m64 tiles and column blocks (widths of the Wgmma table) per consumer");
    static_assert(kDqCols % kDqChunk == 0 && kDqChunk % KvTile::kPanelCols == 0, "dQ in chunks of whole K panels");
    static_assert(kBlockM <= 256 && kBlockN <= 256, "a tensor-memory box is at most 256 rows");
    static_assert(kAccCols + kScoreCols <= 192, "dK, dV, S^T and dP^T accumulators beyond this would spill");
    static_assert(kProductDim % 16 == 0 && kProductDim <= kHeadDim && (kProductDim == kHeadDim || !kSplitHeadDim),
                  "products over whole k16 steps of the head dim, narrowed only where a consumer holds all of it");
    static_assert(QTile::kBytes % 1024 == 0 && KvTile::kBytes % 1024 == 0 && DsTile::kBytes % 1024 == 0 &&
                      DqTile::kBytes % 1024 == 0,
                  "every tile starts on a swizzle atom");
    static_assert(kStages == 1 || kStages == 2, "one or two Q/dO buffers");
    static_assert(2 * QTile::kBytes <= DqTile::kBytes, "a direct dQ tile and an O tile in the float32 tile's place");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

}  // namespace cuflash
