"""The ranks of the multi-GPU tests (tests/test_distributed_gpu.py): started
by ``torch.multiprocessing.spawn``, one process a GPU, NCCL through a file
store. Each case's whole-sequence inputs come from ``inputs.npz`` (float32
values already rounded to the case's dtype); every rank shards them, runs the
strategy forward and backward, gathers the results back, and rank 0 saves
them for the test to check against the float64 reference."""

from __future__ import annotations

import os

import numpy as np


def run(rank: int, world: int, directory: str, cases: dict) -> None:
    import torch
    import torch.distributed as dist

    import cuflash.distributed as cd

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(directory, 'store')}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        inputs = np.load(os.path.join(directory, "inputs.npz"))
        for name, case in cases.items():
            dtype = getattr(torch, case["dtype"])
            balanced = case["balanced"]
            full = [torch.from_numpy(inputs[f"{name}.{x}"]).to("cuda", dtype) for x in ("q", "k", "v", "dout")]
            q, k, v, dout = (cd.shard_sequence(x, balanced=balanced) for x in full)
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            if case["strategy"] == "ring":
                out, lse = cd.ring_attention(q, k, v, causal=case["causal"], balanced=balanced,
                                             window_size=case["window"], return_lse=True)
            else:
                out = cd.ulysses_attention(q, k, v, causal=case["causal"], balanced=balanced,
                                           window_size=case["window"])
                lse = None
            out.backward(dout)
            results = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            gathered = {key: cd.unshard_sequence(x, balanced=balanced) for key, x in results.items()}
            if lse is not None:
                gathered["lse"] = cd.unshard_sequence(lse, dim=2, balanced=balanced)
            if rank == 0:
                np.savez(os.path.join(directory, f"{name}.npz"),
                         **{key: x.float().cpu().numpy() for key, x in gathered.items()})
        dist.barrier()
    finally:
        dist.destroy_process_group()
