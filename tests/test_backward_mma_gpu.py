"""The mma.sync backward dK/dV kernel (sm_80+, what Ampere and Ada GPUs run):
which calls take it, and its sizes. On the H100 these tests pin the kernel
generation to sm_80 (``api._kernel_generation``), so the launcher picks what
an Ampere GPU would: the same kernel source, built for the GPU at hand."""

import pytest

from cuflash import api
from cuflash._tiling import mma_backward_99kib_tiling

from tests.helpers import pin_kernel_generation, pin_ordered_dq_order, random_qkv
from tests.test_backward_gpu import run_backward_and_check
from tests.test_backward_wgmma_gpu import _chosen, assert_deterministic_backward_is_bitwise_repeatable

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


@pytest.fixture
def ampere(monkeypatch):
    pin_kernel_generation(monkeypatch, 80)


@pytest.fixture
def ada(monkeypatch):
    """As on an sm_89 GPU (RTX 40, L4, L40S): 99 KiB of shared memory per block."""
    pin_kernel_generation(monkeypatch, 89)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device_id: 99 * 1024)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,kernel", [(8, "mma"), (32, "mma"), (64, "mma"), (80, "mma"), (128, "mma"),
                                             (160, "mma"), (256, "mma")])
def test_ampere_backward_takes_mma_for_its_head_dims(ampere, dtype, head_dim, kernel):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 33, 40, 4, 2, head_dim, cupy.dtype(dtype), layout="bhsd")
    assert _chosen(q, k, v).kernel == kernel
    assert _chosen(q, k, v, deterministic=True).kernel == kernel  # ordered dQ on the same kernel


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (127, 129), (129, 127), (1000, 2049), (2049, 1000),
                                               (1000, 17), (17, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_mma_backward_sizes(ampere, dtype, head_dim, seqlen_q, seqlen_k, causal, heads):
    """Partial query and key blocks, both orders of the lengths (causal rows
    that see no key), several query blocks per key block so that the Q/dO
    buffers alternate, and query heads summed into one K/V head; above head
    dim 128 two warps share each 16 keys (P^T through shared memory)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 1, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype(dtype),
                         seed=seqlen_q + 3 * seqlen_k + head_dim)
    assert _chosen(q, k, v).kernel == "mma"
    run_backward_and_check(q, k, v, causal=causal, seed=seqlen_q)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 40, 72, 104, 120, 136, 160, 200, 248])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mma_backward_padded_head_dims(ampere, dtype, head_dim, causal):
    """Head dims below their bucket: padded columns add nothing, and dQ, dK,
    dV are written only up to head_dim."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 300, 257, 4, 2, head_dim, cupy.dtype(dtype), seed=head_dim)
    assert _chosen(q, k, v).kernel == "mma"
    run_backward_and_check(q, k, v, causal=causal, seed=head_dim)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 160, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (129, 127), (1000, 2049), (2049, 1000), (17, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_mma_deterministic_backward_sizes(ampere, dtype, head_dim, seqlen_q, seqlen_k, causal, heads):
    """The ordered dQ mode on Ampere: the key blocks take turns on each dQ
    block, from the first that sees it."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype(dtype), seed=seqlen_k + head_dim)
    assert _chosen(q, k, v, deterministic=True).kernel == "mma"
    run_backward_and_check(q, k, v, causal=causal, deterministic=True, seed=seqlen_q)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mma_deterministic_backward_is_bitwise_repeatable(ampere, head_dim, causal):
    """Ten runs, bitwise the same dq, dk, dv, on another stream too; dq of
    the atomic mode agrees to rounding."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1024, 1024, 8, 2, head_dim, cupy.dtype("bfloat16"), seed=head_dim)
    assert _chosen(q, k, v, deterministic=True).kernel == "mma"
    assert_deterministic_backward_is_bitwise_repeatable(q, k, v, causal)


@pytest.mark.parametrize("rotated", [True, False], ids=["rotated-walks", "key-block-order"])
@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads", [(1000, 1000, (4, 4)), (2049, 1000, (6, 2))])
def test_mma_deterministic_backward_in_both_orders(ampere, rotated, head_dim, seqlen_q, seqlen_k, heads, monkeypatch):
    """Both orders of ordered dQ without a mask (see the Hopper test of the
    same name), on the mma.sync kernel."""
    orders = pin_ordered_dq_order(monkeypatch, rotated)
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, *heads, head_dim, cupy.dtype("float16"), seed=head_dim)
    assert _chosen(q, k, v, deterministic=True).kernel == "mma"
    run_backward_and_check(q, k, v, causal=False, deterministic=True, seed=seqlen_k)
    assert orders["ordered"] and set(orders["ordered"]) == {rotated}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [96, 128, 160, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (129, 127), (1000, 2049), (2049, 1000)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "ordered"])
def test_mma_backward_99kib_tiles(ada, dtype, head_dim, seqlen_q, seqlen_k, causal, deterministic):
    """The tiles of GPUs with 99 KiB per block (one Q/dO buffer: the next
    query block is copied during dQ; 32 keys per block at 256)."""
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, seqlen_q, seqlen_k, 4, 2, head_dim, cupy.dtype(dtype), seed=seqlen_q + head_dim)
    chosen = _chosen(q, k, v, deterministic=deterministic)
    assert chosen == mma_backward_99kib_tiling(dtype, head_dim) and chosen.backward_dkdv_smem_bytes(dtype) <= 99 * 1024
    run_backward_and_check(q, k, v, causal=causal, deterministic=deterministic, seed=seqlen_k)


@pytest.mark.parametrize("head_dim", [128, 192])
def test_mma_99kib_deterministic_backward_is_bitwise_repeatable(ada, head_dim):
    cupy = _cupy()
    q, k, v = random_qkv(cupy, 2, 1024, 1024, 8, 2, head_dim, cupy.dtype("bfloat16"), seed=head_dim)
    assert _chosen(q, k, v, deterministic=True) == mma_backward_99kib_tiling("bfloat16", head_dim)
    assert_deterministic_backward_is_bitwise_repeatable(q, k, v, True)
