"""Attention past one GPU: context parallelism over ranks that each hold a
shard of one sequence.

* ``ring_attention`` (PyTorch, ``torch.distributed`` over NCCL): queries stay,
  K/V shards travel around the ring, overlapped with the attention; forward
  and backward, causal (load-balanced sharding) or not, grouped-query heads.
* ``ulysses_attention`` (PyTorch): all-to-all from sequence shards to head
  shards and back around a local attention.
* ``shard_sequence`` / ``unshard_sequence`` (PyTorch): cut a sequence into a
  rank's shard (contiguous or balanced) and gather it back.
* ``cuflash.distributed.jax.ring_attention``: the ring inside
  ``jax.shard_map`` with ``jax.lax.ppermute``, under ``jax.jit``.
* ``cuflash.distributed.schedule``: which queries meet which keys at each
  ring step (pure Python; the implementations and the simulator share it).

``cuflash simulate --gpus N --strategy ring|ulysses`` models both.
Importing this package imports nothing from PyTorch until one of its
PyTorch functions is used.
"""

from .schedule import RingStep, ring_steps, sequence_positions, shard_chunks

_TORCH_NAMES = ("ring_attention", "ulysses_attention", "shard_sequence", "unshard_sequence")

__all__ = ["RingStep", "ring_steps", "sequence_positions", "shard_chunks", *_TORCH_NAMES]


def __getattr__(name):
    if name in _TORCH_NAMES:
        from . import _torch

        return getattr(_torch, name)
    raise AttributeError(f"module 'cuflash.distributed' has no attribute {name!r}")
