// Probabilities recomputed in the backward pass from the forward's
// log-sum-exp, instead of being stored (which would be seqlen_q x seqlen_k).
#pragma once

#include "numeric.cuh"

namespace cuflash {

// P recomputed from the forward's log-sum-exp: exp(scale * q.k - lse) =
// exp2(q.k * scale * log2(e) - lse * log2(e)). Masked entries are 0
// explicitly: a row that sees no key has lse = -inf, and the exponent of its
// (masked) entries would be NaN. One MUFU.EX2 (exp2_fast): the probabilities
// are at most 1, and those below 2^-126 may flush to zero.
__device__ __forceinline__ float recompute_probability(bool visible, float qk, float scale_log2, float lse_log2) {
    return visible ? exp2_fast(fmaf(qk, scale_log2, -lse_log2)) : 0.0f;
}

}  // namespace cuflash
