// Hopper warpgroup matrix multiply (wgmma.mma_async, sm_90a only) and the
// shared-memory layout its operands are read in.
//
// A warpgroup (4 consecutive warps, the first one's index divisible by 4)
// issues D (+)= A B for a 64 x N x 16 tile: A from shared memory or from
// registers, B from shared memory, D float32 in registers. The instruction is
// asynchronous: it is issued, committed into a group, and waited for; until
// the wait its accumulator and A registers belong to the tensor cores.
//
// Accumulator layout (PTX ISA, "wgmma 64xNx16 D fragments"): warp w of the
// warpgroup holds rows 16w..16w+15, and within the warp each n8 column tile
// is laid out exactly as mma.m16n8k16's C fragment (mma.cuh), tile j in
// registers 4j..4j+3. So a warp's accumulators are a [1][N/8][4] fragment
// array of mma.cuh, and the online softmax and masking written for those
// apply unchanged. The register A operand of 64 x 16 is, per warp, mma's A
// fragment of 16 x 16: S accumulators pack into P exactly as in mma.cuh.
#pragma once

#include "numeric.cuh"
#include "swizzled_tile.cuh"
#include "tma.cuh"  // fence_async_shared

namespace cuflash {

typedef unsigned long long u64;

// Shared-memory matrix descriptor of a swizzled operand (PTX ISA, "Matrix
// Descriptor Format"): start address, leading and stride byte offsets, all in
// 16-byte units, and the swizzle mode (SwizzledTile::kDescriptorMode) in bits
// 62-63. The base-offset field stays 0: every atom is aligned to its size.
__device__ __forceinline__ u64 swizzled_descriptor(u32 address, u32 leading_bytes, u32 stride_bytes, int mode) {
    return static_cast<u64>((address & 0x3FFFF) >> 4) | (static_cast<u64>(leading_bytes >> 4) << 16) |
           (static_cast<u64>(stride_bytes >> 4) << 32) | (static_cast<u64>(mode) << 62);
}

// Descriptors of a Tile at byte `offset` from `base` (1024-byte aligned):
// the base's descriptor plus the offset in its address field, so that all
// of a kernel's descriptors are one register and constants.
// K-major operand (Q, K: the panel's columns are the reduction dimension):
// stride = one atom (the next 8 rows); leading unused (1) because a k16 step
// (32 bytes) lies inside a panel row. `offset` is the tile's (or its first
// used row's, a multiple of 8) in the first panel.
template <typename Tile>
__device__ __forceinline__ u64 kmajor_descriptor(u32 base, u32 offset) {
    return swizzled_descriptor(base, 16, Tile::kAtomBytes, Tile::kDescriptorMode) + (offset >> 4);
}

// MN-major operand (V as B of P V: rows are the reduction dimension, the
// columns N): stride = one atom (the next 8 rows of K), leading = the panel
// bytes (the next kPanelCols columns of N). `offset` is that of the panel
// holding the operand's first column.
template <typename Tile>
__device__ __forceinline__ u64 mn_major_descriptor(u32 base, u32 offset) {
    return swizzled_descriptor(base, Tile::kPanelBytes, Tile::kAtomBytes, Tile::kDescriptorMode) + (offset >> 4);
}

// Descriptor offsets (16-byte units) of k16 step ks. K-major: 32 bytes
// further inside a panel row, the next panel after a row's worth of steps
// (the hardware applies the swizzle to the resulting addresses). MN-major:
// 16 rows further.
template <typename Tile>
__device__ __forceinline__ constexpr u64 kmajor_k_step(int ks) {
    constexpr int kStepsPerPanel = Tile::kSwizzleBytes / 32;
    return static_cast<u64>((ks / kStepsPerPanel * Tile::kPanelBytes + ks % kStepsPerPanel * 32) >> 4);
}
template <typename Tile>
__device__ __forceinline__ constexpr u64 mn_major_k_step(int ks) {
    return static_cast<u64>((ks * 16 * Tile::kSwizzleBytes) >> 4);
}

// Orders this warpgroup's earlier register writes (accumulators, A
// fragments) before the wgmma instructions that follow.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// Closes the group of wgmma instructions issued since the last commit.
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The compiler sees a wgmma as finished when its asm statement is, so it
// could move reads of the accumulators above the wait (or writes below the
// issue). Touching every register in an empty asm pins them in place.
template <int kN>
__device__ __forceinline__ void pin_registers(float (&r)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) {
        asm volatile("" : "+f"(r[i])::"memory");
    }
}

// One m64nNk16 instruction with float32 accumulators. ss: A and B from
// shared memory, both K-major. ss_mn_major: the same with both MN-major
// (each transposed by the instruction); ss_mn_major_b: A K-major, B MN-major. rs: A from registers (4 per thread),
// B from shared memory MN-major. accumulate = 0 ignores d's old values.
template <typename Element, int kN>
struct Wgmma;

// Accumulator operands of the asm statements, eight registers at a time:
// CUFLASH_ACC8(d, i) binds d[i..i+7], CUFLASH_REGS_c names %8c..%8c+7.
#define CUFLASH_ACC8(d, i)                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define CUFLASH_REGS_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define CUFLASH_REGS_1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define CUFLASH_REGS_2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define CUFLASH_REGS_3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define CUFLASH_REGS_4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define CUFLASH_REGS_5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define CUFLASH_REGS_6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define CUFLASH_REGS_7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define CUFLASH_REGS_8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define CUFLASH_REGS_9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define CUFLASH_REGS_10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define CUFLASH_REGS_11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define CUFLASH_REGS_12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define CUFLASH_REGS_13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define CUFLASH_REGS_14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define CUFLASH_REGS_15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define CUFLASH_ACC_OPERANDS_16(d) CUFLASH_ACC8(d, 0), CUFLASH_ACC8(d, 8)
#define CUFLASH_REGS_TO_16 CUFLASH_REGS_0 ", " CUFLASH_REGS_1
#define CUFLASH_ACC_LIST_16 "{" CUFLASH_REGS_TO_16 "}"
#define CUFLASH_ACC_OPERANDS_24(d) CUFLASH_ACC_OPERANDS_16(d), CUFLASH_ACC8(d, 16)
#define CUFLASH_REGS_TO_24 CUFLASH_REGS_TO_16 ", " CUFLASH_REGS_2
#define CUFLASH_ACC_LIST_24 "{" CUFLASH_REGS_TO_24 "}"
#define CUFLASH_ACC_OPERANDS_32(d) CUFLASH_ACC_OPERANDS_24(d), CUFLASH_ACC8(d, 24)
#define CUFLASH_REGS_TO_32 CUFLASH_REGS_TO_24 ", " CUFLASH_REGS_3
#define CUFLASH_ACC_LIST_32 "{" CUFLASH_REGS_TO_32 "}"
#define CUFLASH_ACC_OPERANDS_40(d) CUFLASH_ACC_OPERANDS_32(d), CUFLASH_ACC8(d, 32)
#define CUFLASH_REGS_TO_40 CUFLASH_REGS_TO_32 ", " CUFLASH_REGS_4
#define CUFLASH_ACC_LIST_40 "{" CUFLASH_REGS_TO_40 "}"
#define CUFLASH_ACC_OPERANDS_48(d) CUFLASH_ACC_OPERANDS_40(d), CUFLASH_ACC8(d, 40)
#define CUFLASH_REGS_TO_48 CUFLASH_REGS_TO_40 ", " CUFLASH_REGS_5
#define CUFLASH_ACC_LIST_48 "{" CUFLASH_REGS_TO_48 "}"
#define CUFLASH_ACC_OPERANDS_56(d) CUFLASH_ACC_OPERANDS_48(d), CUFLASH_ACC8(d, 48)
#define CUFLASH_REGS_TO_56 CUFLASH_REGS_TO_48 ", " CUFLASH_REGS_6
#define CUFLASH_ACC_LIST_56 "{" CUFLASH_REGS_TO_56 "}"
#define CUFLASH_ACC_OPERANDS_64(d) CUFLASH_ACC_OPERANDS_56(d), CUFLASH_ACC8(d, 56)
#define CUFLASH_REGS_TO_64 CUFLASH_REGS_TO_56 ", " CUFLASH_REGS_7
#define CUFLASH_ACC_LIST_64 "{" CUFLASH_REGS_TO_64 "}"
#define CUFLASH_ACC_OPERANDS_96(d) CUFLASH_ACC_OPERANDS_64(d), CUFLASH_ACC8(d, 64), CUFLASH_ACC8(d, 72), CUFLASH_ACC8(d, 80), CUFLASH_ACC8(d, 88)
#define CUFLASH_REGS_TO_96 CUFLASH_REGS_TO_64 ", " CUFLASH_REGS_8 ", " CUFLASH_REGS_9 ", " CUFLASH_REGS_10 ", " CUFLASH_REGS_11
#define CUFLASH_ACC_LIST_96 "{" CUFLASH_REGS_TO_96 "}"
#define CUFLASH_ACC_OPERANDS_128(d) CUFLASH_ACC_OPERANDS_96(d), CUFLASH_ACC8(d, 96), CUFLASH_ACC8(d, 104), CUFLASH_ACC8(d, 112), CUFLASH_ACC8(d, 120)
#define CUFLASH_REGS_TO_128 CUFLASH_REGS_TO_96 ", " CUFLASH_REGS_12 ", " CUFLASH_REGS_13 ", " CUFLASH_REGS_14 ", " CUFLASH_REGS_15
#define CUFLASH_ACC_LIST_128 "{" CUFLASH_REGS_TO_128 "}"

// Operand numbers after the R accumulators: ss takes (desc A, desc B,
// accumulate) as %R..%R+2; rs takes (a0..a3, desc B, accumulate) as %R..%R+5.
// One shared-memory-operand function NAME; TRANSPOSE gives A's and B's
// major-ness ("0": K-major, "1": MN-major).
#define CUFLASH_WGMMA_SS(NAME, PTX_TYPE, N, R, SS_OPERANDS, SS_FLAG, TRANSPOSE)                                   \
    static __device__ __forceinline__ void NAME(float (&d)[R], u64 a, u64 b, int accumulate) {                    \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_FLAG ", 0;\n"                                           \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " "                    \
                     CUFLASH_ACC_LIST_##R ", " SS_OPERANDS ", p, 1, 1, " TRANSPOSE ";\n}\n"                         \
                     : CUFLASH_ACC_OPERANDS_##R(d)                                                                \
                     : "l"(a), "l"(b), "r"(accumulate));                                                          \
    }

#define CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, N, R, SS_OPERANDS, SS_FLAG, RS_OPERANDS, RS_FLAG)                  \
    template <>                                                                                                   \
    struct Wgmma<ELEMENT, N> {                                                                                    \
        CUFLASH_WGMMA_SS(ss, PTX_TYPE, N, R, SS_OPERANDS, SS_FLAG, "0, 0")                                         \
        CUFLASH_WGMMA_SS(ss_mn_major, PTX_TYPE, N, R, SS_OPERANDS, SS_FLAG, "1, 1")                                \
        CUFLASH_WGMMA_SS(ss_mn_major_b, PTX_TYPE, N, R, SS_OPERANDS, SS_FLAG, "0, 1")                              \
        static __device__ __forceinline__ void rs(float (&d)[R], const u32 (&a)[4], u64 b, int accumulate) {      \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_FLAG ", 0;\n"                                       \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE " "                \
                         CUFLASH_ACC_LIST_##R ", " RS_OPERANDS ", p, 1, 1, 1;\n}\n"                                 \
                         : CUFLASH_ACC_OPERANDS_##R(d)                                                            \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));                 \
        }                                                                                                         \
    };

// The N table: the widths the kernels use (S and dQ blocks, head dims, and
// the products narrowed to the head dim: 48, 80, 112), with the operand
// numbers that follow their N / 2 accumulators.
#define CUFLASH_DEFINE_WGMMA_N(ELEMENT, PTX_TYPE)                                                                \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 32, 16, "%16, %17", "%18", "{%16, %17, %18, %19}, %20", "%21") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 48, 24, "%24, %25", "%26", "{%24, %25, %26, %27}, %28", "%29") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 64, 32, "%32, %33", "%34", "{%32, %33, %34, %35}, %36", "%37") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 80, 40, "%40, %41", "%42", "{%40, %41, %42, %43}, %44", "%45") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 96, 48, "%48, %49", "%50", "{%48, %49, %50, %51}, %52", "%53") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 112, 56, "%56, %57", "%58", "{%56, %57, %58, %59}, %60", "%61") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 128, 64, "%64, %65", "%66", "{%64, %65, %66, %67}, %68", "%69") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 192, 96, "%96, %97", "%98", "{%96, %97, %98, %99}, %100", "%101") \
    CUFLASH_DEFINE_WGMMA(ELEMENT, PTX_TYPE, 256, 128, "%128, %129", "%130", "{%128, %129, %130, %131}, %132", "%133")

// The element-type table: one line per 16-bit input type.
CUFLASH_DEFINE_WGMMA_N(__half, "f16")
CUFLASH_DEFINE_WGMMA_N(__nv_bfloat16, "bf16")

#undef CUFLASH_DEFINE_WGMMA_N
#undef CUFLASH_DEFINE_WGMMA
#undef CUFLASH_WGMMA_SS
#undef CUFLASH_ACC_LIST_16
#undef CUFLASH_REGS_TO_16
#undef CUFLASH_ACC_OPERANDS_16
#undef CUFLASH_ACC_LIST_24
#undef CUFLASH_REGS_TO_24
#undef CUFLASH_ACC_OPERANDS_24
#undef CUFLASH_ACC_LIST_32
#undef CUFLASH_REGS_TO_32
#undef CUFLASH_ACC_OPERANDS_32
#undef CUFLASH_ACC_LIST_40
#undef CUFLASH_REGS_TO_40
#undef CUFLASH_ACC_OPERANDS_40
#undef CUFLASH_ACC_LIST_48
#undef CUFLASH_REGS_TO_48
#undef CUFLASH_ACC_OPERANDS_48
#undef CUFLASH_ACC_LIST_56
#undef CUFLASH_REGS_TO_56
#undef CUFLASH_ACC_OPERANDS_56
#undef CUFLASH_ACC_LIST_64
#undef CUFLASH_REGS_TO_64
#undef CUFLASH_ACC_OPERANDS_64
#undef CUFLASH_ACC_LIST_96
#undef CUFLASH_REGS_TO_96
#undef CUFLASH_ACC_OPERANDS_96
#undef CUFLASH_ACC_LIST_128
#undef CUFLASH_REGS_TO_128
#undef CUFLASH_ACC_OPERANDS_128
#undef CUFLASH_REGS_0
#undef CUFLASH_REGS_1
#undef CUFLASH_REGS_2
#undef CUFLASH_REGS_3
#undef CUFLASH_REGS_4
#undef CUFLASH_REGS_5
#undef CUFLASH_REGS_6
#undef CUFLASH_REGS_7
#undef CUFLASH_REGS_8
#undef CUFLASH_REGS_9
#undef CUFLASH_REGS_10
#undef CUFLASH_REGS_11
#undef CUFLASH_REGS_12
#undef CUFLASH_REGS_13
#undef CUFLASH_REGS_14
#undef CUFLASH_REGS_15
#undef CUFLASH_ACC8

}  // namespace cuflash
