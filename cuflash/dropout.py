"""Dropout of attention probabilities: the random mask the kernels draw,
computed in NumPy (``dropout_mask``), and the numbers behind it.

The kernels (``kernels_cu/dropout.cuh``) keep the probability of query row
i and key j of head h in batch entry b where a 16-bit value drawn by
Philox4x32-10 from (seed, offset, b, h, i, j) is at least
``dropout_threshold(p)``, and scale the kept ones by ``1 / keep``: the mask
is the same whatever the tiles, kernel, GPU or stream, and the backward
regenerates it instead of storing it. ``dropout_mask`` computes the same
mask on the CPU, so small problems can be checked exactly (and a reference
computed with it: ``cuflash.reference.attention_reference(...,
dropout_mask=...)``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["dropout_mask", "dropout_threshold", "dropout_keep_probability", "philox4x32_10"]

#: Values the mask's random draws take: 16 bits each.
DROPOUT_LEVELS = 1 << 16

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def philox4x32_10(counter, key0: int, key1: int) -> np.ndarray:
    """Philox4x32-10 (Salmon et al., SC 2011) of ``counter``, an array
    (..., 4) of 32-bit words, under the key (key0, key1): the (..., 4)
    uint32 words out, as ``kernels_cu/philox.cuh`` computes them."""
    c = [np.asarray(counter, dtype=np.uint64)[..., i] & _LOW32 for i in range(4)]
    k0, k1 = int(key0) & 0xFFFFFFFF, int(key1) & 0xFFFFFFFF
    for _ in range(10):
        product0, product1 = _M0 * c[0], _M1 * c[2]
        hi0, lo0 = product0 >> _SHIFT32, product0 & _LOW32
        hi1, lo1 = product1 >> _SHIFT32, product1 & _LOW32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return np.stack(c, axis=-1).astype(np.uint32)


def dropout_threshold(dropout_p: float) -> int:
    """The 16-bit threshold below which a draw drops its probability:
    ``dropout_p`` rounded to a multiple of 1/65536 (at most 65535/65536)."""
    return min(int(round(float(dropout_p) * DROPOUT_LEVELS)), DROPOUT_LEVELS - 1)


def dropout_keep_probability(dropout_p: float) -> float:
    """The probability a kernel keeps an entry with: ``1 - dropout_p`` after
    ``dropout_threshold``'s rounding; kept entries are divided by it."""
    return (DROPOUT_LEVELS - dropout_threshold(dropout_p)) / DROPOUT_LEVELS


def _stream_key(seed: int, offset: int) -> tuple[int, int]:
    words = philox4x32_10([offset & 0xFFFFFFFF, offset >> 32, 0, 0], seed & 0xFFFFFFFF, seed >> 32)
    return int(words[0]), int(words[1])


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
                 offset: int = 0) -> np.ndarray:
    """The keep mask of a call with these sizes and dropout arguments: a
    NumPy bool array (batch, nheads, seqlen_q, seqlen_k), True where the
    probability is kept. For a variable-length batch, sequence b's mask is
    ``[b, :, :seqlen_q_b, :seqlen_k_b]`` of the mask at the longest lengths
    (rows and keys count from each sequence's start). Meant for small
    problems (tests, teaching): it takes batch * nheads * seqlen_q *
    seqlen_k / 8 Philox evaluations on the CPU."""
    from ._validation import check_counter, check_dropout_p

    dropout_p = check_dropout_p(dropout_p)
    seed, offset = check_counter("seed", seed), check_counter("offset", offset)
    for name, size in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if check_counter(name, size) >= 1 << 31:
            raise ValueError(f"{name} must be below 2**31, got {size}")
    key0, key1 = _stream_key(seed, offset)
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(nheads), np.arange(seqlen_q), np.arange(seqlen_k),
                             indexing="ij", sparse=True)
    group = (j >> 5) * 4 + ((j >> 1) & 3)
    counter = np.stack(np.broadcast_arrays(group, i, h, b), axis=-1)
    words = philox4x32_10(counter, key0, key1)
    word = np.take_along_axis(words, np.broadcast_to((j >> 3) & 3, counter.shape[:-1])[..., None], axis=-1)[..., 0]
    value = (word >> (16 * (j & 1)).astype(np.uint32)) & 0xFFFF
    return value >= dropout_threshold(dropout_p)
