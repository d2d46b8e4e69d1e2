"""User masks without a GPU: the tile map's layout and its NumPy builder,
BlockMask's checks, the validation of mask_mod calls, the plan fields of a
tile map, the float64 reference with a mask function, and the generated
policy compiled into the kernels (ptxas, no GPU)."""

import numpy as np
import pytest

import cuflash
from cuflash import mods
from cuflash._masks import MASKS, register_user_mask
from cuflash._validation import AttentionProblem, check_mask_mod
from cuflash.block_mask import tile_map_reference, tile_map_strides, tile_section_size, tile_states_reference
from cuflash.reference import attention_reference

from tests.helpers import needs_nvcc


def same_document(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def band(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 4)


def per_head(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + h


def _problem(**changes) -> AttentionProblem:
    fields = dict(batch=2, seqlen_q=10, seqlen_k=12, nheads=4, nheads_k=2, head_dim=64, dtype="bfloat16",
                  device=0, softmax_scale=0.125, causal=False)
    return AttentionProblem(**(fields | changes))


def test_tile_states_and_lists_of_a_band():
    condition = band(0, 0, np.arange(10)[:, None], np.arange(12)[None, :])
    states = tile_states_reference(condition, 4, 4)
    # Query tiles of 4 rows, key tiles of 4 keys: the band runs down the diagonal.
    np.testing.assert_array_equal(states, [[1, 0, 0], [1, 1, 0], [0, 1, 1]])
    section = tile_map_reference(states)
    m, n = states.shape
    assert len(section) == tile_section_size(m, n) == 4 * m * n + m + n
    ranks = section[m * n:2 * m * n].reshape(m, n)
    key_lists = section[2 * m * n:3 * m * n].reshape(m, n)
    query_lists = section[3 * m * n:4 * m * n].reshape(n, m)
    key_counts, query_counts = section[4 * m * n:4 * m * n + m], section[4 * m * n + m:]
    np.testing.assert_array_equal(ranks, [[0, -1, -1], [0, 1, -1], [-1, 0, 1]])
    np.testing.assert_array_equal(key_counts, [1, 2, 2])
    np.testing.assert_array_equal(query_counts, [2, 2, 1])
    assert list(key_lists[2, :2]) == [1, 2] and list(query_lists[0, :2]) == [0, 1]


def test_a_full_tile_is_full_and_edges_count_only_real_scores():
    condition = np.ones((5, 7), dtype=bool)
    np.testing.assert_array_equal(tile_states_reference(condition, 4, 4), [[2, 2], [2, 2]])
    condition[4, 6] = False
    np.testing.assert_array_equal(tile_states_reference(condition, 4, 4), [[2, 2], [2, 1]])


def test_tile_map_strides_share_the_dimensions_a_mask_does_not_read():
    section = tile_section_size(3, 2)
    assert tile_map_strides((1, 1), 10, 7, 4, 4) == (0, 0, section)
    assert tile_map_strides((2, 1), 10, 7, 4, 4) == (section, 0, 2 * section)
    assert tile_map_strides((2, 3), 10, 7, 4, 4) == (3 * section, section, 6 * section)


def test_block_mask_checks_its_arguments():
    doc = np.zeros((2, 10), dtype=np.int32)
    with pytest.raises(ValueError, match="needs batch"):
        cuflash.block_mask(same_document, None, 4, 10, 12, mod_arrays={"doc": doc})
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        cuflash.block_mask("q >= k", 2, 4, 10, 12)
    with pytest.raises(ValueError, match="seqlen_q must be an int >= 0"):
        cuflash.block_mask(band, None, None, -1, 12)
    with pytest.raises(TypeError, match="must return a condition"):
        cuflash.block_mask(lambda b, h, q, k: q - k, None, None, 10, 12)
    mask = cuflash.block_mask(same_document, 2, None, 10, 12, mod_arrays={"doc": doc})
    mask.check_call(2, 8, 10, 12)  # any head count: the mask does not read h
    torch = pytest.importorskip("torch")
    cuflash.block_mask(same_document, 2, None, 10, 12, mod_arrays={"doc": torch.zeros(2, 10, dtype=torch.int32)})
    with pytest.raises(ValueError, match="BlockMask for batch 2, but the call has batch 3"):
        mask.check_call(3, 8, 10, 12)


def test_check_mask_mod_registers_the_policy_and_its_map_sections():
    problem = check_mask_mod(_problem(), per_head, {})
    mask = problem.mask
    assert mask is MASKS[problem.mask_name] and mask.tile_map and mask.cxx.startswith("cuflash::UserMask<")
    assert problem.tile_map_dims == (1, 4)  # reads h, not b
    assert check_mask_mod(_problem(), band, {}).tile_map_dims == (1, 1)
    for changes, match in ((dict(causal=True), "does not combine with causal"),
                           (dict(window=(3, 0)), "does not combine with causal"),
                           (dict(packed_rows=(20, 24)), "dense batches")):
        with pytest.raises(ValueError, match=match):
            check_mask_mod(_problem(**changes), band, {})


def test_plans_carry_the_tile_maps_strides_and_tiles():
    from cuflash._tiling import Tiling
    from cuflash.api import _variant_fields
    from cuflash._params import VARIANT_PARAMS

    problem = check_mask_mod(_problem(), per_head, {})
    fields = dict(zip(VARIANT_PARAMS.names, _variant_fields(problem, Tiling(64, 4, 8, 4))))
    section = tile_section_size(3, 2)
    assert (fields["tile_map_batch_stride"], fields["tile_map_head_stride"]) == (0, section)
    assert (fields["tile_map_block_m"], fields["tile_map_block_n"]) == (4, 8)
    assert fields["tile_map"] == 0  # a plan slot writes each call's


def test_the_reference_applies_the_mask_function():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 9, 2, 8)) for _ in range(3))
    got, lse = attention_reference(q, k, v, mask_mod=band)
    want, want_lse = attention_reference(q, k, v, window_size=(3, 0), causal=True)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_generated_rule_is_the_condition():
    trace = mods.trace_mask_mod(same_document, {"doc": np.zeros((2, 10), dtype=np.int32)})
    cxx, code = mods.mask_rule(trace)
    assert cxx.startswith("cuflash::UserRule_same_document_")
    assert "static CUFLASH_HOST_DEVICE bool visible" in code and "struct Row { int p0; };" in code
    assert register_user_mask(trace).rule_cxx == cxx


@needs_nvcc
def test_user_masks_compile_into_the_kernels():
    """A traced mask's policy built into every attention family and the tile
    map builder as NVRTC would build them (tools/kernel_report.py's ptxas
    run, no GPU), the tensor-core ones without spilling more than the
    report allows."""
    import sys

    from cuflash._kernel_families import FAMILY, KernelVariant
    from cuflash._loader import kernel_source_dir

    sys.path.insert(0, str(kernel_source_dir().parent / "tools"))
    import kernel_report

    mask = register_user_mask(mods.trace_mask_mod(same_document, {"doc": np.zeros((2, 10), dtype=np.int32)}))
    variants = []
    for family, dtype, arch, modes in (("forward-wgmma", "bfloat16", "sm_90a", [None]),
                                       ("backward-dkdv-wgmma", "bfloat16", "sm_90a", ["atomic", "ordered"]),
                                       ("forward-mma", "float16", "sm_80", [None]),
                                       ("backward-dkdv-mma", "float16", "sm_80", ["atomic", "ordered"]),
                                       ("backward-dkdv", "float32", "sm_80", ["atomic"]),
                                       ("backward-dq", "float32", "sm_80", [None])):
        tiling = FAMILY[family].tiles_on(dtype, 64, 90 if arch == "sm_90a" else 80)
        for mode in modes:
            options = {} if mode is None else {"dq_mode": mode}
            variants.append((FAMILY[family].variant(dtype, tiling, mask, **options), arch))
    builder = KernelVariant(source="block_map.cu", function="cuflash::fill_tile_states",
                            params="cuflash::TileMapShape", template_args=(mask.rule_cxx,), key="states",
                            threads=256, smem_bytes=0, prelude=mask.prelude)
    for variant, arch in variants:
        (row,) = kernel_report.compile_report([variant], arch)
        assert row["registers"] > 0, row
        assert row["spill_stores"] <= kernel_report.spill_limit(variant.key), row
    assert "fill_tile_states" in kernel_report._translation_unit([builder])


@needs_nvcc
def test_hopper_forward_takes_a_causal_document_mask_without_spilling():
    """The fast path (the wgmma forward, d128): a mask reading two
    document ids per score spilled 8-20 bytes there before its rule came in
    parts (the ids once a row and a key, mods.rule_parts); now none."""
    import sys

    from cuflash._kernel_families import FAMILY
    from cuflash._loader import kernel_source_dir

    sys.path.insert(0, str(kernel_source_dir().parent / "tools"))
    import kernel_report

    def causal_document(b, h, q_idx, kv_idx, doc):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    mask = register_user_mask(mods.trace_mask_mod(causal_document, {"doc": np.zeros((2, 4096), dtype=np.int32)}))
    family = FAMILY["forward-wgmma"]
    (row,) = kernel_report.compile_report([family.variant("bfloat16", family.tiles_on("bfloat16", 128, 90), mask)],
                                          "sm_90a")
    assert row["registers"] > 0 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row
