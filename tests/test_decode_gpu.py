"""Decoding on the GPU against the float64 reference: grouped-query packing
(one query token: the query heads of a K/V head run as rows of one block),
split-KV (key ranges in separate blocks, merged by their log-sum-exp), and
``merge_attention_states``. Outputs are poisoned with NaN before each run."""

import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import api
from cuflash.reference import attention_reference

from tests.helpers import (assert_lse_close, assert_output_accurate, naive_attention_same_precision, random_qkv,
                           to_numpy64)
from tests.test_forward_gpu import _cupy, run_and_check

pytestmark = pytest.mark.gpu


def _plan_of(q, k, v, causal, num_splits=None):
    """The launch plan cuflash makes for this call (the split count and kernels it chose)."""
    from cuflash._validation import check_forward, meta_of

    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), None, causal=causal,
                            softmax_scale=None)
    cupy = _cupy()
    out = cupy.empty_like(q)
    layouts = {name: api.Layout.of(x) for name, x in (("q", q), ("k", k), ("v", v), ("out", out))}
    return api.forward_plan(problem, layouts, aligned=True, num_splits=num_splits)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("seqlen_k", [1, 17, 1000, 4097])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (32, 4)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
def test_decode_one_token(dtype, head_dim, seqlen_k, heads, num_splits):
    cupy = _cupy()
    nheads, nheads_k = heads
    q, k, v = random_qkv(cupy, 3, 1, seqlen_k, nheads, nheads_k, head_dim, cupy.dtype(dtype),
                         seed=seqlen_k + head_dim + nheads_k)
    for causal in (False, True):  # one row sees every key either way
        run_and_check(q, k, v, causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(5, 5), (17, 1000), (64, 3000), (3, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_decode_few_tokens(seqlen_q, seqlen_k, causal, num_splits):
    """Speculative decoding and chunked prefill: a few query rows, causal
    bottom-right; a causal block may see none of a key range (output 0,
    log-sum-exp -inf, weighed 0 by the merge)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, 128, cupy.dtype("bfloat16"), seed=seqlen_q)
    run_and_check(q, k, v, causal=causal, num_splits=num_splits)


def test_decode_packs_query_heads_and_splits_long_caches():
    """One token against a long cache with GQA takes split-KV (forward and
    merge kernels) on the decode tiles; num_splits=1 keeps one kernel."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 1, 131072, 32, 8, 128, cupy.dtype("bfloat16"), seed=5)
    plan = _plan_of(q, k, v, causal=True)
    assert plan.kernel_count == 2 and set(plan.work_buffers) == {"out_partial", "lse_partial"}
    splits = plan.work_buffers["out_partial"][0][0]
    assert splits > 8
    # Packed: (batch 1, 4 query heads of each of 8 K/V heads as rows).
    assert plan.work_buffers["out_partial"][0][1:] == (1, 4, 8, 128)
    assert _plan_of(q, k, v, causal=True, num_splits=1).kernel_count == 1
    run_and_check(q, k, v, causal=True)


def test_decode_split_is_deterministic_and_matches_unsplit():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1, 5000, 16, 4, 128, cupy.dtype("float16"), seed=9)
    first = cuflash.attention(q, k, v, num_splits=8)
    for _ in range(3):
        assert bool((cuflash.attention(q, k, v, num_splits=8) == first).all())
    unsplit = cuflash.attention(q, k, v, num_splits=1)
    assert float(cupy.abs(unsplit.astype(cupy.float32) - first.astype(cupy.float32)).max()) < 2e-3


def test_num_splits_for_a_call_that_does_not_decode_is_refused():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 300, 300, 2, 2, 64, cupy.dtype("bfloat16"))
    with pytest.raises(ValueError, match="num_splits applies to decoding"):
        cuflash.attention(q, k, v, num_splits=4)
    cuflash.attention(q, k, v, num_splits=1)  # no split asked: fine


def _merge_reference(outs, lses):
    outs, lses = to_numpy64(outs), to_numpy64(lses)  # (s, b, n, h, d), (s, b, h, n)
    lse = np.logaddexp.reduce(lses, axis=0)
    with np.errstate(invalid="ignore"):
        weights = np.where(np.isneginf(lses), 0.0, np.exp(lses - lse))  # (s, b, h, n)
    weights = np.nan_to_num(weights)
    out = np.einsum("sbhn,sbnhd->bnhd", weights, np.nan_to_num(outs))
    return out, lse


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [1, 7, 64, 256])
@pytest.mark.parametrize("num_states", [1, 2, 5, 33, 70])  # past 32: the merge reads 32 states at a time
def test_merge_attention_states_matches_float64(dtype, head_dim, num_states):
    cupy = _cupy()
    rng = np.random.default_rng(head_dim * 10 + num_states)
    b, n, h = 2, 17, 3
    outs = cupy.asarray(rng.standard_normal((num_states, b, n, h, head_dim))).astype(dtype)
    lses = rng.standard_normal((num_states, b, h, n)) * 4
    lses[0, 0, 0, :] = -np.inf            # a state that saw no key for some rows
    lses[:, 1, 2, 3] = -np.inf            # a row that saw no key in any state
    outs[0, 0, :, 0, :] = cupy.nan        # never read: weight 0
    lses = cupy.asarray(lses, dtype=cupy.float32)
    out = cupy.full((b, n, h, head_dim), cupy.nan, dtype=dtype)
    lse = cupy.full((b, h, n), cupy.nan, dtype=cupy.float32)
    result, lse_result = cuflash.merge_attention_states(outs, lses, out=out, lse=lse)
    assert result is out and lse_result is lse
    ref_out, ref_lse = _merge_reference(outs, lses)
    got = to_numpy64(out)
    assert not np.isnan(got).any()
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert np.abs(got - ref_out).max() <= tolerance * max(1.0, np.abs(ref_out).max())
    assert_lse_close(lse, ref_lse)
    assert (got[1, 3, 2] == 0).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("num_states", [2, 6])
def test_merge_attention_states_off_a_16_byte_boundary(dtype, num_states):
    """Partials whose strides allow 16-byte loads but whose address does not
    (one element in): merged with narrower loads, after the same shapes
    merged aligned (a cached plan must not serve the misaligned call)."""
    cupy = _cupy()
    rng = np.random.default_rng(num_states)
    shape = (num_states, 2, 9, 3, 64)
    flat = cupy.asarray(rng.standard_normal(int(np.prod(shape)) + 8)).astype(dtype)
    lses = cupy.asarray(rng.standard_normal((num_states, 2, 3, 9)) * 3, dtype=cupy.float32)
    for offset in (0, 1):
        outs = flat[offset:offset + int(np.prod(shape))].reshape(shape)
        out = cupy.full(shape[1:], cupy.nan, dtype=dtype)
        cuflash.merge_attention_states(outs, lses, out=out)
        ref_out, _ = _merge_reference(outs, lses)
        got = to_numpy64(out)
        assert not np.isnan(got).any()
        assert np.abs(got - ref_out).max() <= 1e-2 * max(1.0, np.abs(ref_out).max()), offset


def test_merge_attention_states_of_two_key_halves_is_attention_over_all():
    """The building block of split-KV and context parallelism: attention
    over two halves of the keys, merged, is attention over all of them."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 300, 4, 2, 64, cupy.dtype("float32"), seed=3)
    parts = [cuflash.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 120), slice(120, 300))]
    outs = cupy.stack([p[0] for p in parts])
    lses = cupy.stack([p[1] for p in parts])
    out, lse = cuflash.merge_attention_states(outs, lses)
    ref_out, ref_lse = attention_reference(q, k, v, causal=False, softmax_scale=None)
    assert np.abs(to_numpy64(out) - to_numpy64(ref_out)).max() < 1e-5
    assert_lse_close(lse, ref_lse)


def test_merge_attention_states_from_torch_on_strided_lses():
    torch = pytest.importorskip("torch")
    outs = torch.randn(3, 2, 5, 4, 32, device="cuda")
    lses = torch.randn(3, 2, 5, 4, device="cuda").transpose(2, 3)  # (s, b, h, n), not contiguous
    out, lse = cuflash.merge_attention_states(outs, lses)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 4, 32) and lse.shape == (2, 4, 5)
    ref_out, ref_lse = _merge_reference(outs.cpu().numpy(), lses.cpu().numpy())
    assert np.abs(out.cpu().double().numpy() - ref_out).max() < 1e-5
    assert np.abs(lse.cpu().double().numpy() - ref_lse).max() < 1e-5


def test_merge_attention_states_rejects_bad_input():
    cupy = _cupy()
    outs = cupy.zeros((2, 1, 3, 4, 8), dtype=cupy.float32)
    with pytest.raises(ValueError, match="lses must have shape"):
        cuflash.merge_attention_states(outs, cupy.zeros((2, 1, 3, 4), dtype=cupy.float32))
    with pytest.raises(TypeError, match="lses must have dtype float32"):
        cuflash.merge_attention_states(outs, cupy.zeros((2, 1, 4, 3), dtype=cupy.float16))
    with pytest.raises(ValueError, match="outs must have 5 dimensions"):
        cuflash.merge_attention_states(outs[0], cupy.zeros((1, 4, 3), dtype=cupy.float32))


def _decode_plan_kernels(q, k, v, causal, num_splits):
    """Kernels and work buffers of the plan cuflash makes for this decode call."""
    plan = _plan_of(q, k, v, causal, num_splits)
    return plan.kernel_count, set(plan.work_buffers)


def _hopper():
    return api._kernel_generation(0) >= 90


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 4), (16, 1)], ids=["mha", "gqa8", "mqa16"])
@pytest.mark.parametrize("num_splits", [2, 4, 8, 16])
def test_cluster_merged_splits_match_float64(dtype, head_dim, heads, num_splits):
    """Split-KV whose ranges merge in their thread-block cluster (Hopper):
    one kernel, no work buffers; output and LSE against float64, poisoned
    outputs; awkward lengths, a range count above and below the key blocks."""
    cupy = _cupy()
    nheads, nheads_k = heads
    for seqlen_k in (1000, 4097):
        q, k, v = random_qkv(cupy, 3, 1, seqlen_k, nheads, nheads_k, head_dim, cupy.dtype(dtype),
                             seed=seqlen_k + head_dim + num_splits)
        if _hopper() and seqlen_k == 1000:  # 16 key blocks: every count is a cluster's (4097: 13 ranges of 16)
            assert _decode_plan_kernels(q, k, v, True, num_splits) == (1, set())
        run_and_check(q, k, v, causal=True, num_splits=num_splits)


def test_cluster_merged_splits_weigh_ranges_without_keys_zero():
    """A window: most ranges see no key of the row (output 0, log-sum-exp
    -inf in their blocks), which the cluster's merge must weigh 0."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1, 4097, 16, 2, 128, cupy.dtype("bfloat16"), seed=11)
    scale = 1 / np.sqrt(128)
    for window in ((64, 0), (700, 0)):
        out = cupy.full(q.shape, cupy.nan, q.dtype)
        lse = cupy.full((2, 16, 1), cupy.nan, cupy.float32)
        cuflash.attention(q, k, v, causal=True, window_size=window, num_splits=16, out=out, lse=lse,
                          return_lse=True)
        ref_out, ref_lse = attention_reference(q, k, v, causal=True, window_size=window, softmax_scale=scale)
        baseline = naive_attention_same_precision(q, k, v, causal=True, window_size=window, softmax_scale=scale)
        assert_output_accurate(out, ref_out, baseline)
        assert_lse_close(lse, ref_lse)


def test_cluster_and_merge_kernel_agree():
    """The same ranges merged in the cluster and by the merge kernel."""
    from cuflash import _tiling

    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1, 5000, 16, 4, 128, cupy.dtype("float16"), seed=9)
    clustered = cuflash.attention(q, k, v, num_splits=8)
    saved = _tiling.DECODE_CLUSTER_SPLITS
    try:
        _tiling.DECODE_CLUSTER_SPLITS = ()
        api.plans.clear()
        assert _decode_plan_kernels(q, k, v, False, 8) == (2, {"out_partial", "lse_partial"})
        merged = cuflash.attention(q, k, v, num_splits=8)
    finally:
        _tiling.DECODE_CLUSTER_SPLITS = saved
        api.plans.clear()
    assert float(cupy.abs(clustered.astype(cupy.float32) - merged.astype(cupy.float32)).max()) < 1e-3


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("page_size", [None, 16, 32, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("num_splits", [1, 3, 5, 8])
def test_copy_engine_kv_matches_cp_async_bit_for_bit(monkeypatch, head_dim, page_size, num_splits):
    """Hopper's decode copies its key blocks by tensor maps (``Tiling.kv_tma``:
    one box a block, or a page's rows a box); the cp.async form of the same
    kernel must give the same bits, with NaN in every cache slot that holds
    no key (stale rows a map copies), awkward lengths, shuffled pages.
    Unclustered launches (50 blocks at most) take the deeper ring where it
    fits (``decode_ring``)."""
    from cuflash import _tiling
    from cuflash._tiling import decode_ring_form, decode_tilings
    from tests.test_kvcache_gpu import KvCacheCase

    if not _hopper():
        pytest.skip("copy-engine K/V runs on Hopper")
    cupy = _cupy()
    case = KvCacheCase([1, 17, 64, 1000, 4097], nheads=16, nheads_k=2, head_dim=head_dim, dtype="float16",
                       page_size=page_size, seed=head_dim)
    keys = []
    get = api.loader.get
    monkeypatch.setattr(api.loader, "get", lambda variant, device: keys.append(variant.key) or get(variant, device))

    def run():
        api.plans.clear()
        keys.clear()
        out, lse = cuflash.attention_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=case.cache_seqlens,
                                                  block_table=case.block_table, num_splits=num_splits, return_lse=True)
        return out, lse, [key for key in keys if key.startswith("forward-mma/")]

    out, lse, forward = run()
    assert forward and all(key.endswith(("/tma", f"/tma/cluster{num_splits}")) for key in forward)
    one_tile = dataclasses.replace(decode_tilings("float16", head_dim, 8)[1], kv_tma=True)
    ring = num_splits not in _tiling.DECODE_CLUSTER_SPLITS and decode_ring_form(one_tile, "float16") is not None
    assert all(("/kv3/" in key) == ring for key in forward), forward
    monkeypatch.setattr(api, "_kv_tma_applies", lambda problem, layouts, block_n: False)
    plain_out, plain_lse, plain_forward = run()
    assert plain_forward and not any("/tma" in key for key in plain_forward)
    assert not bool(cupy.isnan(out).any())
    assert bool((out.view(cupy.uint16) == plain_out.view(cupy.uint16)).all())
    assert bool((lse == plain_lse).all())


@pytest.mark.parametrize("batch,nheads_k", [(1, 1), (2, 2)])
def test_decode_without_keys_gives_zeros_and_minus_inf(batch, nheads_k):
    """One token against no keys, dense and from a cache of length 0: zeros
    and -inf (on Hopper the copy-engine path must not map an empty tensor)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, batch, 1, 0, 8, nheads_k, 64, cupy.float16)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert float(cupy.abs(out.astype(cupy.float32)).max()) == 0.0 and bool(cupy.isneginf(lse).all())
    cache = cupy.zeros((batch, 32, nheads_k, 64), cupy.float16)
    out, lse = cuflash.attention_with_kvcache(q, cache, cache, cache_seqlens=0, return_lse=True)
    assert float(cupy.abs(out.astype(cupy.float32)).max()) == 0.0 and bool(cupy.isneginf(lse).all())
