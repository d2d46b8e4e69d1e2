// Split-KV merged inside a thread-block cluster (Hopper): the kSplits
// blocks that share one query block's rows, each over its own key range,
// form one cluster, stage their rows' normalised outputs and log-sum-exps
// in their own shared memory, and after a cluster barrier each block merges
// a share of the columns by reading every block's staged state through
// distributed shared memory. No partial buffers in global memory and no
// merge launch: at decoding's sizes the merge kernel and the gap before it
// cost as much as the forward itself (docs/perf-notes.md, "Decoding").
//
// The merge is merge_states.cu's: with m = max_s lse_s and w_s =
// exp(lse_s - m), lse = m + log(sum_s w_s) and o = sum_s (w_s / sum_s w_s)
// o_s. A state with lse_s = -inf (its range had no key the row sees)
// weighs 0 and is not read into the sum; a row with no state seeing a key
// gets output 0 and log-sum-exp -inf, as in the unsplit forward.
#pragma once

#include "numeric.cuh"
#include "mma.cuh"

namespace cuflash {

// Index of this block in its cluster.
__device__ __forceinline__ int cluster_block_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return static_cast<int>(rank);
}

// Every thread of every block of the cluster has arrived: shared-memory
// writes before it (release) are visible to reads after it (acquire), in
// any block of the cluster.
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Every thread of every block of the cluster has arrived, ordering no
// memory access: for a block's last step, where it must not exit (its
// shared memory gone) while another block may still read it. A relaxed
// arrive orders nothing in PTX's memory model; the reads it must follow are
// complete because every value they returned feeds a store issued before
// it (merge_cluster_states' callers write each merged value). The released barrier above costs a
// GPU-scope fence (MEMBAR.ALL.GPU, then ERRBAR on sm_90a), which at this
// point waits for the block's output stores to complete.
__device__ __forceinline__ void cluster_barrier_before_exit() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

// The address, in the cluster's shared window, of `address` (this block's
// shared memory) in block `rank`'s shared memory.
__device__ __forceinline__ u32 cluster_shared_address(u32 address, int rank) {
    u32 mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
    return mapped;
}

__device__ __forceinline__ float load_cluster_float(u32 address) {
    float value;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(address) : "memory");
    return value;
}

__device__ __forceinline__ float4 load_cluster_float4(u32 address) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(address)
                 : "memory");
    return v;
}

// Where a cluster block stages its rows: kRows x kHeadDim normalised float
// outputs (row-major), then kRows log-sum-exps.
template <int kRows, int kHeadDim>
struct ClusterStateLayout {
    static constexpr int kOutputs = 0;
    static constexpr int kLse = kRows * kHeadDim * 4;
    static constexpr int kBytes = kLse + kRows * 4;
};

// Merges the cluster's kSplits staged states (ClusterStateLayout at the
// shared address `staged` in every block, barrier passed) of the rows
// [0, rows) of this query block: this block takes every kSplits-th group of
// four columns, starting at its rank, of every row, thread by thread.
// write(row, col, float4 values) stores four merged columns (col a multiple
// of 4, < head_dim); write_lse(row, lse) the row's log-sum-exp (block 0
// only). kThreads: the block's threads, all of which call this.
template <int kSplits, int kRows, int kHeadDim, int kThreads, typename Write, typename WriteLse>
__device__ __forceinline__ void merge_cluster_states(u32 staged, int rows, int head_dim, int thread, Write&& write,
                                                     WriteLse&& write_lse) {
    using Layout = ClusterStateLayout<kRows, kHeadDim>;
    static_assert(kHeadDim % 4 == 0, "four-column groups");
    constexpr int kGroups = kHeadDim / 4;
    const int rank = cluster_block_rank();
    u32 block_state[kSplits];
#pragma unroll
    for (int s = 0; s < kSplits; ++s) {
        block_state[s] = cluster_shared_address(staged, s);
    }
    // Work items: (row, this block's column groups rank, rank + kSplits, ...).
    constexpr int kGroupsPerBlock = (kGroups + kSplits - 1) / kSplits;
    for (int item = thread; item < kRows * kGroupsPerBlock; item += kThreads) {
        const int row = item / kGroupsPerBlock;
        const int group = rank + (item % kGroupsPerBlock) * kSplits;
        const int col = group * 4;
        if (row >= rows || group >= kGroups || col >= head_dim) {
            continue;
        }
        float lse[kSplits];
        float largest = negative_infinity();
#pragma unroll
        for (int s = 0; s < kSplits; ++s) {
            lse[s] = load_cluster_float(block_state[s] + Layout::kLse + row * 4);
            largest = fmaxf(largest, lse[s]);
        }
        const bool seen = largest != negative_infinity();
        float weight[kSplits];
        float sum = 0.0f;
#pragma unroll
        for (int s = 0; s < kSplits; ++s) {
            weight[s] = seen && lse[s] != negative_infinity() ? __expf(lse[s] - largest) : 0.0f;
            sum += weight[s];
        }
        const float inv_sum = seen ? 1.0f / sum : 0.0f;
        // Every state's columns are read before any is used: each read is a
        // round trip to another SM, and reads behind a branch on the weight
        // would follow one another. An unseen state's values (anything, NaN
        // included) are then selected out, not multiplied by 0.
        float4 o[kSplits];
#pragma unroll
        for (int s = 0; s < kSplits; ++s) {
            o[s] = load_cluster_float4(block_state[s] + Layout::kOutputs + (row * kHeadDim + col) * 4);
        }
        float4 merged = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int s = 0; s < kSplits; ++s) {
            const bool used = weight[s] != 0.0f;
            const float w = weight[s] * inv_sum;
            merged.x += used ? w * o[s].x : 0.0f;
            merged.y += used ? w * o[s].y : 0.0f;
            merged.z += used ? w * o[s].z : 0.0f;
            merged.w += used ? w * o[s].w : 0.0f;
        }
        write(row, col, merged);
        if (rank == 0 && group == 0) {
            write_lse(row, seen ? largest + logf(sum) : negative_infinity());
        }
    }
}

}  // namespace cuflash
