// Copies between global and shared memory.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Copies a kRows x kCols tile whose rows are row_stride elements apart in
// global memory (last dimension contiguous) into shared memory rows of
// kSmemStride elements. Rows at or past valid_rows (beyond the sequence) and
// columns at or past valid_cols (head-dim padding) are written as zeros and
// never read from global memory: zero columns add nothing to a dot product,
// which is what lets any head_dim run on a kernel built for a padded one.
// Consecutive threads take consecutive columns, so the loads coalesce.
template <int kRows, int kCols, int kSmemStride, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_zero_padded(Element* __restrict__ smem,
                                                      const Element* __restrict__ gmem,
                                                      index_t row_stride, int valid_rows,
                                                      int valid_cols, int thread) {
    const Element zero = from_float<Element>(0.0f);
#pragma unroll 4
    for (int idx = thread; idx < kRows * kCols; idx += kThreads) {
        const int row = idx / kCols;
        const int col = idx % kCols;
        Element value = zero;
        if (row < valid_rows && col < valid_cols) {
            value = gmem[static_cast<index_t>(row) * row_stride + col];
        }
        smem[row * kSmemStride + col] = value;
    }
}

// The same rows of two tensors (K and V, or Q and dO: one sequence
// position range, so one valid_rows) into two tiles.
template <int kRows, int kCols, int kSmemStride, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_pair_zero_padded(Element* smem_a, const Element* gmem_a, index_t stride_a,
                                                           Element* smem_b, const Element* gmem_b, index_t stride_b,
                                                           int valid_rows, int valid_cols, int thread) {
    load_tile_zero_padded<kRows, kCols, kSmemStride, kThreads>(smem_a, gmem_a, stride_a, valid_rows, valid_cols,
                                                               thread);
    load_tile_zero_padded<kRows, kCols, kSmemStride, kThreads>(smem_b, gmem_b, stride_b, valid_rows, valid_cols,
                                                               thread);
}

}  // namespace cuflash

namespace cuflash {

// Copies the first valid_rows x valid_cols of a kRows x kCols shared-memory
// tile to global memory rows row_stride elements apart. Results are staged
// in shared memory and written this way, consecutive threads on consecutive
// columns, because the lanes that compute them own strided columns: written
// from registers directly, one warp store would touch a 32-byte sector for
// every 4 bytes it writes.
template <int kRows, int kCols, int kSmemStride, int kThreads, typename Element>
__device__ __forceinline__ void store_tile(Element* __restrict__ gmem, index_t row_stride,
                                           const Element* __restrict__ smem, int valid_rows, int valid_cols,
                                           int thread) {
#pragma unroll 4
    for (int idx = thread; idx < kRows * kCols; idx += kThreads) {
        const int row = idx / kCols;
        const int col = idx % kCols;
        if (row < valid_rows && col < valid_cols) {
            gmem[static_cast<index_t>(row) * row_stride + col] = smem[row * kSmemStride + col];
        }
    }
}

// Writes this lane's values (columns lane, lane + kLanes, ...) of one tile
// row into shared memory, converted to the storage type, ready for store_tile.
template <int kCols, int kLanes, typename Element>
__device__ __forceinline__ void stage_row(Element* __restrict__ smem_row, const float (&values)[kCols], float scale,
                                          int lane) {
#pragma unroll
    for (int i = 0; i < kCols; ++i) {
        smem_row[lane + i * kLanes] = from_float<Element>(values[i] * scale);
    }
}

}  // namespace cuflash
