// Tile sizes of the kernels and the shared-memory budget derived from them.
//
// The tile sizes themselves are chosen per (dtype, head dim) by the tables in
// cuflash/_tiling.py and arrive here as template arguments; KernelTraits
// derives the thread mappings, and one shared-memory layout per kernel
// (ForwardSmem, BackwardDkDvSmem, BackwardDqSmem) places its tiles and rejects
// impossible combinations at compile time. cuflash/_tiling.py computes the
// same byte counts for the launch (checked by tests/test_tiling.py), and each
// kernel checks at run time that it was given at least kBytes.
#pragma once

#include "numeric.cuh"
#include "swizzled_tile.cuh"

namespace cuflash {

// Hopper and Ampere (sm_80+) allow 227 KiB of shared memory per block.
constexpr int kMaxSmemBytes = 227 * 1024;

// A kRows x kCols tile of T in shared memory. Rows are padded by one 4-byte
// word: the lanes of a warp read one column of several rows at once, and the
// odd word stride puts those rows in different banks. Every tile starts on a
// 16-byte boundary.
template <typename T, int kRows, int kCols>
struct SmemTile {
    static constexpr int kPad = sizeof(T) >= 4 ? 1 : 4 / int(sizeof(T));
    static constexpr int kStride = kCols + kPad;  // elements between rows
    static constexpr int kBytes = ceil_div(kRows * kStride * int(sizeof(T)), 16) * 16;
};

template <int kLanes>
__host__ __device__ constexpr bool is_lane_group() {
    return kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0;
}

template <typename Element_, int kHeadDimPadded_, int kBlockM_, int kBlockN_, int kWarps_>
struct KernelTraits {
    using Element = Element_;
    static constexpr int kHeadDimPadded = kHeadDimPadded_;  // head_dim rounded up; padded columns are zero
    static constexpr int kBlockM = kBlockM_;                // query rows per tile
    static constexpr int kBlockN = kBlockN_;                // keys per tile
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;

    // Query-major mapping: each query row is owned by kLanesPerRow consecutive
    // lanes of one warp; a lane holds keys lane, lane + kLanesPerRow, ... of
    // its row and the same strided subset of the head-dim columns.
    static constexpr int kLanesPerRow = kThreads / kBlockM;
    // Key-major mapping (backward dK/dV): the same with keys and query rows swapped.
    static constexpr int kLanesPerKey = kThreads / kBlockN;

    using QTile = SmemTile<Element, kBlockM, kHeadDimPadded>;  // Q or dO rows
    using KTile = SmemTile<Element, kBlockN, kHeadDimPadded>;  // K or V rows
    using ScoreTile = SmemTile<float, kBlockM, kBlockN>;       // P or dS, one row per query
    using ScoreTileT = SmemTile<float, kBlockN, kBlockM>;      // P^T or dS^T, one row per key
    using RowStats = SmemTile<float, 1, kBlockM>;              // one float per query row

    static_assert(kHeadDimPadded % 32 == 0 && kHeadDimPadded >= 32 && kHeadDimPadded <= 256,
                  "head dim is padded to a multiple of 32, at most 256");
};

// Query-major thread mapping (forward, deterministic dQ): kLanesPerRow lanes
// own a query row; each holds kKeysPerLane scores and kColsPerLane head-dim
// columns of it.
template <typename Traits>
struct QueryMajorMapping {
    static constexpr int kKeysPerLane = Traits::kBlockN / Traits::kLanesPerRow;
    static constexpr int kColsPerLane = Traits::kHeadDimPadded / Traits::kLanesPerRow;
    static_assert(Traits::kThreads % Traits::kBlockM == 0, "every query row needs the same number of lanes");
    static_assert(is_lane_group<Traits::kLanesPerRow>(), "a row's lanes are a power-of-two group in one warp");
    static_assert(Traits::kBlockN % Traits::kLanesPerRow == 0 && Traits::kHeadDimPadded % Traits::kLanesPerRow == 0,
                  "keys and columns split evenly over a row's lanes");
    static_assert(2 * kKeysPerLane <= 64 && kColsPerLane <= 64, "per-lane register arrays this large would spill");
};

// Forward: Q stays, K/V stream, P is the probability tile.
template <typename Traits>
struct ForwardSmem : QueryMajorMapping<Traits> {
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + Traits::QTile::kBytes;
    static constexpr int kV = kK + Traits::KTile::kBytes;
    static constexpr int kP = kV + Traits::KTile::kBytes;
    static constexpr int kBytes = kP + Traits::ScoreTile::kBytes;
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Backward, one block per key block: K/V and the dK/dV accumulators stay;
// Q, dO and their row statistics stream; P^T and dS^T are key-major.
template <typename Traits>
struct BackwardDkDvSmem {
    static constexpr int kK = 0;
    static constexpr int kV = kK + Traits::KTile::kBytes;
    static constexpr int kQ = kV + Traits::KTile::kBytes;
    static constexpr int kDo = kQ + Traits::QTile::kBytes;
    static constexpr int kPt = kDo + Traits::QTile::kBytes;
    static constexpr int kDSt = kPt + Traits::ScoreTileT::kBytes;
    static constexpr int kLse = kDSt + Traits::ScoreTileT::kBytes;
    static constexpr int kDelta = kLse + Traits::RowStats::kBytes;
    static constexpr int kBytes = kDelta + Traits::RowStats::kBytes;

    static constexpr int kRowsPerLane = Traits::kBlockM / Traits::kLanesPerKey;
    static constexpr int kColsPerLane = Traits::kHeadDimPadded / Traits::kLanesPerKey;
    static constexpr int kDqColsPerLane = Traits::kHeadDimPadded / Traits::kLanesPerRow;
    static_assert(Traits::kThreads % Traits::kBlockN == 0 && Traits::kThreads % Traits::kBlockM == 0,
                  "every key and every query row needs the same number of lanes");
    static_assert(is_lane_group<Traits::kLanesPerKey>() && is_lane_group<Traits::kLanesPerRow>(),
                  "lanes of a key or row are a power-of-two group in one warp");
    static_assert(Traits::kBlockM % Traits::kLanesPerKey == 0 && Traits::kHeadDimPadded % Traits::kLanesPerKey == 0 &&
                      Traits::kHeadDimPadded % Traits::kLanesPerRow == 0,
                  "rows and columns split evenly over the lanes");
    static_assert(2 * kColsPerLane <= 64 && kRowsPerLane <= 32 && kDqColsPerLane <= 32,
                  "per-lane register arrays this large would spill");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Backward dQ without atomics (deterministic): one block per query block,
// Q/dO stay, K/V stream, dS is query-major.
template <typename Traits>
struct BackwardDqSmem : QueryMajorMapping<Traits> {
    static constexpr int kQ = 0;
    static constexpr int kDo = kQ + Traits::QTile::kBytes;
    static constexpr int kK = kDo + Traits::QTile::kBytes;
    static constexpr int kV = kK + Traits::KTile::kBytes;
    static constexpr int kDS = kV + Traits::KTile::kBytes;
    static constexpr int kBytes = kDS + Traits::ScoreTile::kBytes;
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// What the two tensor-core forwards share: tile sizes, threads, and the
// fragment counts of a warp's S = Q K^T and O accumulators (n8 column tiles
// of the mma / wgmma accumulator layout, see mma.cuh) and of their k16 steps.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct TensorCoreForwardShape {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;  // padded head dim; padded columns are zero
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;

    static constexpr int kNTiles = kBlockN / 8;     // n8 tiles of S per 16 rows
    static constexpr int kDTiles = kHeadDim / 8;    // n8 tiles of O per 16 rows
    static constexpr int kQkSteps = kHeadDim / 16;  // k16 steps of Q K^T
    static constexpr int kPvSteps = kBlockN / 16;   // k16 steps of P V

    static_assert(sizeof(Element) == 2, "tensor-core path: float16 and bfloat16 only");
};

// Tensor-core forward (flash_fwd_mma.cu): the kWarps warps split the kBlockM
// query rows evenly, each warp owning kMTiles tiles of 16 rows; K and V tiles
// of kBlockN keys are shared by all warps. A K or V fragment read from shared
// memory feeds kMTiles products, which is what keeps shared-memory bandwidth
// below the tensor cores' appetite, and kMTiles * (kDTiles + kNTiles) * 4
// accumulators per lane is what limits it.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kKvStages_>
struct MmaForwardTraits : TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
    using Shape = TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
    using typename Shape::Element;
    using Shape::kBlockM, Shape::kBlockN, Shape::kHeadDim, Shape::kWarps, Shape::kDTiles, Shape::kNTiles,
        Shape::kQkSteps;

    static constexpr int kRowsPerWarp = kBlockM / kWarps;
    static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp

    // Every row is padded by one 16-byte chunk: ldmatrix reads one chunk from
    // each of 8 rows at once, and with an odd number of chunks per row those
    // 8 chunks fall in 8 different bank groups (no conflicts, no swizzle).
    static constexpr int kStride = kHeadDim + 8;
    // Buffers of K and V: with 2, block j-1 is copied in while block j is
    // used; with 1 (where registers are too tight for the longer-lived copy
    // state), V_j is copied during S_j and K_{j-1} during P_j V_j.
    static constexpr int kKvStages = kKvStages_;
    static constexpr int kKvTileBytes = kBlockN * kStride * int(sizeof(Element));
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kBlockM * kStride * int(sizeof(Element));
    static constexpr int kV = kK + kKvStages * kKvTileBytes;
    static constexpr int kBytes = kV + kKvStages * kKvTileBytes;

    // Q's A fragments stay in registers for the whole key loop when they fit
    // in 32 registers; otherwise they are re-read from shared memory per block.
    static constexpr bool kQInRegisters = kMTiles * kQkSteps * 4 <= 32;

    static_assert(kBlockM % (16 * kWarps) == 0, "each warp owns whole m16 tiles");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0 && kHeadDim <= 256, "k16 steps over keys and head dim");
    static_assert((kStride * int(sizeof(Element)) / 16) % 2 == 1, "odd chunks per row: conflict-free ldmatrix");
    static_assert(kMTiles * (kDTiles + kNTiles) * 4 <= 192, "accumulators beyond this would spill");
    static_assert(kKvStages == 1 || kKvStages == 2, "single or double buffered K/V");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Hopper forward (flash_fwd_wgmma.cu, sm_90a): kWarps / 4 warpgroups, each
// owning 64 query rows (one wgmma m64 tile) of the kBlockM; K and V tiles of
// kBlockN keys, double-buffered, are read by every warpgroup straight from
// shared memory by the tensor cores. Per thread the accumulators are S
// (kBlockN / 2 floats), O (kHeadDim / 2) and the previous block's P
// (kBlockN / 4 registers), all live at once while P V overlaps the softmax.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct WgmmaForwardTraits : TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_> {
    using Shape = TensorCoreForwardShape<Element_, kHeadDim_, kBlockM_, kBlockN_, kWarps_>;
    using Shape::kBlockM, Shape::kBlockN, Shape::kHeadDim, Shape::kWarps;
    static constexpr int kWarpgroups = kWarps / 4;

    using QTile = SwizzledTile<kBlockM, kHeadDim>;
    using KvTile = SwizzledTile<kBlockN, kHeadDim>;
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + QTile::kBytes;           // two K buffers
    static constexpr int kV = kK + 2 * KvTile::kBytes;      // two V buffers
    static constexpr int kLayoutBytes = kV + 2 * KvTile::kBytes;
    // Swizzle atoms must be 1024-byte aligned; the dynamic shared memory is
    // only guaranteed 16, so the launch asks for this much more and the
    // kernel rounds its base up.
    static constexpr int kAlignment = 1024;
    static constexpr int kBytes = kLayoutBytes + kAlignment;

    static_assert(kWarps % 4 == 0 && kBlockM == 64 * kWarpgroups, "one warpgroup per 64 query rows");
    static_assert(kHeadDim % 64 == 0 && kBlockN % 64 == 0, "whole 128-byte swizzle panels; wgmma N of 64 or 128");
    static_assert(kBlockN / 2 + kHeadDim / 2 + kBlockN / 4 <= 192, "accumulators beyond this would spill");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Hopper backward dK/dV (flash_bwd_wgmma.cu, sm_90a): kWarps / 4 warpgroups,
// each owning 64 of the block's kBlockN keys (one wgmma m64 tile of S^T, dP^T,
// dK and dV), walking query blocks of kBlockM rows. Per thread: dK and dV
// accumulators (kHeadDim / 2 floats each), S^T and dP^T (kBlockM / 2 each),
// then this warpgroup's share of dQ_i = dS_i K_j (kDqCols / 2), which is
// added to the float32 accumulator with atomics. The warpgroups split dQ's
// kBlockM x kHeadDim into m64 tiles first, then into column blocks.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_>
struct WgmmaBackwardTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;  // padded head dim; padded columns are zero
    static constexpr int kBlockM = kBlockM_;    // query rows per step
    static constexpr int kBlockN = kBlockN_;    // keys per thread block
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;
    static constexpr int kWarpgroups = kWarps / 4;

    static constexpr int kQTiles = kBlockM / 8;     // n8 tiles of a warp's S^T and dP^T
    static constexpr int kDTiles = kHeadDim / 8;    // n8 tiles of a warp's dK and dV
    static constexpr int kQkSteps = kHeadDim / 16;  // k16 steps of S^T = K Q^T and dP^T = V dO^T
    static constexpr int kRowSteps = kBlockM / 16;  // k16 steps of dV += P^T dO and dK += dS^T Q
    static constexpr int kKeySteps = kBlockN / 16;  // k16 steps of dQ = dS K
    static constexpr int kDqMTiles = kBlockM / 64;  // m64 tiles of dQ
    static constexpr int kDqCols = kHeadDim * kDqMTiles / kWarpgroups;  // dQ columns per warpgroup

    using KvTile = SwizzledTile<kBlockN, kHeadDim>;  // K, V: rows are keys
    using QTile = SwizzledTile<kBlockM, kHeadDim>;   // Q, dO: rows are queries
    using DsTile = SwizzledTile<kBlockN, kBlockM>;   // dS^T: rows are keys, columns queries
    static constexpr int kK = 0;
    static constexpr int kV = kK + KvTile::kBytes;
    static constexpr int kQ = kV + KvTile::kBytes;     // two buffers
    static constexpr int kDo = kQ + 2 * QTile::kBytes;  // two buffers
    static constexpr int kDs = kDo + 2 * QTile::kBytes;
    static constexpr int kStats = kDs + DsTile::kBytes;  // two buffers of (LSE in log2, delta), kBlockM floats each
    static constexpr int kLayoutBytes = kStats + 2 * 2 * kBlockM * 4;
    static constexpr int kAlignment = 1024;  // swizzle atoms; see WgmmaForwardTraits
    static constexpr int kBytes = kLayoutBytes + kAlignment;

    static_assert(sizeof(Element) == 2, "wgmma path: float16 and bfloat16 only");
    static_assert(kWarps % 4 == 0 && kBlockN == 64 * kWarpgroups, "one warpgroup per 64 keys");
    static_assert(kBlockM % 64 == 0 && kHeadDim % 64 == 0, "whole 128-byte swizzle panels");
    static_assert(kWarpgroups % kDqMTiles == 0 && kDqCols % 64 == 0 && kDqCols <= 128,
                  "dQ splits into whole m64 tiles and 64-column blocks per warpgroup");
    static_assert(kHeadDim + kBlockM <= 192, "dK, dV, S^T and dP^T accumulators beyond this would spill");
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

// Dynamic shared memory this launch was given, read from the PTX special register.
__device__ __forceinline__ unsigned dynamic_shared_memory_bytes() {
    unsigned bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// The launcher sizes shared memory from cuflash/_tiling.py, a second copy of
// the layouts above. If the two ever disagreed the kernel would write past its
// shared memory; stop the launch instead of corrupting memory silently.
template <typename Layout>
__device__ __forceinline__ void require_shared_memory() {
    if (dynamic_shared_memory_bytes() < static_cast<unsigned>(Layout::kBytes)) {
        __trap();
    }
}

// Typed pointer to the tile at byte `offset` of the launch's dynamic shared
// memory (offsets come from a layout above; call require_shared_memory first).
template <typename T>
__device__ __forceinline__ T* shared_tile(int offset) {
    extern __shared__ __align__(16) unsigned char shared_memory[];
    return reinterpret_cast<T*>(shared_memory + offset);
}

// Shared address (and generic pointer) of the launch's dynamic shared memory
// rounded up to kAlignment; the launch asked for kAlignment bytes more.
template <int kAlignment>
__device__ __forceinline__ u32 aligned_shared_base(unsigned char*& generic) {
    unsigned char* const unaligned = shared_tile<unsigned char>(0);
    const u32 address = static_cast<u32>(__cvta_generic_to_shared(unaligned));
    const u32 aligned = (address + kAlignment - 1) & ~static_cast<u32>(kAlignment - 1);
    generic = unaligned + (aligned - address);
    return aligned;
}

}  // namespace cuflash
