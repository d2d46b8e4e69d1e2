// Score transforms: a function applied to every raw score q.k of the
// visible part of the score matrix before the mask and the softmax, and its
// derivative, which every backward multiplies into dS.
//
// A transform is a small struct built per thread block from the launch's
// parameters, with
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
// cuflash/_masks.py's SCORE_TRANSFORMS lists them for the launcher and the
// float64 references (docs/kernel-policies.md).
#pragma once

#include "masks.cuh"

namespace cuflash {

struct IdentityScore {
    static constexpr bool kIsIdentity = true;

    template <typename Params>
    __device__ __forceinline__ explicit IdentityScore(const Params&) {}
    __device__ __forceinline__ float transform(float raw, int, int) const { return raw; }
    __device__ __forceinline__ float gradient(float, int, int) const { return 1.0f; }
};

// Transforms a warp's raw S fragments in place (rows from row0, keys from key0).
template <typename Score, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_transform(const Score& score, float (&s)[kMTiles][kNTiles][4], int row0,
                                                      int key0, int lane) {
    if constexpr (!Score::kIsIdentity) {
        for_each_fragment_element(s, row0, key0, lane,
                                  [&](float& x, int row, int key) { x = score.transform(x, row, key); });
    }
}

// The same for transposed fragments S^T (rows are keys from key0, columns query rows from row0).
template <typename Score, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_score_transform_transposed(const Score& score, float (&s)[kMTiles][kNTiles][4],
                                                                 int key0, int row0, int lane) {
    if constexpr (!Score::kIsIdentity) {
        for_each_fragment_element(s, key0, row0, lane,
                                  [&](float& x, int key, int row) { x = score.transform(x, row, key); });
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
