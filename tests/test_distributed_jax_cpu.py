"""The JAX ring's bookkeeping (cuflash.distributed.jax: the ppermutes, the
dK/dV sums that travel with K/V, the merge, the lax.cond between a step's
two forms, the manual-axis types) on the CPU: two host devices under
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

SCRIPT = r'''
import os, math, functools
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import cuflash.jax as cj
from cuflash.distributed import jax as rj

def np_fwd(q, k, v, causal, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]; k = np.repeat(k, g, 2); v = np.repeat(v, g, 2)
    s = np.einsum("bshd,bthd->bhst", q, k) * scale
    if causal:
        i = np.arange(q.shape[1])[:, None]; j = np.arange(k.shape[1])[None]
        s = np.where(j > i + k.shape[1] - q.shape[1], -np.inf, s)
    m = s.max(-1, keepdims=True); lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    p = np.exp(s - lse[..., None]); o = np.einsum("bhst,bthd->bshd", p, v)
    return o.astype(np.float32), lse.astype(np.float32)

def fake_forward(q, k, v, a, seed, flags, scale, prec):
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))
    return jax.pure_callback(lambda q, k, v: np_fwd(q, k, v, flags[0], scale), shapes, q, k, v)

def np_bwd(dout, q, k, v, out, lse, causal, scale):
    dout, q, k, v, out, lse = (np.asarray(x, np.float64) for x in (dout, q, k, v, out, lse))
    hk = k.shape[2]; g = q.shape[2] // hk; K = np.repeat(k, g, 2); V = np.repeat(v, g, 2)
    s = np.einsum("bshd,bthd->bhst", q, K) * scale
    if causal:
        i = np.arange(q.shape[1])[:, None]; j = np.arange(k.shape[1])[None]
        s = np.where(j > i + k.shape[1] - q.shape[1], -np.inf, s)
    p = np.exp(s - lse[..., None]); dp = np.einsum("bshd,bthd->bhst", dout, V)
    delta = (dout * out).sum(-1).transpose(0, 2, 1)[..., None]; ds = p * (dp - delta) * scale
    dq = np.einsum("bhst,bthd->bshd", ds, K)
    dk = np.einsum("bhst,bshd->bthd", ds, q).reshape(*k.shape[:3], g, k.shape[3]).sum(3)
    dv = np.einsum("bhst,bshd->bthd", p, dout).reshape(*k.shape[:3], g, k.shape[3]).sum(3)
    return dq.astype(np.float32), dk.astype(np.float32), dv.astype(np.float32)

def fake_backward(dout, q, k, v, out, lse, a, seed, flags, scale, det):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    return jax.pure_callback(lambda *xs: np_bwd(*xs, flags[0], scale), shapes, dout, q, k, v, out, lse)

cj._forward_call, cj._backward_call = fake_forward, fake_backward
cj.JIT_SUPPORTED = True
mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("sequence",))
spec = P(None, "sequence")
rng = np.random.default_rng(0)
for causal, balanced in [(True, True), (True, False), (False, False)]:
    b, S, H, HK, D = 2, 16, 4, 2, 8
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, S, h, D)), jnp.float32) for h in (H, HK, HK, H))
    ringed = jax.shard_map(lambda q, k, v: rj.ring_attention(q, k, v, "sequence", causal=causal, balanced=balanced), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    @jax.jit
    def f(q, k, v, do):
        a = [rj.shard_order(x, 2, balanced=balanced) for x in (q, k, v, do)]
        out, pb = jax.vjp(ringed, *a[:3])
        return [rj.sequence_order(x, 2, balanced=balanced) for x in (out, *pb(a[3]))]
    got = f(q, k, v, do)
    o, lse = np_fwd(q, k, v, causal, 1 / math.sqrt(D))
    want = [o, *np_bwd(do, q, k, v, o, lse, causal, 1 / math.sqrt(D))]
    errors = [float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want)]
    print(causal, balanced, max(errors))
    assert max(errors) < 1e-5, (causal, balanced, errors)
'''


def test_jax_ring_bookkeeping_on_two_host_devices():
    pytest.importorskip("jax")
    environment = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    environment["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                 environment.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("\n") == 3, result.stdout
