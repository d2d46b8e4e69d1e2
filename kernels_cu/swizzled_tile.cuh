// The swizzled shared-memory layouts the Hopper tensor cores read (wgmma
// operands, see wgmma.cuh), written by load_swizzled_tile_async.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// The widest swizzle (128, 64 or 32 bytes per row of a panel) whose panels
// tile `cols` 16-bit columns exactly.
__host__ __device__ constexpr int widest_swizzle_bytes(int cols) {
    return cols % 64 == 0 ? 128 : cols % 32 == 0 ? 64 : 32;
}

// A kRows x kCols tile of 16-bit elements in a kSwizzleBytes swizzled layout
// (the PTX ISA's 128-, 64- and 32-byte swizzle modes): kCols / kPanelCols
// column panels, each kRows rows of kSwizzleBytes. Within a panel the 16-byte
// chunk c of row r is stored at chunk c ^ ((r * kSwizzleBytes / 128) % chunks
// per row): the tensor cores XOR address bits 4.. with bits 7.., so eight
// rows are one swizzle atom of 8 * kSwizzleBytes bytes and panels start at
// multiples of it. The swizzle spreads the 8 rows a core matrix reads over
// distinct banks, and the same layout serves K-major operands (Q, K: rows
// are M or N, the panel's columns are K) and MN-major ones (V: rows are K,
// columns are N). The 128-byte mode is the fastest to read; a narrower one
// is for tiles (or column blocks of them) that are not whole 64 columns.
template <int kRows_, int kCols_, int kSwizzleBytes_ = widest_swizzle_bytes(kCols_)>
struct SwizzledTile {
    static constexpr int kRows = kRows_;
    static constexpr int kCols = kCols_;
    static constexpr int kSwizzleBytes = kSwizzleBytes_;
    static constexpr int kPanelCols = kSwizzleBytes / 2;
    static constexpr int kChunksPerPanelRow = kSwizzleBytes / 16;
    static constexpr int kPanelBytes = kRows * kSwizzleBytes;
    static constexpr int kAtomBytes = 8 * kSwizzleBytes;
    static constexpr int kBytes = kPanelBytes * (kCols / kPanelCols);
    // The descriptor's layout type (PTX ISA, "Matrix Descriptor Format").
    static constexpr int kDescriptorMode = kSwizzleBytes == 128 ? 1 : kSwizzleBytes == 64 ? 2 : 3;
    static_assert(kSwizzleBytes == 128 || kSwizzleBytes == 64 || kSwizzleBytes == 32, "a PTX swizzle mode");
    static_assert(kCols % kPanelCols == 0, "whole panels");
    static_assert(kRows % 8 == 0, "whole swizzle atoms");

    // Byte offset of the 16-byte chunk holding columns 8 * chunk .. 8 * chunk + 7 of `row`.
    static __device__ __forceinline__ int chunk_offset(int row, int chunk) {
        return chunk / kChunksPerPanelRow * kPanelBytes + row * kSwizzleBytes +
               ((chunk % kChunksPerPanelRow) ^ (row * kSwizzleBytes / 128 % kChunksPerPanelRow)) * 16;
    }
};

// One lane's 16-byte row of the ldmatrix matrices it addresses in a
// SwizzledTile: row lane_row of a group of rows, 16-byte chunk lane_chunk (0
// or 1) of a pair of chunks. address(tile, row0, chunk) is its shared
// address in the tile at `tile` (a multiple of kSwizzleBytes; 1024 where the
// copy engine writes it) where the group starts at row row0 (a multiple of
// 8: the swizzle repeats every 8 rows) and the pair at chunk `chunk` (even:
// the pair stays in one panel row). Everything but the chunk's place in
// its panel row is a multiple of kSwizzleBytes, so the swizzle is one XOR
// on the whole address after the adds, and nothing lane-specific per row
// group and chunk stays live across a loop (precomputed offsets cost ptxas
// 70 registers in the decode forward).
template <typename Tile>
struct SwizzledLaneRow {
    int row_bytes;  // lane_row's offset within a panel
    u32 chunk_xor;  // (lane_chunk ^ lane_row's swizzle) * 16

    __device__ __forceinline__ SwizzledLaneRow(int lane_row, int lane_chunk)
        : row_bytes(lane_row * Tile::kSwizzleBytes),
          chunk_xor((lane_chunk ^ (lane_row * Tile::kSwizzleBytes / 128 % Tile::kChunksPerPanelRow)) * 16) {}

    __device__ __forceinline__ u32 address(u32 tile, int row0, int chunk) const {
        return (tile + row_bytes + chunk / Tile::kChunksPerPanelRow * Tile::kPanelBytes + row0 * Tile::kSwizzleBytes +
                chunk % Tile::kChunksPerPanelRow * 16) ^
               chunk_xor;
    }
};

// Zeros rows first_row .. Tile::kRows - 1 of the swizzled tile at shared
// address `tile`, kThreads threads each storing 16-byte chunks.
template <typename Tile, int kThreads>
__device__ __forceinline__ void zero_swizzled_rows(u32 tile, int first_row, int thread) {
    constexpr int kChunksPerRow = Tile::kCols / 8;
    for (int chunk = first_row * kChunksPerRow + thread; chunk < Tile::kRows * kChunksPerRow; chunk += kThreads) {
        const u32 address = tile + Tile::chunk_offset(chunk / kChunksPerRow, chunk % kChunksPerRow);
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(address), "r"(0u) : "memory");
    }
}

// A kRows x kCols tile of float32 in the 128-byte swizzle: kCols / 32 column
// panels of kRows rows of 128 bytes, the 16-byte chunk c (4 floats) of row r
// stored at chunk c ^ (r % 8). It is the layout a tensor map with the
// 128-byte swizzle and a box of 32 columns reads (the Hopper backward's dQ
// tile, reduced into global memory by the copy engine), and a warp writing
// float2 pairs of its accumulator rows (8 rows x 32 bytes) touches every
// bank twice: two wavefronts for 256 bytes, no more.
template <int kRows_, int kCols_>
struct SwizzledFloatTile {
    static constexpr int kRows = kRows_;
    static constexpr int kCols = kCols_;
    static constexpr int kPanelCols = 32;
    static constexpr int kPanelBytes = kRows * 128;
    static constexpr int kBytes = kPanelBytes * (kCols / kPanelCols);
    static_assert(kCols % kPanelCols == 0, "whole 128-byte panels");
    static_assert(kRows % 8 == 0, "whole swizzle atoms");

    // Float column c of row r sits at byte (c / 32) kPanelBytes + 128 r +
    // ((c % 32) / 4 ^ r % 8) 16 + (c % 4) 4. FragmentLane gives that for a
    // lane's elements of an m16 accumulator fragment: rows row0 + lane / 4
    // (+ 8 for the second half), float columns col + 2 (lane % 4) and the
    // next, for row0 a multiple of 8 and col of 8. It is split into the
    // lane's share, once, and the column's: the column's 16-byte chunk in
    // its panel is even and the lane adds (lane % 4) / 2 to it, so the row's
    // swizzle bits act on the two apart. A fragment's stores then cost an
    // XOR and an add per column (the whole formula in signed arithmetic on
    // the lane index, re-read each step, had cost the backward about 12
    // integer instructions a store).
    struct FragmentLane {
        unsigned lane_bytes;    // the row, the swizzled low chunk bit and the float in the chunk
        unsigned swizzle_high;  // the row's swizzle bits above the lowest, as bytes
        __host__ __device__ __forceinline__ unsigned offset(unsigned col, int half) const {
            return col / kPanelCols * kPanelBytes + half * 8 * 128 + lane_bytes +
                   (((col % kPanelCols) / 4 * 16) ^ swizzle_high);
        }
    };
    static __host__ __device__ __forceinline__ FragmentLane fragment_lane(unsigned row0, unsigned lane) {
        const unsigned row_in_atom = lane / 4;  // (row0 + lane / 4 + 8 half) % 8
        return {(row0 + lane / 4) * 128 + (((lane % 4) / 2) ^ (row_in_atom & 1)) * 16 + (2 * lane) % 4 * 4,
                (row_in_atom & 6) * 16};
    }
};

// Stores the 16 rows row0 .. row0 + 15, columns col0 .. col0 + kCols - 1 of a
// swizzled tile (a warp's accumulator rows, staged there) to `out`, the
// tile's row 0 in global memory (rows row_stride elements apart), 16 bytes
// per lane: consecutive lanes write consecutive chunks of a row. Rows at or
// past valid_rows and columns at or past head_dim are not written.
template <typename Tile, int kCols = Tile::kCols, typename Element>
__device__ __forceinline__ void store_warp_rows(Element* out, index_t row_stride, const unsigned char* tile, int row0,
                                                int valid_rows, int head_dim, int lane, int col0 = 0) {
    constexpr int kChunksPerRow = kCols / 8;
    constexpr int kChunks = 16 * kChunksPerRow;
    static_assert(sizeof(Element) == 2 && kCols % 8 == 0, "16-bit rows of whole chunks");
#pragma unroll
    for (int i = 0; i < ceil_div(kChunks, 32); ++i) {
        const int chunk = lane + i * 32;
        const int row = row0 + chunk / kChunksPerRow;
        const int col_chunk = col0 / 8 + chunk % kChunksPerRow;
        if ((kChunks % 32 == 0 || chunk < kChunks) && row < valid_rows && col_chunk * 8 < head_dim) {
            *reinterpret_cast<uint4*>(out + static_cast<index_t>(row) * row_stride + col_chunk * 8) =
                *reinterpret_cast<const uint4*>(tile + Tile::chunk_offset(row, col_chunk));
        }
    }
}

}  // namespace cuflash
