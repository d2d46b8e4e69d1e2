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
    assert "requested GB" in result.output and "DRAM GB" in result.output and "traffic by tensor" in result.output


def test_simulate_json_reproduces_figure2():
    result = invoke(*FIGURE2, "-a", "pytorch", "-a", "flash1", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
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
