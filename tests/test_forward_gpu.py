"""Forward pass on the GPU against the float64 reference.

Outputs and LSE are poisoned with NaN before every run, so an element the
kernel failed to write fails the test. Inputs are fresh random normals."""

import math

import pytest

import cuflash
from cuflash._launch import LaunchPlan
from cuflash.reference import attention_reference

from tests.helpers import (
    assert_lse_close,
    assert_output_accurate,
    naive_attention_same_precision,
    random_qkv,
)
from tests.validation_cases import BAD_FORWARD_CASES, make_cupy_arrays

pytestmark = pytest.mark.gpu

DTYPES = ["float16", "bfloat16", "float32"]
HEAD_DIMS = [16, 32, 59, 64, 96, 128, 192, 256]
SEQLENS = [1, 17, 128, 1000, 2049]


def _cupy():
    import cupy

    return cupy


def _dtype(name):
    return _cupy().dtype(name)  # "bfloat16" resolves through ml_dtypes


def run_and_check(q, k, v, *, causal, softmax_scale=None, **options):
    """Runs cuflash (with ``options``, e.g. fp32_precision) into NaN-poisoned
    buffers and checks output and LSE against float64 (and, for fp16/bf16,
    against the same-precision baseline)."""
    cupy = _cupy()
    batch, seqlen_q, nheads, head_dim = q.shape
    scale = 1 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    lse = cupy.full((batch, nheads, seqlen_q), cupy.nan, dtype=cupy.float32)
    result, lse_result = cuflash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse=lse,
                                           return_lse=True, **options)
    assert result is out and lse_result is lse
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    baseline = None
    if q.dtype != cupy.float32:
        baseline = naive_attention_same_precision(q, k, v, causal=causal, softmax_scale=scale)
    assert_output_accurate(out, ref_out, baseline)
    assert_lse_close(lse, ref_lse)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads,layout", [((4, 4), "bshd"), ((4, 2), "bhsd")], ids=["mha-contiguous", "gqa-bhsd-view"])
def test_forward_grid(dtype, head_dim, seqlen, causal, heads, layout):
    cupy = _cupy()
    nheads, nheads_k = heads
    q, k, v = random_qkv(cupy, 2, seqlen, seqlen, nheads, nheads_k, head_dim, _dtype(dtype), layout=layout,
                         seed=seqlen * 7 + head_dim)
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 2049), (2049, 1), (17, 1000), (1000, 17), (128, 127), (127, 128), (1, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_different_lengths(dtype, seqlen_q, seqlen_k, causal, head_dim):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 4, head_dim, _dtype(dtype), seed=seqlen_q + 3 * seqlen_k)
    out, lse = run_and_check(q, k, v, causal=causal)
    if causal and seqlen_q > seqlen_k:
        unseen = seqlen_q - seqlen_k  # rows that see no key
        assert float(cupy.abs(out[:, :unseen].astype(cupy.float32)).max()) == 0.0
        assert bool(cupy.isneginf(lse[:, :, :unseen]).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nheads_k", [1, 2, 8])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sliced"])
def test_forward_mqa_gqa_and_strides(dtype, nheads_k, layout):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 3, 300, 257, 8, nheads_k, 72, _dtype(dtype), layout=layout, seed=nheads_k)
    assert layout == "bshd" or not q.flags.c_contiguous
    run_and_check(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 2, 31, 33, 100, 129, 200, 255])
def test_forward_odd_head_dims(dtype, head_dim):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 77, 91, 2, 1, head_dim, _dtype(dtype), seed=head_dim)
    run_and_check(q, k, v, causal=False)
    run_and_check(q, k, v, causal=True)


@pytest.mark.parametrize("scale", [0.01, 0.37, 2.0, -0.5])
def test_forward_softmax_scale(scale):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 100, 130, 2, 2, 64, cupy.float32, seed=5)
    run_and_check(q, k, v, causal=False, softmax_scale=scale)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_empty_key_sequence_gives_zeros_and_minus_inf(causal):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 0, 4, 2, 64, cupy.float16)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and float(cupy.abs(out.astype(cupy.float32)).max()) == 0.0
    assert lse.shape == (2, 4, 33) and bool(cupy.isneginf(lse).all())


def _fail_if_any_kernel(message):
    real = LaunchPlan.launch

    def launch(plan, pointers, stream):
        if plan.kernel_count:
            pytest.fail(message)
        real(plan, pointers, stream)
    return launch


@pytest.mark.parametrize("shape_q", [(2, 0, 4, 64), (0, 5, 4, 64), (2, 5, 0, 64)])
def test_forward_empty_query_launches_nothing(shape_q, monkeypatch):
    cupy = _cupy()
    monkeypatch.setattr(LaunchPlan, "launch", _fail_if_any_kernel("launched on an empty problem"))
    q = cupy.ones(shape_q, dtype=cupy.float16)
    nheads_k = 0 if shape_q[2] == 0 else 2
    k = cupy.ones((shape_q[0], 7, nheads_k, 64), dtype=cupy.float16)
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    assert out.shape == shape_q and lse.shape == (shape_q[0], shape_q[2], shape_q[1])


def test_forward_public_api_defaults():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 50, 60, 2, 2, 32, cupy.float32, seed=11)
    out = cuflash.attention(q, k, v)
    assert isinstance(out, cupy.ndarray) and out.shape == q.shape and out.dtype == q.dtype
    ref, _ = attention_reference(q, k, v)
    assert_output_accurate(out, ref)
    out2, lse = cuflash.attention(q, k, v, return_lse=True)
    assert lse.dtype == cupy.float32 and lse.shape == (1, 2, 50)
    assert bool((out2 == out).all())  # deterministic


@pytest.mark.exclusive
def test_forward_large_offsets_beyond_int32():
    """Tensors of more than 2**31 elements: offsets must be 64-bit."""
    cupy = _cupy()
    seqlen, nheads, head_dim = 128, 16, 128
    batch = 2**31 // (seqlen * nheads * head_dim) + 2  # last batch entries start past 2**31
    assert batch * seqlen * nheads * head_dim > 2**31
    q = cupy.empty((batch, seqlen, nheads, head_dim), dtype=cupy.float16)
    rng = cupy.random.default_rng(0)
    for tensor in (q,):
        tensor[...] = rng.standard_normal(tensor.shape, dtype=cupy.float32).astype(cupy.float16)
    k = cupy.empty_like(q)
    k[...] = rng.standard_normal(k.shape, dtype=cupy.float32).astype(cupy.float16)
    v = cupy.empty_like(q)
    v[...] = rng.standard_normal(v.shape, dtype=cupy.float32).astype(cupy.float16)
    out = cupy.full(q.shape, cupy.nan, dtype=cupy.float16)
    cuflash.attention(q, k, v, causal=True, out=out)
    for index in (0, batch - 1):
        sl = slice(index, index + 1)
        ref, _ = attention_reference(q[sl], k[sl], v[sl], causal=True)
        base = naive_attention_same_precision(q[sl], k[sl], v[sl], causal=True, softmax_scale=head_dim ** -0.5)
        assert_output_accurate(out[sl], ref, base)
    del q, k, v, out
    cupy.get_default_memory_pool().free_all_blocks()


class _PoolTracker:
    """CuPy memory hook recording the peak of bytes held from the pool."""

    def __init__(self):
        import cupy

        class Hook(cupy.cuda.MemoryHook):
            name = "cuflash-test-peak"

            def __init__(hook):
                hook.current = 0
                hook.peak = 0

            def malloc_postprocess(hook, device_id, size, mem_size, mem_ptr, pmem_id):
                hook.current += mem_size
                hook.peak = max(hook.peak, hook.current)

            def free_postprocess(hook, device_id, mem_size, mem_ptr, pmem_id):
                hook.current -= mem_size

        self.hook = Hook()


@pytest.mark.exclusive
def test_forward_memory_is_out_plus_lse():
    """batch 1, 8 heads, seqlen 65536, head_dim 128, bf16: nothing beyond
    out + lse + 1 MiB is allocated (no seqlen x seqlen buffer). Exclusive:
    it reads the device's free memory, which other test processes move (a
    parallel gpu_check run saw 1.5 GB go while it ran)."""
    cupy = _cupy()
    shape = (1, 65536, 8, 128)
    rng = cupy.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape, dtype=cupy.float32).astype(_dtype("bfloat16")) for _ in range(3))
    cuflash.attention(q[:, :64], k[:, :64], v[:, :64])  # compile and load outside the measurement
    cupy.cuda.Device().synchronize()
    tracker = _PoolTracker()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    with tracker.hook:
        out, lse = cuflash.attention(q, k, v, return_lse=True)
        cupy.cuda.Device().synchronize()
    free_after = cupy.cuda.runtime.memGetInfo()[0]
    out_bytes = out.nbytes
    lse_bytes = lse.nbytes
    assert lse_bytes == 8 * 65536 * 4
    allowed = out_bytes + lse_bytes + 2**20
    assert tracker.hook.peak <= allowed, f"peak {tracker.hook.peak} > {allowed}"
    assert free_before - free_after <= allowed + 2**21  # pool rounding; nothing else grew
    assert not bool(cupy.isnan(out[0, -100:].astype(cupy.float32)).any())


@pytest.mark.parametrize("case", [c for c in BAD_FORWARD_CASES if not c.needs_two_gpus], ids=lambda c: c.id)
def test_bad_forward_input_is_rejected_before_launch(case, monkeypatch):
    monkeypatch.setattr(LaunchPlan, "launch", lambda *a, **k: pytest.fail("launched on bad input"))
    arrays = make_cupy_arrays(case)
    with pytest.raises(case.error, match=case.match):
        cuflash.attention(arrays["q"], arrays["k"], arrays["v"], out=arrays.get("out"), lse=arrays.get("lse"),
                          **case.options)


def test_generic_dlpack_producer_gives_cupy():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 40, 40, 2, 2, 64, cupy.float16, seed=3)

    class Producer:
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

    out = cuflash.attention(Producer(q), Producer(k), Producer(v), causal=True)
    assert isinstance(out, cupy.ndarray)
    ref, _ = attention_reference(q, k, v, causal=True)
    assert_output_accurate(out, ref, naive_attention_same_precision(q, k, v, causal=True, softmax_scale=0.125))


def test_kernel_runs_on_cupy_current_stream():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 500, 500, 4, 4, 64, cupy.float32, seed=9)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cuflash.attention(q, k, v)
        stream.synchronize()
    ref, _ = attention_reference(q, k, v)
    assert_output_accurate(out, ref)
