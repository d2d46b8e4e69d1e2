"""Kernel variants: the compile-time choices of each kernel, written as the C++
name expression NVRTC instantiates and as a readable cache key.

Compile-time: element dtype, padded head dim, tile sizes, warps, mask mode
and, for the backward, whether dQ is accumulated with atomics. Everything else
(sequence lengths, strides, scale, pointers) is a run-time value in the
launch's parameter struct.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._tiling import Tiling

#: C++ storage type of each supported dtype.
CXX_ELEMENT_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}

#: Threads per block of the element-wise backward helpers (preprocess, dQ conversion).
ELEMENTWISE_WARPS = 8


@dataclass(frozen=True)
class KernelVariant:
    """One template instantiation of one kernel."""

    source: str  #: file under kernels_cu/ that defines the kernel
    function: str  #: qualified C++ name of the kernel template
    template_args: tuple[str, ...]
    key: str  #: readable cache key, unique per instantiation
    threads: int
    smem_bytes: int

    @property
    def name_expression(self) -> str:
        return f"{self.function}<{', '.join(self.template_args)}>"


def _cxx_bool(flag: bool) -> str:
    return "true" if flag else "false"


def _tiled_variant(kind: str, function: str, source: str, dtype_name: str, tiling: Tiling, causal: bool,
                   smem_bytes: int, extra_args: tuple[str, ...] = (), extra_key: str = "") -> KernelVariant:
    return KernelVariant(
        source=source,
        function=function,
        template_args=(
            CXX_ELEMENT_TYPE[dtype_name],
            str(tiling.head_dim_padded),
            str(tiling.block_m),
            str(tiling.block_n),
            str(tiling.warps),
            _cxx_bool(causal),
            *extra_args,
        ),
        key=(
            f"{kind}/{dtype_name}/hdim{tiling.head_dim_padded}"
            f"/m{tiling.block_m}n{tiling.block_n}w{tiling.warps}/{'causal' if causal else 'full'}{extra_key}"
        ),
        threads=tiling.threads,
        smem_bytes=smem_bytes,
    )


def forward_variant(dtype_name: str, tiling: Tiling, causal: bool) -> KernelVariant:
    if tiling.kernel == "wgmma":
        return _tiled_variant("forward-wgmma", "cuflash::flash_forward_wgmma_kernel", "flash_fwd_wgmma.cu",
                              dtype_name, tiling, causal, tiling.forward_smem_bytes(dtype_name),
                              extra_args=(str(tiling.blocks_per_sm),), extra_key=f"/b{tiling.blocks_per_sm}")
    if tiling.kernel == "mma":
        return _tiled_variant("forward-mma", "cuflash::flash_forward_mma_kernel", "flash_fwd_mma.cu", dtype_name,
                              tiling, causal, tiling.forward_smem_bytes(dtype_name),
                              extra_args=(str(tiling.kv_stages),), extra_key=f"/kv{tiling.kv_stages}")
    return _tiled_variant("forward", "cuflash::flash_forward_kernel", "flash_fwd.cu", dtype_name, tiling, causal,
                          tiling.forward_smem_bytes(dtype_name))


def backward_dkdv_variant(dtype_name: str, tiling: Tiling, causal: bool, accumulate_dq: bool) -> KernelVariant:
    if tiling.kernel == "wgmma":
        if not accumulate_dq:
            raise ValueError("the Hopper backward accumulates dQ with atomics; deterministic mode runs the SIMT one")
        return _tiled_variant("backward-dkdv-wgmma", "cuflash::flash_backward_dkdv_wgmma_kernel",
                              "flash_bwd_wgmma.cu", dtype_name, tiling, causal,
                              tiling.backward_dkdv_smem_bytes(dtype_name), extra_key="/atomic-dq")
    return _tiled_variant("backward-dkdv", "cuflash::flash_backward_dkdv_kernel", "flash_bwd.cu", dtype_name,
                          tiling, causal, tiling.backward_dkdv_smem_bytes(dtype_name),
                          extra_args=(_cxx_bool(accumulate_dq),),
                          extra_key="/atomic-dq" if accumulate_dq else "")


def backward_dq_variant(dtype_name: str, tiling: Tiling, causal: bool) -> KernelVariant:
    return _tiled_variant("backward-dq", "cuflash::flash_backward_dq_kernel", "flash_bwd.cu", dtype_name, tiling,
                          causal, tiling.backward_dq_smem_bytes(dtype_name))


def backward_elementwise_variant(kernel: str, dtype_name: str) -> KernelVariant:
    """``kernel`` is ``preprocess`` (delta = rowsum(dO * O), zeroing the dQ
    accumulator) or ``convert_dq`` (float32 accumulator to dq's dtype)."""
    return KernelVariant(
        source="flash_bwd.cu",
        function=f"cuflash::flash_backward_{kernel}_kernel",
        template_args=(CXX_ELEMENT_TYPE[dtype_name], str(ELEMENTWISE_WARPS)),
        key=f"backward-{kernel.replace('_', '-')}/{dtype_name}/w{ELEMENTWISE_WARPS}",
        threads=32 * ELEMENTWISE_WARPS,
        smem_bytes=0,
    )
