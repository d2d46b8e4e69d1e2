// Tensor-core building blocks (sm_80 and later): the warp-wide matrix
// multiply-accumulate mma.sync.m16n8k16 with float32 accumulators, ldmatrix
// loads of its operands from shared memory (float32 pairs are packed into
// 16-bit operand registers by numeric.cuh's pack_pair).
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// lane = 4 * group + quad (group = lane / 4, quad = lane % 4):
//   A (16 x 16, row-major), 4 registers of two elements each:
//     a0 = A[group][2q, 2q+1]      a1 = A[group + 8][2q, 2q+1]
//     a2 = A[group][2q+8, 2q+9]    a3 = A[group + 8][2q+8, 2q+9]
//   B (16 x 8, k x n), 2 registers:  b0 = B[2q, 2q+1][group]   b1 = B[2q+8, 2q+9][group]
//   C/D (16 x 8, float32), 4 values: c0, c1 = C[group][2q, 2q+1]   c2, c3 = C[group + 8][2q, 2q+1]
// So the accumulators of two adjacent n-tiles, packed pairwise, are exactly
// the A fragment of the next product: P goes from S to P V without shared memory.
#pragma once

#include "numeric.cuh"

namespace cuflash {

// d += a * b for one 16 x 8 x 16 tile, float32 accumulation.
template <typename Element>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

// One specialisation per 16-bit input type, differing only in its PTX name.
#define CUFLASH_DEFINE_MMA_M16N8K16(ELEMENT, PTX_TYPE)                                                           \
    template <>                                                                                                 \
    __device__ __forceinline__ void mma_m16n8k16<ELEMENT>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {  \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                            \
                     ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                   \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                         \
    }
CUFLASH_DEFINE_MMA_M16N8K16(__half, "f16")
CUFLASH_DEFINE_MMA_M16N8K16(__nv_bfloat16, "bf16")
#undef CUFLASH_DEFINE_MMA_M16N8K16

// The A fragment of one k16 step from the accumulators of the two n8 tiles it
// spans (lo: its columns 0-7, hi: 8-15), rounded to Element. The layouts
// match (see above), so P goes from S's accumulators to the A operand of
// P V without shared memory; the same holds for wgmma's (wgmma.cuh).
// The register of a k16 step's A fragment that holds n8 tile `tile`'s (0:
// lo, 1: hi) pair of row half `half` (0: row group, 1: group + 8).
__host__ __device__ constexpr int a_fragment_register(int tile, int half) {
    return 2 * tile + half;
}

template <typename Element>
__device__ __forceinline__ void pack_a_fragment(u32 (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[a_fragment_register(0, 0)] = pack_pair<Element>(lo[0], lo[1]);
    a[a_fragment_register(0, 1)] = pack_pair<Element>(lo[2], lo[3]);
    a[a_fragment_register(1, 0)] = pack_pair<Element>(hi[0], hi[1]);
    a[a_fragment_register(1, 1)] = pack_pair<Element>(hi[2], hi[3]);
}

// Every k16 step's A fragment from a row tile's kNTiles n8 accumulators.
template <typename Element, int kNTiles>
__device__ __forceinline__ void pack_a_fragments(u32 (&a)[kNTiles / 2][4], const float (&acc)[kNTiles][4]) {
#pragma unroll
    for (int step = 0; step < kNTiles / 2; ++step) {
        pack_a_fragment<Element>(a[step], acc[2 * step], acc[2 * step + 1]);
    }
}

// Sets every value of a fragment array (accumulators of kM x kN tiles).
template <int kM, int kN>
__device__ __forceinline__ void fill_fragments(float (&fragments)[kM][kN][4], float value) {
    float (&flat)[kM * kN * 4] = reinterpret_cast<float (&)[kM * kN * 4]>(fragments);
#pragma unroll
    for (int i = 0; i < kM * kN * 4; ++i) {
        flat[i] = value;
    }
}

// Multiplies each row of accumulator fragments by its factor: row r of
// row_scale is m16 tile r / 2, half r % 2 (elements 0-1 of each n8 tile are
// the upper row of a lane, 2-3 the lower one).
template <int kM, int kN>
__device__ __forceinline__ void scale_fragment_rows(float (&fragments)[kM][kN][4], const float (&row_scale)[2 * kM]) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int n = 0; n < kN; ++n) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                fragments[m][n][i] *= row_scale[2 * m + i / 2];
            }
        }
    }
}

// acc[mt][2 * n_pair] and acc[mt][2 * n_pair + 1] += A_mt B for every m16
// tile mt, a(mt) giving A_mt's fragment: the four registers of one
// ldmatrix_x4 of B (two n8 tiles) feed every m16 tile.
template <typename Element, int kM, int kN, typename AFragment>
__device__ __forceinline__ void mma_two_n8_tiles(float (&acc)[kM][kN][4], AFragment&& a, const u32 (&b)[4],
                                                 int n_pair) {
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) {
        mma_m16n8k16<Element>(acc[mt][2 * n_pair], a(mt), b[0], b[1]);
        mma_m16n8k16<Element>(acc[mt][2 * n_pair + 1], a(mt), b[2], b[3]);
    }
}

// 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 shared_address(const void* pointer) {
    return static_cast<u32>(__cvta_generic_to_shared(pointer));
}

// Four 8 x 8 matrices of 16-bit elements: lanes 8j..8j+7 give the addresses
// of the eight 16-byte rows of matrix j; register j receives matrix j, each
// lane holding elements (lane / 4, 2 * (lane % 4) + {0, 1}).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// The same, each matrix transposed on the way: lane holds elements
// (2 * (lane % 4) + {0, 1}, lane / 4) of the stored matrix. Turns row-major
// V (keys x dims) into the k-major B operand of P V.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// The inverse of ldmatrix_x4 (sm_90): register j holds matrix j in the same
// fragment layout, and lanes 8j..8j+7 give the addresses its eight 16-byte
// rows are stored at.
__device__ __forceinline__ void stmatrix_x4(u32 address, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

}  // namespace cuflash
