"""Kernel variants: the compile-time choices of each kernel, written as the C++
name expression NVRTC instantiates and as a readable cache key.

Compile-time: element dtype, padded head dim, tile sizes, warps, mask mode.
Everything else (sequence lengths, strides, scale, pointers) is a run-time
value in the launch's parameter struct.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._tiling import ForwardTiling

#: C++ storage type of each supported dtype.
CXX_ELEMENT_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


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


def forward_variant(dtype_name: str, tiling: ForwardTiling, causal: bool) -> KernelVariant:
    mask = "causal" if causal else "full"
    return KernelVariant(
        source="flash_fwd.cu",
        function="cuflash::flash_forward_kernel",
        template_args=(
            CXX_ELEMENT_TYPE[dtype_name],
            str(tiling.head_dim_padded),
            str(tiling.block_m),
            str(tiling.block_n),
            str(tiling.warps),
            "true" if causal else "false",
        ),
        key=(
            f"forward/{dtype_name}/hdim{tiling.head_dim_padded}"
            f"/m{tiling.block_m}n{tiling.block_n}w{tiling.warps}/{mask}"
        ),
        threads=tiling.threads,
        smem_bytes=tiling.smem_bytes(dtype_name),
    )
