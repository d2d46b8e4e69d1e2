// Shared-memory barriers with transaction counts (mbarrier, sm_90), the
// hand-off between a warp that loads tiles and the warps that use them.
//
// An mbarrier completes a phase when its expected arrivals have arrived and
// the bytes announced by arrive_expect_tx have been written by the copy
// engine (TMA, tma.cuh), which counts them down as they land. Waiters name
// the phase they wait for by its parity: a fresh barrier is in phase 0, so
// waiting for parity 1 ("the phase before") returns at once, which is how a
// producer finds every buffer empty on its first pass.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// One 8-byte mbarrier at shared address `barrier`, expecting `arrivals` arrivals per phase.
__device__ __forceinline__ void mbarrier_init(u32 barrier, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}

// Makes the initialised barriers visible to the other threads and to the
// copy engine (the async proxy); a block-wide barrier must follow.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(u32 barrier) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(barrier) : "memory");
}

// Arrives and announces `bytes` that copies completing on this barrier will write.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u32 barrier, u32 bytes) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(barrier),
                 "r"(bytes)
                 : "memory");
}

// Announces `bytes` that copies completing on this barrier will write,
// without arriving (the caller's arrival comes later, with the others').
__device__ __forceinline__ void mbarrier_expect_tx(u32 barrier, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

// Waits until the phase of parity `parity` has completed. try_wait suspends
// the thread for a while in hardware before returning false, so the loop
// does not spin on the issue slots the math warps need.
__device__ __forceinline__ void mbarrier_wait(u32 barrier, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "wait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}\n" ::"r"(barrier),
        "r"(parity)
        : "memory");
}

// Position in a ring of kStages buffers, each guarded by a "full" and an
// "empty" barrier: the buffer index and the parity of the phase that the
// current pass over the ring waits for.
template <int kStages>
struct RingPosition {
    int stage = 0;
    u32 phase = 0;

    __device__ __forceinline__ void advance() {
        if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
        }
    }
    // The position kBack advances before this one (derived rather than kept:
    // registers are scarce where it is needed).
    template <int kBack>
    __device__ __forceinline__ RingPosition behind() const {
        RingPosition p = *this;
#pragma unroll
        for (int k = 0; k < kBack; ++k) {
            if (p.stage == 0) {
                p.stage = kStages - 1;
                p.phase ^= 1;
            } else {
                --p.stage;
            }
        }
        return p;
    }
};

}  // namespace cuflash
