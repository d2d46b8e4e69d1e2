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

}  // namespace cuflash
