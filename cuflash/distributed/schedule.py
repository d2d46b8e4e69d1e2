"""Which queries meet which keys at each step of ring attention (pure Python).

Ring attention shards one sequence of ``seqlen`` tokens over ``world`` ranks.
Every rank keeps its queries; at step ``i`` it attends them to the K/V
shard of rank ``(rank - i) % world`` (the block received ``i`` steps ago),
and the partial results are merged by their log-sum-exps.

Two shardings:

* **contiguous**: rank r holds tokens ``[r * shard, (r + 1) * shard)``. With
  a causal mask, rank r attends to ranks 0..r only, so the last rank works
  every step while rank 0 works once.
* **balanced** (causal load balancing): the sequence is cut into ``2 world``
  equal chunks and rank r holds chunks ``r`` and ``2 world - 1 - r`` (one
  early, one late), in that order. With a causal mask every step after the
  first costs every rank the same: half its queries against all of a K/V
  shard, or all its queries against half of one.

The plans here are shared by the PyTorch and JAX implementations and by the
simulator's model of them.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The half of a local shard a step uses: all of it, its first half (the
#: early chunk of a balanced shard) or its second half (the late chunk).
PARTS = ("all", "early", "late")


@dataclass(frozen=True)
class RingStep:
    """What one rank computes at one ring step.

    ``source``: the rank whose K/V shard the step attends to. ``causal``:
    the step is the shard's own diagonal block, masked causally (within a
    balanced shard the plain causal mask over its two chunks is the right
    one: the early chunk's queries see none of the late chunk's keys, the
    late chunk's queries see all of the early chunk's). ``query_part`` and
    ``key_part``: the halves of the local queries and of the received keys
    that meet (``PARTS``). ``attends``: False when the whole block is masked
    (contiguous causal, a later rank's keys); the rank only forwards the
    block.
    """

    source: int
    causal: bool = False
    query_part: str = "all"
    key_part: str = "all"
    attends: bool = True


def check_world(rank: int, world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world (the number of ranks in the ring) must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def ring_steps(rank: int, world: int, *, causal: bool, balanced: bool) -> tuple[RingStep, ...]:
    """The ``world`` steps of ``rank``, in ring order (step 0: its own shard)."""
    check_world(rank, world)
    steps = []
    for i in range(world):
        source = (rank - i) % world
        if source == rank:
            steps.append(RingStep(source, causal=causal))
        elif not causal:
            steps.append(RingStep(source))
        elif balanced:
            # Source chunks s < r < 2w-1-r: all queries see the early chunk s
            # and none of the late chunk 2w-1-s (later than both of ours).
            # Source s > r: chunks s and 2w-1-s both lie between our early
            # chunk r and our late chunk 2w-1-r: only the late queries see
            # them, all of them.
            steps.append(RingStep(source, key_part="early") if source < rank
                         else RingStep(source, query_part="late"))
        else:
            steps.append(RingStep(source) if source < rank else RingStep(source, attends=False))
    return tuple(steps)


def shard_chunks(rank: int, world: int, *, balanced: bool) -> tuple[int, ...]:
    """The chunks of the sequence ``rank`` holds, in order: with
    ``balanced`` the sequence is cut into ``2 world`` chunks, else into
    ``world``."""
    check_world(rank, world)
    return (rank, 2 * world - 1 - rank) if balanced else (rank,)


def check_shard_length(seqlen_local: int, balanced: bool, name: str = "the local sequence") -> None:
    if balanced and seqlen_local % 2:
        raise ValueError(f"balanced sharding gives each rank two equal chunks: {name} must have an even "
                         f"length, got {seqlen_local}")


def sequence_positions(rank: int, world: int, seqlen: int, *, balanced: bool) -> list[int]:
    """The global token positions of ``rank``'s shard of a ``seqlen``-token
    sequence, in the order the shard holds them (for position embeddings)."""
    chunks = 2 * world if balanced else world
    check_world(rank, world)
    if seqlen % chunks:
        raise ValueError(f"seqlen ({seqlen}) must split into {chunks} equal chunks for "
                         f"{'balanced' if balanced else 'contiguous'} sharding over {world} ranks")
    size = seqlen // chunks
    return [c * size + t for c in shard_chunks(rank, world, balanced=balanced) for t in range(size)]


def gathered_order(world: int, *, balanced: bool) -> list[int]:
    """For shards concatenated in rank order, the chunk each position holds:
    ``gathered_order(w)[j]`` is the sequence chunk at chunk slot ``j`` of the
    concatenation (the inverse permutation restores the sequence's order)."""
    return [c for rank in range(world) for c in shard_chunks(rank, world, balanced=balanced)]


def part_bounds(part: str, length: int) -> tuple[int, int]:
    """``(start, stop)`` of a ``PARTS`` name within a shard of ``length`` tokens."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    half = length // 2
    return {"all": (0, length), "early": (0, half), "late": (half, length)}[part]
