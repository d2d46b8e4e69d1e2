"""Host cost of a call, as tools/bench.py reports it: per-call host
microseconds of cuflash and of the frameworks' own attention on a small
problem, and the per-step time of a jitted JAX training step.

Host time per call: the GPU is held by a sleep kernel (``torch.cuda._sleep``)
on the stream every call below launches to, ``calls`` calls are timed with
``time.perf_counter`` while their launches queue behind it, then the stream
is drained; the median over ``repeats`` such batches, divided by ``calls``.
Nothing waits on the GPU inside the timed loop, so this is Python plus
launch cost, the floor of what a call costs when its GPU work is short.
"""

from __future__ import annotations

import statistics
import time

#: The small problem of the launch-path issue: batch 1, 128 tokens, 8 heads, head_dim 64, bf16, causal.
SMALL = dict(batch=1, seqlen=128, heads=8, head_dim=64)
#: The JAX training-step point: seqlen 2048, head_dim 128 on the FlashAttention-2 grid (16384 tokens, hidden 2048).
JAX_STEP = dict(batch=8, seqlen=2048, heads=16, head_dim=128)


def host_us(candidates: dict, *, calls: int = 100, repeats: int = 15, warmup: int = 5) -> dict[str, float]:
    """Median host microseconds per call of each function in ``candidates``
    (name -> fn; see the module docstring). The candidates take turns, batch
    by batch, so that a drift of the host's speed hits them alike."""
    import torch

    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            torch.cuda._sleep(100_000_000)  # ~50 ms: far longer than the timed launches take to queue
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in samples.items()}


def torch_host_table() -> list[dict]:
    """Per-call host µs of each call on the small problem, PyTorch and CuPy."""
    import cupy
    import torch
    import torch.nn.functional as F

    import cuflash
    import cuflash.torch as ct

    b, s, h, d = SMALL["batch"], SMALL["seqlen"], SMALL["heads"], SMALL["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    q_t, k_t, v_t, dout_t = (x.transpose(1, 2) for x in (q, k, v, dout))  # SDPA layout, views
    cq, ck, cv, cdout, cout, clse = (cupy.from_dlpack(x) for x in (q, k, v, dout, out, lse))
    leaves = [x.detach().clone().requires_grad_() for x in (q_t, k_t, v_t)]

    def autograd_step(attention, **kwargs):
        def step():
            for leaf in leaves:
                leaf.grad = None
            attention(*leaves, is_causal=True, **kwargs).backward(dout_t)
        return step

    def dropin_route(route):
        def attention(q, k, v, is_causal):
            return ct._forward(q, k, v, is_causal, None, route=route, heads_first=True)
        return attention

    passes = {
        "forward": {
            "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True),
            "cuflash.attention (PyTorch)": lambda: cuflash.attention(q, k, v, causal=True),
            "cuflash.attention (CuPy)": lambda: cuflash.attention(cq, ck, cv, causal=True),
            "cuflash.torch.scaled_dot_product_attention": lambda: ct.scaled_dot_product_attention(
                q_t, k_t, v_t, is_causal=True),
        },
        "backward": {
            "cuflash.attention_backward (PyTorch)": lambda: cuflash.attention_backward(dout, q, k, v, out, lse,
                                                                                     causal=True),
            "cuflash.attention_backward (CuPy)": lambda: cuflash.attention_backward(cdout, cq, ck, cv, cout, clse,
                                                                                  causal=True),
        },
    }
    rows = []
    for what, candidates in passes.items():
        with torch.no_grad():
            timings = host_us(candidates)
        rows += [(what, name, us) for name, us in timings.items()]
    autograd = {"F.scaled_dot_product_attention": autograd_step(F.scaled_dot_product_attention)}
    for route in ("function", "custom_op"):
        autograd[f"cuflash.torch.scaled_dot_product_attention ({route} route)"] = autograd_step(dropin_route(route))
    rows += [("autograd fwd+bwd", name, us) for name, us in host_us(autograd, calls=50).items()]
    return [{"what": what, "call": call, "host_us": us} for what, call, us in rows]


def _time_jax(fn, args, *, calls: int, repeats: int = 7) -> float:
    """Median microseconds per call of a jitted ``fn`` run ``calls`` times
    back to back (async dispatch), the last result waited for."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        jax.block_until_ready(result)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def jax_table() -> list[dict]:
    """Under ``jax.jit``: per-call µs of a forward and of a forward + backward
    on the small problem (host-bound), and per-step µs of a training step
    (value and gradient with respect to q, k, v) at seqlen 2048, head_dim
    128, causal, bf16: cuflash.jax.attention against
    jax.nn.dot_product_attention (its cuDNN implementation, and XLA's)."""
    import jax
    import jax.numpy as jnp

    import cuflash.jax as cj

    def candidates():
        yield "cuflash.jax.attention", lambda q, k, v: cj.attention(q, k, v, causal=True)
        for implementation in ("cudnn", "xla"):
            yield (f"jax.nn.dot_product_attention ({implementation})",
                   lambda q, k, v, i=implementation: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                  implementation=i))

    rows = []
    for point, calls in ((SMALL, 200), (JAX_STEP, 20)):
        b, s, h, d = point["batch"], point["seqlen"], point["heads"], point["head_dim"]
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v, weight = (jax.random.normal(key, (b, s, h, d), dtype=jnp.bfloat16) for key in keys)
        for name, attention in candidates():
            forward = jax.jit(attention)
            step = jax.jit(jax.value_and_grad(
                lambda q, k, v, a=attention: (a(q, k, v).astype(jnp.float32) * weight).sum(), argnums=(0, 1, 2)))
            try:
                rows.append({"point": point, "call": name, "pass": "fwd",
                             "us": _time_jax(forward, (q, k, v), calls=calls)})
                rows.append({"point": point, "call": name, "pass": "fwd+bwd step",
                             "us": _time_jax(step, (q, k, v), calls=calls)})
            except Exception as exc:  # an implementation unavailable for this shape
                rows.append({"point": point, "call": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
        if point is JAX_STEP:
            rows += _jax_block_rows(candidates(), point, calls)
    return rows


def _jax_block_rows(candidates, point: dict, calls: int) -> list[dict]:
    """Per-step µs of a jitted training step of one pre-norm transformer
    block (QKV projection, causal attention, output projection, 4x MLP,
    bf16 weights and activations; value and gradient with respect to all
    weights) on ``point``'s tokens, hidden = heads * head_dim."""
    import jax
    import jax.numpy as jnp

    b, s, h, d = point["batch"], point["seqlen"], point["heads"], point["head_dim"]
    hidden = h * d
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    init = lambda key, shape: (jax.random.normal(key, shape, jnp.float32) / shape[0] ** 0.5).astype(jnp.bfloat16)  # noqa: E731
    params = {"qkv": init(keys[0], (hidden, 3 * hidden)), "proj": init(keys[1], (hidden, hidden)),
              "up": init(keys[2], (hidden, 4 * hidden)), "down": init(keys[3], (4 * hidden, hidden))}
    x = jax.random.normal(keys[4], (b, s, hidden), dtype=jnp.bfloat16)

    def norm(x):
        x32 = x.astype(jnp.float32)
        return ((x32 - x32.mean(-1, keepdims=True)) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1e-5)).astype(x.dtype)

    rows = []
    for name, attention in candidates:
        def loss(params, x, attention=attention):
            qkv = (norm(x) @ params["qkv"]).reshape(b, s, 3, h, d)
            x = x + attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(b, s, hidden) @ params["proj"]
            x = x + jax.nn.gelu(norm(x) @ params["up"]) @ params["down"]
            return x.astype(jnp.float32).mean()

        step = jax.jit(jax.value_and_grad(loss))
        try:
            rows.append({"point": point, "call": name, "pass": "transformer block step",
                         "us": _time_jax(step, (params, x), calls=calls)})
        except Exception as exc:
            rows.append({"point": point, "call": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


#: The yardstick of each pass in the same run: SDPA's forward for one call
#: (forward or backward), SDPA's autograd step for an autograd step.
_YARDSTICK = {"forward": ("forward", "F.scaled_dot_product_attention"),
              "backward": ("forward", "F.scaled_dot_product_attention"),
              "autograd fwd+bwd": ("autograd fwd+bwd", "F.scaled_dot_product_attention")}


def sdpa_ratios(torch_rows: list[dict]) -> list[float | None]:
    """Each row's host µs over its yardstick's in the same run
    (``_YARDSTICK``; None where that row is missing): hosts differ by tens
    of percent, so the bars of the launch-path issue compare within a run."""
    measured = {(r["what"], r["call"]): r["host_us"] for r in torch_rows}
    ratios = []
    for r in torch_rows:
        yardstick = measured.get(_YARDSTICK.get(r["what"]))
        ratios.append(r["host_us"] / yardstick if yardstick else None)
    return ratios


def markdown(torch_rows: list[dict], jax_rows: list[dict]) -> list[str]:
    lines = ["| pass | call | host µs per call | / SDPA's (forward; autograd: its step) |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['call']} | {r['host_us']:.1f} | {'-' if ratio is None else f'{ratio:.2f}'} |"
              for r, ratio in zip(torch_rows, sdpa_ratios(torch_rows))]
    lines += ["", "| JAX, under jax.jit | point (batch, seqlen, heads, head_dim) | pass | µs per call |",
              "|---|---|---|---|"]
    for r in jax_rows:
        p = r["point"]
        where = f"{p['batch']}, {p['seqlen']}, {p['heads']}, {p['head_dim']}"
        value = f"{r['us']:.1f}" if "us" in r else r["error"]
        lines.append(f"| {r['call']} | {where} | {r.get('pass', '-')} | {value} |")
    return lines


def across_runs_markdown(runs: list[tuple[str, list[dict]]]) -> list[str]:
    """One host table of several runs (label, ``torch_host_table`` rows),
    a column per run: host µs and, in brackets, the ratio to SDPA's
    yardstick in that run (``sdpa_ratios``). Rows are the calls of the
    first run, then any only later runs have; "-" where a run lacks one."""
    cells, order = {}, []
    for column, (_, rows) in enumerate(runs):
        for r, ratio in zip(rows, sdpa_ratios(rows)):
            row = (r["what"], r["call"])
            if row not in cells:
                cells[row] = ["-"] * len(runs)
                order.append(row)
            cells[row][column] = f"{r['host_us']:.1f}" + ("" if ratio is None else f" ({ratio:.2f})")
    lines = ["| pass | call | " + " | ".join(label for label, _ in runs) + " |",
             "|---|---|" + "---|" * len(runs)]
    lines += [f"| {what} | {call} | " + " | ".join(cells[(what, call)]) + " |" for what, call in order]
    return lines


def following_rows(rounds: int = 3) -> list[dict]:
    """The small problem's autograd step (SDPA drop-in) with the backward
    following its forward's cached call and made not to (the signature
    path every step), against SDPA's step, interleaved; ``rounds`` runs of
    ``host_us``."""
    import torch
    import torch.nn.functional as F

    import cuflash.torch as ct

    b, s, h, d = SMALL["batch"], SMALL["seqlen"], SMALL["heads"], SMALL["head_dim"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    # As torch_host_table's: SDPA's axes over cuflash's memory order.
    leaves = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
              .clone().requires_grad_() for _ in range(3)]
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
    holds = ct._SavedForward.holds

    def step(attention, follow=True):
        def run():
            ct._SavedForward.holds = holds if follow else (lambda *_: False)
            for leaf in leaves:
                leaf.grad = None
            attention(*leaves, is_causal=True).backward(dout)
        return run

    candidates = {"F.scaled_dot_product_attention": step(F.scaled_dot_product_attention),
                  "drop-in, backward following": step(ct.scaled_dot_product_attention),
                  "drop-in, signature path": step(ct.scaled_dot_product_attention, follow=False)}
    rows = []
    try:
        for round_ in range(rounds):
            timings = host_us(candidates, calls=50, repeats=21)
            rows += [{"round": round_, "call": name, "host_us": us,
                      "ratio": us / timings["F.scaled_dot_product_attention"]} for name, us in timings.items()]
    finally:
        ct._SavedForward.holds = holds
    return rows


#: Backwards of one key block (direct dQ on Hopper): (batch, seqlen, heads, head_dim, causal).
DIRECT_DQ_POINTS = ((1, 128, 8, 64, True), (32, 128, 16, 128, False), (64, 128, 16, 64, True),
                    (16, 100, 32, 128, True))


def direct_dq_rows(rounds: int = 3) -> list[dict]:
    """The backward with the direct dQ mode (``cuflash.api.stores_dq_directly``
    as the launcher decides: one launch that computes delta and stores dQ)
    against the same calls with it refused (the preprocessing kernel, the
    float32 accumulator and the conversion kernel), in one process: each side
    plans into its own plan cache, swapped in per call. Host µs (``host_us``,
    ``rounds`` runs) of the small problem's autograd step (SDPA drop-in,
    against SDPA's) and of ``attention_backward``; GPU µs per
    ``attention_backward`` call at ``DIRECT_DQ_POINTS``, with launches queued
    (CUDA events over 50 calls) and per call waited for (host clock around a
    call and a synchronisation), medians of 7 alternating rounds."""
    import torch
    import torch.nn.functional as F

    import cuflash
    import cuflash.torch as ct
    from cuflash import api
    from cuflash._launch import PlanCache

    decide = api.stores_dq_directly
    sides = {"direct": (PlanCache(), decide), "converted": (PlanCache(), lambda *args: False)}

    def on(side, fn):
        cache, decision = sides[side]

        def run():
            api.plans, api.stores_dq_directly = cache, decision
            return fn()
        return run

    def tensors(b, s, h, d):
        gen = torch.Generator(device="cuda").manual_seed(0)
        return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]

    plans = api.plans
    rows = []
    try:
        b, s, h, d = SMALL["batch"], SMALL["seqlen"], SMALL["heads"], SMALL["head_dim"]
        q, k, v, dout = tensors(b, s, h, d)
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        leaves = [x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v)]

        def step(attention):
            def run():
                for leaf in leaves:
                    leaf.grad = None
                attention(*leaves, is_causal=True).backward(dout.transpose(1, 2))
            return run

        for round_ in range(rounds):
            candidates = {"SDPA step": step(F.scaled_dot_product_attention)}
            for side in sides:
                candidates[f"{side}: drop-in step"] = on(side, step(ct.scaled_dot_product_attention))
                candidates[f"{side}: attention_backward"] = on(
                    side, lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True))
            timings = host_us(candidates, calls=50, repeats=21)
            rows += [{"kind": "host", "round": round_, "call": name, "us": us,
                      "ratio": us / timings["SDPA step"] if "step" in name else None}
                     for name, us in timings.items()]
        for b, s, h, d, causal in DIRECT_DQ_POINTS:
            q, k, v, dout = tensors(b, s, h, d)
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            calls = {side: on(side, lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal))
                     for side in sides}
            queued, waited = {side: [] for side in sides}, {side: [] for side in sides}
            for fn in calls.values():
                for _ in range(5):
                    fn()
            torch.cuda.synchronize()
            for _ in range(7):
                for side, fn in calls.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(50):
                        fn()
                    end.record()
                    end.synchronize()
                    queued[side].append(start.elapsed_time(end) / 50 * 1e3)
                    once = []
                    for _ in range(30):
                        begin = time.perf_counter()
                        fn()
                        torch.cuda.synchronize()
                        once.append((time.perf_counter() - begin) * 1e6)
                    waited[side].append(statistics.median(once))
            point = f"{b}x{s}x{h}x{d}{' causal' if causal else ''}"
            rows += [{"kind": "gpu", "point": point, "call": side, "queued_us": statistics.median(queued[side]),
                      "waited_us": statistics.median(waited[side])} for side in sides]
    finally:
        api.plans, api.stores_dq_directly = plans, decide
    return rows


def profile(what: str, calls: int = 2000, top: int = 25) -> None:
    """cProfile of ``calls`` calls of one small-problem call ("forward-torch",
    "forward-cupy", "backward-torch", "autograd-function", "autograd-custom_op"),
    the stream held as in ``host_us``; prints the ``top`` entries by own time."""
    import cProfile
    import pstats

    import cupy
    import torch

    import cuflash
    import cuflash.torch as ct

    b, s, h, d = SMALL["batch"], SMALL["seqlen"], SMALL["heads"], SMALL["head_dim"]
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    leaves = [x.transpose(1, 2).detach().clone().requires_grad_() for x in (q, k, v)]
    dout_t = dout.transpose(1, 2)

    def autograd(route):
        def step():
            for leaf in leaves:
                leaf.grad = None
            ct._forward(*leaves, True, None, route=route, heads_first=True).backward(dout_t)
        return step

    calls_by_name = {
        "forward-torch": lambda: cuflash.attention(q, k, v, causal=True),
        "forward-cupy": lambda: cuflash.attention(cq, ck, cv, causal=True),
        "backward-torch": lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True),
        "autograd-function": autograd("function"),
        "autograd-custom_op": autograd("custom_op"),
    }
    fn = calls_by_name[what]
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    done = 0
    while done < calls:
        torch.cuda._sleep(100_000_000)
        profiler.enable()
        for _ in range(min(100, calls - done)):
            fn()
        profiler.disable()
        done += 100
        torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="host cost per call; --profile NAME for a cProfile of one call")
    parser.add_argument("--profile", action="append", default=[])
    parser.add_argument("--compare-following", action="store_true",
                        help="the autograd step with and without the backward following its forward")
    parser.add_argument("--compare-direct-dq", action="store_true",
                        help="backwards of one key block with and without the direct dQ mode")
    args = parser.parse_args()
    for name in args.profile:
        print(f"=== {name}")
        profile(name)
    if args.compare_following:
        for row in following_rows():
            print(f"round {row['round']}  {row['call']:32s} {row['host_us']:8.1f} us  {row['ratio']:.3f}x")
    if args.compare_direct_dq:
        for row in direct_dq_rows():
            if row["kind"] == "host":
                ratio = "" if row["ratio"] is None else f"  {row['ratio']:.3f}x"
                print(f"round {row['round']}  {row['call']:32s} {row['us']:8.1f} us{ratio}")
            else:
                print(f"{row['point']:22s} {row['call']:10s} queued {row['queued_us']:7.1f} us  "
                      f"waited {row['waited_us']:7.1f} us")
    if not (args.profile or args.compare_following or args.compare_direct_dq):
        print("\n".join(markdown(torch_host_table(), jax_table())))
