// What the tensor-core forwards write at the end: each row's output
// normalised by its softmax sum, and its log-sum-exp.
#pragma once

#include "numeric.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"

namespace cuflash {

// A lane's two adjacent output elements as the epilogue stages them: one
// register of two 16-bit values, or two floats.
template <typename Element>
struct StagedPair {
    using Type = u32;
    static __device__ __forceinline__ Type make(float lo, float hi) { return pack_pair<Element>(lo, hi); }
};

template <>
struct StagedPair<float> {
    using Type = float2;
    static __device__ __forceinline__ Type make(float lo, float hi) { return make_float2(lo, hi); }
};

// Normalises a warp's output accumulators o[kMTiles][kDTiles][4] (mma
// layout, rows from warp_row0 inside the block) by the rows' softmax sums,
// writes the log-sum-exp of the rows that exist (first_row + row <
// seqlen_q) to lse_row, and hands every normalised pair, as Element
// (StagedPair), to stage(row_in_block, dt, pair) (the lane's pair of n8 tile
// dt), which puts it where the kernel's coalesced store picks it up.
template <typename Element, int kMTiles, int kDTiles, typename Stage>
__device__ __forceinline__ void finish_forward_rows(const FragmentOnlineSoftmax<kMTiles>& softmax,
                                                    const float (&o)[kMTiles][kDTiles][4], float* lse_row,
                                                    int first_row, int warp_row0, int seqlen_q, int lane,
                                                    Stage&& stage) {
    const int group = lane / 4, quad = lane % 4;
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) {
        const int mt = r / 2, half = r % 2;
        const float sum = softmax.row_sum(r);
        // A row that saw no key has sum 0: its output is 0, not 0 / 0.
        const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
        const int row_in_block = warp_row0 + mt * 16 + half * 8 + group;
        if (quad == 0 && first_row + row_in_block < seqlen_q) {
            lse_row[first_row + row_in_block] = softmax.log_sum_exp(r, sum);
        }
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
            stage(row_in_block, dt,
                  StagedPair<Element>::make(o[mt][dt][2 * half] * inv_sum, o[mt][dt][2 * half + 1] * inv_sum));
        }
    }
}

// kWarpsSplitKeys (MmaForwardTraits): each warp holds the softmax state and
// output of all kBlockM rows over its own share of the keys. Merged as
// split-KV's partial results are (merge_states.cu), but by each row's
// reference rather than a log-sum-exp: with m the largest reference of a
// row, warp w's output and sum count exp2(reference_w - m) times (0 for a
// warp that saw no key of the row, so -inf - -inf never arises), and warp 0
// ends with the row's sum of them and reference m, as if it had seen every
// key. `buffer`: shared memory for kWarps * kBlockM * (kHeadDim + 2) floats,
// free for the taking (every warp past its last read of it); the caller
// lets warp 0 go on alone.
template <int kBlockM, int kHeadDim, int kWarps, int kMTiles, int kDTiles>
__device__ __forceinline__ void combine_warp_states(FragmentOnlineSoftmax<kMTiles>& softmax,
                                                    float (&o)[kMTiles][kDTiles][4], float* buffer, int warp,
                                                    int lane) {
    static_assert(kBlockM == 16 * kMTiles && kHeadDim == 8 * kDTiles, "every warp holds the block's rows");
    constexpr int kRows = 2 * kMTiles;
    constexpr int kFragments = kMTiles * kDTiles * 4;
    float* references = buffer;          // [kWarps][kBlockM]
    float* sums = buffer + kWarps * kBlockM;  // [kWarps][kBlockM]
    float* outputs = sums + kWarps * kBlockM;  // [kWarps][kFragments][32]: each lane's fragments
    const int group = lane / 4, quad = lane % 4;
    const auto row_of = [&](int r) { return r / 2 * 16 + r % 2 * 8 + group; };
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        const float sum = softmax.row_sum(r);
        if (quad == 0) {
            references[warp * kBlockM + row_of(r)] = softmax.reference[r];
            sums[warp * kBlockM + row_of(r)] = sum;
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        float largest = negative_infinity();
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            largest = fmaxf(largest, references[w * kBlockM + row_of(r)]);
        }
        const auto weight = [&](float reference) {
            return reference == negative_infinity() ? 0.0f : exp2_fast(reference - largest);
        };
        const float own = weight(softmax.reference[r]);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
            o[r / 2][dt][2 * (r % 2)] *= own;
            o[r / 2][dt][2 * (r % 2) + 1] *= own;
        }
        if (warp == 0) {
            float total = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                total += sums[w * kBlockM + row_of(r)] * weight(references[w * kBlockM + row_of(r)]);
            }
            softmax.reference[r] = largest;
            softmax.partial_sum[r] = quad == 0 ? total : 0.0f;  // row_sum adds the quad's shares
        }
    }
    // The fragments as one array (unrolled: constant indices, registers).
    float* fragments = &o[0][0][0];
    if (warp != 0) {
#pragma unroll
        for (int f = 0; f < kFragments; ++f) {
            outputs[(warp * kFragments + f) * 32 + lane] = fragments[f];
        }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int w = 1; w < kWarps; ++w) {
#pragma unroll
            for (int f = 0; f < kFragments; ++f) {
                fragments[f] += outputs[(w * kFragments + f) * 32 + lane];
            }
        }
    }
}

}  // namespace cuflash
