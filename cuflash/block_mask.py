"""User masks and their tile maps: ``mask_mod(b, h, q_idx, kv_idx,
**mod_arrays)`` written in Python (``cuflash.mods``), traced into the
kernels' ``UserMask`` policy, and the tile map (kernels_cu/tile_map.cuh) by
which the kernels skip the tiles it hides wholly and apply it element by
element only where a tile is partial.

A ``BlockMask`` is FlexAttention's ``create_block_mask``: made once for a
mask, its sizes and its arrays, and passed as ``mask_mod=`` to every call
that uses it, it builds each tile map the calls need (one per kernel
tiling: the forward's and the backward's tiles differ) on the GPU the
first time and keeps it. A plain function passed as ``mask_mod=`` builds
its map in each call. A map is one int32 per tile and a few per row and
column of tiles, per batch entry and head the function reads (one section
shared along a dimension it does not read); nothing of the scores' size.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import mods
from ._kernel_families import KernelVariant

#: Threads of the tile-state kernel (one block per tile).
_STATE_THREADS = 256

#: kernels_cu/block_map.cu's TileMapShape.
TILE_MAP_SHAPE = np.dtype([("batch_stride", np.int64), ("head_stride", np.int64), ("map_heads", np.int32),
                           ("seqlen_q", np.int32), ("seqlen_k", np.int32), ("block_m", np.int32),
                           ("block_n", np.int32)], align=True)

_LIST_TILES = KernelVariant(source="block_map.cu", function="cuflash::list_tiles", params="", template_args=(),
                            key="block-map/list-tiles", threads=32, smem_bytes=0)


def tile_section_size(m_tiles: int, n_tiles: int) -> int:
    """Ints of one (batch entry, head) section of a tile map (tile_map.cuh)."""
    return 4 * m_tiles * n_tiles + m_tiles + n_tiles


def tile_map_strides(dims: tuple[int, int], seqlen_q: int, seqlen_k: int, block_m: int,
                     block_n: int) -> tuple[int, int, int]:
    """(batch stride, head stride, total ints) of a map of ``dims`` (batch
    entries, heads: 1 where shared) sections at tiles of block_m x block_n;
    a stride is 0 along a shared dimension."""
    section = tile_section_size(-(-seqlen_q // block_m), -(-seqlen_k // block_n))
    batches, heads = dims
    return (heads * section if batches > 1 else 0), (section if heads > 1 else 0), batches * heads * section


def tile_states_reference(condition: np.ndarray, block_m: int, block_n: int) -> np.ndarray:
    """The tile states (0 empty, 1 partial, 2 full) of a boolean
    (..., seqlen_q, seqlen_k) condition, as block_map.cu computes them (NumPy)."""
    seqlen_q, seqlen_k = condition.shape[-2:]
    m_tiles, n_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    states = np.zeros(condition.shape[:-2] + (m_tiles, n_tiles), dtype=np.int32)
    for m in range(m_tiles):
        for n in range(n_tiles):
            tile = condition[..., m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
            visible, hidden = tile.any(axis=(-2, -1)), (~tile).any(axis=(-2, -1))
            states[..., m, n] = np.where(visible, np.where(hidden, 1, 2), 0)
    return states


def tile_map_reference(states: np.ndarray) -> np.ndarray:
    """The whole section (tile_map.cuh's layout, flattened) of one (M, N)
    array of tile states."""
    m_tiles, n_tiles = states.shape
    ranks = np.full((m_tiles, n_tiles), -1, dtype=np.int64)
    key_lists = np.zeros((m_tiles, n_tiles), dtype=np.int64)
    query_lists = np.zeros((n_tiles, m_tiles), dtype=np.int64)
    key_counts = (states != 0).sum(axis=1)
    query_counts = (states != 0).sum(axis=0)
    for m in range(m_tiles):
        listed = np.flatnonzero(states[m])
        ranks[m, listed] = np.arange(len(listed))
        key_lists[m, :len(listed)] = listed
    for n in range(n_tiles):
        listed = np.flatnonzero(states[:, n])
        query_lists[n, :len(listed)] = listed
    return np.concatenate([states.ravel(), ranks.ravel(), key_lists.ravel(), query_lists.ravel(), key_counts,
                           query_counts])


class BlockMask:
    """A mask function with the tile maps the kernels skip tiles by.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx, **mod_arrays)`` returning a
            condition (True: query ``q_idx`` sees key ``kv_idx``), written with
            comparisons, ``&``, ``|``, ``~``, arithmetic and ``cuflash.mods``
            functions over symbolic values (``cuflash.mods``), or indexing
            the arrays.
        batch, nheads: the calls' batch size and query heads; None where the
            function does not read ``b`` / ``h`` (one map section serves all).
        seqlen_q, seqlen_k: the calls' sequence lengths.
        mod_arrays: name -> GPU array (C-contiguous; float32, float16,
            bfloat16, int32, int64 or bool) the function reads by name. The
            maps are built from their contents at first use: make a new
            BlockMask when they change.
    """

    def __init__(self, mask_mod: Callable, batch: int | None, nheads: int | None, seqlen_q: int, seqlen_k: int,
                 mod_arrays: dict | None = None):
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx, **mod_arrays), "
                            f"got {type(mask_mod).__name__}")
        for name, value in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name, value in (("batch", batch), ("nheads", nheads)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None (shared), got {value!r}")
        if mod_arrays is not None and not isinstance(mod_arrays, dict):
            raise TypeError(f"mod_arrays must be a dict of name -> array, got {type(mod_arrays).__name__}")
        self.mask_mod = mask_mod
        self.batch, self.nheads = batch, nheads
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.mod_arrays = dict(mod_arrays or {})
        trace = mods.trace_mask_mod(mask_mod, self.mod_arrays)
        for position, size, what in (("b", batch, "batch"), ("h", nheads, "nheads")):
            if size is None and mods.reads_variable(trace.value, position):
                raise ValueError(f"mask_mod reads {position}, so the BlockMask needs {what} (got None)")
        self._maps: dict = {}

    def __repr__(self) -> str:
        return (f"BlockMask({getattr(self.mask_mod, '__name__', 'mask_mod')}, batch={self.batch}, "
                f"nheads={self.nheads}, seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, "
                f"arrays={sorted(self.mod_arrays)})")

    def check_call(self, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> None:
        """A ValueError unless a call of these sizes may use this mask."""
        for what, mine, theirs in (("batch", self.batch, batch), ("nheads", self.nheads, nheads),
                                   ("seqlen_q", self.seqlen_q, seqlen_q), ("seqlen_k", self.seqlen_k, seqlen_k)):
            if mine is not None and mine != theirs:
                raise ValueError(f"mask_mod is a BlockMask for {what} {mine}, but the call has {what} {theirs}")

    def tile_map(self, mask, dims: tuple[int, int], block_m: int, block_n: int, array_views: list, device: int):
        """The CuPy int32 tile map at tiles of block_m x block_n (built on the
        current stream the first time): ``mask`` the call's registered
        ``UserMaskPolicy``, ``dims`` its sections (batch entries, heads),
        ``array_views`` the call's mod arrays as CuPy views in slot order."""
        key = (mask.name, dims, block_m, block_n, device)
        built = self._maps.get(key)
        if built is None:
            built = build_tile_map(mask, dims, self.seqlen_q, self.seqlen_k, block_m, block_n, array_views, device)
            self._maps[key] = built
        return built


def build_tile_map(mask, dims: tuple[int, int], seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                   array_views: list, device: int):
    """A tile map (kernels_cu/tile_map.cuh) of ``mask`` (a registered
    ``UserMaskPolicy``) over ``dims`` sections, built on the GPU on the
    current stream by block_map.cu's two kernels."""
    import cupy

    from ._loader import loader

    batch_stride, head_stride, total = tile_map_strides(dims, seqlen_q, seqlen_k, block_m, block_n)
    m_tiles, n_tiles = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    sections = dims[0] * dims[1]
    if max(m_tiles, sections) > 65535:
        raise ValueError(f"a tile map of {m_tiles} query tiles and {sections} sections is more than the "
                         f"builder's grid takes (65535 each)")
    tile_map = cupy.empty(total, dtype=cupy.int32)
    shape = np.zeros(1, dtype=TILE_MAP_SHAPE)
    shape[0] = (batch_stride, head_stride, dims[1], seqlen_q, seqlen_k, block_m, block_n)
    pointers = [np.uint64(view.data.ptr if view is not None else 0) for view in array_views]
    pointers += [np.uint64(0)] * (mods.MAX_ARRAYS - len(pointers))
    states = KernelVariant(source="block_map.cu", function="cuflash::fill_tile_states", params="",
                           template_args=(mask.rule_cxx,), key=f"block-map/states/{mask.name}",
                           threads=_STATE_THREADS, smem_bytes=0, prelude=mask.prelude)
    if m_tiles and n_tiles:
        loader.get(states, device)((n_tiles, m_tiles, sections), (_STATE_THREADS,), (tile_map, *pointers, shape))
    loader.get(_LIST_TILES, device)((m_tiles + n_tiles, 1, sections), (32,), (tile_map, shape))
    return tile_map


def block_mask(mask_mod: Callable, batch: int | None, nheads: int | None, seqlen_q: int, seqlen_k: int,
               mod_arrays: dict | None = None) -> BlockMask:
    """A ``BlockMask`` (see there): a mask function made once and reused
    by every call of these sizes, its tile maps built once each."""
    return BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, mod_arrays)
