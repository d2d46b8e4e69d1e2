"""Bad input gets a TypeError or ValueError naming the argument, what was
expected and what came, before anything is allocated or launched.

The rules run on TensorMeta here (CPU); tests/test_forward_gpu.py sends the
same cases through the public API with real GPU arrays."""

import numpy as np
import pytest

import cuflash
from cuflash._validation import TensorMeta, check_backward, check_forward

from tests.validation_cases import BAD_BACKWARD_CASES, BAD_FORWARD_CASES, GOOD_BACKWARD_SHAPES, GOOD_SHAPES, contiguous_strides


def meta(name, shape, dtype="float16", strides=None, device=0):
    return TensorMeta(name, tuple(shape), tuple(strides) if strides else contiguous_strides(shape), dtype, device)


@pytest.mark.parametrize("case", BAD_FORWARD_CASES, ids=lambda c: c.id)
def test_bad_forward_input_is_rejected(case):
    metas = {name: meta(name, **spec) for name, spec in case.arrays().items()}
    with pytest.raises(case.error, match=case.match):
        check_forward(metas["q"], metas["k"], metas["v"], metas.get("out"), lse=metas.get("lse"), **case.options)


@pytest.mark.parametrize("case", BAD_BACKWARD_CASES, ids=lambda c: c.id)
def test_bad_backward_input_is_rejected(case):
    metas = {name: meta(name, **spec) for name, spec in case.arrays().items()}
    with pytest.raises(case.error, match=case.match):
        check_backward(metas["dout"], metas["q"], metas["k"], metas["v"], metas["out"], metas["lse"],
                       metas.get("dq"), metas.get("dk"), metas.get("dv"), **case.options)


def test_good_backward_input_passes():
    metas = {name: meta(name, shape, dtype="float32" if name == "lse" else "float16")
             for name, shape in GOOD_BACKWARD_SHAPES.items()}
    grads = {name: meta(name, metas[like].shape) for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v"))}
    problem = check_backward(metas["dout"], metas["q"], metas["k"], metas["v"], metas["out"], metas["lse"],
                             grads["dq"], grads["dk"], grads["dv"], causal=True, softmax_scale=0.5,
                             deterministic=True)
    assert problem.softmax_scale == 0.5 and problem.nheads_k == 2


def test_good_input_passes_and_reports_sizes():
    q, k, v = (meta(name, shape) for name, shape in GOOD_SHAPES.items())
    problem = check_forward(q, k, v, None, causal=True, softmax_scale=None)
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k) == (2, 17, 33)
    assert (problem.nheads, problem.nheads_k, problem.head_dim) == (4, 2, 40)
    assert problem.softmax_scale == pytest.approx(40 ** -0.5)
    assert problem.causal is True and not problem.is_empty


def test_empty_problems_are_valid():
    q = meta("q", (2, 0, 4, 40))
    k = meta("k", (2, 5, 2, 40))
    assert check_forward(q, k, meta("v", (2, 5, 2, 40)), None, causal=False, softmax_scale=1.0).is_empty
    q = meta("q", (2, 3, 4, 40))
    k = meta("k", (2, 0, 2, 40))
    assert not check_forward(q, k, meta("v", (2, 0, 2, 40)), None, causal=False, softmax_scale=1.0).is_empty


def test_numpy_arrays_are_rejected_before_anything_runs():
    x = np.zeros((1, 4, 1, 8), dtype=np.float16)
    with pytest.raises(TypeError, match="q must be a CUDA GPU array .* got a NumPy array in host memory"):
        cuflash.attention(x, x, x)


def test_non_arrays_are_rejected():
    with pytest.raises(TypeError, match="q must be a CUDA GPU array .* got builtins.list"):
        cuflash.attention([[1.0]], [[1.0]], [[1.0]])


def test_cpu_torch_tensors_are_rejected():
    torch = pytest.importorskip("torch")
    x = torch.zeros((1, 4, 1, 8), dtype=torch.float16)
    with pytest.raises(TypeError, match="q must be a CUDA GPU array .* torch.Tensor on device 'cpu'"):
        cuflash.attention(x, x, x)


def test_cpu_dlpack_producers_are_rejected():
    class HostProducer:
        def __dlpack__(self, stream=None):
            raise AssertionError("must not be called")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(TypeError, match="q must be a CUDA GPU array .*HostProducer in host memory"):
        cuflash.attention(HostProducer(), HostProducer(), HostProducer())


def test_empty_arrays_with_zero_strides_are_valid():
    # CuPy gives empty arrays all-zero strides; they hold no memory to lay out.
    q = meta("q", (2, 3, 4, 40))
    k = meta("k", (2, 0, 2, 40), strides=(0, 0, 0, 0))
    problem = check_forward(q, k, meta("v", (2, 0, 2, 40), strides=(0, 0, 0, 0)), None,
                            causal=False, softmax_scale=None)
    assert problem.seqlen_k == 0
