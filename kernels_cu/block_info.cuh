// A thread block's place in the batch: its batch entry, query head and K/V
// head, where its query or key tile starts, the lengths of its sequences
// and where their K/V rows are.
//
// Dense batches now: every entry holds seqlen_q queries and seqlen_k keys
// from row 0, and K/V rows are addressed through their tensors' strides
// (DenseKvSource). Variable-length batches will give per-entry lengths and
// row offsets in sequence_bounds and the row pointers, and a paged KV cache
// a K/V source that reads a page table: kernels ask only these.
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "grid.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"

namespace cuflash {

// Lengths of batch entry `batch`'s query and key sequences.
__device__ __forceinline__ SequenceBounds sequence_bounds(const ProblemSize& size, index_t) {
    return {size.seqlen_q_int(), size.seqlen_k_int()};
}

// K or V rows of a dense (batch, seqlen_k, nheads_k, head_dim) tensor.
struct DenseKvSource {
    // Row `key` of K/V head kv_head in batch entry `batch`; the rows after it
    // follow at t.row_stride.
    template <typename Element>
    __device__ __forceinline__ static const Element* rows(const TensorRef& t, index_t batch, index_t kv_head, int key) {
        return t.row_ptr<const Element>(batch, kv_head, key);
    }
};

// The block of a query-major kernel (the forwards, the deterministic dQ
// pass): query rows [m_start, m_start + block_m) of one head, and with
// split-KV which of the num_splits key ranges (split_key_blocks).
struct QueryBlock {
    index_t batch, head, kv_head;
    int m_start;
    int split;
};

// This block's query tile; with kLongestFirst (a mask whose later rows see
// more keys) the last tiles are handed out first. The splits of one query
// tile are neighbours in the grid (they read the same Q rows). Like
// block_coordinates it is recomputed wherever it is called, so a kernel can
// call it again in its epilogue instead of keeping batch, head and first row
// in registers.
template <bool kLongestFirst>
__device__ __forceinline__ QueryBlock query_block(const ProblemSize& size, index_t num_m_blocks, int block_m,
                                                  index_t num_splits = 1) {
    const BlockCoordinates c = block_coordinates(num_m_blocks * num_splits, size.nheads);
    const int tile = static_cast<int>(c.tile / num_splits);
    QueryBlock block;
    block.batch = c.batch;
    block.head = c.head;
    block.kv_head = size.kv_head_of(c.head);
    block.m_start = (kLongestFirst ? counted_from_end(tile, num_m_blocks) : tile) * block_m;
    block.split = static_cast<int>(c.tile % num_splits);
    return block;
}

// Split-KV: a sequence's key blocks cut into num_splits ranges of equal
// count (the last may be shorter or empty), the same for every query block,
// so the ranges partition every row's keys; split `split` runs the part of
// its range that the mask lets the block's rows see (`visible`). The
// launcher's count (cuflash.api) leaves no range empty at seqlen_k, but a
// causal block may see none of a range: it then writes output 0 and
// log-sum-exp -inf, which the merge weighs 0.
__device__ __forceinline__ BlockRange split_key_blocks(BlockRange visible, int seqlen_k, int block_n, int split,
                                                       int num_splits) {
    const int per_split = ceil_div(ceil_div(seqlen_k, block_n), num_splits);
    return {max(visible.begin, split * per_split), min(visible.end, (split + 1) * per_split)};
}

// The block of a key-major kernel (the backward's dK/dV): keys
// [n_start, n_start + block_n) of one K/V head, summed over the query heads
// [first_head, first_head + group) that share it; n_block = n_start / block_n.
struct KeyBlock {
    index_t batch, kv_head, first_head, group;
    int n_block, n_start;
};

// This block's key tile; with kLastFirst the last tiles are handed out
// first (the ordered dQ of a causal mask, where key block j waits for
// j + 1: see dq_turn in backward_steps.cuh).
template <bool kLastFirst = false>
__device__ __forceinline__ KeyBlock key_block(const ProblemSize& size, index_t num_n_blocks, int block_n) {
    const BlockCoordinates c = block_coordinates(num_n_blocks, size.nheads_k);
    KeyBlock block;
    block.batch = c.batch;
    block.kv_head = c.head;
    block.group = size.nheads / size.nheads_k;
    block.first_head = c.head * block.group;
    block.n_block = kLastFirst ? counted_from_end(c.tile, num_n_blocks) : c.tile;
    block.n_start = block.n_block * block_n;
    return block;
}

// What every attention kernel derives first from its parameters and its
// batch entry: the mask and score transform of the block's sequences, their
// lengths, the head dim and the softmax scale in the log2 domain.
template <typename Mask, typename Score>
struct BlockContext {
    Mask mask;
    Score score;
    int seqlen_q, seqlen_k, head_dim;
    float scale_log2;  // softmax_scale * log2(e)

    template <typename Params>
    __device__ __forceinline__ BlockContext(const Params& params, index_t batch)
        : mask(sequence_bounds(params.size, batch)),
          score(params),
          seqlen_q(mask.seqlen_q),
          seqlen_k(mask.seqlen_k),
          head_dim(params.size.head_dim_int()),
          scale_log2(static_cast<float>(params.softmax_scale_log2)) {}
};

}  // namespace cuflash
