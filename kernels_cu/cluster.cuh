// Thread-block clusters (sm_90): two or more thread blocks scheduled together
// on one GPC, each able to store into the others' shared memory (distributed
// shared memory) and to meet them at a cluster-wide barrier.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// This block's rank in its cluster (blockIdx.x % cluster size for clusters
// along x).
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}

// The address, in the cluster's shared window, of shared address `address`
// of block `rank` of this cluster (the same offset in that block's memory).
__device__ __forceinline__ u32 cluster_shared_address(u32 address, unsigned rank) {
    u32 mapped;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
    return mapped;
}

// Stores two floats into another block's shared memory (an address from
// cluster_shared_address); visible to it after a cluster barrier.
__device__ __forceinline__ void store_cluster_float2(u32 address, float x, float y) {
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(x), "f"(y) : "memory");
}

// The cluster barrier in two halves: every thread of every block of the
// cluster arrives, and waits for all of them before reading what the others
// stored before arriving (release / acquire). A thread must wait for one
// phase before it arrives at the next; work placed between its arrive and
// its wait overlaps the others' catching up.
__device__ __forceinline__ void cluster_arrive_release() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void cluster_wait_acquire() {
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

}  // namespace cuflash
