"""The variants table of tools/bench.py (issue 16), bf16, head_dim 128, the
FlashAttention-2 grid's shapes (16k tokens, 16 heads):

- sliding window: ``window_size=(WINDOW, 0)`` against full causal attention,
  forward and backward, time ratio (the bar: >= 8x at 16k);
- soft cap (``softcap=30``, Gemma 2's), ALiBi (per-head slopes) and both,
  against plain attention of the same mask, forward and backward, time
  ratio (the bar: at most 1.15);
- dropout (``dropout_p=0.1``) against plain attention, its cost reported
  on its own (no bar: its Philox rounds are work the others do not do).

    python tools/bench.py --variants-only --out $OUT
"""

from __future__ import annotations

TOKENS, HEADS, HEAD_DIM = 16384, 16, 128
SEQLENS = (2048, 4096, 8192, 16384)
WINDOW = 1024
SOFTCAP = 30.0
DROPOUT = 0.1


def _alibi_slopes(heads: int):
    """ALiBi's geometric slopes 2^(-8 (h + 1) / heads)."""
    import cupy

    return cupy.asarray([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=cupy.float32)


def _passes(q, k, v, options: dict):
    """(forward call, backward call) of cuflash with ``options``."""
    import cupy

    import cuflash

    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    dout = cupy.ones_like(out)
    return (lambda: cuflash.attention(q, k, v, **options),
            lambda: cuflash.attention_backward(dout, q, k, v, out, lse, **options))


def variants_table(time_gpu, calls: int, repeats: int) -> list[dict]:
    """Rows of both tables (``time_gpu(fn, calls=, repeats=)``: bench.py's
    GPU timer, milliseconds per call); prints each as it is measured."""
    import cupy

    rows = []
    print("| variant | seqlen | causal | pass | variant ms | baseline ms | speed-up or cost |")
    print("|---|---|---|---|---|---|---|")
    slopes = _alibi_slopes(HEADS)
    for seqlen in SEQLENS:
        batch = TOKENS // seqlen
        rng = cupy.random.default_rng(seqlen)
        q, k, v = (rng.standard_normal((batch, seqlen, HEADS, HEAD_DIM), dtype=cupy.float32)
                   .astype(cupy.dtype("bfloat16")) for _ in range(3))
        baselines = {causal: _passes(q, k, v, dict(causal=causal)) for causal in (False, True)}
        cases = [("window", True, dict(window_size=(WINDOW, 0)))]
        cases += [(name, causal, dict(causal=causal, **options)) for causal in (False, True)
                  for name, options in (("softcap", dict(softcap=SOFTCAP)), ("alibi", dict(alibi_slopes=slopes)),
                                        ("softcap+alibi", dict(softcap=SOFTCAP, alibi_slopes=slopes)),
                                        ("dropout", dict(dropout_p=DROPOUT, dropout_seed=1)))]
        for name, causal, options in cases:
            for pass_index, pass_name in enumerate(("fwd", "bwd")):
                variant_ms = time_gpu(_passes(q, k, v, options)[pass_index], calls=calls, repeats=repeats)
                baseline_ms = time_gpu(baselines[causal][pass_index], calls=calls, repeats=repeats)
                # a window's speed-up over causal attention; a transform's cost over plain attention
                ratio = baseline_ms / variant_ms if name == "window" else variant_ms / baseline_ms
                row = {"variant": name, "seqlen": seqlen, "batch": batch, "causal": causal, "pass": pass_name,
                       "window": WINDOW if name == "window" else None, "ms": {"variant": variant_ms,
                                                                             "baseline": baseline_ms},
                       ("speedup" if name == "window" else "cost"): ratio}
                rows.append(row)
                print(f"| {name}{f' ({WINDOW}, 0)' if name == 'window' else ''} | {seqlen} | {causal} | {pass_name} | "
                      f"{variant_ms:.3f} | {baseline_ms:.3f} | {ratio:.2f}x |", flush=True)
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = []
    window = [r for r in rows if r["variant"] == "window" and r["seqlen"] == max(SEQLENS)]
    for row in window:
        lines.append(f"window ({WINDOW}, 0) at {row['seqlen']} vs causal, {row['pass']}: {row['speedup']:.2f}x "
                     f"(bar >= 8)")
    costs = [r["cost"] for r in rows if "cost" in r and r["variant"] != "dropout"]
    dropout = [r["cost"] for r in rows if r["variant"] == "dropout"]
    if dropout:
        lines.append(f"dropout {DROPOUT} cost over plain attention: max {max(dropout):.3f}, "
                     f"median {sorted(dropout)[len(dropout) // 2]:.3f}")
    if costs:
        lines.append(f"softcap / ALiBi cost over plain attention: max {max(costs):.3f}, "
                     f"median {sorted(costs)[len(costs) // 2]:.3f}; points <= 1.15: "
                     f"{sum(c <= 1.15 for c in costs)}/{len(costs)}")
    return lines

