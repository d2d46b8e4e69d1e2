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
// warp that saw no key of the row, so -inf - -inf never arises).
//
// The merge is spread over every thread of the block: one warp merging and
// writing the block alone ran about 2000 instructions in a row, most of a
// decoding call's time after its key loop (4 us of 14 measured on the
// H100). Each thread takes every kWarps-th (m16 tile, n8 tile of d) group of
// fragments, starting at its warp, of the lane it is, and adds the warps'
// fragments of it scaled by the rows' factors (weight / merged sum).
//
// `buffer`: shared memory for kBytes, free for the taking (every warp past
// its last read of it); other threads may still read it when merge
// returns (a barrier before it is overwritten).
template <int kBlockM, int kHeadDim, int kWarps>
struct WarpStateMerge {
    static constexpr int kMTiles = kBlockM / 16;
    static constexpr int kDTiles = kHeadDim / 8;
    static constexpr int kGroups = kMTiles * kDTiles;           // float4 fragment groups a lane holds
    static constexpr int kGroupsPerThread = (kGroups + kWarps - 1) / kWarps;
    static constexpr int kReferences = 0;                        // float [kWarps][kBlockM]
    static constexpr int kSums = kReferences + kWarps * kBlockM;  // float [kWarps][kBlockM]
    static constexpr int kFactors = kSums + kWarps * kBlockM;     // float [kWarps][kBlockM]: weight / merged sum
    static constexpr int kFragments = kFactors + kWarps * kBlockM;  // float4 [kWarps][kGroups][32 lanes]
    static constexpr int kBytes = (kFragments + kWarps * kGroups * 32 * 4) * 4;
    static_assert(kBlockM % 16 == 0 && kHeadDim % 8 == 0, "whole m16 and n8 tiles");
    static_assert(kFragments % 4 == 0, "16-byte aligned fragments");

    // This thread's merged fragments: group warp + j kWarps, (x, y) of row
    // group, (z, w) of row group + 8, normalised.
    float4 merged[kGroupsPerThread];
    // Thread t < kBlockM: row t's natural-log log-sum-exp (-inf where no warp saw a key).
    float lse = 0.0f;

    __device__ __forceinline__ void merge(const FragmentOnlineSoftmax<kMTiles>& softmax,
                                          const float (&o)[kMTiles][kDTiles][4], float* buffer, int warp, int lane) {
        const int group = lane / 4, quad = lane % 4;
#pragma unroll
        for (int r = 0; r < 2 * kMTiles; ++r) {
            const float sum = softmax.row_sum(r);
            if (quad == 0) {
                const int row = r / 2 * 16 + r % 2 * 8 + group;
                buffer[kReferences + warp * kBlockM + row] = softmax.reference[r];
                buffer[kSums + warp * kBlockM + row] = sum;
            }
        }
        float4* fragments = reinterpret_cast<float4*>(buffer + kFragments);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt) {
                fragments[(warp * kGroups + mt * kDTiles + dt) * 32 + lane] =
                    make_float4(o[mt][dt][0], o[mt][dt][1], o[mt][dt][2], o[mt][dt][3]);
            }
        }
        __syncthreads();
        // One thread a row: the warps' factors and the row's log-sum-exp.
        const int thread = warp * 32 + lane;
        if (thread < kBlockM) {
            float largest = negative_infinity();
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                largest = fmaxf(largest, buffer[kReferences + w * kBlockM + thread]);
            }
            float weight[kWarps];
            float total = 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float reference = buffer[kReferences + w * kBlockM + thread];
                weight[w] = reference == negative_infinity() ? 0.0f : exp2_fast(reference - largest);
                total += buffer[kSums + w * kBlockM + thread] * weight[w];
            }
            // A row that saw no key has sum 0: its output is 0, not 0 / 0.
            const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                buffer[kFactors + w * kBlockM + thread] = weight[w] * inv_total;
            }
            lse = total > 0.0f ? (largest + log2f(total)) * kLn2 : negative_infinity();
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < kGroupsPerThread; ++j) {
            const int g = warp + j * kWarps;
            merged[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (kGroups % kWarps == 0 || g < kGroups) {
                const int row = g / kDTiles * 16 + group;
#pragma unroll
                for (int w = 0; w < kWarps; ++w) {
                    const float4 f = fragments[(w * kGroups + g) * 32 + lane];
                    const float upper = buffer[kFactors + w * kBlockM + row];
                    const float lower = buffer[kFactors + w * kBlockM + row + 8];
                    // A warp that saw no key of a row has factor 0 (and fragments 0).
                    merged[j].x = fmaf(f.x, upper, merged[j].x);
                    merged[j].y = fmaf(f.y, upper, merged[j].y);
                    merged[j].z = fmaf(f.z, lower, merged[j].z);
                    merged[j].w = fmaf(f.w, lower, merged[j].w);
                }
            }
        }
    }

    // row_lse(row, lse) for the row this thread holds the log-sum-exp of, if any.
    template <typename RowLse>
    __device__ __forceinline__ void for_each_row_lse(int thread, RowLse&& row_lse) const {
        if (thread < kBlockM) {
            row_lse(thread, lse);
        }
    }

    // stage(row, col, float2): this thread's merged pairs, columns col and
    // col + 1 of rows inside the block (every pair of the block is handed to
    // exactly one thread).
    template <typename Stage>
    __device__ __forceinline__ void for_each_pair(int warp, int lane, Stage&& stage) const {
        const int group = lane / 4, quad = lane % 4;
#pragma unroll
        for (int j = 0; j < kGroupsPerThread; ++j) {
            const int g = warp + j * kWarps;
            if (kGroups % kWarps == 0 || g < kGroups) {
                const int row = g / kDTiles * 16 + group, col = g % kDTiles * 8 + 2 * quad;
                stage(row, col, make_float2(merged[j].x, merged[j].y));
                stage(row + 8, col, make_float2(merged[j].z, merged[j].w));
            }
        }
    }
};

}  // namespace cuflash
