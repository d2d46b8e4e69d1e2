// Score transforms: a function applied to every raw score q.k of the
// visible part of the score matrix before the mask and the softmax, and its
// derivative, which every backward multiplies into dS.
//
// A transform is a small struct built from the launch's run-time policy
// values (VariantParams, params.cuh), the block's sequence lengths and the
// batch entry and query head it scores (the backward's key blocks, which
// walk every query head of a K/V head, build one per head), with
//   kIsIdentity                      true only for IdentityScore: the kernels
//                                    then skip both hooks at compile time
//   transform(raw, row, key)         the transformed score, in raw-score units:
//                                    the kernels multiply it by
//                                    softmax_scale * log2(e) afterwards, so the
//                                    online softmax's max of unscaled scores
//                                    (valid for a positive scale) still holds
//   gradient(transformed, row, key)  d transformed / d raw at that score, from
//                                    the transformed value the backward
//                                    recomputed
//   kDropout                         true for WithDropout<...>, whose member
//                                    `dropout` (dropout.cuh) drops
//                                    probabilities after the softmax: it
//                                    rides on the score policy because it
//                                    needs the same coordinates (batch
//                                    entry, head, row, key), and adds one
//                                    policy instead of one per transform
// cuflash/_masks.py's SCORE_TRANSFORMS lists them for the launcher and the
// float64 references (docs/kernel-policies.md).
#pragma once

#include "dropout.cuh"
#include "masks.cuh"

namespace cuflash {

struct IdentityScore {
    static constexpr bool kIsIdentity = true;
    static constexpr bool kDropout = false;

    __device__ __forceinline__ IdentityScore(const VariantParams&, SequenceBounds, index_t, index_t) {}
    __device__ __forceinline__ float transform(float raw, int, int) const { return raw; }
    __device__ __forceinline__ float gradient(float, int, int) const { return 1.0f; }
};

// Soft capping (Gemma 2, Grok): the scaled score s becomes
// softcap * tanh(s / softcap), bounded by the cap. In raw-score units, with
// cap = softcap / softmax_scale (VariantParams::softcap): t = cap * tanh(raw / cap),
// whose derivative 1 - tanh^2 = 1 - (t / cap)^2 comes from t alone.
// kPreciseTanh: float32 inputs take tanhf, as exact as their float32
// baseline asks; 16-bit ones one MUFU.TANH (tanh_fast).
template <bool kPreciseTanh>
struct SoftcapScore {
    static constexpr bool kIsIdentity = false;
    static constexpr bool kDropout = false;
    float cap, inverse_cap;

    __device__ __forceinline__ SoftcapScore(const VariantParams& variant, SequenceBounds, index_t, index_t)
        : cap(variant.softcap), inverse_cap(variant.inverse_softcap) {}
    __device__ __forceinline__ float transform(float raw, int, int) const {
        return cap * (kPreciseTanh ? tanhf(raw * inverse_cap) : tanh_fast(raw * inverse_cap));
    }
    __device__ __forceinline__ float gradient(float transformed, int, int) const {
        const float t = transformed * inverse_cap;
        return fmaf(-t, t, 1.0f);
    }
};

// ALiBi (Press et al.) after the `Inner` transform: the scaled score gains
// -slope * |i + seqlen_k - seqlen_q - j| (FlashAttention-2's bias, aligned
// to the bottom-right corner like the masks; under a causal mask the
// distance is the one to the diagonal), the slope that of the block's
// batch entry and head. The bias is added in raw-score units (divided by
// softmax_scale), and the inner transform's derivative is taken at the
// value before it.
template <typename Inner>
struct WithAlibi {
    static constexpr bool kIsIdentity = false;
    static constexpr bool kDropout = false;
    static constexpr bool kAlibi = true;  // the fragment walks take its bias by distance (alibi_bias_at)
    Inner inner;
    float raw_slope;       // slope / softmax_scale, the bias per key of distance
    int diagonal_offset;   // seqlen_k - seqlen_q

    __device__ __forceinline__ WithAlibi(const VariantParams& variant, SequenceBounds bounds, index_t batch,
                                         index_t head)
        : inner(variant, bounds, batch, head),
          raw_slope(variant.alibi_slopes[batch * variant.alibi_batch_stride + head] *
                    variant.inverse_scale),
          diagonal_offset(bounds.seqlen_k - bounds.seqlen_q) {}
    __device__ __forceinline__ float bias(int row, int key) const {
        return -raw_slope * static_cast<float>(abs(row + diagonal_offset - key));
    }
    __device__ __forceinline__ float transform(float raw, int row, int key) const {
        return inner.transform(raw, row, key) + bias(row, key);
    }
    __device__ __forceinline__ float gradient(float transformed, int row, int key) const {
        if constexpr (Inner::kIsIdentity) {
            return 1.0f;
        } else {
            return inner.gradient(transformed - bias(row, key), row, key);
        }
    }
};

// Dropout (dropout.cuh) after the `Inner` transform, which it leaves as it
// is: the score hooks are Inner's, and the kernels drop probabilities where
// kDropout is set (drop_probabilities, probability.cuh's gradients).
template <typename Inner>
struct WithDropout : Inner {
    static constexpr bool kDropout = true;
    DropoutMask dropout;

    __device__ __forceinline__ WithDropout(const VariantParams& variant, SequenceBounds bounds, index_t batch,
                                           index_t head)
        : Inner(variant, bounds, batch, head), dropout(variant, batch, head) {}
};

// Whether a transform is ALiBi's (WithAlibi, or a policy deriving from it):
// a policy without a kAlibi member is not.
CUFLASH_FLAG_TRAIT(HasAlibi, kAlibi);

// Whether a transform's derivative comes from the raw score
// (gradient_from_raw(raw, row, key): user functions, cuflash/mods.py, whose
// value need not determine their derivative) instead of from the
// transformed one: the backward then keeps raw scores and transforms each
// where it takes its probability. A policy without kGradientFromRaw does not.
CUFLASH_FLAG_TRAIT(HasGradientFromRaw, kGradientFromRaw);

// Whether a transform takes the positions as floats too
// (transform(raw, row, key, row_f, key_f): user functions, cuflash/mods.py,
// whose position arithmetic then needs no conversion per score; see
// alibi_bias_at for why that matters). A policy without kFloatPositions does not.
CUFLASH_FLAG_TRAIT(HasFloatPositions, kFloatPositions);

// ALiBi's bias at distance d = row + seqlen_k - seqlen_q - key, d a float.
// Why the fragment walks pass d: along a fragment's row the keys step by
// compile-time constants, so d is one integer-to-float conversion per row
// plus a constant per element, where converting each element's integer
// distance costs a conversion per score on the quarter-rate pipe that also
// runs exp2 and tanh (the soft-capped ALiBi backward measured 1.44x plain
// attention so).
template <typename Score>
__device__ __forceinline__ float alibi_bias_at(const Score& score, float distance) {
    return -score.raw_slope * fabsf(distance);
}

// d transformed / d raw at one score of (row, key): a user function's at
// the raw score (HasGradientFromRaw), ALiBi's inner transform's at the
// transformed value less the bias at `distance` (row + seqlen_k - seqlen_q
// - key as a float: see alibi_bias_at), any other's at the transformed value.
template <typename Score>
__device__ __forceinline__ float transform_derivative(const Score& score, float raw, float transformed, int row,
                                                      int key, float distance) {
    if constexpr (HasGradientFromRaw<Score>::value) {
        return score.gradient_from_raw(raw, row, key);
    } else if constexpr (HasAlibi<Score>::value) {
        if constexpr (decltype(score.inner)::kIsIdentity) {
            return 1.0f;
        } else {
            return score.inner.gradient(transformed - alibi_bias_at(score, distance), row, key);
        }
    } else {
        return score.gradient(transformed, row, key);
    }
}

// Calls f(mt, i, row, first_key) for each fragment row a lane holds of a
// warp's S fragments s[kMTiles][.][4] (rows from row0, keys from key0;
// layout as for_each_fragment_element's): element s[mt][nt][i] is the score
// of (row, first_key + 8 nt). The walks that derive each element's
// position from its row's (ALiBi's distance, float positions) take it.
template <int kMTiles, typename F>
__device__ __forceinline__ void for_each_fragment_row(int row0, int key0, int lane, F&& f) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f(mt, i, fragment_row(row0, mt, i / 2, lane), fragment_col(key0, 0, i % 2, lane));
        }
    }
}

// Transforms a warp's raw S fragments in place (rows from row0, keys from
// key0; element layout as for_each_fragment_element's).
template <typename Score, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_transform(const Score& score, float (&s)[kMTiles][kNTiles][4], int row0,
                                                      int key0, int lane) {
    if constexpr (HasAlibi<Score>::value) {
        for_each_fragment_row<kMTiles>(row0, key0, lane, [&](int mt, int i, int row, int first_key) {
            const float distance0 = static_cast<float>(row + score.diagonal_offset - first_key);
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                s[mt][nt][i] = score.inner.transform(s[mt][nt][i], row, first_key + nt * 8) +
                               alibi_bias_at(score, distance0 - static_cast<float>(nt * 8));
            }
        });
    } else if constexpr (HasFloatPositions<Score>::value) {
        // The positions as floats: one conversion per fragment row and its first key.
        for_each_fragment_row<kMTiles>(row0, key0, lane, [&](int mt, int i, int row, int first_key) {
            const float row_f = static_cast<float>(row), first_key_f = static_cast<float>(first_key);
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                s[mt][nt][i] = score.transform(s[mt][nt][i], row, first_key + nt * 8, row_f,
                                               first_key_f + static_cast<float>(nt * 8));
            }
        });
    } else if constexpr (!Score::kIsIdentity) {
        for_each_fragment_element(s, row0, key0, lane,
                                  [&](float& x, int row, int key) { x = score.transform(x, row, key); });
    }
}

// The same for transposed fragments S^T (rows are keys from key0, columns
// query rows from row0).
template <typename Score, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_transform_transposed(const Score& score, float (&s)[kMTiles][kNTiles][4],
                                                                 int key0, int row0, int lane) {
    if constexpr (HasAlibi<Score>::value) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = fragment_row(key0, mt, i / 2, lane);
                const int first_row = fragment_col(row0, 0, i % 2, lane);
                const float distance0 = static_cast<float>(first_row + score.diagonal_offset - key);
#pragma unroll
                for (int nt = 0; nt < kNTiles; ++nt) {
                    s[mt][nt][i] = score.inner.transform(s[mt][nt][i], first_row + nt * 8, key) +
                                   alibi_bias_at(score, distance0 + static_cast<float>(nt * 8));
                }
            }
        }
    } else if constexpr (!Score::kIsIdentity) {
        for_each_fragment_element(s, key0, row0, lane,
                                  [&](float& x, int key, int row) { x = score.transform(x, row, key); });
    }
}

// Drops and rescales a warp's P fragments (rows from row0, keys from key0:
// see drop_fragments) where the policy has dropout; nothing otherwise.
template <typename Score, int kMTiles, int kNTiles>
__device__ __forceinline__ void drop_probabilities(const Score& score, float (&p)[kMTiles][kNTiles][4], int row0,
                                                   int key0, int lane) {
    if constexpr (Score::kDropout) {
        drop_fragments(score.dropout, p, row0, key0, lane);
    }
}

// The factor of one probability (SIMT kernels): 1 without dropout.
template <typename Score>
__device__ __forceinline__ float dropout_factor(const Score& score, int row, int key) {
    if constexpr (Score::kDropout) {
        return score.dropout.factor(row, key);
    } else {
        return 1.0f;
    }
}

// The transformed score of one element (SIMT kernels).
template <typename Score>
__device__ __forceinline__ float transformed_score(const Score& score, float raw, int row, int key) {
    if constexpr (Score::kIsIdentity) {
        return raw;
    } else {
        return score.transform(raw, row, key);
    }
}

}  // namespace cuflash
