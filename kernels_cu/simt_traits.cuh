// Tiles, thread mappings and shared-memory layouts of the SIMT kernels
// (flash_fwd.cu, flash_bwd.cu): the tile sizes arrive as template arguments
// from cuflash/_kernel_families.py; SimtTraits derives the thread mappings
// and one layout per kernel (ForwardSmem, BackwardDkDvSmem, BackwardDqSmem)
// places its tiles and rejects impossible combinations at compile time.
#pragma once

#include "numeric.cuh"
#include "shared_memory.cuh"

namespace cuflash {

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
struct SimtTraits {
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
    static constexpr int kStride = QTile::kStride;             // elements between rows of either
    static_assert(KTile::kStride == kStride, "Q and K/V rows share one stride");
    using ScoreTile = SmemTile<float, kBlockM, kBlockN>;   // P or dS, one row per query
    using ScoreTileT = SmemTile<float, kBlockN, kBlockM>;  // P^T or dS^T, one row per key
    using RowStats = SmemTile<float, 1, kBlockM>;          // one float per query row

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

// Tiles of the given byte sizes, one after another from the start of the
// dynamic shared memory (each size a multiple of 16, so every tile is
// 16-byte aligned): at<T, i>() points at tile i, kBytes is the total.
template <int... kTileBytes>
struct TileStack {
    static constexpr int kSizes[] = {kTileBytes...};
    __host__ __device__ static constexpr int offset(int tile) {
        int bytes = 0;
        for (int i = 0; i < tile; ++i) {
            bytes += kSizes[i];
        }
        return bytes;
    }
    static constexpr int kBytes = offset(sizeof...(kTileBytes));
    static_assert(kBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");

    template <typename T, int kIndex>
    __device__ __forceinline__ static T* at() {
        constexpr int kOffset = offset(kIndex);
        return shared_tile<T>(kOffset);
    }
};

// Forward: Q stays, K/V stream, P is the probability tile.
template <typename Traits>
struct ForwardSmem : QueryMajorMapping<Traits> {
    using E = typename Traits::Element;
    using Stack =
        TileStack<Traits::QTile::kBytes, Traits::KTile::kBytes, Traits::KTile::kBytes, Traits::ScoreTile::kBytes>;
    static constexpr int kBytes = Stack::kBytes;
    struct Tiles {
        E *q, *k, *v;
        float* p;
    };
    __device__ __forceinline__ static Tiles tiles() {
        return {Stack::template at<E, 0>(), Stack::template at<E, 1>(), Stack::template at<E, 2>(),
                Stack::template at<float, 3>()};
    }
};

// Backward, one block per key block: K/V and the dK/dV accumulators stay;
// Q, dO and their row statistics stream; P^T and dS^T are key-major.
template <typename Traits>
struct BackwardDkDvSmem {
    using E = typename Traits::Element;
    using Stack = TileStack<Traits::KTile::kBytes, Traits::KTile::kBytes, Traits::QTile::kBytes, Traits::QTile::kBytes,
                            Traits::ScoreTileT::kBytes, Traits::ScoreTileT::kBytes, Traits::RowStats::kBytes,
                            Traits::RowStats::kBytes>;
    static constexpr int kBytes = Stack::kBytes;
    struct Tiles {
        E *k, *v, *q, *dout;
        float *pt, *dst, *lse, *delta;
    };
    __device__ __forceinline__ static Tiles tiles() {
        return {Stack::template at<E, 0>(),     Stack::template at<E, 1>(),     Stack::template at<E, 2>(),
                Stack::template at<E, 3>(),     Stack::template at<float, 4>(), Stack::template at<float, 5>(),
                Stack::template at<float, 6>(), Stack::template at<float, 7>()};
    }

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
};

// Backward dQ without atomics (deterministic): one block per query block,
// Q/dO stay, K/V stream, dS is query-major.
template <typename Traits>
struct BackwardDqSmem : QueryMajorMapping<Traits> {
    using E = typename Traits::Element;
    using Stack = TileStack<Traits::QTile::kBytes, Traits::QTile::kBytes, Traits::KTile::kBytes, Traits::KTile::kBytes,
                            Traits::ScoreTile::kBytes>;
    static constexpr int kBytes = Stack::kBytes;
    struct Tiles {
        E *q, *dout, *k, *v;
        float* ds;
    };
    __device__ __forceinline__ static Tiles tiles() {
        return {Stack::template at<E, 0>(), Stack::template at<E, 1>(), Stack::template at<E, 2>(),
                Stack::template at<E, 3>(), Stack::template at<float, 4>()};
    }
};

}  // namespace cuflash
