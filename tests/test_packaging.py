"""Packaging (CPU, no GPU): the metadata in pyproject.toml (license, the
CUDA extras, each installing one CuPy build and none forced by the base
dependencies), and a wheel built from the checkout, which builds without
deprecation warnings, carries the license and, installed into a fresh
virtual environment, finds and ships every CUDA source file."""

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cuflash import _cuda

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def project() -> dict:
    """The ``[project]`` table of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _cupy_requirements(requirements: list[str]) -> list[Requirement]:
    return [r for r in map(Requirement, requirements) if r.name.lower().startswith("cupy")]


def test_base_dependencies_force_no_cupy_build(project):
    # An environment that has cupy-cuda12x must not be given cupy-cuda13x too.
    assert _cupy_requirements(project["dependencies"]) == []


@pytest.mark.parametrize("major", sorted(_cuda.EXTRAS))
def test_each_cuda_extra_installs_its_cupy_build_with_its_libraries(project, major):
    # exactly what cuflash.CudaSetupError tells users to install
    assert project["optional-dependencies"][_cuda.EXTRAS[major]] == [_cuda.CUPY_REQUIREMENTS[major]]
    (cupy,) = _cupy_requirements([_cuda.CUPY_REQUIREMENTS[major]])
    assert cupy.name == f"cupy-cuda{major}x"
    assert cupy.extras == {"ctk"}  # NVRTC and the CUDA headers, from pip
    assert cupy.specifier.contains("14.2.0") and not cupy.specifier.contains("15.0.0")


def test_only_the_cuda_extras_install_cupy(project):
    extras = project["optional-dependencies"]
    assert {name for name, requirements in extras.items() if _cupy_requirements(requirements)} == \
        set(_cuda.EXTRAS.values())


def test_test_extra_needs_no_plotting_and_builds_the_metadata(project):
    test = {r.name: r for r in map(Requirement, project["optional-dependencies"]["test"])}
    assert "matplotlib" not in test  # tests that plot skip without it (the plot extra has it)
    assert test["setuptools"].specifier.contains("77")  # builds the SPDX license (the packaging test)


def test_every_subpackage_is_packaged():
    """pyproject.toml lists its packages: a new folder of cuflash/ left out
    would be missing from the wheel (and only the checkout would have it)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(path.parent.relative_to(REPO).parts) for path in (REPO / "cuflash").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_license_is_an_spdx_expression_with_its_file(project):
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.slow
def test_wheel_ships_kernel_sources_into_a_fresh_venv(tmp_path):
    # Nothing from the checkout may leak in: with PYTHONPATH pointing at it,
    # pip would take the checkout's egg-info for an installed cuflash.
    clean_env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    wheel_dir = tmp_path / "wheels"
    # -v shows the build backend's output, where setuptools warns about metadata.
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(wheel_dir), str(REPO)],
        check=True, capture_output=True, text=True, env=clean_env,
    )
    assert "DeprecationWarning" not in build.stdout + build.stderr
    (wheel,) = wheel_dir.glob("cuflash-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (info,) = {name.split("/")[0] for name in archive.namelist() if name.endswith(".dist-info/METADATA")}
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        assert archive.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    unconditional = [r for r in map(Requirement, metadata.get_all("Requires-Dist")) if r.marker is None]
    assert [r.name for r in unconditional] == ["numpy", "click", "ml_dtypes"]

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
