// Warp specialisation on Hopper: warpgroups with different roles in one
// block (a producer that only issues copies, consumers that do the math),
// the registers each role keeps, and the named barriers that order the
// consumers among themselves without stopping the producer.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Registers per consumer thread after the producer warpgroup has handed
// back all but producer_registers of its own. A block starts with the
// registers its launch bounds allow every thread (registers_at_entry: the
// file's 65536 over blocks_per_sm blocks of `threads`, rounded down to the
// allocation step of 8) and
// setmaxnreg only moves registers within the block: a consumer asking for
// more than the block holds would wait forever. At most 240 (the ISA's
// ceiling is 256; the compiler keeps a margin for the entry code).
__host__ __device__ constexpr int registers_at_entry(int threads, int blocks_per_sm) {
    return 65536 / (blocks_per_sm * threads) / 8 * 8;
}
__host__ __device__ constexpr int consumer_registers(int threads, int consumer_threads, int producer_registers,
                                                     int blocks_per_sm) {
    const int at_entry = registers_at_entry(threads, blocks_per_sm);
    const int available = (at_entry * threads - 128 * producer_registers) / consumer_threads / 8 * 8;
    return available > 240 ? 240 : available;
}

// Hands registers back (producer) or takes them (consumers). Every warp of
// the warpgroup must execute the same one; the kernel needs a register cap
// at entry (__launch_bounds__ with a minimum of blocks per multiprocessor).
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// The lane index, read afresh from the hardware wherever it is called. Values
// derived from it (swizzled shared-memory offsets of a warp's fragments)
// cannot be hoisted out of a loop: a compiler that keeps a dozen such
// loop-invariant offsets live in a register-tight loop spills them, where
// recomputing each costs an instruction or two.
__device__ __forceinline__ int lane_index_now() {
    int lane;
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
    return lane;
}

// Named barriers (bar.sync / bar.arrive): `threads` threads in all take
// part, a multiple of 32. Barrier 0 is __syncthreads'; a warp-specialised
// kernel uses ids from 1 so that the producer never has to join.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace cuflash
