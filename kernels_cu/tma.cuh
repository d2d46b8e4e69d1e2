// Tile copies by the Tensor Memory Accelerator (cp.async.bulk.tensor, sm_90).
//
// A tensor map (params.cuh's TensorMap, encoded on the host by
// cuTensorMapEncodeTiled: cuflash/_tensor_maps.py) describes a strided
// global tensor and the box one copy moves; one thread issues the copy, the
// engine writes the box into shared memory in the map's swizzle and counts
// its bytes down on an mbarrier (mbarrier.cuh). Elements outside the tensor
// (rows past the sequence, columns past head_dim) arrive as zeros, and their
// bytes count like the others.
//
// The other direction is a reduction or a store: the engine adds a box of
// shared memory into global memory (float32 add), or writes it there,
// skipping elements outside the tensor, and the issuing thread waits for
// its bulk groups (bulk_wait_read: the shared source may be rewritten;
// bulk_wait: the writes are done).
#pragma once

#include "numeric.cuh"
#include "params.cuh"

namespace cuflash {

// Copies the box at coordinates (c0, c1, c2, c3) (innermost dimension
// first) of `map`, a __grid_constant__ parameter, to shared address `dst`,
// completing on the mbarrier at `barrier`.
__device__ __forceinline__ void tma_load_4d(u32 dst, const TensorMap& map, u32 barrier, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
        : "memory");
}

// Loads a kRows x Tile::kCols tile whose first row is `row` into a swizzled
// tile (SwizzledTile, swizzled_tile.cuh) at `dst`: one box per column panel
// (the map's box is kPanelCols wide and kRows tall, in the tile's swizzle),
// the tile's column 0 being the head's column col0 (0, or minus a shift
// from sector_aligned_shift).
template <typename Tile>
__device__ __forceinline__ void tma_load_tile(u32 dst, const TensorMap& map, u32 barrier, int row, index_t head,
                                              index_t batch, int col0 = 0) {
#pragma unroll
    for (int panel = 0; panel < Tile::kCols / Tile::kPanelCols; ++panel) {
        tma_load_4d(dst + panel * Tile::kPanelBytes, map, barrier, col0 + panel * Tile::kPanelCols, row,
                    static_cast<int>(head), static_cast<int>(batch));
    }
}

// The columns a tile's copies of one head start before the head's first
// column, so that they move whole 32-byte sectors: 16 bytes' worth where
// every row of the head starts 16 bytes into a sector and the tile has
// that many columns to spare past head_dim, else 0. The copy engine reads
// global memory by sectors: a 64-byte box row that starts mid-sector spans
// three of them instead of two. Rows of head dims that end mid-sector (72:
// 144 bytes) put every other head of a (batch, seqlen, heads, head_dim)
// array there when the heads' rows are a whole number of sectors apart
// (an even head count); the shift took the Hopper forward at head dim 72,
// 28 heads, 4k keys from 1.68 to 1.35 ms (H200, docs/perf-notes.md). The columns
// before the head lie outside the map (negative coordinates): they arrive
// as zeros, so the products over them add nothing. A store cannot start
// there (a negative coordinate in cp.async.bulk.tensor's store is an
// illegal instruction on the H200): a tile computed in shifted columns is
// staged back in the head's before it is stored.
// `batch` is the map's batch coordinate (a tensor's, not a sequence's).
template <typename Element, int kCols>
__device__ __forceinline__ int sector_aligned_shift(const TensorRef& tensor, index_t batch, index_t head,
                                                    int head_dim) {
    constexpr u32 kElementBytes = sizeof(Element);
    constexpr int kShift = 16 / kElementBytes;
    // The start's place in its sector from the addresses' low 32 bits (a
    // multiple of 32 apart from the whole address).
    const u32 start = static_cast<u32>(reinterpret_cast<unsigned long long>(tensor.ptr)) +
                      static_cast<u32>(batch * tensor.batch_stride + head * tensor.head_stride) * kElementBytes;
    const bool rows_start_alike = static_cast<u32>(tensor.row_stride) * kElementBytes % 32 == 0;
    return rows_start_alike && start % 32 == 16 && head_dim + kShift <= kCols ? kShift : 0;
}

// Whether a tensor's head-pair maps (WgmmaForwardParams) serve a launch:
// encoded (`encoded`, the launcher's bit of kv_pair_maps) and the tensor
// starting on a sector, so that its even heads' rows start on one and its
// odd heads' 16 bytes in, as the maps' columns -8 and 0 assume (the shift
// sector_aligned_shift then gives each head agrees with its map).
__device__ __forceinline__ bool head_pair_maps_serve(int encoded, const TensorRef& tensor) {
    return encoded != 0 && static_cast<u32>(reinterpret_cast<unsigned long long>(tensor.ptr)) % 32 == 0;
}

// Adds the box at `src` (shared) into the box at coordinates (c0, c1, c2,
// c3) of `map`'s float32 tensor, in the bulk group of the issuing thread.
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap& map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
            reinterpret_cast<unsigned long long>(&map)),
        "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Writes the box at `src` (shared) over the box at coordinates (c0, c1, c2,
// c3) of `map`'s tensor, in the bulk group of the issuing thread.
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, u32 src, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
            reinterpret_cast<unsigned long long>(&map)),
        "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Calls copy_box(src_box, c0, c1, c2, c3) for each panel of a tile
// (SwizzledTile, SwizzledFloatTile) whose rows start at `src`, rows row.. of
// (head, batch): one box of Tile::kPanelCols columns per panel (as many
// rows as the map's box: the tile's, or a band of them, starting at `src`).
template <typename Tile, typename CopyBox>
__device__ __forceinline__ void for_each_panel_box(u32 src, int row, index_t head, index_t batch, CopyBox&& copy_box) {
#pragma unroll
    for (int panel = 0; panel < Tile::kCols / Tile::kPanelCols; ++panel) {
        copy_box(src + panel * Tile::kPanelBytes, panel * Tile::kPanelCols, row, static_cast<int>(head),
                 static_cast<int>(batch));
    }
}

// Adds a float32 tile into rows row.. of (head, batch).
template <typename Tile>
__device__ __forceinline__ void tma_reduce_add_tile(const TensorMap& map, u32 src, int row, index_t head,
                                                    index_t batch) {
    for_each_panel_box<Tile>(src, row, head, batch, [&](u32 box, int c0, int c1, int c2, int c3) {
        tma_reduce_add_4d(map, box, c0, c1, c2, c3);
    });
}

// Writes a tile (or the map's box of rows of it, from `src`) over rows row.. of (head, batch).
template <typename Tile>
__device__ __forceinline__ void tma_store_tile(const TensorMap& map, u32 src, int row, index_t head, index_t batch) {
    for_each_panel_box<Tile>(src, row, head, batch, [&](u32 box, int c0, int c1, int c2, int c3) {
        tma_store_4d(map, box, c0, c1, c2, c3);
    });
}

// Closes the bulk group of the copies this thread issued since the last one.
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until at most kPending of this thread's bulk groups still read
// their shared sources (the sources may then be rewritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until at most kPending of this thread's bulk groups are unfinished
// (their writes to global memory are done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Shared memory written through the generic proxy (cp.async, ordinary
// stores) and then read by wgmma, or read or overwritten by the copy engine,
// is accessed through the async proxy: each writing thread fences before the
// barrier that publishes the data.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Orders this thread's global-memory accesses through the copy engine (the
// async proxy) with its ordinary ones, both ways: an acquired turn before
// the reductions it allows, finished reductions before the release that
// hands the turn on.
__device__ __forceinline__ void fence_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

}  // namespace cuflash
