// Small products between shared-memory tiles, on CUDA cores in float32.
//
// A "lane group" of kLanes consecutive lanes owns one row of a result; lane
// `lane` of the group takes the strided subset lane, lane + kLanes, ... of the
// other dimension, so that at each step the lanes of a warp read different
// rows (padded apart in banks) or neighbouring columns.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// out[j] = sum_d row[d] * tile[(lane + j * kLanes) * kStride + d] for j < kN:
// dot products of one row with kN rows of a tile, over kDim columns.
template <int kN, int kLanes, int kDim, int kStride, typename Element>
__device__ __forceinline__ void dot_with_tile_rows(const Element* __restrict__ row,
                                                   const Element* __restrict__ tile, int lane,
                                                   float (&out)[kN]) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
        out[j] = 0.0f;
    }
#pragma unroll 4
    for (int d = 0; d < kDim; ++d) {
        const float a = to_float(row[d]);
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            out[j] = fmaf(a, to_float(tile[(lane + j * kLanes) * kStride + d]), out[j]);
        }
    }
}

// acc[i] += sum_r weights[r * weight_stride] * tile[r * kStride + lane + i * kLanes]
// for r < kRows: this lane's columns of (weight row) x tile.
template <int kCols, int kLanes, int kRows, int kStride, typename Element>
__device__ __forceinline__ void accumulate_weighted_rows(float (&acc)[kCols], const float* __restrict__ weights,
                                                         int weight_stride, const Element* __restrict__ tile,
                                                         int lane) {
#pragma unroll 2
    for (int r = 0; r < kRows; ++r) {
        const float w = weights[r * weight_stride];
        const Element* tile_row = tile + r * kStride + lane;
#pragma unroll
        for (int i = 0; i < kCols; ++i) {
            acc[i] = fmaf(w, to_float(tile_row[i * kLanes]), acc[i]);
        }
    }
}

}  // namespace cuflash
