"""The Hopper forward (wgmma, sm_90a): which inputs take it, and its building
blocks on their own.

The probe kernel below runs one warpgroup through the matrix primitives
flash_fwd_wgmma.cu composes (swizzled tiles, both descriptor kinds, ss and
rs wgmma, the accumulator layout) and compares with NumPy, so a layout
mistake shows up here as a wrong matrix product rather than only as a wrong
attention output. The kernel fills the same tiles by tensor maps; the tests
after the probe run it on the layouts and strides those maps must describe. The forward grid of test_forward_gpu.py runs through the
kernel itself (float16/bfloat16, every head dim a multiple of 8 up to 256) on Hopper."""

import dataclasses
import numpy as np
import pytest

from cuflash import api
from cuflash._loader import builds_sm90a, compile_options, kernel_source_dir, _nvrtc_version
from cuflash._validation import check_forward, check_variants, meta_of

from tests.helpers import random_qkv
from tests.test_forward_gpu import run_and_check

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


def _hopper() -> bool:
    """An sm_90 GPU and an NVRTC that builds sm_90a; False where there is no
    GPU at all (CI), so that the skip condition itself never fails."""
    try:
        return _cupy().cuda.Device().compute_capability == "90" and builds_sm90a()
    except Exception:
        return False


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and NVRTC >= 12.9 (the wgmma forward)")

_PROBE = r"""
#include "async_copy.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
using namespace cuflash;

// One warpgroup: S = A B^T (A: 64 x kD, B: kN x kD, both K-major from
// shared memory), then O = round(S) V (S from registers, V: kN x kD read
// MN-major). Outputs are row-major float32.
template <typename Element, int kN, int kD, int kSwizzleBytes>
__global__ void wgmma_probe(const Element* a, const Element* b, const Element* v, float* s_out, float* o_out) {
    using ATile = SwizzledTile<64, kD, kSwizzleBytes>;
    using BTile = SwizzledTile<kN, kD, kSwizzleBytes>;
    extern __shared__ __align__(16) unsigned char raw[];
    const u32 base = (shared_address(raw) + 1023) & ~1023u;
    const u32 a_smem = base, b_smem = base + ATile::kBytes, v_smem = b_smem + BTile::kBytes;
    const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
    load_swizzled_tile_async<ATile, 128>(a_smem, a, kD, 64, kD, thread);
    load_swizzled_tile_async<BTile, 128>(b_smem, b, kD, kN, kD, thread);
    load_swizzled_tile_async<BTile, 128>(v_smem, v, kD, kN, kD, thread);
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();

    float s[kN / 2];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
        Wgmma<Element, kN>::ss(s, kmajor_descriptor<ATile>(base, a_smem - base) + kmajor_k_step<ATile>(ks),
                               kmajor_descriptor<BTile>(base, b_smem - base) + kmajor_k_step<BTile>(ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(s);

    const int row = warp * 16 + lane / 4, col = 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s_out[(row + e / 2 * 8) * kN + 8 * j + col + e % 2] = s[4 * j + e];
        }
    }
    u32 p[kN / 16][4];
#pragma unroll
    for (int ps = 0; ps < kN / 16; ++ps) {
        p[ps][0] = pack_pair<Element>(s[8 * ps + 0], s[8 * ps + 1]);
        p[ps][1] = pack_pair<Element>(s[8 * ps + 2], s[8 * ps + 3]);
        p[ps][2] = pack_pair<Element>(s[8 * ps + 4], s[8 * ps + 5]);
        p[ps][3] = pack_pair<Element>(s[8 * ps + 6], s[8 * ps + 7]);
    }
    float o[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (int ps = 0; ps < kN / 16; ++ps) {
        const u64 v_step = mn_major_descriptor<BTile>(base, v_smem - base) + mn_major_k_step<BTile>(ps);
        Wgmma<Element, kD>::rs(o, p[ps], v_step, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    pin_registers(o);
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            o_out[(row + e / 2 * 8) * kD + 8 * j + col + e % 2] = o[4 * j + e];
        }
    }
}
"""


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n,d,swizzle", [(64, 64, 128), (128, 64, 128), (64, 128, 128), (128, 128, 128),
                                         (64, 96, 64), (128, 96, 32), (48, 96, 64), (64, 192, 128),
                                         (48, 256, 128), (64, 48, 32), (128, 128, 64), (64, 32, 64)])
def test_wgmma_probe_matches_numpy(dtype, n, d, swizzle):
    """Every swizzle mode (128, 64, 32 bytes), every N of the Wgmma table,
    K-major and MN-major operands spanning several panels."""
    cupy = _cupy()
    element = {"float16": "__half", "bfloat16": "__nv_bfloat16"}[dtype]
    name = f"wgmma_probe<{element}, {n}, {d}, {swizzle}>"
    options = compile_options(kernel_source_dir(), "90", _nvrtc_version())
    module = cupy.RawModule(code=_PROBE, options=options, name_expressions=[name])
    kernel = module.get_function(name)
    rng = np.random.default_rng(n + d)
    a64, b64, v64 = (rng.standard_normal(shape) for shape in ((64, d), (n, d), (n, d)))
    a, b, v = (cupy.asarray(x.astype(np.float32)).astype(cupy.dtype(dtype)) for x in (a64, b64, v64))
    s_out = cupy.full((64, n), cupy.nan, dtype=cupy.float32)
    o_out = cupy.full((64, d), cupy.nan, dtype=cupy.float32)
    smem = 1024 + (64 + 2 * n) * d * 2
    kernel.max_dynamic_shared_size_bytes = smem
    kernel((1,), (128,), (a, b, v, s_out, o_out), shared_mem=smem)
    af, bf, vf = (x.astype(cupy.float32).get().astype(np.float64) for x in (a, b, v))
    s_ref = af @ bf.T
    s_got = s_out.get()
    assert not np.isnan(s_got).any()
    np.testing.assert_allclose(s_got, s_ref, rtol=1e-5, atol=1e-4)
    p = cupy.asarray(s_got).astype(cupy.dtype(dtype)).astype(cupy.float32).get().astype(np.float64)
    o_got = o_out.get()
    assert not np.isnan(o_got).any()
    np.testing.assert_allclose(o_got, p @ vf, rtol=1e-5, atol=1e-3)


def _chosen(q, k, v):
    out = _cupy().empty_like(q)
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), meta_of("out", out), causal=False,
                            softmax_scale=None)
    return api.forward_tiling_for(problem, (q, k, v, out))


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,kernel", [(8, "wgmma"), (64, "wgmma"), (72, "wgmma"), (96, "wgmma"),
                                             (104, "wgmma"), (128, "wgmma"), (160, "wgmma"), (256, "wgmma")])
def test_hopper_takes_wgmma_for_its_head_dims(dtype, head_dim, kernel):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 40, 4, 2, head_dim, cupy.dtype(dtype), layout="bhsd")
    tiling = _chosen(q, k, v)
    assert tiling.kernel == kernel
    assert tiling.head_dim_padded >= head_dim


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (127, 129), (129, 127), (1000, 2049), (2049, 1000),
                                               (4096, 4096)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_forward_sizes(dtype, head_dim, seqlen_q, seqlen_k, causal):
    """Partial query and key blocks, both orders of the sequence lengths,
    several key blocks so that the double-buffered K/V alternate and the
    P V of one block overlaps the softmax of the next."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, seqlen_q, seqlen_k, 4, 2, head_dim, cupy.dtype(dtype),
                         seed=seqlen_q + seqlen_k + head_dim)
    assert _chosen(q, k, v).kernel == "wgmma"
    run_and_check(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 24, 40, 48, 56, 72, 80, 104, 112, 120, 136, 160, 200, 248])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_forward_padded_head_dims(dtype, head_dim, causal):
    """Head dims below their bucket (32, 64, 96, 128, 192, 256): the padded columns are
    zero-filled on the way in and never written out (8, 24, 40, 56 on their
    buckets' 128-row tiles); 40, 48, 72, 80, 104 and 112 run the products
    narrowed to 48, 80 or 112 columns (wgmma_product_dim), the Q tile's
    columns past them left as they came."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 300, 257, 4, 2, head_dim, cupy.dtype(dtype), seed=head_dim)
    tiling = _chosen(q, k, v)
    assert tiling.kernel == "wgmma"
    assert tiling.product_dim == {40: 48, 48: 48, 72: 80, 80: 80, 104: 112, 112: 112}.get(head_dim, 0)
    run_and_check(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_wgmma_forward_on_packed_qkv_views(dtype, head_dim):
    """Q, K and V as views into one packed (batch, seqlen, 3, heads, dim)
    buffer, the layout of a fused QKV projection: every stride differs from a
    dense array's, and the tensor maps must step by them."""
    cupy = _cupy()
    rng = np.random.default_rng(head_dim)
    packed = cupy.asarray(rng.standard_normal((3, 257, 3, 4, head_dim)).astype(np.float32)).astype(dtype)
    q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    assert _chosen(q, k, v).kernel == "wgmma"
    run_and_check(q, k, v, causal=True)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_forward_encodes_maps_for_each_calls_arrays(head_dim):
    """Calls of one signature share a plan and its parameter struct; each
    call's Q, K and V must be read, not the first call's (the maps are
    encoded again for a new pointer)."""
    cupy = _cupy()
    api.plans.clear()
    first = random_qkv(cupy, 2, 200, 300, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=1)
    second = random_qkv(cupy, 2, 200, 300, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=2)
    run_and_check(*first, causal=False)
    plans_after_first = len(api.plans)
    run_and_check(*second, causal=False)
    mixed = (first[0], second[1], first[2])  # a new K alone
    run_and_check(*mixed, causal=False)
    assert len(api.plans) == plans_after_first  # one signature, one plan


def _offset_copy(cupy, array, offset):
    """``array``'s values in a contiguous array that starts ``offset``
    elements into a larger NaN-filled allocation (its first elements stay NaN)."""
    flat = cupy.full(array.size + offset, cupy.nan, dtype=array.dtype)
    view = flat[offset:].reshape(array.shape)
    view[...] = array
    return view, flat


@needs_hopper
@pytest.mark.parametrize("head_dim", [8, 16, 24, 48, 64, 72, 104, 112, 200])
@pytest.mark.parametrize("offsets", [(0, 0, 0, 0), (0, 8, 0, 0), (8, 0, 8, 8), (8, 8, 0, 8)],
                         ids=["aligned", "k", "q-v-out", "q-k-out"])
@pytest.mark.parametrize("walk", ["persistent-full", "persistent-causal", "window"])
def test_wgmma_forward_rows_that_start_mid_sector(head_dim, offsets, walk):
    """Heads whose rows start 16 bytes into a 32-byte sector: the kernel's
    copies then start 8 columns before the head (sector_aligned_shift in
    tma.cuh; the columns before it arrive as zeros), Q's by K's choice and
    the output's by V's. Head dims 8, 24, 72, 104, 200 (rows ending mid-sector)
    put every other head there; an array starting 8 elements (16 bytes)
    into its allocation moves every head (``offsets``: q, k, v, out), so K
    and V, and Q and K, differ. Head dim 16 has room in its 32-column tile
    for the shift; 64 has none, nor have 48 and 112, whose products stop
    at their own width (wgmma_product_dim): their misaligned heads keep
    their columns. 72 and 104 shift within their narrowed 80 and 112.
    Grouped-query (4 heads on 2), persistent blocks (the output stored by
    the copy engine) and one tile a block (a window mask: rows stored by
    the warps), outputs in a poisoned allocation, against float64."""
    import cuflash
    from cuflash._tiling import wgmma_forward_for_call
    from cuflash.reference import attention_reference
    from tests.helpers import assert_lse_close, assert_output_accurate, naive_attention_same_precision

    cupy = _cupy()
    seqlen = 600
    q, k, v = random_qkv(cupy, 2, seqlen, seqlen, 4, 2, head_dim, cupy.dtype("bfloat16"), seed=head_dim + sum(offsets))
    (q, _), (k, _), (v, _) = (_offset_copy(cupy, x, offset) for x, offset in zip((q, k, v), offsets))
    out, out_allocation = _offset_copy(cupy, cupy.full(q.shape, cupy.nan, dtype=q.dtype), offsets[3])
    assert [x.data.ptr % 32 for x in (q, k, v, out)] == [2 * offset for offset in offsets]
    kwargs = {"causal": walk == "persistent-causal", "window_size": (150, 40) if walk == "window" else (-1, -1)}
    problem = check_variants(check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), meta_of("out", out),
                                           causal=kwargs["causal"], softmax_scale=None),
                             window_size=kwargs["window_size"])
    table = api.forward_tiling_for(problem, (q, k, v, out), aligned=True)
    assert table.kernel == "wgmma"
    chosen = wgmma_forward_for_call(table, "bfloat16", head_dim, problem.mask.name, "dense", False, seqlen)
    assert chosen.persistent == walk.startswith("persistent")
    lse = cupy.full((2, 4, seqlen), cupy.nan, dtype=cupy.float32)
    cuflash.attention(q, k, v, out=out, lse=lse, return_lse=True, **kwargs)
    assert bool(cupy.isnan(out_allocation[:offsets[3]]).all()), "the forward wrote before out"
    scale = head_dim ** -0.5
    ref_out, ref_lse = attention_reference(q, k, v, softmax_scale=scale, **kwargs)
    assert_output_accurate(out, ref_out, naive_attention_same_precision(q, k, v, softmax_scale=scale, **kwargs))
    assert_lse_close(lse, ref_lse)


@needs_hopper
@pytest.mark.parametrize("head_dim", [8, 24, 40, 56, 72, 104])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("seqlen", [300, 1100])
def test_wgmma_forward_head_pairs_keep_neighbours_apart(head_dim, causal, value, seqlen):
    """Rows that end mid-sector with an even head count: K and V are copied
    through head-pair maps that bring 8 columns of the neighbouring head
    (params.cuh), on the 192-row tile (8-56 at 1100 keys) and the 128-row
    one (72, 104; 8-56 at 300 keys, their short-sequence tile). A
    non-finite value there must not reach the other head:
    head 1's first 8 K and V columns and head 2's last 8 are poisoned, which
    heads 0 and 3 read beside their own; their outputs must match float64
    (without the zeroing of K's neighbour columns they are NaN)."""
    import cuflash
    from cuflash.reference import attention_reference
    from tests.helpers import assert_output_accurate, naive_attention_same_precision

    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen, seqlen, 4, 4, head_dim, cupy.dtype("bfloat16"), seed=head_dim + causal)
    assert k.data.ptr % 32 == 0 and v.data.ptr % 32 == 0
    for x in (k, v):
        x[:, 5, 1, :8] = value
        x[:, 7, 2, -8:] = value
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    cuflash.attention(q, k, v, causal=causal, out=out)
    scale = head_dim ** -0.5
    heads = [0, 3]
    ref_out, _ = attention_reference(q[:, :, heads], k[:, :, heads], v[:, :, heads], causal=causal,
                                     softmax_scale=scale)
    assert_output_accurate(out[:, :, heads], ref_out, naive_attention_same_precision(
        q[:, :, heads], k[:, :, heads], v[:, :, heads], causal=causal, softmax_scale=scale))


@needs_hopper
def test_negative_strides_take_a_kernel_without_tensor_maps():
    """A reversed view has negative strides, which a tensor map cannot
    describe: such a call runs on another kernel, with the same results."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 130, 140, 2, 2, 64, cupy.dtype("float16"), seed=3)
    q = q[:, ::-1]
    assert _chosen(q, k, v).kernel != "wgmma"
    run_and_check(q, k, v, causal=False)


@needs_hopper
@pytest.mark.parametrize("head_dim,tile", [
    (64, (64, 128, 8, 2)),     # one consumer warpgroup (no turns), two blocks per SM
    (64, (192, 96, 16, 1)),    # three consumers taking turns, key blocks of 96
    (64, (64, 64, 8, 3)),      # three blocks per SM (d64 causal, short sequences)
    (64, (128, 128, 12, 1)),   # two consumers taking turns
    (32, (64, 128, 8, 2)),
    (128, (64, 64, 8, 2)),     # one consumer, two blocks per SM at head dim 128
    (256, (128, 32, 12, 1)),   # narrow key blocks: many ring passes per query block
    (128, (128, 128, 12, 1, 2)),  # a ring of two K/V buffers (the table's tile takes three)
    (64, (128, 64, 12, 1, 2)),
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_forward_other_tiles(head_dim, tile, causal):
    """Tiles the table may take (measured candidates, docs/perf-notes.md),
    run through a plan made with them, against float64: the number of
    consumer warpgroups (1 skips the turns), blocks per SM (the register
    budget setmaxnreg moves), key-block widths and the K/V ring's stages (the
    most that fit, or the fifth entry) all change the pipeline."""
    from cuflash._tiling import Tiling, with_wgmma_forward_stages
    from cuflash.reference import attention_reference
    from tests.helpers import assert_lse_close, assert_output_accurate, naive_attention_same_precision

    cupy = _cupy()
    block_m, block_n, warps, blocks_per_sm = tile[:4]
    tiling = with_wgmma_forward_stages(Tiling(head_dim_padded=head_dim, block_m=block_m, block_n=block_n,
                                              warps=warps, kernel="wgmma", blocks_per_sm=blocks_per_sm), "bfloat16")
    if len(tile) > 4:
        tiling = dataclasses.replace(tiling, kv_stages=tile[4])
    q, k, v = random_qkv(cupy, 2, 333, 517, 4, 2, head_dim, cupy.dtype("bfloat16"), layout="bhsd",
                         seed=head_dim + block_m)
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), None, causal=causal,
                            softmax_scale=None)
    out = cupy.full((2, 333, 4, head_dim), cupy.nan, dtype=q.dtype)
    lse = cupy.full((2, 4, 333), cupy.nan, dtype=cupy.float32)
    layouts = {name: api.Layout.of(x) for name, x in (("q", q), ("k", k), ("v", v), ("out", out))}
    plan = api.forward_plan(problem, layouts, aligned=True, tiling=tiling)
    plan.launch([q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr],
                cupy.cuda.get_current_stream().ptr)
    scale = head_dim ** -0.5
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    assert_output_accurate(out, ref_out, naive_attention_same_precision(q, k, v, causal=causal, softmax_scale=scale))
    assert_lse_close(lse, ref_lse)


@needs_hopper
@pytest.mark.parametrize("head_dim,tile", [(64, "table"), (64, (64, 128, 8, 2)), (64, (64, 64, 8, 3)),
                                           (128, "table"), (24, "table")])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_wgmma_forward_persistent_blocks_walk_many_tiles(head_dim, tile, mask):
    """Persistent blocks (one per resident slot) walking several query tiles
    each, unevenly (more steps than slots, not a multiple of them): Q in two
    buffers, the K/V rings running on across tiles, the output staged in each
    tile's own Q buffer. The launcher takes this form without a mask and
    causal; causal walks tiles in pairs of a long and a short one (23 tiles
    a head at d128: the middle tile alone); the kernel is the same for any
    mask, so a window checks tiles whose walks differ otherwise. d64 runs
    persistent blocks of all its tiles (three consumers of 192 rows; one of
    64 over 128 keys at two blocks an SM, or over 64 at three, for short
    sequences), and so does d24 (rows ending mid-sector: the 192-row tile
    reading K and V through head-pair maps)."""
    from cuflash._tiling import wgmma_forward_persistent, wgmma_forward_short_tiles, wgmma_forward_tiling
    from cuflash.reference import attention_reference
    from tests.helpers import assert_lse_close, assert_output_accurate, naive_attention_same_precision

    cupy = _cupy()
    chosen = wgmma_forward_tiling("bfloat16", head_dim)
    if tile != "table":
        # (a tile may serve under several rules: d64's 64 x 64 for causal and no mask)
        chosen = next(t for t in wgmma_forward_short_tiles("bfloat16", head_dim)
                      if (t.block_m, t.block_n, t.warps, t.blocks_per_sm) == tile)
    tiling = wgmma_forward_persistent(chosen, "bfloat16", "none", "dense")
    assert tiling.persistent
    batch, seqlen, heads = 3, 2900, 12
    q, k, v = random_qkv(cupy, batch, seqlen, seqlen, heads, heads, head_dim, cupy.dtype("bfloat16"),
                         seed=head_dim + len(mask))
    window = (300, 20) if mask == "window" else None
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), None, causal=mask == "causal",
                            softmax_scale=None)
    if window:
        problem = check_variants(problem, window_size=window)
    assert problem.mask.name == mask
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    lse = cupy.full((batch, heads, seqlen), cupy.nan, dtype=cupy.float32)
    layouts = {name: api.Layout.of(x) for name, x in (("q", q), ("k", k), ("v", v), ("out", out))}
    plan = api.forward_plan(problem, layouts, aligned=True, tiling=tiling)
    per_head = -(-seqlen // tiling.block_m)
    tiles = batch * heads * per_head
    steps = batch * heads * -(-per_head // 2) if mask == "causal" else tiles  # causal: units of two tiles
    grid = plan._launches[0][1]
    assert grid < steps and steps % grid, (grid, steps)
    plan.launch([q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr], cupy.cuda.get_current_stream().ptr)
    kwargs = {"causal": mask == "causal", "softmax_scale": head_dim ** -0.5}
    if window:
        kwargs["window_size"] = window
    ref_out, ref_lse = attention_reference(q, k, v, **kwargs)
    assert_output_accurate(out, ref_out, naive_attention_same_precision(q, k, v, **kwargs))
    assert_lse_close(lse, ref_lse)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_forward_persistent_stores_exactly_out(head_dim, causal):
    """Persistent blocks store their output rows with the copy engine
    (out_map): into an ``out`` that is a strided view of a larger poisoned
    buffer (an offset row, head and column range), every element of the
    view gets the float64 reference's value and nothing outside it is
    written, at a length whose last tile runs past the sequence (1000 rows)
    and where head_dim 80 leaves padded columns the map must clip."""
    import cuflash
    from cuflash._tiling import wgmma_forward_for_call
    from cuflash.reference import attention_reference
    from tests.helpers import assert_output_accurate, naive_attention_same_precision

    cupy = _cupy()
    batch, seqlen, heads = 2, 1000, 4
    q, k, v = random_qkv(cupy, batch, seqlen, seqlen, heads, heads, head_dim, cupy.dtype("bfloat16"),
                         seed=head_dim + causal)
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), None, causal=causal,
                            softmax_scale=None)
    table = api.forward_tiling_for(problem, [q, k, v, q], aligned=True)  # out: q's layout
    assert table.kernel == "wgmma" and wgmma_forward_for_call(table, "bfloat16", head_dim, problem.mask.name,
                                                               "dense", False, seqlen).persistent
    buffer = cupy.full((batch, seqlen + 3, heads + 1, head_dim + 8), cupy.nan, dtype=q.dtype)
    out = buffer[:, 2:2 + seqlen, 1:, 8:]
    cuflash.attention(q, k, v, causal=causal, out=out)
    cupy.cuda.get_current_stream().synchronize()
    outside = cupy.ones(buffer.shape, dtype=bool)
    outside[:, 2:2 + seqlen, 1:, 8:] = False
    assert bool(cupy.isnan(buffer[outside]).all()), "the forward wrote outside out"
    ref_out, _ = attention_reference(q, k, v, causal=causal, softmax_scale=head_dim ** -0.5)
    assert_output_accurate(out, ref_out, naive_attention_same_precision(q, k, v, causal=causal,
                                                                        softmax_scale=head_dim ** -0.5))


@needs_hopper
@pytest.mark.parametrize("head_dim,seqlen_q,seqlen_k,consumers", [(64, 1100, 300, 1), (128, 1100, 300, 2),
                                                                   (64, 2600, 2100, 3)])
def test_wgmma_forward_persistent_walks_tiles_that_see_no_key(head_dim, seqlen_q, seqlen_k, consumers):
    """Causal with more queries than keys (bottom-right aligned): the first
    tiles of every head see no key. Persistent blocks walk them between
    tiles that do, so a walk mixes tiles that take no ping-pong turn and
    free their Q buffer at once with tiles whose turns run on across tiles
    and whose Q buffer is freed at the next tile's first S (one, two and
    three consumer warpgroups). Rows that see no
    key get output 0 and log-sum-exp -inf, the others the float64
    reference; out and lse start as NaN."""
    import cuflash
    from cuflash._tiling import wgmma_forward_for_call
    from cuflash.reference import attention_reference
    from tests.helpers import assert_lse_close, assert_output_accurate, naive_attention_same_precision

    cupy = _cupy()
    batch, heads = 3, 12
    q, k, v = random_qkv(cupy, batch, seqlen_q, seqlen_k, heads, heads, head_dim, cupy.dtype("bfloat16"),
                         seed=head_dim + 5)
    problem = check_forward(meta_of("q", q), meta_of("k", k), meta_of("v", v), None, causal=True,
                            softmax_scale=None)
    table = api.forward_tiling_for(problem, [q, k, v, q], aligned=True)
    tiling = wgmma_forward_for_call(table, "bfloat16", head_dim, "causal", "dense", False, seqlen_k)
    assert tiling.persistent and tiling.warps // 4 - 1 == consumers  # one producer warpgroup
    assert (seqlen_q - seqlen_k) // tiling.block_m >= 2  # whole tiles without a key in every head
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    lse = cupy.full((batch, heads, seqlen_q), cupy.nan, dtype=cupy.float32)
    cuflash.attention(q, k, v, causal=True, out=out, lse=lse, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    scale = head_dim ** -0.5
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, softmax_scale=scale)
    assert bool((out[:, :seqlen_q - seqlen_k] == 0).all())
    assert_output_accurate(out, ref_out, naive_attention_same_precision(q, k, v, causal=True, softmax_scale=scale))
    assert_lse_close(lse, ref_lse)


def _scores_along_keys(cupy, q, k, key_scores, scale):
    """Rewrites q and k (in place) so that every query row's score against key
    j is key_scores[j] (natural units, after the softmax scale) plus a small
    random term: q's first column 1, the rest small; k's first column
    key_scores / scale."""
    rng = np.random.default_rng(7)
    q[...] = cupy.asarray(0.05 * rng.standard_normal(q.shape)).astype(q.dtype)
    q[..., 0] = 1
    k[...] = cupy.asarray(0.05 * rng.standard_normal(k.shape)).astype(k.dtype)
    k[..., 0] = cupy.asarray(key_scores / scale)[None, :, None].astype(k.dtype)


@needs_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pattern", ["rising", "plateau"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_wgmma_forward_softmax_paths(dtype, head_dim, pattern, causal):
    """The forward's two softmax paths (FragmentOnlineSoftmax.update_and_pack):
    key blocks are visited from the last to the first, so
    - "rising": scores grow toward the first keys, by several times the
      reference's slack (8 in log2 units) over the walk: a row's reference
      moves again and again, and O is rescaled mid-walk;
    - "plateau": the last keys score 3 (natural units; 4.3 in log2) below
      all others: after the first block every p is about 2^4.3, so a lane's
      block sum passes the fast path's bound (2^8) although no score passes
      the slack: the warp takes the maxima's path, which moves the reference
      up by less than the slack (and the next blocks return to the fast
      path).
    Random data, whose scores stay within a few units, takes the fast path
    almost always; these two are the inputs where it must give way."""
    cupy = _cupy()
    seqlen = 1000
    q, k, v = random_qkv(cupy, 1, seqlen, seqlen, 2, 2, head_dim, cupy.dtype(dtype), seed=head_dim)
    scale = head_dim ** -0.5
    if pattern == "rising":
        key_scores = np.linspace(40.0, 0.0, seqlen)
    else:
        key_scores = np.where(np.arange(seqlen) >= seqlen - 200, -3.0, 0.0)
    _scores_along_keys(cupy, q, k, key_scores, scale)
    assert _chosen(q, k, v).kernel == "wgmma"
    run_and_check(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("where", ["first visited", "later"])
def test_wgmma_forward_nan_score_propagates(head_dim, where):
    """A NaN key makes every row that sees it NaN, as in float64: the fast
    path's bound comparison fails on a NaN sum and the maxima's path keeps
    exp2(NaN) = NaN (no clamp drops it). The key sits in the first visited
    (last) key block, or in a later one where the fast path runs."""
    cupy = _cupy()
    seqlen = 700
    q, k, v = random_qkv(cupy, 1, seqlen, seqlen, 2, 2, head_dim, cupy.dtype("bfloat16"), seed=3)
    key = seqlen - 5 if where == "first visited" else 10
    k[0, key, 1, 3] = cupy.nan
    out = cupy.full(q.shape, 0.0, dtype=q.dtype)
    cuflash_out = api.attention(q, k, v, out=out)
    got = cupy.asnumpy(cuflash_out.astype(cupy.float32))
    assert np.isnan(got[0, :, 1]).all()
    assert not np.isnan(got[0, :, 0]).any()
