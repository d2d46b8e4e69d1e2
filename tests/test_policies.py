"""The kernel seams end to end: the band mask and soft-cap transform of
docs/kernel-policies.md, added exactly as that page shows (its code blocks
are what runs here), through the NumPy references (CPU) and every kernel
family (GPU)."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from cuflash import _masks
from tests.helpers import assert_reference_gradients_match_finite_differences
from cuflash.reference import (
    attention_backward_reference,
    attention_backward_tiled,
    attention_reference,
    attention_tiled,
)

_DOC = Path(__file__).resolve().parent.parent / "docs" / "kernel-policies.md"
_CUDA_BLOCKS = re.findall(r"```cuda\n(.*?)```", _DOC.read_text(), re.S)
_PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", _DOC.read_text(), re.S)


@pytest.fixture
def policies():
    """The page's Python block run as written (it registers its entries in
    the tables), and the entries taken out again afterwards."""
    before = (dict(_masks.MASKS), dict(_masks.SCORE_TRANSFORMS))
    exec(compile(_PYTHON_BLOCKS[0], str(_DOC), "exec"), {})
    try:
        yield _masks.MASKS["test-band"], _masks.SCORE_TRANSFORMS["test-softcap"]
    finally:
        for table, saved in zip((_masks.MASKS, _masks.SCORE_TRANSFORMS), before):
            table.clear()
            table.update(saved)


def test_the_page_adds_one_mask_one_transform_and_two_headers():
    assert len(_CUDA_BLOCKS) == 2 and len(_PYTHON_BLOCKS) == 1
    assert "struct TestBandMask" in _CUDA_BLOCKS[0] and "struct TestSoftcapScore" in _CUDA_BLOCKS[1]


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 300), (300, 17), (300, 517), (517, 300), (128, 128)])
@pytest.mark.parametrize("block_m,block_n", [(64, 64), (128, 64), (32, 128)])
def test_band_block_ranges_cover_exactly_the_visible_blocks(policies, seqlen_q, seqlen_k, block_m, block_n):
    mask, _ = policies
    visible = mask.matrix(seqlen_q, seqlen_k)
    for m_start in range(0, seqlen_q, block_m):
        cols = np.nonzero(visible[m_start:m_start + block_m].any(axis=0))[0]
        expected = sorted({c // block_n for c in cols})
        got = list(mask.key_blocks(m_start, block_m, block_n, seqlen_q, seqlen_k))
        assert got == list(range(expected[0], expected[-1] + 1)) if expected else got == []
    for n_start in range(0, seqlen_k, block_n):
        rows = np.nonzero(visible[:, n_start:n_start + block_n].any(axis=1))[0]
        expected = sorted({r // block_m for r in rows})
        got = list(mask.query_blocks(n_start, block_n, block_m, seqlen_q, seqlen_k))
        assert got == list(range(expected[0], expected[-1] + 1)) if expected else got == []


def _random(shape, rng):
    return rng.standard_normal(shape) * 2.0  # raw scores of order 10: the soft cap bends them


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(150, 260), (260, 150)])
def test_tiled_emulation_with_the_new_policies_matches_the_reference(policies, seqlen_q, seqlen_k):
    mask, score = policies
    rng = np.random.default_rng(3)
    q = _random((1, seqlen_q, 2, 32), rng)
    k, v = (_random((1, seqlen_k, 1, 32), rng) for _ in range(2))
    dout = _random((1, seqlen_q, 2, 32), rng)
    out, lse = attention_reference(q, k, v, mask=mask, score=score)
    tiled_out, tiled_lse, _ = attention_tiled(q, k, v, mask=mask, score=score)
    np.testing.assert_allclose(tiled_out, out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(tiled_lse), np.isneginf(lse))
    assert np.isneginf(lse).any() == (seqlen_q > seqlen_k)  # rows before the first key see nothing
    grads = attention_backward_reference(dout, q, k, v, mask=mask, score=score)
    for deterministic in (False, True):
        tiled = attention_backward_tiled(dout, q, k, v, mask=mask, score=score, deterministic=deterministic)
        for got, want in zip(tiled[:3], grads):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)


def test_reference_gradient_through_the_soft_cap_matches_finite_differences(policies):
    mask, score = policies
    rng = np.random.default_rng(5)
    q, k, v, dout = (_random((1, 7, 1, 8), rng) for _ in range(4))
    dq, dk, dv = assert_reference_gradients_match_finite_differences(dout, q, k, v, mask=mask, score=score)
    # the cap changes the answer: without it the gradient differs
    assert not np.allclose(attention_backward_reference(dout, q, k, v, mask=mask)[0], dq)


# --- GPU: every kernel family with the new policies -------------------------------------------


@pytest.fixture
def kernels_with_policies(tmp_path, policies, monkeypatch):
    """A copy of kernels_cu/ with the page's two C++ blocks appended, one per
    header, and the launcher's loader pointed at it."""
    from cuflash import api
    from cuflash._loader import KernelLoader, kernel_source_dir

    source = tmp_path / "kernels_cu"
    shutil.copytree(kernel_source_dir(), source)
    for header, block in zip(("masks.cuh", "score_transforms.cuh"), _CUDA_BLOCKS):
        path = source / header
        path.write_text(path.read_text() + "\n" + block)
    monkeypatch.setattr(api, "loader", KernelLoader(source))
    return policies


def _run(q, k, v, dout, *, mask, score, deterministic, forward_tiling=None):
    """Forward and backward through the launch plans with the test policies;
    outputs poisoned with NaN first. Returns (out, lse, dq, dk, dv)."""
    import cupy

    from cuflash import api
    from cuflash._validation import check_backward, check_forward, meta_of

    metas = {name: meta_of(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    problem = check_forward(metas["q"], metas["k"], metas["v"], None, causal=False, softmax_scale=None)
    problem = dataclasses.replace(problem, mask_name=mask.name, score_name=score.name)
    out = cupy.full_like(q, cupy.nan)
    lse = cupy.full((problem.batch, problem.nheads, problem.seqlen_q), cupy.nan, dtype=cupy.float32)
    layouts = {name: api.Layout.of(x) for name, x in (("q", q), ("k", k), ("v", v), ("out", out))}
    stream = cupy.cuda.get_current_stream().ptr
    plan = api.forward_plan(problem, layouts, aligned=True, tiling=forward_tiling)
    work = [cupy.empty(shape, dtype=dtype) for shape, dtype in plan.work_buffers.values()]  # split-KV's
    plan.launch([q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, *(w.data.ptr for w in work)],
                stream)

    grads = [cupy.full_like(x, cupy.nan) for x in (q, k, v)]
    metas = {name: meta_of(name, x) for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                                                      ("lse", lse))}
    backward = check_backward(metas["dout"], metas["q"], metas["k"], metas["v"], metas["out"], metas["lse"],
                              None, None, None, causal=False, softmax_scale=None, deterministic=deterministic)
    backward = dataclasses.replace(backward, mask_name=mask.name, score_name=score.name)
    layouts = {name: api.Layout.of(x) for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                                                        ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2]))}
    tiling = api.backward_tiling_for(backward, layouts, layouts, deterministic, aligned=True)
    work = {name: cupy.empty(shape, dtype=dtype)
            for name, (shape, dtype) in api.backward_work_buffers(backward.batch, backward.nheads, backward.seqlen_q,
                                                                  backward.head_dim, tiling, deterministic).items()}
    plan = api.backward_plan(backward, layouts, api.Layout.of(lse), deterministic, aligned=True, tiling=tiling)
    arrays = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2], **work)
    plan.launch([arrays[name].data.ptr if name in arrays else 0 for name in api.BACKWARD_ARRAYS], stream)
    cupy.cuda.get_current_stream().synchronize()
    return out, lse, *grads


def _relative_error(got, want) -> float:
    from tests.helpers import to_numpy64

    got = to_numpy64(got)
    assert np.isfinite(got).all(), "NaN or inf in the kernel's result"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 517), (517, 300), (1, 1000)])
@pytest.mark.parametrize("dtype,head_dim,deterministic,force_mma", [
    ("bfloat16", 64, False, False),  # Hopper: wgmma forward and backward
    ("float16", 128, False, False),  # Hopper: wgmma forward and backward, other tiles
    ("bfloat16", 64, True, True),  # mma.sync forward; Hopper dK/dV with dQ added in a fixed order
    ("float16", 96, True, False),  # mma.sync forward; SIMT dK/dV and the deterministic dQ pass
    ("bfloat16", 96, False, False),  # mma.sync forward, SIMT backward with atomic dQ
    ("float32", 48, False, False),  # SIMT forward and backward, padded head dim
])
def test_every_kernel_family_runs_the_new_policies(kernels_with_policies, seqlen_q, seqlen_k, dtype, head_dim,
                                                   deterministic, force_mma):
    import cupy

    from cuflash._tiling import mma_forward_tiling
    from tests.helpers import random_qkv, to_numpy64

    mask, score = kernels_with_policies
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, head_dim, cupy.dtype(dtype), seed=1)
    q, k = q * 2, k * 2  # raw scores of order 10, where the soft cap bends them
    dout = random_qkv(cupy, 2, seqlen_q, seqlen_q, 4, 4, head_dim, cupy.dtype(dtype), seed=2)[0]
    tiling = mma_forward_tiling(dtype, head_dim) if force_mma else None
    out, lse, dq, dk, dv = _run(q, k, v, dout, mask=mask, score=score, deterministic=deterministic,
                                forward_tiling=tiling)
    args = [to_numpy64(x) for x in (q, k, v)]
    want_out, want_lse = attention_reference(*args, mask=mask, score=score)
    want = attention_backward_reference(to_numpy64(dout), *args, mask=mask, score=score)
    bound = 1e-5 if dtype == "float32" else 2e-2
    assert _relative_error(out, want_out) < bound
    lse = cupy.asnumpy(lse).astype(np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=1e-4, atol=1e-4)
    for got, reference in zip((dq, dk, dv), want):
        assert _relative_error(got, reference) < bound * 2
    # the policies matter: without the band the output differs
    assert _relative_error(out, attention_reference(*args, score=score)[0]) > 10 * bound
