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

    // This thread's rows of the fetched tile: page number and row in the
    // page, page -1 past the sequence's keys (copied as zeros).
    int page[kRowsPerThread];
    int row_in_page[kRowsPerThread];

    // Reads the page numbers of the tile of keys [n_start, n_start + kRows)
    // (rows: the sequence, its table and length); rows outside [0,
    // seqlen_k) read nothing.
    __device__ __forceinline__ void fetch(const SequenceRows& rows, int n_start, int thread) {
        const int row0 = thread / kChunksPerRow;
        // Page sizes that are powers of two (most) divide by a shift.
        const bool power_of_two = (rows.page_size & (rows.page_size - 1)) == 0;
        const int shift = __ffs(rows.page_size) - 1;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            // Keys before 0: the fetch after a split's first tile, never copied.
            const int key = n_start + row0 + i * kRowStep;
            const int slot = power_of_two ? max(key, 0) >> shift : max(key, 0) / rows.page_size;
            page[i] = key >= 0 && key < rows.seqlen_k ? min(max(__ldg(rows.pages + slot), 0), rows.num_pages - 1)
                                                      : -1;
            row_in_page[i] = key - slot * rows.page_size;
        }
    }

    // Issues the copies of the fetched tile of tensor t (K or V), head
    // kv_head, into shared rows of kStride elements; head-dim padding
    // columns (past head_dim) become zeros.
    template <int kStride>
    __device__ __forceinline__ void load(Element* smem, const TensorRef& t, index_t kv_head, int head_dim,
                                         int thread) const {
        const int row0 = thread / kChunksPerRow;
        const int col = thread % kChunksPerRow * kChunkElements;
        const bool col_valid = col < head_dim;
        Element* dst = smem + row0 * kStride + col;
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
            const bool valid = col_valid && page[i] >= 0;
            const Element* src = t.row_ptr<const Element>(valid ? page[i] : 0, kv_head, row_in_page[i]) + col;
            cp_async_16_or_zero(dst + i * kRowStep * kStride, src, valid);
        }
    }
};

}  // namespace cuflash
