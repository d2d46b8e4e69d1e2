"""Where a forward's time goes by tile and by key block: a least-squares fit
of a benchmark JSON's forward rows (``tools/bench.py``) to

    ms x 1000 = (tiles x a + key blocks x b) / SMs

per implementation and mask, where a call of batch x heads x seqlen has
``tiles`` query tiles of block_m rows and each tile visits ``key blocks``
of block_n keys (all of them without a mask; on average (T + 1) / 2 of
its T under a causal one). ``a`` is the microseconds a tile costs beside
its blocks (its first scores and last products alone, the output, the
next tile's start), ``b`` those of one block. The tile is cuflash's for
every implementation (cuDNN's may differ): the fit compares costs per
unit of work, not kernels' structures. docs/perf-notes.md reads the d128
rows this way ("Where the short forwards lose").

    python tools/tile_cost_fit.py benchmarks/h100.json --head-dim 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from cuflash.simulate.algorithms import query_sweep
from cuflash.simulate.traffic import Problem


def work_units(seqlen: int, batch: int, heads: int, causal: bool, block_m: int, block_n: int) -> tuple[int, float]:
    """(query tiles, key blocks visited by all of them) of a call with
    seqlen_q = seqlen_k = ``seqlen``: the simulator's query sweep, whose
    mask rules are the kernels'."""
    sweep = query_sweep(Problem(batch=batch, nheads=heads, seqlen_q=seqlen, seqlen_k=seqlen, causal=causal),
                        block_m, block_n)
    # A tile's visited keys start on a key-block boundary: its block count is their ceiling.
    per_head = sum(-(-tile.keys // block_n) for tile in sweep)
    return batch * heads * len(sweep), float(batch * heads * per_head)


def fit(rows: list[dict], impl: str, causal: bool, *, head_dim: int, dtype: str, block_m: int, block_n: int,
        sms: int, seqlens: tuple[int, int]) -> dict | None:
    """a and b (us) of ``impl`` on the forward rows that match, with the
    largest relative error of the fit over them; None under two rows."""
    design, measured = [], []
    for row in rows:
        if (row.get("pass") != "fwd" or row["dtype"] != dtype or row["head_dim"] != head_dim
                or row["causal"] != causal or not seqlens[0] <= row["seqlen"] <= seqlens[1] or impl not in row["ms"]):
            continue
        tiles, blocks = work_units(row["seqlen"], row["batch"], row["heads"], causal, block_m, block_n)
        design.append([tiles / sms, blocks / sms])
        measured.append(row["ms"][impl] * 1000.0)
    if len(measured) < 2:
        return None
    design_matrix, times = np.array(design), np.array(measured)
    (a, b), *_ = np.linalg.lstsq(design_matrix, times, rcond=None)
    error = float(np.max(np.abs(design_matrix @ np.array([a, b]) - times) / times))
    return {"impl": impl, "causal": causal, "a_us_per_tile": float(a), "b_us_per_block": float(b),
            "max_relative_error": error, "points": len(measured)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--sms", type=int, default=132, help="multiprocessors (132: H100 SXM)")
    parser.add_argument("--min-seqlen", type=int, default=512)
    parser.add_argument("--max-seqlen", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = json.loads(args.bench_json.read_text())["rows"]
    impls = sorted({name for row in rows if row.get("pass") == "fwd" for name in row["ms"]})
    results = [r for impl in impls for causal in (False, True)
               if (r := fit(rows, impl, causal, head_dim=args.head_dim, dtype=args.dtype, block_m=args.block_m,
                            block_n=args.block_n, sms=args.sms, seqlens=(args.min_seqlen, args.max_seqlen)))]
    if not results:
        print(f"no forward rows of head_dim {args.head_dim} and {args.dtype} in {args.bench_json}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"| {args.dtype} d{args.head_dim}, {args.block_m} x {args.block_n} tiles, {args.sms} SMs "
          "| a, us a tile | b, us a block | worst fit | points |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['impl']}, {'causal' if r['causal'] else 'no mask'} | {r['a_us_per_tile']:.2f} "
              f"| {r['b_us_per_block']:.3f} | {100 * r['max_relative_error']:.1f}% | {r['points']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
