"""Attention variants without a GPU: the sliding window's policy (its rule
against a direct reading of FlashAttention-2's definition, its block ranges,
its canonical forms), the soft cap and ALiBi in the float64 references
(against the formulas written out, and the gradient against finite
differences), the tiled emulation with them, validation, and what the
launcher sends the kernels."""

import dataclasses
import math

import numpy as np
import pytest

from cuflash import api
from cuflash._masks import MASKS, SCORE_TRANSFORMS, mask_for, score_for
from cuflash._validation import AttentionProblem, TensorMeta, check_variants, contiguous_strides
from tests.helpers import assert_reference_gradients_match_finite_differences, window_by_definition
from cuflash.reference import (attention_backward_reference, attention_backward_tiled, attention_reference,
                               attention_tiled)

#: (left, right) windows: bands, one-sided, causal-like, empty-right.
WINDOWS = [(0, 0), (3, 5), (64, 0), (100, -1), (-1, 7), (5, -1), (0, 40)]
LENGTHS = [(1, 1), (17, 127), (127, 17), (200, 200), (1, 1000)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
def test_window_rule_is_flash_attention_2s(window, seqlen_q, seqlen_k, causal):
    got = mask_for(causal, window).matrix(seqlen_q, seqlen_k)
    np.testing.assert_array_equal(got, window_by_definition(seqlen_q, seqlen_k, *window, causal=causal))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 127), (127, 17), (200, 333)])
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (64, 64), (128, 64)])
def test_window_block_ranges_are_exactly_the_blocks_with_visible_scores(window, seqlen_q, seqlen_k, block_m,
                                                                        block_n):
    """key_blocks and query_blocks are what the kernels skip by: too narrow
    loses keys, too wide costs time; a band's blocks are an interval, so
    both are exact."""
    mask = MASKS["window"].with_window(*window)
    visible = mask.matrix(seqlen_q, seqlen_k)
    for m_start in range(0, seqlen_q, block_m):
        rows = visible[m_start:m_start + block_m]
        want = [n for n in range(-(-seqlen_k // block_n)) if rows[:, n * block_n:(n + 1) * block_n].any()]
        assert list(mask.key_blocks(m_start, block_m, block_n, seqlen_q, seqlen_k)) == want
    for n_start in range(0, seqlen_k, block_n):
        keys = visible[:, n_start:n_start + block_n]
        want = [m for m in range(-(-seqlen_q // block_m)) if keys[m * block_m:(m + 1) * block_m].any()]
        assert list(mask.query_blocks(n_start, block_n, block_m, seqlen_q, seqlen_k)) == want


def _random(shape, rng, scale=1.0):
    return rng.standard_normal(shape) * scale


def _attention_by_formula(q, k, v, *, scale, window=None, causal=False, softcap=0.0, slopes=None):
    """The variants written out as their papers and FlashAttention-2 define
    them, on one (seqlen, heads, dim) batch entry per call: s = scale q.k;
    capped to softcap tanh(s / softcap); ALiBi adds -slope |i + off - j|;
    the window / causal mask; softmax; P V."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    group = nheads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(nheads):
            s = scale * q[b, :, h] @ k[b, :, h // group].T
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                slope = slopes[h] if slopes.ndim == 1 else slopes[b, h]
                i = np.arange(seqlen_q)[:, None]
                j = np.arange(seqlen_k)[None, :]
                s = s - slope * np.abs(i + seqlen_k - seqlen_q - j)
            left, right = window or (-1, -1)
            visible = window_by_definition(seqlen_q, seqlen_k, left, right, causal=causal)
            s = np.where(visible, s, -np.inf)
            for i in range(seqlen_q):
                if visible[i].any():
                    p = np.exp(s[i] - s[i].max())
                    out[b, i, h] = p @ v[b, :, h // group] / p.sum()
    return out


CASES = {
    "window": dict(window_size=(6, 3)),
    "window-causal": dict(window_size=(6, -1), causal=True),
    "softcap": dict(softcap=1.5),
    "alibi-per-head": dict(alibi_slopes="head"),
    "everything": dict(window_size=(9, 2), softcap=2.0, alibi_slopes="batch"),
}


def _case(name, rng, batch, nheads):
    options = dict(CASES[name])
    if options.get("alibi_slopes") == "head":
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, nheads)
    elif options.get("alibi_slopes") == "batch":
        options["alibi_slopes"] = rng.uniform(0.05, 0.5, (batch, nheads))
    return options


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 30), (17, 29), (29, 17)])
def test_reference_variants_are_the_formulas(name, seqlen_q, seqlen_k):
    rng = np.random.default_rng(3)
    q, k, v = _random((2, seqlen_q, 4, 8), rng, 2), _random((2, seqlen_k, 2, 8), rng, 2), _random((2, seqlen_k, 2, 8), rng)
    options = _case(name, rng, 2, 4)
    out, _ = attention_reference(q, k, v, softmax_scale=0.4, **options)
    want = _attention_by_formula(q, k, v, scale=0.4, window=options.get("window_size"),
                                 causal=options.get("causal", False), softcap=options.get("softcap", 0.0),
                                 slopes=options.get("alibi_slopes"))
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # each variant changes the answer
    np.testing.assert_raises(AssertionError, np.testing.assert_allclose,
                             attention_reference(q, k, v, softmax_scale=0.4)[0], out, atol=1e-6)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seqlen_q,seqlen_k,dtype_name", [(150, 260, "float16"), (260, 150, "bfloat16"),
                                                          (77, 200, "float32")])
def test_tiled_emulation_with_variants_matches_the_reference(name, seqlen_q, seqlen_k, dtype_name):
    rng = np.random.default_rng(4)
    q, k, v = (_random((1, n, 4, 16), rng, 2) for n in (seqlen_q, seqlen_k, seqlen_k))
    k, v = k[:, :, :2], v[:, :, :2]
    dout = _random((1, seqlen_q, 4, 16), rng)
    options = _case(name, rng, 1, 4)
    if "window_size" in options:  # windows wide enough to span several blocks
        options["window_size"] = tuple(w if w < 0 else 7 * w for w in options["window_size"])
    out, lse, visited = attention_tiled(q, k, v, dtype_name=dtype_name, **options)
    want_out, want_lse = attention_reference(q, k, v, **options)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-10)
    for deterministic in (False, True):
        *grads, _ = attention_backward_tiled(dout, q, k, v, dtype_name=dtype_name, deterministic=deterministic,
                                             **options)
        for got, want in zip(grads, attention_backward_reference(dout, q, k, v, **options)):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    if "window_size" in options:  # the window skips blocks: fewer than causal or full attention visit
        _, _, full = attention_tiled(q, k, v, dtype_name=dtype_name, causal=options.get("causal", False))
        assert visited < full


def test_reference_gradient_through_every_variant_matches_finite_differences():
    rng = np.random.default_rng(5)
    q, k, v, dout = (_random((1, n, 2, 4), rng, 2) for n in (5, 7, 7, 5))
    assert_reference_gradients_match_finite_differences(dout, q, k, v, window_size=(3, 1), softcap=1.5,
                                                        alibi_slopes=np.array([0.3, 0.7]), softmax_scale=0.5)


# --- validation and what the launcher sends ---------------------------------------------------


def _problem(seqlen_q=100, seqlen_k=200, causal=False, scale=0.125, batch=2, nheads=4, **fields):
    return AttentionProblem(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=2,
                            head_dim=64, dtype="bfloat16", device=0, softmax_scale=scale, causal=causal, **fields)


@pytest.mark.parametrize("causal,window,want_causal,want_window", [
    (False, (-1, -1), False, None),
    (True, (-1, -1), True, None),
    (False, (-1, 0), True, None),  # the causal window is the causal mask
    (True, (-1, 50), True, None),  # causal makes the right side 0
    (False, (199, 99), False, None),  # both sides reach every key: full attention
    (False, (500, 0), True, None),
    (True, (30, 7), False, (30, 0)),
    (False, (30, 7), False, (30, 7)),
    (False, (-1, 5), False, (-1, 5)),
    (False, (10, 1000), False, (10, -1)),
])
def test_windows_take_their_leanest_form(causal, window, want_causal, want_window):
    problem = check_variants(_problem(causal=causal), window_size=window)
    assert (problem.causal, problem.window) == (want_causal, want_window)
    assert problem.mask.name == ("window" if want_window else "causal" if want_causal else "none")


def _slopes(shape, dtype="float32", strides=None, device=0):
    return TensorMeta("alibi_slopes", shape, strides or contiguous_strides(shape), dtype, device)


@pytest.mark.parametrize("options,error,match", [
    (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a pair \(left, right\)"),
    (dict(window_size="ab"), TypeError, "window_size must be a pair"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size's left side must be an int, got float"),
    (dict(window_size=(3, -2)), ValueError, "window_size's right side must be -1 .* got -2"),
    (dict(window_size=(True, 2)), TypeError, "window_size's left side must be an int, got bool"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=math.inf), ValueError, "softcap must be finite"),
    (dict(softcap="3"), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=_slopes((4,), "float16")), TypeError, "alibi_slopes must have dtype float32, got float16"),
    (dict(alibi_slopes=_slopes((3,))), ValueError, r"alibi_slopes must have shape \(nheads,\) = \(4,\) or "
                                                   r"\(batch, nheads\) = \(2, 4\), got \(3,\)"),
    (dict(alibi_slopes=_slopes((2, 4), strides=(1, 2))), ValueError, "alibi_slopes must be C-contiguous"),
    (dict(alibi_slopes=_slopes((4,), device=1)), ValueError, "alibi_slopes is on GPU 1 but q is on GPU 0"),
])
def test_bad_variants_get_clear_errors(options, error, match):
    with pytest.raises(error, match=match):
        check_variants(_problem(), **options)


def test_softcap_and_alibi_need_a_nonzero_scale():
    for options in (dict(softcap=5.0), dict(alibi_slopes=_slopes((4,)))):
        with pytest.raises(ValueError, match="need a softmax_scale other than 0"):
            check_variants(_problem(scale=0.0), **options)


def test_scores_follow_softcap_and_slopes():
    base = _problem()
    assert check_variants(base).score.name == "identity"
    assert check_variants(base, softcap=0.0).score.name == "identity"
    assert check_variants(base, softcap=30.0).score.name == "softcap"
    assert check_variants(base, alibi_slopes=_slopes((4,))).alibi_batch_stride == 0
    both = check_variants(base, softcap=30.0, alibi_slopes=_slopes((2, 4)))
    assert (both.score.name, both.alibi_batch_stride) == ("softcap-alibi", 4)
    assert score_for(True, True) is SCORE_TRANSFORMS["softcap-alibi"]


def test_variant_fields_are_what_the_kernels_read():
    """VariantParams: a window's unbounded side reaches past every key; the
    cap (and its inverse) and ALiBi's scale in raw-score units; every real
    value rounded once to the struct's float32 (params.cuh)."""
    from cuflash._params import VARIANT_PARAMS

    def fields(problem):
        values = api._variant_fields(problem)
        assert len(values) == len(VARIANT_PARAMS.names)
        return {name: value for name, value in zip(VARIANT_PARAMS.names, values) if value}

    problem = check_variants(_problem(scale=0.125), window_size=(-1, 5), softcap=30.0,
                             alibi_slopes=_slopes((2, 4)))
    assert fields(problem) == dict(window_left=200, window_right=5, softcap=240.0, inverse_softcap=1 / 240.0,
                                   alibi_batch_stride=4, inverse_scale=8.0, scale=0.125)
    problem = check_variants(_problem(), window_size=(7, -1))
    assert api._variant_fields(problem)[:2] == (7, 100)
    assert fields(_problem()) == dict(inverse_scale=8.0, scale=0.125)
    # Dropout: the 16-bit threshold and 1 / keep of the rounded p; the seed
    # and offset (0 here) are plan slots written by each call.
    assert fields(check_variants(_problem(), dropout_p=0.25)) == dict(
        inverse_scale=8.0, scale=0.125, dropout_threshold=16384, dropout_inverse_keep=65536 / 49152)


def test_cxx_types_take_the_precise_tanh_for_float32_only():
    softcap = SCORE_TRANSFORMS["softcap-alibi"]
    assert softcap.cxx_for("float32") == "cuflash::WithAlibi<cuflash::SoftcapScore<true>>"
    assert softcap.cxx_for("bfloat16") == "cuflash::WithAlibi<cuflash::SoftcapScore<false>>"
    assert SCORE_TRANSFORMS["identity"].cxx_for("float32") == "cuflash::IdentityScore"


def test_decoding_folds_heads_only_for_position_free_variants():
    """Grouped-query decoding runs a K/V head's query heads as rows of one
    head: right for a soft cap, wrong for a per-head slope or a window
    (rows would be positions)."""
    layouts = {name: api.Layout.contiguous(shape, "bfloat16")
               for name, shape in (("q", (2, 1, 8, 64)), ("out", (2, 1, 8, 64)), ("k", (2, 300, 2, 64)),
                                   ("v", (2, 300, 2, 64)))}
    base = dataclasses.replace(_problem(seqlen_q=1, seqlen_k=300, nheads=8), nheads_k=2)
    assert api.decode_shape(check_variants(base, softcap=30.0), layouts).packed
    assert api.decode_shape(check_variants(base), layouts).packed
    assert not api.decode_shape(check_variants(base, alibi_slopes=_slopes((8,))), layouts).packed
    assert not api.decode_shape(check_variants(base, window_size=(50, 0)), layouts).packed
