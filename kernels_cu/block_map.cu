// Builds a user mask's tile map (tile_map.cuh) on the GPU, in two launches:
// fill_tile_states evaluates the mask's rule over every score of every tile
// (one thread block per tile and section, O(seqlen_q x seqlen_k) rule
// evaluations, one int written per tile), list_tiles then ranks and lists
// each query tile's non-empty key tiles and each key tile's non-empty query
// tiles (one warp per row or column of tiles). Nothing of the scores' size
// is stored. cuflash/block_mask.py launches both.
#pragma once

#include "numeric.cuh"
#include "tile_map.cuh"

namespace cuflash {

// The sections (batch entry b, head h) of the map are
// b * batch_stride + h * head_stride ints from `map`; blockIdx.z counts them
// (b = z / map_heads, h = z % map_heads). A mask that reads neither the
// batch entry nor the head has one section, evaluated at b = h = 0.
struct TileMapShape {
    long long batch_stride, head_stride;
    int map_heads;
    int seqlen_q, seqlen_k, block_m, block_n;

    __device__ __forceinline__ int m_tiles() const { return ceil_div(seqlen_q, block_m); }
    __device__ __forceinline__ int n_tiles() const { return ceil_div(seqlen_k, block_n); }
    __device__ __forceinline__ int* section(int* map, int z) const {
        return map + (z / map_heads) * batch_stride + (z % map_heads) * head_stride;
    }
};

// One tile (blockIdx.y: query tile, blockIdx.x: key tile) of one section:
// empty when the rule hides every score inside both sequences, full when it
// shows every one, partial otherwise. Each thread stops once it has seen
// both kinds. Rule: UserMask's (masks.cuh).
template <typename Rule>
__global__ void fill_tile_states(int* map, const void* array0, const void* array1, const void* array2,
                                 const void* array3, TileMapShape shape) {
    const void* const arrays[4] = {array0, array1, array2, array3};
    const int m_tile = blockIdx.y, n_tile = blockIdx.x, z = blockIdx.z;
    const int batch = z / shape.map_heads, head = z % shape.map_heads;
    const int first_row = m_tile * shape.block_m, first_key = n_tile * shape.block_n;
    const int rows = min(shape.block_m, shape.seqlen_q - first_row);
    const int keys = min(shape.block_n, shape.seqlen_k - first_key);
    bool seen_visible = false, seen_hidden = false;
    for (int e = threadIdx.x; e < rows * keys && !(seen_visible && seen_hidden); e += blockDim.x) {
        const bool visible = Rule::visible(arrays, batch, head, first_row + e / keys, first_key + e % keys);
        seen_visible |= visible;
        seen_hidden |= !visible;
    }
    const bool any_visible = __syncthreads_or(seen_visible);
    const bool any_hidden = __syncthreads_or(seen_hidden);
    if (threadIdx.x == 0) {
        shape.section(map, z)[m_tile * shape.n_tiles() + n_tile] =
            any_visible ? (any_hidden ? kPartialTile : kFullTile) : kEmptyTile;
    }
}

// One warp per row of tiles (blockIdx.x < M: a query tile's key tiles) or
// column (a key tile's query tiles) of one section (blockIdx.z): the
// non-empty ones in ascending order, their count, and for rows each tile's
// rank (-1: empty), compacted 32 at a time by a ballot.
__global__ void list_tiles(int* map, TileMapShape shape) {
    int* const section = shape.section(map, blockIdx.z);
    const int m_tiles = shape.m_tiles(), n_tiles = shape.n_tiles();
    const int lane = threadIdx.x;
    const bool is_row = static_cast<int>(blockIdx.x) < m_tiles;
    const int line = is_row ? blockIdx.x : blockIdx.x - m_tiles;  // the query tile, or the key tile
    const int length = is_row ? n_tiles : m_tiles;
    const long long tiles = static_cast<long long>(m_tiles) * n_tiles;
    int* const list = section + (is_row ? 2 * tiles + static_cast<long long>(line) * n_tiles
                                        : 3 * tiles + static_cast<long long>(line) * m_tiles);
    int count = 0;
    for (int first = 0; first < length; first += 32) {
        const int i = first + lane;
        const long long at = is_row ? static_cast<long long>(line) * n_tiles + i
                                    : static_cast<long long>(i) * n_tiles + line;
        const bool non_empty = i < length && section[at] != kEmptyTile;
        const unsigned ballot = __ballot_sync(0xffffffffu, non_empty);
        const int rank = count + __popc(ballot & ((1u << lane) - 1u));
        if (non_empty) {
            list[rank] = i;
        }
        if (is_row && i < length) {
            section[tiles + at] = non_empty ? rank : -1;
        }
        count += __popc(ballot);
    }
    // The lists' unused tail is zeroed: the map's contents depend on the
    // mask alone, never on what the buffer held.
    for (int i = count + lane; i < length; i += 32) {
        list[i] = 0;
    }
    if (lane == 0) {
        section[4 * tiles + (is_row ? line : m_tiles + line)] = count;
    }
}

}  // namespace cuflash
