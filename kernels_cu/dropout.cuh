// Dropout on the attention probabilities (FlashAttention's): each P_ij is
// kept with probability 1 - p and then scaled by 1 / (1 - p), or dropped
// (0). It acts after the softmax's row sums, which see every probability,
// and before P V; the backward drops the same entries of P (for dV) and of
// dP (FlashAttention-2's dS = P o (Z o dP / (1 - p) - delta), Z the keep mask).
//
// The mask is a pure function of (seed, offset, batch entry, query head,
// row, key), whatever the tiles, kernel, GPU or stream, so the backward
// regenerates it instead of storing it (cuflash/dropout.py computes the
// same in NumPy, `cuflash.dropout_mask`):
//   stream key   the first two words of Philox(counter = (offset low 32
//                bits, offset high 32 bits, 0, 0), key = seed's two halves)
//   key j's bits Philox(counter = (group, row, head, batch), key = stream
//                key), group = (j / 32) * 4 + (j / 2) % 4: 16-bit value
//                number j % 2 (low half first) of word (j / 8) % 4
//   kept         value >= threshold = round(p * 65536); the launcher's
//                inverse_keep is 65536 / (65536 - threshold), so the
//                output is unbiased for the p actually applied.
// Why that grouping: an mma / wgmma accumulator lane holds keys
// 8t + 2 (lane % 4) + {0, 1} of each n8 tile t, so one Philox call gives a
// lane every value it needs of one row over four n8 tiles.
// Host code compiles it too (tests/test_dropout.py runs it on the CPU).
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "philox.cuh"

namespace cuflash {

struct DropoutMask {
    u32 stream_key0, stream_key1;
    u32 head, batch;
    u32 threshold;
    float inverse_keep;

    CUFLASH_HOST_DEVICE DropoutMask(const VariantParams& variant, index_t batch_entry, index_t query_head)
        : head(static_cast<u32>(query_head)),
          batch(static_cast<u32>(batch_entry)),
          threshold(static_cast<u32>(variant.dropout_threshold)),
          inverse_keep(variant.dropout_inverse_keep) {
        const unsigned long long seed =
            variant.dropout_seed_pointer != nullptr ? *variant.dropout_seed_pointer : variant.dropout_seed;
        const unsigned long long offset = variant.dropout_offset;
        const PhiloxWords stream = philox4x32_10({static_cast<u32>(offset), static_cast<u32>(offset >> 32), 0u, 0u},
                                                 static_cast<u32>(seed), static_cast<u32>(seed >> 32));
        stream_key0 = stream.x;
        stream_key1 = stream.y;
    }

    // The four words of the group of `key` in `row`.
    CUFLASH_HOST_DEVICE PhiloxWords words(int row, int key) const {
        const u32 group = static_cast<u32>(key >> 5) * 4u + static_cast<u32>((key >> 1) & 3);
        return philox4x32_10({group, static_cast<u32>(row), head, batch}, stream_key0, stream_key1);
    }
    CUFLASH_HOST_DEVICE static u32 word(const PhiloxWords& w, int index) {
        return index == 0 ? w.x : index == 1 ? w.y : index == 2 ? w.z : w.w;
    }
    // The factor of a 16-bit draw: inverse_keep or 0.
    CUFLASH_HOST_DEVICE float factor_of(u32 value) const { return value >= threshold ? inverse_keep : 0.0f; }
    // The factor of a key from its group's words.
    CUFLASH_HOST_DEVICE float factor(const PhiloxWords& w, int key) const {
        return factor_of((word(w, (key >> 3) & 3) >> (16 * (key & 1))) & 0xffffu);
    }
    CUFLASH_HOST_DEVICE float factor(int row, int key) const { return factor(words(row, key), key); }
};

// Drops the entries of a warp's P fragments p[kMTiles][kNTiles][4] (layout
// in mma.cuh; rows from row0, keys from key0, a multiple of 8, and of 32
// where kNTiles is a multiple of 4) and scales the kept ones: one Philox
// call per row and four n8 tiles (per n8 tile where they are fewer). With
// key0 so aligned, n8 tile nt's word is nt % 4 and a lane's two keys are the
// low and high halves: known at compile time, no per-element selects.
template <int kMTiles, int kNTiles>
CUFLASH_HOST_DEVICE void drop_fragments(const DropoutMask& mask, float (&p)[kMTiles][kNTiles][4], int row0,
                                               int key0, int lane) {
    constexpr bool kWholeGroups = kNTiles % 4 == 0;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = row0 + mt * 16 + lane / 4 + half * 8;
            PhiloxWords w;
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                const int key = key0 + nt * 8 + 2 * (lane % 4);
                if (!kWholeGroups || nt % 4 == 0) {
                    w = mask.words(row, key);
                }
                const u32 pair = DropoutMask::word(w, kWholeGroups ? nt % 4 : (key >> 3) & 3);
                p[mt][nt][2 * half] *= mask.factor_of(pair & 0xffffu);
                p[mt][nt][2 * half + 1] *= mask.factor_of(pair >> 16);
            }
        }
    }
}

// The keep factors of one lane's two keys key and key + 8 (key0 + lane / 4
// of a 16-aligned m16 tile of keys: one group) in query row `row`, for
// transposed fragments S^T (backward).
struct KeyPairFactors {
    float first, second;
};

CUFLASH_HOST_DEVICE KeyPairFactors key_pair_factors(const DropoutMask& mask, int row, int key) {
    const PhiloxWords w = mask.words(row, key);
    return {mask.factor(w, key), mask.factor(w, key + 8)};
}

}  // namespace cuflash
