"""The tile tables and the kernel-family registry, and their agreement with
the C++ side (each family's traits and the parameter structs), checked by
compiling a host program with nvcc: no GPU."""

import dataclasses
import re
import subprocess

import numpy as np
import pytest

from cuflash._kernel_families import CXX_ELEMENT_TYPE, FAMILIES, FAMILY, family_of, select
from cuflash._loader import kernel_source_dir
from cuflash._masks import MASKS
from cuflash._params import (
    BACKWARD_PARAMS,
    FORWARD_PARAMS,
    MERGE_PARAMS,
    CACHE_APPEND_PARAMS,
    WGMMA_BACKWARD_PARAMS,
    WGMMA_FORWARD_PARAMS,
    flat_fields,
)
from cuflash._tiling import (
    ELEMENT_SIZE,
    HEAD_DIM_BUCKETS,
    MAX_SMEM_BYTES,
    MMA_BACKWARD_99KIB_TILES,
    MMA_BACKWARD_TILES,
    MMA_DTYPES,
    MMA_3XTF32_FORWARD_TILES,
    MMA_FORWARD_TILES,
    WGMMA_PRODUCT_DIMS,
    WGMMA_BACKWARD_TILES,
    WGMMA_FORWARD_PARTIAL_SECTOR_TILES,
    WGMMA_FORWARD_TILES,
    Tiling,
    wgmma_direct_computes_delta,
    wgmma_product_dim,
    backward_splits_head_dim,
    backward_tiling,
    copy_engine_layouts,
    forward_tiling,
    mma_applies,
    mma_forward_applies,
    mma_forward_tiling,
    pad_head_dim,
    mma_backward_applies,
    mma_backward_99kib_tiling,
    mma_backward_tiling,
    wgmma_backward_applies,
    wgmma_backward_swizzles,
    wgmma_backward_tiling,
    wgmma_forward_applies,
    wgmma_forward_tiling,
)
from tests.helpers import needs_nvcc

VARIANTS = [(dtype, padded) for dtype in ELEMENT_SIZE for padded in HEAD_DIM_BUCKETS]


@pytest.mark.parametrize("head_dim", range(1, 257))
def test_pad_head_dim_is_smallest_bucket(head_dim):
    padded = pad_head_dim(head_dim)
    assert padded >= head_dim and padded in HEAD_DIM_BUCKETS
    assert all(bucket < head_dim for bucket in HEAD_DIM_BUCKETS if bucket < padded)


def test_pad_head_dim_rejects_more_than_256():
    for head_dim in (257, 1024):
        with pytest.raises(ValueError, match="head_dim must be at most 256"):
            pad_head_dim(head_dim)


def _lane_group(lanes):
    return lanes >= 1 and lanes <= 32 and lanes & (lanes - 1) == 0


@pytest.mark.parametrize("dtype,padded", VARIANTS)
def test_forward_table_respects_kernel_constraints(dtype, padded):
    tiling = forward_tiling(dtype, padded)
    lanes_per_row = tiling.threads // tiling.block_m
    assert tiling.threads % tiling.block_m == 0 and _lane_group(lanes_per_row)
    assert tiling.block_n % lanes_per_row == 0
    assert padded // lanes_per_row <= 32  # output accumulator per lane stays small
    assert tiling.forward_smem_bytes(dtype) <= MAX_SMEM_BYTES
    assert tiling.backward_dq_smem_bytes(dtype) <= MAX_SMEM_BYTES


@pytest.mark.parametrize("dtype,padded", VARIANTS)
def test_backward_table_respects_kernel_constraints(dtype, padded):
    tiling = backward_tiling(dtype, padded)
    lanes_per_key = tiling.threads // tiling.block_n
    lanes_per_row = tiling.threads // tiling.block_m
    assert _lane_group(lanes_per_key) and _lane_group(lanes_per_row)
    assert tiling.block_m % lanes_per_key == 0
    assert padded // lanes_per_key <= 32  # dK and dV accumulators per lane
    assert tiling.backward_dkdv_smem_bytes(dtype) <= MAX_SMEM_BYTES


def test_unknown_dtype_is_rejected():
    for table in (forward_tiling, backward_tiling):
        with pytest.raises(ValueError, match="dtype must be one of"):
            table("float64", 64)


def _run_host_program(tmp_path, body: str, extra_include: str | None = None) -> list[str]:
    source = tmp_path / "probe.cu"
    extra = f'#include "{extra_include}"\n' if extra_include else ""
    source.write_text(
        "#include <cstdio>\n#include <cstddef>\n"
        '#include "simt_traits.cuh"\n#include "tensor_core_traits.cuh"\n#include "params.cuh"\n' + extra +
        f"int main() {{\n{body}\nreturn 0;\n}}\n"
    )
    binary = tmp_path / "probe"
    subprocess.run(
        ["nvcc", "-std=c++17", f"-I{kernel_source_dir()}", str(source), "-o", str(binary)],
        check=True, capture_output=True, text=True,
    )
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()


#: The C++ layout whose kBytes each family's smem_bytes mirrors, from its tiling.
_TRAITS = {
    "forward": "cuflash::ForwardSmem<cuflash::SimtTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, {t.warps}>>",
    "backward-dq": "cuflash::BackwardDqSmem<cuflash::SimtTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, "
                   "{t.warps}>>",
    "backward-dkdv": "cuflash::BackwardDkDvSmem<cuflash::SimtTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, "
                     "{t.warps}>>",
    "forward-mma": "cuflash::MmaForwardTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, {t.warps}, "
                   "{t.kv_stages}, {split_keys}, {kv_tma}>",
    "forward-wgmma": "cuflash::WgmmaForwardTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, {t.warps}, {t.kv_stages}, {persistent}>",
    "backward-dkdv-wgmma": "cuflash::WgmmaBackwardTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, "
                           "{t.warps}, {t.q_stages}, {product_dim}>",
    "backward-dkdv-mma": "cuflash::MmaBackwardTraits<{e}, {t.head_dim_padded}, {t.block_m}, {t.block_n}, {t.warps}, "
                         "{t.q_stages}>",
}


def _layouts():
    """(C++ layout expression, Python byte count) for every compiled tiling of every family."""
    rows = []
    for family in FAMILIES:
        if family.tiles is None:
            continue
        for dtype, tiling in family.compiled_tilings():
            expression = _TRAITS[family.name].format(e=CXX_ELEMENT_TYPE[dtype], t=tiling,
                                                     split_keys=str(tiling.warps_split_keys).lower(),
                                                     kv_tma=str(tiling.kv_tma).lower(),
                                                     persistent=str(tiling.persistent).lower(),
                                                     product_dim=tiling.product_columns)
            rows.append((f"{expression}::kBytes", family.smem_bytes(tiling, dtype)))
            if family.name == "backward-dkdv-wgmma":  # the direct dQ mode's layout, with its O tiles where they fit
                rows.append((f"{expression[:-1]}, true>::kBytes", family.smem_bytes(tiling, dtype, "direct")))
                rows.append((f"{expression[:-1]}, true>::kComputesDelta",
                             int(wgmma_direct_computes_delta(tiling))))
    return rows


def test_every_tiled_family_has_its_traits_checked():
    assert {f.name for f in FAMILIES if f.tiles is not None} == set(_TRAITS)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_entries_are_consistent(family):
    assert FAMILY[family.name] is family
    assert (kernel_source_dir() / family.source).is_file()
    for dtype, tiling in family.compiled_tilings() if family.tiles else []:
        layout = (copy_engine_layouts(tiling) or ("dense",))[0]  # a copy-engine decode tiling's own layouts
        variant = family.variant(dtype, tiling, MASKS["causal"], layout=layout)
        assert variant.key.startswith(family.name + "/") and variant.smem_bytes <= MAX_SMEM_BYTES
        assert family.applies(dtype, tiling.head_dim_padded, 90) or family.arch != "any"
    if family.tiles:
        assert family_of(family.role, family.kernel) is family


@pytest.mark.parametrize("dtype,head_dim,generation,conditions,forward,backward", [
    ("bfloat16", 128, 90, {}, "wgmma", "wgmma"),
    ("float16", 64, 90, dict(deterministic=True), "wgmma", "wgmma"),
    ("float16", 64, 80, dict(deterministic=True), "mma", "mma"),
    ("bfloat16", 96, 90, {}, "wgmma", "wgmma"),
    ("float16", 80, 90, dict(deterministic=True), "wgmma", "wgmma"),
    ("bfloat16", 256, 90, {}, "wgmma", "wgmma"),
    ("bfloat16", 96, 80, {}, "mma", "mma"),
    ("bfloat16", 128, 80, {}, "mma", "mma"),
    ("bfloat16", 192, 80, {}, "mma", "mma"),
    ("float16", 256, 80, dict(deterministic=True), "mma", "mma"),
    ("bfloat16", 128, 90, dict(aligned_rows=False), "simt", "simt"),
    ("float32", 64, 90, {}, "simt", "simt"),
    ("bfloat16", 20, 90, {}, "simt", "simt"),
    ("bfloat16", 64, 75, {}, "simt", "simt"),
])
def test_selection_takes_the_first_family_that_applies(dtype, head_dim, generation, conditions, forward, backward):
    assert select("forward", dtype, head_dim, generation, **conditions).kernel == forward
    assert select("backward-dkdv", dtype, head_dim, generation, **conditions).kernel == backward


def test_selection_needs_a_positive_scale_for_tensor_cores():
    assert select("forward", "bfloat16", 64, 90, positive_scale=False).kernel == "simt"


def test_a_variant_refuses_a_dq_mode_its_family_lacks():
    tiling = FAMILY["backward-dkdv"].tiles("bfloat16", 64)
    with pytest.raises(ValueError, match="no ordered dQ mode"):
        FAMILY["backward-dkdv"].variant("bfloat16", tiling, MASKS["none"], dq_mode="ordered")


@pytest.mark.parametrize("name,deterministic,mode,key", [
    ("backward-dkdv-wgmma", False, "atomic", "/atomic-dq"), ("backward-dkdv-wgmma", True, "ordered", "/ordered-dq"),
    ("backward-dkdv", False, "atomic", "/atomic-dq"), ("backward-dkdv", True, "separate", "/none"),
])
def test_dq_modes_of_the_dkdv_families(name, deterministic, mode, key):
    family = FAMILY[name]
    assert family.dq_mode(deterministic) == mode
    variant = family.variant("bfloat16", family.tiles("bfloat16", 64), MASKS["none"], dq_mode=mode)
    assert variant.key.endswith(key) and variant.template_args[-1] == family.dq_modes[mode]


def test_the_claimed_dq_mode_is_the_hopper_kernels_third_template_argument():
    """kDqAtomic, kDqOrdered, kDqClaimed (kernels_cu/ordered_accumulation.cuh)
    as the int the kernel's mangled name shows; the claimed mode is built for
    dense batches under causal or window masks, at head dims up to 128 only
    (kernel_report)."""
    from cuflash._kernel_families import claimed_dq_applies

    family = FAMILY["backward-dkdv-wgmma"]
    assert family.dq_modes == {"atomic": "0", "ordered": "1", "claimed": "2", "direct": "3"}
    assert family.dq_mode(False) == "atomic"  # a call asks for claimed by stores_first_dq, never by default
    variant = family.variant("bfloat16", family.tiles("bfloat16", 128), MASKS["causal"], dq_mode="claimed")
    assert variant.key.endswith("/causal/q2/claimed-dq") and variant.template_args[-1] == "2"
    for head_dim in (32, 64, 96, 128):
        assert claimed_dq_applies(MASKS["causal"], "dense", head_dim)
        assert claimed_dq_applies(MASKS["window"], "dense", head_dim)
        assert not claimed_dq_applies(MASKS["none"], "dense", head_dim)
        assert not claimed_dq_applies(MASKS["causal"], "packed", head_dim)
    # Head dims whose consumers split it add their dQ tiles (measured faster).
    assert not any(claimed_dq_applies(MASKS[mask], "dense", head_dim)
                   for mask in ("causal", "window") for head_dim in (192, 256))


@pytest.mark.parametrize("mask,seqlen_q,seqlen_k,block_n,dq_aligned,direct", [
    ("none", 1, 1, 128, True, True),
    ("none", 1000, 128, 128, True, True),      # many query blocks, one key block
    ("none", 1000, 129, 128, True, False),     # two key blocks add into one dQ block
    ("none", 100, 100, 64, True, False),       # the d256 tiles' 64 keys a block
    ("none", 100, 100, 128, False, False),     # a dq the caller gave: its alignment is not the plan's
    ("causal", 17, 17, 128, True, True),
    ("causal", 50, 90, 128, True, True),       # fewer queries than keys: every row sees its diagonal key
    ("causal", 300, 50, 128, True, False),     # rows before the keys see none: their blocks are never visited
    ("window", 90, 90, 128, True, True),
    ("window", 91, 90, 128, True, False),
    ("none", 0, 10, 128, True, False),         # nothing to store
    ("none", 10, 0, 128, True, False),         # no key block: dq is zeros from the conversion
])
def test_direct_dq_runs_for_one_key_block_that_visits_every_query_block(mask, seqlen_q, seqlen_k, block_n, dq_aligned,
                                                                        direct):
    """The Hopper dK/dV kernel stores dQ itself (kDqDirect, the fourth
    template argument) exactly where each query block's dQ comes from one key
    block that visits it: one key block, a dense batch without a mask or
    under a causal or window mask with no rows before the keys, and a dq the
    call allocates."""
    from cuflash._kernel_families import direct_dq_applies, runs_direct_dq

    assert runs_direct_dq("wgmma", MASKS[mask], "dense", seqlen_q, seqlen_k, block_n, dq_aligned) is direct
    assert not runs_direct_dq("mma", MASKS[mask], "dense", seqlen_q, seqlen_k, block_n, dq_aligned)
    assert not runs_direct_dq("wgmma", MASKS[mask], "packed", seqlen_q, seqlen_k, block_n, dq_aligned)
    assert direct_dq_applies(MASKS[mask], "dense") and not direct_dq_applies(MASKS[mask], "packed")
    family = FAMILY["backward-dkdv-wgmma"]
    variant = family.variant("bfloat16", family.tiles("bfloat16", 64), MASKS[mask], dq_mode="direct")
    assert variant.key.endswith(f"/{mask}/q2/direct-dq") and variant.template_args[-1] == "3"


@pytest.mark.parametrize("head_dim", [8, 16, 64, 72, 96, 120, 128, 136, 192, 200, 256])
@pytest.mark.parametrize("dtype", MMA_DTYPES + ("float32",))
def test_mma_table(dtype, head_dim):
    """16-bit tiles, and float32's 3xTF32 tiles on the same head-dim buckets."""
    tiling = mma_forward_tiling(dtype, head_dim)
    assert tiling.keys_last_to_first and tiling.head_dim_padded >= head_dim
    assert tiling.head_dim_padded == min(b for b in MMA_FORWARD_TILES if b >= head_dim)
    table = MMA_3XTF32_FORWARD_TILES if dtype == "float32" else MMA_FORWARD_TILES
    assert (tiling.block_m, tiling.block_n, tiling.warps, tiling.kv_stages) == table[tiling.head_dim_padded]
    # MmaForwardTraits: whole m16 tiles per warp, k16 steps over keys.
    assert tiling.block_m % (16 * tiling.warps) == 0 and tiling.block_n % 16 == 0
    assert tiling.forward_smem_bytes(dtype) <= MAX_SMEM_BYTES
    assert mma_forward_applies(dtype, head_dim)
    assert mma_applies(dtype, head_dim) == (dtype != "float32")  # the 16-bit tensor-core kernels


@pytest.mark.parametrize("dtype,head_dim", [("float32", 20), ("float16", 20), ("bfloat16", 257), ("float16", 0),
                                            ("float32", 264)])
def test_mma_table_rejects_what_it_does_not_serve(dtype, head_dim):
    assert not mma_applies(dtype, head_dim) and not mma_forward_applies(dtype, head_dim)
    with pytest.raises(ValueError, match="tensor-core forward"):
        mma_forward_tiling(dtype, head_dim)


@pytest.mark.parametrize("head_dim,bucket", [(8, 32), (32, 32), (40, 64), (64, 64), (72, 96), (80, 96), (96, 96),
                                             (104, 128), (128, 128), (136, 192), (160, 192), (192, 192),
                                             (200, 256), (256, 256)])
@pytest.mark.parametrize("dtype", MMA_DTYPES)
def test_wgmma_forward_table(dtype, head_dim, bucket):
    tiling = wgmma_forward_tiling(dtype, head_dim)
    assert tiling.kernel == "wgmma" and tiling.keys_last_to_first and tiling.head_dim_padded == bucket
    # WgmmaForwardTraits: a producer warpgroup, one consumer warpgroup per 64
    # rows, k16 steps over keys, and S (block_n / 2), O (head_dim / 2) and
    # two blocks' P (block_n / 4 each) within 192 registers.
    assert tiling.block_m == 16 * (tiling.warps - 4) and tiling.block_n % 16 == 0
    assert tiling.block_n // 2 + bucket // 2 + 2 * (tiling.block_n // 4) <= 192
    assert tiling.forward_smem_bytes(dtype) <= MAX_SMEM_BYTES
    assert wgmma_forward_applies(dtype, head_dim)
    assert select("forward", dtype, head_dim, 90) == tiling
    assert select("forward", dtype, head_dim, 80).kernel == "mma"


@pytest.mark.parametrize("head_dim,partial_sector", [(8, True), (16, False), (24, True), (32, False), (40, True),
                                                     (48, False), (56, True), (64, False), (72, False)])
@pytest.mark.parametrize("dtype", MMA_DTYPES)
def test_wgmma_forward_rows_ending_mid_sector_take_192_query_rows(dtype, head_dim, partial_sector):
    """Head dims 8, 24, 40 and 56 (16-bit rows of 16, 48, 80, 112 bytes)
    take the 192-row tile of three consumers (docs/perf-notes.md: 7-21%
    faster on such rows than 128 x 128, twice as fast as 64 x 128 at two
    an SM); 16 and 32 keep the 64-row, two-blocks-per-SM one, 48 and 64 the
    192-row one; 72's bucket has one tile."""
    tiling = wgmma_forward_tiling(dtype, head_dim)
    table = WGMMA_FORWARD_PARTIAL_SECTOR_TILES if partial_sector and head_dim < 32 else WGMMA_FORWARD_TILES
    assert (tiling.block_m, tiling.block_n, tiling.warps, tiling.blocks_per_sm) == table[tiling.head_dim_padded]
    assert (tiling.block_m, tiling.block_n) == ((192, 96) if partial_sector or 32 < head_dim <= 64
                                                else (64, 128) if head_dim <= 32 else (128, 128))
    assert tiling.product_dim == wgmma_product_dim(head_dim, tiling.head_dim_padded)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.tiles is not None], ids=lambda f: f.name)
def test_compiled_tilings_hold_every_head_dims_choice(family):
    """Every tiling a served head dim may take is compiled (kernel_report,
    warm-up and the traits' layout checks walk compiled_tilings), also
    where a table picks tiles by head dim within a bucket."""
    compiled = set(family.compiled_tilings())
    for dtype in family.dtypes:
        for head_dim in range(1, 257):
            if family.serves(dtype, head_dim):
                assert (dtype, family.tiles(dtype, head_dim)) in compiled, (dtype, head_dim)


@pytest.mark.parametrize("head_dim,bucket", [(8, 32), (32, 32), (40, 64), (64, 64), (72, 96), (80, 96), (96, 96),
                                             (120, 128), (128, 128), (136, 192), (160, 192), (192, 192),
                                             (224, 256), (256, 256)])
@pytest.mark.parametrize("dtype", MMA_DTYPES)
def test_wgmma_backward_table(dtype, head_dim, bucket):
    tiling = wgmma_backward_tiling(dtype, head_dim)
    assert tiling.kernel == "wgmma" and tiling.head_dim_padded == bucket
    # WgmmaBackwardTraits: 64 keys per warpgroup, or shared by all of them
    # where the head dim is split; dK, dV, S^T and dP^T within 192
    # registers; dQ split into column blocks of whole k16 steps.
    warpgroups = tiling.warps // 4 - 1  # consumers; warpgroup 0 is the producer
    assert warpgroups >= 1
    split = backward_splits_head_dim(bucket)
    assert split == (bucket > 128)
    assert tiling.block_n == (64 if split else 64 * warpgroups) and tiling.block_m % 64 == 0
    dim_groups = warpgroups if split else 1
    assert (bucket + tiling.block_m) // dim_groups <= 192
    dq_cols = bucket * (tiling.block_m // 64) // warpgroups
    assert dq_cols % 16 == 0 and dq_cols <= 128
    assert tiling.backward_dkdv_smem_bytes(dtype) <= MAX_SMEM_BYTES
    assert wgmma_backward_applies(dtype, head_dim)
    assert select("backward-dkdv", dtype, head_dim, 90) == tiling
    assert select("backward-dkdv", dtype, head_dim, 80).kernel == "mma"


@pytest.mark.parametrize("head_dim,product_dim", [
    (8, 0), (16, 0), (32, 0),                 # bucket 32: no narrower N in the table
    (40, 48), (48, 48), (56, 0), (64, 0),     # bucket 64: 48, where the head dim fits it
    (72, 80), (80, 80), (88, 0), (96, 0),
    (104, 112), (112, 112), (120, 0), (128, 0),
    (136, 0), (176, 0), (200, 0), (248, 0),   # split head dims: the consumers share the columns
])
def test_backward_products_stop_at_the_head_dim_rounded_to_a_k16_step(head_dim, product_dim):
    """``wgmma_product_dim``: a head dim between buckets runs the Hopper
    backward's products over itself rounded up to a k16 step where that is a
    Wgmma width below the bucket and each consumer holds every column; the
    width rides in the variant's template arguments and key, after the Q/dO
    buffers."""
    tiling = wgmma_backward_tiling("bfloat16", head_dim)
    assert wgmma_product_dim(head_dim, tiling.head_dim_padded) == product_dim == tiling.product_dim
    if product_dim:
        assert head_dim <= product_dim < tiling.head_dim_padded and product_dim in WGMMA_PRODUCT_DIMS
    family = FAMILY["backward-dkdv-wgmma"]
    variant = family.variant("bfloat16", tiling, MASKS["causal"], dq_mode="claimed")
    stages_at = len(variant.template_args) - 3
    assert variant.template_args[stages_at:] == (str(tiling.q_stages), str(product_dim or tiling.head_dim_padded),
                                                 family.dq_modes["claimed"])
    suffix = f"/q{tiling.q_stages}" + (f"/k{product_dim}" if product_dim else "") + "/claimed-dq"
    assert variant.key.endswith(f"/causal{suffix}")
    # The tiles, their shared memory and the swizzles (tensor maps) are the bucket's.
    bucket = wgmma_backward_tiling("bfloat16", tiling.head_dim_padded)
    assert dataclasses.replace(tiling, product_dim=0) == bucket
    assert tiling.backward_dkdv_smem_bytes("bfloat16") == bucket.backward_dkdv_smem_bytes("bfloat16")
    assert wgmma_backward_swizzles(tiling) == wgmma_backward_swizzles(bucket)


def test_every_narrowed_backward_is_compiled():
    """The kernel list (kernel_report, warmup's and the loader's keys) holds
    each bucket's narrowed tiling beside its own, in both dtypes."""
    narrowed = {(dtype, t.head_dim_padded, t.product_dim)
                for dtype, t in FAMILY["backward-dkdv-wgmma"].compiled_tilings() if t.product_dim}
    assert narrowed == {(dtype, bucket, width) for dtype in MMA_DTYPES
                        for bucket, width in ((64, 48), (96, 80), (128, 112))}


@pytest.mark.parametrize("head_dim,product_dim", [
    (8, 0), (24, 0), (32, 0),                  # bucket 32: no narrower N in the table
    (40, 48), (48, 48), (56, 0), (64, 0),      # bucket 64: 40 (rows ending mid-sector) and 48 alike
    (72, 80), (80, 80), (88, 0), (96, 0),
    (104, 112), (112, 112), (120, 0), (128, 0),
    (136, 0), (160, 0), (200, 0), (256, 0),    # buckets 192 and 256: no width of the table inside them
])
@pytest.mark.parametrize("dtype", MMA_DTYPES)
def test_forward_products_stop_at_the_head_dim_rounded_to_a_k16_step(dtype, head_dim, product_dim):
    """``wgmma_product_dim`` serves the Hopper forward too: S's k16 steps and
    O's N stop at the head dim rounded up to a k16 step where that is a
    Wgmma width inside and below the bucket, in every tile a call may take
    (the table's, the short-sequence ones, their persistent forms); the
    width rides in the variant's template arguments (last) and key."""
    from cuflash._tiling import wgmma_forward_for_call, wgmma_forward_persistent_form, wgmma_forward_short_tilings

    tiling = wgmma_forward_tiling(dtype, head_dim)
    assert wgmma_product_dim(head_dim, tiling.head_dim_padded) == product_dim == tiling.product_dim
    family = FAMILY["forward-wgmma"]
    chosen = [wgmma_forward_for_call(tiling, dtype, head_dim, mask, "dense", False, keys)
              for mask in ("none", "causal", "window") for keys in (256, 512, 1024, 4096, 16384)]
    shorts = wgmma_forward_short_tilings(dtype, head_dim)
    for rule, short in shorts:  # persistent only where the bucket's rule says, narrowed or not
        form = wgmma_forward_persistent_form(dtype, short)
        assert (form is None) == (not rule.serves_persistent)
    for candidate in {tiling, *(short for _, short in shorts), *chosen}:
        assert candidate.product_dim == product_dim
        variant = family.variant(dtype, candidate, MASKS["causal"])
        assert variant.template_args[-1] == str(product_dim or candidate.head_dim_padded)
        assert variant.key.endswith(f"/k{product_dim}") == bool(product_dim)
        # The tiles and their shared memory are the bucket's.
        bucket = dataclasses.replace(candidate, product_dim=0)
        assert candidate.forward_smem_bytes(dtype) == bucket.forward_smem_bytes(dtype)
        assert family.variant(dtype, bucket, MASKS["causal"]).key + f"/k{product_dim}" == variant.key or not product_dim
        # WgmmaForwardTraits' accumulator budget with O kProductDim wide.
        assert candidate.block_n // 2 + candidate.product_columns // 2 + 2 * (candidate.block_n // 4) <= 192


def test_every_narrowed_forward_is_compiled():
    """The kernel list holds each bucket's narrowed forward tilings beside
    its own: the table's, the short-sequence tiles (head dims 48 and 112
    have whole-sector rows) and the persistent forms, in both dtypes."""
    compiled = FAMILY["forward-wgmma"].compiled_tilings()
    narrowed = {(dtype, t.head_dim_padded, t.product_dim) for dtype, t in compiled if t.product_dim}
    assert narrowed == {(dtype, bucket, width) for dtype in MMA_DTYPES
                        for bucket, width in ((64, 48), (96, 80), (128, 112))}
    for dtype, t in compiled:
        if not t.product_dim and t.head_dim_padded in (64, 96, 128):
            assert (dtype, dataclasses.replace(t, product_dim=wgmma_product_dim(t.head_dim_padded - 16,
                                                                                 t.head_dim_padded))) in compiled


@pytest.mark.parametrize("fields,message", [
    (dict(head_dim_padded=128, kernel="mma", product_dim=112), "wgmma tiling"),
    (dict(head_dim_padded=128, kernel="wgmma", product_dim=128), "got 128"),
    (dict(head_dim_padded=96, kernel="wgmma", product_dim=112), "got 112"),
    (dict(head_dim_padded=128, kernel="wgmma", product_dim=104), "got 104"),   # not a width of the Wgmma table
    (dict(head_dim_padded=256, kernel="wgmma", product_dim=112), "head_dim_padded 256"),  # split head dim
])
def test_a_tiling_refuses_a_product_dim_its_kernel_cannot_run(fields, message):
    with pytest.raises(ValueError, match=f"product_dim must be 0 or one of .*{message}"):
        Tiling(block_m=64, block_n=128, warps=12, **fields)


@pytest.mark.parametrize("head_dim,bucket", [(8, 32), (40, 64), (72, 96), (96, 96), (120, 128), (128, 128),
                                             (136, 192), (160, 192), (192, 192), (200, 256), (256, 256)])
@pytest.mark.parametrize("dtype", MMA_DTYPES)
def test_mma_backward_table(dtype, head_dim, bucket):
    tiling = mma_backward_tiling(dtype, head_dim)
    assert tiling.kernel == "mma" and tiling.head_dim_padded == bucket
    assert (tiling.block_m, tiling.block_n, tiling.warps, tiling.q_stages) == MMA_BACKWARD_TILES[bucket]
    # MmaBackwardTraits: 16 keys per warp, or per pair of warps where the
    # head dim is split; dK, dV, S^T and dP^T within 192 registers; dQ in m16
    # row tiles and whole n8 pairs of columns.
    dim_groups = 2 if backward_splits_head_dim(bucket) else 1
    assert tiling.block_n == 16 * tiling.warps // dim_groups
    assert (bucket + tiling.block_m) // dim_groups <= 192 and (tiling.block_m // dim_groups) % 16 == 0
    row_tiles = tiling.block_m // 16
    assert tiling.warps % row_tiles == 0 and bucket % (16 * (tiling.warps // row_tiles)) == 0
    # What Ampere runs: within an A100's 163 KiB per block.
    assert tiling.backward_dkdv_smem_bytes(dtype) <= 163 * 1024
    assert mma_backward_applies(dtype, head_dim)
    assert select("backward-dkdv", dtype, head_dim, 80, smem_limit=163 * 1024) == tiling


@pytest.mark.parametrize("head_dim", [8, 40, 64, 72, 96, 120, 128, 160, 192, 200, 256])
@pytest.mark.parametrize("dtype", MMA_DTYPES)
def test_mma_backward_99kib_tiles(dtype, head_dim):
    """sm_86/sm_89 GPUs give a block 99 KiB: where the A100 tiles need more,
    the launcher takes tiles that fit (same kernel rules), and those run
    with one Q/dO buffer or fewer rows or keys."""
    small = 99 * 1024
    default = mma_backward_tiling(dtype, head_dim)
    compact = mma_backward_99kib_tiling(dtype, head_dim)
    chosen = select("backward-dkdv", dtype, head_dim, 86, smem_limit=small)
    if default.backward_dkdv_smem_bytes(dtype) <= small:
        assert chosen == default
    else:
        assert compact is not None and chosen == compact and compact.head_dim_padded == default.head_dim_padded
        assert compact.backward_dkdv_smem_bytes(dtype) <= small
        assert tuple(MMA_BACKWARD_99KIB_TILES[compact.head_dim_padded]) == (
            compact.block_m, compact.block_n, compact.warps, compact.q_stages)
    assert (dtype, chosen) in FAMILY["backward-dkdv-mma"].compiled_tilings()


@pytest.mark.parametrize("dtype,head_dim,kernel", [("float32", 64, "simt"), ("bfloat16", 20, "simt"),
                                                   ("float16", 260, None)])
def test_wgmma_forward_table_leaves_other_inputs_to_simt(dtype, head_dim, kernel):
    assert not wgmma_forward_applies(dtype, head_dim)
    if kernel is None:
        with pytest.raises(ValueError):
            select("forward", dtype, head_dim, 90)
    else:
        assert select("forward", dtype, head_dim, 90).kernel == kernel


def test_hopper_backward_buckets_have_a_hopper_forward():
    assert set(WGMMA_BACKWARD_TILES) <= set(WGMMA_FORWARD_TILES)


def test_tiling_rejects_an_unknown_kernel():
    with pytest.raises(ValueError, match="kernel must be one of"):
        Tiling(head_dim_padded=64, block_m=64, block_n=64, warps=4, kernel="tma")


@needs_nvcc
def test_python_and_cxx_agree_on_shared_memory(tmp_path):
    layouts = _layouts()
    body = "\n".join(f'printf("%d\\n", {expression});' for expression, _ in layouts)
    printed = [int(x) for x in _run_host_program(tmp_path, body)]
    assert printed == [expected for _, expected in layouts]


@needs_nvcc
def test_python_and_cxx_agree_on_layout_constants(tmp_path):
    """Constants Python restates: the rescale slack the tiled emulation
    follows, the swizzle alignment the shared-memory formulas add, the
    shared-memory budget."""
    from cuflash._tiling import WGMMA_SMEM_ALIGNMENT
    from cuflash.reference import RESCALE_SLACK

    printed = _run_host_program(tmp_path, "\n".join([
        'printf("%g\\n", (double)cuflash::FragmentOnlineSoftmax<1>::kRescaleSlack);',
        'printf("%d\\n", cuflash::WgmmaForwardTraits<__half, 64, 128, 64, 12, 2, false>::kAlignment);',
        'printf("%d\\n", cuflash::WgmmaBackwardTraits<__half, 64, 64, 128, 12, 2>::kAlignment);',
        'printf("%d\\n", cuflash::kMaxSmemBytes);',
    ]), extra_include="online_softmax.cuh")
    assert [float(x) for x in printed] == [RESCALE_SLACK, WGMMA_SMEM_ALIGNMENT, WGMMA_SMEM_ALIGNMENT, MAX_SMEM_BYTES]


@needs_nvcc
def test_fragment_lane_offsets_follow_the_float_tile_swizzle(tmp_path):
    """SwizzledFloatTile::FragmentLane (the Hopper backward's dQ tile
    stores) against the tile's layout written out: float column c of row r
    at (c / 32) panel + 128 r + ((c % 32) / 4 ^ r % 8) 16 + (c % 4) 4, for
    every lane, both halves, every row0 (multiples of 8) and column (of 8),
    and the lane's second float 4 bytes on. Head dims 64, 96 (48-column dQ
    blocks: columns 16 into a panel) and 128's tiles."""
    body = r"""
    unsigned mismatches = 0, checked = 0;
    auto check = [&](auto tile) {
        using Tile = decltype(tile);
        const auto layout = [](unsigned r, unsigned c) {
            return c / 32 * Tile::kPanelBytes + 128 * r + (((c % 32) / 4) ^ (r % 8)) * 16 + (c % 4) * 4;
        };
        for (unsigned row0 = 0; row0 + 16 <= Tile::kRows; row0 += 8)
            for (unsigned lane = 0; lane < 32; ++lane)
                for (unsigned col = 0; col + 8 <= Tile::kCols; col += 8)
                    for (int half = 0; half < 2; ++half) {
                        const unsigned r = row0 + lane / 4 + 8 * half, c = col + 2 * (lane % 4);
                        const unsigned got = Tile::fragment_lane(row0, lane).offset(col, half);
                        mismatches += (got != layout(r, c)) + (got + 4 != layout(r, c + 1));
                        ++checked;
                    }
    };
    check(cuflash::SwizzledFloatTile<64, 64>());
    check(cuflash::SwizzledFloatTile<64, 96>());
    check(cuflash::SwizzledFloatTile<128, 128>());
    printf("%u %u\n", mismatches, checked);
    """
    mismatches, checked = map(int, _run_host_program(tmp_path, body, extra_include="swizzled_tile.cuh"))
    assert checked == 2 * 32 * (7 * 8 + 7 * 12 + 15 * 16) and mismatches == 0


@needs_nvcc
@pytest.mark.parametrize("struct,dtype", [("ForwardParams", FORWARD_PARAMS), ("BackwardParams", BACKWARD_PARAMS),
                                          ("WgmmaForwardParams", WGMMA_FORWARD_PARAMS),
                                          ("WgmmaBackwardParams", WGMMA_BACKWARD_PARAMS),
                                          ("MergeParams", MERGE_PARAMS),
                                          ("CacheAppendParams", CACHE_APPEND_PARAMS)])
def test_python_and_cxx_agree_on_params_layout(tmp_path, struct, dtype):
    fields = flat_fields(dtype)
    body = [f'printf("%zu\\n", sizeof(cuflash::{struct}));']
    # the Python side names the user arrays' pointers user_array0..3 (plan slots) and the head-pair maps
    # k_pair_map0..1, v_pair_map0..1; C++ holds arrays of them
    paths = [re.sub(r"(user_array|k_pair_map|v_pair_map)(\d)$", r"\1s[\2]", path) for path, _ in fields]
    body += [f'printf("%zu\\n", offsetof(cuflash::{struct}, {path}));' for path in paths]
    printed = [int(x) for x in _run_host_program(tmp_path, "\n".join(body))]
    assert printed[0] == dtype.itemsize
    assert printed[1:] == [offset for _, offset in fields]


def test_params_pack_requires_every_field():
    from cuflash._params import NO_VARIANT, pack

    fields = {name: 0 for name in FORWARD_PARAMS.names}
    fields.update(q=(1, 2, 3, 4), k=(0, 0, 0, 0), v=(0, 0, 0, 0), out=(0, 0, 0, 0), size=(1, 2, 3, 4, 5, 6, 0, 0, 4, 5, 0, 0, 0, 0),
                  variant=NO_VARIANT)
    struct = pack(FORWARD_PARAMS, **fields)
    assert struct.shape == (1,) and struct.dtype == FORWARD_PARAMS
    assert struct["q"]["row_stride"][0] == 3 and struct["size"]["seqlen_k"][0] == 5
    del fields["q"]
    with pytest.raises(KeyError, match="missing \\['q'\\]"):
        pack(FORWARD_PARAMS, **fields)
    with pytest.raises(KeyError, match="unknown \\['bogus'\\]"):
        pack(FORWARD_PARAMS, bogus=1, q=(0, 0, 0, 0), **fields)
    assert np.dtype(FORWARD_PARAMS).isalignedstruct


@pytest.mark.parametrize("mask,dq_mode,kernel,num_m_blocks,num_n_blocks,multiprocessors,rotated", [
    ("none", "ordered", "wgmma", 32, 32, 132, True),
    ("none", "ordered", "wgmma", 64, 32, 132, True),     # more query blocks than key blocks: each still starts on its own
    ("none", "ordered", "wgmma", 16, 32, 132, False),    # fewer: two key blocks would start on one query block
    ("none", "ordered", "wgmma", 256, 133, 132, False),  # one head's key blocks may not all be running at once
    ("none", "ordered", "wgmma", 132, 132, 132, True),
    ("none", "ordered", "mma", 32, 32, 132, True),
    ("none", "atomic", "wgmma", 32, 32, 132, True),      # spreads the additions over the dQ blocks
    ("none", "atomic", "wgmma", 256, 133, 132, True),    # no turns: no key block waits for another
    ("none", "atomic", "wgmma", 16, 32, 132, False),
    ("none", "atomic", "mma", 32, 32, 132, False),       # not measured on the mma.sync kernel
    ("none", "atomic", "simt", 32, 32, 132, False),
    ("causal", "ordered", "wgmma", 32, 32, 132, False),  # its own order, chain-free without rotation
    ("causal", "atomic", "wgmma", 32, 32, 132, False),   # its walks start on the diagonal already
])
def test_rotate_walks_where_it_pays_and_every_key_block_can_run(mask, dq_mode, kernel, num_m_blocks, num_n_blocks,
                                                                multiprocessors, rotated):
    from types import SimpleNamespace

    from cuflash.api import rotate_walks

    problem = SimpleNamespace(mask=MASKS[mask], packed=False)
    assert rotate_walks(problem, dq_mode, kernel, num_m_blocks, num_n_blocks, multiprocessors) is rotated


def test_masks_name_a_dq_order_their_structs_have():
    """Every mask's Python dq_turns names the C++ order its struct declares."""
    source = (kernel_source_dir() / "masks.cuh").read_text()
    cxx_names = {"key-block-order": "kKeyBlockOrder", "last-key-first": "kLastKeyFirst", "rotated": "kRotated"}
    for policy in MASKS.values():  # a user mask's struct is the UserMask template
        struct = policy.cxx.removeprefix("cuflash::").split("<")[0]
        body = source[source.index(f"struct {struct} "):]
        body = body[:body.index("\n};")]
        assert f"kDqTurns = DqTurns::{cxx_names[policy.dq_turns]};" in body, policy.name


def test_3xtf32_takes_hopper_tiles_where_they_differ():
    """float32 at head dim 256: 64 rows within an A100's 163 KiB, 128 rows
    on Hopper; elsewhere one table serves both."""
    a100 = select("forward", "float32", 256, 80, tf32x3=True)
    h100 = select("forward", "float32", 256, 90, tf32x3=True)
    assert (a100.block_m, h100.block_m) == (64, 128)
    assert a100.forward_smem_bytes("float32") <= 163 * 1024 < h100.forward_smem_bytes("float32") <= MAX_SMEM_BYTES
    assert select("forward", "float32", 128, 90, tf32x3=True) == select("forward", "float32", 128, 80, tf32x3=True)
    assert all(t.forward_smem_bytes("float32") <= 163 * 1024 for t in
               (select("forward", "float32", d, 80, tf32x3=True) for d in (32, 64, 96, 128, 192, 256)))


def test_families_whose_tiles_exceed_the_gpus_shared_memory_are_not_picked():
    """sm_86/sm_89 GPUs give a block 99 KiB: the launcher passes the limit
    and what needs more falls to the next family (3xTF32 float32 from head
    dim 64 to the exact path); the mma.sync backward takes its 99 KiB tiles
    from head dim 96."""
    small = 99 * 1024
    assert select("forward", "float32", 32, 86, tf32x3=True, smem_limit=small).kernel == "mma"
    assert select("forward", "float32", 64, 86, tf32x3=True, smem_limit=small).kernel == "simt"
    assert select("forward", "float32", 64, 80, tf32x3=True, smem_limit=163 * 1024).kernel == "mma"
    assert select("forward", "bfloat16", 256, 86, smem_limit=small).kernel == "mma"  # 99 KiB exactly
    assert select("backward-dkdv", "bfloat16", 64, 86, smem_limit=small).kernel == "mma"
    assert select("backward-dkdv", "bfloat16", 128, 86, smem_limit=small) == mma_backward_99kib_tiling("bfloat16", 128)
    assert select("backward-dkdv", "bfloat16", 256, 86, smem_limit=small) == mma_backward_99kib_tiling("bfloat16", 256)
    assert select("backward-dkdv", "bfloat16", 256, 80, smem_limit=163 * 1024) == mma_backward_tiling("bfloat16", 256)
    reason = FAMILY["forward-mma"].why_not("float32", 128, 86, tf32x3=True, smem_limit=small)
    assert reason == f"needs 135168 bytes of shared memory per block, the GPU gives {small}"


def test_decode_ring_at_one_block_an_sm_or_over_short_pages():
    """Three K/V buffers (``decode_ring``) for any cache where the launch is
    at most one block an SM; over short pages also where its blocks still
    fit one wave of what an SM holds with them (two at d128 on a Hopper,
    one at d192 and d256) and ranges are short; never where the GPU's
    blocks lack the shared memory, for clustered or cp.async tiles."""
    from cuflash._tiling import decode_cluster_tiling, decode_ring, decode_tilings

    for head_dim, per_sm in ((128, 2), (192, 1), (256, 1)):
        split = dataclasses.replace(decode_tilings("bfloat16", head_dim, 8)[1], kv_tma=True)

        def stages(page_size=16, blocks=200, range_blocks=16, smem=None):
            return decode_ring(split, page_size, "bfloat16", blocks, range_blocks, 132, smem).kv_stages

        # one block an SM: any cache, any range
        for page_size in (None, 16, 64, 256):
            assert stages(page_size, blocks=132, range_blocks=1000) == 3, (head_dim, page_size)
        assert stages(page_size=None, blocks=133) == 2 and stages(page_size=256, blocks=133) == 2
        # short pages past one block an SM
        assert stages(blocks=per_sm * 132) == 3, head_dim
        assert stages(blocks=per_sm * 132 + 1) == 2  # a second wave, or fewer blocks an SM than two buffers leave
        assert stages(range_blocks=17) == 2 or per_sm == 1
        assert stages(blocks=133, range_blocks=17) == 2 and stages(blocks=133, page_size=64) == 2
        assert stages(smem=99 * 1024) == 2 and stages(blocks=10, smem=99 * 1024) == 2  # sm_120's 99 KiB blocks
        assert decode_ring(decode_cluster_tiling(split, 4), 16, "bfloat16", 10, 4, 132).kv_stages == 2
        cp_async = dataclasses.replace(split, kv_tma=False)
        assert decode_ring(cp_async, 16, "bfloat16", 10, 4, 132) == cp_async


def test_wgmma_forward_persistent_only_where_a_static_share_is_even():
    from cuflash._tiling import (MAX_SMEM_BYTES, PERSISTENT_FORWARD_KEYS, SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK,
                                 wgmma_forward_persistent, wgmma_forward_persistent_form, wgmma_forward_short_tilings,
                                 wgmma_forward_tiling)

    for head_dim in (32, 64, 96, 128, 192, 256):
        tiling = wgmma_forward_tiling("bfloat16", head_dim)
        keys = PERSISTENT_FORWARD_KEYS[tiling.blocks_per_sm]
        persistent = wgmma_forward_persistent(tiling, "bfloat16", "none", "dense", False, keys)
        assert persistent.persistent and not tiling.persistent
        assert wgmma_forward_persistent_form("bfloat16", tiling) == persistent
        # Q's second buffer fits beside the K/V ring, for every resident block
        smem = persistent.forward_smem_bytes("bfloat16")
        assert persistent.kv_stages >= 2 and smem <= MAX_SMEM_BYTES
        assert persistent.blocks_per_sm * (smem + SMEM_RESERVED_PER_BLOCK) <= SMEM_PER_SM
        fewer_stages = tiling.kv_stages - persistent.kv_stages  # each: a K and a V buffer, five mbarriers
        # the second Q buffer with its two mbarriers and its tile's coordinates
        assert smem - tiling.forward_smem_bytes("bfloat16") == (
            tiling.block_m * head_dim * 2 + 32 - fewer_stages * (2 * tiling.block_n * head_dim * 2 + 40))
        assert wgmma_forward_persistent(tiling, "bfloat16", "causal", "dense", False, keys) == persistent
        for mask, layout, dropout, length in (("window", "dense", False, 512), ("none", "packed", False, 512),
                                              ("causal", "packed", False, 512), ("none", "dense", True, 512),
                                              ("none", "dense", False, keys + 1), ("causal", "dense", False, keys + 1)):
            assert wgmma_forward_persistent(tiling, "bfloat16", mask, layout, dropout, length) is tiling
        # the short-sequence tiles run persistent only where their table says
        for rule, short in wgmma_forward_short_tilings("bfloat16", head_dim):
            form = wgmma_forward_persistent_form("bfloat16", short)
            assert (form is None) == (not rule.serves_persistent) and (form is None or form.persistent)
            assert rule.serves_persistent == (head_dim == 64)


@pytest.mark.parametrize("head_dim,mask,layout,dropout,keys,expected", [
    # d64: causal 64 x 64 at three blocks an SM up to 2048 keys (persistent up
    # to 1024), no mask the same up to 512, else 64 x 128 up to 1024 keys
    # (persistent where that applies), else 192 x 96
    (64, "causal", "dense", False, 1024, ((64, 64, 8, 3), True)),
    (64, "causal", "dense", False, 1025, ((64, 64, 8, 3), False)),
    (64, "causal", "dense", False, 2048, ((64, 64, 8, 3), False)),
    (64, "causal", "packed", False, 700, ((64, 64, 8, 3), False)),
    (64, "causal", "dense", False, 2049, ("table", True)),
    (64, "none", "dense", False, 512, ((64, 64, 8, 3), True)),
    (64, "none", "packed", False, 500, ((64, 64, 8, 3), False)),
    (64, "none", "dense", False, 513, ((64, 128, 8, 2), True)),
    (64, "none", "dense", False, 1024, ((64, 128, 8, 2), True)),
    (64, "window", "dense", False, 1024, ((64, 128, 8, 2), False)),
    (64, "none", "packed", False, 700, ((64, 128, 8, 2), False)),
    (64, "none", "dense", True, 700, ((64, 128, 8, 2), False)),
    (64, "none", "dense", False, 1025, ("table", True)),
    (64, "causal", "dense", False, 8192, ("table", True)),
    (64, "none", "dense", False, 8193, ("table", False)),
    (64, "window", "dense", False, 2048, ("table", False)),
    (48, "none", "dense", False, 1024, ((64, 128, 8, 2), True)),  # whole sectors: bucket 64's tiles
    # rows ending mid-sector: 128 x 128 (the table's is 192 x 96) causal up
    # to 1024 keys, no mask up to 512, persistent where that applies
    (56, "none", "dense", False, 1024, ("table", True)),
    (56, "none", "dense", False, 512, ((128, 128, 12, 1), True)),
    (8, "none", "dense", False, 512, ((128, 128, 12, 1), True)),
    (24, "none", "packed", False, 500, ((128, 128, 12, 1), False)),
    (40, "causal", "dense", False, 1024, ((128, 128, 12, 1), True)),
    (40, "causal", "dense", False, 1025, ("table", True)),
    (40, "window", "dense", False, 512, ("table", False)),
    # d128: the short tile only where persistent blocks do not apply, up to 512 keys
    (128, "none", "dense", False, 512, ("table", True)),
    (128, "causal", "dense", False, 512, ("table", True)),
    (128, "window", "dense", False, 512, ((64, 64, 8, 2), False)),
    (128, "causal", "packed", False, 512, ((64, 64, 8, 2), False)),
    (128, "window", "dense", False, 513, ("table", False)),
    (256, "window", "dense", False, 100, ("table", False)),  # no short tile
])
def test_wgmma_forward_for_call_picks_short_tiles_and_persistent_blocks(head_dim, mask, layout, dropout, keys,
                                                                        expected):
    from cuflash._tiling import wgmma_forward_for_call, wgmma_forward_tiling

    table = wgmma_forward_tiling("bfloat16", head_dim)
    chosen = wgmma_forward_for_call(table, "bfloat16", head_dim, mask, layout, dropout, keys)
    tile, persistent = expected
    assert chosen.persistent == persistent
    if tile == "table":
        assert dataclasses.replace(chosen, persistent=False, kv_stages=table.kv_stages) == table
    else:
        assert (chosen.block_m, chosen.block_n, chosen.warps, chosen.blocks_per_sm) == tile


@pytest.mark.parametrize("tiles_per_head", [1, 2, 7, 8, 16, 33])
@pytest.mark.parametrize("heads", [1, 5, 64, 1024])
def test_persistent_causal_walk_pairs_long_and_short_tiles(tiles_per_head, heads):
    """A Python model of kernels_cu/grid.cuh's PersistentTileWalk on the grid
    persistent_grid gives: every tile is walked exactly once, and with causal
    walks (longest first: position p sees n - p key blocks) each block's
    share stays within one unit of the even share; the unpaired walk
    (tiles gridDim.x apart) can be far off with 8 tiles a head."""
    from cuflash._tiling import persistent_grid, persistent_tile_walks

    slots, n = 264, tiles_per_head
    tiles = heads * n
    half = (n + n % 2) // 2  # an odd n walks as n + 1 tiles, the last empty

    work = [n - linear % n for linear in range(tiles)]
    grid = persistent_grid(tiles, slots, n, paired=True)
    assert grid == min(heads * half, slots)
    walks = persistent_tile_walks(tiles, n, grid, paired=True)
    assert sorted(t for walk in walks for t in walk) == list(range(tiles))
    share = [sum(work[t] for t in walk) for walk in walks]
    assert max(share) - sum(work) / grid <= n + 1
    plain = persistent_grid(tiles, slots, n, paired=False)
    assert plain == min(tiles, slots)
    if tiles > 4 * slots and n == 8:
        unpaired = [sum(work[g::plain]) for g in range(plain)]
        assert max(unpaired) - sum(work) / plain > n + 1
