"""The one registry of kernel families: which kernels exist, what each is
compiled from, where it runs, its tiles and shared memory, and when the
launcher picks it.

A family is one ``__global__`` template in ``kernels_cu/``; a variant is one
instantiation of it (element type, tiles, mask and score-transform
policies, and family-specific arguments), compiled on first use by
``cuflash._loader``. The launcher (``cuflash.api``), the IO simulator, the
NumPy emulation of the tiled algorithm and ``tools/kernel_report.py`` read
these entries; nothing else lists kernels. Adding a family is one entry in
``FAMILIES`` (and its kernel file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ._masks import BATCH_LAYOUTS, CACHE_LAYOUTS, SCORE_TRANSFORMS, MaskPolicy, ScoreTransform
from ._tiling import (
    ELEMENT_SIZE,
    HEAD_DIM_BUCKETS,
    MMA_DTYPES,
    MMA_BACKWARD_TILES,
    MMA_3XTF32_DTYPE,
    MMA_FORWARD_TILES,
    WGMMA_BACKWARD_TILES,
    WGMMA_FORWARD_TILES,
    Tiling,
    backward_splits_head_dim,
    backward_tiling,
    copy_engine_layouts,
    every_decode_tiling,
    forward_tiling,
    mma_backward_applies,
    mma_backward_tiling,
    mma_backward_99kib_tiling,
    mma_forward_applies,
    mma_forward_hopper_tiling,
    mma_forward_tiling,
    wgmma_backward_applies,
    wgmma_forward_applies,
    wgmma_forward_persistent_form,
    wgmma_backward_tiling,
    wgmma_forward_short_tiles,
    wgmma_forward_tiling,
)

#: C++ storage type of each supported dtype.
CXX_ELEMENT_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}

#: Threads per block of the element-wise backward kernels (preprocess, dQ conversion).
ELEMENTWISE_WARPS = 8

_IDENTITY = SCORE_TRANSFORMS["identity"]

#: Compute capabilities a family's ``arch`` needs ("sm_90a": Hopper's own
#: instructions, built only where NVRTC can, see cuflash.api._kernel_generation).
_ARCH_CAPABILITY = {"sm_80": 80, "sm_90a": 90}


@dataclass(frozen=True)
class KernelVariant:
    """One template instantiation of one kernel."""

    source: str  #: file under kernels_cu/ that defines the kernel
    function: str  #: qualified C++ name of the kernel template
    params: str  #: C++ parameter struct the kernel takes by value (with its qualifier, if any)
    template_args: tuple[str, ...]
    key: str  #: readable cache key, unique per instantiation
    threads: int
    smem_bytes: int
    #: C++ compiled after the kernel's source: generated policies (a user
    #: score function's, a user mask's rule: cuflash/mods.py), else empty
    prelude: str = ""
    #: blocks per thread-block cluster, fixed at compile time by the
    #: kernel's __cluster_dims__ (Hopper on); 1: no clusters
    cluster_blocks: int = 1

    @property
    def name_expression(self) -> str:
        return f"{self.function}<{', '.join(self.template_args)}>" if self.template_args else self.function


@dataclass(frozen=True)
class KernelFamily:
    """A kernel template and the facts the Python side needs of it."""

    name: str  #: prefix of its variants' keys
    role: str  #: "forward", "backward-dkdv", "backward-dq" or "backward-elementwise"
    source: str
    function: str
    params: str
    #: the build target it needs: "any" (SIMT, every CUDA GPU cuflash
    #: supports), "sm_80" (mma.sync), "sm_90a" (wgmma; Hopper only)
    arch: str
    #: the ``Tiling.kernel`` its tilings carry ("simt", "mma", "wgmma");
    #: None for the element-wise kernels, which have no tiles
    kernel: str | None
    dtypes: tuple[str, ...]
    #: head-dim buckets it is compiled for
    head_dims: tuple[int, ...]
    #: (dtype, head_dim) -> its tiles
    tiles: Callable[[str, int], Tiling] | None
    #: (tiling, dtype) -> dynamic shared memory of a launch (a family with
    #: dQ modes: (tiling, dtype, dQ mode), a mode's layout may differ)
    smem_bytes: Callable[[Tiling, str], int] | None
    #: whether (dtype, head_dim) is one it serves (beyond dtypes and head_dims)
    serves: Callable[[str, int], bool]
    #: needs 16-byte aligned rows and pointers (cp.async / 16-byte stores)
    needs_aligned_rows: bool = False
    #: needs softmax_scale > 0 (the online softmax takes the max of unscaled scores)
    needs_positive_scale: bool = False
    #: dtypes it takes only when the call opts in to 3xTF32 (float32 on
    #: tensor cores, ``fp32_precision="3xtf32"``); the exact float32 path
    #: is the default
    tf32x3_dtypes: tuple[str, ...] = ()
    #: dQ modes of a dK/dV family, each with the value of its last template
    #: argument: "atomic" (float32 atomics: fast, not bitwise repeatable),
    #: "ordered" (the key blocks add in turn, in order: deterministic),
    #: "claimed" (atomic, the first tile of each query block stored over an
    #: unzeroed accumulator: ``cuflash.api.stores_first_dq``), "direct" (the
    #: only key block of its query blocks stores dQ in the input dtype:
    #: ``runs_direct_dq``), "separate" (no dQ here: the deterministic dQ pass
    #: follows)
    dq_modes: dict[str, str] = field(default_factory=dict)
    #: tiling -> (template arguments after Mask and Score, key suffix) of the
    #: tile choices beyond the common ones (K/V or Q/dO buffers, blocks per SM)
    tile_args: Callable[[Tiling], tuple[tuple[str, ...], str]] = lambda tiling: ((), "")
    #: (dtype, head_dim) -> its tiles on Hopper where they differ from
    #: ``tiles`` (more shared memory per block than an A100's), else None
    hopper_tiles: Callable[[str, int], Tiling | None] = lambda dtype_name, head_dim: None
    #: (dtype, head_dim) -> its tiles on GPUs with 99 KiB of shared memory
    #: per block (sm_86, sm_89) where ``tiles``' need more, else None
    small_smem_tiles: Callable[[str, int], Tiling | None] = lambda dtype_name, head_dim: None
    #: (dtype, head_dim) -> tiles the launcher may pick for some calls
    #: beside ``tiles`` (the mma.sync forward's decode tiles)
    other_tiles: Callable[[str, int], tuple[Tiling, ...]] = lambda dtype_name, head_dim: ()
    #: (dtype, head_dim) -> its tiles for short sequences (``WGMMA_FORWARD_SHORT_TILES``)
    short_tiles: Callable[[str, int], tuple[Tiling, ...]] = lambda dtype_name, head_dim: ()
    #: the persistent form of a tiling, where the family has one (the Hopper
    #: forward's, for calls without a mask or causal on dense batches)
    persistent_form: Callable[[str, Tiling], Tiling | None] = lambda dtype_name, tiling: None
    #: dtypes it is also built for in the KV-cache batch layouts
    #: (``CACHE_LAYOUTS``: a contiguous or paged cache), every tiling
    cache_dtypes: tuple[str, ...] = ()
    #: tiling -> (function, params) of the entry point a tiling runs on,
    #: for a family with more than one (the mma.sync forward's thread-block
    #: cluster and copy-engine ones, Hopper only: ``Tiling.cluster_splits``,
    #: ``Tiling.kv_tma``), or None where the family has no entry for it;
    #: unset: ``function`` and ``params`` for tilings without either
    entry_points: Callable[[Tiling], tuple[str, str] | None] | None = None

    def dq_mode(self, deterministic: bool) -> str:
        """The mode a call runs this family in: atomic, or its deterministic one."""
        if not deterministic:
            return "atomic"
        return next(mode for mode in ("ordered", "separate") if mode in self.dq_modes)

    def runs_on(self, generation: int) -> bool:
        """Whether a device of this kernel generation (``cuflash.api._kernel_generation``) runs it."""
        if self.arch == "any":
            return True
        if self.arch == "sm_90a":
            return generation == 90
        return generation >= _ARCH_CAPABILITY[self.arch]

    def why_not(self, dtype_name: str, head_dim: int, generation: int, *, aligned_rows: bool = True,
                positive_scale: bool = True, deterministic: bool = False, tf32x3: bool = False,
                smem_limit: int | None = None) -> str | None:
        """Why the launcher may not pick this family for such a call (None: it may)."""
        if dtype_name not in self.dtypes:
            return f"takes {'/'.join(self.dtypes)}"
        if dtype_name in self.tf32x3_dtypes and not tf32x3:
            return f"takes {dtype_name} only with fp32_precision='3xtf32'"
        if not self.serves(dtype_name, head_dim):
            if self.tiles is not None and self.head_dims != HEAD_DIM_BUCKETS:
                return f"built for head dims {'/'.join(map(str, self.head_dims))} (multiples of 8 up to them)"
            return f"does not serve head_dim {head_dim}"
        if not self.runs_on(generation):
            return {"sm_90a": "needs Hopper (sm_90a) and NVRTC 12.9+", "sm_80": "needs sm_80 or newer"}[self.arch]
        if smem_limit is not None and self.tiles is not None:
            needed = self.smem_bytes(self.tiles_on(dtype_name, head_dim, generation, smem_limit), dtype_name)
            if needed > smem_limit:
                return f"needs {needed} bytes of shared memory per block, the GPU gives {smem_limit}"
        if self.needs_aligned_rows and not aligned_rows:
            return "needs 16-byte aligned rows"
        if self.needs_positive_scale and not positive_scale:
            return "needs softmax_scale > 0"
        wanted = ("ordered", "separate") if deterministic else ("atomic",)
        if self.dq_modes and not any(mode in self.dq_modes for mode in wanted):
            return f"has no {'deterministic' if deterministic else 'atomic'} dQ mode"
        return None

    def applies(self, dtype_name: str, head_dim: int, generation: int, **conditions) -> bool:
        """Whether the launcher may pick this family for such a call (conditions: aligned_rows,
        positive_scale, deterministic, tf32x3, smem_limit: the GPU's shared memory per block, None
        where unknown)."""
        return self.why_not(dtype_name, head_dim, generation, **conditions) is None

    def variant(self, dtype_name: str, tiling: Tiling | None = None, mask: MaskPolicy | None = None,
                score: ScoreTransform = _IDENTITY, dq_mode: str = "atomic", layout: str = "dense") -> KernelVariant:
        """The instantiation for these compile-time choices (``layout``: a
        batch layout of ``BATCH_LAYOUTS``; the KV-cache ones where the family
        has them for the dtype)."""
        if layout in CACHE_LAYOUTS and dtype_name not in self.cache_dtypes:
            raise ValueError(f"{self.name} is not built for a {layout} KV cache of {dtype_name}")
        if self.role in _OWN_VARIANTS:
            raise ValueError(f"{self.name}'s variants come from {_OWN_VARIANTS[self.role]}")
        if self.tiles is None:  # element-wise: no tiles, no policies
            return KernelVariant(
                source=self.source, function=self.function, params=self.params,
                template_args=(CXX_ELEMENT_TYPE[dtype_name], str(ELEMENTWISE_WARPS)),
                key=f"{self.name}/{dtype_name}/w{ELEMENTWISE_WARPS}", threads=32 * ELEMENTWISE_WARPS, smem_bytes=0)
        if tiling.kernel != self.kernel:
            raise ValueError(f"{self.name} takes {self.kernel} tilings, got {tiling}")
        entry = (self.entry_points(tiling) if self.entry_points is not None
                 else None if tiling.cluster_splits > 1 or tiling.kv_tma else (self.function, self.params))
        if entry is None:
            raise ValueError(f"{self.name} has no entry point for {tiling}")
        if tiling.kv_tma and layout not in copy_engine_layouts(tiling):
            raise ValueError(f"copy-engine K/V tiles {tiling} are built for {'/'.join(copy_engine_layouts(tiling))} "
                             f"batches, not {layout}")
        extra_args, extra_key = self.tile_args(tiling)
        if self.dq_modes:
            if dq_mode not in self.dq_modes:
                raise ValueError(f"{self.name} has no {dq_mode} dQ mode (it has {list(self.dq_modes)})")
            extra_args += (self.dq_modes[dq_mode],)
            extra_key += "" if dq_mode == "separate" else f"/{dq_mode}-dq"
        return KernelVariant(
            source=self.source,
            function=entry[0],
            params=entry[1],
            template_args=(
                CXX_ELEMENT_TYPE[dtype_name], str(tiling.head_dim_padded), str(tiling.block_m), str(tiling.block_n),
                str(tiling.warps), mask.cxx, score.cxx_for(dtype_name), BATCH_LAYOUTS[layout], *extra_args,
            ),
            key=(f"{self.name}/{dtype_name}/hdim{tiling.head_dim_padded}"
                 f"/m{tiling.block_m}n{tiling.block_n}w{tiling.warps}/{mask.name}"
                 f"{'' if score.name == 'identity' else '/' + score.name}{'' if layout == 'dense' else '/' + layout}"
                 f"{extra_key}"),
            threads=tiling.threads,
            smem_bytes=(self.smem_bytes(tiling, dtype_name, dq_mode) if self.dq_modes
                        else self.smem_bytes(tiling, dtype_name)),
            prelude=score.prelude + mask.prelude,
            cluster_blocks=tiling.cluster_splits,
        )

    def tiles_on(self, dtype_name: str, head_dim: int, generation: int, smem_limit: int | None = None) -> Tiling:
        """Its tiles for (dtype, head_dim) on a device of this kernel
        generation giving a block ``smem_limit`` bytes of shared memory
        (None: unknown, as much as the tiles need)."""
        hopper = self.hopper_tiles(dtype_name, head_dim) if generation == 90 else None
        tiling = hopper or self.tiles(dtype_name, head_dim)
        if smem_limit is not None and self.smem_bytes(tiling, dtype_name) > smem_limit:
            return self.small_smem_tiles(dtype_name, head_dim) or tiling
        return tiling

    def compiled_tilings(self, other_tiles: bool = True) -> list[tuple[str, Tiling]]:
        """(dtype, tiling) of every tile choice it is compiled for, the Hopper
        and small-shared-memory tiles included: each head dim it serves is
        asked, as a table may pick tiles by head dim within a bucket
        (``WGMMA_FORWARD_PARTIAL_SECTOR_TILES``). Buckets' tiles first;
        ``other_tiles`` (the decode tiles, dense batches only) last."""
        head_dims = [*self.head_dims, *range(1, max(self.head_dims) + 1)]
        tilings = [(dtype, self.tiles(dtype, head_dim)) for dtype in self.dtypes for head_dim in head_dims
                   if self.serves(dtype, head_dim)]
        tilings += [(dtype, other) for dtype in self.dtypes for head_dim in self.head_dims
                    for choose in (self.hopper_tiles, self.small_smem_tiles)
                    if (other := choose(dtype, head_dim)) is not None]
        tilings += [(dtype, short) for dtype in self.dtypes for head_dim in head_dims
                    if self.serves(dtype, head_dim) for short in self.short_tiles(dtype, head_dim)]
        tilings += [(dtype, persistent) for dtype, tiling in tilings
                    if (persistent := self.persistent_form(dtype, tiling)) is not None]
        if other_tiles:
            tilings += [(dtype, other) for dtype in self.dtypes for head_dim in self.head_dims
                        for other in self.other_tiles(dtype, head_dim)]
        return list(dict.fromkeys(tilings))


def _any_head_dim(dtype_name: str, head_dim: int) -> bool:
    return 0 < head_dim <= HEAD_DIM_BUCKETS[-1]


_ALL_DTYPES = tuple(ELEMENT_SIZE)


def _mma_forward_tile_args(tiling: Tiling) -> tuple[tuple[str, ...], str]:
    """The mma.sync forward's template arguments after Batch, and key
    suffix: K/V buffers, split-KV, warps splitting the keys; the cluster
    entry's take the cluster's split count instead of the split-KV flag."""
    def flag(value: bool) -> str:
        return "true" if value else "false"

    key = (f"/kv{tiling.kv_stages}" + ("/split" if tiling.split_kv else "")
           + ("/split-keys" if tiling.warps_split_keys else "") + ("/tma" if tiling.kv_tma else ""))
    if tiling.cluster_splits > 1:
        return ((str(tiling.kv_stages), flag(tiling.warps_split_keys), str(tiling.cluster_splits)),
                f"{key}/cluster{tiling.cluster_splits}")
    return (str(tiling.kv_stages), flag(tiling.split_kv), flag(tiling.warps_split_keys)), key


def _product_key(tiling: Tiling) -> str:
    """A Hopper variant's key part for the columns its products run over
    (``Tiling.product_columns``): named only where narrowed."""
    return f"/k{tiling.product_dim}" if tiling.product_dim else ""


def _wgmma_forward_tile_args(tiling: Tiling) -> tuple[tuple[str, ...], str]:
    """The Hopper forward's template arguments after Batch, and key suffix:
    blocks per SM, K/V stages, persistent blocks, the columns its products
    run over."""
    key = f"/b{tiling.blocks_per_sm}/s{tiling.kv_stages}" + ("/persistent" if tiling.persistent else "")
    return ((str(tiling.blocks_per_sm), str(tiling.kv_stages), "true" if tiling.persistent else "false",
             str(tiling.product_columns)), key + _product_key(tiling))


def _wgmma_backward_tile_args(tiling: Tiling) -> tuple[tuple[str, ...], str]:
    """The Hopper backward's template arguments after Batch, and key suffix:
    Q/dO buffers, the columns its products run over."""
    return (str(tiling.q_stages), str(tiling.product_columns)), f"/q{tiling.q_stages}" + _product_key(tiling)


_FORWARD = "cuflash::ForwardParams"
#: The Hopper forward's: ForwardParams and the tensor maps of Q, K and V, a
#: __grid_constant__ parameter (the copy engine reads the maps in place).
_WGMMA_FORWARD = "__grid_constant__ cuflash::WgmmaForwardParams"
_BACKWARD = "cuflash::BackwardParams"


def _mma_forward_entry(tiling: Tiling) -> tuple[str, str]:
    """The mma.sync forward's entry point of a tiling: thread-block clusters
    (``cluster_splits``) and copy-engine K/V (``kv_tma``, whose K and V
    maps ride in the Hopper forward's parameters) each have their own."""
    function = ("cuflash::flash_forward_mma" + ("_tma" if tiling.kv_tma else "")
                + ("_cluster" if tiling.cluster_splits > 1 else "") + "_kernel")
    return function, _WGMMA_FORWARD if tiling.kv_tma else _FORWARD
#: The Hopper backward's: BackwardParams and the tensor maps of Q, K, V, dO
#: and the float32 dQ accumulator, a __grid_constant__ parameter.
_WGMMA_BACKWARD = "__grid_constant__ cuflash::WgmmaBackwardParams"

#: Every kernel, preferred first within a role.
FAMILIES: tuple[KernelFamily, ...] = (
    KernelFamily("forward-wgmma", "forward", "flash_fwd_wgmma.cu", "cuflash::flash_forward_wgmma_kernel",
                 _WGMMA_FORWARD,
                 arch="sm_90a", kernel="wgmma", dtypes=MMA_DTYPES, head_dims=tuple(WGMMA_FORWARD_TILES),
                 tiles=wgmma_forward_tiling, smem_bytes=Tiling.forward_smem_bytes, serves=wgmma_forward_applies,
                 needs_aligned_rows=True, needs_positive_scale=True, short_tiles=wgmma_forward_short_tiles,
                 persistent_form=wgmma_forward_persistent_form, tile_args=_wgmma_forward_tile_args),
    KernelFamily("forward-mma", "forward", "flash_fwd_mma.cu", "cuflash::flash_forward_mma_kernel", _FORWARD,
                 arch="sm_80", kernel="mma", dtypes=MMA_DTYPES + (MMA_3XTF32_DTYPE,),
                 head_dims=tuple(MMA_FORWARD_TILES), tiles=mma_forward_tiling, smem_bytes=Tiling.forward_smem_bytes,
                 serves=mma_forward_applies, needs_aligned_rows=True, needs_positive_scale=True,
                 tf32x3_dtypes=(MMA_3XTF32_DTYPE,), hopper_tiles=mma_forward_hopper_tiling,
                 other_tiles=every_decode_tiling, cache_dtypes=MMA_DTYPES,
                 tile_args=_mma_forward_tile_args, entry_points=_mma_forward_entry),
    KernelFamily("forward", "forward", "flash_fwd.cu", "cuflash::flash_forward_kernel", _FORWARD,
                 arch="any", kernel="simt", dtypes=_ALL_DTYPES, head_dims=HEAD_DIM_BUCKETS,
                 tiles=forward_tiling, smem_bytes=Tiling.forward_smem_bytes, serves=_any_head_dim),
    KernelFamily("backward-dkdv-wgmma", "backward-dkdv", "flash_bwd_wgmma.cu",
                 "cuflash::flash_backward_dkdv_wgmma_kernel", _WGMMA_BACKWARD, arch="sm_90a", kernel="wgmma",
                 dtypes=MMA_DTYPES, head_dims=tuple(WGMMA_BACKWARD_TILES), tiles=wgmma_backward_tiling,
                 smem_bytes=Tiling.backward_dkdv_smem_bytes, serves=wgmma_backward_applies, needs_aligned_rows=True,
                 # kDqAtomic, kDqOrdered, kDqClaimed, kDqDirect (kernels_cu/ordered_accumulation.cuh)
                 dq_modes={"atomic": "0", "ordered": "1", "claimed": "2", "direct": "3"},
                 tile_args=_wgmma_backward_tile_args),
    KernelFamily("backward-dkdv-mma", "backward-dkdv", "flash_bwd_mma.cu",
                 "cuflash::flash_backward_dkdv_mma_kernel", _BACKWARD, arch="sm_80", kernel="mma",
                 dtypes=MMA_DTYPES, head_dims=tuple(MMA_BACKWARD_TILES), tiles=mma_backward_tiling,
                 smem_bytes=Tiling.backward_dkdv_smem_bytes, serves=mma_backward_applies, needs_aligned_rows=True,
                 dq_modes={"atomic": "false", "ordered": "true"}, small_smem_tiles=mma_backward_99kib_tiling,
                 tile_args=lambda t: ((str(t.q_stages),), f"/q{t.q_stages}")),
    KernelFamily("backward-dkdv", "backward-dkdv", "flash_bwd.cu", "cuflash::flash_backward_dkdv_kernel", _BACKWARD,
                 arch="any", kernel="simt", dtypes=_ALL_DTYPES, head_dims=HEAD_DIM_BUCKETS, tiles=backward_tiling,
                 smem_bytes=Tiling.backward_dkdv_smem_bytes, serves=_any_head_dim,
                 dq_modes={"atomic": "true", "separate": "false"}),
    # The deterministic dQ pass: the forward's SIMT tiles, one block per query block.
    KernelFamily("backward-dq", "backward-dq", "flash_bwd.cu", "cuflash::flash_backward_dq_kernel", _BACKWARD,
                 arch="any", kernel="simt", dtypes=_ALL_DTYPES, head_dims=HEAD_DIM_BUCKETS, tiles=forward_tiling,
                 smem_bytes=Tiling.backward_dq_smem_bytes, serves=_any_head_dim),
    KernelFamily("backward-preprocess", "backward-elementwise", "flash_bwd_elementwise.cu",
                 "cuflash::flash_backward_preprocess_kernel", _BACKWARD, arch="any", kernel=None,
                 dtypes=_ALL_DTYPES, head_dims=(), tiles=None, smem_bytes=None, serves=_any_head_dim),
    KernelFamily("backward-convert-dq", "backward-elementwise", "flash_bwd_elementwise.cu",
                 "cuflash::flash_backward_convert_dq_kernel", _BACKWARD, arch="any", kernel=None,
                 dtypes=_ALL_DTYPES, head_dims=(), tiles=None, smem_bytes=None, serves=_any_head_dim),
    # Combines partial results by their log-sum-exp (split-KV decoding,
    # cuflash.merge_attention_states): variants by merge_variant.
    KernelFamily("merge-states", "merge", "merge_states.cu", "cuflash::merge_attention_states_kernel",
                 "cuflash::MergeParams", arch="any", kernel=None, dtypes=_ALL_DTYPES, head_dims=(), tiles=None,
                 smem_bytes=None, serves=lambda dtype_name, head_dim: head_dim > 0),
    # Appends k_new / v_new to a KV cache before the attention reads it
    # (cuflash.attention_with_kvcache): variants by cache_append_variant.
    KernelFamily("kv-cache-append", "cache-append", "kv_cache_append.cu", "cuflash::kv_cache_append_kernel",
                 "cuflash::CacheAppendParams", arch="any", kernel=None, dtypes=MMA_DTYPES, head_dims=(),
                 tiles=None, smem_bytes=None, serves=lambda dtype_name, head_dim: head_dim > 0),
)

#: Roles whose variants come from their own function, not KernelFamily.variant.
_OWN_VARIANTS = {"merge": "merge_variant", "cache-append": "cache_append_variant"}

#: Rows (warps) per block of the merge kernel.
MERGE_WARPS = 4


#: States a merge lane reads at once: the few of a ring or a prefix cache, or up to 32 (split-KV decoding).
MERGE_STATES_IN_FLIGHT = (4, 32)


def merge_states_in_flight(num_states: int) -> int:
    """The fewest states in flight a merge of ``num_states`` states reads at once."""
    return next((n for n in MERGE_STATES_IN_FLIGHT if n >= num_states), MERGE_STATES_IN_FLIGHT[-1])


def merge_vectors(partial_dtype: str, states_in_flight: int) -> tuple[int, ...]:
    """Columns a merge lane may read at a time: one, or 8 or 16 bytes' worth
    (16 bytes of 16-bit values only with few states in flight: 32 states of
    eight values each would spill)."""
    if partial_dtype == "float32" or states_in_flight > MERGE_STATES_IN_FLIGHT[0]:
        return (1, 4)
    return (1, 4, 8)


def merge_variant(partial_dtype: str, out_dtype: str, vector: int, states_in_flight: int = 32) -> KernelVariant:
    """The merge kernel for partial outputs of ``partial_dtype`` merged into
    ``out_dtype``, each lane reading ``vector`` consecutive columns of
    ``states_in_flight`` states at a time (``merge_vectors``; a vector
    needs head_dim, strides and pointers in multiples of it)."""
    if states_in_flight not in MERGE_STATES_IN_FLIGHT:
        raise ValueError(f"states_in_flight must be one of {MERGE_STATES_IN_FLIGHT}, got {states_in_flight}")
    vectors = merge_vectors(partial_dtype, states_in_flight)
    if vector not in vectors:
        raise ValueError(f"vector must be one of {vectors} for {partial_dtype} partials and {states_in_flight} "
                         f"states in flight, got {vector}")
    family = FAMILY["merge-states"]
    return KernelVariant(
        source=family.source, function=family.function, params=family.params,
        template_args=(CXX_ELEMENT_TYPE[partial_dtype], CXX_ELEMENT_TYPE[out_dtype], str(vector), str(MERGE_WARPS),
                       str(states_in_flight)),
        key=f"{family.name}/{partial_dtype}-{out_dtype}/v{vector}/w{MERGE_WARPS}/s{states_in_flight}",
        threads=32 * MERGE_WARPS, smem_bytes=0)


def merge_variants() -> list[KernelVariant]:
    """Every merge variant a call may take: split-KV's float32 partials into
    16-bit outputs, and the public merge's partials of each dtype into the same dtype."""
    pairs = [("float32", dtype) for dtype in MMA_DTYPES] + [(dtype, dtype) for dtype in _ALL_DTYPES]
    return [merge_variant(partial, out, vector, states) for partial, out in dict.fromkeys(pairs)
            for states in MERGE_STATES_IN_FLIGHT for vector in merge_vectors(partial, states)]

#: Threads per block of the KV-cache append kernel.
CACHE_APPEND_THREADS = 256


def cache_append_variant(dtype_name: str, layout: str) -> KernelVariant:
    """The KV-cache append kernel for a cache of ``dtype_name`` in
    ``layout`` ("cache": contiguous, "paged")."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"layout must be one of {CACHE_LAYOUTS}, got {layout!r}")
    family = FAMILY["kv-cache-append"]
    return KernelVariant(
        source=family.source, function=family.function, params=family.params,
        template_args=(CXX_ELEMENT_TYPE[dtype_name], BATCH_LAYOUTS[layout]),
        key=f"{family.name}/{dtype_name}/{layout}", threads=CACHE_APPEND_THREADS, smem_bytes=0)


def cache_append_variants() -> list[KernelVariant]:
    """Every append variant a call may take."""
    family = FAMILY["kv-cache-append"]
    return [cache_append_variant(dtype, layout) for dtype in family.dtypes for layout in CACHE_LAYOUTS]


FAMILY = {family.name: family for family in FAMILIES}


def claimed_dq_applies(mask: MaskPolicy, layout: str, head_dim_padded: int) -> bool:
    """Whether the Hopper dK/dV kernel's claimed dQ mode is built for a mask,
    batch layout and head dim: dense batches (a packed batch's tiles run into
    the next sequence's rows, whose blocks they cannot claim) under a causal
    or window mask, whose key blocks start their walks on their own
    diagonals (``runs_claimed_dq``), at head dims whose consumers each hold
    all of it (``backward_splits_head_dim``). Above 128 the dQ tile a step
    (64 queries by 192 or 256 float32 columns) is 1.5-2x d128's while a
    step's products are as long: the atomic mode measured 8-14% faster there
    (H200, causal, d160 and d256 at 2k-4k; claimed 2-3% faster at d64 and
    d128, even at d96; docs/perf-notes.md)."""
    return layout == "dense" and mask.dq_turns == "last-key-first" and not backward_splits_head_dim(head_dim_padded)


def runs_claimed_dq(kernel: str, dq_mode: str, mask: MaskPolicy, layout: str, seqlen_q: int, seqlen_k: int,
                    head_dim_padded: int) -> bool:
    """Whether a backward runs its dK/dV kernel (``kernel``, in ``dq_mode``,
    at ``head_dim_padded``) in the claimed dQ mode: the Hopper kernel with
    atomic dQ where the mode is built (``claimed_dq_applies``) and there are
    at least as many queries as keys, so that each key block's walk starts
    on its own diagonal: it is the first at its first query blocks, and the
    others reach them steps later (the launcher, ``cuflash.api.stores_first_dq``,
    and the simulator's plan)."""
    return (kernel == "wgmma" and dq_mode == "atomic" and claimed_dq_applies(mask, layout, head_dim_padded)
            and seqlen_q >= seqlen_k)


def direct_dq_applies(mask: MaskPolicy, layout: str) -> bool:
    """Whether the Hopper dK/dV kernel's direct dQ mode is built for a mask
    and batch layout: dense batches (a packed batch's tiles run into the
    next sequence's rows, which a store would overwrite) without a mask or
    under a causal or window mask, whose one key block's walk can visit
    every query block (``runs_direct_dq``)."""
    return layout == "dense" and mask.dq_turns in ("rotated", "last-key-first")


def runs_direct_dq(kernel: str, mask: MaskPolicy, layout: str, seqlen_q: int, seqlen_k: int, block_n: int,
                   dq_aligned: bool) -> bool:
    """Whether a backward runs its dK/dV kernel (``kernel``, whose key
    blocks are ``block_n`` keys) in the direct dQ mode, in either the atomic
    or the deterministic mode (one key block adds in one order): the Hopper
    kernel where the mode is built (``direct_dq_applies``), one key block
    (``seqlen_k <= block_n``) whose walk visits every query block (always
    without a mask; under a causal or window mask where no query row comes
    before the keys, ``seqlen_q <= seqlen_k``: every row then sees its
    diagonal key, and a query block no key block visits would be left
    unwritten), and a dq whose pointer is 16-byte aligned, which its tensor
    map needs (``dq_aligned``: a dq the call allocates, or an XLA buffer; a
    dq given to ``attention_backward`` may not be, and its key does not
    say; out's map, where the kernel computes delta, is
    ``cuflash.api.stores_dq_directly``'s to check). Each
    query row then meets this one block, which stores its dQ in the input
    dtype and computes its delta from the tiles of dO and out (where
    ``wgmma_direct_computes_delta``; at head dim 192 the preprocessing
    kernel computes it first): no float32 accumulator, no zeroing, no
    conversion kernel (the launcher, ``cuflash.api.backward_plan``, and the simulator's
    plan)."""
    if kernel != "wgmma" or not dq_aligned or not direct_dq_applies(mask, layout):
        return False
    if not (0 < seqlen_k <= block_n and seqlen_q > 0):
        return False
    return mask.dq_turns == "rotated" or seqlen_q <= seqlen_k


def family_of(role: str, kernel: str) -> KernelFamily:
    """The family of ``role`` whose tilings carry ``kernel`` (a Tiling's ``.kernel``)."""
    for family in FAMILIES:
        if family.role == role and family.kernel == kernel:
            return family
    raise ValueError(f"no {role} kernel family for {kernel!r} tilings")


def select(role: str, dtype_name: str, head_dim: int, generation: int = 80, **conditions) -> Tiling:
    """The tiles of the first ``role`` family that ``applies`` (keyword
    ``conditions``: aligned_rows, positive_scale, deterministic, tf32x3, smem_limit) on a device
    of kernel ``generation``."""
    for family in FAMILIES:
        if family.role == role and family.applies(dtype_name, head_dim, generation, **conditions):
            return family.tiles_on(dtype_name, head_dim, generation, conditions.get("smem_limit"))
    raise ValueError(f"no {role} kernel serves dtype {dtype_name!r} with head_dim {head_dim}")
