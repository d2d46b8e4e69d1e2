"""What a persistent forward's tile schedule costs: the makespan of the
kernel's static walk (kernels_cu/grid.cuh ``PersistentTileWalk``: block g
takes steps g, g + grid, ...; causal tiles in pairs of a long and a short
walk) against a dynamic scheduler that hands each free block the longest
tile left (list scheduling, longest first), and the ideal (all work spread
evenly). A tile's cost is ``a + b x key blocks``, the per-tile and
per-block microseconds ``tools/tile_cost_fit.py`` fits from a benchmark
JSON; tiles and their key blocks come from the simulator's query sweep
(cuflash.simulate), whose mask rules are the kernels'.

A model, not a measurement: it predicts what a dynamic scheduler (not
built; docs/perf-notes.md, "Design, not built: a dynamic tile scheduler")
could take off the static walk's imbalance, before device time is spent.

    python tools/persistent_schedule.py --a 2.91 --b 1.39 --causal --head-dim 128
"""

from __future__ import annotations

import argparse
import heapq

from cuflash._tiling import persistent_tile_walks
from cuflash.simulate.algorithms import query_sweep
from cuflash.simulate.traffic import Problem


def tile_blocks(seqlen: int, causal: bool, block_m: int, block_n: int) -> list[int]:
    """Key blocks each query tile of one head visits (seqlen_q = seqlen_k)."""
    sweep = query_sweep(Problem(batch=1, nheads=1, seqlen_q=seqlen, seqlen_k=seqlen, causal=causal),
                        block_m, block_n)
    return [-(-tile.keys // block_n) for tile in sweep]


def makespans(blocks_per_tile: list[int], heads: int, grid: int, a: float, b: float,
              paired: bool) -> dict[str, float]:
    """Microseconds until the last block is done: the static walk's, the
    dynamic longest-first scheduler's, and the even spread's, for ``heads``
    heads (batch x heads) of tiles visiting ``blocks_per_tile`` key blocks."""
    per_head = len(blocks_per_tile)
    # Paired (causal) walks count a head's tiles from its last query block
    # (block_info.cuh, query_coordinates_from: longest first).
    order = blocks_per_tile[::-1] if paired else blocks_per_tile
    cost = [a + b * order[t % per_head] for t in range(heads * per_head)]
    static = max(sum(cost[t] for t in walk) for walk in persistent_tile_walks(len(cost), per_head, grid, paired))
    finish = [0.0] * grid
    for c in sorted(cost, reverse=True):
        heapq.heappush(finish, heapq.heappop(finish) + c)
    return {"static": static, "dynamic": max(finish), "even": sum(cost) / grid}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=float, required=True, help="us a tile costs beside its blocks")
    parser.add_argument("--b", type=float, required=True, help="us a key block costs")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--head-dim", type=int, default=128, help="FA2 grid: 2048 / head_dim heads")
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--sms", type=int, default=132, help="blocks of the grid (one an SM)")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192")
    args = parser.parse_args(argv)
    print("| seqlen | static us | dynamic us | even us | static / dynamic |")
    print("|---|---|---|---|---|")
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        heads = 16384 // seqlen * (2048 // args.head_dim)
        spans = makespans(tile_blocks(seqlen, args.causal, args.block_m, args.block_n), heads, args.sms, args.a,
                          args.b, paired=args.causal)
        print(f"| {seqlen} | {spans['static']:.1f} | {spans['dynamic']:.1f} | {spans['even']:.1f} | "
              f"{spans['static'] / spans['dynamic']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
