"""Ring and Ulysses attention on two GPUs (``nvidia-h200-x2``) against the
float64 reference of the gathered sequence, within the accuracy rule of
DEVELOPERS.md (2x a same-precision naive baseline on the whole sequence);
outputs, log-sum-exps and the gradients autograd returns to every rank's
shards."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import (assert_lse_close, assert_output_accurate, naive_attention_backward_same_precision,
                           naive_attention_same_precision)

pytestmark = pytest.mark.gpu

#: name -> (strategy, batch, whole seqlen, nheads, nheads_k, head_dim, dtype, causal, balanced, window)
CASES = {
    "ring-causal-balanced-gqa-bf16": ("ring", 2, 68, 4, 2, 64, "bfloat16", True, True, (-1, -1)),
    "ring-causal-contiguous-fp16": ("ring", 1, 34, 2, 2, 128, "float16", True, False, (-1, -1)),
    "ring-full-mqa-bf16": ("ring", 1, 254, 3, 1, 96, "bfloat16", False, False, (-1, -1)),
    "ring-full-balanced-fp16": ("ring", 2, 1000, 2, 2, 64, "float16", False, True, (-1, -1)),
    "ring-causal-balanced-fp32": ("ring", 1, 1000, 2, 1, 64, "float32", True, True, (-1, -1)),
    "ring-causal-balanced-one-token-chunks": ("ring", 3, 4, 2, 2, 32, "bfloat16", True, True, (-1, -1)),
    "ring-causal-balanced-d256": ("ring", 1, 508, 2, 2, 256, "bfloat16", True, True, (-1, -1)),
    "ring-causal-window-fp16": ("ring", 1, 1000, 2, 2, 64, "float16", True, False, (300, 0)),
    "ring-window-both-sides-bf16": ("ring", 1, 254, 2, 1, 128, "bfloat16", False, False, (17, 40)),
    "ulysses-causal-bf16": ("ulysses", 1, 254, 4, 4, 64, "bfloat16", True, False, (-1, -1)),
    "ulysses-causal-balanced-replicated-kv": ("ulysses", 2, 68, 4, 1, 128, "float16", True, True, (-1, -1)),
    "ulysses-full-gqa-fp32": ("ulysses", 1, 34, 6, 2, 64, "float32", False, False, (-1, -1)),
    "ulysses-causal-balanced-window-bf16": ("ulysses", 1, 508, 4, 2, 64, "bfloat16", True, True, (50, 0)),
}
FIELDS = ("strategy", "batch", "seqlen", "nheads", "nheads_k", "head_dim", "dtype", "causal", "balanced", "window")


def _cases() -> dict:
    return {name: dict(zip(FIELDS, values)) for name, values in CASES.items()}


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    cupy = pytest.importorskip("cupy")
    from tests.distributed_worker import run

    directory = tmp_path_factory.mktemp("distributed")
    rng = np.random.default_rng(19)
    inputs = {}
    for name, case in _cases().items():
        b, s, h, hk, d = (case[key] for key in ("batch", "seqlen", "nheads", "nheads_k", "head_dim"))
        for x, heads in (("q", h), ("k", hk), ("v", hk), ("dout", h)):
            values = rng.standard_normal((b, s, heads, d)).astype(np.float32)
            # rounded to the case's dtype, so that every process sees the same values
            inputs[f"{name}.{x}"] = cupy.asarray(values).astype(cupy.dtype(case["dtype"])).astype(np.float32).get()
    np.savez(directory / "inputs.npz", **inputs)
    torch.multiprocessing.spawn(run, args=(2, str(directory), _cases()), nprocs=2, join=True)
    return directory, inputs


@pytest.mark.parametrize("name", list(CASES))
def test_two_gpus_match_the_float64_reference(distributed_results, name):
    import cupy

    from cuflash.reference import attention_backward_reference, attention_reference

    directory, inputs = distributed_results
    case = _cases()[name]
    got = np.load(directory / f"{name}.npz")
    host = [inputs[f"{name}.{x}"].astype(np.float64) for x in ("q", "k", "v", "dout")]
    options = {"causal": case["causal"], "window_size": case["window"]}
    want_out, want_lse = attention_reference(*host[:3], **options)
    wants = attention_backward_reference(host[3], *host[:3], **options)
    low = case["dtype"] != "float32"
    dtype = cupy.dtype(case["dtype"])
    q, k, v, dout = (cupy.asarray(x).astype(dtype) for x in host)
    scale = 1 / math.sqrt(case["head_dim"])
    baseline = naive_attention_same_precision(q, k, v, softmax_scale=scale, **options) if low else None
    bases = naive_attention_backward_same_precision(dout, q, k, v, softmax_scale=scale, **options)
    # float32 results came back as float32; low-precision ones are checked at their dtype's values
    as_dtype = (lambda x: cupy.asarray(x).astype(dtype)) if low else (lambda x: x)
    assert_output_accurate(as_dtype(got["out"]), want_out, baseline)
    if "lse" in got:
        assert_lse_close(got["lse"], want_lse)
    for key, want, base in zip(("dq", "dk", "dv"), wants, bases):
        try:
            assert_output_accurate(as_dtype(got[key]), want, base)
        except AssertionError as error:
            raise AssertionError(f"{key}: {error}") from None


#: name -> (strategy, batch, whole seqlen, nheads, nheads_k, head_dim, dtype, causal, balanced, window)
JAX_CASES = {
    "jax-ring-causal-balanced-gqa-bf16": ("ring", 2, 68, 4, 2, 64, "bfloat16", True, True, (-1, -1)),
    "jax-ring-causal-contiguous-fp16": ("ring", 1, 254, 2, 2, 128, "float16", True, False, (-1, -1)),
    "jax-ring-full-fp32": ("ring", 1, 34, 2, 1, 64, "float32", False, False, (-1, -1)),
    "jax-ring-causal-window-bf16": ("ring", 1, 254, 2, 2, 64, "bfloat16", True, False, (100, 0)),
    "jax-ulysses-causal-balanced-mqa-bf16": ("ulysses", 1, 508, 4, 1, 64, "bfloat16", True, True, (-1, -1)),
    "jax-ulysses-full-fp16": ("ulysses", 2, 34, 2, 2, 128, "float16", False, False, (-1, -1)),
}


@pytest.mark.parametrize("name", list(JAX_CASES))
def test_jax_strategies_under_jit_match_the_float64_reference(name):
    jax = pytest.importorskip("jax")
    import cupy
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from cuflash.distributed import jax as ring_jax
    from cuflash.reference import attention_backward_reference, attention_reference

    gpus = [device for device in jax.devices() if device.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs 2 GPUs")
    strategy, batch, seqlen, nheads, nheads_k, head_dim, dtype_name, causal, balanced, window = JAX_CASES[name]
    dtype = cupy.dtype(dtype_name)
    rng = np.random.default_rng(23)
    host = [cupy.asarray(rng.standard_normal((batch, seqlen, heads, head_dim)).astype(np.float32)).astype(dtype)
            for heads in (nheads, nheads_k, nheads_k, nheads)]
    mesh = jax.sharding.Mesh(np.array(gpus[:2]), ("sequence",))
    spec = PartitionSpec(None, "sequence")
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map

    def ring(q, k, v):
        function = ring_jax.ring_attention if strategy == "ring" else ring_jax.ulysses_attention
        return function(q, k, v, "sequence", causal=causal, balanced=balanced, window_size=window)

    ringed = shard_map(ring, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    @jax.jit
    def loss_and_grads(q, k, v, dout):
        arranged = [ring_jax.shard_order(x, 2, balanced=balanced) for x in (q, k, v, dout)]
        out, pullback = jax.vjp(ringed, *arranged[:3])
        grads = pullback(arranged[3])
        return [ring_jax.sequence_order(x, 2, balanced=balanced) for x in (out, *grads)]

    jdtype = jnp.dtype(dtype_name)
    inputs = [jnp.asarray(x.astype(np.float32).get()).astype(jdtype) for x in host]
    out, dq, dk, dv = loss_and_grads(*inputs)
    host64 = [x.astype(np.float64).get() for x in host]
    options = {"causal": causal, "window_size": window}
    want_out, _ = attention_reference(*host64[:3], **options)
    wants = attention_backward_reference(host64[3], *host64[:3], **options)
    scale = 1 / math.sqrt(head_dim)
    low = dtype_name != "float32"
    baseline = naive_attention_same_precision(*host[:3], softmax_scale=scale, **options) if low else None
    bases = naive_attention_backward_same_precision(host[3], *host[:3], softmax_scale=scale, **options)
    assert_output_accurate(out, want_out, baseline)
    for key, got, want, base in zip(("dq", "dk", "dv"), (dq, dk, dv), wants, bases):
        try:
            assert_output_accurate(got, want, base)
        except AssertionError as error:
            raise AssertionError(f"{key}: {error}") from None
