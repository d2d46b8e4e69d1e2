"""JAX integration: ``attention`` with a ``jax.custom_vjp`` whose forward and
backward are cuflash's kernels, usable eagerly and inside ``jax.jit``,
``jax.grad``, ``jax.value_and_grad``, ``jax.checkpoint`` and ``jax.vmap``.

Each pass is a ``jax.experimental.buffer_callback`` (JAX 0.6.1 or newer): at
run time XLA hands a Python callback its device buffers and CUDA stream, and
the callback launches the cached launch plan on that stream, writing
straight into the output buffers XLA allocated (no copy, no host round trip,
no synchronisation). Arguments are validated when the function is traced,
from shapes and dtypes, before anything runs. Under ``jax.vmap`` the mapped
axes become extra leading batch entries (``vmap_method="broadcast_all"``:
an unmapped k or v is broadcast along the mapped axis first).

On a JAX without ``buffer_callback`` the kernels take concrete arrays
through DLPack: eager calls and eager ``jax.grad`` work, and a traced call
raises a ``TypeError`` saying so. Importing this module imports JAX;
``import cuflash`` alone never does.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from . import _interop, api
from ._cuda import gpu_access
from ._validation import (
    TensorMeta,
    check_backward,
    check_causal,
    check_deterministic,
    check_dropout_p,
    check_forward,
    check_fp32_precision,
    check_softcap,
    check_variants,
    check_window,
    contiguous_strides,
)

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # JAX < 0.6.1
    buffer_callback = None

__all__ = ["attention", "JIT_SUPPORTED"]

#: Whether this JAX can run cuflash inside ``jax.jit`` (``buffer_callback``).
JIT_SUPPORTED = buffer_callback is not None


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, dropout_rng=None, deterministic=False, fp32_precision="ieee"):
    """Differentiable ``cuflash.attention`` for JAX arrays, eager or traced.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k,
    head_dim), nheads_k dividing nheads; float16, bfloat16 or float32 on a
    CUDA GPU. Causal masking is bottom-right aligned. ``window_size``,
    ``softcap`` and ``alibi_slopes`` ((nheads,) or (batch, nheads) float32,
    not differentiated) as for ``cuflash.attention``. ``deterministic``: the
    backward's dq is bitwise repeatable (as ``cuflash.attention_backward``).
    ``fp32_precision``: as for ``cuflash.attention`` (float32 forward; the
    backward is exact float32). ``dropout_p``: dropout of the probabilities
    (as ``cuflash.attention``), its mask drawn from ``dropout_rng``, a JAX PRNG
    key (typed, or raw uint32[2]) whose 64 bits are the seed: a traced value,
    so a jitted step takes a new key each call without recompiling; the same
    key gives the same mask (``cuflash.dropout_mask(..., seed)`` with the
    seed ``key_data[0] + 2**32 * key_data[1]``).
    Returns the output (batch, seqlen_q, nheads, head_dim); gradients flow to
    q, k and v through cuflash's backward.
    """
    causal, deterministic = check_causal(causal), check_deterministic(deterministic)
    fp32_precision = check_fp32_precision(fp32_precision)
    dropout_p = check_dropout_p(dropout_p)
    flags = (causal, check_window(window_size), check_softcap(softcap), dropout_p)
    seed = _seed_words(dropout_rng) if dropout_p else None
    if not JIT_SUPPORTED:
        return _eager(q, k, v, alibi_slopes, seed, flags, softmax_scale, deterministic, fp32_precision)
    problem = check_forward(*(_meta(name, x) for name, x in (("q", q), ("k", k), ("v", v))), None,
                            causal=causal, softmax_scale=softmax_scale)
    if alibi_slopes is not None:
        check_variants(problem, alibi_slopes=_meta("alibi_slopes", alibi_slopes))
        # One slope per (batch entry, head): vmapped axes then fold into the batch like q's.
        alibi_slopes = jax.numpy.broadcast_to(alibi_slopes, (problem.batch, problem.nheads))
    check_variants(problem, window_size=flags[1], softcap=flags[2], dropout_p=dropout_p)
    return _attention(q, k, v, alibi_slopes, seed, flags, problem.softmax_scale, deterministic, fp32_precision)


def _seed_words(dropout_rng):
    """A dropout key's 64 bits as uint32[2] (the kernels read them as one
    little-endian 64-bit seed)."""
    if dropout_rng is None:
        raise ValueError("dropout_p > 0 needs dropout_rng, a JAX PRNG key (jax.random.key or PRNGKey): the "
                         "backward regenerates the mask from it")
    dtype = getattr(dropout_rng, "dtype", None)
    if dtype is None:
        raise TypeError(f"dropout_rng must be a JAX PRNG key, got {type(dropout_rng).__name__}")
    words = jax.random.key_data(dropout_rng) if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else dropout_rng
    if tuple(words.shape) != (2,) or np.dtype(words.dtype) != np.uint32:
        raise ValueError(f"dropout_rng must be a key of two uint32 words (jax.random.key(seed) with the default "
                         f"threefry implementation, or PRNGKey), got {np.dtype(words.dtype).name} data of shape "
                         f"{tuple(words.shape)}")
    return words


def _meta(name: str, x) -> TensorMeta:
    """What validation needs of a JAX array or tracer: shape and dtype (XLA
    buffers are C-contiguous); the device is known only at run time."""
    for attribute in ("shape", "dtype"):
        if not hasattr(x, attribute):
            raise TypeError(f"{name} must be a JAX array, got {type(x).__module__}.{type(x).__qualname__}")
    _check_platform(name, x)
    shape = tuple(int(n) for n in x.shape)
    return TensorMeta(name=name, shape=shape, strides=contiguous_strides(shape), dtype=np.dtype(x.dtype).name,
                      device=0)


def _check_platform(name: str, x) -> None:
    """A concrete array must live on a GPU; a traced one is checked when the
    callback runs (its buffers then have to be CUDA memory)."""
    if isinstance(x, jax.Array) and not _interop._is_jax_tracer(x):
        platforms = {device.platform for device in x.devices()}
        if platforms != {"gpu"}:
            raise TypeError(f"{name} must be a JAX array on a CUDA GPU, got one on {sorted(platforms)}")


# --- traced route: buffer_callback ---

# ``flags``: (causal, window_size, softcap, dropout_p); the ALiBi slopes and
# the dropout seed (or None) are arguments without a gradient (custom_vjp
# gives them a zero one).

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, alibi_slopes, seed, flags, softmax_scale, deterministic, fp32_precision):
    return _forward_call(q, k, v, alibi_slopes, seed, flags, softmax_scale, fp32_precision)[0]


def _attention_fwd(q, k, v, alibi_slopes, seed, flags, softmax_scale, deterministic, fp32_precision):
    out, lse = _forward_call(q, k, v, alibi_slopes, seed, flags, softmax_scale, fp32_precision)
    return out, (q, k, v, alibi_slopes, seed, out, lse)


def _zero_gradient(x):
    """The cotangent of an input without a gradient: float0 for the integer seed words."""
    if x is None:
        return None
    if x.dtype == np.uint32:
        return np.zeros(x.shape, jax.dtypes.float0)
    return jax.numpy.zeros_like(x)


def _attention_bwd(flags, softmax_scale, deterministic, fp32_precision, residuals, dout):
    q, k, v, alibi_slopes, seed, out, lse = residuals
    dq, dk, dv = _backward_call(dout, q, k, v, out, lse, alibi_slopes, seed, flags, softmax_scale,
                                deterministic)[:3]
    return dq, dk, dv, _zero_gradient(alibi_slopes), _zero_gradient(seed)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _shape_dtype(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


#: The optional inputs of a callback, in the order they follow the others.
_OPTIONAL_BUFFERS = ("alibi_slopes", "dropout_rng")


def _with_variants(arrays: tuple, alibi_slopes, seed) -> tuple[tuple, tuple[str, ...]]:
    """The callback's inputs: ``arrays``, then the slopes and the seed where
    given; and the names of those given (the callback's ``optional``)."""
    given = [(name, x) for name, x in zip(_OPTIONAL_BUFFERS, (alibi_slopes, seed)) if x is not None]
    return (*arrays, *(x for _, x in given)), tuple(name for name, _ in given)


def _varying_axes(x) -> frozenset:
    """The manual mesh axes (inside ``shard_map``) that x varies over."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10 and later
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_like(results: tuple, inputs: tuple) -> tuple:
    """``results`` typed as varying over every manual mesh axis ``inputs``
    vary over. Inside ``shard_map`` a ``buffer_callback``'s outputs carry no
    such type, and custom_vjp (whose backward must return its inputs'
    types), ``lax.cond`` and ``shard_map``'s own checks need them; a JAX
    without these types has nothing to set."""
    cast = getattr(jax.lax, "pcast", None)
    typed_axes = getattr(jax, "typeof", None) is not None and (cast is not None or hasattr(jax.lax, "pvary"))
    if not typed_axes:
        return results
    axes = frozenset().union(*(_varying_axes(x) for x in inputs if x is not None))
    if not axes:
        return results

    def typed(x):
        missing = tuple(sorted(axes - _varying_axes(x)))
        if not missing:
            return x
        return cast(x, missing, to="varying") if cast is not None else jax.lax.pvary(x, missing)

    return tuple(typed(x) for x in results)


def _forward_call(q, k, v, alibi_slopes, seed, flags, softmax_scale, fp32_precision):
    batch, seqlen_q, nheads, _ = q.shape
    results = (_shape_dtype(q.shape, q.dtype), _shape_dtype((batch, nheads, seqlen_q), np.float32))
    arrays, optional = _with_variants((q, k, v), alibi_slopes, seed)
    callback = _forward_callback(flags, softmax_scale, fp32_precision, optional)
    return varying_like(buffer_callback(callback, results, vmap_method="broadcast_all")(*arrays), arrays)


def _backward_call(dout, q, k, v, out, lse, alibi_slopes, seed, flags, softmax_scale, deterministic):
    # The work buffers (api.backward_work_buffers) are extra outputs that
    # XLA allocates and nothing reads afterwards. Which dK/dV kernel runs is
    # known only at launch (it depends on the buffers' alignment), so every
    # buffer any of them could need is made.
    work = _work_buffers(q.shape)
    results = [_shape_dtype(x.shape, x.dtype) for x in (q, k, v)]
    results += [_shape_dtype(shape, np.dtype(dtype)) for shape, dtype in work.values()]
    arrays, optional = _with_variants((dout, q, k, v, out, lse), alibi_slopes, seed)
    callback = _backward_callback(flags, softmax_scale, deterministic, optional, tuple(work))
    return varying_like(buffer_callback(callback, tuple(results), vmap_method="broadcast_all")(*arrays), arrays)


# One callback object per set of flags: the callback is a static parameter of
# the primitive, so a fresh closure per call would recompile every eager call.

@functools.lru_cache(maxsize=None)
def _forward_callback(flags: tuple, softmax_scale: float, fp32_precision: str, optional: tuple[str, ...]):
    launch = _BufferLauncher(("forward", flags, softmax_scale, fp32_precision), api.FORWARD_ARRAYS,
                             ("q", "k", "v", "out", "lse", *optional))

    def callback(ctx, outputs, q, k, v, *extras):
        launch(ctx.stream, (q, k, v, *outputs, *extras))
    return callback


@functools.lru_cache(maxsize=None)
def _backward_callback(flags: tuple, softmax_scale: float, deterministic: bool, optional: tuple[str, ...],
                       work: tuple[str, ...]):
    # dout, q, k, v, out and lse, then the outputs as _backward_call declares
    # them: dq, dk, dv and the work buffers ``work`` (by name, in that order).
    launch = _BufferLauncher(("backward", flags, softmax_scale, deterministic), api.BACKWARD_ARRAYS,
                             (*api.BACKWARD_ARRAYS[:9], *work, *optional))

    def callback(ctx, outputs, dout, q, k, v, out, lse, *extras):
        launch(ctx.stream, (dout, q, k, v, out, lse, *outputs, *extras))
    return callback


class _BufferLauncher:
    """Runs the plan of one callback's buffers (XLA's, C-contiguous; any
    leading vmapped axes fold into the batch) on XLA's stream. ``present``:
    the names (of ``names``, the plan's arrays) of the buffers each call
    hands over, in that order; the others are absent (null). The plan-cache
    key is made of what a call's buffers can change: their shapes, q's
    dtype, the device and the alignments."""

    def __init__(self, flags: tuple, names: tuple[str, ...], present: tuple[str, ...]):
        self.flags, self.names, self.present = flags, names, present
        self.indices = tuple(names.index(name) for name in present)
        self.q_position = present.index("q")  # among the buffers
        # The slots whose alignment a backward's plan depends on besides (the direct dQ mode may map them).
        self.mapped_slots = (names.index("dq"), names.index("out")) if "dq" in present else None

    def __call__(self, stream: int, buffers: tuple) -> None:
        pointers = [0] * len(self.names)
        shapes = []
        for index, name, buffer in zip(self.indices, self.present, buffers, strict=True):
            interface = getattr(buffer, "__cuda_array_interface__", None)
            if interface is None:
                raise TypeError(f"cuflash.jax.attention runs on CUDA GPUs; {name} is not in GPU memory")
            pointers[index] = interface["data"][0]
            shapes.append(tuple(buffer.shape))
        with gpu_access():  # JAX runs here; the CuPy build may not
            device = _device_of_pointer(pointers[self.indices[self.q_position]])
        aligned = api.pointers_aligned(self.flags[0], pointers)
        if self.mapped_slots is None:
            maps_aligned = (False, False)
        else:
            dq_slot, out_slot = self.mapped_slots
            maps_aligned = (not pointers[dq_slot] & 15, not pointers[out_slot] & 15)
        dtype = buffers[self.q_position].dtype
        key = ("jax", self.flags, self.present, tuple(shapes), dtype, device, aligned, maps_aligned)
        plan = api.plans.get(key)
        # A reused plan's launch writes only the slots of the buffers: the
        # key fixes which names are present, and the others stay null (the
        # structs start zeroed; a plan's first launch writes every slot too).
        slots = self.indices
        if plan is None:
            all_shapes = [None] * len(self.names)
            for index, shape in zip(self.indices, shapes):
                all_shapes[index] = shape
            plan = _plan(self.flags, all_shapes, np.dtype(dtype).name, device, self.names, aligned, maps_aligned)
            api.plans.put(key, plan)
            slots = None
        if _interop.current_device() == device:
            plan.launch(pointers, stream, slots)
        else:
            import cupy

            with cupy.cuda.Device(device):
                plan.launch(pointers, stream, slots)


def _work_buffers(q_shape: tuple[int, ...]) -> dict:
    """Every backward work buffer for q of this shape, as the leading
    vmapped axes and one flat axis (the kernels see contiguous memory; every
    buffer holds a whole number of elements per batch entry)."""
    *lead, seqlen_q, nheads, head_dim = q_shape
    batch = math.prod(lead)
    buffers = api.backward_work_buffers(batch, nheads, seqlen_q, head_dim, None, True)
    return {name: ((*lead, math.prod(shape) // max(batch, 1)), dtype) for name, (shape, dtype) in buffers.items()}


def _device_of_pointer(pointer: int) -> int:
    from cupy.cuda import runtime

    if pointer == 0:  # an empty buffer: no memory, no device of its own
        return _interop.current_device()
    return runtime.pointerGetAttributes(pointer).device


def _folded(shape: tuple[int, ...], trailing: int) -> tuple[int, ...]:
    """``shape`` with every axis before the last ``trailing`` folded into one
    (vmap's leading axes join the batch axis)."""
    return (math.prod(shape[:-trailing]),) + tuple(shape[-trailing:])


#: Buffers whose dtype is not q's.
_WORK_DTYPES = {"lse": "float32", "delta": "float32", "dq_accum": "float32", "dq_semaphore": "int32",
                "alibi_slopes": "float32", "dropout_rng": "uint32"}


def _plan(flags: tuple, shapes: list, dtype: str, device: int, names: tuple[str, ...], aligned: bool,
          maps_aligned: tuple[bool, bool]):
    """The launch plan of one buffer signature (validated again, now with
    the folded shapes and the device); ``maps_aligned``: whether a
    backward's dq and out buffers are 16-byte aligned (the direct dQ mode
    may map them)."""
    trailing = {"lse": 2, "delta": 2, "dq_semaphore": 2, "alibi_slopes": 1, "dropout_rng": 1}
    metas = {}
    for name, shape in zip(names, shapes):
        if shape is not None:
            folded = _folded(shape, trailing.get(name, 3))
            metas[name] = TensorMeta(name, folded, contiguous_strides(folded), _WORK_DTYPES.get(name, dtype), device)
    slopes = metas.pop("alibi_slopes", None)
    metas.pop("dropout_rng", None)  # the seed's address: read by the kernels, nothing to plan
    layouts = {name: api.Layout.contiguous(meta.shape, meta.dtype) for name, meta in metas.items()
               if name != "dq_semaphore"}
    kind, (causal, window_size, softcap, dropout_p), scale, option = flags
    variants = dict(window_size=window_size, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p)
    if kind == "forward":
        problem = check_forward(metas["q"], metas["k"], metas["v"], metas["out"], causal=causal,
                                softmax_scale=scale, lse=metas["lse"], fp32_precision=option)
        problem = check_variants(problem, **variants)
        # No split-KV under JAX: its buffers are declared before the plan is known.
        return api.forward_plan(problem, layouts, aligned=aligned, num_splits=1)
    problem = check_backward(*(metas[name] for name in ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv")),
                             causal=causal, softmax_scale=scale, deterministic=option)
    problem = check_variants(problem, **variants)
    dq_aligned, out_aligned = maps_aligned
    return api.backward_plan(problem, layouts, layouts["lse"], option, aligned=aligned, dq_aligned=dq_aligned,
                             out_aligned=out_aligned)


# --- eager route for a JAX without buffer_callback ---

def _variant_kwargs(flags: tuple, alibi_slopes, seed) -> dict:
    causal, window_size, softcap, dropout_p = flags
    words = None if seed is None else np.asarray(seed, dtype=np.uint64)
    return dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                dropout_p=dropout_p, dropout_seed=None if words is None else int(words[0] | words[1] << 32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _eager(q, k, v, alibi_slopes, seed, flags, softmax_scale, deterministic, fp32_precision):
    return api.attention(q, k, v, softmax_scale=softmax_scale, fp32_precision=fp32_precision,
                         **_variant_kwargs(flags, alibi_slopes, seed))


def _eager_fwd(q, k, v, alibi_slopes, seed, flags, softmax_scale, deterministic, fp32_precision):
    out, lse = api.attention(q, k, v, softmax_scale=softmax_scale, return_lse=True, fp32_precision=fp32_precision,
                             **_variant_kwargs(flags, alibi_slopes, seed))
    return out, (q, k, v, alibi_slopes, seed, out, lse)


def _eager_bwd(flags, softmax_scale, deterministic, fp32_precision, residuals, dout):
    q, k, v, alibi_slopes, seed, out, lse = residuals
    dq, dk, dv = api.attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                        deterministic=deterministic, **_variant_kwargs(flags, alibi_slopes, seed))
    return dq, dk, dv, _zero_gradient(alibi_slopes), _zero_gradient(seed)


_eager.defvjp(_eager_fwd, _eager_bwd)
