"""Variable-length (packed) batches on the GPU against the float64
reference, sequence by sequence: ``attention_varlen`` and
``attention_varlen_backward`` on every kernel family (Hopper, mma.sync,
SIMT), with empty sequences, lengths that end inside a tile, grouped-query
heads and rows after the last sequence. Outputs and gradients are poisoned
with NaN before each run; the rows after the last sequence must stay so
(nothing is written outside the sequences), and NaN anywhere else fails."""

import math

import numpy as np
import pytest

import cuflash
from cuflash import api
from cuflash.reference import attention_backward_reference, attention_reference

from tests.helpers import (
    assert_lse_close,
    assert_output_accurate,
    naive_attention_backward_same_precision,
    naive_attention_same_precision,
    pin_kernel_generation,
)
from tests.test_forward_gpu import _cupy

pytestmark = pytest.mark.gpu

#: Query and key lengths of packed batches: empty sequences, one token,
#: lengths inside and across tiles, more keys than queries and fewer.
LENGTHS = {
    "awkward": ([0, 1, 17, 1000], [5, 1, 17, 1000]),
    "tiles": ([127, 128, 129, 300], [127, 128, 129, 300]),
    "cross": ([64, 200, 3], [300, 17, 0]),
}


class PackedBatch:
    """q (total_q, h, d), k, v (total_k, h_k, d) of random sequences, with
    ``padding`` extra rows after the last sequence of each, and their
    cu_seqlens (int32, on the GPU)."""

    def __init__(self, lens_q, lens_k, nheads, nheads_k, head_dim, dtype, *, seed=0, padding=3):
        cupy = _cupy()
        rng = np.random.default_rng(seed)
        self.lens_q, self.lens_k = list(lens_q), list(lens_k)
        self.cu_q = np.concatenate([[0], np.cumsum(self.lens_q)]).astype(np.int32)
        self.cu_k = np.concatenate([[0], np.cumsum(self.lens_k)]).astype(np.int32)
        self.padding = padding

        def make(rows, heads):
            data = rng.standard_normal((rows + padding, heads, head_dim)).astype(np.float32)
            return cupy.asarray(data).astype(dtype)

        self.q = make(int(self.cu_q[-1]), nheads)
        self.k, self.v = make(int(self.cu_k[-1]), nheads_k), make(int(self.cu_k[-1]), nheads_k)
        self.cu_seqlens_q, self.cu_seqlens_k = cupy.asarray(self.cu_q), cupy.asarray(self.cu_k)
        self.max_q, self.max_k = max(self.lens_q), max(self.lens_k)

    def args(self):
        return (self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, self.max_q, self.max_k)

    def sequences(self):
        """(query rows, key rows) slices of each sequence."""
        for b in range(len(self.lens_q)):
            yield slice(self.cu_q[b], self.cu_q[b + 1]), slice(self.cu_k[b], self.cu_k[b + 1])


def _reference_forward(batch: PackedBatch, causal, scale):
    """float64 out (total_q, h, d) and lse (h, total_q) sequence by sequence."""
    cupy = _cupy()
    out = cupy.zeros(batch.q.shape, dtype=cupy.float64)
    lse = cupy.zeros((batch.q.shape[1], batch.q.shape[0]), dtype=cupy.float64)
    baseline = cupy.zeros(batch.q.shape, dtype=batch.q.dtype)
    for rows_q, rows_k in batch.sequences():
        if rows_q.stop == rows_q.start:
            continue
        q, k, v = batch.q[rows_q][None], batch.k[rows_k][None], batch.v[rows_k][None]
        ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
        out[rows_q] = cupy.asarray(ref_out[0])
        lse[:, rows_q] = cupy.asarray(ref_lse[0])
        if batch.q.dtype != cupy.float32 and rows_k.stop > rows_k.start:
            baseline[rows_q] = naive_attention_same_precision(q, k, v, causal=causal, softmax_scale=scale)[0]
    return out, lse, baseline


def run_varlen_forward(batch: PackedBatch, *, causal, softmax_scale=None):
    cupy = _cupy()
    scale = 1 / math.sqrt(batch.q.shape[-1]) if softmax_scale is None else softmax_scale
    out = cupy.full(batch.q.shape, cupy.nan, dtype=batch.q.dtype)
    lse = cupy.full((batch.q.shape[1], batch.q.shape[0]), cupy.nan, dtype=cupy.float32)
    result, lse_result = cuflash.attention_varlen(*batch.args(), causal=causal, softmax_scale=softmax_scale,
                                                  return_lse=True, out=out, lse=lse)
    assert result is out and lse_result is lse
    end = int(batch.cu_q[-1])
    # Nothing is written after the last sequence.
    assert bool(cupy.isnan(out[end:].astype(cupy.float32)).all()) and bool(cupy.isnan(lse[:, end:]).all())
    ref_out, ref_lse, baseline = _reference_forward(batch, causal, scale)
    assert_output_accurate(out[:end], ref_out[:end], None if batch.q.dtype == cupy.float32 else baseline[:end])
    assert_lse_close(lse[:, :end], ref_lse[:, :end])
    return out, lse


def _kernel_keys(batch: PackedBatch, causal) -> list[str]:
    """The forward plan's kernels for this call (as the API plans it)."""
    from cuflash._validation import Packing, as_batch_of_one, check_forward, meta_of, packed_problem

    cupy = _cupy()
    metas = {name: as_batch_of_one(meta_of(name, x)) for name, x in (("q", batch.q), ("k", batch.k),
                                                                     ("v", batch.v))}
    problem = check_forward(metas["q"], metas["k"], metas["v"], None, causal=causal, softmax_scale=None)
    packing = Packing(meta_of("cu_seqlens_q", batch.cu_seqlens_q), meta_of("cu_seqlens_k", batch.cu_seqlens_k),
                      batch.max_q, batch.max_k)
    problem = packed_problem(problem, len(batch.lens_q), packing)
    out = cupy.empty_like(batch.q)
    layouts = {name: api.Layout.of(x[None]) for name, x in (("q", batch.q), ("k", batch.k), ("v", batch.v),
                                                              ("out", out))}
    tiling = api.forward_tiling_for(problem, list(layouts.values()), aligned=True)
    from cuflash._kernel_families import family_of

    return [family_of("forward", tiling.kernel).variant(problem.dtype, tiling, problem.mask, problem.score,
                                                        layout=problem.layout).key]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [40, 64, 128, 256])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_varlen_forward(dtype, head_dim, lengths, causal, heads):
    cupy = _cupy()
    lens_q, lens_k = LENGTHS[lengths]
    batch = PackedBatch(lens_q, lens_k, *heads, head_dim, cupy.dtype(dtype), seed=head_dim + len(lengths))
    run_varlen_forward(batch, causal=causal)


@pytest.mark.parametrize("generation", [90, 80], ids=["hopper", "mma-sync"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_forward_tensor_core_kernels(generation, causal, monkeypatch):
    """On the H100 the packed batch runs on the Hopper kernel, and pinned to
    sm_80 on the mma.sync one (both with their packed-batch variant)."""
    cupy = _cupy()
    if generation == 90 and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU")
    pin_kernel_generation(monkeypatch, generation)
    batch = PackedBatch([0, 1, 17, 1000, 333], [3, 1, 17, 1000, 700], 8, 2, 128, cupy.dtype("bfloat16"), seed=7)
    (key,) = _kernel_keys(batch, causal)
    assert key.startswith("forward-wgmma/" if generation == 90 else "forward-mma/") and "/packed" in key
    run_varlen_forward(batch, causal=causal)


def test_varlen_matches_dense_on_equal_lengths():
    """A packed batch of equal lengths computes what the dense call does on
    the same rows, bit for bit (same kernels' arithmetic, other addressing).
    Past d128's short-tile keys (WGMMA_FORWARD_SHORT_TILES), so both run
    the table's tile (the dense call's blocks persistent: the same tiles'
    arithmetic); at 512 keys or fewer a
    packed batch takes the short-sequence tile, whose key blocks sum in
    another order."""
    cupy = _cupy()
    n = 640
    batch = PackedBatch([n] * 4, [n] * 4, 8, 8, 128, cupy.dtype("bfloat16"), seed=3, padding=0)
    for causal in (False, True):
        out, lse = cuflash.attention_varlen(*batch.args(), causal=causal, return_lse=True)
        dense_out, dense_lse = cuflash.attention(batch.q.reshape(4, n, 8, 128), batch.k.reshape(4, n, 8, 128),
                                                 batch.v.reshape(4, n, 8, 128), causal=causal, return_lse=True)
        assert bool((out.reshape(4, n, 8, 128) == dense_out).all())
        assert bool((lse.reshape(8, 4, n).transpose(1, 0, 2) == dense_lse).all())


def run_varlen_backward(batch: PackedBatch, *, causal, deterministic=False, seed=0):
    cupy = _cupy()
    scale = 1 / math.sqrt(batch.q.shape[-1])
    out, lse = cuflash.attention_varlen(*batch.args(), causal=causal, return_lse=True)
    rng = cupy.random.default_rng(seed)
    dout = rng.standard_normal(batch.q.shape, dtype=cupy.float32).astype(batch.q.dtype)
    poisoned = [cupy.full(x.shape, cupy.nan, dtype=x.dtype) for x in (batch.q, batch.k, batch.v)]
    q, k, v, cu_q, cu_k, max_q, max_k = batch.args()
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                              deterministic=deterministic, dq=poisoned[0], dk=poisoned[1],
                                              dv=poisoned[2])
    assert all(g is p for g, p in zip(grads, poisoned))
    end_q, end_k = int(batch.cu_q[-1]), int(batch.cu_k[-1])
    # dq of the rows after the last sequence is 0; dk and dv there are not written.
    assert bool((grads[0][end_q:] == 0).all())
    assert all(bool(cupy.isnan(g[end_k:].astype(cupy.float32)).all()) for g in grads[1:])
    expected = [cupy.zeros(x.shape, dtype=cupy.float64) for x in (q, k, v)]
    baselines = [cupy.zeros(x.shape, dtype=x.dtype) for x in (q, k, v)]
    for rows_q, rows_k in batch.sequences():
        seq = (dout[rows_q][None], q[rows_q][None], k[rows_k][None], v[rows_k][None])
        if rows_k.stop == rows_k.start:
            continue  # no key: every gradient of the sequence is 0 (dq rows stay 0 in expected)
        want = attention_backward_reference(*seq, causal=causal, softmax_scale=scale)
        base = naive_attention_backward_same_precision(*seq, causal=causal, softmax_scale=scale)
        for i, rows in enumerate((rows_q, rows_k, rows_k)):
            expected[i][rows] = cupy.asarray(want[i][0])
            baselines[i][rows] = base[i][0]
    for name, got, want, base, end in zip(("dq", "dk", "dv"), grads, expected, baselines, (end_q, end_k, end_k)):
        try:
            assert_output_accurate(got[:end], want[:end], base[:end])
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    return grads


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_varlen_backward(dtype, head_dim, lengths, causal, heads):
    cupy = _cupy()
    lens_q, lens_k = LENGTHS[lengths]
    batch = PackedBatch(lens_q, lens_k, *heads, head_dim, cupy.dtype(dtype), seed=head_dim + 11)
    run_varlen_backward(batch, causal=causal)


@pytest.mark.parametrize("generation", [90, 80], ids=["hopper", "mma-sync"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_backward_tensor_core_kernels(generation, deterministic, causal, head_dim, monkeypatch):
    cupy = _cupy()
    if generation == 90 and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU")
    pin_kernel_generation(monkeypatch, generation)
    batch = PackedBatch([0, 1, 17, 1000, 333], [3, 1, 17, 1000, 700], 8, 2, head_dim, cupy.dtype("float16"),
                        seed=head_dim)
    grads = run_varlen_backward(batch, causal=causal, deterministic=deterministic)
    if deterministic:
        again = run_varlen_backward(batch, causal=causal, deterministic=True)
        assert all(bool(((a == b) | (cupy.isnan(a) & cupy.isnan(b))).all()) for a, b in zip(grads, again))


def test_varlen_plan_is_reused_across_offsets():
    """Two calls with the same shapes and longest lengths but other offsets
    share a plan (the offsets are pointers, read on the GPU)."""
    cupy = _cupy()
    first = PackedBatch([10, 30], [10, 30], 4, 4, 64, cupy.dtype("float16"), seed=1, padding=0)
    second = PackedBatch([30, 10], [30, 10], 4, 4, 64, cupy.dtype("float16"), seed=2, padding=0)
    api.plans.clear()
    run_varlen_forward(first, causal=True)
    planned = len(api.plans)
    run_varlen_forward(second, causal=True)
    assert len(api.plans) == planned


def test_varlen_offsets_out_of_range_stay_inside_the_tensors():
    """Offsets past the tensors (a caller's bug the launcher cannot see
    without a copy) are clamped to them: the call writes nothing outside its
    output (guard rows around it keep their value), and the sequences the
    clamped offsets describe are computed correctly."""
    cupy = _cupy()
    batch = PackedBatch([20, 30], [20, 30], 4, 4, 64, cupy.dtype("float16"), seed=5, padding=0)
    bad = cupy.asarray(np.array([0, 20, 10**6], dtype=np.int32))  # clamped to [0, 20, 50]
    storage = cupy.full((56, 4, 64), 7.0, dtype=cupy.float16)
    out = storage[3:53]
    cuflash.attention_varlen(batch.q, batch.k, batch.v, bad, bad, 64, 64, out=out)
    assert bool((storage[:3] == 7.0).all()) and bool((storage[53:] == 7.0).all())
    ref, _, baseline = _reference_forward(batch, False, 1 / 8)
    assert_output_accurate(out, ref, baseline)


def test_torch_flash_attn_varlen_func_trains():
    """``cuflash.torch.flash_attn_varlen_func``: FlashAttention-2's signature,
    gradients through autograd equal to cuflash's varlen backward."""
    torch = pytest.importorskip("torch")
    from cuflash.torch import flash_attn_varlen_func

    cupy = _cupy()
    batch = PackedBatch([5, 0, 300, 64], [5, 2, 300, 100], 8, 4, 64, cupy.dtype("bfloat16"), seed=9, padding=0)
    q, k, v = (torch.from_dlpack(x).clone().requires_grad_() for x in (batch.q, batch.k, batch.v))
    cu_q, cu_k = torch.from_dlpack(batch.cu_seqlens_q), torch.from_dlpack(batch.cu_seqlens_k)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, batch.max_q, batch.max_k, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected = cuflash.attention_varlen(*batch.args(), causal=True)
    assert bool((cupy.from_dlpack(out.detach()) == expected).all())
    _, lse = cuflash.attention_varlen(*batch.args(), causal=True, return_lse=True)
    grads = cuflash.attention_varlen_backward(cupy.from_dlpack(dout), batch.q, batch.k, batch.v, expected, lse,
                                              batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_q, batch.max_k,
                                              causal=True)
    for tensor, want in zip((q, k, v), grads):
        got = cupy.from_dlpack(tensor.grad).astype(cupy.float32)
        assert float(cupy.abs(got - want.astype(cupy.float32)).max()) <= 2e-2
