#!/usr/bin/env python3
"""What rows that start mid-sector cost the Hopper forward, and whether
copying K and V into padded rows pays (docs/perf-notes.md, "Head dim 72's
forward: copies that start on a sector").

For each length of the FlashAttention-2 grid (batch x seqlen = 16384,
heads = 2048 / head_dim), causal and not: cuflash's forward on contiguous
q, k, v (rows of head_dim x 2 bytes), on K and V as views of rows padded to
``--pad`` elements, on Q, K and V so, the copy of K and V into the padded
rows, Q, K and V's padded rows read whole as head dim ``--pad`` (zeros
past the head dim: what the copies cost when their boxes end on a
sector), and SDPA's cuDNN backend; GPU time of queued launches
(``bench.time_gpu``), ms. The last columns say whether the padded call
plus its copy beats the plain one and cuDNN, and whether the padded call's
output is bitwise the plain one's. Since d9f794f the forward starts the
copies of heads whose rows all begin mid-sector 8 columns early
(sector_aligned_shift in kernels_cu/tma.cuh), so "plain" is within a few
percent of "padded K/V" there and no longer bitwise equal to it (the
zeros' columns shift the products' k16 steps); with an odd head count the
rows alternate and plain stays slower.

    python3 tools/bench_padded_rows.py --head-dim 72 --pad 80 [--backward]

``--backward`` times ``cuflash.attention_backward`` instead: every input
(dout, q, k, v, out) and output (dq, dk, dv) contiguous, against all of
them as views of padded rows (the backward does not shift its copies).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def padded_rows(x, pad: int):
    """``x``'s values as a view of rows of ``pad`` elements (zeros past its last dimension)."""
    import torch

    view = torch.zeros(*x.shape[:-1], pad, device=x.device, dtype=x.dtype)[..., :x.shape[-1]]
    view.copy_(x)
    return view


def best_of_two(fn, calls: int) -> float:
    """The lower of two medians of ``bench.time_gpu`` (ms)."""
    from bench import time_gpu

    return min(time_gpu(fn, calls=calls, repeats=7) for _ in range(2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=72)
    parser.add_argument("--pad", type=int, default=80, help="elements a padded row holds (rows of pad x 2 bytes)")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192")
    parser.add_argument("--backward", action="store_true", help="time the backward, plain against padded rows")
    args = parser.parse_args(argv)
    if args.pad < args.head_dim:
        parser.error(f"--pad must be at least --head-dim ({args.head_dim}), got {args.pad}")
    if args.backward:
        return backward_table(args)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash

    d, pad = args.head_dim, args.pad
    print("| seqlen | causal | plain | padded K/V | padded Q/K/V | as head dim pad | copy K/V | cuDNN | "
          "plain / cuDNN | (padded + copy) / plain | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        batch, heads = 16384 // seqlen, 2048 // d
        for causal in (False, True):
            generator = torch.Generator(device="cuda").manual_seed(seqlen)
            q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                                   generator=generator) for _ in range(3))
            qp, kp, vp = (padded_rows(x, pad) for x in (q, k, v))
            calls = max(3, min(30, int(60 * 2048 / seqlen)))

            def best(fn):
                return best_of_two(fn, calls)

            plain = best(lambda: cuflash.attention(q, k, v, causal=causal))
            padded_kv = best(lambda: cuflash.attention(q, kp, vp, causal=causal))
            padded_all = best(lambda: cuflash.attention(qp, kp, vp, causal=causal))
            # The same rows read whole: head dim `pad`, zeros past d (the
            # scores are the same; the copies' boxes end on a sector).
            whole = tuple(x.as_strided((*x.shape[:-1], pad), x.stride()) for x in (qp, kp, vp))
            as_pad = best(lambda: cuflash.attention(*whole, causal=causal, softmax_scale=d ** -0.5))
            copy_kv = best(lambda: (kp.copy_(k), vp.copy_(v)))
            same = torch.equal(cuflash.attention(q, k, v, causal=causal), cuflash.attention(q, kp, vp, causal=causal))
            leaves = tuple(x.transpose(1, 2) for x in (q, k, v))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn = best(lambda: sdpa(*leaves, is_causal=causal))
            except RuntimeError:  # no cuDNN kernel for this head dim
                cudnn = float("nan")
            print(f"| {seqlen} | {'yes' if causal else 'no'} | {plain:.4f} | {padded_kv:.4f} | {padded_all:.4f} | "
                  f"{as_pad:.4f} | {copy_kv:.4f} | {cudnn:.4f} | {cudnn / plain:.3f} | "
                  f"{(padded_kv + copy_kv) / plain:.3f} | {same} |", flush=True)
    return 0


def backward_table(args) -> int:
    """The backward on contiguous rows against padded ones (ms)."""
    import torch

    import cuflash

    d, pad = args.head_dim, args.pad
    print("| seqlen | causal | plain | padded | padded / plain |")
    print("|---|---|---|---|---|")
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        batch, heads = 16384 // seqlen, 2048 // d
        for causal in (False, True):
            generator = torch.Generator(device="cuda").manual_seed(seqlen)
            q, k, v, dout = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16,
                                         generator=generator) for _ in range(4))
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            padded = [padded_rows(x, pad) for x in (dout, q, k, v, out)]
            grads = [padded_rows(torch.empty_like(x), pad) for x in (q, k, v)]
            calls = max(3, min(20, int(30 * 2048 / seqlen)))
            plain = best_of_two(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal), calls)
            rows = best_of_two(lambda: cuflash.attention_backward(*padded, lse, causal=causal, dq=grads[0],
                                                                  dk=grads[1], dv=grads[2]), calls)
            print(f"| {seqlen} | {'yes' if causal else 'no'} | {plain:.4f} | {rows:.4f} | {rows / plain:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
