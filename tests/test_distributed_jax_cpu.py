"""The JAX ring's bookkeeping (cuflash.distributed.jax: the ppermutes, the
dK/dV sums that travel with K/V, the merge, the lax.cond between a step's
two forms), its Ulysses (the all-to-alls, replicated K/V heads) and
cuflash.jax's primitives inside ``shard_map`` (their
outputs' manual-axis types) on the CPU: two host devices under
``jax.jit`` and ``shard_map``, cuflash's kernels replaced by float64 NumPy
callbacks (``pure_callback``, which, like the kernels' ``buffer_callback``,
gives untyped outputs). Forward and gradients against the whole sequence's
NumPy math. Run in a subprocess: the host device count must be set before
JAX starts. Skips without JAX."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import cuflash.jax as cuflash_jax
from cuflash.distributed import jax as ring_jax


def scores(q, k, causal, window, scale):
    group = q.shape[2] // k.shape[2]
    s = np.einsum("bshd,bthd->bhst", q, np.repeat(k, group, 2)) * scale
    left, right = window[0], 0 if causal else window[1]
    rows, cols = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None]
    diagonal = rows + k.shape[1] - q.shape[1]
    if right >= 0:
        s = np.where(cols > diagonal + right, -np.inf, s)
    if left >= 0:
        s = np.where(cols < diagonal - left, -np.inf, s)
    return s


def forward(q, k, v, causal, window, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = scores(q, k, causal, window, scale)
    top = np.max(s, -1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    total = np.exp(s - top).sum(-1, keepdims=True)
    lse = np.where(total > 0, top + np.log(np.where(total > 0, total, 1)), -np.inf)[..., 0]
    p = np.where(total > 0, np.exp(s - lse[..., None]), 0)
    out = np.einsum("bhst,bthd->bshd", p, np.repeat(v, q.shape[2] // k.shape[2], 2))
    return out.astype(np.float32), lse.astype(np.float32)


def backward(dout, q, k, v, out, lse, causal, window, scale):
    dout, q, k, v, out, lse = (np.asarray(x, np.float64) for x in (dout, q, k, v, out, lse))
    group = q.shape[2] // k.shape[2]
    keys, values = np.repeat(k, group, 2), np.repeat(v, group, 2)
    p = np.exp(scores(q, k, causal, window, scale) - lse[..., None])
    delta = (dout * out).sum(-1).transpose(0, 2, 1)[..., None]
    ds = p * (np.einsum("bshd,bthd->bhst", dout, values) - delta) * scale
    shape = (*k.shape[:3], group, k.shape[3])
    dq = np.einsum("bhst,bthd->bshd", ds, keys)
    dk = np.einsum("bhst,bshd->bthd", ds, q).reshape(shape).sum(3)
    dv = np.einsum("bhst,bshd->bthd", p, dout).reshape(shape).sum(3)
    return dq.astype(np.float32), dk.astype(np.float32), dv.astype(np.float32)


def forward_callback(flags, softmax_scale, fp32_precision, optional):
    return "forward", flags, softmax_scale


def backward_callback(flags, softmax_scale, deterministic, optional, work):
    return "backward", flags, softmax_scale


def fake_buffer_callback(callback, results, vmap_method=None):
    # cuflash.jax's primitive with its kernels replaced by the NumPy math
    # above, through pure_callback (whose outputs, like buffer_callback's,
    # carry no manual-axis type inside shard_map).
    kind, flags, scale = callback
    causal, window = flags[0], flags[1]

    def run(*arrays):
        if kind == "forward":
            return jax.pure_callback(lambda q, k, v: forward(q, k, v, causal, window, scale), results, *arrays[:3])

        def host(dout, q, k, v, out, lse):
            grads = backward(dout, q, k, v, out, lse, causal, window, scale)
            work = tuple(np.zeros(r.shape, r.dtype) for r in results[3:])  # the kernels' work buffers
            return tuple(g.astype(r.dtype) for g, r in zip(grads, results)) + work

        return jax.pure_callback(host, results, *arrays[:6])

    return run


cuflash_jax._forward_callback, cuflash_jax._backward_callback = forward_callback, backward_callback
cuflash_jax.buffer_callback = fake_buffer_callback
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sequence",))
spec = PartitionSpec(None, "sequence")
rng = np.random.default_rng(0)


def check(strategy, causal, balanced, window, nheads_k):
    # strategy inside shard_map under jit and vjp against the NumPy math of
    # the whole sequence
    q, k, v, dout = (jnp.asarray(rng.standard_normal((2, 16, heads, 8)), jnp.float32)
                     for heads in (4, nheads_k, nheads_k, 4))

    def local(q, k, v):
        return strategy(q, k, v, "sequence", causal=causal, balanced=balanced, window_size=window)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    @jax.jit
    def output_and_gradients(q, k, v, dout):
        arranged = [ring_jax.shard_order(x, 2, balanced=balanced) for x in (q, k, v, dout)]
        out, pullback = jax.vjp(mapped, *arranged[:3])
        return [ring_jax.sequence_order(x, 2, balanced=balanced) for x in (out, *pullback(arranged[3]))]

    got = output_and_gradients(q, k, v, dout)
    out, lse = forward(q, k, v, causal, window, 1 / math.sqrt(8))
    want = [out, *backward(dout, q, k, v, out, lse, causal, window, 1 / math.sqrt(8))]
    errors = [float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want)]
    print(strategy.__name__, causal, balanced, window, nheads_k, max(errors))
    assert max(errors) < 1e-5, (strategy.__name__, causal, balanced, window, nheads_k, errors)


for causal, balanced, window in [(True, True, (-1, -1)), (True, False, (-1, -1)), (False, False, (-1, -1)),
                                 (True, False, (3, 0)), (False, False, (2, 5))]:
    check(ring_jax.ring_attention, causal, balanced, window, 2)
# Ulysses: all-to-alls around one attention of the whole sequence, K/V
# heads replicated where fewer than the devices.
for causal, balanced, nheads_k, window in [(True, True, 2, (-1, -1)), (False, False, 1, (-1, -1)),
                                           (True, False, 4, (5, 0))]:
    check(ring_jax.ulysses_attention, causal, balanced, window, nheads_k)

# cuflash.jax.attention itself inside shard_map (the batch split over the
# devices), under jit and grad: its kernels' outputs typed like its inputs.
batch_spec = PartitionSpec("sequence")
q, k, v = (jnp.asarray(rng.standard_normal((4, 12, 2, 8)), jnp.float32) for _ in range(3))
local = jax.shard_map(lambda q, k, v: cuflash_jax.attention(q, k, v, causal=True), mesh=mesh,
                      in_specs=(batch_spec,) * 3, out_specs=batch_spec)
got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(local(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
out, lse = forward(q, k, v, True, (-1, -1), 1 / math.sqrt(8))
want = backward(2 * out, q, k, v, out, lse, True, (-1, -1), 1 / math.sqrt(8))
errors = [float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want)]
print("cuflash.jax.attention in shard_map", max(errors))
assert max(errors) < 1e-5, errors
"""


def test_jax_ring_bookkeeping_on_two_host_devices():
    pytest.importorskip("jax")
    environment = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                 environment.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == 9, result.stdout
