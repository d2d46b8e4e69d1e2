"""tools/tile_cost_fit.py: the per-tile and per-block costs of a forward,
fitted to benchmark rows (CPU only)."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


def _rows(a: float, b: float, causal: bool, impl: str = "cuflash", sms: int = 132) -> list[dict]:
    """FA2-grid forward rows whose times are exactly (tiles a + blocks b) / sms."""
    from tile_cost_fit import work_units

    rows = []
    for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
        batch, heads = 16384 // seqlen, 16
        tiles, blocks = work_units(seqlen, batch, heads, causal, 128, 128)
        rows.append({"pass": "fwd", "dtype": "bfloat16", "head_dim": 128, "causal": causal, "seqlen": seqlen,
                     "batch": batch, "heads": heads, "ms": {impl: (tiles * a + blocks * b) / sms / 1000.0}})
    return rows


def test_work_units_count_the_causal_triangle():
    from tile_cost_fit import work_units

    assert work_units(512, 2, 3, False, 128, 128) == (24, 96.0)
    assert work_units(512, 1, 1, True, 128, 128) == (4, 10.0)  # 1 + 2 + 3 + 4 key blocks
    assert work_units(300, 1, 1, True, 128, 64) == (3, 11.0)  # rows 0-127: 2 blocks, 128-255: 4, 256-299: 5


@pytest.mark.parametrize("causal", [False, True])
def test_fit_recovers_the_costs_that_made_the_rows(causal):
    from tile_cost_fit import fit

    rows = _rows(3.5, 1.25, causal) + _rows(9.0, 9.0, not causal)  # the other mask's rows must not count
    result = fit(rows, "cuflash", causal, head_dim=128, dtype="bfloat16", block_m=128, block_n=128, sms=132,
                 seqlens=(512, 16384))
    assert result["points"] == 6
    assert result["a_us_per_tile"] == pytest.approx(3.5, rel=1e-9)
    assert result["b_us_per_block"] == pytest.approx(1.25, rel=1e-9)
    assert result["max_relative_error"] < 1e-9


def test_cli_prints_json_and_fails_without_rows(tmp_path, capsys):
    from tile_cost_fit import main

    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": _rows(2.0, 1.5, False, impl="cudnn") + _rows(4.0, 1.3, True)}))
    assert main([str(path), "--json"]) == 0
    results = {(r["impl"], r["causal"]): r for r in json.loads(capsys.readouterr().out)}
    assert set(results) == {("cudnn", False), ("cuflash", True)}
    assert results[("cudnn", False)]["a_us_per_tile"] == pytest.approx(2.0)
    assert results[("cuflash", True)]["b_us_per_block"] == pytest.approx(1.3)
    assert main([str(path), "--head-dim", "64"]) == 1
    assert "no forward rows of head_dim 64" in capsys.readouterr().err
