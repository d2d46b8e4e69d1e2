"""Compiling kernels ahead of time: ``cuflash.warmup`` and ``cuflash warmup``.

A first call of a new (dtype, head dim, mask) compiles its kernels with NVRTC,
seconds each; CuPy keeps the result in its on-disk kernel cache
(``CUPY_CACHE_DIR``), so later processes only load it. Warming up plans the
calls a model will make, on the GPU it will run on, exactly as the launcher
plans them (the same tile tables, masks and dQ modes), which compiles every
kernel those plans launch into that cache: run it while building a
deployment image, or before capturing CUDA graphs (capture cannot compile).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from . import api
from ._cuda import gpu_access, import_cupy
from ._tiling import ELEMENT_SIZE, MAX_HEAD_DIM, wgmma_forward_key_limits
from ._validation import FP32_PRECISIONS, TensorMeta, check_backward, check_forward, contiguous_strides

#: Query rows of the planned forwards.
_PLAN_SEQLEN = 128
#: Query rows and keys of the planned backwards (their tiles do not depend
#: on them, their dQ mode does): one key block, whose dQ the Hopper kernel
#: stores directly (``cuflash._kernel_families.runs_direct_dq``), and more
#: keys than any key block holds (256 at most).
BACKWARD_SEQLENS = (1, 512)


def forward_key_counts() -> tuple[int, ...]:
    """Keys of the planned forwards: one in each range of key counts over
    which the Hopper forward keeps its tile (``wgmma_forward_key_limits``),
    so that every kernel a call of some length takes is compiled."""
    return tuple(sorted({_PLAN_SEQLEN} | {keys + 1 for keys in wgmma_forward_key_limits()}))


def _meta(name: str, shape: tuple[int, ...], dtype: str, device: int) -> TensorMeta:
    return TensorMeta(name=name, shape=shape, strides=contiguous_strides(shape), dtype=dtype, device=device)


def configurations(dtypes, head_dims, causal, backward, deterministic, fp32_precisions) -> list[dict]:
    """The calls ``warmup`` plans: a forward per dtype, head dim, mask (and
    float32 precision), at each of ``forward_key_counts``; a backward per dQ mode."""
    configs = []
    for dtype in dtypes:
        for head_dim in head_dims:
            for is_causal in causal:
                for precision in fp32_precisions if dtype == "float32" else ("ieee",):
                    configs.append(dict(dtype=dtype, head_dim=head_dim, causal=is_causal, pass_name="forward",
                                        fp32_precision=precision))
                if backward:
                    for mode in deterministic:
                        configs.append(dict(dtype=dtype, head_dim=head_dim, causal=is_causal, pass_name="backward",
                                            deterministic=mode))
    return configs


def _plan(config: dict, device: int) -> None:
    """Plans one call as the launcher does, which compiles its kernels."""
    dtype, head_dim = config["dtype"], config["head_dim"]
    shape = (1, _PLAN_SEQLEN, 1, head_dim)
    names = ("q", "k", "v", "out")
    if config["pass_name"] == "forward":
        for keys in forward_key_counts():
            shapes = {"q": shape, "out": shape, "k": (1, keys, 1, head_dim), "v": (1, keys, 1, head_dim)}
            metas = {name: _meta(name, shapes[name], dtype, device) for name in names}
            problem = check_forward(metas["q"], metas["k"], metas["v"], None, causal=config["causal"],
                                    softmax_scale=None, fp32_precision=config["fp32_precision"])
            api.forward_plan(problem, {name: api.Layout.contiguous(shapes[name], dtype) for name in names},
                             aligned=True)
        return
    for seqlen in BACKWARD_SEQLENS:
        shape = (1, seqlen, 1, head_dim)
        metas = {name: _meta(name, shape, dtype, device) for name in names + ("dout",)}
        layouts = {name: api.Layout.contiguous(shape, dtype) for name in names + ("dout", "dq", "dk", "dv")}
        lse_shape = (1, 1, seqlen)
        problem = check_backward(metas["dout"], metas["q"], metas["k"], metas["v"], metas["out"],
                                 _meta("lse", lse_shape, "float32", device), None, None, None,
                                 causal=config["causal"], softmax_scale=None, deterministic=config["deterministic"])
        api.backward_plan(problem, layouts, api.Layout.contiguous(lse_shape, "float32"), config["deterministic"],
                          aligned=True)


def warmup(dtypes: Iterable[str] = ("bfloat16", "float16"), head_dims: Iterable[int] = (64, 128), *,
           causal: Iterable[bool] = (False, True), backward: bool = True,
           deterministic: Iterable[bool] = (False,), fp32_precision: Iterable[str] = ("ieee", "3xtf32"),
           device: int | None = None, workers: int = 8,
           progress: Callable[[dict], None] | None = None) -> list[str]:
    """Compiles, on GPU ``device`` (default: CuPy's current one), every kernel
    the calls of these kinds launch there: the forward of each dtype, head
    dim and mask, and (``backward``) the backward in each of the
    ``deterministic`` modes; float32 forwards in each ``fp32_precision``.
    Inputs are taken as the fast path needs them (16-byte aligned rows,
    default scale). ``progress`` is called with each configuration as it
    finishes. Returns the keys of every kernel this process has compiled
    for that device so far (``cuflash info`` lists the cache they went to).

    Raises ``TypeError``/``ValueError`` naming the argument for a dtype,
    head dim or precision the kernels do not take, before compiling anything;
    ``cuflash.CudaSetupError`` where this machine cannot run the installed
    CuPy build.
    """
    cupy = import_cupy()
    dtypes, head_dims = tuple(dtypes), tuple(head_dims)
    causal, deterministic, fp32_precision = tuple(causal), tuple(deterministic), tuple(fp32_precision)
    for dtype in dtypes:
        if dtype not in ELEMENT_SIZE:
            raise ValueError(f"dtypes must be among {sorted(ELEMENT_SIZE)}, got {dtype!r}")
    for head_dim in head_dims:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 1 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dims must be integers from 1 to {MAX_HEAD_DIM}, got {head_dim!r}")
    for name, values in (("causal", causal), ("deterministic", deterministic)):
        if not values or not all(isinstance(value, bool) for value in values):
            raise TypeError(f"{name} must be a non-empty sequence of bools, got {values!r}")
    for precision in fp32_precision:
        if precision not in FP32_PRECISIONS:
            raise ValueError(f"fp32_precision must be among {list(FP32_PRECISIONS)}, got {precision!r}")
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool, got {type(backward).__name__}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    configs = configurations(dtypes, head_dims, causal, backward, deterministic, fp32_precision)
    with gpu_access():
        device = cupy.cuda.Device().id if device is None else device
        with ThreadPoolExecutor(workers) as pool:
            for config, _ in zip(configs, pool.map(lambda config: _plan(config, device), configs)):
                if progress is not None:
                    progress(config)
    return sorted(api.loader.compiled_keys(device))
