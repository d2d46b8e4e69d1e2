#!/usr/bin/env python3
"""The JAX ring (``cuflash.distributed.jax.ring_attention`` in
``jax.shard_map``) on every GPU of one process against
``cuflash.jax.attention`` of the whole sequence on one GPU (issue 19).

  python tools/bench_ring_jax.py [--seqlen 64k] [--heads 32] [--head-dim 128] [--out DIR]

Both jitted, forward + backward (``jax.grad`` of a sum), bf16, batch 1,
causal (balanced shards) and not. Time: wall clock around one call and
``block_until_ready``, after two warm-up calls, median of ``--repeats``.
Writes ``bench_ring_jax.json`` under ``--out`` (default $OUT) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _size(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def _median_ms(function, arguments, repeats: int) -> float:
    for _ in range(2):
        _block(function(*arguments))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        _block(function(*arguments))
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _block(tree) -> None:
    import jax

    jax.tree_util.tree_map(lambda x: x.block_until_ready(), tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=_size, default=64 * 1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import cuflash.jax as cuflash_jax
    from cuflash.distributed import jax as ring_jax

    gpus = [device for device in jax.devices() if device.platform == "gpu"]
    world = len(gpus)
    mesh = Mesh(np.array(gpus), ("sequence",))
    spec = PartitionSpec(None, "sequence")
    rows = []
    for causal in (True, False):
        shape = (1, args.seqlen, args.heads, args.head_dim)
        q, k, v = (jax.device_put(jax.random.normal(jax.random.key(i), shape, jnp.bfloat16), gpus[0])
                   for i in range(3))

        def single_loss(q, k, v):
            return jnp.sum(cuflash_jax.attention(q, k, v, causal=causal).astype(jnp.float32))

        single = jax.jit(jax.grad(single_loss, argnums=(0, 1, 2)))
        one_gpu_ms = _median_ms(single, (q, k, v), args.repeats)

        ring = jax.shard_map(lambda q, k, v: ring_jax.ring_attention(q, k, v, "sequence", causal=causal),
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

        def ring_loss(q, k, v):
            return jnp.sum(ring(q, k, v).astype(jnp.float32))

        # the shards in balanced order, already on their GPUs (as a model's activations would be)
        sharding = NamedSharding(mesh, spec)
        arranged = [jax.device_put(ring_jax.shard_order(x, world, balanced=causal), sharding) for x in (q, k, v)]
        del q, k, v
        ringed = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))
        ring_ms = _median_ms(ringed, arranged, args.repeats)
        rows.append({"seqlen": args.seqlen, "heads": args.heads, "head_dim": args.head_dim, "causal": causal,
                     "gpus": world, "one_gpu_ms": one_gpu_ms, "ring_ms": ring_ms})
        del arranged
    print(f"{'causal':>6} {'one GPU':>10} {'ring':>10} {'speedup':>8}")
    for row in rows:
        print(f"{str(row['causal']):>6} {row['one_gpu_ms']:10.2f} {row['ring_ms']:10.2f} "
              f"{row['one_gpu_ms'] / row['ring_ms']:8.3f}")
    meta = {"commit": os.environ.get("CUFLASH_COMMIT"), "device": gpus[0].device_kind, "gpus": world, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_ring_jax.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
