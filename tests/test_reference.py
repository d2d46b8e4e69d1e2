"""The float64 reference and the NumPy emulation of the tiled forward kernel
(CPU: checks the tiled algorithm itself, with no GPU)."""

import math

import numpy as np
import pytest

from cuflash._masks import MASKS
from cuflash._tiling import forward_tiling, mma_forward_tiling
from cuflash.reference import (
    attention_backward_reference,
    attention_backward_tiled,
    attention_reference,
    attention_tiled,
    causal_mask,
)
from tests.validation_cases import BAD_FORWARD_CASES


def _random(shape, rng):
    return rng.standard_normal(shape)


def _assert_lse_equal(lse, ref):
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(lse[finite], ref[finite], rtol=1e-12, atol=1e-12)


def test_reference_matches_explicit_softmax():
    rng = np.random.default_rng(1)
    q, k, v = (_random((1, 5, 1, 3), rng) for _ in range(3))
    scores = q[0, :, 0] @ k[0, :, 0].T * 0.7
    probs = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    out, lse = attention_reference(q, k, v, softmax_scale=0.7)
    np.testing.assert_allclose(out[0, :, 0], probs @ v[0, :, 0], rtol=1e-12)
    np.testing.assert_allclose(lse[0, 0], np.log(np.exp(scores).sum(axis=1)), rtol=1e-12)


def test_reference_default_scale_is_inverse_sqrt_head_dim():
    rng = np.random.default_rng(2)
    q, k, v = (_random((1, 4, 2, 9), rng) for _ in range(3))
    a, _ = attention_reference(q, k, v)
    b, _ = attention_reference(q, k, v, softmax_scale=1 / 3)
    np.testing.assert_allclose(a, b, rtol=1e-13)


def test_causal_mask_is_bottom_right_aligned():
    mask = causal_mask(2, 4)
    # query 0 sees keys 0..2, query 1 sees all four
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    mask = causal_mask(4, 2)
    # the first two queries see nothing
    assert mask.tolist() == [[False, False], [False, False], [True, False], [True, True]]


def test_reference_rows_seeing_no_key_are_zero_with_lse_minus_inf():
    rng = np.random.default_rng(3)
    q = _random((2, 6, 2, 8), rng)
    k, v = (_random((2, 3, 2, 8), rng) for _ in range(2))
    out, lse = attention_reference(q, k, v, causal=True)
    assert np.all(out[:, :3] == 0)
    assert np.all(np.isneginf(lse[:, :, :3]))
    assert np.isfinite(lse[:, :, 3:]).all()


def test_reference_grouped_query_attention_uses_shared_heads():
    rng = np.random.default_rng(4)
    q = _random((1, 7, 4, 8), rng)
    k, v = (_random((1, 9, 2, 8), rng) for _ in range(2))
    out, _ = attention_reference(q, k, v)
    for head in range(4):
        single, _ = attention_reference(q[:, :, head : head + 1], k[:, :, head // 2 : head // 2 + 1],
                                        v[:, :, head // 2 : head // 2 + 1])
        np.testing.assert_allclose(out[:, :, head], single[:, :, 0], rtol=1e-13)


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
@pytest.mark.parametrize("head_dim", [1, 16, 59, 64, 96, 130, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (127, 300), (300, 127), (1000, 17), (65, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_emulation_matches_reference(dtype_name, head_dim, seqlen_q, seqlen_k, causal):
    rng = np.random.default_rng(seqlen_q * 1000 + seqlen_k + head_dim)
    nheads, nheads_k = 4, 2
    q = _random((2, seqlen_q, nheads, head_dim), rng)
    k, v = (_random((2, seqlen_k, nheads_k, head_dim), rng) for _ in range(2))
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.3)
    out, lse, _ = attention_tiled(q, k, v, causal=causal, softmax_scale=0.3, dtype_name=dtype_name)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    _assert_lse_equal(lse, ref_lse)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("ramp", [(6.0, 0.2), (1.6, 0.4), (0.2, 6.0)], ids=["steep-rise", "within-slack", "falling"])
def test_tensor_core_schedule_with_stale_reference_matches_reference(causal, ramp):
    """The tensor-core kernel's schedule (key blocks last to first, softmax
    reference moving only beyond the slack), emulated in float64, is exact
    whether scores rise steeply from block to block (the reference moves many
    times), slowly (never moves after the first block: p grows to 2^8) or fall."""
    rng = np.random.default_rng(11)
    q = _random((1, 300, 2, 64), rng)
    k, v = (_random((1, 700, 2, 64), rng) for _ in range(2))
    k = k * np.linspace(*ramp, 700)[None, :, None, None]
    tiling = mma_forward_tiling("bfloat16", 64)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.5)
    out, lse, _ = attention_tiled(q, k, v, causal=causal, softmax_scale=0.5, tiling=tiling)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    _assert_lse_equal(lse, ref_lse)


def test_tiled_emulation_skips_fully_masked_key_blocks():
    rng = np.random.default_rng(5)
    tiling = forward_tiling("float16", 64)  # 64 x 64 tiles
    assert (tiling.block_m, tiling.block_n) == (64, 64)
    q, k, v = (_random((1, 256, 1, 64), rng) for _ in range(3))
    _, _, visited_full = attention_tiled(q, k, v, causal=False, tiling=tiling)
    _, _, visited_causal = attention_tiled(q, k, v, causal=True, tiling=tiling)
    assert visited_full == 4 * 4
    assert visited_causal == 1 + 2 + 3 + 4  # only blocks on or below the diagonal


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 1000), (1000, 17), (130, 70), (64, 64), (0, 5)])
def test_causal_key_blocks_match_brute_force(seqlen_q, seqlen_k):
    block_m, block_n = 64, 32
    mask = causal_mask(seqlen_q, seqlen_k)
    for m_start in range(0, seqlen_q, block_m):
        rows = mask[m_start : m_start + block_m]
        visible_cols = np.nonzero(rows.any(axis=0))[0]
        expected = 0 if len(visible_cols) == 0 else math.ceil((visible_cols.max() + 1) / block_n)
        assert len(MASKS["causal"].key_blocks(m_start, block_m, block_n, seqlen_q, seqlen_k)) == expected
        assert MASKS["none"].key_blocks(m_start, block_m, block_n, seqlen_q, seqlen_k) == range(math.ceil(seqlen_k / block_n))


# --- Bad input: the errors of cuflash.attention, not IndexError or ZeroDivisionError ---

#: Every reference function, called on (q, k, v) and, for the backward ones, a dout shaped like q.
REFERENCE_FUNCTIONS = {
    "attention_reference": lambda q, k, v, **kw: attention_reference(q, k, v, **kw),
    "attention_tiled": lambda q, k, v, **kw: attention_tiled(q, k, v, **kw),
    "attention_backward_reference": lambda q, k, v, **kw: attention_backward_reference(np.zeros(q.shape), q, k, v,
                                                                                        **kw),
    "attention_backward_tiled": lambda q, k, v, **kw: attention_backward_tiled(np.zeros(q.shape), q, k, v, **kw),
}
#: The cases of the forward API that are about shapes alone, which the references share.
SHAPE_CASES = [case for case in BAD_FORWARD_CASES
               if case.id in ("rank-3", "rank-5", "batch-mismatch", "head-dim-mismatch", "nheads-not-divisible",
                              "kv-length-mismatch")]


@pytest.mark.parametrize("function", REFERENCE_FUNCTIONS)
@pytest.mark.parametrize("case", SHAPE_CASES, ids=lambda case: case.id)
def test_references_reject_bad_shapes_as_attention_does(function, case):
    arrays = {name: np.zeros(spec["shape"]) for name, spec in case.arrays().items()}
    with pytest.raises(case.error, match=case.match):
        REFERENCE_FUNCTIONS[function](arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("function", REFERENCE_FUNCTIONS)
def test_references_reject_head_dim_zero(function):
    x = np.zeros((1, 4, 2, 0))
    with pytest.raises(ValueError, match=r"q's head_dim \(last dimension\) must be (at least 1|between 1 and 256), "
                                         r"got 0"):
        REFERENCE_FUNCTIONS[function](x, x, x)


@pytest.mark.parametrize("function", ["attention_tiled", "attention_backward_tiled"])
def test_tiled_emulations_reject_head_dims_the_kernels_do_not_take(function):
    x = np.zeros((1, 4, 1, 257))
    with pytest.raises(ValueError, match=r"q's head_dim \(last dimension\) must be between 1 and 256, got 257"):
        REFERENCE_FUNCTIONS[function](x, x, x)


def test_naive_reference_takes_any_head_dim():
    x = np.ones((1, 2, 1, 300))
    out, _ = attention_reference(x, x, x)
    np.testing.assert_allclose(out, x)


@pytest.mark.parametrize("function", REFERENCE_FUNCTIONS)
@pytest.mark.parametrize("options,error,match", [
    ({"causal": "yes"}, TypeError, "causal must be a bool, got str 'yes'"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite, got nan"),
    ({"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a real number or None, got str"),
], ids=["causal-str", "scale-nan", "scale-str"])
def test_references_reject_bad_options(function, options, error, match):
    x = np.zeros((1, 4, 2, 8))
    with pytest.raises(error, match=match):
        REFERENCE_FUNCTIONS[function](x, x, x, **options)


@pytest.mark.parametrize("backward", [attention_backward_reference, attention_backward_tiled])
def test_backward_references_reject_dout_unlike_q(backward):
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"dout must have the shape of q \(1, 4, 2, 8\) .* got \(1, 4, 2, 7\)"):
        backward(np.zeros((1, 4, 2, 7)), q, q, q)
    with pytest.raises(ValueError, match=r"dout must have 4 dimensions .* got shape \(4, 2, 8\)"):
        backward(np.zeros((4, 2, 8)), q, q, q)
