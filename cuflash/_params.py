"""The kernels' parameter structs as NumPy structured dtypes.

CuPy passes a one-element structured array to a kernel as a struct by value.
Field order and types here must match ``kernels_cu/params.cuh``; the dtypes
are aligned as a C compiler aligns the structs (a lone float32 before an
8-byte field is padded). tests/test_tiling.py compiles a host program that
prints the C++ offsets and compares them.
"""

from __future__ import annotations

import numpy as np

_POINTER = np.uint64
_INDEX = np.int64

#: A (batch, seqlen, heads, dim) tensor: pointer and strides in elements.
TENSOR_REF = np.dtype(
    [("ptr", _POINTER), ("batch_stride", _INDEX), ("row_stride", _INDEX), ("head_stride", _INDEX)],
    align=True,
)

#: ProblemSize: a dense batch's sizes, or a packed (variable-length) batch's
#: with its cu_seqlens pointers (null when dense); total_q, total_k: the rows
#: of the q-side and k-side tensors; a KV cache's per-entry key counts
#: (seqused_k, null where every entry has seqlen_k keys) and page table
#: (block_table, null for a contiguous cache).
PROBLEM_SIZE = np.dtype(
    [*[(name, _INDEX) for name in ("batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "head_dim")],
     ("cu_seqlens_q", _POINTER), ("cu_seqlens_k", _POINTER), ("total_q", _INDEX), ("total_k", _INDEX),
     ("seqused_k", _POINTER), ("block_table", _POINTER), ("block_table_stride", _INDEX), ("page_size", _INDEX)],
    align=True,
)

#: VariantParams: the run-time values of the mask and score policies
#: (window sides, soft cap, ALiBi slopes, dropout), 0 where a call has none.
#: The dropout seed and offset (or the seed's GPU address) are written by
#: each call (plan slots).
VARIANT_PARAMS = np.dtype(
    [("window_left", _INDEX), ("window_right", _INDEX), ("softcap", np.float32),
     ("inverse_softcap", np.float32), ("alibi_slopes", _POINTER), ("alibi_batch_stride", _INDEX),
     ("inverse_scale", np.float32), ("scale", np.float32), ("dropout_seed", np.uint64),
     ("dropout_offset", np.uint64), ("dropout_threshold", _INDEX), ("dropout_inverse_keep", np.float32),
     ("dropout_seed_pointer", _POINTER), *[(f"user_array{i}", _POINTER) for i in range(4)],
     ("tile_map", _POINTER), ("tile_map_batch_stride", _INDEX), ("tile_map_head_stride", _INDEX),
     ("tile_map_block_m", _INDEX), ("tile_map_block_n", _INDEX)],
    align=True,
)

#: VariantParams of a call with no window, soft cap, ALiBi or dropout.
NO_VARIANT = tuple(0 for _ in VARIANT_PARAMS.names)

FORWARD_PARAMS = np.dtype(
    [
        *[(name, TENSOR_REF) for name in ("q", "k", "v", "out")],
        ("lse", _POINTER),
        ("lse_batch_stride", _INDEX),
        ("lse_head_stride", _INDEX),
        ("size", PROBLEM_SIZE),
        ("num_m_blocks", _INDEX),
        ("softmax_scale_log2", np.float32),
        ("kv_pair_maps", np.int32),
        ("num_splits", _INDEX),
        ("out_split_stride", _INDEX),
        ("lse_split_stride", _INDEX),
        ("variant", VARIANT_PARAMS),
    ],
    align=True,
)

#: MergeParams (params.cuh; kernels_cu/merge_states.cu).
MERGE_PARAMS = np.dtype(
    [
        ("out", TENSOR_REF),
        ("lse", _POINTER),
        ("lse_batch_stride", _INDEX),
        ("lse_head_stride", _INDEX),
        ("lse_row_stride", _INDEX),
        ("partial", TENSOR_REF),
        ("partial_lse", _POINTER),
        ("partial_lse_batch_stride", _INDEX),
        ("partial_lse_head_stride", _INDEX),
        ("partial_lse_row_stride", _INDEX),
        ("num_states", _INDEX),
        ("partial_state_stride", _INDEX),
        ("partial_lse_state_stride", _INDEX),
        ("size", PROBLEM_SIZE),
    ],
    align=True,
)

#: CacheAppendParams (params.cuh; kernels_cu/kv_cache_append.cu).
CACHE_APPEND_PARAMS = np.dtype(
    [
        *[(name, TENSOR_REF) for name in ("k_new", "v_new", "k_cache", "v_cache")],
        ("cache_seqlens", _POINTER),
        ("seqused_k", _POINTER),
        ("cache_seqlen", _INDEX),
        ("seqlen_new", _INDEX),
        ("size", PROBLEM_SIZE),
    ],
    align=True,
)

BACKWARD_PARAMS = np.dtype(
    [
        *[(name, TENSOR_REF) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")],
        ("lse", _POINTER),
        ("lse_batch_stride", _INDEX),
        ("lse_head_stride", _INDEX),
        ("delta", _POINTER),
        ("dq_accum", _POINTER),
        ("dq_semaphore", _POINTER),
        ("size", PROBLEM_SIZE),
        ("num_m_blocks", _INDEX),
        ("num_n_blocks", _INDEX),
        ("rotate_walks", _INDEX),
        ("softmax_scale_log2", np.float32),
        ("softmax_scale", np.float32),
        ("variant", VARIANT_PARAMS),
        ("dq_block_m", _INDEX),
    ],
    align=True,
)

#: A CUtensorMap (cuda.h; params.cuh's TensorMap): 128 opaque bytes, 64-byte aligned.
TENSOR_MAP = np.dtype((np.uint64, 16))
TENSOR_MAP_ALIGNMENT = 64


def _with_maps(base: np.dtype, maps: tuple[str, ...]) -> np.dtype:
    """A struct deriving from ``base`` with tensor maps after it (params.cuh):
    ``base``'s fields, then the maps from ``base`` rounded up to their alignment."""
    start = -(-base.itemsize // TENSOR_MAP_ALIGNMENT) * TENSOR_MAP_ALIGNMENT
    return np.dtype({
        "names": [*base.names, *maps],
        "formats": [*(base.fields[name][0] for name in base.names), *(TENSOR_MAP for _ in maps)],
        "offsets": [*(base.fields[name][1] for name in base.names),
                    *(start + TENSOR_MAP.itemsize * i for i in range(len(maps)))],
        "itemsize": start + TENSOR_MAP.itemsize * len(maps),
    })


#: WgmmaForwardParams (params.cuh): ForwardParams, then the maps of Q, K, V
#: and the output (persistent blocks store their rows through it), and K's
#: and V's two head-pair maps each (``kv_pair_maps``).
WGMMA_FORWARD_PARAMS = _with_maps(FORWARD_PARAMS, ("q_map", "k_map", "v_map", "out_map", "k_pair_map0",
                                                   "k_pair_map1", "v_pair_map0", "v_pair_map1"))
#: WgmmaBackwardParams: BackwardParams, then the maps of Q, K, V, dO and the
#: float32 dQ accumulator (the direct dQ mode: of dq), and of the output (the
#: direct dQ mode's, from which the kernel computes delta).
WGMMA_BACKWARD_PARAMS = _with_maps(BACKWARD_PARAMS, ("q_map", "k_map", "v_map", "do_map", "dq_map", "o_map"))

#: sizeof() of the C++ structs, as params.cuh's static_asserts pin them.
FORWARD_PARAMS_SIZE = 4 * 32 + 3 * 8 + 14 * 8 + 2 * 8 + 3 * 8 + 20 * 8
BACKWARD_PARAMS_SIZE = 8 * 32 + 6 * 8 + 14 * 8 + 5 * 8 + 20 * 8
MERGE_PARAMS_SIZE = 2 * 32 + 2 * 8 + 6 * 8 + 3 * 8 + 14 * 8
CACHE_APPEND_PARAMS_SIZE = 4 * 32 + 4 * 8 + 14 * 8
assert FORWARD_PARAMS.itemsize == FORWARD_PARAMS_SIZE
assert MERGE_PARAMS.itemsize == MERGE_PARAMS_SIZE
assert CACHE_APPEND_PARAMS.itemsize == CACHE_APPEND_PARAMS_SIZE
assert BACKWARD_PARAMS.itemsize == BACKWARD_PARAMS_SIZE


def tensor_ref(layout) -> tuple[int, int, int, int]:
    """TensorRef fields of a 4-D (batch, seqlen, heads, dim) array layout
    (``.strides`` in bytes, ``.itemsize``), its pointer left 0: launch plans
    write the pointer of each call (``cuflash._launch.LaunchPlan``)."""
    batch, row, head = (stride // layout.itemsize for stride in layout.strides[:3])
    # A batch of one is never stepped over; 0 also serves a packed batch, whose
    # kernels address every sequence in entry 0 (kernels_cu/block_info.cuh).
    return (0, batch if layout.shape[0] > 1 else 0, row, head)


def flat_fields(dtype: np.dtype, prefix: str = "") -> list[tuple[str, int]]:
    """(dotted C++ member path, byte offset) of every scalar field of ``dtype``."""
    fields = []
    for name in dtype.names:
        sub, offset = dtype.fields[name][:2]
        if sub.names:
            fields += [(f"{prefix}{name}.{path}", offset + inner) for path, inner in flat_fields(sub)]
        else:
            fields.append((f"{prefix}{name}", offset))
    return fields


def pack(dtype: np.dtype, **fields) -> np.ndarray:
    """A one-element struct of ``dtype`` with every top-level field set, by
    name (nested structs as tuples), its memory ``TENSOR_MAP_ALIGNMENT``-byte
    aligned (tensor maps are encoded in place). A field left
    out or a name the struct does not have is an error: a silently zero
    stride or pointer would be a wrong answer, not a crash; tensor maps
    (``TENSOR_MAP`` fields) may be left out: the launch plan encodes them."""
    maps = {name for name in dtype.names if dtype.fields[name][0] == TENSOR_MAP}
    missing = set(dtype.names) - set(fields) - maps
    unknown = set(fields) - set(dtype.names)
    if missing or unknown:
        raise KeyError(f"struct fields missing {sorted(missing)}, unknown {sorted(unknown)}")
    storage = np.zeros(dtype.itemsize + TENSOR_MAP_ALIGNMENT, dtype=np.uint8)
    start = -storage.ctypes.data % TENSOR_MAP_ALIGNMENT
    struct = storage[start:start + dtype.itemsize].view(dtype)
    for name, value in fields.items():
        struct[name] = value
    return struct
