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

Policies with run-time values (a window's sides, a soft cap, ALiBi slopes)
are compiled once per policy; the values travel in the launch's
``VariantParams`` (kernels_cu/params.cuh). A window's sides are bound to its
``MaskPolicy`` (``window``); a transform's values come to its functions as
``ScoreValues``.
"""

from __future__ import annotations

import dataclasses
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
    #: C++ defining ``cxx``'s rule where it is generated (a user mask,
    #: ``cuflash.mods.mask_rule``), compiled after the kernel source
    prelude: str = ""
    #: the kernels skip tiles by a tile map (``cuflash.block_mask``) that
    #: each call passes at the kernel's tiles (``VariantParams::tile_map``)
    tile_map: bool = False

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
class WindowMaskPolicy(MaskPolicy):
    """A sliding window (FlashAttention-2's ``window_size``), bottom-right
    aligned: row ``i`` sees key ``j`` iff ``i + off - left <= j <= i + off +
    right``, ``off = seqlen_k - seqlen_q``; a side of -1 is unbounded.
    ``window`` holds (left, right); C++ ``WindowMask``."""

    window: tuple[int, int] = (-1, -1)

    def with_window(self, left: int, right: int) -> "WindowMaskPolicy":
        return dataclasses.replace(self, window=(int(left), int(right)))

    def offsets(self, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        """(first, last): row ``i`` sees keys ``[i + first, i + last]``; an
        unbounded side reaches past every key (as the launcher sends it)."""
        left, right = self.window
        offset = seqlen_k - seqlen_q
        return (offset - (seqlen_k if left < 0 else left), offset + (seqlen_q if right < 0 else right))

    def rule(self, rows, keys, seqlen_q: int, seqlen_k: int):
        first, last = self.offsets(seqlen_q, seqlen_k)
        return (keys >= rows + first) & (keys <= rows + last)

    def key_blocks(self, m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> range:
        first_offset, last_offset = self.offsets(seqlen_q, seqlen_k)
        first = max(0, m_start + first_offset)
        last = min(min(m_start + block_m, seqlen_q) - 1 + last_offset, seqlen_k - 1)
        return range(0) if last < first else range(first // block_n, last // block_n + 1)

    def query_blocks(self, n_start: int, block_n: int, block_m: int, seqlen_q: int, seqlen_k: int) -> range:
        first_offset, last_offset = self.offsets(seqlen_q, seqlen_k)
        first = max(0, n_start - last_offset)
        last = min(seqlen_q - 1, min(n_start + block_n, seqlen_k) - 1 - first_offset)
        return range(0) if last < first else range(first // block_m, last // block_m + 1)


@dataclass(frozen=True)
class UserMaskPolicy(MaskPolicy):
    """A traced user mask (``cuflash.mods``), C++ ``UserMask<Rule>``: its
    rule reads the batch entry and head, so the launcher's block counts see
    every block (the tile map narrows them on the GPU) and the references
    evaluate the Python function itself (``user_mask_reference``).
    ``rule_cxx``: the generated Rule, which the tile-map builder takes too;
    ``reads_batch`` / ``reads_head``: whether the map needs a section per
    batch entry / head."""

    rule_cxx: str = ""
    reads_batch: bool = True
    reads_head: bool = True

    def rule(self, rows, keys, seqlen_q: int, seqlen_k: int):
        raise NotImplementedError("a user mask is evaluated by the references themselves "
                                  "(cuflash.mods.evaluate_mask_mod), not through its policy")


def register_user_mask(trace) -> UserMaskPolicy:
    """The kernels' mask of a traced user mask function (``cuflash.mods``),
    entered in MASKS under a name that includes its trace's hash."""
    from . import mods

    name = f"mask-{mods.trace_key(trace)}"
    mask = MASKS.get(name)
    if mask is None:
        rule_cxx, code = mods.mask_rule(trace)
        mask = UserMaskPolicy(name, f"cuflash::UserMask<{rule_cxx}>", later_rows_see_more=True, prelude=code,
                              tile_map=True,
                              rule_cxx=rule_cxx, reads_batch=mods.reads_variable(trace.value, "b"),
                              reads_head=mods.reads_variable(trace.value, "h"))
        MASKS[name] = mask
    return mask


@dataclass(frozen=True)
class UserMaskReference(MaskPolicy):
    """A user mask function as the float64 references apply it: ``matrix``
    is its (batch, nheads, seqlen_q, seqlen_k) condition (NumPy, arrays
    indexed as the kernels index them)."""

    fn: Callable = None
    arrays: object = None
    batch: int = 1
    nheads: int = 1

    def matrix(self, seqlen_q: int, seqlen_k: int, xp=np):
        from . import mods

        return xp.asarray(mods.evaluate_mask_mod(self.fn, (self.batch, self.nheads, seqlen_q, seqlen_k),
                                                 self.arrays))


@dataclass(frozen=True)
class ScoreValues:
    """The run-time values of a score transform, in raw-score units (the
    kernels' ``VariantParams``): the soft cap ``softcap / softmax_scale``, the
    ALiBi slopes over ``softmax_scale`` (broadcastable against the scores
    they shift: (b, h, 1, 1) against (b, h, q, k)) and ``seqlen_k -
    seqlen_q``."""

    cap: float = 0.0
    raw_slopes: object = 0.0
    diagonal_offset: int = 0

    def alibi_bias(self, rows, keys):
        return -self.raw_slopes * abs(rows + self.diagonal_offset - keys)


@dataclass(frozen=True)
class ScoreTransform:
    """A function of the raw score ``s = q . k`` (raw-score units: the
    kernels scale it by ``softmax_scale`` afterwards), applied before the mask
    and softmax, and its derivative given the transformed value. Both take
    the call's ``ScoreValues`` last."""

    name: str
    #: the C++ struct in kernels_cu/score_transforms.cuh; ``{precise}`` is
    #: replaced by whether the inputs are float32 (``cxx_for``)
    cxx: str
    transform: Callable  #: (raw, rows, keys, values) -> transformed
    gradient: Callable  #: (transformed, rows, keys, values) -> d transformed / d raw
    is_identity: bool = False
    #: the same function for every query head and position: grouped-query
    #: decoding may fold heads into rows (``cuflash.api.decode_shape``)
    position_free: bool = True
    #: reads the ALiBi slopes (``VariantParams::alibi_slopes``)
    reads_slopes: bool = False
    #: drops probabilities after the softmax (``WithDropout``, kernels_cu/dropout.cuh)
    dropout: bool = False
    #: C++ defining ``cxx`` where it is generated (a user score function's
    #: policy, ``cuflash.mods.score_policy``), compiled after the kernel source
    prelude: str = ""
    #: ``gradient`` takes the raw score, not the transformed one (user functions)
    gradient_from_raw: bool = False

    def cxx_for(self, dtype_name: str) -> str:
        """The C++ type for inputs of ``dtype_name`` (float32 takes the precise tanh)."""
        return self.cxx.format(precise="true" if dtype_name == "float32" else "false")


def dropout_name(name: str) -> str:
    """The name of transform ``name`` followed by dropout."""
    return "dropout" if name == "identity" else f"{name}-dropout"


def with_dropout(inner: ScoreTransform) -> ScoreTransform:
    """``inner`` followed by dropout of the probabilities: the same score
    hooks, and a mask drawn per (batch entry, head, row, key). Every
    registered transform has its twin in SCORE_TRANSFORMS."""
    return dataclasses.replace(inner, name=dropout_name(inner.name), cxx=f"cuflash::WithDropout<{inner.cxx}>",
                               position_free=False, dropout=True)


def register_score_transform(trace, float_positions: bool = True) -> ScoreTransform:
    """The kernels' transform of a traced user score function
    (``cuflash.mods``), entered in SCORE_TRANSFORMS under a name that
    includes its trace's hash (so a plan or kernel key names it). Its NumPy
    hooks are not used: the references evaluate the function itself.
    ``float_positions``: the kernels may hand it the positions as floats
    (sequences of at most ``mods.FLOAT_POSITION_LIMIT``)."""
    from . import mods

    name = f"mod-{mods.trace_key(trace)}{'' if float_positions else '-int'}"
    transform = SCORE_TRANSFORMS.get(name)
    if transform is None:
        cxx, code = mods.score_policy(trace, float_positions)
        transform = ScoreTransform(name, cxx, transform=_evaluated_by_the_reference,
                                   gradient=_evaluated_by_the_reference, position_free=not trace.reads_position,
                                   prelude=code, gradient_from_raw=True)
        SCORE_TRANSFORMS[name] = transform
        SCORE_TRANSFORMS[dropout_name(name)] = with_dropout(transform)
    return transform


def user_score_reference(fn, arrays: dict | None, scale: float, xp=np) -> ScoreTransform:
    """A user score function as the float64 references apply it, in
    raw-score units like every transform: ``fn`` of score = raw * scale
    (NumPy, arrays indexed as the kernels index them), divided by the scale;
    its derivative by central differences (the function's own, not the
    trace's: the references check the trace)."""
    from . import mods

    def value(raw):
        host = raw.get() if hasattr(raw, "get") else raw
        return xp.asarray(mods.evaluate_score_mod(fn, host * scale, arrays) / scale)

    def gradient(raw):
        host = raw.get() if hasattr(raw, "get") else raw
        step = 1e-6 * np.maximum(1.0, np.abs(host * scale))
        plus = mods.evaluate_score_mod(fn, host * scale + step, arrays)
        minus = mods.evaluate_score_mod(fn, host * scale - step, arrays)
        return xp.asarray((plus - minus) / (2 * step))

    return ScoreTransform(f"reference-{getattr(fn, '__name__', 'score_mod')}", "", position_free=False,
                          transform=lambda raw, rows, keys, values: value(raw),
                          gradient=lambda raw, rows, keys, values: gradient(raw), gradient_from_raw=True)


def _evaluated_by_the_reference(*args):
    raise NotImplementedError("a user score function is evaluated by the references themselves "
                              "(cuflash.mods.evaluate_score_mod), not through its transform")


def _softcap(raw, values: ScoreValues):
    # np.tanh dispatches to CuPy for CuPy arrays (__array_ufunc__).
    return values.cap * np.tanh(raw / values.cap)


def _softcap_gradient(transformed, values: ScoreValues):
    return 1.0 - (transformed / values.cap) ** 2


#: Masks by name; the public ``causal`` flag picks "causal" or "none", a
#: ``window_size`` "window" (``mask_for``).
MASKS: dict[str, MaskPolicy] = {
    "none": MaskPolicy("none", "cuflash::NoMask", dq_turns="rotated"),
    "causal": CausalMaskPolicy("causal", "cuflash::CausalMask", later_rows_see_more=True,
                               dq_turns="last-key-first"),
    "window": WindowMaskPolicy("window", "cuflash::WindowMask", dq_turns="last-key-first"),
}

#: Score transforms by name; the public ``softcap`` and ``alibi_slopes`` pick
#: one (``score_for``).
SCORE_TRANSFORMS: dict[str, ScoreTransform] = {
    "identity": ScoreTransform("identity", "cuflash::IdentityScore", transform=lambda s, rows, keys, values: s,
                               gradient=lambda t, rows, keys, values: 1.0, is_identity=True),
    "softcap": ScoreTransform(
        "softcap", "cuflash::SoftcapScore<{precise}>",
        transform=lambda s, rows, keys, values: _softcap(s, values),
        gradient=lambda t, rows, keys, values: _softcap_gradient(t, values)),
    "alibi": ScoreTransform(
        "alibi", "cuflash::WithAlibi<cuflash::IdentityScore>",
        transform=lambda s, rows, keys, values: s + values.alibi_bias(rows, keys),
        gradient=lambda t, rows, keys, values: 1.0, position_free=False, reads_slopes=True),
    "softcap-alibi": ScoreTransform(
        "softcap-alibi", "cuflash::WithAlibi<cuflash::SoftcapScore<{precise}>>",
        transform=lambda s, rows, keys, values: _softcap(s, values) + values.alibi_bias(rows, keys),
        gradient=lambda t, rows, keys, values: _softcap_gradient(t - values.alibi_bias(rows, keys), values),
        position_free=False, reads_slopes=True),
}
SCORE_TRANSFORMS |= {(dropped := with_dropout(transform)).name: dropped for transform in list(SCORE_TRANSFORMS.values())}


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


def built_in_masks() -> list[MaskPolicy]:
    """The masks cuflash defines (MASKS also holds the user masks a process
    registered, each with its generated code: ``register_user_mask``)."""
    return [mask for mask in MASKS.values() if not mask.prelude]


def _named(table: dict, what: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"{what} must be one of {sorted(table)}, got {name!r}") from None


def mask_named(name: str) -> MaskPolicy:
    return _named(MASKS, "mask", name)


def score_transform_named(name: str) -> ScoreTransform:
    return _named(SCORE_TRANSFORMS, "score transform", name)


def mask_for(causal: bool, window: tuple[int, int] | None = None) -> MaskPolicy:
    """The policy of the public ``causal`` flag, or of a window (left, right)
    (sides of -1 unbounded; ``causal`` makes the right side 0)."""
    if window is None:
        return MASKS["causal" if causal else "none"]
    return MASKS["window"].with_window(window[0], 0 if causal else window[1])


def score_for(softcap: bool, alibi: bool, dropout: bool = False) -> ScoreTransform:
    """The transform of a call with a soft cap, ALiBi slopes and / or dropout."""
    name = {(False, False): "identity", (True, False): "softcap", (False, True): "alibi",
            (True, True): "softcap-alibi"}[bool(softcap), bool(alibi)]
    return SCORE_TRANSFORMS[dropout_name(name) if dropout else name]
