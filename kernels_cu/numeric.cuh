// Element types, conversions and numeric constants shared by every kernel.
//
// Storage element types are float, __half and __nv_bfloat16; all arithmetic is
// carried out in float32 whatever the storage type.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cuflash {

// Offsets into tensors are 64-bit so that tensors over 2^31 elements work.
typedef long long index_t;
// 32-bit register of packed 16-bit operands (NVRTC has no <cstdint>).
typedef unsigned int u32;

// log2(e): scores are folded into the log2 domain so that every softmax
// exponential is a single exp2 (one MUFU.EX2 instruction).
constexpr float kLog2e = 1.4426950408889634f;
// ln(2): converts a log2-domain log-sum-exp back to natural log.
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float negative_infinity() {
    return -__int_as_float(0x7f800000);
}

template <typename Element>
struct ElementConversion;

template <>
struct ElementConversion<float> {
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};

template <>
struct ElementConversion<__half> {
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct ElementConversion<__nv_bfloat16> {
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <typename Element>
__device__ __forceinline__ float to_float(Element x) {
    return ElementConversion<Element>::to_float(x);
}

template <typename Element>
__device__ __forceinline__ Element from_float(float x) {
    return ElementConversion<Element>::from_float(x);
}

// Two adjacent elements as float32 (x: the lower address), loaded or stored
// with one access: 4 bytes for 16-bit types, 8 for float. The pointer must be
// aligned to that size (pair_aligned).
template <typename Element>
struct ElementPair;

template <>
struct ElementPair<float> {
    using Storage = float2;
    static __device__ __forceinline__ float2 to_float2(float2 v) { return v; }
    static __device__ __forceinline__ float2 from_float2(float2 v) { return v; }
};

template <>
struct ElementPair<__half> {
    using Storage = __half2;
    static __device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
    static __device__ __forceinline__ __half2 from_float2(float2 v) { return __float22half2_rn(v); }
};

template <>
struct ElementPair<__nv_bfloat16> {
    using Storage = __nv_bfloat162;
    static __device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
    static __device__ __forceinline__ __nv_bfloat162 from_float2(float2 v) { return __float22bfloat162_rn(v); }
};

template <typename Element>
__device__ __forceinline__ bool pair_aligned(const void* p) {
    return reinterpret_cast<unsigned long long>(p) % (2 * sizeof(Element)) == 0;
}

template <typename Element>
__device__ __forceinline__ float2 load_pair(const Element* p) {
    using Pair = ElementPair<Element>;
    return Pair::to_float2(*reinterpret_cast<const typename Pair::Storage*>(p));
}

template <typename Element>
__device__ __forceinline__ void store_pair(Element* p, float2 v) {
    using Pair = ElementPair<Element>;
    *reinterpret_cast<typename Pair::Storage*>(p) = Pair::from_float2(v);
}

// Two float32 values rounded to one register of two 16-bit elements, `lo` in
// the low half (the element with the smaller column index in a fragment).
template <typename Element>
__device__ __forceinline__ u32 pack_pair(float lo, float hi) {
    static_assert(sizeof(Element) == 2, "two 16-bit elements a register");
    const typename ElementPair<Element>::Storage pair = ElementPair<Element>::from_float2(make_float2(lo, hi));
    return *reinterpret_cast<const u32*>(&pair);
}

// The dot product of 8 16-bit elements of a and b, added to sum.
template <typename Element>
__device__ __forceinline__ float dot_chunk(const uint4& a, const uint4& b, float sum) {
    const Element* x = reinterpret_cast<const Element*>(&a);
    const Element* y = reinterpret_cast<const Element*>(&b);
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        const float2 u = load_pair(x + i), v = load_pair(y + i);
        sum = fmaf(u.x, v.x, fmaf(u.y, v.y, sum));
    }
    return sum;
}

// 2^x with one MUFU.EX2 (ex2.approx.ftz, about 2 ulp): exp2f would add
// range handling for denormal results, which probabilities below 2^-126 do
// not need. exp2_fast(-inf) = +0, which masked scores rely on.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh with one MUFU.TANH (tanh.approx.f32, sm_75+, relative error about
// 2^-11): the soft cap of 16-bit attention, whose scores a framework's own
// implementation rounds to 2^-8 or 2^-11 anyway; one special-function op per
// score beside the softmax's exp2 keeps the cap off the critical path.
__device__ __forceinline__ float tanh_fast(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Declares Trait<T>::value: T::kMember where a policy T has that static
// flag, false where it has none (the optional flags of the policy
// contracts: masks.cuh, score_transforms.cuh).
#define CUFLASH_FLAG_TRAIT(Trait, kMember)                       \
    template <typename T, typename = void>                       \
    struct Trait {                                               \
        static constexpr bool value = false;                     \
    };                                                           \
    template <typename T>                                        \
    struct Trait<T, decltype(void(T::kMember))> {                \
        static constexpr bool value = T::kMember;                \
    }

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

}  // namespace cuflash
