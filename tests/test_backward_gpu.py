"""Backward pass on the GPU against the float64 reference.

Gradient buffers are poisoned with NaN before every run, so an element the
kernels failed to write fails the test. Inputs are fresh random normals."""

import math

import pytest

import cuflash
from cuflash._launch import LaunchPlan
from cuflash.reference import attention_backward_reference

from tests.helpers import (
    assert_output_accurate,
    naive_attention_backward_same_precision,
    random_qkv,
)
from tests.test_forward_gpu import DTYPES, HEAD_DIMS, SEQLENS, _PoolTracker, _cupy, _dtype
from tests.validation_cases import BAD_BACKWARD_CASES, make_cupy_arrays

pytestmark = pytest.mark.gpu


def forward_for_backward(q, k, v, *, causal, softmax_scale=None, seed=0, **variants):
    """out and lse from cuflash's forward (with ``variants``: window_size, ...), and a random dout."""
    cupy = _cupy()
    out, lse = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, **variants)
    rng = cupy.random.default_rng(seed + 12345)
    dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(q.dtype)
    return dout, out, lse


def run_backward_and_check(q, k, v, *, causal, softmax_scale=None, deterministic=False, seed=0, allocate=False,
                           **variants):
    """cuflash's backward (with ``variants``: window_size, ...) against the
    float64 reference, into NaN-poisoned dq, dk, dv, or (``allocate``) into
    the gradients it allocates itself."""
    cupy = _cupy()
    head_dim = q.shape[-1]
    scale = 1 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    dout, out, lse = forward_for_backward(q, k, v, causal=causal, softmax_scale=softmax_scale, seed=seed, **variants)
    poisoned = [None] * 3 if allocate else [cupy.full(x.shape, cupy.nan, dtype=x.dtype) for x in (q, k, v)]
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                       deterministic=deterministic, dq=poisoned[0], dk=poisoned[1], dv=poisoned[2],
                                       **variants)
    assert allocate or all(g is p for g, p in zip(grads, poisoned))
    expected = attention_backward_reference(dout, q, k, v, causal=causal, softmax_scale=scale, **variants)
    # float32 results are judged by relative error; their baseline only
    # matters where the exact gradient cancels to zero (see assert_output_accurate).
    baselines = naive_attention_backward_same_precision(dout, q, k, v, causal=causal, softmax_scale=scale,
                                                        **variants)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, expected, baselines):
        try:
            assert_output_accurate(got, want, base)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    return grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,layout", [((4, 4), "bshd"), ((4, 2), "bhsd")], ids=["mha-contiguous", "gqa-bhsd-view"])
def test_backward_grid(dtype, head_dim, seqlen, causal, heads, layout):
    cupy = _cupy()
    nheads, nheads_k = heads
    q, k, v = random_qkv(cupy, 2, seqlen, seqlen, nheads, nheads_k, head_dim, _dtype(dtype), layout=layout,
                         seed=seqlen * 5 + head_dim)
    run_backward_and_check(q, k, v, causal=causal, seed=seqlen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 59, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (1000, 1000), (300, 129)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_deterministic_is_accurate(dtype, head_dim, seqlen_q, seqlen_k, causal):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, head_dim, _dtype(dtype), seed=head_dim)
    run_backward_and_check(q, k, v, causal=causal, deterministic=True, seed=3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backward_deterministic_is_bitwise_repeatable(dtype):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1000, 1000, 8, 2, 64, _dtype(dtype), seed=21)
    dout, out, lse = forward_for_backward(q, k, v, causal=True)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(9):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view(cupy.uint16 if a.itemsize == 2 else cupy.uint32)
                         == b.view(cupy.uint16 if b.itemsize == 2 else cupy.uint32)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 2049), (2049, 1), (17, 1000), (1000, 17), (128, 127), (1, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_different_lengths(dtype, seqlen_q, seqlen_k, causal):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 1, 64, _dtype(dtype), seed=seqlen_q + seqlen_k)
    dq, _, _ = run_backward_and_check(q, k, v, causal=causal)
    if causal and seqlen_q > seqlen_k:
        assert float(cupy.abs(dq[:, : seqlen_q - seqlen_k].astype(cupy.float32)).max()) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_k", [1, 2, 8])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sliced"])
def test_backward_mqa_gqa_and_strides(dtype, nheads_k, layout):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 3, 300, 257, 8, nheads_k, 72, _dtype(dtype), layout=layout, seed=nheads_k)
    run_backward_and_check(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 2, 33, 100, 200, 255])
def test_backward_odd_head_dims_and_scale(dtype, head_dim):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 77, 91, 2, 1, head_dim, _dtype(dtype), seed=head_dim)
    run_backward_and_check(q, k, v, causal=False, softmax_scale=0.3)
    run_backward_and_check(q, k, v, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_empty_sequences(deterministic):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 0, 4, 2, 64, cupy.float16)
    dout, out, lse = forward_for_backward(q, k, v, causal=False)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic)
    assert dq.shape == q.shape and float(cupy.abs(dq.astype(cupy.float32)).max()) == 0.0
    assert dk.shape == k.shape and dv.shape == v.shape
    q, k, v = random_qkv(cupy, 2, 0, 40, 4, 2, 64, cupy.float16)
    dout, out, lse = forward_for_backward(q, k, v, causal=True)
    dk_poisoned = cupy.full(k.shape, cupy.nan, dtype=k.dtype)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic,
                                            dk=dk_poisoned)
    assert dq.shape == q.shape and dk is dk_poisoned
    assert float(cupy.abs(dk.astype(cupy.float32)).max()) == 0.0
    assert float(cupy.abs(dv.astype(cupy.float32)).max()) == 0.0


def test_backward_memory_is_gradients_accumulator_and_delta():
    """batch 1, 8 heads, seqlen 65536, head_dim 128, bf16: the backward
    allocates dq, dk, dv, the float32 dQ accumulator, delta, and at most 1 MiB more."""
    cupy = _cupy()
    shape = (1, 65536, 8, 128)
    rng = cupy.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal(shape, dtype=cupy.float32).astype(_dtype("bfloat16")) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    small = tuple(x[:, :64] for x in (dout, q, k, v, out))
    cuflash.attention_backward(*small, cupy.ascontiguousarray(lse[:, :, :64]), causal=True)  # compile outside
    cupy.cuda.Device().synchronize()
    tracker = _PoolTracker()
    with tracker.hook:
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        cupy.cuda.Device().synchronize()
    grads = dq.nbytes + dk.nbytes + dv.nbytes
    accumulator = 65536 * 8 * 128 * 4
    delta = 8 * 65536 * 4
    allowed = grads + accumulator + delta + 2**20
    assert tracker.hook.peak <= allowed, f"peak {tracker.hook.peak} > {allowed}"
    assert not bool(cupy.isnan(dq[0, -64:].astype(cupy.float32)).any())


@pytest.mark.parametrize("case", [c for c in BAD_BACKWARD_CASES if not c.needs_two_gpus], ids=lambda c: c.id)
def test_bad_backward_input_is_rejected_before_launch(case, monkeypatch):
    monkeypatch.setattr(LaunchPlan, "launch", lambda *a, **k: pytest.fail("launched on bad input"))
    arrays = make_cupy_arrays(case)
    with pytest.raises(case.error, match=case.match):
        cuflash.attention_backward(arrays["dout"], arrays["q"], arrays["k"], arrays["v"], arrays["out"],
                                   arrays["lse"], dq=arrays.get("dq"), dk=arrays.get("dk"), dv=arrays.get("dv"),
                                   **case.options)
