// What the tensor-core backward kernels (flash_bwd_wgmma.cu on Hopper,
// flash_bwd_mma.cu on sm_80+) do around their products, in their common
// transposed form (a warp's accumulator rows are keys, its columns queries):
// the walk over query blocks, the row statistics of a query block, and P^T
// and dS^T from S^T and dP^T.
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "block_info.cuh"
#include "masks.cuh"
#include "score_transforms.cuh"
#include "probability.cuh"
#include "mma.cuh"            // stmatrix_x4
#include "swizzled_tile.cuh"  // SwizzledLaneRow

namespace cuflash {

// The steps of one key block: every visible query block of every query head
// sharing its K/V head, head by head, advanced without divisions. Each head's
// query blocks [begin, end) are walked in a circle from begin + rotation:
// rotated walks (walk_rotation, dq_turn) start every key block on a
// different query block. A mask with a tile map walks the query tiles its
// map lists for the key block and head instead (the specialisation below);
// the deduction guide picks the walk from the mask's type.
template <bool kTileMapped>
struct QueryBlockWalk {
    int begin, end;  // the query blocks of each head
    int last;        // the walk's last query block of each head
    int steps;
    index_t head;
    int m_block;

    // `rotation` < the number of query blocks the key block sees (0 when it sees none).
    template <typename Mask>
    __device__ __forceinline__ QueryBlockWalk(const Mask& mask, const KeyBlock& block, int block_n, int block_m,
                                              int rotation) {
        const BlockRange range = mask.query_blocks(block.n_start, block_n, block_m);
        begin = range.begin;
        end = max(range.begin, range.end);
        m_block = begin + rotation;
        last = (m_block == begin ? end : m_block) - 1;
        steps = static_cast<int>(block.group) * (end - begin);
        head = block.first_head;
    }

    // The head and query block of the step after this one.
    __device__ __forceinline__ void following(index_t& next_head, int& next_m_block) const {
        next_head = m_block == last ? head + 1 : head;
        next_m_block = m_block + 1 == end ? begin : m_block + 1;
    }

    // Moves on to the step after this one (following reads m_block before it
    // writes it, and writes head first from values it has already read).
    __device__ __forceinline__ void advance() {
        following(head, m_block);
    }

    // Moves on to the step after this one, which `following` gave earlier.
    __device__ __forceinline__ void move_to(index_t next_head, int next_m_block) {
        head = next_head;
        m_block = next_m_block;
    }
};

// With a tile map: each head's listed query tiles of this key tile, in
// ascending order (the map's tiles are the kernel's), heads without any
// passed over. No rotation: the map's dQ order is key-block order. The
// query tile of the step after the current one is read a step ahead
// (`upcoming`), so moving on waits for no load within a head. Few values:
// the Hopper consumers keep them beside their accumulators.
template <>
struct QueryBlockWalk<true> {
    const int* lists;  // the first head's list of this key tile's query tiles
    int count_offset;  // from a head's list to its count
    int head_stride;   // between heads' sections (0: one shared)
    int heads_left;    // after this one
    int section;       // this head's section, from the first head's
    int position, count;  // in this head's list
    int steps;
    index_t head;
    int m_block;
    int upcoming;  // the query tile of the step after this one (where there is one)

    template <typename Mask>
    __device__ __forceinline__ QueryBlockWalk(const Mask& mask, const KeyBlock& block, int, int, int) {
        const TileMap map = mask.map();
        const TileSection first = map.of_head(block.first_head);
        lists = first.base + 3 * first.m_tiles * first.n_tiles + block.n_block * first.m_tiles;
        count_offset = static_cast<int>(first.base + 4 * first.m_tiles * first.n_tiles + first.m_tiles +
                                        block.n_block - lists);
        head_stride = static_cast<int>(map.head_stride);
        steps = 0;
        for (int h = 0; h < static_cast<int>(block.group); ++h) {
            steps += lists[h * head_stride + count_offset];
        }
        head = block.first_head - 1;  // before the first head: the first step is the one after
        heads_left = static_cast<int>(block.group);
        section = -head_stride;
        position = -1;
        count = 0;
        next(head, heads_left, section, position, count);
        m_block = tile_at(heads_left, section, position);
        upcoming = tile_after(head, heads_left, section, position, count);
    }

    // The place in the lists after the given one (a list of cnt tiles).
    __device__ __forceinline__ void next(index_t& h, int& left, int& sec, int& pos, int& cnt) const {
        if (++pos < cnt) {
            return;
        }
        pos = 0;
        do {
            ++h;
            sec += head_stride;
            cnt = left > 0 ? lists[sec + count_offset] : 0;
            --left;
        } while (cnt == 0 && left >= 0);
    }

    // The tile at a place (0 past the last head).
    __device__ __forceinline__ int tile_at(int left, int sec, int pos) const { return left >= 0 ? lists[sec + pos] : 0; }

    __device__ __forceinline__ int tile_after(index_t h, int left, int sec, int pos, int cnt) const {
        next(h, left, sec, pos, cnt);
        return tile_at(left, sec, pos);
    }

    __device__ __forceinline__ void following(index_t& next_head, int& next_m_block) const {
        index_t h = head;
        int left = heads_left, sec = section, pos = position, cnt = count;
        next(h, left, sec, pos, cnt);
        next_head = h;
        next_m_block = upcoming;
    }

    __device__ __forceinline__ void advance() {
        next(head, heads_left, section, position, count);
        m_block = upcoming;
        upcoming = tile_after(head, heads_left, section, position, count);
    }

    // Moves on to the step after this one, which `following` gave earlier
    // (the place in the lists moves on with it).
    __device__ __forceinline__ void move_to(index_t, int) { advance(); }
};

template <typename Mask>
QueryBlockWalk(const Mask&, const KeyBlock&, int, int, int) -> QueryBlockWalk<HasTileMap<Mask>::value>;

// Ordered dQ (ordered_accumulation.cuh): the turn of key block n_block
// among the key blocks that add into dQ block m_block, in the mask's order
// (DqTurns in masks.cuh). The orders follow the walks: the key block before
// this one in a dQ block's order reached that block at an earlier step of
// its own walk, so in steady state nobody waits.
//  - kLastKeyFirst: the last key block the query block sees goes first, then
//    each earlier one. Each key block walks from the first query block that
//    sees it (where its turn is 0, or small where later key blocks are first
//    seen by the same query block); key block j waits only for j + 1, which
//    reached the query block no later in its own walk, and the grid
//    dispatches the last key blocks first (key_block<true>), so every
//    awaited block was dispatched earlier.
//  - kRotated, with params.rotate_walks (num_m_blocks >= num_n_blocks): key
//    block j starts on query block j; the key blocks reach query block i in
//    the order j = i, i - 1, ..., wrapping round through the last key block,
//    and that is their order. Key block 0 waits for the last one, so one
//    head's key blocks must all be running at once: the launcher rotates
//    only where they fit (cuflash/api.py, rotate_walks).
//  - Otherwise key-block order: every walk starts on its first query block,
//    and key block j waits there for each block before it.
//  - A mask with a tile map: key-block order among the key tiles its map
//    lists for the query tile (the tile's key_rank), for query head `head`.
template <typename Mask>
__device__ __forceinline__ int dq_turn(const Mask& mask, const BackwardParams& params, index_t head, int m_block,
                                       int n_block, int block_m, int block_n) {
    if constexpr (HasTileMap<Mask>::value) {
        // Key-block order among the key tiles the map lists for the query
        // tile: the skipped ones take no turn.
        return mask.map().of_head(head).key_rank(m_block, n_block);
    }
    const BlockRange keys = mask.key_blocks(m_block * block_m, block_m, block_n);
    if constexpr (Mask::kDqTurns == DqTurns::kLastKeyFirst) {
        return keys.end - 1 - n_block;
    } else {
        if (Mask::kDqTurns == DqTurns::kRotated && params.rotate_walks) {
            // Steps key block n_block takes to reach m_block; the key blocks
            // that reach it sooner started on the query blocks
            // (n_block, n_block + steps], counted round the circle. The
            // counts are the grid's, which are every batch entry's in a
            // dense batch (the launcher does not rotate packed batches).
            const int num_m_blocks = static_cast<int>(params.num_m_blocks);
            const int last_key_block = static_cast<int>(params.num_n_blocks) - 1;
            const int steps = m_block >= n_block ? m_block - n_block : m_block - n_block + num_m_blocks;
            const int reach = n_block + steps;
            return min(reach, last_key_block) - n_block + max(0, reach - num_m_blocks + 1);
        }
        return n_block - keys.begin;
    }
}

// The first query block of key block n_block's walk, counted from the first
// it sees (QueryBlockWalk's rotation): its own index where dq_turn rotates.
template <typename Mask>
__device__ __forceinline__ int walk_rotation(const BackwardParams& params, int n_block) {
    return Mask::kDqTurns == DqTurns::kRotated && params.rotate_walks ? n_block : 0;
}

// Stores one warp's P^T or dS^T, packed to 16 bits as A fragments
// (pack_a_fragment: frags[j / 2] holds n8 query tiles j and j + 1), into a
// shared tile of keys x queries: 16 rows from key0, kQTiles n8 tiles of
// columns from query0. chunk_offset(row, chunk) is the byte offset of a
// row's 16-byte chunk (8 queries): padded rows or a swizzle.
template <int kQTiles, typename ChunkOffset>
__device__ __forceinline__ void stage_transposed_fragments(unsigned char* tile, const u32 (&frags)[kQTiles / 2][4],
                                                           int key0, int query0, int lane,
                                                           const ChunkOffset& chunk_offset) {
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int key_row = key0 + lane / 4 + half * 8;
            *reinterpret_cast<u32*>(tile + chunk_offset(key_row, query0 / 8 + j) + 4 * (lane % 4)) =
                frags[j / 2][(j % 2) * 2 + half];
        }
    }
}

// The same into a SwizzledTile at shared address `tile` (1024-aligned), a
// pair of n8 query tiles (one A fragment: four 8 x 8 matrices) per stmatrix:
// a quarter of the stores, and each lane's address is one add and one XOR on
// SwizzledLaneRow's, computed where it is stored. Precomputed, the 16
// per-lane addresses of the 32-bit stores were live beside S^T and dP^T and
// made the 128-query tiles spill.
template <typename Tile, int kQTiles>
__device__ __forceinline__ void stage_swizzled_fragments(u32 tile, const u32 (&frags)[kQTiles / 2][4], int key0,
                                                         int query0, int lane) {
    // Matrix lane / 8 of a fragment: rows + 8 (lane / 8 % 2), chunk + lane / 16.
    const SwizzledLaneRow<Tile> lane_row(lane % 8 + lane / 8 % 2 * 8, lane / 16);
#pragma unroll
    for (int ps = 0; ps < kQTiles / 2; ++ps) {
        stmatrix_x4(lane_row.address(tile, key0, query0 / 8 + 2 * ps), frags[ps]);
    }
}

// LSE (in the log2 domain) and delta of the kBlockM query rows from m_start
// of `head` of the sequence at `rows` into stats[0, kBlockM) and
// stats[kBlockM, 2 kBlockM), by plain stores; rows past its seqlen_q get 0
// (they are masked). `thread` < kThreads. kWrittenOut (the Hopper kernel's
// load warp: 32 threads, 64 or 128 rows) writes out the rounds where there
// are two or fewer: as a loop from `thread` the compiler does not know the
// count and emits an unrolled loop and its remainder, whose counters
// spilled 8 bytes from that warp's 24 registers (64 rows: the narrowed head
// dim 112, claimed dQ). Four rounds stay a loop (written out, their loads in
// flight at once spilled there: 128 rows, head dim 64, causal), and so does
// the mma.sync kernel's single round (written out, its 255-register
// variants spilled 4-16 bytes). kLoadsDelta false: LSE alone (the Hopper
// kernel's direct dQ mode computes delta itself, and there is no delta buffer).
template <int kBlockM, int kThreads, bool kWrittenOut = false, bool kLoadsDelta = true>
__device__ __forceinline__ void load_row_statistics(float* stats, const BackwardParams& params,
                                                    const SequenceRows& rows, index_t head, int m_start, int thread) {
    const float* lse_row = params.lse_row(rows.tensor_batch, head) + rows.q_row0;
    const float* delta_row = kLoadsDelta ? params.delta_row(rows.tensor_batch, head) + rows.q_row0 : nullptr;
    const auto load_row = [&](int i) {
        const int row = m_start + i;
        const bool valid = row < rows.seqlen_q;
        const float lse = valid ? lse_row[row] : 0.0f;
        // A row that sees no key (LSE -inf) has every score masked to -inf;
        // a finite stand-in keeps exp2(-inf - lse) = 0 instead of NaN.
        stats[i] = lse == negative_infinity() ? 0.0f : lse * kLog2e;
        if constexpr (kLoadsDelta) {
            stats[kBlockM + i] = valid ? delta_row[row] : 0.0f;
        }
    };
    constexpr int kRounds = ceil_div(kBlockM, kThreads);
    if constexpr (kWrittenOut && kRounds <= 2) {
#pragma unroll
        for (int round = 0; round < kRounds; ++round) {
            if (kBlockM % kThreads == 0 || thread + round * kThreads < kBlockM) {
                load_row(thread + round * kThreads);
            }
        }
    } else {
        for (int i = thread; i < kBlockM; i += kThreads) {
            load_row(i);
        }
    }
}

// P^T and dS^T in place of one warp's S^T and dP^T: 16 keys from key0 (in
// the sequence) by kQTiles n8 tiles of queries from m_start + query0 (query0
// inside the block of kBlockM rows from m_start; the block's keys start at
// n_start). `stats` holds the block's LSE (log2) and delta
// (load_row_statistics). S^T gets the score transform, then the mask, but
// only in blocks that cross the causal diagonal or the end of either
// sequence (scores to -inf, so P^T = 0 there); dS^T = P^T (dP^T - delta)
// times the transform's derivative. `score`: the transform of the query
// head of this step (BlockContext::score_of_head), `mask` its mask
// (BlockContext::mask_of_head). With dropout, P^T comes back dropped and
// scaled (dV's operand) and dP^T is dropped before dS^T.
template <int kBlockM, int kBlockN, typename Mask, typename Score, int kQTiles>
__device__ __forceinline__ void transposed_probabilities_and_gradients(const BlockContext<Mask, Score>& ctx,
                                                                       const Mask& mask, const Score& score,
                                                                       float (&s)[1][kQTiles][4],
                                                                       float (&dp)[1][kQTiles][4], const float* stats,
                                                                       int m_start, int query0, int n_start, int key0,
                                                                       int lane) {
    constexpr bool kFromRaw = HasGradientFromRaw<Score>::value;  // s keeps raw scores, transformed below
    if constexpr (!kFromRaw) {
        apply_score_transform_transposed(score, s, key0, m_start + query0, lane);
    }
    if (m_start + kBlockM > ctx.seqlen_q || key_block_needs_mask(mask, m_start, kBlockM, n_start, kBlockN)) {
        apply_mask_to_transposed_fragments(mask, s, key0, m_start + query0, lane);
    }
    // ALiBi's distance row + seqlen_k - seqlen_q - key of element (j, e) is
    // distance0 + 8 j + e % 2 - 8 (e / 2) (unused without ALiBi).
    const float distance0 = static_cast<float>(m_start + query0 + 2 * (lane % 4) + ctx.seqlen_k - ctx.seqlen_q -
                                               (key0 + lane / 4));
    // A transform taking float positions gets row and key of element (j, e)
    // as row_f0 + 8 j + e % 2 and key_f0 + 8 (e / 2) (unused otherwise).
    const float row_f0 = static_cast<float>(m_start + query0 + 2 * (lane % 4));
    const float key_f0 = static_cast<float>(key0 + lane / 4);
#pragma unroll
    for (int j = 0; j < kQTiles; ++j) {
        const int col = query0 + 8 * j + 2 * (lane % 4);  // query row inside the block, and col + 1
        const float2 lse_pair = *reinterpret_cast<const float2*>(stats + col);
        const float2 delta_pair = *reinterpret_cast<const float2*>(stats + kBlockM + col);
        // Dropout's keep factors of this lane's keys in rows col and col + 1.
        KeyPairFactors keep[2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
        if constexpr (Score::kDropout) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                keep[r] = key_pair_factors(score.dropout, m_start + col + r, key0 + lane / 4);
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            // Masked scores are -inf: P^T = 0 there (recompute_probability's
            // explicit zero is not needed on this path; a raw -inf is not
            // given to a user transform, whose value there is anyone's guess).
            const int row = m_start + col + e % 2, key = key0 + lane / 4 + (e / 2) * 8;
            const float raw = s[0][j][e];
            float transformed = raw;
            if constexpr (kFromRaw && HasFloatPositions<Score>::value) {
                transformed = raw == negative_infinity()
                                  ? raw
                                  : score.transform(raw, row, key, row_f0 + static_cast<float>(8 * j + e % 2),
                                                    key_f0 + static_cast<float>(8 * (e / 2)));
            } else if constexpr (kFromRaw) {
                transformed = raw == negative_infinity() ? raw : score.transform(raw, row, key);
            }
            const float p = exp2_fast(fmaf(transformed, ctx.scale_log2, -(e % 2 ? lse_pair.y : lse_pair.x)));
            // dV takes the dropped P; dS = P (Z dP - delta) with Z the factor.
            const float z = e / 2 ? keep[e % 2].second : keep[e % 2].first;
            s[0][j][e] = Score::kDropout ? p * z : p;
            dp[0][j][e] = score_gradient(score, p, Score::kDropout ? dp[0][j][e] * z : dp[0][j][e],
                                         e % 2 ? delta_pair.y : delta_pair.x, raw, transformed, row, key,
                                         distance0 + static_cast<float>(8 * j + e % 2 - 8 * (e / 2)));
        }
    }
}

}  // namespace cuflash
