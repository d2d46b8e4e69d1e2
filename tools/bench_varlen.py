"""The variable-length table of tools/bench.py (issue 15): packed batches
of mixed lengths against dense cuflash on batches of the same total tokens,
forward and backward, in TFLOP/s counted on the real tokens only
(FlashAttention-2's convention per sequence: 4 * len_q * len_k * heads *
head_dim, halved when causal; the backward 2.5x the forward).

    python tools/bench.py --varlen-only --out $OUT
"""

from __future__ import annotations

import numpy as np

#: (name, dense batch x seqlen, packed lengths' spread): every packed batch
#: holds the dense batch's tokens; "equal" the same lengths, "mixed" lengths
#: drawn uniformly from [seqlen / 8, 15 seqlen / 8].
SHAPES = (("equal", 8, 2048, None), ("mixed", 8, 2048, (1, 15)), ("equal", 64, 256, None),
          ("mixed", 64, 256, (1, 15)))
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def packed_lengths(batch: int, seqlen: int, spread, seed: int = 0) -> list[int]:
    """``batch``-ish lengths summing to batch * seqlen: all equal, or drawn
    from [seqlen * lo / 8, seqlen * hi / 8] with the last one cut to fit."""
    if spread is None:
        return [seqlen] * batch
    rng = np.random.default_rng(seed)
    total, lengths = batch * seqlen, []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(seqlen * spread[0] // 8, seqlen * spread[1] // 8 + 1)))
    lengths[-1] -= sum(lengths) - total
    return [length for length in lengths if length > 0]


def flops(lengths: list[int], causal: bool) -> float:
    total = sum(4.0 * n * n * HEADS * HEAD_DIM for n in lengths)
    return total / 2 if causal else total


def varlen_table(time_gpu, calls: int, repeats: int) -> list[dict]:
    """Rows of the table (``time_gpu(fn, calls=, repeats=)``: bench.py's
    GPU timer, milliseconds per call); prints each as it is measured."""
    import cupy

    import cuflash

    rows = []
    print("| lengths | dense | sequences | causal | pass | varlen TFLOP/s | dense TFLOP/s | varlen / dense |")
    print("|---|---|---|---|---|---|---|---|")
    for name, batch, seqlen, spread in SHAPES:
        lengths = packed_lengths(batch, seqlen, spread, seed=batch)
        total = batch * seqlen
        rng = cupy.random.default_rng(0)
        q = rng.standard_normal((total, HEADS, HEAD_DIM), dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
        k = rng.standard_normal((total, KV_HEADS, HEAD_DIM), dtype=cupy.float32).astype(q.dtype)
        v = rng.standard_normal((total, KV_HEADS, HEAD_DIM), dtype=cupy.float32).astype(q.dtype)
        cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]), dtype=cupy.int32)
        longest = max(lengths)
        dense = [x.reshape(batch, seqlen, *x.shape[1:]) for x in (q, k, v)]
        for causal in (False, True):
            out, lse = cuflash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
            dense_out, dense_lse = cuflash.attention(*dense, causal=causal, return_lse=True)
            dout = cupy.ones_like(out)
            runs = {
                "fwd": (lambda: cuflash.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal),
                        lambda: cuflash.attention(*dense, causal=causal)),
                "bwd": (lambda: cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, longest, longest,
                                                                  causal=causal),
                        lambda: cuflash.attention_backward(dout.reshape(dense_out.shape), *dense, dense_out,
                                                           dense_lse, causal=causal)),
            }
            for pass_name, (packed_call, dense_call) in runs.items():
                factor = 2.5 if pass_name == "bwd" else 1.0
                packed_ms = time_gpu(packed_call, calls=calls, repeats=repeats)
                dense_ms = time_gpu(dense_call, calls=calls, repeats=repeats)
                packed_tflops = factor * flops(lengths, causal) / packed_ms / 1e9
                dense_tflops = factor * flops([seqlen] * batch, causal) / dense_ms / 1e9
                row = {"lengths": name, "dense": f"{batch}x{seqlen}", "sequences": len(lengths),
                       "min_length": min(lengths), "max_length": longest, "causal": causal, "pass": pass_name,
                       "ms": {"varlen": packed_ms, "dense": dense_ms},
                       "tflops": {"varlen": packed_tflops, "dense": dense_tflops},
                       "varlen_over_dense": packed_tflops / dense_tflops}
                rows.append(row)
                print(f"| {name} {min(lengths)}-{longest} | {batch}x{seqlen} | {len(lengths)} | {causal} | "
                      f"{pass_name} | {packed_tflops:.1f} | {dense_tflops:.1f} | {row['varlen_over_dense']:.3f} |",
                      flush=True)
    return rows
