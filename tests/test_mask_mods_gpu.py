"""User masks on the GPU: ``mask_mod`` traced into the kernels' UserMask
policy and its tile map (built on the GPU, compared with NumPy's), forward
and backward of every kernel family (Hopper wgmma, mma.sync, SIMT) against
the float64 reference that evaluates the same Python function, within 2x a
same-precision naive baseline that applies it too; rows that see no key,
grouped-query heads with a per-head mask, the deterministic backward,
BlockMask reuse, score_mod together with mask_mod, the PyTorch autograd
path, and errors before any launch."""

import numpy as np
import pytest

import cuflash
from cuflash import mods
from cuflash.block_mask import tile_map_reference, tile_states_reference

from tests.helpers import check_forward_and_backward, random_qkv
from tests.test_forward_gpu import _cupy
from tests.test_mods_gpu import CONFIGS, configured  # a kernel family each

pytestmark = pytest.mark.gpu


def same_document(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def causal_band(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 100)


def prefix_lm_per_head(b, h, q_idx, kv_idx):
    # Head h sees a prefix of 37 + 40 h keys whole, causal beyond it.
    return (kv_idx < 37 + 40 * h) | (q_idx >= kv_idx)


def first_rows_only(b, h, q_idx, kv_idx):
    # Rows from 50 on see no key at all: output 0, log-sum-exp -inf.
    return (q_idx < 50) & (kv_idx % 3 != 1)


def _arrays(name, batch, seqlen):
    cupy = _cupy()
    if name != "same_document":
        return {}
    rng = np.random.default_rng(2)
    return {"doc": cupy.asarray(np.sort(rng.integers(0, 5, (batch, max(seqlen, 1))), axis=1).astype(np.int32))}


MASKS = [same_document, causal_band, prefix_lm_per_head, first_rows_only]


@pytest.mark.parametrize("fn", MASKS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 517), (517, 300), (1, 1000), (17, 127)])
def test_mask_mod_forward_and_backward(fn, config, seqlen_q, seqlen_k, monkeypatch):
    cupy = _cupy()
    dtype, head_dim = configured(config, monkeypatch)
    batch, nheads, nheads_k = 2, 4, 2
    q, k, v = random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, cupy.dtype(dtype), seed=5)
    dout = random_qkv(cupy, batch, seqlen_q, seqlen_q, nheads, nheads, head_dim, cupy.dtype(dtype), seed=6)[0]
    options = dict(mask_mod=fn, mod_arrays=_arrays(fn.__name__, batch, max(seqlen_q, seqlen_k)))
    check_forward_and_backward(cupy, q, k, v, dout, options, dtype)


@pytest.mark.parametrize("fn", [same_document, prefix_lm_per_head], ids=lambda f: f.__name__)
def test_deterministic_backward_takes_turns_among_the_listed_tiles(fn):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 700, 700, 4, 2, 128, cupy.dtype("bfloat16"), seed=7)
    dout = random_qkv(cupy, 2, 700, 700, 4, 4, 128, cupy.dtype("bfloat16"), seed=8)[0]
    options = dict(mask_mod=fn, mod_arrays=_arrays(fn.__name__, 2, 700))
    out, lse, grads = check_forward_and_backward(cupy, q, k, v, dout, options, "bfloat16", deterministic=True)
    again = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for got, want in zip(again, grads):
        assert bool((got == want).all())


@pytest.mark.parametrize("fn", MASKS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("block_m,block_n", [(128, 128), (64, 128), (128, 48), (16, 32)])
def test_tile_map_is_numpys(fn, block_m, block_n):
    batch, nheads, seqlen_q, seqlen_k = 2, 3, 517, 300
    arrays = _arrays(fn.__name__, batch, max(seqlen_q, seqlen_k))
    mask = cuflash.block_mask(fn, batch, nheads, seqlen_q, seqlen_k, mod_arrays=arrays)
    from cuflash._masks import register_user_mask

    policy = register_user_mask(mods.trace_mask_mod(fn, arrays))
    dims = (batch if policy.reads_batch else 1, nheads if policy.reads_head else 1)
    views = [arrays.get("doc")]
    got = mask.tile_map(policy, dims, block_m, block_n, views, 0).get()
    condition = mods.evaluate_mask_mod(fn, (batch, nheads, seqlen_q, seqlen_k), arrays)
    states = tile_states_reference(condition[:dims[0], :dims[1]], block_m, block_n)
    want = np.concatenate([tile_map_reference(states[b, h]) for b in range(dims[0]) for h in range(dims[1])])
    np.testing.assert_array_equal(got, want)
    assert mask.tile_map(policy, dims, block_m, block_n, views, 0) is mask.tile_map(policy, dims, block_m, block_n,
                                                                                     views, 0)


def test_a_block_mask_is_built_once_per_tiling_and_matches_the_function():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1000, 1000, 4, 4, 128, cupy.dtype("bfloat16"), seed=9)
    arrays = _arrays("same_document", 2, 1000)
    mask = cuflash.block_mask(same_document, 2, None, 1000, 1000, mod_arrays=arrays)
    out, lse = cuflash.attention(q, k, v, mask_mod=mask, return_lse=True)
    again = cuflash.attention(q, k, v, mask_mod=mask)
    plain = cuflash.attention(q, k, v, mask_mod=same_document, mod_arrays=arrays)
    assert bool((out == again).all()) and bool((out == plain).all())
    dout = cupy.ones_like(out)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mask)
    plain_grads = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=same_document, mod_arrays=arrays)
    for got, want in zip(grads, plain_grads):
        assert float(cupy.abs(got.astype(cupy.float32) - want.astype(cupy.float32)).max()) < 1e-2
    assert len(mask._maps) == 2  # the forward's tiling and the backward's
    # Later calls take their cached plans, the maps among their fixed arrays.
    mask.tile_map = None
    assert bool((cuflash.attention(q, k, v, mask_mod=mask) == out).all())
    for got, want in zip(cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mask), grads):
        assert bool((got == want).all())
    with pytest.raises(ValueError, match="BlockMask for seqlen_q 1000, but the call has seqlen_q 999"):
        cuflash.attention(q[:, :999], k, v, mask_mod=mask)


def test_score_mod_and_mask_mod_together():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 300, 400, 4, 2, 64, cupy.dtype("bfloat16"), seed=11)
    dout = random_qkv(cupy, 2, 300, 300, 4, 4, 64, cupy.dtype("bfloat16"), seed=12)[0]
    arrays = _arrays("same_document", 2, 400)
    arrays["slopes"] = cupy.asarray(np.linspace(0.05, 0.3, 4).astype(np.float32))

    def alibi(score, b, h, q_idx, kv_idx, doc, slopes):
        return score - slopes[h] * abs(q_idx - kv_idx)

    def document(b, h, q_idx, kv_idx, doc, slopes):
        return doc[b, q_idx] == doc[b, kv_idx]

    check_forward_and_backward(cupy, q, k, v, dout, dict(score_mod=alibi, mask_mod=document, mod_arrays=arrays), "bfloat16")


def test_pytorch_autograd_takes_a_mask_mod():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cuflash_torch

    cupy = _cupy()
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = cuflash_torch.attention(q, k, v, mask_mod=causal_band)
    out.float().square().sum().backward()
    views = [cupy.from_dlpack(x.detach()) for x in (q, k, v)]
    want, lse = cuflash.attention(*views, return_lse=True, mask_mod=causal_band)
    assert bool((cupy.from_dlpack(out.detach()) == want).all())
    dout = cupy.from_dlpack((2 * out.float()).to(torch.bfloat16).detach())
    for leaf, grad in zip((q, k, v), cuflash.attention_backward(dout, *views, want, lse, mask_mod=causal_band)):
        assert bool((cupy.from_dlpack(leaf.grad) == grad).all())


def test_bad_mask_mods_fail_before_any_launch():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 64, 64, 4, 4, 64, cupy.dtype("float16"))
    doc = cupy.zeros((1, 64), dtype=cupy.int32)
    for options, error, match in (
            (dict(mask_mod=causal_band, causal=True), ValueError, "does not combine with causal"),
            (dict(mask_mod=causal_band, window_size=(8, 0)), ValueError, "does not combine with causal"),
            (dict(mask_mod=lambda b, h, qi, ki: qi - ki), TypeError, "must return a condition"),
            (dict(mask_mod=same_document), TypeError, "doc"),
            (dict(mask_mod="q_idx >= kv_idx"), TypeError, "mask_mod must be a function"),
            (dict(mask_mod=causal_band, num_splits=2), ValueError, "num_splits does not combine"),
            (dict(mask_mod=cuflash.block_mask(same_document, 1, None, 64, 64, mod_arrays={"doc": doc}),
                  mod_arrays={"doc": doc.copy()}), ValueError, "the same array its tile maps")):
        out = cupy.full_like(q, cupy.nan)
        with pytest.raises(error, match=match):
            cuflash.attention(q, k, v, out=out, **options)
        assert bool(cupy.isnan(out.astype(cupy.float32)).all())
    with pytest.raises(ValueError, match="needs batch"):
        cuflash.block_mask(same_document, None, None, 64, 64, mod_arrays={"doc": doc})
