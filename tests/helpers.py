"""Shared test helpers: random inputs, the same-precision naive baseline and
the accuracy rule of DEVELOPERS.md."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from cuflash import mods
from cuflash._masks import mask_for
from cuflash.block_mask import BlockMask
from cuflash.dropout import dropout_keep_probability
from cuflash.dropout import dropout_mask as _draw_mask

#: Tests that compile CUDA with the toolkit's nvcc (no GPU needed).
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

#: Absolute floor added to the low-precision bound (2x the baseline's error).
ABS_FLOOR = 1e-5
#: Relative L2 bound for float32.
FLOAT32_RTOL = 1e-5
#: Absolute RMS floor for float32, for results that are exactly zero in exact
#: arithmetic (dq at seqlen_k = 1, where dS = P (dP - delta) = 0), where any
#: rounding at all is an infinite relative error.
FLOAT32_RMS_FLOOR = 1e-6


def window_by_definition(seqlen_q, seqlen_k, left, right, causal=False):
    """FlashAttention-2's window read off its docstring: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, a
    side of -1 unbounded, causal forcing right = 0. (seqlen_q, seqlen_k) bool."""
    rows = np.arange(seqlen_q)[:, None]
    keys = np.arange(seqlen_k)[None, :]
    offset = seqlen_k - seqlen_q
    right = 0 if causal else right
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        visible &= keys >= rows + offset - left
    if right >= 0:
        visible &= keys <= rows + offset + right
    return visible


def random_qkv(xp, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, *, layout="bshd", seed=0):
    """Fresh random q, k, v of ``dtype`` in (batch, seqlen, heads, dim) shape.

    ``layout="bhsd"`` makes them transposed views of (batch, heads, seqlen, dim)
    buffers, the PyTorch SDPA layout; ``"sliced"`` makes them views into larger
    buffers (every other batch, a subset of heads), so no stride is the
    contiguous one.
    """
    rng = np.random.default_rng(seed)

    def make(seqlen, heads):
        if layout == "bshd":
            data = rng.standard_normal((batch, seqlen, heads, head_dim))
            return xp.asarray(data.astype(np.float32)).astype(dtype)
        if layout == "bhsd":
            data = rng.standard_normal((batch, heads, seqlen, head_dim))
            return xp.asarray(data.astype(np.float32)).astype(dtype).transpose(0, 2, 1, 3)
        if layout == "sliced":
            data = rng.standard_normal((2 * batch, seqlen, heads + 3, head_dim + 8))
            return xp.asarray(data.astype(np.float32)).astype(dtype)[::2, :, 1 : heads + 1, 4 : head_dim + 4]
        raise ValueError(layout)

    return make(seqlen_q, nheads), make(seqlen_k, nheads_k), make(seqlen_k, nheads_k)


def _same_precision_scores(q, k_all, *, causal, softmax_scale, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, score_mod=None, mask_mod=None, mod_arrays=None):
    """Scaled scores (b, h, q, k) as a framework's unfused low-precision
    attention makes them, and the derivative of the transformed scores by the
    scaled ones (None without a soft cap or score_mod): a user score_mod
    applied in float64 (NumPy, cuflash.mods) and rounded to the input dtype;
    q.k accumulated in float32 and rounded to the input dtype, scaled, each
    variant applied in float32 and rounded to the input dtype (Gemma 2's
    cap, ALiBi's bias), then the mask."""
    import cupy

    dtype = q.dtype
    rnd = lambda x: x.astype(dtype).astype(cupy.float32)  # noqa: E731
    scores = cupy.einsum("bqhd,bkhd->bhqk", q.astype(cupy.float32), k_all.astype(cupy.float32))
    scores = rnd(scores) * softmax_scale
    seqlen_q, seqlen_k = q.shape[1], k_all.shape[1]
    chain = None
    if softcap:
        tanh = rnd(cupy.tanh(scores / softcap))
        scores = rnd(softcap * tanh)
        chain = 1 - tanh * tanh  # d/ds softcap tanh(s / softcap)
    if score_mod is not None:
        host = cupy.asnumpy(scores).astype(np.float64)
        scores = rnd(cupy.asarray(mods.evaluate_score_mod(score_mod, host, mod_arrays), dtype=cupy.float32))
        step = 1e-3 * np.maximum(1.0, np.abs(host))
        derivative = (mods.evaluate_score_mod(score_mod, host + step, mod_arrays)
                      - mods.evaluate_score_mod(score_mod, host - step, mod_arrays)) / (2 * step)
        chain = rnd(cupy.asarray(derivative, dtype=cupy.float32))
    if alibi_slopes is not None:
        slopes = cupy.broadcast_to(cupy.asarray(alibi_slopes, dtype=cupy.float32), scores.shape[:2])
        distance = cupy.abs(cupy.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q - cupy.arange(seqlen_k)[None, :])
        scores = rnd(scores - slopes[:, :, None, None] * distance.astype(cupy.float32))
    window = tuple(window_size)
    mask = mask_for(causal, None if window == (-1, -1) else window)
    if mask.name != "none":
        scores = cupy.where(mask.matrix(seqlen_q, seqlen_k, cupy), scores, -cupy.inf)
    if mask_mod is not None:  # a user mask (a BlockMask's function and arrays where one is given)
        if isinstance(mask_mod, BlockMask):
            mask_mod, mod_arrays = mask_mod.mask_mod, mod_arrays or mask_mod.mod_arrays
        visible = mods.evaluate_mask_mod(mask_mod, scores.shape, mod_arrays)
        scores = cupy.where(cupy.asarray(visible), scores, -cupy.inf)
    return scores, chain


def _same_precision_probabilities(q, k_all, *, causal, softmax_scale, **variants):
    """Probabilities as a framework's unfused low-precision attention makes
    them: scores as ``_same_precision_scores``, the softmax in float32, the
    result rounded to the input dtype (returned as float32 holding those
    rounded values). ``variants``: window_size, softcap, alibi_slopes."""
    import cupy

    dtype = q.dtype
    scores, _ = _same_precision_scores(q, k_all, causal=causal, softmax_scale=softmax_scale, **variants)
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = cupy.where(cupy.isneginf(row_max), 0.0, row_max)
    probs = cupy.exp(scores - row_max)
    row_sum = probs.sum(axis=-1, keepdims=True)
    return (probs / cupy.where(row_sum > 0, row_sum, 1.0)).astype(dtype).astype(cupy.float32)


def _dropout_factor(q, k, dropout_p=0.0, dropout_seed=None, dropout_offset=0, dropout_mask=None):
    """Dropout's factor (b, h, q, k) as float32 (1 / keep where kept, 0
    where dropped: ``dropout_mask``, or cuflash's mask for these arguments),
    or None without dropout."""
    import cupy

    if not dropout_p:
        return None
    keep = dropout_mask
    if keep is None:
        keep = _draw_mask(q.shape[0], q.shape[2], q.shape[1], k.shape[1], dropout_p, dropout_seed, dropout_offset)
    return cupy.asarray(np.where(keep, 1.0 / dropout_keep_probability(dropout_p), 0.0).astype(np.float32))


def _split_dropout(variants: dict) -> tuple[dict, dict]:
    names = ("dropout_p", "dropout_seed", "dropout_offset", "dropout_mask")
    return ({name: value for name, value in variants.items() if name not in names},
            {name: value for name, value in variants.items() if name in names})


def naive_attention_same_precision(q, k, v, *, softmax_scale, causal=False, **variants):
    """Attention the naive way in the inputs' own precision (CuPy): each
    matrix product accumulates in float32 and is rounded to the input dtype,
    as a framework's unfused bf16/fp16 attention does. Its error against
    float64 is the yardstick for cuflash's low-precision error.
    ``variants``: window_size, softcap, alibi_slopes, dropout_p,
    dropout_seed, dropout_offset (as ``cuflash.attention``'s; dropout
    multiplies the rounded probabilities, rounded again)."""
    import cupy

    group = q.shape[2] // k.shape[2]
    variants, dropout = _split_dropout(variants)
    probs = _same_precision_probabilities(q, cupy.repeat(k, group, axis=2), causal=causal,
                                          softmax_scale=softmax_scale, **variants)
    factor = _dropout_factor(q, k, **dropout)
    if factor is not None:
        probs = (probs * factor).astype(q.dtype).astype(cupy.float32)
    v_all = cupy.repeat(v, group, axis=2).astype(cupy.float32)
    return cupy.einsum("bhqk,bkhd->bqhd", probs, v_all).astype(q.dtype)


def to_numpy64(x) -> np.ndarray:
    """Any CuPy, PyTorch, JAX or NumPy array as a float64 NumPy array."""
    module = type(x).__module__
    if module.startswith("cupy"):
        x = x.get()
    elif module.startswith("torch"):
        x = x.detach().float().cpu().numpy()
    elif module.startswith("jax"):
        x = np.asarray(x.astype("float32"))
    return np.asarray(x).astype(np.float64)


def assert_lse_close(lse, ref_lse, atol=1e-4):
    lse = to_numpy64(lse)
    ref_lse = to_numpy64(ref_lse)
    assert not np.isnan(lse).any(), "lse has NaN (unwritten or invalid)"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse is -inf at other rows than the reference"
    finite = np.isfinite(ref_lse)
    assert np.isfinite(lse[finite]).all()
    if finite.any():
        err = np.abs(lse[finite] - ref_lse[finite]) / np.maximum(1.0, np.abs(ref_lse[finite]))
        assert err.max() <= atol, f"lse error {err.max():.3g} > {atol}"


def assert_output_accurate(out, ref, baseline=None):
    """DEVELOPERS.md's rule. float16 and bfloat16: max error <= 2 x the
    same-precision naive baseline's max error + a tiny floor. float32:
    relative L2 error <= 1e-5 (plus an RMS floor of 1e-6); where the exact
    result cancels to (nearly) zero, as dk does for seqlen_k = 1, no relative
    bound can hold, and a float32 naive baseline, if given, sets the bound as
    for the low precisions. NaN never passes."""
    is_float32 = "float32" in str(out.dtype)
    out64 = to_numpy64(out)
    ref64 = to_numpy64(ref)
    assert not np.isnan(out64).any(), "output has NaN (unwritten or invalid)"
    assert out64.shape == ref64.shape
    if is_float32:
        norm = np.linalg.norm(ref64)
        err = np.linalg.norm(out64 - ref64)
        bound = FLOAT32_RTOL * norm + FLOAT32_RMS_FLOOR * np.sqrt(ref64.size)
        message = (f"relative error {err / max(norm, 1e-30):.3g} > {FLOAT32_RTOL} "
                   f"(L2 error {err:.3g}, reference norm {norm:.3g})")
        if err <= bound:
            return
        assert baseline is not None, message
    assert baseline is not None, "a low-precision result needs a same-precision baseline"
    base64 = to_numpy64(baseline)
    err = np.abs(out64 - ref64).max(initial=0.0)
    base_err = np.abs(base64 - ref64).max(initial=0.0)
    assert err <= 2 * base_err + ABS_FLOOR, f"max error {err:.3g} > 2 x baseline {base_err:.3g} + {ABS_FLOOR}"


def naive_attention_backward_same_precision(dout, q, k, v, *, softmax_scale, causal=False, **variants):
    """Gradients the naive way in the inputs' own precision (CuPy): every
    product accumulates in float32 and is rounded to the input dtype, as a
    framework's unfused bf16/fp16 attention backward does. Its error against
    float64 is the yardstick for cuflash's low-precision gradients.
    ``variants``: window_size, softcap, alibi_slopes, and dropout's."""
    import cupy

    dtype = q.dtype
    variants, dropout = _split_dropout(variants)
    factor = _dropout_factor(q, k, **dropout)
    f32 = lambda x: x.astype(cupy.float32)  # noqa: E731
    rnd = lambda x: x.astype(dtype)  # noqa: E731
    nheads, nheads_k = q.shape[2], k.shape[2]
    group = nheads // nheads_k
    k_all = cupy.repeat(k, group, axis=2)
    v_all = cupy.repeat(v, group, axis=2)
    probs = _same_precision_probabilities(q, k_all, causal=causal, softmax_scale=softmax_scale, **variants)
    weights = probs if factor is None else f32(rnd(probs * factor))
    out = f32(rnd(cupy.einsum("bhqk,bkhd->bqhd", weights, f32(v_all))))
    dout32 = f32(dout)
    dv = rnd(cupy.einsum("bhqk,bqhd->bkhd", weights, dout32).reshape(*k.shape[:3], group, k.shape[3]).sum(3))
    dprobs = f32(rnd(cupy.einsum("bqhd,bkhd->bhqk", dout32, f32(v_all))))
    if factor is not None:
        dprobs = f32(rnd(dprobs * factor))
    delta = (dout32 * out).sum(axis=-1).transpose(0, 2, 1)[..., None]
    dscores = f32(rnd(probs * (dprobs - delta)))
    _, chain = _same_precision_scores(q, k_all, causal=causal, softmax_scale=softmax_scale, **variants)
    if chain is not None:  # through the soft cap or score_mod
        dscores = f32(rnd(dscores * chain))
    dq = rnd(softmax_scale * cupy.einsum("bhqk,bkhd->bqhd", dscores, f32(k_all)))
    dk = rnd(softmax_scale * cupy.einsum("bhqk,bqhd->bkhd", dscores, f32(q)).reshape(*k.shape[:3], group, k.shape[3]).sum(3))
    return dq, dk, dv


#: A kernel that spins for ``cycles`` clock cycles, then copies ``src`` to
#: ``dst``: writes inputs late on a stream, to show a call waits for them.
SPIN_AND_COPY = r"""
extern "C" __global__ void spin_and_copy(const float* src, float* dst, long long n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def pin_kernel_generation(monkeypatch, generation: int) -> None:
    """Makes the launcher choose kernels as on a GPU of compute capability
    ``generation`` (``api._kernel_generation``), with an empty plan cache of
    its own: a plan cached by an earlier test of the same call signature
    would otherwise run the kernel chosen for the real device."""
    from cuflash import api
    from cuflash._launch import PlanCache

    monkeypatch.setattr(api, "_kernel_generation", lambda device_id: generation)
    monkeypatch.setattr(api, "plans", PlanCache())


def recorded_decisions(monkeypatch, name: str) -> list:
    """What every call of ``cuflash.api.<name>`` (one of the launcher's
    decisions, e.g. ``stores_dq_directly``) returns from now on, in order.
    Plans already cached do not decide again: clear them first."""
    from cuflash import api

    decisions = []
    decide = getattr(api, name)
    monkeypatch.setattr(api, name, lambda *args: decisions.append(decide(*args)) or decisions[-1])
    return decisions


def pin_ordered_dq_order(monkeypatch, rotated: bool) -> dict:
    """Makes the launcher rotate the walks of every ordered-dQ backward that
    may rotate (``rotated``: as if the GPU had room for any number of key
    blocks), or of none (as if it had none), from a fresh plan cache.
    Returns dq mode -> the orders the plans made since took (True: rotated)."""
    from cuflash import api
    from cuflash._launch import PlanCache

    taken = {"ordered": [], "atomic": []}
    decide = api.rotate_walks

    def recorded(problem, dq_mode, kernel, num_m_blocks, num_n_blocks, multiprocessors):
        rotate = decide(problem, dq_mode, kernel, num_m_blocks, num_n_blocks, 1 << 20 if rotated else 0)
        taken.setdefault(dq_mode, []).append(rotate)
        return rotate

    monkeypatch.setattr(api, "rotate_walks", recorded)
    monkeypatch.setattr(api, "plans", PlanCache())
    return taken


def assert_reference_gradients_match_finite_differences(dout, q, k, v, **options):
    """``attention_backward_reference`` against central differences of
    sum(attention_reference(...) * dout) in float64, every input element
    (small problems)."""
    from cuflash.reference import attention_backward_reference, attention_reference

    grads = attention_backward_reference(dout, q, k, v, **options)

    def loss(*args):
        return float((attention_reference(*args, **options)[0] * dout).sum())

    step = 1e-6
    for index, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for position in np.ndindex(grad.shape):
            plus, minus = [x.copy() for x in (q, k, v)], [x.copy() for x in (q, k, v)]
            plus[index][position] += step
            minus[index][position] -= step
            numeric[position] = (loss(*plus) - loss(*minus)) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7)
    return grads


def check_forward_and_backward(cupy, q, k, v, dout, options: dict, dtype: str, deterministic: bool = False):
    """cuflash's forward and backward of ``options`` (a call's keyword
    arguments) on poisoned outputs against the float64 references, within 2x
    the same-precision naive baseline for 16-bit inputs; returns (out, lse,
    [dq, dk, dv])."""
    import cuflash
    from cuflash.reference import attention_backward_reference, attention_reference

    batch, seqlen_q, nheads, head_dim = q.shape
    out = cupy.full_like(q, cupy.nan)
    lse = cupy.full((batch, nheads, seqlen_q), cupy.nan, dtype=cupy.float32)
    cuflash.attention(q, k, v, out=out, lse=lse, return_lse=True, **options)
    host = [to_numpy64(x) for x in (q, k, v, dout)]
    want_out, want_lse = attention_reference(*host[:3], **options)
    scale = 1 / math.sqrt(head_dim)
    low = dtype != "float32"
    baseline = naive_attention_same_precision(q, k, v, softmax_scale=scale, **options) if low else None
    assert_output_accurate(out, want_out, baseline)
    assert_lse_close(lse, want_lse)
    grads = [cupy.full_like(x, cupy.nan) for x in (q, k, v)]
    cuflash.attention_backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                               deterministic=deterministic, **options)
    wants = attention_backward_reference(host[3], *host[:3], **options)
    bases = naive_attention_backward_same_precision(dout, q, k, v, softmax_scale=scale, **options)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, wants, bases):
        try:
            assert_output_accurate(got, want, base)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    return out, lse, grads
