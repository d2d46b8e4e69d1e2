"""cuflash.torch on tensors outside GPU memory (CPU, no GPU needed): every
entry point and route raises cuflash.attention's one-line TypeError naming
the caller's argument, never the dispatcher's NotImplementedError."""

import re

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
