"""Ring attention for JAX: inside ``jax.shard_map`` over a mesh axis, K/V
shards travel around the axis with ``jax.lax.ppermute`` and every step is a
cuflash kernel (``cuflash.jax``'s ``buffer_callback`` primitives), under
``jax.jit`` and ``jax.grad``. The ring steps are ``cuflash.distributed.
schedule``'s, as in the PyTorch version; a rank's index is a traced value
here, so a step whose work depends on it is a ``jax.lax.cond`` between the
two forms (both shaped alike).

Needs a JAX with ``buffer_callback`` (``cuflash.jax.JIT_SUPPORTED``); a clear
error otherwise. Whether XLA overlaps a ``ppermute`` with the step's kernel
is its scheduler's choice. ``ulysses_attention``: the all-to-all strategy,
as ``cuflash.distributed.ulysses_attention``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import jax as cuflash_jax
from .._validation import check_causal, check_deterministic, check_window, resolve_softmax_scale
from .schedule import (RingStep, check_shard_length, gathered_order, ring_length, ring_steps, sequence_slots,
                       ulysses_kv_copies)

__all__ = ["ring_attention", "ulysses_attention", "shard_order", "sequence_order"]

_NO_VARIANTS = ((-1, -1), 0.0, 0.0)  # window, softcap, dropout_p: ``cuflash.jax``'s flags after causal


def _axis_size(axis_name) -> int:
    size = getattr(jax.lax, "axis_size", None)
    return int(size(axis_name)) if size is not None else int(jax.lax.psum(1, axis_name))


def ring_attention(q, k, v, axis_name, *, causal=False, softmax_scale=None, window_size=(-1, -1), balanced=None,
                   deterministic=False):
    """Ring attention over the mesh axis ``axis_name``; call it inside
    ``jax.shard_map`` with the sequence axis (1) of q, k and v sharded over
    that axis.

    q: (batch, seqlen_local, nheads, head_dim); k, v: (batch, seqlen_local,
    nheads_k, head_dim), nheads_k dividing nheads; float16, bfloat16 or
    float32. ``window_size``: as ``cuflash.distributed.ring_attention``
    (contiguous shards only). ``balanced``: the shards hold chunks r and
    2 world - 1 - r of 2 world (arrange the whole array with ``shard_order``
    before sharding it; ``sequence_order`` undoes it); default ``causal``
    without a window. Returns the local
    output shard; differentiable.
    """
    if not cuflash_jax.JIT_SUPPORTED:
        raise RuntimeError(f"cuflash.distributed.jax.ring_attention runs inside jax.jit and shard_map, which needs "
                           f"jax.experimental.buffer_callback (JAX 0.6.1 or newer); this JAX is {jax.__version__}")
    causal, deterministic = check_causal(causal), check_deterministic(deterministic)
    window = check_window(window_size)
    balanced = (causal and window == (-1, -1)) if balanced is None else bool(balanced)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be (batch, seqlen_local, nheads, head_dim), got shape {tuple(x.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape != v.shape:
        raise ValueError(f"q, k and v must be shards of one sequence (same batch and seqlen_local; k and v one "
                         f"shape), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    check_shard_length(q.shape[1], balanced, "q's sequence shard")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    _step_forms(_axis_size(axis_name), q.shape[1], causal, balanced, window)  # the plan's checks, at trace time
    return _ring(q, k, v, axis_name, causal, scale, balanced, window, deterministic)


def _forward_step(q, k, v, causal: bool, window: tuple[int, int], scale: float):
    flags = (causal, window, 0.0, 0.0)  # cuflash.jax's: causal, window, softcap, dropout_p
    return cuflash_jax._forward_call(q, k, v, None, None, flags, scale, "ieee")


def _backward_step(dout, q, k, v, out, lse, causal: bool, window: tuple[int, int], scale: float,
                   deterministic: bool):
    flags = (causal, window, 0.0, 0.0)
    return cuflash_jax._backward_call(dout, q, k, v, out, lse, None, None, flags, scale, deterministic)[:3]


def _rows(x, rows: tuple[int, int], axis: int = 1):
    return jax.lax.slice_in_dim(x, rows[0], rows[1], axis=axis)


def _placed(x, rows: tuple[int, int], length: int, fill, axis: int = 1):
    """x as rows ``rows`` of a tensor ``length`` long along ``axis``, the rest ``fill``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (rows[0], length - rows[1])
    return jnp.pad(x, pad, constant_values=fill)


def _step_forward(step: RingStep, q, k, v, scale: float):
    """(out, lse) of one step for every local query row (0 and -inf where
    the step does not reach)."""
    seqlen = q.shape[1]
    if not step.attends:
        return cuflash_jax.varying_like(
            (jnp.zeros_like(q), jnp.full((q.shape[0], q.shape[2], seqlen), -jnp.inf, jnp.float32)), (q,))
    out, lse = _forward_step(_rows(q, step.rows), _rows(k, step.keys), _rows(v, step.keys), step.causal,
                             step.window, scale)
    return _placed(out, step.rows, seqlen, 0), _placed(lse, step.rows, seqlen, -jnp.inf, axis=2)


def _step_backward(step: RingStep, dout, q, k, v, out, lse, scale: float, deterministic: bool):
    """(dq, dk, dv) of one step, shaped like q, k, v (zeros where it does not reach)."""
    if not step.attends:
        return cuflash_jax.varying_like((jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)), (q, k, v))
    rows, keys = step.rows, step.keys
    dq, dk, dv = _backward_step(_rows(dout, rows), _rows(q, rows), _rows(k, keys), _rows(v, keys), _rows(out, rows),
                                _rows(lse, rows, axis=2), step.causal, step.window, scale, deterministic)
    seqlen = q.shape[1]
    return _placed(dq, rows, seqlen, 0), _placed(dk, keys, seqlen, 0), _placed(dv, keys, seqlen, 0)


def _step_forms(world: int, seqlen: int, causal: bool, balanced: bool, window) -> list[tuple[RingStep, RingStep]]:
    """Per ring step, its form on ranks whose source is earlier (step <=
    rank) and on the others. Within each, the plan is the same on every
    rank (schedule.ring_steps: it depends on the shards' distance, and for
    balanced causal shards on which side the source lies), so the plans of
    ranks world - 1 and 0 stand for all."""
    last, first = (ring_steps(rank, world, seqlen, causal=causal, balanced=balanced, window=window)
                   for rank in (world - 1, 0))
    length = ring_length(world, seqlen, causal=causal, balanced=balanced, window=window)
    return [(last[i], first[i]) for i in range(length)]


def _by_rank(step: int, rank, forms: tuple[RingStep, RingStep], run):
    """``run(form)`` for this rank's form of ring step ``step`` (a
    ``lax.cond`` on the traced rank where the forms differ)."""
    earlier, later = forms
    if step == 0 or earlier == later:
        return run(earlier)
    return jax.lax.cond(step <= rank, lambda: run(earlier), lambda: run(later))


def _merge(outs, lses):
    """Partial results merged by their log-sum-exps, in float32."""
    lses = jnp.stack(lses)
    top = jnp.max(lses, axis=0)
    safe_top = jnp.where(jnp.isneginf(top), 0.0, top)
    weights = jnp.where(jnp.isneginf(lses), 0.0, jnp.exp(lses - safe_top))
    total = jnp.sum(weights, axis=0)
    lse = jnp.where(total > 0, safe_top + jnp.log(total), -jnp.inf)
    # weights are (state, batch, nheads, seqlen); outputs (batch, seqlen, nheads, head_dim)
    scaled = weights / jnp.where(total > 0, total, 1.0)
    out = sum(o.astype(jnp.float32) * jnp.transpose(w, (0, 2, 1))[..., None] for o, w in zip(outs, scaled))
    return out.astype(outs[0].dtype), lse


def _ring_forward(q, k, v, axis_name, causal, scale, balanced, window):
    world = _axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    forms = _step_forms(world, q.shape[1], causal, balanced, window)
    forward = [(source, (source + 1) % world) for source in range(world)]
    outs, lses = [], []
    for step, step_forms in enumerate(forms):
        following = jax.lax.ppermute((k, v), axis_name, forward) if step + 1 < len(forms) else None
        out, lse = _by_rank(step, rank, step_forms,
                            lambda form, k=k, v=v: _step_forward(form, q, k, v, scale))
        outs.append(out)
        lses.append(lse)
        if following is not None:
            k, v = following
    return _merge(outs, lses)


def _ring_backward(dout, q, k, v, out, lse, axis_name, causal, scale, balanced, window, deterministic):
    world = _axis_size(axis_name)
    rank = jax.lax.axis_index(axis_name)
    forms = _step_forms(world, q.shape[1], causal, balanced, window)
    forward = [(source, (source + 1) % world) for source in range(world)]
    dq = jnp.zeros(q.shape, jnp.float32)
    dk_sum = dv_sum = None
    for step, step_forms in enumerate(forms):
        following = jax.lax.ppermute((k, v), axis_name, forward) if step + 1 < len(forms) else None
        dq_step, dk_step, dv_step = _by_rank(
            step, rank, step_forms,
            lambda form, k=k, v=v: _step_backward(form, dout, q, k, v, out, lse, scale, deterministic))
        dq = dq + dq_step.astype(jnp.float32)
        # This step's block's float32 sums (the previous rank's, handed on at
        # its step's end) plus ours, handed on to the rank that attends to
        # the block next, or after the last step straight to its owner.
        dk_sum = dk_step.astype(jnp.float32) if dk_sum is None else dk_sum + dk_step.astype(jnp.float32)
        dv_sum = dv_step.astype(jnp.float32) if dv_sum is None else dv_sum + dv_step.astype(jnp.float32)
        hops = 1 if step + 1 < len(forms) else -step
        if hops % world:
            onward = [(source, (source + hops) % world) for source in range(world)]
            dk_sum, dv_sum = jax.lax.ppermute((dk_sum, dv_sum), axis_name, onward)
        if following is not None:
            k, v = following
    return dq.astype(q.dtype), dk_sum.astype(k.dtype), dv_sum.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8))
def _ring(q, k, v, axis_name, causal, scale, balanced, window, deterministic):
    return _ring_forward(q, k, v, axis_name, causal, scale, balanced, window)[0]


def _ring_fwd(q, k, v, axis_name, causal, scale, balanced, window, deterministic):
    out, lse = _ring_forward(q, k, v, axis_name, causal, scale, balanced, window)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis_name, causal, scale, balanced, window, deterministic, residuals, dout):
    q, k, v, out, lse = residuals
    return _ring_backward(dout, q, k, v, out, lse, axis_name, causal, scale, balanced, window, deterministic)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ulysses_attention(q, k, v, axis_name, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                      balanced=False, deterministic=False):
    """Ulysses attention over the mesh axis ``axis_name`` (inside
    ``jax.shard_map``, the sequence axis 1 sharded over it): an all-to-all
    turns the sequence shards into head shards, ``cuflash.jax.attention``
    attends to the whole sequence for nheads / world heads, and a second
    all-to-all returns the output to sequence shards (``jax.lax.all_to_all``;
    differentiable). Shapes, ``balanced`` and the K/V head rule as
    ``cuflash.distributed.ulysses_attention``."""
    world = _axis_size(axis_name)
    copies = ulysses_kv_copies(q.shape[2], k.shape[2], world)
    if copies > 1:
        k, v = (jnp.repeat(x, copies, axis=2) for x in (k, v))
    check_shard_length(q.shape[1], balanced, "q's sequence shard")

    def to_heads(x):  # shards concatenate in rank order; balanced ones are then put in sequence order
        whole = jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
        return sequence_order(whole, world, balanced=balanced)

    out = cuflash_jax.attention(*(to_heads(x) for x in (q, k, v)), causal=causal, softmax_scale=softmax_scale,
                                window_size=window_size, deterministic=deterministic)
    return jax.lax.all_to_all(shard_order(out, world, balanced=balanced), axis_name, split_axis=1, concat_axis=2,
                              tiled=True)


def _reordered(x, axis: int, order: list[int]):
    chunks = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def shard_order(x, world: int, *, axis: int = 1, balanced: bool = True):
    """The whole sequence rearranged so that splitting ``axis`` into
    ``world`` equal shards (as ``shard_map`` does) gives rank r chunks r and
    2 world - 1 - r of 2 world (``balanced``; unchanged otherwise)."""
    if not balanced:
        return x
    if x.shape[axis] % (2 * world):
        raise ValueError(f"x's sequence axis ({axis}, length {x.shape[axis]}) must split into {2 * world} equal "
                         f"chunks for balanced sharding over {world} ranks")
    return _reordered(x, axis, gathered_order(world, balanced=True))


def sequence_order(x, world: int, *, axis: int = 1, balanced: bool = True):
    """``shard_order``'s inverse."""
    if not balanced:
        return x
    return _reordered(x, axis, sequence_slots(world, balanced=True))
