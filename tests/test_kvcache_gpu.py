"""``attention_with_kvcache`` on the GPU against the float64 reference,
entry by entry with the cache gathered through its block table: contiguous
and paged caches (page sizes 1 to 256, pages out of order, the last page
partly filled), one length for all or per entry, keys appended in the same
call (exactly the intended slots written: the cache is poisoned with NaN
everywhere else, which a read of an unused slot would also show), decoding,
speculative decoding and chunked prefill, causal and not, GQA."""

import math

import numpy as np
import pytest

import cuflash
from cuflash import api
from cuflash.reference import attention_with_kvcache_reference, kv_cache_keys

from tests.helpers import assert_lse_close, assert_output_accurate, naive_attention_same_precision
from tests.test_forward_gpu import _cupy

pytestmark = pytest.mark.gpu

#: Cached keys per entry before the call: an empty entry, one key, a
#: partial page or tile, and a long one that split-KV cuts.
LENGTHS = {"awkward": [0, 1, 17, 1000], "long": [3000, 129]}


class KvCacheCase:
    """A random cache of ``lengths`` keys per entry (contiguous, or paged
    with ``page_size`` rows a page, the pages shuffled and spare pages
    left unused), NaN in every slot that holds no key, queries and, with
    ``new`` > 0, the rows to append."""

    def __init__(self, lengths, *, seqlen_q=1, nheads=8, nheads_k=2, head_dim=128, dtype="bfloat16",
                 page_size=None, new=0, seed=0):
        cupy = _cupy()
        rng = np.random.default_rng(seed)
        self.lengths, self.new, self.page_size = list(lengths), new, page_size
        batch = len(lengths)
        needed = [n + new for n in lengths]

        def random(*shape):
            return rng.standard_normal(shape).astype(np.float32)

        self.q = cupy.asarray(random(batch, seqlen_q, nheads, head_dim)).astype(dtype)
        keys = [random(n, nheads_k, head_dim) for n in lengths]
        values = [random(n, nheads_k, head_dim) for n in lengths]
        if page_size is None:
            capacity = max(needed) + 5
            k_cache = np.full((batch, capacity, nheads_k, head_dim), np.nan, np.float32)
            v_cache = k_cache.copy()
            for b, n in enumerate(lengths):
                k_cache[b, :n], v_cache[b, :n] = keys[b], values[b]
            self.block_table = None
        else:
            pages_each = [max(1, -(-n // page_size)) + 1 for n in needed]  # one spare page in the table
            num_pages = sum(pages_each) + 3  # and three no entry lists
            order = rng.permutation(num_pages)
            max_pages = max(pages_each)
            table = np.zeros((batch, max_pages), np.int32)
            k_cache = np.full((num_pages, page_size, nheads_k, head_dim), np.nan, np.float32)
            v_cache = k_cache.copy()
            start = 0
            for b, count in enumerate(pages_each):
                table[b, :count] = order[start:start + count]
                table[b, count:] = order[start]  # slots past the entry's pages: a page of its own
                start += count
                for key in range(lengths[b]):
                    page, row = table[b, key // page_size], key % page_size
                    k_cache[page, row], v_cache[page, row] = keys[b][key], values[b][key]
            self.block_table = cupy.asarray(table)
        self.k_cache = cupy.asarray(k_cache).astype(dtype)
        self.v_cache = cupy.asarray(v_cache).astype(dtype)
        self.k_new = cupy.asarray(random(batch, new, nheads_k, head_dim)).astype(dtype) if new else None
        self.v_new = cupy.asarray(random(batch, new, nheads_k, head_dim)).astype(dtype) if new else None
        self.cache_seqlens = cupy.asarray(np.array(lengths, np.int32))

    def expected_caches(self):
        """The caches as they must be after the call: the new rows in their slots, every other bit as before."""
        cupy = _cupy()
        caches = [self.k_cache.copy(), self.v_cache.copy()]
        for cache, rows in zip(caches, (self.k_new, self.v_new)):
            for b, n in enumerate(self.lengths):
                for j in range(self.new):
                    key = n + j
                    if self.page_size is None:
                        cache[b, key] = rows[b, j]
                    else:
                        cache[int(self.block_table[b, key // self.page_size]), key % self.page_size] = rows[b, j]
        return caches

    def reference(self, causal, scale):
        cupy = _cupy()
        table = None if self.block_table is None else self.block_table.get()
        host = [None if x is None else x.astype(cupy.float64).get()
                for x in (self.q, self.k_cache, self.v_cache, self.k_new, self.v_new)]
        out, lse = attention_with_kvcache_reference(host[0], host[1], host[2], self.lengths, block_table=table,
                                                    k_new=host[3], v_new=host[4], causal=causal,
                                                    softmax_scale=scale)
        # The same-precision yardstick, entry by entry.
        keys = kv_cache_keys(self.k_cache, self.lengths, table)
        values = kv_cache_keys(self.v_cache, self.lengths, table)
        baseline = cupy.zeros(self.q.shape, self.q.dtype)
        for b in range(self.q.shape[0]):
            k, v = keys[b], values[b]
            if self.new:
                k, v = cupy.concatenate([k, self.k_new[b]]), cupy.concatenate([v, self.v_new[b]])
            if k.shape[0]:
                baseline[b] = naive_attention_same_precision(self.q[b:b + 1], k[None], v[None], causal=causal,
                                                             softmax_scale=scale)[0]
        return out, lse, baseline


def run_kvcache(case: KvCacheCase, *, causal, lengths="array", num_splits=None):
    """One call with poisoned outputs, checked against the reference; the caches checked bit for bit."""
    cupy = _cupy()
    scale = 1 / math.sqrt(case.q.shape[-1])
    expected_k, expected_v = case.expected_caches() if case.new else (case.k_cache.copy(), case.v_cache.copy())
    ref_out, ref_lse, baseline = case.reference(causal, scale)
    out = cupy.full(case.q.shape, cupy.nan, case.q.dtype)
    lse = cupy.full((case.q.shape[0], case.q.shape[2], case.q.shape[1]), cupy.nan, cupy.float32)
    cache_seqlens = {"array": case.cache_seqlens, "int": case.lengths[0], "none": None}[lengths]
    result, result_lse = cuflash.attention_with_kvcache(
        case.q, case.k_cache, case.v_cache, case.k_new, case.v_new, cache_seqlens=cache_seqlens,
        block_table=case.block_table, causal=causal, return_lse=True, num_splits=num_splits, out=out, lse=lse)
    assert result is out and result_lse is lse
    assert_output_accurate(out, ref_out, baseline)
    assert_lse_close(lse, ref_lse)
    for cache, expected in ((case.k_cache, expected_k), (case.v_cache, expected_v)):
        assert bool((cache.view(cupy.uint16) == expected.view(cupy.uint16)).all()), "cache slots changed"
    return out, lse


@pytest.mark.parametrize("page_size", [None, 1, 7, 16, 256], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("seqlen_q", [1, 4, 100], ids=["decode", "speculative", "prefill"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_kvcache_matches_reference(page_size, seqlen_q, causal, heads, append):
    case = KvCacheCase(LENGTHS["awkward"], seqlen_q=seqlen_q, nheads=heads[0], nheads_k=heads[1],
                       page_size=page_size, new=seqlen_q if append else 0)
    run_kvcache(case, causal=causal)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("seqlen_q", [1, 100])
def test_kvcache_dtypes_and_head_dims(dtype, head_dim, page_size, seqlen_q):
    case = KvCacheCase([5, 300, 0], seqlen_q=seqlen_q, head_dim=head_dim, dtype=dtype, page_size=page_size,
                       new=1, seed=1)
    run_kvcache(case, causal=True)


@pytest.mark.parametrize("page_size", [None, 16, 256])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
def test_kvcache_split_kv_over_long_entries(page_size, num_splits):
    case = KvCacheCase(LENGTHS["long"], nheads=32, nheads_k=8, page_size=page_size, new=1, seed=2)
    run_kvcache(case, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("lengths", ["int", "none"])
def test_kvcache_one_length_for_every_entry(page_size, lengths):
    new = 2 if lengths == "int" else 0
    case = KvCacheCase([40, 40, 40], seqlen_q=2, page_size=page_size, new=new, seed=3)
    if lengths == "none":
        # A full cache: every slot holds a key (contiguous: no spare rows; paged: every listed page full).
        cupy = _cupy()
        if page_size is None:
            case.k_cache, case.v_cache = case.k_cache[:, :40], case.v_cache[:, :40]
        else:
            case.block_table = case.block_table[:, :-(-40 // page_size)]
            case = _filled(case)
        case.lengths = [case.k_cache.shape[1] if page_size is None else case.block_table.shape[1] * page_size] * 3
        case.cache_seqlens = cupy.asarray(np.array(case.lengths, np.int32))
    run_kvcache(case, causal=True, lengths=lengths)


def _filled(case: KvCacheCase) -> KvCacheCase:
    """Every row of every page the table lists given a random key."""
    cupy = _cupy()
    rng = np.random.default_rng(9)
    for cache in (case.k_cache, case.v_cache):
        for page in set(case.block_table.get().ravel().tolist()):
            cache[page] = cupy.asarray(rng.standard_normal(cache.shape[1:]).astype(np.float32)).astype(cache.dtype)
    return case


def test_kvcache_decoding_loop_reuses_its_plan(monkeypatch):
    """Tokens appended one by one with cache_seqlens advanced on the GPU:
    one plan serves every step, and each step's output is right."""
    from cuflash._launch import PlanCache

    cupy = _cupy()
    monkeypatch.setattr(api, "plans", PlanCache())  # a worker's shared cache may be full (LRU)
    case = KvCacheCase([10, 0, 33], nheads=8, nheads_k=2, page_size=16, new=1, seed=4)
    before = len(api.plans)
    for step in range(4):
        run_kvcache(case, causal=True)
        case.k_cache, case.v_cache = case.expected_caches()
        case.lengths = [n + 1 for n in case.lengths]
        case.cache_seqlens += 1
        rng = np.random.default_rng(step)
        case.q = cupy.asarray(rng.standard_normal(case.q.shape).astype(np.float32)).astype(case.q.dtype)
        case.k_new = cupy.asarray(rng.standard_normal(case.k_new.shape).astype(np.float32)).astype(case.q.dtype)
        case.v_new = cupy.asarray(rng.standard_normal(case.v_new.shape).astype(np.float32)).astype(case.q.dtype)
    assert len(api.plans) == before + 1


def test_kvcache_positions_past_the_capacity_and_bad_pages_stay_inside_the_cache():
    """GPU-side lengths past the capacity and page numbers outside the
    cache are clamped: the call writes and reads only the cache (its
    neighbours in one allocation stay as they were) and returns finite rows."""
    cupy = _cupy()
    heads, dim, page = 2, 64, 16
    store = cupy.zeros((12, page, heads, dim), cupy.float16)  # pages 2..9 are the cache
    k_cache, v_cache = store[2:6], store[6:10]
    table = cupy.asarray(np.array([[0, 3, -7], [100000, 1, 2]], np.int32))
    lengths = cupy.asarray(np.array([47, 5000], np.int32))
    new = cupy.ones((2, 3, heads, dim), cupy.float16)
    q = cupy.ones((2, 1, heads, dim), cupy.float16)
    out = cuflash.attention_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lengths, block_table=table)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.isfinite(out).all())
    assert bool((store[:2] == 0).all()) and bool((store[10:] == 0).all())


def test_torch_flash_attn_with_kvcache_drop_in():
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct

    case = KvCacheCase([7, 200], nheads=8, nheads_k=2, page_size=16, new=1, seed=5)
    cupy = _cupy()
    scale = 1 / math.sqrt(case.q.shape[-1])
    ref_out, ref_lse, baseline = case.reference(True, scale)
    expected_k, _ = case.expected_caches()
    t = {name: torch.from_dlpack(getattr(case, name)) for name in ("q", "k_cache", "v_cache", "k_new", "v_new",
                                                                     "block_table")}
    lengths = torch.tensor(case.lengths, dtype=torch.int64, device="cuda")  # int64 is converted
    out, lse = ct.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], t["k_new"], t["v_new"],
                                          cache_seqlens=lengths, block_table=t["block_table"], causal=True,
                                          return_softmax_lse=True)
    assert isinstance(out, torch.Tensor) and out.shape == t["q"].shape
    assert_output_accurate(out, ref_out, baseline)
    assert_lse_close(lse, ref_lse)
    assert bool((case.k_cache.view(cupy.uint16) == expected_k.view(cupy.uint16)).all())
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        ct.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], rotary_cos=t["q"], cache_seqlens=lengths,
                                   block_table=t["block_table"])


def test_kvcache_rejects_what_its_kernels_cannot_read():
    cupy = _cupy()
    q = cupy.zeros((1, 1, 2, 64), cupy.float32)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        cuflash.attention_with_kvcache(q, q, q)
    q = cupy.zeros((1, 1, 2, 68), cupy.float16)[..., :64]  # heads 136 bytes apart: not 16-byte multiples
    k = cupy.zeros((1, 8, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        cuflash.attention_with_kvcache(q, k, k, cache_seqlens=cupy.zeros(1, cupy.int32))
