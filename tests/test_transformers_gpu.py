"""The transformers integration on the GPU with the real kernels: small
random-weight Llama-style (GQA), Gemma-style (MQA, head_dim 64),
Mistral-style (sliding window) and Gemma-2-style (soft cap, sliding-window
layers) models on cuflash against the same weights on transformers'
``sdpa`` (``eager`` for Gemma 2): logits with and without left padding,
packed sequences, greedy generation with the KV cache, and a few training
steps."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.transformers_models import (CONFIGS, REFERENCE_IMPLEMENTATION, left_padded_batch, model_pair,  # noqa: E402
                                      reference_generation, reference_logits)

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return "cuda"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_sdpa(name):
    """float32: within 1e-4 of sdpa; bfloat16: error against the float32
    sdpa logits at most 2x sdpa's own bfloat16 error (plus 1e-2)."""
    device = _cuda()
    ids, mask = left_padded_batch(device)
    kept = mask.bool()
    reference, ours = model_pair(name, device=device, dtype=torch.float32)
    with torch.no_grad():
        exact = reference_logits(name, reference, ids, mask)  # the kept tokens'
        assert (ours(ids, attention_mask=mask).logits[kept] - exact).abs().max() < 1e-4
        assert (ours(ids).logits - reference(ids).logits).abs().max() < 1e-4
    reference, ours = model_pair(name, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ours_error = (ours(ids, attention_mask=mask).logits[kept].float() - exact).abs().max()
        sdpa_error = (reference_logits(name, reference, ids, mask).float() - exact).abs().max()
    assert ours_error <= 2 * sdpa_error + 1e-2, (float(ours_error), float(sdpa_error))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_sdpa(name):
    device = _cuda()
    reference, ours = model_pair(name, device=device, dtype=torch.float32)
    ids, mask = left_padded_batch(device)
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, attention_mask=mask, **settings),
                           reference_generation(name, reference, ids, mask, **settings))


def test_packed_sequences_match_separate_ones():
    device = _cuda()
    reference, ours = model_pair("llama-gqa", device=device, dtype=torch.float32)
    lengths = [5, 9, 2]
    ids = torch.randint(1, 128, (1, sum(lengths)), generator=torch.Generator().manual_seed(3)).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    with torch.no_grad():
        packed = ours(ids, position_ids=positions).logits
        alone = torch.cat([reference(ids[:, s:s + n]).logits for s, n in zip([0, 5, 14], lengths)], dim=1)
    assert (packed - alone).abs().max() < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_steps_match_sdpa(name):
    """Five AdamW steps of causal-LM training on fixed random batches with
    padding: the losses match sdpa's within 1e-3 relative."""
    device = _cuda()
    models = model_pair(name, device=device, dtype=torch.float32)
    ids, mask = left_padded_batch(device)
    if name in REFERENCE_IMPLEMENTATION:
        mask = torch.ones_like(mask)  # eager Gemma 2 turns left-padded rows to NaN (reference_logits)
    labels = ids.masked_fill(mask == 0, -100)
    losses = []
    for model in models:
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(5):
            loss = model(ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.append(loss.item())
        losses.append(run)
    for ours, expected in zip(losses[1], losses[0]):
        assert abs(ours - expected) <= 1e-3 * abs(expected), losses
    assert losses[1][-1] < losses[1][0]
