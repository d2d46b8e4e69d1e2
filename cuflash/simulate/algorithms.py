"""Attention algorithms as HBM-traffic ledgers.

Every algorithm is written as the loops it runs: per (batch, head) the same
tile loops repeat, so each loop is walked once per head shape and multiplied
by the number of heads. Ragged last blocks count their real rows and keys;
causal masking skips the tiles the algorithm skips.

**L2 model** behind the DRAM estimate (requested traffic is exact and needs
none of it). Writes always reach DRAM once per distinct write. A read reaches
DRAM on first touch; a re-read hits in L2 when what was touched in between
fits in L2:

* unfused pipelines (``standard``, ``pytorch``): an intermediate read by the
  op right after the one that touched it hits iff the whole tensor takes at
  most half of L2; any other re-read misses;
* tiled kernels whose thread blocks share data (``flash2``, ``cuflash``: the
  query blocks of one head share its K/V in the forward, the key blocks of a
  head share its Q, dO, LSE, D and dQ accumulator in the backward): thread
  blocks run in waves of ``sms * blocks_per_sm``, the tiles of one head are
  consecutive in the grid, and the shared data of the heads in flight at once
  (``ceil(concurrent / tiles_per_head) + 1`` heads) stays in L2 if it fits;
  then it comes from DRAM once, otherwise once per wave over that head, as
  far as the wave's blocks reach (``wave_reach``);
* ``flash1`` (one thread block per head, looping over all tiles): the
  head's Q, O, l, m (and dO, dQ in the backward) are re-read on every outer
  step; they hit iff all concurrent blocks' working sets fit in L2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .._kernel_families import FAMILY, family_of, runs_claimed_dq, runs_direct_dq, select
from .._tiling import (DECODE_CLUSTER_SPLITS, DECODE_MAX_ROWS, MMA_DTYPES, copy_engine_box_rows,
                       decode_cluster_count, decode_cluster_tiling, decode_clusters_apply, decode_split_count,
                       decode_tail_split, decode_tilings, decode_ring, wave_efficient_splits,
                       wgmma_direct_computes_delta, wgmma_forward_for_call, with_wgmma_forward_stages)
from .._masks import mask_for
from .machines import Machine
from .traffic import STAT_BYTES, Problem, Traffic

PASSES = ("fwd", "bwd", "fwd+bwd")

#: Non-matmul FLOPs per score element (S entry) computed.
NONMATMUL = {
    # scale, row max, subtract, exp, row sum, divide
    "standard_fwd": 6,
    # P * dP, row sum, subtract, multiply
    "standard_bwd": 4,
    # scale folded into one FMA before exp2, row max, exp2, row sum
    "flash_fwd": 4,
    # FMA + exp2 to recompute P, subtract + multiply for dS
    "flash_bwd": 4,
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class QueryBlock:
    rows: int
    keys: int  #: keys visited (the visited key blocks, clipped to seqlen_k)
    key_start: int = 0  #: the first key visited


@dataclass(frozen=True)
class KeyBlock:
    keys: int
    rows: int  #: query rows visited (from the first query block that sees this key block)


def query_sweep(p: Problem, block_m: int, block_n: int, pack: int = 1) -> list[QueryBlock]:
    """Query-outer loop: each query block with the keys it visits. With
    ``pack`` > 1 (GQA packing) the blocks run over the rows of ``pack`` query
    heads interleaved, row r being query position r // pack, so a block
    visits the keys of the positions its rows cover."""
    blocks = []
    mask = mask_for(p.causal)
    rows_total = pack * p.seqlen_q
    for m_start in range(0, rows_total, block_m):
        rows = min(block_m, rows_total - m_start)
        first, last = m_start // pack, (m_start + rows - 1) // pack
        key_blocks = _kept(mask.key_blocks(first, last - first + 1, block_n, p.seqlen_q, p.seqlen_k), p)
        start = key_blocks.start * block_n if key_blocks else 0
        keys = min(key_blocks.stop * block_n, p.seqlen_k) - start if key_blocks else 0
        blocks.append(QueryBlock(rows, keys, start))
    return blocks


def _kept(blocks: range, p: Problem) -> range:
    """The blocks a block-sparse mask of density p.block_density keeps (at
    least one where any is visible), counted from the first: what is
    traffic and work is how many, not which."""
    if p.block_density == 1 or not blocks:
        return blocks
    return range(blocks.start, blocks.start + max(1, math.ceil(p.block_density * len(blocks))))


def split_keys(blocks: list[QueryBlock], block_n: int, splits: int) -> list[QueryBlock]:
    """Split-KV: each query block's key blocks dealt to ``splits`` thread
    blocks, ceil(key blocks / splits) each in order (the last ones may get
    fewer, or none: an empty split still runs and writes its empty partial
    result)."""
    if splits == 1:
        return blocks
    out = []
    for b in blocks:
        per_split = _cdiv(_cdiv(b.keys, block_n), splits) * block_n
        for split in range(splits):
            start = min(split * per_split, b.keys)
            out.append(QueryBlock(b.rows, min(per_split, b.keys - start), b.key_start + start))
    return out


def key_sweep(p: Problem, block_m: int, block_n: int) -> list[KeyBlock]:
    """Key-outer loop: each key block with the query rows it visits."""
    blocks = []
    for n_start in range(0, p.seqlen_k, block_n):
        query_blocks = _kept(mask_for(p.causal).query_blocks(n_start, block_n, block_m, p.seqlen_q, p.seqlen_k), p)
        rows = min(query_blocks.stop * block_m, p.seqlen_q) - query_blocks.start * block_m if query_blocks else 0
        blocks.append(KeyBlock(min(block_n, p.seqlen_k - n_start), rows))
    return blocks


def _fits(machine: Machine, nbytes: float) -> bool:
    return nbytes <= machine.l2_bytes


def reread_factor(machine: Machine, tiles_per_head: int, concurrent: int, shared_bytes_per_head: int) -> int:
    """How often a head's shared data comes from DRAM (see the module doc)."""
    if tiles_per_head <= 1:
        return 1
    heads_in_flight = _cdiv(concurrent, tiles_per_head) + 1
    if _fits(machine, heads_in_flight * shared_bytes_per_head):
        return 1
    return _cdiv(tiles_per_head, concurrent)


def wave_reach(spans: list[tuple[int, int]], concurrent: int) -> int:
    """What a head's blocks bring from DRAM of the data they share when it
    does not stay in L2 between waves (``reread_factor`` > 1): ``spans`` is
    each block's visited range (first, count) of that data (the forward's
    keys, the backward's query rows). Each wave of ``concurrent`` blocks, the
    longest first (the grids hand causal blocks out that way), reads the
    union of its blocks' ranges once between them; so a causal head's later
    waves read only the shorter ranges their blocks visit."""
    order = sorted((span for span in spans if span[1]), key=lambda span: span[1], reverse=True)
    total = 0
    for first in range(0, len(order), concurrent):
        wave = order[first:first + concurrent]
        total += max(a + n for a, n in wave) - min(a for a, _ in wave)
    return total


def _blocks_per_sm(machine: Machine, smem_bytes: int, threads: int) -> int:
    return max(1, min(machine.sram_per_sm // max(smem_bytes, 1), 2048 // threads, 32))


# --------------------------------------------------------------------------
# Unfused pipelines
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    name: str
    reads: tuple  #: (tensor, bytes, element_size)
    writes: tuple


def _run_ops(t: Traffic, ops: list[Op], machine: Machine) -> None:
    """Each op reads whole operands and writes whole results. A read hits in
    L2 iff the previous op touched the tensor and it takes at most half of L2."""
    previous: set[str] = set()
    for op in ops:
        for tensor, nbytes, element in op.reads:
            hit = tensor in previous and nbytes <= machine.l2_bytes // 2
            t.read(tensor, nbytes, element_size=element, dram=0 if hit else nbytes, formula=f"{op.name}: reads {tensor}")
        for tensor, nbytes, element in op.writes:
            t.write(tensor, nbytes, element_size=element, formula=f"{op.name}: writes {tensor}")
        previous = {name for name, _, _ in op.reads + op.writes}


def _sizes(p: Problem):
    e = p.element_size
    q = p.heads * p.seqlen_q * p.head_dim * e  # Q, O, dO, dQ
    kv_per_q_head = p.heads * p.seqlen_k * p.head_dim * e  # K, V broadcast to every query head (and dK, dV per one)
    scores = p.heads * p.seqlen_q * p.seqlen_k * e  # S, P, dP, dS
    return e, q, kv_per_q_head, scores


def _gradient_names(p: Problem) -> tuple[str, str]:
    """Where an algorithm without native grouped-query attention writes dK
    and dV: per query head ("dK_expanded", "dV_expanded") when query heads
    share K/V heads, then summed by ``_sum_expanded_gradients``."""
    return ("dK", "dV") if p.group == 1 else ("dK_expanded", "dV_expanded")


def _sum_expanded_gradients(t: Traffic, p: Problem) -> None:
    """The sum over each K/V head's query heads of per-query-head dK and dV
    (algorithms that broadcast K/V to every query head)."""
    if p.group == 1:
        return
    e, nk, d = p.element_size, p.seqlen_k, p.head_dim
    for expanded, final in (("dK_expanded", "dK"), ("dV_expanded", "dV")):
        t.read(expanded, p.heads * nk * d * e, element_size=e, formula="sum over the query heads of a group")
        t.write(final, p.kv_heads * nk * d * e, element_size=e, formula="summed gradient per K/V head")


def _key_value_pair(p: Problem, names: tuple[str, str], *, expand: bool) -> dict[str, int]:
    """Two K/V-shaped tensors held in HBM (K and V, or dK and dV), per K/V
    head; algorithms without native grouped-query attention (``expand``)
    also hold them per query head (``<name>_expanded``)."""
    e, _, kvq, _ = _sizes(p)
    kv = p.kv_heads * p.seqlen_k * p.head_dim * e
    held = dict.fromkeys(names, kv)
    if expand and p.group > 1:
        held.update(dict.fromkeys((f"{name}_expanded" for name in names), kvq))
    return held


def _inputs(p: Problem, *, expand: bool) -> dict[str, int]:
    """Q, K and V in HBM (see _key_value_pair for ``expand``)."""
    return {"Q": _sizes(p)[1], **_key_value_pair(p, ("K", "V"), expand=expand)}


def _gradients(p: Problem, *, expand: bool) -> dict[str, int]:
    """dK and dV (per query head first, then summed, where ``expand``)."""
    return _key_value_pair(p, ("dK", "dV"), expand=expand)


def standard(p: Problem, machine: Machine, passes: str, block_m=None, block_n=None) -> Traffic:
    """Algorithm 0 of the FlashAttention paper: S and P written to and read
    back from HBM; its backward (Algorithm 3) likewise with dP and dS. Each
    matrix product reads its operands once."""
    t = Traffic("standard")
    e, q, kvq, nn = _sizes(p)
    scores = p.heads * p.seqlen_q * p.seqlen_k
    if "fwd" in passes:
        _run_ops(t, [
            Op("S = Q Kᵀ", (("Q", q, e), ("K", kvq, e)), (("S", nn, e),)),
            Op("P = softmax(scale·S" + (", causal mask" if p.causal else "") + ")", (("S", nn, e),), (("P", nn, e),)),
            Op("O = P V", (("P", nn, e), ("V", kvq, e)), (("O", q, e),)),
        ], machine)
        t.flops(4 * scores * p.head_dim, (NONMATMUL["standard_fwd"] + p.causal) * scores,
                f"forward: matmul 4·B·H·Nq·Nk·d; other {NONMATMUL['standard_fwd'] + p.causal}·B·H·Nq·Nk")
        t.live("forward: softmax (S and P)", {**_inputs(p, expand=True), "S": nn, "P": nn})
        t.live("forward: O = P V", {**_inputs(p, expand=True), "P": nn, "O": q})
    if "bwd" in passes:
        dk, dv = _gradient_names(p)
        _run_ops(t, [
            Op("dV = Pᵀ dO", (("P", nn, e), ("dO", q, e)), ((dv, kvq, e),)),
            Op("dP = dO Vᵀ", (("dO", q, e), ("V", kvq, e)), (("dP", nn, e),)),
            Op("dS = P ∘ (dP − rowsum(dP ∘ P))", (("P", nn, e), ("dP", nn, e)), (("dS", nn, e),)),
            Op("dQ = scale·dS K", (("dS", nn, e), ("K", kvq, e)), (("dQ", q, e),)),
            Op("dK = scale·dSᵀ Q", (("dS", nn, e), ("Q", q, e)), ((dk, kvq, e),)),
        ], machine)
        _sum_expanded_gradients(t, p)
        t.flops(8 * scores * p.head_dim, NONMATMUL["standard_bwd"] * scores,
                f"backward: matmul 8·B·H·Nq·Nk·d; other {NONMATMUL['standard_bwd']}·B·H·Nq·Nk")
        t.live("backward: dS from P and dP", {**_inputs(p, expand=True), "O": q, "dO": q, "P": nn, "dP": nn,
                                             "dS": nn, dv: kvq})
    return t


def pytorch(p: Problem, machine: Machine, passes: str, block_m=None, block_n=None) -> Traffic:
    """The unfused framework pipeline the paper measured: scores by a batched
    GEMM with the scale folded in (baddbmm, alpha = scale), masked_fill
    (causal or key-padding mask), softmax, optional dropout (which writes a
    one-byte mask), and a batched GEMM with V; the backward runs each op's
    backward, reading and writing full-size operands."""
    t = Traffic("pytorch")
    e, q, kvq, nn = _sizes(p)
    scores = p.heads * p.seqlen_q * p.seqlen_k
    masked = p.causal or p.key_padding_mask
    mask_bytes = p.batch * p.seqlen_k  # a (batch, seqlen_k) bool key-padding mask; causal masks are built on the fly
    drop_mask = scores  # bool per score
    probs_used = "P_dropped" if p.dropout else "P"
    inputs = {**_inputs(p, expand=True), "padding_mask": mask_bytes if p.key_padding_mask else 0}
    # Autograd keeps P (softmax's backward) and, with dropout, its mask and the dropped P (bmm's backward).
    saved = {"P": nn, "dropout_mask": drop_mask if p.dropout else 0, "P_dropped": nn if p.dropout else 0}
    if "fwd" in passes:
        ops = [Op("S = scale·Q Kᵀ (baddbmm)", (("Q", q, e), ("K", kvq, e)), (("S", nn, e),))]
        if masked:
            reads = (("S", nn, e),) + ((("padding_mask", mask_bytes, 1),) if p.key_padding_mask else ())
            ops.append(Op("masked_fill", reads, (("S", nn, e),)))
        ops.append(Op("P = softmax(S)", (("S", nn, e),), (("P", nn, e),)))
        if p.dropout:
            ops.append(Op("dropout", (("P", nn, e),), (("P_dropped", nn, e), ("dropout_mask", drop_mask, 1))))
        ops.append(Op("O = P V (bmm)", ((probs_used, nn, e), ("V", kvq, e)), (("O", q, e),)))
        _run_ops(t, ops, machine)
        t.live("forward: softmax (S and P)", {**inputs, "S": nn, "P": nn})
        t.live("forward: O = P V", {**inputs, **saved, "O": q})
        other = 1 + masked + 5 + 2 * p.dropout
        t.flops(4 * scores * p.head_dim, other * scores,
                f"forward: matmul 4·B·H·Nq·Nk·d; other {other}·B·H·Nq·Nk (scale, mask, softmax 5, dropout 2)")
    if "bwd" in passes:
        grad_probs = "dP_dropped" if p.dropout else "dP"
        dk, dv = _gradient_names(p)
        ops = [
            Op("dP = dO Vᵀ (bmm backward)", (("dO", q, e), ("V", kvq, e)), ((grad_probs, nn, e),)),
            Op("dV = Pᵀ dO (bmm backward)", ((probs_used, nn, e), ("dO", q, e)), ((dv, kvq, e),)),
        ]
        if p.dropout:
            ops.append(Op("dropout backward", (("dP_dropped", nn, e), ("dropout_mask", drop_mask, 1)), (("dP", nn, e),)))
        ops.append(Op("softmax backward", (("P", nn, e), ("dP", nn, e)), (("dS", nn, e),)))
        if masked:
            ops.append(Op("masked_fill backward", (("dS", nn, e),), (("dS", nn, e),)))
        ops += [
            Op("dQ = scale·dS K (baddbmm backward)", (("dS", nn, e), ("K", kvq, e)), (("dQ", q, e),)),
            Op("dK = scale·dSᵀ Q (baddbmm backward)", (("dS", nn, e), ("Q", q, e)), ((dk, kvq, e),)),
        ]
        _run_ops(t, ops, machine)
        _sum_expanded_gradients(t, p)
        t.live("backward: softmax backward (dP and dS)",
               {**inputs, **saved, "O": q, "dO": q, "dP": nn, "dS": nn, dv: kvq})
        other = 4 + masked + p.dropout
        t.flops(8 * scores * p.head_dim, other * scores,
                f"backward: matmul 8·B·H·Nq·Nk·d; other {other}·B·H·Nq·Nk (softmax backward 4, mask, dropout)")
    return t


# --------------------------------------------------------------------------
# FlashAttention (Algorithm 1 and its backward, Algorithm 4)
# --------------------------------------------------------------------------

def flash1_blocks(p: Problem, machine: Machine) -> tuple[int, int]:
    """The paper's rule: with M the SRAM size in elements, Bc = ⌈M / 4d⌉ and
    Br = min(⌈M / 4d⌉, d)."""
    m_elements = machine.sram_per_sm // p.element_size
    bc = _cdiv(m_elements, 4 * p.head_dim)
    return min(bc, p.head_dim), bc


def flash1(p: Problem, machine: Machine, passes: str, block_m=None, block_n=None) -> Traffic:
    """FlashAttention Algorithm 1: key/value blocks in the outer loop, so the
    output, l and m are read and written back to HBM once per outer step;
    Algorithm 4 (backward) likewise re-reads and re-writes dQ. One thread
    block per (batch, head)."""
    t = Traffic("flash1")
    br, bc = flash1_blocks(p, machine)
    br, bc = block_m or br, block_n or bc
    t.blocks.update({"flash1 Br": br, "flash1 Bc": bc})
    e, f, d, heads = p.element_size, STAT_BYTES, p.head_dim, p.heads
    sweep = key_sweep(p, br, bc)
    visited_rows = sum(b.rows for b in sweep)  # Σ_j rows visited by key block j
    distinct_rows = max((b.rows for b in sweep), default=0)  # rows ever visited (key block 0 sees the most)
    pairs = sum(b.rows * b.keys for b in sweep)
    concurrent = min(heads, machine.sms)
    nq, nk = p.seqlen_q, p.seqlen_k
    def resident(pass_name: str, working: int) -> bool:
        """Whether the concurrent blocks' per-head working sets fit in L2."""
        hit = _fits(machine, concurrent * working)
        t.notes.append(f"flash1 {pass_name}: per-head working set {working} B × {concurrent} blocks "
                       f"{'fits' if hit else 'does not fit'} in L2")
        return hit

    def revisited(kind: str, tensor: str, size: int, element: int, hit: bool, formula: str) -> None:
        """A row slice touched for every visited (i, j); from DRAM once per row if resident."""
        t.access(tensor, kind, heads * visited_rows * size, element_size=element,
                 dram=heads * distinct_rows * size if hit else None, formula=formula)

    if "fwd" in passes:
        hit = resident("forward", 2 * nq * d * e + 2 * nq * f + 2 * bc * d * e)
        t.write("O", heads * nq * d * e, element_size=e, formula="initialise O = 0 in HBM: B·H·Nq·d")
        t.write("l", heads * nq * f, element_size=f, formula="initialise l = 0 in HBM: B·H·Nq")
        t.write("m", heads * nq * f, element_size=f, formula="initialise m = -inf in HBM: B·H·Nq")
        t.read("K", heads * nk * d * e, element_size=e, formula="K_j once per outer step: B·H·Nk·d")
        t.read("V", heads * nk * d * e, element_size=e, formula="V_j once per outer step: B·H·Nk·d")
        for tensor, size, element in (("Q", d * e, e), ("O", d * e, e), ("l", f, f), ("m", f, f)):
            revisited("read", tensor, size, element, hit,
                      f"{tensor}_i for every visited (i, j): B·H·Σ_j rows_j·{'d' if element == e else '1'}")
        for tensor, size, element in (("O", d * e, e), ("l", f, f), ("m", f, f)):
            revisited("write", tensor, size, element, hit, f"{tensor}_i written back for every visited (i, j)")
        t.live("forward", {**_inputs(p, expand=True), "O": heads * nq * d * e, "l": heads * nq * f,
                           "m": heads * nq * f})
        t.flops(4 * heads * pairs * d, heads * (NONMATMUL["flash_fwd"] + 1) * pairs + heads * 4 * visited_rows * d,
                "forward: matmul 4·B·H·Σ rows·keys·d over visited tiles; other 5 per score + 4·d per row per tile "
                "(rescaling O)")
    if "bwd" in passes:
        hit = resident("backward", 4 * nq * d * e + 2 * nq * f + 2 * bc * d * e)
        dk, dv = _gradient_names(p)
        for tensor, length in (("dQ", nq), (dk, nk), (dv, nk)):
            t.write(tensor, heads * length * d * e, element_size=e, formula=f"initialise {tensor} = 0 in HBM")
        t.read("K", heads * nk * d * e, element_size=e, formula="K_j once per outer step")
        t.read("V", heads * nk * d * e, element_size=e, formula="V_j once per outer step")
        for tensor, size, element in (("Q", d * e, e), ("O", d * e, e), ("dO", d * e, e), ("dQ", d * e, e),
                                      ("l", f, f), ("m", f, f)):
            revisited("read", tensor, size, element, hit, f"{tensor}_i for every visited (i, j)")
        revisited("write", "dQ", d * e, e, hit, "dQ_i written back for every visited (i, j)")
        t.write(dk, heads * nk * d * e, element_size=e, formula=f"{dk}_j at the end of outer step j")
        t.write(dv, heads * nk * d * e, element_size=e, formula=f"{dv}_j at the end of outer step j")
        _sum_expanded_gradients(t, p)
        t.live("backward", {**_inputs(p, expand=True), "O": heads * nq * d * e, "dO": heads * nq * d * e,
                            "l": heads * nq * f, "m": heads * nq * f, "dQ": heads * nq * d * e,
                            **_gradients(p, expand=True)})
        t.flops(10 * heads * pairs * d, heads * (NONMATMUL["flash_bwd"] + 2) * pairs + heads * 2 * visited_rows * d,
                "backward: matmul 10·B·H·Σ rows·keys·d (S recomputed, dV, dP, dQ, dK); other 6 per score "
                "+ 2·d per row per tile (D_i = rowsum(dO_i ∘ O_i))")
    return t


# --------------------------------------------------------------------------
# FlashAttention-2 and cuflash
# --------------------------------------------------------------------------

def flash2_blocks(p: Problem, machine: Machine) -> tuple[int, int]:
    """Square tiles, the largest power of two up to 128 for which Q_i, K_j and
    V_j fit in one SM's SRAM."""
    block = 128
    while block > 16 and 3 * block * p.head_dim * p.element_size > machine.sram_per_sm:
        block //= 2
    return block, block


@dataclass(frozen=True)
class _TiledPlan:
    """Tiles and occupancy of a FlashAttention-2-style implementation."""

    fwd_m: int
    fwd_n: int
    bwd_m: int
    bwd_n: int
    fwd_blocks_per_sm: int
    bwd_blocks_per_sm: int
    dq_m: int
    dq_n: int
    native_gqa: bool  #: dK/dV computed per K/V head (cuflash) or per query head then summed (flash2)
    splits: int = 1  #: split-KV thread blocks per query block of the forward
    pack: int = 1  #: query heads packed into one block's rows (GQA packing), else 1
    #: the forward runs the mma.sync kernel where the algorithm's own is
    #: another (cuflash's decode tiles on Hopper)
    fwd_mma: bool = False
    #: the splits of a query block run as one thread-block cluster and merge
    #: there (cuflash on Hopper: no partial results in memory, no merge launch)
    clustered: bool = False
    #: the dK/dV kernel stores each query block's first dQ tile instead of
    #: adding every tile into a zeroed accumulator (cuflash where
    #: cuflash._kernel_families.runs_claimed_dq says, as its launcher):
    #: no zeroing pass, no accumulator lines fetched for the first additions
    claimed_dq: bool = False
    #: the dK/dV kernel's one key block stores dQ in the input dtype (cuflash
    #: where cuflash._kernel_families.runs_direct_dq says, as its launcher):
    #: no accumulator, no zeroing, no conversion kernel
    direct_dq: bool = False
    #: that kernel also computes D = rowsum(dO ∘ O) from O tiles it loads
    #: (cuflash where cuflash._tiling.wgmma_direct_computes_delta says): no
    #: preprocessing kernel, no D in memory
    delta_in_kernel: bool = False
    #: the head-dim columns the tensor cores run each product over (the
    #: compiled bucket, zeros past the head dim; 0: the head dim itself):
    #: the forward's two products, the backward's S, dP, dV and dK, and
    #: its dQ (``timing``'s block work; the traffic's FLOP counts stay
    #: the problem's, FlashAttention-2's convention)
    fwd_width: int = 0
    bwd_width: int = 0
    dq_width: int = 0


def _decode_grid(p: Problem, plan: _TiledPlan, pack: int) -> tuple[int, int]:
    """A decode forward's thread blocks without splits (owners x query
    blocks, ``pack`` query heads a block's rows) and its key blocks per
    sequence (at least one), as cuflash.api._decode_blocks counts them."""
    blocks = query_sweep(p, plan.fwd_m, plan.fwd_n, pack)
    owners = p.kv_heads if pack > 1 else p.heads
    return owners * len(blocks), max([1, *(_cdiv(b.keys, plan.fwd_n) for b in blocks)])


def _decoding_plan(plan: _TiledPlan, p: Problem, machine: Machine, *, splits, pack: bool,
                   clusters: bool = False) -> _TiledPlan:
    """The plan with the problem's split-KV and GQA-packing choices where it
    makes them (Problem.num_splits, Problem.pack_gqa), else the algorithm's
    defaults ``splits`` (a count, "auto" or "cuflash") and ``pack``; "auto"
    takes wave_efficient_splits over the machine's SMs (FlashAttention-2's
    rule), "cuflash" cuflash's launcher's decode_split_count, and where
    ``clusters`` (cuflash's one-tile decode blocks on Hopper) its
    decode_cluster_count (where decode_clusters_apply; an unsplit launch
    past one wave: decode_tail_split's two), whose splits merge in their
    cluster. The
    launcher's occupancy of the kernel is modelled by shared memory alone
    (a paged cache's kernel is register-bound at two blocks an SM on the
    H100, which this does not see)."""
    pack = pack if p.pack_gqa is None else p.pack_gqa
    rows = p.group if pack and p.group > 1 else 1
    splits = splits if p.num_splits is None else p.num_splits
    clustered = False
    if splits in ("auto", "cuflash"):
        parallel, key_blocks = _decode_grid(p, plan, rows)
        launchers = splits == "cuflash"
        choose = decode_split_count if launchers else wave_efficient_splits
        splits = choose(parallel, machine.sms, key_blocks)
        if clusters and launchers and splits == 1:
            # past one wave, two clustered ranges (decode_tail_split)
            clustered = decode_tail_split(parallel, machine.sms, key_blocks, lambda: plan.fwd_blocks_per_sm)
            splits = 2 if clustered else 1
        elif clusters and decode_clusters_apply(splits, key_blocks):
            counted = decode_cluster_count(parallel, machine.sms, key_blocks, plan.fwd_blocks_per_sm, splits)
            clustered = counted > 1
            splits = counted if clustered else splits
    elif clusters:
        clustered = splits in DECODE_CLUSTER_SPLITS
    return replace(plan, splits=splits, pack=rows, clustered=clustered)


def _tiled_forward(t: Traffic, p: Problem, machine: Machine, plan: _TiledPlan) -> None:
    e, f, d, heads = p.element_size, STAT_BYTES, p.head_dim, p.heads
    # A thread block's rows belong to one query head, or with GQA packing to
    # the plan.pack heads sharing a K/V head ("owners": who reads the K/V).
    owners = p.kv_heads if plan.pack > 1 else heads
    unsplit = query_sweep(p, plan.fwd_m, plan.fwd_n, plan.pack)
    blocks = split_keys(unsplit, plan.fwd_n, plan.splits)
    rows_read = sum(b.rows for b in blocks)
    keys_visited = sum(b.keys for b in blocks)
    pairs = sum(b.rows * b.keys for b in blocks)
    # DRAM: the union of the keys the query blocks visit; a block-sparse mask
    # keeps different key blocks for different query blocks, so the dense union.
    dense = unsplit if p.block_density == 1 else query_sweep(replace(p, block_density=1.0), plan.fwd_m,
                                                             plan.fwd_n, plan.pack)
    seen = [b for b in dense if b.keys]
    distinct_keys = max(b.key_start + b.keys for b in seen) - min(b.key_start for b in seen) if seen else 0
    concurrent = machine.sms * plan.fwd_blocks_per_sm
    factor = reread_factor(machine, len(blocks), concurrent, 2 * p.seqlen_k * d * e)
    kv_owners = p.kv_heads if factor == 1 else owners
    kv_dram_keys = distinct_keys if factor == 1 else wave_reach([(b.key_start, b.keys) for b in dense], concurrent)
    split_note = f" × {plan.splits} splits" if plan.splits > 1 else ""
    t.read("Q", owners * rows_read * d * e, element_size=e, dram=heads * p.seqlen_q * d * e,
           formula=f"Q_i once per query block{split_note}: B·H·Nq·d")
    for tensor in ("K", "V"):
        t.read(tensor, owners * keys_visited * d * e, element_size=e, dram=kv_owners * kv_dram_keys * d * e,
               formula=f"{tensor}_j for every visited (i, j): {'B·H_kv' if plan.pack > 1 else 'B·H'}·Σ_i keys_i·d "
                       f"(Tr = {len(unsplit)} query blocks{split_note})")
    if p.page_size is not None:
        pages = sum(_cdiv(b.key_start + b.keys, p.page_size) - b.key_start // p.page_size for b in blocks if b.keys)
        t.read("block_table", owners * pages * 4, element_size=4,
               dram=p.batch * _cdiv(p.seqlen_k, p.page_size) * 4,
               formula=f"int32 page numbers of the pages each block's keys span (page size {p.page_size})")
    if p.append:
        new = p.kv_heads * p.seqlen_q * d * e
        for tensor in ("K", "V"):
            t.read(f"{tensor}_new", new, element_size=e, formula=f"{tensor}_new appended: B·H_kv·Nq·d")
            t.write(tensor, new, element_size=e, formula=f"{tensor}_new into the cache at each sequence's length")
    held = {**_inputs(p, expand=False), "O": heads * p.seqlen_q * d * e, "LSE": heads * p.seqlen_q * f}
    if plan.splits > 1 and not plan.clustered:
        held.update(O_partial=owners * rows_read * d * f, LSE_partial=owners * rows_read * f)
    t.live("forward", held)
    if plan.clustered:
        # Each block's rows staged in its shared memory and merged there
        # through distributed shared memory: only the merged rows reach HBM.
        t.write("O", heads * p.seqlen_q * d * e, element_size=e,
                formula=f"O_i once, merged in the cluster of {plan.splits} splits: B·H·Nq·d")
        t.write("LSE", heads * p.seqlen_q * f, element_size=f, formula="LSE_i once: B·H·Nq (float32)")
        t.flops(0, heads * p.seqlen_q * plan.splits * (2 * d + 4),
                "split-KV merge in the cluster: per row and split, an exponential weight and a scaled add of d values")
    elif plan.splits == 1:
        t.write("O", heads * p.seqlen_q * d * e, element_size=e, formula="O_i once: B·H·Nq·d")
        t.write("LSE", heads * p.seqlen_q * f, element_size=f, formula="LSE_i once: B·H·Nq (float32)")
    else:
        partial = owners * rows_read
        fits = _fits(machine, partial * (d + 1) * f)
        t.write("O_partial", partial * d * f, element_size=f,
                formula=f"each split's O_i, float32: B·H·Nq·d × {plan.splits} splits")
        t.write("LSE_partial", partial * f, element_size=f, formula=f"each split's LSE_i: B·H·Nq × {plan.splits}")
        t.read("O_partial", partial * d * f, element_size=f, dram=0 if fits else None,
               formula="merge reads every split's O_i")
        t.read("LSE_partial", partial * f, element_size=f, dram=0 if fits else None,
               formula="merge reads every split's LSE_i")
        t.write("O", heads * p.seqlen_q * d * e, element_size=e, formula="merge writes O_i: B·H·Nq·d")
        t.write("LSE", heads * p.seqlen_q * f, element_size=f, formula="merge writes LSE_i: B·H·Nq (float32)")
        t.flops(0, heads * p.seqlen_q * plan.splits * (2 * d + 4),
                "split-KV merge: per row and split, an exponential weight and a scaled add of d values")
    t.flops(4 * owners * pairs * d, owners * NONMATMUL["flash_fwd"] * pairs + owners * 2 * sum(
        b.rows * _cdiv(b.keys, plan.fwd_n) for b in blocks) * d,
        "forward: matmul 4·B·H·Σ rows·keys·d over visited tiles; other 4 per score + d per row per tile "
        "(rescale) and at the end (normalise)")
    t.notes.append(f"forward: K/V from DRAM {'once per K/V head' if factor == 1 else 'once per wave of a head'} "
                   f"({concurrent} blocks in flight"
                   f"{'' if factor == 1 else f'; {kv_dram_keys / max(distinct_keys, 1):.2f}× its keys'})")
    if plan.pack > 1:
        t.notes.append(f"forward: GQA packing, the {plan.pack} query heads of a K/V head in one block's rows")
    if plan.splits > 1:
        where = " in their thread-block cluster (distributed shared memory)" if plan.clustered else ""
        t.notes.append(f"forward: split-KV, {plan.splits} thread blocks per query block, merged by their LSE{where}")
    if p.page_size is not None:
        t.notes.append("forward: paged K/V request the bytes a contiguous cache would (a key's row of d elements "
                       "is one run in either layout) plus the block table; DRAM page locality is not modelled")


def _tiled_backward(t: Traffic, p: Problem, machine: Machine, plan: _TiledPlan, deterministic: bool) -> None:
    e, f, d = p.element_size, STAT_BYTES, p.head_dim
    heads, nq, nk = p.heads, p.seqlen_q, p.seqlen_k
    # preprocess: D = rowsum(dO ∘ O) (and the dQ accumulator zeroed, unless
    # the dK/dV kernel stores each query block's first tile); or D computed
    # by the dK/dV kernel of one key block, from the O tiles it loads
    if plan.delta_in_kernel:
        t.read("O", heads * nq * d * e, element_size=e, formula="the dK/dV kernel reads O once, with dO")
        t.flops(0, 2 * heads * nq * d, "D = rowsum(dO ∘ O) in the dK/dV kernel: 2·B·H·Nq·d")
    else:
        t.read("O", heads * nq * d * e, element_size=e, formula="preprocess reads O once")
        t.read("dO", heads * nq * d * e, element_size=e, formula="preprocess reads dO once")
        t.write("D", heads * nq * f, element_size=f, formula="preprocess writes D = rowsum(dO ∘ O), float32")
        t.flops(0, 2 * heads * nq * d, "preprocess: 2·B·H·Nq·d")
    if not deterministic and not plan.claimed_dq and not plan.direct_dq:
        t.write("dQ_accum", heads * nq * d * f, element_size=f, formula="preprocess zeroes the float32 dQ accumulator")
    # dK/dV pass: one block per key block of a K/V head (cuflash) or of a query head (flash2)
    sweep = key_sweep(p, plan.bwd_m, plan.bwd_n)
    rows_visited = sum(b.rows for b in sweep)
    # The rows any key block visits: each visits a suffix of the query rows
    # (from its first visible query block on), so the longest is the union.
    # DRAM is charged for those, not for rows no key block reads (causal with
    # seqlen_q > seqlen_k leaves the first ones unvisited).
    dense = sweep if p.block_density == 1 else key_sweep(replace(p, block_density=1.0), plan.bwd_m, plan.bwd_n)
    distinct_rows = max((b.rows for b in dense), default=0)
    pairs = sum(b.rows * b.keys for b in sweep)
    owners = p.kv_heads if plan.native_gqa else heads
    per_owner_heads = p.group if plan.native_gqa else 1
    concurrent = machine.sms * plan.bwd_blocks_per_sm
    shared = per_owner_heads * (2 * nq * d * e + 2 * nq * f + (0 if deterministic else nq * d * f))
    factor = reread_factor(machine, len(sweep), concurrent, shared)
    # Rows from DRAM a head: once, or each wave's (the rows a key block
    # visits are a suffix: nq - rows on).
    dram_rows = distinct_rows if factor == 1 else wave_reach([(nq - b.rows, b.rows) for b in dense], concurrent)
    t.read("K", owners * nk * d * e, element_size=e, formula="K_j once per key block")
    t.read("V", owners * nk * d * e, element_size=e, formula="V_j once per key block")
    row_tensors = (("Q", d * e, e), ("dO", d * e, e), ("LSE", f, f)) + (() if plan.delta_in_kernel else (("D", f, f),))
    for tensor, size, element in row_tensors:
        t.read(tensor, heads * rows_visited * size, element_size=element, dram=heads * dram_rows * size,
               formula=f"{tensor}_i for every visited (i, j): B·H·Σ_j rows_j (Tc = {len(sweep)} key blocks)")
    if plan.delta_in_kernel:
        t.notes.append("backward: each query row meets one key block, which computes its D from O and dO "
                       "(no preprocessing kernel, no D in memory)")
    if plan.direct_dq:
        t.write("dQ", heads * rows_visited * d * e, element_size=e, dram=heads * dram_rows * d * e,
                formula="dQ_i = scale·dS K_j stored in the input dtype by each row's one key block")
        t.notes.append("backward: one key block reaches every query block, so it stores dQ itself "
                       "(no float32 accumulator, no zeroing, no conversion kernel)")
    elif not deterministic:
        t.write("dQ_accum", heads * rows_visited * d * f, element_size=f, dram=heads * dram_rows * d * f,
                formula="atomic float32 dQ_i += scale·dS K_j for every visited (i, j)")
        if plan.claimed_dq:
            t.notes.append("backward: each query block's first dQ tile stored over the accumulator (not zeroed); "
                           "the later additions find its lines in L2")
        else:
            t.read("dQ_accum", 0, element_size=f, dram=heads * dram_rows * d * f,
                   formula="L2 fetches the zeroed accumulator lines for the atomics (no SM request)")
    for tensor in ("dK", "dV") if plan.native_gqa else _gradient_names(p):
        t.write(tensor, owners * nk * d * e, element_size=e, formula=f"{tensor}_j once per key block")
    if not plan.native_gqa:
        _sum_expanded_gradients(t, p)
    t.flops(10 * heads * pairs * d, heads * NONMATMUL["flash_bwd"] * pairs,
            "backward: matmul 10·B·H·Σ rows·keys·d (S recomputed, dV, dP, dK, dQ); other 4 per score")
    t.live("backward", {**_inputs(p, expand=False), "O": heads * nq * d * e, "dO": heads * nq * d * e,
                        "LSE": heads * nq * f, "D": 0 if plan.delta_in_kernel else heads * nq * f,
                        "dQ_accum": 0 if deterministic or plan.direct_dq else heads * nq * d * f,
                        "dQ": heads * nq * d * e,
                        **_gradients(p, expand=not plan.native_gqa)})
    if plan.direct_dq:
        return
    if deterministic:
        dq_sweep = query_sweep(p, plan.dq_m, plan.dq_n)
        keys_visited = sum(b.keys for b in dq_sweep)
        dq_pairs = sum(b.rows * b.keys for b in dq_sweep)
        dq_concurrent = machine.sms * plan.fwd_blocks_per_sm
        dq_factor = reread_factor(machine, len(dq_sweep), dq_concurrent, 2 * nk * d * e)
        for tensor, size, element in (("Q", d * e, e), ("dO", d * e, e), ("LSE", f, f), ("D", f, f)):
            t.read(tensor, heads * nq * size, element_size=element, formula=f"dQ pass: {tensor}_i once per query block")
        for tensor in ("K", "V"):
            t.read(tensor, heads * keys_visited * d * e, element_size=e,
                   dram=(p.kv_heads if dq_factor == 1 else heads) * dq_factor * nk * d * e,
                   formula=f"dQ pass: {tensor}_j for every visited (i, j)")
        t.write("dQ", heads * nq * d * e, element_size=e, formula="dQ pass writes dQ_i once")
        t.flops(8 * heads * dq_pairs * d, heads * NONMATMUL["flash_bwd"] * dq_pairs,
                "deterministic dQ pass: matmul 8·B·H·Σ rows·keys·d (S, dP recomputed, dQ); other 4 per score")
    else:
        t.read("dQ_accum", heads * nq * d * f, element_size=f,
               dram=0 if _fits(machine, heads * nq * d * f) else None, formula="conversion reads the accumulator")
        t.write("dQ", heads * nq * d * e, element_size=e, formula="conversion writes dQ in the input dtype")


def _flash2_tiles(p: Problem, machine: Machine, block_m, block_n) -> _TiledPlan:
    """FlashAttention-2's tiles and occupancy, before any decoding choice."""
    bm, bn = flash2_blocks(p, machine)
    bm, bn = block_m or bm, block_n or bn
    smem = (bm + 2 * bn) * p.head_dim * p.element_size
    per_sm = _blocks_per_sm(machine, smem, 128)
    width = flash2_head_dim(p.head_dim)
    return _TiledPlan(bm, bn, bm, bn, per_sm, per_sm, bm, bn, native_gqa=False, fwd_width=width, bwd_width=width,
                      dq_width=width)


def flash2_head_dim(head_dim: int) -> int:
    """The head dim FlashAttention-2's kernels are compiled for that serves
    ``head_dim``: a multiple of 32 up to 192, else 256 (its own rounding of
    the head size), the columns past it zeros."""
    return -(-head_dim // 32) * 32 if head_dim <= 192 else 256


def _flash2_plan(p: Problem, machine: Machine, block_m, block_n) -> _TiledPlan:
    return _decoding_plan(_flash2_tiles(p, machine, block_m, block_n), p, machine, splits=1, pack=False)


def _run_tiled(t: Traffic, p: Problem, machine: Machine, plan: _TiledPlan, passes: str, *,
               deterministic: bool = False, show_decoding: bool = False) -> Traffic:
    """Fills ``t`` with a FlashAttention-2-style algorithm's passes; its
    split and packing choices go with its blocks where they are not the
    plain ones (or always, with ``show_decoding``)."""
    if show_decoding or plan.splits > 1 or plan.pack > 1:
        t.blocks.update({f"{t.algorithm} splits": plan.splits, f"{t.algorithm} packed heads": plan.pack})
    if "fwd" in passes:
        _tiled_forward(t, p, machine, plan)
    if "bwd" in passes:
        _tiled_backward(t, p, machine, plan, deterministic=deterministic)
    return t


def flash2(p: Problem, machine: Machine, passes: str, block_m=None, block_n=None) -> Traffic:
    """FlashAttention-2: query blocks in the outer loop, K/V streamed, the
    LSE written once; the backward parallel over key blocks with dQ
    accumulated in float32 atomics, D precomputed, dQ converted at the end.
    With grouped-query attention dK/dV are computed per query head and summed."""
    t = Traffic("flash2")
    plan = _flash2_plan(p, machine, block_m, block_n)
    t.blocks.update({"flash2 Br": plan.fwd_m, "flash2 Bc": plan.fwd_n})
    return _run_tiled(t, p, machine, plan, passes)


def flash_decoding_blocks(p: Problem) -> tuple[int, int]:
    """FlashAttention-2's split-KV kernel tiles: 64 query rows (4 warps), and
    keys per step by head dim (256 up to 64, 128 up to 128, else 64)."""
    return 64, 256 if p.head_dim <= 64 else 128 if p.head_dim <= 128 else 64


def _flash_decoding_plan(p: Problem, machine: Machine, block_m, block_n) -> _TiledPlan:
    bm, bn = flash_decoding_blocks(p)
    bm, bn = block_m or bm, block_n or bn
    per_sm = _blocks_per_sm(machine, (bm + 2 * bn) * p.head_dim * p.element_size, 128)
    plan = replace(_flash2_tiles(p, machine, None, None), fwd_m=bm, fwd_n=bn, fwd_blocks_per_sm=per_sm)
    # PyTorch's copy of FlashAttention-2 counts the SMs as the slots of its
    # split heuristic (upstream counts two per SM); it packs the query heads
    # of a K/V head for single-token queries.
    return _decoding_plan(plan, p, machine, splits="auto", pack=p.seqlen_q == 1)


def flash_decoding(p: Problem, machine: Machine, passes: str, block_m=None, block_n=None) -> Traffic:
    """FlashAttention-2's decoding path (Flash-Decoding; what PyTorch SDPA's
    flash backend runs for inference shapes): its split-KV kernel (64-row
    query blocks), the keys split over thread blocks by a wave-efficiency
    heuristic where batch x heads x query blocks would not fill the GPU, the
    partial results merged by their LSE, and for single-token queries the
    query heads of a K/V head packed into one block. The backward is
    flash2's."""
    t = Traffic("flash-decoding")
    plan = _flash_decoding_plan(p, machine, block_m, block_n)
    t.blocks.update({"flash-decoding Br": plan.fwd_m, "flash-decoding Bc": plan.fwd_n})
    return _run_tiled(t, p, machine, plan, passes, show_decoding=True)


def cuflash_plan(p: Problem, machine: Machine, block_m=None, block_n=None) -> _TiledPlan:
    """cuflash's own tiles for this problem, from the tables its launcher uses."""
    dtype = cuflash_dtype(p)
    # The launcher's choice for aligned inputs on this machine's generation:
    # a tensor-core forward (wgmma on Hopper where it applies, mma.sync
    # otherwise) for 16-bit types and head_dim % 8 == 0, the SIMT kernel
    # otherwise; the deterministic dQ pass always has the SIMT forward's tiles.
    dq = FAMILY["backward-dq"].tiles(dtype, p.head_dim)
    fwd, bwd = _cuflash_tiles(p, machine)
    # a block-sparse problem stands for a user's mask, which adds into zeros;
    # the launcher's outputs are its own (dq allocated by the call)
    direct_dq = p.block_density == 1 and runs_direct_dq(bwd.kernel, mask_for(p.causal), "dense", p.seqlen_q,
                                                        p.seqlen_k, bwd.block_n, dq_aligned=True)
    fwd_blocks_per_sm = _blocks_per_sm(machine, fwd.forward_smem_bytes(dtype), fwd.threads)
    if fwd.kernel == "wgmma":
        # Its launch bounds set the registers for exactly blocks_per_sm
        # resident blocks; the other kernels are sized by shared memory here.
        fwd_blocks_per_sm = min(fwd_blocks_per_sm, fwd.blocks_per_sm)
    plan = _TiledPlan(
        fwd_m=block_m or fwd.block_m, fwd_n=block_n or fwd.block_n,
        bwd_m=bwd.block_m, bwd_n=bwd.block_n,
        fwd_blocks_per_sm=fwd_blocks_per_sm,
        bwd_blocks_per_sm=_blocks_per_sm(machine, bwd.backward_dkdv_smem_bytes(dtype), bwd.threads),
        dq_m=dq.block_m, dq_n=dq.block_n, native_gqa=True,
        claimed_dq=p.block_density == 1 and not direct_dq and runs_claimed_dq(
            bwd.kernel, family_of("backward-dkdv", bwd.kernel).dq_mode(p.deterministic), mask_for(p.causal), "dense",
            p.seqlen_q, p.seqlen_k, bwd.head_dim_padded),
        direct_dq=direct_dq,
        delta_in_kernel=direct_dq and wgmma_direct_computes_delta(bwd),
        # the buckets the kernels are compiled for; the Hopper forward's
        # products and the backward's but dQ stop at their product_dim
        # (wgmma_product_dim)
        fwd_width=fwd.product_columns, bwd_width=bwd.product_columns,
        dq_width=bwd.head_dim_padded,
    )
    # Decoding, as the launcher decides it (cuflash.api._forward_tiles): on
    # the tensor-core path with 16-bit inputs and at most DECODE_MAX_ROWS
    # query rows per K/V head (one token's query heads packed per K/V head),
    # the mma.sync decode tiles, split-KV by decode_split_count. Problem's
    # num_splits / pack_gqa override.
    pack = p.seqlen_q == 1 and p.group > 1
    rows = p.group if (pack if p.pack_gqa is None else p.pack_gqa) else p.seqlen_q
    if (p.cuflash_decode and dtype in MMA_DTYPES and fwd.kernel in ("mma", "wgmma") and rows <= DECODE_MAX_ROWS
            and block_m is None and block_n is None):
        decode = decode_tilings(dtype, p.head_dim, rows)[1]
        plan = replace(plan, fwd_m=decode.block_m, fwd_n=decode.block_n, fwd_mma=True,
                       fwd_blocks_per_sm=_blocks_per_sm(machine, decode.forward_smem_bytes(dtype), decode.threads),
                       fwd_width=decode.head_dim_padded)
        plan = _decoding_plan(plan, p, machine, splits="cuflash", pack=pack,
                              clusters=machine.compute_capability >= 90
                              and decode_cluster_tiling(decode, 2) is not None)
        # On Hopper a decode the copy engine takes runs with a deeper K/V
        # ring at one block an SM, or over short pages (decode_ring).
        if (machine.compute_capability >= 90 and not plan.clustered
                and decode.warps_split_keys and copy_engine_box_rows(decode.block_n, p.page_size) is not None):
            parallel, key_blocks = _decode_grid(p, plan, plan.pack)
            ring = decode_ring(replace(decode, kv_tma=True), p.page_size, dtype, parallel * plan.splits,
                               _cdiv(key_blocks, plan.splits), machine.sms)
            if ring.kv_stages != decode.kv_stages:
                plan = replace(plan, fwd_blocks_per_sm=_blocks_per_sm(machine, ring.forward_smem_bytes(dtype),
                                                                      ring.threads))
        return plan
    return _decoding_plan(plan, p, machine, splits=1, pack=False)


def cuflash(p: Problem, machine: Machine, passes: str, block_m=None, block_n=None) -> Traffic:
    """This library's kernels, tile for tile: the forward tiles of
    ``cuflash._kernel_families.select`` for the machine's generation
    (tensor-core tiles for 16-bit types), the dQ tiles of the deterministic
    dQ family and the dK/dV tiles ``select`` gives (what the launcher picks). dK/dV per K/V head, walking the query heads of its
    group; ``deterministic`` swaps the atomics for the dQ pass."""
    t = Traffic("cuflash")
    plan = cuflash_plan(p, machine, block_m, block_n)
    t.blocks.update({"cuflash fwd Br": plan.fwd_m, "cuflash fwd Bc": plan.fwd_n,
                     "cuflash bwd Br": plan.bwd_m, "cuflash bwd Bc": plan.bwd_n})
    return _run_tiled(t, p, machine, plan, passes, deterministic=p.deterministic)


ALGORITHMS = {
    "standard": standard,
    "pytorch": pytorch,
    "flash1": flash1,
    "flash2": flash2,
    "flash-decoding": flash_decoding,
    "cuflash": cuflash,
}


def sram_needed(algorithm: str, p: Problem, machine: Machine) -> int:
    """The fewest bytes of SRAM per SM an algorithm's tiles can run in: flash1
    one key row per block (Bc = ⌈M / 4d⌉ >= 1 and the four d-wide tiles),
    flash2 its smallest tiles (16 rows of Q, K and V), cuflash the shared
    memory of the kernels it launches; the unfused algorithms need none."""
    if algorithm == "flash1":
        return 4 * p.head_dim * p.element_size
    if algorithm in ("flash2", "flash-decoding"):
        return 3 * 16 * p.head_dim * p.element_size
    if algorithm == "cuflash":
        dtype = cuflash_dtype(p)
        fwd, bwd = _cuflash_tiles(p, machine)
        return max(fwd.forward_smem_bytes(dtype), bwd.backward_dkdv_smem_bytes(dtype))
    return 0


def _cuflash_tiles(p: Problem, machine: Machine):
    """The forward and dK/dV tiles cuflash's launcher picks for the problem
    on a GPU of the machine's generation whose blocks get its SRAM (so a
    small ``--sram`` takes the small-shared-memory tiles, as on sm_86/sm_89)."""
    dtype = cuflash_dtype(p)

    def tiles(**conditions):
        return (select("forward", dtype, p.head_dim, machine.compute_capability, **conditions),
                select("backward-dkdv", dtype, p.head_dim, machine.compute_capability,
                       deterministic=p.deterministic, **conditions))

    try:
        fwd, bwd = tiles(smem_limit=machine.sram_per_sm)
    except ValueError:  # nothing fits: the unconstrained tiles, whose need sram_needed reports
        fwd, bwd = tiles()
    if fwd.kernel == "wgmma":
        # The tile forward_plan takes by key count, mask and dropout (a
        # short-sequence one, or the table's; a block mask is a user mask's
        # tile map) where its blocks get that much SRAM; persistent blocks
        # are timed as one block a tile (timing.KERNEL_COSTS' per-block cost
        # absorbs the difference).
        mask = "user" if p.block_density < 1 else "causal" if p.causal else "none"
        called = wgmma_forward_for_call(fwd, dtype, p.head_dim, mask, "dense", p.dropout, p.seqlen_k)
        called = with_wgmma_forward_stages(replace(called, persistent=False), dtype)
        # A short tile is one of several blocks an SM: taken only where they all fit.
        if called.blocks_per_sm * called.forward_smem_bytes(dtype) <= machine.sram_per_sm:
            fwd = called
    return fwd, bwd


def cuflash_dtype(p: Problem) -> str:
    """The cuflash dtype of the problem's element size: its kernels take
    2-byte (fp16/bf16) and 4-byte (fp32) elements only."""
    dtype = {2: "float16", 4: "float32"}.get(p.element_size)
    if dtype is None:
        raise ValueError(f"cuflash's kernels take 2-byte (fp16/bf16) or 4-byte (fp32) elements, "
                         f"got {p.element_size}-byte ones")
    return dtype


def run(algorithm: str, problem: Problem, machine: Machine, passes: str = "fwd+bwd",
        block_m: int | None = None, block_n: int | None = None) -> Traffic:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if passes not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {passes!r}")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    needed = sram_needed(algorithm, problem, machine)
    if machine.sram_per_sm < needed:
        raise ValueError(f"{algorithm} needs at least {needed} bytes of SRAM per SM for head_dim {problem.head_dim} "
                         f"and {problem.element_size}-byte elements, the machine has {machine.sram_per_sm}")
    return ALGORITHMS[algorithm](problem, machine, passes, block_m, block_n)


def roofline_seconds(t: Traffic, machine: Machine) -> dict[str, float]:
    """Time on the machine if limited by arithmetic or by DRAM bandwidth."""
    compute = t.matmul_flops / machine.matmul_flops + t.other_flops / machine.nonmatmul_flops
    memory = t.total("dram") / machine.hbm_bandwidth
    return {"compute_s": compute, "memory_s": memory, "estimate_s": max(compute, memory)}


