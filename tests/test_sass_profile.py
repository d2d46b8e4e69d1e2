"""tools/sass_profile.py: the summary of an ncu source page (CPU only, a
source page written here in ncu's CSV form)."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import sass_profile  # noqa: E402

HEADER = ["Address", "Source", sass_profile.SAMPLES, "Warp Stall Sampling (Not-issued Samples)",
          sass_profile.EXECUTED, "stall_barrier", "stall_wait", "stall_long_sb", "stall_barrier (Not Issued)"]


def _write(path, lines):
    """A source page of (source, samples, executed, barrier, wait, long_sb) lines."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["Kernel Name", "void k<1>(P)"])
        writer.writerow(HEADER)
        for i, (source, samples, executed, barrier, wait, long_sb) in enumerate(lines):
            writer.writerow([hex(i * 16), source, samples, samples, executed, barrier, wait, long_sb, barrier])


def test_shares_runs_and_top_lines(tmp_path):
    page = tmp_path / "page.csv"
    _write(page, [("IABS R2, R0", 10, 100, 0, 10, 0),
                  ("@!P0  BRA 0x10", 30, 100, 0, 0, 30),
                  ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT", 0, 50, 0, 0, 0),
                  ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 60, 50, 60, 0, 0)])
    kernel, lines = sass_profile.read_source_page(str(page))
    assert kernel == "void k<1>(P)" and [line["opcode"] for line in lines][:2] == ["IABS", "BRA"]
    # the not-issued column of a reason is not counted again
    assert sass_profile.stall_shares(lines) == pytest.approx({"barrier": 0.6, "long_sb": 0.3, "wait": 0.1})
    first, second = sass_profile.runs(lines, 2, 0.0)
    assert (first["first"], first["last"], first["share"], first["executed"]) == (0, 1, pytest.approx(0.4), 100)
    assert first["stalls"] == [("long_sb", pytest.approx(0.3)), ("wait", pytest.approx(0.1))]
    assert second["landmarks"] == {"HGMMA": 1, "WARPGROUP.DEPBAR.LE": 1}
    assert [run["first"] for run in sass_profile.runs(lines, 2, 0.5)] == [2]  # runs below the floor are left out
    assert [(i, share) for i, share, _ in sass_profile.top_lines(lines, 2)] == [(1, 0.3), (3, 0.6)]


def test_main_prints_the_tables(tmp_path, capsys):
    page = tmp_path / "page.csv"
    _write(page, [("FADD R1, R2, R3", 5, 7, 0, 5, 0)])
    assert sass_profile.main([str(page), "--run", "10", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 SASS lines, 5 warp samples" in out and "stalls: wait 100.0%" in out
    assert "| 0-0 | 100.0% | 7 | wait 100.0% |" in out and "`FADD R1, R2, R3`" in out


def test_rejects_what_is_not_a_source_page(tmp_path):
    other = tmp_path / "details.csv"
    other.write_text('"ID","Metric Name"\n"0","gpu__time_duration.sum"\n')
    with pytest.raises(ValueError, match="not an ncu source page"):
        sass_profile.read_source_page(str(other))
    page = tmp_path / "page.csv"
    page.write_text('"Kernel Name","k"\n"Address","Source"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        sass_profile.read_source_page(str(page))
