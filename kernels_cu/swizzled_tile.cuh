// The 128-byte swizzled shared-memory layout the Hopper tensor cores read
// (wgmma operands, see wgmma.cuh), written by load_swizzled_tile_async.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// A kRows x kCols tile of 16-bit elements in the 128-byte swizzled layout:
// kCols / 64 column panels, each kRows rows of 128 bytes (64 elements); the
// 16-byte chunk c of row r is stored at chunk c ^ (r % 8) of that row. Eight
// rows (1024 bytes) are one swizzle atom, and panels start 1024-byte aligned,
// because the tensor cores apply the XOR to address bits 4-6 from bits 7-9.
// The swizzle spreads the 8 rows a core matrix reads over all 32 banks, and
// the same layout serves K-major operands (Q, K: rows are M or N, the 64
// columns are K) and MN-major ones (V: rows are K, columns are N).
template <int kRows_, int kCols_>
struct SwizzledTile {
    static constexpr int kRows = kRows_;
    static constexpr int kCols = kCols_;
    static constexpr int kPanelBytes = kRows * 128;
    static constexpr int kBytes = kPanelBytes * (kCols / 64);
    static_assert(kCols % 64 == 0, "whole 128-byte panels of 64 elements");
    static_assert(kRows % 8 == 0, "whole 1024-byte swizzle atoms");

    // Byte offset of the 16-byte chunk holding columns 8 * chunk .. 8 * chunk + 7 of `row`.
    static __device__ __forceinline__ int chunk_offset(int row, int chunk) {
        return chunk / 8 * kPanelBytes + row * 128 + ((chunk % 8) ^ (row % 8)) * 16;
    }
};

// Stores the 16 rows row0 .. row0 + 15 of a swizzled tile (a warp's
// accumulator rows, staged there) to `out`, the tile's row 0 in global memory
// (rows row_stride elements apart), 16 bytes per lane: consecutive lanes
// write consecutive chunks of a row. Rows at or past valid_rows and columns at
// or past head_dim are not written.
template <typename Tile, typename Element>
__device__ __forceinline__ void store_warp_rows(Element* out, index_t row_stride, const unsigned char* tile, int row0,
                                                int valid_rows, int head_dim, int lane) {
    constexpr int kChunksPerRow = Tile::kCols / 8;
    static_assert(sizeof(Element) == 2 && (16 * kChunksPerRow) % 32 == 0, "16-bit rows, whole warp steps");
#pragma unroll
    for (int i = 0; i < 16 * kChunksPerRow / 32; ++i) {
        const int chunk = lane + i * 32;
        const int row = row0 + chunk / kChunksPerRow;
        const int col_chunk = chunk % kChunksPerRow;
        if (row < valid_rows && col_chunk * 8 < head_dim) {
            *reinterpret_cast<uint4*>(out + static_cast<index_t>(row) * row_stride + col_chunk * 8) =
                *reinterpret_cast<const uint4*>(tile + Tile::chunk_offset(row, col_chunk));
        }
    }
}

}  // namespace cuflash
