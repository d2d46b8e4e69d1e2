"""The transformers integration's glue without a GPU: cuflash's two PyTorch
entry points replaced by a float64 CPU stand-in with their contract
(bottom-right causal, GQA, packed sequences, sliding windows, soft caps:
cuflash's float64 reference), so that layouts, unpadding, scattering back,
packed-sequence offsets, the window and cap mapping and refusals are checked
against transformers' own ``sdpa`` implementation."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import cuflash.torch as cuflash_torch  # noqa: E402
import cuflash.integrations.transformers as cuflash_hf  # noqa: E402
from cuflash.reference import attention_reference  # noqa: E402

from tests.transformers_models import (CONFIGS, FLOAT64_TOLERANCE, left_padded_batch, model_pair,  # noqa: E402
                                      reference_generation, reference_logits)


def _attention(q, k, v, **options):
    """(len_q, heads, dim) against (len_k, kv_heads, dim), float64, through
    cuflash's reference (bottom-right causal, windows, soft caps)."""
    out, _ = attention_reference(*(x.detach().double().numpy()[None] for x in (q, k, v)), **options)
    return torch.from_numpy(out[0]).to(q.dtype)


dropouts = []


def _dense(q, k, v, dropout_p=0.0, **options):
    dropouts.append(dropout_p)
    return torch.stack([_attention(q[b], k[b], v[b], **options) for b in range(q.shape[0])])


calls = []


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, **options):
    calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
    dropouts.append(dropout_p)
    out = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop > rows.start:
            out[rows] = _attention(q[rows], k[keys], v[keys], **options)
    return out


@pytest.fixture(autouse=True)
def cpu_stand_in(monkeypatch):
    monkeypatch.setattr(cuflash_torch, "flash_attn_func", _dense)
    monkeypatch.setattr(cuflash_torch, "flash_attn_varlen_func", _varlen)
    calls.clear()
    dropouts.clear()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_sdpa_with_and_without_padding(name):
    reference, ours = model_pair(name, dtype=torch.float64)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        full_ref, full = reference(ids).logits, ours(ids).logits
        padded_ref, padded = reference_logits(name, reference, ids, mask), ours(ids, attention_mask=mask).logits
    atol = FLOAT64_TOLERANCE.get(name, 1e-9)
    assert torch.allclose(full, full_ref, atol=atol)
    kept = mask.bool()
    assert torch.allclose(padded[kept], padded_ref, atol=atol)
    # the padded rows went through the packed path: three sequences of 12, 7 and 3 tokens
    assert ([0, 12, 19, 22], [0, 12, 19, 22], 12, 12) in calls


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_with_a_cache_matches_sdpa(name):
    reference, ours = model_pair(name, dtype=torch.float64)
    ids, mask = left_padded_batch()
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = reference_generation(name, reference, ids, mask, **settings)
        generated = ours.generate(ids, attention_mask=mask, **settings)
    assert torch.equal(generated, expected)
    # decoding steps: one query row per sequence against its cached keys
    assert any(cu_q == [0, 1, 2, 3] for cu_q, *_ in calls)


def test_packed_sequences_from_position_ids_and_from_offsets():
    reference, ours = model_pair("llama-gqa", dtype=torch.float64)
    lengths = [5, 9, 2]
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(ids, position_ids=positions).logits
        alone = [reference(ids[:, start:start + n]).logits
                 for start, n in zip([0, 5, 14], lengths)]
    assert torch.allclose(packed, torch.cat(alone, dim=1), atol=1e-9)
    assert ([0, 5, 14, 16], [0, 5, 14, 16], 9, 9) in calls


def test_attention_dropout_reaches_the_kernels_as_the_model_passes_it():
    """transformers passes the layer's attention dropout in training and 0 in
    evaluation; both paths (dense and padded) hand it on as dropout_p."""
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.zeros(2, 2, 3, 8)
    cuflash_hf.attention_forward(module, q, q, q, None, dropout=0.1)
    cuflash_hf.attention_forward(module, q, q, q, torch.ones(2, 3, dtype=torch.long), dropout=0.25)
    cuflash_hf.attention_forward(module, q, q, q, None)
    assert dropouts == [0.1, 0.25, 0.0]


def test_unsupported_options_are_refused():
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        cuflash_hf.attention_forward(module, q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(NotImplementedError, match="2-D padding mask"):
        cuflash_hf.attention_forward(module, q, q, q, torch.ones(1, 1, 3, 3), dropout=0.0)
