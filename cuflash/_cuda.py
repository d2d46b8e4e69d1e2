"""The CUDA stack under cuflash: which CuPy build is installed, the driver it
needs, and one clear error, ``CudaSetupError``, where the machine does not
fit it (no CuPy, a driver older than the build's CUDA, no driver, no GPU, no
NVRTC).

CuPy comes as one build per CUDA major version (``cupy-cuda12x``,
``cupy-cuda13x``). The extras ``cuflash[cuda12]`` and ``cuflash[cuda13]``
install one of them with the CUDA libraries it loads from pip (CuPy's own
``ctk`` extra: NVRTC and the CUDA headers the kernels compile with, among
others); cuflash itself depends on neither, so that an environment keeps the
build it has.
"""

from __future__ import annotations

import importlib.metadata
import os

#: The cuflash extra that installs the CuPy build of each CUDA major version,
#: and what it installs (pyproject.toml; tests/test_packaging.py keeps the
#: two in step). The messages give the requirement itself: it works however
#: cuflash was installed.
EXTRAS = {12: "cuda12", 13: "cuda13"}
CUPY_REQUIREMENTS = {12: "cupy-cuda12x[ctk]>=14,<15", 13: "cupy-cuda13x[ctk]>=14,<15"}
#: The oldest Linux driver for each CUDA major version. A CuPy build for
#: CUDA 12.x (13.x) runs on any driver for 12.0 (13.0) or newer.
MIN_LINUX_DRIVER = {12: "525.60.13", 13: "580.65.06"}

#: CUDA runtime statuses that mean this machine cannot run the installed
#: CuPy build: cudaErrorInsufficientDriver (also CuPy's answer where no
#: driver is loaded at all) and cudaErrorNoDevice.
_INSUFFICIENT_DRIVER = 35
_NO_DEVICE = 100


class CudaSetupError(RuntimeError):
    """The CUDA installation cannot run cuflash's kernels: no CuPy, a driver
    older than the installed CuPy build needs, no driver, no GPU, or no NVRTC
    to compile them. The message names what is installed, what is needed and
    the fix."""


def _install_command(major: int) -> str:
    return f'pip install "{CUPY_REQUIREMENTS[major]}" (what cuflash\'s extra {EXTRAS[major]} installs)'


def cupy_builds() -> list[str]:
    """The installed CuPy distributions with their versions, e.g.
    ``["cupy-cuda13x 14.2.0"]`` (more than one is a broken environment)."""
    builds = set()
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"] or ""
        if name.lower() == "cupy" or name.lower().startswith("cupy-"):
            builds.add(f"{name} {distribution.version}")
    return sorted(builds)


def import_cupy():
    """The ``cupy`` module; ``CudaSetupError`` naming the extras where none is installed."""
    try:
        import cupy
    except ModuleNotFoundError as error:
        if error.name != "cupy":
            raise
        choices = "; ".join(f"for a driver for CUDA {major} (Linux {MIN_LINUX_DRIVER[major]} or newer), "
                            f"{_install_command(major)}" for major in sorted(EXTRAS, reverse=True))
        raise CudaSetupError(
            "cuflash runs its kernels through CuPy, and no CuPy is installed. Install the build for the CUDA "
            f"version of the driver (nvidia-smi shows it, top right): {choices}."
        ) from error
    return cupy


def _cuda_version(version: int) -> str:
    """'13.2' for CUDA's integer version 13020."""
    return f"{version // 1000}.{version % 1000 // 10}"


def diagnosis(status: int) -> str:
    """Why this machine cannot run the installed CuPy build, and the fix,
    for a CUDA runtime ``status`` of cudaErrorInsufficientDriver (35) or
    cudaErrorNoDevice (100)."""
    from cupy.cuda import runtime

    runtime_version, driver_version = runtime.runtimeGetVersion(), runtime.driverGetVersion()
    if status == _NO_DEVICE:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"The NVIDIA driver (CUDA {_cuda_version(driver_version)}) reports no GPU: check nvidia-smi"
                + ("." if visible is None else f" and CUDA_VISIBLE_DEVICES (set to {visible!r})."))
    builds = cupy_builds()
    needed = runtime_version // 1000
    oldest_driver = f" (Linux {MIN_LINUX_DRIVER[needed]} or newer)" if needed in MIN_LINUX_DRIVER else ""
    needs = (f"the installed CuPy build ({' and '.join(builds) or 'CuPy'}, for CUDA {_cuda_version(runtime_version)}) "
             f"needs an NVIDIA driver for CUDA {needed}{oldest_driver}")
    if driver_version == 0:
        return f"No NVIDIA driver was found; {needs}. Install one; nvidia-smi then shows it."
    found = f"{needs[0].upper()}{needs[1:]}; this machine's driver supports CUDA {_cuda_version(driver_version)}"
    have, oldest = driver_version // 1000, min(EXTRAS)
    if have in EXTRAS and have < needed:
        names = " ".join(build.split()[0] for build in builds) or "cupy"
        return (f"{found}. Install the CuPy build for CUDA {have} in its place: pip uninstall {names} && "
                f"{_install_command(have)}; or update the driver.")
    if have < oldest:
        return (f"{found}, older than any cuflash runs on: update the driver to one for CUDA {oldest} "
                f"(Linux {MIN_LINUX_DRIVER[oldest]}) or newer.")
    return f"{found}: update the driver."


def nvrtc_missing(error: Exception) -> str:
    """Why no kernel can compile where CuPy finds no NVRTC (``error``,
    cuda.pathfinder's), naming the installed CuPy build and the fix."""
    from cupy.cuda import runtime

    runtime_version = runtime.runtimeGetVersion()
    major = runtime_version // 1000
    builds = " and ".join(cupy_builds()) or "CuPy"
    fix = (_install_command(major) if major in CUPY_REQUIREMENTS
           else "install the CuPy build's ctk extra")
    return (f"cuflash compiles its kernels with NVRTC, which the installed CuPy build ({builds}, for CUDA "
            f"{_cuda_version(runtime_version)}) cannot find ({str(error).strip()}). Install it with CuPy's CUDA "
            f"libraries: {fix}; or install a CUDA toolkit {major}.x.")


class gpu_access:
    """``with gpu_access():`` around cuflash's first use of the GPU through
    CuPy. CuPy's errors for a machine that cannot run its build (statuses
    cudaErrorInsufficientDriver and cudaErrorNoDevice) leave as a
    ``CudaSetupError`` with ``diagnosis``'s message; every other error
    passes unchanged."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None or getattr(error, "status", None) not in (_INSUFFICIENT_DRIVER, _NO_DEVICE):
            return False
        from cupy.cuda.runtime import CUDARuntimeError

        if isinstance(error, CUDARuntimeError):
            raise CudaSetupError(diagnosis(error.status)) from error
        return False
