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

__device__ __forceinline__ void add_release(int* address, int value) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(address), "r"(value) : "memory");
}

// Waits until *counter == turn, polled by the calling thread alone.
// Progress needs the awaited block to be running or finished: callers wait
// for blocks dispatched earlier, or (rotated walks, see dq_turn) for blocks
// of a head whose key blocks all fit on the GPU at once. A counter that
// never arrives (block ranges that disagree with the order) traps, with an
// error, instead of hanging the GPU.
__device__ __forceinline__ void poll_until_turn(const int* counter, int turn) {
    long long polls = 0;
    while (load_acquire(counter) != turn) {
        if (++polls > (1LL << 28)) {
            __trap();
        }
        __nanosleep(32);
    }
}

// The same for a whole block: thread 0 polls and the block goes on together.
__device__ __forceinline__ void wait_for_turn(const int* counter, int turn) {
    if (threadIdx.x == 0) {
        poll_until_turn(counter, turn);
    }
    __syncthreads();
}

// Hands the turn on, off the caller's critical path: called by thread 0
// alone, after a barrier that every thread reached after its additions. The
// barrier orders them before thread 0's fence, and a release is cumulative
// over what was ordered before it, so the next block sees them all; the
// other threads need not wait for their additions to land. A caller that
// calls this once its next tensor-core work is issued hides the fence's
// wait behind it.
// The holder of the turn is the only one that may change the counter, so
// handing on is adding one (no need to keep the turn's number).
__device__ __forceinline__ void hand_on_turn(int* counter) {
    __threadfence();
    add_release(counter, 1);
}

// The turn a block holds from its last additions until it hands it on one
// step later (see hand_on_turn): none before the first step's additions.
struct HeldTurn {
    int* counter = nullptr;

    // Thread 0 hands the held turn on, if any; every thread has passed a
    // barrier since its additions.
    __device__ __forceinline__ void hand_on(int thread) const {
        if (thread == 0 && counter != nullptr) {
            hand_on_turn(counter);
        }
    }
};

}  // namespace cuflash
