"""Compiles kernels from ``kernels_cu/`` with NVRTC through ``cupy.RawModule``.

One module per (kernel variant, device), built on first use and kept for the
life of the process; building is thread-safe and happens once per key.

CuPy's on-disk kernel cache hashes the source string it is given but not the
headers that string ``#include``s, so a changed header would silently load a
stale binary. The compile options therefore carry a hash of every file under
``kernels_cu/`` (``-DCUFLASH_SOURCE_HASH=...``), which is part of CuPy's key.
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import lru_cache
from pathlib import Path

from ._cuda import CudaSetupError, nvrtc_missing
from ._kernel_families import KernelVariant

_SOURCE_SUFFIXES = (".cu", ".cuh")
#: CUDA's default limit of dynamic shared memory; more needs an opt-in per kernel.
_DEFAULT_SMEM_LIMIT = 48 * 1024
#: Blocks a thread-block cluster may have on any GPU; more (up to 16 on an
#: H100) needs the kernel's CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
#: (cuda.h: 14) set.
_PORTABLE_CLUSTER_BLOCKS = 8
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
#: First NVRTC whose ``-arch=sm_90a`` wins over the ``-arch=sm_90`` CuPy appends.
_SM90A_NVRTC = (12, 9)


def kernel_source_dir() -> Path:
    """Folder holding the CUDA sources: inside the installed package
    (``cuflash/kernels_cu``, where the wheel puts them), or ``kernels_cu/``
    beside the package in a source checkout. Developers can point
    ``CUFLASH_KERNEL_SOURCE_DIR`` at another copy to compare kernel edits in
    one benchmark run (the source hash keeps their caches apart)."""
    override = os.environ.get("CUFLASH_KERNEL_SOURCE_DIR")
    if override:
        path = Path(override).resolve()
        if not (path / "flash_fwd.cu").is_file():
            raise FileNotFoundError(f"CUFLASH_KERNEL_SOURCE_DIR={override} holds no flash_fwd.cu")
        return path
    package = Path(__file__).resolve().parent
    for candidate in (package / "kernels_cu", package.parent / "kernels_cu"):
        if (candidate / "flash_fwd.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"cuflash's CUDA sources were not found in {package / 'kernels_cu'} "
        f"or {package.parent / 'kernels_cu'}; the installation is incomplete"
    )


def source_hash(source_dir: Path) -> str:
    """SHA-1 over the names and contents of every CUDA source file in ``source_dir``."""
    digest = hashlib.sha1()
    for path in sorted(p for p in source_dir.iterdir() if p.suffix in _SOURCE_SUFFIXES):
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def compile_options(source_dir: Path, compute_capability: str, nvrtc_version: tuple[int, int]) -> tuple[str, ...]:
    """NVRTC options for one device. CuPy appends its own ``-arch=sm_XX``;
    on Hopper we ask for ``sm_90a`` (Hopper-only instructions), which wins
    over CuPy's flag from NVRTC 12.9 on."""
    options = [
        "-std=c++17",
        f"-I{source_dir}",
        f"-DCUFLASH_SOURCE_HASH={source_hash(source_dir)}",
    ]
    if compute_capability == "90" and nvrtc_version >= _SM90A_NVRTC:
        options.append("-arch=sm_90a")
    return tuple(options)


def builds_sm90a() -> bool:
    """Whether this process's NVRTC builds Hopper's own instructions (wgmma)
    on a compute capability 9.0 device: NVRTC 12.9 or newer."""
    return _nvrtc_version() >= _SM90A_NVRTC


class KernelLoader:
    """Memoised, thread-safe compilation of kernel variants, per device."""

    def __init__(self, source_dir: Path | None = None):
        self._source_dir = source_dir
        self._functions: dict[tuple[str, int], object] = {}
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    @property
    def source_dir(self) -> Path:
        if self._source_dir is None:
            self._source_dir = kernel_source_dir()
        return self._source_dir

    def get(self, variant: KernelVariant, device_id: int):
        """The compiled ``cupy.RawKernel`` of ``variant`` on ``device_id``."""
        key = (variant.key, device_id)
        function = self._functions.get(key)
        if function is not None:
            return function
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            function = self._functions.get(key)
            if function is None:
                function = self._build(variant, device_id)
                self._functions[key] = function
        return function

    def compiled_keys(self, device_id: int) -> list[str]:
        """Keys of the variants compiled (or loaded from the disk cache) for ``device_id`` so far."""
        return [key for key, device in list(self._functions) if device == device_id]

    def _build(self, variant: KernelVariant, device_id: int):
        import cupy

        with cupy.cuda.Device(device_id) as device:
            options = compile_options(
                self.source_dir, device.compute_capability, _nvrtc_version()
            )
            module = cupy.RawModule(
                code=f'#include "{variant.source}"\n{variant.prelude}',
                options=options,
                name_expressions=[variant.name_expression],
            )
            function = module.get_function(variant.name_expression)
            if variant.smem_bytes > _DEFAULT_SMEM_LIMIT:
                function.max_dynamic_shared_size_bytes = variant.smem_bytes
            if variant.cluster_blocks > _PORTABLE_CLUSTER_BLOCKS:
                from cupy_backends.cuda.api import driver

                driver.funcSetAttribute(function.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        return function


@lru_cache(maxsize=1)
def _nvrtc_version() -> tuple[int, int]:
    """NVRTC's version: the first use of NVRTC, before any kernel compiles.
    ``CudaSetupError`` where CuPy finds none (cuda.pathfinder's
    DynamicLibNotFoundError, a RuntimeError)."""
    from cupy.cuda import nvrtc

    try:
        return tuple(nvrtc.getVersion())
    except RuntimeError as error:
        raise CudaSetupError(nvrtc_missing(error)) from error


#: The process-wide loader used by the public API.
loader = KernelLoader()
