// Programmatic dependent launch (sm_90): a kernel launched with the
// programmatic stream serialization attribute (cuflash/_launch.py,
// KernelLaunch.dependent) may be scheduled once every block of the kernel
// ahead of it on the stream has exited (or let it start earlier), before
// that kernel has completed and its memory writes are flushed. Its blocks
// then wait in `wait_for_prerequisite_grids` until the earlier kernel has
// completed and its writes are visible, so the dependent kernel's launch
// latency overlaps the earlier kernel's completion instead of following it.
//
// No cuflash kernel lets its dependents start before its blocks have all
// exited (griddepcontrol.launch_dependents): every place it was tried
// measured slower on the H100, a next call's blocks placed beside the
// running ones (docs/perf-notes.md, decoding).
//
// The wait is a no-op where the kernel was launched without the attribute,
// and on GPUs before sm_90 (compiled out), so a kernel that calls it stays
// correct under either launch.
#pragma once

namespace cuflash {

// Waits until the grids this one depends on have completed and their memory
// writes are visible to it. Call before the first read of their results.
__device__ __forceinline__ void wait_for_prerequisite_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace cuflash
