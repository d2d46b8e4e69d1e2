"""cuflash.torch and cuflash.jax on the GPU: autograd, torch.compile, the
SDPA and flash_attn drop-ins, streams, CUDA graphs, several GPUs, and short
training runs against the frameworks' own attention."""

import fcntl
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import cuflash
from cuflash.reference import attention_backward_reference, attention_reference

from tests.helpers import (
    SPIN_AND_COPY,
    assert_output_accurate,
    naive_attention_backward_same_precision,
    naive_attention_same_precision,
    recorded_decisions,
)

pytestmark = pytest.mark.gpu


def _torch():
    return pytest.importorskip("torch")


def _ct():
    _torch()
    import cuflash.torch as ct

    return ct


def _baselines(q, k, v, dout, causal):
    import cupy

    views = [cupy.from_dlpack(x.detach()) for x in (q, k, v, dout)]
    scale = 1 / math.sqrt(q.shape[-1])
    out = naive_attention_same_precision(*views[:3], causal=causal, softmax_scale=scale)
    return out, naive_attention_backward_same_precision(views[3], *views[:3], causal=causal, softmax_scale=scale)


def _qkv(torch, shape_q, shape_kv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(*shape_q, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(*shape_kv, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(*shape_kv, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_attention_autograd(dtype, causal):
    torch, ct = _torch(), _ct()
    q, k, v = _qkv(torch, (2, 300, 8, 64), (2, 310, 2, 64), getattr(torch, dtype))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ct.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    arrays = [x.detach().double().cpu().numpy() for x in (q, k, v, dout)]
    ref_out, _ = attention_reference(*arrays[:3], causal=causal)
    ref_grads = attention_backward_reference(arrays[3], *arrays[:3], causal=causal)
    base_out, base_grads = _baselines(q, k, v, dout, causal)
    assert_output_accurate(out.detach(), ref_out, base_out)
    for got, want, base in zip((q.grad, k.grad, v.grad), ref_grads, base_grads):
        assert_output_accurate(got, want, base)


def test_torch_opcheck():
    torch, _ = _torch(), _ct()
    q, k, v = _qkv(torch, (1, 64, 4, 32), (1, 80, 2, 32), torch.bfloat16)
    for x in (q, k, v):
        x.requires_grad_()
    # (causal, scale, window left, right, softcap, slopes, dropout p, seed, offset), then the flags
    plain = (True, 0.2, -1, -1, 0.0, None, 0.0, 0, 0)
    variants = (False, 0.2, 20, 3, 5.0, torch.rand(4, device="cuda"), 0.1, 7, 2)
    for options in (plain, variants):
        torch.library.opcheck(torch.ops.cuflash.attention_forward.default, (q, k, v, *options, False, "ieee"))
        out, lse = torch.ops.cuflash.attention_forward(q, k, v, *options, False, "ieee")
        # The backward op takes plain tensors (no double backward through cuflash).
        torch.library.opcheck(torch.ops.cuflash.attention_backward.default,
                              (torch.randn_like(out), *(x.detach() for x in (q, k, v, out, lse)), *options, False))
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    torch.library.opcheck(torch.ops.cuflash.attention_forward.default, (q32, k32, v32, *plain, False, "3xtf32"))


@pytest.mark.parametrize("route", ["function", "custom_op"])
def test_torch_float32_3xtf32_forward_and_exact_backward(route):
    """cuflash.torch.attention(fp32_precision="3xtf32") on both eager routes:
    forward and gradients within the float32 bound of float64."""
    torch, ct = _torch(), _ct()
    q, k, v = _qkv(torch, (2, 200, 4, 64), (2, 300, 2, 64), torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ct._forward(q, k, v, True, None, route=route, fp32_precision="3xtf32")
    dout = torch.randn_like(out)
    out.backward(dout)
    arrays = [x.detach().double().cpu().numpy() for x in (q, k, v, dout)]
    ref_out, _ = attention_reference(*arrays[:3], causal=True)
    assert_output_accurate(out.detach(), ref_out)
    exact = ct.attention(q.detach(), k.detach(), v.detach(), causal=True)
    assert not bool((exact == out.detach()).all())  # the tensor-core path ran
    for got, want in zip((q.grad, k.grad, v.grad), attention_backward_reference(arrays[3], *arrays[:3], causal=True)):
        assert_output_accurate(got, want)


def test_torch_sdpa_drop_in_takes_3xtf32_where_torch_allows_tf32():
    torch, ct = _torch(), _ct()
    q, k, v = _qkv(torch, (1, 128, 4, 64), (1, 128, 4, 64), torch.float32)
    sdpa_layout = [x.transpose(1, 2) for x in (q, k, v)]
    ref_out, _ = attention_reference(*(x.double().cpu().numpy() for x in (q, k, v)), causal=True)
    previous = torch.get_float32_matmul_precision()
    try:
        results = {}
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            results[precision] = ct.scaled_dot_product_attention(*sdpa_layout, is_causal=True).transpose(1, 2)
            assert_output_accurate(results[precision], ref_out)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert not bool((results["highest"] == results["high"]).all())  # two kernels, not one


def test_torch_compile_fullgraph():
    torch, ct = _torch(), _ct()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

        def forward(self, q, k, v):
            return self.proj(ct.attention(q, k, v, causal=True)).sum()

    model = Model()
    q, k, v = _qkv(torch, (2, 128, 4, 64), (2, 128, 4, 64), torch.bfloat16)
    eager_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    compiled_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    eager = model(*eager_inputs)
    eager.backward()
    compiled = torch.compile(model, fullgraph=True)(*compiled_inputs)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    for a, b in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_drop_in_matches_pytorch(gqa):
    torch, ct = _torch(), _ct()
    heads_kv = 2 if gqa else 8
    q, k, v = _qkv(torch, (2, 8, 257, 64), (2, heads_kv, 257, 64), torch.float32, seed=4)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ours_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3, enable_gqa=gqa)
    ours = ct.scaled_dot_product_attention(*ours_leaves, is_causal=True, scale=0.3, enable_gqa=gqa)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    ours.backward(dout)
    for a, b in zip(ours_leaves, leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-3)


def test_sdpa_drop_in_rejects_unsupported_arguments():
    torch, ct = _torch(), _ct()
    q = torch.randn(1, 2, 8, 16, device="cuda")
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ct.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool, device="cuda"))
    with pytest.raises(NotImplementedError, match="top-left"):
        ct.scaled_dot_product_attention(q, q[:, :, :5], q[:, :, :5], is_causal=True)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ct.scaled_dot_product_attention(q, q[:, :1], q[:, :1])


def test_flash_attn_func_drop_in():
    torch, ct = _torch(), _ct()
    q, k, v = _qkv(torch, (2, 200, 8, 128), (2, 260, 4, 128), torch.bfloat16, seed=5)
    out = ct.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, ct.attention(q, k, v, causal=True), rtol=0, atol=0)
    grads = []
    for _ in range(3):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ct.flash_attn_func(*leaves, causal=True, deterministic=True).sum().backward()
        grads.append([x.grad for x in leaves])
    for later in grads[1:]:
        for a, b in zip(later, grads[0]):
            assert torch.equal(a, b)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        ct.flash_attn_func(q, k, v, return_attn_probs=True)


def test_torch_forward_and_backward_on_a_side_stream():
    """The inputs are produced on a side stream behind a long sleep; cuflash
    must run its forward and backward on that stream to see them."""
    torch, ct = _torch(), _ct()
    q_src, k_src, v_src = _qkv(torch, (2, 512, 4, 64), (2, 512, 4, 64), torch.float32, seed=6)
    dout = torch.randn_like(q_src)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q = torch.zeros_like(q_src, requires_grad=True)
        torch.cuda._sleep(200_000_000)
        with torch.no_grad():
            q.copy_(q_src)
        out = ct.attention(q, k_src, v_src)
        out.backward(dout)
        results = (out.detach().clone(), q.grad.clone())
    side.synchronize()
    arrays = [x.double().cpu().numpy() for x in (q_src, k_src, v_src, dout)]
    assert_output_accurate(results[0], attention_reference(*arrays[:3])[0])
    assert_output_accurate(results[1], attention_backward_reference(arrays[3], *arrays[:3])[0])


def test_cupy_stream_context():
    import cupy

    spin = cupy.RawKernel(SPIN_AND_COPY, "spin_and_copy")
    rng = cupy.random.default_rng(7)
    q_src, k, v = (rng.standard_normal((2, 400, 4, 64), dtype=cupy.float32) for _ in range(3))
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q = cupy.zeros_like(q_src)
        spin((64,), (256,), (q_src, q, np.int64(q.size), np.int64(400_000_000)))
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = cuflash.attention_backward(cupy.ones_like(out), q, k, v, out, lse, causal=True)
        stream.synchronize()
    ref = attention_reference(q_src, k, v, causal=True)[0]
    assert_output_accurate(out, ref)
    assert_output_accurate(dq, attention_backward_reference(cupy.ones_like(out), q_src, k, v, causal=True)[0])


def test_torch_cuda_graph_capture_and_replay():
    torch, ct = _torch(), _ct()
    shape = (2, 256, 4, 64)
    static = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    static_dout = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, settles the allocator
        for _ in range(2):
            for x in static:
                x.grad = None
            ct.attention(*static, causal=True).backward(static_dout)
    torch.cuda.current_stream().wait_stream(side)
    for x in static:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = ct.attention(*static, causal=True)
        static_out.backward(static_dout)
    for seed in (10, 11):
        fresh = _qkv(torch, shape, shape, torch.bfloat16, seed=seed)
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = [x.clone().requires_grad_() for x in fresh]
        expected = ct.attention(*eager, causal=True)
        expected.backward(static_dout)
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
        for captured, x in zip(static, eager):
            torch.testing.assert_close(captured.grad, x.grad, rtol=1e-2, atol=1e-2)


def test_torch_cuda_graph_of_a_split_decode_step():
    """A serving loop's decode step captured once and replayed: append the
    new token's K/V, then split-KV decoding whose merge is a dependent
    launch on Hopper (programmatic stream serialization, captured as a
    programmatic edge). Each replay matches the eager call bit for bit, the
    caches included."""
    import cupy

    from cuflash import api

    torch, ct = _torch(), _ct()
    gen = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    k_cache, v_cache = randn(1, 4096, 4, 128), randn(1, 4096, 4, 128)
    q, k_new, v_new = randn(1, 1, 32, 128), randn(1, 1, 4, 128), randn(1, 1, 4, 128)
    lengths = torch.full((1,), 1000, device="cuda", dtype=torch.int32)

    def step(k_cache, v_cache, lengths):
        return ct.flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=lengths, num_splits=5)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, settles the allocator
        for _ in range(2):
            step(k_cache, v_cache, lengths)
    torch.cuda.current_stream().wait_stream(side)
    if int(cupy.cuda.Device().compute_capability) >= 90:
        assert any(dependent is not None for entry in api.plans._entries.values()
                   for *_, dependent in entry.plan._launches), "no dependent launch in the decode step's plan"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(k_cache, v_cache, lengths)
    for _ in range(3):
        for x in (q, k_new, v_new):
            x.copy_(randn(*x.shape))
        eager_k, eager_v, eager_lengths = k_cache.clone(), v_cache.clone(), lengths.clone()
        graph.replay()
        expected = step(eager_k, eager_v, eager_lengths)
        torch.cuda.synchronize()
        assert not static_out.isnan().any()
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
        torch.testing.assert_close(k_cache, eager_k, rtol=0, atol=0)
        torch.testing.assert_close(v_cache, eager_v, rtol=0, atol=0)
        lengths += 1


def test_cupy_stream_capture_allocates_nothing():
    import cupy

    rng = cupy.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 300, 4, 64), dtype=cupy.float32) for _ in range(3))
    out = cupy.empty_like(q)
    lse = cupy.empty((2, 4, 300), dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v, causal=True, out=out, lse=lse)  # warm-up: compile and load
        stream.synchronize()

        def no_allocation(size):
            raise AssertionError(f"CuPy's pool allocated {size} bytes during capture")

        previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(no_allocation)
        try:
            stream.begin_capture()
            cuflash.attention(q, k, v, causal=True, out=out, lse=lse)
            graph = stream.end_capture()
        finally:
            cupy.cuda.set_allocator(previous)
        for seed in (1, 2):
            fresh = cupy.random.default_rng(seed).standard_normal(q.shape, dtype=cupy.float32)
            q[...] = fresh
            graph.launch(stream)
            stream.synchronize()
            ref_out, ref_lse = attention_reference(q, k, v, causal=True)
            assert_output_accurate(out, ref_out)
            assert np.allclose(lse.get(), ref_lse.get(), atol=1e-4)


def test_inputs_on_the_second_gpu_stay_there():
    torch, ct = _torch(), _ct()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.cuda.set_device(0)
    torch.cuda.synchronize(0)
    before = torch.cuda.mem_get_info(0)[0]
    allocated_before = torch.cuda.memory_allocated(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda:1", requires_grad=True) for _ in range(3))
    out = ct.attention(q, k, v, causal=True)
    out.sum().backward()
    torch.cuda.synchronize(1)
    assert out.device == torch.device("cuda:1") and q.grad.device == torch.device("cuda:1")
    assert torch.cuda.memory_allocated(0) == allocated_before
    assert torch.cuda.mem_get_info(0)[0] >= before - 2**20  # no buffer on GPU 0 (context pages aside)
    arrays = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    assert_output_accurate(out.detach(), attention_reference(*arrays, causal=True)[0])


def test_jax_custom_vjp_gradients():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, 150, 4, 64), dtype=jnp.float32)
    k = jax.random.normal(keys[1], (2, 170, 2, 64), dtype=jnp.float32)
    v = jax.random.normal(keys[2], (2, 170, 2, 64), dtype=jnp.float32)
    weights = jax.random.normal(keys[3], q.shape, dtype=jnp.float32)

    def loss(q, k, v):
        return jnp.sum(cj.attention(q, k, v, causal=True) * weights)

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    arrays = [np.asarray(x, dtype=np.float64) for x in (q, k, v, weights)]
    ref_out, _ = attention_reference(*arrays[:3], causal=True)
    assert float(value) == pytest.approx(float((ref_out * arrays[3]).sum()), rel=1e-5)
    for got, want in zip(grads, attention_backward_reference(arrays[3], *arrays[:3], causal=True)):
        assert_output_accurate(np.asarray(got), want)
    jit_value, jit_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert float(jit_value) == pytest.approx(float(value), rel=1e-6)
    for a, b in zip(jit_grads, grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_jax_float32_3xtf32_forward_under_jit():
    """cuflash.jax.attention(fp32_precision="3xtf32"), eager and jitted:
    the tensor-core forward (bitwise what cuflash.attention gives with the
    same flag, not what the exact path gives), within the float32 bound of
    float64; gradients through the exact backward."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    q, k, v = _jax_qkv((2, 130, 4, 64), (2, 140, 2, 64), jnp.float32, seed=3)
    direct = np.asarray(cuflash.attention(q, k, v, causal=True, fp32_precision="3xtf32"))
    exact = np.asarray(cuflash.attention(q, k, v, causal=True))
    eager = np.asarray(cj.attention(q, k, v, causal=True, fp32_precision="3xtf32"))
    jitted = np.asarray(jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True, fp32_precision="3xtf32"))(q, k, v))
    assert np.array_equal(eager, direct) and np.array_equal(jitted, direct) and not np.array_equal(direct, exact)
    arrays = [np.asarray(x, dtype=np.float64) for x in (q, k, v)]
    assert_output_accurate(jitted, attention_reference(*arrays, causal=True)[0])
    grads = jax.jit(jax.grad(lambda q: jnp.sum(cj.attention(q, k, v, causal=True, fp32_precision="3xtf32"))))(q)
    assert not np.isnan(np.asarray(grads)).any()
    with pytest.raises(ValueError, match="fp32_precision must be one of"):
        cj.attention(q, k, v, fp32_precision="tf32")


def _jax_qkv(shape_q, shape_kv, dtype, seed=0):
    jax = pytest.importorskip("jax")
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(keys[0], shape_q, dtype=dtype), jax.random.normal(keys[1], shape_kv, dtype=dtype),
            jax.random.normal(keys[2], shape_kv, dtype=dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_jit_matches_eager_bitwise(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    assert cj.JIT_SUPPORTED
    q, k, v = _jax_qkv((2, 130, 4, 64), (2, 140, 2, 64), getattr(jnp, dtype), seed=1)
    weights = jax.random.normal(jax.random.PRNGKey(9), q.shape, dtype=jnp.float32)
    direct = np.asarray(cuflash.attention(q, k, v, causal=True))  # the DLPack route
    eager = np.asarray(cj.attention(q, k, v, causal=True))
    jitted = np.asarray(jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True))(q, k, v))
    assert np.array_equal(eager, direct) and np.array_equal(jitted, direct)

    def loss(q, k, v):
        out = cj.attention(q, k, v, causal=True, deterministic=True)
        return jnp.sum(out.astype(jnp.float32) * weights)

    eager_grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jit_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    remat_grads = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    direct_grads = cuflash.attention_backward(weights.astype(q.dtype), q, k, v, out, lse, causal=True,
                                              deterministic=True)
    for e, j, r, d in zip(eager_grads, jit_grads, remat_grads, direct_grads):
        assert np.array_equal(np.asarray(e), np.asarray(j)) and np.array_equal(np.asarray(j), np.asarray(r))
        if dtype == "float32":  # in bf16 the cotangent is whatever JAX's astype transpose rounds it to
            assert np.array_equal(np.asarray(j), np.asarray(d))
    arrays = [np.asarray(x, dtype=np.float64) for x in (q, k, v, weights)]
    for got, want in zip(jit_grads, attention_backward_reference(arrays[3], *arrays[:3], causal=True)):
        assert not np.isnan(np.asarray(got, dtype=np.float64)).any()
        if dtype == "float32":
            assert_output_accurate(np.asarray(got), want)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_jax_jit_backward_of_one_key_block_stores_dq_directly(causal, monkeypatch):
    """Under jax.jit a backward whose 120 keys fit one key block takes the
    direct dQ mode where XLA's dq buffer is 16-byte aligned (the JAX plan's
    key holds that): dQ stored by the dK/dV kernel into XLA's buffer, not
    converted from the accumulator XLA also allocates (and the plan leaves
    unzeroed). The jitted gradients are bitwise the eager
    cuflash.attention_backward's on the same arrays (its own dq, also
    direct: one key block, one order)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj
    from cuflash import api

    decisions = recorded_decisions(monkeypatch, "stores_dq_directly")
    api.plans.clear()
    q, k, v = _jax_qkv((2, 100, 4, 64), (2, 120, 2, 64), jnp.bfloat16, seed=5)
    cotangent = jax.random.normal(jax.random.PRNGKey(6), q.shape, dtype=jnp.bfloat16)

    def loss(q, k, v):  # d loss / d out is the cotangent exactly
        return jnp.sum((cj.attention(q, k, v, causal=causal) * cotangent).astype(jnp.float32))

    jit_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert decisions == [True]
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    eager_grads = cuflash.attention_backward(cotangent, q, k, v, out, lse, causal=causal)
    for j, e in zip(jit_grads, eager_grads):
        assert not np.isnan(np.asarray(j, dtype=np.float64)).any()
        assert np.array_equal(np.asarray(j).view(np.uint16), np.asarray(e).view(np.uint16))
    api.plans.clear()


def test_jax_vmap_folds_into_the_batch():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    q, k, v = _jax_qkv((3, 2, 65, 4, 32), (3, 2, 70, 2, 32), jnp.float32, seed=2)
    attention = lambda q, k, v: cj.attention(q, k, v, causal=True)  # noqa: E731
    batched = jax.jit(jax.vmap(attention))(q, k, v)
    for i in range(3):
        assert np.array_equal(np.asarray(batched[i]), np.asarray(attention(q[i], k[i], v[i])))
    shared = jax.vmap(attention, in_axes=(0, None, None))(q, k[0], v[0])  # k, v broadcast along the mapped axis
    for i in range(3):
        assert np.array_equal(np.asarray(shared[i]), np.asarray(attention(q[i], k[0], v[0])))
    grads = jax.grad(lambda q: jax.vmap(attention)(q, k, v).sum())(q)
    assert grads.shape == q.shape and not bool(jnp.isnan(grads).any())


def test_jax_bad_input_is_rejected_when_traced():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cj

    q, k, v = _jax_qkv((1, 16, 4, 32), (1, 16, 3, 32), jnp.float32)
    with pytest.raises(ValueError, match="multiple of k's nheads_k"):
        jax.jit(lambda q, k, v: cj.attention(q, k, v))(q, k, v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cj.attention(q, q, q, causal="yes")
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        jax.jit(lambda q, k: cj.attention(q, k, k))(q, q.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="traced JAX value.*cuflash.jax.attention"):
        jax.jit(lambda q: cuflash.attention(q, q, q))(q)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_first", [False, True])
def test_torch_eager_routes_agree(causal, heads_first):
    """The autograd.Function route (eager) and the custom-op route (what
    torch.compile traces) give identical outputs and gradients, in
    cuflash's layout and in SDPA's (heads_first, as the drop-in calls)."""
    torch, ct = _torch(), _ct()
    q, k, v = _qkv(torch, (2, 200, 8, 64), (2, 230, 2, 64), torch.bfloat16, seed=12)
    dout = torch.randn_like(q)
    if heads_first:
        q, k, v, dout = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
    results = {}
    for route in ("function", "custom_op"):
        for deterministic in (True, False):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = ct._forward(*leaves, causal, None, deterministic, route=route, heads_first=heads_first)
            out.backward(dout)
            results[route, deterministic] = [out.detach()] + [x.grad for x in leaves]
    for deterministic in (True, False):
        ours, theirs = results["function", deterministic], results["custom_op", deterministic]
        assert torch.equal(ours[0], theirs[0])
        for a, b in zip(ours[1:], theirs[1:]):
            if deterministic:
                assert torch.equal(a, b)
            else:  # float32 atomics: summation order varies run to run
                torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        assert torch.equal(ct._forward(q, k, v, causal, None, heads_first=heads_first), results["function", True][0])


def test_torch_sdpa_dropin_is_one_autograd_node():
    """The drop-in's layout change happens inside its autograd node: the
    output is a tensor of its own (not a view: in-place changes are
    allowed, as on SDPA's), its node leads straight to the leaves, the
    gradients arrive in the leaves' layout without a copy, and a second
    derivative is refused, not silently wrong."""
    torch, ct = _torch(), _ct()
    q, k, v = (x.transpose(1, 2).contiguous().requires_grad_()
               for x in _qkv(torch, (2, 100, 4, 64), (2, 100, 4, 64), torch.float16, seed=13))
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out._base is None and out.stride() == q.stride()
    assert [type(node).__name__ for node, _ in out.grad_fn.next_functions] == ["AccumulateGrad"] * 3
    dout = torch.randn_like(out)
    out.backward(dout)
    want = torch.nn.functional.scaled_dot_product_attention(*(x.detach().double() for x in (q, k, v)),
                                                              is_causal=True)
    torch.testing.assert_close(out.detach().double(), want, atol=2e-3, rtol=0)
    for leaf in (q, k, v):
        assert leaf.grad.stride() == leaf.stride() and torch.isfinite(leaf.grad).all()
    ct.scaled_dot_product_attention(q, k, v, is_causal=True).mul_(2)  # in place, recorded: allowed
    out = ct.scaled_dot_product_attention(q, k, v, is_causal=True)
    (grad_q,) = torch.autograd.grad(out, q, dout.requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.sum().backward()


@pytest.mark.parametrize("window_size,softcap", [((-1, -1), 0.0), ((40, 0), 5.0)])
def test_torch_backward_follows_its_forwards_cached_call(monkeypatch, window_size, softcap):
    """A training loop's backward runs the plan remembered on its forward's
    cached call (api.backward_following): after the first backward of each
    dout layout, no backward reads the signatures of q, k, v, out and lse
    (api._backward, the signature path, is not called); without variants,
    no forward after the first cached one takes _attention's signature path
    (api.forward_plain); and every step's
    output and gradients are bitwise those of cuflash.attention /
    attention_backward on the same tensors (deterministic dQ), for two
    dout layouts, with GQA, a window and a soft cap. Under saved-tensor
    hooks (save_on_cpu: the saved tensors come back as copies) the
    signature path runs, with the same results."""
    torch, ct = _torch(), _ct()
    from cuflash import api
    from cuflash._launch import PlanCache

    monkeypatch.setattr(api, "plans", PlanCache())

    def counted(name: str) -> list:
        """The argument tuples of each call of api.``name`` from now on."""
        calls, function = [], getattr(api, name)

        def counting(*args):
            calls.append(args)
            return function(*args)

        monkeypatch.setattr(api, name, counting)
        return calls

    signature_path, forward_signature_path = counted("_backward"), counted("_attention")
    q, k, v = (x.transpose(1, 2).contiguous() for x in _qkv(torch, (2, 130, 8, 64), (2, 150, 2, 64),
                                                              torch.bfloat16, seed=21))
    variants = ct._variants(window_size, softcap)
    plain = variants is ct._NO_VARIANTS
    gen = torch.Generator(device="cuda").manual_seed(22)

    def step(index: int, dout_seqlen_first: bool):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]  # new tensors every step, as in training
        dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
        if dout_seqlen_first:  # SDPA's shape, cuflash's memory order
            dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
        forwards_before = len(forward_signature_path)
        out = ct._forward(*leaves, True, None, True, variants=variants, heads_first=True)
        before = len(signature_path)
        out.backward(dout)
        took_signature_path = len(signature_path) > before
        # Without variants, a forward after the first cached one reads only
        # q's, k's and v's signatures (api.forward_plain).
        forward_took_signature_path = len(forward_signature_path) > forwards_before
        assert forward_took_signature_path == (not plain or index < 2)
        want_out, want_lse = cuflash.attention(*leaves, causal=True, window_size=window_size, softcap=softcap,
                                               return_lse=True, heads_first=True)
        want = cuflash.attention_backward(dout, *leaves, want_out, want_lse, causal=True, window_size=window_size,
                                          softcap=softcap, deterministic=True, heads_first=True)
        assert torch.equal(out.detach(), want_out)
        for leaf, expected in zip(leaves, want):
            assert torch.equal(leaf.grad, expected)
        return took_signature_path

    # Step 0's forward is planned (no cached call to follow); step 1's dout
    # layout is new (its backward planned, not cached yet: nothing to
    # remember); steps 2 and 3 are each layout's first cached backward
    # after a cached forward, remembered; the steps after follow.
    assert [step(i, i % 2 == 1) for i in range(7)] == [True] * 4 + [False] * 3
    with torch.autograd.graph.save_on_cpu():
        assert step(7, False)


def test_torch_wrappers_reject_cpu_tensors_in_one_line():
    torch, ct = _torch(), _ct()
    q = torch.randn(1, 2, 8, 16)
    for call in (lambda: ct.scaled_dot_product_attention(q, q, q), lambda: ct.flash_attn_func(q, q, q),
                 lambda: ct.attention(q.requires_grad_(), q, q), lambda: ct._forward(q, q, q, False, None,
                                                                                     route="custom_op")):
        with pytest.raises(TypeError, match="CUDA") as info:
            call()
        assert "\n" not in str(info.value)


# --- end-to-end: a small transformer block trained for 50 steps in bfloat16 (JAX: each step jitted) ---

E2E_STEPS, E2E_VOCAB, E2E_DIM, E2E_HEADS, E2E_SEQ, E2E_BATCH = 50, 64, 128, 2, 64, 16
#: Stated tolerance: at every step the two loss curves differ by at most 3% of the initial loss.
E2E_TOLERANCE = 0.03


def _record_e2e(name: str, ours, reference) -> float:
    """Max gap of the two loss curves as a fraction of the initial loss;
    both curves go to $OUT/e2e_losses.json when OUT is set (gpu_check.sh)."""
    gap = float(np.abs(ours - reference).max() / reference[0])
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "e2e_losses.json"
        # gpu_check.sh may run tests in several processes (pytest-xdist).
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = json.loads(path.read_text()) if path.exists() else {}
            data[name] = {"cuflash": ours.tolist(), "reference": reference.tolist(), "max_gap_of_initial": gap,
                          "tolerance": E2E_TOLERANCE}
            path.write_text(json.dumps(data, indent=1))
    return gap


def _copy_task(rng, batch):
    """Tokens and targets of a copy task (predict the previous token), learnable by causal attention."""
    tokens = rng.integers(0, E2E_VOCAB, size=(batch, E2E_SEQ))
    targets = np.concatenate([tokens[:, :1], tokens[:, :-1]], axis=1)
    return tokens, targets


def _torch_losses(attention_fn):
    torch = _torch()
    torch.manual_seed(0)
    dim, heads = E2E_DIM, E2E_HEADS
    head_dim = dim // heads
    embed = torch.nn.Embedding(E2E_VOCAB, dim).cuda()
    positions = torch.nn.Embedding(E2E_SEQ, dim).cuda()
    norm1, norm2 = torch.nn.LayerNorm(dim).cuda(), torch.nn.LayerNorm(dim).cuda()
    qkv, proj = torch.nn.Linear(dim, 3 * dim).cuda(), torch.nn.Linear(dim, dim).cuda()
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)).cuda()
    head = torch.nn.Linear(dim, E2E_VOCAB).cuda()
    modules = torch.nn.ModuleList([embed, positions, norm1, norm2, qkv, proj, mlp, head])
    optimizer = torch.optim.Adam(modules.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(E2E_STEPS):
        tokens, targets = (torch.as_tensor(x, device="cuda") for x in _copy_task(rng, E2E_BATCH))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = embed(tokens) + positions.weight[: tokens.shape[1]]
            b, s, _ = x.shape
            q, k, v = qkv(norm1(x)).view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            attended = attention_fn(q, k, v, is_causal=True)  # (b, h, s, d) in bfloat16
            assert attended.dtype == torch.bfloat16
            x = x + proj(attended.transpose(1, 2).reshape(b, s, dim))
            x = x + mlp(norm2(x))
            loss = torch.nn.functional.cross_entropy(head(x).float().reshape(-1, E2E_VOCAB), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return np.array(losses)


def test_end_to_end_training_tracks_pytorch_sdpa():
    torch, ct = _torch(), _ct()
    ours = _torch_losses(ct.scaled_dot_product_attention)
    reference = _torch_losses(torch.nn.functional.scaled_dot_product_attention)
    gap = _record_e2e("torch_sdpa", ours, reference)
    print(f"torch e2e: loss {reference[0]:.3f} -> {reference[-1]:.3f} (SDPA), {ours[-1]:.3f} (cuflash); "
          f"max gap {gap:.4f} of the initial loss")
    assert reference[-5:].mean() < reference[:5].mean() and ours[-5:].mean() < ours[:5].mean()  # both learn
    assert gap <= E2E_TOLERANCE


def _jax_losses(attention_fn):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    dim, heads = E2E_DIM, E2E_HEADS
    head_dim = dim // heads
    keys = jax.random.split(jax.random.PRNGKey(0), 7)
    init = lambda key, shape: jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[0])  # noqa: E731
    params = {"embed": jax.random.normal(keys[0], (E2E_VOCAB, dim)), "qkv": init(keys[1], (dim, 3 * dim)),
              "proj": init(keys[2], (dim, dim)), "up": init(keys[3], (dim, 4 * dim)),
              "down": init(keys[4], (4 * dim, dim)), "head": init(keys[5], (dim, E2E_VOCAB)),
              "pos": 0.02 * jax.random.normal(keys[6], (E2E_SEQ, dim))}
    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)

    def layer_norm(x):
        return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)

    def loss_fn(params, tokens, targets):
        x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
        b, s, _ = x.shape
        qkv = (layer_norm(x) @ params["qkv"]).reshape(b, s, 3, heads, head_dim).astype(jnp.bfloat16)
        attended = attention_fn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).astype(jnp.float32)
        x = x + attended.reshape(b, s, dim) @ params["proj"]
        x = x + jax.nn.gelu(layer_norm(x) @ params["up"]) @ params["down"]
        logits = x @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(params, state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    rng = np.random.default_rng(0)
    losses = []
    for _ in range(E2E_STEPS):
        tokens, targets = _copy_task(rng, E2E_BATCH)
        params, state, loss = step(params, state, jnp.asarray(tokens), jnp.asarray(targets))
        losses.append(float(loss))
    return np.array(losses)


def test_end_to_end_training_tracks_jax_dot_product_attention():
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    import cuflash.jax as cj

    ours = _jax_losses(lambda q, k, v: cj.attention(q, k, v, causal=True))
    reference = _jax_losses(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    gap = _record_e2e("jax_dot_product_attention", ours, reference)
    print(f"jax e2e: loss {reference[0]:.3f} -> {reference[-1]:.3f} (jax), {ours[-1]:.3f} (cuflash); "
          f"max gap {gap:.4f} of the initial loss")
    assert reference[-5:].mean() < reference[:5].mean() and ours[-5:].mean() < ours[:5].mean()
    assert gap <= E2E_TOLERANCE
