"""The ring schedule (cuflash.distributed.schedule) on the CPU: over all
ranks and steps, every (query, key) pair the mask leaves visible is computed
exactly once and no hidden pair ever is, for every world size, sharding and
mask."""

from __future__ import annotations

import numpy as np
import pytest

from cuflash.distributed import schedule


def _covered(world: int, chunk: int, causal: bool, balanced: bool) -> np.ndarray:
    """How often each (query position, key position) of the whole sequence
    is computed by the ranks' steps, from the plans alone."""
    seqlen = chunk * (2 * world if balanced else world)
    local = seqlen // world
    positions = [schedule.sequence_positions(r, world, seqlen, balanced=balanced) for r in range(world)]
    counts = np.zeros((seqlen, seqlen), dtype=int)
    for rank in range(world):
        for step in schedule.ring_steps(rank, world, causal=causal, balanced=balanced):
            if not step.attends:
                continue
            q_start, q_stop = schedule.part_bounds(step.query_part, local)
            k_start, k_stop = schedule.part_bounds(step.key_part, local)
            for i in range(q_start, q_stop):
                for j in range(k_start, k_stop):
                    # the step's own mask: causal over the shard's local order
                    if step.causal and j > i:
                        continue
                    counts[positions[rank][i], positions[step.source][j]] += 1
    return counts


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("balanced", [False, True])
def test_every_visible_pair_is_computed_once(world, causal, balanced):
    counts = _covered(world, 3, causal, balanced)
    seqlen = counts.shape[0]
    visible = np.tril(np.ones((seqlen, seqlen), dtype=int)) if causal else np.ones((seqlen, seqlen), dtype=int)
    np.testing.assert_array_equal(counts, visible)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balanced_causal_steps_cost_every_rank_the_same(world):
    """After the diagonal, each step is half a block on every rank; with
    contiguous shards the last rank does a whole block every step."""
    for rank in range(world):
        steps = schedule.ring_steps(rank, world, causal=True, balanced=True)[1:]
        assert all((step.query_part == "all") != (step.key_part == "all") for step in steps)
    last = schedule.ring_steps(world - 1, world, causal=True, balanced=False)
    first = schedule.ring_steps(0, world, causal=True, balanced=False)
    assert all(step.attends for step in last) and sum(step.attends for step in first) == 1


def test_positions_and_gathered_order():
    assert schedule.sequence_positions(1, 2, 8, balanced=True) == [2, 3, 4, 5]
    assert schedule.sequence_positions(0, 2, 8, balanced=True) == [0, 1, 6, 7]
    assert schedule.sequence_positions(1, 2, 8, balanced=False) == [4, 5, 6, 7]
    assert schedule.gathered_order(3, balanced=True) == [0, 5, 1, 4, 2, 3]
    assert schedule.gathered_order(3, balanced=False) == [0, 1, 2]


@pytest.mark.parametrize("call, message", [
    (lambda: schedule.ring_steps(2, 2, causal=True, balanced=True), r"rank must be an int in \[0, 2\)"),
    (lambda: schedule.ring_steps(0, 0, causal=True, balanced=True), "world"),
    (lambda: schedule.sequence_positions(0, 2, 6, balanced=True), "must split into 4 equal chunks"),
    (lambda: schedule.check_shard_length(17, True), "even length, got 17"),
    (lambda: schedule.part_bounds("middle", 4), "part must be one of"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
