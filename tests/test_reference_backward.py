"""The float64 backward reference against finite differences, and the NumPy
emulation of the tiled backward against the reference (CPU)."""

import math

import numpy as np
import pytest

from cuflash._masks import MASKS
from cuflash._tiling import backward_tiling
from cuflash.reference import (
    attention_backward_reference,
    attention_backward_tiled,
    attention_reference,
    causal_mask,
)


def _random(shape, rng):
    return rng.standard_normal(shape)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,nheads,nheads_k", [(5, 7, 2, 1), (7, 4, 2, 2), (1, 1, 1, 1), (6, 6, 4, 2)])
def test_backward_reference_matches_finite_differences(causal, seqlen_q, seqlen_k, nheads, nheads_k):
    rng = np.random.default_rng(seqlen_q * 10 + seqlen_k)
    head_dim = 3
    q = _random((2, seqlen_q, nheads, head_dim), rng)
    k = _random((2, seqlen_k, nheads_k, head_dim), rng)
    v = _random((2, seqlen_k, nheads_k, head_dim), rng)
    dout = _random(q.shape, rng)
    scale = 0.8
    grads = attention_backward_reference(dout, q, k, v, causal=causal, softmax_scale=scale)

    def loss(q_, k_, v_):
        out, _ = attention_reference(q_, k_, v_, causal=causal, softmax_scale=scale)
        return float((out * dout).sum())

    eps = 1e-6
    for index, (name, x) in enumerate((("q", q), ("k", k), ("v", v))):
        numeric = np.zeros_like(x)
        for position in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[index][position] += eps
            plus = loss(*args)
            args[index][position] -= 2 * eps
            minus = loss(*args)
            numeric[position] = (plus - minus) / (2 * eps)
        np.testing.assert_allclose(grads[index], numeric, rtol=1e-6, atol=1e-8, err_msg=f"d{name}")


def test_backward_reference_rows_seeing_no_key_have_zero_gradient():
    rng = np.random.default_rng(7)
    q = _random((1, 6, 2, 8), rng)
    k, v = (_random((1, 3, 2, 8), rng) for _ in range(2))
    dout = _random(q.shape, rng)
    dq, dk, dv = attention_backward_reference(dout, q, k, v, causal=True)
    assert np.all(dq[:, :3] == 0)
    assert np.isfinite(dk).all() and np.isfinite(dv).all()


@pytest.mark.parametrize("dtype_name", ["float16", "float32"])
@pytest.mark.parametrize("head_dim", [1, 40, 64, 100, 200])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (127, 300), (300, 127), (70, 0), (0, 50)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_tiled_backward_matches_reference(dtype_name, head_dim, seqlen_q, seqlen_k, causal, deterministic):
    rng = np.random.default_rng(seqlen_q * 1000 + seqlen_k + head_dim)
    q = _random((2, seqlen_q, 4, head_dim), rng)
    k, v = (_random((2, seqlen_k, 2, head_dim), rng) for _ in range(2))
    dout = _random(q.shape, rng)
    expected = attention_backward_reference(dout, q, k, v, causal=causal, softmax_scale=0.3)
    dq, dk, dv, _ = attention_backward_tiled(dout, q, k, v, causal=causal, softmax_scale=0.3,
                                             dtype_name=dtype_name, deterministic=deterministic)
    for got, want, name in zip((dq, dk, dv), expected, ("dq", "dk", "dv")):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11, err_msg=name)


def test_tiled_backward_skips_query_blocks_that_see_no_key_of_the_block():
    rng = np.random.default_rng(8)
    tiling = backward_tiling("float16", 64)
    assert (tiling.block_m, tiling.block_n) == (32, 128)
    q, k, v = (_random((1, 256, 1, 64), rng) for _ in range(3))
    _, _, _, full = attention_backward_tiled(q, q, k, v, causal=False)
    _, _, _, causal = attention_backward_tiled(q, q, k, v, causal=True)
    assert full == 2 * 8  # two key blocks, eight query blocks each
    assert causal == 8 + 4  # the second key block is seen from query row 128 on


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 1000), (1000, 17), (130, 70), (64, 64), (5, 0)])
def test_causal_query_blocks_match_brute_force(seqlen_q, seqlen_k):
    block_m, block_n = 32, 64
    mask = causal_mask(seqlen_q, seqlen_k)
    for n_start in range(0, seqlen_k, block_n):
        cols = mask[:, n_start : n_start + block_n]
        rows = np.nonzero(cols.any(axis=1))[0]
        expected = rows.min() // block_m if len(rows) else None
        got = MASKS["causal"].query_blocks(n_start, block_n, block_m, seqlen_q, seqlen_k)
        if expected is None:
            assert not got  # nothing to visit
        else:
            assert got.start == expected and got.stop == math.ceil(seqlen_q / block_m)
        assert MASKS["none"].query_blocks(n_start, block_n, block_m, seqlen_q, seqlen_k) == range(math.ceil(seqlen_q / block_m))
