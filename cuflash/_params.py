"""The kernels' parameter structs as NumPy structured dtypes.

CuPy passes a one-element structured array to a kernel as a struct by value.
Field order and types here must match ``kernels_cu/params.cuh``; every field
is 8 bytes, so the aligned layout has no padding, and both sides pin the size.
"""

from __future__ import annotations

import numpy as np

_POINTER = np.uint64
_INDEX = np.int64

FORWARD_PARAMS = np.dtype(
    [
        ("q", _POINTER),
        ("k", _POINTER),
        ("v", _POINTER),
        ("out", _POINTER),
        ("lse", _POINTER),
        *[
            (f"{tensor}_{stride}_stride", _INDEX)
            for tensor in ("q", "k", "v", "out")
            for stride in ("batch", "row", "head")
        ],
        ("lse_batch_stride", _INDEX),
        ("lse_head_stride", _INDEX),
        ("batch", _INDEX),
        ("nheads", _INDEX),
        ("nheads_k", _INDEX),
        ("seqlen_q", _INDEX),
        ("seqlen_k", _INDEX),
        ("head_dim", _INDEX),
        ("num_m_blocks", _INDEX),
        ("softmax_scale_log2", np.float64),
    ],
    align=True,
)

#: sizeof(ForwardParams) in kernels_cu/params.cuh.
FORWARD_PARAMS_SIZE = 27 * 8
assert FORWARD_PARAMS.itemsize == FORWARD_PARAMS_SIZE


def pack(dtype: np.dtype, **fields) -> np.ndarray:
    """A one-element struct of ``dtype`` with every field set, by name.

    A field left out or a name the struct does not have is an error: a
    silently zero stride or pointer would be a wrong answer, not a crash.
    """
    missing = set(dtype.names) - set(fields)
    unknown = set(fields) - set(dtype.names)
    if missing or unknown:
        raise KeyError(f"struct fields missing {sorted(missing)}, unknown {sorted(unknown)}")
    struct = np.zeros(1, dtype=dtype)
    for name, value in fields.items():
        struct[name] = value
    return struct
