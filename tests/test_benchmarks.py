"""The committed benchmark JSON is self-consistent and BENCHMARKS.md is the
rendering of it (CPU only: no timing happens here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

#: The FlashAttention-2 grid per device kind, and the head-dim sweeps (``*_head_dims.json``).
SWEEPS = sorted((REPO / "benchmarks").glob("*_head_dims.json"))
#: float32 forwards (``tools/bench.py --dtype float32``).
FLOAT32 = sorted((REPO / "benchmarks").glob("*_float32.json"))
#: decode rows (one query token against a cache), read by ``cuflash simulate --measured``.
DECODE = sorted((REPO / "benchmarks").glob("*_decode.json"))
#: packed batches against dense ones (``tools/bench.py --varlen-only``).
VARLEN = sorted((REPO / "benchmarks").glob("*_varlen.json"))
#: decoding against KV caches beside SDPA (``tools/bench.py --decode-only``).
KVCACHE = sorted((REPO / "benchmarks").glob("*_kvcache.json"))
#: windows, soft caps, ALiBi and dropout against plain attention (``tools/bench.py --variants-only``).
VARIANTS = sorted((REPO / "benchmarks").glob("*_variants.json"))
#: tools/bench_mods.py: user functions against FlexAttention.
MODS = sorted((REPO / "benchmarks").glob("*_mods.json"))
#: host-cost runs on other machines (part of the grid at most), for BENCHMARKS.md's across-machines table.
HOST_RUNS = sorted((REPO / "benchmarks").glob("*_host_*.json"))
BENCHMARKS = sorted(set((REPO / "benchmarks").glob("*.json")) - set(SWEEPS) - set(FLOAT32) - set(DECODE)
                    - set(VARLEN) - set(KVCACHE) - set(VARIANTS) - set(MODS) - set(HOST_RUNS))


@pytest.mark.parametrize("path", MODS, ids=lambda p: p.name)
def test_mods_rows_are_consistent(path):
    from bench_mods import CASES

    result = json.loads(path.read_text())
    assert {"device", "commit", "date"} <= set(result["environment"])
    rows = result["rows"]
    flex = {r["case"]: r["ms"] for r in rows if r["backend"] == "flex"}
    assert set(flex) == set(CASES)
    for r in rows:
        if r["backend"] != "flex":
            for part in ("fwd", "fwd+bwd"):
                assert r["flex_over_this"][part] == pytest.approx(flex[r["case"]][part] / r["ms"][part])
    first = {(r["case"], r["backend"]): r["first_call_s"] for r in result["first_calls"]}
    assert set(first) == {(case, backend) for case in CASES for backend in ("flex", "cuflash")}
    assert all(seconds is not None and seconds > 0 for seconds in first.values())


@pytest.mark.parametrize("path", VARIANTS, ids=lambda p: p.name)
def test_variant_rows_are_consistent(path):
    import bench_variants

    result = json.loads(path.read_text())
    rows = result["variants"]
    assert {"device", "commit", "date"} <= set(result["environment"])
    assert {r["seqlen"] for r in rows} == set(bench_variants.SEQLENS)
    for r in rows:
        assert r["batch"] * r["seqlen"] == bench_variants.TOKENS
        variant, baseline = r["ms"]["variant"], r["ms"]["baseline"]
        if r["variant"] == "window":  # a speed-up over causal attention
            assert r["causal"] and r["speedup"] == pytest.approx(baseline / variant)
        else:  # a cost over plain attention
            assert r["cost"] == pytest.approx(variant / baseline)
    assert {r["variant"] for r in rows} == {"window", "softcap", "alibi", "softcap+alibi", "dropout"}


@pytest.mark.parametrize("path", KVCACHE, ids=lambda p: p.name)
def test_kvcache_rows_are_consistent(path):
    import bench_decode

    result = json.loads(path.read_text())
    rows = result["decode"]
    assert {"device", "commit", "date"} <= set(result["environment"])
    assert [(r["kv_heads"], r["batch"], r["seqlen_k"]) for r in rows] == bench_decode.points()
    for r in rows:
        assert r["kv_bytes"] == bench_decode.kv_bytes(r["batch"], r["seqlen_k"], r["kv_heads"])
        best = max(r["kv_tbps"][name] for name in ("flash", "cudnn") if name in r["kv_tbps"])
        for label in ("contiguous", "paged16", "paged256"):
            assert r["over_best_sdpa"][label] == pytest.approx(r["kv_tbps"][label] / best)
        # every layout computed the dense forward's answer
        assert max(r["max_abs_diff_vs_dense"].values()) < 0.05
    # the host-cost table, where the run has one: every call at every point, its times positive
    host = result.get("decode_host", [])
    if host:
        calls = {"cuflash (CuPy)", "cuflash.torch", "SDPA cuDNN"}
        assert {(r["kv_heads"], r["batch"], r["seqlen_k"]) for r in host} == set(bench_decode.HOST_POINTS)
        assert len(host) == len(calls) * len(bench_decode.HOST_POINTS) and {r["call"] for r in host} == calls
        assert all(r["gpu_ms"] > 0 and r["host_us"] > 0 and (r["user_ms"] is None or r["user_ms"] > 0)
                   for r in host)


@pytest.mark.parametrize("path", VARLEN, ids=lambda p: p.name)
def test_varlen_rows_are_consistent(path):
    import bench_varlen

    result = json.loads(path.read_text())
    rows = result["varlen"]
    assert {"device", "commit", "date"} <= set(result["environment"]) and rows
    for r in rows:
        batch, seqlen = map(int, r["dense"].split("x"))
        factor = 2.5 if r["pass"] == "bwd" else 1.0
        assert r["tflops"]["dense"] == pytest.approx(
            factor * bench_varlen.flops([seqlen] * batch, r["causal"]) / (r["ms"]["dense"] * 1e9))
        assert r["varlen_over_dense"] == pytest.approx(r["tflops"]["varlen"] / r["tflops"]["dense"])
        assert r["min_length"] <= r["max_length"] and r["sequences"] >= 1


@pytest.mark.parametrize("path", DECODE, ids=lambda p: p.name)
def test_decode_rows_are_consistent(path):
    result = json.loads(path.read_text())
    assert {"device", "source"} <= set(result["environment"])
    for r in result["rows"]:
        assert r["pass"] == "decode" and r["heads"] % r["kv_heads"] == 0
        element = {"bfloat16": 2, "float16": 2}[r["dtype"]]
        assert r["kv_bytes"] == r["batch"] * r["seqlen_k"] * r["kv_heads"] * r["head_dim"] * element * 2
        for backend, ms in r["ms"].items():
            assert ms == pytest.approx(r["kv_bytes"] / (r["kv_tbps"][backend] * 1e9), rel=1e-3)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_rows_are_consistent(path):
    from bench import SEQLENS

    result = json.loads(path.read_text())
    grid = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in result["rows"] if r["pass"] == "fwd"}
    assert grid == {(dt, d, c, s) for dt in ("bfloat16", "float16") for d in (64, 128) for c in (False, True)
                    for s in SEQLENS}
    check_grid_rows(result)


@pytest.mark.parametrize("path", HOST_RUNS, ids=lambda p: p.name)
def test_host_runs_are_consistent(path):
    result = json.loads(path.read_text())
    assert result["host_overhead"] and result["jax_jit"]
    check_grid_rows(result)


def check_grid_rows(result: dict) -> None:
    """What holds of every ``tools/bench.py`` run, whatever part of the grid
    it timed: its environment, a backward for each backward point, FLOPs,
    TFLOP/s and ratios that follow from the milliseconds, host rows."""
    from bench import PASS_FLOPS, forward_flops

    assert {"device", "driver", "torch", "commit", "date"} <= set(result["environment"])
    rows = result["rows"]
    grid = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in rows if r["pass"] == "fwd"}
    by_pass = {}
    for r in rows:
        by_pass.setdefault(r["pass"], {})[(r["dtype"], r["head_dim"], r["causal"], r["seqlen"])] = r
    if "bwd" in by_pass:  # backward rows: at least the bf16 grid, and fwd+bwd for each
        assert {key for key in by_pass["bwd"] if key[0] == "bfloat16"} == {
            key for key in grid if key[0] == "bfloat16"}
        assert set(by_pass["fwd+bwd"]) == set(by_pass["bwd"])
        for key, both in by_pass["fwd+bwd"].items():
            for backend, ms in both["ms"].items():
                assert ms == pytest.approx(by_pass["fwd"][key]["ms"][backend] + by_pass["bwd"][key]["ms"][backend])
    for r in rows:
        assert r["batch"] * r["seqlen"] == 16384 and r["heads"] * r["head_dim"] == 2048
        assert r["flops"] == PASS_FLOPS[r["pass"]] * forward_flops(r["batch"], r["heads"], r["seqlen"], r["head_dim"],
                                                                   r["causal"])
        for backend, ms in r["ms"].items():
            assert r["tflops"][backend] == pytest.approx(r["flops"] / (ms * 1e9))
        for base in ("flash", "cudnn"):
            assert r[f"cuflash_over_{base}"] == pytest.approx(r["ms"][base] / r["ms"]["cuflash"])
            if base in r.get("user_ms", {}):
                assert r[f"user_cuflash_over_{base}"] == pytest.approx(r["user_ms"][base] / r["user_ms"]["cuflash"])
    for row in result.get("host_overhead", []):
        assert {"what", "call", "host_us"} <= set(row) and row["host_us"] > 0


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_head_dim_sweep_rows_are_consistent(path):
    from bench import HEAD_DIM_SWEEP, HIDDEN, PASS_FLOPS, TOKENS, forward_flops

    rows = json.loads(path.read_text())["rows"]
    expected = {(dt, d, c, 4096) for dt in ("bfloat16", "float16") for d in HEAD_DIM_SWEEP for c in (False, True)}
    for pass_name in ("fwd", "bwd", "fwd+bwd"):
        keys = {(r["dtype"], r["head_dim"], r["causal"], r["seqlen"]) for r in rows if r["pass"] == pass_name}
        assert keys == expected
    for r in rows:
        assert r["batch"] * r["seqlen"] == TOKENS and r["heads"] == HIDDEN // r["head_dim"]
        assert r["flops"] == PASS_FLOPS[r["pass"]] * forward_flops(r["batch"], r["heads"], r["seqlen"], r["head_dim"],
                                                                   r["causal"])
        for backend, ms in r["ms"].items():
            assert r["tflops"][backend] == pytest.approx(r["flops"] / (ms * 1e9))
        if r["pass"] == "bwd":  # the deterministic backward's cost is part of the sweep
            assert r["ms"]["cuflash-deterministic"] > 0


@pytest.mark.parametrize("path", FLOAT32, ids=lambda p: p.name)
def test_float32_rows_are_consistent(path):
    from bench import HIDDEN, TOKENS, forward_flops

    rows = json.loads(path.read_text())["rows"]
    assert rows and {r["dtype"] for r in rows} == {"float32"} and {r["pass"] for r in rows} == {"fwd"}
    assert {(r["head_dim"], r["causal"]) for r in rows} == {(d, c) for d in (32, 64, 96, 128, 192, 256)
                                                             for c in (False, True)}
    for r in rows:
        assert r["batch"] * r["seqlen"] == TOKENS and r["heads"] == HIDDEN // r["head_dim"]
        assert r["flops"] == forward_flops(r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"])
        assert set(r["ms"]) == {"cuflash", "cuflash-3xtf32", "efficient"}
        for backend, ms in r["ms"].items():
            assert r["tflops"][backend] == pytest.approx(r["flops"] / (ms * 1e9))
        assert r["cuflash_over_efficient"] == pytest.approx(r["ms"]["efficient"] / r["ms"]["cuflash"])
        assert r["cuflash_3xtf32_over_efficient"] == pytest.approx(r["ms"]["efficient"] / r["ms"]["cuflash-3xtf32"])


def test_benchmarks_md_renders_the_benchmark_jsons():
    rendered = subprocess.run([sys.executable, str(REPO / "tools" / "bench_report.py"),
                               str(REPO / "benchmarks" / "h100.json"), "--grid-also",
                               str(REPO / "benchmarks" / "h200.json"), "--head-dims",
                               str(REPO / "benchmarks" / "h100_head_dims.json"), "--head-dims",
                               str(REPO / "benchmarks" / "h200_head_dims.json"), "--float32",
                               str(REPO / "benchmarks" / "h100_float32.json"), "--varlen",
                               str(REPO / "benchmarks" / "h100_varlen.json"), "--kvcache",
                               str(REPO / "benchmarks" / "h100_kvcache.json"), "--variants",
                               str(REPO / "benchmarks" / "h100_variants.json"), "--mods",
                               str(REPO / "benchmarks" / "h100_mods.json"), "--host-runs",
                               str(REPO / "benchmarks" / "h200_host_only.json"), "--host-runs",
                               str(REPO / "benchmarks" / "h200.json"), "--host-runs",
                               str(REPO / "benchmarks" / "h200_host_seqlen1024.json")], capture_output=True, text=True,
                              check=True).stdout
    committed = (REPO / "BENCHMARKS.md").read_text()
    # The committed file also links the plot; everything else is identical.
    assert committed.replace("![TFLOP/s against seqlen](h100_forward.png)\n\n", "") == rendered


def test_host_runs_side_by_side_keep_each_runs_own_yardstick():
    """Across machines, each column's ratios are to SDPA of that run; a
    call only a later run measured still gets its row, "-" elsewhere."""
    from host_overhead import across_runs_markdown

    fast = [{"what": "forward", "call": "F.scaled_dot_product_attention", "host_us": 20.0},
            {"what": "forward", "call": "cuflash.attention (CuPy)", "host_us": 16.0}]
    slow = [{"what": "forward", "call": "F.scaled_dot_product_attention", "host_us": 30.0},
            {"what": "forward", "call": "cuflash.attention (CuPy)", "host_us": 27.0},
            {"what": "backward", "call": "cuflash.attention_backward (CuPy)", "host_us": 36.0}]
    lines = across_runs_markdown([("fast", fast), ("slow", slow)])
    assert lines[0] == "| pass | call | fast | slow |"
    assert "| forward | cuflash.attention (CuPy) | 16.0 (0.80) | 27.0 (0.90) |" in lines
    assert lines[-1] == "| backward | cuflash.attention_backward (CuPy) | - | 36.0 (1.20) |"


def test_host_rows_are_compared_with_sdpa_of_the_same_run():
    """The host table's ratio column: one call against SDPA's forward,
    an autograd step against SDPA's step, both from the same run."""
    from host_overhead import markdown, sdpa_ratios

    rows = [{"what": "forward", "call": "F.scaled_dot_product_attention", "host_us": 20.0},
            {"what": "forward", "call": "cuflash.attention (CuPy)", "host_us": 15.0},
            {"what": "backward", "call": "cuflash.attention_backward (PyTorch)", "host_us": 30.0},
            {"what": "autograd fwd+bwd", "call": "cuflash.torch.scaled_dot_product_attention", "host_us": 250.0}]
    assert sdpa_ratios(rows) == [1.0, 0.75, 1.5, None]  # no SDPA step in this run
    rows.append({"what": "autograd fwd+bwd", "call": "F.scaled_dot_product_attention", "host_us": 200.0})
    assert sdpa_ratios(rows)[3] == 1.25
    assert "| backward | cuflash.attention_backward (PyTorch) | 30.0 | 1.50 |" in markdown(rows, [])


def test_cudnn_summary_reads_issue_17s_bars_per_dtype_and_pass():
    """The bench's closing lines: per dtype and pass, the lowest ratio to
    cuDNN from seqlen 2048 up (bar 1.0) and below it (bar 0.9), and where."""
    from bench import cudnn_summary

    def row(dtype, pass_name, seqlen, causal, ratio):
        return {"dtype": dtype, "pass": pass_name, "head_dim": 128, "causal": causal, "seqlen": seqlen,
                "cuflash_over_cudnn": ratio}

    rows = [row("float16", "bwd", 2048, False, 0.99), row("float16", "bwd", 4096, True, 1.03),
            row("float16", "bwd", 512, False, 0.89), row("float16", "fwd+bwd", 2048, False, 0.5),
            row("bfloat16", "fwd", 1024, True, 0.95)]
    assert cudnn_summary(rows) == [
        "bfloat16 fwd cuflash/cuDNN: below 2k min 0.950 (d128 causal 1024), >= 0.9: 1/1",
        "float16 bwd cuflash/cuDNN: from 2k min 0.990 (d128 full 2048), >= 1.0: 1/2; "
        "below 2k min 0.890 (d128 full 512), >= 0.9: 0/1"]


def test_bench_padded_rows_refuses_rows_narrower_than_the_head_dim(capsys):
    """A padded row must hold the head's elements: refused before any
    framework is imported, the message naming --pad and the head dim."""
    import bench_padded_rows

    for backward in ([], ["--backward"]):
        with pytest.raises(SystemExit) as refused:
            bench_padded_rows.main(["--head-dim", "72", "--pad", "64", *backward])
        assert refused.value.code == 2
        assert "--pad must be at least --head-dim (72), got 64" in capsys.readouterr().err
