#!/usr/bin/env python3
"""Attention speed, forward and backward: cuflash against PyTorch SDPA's
FlashAttention-2 (flash) and cuDNN backends, in one process, on the
FlashAttention-2 benchmark grid.

Grid: batch x seqlen = 16384 tokens, hidden 2048 (heads = 2048 / head_dim),
seqlen 512 ... 16k, head_dim 64 and 128, causal and not, bf16 and fp16.
FLOPs follow FlashAttention-2: 4 * batch * heads * seqlen^2 * head_dim,
halved for causal; the backward counts 2.5 times that, forward + backward
3.5 times (its time is the sum of the two measured times). Backward rows are
made for the dtypes of --backward-dtype (default bfloat16 and float16, the
grid of issue 17's bars; "none" for none).

Timing: CUDA events on PyTorch's current stream. Before each timed batch
the stream is held by ``torch.cuda._sleep`` so that every launch of the batch
is queued before the first one starts: the events measure GPU time, not
Python launch overhead (equally for every backend). Warm-up first, then the
median of ``--repeats`` batches of ``--calls`` calls each. Each backend gets
its native layout: cuflash (batch, seqlen, heads, dim), SDPA (batch, heads,
seqlen, dim), both contiguous. Each row also reports cuflash's largest
deviation from the flash backend's output, as a sanity check.

"As the user sees it" (``user_ms``, forward and forward + backward rows):
``triton.testing.do_bench`` (L2 flushed before each call, each call timed
alone with CUDA events, nothing holding the stream, so a call's host cost
shows wherever it exceeds its GPU time), median, with SDPA-layout tensors:
cuflash through its SDPA drop-in (transposed views, no copy), flash and
cuDNN through ``F.scaled_dot_product_attention``; forward + backward is one
autograd step (forward, then ``backward`` of the same dO).

Host overhead (``--host``, on by default; tools/host_overhead.py): per-call
host microseconds of cuflash and SDPA on a small problem, and JAX under
``jax.jit``: cuflash.jax.attention against jax.nn.dot_product_attention.

Writes a table to stdout and ``bench.json`` under ``--out`` (default $OUT).

  python3 tools/bench.py [--dtype bfloat16 --dtype float16] [--seqlens 512,1024] [--head-dims 64,128]
                         [--tiles 128=128x64w4s2 128=wgmma:128x128w8 ...]  # extra cuflash columns: other tiles, s = K/V buffers
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
#: ``--head-dims sweep``: the head dims of common models (issue 14), at seqlen 4096 unless --seqlens says otherwise.
HEAD_DIM_SWEEP = (8, 16, 32, 40, 64, 72, 80, 96, 112, 128, 160, 192, 256)
#: bf16 matrix-multiply rate of the H100 80GB HBM3, for the floor column: the ceiling measured on the
#: device pool's H100s on 2026-11-22 (the same day's runs as BENCHMARKS.md's first anchors).
MATMUL_TFLOPS = {"NVIDIA H100 80GB HBM3": 796.0}


def forward_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


#: FLOPs of each pass in units of the forward's (FlashAttention-2's convention).
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def time_gpu(fn, *, calls: int, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn`` (GPU time, see the module docstring)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        torch.cuda._sleep(20_000_000)  # ~10 ms: the launches below queue up behind it
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def time_user(fn, grad_to_none=None) -> float | None:
    """Median milliseconds per call as the user sees it (see the module
    docstring); None without Triton."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return None
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def measure_user(sdpa_inputs, dout_t, causal) -> tuple[dict, dict]:
    """Milliseconds per call as the user sees it, forward (no grad) and
    autograd forward + backward, of cuflash's SDPA drop-in, SDPA flash and
    SDPA cuDNN on the same SDPA-layout tensors."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash.torch as ct

    leaves = [x.detach().clone().requires_grad_() for x in sdpa_inputs]
    forward, both = {}, {}
    backends = (("cuflash", None, ct.scaled_dot_product_attention), ("flash", SDPBackend.FLASH_ATTENTION, sdpa),
                ("cudnn", SDPBackend.CUDNN_ATTENTION, sdpa))
    for label, backend, attention in backends:
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                with torch.no_grad():
                    ms = time_user(lambda: attention(*sdpa_inputs, is_causal=causal))
                if ms is None:
                    return {}, {}
                forward[label] = ms
                both[label] = time_user(lambda: attention(*leaves, is_causal=causal).backward(dout_t),
                                        grad_to_none=leaves)
        except RuntimeError as exc:  # backend unavailable for this shape
            print(f"# {label} (user timing) unavailable: {exc}", file=sys.stderr)
    return forward, both


def _parse_tiles(specs: list[str]) -> dict[int, list]:
    """``HD=[KERNEL:]BMxBNwW[sS][bB][p]``: an extra cuflash column for head
    dim HD with that kernel ("mma", the default, or "wgmma"), tile, warps,
    K/V buffers (wgmma: the most that fit where not given), (wgmma) blocks
    per SM and (wgmma, ``p``) persistent blocks."""
    from cuflash._tiling import Tiling, with_wgmma_forward_stages

    tiles: dict[int, list] = {}
    for spec in specs:
        head_dim, shape = spec.split("=")
        kernel, shape = shape.split(":") if ":" in shape else ("mma", shape)
        persistent = shape.endswith("p")
        shape = shape.removesuffix("p")
        shape, blocks = shape.split("b") if "b" in shape else (shape, "1")
        shape, stages = shape.split("s") if "s" in shape else (shape, None)
        mn, warps = shape.split("w")
        block_m, block_n = mn.split("x")
        tiling = Tiling(head_dim_padded=int(head_dim), block_m=int(block_m), block_n=int(block_n), warps=int(warps),
                        kernel=kernel, kv_stages=int(stages or 1), blocks_per_sm=int(blocks), persistent=persistent)
        if kernel == "wgmma" and stages is None:
            tiling = with_wgmma_forward_stages(tiling, "bfloat16")
        tiles.setdefault(int(head_dim), []).append(tiling)
    return tiles


def _time_extra_tilings(q, k, v, causal, tilings, calls, repeats) -> dict[str, float]:
    """Milliseconds of the forward launched with each of ``tilings`` instead
    of the table's (same inputs; CuPy views of the PyTorch tensors, buffers,
    the problem and each tiling's launch plan made once)."""
    import cupy
    import torch

    from cuflash import api
    from cuflash._validation import check_forward, meta_of

    if not tilings:
        return {}
    qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
    problem = check_forward(meta_of("q", qc), meta_of("k", kc), meta_of("v", vc), None, causal=causal,
                            softmax_scale=None)
    out = cupy.empty_like(qc)
    lse = cupy.empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=cupy.float32)
    stream = torch.cuda.current_stream().cuda_stream
    layouts = {name: api.Layout.of(x) for name, x in (("q", qc), ("k", kc), ("v", vc), ("out", out))}
    pointers = [x.data.ptr for x in (qc, kc, vc, out, lse)]
    timings = {}
    for t in tilings:
        plan = api.forward_plan(problem, layouts, aligned=True, tiling=t)
        label = f"{t.kernel}-m{t.block_m}n{t.block_n}w{t.warps}s{t.kv_stages}" + (
            "" if t.kernel == "mma" else f"b{t.blocks_per_sm}" + ("p" if t.persistent else ""))
        timings[label] = time_gpu(lambda: plan.launch(pointers, stream), calls=calls, repeats=repeats)
    return timings


def measure_point(q, k, v, sdpa_inputs, causal, tilings, calls, repeats) -> tuple[dict[str, float], float]:
    """Milliseconds per call of cuflash on q, k, v (batch, seqlen, heads, dim),
    SDPA flash and SDPA cuDNN on ``sdpa_inputs`` (the same values in SDPA's
    (batch, heads, seqlen, dim) layout) and of ``tilings``, and cuflash's
    largest deviation from flash."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash

    q_t, k_t, v_t = sdpa_inputs
    float32 = q.dtype == torch.float32
    with torch.no_grad():
        timings = {"cuflash": time_gpu(lambda: cuflash.attention(q, k, v, causal=causal),
                                       calls=calls, repeats=repeats)}
        if float32:  # the opt-in tensor-core path beside the exact one
            timings["cuflash-3xtf32"] = time_gpu(
                lambda: cuflash.attention(q, k, v, causal=causal, fp32_precision="3xtf32"), calls=calls,
                repeats=repeats)
        # float32: SDPA's flash and cuDNN backends take 16-bit inputs only; its
        # memory-efficient one is what a float32 user gets.
        backends = ((("efficient", SDPBackend.EFFICIENT_ATTENTION),) if float32 else
                    (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)))
        for label, backend in backends:
            try:
                with sdpa_kernel(backend):
                    timings[label] = time_gpu(lambda: sdpa(q_t, k_t, v_t, is_causal=causal),
                                              calls=calls, repeats=repeats)
            except RuntimeError as exc:  # backend unavailable for this shape
                print(f"# {label} unavailable at {tuple(q.shape)} {q.dtype}: {exc}", file=sys.stderr)
        ours = cuflash.attention(q, k, v, causal=causal)
        with sdpa_kernel(backends[0][1]):
            theirs = sdpa(q_t, k_t, v_t, is_causal=causal).transpose(1, 2)
        deviation = (ours.float() - theirs.float()).abs().max().item()
        timings.update(_time_extra_tilings(q, k, v, causal, tilings, calls, repeats))
    return timings, deviation


def measure_backward(q, k, v, sdpa_inputs, causal, calls, repeats, deterministic=False) -> dict[str, float]:
    """Milliseconds per call of the backward alone: cuflash.attention_backward
    on the forward's out and LSE (preprocess, dK/dV, dQ conversion), and each
    SDPA backend's autograd backward of one recorded forward (its own
    preprocessing and dQ conversion included), all with the same dO."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash

    generator = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=generator)
    with torch.no_grad():
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    timings = {"cuflash": time_gpu(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal),
                                   calls=calls, repeats=repeats)}
    if deterministic:  # dQ added in a fixed order (tensor-core kernels), or the SIMT passes elsewhere
        timings["cuflash-deterministic"] = time_gpu(
            lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True),
            calls=calls, repeats=repeats)
    leaves = tuple(x.detach().requires_grad_() for x in sdpa_inputs)
    dout_t = dout.transpose(1, 2).contiguous()
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                recorded = sdpa(*leaves, is_causal=causal)
                timings[label] = time_gpu(lambda: torch.autograd.grad(recorded, leaves, dout_t, retain_graph=True),
                                          calls=calls, repeats=repeats)
            del recorded
        except RuntimeError as exc:  # backend unavailable for this shape
            print(f"# {label} backward unavailable at {tuple(q.shape)} {q.dtype}: {exc}", file=sys.stderr)
    return timings


def _row(pass_name, dtype_name, head_dim, causal, seqlen, batch, heads, timings, deviation, user=None) -> dict:
    flops = PASS_FLOPS[pass_name] * forward_flops(batch, heads, seqlen, head_dim, causal)
    row = {"pass": pass_name, "dtype": dtype_name, "head_dim": head_dim, "causal": causal,
           "seqlen": seqlen, "batch": batch, "heads": heads, "flops": flops,
           "max_abs_deviation_from_flash": deviation,
           "ms": timings, "tflops": {name: flops / (ms * 1e9) for name, ms in timings.items()}}
    for base in ("flash", "cudnn", "efficient"):
        if base in timings:
            row[f"cuflash_over_{base}"] = timings[base] / timings["cuflash"]
    if "cuflash-3xtf32" in timings and "efficient" in timings:
        row["cuflash_3xtf32_over_efficient"] = timings["efficient"] / timings["cuflash-3xtf32"]
    if user and "cuflash" in user:
        row["user_ms"] = user
        for base in ("flash", "cudnn"):
            if base in user:
                row[f"user_cuflash_over_{base}"] = user[base] / user["cuflash"]
    return row


def run_grid(dtypes, seqlens, head_dims, causals, calls, repeats, extra_tiles, backward_dtypes=(),
             deterministic=False, user=True) -> list[dict]:
    import torch

    rows = []
    for dtype_name in dtypes:
        for head_dim in head_dims:
            heads = HIDDEN // head_dim
            for seqlen in seqlens:
                batch = TOKENS // seqlen
                generator = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda",
                                       dtype=getattr(torch, dtype_name), generator=generator) for _ in range(3))
                sdpa_inputs = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))  # SDPA's native layout
                dout_t = torch.randn(sdpa_inputs[0].shape, device="cuda", dtype=q.dtype, generator=generator)
                for causal in causals:
                    timings, deviation = measure_point(q, k, v, sdpa_inputs, causal, extra_tiles.get(head_dim, []),
                                                       calls, repeats)
                    user_forward, user_both = measure_user(sdpa_inputs, dout_t, causal) if user else ({}, {})
                    shape = (dtype_name, head_dim, causal, seqlen, batch, heads)
                    rows.append(_row("fwd", *shape, timings, deviation, user_forward))
                    print(_row_line(rows[-1]), flush=True)
                    if dtype_name in backward_dtypes:
                        backward = measure_backward(q, k, v, sdpa_inputs, causal, calls, repeats, deterministic)
                        rows.append(_row("bwd", *shape, backward, deviation))
                        print(_row_line(rows[-1]), flush=True)
                        both = {name: timings[name] + backward[name] for name in backward if name in timings}
                        rows.append(_row("fwd+bwd", *shape, both, deviation, user_both))
                        print(_row_line(rows[-1]), flush=True)
                del q, k, v, sdpa_inputs, dout_t
                torch.cuda.empty_cache()
    return rows


def _row_line(row: dict) -> str:
    t = row["tflops"]
    extra = " ".join(f"{name}={value:.0f}" for name, value in t.items()
                     if name not in ("cuflash", "flash", "cudnn"))
    return (f"| {row['pass']} | {row['dtype']} | {row['head_dim']} | {'yes' if row['causal'] else 'no'} | {row['seqlen']} | "
            f"{t['cuflash']:.0f} | {t.get('flash', float('nan')):.0f} | {t.get('cudnn', float('nan')):.0f} | "
            f"{row.get('cuflash_over_flash', float('nan')):.2f} | {row.get('cuflash_over_cudnn', float('nan')):.2f} | "
            f"{row['max_abs_deviation_from_flash']:.1e} |" + (f" {extra}" if extra else "")
            + (f" user cuflash/flash {row['user_cuflash_over_flash']:.2f}" if "user_cuflash_over_flash" in row else ""))


HEADER = ("| pass | dtype | head_dim | causal | seqlen | cuflash TFLOP/s | flash TFLOP/s | cuDNN TFLOP/s | "
          "cuflash/flash | cuflash/cuDNN | max abs dev. vs flash (fwd) |\n|---|---|---|---|---|---|---|---|---|---|---|")


def environment() -> dict:
    import cupy
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        driver = "unknown"
    try:
        commit = os.environ.get("CUFLASH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"device": props.name, "driver": driver, "torch": torch.__version__, "cupy": cupy.__version__,
            "cuda_runtime": torch.version.cuda, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def cudnn_summary(rows) -> list[str]:
    """Issue 17's bars, read off the grid's rows: per dtype and pass, the
    lowest cuflash / cuDNN ratio from seqlen 2048 up and below it, and how
    many points reach 1.0 (from 2k) and 0.9 (below)."""
    lines = []
    for dtype in sorted({r["dtype"] for r in rows if "cuflash_over_cudnn" in r}):
        for pass_name in ("fwd", "bwd"):
            picked = [r for r in rows if r["dtype"] == dtype and r["pass"] == pass_name and "cuflash_over_cudnn" in r]
            if not picked:
                continue
            parts = []
            for label, chosen, bar in (("from 2k", [r for r in picked if r["seqlen"] >= 2048], 1.0),
                                       ("below 2k", [r for r in picked if r["seqlen"] < 2048], 0.9)):
                if chosen:
                    ratios = [r["cuflash_over_cudnn"] for r in chosen]
                    worst = min(chosen, key=lambda r: r["cuflash_over_cudnn"])
                    parts.append(f"{label} min {min(ratios):.3f} (d{worst['head_dim']} "
                                 f"{'causal' if worst['causal'] else 'full'} {worst['seqlen']}), "
                                 f">= {bar}: {sum(x >= bar for x in ratios)}/{len(ratios)}")
            lines.append(f"{dtype} {pass_name} cuflash/cuDNN: " + "; ".join(parts))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=("bfloat16", "float16", "float32"),
                        help="float32 rows time the exact path and fp32_precision='3xtf32' against SDPA's "
                             "memory-efficient backend (forward only)")
    parser.add_argument("--seqlens", default=None, help=f"default {','.join(map(str, SEQLENS))}")
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)),
                        help="comma-separated, or 'sweep' for the head-dim sweep (seqlen 4096 by default)")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tiles", action="append", default=[], help="HEAD_DIM=[KERNEL:]BMxBNwWARPS[sSTAGES][bBLOCKS][p], extra cuflash column (p: persistent)")
    parser.add_argument("--backward-dtype", action="append", choices=("bfloat16", "float16", "none"),
                        help="dtypes that also get backward and forward+backward rows (default: bfloat16 and "
                             "float16)")
    parser.add_argument("--deterministic", action="store_true",
                        help="backward rows also time deterministic=True (column cuflash-deterministic)")
    parser.add_argument("--no-user", action="store_true", help="skip the as-the-user-sees-it timings")
    parser.add_argument("--no-host", action="store_true", help="skip the host-overhead tables")
    parser.add_argument("--host-only", action="store_true", help="only the host-overhead tables")
    parser.add_argument("--varlen", action="store_true",
                        help="also the variable-length table (packed batches against dense, tools/bench_varlen.py)")
    parser.add_argument("--varlen-only", action="store_true", help="only the variable-length table")
    parser.add_argument("--decode", action="store_true",
                        help="also the decode table (KV caches against SDPA flash/cuDNN, tools/bench_decode.py)")
    parser.add_argument("--decode-only", action="store_true", help="only the decode table")
    parser.add_argument("--variants", action="store_true",
                        help="also the variants table (sliding window, soft cap, ALiBi; issue 16)")
    parser.add_argument("--variants-only", action="store_true", help="only the variants table")
    parser.add_argument("--generation", type=int, choices=(80, 90),
                        help="pick cuflash's kernels as a GPU of this kernel generation would (80: the sm_80 "
                             "kernels, measured on a Hopper GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.generation:
        from cuflash import api

        api._kernel_generation = lambda device_id: args.generation
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    sweep = args.head_dims == "sweep"
    head_dims = HEAD_DIM_SWEEP if sweep else tuple(int(d) for d in args.head_dims.split(","))
    seqlens = (4096,) if sweep and args.seqlens is None else tuple(
        int(s) for s in (args.seqlens or ",".join(map(str, SEQLENS))).split(","))
    env = environment()
    print(f"# {env['device']}, driver {env['driver']}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    result = {"environment": env, "matmul_tflops": MATMUL_TFLOPS.get(env["device"]), "rows": []}
    only = args.varlen_only or args.decode_only or args.variants_only
    if not args.no_host and not only:
        import host_overhead

        result["host_overhead"] = host_overhead.torch_host_table()
        try:
            result["jax_jit"] = host_overhead.jax_table()
        except ImportError as exc:
            print(f"# JAX table skipped: {exc}")
            result["jax_jit"] = []
        print("\n".join(host_overhead.markdown(result["host_overhead"], result["jax_jit"])) + "\n", flush=True)
    rows = result["rows"]
    if args.varlen or args.varlen_only:
        import bench_varlen

        result["varlen"] = bench_varlen.varlen_table(time_gpu, args.calls, args.repeats)
        ratios = [r["varlen_over_dense"] for r in result["varlen"]]
        print(f"\nvarlen / dense TFLOP/s: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
              f"points >= 0.9: {sum(r >= 0.9 for r in ratios)}/{len(ratios)}\n", flush=True)
    if args.decode or args.decode_only:
        import bench_decode

        result["decode"] = bench_decode.decode_table(time_gpu, args.calls, args.repeats)
        print("\n".join(bench_decode.summary(result["decode"])) + "\n", flush=True)
        import host_overhead

        result["decode_host"] = bench_decode.decode_host_table(time_gpu, time_user, host_overhead.host_us)
        print("\n".join(bench_decode.host_markdown(result["decode_host"])) + "\n", flush=True)
    if args.variants or args.variants_only:
        import bench_variants

        result["variants"] = bench_variants.variants_table(time_gpu, args.calls, args.repeats)
        print("\n".join(bench_variants.summary(result["variants"])) + "\n", flush=True)
    if not args.host_only and not only:
        print(HEADER)
        rows += run_grid(args.dtype or ["bfloat16", "float16"], seqlens, head_dims, causals, args.calls, args.repeats,
                         _parse_tiles(args.tiles), backward_dtypes=tuple(args.backward_dtype or ["bfloat16", "float16"]),
                         deterministic=args.deterministic, user=not args.no_user)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    for pass_name in PASS_FLOPS:
        ratios = [r["cuflash_over_flash"] for r in rows
                  if r["dtype"] == "bfloat16" and r["pass"] == pass_name and "cuflash_over_flash" in r]
        if ratios:
            print(f"\nbf16 {pass_name} cuflash/flash: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
                  f"points >= 1.0: {sum(r >= 1.0 for r in ratios)}/{len(ratios)}")
        user = [r["user_cuflash_over_flash"] for r in rows
                if r["dtype"] == "bfloat16" and r["pass"] == pass_name and "user_cuflash_over_flash" in r]
        if user:
            print(f"bf16 {pass_name} as the user sees it, cuflash/flash: min {min(user):.3f}, "
                  f"median {statistics.median(user):.3f}; points >= 1.0: {sum(r >= 1.0 for r in user)}/{len(user)}")
    for line in cudnn_summary(rows):
        print(line)
    fp32 = [r for r in rows if r["dtype"] == "float32" and r["pass"] == "fwd" and "cuflash_3xtf32_over_efficient" in r]
    if fp32:
        for label, key in (("3xtf32", "cuflash_3xtf32_over_efficient"), ("exact", "cuflash_over_efficient")):
            ratios = [r[key] for r in fp32]
            print(f"float32 fwd cuflash {label}/SDPA efficient: min {min(ratios):.3f}, "
                  f"median {statistics.median(ratios):.3f}; points >= 1.0: {sum(x >= 1.0 for x in ratios)}/{len(ratios)}")
    deterministic = [r["ms"]["cuflash"] / r["ms"]["cuflash-deterministic"] for r in rows
                     if r["pass"] == "bwd" and "cuflash-deterministic" in r["ms"]]
    if deterministic:
        print(f"deterministic backward / default backward speed: min {min(deterministic):.3f}, "
              f"median {statistics.median(deterministic):.3f}; points >= 0.75: "
              f"{sum(r >= 0.75 for r in deterministic)}/{len(deterministic)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
