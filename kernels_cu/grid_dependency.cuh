// Programmatic dependent launch (sm_90): a kernel launched with the
// programmatic stream serialization attribute (cuflash/_launch.py,
// KernelLaunch.dependent) may start before the kernel ahead of it on the
// stream has finished, once every block of that kernel has called
// `allow_dependent_launch` or exited. Its blocks then wait in
// `wait_for_prerequisite_grids` until the earlier kernel has completed and
// its memory writes are visible, so the dependent kernel's launch latency
// overlaps the earlier kernel's tail instead of following it.
//
// Both are no-ops where the kernel was launched without the attribute, and
// on GPUs before sm_90 (compiled out), so a kernel that calls them stays
// correct under either launch.
#pragma once

namespace cuflash {

// Lets the kernel launched after this one on the stream (with the
// attribute) be scheduled once every block of this grid has called this or
// exited. It says nothing about this block's memory writes: the dependent
// kernel still waits for the whole grid in wait_for_prerequisite_grids.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the grids this one depends on have completed and their memory
// writes are visible to it. Call before the first read of their results.
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cuflash
