"""Attention across GPUs (context parallelism): ring attention and Ulysses.

The sequence is sharded over ``gpus`` GPUs of one machine kind linked at
``link_bandwidth`` bytes per second each way per GPU (NVLink through
NVSwitch: every GPU sends and receives at that rate at once). Per GPU the
model gives the HBM bytes its kernels and transfers move, the bytes it sends
to other GPUs, and the time, from the single-GPU time model
(``timing.estimate``) of the local attention each step runs.

* **Ring** (each GPU keeps its queries; K/V blocks travel around the ring,
  partial results merge by their log-sum-exp, all at once after the last
  step): ``gpus`` steps (``cuflash.distributed.schedule``); step j
  attends the local queries to the K/V block received j steps ago while the
  next block travels, so a step takes the longer of its attention and its
  transfer (``overlap``). The backward sends K/V around again with the dK/dV
  accumulated for them (float32), and attends with 2.5x the forward's work;
  after its last step the completed dK/dV go home in the inputs' dtype, a
  transfer nothing hides. The ring's own element-wise work (the forward's
  merge of every step's partial output, the backward's float32 sums) counts
  at the HBM bandwidth.
  Causal attention with contiguous shards leaves the last rank a full block
  every step while others idle; **balanced** sharding (each rank holds
  chunks i and 2 gpus - 1 - i) gives every rank half a block every step
  after the first.
* **Ulysses** (all-to-all over heads): an all-to-all turns the sequence
  shards of Q, K and V into head shards (every GPU then holds the whole
  sequence for nheads / gpus heads), attention runs locally, and a second
  all-to-all returns the output to sequence shards; the backward moves dO
  in and dQ, dK, dV out. The all-to-alls are not hidden behind the
  attention (they sit between the layer's projections and its attention).
  Needs nheads divisible by gpus; K/V heads fewer than the GPUs are
  replicated (each GPU receives the K/V head its query heads use).

Rule of thumb (``choose``): per GPU and forward + backward, a ring sends
about 16 S nheads_k d bytes in bf16 whatever the GPU count (every K/V block
visits every GPU; the backward's dK/dV travel in float32; exactly
(16 (gpus - 1) + 4) S nheads_k d / gpus), Ulysses about 8 (S / gpus)
(nheads + nheads_k) d (nheads_k at least gpus: replicated; times
(gpus - 1) / gpus where data stays home): the ring sends
gpus (4 gpus - 3) nheads_k / (2 (gpus - 1) (nheads + nheads_k)) times
Ulysses' bytes, about 2 gpus nheads_k / (nheads + nheads_k) on many GPUs
(5 nheads_k / (nheads + nheads_k) on two). So grouped-query
models on few GPUs favour the ring, many heads and many GPUs Ulysses; only
the ring hides its transfers behind the attention, and Ulysses cannot use
more GPUs than heads. The model's times decide.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .machines import Machine
from .timing import estimate
from .traffic import STAT_BYTES, Problem

#: NVLink bandwidth each way per GPU, bytes per second (datasheets: NVLink 4
#: 900 GB/s and NVLink 3 600 GB/s both ways together).
LINK_BANDWIDTH = {"a100": 300e9, "h100": 450e9, "h200": 450e9}
#: Fixed cost of one transfer (NCCL send/receive or all-to-all launch and
#: synchronisation), seconds.
TRANSFER_LATENCY = 10e-6
STRATEGIES = ("ring", "ulysses")


@dataclass(frozen=True)
class Step:
    """One step of one pass on the busiest GPU."""

    name: str
    attention_s: float
    transfer_bytes: int
    transfer_s: float
    seconds: float


@dataclass(frozen=True)
class DistributedEstimate:
    strategy: str
    gpus: int
    passes: str
    link_bandwidth: float
    steps: tuple[Step, ...]
    seconds: float  #: per pass set, the busiest GPU
    sent_bytes_per_gpu: int  #: to other GPUs
    hbm_bytes_per_gpu: int  #: requested by its kernels and transfers
    dram_bytes_per_gpu: int  #: the same after the L2 cache (the traffic model's estimate)
    single_gpu_seconds: float  #: the same problem on one GPU (if it fits)

    @property
    def attention_s(self) -> float:
        return sum(step.attention_s for step in self.steps)

    @property
    def exposed_transfer_s(self) -> float:
        """Transfer time not hidden behind attention."""
        return self.seconds - self.attention_s

    @property
    def speedup(self) -> float:
        return self.single_gpu_seconds / self.seconds


def _check(problem: Problem, gpus: int, strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if gpus < 2:
        raise ValueError(f"context parallelism needs at least 2 GPUs, got {gpus}")
    if problem.seqlen_q != problem.seqlen_k:
        raise ValueError("context parallelism shards one sequence: seqlen_q and seqlen_k must be equal, got "
                         f"{problem.seqlen_q} and {problem.seqlen_k}")
    if problem.seqlen_q % (2 * gpus):
        raise ValueError(f"the sequence ({problem.seqlen_q}) must split into 2 x {gpus} equal chunks")
    if strategy == "ulysses" and problem.nheads % gpus:
        raise ValueError(f"Ulysses gives each GPU nheads / gpus heads: {problem.nheads} heads do not divide over "
                         f"{gpus} GPUs")


def _attention(problem: Problem, machine: Machine, passes: str) -> tuple[float, int, int]:
    """Seconds, requested HBM bytes and DRAM bytes of cuflash's kernels on one GPU."""
    from .algorithms import run

    seconds = estimate("cuflash", problem, machine, passes)["seconds"]
    terms = run("cuflash", problem, machine, passes).terms
    return seconds, sum(term.requested for term in terms), sum(term.dram for term in terms)


def _kv_bytes(problem: Problem, tokens: int, element_size: int) -> int:
    return 2 * problem.batch * tokens * problem.nheads_k * problem.head_dim * element_size


def ring(problem: Problem, machine: Machine, gpus: int, passes: str = "fwd+bwd", *, balanced: bool = True,
         link_bandwidth: float | None = None, overlap: bool = True) -> DistributedEstimate:
    """Ring attention (see the module doc)."""
    _check(problem, gpus, "ring")
    link = link_bandwidth or LINK_BANDWIDTH[machine.name.split()[0]]
    shard = problem.seqlen_q // gpus
    full = dataclasses.replace(problem, seqlen_q=shard, seqlen_k=shard, causal=False)
    # A balanced rank's off-diagonal step: its two query chunks against half
    # the received keys' work (two of four chunk pairs visible).
    half = dataclasses.replace(problem, seqlen_q=shard, seqlen_k=shard // 2, causal=False)
    diagonal = dataclasses.replace(problem, seqlen_q=shard, seqlen_k=shard)  # causal as given
    steps, hbm, dram, sent = [], 0, 0, 0
    for pass_name in ("fwd", "bwd"):
        if pass_name not in passes.split("+"):
            continue
        for j in range(gpus):
            local = diagonal if j == 0 else (half if problem.causal and balanced else full)
            attention_s, attention_bytes, attention_dram = _attention(local, machine, pass_name)
            last = j == gpus - 1
            rows = problem.batch * local.seqlen_q * problem.nheads
            keys = problem.batch * local.seqlen_k * problem.nheads_k
            if pass_name == "fwd":
                # Each step writes its partial output and LSE to a slot of
                # its own; after the last one a merge reads all the slots
                # and writes the output and LSE (cuflash.distributed: one rounding).
                shard_rows = problem.batch * shard * problem.nheads
                ring_bytes = (shard_rows * (gpus + 1) * (problem.head_dim * problem.element_size + STAT_BYTES)
                              if last else 0)
                # K/V on to the next rank, but after the last step
                transfer_bytes = 0 if last else _kv_bytes(problem, shard, problem.element_size)
            else:
                # The ring's float32 sums: the step's dQ and dK/dV (the
                # inputs' dtype) read, the sums read and written; at the end
                # dQ converted to the inputs' dtype.
                ring_bytes = (rows + 2 * keys) * problem.head_dim * (problem.element_size + 2 * STAT_BYTES)
                if last:
                    ring_bytes += problem.batch * shard * problem.nheads * problem.head_dim * (
                        STAT_BYTES + problem.element_size)
                # K/V with their float32 dK/dV sums on to the next rank; after
                # the last step the completed sums go home in the inputs' dtype
                transfer_bytes = (_kv_bytes(problem, shard, problem.element_size) if last else
                                  _kv_bytes(problem, shard, problem.element_size) + _kv_bytes(problem, shard, STAT_BYTES))
            attention_s += ring_bytes / machine.hbm_bandwidth
            transfer_s = transfer_bytes / link + TRANSFER_LATENCY if transfer_bytes else 0.0
            # The backward's last transfer follows its last attention: nothing hides it.
            hidden = overlap and not (pass_name == "bwd" and last)
            seconds = max(attention_s, transfer_s) if hidden else attention_s + transfer_s
            steps.append(Step(f"{pass_name} step {j}", attention_s, transfer_bytes, transfer_s, seconds))
            # received blocks land in HBM and sent ones are read from it
            hbm += attention_bytes + ring_bytes + 2 * transfer_bytes
            dram += attention_dram + ring_bytes + 2 * transfer_bytes
            sent += transfer_bytes
    total = sum(step.seconds for step in steps)
    single = _attention(problem, machine, passes)[0]
    return DistributedEstimate("ring", gpus, passes, link, tuple(steps), total, sent, hbm, dram, single)


def ulysses(problem: Problem, machine: Machine, gpus: int, passes: str = "fwd+bwd", *,
            link_bandwidth: float | None = None) -> DistributedEstimate:
    """Ulysses: all-to-all over heads (see the module doc)."""
    _check(problem, gpus, "ulysses")
    link = link_bandwidth or LINK_BANDWIDTH[machine.name.split()[0]]
    shard = problem.seqlen_q // gpus
    local_kv = max(1, problem.nheads_k // gpus)  # fewer K/V heads than GPUs: replicated
    local = dataclasses.replace(problem, nheads=problem.nheads // gpus, nheads_k=local_kv)
    elem, d, b = problem.element_size, problem.head_dim, problem.batch
    away = (gpus - 1) / gpus  # the share of an all-to-all's data that leaves the GPU

    def all_to_all(name: str, heads: float) -> Step:
        nbytes = int(away * b * shard * heads * d * elem)
        seconds = nbytes / link + TRANSFER_LATENCY
        return Step(name, 0.0, nbytes, seconds, seconds)

    steps, hbm, dram = [], 0, 0
    kv_heads = local_kv * gpus  # K/V heads held across the GPUs after the exchange
    for pass_name in ("fwd", "bwd"):
        if pass_name not in passes.split("+"):
            continue
        if pass_name == "fwd":
            steps.append(all_to_all("fwd all-to-all Q, K, V", problem.nheads + 2 * kv_heads))
        else:
            steps.append(all_to_all("bwd all-to-all dO", problem.nheads))
        attention_s, attention_bytes, attention_dram = _attention(local, machine, pass_name)
        steps.append(Step(f"{pass_name} attention", attention_s, 0, 0.0, attention_s))
        hbm += attention_bytes
        dram += attention_dram
        if pass_name == "fwd":
            steps.append(all_to_all("fwd all-to-all O", problem.nheads))
        else:
            steps.append(all_to_all("bwd all-to-all dQ, dK, dV", problem.nheads + 2 * kv_heads))
    sent = sum(step.transfer_bytes for step in steps)
    hbm += 2 * sent  # read to send, written on receipt (the same amount arrives)
    dram += 2 * sent
    single = _attention(problem, machine, passes)[0]
    total = sum(step.seconds for step in steps)
    return DistributedEstimate("ulysses", gpus, passes, link, tuple(steps), total, sent, hbm, dram, single)


def choose(problem: Problem, machine: Machine, gpus: int, passes: str = "fwd+bwd",
           link_bandwidth: float | None = None) -> DistributedEstimate:
    """The faster of the strategies that apply (balanced ring for causal)."""
    options = [ring(problem, machine, gpus, passes, link_bandwidth=link_bandwidth)]
    if problem.nheads % gpus == 0:
        options.append(ulysses(problem, machine, gpus, passes, link_bandwidth=link_bandwidth))
    return min(options, key=lambda option: option.seconds)


def report(result: DistributedEstimate) -> list[str]:
    """Text lines of an estimate."""
    lines = [f"{result.strategy} attention over {result.gpus} GPUs ({result.passes}), links "
             f"{result.link_bandwidth / 1e9:.0f} GB/s each way per GPU:"]
    for step in result.steps:
        lines.append(f"  {step.name:28} attention {step.attention_s * 1e3:8.3f} ms  transfer "
                     f"{step.transfer_bytes / 1e6:9.2f} MB {step.transfer_s * 1e3:8.3f} ms  -> {step.seconds * 1e3:8.3f} ms")
    lines.append(f"  time {result.seconds * 1e3:.3f} ms (attention {result.attention_s * 1e3:.3f} ms, transfers "
                 f"exposed {result.exposed_transfer_s * 1e3:.3f} ms); one GPU {result.single_gpu_seconds * 1e3:.3f} "
                 f"ms: {result.speedup:.2f}x")
    lines.append(f"  per GPU: sends {result.sent_bytes_per_gpu / 1e9:.3f} GB; HBM {result.hbm_bytes_per_gpu / 1e9:.3f} "
                 f"GB requested, {result.dram_bytes_per_gpu / 1e9:.3f} GB DRAM (estimate)")
    return lines


def as_dict(result: DistributedEstimate) -> dict:
    """An estimate as JSON-ready values."""
    return {"strategy": result.strategy, "gpus": result.gpus, "passes": result.passes,
            "link_bandwidth": result.link_bandwidth, "seconds": result.seconds, "attention_s": result.attention_s,
            "exposed_transfer_s": result.exposed_transfer_s, "single_gpu_seconds": result.single_gpu_seconds,
            "speedup": result.speedup, "sent_bytes_per_gpu": result.sent_bytes_per_gpu,
            "hbm_bytes_per_gpu": result.hbm_bytes_per_gpu, "dram_bytes_per_gpu": result.dram_bytes_per_gpu,
            "steps": [dataclasses.asdict(step) for step in result.steps]}
