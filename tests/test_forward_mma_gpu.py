"""The tensor-core forwards: which inputs take them, and the numerical
hazards particular to them (stale softmax reference, masked first blocks,
padded columns). The general forward grid of test_forward_gpu.py runs
through them for float16/bfloat16 as well; these tests pin down the path
choice so that a silent fallback to the SIMT kernel cannot pass for the fast
path. On Hopper the defaults take the wgmma kernel at every head dim the
tensor cores serve; the ``generation`` parameter runs the hazard tests a second time
as an sm_80 device would (mma.sync kernel), so that kernel stays covered there."""

import math

import pytest

from cuflash import api
from cuflash._validation import check_forward, meta_of

from tests.helpers import pin_kernel_generation, random_qkv
from tests.test_forward_gpu import run_and_check

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


@pytest.fixture(params=["device", "sm80"])
def generation(request, monkeypatch):
    """"device": the kernels this GPU gets; "sm80": those an Ampere gets."""
    if request.param == "sm80":
        pin_kernel_generation(monkeypatch, 80)
    return request.param


def _chosen(q, k, v, out=None, *, softmax_scale=None):
    cupy = _cupy()
    out = cupy.empty_like(q) if out is None else out
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), meta_of("out", out), causal=False,
                            softmax_scale=softmax_scale)
    return api.forward_tiling_for(problem, (q, k, v, out))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 256])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_aligned_half_precision_takes_tensor_cores(dtype, head_dim, layout):
    q, k, v = random_qkv(_cupy(), 2, 33, 40, 4, 2, head_dim, _cupy().dtype(dtype), layout=layout)
    tiling = _chosen(q, k, v)
    assert tiling.kernel != "simt"
    assert tiling.head_dim_padded >= head_dim


def test_what_falls_back_to_simt():
    cupy = _cupy()
    bf16 = cupy.dtype("bfloat16")
    q, k, v = random_qkv(cupy, 2, 33, 40, 4, 2, 64, bf16)
    assert _chosen(*random_qkv(cupy, 2, 33, 40, 4, 2, 64, cupy.float32)).kernel == "simt"  # float32
    assert _chosen(*random_qkv(cupy, 2, 33, 40, 4, 2, 20, bf16)).kernel == "simt"  # head_dim % 8
    assert _chosen(*random_qkv(cupy, 2, 33, 40, 4, 2, 64, bf16, layout="sliced")).kernel == "simt"  # 8-byte offset
    assert _chosen(q, k, v, softmax_scale=-0.5).kernel == "simt"  # max of raw scores != max of scaled ones
    assert _chosen(q, k, v, softmax_scale=0.0).kernel == "simt"
    misaligned_out = cupy.empty(q.size + 4, dtype=bf16)[4:].reshape(q.shape)
    assert _chosen(q, k, v, misaligned_out).kernel == "simt"
    assert _chosen(q, k, v).kernel != "simt"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rising_scores_move_the_stale_reference(dtype, causal, generation):
    """Key blocks are visited last to first; keys whose scores grow towards
    the start of the sequence raise the row max by far more than the rescale
    slack (2^8) from block to block, so the reference moves and the output is
    rescaled many times, with large probabilities in between."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 300, 700, 2, 2, 64, cupy.dtype(dtype), seed=3)
    ramp = cupy.linspace(6.0, 0.2, k.shape[1], dtype=cupy.float32)[None, :, None, None]
    k = (k.astype(cupy.float32) * ramp).astype(k.dtype)
    assert _chosen(q, k, v).kernel != "simt"
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_scores_within_the_slack_never_rescale_and_stay_exact(dtype, head_dim, generation):
    """Scores that rise slowly (less than the slack per block) keep the
    first reference: p grows above 1 (up to 2^8) and the result must still
    match float64."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 129, 1000, 2, 1, head_dim, cupy.dtype(dtype), seed=5)
    ramp = cupy.linspace(1.6, 0.4, k.shape[1], dtype=cupy.float32)[None, :, None, None]
    k = (k.astype(cupy.float32) * ramp).astype(k.dtype)
    run_and_check(q, k, v, causal=False, softmax_scale=2.0 / math.sqrt(head_dim))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 17), (300, 129), (129, 1)])
def test_causal_rows_that_see_no_key_in_their_first_blocks(seqlen_q, seqlen_k, generation):
    """seqlen_q > seqlen_k, bottom-right causal: the first rows see no key
    (output 0, LSE -inf) and whole query blocks visit no key block."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 4, 128, cupy.dtype("bfloat16"))
    assert _chosen(q, k, v).kernel != "simt"
    out, lse = run_and_check(q, k, v, causal=True)
    hidden = seqlen_q - seqlen_k
    if hidden > 0:
        assert bool((out[:, :hidden] == 0).all())
        assert bool(cupy.isneginf(lse[:, :, :hidden]).all())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 1000), (1000, 17), (2049, 2049)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mma_kernel_where_hopper_takes_wgmma(dtype, head_dim, seqlen_q, seqlen_k, causal, monkeypatch):
    """The mma.sync kernel at the head dims Hopper serves with wgmma, as an
    Ampere GPU runs it."""
    pin_kernel_generation(monkeypatch, 80)
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, head_dim, cupy.dtype(dtype), seed=head_dim + seqlen_q)
    assert _chosen(q, k, v).kernel == "mma"
    run_and_check(q, k, v, causal=causal)
