// Mask policies: which keys a query row may attend to, and which blocks of
// the score matrix can be skipped or need no element masking.
//
// A mask is a small struct built per thread block from the two sequence
// lengths (SequenceBounds, see block_info.cuh) and the launch's run-time
// policy values (VariantParams, params.cuh). Every kernel asks it the same questions:
//   rule(row, key)               the mask's own rule, for a row and key inside
//                                their sequences (bounds are checked apart)
//   key_blocks(m_start, block_m, block_n)
//                                the key blocks some row of the query block
//                                [m_start, m_start + block_m) sees
//   query_blocks(n_start, block_n, block_m)
//                                the query blocks with a row that sees some key
//                                of the key block [n_start, n_start + block_n)
//                                (the backward's dK/dV walk)
//   rule_hides_keys(first_row, rows, n_start, block_n)
//                                whether the rule may hide some key of the key
//                                block from some row of the group of `rows`
//                                consecutive rows starting at first_row (only
//                                such blocks, and blocks past a sequence's end,
//                                pay for element masking)
//   kLaterRowsSeeMore            whether the last query blocks have the most
//                                keys (the grid then hands them out first)
//   kDqTurns                     the order in which the key blocks of the
//                                deterministic backward add into a dQ block
//                                (DqTurns; dq_turn in backward_steps.cuh)
//   rows_from(first_row)         the same mask with rows counted from
//                                first_row (row r means first_row + r): a
//                                kernel that masks one block's rows folds the
//                                block's start into the mask's constants, so
//                                one value fewer stays live through its loop
//                                (the register-tight mma.sync forward spilled
//                                without it)
// cuflash/_masks.py holds the same policies for the launcher, the NumPy
// references and the IO simulator; adding a mask means one struct here and
// one entry there (docs/kernel-policies.md).
#pragma once

#include "numeric.cuh"
#include "params.cuh"
#include "tile_map.cuh"

namespace cuflash {

// The orders of the deterministic backward's dQ additions (dq_turn in
// backward_steps.cuh). kKeyBlockOrder serves any mask; the others are
// faster where the mask allows them:
//   kKeyBlockOrder   first key block first: every key block waits at its
//                    first query block for those before it (a chain)
//   kLastKeyFirst    the last key block a query block sees first, down to
//                    the first: needs each query block's key blocks and each
//                    key block's query blocks to be intervals whose ends grow
//                    together (causal, bands); no chain
//   kRotated         needs every row to see every key: each key block starts
//                    its walk on its own query block; no chain, where the
//                    launcher finds that one head's key blocks fit on the GPU
//                    at once (params.rotate_walks), key-block order otherwise
enum class DqTurns { kKeyBlockOrder, kLastKeyFirst, kRotated };

// Blocks [begin, end); empty when end <= begin.
struct BlockRange {
    int begin, end;
};

// The sequence lengths every mask knows: scores past either end are masked
// whatever the rule says.
struct SequenceBounds {
    int seqlen_q, seqlen_k;
};

// Full attention: every key of the sequence.
struct NoMask : SequenceBounds {
    static constexpr bool kLaterRowsSeeMore = false;
    static constexpr DqTurns kDqTurns = DqTurns::kRotated;

    __device__ __forceinline__ NoMask(SequenceBounds bounds, const VariantParams&) : SequenceBounds(bounds) {}
    __device__ __forceinline__ bool rule(int, int) const { return true; }
    __device__ __forceinline__ NoMask rows_from(int first_row) const {
        NoMask shifted = *this;
        shifted.seqlen_q -= first_row;
        return shifted;
    }
    __device__ __forceinline__ BlockRange key_blocks(int, int, int block_n) const {
        return {0, ceil_div(seqlen_k, block_n)};
    }
    __device__ __forceinline__ BlockRange query_blocks(int, int, int block_m) const {
        return {0, ceil_div(seqlen_q, block_m)};
    }
    __device__ __forceinline__ bool rule_hides_keys(int, int, int, int) const { return false; }
};

// Causal attention aligned to the bottom-right corner of the score matrix, as
// in FlashAttention-2: query row i sees key j iff j <= i + (seqlen_k - seqlen_q).
// With seqlen_q > seqlen_k the first seqlen_q - seqlen_k rows see no key at
// all; their output is 0 and their log-sum-exp -inf (see OnlineSoftmax).
struct CausalMask : SequenceBounds {
    static constexpr bool kLaterRowsSeeMore = true;
    static constexpr DqTurns kDqTurns = DqTurns::kLastKeyFirst;
    int diagonal_offset;  // row i sees keys up to i + diagonal_offset

    __device__ __forceinline__ CausalMask(SequenceBounds bounds, const VariantParams&)
        : SequenceBounds(bounds), diagonal_offset(bounds.seqlen_k - bounds.seqlen_q) {}

    __device__ __forceinline__ bool rule(int row, int key) const { return key <= row + diagonal_offset; }
    __device__ __forceinline__ CausalMask rows_from(int first_row) const {
        CausalMask shifted = *this;
        shifted.seqlen_q -= first_row;
        shifted.diagonal_offset += first_row;
        return shifted;
    }

    // Up to the block holding the last key its last row sees; nothing when
    // even that row sees no key.
    __device__ __forceinline__ BlockRange key_blocks(int m_start, int block_m, int block_n) const {
        const int last_row = min(m_start + block_m, seqlen_q) - 1;
        const int last_visible_key = last_row + diagonal_offset;
        return {0, last_visible_key < 0 ? 0 : ceil_div(min(last_visible_key + 1, seqlen_k), block_n)};
    }

    // From the block of the first row that sees key n_start: a row that sees
    // it sees every later key of the block up to its diagonal.
    __device__ __forceinline__ BlockRange query_blocks(int n_start, int, int block_m) const {
        return {max(0, n_start - diagonal_offset) / block_m, ceil_div(seqlen_q, block_m)};
    }

    // The group's first row sees the fewest keys: the block's last key lies
    // beyond its diagonal.
    __device__ __forceinline__ bool rule_hides_keys(int first_row, int, int n_start, int block_n) const {
        return n_start + block_n - 1 > first_row + diagonal_offset;
    }
};

// A sliding window (FlashAttention-2's window_size, causal being the window
// (left, 0)), aligned to the bottom-right corner like CausalMask: with
// off = seqlen_k - seqlen_q, row i sees key j iff
// i + off - window_left <= j <= i + off + window_right. The launcher turns
// an unbounded side (-1) into one that reaches past every key, so the sums
// below stay far from int overflow. Rows whose window holds no key (it can
// lie past either end) see nothing: output 0, log-sum-exp -inf.
struct WindowMask : SequenceBounds {
    static constexpr bool kLaterRowsSeeMore = false;
    // Each row's keys are an interval whose ends move down with the row.
    static constexpr DqTurns kDqTurns = DqTurns::kLastKeyFirst;
    int first_offset;  // row i sees keys from i + first_offset
    int last_offset;   // to i + last_offset

    __device__ __forceinline__ WindowMask(SequenceBounds bounds, const VariantParams& variant)
        : SequenceBounds(bounds),
          first_offset(bounds.seqlen_k - bounds.seqlen_q - static_cast<int>(variant.window_left)),
          last_offset(bounds.seqlen_k - bounds.seqlen_q + static_cast<int>(variant.window_right)) {}

    __device__ __forceinline__ bool rule(int row, int key) const {
        return key >= row + first_offset && key <= row + last_offset;
    }
    __device__ __forceinline__ WindowMask rows_from(int first_row) const {
        WindowMask shifted = *this;
        shifted.seqlen_q -= first_row;
        shifted.first_offset += first_row;
        shifted.last_offset += first_row;
        return shifted;
    }
    // From the first row's first key to the last row's last key: the
    // blocks outside every row's window are skipped, so the cost follows
    // the window, not the sequence.
    __device__ __forceinline__ BlockRange key_blocks(int m_start, int block_m, int block_n) const {
        const int first = max(0, m_start + first_offset);
        const int last = min(min(m_start + block_m, seqlen_q) - 1 + last_offset, seqlen_k - 1);
        return last < first ? BlockRange{0, 0} : BlockRange{first / block_n, last / block_n + 1};
    }
    // From the first row that sees the block's first key to the last row
    // that sees its last key.
    __device__ __forceinline__ BlockRange query_blocks(int n_start, int block_n, int block_m) const {
        const int first = max(0, n_start - last_offset);
        const int last = min(seqlen_q - 1, min(n_start + block_n, seqlen_k) - 1 - first_offset);
        return last < first ? BlockRange{0, 0} : BlockRange{first / block_m, last / block_m + 1};
    }
    // The group's first row sees the fewest late keys, its last row the
    // fewest early ones.
    __device__ __forceinline__ bool rule_hides_keys(int first_row, int rows, int n_start, int block_n) const {
        return n_start + block_n - 1 > first_row + last_offset || n_start < first_row + rows - 1 + first_offset;
    }
};

// A user mask (cuflash.mods: mask_mod traced into CUDA C). Rule is the
// generated struct (cuflash.mods.mask_rule), whose
//   static bool visible(const void* const* arrays, int b, int h, int q_idx, int kv_idx)
// is the user's condition, and which gives it in parts too: Row row(arrays,
// b, h, q_idx) and Key key(arrays, b, h, kv_idx), what reads one position
// alone, combine(row, key, arrays, b, h, q_idx, kv_idx) the rest, kParts
// how many parts there are (0: a rule of the positions alone). The tile
// map (tile_map.cuh, built on the GPU from the same rule at the kernel's
// tiles) says which tiles it hides wholly (the kernels skip them:
// VisitedKeyBlocks, the backward's QueryBlockWalk), which it shows wholly
// (no element masking) and which are partial. The rule reads the batch
// entry and head, so a key-major backward builds the mask of each query
// head it visits (BlockContext::mask_of_head).
template <typename Rule>
struct UserMask : SequenceBounds {
    // The grid hands out the last query tiles first: the common user masks
    // (causal ones, prefix LMs) give later rows more keys, and for the
    // others (documents, windows) the order is as good as any.
    static constexpr bool kLaterRowsSeeMore = true;
    // The map ranks every query tile's visible key tiles (key_rank).
    static constexpr DqTurns kDqTurns = DqTurns::kKeyBlockOrder;
    static constexpr bool kTileMap = true;
    // As few values as the walks need: the register-tight mma.sync forward
    // keeps them all through its loop.
    const void* const* arrays;
    const int* head_section;  // the map's section of (batch, head)
    int head_stride;          // between heads' sections (0: one shared)
    int block_m, block_n, m_tiles, n_tiles;
    int batch, head;
    int row_shift;  // rows_from's first row: rule rows are row + row_shift

    __device__ __forceinline__ UserMask(SequenceBounds bounds, const VariantParams& variant, index_t batch_index,
                                        index_t head_index)
        : SequenceBounds(bounds),
          arrays(variant.user_arrays),
          head_section(variant.tile_map + batch_index * variant.tile_map_batch_stride +
                       head_index * variant.tile_map_head_stride),
          head_stride(static_cast<int>(variant.tile_map_head_stride)),
          block_m(static_cast<int>(variant.tile_map_block_m)),
          block_n(static_cast<int>(variant.tile_map_block_n)),
          m_tiles(ceil_div(bounds.seqlen_q, block_m)),
          n_tiles(ceil_div(bounds.seqlen_k, block_n)),
          batch(static_cast<int>(batch_index)),
          head(static_cast<int>(head_index)),
          row_shift(0) {}

    // The rule in the generated three steps (cuflash.mods.rule_parts): the
    // parts of a row (what reads no key position), of a key (what reads no
    // query position), and their combination: fragment masking takes each
    // row's and key's parts once, not once per score. A rule of the
    // positions alone (no parts) keeps the plain walk in the forwards, the
    // faster one there (H100, a window by mask_mod: 172 against 176 us),
    // and the backward takes the walk by lines either way (728 against
    // 748 us forward + backward).
    static constexpr bool kFactoredRule = true;
    static constexpr bool kRuleHasParts = Rule::kParts > 0;
    using RowPart = typename Rule::Row;
    using KeyPart = typename Rule::Key;
    __device__ __forceinline__ RowPart row_part(int row) const {
        return Rule::row(arrays, batch, head, row + row_shift);
    }
    __device__ __forceinline__ KeyPart key_part(int key) const { return Rule::key(arrays, batch, head, key); }
    __device__ __forceinline__ bool rule_of(const RowPart& row_values, const KeyPart& key_values, int row,
                                            int key) const {
        return Rule::combine(row_values, key_values, arrays, batch, head, row + row_shift, key);
    }
    __device__ __forceinline__ bool rule(int row, int key) const {
        return rule_of(row_part(row), key_part(key), row, key);
    }
    __device__ __forceinline__ UserMask rows_from(int first_row) const {
        UserMask shifted = *this;
        shifted.seqlen_q -= first_row;
        shifted.row_shift += first_row;
        return shifted;
    }
    __device__ __forceinline__ UserMask with_head(index_t other) const {
        UserMask same = *this;
        same.head_section += (static_cast<int>(other) - head) * static_cast<index_t>(head_stride);
        same.head = static_cast<int>(other);
        return same;
    }
    __device__ __forceinline__ TileSection section() const { return {head_section, m_tiles, n_tiles}; }
    // The sections of every head of the batch entry (the backward's walks).
    __device__ __forceinline__ TileMap map() const {
        return {head_section - head * static_cast<index_t>(head_stride), head_stride, m_tiles, n_tiles};
    }
    // Every block (of the asking kernel's tiles, which are the map's but in
    // the deterministic dQ pass): the map's lists say which to visit.
    __device__ __forceinline__ BlockRange key_blocks(int, int, int kernel_block_n) const {
        return {0, ceil_div(seqlen_k, kernel_block_n)};
    }
    __device__ __forceinline__ BlockRange query_blocks(int, int, int kernel_block_m) const {
        return {0, ceil_div(seqlen_q, kernel_block_m)};
    }
    // The group lies in one tile of the map (the kernel's own tiles): only
    // a full tile needs no element masking.
    __device__ __forceinline__ bool rule_hides_keys(int first_row, int, int n_start, int) const {
        return section().state((first_row + row_shift) / block_m, n_start / block_n) != kFullTile;
    }
};

// Whether a mask skips tiles by a tile map (UserMask); the others do not.
CUFLASH_FLAG_TRAIT(HasTileMap, kTileMap);
// Whether a mask's rule comes as row and key parts (UserMask), and whether
// it has any (a rule of the positions alone has none).
CUFLASH_FLAG_TRAIT(HasFactoredRule, kFactoredRule);
CUFLASH_FLAG_TRAIT(HasRuleParts, kRuleHasParts);

// The mask of a block's sequences for query head `head` of batch entry
// `batch` (only a user mask reads them).
template <typename Mask>
__device__ __forceinline__ Mask make_mask(SequenceBounds bounds, const VariantParams& variant, index_t batch,
                                          index_t head) {
    if constexpr (HasTileMap<Mask>::value) {
        return Mask(bounds, variant, batch, head);
    } else {
        return Mask(bounds, variant);
    }
}

// The key blocks a query block visits, last first (the forwards' order):
// n_block(i) for i in [0, count). Every block of the mask's range, or with
// a tile map the tiles it lists for the block (the map's tiles are the
// kernel's).
template <typename Mask, bool = HasTileMap<Mask>::value>
struct VisitedKeyBlocks {
    int last, count;

    __device__ __forceinline__ VisitedKeyBlocks(const Mask& mask, int m_start, int block_m, int block_n) {
        const BlockRange range = mask.key_blocks(m_start, block_m, block_n);
        last = range.end - 1;
        count = max(0, range.end - range.begin);
    }
    __device__ __forceinline__ int n_block(int i) const { return last - i; }
};

template <typename Mask>
struct VisitedKeyBlocks<Mask, true> {
    TileSection tiles;
    int m_tile, count;

    __device__ __forceinline__ VisitedKeyBlocks(const Mask& mask, int m_start, int block_m, int) {
        tiles = mask.section();
        m_tile = (m_start + mask.row_shift) / block_m;
        count = tiles.key_count(m_tile);
    }
    __device__ __forceinline__ int n_block(int i) const { return tiles.key_tile(m_tile, count - 1 - i); }
};

// Whether `key` exists and the mask lets `row` see it (the forward computes
// rows past seqlen_q but never writes them).
template <typename Mask>
__device__ __forceinline__ bool key_visible(const Mask& mask, int row, int key) {
    return key < mask.seqlen_k && mask.rule(row, key);
}

// Whether any score of the key block [n_start, n_start + block_n) is masked
// for some row of the group of `rows` consecutive rows starting at
// first_row: the block runs past the last key, or the rule hides some of
// its keys.
template <typename Mask>
__device__ __forceinline__ bool key_block_needs_mask(const Mask& mask, int first_row, int rows, int n_start,
                                                     int block_n) {
    return n_start + block_n > mask.seqlen_k || mask.rule_hides_keys(first_row, rows, n_start, block_n);
}

// Row and column of element s[mt][nt][half * 2 + c] of mma accumulator
// fragments (layout in mma.cuh) of a warp whose fragment rows start at row0
// and columns at col0.
__device__ __forceinline__ int fragment_row(int row0, int mt, int half, int lane) {
    return row0 + mt * 16 + lane / 4 + half * 8;
}
__device__ __forceinline__ int fragment_col(int col0, int nt, int c, int lane) {
    return col0 + nt * 8 + 2 * (lane % 4) + c;
}

// Calls f(value, row, col) for every element of mma accumulator fragments
// s[kMTiles][kNTiles][4]. The same walk serves transposed scores S^T, whose
// rows are keys and columns query rows.
template <int kMTiles, int kNTiles, typename F>
__device__ __forceinline__ void for_each_fragment_element(float (&s)[kMTiles][kNTiles][4], int row0, int col0, int lane,
                                                          F&& f) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = fragment_row(row0, mt, i / 2, lane);
#pragma unroll
            for (int nt = 0; nt < kNTiles; ++nt) {
                f(s[mt][nt][i], row, fragment_col(col0, nt, i % 2, lane));
            }
        }
    }
}

// The same walk with a value derived once per fragment row (row_value(row))
// and once per column (col_value(col)): f(value, row, col, its row's value,
// its column's value). A factored mask rule's parts (HasFactoredRule) come
// this way: what depends on a row or a key alone (an array read indexed by
// one position: a document id) is computed once for each of the thread's
// rows and columns in a tile (a row by the four lanes that hold it, a key
// by the eight), not once per score.
template <int kMTiles, int kNTiles, typename RowValue, typename ColValue, typename F>
__device__ __forceinline__ void for_each_fragment_element_by_line(float (&s)[kMTiles][kNTiles][4], int row0, int col0,
                                                                  int lane, RowValue&& row_value,
                                                                  ColValue&& col_value, F&& f) {
    decltype(row_value(0)) row_values[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            row_values[mt][half] = row_value(fragment_row(row0, mt, half, lane));
        }
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int col = fragment_col(col0, nt, c, lane);
            const auto col_values = col_value(col);
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    f(s[mt][nt][half * 2 + c], fragment_row(row0, mt, half, lane), col, row_values[mt][half],
                      col_values);
                }
            }
        }
    }
}

// Sets the masked scores of a warp's S fragments (rows from row0, keys from
// key0) to -inf.
template <typename Mask, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask_to_fragments(const Mask& mask, float (&s)[kMTiles][kNTiles][4], int row0,
                                                        int key0, int lane) {
    if constexpr (HasRuleParts<Mask>::value) {
        for_each_fragment_element_by_line(
            s, row0, key0, lane, [&](int row) { return mask.row_part(row); },
            [&](int key) { return mask.key_part(key); },
            [&](float& score, int row, int key, const auto& row_values, const auto& key_values) {
                if (!(key < mask.seqlen_k && mask.rule_of(row_values, key_values, row, key))) {
                    score = negative_infinity();
                }
            });
    } else {
        for_each_fragment_element(s, row0, key0, lane, [&](float& score, int row, int key) {
            if (!key_visible(mask, row, key)) {
                score = negative_infinity();
            }
        });
    }
}

// The same for transposed scores S^T (rows are keys from key0, columns query
// rows from row0), as the backward's key-major accumulators hold them. Rows
// past seqlen_q are masked too: the backward must not count them.
template <typename Mask, int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask_to_transposed_fragments(const Mask& mask, float (&s)[kMTiles][kNTiles][4],
                                                                   int key0, int row0, int lane) {
    if constexpr (HasFactoredRule<Mask>::value) {
        for_each_fragment_element_by_line(
            s, key0, row0, lane, [&](int key) { return mask.key_part(key); },
            [&](int row) { return mask.row_part(row); },
            [&](float& score, int key, int row, const auto& key_values, const auto& row_values) {
                if (!(row < mask.seqlen_q && key < mask.seqlen_k && mask.rule_of(row_values, key_values, row, key))) {
                    score = negative_infinity();
                }
            });
    } else {
        for_each_fragment_element(s, key0, row0, lane, [&](float& score, int key, int row) {
            if (row >= mask.seqlen_q || !key_visible(mask, row, key)) {
                score = negative_infinity();
            }
        });
    }
}

}  // namespace cuflash
