"""Every Python example in the README runs: the CPU ones everywhere, the
GPU ones (CuPy, PyTorch, JAX) on a GPU."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
GPU_WORDS = ("cupy", "torch", "jax")


def _needs_gpu(block: str) -> bool:
    return any(re.search(rf"\bimport\b.*\b{word}\b", block) for word in GPU_WORDS)


def _id(block: str) -> str:
    return block.strip().splitlines()[0][:40]


@pytest.mark.parametrize("block", [b for b in BLOCKS if not _needs_gpu(b)], ids=_id)
def test_cpu_readme_example_runs(block):
    exec(compile(block, str(README), "exec"), {})


@pytest.mark.gpu
@pytest.mark.parametrize("block", [b for b in BLOCKS if _needs_gpu(b)], ids=_id)
def test_gpu_readme_example_runs(block):
    exec(compile(block, str(README), "exec"), {})


def test_readme_has_examples_for_each_framework():
    text = "\n".join(BLOCKS)
    for needle in ("import cupy", "import torch", "import jax", "attention_backward", "cuflash.reference"):
        assert needle in text


def _ci_command(label: str) -> str:
    """The command of .ci/run on the line after its ``# README: <label>`` comment."""
    lines = (README.parent / ".ci" / "run").read_text().splitlines()
    return lines[lines.index(f"# README: {label}") + 1]


def test_ci_installs_and_tests_as_the_readme_says():
    bash = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
            for line in block.splitlines()]
    install = _ci_command("install")
    assert install.replace(" -q", "") in bash  # CI quiets pip, nothing more
    assert _ci_command("test") in bash
    assert ".[cuda13,test]" in install or ".[cuda12,test]" in install  # CuPy comes from a CUDA extra
