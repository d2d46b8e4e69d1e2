"""The tile table, and its agreement with the C++ side (KernelTraits and the
parameter struct), checked by compiling a host program with nvcc: no GPU."""

import shutil
import subprocess

import numpy as np
import pytest

from cuflash._kernels import CXX_ELEMENT_TYPE
from cuflash._loader import kernel_source_dir
from cuflash._params import FORWARD_PARAMS
from cuflash._tiling import ELEMENT_SIZE, HEAD_DIM_BUCKETS, MAX_SMEM_BYTES, forward_tiling, pad_head_dim

VARIANTS = [(dtype, padded) for dtype in ELEMENT_SIZE for padded in HEAD_DIM_BUCKETS]


@pytest.mark.parametrize("head_dim", range(1, 257))
def test_pad_head_dim_is_smallest_bucket(head_dim):
    padded = pad_head_dim(head_dim)
    assert padded >= head_dim and padded in HEAD_DIM_BUCKETS
    assert all(bucket < head_dim for bucket in HEAD_DIM_BUCKETS if bucket < padded)


@pytest.mark.parametrize("head_dim", [0, 257, 1024])
def test_pad_head_dim_rejects_out_of_range(head_dim):
    if head_dim == 0:
        assert pad_head_dim(0) == 32  # validation rejects 0 before tiling is asked
    else:
        with pytest.raises(ValueError, match="head_dim must be at most 256"):
            pad_head_dim(head_dim)


@pytest.mark.parametrize("dtype,padded", VARIANTS)
def test_table_respects_kernel_constraints(dtype, padded):
    tiling = forward_tiling(dtype, padded)
    lanes_per_row = tiling.threads // tiling.block_m
    assert tiling.threads % tiling.block_m == 0
    assert lanes_per_row & (lanes_per_row - 1) == 0 and lanes_per_row <= 32
    assert tiling.block_n % lanes_per_row == 0
    assert padded // lanes_per_row <= 32  # output accumulator per lane stays small
    assert tiling.smem_bytes(dtype) <= MAX_SMEM_BYTES


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype must be one of"):
        forward_tiling("float64", 64)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def _run_host_program(tmp_path, body: str) -> list[str]:
    source = tmp_path / "probe.cu"
    source.write_text(
        "#include <cstdio>\n#include <cstddef>\n"
        '#include "kernel_traits.cuh"\n#include "params.cuh"\n'
        f"int main() {{\n{body}\nreturn 0;\n}}\n"
    )
    binary = tmp_path / "probe"
    subprocess.run(
        ["nvcc", "-std=c++17", f"-I{kernel_source_dir()}", str(source), "-o", str(binary)],
        check=True, capture_output=True, text=True,
    )
    return subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()


@needs_nvcc
def test_python_and_cxx_agree_on_shared_memory(tmp_path):
    lines = []
    for dtype, padded in VARIANTS:
        t = forward_tiling(dtype, padded)
        traits = f"cuflash::KernelTraits<{CXX_ELEMENT_TYPE[dtype]}, {padded}, {t.block_m}, {t.block_n}, {t.warps}>"
        lines.append(f'printf("%d\\n", {traits}::kSmemBytes);')
    printed = [int(x) for x in _run_host_program(tmp_path, "\n".join(lines))]
    expected = [forward_tiling(dtype, padded).smem_bytes(dtype) for dtype, padded in VARIANTS]
    assert printed == expected


@needs_nvcc
def test_python_and_cxx_agree_on_forward_params_layout(tmp_path):
    body = ['printf("%zu\\n", sizeof(cuflash::ForwardParams));']
    body += [f'printf("%zu\\n", offsetof(cuflash::ForwardParams, {name}));' for name in FORWARD_PARAMS.names]
    printed = [int(x) for x in _run_host_program(tmp_path, "\n".join(body))]
    assert printed[0] == FORWARD_PARAMS.itemsize
    assert printed[1:] == [FORWARD_PARAMS.fields[name][1] for name in FORWARD_PARAMS.names]


def test_forward_params_pack_requires_every_field():
    from cuflash._params import pack

    fields = {name: 0 for name in FORWARD_PARAMS.names}
    struct = pack(FORWARD_PARAMS, **fields)
    assert struct.shape == (1,) and struct.dtype == FORWARD_PARAMS
    del fields["q"]
    with pytest.raises(KeyError, match="missing \\['q'\\]"):
        pack(FORWARD_PARAMS, **fields)
    with pytest.raises(KeyError, match="unknown \\['bogus'\\]"):
        pack(FORWARD_PARAMS, bogus=1, q=0, **fields)
    assert np.dtype(FORWARD_PARAMS).isalignedstruct
