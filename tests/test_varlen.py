"""Variable-length (packed) batches without a GPU: the argument checks, the
problem the kernels see, the work buffers, and the packed-batch kernel
variants."""

import pytest

from cuflash import api
from cuflash._kernel_families import FAMILY
from cuflash._masks import MASKS
from cuflash._params import tensor_ref
from cuflash._tiling import forward_tiling
from cuflash._validation import (Packing, TensorMeta, as_batch_of_one, check_forward, check_packed_like,
                                 check_packed_lse, check_packing, packed_problem)


def _meta(name, shape, dtype="bfloat16"):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return TensorMeta(name, tuple(shape), tuple(reversed(strides)), dtype, 0)


def _packing(batch=3, max_q=100, max_k=200, dtype="int32", cu_q_len=None):
    return Packing(_meta("cu_seqlens_q", ((cu_q_len or batch + 1),), dtype), _meta("cu_seqlens_k", (batch + 1,), dtype),
                   max_q, max_k)


def _qkv(total_q=250, total_k=400):
    return _meta("q", (total_q, 8, 128)), _meta("k", (total_k, 2, 128)), _meta("v", (total_k, 2, 128))


def test_packed_problem_is_a_batch_of_sequences_on_one_tensor_entry():
    q, k, v = _qkv()
    batch = check_packing(_packing(), q, k, v)
    assert batch == 3
    problem = check_forward(*(as_batch_of_one(m) for m in (q, k, v)), None, causal=True, softmax_scale=None)
    problem = packed_problem(problem, batch, _packing())
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k) == (3, 100, 200)
    assert (problem.total_q, problem.total_k, problem.tensor_batch, problem.tensor_seqlen_q) == (250, 400, 1, 250)
    assert problem.packed and problem.layout == "packed"
    dense = check_forward(_meta("q", (2, 10, 8, 64)), _meta("k", (2, 30, 2, 64)), _meta("v", (2, 30, 2, 64)),
                          None, causal=False, softmax_scale=None)
    assert (dense.total_q, dense.total_k, dense.tensor_batch, dense.layout) == (20, 60, 2, "dense")


@pytest.mark.parametrize("change,error,match", [
    (dict(q=_meta("q", (1, 250, 8, 128))), ValueError, r"q must have 3 dimensions \(total_tokens"),
    (dict(packing=_packing(dtype="int64")), TypeError, "cu_seqlens_q must have dtype int32"),
    (dict(packing=_packing(cu_q_len=3)), ValueError, "one length"),
    (dict(packing=_packing(max_q=-1)), ValueError, "max_seqlen_q must be from 0"),
    (dict(packing=_packing(max_k=2.5)), TypeError, "max_seqlen_k must be an int"),
    (dict(packing=_packing(max_k=True)), TypeError, "max_seqlen_k must be an int"),
])
def test_bad_packing_is_rejected(change, error, match):
    q, k, v = _qkv()
    arguments = dict(packing=_packing(), q=q, k=k, v=v) | change
    with pytest.raises(error, match=match):
        check_packing(arguments["packing"], arguments["q"], arguments["k"], arguments["v"])


def test_offsets_must_be_contiguous_one_dimensional():
    q, k, v = _qkv()
    strided = TensorMeta("cu_seqlens_q", (4,), (2,), "int32", 0)
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        check_packing(Packing(strided, _meta("cu_seqlens_k", (4,), "int32"), 10, 10), q, k, v)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be 1-D \(batch \+ 1,\)"):
        check_packing(Packing(_meta("cu_seqlens_q", (4,), "int32"), _meta("cu_seqlens_k", (2, 2), "int32"), 1, 1),
                      q, k, v)


def test_packed_outputs_and_lse_are_checked_in_the_callers_shapes():
    q, _, _ = _qkv()
    with pytest.raises(ValueError, match=r"out must have the shape of q \(250, 8, 128\)"):
        check_packed_like(_meta("out", (1, 250, 8, 128)), q)
    with pytest.raises(TypeError, match="dq must have the dtype of q"):
        check_packed_like(_meta("dq", (250, 8, 128), "float16"), q)
    with pytest.raises(ValueError, match=r"lse must have shape \(nheads, total_q\) = \(8, 250\)"):
        check_packed_lse(_meta("lse", (1, 8, 250), "float32"), 8, 250)
    assert check_packed_lse(_meta("lse", (8, 250), "float32"), 8, 250).shape == (1, 8, 250)


def test_packed_work_buffers_have_one_row_per_token():
    buffers = api.backward_work_buffers(3, 8, 100, 128, None, True, total_q=250)
    assert buffers["delta"] == ((8, 250), "float32")
    assert buffers["dq_accum"] == ((250, 8, 128), "float32")
    assert buffers["dq_semaphore"][0][:2] == (3, 8)  # turn counters per sequence and head
    dense = api.backward_work_buffers(2, 4, 10, 64, None, True)
    assert dense["delta"] == ((4, 20), "float32") and dense["dq_accum"] == ((20, 4, 64), "float32")


def test_dq_blocks_are_stored_first_only_by_the_hopper_kernel_on_dense_batches():
    """Where the Hopper dK/dV kernel may store each dQ block's first tile, a
    dense batch gets the counters in the atomic mode too; a packed batch
    (tiles that run into the next sequence's rows) and the other kernels add
    into a zeroed accumulator."""
    from cuflash._tiling import Tiling

    hopper = Tiling(head_dim_padded=128, block_m=64, block_n=128, warps=12, kernel="wgmma")
    ampere = Tiling(head_dim_padded=128, block_m=64, block_n=64, warps=4, kernel="mma")
    dense = api.backward_work_buffers(2, 4, 1000, 128, hopper, False)
    assert dense["dq_semaphore"] == ((2, 4, 16), "int32") and dense["dq_accum"] == ((2000, 4, 128), "float32")
    assert "dq_semaphore" not in api.backward_work_buffers(1, 4, 1000, 128, hopper, False, total_q=900, packed=True)
    assert "dq_semaphore" not in api.backward_work_buffers(2, 4, 1000, 128, ampere, False)


@pytest.mark.parametrize("seqlen_q,seqlen_k,mask,mode,stores", [
    (2049, 1000, "causal", "atomic", True),    # causal walks start on each key block's own diagonal
    (1000, 1000, "window", "atomic", True),
    (512, 8192, "causal", "atomic", False),    # past the queries every walk starts on query block 0
    (1000, 1000, "none", "atomic", False),     # measured slower without a mask
    (2049, 1000, "causal", "ordered", False),
    (1000, 1000, "none", "separate", False),
])
def test_which_backwards_store_each_dq_block_first(seqlen_q, seqlen_k, mask, mode, stores):
    import dataclasses

    from cuflash._masks import MASKS
    from cuflash._tiling import Tiling
    from cuflash._validation import check_backward

    q, k = _meta("q", (2, seqlen_q, 4, 128)), _meta("k", (2, seqlen_k, 4, 128))
    problem = check_backward(_meta("dout", q.shape), q, k, _meta("v", k.shape), _meta("out", q.shape),
                             _meta("lse", (2, 4, seqlen_q), "float32"), None, None, None, causal=False,
                             softmax_scale=None, deterministic=mode != "atomic")
    problem = dataclasses.replace(problem, mask_name=mask)
    assert problem.mask is MASKS[mask]
    hopper = Tiling(head_dim_padded=128, block_m=64, block_n=128, warps=12, kernel="wgmma")
    assert api.stores_first_dq(problem, hopper, mode) is stores
    ampere = Tiling(head_dim_padded=128, block_m=64, block_n=64, warps=4, kernel="mma")
    assert not api.stores_first_dq(problem, ampere, mode)


def test_a_batch_of_one_tensor_entry_is_addressed_without_its_batch_stride():
    """Packed kernels address every sequence in tensor entry 0; a batch of one
    has no batch stride to apply."""
    one = api.Layout((1, 250, 8, 128), (12345 * 2, 8 * 128 * 2, 128 * 2, 2), 2)
    assert tensor_ref(one) == (0, 0, 1024, 128)
    two = api.Layout((2, 250, 8, 128), (250 * 1024 * 2, 1024 * 2, 256, 2), 2)
    assert tensor_ref(two)[1] == 250 * 1024


def test_packed_kernels_are_their_own_variants():
    tiling = forward_tiling("bfloat16", 128)
    family = FAMILY["forward"]
    dense = family.variant("bfloat16", tiling, MASKS["causal"])
    packed = family.variant("bfloat16", tiling, MASKS["causal"], layout="packed")
    assert dense.template_args[-1] == "cuflash::DenseBatch" and packed.template_args[-1] == "cuflash::PackedBatch"
    assert packed.key == dense.key + "/packed"


def test_packed_batches_never_rotate_or_decode():
    q, k, v = _qkv(total_q=3, total_k=4096)
    problem = check_forward(*(as_batch_of_one(m) for m in (q, k, v)), None, causal=False, softmax_scale=None)
    problem = packed_problem(problem, 3, _packing(max_q=1, max_k=4096))
    assert not api.rotate_walks(problem, "atomic", "wgmma", 64, 1, 132)
    assert api.decode_shape(problem, {}).packed is False
