// Helpers of the code cuflash/mods.py generates from user score and mask
// functions: Python's semantics where C's differ (floor division and
// modulo of integers), and 16-bit array elements read as float. Host code
// compiles it too (tests/test_mods.py runs generated functions on the CPU).
#pragma once

#include "numeric.cuh"
#include "philox.cuh"  // CUFLASH_HOST_DEVICE

namespace cuflash {

// Python's a // b: rounded towards minus infinity (C's / truncates); b = 0 gives 0.
CUFLASH_HOST_DEVICE int mod_floor_divide(int a, int b) {
    if (b == 0) {
        return 0;
    }
    const int quotient = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? quotient - 1 : quotient;
}

// Python's a % b: the sign of b (C's % takes a's); b = 0 gives 0.
CUFLASH_HOST_DEVICE int mod_floor_modulo(int a, int b) {
    if (b == 0) {
        return 0;
    }
    const int remainder = a % b;
    return (remainder != 0 && ((remainder < 0) != (b < 0))) ? remainder + b : remainder;
}

// exp, log and tanh of a user function: precise for float32 inputs; for
// 16-bit ones (kPrecise false) one special-function op each, as the
// built-in soft cap takes (tanh_fast), their error far below the inputs'
// rounding. The host (the CPU tests) always computes them precisely.
template <bool kPrecise>
CUFLASH_HOST_DEVICE float mod_exp(float x) {
#ifdef __CUDA_ARCH__
    if constexpr (!kPrecise) {
        return __expf(x);
    }
#endif
    return expf(x);
}

template <bool kPrecise>
CUFLASH_HOST_DEVICE float mod_log(float x) {
#ifdef __CUDA_ARCH__
    if constexpr (!kPrecise) {
        return __logf(x);
    }
#endif
    return logf(x);
}

template <bool kPrecise>
CUFLASH_HOST_DEVICE float mod_tanh(float x) {
#ifdef __CUDA_ARCH__
    if constexpr (!kPrecise) {
        return tanh_fast(x);
    }
#endif
    return tanhf(x);
}

CUFLASH_HOST_DEVICE float mod_load_float(__half x) { return __half2float(x); }
CUFLASH_HOST_DEVICE float mod_load_float(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace cuflash
