#!/usr/bin/env python3
"""Context-parallel attention on several GPUs against one (issue 19).

Started with one process a GPU:

  python -m torch.distributed.run --nproc_per_node 2 tools/bench_ring.py [--seqlen 128k] [--timeline] [--out DIR]

For each configuration (whole sequence ``--seqlen``, batch 1, ``--heads``
query heads, ``--kv-heads``, head_dim ``--head-dim``, bf16; causal and not):

* ``one GPU``: cuflash forward + backward (PyTorch autograd) of the whole
  sequence on rank 0's GPU, while the others wait;
* ``ring``: ``cuflash.distributed.ring_attention`` forward + backward on
  every rank (balanced sharding when causal), the slowest rank's time;
* ``ring, serialised``: the same with every transfer finished before the
  step after it starts (no overlap): the difference is the communication
  the ring hides;
* ``ulysses``: ``ulysses_attention`` forward + backward;
* ``model``: ``cuflash simulate``'s prediction for the ring
  (``cuflash.simulate.distributed.ring``) on this machine;
* with ``--timeline``: one ring step under the PyTorch profiler on every
  rank (Chrome traces ``ring_trace_*_rank*.json`` under ``--out``), and how
  long the GPU ran no kernel but NCCL's during the step (transfers not
  hidden, and host gaps).

Times: CUDA events around one forward + backward step, after a barrier,
median of ``--repeats``; the ring's is the maximum over ranks. Speedup =
one GPU's time / the ring's. Writes ``bench_ring_<seqlen>k.json`` under ``--out``
(default $OUT) and a table to stdout from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _size(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def _step_ms(torch, step, repeats: int, dist=None) -> float:
    """Median ms of ``step()`` (forward + backward) after a warm-up; with
    ``dist``, every rank starts after a barrier and the slowest rank's time
    counts."""
    samples = []
    step()  # warm-up: plans, kernels, NCCL channels
    for _ in range(repeats):
        torch.cuda.synchronize()
        if dist is not None:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        elapsed = torch.tensor([start.elapsed_time(end)], device="cuda")
        if dist is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(float(elapsed))
    return statistics.median(samples)


def _overlap_from_trace(path: Path) -> dict:
    """From a Chrome trace of one step (after the barrier that starts it):
    the step's span on the GPU, how much of it attention and element-wise
    kernels filled, and NCCL's send/receive kernels (their time includes
    waiting for the peer)."""
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel" and "dur" in e]
    barrier_end = max((end for _, end, name in kernels if "AllReduce" in name), default=-1.0)
    kernels = [kernel for kernel in kernels if kernel[0] >= barrier_end]
    nccl = [(start, end) for start, end, name in kernels if "nccl" in name.lower()]
    compute = sorted((start, end) for start, end, name in kernels if "nccl" not in name.lower())
    merged = []
    for start, end in compute:  # the union of the compute kernels' intervals
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    span = max(end for _, end, _ in kernels) - min(start for start, _, _ in kernels)
    busy = sum(end - start for start, end in merged)
    return {"span_us": span, "compute_us": busy, "idle_us": span - busy, "nccl_kernels": len(nccl),
            "nccl_kernel_us": sum(end - start for start, end in nccl)}


def _timeline(torch, dist, step, out: Path, rank: int, tag: str) -> dict:
    """One step under the profiler, after a barrier inside the profiled
    region (so that the ranks' profiler start-up does not skew it); its
    trace saved for a timeline viewer."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        dist.barrier()
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
    path = out / f"ring_trace_{tag}_rank{rank}.json"
    profiler.export_chrome_trace(str(path))
    return _overlap_from_trace(path)


def _one_gpu_ms(torch, ct, whole: list, causal: bool, repeats: int) -> float:
    """Median ms of one forward + backward of the whole sequence on this GPU."""
    q, k, v = (x.clone().requires_grad_() for x in whole[:3])
    return _step_ms(torch, lambda: ct.attention(q, k, v, causal=causal).backward(whole[3]), repeats)


def _distributed_ms(torch, dist, local: list, causal: bool, args, ring_module, ring_attention,
                    ulysses_attention) -> dict:
    """Median ms of the ring (overlapped and serialised) and of Ulysses."""
    q, k, v = (x.requires_grad_() for x in local[:3])

    def ring():
        ring_attention(q, k, v, causal=causal, balanced=causal).backward(local[3])

    times = {"ring_ms": _step_ms(torch, ring, args.repeats, dist)}
    if args.timeline:
        tag = f"{args.seqlen // 1024}k_{'causal' if causal else 'full'}"
        times["timeline"] = _timeline(torch, dist, ring, Path(args.out), dist.get_rank(), tag)
    ring_module.OVERLAP = False
    try:
        times["ring_serialised_ms"] = _step_ms(torch, ring, args.repeats, dist)
    finally:
        ring_module.OVERLAP = True
    if ulysses_attention is not None:
        def ulysses():
            ulysses_attention(q, k, v, causal=causal, balanced=causal).backward(local[3])

        times["ulysses_ms"] = _step_ms(torch, ulysses, args.repeats, dist)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=_size, default=128 * 1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--no-ulysses", action="store_true")
    parser.add_argument("--timeline", action="store_true",
                        help="profile one ring step on each rank: Chrome traces under --out, and how long the GPU "
                             "ran no kernel but NCCL's")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import cuflash.torch as ct
    from cuflash.distributed import _torch as ring_module
    from cuflash.distributed import ring_attention, shard_sequence, ulysses_attention
    from cuflash.simulate import distributed as model
    from cuflash.simulate.machines import MACHINES
    from cuflash.simulate.traffic import Problem

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    kv_heads = args.kv_heads or args.heads
    name = torch.cuda.get_device_name().lower()
    machine_name = "h200" if "h200" in name else "h100" if "h100" in name else None
    rows = []
    for causal in {"both": (True, False), "causal": (True,), "full": (False,)}[args.causal]:
        generator = torch.Generator(device="cuda").manual_seed(0)

        def randn(heads):
            return torch.randn(1, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                               generator=generator)

        whole = [randn(args.heads), randn(kv_heads), randn(kv_heads), randn(args.heads)]
        row = {"seqlen": args.seqlen, "heads": args.heads, "kv_heads": kv_heads, "head_dim": args.head_dim,
               "causal": causal, "gpus": world}
        # One GPU: rank 0 alone; the others wait at the barrier.
        if rank == 0:
            row["one_gpu_ms"] = _one_gpu_ms(torch, ct, whole, causal, args.repeats)
        dist.barrier()
        torch.cuda.empty_cache()
        local = [shard_sequence(x, balanced=causal) for x in whole]
        whole.clear()
        row.update(_distributed_ms(torch, dist, local, causal, args, ring_module, ring_attention,
                                   ulysses_attention if not args.no_ulysses and args.heads % world == 0 else None))
        local.clear()
        torch.cuda.empty_cache()
        if machine_name is not None:
            problem = Problem(batch=1, seqlen_q=args.seqlen, seqlen_k=args.seqlen, nheads=args.heads,
                              nheads_k=kv_heads, head_dim=args.head_dim, element_size=2, causal=causal)
            estimate = model.ring(problem, MACHINES[machine_name], world, "fwd+bwd", balanced=causal)
            row["model_ring_ms"] = estimate.seconds * 1e3
            row["model_one_gpu_ms"] = estimate.single_gpu_seconds * 1e3
        rows.append(row)
    if rank == 0:
        print(f"{'causal':>6} {'one GPU':>10} {'ring':>10} {'speedup':>8} {'serialised':>11} {'ulysses':>10} "
              f"{'model ring':>11} {'model/meas':>10}")
        for row in rows:
            speedup = row["one_gpu_ms"] / row["ring_ms"]
            model_ratio = row.get("model_ring_ms", float("nan")) / row["ring_ms"]
            print(f"{str(row['causal']):>6} {row['one_gpu_ms']:10.2f} {row['ring_ms']:10.2f} {speedup:8.3f} "
                  f"{row['ring_serialised_ms']:11.2f} {row.get('ulysses_ms', float('nan')):10.2f} "
                  f"{row.get('model_ring_ms', float('nan')):11.2f} {model_ratio:10.3f}")
            if "timeline" in row:
                line = row["timeline"]
                print(f"       rank 0 timeline: step {line['span_us'] / 1e3:.2f} ms on the GPU, kernels other than "
                      f"NCCL's running {line['compute_us'] / 1e3:.2f} ms of it (idle {line['idle_us'] / 1e3:.2f} "
                      f"ms); {line['nccl_kernels']} NCCL send/receive kernels")
        print("README rows:")
        for row in rows:
            print(f"| {row['seqlen'] // 1024}k | {'causal' if row['causal'] else 'none'} | {row['one_gpu_ms']:.2f} ms | "
                  f"{row['ring_ms']:.2f} ms | {row['one_gpu_ms'] / row['ring_ms']:.2f}x | "
                  f"{row['ring_serialised_ms']:.2f} ms | {row.get('ulysses_ms', float('nan')):.2f} ms | "
                  f"{row.get('model_ring_ms', float('nan')):.2f} ms ({row.get('model_ring_ms', float('nan')) / row['ring_ms']:.2f}x) |")
        meta = {"commit": os.environ.get("CUFLASH_COMMIT"), "device": torch.cuda.get_device_name(),
                "gpus": world, "rows": rows}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"bench_ring_{args.seqlen // 1024}k.json").write_text(json.dumps(meta, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
