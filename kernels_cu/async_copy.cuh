// Asynchronous global -> shared copies (cp.async, sm_80 and later) of
// row-major tiles, 16 bytes per instruction, bypassing the register file so
// that the next tile's load overlaps the current tile's math.
//
// Each 16-byte chunk is 8 elements of one row. The fast path requires what
// makes every chunk an aligned 16-byte load: 16-byte aligned base pointers,
// row/head/batch strides and head_dim multiples of 8 elements (the launcher
// checks this and otherwise runs the SIMT kernels).
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Copies 16 bytes from `src` to shared `dst`, or writes 16 zero bytes when
// `valid` is false: with src-size 0 nothing is read, so `src` may point past
// the end of the tensor (rows past the sequence, padded columns).
__device__ __forceinline__ void cp_async_16_or_zero(u32 dst_address, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_address), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_16_or_zero(void* dst, const void* src, bool valid) {
    cp_async_16_or_zero(static_cast<u32>(__cvta_generic_to_shared(dst)), src, valid);
}

// Closes the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most kPending committed groups of this thread are in flight.
// Other threads' copies are visible only after a barrier that follows this.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Issues the copies of a kRows x kHeadDim tile into shared memory with a row
// stride of kStride elements. Rows at or past `valid_rows` and columns at or
// past `head_dim` become zeros, so padded keys and head-dim columns add
// nothing to any product (and never inject NaN from stale memory).
template <int kRows, int kHeadDim, int kStride, int kThreads, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, index_t row_stride,
                                                int valid_rows, int head_dim, int thread) {
    constexpr int kChunkElements = 16 / int(sizeof(Element));
    constexpr int kChunksPerRow = kHeadDim / kChunkElements;
    constexpr int kChunks = kRows * kChunksPerRow;
    static_assert(kHeadDim % kChunkElements == 0 && kStride % kChunkElements == 0,
                  "rows are whole 16-byte chunks");
    if constexpr (kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0) {
        // Each thread keeps one column and walks rows kRowStep apart: one
        // pointer and one stride live in registers, not one address per chunk.
        constexpr int kRowStep = kThreads / kChunksPerRow;
        const int row0 = thread / kChunksPerRow;
        const int col = thread % kChunksPerRow * kChunkElements;
        const bool col_valid = col < head_dim;
        const Element* src = gmem + static_cast<index_t>(row0) * row_stride + col;
        const index_t step = kRowStep * row_stride;
        Element* dst = smem + row0 * kStride + col;
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i) {
            cp_async_16_or_zero(dst + i * kRowStep * kStride, src, col_valid && row0 + i * kRowStep < valid_rows);
            src += step;
        }
    } else {
#pragma unroll
        for (int i = 0; i < ceil_div(kChunks, kThreads); ++i) {
            const int chunk = thread + i * kThreads;
            if (kChunks % kThreads == 0 || chunk < kChunks) {
                const int row = chunk / kChunksPerRow;
                const int col = chunk % kChunksPerRow * kChunkElements;
                cp_async_16_or_zero(smem + row * kStride + col, gmem + static_cast<index_t>(row) * row_stride + col,
                                    row < valid_rows && col < head_dim);
            }
        }
    }
}

// load_tile_async for rows that are not a fixed stride apart (a paged KV
// cache's keys): row_of(row) is row `row`'s first element, asked only for
// rows below valid_rows. Each thread first finds all of its rows and then
// issues their copies, so the lookups behind row_of (page numbers) are in
// flight together rather than one after another.
template <int kRows, int kHeadDim, int kStride, int kThreads, typename Element, typename RowOf>
__device__ __forceinline__ void load_rows_async(Element* smem, RowOf row_of, int valid_rows, int head_dim,
                                                int thread) {
    constexpr int kChunkElements = 16 / int(sizeof(Element));
    constexpr int kChunksPerRow = kHeadDim / kChunkElements;
    static_assert(kHeadDim % kChunkElements == 0 && kStride % kChunkElements == 0,
                  "rows are whole 16-byte chunks");
    if constexpr (kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0) {
        // Each thread keeps one column of rows kRowStep apart.
        constexpr int kRowStep = kThreads / kChunksPerRow;
        constexpr int kRowsPerThread = kRows / kRowStep;
        const int row0 = thread / kChunksPerRow;
        const int col = thread % kChunksPerRow * kChunkElements;
        const bool col_valid = col < head_dim;
        const Element* src[kRowsPerThread];
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int row = row0 + i * kRowStep;
            src[i] = row < valid_rows ? row_of(row) + col : nullptr;
        }
        Element* dst = smem + row0 * kStride + col;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            cp_async_16_or_zero(dst + i * kRowStep * kStride, src[i], col_valid && src[i] != nullptr);
        }
    } else {
        // Rows whose chunks do not divide among the threads (head dims such
        // as 96): the chunks in order, each finding its own row.
        constexpr int kChunks = kRows * kChunksPerRow;
        constexpr int kSteps = ceil_div(kChunks, kThreads);
        const Element* src[kSteps];
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
            const int chunk = thread + i * kThreads;
            const int row = chunk / kChunksPerRow;
            const bool valid = (kChunks % kThreads == 0 || chunk < kChunks) && row < valid_rows &&
                               chunk % kChunksPerRow * kChunkElements < head_dim;
            src[i] = valid ? row_of(row) + chunk % kChunksPerRow * kChunkElements : nullptr;
        }
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
            const int chunk = thread + i * kThreads;
            if (kChunks % kThreads == 0 || chunk < kChunks) {
                cp_async_16_or_zero(smem + chunk / kChunksPerRow * kStride + chunk % kChunksPerRow * kChunkElements,
                                    src[i], src[i] != nullptr);
            }
        }
    }
}

// The same copy into a swizzled layout (SwizzledTile in wgmma.cuh, or any
// Tile with its chunk_offset) at shared address `smem`. Consecutive threads
// take consecutive chunks of a row: global reads stay coalesced, and the
// 8 chunks of a 128-byte shared row land in 8 distinct 16-byte bank groups.
template <typename Tile, int kThreads, typename Element>
__device__ __forceinline__ void load_swizzled_tile_async(u32 smem, const Element* gmem, index_t row_stride,
                                                         int valid_rows, int head_dim, int thread) {
    constexpr int kChunkElements = 16 / int(sizeof(Element));
    constexpr int kChunksPerRow = Tile::kCols / kChunkElements;
    constexpr int kChunks = Tile::kRows * kChunksPerRow;
#pragma unroll
    for (int i = 0; i < ceil_div(kChunks, kThreads); ++i) {
        const int chunk = thread + i * kThreads;
        if (kChunks % kThreads == 0 || chunk < kChunks) {
            const int row = chunk / kChunksPerRow;
            const int col_chunk = chunk % kChunksPerRow;
            cp_async_16_or_zero(smem + Tile::chunk_offset(row, col_chunk),
                                gmem + static_cast<index_t>(row) * row_stride + col_chunk * kChunkElements,
                                row < valid_rows && col_chunk * kChunkElements < head_dim);
        }
    }
}

}  // namespace cuflash
