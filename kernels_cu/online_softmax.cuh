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
#include "mma.cuh"  // pack_a_fragments, a_fragment_register
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

// The same online softmax for scores held in mma.m16n8k16 accumulator
// fragments s[kMTiles][kNTiles][4] (see mma.cuh): a lane holds two rows per
// m16 tile (elements 0-1 of each n8 tile for row `group`, 2-3 for row
// `group + 8`), and the 4 lanes of a quad share each row.
//
// Two differences from OnlineSoftmax, both for speed:
// - The scale is folded into the exponent with one fused multiply-add,
//   p = exp2(s * scale_log2 - reference), on raw scores s = q.k. The max of
//   raw scores times scale_log2 is the max of the scaled scores only for
//   scale_log2 > 0; the launcher sends other scales to the SIMT kernel.
// - The reference subtracted in the exponent is the running max only up to
//   kRescaleSlack: it moves (with a rescale factor other than 1) only when a
//   block's max exceeds it by more than that. Any reference gives the same
//   O / l; a stale one only lets p grow to 2^kRescaleSlack, harmless in
//   float32 sums and in the float16/bfloat16 P of P V, and after the first
//   blocks the factors are almost always exactly 1.
template <int kMTiles>
struct FragmentOnlineSoftmax {
    static constexpr int kRows = 2 * kMTiles;  // row r: m16 tile r / 2, half r % 2
    static constexpr float kRescaleSlack = 8.0f;
    float reference[kRows];    // log2 domain; -inf while no visible key was seen
    float partial_sum[kRows];  // this lane's share of l = sum of exp2(score - reference)

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            reference[r] = negative_infinity();
            partial_sum[r] = 0.0f;
        }
    }

    // Turns the block's raw scores (masked ones -inf) into unnormalised
    // probabilities in place and writes per row the factor by which the
    // output accumulated so far must be scaled. A row's reference moves to
    // the block's max when that exceeds it by more than `slack`.
    template <int kNTiles>
    __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                           float (&rescale)[kRows], float slack = kRescaleSlack) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            const int mt = r / 2, half = r % 2;
            float block_max = negative_infinity();
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                block_max = fmaxf(block_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
            }
            const float candidate = group_allreduce_max<4>(block_max) * scale_log2;
            rescale[r] = 1.0f;
            // -inf > anything is false: a fully masked block never moves the reference.
            if (candidate > reference[r] + slack) {
                // exp2(-inf) = 0 on the first visible block: nothing accumulated yet.
                rescale[r] = exp2_fast(reference[r] - candidate);
                reference[r] = candidate;
            }
            // While every key seen so far is masked the reference is -inf and
            // -inf - (-inf) would be NaN; subtracting 0 keeps exp2(-inf) = 0.
            const float subtract = reference[r] == negative_infinity() ? 0.0f : reference[r];
            float block_sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float& x = s[mt][nt][2 * half + e];
                    x = exp2_fast(fmaf(x, scale_log2, -subtract));
                    block_sum += x;
                }
            }
            // Summed over the quad once at the end, not once per block.
            partial_sum[r] = partial_sum[r] * rescale[r] + block_sum;
        }
    }

    // update() and the packing of P (the A operand of P V, k step ps from
    // n8 tiles 2 ps and 2 ps + 1, see pack_a_fragments) in one pass, for one
    // m16 row tile (wgmma: a warp's 16 rows of a consumer's 64). The usual
    // block moves no reference: its scores stay below reference +
    // kRescaleSlack. That is known without the rows' maxima: every p is
    // positive, so a lane's block sum of p = exp2(score - reference) at most
    // 2^kRescaleSlack bounds each of its p by it. So each lane first computes
    // and packs P against the references it has, and only if a lane of the
    // warp finds a sum above the bound (or a reference still -inf, or a NaN,
    // which fails the comparison) does the warp take update()'s path (maxima,
    // quad shuffles) on the scores, which are left intact for it. The fast
    // path spares a warp the maxima (an FMNMX a score) and the shuffles
    // between the scores landing and the exponentials. The maxima's path
    // moves a reference to any larger block max (slack 0): a reference left
    // a few units low (a causal row's first block sees only a few keys) would
    // keep its lanes' sums above the bound and the warp on that path.
    template <typename Element, int kNTiles>
    __device__ __forceinline__ void update_and_pack(float (&s)[1][kNTiles][4], float scale_log2,
                                                    float (&rescale)[kRows], u32 (&p)[kNTiles / 2][4]) {
        static_assert(kMTiles == 1 && kNTiles % 2 == 0, "one m16 row tile, whole k16 steps of P V");
        constexpr float kLargestP = float(1 << int(kRescaleSlack));
        if (__all_sync(0xffffffffu, reference[0] != negative_infinity() && reference[1] != negative_infinity())) {
            float block_sum[kRows] = {0.0f, 0.0f};
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const float p0 = exp2_fast(fmaf(s[0][nt][2 * half], scale_log2, -reference[half]));
                    const float p1 = exp2_fast(fmaf(s[0][nt][2 * half + 1], scale_log2, -reference[half]));
                    block_sum[half] += p0 + p1;
                    p[nt / 2][a_fragment_register(nt % 2, half)] = pack_pair<Element>(p0, p1);
                }
            }
            if (__all_sync(0xffffffffu, block_sum[0] <= kLargestP && block_sum[1] <= kLargestP)) {
#pragma unroll
                for (int r = 0; r < kRows; ++r) {
                    rescale[r] = 1.0f;
                    partial_sum[r] += block_sum[r];
                }
                return;
            }
        }
        update(s, scale_log2, rescale, 0.0f);
        pack_a_fragments<Element>(p, s[0]);
    }

    // l of row r, on every lane of the quad.
    __device__ __forceinline__ float row_sum(int r) const { return group_allreduce_sum<4>(partial_sum[r]); }

    // Natural-log log-sum-exp of row r's scaled scores; -inf for a row that saw no key.
    __device__ __forceinline__ float log_sum_exp(int r, float sum) const {
        return sum > 0.0f ? (reference[r] + log2f(sum)) * kLn2 : negative_infinity();
    }
};

}  // namespace cuflash
