// Which keys a query row may attend to, and which key blocks can be skipped.
//
// Causal attention is aligned to the bottom-right corner of the score matrix,
// as in FlashAttention-2: query row i sees key j iff j <= i + (seqlen_k - seqlen_q).
// With seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see no key at all;
// their output is 0 and their log-sum-exp -inf (see OnlineSoftmax).
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Offset of the causal diagonal: row i sees keys up to i + causal_diagonal_offset.
__device__ __forceinline__ int causal_diagonal_offset(int seqlen_q, int seqlen_k) {
    return seqlen_k - seqlen_q;
}

template <bool kIsCausal>
__device__ __forceinline__ bool is_key_visible(int row, int key, int seqlen_k, int diagonal_offset) {
    return key < seqlen_k && (!kIsCausal || key <= row + diagonal_offset);
}

// Number of key blocks, from the first, that hold at least one key visible to
// some row of the query block [m_start, m_start + block_m). Blocks past it are
// fully masked for every row of the block: they are skipped, not computed.
template <bool kIsCausal>
__device__ __forceinline__ int visible_key_blocks(int m_start, int block_m, int block_n,
                                                  int seqlen_q, int seqlen_k) {
    if (!kIsCausal) {
        return ceil_div(seqlen_k, block_n);
    }
    const int last_row = min(m_start + block_m, seqlen_q) - 1;
    const int last_visible_key = last_row + causal_diagonal_offset(seqlen_q, seqlen_k);
    if (last_visible_key < 0) {
        return 0;
    }
    return ceil_div(min(last_visible_key + 1, seqlen_k), block_n);
}

}  // namespace cuflash

namespace cuflash {

// First query block, counted from 0, with a row that sees some key of the key
// block starting at n_start; earlier query blocks see none of those keys
// (the backward's dK/dV walk skips them). Row i sees key n_start iff
// i >= n_start - (seqlen_k - seqlen_q), and a row that sees n_start sees
// every later key of the block up to its diagonal.
template <bool kIsCausal>
__device__ __forceinline__ int first_visible_query_block(int n_start, int block_m, int seqlen_q, int seqlen_k) {
    if (!kIsCausal) {
        return 0;
    }
    const int first_row = max(0, n_start - causal_diagonal_offset(seqlen_q, seqlen_k));
    return first_row / block_m;
}

}  // namespace cuflash

namespace cuflash {

// Whether any score of the key block starting at n_start is masked for some
// row of a group of consecutive query rows (a block's, or a warp's): the
// block runs past the last key, or (causal) its last key lies beyond the
// diagonal of the group's first row, which sees keys up to
// first_row_diagonal = first row + causal_diagonal_offset. Only such key
// blocks pay for apply_mask_to_fragments.
template <bool kIsCausal>
__device__ __forceinline__ bool key_block_needs_mask(int first_row_diagonal, int n_start, int block_n, int seqlen_k) {
    return n_start + block_n > seqlen_k || (kIsCausal && n_start + block_n - 1 > first_row_diagonal);
}

// Sets the masked scores of mma accumulator fragments s[kMTiles][kNTiles][4]
// (layout in mma.cuh) to -inf. row0_diagonal is the last key visible to the
// warp's first fragment row (its row index + causal_diagonal_offset; rows
// further down see correspondingly more), key0 the first key of the block.
// Passing the sum rather than row and offset saves a register in a loop
// where the accumulators need all of them.
template <bool kIsCausal, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask_to_fragments(float (&s)[kMTiles][kNTiles][4], int row0_diagonal, int key0,
                                                        int lane, int seqlen_k) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int last_visible = row0_diagonal + mt * 16 + lane / 4 + (i / 2) * 8;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                const int key = key0 + nt * 8 + 2 * (lane % 4) + i % 2;
                if (key >= seqlen_k || (kIsCausal && key > last_visible)) {
                    s[mt][nt][i] = negative_infinity();
                }
            }
        }
    }
}

// The same for transposed scores S^T (rows are keys, columns query rows), as
// the backward's key-major accumulators hold them: key0 is the first key of
// the warp's 16 fragment rows, row0 the first query row of the tile. A query
// row sees a key iff the key exists, the row exists and (causal) the key is at
// most row + diagonal_offset.
template <bool kIsCausal, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask_to_transposed_fragments(float (&s)[kMTiles][kNTiles][4], int key0, int row0,
                                                                   int lane, int seqlen_q, int seqlen_k,
                                                                   int diagonal_offset) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = key0 + mt * 16 + lane / 4 + (i / 2) * 8;
            // Rows below first_row see this key (causal); none do if the key is past the end.
            const int first_row = key >= seqlen_k ? seqlen_q : (kIsCausal ? key - diagonal_offset : 0);
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                const int row = row0 + nt * 8 + 2 * (lane % 4) + i % 2;
                if (row >= seqlen_q || row < first_row) {
                    s[mt][nt][i] = negative_infinity();
                }
            }
        }
    }
}

}  // namespace cuflash
