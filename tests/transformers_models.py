"""Small random-weight transformers models (nothing downloaded) for the
cuflash integration's tests: a Llama-style one with grouped-query attention,
a Gemma-style one with multi-query attention and head_dim 64, a
Mistral-style one with a sliding window and a Gemma-2-style one with soft
capping and sliding-window layers (windows shorter than the test sequences,
caps low enough to bend the scores), each built twice with the same weights,
on transformers' reference implementation and on cuflash. The reference is
``sdpa``, and ``eager`` for Gemma 2 (transformers gives soft-capped models
no sdpa path)."""

import pytest

CONFIGS = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "gemma-mqa": ("GemmaConfig", "GemmaForCausalLM",
                  dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM",
                       dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                            max_position_embeddings=256)),
    "gemma2-softcap": ("Gemma2Config", "Gemma2ForCausalLM",
                       dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                            attn_logit_softcapping=2.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                            max_position_embeddings=256)),
}


#: The implementation cuflash is compared with, where it is not "sdpa".
REFERENCE_IMPLEMENTATION = {"gemma2-softcap": "eager"}
#: How close float64 logits of the two implementations are: eager attention
#: takes its softmax in float32.
FLOAT64_TOLERANCE = {"gemma2-softcap": 1e-6}


def model_pair(name: str, *, device="cpu", dtype=None, seed=0):
    """(reference model, cuflash model) with the same random weights, in
    eval mode (the reference: ``REFERENCE_IMPLEMENTATION``, else sdpa)."""
    transformers = pytest.importorskip("transformers")
    import torch

    import cuflash.integrations.transformers as cuflash_hf

    config_name, model_name, fields = CONFIGS[name]
    torch.manual_seed(seed)
    models = []
    for implementation in (REFERENCE_IMPLEMENTATION.get(name, "sdpa"), cuflash_hf.register()):
        config = getattr(transformers, config_name)(**fields)
        model = getattr(transformers, model_name)._from_config(config, attn_implementation=implementation)
        models.append(model)
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        model.to(device=device, dtype=dtype).eval()
    return models


def left_padded_batch(device="cpu", seed=1):
    """input_ids (3, 12) with 0, 5 and 9 pad tokens on the left, and their mask."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (3, 12), generator=generator)
    mask = torch.ones_like(ids)
    for row, pads in enumerate((0, 5, 9)):
        mask[row, :pads] = 0
        ids[row, :pads] = 0
    return ids.to(device), mask.to(device)


def reference_logits(name: str, reference, ids, mask):
    """The reference model's logits of a left-padded batch at its kept
    tokens (kept_tokens, vocab). The eager reference (Gemma 2) turns the
    rows of a left-padded batch to NaN (a sliding window that holds only
    padding), so its rows run one at a time without their padding; sdpa
    takes the batch as it is."""
    import torch

    kept = mask.bool()
    if name not in REFERENCE_IMPLEMENTATION:
        return reference(ids, attention_mask=mask).logits[kept]
    return torch.cat([reference(row[keep][None]).logits[0] for row, keep in zip(ids, kept)])


def reference_generation(name: str, reference, ids, mask, **settings):
    """Greedy tokens of the reference model for a left-padded batch, its
    eager rows one at a time without their padding, padded back (as
    ``reference_logits``)."""
    import torch

    if name not in REFERENCE_IMPLEMENTATION:
        return reference.generate(ids, attention_mask=mask, **settings)
    rows = []
    for row, kept in zip(ids, mask.bool()):
        alone = reference.generate(row[kept][None], **settings)[0]
        rows.append(torch.cat([row[~kept], alone]))
    return torch.stack(rows)
