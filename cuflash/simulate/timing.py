"""A time model of the tiled algorithms: thread blocks, waves, and the pipes of an SM.

The roofline (``algorithms.roofline_seconds``) cannot tell FlashAttention-1,
-2 and cuflash apart where it matters: they do the same matmul FLOPs and
nearly the same DRAM traffic at long sequences. What separates them is how
their work lands on the SMs:

* **Thread blocks and waves.** A kernel is a grid of thread blocks; each SM
  holds ``blocks_per_sm`` of them (shared memory and threads decide), and a
  block runs to its end on the SM it was given. The model hands the blocks
  out in grid order to whichever slot frees first (the hardware's
  dispatcher), so the partial last wave and the unequal blocks of a causal
  mask show. FlashAttention-1 has one block per (batch, head): 16 heads use
  16 of an H100's 132 SMs.
* **The pipes of an SM, per step.** A block's work is a prologue and one step
  per key block (forward) or query block (backward). A step keeps three
  pipes busy: the tensor cores (its matmul FLOPs at the SM's share of the
  machine's rate, times the kernel's ``tensor_efficiency``), the
  special-function units (one exponential per score, 16 per SM per clock on
  the A100 and H100, the bottleneck FlashAttention-3 is built around: at
  head dim 64 they take as long as the matmuls) and the CUDA cores (the other
  float32 work). ``overlap`` says how much of the shorter pipes hides behind
  the longest: 0 runs them one after another (one warp's matmul, then its
  softmax), 1 hides them entirely (FlashAttention-3's ping-pong). Blocks
  resident on one SM share its pipes, so a block's time there is
  ``blocks_per_sm`` times its time alone.
* **DRAM.** A kernel takes at least its DRAM bytes over the bandwidth
  (times the fraction of it the kernel's stream reaches, plus the cycles
  before its first loads land: cuflash's decode blocks, fitted; 1 and 0
  elsewhere); the element-wise kernels of the backward (delta, the dQ
  conversion) are that alone.

The constants of each kernel (``KERNEL_COSTS``: tensor efficiency, overlap,
cycles per step and per block) are fitted to the H100 measurements in
``benchmarks/h100.json`` and stated there; the structure
above, not the fit, is what carries over to other shapes and machines.
``cuflash simulate --measured FILE`` prints the model beside a benchmark
file, with the error per row.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .algorithms import (NONMATMUL, _cdiv, _flash2_plan, _flash_decoding_plan, _TiledPlan, cuflash_plan,
                         flash1_blocks, key_sweep, query_sweep, roofline_seconds, run, split_keys)
from .machines import Machine
from .traffic import STAT_BYTES, Problem


@dataclass(frozen=True)
class KernelCost:
    """How one kernel uses an SM (see the module doc)."""

    tensor_efficiency: float  #: fraction of the machine's matmul rate its products reach
    overlap: float  #: 0: pipes one after another, 1: all behind the longest
    step_cycles: float  #: fixed cycles per step (barriers, pointer and mask work, pipeline fill)
    block_cycles: float  #: fixed cycles per thread block (prologue, epilogue, first loads)
    note: str
    #: fraction of the machine's DRAM bandwidth the kernel's stream reaches
    dram_efficiency: float = 1.0
    #: cycles before a launch that reads DRAM streams at that rate (its
    #: first loads' round trip under load, which no other block's bytes hide)
    dram_latency_cycles: float = 0.0
    #: a forward's CUDA-core operations per score (algorithms.NONMATMUL's
    #: flash_fwd: scale, row max, exp2, row sum) and whether each step
    #: rescales O (2 per output element)
    softmax_ops_per_score: int = NONMATMUL["flash_fwd"]
    rescales_every_step: bool = True


#: Per algorithm, pass and (cuflash) kernel generation. Fitted to
#: benchmarks/h100.json (the FlashAttention-2 grid: head dims 64 and 128,
#: seqlen 512-16k at 16k tokens, causal and not; one run on 687d89a, both
#: Hopper kernels warp-specialised, forward bf16 and fp16, backward bf16) by
#: a grid search minimising the largest relative error; flash2, PyTorch
#: SDPA's flash backend (FlashAttention-2's mma.sync code) in that run, 20%
#: forward and 21% backward. cuflash's backward refitted to the run on
#: cfde18a (largest error plus half the mean; its dQ tile stores no longer
#: recompute the swizzle per store): within 8.0% (mean 3.8%). Its forward
#: refitted to the same run (the softmax takes rows' maxima only where a
#: lane's sum asks for them: 3 CUDA-core operations a score, and O rescaled
#: once a block rather than every step), on the tiles the launcher takes by
#: key count and mask (``wgmma_forward_for_call``: head dim 64's
#: short-sequence tiles), with DRAM terms of its own as the decode blocks
#: have (its short calls stream at 0.60 of the preset's rate, about 2.0
#: TB/s: d128 causal at 512 keys moves 268 MB in 119 us; and about 1.6 us
#: before the first loads land): within 16.4% at every point, bf16 and fp16
#: (mean 8.6%; without the DRAM terms 24.2%, mean 10.4%;
#: persistent blocks, up to 1k-8k keys, are modelled as one block a tile with
#: a smaller per-block cost, and head dim 64's short causal tiles, several
#: resident blocks of one consumer each, fit the block-sharing rule worst).
#: cuflash's mma.sync kernels (sm_80/sm_89, or Hopper without sm_90a) take
#: flash2's constants: same instructions, not fitted on their own; on Hopper
#: its decode blocks ("decode") take their own, fitted to the decode table. flash1
#: takes flash2's pipes with its own grid and HBM round trips.
KERNEL_COSTS = {
    ("cuflash", "fwd", 90): KernelCost(0.80, 0.80, 0, 2000, "wgmma forward, warp-specialised: one "
                                                              "consumer warpgroup's products run while another "
                                                              "computes its softmax (ping-pong), and each "
                                                              "softmax while its own P V runs; rows' maxima "
                                                              "only where a lane's sum asks for them, O "
                                                              "rescaled only where a factor is not 1",
                                       dram_efficiency=0.60, dram_latency_cycles=3000,
                                       softmax_ops_per_score=3, rescales_every_step=False),
    ("cuflash", "bwd", 90): KernelCost(0.66, 1.00, 500, 12500, "wgmma backward, warp-specialised: dQ added "
                                                                 "by the copy engine, products of one consumer "
                                                                 "behind the element-wise work of the other"),
    # Fitted to the decode tables of f33f082 and 69d542b (two H100s:
    # benchmarks/h100-f33f082_kvcache.json and h100_kvcache.json; 48
    # points x contiguous, 16- and 256-row pages each) by a grid search over
    # the block and step cycles, the DRAM latency and efficiency, minimising
    # the largest relative error (and half the mean), the pipes' constants
    # left at flash2's (a decode block's products and exponentials are too
    # small to fit them): largest error 19.7% and 20.1%, mean 4.4% and 4.7%
    # over each table's 144 rows (without the DRAM terms: 28.3% and 29.2%,
    # means 11.0% and 9.4%). The two DRAM terms are what the traces showed
    # (docs/perf-notes.md): copy-engine streams at 3.08 of the preset's 3.35
    # TB/s, and about a microsecond before a call's first K/V lands.
    ("cuflash", "decode", 90): KernelCost(0.55, 0.50, 700, 1000, "mma.sync decode blocks on Hopper: copy-engine "
                                                                "K/V through a ring, one query tile, the warps' "
                                                                "states merged together",
                                          dram_efficiency=0.92, dram_latency_cycles=1800),
    # Its DRAM efficiency from the same decode tables' SDPA flash column
    # (flash-decoding), where it alone binds: 0.80 of the preset's rate
    # (2.7 TB/s, what SDPA's flash backend reads on large calls): mean error
    # 14.1% / 14.7% -> 7.9% / 8.6%, and the model orders it and cuflash as
    # measured at 48 of 48 points (29 at 1.0); the FlashAttention-2 grid's
    # rows, compute-bound, unchanged.
    ("flash2", "fwd", 0): KernelCost(0.55, 0.50, 500, 5000, "FlashAttention-2 forward (mma.sync; several "
                                                           "blocks per SM interleave their pipes)",
                                     dram_efficiency=0.80),
    ("flash2", "bwd", 0): KernelCost(0.55, 0.00, 3000, 20000, "FlashAttention-2 backward (mma.sync)"),
}


#: The DRAM terms of a launch without a kernel cost (element-wise kernels):
#: the machine's rate, no latency.
_NO_KERNEL_COST = KernelCost(1.0, 0.0, 0, 0, "element-wise: DRAM time alone")


def kernel_cost(algorithm: str, pass_name: str, machine: Machine) -> KernelCost:
    """The constants of an algorithm's kernel on a machine's generation
    (cuflash: the Hopper kernels on compute capability 9.0, ``pass_name``
    "decode" its decode blocks there; below it the mma.sync kernels with
    flash2's forward or backward constants; flash1 and flash2 the same
    everywhere)."""
    if algorithm == "cuflash" and machine.compute_capability >= 90:
        return KERNEL_COSTS[("cuflash", pass_name, 90)]
    return KERNEL_COSTS[("flash2", "fwd" if pass_name == "decode" else pass_name, 0)]


@dataclass(frozen=True)
class BlockWork:
    """One thread block's work."""

    steps: int
    matmul_flops: float
    exps: float
    other_flops: float


@dataclass
class Launch:
    """One kernel launch: its blocks in grid order (``(count, work)`` runs),
    blocks per SM, DRAM bytes and costs; ``seconds`` once timed."""

    name: str
    blocks: list[tuple[int, BlockWork]]
    blocks_per_sm: int
    dram_bytes: float
    cost: KernelCost | None
    #: fraction of the machine's DRAM bandwidth its blocks can pull (flash1:
    #: only the busy SMs' share)
    bandwidth_share: float = 1.0
    seconds: float = 0.0
    compute_seconds: float = 0.0
    memory_seconds: float = 0.0
    waves: float = 0.0


def block_seconds(work: BlockWork, cost: KernelCost, machine: Machine) -> float:
    """A block's time on an SM it has to itself: prologue plus steps, each
    step its pipes combined by ``cost.overlap``."""
    sm_matmul = machine.matmul_flops / machine.sms * cost.tensor_efficiency
    sm_other = machine.nonmatmul_flops / machine.sms
    pipes = (work.matmul_flops / sm_matmul, work.exps / (machine.exp_per_clock * machine.clock_hz),
             work.other_flops / sm_other)
    longest = max(pipes)
    busy = longest + (1 - cost.overlap) * (sum(pipes) - longest)
    return busy + (cost.step_cycles * work.steps + cost.block_cycles) / machine.clock_hz


def _makespan(durations: list[tuple[int, float]], slots: int) -> float:
    """The time the last block ends when blocks (in grid order, ``(count,
    seconds)`` runs) go to whichever of ``slots`` frees first."""
    total = sum(count for count, _ in durations)
    if total <= slots:
        return max((seconds for count, seconds in durations if count), default=0.0)
    if total > 200_000:  # very large grids: the balanced bound, with the longest block as the floor
        work = sum(count * seconds for count, seconds in durations)
        return max(work / slots, max(seconds for _, seconds in durations))
    free = [0.0] * slots
    for count, seconds in durations:
        for _ in range(count):
            start = heapq.heappop(free)
            heapq.heappush(free, start + seconds)
    return max(free)


def time_launch(launch: Launch, machine: Machine) -> Launch:
    """Fills in the launch's compute (waves of blocks), memory and total time."""
    slots = machine.sms * launch.blocks_per_sm
    if launch.cost is not None and launch.blocks:
        durations = [(count, launch.blocks_per_sm * block_seconds(work, launch.cost, machine))
                     for count, work in launch.blocks]
        launch.compute_seconds = _makespan(durations, slots)
        launch.waves = sum(count for count, _ in launch.blocks) / slots
    cost = launch.cost or _NO_KERNEL_COST
    launch.memory_seconds = launch.dram_bytes / (machine.hbm_bandwidth * launch.bandwidth_share * cost.dram_efficiency)
    if launch.dram_bytes > 0:
        launch.memory_seconds += cost.dram_latency_cycles / machine.clock_hz
    launch.seconds = max(launch.compute_seconds, launch.memory_seconds) + machine.launch_seconds
    return launch


# --------------------------------------------------------------------------
# The launches of each algorithm
# --------------------------------------------------------------------------

def _forward_blocks(p: Problem, plan: _TiledPlan, cost: KernelCost) -> list[tuple[int, BlockWork]]:
    """One block per (row owner, query block, split) with the keys it
    visits, longest first (as both tensor-core forwards and
    FlashAttention-2 schedule causal grids). The tensor cores and the
    exponentials work on whole tiles: a block of one query row (decoding)
    costs what a full one does, which is why one-token queries want their
    query heads packed into the rows and their keys split over blocks; so do
    the head dim's padded columns (``plan.fwd_width``)."""
    d, block_m, block_n = plan.fwd_width or p.head_dim, plan.fwd_m, plan.fwd_n
    owners = p.kv_heads if plan.pack > 1 else p.heads
    blocks = split_keys(query_sweep(p, block_m, block_n, plan.pack), block_n, plan.splits)
    runs = []
    for b in sorted(blocks, key=lambda b: -b.keys):
        steps = _cdiv(b.keys, block_n)
        tile_pairs = block_m * steps * block_n
        rescale = 2 * block_m * d * (steps if cost.rescales_every_step else 1)
        runs.append((owners, BlockWork(steps, 4 * tile_pairs * d, tile_pairs,
                                       cost.softmax_ops_per_score * tile_pairs + rescale)))
    return runs


def _backward_blocks(p: Problem, plan: _TiledPlan, group: int) -> list[tuple[int, BlockWork]]:
    """One block per (K/V owner, key block): it walks the query rows it sees
    of ``group`` query heads; S, dP, dV and dK over ``plan.bwd_width``
    columns, dQ over ``plan.dq_width``."""
    block_m, block_n = plan.bwd_m, plan.bwd_n
    width, dq_width = plan.bwd_width or p.head_dim, plan.dq_width or p.head_dim
    owners = p.heads // group
    runs = []
    for b in sorted(key_sweep(p, block_m, block_n), key=lambda b: -b.rows * b.keys):
        pairs = group * b.rows * b.keys
        runs.append((owners, BlockWork(group * _cdiv(b.rows, block_m), (8 * width + 2 * dq_width) * pairs, pairs,
                                       NONMATMUL["flash_bwd"] * pairs)))
    return runs


def _elementwise(name: str, nbytes: float) -> Launch:
    return Launch(name, [], 1, nbytes, None)


def launches(algorithm: str, p: Problem, machine: Machine, passes: str) -> list[Launch]:
    """The kernels an algorithm launches for ``passes``, untimed."""
    e, f, d, heads, nq = p.element_size, STAT_BYTES, p.head_dim, p.heads, p.seqlen_q
    out: list[Launch] = []
    if algorithm in ("flash2", "flash-decoding", "cuflash"):
        plan = {"cuflash": cuflash_plan, "flash2": _flash2_plan,
                "flash-decoding": _flash_decoding_plan}[algorithm](p, machine, None, None)
        group = p.group if plan.native_gqa else 1
        if "fwd" in passes:
            forward_dram = run(algorithm, p, machine, "fwd").total("dram")
            merge = 0
            if plan.splits > 1 and not plan.clustered:
                # the merge kernel: partial O and LSE in (from L2), O and LSE out
                merge = heads * nq * (d * e + f)
            # cuflash's decode tiles run its mma.sync forward: on Hopper with
            # the decode blocks' own constants, before it flash2's
            cost = kernel_cost(algorithm, "decode" if plan.fwd_mma else "fwd", machine)
            out.append(Launch(f"{algorithm} forward", _forward_blocks(p, plan, cost), plan.fwd_blocks_per_sm,
                              forward_dram - merge, cost))
            if merge:
                out.append(_elementwise(f"{algorithm} split-KV merge", merge))
        if "bwd" in passes:
            # delta = rowsum(dO * O) and the zeroed float32 dQ accumulator
            # (not where the dK/dV kernel stores each block's first tile, or
            # stores dQ itself) before (not where the dK/dV kernel computes
            # delta too); the accumulator converted to the input dtype after
            # (not where dQ is stored directly).
            zeroed = not (plan.claimed_dq or plan.direct_dq)
            preprocess = 0 if plan.delta_in_kernel else heads * nq * (2 * d * e + f + (d * f if zeroed else 0))
            conversion = 0 if plan.direct_dq else heads * nq * d * (f + e)
            backward_dram = run(algorithm, p, machine, "bwd").total("dram")
            if not plan.delta_in_kernel:
                out.append(_elementwise(f"{algorithm} backward preprocess", preprocess))
            out.append(Launch(f"{algorithm} backward dK/dV", _backward_blocks(p, plan, group),
                              plan.bwd_blocks_per_sm, max(backward_dram - preprocess - conversion, 0.0),
                              kernel_cost(algorithm, "bwd", machine)))
            if not plan.direct_dq:
                out.append(_elementwise(f"{algorithm} backward dQ conversion", conversion))
        return out
    if algorithm == "flash1":
        br, bc = flash1_blocks(p, machine)
        for pass_name in ("fwd", "bwd"):
            if pass_name not in passes:
                continue
            # One block per (batch, head): a head's share of the pass's FLOPs
            # (algorithms.flash1), one step per inner tile. Alone on its SM,
            # its per-step HBM round trips (O, l, m; dQ) come through the
            # busy SMs only.
            pass_traffic = run(algorithm, p, machine, pass_name)
            if pass_name == "fwd":
                sweep = query_sweep(p, br, bc)
                steps = sum(_cdiv(b.keys, bc) for b in sweep)
            else:
                sweep = key_sweep(p, br, bc)
                steps = sum(_cdiv(b.rows, br) for b in sweep)
            work = BlockWork(steps, pass_traffic.matmul_flops / heads, sum(b.rows * b.keys for b in sweep),
                             pass_traffic.other_flops / heads)
            out.append(Launch(f"flash1 {'forward' if pass_name == 'fwd' else 'backward'}", [(heads, work)], 1,
                              pass_traffic.total("dram"), kernel_cost(algorithm, pass_name, machine),
                              bandwidth_share=min(heads, machine.sms) / machine.sms))
        return out
    # Unfused pipelines: each op at its own roofline, one after another.
    traffic = run(algorithm, p, machine, passes)
    roof = roofline_seconds(traffic, machine)
    out.append(Launch(f"{algorithm} (roofline)", [], 1, traffic.total("dram"), None,
                      compute_seconds=roof["compute_s"]))
    return out


def estimate(algorithm: str, p: Problem, machine: Machine, passes: str) -> dict:
    """Seconds of an algorithm's passes on the machine, with the launches it
    is made of (name, seconds, compute, memory, waves)."""
    timed = [time_launch(launch, machine) for launch in launches(algorithm, p, machine, passes)]
    return {
        "seconds": sum(launch.seconds for launch in timed),
        "launches": [{"name": launch.name, "seconds": launch.seconds, "compute_s": launch.compute_seconds,
                      "memory_s": launch.memory_seconds, "waves": launch.waves,
                      "blocks_per_sm": launch.blocks_per_sm} for launch in timed],
    }


#: Which modelled algorithm stands for a benchmark column, per kind of row:
#: SDPA's flash backend runs FlashAttention-2's training kernels, and for
#: decoding its split-KV path.
_MEASURED_AS = {"fwd": (("cuflash", "cuflash"), ("flash2", "flash")),
                "bwd": (("cuflash", "cuflash"), ("flash2", "flash")),
                "decode": (("cuflash", "cuflash"), ("flash-decoding", "flash"))}


def decode_table_rows(decode: list[dict]) -> list[dict]:
    """The rows of ``tools/bench.py --decode-only``'s table (``decode``:
    K/V bytes and TB/s per column: cuflash's ``contiguous`` and
    ``paged<page size>``, SDPA's ``flash`` and ``cudnn``) as
    ``compare_with_bench`` takes them: one row per cache layout, its
    milliseconds from the bytes and the rate; SDPA ran on the contiguous
    cache only."""
    rows = []
    for row in decode:
        rates = row["kv_tbps"]
        shape = {key: row[key] for key in ("pass", "dtype", "head_dim", "causal", "batch", "heads", "kv_heads",
                                           "seqlen_q", "seqlen_k")}
        sdpa = {name: rates[name] for name in ("flash", "cudnn") if name in rates}
        for layout, rate in rates.items():
            if layout == "contiguous":
                page_size, columns = None, {"cuflash": rate} | sdpa
            elif layout.startswith("paged"):
                page_size, columns = int(layout.removeprefix("paged")), {"cuflash": rate}
            else:
                continue
            rows.append(shape | {"page_size": page_size,
                                 "ms": {name: row["kv_bytes"] / (r * 1e12) * 1e3 for name, r in columns.items()}})
    return rows


def compare_with_bench(rows: list[dict], machine: Machine) -> list[dict]:
    """The model's times beside a benchmark file's measured ones, one record
    per (16-bit row, algorithm): ``fwd`` and ``bwd`` rows of ``tools/bench.py``
    (cuflash and flash2 against cuflash and SDPA flash) and ``decode`` rows
    (a forward with ``seqlen_q`` query tokens against a cache of ``seqlen_k``,
    ``kv_heads`` K/V heads and optionally ``page_size``: cuflash and
    flash-decoding; ``cuflash_decode`` false: measured before cuflash's
    decode path existed). Each record has the row's shape, ``measured_ms``,
    ``model_ms`` and ``error`` (model / measured - 1)."""
    records = []
    for row in rows:
        if row["dtype"] not in ("bfloat16", "float16") or row["pass"] not in _MEASURED_AS:
            continue
        decode = row["pass"] == "decode"
        seqlen_q = row["seqlen_q"] if decode else row["seqlen"]
        seqlen_k = row["seqlen_k"] if decode else row["seqlen"]
        kv_heads = row.get("kv_heads", row["heads"])
        problem = Problem(batch=row["batch"], nheads=row["heads"], nheads_k=kv_heads, seqlen_q=seqlen_q,
                          seqlen_k=seqlen_k, head_dim=row["head_dim"], element_size=2, causal=row["causal"],
                          page_size=row.get("page_size"), cuflash_decode=row.get("cuflash_decode", True))
        for algorithm, measured_as in _MEASURED_AS[row["pass"]]:
            if measured_as not in row["ms"]:
                continue
            model_ms = estimate(algorithm, problem, machine, "fwd" if decode else row["pass"])["seconds"] * 1e3
            records.append({"pass": row["pass"], "dtype": row["dtype"], "head_dim": row["head_dim"],
                            "causal": row["causal"], "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
                            "batch": row["batch"], "heads": row["heads"], "kv_heads": kv_heads,
                            "page_size": row.get("page_size"), "algorithm": algorithm,
                            "measured_ms": row["ms"][measured_as], "model_ms": model_ms,
                            "error": model_ms / row["ms"][measured_as] - 1})
    return records


def ranking_agreement(records: list[dict]) -> tuple[int, int]:
    """(points where the model orders cuflash and the other algorithm as
    measured, points with both); a modelled tie counts as disagreement."""
    pairs: dict[tuple, dict] = {}
    shape = ("pass", "dtype", "head_dim", "causal", "seqlen_q", "seqlen_k", "batch", "heads", "kv_heads", "page_size")
    for r in records:
        pairs.setdefault(tuple(r[key] for key in shape), {})[r["algorithm"]] = r
    both = [(pair["cuflash"], other) for pair in pairs.values() if "cuflash" in pair
            for name, other in pair.items() if name != "cuflash"]
    agree = sum((ours["model_ms"] < other["model_ms"]) == (ours["measured_ms"] < other["measured_ms"])
                and ours["model_ms"] != other["model_ms"] for ours, other in both)
    return agree, len(both)
