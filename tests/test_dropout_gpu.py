"""Dropout on the GPU. The mask each kernel applies is read back exactly and
compared with ``cuflash.dropout_mask`` (q = k = 0 makes every probability
1 / seqlen_k; one-hot values and output gradients then expose each kept or
dropped entry in the output and in dV), on every kernel family, for
decoding with split-KV and for variable-length batches; results are
bitwise repeatable for a seed and change with it; PyTorch draws seeds from
its CUDA generator as FlashAttention-2 does, and JAX takes a PRNG key under
``jax.jit`` without recompiling. Accuracy against the float64 reference
with the materialised mask runs in test_variants_gpu.py's matrix."""

import numpy as np
import pytest

import cuflash
from cuflash.dropout import dropout_keep_probability, dropout_mask

from tests.helpers import pin_kernel_generation, random_qkv, to_numpy64
from tests.test_forward_gpu import _cupy

pytestmark = pytest.mark.gpu

#: name -> (dtype, head_dim, kernel generation to pin or None): the families the calls reach.
KERNELS = {
    "wgmma": ("bfloat16", 64, None),  # Hopper forward and backward
    "mma": ("float16", 64, 80),  # mma.sync forward and backward
    "mma-d96": ("bfloat16", 96, None),  # mma.sync forward (its tiles of 96 keys), SIMT backward
    "simt": ("float32", 64, None),  # SIMT forward and backward
}


def _read_masks(dtype, head_dim, batch, nheads, seqlen_q, seqlen_k, p, seed, offset, **options):
    """The keep masks (batch, nheads, seqlen_q, seqlen_k) the forward and the
    backward applied, read from out and dV: with q = k = 0 each probability
    is 1 / seqlen_k; v one-hot on keys [c, c + head_dim) gives
    out[.., i, .., m] = keep(i, c + m) / (keep_p seqlen_k), and dO one-hot
    on rows [c, c + head_dim) gives dV[.., j, .., m] = keep(c + m, j) / (...)."""
    cupy = _cupy()
    zeros_q = cupy.zeros((batch, seqlen_q, nheads, head_dim), dtype=dtype)
    zeros_k = cupy.zeros((batch, seqlen_k, nheads, head_dim), dtype=dtype)
    kept_value = 1.0 / (dropout_keep_probability(p) * seqlen_k)
    forward = np.zeros((batch, nheads, seqlen_q, seqlen_k), dtype=bool)
    backward = np.zeros_like(forward)
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset, **options)
    for c in range(0, seqlen_k, head_dim):
        width = min(head_dim, seqlen_k - c)
        v = cupy.zeros_like(zeros_k)
        v[:, c + np.arange(width), :, np.arange(width)] = 1
        out = cupy.full_like(zeros_q, cupy.nan)
        out, lse = cuflash.attention(zeros_q, zeros_k, v, out=out, return_lse=True, **drop)
        got = to_numpy64(out)[..., :width]  # (b, q, h, m)
        assert not np.isnan(got).any()
        assert np.isclose(got[got != 0], kept_value, rtol=1e-2).all()
        forward[..., c:c + width] = got.transpose(0, 2, 1, 3) != 0
    for c in range(0, seqlen_q, head_dim):
        width = min(head_dim, seqlen_q - c)
        v = cupy.zeros_like(zeros_k)
        out, lse = cuflash.attention(zeros_q, zeros_k, v, return_lse=True, **drop)
        dout = cupy.zeros_like(zeros_q)
        dout[:, c + np.arange(width), :, np.arange(width)] = 1
        dv = cupy.full_like(zeros_k, cupy.nan)
        cuflash.attention_backward(dout, zeros_q, zeros_k, v, out, lse, dv=dv, **drop)
        got = to_numpy64(dv)[..., :width]  # (b, k, h, m): keep(c + m, k)
        assert not np.isnan(got).any()
        assert np.isclose(got[got != 0], kept_value, rtol=1e-2).all()
        backward[:, :, c:c + width, :] = got.transpose(0, 2, 3, 1) != 0
    return forward, backward


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(200, 300), (17, 127), (1, 1000)])
def test_every_kernel_applies_cuflash_dropout_mask(kernel, seqlen_q, seqlen_k, monkeypatch):
    cupy = _cupy()
    dtype, head_dim, generation = KERNELS[kernel]
    if generation is None and dtype != "float32" and kernel == "wgmma" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs a Hopper GPU")
    if generation is not None:
        pin_kernel_generation(monkeypatch, generation)
    p, seed, offset = 0.3, (5 << 40) + 17, 9
    forward, backward = _read_masks(cupy.dtype(dtype), head_dim, 2, 3, seqlen_q, seqlen_k, p, seed, offset)
    want = dropout_mask(2, 3, seqlen_q, seqlen_k, p, seed, offset)
    np.testing.assert_array_equal(forward, want)
    np.testing.assert_array_equal(backward, want)
    assert abs(want.mean() - 0.7) < 0.05


def test_split_kv_decoding_applies_the_same_mask():
    """One query row against 8192 keys runs split-KV (key ranges merged by
    their log-sum-exp); the mask is the dense one's."""
    cupy = _cupy()
    p, seed = 0.5, 11
    q = cupy.zeros((1, 1, 2, 128), dtype=cupy.float16)
    k = cupy.zeros((1, 8192, 2, 128), dtype=cupy.float16)
    for splits in (None, 1):
        forward = np.zeros((1, 2, 1, 8192), dtype=bool)
        for c in range(0, 8192, 128):
            v = cupy.zeros_like(k)
            v[:, c + np.arange(128), :, np.arange(128)] = 1
            out = cuflash.attention(q, k, v, dropout_p=p, dropout_seed=seed, num_splits=splits)
            forward[..., c:c + 128] = to_numpy64(out).transpose(0, 2, 1, 3) != 0
        np.testing.assert_array_equal(forward, dropout_mask(1, 2, 1, 8192, p, seed))


def test_variable_length_sequences_take_their_batch_entrys_mask():
    cupy = _cupy()
    lengths_q, lengths_k = [5, 0, 40], [9, 3, 70]
    p, seed, head_dim = 0.25, 3, 128
    cu_q = cupy.asarray(np.cumsum([0] + lengths_q), dtype=cupy.int32)
    cu_k = cupy.asarray(np.cumsum([0] + lengths_k), dtype=cupy.int32)
    q = cupy.zeros((sum(lengths_q), 4, head_dim), dtype=cupy.dtype("bfloat16"))
    k = cupy.zeros((sum(lengths_k), 4, head_dim), dtype=cupy.dtype("bfloat16"))
    v = cupy.zeros_like(k)
    starts = np.cumsum([0] + lengths_k)
    for b, n in enumerate(lengths_k):  # one-hot per sequence: key j of sequence b -> column j
        v[starts[b] + np.arange(n), :, np.arange(n)] = 1
    out = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), dropout_p=p,
                                   dropout_seed=seed)
    mask = dropout_mask(3, 4, max(lengths_q), max(lengths_k), p, seed)
    got = to_numpy64(out)
    row = 0
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        np.testing.assert_array_equal(got[row:row + n_q, :, :n_k].transpose(1, 0, 2) != 0, mask[b, :, :n_q, :n_k])
        row += n_q


def test_a_seed_repeats_bitwise_and_a_new_seed_or_offset_changes_the_mask():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 300, 400, 8, 2, 128, cupy.dtype("bfloat16"), seed=1)
    dout = random_qkv(cupy, 2, 300, 300, 8, 8, 128, cupy.dtype("bfloat16"), seed=2)[0]
    options = dict(dropout_p=0.1, dropout_seed=42, causal=True)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **options)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
    for _ in range(2):
        again, again_lse = cuflash.attention(q, k, v, return_lse=True, **options)
        assert bool((again == out).all()) and bool((again_lse == lse).all())
        regrads = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **options)
        assert all(bool((a == b).all()) for a, b in zip(grads, regrads))
    for other in (dict(options, dropout_seed=43), dict(options, dropout_offset=1)):
        assert not bool((cuflash.attention(q, k, v, **other) == out).all())
    plain = cuflash.attention(q, k, v, causal=True)
    # Dropout changes the output, and the mean over many masks is the plain output.
    assert not bool((out == plain).all())
    mean = sum(to_numpy64(cuflash.attention(q, k, v, causal=True, dropout_p=0.1, dropout_seed=s))
               for s in range(64)) / 64
    assert np.abs(mean - to_numpy64(plain)).mean() < 0.1 * np.abs(to_numpy64(plain)).mean()


def test_dropout_arguments_are_checked_before_any_launch():
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, 64, 64, 2, 2, 64, cupy.dtype("float16"))
    for options, error, match in ((dict(dropout_p=0.1), ValueError, "needs dropout_seed"),
                                  (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
                                  (dict(dropout_p=0.1, dropout_seed=-3), ValueError, "dropout_seed must be in"),
                                  (dict(dropout_p=0.1, dropout_seed=1, dropout_offset=2.5), TypeError,
                                   "dropout_offset must be an int")):
        out = cupy.full_like(q, cupy.nan)
        with pytest.raises(error, match=match):
            cuflash.attention(q, k, v, out=out, **options)
        assert bool(cupy.isnan(out.astype(cupy.float32)).all())
    # A call of a cached signature is checked again: a bad seed never reaches the plan slot.
    cuflash.attention(q, k, v, dropout_p=0.1, dropout_seed=1)
    with pytest.raises(ValueError, match="dropout_seed must be in"):
        cuflash.attention(q, k, v, dropout_p=0.1, dropout_seed=1 << 64)


def test_pytorch_draws_seeds_from_its_cuda_generator():
    torch = pytest.importorskip("torch")
    import cuflash.torch as cuflash_torch

    cupy = _cupy()
    device = torch.device("cuda")
    q, k, v = (torch.randn(2, 256, n, 64, device=device, dtype=torch.bfloat16) for n in (8, 2, 2))
    generator = torch.cuda.default_generators[device.index or 0]
    torch.manual_seed(123)
    seed, offset = generator.initial_seed(), generator.get_offset()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cuflash_torch.flash_attn_func(*leaves, dropout_p=0.2, causal=True)
    out.float().square().sum().backward()
    assert generator.get_offset() > offset  # the next call draws a new mask
    views = [cupy.from_dlpack(x.detach()) for x in (q, k, v)]
    drop = dict(dropout_p=0.2, dropout_seed=seed, dropout_offset=offset, causal=True)
    want_out, want_lse = cuflash.attention(*views, return_lse=True, **drop)
    assert bool((cupy.from_dlpack(out.detach()) == want_out).all())
    dout = cupy.from_dlpack((2 * out.float()).to(torch.bfloat16).detach())
    for leaf, grad in zip(leaves, cuflash.attention_backward(dout, *views, want_out, want_lse, **drop)):
        assert bool((cupy.from_dlpack(leaf.grad) == grad).all())
    # the same seed again: the same output; the next call: another mask
    torch.manual_seed(123)
    assert torch.equal(cuflash_torch.flash_attn_func(q, k, v, dropout_p=0.2, causal=True), out.detach())
    assert not torch.equal(cuflash_torch.flash_attn_func(q, k, v, dropout_p=0.2, causal=True), out.detach())
    # SDPA's drop-in and torch.compile's custom op take dropout too
    torch.manual_seed(123)
    sdpa = cuflash_torch.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      dropout_p=0.2, is_causal=True, enable_gqa=True)
    assert torch.equal(sdpa.transpose(1, 2), out.detach())
    compiled = torch.compile(lambda *x: cuflash_torch.attention(*x, causal=True, dropout_p=0.2, dropout_seed=seed,
                                                                dropout_offset=offset), fullgraph=True)
    assert torch.equal(compiled(q, k, v), out.detach())


def test_jax_takes_a_prng_key_under_jit():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.jax as cuflash_jax

    if not cuflash_jax.JIT_SUPPORTED:
        pytest.skip("this JAX has no buffer_callback")
    cupy = _cupy()
    base = jax.random.PRNGKey(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(base, i), (2, 200, n, 64), dtype=jnp.bfloat16)
               for i, n in enumerate((4, 2, 2)))

    @jax.jit
    def loss(q, k, v, key):
        return jnp.sum(jnp.square(cuflash_jax.attention(q, k, v, causal=True, dropout_p=0.25,
                                                        dropout_rng=key).astype(jnp.float32)))

    key = jax.random.key(7)
    value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, key)
    words = np.asarray(jax.random.key_data(key), dtype=np.uint64)
    seed = int(words[0] | words[1] << np.uint64(32))
    views = [cupy.asarray(np.asarray(x)) for x in (q, k, v)]
    drop = dict(causal=True, dropout_p=0.25, dropout_seed=seed)
    want_out, want_lse = cuflash.attention(*views, return_lse=True, **drop)
    assert abs(float(value) - float(cupy.square(want_out.astype(cupy.float32)).sum())) <= 1e-3 * abs(float(value))
    dout = (2 * want_out.astype(cupy.float32)).astype(want_out.dtype)
    for got, want in zip(grads, cuflash.attention_backward(dout, *views, want_out, want_lse, **drop)):
        got, want = np.asarray(got.astype(jnp.float32)), cupy.asnumpy(want.astype(cupy.float32))
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    # A new key each step: a new mask, no new compilation.
    other = loss(q, k, v, jax.random.key(8))
    assert float(other) != float(value)
    assert loss._cache_size() == 1
    with pytest.raises(ValueError, match="needs dropout_rng"):
        cuflash_jax.attention(q, k, v, dropout_p=0.25)
