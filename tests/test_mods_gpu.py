"""User score functions on the GPU: traced, compiled into every kernel
family (Hopper wgmma, mma.sync, SIMT), forward and backward against the
float64 reference that evaluates the same Python function with NumPy (its
derivative by finite differences), within 2x a same-precision naive
baseline that applies it too; arrays read by name through plan slots (new
values, same plan), variable-length batches, dropout on top, decoding, the
PyTorch autograd path, and errors before any launch."""

import numpy as np
import pytest

import cuflash
from cuflash import mods
from cuflash.reference import attention_reference

from tests.helpers import check_forward_and_backward, pin_kernel_generation, random_qkv, to_numpy64
from tests.test_forward_gpu import _cupy

pytestmark = pytest.mark.gpu


def relative_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, mods.minimum(mods.maximum(q_idx - kv_idx, -64), 63) + 64]


def softcap_causal_penalty(score, b, h, q_idx, kv_idx):
    return 4.0 * mods.tanh(score / 4.0) + mods.where(kv_idx > q_idx, -2.0, 0.0)


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx + 0 - kv_idx)


def document_bias(score, b, h, q_idx, kv_idx, doc):
    return mods.where(doc[b, q_idx] == doc[b, kv_idx], score, score - 3.0) + (q_idx % 3 - kv_idx // 7) * 0.01


def squared(score, b, h, q_idx, kv_idx):
    return score * mods.exp(-abs(score) / 8.0)


def _arrays(name, batch, nheads, seqlen_k):
    cupy = _cupy()
    rng = np.random.default_rng(1)
    if name == "relative_bias":
        return {"table": cupy.asarray(rng.uniform(-1, 1, (nheads, 128)).astype(np.float32)).astype(
            cupy.dtype("bfloat16"))}
    if name == "alibi":
        return {"slopes": cupy.asarray(rng.uniform(0.02, 0.3, nheads).astype(np.float32))}
    if name == "document_bias":
        return {"doc": cupy.asarray(np.sort(rng.integers(0, 4, (batch, max(seqlen_k, 1000))), axis=1)
                                    .astype(np.int32))}
    return {}


FUNCTIONS = [relative_bias, softcap_causal_penalty, alibi, document_bias, squared]
CONFIGS = {
    "wgmma": ("bfloat16", 128, None),
    "mma": ("float16", 64, 80),
    "simt": ("float32", 40, None),
}


def configured(config: str, monkeypatch) -> tuple[str, int]:
    """(dtype, head_dim) of CONFIGS[config], its kernel family made the one
    that runs (the generation pinned; Hopper's skipped elsewhere)."""
    dtype, head_dim, generation = CONFIGS[config]
    if config == "wgmma" and _cupy().cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU")
    if generation is not None:
        pin_kernel_generation(monkeypatch, generation)
    return dtype, head_dim


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(300, 517, False), (517, 300, True), (1, 1000, False),
                                                      (17, 127, True)])
def test_score_mod_forward_and_backward(fn, config, seqlen_q, seqlen_k, causal, monkeypatch):
    cupy = _cupy()
    dtype, head_dim = configured(config, monkeypatch)
    batch, nheads, nheads_k = 2, 4, 2
    q, k, v = random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, cupy.dtype(dtype), seed=3)
    q, k = q * 2, k * 2
    dout = random_qkv(cupy, batch, seqlen_q, seqlen_q, nheads, nheads, head_dim, cupy.dtype(dtype), seed=4)[0]
    arrays = _arrays(fn.__name__, batch, nheads, seqlen_k)
    options = dict(causal=causal, score_mod=fn, mod_arrays=arrays)
    check_forward_and_backward(cupy, q, k, v, dout, options, dtype)


def test_new_array_values_reuse_the_plan():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 200, 200, 4, 4, 64, cupy.dtype("bfloat16"), seed=5)
    first = {"table": cupy.zeros((4, 128), dtype=cupy.float32)}
    second = {"table": cupy.asarray(np.random.default_rng(2).uniform(-2, 2, (4, 128)).astype(np.float32))}
    plain = cuflash.attention(q, k, v)
    with_zero = cuflash.attention(q, k, v, score_mod=relative_bias, mod_arrays=first)
    assert bool((with_zero == plain).all())  # a zero bias is plain attention, bit for bit
    plans = len(cuflash.api.plans)
    biased = cuflash.attention(q, k, v, score_mod=relative_bias, mod_arrays=second)
    assert len(cuflash.api.plans) == plans  # the second table took the first one's plan
    want, _ = attention_reference(*(to_numpy64(x) for x in (q, k, v)), score_mod=relative_bias, mod_arrays=second)
    assert np.abs(to_numpy64(biased) - want).max() < 2e-2


def test_score_mod_equals_the_built_in_variants():
    """ALiBi and the soft cap written as score functions against the
    built-in policies: the same attention within rounding."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 300, 300, 4, 4, 64, cupy.dtype("float16"), seed=6)
    slopes = cupy.asarray([0.1, 0.2, 0.3, 0.4], dtype=cupy.float32)
    mine = cuflash.attention(q * 2, k * 2, v, causal=True, score_mod=alibi, mod_arrays={"slopes": slopes})
    built_in = cuflash.attention(q * 2, k * 2, v, causal=True, alibi_slopes=slopes)
    assert float(cupy.abs(mine.astype(cupy.float32) - built_in.astype(cupy.float32)).max()) < 5e-3

    def cap(score, b, h, q_idx, kv_idx):
        return 5.0 * mods.tanh(score / 5.0)

    mine = cuflash.attention(q * 2, k * 2, v, score_mod=cap)
    built_in = cuflash.attention(q * 2, k * 2, v, softcap=5.0)
    assert float(cupy.abs(mine.astype(cupy.float32) - built_in.astype(cupy.float32)).max()) < 5e-3


def test_score_mod_on_variable_length_batches_with_dropout():
    cupy = _cupy()
    from tests.test_varlen_gpu import PackedBatch

    batch = PackedBatch([0, 17, 300, 5], [3, 40, 300, 700], 4, 2, 64, cupy.dtype("bfloat16"), seed=8)
    doc = {"doc": cupy.asarray(np.random.default_rng(0).integers(0, 3, (4, 1000)).astype(np.int32))}
    options = dict(score_mod=document_bias, mod_arrays=doc, dropout_p=0.1, dropout_seed=3, causal=True)
    out = cuflash.attention_varlen(*batch.args(), **options)
    got = to_numpy64(out)
    for b, (rows_q, rows_k) in enumerate(batch.sequences()):
        if rows_q.stop == rows_q.start:
            continue
        sq, sk = rows_q.stop - rows_q.start, rows_k.stop - rows_k.start
        # sequence b: batch entry b of the score function and of the mask
        args = [to_numpy64(x[rows][None]) for x, rows in ((batch.q, rows_q), (batch.k, rows_k), (batch.v, rows_k))]
        keep = cuflash.dropout_mask(b + 1, 4, sq, sk, 0.1, 3)[b:b + 1]

        def shifted(score, _b, h, q_idx, kv_idx, doc, entry=b):  # the reference's batch entry 0 is sequence b
            return document_bias(score, _b + entry, h, q_idx, kv_idx, doc)

        want, _ = attention_reference(*args, causal=True, score_mod=shifted, mod_arrays=doc, dropout_p=0.1,
                                      dropout_mask=keep)
        assert np.abs(got[rows_q][None] - want).max() < 3e-2, b


def test_score_only_functions_keep_grouped_query_decoding():
    """A function of the score alone lets one decode token's query heads run
    as rows of their K/V head (each K/V byte read once); one that reads
    positions does not. Both compute the same as the reference."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1, 3000, 8, 2, 128, cupy.dtype("bfloat16"), seed=9)
    for fn, arrays in ((squared, {}), (relative_bias, _arrays("relative_bias", 2, 8, 3000))):
        out = cuflash.attention(q, k, v, score_mod=fn, mod_arrays=arrays)
        want, _ = attention_reference(*(to_numpy64(x) for x in (q, k, v)), score_mod=fn, mod_arrays=arrays)
        assert np.abs(to_numpy64(out) - want).max() < 2e-2
    assert mods.trace_score_mod(squared).reads_position is False


def test_pytorch_autograd_takes_a_score_mod():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cuflash_torch

    cupy = _cupy()
    q, k, v = (torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    table = torch.randn(4, 128, device="cuda")
    out = cuflash_torch.attention(q, k, v, causal=True, score_mod=relative_bias, mod_arrays={"table": table})
    out.float().square().sum().backward()
    views = [cupy.from_dlpack(x.detach()) for x in (q, k, v)]
    options = dict(causal=True, score_mod=relative_bias, mod_arrays={"table": cupy.from_dlpack(table)})
    want, lse = cuflash.attention(*views, return_lse=True, **options)
    assert bool((cupy.from_dlpack(out.detach()) == want).all())
    dout = cupy.from_dlpack((2 * out.float()).to(torch.bfloat16).detach())
    for leaf, grad in zip((q, k, v), cuflash.attention_backward(dout, *views, want, lse, **options)):
        assert bool((cupy.from_dlpack(leaf.grad) == grad).all())


def test_bad_score_mods_fail_before_any_launch():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 64, 64, 4, 4, 64, cupy.dtype("float16"))
    table = cupy.zeros((4, 128), dtype=cupy.float32)
    for options, error, match in (
            (dict(score_mod=relative_bias, mod_arrays={"table": table}, softcap=3.0), ValueError,
             "does not combine with softcap"),
            (dict(mod_arrays={"table": table}), ValueError, "without a score_mod"),
            (dict(score_mod=relative_bias, mod_arrays={f"t{i}": table for i in range(5)}), ValueError,
             "at most 4 arrays"),
            (dict(score_mod=relative_bias, mod_arrays={"table": table.astype(cupy.float64)}), TypeError,
             "must have one of the dtypes"),
            (dict(score_mod=relative_bias, mod_arrays={"table": table[:, ::2]}), ValueError, "C-contiguous"),
            (dict(score_mod=lambda s, b, h, qi, ki: s if qi > ki else s), TypeError, "no truth value"),
            (dict(score_mod=relative_bias), TypeError, "table"),
            (dict(score_mod="score * 2"), TypeError, "score_mod must be a function")):
        out = cupy.full_like(q, cupy.nan)
        with pytest.raises(error, match=match):
            cuflash.attention(q, k, v, out=out, **options)
        assert bool(cupy.isnan(out.astype(cupy.float32)).all())


def test_a_cuda_expression_score_mod_matches_its_python_twin():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 200, 300, 4, 2, 64, cupy.dtype("bfloat16"), seed=10)
    arrays = _arrays("alibi", 2, 4, 300)
    raw = mods.cuda("score - slopes[h] * abs(q_idx - kv_idx)", gradient="1.0f", name="raw_alibi")
    out, lse = cuflash.attention(q, k, v, score_mod=raw, mod_arrays=arrays, return_lse=True)
    twin, twin_lse = cuflash.attention(q, k, v, score_mod=alibi, mod_arrays=arrays, return_lse=True)
    assert float(cupy.abs(out.astype(cupy.float32) - twin.astype(cupy.float32)).max()) < 1e-2
    dout = cupy.ones_like(out)
    for got, want in zip(cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=raw, mod_arrays=arrays),
                         cuflash.attention_backward(dout, q, k, v, twin, twin_lse, score_mod=alibi,
                                                    mod_arrays=arrays)):
        assert float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max()) < 5e-2
    with pytest.raises(ValueError, match="needs its derivative for the backward"):
        cuflash.attention_backward(dout, q, k, v, out, lse, score_mod=mods.cuda("score * 2.0f"))
