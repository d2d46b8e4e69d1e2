"""The simulator's time model (cuflash/simulate/timing.py): thread blocks in
waves, the pipes of an SM, and its fit to the H100 measurements (CPU only)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cuflash.cli import main
from cuflash.simulate import MACHINES, Problem
from cuflash.simulate.timing import (KERNEL_COSTS, BlockWork, KernelCost, _makespan, block_seconds, estimate,
                                     launches)

REPO = Path(__file__).resolve().parent.parent
H100 = MACHINES["h100"]


def _h100_rows():
    rows = json.loads((REPO / "benchmarks" / "h100.json").read_text())["rows"]
    return [row for row in rows if row["dtype"] == "bfloat16" and row["pass"] in ("fwd", "bwd")]


@pytest.mark.parametrize("algorithm,measured_as", [("cuflash", "cuflash"), ("flash2", "flash")])
def test_model_is_within_25_percent_of_every_h100_grid_point(algorithm, measured_as):
    """Issue 18's bar: the model's time of the forward and the backward at
    every point of the FlashAttention-2 grid within 25% of the measurement
    (benchmarks/h100.json, bf16)."""
    rows = _h100_rows()
    assert len(rows) == 48  # 2 head dims x 6 lengths x causal or not x fwd, bwd
    for row in rows:
        problem = Problem(batch=row["batch"], nheads=row["heads"], seqlen_q=row["seqlen"], head_dim=row["head_dim"],
                          causal=row["causal"])
        model = estimate(algorithm, problem, H100, row["pass"])["seconds"] * 1e3
        assert abs(model / row["ms"][measured_as] - 1) <= 0.25, (row["pass"], row["head_dim"], row["seqlen"],
                                                                  row["causal"], model, row["ms"][measured_as])


def test_decode_rows_of_issue_15_are_explained_by_whole_tiles(monkeypatch):
    """benchmarks/h100_decode.json (issue 15's measurements, no constant fitted
    to them): cuflash's one-token blocks cost whole 128-row tiles and re-read
    K/V per query head. With the constants of the forward those rows
    measured (71648b2's, before 0fe28cc: the softmax not yet behind its own
    P V, no DRAM terms) the model puts its times within 15% of the
    measurement (11% at most); flash-decoding (packed, split, DRAM-bound)
    within 30%, and faster than cuflash wherever heads are grouped, as
    measured. (The forward's constants now describe a faster kernel, d128
    at 16k 566 -> 806 TFLOP/s, with DRAM terms fitted to its short calls:
    they put these rows 32-48% off, rows of a kernel they do not describe.)"""
    from cuflash.simulate import timing
    from cuflash.simulate.timing import compare_with_bench, ranking_agreement

    monkeypatch.setitem(timing.KERNEL_COSTS, ("cuflash", "fwd", 90),
                        KernelCost(0.60, 0.40, 0, 2500, "the wgmma forward of 71648b2"))
    rows = json.loads((REPO / "benchmarks" / "h100_decode.json").read_text())["rows"]
    records = compare_with_bench(rows, H100)
    assert len(records) == 8
    for record in records:
        assert abs(record["error"]) <= (0.15 if record["algorithm"] == "cuflash" else 0.30), record
    by_shape = {}
    for record in records:
        by_shape.setdefault((record["batch"], record["seqlen_k"], record["kv_heads"]), {})[record["algorithm"]] = record
    for (batch, seqlen_k, kv_heads), pair in by_shape.items():
        if kv_heads < 32:
            assert pair["flash-decoding"]["model_ms"] < pair["cuflash"]["model_ms"] / 2, (batch, seqlen_k)
    # every row as measured (the MHA row, DRAM-bound for both, tied before
    # flash2's forward read at its own DRAM efficiency)
    assert ranking_agreement(records) == (4, 4)


def test_a_one_row_block_costs_a_whole_tile():
    # the kernels before cuflash's decode path (whose 64-row decode tiles now take the one-row block)
    one = estimate("cuflash", Problem(batch=1, nheads=132, seqlen_q=1, seqlen_k=8192, head_dim=128,
                                      cuflash_decode=False), H100, "fwd")
    full = estimate("cuflash", Problem(batch=1, nheads=132, seqlen_q=128, seqlen_k=8192, head_dim=128), H100, "fwd")
    assert one["launches"][0]["compute_s"] == pytest.approx(full["launches"][0]["compute_s"])


def test_split_kv_adds_a_merge_launch_and_shortens_a_lone_sequence():
    problem = Problem(batch=1, nheads=8, seqlen_q=1, seqlen_k=65536, head_dim=128)
    alone = estimate("cuflash", Problem(**{**problem.__dict__, "num_splits": 1}), H100, "fwd")
    split = estimate("cuflash", Problem(**{**problem.__dict__, "num_splits": 24}), H100, "fwd")
    assert [launch["name"] for launch in split["launches"]] == ["cuflash forward", "cuflash split-KV merge"]
    # One block per K/V head reads its keys alone; 24 ranges a head share them
    # out over 192 blocks, near the memory floor (K/V once at the device's bandwidth).
    assert split["seconds"] < alone["seconds"] / 4
    assert split["launches"][0]["memory_s"] > 0.75 * split["launches"][0]["compute_s"]


def test_cluster_merged_splits_launch_no_merge_on_hopper():
    """A split count of a cluster's (Hopper, cuflash's one-tile decode
    blocks): the splits merge in their cluster, so no merge launch and no
    partial results in memory; an A100 keeps the merge kernel."""
    from cuflash.simulate.algorithms import run

    problem = Problem(batch=1, nheads=8, seqlen_q=1, seqlen_k=65536, head_dim=128, num_splits=16)
    clustered = estimate("cuflash", problem, H100, "fwd")
    assert [launch["name"] for launch in clustered["launches"]] == ["cuflash forward"]
    assert "O_partial" not in {term.tensor for term in run("cuflash", problem, H100, "fwd").terms}
    assert "O_partial" in {term.tensor for term in run("cuflash", problem, MACHINES["a100"], "fwd").terms}
    assert len(estimate("cuflash", problem, MACHINES["a100"], "fwd")["launches"]) == 2
    # The launcher's own choice for a short cache: clusters, one launch.
    short = Problem(batch=1, nheads=32, seqlen_q=1, seqlen_k=1024, head_dim=128)
    assert [launch["name"] for launch in estimate("cuflash", short, H100, "fwd")["launches"]] == ["cuflash forward"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("passes", ["fwd", "bwd", "fwd+bwd"])
def test_ranking_at_batch_1_16_heads_16k(head_dim, passes):
    """flash1 (one block per head: 16 of 132 SMs) slower than flash2 slower
    than cuflash, as measured."""
    problem = Problem(batch=1, nheads=16, seqlen_q=16384, head_dim=head_dim)
    seconds = {name: estimate(name, problem, H100, passes)["seconds"] for name in ("flash1", "flash2", "cuflash")}
    assert seconds["flash1"] > seconds["flash2"] > seconds["cuflash"]


def test_flash1_leaves_most_sms_idle_and_flash2_fills_them():
    problem = Problem(batch=1, nheads=16, seqlen_q=16384, head_dim=64)
    (flash1,) = launches("flash1", problem, H100, "fwd")
    assert sum(count for count, _ in flash1.blocks) == 16
    timed = estimate("flash1", problem, H100, "fwd")["launches"][0]
    assert timed["waves"] == pytest.approx(16 / 132)
    flash2 = estimate("flash2", problem, H100, "fwd")["launches"][0]
    assert flash2["waves"] > 1
    # Twice the heads: flash1 twice the blocks in the same time (still one
    # partial wave), flash2 twice the time.
    doubled = Problem(batch=2, nheads=16, seqlen_q=16384, head_dim=64)
    assert estimate("flash1", doubled, H100, "fwd")["launches"][0]["compute_s"] == pytest.approx(timed["compute_s"])
    assert estimate("flash2", doubled, H100, "fwd")["launches"][0]["compute_s"] == pytest.approx(
        2 * flash2["compute_s"], rel=0.05)


def test_a_step_combines_its_pipes_by_the_overlap():
    """Tensor cores, exponentials (16 per SM per clock) and CUDA cores: one
    after another with overlap 0, only the longest with overlap 1."""
    work = BlockWork(steps=0, matmul_flops=1e9, exps=1e7, other_flops=1e7)
    sm_matmul = H100.matmul_flops / H100.sms
    pipes = (1e9 / sm_matmul, 1e7 / (16 * H100.clock_hz), 1e7 / (H100.nonmatmul_flops / H100.sms))
    assert block_seconds(work, KernelCost(1.0, 0.0, 0, 0, ""), H100) == pytest.approx(sum(pipes))
    assert block_seconds(work, KernelCost(1.0, 1.0, 0, 0, ""), H100) == pytest.approx(max(pipes))
    # At head dim 64 the forward's exponentials take as long as its matmuls
    # (256 FLOPs per score against 4096 per SM per clock, 1 exp against 16).
    score = BlockWork(steps=0, matmul_flops=4 * 64, exps=1, other_flops=0)
    mm = (4 * 64) / sm_matmul
    assert block_seconds(score, KernelCost(1.0, 0.0, 0, 0, ""), H100) == pytest.approx(2 * mm, rel=0.01)
    # Fixed cycles per step and per block.
    fixed = block_seconds(BlockWork(steps=3, matmul_flops=0, exps=0, other_flops=0), KernelCost(1, 0, 100, 50, ""),
                          H100)
    assert fixed == pytest.approx(350 / H100.clock_hz)


def test_blocks_go_to_the_first_free_slot():
    assert _makespan([(3, 1.0)], slots=2) == 2.0
    assert _makespan([(1, 3.0), (3, 1.0)], slots=2) == 3.0  # longest first: the short ones fill the other slot
    assert _makespan([(3, 1.0), (1, 3.0)], slots=2) == 4.0  # longest last: it starts after a wave
    assert _makespan([(5, 2.0)], slots=8) == 2.0


def test_causal_blocks_are_unequal_and_longest_first():
    problem = Problem(batch=1, nheads=4, seqlen_q=4096, head_dim=128, causal=True)
    forward = launches("cuflash", problem, H100, "fwd")[0]
    work = [w.matmul_flops for _, w in forward.blocks]
    assert work == sorted(work, reverse=True) and work[0] > 10 * work[-1]


def test_the_backward_is_three_launches_and_the_element_wise_ones_are_memory_bound():
    problem = Problem(batch=4, nheads=16, seqlen_q=4096, head_dim=128)
    result = estimate("cuflash", problem, H100, "bwd")
    names = [launch["name"] for launch in result["launches"]]
    assert names == ["cuflash backward preprocess", "cuflash backward dK/dV", "cuflash backward dQ conversion"]
    preprocess = result["launches"][0]
    assert preprocess["compute_s"] == 0 and preprocess["memory_s"] > 0
    assert result["seconds"] == pytest.approx(sum(launch["seconds"] for launch in result["launches"]))


def _compute_seconds(algorithm, head_dim, passes, launch=0, machine=MACHINES["h200"]):
    problem = Problem(batch=2, nheads=16, seqlen_q=4096, head_dim=head_dim)
    return estimate(algorithm, problem, machine, passes)["launches"][launch]["compute_s"]


def test_products_are_charged_at_the_head_dim_the_kernels_run():
    """The tensor cores work on the compiled head dim, zeros past the
    problem's: cuflash's buckets, the Hopper forward's products and the
    backward's but dQ narrowed to wgmma_product_dim (104 and 112 run 112
    of 128 columns), FlashAttention-2's multiples of 32 up to 192, then 256."""
    from cuflash.simulate.algorithms import _flash2_plan, cuflash_plan, flash2_head_dim

    for passes, launch in (("fwd", 0), ("bwd", 1)):
        seconds = {d: _compute_seconds("cuflash", d, passes, launch=launch) for d in (104, 112, 120, 128)}
        assert seconds[104] == seconds[112] < seconds[120] == seconds[128], passes
    h200 = MACHINES["h200"]
    plan = cuflash_plan(Problem(batch=2, nheads=16, seqlen_q=4096, head_dim=72), h200)
    assert (plan.fwd_width, plan.bwd_width, plan.dq_width) == (80, 80, 96)
    plan = _flash2_plan(Problem(batch=2, nheads=16, seqlen_q=4096, head_dim=72), h200, None, None)
    assert (plan.fwd_width, plan.bwd_width, plan.dq_width) == (96, 96, 96)
    assert [flash2_head_dim(d) for d in (8, 40, 72, 96, 136, 160, 200, 256)] == [32, 64, 96, 96, 160, 160, 256, 256]


@pytest.mark.parametrize("algorithm,between_buckets", [
    ("cuflash", (8, 16, 40, 72, 80, 112, 160)),  # Hopper's buckets 32, 64, 96, 128, 192, 256
    ("flash2", (8, 16, 40, 72, 80, 112)),        # FlashAttention-2's 32, 64, ..., 192, 256
])
def test_the_model_explains_the_h200_head_dim_sweep_between_buckets(algorithm, between_buckets):
    """benchmarks/h200_head_dims.json (the sweep of record, no constant
    fitted to it): at head dims between the algorithm's compiled ones the
    model's forward and backward are within 15% of the measurement at the
    median and 32% at worst (products charged at the problem's head dim
    instead: cuflash 23% and 44%, FlashAttention-2 23% and 34%). cuflash's
    forward at head dims 8 and 40 (rows ending mid-sector), which the model
    has no term for, sat 29-37% short of the measurement on the 128-row
    tile; on the 192-row tile it is within the same bounds (14-21% short)."""
    from cuflash.simulate.timing import compare_with_bench

    rows = json.loads((REPO / "benchmarks" / "h200_head_dims.json").read_text())["rows"]
    errors = sorted(abs(r["error"]) for r in compare_with_bench(rows, MACHINES["h200"])
                    if r["algorithm"] == algorithm and r["head_dim"] in between_buckets)
    assert len(errors) == 8 * len(between_buckets)  # fwd and bwd, full and causal, two dtypes
    assert errors[len(errors) // 2] <= 0.15 and errors[-1] <= 0.32, errors


@pytest.mark.parametrize("algorithm", ["cuflash", "flash2"])
def test_the_model_fitted_on_the_h100_explains_the_h200_grid(algorithm):
    """benchmarks/h200.json (the FlashAttention-2 grid on an H200, both
    dtypes, forward and backward; no constant fitted to it): with the H200
    preset the model is within 25% of every point (issue 18's bar on the
    H100's grid; measured on 2c40d98's run: cuflash 6% at the median and
    17% at worst, FlashAttention-2 7% and 21.5%) and orders cuflash and FlashAttention-2 as
    measured at every point. (The H100's preset, same rows, put cuflash's
    forward up to 36% long: the preset's bandwidth and clock matter.)"""
    from cuflash.simulate.timing import compare_with_bench, ranking_agreement

    rows = json.loads((REPO / "benchmarks" / "h200.json").read_text())["rows"]
    records = compare_with_bench(rows, MACHINES["h200"])
    assert ranking_agreement(records) == (96, 96)
    errors = sorted(abs(r["error"]) for r in records if r["algorithm"] == algorithm)
    assert len(errors) == 96  # 2 head dims x 6 lengths x causal or not x fwd, bwd x 2 dtypes
    assert errors[len(errors) // 2] <= 0.10 and errors[-1] <= 0.25, errors


def test_every_cost_entry_is_physical():
    for cost in KERNEL_COSTS.values():
        assert 0 < cost.tensor_efficiency <= 1 and 0 <= cost.overlap <= 1
        assert cost.step_cycles >= 0 and cost.block_cycles >= 0 and cost.note


def test_cli_prints_the_model_and_compares_with_measurements():
    runner = CliRunner()
    table = runner.invoke(main, ["simulate", "--machine", "h100", "--seqlen", "16k", "-a", "flash1", "-a", "cuflash"])
    assert table.exit_code == 0, table.output
    assert "model ms" in table.output and "waves of" in table.output
    compared = runner.invoke(main, ["simulate", "--measured", str(REPO / "benchmarks" / "h100.json")])
    assert compared.exit_code == 0, compared.output
    assert "on h100" in compared.output  # machine inferred from the file's device
    assert compared.output.count("| cuflash |") == 72 and "cuflash fwd: largest error" in compared.output
    assert "ranking of cuflash and the other algorithm as measured at 72 of 72 points" in compared.output
    as_json = runner.invoke(main, ["simulate", "--measured", str(REPO / "benchmarks" / "h100.json"), "--json"])
    records = json.loads(as_json.output)["rows"]
    assert max(abs(r["error"]) for r in records if r["algorithm"] == "cuflash") <= 0.25


def test_machine_overrides_change_the_model():
    runner = CliRunner()

    def model_ms(*extra):
        result = runner.invoke(main, ["simulate", "--machine", "h100", "--seqlen", "16k", "-a", "cuflash", "--json",
                                      *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["results"][0]["time_model"]["seconds"]

    base = model_ms()
    # The presets' rates are the whole GPU's: half the SMs with half the
    # tensor-core rate is a slower GPU, half the SMs alone faster SMs.
    assert model_ms("--sms", "66", "--matmul-tflops", "494.5") > 1.4 * base
    assert model_ms("--sms", "66") != base
    assert model_ms("--matmul-tflops", "1978") < base
    bad = runner.invoke(main, ["simulate", "--bandwidth", "0"])
    assert bad.exit_code != 0 and "hbm_bandwidth must be positive" in bad.output
    conflict = runner.invoke(main, ["simulate", "--measured", str(REPO / "benchmarks" / "h100.json"), "--sweep",
                                    "seqlen", "--values", "1k"])
    assert conflict.exit_code != 0 and "--measured" in conflict.output


def test_measured_takes_the_decode_table_one_row_per_cache_layout(tmp_path):
    """bench.py --decode-only's rows (K/V bytes and TB/s per column) become
    one row per layout with milliseconds; SDPA ran on the contiguous cache
    only, so the paged rows compare cuflash alone."""
    from cuflash.simulate.timing import decode_table_rows

    row = {"pass": "decode", "dtype": "bfloat16", "head_dim": 128, "causal": False, "batch": 8, "heads": 32,
           "kv_heads": 8, "seqlen_q": 1, "seqlen_k": 16384, "kv_bytes": 2 * 8 * 16384 * 8 * 128 * 2,
           "kv_tbps": {"contiguous": 2.5, "paged16": 2.0, "paged256": 2.4, "flash": 2.6, "cudnn": 2.8}}
    contiguous, paged16, paged256 = decode_table_rows([row])
    assert (contiguous["page_size"], paged16["page_size"], paged256["page_size"]) == (None, 16, 256)
    assert contiguous["ms"] == pytest.approx({name: row["kv_bytes"] / (rate * 1e9) for name, rate in
                                              (("cuflash", 2.5), ("flash", 2.6), ("cudnn", 2.8))})
    assert paged16["ms"] == pytest.approx({"cuflash": row["kv_bytes"] / 2.0e9})
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"environment": {"device": "NVIDIA H100 80GB HBM3"}, "rows": [], "decode": [row]}))
    result = CliRunner().invoke(main, ["simulate", "--measured", str(path), "--json"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.output)["rows"]
    assert [(r["algorithm"], r["page_size"]) for r in records] == [
        ("cuflash", None), ("flash-decoding", None), ("cuflash", 16), ("cuflash", 256)]
    assert records[2]["measured_ms"] == pytest.approx(row["kv_bytes"] / 2.0e9)


def test_measured_rejects_a_file_that_is_not_a_benchmark(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"rows": 3}')
    result = CliRunner().invoke(main, ["simulate", "--measured", str(path)])
    assert result.exit_code != 0 and "is not a tools/bench.py JSON file" in result.output


def _readme_simulate_commands() -> list[str]:
    """Every `cuflash simulate` command of the README's bash blocks (line
    continuations joined, comments dropped)."""
    import re

    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("cuflash simulate"):
                commands.append(line)
    return commands


@pytest.mark.parametrize("command", [c for c in _readme_simulate_commands() if "--plot" not in c])
def test_readme_simulate_examples_run(command, monkeypatch):
    import shlex

    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    assert result.exit_code == 0, result.output


def test_readme_has_simulate_examples():
    commands = _readme_simulate_commands()
    assert len(commands) >= 8 and any("--measured" in c for c in commands)


def test_the_decode_blocks_constants_fit_the_decode_table():
    """cuflash's decode blocks on Hopper take their own block and step
    cycles and DRAM efficiency and latency (KERNEL_COSTS["cuflash",
    "decode", 90]), fitted to the decode tables: every cuflash row within
    25%, 6% on average (without the DRAM terms 29%, 9%; flash2's constants
    were 98% over on the smallest calls); before Hopper they take flash2's
    forward's. The other algorithm of the table (flash-decoding, on
    flash2's forward constants and their DRAM efficiency) is ordered
    against cuflash as measured at every point; the backward has no DRAM
    terms."""
    from cuflash.simulate.machines import MACHINES
    from cuflash.simulate.timing import compare_with_bench, decode_table_rows, kernel_cost, ranking_agreement

    # The latest table and the one before it, on another H100 (both fitted).
    for name in ("h100_kvcache.json", "h100-f33f082_kvcache.json"):
        bench = json.loads((REPO / "benchmarks" / name).read_text())
        everything = compare_with_bench(decode_table_rows(bench["decode"]), MACHINES["h100"])
        records = [r for r in everything if r["algorithm"] == "cuflash"]
        errors = [abs(r["error"]) for r in records]
        assert len(records) == 144 and max(errors) < 0.25 and sum(errors) / len(errors) < 0.06, name
        assert ranking_agreement(everything) == (48, 48), name
    flash2 = KERNEL_COSTS[("flash2", "bwd", 0)]
    assert (flash2.dram_efficiency, flash2.dram_latency_cycles) == (1.0, 0.0)
    assert kernel_cost("cuflash", "decode", MACHINES["h100"]) == KERNEL_COSTS[("cuflash", "decode", 90)]
    assert kernel_cost("cuflash", "decode", MACHINES["a100"]) == KERNEL_COSTS[("flash2", "fwd", 0)]
