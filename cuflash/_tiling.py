"""Tile sizes of cuflash's kernels, per (dtype, head dim), and the shared
memory they take: the tables ``cuflash._kernel_families`` points each kernel
family at (which family runs a call is decided there).

The CUDA side (``kernels_cu/simt_traits.cuh``, ``tensor_core_traits.cuh``)
receives these numbers as template arguments and derives the shared-memory
layout from them; the ``*_smem_bytes`` formulas below mirror that derivation
(tests/test_tiling.py compares them with the traits), and each kernel checks
at run time that it was given at least as much as it needs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

#: Head dims the kernels are compiled for. A head_dim between two entries runs
#: on the next larger one, its extra columns zero-filled inside the kernel.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

#: Bytes per element of each supported storage dtype, by NumPy name.
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}

#: Shared memory a Hopper or Ampere block may use (227 KiB).
MAX_SMEM_BYTES = 227 * 1024

#: Storage dtypes of the tensor-core kernels (mma.sync and wgmma, float32 accumulation).
MMA_DTYPES = ("float16", "bfloat16")
#: mma.sync forward tiles (flash_fwd_mma.cu) per compiled head dim (a head
#: dim runs on the next larger one): (block_m, block_n, warps,
#: K/V buffers). Each warp owns block_m / warps query rows; its accumulators
#: (O: rows x head dim, S: rows x block_n) fill the register file, so the
#: larger head dims take fewer rows or keys, and where double-buffered K/V
#: copies would spill registers (96, 128) the tiles are single-buffered.
#: tools/kernel_report.py checks that none spills.
MMA_FORWARD_TILES = {
    32: (128, 64, 4, 2),
    64: (128, 64, 4, 2),
    96: (128, 64, 4, 1),
    128: (128, 64, 4, 1),
    192: (64, 32, 4, 2),
    256: (64, 32, 4, 2),
}
#: The mma.sync forward's tiles for decoding (``decode_tiling``): calls with
#: at most ``DECODE_MAX_ROWS`` query rows per K/V head and batch entry (one
#: query token with grouped-query packing, a few with speculative decoding),
#: which read K and V once and compute little, so the tile is the fewest
#: rows the warps can hold (16 each), double-buffered key blocks small
#: enough for two or three blocks per SM, and no Hopper variant (the
#: wgmma forward computes 128 rows a block). (block_m, block_n, warps, K/V
#: buffers), per compiled head dim. d64 takes 128 keys: with 64, ptxas
#: spilled the unmasked variant on sm_90a (16 bytes at 128 registers).
MMA_DECODE_TILES = {
    32: (64, 64, 4, 2),
    64: (64, 128, 4, 2),
    96: (64, 64, 4, 2),
    128: (64, 64, 4, 2),
    192: (64, 32, 4, 2),
    256: (64, 32, 4, 2),
}
#: Query rows per K/V head and batch entry up to which a call takes the
#: decode tiles (one decode block's rows).
DECODE_MAX_ROWS = 64
#: The decode tiles of calls with at most DECODE_SPLIT_KEYS_MAX_ROWS such
#: rows (one query token, up to 16 query heads per K/V head): one m16 tile
#: of rows whose four warps split each key block's keys (the Tiling's
#: warps_split_keys, MmaForwardTraits), so each score is computed once, not
#: by four warps of which three hold empty rows. Measured on the H100
#: (bf16 d128, one token, against the 64-row tiles): docs/perf-notes.md,
#: "Decoding". Whole k16 steps per warp: 64 keys a block (at d64 too: with
#: 128, ptxas spilled the causal variant on sm_90a).
MMA_DECODE_SPLIT_KEYS_TILES = {
    32: (16, 64, 4, 2),
    64: (16, 64, 4, 2),
    96: (16, 64, 4, 2),
    128: (16, 64, 4, 2),
    192: (16, 64, 4, 2),
    256: (16, 64, 4, 2),
}
DECODE_SPLIT_KEYS_MAX_ROWS = 16
#: Split counts a Hopper decode runs as thread-block clusters, merged in
#: the cluster (``decode_cluster_tiling``); other counts take the merge
#: kernel. Clusters of more than 8 blocks are non-portable (the launcher
#: allows them per kernel).
DECODE_CLUSTER_SPLITS = (2, 4, 8, 16)
#: The same kernel on float32 by 3xTF32 (opt-in: fp32_precision="3xtf32";
#: see kernels_cu/mma_operands.cuh), per compiled head dim: (block_m,
#: block_n, warps, K/V buffers). Measured on the H100 (seqlen 4096, docs/
#: perf-notes.md): two m16 tiles per warp at 64 (each K/V
#: fragment feeds two products), one tile per warp elsewhere (eight warps
#: from 96 to 192); float32 tiles
#: take twice the shared memory of 16-bit ones, and every entry stays within
#: an A100's 163 KiB (Hopper takes MMA_3XTF32_HOPPER_TILES where they differ).
MMA_3XTF32_FORWARD_TILES = {
    32: (64, 64, 4, 2),
    64: (128, 64, 4, 2),
    96: (128, 64, 8, 1),
    128: (128, 64, 8, 1),
    192: (128, 32, 8, 1),
    256: (64, 32, 4, 1),
}
#: Where Hopper's 227 KiB of shared memory per block allow larger 3xTF32
#: tiles than an A100's 163 KiB: (block_m, block_n, warps, K/V buffers).
#: 256: 128 rows (200 KiB), 15-30% faster than the 64-row tile on the H100.
MMA_3XTF32_HOPPER_TILES = {
    256: (128, 32, 8, 1),
}
#: The float32 dtype the mma.sync forward serves by 3xTF32.
MMA_3XTF32_DTYPE = "float32"
#: mma.sync backward dK/dV tiles (sm_80+; flash_bwd_mma.cu; what Ampere and
#: Ada GPUs run) per compiled head dim: (block_m query rows per step, block_n
#: keys per block, warps, Q/dO buffers), within an A100's 163 KiB per block.
#: Up to head dim 128 each warp owns 16 keys: S^T and dP^T take block_m / 2
#: registers each, dK and dV head_dim / 2 each, so block_m + head_dim <= 192.
#: Above 128 two warps share 16 keys and split the head dim
#: (``backward_splits_head_dim``), halving both. At 192, 64 query rows fit
#: single-buffered (118.5 KiB; 169 double-buffered): as fast as 32 rows
#: double-buffered and the deterministic mode 15% faster (H100 as sm_80
#: code, docs/perf-notes.md). At 256 the same (150.5 KiB) measured alike,
#: deterministic 18% faster, but its ordered-dQ variant spills on sm_90
#: (which runs this kernel where NVRTC cannot build sm_90a): 32 rows
#: double-buffered (142.5 KiB).
MMA_BACKWARD_TILES = {
    32: (64, 128, 8, 2),
    64: (64, 128, 8, 2),
    96: (64, 128, 8, 2),
    128: (32, 128, 8, 2),
    192: (64, 64, 8, 1),
    256: (32, 64, 8, 2),
}
#: The mma.sync backward's tiles for GPUs that give a block 99 KiB (sm_86,
#: sm_89: RTX 30/40, A10, L4, L40S) where ``MMA_BACKWARD_TILES``' need more;
#: measured as sm_80 code on the H100 at 0.94-1.0x the larger tiles' speed,
#: 0.53x at 256 (32 keys per block).
MMA_BACKWARD_99KIB_TILES = {
    96: (64, 128, 8, 1),
    128: (32, 128, 8, 1),
    192: (32, 64, 8, 1),
    256: (32, 32, 4, 1),
}
#: Hopper forward tiles (wgmma, sm_90a; flash_fwd_wgmma.cu) per compiled head
#: dim (mma.sync buckets): (block_m, block_n, warps, blocks per SM). The
#: kernel is warp-specialised: warpgroup 0 (4 warps) copies, and one
#: consumer warpgroup per 64 query rows computes, so warps = 4 + block_m / 16.
#: The register budget is set (launch bounds, setmaxnreg) for that many
#: resident blocks per SM. Per consumer thread S takes block_n / 2
#: registers, O head_dim / 2 and two blocks' P block_n / 4 each (<= 192
#: together); K and V go through a ring of two or three buffers each
#: (``with_wgmma_forward_stages``), so the larger head dims take fewer keys
#: per block. Head dims whose bucket is missing
#: here run on the mma.sync kernel. d32 runs one consumer per block and two
#: blocks per SM. d64 runs three consumers of 64 rows over 96 keys (a block
#: reads each K/V block once per 192 query rows, where the 64-row tile read
#: them from L2 at 72% of its throughput; 128 consumer registers of 160):
#: H200, bf16, FA2 grid, TFLOP/s against 64 x 128 at two blocks an SM, full
#: 4k 491 / 472, 8k 530 / 477, 16k 525 / 466, causal 16k 511 / 480; shorter
#: sequences keep the 64-row tile (``WGMMA_FORWARD_SHORT_TILES``).
WGMMA_FORWARD_TILES = {
    32: (64, 128, 8, 2),
    64: (192, 96, 16, 1),
    96: (128, 128, 12, 1),
    128: (128, 128, 12, 1),
    192: (128, 64, 12, 1),
    256: (128, 48, 12, 1),
}
#: Hopper forward tiles for head dims whose rows end inside a 32-byte
#: sector (head_dim * element bytes not a multiple of 32: 8, 24, 40, 56 in
#: 16 bits), where they differ from ``WGMMA_FORWARD_TILES``: bucket 32's
#: 64-row tile at two blocks an SM copies each K/V block for a third of the
#: query rows a 192-row one does, and over such rows it ran at half the
#: speed of 128 x 128 (H100: d40 139 against 251 TFLOP/s, d8 40 against 68;
#: padding the storage so rows start on a sector did not help, so it is the
#: copies of rows ending mid-sector, not their alignment:
#: docs/perf-notes.md). Of the larger tiles, d64's 192 x 96 of three
#: consumers beat 128 x 128 on such rows (H200, bf16, ms, 128 x 128 /
#: 192 x 96 / 64 x 128 at two an SM: d40 full 4k 1.704 / 1.363 / 3.328,
#: causal 4k 0.945 / 0.802 / 1.776, full 1k 0.476 / 0.443 / 0.901; d56 full
#: 4k 1.180 / 1.029 / 1.176; d24 full 4k 2.525 / 2.154 / 3.696), so bucket
#: 64 keeps its table tile for them and bucket 32 takes it. Head dims 16 and 32 keep the 64-row tile. Short
#: sequences keep 128 x 128 (``WGMMA_FORWARD_PARTIAL_SECTOR_SHORT_TILES``).
WGMMA_FORWARD_PARTIAL_SECTOR_TILES = {
    32: (192, 96, 16, 1),
}
@dataclasses.dataclass(frozen=True)
class ShortSequenceTile:
    """A Hopper forward tile for short sequences (``WGMMA_FORWARD_SHORT_TILES``)."""

    tile: tuple[int, int, int, int]  #: as in ``WGMMA_FORWARD_TILES``
    most_keys: int  #: keys per sequence (a packed batch's longest) up to which it serves
    #: whether it also serves the calls persistent blocks apply to
    #: (``wgmma_forward_persistent``; then it runs persistent itself) or
    #: leaves those to the table's tile
    serves_persistent: bool
    masks: tuple[str, ...] | None = None  #: the masks it serves; None: every mask


#: Hopper forward tiles for short sequences, head dims whose 16-bit rows are
#: whole 32-byte sectors (the others: ``WGMMA_FORWARD_PARTIAL_SECTOR_SHORT_TILES``):
#: head dim -> its ``ShortSequenceTile`` rules, the first that serves a call
#: taken (``wgmma_forward_for_call``). Blocks of one consumer warpgroup, two
#: or three an SM, keep more tiles in flight where each sees few key blocks.
#: - d128, up to 512 keys, only where persistent blocks do not apply
#:   (packed batches, other masks, dropout). H100, bf16, d128, 32/8 heads,
#:   16384 tokens, TFLOP/s, 128 x 128 -> 64 x 64: 64 x 256 tokens 270 ->
#:   282, causal 154 -> 170; packed lengths 45-476, 235 -> 275, causal 143 ->
#:   176; at 8 x 2048 it lost (538 -> 508); on the FA2 grid at 512, 380 ->
#:   372, causal 241 -> 262 (38fcc3b). The table's tile persistent beats it
#:   where that applies: 477 / 292 against 433 / 284 (both persistent, 0c50e0a).
#: - d64 causal, up to 2048 keys: 64 x 64 at three blocks an SM (a causal
#:   tile's last key block is the diagonal one, and short walks leave the
#:   tensor cores idle unless more blocks share an SM). H100, bf16, FA2
#:   grid, TFLOP/s, against the tile taken before (64 x 128 two an SM up
#:   to 1k, 192 x 96 at 2k, persistent): 512 196 -> 239 (persistent; one
#:   tile a block 224), 1k 278 -> 314 (309), 2k 358 -> 374 (one tile a
#:   block; persistent 368). Without a mask it lost (1k 408 -> 388).
#: - d64 without a mask, up to 512 keys: the same 64 x 64 tile, once the
#:   softmax took the maxima only where a sum asks for them (6e3493d). H100,
#:   bf16, FA2 grid, TFLOP/s, persistent, against 64 x 128 at two an SM:
#:   512 392 / 371, 1k 452 / 453 (a tie: left to 64 x 128), 2k 483 / 505.
#: - d64, up to 1024 keys, persistent where that applies: H200, bf16, FA2
#:   grid, TFLOP/s, 64 x 128 at two blocks an SM against the table's 192 x 96
#:   (both persistent where they apply): full 512 355 / 317, 1k 412 / 389,
#:   causal 512 199 / 158, 1k 279 / 249; at 2k 442 / 458, causal 350 / 359.
WGMMA_FORWARD_SHORT_TILES = {
    64: (ShortSequenceTile((64, 64, 8, 3), 2048, True, ("causal",)),
         ShortSequenceTile((64, 64, 8, 3), 512, True, ("none",)),
         ShortSequenceTile((64, 128, 8, 2), 1024, True)),
    128: (ShortSequenceTile((64, 64, 8, 2), 512, False),),
}
#: Hopper forward tiles for short sequences whose rows end inside a 32-byte
#: sector (``rows_end_mid_sector``), by bucket: the 128-row tile of two
#: consumers, where the 192-row one (``WGMMA_FORWARD_PARTIAL_SECTOR_TILES``)
#: has too few query tiles to fill the SMs. H200, bf16, FA2 grid, ms,
#: 128 x 128 against 192 x 96, both persistent (tools/ab.py, 2c41359): causal
#: d40 512 0.223 / 0.262, 1k 0.327 / 0.353, d56 1k 0.242 / 0.268, d8 1k
#: 1.481 / 1.569, but d56 2k 0.389 / 0.376; no mask d24 512 0.411 / 0.432,
#: d40 512 0.269 / 0.275, d56 512 0.197 / 0.207, but d40 1k 0.476 / 0.443
#: (the probe measured with the table above).
_PARTIAL_SECTOR_SHORT_RULES = (ShortSequenceTile((128, 128, 12, 1), 1024, True, ("causal",)),
                               ShortSequenceTile((128, 128, 12, 1), 512, True, ("none",)))
WGMMA_FORWARD_PARTIAL_SECTOR_SHORT_TILES = {32: _PARTIAL_SECTOR_SHORT_RULES, 64: _PARTIAL_SECTOR_SHORT_RULES}
#: Most stages of the Hopper forward's K/V ring (``WgmmaForwardTraits::kStages``):
#: three where the blocks of an SM hold them, else two (``with_wgmma_forward_stages``).
#: A step multiplies by K_i and V_{i-1}, and V_{i-2}'s buffer is freed only
#: as step i starts (flash_fwd_wgmma.cu), so with two stages a V tile has one
#: step to arrive.
WGMMA_FORWARD_MAX_STAGES = 3
#: Shared memory of one SM that resident blocks share (H100: 228 KiB), each
#: block also taking ``SMEM_RESERVED_PER_BLOCK`` for the system.
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024


def wgmma_forward_barrier_bytes(stages: int, q_buffers: int = 1) -> int:
    """The Hopper forward's mbarriers: Q full and empty per Q buffer with its tile's coordinates (16 bytes), then
    full and empty for K and V per stage, then K landed per stage (K copied with its neighbour's columns)."""
    return 8 * (4 * q_buffers + 5 * stages)


#: Hopper backward dK/dV tiles (wgmma, sm_90a; flash_bwd_wgmma.cu) per
#: compiled head dim: (block_m query rows per step, block_n keys per block,
#: warps, Q/dO buffers). Warp-specialised like the forward: warpgroup 0
#: loads and adds dQ, the other warps / 4 - 1 are consumers. Up to head dim
#: 128 each consumer owns 64 keys: S^T and dP^T take block_m / 2 registers
#: each, dK and dV head_dim / 2 each, so block_m + head_dim <= 192 (d64's
#: 128 rows fit once dS^T is staged by stmatrix, whose addresses are not live
#: beside S^T and dP^T: 7-10% faster than 64 rows, docs/perf-notes.md; with a
#: window or on packed batches 4-12 bytes spill). Above 128 the
#: consumers share 64 keys and split the head dim
#: (``backward_splits_head_dim``): head_dim / consumers columns of dK and
#: dV, block_m / consumers queries of S^T and dP^T each. Head dim 256 has
#: one Q/dO buffer: two do not fit beside the float32 dQ tile.
WGMMA_BACKWARD_TILES = {
    32: (128, 128, 12, 2),
    64: (128, 128, 12, 2),
    96: (64, 128, 12, 2),
    128: (64, 128, 12, 2),
    192: (64, 64, 12, 2),
    256: (64, 64, 12, 1),
}
#: Widths the Hopper kernels' products may stop at inside a bucket
#: (``wgmma_product_dim``): Wgmma N's a k16 step or more short of the
#: buckets 64, 96 and 128 (kernels_cu/wgmma.cuh's N table has each).
WGMMA_PRODUCT_DIMS = (48, 80, 112)
#: Bytes the Hopper forward asks for beyond its tiles: it aligns its base to
#: 1024 (``WgmmaForwardTraits::kAlignment``).
WGMMA_SMEM_ALIGNMENT = 1024
#: Kernels a ``Tiling`` can describe.
KERNELS = ("simt", "mma", "wgmma")


def widest_swizzle_bytes(cols: int) -> int:
    """``widest_swizzle_bytes`` of swizzled_tile.cuh: the widest swizzle
    (128, 64 or 32 bytes a row) whose panels of 16-bit columns tile ``cols``."""
    return 128 if cols % 64 == 0 else 64 if cols % 32 == 0 else 32


def wgmma_backward_swizzles(tiling: "Tiling") -> tuple[int, int]:
    """Swizzle widths (bytes a panel row) of the Hopper backward's Q/dO and
    K/V tiles (``WgmmaBackwardTraits``' QTile, KvTile): narrowed until each
    consumer's columns of dK and dV (Q, dO) and the column blocks of dQ
    that the consumers would split (K; ``kDqSplitCols``, kept where they
    take dQ by turns instead) start on a panel."""
    d = tiling.head_dim_padded
    consumers = tiling.warps // 4 - 1
    acc_cols = d // consumers if backward_splits_head_dim(d) else d
    dq_cols = d * (tiling.block_m // 64) // consumers
    return widest_swizzle_bytes(acc_cols), widest_swizzle_bytes(dq_cols)


def backward_splits_head_dim(head_dim_padded: int) -> bool:
    """Whether the tensor-core backwards share their keys between warpgroups
    (Hopper, ``WgmmaBackwardTraits::kSplitHeadDim``) or pairs of warps
    (mma.sync, ``MmaBackwardTraits::kSplitHeadDim``) and split the head dim:
    above 128, dK and dV of one warp's 16 keys do not fit its registers."""
    return head_dim_padded > 128


def wgmma_product_dim(head_dim: int, head_dim_padded: int) -> int:
    """The head-dim columns the Hopper kernels' products run over for
    ``head_dim`` in its bucket ``head_dim_padded`` (``kProductDim`` of
    ``WgmmaForwardTraits`` and ``WgmmaBackwardTraits``: the forward's S and
    O, the backward's S^T, dP^T, dV and dK; dQ stays the bucket's), or 0 for
    the whole bucket: the head dim rounded up to a k16 step where that is
    one of ``WGMMA_PRODUCT_DIMS`` inside the bucket and below its width.
    The padded columns are zeros: products over them add nothing, and at
    head dim 112 they were an eighth of the work (H200, bf16, 4k keys: the
    backward 4-6% faster stopped at 112, 8% at head dim 40 stopped at 48;
    docs/perf-notes.md). No width of the table lies in a bucket above 128,
    where the backward's consumers split the head dim."""
    width = -(-head_dim // 16) * 16
    if width in WGMMA_PRODUCT_DIMS and pad_head_dim(width) == head_dim_padded:  # no table width is a bucket
        return width
    return 0


def pad_head_dim(head_dim: int) -> int:
    """The compiled head dim that serves ``head_dim`` (the smallest bucket >= it)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def smem_tile_bytes(rows: int, cols: int, element_size: int) -> int:
    """Bytes of one shared-memory tile; mirrors ``SmemTile`` in
    ``kernels_cu/simt_traits.cuh``: rows padded by one 4-byte word, each
    tile rounded up to 16 bytes."""
    pad = 1 if element_size >= 4 else 4 // element_size
    return -(-rows * (cols + pad) * element_size // 16) * 16


@dataclass(frozen=True)
class Tiling:
    """Tiles of one kernel launch: ``block_m`` query rows and ``block_n`` keys
    per tile, ``warps`` warps per thread block, head dim padded to
    ``head_dim_padded``."""

    head_dim_padded: int
    block_m: int
    block_n: int
    warps: int
    #: which kernel: "simt" (flash_fwd.cu, flash_bwd.cu), "mma" (mma.sync,
    #: sm_80+: flash_fwd_mma.cu, flash_bwd_mma.cu) or "wgmma" (Hopper, sm_90a:
    #: flash_fwd_wgmma.cu, flash_bwd_wgmma.cu)
    kernel: str = "simt"
    #: K/V buffers of the mma.sync forward (1, or a ring of 2 to 4, see
    #: MmaForwardTraits); of the wgmma forward's ring (2 or 3)
    kv_stages: int = 1
    #: Q/dO buffers of the tensor-core backwards (1 or 2, see
    #: MmaBackwardTraits, WgmmaBackwardTraits)
    q_stages: int = 2
    #: resident blocks per SM the wgmma forward's register budget is set for
    #: (its launch bounds); the other kernels leave it to the compiler
    blocks_per_sm: int = 1
    #: split-KV (the mma.sync forward's kSplitKv): the keys of each query
    #: block are cut into ranges, one thread block each, whose float32
    #: partial results a merge kernel combines (decoding)
    split_kv: bool = False
    #: the mma.sync forward's warps split each key block's keys, not the
    #: query rows (kWarpsSplitKeys: decoding's one m16 tile of rows)
    warps_split_keys: bool = False
    #: split-KV in exactly this many ranges, which run as one thread-block
    #: cluster per query block and merge there through distributed shared
    #: memory (kernels_cu/cluster_states.cuh; Hopper): no partial buffers,
    #: no merge kernel. 1: the merge kernel combines a split_kv launch's ranges
    cluster_splits: int = 1
    #: the mma.sync forward's key blocks of K and V come by the Tensor
    #: Memory Accelerator (tensor maps, swizzled buffers, an mbarrier per
    #: stage: kKvTma in flash_fwd_mma.cu; Hopper): the one-tile decode tiles
    #: of dense batches, contiguous caches and paged ones whose pages tile a
    #: key block (``copy_engine_box_rows``)
    kv_tma: bool = False
    #: the wgmma forward's blocks are persistent: one per resident slot, each
    #: walking the query tiles gridDim.x apart with Q double-buffered, so a
    #: tile's copies start while the previous tile runs (``wgmma_forward_persistent``)
    persistent: bool = False
    #: the Hopper kernels' products stop at this many columns of the head
    #: dim (``wgmma_product_dim``); 0: they run over the whole
    #: ``head_dim_padded``
    product_dim: int = 0

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        # a width wgmma_product_dim gives some head dim of this bucket
        if self.product_dim and not (self.kernel == "wgmma" and
                                     wgmma_product_dim(self.product_dim, self.head_dim_padded) == self.product_dim):
            raise ValueError(f"product_dim must be 0 or one of {WGMMA_PRODUCT_DIMS} inside and below "
                             f"head_dim_padded on a wgmma tiling, got {self.product_dim} for {self.kernel} tiles of "
                             f"head_dim_padded {self.head_dim_padded}")
        if self.cluster_splits > 1 and not (self.split_kv and self.warps_split_keys):
            raise ValueError("cluster_splits applies to split-KV decode tiles whose warps split the keys")
        if self.kv_tma and not (self.kernel == "mma" and self.kv_stages >= 2):
            raise ValueError("kv_tma applies to the mma.sync forward with a ring of K/V buffers")

    @property
    def product_columns(self) -> int:
        """The head-dim columns the Hopper kernels' products run over
        (``kProductDim``: the forward's S and O, the backward's S^T, dP^T,
        dV and dK): ``product_dim``, else the whole ``head_dim_padded``."""
        return self.product_dim or self.head_dim_padded

    @property
    def keys_last_to_first(self) -> bool:
        """Whether this forward visits key blocks last to first with a
        rescale slack, as both tensor-core forwards (mma.sync, wgmma) do
        (see ``cuflash.reference.attention_tiled``)."""
        return self.kernel != "simt"

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def _tiles(self, dtype_name: str) -> dict[str, int]:
        e = ELEMENT_SIZE[dtype_name]
        d, m, n = self.head_dim_padded, self.block_m, self.block_n
        return {
            "q": smem_tile_bytes(m, d, e),  # Q or dO rows
            "k": smem_tile_bytes(n, d, e),  # K or V rows
            "score": smem_tile_bytes(m, n, 4),  # P or dS, query-major
            "score_t": smem_tile_bytes(n, m, 4),  # P^T or dS^T, key-major
            "row_stats": smem_tile_bytes(1, m, 4),  # LSE or delta per query row
        }

    def forward_smem_bytes(self, dtype_name: str) -> int:
        """``ForwardSmem::kBytes``: Q, K, V, P; for the mma.sync forward
        ``MmaForwardTraits::kBytes``: Q and ``kv_stages`` buffers of K and V,
        rows padded by 16 bytes (with ``kv_tma``, K and V unpadded and
        swizzled after Q rounded up to a swizzle atom, their mbarriers and
        the alignment slack); for the wgmma forward
        ``WgmmaForwardTraits::kBytes``: Q (two buffers where
        ``persistent``) and ``kv_stages`` unpadded (swizzled) buffers of K
        and V, the mbarriers, plus the alignment slack."""
        if self.kernel == "mma":
            row_bytes = self.head_dim_padded * ELEMENT_SIZE[dtype_name]
            kv_rows = 2 * self.kv_stages * self.block_n
            if not self.kv_tma:
                return (self.block_m + kv_rows) * (row_bytes + 16)
            # Q's padded rows up to a swizzle atom, the unpadded K/V rings, their mbarriers, the alignment slack.
            q_bytes = -(-self.block_m * (row_bytes + 16) // WGMMA_SMEM_ALIGNMENT) * WGMMA_SMEM_ALIGNMENT
            return q_bytes + kv_rows * row_bytes + 8 * self.kv_stages + WGMMA_SMEM_ALIGNMENT
        if self.kernel == "wgmma":
            q_buffers = 2 if self.persistent else 1
            rows = q_buffers * self.block_m + 2 * self.kv_stages * self.block_n
            return (rows * self.head_dim_padded * ELEMENT_SIZE[dtype_name]
                    + wgmma_forward_barrier_bytes(self.kv_stages, q_buffers) + WGMMA_SMEM_ALIGNMENT)
        t = self._tiles(dtype_name)
        return t["q"] + 2 * t["k"] + t["score"]

    def backward_dkdv_smem_bytes(self, dtype_name: str, dq_mode: str | None = None) -> int:
        """``BackwardDkDvSmem::kBytes``: K, V, Q, dO, P^T, dS^T, LSE, delta;
        for the mma.sync backward ``MmaBackwardTraits::kBytes``: K, V,
        ``q_stages`` buffers of Q and dO (rows padded by 8 elements), dS^T
        (and P^T where the head dim is split; 16-bit, rows padded), as many
        buffers of LSE and delta; for the wgmma backward
        ``WgmmaBackwardTraits::kBytes``: K, V, ``q_stages`` buffers of Q and
        dO, two of dS^T (and P^T where the head dim is split; 16-bit,
        swizzled), the float32 dQ tile (in the direct dQ mode: the dQ tile
        and the first O tile in the input dtype), ``q_stages`` buffers of
        LSE and delta, the mbarriers, plus the alignment slack; ``dq_mode``
        "direct" where its O tiles fit (``wgmma_direct_computes_delta``): the
        second O tile, on a swizzle atom after the barriers."""
        d, m, n = self.head_dim_padded, self.block_m, self.block_n
        score_tiles = 2 if backward_splits_head_dim(d) else 1  # dS^T, and P^T where split
        if self.kernel == "mma":
            q = self.q_stages
            return ((2 * n * (d + 8) + 2 * q * m * (d + 8) + score_tiles * n * (m + 8)) * ELEMENT_SIZE[dtype_name]
                    + q * 2 * m * 4)
        if self.kernel == "wgmma":
            layout = _wgmma_backward_layout(self, ELEMENT_SIZE[dtype_name])
            direct = dq_mode == "direct" and layout["direct"] is not None
            return layout["direct" if direct else "barriers_end"] + WGMMA_SMEM_ALIGNMENT
        t = self._tiles(dtype_name)
        return 2 * t["k"] + 2 * t["q"] + 2 * t["score_t"] + 2 * t["row_stats"]

    def backward_dq_smem_bytes(self, dtype_name: str) -> int:
        """``BackwardDqSmem::kBytes``: Q, dO, K, V, dS."""
        t = self._tiles(dtype_name)
        return 2 * t["q"] + 2 * t["k"] + t["score"]


def _wgmma_backward_layout(tiling: "Tiling", e: int) -> dict:
    """Byte offsets of ``WgmmaBackwardTraits`` (``e``-byte elements):
    ``barriers_end``, the end of every mode's layout (K, V, the Q and dO
    stages, the two score buffers, the float32 dQ tile, the statistics, the
    barriers: K/V full; Q full, dO full, empty per stage; dQ full, empty,
    store job; the job's slot; delta written per stage), and ``direct``, the
    end of the direct dQ mode's with its second O tile (two stages; one
    stage has its only O tile in the dQ tile's second half), or None where
    that does not fit the budget (``WgmmaBackwardTraits::kComputesDelta``)."""
    d, m, n, q = tiling.head_dim_padded, tiling.block_m, tiling.block_n, tiling.q_stages
    score_tiles = 2 if backward_splits_head_dim(d) else 1  # dS^T, and P^T where split
    barriers = 8 * (1 + 3 * q + 3) + 8 + 8 * q
    end = (2 * n * d + 2 * q * m * d + 2 * score_tiles * n * m) * e + m * d * 4 + q * 2 * m * 4 + barriers
    second_o = -(-end // WGMMA_SMEM_ALIGNMENT) * WGMMA_SMEM_ALIGNMENT
    direct = second_o + m * d * e if q > 1 else end
    return {"barriers_end": end, "direct": direct if direct + WGMMA_SMEM_ALIGNMENT <= MAX_SMEM_BYTES else None}


def wgmma_direct_computes_delta(tiling: "Tiling") -> bool:
    """Whether the Hopper dK/dV kernel of ``tiling`` in the direct dQ mode
    computes delta itself (``WgmmaBackwardTraits::kComputesDelta``: its O
    tiles fit in shared memory; all but head dim 192's two stages). Then
    that backward is the one kernel, with no work buffer; otherwise the
    preprocessing kernel computes delta before it."""
    return tiling.kernel == "wgmma" and _wgmma_backward_layout(tiling, 2)["direct"] is not None


def _check_budget(smem_bytes: int, what: str) -> None:
    if smem_bytes > MAX_SMEM_BYTES:  # pragma: no cover - table invariant, tested
        raise AssertionError(f"{what} needs {smem_bytes} bytes of shared memory")


def forward_tiling(dtype_name: str, head_dim: int) -> Tiling:
    """Tiles of the forward kernel (and of the deterministic dQ kernel).

    Each query row is owned by ``threads / block_m`` lanes; the table keeps a
    lane's output columns (head_dim_padded / lanes) at 32 or fewer so the
    accumulator stays in registers, and keeps float32 tiles of the largest head
    dims small enough for two blocks per SM.
    """
    if dtype_name not in ELEMENT_SIZE:
        raise ValueError(f"dtype must be one of {sorted(ELEMENT_SIZE)}, got {dtype_name!r}")
    padded = pad_head_dim(head_dim)
    if padded <= 64:
        block_m, block_n = 64, 64
    elif padded <= 128:
        block_m, block_n = 32, 64
    else:
        block_m, block_n = 16, 32 if dtype_name == "float32" else 64
    tiling = Tiling(head_dim_padded=padded, block_m=block_m, block_n=block_n, warps=4)
    _check_budget(tiling.forward_smem_bytes(dtype_name), f"forward {tiling} for {dtype_name}")
    _check_budget(tiling.backward_dq_smem_bytes(dtype_name), f"backward dQ {tiling} for {dtype_name}")
    return tiling


def _mma_bucket(dtype_name: str, head_dim: int) -> int:
    """The mma.sync head-dim bucket serving (dtype, head_dim); ValueError
    where the tensor-core kernels do not apply (``mma_applies``)."""
    if dtype_name not in MMA_DTYPES:
        raise ValueError(f"the tensor-core forward takes {MMA_DTYPES}, got {dtype_name!r}")
    if head_dim <= 0 or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the tensor-core forward takes head_dim a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}")
    return next(b for b in MMA_FORWARD_TILES if head_dim <= b)


def _bucket_in(tiles: dict, kernel: str, dtype_name: str, head_dim: int) -> int:
    """The tensor-core bucket serving (dtype, head_dim), where ``tiles`` (a
    tile table keyed by bucket) has it; ValueError naming ``kernel`` otherwise."""
    padded = _mma_bucket(dtype_name, head_dim)
    if padded not in tiles:
        raise ValueError(f"the {kernel} takes head dims in buckets {list(tiles)}, got {head_dim} (bucket {padded})")
    return padded


def _served_by(tiles: dict, dtype_name: str, head_dim: int) -> bool:
    try:
        _bucket_in(tiles, "", dtype_name, head_dim)
    except ValueError:
        return False
    return True


def mma_applies(dtype_name: str, head_dim: int) -> bool:
    """Whether (dtype, head_dim) is one the tensor-core kernels serve."""
    return _served_by(MMA_FORWARD_TILES, dtype_name, head_dim)


def _mma_forward_bucket(dtype_name: str, head_dim: int) -> int:
    """The mma.sync forward's head-dim bucket: float32 (3xTF32) takes the
    16-bit buckets; ValueError where the forward does not serve it."""
    return _mma_bucket("float16" if dtype_name == MMA_3XTF32_DTYPE else dtype_name, head_dim)


def mma_forward_applies(dtype_name: str, head_dim: int) -> bool:
    """Whether the mma.sync forward serves (dtype, head_dim): float16 and
    bfloat16, or float32 by 3xTF32, head_dim a multiple of 8 up to 256."""
    try:
        _mma_forward_bucket(dtype_name, head_dim)
    except ValueError:
        return False
    return True


def mma_forward_tiling(dtype_name: str, head_dim: int) -> Tiling:
    """Tiles of the mma.sync forward (sm_80+), for float16/bfloat16 (or
    float32 by 3xTF32, ``MMA_3XTF32_FORWARD_TILES``) and head_dim a multiple
    of 8 (the launcher checks the rest: alignment, scale > 0)."""
    padded = _mma_forward_bucket(dtype_name, head_dim)
    table = MMA_3XTF32_FORWARD_TILES if dtype_name == MMA_3XTF32_DTYPE else MMA_FORWARD_TILES
    return _mma_forward_tiles(dtype_name, padded, table[padded])


def mma_forward_hopper_tiling(dtype_name: str, head_dim: int) -> Tiling | None:
    """The mma.sync forward's tiles on Hopper where they differ from
    ``mma_forward_tiling``'s (``MMA_3XTF32_HOPPER_TILES``), else None."""
    if dtype_name != MMA_3XTF32_DTYPE:
        return None
    padded = _mma_forward_bucket(dtype_name, head_dim)
    tiles = MMA_3XTF32_HOPPER_TILES.get(padded)
    return None if tiles is None else _mma_forward_tiles(dtype_name, padded, tiles)


#: Split-KV fills one wave of one decode block an SM, each block with a
#: ring of three K/V buffers (``decode_ring``, on Hopper's copy engine):
#: the bytes in flight of two blocks of two buffers an SM, with half the
#: blocks' fixed costs and half the states to merge. Measured on the H100
#: (bf16 d128, one token, GPU us with launches queued, one process;
#: docs/perf-notes.md, "Decoding: one block an SM"): against two blocks an
#: SM of two buffers each (kept from b20e290 until then), 1 x 65536 keys,
#: 4 K/V heads 57.0 -> 55.3 (16-row pages 58.4 -> 55.8), 1 x 131072 100.6
#: -> 98.0, 8 heads 185.8 -> 182.9, 32 x 4096, 4 heads 97.0 -> 94.2; the
#: other points of the decode table within 1% (the worst, 8 x 65536, 4
#: heads, 16-row pages, 368.7 -> 372.3).
DECODE_BLOCKS_PER_SM = 1
#: The merge kernel reads up to this many states' columns in one round
#: trip (``kStatesInFlight``, kernels_cu/merge_states.cu); a count past it
#: takes it instead where that many ranges are longer by at most
#: 1 / DECODE_MERGE_ROUND_TOLERANCE: 1 x 131072 keys, 4 K/V heads on the
#: H100, 33 ranges of 63 key blocks (132 blocks) 100.1 us, 32 of 64 (128
#: blocks) 98.0. (Not measured past 1.6% longer ranges.)
DECODE_MERGE_STATES_A_ROUND = 32
DECODE_MERGE_ROUND_TOLERANCE = 0.95
#: cuflash's decode takes, among split counts that fit the slots in one
#: wave, the one that fills it best (wave_efficient_splits' tolerance 1),
#: not FlashAttention-2's smallest within 85% of the best: at 1 x 131072
#: keys, GQA 32/8 on the H100, 32 ranges (256 of 264 slots) streamed 2.60
#: TB/s, the 85% rule's 29 2.43.
DECODE_WAVE_TOLERANCE = 1.0
#: A decode launch of more blocks than the SMs hold at once, but at most
#: DECODE_TAIL_SPLIT_WAVES times as many, runs as clusters of two key
#: ranges where each keeps DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS key blocks
#: (``decode_tail_split``): unsplit, its second wave leaves most SMs idle.
#: Measured on the H100 (bf16 d128, 4 K/V heads x 128 sequences: 512
#: blocks, 396 held at once; GPU us with launches queued, unsplit -> two
#: ranges in clusters): 4096 keys 362.3 -> 358.5 (16-row pages 376.3 ->
#: 364.1), 16384 keys 1411.6 -> 1386.6 (1493.7 -> 1419.7); the same two
#: ranges merged by the merge kernel lost the gain on contiguous caches
#: (367.7, 1394.8); three and four ranges no better; halves of 8 key
#: blocks (1024 keys) 95.0 -> 97.4, and launches of 2.6 waves or more
#: (1024-2048 blocks) 1-5% slower split.
DECODE_TAIL_SPLIT_WAVES = 1.5
DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS = 32


def wave_efficient_splits(parallel_blocks: int, slots: int, key_blocks: int, max_splits: int = 128,
                          tolerance: float = 0.85) -> int:
    """A split count for split-KV, by the idea FlashAttention-2's launcher
    uses: none when the grid already nearly fills the GPU (80% of its slots);
    otherwise, of the counts that change how many key blocks each split gets,
    the smallest whose last wave is within ``tolerance`` (FlashAttention-2:
    85%) of the best wave efficiency (waves / ceil(waves)). The launcher's
    split-KV count (cuflash.api, ``DECODE_WAVE_TOLERANCE``) and the
    simulator's (cuflash.simulate) both come from here."""
    if parallel_blocks >= 0.8 * slots:
        return 1
    candidates = [s for s in range(1, min(max_splits, slots, key_blocks) + 1)
                  if s == 1 or -(-key_blocks // s) != -(-key_blocks // (s - 1))]
    efficiency = {s: (parallel_blocks * s / slots) / math.ceil(parallel_blocks * s / slots) for s in candidates}
    best = max(efficiency.values())
    return min(s for s in candidates if efficiency[s] >= tolerance * best)


def decode_tail_split(parallel_blocks: int, sms: int, key_blocks: int, blocks_per_sm: Callable[[], int]) -> bool:
    """Whether a decode forward that ``decode_split_count`` leaves unsplit
    (``parallel_blocks`` blocks, ``key_blocks`` key blocks per sequence),
    whose two-block cluster form's SMs (``sms``) hold ``blocks_per_sm()``
    blocks each, runs as clusters of two key ranges instead
    (``DECODE_TAIL_SPLIT_WAVES``): past one wave, within 1.5, each range
    keeping ``DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS`` key blocks. The caller
    asks only where that cluster form exists; ``blocks_per_sm`` is called
    only past the cheap conditions (the launcher compiles the form to learn
    it: at least one block an SM, so no more blocks than SMs never asks)."""
    if not (2 in DECODE_CLUSTER_SPLITS and parallel_blocks > sms
            and key_blocks >= 2 * DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS):
        return False
    held = blocks_per_sm() * sms
    return held < parallel_blocks <= DECODE_TAIL_SPLIT_WAVES * held


def decode_split_count(parallel_blocks: int, sms: int, key_blocks: int) -> int:
    """The launcher's split-KV count for a decode forward of
    ``parallel_blocks`` thread blocks without splits and ``key_blocks`` key
    blocks per sequence on ``sms`` SMs (cuflash.api.decode_splits; the
    simulator models cuflash with it): the count whose blocks fill one wave
    of ``DECODE_BLOCKS_PER_SM`` blocks per SM best, no more than
    ``DECODE_MERGE_STATES_A_ROUND`` where that many ranges are nearly as
    short (``DECODE_MERGE_ROUND_TOLERANCE``), and no more ranges than the
    key blocks make non-empty. (Where this says 1, a launch past one wave
    may still take two clustered ranges:
    ``decode_tail_split``.)"""
    slots = DECODE_BLOCKS_PER_SM * sms
    splits = wave_efficient_splits(parallel_blocks, slots, key_blocks,
                                   max_splits=min(128, -(-slots // max(parallel_blocks, 1))),
                                   tolerance=DECODE_WAVE_TOLERANCE)
    if splits > DECODE_MERGE_STATES_A_ROUND and (DECODE_MERGE_ROUND_TOLERANCE
                                                 * -(-key_blocks // DECODE_MERGE_STATES_A_ROUND)
                                                 <= -(-key_blocks // splits)):
        splits = DECODE_MERGE_STATES_A_ROUND
    per_split = -(-key_blocks // min(splits, key_blocks))
    return -(-key_blocks // per_split)


def decode_tilings(dtype_name: str, head_dim: int, rows: int = DECODE_MAX_ROWS) -> tuple[Tiling, ...]:
    """The mma.sync forward's decode tiles for (dtype, head_dim) and ``rows``
    query rows per K/V head and batch entry, without and with split-KV:
    ``MMA_DECODE_SPLIT_KEYS_TILES`` up to ``DECODE_SPLIT_KEYS_MAX_ROWS``
    rows, else ``MMA_DECODE_TILES``; none for float32."""
    if dtype_name not in MMA_DTYPES:
        return ()
    padded = _mma_forward_bucket(dtype_name, head_dim)
    split_keys = rows <= DECODE_SPLIT_KEYS_MAX_ROWS
    tiles = (MMA_DECODE_SPLIT_KEYS_TILES if split_keys else MMA_DECODE_TILES)[padded]
    return tuple(_mma_forward_tiles(dtype_name, padded, tiles, split_kv=split, warps_split_keys=split_keys)
                 for split in (False, True))


#: Key blocks per range up to which a decode's ranges run as clusters
#: (``decode_cluster_count``), but where the heuristic's two ranges run as
#: clusters of two, at any length: measured on the H100 (bf16 d128, GPU us with launches
#: queued; the heuristic's count through the merge kernel -> the same count
#: as clusters), two ranges gained at 32 key blocks a range (4 x 32 x 4096
#: keys, 4 K/V heads 98.1 -> 94.6, 16-row pages 101.0 -> 97.2; 8 x 16 x
#: 4096 96.8 -> 93.8) and at 128 (4 x 32 x 16384 352.3 -> 349.3), while
#: four and eight lost at 128-256 key blocks a range (8 x 8 x 65536, 8
#: heads 693.8 -> 716.5; 32 x 1 x 65536 349.7 -> 358.0) and broke even at
#: 32-64.
DECODE_CLUSTER_RANGE_BLOCKS = 16
#: A heuristic count above the largest cluster still runs as clusters
#: where their ranges would be this short (``decode_clusters_apply``): the
#: whole call is then a few microseconds, of which the merge launch is a
#: large part. Measured on the H100 (bf16 d128, 1 x 4096 keys, 4 K/V
#: heads, copy-engine K/V): 16 clusters of 4 key blocks 12.3 us against the
#: merge kernel's ranges' 15.0; at 16 key blocks a range (1 x 16384) the
#: merged ranges were faster (19.6 against 21.7).
DECODE_CLUSTER_SHORT_RANGE_BLOCKS = 4


def decode_clusters_apply(splits: int, key_blocks: int) -> bool:
    """Whether a decode whose merge-kernel heuristic asks for ``splits``
    ranges of ``key_blocks`` key blocks may run as clusters
    (``decode_cluster_count`` then picks their count): where the heuristic
    asks for no more than the largest cluster, or the largest cluster's
    ranges would be at most ``DECODE_CLUSTER_SHORT_RANGE_BLOCKS`` long."""
    largest = max(DECODE_CLUSTER_SPLITS, default=0)
    return splits <= largest or key_blocks <= DECODE_CLUSTER_SHORT_RANGE_BLOCKS * largest


def decode_cluster_count(parallel_blocks: int, sms: int, key_blocks: int, blocks_per_sm: int, splits: int) -> int:
    """The split count a decode forward of ``parallel_blocks`` unsplit
    blocks and ``key_blocks`` key blocks per sequence runs as thread-block
    clusters (``decode_cluster_tiling``) when the merge-kernel heuristic
    (``decode_split_count``) asks for at most ``max(DECODE_CLUSTER_SPLITS)``:
    the largest of ``DECODE_CLUSTER_SPLITS`` whose blocks fit in one SM's
    slot fewer than the kernel's ``blocks_per_sm`` on every SM (at least
    one) with two key blocks a range, where the ranges are then at most
    ``DECODE_CLUSTER_RANGE_BLOCKS`` long (at any length where that is two
    and the heuristic asked for two, ``splits``); 1 otherwise (the merge
    kernel combines the heuristic's ranges). Measured on the H100 (bf16 d128, one
    token; docs/perf-notes.md, "Decoding"): clusters win where the merge
    launch is a large part of a short call and lose on long ranges (paged
    caches up to 1.5x slower at 64 key blocks a range, contiguous ones 5%
    at 32) and with their blocks filling every slot."""
    fitting = [c for c in DECODE_CLUSTER_SPLITS
               if parallel_blocks * c <= max(1, blocks_per_sm - 1) * sms and 2 * c <= key_blocks]
    clusters = max(fitting, default=1)
    return clusters if clusters == splits == 2 or key_blocks <= DECODE_CLUSTER_RANGE_BLOCKS * clusters else 1


def decode_cluster_tiling(split: Tiling, splits: int) -> Tiling | None:
    """The cluster-merged form of the split-KV decode tiling ``split`` for a
    launch of ``splits`` key ranges (``Tiling.cluster_splits``), where
    ``splits`` is one of ``DECODE_CLUSTER_SPLITS`` and the tiles' warps split
    the keys; else None (the merge kernel combines the ranges)."""
    if splits not in DECODE_CLUSTER_SPLITS or not (split.split_kv and split.warps_split_keys):
        return None
    return dataclasses.replace(split, cluster_splits=splits)


def copy_engine_box_rows(block_n: int, page_size: int | None = None) -> int | None:
    """Rows of one copy-engine box of K or V (``Tiling.kv_tma``) for key
    blocks of ``block_n`` and a paged cache's ``page_size`` (None: not
    paged): a block's rows, or a page's where pages are shorter; None where
    pages do not tile a block in whole swizzle atoms (pages of a multiple
    of ``block_n`` rows, or of 16 or more rows that divide it), whose rows
    are gathered by cp.async. The kernel takes the same rows
    (``load_key_values`` in flash_fwd_mma.cu)."""
    if page_size is None or page_size % block_n == 0:
        return block_n
    return page_size if block_n % page_size == 0 and page_size >= 16 else None


#: K/V buffers of the copy-engine decode tiles (``decode_ring``) in
#: launches of at most DECODE_DEEP_RING_BLOCKS_PER_SM blocks an SM (every
#: split launch of the heuristic's count, ``DECODE_BLOCKS_PER_SM``), and
#: over a paged cache whose pages are shorter than a key block (one box per page: 16- and 32-row
#: pages) in launches that lose no occupancy by them and whose ranges are
#: short; the others keep the decode tiles' two. Measured on the H100
#: (bf16 d128, one token, every point of the decode table, one process;
#: docs/perf-notes.md): at one block an SM, 32 x 1024 keys, 4 K/V heads
#: (unsplit) 2.29 -> 2.37 TB/s (256-row pages 2.22 -> 2.37), 32 x 4096
#: 94.3 -> 93.1 us, no point slower by more than 1%; four buffers no
#: better (92.6, 28.4 against 28.1 us). Over short pages at up to two blocks an
#: SM (at d128 three buffers leave two, two buffers three) and at most
#: ``DECODE_SHORT_PAGE_RING_RANGE_BLOCKS`` key blocks a block, 32 x 1024
#: keys, 4 K/V heads 1.82 -> 2.15 TB/s, 8 x 1024 and 32 heads +3%, 32 x
#: 1024, 8 heads +1.6%, the others there within 0.5%; longer ranges lost
#: up to 2% (8 x 4096, 32 heads), fuller grids 0.7-1.4% at 1024 blocks
#: (and gained 2-5% at 512 and 2048), clustered launches lost more (fewer
#: clusters fit), as did 256-row pages at the largest calls.
DECODE_RING_STAGES = 3
DECODE_DEEP_RING_BLOCKS_PER_SM = 1
DECODE_SHORT_PAGE_RING_RANGE_BLOCKS = 16


def decode_ring_form(tiling: Tiling, dtype_name: str, smem_per_block: int | None = None) -> Tiling | None:
    """The ``DECODE_RING_STAGES``-buffer form of an unclustered
    copy-engine one-tile decode tiling, where it fits a block's shared
    memory (``smem_per_block``, the GPU's; None: Hopper's); None for other
    tilings or where it does not fit."""
    if not (tiling.kv_tma and tiling.warps_split_keys and tiling.cluster_splits == 1):
        return None
    ringed = dataclasses.replace(tiling, kv_stages=DECODE_RING_STAGES)
    limit = MAX_SMEM_BYTES if smem_per_block is None else smem_per_block
    return ringed if ringed.forward_smem_bytes(dtype_name) <= limit else None


def decode_ring(tiling: Tiling, page_size: int | None, dtype_name: str, blocks: int, range_blocks: int,
                sms: int, smem_per_block: int | None = None) -> Tiling:
    """``tiling``'s ``decode_ring_form`` where it has one and either its
    launch of ``blocks`` thread blocks is at most
    ``DECODE_DEEP_RING_BLOCKS_PER_SM`` blocks an SM on ``sms`` SMs, or the
    pages are shorter than its key block (``page_size``; None: not paged),
    the launch still fits one wave of the blocks an SM holds in that form
    (two at d128 on a Hopper, one at d192 and d256), and each block covers
    at most ``DECODE_SHORT_PAGE_RING_RANGE_BLOCKS`` key blocks
    (``range_blocks``); else ``tiling``."""
    ringed = decode_ring_form(tiling, dtype_name, smem_per_block)
    if ringed is None:
        return tiling
    if blocks <= DECODE_DEEP_RING_BLOCKS_PER_SM * sms:
        return ringed
    if page_size is None or page_size >= tiling.block_n or range_blocks > DECODE_SHORT_PAGE_RING_RANGE_BLOCKS:
        return tiling
    limit = MAX_SMEM_BYTES if smem_per_block is None else smem_per_block
    return ringed if blocks <= limit // ringed.forward_smem_bytes(dtype_name) * sms else tiling


def copy_engine_layouts(tiling: Tiling) -> tuple[str, ...] | None:
    """The batch layouts a copy-engine tiling is built for: dense batches
    and both caches (a ring of ``DECODE_RING_STAGES`` buffers too:
    ``decode_ring`` gives it to any launch of at most
    ``DECODE_DEEP_RING_BLOCKS_PER_SM`` blocks an SM); None for other
    tilings."""
    return ("dense", "cache", "paged") if tiling.kv_tma else None


def every_decode_tiling(dtype_name: str, head_dim: int) -> tuple[Tiling, ...]:
    """Every decode tiling ``decode_tilings`` (and on Hopper
    ``decode_cluster_tiling``, the one-tile tiles' copy-engine forms,
    ``Tiling.kv_tma``, and their deeper rings, ``decode_ring``) may
    choose for (dtype, head_dim)."""
    one_tile = decode_tilings(dtype_name, head_dim, DECODE_SPLIT_KEYS_MAX_ROWS)
    clustered = tuple(decode_cluster_tiling(one_tile[1], splits) for splits in DECODE_CLUSTER_SPLITS) if one_tile else ()
    by_tma = tuple(dataclasses.replace(tiling, kv_tma=True) for tiling in one_tile + clustered)
    rings = tuple(ring for tiling in by_tma if (ring := decode_ring_form(tiling, dtype_name)) is not None)
    return one_tile + decode_tilings(dtype_name, head_dim, DECODE_MAX_ROWS) + clustered + by_tma + rings


def _mma_forward_tiles(dtype_name: str, padded: int, tiles: tuple[int, int, int, int],
                       split_kv: bool = False, warps_split_keys: bool = False) -> Tiling:
    block_m, block_n, warps, stages = tiles
    tiling = Tiling(head_dim_padded=padded, block_m=block_m, block_n=block_n, warps=warps, kernel="mma",
                    kv_stages=stages, split_kv=split_kv, warps_split_keys=warps_split_keys)
    _check_budget(tiling.forward_smem_bytes(dtype_name), f"forward {tiling} for {dtype_name}")
    return tiling


def mma_backward_applies(dtype_name: str, head_dim: int) -> bool:
    """Whether the mma.sync backward serves (dtype, head_dim) (on sm_80+)."""
    return _served_by(MMA_BACKWARD_TILES, dtype_name, head_dim)


def mma_backward_tiling(dtype_name: str, head_dim: int) -> Tiling:
    """Tiles of the mma.sync backward dK/dV kernel, where ``mma_backward_applies``."""
    padded = _bucket_in(MMA_BACKWARD_TILES, "mma.sync backward", dtype_name, head_dim)
    return _mma_backward_tiles(dtype_name, padded, MMA_BACKWARD_TILES[padded])


def mma_backward_99kib_tiling(dtype_name: str, head_dim: int) -> Tiling | None:
    """The mma.sync backward's tiles on GPUs with 99 KiB of shared memory
    per block where ``mma_backward_tiling``'s need more
    (``MMA_BACKWARD_99KIB_TILES``), else None."""
    padded = _bucket_in(MMA_BACKWARD_TILES, "mma.sync backward", dtype_name, head_dim)
    tiles = MMA_BACKWARD_99KIB_TILES.get(padded)
    return None if tiles is None else _mma_backward_tiles(dtype_name, padded, tiles)


def _mma_backward_tiles(dtype_name: str, padded: int, tiles: tuple[int, int, int, int]) -> Tiling:
    block_m, block_n, warps, q_stages = tiles
    tiling = Tiling(head_dim_padded=padded, block_m=block_m, block_n=block_n, warps=warps, kernel="mma",
                    q_stages=q_stages)
    _check_budget(tiling.backward_dkdv_smem_bytes(dtype_name), f"backward dK/dV {tiling} for {dtype_name}")
    return tiling


def wgmma_forward_applies(dtype_name: str, head_dim: int) -> bool:
    """Whether the Hopper forward serves (dtype, head_dim) (on sm_90a)."""
    return _served_by(WGMMA_FORWARD_TILES, dtype_name, head_dim)


def wgmma_backward_applies(dtype_name: str, head_dim: int) -> bool:
    """Whether the Hopper backward serves (dtype, head_dim) (on sm_90a)."""
    return _served_by(WGMMA_BACKWARD_TILES, dtype_name, head_dim)


def wgmma_forward_tiling(dtype_name: str, head_dim: int) -> Tiling:
    """Tiles of the Hopper forward (wgmma, sm_90a), where ``wgmma_forward_applies``, its products stopping at
    ``wgmma_product_dim``."""
    padded = _bucket_in(WGMMA_FORWARD_TILES, "Hopper forward", dtype_name, head_dim)
    table = WGMMA_FORWARD_TILES
    if rows_end_mid_sector(dtype_name, head_dim) and padded in WGMMA_FORWARD_PARTIAL_SECTOR_TILES:
        table = WGMMA_FORWARD_PARTIAL_SECTOR_TILES
    return _wgmma_forward_tiles(dtype_name, head_dim, padded, table[padded])


#: Bytes a 32-byte sector holds: the copy engine reads global memory by them.
SECTOR_BYTES = 32


def rows_end_mid_sector(dtype_name: str, head_dim: int) -> bool:
    """Whether a row of ``head_dim`` elements ends inside a sector
    (``SECTOR_BYTES``; 16 bits: head dims 8, 24, 40, ...), which the Hopper
    forward's tiles treat apart."""
    return bool(head_dim * ELEMENT_SIZE[dtype_name] % SECTOR_BYTES)


def wgmma_forward_short_tilings(dtype_name: str, head_dim: int) -> tuple[tuple[ShortSequenceTile, Tiling], ...]:
    """The Hopper forward's rules for short sequences and their tiles: ``WGMMA_FORWARD_SHORT_TILES``'s, or
    ``WGMMA_FORWARD_PARTIAL_SECTOR_SHORT_TILES``' where rows end inside a 32-byte sector; none where that
    table has none for this head dim's bucket."""
    padded = _bucket_in(WGMMA_FORWARD_TILES, "Hopper forward", dtype_name, head_dim)
    table = (WGMMA_FORWARD_PARTIAL_SECTOR_SHORT_TILES if rows_end_mid_sector(dtype_name, head_dim)
             else WGMMA_FORWARD_SHORT_TILES)
    return tuple((rule, _wgmma_forward_tiles(dtype_name, head_dim, padded, rule.tile))
                 for rule in table.get(padded, ()))


def wgmma_forward_short_tiles(dtype_name: str, head_dim: int) -> tuple[Tiling, ...]:
    """The tiles of ``wgmma_forward_short_tilings``."""
    return tuple(tiling for _, tiling in wgmma_forward_short_tilings(dtype_name, head_dim))


def wgmma_forward_for_call(tiling: Tiling, dtype_name: str, head_dim: int, mask_name: str, layout: str,
                           dropout: bool, seqlen_k: int) -> Tiling:
    """The Hopper forward a call runs, from its table tiling ``tiling``: the
    first short-sequence tile that serves it (its mask, at most its keys
    per sequence, and where persistent blocks apply only if it serves those:
    ``WGMMA_FORWARD_SHORT_TILES``), else the table's; persistent where
    ``wgmma_forward_persistent`` says."""
    table = wgmma_forward_persistent(tiling, dtype_name, mask_name, layout, dropout, seqlen_k)
    for rule, short in wgmma_forward_short_tilings(dtype_name, head_dim):
        if (seqlen_k <= rule.most_keys and (rule.masks is None or mask_name in rule.masks)
                and (rule.serves_persistent or not table.persistent)):
            return wgmma_forward_persistent(short, dtype_name, mask_name, layout, dropout, seqlen_k)
    return table


def wgmma_forward_key_limits() -> tuple[int, ...]:
    """The key counts up to which ``wgmma_forward_for_call`` keeps a choice
    (a short-sequence tile's most keys, persistent blocks' limits): past
    each of them its answer may change."""
    limits = {rule.most_keys for table in (WGMMA_FORWARD_SHORT_TILES, WGMMA_FORWARD_PARTIAL_SECTOR_SHORT_TILES)
              for rules in table.values() for rule in rules}
    return tuple(sorted(limits | set(PERSISTENT_FORWARD_KEYS.values())))


def _wgmma_forward_tiles(dtype_name: str, head_dim: int, padded: int, entry: tuple[int, int, int, int]) -> Tiling:
    """The Hopper forward's ``Tiling`` of a table entry (block_m, block_n, warps, blocks per SM) for ``head_dim``
    in its bucket ``padded``, its shared memory checked against the budget."""
    block_m, block_n, warps, blocks_per_sm = entry
    tiling = with_wgmma_forward_stages(Tiling(head_dim_padded=padded, block_m=block_m, block_n=block_n, warps=warps,
                                              kernel="wgmma", blocks_per_sm=blocks_per_sm,
                                              product_dim=wgmma_product_dim(head_dim, padded)), dtype_name)
    _check_budget(tiling.forward_smem_bytes(dtype_name), f"forward {tiling} for {dtype_name}")
    return tiling


#: Keys per sequence up to which the Hopper forward runs persistent blocks
#: (``wgmma_forward_persistent``), by the tiling's blocks per SM. Measured
#: on the H100 (bf16, FA2 grid, one process, TFLOP/s, one tile a block ->
#: persistent, commit 0c50e0a's kernel): one block an SM (d128's 128 x 128
#: tile), full 2k 621 -> 650, 4k 675 -> 686, 8k 700 -> 697, 16k 690 -> 669;
#: causal 4k 585 -> 609, 8k 640 -> 658, 16k 696 -> 682; two blocks an SM
#: (d64's 64 x 128), full 1k 386 -> 413, 2k 443 -> 447, 4k 475 -> 464;
#: causal (tiles taken in pairs of a long and a short walk,
#: ``persistent_grid``) 2k 0.390 -> 0.385 ms, 4k 1% slower; three blocks an
#: SM (d64's causal 64 x 64, H100, df5ead3): 512 224 -> 239, 1k 309 -> 314,
#: 2k 374 -> 368 TFLOP/s.
PERSISTENT_FORWARD_KEYS = {1: 8192, 2: 2048, 3: 1024}


def wgmma_forward_persistent(tiling: Tiling, dtype_name: str, mask_name: str, layout: str,
                             dropout: bool = False, seqlen_k: int = 0) -> Tiling:
    """``tiling`` (a Hopper forward's) persistent on dense batches without a
    mask or with a causal one, up to ``PERSISTENT_FORWARD_KEYS`` keys, with
    the stages that then fit (``with_wgmma_forward_stages``); as it is
    otherwise (a packed batch's or another mask's tiles differ in ways a
    static share does not even out), and with dropout (whose Philox rounds
    beside the tile walk's registers spill: 304 bytes at head dim 256)."""
    if (mask_name not in ("none", "causal") or layout != "dense" or dropout
            or seqlen_k > PERSISTENT_FORWARD_KEYS[tiling.blocks_per_sm]):
        return tiling
    persistent = with_wgmma_forward_stages(dataclasses.replace(tiling, persistent=True), dtype_name)
    _check_budget(persistent.forward_smem_bytes(dtype_name), f"forward {persistent} for {dtype_name}")
    return persistent


def wgmma_forward_persistent_form(dtype_name: str, tiling: Tiling) -> Tiling | None:
    """The persistent form the launcher may run of a Hopper forward tiling:
    none for the short-sequence tiles that it takes only where persistent
    blocks do not apply (``wgmma_forward_for_call``)."""
    shorts = wgmma_forward_short_tilings(dtype_name, tiling.product_columns)  # a head dim its products fit
    if any(short == tiling and not rule.serves_persistent for rule, short in shorts):
        return None
    return wgmma_forward_persistent(tiling, dtype_name, "none", "dense")


def persistent_grid(tiles: int, slots: int, tiles_per_head: int, paired: bool) -> int:
    """Blocks of a persistent forward of ``tiles`` query tiles
    (``tiles_per_head`` a head) on ``slots`` resident slots: one a slot, or
    fewer where there are fewer steps to share. Paired (a causal mask's
    uneven tiles, kernels_cu/grid.cuh ``PersistentTileWalk``), a block's
    share is units of two tiles, ceil(tiles_per_head / 2) a head."""
    return min(_walk_units(tiles, tiles_per_head) if paired else tiles, slots)


def _walk_units(tiles: int, tiles_per_head: int) -> int:
    """A paired walk's units: ceil(tiles_per_head / 2) a head (kernels_cu/grid.cuh ``PersistentTileWalk::units``)."""
    return tiles // tiles_per_head * -(-tiles_per_head // 2)


def persistent_tile_walks(num_tiles: int, tiles_per_head: int, grid: int, paired: bool) -> list[list[int]]:
    """The tiles (indices, head-major) each of ``grid`` blocks takes, in
    order, as kernels_cu/grid.cuh's ``PersistentTileWalk`` hands them out
    (its Python mirror, for models and tests; ``persistent_grid`` sizes the
    grid): block g takes steps g, g + grid, ...; paired, a step names a unit
    of a head's tiles p and even - 1 - p (even: tiles_per_head rounded up to
    even), the long one in even rounds and the short one in odd rounds, and
    a position past the head's tiles is no tile."""
    walks = [[] for _ in range(grid)]
    if not paired:
        for tile in range(num_tiles):
            walks[tile % grid].append(tile)
        return walks
    units = _walk_units(num_tiles, tiles_per_head)
    end = 2 * -(-units // grid) * grid
    even = tiles_per_head + tiles_per_head % 2
    for step in range(end):
        round_, lane = divmod(step, grid)
        unit = round_ // 2 * grid + lane
        if unit >= units:
            continue
        head, p = divmod(unit, even // 2)
        position = p if round_ % 2 == 0 else even - 1 - p
        if position < tiles_per_head:
            walks[lane].append(head * tiles_per_head + position)
    return walks


def with_wgmma_forward_stages(tiling: Tiling, dtype_name: str) -> Tiling:
    """``tiling`` (a Hopper forward's) with the most K/V stages, up to
    ``WGMMA_FORWARD_MAX_STAGES``, whose shared memory its ``blocks_per_sm``
    resident blocks hold; two where none more fit."""
    for stages in range(WGMMA_FORWARD_MAX_STAGES, 2, -1):
        staged = dataclasses.replace(tiling, kv_stages=stages)
        smem = staged.forward_smem_bytes(dtype_name)
        if smem <= MAX_SMEM_BYTES and tiling.blocks_per_sm * (smem + SMEM_RESERVED_PER_BLOCK) <= SMEM_PER_SM:
            return staged
    return dataclasses.replace(tiling, kv_stages=2)


def wgmma_backward_tiling(dtype_name: str, head_dim: int) -> Tiling:
    """Tiles of the Hopper backward dK/dV kernel, where ``wgmma_backward_applies``, its products stopping at
    ``wgmma_product_dim``."""
    padded = _bucket_in(WGMMA_BACKWARD_TILES, "Hopper backward", dtype_name, head_dim)
    block_m, block_n, warps, q_stages = WGMMA_BACKWARD_TILES[padded]
    tiling = Tiling(head_dim_padded=padded, block_m=block_m, block_n=block_n, warps=warps, kernel="wgmma",
                    q_stages=q_stages, product_dim=wgmma_product_dim(head_dim, padded))
    _check_budget(tiling.backward_dkdv_smem_bytes(dtype_name), f"backward dK/dV {tiling} for {dtype_name}")
    return tiling


def backward_tiling(dtype_name: str, head_dim: int) -> Tiling:
    """Tiles of the backward dK/dV kernel: one thread block per ``block_n``
    keys, walking the query rows ``block_m`` at a time.

    Each key is owned by ``threads / block_n`` lanes, which hold that key's dK
    and dV columns in registers; ``block_n * head_dim_padded`` stays at 32 per
    thread for each of the two accumulators.
    """
    if dtype_name not in ELEMENT_SIZE:
        raise ValueError(f"dtype must be one of {sorted(ELEMENT_SIZE)}, got {dtype_name!r}")
    padded = pad_head_dim(head_dim)
    warps = 8
    block_n = 32 * 32 * warps // padded  # 32 columns of dK and of dV per lane
    block_n = min(128, 1 << (block_n.bit_length() - 1))  # a power of two
    tiling = Tiling(head_dim_padded=padded, block_m=32, block_n=block_n, warps=warps)
    _check_budget(tiling.backward_dkdv_smem_bytes(dtype_name), f"backward dK/dV {tiling} for {dtype_name}")
    return tiling
