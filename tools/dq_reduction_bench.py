"""How fast can thread blocks add float32 tiles into a shared dQ accumulator?

The Hopper backward at head dims 192/256 is bound by L2 (docs/perf-notes.md,
"Issue 14"), and more than half of its L2 sectors are dQ's float32 reductions.
This microbenchmark adds 64-row x head_dim float32 tiles into a dQ-shaped
buffer (batch*heads, seqlen, head_dim in the (b, s, h, d) layout the kernels
use) the way the backward's grid does: one thread block per key block, each
walking every query block of its head, so many blocks add into the same dQ
rows at nearly the same time. It compares ways of issuing the additions:

  red_v2_fragment  red.global.add.v2.f32 in the wgmma accumulator layout (what
                   flash_bwd_wgmma.cu does): a warp instruction touches 8 rows,
                   32 bytes of each
  red_v2_lines     red.v2.f32, a warp instruction covers 2 whole 128-byte lines
  red_v4_lines     red.v4.f32 (sm_90), a warp instruction covers 4 whole lines
  bulk_rows        the tile staged in shared memory, then one
                   cp.reduce.async.bulk (TMA's bulk reduction) per row
  store_v4_lines   plain 16-byte stores, whole lines (no reduction: the
                   write-bandwidth reference)

and prints milliseconds and TB/s of dQ bytes for each. Needs an sm_90 GPU.

    PYTHONPATH=. python tools/dq_reduction_bench.py [--head-dim 256] [--seqlen 4096] [--heads 32]
"""
from __future__ import annotations

import argparse

PATTERNS = ("red_v2_fragment", "red_v2_lines", "red_v4_lines", "bulk_rows", "store_v4_lines")

SOURCE = r"""
template <int kPattern, int kHeadDim>
__device__ void add_tile(float* tile, long long row_stride, float value, float* staging) {
    const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
    constexpr int kRows = 64;
    if constexpr (kPattern == 0) {
        // wgmma accumulator layout: warp w owns rows 16 (w % 4) ..+15 and half of the columns
        const int col_base = (warp / 4) * (kHeadDim / 2);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = (warp % 4) * 16 + lane / 4 + half * 8;
#pragma unroll 8
            for (int j = 0; j < kHeadDim / 16; ++j) {
                float* address = tile + row * row_stride + col_base + 8 * j + 2 * (lane % 4);
                asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(address), "f"(value),
                             "f"(value) : "memory");
            }
        }
    } else if constexpr (kPattern == 1) {
        constexpr int kPairsPerRow = kHeadDim / 2;
#pragma unroll 8
        for (int f = thread; f < kRows * kPairsPerRow; f += 256) {
            float* address = tile + (f / kPairsPerRow) * row_stride + 2 * (f % kPairsPerRow);
            asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(address), "f"(value),
                         "f"(value) : "memory");
        }
    } else if constexpr (kPattern == 2 || kPattern == 4) {
        constexpr int kQuadsPerRow = kHeadDim / 4;
#pragma unroll 8
        for (int f = thread; f < kRows * kQuadsPerRow; f += 256) {
            float* address = tile + (f / kQuadsPerRow) * row_stride + 4 * (f % kQuadsPerRow);
            if constexpr (kPattern == 2) {
                asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(address),
                             "f"(value), "f"(value), "f"(value), "f"(value) : "memory");
            } else {
                *reinterpret_cast<float4*>(address) = make_float4(value, value, value, value);
            }
        }
    } else {
        // Stage the tile (as the accumulator layout would write it), then one bulk reduction per row.
        __syncthreads();  // the previous tile's bulk reductions have read staging (waited below)
        for (int f = thread; f < kRows * kHeadDim / 4; f += 256) {
            reinterpret_cast<float4*>(staging)[f] = make_float4(value, value, value, value);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (thread < kRows) {
            const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(staging + thread * kHeadDim));
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                         ::"l"(tile + thread * row_stride), "r"(src), "r"(kHeadDim * 4) : "memory");
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        }
    }
}

template <int kPattern, int kHeadDim>
__global__ void __launch_bounds__(256, 1) add_tiles(float* dq, int heads, int seqlen, int steps) {
    extern __shared__ float4 staging_storage[];
    // blockIdx.x: key block (fastest, so the resident blocks share heads, as the backward's grid does)
    const int key_block = blockIdx.x % (seqlen / 64);
    const int head = blockIdx.x / (seqlen / 64);
    const int m_blocks = seqlen / 64;
    const long long row_stride = static_cast<long long>(heads) * kHeadDim;
    for (int step = 0; step < steps; ++step) {
        const int m_block = (step + key_block) % m_blocks;
        float* tile = dq + static_cast<long long>(m_block) * 64 * row_stride + head * kHeadDim;
        add_tile<kPattern, kHeadDim>(tile, row_stride, 1.0f, reinterpret_cast<float*>(staging_storage));
    }
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32, help="batch x heads")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import cupy as cp  # here: the CUDA source above is importable (and tested) without a GPU

    d, seqlen, heads = args.head_dim, args.seqlen, args.heads
    names = [f"add_tiles<{i}, {d}>" for i in range(len(PATTERNS))]
    module = cp.RawModule(code=SOURCE, options=("-std=c++17", "-arch=sm_90a"), name_expressions=names)
    dq = cp.zeros((seqlen, heads, d), dtype=cp.float32)
    m_blocks = seqlen // 64
    grid = (m_blocks * heads,)
    steps = m_blocks
    dq_bytes = grid[0] * steps * 64 * d * 4
    print(f"head_dim {d}, seqlen {seqlen}, {heads} heads: {grid[0]} blocks x {steps} tiles, "
          f"{dq_bytes / 1e9:.2f} GB of dQ additions")
    print("| pattern | ms | TB/s | sum check |")
    print("|---|---|---|---|")
    for pattern, name in zip(PATTERNS, names):
        kernel = module.get_function(name)
        smem = 64 * d * 4 if pattern == "bulk_rows" else 0
        if smem > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = smem
        times = []
        for _ in range(args.repeats + 1):
            dq.fill(0)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            kernel(grid, (256,), (dq, cp.int32(heads), cp.int32(seqlen), cp.int32(steps)), shared_mem=smem)
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop))
        ms = sorted(times[1:])[len(times[1:]) // 2]
        expected = 1.0 if pattern == "store_v4_lines" else float(m_blocks)
        check = "ok" if bool(cp.all(dq == expected)) else f"WRONG (mean {float(dq.mean()):.3f}, want {expected})"
        print(f"| {pattern} | {ms:.3f} | {dq_bytes / ms / 1e9:.2f} | {check} |")


if __name__ == "__main__":
    main()
