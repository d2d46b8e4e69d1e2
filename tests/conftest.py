"""GPU tests carry the ``gpu`` marker and are skipped, with a reason, where
no CUDA GPU is present (CI). ``tools/gpu_check.sh`` runs them on a GPU and
fails if any is skipped there."""

import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.is_available())
    except Exception:  # no CuPy, no driver, no device
        return False


GPU_AVAILABLE = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if GPU_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
