"""The public attention functions: arrays in, arrays of the same kind out.

Every call runs through a launch plan (``cuflash._launch``). The first call
of a signature (frameworks, dtypes, shapes, strides, devices, pointer
alignment, flags) is validated in full and planned; the plan is kept in a
bounded cache, and a later call of that signature from CuPy or PyTorch only
reads its pointers and the stream, allocates its outputs and launches
(``_cached_call``). Whatever differs between two calls of one signature
(pointers, their 16-byte alignment, the current device, the stream) is read
on every call: alignment is part of the signature, a call on another
current device takes the full path, the stream is queried each time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import _interop, _tiling, mods
from ._cuda import import_cupy
from .dropout import dropout_keep_probability
from ._kernel_families import (CACHE_APPEND_THREADS, FAMILIES, FAMILY, MERGE_WARPS, cache_append_variant, family_of,
                               merge_states_in_flight, merge_variant, merge_vectors, runs_claimed_dq, runs_direct_dq,
                               select)
from ._masks import CACHE_LAYOUTS
from .block_mask import BlockMask, build_tile_map, tile_map_strides
from ._launch import KernelLaunch, LaunchPlan, PlanCache
from ._loader import builds_sm90a, loader
from ._params import (BACKWARD_PARAMS, CACHE_APPEND_PARAMS, FORWARD_PARAMS, MERGE_PARAMS, VARIANT_PARAMS,
                      WGMMA_BACKWARD_PARAMS, WGMMA_FORWARD_PARAMS, pack,
                      tensor_ref)
from ._tensor_maps import TensorMapEncoder, TileBox, head_pair_geometry, takes_layout
from ._tiling import (DECODE_MAX_ROWS, ELEMENT_SIZE, MMA_DTYPES, Tiling,
                      copy_engine_box_rows, decode_cluster_count, decode_cluster_tiling, decode_clusters_apply,
                      decode_split_count, decode_tail_split, decode_tilings, decode_ring,
                      persistent_grid, wgmma_backward_swizzles, wgmma_direct_computes_delta, wgmma_forward_for_call)
from ._validation import (AttentionProblem, MergeProblem, Packing, as_batch_of_one, check_backward, check_forward,
                          check_kv_cache, check_merge, check_num_splits, check_packed_like, check_packed_lse,
                          check_dropout_seed, check_heads_first, check_mask_mod, check_packing, check_score_mod, check_variants, contiguous_strides, meta_of, packed_problem, KvCacheCall)

_LOG2E = math.log2(math.e)
_MAX_GRID_X = 2**31 - 1
#: Blocks of the grid-stride element-wise backward kernels (preprocess, dQ conversion).
_ELEMENTWISE_BLOCKS = 4096

#: The arrays a user score function reads (``mod_arrays``), in the order
#: the call names them: slots of every plan (VariantParams::user_arrays).
MOD_ARRAY_SLOTS = tuple(f"mod_array{i}" for i in range(mods.MAX_ARRAYS))

#: Arrays of a forward call, in the order of the plan's pointer slots: the
#: split-KV work buffers (``forward_work_buffers``) last.
FORWARD_ARRAYS = ("q", "k", "v", "out", "lse", "out_partial", "lse_partial", "cu_seqlens_q", "cu_seqlens_k",
                  "alibi_slopes", "dropout_seed", "dropout_offset", "dropout_rng", *MOD_ARRAY_SLOTS, "tile_map")
#: The sequence offsets of a variable-length call (0, a null pointer, in a
#: dense one), the ALiBi slopes (0 without ALiBi), dropout's seed and offset
#: (ints, not pointers: written each call like them) and the GPU address of
#: a seed to read there instead (cuflash.jax's PRNG keys; 0 elsewhere),
#: the mod arrays and a user mask's tile map (``cuflash.block_mask``; built
#: by the call): slots of every plan, after its arrays.
_PACKING_SLOTS = ("size.cu_seqlens_q", "size.cu_seqlens_k", "variant.alibi_slopes", "variant.dropout_seed",
                  "variant.dropout_offset", "variant.dropout_seed_pointer",
                  *(f"variant.user_array{i}" for i in range(len(MOD_ARRAY_SLOTS))), "variant.tile_map")
#: Pointer slots of a forward plan without split-KV (the work buffers unused)
#: and with it (struct 0 the forward kernel's, writing the partial results;
#: struct 1 the merge kernel's).
FORWARD_SLOTS = ("q.ptr", "k.ptr", "v.ptr", "out.ptr", "lse", (), (), *_PACKING_SLOTS)
SPLIT_FORWARD_SLOTS = ("q.ptr", "k.ptr", "v.ptr", ((1, "out.ptr"),), ((1, "lse"),),
                       ((0, "out.ptr"), (1, "partial.ptr")), ((0, "lse"), (1, "partial_lse")), *_PACKING_SLOTS)
#: Arrays of a KV-cache call (``attention_with_kvcache``), in the order of
#: its plan's pointer slots (``kvcache_slots``): a forward's (k and v the
#: caches), then the key counts the kernels read (seqused_k: a work buffer
#: the append kernel fills, when it runs), the block table, the appended
#: rows and the cached lengths.
KVCACHE_ARRAYS = FORWARD_ARRAYS + ("seqused_k", "block_table", "k_new", "v_new", "cache_seqlens")
#: Arrays of a backward call (the work buffers delta, dq_accum and
#: dq_semaphore last, see ``backward_work_buffers``), in the order of the
#: plan's pointer slots.
BACKWARD_ARRAYS = ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv", "delta", "dq_accum", "dq_semaphore",
                   "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "dropout_seed", "dropout_offset", "dropout_rng",
                   *MOD_ARRAY_SLOTS, "tile_map")
BACKWARD_SLOTS = ("dout.ptr", "q.ptr", "k.ptr", "v.ptr", "out.ptr", "lse", "dq.ptr", "dk.ptr", "dv.ptr", "delta",
                  "dq_accum", "dq_semaphore", *_PACKING_SLOTS)
#: Arrays whose rows the tensor-core kernels copy in 16-byte chunks, as
#: indices into FORWARD_ARRAYS / BACKWARD_ARRAYS / KVCACHE_ARRAYS /
#: MERGE_ARRAYS: the 16-byte alignment of their pointers decides the kernel,
#: so it is part of a call's signature.
_ALIGNED_ARRAYS = {
    "merge": (0,),  # partial: float32 partials are read 16 bytes at a time where aligned
    "forward": tuple(FORWARD_ARRAYS.index(name) for name in ("q", "k", "v", "out")),
    "backward": tuple(BACKWARD_ARRAYS.index(name) for name in ("dout", "q", "k", "v", "dk", "dv")),
    # k and v: k_cache and v_cache
    "kvcache": tuple(KVCACHE_ARRAYS.index(name) for name in ("q", "k", "v", "out", "k_new", "v_new")),
}

#: Plans by call signature, for every framework.
plans = PlanCache()


@dataclass(frozen=True)
class Layout:
    """Shape, byte strides and element size of an array: what a plan needs
    of it (pointers come with each call)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @classmethod
    def of(cls, array) -> "Layout":
        """Layout of a CuPy array."""
        return cls(tuple(array.shape), tuple(array.strides), array.dtype.itemsize)

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], dtype_name: str) -> "Layout":
        """Layout of a C-contiguous array (what the allocators return)."""
        itemsize = ELEMENT_SIZE[dtype_name]
        return cls(tuple(shape), tuple(s * itemsize for s in contiguous_strides(tuple(shape))), itemsize)


#: Byte alignment of each work buffer inside a call's one work allocation
#: (``WorkArena``): the allocators' own, so kernels see the alignment that
#: separate buffers would have had (tensor maps need 16 bytes).
_WORK_ALIGNMENT = 256


@dataclass(frozen=True)
class WorkArena:
    """A call's work buffers (name -> (shape, dtype name), all C-contiguous)
    as one allocation, each at a ``_WORK_ALIGNMENT``-aligned byte offset:
    an allocation costs the host a few microseconds however many bytes it
    holds, and a backward needs up to three buffers."""

    buffers: tuple[tuple[str, tuple[int, ...], str, int], ...]  #: (name, shape, dtype name, byte offset)
    nbytes: int

    @classmethod
    def of(cls, buffers: dict) -> "WorkArena":
        entries, offset = [], 0
        for name, (shape, dtype) in buffers.items():
            entries.append((name, tuple(shape), dtype, offset))
            offset += -(-_byte_size(shape, dtype) // _WORK_ALIGNMENT) * _WORK_ALIGNMENT
        return cls(tuple(entries), offset)

    def allocate(self, bridge, views: dict) -> None:
        """Allocates the arena from the call's framework (``bridge.empty``)
        and adds a CuPy view of each buffer to ``views`` (which keeps the
        memory alive as long as the view lives)."""
        cupy = import_cupy()
        if not self.nbytes:
            views |= {name: cupy.empty(shape, dtype) for name, shape, dtype, _ in self.buffers}
            return
        _, base = bridge.empty((self.nbytes,), "uint8")
        for name, shape, dtype, offset in self.buffers:
            views[name] = base[offset:offset + _byte_size(shape, dtype)].view(dtype).reshape(shape)


def _byte_size(shape: tuple[int, ...], dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class CachedCall:
    """A plan with what a call of its signature needs besides: how to
    allocate the outputs the caller did not give (index into the call's
    arrays, allocator returning ``(array, pointer)``) and the work buffers
    (one allocator of the ``WorkArena`` and each buffer's (index, byte
    offset); None without), which slots to write (``live``: those of the
    arrays the signature does not fix as absent), and how to read the
    current stream of q's framework."""

    plan: LaunchPlan
    allocations: tuple[tuple[int, Callable], ...]
    work: tuple[Callable, tuple[tuple[int, int], ...]] | None
    live: tuple[int, ...]
    stream: Callable[[], int]
    current_device: Callable[[], int]
    #: A forward's backward calls (``backward_following``), by dout's
    #: signature part, its pointer's 16-byte alignment and ``deterministic``.
    followers: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    #: The plan-cache key it is kept under (``forward_plain`` checks that it still is).
    key: object = dataclasses.field(default=None, compare=False, repr=False)

    def run(self, arrays: list, pointers: list) -> None:
        for index, allocate in self.allocations:
            arrays[index], pointers[index] = allocate()
        if self.work is not None:
            allocate, offsets = self.work
            memory, base = allocate()  # noqa: F841 (held until the launches are queued; freed in stream order)
            for index, offset in offsets:
                pointers[index] = base + offset
        self.plan.launch(pointers, self.stream(), self.live)


@dataclass(frozen=True)
class Variants:
    """A call's attention variants as given (``check_variants`` validates
    them): a sliding window, a soft cap, ALiBi slopes (an array; None where
    the slopes travel among a call's arrays), dropout's probability, seed
    and offset."""

    window_size: object = (-1, -1)
    softcap: object = 0.0
    alibi_slopes: object = None
    dropout_p: object = 0.0
    dropout_seed: object = None
    dropout_offset: object = 0
    score_mod: object = None
    mod_arrays: object = None
    mask_mod: object = None

    def values(self) -> tuple:
        """The fields in order, as ``_attention`` and ``_backward`` take them."""
        return (self.window_size, self.softcap, self.alibi_slopes, self.dropout_p, self.dropout_seed,
                self.dropout_offset, self.score_mod, self.mod_arrays, self.mask_mod)

    @property
    def plain(self) -> bool:
        """No ALiBi slopes, dropout or mods (a window and a soft cap at most):
        the variants ``backward_following`` serves."""
        return (self.alibi_slopes is None and self.dropout_p.__class__ is float and self.dropout_p == 0.0
                and self.score_mod is None and self.mod_arrays is None and self.mask_mod is None)

    def applied(self, problem: AttentionProblem, alibi_slopes=None, mod_metas=None) -> AttentionProblem:
        """``problem`` with these variants, the slopes' and the mod arrays'
        ``TensorMeta`` given (the latter by the names the call gave)."""
        problem = check_variants(problem, window_size=self.window_size, softcap=self.softcap,
                                 alibi_slopes=alibi_slopes, dropout_p=self.dropout_p)
        problem = check_score_mod(problem, self.score_mod, mod_metas or {}, has_mask_mod=self.mask_mod is not None)
        return check_mask_mod(problem, self.mask_mod, mod_metas or {})

    def fixed_arrays(self, views: dict) -> tuple[str, ...]:
        """The views a cached plan of this call passes to every call as they
        are: a BlockMask's tile map."""
        return ("tile_map",) if isinstance(self.mask_mod, BlockMask) and "tile_map" in views else ()

    def tile_map_view(self, problem: AttentionProblem, tiling: Tiling, views: dict):
        """The CuPy tile map of the call's user mask at ``tiling``'s tiles
        (built now on the call's stream, or kept by its ``BlockMask``), or
        None without a mask function."""
        if problem.tile_map_dims is None:
            return None
        arrays = [views.get(slot) for slot in MOD_ARRAY_SLOTS]
        if isinstance(self.mask_mod, BlockMask):
            return self.mask_mod.tile_map(problem.mask, problem.tile_map_dims, tiling.block_m, tiling.block_n, arrays,
                                          problem.device)
        # A plain function (traced and checked by check_mask_mod): its map, for this call only.
        return build_tile_map(problem.mask, problem.tile_map_dims, problem.seqlen_q, problem.seqlen_k, tiling.block_m,
                              tiling.block_n, arrays, problem.device)

    def mod_inputs(self) -> dict:
        """The mod arrays under their slot names (``MOD_ARRAY_SLOTS``)."""
        return dict(zip(MOD_ARRAY_SLOTS, _mod_array_values(self.mod_arrays)))

    def mod_metas(self, metas: dict) -> dict:
        """The mod arrays' metas popped from ``metas``, by the names the call gave."""
        names = list(self.mod_arrays or {})
        return {names[i]: metas.pop(slot) for i, slot in enumerate(MOD_ARRAY_SLOTS) if slot in metas}

    def scalars(self, problem: AttentionProblem) -> dict:
        """The call's values written into plan slots beside its pointers:
        dropout's seed and offset (checked; 0 without dropout)."""
        seed, offset = check_dropout_seed(problem.dropout_p, self.dropout_seed, self.dropout_offset)
        return {"dropout_seed": seed, "dropout_offset": offset}


#: The variants' values of a call without any (``Variants()``).
_PLAIN_VARIANT_VALUES = Variants().values()


def _mod_array_values(mod_arrays) -> list:
    """A call's ``mod_arrays`` as its arrays, in order (checked: a dict of at
    most ``mods.MAX_ARRAYS``)."""
    if mod_arrays is None:
        return []
    if not isinstance(mod_arrays, dict):
        raise TypeError(f"mod_arrays must be a dict of name -> array, got {type(mod_arrays).__name__}")
    if len(mod_arrays) > mods.MAX_ARRAYS:
        raise ValueError(f"mod_arrays takes at most {mods.MAX_ARRAYS} arrays, got {len(mod_arrays)}")
    return list(mod_arrays.values())


#: The mod arrays' entries of a call without them (the per-call path's common case).
_NO_MOD_ARRAYS = (None,) * len(MOD_ARRAY_SLOTS)


def _mod_list(mod_arrays) -> tuple | list:
    """The mod arrays' entries of a call's array list (None padded), or an
    entry no fast lane reads where they cannot be read (the full path then
    explains)."""
    if mod_arrays is None:
        return _NO_MOD_ARRAYS
    try:
        values = _mod_array_values(mod_arrays)
    except (TypeError, ValueError):
        values = [object()]  # no fast-lane class: the full path runs and raises
    return (values + [None] * len(MOD_ARRAY_SLOTS))[:len(MOD_ARRAY_SLOTS)]


def _mod_flags(score_mod, mod_arrays) -> tuple:
    return score_mod, tuple(mod_arrays) if isinstance(mod_arrays, dict) else mod_arrays.__class__


def _mask_mod_arrays(mask_mod, mod_arrays):
    """The call's mod arrays with a ``BlockMask``: its own where the call
    gives none; else the call's, which must hold the mask's under the same
    names (the very arrays its maps were built from)."""
    if not isinstance(mask_mod, BlockMask) or not mask_mod.mod_arrays:
        return mod_arrays
    if mod_arrays is None:
        return mask_mod.mod_arrays
    if not isinstance(mod_arrays, dict):
        return mod_arrays  # the checks explain
    for name, array in mask_mod.mod_arrays.items():
        if mod_arrays.get(name) is not array:
            raise ValueError(f"mod_arrays must hold the BlockMask's array {name!r} (the same array its tile maps "
                             f"were built from), or be left out")
    return mod_arrays


def _unplanned(*args):
    """The signature of a call whose plan is not cached: a plain mask
    function's tile map is built by each call, which the fast path cannot do
    (a ``BlockMask``'s calls are cached: its maps are fixed)."""
    return None, None


def _planned(mask_mod) -> bool:
    """Whether a call with this mask_mod may take the fast path: none, or a
    ``BlockMask`` (which is then part of the plan's key, its map one of the
    plan's fixed arrays)."""
    return mask_mod is None or isinstance(mask_mod, BlockMask)


def _variant_flags(window_size, softcap, dropout_p=0.0) -> tuple:
    """The variants' part of a call's plan-cache flags (the slopes are an
    array of the call; dropout's seed and offset values of it)."""
    return window_size.__class__, window_size, softcap.__class__, softcap, dropout_p.__class__, dropout_p


def _variant_fields(problem: AttentionProblem, tiling: Tiling | None = None) -> tuple:
    """VariantParams (kernels_cu/params.cuh) of a validated problem, the
    slopes' pointer 0 (a plan slot writes each call's): a window's sides as
    the kernels take them (an unbounded side reaches past every key), the
    soft cap and ALiBi's scale in raw-score units, and a user mask's tile
    map's strides and tiles (``tiling``'s, the kernel's)."""
    left, right = problem.window or (0, 0)
    if problem.window is not None:
        left = problem.seqlen_k if left < 0 else left
        right = problem.seqlen_q if right < 0 else right
    scale = problem.softmax_scale
    threshold = problem.dropout_threshold
    # Real values are computed in double and rounded once to the structs' float32.
    cap = problem.softcap / scale if problem.softcap else 0.0
    fields = dict(window_left=left, window_right=right, softcap=cap, inverse_softcap=1.0 / cap if cap else 0.0,
                  alibi_batch_stride=problem.alibi_batch_stride or 0, inverse_scale=1.0 / scale if scale else 0.0,
                  scale=scale,
                  dropout_threshold=threshold,
                  dropout_inverse_keep=1.0 / dropout_keep_probability(problem.dropout_p) if threshold else 0.0)
    if problem.tile_map_dims is not None:
        batch_stride, head_stride, _ = tile_map_strides(problem.tile_map_dims, problem.seqlen_q, problem.seqlen_k,
                                                        tiling.block_m, tiling.block_n)
        fields |= dict(tile_map_batch_stride=batch_stride, tile_map_head_stride=head_stride,
                       tile_map_block_m=tiling.block_m, tile_map_block_n=tiling.block_n)
    # Pointers and dropout's seed and offset: 0 here, plan slots write each call's.
    return tuple(fields.get(name, 0) for name in VARIANT_PARAMS.names)


def pointers_aligned(kind: str, pointers: list) -> bool:
    """Whether the pointers the ``kind`` ("forward", "backward") kernels copy
    in 16-byte chunks are 16-byte aligned (``pointers`` in the order of
    FORWARD_ARRAYS / BACKWARD_ARRAYS; 0 for an array still to be allocated,
    which the allocators align)."""
    misaligned = 0
    for index in _ALIGNED_ARRAYS[kind]:
        misaligned |= pointers[index]
    return not misaligned & 15


_BACKWARD_OUT = BACKWARD_ARRAYS.index("out")


def _signature(kind: str, arrays: list, flags: tuple):
    """The plan-cache key of a call and its pointers, or ``(None, None)``
    where an array is not one the cache serves (any type but a CuPy array,
    a PyTorch tensor or None). A backward's key also holds whether out's
    pointer is 16-byte aligned: the direct dQ mode may map it
    (``stores_dq_directly``; not at head dim 192, whose key this splits
    needlessly)."""
    signature, pointers = _interop.call_signature(arrays)
    if signature is None:
        return None, None
    aligned = pointers_aligned(kind, pointers)
    if kind == "backward":
        aligned = aligned, not pointers[_BACKWARD_OUT] & 15
    return (kind, signature, flags, aligned), pointers


def _cached_call(key, arrays: list, pointers: list) -> CachedCall | None:
    """Runs the call from its cached plan and returns that; None where there
    is none, the current device is not the plan's, or a flag cannot be
    hashed (then the full path runs, and explains a bad flag)."""
    try:
        call = plans.get(key)
    except TypeError:  # an unhashable flag
        return None
    if call is None or call.current_device() != call.plan.device:
        return None
    call.run(arrays, pointers)
    return call


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, dropout_seed=None, dropout_offset=0, score_mod=None, mask_mod=None, mod_arrays=None,
              return_lse=False, out=None, lse=None, fp32_precision="ieee", num_splits=None, heads_first=False):
    """Exact softmax attention, ``softmax(scale * q @ k^T) @ v``, computed
    tile by tile (FlashAttention-2): memory O(seqlen), never O(seqlen^2).

    Args:
        q: (batch, seqlen_q, nheads, head_dim) query, float16, bfloat16 or float32,
            on a CUDA GPU: a CuPy array, PyTorch tensor, JAX array or any DLPack
            producer. Any strides on the first three dimensions; the last must be
            contiguous. head_dim from 1 to 256.
        k, v: (batch, seqlen_k, nheads_k, head_dim), same dtype and GPU as q;
            nheads_k divides nheads (multi-query / grouped-query attention:
            query head h uses key/value head h // (nheads // nheads_k)).
        causal: mask aligned to the bottom-right corner: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. A query that sees no key gets output 0
            and log-sum-exp -inf.
        softmax_scale: scale of q.k; default 1 / sqrt(head_dim).
        window_size: (left, right) sliding window, FlashAttention-2's: query i
            sees key j iff i + off - left <= j <= i + off + right, with
            off = seqlen_k - seqlen_q (bottom-right aligned); -1 leaves a side
            unbounded; with ``causal`` the right side is 0. Key blocks outside
            every row's window are skipped: the cost follows the window.
        softcap: > 0 caps the scaled scores s as softcap * tanh(s / softcap)
            (Gemma 2) before the softmax; 0 (default) none.
        alibi_slopes: optional (nheads,) or (batch, nheads) float32 array on
            q's GPU: ALiBi adds -slope * |i + off - j| to the scaled score of
            query i and key j (after any soft cap).
        dropout_p: in [0, 1): each probability (after the softmax's
            normalisation) is dropped with this probability and the kept ones
            scaled by 1 / (1 - dropout_p) (p is rounded to a multiple of
            1/65536; ``cuflash.dropout``). 0 (default): none.
        dropout_seed, dropout_offset: ints in [0, 2**64) that fix the mask,
            a function of (seed, offset, batch entry, head, query, key) alone:
            the same on every GPU, tiling and stream, and regenerated by
            ``attention_backward`` given the same values. The seed is
            required with dropout; ``cuflash.dropout_mask`` materialises the
            mask for small problems.
        score_mod: a user score function ``score_mod(score, b, h, q_idx,
            kv_idx, **mod_arrays)`` of the scaled score (``cuflash.mods``):
            traced once per function and arrays' shapes, compiled into the
            kernels, its derivative derived for the backward. Not with
            softcap or alibi_slopes.
        mask_mod: a user mask ``mask_mod(b, h, q_idx, kv_idx, **mod_arrays)``
            returning a condition (True: query q_idx sees key kv_idx;
            ``cuflash.mods``), or a ``cuflash.BlockMask`` made once from one
            (``cuflash.block_mask``). A tile map built on the GPU from it
            lets the kernels skip the tiles it hides wholly and mask only the
            partial ones; a plain function builds its map in each call, a
            BlockMask once per kernel tiling. Not with causal or
            window_size (write them into the function).
        mod_arrays: dict of name -> array on q's GPU (at most 4, C-contiguous;
            float32, float16, bfloat16, int32, int64 or bool) that score_mod
            and mask_mod read by name (indices clamped to each array's
            bounds); a BlockMask's own by default.
        return_lse: also return the log-sum-exp of each query row (of the
            probabilities before dropout).
        out: optional (batch, seqlen_q, nheads, head_dim) array of q's dtype to
            write the output into (not for JAX, whose arrays are immutable).
        lse: optional (batch, nheads, seqlen_q) C-contiguous float32 array to
            write the log-sum-exp into. With ``out`` and ``lse`` given the call
            allocates nothing, as CUDA graph capture needs.
        fp32_precision: the arithmetic of float32 inputs (others ignore it):
            "ieee" (default) float32 products on CUDA cores; "3xtf32" each
            float32 operand split into two tf32 parts, three tensor-core
            products summed in float32: float32-level accuracy at several
            times the speed (sm_80+, head_dim a multiple of 8, 16-byte
            aligned rows, softmax_scale > 0, tiles that fit the GPU's shared
            memory; otherwise the exact path runs). README: float32.
        num_splits: decoding only (float16/bfloat16 on the tensor-core path,
            at most 64 query rows per K/V head: seqlen_q, or with seqlen_q 1
            the query heads sharing a K/V head, which run together): the
            number of key ranges computed by separate thread blocks and
            merged by their log-sum-exp (split-KV; on Hopper and later, a
            count of 2, 4, 8 or 16 on the one-token decode blocks runs as
            thread-block clusters merged in place, else a merge kernel
            follows). None (default): chosen from the device's SM count; 1:
            no split. Other calls take None or 1.
        heads_first: q, k, v and out given as (batch, nheads, seqlen, head_dim)
            (PyTorch SDPA's layout; any strides, the last dimension
            contiguous), and the output returned so, laid out like q.

    Returns:
        ``out`` shaped like q, of q's framework (CuPy for CuPy and generic
        DLPack inputs), or ``(out, lse)`` with lse (batch, nheads, seqlen_q)
        float32 when ``return_lse``. Kernels run on the current stream of q's
        framework (PyTorch's current stream, CuPy's current stream).
    """
    if (out is None and lse is None and num_splits is None and return_lse.__class__ is bool
            and plain_options(window_size, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset, score_mod,
                              mod_arrays, mask_mod)):
        # The call's plan is fixed by q, k, v and the flags (forward_plain).
        out, lse, _ = forward_plain(q, k, v, causal, softmax_scale, fp32_precision, heads_first, return_lse)
        return (out, lse) if return_lse else out
    arrays, _ = _attention(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                           dropout_offset, score_mod, mod_arrays, mask_mod, return_lse, out, lse, fp32_precision,
                           num_splits, heads_first)
    return (arrays[3], arrays[4]) if return_lse else arrays[3]


def plain_options(window_size, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset, score_mod, mod_arrays,
                  mask_mod) -> bool:
    """Whether a call's variant options are all their defaults, each of its
    default's class (the window's sides too: ``check_window`` refuses
    others, and the full path must explain them): no variants, so that its
    plan is fixed by q, k, v and the flags (``forward_plain``)."""
    return (window_size.__class__ is tuple and len(window_size) == 2 and window_size[0].__class__ is int
            and window_size[1].__class__ is int and window_size == (-1, -1) and softcap.__class__ is float
            and softcap == 0.0 and dropout_p.__class__ is float and dropout_p == 0.0
            and dropout_offset.__class__ is int and dropout_offset == 0 and alibi_slopes is None
            and dropout_seed is None and score_mod is None and mod_arrays is None and mask_mod is None)


def _attention(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
               dropout_offset, score_mod, mod_arrays, mask_mod, return_lse, out, lse, fp32_precision, num_splits,
               heads_first) -> tuple[list, CachedCall | None]:
    """``attention``'s call (the variants in ``Variants``' order): the
    arrays of FORWARD_ARRAYS (out and lse at 3 and 4) and the cached call
    that ran it (None where the full path ran)."""
    mod_arrays = _mask_mod_arrays(mask_mod, mod_arrays)
    arrays = [q, k, v, out, lse, None, None, None, None, alibi_slopes, dropout_seed, dropout_offset, None,
              *_mod_list(mod_arrays), None]
    flags = (causal.__class__, causal, softmax_scale.__class__, softmax_scale, fp32_precision.__class__,
             fp32_precision, num_splits.__class__, num_splits, *_variant_flags(window_size, softcap, dropout_p),
             *_mod_flags(score_mod, mod_arrays), mask_mod, heads_first.__class__, heads_first, bool(return_lse))
    key, pointers = _signature("forward", arrays, flags) if _planned(mask_mod) else (None, None)
    call = None if key is None else _cached_call(key, arrays, pointers)
    if call is None:
        arrays = _attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse=lse,
                                    fp32_precision=fp32_precision, num_splits=num_splits, keep_lse=bool(return_lse),
                                    heads_first=check_heads_first(heads_first),
                                    variants=Variants(window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                                                      dropout_offset, score_mod, mod_arrays, mask_mod),
                                    signature=(functools.partial(_signature, "forward", arrays, flags)
                                               if _planned(mask_mod) else _unplanned))
    return arrays, call


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                       score_mod=None, mask_mod=None, mod_arrays=None, deterministic=False, dq=None, dk=None,
                       dv=None, heads_first=False):
    """Gradients of ``attention`` with respect to q, k and v, recomputing the
    attention probabilities tile by tile from the forward's log-sum-exp
    (FlashAttention-2 backward): memory O(seqlen), never O(seqlen^2).

    Args:
        dout: (batch, seqlen_q, nheads, head_dim) gradient of the output, q's dtype.
        q, k, v: the forward's inputs, as for ``attention``.
        out: (batch, seqlen_q, nheads, head_dim) the forward's output.
        lse: (batch, nheads, seqlen_q) float32, the forward's log-sum-exp
            (``attention(..., return_lse=True)``).
        causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
            dropout_seed, dropout_offset, score_mod, mask_mod, mod_arrays: as
            given to the forward (the same seed and offset regenerate its
            dropout mask; score_mod's derivative is traced with it; a
            BlockMask builds its map at the backward's tiles once).
        deterministic: if True, dq is bitwise identical from run to run (dQ is
            summed in a fixed order instead of with float32 atomics: on the
            tensor-core backwards the key blocks add in turn, at 0.73-0.90x
            the default's speed on an H100; elsewhere a second SIMT pass).
            dk and dv are always deterministic.
        dq, dk, dv: optional arrays to write the gradients into, shaped and
            typed like q, k, v (not for JAX).
        heads_first: dout, q, k, v, out, dq, dk and dv given (and dq, dk, dv
            returned) as (batch, nheads, seqlen, head_dim), as for ``attention``.

    Returns:
        ``(dq, dk, dv)`` shaped and typed like q, k, v, in q's framework. With
        grouped-query attention, dk and dv are summed over the query heads that
        share each key/value head. Kernels run on the current stream of q's
        framework.
    """
    arrays, _ = _backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size, softcap, alibi_slopes,
                          dropout_p, dropout_seed, dropout_offset, score_mod, mod_arrays, mask_mod, deterministic, dq,
                          dk, dv, heads_first)
    return arrays[6], arrays[7], arrays[8]


def _backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
              dropout_seed, dropout_offset, score_mod, mod_arrays, mask_mod, deterministic, dq, dk, dv,
              heads_first) -> tuple[list, CachedCall | None]:
    """``attention_backward``'s call (the variants in ``Variants``' order):
    the arrays of BACKWARD_ARRAYS (dq, dk, dv at 6-8) and the cached call
    that ran it (None where the full path ran)."""
    mod_arrays = _mask_mod_arrays(mask_mod, mod_arrays)
    arrays = [dout, q, k, v, out, lse, dq, dk, dv, None, None, None, None, None, alibi_slopes, dropout_seed,
              dropout_offset, None, *_mod_list(mod_arrays), None]
    flags = (causal.__class__, causal, softmax_scale.__class__, softmax_scale, deterministic.__class__,
             deterministic, *_variant_flags(window_size, softcap, dropout_p), *_mod_flags(score_mod, mod_arrays),
             mask_mod, heads_first.__class__, heads_first)
    key, pointers = _signature("backward", arrays, flags) if _planned(mask_mod) else (None, None)
    call = None if key is None else _cached_call(key, arrays, pointers)
    if call is None:
        arrays = _attention_backward(arrays, causal=causal, softmax_scale=softmax_scale,
                                     deterministic=deterministic, heads_first=check_heads_first(heads_first),
                                     variants=Variants(window_size, softcap, None, dropout_p, dropout_seed,
                                                       dropout_offset, score_mod, mod_arrays, mask_mod),
                                     signature=(functools.partial(_signature, "backward", list(arrays), flags)
                                                if _planned(mask_mod) else _unplanned))
    return arrays, call


#: A backward's arrays beyond dout, q, k, v, out and lse where the call has
#: no ALiBi slopes, dropout or mod arrays (dropout's offset is the int 0).
_PLAIN_BACKWARD_REST = tuple(0 if name == "dropout_offset" else None for name in BACKWARD_ARRAYS[6:])
#: Most followers one forward's cached call keeps (a few dout layouts).
_MAX_FOLLOWERS = 16


def followed_backward(forward, dout, q, k, v, out, lse, deterministic) -> tuple | None:
    """``(dq, dk, dv)`` from the backward call remembered on the cached
    forward call ``forward`` for dout's signature part, alignment and
    ``deterministic`` (``backward_following`` remembers them), reading only
    dout's signature and the six pointers; None where none is remembered,
    dout is no fast-lane array or the current device is not the plan's.
    Same arrays and conditions as ``backward_following``."""
    try:
        part, pointer = _interop.SIGNATURES[dout.__class__](dout)
        follower = forward.followers.get((part, not pointer & 15, deterministic))
    except Exception:  # not a fast-lane array, or no forward call: the caller's path explains
        return None
    if follower is None or follower.current_device() != follower.plan.device:
        return None
    arrays = [dout, q, k, v, out, lse, *_PLAIN_BACKWARD_REST]
    read = _interop.POINTERS  # each array's class: a call may mix fast-lane frameworks
    pointers = [pointer, read[q.__class__](q), read[k.__class__](k), read[v.__class__](v), read[out.__class__](out),
                read[lse.__class__](lse), *_PLAIN_BACKWARD_REST]
    # Slots of absent arrays are not written (CachedCall.live): their Nones are never read.
    follower.run(arrays, pointers)
    return arrays[6], arrays[7], arrays[8]


def backward_following(forward, dout, q, k, v, out, lse, *, causal, softmax_scale, window_size, softcap,
                       deterministic, heads_first) -> tuple:
    """``attention_backward(dout, q, k, v, out, lse, ...)`` (returns ``(dq,
    dk, dv)``) of a forward that ran from the cached call ``forward``
    (``_attention``'s) on these q, k and v, allocating the out and lse given
    here (same arrays, same layouts: the caller knows, as PyTorch's autograd
    does of a node's saved tensors), with the same flags and no ALiBi
    slopes, dropout or mods. Its plan is then fixed by the forward's and by
    dout's signature part, alignment and ``deterministic``: the first such
    backward takes ``attention_backward``'s path and is remembered on the
    forward's call; later ones read only dout's signature and the six
    pointers (``followed_backward``; signatures of q, k, v, out and lse
    cost 3-4 us each inside a training step). ``forward`` None:
    ``attention_backward``'s path."""
    if forward is not None:
        gradients = followed_backward(forward, dout, q, k, v, out, lse, deterministic)
        if gradients is not None:
            return gradients
    arrays, follower = _backward(dout, q, k, v, out, lse, causal, softmax_scale, window_size, softcap, None, 0.0,
                                 None, 0, None, None, None, deterministic, None, None, None, heads_first)
    if forward is not None and follower is not None:
        try:
            part, pointer = _interop.SIGNATURES[dout.__class__](dout)
        except Exception:  # not a fast-lane array (then no call is cached either)
            return arrays[6], arrays[7], arrays[8]
        if len(forward.followers) >= _MAX_FOLLOWERS:
            forward.followers.clear()
        forward.followers[(part, not pointer & 15, deterministic)] = follower
    return arrays[6], arrays[7], arrays[8]


#: A forward's arrays beyond q, k, v, out and lse without ALiBi slopes,
#: dropout or mod arrays (dropout's offset is the int 0).
_PLAIN_FORWARD_REST = tuple(0 if name == "dropout_offset" else None for name in FORWARD_ARRAYS[5:])
#: The most short keys ``forward_plain`` keeps (``plans.shortcuts``).
_MAX_PLAIN_FORWARDS = 64


def forward_plain(q, k, v, causal, softmax_scale, fp32_precision, heads_first, return_lse=True) -> tuple:
    """``_attention(q, k, v, ...)`` without variants, ``out``, ``lse`` or
    ``num_splits`` given (the differentiable route's forward, returning the
    log-sum-exp; ``attention``'s call without options): ``(out, lse, call)``,
    lse None unless ``return_lse`` (a bool), ``call`` as ``_attention``'s.
    With no variants and no out or lse, the signature parts of q, k and v,
    their alignment and the flags fix the rest of ``_attention``'s plan-cache key, so the cached
    call remembered under that short key is the one ``_attention`` would
    find; a call that has one reads only three signatures (a training
    step's forward spends its host time on the rest of ``_attention``'s
    key otherwise). The short keys live beside the plans they stand for
    (``plans.shortcuts``) and go with them; a call is served only while it
    is still the plan cache's entry, which each call keeps recent (so the
    cache's bound and a ``plans.clear()`` hold for it too)."""
    shortcuts = plans.shortcuts
    try:
        read = _interop.SIGNATURES
        q_part, q_pointer = read[q.__class__](q)
        k_part, k_pointer = read[k.__class__](k)
        v_part, v_pointer = read[v.__class__](v)
        key = (q_part, k_part, v_part, not (q_pointer | k_pointer | v_pointer) & 15, causal.__class__, causal,
               softmax_scale.__class__, softmax_scale, fp32_precision.__class__, fp32_precision,
               heads_first.__class__, heads_first, return_lse)
        call = shortcuts.get(key)
    except Exception:  # not a fast-lane array, or an unhashable flag: _attention explains
        key = call = None
    if call is not None and call.current_device() == call.plan.device and plans.refresh(call.key, call):
        arrays = [q, k, v, None, None, *_PLAIN_FORWARD_REST]
        # Slots of absent arrays are not written (CachedCall.live): their Nones are never read.
        pointers = [q_pointer, k_pointer, v_pointer, 0, 0, *_PLAIN_FORWARD_REST]
        call.run(arrays, pointers)
        return arrays[3], arrays[4] if return_lse else None, call
    arrays, call = _attention(q, k, v, causal, softmax_scale, *_PLAIN_VARIANT_VALUES, return_lse, None, None,
                              fp32_precision, None, heads_first)
    if key is not None and call is not None:
        if len(shortcuts) >= _MAX_PLAIN_FORWARDS:
            shortcuts.clear()
        shortcuts[key] = call
    return arrays[3], arrays[4] if return_lse else None, call


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     dropout_seed=None, dropout_offset=0, score_mod=None, mod_arrays=None, return_lse=False, out=None,
                     lse=None, fp32_precision="ieee"):
    """``attention`` of a variable-length batch: sequences of different
    lengths packed one after another, with no padding (FlashAttention-2's
    ``flash_attn_varlen_func`` layout). Sequence b's queries are rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q, its keys and values rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v; each sequence
    attends only to its own keys.

    Args:
        q: (total_q, nheads, head_dim); k, v: (total_k, nheads_k, head_dim),
            dtypes, head dims and grouped-query heads as for ``attention``.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's GPU, contiguous,
            non-decreasing, from 0 (``cumsum`` of the lengths with a leading 0).
            Their values stay on the GPU (reading them would synchronise):
            offsets outside the tensors are clamped to them, so a bad offset
            gives wrong rows, never an access outside the arrays.
        max_seqlen_q, max_seqlen_k: ints at least the longest query and key
            sequence (they size the grid: query rows past max_seqlen_q are not
            computed, and a backward leaves the keys past max_seqlen_k
            without gradients).
        causal: bottom-right aligned within each sequence, as in ``attention``.
        window_size, softcap: as for ``attention``, within each sequence.
        alibi_slopes: (nheads,) or (batch, nheads) float32, sequence b's
            slopes row b.
        dropout_p, dropout_seed, dropout_offset: as for ``attention``,
            sequence b's mask that of batch entry b (rows and keys counted
            from the sequence's start).
        score_mod, mod_arrays: as for ``attention``, b the sequence and
            q_idx, kv_idx counted from its start.
        softmax_scale, fp32_precision: as for ``attention``.
        return_lse: also return the log-sum-exp, (nheads, total_q) float32.
        out: optional (total_q, nheads, head_dim) array of q's dtype;
            lse: optional (nheads, total_q) C-contiguous float32 array.

    Returns:
        ``out`` (total_q, nheads, head_dim), or ``(out, lse)``. Rows of q past
        ``cu_seqlens_q[batch]`` are not written.
    """
    arrays = [q, k, v, out, lse, None, None, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, dropout_offset,
              None, *_mod_list(mod_arrays), None]
    flags = (causal.__class__, causal, softmax_scale.__class__, softmax_scale, fp32_precision.__class__,
             fp32_precision, "varlen", max_seqlen_q.__class__, max_seqlen_q, max_seqlen_k.__class__, max_seqlen_k,
             *_variant_flags(window_size, softcap, dropout_p), *_mod_flags(score_mod, mod_arrays), bool(return_lse))
    key, pointers = _signature("forward", arrays, flags)
    if key is None or not _cached_call(key, arrays, pointers):
        arrays = _attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse=lse,
                                    fp32_precision=fp32_precision, keep_lse=bool(return_lse),
                                    variants=Variants(window_size, softcap, alibi_slopes, dropout_p, dropout_seed,
                                                      dropout_offset, score_mod, mod_arrays),
                                    packing=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                                    signature=functools.partial(_signature, "forward", arrays, flags))
    return (arrays[3], arrays[4]) if return_lse else arrays[3]


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                              score_mod=None, mod_arrays=None, deterministic=False, dq=None, dk=None, dv=None):
    """Gradients of ``attention_varlen`` with respect to q, k and v.

    Args:
        dout, out: (total_q, nheads, head_dim); q, k, v, the offsets and
            longest lengths as given to ``attention_varlen``; lse its
            (nheads, total_q) log-sum-exp (``return_lse=True``).
        causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p,
            dropout_seed, dropout_offset, score_mod, mod_arrays, deterministic:
            as for ``attention_backward``.
        dq, dk, dv: optional arrays shaped and typed like q, k, v.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v. dq is 0 on the rows past
        ``cu_seqlens_q[batch]``; dk and dv are not written past
        ``cu_seqlens_k[batch]``.
    """
    arrays = [dout, q, k, v, out, lse, dq, dk, dv, None, None, None, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
              dropout_seed, dropout_offset, None, *_mod_list(mod_arrays), None]
    flags = (causal.__class__, causal, softmax_scale.__class__, softmax_scale, deterministic.__class__,
             deterministic, "varlen", max_seqlen_q.__class__, max_seqlen_q, max_seqlen_k.__class__, max_seqlen_k,
             *_variant_flags(window_size, softcap, dropout_p), *_mod_flags(score_mod, mod_arrays))
    key, pointers = _signature("backward", arrays, flags)
    if key is None or not _cached_call(key, arrays, pointers):
        arrays = _attention_backward(arrays, causal=causal, softmax_scale=softmax_scale,
                                     deterministic=deterministic, packing=(max_seqlen_q, max_seqlen_k),
                                     variants=Variants(window_size, softcap, None, dropout_p, dropout_seed,
                                                       dropout_offset, score_mod, mod_arrays),
                                     signature=functools.partial(_signature, "backward", list(arrays), flags))
    return arrays[6], arrays[7], arrays[8]


def attention_with_kvcache(q, k_cache, v_cache, k_new=None, v_new=None, *, cache_seqlens=None, block_table=None,
                           causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_lse=False, num_splits=None, out=None, lse=None):
    """``attention`` of new queries against a KV cache (decoding, chunked
    prefill, speculative decoding), optionally appending the new tokens'
    keys and values to the cache first, in the same call.

    Args:
        q: (batch, seqlen_q, nheads, head_dim), float16 or bfloat16, head_dim
            a multiple of 8 up to 256, rows 16-byte aligned.
        k_cache, v_cache: the cache, of q's dtype: contiguous
            (batch, seqlen_cache, nheads_k, head_dim), or paged
            (num_pages, page_size, nheads_k, head_dim) with ``block_table``;
            any page size from 1 row. nheads_k divides nheads (GQA).
        k_new, v_new: optional (batch, seqlen_new, nheads_k, head_dim): written
            into the cache at keys ``cache_seqlens[b] .. + seqlen_new`` of each
            entry b (through the block table where paged), then attended to.
            Nothing else in the cache is written; keys that would fall past
            the capacity are not written and not attended to.
        cache_seqlens: the keys each entry holds before the append: None (every
            entry is full: seqlen_cache, or max_pages * page_size), an int, or a
            (batch,) int32 GPU array (read on the GPU, clamped to the capacity;
            an int is checked here, and each new int value plans anew, so pass
            an array in a decoding loop).
        block_table: (batch, max_pages) int32 GPU array, contiguous in its last
            dimension: entry b's keys are the rows of pages block_table[b, 0],
            block_table[b, 1], ... in order (any order of pages, shared pages
            allowed). Page numbers are clamped to the cache on the GPU.
        causal: bottom-right aligned per entry: query i of entry b sees key j
            iff j <= i + seqlen_k[b] - seqlen_q, seqlen_k[b] its keys after
            the append.
        softmax_scale, window_size, softcap, alibi_slopes, return_lse, out,
            lse: as for ``attention``, each entry's keys those after the append.
        num_splits: as for ``attention`` (decoding's split-KV; None chooses
            from the device's SM count and the cache's capacity).

    Returns:
        ``out`` (batch, seqlen_q, nheads, head_dim), or ``(out, lse)`` with lse
        (batch, nheads, seqlen_q) float32. An entry with no key gets output 0
        and log-sum-exp -inf.
    """
    lengths = None if cache_seqlens is None or isinstance(cache_seqlens, numbers.Integral) else cache_seqlens
    arrays = [q, k_cache, v_cache, out, lse, None, None, None, None, alibi_slopes, None, None, None, None,
              *[None] * len(MOD_ARRAY_SLOTS), None, block_table, k_new, v_new, lengths]
    flags = (causal.__class__, causal, softmax_scale.__class__, softmax_scale, num_splits.__class__, num_splits,
             "kvcache", None if lengths is not None else (cache_seqlens.__class__, cache_seqlens),
             *_variant_flags(window_size, softcap))
    key, pointers = _signature("kvcache", arrays, flags)
    if key is None or not _cached_call(key, arrays, pointers):
        arrays = _attention_kvcache(
            {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
             "block_table": block_table, "cache_seqlens": lengths, "alibi_slopes": alibi_slopes},
            cache_seqlens=cache_seqlens, causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
            variants=Variants(window_size, softcap), out=out, lse=lse,
            signature=functools.partial(_signature, "kvcache", arrays, flags))
    return (arrays[3], arrays[4]) if return_lse else arrays[3]


def _attention_kvcache(inputs: dict, *, cache_seqlens, causal, softmax_scale, num_splits, variants: "Variants",
                       out, lse, signature) -> list:
    """The full path of a KV-cache call (``inputs``: its arrays by name, None
    where not given; ``variants`` without the slopes, which are among
    ``inputs``). Returns the arrays of ``KVCACHE_ARRAYS`` in q's framework."""
    arrays = {name: x for name, x in inputs.items() if x is not None}
    given = {name: x for name, x in (("out", out), ("lse", lse)) if x is not None}
    with _call(arrays | given, immutable_outputs=tuple(given)) as (bridge, views):
        metas = {name: meta_of(name, view) for name, view in views.items()}
        call = check_kv_cache(metas["q"], metas["k_cache"], metas["v_cache"], metas.get("k_new"), metas.get("v_new"),
                              metas.get("cache_seqlens", cache_seqlens), metas.get("block_table"), metas.get("out"),
                              metas.get("lse"), causal=causal, softmax_scale=softmax_scale)
        call = dataclasses.replace(call, problem=variants.applied(call.problem, metas.get("alibi_slopes")))
        problem = call.problem
        natives = {"k": inputs["k_cache"], "v": inputs["v_cache"]} | arrays | given
        allocated = {}
        for name, shape, dtype, like in (("out", tuple(views["q"].shape), views["q"].dtype, metas["q"].strides),
                                         ("lse", (problem.batch, problem.nheads, problem.seqlen_q), "float32", None)):
            if name not in given:
                allocated[name] = _new_output(bridge, views, name, shape, dtype, like)
        # The kernels' K and V: the pages, the whole cache, or (every entry
        # holding the same keys) its first seqlen_k keys as a dense batch.
        dense = problem.kv_cache is None
        views["k"], views["v"] = (views[name][:, :problem.seqlen_k] if dense else views[name]
                                  for name in ("k_cache", "v_cache"))
        layouts = {name: Layout.of(views[name]) for name in ("q", "k", "v", "out", "k_new", "v_new") if name in views}
        aligned = pointers_aligned("kvcache", _view_pointers(KVCACHE_ARRAYS, views))
        if not (aligned and all(_rows_are_16_byte_chunks(layout) for layout in layouts.values())):
            raise ValueError("q, k_cache, v_cache, out, k_new and v_new must have 16-byte aligned pointers and row, "
                             "head and batch strides for a KV cache (the tensor-core kernels copy 16-byte chunks)")
        caches = {name: Layout.of(views[f"{name}_cache"]) for name in ("k", "v")}
        plan = kvcache_plan(call, layouts, caches, num_splits=check_num_splits(num_splits))
        work = WorkArena.of(plan.work_buffers)
        work.allocate(bridge, views)
        pointers = _view_pointers(KVCACHE_ARRAYS, views)
        return _run_planned(signature, bridge, plan, KVCACHE_ARRAYS, views, pointers, natives, allocated,
                            work=work)


def kvcache_plan(call: KvCacheCall, layouts: dict, caches: dict, num_splits: int | None = None) -> LaunchPlan:
    """The launch plan of a validated KV-cache call (``layouts``: q, k, v
    and out as the forward kernels see them, k_new and v_new where given;
    ``caches``: "k" and "v", the caches' whole layouts): where keys are appended, the append
    kernel (``kernels_cu/kv_cache_append.cu``), then the forward. Pointer
    slots: ``kvcache_slots``."""
    problem = call.problem
    parts = _forward_parts(problem, layouts, aligned=True, num_splits=num_splits)
    structs, launches = list(parts.structs), list(parts.launches)
    work_buffers = dict(parts.work_buffers)
    append = None
    if call.seqlen_new and problem.batch:
        append = len(structs)
        layout = "paged" if problem.kv_cache is not None and problem.kv_cache.paged else "cache"
        if problem.kv_cache is not None and problem.kv_cache.per_entry:
            work_buffers["seqused_k"] = ((problem.batch,), "int32")
        cache_size = dataclasses.replace(problem, seqlen_k=call.capacity)
        structs.append(pack(
            CACHE_APPEND_PARAMS,
            k_new=tensor_ref(layouts["k_new"]), v_new=tensor_ref(layouts["v_new"]),
            k_cache=tensor_ref(caches["k"]), v_cache=tensor_ref(caches["v"]),
            cache_seqlens=0, seqused_k=0, cache_seqlen=call.cache_seqlen or 0, seqlen_new=call.seqlen_new,
            size=_size_fields(cache_size)))
        variant = cache_append_variant(problem.dtype, layout)
        chunks = problem.batch * call.seqlen_new * problem.nheads_k * problem.head_dim * 2 // 16
        blocks = max(1, min(-(-chunks // CACHE_APPEND_THREADS), 4096))
        launches.insert(0, KernelLaunch(loader.get(variant, problem.device), blocks, variant.threads, 0, append))
    slots = kvcache_slots(parts.slots, append, per_entry=problem.kv_cache is not None and problem.kv_cache.per_entry)
    # The forward's tensor maps (copy-engine K/V) follow their arrays to the same places among these slots.
    tensor_maps = [(slots[list(parts.slots).index(slot)], encoder) for slot, encoder in parts.tensor_maps]
    return LaunchPlan(problem.device, structs, slots, launches, tensor_maps, work_buffers)


def kvcache_slots(forward_slots: tuple, append: int | None, per_entry: bool) -> tuple:
    """The pointer slots of a KV-cache plan (``KVCACHE_ARRAYS``) from its
    forward's (struct 0 the forward kernel's) and the index of the append
    kernel's struct (None: no append). The forward kernel reads the key
    counts from the append kernel's output where it runs, else from
    cache_seqlens directly (``per_entry``: a GPU array of them)."""
    def both(forward_field: str, append_field: str) -> tuple:
        return ((0, forward_field),) + (((append, append_field),) if append is not None else ())

    def appended(field: str) -> tuple:
        return ((append, field),) if append is not None else ()

    q, _, _, *rest = forward_slots
    return (q, both("k.ptr", "k_cache.ptr"), both("v.ptr", "v_cache.ptr"), *rest,
            both("size.seqused_k", "seqused_k") if append is not None and per_entry else (),
            both("size.block_table", "size.block_table"), appended("k_new.ptr"), appended("v_new.ptr"),
            appended("cache_seqlens") if append is not None else ((0, "size.seqused_k"),) if per_entry else ())


#: Arrays of a merge call, in the order of its plan's pointer slots.
MERGE_ARRAYS = ("partial", "partial_lse", "out", "lse")
MERGE_SLOTS = ("partial.ptr", "partial_lse", "out.ptr", "lse")


def merge_attention_states(outs, lses, *, out=None, lse=None):
    """Combines attention results computed over disjoint parts of the same
    keys (split-KV decoding, a prefix cache beside new tokens, context
    parallelism) into the result over all of them, by their log-sum-exps:
    ``lse = log(sum_s exp(lses[s]))``, ``out = sum_s exp(lses[s] - lse) * outs[s]``.
    A state whose lse is -inf (it saw no key) weighs 0 and its output is not
    read; a row whose every state is -inf gets output 0 and lse -inf.

    Args:
        outs: (num_states, batch, seqlen, nheads, head_dim) partial outputs,
            each normalised by its own softmax sum (as ``attention`` returns
            them), float16, bfloat16 or float32, contiguous in head_dim.
        lses: (num_states, batch, nheads, seqlen) float32, their log-sum-exps
            (``attention(..., return_lse=True)``); any strides.
        out: optional (batch, seqlen, nheads, head_dim) array of outs' dtype
            to write the output into (not for JAX).
        lse: optional (batch, nheads, seqlen) float32 array for the merged
            log-sum-exp (not for JAX).

    Returns:
        ``(out, lse)`` in outs' framework; out has outs' dtype, computed in float32.
    """
    arrays = [outs, lses, out, lse]
    key, pointers = _signature("merge", arrays, ())
    if key is None or not _cached_call(key, arrays, pointers):
        arrays = _merge(outs, lses, out, lse, signature=functools.partial(_signature, "merge", arrays, ()))
    return arrays[2], arrays[3]


def _merge(outs, lses, out, lse, *, signature) -> list:
    given = {name: x for name, x in (("out", out), ("lse", lse)) if x is not None}
    with _call({"q": outs, "partial_lse": lses} | given, immutable_outputs=tuple(given)) as (bridge, views):
        views["partial"] = views.pop("q")
        metas = {name: meta_of(name, views[name]) for name in views}
        problem = check_merge(dataclasses.replace(metas["partial"], name="outs"),
                              dataclasses.replace(metas["partial_lse"], name="lses"), metas.get("out"),
                              metas.get("lse"))
        natives = {"partial": outs, "partial_lse": lses} | given
        allocated = {}
        for name, shape, dtype in (("out", tuple(views["partial"].shape[1:]), views["partial"].dtype),
                                   ("lse", (problem.batch, problem.nheads, problem.seqlen), "float32")):
            if name not in given:
                allocated[name] = _new_output(bridge, views, name, shape, dtype)
        pointers = _view_pointers(MERGE_ARRAYS, views)
        plan = merge_plan(problem, {name: metas[name].strides if name in metas else
                                    contiguous_strides(tuple(views[name].shape)) for name in MERGE_ARRAYS}, pointers)
        return _run_planned(signature, bridge, plan, MERGE_ARRAYS, views, pointers, natives, allocated)


def merge_plan(problem: MergeProblem, strides: dict, pointers: list) -> LaunchPlan:
    """The launch plan of a validated merge: element ``strides`` of partial,
    partial_lse, out and lse; each lane reads the widest vector of columns
    (``merge_vectors``: up to 16 bytes) that head_dim, the strides and
    ``pointers`` allow, and few states take the variant with few in flight."""
    partial = strides["partial"]
    # the widest load (8 or 16 bytes) the strides allow; pointers 16-byte aligned (the cache key says so)
    states_in_flight = merge_states_in_flight(problem.num_states)
    vector = max((n for n in merge_vectors(problem.dtype, states_in_flight)
                  if all(x % n == 0 for x in (*partial[:4], problem.head_dim)) and pointers[0] % 16 == 0), default=1)
    params, launch = _merge_launch(
        problem.device, problem.dtype, problem.dtype, problem.num_states,
        (problem.batch, problem.nheads, problem.nheads, problem.seqlen, 0, problem.head_dim, 0, 0,
         problem.batch * problem.seqlen, 0, 0, 0, 0, 0),
        out=(0, *strides["out"][:3]), lse_strides=strides["lse"], partial=(0, *partial[1:4]),
        partial_state_stride=partial[0], partial_lse_strides=strides["partial_lse"], vector=vector)
    return LaunchPlan(problem.device, [params], MERGE_SLOTS, [launch] if launch else [])


def _merge_launch(device: int, partial_dtype: str, out_dtype: str, num_states: int, size: tuple, *, out: tuple,
                  lse_strides: tuple, partial: tuple, partial_state_stride: int, partial_lse_strides: tuple,
                  vector: int, struct: int = 0):
    """The merge kernel's parameter struct (MergeParams, pointers left 0)
    and its launch (None where there is no row or column), for both callers:
    ``merge_attention_states`` and split-KV. ``size`` is ProblemSize's
    fields (batch, heads, heads, rows, unused, head_dim, ...); ``out`` and
    ``partial`` TensorRef fields; ``lse_strides`` (batch, head, row) and
    ``partial_lse_strides`` (state, batch, head, row) in elements;
    ``vector``: the columns a lane loads at once (``merge_vectors``; the
    caller has checked that pointers, strides and head_dim allow it)."""
    batch, heads, _, rows, _, head_dim = size[:6]
    params = pack(
        MERGE_PARAMS,
        out=out,
        lse=0,
        lse_batch_stride=lse_strides[0],
        lse_head_stride=lse_strides[1],
        lse_row_stride=lse_strides[2],
        partial=partial,
        partial_lse=0,
        partial_lse_batch_stride=partial_lse_strides[1],
        partial_lse_head_stride=partial_lse_strides[2],
        partial_lse_row_stride=partial_lse_strides[3],
        num_states=num_states,
        partial_state_stride=partial_state_stride,
        partial_lse_state_stride=partial_lse_strides[0],
        size=size,
    )
    total_rows = batch * heads * rows
    if not total_rows or not head_dim:
        return params, None
    variant = merge_variant(partial_dtype, out_dtype, vector, merge_states_in_flight(num_states))
    return params, KernelLaunch(loader.get(variant, device), -(-total_rows // MERGE_WARPS), variant.threads, 0,
                                struct)


@contextmanager
def _call(arrays: dict, immutable_outputs: tuple[str, ...] = ()):
    """Checks that ``arrays`` (which include q, whose framework, device and
    stream the call takes) are GPU arrays on one device and yields the call's
    bridge and CuPy views of them, inside that device and stream."""
    cupy = import_cupy()
    frameworks = {name: _interop.framework_of(x, name) for name, x in arrays.items()}
    for framework in set(frameworks.values()):
        _interop.fast_lane(framework)  # lets later calls with these array classes compute their signature
    for name in immutable_outputs:
        if frameworks[name] == _interop.JAX:
            raise TypeError(f"{name} must be a mutable GPU array; JAX arrays are immutable, so leave {name}=None")
    devices = {name: _interop.device_of(x, frameworks[name]) for name, x in arrays.items()}
    lead = "q"
    bridge = _interop.bridge_for(arrays[lead], frameworks[lead], devices[lead])
    for name, device in devices.items():
        if device != bridge.device_id:
            raise ValueError(f"{name} is on GPU {device} but {lead} is on GPU {bridge.device_id}")
    with cupy.cuda.Device(bridge.device_id), bridge.stream:
        views = {name: bridge.as_cupy(x, frameworks[name]) for name, x in arrays.items()}
        yield bridge, views


def _view_pointers(names: tuple[str, ...], views: dict, scalars: dict | None = None) -> list:
    """Data pointers of ``views`` in the order of ``names`` (0 for an absent
    one), or the value in ``scalars`` of a name there (dropout's seed and offset)."""
    scalars = scalars or {}
    return [views[name].data.ptr if name in views else scalars.get(name, 0) for name in names]


def _run_planned(signature, bridge, plan: LaunchPlan, names: tuple[str, ...], views: dict, pointers: list,
                 natives: dict, allocated: dict, fixed: tuple[str, ...] = (), work: WorkArena | None = None) -> list:
    """Launches ``plan`` on ``pointers`` (``_view_pointers(names, views)``),
    then hands the outputs this call allocated back in q's framework, and
    caches the plan under the call's signature (``signature()``:
    ``_signature``'s result, computed now that ``_call`` has registered the
    call's array classes) for the fast path where q's framework has one.
    ``allocated``: name -> (shape, dtype, element strides, native array) of
    the outputs this call allocated (``_new_output``), which later calls of
    the signature allocate the same way; ``work``: the call's work buffers
    (allocated by the caller, ``WorkArena.allocate``); ``fixed``: names of views every
    call of the signature passes as they are (a BlockMask's tile map, the
    BlockMask being part of the signature). Returns the call's arrays in the
    order of ``names`` (None for an absent one)."""
    plan.launch(pointers, bridge.stream.ptr)
    for name, (_, _, _, native) in allocated.items():
        natives[name] = bridge.export(native, views[name])
    lane = _interop.fast_lane(bridge.framework)
    key = signature()[0] if lane is not None else None
    if key is not None:
        allocations = tuple((names.index(name), lane.allocator(shape, dtype, bridge.device_id, strides))
                            for name, (shape, dtype, strides, _) in allocated.items())
        allocations += tuple((names.index(name), functools.partial(_fixed_array, views[name])) for name in fixed)
        written = {index for index, _ in allocations}
        work_slots = None
        if work is not None and work.nbytes:
            offsets = tuple((names.index(name), offset) for name, _, _, offset in work.buffers)
            work_slots = (lane.memory(work.nbytes, bridge.device_id), offsets)
            written |= {index for index, _ in offsets}
        # Slots of arrays absent from the signature (None) hold the null
        # pointer the first call wrote; the rest are written each call.
        live = tuple(i for i, part in enumerate(key[1]) if part is not None or i in written)  # key[1]: the arrays' parts
        plans.put(key, CachedCall(plan, allocations, work_slots, live, lane.stream(bridge.device_id),
                                  _interop.current_device_getter(), key=key))
    return [natives.get(name) for name in names]


def _new_output(bridge, views: dict, name: str, shape: tuple[int, ...], dtype, like_strides=None,
                heads_first: bool = False) -> tuple:
    """A new output of the call (``bridge.empty``: dense, its dimensions in
    the order of ``like_strides``), its CuPy view as the kernels take it put
    in ``views``; returns ``(shape, dtype, element strides, native)`` of
    the caller's array. ``heads_first``: a 4-D output is made in the
    caller's (batch, nheads, seqlen, head_dim) axes, the view swapped."""
    swap = heads_first and len(shape) == 4
    if swap:
        shape = _swap_heads_and_seqlen(shape)
        like_strides = like_strides and _swap_heads_and_seqlen(like_strides)
    native, view = bridge.empty(shape, dtype, like_strides)
    views[name] = view.swapaxes(1, 2) if swap else view
    return shape, dtype, _element_strides(view), native


def _swap_heads_and_seqlen(sizes: tuple) -> tuple:
    return sizes[0], sizes[2], sizes[1], sizes[3]


def _seqlen_first_views(views: dict, names: tuple[str, ...]) -> None:
    """A ``heads_first`` call's (batch, nheads, seqlen, head_dim) arrays among
    ``views`` replaced by (batch, seqlen, nheads, head_dim) views of them,
    the layout every check and kernel takes."""
    for name in names:
        if name in views:
            if views[name].ndim != 4:
                raise ValueError(f"{name} must be (batch, nheads, seqlen, head_dim) with heads_first=True, "
                                 f"got shape {tuple(views[name].shape)}")
            views[name] = views[name].swapaxes(1, 2)


def _fixed_array(view) -> tuple:
    return view, view.data.ptr


def _element_strides(view) -> tuple[int, ...]:
    return tuple(stride // view.dtype.itemsize for stride in view.strides)


def _attention_forward(q, k, v, *, causal, softmax_scale, out, lse, signature, fp32_precision="ieee",
                       num_splits=None, packing=None, variants: Variants = Variants(), heads_first=False,
                       keep_lse=True) -> list:
    """The full path of a forward call: validation, plan, launch.
    ``packing``: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    of a variable-length call. ``keep_lse``: the caller keeps the
    log-sum-exp (``return_lse``); else, unless given, it goes into the work
    buffers' allocation (one allocation less). Returns the arrays of
    ``FORWARD_ARRAYS`` in q's framework."""
    arrays = {"q": q, "k": k, "v": v}
    if packing is not None:
        arrays |= {"cu_seqlens_q": packing[0], "cu_seqlens_k": packing[1]}
    if variants.alibi_slopes is not None:
        arrays["alibi_slopes"] = variants.alibi_slopes
    arrays |= variants.mod_inputs()
    given = {name: x for name, x in (("out", out), ("lse", lse)) if x is not None}
    with _call(arrays | given, immutable_outputs=tuple(given)) as (bridge, views):
        if heads_first:
            _seqlen_first_views(views, ("q", "k", "v", "out"))
        metas = {name: meta_of(name, view) for name, view in views.items()}
        slopes = metas.pop("alibi_slopes", None)
        mod_metas = variants.mod_metas(metas)
        if packing is not None:
            metas, packed, batch = _packed_metas(metas, packing[2:], {"out": "q"})
        problem = check_forward(metas["q"], metas["k"], metas["v"], metas.get("out"),
                                causal=causal, softmax_scale=softmax_scale, lse=metas.get("lse"),
                                fp32_precision=fp32_precision)
        if packing is not None:
            problem = packed_problem(problem, batch, packed)
        problem = variants.applied(problem, slopes, mod_metas)
        natives = dict(arrays) | given
        allocated = {}
        lse_shape = ((problem.nheads, problem.total_q) if problem.packed else
                     (problem.batch, problem.nheads, problem.seqlen_q))
        q_shape = tuple(views["q"].shape)
        for name, shape, dtype, like in (("out", q_shape, views["q"].dtype, metas["q"].strides[-len(q_shape):]),
                                         ("lse", lse_shape, "float32", None)):
            if name not in given and (name == "out" or keep_lse):
                allocated[name] = _new_output(bridge, views, name, shape, dtype, like, heads_first)
        num_splits = check_num_splits(num_splits)
        layouts = _kernel_layouts(views, ("q", "k", "v", "out"), problem.packed)
        aligned = pointers_aligned("forward", _view_pointers(FORWARD_ARRAYS, views))
        tiling = None
        if problem.tile_map_dims is not None and not problem.is_empty:
            # A user mask's map is built at the kernel's tiles: decided here,
            # without split-KV (its ranges would cut the map's lists).
            if num_splits not in (None, 1):
                raise ValueError(f"num_splits does not combine with mask_mod: leave it None, got {num_splits}")
            tiling = _forward_tiles(problem, layouts, aligned, 1)[0]
            views["tile_map"] = variants.tile_map_view(problem, tiling, views)
        plan = forward_plan(problem, layouts, aligned=aligned, tiling=tiling, num_splits=num_splits)
        # Split-KV's work buffers (and a log-sum-exp no one keeps) come from
        # the caller's framework, on the call's stream.
        work = WorkArena.of(plan.work_buffers | ({} if "lse" in views else {"lse": (lse_shape, "float32")}))
        work.allocate(bridge, views)
        pointers = _view_pointers(FORWARD_ARRAYS, views, variants.scalars(problem))
        return _run_planned(signature, bridge, plan, FORWARD_ARRAYS, views, pointers, natives, allocated,
                            variants.fixed_arrays(views), work)


def _packed_metas(metas: dict, max_seqlens: tuple, likes: dict) -> tuple[dict, Packing, int]:
    """A variable-length call's metas (``cu_seqlens_q``/``_k`` among them)
    checked in the caller's packed shapes (``likes``: array -> the array
    whose shape and dtype it must have; the log-sum-exp (nheads, total_q)),
    then returned as the batch-of-one metas the dense checks take, with the
    call's ``Packing`` and batch size."""
    packing = Packing(metas.pop("cu_seqlens_q"), metas.pop("cu_seqlens_k"), *max_seqlens)
    batch = check_packing(packing, metas["q"], metas["k"], metas["v"])
    for name, like in likes.items():
        check_packed_like(metas.get(name), metas[like])
    if "lse" in metas:
        metas["lse"] = check_packed_lse(metas["lse"], metas["q"].shape[1], metas["q"].shape[0])
    return ({name: meta if name == "lse" else as_batch_of_one(meta) for name, meta in metas.items()}, packing,
            batch)


def _kernel_layouts(views: dict, names: tuple[str, ...], packed: bool) -> dict:
    """``Layout``s of the (batch, seqlen, heads, head_dim) arrays the kernels
    see: the views, or a packed call's (total, heads, head_dim) views as a
    batch of one."""
    return {name: Layout.of(views[name][None] if packed else views[name]) for name in names}


def _attention_backward(arrays: list, *, causal, softmax_scale, deterministic, signature, packing=None,
                        variants: Variants = Variants(), heads_first=False) -> list:
    """The full path of a backward call; ``arrays`` as ``BACKWARD_ARRAYS``
    (the ALiBi slopes among them); ``packing``: (max_seqlen_q, max_seqlen_k)
    of a variable-length call. Returns the arrays of ``BACKWARD_ARRAYS`` in
    q's framework."""
    inputs = dict(zip(BACKWARD_ARRAYS[:6], arrays[:6]))
    if packing is not None:
        inputs |= dict(zip(BACKWARD_ARRAYS[12:14], arrays[12:14]))
    if arrays[14] is not None:
        inputs["alibi_slopes"] = arrays[14]
    inputs |= variants.mod_inputs()
    if isinstance(variants.score_mod, mods.RawScoreMod) and variants.score_mod.gradient is None:
        raise ValueError("a CUDA-C score_mod needs its derivative for the backward: "
                         "cuflash.mods.cuda(value, gradient=...)")
    given = {name: x for name, x in zip(("dq", "dk", "dv"), arrays[6:9]) if x is not None}
    with _call(inputs | given, immutable_outputs=tuple(given)) as (bridge, views):
        if heads_first:
            _seqlen_first_views(views, ("dout", "q", "k", "v", "out", "dq", "dk", "dv"))
        metas = {name: meta_of(name, view) for name, view in views.items()}
        slopes = metas.pop("alibi_slopes", None)
        mod_metas = variants.mod_metas(metas)
        if packing is not None:
            metas, packed, batch = _packed_metas(
                metas, packing, {"dout": "q", "out": "q", "dq": "q", "dk": "k", "dv": "v"})
        problem = check_backward(
            metas["dout"], metas["q"], metas["k"], metas["v"], metas["out"], metas["lse"],
            metas.get("dq"), metas.get("dk"), metas.get("dv"),
            causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
        )
        if packing is not None:
            problem = packed_problem(problem, batch, packed)
        problem = variants.applied(problem, slopes, mod_metas)
        natives = inputs | given
        allocated = {}
        for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            if name not in given:
                shape, dtype = tuple(views[like].shape), views[like].dtype
                allocated[name] = _new_output(bridge, views, name, shape, dtype, metas[like].strides[-len(shape):],
                                              heads_first)
        layouts = _kernel_layouts(views, ("dout", "q", "k", "v", "out", "dq", "dk", "dv"), problem.packed)
        aligned = pointers_aligned("backward", _view_pointers(BACKWARD_ARRAYS, views))
        tiling = backward_tiling_for(problem, layouts, layouts, bool(deterministic), aligned)
        if problem.tile_map_dims is not None and not problem.is_empty:
            views["tile_map"] = variants.tile_map_view(problem, tiling, views)
        # Work buffers come from the caller's framework (PyTorch's caching
        # allocator for PyTorch callers), on the call's stream.
        sizes = (problem.batch, problem.nheads, problem.seqlen_q, problem.head_dim)
        # The allocators align dq; a given dq's alignment is not in the key, out's is (_signature).
        dq_aligned, out_aligned = "dq" not in given, not views["out"].data.ptr & 15
        direct = stores_dq_directly(problem, layouts, tiling, dq_aligned, out_aligned)
        work = WorkArena.of(backward_work_buffers(*sizes, tiling, bool(deterministic), total_q=problem.total_q,
                                                  packed=problem.packed, direct=direct))
        work.allocate(bridge, views)
        pointers = _view_pointers(BACKWARD_ARRAYS, views, variants.scalars(problem))
        lse_layout = Layout.of(views["lse"][None] if problem.packed else views["lse"])
        plan = backward_plan(problem, layouts, lse_layout, bool(deterministic), aligned=aligned, tiling=tiling,
                             dq_aligned=dq_aligned, out_aligned=out_aligned)
        return _run_planned(signature, bridge, plan, BACKWARD_ARRAYS, views, pointers, natives, allocated,
                            variants.fixed_arrays(views), work)


def _grid_size(tiles: int, problem: AttentionProblem, heads: int, what: str) -> int:
    grid = tiles * heads * problem.batch
    if grid > _MAX_GRID_X:
        raise ValueError(f"{what} would need {grid} thread blocks, more than 2**31 - 1")
    return grid


def _size_fields(problem: AttentionProblem) -> tuple:
    """ProblemSize's fields, its pointers (cu_seqlens, seqused_k,
    block_table) 0: the plan's slots write those of a call that has them."""
    cache = problem.kv_cache
    block_table_stride, page_size = (cache.block_table_stride, cache.page_size) if cache is not None else (0, 0)
    return (problem.batch, problem.nheads, problem.nheads_k, problem.seqlen_q, problem.seqlen_k, problem.head_dim,
            0, 0, problem.total_q, problem.total_k, 0, 0, block_table_stride, page_size)


@functools.lru_cache(maxsize=None)
def _compute_capability(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def _pointers_aligned(arrays) -> bool:
    """Whether the data pointer of every CuPy array in ``arrays`` is a multiple of 16 bytes."""
    return all(x.data.ptr % 16 == 0 for x in arrays)


def _rows_are_16_byte_chunks(layout: Layout) -> bool:
    """Whether every 8 consecutive 16-bit elements of a row, from the row's
    start, are one aligned 16-byte load given an aligned base pointer: the
    stride of every dimension but the last (contiguous) one, where that
    dimension has more than one entry, is a positive multiple of 16 bytes
    (positive: the Hopper forward's tensor maps take no negative strides)."""
    return all(stride > 0 and stride % 16 == 0
               for size, stride in zip(layout.shape[:-1], layout.strides[:-1]) if size > 1)


def _as_layouts(arrays) -> list[Layout]:
    return [x if isinstance(x, Layout) else Layout.of(x) for x in arrays]


def forward_tiling_for(problem: AttentionProblem, arrays, aligned: bool | None = None) -> Tiling:
    """The forward kernel a problem runs on: the first forward family of
    ``cuflash._kernel_families`` that applies. The tensor-core kernels need
    float16/bfloat16 (or float32 by 3xTF32) with head_dim a multiple of 8, the device generation,
    and at run time a positive softmax scale and 16-byte aligned rows
    (``arrays``: q, k, v, out as CuPy views or ``Layout``s; ``aligned``:
    whether their pointers are 16-byte aligned, read from the CuPy views
    where not given), tiles that fit the GPU's shared memory, and for
    float32 ``fp32_precision="3xtf32"``; otherwise the SIMT kernel runs
    (same results, slower)."""
    if aligned is None:
        aligned = _pointers_aligned(arrays)
    conditions = dict(aligned_rows=aligned and all(map(_rows_are_16_byte_chunks, _as_layouts(arrays))),
                      positive_scale=problem.softmax_scale > 0, tf32x3=problem.fp32_precision == "3xtf32",
                      smem_limit=_shared_memory_per_block(problem.device))
    generation = _kernel_generation(problem.device)
    if problem.layout in CACHE_LAYOUTS:
        # A KV cache's layouts are built into the mma.sync forward alone (the
        # warp-specialised forward's tensor maps span no pages; the decode
        # tiles copy pages by tensor maps on Hopper: _kv_tma_applies).
        family = FAMILY["forward-mma"]
        why = family.why_not(problem.dtype, problem.head_dim, generation, **conditions)
        if why is not None:
            raise ValueError(f"a KV cache is read by the tensor-core (mma.sync) forward, which {why}: "
                             f"this call has {problem.dtype}, head_dim {problem.head_dim}")
        return family.tiles_on(problem.dtype, problem.head_dim, generation, conditions["smem_limit"])
    return select("forward", problem.dtype, problem.head_dim, generation, **conditions)


def _kernel_generation(device_id: int) -> int:
    """The compute capability the kernels can be built for on ``device_id``:
    Hopper's own instructions (sm_90a) need NVRTC 12.9 or newer (see
    ``cuflash._loader.compile_options``); with an older one a Hopper runs the
    sm_80 kernels."""
    capability = _compute_capability(device_id)
    if capability == 90 and not builds_sm90a():
        return 80
    return capability


@dataclass(frozen=True)
class DecodeShape:
    """How a forward runs as decoding (``decode_shape``): the problem and the
    q/out layouts the kernels see (grouped-query packing folds the query
    heads of a K/V head into query rows) and the log-sum-exp's head stride
    in that problem."""

    problem: AttentionProblem
    layouts: dict
    lse_head_stride: int
    packed: bool


def decode_shape(problem: AttentionProblem, layouts: dict) -> DecodeShape:
    """Grouped-query packing for one query token: with seqlen_q 1, the
    ``group`` query heads of each K/V head become ``group`` query rows of one
    head (q (b, 1, h, d) viewed as (b, group, h_k, d): rows one head stride
    apart, heads group head strides apart; out alike; the log-sum-exp
    (b, h, 1) as (b, h_k, group)), so each K/V byte is read once per K/V
    head instead of once per query head. Causal attention of one query row
    sees every key (bottom-right aligned), so the packed rows run unmasked.
    Other calls keep their shape."""
    group = problem.nheads // max(problem.nheads_k, 1)
    packable = (problem.seqlen_q == 1 and group > 1 and problem.mask.name in ("none", "causal")
                and problem.score.position_free and not problem.packed)
    if not packable:
        return DecodeShape(problem, layouts, problem.tensor_seqlen_q, False)
    packed = dataclasses.replace(problem, seqlen_q=group, nheads=problem.nheads_k, causal=False, mask_name=None)
    views = dict(layouts)
    for name in ("q", "out"):
        layout = layouts[name]
        batch_stride, _, head_stride, column_stride = layout.strides
        views[name] = Layout((layout.shape[0], group, problem.nheads_k, layout.shape[3]),
                             (batch_stride, head_stride, group * head_stride, column_stride), layout.itemsize)
    return DecodeShape(packed, views, group, True)


def decode_splits(problem: AttentionProblem, tiling: Tiling, num_splits: int | None) -> int:
    """How many key ranges a decode forward (``problem`` as the kernels see
    it) runs in: ``num_splits``, or where None ``decode_split_count`` over
    the device's SMs; never more ranges than key blocks, and no range left
    empty."""
    parallel, key_blocks = _decode_blocks(problem, tiling)
    if num_splits is None:
        return decode_split_count(parallel, _multiprocessor_count(problem.device), key_blocks)
    per_split = -(-key_blocks // min(num_splits, key_blocks))
    return -(-key_blocks // per_split)


def _decode_blocks(problem: AttentionProblem, tiling: Tiling) -> tuple[int, int]:
    """A decode forward's thread blocks without splits and its key blocks
    per sequence (at least one), ``problem`` as the kernels see it."""
    return (problem.batch * problem.nheads * -(-problem.seqlen_q // tiling.block_m),
            max(1, -(-problem.seqlen_k // tiling.block_n)))


def forward_work_buffers(problem: AttentionProblem, num_splits: int) -> dict:
    """The work buffers of a split-KV forward (``problem`` as its kernels see
    it), name -> (shape, dtype), C-contiguous: the float32 partial outputs
    (num_splits, batch, seqlen_q, nheads, head_dim) and their log-sum-exps
    (num_splits, batch, nheads, seqlen_q); none without splits."""
    if num_splits == 1:
        return {}
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim
    return {"out_partial": ((num_splits, b, sq, h, d), "float32"),
            "lse_partial": ((num_splits, b, h, sq), "float32")}


def _forward_tiles(problem: AttentionProblem, layouts: dict, aligned: bool,
                   num_splits: int | None) -> tuple[Tiling, DecodeShape, int]:
    """The tiles, shape and split count of a forward that ``forward_plan``
    decides: ``forward_tiling_for``'s kernel (persistent where
    ``wgmma_forward_persistent`` says, and its short-sequence tiles where
    ``wgmma_forward_for_call`` says),
    or where it is a tensor-core
    one on 16-bit inputs with at most ``DECODE_MAX_ROWS`` query rows per
    head (after ``decode_shape``'s packing) the decode tiles that fit the
    GPU's shared memory (the one-tile ones, else the 64-row ones; none: not
    decoding), split-KV by ``decode_splits`` unless ``num_splits`` is 1; on
    Hopper and later, a split count of ``DECODE_CLUSTER_SPLITS`` on the
    one-tile tiles runs as thread-block clusters merged in place
    (``decode_cluster_tiling``; without ``num_splits``, where
    ``decode_clusters_apply``), and the one-tile tiles copy K and V by the
    Tensor Memory Accelerator where ``_kv_tma_applies`` (with a deeper ring
    where ``decode_ring`` says).
    A ValueError where
    ``num_splits`` asks for splits such a call cannot have."""
    shape = decode_shape(problem, layouts)
    rows = shape.problem.seqlen_q
    chosen = forward_tiling_for(shape.problem, [shape.layouts[name] for name in ("q", "k", "v", "out")], aligned)
    decodes = (chosen.kernel in ("mma", "wgmma") and problem.dtype in MMA_DTYPES and rows <= DECODE_MAX_ROWS
               and not problem.packed)
    decode = _decode_tilings_that_fit(problem, rows) if decodes else None
    if decode is None:
        if num_splits not in (None, 1):
            raise ValueError(
                f"num_splits applies to decoding: float16/bfloat16 inputs on the tensor-core path with at most "
                f"{DECODE_MAX_ROWS} query rows per K/V head (seqlen_q, or with one query token the query heads "
                f"sharing a K/V head) and decode tiles that fit the GPU's shared memory; this call has {rows} "
                f"rows of {problem.dtype} on the {chosen.kernel} kernel, so leave num_splits=None")
        tiling = chosen
        if chosen.kernel == "wgmma":
            tiling = wgmma_forward_for_call(chosen, problem.dtype, problem.head_dim, problem.mask.name,
                                            problem.layout, problem.score.dropout, problem.seqlen_k)
        return tiling, DecodeShape(problem, layouts, problem.tensor_seqlen_q, False), 1
    plain, split = decode
    if split.warps_split_keys and _kv_tma_applies(problem, shape.layouts, split.block_n):
        plain, split = (dataclasses.replace(tiling, kv_tma=True) for tiling in (plain, split))
    splits = 1 if num_splits == 1 else decode_splits(shape.problem, split, num_splits)
    parallel, key_blocks = _decode_blocks(shape.problem, split)

    sms = _multiprocessor_count(problem.device)

    def ring(tiling: Tiling, ranges: int) -> Tiling:  # decode_ring for this launch of `ranges` key ranges
        return decode_ring(tiling, _page_size(problem), problem.dtype, parallel * ranges, -(-key_blocks // ranges),
                           sms, _shared_memory_per_block(problem.device))

    smallest = (decode_cluster_tiling(split, min(_tiling.DECODE_CLUSTER_SPLITS))
                if _tiling.DECODE_CLUSTER_SPLITS and _kernel_generation(problem.device) >= 90 else None)
    if splits == 1:
        # Past one wave, two clustered ranges where decode_tail_split says (by the cluster form's occupancy).
        pair = decode_cluster_tiling(split, 2) if smallest is not None and num_splits is None else None
        if pair is not None and decode_tail_split(parallel, sms, key_blocks,
                                                  lambda: _decode_blocks_per_sm(shape.problem, pair)):
            return pair, shape, 2
        return ring(plain, 1), shape, 1
    if smallest is not None:
        # The caller's count runs as clusters where it is a cluster's;
        # decode_cluster_count picks one where the heuristic's count is small.
        clusters = splits
        if num_splits is None:
            clusters = decode_cluster_count(parallel, sms, key_blocks, _decode_blocks_per_sm(shape.problem, smallest),
                                            splits) \
                if decode_clusters_apply(splits, key_blocks) else 1
        clustered = decode_cluster_tiling(split, clusters)
        if clustered is not None:
            return clustered, shape, clusters
    return ring(split, splits), shape, splits


def _page_size(problem: AttentionProblem) -> int | None:
    """A paged cache's rows a page; None for other layouts."""
    return problem.kv_cache.page_size if problem.layout == "paged" else None


def _kv_tma_applies(problem: AttentionProblem, layouts: dict, block_n: int) -> bool:
    """Whether a decode on the one-tile tiles (``block_n`` keys a block)
    copies K and V by the Tensor Memory Accelerator (``Tiling.kv_tma``): on
    Hopper and later, for a dense batch, a contiguous cache, or a paged one
    whose pages tile a key block (``copy_engine_box_rows``), where K and V
    can have tensor maps (``takes_layout``: no empty dimension, strides of
    multiples of 16 bytes)."""
    return (_kernel_generation(problem.device) >= 90 and problem.layout != "packed"
            and copy_engine_box_rows(block_n, _page_size(problem)) is not None
            and all(takes_layout(layouts[name].shape, layouts[name].strides) for name in ("k", "v")))


def _decode_blocks_per_sm(problem: AttentionProblem, tiling: Tiling) -> int:
    """Blocks of ``tiling``'s forward kernel (compiled for ``problem``) one
    SM holds at once, by the CUDA occupancy calculator."""
    import cupy
    from cupy_backends.cuda.api import driver

    variant = family_of("forward", tiling.kernel).variant(problem.dtype, tiling, problem.mask, problem.score,
                                                          layout=problem.layout)
    function = loader.get(variant, problem.device)
    with cupy.cuda.Device(problem.device):
        return int(driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, variant.threads,
                                                                    variant.smem_bytes))


def _decode_tilings_that_fit(problem: AttentionProblem, rows: int) -> tuple[Tiling, Tiling] | None:
    """The decode tiles (without and with split-KV) for ``rows`` query rows
    per K/V head that fit the GPU's shared memory: the one-tile ones, else
    the 64-row ones; None where neither does."""
    limit = _shared_memory_per_block(problem.device)
    for rows_of_tiles in (rows, DECODE_MAX_ROWS):
        tilings = decode_tilings(problem.dtype, problem.head_dim, rows_of_tiles)
        if limit is None or max(t.forward_smem_bytes(problem.dtype) for t in tilings) <= limit:
            return tilings
    return None


@dataclass(frozen=True)
class PlanParts:
    """What a ``LaunchPlan`` is made of (its constructor's arguments), for
    plans built from another's: a KV-cache call's is a forward's with the
    append kernel added."""

    structs: list
    slots: tuple
    launches: list
    tensor_maps: list = dataclasses.field(default_factory=list)
    work_buffers: dict = dataclasses.field(default_factory=dict)

    def plan(self, device: int) -> LaunchPlan:
        return LaunchPlan(device, self.structs, self.slots, self.launches, self.tensor_maps, self.work_buffers)


def forward_plan(problem: AttentionProblem, layouts: dict, aligned: bool, tiling: Tiling | None = None,
                 num_splits: int | None = None) -> LaunchPlan:
    """The launch plan of a validated forward: ``layouts`` of q, k, v and
    out, ``aligned`` whether their pointers will be 16-byte aligned. Pointer
    slots: ``FORWARD_SLOTS`` (``SPLIT_FORWARD_SLOTS`` with split-KV, whose
    work buffers ``plan.work_buffers`` names); the log-sum-exp is
    C-contiguous. ``tiling`` overrides the table (benchmarks of other tile
    sizes); by default ``forward_tiling_for`` decides, and a call of few
    query rows per K/V head runs as decoding (``decode_shape``; the decode
    tiles, split-KV by ``decode_splits`` unless ``num_splits`` is 1)."""
    return _forward_parts(problem, layouts, aligned, tiling, num_splits).plan(problem.device)


def _forward_parts(problem: AttentionProblem, layouts: dict, aligned: bool, tiling: Tiling | None = None,
                   num_splits: int | None = None) -> PlanParts:
    """``forward_plan``'s parts."""
    names = ("q", "k", "v", "out")
    # Of the call's lse, packed by decode_shape or not; a packed batch's is one entry.
    lse_batch_stride = problem.nheads * problem.tensor_seqlen_q
    shape, splits = DecodeShape(problem, layouts, problem.tensor_seqlen_q, False), 1
    if tiling is None and problem.is_empty:
        tiling = forward_tiling_for(problem, [layouts[name] for name in names], aligned)
    elif tiling is None:
        tiling, shape, splits = _forward_tiles(problem, layouts, aligned, num_splits)
    problem, layouts = shape.problem, shape.layouts
    if splits > 1 and tiling.cluster_splits == 1:
        return _split_forward_plan(problem, layouts, tiling, splits, lse_batch_stride, shape.lse_head_stride)
    # From here one launch writes out and lse: unsplit, or split-KV whose
    # ranges merge in their thread-block cluster (Tiling.cluster_splits).
    num_m_blocks = -(-problem.seqlen_q // tiling.block_m)
    launches = []
    if not problem.is_empty:
        variant = family_of("forward", tiling.kernel).variant(problem.dtype, tiling, problem.mask, problem.score,
                                                              layout=problem.layout)
        grid = _grid_size(num_m_blocks * splits, problem, problem.nheads, "the forward pass")
        if tiling.persistent:  # one block per resident slot, each walking the tiles gridDim.x apart
            grid = persistent_grid(grid, _multiprocessor_count(problem.device) * tiling.blocks_per_sm, num_m_blocks,
                                   problem.mask.later_rows_see_more)
        launches.append(KernelLaunch(loader.get(variant, problem.device), grid, variant.threads, variant.smem_bytes,
                                     dependent=_forward_launch_dependent(problem, tiling)))
    params = pack(
        _forward_params_struct(tiling),
        **{name: tensor_ref(layouts[name]) for name in names},
        lse=0,
        lse_batch_stride=lse_batch_stride,
        lse_head_stride=shape.lse_head_stride,
        size=_size_fields(problem),
        num_m_blocks=num_m_blocks,
        softmax_scale_log2=problem.softmax_scale * _LOG2E,
        kv_pair_maps=sum(1 << bit for bit, geometry in enumerate(_kv_pair_geometries(problem, layouts, tiling))
                         if geometry is not None),
        num_splits=splits,
        out_split_stride=0,
        lse_split_stride=0,
        variant=_variant_fields(problem, tiling),
    )
    tensor_maps = [] if problem.is_empty else _forward_tensor_maps(problem, layouts, tiling, params)
    return PlanParts([params], FORWARD_SLOTS, launches, tensor_maps)


def _forward_params_struct(tiling: Tiling):
    """The parameter struct of a forward launch: with tensor maps for the
    Hopper forward and for copy-engine K/V (``Tiling.kv_tma``)."""
    return WGMMA_FORWARD_PARAMS if tiling.kernel == "wgmma" or tiling.kv_tma else FORWARD_PARAMS


def _forward_tensor_maps(problem: AttentionProblem, layouts: dict, tiling: Tiling, params) -> list:
    """(pointer slot, encoder) of the tensor maps a forward reads and
    writes: the Hopper forward's of Q, K and V, and with persistent blocks
    of the output (one consumer's 64 rows a copy), copy-engine K/V's of K
    and V (one swizzle panel of block_m or block_n rows a copy), encoded in
    ``params`` for each call's pointers; none for the other forwards. The
    output takes a map wherever Q does: the Hopper forward runs only where
    q, k, v and out all have 16-byte aligned pointers and strides of whole
    16-byte chunks (``forward_tiling_for``)."""
    kv_rows = copy_engine_box_rows(tiling.block_n, _page_size(problem)) if tiling.kv_tma else tiling.block_n
    rows = {"q": tiling.block_m, "k": kv_rows, "v": kv_rows, "out": 64}
    names = ("q", "k", "v") if tiling.kernel == "wgmma" else ("k", "v") if tiling.kv_tma else ()
    if tiling.kernel == "wgmma" and tiling.persistent:
        names += ("out",)
    maps = []
    for name in names:
        layout = layouts[name]
        address = params.ctypes.data + params.dtype.fields[f"{name}_map"][1]
        box = TileBox(rows=rows[name], cols=tiling.head_dim_padded)
        maps.append((f"{name}.ptr", TensorMapEncoder(address, problem.dtype, layout.shape, layout.strides, box)))
    for name, geometry in zip(("k", "v"), _kv_pair_geometries(problem, layouts, tiling)):
        if geometry is None:
            continue
        shape, strides, odd_offset = geometry
        box = TileBox(rows=rows[name], cols=tiling.head_dim_padded)
        for parity, offset in enumerate((0, odd_offset)):
            address = params.ctypes.data + params.dtype.fields[f"{name}_pair_map{parity}"][1]
            maps.append((f"{name}.ptr", TensorMapEncoder(address, problem.dtype, shape, strides, box, offset=offset)))
    return maps


def _kv_pair_geometries(problem: AttentionProblem, layouts: dict, tiling: Tiling) -> tuple:
    """K's and V's head-pair map geometries (``head_pair_geometry``) for the
    Hopper forward, None for a tensor without them (and for every other
    forward)."""
    if tiling.kernel != "wgmma" or problem.is_empty:
        return None, None
    return tuple(head_pair_geometry(layouts[name].shape, layouts[name].strides, layouts[name].itemsize,
                                    tiling.head_dim_padded) for name in ("k", "v"))


def _split_forward_plan(problem: AttentionProblem, layouts: dict, tiling: Tiling, splits: int,
                        lse_batch_stride: int, lse_head_stride: int) -> PlanParts:
    """Split-KV: the decode forward writes each key range's float32 output
    and log-sum-exp to the work buffers, and the merge kernel combines them
    into out and lse (``problem`` and ``layouts`` as the kernels see them)."""
    buffers = forward_work_buffers(problem, splits)
    partial = Layout.contiguous(buffers["out_partial"][0][1:], "float32")
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.head_dim
    num_m_blocks = -(-sq // tiling.block_m)
    variant = family_of("forward", tiling.kernel).variant(problem.dtype, tiling, problem.mask, problem.score,
                                                          layout=problem.layout)
    grid = _grid_size(num_m_blocks * splits, problem, h, "the forward pass")
    forward = pack(
        _forward_params_struct(tiling),
        **{name: tensor_ref(layouts[name]) for name in ("q", "k", "v")},
        out=tensor_ref(partial),
        lse=0,
        lse_batch_stride=h * sq,
        lse_head_stride=sq,
        size=_size_fields(problem),
        num_m_blocks=num_m_blocks,
        softmax_scale_log2=problem.softmax_scale * _LOG2E,
        kv_pair_maps=0,
        num_splits=splits,
        out_split_stride=b * sq * h * d,
        lse_split_stride=b * h * sq,
        variant=_variant_fields(problem, tiling),
    )
    merge_params, merge = _merge_launch(
        problem.device, "float32", problem.dtype, splits, _size_fields(problem), out=tensor_ref(layouts["out"]),
        lse_strides=(lse_batch_stride, lse_head_stride, 1), partial=tensor_ref(partial),
        partial_state_stride=b * sq * h * d, partial_lse_strides=(b * h * sq, h * sq, sq, 1),
        vector=4 if d % 4 == 0 else 1, struct=1)  # float32 partials: 16-byte loads (the work buffer is aligned)
    # On Hopper the merge is a dependent launch: scheduled once the forward's
    # blocks have exited, its launch latency overlaps the forward's completion.
    merge = dataclasses.replace(merge, dependent=_kernel_generation(problem.device) >= 90)
    launches = [KernelLaunch(loader.get(variant, problem.device), grid, variant.threads, variant.smem_bytes, 0,
                             dependent=_forward_launch_dependent(problem, tiling)), merge]
    return PlanParts([forward, merge_params], SPLIT_FORWARD_SLOTS, launches,
                     _forward_tensor_maps(problem, layouts, tiling, forward), buffers)


def _forward_launch_dependent(problem: AttentionProblem, tiling: Tiling) -> bool:
    """Whether a forward on ``tiling`` is launched as a dependent of the
    kernel ahead of it on the stream (``KernelLaunch.dependent``): the
    mma.sync forward on Hopper, whose blocks wait for that kernel before
    any global access (flash_fwd_mma.cu). It is then scheduled once the
    blocks of the kernel before it have exited, not after that kernel has
    completed and flushed its writes."""
    return tiling.kernel == "mma" and _kernel_generation(problem.device) >= 90


def backward_tiling_for(problem: AttentionProblem, views: dict, grads: dict, deterministic: bool,
                        aligned: bool | None = None) -> Tiling:
    """The dK/dV kernel a backward runs on: the first dK/dV family that
    applies, the Hopper (wgmma) kernel where the dtype, head dim, device and
    mode allow and q, k, v, dout, dk and dv have 16-byte aligned rows
    (cp.async copies in, 16-byte stores out); the SIMT kernel otherwise.
    ``views``/``grads``: CuPy views or ``Layout``s; ``aligned`` as for
    ``forward_tiling_for``."""
    arrays = [views[name] for name in ("q", "k", "v", "dout")] + [grads[name] for name in ("dk", "dv")]
    if aligned is None:
        aligned = _pointers_aligned(arrays)
    return select("backward-dkdv", problem.dtype, problem.head_dim, _kernel_generation(problem.device),
                  aligned_rows=aligned and all(map(_rows_are_16_byte_chunks, _as_layouts(arrays))),
                  deterministic=deterministic, smem_limit=_shared_memory_per_block(problem.device))


def stores_first_dq(problem: AttentionProblem, tiling: Tiling, dq_mode: str) -> bool:
    """Whether a backward on the dK/dV kernel of ``tiling`` runs it in the
    claimed dQ mode (``runs_claimed_dq``): the first dQ tile of each query
    block is written over the float32 accumulator and the others are added
    once it has landed (kernels_cu/ordered_accumulation.cuh's first stores).
    Then no pass zeroes the accumulator (134 MB on the FlashAttention-2 grid
    at head dim 128: the preprocessing takes 56 us instead of 95 on an H100),
    the counters mark the blocks written, and the conversion writes zeros
    for the others.

    Not measured faster elsewhere (docs/perf-notes.md): where all walks
    start on one query block (fewer queries than keys) all but the first
    key block wait for its store at every step (4-16% slower), and without
    a mask the dK/dV kernel took 3-4% longer at head dim 128, as much as the
    preprocessing saved (measured again with the store warp, rotated walks
    and a bound that never waits: the waits are about a sixth of it, the
    rest not located), and above head dim 128 (split between the consumers)
    adding into zeros measured 8-14% faster (``claimed_dq_applies``)."""
    return runs_claimed_dq(tiling.kernel, dq_mode, problem.mask, problem.layout, problem.seqlen_q, problem.seqlen_k,
                           tiling.head_dim_padded)


def stores_dq_directly(problem: AttentionProblem, layouts: dict, tiling: Tiling, dq_aligned: bool,
                       out_aligned: bool) -> bool:
    """Whether a backward on the dK/dV kernel of ``tiling`` runs it in the
    direct dQ mode (``runs_direct_dq``: one key block, which stores dQ in
    the input dtype through a tensor map of dq and, where
    ``wgmma_direct_computes_delta``, computes delta from the output's tiles,
    read through a map of out). ``dq_aligned`` / ``out_aligned``: dq's / out's
    pointers will be 16-byte aligned; dq's layout, and out's where the
    kernel maps it, must take a tensor map (``layouts``). Where the kernel
    does not compute delta (head dim 192) out is read by the preprocessing
    kernel alone, so its alignment and layout do not matter. Then the
    backward is the dK/dV kernel alone, with no work buffer (head dim 192:
    the preprocessing kernel before it, and delta): on small problems two
    launches and an allocation fewer, and the float32 accumulator's and
    delta's traffic gone."""
    if not runs_direct_dq(tiling.kernel, problem.mask, problem.layout, problem.seqlen_q, problem.seqlen_k,
                          tiling.block_n, dq_aligned):
        return False
    maps_out = wgmma_direct_computes_delta(tiling)
    if maps_out and not out_aligned:
        return False
    mapped = ("dq", "out") if maps_out else ("dq",)
    return all(takes_layout(layouts[name].shape, layouts[name].strides) for name in mapped)


def backward_work_buffers(b: int, h: int, sq: int, d: int, tiling: Tiling | None, deterministic: bool,
                          total_q: int | None = None, packed: bool = False, direct: bool = False) -> dict:
    """The work buffers a backward (batch b, h query heads, seqlen_q sq,
    head_dim d; ``total_q`` the query rows of a packed batch, b * sq by
    default) on the dK/dV kernel of ``tiling`` needs, name -> (shape, dtype),
    all contiguous (params.cuh): delta (h, total_q); the float32 dQ
    accumulator (total_q, h, d) unless the deterministic dQ pass computes
    dQ; the int32 counters (b, h, query blocks) of the ordered mode and,
    for the Hopper kernel's atomic mode on dense batches, of first stores
    (``stores_first_dq``, which the plan decides from the mask; a few KB,
    zeroed either way); ``direct`` (``stores_dq_directly``): delta alone,
    and none where the dK/dV kernel computes it (``wgmma_direct_computes_delta``).
    ``tiling`` None: every buffer any dK/dV kernel could need (JAX decides
    its buffers before the kernel is known), the counters for the smallest
    query block of any kernel that counts."""
    rows = b * sq if total_q is None else total_q
    buffers = {"delta": ((h, rows), "float32")}
    if direct:
        return {} if tiling is not None and wgmma_direct_computes_delta(tiling) else buffers
    if tiling is None:
        block_m = min(t.block_m for family in FAMILIES if "ordered" in family.dq_modes
                      for _, t in family.compiled_tilings())
        return buffers | {"dq_accum": ((rows, h, d), "float32"),
                          "dq_semaphore": ((b, h, -(-sq // block_m)), "int32")}
    family = family_of("backward-dkdv", tiling.kernel)
    mode = family.dq_mode(deterministic)
    if mode != "separate":
        buffers["dq_accum"] = ((rows, h, d), "float32")
    if mode == "ordered" or (mode == "atomic" and "claimed" in family.dq_modes and not packed):
        buffers["dq_semaphore"] = ((b, h, -(-sq // tiling.block_m)), "int32")
    return buffers


@functools.lru_cache(maxsize=None)
def _device_properties(device_id: int) -> dict:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)


def _multiprocessor_count(device_id: int) -> int:
    return int(_device_properties(device_id)["multiProcessorCount"])


def _shared_memory_per_block(device_id: int) -> int | None:
    """The shared memory a block may opt in to on ``device_id`` (227 KiB on
    Hopper, 163 KiB on an A100, 99 KiB on sm_86/sm_89); None where CuPy does
    not say. Families whose tiles need more are not picked there."""
    limit = _device_properties(device_id).get("sharedMemPerBlockOptin")
    return int(limit) if limit else None


def rotate_walks(problem: AttentionProblem, dq_mode: str, kernel: str, num_m_blocks: int,
                 num_n_blocks: int, multiprocessors: int) -> bool:
    """Whether a backward rotates the key blocks' walks (key block j starts
    on query block j: ``walk_rotation`` in kernels_cu/backward_steps.cuh),
    for a mask that allows it (``dq_turns == "rotated"``: no mask) and with
    at least as many query blocks as key blocks (each key block starts on its
    own query block).

    Ordered dQ (``dq_turn``): only where one head's key blocks fit on the GPU
    at once, counted as one block per multiprocessor whatever the occupancy:
    the first key block's turns wait for the last key block, so all of them
    must be running. Past that the walks all start on the first query block
    and key block j waits there for the j before it (a chain at the start:
    slower, never stuck).

    Atomic dQ on Hopper (``kernel == "wgmma"``): always. Walks that all start
    on one query block add into the same dQ rows at the same time; spread
    over the query blocks the backward took 3-4% less time without a mask on
    an H100 (head dims 64-256, docs/perf-notes.md). The mma.sync and SIMT
    kernels were not measured so and keep their walks."""
    if problem.mask.dq_turns != "rotated" or num_m_blocks < num_n_blocks or problem.packed:
        return False  # a packed batch's block counts are its longest sequence's, not each one's
    if dq_mode == "ordered":
        return num_n_blocks <= multiprocessors
    return dq_mode == "atomic" and kernel == "wgmma"


def backward_plan(problem: AttentionProblem, layouts: dict, lse: Layout, deterministic: bool,
                  aligned: bool, tiling: Tiling | None = None, dq_aligned: bool = True,
                  out_aligned: bool = True) -> LaunchPlan:
    """The launch plan of a validated backward: preprocess (delta, the dQ
    accumulator zeroed unless ``stores_first_dq``, the counters), dK/dV (dQ
    added with atomics, the first tile of each block stored where
    ``stores_first_dq``; added in a fixed order (dq_turn); or left to the
    deterministic dQ pass), then dQ conversion; where ``stores_dq_directly``
    (``dq_aligned``, ``out_aligned``: dq's, out's pointers will be 16-byte
    aligned, as the allocators align dq), dK/dV alone, which computes delta
    (``wgmma_direct_computes_delta``; else preprocess first) and stores dQ
    itself (the plan then writes no accumulator or counter pointers, nor
    delta's where the kernel computes it: a caller that has those buffers
    anyway, JAX, does not have them touched). ``layouts`` of dout, q,
    k, v, out, dq, dk, dv; ``lse``'s layout; ``aligned`` whether the
    pointers of dout, q, k, v, dk and dv will be 16-byte aligned; ``tiling``
    the dK/dV kernel's (``backward_tiling_for`` decides where not given).
    Pointer slots: ``BACKWARD_SLOTS``, the work buffers of
    ``backward_work_buffers`` (0 for the others)."""
    dkdv_tiling = tiling or backward_tiling_for(problem, layouts, layouts, deterministic, aligned)
    dkdv_family = family_of("backward-dkdv", dkdv_tiling.kernel)
    dq_mode = dkdv_family.dq_mode(deterministic)
    dq_family = FAMILY["backward-dq"]
    dq_tiling = dq_family.tiles(problem.dtype, problem.head_dim)
    rows = problem.total_q * problem.nheads
    num_m_blocks = -(-problem.seqlen_q // dkdv_tiling.block_m)
    num_n_blocks = -(-problem.seqlen_k // dkdv_tiling.block_n)
    rotated = rotate_walks(problem, dq_mode, dkdv_tiling.kernel, num_m_blocks, num_n_blocks,
                           _multiprocessor_count(problem.device))
    direct = stores_dq_directly(problem, layouts, dkdv_tiling, dq_aligned, out_aligned)
    delta_in_kernel = direct and wgmma_direct_computes_delta(dkdv_tiling)
    claimed = not direct and stores_first_dq(problem, dkdv_tiling, dq_mode)
    fields = dict(
        **{name: tensor_ref(layouts[name]) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")},
        lse=0,
        lse_batch_stride=lse.strides[0] // lse.itemsize,
        lse_head_stride=lse.strides[1] // lse.itemsize,
        delta=0,
        dq_accum=0,
        dq_semaphore=0,
        size=_size_fields(problem),
        num_m_blocks=num_m_blocks,
        num_n_blocks=num_n_blocks,
        rotate_walks=int(rotated),
        dq_block_m=dkdv_tiling.block_m if claimed else 0,
        softmax_scale_log2=problem.softmax_scale * _LOG2E,
        softmax_scale=problem.softmax_scale,
        variant=_variant_fields(problem, dkdv_tiling),
    )
    hopper = dkdv_tiling.kernel == "wgmma"
    # The element-wise kernels take the BackwardParams at the start of the
    # Hopper kernel's struct.
    structs = [pack(WGMMA_BACKWARD_PARAMS if hopper else BACKWARD_PARAMS, **fields)]
    unwritten = (("dq_accum", "dq_semaphore") if direct else ()) + (("delta",) if delta_in_kernel else ())
    slots = tuple(() if slot in unwritten else slot for slot in BACKWARD_SLOTS)
    device = problem.device
    launches = []

    def elementwise(family: str, work: int):
        variant = FAMILY[family].variant(problem.dtype)
        blocks = max(1, min(_ELEMENTWISE_BLOCKS, -(-work // variant.threads)))
        launches.append(KernelLaunch(loader.get(variant, device), blocks, variant.threads, 0))

    if rows and not delta_in_kernel:
        elementwise("backward-preprocess", rows * 32)  # one warp per query row
    grid = _grid_size(num_n_blocks, problem, problem.nheads_k, "the backward dK/dV pass")
    if grid:  # with seqlen_q == 0 this still runs, and writes dk = dv = 0
        mode = "direct" if direct else "claimed" if claimed else dq_mode
        variant = dkdv_family.variant(problem.dtype, dkdv_tiling, problem.mask, problem.score, mode,
                                      layout=problem.layout)
        launches.append(KernelLaunch(loader.get(variant, device), grid, variant.threads, variant.smem_bytes))
    if rows and dq_mode == "separate":
        # The dQ pass has the forward's tiles; its grid is over those query
        # blocks, so it takes a second struct with that block count.
        fields["num_m_blocks"] = -(-problem.seqlen_q // dq_tiling.block_m)
        structs.append(pack(BACKWARD_PARAMS, **fields))
        variant = dq_family.variant(problem.dtype, dq_tiling, problem.mask, problem.score, layout=problem.layout)
        grid = _grid_size(fields["num_m_blocks"], problem, problem.nheads, "the backward dQ pass")
        launches.append(KernelLaunch(loader.get(variant, device), grid, variant.threads, variant.smem_bytes,
                                     struct=1))
    elif rows and not direct:
        elementwise("backward-convert-dq", rows * 32)  # one warp per query row
    tensor_maps = (_wgmma_backward_maps(problem, layouts, dkdv_tiling, structs[0], direct, delta_in_kernel)
                   if hopper and rows and grid else [])
    return LaunchPlan(device, structs, slots, launches, tensor_maps)


def _wgmma_backward_maps(problem: AttentionProblem, layouts: dict, tiling: Tiling, struct, direct: bool,
                         delta_in_kernel: bool) -> list:
    """(slot, encoder) of the Hopper backward's tensor maps in ``struct``: Q
    and dO by blocks of block_m rows, K and V of block_n, in the kernel's
    swizzles (``wgmma_backward_swizzles``), and the float32 dQ accumulator
    (contiguous (total_q, heads, head_dim), seen like q) in 32-column boxes of
    block_m rows, 128-byte swizzle, into which the kernel adds its dQ tiles;
    ``direct`` (``stores_dq_directly``): dq itself in Q's boxes instead, into
    which the kernel stores them; ``delta_in_kernel``
    (``wgmma_direct_computes_delta``): out too, in Q's boxes, from which it
    computes delta."""
    q_swizzle, kv_swizzle = wgmma_backward_swizzles(tiling)
    d = tiling.head_dim_padded
    maps = []

    def add(slot: str, field: str, dtype_name: str, shape, strides, box: TileBox):
        address = struct.ctypes.data + struct.dtype.fields[field][1]
        maps.append((slot, TensorMapEncoder(address, dtype_name, shape, strides, box)))

    for name, field, rows, swizzle in (("q", "q_map", tiling.block_m, q_swizzle),
                                       ("dout", "do_map", tiling.block_m, q_swizzle),
                                       ("k", "k_map", tiling.block_n, kv_swizzle),
                                       ("v", "v_map", tiling.block_n, kv_swizzle)):
        layout = layouts[name]
        add(f"{name}.ptr", field, problem.dtype, layout.shape, layout.strides,
            TileBox(rows=rows, cols=d, swizzle_width=swizzle))
    if direct:
        for name, field in (("dq", "dq_map"), ("out", "o_map"))[:2 if delta_in_kernel else 1]:
            layout = layouts[name]
            add(f"{name}.ptr", field, problem.dtype, layout.shape, layout.strides,
                TileBox(rows=tiling.block_m, cols=d, swizzle_width=q_swizzle))
        return maps
    shape = (*layouts["q"].shape[:2], problem.nheads, problem.head_dim)
    add("dq_accum", "dq_map", "float32", shape, tuple(4 * stride for stride in contiguous_strides(shape)),
        TileBox(rows=tiling.block_m, cols=d, swizzle_width=128, element_bytes=4))
    return maps
