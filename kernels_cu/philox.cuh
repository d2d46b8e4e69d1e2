// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
// 3", SC 2011): a counter-based generator. Four 32-bit outputs are a pure
// function of a 128-bit counter and a 64-bit key, so any thread can draw the
// random bits of any element without state or ordering: dropout regenerates
// its mask in the backward from the same coordinates (dropout.cuh).
// cuflash/dropout.py computes the same function in NumPy; host and device
// compile this header (tests/test_dropout.py runs it on the CPU).
#pragma once

#ifdef __CUDACC__
#define CUFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CUFLASH_HOST_DEVICE inline
#endif

namespace cuflash {

struct PhiloxWords {
    unsigned int x, y, z, w;
};

// The multipliers and the key increments (Weyl sequence) of Philox4x32.
constexpr unsigned int kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr unsigned int kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

CUFLASH_HOST_DEVICE unsigned int philox_mulhi(unsigned int a, unsigned int b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
#endif
}

// Ten rounds of Philox4x32 on `counter` under the key (key0, key1).
CUFLASH_HOST_DEVICE PhiloxWords philox4x32_10(PhiloxWords counter, unsigned int key0, unsigned int key1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned int hi0 = philox_mulhi(kPhiloxM0, counter.x), lo0 = kPhiloxM0 * counter.x;
        const unsigned int hi1 = philox_mulhi(kPhiloxM1, counter.z), lo1 = kPhiloxM1 * counter.z;
        counter = {hi1 ^ counter.y ^ key0, lo1, hi0 ^ counter.w ^ key1, lo0};
        key0 += kPhiloxW0;
        key1 += kPhiloxW1;
    }
    return counter;
}

}  // namespace cuflash
