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
// it back a row's 128 bytes per 8 lanes (kStaged). Kernels whose registers
// are spent (the m128 tiles of head dims 32-64, which hold 128 queries of S^T
// and dP^T: the staging's addresses made them spill) add the fragment as it
// lies, two floats per lane.
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

// Adds scale * dq (a warp's m16 x kCols accumulator fragment) into rows
// row0.. and columns col0.. of the dQ block at `rows` (its row 0, column 0;
// consecutive rows `row_stride` floats apart). Only rows below `valid_rows`
// and columns below `valid_cols` are written (the rest are past seqlen_q or
// padding of the head dim); the tensor-core backwards serve head dims that
// are multiples of 8, so rows start 16-byte aligned and each four columns are
// wholly in or out. `staging` is this warp's kDqStagingFloatsPerWarp floats
// of shared memory (kStaged).
template <int kCols, bool kStaged>
__device__ __forceinline__ void add_dq_fragment(float* rows, index_t row_stride, int row0, int col0,
                                                const float (&dq)[1][kCols / 8][4], float scale, float* staging,
                                                int valid_rows, int valid_cols, int lane) {
    static_assert(kCols % 16 == 0, "whole n8 pairs");
    if constexpr (!kStaged) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + lane / 4 + half * 8;
            if (row < valid_rows) {
#pragma unroll
                for (int j = 0; j < kCols / 8; ++j) {
                    const int col = col0 + 8 * j + 2 * (lane % 4);
                    if (col < valid_cols) {
                        asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};\n"
                                     ::"l"(rows + row * row_stride + col), "f"(dq[0][j][2 * half] * scale),
                                     "f"(dq[0][j][2 * half + 1] * scale)
                                     : "memory");
                    }
                }
            }
        }
        return;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int piece0 = 0; piece0 < kCols; piece0 += kDqStageCols) {
            __syncwarp();  // the previous piece has been read
#pragma unroll
            for (int tile = 0; tile < kDqStageCols / 8; ++tile) {
                const int j = piece0 / 8 + tile;
                if (j < kCols / 8) {
                    *reinterpret_cast<float2*>(staging + (lane / 4) * kDqStageStride + 8 * tile + 2 * (lane % 4)) =
                        make_float2(dq[0][j][2 * half] * scale, dq[0][j][2 * half + 1] * scale);
                }
            }
            __syncwarp();
            // Back out: a row's line (32 columns) per 8 lanes, 4 rows per pass;
            // where the width is 16 mod 32, its last 16 columns by 4 lanes per
            // row, 8 rows in one pass.
            const int lanes_per_row = piece0 + 32 <= kCols ? 8 : 4;
            const int rows_per_pass = 32 / lanes_per_row;
            const int staged_col = 4 * (lane % lanes_per_row);
            const int col = col0 + piece0 + staged_col;
            // One pointer stepped from pass to pass: an offset per pass's row,
            // held by the compiler across the main loop, costs a register pair each.
            const int first_row = row0 + half * 8 + lane / lanes_per_row;
            float* target = rows + first_row * row_stride + col;
#pragma unroll
            for (int pass_row0 = 0; pass_row0 < kDqStageRows; pass_row0 += 4) {
                if (pass_row0 % rows_per_pass == 0) {
                    const int staged_row = pass_row0 + lane / lanes_per_row;
                    if (first_row + pass_row0 < valid_rows && col < valid_cols) {
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
