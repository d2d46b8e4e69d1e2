"""A machine that cannot run the installed CuPy build (no CuPy, a driver too
old for it, no driver, no GPU, no NVRTC) gets one cuflash.CudaSetupError
naming what is installed, what it needs and which extra to install, where
cuflash first touches the GPU or NVRTC (CPU: CuPy's errors come from stubs).
The extras themselves: tests/test_packaging.py."""

import sys

import pytest

import cuflash
from cuflash import _cuda


class CudaDevice:
    """A DLPack producer that says it lives on CUDA device 0 (never exported:
    the call fails before)."""

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be exported")

    def __dlpack_device__(self):
        return (2, 0)


@pytest.fixture
def cupy_fails(monkeypatch):
    """``fail(status, driver=...)``: from now on CuPy's first use of the GPU
    raises CUDARuntimeError(status), on a machine whose driver supports CUDA
    ``driver`` (CuPy's integer form, 0: none) under the build cupy-cuda13x
    14.2.0 for CUDA 13.2."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import runtime

    def fail(status: int, driver: int = 12080):
        def device(*args, **kwargs):
            raise runtime.CUDARuntimeError(status)

        monkeypatch.setattr(cupy.cuda, "Device", device)
        monkeypatch.setattr(runtime, "driverGetVersion", lambda: driver)
        monkeypatch.setattr(runtime, "runtimeGetVersion", lambda: 13020)
        monkeypatch.setattr(_cuda, "cupy_builds", lambda: ["cupy-cuda13x 14.2.0"])
        return runtime.CUDARuntimeError

    return fail


def _error_of(call) -> cuflash.CudaSetupError:
    with pytest.raises(cuflash.CudaSetupError) as caught:
        call()
    return caught.value


ENTRY_POINTS = {
    "attention": lambda: cuflash.attention(CudaDevice(), CudaDevice(), CudaDevice()),
    "attention_backward": lambda: cuflash.attention_backward(*(CudaDevice() for _ in range(6))),
    "warmup": lambda: cuflash.warmup(["float16"], [64], backward=False),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_driver_older_than_the_cupy_build_names_build_driver_and_extra(cupy_fails, entry):
    cupy_error = cupy_fails(35)
    error = _error_of(ENTRY_POINTS[entry])
    assert isinstance(error.__cause__, cupy_error)
    assert str(error) == (
        "The installed CuPy build (cupy-cuda13x 14.2.0, for CUDA 13.2) needs an NVIDIA driver for CUDA 13 "
        "(Linux 580.65.06 or newer); this machine's driver supports CUDA 12.8. Install the CuPy build for "
        'CUDA 12 in its place: pip uninstall cupy-cuda13x && pip install "cupy-cuda12x[ctk]>=14,<15" '
        "(what cuflash's extra cuda12 installs); or update the driver."
    )


def test_no_driver_says_so(cupy_fails):
    cupy_fails(35, driver=0)
    assert str(_error_of(ENTRY_POINTS["attention"])) == (
        "No NVIDIA driver was found; the installed CuPy build (cupy-cuda13x 14.2.0, for CUDA 13.2) needs an "
        "NVIDIA driver for CUDA 13 (Linux 580.65.06 or newer). Install one; nvidia-smi then shows it."
    )


def test_driver_older_than_any_build_asks_for_a_newer_driver(cupy_fails):
    cupy_fails(35, driver=11080)
    assert str(_error_of(ENTRY_POINTS["attention"])).endswith(
        "this machine's driver supports CUDA 11.8, older than any cuflash runs on: update the driver to one for "
        "CUDA 12 (Linux 525.60.13) or newer."
    )


def test_no_device_points_at_the_visible_devices(cupy_fails, monkeypatch):
    cupy_fails(100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert str(_error_of(ENTRY_POINTS["attention"])) == (
        "The NVIDIA driver (CUDA 12.8) reports no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES (set to '')."
    )


def test_other_cuda_errors_pass_unchanged(cupy_fails):
    cupy_error = cupy_fails(2)  # cudaErrorMemoryAllocation
    with pytest.raises(cupy_error) as caught:
        ENTRY_POINTS["attention"]()
    assert not isinstance(caught.value, cuflash.CudaSetupError)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_missing_cupy_names_the_extras(monkeypatch, entry):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now fails as if it were not installed
    error = _error_of(ENTRY_POINTS[entry])
    assert str(error).startswith("cuflash runs its kernels through CuPy, and no CuPy is installed. ")
    for major, extra in _cuda.EXTRAS.items():
        assert (f"for a driver for CUDA {major} (Linux {_cuda.MIN_LINUX_DRIVER[major]} or newer), "
                f"pip install \"{_cuda.CUPY_REQUIREMENTS[major]}\" (what cuflash's extra {extra} installs)") in str(error)


def test_setup_error_is_a_runtime_error():
    assert issubclass(cuflash.CudaSetupError, RuntimeError)
    assert "CudaSetupError" in cuflash.__all__


def test_missing_nvrtc_names_the_build_and_its_libraries(monkeypatch):
    pytest.importorskip("cupy")
    from cuda.pathfinder import DynamicLibNotFoundError
    from cupy.cuda import nvrtc, runtime

    from cuflash import _loader

    def get_version():
        raise DynamicLibNotFoundError("Failure finding libnvrtc.so.13")

    monkeypatch.setattr(nvrtc, "getVersion", get_version)
    monkeypatch.setattr(runtime, "runtimeGetVersion", lambda: 13020)
    monkeypatch.setattr(_cuda, "cupy_builds", lambda: ["cupy-cuda13x 14.2.0"])
    _loader._nvrtc_version.cache_clear()
    try:
        error = _error_of(_loader.builds_sm90a)  # the launcher's first use of NVRTC
    finally:
        _loader._nvrtc_version.cache_clear()
    assert str(error) == (
        "cuflash compiles its kernels with NVRTC, which the installed CuPy build (cupy-cuda13x 14.2.0, for CUDA "
        "13.2) cannot find (Failure finding libnvrtc.so.13). Install it with CuPy's CUDA libraries: pip install "
        "\"cupy-cuda13x[ctk]>=14,<15\" (what cuflash's extra cuda13 installs); or install a CUDA toolkit 13.x."
    )
