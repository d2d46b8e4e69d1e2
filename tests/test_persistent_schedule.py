"""tools/persistent_schedule.py: the persistent forward's static tile walk
(the kernel's PersistentTileWalk, mirrored by
cuflash._tiling.persistent_tile_walks) against a dynamic longest-first
scheduler (CPU only)."""

import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("tiles_per_head,heads,grid", [(4, 512, 132), (5, 7, 3), (1, 9, 4), (23, 36, 132),
                                                        (8, 3, 40)])
def test_static_walk_takes_every_tile_once(paired, tiles_per_head, heads, grid):
    from cuflash._tiling import persistent_tile_walks

    walks = persistent_tile_walks(heads * tiles_per_head, tiles_per_head, grid, paired)
    assert len(walks) == grid
    assert Counter(t for walk in walks for t in walk) == Counter(range(heads * tiles_per_head))


def test_static_walk_blocks_match_the_launchers_grid():
    """A paired walk's blocks that get work are ``persistent_grid``'s count
    where there are fewer units than slots (the launcher launches no idle
    block)."""
    from cuflash._tiling import persistent_grid, persistent_tile_walks

    for tiles_per_head, heads in ((4, 10), (5, 7), (23, 3)):
        slots = 132
        busy = sum(1 for walk in persistent_tile_walks(heads * tiles_per_head, tiles_per_head, slots, True) if walk)
        assert busy == persistent_grid(heads * tiles_per_head, slots, tiles_per_head, True)


def test_paired_causal_walks_pair_long_and_short_tiles():
    """With an even number of tiles a head, each block's tiles come in pairs
    whose key blocks sum to tiles + 1: a block of k units costs k pairs."""
    from cuflash._tiling import persistent_tile_walks
    from persistent_schedule import makespans, tile_blocks

    blocks = tile_blocks(1024, True, 128, 128)
    assert blocks == [1, 2, 3, 4, 5, 6, 7, 8]
    walks = persistent_tile_walks(8 * 64, 8, 16, True)
    for walk in walks:
        assert len(walk) % 2 == 0
        longest_first = blocks[::-1]
        pairs = [longest_first[walk[i] % 8] + longest_first[walk[i + 1] % 8] for i in range(0, len(walk), 2)]
        assert set(pairs) == {9}
    # 256 units over 16 blocks: 16 units each, all alike: static = dynamic = even.
    spans = makespans(blocks, 64, 16, 3.0, 1.5, paired=True)
    assert spans["static"] == pytest.approx(16 * (2 * 3.0 + 9 * 1.5))
    assert spans["static"] == pytest.approx(spans["dynamic"]) == pytest.approx(spans["even"])


@pytest.mark.parametrize("seqlen,causal", [(512, True), (2048, True), (512, False), (1000, False), (1000, True)])
def test_dynamic_is_never_worse_than_the_static_walk_here(seqlen, causal):
    """The even spread is a lower bound of any schedule, and list scheduling
    ends within one tile of it (Graham: at most the even spread plus the
    longest tile); on these grids the dynamic scheduler also never loses to
    the static walk, and without a mask (equal tiles) ties it."""
    from persistent_schedule import makespans, tile_blocks

    blocks = tile_blocks(seqlen, causal, 128, 128)
    spans = makespans(blocks, 16384 // seqlen * 16, 132, 2.9, 1.4, paired=causal)
    assert spans["even"] <= spans["dynamic"] + 1e-9
    assert spans["dynamic"] <= spans["static"] + 1e-9
    assert spans["dynamic"] <= spans["even"] + 2.9 + 1.4 * max(blocks) + 1e-9
    if not causal:
        assert spans["dynamic"] == pytest.approx(spans["static"])


def test_grouped_order_keeps_a_grids_worth_of_tiles_together():
    """Heads a group: about grid / tiles a head (at least one), so that the
    blocks running at once read as few heads' K/V as the static walk's."""
    from persistent_schedule import group_heads

    assert [group_heads(tiles, 132) for tiles in (4, 8, 16, 32, 64, 128, 300)] == [33, 16, 8, 4, 2, 1, 1]


@pytest.mark.parametrize("seqlen", [1024, 2048, 4096, 8192])
def test_grouped_dynamic_order_beats_the_static_causal_walk(seqlen):
    """Causal, d128's tiles on 132 blocks, H200-fitted costs: longest first
    within groups of heads (the order a counter would hand out without
    thrashing L2) ends before the paired static walk and after the even
    spread; it schedules every tile (its total work is the static walk's)."""
    from persistent_schedule import makespans, tile_blocks

    spans = makespans(tile_blocks(seqlen, True, 128, 128), 16384 // seqlen * 16, 132, 2.91, 1.39, paired=True)
    assert spans["even"] <= spans["grouped"] < spans["static"]
    assert spans["grouped"] <= spans["even"] + 2.91 + 1.39 * seqlen // 128 + 1e-9


def test_cli_prints_a_row_per_length(capsys):
    from persistent_schedule import main

    assert main(["--a", "2.91", "--b", "1.39", "--causal", "--seqlens", "512,2048"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| seqlen |") and len(out) == 4
    assert out[2].startswith("| 512 |") and out[3].startswith("| 2048 |")
    assert out[0].count("|") == out[3].count("|") == 8  # seven columns, the grouped one among them
