// Launch parameters, passed to the kernels by value as one struct.
//
// The Python side builds the same structs as NumPy structured dtypes with
// aligned fields (cuflash/_params.py). Every field is 8 bytes wide, so the
// layout has no padding and cannot differ between compilers; the
// static_asserts below pin the sizes and tests/test_tiling.py compares every
// field offset with the Python side.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// A (batch, seqlen, heads, dim) tensor whose last dimension is contiguous;
// strides are in elements, not bytes.
struct TensorRef {
    void* ptr;
    index_t batch_stride;
    index_t row_stride;
    index_t head_stride;

    // Start of the row `row` of head `head` in batch entry `batch`. All
    // arithmetic is 64-bit so tensors over 2^31 elements work.
    template <typename Element>
    __device__ __forceinline__ Element* row_ptr(index_t batch, index_t head, index_t row) const {
        return static_cast<Element*>(ptr) + batch * batch_stride + head * head_stride + row * row_stride;
    }
};

// Sizes shared by the forward and backward launches.
//
// A dense batch: every entry holds seqlen_q queries and seqlen_k keys, and
// the cu_seqlens pointers are null. A variable-length (packed) batch:
// entry b's queries are rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of one
// packed (total_q, nheads, head_dim) tensor (described as a batch of one),
// its keys rows of cu_seqlens_k alike, and seqlen_q, seqlen_k are the
// longest entry's lengths, which size the grid (sequence_rows in
// block_info.cuh). total_q and total_k are the rows of the q-side and
// k-side tensors (batch * seqlen_q and batch * seqlen_k in a dense batch);
// the backward's work buffers have total_q rows.
//
// A KV cache (the forward only): seqused_k, where not null, holds each
// entry's key count (cache_seqlens, plus the keys appended by the call),
// seqlen_k being the cache's capacity; a paged cache's keys are rows of
// pages of page_size rows (the k-side tensors' batch entries), entry b's
// page list row b of block_table (block_table_stride ints apart), and
// total_k is the pages' rows (num_pages * page_size). Null and 0 otherwise.
struct ProblemSize {
    index_t batch, nheads, nheads_k, seqlen_q, seqlen_k, head_dim;
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    index_t total_q, total_k;
    const int* seqused_k;
    const int* block_table;
    index_t block_table_stride, page_size;

    // Positions inside a sequence and head-dim columns fit in int (the
    // launcher rejects sequences of 2^31 or more); offsets stay 64-bit.
    __device__ __forceinline__ int seqlen_q_int() const { return static_cast<int>(seqlen_q); }
    __device__ __forceinline__ int seqlen_k_int() const { return static_cast<int>(seqlen_k); }
    __device__ __forceinline__ int head_dim_int() const { return static_cast<int>(head_dim); }
    // Grouped-query attention: nheads / nheads_k consecutive query heads share a K/V head.
    __device__ __forceinline__ index_t kv_head_of(index_t head) const { return head / (nheads / nheads_k); }
    // The tensors' own batch and sequence sizes: a packed batch is one entry of total_q rows.
    __device__ __forceinline__ bool packed() const { return cu_seqlens_q != nullptr; }
    __device__ __forceinline__ index_t tensor_seqlen_q() const { return packed() ? total_q : seqlen_q; }
};

// The run-time values of the mask and score policies (masks.cuh,
// score_transforms.cuh), shared by the forward and backward parameters;
// fields a call's policies do not read are 0.
//   window_left, window_right  WindowMask: row i sees keys
//                              [i + off - window_left, i + off + window_right],
//                              off = seqlen_k - seqlen_q (the launcher turns an
//                              unbounded side into one past every key)
//   softcap, inverse_softcap   SoftcapScore: the cap in raw-score units,
//                              softcap / softmax_scale, and its inverse
//   alibi_slopes               WithAlibi: float32 slopes, head h of batch
//                              entry b at b * alibi_batch_stride + h
//                              (stride 0: one slope per head)
//   inverse_scale, scale       1 / softmax_scale (WithAlibi's bias in
//                              raw-score units) and softmax_scale
// Every real-valued field is float32, rounded once on the host: a double
// here is converted where the kernel reads it, and ptxas re-reads and
// re-converts it inside the main loops rather than hold a register (F2F.F64
// and a DSETP on the slow double-precision pipe each step: ~7% of the Hopper
// backward's stall samples at d128, docs/perf-notes.md).
struct VariantParams {
    index_t window_left, window_right;
    float softcap, inverse_softcap;
    const float* alibi_slopes;
    index_t alibi_batch_stride;
    float inverse_scale, scale;
    // Dropout (dropout.cuh): the call's seed and offset, the 16-bit threshold
    // below which a probability is dropped (0: none) and 1 / (1 - p); where
    // dropout_seed_pointer is set the seed is read from the GPU there
    // instead (a JAX PRNG key's 64 bits, a value that changes under jit).
    unsigned long long dropout_seed, dropout_offset;
    index_t dropout_threshold;
    float dropout_inverse_keep;
    const unsigned long long* dropout_seed_pointer;
    // The arrays a user score or mask function reads (cuflash/mods.py), by
    // the order the call names them; null where unused.
    const void* user_arrays[4];
    // A user mask's tile map (tile_map.cuh): the buffer, the strides of its
    // sections by batch entry and by head (0: shared), and its tiles
    // (tile_map_block_m query rows by tile_map_block_n keys, the kernel's);
    // null and 0 without one.
    const int* tile_map;
    index_t tile_map_batch_stride, tile_map_head_stride, tile_map_block_m, tile_map_block_n;
};

struct ForwardParams {
    TensorRef q, k, v, out;
    float* lse;  // (batch, nheads, seqlen_q)
    index_t lse_batch_stride, lse_head_stride;
    ProblemSize size;
    index_t num_m_blocks;       // ceil(seqlen_q / kBlockM): the grid is flattened over it
    float softmax_scale_log2;  // softmax_scale * log2(e), see numeric.cuh
    // The Hopper forward: bit 0 (K) and bit 1 (V) set where the launcher
    // encoded the tensor's head-pair maps (WgmmaForwardParams); 0 elsewhere.
    int kv_pair_maps;
    // Split-KV (the mma.sync forward with kSplitKv): each query block's keys
    // are cut into num_splits ranges, one thread block each; out and lse then
    // point at float32 partial results, split s's at s * out_split_stride and
    // s * lse_split_stride elements, which merge_states.cu combines by their
    // log-sum-exp. 1, 0 and 0 for every other launch.
    index_t num_splits, out_split_stride, lse_split_stride;
    VariantParams variant;

    // Log-sum-exp of (batch, head), indexed by query row.
    __device__ __forceinline__ float* lse_row(index_t batch, index_t head) const {
        return lse + batch * lse_batch_stride + head * lse_head_stride;
    }
};

// A CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned, written by
// cuTensorMapEncodeTiled on the host and read by the copy engine from the
// kernel's parameters (tma.cuh). The driver API's header is not available to
// NVRTC, hence this copy of its size and alignment.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// The Hopper forward's parameters (flash_fwd_wgmma.cu): the common ones and
// tensor maps of Q, K and V, and of the output (written only by persistent
// blocks, encoded only for them), whose global addresses the launcher
// writes per call. Passed as a __grid_constant__ parameter so that the maps
// keep a parameter-space address the copy engine can read.
//
// k_pair_maps and v_pair_maps (encoded where kv_pair_maps says): K and V
// over pairs of heads, head_dim + 8 columns wide, for head dims whose rows
// end 16 bytes into a 32-byte sector (head_dim % 16 == 8, 16-bit), heads
// contiguous and an even number of them: [0] starts at the tensor (an even
// head's columns and the next head's first 8), [1] at head 1's start less
// 16 bytes (an odd head's columns after the previous head's last 8). Every
// box row then starts and ends on a sector (sector_aligned_shift, tma.cuh).
struct WgmmaForwardParams : ForwardParams {
    TensorMap q_map, k_map, v_map, out_map;
    TensorMap k_pair_maps[2], v_pair_maps[2];
};

static_assert(sizeof(VariantParams) == 20 * 8, "VariantParams layout must match cuflash/_params.py");
static_assert(sizeof(TensorRef) == 4 * 8, "TensorRef layout must match cuflash/_params.py");
static_assert(sizeof(TensorMap) == 128, "a CUtensorMap is 128 bytes");
static_assert(sizeof(WgmmaForwardParams) == 512 + 8 * 128, "WgmmaForwardParams layout must match cuflash/_params.py");
static_assert(sizeof(ProblemSize) == 14 * 8, "ProblemSize layout must match cuflash/_params.py");
static_assert(sizeof(ForwardParams) == 4 * 32 + 3 * 8 + 14 * 8 + 2 * 8 + 3 * 8 + 20 * 8,
              "ForwardParams layout must match cuflash/_params.py");

// merge_states.cu: num_states partial attention results of the same rows
// (each normalised by its own softmax sum, with its log-sum-exp) combined
// into one. partial is state 0's (batch, seqlen, heads, head_dim) outputs,
// state s's at s * partial_state_stride elements; partial_lse state 0's
// (batch, heads, seqlen) log-sum-exps, rows partial_lse_row_stride apart.
// size.seqlen_q is the rows per (batch, head); nheads_k and seqlen_k are unused.
struct MergeParams {
    TensorRef out;
    float* lse;
    index_t lse_batch_stride, lse_head_stride, lse_row_stride;
    TensorRef partial;
    const float* partial_lse;
    index_t partial_lse_batch_stride, partial_lse_head_stride, partial_lse_row_stride;
    index_t num_states, partial_state_stride, partial_lse_state_stride;
    ProblemSize size;
};

static_assert(sizeof(MergeParams) == 2 * 32 + 2 * 8 + 6 * 8 + 3 * 8 + 14 * 8,
              "MergeParams layout must match cuflash/_params.py");

// kv_cache_append.cu: k_new and v_new (batch, seqlen_new, nheads_k,
// head_dim) appended to k_cache and v_cache at each entry's cached length,
// cache_seqlens[b] (or cache_seqlen for every entry where it is null);
// seqused_k, where not null, receives the lengths after the append. size:
// the cache's (seqlen_k its capacity, block_table and page_size where
// paged; its seqused_k null).
struct CacheAppendParams {
    TensorRef k_new, v_new, k_cache, v_cache;
    const int* cache_seqlens;
    int* seqused_k;
    index_t cache_seqlen, seqlen_new;
    ProblemSize size;
};

static_assert(sizeof(CacheAppendParams) == 4 * 32 + 4 * 8 + 14 * 8,
              "CacheAppendParams layout must match cuflash/_params.py");

// Backward. delta (nheads, total_q) and dq_accum (total_q, nheads,
// head_dim), total_q = batch * seqlen_q in a dense batch, are float32 work
// buffers made by the launcher, contiguous; dq_semaphore (batch, nheads,
// num_m_blocks) int32, zeroed by the preprocessing kernel, orders the dQ
// additions of the deterministic backward, and where dq_block_m > 0 says
// which dQ blocks of dq_block_m rows a first tile was stored into (the
// accumulator is then not zeroed: ordered_accumulation.cuh's first
// stores). Rows are addressed as in the tensors (ProblemSize): batch entry
// `batch` of the tensors (0 in a packed batch), row `row` from that entry's
// first.
struct BackwardParams {
    TensorRef q, k, v, out, dout, dq, dk, dv;
    const float* lse;  // (batch, nheads, seqlen_q), from the forward pass
    index_t lse_batch_stride, lse_head_stride;
    float* delta;     // rowsum(dO * O), written by the preprocessing kernel
    float* dq_accum;  // float32 dQ accumulated with atomics, or in a fixed order (ordered mode)
    int* dq_semaphore;  // ordered mode: per (batch, head, query block) the key blocks that added their dQ
    ProblemSize size;
    index_t num_m_blocks, num_n_blocks;
    index_t rotate_walks;  // 1: key block j walks a head's query blocks from j (QueryBlockWalk, dq_turn)
    float softmax_scale_log2;  // softmax_scale * log2(e)
    float softmax_scale;
    VariantParams variant;
    // > 0: the dK/dV kernel stores the first tile of each dQ block of this
    // many rows (kDqClaimed); 0: it adds every tile into zeros. Last: the
    // fields before it keep the offsets the kernels were tuned with.
    index_t dq_block_m;

    // The forward's log-sum-exp and delta of (batch, head) of the tensors,
    // indexed by query row.
    __device__ __forceinline__ const float* lse_row(index_t batch, index_t head) const {
        return lse + batch * lse_batch_stride + head * lse_head_stride;
    }
    __device__ __forceinline__ float* delta_row(index_t batch, index_t head) const {
        return delta + head * size.total_q + batch * size.seqlen_q;
    }
    // The float32 dQ accumulator of query row `row` of (batch, head): rows
    // of head_dim floats, heads fastest. The caller passes head_dim (the
    // value it already holds): re-reading it from the parameters here moved
    // the register-tight Hopper backward into spilling.
    __device__ __forceinline__ float* dq_accum_row(index_t batch, index_t head, index_t row, int head_dim) const {
        return dq_accum + ((batch * size.seqlen_q + row) * size.nheads + head) * head_dim;
    }
    // The dQ counter of query block m_block of (batch, head): the ordered
    // mode's turns, or the claimed mode's first store (ordered_accumulation.cuh).
    __device__ __forceinline__ int* dq_counter(index_t batch, index_t head, int m_block) const {
        return dq_semaphore + (batch * size.nheads + head) * num_m_blocks + m_block;
    }
};

static_assert(sizeof(BackwardParams) == 8 * 32 + 6 * 8 + 14 * 8 + 5 * 8 + 20 * 8, "BackwardParams layout must match cuflash/_params.py");

// The Hopper backward's parameters (flash_bwd_wgmma.cu, a __grid_constant__
// parameter): BackwardParams, then tensor maps of Q, K, V, dO (16-bit, the
// kernel's swizzled tiles) and of the float32 dQ accumulator (32-column
// boxes, 128-byte swizzle), which the copy engine reads in place; in the
// direct dQ mode (kDqDirect) dq_map is dq's own, in Q's boxes, and o_map
// the output's, in Q's boxes too (the kernel computes delta from it).
struct WgmmaBackwardParams : BackwardParams {
    TensorMap q_map, k_map, v_map, do_map, dq_map, o_map;
};

static_assert(sizeof(WgmmaBackwardParams) == 640 + 6 * 128, "WgmmaBackwardParams layout must match cuflash/_params.py");

}  // namespace cuflash
