"""float32 inputs on tensor cores by 3xTF32 (``fp32_precision="3xtf32"``):
opt-in, on the mma.sync forward (sm_80+, Hopper included), held to the
float32 accuracy rule against float64 (relative L2 error <= 1e-5)."""

import math

import pytest

import cuflash
from cuflash import api
from cuflash._validation import check_forward, meta_of

from tests.helpers import random_qkv
from tests.test_forward_gpu import run_and_check

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


def _chosen(q, k, v, out=None, *, fp32_precision, softmax_scale=None):
    cupy = _cupy()
    out = cupy.empty_like(q) if out is None else out
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), meta_of("out", out), causal=False,
                            softmax_scale=softmax_scale, fp32_precision=fp32_precision)
    return api.forward_tiling_for(problem, (q, k, v, out))


@pytest.mark.parametrize("head_dim,bucket", [(8, 32), (40, 64), (64, 64), (80, 96), (128, 128), (160, 192),
                                             (256, 256)])
def test_3xtf32_is_opt_in(head_dim, bucket):
    q, k, v = random_qkv(_cupy(), 2, 33, 40, 4, 2, head_dim, _cupy().float32, layout="bhsd")
    assert _chosen(q, k, v, fp32_precision="ieee").kernel == "simt"
    tiling = _chosen(q, k, v, fp32_precision="3xtf32")
    assert (tiling.kernel, tiling.head_dim_padded) == ("mma", bucket)


def test_3xtf32_falls_back_to_the_exact_path_where_it_cannot_run():
    cupy = _cupy()
    assert _chosen(*random_qkv(cupy, 2, 33, 40, 4, 2, 20, cupy.float32), fp32_precision="3xtf32").kernel == "simt"
    q, k, v = random_qkv(cupy, 2, 33, 40, 4, 2, 64, cupy.float32)
    misaligned_out = cupy.empty(q.size + 1, dtype=cupy.float32)[1:].reshape(q.shape)  # 4-byte offset
    assert _chosen(q, k, v, misaligned_out, fp32_precision="3xtf32").kernel == "simt"
    assert _chosen(q, k, v, softmax_scale=-0.5, fp32_precision="3xtf32").kernel == "simt"
    # 16-bit inputs ignore it
    bf16 = random_qkv(cupy, 2, 33, 40, 4, 2, 64, cupy.dtype("bfloat16"))
    assert _chosen(*bf16, fp32_precision="3xtf32") == _chosen(*bf16, fp32_precision="ieee")


@pytest.mark.parametrize("head_dim", [8, 32, 64, 80, 128, 160, 192, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 1000), (127, 129), (1000, 17), (1000, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_3xtf32_forward_matches_float64(head_dim, seqlen_q, seqlen_k, causal):
    """Partial blocks, both orders of the lengths (causal rows that see no
    key), padded head dims and query heads sharing a K/V head."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, head_dim, cupy.float32, seed=head_dim + seqlen_k)
    assert _chosen(q, k, v, fp32_precision="3xtf32").kernel == "mma"
    run_and_check(q, k, v, causal=causal, fp32_precision="3xtf32")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_3xtf32_keeps_float32_accuracy_where_one_tf32_pass_would_not(head_dim):
    """Large scores (scale 4 / sqrt(d)): tf32's 10-bit mantissa alone would
    miss the float32 bound by far; the split's three products meet it, and
    the plan cache keeps the two precisions apart."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 500, 700, 2, 2, head_dim, cupy.float32, seed=11)
    scale = 4.0 / math.sqrt(head_dim)
    run_and_check(q, k, v, causal=False, softmax_scale=scale, fp32_precision="3xtf32")
    exact = cuflash.attention(q, k, v, softmax_scale=scale)
    fast = cuflash.attention(q, k, v, softmax_scale=scale, fp32_precision="3xtf32")
    assert not bool((exact == fast).all())  # two kernels ran, not one cached plan
    one_pass = _one_tf32_pass_error(q, k, v, scale)
    error = float(cupy.linalg.norm(fast - exact) / cupy.linalg.norm(exact))
    assert error < one_pass / 20, (error, one_pass)


def _one_tf32_pass_error(q, k, v, scale):
    """Relative L2 error of attention with its inputs rounded to tf32 once
    (what a single tf32 product per matmul would see), against float32."""
    cupy = _cupy()

    def tf32(x):
        bits = x.view(cupy.uint32)
        return ((bits + 0x1000) & 0xFFFFE000).view(cupy.float32)  # round to 10 mantissa bits

    def attend(round_inputs):
        q64, k64, v64 = (round_inputs(x).astype(cupy.float64) for x in (q, k, v))
        s = cupy.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
        p = cupy.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        p = round_inputs(p.astype(cupy.float32)).astype(cupy.float64)
        return cupy.einsum("bhqk,bkhd->bqhd", p, v64)

    exact = attend(lambda x: x)
    rounded = attend(tf32)
    return float(cupy.linalg.norm(rounded - exact) / cupy.linalg.norm(exact))
