"""Every kernel variant the launcher can ask for compiles for sm_90a, and
ptxas reports its resources (CPU: nvcc only, no GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

from cuflash._masks import built_in_masks
from cuflash._tiling import DECODE_RING_STAGES
from tests.helpers import needs_nvcc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


@needs_nvcc
@pytest.mark.slow
def test_every_variant_compiles_and_is_reported():
    import kernel_report

    variants = kernel_report.variants_for(kernel_report.all_variants(), "sm_90a")
    rows = kernel_report.compile_report(variants, "sm_90a")
    assert len(rows) == len(variants) == len({v.key for v in variants})
    for row in rows:
        assert row["registers"] > 0 and row["registers"] <= 255
        # The fast path has no local memory at all; the limits of the others: kernel_report.spill_limit.
        limit = kernel_report.spill_limit(row["variant"])
        assert row["spill_stores"] <= limit and row["spill_loads"] <= limit, row
        if row["variant"].startswith(kernel_report.FAST_PATH):
            assert not row["wgmma_serialized"], row  # no wgmma made to wait for the one before it
    assert kernel_report.spill_limit("forward-wgmma/bfloat16/hdim128/m128n128w12/window/b1") == 0
    assert kernel_report.spill_limit("forward-mma/bfloat16/hdim64/m128n64w4/causal/paged/kv2") == 64
    assert kernel_report.spill_limit("forward-mma/float16/hdim96/m128n64w4/window/paged/kv1") == 136
    assert kernel_report.spill_limit("forward-mma/float16/hdim128/m128n64w4/window/kv1") == 32
    assert kernel_report.spill_limit("backward-dkdv-wgmma/bfloat16/hdim256/m64n64w12/window/q1/atomic-dq") == 0
    assert kernel_report.spill_limit("backward-dkdv-wgmma/bfloat16/hdim64/m128n128w12/window/q2/atomic-dq") == 12
    assert kernel_report.spill_limit("backward-dkdv-wgmma/bfloat16/hdim64/m128n128w12/causal/q2/atomic-dq") == 0
    assert kernel_report.spill_limit("backward-dkdv-wgmma/bfloat16/hdim256/m64n64w12/causal/q1/atomic-dq") == 0
    assert kernel_report.spill_limit("backward-dkdv-wgmma/bfloat16/hdim128/m64n128w12/causal/dropout/q2/atomic-dq") == 256
    # 111 tilings: float16, bfloat16, float32 (3xTF32), and float32's Hopper
    # tile at 256; the 16-bit decode tiles without and with split-KV (10 not
    # already there), the one-tile decode tiles whose warps split the keys,
    # without and with split-KV (24), and the latter's thread-block cluster
    # forms of 2, 4, 8 and 16 ranges (48, Hopper only); each with the three
    # masks and, in dense batches, the heaviest policies (a window with soft
    # cap and ALiBi); packed batches on every tiling but the decode ones
    # (19 x 3 masks); KV caches, contiguous and paged, on every 16-bit
    # tiling, decode ones included (104 x 3 each). On Hopper the one-tile
    # tiles and their cluster forms (72) copy K and V by the Tensor Memory
    # Accelerator in dense batches and contiguous caches (the same counts),
    # and paged caches have both forms (176 x 3); the one-tile tiles'
    # copy-engine ring of three K/V buffers (decode_ring) is built for all
    # three layouts (24 x 4 dense, 24 x 3 each cache)
    assert sum(row["variant"].startswith("forward-mma/") for row in rows) == (
        111 * 4 + 19 * 3 + (104 + 176) * 3 + 24 * 4 + 2 * 24 * 3)
    assert sum("/packed" in row["variant"] and row["variant"].startswith("forward-mma/") for row in rows) == 19 * 3
    assert sum("/cluster" in row["variant"] for row in rows) == 48 * 4 + 48 * 3 + 2 * 48 * 3
    assert sum("/tma" in row["variant"] for row in rows) == 72 * 4 + 2 * 72 * 3 + 24 * 4 + 2 * 24 * 3
    assert sum("/kv3/" in row["variant"] and "/tma" in row["variant"] for row in rows) == 24 * 4 + 2 * 24 * 3
    for layout, tilings in (("/cache/", 104 + 24), ("/paged/", 176 + 24)):
        assert sum(layout in row["variant"] and row["variant"].startswith("forward-mma/") for row in rows) == tilings * 3
    assert sum("/window/softcap-alibi-dropout" in row["variant"] for row in rows if row["variant"].startswith("forward-mma/")) == 111 + 24
    assert {row["variant"] for row in rows if row["variant"].startswith("kv-cache-append/")} == {
        f"kv-cache-append/{dtype}/{layout}" for dtype in ("float16", "bfloat16") for layout in ("cache", "paged")}
    # split-KV's float32 partials into each 16-bit dtype, and each dtype into itself; 4 or 32 states in flight;
    # 1 or 4 columns a lane, and 8 for 16-bit partials with 4 states in flight
    assert sum(row["variant"].startswith("merge-states/") for row in rows) == 3 * 2 * 2 + 2 * (3 + 2)
    # 38 tilings: head dims 32/64/96/128/192/256, the 192-row tile of 32
    # and the 128-row tiles of 32/64 for rows ending mid-sector (the latter
    # for short sequences), the short-sequence tiles (d64's two, d128's
    # one), and the products narrowed by wgmma_product_dim (48 in d48's
    # 192-row tile, which d40 runs too, d40's 128-row tile and d48's two
    # short tiles; 80 in 96's tile; 112 in 128's tile and its short one),
    # two dtypes; three masks and the heaviest policies dense, three masks
    # packed; the persistent forms of the 34 that are not d128's or d112's
    # short tile, without a mask and causal, identity, and causal soft cap
    # with ALiBi, dense
    assert sum(row["variant"].startswith("forward-wgmma/") for row in rows) == 38 * (4 + 3) + 34 * 3
    # 18 tilings (six buckets and the three narrowed products of
    # wgmma_product_dim, two dtypes), atomic and ordered dQ; the claimed
    # dQ mode for the dense causal and window masks and the heaviest
    # policies on the 14 tilings of head dims up to 128
    # (claimed_dq_applies); the direct one for those and the dense no-mask
    # policy (direct_dq_applies)
    assert sum(row["variant"].startswith("backward-dkdv-wgmma/") for row in rows) == 18 * ((4 + 3) * 2 + 4) + 14 * 3
    assert sum(row["variant"].endswith("/claimed-dq") for row in rows) == 14 * 3
    assert sum(row["variant"].endswith("/direct-dq") for row in rows) == 18 * 4


def test_hopper_only_variants_are_left_out_of_other_architectures():
    import kernel_report

    variants = kernel_report.all_variants()
    sm80 = kernel_report.variants_for(variants, "sm_80")
    assert not any(v.key.startswith(("forward-wgmma/", "backward-dkdv-wgmma/")) for v in sm80)
    # The mma.sync backward's 99 KiB tiles (4 head dims, 2 dtypes, every
    # mask, 2 dQ modes) are left out of Hopper's instead.
    small = kernel_report.small_smem_only_keys()
    # every mask dense and packed, and the heaviest policies dense
    assert len(small) == 4 * 2 * (2 * len(built_in_masks()) + 1) * 2 and all(key.startswith("backward-dkdv-mma/") for key in small)
    assert small <= {v.key for v in sm80}
    sm90a = kernel_report.variants_for(variants, "sm_90a")
    # An A100 block gets 163 KiB: float32's Hopper-only 3xTF32 tile at head
    # dim 256 (200 KiB: every mask dense and packed, the heaviest policies
    # dense) is left out there too.
    beyond_a100 = [v.key for v in variants if v.smem_bytes > 163 * 1024 and not v.key.startswith(
        kernel_report.HOPPER_ONLY) and "/tma" not in v.key]  # copy-engine forms: Hopper's own
    assert len(beyond_a100) == 2 * len(built_in_masks()) + 1
    assert all(key.startswith("forward-mma/float32/hdim256/") for key in beyond_a100)
    hopper_only = [v for v in variants if v.key.startswith(kernel_report.HOPPER_ONLY)]
    # the decode forward's thread-block cluster and copy-engine K/V variants: Hopper on
    clusters = [v for v in variants if v.cluster_blocks > 1]
    assert clusters and all("/cluster" in v.key for v in clusters)
    by_tma = {v.key for v in variants if "/tma" in v.key}
    hopper_forms = by_tma | {v.key for v in clusters}
    # ... where the copy-engine forms replace the one-tile decode variants of dense batches and contiguous
    # caches (paged ones keep theirs: page sizes that do not tile a key block); their rings of three
    # K/V buffers (decode_ring) have no cp.async form
    replaced = {v.key for v in variants if kernel_report._copy_engine_form_on_hopper(v.key)}
    rings = {key for key in by_tma if f"/kv{DECODE_RING_STAGES}/" in key}
    assert rings and all(f"/kv{DECODE_RING_STAGES}/" not in key for key in replaced)
    assert {key.replace("/split-keys", "/split-keys/tma") for key in replaced} == {
        key for key in by_tma - rings if "/paged" not in key}
    assert {"paged" if "/paged/" in key else "cache" if "/cache/" in key else "dense" for key in rings} == {
        "paged", "cache", "dense"}
    assert any("/paged" in key for key in by_tma) and not replaced & {v.key for v in sm90a}
    assert len(sm90a) == len(variants) - len(small) - len(replaced) == (
        len(sm80) + len(hopper_only) + len(hopper_forms) + len(beyond_a100) - len(small) - len(replaced))
    # sm_86/sm_89 (99 KiB) build only what fits them: the 99 KiB tiles, not
    # the A100 ones they replace.
    sm89 = {v.key for v in kernel_report.variants_for(variants, "sm_89")}
    assert small <= sm89 and all(v.smem_bytes <= 99 * 1024 for v in variants if v.key in sm89)
    assert not any(key.startswith("backward-dkdv-mma/bfloat16/hdim96/m64n128w8/causal/q2") for key in sm89)


@needs_nvcc
@pytest.mark.parametrize("only", ["forward-mma/bfloat16/hdim64", "forward-wgmma/bfloat16/hdim128",
                                  "backward-dkdv-wgmma/bfloat16/hdim128"])
def test_fast_path_spill_gate_command_line(only):
    """--fail-on-spill exits 1 if a selected variant spills past its limit
    (none on dense batches); the tensor-core forwards for Hopper (sm_90a)
    pass it."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "kernel_report.py"), "--arch", "sm_90a",
                             "--only", only, "--fail-on-spill"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # the three masks (and the heaviest policies dense), dense and packed;
    # the backward in both dQ modes (atomic, ordered), and claimed and
    # direct for the dense causal, window and heaviest policies (direct for
    # the dense one without a mask too); the mma.sync forward's
    # two kinds of decode tiles without and with split-KV and the four
    # cluster counts of the one-tile split beside its own (dense only), and
    # all nine for KV caches, contiguous and paged; the one-tile ones (two
    # and four cluster counts) in their copy-engine K/V form instead, and
    # for paged caches in both forms; the one-tile ones without and with
    # split-KV with a ring of three K/V buffers (decode_ring) for dense
    # batches and both caches too; the Hopper forward's short-sequence tile,
    # and the persistent form of its table tile (no mask and causal,
    # identity, and causal soft cap with ALiBi, dense), each also with its
    # products narrowed to 112 columns, as the Hopper backward's bucket
    # (wgmma_product_dim)
    expected = {"forward-mma": 9 * 4 + 3 + 2 * 9 * 3 + 6 * 3 + 2 * (4 + 3 + 3),
                "forward-wgmma": 2 * (2 * (4 + 3) + 3),
                "backward-dkdv-wgmma": 2 * ((4 + 3) * 2 + 3 + 4)}[only.split("/")[0]]
    assert result.stdout.count(only) == expected


@needs_nvcc
def test_report_command_line_on_a_subset():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "kernel_report.py"), "--arch", "sm_80",
                             "--only", "forward/bfloat16/hdim128", "--json"], capture_output=True, text=True,
                            check=True)
    import json

    rows = json.loads(result.stdout)
    assert {r["variant"] for r in rows} == {f"forward/bfloat16/hdim128/m32n64w4/{mask}{layout}"
                                           for mask in ("none", "causal", "window") for layout in ("", "/packed")
                                           } | {"forward/bfloat16/hdim128/m32n64w4/window/softcap-alibi-dropout"}
    assert all(r["arch"] == "sm_80" and r["dynamic_smem"] > 0 for r in rows)


@needs_nvcc
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_hopper_forward_softmax_runs_beside_its_own_p_v(head_dim, mask):
    """In the Hopper forward's SASS every wait for S_i alone is followed by
    the whole block's exponentials before any other wgmma wait: the softmax
    runs while P_{i-1} V_{i-1} is in the tensor cores. (ptxas hoisted the
    wait for P V above them while it sat after the softmax in the same basic
    block: d128 at 16k ran at 566 TFLOP/s, 711 without.) The persistent form
    too."""
    import kernel_report

    if kernel_report.cuobjdump() is None:
        pytest.skip("needs cuobjdump (the test extra's nvidia-cuda-cuobjdump)")
    from cuflash._kernel_families import FAMILY
    from cuflash._masks import MASKS
    from cuflash._tiling import wgmma_forward_persistent, wgmma_forward_tiling

    family = FAMILY["forward-wgmma"]
    tiling = wgmma_forward_tiling("bfloat16", head_dim)
    per_thread = tiling.block_n // 2  # a consumer thread's scores of one key block
    for form in (tiling, wgmma_forward_persistent(tiling, "bfloat16", "none", "dense", False, 512)):
        counts = kernel_report.exponentials_after_score_waits(
            kernel_report.sass_of(family.variant("bfloat16", form, MASKS[mask])))
        assert counts and all(count >= per_thread for count in counts), (form, counts)


@needs_nvcc
@pytest.mark.parametrize("family_name", ["forward-wgmma", "backward-dkdv-wgmma"])
@pytest.mark.parametrize("score", [(False, False, False), (True, True, False), (False, False, True)],
                         ids=["identity", "softcap-alibi", "dropout"])
def test_hopper_kernels_have_no_double_precision_instructions(family_name, score):
    """No float64 instruction in the Hopper kernels' SASS. Their scale, soft
    cap, ALiBi scale and dropout factor were float64 parameters, converted
    where read; ptxas re-read and converted them inside the main loops
    (F2F.F64 and a DSETP each step on the slow double-precision pipe: ~7% of
    the backward's stall samples at d128; the soft cap's reciprocal a DFMA
    sequence). They are float32 now, rounded once on the host."""
    import kernel_report

    if kernel_report.cuobjdump() is None:
        pytest.skip("needs cuobjdump (the test extra's nvidia-cuda-cuobjdump)")
    from cuflash._kernel_families import FAMILY
    from cuflash._masks import MASKS, score_for
    from cuflash._tiling import wgmma_forward_tiling

    family = FAMILY[family_name]
    tiling = (wgmma_forward_tiling("bfloat16", 128) if family_name == "forward-wgmma"
              else family.tiles("bfloat16", 128))
    sass = kernel_report.sass_of(family.variant("bfloat16", tiling, MASKS["causal"], score_for(*score)))
    assert sass and kernel_report.double_precision_instructions(sass) == []


#: Integer ALU instructions (kernel_report.opcode_classes) in the Hopper
#: backward's main loop, no mask, bf16: cfde18a's counts (273, 143, 138,
#: 103; the loop's span includes its skipped masking block) with about 15%
#: slack. Before it, the dQ tile's stores evaluated the swizzle formula per
#: store in signed arithmetic on the lane index: 434, 252, 298 and 445, and
#: the d128 backward ran 3-6% slower (docs/perf-notes.md).
_BACKWARD_LOOP_INTEGER_CEILING = {64: 315, 96: 165, 128: 160, 256: 120}


@needs_nvcc
@pytest.mark.parametrize("head_dim", sorted(_BACKWARD_LOOP_INTEGER_CEILING))
def test_hopper_backward_loop_keeps_its_address_arithmetic_small(head_dim):
    """The Hopper backward is bound by what its consumers issue: a step's
    integer work stays near what its addresses need (the loop found by its
    back edge, kernel_report.main_loop)."""
    import kernel_report

    if kernel_report.cuobjdump() is None:
        pytest.skip("needs cuobjdump (the test extra's nvidia-cuda-cuobjdump)")
    from cuflash._kernel_families import FAMILY
    from cuflash._masks import MASKS

    family = FAMILY["backward-dkdv-wgmma"]
    loop = kernel_report.main_loop(
        kernel_report.sass_of(family.variant("bfloat16", family.tiles("bfloat16", head_dim), MASKS["none"])))
    counts = kernel_report.opcode_classes(loop)
    assert counts["wgmma"] >= 28, counts  # the consumer loop, not a copy loop
    assert counts["integer"] <= _BACKWARD_LOOP_INTEGER_CEILING[head_dim], counts


def test_main_loop_takes_the_conditional_back_edge_with_most_wgmma():
    """main_loop on a hand-made listing: instruction i at byte 16 i; the
    unconditional branch back (a wait's out-of-line retry) and the short
    spin loop without wgmma are not the main loop."""
    import kernel_report

    sass = ["MOV R1, R2", "HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0", "IMAD R3, R3, 0x2, RZ",
            "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R2", "@!P0 BRA 0x30",
            "HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0", "@P1 BRA 0x10", "EXIT", "BRA 0x0"]
    assert kernel_report.main_loop(sass) == sass[1:7]
    assert kernel_report.opcode_classes(sass[1:7]) == {"integer": 1, "uniform": 0, "wgmma": 2, "mufu": 0,
                                                       "other": 3}
