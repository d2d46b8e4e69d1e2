"""tools/dq_reduction_bench.py's kernels compile for sm_90a, one per
pattern, for the head dims the Hopper backward stages (CPU: nvcc only)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import needs_nvcc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


@needs_nvcc
@pytest.mark.parametrize("head_dim", [128, 256])
def test_every_pattern_compiles(tmp_path, head_dim):
    import dq_reduction_bench

    source = tmp_path / "patterns.cu"
    instances = "".join(f"template __global__ void add_tiles<{i}, {head_dim}>(float*, int, int, int);\n"
                        for i in range(len(dq_reduction_bench.PATTERNS)))
    source.write_text(dq_reduction_bench.SOURCE + instances)
    result = subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", str(source),
                             "-o", str(tmp_path / "patterns.cubin")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("Used ") == len(dq_reduction_bench.PATTERNS)
