#!/usr/bin/env python3
"""User functions against FlexAttention (issue 16): FlexAttention's own
examples (causal, sliding window, ALiBi through score_mod, document
masking, soft capping), written once for ``flex_attention`` under
``torch.compile`` and once for cuflash, timed in one process (bf16, CUDA
events, medians; forward, and forward + backward through autograd), and
each one's first call in a fresh process with empty compile caches (cold:
tracing, code generation and compilation included).

cuflash runs each case the way its API offers: a built-in option where one
exists (``causal``, ``window_size``, ``softcap``), the same ``mask_mod``
FlexAttention takes (a ``cuflash.BlockMask`` made once, as FlexAttention's
block mask is), a traced ``score_mod`` (ALiBi, the soft cap again), and for
documents also ``attention_varlen`` over the packed sequences. Each case
starts from a reset of torch.compile's caches, so FlexAttention's
recompilations (grad mode on and off, per case) stay under its recompile
limit and it runs compiled throughout.

    python tools/bench_mods.py --out $OUT            # table and bench_mods.json
    python tools/bench_mods.py --first-call CASE --backend flex|cuflash   # one cold first call (internal)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BATCH, HEADS, SEQLEN, HEAD_DIM = 2, 16, 4096, 128
WINDOW = 1024
SOFTCAP = 20.0
DOCUMENTS = 6
CASES = ("causal", "sliding_window", "alibi", "document", "softcap")


def _inputs(seed: int = 0):
    """q, k, v (batch, heads, seqlen, head_dim) bf16 CUDA tensors (FlexAttention's layout), the ALiBi
    slopes and per-token document ids (documents of random lengths, packed)."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(BATCH, HEADS, SEQLEN, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=generator) for _ in range(3))
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)], device="cuda")
    cuts = torch.sort(torch.randperm(SEQLEN - 1, generator=torch.Generator().manual_seed(seed))[:DOCUMENTS - 1]
                      + 1).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([SEQLEN])]))
    doc = torch.repeat_interleave(torch.arange(DOCUMENTS), lengths).to("cuda", torch.int32)
    return q, k, v, slopes, doc.expand(BATCH, SEQLEN).contiguous(), lengths


def flex_call(case: str, q, k, v, slopes, doc):
    """() -> out of FlexAttention for ``case`` (compiled ``flex_attention``, its block mask made once)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    mask_mod, score_mod = {"causal": (causal, None), "sliding_window": (sliding_window, None),
                           "alibi": (causal, alibi), "document": (same_document, None),
                           "softcap": (None, softcap)}[case]
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, BATCH, None, SEQLEN, SEQLEN)
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)


def cuflash_calls(case: str, q, k, v, slopes, doc, lengths) -> dict:
    """name -> () -> out (batch, heads, seqlen, head_dim) of cuflash's ways to run ``case``."""
    import torch

    import cuflash
    import cuflash.torch as ct
    from cuflash import mods

    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))  # (batch, seqlen, heads, dim) views, no copies

    def call(**options):
        return lambda: ct.attention(qs, ks, vs, **options).transpose(1, 2)

    def alibi(score, b, h, q_idx, kv_idx, slopes):
        return score - slopes[h] * (q_idx - kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * mods.tanh(score / SOFTCAP)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    def same_document(b, h, q_idx, kv_idx, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

    if case == "causal":
        return {"built-in causal": call(causal=True),
                "mask_mod": call(mask_mod=cuflash.block_mask(causal, None, None, SEQLEN, SEQLEN))}
    if case == "sliding_window":
        return {"built-in window": call(causal=True, window_size=(WINDOW, 0)),
                "mask_mod": call(mask_mod=cuflash.block_mask(sliding_window, None, None, SEQLEN, SEQLEN))}
    if case == "alibi":
        return {"built-in alibi": call(causal=True, alibi_slopes=slopes),
                "score_mod": call(causal=True, score_mod=alibi, mod_arrays={"slopes": slopes})}
    if case == "softcap":
        return {"built-in softcap": call(softcap=SOFTCAP), "score_mod": call(score_mod=softcap)}
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    cu = torch.cat([offsets[:-1] + b * SEQLEN for b in range(BATCH)] + [offsets[-1:] + (BATCH - 1) * SEQLEN])
    cu = cu.to("cuda", torch.int32)
    longest = int(lengths.max())

    def varlen():  # the packing copies are part of each call (and of its autograd graph)
        packed = [x.contiguous().reshape(BATCH * SEQLEN, HEADS, HEAD_DIM) for x in (qs, ks, vs)]
        out = ct.flash_attn_varlen_func(*packed, cu, cu, longest, longest)
        return out.reshape(BATCH, SEQLEN, HEADS, HEAD_DIM).transpose(1, 2)

    return {"mask_mod": call(mask_mod=cuflash.block_mask(same_document, BATCH, None, SEQLEN, SEQLEN,
                                                         mod_arrays={"doc": doc})),
            "varlen": varlen}


def _with_backward(fn, leaves):
    import torch

    def step():
        out = fn()
        torch.autograd.backward(out, torch.ones_like(out))
        for leaf in leaves:
            leaf.grad = None
    return step


def measure(calls: int, repeats: int) -> list[dict]:
    import torch

    from bench import time_gpu

    rows = []
    q, k, v, slopes, doc, lengths = _inputs()
    leaves = [x.requires_grad_() for x in (q, k, v)]
    for case in CASES:
        torch._dynamo.reset()
        backends = {"flex": flex_call(case, q, k, v, slopes, doc)}
        backends |= {f"cuflash {name}": fn for name, fn in cuflash_calls(case, q, k, v, slopes, doc, lengths).items()}
        times = {}
        for name, fn in backends.items():
            with torch.no_grad():
                forward = time_gpu(fn, calls=calls, repeats=repeats)
            both = time_gpu(_with_backward(fn, leaves), calls=calls, repeats=repeats)
            times[name] = {"fwd": forward, "fwd+bwd": both}
        for name, t in times.items():
            row = {"case": case, "backend": name, "ms": t}
            if name != "flex":
                row["flex_over_this"] = {p: times["flex"][p] / t[p] for p in t}
            rows.append(row)
            ratio = "" if name == "flex" else (f"{row['flex_over_this']['fwd']:.2f}x / "
                                                f"{row['flex_over_this']['fwd+bwd']:.2f}x")
            print(f"| {case} | {name} | {t['fwd']:.3f} | {t['fwd+bwd']:.3f} | {ratio} |", flush=True)
    return rows


def first_call(case: str, backend: str) -> float:
    """Seconds of one cold first call (forward) in this process."""
    import torch

    q, k, v, slopes, doc, lengths = _inputs()
    torch.cuda.synchronize()
    start = time.perf_counter()
    if backend == "flex":
        fn = flex_call(case, q, k, v, slopes, doc)
    else:
        calls = cuflash_calls(case, q, k, v, slopes, doc, lengths)
        # A traced function where the case has one (the mask's BlockMask is made in the timed call).
        fn = calls.get("mask_mod", calls.get("score_mod", next(iter(calls.values()))))
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cold_first_calls() -> list[dict]:
    """Each case's first call per backend in a fresh process with empty
    compile caches (CuPy's kernel cache, Inductor's and Triton's)."""
    rows = []
    for case in CASES:
        for backend in ("flex", "cuflash"):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, CUPY_CACHE_DIR=f"{cache}/cupy", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
                           TRITON_CACHE_DIR=f"{cache}/triton")
                result = subprocess.run([sys.executable, __file__, "--first-call", case, "--backend", backend],
                                        env=env, capture_output=True, text=True)
            seconds = float(result.stdout.split()[-1]) if result.returncode == 0 else None
            rows.append({"case": case, "backend": backend, "first_call_s": seconds,
                         "error": None if seconds is not None else result.stderr[-2000:]})
            print(f"| {case} | {backend} | first call {seconds if seconds is None else f'{seconds:.2f}'} s |",
                  flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for bench_mods.json")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--first-call", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=("flex", "cuflash"), help=argparse.SUPPRESS)
    parser.add_argument("--skip-cold", action="store_true", help="leave out the cold first calls")
    args = parser.parse_args()
    if args.first_call:
        print(f"{first_call(args.first_call, args.backend):.4f}")
        return 0
    from bench import environment

    print(f"bf16, batch {BATCH}, {HEADS} heads, seqlen {SEQLEN}, head_dim {HEAD_DIM}")
    print("| case | backend | fwd ms | fwd+bwd ms | flex / this (fwd / fwd+bwd) |")
    print("|---|---|---|---|---|")
    result = {"environment": environment(), "shape": [BATCH, HEADS, SEQLEN, HEAD_DIM],
              "rows": measure(args.calls, args.repeats)}
    if not args.skip_cold:
        result["first_calls"] = cold_first_calls()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_mods.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
