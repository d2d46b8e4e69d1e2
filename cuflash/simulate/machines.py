"""Machine presets of the IO simulator.

Datasheet figures (dense fp16/bf16 tensor-core peak, fp32 CUDA-core peak,
HBM bandwidth), except where a number was read off the real machine of this
project (noted). ``sram_per_sm`` is the on-chip memory an SM can give a thread
block (the paper's M, in bytes); ``l2_bytes`` feeds the DRAM estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Machine:
    name: str
    sms: int
    sram_per_sm: int  #: bytes of shared memory (SRAM) per SM
    l2_bytes: int
    hbm_bandwidth: float  #: bytes per second
    matmul_flops: float  #: dense fp16/bf16 tensor-core FLOP/s
    nonmatmul_flops: float  #: fp32 CUDA-core FLOP/s
    #: compute capability, as the launcher uses it to pick cuflash's kernels
    #: (90: the Hopper wgmma forward and its tiles)
    compute_capability: int = 80
    #: SM clock of the tensor-core peak (matmul_flops = sms x per-clock FLOPs x clock)
    clock_hz: float = 1.41e9
    #: exponentials per SM per clock (the special-function units: 16 on the A100 and H100)
    exp_per_clock: int = 16
    #: a kernel launch's fixed cost on the GPU when launches are queued back to back
    launch_seconds: float = 2e-6

    def with_sram(self, sram_per_sm: int) -> "Machine":
        return replace(self, sram_per_sm=sram_per_sm, name=f"{self.name} (SRAM {sram_per_sm} B)")


KIB = 1024
MIB = 1024 * 1024

MACHINES = {
    # A100 SXM4 40 GB, the GPU of the FlashAttention paper: 192 KB of SRAM on
    # each of 108 SMs, 40 MB L2, 1.555 TB/s, 312 TFLOP/s fp16, 19.5 TFLOP/s fp32.
    "a100": Machine("a100", sms=108, sram_per_sm=192 * KIB, l2_bytes=40 * MIB, hbm_bandwidth=1.555e12,
                    matmul_flops=312e12, nonmatmul_flops=19.5e12, clock_hz=1.41e9),
    # H100 SXM5 80 GB: 228 KB SRAM per SM (227 KB per block), 50 MB L2,
    # 3.35 TB/s (3.0 TB/s measured on this project's H100), 989 TFLOP/s
    # bf16 dense (796 measured), 67 TFLOP/s fp32.
    "h100": Machine("h100", sms=132, sram_per_sm=228 * KIB, l2_bytes=50 * MIB, hbm_bandwidth=3.35e12,
                    matmul_flops=989e12, nonmatmul_flops=67e12, compute_capability=90, clock_hz=1.83e9),
    # H200 SXM 141 GB: as H100 with 4.8 TB/s HBM3e (4.3 measured here) and
    # 60 MB L2 as PyTorch reports it on this project's H200.
    "h200": Machine("h200", sms=132, sram_per_sm=228 * KIB, l2_bytes=60 * MIB, hbm_bandwidth=4.8e12,
                    matmul_flops=989e12, nonmatmul_flops=67e12, compute_capability=90, clock_hz=1.83e9),
}
