"""Sliding windows, soft capping and ALiBi on the GPU against the float64
reference (the variants applied there too): forward and backward through
the public API on every kernel family (Hopper wgmma, mma.sync, SIMT, 3xTF32),
deterministic dQ orders, variable-length batches, KV caches, and the
PyTorch and JAX front ends. Outputs and gradients are poisoned with NaN
before each run; low precision must stay within 2x a same-precision naive
baseline that applies the same variants."""

import math

import numpy as np
import pytest

import cuflash
from cuflash import api
from cuflash._kernel_families import family_of
from cuflash._tiling import DECODE_MAX_ROWS
from cuflash._validation import check_forward, check_variants, meta_of
from cuflash.reference import attention_backward_reference, attention_reference, attention_with_kvcache_reference

from tests.helpers import (
    assert_lse_close,
    assert_output_accurate,
    naive_attention_backward_same_precision,
    naive_attention_same_precision,
    pin_kernel_generation,
    random_qkv,
    to_numpy64,
)
from tests.test_forward_gpu import _cupy

pytestmark = pytest.mark.gpu

#: name -> the variants of a call (alibi_slopes: "head" for (nheads,), "batch" for (batch, nheads)).
VARIANTS = {
    "band": dict(window_size=(64, 32)),
    "window-causal": dict(window_size=(100, -1), causal=True),
    "right-only": dict(window_size=(-1, 50)),
    "softcap": dict(softcap=5.0),
    "softcap-causal": dict(softcap=3.0, causal=True),
    "alibi-causal": dict(alibi_slopes="head", causal=True),
    "everything": dict(window_size=(80, 10), softcap=4.0, alibi_slopes="batch"),
    "dropout": dict(dropout_p=0.2, dropout_seed=1234),
    "dropout-everything": dict(window_size=(80, 10), softcap=4.0, alibi_slopes="batch", dropout_p=0.15,
                               dropout_seed=(1 << 40) + 9, dropout_offset=5),
}

#: Options of a call that are not check_variants' (dropout's seed and offset: values of each call).
_CALL_VALUES = ("causal", "dropout_seed", "dropout_offset")

#: (dtype, head_dim, kernel generation to pin or None, deterministic, fp32_precision) -> the families they reach.
CONFIGS = {
    "wgmma": ("bfloat16", 128, None, False, "ieee"),  # Hopper forward and backward
    "wgmma-ordered": ("float16", 64, None, True, "ieee"),  # Hopper backward, dQ added in the mask's order
    "mma": ("float16", 64, 80, False, "ieee"),  # mma.sync forward and backward
    "mma-ordered": ("bfloat16", 128, 80, True, "ieee"),
    "mma-simt": ("bfloat16", 96, None, False, "ieee"),  # mma.sync forward, SIMT backward
    "simt": ("float32", 40, None, False, "ieee"),  # SIMT forward and backward (precise tanh)
    "3xtf32": ("float32", 64, None, False, "3xtf32"),  # mma.sync forward on float32, SIMT backward
}


def _slopes(kind, batch, nheads, seed=0):
    cupy = _cupy()
    rng = np.random.default_rng(seed)
    shape = (nheads,) if kind == "head" else (batch, nheads)
    # ALiBi's geometric slopes 2^(-8 i / n) span this range
    return cupy.asarray(rng.uniform(0.02, 0.5, shape).astype(np.float32))


def _options(name, batch, nheads):
    options = dict(VARIANTS[name])
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _slopes(options["alibi_slopes"], batch, nheads)
    return options


def _forward_key(q, k, v, options, fp32_precision="ieee") -> str:
    """The forward kernel the API plans for this call."""
    metas = {name: meta_of(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    variants = {name: value for name, value in options.items() if name not in _CALL_VALUES}
    if "alibi_slopes" in variants:
        variants["alibi_slopes"] = meta_of("alibi_slopes", variants["alibi_slopes"])
    problem = check_forward(metas["q"], metas["k"], metas["v"], None, causal=options.get("causal", False),
                            softmax_scale=None, fp32_precision=fp32_precision)
    problem = check_variants(problem, **variants)
    layouts = {name: api.Layout.of(x) for name, x in (("q", q), ("k", k), ("v", v), ("out", q))}
    tiling, shape, _ = api._forward_tiles(problem, layouts, True, None)
    return family_of("forward", tiling.kernel).variant(problem.dtype, tiling, shape.problem.mask,
                                                       shape.problem.score).key


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 517), (517, 300), (1, 1000), (17, 127)])
def test_variants_forward_and_backward(variant, config, seqlen_q, seqlen_k, monkeypatch):
    cupy = _cupy()
    dtype, head_dim, generation, deterministic, fp32_precision = CONFIGS[config]
    if generation is None and dtype != "float32" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU")
    if generation is not None:
        pin_kernel_generation(monkeypatch, generation)
    batch, nheads, nheads_k = 2, 4, 2
    q, k, v = random_qkv(cupy, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, cupy.dtype(dtype), seed=5)
    q, k = q * 2, k * 2  # scaled scores of order 5-10, where the caps bend them
    dout = random_qkv(cupy, batch, seqlen_q, seqlen_q, nheads, nheads, head_dim, cupy.dtype(dtype), seed=6)[0]
    options = _options(variant, batch, nheads)
    key = _forward_key(q, k, v, options, fp32_precision)
    expected_family = {"wgmma": "forward-wgmma/", "wgmma-ordered": "forward-wgmma/", "mma": "forward-mma/",
                       "mma-ordered": "forward-mma/", "simt": "forward/", "3xtf32": "forward-mma/"}.get(config)
    if expected_family is not None and (seqlen_q > DECODE_MAX_ROWS or config == "simt"):  # else decode tiles
        assert key.startswith(expected_family), key
    scale = 1 / math.sqrt(head_dim)

    out = cupy.full_like(q, cupy.nan)
    lse = cupy.full((batch, nheads, seqlen_q), cupy.nan, dtype=cupy.float32)
    cuflash.attention(q, k, v, out=out, lse=lse, return_lse=True, fp32_precision=fp32_precision, **options)
    host = {name: to_numpy64(x) for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    reference_options = {name: (to_numpy64(x) if name == "alibi_slopes" else x) for name, x in options.items()}
    want_out, want_lse = attention_reference(host["q"], host["k"], host["v"], **reference_options)
    low = dtype != "float32"
    baseline = naive_attention_same_precision(q, k, v, softmax_scale=scale, **options) if low else None
    assert_output_accurate(out, want_out, baseline)
    assert_lse_close(lse, want_lse)

    grads = [cupy.full_like(x, cupy.nan) for x in (q, k, v)]
    cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, dq=grads[0], dk=grads[1],
                               dv=grads[2], **options)
    wants = attention_backward_reference(host["dout"], host["q"], host["k"], host["v"], **reference_options)
    # float32 is held to a relative bound; its baseline serves only where the result cancels to ~0
    baselines = naive_attention_backward_same_precision(dout, q, k, v, softmax_scale=scale, **options)
    for name, got, want, base in zip(("dq", "dk", "dv"), grads, wants, baselines):
        try:
            assert_output_accurate(got, want, base)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


def test_deterministic_backward_with_a_window_is_bitwise_repeatable():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 700, 900, 8, 2, 128, cupy.dtype("bfloat16"), seed=9)
    dout = random_qkv(cupy, 2, 700, 700, 8, 8, 128, cupy.dtype("bfloat16"), seed=10)[0]
    options = dict(window_size=(200, 30), softcap=5.0, alibi_slopes=_slopes("head", 2, 8))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    first = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for _ in range(3):
        again = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
        assert all(bool((a == b).all()) for a, b in zip(first, again))


@pytest.mark.parametrize("variant", ["band", "softcap-causal", "everything", "dropout-everything"])
@pytest.mark.parametrize("generation", [90, 80], ids=["hopper", "mma-sync"])
def test_variants_on_variable_length_batches(variant, generation, monkeypatch):
    from tests.test_varlen_gpu import PackedBatch

    cupy = _cupy()
    if generation == 90 and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU")
    pin_kernel_generation(monkeypatch, generation)
    batch = PackedBatch([0, 1, 17, 1000, 333], [3, 1, 17, 1000, 700], 8, 2, 128, cupy.dtype("bfloat16"), seed=7)
    options = _options(variant, 5, 8)
    out, lse = cuflash.attention_varlen(*batch.args(), return_lse=True, **options)
    rng = cupy.random.default_rng(1)
    dout = rng.standard_normal(batch.q.shape, dtype=cupy.float32).astype(batch.q.dtype)
    grads = cuflash.attention_varlen_backward(dout, *batch.args()[:3], out, lse, *batch.args()[3:], **options)
    slopes = options.get("alibi_slopes")
    dropout = {name: options.pop(name) for name in ("dropout_seed", "dropout_offset") if name in options}
    for b, (rows_q, rows_k) in enumerate(batch.sequences()):
        if rows_q.stop == rows_q.start or rows_k.stop == rows_k.start:
            continue
        sequence = {name: value for name, value in options.items() if name != "alibi_slopes"}
        if slopes is not None:
            sequence["alibi_slopes"] = slopes[b:b + 1]
        if dropout:  # sequence b's mask: batch entry b's, rows and keys from the sequence's start
            sequence["dropout_mask"] = cuflash.dropout_mask(
                b + 1, 8, rows_q.stop - rows_q.start, rows_k.stop - rows_k.start, options["dropout_p"],
                dropout["dropout_seed"], dropout.get("dropout_offset", 0))[b:b + 1]
        args = (batch.q[rows_q][None], batch.k[rows_k][None], batch.v[rows_k][None])
        reference = {name: (to_numpy64(x) if name == "alibi_slopes" else x) for name, x in sequence.items()}
        want_out, want_lse = attention_reference(*(to_numpy64(x) for x in args), **reference)
        scale = 1 / math.sqrt(128)
        assert_output_accurate(out[rows_q][None], want_out,
                               naive_attention_same_precision(*args, softmax_scale=scale, **sequence))
        assert_lse_close(lse[:, rows_q][None], want_lse)
        wants = attention_backward_reference(to_numpy64(dout[rows_q][None]), *(to_numpy64(x) for x in args),
                                             **reference)
        bases = naive_attention_backward_same_precision(dout[rows_q][None], *args, softmax_scale=scale, **sequence)
        for got, rows, want, base in zip(grads, (rows_q, rows_k, rows_k), wants, bases):
            assert_output_accurate(got[rows][None], want, base)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("variant", ["band", "softcap", "alibi-causal", "everything"])
def test_variants_with_a_kv_cache(paged, variant):
    cupy = _cupy()
    rng = np.random.default_rng(3)
    batch, nheads, nheads_k, head_dim, capacity, page = 3, 8, 2, 128, 640, 16
    lengths = np.array([0, 333, 600], dtype=np.int32)
    dtype = cupy.dtype("bfloat16")
    cache_shape = (batch * capacity // page, page) if paged else (batch, capacity)
    k_cache, v_cache = (cupy.asarray(rng.standard_normal((*cache_shape, nheads_k, head_dim)).astype(np.float32))
                        .astype(dtype) for _ in range(2))
    block_table = None
    if paged:
        table = rng.permutation(batch * capacity // page).reshape(batch, capacity // page).astype(np.int32)
        block_table = cupy.asarray(table)
    for seqlen_q in (1, 5):
        q = cupy.asarray(rng.standard_normal((batch, seqlen_q, nheads, head_dim)).astype(np.float32) * 2).astype(dtype)
        options = _options(variant, batch, nheads)
        out, lse = cuflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cupy.asarray(lengths),
                                                  block_table=block_table, return_lse=True, **options)
        reference = {name: (to_numpy64(x) if name == "alibi_slopes" else x) for name, x in options.items()}
        want_out, want_lse = attention_with_kvcache_reference(
            to_numpy64(q), to_numpy64(k_cache), to_numpy64(v_cache), lengths,
            block_table=None if block_table is None else cupy.asnumpy(block_table), **reference)
        got = to_numpy64(out)
        np.testing.assert_allclose(got, want_out, atol=3e-2, rtol=0)
        assert_lse_close(lse, want_lse, atol=2e-3)


def test_pytorch_drop_in_takes_flash_attention_2s_variants():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cuflash_torch

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 300, n, 64, device=device, generator=generator, dtype=torch.bfloat16) * 2
               for n in (8, 2, 2))
    slopes = torch.rand(8, device=device, generator=generator) * 0.3
    options = dict(window_size=(50, 10), softcap=4.0, alibi_slopes=slopes)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cuflash_torch.flash_attn_func(*leaves, **options)
    out.float().square().sum().backward()
    cupy = _cupy()
    views = [cupy.from_dlpack(x.detach()) for x in (q, k, v)]
    want_out, want_lse = cuflash.attention(*views, return_lse=True, window_size=(50, 10), softcap=4.0,
                                           alibi_slopes=cupy.from_dlpack(slopes))
    assert bool((cupy.from_dlpack(out.detach()) == want_out).all())
    dout = cupy.from_dlpack((2 * out.float()).to(torch.bfloat16).detach())
    want = cuflash.attention_backward(dout, *views, want_out, want_lse, window_size=(50, 10), softcap=4.0,
                                      alibi_slopes=cupy.from_dlpack(slopes))
    for leaf, grad in zip(leaves, want):
        assert bool((cupy.from_dlpack(leaf.grad) == grad).all())
    # through torch.compile's custom op: the same numbers
    compiled = torch.compile(lambda *x: cuflash_torch.attention(*x, **options), fullgraph=True)
    assert torch.equal(compiled(q, k, v), out.detach())


def test_jax_under_jit_takes_the_variants():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cuflash_jax

    if not cuflash_jax.JIT_SUPPORTED:
        pytest.skip("this JAX has no buffer_callback")
    key = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (2, 200, n, 64), dtype=jnp.bfloat16) * 2
               for i, n in enumerate((4, 2, 2)))
    slopes = jnp.array([0.1, 0.2, 0.3, 0.4], dtype=jnp.float32)
    options = dict(window_size=(40, 5), softcap=3.0, alibi_slopes=slopes)

    @jax.jit
    def loss(q, k, v):
        return jnp.sum(jnp.square(cuflash_jax.attention(q, k, v, **options).astype(jnp.float32)))

    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    host = [np.asarray(x.astype(jnp.float32), dtype=np.float64) for x in (q, k, v)]
    reference = dict(window_size=(40, 5), softcap=3.0, alibi_slopes=np.asarray(slopes, dtype=np.float64))
    want_out, _ = attention_reference(*host, **reference)
    assert abs(float(value) - float(np.square(want_out).sum())) <= 2e-2 * float(np.square(want_out).sum())
    wants = attention_backward_reference(2 * want_out, *host, **reference)
    for got, want in zip(grads, wants):
        got = np.asarray(got.astype(jnp.float32), dtype=np.float64)
        assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want)


def test_bad_variants_fail_before_any_launch():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 64, 64, 4, 2, 64, cupy.dtype("float16"))
    for options, error, match in (
            (dict(window_size=(3,)), TypeError, "window_size must be a pair"),
            (dict(softcap=-2.0), ValueError, "softcap must be finite and >= 0"),
            (dict(alibi_slopes=cupy.ones(3, dtype=cupy.float32)), ValueError, r"alibi_slopes must have shape"),
            (dict(alibi_slopes=cupy.ones(4, dtype=cupy.float64)), TypeError, "alibi_slopes must have dtype float32"),
            (dict(alibi_slopes=np.ones(4, dtype=np.float32)), TypeError, "alibi_slopes")):
        out = cupy.full_like(q, cupy.nan)
        with pytest.raises(error, match=match):
            cuflash.attention(q, k, v, out=out, **options)
        assert bool(cupy.isnan(out.astype(cupy.float32)).all())  # nothing ran
