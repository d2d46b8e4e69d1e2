"""Calls of the Hopper kernels for compute-sanitizer (tools/gpu_check.sh runs
this under memcheck, racecheck and synccheck): the warp-specialised forward
and backward (TMA copies, mbarrier rings, named barriers, the dQ warp's bulk
reductions, the direct dQ mode's delta warps) at every tile shape of their
tables, causal and not, atomic and ordered dQ, with partial blocks at both ends, dense batches and packed
(variable-length) ones, persistent forward blocks walking many tiles
(plain and causal pairs), decoding, and the variants (a window with soft
cap and per-(batch, head) ALiBi slopes). Sizes are small: racecheck
tracks every shared-memory access. Exits 1 if a result is not finite, so a
run that the sanitizer lets through still checks the kernels ran.

    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize.py
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

import cuflash
from cuflash._tiling import WGMMA_BACKWARD_TILES, WGMMA_FORWARD_TILES, wgmma_backward_tiling, wgmma_forward_tiling


def _inputs(head_dim: int, seqlen_q: int, seqlen_k: int, seed: int):
    rng = cupy.random.default_rng(seed)
    q = rng.standard_normal((1, seqlen_q, 2, head_dim), dtype=cupy.float32).astype(cupy.float16)
    k = rng.standard_normal((1, seqlen_k, 1, head_dim), dtype=cupy.float32).astype(cupy.float16)
    v = rng.standard_normal((1, seqlen_k, 1, head_dim), dtype=cupy.float32).astype(cupy.float16)
    return q, k, v


def head_dims_of_every_tiling() -> list[int]:
    """The tables' buckets, and the smallest head dim of each (forward,
    backward) tiling pair they miss (a table may pick tiles by head dim within
    a bucket: WGMMA_FORWARD_PARTIAL_SECTOR_TILES)."""
    def tilings(head_dim):
        return wgmma_forward_tiling("float16", head_dim), wgmma_backward_tiling("float16", head_dim)

    head_dims = sorted(set(WGMMA_FORWARD_TILES) | set(WGMMA_BACKWARD_TILES))
    covered = {tilings(head_dim) for head_dim in head_dims}
    for head_dim in range(8, max(head_dims) + 1, 8):
        if tilings(head_dim) not in covered:
            covered.add(tilings(head_dim))
            head_dims.append(head_dim)
    return head_dims


def main() -> int:
    if cupy.cuda.Device().compute_capability != "90":
        print("needs an sm_90 GPU (the warp-specialised kernels are Hopper's)")
        return 1
    failures = []
    for head_dim in head_dims_of_every_tiling():
        for causal in (False, True):
            for deterministic in (False, True):
                # More queries than keys and the reverse: partial blocks, rows
                # that see no key, several query blocks per key block; and
                # one key block (the direct dQ mode: its delta warps reading
                # the O and dO tiles of two heads' steps).
                for seqlen_q, seqlen_k in ((200, 130), (70, 260), (40, 60)):
                    q, k, v = _inputs(head_dim, seqlen_q, seqlen_k, seed=head_dim + seqlen_q)
                    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                    dout = cupy.ones_like(out)
                    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                       deterministic=deterministic)
                    cupy.cuda.Device().synchronize()
                    for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
                        if not bool(cupy.isfinite(x.astype(cupy.float32)).all()):
                            failures.append(f"d{head_dim} causal={causal} deterministic={deterministic} "
                                            f"{seqlen_q}x{seqlen_k}: {name} not finite")
                print(f"head_dim {head_dim} causal={causal} deterministic={deterministic}: ran", flush=True)
    # Persistent forward blocks walking several tiles each (more tiles than
    # resident slots: 40 heads of 1000 rows), Q in two buffers and the K/V
    # rings running on across tiles; causal ones in pairs of a long and a
    # short walk (PersistentTileWalk). d64 takes three tiles by length and
    # mask: 64 x 128 (two blocks an SM) and causal 64 x 64 (three) at 1000
    # keys, 192 x 96 at 2100 (wgmma_forward_for_call).
    for head_dim, seqlen in ((64, 1000), (64, 2100), (128, 1000)):
        q, k, v = (cupy.concatenate([x] * (40 // x.shape[2]), axis=2)
                   for x in _inputs(head_dim, seqlen, seqlen, seed=head_dim))
        for causal in (False, True):
            out = cuflash.attention(q, k, v, causal=causal)
            cupy.cuda.Device().synchronize()
            if not bool(cupy.isfinite(out.astype(cupy.float32)).all()):
                failures.append(f"persistent d{head_dim} {seqlen} causal={causal}: out not finite")
        print(f"persistent head_dim {head_dim} seqlen {seqlen}: ran", flush=True)
    # Rows that end mid-sector with two K/V heads: K and V through head-pair
    # maps, the copy warp zeroing K's neighbour columns before each tile's
    # K full (one key block behind the copies), persistent and one tile a
    # block (a window), d40 (one 64-column panel) and d72 (three).
    for head_dim in (40, 72):
        q, k, v = (cupy.concatenate([x, x], axis=2) for x in _inputs(head_dim, 300, 300, seed=head_dim))
        for options in ({"causal": False}, {"causal": True}, {"window_size": (100, 20)}):
            out = cuflash.attention(q, k, v, **options)
            cupy.cuda.Device().synchronize()
            if not bool(cupy.isfinite(out.astype(cupy.float32)).all()):
                failures.append(f"head pairs d{head_dim} {options}: out not finite")
        print(f"head pairs head_dim {head_dim}: ran", flush=True)
    # Variants: a window (blocks skipped at both ends, rows that see no key),
    # the soft cap and ALiBi slopes read per (batch entry, head).
    # d64 at 1100 keys: the 192-row forward tile, one a block (the causal
    # window (-1, 0): causal 64 x 64 tiles, three blocks an SM, one tile a block).
    for head_dim, seqlen_k in ((64, 330), (64, 1100), (128, 330)):
        q, k, v = _inputs(head_dim, 200, seqlen_k, seed=head_dim)
        slopes = cupy.asarray([[0.1, 0.2]], dtype=cupy.float32)
        for window in ((40, 5), (-1, 0), (0, -1)):
            options = dict(window_size=window, softcap=5.0, alibi_slopes=slopes)
            for deterministic in (False, True):
                out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
                grads = cuflash.attention_backward(cupy.ones_like(out), q, k, v, out, lse,
                                                   deterministic=deterministic, **options)
                cupy.cuda.Device().synchronize()
                for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
                    if not bool(cupy.isfinite(x.astype(cupy.float32)).all()):
                        failures.append(f"variants d{head_dim} {seqlen_k} window={window}: {name} not finite")
        print(f"variants head_dim {head_dim} seqlen_k {seqlen_k}: ran", flush=True)
    # Decoding: one query token with grouped-query packing, split-KV and the merge.
    for num_splits in (1, 5):
        q, k, v = _inputs(128, 1, 3000, seed=num_splits)
        q = cupy.concatenate([q, q], axis=2)  # 4 query heads on 1 K/V head
        out = cuflash.attention(q, k, v, causal=True, num_splits=num_splits)
        cupy.cuda.Device().synchronize()
        if not bool(cupy.isfinite(out.astype(cupy.float32)).all()):
            failures.append(f"decode num_splits={num_splits}: out not finite")
        print(f"decode num_splits={num_splits}: ran", flush=True)
    # merge_attention_states of few and many 16-bit states, 16-byte aligned
    # (wide loads) and one element off (scalar loads): the last column step
    # of each row reads up to its end.
    for num_states, offset in ((2, 0), (2, 1), (6, 0)):
        shape = (num_states, 2, 33, 3, 72)
        size = num_states * 2 * 33 * 3 * 72
        outs = cupy.random.default_rng(num_states).standard_normal(size + 1).astype(cupy.float32)
        outs = outs.astype(cupy.float16)[offset:offset + size].reshape(shape)
        lses = cupy.zeros((num_states, 2, 3, 33), dtype=cupy.float32)
        out, _ = cuflash.merge_attention_states(outs, lses)
        cupy.cuda.Device().synchronize()
        if not bool(cupy.isfinite(out.astype(cupy.float32)).all()):
            failures.append(f"merge of {num_states} states at offset {offset}: out not finite")
        print(f"merge num_states={num_states} offset={offset}: ran", flush=True)
    # Packed (variable-length) batches: tiles that run past a sequence's end
    # copy the next sequence's rows (masked), the backward adds zeros into
    # its dQ rows; an empty sequence, and rows after the last one.
    lengths_q, lengths_k = [0, 70, 1, 200], [130, 1, 17, 260]
    cu_q = cupy.asarray([0, *cupy.cumsum(cupy.asarray(lengths_q)).get()], dtype=cupy.int32)
    cu_k = cupy.asarray([0, *cupy.cumsum(cupy.asarray(lengths_k)).get()], dtype=cupy.int32)
    for head_dim in (64, 128, 256):
        q, k, v = (x[0] for x in _inputs(head_dim, sum(lengths_q) + 5, sum(lengths_k) + 5, seed=head_dim))
        for causal in (False, True):
            for deterministic in (False, True):
                out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                    causal=causal, return_lse=True)
                dout = cupy.ones_like(out)
                grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lengths_q),
                                                          max(lengths_k), causal=causal, deterministic=deterministic)
                cupy.cuda.Device().synchronize()
                rows = (sum(lengths_q), sum(lengths_q), sum(lengths_k), sum(lengths_k))
                for name, x, end in zip(("out", "dq", "dk", "dv"), (out, *grads), rows):
                    if not bool(cupy.isfinite(x[:end].astype(cupy.float32)).all()):
                        failures.append(f"varlen d{head_dim} causal={causal} deterministic={deterministic}: "
                                        f"{name} not finite")
        print(f"varlen head_dim {head_dim}: ran", flush=True)
    # KV caches: paged (pages of 1, 16, 32 and 256 rows, shuffled, out-of-range
    # page numbers among the unused slots) and contiguous, entries of 0 to
    # 1000 keys, rows appended; decoding (split-KV) and chunked prefill.
    lengths = cupy.asarray([0, 17, 1000], dtype=cupy.int32)
    for page_size in (None, 1, 16, 32, 256):
        for seqlen_q in (1, 80):
            q, _, _ = _inputs(128, seqlen_q, 1, seed=seqlen_q)
            q = cupy.concatenate([q] * 3)
            new = q[:, :seqlen_q, :1]
            if page_size is None:
                k_cache = cupy.zeros((3, 1000 + seqlen_q, 1, 128), q.dtype)
                table = None
            else:
                pages = -(-(1000 + seqlen_q) // page_size)
                k_cache = cupy.zeros((3 * pages, page_size, 1, 128), q.dtype)
                order = cupy.asarray(np.random.default_rng(page_size).permutation(3 * pages).astype(np.int32))
                table = cupy.concatenate([order.reshape(3, pages), cupy.full((3, 2), -9, cupy.int32)], axis=1)
            v_cache = cupy.zeros_like(k_cache)
            out = cuflash.attention_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=lengths,
                                                 block_table=table, causal=True)
            cupy.cuda.Device().synchronize()
            if not bool(cupy.isfinite(out.astype(cupy.float32)).all()):
                failures.append(f"kv cache page_size={page_size} seqlen_q={seqlen_q}: out not finite")
        print(f"kv cache page_size={page_size}: ran", flush=True)
    for failure in failures:
        print(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
