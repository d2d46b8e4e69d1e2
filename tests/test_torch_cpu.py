"""cuflash.torch on tensors outside GPU memory (CPU, no GPU needed): every
entry point and route raises cuflash.attention's one-line TypeError naming
the caller's argument, never the dispatcher's NotImplementedError."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.torch as cuflash_torch  # noqa: E402


def _attention_error(name: str, tensor) -> str:
    """What cuflash.attention says of ``tensor`` given as its ``name`` argument (q)."""
    with pytest.raises(TypeError) as caught:
        cuflash.attention(tensor, tensor, tensor)
    return str(caught.value).replace("q must", f"{name} must", 1)


def _raises_attention_error(call, name: str, tensor):
    expected = _attention_error(name, tensor)
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        call()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_sdpa_names_its_own_cpu_argument(requires_grad):
    cpu = torch.zeros(1, 2, 8, 16, requires_grad=requires_grad)
    meta = torch.zeros(1, 2, 8, 16, device="meta")
    sdpa = cuflash_torch.scaled_dot_product_attention
    _raises_attention_error(lambda: sdpa(cpu, cpu, cpu), "query", cpu)
    _raises_attention_error(lambda: sdpa(meta, cpu, meta), "key", cpu)
    _raises_attention_error(lambda: sdpa(meta, meta, cpu), "value", cpu)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("entry", ["attention", "flash_attn_func"])
def test_wrappers_raise_attention_error_for_cpu_tensors(entry, requires_grad):
    cpu = torch.zeros(1, 8, 2, 16, requires_grad=requires_grad)
    _raises_attention_error(lambda: getattr(cuflash_torch, entry)(cpu, cpu, cpu), "q", cpu)


@pytest.mark.parametrize("position,name", [(0, "q"), (1, "k"), (2, "v")])
def test_custom_op_route_checks_before_dispatch(position, name):
    # The route torch.compile traces: the custom op would dispatch on the
    # device and raise PyTorch's NotImplementedError for the CPU backend.
    cpu = torch.zeros(1, 8, 2, 16)
    args = [torch.zeros(1, 8, 2, 16, device="meta") for _ in range(3)]
    args[position] = cpu
    _raises_attention_error(lambda: cuflash_torch._forward(*args, False, None, route="custom_op"), name, cpu)


def test_error_is_one_line():
    cpu = torch.zeros(1, 2, 8, 16)
    with pytest.raises(TypeError) as caught:
        cuflash_torch.scaled_dot_product_attention(cpu, cpu, cpu)
    assert len(str(caught.value).splitlines()) == 1


# --- the eager autograd node's plumbing, with float64 stand-ins for the kernels ---

def _reference_scores(q, k, causal, softmax_scale):
    """(batch, heads, seqlen_q, seqlen_k) scaled scores of heads-first q, k, bottom-right causal mask applied."""
    scores = q @ k.transpose(-1, -2) * (softmax_scale or q.shape[-1] ** -0.5)
    if causal:
        seqlen_q, seqlen_k = scores.shape[-2:]
        hidden = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).triu(seqlen_k - seqlen_q + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


class _StandIns(list):
    """The calls the stand-in kernels saw, ("forward" / "plain forward" /
    "backward" / "following" / "followed", heads_first); ``call``: what the
    stand-in forward returns as its cached call (None: as the full path
    does); ``remembered``: whether a backward is remembered on it
    (api.followed_backward then serves)."""

    call = None
    remembered = False


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """cuflash.api's forward and backward replaced by PyTorch on the CPU,
    taking the layouts the autograd node passes (heads_first or not);
    records each call's heads_first."""
    seen = _StandIns()

    def heads_first_view(x, heads_first):
        return x if heads_first else x.transpose(1, 2)

    def attention(q, k, v, causal, softmax_scale, *rest):
        # rest: the variants (Variants' order), return_lse, out, lse, fp32_precision, num_splits, heads_first
        heads_first = rest[-1]
        seen.append(("forward", heads_first))
        qh, kh, vh = (heads_first_view(x, heads_first) for x in (q, k, v))
        scores = _reference_scores(qh, kh, causal, softmax_scale)
        out = heads_first_view(torch.softmax(scores, -1) @ vh, heads_first).clone()
        return [q, k, v, out, torch.logsumexp(scores, -1)], seen.call

    def gradients(dout, q, k, v, causal, softmax_scale, heads_first):
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            qh, kh, vh = (heads_first_view(x, heads_first) for x in leaves)
            recomputed = heads_first_view(torch.softmax(_reference_scores(qh, kh, causal, softmax_scale), -1) @ vh,
                                          heads_first)
            return torch.autograd.grad(recomputed, leaves, dout)

    def attention_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic, heads_first, **_):
        seen.append(("backward", heads_first))
        return gradients(dout, q, k, v, causal, softmax_scale, heads_first)

    def backward_following(forward, dout, q, k, v, out, lse, *, causal, softmax_scale, window_size, softcap,
                           deterministic, heads_first):
        assert forward is seen.call
        seen.append(("following", heads_first))
        return gradients(dout, q, k, v, causal, softmax_scale, heads_first)

    def forward_plain(q, k, v, causal, softmax_scale, fp32_precision, heads_first, return_lse=True):
        arrays, call = attention(q, k, v, causal, softmax_scale, *cuflash.api.Variants().values(), return_lse, None,
                                 None, fp32_precision, None, heads_first)
        seen[-1] = ("plain forward", heads_first, return_lse)
        seen.flags = (causal, softmax_scale, heads_first)
        return arrays[3], arrays[4] if return_lse else None, call

    def followed_backward(forward, dout, q, k, v, out, lse, deterministic):
        if not seen.remembered:
            return None
        assert forward is seen.call
        causal, softmax_scale, heads_first = seen.flags
        seen.append(("followed", heads_first))
        return gradients(dout, q, k, v, causal, softmax_scale, heads_first)

    monkeypatch.setattr(cuflash.api, "_attention", attention)
    monkeypatch.setattr(cuflash.api, "forward_plain", forward_plain)
    monkeypatch.setattr(cuflash.api, "attention_backward", attention_backward)
    monkeypatch.setattr(cuflash.api, "backward_following", backward_following)
    monkeypatch.setattr(cuflash.api, "followed_backward", followed_backward)
    return seen


@pytest.mark.parametrize("public_apply", [False, True])
def test_sdpa_dropin_node_on_stand_in_kernels(stand_in_kernels, monkeypatch, public_apply):
    """The drop-in's one autograd node passes SDPA's layout through
    (heads_first), its gradients match autograd through the same math,
    and a second derivative raises; with PyTorch's private apply hooks
    missing (public_apply), the public apply gives the same."""
    if public_apply:
        monkeypatch.setattr(cuflash_torch, "_unwrap_if_dead", None)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 9, 8, dtype=torch.float64, generator=gen) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    # The drop-in's route past its device check (the stand-ins run on the CPU).
    out = cuflash_torch._forward(*leaves, True, None, heads_first=True)
    assert [type(node).__name__ for node, _ in out.grad_fn.next_functions] == ["AccumulateGrad"] * 3
    out.backward(dout)
    expected_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*expected_leaves, is_causal=True)
    expected.backward(dout)
    torch.testing.assert_close(out, expected)
    for got, want in zip(leaves, expected_leaves):
        torch.testing.assert_close(got.grad, want.grad)
    assert stand_in_kernels == [("plain forward", True, True), ("backward", True)]  # no variants: api.forward_plain
    out = cuflash_torch._forward(*leaves, True, None, heads_first=True)
    (grad_q,) = torch.autograd.grad(out, leaves[0], dout.clone().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_q.sum().backward()


def test_forward_without_gradients_takes_the_short_key_without_lse(stand_in_kernels):
    """Without gradients (inference, ``torch.no_grad``) a call without
    variants runs through api.forward_plain without the log-sum-exp (a
    plan fixed by q, k, v and the flags); with variants through
    cuflash.attention; both give the reference output."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.no_grad():
        out = cuflash_torch._forward(q, k, v, True, None, heads_first=True)
    torch.testing.assert_close(out, expected)
    assert stand_in_kernels == [("plain forward", True, False)]
    out = cuflash_torch._forward(q, k, v, True, None, heads_first=True)  # no leaf asks for a gradient
    torch.testing.assert_close(out, expected)
    assert stand_in_kernels[-1] == ("plain forward", True, False)
    out = cuflash_torch._forward(q, k, v, True, None, heads_first=True,
                                 variants=cuflash.api.Variants(window_size=(100, 0)))
    torch.testing.assert_close(out, expected)  # the window covers every row's keys
    assert stand_in_kernels[-1] == ("forward", True)


def test_backward_follows_the_forwards_cached_call_only_on_its_own_tensors(stand_in_kernels):
    """The eager node's backward takes the forward's cached call
    (api.backward_following) when its forward ran from one, without
    variants that carry arrays, and autograd hands back the tensors the
    forward saved; under saved-tensor hooks (which may return others, of
    other layouts) and with dropout it takes attention_backward's path."""
    stand_in_kernels.call = object()  # the forward "ran from a cached call"
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=gen) for _ in range(4))

    def step(**kwargs):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        cuflash_torch._forward(*leaves, True, None, heads_first=True, **kwargs).backward(dout)
        return [leaf.grad for leaf in leaves]

    plain = step()
    assert stand_in_kernels[-1] == ("following", True)
    with torch.autograd.graph.save_on_cpu():
        hooked = step()
    assert stand_in_kernels[-1] == ("backward", True)
    for a, b in zip(plain, hooked):
        torch.testing.assert_close(a, b)
    step(variants=cuflash.api.Variants(dropout_p=0.1, dropout_seed=1))
    assert stand_in_kernels[-1] == ("backward", True)
    stand_in_kernels.call = None  # the full path ran the forward
    step()
    assert stand_in_kernels[-1] == ("backward", True)


def test_backward_takes_a_remembered_call_first_on_the_gradient_as_given(stand_in_kernels):
    """With a backward remembered on the forward's cached call, the node's
    backward runs it (api.followed_backward) on the gradient as autograd
    gives it, an expanded one too (a remembered call's dout signature was
    made contiguous, so only such a dout can match it), before any
    contiguity check; its gradients are the math's; without one it takes
    api.backward_following on the contiguous gradient."""
    stand_in_kernels.call = object()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=gen) for _ in range(3))

    def gradients(dout):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        cuflash_torch._forward(*leaves, False, 0.3, heads_first=True).backward(dout)
        return [leaf.grad for leaf in leaves]

    dout = torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=gen)
    following = gradients(dout)
    assert stand_in_kernels[-2:] == [("plain forward", True, True), ("following", True)]
    stand_in_kernels.remembered = True
    for given in (dout, torch.ones(()).expand(1, 2, 7, 8).double()):
        followed = gradients(given)
        assert stand_in_kernels[-1] == ("followed", True)
        expected = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*expected, scale=0.3).backward(given)
        for got, want in zip(followed, expected):
            torch.testing.assert_close(got, want.grad)
    for got, want in zip(following, gradients(dout)):
        torch.testing.assert_close(got, want)


def test_variants_of_default_options_are_the_shared_plain_object():
    """cuflash.torch's calls pass the shared no-variants object (the lean
    forward's test is identity) exactly where every option is its default
    of the default's class: a window side of another class, a soft cap or
    dropout given as an int, an array side keep Variants (and
    check_window's message)."""
    plain = cuflash_torch._NO_VARIANTS
    assert cuflash_torch._variants() is plain and cuflash_torch._variants((-1, -1), 0.0, None, 0.0) is plain
    for options in (dict(window_size=(-1.0, -1.0)), dict(window_size=(-1, np.int64(-1))),
                    dict(window_size=[-1, -1]), dict(window_size=(np.array([-1, -1]), -1)),
                    dict(window_size=(-1, -1, -1)), dict(softcap=0), dict(dropout_p=0), dict(dropout_offset=0.0),
                    dict(window_size=(4, 0)), dict(dropout_seed=1), dict(alibi_slopes=torch.zeros(2)),
                    dict(score_mod=lambda score, b, h, q, kv: score)):
        variants = cuflash_torch._variants(**options)
        assert variants is not plain, options
    from cuflash._validation import check_window

    with pytest.raises(TypeError, match="window_size's left side must be an int, got float"):
        check_window(cuflash_torch._variants(window_size=(-1.0, -1)).window_size)


def test_variants_values_follow_the_fields():
    import dataclasses

    variants = cuflash.api.Variants((3, 4), 2.0, None, 0.0, 5, 6, None, None, None)
    assert variants.values() == tuple(getattr(variants, f.name) for f in dataclasses.fields(variants))
    assert variants.plain and cuflash.api.Variants().plain
    for field, value in (("alibi_slopes", object()), ("dropout_p", 0.1), ("dropout_p", 0), ("score_mod", object()),
                         ("mod_arrays", {}), ("mask_mod", object())):
        assert not dataclasses.replace(variants, **{field: value}).plain
