// Probabilities and score gradients of the backward pass, recomputed from
// the forward's log-sum-exp instead of being stored (which would be
// seqlen_q x seqlen_k). Every backward kernel computes dS with these.
#pragma once

#include "numeric.cuh"
#include "block_info.cuh"

namespace cuflash {

// P recomputed from the forward's log-sum-exp: exp(scale * s - lse) =
// exp2(s * scale * log2(e) - lse * log2(e)), s the (transformed) score.
// Masked entries are 0 explicitly: a row that sees no key has lse = -inf,
// and the exponent of its (masked) entries would be NaN. One MUFU.EX2
// (exp2_fast): the probabilities are at most 1, and those below 2^-126 may
// flush to zero.
__device__ __forceinline__ float recompute_probability(bool visible, float score, float scale_log2, float lse_log2) {
    return visible ? exp2_fast(fmaf(score, scale_log2, -lse_log2)) : 0.0f;
}

// dL/d(raw score) = dS = P (dP - delta) times the score transform's
// derivative at this score (transform_derivative: from the raw score `raw`,
// the transformed one, or ALiBi's distance as a float): softmax's gradient,
// then the chain rule through the transform. The identity costs nothing.
template <typename Score>
__device__ __forceinline__ float score_gradient(const Score& score, float p, float dp, float delta, float raw,
                                                float transformed, int row, int key, float alibi_distance) {
    const float ds = p * (dp - delta);
    if constexpr (Score::kIsIdentity) {
        return ds;
    } else {
        // Where P is 0 (masked: the fragment kernels hold -inf there, at which
        // a transform's derivative need not be finite) dS is 0, not 0 * inf.
        return p > 0.0f ? ds * transform_derivative(score, raw, transformed, row, key, alibi_distance) : 0.0f;
    }
}

// P and dS of one score (SIMT backward kernels): qk the raw score of (row,
// key), dp its dP, lse_log2 and delta the row's statistics; row_valid:
// the row exists; `mask` and `score` the mask and transform of the row's
// head. With dropout, p is the dropped and scaled probability (dV's), and
// dS = P (Z dP - delta).
struct ScoreGradient {
    float p, ds;
};

template <typename Mask, typename Score>
__device__ __forceinline__ ScoreGradient recompute_score_gradient(const BlockContext<Mask, Score>& ctx,
                                                                  const Mask& mask, const Score& score, float qk,
                                                                  float dp, int row, int key, bool row_valid,
                                                                  float lse_log2, float delta) {
    const bool visible = row_valid && key_visible(mask, row, key);
    const float s = transformed_score(score, qk, row, key);
    const float p = recompute_probability(visible, s, ctx.scale_log2, lse_log2);
    const float z = dropout_factor(score, row, key);  // 1 without dropout
    const float alibi_distance = static_cast<float>(row + ctx.seqlen_k - ctx.seqlen_q - key);
    return {Score::kDropout ? p * z : p,
            score_gradient(score, p, Score::kDropout ? dp * z : dp, delta, qk, s, row, key, alibi_distance)};
}

}  // namespace cuflash
