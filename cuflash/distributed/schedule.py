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

import functools
import math
from dataclasses import dataclass

from .._validation import check_window

#: Query rows or key rows of a local shard, ``(start, stop)``.
Rows = tuple[int, int]


@dataclass(frozen=True)
class RingStep:
    """What one rank computes at one ring step.

    ``source``: the rank whose K/V shard the step attends to. ``rows`` and
    ``keys``: the local query rows and the received key rows that meet,
    ``(start, stop)``; the rest of the queries get nothing from this step.
    ``causal`` and ``window``: the mask of that call, as
    ``cuflash.attention`` takes them (bottom-right aligned on the rows and
    keys given). Within a balanced shard the plain causal mask over its two
    chunks is the right one: the early chunk's queries see none of the late
    chunk's keys, the late chunk's queries all of the early chunk's.
    ``attends``: False when the whole block is masked; the rank only
    forwards it.
    """

    source: int
    rows: Rows
    keys: Rows
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    attends: bool = True


def check_world(rank: int, world: int) -> None:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world (the number of ranks in the ring) must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")


def ring_steps(rank: int, world: int, seqlen: int, *, causal: bool, balanced: bool,
               window: tuple[int, int] = (-1, -1)) -> tuple[RingStep, ...]:
    """The ``world`` steps of ``rank`` for local shards of ``seqlen`` tokens,
    in ring order (step 0: its own shard). ``window``: (left, right) over the
    whole sequence as ``cuflash.attention`` takes it (-1 unbounded; causal
    makes right 0); contiguous shards only."""
    return _ring_steps(rank, world, seqlen, bool(causal), bool(balanced), check_window(window))


@functools.lru_cache(maxsize=1024)  # a call plans every step; a training loop repeats its calls
def _ring_steps(rank: int, world: int, seqlen: int, causal: bool, balanced: bool,
                window: tuple[int, int]) -> tuple[RingStep, ...]:
    check_world(rank, world)
    check_shard_length(seqlen, balanced)
    left, right = window
    if balanced and window != (-1, -1):
        raise ValueError("a sliding window needs contiguous shards (balanced=False): a balanced shard's late chunk "
                         "lies far from the ranks holding its neighbours, so every step would be needed")
    if balanced and causal:
        half = seqlen // 2
        steps = []
        for i in range(world):
            source = (rank - i) % world
            # Source chunks s < r < 2w-1-r: all queries see the early chunk s
            # and none of the late chunk 2w-1-s (later than both of ours).
            # Source s > r: chunks s and 2w-1-s both lie between our early
            # chunk r and our late chunk 2w-1-r: only the late queries see
            # them, all of them.
            if source == rank:
                steps.append(RingStep(source, (0, seqlen), (0, seqlen), causal=True))
            elif source < rank:
                steps.append(RingStep(source, (0, seqlen), (0, half)))
            else:
                steps.append(RingStep(source, (half, seqlen), (0, seqlen)))
        return tuple(steps)
    # Contiguous shards (and balanced ones without a mask, where only which
    # keys arrive matters): query i (global position qa + i) sees key j
    # (ka + j) iff lo <= j - i <= hi, a band at the shards' offset.
    right = 0 if causal else right
    steps = []
    for i in range(world):
        source = (rank - i) % world
        offset = (rank - source) * seqlen if not balanced else 0
        lo = offset - left if left >= 0 else -math.inf
        hi = offset + right if right >= 0 else math.inf
        steps.append(_band_step(source, seqlen, lo, hi))
    return tuple(steps)


def _band_step(source: int, seqlen: int, lo, hi) -> RingStep:
    """The step whose query i meets key j iff lo <= j - i <= hi (ints, or
    -inf / inf for an unbounded side): the query rows that see a key, the
    keys they see, and the window that masks the rest with cuflash's
    bottom-right alignment."""
    row_start, row_stop = max(0, -hi), min(seqlen, seqlen - lo)
    if row_start >= row_stop:
        return RingStep(source, (0, 0), (0, 0), attends=False)
    key_start, key_stop = max(0, row_start + lo), min(seqlen, row_stop + hi)
    # cuflash's window (L, R) on these rows and keys lets query i' see key j'
    # iff -L <= j' - i' - corner <= R, with corner = keys - rows (the
    # bottom-right alignment); in shard coordinates corner = key_stop -
    # row_stop, which lies in [lo, hi] by the choice of the rows and keys.
    corner = key_stop - row_stop
    whole = lo <= key_start - (row_stop - 1) and hi >= (key_stop - 1) - row_start
    if whole:
        return RingStep(source, (row_start, row_stop), (key_start, key_stop))
    window = (corner - lo if lo != -math.inf else -1, hi - corner if hi != math.inf else -1)
    if window == (-1, 0):
        return RingStep(source, (row_start, row_stop), (key_start, key_stop), causal=True)
    return RingStep(source, (row_start, row_stop), (key_start, key_stop), window=window)


def ring_length(world: int, seqlen: int, *, causal: bool, balanced: bool,
                window: tuple[int, int] = (-1, -1)) -> int:
    """How many ring steps any rank attends in: K/V travel that many - 1
    hops (a window can make it fewer than ``world``)."""
    return _ring_length(world, seqlen, bool(causal), bool(balanced), check_window(window))


@functools.lru_cache(maxsize=256)
def _ring_length(world: int, seqlen: int, causal: bool, balanced: bool, window: tuple[int, int]) -> int:
    needed = [i for rank in range(world)
              for i, step in enumerate(_ring_steps(rank, world, seqlen, causal, balanced, window)) if step.attends]
    return max(needed) + 1


def ulysses_kv_copies(nheads: int, nheads_k: int, world: int) -> int:
    """Ulysses gives each of ``world`` ranks nheads / world query heads and
    the K/V heads they use: how many copies of each K/V head that takes (1
    where the K/V heads divide over the ranks; world / nheads_k where the
    ranks divide over them, each head then replicated)."""
    if nheads % world:
        raise ValueError(f"Ulysses gives each rank nheads / world heads: q's {nheads} heads do not divide over "
                         f"{world} ranks")
    if nheads_k % world == 0:
        return 1
    if world % nheads_k:
        raise ValueError(f"k and v's {nheads_k} heads must divide over the {world} ranks, or the ranks over "
                         f"them (each K/V head then replicated)")
    return world // nheads_k


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


def sequence_slots(world: int, *, balanced: bool) -> list[int]:
    """``gathered_order``'s inverse: ``sequence_slots(w)[c]`` is the chunk
    slot of the rank-order concatenation that holds sequence chunk ``c``."""
    order = gathered_order(world, balanced=balanced)
    return sorted(range(len(order)), key=order.__getitem__)
