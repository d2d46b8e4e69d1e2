// Mapping of the flattened one-dimensional grid to (tile, head, batch).
#pragma once

#include "numeric.cuh"

namespace cuflash {

// The grid is flattened with the tile index fastest, so the blocks of one
// head run side by side and their shared reads (K/V in the forward, Q/dO in
// the backward) hit in L2. blockIdx.x allows 2^31 - 1 blocks, far more than
// gridDim.y/z would.
struct BlockCoordinates {
    int tile;
    index_t head;
    index_t batch;
};

// Reading the block index through a volatile asm makes every call compute
// the coordinates afresh: a kernel that needs them again only in its
// epilogue does not keep them in registers through its main loop.
__device__ __forceinline__ unsigned block_index() {
    unsigned index;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(index));
    return index;
}

// The coordinates of block `linear` of the flattened grid (a persistent
// block's tiles are such indices; see block_coordinates).
__device__ __forceinline__ BlockCoordinates block_coordinates_of(index_t linear, index_t num_tiles, index_t nheads) {
    BlockCoordinates c;
    c.tile = static_cast<int>(linear % num_tiles);
    linear /= num_tiles;
    c.head = linear % nheads;
    c.batch = linear / nheads;
    return c;
}

__device__ __forceinline__ BlockCoordinates block_coordinates(index_t num_tiles, index_t nheads) {
    return block_coordinates_of(block_index(), num_tiles, nheads);
}

// Tile `tile` counted from the last. Blocks are dispatched roughly in
// blockIdx order: causal attention gives the last query blocks the most
// keys, so the forward hands them out first (long tiles early, short ones
// for the tail of the grid); the deterministic causal backward hands out its
// last key blocks first, whose turns come first (dq_turn).
__device__ __forceinline__ int counted_from_end(int tile, index_t num_tiles) {
    return static_cast<int>(num_tiles) - 1 - tile;
}

}  // namespace cuflash
