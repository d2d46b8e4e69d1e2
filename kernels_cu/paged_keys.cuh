// Key tiles of a paged KV cache (PagedBatch, block_info.cuh) with their
// page numbers read one tile ahead.
//
// A paged cache's key rows are found through the block table: row `key` of
// a sequence is row key % page_size of page pages[key / page_size]. Looked
// up when a tile's copies are issued, the table read (a dependent global
// load, then the division) stalls the issuing warp for a memory latency on
// every tile: measured on the H100 at decoding, paged caches streamed K/V
// at a third to a half of a contiguous cache's rate. PagedKeyRows reads the
// page numbers of the next tile's rows while the current tile is computed,
// into registers, so the copies issue as soon as a buffer frees up, as a
// contiguous cache's do. K and V share the rows, so one read serves both.
//
// Each thread copies one 16-byte column of rows kRowStep apart (as
// load_tile_async's fast path does); tilings whose chunks do not divide
// among the threads that way (kPrefetches false) look rows up as they copy
// (load_rows_async).
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "async_copy.cuh"
#include "block_info.cuh"

namespace cuflash {

template <int kRows, int kHeadDim, int kThreads, typename Element>
struct PagedKeyRows {
    static constexpr int kChunkElements = 16 / int(sizeof(Element));
    static constexpr int kChunksPerRow = kHeadDim / kChunkElements;
    static constexpr bool kPrefetches = kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0;
    static constexpr int kRowStep = kPrefetches ? kThreads / kChunksPerRow : 1;
    static constexpr int kRowsPerThread = kPrefetches ? kRows / kRowStep : 1;

    // This thread's rows of the fetched tile: the first one's key, and each
    // row's page number as the table holds it (clamped when used) and row
    // in its page.
    int key0;
    int page[kRowsPerThread];
    int row_in_page[kRowsPerThread];

    // Reads the page numbers of the tile of keys [n_start, n_start + kRows)
    // (rows: the sequence, its table and length); rows outside [0,
    // seqlen_k) read the table's first entry, which is not used.
    //
    // The loads are volatile asm so that they issue here, not where their
    // values are first used (the compiler would otherwise sink them to the
    // copies, a memory latency later in the same iteration); nothing here
    // uses the values, so the warp does not wait for them until load().
    __device__ __forceinline__ void fetch(const SequenceRows& rows, int n_start, int thread) {
        key0 = n_start + thread / kChunksPerRow;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int key = key0 + i * kRowStep;
            const int slot = key >= 0 && key < rows.seqlen_k ? key / rows.page_size : 0;
            row_in_page[i] = key - slot * rows.page_size;
            asm volatile("ld.global.nc.s32 %0, [%1];\n" : "=r"(page[i]) : "l"(rows.pages + slot));
        }
    }

    // Issues the copies of the fetched tile of tensor t (K or V), head
    // kv_head, into shared rows of kStride elements; rows past the
    // sequence's keys and head-dim padding columns become zeros.
    template <int kStride>
    __device__ __forceinline__ void load(Element* smem, const SequenceRows& rows, const TensorRef& t,
                                         index_t kv_head, int head_dim, int thread) const {
        const int col = thread % kChunksPerRow * kChunkElements;
        const bool col_valid = col < head_dim;
        Element* dst = smem + (thread / kChunksPerRow) * kStride + col;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const int key = key0 + i * kRowStep;
            const bool valid = col_valid && key >= 0 && key < rows.seqlen_k;
            // A page number outside the cache (the launcher cannot check
            // the table) is clamped: a wrong page, never memory outside it.
            const int clamped = min(max(page[i], 0), rows.num_pages - 1);
            const Element* src = t.row_ptr<const Element>(clamped, kv_head, row_in_page[i]) + col;
            cp_async_16_or_zero(dst + i * kRowStep * kStride, src, valid);
        }
    }
};

}  // namespace cuflash
