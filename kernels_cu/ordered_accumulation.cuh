// Ordered accumulation: the thread blocks that add into one float32 block of
// a shared accumulator take turns in a fixed order, so the sums come out
// bitwise the same on every run (float addition is not associative, and
// atomics add in whatever order the blocks arrive). One int32 counter per
// accumulator block, zeroed before the kernel, says whose turn it is.
//
// First stores (kDqClaimed): the accumulator need not be zeroed (a pass
// over all of it at DRAM speed, before the kernel) if the first tile to
// reach each block is written over it and the others are added after it
// has landed. The blocks claim the first store with the block's counter
// (claim_first_store), which stays 0 only for a block no tile reached: the
// reader of the accumulator must then take it as zeros (never written).
#pragma once

#include "numeric.cuh"

namespace cuflash {

// How a dK/dV kernel adds its dQ tiles into the float32 accumulator (an
// int template argument, the launcher's dq_modes: its value is what the
// kernels' mangled names show): kDqAtomic in any order into zeros;
// kDqOrdered in turns (this file), into zeros; kDqClaimed in any order, the
// first tile of each block stored over the unzeroed accumulator (first
// stores, below); kDqDirect not at all: the kernel's one key block is the
// only one to reach each query block, so its tile is dQ itself, stored in
// the input dtype (no accumulator, no conversion pass).
constexpr int kDqAtomic = 0;
constexpr int kDqOrdered = 1;
constexpr int kDqClaimed = 2;
constexpr int kDqDirect = 3;

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

// The counter of an accumulator block in the unordered mode: unclaimed,
// claimed (the first tile is being stored), stored (it has landed).
enum FirstStore : int { kUnclaimed = 0, kClaimed = 1, kStored = 2 };

// Claims the first store of a block: returns the counter as it was, so
// kUnclaimed means the caller's block stores (the Hopper kernel's store
// warp, which then marks the block stored with hand_on_turn, moving it from
// kClaimed to kStored, from the thread that issued the store); kClaimed means it
// must wait (wait_until_stored) before adding; kStored that it may add at
// once. Acquire: a kStored seen here orders the store before
// the caller's additions. The claimer is running its step, so a waiter
// never waits on a block that is not on the GPU.
__device__ __forceinline__ int claim_first_store(int* counter) {
    int prior;
    asm volatile("atom.acquire.gpu.global.cas.b32 %0, [%1], %2, %3;\n"
                 : "=r"(prior)
                 : "l"(counter), "r"(static_cast<int>(kUnclaimed)), "r"(static_cast<int>(kClaimed))
                 : "memory");
    return prior;
}

// A first store the Hopper dK/dV kernel's dQ warp hands to its store warp
// (flash_bwd_wgmma.cu) through a slot of shared memory: the query head and
// block (m_block < 0: no more stores). Two 32-bit values at a shared
// address, where the dQ warp, which runs on few registers, has them at hand.
struct FirstStoreJob {
    int head, m_block;
};

__device__ __forceinline__ void post_first_store(u32 slot, int head, int m_block) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(slot), "r"(head), "r"(m_block) : "memory");
}

__device__ __forceinline__ FirstStoreJob take_first_store(u32 slot) {
    FirstStoreJob job;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(job.head), "=r"(job.m_block) : "r"(slot) : "memory");
    return job;
}

// Waits until a claimed block's first store has landed (acquire). Unlike
// poll_until_turn it has no trap: the claimer is a running block whose
// store needs nothing from anyone else. (In this mode's first version,
// poll_until_turn's 64-bit count in the dQ warp moved the consumers'
// registers into a spill.)
__device__ __forceinline__ void wait_until_stored(const int* counter) {
    asm volatile(
        "{\n"
        ".reg .pred pending;\n"
        ".reg .b32 value;\n"
        "WAIT_STORED_%=:\n"
        "ld.acquire.gpu.global.b32 value, [%0];\n"
        "setp.ne.b32 pending, value, %1;\n"
        "@pending nanosleep.u32 32;\n"
        "@pending bra.uni WAIT_STORED_%=;\n"
        "}\n" ::"l"(counter),
        "n"(static_cast<int>(kStored))
        : "memory");
}

}  // namespace cuflash
