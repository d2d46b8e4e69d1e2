"""Context parallelism for PyTorch: ring attention and Ulysses over
``torch.distributed`` (NCCL). See ``cuflash.distributed``."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import api
from .._validation import check_causal, check_deterministic, check_window, resolve_softmax_scale
from .schedule import (check_shard_length, gathered_order, ring_length, ring_steps, sequence_slots, shard_chunks,
                       ulysses_kv_copies)


def _group_of(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cuflash.distributed needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group('nccl'), for example under torchrun)")
    return group if group is not None else dist.group.WORLD


def _check_inputs(q, k, v, balanced: bool) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_cuda:
            raise TypeError(f"{name} must be a CUDA torch.Tensor, got {type(x).__name__}"
                            + (f" on {x.device}" if isinstance(x, torch.Tensor) else ""))
        if x.dim() != 4:
            raise ValueError(f"{name} must be (batch, seqlen_local, nheads, head_dim), got shape {tuple(x.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one GPU, got {q.device}, {k.device} and {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"k's heads must divide q's and the head dims match: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError("q, k and v must be shards of one sequence: (batch, seqlen_local) must match, got "
                         f"q {tuple(q.shape[:2])} and k {tuple(k.shape[:2])}")
    check_shard_length(q.shape[1], balanced, "q's sequence shard")


#: False makes every transfer finish before the step that follows it starts
#: (tools/bench_ring.py's serialised baseline, to measure the overlap).
OVERLAP = True


class _Ring:
    """Point-to-point hand-off around the ring: each rank sends to the next
    and receives from the previous, on NCCL's stream, ordered after the
    work already queued on the current stream (the sent buffer is complete)
    and before the work queued after ``wait`` (the received one is)."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def start(self, send: torch.Tensor, receive: torch.Tensor, hops: int = 1):
        """Send ``send`` ``hops`` ranks ahead; receive from as many behind."""
        ahead = dist.get_global_rank(self.group, (self.rank + hops) % self.world)
        behind = dist.get_global_rank(self.group, (self.rank - hops) % self.world)
        ops = [dist.P2POp(dist.isend, send, ahead, self.group), dist.P2POp(dist.irecv, receive, behind, self.group)]
        works = dist.batch_isend_irecv(ops)
        if not OVERLAP:
            self.wait(works)
            return ()
        return works

    @staticmethod
    def wait(works) -> None:
        for work in works:
            work.wait()  # the current stream waits on NCCL's; the host does not


def _plan(q, group, causal: bool, balanced: bool, window: tuple[int, int]):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seqlen = q.shape[1]
    steps = ring_steps(rank, world, seqlen, causal=causal, balanced=balanced, window=window)
    return steps[:ring_length(world, seqlen, causal=causal, balanced=balanced, window=window)]


def _ring_forward(q, k, v, group, causal: bool, softmax_scale: float, balanced: bool, window: tuple[int, int]):
    """(out, lse) of the local queries against the whole sequence's keys."""
    steps = _plan(q, group, causal, balanced, window)
    batch, seqlen, nheads, head_dim = q.shape
    # Each step's partial result gets its own slot and one merge combines
    # them all at the end: float32 inside the merge, one rounding to q's
    # dtype (a running merge in q's dtype would round once a step).
    outs = q.new_empty((len(steps), batch, seqlen, nheads, head_dim))
    lses = torch.empty((len(steps), batch, nheads, seqlen), dtype=torch.float32, device=q.device)
    blocks = torch.stack((k, v)).contiguous(), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
    ring = _Ring(group) if len(steps) > 1 else None
    for i, step in enumerate(steps):
        block = blocks[i % 2]
        works = ring.start(block, blocks[(i + 1) % 2]) if i + 1 < len(steps) else ()
        rows, keys = slice(*step.rows), slice(*step.keys)
        if step.rows != (0, seqlen) or not step.attends:
            lses[i].fill_(-math.inf)  # rows this step does not reach: the merge never reads their outputs
        if step.attends:
            # the kernels write a C-contiguous lse: a part of the rows goes through a buffer
            lse = lses[i] if step.rows == (0, seqlen) else torch.empty(
                (batch, nheads, rows.stop - rows.start), dtype=torch.float32, device=q.device)
            api.attention(q[:, rows], block[0][:, keys], block[1][:, keys], causal=step.causal,
                          window_size=step.window, softmax_scale=softmax_scale, out=outs[i][:, rows], lse=lse)
            if lse is not lses[i]:
                lses[i][:, :, rows] = lse
        _Ring.wait(works)
    return api.merge_attention_states(outs, lses)


def _ring_backward(dout, q, k, v, out, lse, group, causal: bool, softmax_scale: float, balanced: bool,
                   window: tuple[int, int], deterministic: bool):
    """(dq, dk, dv) of the local shards. K/V travel around the ring as in the
    forward; each block's dK/dV sums (float32) travel with it, and after the
    last step, complete, go home in k's dtype (half the bytes of the one
    transfer no attention hides), straight to the block's owner (the next
    rank when the ring went all the way round)."""
    steps = _plan(q, group, causal, balanced, window)
    seqlen = q.shape[1]
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dq_written = False
    blocks = torch.stack((k, v)).contiguous(), torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
    grads = (torch.empty((2, *k.shape), dtype=torch.float32, device=k.device),
             torch.empty((2, *k.shape), dtype=torch.float32, device=k.device))
    ring = _Ring(group) if len(steps) > 1 else None
    home = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device) if ring is not None else None
    dkv_works = ()
    for i, step in enumerate(steps):
        block = blocks[i % 2]
        kv_works = ring.start(block, blocks[(i + 1) % 2]) if i + 1 < len(steps) else ()
        partial = None
        rows, keys = slice(*step.rows), slice(*step.keys)
        if step.attends:
            partial = api.attention_backward(dout[:, rows], q[:, rows], block[0][:, keys], block[1][:, keys],
                                             out[:, rows], lse[:, :, rows], causal=step.causal,
                                             window_size=step.window, softmax_scale=softmax_scale,
                                             deterministic=deterministic)
            if not dq_written and step.rows == (0, seqlen):
                dq.copy_(partial[0])
            else:
                if not dq_written:
                    dq.zero_()
                dq[:, rows] += partial[0]
            dq_written = True
        # The sums of this step's block: ours alone at step 0 (our own block,
        # no one has added to it yet), else the ones the previous rank sent
        # at the end of its step plus ours.
        grad = grads[i % 2]
        _Ring.wait(dkv_works)
        if i == 0 and partial is not None and step.keys == (0, seqlen):
            grad[0].copy_(partial[1])
            grad[1].copy_(partial[2])
        else:
            if i == 0:
                grad.zero_()
            if partial is not None:
                grad[0][:, keys] += partial[1]
                grad[1][:, keys] += partial[2]
        if ring is not None:
            if i + 1 < len(steps):  # on to the rank that attends to this block next
                dkv_works = ring.start(grad, grads[(i + 1) % 2])
            else:  # complete: home, as the gradient
                dkv_works = ring.start(grad.to(k.dtype), home, hops=-i)
        _Ring.wait(kv_works)
    _Ring.wait(dkv_works)
    if not dq_written:
        dq.zero_()
    dkv = home if ring is not None else grads[0].to(k.dtype)
    return dq.to(q.dtype), dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, balanced, window, deterministic):
        out, lse = _ring_forward(q, k, v, group, causal, softmax_scale, balanced, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = group, causal, softmax_scale, balanced, window, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.settings)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, window_size=(-1, -1), balanced=None,
                   deterministic=False, return_lse=False):
    """Ring attention over the ranks of ``group``: each rank holds a shard of
    one sequence, keeps its queries, and the K/V shards travel around the
    ring (NCCL send/receive on NCCL's stream, overlapped with the attention
    of the shard in hand); partial results merge by their log-sum-exps. The
    backward sends K/V around again with their float32 dK/dV sums.
    Differentiable (PyTorch autograd).

    Args:
        q: (batch, seqlen_local, nheads, head_dim) this rank's query shard
            (float16, bfloat16 or float32 CUDA tensor, as ``cuflash.attention``).
        k, v: (batch, seqlen_local, nheads_k, head_dim), the same rank's
            key and value shards; nheads_k divides nheads (GQA).
        group: the ``torch.distributed`` process group (default: the world);
            rank i of the group holds shard i.
        causal: causal over the whole sequence.
        softmax_scale: default 1 / sqrt(head_dim).
        window_size: (left, right) sliding window over the whole sequence,
            as ``cuflash.attention`` (-1 unbounded; with ``causal`` the right
            side is 0); contiguous shards only. K/V travel only as many
            hops as the window reaches, and the dK/dV sums go straight home
            from the last.
        balanced: how the sequence was sharded (``shard_sequence``): True,
            rank r holds chunks r and 2 world - 1 - r of 2 world (one early,
            one late: causal work even over the ranks); False, rank r holds
            the r-th of world contiguous shards. Default: ``causal`` without
            a window.
        deterministic: the backward's per-step dq is bitwise repeatable (as
            ``cuflash.attention_backward``); the ring's sums are always
            in a fixed order.
        return_lse: also return the (batch, nheads, seqlen_local) float32
            log-sum-exp of the local queries over the whole sequence.

    Returns:
        out (batch, seqlen_local, nheads, head_dim), q's dtype; with
        ``return_lse`` (out, lse).
    """
    group = _group_of(group)
    causal, deterministic, window = check_causal(causal), check_deterministic(deterministic), check_window(window_size)
    balanced = bool((causal and window == (-1, -1)) if balanced is None else balanced)
    _check_inputs(q, k, v, balanced=balanced)
    softmax_scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    # the plan's own checks (a window with balanced shards) before anything runs
    _plan(q, group, causal, balanced, window)
    out, lse = _RingAttention.apply(q, k, v, group, causal, softmax_scale, balanced, window, deterministic)
    return (out, lse) if return_lse else out


def shard_sequence(x, *, group=None, dim=1, balanced=True):
    """This rank's shard of ``x``'s sequence axis ``dim`` (every rank passes
    the whole sequence): with ``balanced``, chunks r and 2 world - 1 - r of
    2 world; else the r-th of world. A contiguous copy."""
    group = _group_of(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = 2 * world if balanced else world
    if x.shape[dim] % count:
        raise ValueError(f"x's sequence axis (dim {dim}, length {x.shape[dim]}) must split into {count} equal "
                         f"chunks for {'balanced' if balanced else 'contiguous'} sharding over {world} ranks")
    chunks = x.chunk(count, dim=dim)
    return torch.cat([chunks[c] for c in shard_chunks(rank, world, balanced=balanced)], dim=dim).contiguous()


def unshard_sequence(x, *, group=None, dim=1, balanced=True):
    """The whole sequence from every rank's shard (``shard_sequence``'s
    inverse; an all-gather, every rank gets it). Not differentiable."""
    group = _group_of(group)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    return _in_sequence_order(torch.cat(gathered, dim=dim), world, dim, balanced)


def _in_sequence_order(x, world: int, dim: int, balanced: bool):
    """Shards concatenated in rank order -> the sequence's order."""
    return _chunks_in(x, sequence_slots(world, balanced=True), dim) if balanced else x


def _from_sequence_order(x, world: int, dim: int, balanced: bool):
    """``_in_sequence_order``'s inverse."""
    return _chunks_in(x, gathered_order(world, balanced=True), dim) if balanced else x


def _chunks_in(x, order: list[int], dim: int):
    """x cut into len(order) chunks along ``dim``, concatenated as ``order`` lists them."""
    chunks = x.chunk(len(order), dim=dim)
    return torch.cat([chunks[c] for c in order], dim=dim)


# --- Ulysses: all-to-all over heads ---

def _sequence_to_heads(x, group):
    """(batch, seqlen_local, nheads, d) sequence shards -> (batch, world *
    seqlen_local, nheads / world, d) head shards, shards in rank order."""
    world = dist.get_world_size(group)
    batch, seqlen, nheads, head_dim = x.shape
    sent = x.reshape(batch, seqlen, world, nheads // world, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return received.permute(1, 0, 2, 3, 4).reshape(batch, world * seqlen, nheads // world, head_dim)


def _heads_to_sequence(y, group):
    """``_sequence_to_heads``'s inverse."""
    world = dist.get_world_size(group)
    batch, seqlen_all, heads, head_dim = y.shape
    seqlen = seqlen_all // world
    sent = y.reshape(batch, world, seqlen, heads, head_dim).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, seqlen, world * heads, head_dim)


class _AllToAll(torch.autograd.Function):
    """Sequence shards to head shards (``to_heads``) or back; the gradient
    of each direction is the other."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_sequence if ctx.to_heads else _sequence_to_heads)(grad.contiguous(), ctx.group), None, None


def ulysses_attention(q, k, v, *, group=None, causal=False, softmax_scale=None, window_size=(-1, -1),
                      balanced=False, deterministic=False):
    """Ulysses attention: an all-to-all turns the ranks' sequence shards into
    head shards (each rank then holds the whole sequence for nheads / world
    heads), cuflash attends locally, and a second all-to-all returns the
    output to sequence shards. Differentiable (the backward's all-to-alls
    are the forward's, reversed). Shapes as ``ring_attention``.

    nheads must be divisible by the group's size; nheads_k too, or the size
    by nheads_k (then each K/V head is replicated to the ranks whose query
    heads use it). ``balanced``: the shards are ``shard_sequence``'s
    balanced ones (their chunks are put in sequence order around the
    attention). ``window_size`` as ``cuflash.attention``'s over the whole
    sequence. The all-to-alls are not overlapped with the attention.
    """
    group = _group_of(group)
    _check_inputs(q, k, v, balanced=balanced)
    world = dist.get_world_size(group)
    copies = ulysses_kv_copies(q.shape[2], k.shape[2], world)
    if copies > 1:
        k, v = (x.repeat_interleave(copies, dim=2) for x in (k, v))
    q, k, v = (_in_sequence_order(_AllToAll.apply(x.contiguous(), group, True), world, 1, balanced)
               for x in (q, k, v))
    from .. import torch as cuflash_torch

    out = cuflash_torch.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                  deterministic=deterministic)
    return _AllToAll.apply(_from_sequence_order(out, world, 1, balanced).contiguous(), group, False)
