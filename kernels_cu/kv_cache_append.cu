// Appending new keys and values to a KV cache (cuflash.attention_with_kvcache
// with k_new / v_new): row j of entry b's k_new and v_new becomes key
// cache_seqlens[b] + j of the cache, contiguous or paged (the Batch policy's
// key_row, block_info.cuh), before the attention that reads them runs.
// Keys that would land at or past the cache's capacity are not written (the
// positions live on the GPU, where the launcher cannot check them), and
// seqused_k[b] receives the entry's key count after the append, clamped to
// the capacity, which the attention then reads (ProblemSize::seqused_k).
//
// One thread per 16-byte chunk of a row (the launcher requires head_dim a
// multiple of 16 bytes and 16-byte aligned rows), grid-stride.
#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"

namespace cuflash {

// The entry's cached keys before the append: cache_seqlens[b], or
// cache_seqlen for every entry; clamped to [0, capacity].
__device__ __forceinline__ int cached_keys(const CacheAppendParams& params, index_t batch) {
    const int given = params.cache_seqlens == nullptr ? static_cast<int>(params.cache_seqlen)
                                                      : params.cache_seqlens[batch];
    return min(max(given, 0), params.size.seqlen_k_int());
}

template <typename Element, typename Batch>
__global__ void kv_cache_append_kernel(const CacheAppendParams params) {
    constexpr int kChunkElements = 16 / int(sizeof(Element));
    const ProblemSize& size = params.size;
    const int chunks_per_row = size.head_dim_int() / kChunkElements;
    const index_t seqlen_new = params.seqlen_new;
    const index_t total = size.batch * seqlen_new * size.nheads_k * chunks_per_row;
    const index_t first = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const index_t step = static_cast<index_t>(gridDim.x) * blockDim.x;
    if (params.seqused_k != nullptr) {
        for (index_t batch = first; batch < size.batch; batch += step) {
            params.seqused_k[batch] =
                static_cast<int>(min(static_cast<index_t>(cached_keys(params, batch)) + seqlen_new, size.seqlen_k));
        }
    }
    for (index_t index = first; index < total; index += step) {
        const int chunk = static_cast<int>(index % chunks_per_row);
        index_t rest = index / chunks_per_row;
        const index_t kv_head = rest % size.nheads_k;
        rest /= size.nheads_k;
        const index_t row = rest % seqlen_new;
        const index_t batch = rest / seqlen_new;
        const index_t key = cached_keys(params, batch) + row;
        if (key >= size.seqlen_k) {
            continue;  // past the capacity: not written, not attended
        }
        const SequenceRows rows = Batch::rows(size, batch);
        const int col = chunk * kChunkElements;
        *reinterpret_cast<uint4*>(key_row<Batch, Element>(rows, params.k_cache, kv_head, static_cast<int>(key)) + col) =
            *reinterpret_cast<const uint4*>(params.k_new.row_ptr<const Element>(batch, kv_head, row) + col);
        *reinterpret_cast<uint4*>(key_row<Batch, Element>(rows, params.v_cache, kv_head, static_cast<int>(key)) + col) =
            *reinterpret_cast<const uint4*>(params.v_new.row_ptr<const Element>(batch, kv_head, row) + col);
    }
}

}  // namespace cuflash
