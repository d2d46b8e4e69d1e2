"""The ``cuflash`` command line (CPU)."""

import csv
import io
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cuflash.cli import main

FIGURE2 = ["simulate", "--machine", "a100", "--batch", "64", "--heads", "16", "--seqlen", "1024",
           "--head-dim", "64", "--dtype", "fp16", "--key-padding-mask"]


def invoke(*args):
    result = CliRunner().invoke(main, list(args))
    return result


def test_simulate_table_shows_every_algorithm():
    result = invoke("simulate", "--seqlen", "2k")
    assert result.exit_code == 0, result.output
    for name in ("standard", "pytorch", "flash1", "flash2", "cuflash"):
        assert name in result.output
    assert "requested" in result.output and "DRAM (est.)" in result.output and "traffic by tensor" in result.output
    assert " GB " in result.output or " MB " in result.output


def test_simulate_json_reproduces_figure2():
    result = invoke(*FIGURE2, "-a", "pytorch", "-a", "flash1", "--json")
    assert result.exit_code == 0, result.output
    # flash1 is outside Theorem 2's range here (M > N d): a warning on stderr, which the runner may mix in first
    data = json.loads(result.output[result.output.index("{"):])
    by_name = {r["algorithm"]: r for r in data["results"]}
    assert set(by_name) == {"pytorch", "flash1"}
    assert by_name["pytorch"]["dram_bytes"] / 1e9 == pytest.approx(35.3, rel=0.15)
    assert by_name["flash1"]["dram_bytes"] / 1e9 == pytest.approx(4.4, rel=0.30)
    assert data["problem"]["seqlen_q"] == 1024 and data["machine"]["name"] == "a100"
    assert by_name["flash1"]["blocks"] == {"flash1 Br": 64, "flash1 Bc": 384}


def test_simulate_csv():
    result = invoke("simulate", "-a", "flash2", "-a", "cuflash", "--pass", "fwd", "--csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert [r["algorithm"] for r in rows] == ["flash2", "cuflash"]
    assert int(rows[0]["requested_bytes"]) > 0


def test_simulate_sweep_over_seqlen_with_progress_and_json():
    result = invoke("simulate", "-a", "standard", "-a", "flash2", "--sweep", "seqlen", "--values", "1k,2k,4k", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    values = [(r["value"], r["algorithm"]) for r in data["results"]]
    assert values == [(1024, "standard"), (1024, "flash2"), (2048, "standard"), (2048, "flash2"),
                      (4096, "standard"), (4096, "flash2")]


@pytest.mark.parametrize("sweep,values", [("head-dim", "32,64,128"), ("sram", "48KB,96KB,192KB")])
def test_simulate_sweeps(sweep, values):
    result = invoke("simulate", "-a", "flash1", "--sweep", sweep, "--values", values)
    assert result.exit_code == 0, result.output
    assert result.output.count("flash1") == 3


def test_simulate_sram_sweep_halves_flash1_traffic():
    result = invoke("simulate", "-a", "flash1", "--pass", "fwd", "--seqlen", "16k", "--sweep", "sram",
                    "--values", "96KB,192KB", "--csv")
    rows = list(csv.DictReader(io.StringIO(result.output[result.output.index("sweep_value"):])))
    ratio = int(rows[0]["requested_bytes"]) / int(rows[1]["requested_bytes"])
    assert ratio == pytest.approx(2.0, rel=0.1)


def test_simulate_explain_prints_formulas():
    result = invoke("simulate", "-a", "flash1", "--explain")
    assert result.exit_code == 0, result.output
    assert "initialise O = 0 in HBM" in result.output and "FLOPs: forward: matmul" in result.output


def test_simulate_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    result = invoke("simulate", "--sweep", "seqlen", "--values", "512,1k,2k", "--plot", str(path))
    assert result.exit_code == 0, result.output
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("args,message", [
    (["--heads", "6", "--kv-heads", "4"], "multiple of nheads_k"),
    (["--seqlen", "abc"], "expected a whole number"),
    (["--plot", "x.png"], "--plot needs --sweep"),
    (["--sweep", "seqlen"], "--sweep needs --values"),
    (["--json", "--csv"], "choose one of --json and --csv"),
    (["--block-m", "0"], "block_m must be at least 1"),
])
def test_simulate_bad_arguments(args, message):
    result = invoke("simulate", *args)
    assert result.exit_code != 0
    assert message in result.output


def test_help_shows_the_figure2_example():
    result = invoke("simulate", "--help")
    assert result.exit_code == 0
    assert "--key-padding-mask -a pytorch -a flash1" in result.output


def test_python_dash_m_runs():
    result = subprocess.run([sys.executable, "-m", "cuflash", "simulate", "-a", "flash2", "--pass", "fwd"],
                            capture_output=True, text=True, check=True)
    assert "flash2" in result.stdout


# --- bad or ignored input gets a one-line error (issue 18) ---------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--kv-heads", "0"], "nheads_k must be at least 1, got 0"),
    (["--element-bytes", "0"], "element_size must be at least 1, got 0"),
    (["--sweep", "seqlen", "--values", "0,1k"], "seqlen_q must be at least 1, got 0"),
    (["--sweep", "head-dim", "--values", "0"], "head_dim must be at least 1, got 0"),
    (["--sram", "1", "-a", "flash1"], "flash1 needs at least 512 bytes of SRAM per SM"),
    (["--sram", "0", "-a", "flash2"], "flash2 needs at least 6144 bytes of SRAM per SM"),
    (["--sram", "10", "-a", "cuflash"], "cuflash needs at least"),
    (["--element-bytes", "3", "-a", "cuflash"], "cuflash's kernels take 2-byte (fp16/bf16) or 4-byte (fp32)"),
    (["--element-bytes", "1", "-a", "cuflash"], "got 1-byte ones"),
    (["--values", "1k,2k"], "--values needs --sweep"),
    (["--sweep", "seqlen", "--values", "1k", "--explain"], "--explain explains one problem"),
    (["--sweep", "seqlen", "--values", ","], "--values gave no values"),
    (["--sweep", "seqlen", "--values", "1k", "--seqlen-q", "1"], "use --sweep kv-len"),
    (["--sweep", "kv-len", "--values", "1k", "--seqlen-k", "1"], "leave out --seqlen-k"),
])
def test_bad_or_ignored_input_is_a_clear_error(args, message):
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("path,message", [("/nonexistent/x.png", "does not exist"), ("{tmp}/x.xyz", "ending in one of"),
                                          ("{tmp}/x", "ending in one of")])
def test_bad_plot_targets_fail_before_the_sweep(tmp_path, path, message):
    # Checked before matplotlib is imported: runs where it is not installed.
    result = CliRunner().invoke(main, ["simulate", "--sweep", "seqlen", "--values", "1k", "--plot",
                                       path.format(tmp=tmp_path)])
    assert result.exit_code != 0 and message in result.output
    assert "sweeping" not in result.output  # failed before any work


def test_kv_len_sweep_keeps_the_query_length():
    """Decoding: one query row against growing caches."""
    result = CliRunner().invoke(main, ["simulate", "--sweep", "kv-len", "--seqlen-q", "1", "--values", "1k,4k",
                                       "-a", "flash2", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("{"):])["results"]
    assert [r["value"] for r in rows] == [1024, 4096]
    assert rows[1]["requested_bytes"] > 3 * rows[0]["requested_bytes"]  # K/V reads grow with the cache


def test_small_problems_print_in_small_units():
    """Units scale: one 16-token head is kilobytes, not 0.000 GB."""
    result = CliRunner().invoke(main, ["simulate", "--batch", "1", "--heads", "1", "--seqlen", "16", "-a", "standard"])
    assert result.exit_code == 0, result.output
    assert " KB" in result.output and "0.000" not in result.output


def test_format_bytes_scales():
    from cuflash.simulate.report import format_bytes

    assert [format_bytes(x) for x in (0, 999, 1000, 12_345_678, 4.4e9)] == ["0 B", "999 B", "1 KB", "12.35 MB",
                                                                           "4.4 GB"]


def test_flash1_warns_outside_theorem_2():
    result = CliRunner().invoke(main, ["simulate", "-a", "flash1", "--seqlen", "128", "--head-dim", "64"])
    assert result.exit_code == 0, result.output
    assert "outside Theorem 2's range" in result.output  # 98304 elements of SRAM > N d = 8192
    inside = CliRunner().invoke(main, ["simulate", "-a", "flash1", "--seqlen", "16k", "--head-dim", "64"])
    assert "Theorem 2" not in inside.output



# --- cuflash info -------------------------------------------------------------------------------------


def _info(*args, env=None):
    result = CliRunner().invoke(main, ["info", "--json", *args], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _row(report, dtype, head_dim):
    return next(r for r in report["kernels"] if r["dtype"] == dtype and r["head_dim"] == head_dim)


def test_info_says_which_kernel_runs_and_why_on_hopper():
    report = _info("--capability", "90")
    assert report["generation"] == 90
    d64 = _row(report, "bfloat16", 64)
    assert (d64["forward"], d64["backward"]) == ("forward-wgmma", "backward-dkdv-wgmma") and not d64["why"]
    assert d64["deterministic"] == "backward-dkdv-wgmma (ordered dQ)"
    d96 = _row(report, "bfloat16", 96)
    assert (d96["forward"], d96["backward"]) == ("forward-wgmma", "backward-dkdv-wgmma") and not d96["why"]
    d256 = _row(report, "bfloat16", 256)
    assert (d256["forward"], d256["backward"]) == ("forward-wgmma", "backward-dkdv-wgmma") and not d256["why"]
    fp32 = _row(report, "float32", 128)
    assert fp32["forward"] == "forward" and any("takes float16/bfloat16" in why for why in fp32["why"])


def test_info_on_ampere_names_the_hopper_requirement():
    report = _info("--capability", "80")
    d128 = _row(report, "float16", 128)
    assert (d128["forward"], d128["backward"]) == ("forward-mma", "backward-dkdv-mma")
    assert d128["deterministic"] == "backward-dkdv-mma (ordered dQ)"
    assert any("needs Hopper" in why for why in d128["why"])
    d256 = _row(report, "float16", 256)
    assert (d256["backward"], d256["deterministic"]) == ("backward-dkdv-mma", "backward-dkdv-mma (ordered dQ)")
    fp32 = _row(report, "float32", 128)
    assert (fp32["backward"], fp32["deterministic"]) == ("backward-dkdv", "backward-dkdv (separate dQ)")


def test_info_reports_the_kernel_cache(tmp_path):
    (tmp_path / "kernel.cubin").write_bytes(b"x" * 100)
    report = _info("--capability", "90", env={"CUPY_CACHE_DIR": str(tmp_path)})
    assert report["kernel_cache"] == {"path": str(tmp_path), "files": 1, "bytes": 100}
    assert report["versions"]["cuflash"] and report["versions"]["python"]


def test_info_lists_the_gpus_or_says_there_are_none():
    from cuflash.cli import _gpus

    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    gpus = _gpus()
    if gpus:  # the kernel table follows GPU 0's generation
        assert f"GPU 0: {gpus[0]['name']}" in result.output and "kernels on compute capability" in result.output
    else:
        assert "no CUDA GPU found" in result.output and "kernels on" not in result.output
    assert "kernel cache:" in result.output


def test_simulate_block_size_sweep_as_figure_2_middle():
    """Larger key blocks, fewer outer steps of flash1: its requested traffic
    falls as Bc grows (the paper's Figure 2, middle); the time model is left
    out for tiles the algorithm would not choose."""
    result = invoke("simulate", "-a", "flash1", "--pass", "fwd", "--seqlen", "1k", "--sweep", "block-n",
                    "--values", "64,128,256,512", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("{"):])["results"]
    requested = [row["requested_bytes"] for row in rows]
    assert [row["value"] for row in rows] == [64, 128, 256, 512]
    assert requested == sorted(requested, reverse=True) and requested[0] > 1.5 * requested[-1]
    assert all(row["blocks"]["flash1 Bc"] == row["value"] and row["time_model"] is None for row in rows)
    conflict = invoke("simulate", "--sweep", "block-n", "--values", "64", "--block-n", "32")
    assert conflict.exit_code != 0 and "leave out --block-n" in conflict.output


# --- command-line polish (issue 20) ----------------------------------------------------------------


def test_bare_cuflash_shows_help_and_succeeds():
    result = subprocess.run([sys.executable, "-m", "cuflash"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "Commands:" in result.stdout and "simulate" in result.stdout


def test_machine_names_ignore_case():
    upper = invoke("simulate", "--machine", "A100", "-a", "flash2", "--json")
    lower = invoke("simulate", "--machine", "a100", "-a", "flash2", "--json")
    assert upper.exit_code == 0, upper.output
    assert json.loads(upper.output) == json.loads(lower.output)


@pytest.mark.parametrize("machine_readable", ["--json", "--csv"])
def test_explain_is_not_mixed_into_machine_readable_output(machine_readable):
    result = invoke("simulate", "-a", "flash2", "--explain", machine_readable)
    assert result.exit_code == 2
    assert "--explain prints text; leave out --json and --csv" in result.output


def test_sweep_json_has_the_single_run_shape():
    single = json.loads(invoke("simulate", "-a", "flash2", "--json").output)
    sweep = invoke("simulate", "-a", "flash2", "--sweep", "kv-len", "--values", "1k,2k", "--json")
    assert sweep.exit_code == 0, sweep.output
    data = json.loads(sweep.output[sweep.output.index("{"):])
    assert set(single) <= set(data) and data["sweep"] == "kv-len"
    assert data["machine"] == single["machine"] and data["problem"] == single["problem"]
    assert [r["value"] for r in data["results"]] == [1024, 2048]


# --- decoding and the KV cache (issue 18, build 3) --------------------------------------------------


def test_decode_options_reach_the_ledger():
    result = invoke("simulate", "--machine", "h100", "--heads", "32", "--kv-heads", "8", "--seqlen-q", "1",
                    "--seqlen-k", "64k", "-d", "128", "--pass", "fwd", "-a", "cuflash", "--splits", "auto",
                    "--pack-gqa", "--page-size", "16", "--append")
    assert result.exit_code == 0, result.output
    for text in ("pages of 16", "K/V appended", "splits auto", "GQA packed", "block_table", "K_new", "O_partial",
                 "split-KV merge"):
        assert text in result.output, text


def test_flash_decoding_is_listed_beside_cuflash_on_a_lone_long_sequence():
    """Both decode paths pack the query heads and split the keys: both are
    DRAM-bound in the model, within 40% of each other (measured on the
    H100: 0.21 and 0.19 ms; before cuflash's decode path, 2.3 ms)."""
    result = invoke("simulate", "--machine", "h100", "--heads", "32", "--kv-heads", "8", "--seqlen-q", "1",
                    "--seqlen-k", "128k", "-d", "128", "--pass", "fwd", "-a", "cuflash", "-a", "flash-decoding",
                    "--json")
    assert result.exit_code == 0, result.output
    times = {r["algorithm"]: r["time_model"]["seconds"] for r in json.loads(result.output)["results"]}
    assert 0.6 < times["flash-decoding"] / times["cuflash"] < 1.6


@pytest.mark.parametrize("splits,message", [("0", "num_splits must be a whole number of at least 1"),
                                            ("many", "expected a whole number or 'auto', got 'many'")])
def test_bad_split_counts(splits, message):
    result = invoke("simulate", "--splits", splits, "-a", "flash2")
    assert result.exit_code == 2
    assert message in result.output


def test_roofline_points_place_each_algorithm_by_intensity_and_achieved_rate():
    from cuflash.cli import roofline_points
    from cuflash.simulate import MACHINES, Problem, run, summarize
    from cuflash.simulate.timing import estimate

    h100 = MACHINES["h100"]
    records = []
    for n in (1024, 4096):
        problem = Problem(seqlen_q=n, head_dim=128)
        for name in ("standard", "cuflash"):
            traffic = run(name, problem, h100)
            model = estimate(name, problem, h100, "fwd+bwd") if name == "cuflash" else None
            records.append((n, summarize(traffic, h100, model)))
    points = roofline_points(records)
    assert set(points) == {"standard", "cuflash"} and all(len(p) == 2 for p in points.values())
    for intensity, tflops in points["standard"] + points["cuflash"]:
        # under the roofline: neither above the tensor-core peak nor above bandwidth x intensity
        assert 0 < tflops <= min(h100.matmul_flops, h100.hbm_bandwidth * intensity) / 1e12 * 1.0001
    assert min(i for i, _ in points["cuflash"]) > 5 * max(i for i, _ in points["standard"])
