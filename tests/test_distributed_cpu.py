"""The ring's and Ulysses' bookkeeping (cuflash.distributed's PyTorch code:
the hand-offs around the ring, the dK/dV sums that travel with K/V, the
merge, the all-to-alls, balanced sharding) on the CPU: 1 to 4 processes
over gloo, with cuflash's kernels replaced by float64 PyTorch math (the
kernels themselves are tested on the GPU, tests/test_distributed_gpu.py).
Forward and gradients against autograd through the same math on the whole
sequence. Skips without PyTorch."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")


def _scores(q, k, causal: bool, scale: float, window=(-1, -1)):
    """(batch, nheads, seqlen_q, seqlen_k) float64 scaled scores, the causal
    mask and the window bottom-right aligned as cuflash's; K/V heads shared
    by groups of query heads."""
    group = q.shape[2] // k.shape[2]
    scores = torch.einsum("bshd,bthd->bhst", q.double(), k.double().repeat_interleave(group, dim=2)) * scale
    left, right = window[0], 0 if causal else window[1]
    rows, cols = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    diagonal = rows + k.shape[1] - q.shape[1]
    if right >= 0:
        scores = scores.masked_fill(cols > diagonal + right, -math.inf)
    if left >= 0:
        scores = scores.masked_fill(cols < diagonal - left, -math.inf)
    return scores


def _attention(q, k, v, *, causal, softmax_scale=None, window_size=(-1, -1), out=None, lse=None, **_):
    scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
    scores = _scores(q, k, causal, scale, window_size)
    row_lse = torch.logsumexp(scores, -1)
    probabilities = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
    values = v.double().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    result = torch.einsum("bhst,bthd->bshd", probabilities, values)
    if out is None:
        return result.to(q.dtype), row_lse.float()
    out.copy_(result)
    lse.copy_(row_lse)
    return out, lse


def _planned_attention(q, k, v, causal, softmax_scale, window_size, *_):
    """``api._attention``'s stand-in (cuflash.torch's autograd node calls
    it): FORWARD_ARRAYS' first five, and no cached call."""
    out, lse = _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    return [q, k, v, out, lse], None


def _attention_backward(dout, q, k, v, out, lse, *, causal, softmax_scale=None, window_size=(-1, -1), **_):
    """Gradients of one block's share, from the whole row's output and
    log-sum-exp (as cuflash's backward computes them)."""
    scale = softmax_scale or 1 / math.sqrt(q.shape[-1])
    batch, seqlen_k, nheads_k, head_dim = k.shape
    group = q.shape[2] // nheads_k
    probabilities = torch.exp(_scores(q, k, causal, scale, window_size) - lse.double()[..., None])
    keys, values = (x.double().repeat_interleave(group, dim=2) for x in (k, v))
    dprobabilities = torch.einsum("bshd,bthd->bhst", dout.double(), values)
    delta = (dout.double() * out.double()).sum(-1).transpose(1, 2)[..., None]
    dscores = probabilities * (dprobabilities - delta) * scale
    dq = torch.einsum("bhst,bthd->bshd", dscores, keys)
    dk = torch.einsum("bhst,bshd->bthd", dscores, q.double()).reshape(batch, seqlen_k, nheads_k, group, head_dim)
    dv = torch.einsum("bhst,bshd->bthd", probabilities, dout.double()).reshape(dk.shape)
    return dq.to(q.dtype), dk.sum(3).to(k.dtype), dv.sum(3).to(v.dtype)


def _merge(outs, lses):
    lse = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - lse).nan_to_num(0.0).permute(0, 1, 3, 2)[..., None]
    return (outs.double() * weights).sum(0).to(outs.dtype), lse


def _rank(rank: int, world: int, store: str, cases: list, queue) -> None:
    import torch.distributed as dist

    from cuflash import api
    from cuflash.distributed import _torch as ring

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    patches = {"attention": _attention, "_attention": _planned_attention, "attention_backward": _attention_backward,
               "merge_attention_states": _merge}
    saved = {name: getattr(api, name) for name in patches}
    for name, function in patches.items():
        setattr(api, name, function)
    ring._check_inputs = lambda q, k, v, balanced: None  # CPU tensors stand in for CUDA ones here
    try:
        for strategy, causal, balanced, nheads, nheads_k, window in cases:
            generator = torch.Generator().manual_seed(7)
            whole = [torch.randn(2, 6 * world, heads, 8, dtype=torch.float64, generator=generator)
                     for heads in (nheads, nheads_k, nheads_k, nheads)]
            leaves = [x.clone().requires_grad_() for x in whole[:3]]
            _attention(*leaves, causal=causal, window_size=window)[0].backward(whole[3])
            local = [ring.shard_sequence(x, balanced=balanced) for x in whole]
            q, k, v = (x.requires_grad_() for x in local[:3])
            if strategy == "ring":
                out = ring.ring_attention(q, k, v, causal=causal, balanced=balanced, window_size=window)
            else:
                out = ring.ulysses_attention(q, k, v, causal=causal, balanced=balanced)
            out.backward(local[3])
            got = [ring.unshard_sequence(x, balanced=balanced) for x in (out.detach(), q.grad, k.grad, v.grad)]
            want = [_attention(*whole[:3], causal=causal, window_size=window)[0]] + [x.grad for x in leaves]
            errors = [float((a - b).abs().max()) for a, b in zip(got, want)]
            if rank == 0:
                queue.put(((strategy, causal, balanced, nheads, nheads_k, window), errors))
    finally:
        for name, function in saved.items():
            setattr(api, name, function)
        dist.destroy_process_group()


#: (strategy, causal, balanced, nheads, nheads_k, window); shards of 6 tokens a rank
CASES = [("ring", True, True, 4, 2, (-1, -1)), ("ring", True, False, 4, 4, (-1, -1)),
         ("ring", False, False, 2, 1, (-1, -1)), ("ring", False, True, 4, 2, (-1, -1)),
         ("ring", True, False, 2, 2, (7, 0)), ("ring", False, False, 2, 1, (2, 3)),
         ("ring", True, False, 2, 2, (2, 0)),
         ("ulysses", True, True, 4, 2, (-1, -1)), ("ulysses", False, False, 4, 4, (-1, -1))]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_and_ulysses_bookkeeping_over_gloo(world, tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    cases = [case for case in CASES if case[0] == "ring" or case[3] % world == 0]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), cases, queue), nprocs=world, join=True)
    results = [queue.get() for _ in cases]
    # dq and the dK/dV sums are float32 in the ring (as on the GPU); the rest float64
    failures = [(case, errors) for case, errors in results if max(errors) > 1e-5]
    assert not failures, failures


def test_bad_calls_are_refused_before_anything_runs(tmp_path):
    import torch.distributed as dist

    from cuflash.distributed import _torch as ring

    q = torch.zeros(1, 4, 2, 8)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ring.ring_attention(q, q, q)
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(TypeError, match="q must be a CUDA torch.Tensor, got Tensor on cpu"):
            ring.ring_attention(q, q, q)
        with pytest.raises(ValueError, match="window_size's left side"):
            ring.ring_attention(q, q, q, window_size=(-2, 0))
        with pytest.raises(TypeError, match="q must be a CUDA torch.Tensor, got Tensor on meta"):
            ring.ulysses_attention(torch.zeros(1, 4, 2, 8, device="meta"), q, q)
    finally:
        dist.destroy_process_group()
