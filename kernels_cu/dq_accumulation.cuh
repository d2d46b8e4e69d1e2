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
//
// At head dim 256 the additions alone need about as long as the products
// even as whole lines (8.6 GB at 3.2 TB/s against 2.9 ms without them), so
// the atomic mode halves them: two thread blocks of a cluster, on adjacent
// key blocks, walk the same query blocks, and each warp sends half of its dQ
// columns to its twin in the other block (distributed shared memory) and adds
// the sum of both blocks' other halves (send_dq_half, add_paired_dq_half).
#pragma once

#include "numeric.cuh"
#include "cluster.cuh"

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

// A warp's exchange area (paired dQ): its m16 rows of one half of its dQ
// columns, kCols floats per row, rows padded by 8 floats as the staging rows
// are: a half-warp's float2 fragment stores (4 rows x 8 floats) and a
// quarter-warp's float4 reads (32 floats of one row) fall on 32 distinct
// banks, and every address is the lane's base plus a constant (a swizzle
// that depends on the row made the compiler keep an offset per column tile).
constexpr int kDqExchangeRows = 16;

template <int kCols>
constexpr int kDqExchangeStride = kCols + 8;

template <int kCols>
__device__ __forceinline__ int dq_exchange_offset(int row, int col) {
    return row * kDqExchangeStride<kCols> + col;
}

// Stores a warp's m16 x kCols dQ fragment, unscaled, into its twin's exchange
// area in the other block of the cluster (`peer_area`: that area's cluster
// shared address). Published by the cluster barrier the caller arrives at.
template <int kCols>
__device__ __forceinline__ void send_dq_half(u32 peer_area, const float (&dq)[1][kCols / 8][4], int lane) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = lane / 4 + half * 8;
#pragma unroll
        for (int j = 0; j < kCols / 8; ++j) {
            const int col = 8 * j + 2 * (lane % 4);
            store_cluster_float2(peer_area + 4 * dq_exchange_offset<kCols>(row, col), dq[0][j][2 * half],
                                 dq[0][j][2 * half + 1]);
        }
    }
}

// Adds scale * (dq + the twin's half in `area`) into rows row0.. and columns
// col0.. of the dQ block at `rows` (as add_dq_fragment): the sum goes back
// into the area in place, then leaves as red.v4.f32 of whole lines, kCols / 4
// lanes per row.
template <int kCols>
__device__ __forceinline__ void add_paired_dq_half(float* rows, index_t row_stride, int row0, int col0,
                                                   const float (&dq)[1][kCols / 8][4], float scale, float* area,
                                                   int valid_rows, int valid_cols, int lane) {
    static_assert(kCols % 32 == 0 && kCols <= 128, "rows of whole lines, read by at most 32 lanes");
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = lane / 4 + half * 8;
#pragma unroll
        for (int j = 0; j < kCols / 8; ++j) {
            float2* const slot = reinterpret_cast<float2*>(area + dq_exchange_offset<kCols>(row, 8 * j + 2 * (lane % 4)));
            const float2 twin = *slot;
            *slot = make_float2((dq[0][j][2 * half] + twin.x) * scale, (dq[0][j][2 * half + 1] + twin.y) * scale);
        }
    }
    __syncwarp();
    constexpr int kLanesPerRow = kCols / 4;
    constexpr int kRowsPerPass = 32 / kLanesPerRow;
    const int first_row = lane / kLanesPerRow;
    const int col = 4 * (lane % kLanesPerRow);
    float* target = rows + (row0 + first_row) * row_stride + col0 + col;
#pragma unroll
    for (int pass = 0; pass < kDqExchangeRows / kRowsPerPass; ++pass) {
        const int row = pass * kRowsPerPass + first_row;
        if (row0 + row < valid_rows && col0 + col < valid_cols) {
            const float4 values = *reinterpret_cast<const float4*>(area + dq_exchange_offset<kCols>(row, col));
            asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(target), "f"(values.x),
                         "f"(values.y), "f"(values.z), "f"(values.w)
                         : "memory");
        }
        target += kRowsPerPass * row_stride;
    }
}

}  // namespace cuflash
