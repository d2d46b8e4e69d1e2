"""The public attention functions: arrays in, arrays of the same kind out."""

from __future__ import annotations

import math

from . import _interop
from ._kernels import forward_variant
from ._loader import loader
from ._params import FORWARD_PARAMS, pack
from ._tiling import forward_tiling
from ._validation import AttentionProblem, check_forward, check_same_device, meta_of

_LOG2E = math.log2(math.e)
_MAX_GRID_X = 2**31 - 1


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None):
    """Exact softmax attention, ``softmax(scale * q @ k^T) @ v``, computed
    tile by tile (FlashAttention-2): memory O(seqlen), never O(seqlen^2).

    Args:
        q: (batch, seqlen_q, nheads, head_dim) query, float16, bfloat16 or float32,
            on a CUDA GPU: a CuPy array, PyTorch tensor, JAX array or any DLPack
            producer. Any strides on the first three dimensions; the last must be
            contiguous. head_dim from 1 to 256.
        k, v: (batch, seqlen_k, nheads_k, head_dim), same dtype and GPU as q;
            nheads_k divides nheads (multi-query / grouped-query attention:
            query head h uses key/value head h // (nheads // nheads_k)).
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. A query that sees no key gets output 0
            and log-sum-exp -inf.
        softmax_scale: scale of q.k; default 1 / sqrt(head_dim).
        return_lse: also return the log-sum-exp of each query row.
        out: optional (batch, seqlen_q, nheads, head_dim) array of q's dtype to
            write the output into (not for JAX, whose arrays are immutable).

    Returns:
        ``out`` shaped like q, of q's framework (CuPy for CuPy and generic
        DLPack inputs), or ``(out, lse)`` with lse (batch, nheads, seqlen_q)
        float32 when ``return_lse``. Kernels run on the current stream of q's
        framework (PyTorch's current stream, CuPy's current stream).
    """
    return _attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              return_lse=return_lse, out=out)


def _attention_forward(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                       out=None, lse=None):
    """``attention`` with an optional preallocated CuPy ``lse`` buffer (tests
    poison it to prove that every element gets written)."""
    import cupy

    arrays = {"q": q, "k": k, "v": v}
    if out is not None:
        arrays["out"] = out
    frameworks = {name: _interop.framework_of(x, name) for name, x in arrays.items()}
    devices = {name: _interop.device_of(x, frameworks[name]) for name, x in arrays.items()}
    if out is not None and frameworks["out"] == _interop.JAX:
        raise TypeError("out must be a mutable GPU array; JAX arrays are immutable, so leave out=None")
    bridge = _interop.bridge_for(q, frameworks["q"], devices["q"])
    for name, device in devices.items():
        if device != bridge.device_id:
            raise ValueError(f"{name} is on GPU {device} but q is on GPU {bridge.device_id}")

    with cupy.cuda.Device(bridge.device_id), bridge.stream:
        views = {name: bridge.as_cupy(x, frameworks[name]) for name, x in arrays.items()}
        metas = {name: meta_of(name, view) for name, view in views.items()}
        problem = check_forward(metas["q"], metas["k"], metas["v"], metas.get("out"),
                                causal=causal, softmax_scale=softmax_scale)
        lse_shape = (problem.batch, problem.nheads, problem.seqlen_q)
        if lse is not None:
            lse_meta = meta_of("lse", lse)
            check_same_device([metas["q"], lse_meta])
            if lse_meta.shape != lse_shape or lse_meta.dtype != "float32" or not lse.flags.c_contiguous:
                raise ValueError(f"lse must be a C-contiguous float32 array of shape {lse_shape}")
        if out is None:
            out_native, out_view = bridge.empty(tuple(views["q"].shape), views["q"].dtype)
        else:
            out_native, out_view = out, views["out"]
        if lse is None:
            lse_native, lse_view = bridge.empty(lse_shape, "float32")
        else:
            lse_native, lse_view = lse, lse
        if not problem.is_empty:
            _launch_forward(problem, views["q"], views["k"], views["v"], out_view, lse_view, bridge.stream)
        result = bridge.export(out_native, out_view) if out is None else out
        if return_lse:
            return result, bridge.export(lse_native, lse_view)
        return result


def _launch_forward(problem: AttentionProblem, q, k, v, out, lse, stream) -> None:
    tiling = forward_tiling(problem.dtype, problem.head_dim)
    variant = forward_variant(problem.dtype, tiling, problem.causal)
    num_m_blocks = -(-problem.seqlen_q // tiling.block_m)
    grid = num_m_blocks * problem.nheads * problem.batch
    if grid > _MAX_GRID_X:
        raise ValueError(
            f"batch * nheads * ceil(seqlen_q / {tiling.block_m}) must be below 2**31 thread blocks, got {grid}"
        )
    kernel = loader.get(variant, problem.device)

    def strides(array):
        itemsize = array.dtype.itemsize
        return [s // itemsize for s in array.strides[:3]]

    fields = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "out": out.data.ptr, "lse": lse.data.ptr}
    for name, array in (("q", q), ("k", k), ("v", v), ("out", out)):
        batch_stride, row_stride, head_stride = strides(array)
        fields[f"{name}_batch_stride"] = batch_stride
        fields[f"{name}_row_stride"] = row_stride
        fields[f"{name}_head_stride"] = head_stride
    params = pack(
        FORWARD_PARAMS,
        **fields,
        lse_batch_stride=problem.nheads * problem.seqlen_q,
        lse_head_stride=problem.seqlen_q,
        batch=problem.batch,
        nheads=problem.nheads,
        nheads_k=problem.nheads_k,
        seqlen_q=problem.seqlen_q,
        seqlen_k=problem.seqlen_k,
        head_dim=problem.head_dim,
        num_m_blocks=num_m_blocks,
        softmax_scale_log2=problem.softmax_scale * _LOG2E,
    )
    kernel((grid,), (variant.threads,), (params,), shared_mem=variant.smem_bytes, stream=stream)
