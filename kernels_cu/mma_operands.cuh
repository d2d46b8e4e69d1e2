// How the mma.sync forward (flash_fwd_mma.cu) feeds each element type to the
// tensor cores: where each lane's ldmatrix rows start, one k step of
// S = Q K^T or O += P V on a pair of n8 tiles, the A operand of P V from S's
// accumulators, and V's B operand.
//
//   MmaOperands<__half / __nv_bfloat16>: mma.m16n8k16 on 16-bit inputs (mma.cuh).
//   MmaOperands<float>: 3xTF32. Each float32 operand x is split into
//     big = tf32(x) and small = x - big (tf32: 10 explicit mantissa bits,
//     so big + small carries 21 of float32's 24, see split_tf32), and a product is
//     a_small b_big + a_big b_small + a_big b_big on mma.m16n8k8.tf32 with
//     float32 accumulation: three products where one would do in 16 bits,
//     for an error near float32's (the dropped a_small b_small is below
//     2^-22 relative) at tensor-core speed.
//
// A k step spans 32 bytes of k in both: 16 elements of 16 bits, 8 of 32. An
// 8 x 8 ldmatrix matrix of 16-bit elements is 8 x 4 of float32, each lane
// receiving element (lane / 4, lane % 4): exactly the tf32 fragment layouts,
//   A (16 x 8):  a0 = A[g][q]  a1 = A[g + 8][q]  a2 = A[g][q + 4]  a3 = A[g + 8][q + 4]
//   B (8 x 8):   b0 = B[q][g]  b1 = B[q + 4][g]        (g = lane / 4, q = lane % 4)
// so Q and K load by the same byte addresses as 16-bit tiles. P V needs P as
// A, but S's accumulators hold P[g][2q, 2q + 1] and P[g + 8][2q, 2q + 1]:
// the sum over keys does not care in which order the k slots take the keys,
// so slot q takes key 2q and slot q + 4 key 2q + 1 (a0..a3 = c0, c2, c1, c3),
// and V's B operand is read with the same permutation, one 32-bit shared
// load per register (ldmatrix cannot transpose 32-bit elements).
#pragma once

#include "numeric.cuh"
#include "mma.cuh"

namespace cuflash {

// What both element widths share: lane addresses (byte offsets) of the
// ldmatrix rows of A (Q) and of B (K) in tiles of kStride elements per row,
// each row's k step in two 16-byte halves (kHalf elements each). The
// mma.sync backward reads its K/V (A) and Q/dO (B) of S^T and dP^T the same way.
template <int kStride, int kElementBytes>
struct MmaLaneOffsets {
    static constexpr int kHalf = 16 / kElementBytes;
    // A, one m16 x k step from row first_row: matrices (rows 0-7 | 8-15) x (first | second half).
    static __device__ __forceinline__ u32 a(int lane, int first_row) {
        return ((first_row + lane % 8 + (lane / 8) % 2 * 8) * kStride + lane / 16 * kHalf) * kElementBytes;
    }
    // B of Q K^T, two n8 tiles: matrices (keys 0-7: first | second half), (keys 8-15: ...).
    static __device__ __forceinline__ u32 b(int lane) {
        return ((lane % 8 + lane / 16 * 8) * kStride + (lane / 8) % 2 * kHalf) * kElementBytes;
    }
    // B stored with k along the rows (V of P V; dO, Q, K in the backward),
    // read by ldmatrix.trans, 16-bit elements: matrices (k 0-7 | 8-15) x
    // (columns 0-7 | 8-15), two n8 tiles of columns per load.
    static __device__ __forceinline__ u32 b_trans(int lane) {
        static_assert(kElementBytes == 2, "ldmatrix.trans moves 16-bit elements");
        return ((lane % 8 + (lane / 8) % 2 * 8) * kStride + lane / 16 * 8) * kElementBytes;
    }
};

template <typename Element, int kStride>
struct MmaOperands : MmaLaneOffsets<kStride, 2> {
    static constexpr int kElementBytes = 2;
    static constexpr int kKStep = 16;  // elements of k per product
    // A lane's address offset into V for v_b (ldmatrix.trans rows).
    static __device__ __forceinline__ u32 v_lane(int lane) { return MmaLaneOffsets<kStride, 2>::b_trans(lane); }
    // V's B operand of P V, k step ps (keys), n8 tiles 2 dp and 2 dp + 1 (dims).
    static __device__ __forceinline__ void v_b(u32 (&b)[4], u32 lane_address, int ps, int dp) {
        ldmatrix_x4_trans(b, lane_address + (ps * kKStep * kStride + dp * 16) * kElementBytes);
    }
    // The A operand of P V's k step ps from the accumulators of S's row tile.
    template <int kNTiles>
    static __device__ __forceinline__ void p_a(u32 (&a)[4], const float (&s)[kNTiles][4], int ps) {
        pack_a_fragment<Element>(a, s[2 * ps], s[2 * ps + 1]);
    }
    template <int kM, int kN, typename AFragment>
    static __device__ __forceinline__ void mma_two_n8_tiles(float (&acc)[kM][kN][4], AFragment&& a,
                                                            const u32 (&b)[4], int n_pair) {
        cuflash::mma_two_n8_tiles<Element>(acc, a, b, n_pair);
    }
};

// The tf32 pair (big, small) of a float32 bit pattern: big = x rounded to
// tf32, small = x - big (exact in float32). The mma reads only a tf32's 19
// bits, so small is not rounded here: the tensor cores drop its low 13 bits,
// an error below 2^-21 |x| (big's rounding leaves |small| <= 2^-11 |x|).
__device__ __forceinline__ void split_tf32(u32 x, u32& big, u32& small) {
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(big) : "f"(__uint_as_float(x)));
    small = __float_as_uint(__uint_as_float(x) - __uint_as_float(big));
}

// d += a * b for one 16 x 8 x 8 tile of tf32 inputs, float32 accumulation.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int kStride>
struct MmaOperands<float, kStride> : MmaLaneOffsets<kStride, 4> {
    static constexpr int kElementBytes = 4;
    static constexpr int kKStep = 8;
    // Element (2 q, g) of V's k step (keys) and n8 tile (dims): see above.
    static __device__ __forceinline__ u32 v_lane(int lane) {
        return (2 * (lane % 4) * kStride + lane / 4) * kElementBytes;
    }
    // volatile, with a memory clobber: the loads must stay after the barrier
    // that says V has landed.
    static __device__ __forceinline__ void v_b(u32 (&b)[4], u32 lane_address, int ps, int dp) {
        const u32 address = lane_address + (ps * kKStep * kStride + dp * 16) * kElementBytes;
        constexpr u32 kNextKey = kStride * kElementBytes;
        constexpr u32 kNextTile = 8 * kElementBytes;
        asm volatile("ld.shared.b32 %0, [%4];\n\t"
                     "ld.shared.b32 %1, [%4 + %5];\n\t"
                     "ld.shared.b32 %2, [%4 + %6];\n\t"
                     "ld.shared.b32 %3, [%4 + %7];\n"
                     : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3])
                     : "r"(address), "n"(kNextKey), "n"(kNextTile), "n"(kNextTile + kNextKey)
                     : "memory");
    }
    template <int kNTiles>
    static __device__ __forceinline__ void p_a(u32 (&a)[4], const float (&s)[kNTiles][4], int ps) {
        a[0] = __float_as_uint(s[ps][0]);
        a[1] = __float_as_uint(s[ps][2]);
        a[2] = __float_as_uint(s[ps][1]);
        a[3] = __float_as_uint(s[ps][3]);
    }
    // The small cross terms first, into the same float32 accumulator; the
    // two n8 tiles alternate, two independent chains of products.
    template <int kM, int kN, typename AFragment>
    static __device__ __forceinline__ void mma_two_n8_tiles(float (&acc)[kM][kN][4], AFragment&& a,
                                                            const u32 (&b)[4], int n_pair) {
        u32 b_big[4], b_small[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            split_tf32(b[i], b_big[i], b_small[i]);
        }
#pragma unroll
        for (int mt = 0; mt < kM; ++mt) {
            u32 a_big[4], a_small[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                split_tf32(a(mt)[i], a_big[i], a_small[i]);
            }
            float(&d0)[4] = acc[mt][2 * n_pair];
            float(&d1)[4] = acc[mt][2 * n_pair + 1];
            mma_m16n8k8_tf32(d0, a_small, b_big[0], b_big[1]);
            mma_m16n8k8_tf32(d1, a_small, b_big[2], b_big[3]);
            mma_m16n8k8_tf32(d0, a_big, b_small[0], b_small[1]);
            mma_m16n8k8_tf32(d1, a_big, b_small[2], b_small[3]);
            mma_m16n8k8_tf32(d0, a_big, b_big[0], b_big[1]);
            mma_m16n8k8_tf32(d1, a_big, b_big[2], b_big[3]);
        }
    }
};

}  // namespace cuflash
