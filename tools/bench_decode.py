"""The decode table of tools/bench.py (issue 15): one query token per
sequence against a KV cache, bf16, head_dim 128, 32 query heads, MHA and
GQA 4:1 and 8:1, batch 1-256, cached keys 1k-128k, the cache contiguous or
paged (pages of 16 and 256 rows, the block table a random permutation of
the pages, as an allocator that hands pages out as sequences grow leaves
them). cuflash runs ``attention_with_kvcache`` with per-sequence
``cache_seqlens`` (what a server passes); SDPA's flash and cuDNN backends
run ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on the same
keys in their native contiguous (batch, heads, seqlen, dim) layout (they
have no paged cache). Speed is the K/V bytes of the cache (once per K/V
head) over the GPU time, in TB/s; each cuflash row's ratio is against the
better of the two SDPA backends on the same shape. Points whose K/V exceed
``MAX_KV_BYTES`` are left out (memory: each backend's copy of the cache).

    python tools/bench.py --decode-only --out $OUT
"""

from __future__ import annotations

import math

import numpy as np

HEADS, HEAD_DIM = 32, 128
KV_HEADS = (32, 8, 4)  # MHA, GQA 4:1, GQA 8:1
BATCHES = (1, 8, 32, 128, 256)
KV_LENGTHS = (1024, 4096, 16384, 65536, 131072)
PAGE_SIZES = (None, 16, 256)
#: The largest K/V (both tensors) a point may have: 4 GiB, so that the
#: contiguous cache, the paged one and SDPA's layout fit beside each other.
MAX_KV_BYTES = 4 << 30
#: Where the issue's bandwidth bar applies: K/V above 64 MB (no L2 help).
BANDWIDTH_BAR_BYTES = 64 << 20


def kv_bytes(batch: int, kv_len: int, kv_heads: int) -> int:
    return 2 * batch * kv_len * kv_heads * HEAD_DIM * 2


def points() -> list[tuple[int, int, int]]:
    """(kv_heads, batch, kv_len) of the table."""
    return [(kv_heads, batch, kv_len) for kv_heads in KV_HEADS for batch in BATCHES for kv_len in KV_LENGTHS
            if kv_bytes(batch, kv_len, kv_heads) <= MAX_KV_BYTES]


def _paged(caches, page_size: int, rng):
    """Contiguous (batch, kv_len, kv_heads, dim) caches as pages of
    ``page_size`` rows in one shuffled order, and their block table."""
    import cupy

    batch, kv_len = caches[0].shape[:2]
    pages_each = math.ceil(kv_len / page_size)
    table = cupy.asarray(rng.permutation(batch * pages_each).astype(np.int32).reshape(batch, pages_each))
    paged = []
    for cache in caches:
        padded = cupy.zeros((batch, pages_each * page_size, *cache.shape[2:]), cache.dtype)
        padded[:, :kv_len] = cache
        pages = cupy.empty((batch * pages_each, page_size, *cache.shape[2:]), cache.dtype)
        pages[table.ravel()] = padded.reshape(batch * pages_each, page_size, *cache.shape[2:])
        paged.append(pages)
    return (*paged, table)


def decode_table(time_gpu, calls: int, repeats: int) -> list[dict]:
    """Rows of the table (``time_gpu(fn, calls=, repeats=)``: bench.py's
    GPU timer, milliseconds per call); prints each as it is measured."""
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash

    rows = []
    print("| kv heads | batch | kv len | K/V MB | cuflash contiguous | paged 16 | paged 256 | SDPA flash | "
          "SDPA cuDNN | best SDPA / cuflash contiguous, 16, 256 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for kv_heads, batch, kv_len in points():
        nbytes = kv_bytes(batch, kv_len, kv_heads)
        generator = cupy.random.default_rng(batch * kv_len + kv_heads)
        q = generator.standard_normal((batch, 1, HEADS, HEAD_DIM), dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
        k = generator.standard_normal((batch, kv_len, kv_heads, HEAD_DIM), dtype=cupy.float32).astype(q.dtype)
        v = generator.standard_normal((batch, kv_len, kv_heads, HEAD_DIM), dtype=cupy.float32).astype(q.dtype)
        lengths = cupy.full((batch,), kv_len, cupy.int32)
        tbps, checks = {}, {}
        reference = cuflash.attention(q, k, v)
        for page_size in PAGE_SIZES:
            if page_size is None:
                k_cache, v_cache, table, label = k, v, None, "contiguous"
            else:
                k_cache, v_cache, table = _paged((k, v), page_size, rng)
                label = f"paged{page_size}"

            def call(k_cache=k_cache, v_cache=v_cache, table=table):
                return cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)

            checks[label] = float(cupy.abs(call().astype(cupy.float32) - reference.astype(cupy.float32)).max())
            tbps[label] = nbytes / time_gpu(call, calls=calls, repeats=repeats) / 1e9
            del k_cache, v_cache
        qt = torch.from_dlpack(q).transpose(1, 2)
        kt = torch.from_dlpack(k).transpose(1, 2).contiguous()
        vt = torch.from_dlpack(v).transpose(1, 2).contiguous()
        for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            try:
                sdpa()
            except RuntimeError as exc:  # a backend that refuses the shape
                print(f"# {label} refused kv_heads {kv_heads} batch {batch} kv_len {kv_len}: {str(exc)[:120]}")
                continue
            tbps[label] = nbytes / time_gpu(sdpa, calls=calls, repeats=repeats) / 1e9
        del kt, vt
        best = max((tbps[name] for name in ("flash", "cudnn") if name in tbps), default=float("nan"))
        row = {"pass": "decode", "dtype": "bfloat16", "head_dim": HEAD_DIM, "causal": False, "batch": batch,
               "heads": HEADS, "kv_heads": kv_heads, "seqlen_q": 1, "seqlen_k": kv_len, "kv_bytes": nbytes,
               "kv_tbps": tbps, "max_abs_diff_vs_dense": checks,
               "over_best_sdpa": {name: tbps[name] / best for name in ("contiguous", "paged16", "paged256")}}
        rows.append(row)
        ratios = row["over_best_sdpa"]
        print(f"| {kv_heads} | {batch} | {kv_len} | {nbytes / 2**20:.0f} | {tbps['contiguous']:.2f} | "
              f"{tbps['paged16']:.2f} | {tbps['paged256']:.2f} | {tbps.get('flash', float('nan')):.2f} | "
              f"{tbps.get('cudnn', float('nan')):.2f} | {ratios['contiguous']:.2f}, {ratios['paged16']:.2f}, "
              f"{ratios['paged256']:.2f} |", flush=True)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The issue's bars over the table: >= 2.7 TB/s where K/V exceed 64 MB,
    >= 1.0x the better SDPA backend everywhere."""
    lines = []
    for label in ("contiguous", "paged16", "paged256"):
        big = [r["kv_tbps"][label] for r in rows if r["kv_bytes"] > BANDWIDTH_BAR_BYTES]
        ratios = [r["over_best_sdpa"][label] for r in rows if not math.isnan(r["over_best_sdpa"][label])]
        lines.append(f"{label}: K/V > 64 MB: min {min(big, default=float('nan')):.2f} TB/s, "
                     f"{sum(x >= 2.7 for x in big)}/{len(big)} >= 2.7; vs best SDPA: min "
                     f"{min(ratios, default=float('nan')):.2f}, {sum(x >= 1.0 for x in ratios)}/{len(ratios)} >= 1.0")
    return lines


#: (kv_heads, batch, kv_len) of the host-cost table: a short call (split-KV
#: merged in a cluster on Hopper), a middle one, a long one.
HOST_POINTS = ((8, 1, 1024), (8, 8, 4096), (8, 32, 16384))


def decode_host_table(time_gpu, time_user, host_us) -> list[dict]:
    """Decoding as a caller sees it, at ``HOST_POINTS`` (contiguous cache):
    cuflash on CuPy arrays, cuflash's PyTorch drop-in
    (``cuflash.torch.flash_attn_with_kvcache``) and SDPA's cuDNN backend;
    per call: GPU time with launches queued (``time_gpu``), time without
    holding the stream, L2 flushed (``time_user``), and host microseconds
    (``host_us``: tools/host_overhead.py), in milliseconds but host µs."""
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cuflash
    import cuflash.torch as ct

    rows = []
    for kv_heads, batch, kv_len in HOST_POINTS:
        generator = torch.Generator(device="cuda").manual_seed(batch + kv_len)
        q, k, v = (torch.randn(batch, n, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
                   for n, h in ((1, HEADS), (kv_len, kv_heads), (kv_len, kv_heads)))
        lengths = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
        cq, ck, cv, clengths = (cupy.from_dlpack(x) for x in (q, k, v, lengths))
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        candidates = {
            "cuflash (CuPy)": lambda: cuflash.attention_with_kvcache(cq, ck, cv, cache_seqlens=clengths),
            "cuflash.torch": lambda: ct.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths),
            "SDPA cuDNN": cudnn,
        }
        host = host_us(candidates)
        for name, fn in candidates.items():
            rows.append({"kv_heads": kv_heads, "batch": batch, "seqlen_k": kv_len, "call": name,
                         "gpu_ms": time_gpu(fn, calls=20, repeats=7), "user_ms": time_user(fn),
                         "host_us": host[name]})
        del q, k, v, kt, vt, cq, ck, cv
        torch.cuda.empty_cache()
    return rows


def host_markdown(rows: list[dict]) -> list[str]:
    """The host-cost table as Markdown lines."""
    lines = ["| K/V heads | batch | keys | call | GPU us, launches queued | us per call, L2 flushed | host us |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        user = "n/a" if r["user_ms"] is None else f"{r['user_ms'] * 1e3:.1f}"
        lines.append(f"| {r['kv_heads']} | {r['batch']} | {r['seqlen_k']} | {r['call']} | {r['gpu_ms'] * 1e3:.1f} | "
                     f"{user} | {r['host_us']:.1f} |")
    return lines
