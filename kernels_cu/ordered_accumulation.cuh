// Ordered accumulation: the thread blocks that add into one float32 block of
// a shared accumulator take turns in a fixed order, so the sums come out
// bitwise the same on every run (float addition is not associative, and
// atomics add in whatever order the blocks arrive). One int32 counter per
// accumulator block, zeroed before the kernel, says whose turn it is.
#pragma once

#include "numeric.cuh"

namespace cuflash {

__device__ __forceinline__ int load_acquire(const int* address) {
    int value;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
    return value;
}

__device__ __forceinline__ void store_release(int* address, int value) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(address), "r"(value) : "memory");
}

// Waits until *counter == turn; thread 0 polls and the whole block goes on
// together. Callers wait only for blocks with a smaller index into the grid
// (dispatched earlier, so resident or finished), which guarantees progress. A
// counter that never arrives (block ranges that disagree with the order)
// traps, with an error, instead of hanging the GPU.
__device__ __forceinline__ void wait_for_turn(const int* counter, int turn) {
    if (threadIdx.x == 0) {
        long long polls = 0;
        while (load_acquire(counter) != turn) {
            if (++polls > (1LL << 28)) {
                __trap();
            }
            __nanosleep(32);
        }
    }
    __syncthreads();
}

// Makes this block's additions visible, then hands the turn on.
__device__ __forceinline__ void pass_turn(int* counter, int turn) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        store_release(counter, turn + 1);
    }
}

}  // namespace cuflash
