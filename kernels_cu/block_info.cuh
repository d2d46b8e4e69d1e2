// A thread block's place in the batch: its batch entry, query head and K/V
// head, where its query or key tile starts, the lengths of its sequences
// and where their rows are (FlashAttention-2's BlockInfo).
//
// Dense batches: every entry holds seqlen_q queries and seqlen_k keys from
// row 0 of its own batch entry of the tensors. Variable-length batches:
// entry b's rows lie at cu_seqlens in one packed batch entry
// (ProblemSize). Kernels take the layout as a policy (DenseBatch,
// PackedBatch, and for a KV cache CacheBatch and PagedBatch) and ask only
// its rows and the row addressing of SequenceRows and the policy.
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "grid.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"

namespace cuflash {

// Where one batch entry's sequences lie: their lengths (the SequenceBounds
// every mask is built from), the batch entry of the tensors that holds them
// and the tensor rows of their first query and first key.
struct SequenceRows : SequenceBounds {
    index_t tensor_batch;
    index_t q_row0, k_row0;
    // A paged KV cache's: this entry's row of the block table, the rows per
    // page and the pages the k-side tensors hold (unset in other layouts).
    const int* pages;
    int page_size, num_pages;

    // Row `row` (of the sequence) of head `head` of a q-side tensor (q, out,
    // dout, dq) or a k-side one (k, v, dk, dv).
    template <typename Element>
    __device__ __forceinline__ Element* query_row(const TensorRef& t, index_t head, index_t row) const {
        return t.row_ptr<Element>(tensor_batch, head, q_row0 + row);
    }
    template <typename Element>
    __device__ __forceinline__ Element* key_row(const TensorRef& t, index_t kv_head, index_t key) const {
        return t.row_ptr<Element>(tensor_batch, kv_head, k_row0 + key);
    }
    // Key `key` of a paged cache: row key % page_size of page
    // pages[key / page_size]. The page numbers live on the GPU, where the
    // launcher cannot check them without a copy: clamped to the cache, a bad
    // one reads a wrong page, never memory outside the cache.
    template <typename Element>
    __device__ __forceinline__ Element* paged_key_row(const TensorRef& t, index_t kv_head, int key) const {
        const int slot = key / page_size;
        const int page = min(max(__ldg(pages + slot), 0), num_pages - 1);
        return t.row_ptr<Element>(page, kv_head, key - slot * page_size);
    }
};

// A KV cache's key count of entry `batch`: seqused_k[batch] (the cached
// keys and those the call appended) clamped to the capacity seqlen_k, or
// seqlen_k where every entry has that many (seqused_k null).
__device__ __forceinline__ int cache_keys(const ProblemSize& size, index_t batch) {
    const int capacity = size.seqlen_k_int();
    return size.seqused_k == nullptr ? capacity : min(max(size.seqused_k[batch], 0), capacity);
}

// Batch layouts, the kernels' sequence policy beside Mask and Score:
// rows(size, batch) says where batch entry `batch`'s sequences lie.
// A dense batch: every entry holds seqlen_q queries and seqlen_k keys from
// row 0 of its own entry of the tensors.
// Every layout says whether its sequences share a packed entry (kPacked:
// grid blocks past a shorter sequence's end have no rows) and whether its
// keys are rows of pages (kPaged: key tiles are gathered row by row,
// key_row below); key_row is a key's row in any layout.
struct DenseBatch {
    static constexpr bool kPacked = false;
    static constexpr bool kPaged = false;

    __device__ __forceinline__ static SequenceRows rows(const ProblemSize& size, index_t batch) {
        SequenceRows rows;
        rows.seqlen_q = size.seqlen_q_int();
        rows.seqlen_k = size.seqlen_k_int();
        rows.tensor_batch = batch;
        rows.q_row0 = 0;
        rows.k_row0 = 0;
        return rows;
    }
};

// A packed (variable-length) batch: entry b's rows lie at cu_seqlens in
// the tensors' one entry. The offsets are clamped to the tensors: they live
// on the GPU, where the launcher cannot check them without a copy, and a
// bad one must give wrong rows, never an access outside the tensors.
struct PackedBatch {
    static constexpr bool kPacked = true;
    static constexpr bool kPaged = false;

    __device__ __forceinline__ static SequenceRows rows(const ProblemSize& size, index_t batch) {
        const int total_q = static_cast<int>(size.total_q), total_k = static_cast<int>(size.total_k);
        const int q_begin = min(max(size.cu_seqlens_q[batch], 0), total_q);
        const int k_begin = min(max(size.cu_seqlens_k[batch], 0), total_k);
        SequenceRows rows;
        rows.seqlen_q = min(max(size.cu_seqlens_q[batch + 1], q_begin), total_q) - q_begin;
        rows.seqlen_k = min(max(size.cu_seqlens_k[batch + 1], k_begin), total_k) - k_begin;
        rows.tensor_batch = 0;
        rows.q_row0 = q_begin;
        rows.k_row0 = k_begin;
        return rows;
    }
};

// A contiguous KV cache (batch, capacity, nheads_k, head_dim): a dense
// batch whose entries hold their own number of keys (cache_keys).
struct CacheBatch {
    static constexpr bool kPacked = false;
    static constexpr bool kPaged = false;

    __device__ __forceinline__ static SequenceRows rows(const ProblemSize& size, index_t batch) {
        SequenceRows rows = DenseBatch::rows(size, batch);
        rows.seqlen_k = cache_keys(size, batch);
        return rows;
    }
};

// A paged KV cache (num_pages, page_size, nheads_k, head_dim): entry b's
// keys are the rows of the pages block_table row b lists, in order; its
// queries as in a dense batch.
struct PagedBatch {
    static constexpr bool kPacked = false;
    static constexpr bool kPaged = true;

    __device__ __forceinline__ static SequenceRows rows(const ProblemSize& size, index_t batch) {
        SequenceRows rows = CacheBatch::rows(size, batch);  // tensor_batch: the q side's entry
        rows.pages = size.block_table + batch * size.block_table_stride;
        rows.page_size = static_cast<int>(size.page_size);
        rows.num_pages = static_cast<int>(size.total_k / size.page_size);
        return rows;
    }
};

// Key `key` of (rows' sequence, kv_head) of a k-side tensor in `Batch`'s layout.
template <typename Batch, typename Element>
__device__ __forceinline__ Element* key_row(const SequenceRows& rows, const TensorRef& t, index_t kv_head, int key) {
    if constexpr (Batch::kPaged) {
        return rows.paged_key_row<Element>(t, kv_head, key);
    } else {
        return rows.key_row<Element>(t, kv_head, key);
    }
}

// The block of a query-major kernel (the forwards, the deterministic dQ
// pass): query rows [m_start, m_start + block_m) of one head, and with
// split-KV which of the num_splits key ranges (split_key_blocks).
struct QueryBlock : SequenceRows {
    index_t batch, head, kv_head;
    int m_start;
    int split;
};

// A query tile's place in the grid: what query_block knows before it reads
// the GPU's memory (the sequence's rows), from the parameters and the block
// index alone. With kLongestFirst (a mask whose later rows see more keys)
// the last tiles are handed out first. The splits of one query tile are
// neighbours in the grid (they read the same Q rows).
struct QueryCoordinates {
    index_t batch, head, kv_head;
    int m_start;
    int split;

    // Makes the compiler compute these here, not after the asm that follows
    // (a dependent launch computes them before it waits for the kernel ahead).
    __device__ __forceinline__ void materialise() const {
        asm volatile("" ::"l"(batch), "l"(head), "l"(kv_head), "r"(m_start), "r"(split));
    }
};

// A query tile's coordinates in 16 bytes of shared memory at `slot` (16-byte
// aligned), 32-bit each (a grid has fewer than 2^31 tiles): a
// warp-specialised kernel's producer decodes each tile once and hands it to
// its consumers with the tile's Q (flash_fwd_wgmma.cu), which then divide
// nothing (a tile's decoding is a chain of integer divisions, about 6% of
// the Hopper forward's time at 512 keys, causal). m_start < 0 marks the end
// of a walk.
__device__ __forceinline__ void store_query_coordinates(u32 slot, const QueryCoordinates& c) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(c.m_start),
                 "r"(static_cast<int>(c.head)), "r"(static_cast<int>(c.kv_head)), "r"(static_cast<int>(c.batch))
                 : "memory");
}

__device__ __forceinline__ QueryCoordinates load_query_coordinates(u32 slot) {
    int head, kv_head, batch;
    QueryCoordinates c;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(c.m_start), "=r"(head), "=r"(kv_head), "=r"(batch)
                 : "r"(slot)
                 : "memory");
    c.head = head;
    c.kv_head = kv_head;
    c.batch = batch;
    c.split = 0;
    return c;
}

// Reads the parameters Batch::rows reads first (the key counts' address;
// the offsets' where packed) into registers: a dependent launch does it
// before its wait, so that their constant-cache misses come before it too.
__device__ __forceinline__ void warm_sequence_parameters(const ProblemSize& size) {
    asm volatile("" ::"l"(size.seqused_k), "l"(size.cu_seqlens_q), "l"(size.cu_seqlens_k));
}

// The query tile of grid coordinates c (query tiles, each cut in num_splits
// key ranges, fastest).
template <bool kLongestFirst>
__device__ __forceinline__ QueryCoordinates query_coordinates_from(const ProblemSize& size, const BlockCoordinates& c,
                                                                   index_t num_m_blocks, int block_m,
                                                                   index_t num_splits) {
    const int tile = static_cast<int>(c.tile / num_splits);
    QueryCoordinates q;
    q.batch = c.batch;
    q.head = c.head;
    q.kv_head = size.kv_head_of(c.head);
    q.m_start = (kLongestFirst ? counted_from_end(tile, num_m_blocks) : tile) * block_m;
    q.split = static_cast<int>(c.tile % num_splits);
    return q;
}

// This block's query tile.
template <bool kLongestFirst>
__device__ __forceinline__ QueryCoordinates query_coordinates(const ProblemSize& size, index_t num_m_blocks,
                                                              int block_m, index_t num_splits = 1) {
    return query_coordinates_from<kLongestFirst>(size, block_coordinates(num_m_blocks * num_splits, size.nheads),
                                                 num_m_blocks, block_m, num_splits);
}

// Query tile `linear` of the flattened grid, unsplit (a persistent block's tiles).
template <bool kLongestFirst>
__device__ __forceinline__ QueryCoordinates query_coordinates_of(const ProblemSize& size, index_t num_m_blocks,
                                                                 int block_m, index_t linear) {
    return query_coordinates_from<kLongestFirst>(size, block_coordinates_of(linear, num_m_blocks, size.nheads),
                                                 num_m_blocks, block_m, 1);
}

// The query tile at `c`, with its sequence's rows.
template <typename Batch>
__device__ __forceinline__ QueryBlock query_block_at(const ProblemSize& size, const QueryCoordinates& c) {
    QueryBlock block;
    static_cast<SequenceRows&>(block) = Batch::rows(size, c.batch);
    block.batch = c.batch;
    block.head = c.head;
    block.kv_head = c.kv_head;
    block.m_start = c.m_start;
    block.split = c.split;
    return block;
}

// This block's query tile (query_coordinates, query_block_at). Like
// block_coordinates it is recomputed wherever it is called, so a kernel can
// call it again in its epilogue instead of keeping batch, head and first row
// in registers.
template <typename Batch, bool kLongestFirst>
__device__ __forceinline__ QueryBlock query_block(const ProblemSize& size, index_t num_m_blocks, int block_m,
                                                  index_t num_splits = 1) {
    return query_block_at<Batch>(size, query_coordinates<kLongestFirst>(size, num_m_blocks, block_m, num_splits));
}

// Query tile `linear` (query_coordinates_of, query_block_at).
template <typename Batch, bool kLongestFirst>
__device__ __forceinline__ QueryBlock query_block_of(const ProblemSize& size, index_t num_m_blocks, int block_m,
                                                     index_t linear) {
    return query_block_at<Batch>(size, query_coordinates_of<kLongestFirst>(size, num_m_blocks, block_m, linear));
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
struct KeyBlock : SequenceRows {
    index_t batch, kv_head, first_head, group;
    int n_block, n_start;
};

// This block's key tile; with kLastFirst the last tiles are handed out
// first (the ordered dQ of a causal mask, where key block j waits for
// j + 1: see dq_turn in backward_steps.cuh).
template <typename Batch, bool kLastFirst = false>
__device__ __forceinline__ KeyBlock key_block(const ProblemSize& size, index_t num_n_blocks, int block_n) {
    const BlockCoordinates c = block_coordinates(num_n_blocks, size.nheads_k);
    KeyBlock block;
    static_cast<SequenceRows&>(block) = Batch::rows(size, c.batch);
    block.batch = c.batch;
    block.kv_head = c.head;
    block.group = size.nheads / size.nheads_k;
    block.first_head = c.head * block.group;
    block.n_block = kLastFirst ? counted_from_end(c.tile, num_n_blocks) : c.tile;
    block.n_start = block.n_block * block_n;
    return block;
}

// What every attention kernel derives first from its parameters and its
// block's sequences: the mask and score transform of those sequences (the
// score's for the block's query head, the first of a key block's), their
// lengths, the head dim and the softmax scale in the log2 domain.
template <typename Mask, typename Score>
struct BlockContext {
    Mask mask;
    Score score;
    int seqlen_q, seqlen_k, head_dim;
    float scale_log2;  // softmax_scale * log2(e)

    template <typename Params>
    __device__ __forceinline__ BlockContext(const Params& params, const QueryBlock& block)
        : BlockContext(params, block, block.batch, block.head) {}
    template <typename Params>
    __device__ __forceinline__ BlockContext(const Params& params, const KeyBlock& block)
        : BlockContext(params, block, block.batch, block.first_head) {}
    template <typename Params>
    __device__ __forceinline__ BlockContext(const Params& params, const SequenceBounds& bounds, index_t batch,
                                            index_t head)
        : mask(make_mask<Mask>(bounds, params.variant, batch, head)),
          score(params.variant, bounds, batch, head),
          seqlen_q(mask.seqlen_q),
          seqlen_k(mask.seqlen_k),
          head_dim(params.size.head_dim_int()),
          scale_log2(params.softmax_scale_log2) {}

    // The score transform of query head `head` of the block's batch entry
    // (a key block's walk visits every head of its K/V head).
    template <typename Params>
    __device__ __forceinline__ Score score_of_head(const Params& params, index_t batch, index_t head) const {
        return Score(params.variant, mask, batch, head);
    }

    // The mask of query head `head` (a user mask reads it; the others are the same for every head).
    __device__ __forceinline__ Mask mask_of_head(index_t head) const {
        if constexpr (HasTileMap<Mask>::value) {
            return mask.with_head(head);
        } else {
            return mask;
        }
    }
};

}  // namespace cuflash
