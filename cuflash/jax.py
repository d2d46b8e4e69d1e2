"""JAX integration: ``attention`` with a ``jax.custom_vjp`` whose backward is
cuflash's backward kernel.

Eager only: the kernels take concrete arrays through DLPack, so under
``jax.jit`` (or any other tracing) the call raises a ``TypeError`` saying so.
``jax.grad`` / ``jax.value_and_grad`` of eager code work. Importing this
module imports JAX; ``import cuflash`` alone never does.
"""

from __future__ import annotations

from functools import partial

import jax

from . import api

__all__ = ["attention"]


def attention(q, k, v, *, causal=False, softmax_scale=None):
    """Differentiable ``cuflash.attention`` for concrete JAX arrays.

    q: (batch, seqlen_q, nheads, head_dim); k, v: (batch, seqlen_k, nheads_k,
    head_dim), nheads_k dividing nheads. Causal masking is bottom-right
    aligned. Returns the output (batch, seqlen_q, nheads, head_dim).
    """
    return _attention(q, k, v, bool(causal), softmax_scale)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, causal, softmax_scale):
    return api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)


def _attention_fwd(q, k, v, causal, softmax_scale):
    out, lse = api.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
    return out, (q, k, v, out, lse)


def _attention_bwd(causal, softmax_scale, residuals, dout):
    q, k, v, out, lse = residuals
    return api.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


_attention.defvjp(_attention_fwd, _attention_bwd)
