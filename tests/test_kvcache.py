"""KV-cache calls without a GPU: the argument checks of
``attention_with_kvcache``, the problem and batch layout they give the
kernels, and the launch plan (the append kernel first, then the forward on
the mma.sync kernel, pointer slots wired to both)."""

from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import api
from cuflash._launch import PlanCache
from cuflash._params import CACHE_APPEND_PARAMS, FORWARD_PARAMS, WGMMA_FORWARD_PARAMS
from cuflash._validation import TensorMeta, check_kv_cache, contiguous_strides
from cuflash.reference import attention_reference, attention_with_kvcache_reference, kv_cache_keys


def _meta(name, shape, dtype="bfloat16", strides=None):
    return TensorMeta(name, tuple(shape), strides or contiguous_strides(tuple(shape)), dtype, 0)


def _call(batch=3, seqlen_q=1, nheads=8, nheads_k=2, head_dim=128, cache=(3, 1024), paged=None, new=0,
          cache_seqlens="array", **kwargs):
    """check_kv_cache of a call: ``cache`` (entries or pages, rows each),
    ``paged``: max_pages (with a block table), ``new``: appended rows."""
    q = _meta("q", (batch, seqlen_q, nheads, head_dim))
    k = _meta("k_cache", (*cache, nheads_k, head_dim))
    v = _meta("v_cache", (*cache, nheads_k, head_dim))
    k_new = _meta("k_new", (batch, new, nheads_k, head_dim)) if new else None
    v_new = _meta("v_new", (batch, new, nheads_k, head_dim)) if new else None
    table = _meta("block_table", (batch, paged), "int32") if paged else None
    lengths = _meta("cache_seqlens", (batch,), "int32") if cache_seqlens == "array" else cache_seqlens
    return check_kv_cache(q, k, v, k_new, v_new, lengths, table, None, None,
                          causal=kwargs.get("causal", True), softmax_scale=None)


def test_a_contiguous_cache_with_one_length_is_a_dense_problem():
    call = _call(cache_seqlens=700, new=2)
    problem = call.problem
    assert problem.kv_cache is None and problem.layout == "dense"
    assert (problem.seqlen_k, call.capacity, call.seqlen_new, call.cache_seqlen) == (702, 1024, 2, 700)
    full = _call(cache_seqlens=None).problem
    assert full.seqlen_k == 1024 and full.layout == "dense"


def test_per_entry_lengths_and_pages_are_their_own_layouts():
    cache = _call(cache_seqlens="array").problem
    assert cache.layout == "cache" and cache.kv_cache.per_entry and cache.seqlen_k == 1024
    paged = _call(cache=(40, 16), paged=10, cache_seqlens="array").problem
    assert paged.layout == "paged" and paged.seqlen_k == 160  # max_pages * page_size
    assert (paged.kv_cache.page_size, paged.kv_cache.num_pages, paged.kv_cache.block_table_stride) == (16, 40, 10)
    assert paged.total_k == 40 * 16
    one_length = _call(cache=(40, 16), paged=10, cache_seqlens=33, new=1).problem
    assert one_length.layout == "paged" and not one_length.kv_cache.per_entry and one_length.seqlen_k == 34


@pytest.mark.parametrize("change,error,match", [
    (dict(cache=(2, 64)), ValueError, "k_cache must have batch size 3 like q"),
    (dict(cache=(0, 16), paged=4), ValueError, "at least one page"),
    (dict(head_dim=36), ValueError, "multiple of 8"),
    (dict(nheads_k=3), ValueError, "multiple of k's nheads_k"),
    (dict(cache_seqlens=None, new=1), ValueError, "k_new and v_new need cache_seqlens"),
    (dict(cache_seqlens=1024, new=1), ValueError, "from 0 to the cache's capacity 1024 less the 1 appended"),
    (dict(cache_seqlens=-1), ValueError, "from 0 to"),
    (dict(cache_seqlens=2.0), TypeError, "cache_seqlens must be None, an int"),
    (dict(cache_seqlens=True), TypeError, "cache_seqlens must be None, an int"),
])
def test_bad_calls_name_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        _call(**change)


def test_bad_arrays_name_the_argument():
    q = _meta("q", (2, 1, 4, 64))
    k = _meta("k_cache", (2, 32, 4, 64))
    with pytest.raises(TypeError, match="q must have dtype float16 or bfloat16"):
        check_kv_cache(_meta("q", (2, 1, 4, 64), "float32"), _meta("k_cache", (2, 32, 4, 64), "float32"),
                       _meta("v_cache", (2, 32, 4, 64), "float32"), None, None, None, None, None, None,
                       causal=False, softmax_scale=None)
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        check_kv_cache(q, k, k, None, None, None, _meta("block_table", (2, 4), "int64"), None, None,
                       causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match=r"block_table must have shape \(batch, max_pages\) with batch 2"):
        check_kv_cache(q, k, k, None, None, None, _meta("block_table", (3, 4), "int32"), None, None,
                       causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match="cache_seqlens must have shape \\(2,\\)"):
        check_kv_cache(q, k, k, None, None, _meta("cache_seqlens", (3,), "int32"), None, None, None,
                       causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match="k_new and v_new come together"):
        check_kv_cache(q, k, k, _meta("k_new", (2, 1, 4, 64)), None, 3, None, None, None, causal=False,
                       softmax_scale=None)
    with pytest.raises(ValueError, match=r"v_new must have shape \(batch, seqlen_new, nheads_k, head_dim\)"):
        check_kv_cache(q, k, k, _meta("k_new", (2, 1, 4, 64)), _meta("v_new", (2, 2, 4, 64)), 3, None, None, None,
                       causal=False, softmax_scale=None)
    with pytest.raises(ValueError, match="v_cache must have the shape of k_cache"):
        check_kv_cache(q, k, _meta("v_cache", (2, 31, 4, 64)), None, None, None, None, None, None, causal=False,
                       softmax_scale=None)


@pytest.fixture
def stand_in_hopper(monkeypatch):
    """A planner that believes it runs on an H100, recording the kernels it asks for."""
    requested = []

    def get(variant, device):
        requested.append(variant.key)
        return SimpleNamespace(kernel=SimpleNamespace(ptr=len(requested)))

    monkeypatch.setattr(api.loader, "get", get)
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(api, "plans", PlanCache())
    return requested


def _layouts(call, cache_shape, new):
    p = call.problem
    q = api.Layout.contiguous((p.batch, p.seqlen_q, p.nheads, p.head_dim), p.dtype)
    cache = api.Layout.contiguous((*cache_shape, p.nheads_k, p.head_dim), p.dtype)
    layouts = {"q": q, "out": q, "k": cache, "v": cache}
    if new:
        layouts["k_new"] = layouts["v_new"] = api.Layout.contiguous((p.batch, new, p.nheads_k, p.head_dim), p.dtype)
    return layouts, {"k": cache, "v": cache}


def _without_driver(plan):
    """Makes ``plan.launch`` write its structs and maps but call no driver."""
    plan._launch_kernel = lambda *args: None
    plan._launch_kernel_ex = lambda *args: 0


def _launched(plan, requested):
    """The keys of a plan's kernels in launch order (the stand-in loader
    numbers kernels by request)."""
    return [requested[function - 1] for function, *_ in plan._launches]


@pytest.mark.parametrize("cache,paged,new,batch", [((600, 16), 512, 1, 2), ((3, 1024), None, 0, 3),
                                                  ((64, 1024), None, 0, 64), ((4, 128), None, 0, 4)])
def test_every_dependent_launch_is_of_a_kernel_that_waits(stand_in_hopper, monkeypatch, cache, paged, new, batch):
    """A kernel launched with programmatic stream serialization may start
    before the kernel ahead of it has finished, so its source must wait for
    that kernel (``wait_for_prerequisite_grids``, grid_dependency.cuh):
    split and unsplit decodes, clustered or not, with an append."""
    from pathlib import Path

    from cuflash._loader import kernel_source_dir

    variants = []
    record_key = api.loader.get  # the stand-in's: numbers the kernels by request
    monkeypatch.setattr(api.loader, "get", lambda variant, device: variants.append(variant) or record_key(variant,
                                                                                                         device))
    monkeypatch.setattr(api, "_decode_blocks_per_sm", lambda problem, tiling: 3)
    call = _call(batch=batch, cache=cache, paged=paged, new=new, causal=False)
    layouts, caches = _layouts(call, cache, new)
    plan = api.kvcache_plan(call, layouts, caches)
    dependent = [variants[function - 1] for function, *_, config in plan._launches if config is not None]
    assert dependent and any(variant.key.startswith("forward-mma/") for variant in dependent)
    for variant in dependent:
        source = (Path(kernel_source_dir()) / variant.source).read_text()
        assert "wait_for_prerequisite_grids();" in source, variant.key


def test_a_paged_decode_appends_first_then_runs_split_kv_on_the_paged_kernel(stand_in_hopper):
    call = _call(batch=2, cache=(600, 16), paged=512, new=1, cache_seqlens="array")
    layouts, caches = _layouts(call, (600, 16), 1)
    plan = api.kvcache_plan(call, layouts, caches)
    append, forward, merge = _launched(plan, stand_in_hopper)
    assert append == "kv-cache-append/bfloat16/paged"
    # GQA packed: no mask; a one-tile block; 16-row pages, merged by the merge kernel: the deeper ring.
    assert forward.startswith("forward-mma/bfloat16/hdim128/m16n64w4/none/paged/kv3/split/split-keys")
    assert merge.startswith("merge-states/float32-bfloat16")
    # On Hopper the forward and the merge are dependent launches (their launch latency overlaps the tail of
    # the kernel before them; both wait for it before reading its results).
    assert [dependent is not None for *_, dependent in plan._launches] == [False, True, True]
    assert set(plan.work_buffers) == {"out_partial", "lse_partial", "seqused_k"}
    assert plan.work_buffers["seqused_k"] == ((2,), "int32")
    # Pointers land where each kernel reads them (struct 0: forward, 1: merge, 2: append).
    # 16-row pages tile a key block: on Hopper the forward copies them by tensor maps (encoded here by a stand-in).
    assert forward.endswith("/tma") and len(plan._tensor_maps) == 2
    encoded = []
    for _, encoder in plan._tensor_maps:
        encoder._encode = lambda *args: encoded.append(args[3].value) or 0
    pointers = [1024 + 16 * i for i in range(len(api.KVCACHE_ARRAYS))]
    _without_driver(plan)
    plan.launch(pointers, 0)
    forward_struct, append_struct = plan._structs[0][0], plan._structs[2][0]
    at = dict(zip(api.KVCACHE_ARRAYS, pointers))
    assert encoded == [at["k"], at["v"]]
    assert forward_struct["k"]["ptr"] == append_struct["k_cache"]["ptr"] == at["k"]
    assert forward_struct["v"]["ptr"] == append_struct["v_cache"]["ptr"] == at["v"]
    assert forward_struct["size"]["seqused_k"] == append_struct["seqused_k"] == at["seqused_k"]
    assert forward_struct["size"]["block_table"] == append_struct["size"]["block_table"] == at["block_table"]
    assert append_struct["cache_seqlens"] == at["cache_seqlens"]
    assert (append_struct["k_new"]["ptr"], append_struct["v_new"]["ptr"]) == (at["k_new"], at["v_new"])
    assert forward_struct["size"]["page_size"] == append_struct["size"]["page_size"] == 16
    assert forward_struct["size"]["block_table_stride"] == 512 and forward_struct["size"]["total_k"] == 600 * 16
    assert append_struct["size"]["seqlen_k"] == 512 * 16 and append_struct["seqlen_new"] == 1


def test_without_an_append_the_kernels_read_cache_seqlens_directly(stand_in_hopper):
    call = _call(batch=2, seqlen_q=100, nheads=4, nheads_k=4, cache=(2, 4096), cache_seqlens="array")
    layouts, caches = _layouts(call, (2, 4096), 0)
    plan = api.kvcache_plan(call, layouts, caches)
    (forward,) = _launched(plan, stand_in_hopper)  # 100 query rows: the mma.sync forward's own tiles, no split, no append
    assert "/cache/" in forward and forward.startswith("forward-mma/") and "/causal/" in forward
    assert "/split" not in forward and plan.work_buffers == {}
    pointers = [8 * (i + 1) for i in range(len(api.KVCACHE_ARRAYS))]
    _without_driver(plan)
    plan.launch(pointers, 0)
    at = dict(zip(api.KVCACHE_ARRAYS, pointers))
    assert plan._structs[0][0]["size"]["seqused_k"] == at["cache_seqlens"]


@pytest.mark.parametrize("generation", [90, 80])
def test_the_forward_struct_and_its_tensor_maps(stand_in_hopper, monkeypatch, generation):
    """The forward's parameters: on Hopper with the K and V tensor maps of
    copy-engine K/V, encoded from the pointers of the k and v slots (the
    caches the append kernel writes too); before Hopper a plain ForwardParams."""
    monkeypatch.setattr(api, "_kernel_generation", lambda device: generation)
    call = _call(cache_seqlens=10, new=3)
    layouts, caches = _layouts(call, (3, 1024), 3)
    layouts["k"] = layouts["v"] = api.Layout(layouts["k"].shape[:1] + (13,) + layouts["k"].shape[2:],
                                             layouts["k"].strides, layouts["k"].itemsize)
    plan = api.kvcache_plan(call, layouts, caches)
    assert _launched(plan, stand_in_hopper)[0] == "kv-cache-append/bfloat16/cache"
    hopper = generation == 90
    assert plan._structs[-1].dtype == CACHE_APPEND_PARAMS
    assert plan._structs[0].dtype == (WGMMA_FORWARD_PARAMS if hopper else FORWARD_PARAMS)
    assert _launched(plan, stand_in_hopper)[1].endswith("/tma") == hopper
    assert [slot for slot, _ in plan._tensor_maps] == ([1, 2] if hopper else [])
    assert plan._structs[-1][0]["cache_seqlen"] == 10 and plan._structs[-1][0]["cache_seqlens"] == 0
    assert "seqused_k" not in plan.work_buffers  # one length for all: the forward's seqlen_k is 13
    encoded = []
    for _, encoder in plan._tensor_maps:
        encoder._encode = lambda *args: encoded.append(args[3].value) or 0
    _without_driver(plan)
    pointers = [1024 * (i + 1) for i in range(len(api.KVCACHE_ARRAYS))]
    plan.launch(pointers, 0)
    at = dict(zip(api.KVCACHE_ARRAYS, pointers))
    assert encoded == ([at["k"], at["v"]] if hopper else [])


def test_reference_gathers_pages_in_table_order():
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((6, 4, 1, 8))
    table = np.array([[5, 0, 3], [2, 2, 1]])
    keys = kv_cache_keys(cache, [9, 0], table)
    assert np.array_equal(keys[0], np.concatenate([cache[5], cache[0], cache[3]])[:9])
    assert keys[1].shape == (0, 1, 8)
    q = rng.standard_normal((2, 2, 2, 8))
    new = rng.standard_normal((2, 1, 1, 8))
    out, lse = attention_with_kvcache_reference(q, cache, cache, [9, 0], block_table=table, k_new=new, v_new=new,
                                                causal=True)
    expected, expected_lse = attention_reference(q[1:], new[1][None], new[1][None], causal=True)
    assert np.allclose(out[1:], expected, equal_nan=False) and np.array_equal(lse[1:], expected_lse)


@pytest.mark.parametrize("batch,nheads_k,pages,page_size,stages,form", [
    (32, 4, 64, 16, 3, "/tma"),             # 128 blocks of 16 key blocks: one an SM
    (32, 4, 256, 16, 3, "/tma"),            # 128 blocks of 64 key blocks: one an SM, any range
    (32, 4, 4, 256, 3, "/tma"),             # 256-row pages at one block an SM
    (8, 32, 64, 16, 3, "/tma"),             # 256 blocks (two an SM) of 16 key blocks: short pages
    (64, 4, 256, 16, 2, "/tma"),            # 256 blocks of 64 key blocks: short pages, long ranges
    (64, 4, 4, 256, 2, "/tma"),             # 256 blocks over 256-row pages
    (32, 32, 64, 16, 2, "/tma"),            # 1024 blocks: three buffers would cost occupancy
    (128, 4, 256, 16, 2, "/tma/cluster2"),  # 512 blocks, 1.3 waves: two ranges a cluster of two, no ring
    (1, 8, 64, 16, 2, "/cluster8"),         # clustered: fewer clusters would fit
])
def test_deeper_ring_where_the_launch_keeps_its_occupancy(stand_in_hopper, monkeypatch, batch, nheads_k, pages,
                                                          page_size, stages, form):
    monkeypatch.setattr(api, "_decode_blocks_per_sm", lambda problem, tiling: 3)
    cache = (batch * pages, page_size)
    call = _call(batch=batch, nheads=32, nheads_k=nheads_k, cache=cache, paged=pages, causal=False)
    layouts, caches = _layouts(call, cache, 0)
    plan = api.kvcache_plan(call, layouts, caches)
    (forward,) = [key for key in _launched(plan, stand_in_hopper) if key.startswith("forward-mma/")]
    assert f"/paged/kv{stages}/" in forward and forward.endswith(form), forward
