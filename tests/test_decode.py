"""Decoding's planning without a GPU: grouped-query packing of one query
token, the split count, the work buffers, and the argument checks of
``num_splits`` and ``merge_attention_states``."""

import dataclasses

import pytest

from cuflash import api
from cuflash._tiling import MMA_DECODE_TILES, decode_tilings
from cuflash._validation import AttentionProblem, TensorMeta, check_merge, check_num_splits


def _problem(batch=2, seqlen_q=1, seqlen_k=4096, nheads=32, nheads_k=8, head_dim=128, causal=True):
    return AttentionProblem(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
                            head_dim=head_dim, dtype="bfloat16", device=0, softmax_scale=0.1, causal=causal)


def _layouts(problem):
    q = api.Layout.contiguous((problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim), problem.dtype)
    kv = api.Layout.contiguous((problem.batch, problem.seqlen_k, problem.nheads_k, problem.head_dim), problem.dtype)
    return {"q": q, "k": kv, "v": kv, "out": q}


def test_one_token_packs_the_query_heads_of_each_kv_head_as_rows():
    problem = _problem()
    shape = api.decode_shape(problem, _layouts(problem))
    assert shape.packed and shape.lse_head_stride == 4
    packed = shape.problem
    assert (packed.seqlen_q, packed.nheads, packed.nheads_k, packed.causal) == (4, 8, 8, False)
    item = 2
    # q (2, 1, 32, 128) as (2, 4, 8, 128): row g of K/V head h is query head 4 h + g.
    q = shape.layouts["q"]
    assert q.shape == (2, 4, 8, 128)
    assert q.strides == (32 * 128 * item, 128 * item, 4 * 128 * item, item)
    for h in range(8):
        for g in range(4):
            assert h * q.strides[2] + g * q.strides[1] == (4 * h + g) * 128 * item
    assert shape.layouts["k"] == _layouts(problem)["k"]


@pytest.mark.parametrize("change", [dict(seqlen_q=2), dict(nheads_k=32)])
def test_other_calls_keep_their_shape(change):
    problem = dataclasses.replace(_problem(), **change)
    shape = api.decode_shape(problem, _layouts(problem))
    assert not shape.packed and shape.problem == problem and shape.lse_head_stride == problem.seqlen_q


def test_decode_splits_leave_no_key_range_empty():
    problem = _problem(seqlen_k=1000)
    _, split = decode_tilings("bfloat16", 128)
    key_blocks = -(-1000 // split.block_n)  # 16
    assert api.decode_splits(problem, split, 1) == 1
    assert api.decode_splits(problem, split, 4) == 4
    # 6 ranges of 16 blocks would be 3 blocks each: 6 ranges, none empty; 12 -> 2 each: 8 ranges.
    assert api.decode_splits(problem, split, 6) == 6
    assert api.decode_splits(problem, split, 12) == 8
    assert api.decode_splits(problem, split, 200) == key_blocks


def test_work_buffers_of_a_split_forward():
    problem = _problem(seqlen_q=4, nheads=8)
    assert api.forward_work_buffers(problem, 1) == {}
    assert api.forward_work_buffers(problem, 3) == {"out_partial": ((3, 2, 4, 8, 128), "float32"),
                                                    "lse_partial": ((3, 2, 8, 4), "float32")}


def test_decode_tiles_hold_a_packed_group_and_both_modes():
    for head_dim in (8, 64, 80, 128, 200, 256):
        plain, split = decode_tilings("float16", head_dim)
        assert not plain.split_kv and split.split_kv and plain.block_m == split.block_m == 64
        assert plain.kernel == "mma" and plain.head_dim_padded in MMA_DECODE_TILES
        assert not plain.warps_split_keys
        # up to 16 rows (one token, up to 16 query heads per K/V head): one m16 tile, the warps splitting the keys
        for rows in (1, 4, 16):
            plain, split = decode_tilings("float16", head_dim, rows)
            assert plain.block_m == split.block_m == 16 and plain.warps_split_keys and split.warps_split_keys
            assert not plain.split_kv and split.split_kv and plain.block_n // plain.warps % 16 == 0
        assert decode_tilings("float16", head_dim, 17)[0].block_m == 64
    assert decode_tilings("float32", 64) == ()


@pytest.mark.parametrize("value,error,match", [
    (0, ValueError, "from 1 to 256"), (257, ValueError, "from 1 to 256"), (2.0, TypeError, "an int"),
    (True, TypeError, "an int")])
def test_num_splits_is_checked(value, error, match):
    with pytest.raises(error, match=f"num_splits must be.*{match}"):
        check_num_splits(value)
    assert check_num_splits(None) is None and check_num_splits(3) == 3


def _meta(name, shape, dtype="float32"):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return TensorMeta(name, tuple(shape), tuple(reversed(strides)), dtype, 0)


def test_merge_checks_name_the_argument():
    outs, lses = _meta("outs", (3, 2, 5, 4, 8)), _meta("lses", (3, 2, 4, 5))
    problem = check_merge(outs, lses, None, None)
    assert (problem.num_states, problem.batch, problem.seqlen, problem.nheads, problem.head_dim) == (3, 2, 5, 4, 8)
    with pytest.raises(ValueError, match=r"lses must have shape \(num_states, batch, nheads, seqlen\)"):
        check_merge(outs, _meta("lses", (3, 2, 5, 4)), None, None)
    with pytest.raises(ValueError, match="outs must hold at least one state"):
        check_merge(_meta("outs", (0, 2, 5, 4, 8)), _meta("lses", (0, 2, 4, 5)), None, None)
    with pytest.raises(TypeError, match="out must have the dtype of outs"):
        check_merge(outs, lses, _meta("out", (2, 5, 4, 8), "float16"), None)
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen\)"):
        check_merge(outs, lses, None, _meta("lse", (2, 5, 4)))
    with pytest.raises(TypeError, match="outs must have dtype"):
        check_merge(_meta("outs", (3, 2, 5, 4, 8), "int32"), lses, None, None)


def test_split_kv_fills_one_block_an_sm_and_the_merges_round(monkeypatch):
    """Split-KV fills one wave of one decode block per SM, as exactly as the
    key blocks allow (measured faster on the H100 than two blocks an SM,
    with three K/V buffers a block); a count past the merge kernel's states
    a round trip (DECODE_MERGE_STATES_A_ROUND) takes it instead where its
    ranges are nearly as short; none where the grid already nearly fills
    the GPU."""
    from cuflash._tiling import DECODE_BLOCKS_PER_SM, DECODE_MERGE_STATES_A_ROUND, wave_efficient_splits

    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90)
    _, split = decode_tilings("bfloat16", 128)
    assert DECODE_BLOCKS_PER_SM == 1 and DECODE_MERGE_STATES_A_ROUND == 32
    # 1 x 131072 keys, 8 K/V heads (packed GQA): 8 x 16 blocks of 132 slots
    long = dataclasses.replace(_problem(batch=1, seqlen_k=131072), seqlen_q=4, nheads=8, causal=False)
    assert api.decode_splits(long, split, None) == 16
    assert wave_efficient_splits(8, 132, 131072 // split.block_n) == 15  # FlashAttention-2's 85% rule
    # 4 K/V heads: 33 ranges fill 132 slots, 32 fill 128 in one merge round trip
    four = dataclasses.replace(long, nheads=4)
    assert wave_efficient_splits(4, 132, 2048, max_splits=33, tolerance=1.0) == 33
    assert api.decode_splits(four, split, None) == 32
    # 3 K/V heads: 44 ranges (132 slots) against 32 (96): ranges of 47 key blocks against 64
    assert api.decode_splits(dataclasses.replace(long, nheads=3), split, None) == 44
    # 33 ranges whose 32 would be longer past the tolerance stay: 257 key blocks (33 of 8 against 32 of 9,
    # which rounds to 29), 1089 (33 of 33 against 35)
    for key_blocks in (257, 1089):
        keys = dataclasses.replace(four, seqlen_k=key_blocks * split.block_n)
        assert api.decode_splits(keys, split, None) == 33, key_blocks
    # 8 x 16384: 64 parallel blocks, 2 ranges (128 of 132 slots), not a second wave
    assert api.decode_splits(dataclasses.replace(long, batch=8, seqlen_k=16384), split, None) == 2
    # 16 x 1024: 128 blocks unsplit nearly fill the GPU
    assert api.decode_splits(dataclasses.replace(long, batch=16, seqlen_k=1024), split, None) == 1


@pytest.mark.parametrize("generation", [90, 80])
def test_a_launch_just_past_one_wave_splits_long_keys_in_two(monkeypatch, generation):
    """More blocks than the SMs hold at once of the two-block cluster form
    (the occupancy calculator's count) but at most 1.5 times as many
    (DECODE_TAIL_SPLIT_WAVES): on Hopper, two key ranges as a cluster of
    two where each keeps DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS key blocks
    (measured faster on the H100: the unsplit second wave leaves most SMs
    idle; the merge kernel's two ranges lost the gain); unsplit below one
    wave, past 1.5 waves, with shorter halves, without clusters, or where
    the caller gives the count."""
    from cuflash._tiling import DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS, DECODE_TAIL_SPLIT_WAVES

    held = 3 * 132  # three one-tile blocks an SM
    assert 1 < 512 / held <= DECODE_TAIL_SPLIT_WAVES

    def choice(batch, seqlen_k, blocks_per_sm=3, num_splits=None):
        choose = _decode_plan_choice(monkeypatch, generation, blocks_per_sm, batch=batch, seqlen_k=seqlen_k,
                                     nheads=32, nheads_k=4, causal=False)
        tiling, _, splits = choose(num_splits)
        return tiling.cluster_splits, splits

    block_n = 64
    long_enough = 2 * DECODE_TAIL_SPLIT_MIN_RANGE_BLOCKS * block_n
    # 4 K/V heads x 128 sequences: 512 blocks, 1.29 waves
    tail = (2, 2) if generation >= 90 else (1, 1)
    assert choice(128, long_enough) == tail and choice(128, 16384) == tail
    assert choice(128, long_enough - block_n) == (1, 1)  # halves one key block short
    assert choice(256, 16384) == (1, 1)  # 1024 blocks, 2.6 waves
    assert choice(96, 16384) == (1, 1)  # 384 blocks: one wave
    assert choice(128, 16384, blocks_per_sm=4) == (1, 1)  # four an SM: 512 blocks fit one wave
    assert choice(128, 16384, num_splits=1) == (1, 1)


@pytest.mark.parametrize("smem_kib,head_dim,expected", [(227, 192, (16, True)), (227, 256, (16, True)),
                                                         (99, 128, (16, True)), (99, 192, (64, False)),
                                                         (99, 256, (64, False)), (72, 128, None)])
def test_decode_tiles_fit_the_gpus_shared_memory(monkeypatch, smem_kib, head_dim, expected):
    """The one-tile decode tiles where they fit the GPU's shared memory, else
    the 64-row ones (a 99 KiB GPU, sm_86/sm_89, at head dims 192 and 256),
    else no decoding (the chosen kernel, unsplit)."""
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90 if smem_kib == 227 else 80)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 128)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: smem_kib * 1024)
    monkeypatch.setattr(api, "_decode_blocks_per_sm", lambda problem, tiling: 1)  # the occupancy, without a GPU
    problem = _problem(batch=1, seqlen_k=65536, head_dim=head_dim)
    tiling, shape, splits = api._forward_tiles(problem, _layouts(problem), True, None)
    assert tiling.forward_smem_bytes("bfloat16") <= smem_kib * 1024
    if expected is None:
        assert not tiling.split_kv and splits == 1 and not shape.packed
        with pytest.raises(ValueError, match="num_splits applies to decoding"):
            api._forward_tiles(problem, _layouts(problem), True, 4)
    else:
        assert (tiling.block_m, tiling.warps_split_keys) == expected and tiling.split_kv and splits > 1


def test_cluster_counts_fit_a_slot_fewer_than_the_kernel_holds():
    """Clusters of the largest allowed count whose blocks leave one slot an
    SM free (all of them with one block an SM) and keep two key blocks a
    range, where the ranges are short enough."""
    from cuflash._tiling import DECODE_CLUSTER_SPLITS, decode_cluster_count

    assert DECODE_CLUSTER_SPLITS == (2, 4, 8, 16)
    # 32 K/V heads x 1 sequence, 16 key blocks: three blocks an SM -> 8 (256 <= 264); two -> 4 (128 <= 132)
    assert decode_cluster_count(32, 132, 16, blocks_per_sm=3, splits=16) == 8
    assert decode_cluster_count(32, 132, 16, blocks_per_sm=2, splits=16) == 4
    assert decode_cluster_count(32, 132, 16, blocks_per_sm=1, splits=16) == 4
    # 4 blocks, 16 key blocks: 16 ranges would be one key block each
    assert decode_cluster_count(4, 132, 16, blocks_per_sm=3, splits=16) == 8
    assert decode_cluster_count(4, 132, 64, blocks_per_sm=3, splits=16) == 16
    # nothing fits: the merge kernel's ranges stay
    assert decode_cluster_count(200, 132, 64, blocks_per_sm=2, splits=16) == 1
    assert decode_cluster_count(4, 132, 3, blocks_per_sm=3, splits=16) == 1
    # long ranges stay with the merge kernel: beyond 16 key blocks a range
    assert decode_cluster_count(32, 132, 128, blocks_per_sm=3, splits=16) == 8
    assert decode_cluster_count(32, 132, 256, blocks_per_sm=3, splits=16) == 1
    assert decode_cluster_count(32, 132, 64, blocks_per_sm=2, splits=16) == 4
    assert decode_cluster_count(32, 132, 128, blocks_per_sm=2, splits=16) == 1
    # the heuristic's two ranges run as clusters of two at any length (4 K/V heads x 32 x 4096 keys: 128
    # blocks, 64 key blocks), a count of three as the merge kernel's
    assert decode_cluster_count(128, 132, 64, blocks_per_sm=3, splits=2) == 2
    assert decode_cluster_count(128, 132, 1024, blocks_per_sm=3, splits=2) == 2
    assert decode_cluster_count(80, 132, 1024, blocks_per_sm=3, splits=3) == 1


def test_copy_engine_kv_on_hopper_but_not_without_keys(monkeypatch):
    """Hopper's one-tile decode copies K and V by tensor maps; a call with
    no keys (seqlen_k 0: a tensor map has no empty dimension) and GPUs before
    Hopper keep cp.async."""
    tiling, _, _ = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=1024)()
    assert tiling.kv_tma and tiling.warps_split_keys
    tiling, _, _ = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=0)()
    assert not tiling.kv_tma
    tiling, _, _ = _decode_plan_choice(monkeypatch, 80, batch=1, seqlen_k=1024)()
    assert not tiling.kv_tma


def test_clusters_apply_to_small_counts_and_short_ranges():
    from cuflash._tiling import decode_clusters_apply

    assert decode_clusters_apply(16, 1000) and decode_clusters_apply(2, 8)
    # a count above 16: only where 16 clusters' ranges would be at most 4 key blocks
    assert decode_clusters_apply(33, 64) and not decode_clusters_apply(33, 65)


def _decode_plan_choice(monkeypatch, generation, blocks_per_sm=3, **problem_args):
    monkeypatch.setattr(api, "_kernel_generation", lambda device: generation)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(api, "_decode_blocks_per_sm", lambda problem, tiling: blocks_per_sm)
    problem = _problem(**problem_args)
    return lambda num_splits=None: api._forward_tiles(problem, _layouts(problem), True, num_splits)


def test_hopper_decodes_few_ranges_as_clusters(monkeypatch):
    choose = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=1024, nheads=32, nheads_k=32)
    tiling, shape, splits = choose()
    assert (tiling.cluster_splits, splits) == (8, 8) and tiling.split_kv and tiling.warps_split_keys
    tiling, _, splits = choose(4)  # the caller's count, where it is a cluster's
    assert (tiling.cluster_splits, splits) == (4, 4)
    tiling, _, splits = choose(3)  # not a cluster's count: the merge kernel
    assert (tiling.cluster_splits, splits, tiling.split_kv) == (1, 3, True)
    # A long cache over few heads: ranges too long for a cluster, the merge kernel (three K/V buffers).
    tiling, _, splits = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=131072)()
    assert tiling.cluster_splits == 1 and splits == 16 and tiling.kv_stages == 3
    # Ranges of a cluster's count but too long (the heuristic's 4 of 64 key blocks): the merge kernel.
    tiling, _, splits = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=16384, nheads=32, nheads_k=32)()
    assert tiling.cluster_splits == 1 and splits == 4
    # Before Hopper: no clusters.
    tiling, _, splits = _decode_plan_choice(monkeypatch, 80, batch=1, seqlen_k=1024, nheads=32, nheads_k=32)()
    assert tiling.cluster_splits == 1 and splits > 1
    # A heuristic count above 16 whose ranges would be short as 16 clusters: clusters (1 x 4096 keys, 4 K/V
    # heads: 64 key blocks); with 16 key blocks a range (1 x 16384) the merge kernel's ranges stay.
    tiling, _, splits = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=4096, nheads=32, nheads_k=4)()
    assert (tiling.cluster_splits, splits) == (16, 16)
    tiling, _, splits = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=16384, nheads=32, nheads_k=4)()
    assert tiling.cluster_splits == 1 and splits > 16
    # Cluster counts switched off (the merge kernel for every count).
    from cuflash import _tiling

    monkeypatch.setattr(_tiling, "DECODE_CLUSTER_SPLITS", ())
    tiling, _, splits = _decode_plan_choice(monkeypatch, 90, batch=1, seqlen_k=1024, nheads=32, nheads_k=32)()
    assert tiling.cluster_splits == 1 and splits > 1


def test_cluster_plans_launch_one_kernel_without_work_buffers(monkeypatch):
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    monkeypatch.setattr(api, "_decode_blocks_per_sm", lambda problem, tiling: 3)
    launched = []
    monkeypatch.setattr(api.loader, "get", lambda variant, device: launched.append(variant) or variant)
    problem = _problem(batch=1, seqlen_k=1024, nheads=32, nheads_k=32)
    parts = api._forward_parts(problem, _layouts(problem), True)
    assert len(parts.launches) == 1 and parts.work_buffers == {}
    (launch,) = parts.launches
    assert launch.grid == 32 * 8  # 32 heads x one query block x 8 ranges, consecutive ranges one cluster
    # A dense batch on Hopper: its whole key blocks by the copy engine, whose maps ride in the parameters.
    assert launched[-1].function == "cuflash::flash_forward_mma_tma_cluster_kernel"
    assert launched[-1].params.endswith("WgmmaForwardParams") and [slot for slot, _ in parts.tensor_maps] == [
        "k.ptr", "v.ptr"]
    assert launched[-1].cluster_blocks == 8 and launched[-1].key.endswith("/tma/cluster8")
    assert parts.structs[0]["num_splits"] == 8


def test_cluster_tilings_are_split_kv_decode_tiles_built_for_hopper_only():
    import sys

    from cuflash._tiling import Tiling, decode_cluster_tiling, every_decode_tiling

    with pytest.raises(ValueError, match="cluster_splits applies"):
        Tiling(128, 16, 64, 4, kernel="mma", kv_stages=2, warps_split_keys=True, cluster_splits=4)
    plain, split = decode_tilings("bfloat16", 128, 16)
    assert decode_cluster_tiling(split, 3) is None and decode_cluster_tiling(plain, 4) is None
    _, wide = decode_tilings("bfloat16", 128, 64)
    assert decode_cluster_tiling(wide, 4) is None  # 64-row tiles: warps own rows, not keys
    assert {t.cluster_splits for t in every_decode_tiling("bfloat16", 128)} == {1, 2, 4, 8, 16}
    sys.path.insert(0, "tools")
    import kernel_report

    from cuflash._kernel_families import family_of
    from cuflash._masks import MASKS

    variant = family_of("forward", "mma").variant("bfloat16", decode_cluster_tiling(split, 8), MASKS["causal"],
                                                  layout="paged")
    assert kernel_report.variants_for([variant], "sm_90a") == [variant]
    assert kernel_report.variants_for([variant], "sm_90") == [variant]
    assert kernel_report.variants_for([variant], "sm_80") == []


@pytest.mark.parametrize("generation,kernel,dependent", [(90, "mma", True), (80, "mma", False), (90, "wgmma", False)])
def test_the_mma_forward_is_a_dependent_launch_on_hopper(monkeypatch, generation, kernel, dependent):
    """The mma.sync forward (whose blocks wait for the kernel ahead before
    any global access, flash_fwd_mma.cu) is launched with programmatic
    stream serialization on Hopper; the others are not (they do not wait)."""
    monkeypatch.setattr(api, "_kernel_generation", lambda device: generation)
    tiling = dataclasses.replace(decode_tilings("bfloat16", 128)[1], kernel=kernel)
    assert api._forward_launch_dependent(_problem(batch=1, seqlen_k=4096), tiling) is dependent
