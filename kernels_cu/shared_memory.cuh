// The shared-memory budget and the run-time side of every kernel's layout:
// the check that the launch gave a kernel at least what its traits need,
// and typed or aligned pointers into the dynamic shared memory.
//
// Each kernel's layout (its traits: simt_traits.cuh, tensor_core_traits.cuh)
// places its tiles at compile time and static_asserts the budget;
// cuflash/_kernel_families.py computes the same byte counts for the launch
// (checked against the traits by tests/test_tiling.py).
#pragma once

#include "numeric.cuh"

namespace cuflash {

// Hopper and Ampere (sm_80+) allow 227 KiB of shared memory per block.
constexpr int kMaxSmemBytes = 227 * 1024;

// Dynamic shared memory this launch was given, read from the PTX special register.
__device__ __forceinline__ unsigned dynamic_shared_memory_bytes() {
    unsigned bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

// The launcher sizes shared memory from cuflash/_kernel_families.py, a
// second copy of the traits' layouts. If the two ever disagreed the kernel would write past its
// shared memory; stop the launch instead of corrupting memory silently.
template <typename Layout>
__device__ __forceinline__ void require_shared_memory() {
    if (dynamic_shared_memory_bytes() < static_cast<unsigned>(Layout::kBytes)) {
        __trap();
    }
}

// Typed pointer to the tile at byte `offset` of the launch's dynamic shared
// memory (offsets come from a layout above; call require_shared_memory first).
template <typename T>
__device__ __forceinline__ T* shared_tile(int offset) {
    extern __shared__ __align__(16) unsigned char shared_memory[];
    return reinterpret_cast<T*>(shared_memory + offset);
}

// Shared address (and generic pointer) of the launch's dynamic shared memory
// rounded up to kAlignment; the launch asked for kAlignment bytes more.
template <int kAlignment>
__device__ __forceinline__ u32 aligned_shared_base(unsigned char*& generic) {
    unsigned char* const unaligned = shared_tile<unsigned char>(0);
    const u32 address = static_cast<u32>(__cvta_generic_to_shared(unaligned));
    const u32 aligned = (address + kAlignment - 1) & ~static_cast<u32>(kAlignment - 1);
    generic = unaligned + (aligned - address);
    return aligned;
}

// The 16 bytes at shared `address`, and a float stored there (32-bit
// addresses: fewer registers than generic pointers where a warp runs on
// few, as a producer's do).
__device__ __forceinline__ uint4 load_shared_chunk(u32 address) {
    uint4 chunk;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(chunk.x), "=r"(chunk.y), "=r"(chunk.z), "=r"(chunk.w)
                 : "r"(address));
    return chunk;
}

__device__ __forceinline__ void store_shared(u32 address, float value) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(address), "f"(value) : "memory");
}

}  // namespace cuflash
