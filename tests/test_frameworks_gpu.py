"""PyTorch and JAX arrays in, arrays of the same framework out, through
DLPack with no copies, on the framework's stream."""

import math

import numpy as np
import pytest

import cuflash
from cuflash.reference import attention_reference

from tests.helpers import (
    assert_lse_close,
    assert_output_accurate,
    naive_attention_backward_same_precision,
    naive_attention_same_precision,
)

pytestmark = pytest.mark.gpu


def _torch():
    return pytest.importorskip("torch")


def _baseline(q, k, v, causal):
    """Same-precision naive attention on the same memory (None for float32)."""
    import cupy

    q, k, v = (cupy.from_dlpack(x) for x in (q, k, v))
    if q.dtype == cupy.float32:
        return None
    return naive_attention_same_precision(q, k, v, causal=causal, softmax_scale=1 / math.sqrt(q.shape[-1]))


def _torch_reference(q, k, v, causal):
    """float64 reference from torch tensors (via NumPy)."""
    arrays = [x.detach().double().cpu().numpy() for x in (q, k, v)]
    return attention_reference(*arrays, causal=causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_in_torch_out(dtype, causal):
    torch = _torch()
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # PyTorch SDPA layout (batch, heads, seqlen, dim), passed as a transposed view
    q = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch_dtype, generator=gen).transpose(1, 2)
    k = torch.randn(2, 2, 330, 64, device="cuda", dtype=torch_dtype, generator=gen).transpose(1, 2)
    v = torch.randn(2, 2, 330, 64, device="cuda", dtype=torch_dtype, generator=gen).transpose(1, 2)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.shape == q.shape and out.dtype == torch_dtype and out.device == q.device
    assert lse.shape == (2, 4, 300) and lse.dtype == torch.float32
    ref_out, ref_lse = _torch_reference(q, k, v, causal)
    assert_output_accurate(out, ref_out, _baseline(q, k, v, causal))
    assert_lse_close(lse, ref_lse)


def test_torch_out_is_written_in_place_without_copy():
    torch = _torch()
    q = torch.randn(1, 128, 2, 32, device="cuda")
    out = torch.full_like(q, float("nan"))
    pointer = out.data_ptr()
    result = cuflash.attention(q, q, q, out=out)
    assert result is out and out.data_ptr() == pointer
    assert_output_accurate(out, _torch_reference(q, q, q, False)[0])


def test_torch_runs_on_the_current_torch_stream():
    """q is produced on a side stream behind a long sleep; if cuflash ran on
    any other stream it would read q before it is written."""
    torch = _torch()
    side = torch.cuda.Stream()
    q_src = torch.randn(2, 1000, 4, 64, device="cuda")
    k = torch.randn(2, 1000, 4, 64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q = torch.zeros_like(q_src)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        q.copy_(q_src)
        out = cuflash.attention(q, k, k)
        result = out.clone()
    side.synchronize()
    assert_output_accurate(result, _torch_reference(q_src, k, k, False)[0])


def test_torch_rejects_tensors_on_cpu_mixed_with_cuda():
    torch = _torch()
    q = torch.randn(1, 8, 1, 32, device="cuda")
    with pytest.raises(TypeError, match="k must be a CUDA GPU array .* torch.Tensor on device 'cpu'"):
        cuflash.attention(q, q.cpu(), q)


def _jax():
    return pytest.importorskip("jax")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jax_in_jax_out(dtype):
    jax = _jax()
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (2, 150, 4, 96), dtype=jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (2, 170, 1, 96), dtype=jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (2, 170, 1, 96), dtype=jnp.float32).astype(dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 4, 150)
    ref_out, ref_lse = attention_reference(*(np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in (q, k, v)), causal=True)
    assert_output_accurate(out, ref_out, _baseline(q, k, v, True))
    assert_lse_close(np.asarray(lse), ref_lse)


def test_jax_rejects_out_buffer():
    _jax()
    import jax.numpy as jnp

    q = jnp.ones((1, 4, 1, 8), dtype=jnp.float16)
    with pytest.raises(TypeError, match="JAX arrays are immutable"):
        cuflash.attention(q, q, q, out=q)


def test_jax_under_jit_gives_clear_error():
    jax = _jax()
    import jax.numpy as jnp

    q = jnp.ones((1, 4, 1, 8), dtype=jnp.float16)
    with pytest.raises(TypeError, match="traced JAX value"):
        jax.jit(lambda x: cuflash.attention(x, x, x))(q)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_backward_matches_float64_autograd(dtype, causal):
    """Gradients from PyTorch tensors against torch.autograd of float64 math
    attention on the GPU."""
    torch = _torch()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    seqlen_q, seqlen_k = 250, 300
    q = torch.randn(2, 4, seqlen_q, 64, device="cuda", dtype=torch_dtype, generator=gen).transpose(1, 2)
    k = torch.randn(2, 2, seqlen_k, 64, device="cuda", dtype=torch_dtype, generator=gen).transpose(1, 2)
    v = torch.randn(2, 2, seqlen_k, 64, device="cuda", dtype=torch_dtype, generator=gen).transpose(1, 2)
    dout = torch.randn(2, seqlen_q, 4, 64, device="cuda", dtype=torch_dtype, generator=gen)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.dtype == torch_dtype

    leaves = [x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    mask = None
    if causal:  # bottom-right aligned, as cuflash
        mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device="cuda").tril(seqlen_k - seqlen_q)
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    ref.backward(dout.double().transpose(1, 2))
    expected = [leaf.grad.transpose(1, 2) for leaf in leaves]

    import cupy

    baselines = (None, None, None)
    if dtype != "float32":
        views = [cupy.from_dlpack(x) for x in (dout, q, k, v)]
        baselines = naive_attention_backward_same_precision(*views, causal=causal, softmax_scale=1 / 8)
    for got, want, base in zip((dq, dk, dv), expected, baselines):
        assert_output_accurate(got, want.detach().cpu().numpy(), base)


def test_jax_backward_gives_jax_arrays():
    jax = _jax()
    import jax.numpy as jnp

    from cuflash.reference import attention_backward_reference

    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(keys[0], (1, 130, 4, 64), dtype=jnp.float32)
    k = jax.random.normal(keys[1], (1, 140, 2, 64), dtype=jnp.float32)
    v = jax.random.normal(keys[2], (1, 140, 2, 64), dtype=jnp.float32)
    dout = jax.random.normal(keys[3], q.shape, dtype=jnp.float32)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert all(isinstance(g, jax.Array) for g in grads)
    expected = attention_backward_reference(*(np.asarray(x, dtype=np.float64) for x in (dout, q, k, v)), causal=True)
    for got, want in zip(grads, expected):
        assert_output_accurate(np.asarray(got), want)
