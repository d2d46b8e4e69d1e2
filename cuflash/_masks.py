"""Mask and score-transform policies: the Python half of
``kernels_cu/masks.cuh`` and ``kernels_cu/score_transforms.cuh``.

Each entry names its C++ struct (a template argument of every attention
kernel) and states its rule for the code that runs without a GPU: the
launcher's block counts, the float64 and tiled NumPy references and the IO
simulator all ask these objects, so the causal rule lives here once (and
once in ``masks.cuh``). Adding a policy is one struct in the header and one
entry in ``MASKS`` or ``SCORE_TRANSFORMS`` (docs/kernel-policies.md).

Positions are query rows ``i`` in ``[0, seqlen_q)`` and keys ``j`` in
``[0, seqlen_k)``; NumPy/CuPy arrays broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MaskPolicy:
    """A mask: which keys each query row sees. ``rule`` holds for a row and
    key inside their sequences; bounds are checked apart (``visible``)."""

    name: str
    cxx: str  #: the C++ struct in kernels_cu/masks.cuh
    #: whether the last query blocks see the most keys (the kernels' grid
    #: hands them out first)
    later_rows_see_more: bool = False
    #: the deterministic backward's order of dQ additions (C++ ``kDqTurns``,
    #: kernels_cu/masks.cuh): "key-block-order" (any mask), "last-key-first"
    #: (causal, bands), "rotated" (no mask; the launcher decides whether the
    #: walks rotate, ``cuflash.api.rotate_walks``)
    dq_turns: str = "key-block-order"

    def rule(self, rows, keys, seqlen_q: int, seqlen_k: int):
        return np.ones(np.broadcast_shapes(np.shape(rows), np.shape(keys)), dtype=bool)

    def visible(self, rows, keys, seqlen_q: int, seqlen_k: int):
        """Whether row ``rows`` sees key ``keys`` (both inside their sequences)."""
        return (keys < seqlen_k) & (rows < seqlen_q) & self.rule(rows, keys, seqlen_q, seqlen_k)

    def matrix(self, seqlen_q: int, seqlen_k: int, xp=np):
        """The (seqlen_q, seqlen_k) boolean matrix of visible scores (for references only)."""
        rows = xp.arange(seqlen_q)[:, None]
        keys = xp.arange(seqlen_k)[None, :]
        return xp.broadcast_to(xp.asarray(self.rule(rows, keys, seqlen_q, seqlen_k)), (seqlen_q, seqlen_k))

    def key_blocks(self, m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> range:
        """Key blocks some row of the query block ``[m_start, m_start + block_m)`` sees."""
        return range(0, _ceil_div(seqlen_k, block_n))

    def query_blocks(self, n_start: int, block_n: int, block_m: int, seqlen_q: int, seqlen_k: int) -> range:
        """Query blocks with a row that sees some key of the key block ``[n_start, n_start + block_n)``."""
        return range(0, _ceil_div(seqlen_q, block_m))


@dataclass(frozen=True)
class CausalMaskPolicy(MaskPolicy):
    """Bottom-right aligned causal attention (FlashAttention-2's): row ``i``
    sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``."""

    @staticmethod
    def diagonal_offset(seqlen_q: int, seqlen_k: int) -> int:
        return seqlen_k - seqlen_q

    def rule(self, rows, keys, seqlen_q: int, seqlen_k: int):
        return keys <= rows + self.diagonal_offset(seqlen_q, seqlen_k)

    def key_blocks(self, m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> range:
        last_visible_key = min(m_start + block_m, seqlen_q) - 1 + self.diagonal_offset(seqlen_q, seqlen_k)
        if last_visible_key < 0:
            return range(0)
        return range(0, _ceil_div(min(last_visible_key + 1, seqlen_k), block_n))

    def query_blocks(self, n_start: int, block_n: int, block_m: int, seqlen_q: int, seqlen_k: int) -> range:
        first_row = max(0, n_start - self.diagonal_offset(seqlen_q, seqlen_k))
        return range(first_row // block_m, _ceil_div(seqlen_q, block_m))


@dataclass(frozen=True)
class ScoreTransform:
    """A function of the raw score ``s = q . k`` (raw-score units: the
    kernels scale it by ``softmax_scale`` afterwards), applied before the mask
    and softmax, and its derivative given the transformed value."""

    name: str
    cxx: str  #: the C++ struct in kernels_cu/score_transforms.cuh
    transform: Callable  #: (raw, rows, keys) -> transformed
    gradient: Callable  #: (transformed, rows, keys) -> d transformed / d raw
    is_identity: bool = False


#: Masks by name; the public ``causal`` flag picks "causal" or "none".
MASKS: dict[str, MaskPolicy] = {
    "none": MaskPolicy("none", "cuflash::NoMask", dq_turns="rotated"),
    "causal": CausalMaskPolicy("causal", "cuflash::CausalMask", later_rows_see_more=True,
                               dq_turns="last-key-first"),
}

#: Score transforms by name.
SCORE_TRANSFORMS: dict[str, ScoreTransform] = {
    "identity": ScoreTransform("identity", "cuflash::IdentityScore", transform=lambda s, rows, keys: s,
                               gradient=lambda t, rows, keys: 1.0, is_identity=True),
}


#: Batch layouts by name, the kernels' sequence policy beside the mask and
#: score transform (kernels_cu/block_info.cuh): "dense", every batch entry
#: holds seqlen_q queries and seqlen_k keys of its own entry of the tensors;
#: "packed", a variable-length batch whose sequences lie at cu_seqlens offsets
#: in one packed entry; "cache", a contiguous KV cache whose entries hold
#: their own number of keys; "paged", a paged KV cache (keys are rows of
#: the pages a block table lists). Every tiled kernel is built for the first
#: two; the KV-cache layouts are the mma.sync forward's
#: (``KernelFamily.cache_layouts``).
BATCH_LAYOUTS: dict[str, str] = {"dense": "cuflash::DenseBatch", "packed": "cuflash::PackedBatch",
                                 "cache": "cuflash::CacheBatch", "paged": "cuflash::PagedBatch"}
#: The KV-cache layouts among them.
CACHE_LAYOUTS = ("cache", "paged")


def _named(table: dict, what: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {name!r}") from None


def mask_named(name: str) -> MaskPolicy:
    return _named(MASKS, "mask", name)


def score_transform_named(name: str) -> ScoreTransform:
    return _named(SCORE_TRANSFORMS, "score transform", name)


def mask_for(causal: bool) -> MaskPolicy:
    """The policy of the public ``causal`` flag."""
    return MASKS["causal" if causal else "none"]
