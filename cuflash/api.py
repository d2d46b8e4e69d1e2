"""The public attention functions: arrays in, arrays of the same kind out."""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

from . import _interop
from ._kernels import (
    backward_dkdv_variant,
    backward_dq_variant,
    backward_elementwise_variant,
    forward_variant,
)
from ._loader import builds_sm90a, loader
from ._params import BACKWARD_PARAMS, FORWARD_PARAMS, pack, tensor_ref
from ._tiling import (
    Tiling,
    backward_tiling,
    default_backward_tiling,
    default_forward_tiling,
    forward_tiling,
)
from ._validation import AttentionProblem, check_backward, check_forward, meta_of

_LOG2E = math.log2(math.e)
_MAX_GRID_X = 2**31 - 1
#: Blocks of the grid-stride element-wise backward kernels (preprocess, dQ conversion).
_ELEMENTWISE_BLOCKS = 4096


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, lse=None):
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
        lse: optional (batch, nheads, seqlen_q) C-contiguous float32 array to
            write the log-sum-exp into. With ``out`` and ``lse`` given the call
            allocates nothing, as CUDA graph capture needs.

    Returns:
        ``out`` shaped like q, of q's framework (CuPy for CuPy and generic
        DLPack inputs), or ``(out, lse)`` with lse (batch, nheads, seqlen_q)
        float32 when ``return_lse``. Kernels run on the current stream of q's
        framework (PyTorch's current stream, CuPy's current stream).
    """
    return _attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                              return_lse=return_lse, out=out, lse=lse)


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False,
                       dq=None, dk=None, dv=None):
    """Gradients of ``attention`` with respect to q, k and v, recomputing the
    attention probabilities tile by tile from the forward's log-sum-exp
    (FlashAttention-2 backward): memory O(seqlen), never O(seqlen^2).

    Args:
        dout: (batch, seqlen_q, nheads, head_dim) gradient of the output, q's dtype.
        q, k, v: the forward's inputs, as for ``attention``.
        out: (batch, seqlen_q, nheads, head_dim) the forward's output.
        lse: (batch, nheads, seqlen_q) float32, the forward's log-sum-exp
            (``attention(..., return_lse=True)``).
        causal, softmax_scale: as given to the forward.
        deterministic: if True, dq is bitwise identical from run to run (dQ is
            summed in a fixed order by a second pass instead of float32 atomics;
            this mode runs on the SIMT kernels, about 35x slower than the
            default on an H100). dk and dv are always deterministic.
        dq, dk, dv: optional arrays to write the gradients into, shaped and
            typed like q, k, v (not for JAX).

    Returns:
        ``(dq, dk, dv)`` shaped and typed like q, k, v, in q's framework. With
        grouped-query attention, dk and dv are summed over the query heads that
        share each key/value head. Kernels run on the current stream of q's
        framework.
    """
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    given = {name: x for name, x in (("dq", dq), ("dk", dk), ("dv", dv)) if x is not None}
    with _call(arrays | given, immutable_outputs=tuple(given)) as (bridge, views):
        metas = {name: meta_of(name, view) for name, view in views.items()}
        problem = check_backward(
            metas["dout"], metas["q"], metas["k"], metas["v"], metas["out"], metas["lse"],
            metas.get("dq"), metas.get("dk"), metas.get("dv"),
            causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
        )
        grads = {}
        for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            if name in given:
                grads[name] = (given[name], views[name])
            else:
                grads[name] = bridge.empty(tuple(views[like].shape), views[like].dtype)
        _launch_backward(problem, views, {name: view for name, (_, view) in grads.items()},
                         bool(deterministic), bridge)
        return tuple(
            given[name] if name in given else bridge.export(native, view)
            for name, (native, view) in grads.items()
        )


@contextmanager
def _call(arrays: dict, immutable_outputs: tuple[str, ...] = ()):
    """Checks that ``arrays`` (which include q, whose framework, device and
    stream the call takes) are GPU arrays on one device and yields the call's
    bridge and CuPy views of them, inside that device and stream."""
    import cupy

    frameworks = {name: _interop.framework_of(x, name) for name, x in arrays.items()}
    for name in immutable_outputs:
        if frameworks[name] == _interop.JAX:
            raise TypeError(f"{name} must be a mutable GPU array; JAX arrays are immutable, so leave {name}=None")
    devices = {name: _interop.device_of(x, frameworks[name]) for name, x in arrays.items()}
    lead = "q"
    bridge = _interop.bridge_for(arrays[lead], frameworks[lead], devices[lead])
    for name, device in devices.items():
        if device != bridge.device_id:
            raise ValueError(f"{name} is on GPU {device} but {lead} is on GPU {bridge.device_id}")
    with cupy.cuda.Device(bridge.device_id), bridge.stream:
        views = {name: bridge.as_cupy(x, frameworks[name]) for name, x in arrays.items()}
        yield bridge, views


def _attention_forward(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
                       out=None, lse=None):
    arrays = {"q": q, "k": k, "v": v}
    given = {name: x for name, x in (("out", out), ("lse", lse)) if x is not None}
    with _call(arrays | given, immutable_outputs=tuple(given)) as (bridge, views):
        metas = {name: meta_of(name, view) for name, view in views.items()}
        problem = check_forward(metas["q"], metas["k"], metas["v"], metas.get("out"),
                                causal=causal, softmax_scale=softmax_scale, lse=metas.get("lse"))
        lse_shape = (problem.batch, problem.nheads, problem.seqlen_q)
        outputs = {}
        for name, shape, dtype in (("out", tuple(views["q"].shape), views["q"].dtype), ("lse", lse_shape, "float32")):
            outputs[name] = (given[name], views[name]) if name in given else bridge.empty(shape, dtype)
        if not problem.is_empty:
            _launch_forward(problem, views["q"], views["k"], views["v"], outputs["out"][1], outputs["lse"][1],
                            bridge.stream)
        results = [given[name] if name in given else bridge.export(*outputs[name])
                   for name in (("out", "lse") if return_lse else ("out",))]
        return tuple(results) if return_lse else results[0]


def _grid_size(tiles: int, problem: AttentionProblem, heads: int, what: str) -> int:
    grid = tiles * heads * problem.batch
    if grid > _MAX_GRID_X:
        raise ValueError(f"{what} would need {grid} thread blocks, more than 2**31 - 1")
    return grid


def _size_fields(problem: AttentionProblem) -> tuple:
    return (problem.batch, problem.nheads, problem.nheads_k, problem.seqlen_q, problem.seqlen_k, problem.head_dim)


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def _rows_are_16_byte_chunks(x) -> bool:
    """Whether every 8 consecutive 16-bit elements of a row, from the row's
    start, are one aligned 16-byte load: the base pointer and the stride of
    every dimension but the last (contiguous) one, where that dimension has
    more than one entry, are multiples of 16 bytes."""
    return x.data.ptr % 16 == 0 and all(
        stride % 16 == 0 for size, stride in zip(x.shape[:-1], x.strides[:-1]) if size > 1)


def forward_tiling_for(problem: AttentionProblem, arrays) -> Tiling:
    """The forward kernel a problem runs on. The tensor-core kernels need
    float16/bfloat16 with head_dim a multiple of 8 (``default_forward_tiling``
    decides by dtype, head dim and device generation), and at run time a
    positive softmax scale and 16-byte aligned rows (``arrays``: q, k, v, out
    as CuPy views); otherwise the SIMT kernel runs (same results, slower)."""
    if problem.softmax_scale > 0 and all(map(_rows_are_16_byte_chunks, arrays)):
        return default_forward_tiling(problem.dtype, problem.head_dim, _kernel_generation(problem.device))
    return forward_tiling(problem.dtype, problem.head_dim)


def _kernel_generation(device_id: int) -> int:
    """The compute capability the kernels can be built for on ``device_id``:
    Hopper's own instructions (sm_90a) need NVRTC 12.9 or newer (see
    ``cuflash._loader.compile_options``); with an older one a Hopper runs the
    sm_80 kernels."""
    capability = _compute_capability(device_id)
    if capability == 90 and not builds_sm90a():
        return 80
    return capability


def _launch_forward(problem: AttentionProblem, q, k, v, out, lse, stream, tiling: Tiling | None = None) -> None:
    """``tiling`` overrides the table (benchmarks of other tile sizes); by
    default ``forward_tiling_for`` decides."""
    tiling = tiling or forward_tiling_for(problem, (q, k, v, out))
    variant = forward_variant(problem.dtype, tiling, problem.causal)
    num_m_blocks = -(-problem.seqlen_q // tiling.block_m)
    grid = _grid_size(num_m_blocks, problem, problem.nheads, "the forward pass")
    kernel = loader.get(variant, problem.device)
    params = pack(
        FORWARD_PARAMS,
        q=tensor_ref(q), k=tensor_ref(k), v=tensor_ref(v), out=tensor_ref(out),
        lse=lse.data.ptr,
        lse_batch_stride=problem.nheads * problem.seqlen_q,
        lse_head_stride=problem.seqlen_q,
        size=_size_fields(problem),
        num_m_blocks=num_m_blocks,
        softmax_scale_log2=problem.softmax_scale * _LOG2E,
    )
    kernel((grid,), (variant.threads,), (params,), shared_mem=variant.smem_bytes, stream=stream)


def backward_tiling_for(problem: AttentionProblem, views: dict, grads: dict, deterministic: bool) -> Tiling:
    """The dK/dV kernel a backward runs on: the Hopper (wgmma) kernel where
    ``default_backward_tiling`` says so and q, k, v, dout, dk and dv have
    16-byte aligned rows (cp.async copies in, 16-byte stores out); the SIMT
    kernel otherwise."""
    arrays = [views[name] for name in ("q", "k", "v", "dout")] + [grads[name] for name in ("dk", "dv")]
    if all(map(_rows_are_16_byte_chunks, arrays)):
        return default_backward_tiling(problem.dtype, problem.head_dim, _kernel_generation(problem.device),
                                       deterministic)
    return backward_tiling(problem.dtype, problem.head_dim)


def _launch_backward(problem: AttentionProblem, views: dict, grads: dict, deterministic: bool, bridge) -> None:
    """Preprocess (delta, zeroed dQ accumulator), dK/dV (with atomic dQ, or
    without and then the deterministic dQ pass), then dQ conversion."""
    dkdv_tiling = backward_tiling_for(problem, views, grads, deterministic)
    dq_tiling = forward_tiling(problem.dtype, problem.head_dim)
    rows = problem.batch * problem.seqlen_q * problem.nheads
    # Work buffers: delta (batch, nheads, seqlen_q) and, unless deterministic,
    # the float32 dQ accumulator (batch, seqlen_q, nheads, head_dim).
    # They come from the caller's framework (PyTorch's caching allocator for
    # PyTorch callers), on the call's stream.
    delta = bridge.empty((problem.batch, problem.nheads, problem.seqlen_q), "float32")[1]
    dq_accum = None if deterministic else bridge.empty(
        (problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim), "float32")[1]
    lse = views["lse"]
    itemsize = lse.dtype.itemsize
    num_m_blocks_dkdv = -(-problem.seqlen_q // dkdv_tiling.block_m)
    num_n_blocks = -(-problem.seqlen_k // dkdv_tiling.block_n)
    params = pack(
        BACKWARD_PARAMS,
        **{name: tensor_ref(views[name]) for name in ("q", "k", "v", "out", "dout")},
        **{name: tensor_ref(grads[name]) for name in ("dq", "dk", "dv")},
        lse=lse.data.ptr,
        lse_batch_stride=lse.strides[0] // itemsize,
        lse_head_stride=lse.strides[1] // itemsize,
        delta=delta.data.ptr,
        dq_accum=0 if dq_accum is None else dq_accum.data.ptr,
        size=_size_fields(problem),
        num_m_blocks=num_m_blocks_dkdv,
        num_n_blocks=num_n_blocks,
        softmax_scale_log2=problem.softmax_scale * _LOG2E,
        softmax_scale=problem.softmax_scale,
    )
    stream, device = bridge.stream, problem.device

    def elementwise(kind: str, work: int):
        variant = backward_elementwise_variant(kind, problem.dtype)
        blocks = max(1, min(_ELEMENTWISE_BLOCKS, -(-work // variant.threads)))
        loader.get(variant, device)((blocks,), (variant.threads,), (params,), stream=stream)

    if rows:
        elementwise("preprocess", rows * 32)  # one warp per query row
    grid = _grid_size(num_n_blocks, problem, problem.nheads_k, "the backward dK/dV pass")
    if grid:  # with seqlen_q == 0 this still runs, and writes dk = dv = 0
        variant = backward_dkdv_variant(problem.dtype, dkdv_tiling, problem.causal, accumulate_dq=not deterministic)
        loader.get(variant, device)((grid,), (variant.threads,), (params,), shared_mem=variant.smem_bytes,
                                    stream=stream)
    if not rows:
        return
    if deterministic:
        # The dQ pass has the forward's tiles; its grid is over those query blocks.
        params["num_m_blocks"] = -(-problem.seqlen_q // dq_tiling.block_m)
        variant = backward_dq_variant(problem.dtype, dq_tiling, problem.causal)
        grid = _grid_size(int(params["num_m_blocks"][0]), problem, problem.nheads, "the backward dQ pass")
        loader.get(variant, device)((grid,), (variant.threads,), (params,), shared_mem=variant.smem_bytes,
                                    stream=stream)
    else:
        elementwise("convert_dq", rows * 32)  # one warp per query row
