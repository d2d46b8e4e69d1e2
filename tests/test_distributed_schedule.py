"""The ring schedule (cuflash.distributed.schedule) on the CPU: over all
ranks and steps, every (query, key) pair the mask leaves visible is computed
exactly once and no hidden pair ever is, for every world size, sharding and
mask."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.distributed import schedule
from tests.helpers import window_by_definition


def _covered(world: int, chunk: int, causal: bool, balanced: bool, window=(-1, -1)) -> np.ndarray:
    """How often each (query position, key position) of the whole sequence
    is computed by the ranks' steps, from the plans alone (each step's rows,
    keys and mask, as cuflash would apply it), over the ring's length."""
    seqlen = chunk * (2 * world if balanced else world)
    local = seqlen // world
    positions = [schedule.sequence_positions(r, world, seqlen, balanced=balanced) for r in range(world)]
    length = schedule.ring_length(world, local, causal=causal, balanced=balanced, window=window)
    counts = np.zeros((seqlen, seqlen), dtype=int)
    for rank in range(world):
        steps = schedule.ring_steps(rank, world, local, causal=causal, balanced=balanced, window=window)
        assert not any(step.attends for step in steps[length:])
        for step in steps[:length]:
            if not step.attends:
                continue
            (r0, r1), (k0, k1) = step.rows, step.keys
            shown = window_by_definition(r1 - r0, k1 - k0, *step.window, causal=step.causal)
            for i, j in zip(*np.nonzero(shown)):
                counts[positions[rank][r0 + i], positions[step.source][k0 + j]] += 1
    return counts


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_every_visible_pair_is_computed_once(world, causal, balanced):
    counts = _covered(world, 3, causal, balanced)
    seqlen = counts.shape[0]
    np.testing.assert_array_equal(counts, window_by_definition(seqlen, seqlen, -1, -1, causal=causal).astype(int))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(0, 0), (1, 2), (3, -1), (-1, 4), (5, 0), (7, 7), (30, 1)])
def test_windows_are_computed_once_each(world, causal, window):
    counts = _covered(world, 4, causal, False, window)
    seqlen = counts.shape[0]
    np.testing.assert_array_equal(counts, window_by_definition(seqlen, seqlen, *window, causal=causal).astype(int))


def test_a_window_shortens_the_ring():
    # 8 ranks of 4 tokens: a causal window of 5 reaches one shard back
    assert schedule.ring_length(8, 4, causal=True, balanced=False, window=(5, 0)) == 3
    assert schedule.ring_length(8, 4, causal=True, balanced=False, window=(3, 0)) == 2
    assert schedule.ring_length(8, 4, causal=True, balanced=False) == 8
    # a right side reaches the next rank: the ring goes all the way round
    assert schedule.ring_length(8, 4, causal=False, balanced=False, window=(3, 1)) == 8


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balanced_causal_steps_cost_every_rank_the_same(world):
    """After the diagonal, each step is half a block on every rank; with
    contiguous shards the last rank does a whole block every step."""
    local = 8
    for rank in range(world):
        for step in schedule.ring_steps(rank, world, local, causal=True, balanced=True)[1:]:
            area = (step.rows[1] - step.rows[0]) * (step.keys[1] - step.keys[0])
            assert area == local * local // 2 and not step.causal
    last = schedule.ring_steps(world - 1, world, local, causal=True, balanced=False)
    first = schedule.ring_steps(0, world, local, causal=True, balanced=False)
    assert all(step.attends for step in last) and sum(step.attends for step in first) == 1


def test_ulysses_replicates_kv_heads_fewer_than_the_ranks():
    assert schedule.ulysses_kv_copies(32, 8, 4) == 1
    assert schedule.ulysses_kv_copies(32, 2, 8) == 4
    assert schedule.ulysses_kv_copies(8, 1, 8) == 8


def test_positions_and_gathered_order():
    assert schedule.sequence_positions(1, 2, 8, balanced=True) == [2, 3, 4, 5]
    assert schedule.sequence_positions(0, 2, 8, balanced=True) == [0, 1, 6, 7]
    assert schedule.sequence_positions(1, 2, 8, balanced=False) == [4, 5, 6, 7]
    assert schedule.gathered_order(3, balanced=True) == [0, 5, 1, 4, 2, 3]
    assert schedule.gathered_order(3, balanced=False) == [0, 1, 2]


@pytest.mark.parametrize("call, message", [
    (lambda: schedule.ring_steps(2, 2, 4, causal=True, balanced=True), r"rank must be an int in \[0, 2\)"),
    (lambda: schedule.ring_steps(0, 0, 4, causal=True, balanced=True), "world"),
    (lambda: schedule.ring_steps(0, 2, 4, causal=True, balanced=True, window=(3, 0)), "needs contiguous shards"),
    (lambda: schedule.sequence_positions(0, 2, 6, balanced=True), "must split into 4 equal chunks"),
    (lambda: schedule.check_shard_length(17, True), "even length, got 17"),
    (lambda: schedule.ulysses_kv_copies(6, 2, 4), "q's 6 heads do not divide over 4 ranks"),
    (lambda: schedule.ulysses_kv_copies(12, 3, 4), "k and v's 3 heads must divide over the 4 ranks"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
