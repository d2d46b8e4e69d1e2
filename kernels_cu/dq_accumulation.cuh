// Adding a warp's share of dQ_i = dS K into the float32 accumulator in global
// memory (dq_accum, row-major rows of head_dim floats), where other thread
// blocks add into the same rows; sm_90 (vector reductions).
//
// The accumulator fragment of mma.sync and wgmma gives lane l rows l/4 and
// l/4 + 8 and, per n8 tile j, columns 8j + 2(l % 4) and the next: a warp
// instruction that adds it directly touches 32 bytes in each of 8 rows. L2
// applies reductions per 128-byte line, and such scattered 32-byte pieces add
// at 1.9 TB/s on an H100 against 3.2 TB/s for instructions covering whole
// lines (tools/dq_reduction_bench.py, the backward grid's pattern). At head
// dims 128-256 these additions bound the whole Hopper backward (without them
// it runs twice as fast: docs/perf-notes.md). So each warp passes its fragment
// through a small shared-memory area, 8 rows x 32 columns at a time, and reads
// it back a row's 128 bytes per 8 lanes.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Each warp stages 8 rows of 32 columns at a time, rows padded by 8 floats:
// the float2 writes of a half-warp (4 rows of 8 lanes' pairs) fall on 32
// distinct banks, and each quarter-warp's float4 reads (one row) as well.
constexpr int kDqStageRows = 8;
constexpr int kDqStageCols = 32;
constexpr int kDqStageStride = kDqStageCols + 8;
constexpr int kDqStagingFloatsPerWarp = kDqStageRows * kDqStageStride;

// Adds scale * dq (a warp's m16 x kCols accumulator fragment) into the rows at
// `rows` (the fragment's row 0, column 0; consecutive rows `row_stride` floats
// apart). Only rows below `valid_rows` and columns below `valid_cols` are
// written (the rest are past seqlen_q or padding of the head dim); the
// tensor-core backwards serve head dims that are multiples of 8, so rows
// start 16-byte aligned and each four columns are wholly in or out. `staging`
// is this warp's kDqStagingFloatsPerWarp floats of shared memory.
template <int kCols>
__device__ __forceinline__ void add_dq_fragment(float* rows, index_t row_stride, const float (&dq)[1][kCols / 8][4],
                                                float scale, float* staging, int valid_rows, int valid_cols,
                                                int lane) {
    static_assert(kCols % 16 == 0, "whole n8 pairs");
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int col0 = 0; col0 < kCols; col0 += kDqStageCols) {
            __syncwarp();  // the previous piece has been read
#pragma unroll
            for (int tile = 0; tile < kDqStageCols / 8; ++tile) {
                const int j = col0 / 8 + tile;
                if (j < kCols / 8) {
                    *reinterpret_cast<float2*>(staging + (lane / 4) * kDqStageStride + 8 * tile + 2 * (lane % 4)) =
                        make_float2(dq[0][j][2 * half] * scale, dq[0][j][2 * half + 1] * scale);
                }
            }
            __syncwarp();
            // Back out: a row's line (32 columns) per 8 lanes, 4 rows per pass;
            // where the width is 16 mod 32, its last 16 columns by 4 lanes per
            // row, 8 rows in one pass.
            const int lanes_per_row = col0 + 32 <= kCols ? 8 : 4;
            const int rows_per_pass = 32 / lanes_per_row;
            const int staged_col = 4 * (lane % lanes_per_row);
            const int col = col0 + staged_col;
            // One pointer stepped from pass to pass: an offset per pass's row,
            // held by the compiler across the main loop, costs a register pair each.
            float* target = rows + (half * 8 + lane / lanes_per_row) * row_stride + col;
#pragma unroll
            for (int row0 = 0; row0 < kDqStageRows; row0 += 4) {
                if (row0 % rows_per_pass == 0) {
                    const int staged_row = row0 + lane / lanes_per_row;
                    if (half * 8 + staged_row < valid_rows && col < valid_cols) {
                        const float4 values =
                            *reinterpret_cast<const float4*>(staging + staged_row * kDqStageStride + staged_col);
                        // One vector reduction of four floats (sm_90).
                        asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(target),
                                     "f"(values.x), "f"(values.y), "f"(values.z), "f"(values.w)
                                     : "memory");
                    }
                    target += rows_per_pass * row_stride;
                }
            }
        }
    }
}

}  // namespace cuflash
