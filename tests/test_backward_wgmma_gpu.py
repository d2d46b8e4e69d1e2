"""The Hopper backward dK/dV kernel (wgmma, sm_90a): which calls take it, and
its sizes. The backward grid of test_backward_gpu.py runs through it for
float16/bfloat16 at every head dim a multiple of 8 up to 256 on Hopper, deterministic
or not (dQ added in a fixed order); the SIMT backward keeps the other
cases and (tested here with the generation pinned to sm_80) what an Ampere
GPU runs."""

import pytest

import cuflash
from cuflash import api
from cuflash._validation import check_backward, meta_of

from tests.helpers import pin_kernel_generation, pin_ordered_dq_order, random_qkv, recorded_decisions
from tests.test_backward_gpu import forward_for_backward, run_backward_and_check
from tests.test_forward_wgmma_gpu import needs_hopper

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


def _chosen(q, k, v, *, deterministic=False):
    cupy = _cupy()
    dout, out, lse = forward_for_backward(q, k, v, causal=False)
    grads = {name: cupy.empty_like(x) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    views = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    problem = check_backward(*(meta_of(name, views[name]) for name in ("dout", "q", "k", "v", "out", "lse")),
                             None, None, None, causal=False, softmax_scale=None, deterministic=deterministic)
    return api.backward_tiling_for(problem, views, grads, deterministic)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,kernel", [(8, "wgmma"), (64, "wgmma"), (80, "wgmma"), (96, "wgmma"),
                                             (104, "wgmma"), (128, "wgmma"), (160, "wgmma"), (256, "wgmma")])
def test_hopper_backward_takes_wgmma_for_its_head_dims(dtype, head_dim, kernel):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 40, 4, 2, head_dim, cupy.dtype(dtype), layout="bhsd")
    assert _chosen(q, k, v).kernel == kernel
    # Deterministic: the same kernel with dQ added in a fixed order (dq_turn).
    assert _chosen(q, k, v, deterministic=True).kernel == kernel


@needs_hopper
def test_unaligned_rows_fall_back_to_simt():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 40, 4, 2, 64, cupy.dtype("bfloat16"), layout="sliced")
    assert _chosen(q, k, v).kernel == "simt"


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (127, 129), (129, 127), (1000, 2049), (2049, 1000),
                                               (1000, 17), (17, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_wgmma_backward_sizes(dtype, head_dim, seqlen_q, seqlen_k, causal, heads):
    """Partial query and key blocks, both orders of the lengths (causal rows
    that see no key), several query blocks per key block so that the Q/dO
    buffers alternate, and query heads summed into one K/V head."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype(dtype),
                         seed=seqlen_q + 3 * seqlen_k + head_dim)
    assert _chosen(q, k, v).kernel == "wgmma"
    run_backward_and_check(q, k, v, causal=causal, seed=seqlen_q)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 40, 64, 80, 96, 128, 160, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (129, 127), (1000, 2049), (2049, 1000), (17, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_wgmma_deterministic_backward_sizes(dtype, head_dim, seqlen_q, seqlen_k, causal, heads):
    """The ordered dQ mode (deterministic=True on Hopper): the key blocks
    take turns on each dQ block, from the first that sees it; rows that see
    no key, partial blocks and query heads sharing a K/V head."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype(dtype), seed=seqlen_k + head_dim)
    assert _chosen(q, k, v, deterministic=True).kernel == "wgmma"
    run_backward_and_check(q, k, v, causal=causal, deterministic=True, seed=seqlen_q)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_deterministic_backward_is_bitwise_repeatable(head_dim, causal):
    """Ten runs, bitwise the same dq, dk, dv, on another stream too; the
    atomic mode on the same inputs is not required to be (and dq of the two
    modes agree to rounding)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 4, 2048, 2048, 16, 4, head_dim, cupy.dtype("bfloat16"), seed=head_dim)
    assert _chosen(q, k, v, deterministic=True).kernel == "wgmma"
    assert_deterministic_backward_is_bitwise_repeatable(q, k, v, causal)


@needs_hopper
@pytest.mark.parametrize("rotated", [True, False], ids=["rotated-walks", "key-block-order"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads", [(1000, 1000, (4, 4)), (2049, 1000, (6, 2)), (300, 129, (4, 1))])
def test_wgmma_deterministic_backward_in_both_orders(rotated, head_dim, seqlen_q, seqlen_k, heads, monkeypatch):
    """Ordered dQ without a mask takes one of two orders (dq_turn in
    kernels_cu/backward_steps.cuh): rotated walks where one head's key blocks
    fit on the GPU at once, key-block order where they may not (pinned here
    by the multiprocessor count the launcher sees); each is checked against
    the float64 reference and for bitwise repeatability."""
    orders = pin_ordered_dq_order(monkeypatch, rotated)
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype("bfloat16"), seed=head_dim)
    assert _chosen(q, k, v, deterministic=True).kernel == "wgmma"
    run_backward_and_check(q, k, v, causal=False, deterministic=True, seed=seqlen_k)
    assert_deterministic_backward_is_bitwise_repeatable(q, k, v, False)
    assert orders["ordered"] and set(orders["ordered"]) == {rotated}


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,rotates", [
    (1000, 1000, (4, 4), True), (2049, 1000, (6, 2), True), (129, 1000, (4, 1), False)])
def test_wgmma_atomic_backward_rotates_its_walks_without_a_mask(head_dim, seqlen_q, seqlen_k, heads, rotates,
                                                                monkeypatch):
    """The atomic mode without a mask starts key block j on query block j
    (rotate_walks) where there are at least as many query blocks as key
    blocks, and keeps the plain order where there are fewer; both against
    the float64 reference."""
    orders = pin_ordered_dq_order(monkeypatch, True)
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype("bfloat16"), seed=head_dim + 7)
    assert _chosen(q, k, v).kernel == "wgmma"
    run_backward_and_check(q, k, v, causal=False, seed=seqlen_q)
    assert orders["atomic"] and set(orders["atomic"]) == {rotates}


def _bfloat16_qkv(seqlen_q, seqlen_k, heads, head_dim):
    """Batch-2 bfloat16 q, k, v with (nheads, nheads_k) ``heads``, seeded by their sizes."""
    cupy = _cupy()
    return random_qkv(cupy, 2, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype("bfloat16"), seed=seqlen_q + head_dim)


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every array cuflash allocates for a CuPy caller (outputs and work
    buffers) comes filled with garbage: float NaN, int32 0x7f7f7f7f, the
    bytes of the work buffers' one allocation 0xff (NaN as float32). The
    Hopper backward on dense batches no longer zeroes the float32 dQ
    accumulator (stores_first_dq): each query block's first tile is written
    over it, and blocks no tile reaches must come out as zeros, not as what
    the memory held."""
    from cuflash import _interop

    original = _interop._cupy_allocator

    def poisoning(shape, dtype, device, strides=None):
        allocate = original(shape, dtype, device, strides)

        def allocate_poisoned():
            array, pointer = allocate()
            array.fill(float("nan") if array.dtype.kind == "f" else 0xFF if array.dtype.itemsize == 1 else 0x7F7F7F7F)
            return array, pointer
        return allocate_poisoned
    monkeypatch.setattr(_interop, "_cupy_allocator", poisoning)
    api.plans.clear()  # cached plans allocate with the allocator they were made with
    yield
    api.plans.clear()


@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,window,heads,claimed", [
    (2049, 1000, None, (6, 2), True),   # causal, more queries than keys: the first query blocks see no key
    (1000, 17, None, (4, 4), True),     # one key block: most query blocks see no key
    (1000, 1000, (100, 0), (4, 4), True),   # a window: each key block reaches few query blocks
    (17, 1000, None, (4, 4), False),    # every walk starts on query block 0: added into zeros
    (129, 1000, (300, 300), (4, 1), False),
])
def test_wgmma_backward_claims_each_dq_blocks_first_store(deterministic, head_dim, seqlen_q, seqlen_k, window, heads,
                                                         claimed, poisoned_allocations, monkeypatch):
    """Against the float64 reference with every allocation poisoned: in the
    claimed dQ mode (atomic dQ, causal or window masks, dense batches, at
    least as many queries as keys, head dims up to 128) a dQ block that no
    tile reaches (rows that see no key) would keep NaN, and a first tile
    added instead of stored would add it to NaN; the other modes (and head
    dim 256, which adds its tiles) add into a zeroed one."""
    decisions = recorded_decisions(monkeypatch, "stores_first_dq")
    q, k, v = _bfloat16_qkv(seqlen_q, seqlen_k, heads, head_dim)
    assert _chosen(q, k, v, deterministic=deterministic).kernel == "wgmma"
    masking = dict(causal=True) if window is None else dict(causal=False, window_size=window)
    run_backward_and_check(q, k, v, deterministic=deterministic, seed=seqlen_k, **masking)
    assert decisions == [claimed and not deterministic and head_dim <= 128]


@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,window,causal,heads", [
    (1, 1, None, False, (4, 4)),
    (17, 17, None, True, (4, 4)),
    (1000, 60, None, False, (4, 1)),     # many query blocks of one key block, grouped heads
    (127, 128, None, True, (6, 2)),      # head dim 256: two key blocks of 64
    (50, 90, (20, 5), False, (2, 2)),    # a window, fewer queries than keys
    (300, 50, None, True, (4, 4)),       # rows before the keys see none: claimed first stores instead
    (100, 1000, None, False, (4, 4)),    # many key blocks
])
@pytest.mark.parametrize("allocate", [True, False], ids=["own-dq", "given-dq"])
def test_wgmma_backward_stores_dq_directly_from_one_key_block(deterministic, head_dim, seqlen_q, seqlen_k, window,
                                                              causal, heads, allocate, poisoned_allocations,
                                                              monkeypatch):
    """Against the float64 reference with every allocation poisoned: where
    one key block reaches every query block and the call allocates dq
    (api.stores_dq_directly), the dK/dV kernel stores dQ in the input dtype
    through dq's tensor map and nothing converts it after; a tile left
    unstored, stored into the wrong rows, heads or columns, or rounded
    twice fails here. A dq the caller gives goes through the accumulator."""
    decisions = recorded_decisions(monkeypatch, "stores_dq_directly")
    q, k, v = _bfloat16_qkv(seqlen_q, seqlen_k, heads, head_dim)
    tiling = _chosen(q, k, v, deterministic=deterministic)
    assert tiling.kernel == "wgmma"
    masking = dict(causal=causal) if window is None else dict(causal=False, window_size=window)
    run_backward_and_check(q, k, v, deterministic=deterministic, seed=seqlen_k, allocate=allocate, **masking)
    reaches_every_block = window is None and not causal or seqlen_q <= seqlen_k
    assert set(decisions) == {allocate and seqlen_k <= tiling.block_n and reaches_every_block}


@needs_hopper
@pytest.mark.parametrize("head_dim", [8, 72, 104, 176, 200])
@pytest.mark.parametrize("seqlen_q,seqlen_k,causal", [(100, 60, False), (33, 40, True)])
def test_direct_dq_at_padded_head_dims(head_dim, seqlen_q, seqlen_k, causal, poisoned_allocations, monkeypatch):
    """Head dims the kernels pad (to 32, 96, 128, 192, 256): dq's map clips
    the store's last column panel at head_dim as the loads' maps zero-fill
    theirs, and out's tiles from which the kernel computes delta read zeros
    past head_dim (176: bucket 192, whose O tiles do not fit, computes delta
    in the preprocessing kernel instead); against the float64 reference
    with every allocation poisoned, the direct mode taken."""
    decisions = recorded_decisions(monkeypatch, "stores_dq_directly")
    q, k, v = _bfloat16_qkv(seqlen_q, seqlen_k, (4, 2), head_dim)
    assert _chosen(q, k, v).head_dim_padded > head_dim
    run_backward_and_check(q, k, v, causal=causal, seed=head_dim, allocate=True)
    assert set(decisions) == {True}


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_direct_dq_computes_delta_from_out_in_its_own_layout(head_dim, monkeypatch):
    """The one-key-block backward computes delta from out's tiles, read
    through a map of out's own layout, in one launch: an out with padded
    rows (a view of a wider array) gives bitwise the gradients of a
    contiguous one. An out 2 bytes off a 16-byte boundary cannot be mapped:
    its call's key differs (the aligned calls' plans are not reused for it,
    nor its plan for them), it takes the preprocessing kernel and the
    accumulated dQ, and agrees to rounding. At head dim 192 the kernel does
    not compute delta (its O tiles do not fit): the preprocessing kernel
    reads out, aligned or not, and every call stores dQ directly. Twice:
    the second round from the cached plans."""
    cupy = _cupy()
    api.plans.clear()
    decisions = recorded_decisions(monkeypatch, "stores_dq_directly")
    q, k, v = random_qkv(cupy, 2, 50, 64, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=head_dim)
    dout, out, lse = forward_for_backward(q, k, v, causal=True)
    wide = cupy.zeros(out.shape[:-1] + (head_dim + 8,), out.dtype)
    wide[..., :head_dim] = out
    padded = wide[..., :head_dim]
    storage = cupy.zeros(out.size + 8, out.dtype)
    shifted = storage[1:1 + out.size].reshape(out.shape)
    shifted[...] = out
    assert shifted.data.ptr % 16 == 2
    for _ in range(2):
        want = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
        got = cuflash.attention_backward(dout, q, k, v, padded, lse, causal=True)
        off = cuflash.attention_backward(dout, q, k, v, shifted, lse, causal=True)
        for a, b, c in zip(want, got, off):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())
            assert bool(cupy.isfinite(a.astype(cupy.float32)).all())
            cupy.testing.assert_allclose(c.astype(cupy.float32), a.astype(cupy.float32), rtol=2e-2, atol=2e-2)
    # The work buffers' decision and the plan's, once a signature (out's alignment is in the key).
    in_kernel = head_dim != 192
    assert decisions == [True] * 4 + [not in_kernel] * 2
    launches = [call.plan.kernel_count for key, call in api.plans._entries.items() if key[0] == "backward"]
    assert launches == ([1, 1, 3] if in_kernel else [2, 2, 2])


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_direct_dq_in_the_callers_axes(head_dim):
    """heads_first: dq allocated as (batch, heads, seqlen, head_dim) and
    stored there through its own tensor map; bitwise the seqlen-first call's
    gradients (one key block stores each dQ once: nothing depends on order)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 3, 77, 77, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=head_dim)
    dout, out, lse = forward_for_backward(q, k, v, causal=True)
    seqlen_first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)

    def heads_first(x):
        return cupy.ascontiguousarray(x.transpose(0, 2, 1, 3))

    grads = cuflash.attention_backward(*(heads_first(x) for x in (dout, q, k, v, out)), lse, causal=True,
                                       heads_first=True)
    for got, want in zip(grads, seqlen_first):
        assert got.flags.c_contiguous and got.shape == heads_first(want).shape
        assert bool((got.view(cupy.uint16) == heads_first(want).view(cupy.uint16)).all())


def assert_deterministic_backward_is_bitwise_repeatable(q, k, v, causal):
    """Ten deterministic backwards of bfloat16 q, k, v, alternating between
    the null stream and another: bitwise the same dq, dk, dv; dq of the
    atomic mode agrees to rounding."""
    cupy = _cupy()
    dout, out, lse = forward_for_backward(q, k, v, causal=causal)

    def bits(grads):
        return [g.view(cupy.uint16).copy() for g in grads]

    first = bits(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True))
    stream = cupy.cuda.Stream(non_blocking=True)
    for run in range(9):
        with stream if run % 2 else cupy.cuda.Stream.null:
            again = bits(cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True))
        stream.synchronize()
        for a, b in zip(first, again):
            assert bool((a == b).all())
    atomic = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    difference = cupy.abs(atomic[0].astype(cupy.float32) - first[0].view(cupy.dtype("bfloat16")).astype(cupy.float32))
    assert float(difference.max()) <= 0.02 * float(cupy.abs(atomic[0].astype(cupy.float32)).max())


@pytest.mark.parametrize("dtype,head_dim", [("float32", 64), ("bfloat16", 20), ("float16", 130), ("float32", 200)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (1000, 1000), (300, 129)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_simt_backward_where_no_tensor_core_kernel_applies(dtype, head_dim, seqlen_q, seqlen_k, causal, monkeypatch):
    """The SIMT backward (atomic dQ) as an Ampere GPU runs it where the
    mma.sync backward does not apply: float32, head dims not a multiple of 8."""
    pin_kernel_generation(monkeypatch, 80)
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, head_dim, cupy.dtype(dtype), seed=head_dim + 1)
    assert _chosen(q, k, v).kernel == "simt"
    run_backward_and_check(q, k, v, causal=causal, seed=5)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 40, 48, 56, 72, 80, 88, 104, 112, 120, 136, 160, 200, 248])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_backward_padded_head_dims(dtype, head_dim, causal):
    """Head dims below their bucket (32, 64, 96, 128, 192 or 256): padded columns add nothing
    to S^T and dP^T, and dQ, dK, dV are written only up to head_dim. 40, 48, 72, 80, 104 and
    112 run the products narrowed to 48, 80 or 112 columns (wgmma_product_dim)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 300, 257, 4, 2, head_dim, cupy.dtype(dtype), seed=head_dim)
    tiling = _chosen(q, k, v)
    assert tiling.kernel == "wgmma"
    assert tiling.product_dim == {40: 48, 48: 48, 72: 80, 80: 80, 104: 112, 112: 112}.get(head_dim, 0)
    run_backward_and_check(q, k, v, causal=causal, seed=head_dim)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
def test_wgmma_backward_on_packed_qkv_views(dtype, head_dim, deterministic):
    """Q, K and V as views into one packed (batch, seqlen, 3, heads, dim)
    buffer (a fused QKV projection): the backward's tensor maps of Q, K, V
    and dO step by the views' strides, and its dQ tiles are added into the
    accumulator by its own map, whatever the inputs' layout."""
    import numpy as np

    cupy = _cupy()
    rng = np.random.default_rng(head_dim)
    packed = cupy.asarray(rng.standard_normal((2, 301, 3, 4, head_dim)).astype(np.float32)).astype(dtype)
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    assert _chosen(q, k, v).kernel == "wgmma"
    run_backward_and_check(q, k, v, causal=True, deterministic=deterministic, seed=head_dim)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_backward_encodes_maps_for_each_calls_arrays(head_dim):
    """Backward calls of one signature share a plan; each call's Q, K, V, dO
    and work buffers must be used, not the first call's (the maps are
    encoded again for each new pointer)."""
    cupy = _cupy()
    api.plans.clear()
    first = random_qkv(cupy, 2, 200, 300, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=1)
    second = random_qkv(cupy, 2, 200, 300, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=2)
    run_backward_and_check(*first, causal=False, seed=1)
    plans_after_first = len(api.plans)
    run_backward_and_check(*second, causal=False, seed=2)
    run_backward_and_check(first[0], second[1], first[2], causal=False, seed=3)  # a new K alone
    assert len(api.plans) == plans_after_first  # one signature per pass, one plan each
