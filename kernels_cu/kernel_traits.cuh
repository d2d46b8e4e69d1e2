// Tile sizes of the forward kernel and the shared-memory budget derived from them.
//
// The tile sizes themselves are chosen per (dtype, head dim) by the table in
// cuflash/_tiling.py and arrive here as template arguments; this struct
// derives everything else and rejects impossible combinations at compile time.
// cuflash/_tiling.py computes the same shared-memory size for the launch, and
// the kernel checks at run time that it was given at least kSmemBytes.
#pragma once

#include "numeric.cuh"

namespace cuflash {

template <typename Element_, int kHeadDimPadded_, int kBlockM_, int kBlockN_, int kWarps_>
struct KernelTraits {
    using Element = Element_;
    static constexpr int kHeadDimPadded = kHeadDimPadded_;  // head_dim rounded up; padded columns are zero
    static constexpr int kBlockM = kBlockM_;                // query rows per thread block
    static constexpr int kBlockN = kBlockN_;                // keys per streamed K/V tile
    static constexpr int kWarps = kWarps_;
    static constexpr int kThreads = kWarps * 32;

    // Each query row is owned by kThreadsPerRow consecutive lanes of one warp.
    // A lane holds kKeysPerThread scores of its row and kColsPerThread output
    // columns (columns lane_in_row, lane_in_row + kThreadsPerRow, ...).
    static constexpr int kThreadsPerRow = kThreads / kBlockM;
    static constexpr int kKeysPerThread = kBlockN / kThreadsPerRow;
    static constexpr int kColsPerThread = kHeadDimPadded / kThreadsPerRow;

    // Q/K/V rows in shared memory are padded by one 4-byte word: the lanes of a
    // warp read one column of 32 / kThreadsPerRow different rows at once, and
    // the odd word stride puts those rows in different banks.
    static constexpr int kRowPad = 4 / int(sizeof(Element));
    static constexpr int kSmemRowStride = kHeadDimPadded + kRowPad;  // elements
    // The probability tile is float with one float of padding for the same reason.
    static constexpr int kScoreRowStride = kBlockN + 1;  // floats

    static constexpr int kSmemQOffset = 0;
    static constexpr int kSmemKOffset = kSmemQOffset + kBlockM * kSmemRowStride * int(sizeof(Element));
    static constexpr int kSmemVOffset = kSmemKOffset + kBlockN * kSmemRowStride * int(sizeof(Element));
    static constexpr int kSmemPOffset = ceil_div(kSmemVOffset + kBlockN * kSmemRowStride * int(sizeof(Element)), 16) * 16;
    static constexpr int kSmemBytes = kSmemPOffset + kBlockM * kScoreRowStride * int(sizeof(float));

    // Hopper and Ampere (sm_80+) allow 227 KiB of shared memory per block.
    static constexpr int kMaxSmemBytes = 227 * 1024;

    static_assert(kHeadDimPadded % 32 == 0 && kHeadDimPadded >= 32 && kHeadDimPadded <= 256,
                  "head dim is padded to a multiple of 32, at most 256");
    static_assert(kThreads % kBlockM == 0, "every query row needs the same number of lanes");
    static_assert(kThreadsPerRow >= 1 && kThreadsPerRow <= 32 && (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                  "the lanes of a row must be a power-of-two group inside one warp");
    static_assert(kBlockN % kThreadsPerRow == 0, "keys of a tile split evenly over a row's lanes");
    static_assert(kHeadDimPadded % kThreadsPerRow == 0, "output columns split evenly over a row's lanes");
    static_assert(kColsPerThread <= 64 && kKeysPerThread <= 64,
                  "per-thread register arrays this large would spill");
    static_assert(kSmemBytes <= kMaxSmemBytes, "tile sizes exceed the shared-memory budget");
};

}  // namespace cuflash

namespace cuflash {

// Dynamic shared memory this launch was given, read from the PTX special register.
__device__ __forceinline__ unsigned dynamic_shared_memory_bytes() {
    unsigned bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// The launcher sizes shared memory from cuflash/_tiling.py, a second copy of
// the formula above. If the two ever disagree the kernel would write past its
// shared memory; stop the launch instead of corrupting memory silently.
template <typename Traits>
__device__ __forceinline__ void require_shared_memory() {
    if (dynamic_shared_memory_bytes() < static_cast<unsigned>(Traits::kSmemBytes)) {
        __trap();
    }
}

}  // namespace cuflash
