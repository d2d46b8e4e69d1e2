"""Validation of the public API's arguments, before anything is allocated or
launched. Works on ``TensorMeta`` (shape, strides, dtype, device) so that
every rule can be tested without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from .dropout import dropout_threshold
from ._masks import (MaskPolicy, ScoreTransform, dropout_name, mask_for, mask_named, register_score_transform,
                     register_user_mask, score_for, score_transform_named)
from ._tiling import ELEMENT_SIZE, MAX_HEAD_DIM

SUPPORTED_DTYPES = tuple(ELEMENT_SIZE)  # float16, bfloat16, float32
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class TensorMeta:
    """What validation needs to know of an array; strides are in elements."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: int


def meta_of(name: str, array) -> TensorMeta:
    """``TensorMeta`` of a CuPy array."""
    itemsize = array.dtype.itemsize
    if any(stride % itemsize for stride in array.strides):
        raise ValueError(f"{name} has strides {array.strides} (bytes) that are not whole elements")
    return TensorMeta(
        name=name,
        shape=tuple(array.shape),
        strides=tuple(stride // itemsize for stride in array.strides),
        dtype=np.dtype(array.dtype).name,
        device=array.device.id,
    )


@dataclass(frozen=True)
class AttentionProblem:
    """Sizes of a validated attention call."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: str
    device: int
    softmax_scale: float
    causal: bool
    #: a mask policy by name (``cuflash._masks.MASKS``) in place of the one
    #: ``causal`` picks; set only by internal callers and tests
    mask_name: str | None = None
    #: a score transform by name (``cuflash._masks.SCORE_TRANSFORMS``); None: the identity
    score_name: str | None = None
    #: float32 arithmetic of a float32 forward: "ieee" (exact float32 on
    #: CUDA cores) or "3xtf32" (tensor cores, see FP32_PRECISIONS)
    fp32_precision: str = "ieee"
    #: a packed (variable-length) batch: (total_q, total_k), the rows of its
    #: q-side and k-side tensors, which the kernels see as one batch entry;
    #: seqlen_q and seqlen_k are then the longest sequences (max_seqlen_q,
    #: max_seqlen_k). None: a dense batch.
    packed_rows: tuple[int, int] | None = None
    #: a KV cache the kernels read in its own layout (``KvCache``): paged,
    #: or contiguous with per-entry key counts; seqlen_k is then the cache's
    #: capacity per entry. None: K and V are dense (batch, seqlen_k) arrays.
    kv_cache: "KvCache | None" = None
    #: a sliding window (left, right) that is neither full nor causal
    #: attention (``check_variants`` puts windows that are into ``causal``);
    #: a side of -1 is unbounded
    window: tuple[int, int] | None = None
    #: the soft cap of the scaled scores; 0: none
    softcap: float = 0.0
    #: ALiBi: the slopes' batch stride in elements (0: one slope per head);
    #: None: no ALiBi
    alibi_batch_stride: int | None = None
    #: dropout's probability of dropping an entry of P, as given (the
    #: kernels apply it rounded: ``cuflash.dropout.dropout_threshold``); 0: none
    dropout_p: float = 0.0
    #: a user mask's tile map: its sections (batch entries, heads; 1 along
    #: a dimension the mask does not read), ``cuflash.block_mask``; None:
    #: no user mask
    tile_map_dims: tuple[int, int] | None = None

    @property
    def mask(self) -> MaskPolicy:
        """The mask policy the kernels are instantiated with."""
        return mask_for(self.causal, self.window) if self.mask_name is None else mask_named(self.mask_name)

    @property
    def score(self) -> ScoreTransform:
        """The score transform the kernels are instantiated with."""
        if self.score_name is not None:
            named = score_transform_named(self.score_name)
            return score_transform_named(dropout_name(named.name)) if self.dropout_threshold and not named.dropout \
                else named
        return score_for(self.softcap > 0, self.alibi_batch_stride is not None, self.dropout_threshold > 0)

    @property
    def dropout_threshold(self) -> int:
        """The kernels' 16-bit dropout threshold (0: no dropout)."""
        return dropout_threshold(self.dropout_p) if self.dropout_p else 0

    @property
    def packed(self) -> bool:
        return self.packed_rows is not None

    @property
    def layout(self) -> str:
        """The kernels' batch layout (``cuflash._masks.BATCH_LAYOUTS``)."""
        if self.kv_cache is not None:
            return "paged" if self.kv_cache.paged else "cache"
        return "packed" if self.packed else "dense"

    @property
    def tensor_batch(self) -> int:
        """Batch entries of the tensors: 1 for a packed batch."""
        return 1 if self.packed else self.batch

    @property
    def tensor_seqlen_q(self) -> int:
        """Query rows per batch entry of the q-side tensors (and of the log-sum-exp per head)."""
        return self.packed_rows[0] if self.packed else self.seqlen_q

    @property
    def total_q(self) -> int:
        return self.tensor_batch * self.tensor_seqlen_q

    @property
    def total_k(self) -> int:
        """Rows of the k-side tensors (a paged cache's: its pages' rows)."""
        if self.kv_cache is not None and self.kv_cache.paged:
            return self.kv_cache.num_pages * self.kv_cache.page_size
        return self.packed_rows[1] if self.packed else self.batch * self.seqlen_k

    @property
    def is_empty(self) -> bool:
        """No output element exists: nothing to launch."""
        return self.batch == 0 or self.seqlen_q == 0 or self.nheads == 0


def check_same_device(metas: list[TensorMeta]) -> None:
    first = metas[0]
    for meta in metas[1:]:
        if meta.device != first.device:
            raise ValueError(f"{meta.name} is on GPU {meta.device} but {first.name} is on GPU {first.device}")


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_causal(causal) -> bool:
    return _check_bool("causal", causal)


def check_deterministic(deterministic) -> bool:
    return _check_bool("deterministic", deterministic)


def check_heads_first(heads_first) -> bool:
    return _check_bool("heads_first", heads_first)


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale applied to q.k before the softmax: 1/sqrt(head_dim) by default."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    return scale


#: What each dimension of an attention input is: q, k and v (and dout, out) alike.
ATTENTION_LAYOUT = "(batch, seqlen, nheads, head_dim)"


def check_rank(name: str, shape: tuple[int, ...]) -> None:
    """An attention input has 4 dimensions, ``ATTENTION_LAYOUT``."""
    if len(shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions {ATTENTION_LAYOUT}, got shape {shape}")


#: The most key ranges a split-KV forward takes (``num_splits``).
MAX_NUM_SPLITS = 256


def check_num_splits(num_splits) -> int | None:
    """``num_splits`` of a forward call: None or an int from 1 to ``MAX_NUM_SPLITS``."""
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be None or an int, got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be from 1 to {MAX_NUM_SPLITS}, got {num_splits}")
    return int(num_splits)


def check_sizes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], *,
                max_head_dim: int | None = MAX_HEAD_DIM) -> None:
    """The size rules of an attention call on the 4-dimensional shapes of q
    (batch, seqlen_q, nheads, head_dim), k and v (batch, seqlen_k, nheads_k,
    head_dim): one batch size and head_dim, at least 1 (and at most
    ``max_head_dim`` where given), v shaped like k, and nheads a multiple of
    nheads_k (grouped-query attention)."""
    batch, _, nheads, head_dim = q
    nheads_k = k[2]
    if head_dim == 0 or max_head_dim is not None and head_dim > max_head_dim:
        expected = "at least 1" if max_head_dim is None else f"between 1 and {max_head_dim}"
        raise ValueError(f"q's head_dim (last dimension) must be {expected}, got {head_dim}")
    for name, shape in (("k", k), ("v", v)):
        if shape[0] != batch:
            raise ValueError(f"{name} must have batch size {batch} like q, got shape {shape}")
        if shape[3] != head_dim:
            raise ValueError(f"{name} must have head_dim {head_dim} like q, got shape {shape}")
    if v != k:
        raise ValueError(f"v must have the shape of k {k} (batch, seqlen_k, nheads_k, head_dim), got {v}")
    if nheads_k == 0 and nheads > 0 or nheads_k > 0 and nheads % nheads_k != 0:
        raise ValueError(
            f"q's nheads ({nheads}) must be a multiple of k's nheads_k ({nheads_k}) for grouped-query attention"
        )


def _check_layout(meta: TensorMeta) -> None:
    check_rank(meta.name, meta.shape)
    if meta.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{meta.name} must have dtype float16, bfloat16 or float32, got {meta.dtype}"
        )
    # An empty array has no memory to lay out (CuPy gives it zero strides).
    if meta.shape[-1] > 1 and meta.strides[-1] != 1 and 0 not in meta.shape:
        raise ValueError(
            f"{meta.name} must be contiguous in its last dimension (stride 1), "
            f"got strides {meta.strides} (in elements)"
        )


def _check_writable(meta: TensorMeta) -> None:
    """An output must not be a broadcast view: two elements sharing memory
    would be written by two threads."""
    for size, stride in zip(meta.shape, meta.strides):
        if size > 1 and stride == 0:
            raise ValueError(f"{meta.name} must not be a broadcast view (stride 0), got strides {meta.strides}")


#: The ``fp32_precision`` choices of a float32 forward: "ieee", float32
#: products on CUDA cores (the default); "3xtf32", each float32 operand split
#: into two tf32 parts and three tensor-core products summed in float32
#: (kernels_cu/mma_operands.cuh): float32-level accuracy, several times faster.
FP32_PRECISIONS = ("ieee", "3xtf32")


def check_fp32_precision(fp32_precision) -> str:
    if not isinstance(fp32_precision, str):
        raise TypeError(f"fp32_precision must be a str, one of {FP32_PRECISIONS}, got "
                        f"{type(fp32_precision).__name__}")
    if fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}, got {fp32_precision!r}")
    return fp32_precision


def check_forward(q: TensorMeta, k: TensorMeta, v: TensorMeta, out: TensorMeta | None,
                  *, causal, softmax_scale, lse: TensorMeta | None = None,
                  fp32_precision="ieee") -> AttentionProblem:
    """Checks a forward call; returns its sizes. Raises ``TypeError`` or
    ``ValueError`` naming the argument, what was expected and what came."""
    for meta in (q, k, v):
        _check_layout(meta)
    for meta in (k, v):
        if meta.dtype != q.dtype:
            raise TypeError(f"{meta.name} must have the same dtype as q ({q.dtype}), got {meta.dtype}")
    check_same_device([q, k, v])

    check_sizes(q.shape, k.shape, v.shape)
    batch, seqlen_q, nheads, head_dim = q.shape
    _, seqlen_k, nheads_k, _ = k.shape
    for name, length in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if length > _INT32_MAX:
            raise ValueError(f"{name} must be below 2**31, got {length}")
    if batch * nheads > _INT32_MAX:
        raise ValueError(f"batch * nheads must be below 2**31, got {batch * nheads}")

    _check_forward_outputs(q, out, lse)

    return AttentionProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=nheads_k,
        head_dim=head_dim, dtype=q.dtype, device=q.device,
        softmax_scale=resolve_softmax_scale(softmax_scale, head_dim) if head_dim else 0.0,
        causal=check_causal(causal), fp32_precision=check_fp32_precision(fp32_precision),
    )


def check_window(window_size) -> tuple[int, int]:
    """``window_size``: a pair (left, right) of ints from -1 (-1: unbounded)."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 for an unbounded side, got "
                        f"{window_size!r}")
    for side, value in zip(("left", "right"), window_size):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"window_size's {side} side must be an int, got {type(value).__name__} {value!r}")
        if not -1 <= value <= _INT32_MAX:
            raise ValueError(f"window_size's {side} side must be -1 (unbounded) or from 0 to 2**31 - 1, got "
                             f"{value}")
    return int(window_size[0]), int(window_size[1])


def check_softcap(softcap) -> float:
    """``softcap``: a finite real number >= 0 (0: no soft cap)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0 for none), got {type(softcap).__name__} {softcap!r}")
    value = float(softcap)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0 for none), got {value}")
    return value


def check_dropout_p(dropout_p) -> float:
    """``dropout_p``: a real number in [0, 1) (0: no dropout)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1) (0 for none), got {type(dropout_p).__name__} "
                        f"{dropout_p!r}")
    value = float(dropout_p)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (0 for none), got {value}")
    return value


def check_dropout_seed(dropout_p: float, seed, offset) -> tuple[int, int]:
    """A call's dropout ``dropout_seed`` and ``dropout_offset``: ints in
    [0, 2**64); the seed is required where ``dropout_p`` > 0 (the backward
    regenerates the mask from it), and both are 0 where there is no dropout."""
    if dropout_p == 0.0:
        return 0, 0
    if seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed, an int in [0, 2**64): attention_backward regenerates "
                         "the same mask from it (and dropout_offset)")
    return check_counter("dropout_seed", seed), check_counter("dropout_offset", offset)


def check_counter(name: str, value) -> int:
    """An int in [0, 2**64) (a Philox seed or offset, a size)."""
    if value.__class__ is bool or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int in [0, 2**64), got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < 1 << 64:
        raise ValueError(f"{name} must be in [0, 2**64), got {int(value)}")
    return int(value)


def check_variants(problem: AttentionProblem, *, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes: TensorMeta | None = None, dropout_p=0.0) -> AttentionProblem:
    """``problem`` (its lengths final: a packed batch's longest) with the
    variants of the call: a sliding window (FlashAttention-2's semantics:
    ``causal`` makes its right side 0; a window that hides nothing becomes
    full attention, one that is causal becomes ``causal``, whose kernels are
    leaner), a soft cap, ALiBi slopes ((nheads,) or (batch, nheads) float32,
    contiguous, on q's GPU), dropout of the probabilities (``dropout_p``;
    the seed and offset are checked with ``check_dropout_seed``). Raises
    ``TypeError`` or ``ValueError`` naming the argument, what was expected
    and what came."""
    left, right = check_window(window_size)
    softcap = check_softcap(softcap)
    dropout_p = check_dropout_p(dropout_p)
    if problem.causal:
        right = 0
    # A side that reaches every key of every row is unbounded.
    if left >= problem.seqlen_k - 1:
        left = -1
    if right >= problem.seqlen_q - 1:
        right = -1
    causal, window = problem.causal, None
    if (left, right) == (-1, 0):
        causal = True
    elif (left, right) != (-1, -1):
        causal, window = False, (left, right)
        if problem.seqlen_q + problem.seqlen_k > _INT32_MAX:
            raise ValueError(f"a window_size needs seqlen_q + seqlen_k below 2**31, got "
                             f"{problem.seqlen_q + problem.seqlen_k}")
    alibi_batch_stride = None
    if alibi_slopes is not None:
        alibi_batch_stride = _check_alibi_slopes(alibi_slopes, problem)
    if (softcap or alibi_slopes is not None) and problem.softmax_scale == 0:
        raise ValueError("softcap and alibi_slopes need a softmax_scale other than 0 (they act on the scaled "
                         "scores, which a scale of 0 makes all 0)")
    return dataclasses.replace(problem, causal=causal, window=window, softcap=softcap,
                               alibi_batch_stride=alibi_batch_stride, dropout_p=dropout_p)


def check_score_mod(problem: AttentionProblem, score_mod, arrays: dict[str, TensorMeta],
                    has_mask_mod: bool = False) -> AttentionProblem:
    """``problem`` with a user score function (``cuflash.mods``), traced
    against the shapes and dtypes of the ``mod_arrays`` it reads (``arrays``:
    name -> meta, at most ``mods.MAX_ARRAYS``, C-contiguous, on q's GPU).
    Not with ``softcap`` or ``alibi_slopes``: the function says both."""
    from . import mods

    if score_mod is None:
        if arrays and not has_mask_mod:
            raise ValueError(f"mod_arrays {sorted(arrays)} were given without a score_mod or mask_mod that "
                             f"reads them")
        return problem
    if not callable(score_mod) and not isinstance(score_mod, mods.RawScoreMod):
        raise TypeError(f"score_mod must be a function (score, b, h, q_idx, kv_idx, **mod_arrays) or "
                        f"cuflash.mods.cuda(value, gradient), got {type(score_mod).__name__}")
    if problem.softcap or problem.alibi_batch_stride is not None:
        raise ValueError("score_mod does not combine with softcap or alibi_slopes: write them into the score "
                         "function (its score is the scaled one)")
    if problem.softmax_scale == 0:
        raise ValueError("score_mod needs a softmax_scale other than 0 (it maps the scaled scores)")
    signature = _mod_array_signature(problem, arrays)
    if isinstance(score_mod, mods.RawScoreMod):
        trace = score_mod.bound({name: mods.ArraySpec(name, shape, dtype) for name, shape, dtype in signature})
    else:
        trace = _traced_score_mod(score_mod, signature)
    transform = register_score_transform(
        trace, float_positions=max(problem.seqlen_q, problem.seqlen_k) <= mods.FLOAT_POSITION_LIMIT)
    return dataclasses.replace(problem, score_name=transform.name)


def _mod_array_signature(problem: AttentionProblem, arrays: dict[str, TensorMeta]) -> tuple:
    """(name, shape, dtype) of each mod array, checked (at most
    ``mods.MAX_ARRAYS``, a dtype the traces read, C-contiguous, on q's GPU)."""
    from . import mods

    if len(arrays) > mods.MAX_ARRAYS:
        raise ValueError(f"mod_arrays takes at most {mods.MAX_ARRAYS} arrays, got {len(arrays)}")
    for name, meta in arrays.items():
        if meta.dtype not in mods.ARRAY_TYPES:
            raise TypeError(f"mod_arrays[{name!r}] must have one of the dtypes {sorted(mods.ARRAY_TYPES)}, "
                            f"got {meta.dtype}")
        if meta.strides != contiguous_strides(meta.shape):
            raise ValueError(f"mod_arrays[{name!r}] must be C-contiguous, got strides {meta.strides} (in elements)")
        if meta.device != problem.device:
            raise ValueError(f"mod_arrays[{name!r}] is on GPU {meta.device} but q is on GPU {problem.device}")
    return tuple((name, meta.shape, meta.dtype) for name, meta in arrays.items())


def check_mask_mod(problem: AttentionProblem, mask_mod, arrays: dict[str, TensorMeta]) -> AttentionProblem:
    """``problem`` with a user mask (``cuflash.mods``; a function or a
    ``cuflash.BlockMask``), traced against the call's mod arrays (``arrays``
    as for ``check_score_mod``): its kernels' mask policy and its tile map's
    sections. Dense batches only, not with causal or a window."""
    from .block_mask import BlockMask

    if mask_mod is None:
        return problem
    function = mask_mod.mask_mod if isinstance(mask_mod, BlockMask) else mask_mod
    if not callable(function):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx, **mod_arrays) or a "
                        f"cuflash.BlockMask, got {type(mask_mod).__name__}")
    if problem.causal or problem.window is not None:
        raise ValueError("mask_mod does not combine with causal or window_size: write them into the mask "
                         "function (e.g. q_idx >= kv_idx)")
    if problem.packed or problem.kv_cache is not None:
        raise ValueError("mask_mod takes dense batches (attention, attention_backward), not variable-length "
                         "batches or KV caches: document masks from per-token ids do what packing does")
    if isinstance(mask_mod, BlockMask):
        mask_mod.check_call(problem.batch, problem.nheads, problem.seqlen_q, problem.seqlen_k)
    mask = register_user_mask(_traced_mask_mod(function, _mod_array_signature(problem, arrays)))
    dims = (problem.batch if mask.reads_batch else 1, problem.nheads if mask.reads_head else 1)
    return dataclasses.replace(problem, mask_name=mask.name, tile_map_dims=dims)


@functools.lru_cache(maxsize=256)
def _traced_mask_mod(mask_mod, arrays: tuple):
    """A mask function's trace against arrays of these (name, shape, dtype), once per signature."""
    from . import mods

    return mods.trace_mask_mod(mask_mod, {name: mods.ArraySpec(name, shape, dtype) for name, shape, dtype in arrays})


@functools.lru_cache(maxsize=256)
def _traced_score_mod(score_mod, arrays: tuple):
    """A score function's trace against arrays of these (name, shape, dtype), once per signature."""
    from . import mods

    return mods.trace_score_mod(score_mod, {name: mods.ArraySpec(name, shape, dtype)
                                            for name, shape, dtype in arrays})


def _check_alibi_slopes(slopes: TensorMeta, problem: AttentionProblem) -> int:
    """ALiBi slopes: (nheads,) or (batch, nheads) float32, contiguous, on q's
    GPU; returns their batch stride (0 for one slope per head)."""
    if slopes.dtype != "float32":
        raise TypeError(f"alibi_slopes must have dtype float32, got {slopes.dtype}")
    per_head, per_entry = (problem.nheads,), (problem.batch, problem.nheads)
    if slopes.shape not in (per_head, per_entry):
        raise ValueError(f"alibi_slopes must have shape (nheads,) = {per_head} or (batch, nheads) = {per_entry}, "
                         f"got {slopes.shape}")
    if 0 not in slopes.shape and slopes.strides != contiguous_strides(slopes.shape):
        raise ValueError(f"alibi_slopes must be C-contiguous, got strides {slopes.strides} (in elements)")
    if slopes.device != problem.device:
        raise ValueError(f"alibi_slopes is on GPU {slopes.device} but q is on GPU {problem.device}")
    return problem.nheads if len(slopes.shape) == 2 else 0


def _check_forward_outputs(q: TensorMeta, out: TensorMeta | None, lse: TensorMeta | None) -> None:
    """A forward's optional outputs: out shaped and typed like q, writable;
    lse (batch, nheads, seqlen_q) float32, C-contiguous; both on q's GPU."""
    batch, seqlen_q, nheads, _ = q.shape
    if out is not None:
        _check_like(out, q, "")
        _check_writable(out)
        check_same_device([q, out])
    if lse is not None:
        _check_lse(lse, (batch, nheads, seqlen_q))
        if 0 not in lse.shape and lse.strides != contiguous_strides(lse.shape):
            raise ValueError(f"lse must be C-contiguous, got strides {lse.strides} (in elements)")
        check_same_device([q, lse])


@dataclass(frozen=True)
class MergeProblem:
    """Sizes of a validated ``merge_attention_states`` call."""

    num_states: int
    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    dtype: str
    device: int


def check_merge(outs: TensorMeta, lses: TensorMeta, out: TensorMeta | None,
                lse: TensorMeta | None) -> MergeProblem:
    """Checks a ``merge_attention_states`` call: outs (num_states, batch,
    seqlen, nheads, head_dim) of a supported dtype, contiguous in head_dim;
    lses (num_states, batch, nheads, seqlen) float32; out and lse, if given,
    shaped and typed as the results."""
    if len(outs.shape) != 5:
        raise ValueError(f"outs must have 5 dimensions (num_states, batch, seqlen, nheads, head_dim), "
                         f"got shape {outs.shape}")
    if outs.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"outs must have dtype float16, bfloat16 or float32, got {outs.dtype}")
    num_states, batch, seqlen, nheads, head_dim = outs.shape
    if num_states < 1:
        raise ValueError(f"outs must hold at least one state (num_states >= 1), got shape {outs.shape}")
    if head_dim > 1 and outs.strides[-1] != 1:
        raise ValueError(f"outs must be contiguous in head_dim (stride 1), got strides {outs.strides}")
    expected = (num_states, batch, nheads, seqlen)
    if lses.dtype != "float32":
        raise TypeError(f"lses must have dtype float32, got {lses.dtype}")
    if lses.shape != expected:
        raise ValueError(f"lses must have shape (num_states, batch, nheads, seqlen) = {expected}, got {lses.shape}")
    check_same_device([outs, lses])
    if out is not None:
        if out.dtype != outs.dtype:
            raise TypeError(f"out must have the dtype of outs ({outs.dtype}), got {out.dtype}")
        if out.shape != outs.shape[1:]:
            raise ValueError(f"out must have shape (batch, seqlen, nheads, head_dim) = {outs.shape[1:]}, "
                             f"got {out.shape}")
        if head_dim > 1 and out.strides[-1] != 1:
            raise ValueError(f"out must be contiguous in head_dim (stride 1), got strides {out.strides}")
        _check_writable(out)
        check_same_device([outs, out])
    if lse is not None:
        if lse.dtype != "float32":
            raise TypeError(f"lse must have dtype float32, got {lse.dtype}")
        if lse.shape != (batch, nheads, seqlen):
            raise ValueError(f"lse must have shape (batch, nheads, seqlen) = {(batch, nheads, seqlen)}, "
                             f"got {lse.shape}")
        check_same_device([outs, lse])
    if batch * nheads * seqlen > _INT32_MAX:
        raise ValueError(f"batch * nheads * seqlen must be below 2**31, got {batch * nheads * seqlen}")
    return MergeProblem(num_states, batch, seqlen, nheads, head_dim, outs.dtype, outs.device)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _check_lse(lse: TensorMeta, shape: tuple[int, int, int]) -> None:
    if lse.dtype != "float32":
        raise TypeError(f"lse must have dtype float32 (as the forward returns it), got {lse.dtype}")
    if lse.shape != shape:
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {shape}, got {lse.shape}")
    if lse.shape[-1] > 1 and lse.strides[-1] != 1 and 0 not in lse.shape:
        raise ValueError(f"lse must be contiguous in its last dimension (stride 1), got strides {lse.strides}")


def _check_like(meta: TensorMeta | None, like: TensorMeta, what: str) -> None:
    """``meta`` must have the shape and dtype of ``like`` and a contiguous last dimension."""
    if meta is None:
        return
    if meta.dtype != like.dtype:
        raise TypeError(f"{meta.name} must have the dtype of {like.name} ({like.dtype}), got {meta.dtype}")
    if meta.shape != like.shape:
        raise ValueError(f"{meta.name} must have the shape of {like.name} {like.shape}{what}, got {meta.shape}")
    if meta.shape[-1] > 1 and meta.strides[-1] != 1 and 0 not in meta.shape:
        raise ValueError(
            f"{meta.name} must be contiguous in its last dimension (stride 1), got strides {meta.strides}"
        )


def check_backward(dout: TensorMeta, q: TensorMeta, k: TensorMeta, v: TensorMeta, out: TensorMeta,
                   lse: TensorMeta, dq: TensorMeta | None, dk: TensorMeta | None, dv: TensorMeta | None,
                   *, causal, softmax_scale, deterministic) -> AttentionProblem:
    """Checks a backward call; returns its sizes. Raises ``TypeError`` or
    ``ValueError`` naming the argument, what was expected and what came."""
    problem = check_forward(q, k, v, None, causal=causal, softmax_scale=softmax_scale)
    check_deterministic(deterministic)
    _check_like(dout, q, " (batch, seqlen_q, nheads, head_dim)")
    _check_like(out, q, " (batch, seqlen_q, nheads, head_dim)")
    _check_lse(lse, (problem.batch, problem.nheads, problem.seqlen_q))
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        _check_like(grad, like, "")
        if grad is not None:
            _check_writable(grad)
    check_same_device([q, dout, out, lse] + [g for g in (dq, dk, dv) if g is not None])
    return problem


#: What each dimension of a packed (variable-length) input is.
PACKED_LAYOUT = "(total_tokens, nheads, head_dim)"


@dataclass(frozen=True)
class Packing:
    """The sequence bounds of a variable-length call: cu_seqlens_q and
    cu_seqlens_k (GPU arrays, ``TensorMeta``), the longest lengths."""

    cu_seqlens_q: TensorMeta
    cu_seqlens_k: TensorMeta
    max_seqlen_q: int
    max_seqlen_k: int


def check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not 0 <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be from 0 to 2**31 - 1, got {value}")
    return int(value)


def check_packing(packing: Packing, q: TensorMeta, k: TensorMeta, v: TensorMeta) -> int:
    """The rules of a variable-length call's layout: q (total_q, nheads,
    head_dim), k and v (total_k, nheads_k, head_dim), cu_seqlens_q and
    cu_seqlens_k contiguous int32 of one length batch + 1 on q's GPU, and
    the longest lengths; returns the batch size. The offsets' values live
    on the GPU and are not read here: the kernels clamp them to the
    tensors (kernels_cu/block_info.cuh)."""
    for meta in (q, k, v):
        if len(meta.shape) != 3:
            raise ValueError(f"{meta.name} must have 3 dimensions {PACKED_LAYOUT} in a variable-length call, "
                             f"got shape {meta.shape}")
    cu_q, cu_k = packing.cu_seqlens_q, packing.cu_seqlens_k
    for meta in (cu_q, cu_k):
        if meta.dtype != "int32":
            raise TypeError(f"{meta.name} must have dtype int32, got {meta.dtype}")
        if len(meta.shape) != 1 or meta.shape[0] < 1:
            raise ValueError(f"{meta.name} must be 1-D (batch + 1,), got shape {meta.shape}")
        if meta.shape[0] > 1 and meta.strides[0] != 1:
            raise ValueError(f"{meta.name} must be contiguous, got stride {meta.strides[0]} (in elements)")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got {cu_q.shape[0]} "
                         f"and {cu_k.shape[0]}")
    check_same_device([q, cu_q, cu_k])
    for name, meta in (("max_seqlen_q", q), ("max_seqlen_k", k)):
        if meta.shape[0] > _INT32_MAX:
            raise ValueError(f"{meta.name} must have fewer than 2**31 tokens, got {meta.shape[0]}")
    check_max_seqlen("max_seqlen_q", packing.max_seqlen_q)
    check_max_seqlen("max_seqlen_k", packing.max_seqlen_k)
    return cu_q.shape[0] - 1


def as_batch_of_one(meta: TensorMeta) -> TensorMeta:
    """A packed (total, nheads, head_dim) array as the one-entry
    (1, total, nheads, head_dim) array the kernels see (a C-contiguous one
    stays C-contiguous)."""
    return TensorMeta(meta.name, (1, *meta.shape), (max(meta.shape[0], 1) * meta.strides[0], *meta.strides),
                      meta.dtype, meta.device)


def packed_problem(problem: AttentionProblem, batch: int, packing: Packing) -> AttentionProblem:
    """A problem checked on the batch-of-one view of packed arrays, as the
    packed batch of ``batch`` sequences it is."""
    if batch * problem.nheads > _INT32_MAX:
        raise ValueError(f"batch * nheads must be below 2**31, got {batch * problem.nheads}")
    return dataclasses.replace(problem, batch=batch, seqlen_q=packing.max_seqlen_q, seqlen_k=packing.max_seqlen_k,
                               packed_rows=(problem.seqlen_q, problem.seqlen_k))


def check_packed_lse(lse: TensorMeta, nheads: int, total_q: int) -> TensorMeta:
    """The log-sum-exp of a variable-length call, (nheads, total_q) float32
    (FlashAttention-2's varlen layout), contiguous in its last dimension;
    returned as the (1, nheads, total_q) meta the dense checks take."""
    if len(lse.shape) != 2 or lse.shape != (nheads, total_q):
        raise ValueError(f"lse must have shape (nheads, total_q) = {(nheads, total_q)} in a variable-length call, "
                         f"got {lse.shape}")
    return as_batch_of_one(lse)


def check_packed_like(meta: TensorMeta | None, like: TensorMeta) -> None:
    """A packed array that must have the shape and dtype of another (out,
    dout and dq of q; dk, dv of k and v), checked before the batch-of-one
    view so that the message shows the caller's shapes."""
    if meta is None:
        return
    if meta.dtype != like.dtype:
        raise TypeError(f"{meta.name} must have the dtype of {like.name} ({like.dtype}), got {meta.dtype}")
    if meta.shape != like.shape:
        raise ValueError(f"{meta.name} must have the shape of {like.name} {like.shape} {PACKED_LAYOUT}, "
                         f"got {meta.shape}")


#: What each dimension of a paged KV cache is.
PAGED_CACHE_LAYOUT = "(num_pages, page_size, nheads_k, head_dim)"


@dataclass(frozen=True)
class KvCache:
    """How the kernels read a KV cache (``AttentionProblem.kv_cache``):
    paged (``page_size`` rows a page, ``num_pages`` pages, each entry's page
    list a row of a block table ``block_table_stride`` ints apart) or
    contiguous; ``per_entry``: each entry's key count comes from a GPU array
    (``cache_seqlens``, plus the appended keys)."""

    paged: bool
    per_entry: bool
    page_size: int = 0
    num_pages: int = 0
    block_table_stride: int = 0


@dataclass(frozen=True)
class KvCacheCall:
    """A validated ``attention_with_kvcache`` call: the problem the kernels
    solve (seqlen_k: the keys every entry attends to where ``cache_seqlen``
    says so, else the capacity), the cache's ``capacity`` per entry, the
    appended rows per entry (``seqlen_new``, 0 without k_new) and the
    cached length when given as an int (``cache_seqlen``; None for an array
    or, with neither, a full cache)."""

    problem: AttentionProblem
    capacity: int
    seqlen_new: int
    cache_seqlen: int | None


def _check_int32_vector(meta: TensorMeta, length: int, what: str) -> None:
    if meta.dtype != "int32":
        raise TypeError(f"{meta.name} must have dtype int32, got {meta.dtype}")
    if meta.shape != (length,):
        raise ValueError(f"{meta.name} must have shape {(length,)} ({what}), got {meta.shape}")
    if length > 1 and meta.strides[0] != 1:
        raise ValueError(f"{meta.name} must be contiguous, got stride {meta.strides[0]} (in elements)")


def check_kv_cache(q: TensorMeta, k_cache: TensorMeta, v_cache: TensorMeta, k_new: TensorMeta | None,
                   v_new: TensorMeta | None, cache_seqlens, block_table: TensorMeta | None,
                   out: TensorMeta | None, lse: TensorMeta | None, *, causal, softmax_scale) -> KvCacheCall:
    """Checks an ``attention_with_kvcache`` call. ``cache_seqlens``: None, an
    int, or the ``TensorMeta`` of a (batch,) int32 GPU array. Raises
    ``TypeError`` or ``ValueError`` naming the argument, what was expected
    and what came."""
    for meta in (q, k_cache, v_cache):
        _check_layout(meta)
    if q.dtype not in ("float16", "bfloat16"):
        raise TypeError(f"q must have dtype float16 or bfloat16 for a KV cache (the tensor-core kernels read it), "
                        f"got {q.dtype}")
    for meta in (k_cache, v_cache, k_new, v_new):
        if meta is not None and meta.dtype != q.dtype:
            raise TypeError(f"{meta.name} must have the dtype of q ({q.dtype}), got {meta.dtype}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {k_cache.shape}, got {v_cache.shape}")
    batch, seqlen_q, nheads, head_dim = q.shape
    paged = block_table is not None
    if paged:
        if len(block_table.shape) != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_pages) with batch {batch}, "
                             f"got {block_table.shape}")
        if block_table.dtype != "int32":
            raise TypeError(f"block_table must have dtype int32, got {block_table.dtype}")
        if block_table.shape[1] > 1 and block_table.strides[1] != 1:
            raise ValueError(f"block_table must be contiguous in its last dimension, got strides "
                             f"{block_table.strides} (in elements)")
        num_pages, page_size = k_cache.shape[:2]
        if num_pages == 0 or page_size == 0:
            raise ValueError(f"k_cache must hold at least one page of one row {PAGED_CACHE_LAYOUT} with a "
                             f"block_table, got shape {k_cache.shape}")
        capacity = block_table.shape[1] * page_size
        cache = KvCache(paged=True, per_entry=False, page_size=page_size, num_pages=num_pages,
                        block_table_stride=block_table.strides[0] if batch > 1 else 0)
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have batch size {batch} like q (batch, seqlen_cache, nheads_k, head_dim), "
                             f"or be paged {PAGED_CACHE_LAYOUT} with a block_table; got shape {k_cache.shape}")
        capacity = k_cache.shape[1]
        cache = KvCache(paged=False, per_entry=False)
    as_dense = TensorMeta(k_cache.name, (batch, capacity, *k_cache.shape[2:]), k_cache.strides, k_cache.dtype,
                          k_cache.device)
    check_sizes(q.shape, as_dense.shape, as_dense.shape)
    if head_dim % 8:
        raise ValueError(f"q's head_dim must be a multiple of 8 for a KV cache (16-byte rows), got {head_dim}")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together: give both or neither")
    seqlen_new = 0
    if k_new is not None:
        for meta in (k_new, v_new):
            _check_layout(meta)
            expected = (batch, k_new.shape[1], k_cache.shape[2], head_dim)
            if meta.shape != expected:
                raise ValueError(f"{meta.name} must have shape (batch, seqlen_new, nheads_k, head_dim) = {expected}, "
                                 f"got {meta.shape}")
        if cache_seqlens is None:
            raise ValueError("k_new and v_new need cache_seqlens: the keys each entry holds, after which they are "
                             "appended")
        seqlen_new = k_new.shape[1]
    cache_seqlen = None
    if isinstance(cache_seqlens, TensorMeta):
        _check_int32_vector(cache_seqlens, batch, "batch,")
        cache = dataclasses.replace(cache, per_entry=True)
        seqlen_k = capacity
    elif cache_seqlens is None:
        seqlen_k = capacity
    else:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, np.integer)):
            raise TypeError(f"cache_seqlens must be None, an int or a (batch,) int32 GPU array, got "
                            f"{type(cache_seqlens).__name__}")
        cache_seqlen = int(cache_seqlens)
        if not 0 <= cache_seqlen <= capacity - seqlen_new:
            raise ValueError(f"cache_seqlens must be from 0 to the cache's capacity {capacity} less the "
                             f"{seqlen_new} appended keys, got {cache_seqlen}")
        seqlen_k = cache_seqlen + seqlen_new
    if capacity > _INT32_MAX or seqlen_q > _INT32_MAX:
        raise ValueError(f"the cache's capacity and seqlen_q must be below 2**31, got {capacity} and {seqlen_q}")
    if batch * nheads > _INT32_MAX:
        raise ValueError(f"batch * nheads must be below 2**31, got {batch * nheads}")
    _check_forward_outputs(q, out, lse)
    check_same_device([m for m in (q, k_cache, v_cache, k_new, v_new, block_table, out, lse,
                                   cache_seqlens if isinstance(cache_seqlens, TensorMeta) else None)
                       if m is not None])
    problem = AttentionProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_k=k_cache.shape[2],
        head_dim=head_dim, dtype=q.dtype, device=q.device,
        softmax_scale=resolve_softmax_scale(softmax_scale, head_dim), causal=check_causal(causal),
        kv_cache=cache if cache.paged or cache.per_entry else None)
    return KvCacheCall(problem, capacity, seqlen_new, cache_seqlen)
