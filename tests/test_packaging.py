"""A wheel built from the checkout, installed into a fresh virtual
environment, finds and ships every CUDA source file (CPU, no GPU)."""

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_ships_kernel_sources_into_a_fresh_venv(tmp_path):
    # Nothing from the checkout may leak in: with PYTHONPATH pointing at it,
    # pip would take the checkout's egg-info for an installed cuflash.
    clean_env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    wheel_dir = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(REPO)],
        check=True, capture_output=True, text=True, env=clean_env,
    )
    (wheel,) = wheel_dir.glob("cuflash-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, env=clean_env)
    # cuflash's dependencies (CuPy, NumPy, click) come from the environment
    # running the tests, through a .pth file: the fresh venv holds cuflash only.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True, env=clean_env).stdout.strip()
    Path(purelib, "_deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n" + sysconfig.get_paths()["platlib"] + "\n"
    )

    probe = textwrap.dedent(
        """
        import cuflash, json
        from cuflash._loader import kernel_source_dir
        d = kernel_source_dir()
        print(json.dumps({"package": cuflash.__file__, "sources": str(d),
                          "files": sorted(p.name for p in d.iterdir())}))
        """
    )
    result = subprocess.run([str(python), "-c", probe], cwd=tmp_path, check=True,
                            capture_output=True, text=True, env=clean_env)
    import json

    found = json.loads(result.stdout)
    assert found["package"].startswith(str(venv)), "cuflash was imported from the checkout, not the wheel"
    assert found["sources"].startswith(str(venv))
    expected = sorted(p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert found["files"] == expected
