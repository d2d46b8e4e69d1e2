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

// The query tiles a persistent block walks: block g of a grid of `grid`
// takes steps w = g, g + grid, g + 2 grid, ... below end(), each naming a
// tile of the flattened grid's order (heads one after another, each head's
// tiles_per_head tiles in a row; longest first where later rows see more
// keys), or none (-1). Where every tile does the same work the step is the
// tile. Where a causal mask makes them uneven (kPaired) a block's steps come
// in pairs: unit u = k grid + g (units head by head, ceil(n / 2) a head,
// n = tiles_per_head) is its steps 2k and 2k + 1, the head's tiles at
// positions p and m - 1 - p of its order (m: n rounded up to even, the
// position n of an odd n empty), whose key walks add up to about the same
// for every p (position q sees about n - q key blocks): a static share of
// units is as even as the hardware's dynamic share of tiles, where a share
// of tiles gridDim.x apart could hand one block the longest walk every time
// (8 tiles a head on 264 slots: always the same position).
template <bool kPaired>
struct PersistentTileWalk {
    int num_tiles, tiles_per_head, grid;

    __device__ __forceinline__ int units() const {
        return num_tiles / tiles_per_head * ((tiles_per_head + 1) / 2);
    }
    __device__ __forceinline__ int end() const {
        return kPaired ? 2 * ((units() + grid - 1) / grid) * grid : num_tiles;
    }
    __device__ __forceinline__ int tile(int step) const {
        if constexpr (!kPaired) {
            return step;
        } else {
            const int round = step / grid;
            const int unit = round / 2 * grid + (step - round * grid);
            if (unit >= units()) {
                return -1;
            }
            const int even = tiles_per_head + tiles_per_head % 2;
            const int head = unit / (even / 2), p = unit - head * (even / 2);
            const int position = round % 2 == 0 ? p : even - 1 - p;
            return position < tiles_per_head ? head * tiles_per_head + position : -1;
        }
    }
};

// Tile `tile` counted from the last. Blocks are dispatched roughly in
// blockIdx order: causal attention gives the last query blocks the most
// keys, so the forward hands them out first (long tiles early, short ones
// for the tail of the grid); the deterministic causal backward hands out its
// last key blocks first, whose turns come first (dq_turn).
__device__ __forceinline__ int counted_from_end(int tile, index_t num_tiles) {
    return static_cast<int>(num_tiles) - 1 - tile;
}

}  // namespace cuflash
