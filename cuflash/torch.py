"""PyTorch integration: differentiable attention, and drop-in replacements
for ``torch.nn.functional.scaled_dot_product_attention`` and
``flash_attn.flash_attn_func``.

Two routes to the same kernels, with identical results and gradients:
eager calls go through a plain ``torch.autograd.Function`` (the cheaper one
on the host: no dispatcher round trip, no schema parsing), and under
``torch.compile`` the call is a ``torch.library`` custom op with a fake
(meta) implementation, so ``torch.compile(fullgraph=True)`` traces through
it. ``EAGER_ROUTE`` names the eager one ("function" or "custom_op");
``tools/bench.py`` measures both.

Importing this module imports PyTorch; ``import cuflash`` alone never does.
Kernels run on PyTorch's current stream; outputs and work buffers come from
PyTorch's caching allocator, so CUDA graph capture works (after one warm-up
call has compiled the kernels).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch

from . import api
from ._interop import dense_strides_like, torch_device_error
from ._validation import (check_causal, check_deterministic, check_dropout_p, check_dropout_seed,
                          check_fp32_precision, check_softcap, check_window, resolve_softmax_scale)

__all__ = ["attention", "scaled_dot_product_attention", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache"]


# The variants travel through the custom ops as plain values (the schema
# takes no tuples of mixed types): the window's sides, the soft cap, the
# slopes or None.
@torch.library.custom_op("cuflash::attention_forward", mutates_args=(), device_types="cuda")
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                dropout_p: float, dropout_seed: int, dropout_offset: int, deterministic: bool,
                fp32_precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); ``deterministic`` is only carried to the backward."""
    return api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
                         softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                         dropout_offset=dropout_offset, return_lse=True, fp32_precision=fp32_precision)


@_forward_op.register_fake
def _forward_fake(q, k, v, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
                  dropout_seed, dropout_offset, deterministic, fp32_precision):
    batch, seqlen_q, nheads, _ = q.shape
    # The real op lays out out like q (see cuflash._interop.dense_strides_like)
    # and returns a C-contiguous log-sum-exp.
    return _empty_like_layout(q), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


def _empty_like_layout(x):
    return x.new_empty_strided(x.shape, dense_strides_like(tuple(x.shape), tuple(x.stride())))


def _contiguous_gradient(dout):
    # Autograd can hand over an expanded gradient (stride 0 everywhere, from
    # a .sum()); the kernels need a contiguous last dimension.
    return dout.contiguous() if dout.shape[-1] > 1 and dout.stride(-1) != 1 else dout


@torch.library.custom_op("cuflash::attention_backward", mutates_args=(), device_types="cuda")
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int,
                 softcap: float, alibi_slopes: Optional[torch.Tensor], dropout_p: float, dropout_seed: int,
                 dropout_offset: int, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return api.attention_backward(_contiguous_gradient(dout), q, k, v, out, lse, causal=causal,
                                  softmax_scale=softmax_scale, window_size=(window_left, window_right),
                                  softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                  dropout_seed=dropout_seed, dropout_offset=dropout_offset,
                                  deterministic=deterministic)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap, alibi_slopes,
                   dropout_p, dropout_seed, dropout_offset, deterministic):
    return _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *flags, alibi_slopes, dropout_p, dropout_seed, dropout_offset, deterministic, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.flags, ctx.alibi_slopes, ctx.deterministic = tuple(flags), alibi_slopes, deterministic
    ctx.dropout = (dropout_p, dropout_seed, dropout_offset)


def _backward(ctx, dout, dlse):
    # The log-sum-exp is an auxiliary output that the public functions never
    # return, so no gradient flows into it (dlse is None or zero).
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.cuflash.attention_backward(dout, q, k, v, out, lse, *ctx.flags, ctx.alibi_slopes,
                                                      *ctx.dropout, ctx.deterministic)
    return dq, dk, dv, *(None,) * 11


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """The eager route: cuflash's forward, and its backward from the saved
    inputs, output and log-sum-exp. ``variants``: ``Variants`` (the slopes
    and dropout's seed among them; not differentiated). ``heads_first``:
    q, k, v and the output in SDPA's (batch, heads, seqlen, dim) layout
    (``cuflash.attention``'s option), so that the graph holds this one node
    and no transposes (four around it would add four nodes to every
    backward)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, variants, deterministic, fp32_precision, heads_first):
        if variants is _NO_VARIANTS:
            out, lse, call = api.forward_plain(q, k, v, causal, softmax_scale, fp32_precision, heads_first)
        else:
            arrays, call = api._attention(q, k, v, causal, softmax_scale, *variants.values(), True, None, None,
                                          fp32_precision, None, heads_first)
            out, lse = arrays[3], arrays[4]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        ctx.variants, ctx.heads_first = variants, heads_first
        ctx.saved_forward = _SavedForward(call, q, k, v, out, lse) if call is not None and variants.plain else None
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():  # create_graph=True: say that there is no second derivative
            return _backward_once(ctx, dout)
        return _attention_backward(ctx, dout)


class _SavedForward:
    """What a backward needs to follow its forward's cached call
    (``cuflash.api.backward_following``): that call, and how to tell that
    the saved tensors autograd hands back are the forward's own. Unpacked
    without saved-tensor hooks, q, k, v and lse (saved as they are: inputs
    and an intermediate) are the very objects saved, and out (an output,
    unpacked as a new tensor) has its layout; a hook (``save_on_cpu``,
    checkpointing) may return others, of other layouts, and then the
    backward takes ``attention_backward``'s path. Weak references: the ctx
    must not keep the forward's tensors alive past what autograd saves."""

    __slots__ = ("call", "q", "k", "v", "lse", "out_layout")

    def __init__(self, call, q, k, v, out, lse):
        self.call = call
        self.q, self.k, self.v, self.lse = weakref.ref(q), weakref.ref(k), weakref.ref(v), weakref.ref(lse)
        self.out_layout = (out.size(), out.stride())

    def holds(self, q, k, v, out, lse) -> bool:
        return (q is self.q() and k is self.k() and v is self.v() and lse is self.lse()
                and (out.size(), out.stride()) == self.out_layout)


def _attention_backward(ctx, dout):
    # The gradients are made like q, k and v (dense, their dimensions in the
    # same order): autograd takes them as the leaves' gradients without a copy.
    q, k, v, out, lse = ctx.saved_tensors
    forward = ctx.saved_forward
    if forward is not None and forward.holds(q, k, v, out, lse):
        # A remembered backward serves only a dout of a signature made
        # contiguous before (strides are part of it): it needs no check here.
        gradients = api.followed_backward(forward.call, dout, q, k, v, out, lse, ctx.deterministic)
        if gradients is not None:
            return (*gradients, None, None, None, None, None, None)
        variants = ctx.variants
        dq, dk, dv = api.backward_following(forward.call, _contiguous_gradient(dout), q, k, v, out, lse,
                                            causal=ctx.causal, softmax_scale=ctx.softmax_scale,
                                            window_size=variants.window_size, softcap=variants.softcap,
                                            deterministic=ctx.deterministic, heads_first=ctx.heads_first)
    else:
        dq, dk, dv = api.attention_backward(_contiguous_gradient(dout), q, k, v, out, lse, causal=ctx.causal,
                                            softmax_scale=ctx.softmax_scale, **_variant_kwargs(ctx.variants),
                                            deterministic=ctx.deterministic, heads_first=ctx.heads_first)
    return dq, dk, dv, None, None, None, None, None, None


#: The backward under ``create_graph=True``: its results carry an error for
#: anyone differentiating them again (PyTorch's ``once_differentiable``,
#: whose wrapper costs host time every call, so only taken there).
_backward_once = torch.autograd.function.once_differentiable(_attention_backward)


def _apply_attention(q, k, v, *args):
    """``_AttentionFunction.apply`` at less host cost: PyTorch's
    ``Function.apply`` binds default arguments by signature (which
    ``forward`` has none of) and checks for functorch transforms on every
    call; without an active transform, the C++ apply it ends in is called
    directly, after the same unwrapping of dead functorch wrappers."""
    if _unwrap_if_dead is None or _transforms_active():
        return _AttentionFunction.apply(q, k, v, *args)
    unwrap = _unwrap_if_dead
    return _raw_apply(unwrap(q), unwrap(k), unwrap(v), *args)


_raw_apply = super(torch.autograd.Function, _AttentionFunction).apply
# PyTorch's private hooks that Function.apply itself calls; where a PyTorch
# version lacks one, every call takes the public apply.
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
if _transforms_active is None:
    _unwrap_if_dead = None


#: How eager calls reach the kernels: "function" (``torch.autograd.Function``)
#: or "custom_op" (the ``torch.library`` op that ``torch.compile`` traces).
#: Both give identical results; "function" costs less host time per call
#: (tools/bench.py's host-overhead table measures both).
EAGER_ROUTE = "function"


def _variant_kwargs(variants: api.Variants) -> dict:
    """The variants as keyword arguments of the API's calls (mask_mod only
    where given: the variable-length calls take none); for the common call
    without variants, a dict made once (read-only: callers only unpack it)."""
    if variants is _NO_VARIANTS:
        return _NO_VARIANT_KWARGS
    return _keyword_arguments(variants)


def _keyword_arguments(variants: api.Variants) -> dict:
    kwargs = dict(window_size=variants.window_size, softcap=variants.softcap, alibi_slopes=variants.alibi_slopes,
                  dropout_p=variants.dropout_p, dropout_seed=variants.dropout_seed,
                  dropout_offset=variants.dropout_offset, score_mod=variants.score_mod,
                  mod_arrays=variants.mod_arrays)
    if variants.mask_mod is not None:
        kwargs["mask_mod"] = variants.mask_mod
    return kwargs


#: No window, soft cap, ALiBi or dropout; and as keyword arguments, made once.
_NO_VARIANTS = api.Variants()
_NO_VARIANT_KWARGS = _keyword_arguments(_NO_VARIANTS)


def _variants(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None,
              dropout_offset=0, score_mod=None, mod_arrays=None, mask_mod=None) -> api.Variants:
    """``api.Variants`` of a call's options: ``_NO_VARIANTS`` itself where
    they are all defaults (``api.plain_options``), so that the
    differentiable route's forward reads only three signatures
    (api.forward_plain)."""
    if api.plain_options(window_size, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset, score_mod,
                         mod_arrays, mask_mod):
        return _NO_VARIANTS
    return api.Variants(window_size, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset, score_mod,
                        mod_arrays, mask_mod)


def dropout_seed_and_offset(device, generator: torch.Generator | None = None) -> tuple[int, int]:
    """A fresh (seed, offset) for one call's dropout mask, from ``generator``
    or the default CUDA generator of ``device``, as FlashAttention-2 takes
    them: the generator's seed and its Philox offset, which is then moved on
    (so ``torch.manual_seed`` makes runs repeatable and every call draws a
    new mask). A CPU generator gives a random seed instead."""
    if generator is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # PyTorch's CUDA offsets advance in steps of 4
        return generator.initial_seed() % (1 << 63), offset
    return int(torch.randint(0, 1 << 62, (), generator=generator)), 0


def _resolved(variants: api.Variants, q, generator=None) -> api.Variants:
    """``variants`` with a seed drawn for dropout where none was given (from
    ``generator``, or the CUDA generator of q's device)."""
    if variants.dropout_seed is not None or variants.dropout_p.__class__ is float and variants.dropout_p == 0.0:
        return variants
    if check_dropout_p(variants.dropout_p) == 0.0:
        return variants
    _check_cuda_tensors(("q",), (q,))
    seed, offset = dropout_seed_and_offset(q.device, generator)
    return dataclasses.replace(variants, dropout_seed=seed, dropout_offset=offset)


def _forward(q, k, v, causal, softmax_scale, deterministic=False, route=None, fp32_precision="ieee",
             variants=_NO_VARIANTS, generator=None, heads_first=False):
    """``variants``: ``cuflash.api.Variants``; dropout without a seed draws
    one from ``generator`` (``dropout_seed_and_offset``). ``heads_first``:
    q, k, v and the result in SDPA's (batch, heads, seqlen, dim) layout."""
    if deterministic.__class__ is not bool:
        deterministic = check_deterministic(deterministic)
    route = route or EAGER_ROUTE
    if route == "custom_op" or torch.compiler.is_compiling():
        if variants.score_mod is not None or variants.mask_mod is not None:
            raise NotImplementedError("score_mod and mask_mod are not traced through torch.compile's custom op "
                                      "yet: call cuflash.torch.attention eagerly (outside torch.compile) with them")
        _check_cuda_tensors(("q", "k", "v", "alibi_slopes"), (q, k, v, variants.alibi_slopes))
        if heads_first:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        variants = _resolved(variants, q, generator)
        scale = resolve_softmax_scale(softmax_scale, q.shape[-1] or 1)
        dropout_p = check_dropout_p(variants.dropout_p)
        seed, offset = check_dropout_seed(dropout_p, variants.dropout_seed, variants.dropout_offset)
        out = torch.ops.cuflash.attention_forward(
            q, k, v, check_causal(causal), scale, *check_window(variants.window_size), check_softcap(variants.softcap),
            variants.alibi_slopes, dropout_p, seed, offset, deterministic, check_fp32_precision(fp32_precision))[0]
        return out.transpose(1, 2) if heads_first else out
    if variants is not _NO_VARIANTS:
        variants = _resolved(variants, q, generator)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _apply_attention(q, k, v, causal, softmax_scale, variants, deterministic, fp32_precision, heads_first)
    if variants is _NO_VARIANTS:  # a plan fixed by q, k, v and the flags (api.forward_plain)
        return api.forward_plain(q, k, v, causal, softmax_scale, fp32_precision, heads_first, False)[0]
    return api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, **_variant_kwargs(variants),
                         fp32_precision=fp32_precision, heads_first=heads_first)


def _float32_precision_of_torch() -> str:
    """The float32 arithmetic the drop-ins use: 3xTF32 where the user has
    let PyTorch's float32 matmuls use TF32 (``torch.set_float32_matmul_precision``
    "high" or "medium": 3xTF32 is more accurate than either allows), the
    exact path at "highest" (PyTorch's default)."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "3xtf32"


def _check_cuda_tensors(names: tuple[str, ...], tensors: tuple) -> None:
    """The custom op dispatches on the device: check first, so that a tensor
    outside GPU memory gets ``cuflash.attention``'s one-line ``TypeError``
    naming the caller's argument (``names``), not the dispatcher's
    NotImplementedError. Meta tensors pass (tracing)."""
    for name, tensor in zip(names, tensors):
        if isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cuda", "meta"):
            raise torch_device_error(name, tensor)


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, dropout_seed=None, dropout_offset=0, generator=None, score_mod=None, mask_mod=None,
              mod_arrays=None, deterministic=False, fp32_precision="ieee"):
    """Differentiable ``cuflash.attention`` for PyTorch tensors.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k,
    head_dim), nheads_k dividing nheads. Causal masking is bottom-right
    aligned (FlashAttention-2). ``window_size``, ``softcap``,
    ``alibi_slopes`` ((nheads,) or (batch, nheads) float32 CUDA tensor, not
    differentiated) and ``fp32_precision`` as for ``cuflash.attention``
    (float32 forward; the backward is exact float32); ``deterministic`` as
    for ``cuflash.attention_backward``. ``dropout_p``: dropout of the
    attention probabilities, its mask fixed by ``dropout_seed`` and
    ``dropout_offset`` where given, else drawn from ``generator`` (default:
    the CUDA generator of q's device, as FlashAttention-2 does), and saved
    for the backward. ``score_mod``, ``mask_mod``, ``mod_arrays``: a user
    score function, a user mask (a function or a ``cuflash.BlockMask``) and
    the CUDA tensors they read (``cuflash.mods``; not differentiated; eager
    calls only). Returns the output (batch, seqlen_q, nheads,
    head_dim); gradients flow to q, k and v through cuflash's backward.
    """
    return _forward(q, k, v, causal, softmax_scale, deterministic, fp32_precision=fp32_precision,
                    variants=_variants(window_size, softcap, alibi_slopes, dropout_p, dropout_seed, dropout_offset,
                                       score_mod, mod_arrays, mask_mod), generator=generator)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on
    (batch, heads, seqlen, dim) CUDA tensors: the layout change is a view,
    no copy. float32 inputs take 3xTF32 where ``torch.get_float32_matmul_precision()``
    allows TF32 ("high", "medium"), the exact path at "highest". ``dropout_p``
    drops attention weights as SDPA does (cuflash's own mask, drawn from
    PyTorch's CUDA generator: not the same entries as SDPA's). Not supported
    yet (``NotImplementedError``): ``attn_mask``, and
    ``is_causal`` with seqlen_q != seqlen_k (PyTorch aligns that mask to the
    top-left corner, cuflash to the bottom-right). A tensor outside GPU
    memory raises ``cuflash.attention``'s ``TypeError``, naming ``query``,
    ``key`` or ``value``."""
    if attn_mask is not None:
        raise NotImplementedError("cuflash.torch.scaled_dot_product_attention does not support attn_mask yet")
    if not (query.is_cuda and key.is_cuda and value.is_cuda):
        _check_cuda_tensors(("query", "key", "value"), (query, key, value))
    # Each shape read once: inside a training step every accessor call costs.
    query_shape, key_shape = query.shape, key.shape
    if len(query_shape) != 4 or len(key_shape) != 4 or value.dim() != 4:
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if tensor.dim() != 4:
                raise ValueError(f"{name} must be (batch, heads, seqlen, dim), got shape {tuple(tensor.shape)}")
    if key_shape[1] != query_shape[1] and not enable_gqa:
        raise ValueError(
            f"key has {key_shape[1]} heads but query has {query_shape[1]}; pass enable_gqa=True for "
            "grouped-query attention"
        )
    if is_causal and query_shape[2] != key_shape[2]:
        raise NotImplementedError(
            "is_causal with different query and key lengths: PyTorch's SDPA aligns the mask to the top-left "
            "corner, cuflash to the bottom-right; use cuflash.torch.attention(causal=True) for the latter"
        )
    precision = _float32_precision_of_torch() if query.dtype == torch.float32 else "ieee"
    variants = _variants(dropout_p=dropout_p)
    return _forward(query, key, value, is_causal, scale, fp32_precision=precision, variants=variants,
                    heads_first=True)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Drop-in for ``flash_attn.flash_attn_func`` (FlashAttention-2): q
    (batch, seqlen_q, nheads, head_dim), k and v (batch, seqlen_k, nheads_k,
    head_dim), bottom-right causal alignment, ``deterministic`` for a
    bitwise-repeatable backward, sliding windows (``window_size``), soft
    capping (``softcap``), ALiBi (``alibi_slopes``) and dropout (``dropout_p``,
    its mask drawn from PyTorch's CUDA generator as FlashAttention-2 draws
    its own: same distribution, not the same entries) with
    FlashAttention-2's semantics. Not supported yet
    (``NotImplementedError``): ``return_attn_probs``."""
    _refuse_unsupported("flash_attn_func", return_attn_probs)
    return _forward(q, k, v, causal, softmax_scale, deterministic,
                    variants=_variants(window_size, softcap, alibi_slopes, dropout_p))


def _refuse_unsupported(function: str, return_attn_probs, block_table=None) -> None:
    """``NotImplementedError`` naming every FlashAttention-2 option a drop-in was given that cuflash lacks."""
    unsupported = []
    if return_attn_probs:
        unsupported.append("return_attn_probs=True")
    if block_table is not None:
        unsupported.append("block_table")
    if unsupported:
        raise NotImplementedError(f"cuflash.torch.{function} does not support {', '.join(unsupported)} yet")


class _VarlenAttentionFunction(torch.autograd.Function):
    """``cuflash.attention_varlen`` and its backward from the saved inputs,
    output and log-sum-exp (the offsets are not differentiated)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                variants, deterministic):
        out, lse = api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        causal=causal, softmax_scale=softmax_scale, **_variant_kwargs(variants),
                                        return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.lengths = (max_seqlen_q, max_seqlen_k)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        ctx.variants = variants
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = api.attention_varlen_backward(_contiguous_gradient(dout), q, k, v, out, lse, cu_seqlens_q,
                                                   cu_seqlens_k, *ctx.lengths, causal=ctx.causal,
                                                   softmax_scale=ctx.softmax_scale, **_variant_kwargs(ctx.variants),
                                                   deterministic=ctx.deterministic)
        return dq, dk, dv, *(None,) * 8


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Drop-in for ``flash_attn.flash_attn_varlen_func`` (FlashAttention-2):
    packed q (total_q, nheads, head_dim), k and v (total_k, nheads_k,
    head_dim), int32 ``cu_seqlens_q``/``cu_seqlens_k`` (batch + 1) on the GPU
    and the longest lengths, as for ``cuflash.attention_varlen``;
    differentiable (gradients to q, k and v); windows, soft capping, ALiBi
    and dropout as in ``flash_attn_func`` (sequence b's mask that of batch
    entry b). Not supported yet (``NotImplementedError``):
    ``return_attn_probs``, ``block_table``."""
    _refuse_unsupported("flash_attn_varlen_func", return_attn_probs, block_table)
    if deterministic.__class__ is not bool:
        deterministic = check_deterministic(deterministic)
    variants = _resolved(api.Variants(window_size, softcap, alibi_slopes, dropout_p), q)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenAttentionFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal, softmax_scale, variants, deterministic)
    return api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, **_variant_kwargs(variants))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Drop-in for ``flash_attn.flash_attn_with_kvcache`` (FlashAttention-2),
    as ``cuflash.attention_with_kvcache``: q (batch, seqlen_q, nheads,
    head_dim); a contiguous (batch, seqlen_cache, nheads_k, head_dim) or, with
    ``block_table`` (batch, max_pages) int32, paged (num_pages, page_size,
    nheads_k, head_dim) cache of any page size; ``k``/``v`` (batch,
    seqlen_new, nheads_k, head_dim) appended at ``cache_seqlens`` (an int or
    a (batch,) int32 tensor) in place; ``num_splits`` 0 chooses. Inference
    only (no autograd); windows, soft capping and ALiBi as in
    ``flash_attn_func``. Not supported yet (``NotImplementedError``): rotary
    embeddings, ``cache_batch_idx``, ``cache_leftpad``."""
    unsupported = [name for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                                            ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad))
                   if value is not None]
    if unsupported:
        raise NotImplementedError(f"cuflash.torch.flash_attn_with_kvcache does not support {', '.join(unsupported)} "
                                  f"yet")
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype != torch.int32:
        cache_seqlens = cache_seqlens.to(torch.int32)  # FlashAttention-2 takes int32 only; int64 is common
    return api.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                      block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                      window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                      return_lse=return_softmax_lse, num_splits=num_splits or None)
