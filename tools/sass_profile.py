#!/usr/bin/env python3
"""Where a kernel's warps stall, by SASS line: a summary of Nsight Compute's
source page (``ncu -i REPORT --page source --csv --print-source sass``, from
a report taken with ``--section SourceCounters``; tools/ncu_forward.sh
exports one per kernel).

Prints the stall reasons' shares of all warp samples, then the kernel's
instructions in runs of ``--run`` lines, those holding at least
``--floor`` of the samples, each with its share, its most executed
instruction's count (per-tile code and per-block code differ by the blocks
a tile), its three largest stall reasons and the instructions that mark
what it does (tensor-core products and their waits, exponentials, barrier
waits, copies, stores); last the ``--top`` single lines with most samples.
docs/perf-notes.md's "by SASS line" tables were read off this.

  python3 tools/sass_profile.py SOURCE.csv [--run 50] [--floor 0.004] [--top 30]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
#: Opcodes that say what a run of SASS does, in the order they are listed.
LANDMARKS = ("HGMMA", "WARPGROUP.DEPBAR.LE", "MUFU.EX2", "FMNMX.FTZ", "SHFL.BFLY", "SYNCS.PHASECHK.TRANS64.TRYWAIT",
             "BAR.SYNC.DEFER_BLOCKING", "BAR.ARV", "UTMALDG.4D", "UTMASTG.4D", "UBLKRED", "STS", "STG.E", "CALL.REL.NOINC")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def read_source_page(path: str) -> tuple[str, list[dict]]:
    """The kernel's name and one dict per SASS line (the CSV's columns, and
    ``opcode``: the instruction without its predicate or operands)."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    if len(rows) < 2 or not rows[0] or rows[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source page (its first row should name the kernel)")
    header = rows[1]
    if SAMPLES not in header or "Source" not in header:
        raise ValueError(f"{path}: no {SAMPLES!r} column (was the report taken with --section SourceCounters?)")
    lines = []
    for row in rows[2:]:
        line = dict(zip(header, row))
        words = line["Source"].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        line["opcode"] = words[0] if words else ""
        lines.append(line)
    return rows[0][1], lines


def total_samples(lines: list[dict]) -> float:
    """All warp samples of the kernel (1 where there are none, so that shares divide by it)."""
    return sum(_number(line[SAMPLES]) for line in lines) or 1.0


def stall_columns(lines: list[dict]) -> list[str]:
    """The per-reason sample columns (all samples, not the not-issued ones)."""
    return [name for name in (lines[0] if lines else {}) if name.startswith("stall_") and "Not Issued" not in name]


def stall_shares(lines: list[dict]) -> dict[str, float]:
    """Each stall reason's share of all samples, largest first."""
    total = total_samples(lines)
    shares = Counter()
    for line in lines:
        for name in stall_columns(lines):
            shares[name[len("stall_"):]] += _number(line[name]) / total
    return dict(shares.most_common())


def runs(lines: list[dict], length: int, floor: float) -> list[dict]:
    """Runs of ``length`` consecutive lines holding at least ``floor`` of the
    samples: first and last line, share, most executions of a line, the three
    largest stall reasons' shares and the landmark opcodes' counts."""
    total = total_samples(lines)
    columns = stall_columns(lines)
    out = []
    for first in range(0, len(lines), length):
        run = lines[first:first + length]
        share = sum(_number(line[SAMPLES]) for line in run) / total
        if share < floor:
            continue
        reasons = Counter({name[len("stall_"):]: sum(_number(line[name]) for line in run) / total
                           for name in columns})
        # a landmark names an opcode and its variants (HGMMA: HGMMA.64x128x16.F32.BF16, ...)
        landmarks = Counter(op for line in run for op in LANDMARKS
                            if line["opcode"] == op or line["opcode"].startswith(op + "."))
        out.append({"first": first, "last": first + len(run) - 1, "share": share,
                    "executed": max(_number(line[EXECUTED]) for line in run),
                    "stalls": [(name, value) for name, value in reasons.most_common(3) if value > 0],
                    "landmarks": {op: landmarks[op] for op in LANDMARKS if landmarks[op]}})
    return out


def top_lines(lines: list[dict], count: int) -> list[tuple[int, float, dict]]:
    """The ``count`` lines with most samples, in program order: (index, share, line)."""
    total = total_samples(lines)
    ranked = sorted(range(len(lines)), key=lambda i: -_number(lines[i][SAMPLES]))[:count]
    return [(i, _number(lines[i][SAMPLES]) / total, lines[i]) for i in sorted(ranked)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the CSV of ncu's source page (SASS)")
    parser.add_argument("--run", type=int, default=50, help="lines a run (default 50)")
    parser.add_argument("--floor", type=float, default=0.004, help="smallest share of samples a run listed holds")
    parser.add_argument("--top", type=int, default=30, help="single lines listed (default 30)")
    args = parser.parse_args(argv)
    kernel, lines = read_source_page(args.source)
    samples = sum(_number(line[SAMPLES]) for line in lines)
    print(f"{kernel}\n{len(lines)} SASS lines, {samples:.0f} warp samples")
    print("stalls: " + ", ".join(f"{name} {100 * share:.1f}%" for name, share in stall_shares(lines).items()
                                 if share >= 0.001))
    print(f"\n| lines | samples | most executed | stalls | landmarks |\n|---|---|---|---|---|")
    for run in runs(lines, args.run, args.floor):
        stalls = ", ".join(f"{name} {100 * value:.1f}%" for name, value in run["stalls"])
        landmarks = ", ".join(f"{op} x{n}" for op, n in run["landmarks"].items())
        print(f"| {run['first']}-{run['last']} | {100 * run['share']:.1f}% | {run['executed']:.0f} | {stalls} | "
              f"{landmarks} |")
    print(f"\n| line | samples | executed | instruction |\n|---|---|---|---|")
    for index, share, line in top_lines(lines, args.top):
        print(f"| {index} | {100 * share:.2f}% | {line[EXECUTED]} | `{line['Source'].strip()}` |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
