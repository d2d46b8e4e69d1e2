// Reductions across the lanes of a warp that share one query row (or key).
//
// A row is owned by kGroup consecutive lanes (kGroup a power of two dividing
// 32), so butterfly shuffles with offsets below kGroup never leave the group.
// Every lane of the warp must call these (full mask).
#pragma once

namespace cuflash {

struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

struct SumOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

template <int kGroup, typename Op>
__device__ __forceinline__ float group_allreduce(float value, Op op) {
    static_assert(kGroup >= 1 && kGroup <= 32 && (kGroup & (kGroup - 1)) == 0,
                  "a row group is a power of two of lanes within one warp");
#pragma unroll
    for (int offset = kGroup / 2; offset > 0; offset /= 2) {
        value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    return value;
}

template <int kGroup>
__device__ __forceinline__ float group_allreduce_max(float value) {
    return group_allreduce<kGroup>(value, MaxOp());
}

template <int kGroup>
__device__ __forceinline__ float group_allreduce_sum(float value) {
    return group_allreduce<kGroup>(value, SumOp());
}

}  // namespace cuflash
