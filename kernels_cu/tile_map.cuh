// A user mask's tile map (FlexAttention's block mask): what every tile of
// the score matrix holds at one granularity (a kernel's block_m query rows
// by block_n keys), so the kernels skip the empty tiles and apply the
// element rule only to the partial ones.
//
// One int32 buffer (cuflash/block_mask.py builds it, block_map.cu fills it
// on the GPU) holds a section per (batch entry, head) of the mask, or one
// section shared along a dimension the mask does not read (stride 0). With
// M = ceil(seqlen_q / block_m) query tiles and N = ceil(seqlen_k / block_n)
// key tiles, a section is, in order:
//   states     [M][N]  kEmptyTile, kPartialTile or kFullTile
//   key_ranks  [M][N]  a non-empty tile's place among its query tile's
//                      non-empty key tiles, counted from the first (-1: empty)
//   key_lists  [M][N]  each query tile's non-empty key tiles, ascending
//                      (its first key_counts[m] entries)
//   query_lists [N][M] each key tile's non-empty query tiles, ascending
//   key_counts  [M]
//   query_counts [N]
// so its size is 4 M N + M + N (tile_section_size; the Python side mirrors it).
#pragma once

#include "numeric.cuh"

namespace cuflash {

enum TileState : int { kEmptyTile = 0, kPartialTile = 1, kFullTile = 2 };

__host__ __device__ __forceinline__ long long tile_section_size(int m_tiles, int n_tiles) {
    return 4LL * m_tiles * n_tiles + m_tiles + n_tiles;
}

// One (batch entry, head)'s section, read through its parts.
struct TileSection {
    const int* base;
    int m_tiles, n_tiles;

    __device__ __forceinline__ int state(int m_tile, int n_tile) const { return base[m_tile * n_tiles + n_tile]; }
    __device__ __forceinline__ int key_rank(int m_tile, int n_tile) const {
        return base[m_tiles * n_tiles + m_tile * n_tiles + n_tile];
    }
    __device__ __forceinline__ int key_tile(int m_tile, int i) const {
        return base[2 * m_tiles * n_tiles + m_tile * n_tiles + i];
    }
    __device__ __forceinline__ int query_tile(int n_tile, int i) const {
        return base[3 * m_tiles * n_tiles + n_tile * m_tiles + i];
    }
    __device__ __forceinline__ int key_count(int m_tile) const { return base[4 * m_tiles * n_tiles + m_tile]; }
    __device__ __forceinline__ int query_count(int n_tile) const {
        return base[4 * m_tiles * n_tiles + m_tiles + n_tile];
    }
};

// The map of one batch entry: its sections by head (head_stride 0 where the
// mask does not read the head).
struct TileMap {
    const int* batch_base;
    index_t head_stride;
    int m_tiles, n_tiles;

    __device__ __forceinline__ TileSection of_head(index_t head) const {
        return {batch_base + head * head_stride, m_tiles, n_tiles};
    }
};

}  // namespace cuflash
