"""Dropout without a GPU: Philox4x32-10 against its published test vectors,
the kernels' own C++ (philox.cuh, dropout.cuh, compiled for the host) against
cuflash.dropout's NumPy mask element by element (including the fragment walk
each tensor-core lane does), the mask's statistics, the float64 references
with dropout (forward by hand, backward against finite differences), the
validation of dropout_p / seed / offset, and what the launcher instantiates."""

import subprocess

import numpy as np
import pytest

from cuflash import api
from cuflash._loader import kernel_source_dir
from cuflash._masks import SCORE_TRANSFORMS, score_for
from cuflash._validation import AttentionProblem, check_dropout_p, check_dropout_seed, check_variants
from cuflash.dropout import dropout_keep_probability, dropout_mask, dropout_threshold, philox4x32_10
from cuflash.reference import attention_reference
from tests.helpers import assert_reference_gradients_match_finite_differences, needs_nvcc


def test_philox_matches_the_published_test_vectors():
    """Random123's known-answer tests for philox4x32_10."""
    assert philox4x32_10([0, 0, 0, 0], 0, 0).tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([0xFFFFFFFF] * 4, 0xFFFFFFFF, 0xFFFFFFFF).tolist() == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def _host_program(tmp_path, body: str) -> list[str]:
    source = tmp_path / "dropout_probe.cu"
    source.write_text('#include <cstdio>\n#include "dropout.cuh"\nusing namespace cuflash;\n'
                      f"int main() {{\n{body}\nreturn 0;\n}}\n")
    binary = tmp_path / "dropout_probe"
    subprocess.run(["nvcc", "-std=c++17", f"-I{kernel_source_dir()}", str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()


def _variant_struct(seed, offset, p):
    return (f"VariantParams v{{}}; v.dropout_seed = {seed}ull; v.dropout_offset = {offset}ull; "
            f"v.dropout_threshold = {dropout_threshold(p)}; v.dropout_inverse_keep = {1 / dropout_keep_probability(p)};")


@needs_nvcc
def test_the_kernels_mask_is_cuflash_dropout_mask(tmp_path):
    """DropoutMask::factor (what every kernel asks, per element) equals
    dropout_mask at every (batch, head, row, key) of an awkward-sized
    problem, for a seed and offset wider than 32 bits."""
    batch, nheads, seqlen_q, seqlen_k, p = 2, 3, 17, 75, 0.3
    seed, offset = 0x1234_5678_9ABC_DEF0, (7 << 32) + 11
    body = (_variant_struct(seed, offset, p) +
            f"for (int b = 0; b < {batch}; ++b) for (int h = 0; h < {nheads}; ++h) {{ DropoutMask m(v, b, h); "
            f"for (int i = 0; i < {seqlen_q}; ++i) for (int j = 0; j < {seqlen_k}; ++j) "
            'printf("%d ", m.factor(i, j) > 0.0f); }')
    got = np.array(_host_program(tmp_path, body), dtype=int).reshape(batch, nheads, seqlen_q, seqlen_k)
    np.testing.assert_array_equal(got.astype(bool), dropout_mask(batch, nheads, seqlen_q, seqlen_k, p, seed, offset))


@needs_nvcc
@pytest.mark.parametrize("n_tiles,key0", [(8, 64), (2, 40), (10, 16)])
def test_each_lanes_fragment_walk_drops_its_own_elements(tmp_path, n_tiles, key0):
    """drop_fragments as 32 lanes of a warp run it on an mma accumulator of
    ones (rows 16 mt + lane / 4 (+ 8), keys 8 nt + 2 (lane % 4) (+ 1)): the
    tile it leaves is the mask's, scaled by 1 / keep: whole groups of four
    n8 tiles (one Philox call per row) and the per-tile fallback alike."""
    p, seed, offset, row0 = 0.4, 99, 3, 5
    body = (_variant_struct(seed, offset, p) + "DropoutMask m(v, 1, 2);\n"
            f"for (int lane = 0; lane < 32; ++lane) {{ float s[2][{n_tiles}][4];"
            f" for (int a = 0; a < 2; ++a) for (int b = 0; b < {n_tiles}; ++b) for (int e = 0; e < 4; ++e) s[a][b][e] = 1.0f;"
            f" drop_fragments(m, s, {row0}, {key0}, lane);"
            f" for (int mt = 0; mt < 2; ++mt) for (int nt = 0; nt < {n_tiles}; ++nt) for (int e = 0; e < 4; ++e)"
            f' printf("%d %d %.9g ", {row0} + mt * 16 + lane / 4 + (e / 2) * 8, {key0} + nt * 8 + 2 * (lane % 4) + e % 2,'
            " s[mt][nt][e]); }")
    values = np.array(_host_program(tmp_path, body), dtype=float).reshape(-1, 3)
    mask = dropout_mask(2, 3, row0 + 32, key0 + 8 * n_tiles, p, seed, offset)[1, 2]
    rows, keys = values[:, 0].astype(int), values[:, 1].astype(int)
    assert len(set(zip(rows, keys))) == 32 * 8 * n_tiles  # every element once
    expected = np.where(mask[rows, keys], 1 / dropout_keep_probability(p), 0.0)
    np.testing.assert_allclose(values[:, 2], expected, rtol=1e-6)


@needs_nvcc
def test_the_backwards_key_pair_factors_are_the_mask(tmp_path):
    """key_pair_factors (the transposed fragments of the tensor-core
    backwards: keys key and key + 8 of a 16-aligned tile, one query row)."""
    p, seed = 0.25, 5
    body = (_variant_struct(seed, 0, p) + "DropoutMask m(v, 0, 1);\n"
            "for (int row = 0; row < 9; ++row) for (int tile = 0; tile < 4; ++tile) for (int k = 0; k < 8; ++k) {"
            " KeyPairFactors f = key_pair_factors(m, row, 16 * tile + k);"
            ' printf("%d %d %d %d ", row, 16 * tile + k, f.first > 0, f.second > 0); }')
    values = np.array(_host_program(tmp_path, body), dtype=int).reshape(-1, 4)
    mask = dropout_mask(1, 2, 9, 64, p, seed)[0, 1]
    np.testing.assert_array_equal(values[:, 2], mask[values[:, 0], values[:, 1]])
    np.testing.assert_array_equal(values[:, 3], mask[values[:, 0], values[:, 1] + 8])


def test_the_mask_keeps_one_minus_p_and_depends_on_every_coordinate():
    mask = dropout_mask(4, 4, 64, 256, 0.3, seed=1)
    assert abs(mask.mean() - 0.7) < 0.01
    # Every batch entry, head, row and key block draws its own bits.
    assert not (mask[0] == mask[1]).all() and not (mask[:, 0] == mask[:, 1]).all()
    assert not (mask[:, :, 0] == mask[:, :, 1]).all()
    assert not (mask[..., :32] == mask[..., 32:64]).all()
    # The seed and the offset (past 32 bits too) choose the mask; the same ones give it again.
    assert not (mask == dropout_mask(4, 4, 64, 256, 0.3, seed=2)).all()
    assert not (mask == dropout_mask(4, 4, 64, 256, 0.3, seed=1, offset=1 << 32)).all()
    np.testing.assert_array_equal(mask, dropout_mask(4, 4, 64, 256, 0.3, seed=1))
    # A smaller problem's mask is the corner of a larger one's (lengths never enter the draw).
    np.testing.assert_array_equal(mask[:2, :3, :17, :100], dropout_mask(2, 3, 17, 100, 0.3, seed=1))


def test_threshold_rounds_p_to_sixteen_bits():
    assert dropout_threshold(0.0) == 0 and dropout_threshold(0.5) == 32768
    assert dropout_threshold(1 - 1e-9) == 65535
    assert dropout_keep_probability(0.1) == (65536 - round(0.1 * 65536)) / 65536
    assert dropout_mask(1, 1, 4, 4, 0.0, seed=3).all()


@pytest.mark.parametrize("call,error,match", [
    (lambda: check_dropout_p(1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (lambda: check_dropout_p(-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (lambda: check_dropout_p(True), TypeError, "dropout_p must be a real number"),
    (lambda: check_dropout_p("0.1"), TypeError, "dropout_p must be a real number"),
    (lambda: check_dropout_seed(0.1, None, 0), ValueError, "dropout_p > 0 needs dropout_seed"),
    (lambda: check_dropout_seed(0.1, -1, 0), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
    (lambda: check_dropout_seed(0.1, 1 << 64, 0), ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
    (lambda: check_dropout_seed(0.1, 1.5, 0), TypeError, "dropout_seed must be an int"),
    (lambda: check_dropout_seed(0.1, True, 0), TypeError, "dropout_seed must be an int"),
    (lambda: check_dropout_seed(0.1, 3, -2), ValueError, r"dropout_offset must be in \[0, 2\*\*64\)"),
    (lambda: dropout_mask(1, 1, 2, 2, 0.5, seed=None), TypeError, "seed must be an int"),
])
def test_bad_dropout_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_without_dropout_the_seed_is_not_read():
    assert check_dropout_seed(0.0, None, 0) == (0, 0)
    assert check_dropout_seed(0.0, "anything", None) == (0, 0)


def _problem(**fields):
    return AttentionProblem(batch=2, seqlen_q=1, seqlen_k=300, nheads=8, nheads_k=2, head_dim=64,
                            dtype="bfloat16", device=0, softmax_scale=0.125, causal=False, **fields)


def test_dropout_picks_the_dropout_policies_and_never_folds_heads():
    problem = check_variants(_problem(), softcap=30.0, dropout_p=0.1)
    assert problem.score is SCORE_TRANSFORMS["softcap-dropout"] or problem.score == SCORE_TRANSFORMS["softcap-dropout"]
    assert problem.score.cxx_for("bfloat16") == "cuflash::WithDropout<cuflash::SoftcapScore<false>>"
    assert score_for(False, False, True).name == "dropout"
    # Rows of a folded decode would be heads: each head draws its own mask.
    layouts = {name: api.Layout.contiguous(shape, "bfloat16")
               for name, shape in (("q", (2, 1, 8, 64)), ("out", (2, 1, 8, 64)))}
    assert not api.decode_shape(problem, layouts).packed
    assert api.decode_shape(check_variants(_problem(), softcap=30.0), layouts).packed
    # A p that rounds to no dropout runs the kernels without it.
    assert check_variants(_problem(), dropout_p=1e-7).score.name == "identity"


def _random(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_forward_drops_the_normalised_probabilities(causal):
    q, k, v = _random((2, 5, 4, 8), 0), _random((2, 7, 2, 8), 1), _random((2, 7, 2, 8), 2)
    p, seed, offset = 0.3, 17, 4
    out, lse = attention_reference(q, k, v, causal=causal, dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    plain, plain_lse = attention_reference(q, k, v, causal=causal)
    np.testing.assert_array_equal(lse, plain_lse)  # the log-sum-exp is dropout's input, not its output
    keep = dropout_mask(2, 4, 5, 7, p, seed, offset)
    scores = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) / np.sqrt(8)
    if causal:
        scores = np.where(np.tril(np.ones((5, 7), dtype=bool), 2), scores, -np.inf)
    probs = np.exp(scores - lse[..., None])
    expected = np.einsum("bhqk,bkhd->bqhd", probs * keep / dropout_keep_probability(p), np.repeat(v, 2, axis=2))
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    # The mask given explicitly is the one drawn from the seed.
    np.testing.assert_array_equal(out, attention_reference(q, k, v, causal=causal, dropout_p=p, dropout_mask=keep)[0])


def test_reference_backward_is_the_gradient_with_the_mask_fixed():
    """Finite differences of sum(out * dout) with the same mask."""
    q, k, v = _random((1, 4, 2, 3), 3), _random((1, 6, 1, 3), 4), _random((1, 6, 1, 3), 5)
    dout = _random((1, 4, 2, 3), 6)
    assert_reference_gradients_match_finite_differences(dout, q, k, v, causal=True, softcap=2.0, dropout_p=0.4,
                                                        dropout_seed=8)


def test_reference_rejects_a_mask_of_the_wrong_shape():
    q = k = v = _random((1, 3, 2, 4), 0)
    with pytest.raises(ValueError, match=r"dropout_mask must have shape \(batch, nheads, seqlen_q, seqlen_k\)"):
        attention_reference(q, k, v, dropout_p=0.5, dropout_mask=np.ones((1, 2, 3, 4), dtype=bool))


def test_a_calls_seed_and_offset_are_its_plan_slots_values():
    """What the launch path writes into the plan slots beside the pointers."""
    problem = check_variants(_problem(), dropout_p=0.1)
    variants = api.Variants(dropout_p=0.1, dropout_seed=(1 << 63) + 5, dropout_offset=7)
    assert variants.scalars(problem) == {"dropout_seed": (1 << 63) + 5, "dropout_offset": 7}
    assert api.Variants(dropout_seed=3).scalars(check_variants(_problem())) == {"dropout_seed": 0,
                                                                                "dropout_offset": 0}
    with pytest.raises(ValueError, match="needs dropout_seed"):
        api.Variants(dropout_p=0.1).scalars(problem)
