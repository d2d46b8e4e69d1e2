"""What a persistent forward's tile schedule costs: the makespan of the
kernel's static walk (kernels_cu/grid.cuh ``PersistentTileWalk``: block g
takes steps g, g + grid, ...; causal tiles in pairs of a long and a short
walk) against a dynamic scheduler that hands each free block the longest
tile left (list scheduling, longest first), the same scheduler taking heads
in groups (longest first within a group: what keeps L2's working set, see
``group_heads``), and the ideal (all work spread evenly). A tile's cost is
``a + b x key blocks``, the per-tile and per-block microseconds
``tools/tile_cost_fit.py`` fits from a benchmark JSON; tiles and their key
blocks come from the simulator's query sweep (cuflash.simulate), whose mask
rules are the kernels'.

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


def group_heads(tiles_per_head: int, grid: int) -> int:
    """Heads a grouped order takes together: about a grid's worth of tiles,
    so that the blocks running at once read the K/V of as few heads as the
    static walk's (``grid`` consecutive tiles of the flattened order: about
    8 MB of K/V at d128 in 16 bits, whatever the length). A global
    longest-first order would have every block on another head at once
    (132 heads' K/V: 132 MB at 2k keys, past L2)."""
    return max(1, round(grid / tiles_per_head))


def _list_schedule(costs: list[float], grid: int) -> float:
    """Makespan of handing each tile, in ``costs``' order, to the block that
    is free first (a dynamic scheduler's counter)."""
    finish = [0.0] * grid
    for c in costs:
        heapq.heappush(finish, heapq.heappop(finish) + c)
    return max(finish)


def makespans(blocks_per_tile: list[int], heads: int, grid: int, a: float, b: float,
              paired: bool) -> dict[str, float]:
    """Microseconds until the last block is done, for ``heads`` heads (batch
    x heads) of tiles visiting ``blocks_per_tile`` key blocks: the static
    walk's; a dynamic scheduler's in global longest-first order
    ("dynamic") and in longest-first order within groups of
    ``group_heads`` heads, groups one after another ("grouped", the order
    that keeps L2's working set); the even spread's."""
    per_head = len(blocks_per_tile)
    # Paired (causal) walks count a head's tiles from its last query block
    # (block_info.cuh, query_coordinates_from: longest first).
    order = blocks_per_tile[::-1] if paired else blocks_per_tile
    cost = [a + b * order[t % per_head] for t in range(heads * per_head)]
    static = max(sum(cost[t] for t in walk) for walk in persistent_tile_walks(len(cost), per_head, grid, paired))
    longest_first = sorted(range(per_head), key=lambda p: -order[p])
    size = group_heads(per_head, grid)
    grouped = [a + b * order[p] for g0 in range(0, heads, size)
               for p in longest_first for _ in range(min(size, heads - g0))]
    return {"static": static, "dynamic": _list_schedule(sorted(cost, reverse=True), grid),
            "grouped": _list_schedule(grouped, grid), "even": sum(cost) / grid}


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
    print("| seqlen | static us | dynamic us | grouped us (heads a group) | even us | static / dynamic | "
          "static / grouped |")
    print("|---|---|---|---|---|---|---|")
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        heads = 16384 // seqlen * (2048 // args.head_dim)
        blocks = tile_blocks(seqlen, args.causal, args.block_m, args.block_n)
        spans = makespans(blocks, heads, args.sms, args.a, args.b, paired=args.causal)
        print(f"| {seqlen} | {spans['static']:.1f} | {spans['dynamic']:.1f} | {spans['grouped']:.1f} "
              f"({group_heads(len(blocks), args.sms)}) | {spans['even']:.1f} | "
              f"{spans['static'] / spans['dynamic']:.3f} | {spans['static'] / spans['grouped']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
