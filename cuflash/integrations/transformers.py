"""cuflash as a Hugging Face ``transformers`` attention implementation.

    import cuflash.integrations.transformers as cuflash_hf
    name = cuflash_hf.register()            # "cufa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

``register`` adds cuflash to transformers' attention-function registry
(``AttentionInterface``) and gives it FlashAttention's mask convention
(``AttentionMaskInterface``): the model hands the attention a 2-D padding
mask (batch, kv_len), or None where no token is padded. Each call receives
query (batch, heads, q_len, head_dim) and key/value (batch, kv_heads,
kv_len, head_dim) after the KV-cache update and runs:

- no mask: ``cuflash.torch.flash_attn_func`` on transposed views (no copy);
- a padding mask (left or right padding, generation with a cache):
  the real tokens gathered into a packed batch, ``flash_attn_varlen_func``,
  the output scattered back (padded query rows get zeros);
- packed sequences, given as transformers' ``cu_seq_lens_q``/``cu_seq_lens_k``
  and ``max_length_q``/``max_length_k`` keyword arguments, or as position ids
  that restart at 0 within one row: ``flash_attn_varlen_func``.

Causal masks are bottom-right aligned per sequence, as FlashAttention's and
as a cache's new tokens need; a layer's ``sliding_window`` (Mistral, Gemma 2)
becomes a window of that many keys ending at each query's own, and
``softcap`` (Gemma 2) caps the scores, as the model's ``sdpa`` attention
does; attention dropout in training drops probabilities with cuflash's own
mask. Both paths are differentiable. Not supported (``NotImplementedError``):
attention sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import torch as cuflash_torch

#: The name ``register`` uses by default. Not "cuflash": transformers takes
#: any implementation name containing "flash" for a FlashAttention build or
#: hub kernel and tries to import one (utils.generic.is_flash_attention_requested).
NAME = "cufa"


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("cuflash.integrations.transformers needs the transformers package "
                          "(pip install 'transformers>=5')") from exc
    return AttentionInterface, AttentionMaskInterface, flash_attention_mask


def register(name: str = NAME) -> str:
    """Registers cuflash with transformers under ``name`` and returns it,
    for ``attn_implementation=name``. A name containing "flash" is refused
    (transformers would look for a FlashAttention kernel by it)."""
    if "flash" in name:
        raise ValueError(f"name must not contain 'flash' (transformers then imports a FlashAttention kernel "
                         f"under that name), got {name!r}")
    attention_interface, mask_interface, flash_mask = _transformers()
    attention_interface.register(name, attention_forward)
    mask_interface.register(name, flash_mask)
    return name


def _refuse_unsupported(s_aux) -> None:
    if s_aux is not None:
        raise NotImplementedError("cuflash's transformers attention does not support attention sinks (s_aux) yet "
                                  "(use attn_implementation='sdpa' for this model)")


def _lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def _packed_from_positions(position_ids: torch.Tensor | None, batch: int, q_len: int, kv_len: int):
    """(cu_seqlens, longest) of sequences packed in one row whose position ids
    restart at 0 (transformers' flattening collator), or None."""
    if position_ids is None or batch != 1 or q_len != kv_len or q_len < 2:
        return None
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    if starts.numel() <= 1 and int(positions[0]) == 0:
        return None  # one sequence
    if starts.numel() == 0 or int(starts[0]) != 0:
        return None  # not a packed batch from its start (a cache continuation)
    offsets = torch.cat([starts, torch.tensor([q_len], device=starts.device)]).to(torch.int32)
    return offsets, int((offsets[1:] - offsets[:-1]).max())


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      s_aux: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function contract: query (batch, heads,
    q_len, head_dim), key/value (batch, kv_heads, kv_len, head_dim), a 2-D
    padding mask or None; returns (output (batch, q_len, heads, head_dim), None)."""
    _refuse_unsupported(s_aux)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (batch, len, heads, dim) views
    batch, q_len, heads, dim = q.shape
    kv_len = k.shape[1]
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"cuflash's transformers attention takes a 2-D padding mask, got one of shape "
                                  f"{tuple(attention_mask.shape)}")
    # transformers' sliding window: query i sees keys i - sliding_window + 1 .. i.
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    # Attention dropout as the model passes it (0 outside training), as
    # transformers' FlashAttention path applies it; the mask is drawn from PyTorch's CUDA generator.
    varlen = dict(causal=causal, softmax_scale=scaling, window_size=window, softcap=softcap or 0.0,
                  dropout_p=float(dropout or 0.0))
    if attention_mask is not None:
        keys_kept = attention_mask[:, -kv_len:].bool()
        queries_kept = keys_kept[:, -q_len:]
        rows_k = torch.nonzero(keys_kept.reshape(-1)).reshape(-1)
        rows_q = torch.nonzero(queries_kept.reshape(-1)).reshape(-1)
        lengths_k, lengths_q = keys_kept.sum(1), queries_kept.sum(1)
        packed = cuflash_torch.flash_attn_varlen_func(
            q.reshape(batch * q_len, heads, dim)[rows_q], k.reshape(batch * kv_len, -1, dim)[rows_k],
            v.reshape(batch * kv_len, -1, dim)[rows_k], _lengths_to_offsets(lengths_q),
            _lengths_to_offsets(lengths_k), int(lengths_q.max()), int(lengths_k.max()), **varlen)
        out = packed.new_zeros(batch * q_len, heads, dim).index_copy(0, rows_q, packed)
        return out.reshape(batch, q_len, heads, dim), None
    offsets = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(x is not None for x in offsets):
        cu_q, cu_k, max_q, max_k = offsets
    else:
        found = _packed_from_positions(kwargs.get("position_ids"), batch, q_len, kv_len)
        if found is None:
            return cuflash_torch.flash_attn_func(q, k, v, **varlen), None
        cu_q, max_q = found
        cu_k, max_k = found
    out = cuflash_torch.flash_attn_varlen_func(
        q.reshape(batch * q_len, heads, dim), k.reshape(batch * kv_len, -1, dim), v.reshape(batch * kv_len, -1, dim),
        cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), **varlen)
    return out.reshape(batch, q_len, heads, dim), None
