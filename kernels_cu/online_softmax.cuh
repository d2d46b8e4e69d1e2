// Online (streaming) softmax state of one query row.
//
// Keys arrive one block at a time. The row keeps the running maximum m of its
// scores and the running sum l of exp(score - m); when a block raises the
// maximum, everything accumulated so far (l and the output accumulator) is
// multiplied by exp(m_old - m_new), so the final O / l equals softmax(S) V
// exactly, whatever the order of blocks.
//
// Scores are in the log2 domain: score = (q . k) * softmax_scale * log2(e), so
// exp(x * scale) becomes exp2(score) with the scale folded into one multiply.
#pragma once

#include "numeric.cuh"
#include "warp_reduce.cuh"

namespace cuflash {

template <int kThreadsPerRow>
struct OnlineSoftmax {
    float row_max;      // max over every visible score seen so far; -inf while none was visible
    float partial_sum;  // this lane's share of l = sum of exp2(score - row_max)

    __device__ __forceinline__ void init() {
        row_max = negative_infinity();
        partial_sum = 0.0f;
    }

    // Takes this lane's kN scores of a new key block (masked ones are -inf),
    // turns them in place into unnormalised probabilities exp2(score - max),
    // and returns the factor by which the row's output accumulator must be
    // scaled before this block's contribution is added.
    template <int kN>
    __device__ __forceinline__ float update(float (&scores)[kN]) {
        float block_max = scores[0];
#pragma unroll
        for (int j = 1; j < kN; ++j) {
            block_max = fmaxf(block_max, scores[j]);
        }
        block_max = group_allreduce_max<kThreadsPerRow>(block_max);
        const float new_max = fmaxf(row_max, block_max);
        // While every key seen so far is masked, new_max is -inf, and
        // score - new_max would be (-inf) - (-inf) = NaN. Subtracting 0 instead
        // keeps exp2(-inf - 0) = 0 for the masked scores, as it should be.
        const float reference = new_max == negative_infinity() ? 0.0f : new_max;
        // exp2(-inf) = 0 on the first visible block: nothing accumulated yet.
        const float rescale = exp2f(row_max - reference);
        float block_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            scores[j] = exp2f(scores[j] - reference);
            block_sum += scores[j];
        }
        // Each lane keeps its own partial sum; the lanes of a row are summed
        // once at the end (row_sum), not once per block.
        partial_sum = partial_sum * rescale + block_sum;
        row_max = new_max;
        return rescale;
    }

    // l for the whole row, on every lane of the row.
    __device__ __forceinline__ float row_sum() const {
        return group_allreduce_sum<kThreadsPerRow>(partial_sum);
    }

    // Natural-log log-sum-exp of the row's scaled scores: ln(sum_j exp(scale * q.k_j)).
    // A row that saw no key has l == 0 and gets -inf, the log of an empty sum.
    __device__ __forceinline__ float log_sum_exp(float sum) const {
        return sum > 0.0f ? (row_max + log2f(sum)) * kLn2 : negative_infinity();
    }
};

}  // namespace cuflash
