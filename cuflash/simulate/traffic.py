"""Counting HBM traffic: the problem, and the ledger each algorithm fills.

Two levels are kept for every access:

* **requested**: the bytes the algorithm's loads and stores ask of global
  memory, exact (the paper's "HBM accesses" of Algorithms 0 and 1);
* **dram**: an estimate of what reaches DRAM after the L2 cache, from the
  model in ``algorithms.py`` (what a profiler's ``dram__bytes`` measures).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

#: Display order of tensors; anything else is listed after these.
TENSOR_ORDER = ("Q", "K", "V", "K_new", "V_new", "block_table", "O", "LSE", "O_partial", "LSE_partial", "l", "m",
                "S", "P", "dropout_mask", "padding_mask", "dO", "dP", "dS", "dQ", "dK", "dV", "D", "dQ_accum",
                "dK_expanded", "dV_expanded")

#: float32 statistics (LSE, l, m, D) and accumulators.
STAT_BYTES = 4


@dataclass(frozen=True)
class Problem:
    """One attention call: shapes, element size and masking."""

    batch: int = 1
    nheads: int = 16
    nheads_k: int | None = None
    seqlen_q: int = 1024
    seqlen_k: int | None = None
    head_dim: int = 64
    element_size: int = 2
    causal: bool = False
    dropout: bool = False  #: the ``pytorch`` pipeline's dropout (other algorithms regenerate it on chip)
    key_padding_mask: bool = False  #: the ``pytorch`` pipeline's masked_fill with a key-padding mask
    deterministic: bool = False  #: cuflash's deterministic backward (dQ pass instead of atomics)
    #: K/V in a paged cache of this many tokens per page, found through an
    #: int32 block table (None: one contiguous cache per sequence)
    page_size: int | None = None
    #: the seqlen_q new tokens' K and V are appended to the cache (which then
    #: holds seqlen_k tokens, the new ones last) by the same call
    append: bool = False
    #: split-KV: the forward's keys split over this many thread blocks per
    #: query block, merged by their LSE; "auto": a wave-efficiency heuristic
    #: (algorithms.wave_efficient_splits); None: the algorithm's own choice
    num_splits: int | str | None = None
    #: GQA packing: the query heads sharing a K/V head run as the rows of one
    #: query block, so K/V are read once per K/V head (None: the algorithm's choice)
    pack_gqa: bool | None = None
    #: block-sparse attention (the FlashAttention paper's Proposition 4): the
    #: fraction of a query block's key blocks (of a key block's query blocks)
    #: a block mask keeps, spread evenly; the tiled algorithms skip the rest,
    #: the unfused ones compute everything and mask
    block_density: float = 1.0
    #: cuflash's decode path (its decode tiles, GQA packing and split-KV
    #: count for few query rows per K/V head); False models the kernels
    #: before it, which issue 15's first decode measurements ran
    cuflash_decode: bool = True

    def __post_init__(self):
        if self.nheads_k is None:
            object.__setattr__(self, "nheads_k", self.nheads)
        if self.seqlen_k is None:
            object.__setattr__(self, "seqlen_k", self.seqlen_q)
        for name in ("batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k", "head_dim", "element_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.nheads % self.nheads_k:
            raise ValueError(f"nheads ({self.nheads}) must be a multiple of nheads_k ({self.nheads_k})")
        if not 0 < self.block_density <= 1:
            raise ValueError(f"block_density must be in (0, 1], got {self.block_density}")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}")
        if self.num_splits is not None and self.num_splits != "auto" and not (
                isinstance(self.num_splits, int) and self.num_splits >= 1):
            raise ValueError(f"num_splits must be a whole number of at least 1 or 'auto', got {self.num_splits!r}")
        if self.append and self.seqlen_k < self.seqlen_q:
            raise ValueError(f"append adds the seqlen_q ({self.seqlen_q}) new tokens to the cache, so seqlen_k "
                             f"(the cache after it) must be at least seqlen_q, got {self.seqlen_k}")

    @property
    def heads(self) -> int:
        """Query heads over the whole batch."""
        return self.batch * self.nheads

    @property
    def kv_heads(self) -> int:
        return self.batch * self.nheads_k

    @property
    def group(self) -> int:
        return self.nheads // self.nheads_k


@dataclass
class Term:
    tensor: str
    kind: str  #: "read" or "write" (an atomic add counts as a write)
    requested: int
    dram: int
    element_size: int
    formula: str


@dataclass
class Traffic:
    """Ledger of one algorithm's passes: accesses, FLOPs and block sizes."""

    algorithm: str
    terms: list[Term] = field(default_factory=list)
    matmul_flops: float = 0.0
    other_flops: float = 0.0
    blocks: dict = field(default_factory=dict)
    flop_formulas: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: (phase, {tensor: bytes}): what the algorithm holds in HBM at once, per
    #: phase of its passes (inputs and outputs included)
    phases: list[tuple[str, dict[str, int]]] = field(default_factory=list)

    def access(self, tensor: str, kind: str, requested: int, *, element_size: int, formula: str,
               dram: int | None = None) -> None:
        requested = int(requested)
        dram = requested if dram is None else int(dram)
        self.terms.append(Term(tensor, kind, requested, dram, element_size, formula))

    def read(self, tensor, requested, **kwargs):
        self.access(tensor, "read", requested, **kwargs)

    def write(self, tensor, requested, **kwargs):
        self.access(tensor, "write", requested, **kwargs)

    def live(self, phase: str, tensors: dict[str, int]) -> None:
        """Records the tensors held in HBM together during ``phase``."""
        self.phases.append((phase, {name: int(size) for name, size in tensors.items() if size}))

    def peak_memory(self) -> tuple[int, str, dict[str, int]]:
        """(bytes, phase, tensors) of the phase that holds the most HBM."""
        if not self.phases:
            return 0, "", {}
        phase, tensors = max(self.phases, key=lambda item: sum(item[1].values()))
        return sum(tensors.values()), phase, tensors

    def flops(self, matmul: float, other: float, formula: str) -> None:
        self.matmul_flops += matmul
        self.other_flops += other
        self.flop_formulas.append(formula)

    # --- summaries ---------------------------------------------------------
    def by_tensor(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = defaultdict(
            lambda: {"read": 0, "write": 0, "dram_read": 0, "dram_write": 0, "elements": 0})
        for term in self.terms:
            row = table[term.tensor]
            row[term.kind] += term.requested
            row[f"dram_{term.kind}"] += term.dram
            row["elements"] += term.requested // term.element_size
        order = {name: i for i, name in enumerate(TENSOR_ORDER)}
        return dict(sorted(table.items(), key=lambda item: order.get(item[0], len(order))))

    def total(self, level: str = "requested", kind: str | None = None) -> int:
        return sum(getattr(t, level) for t in self.terms if kind is None or t.kind == kind)

    @property
    def element_accesses(self) -> int:
        return sum(t.requested // t.element_size for t in self.terms)
