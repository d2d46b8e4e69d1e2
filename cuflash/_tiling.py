"""Tile sizes of cuflash's kernels: the one table the launcher, the NumPy
emulation of the tiled algorithm and the IO simulator all read.

The CUDA side (``kernels_cu/kernel_traits.cuh``) receives these numbers as
template arguments and derives the shared-memory layout from them; the
``forward_smem_bytes`` formula below mirrors that derivation, and the kernel
checks at run time that it was given at least as much as it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Head dims the kernels are compiled for. A head_dim between two entries runs
#: on the next larger one, its extra columns zero-filled inside the kernel.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

#: Bytes per element of each supported storage dtype, by NumPy name.
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}

#: Shared memory a Hopper or Ampere block may use (227 KiB).
MAX_SMEM_BYTES = 227 * 1024


def pad_head_dim(head_dim: int) -> int:
    """The compiled head dim that serves ``head_dim`` (the smallest bucket >= it)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


@dataclass(frozen=True)
class ForwardTiling:
    """Tiles of the forward kernel: ``block_m`` query rows per thread block,
    ``block_n`` keys per streamed K/V tile, ``warps`` warps per block."""

    head_dim_padded: int
    block_m: int
    block_n: int
    warps: int

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self, dtype_name: str) -> int:
        """Dynamic shared memory of one block; mirrors ``KernelTraits::kSmemBytes``."""
        element = ELEMENT_SIZE[dtype_name]
        row_stride = self.head_dim_padded + 4 // element  # one 4-byte word of padding per row
        qkv_bytes = (self.block_m + 2 * self.block_n) * row_stride * element
        p_offset = -(-qkv_bytes // 16) * 16
        return p_offset + self.block_m * (self.block_n + 1) * 4


def forward_tiling(dtype_name: str, head_dim: int) -> ForwardTiling:
    """Tiles for a forward pass over ``dtype_name`` inputs with this head_dim.

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
    tiling = ForwardTiling(head_dim_padded=padded, block_m=block_m, block_n=block_n, warps=4)
    if tiling.smem_bytes(dtype_name) > MAX_SMEM_BYTES:  # pragma: no cover - table invariant, tested
        raise AssertionError(f"tiling {tiling} exceeds shared memory for {dtype_name}")
    return tiling


def visible_key_blocks(m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                       causal: bool) -> int:
    """Key blocks, counted from the first, that a query block starting at row
    ``m_start`` must visit; the rest are fully masked and skipped. Mirrors
    ``visible_key_blocks`` in ``kernels_cu/masking.cuh`` (bottom-right causal
    alignment: row i sees key j iff j <= i + seqlen_k - seqlen_q)."""
    if not causal:
        return -(-seqlen_k // block_n)
    last_row = min(m_start + block_m, seqlen_q) - 1
    last_visible_key = last_row + seqlen_k - seqlen_q
    if last_visible_key < 0:
        return 0
    return -(-min(last_visible_key + 1, seqlen_k) // block_n)
