#!/usr/bin/env python3
"""Compares cuflash's GPU times between benchmark runs of two builds (for
example a commit and its parent, measured back to back on one machine):
per point of the grid, new / base time of cuflash, and the same ratio for
the flash backend as the measure of the machine's drift between the runs.

  python3 tools/bench_compare.py BASE.json NEW.json [BASE2.json NEW2.json ...] [--limit 0.03]

With several pairs, each point's ratio is the median over the pairs. Exits
1 if any point's cuflash ratio leaves 1 +- limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _points(path: str) -> dict:
    rows = json.load(open(path))["rows"]
    return {(r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"]): r["ms"] for r in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="bench.json files: base, new, base, new, ...")
    parser.add_argument("--limit", type=float, default=0.03)
    args = parser.parse_args()
    if len(args.runs) % 2:
        parser.error("give pairs of runs: base, new, ...")
    pairs = [(_points(args.runs[i]), _points(args.runs[i + 1])) for i in range(0, len(args.runs), 2)]
    keys = [key for key in pairs[0][0] if all(key in base and key in new for base, new in pairs)]
    print("| pass | dtype | head_dim | causal | seqlen | base ms | new ms | cuflash new/base | flash new/base |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for key in keys:
        ratio = statistics.median(new[key]["cuflash"] / base[key]["cuflash"] for base, new in pairs)
        drift = statistics.median(new[key]["flash"] / base[key]["flash"] for base, new in pairs)
        worst = max(worst, abs(ratio - 1))
        base_ms = statistics.median(base[key]["cuflash"] for base, _ in pairs)
        new_ms = statistics.median(new[key]["cuflash"] for _, new in pairs)
        print(f"| {' | '.join(map(str, key))} | {base_ms:.3f} | {new_ms:.3f} | {ratio:.3f} | {drift:.3f} |")
    print(f"\n{len(keys)} points, {len(pairs)} pair(s): largest |cuflash new/base - 1| = {worst:.3f} "
          f"(limit {args.limit})")
    return 0 if worst <= args.limit else 1


if __name__ == "__main__":
    sys.exit(main())
