"""The launch path: plans made once per call signature, reused only by calls
they fit. CPU tests check the plan machinery with the driver call recorded;
GPU tests check that a cached plan never serves a call it does not fit
(other strides, alignment, flags, dtype, stream, device)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuflash import _interop, _launch, api
from cuflash._launch import KernelLaunch, LaunchPlan, PlanCache
from cuflash._params import BACKWARD_PARAMS, FORWARD_PARAMS, MERGE_PARAMS, NO_VARIANT, pack
from cuflash.reference import attention_backward_reference, attention_reference

from tests.helpers import (
    SPIN_AND_COPY,
    assert_output_accurate,
    naive_attention_backward_same_precision,
    naive_attention_same_precision,
    random_qkv,
)


class _FakeKernel:
    """Stands for a ``cupy.RawKernel``: only its function pointer is read."""

    def __init__(self, pointer):
        self.kernel = type("Function", (), {"ptr": pointer})()


def _forward_struct():
    return pack(FORWARD_PARAMS, q=(0, 1, 2, 3), k=(0, 4, 5, 6), v=(0, 7, 8, 9), out=(0, 10, 11, 12), lse=0,
                lse_batch_stride=13, lse_head_stride=14, size=(1, 2, 3, 4, 5, 6, 0, 0, 4, 5, 0, 0, 0, 0), num_m_blocks=15,
                softmax_scale_log2=0.5, kv_pair_maps=0, num_splits=1, out_split_stride=0, lse_split_stride=0,
                variant=NO_VARIANT)


def _merge_struct():
    return pack(MERGE_PARAMS, out=(0, 1, 2, 3), lse=0, lse_batch_stride=1, lse_head_stride=1, lse_row_stride=1,
                partial=(0, 1, 2, 3), partial_lse=0, partial_lse_batch_stride=1, partial_lse_head_stride=1,
                partial_lse_row_stride=1, num_states=2, partial_state_stride=4, partial_lse_state_stride=5,
                size=(1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0))


def _read_struct(address: int, dtype: np.dtype) -> np.ndarray:
    raw = ctypes.string_at(address, dtype.itemsize)
    return np.frombuffer(raw, dtype=dtype)


@pytest.fixture
def recorded_launches(monkeypatch):
    """Replaces the driver's launch by a recorder that also copies the
    struct each launch points at, as cuLaunchKernel does."""
    from cupy.cuda import driver

    calls = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, arguments, extra):
        (struct_address,) = _read_struct(arguments, np.dtype(np.uint64))
        calls.append({"function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem,
                      "stream": stream, "struct_address": int(struct_address), "extra": extra})

    def launch_kernel_ex(config, function, arguments, extra):
        config = ctypes.cast(config, ctypes.POINTER(_launch._LaunchConfig)).contents
        attributes = [config.attributes[i] for i in range(config.attribute_count)]
        (struct_address,) = _read_struct(arguments, np.dtype(np.uint64))
        calls.append({"function": function, "grid": tuple(config.grid), "block": tuple(config.block),
                      "smem": config.shared_mem_bytes, "stream": config.stream or 0,
                      "struct_address": int(struct_address), "extra": extra or 0,
                      "attributes": [(a.id, a.value) for a in attributes]})
        return 0

    monkeypatch.setattr(driver, "launchKernel", launch_kernel)
    monkeypatch.setattr(_launch, "launch_kernel_ex", launch_kernel_ex)
    return calls


def test_plan_writes_each_pointer_into_its_field_and_launches_in_order(recorded_launches):
    struct = _forward_struct()
    plan = LaunchPlan(0, [struct], api.FORWARD_SLOTS,
                      [KernelLaunch(_FakeKernel(111), 7, 128, 4096), KernelLaunch(_FakeKernel(222), 3, 256, 0)])
    pointers = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000]
    plan.launch(pointers, stream=99)
    assert [c["function"] for c in recorded_launches] == [111, 222]
    assert recorded_launches[0]["grid"] == (7, 1, 1) and recorded_launches[0]["block"] == (128, 1, 1)
    assert recorded_launches[0]["smem"] == 4096 and recorded_launches[1]["smem"] == 0
    assert {c["stream"] for c in recorded_launches} == {99} and {c["extra"] for c in recorded_launches} == {0}
    written = _read_struct(recorded_launches[0]["struct_address"], FORWARD_PARAMS)[0]
    for name, pointer in zip(("q", "k", "v", "out"), pointers):
        assert written[name]["ptr"] == pointer
    assert written["lse"] == 0x5000
    # Everything else is as planned.
    assert tuple(written["q"])[1:] == (1, 2, 3) and written["num_m_blocks"] == 15
    assert written["softmax_scale_log2"] == 0.5 and tuple(written["size"]) == (1, 2, 3, 4, 5, 6, 0, 0, 4, 5, 0, 0, 0, 0)
    # A variable-length call's offsets go into the problem size (null in a dense call).
    plan.launch([1, 2, 3, 4, 5, 0, 0, 0x6000, 0x7000], stream=7)  # a second call overwrites every pointer
    written = _read_struct(recorded_launches[-1]["struct_address"], FORWARD_PARAMS)[0]
    assert [written[n]["ptr"] for n in ("q", "k", "v", "out")] == [1, 2, 3, 4] and written["lse"] == 5
    assert written["size"]["cu_seqlens_q"] == 0x6000 and written["size"]["cu_seqlens_k"] == 0x7000


def test_a_dependent_launch_allows_programmatic_stream_serialization(recorded_launches):
    """A dependent kernel (split-KV's merge on Hopper) goes through
    cuLaunchKernelEx with the attribute that lets it start before the kernel
    ahead of it ends, on the call's stream, with its own struct; the others
    through cuLaunchKernel without attributes."""
    merge = _merge_struct()
    plan = LaunchPlan(0, [_forward_struct(), merge], api.SPLIT_FORWARD_SLOTS,
                      [KernelLaunch(_FakeKernel(1), 9, 128, 512), KernelLaunch(_FakeKernel(2), 5, 64, 16, struct=1,
                                                                               dependent=True)])
    for stream in (0, 0x77):
        plan.launch([11, 12, 13, 14, 15, 16, 17], stream=stream)
        forward, merged = recorded_launches[-2:]
        assert "attributes" not in forward and forward["grid"] == (9, 1, 1)
        assert merged["function"] == 2 and merged["grid"] == (5, 1, 1) and merged["block"] == (64, 1, 1)
        assert merged["smem"] == 16 and merged["stream"] == stream and merged["extra"] == 0
        assert merged["attributes"] == [(_launch._PROGRAMMATIC_STREAM_SERIALIZATION, 1)]
        assert _read_struct(merged["struct_address"], MERGE_PARAMS)[0]["partial"]["ptr"] == 16


def test_a_failed_dependent_launch_raises_the_drivers_error(monkeypatch):
    from cupy.cuda import driver

    monkeypatch.setattr(_launch, "launch_kernel_ex", lambda *args: 1)  # CUDA_ERROR_INVALID_VALUE
    # CuPy's error asks the driver for the status's name: a stand-in where there is no driver.
    monkeypatch.setattr(driver, "CUDADriverError", type("CUDADriverError", (Exception,), {}))
    plan = LaunchPlan(0, [_forward_struct()], api.FORWARD_SLOTS,
                      [KernelLaunch(_FakeKernel(1), 1, 32, 0, dependent=True)])
    with pytest.raises(driver.CUDADriverError):
        plan.launch([1, 2, 3, 4, 5, 6, 7], stream=0)


def test_backward_plan_writes_pointers_into_both_structs(recorded_launches):
    fields = {name: (0, 1, 2, 3) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
    fields.update(lse=0, lse_batch_stride=1, lse_head_stride=2, delta=0, dq_accum=0, dq_semaphore=0, size=(1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0),
                  num_m_blocks=4, num_n_blocks=5, rotate_walks=0, dq_block_m=0, softmax_scale_log2=1.0, softmax_scale=1.0,
                  variant=NO_VARIANT)
    first = pack(BACKWARD_PARAMS, **fields)
    fields["num_m_blocks"] = 8
    second = pack(BACKWARD_PARAMS, **fields)
    plan = LaunchPlan(0, [first, second], api.BACKWARD_SLOTS,
                      [KernelLaunch(_FakeKernel(1), 1, 32, 0), KernelLaunch(_FakeKernel(2), 1, 32, 0, struct=1)])
    pointers = list(range(100, 100 + len(api.BACKWARD_SLOTS)))
    plan.launch(pointers, stream=0)
    structs = [_read_struct(c["struct_address"], BACKWARD_PARAMS)[0] for c in recorded_launches]
    assert [s["num_m_blocks"] for s in structs] == [4, 8]
    for written in structs:
        for slot, pointer in zip(api.BACKWARD_SLOTS, pointers):
            name, _, field = slot.partition(".")
            assert (written[name][field] if field else written[name]) == pointer


def test_split_plan_sends_one_array_to_different_fields_of_different_structs(recorded_launches):
    """Split-KV: the partial results are the forward kernel's out and lse and
    the merge kernel's partial and partial_lse; the call's out and lse are
    the merge kernel's alone. A plan without splits leaves the work-buffer
    slots unused."""
    merge = _merge_struct()
    plan = LaunchPlan(0, [_forward_struct(), merge], api.SPLIT_FORWARD_SLOTS,
                      [KernelLaunch(_FakeKernel(1), 1, 32, 0), KernelLaunch(_FakeKernel(2), 1, 32, 0, struct=1)])
    plan.launch([11, 12, 13, 14, 15, 16, 17], stream=0)
    forward = _read_struct(recorded_launches[0]["struct_address"], FORWARD_PARAMS)[0]
    merged = _read_struct(recorded_launches[1]["struct_address"], MERGE_PARAMS)[0]
    assert [forward[n]["ptr"] for n in ("q", "k", "v", "out")] == [11, 12, 13, 16] and forward["lse"] == 17
    assert merged["out"]["ptr"] == 14 and merged["lse"] == 15
    assert merged["partial"]["ptr"] == 16 and merged["partial_lse"] == 17
    plain = LaunchPlan(0, [_forward_struct()], api.FORWARD_SLOTS, [KernelLaunch(_FakeKernel(3), 1, 32, 0)])
    plain.launch([1, 2, 3, 4, 5, 6, 7], stream=0)
    written = _read_struct(recorded_launches[-1]["struct_address"], FORWARD_PARAMS)[0]
    assert written["out"]["ptr"] == 4 and written["lse"] == 5


def test_plan_writes_only_the_slots_a_cached_call_names(recorded_launches):
    """A cached call writes the pointers its signature leaves open; the
    others (arrays the signature fixes as absent) keep what the first call
    wrote."""
    plan = LaunchPlan(0, [_forward_struct()], api.FORWARD_SLOTS, [KernelLaunch(_FakeKernel(1), 1, 32, 0)])
    plan.launch([1, 2, 3, 4, 5, 0, 0, 0x6000, 0x7000], stream=0)
    plan.launch([11, 12, 13, 14, 15, 0, 0, 0x8000, 0x9000], stream=0, slots=(0, 1, 2, 3, 4))
    written = _read_struct(recorded_launches[-1]["struct_address"], FORWARD_PARAMS)[0]
    assert [written[n]["ptr"] for n in ("q", "k", "v", "out")] == [11, 12, 13, 14] and written["lse"] == 15
    assert written["size"]["cu_seqlens_q"] == 0x6000 and written["size"]["cu_seqlens_k"] == 0x7000


@pytest.fixture
def stand_in_hopper(monkeypatch):
    """Plans made for a stand-in H100 (no GPU, nothing compiled); the keys
    of the variants the plans asked the loader for, in order."""
    requested = []
    monkeypatch.setattr(api.loader, "get", lambda variant, device: requested.append(variant.key) or _FakeKernel(0))
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    return requested


def _one_key_block_backward(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool, out_strides=None):
    """(problem, layouts, tiling) of a bf16 backward with 4 query heads on 2
    K/V heads, batch 2, all contiguous but out, whose element strides
    ``out_strides`` may pad its rows; the dK/dV tiling the launcher picks."""
    from cuflash._validation import TensorMeta, check_backward, contiguous_strides

    q_shape, kv_shape = (2, seqlen_q, 4, head_dim), (2, seqlen_k, 2, head_dim)
    shapes = dict(dout=q_shape, q=q_shape, k=kv_shape, v=kv_shape, out=q_shape, dq=q_shape, dk=kv_shape, dv=kv_shape)
    strides = {name: contiguous_strides(shape) for name, shape in shapes.items()} | (
        {"out": out_strides} if out_strides is not None else {})
    metas = {name: TensorMeta(name, shape, strides[name], "bfloat16", 0) for name, shape in shapes.items()}
    lse_shape = (2, 4, seqlen_q)
    problem = check_backward(*(metas[name] for name in ("dout", "q", "k", "v", "out")),
                             TensorMeta("lse", lse_shape, contiguous_strides(lse_shape), "float32", 0), None, None,
                             None, causal=causal, softmax_scale=None, deterministic=False)
    layouts = {name: api.Layout(shape, tuple(2 * stride for stride in strides[name]), 2)
               for name, shape in shapes.items()}
    return problem, layouts, api.backward_tiling_for(problem, layouts, layouts, False, aligned=True)


@pytest.mark.parametrize("head_dim,seqlen_q,seqlen_k,causal,dq_aligned,out_aligned,direct", [
    (64, 100, 128, True, True, True, True),     # one key block of 128: dQ stored, delta computed, by the dK/dV kernel
    (64, 1000, 17, False, True, True, True),
    (256, 50, 64, False, True, True, True),     # one stage: its O tile in the dQ tile's second half
    (192, 50, 64, False, True, True, True),     # two stages whose O tiles do not fit: delta by the preprocessing kernel
    (192, 50, 64, False, True, False, True),    # ... which reads out as it is: out's alignment does not matter
    (192, 50, 64, False, False, True, False),   # the caller's dq (its alignment unknown): accumulated and converted
    (64, 100, 128, True, False, True, False),
    (64, 100, 128, True, True, False, False),   # a misaligned out, which the kernel would map
    (64, 100, 129, False, True, True, False),   # two key blocks
    (64, 300, 100, True, True, True, False),    # causal rows before the keys: claimed first stores
])
def test_backward_plan_of_one_key_block_stores_dq_without_a_conversion(stand_in_hopper, head_dim, seqlen_q, seqlen_k,
                                                                       causal, dq_aligned, out_aligned, direct):
    """The Hopper backward of one key block (128 keys a block at head dim
    64, 64 above 128) is one kernel, dK/dV in the direct dQ mode, which
    computes delta from tiles of out and stores dQ through a tensor map of
    dq (not of the accumulator), both encoded from the call's pointers; it
    has no work buffer and writes no pointer to one. Where its O tiles do
    not fit (head dim 192), the preprocessing kernel computes delta first
    into its buffer. Otherwise the conversion follows, into the
    accumulator's map."""
    from cuflash._tiling import wgmma_direct_computes_delta

    problem, layouts, tiling = _one_key_block_backward(head_dim, seqlen_q, seqlen_k, causal)
    assert (tiling.kernel, tiling.block_n) == ("wgmma", 128 if head_dim <= 128 else 64)
    assert api.stores_dq_directly(problem, layouts, tiling, dq_aligned, out_aligned) is direct
    in_kernel = direct and head_dim != 192
    assert (direct and wgmma_direct_computes_delta(tiling)) is in_kernel
    plan = api.backward_plan(problem, layouts, api.Layout.contiguous((2, 4, seqlen_q), "float32"), False,
                             aligned=True, tiling=tiling, dq_aligned=dq_aligned, out_aligned=out_aligned)
    families = [key.split("/")[0] for key in stand_in_hopper]
    assert families == ([] if in_kernel else ["backward-preprocess"]) + ["backward-dkdv-wgmma"] + (
        [] if direct else ["backward-convert-dq"])
    assert stand_in_hopper[-1 if direct else -2].endswith("/direct-dq") is direct
    assert plan.kernel_count == len(families)
    mapped = {api.BACKWARD_SLOTS[slot] for slot, _ in plan._tensor_maps}
    assert mapped == {"dout.ptr", "q.ptr", "k.ptr", "v.ptr"} | (
        {"dq.ptr", "out.ptr"} if in_kernel else {"dq.ptr"} if direct else {"dq_accum"})
    # Direct: the accumulator's and counters' pointers, and delta's where the
    # kernel computes it, are never written (JAX passes buffers for them
    # anyway; nothing must zero or read them).
    unwritten = {slot for slot, writes in zip(api.BACKWARD_SLOTS, plan._writes) if not writes}
    assert unwritten == ({"dq_accum", "dq_semaphore"} | ({"delta"} if in_kernel else set()) if direct else set())
    buffers = api.backward_work_buffers(2, 4, seqlen_q, head_dim, tiling, False, direct=direct)
    assert set(buffers) == (set() if in_kernel else {"delta"} if direct else {"delta", "dq_accum", "dq_semaphore"})
    # No kernel known (JAX's buffers): delta is kept.
    assert set(api.backward_work_buffers(2, 4, seqlen_q, head_dim, None, False, direct=True)) == {"delta"}


@pytest.mark.parametrize("head_dim,direct", [(192, True), (64, False), (256, False)])
def test_direct_dq_maps_out_only_where_the_kernel_computes_delta(stand_in_hopper, head_dim, direct):
    """An out whose rows cannot take a tensor map (a row stride of head_dim
    + 1 elements, not a multiple of 16 bytes): where the one-key-block
    kernel computes delta from out's tiles it would map out, so the call
    takes the accumulated path; at head dim 192 the preprocessing kernel
    reads out as it is and the kernel maps dq alone, so dQ is still stored
    directly (two launches, out not among the maps)."""
    from cuflash._validation import contiguous_strides

    seqlen_q = 50
    padded = contiguous_strides((2, seqlen_q, 4, head_dim + 1))
    problem, layouts, tiling = _one_key_block_backward(head_dim, seqlen_q, 64, False, out_strides=padded)
    assert api.stores_dq_directly(problem, layouts, tiling, True, True) is direct
    plan = api.backward_plan(problem, layouts, api.Layout.contiguous((2, 4, seqlen_q), "float32"), False,
                             aligned=True, tiling=tiling)
    assert plan.kernel_count == (2 if direct else 3)
    mapped = {api.BACKWARD_SLOTS[slot] for slot, _ in plan._tensor_maps}
    assert "out.ptr" not in mapped and ("dq.ptr" in mapped) is direct


@pytest.mark.parametrize("head_dim,dq_aligned,out_aligned,launches", [
    (64, True, True, 1),      # direct, delta from out's tiles
    (64, True, False, 3),     # out would be mapped: accumulated
    (64, False, True, 3),     # dq cannot be mapped: accumulated
    (192, True, True, 2),     # direct after the preprocessing kernel
    (192, True, False, 2),    # out not mapped there: still direct
    (192, False, True, 3),
])
def test_jax_backward_plan_takes_dq_and_out_alignment_apart(stand_in_hopper, head_dim, dq_aligned, out_aligned,
                                                            launches):
    """Under JAX the plan of a backward's buffers is keyed by dq's and out's
    alignments apart (``cuflash.jax._BufferLauncher``), and ``_plan`` hands both to
    the launcher: out's matters only where the kernel maps it."""
    pytest.importorskip("jax")
    import cuflash.jax as cuflash_jax

    q_shape, kv_shape = (2, 50, 4, head_dim), (2, 64, 2, head_dim)
    shapes = dict(dout=q_shape, q=q_shape, k=kv_shape, v=kv_shape, out=q_shape, lse=(2, 4, 50), dq=q_shape,
                  dk=kv_shape, dv=kv_shape)
    shapes |= {name: shape for name, (shape, _) in cuflash_jax._work_buffers(q_shape).items()}
    names = api.BACKWARD_ARRAYS
    flags = ("backward", (False, (-1, -1), 0.0, 0.0), None, False)
    plan = cuflash_jax._plan(flags, [shapes.get(name) for name in names], "bfloat16", 0, names, True,
                             (dq_aligned, out_aligned))
    assert plan.kernel_count == launches


class _XlaBuffer:
    """What a buffer_callback hands the callback: shape, dtype and the CUDA
    array interface's address."""

    def __init__(self, shape, dtype, pointer):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.__cuda_array_interface__ = {"data": (pointer, False), "shape": shape}


class _RecordingPlan:
    def __init__(self, shapes):
        self.shapes, self.launches = shapes, []

    def launch(self, pointers, stream, slots=None):
        self.launches.append((list(pointers), stream, slots))


@pytest.mark.parametrize("optional", [(), ("alibi_slopes", "dropout_rng")], ids=["plain", "alibi-dropout"])
@pytest.mark.parametrize("lead", [(), (3,)], ids=["unmapped", "vmapped"])
@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_jax_callback_launches_its_buffers_plan(kind, lead, optional, monkeypatch, fresh_plans):
    """A JAX callback's buffers (a vmapped axis leading, the slopes and the
    dropout key among them or not) fill their own slots of the plan's
    arrays, the others null; a second call of the same shapes reuses the
    plan and writes only its buffers' slots; other shapes, another dtype,
    misaligned buffers or (backward) a misaligned dq alone get another
    plan, which knows the alignments; a buffer outside GPU memory is named
    in a TypeError before anything launches."""
    pytest.importorskip("jax")
    import cuflash.jax as cuflash_jax

    made = []

    def plan_of(flags, shapes, dtype, device, names, aligned, maps_aligned):
        made.append((dict(zip(names, shapes)), dtype, aligned, maps_aligned))
        return _RecordingPlan(shapes)

    monkeypatch.setattr(cuflash_jax, "_plan", plan_of)
    monkeypatch.setattr(cuflash_jax, "_device_of_pointer", lambda pointer: 0)
    monkeypatch.setattr(_interop, "current_device", lambda: 0)
    flags = (False, (-1, -1), 0.0, 0.1 if "dropout_rng" in optional else 0.0)
    q, kv, lse = (*lead, 2, 50, 4, 64), (*lead, 2, 64, 2, 64), (*lead, 2, 4, 50)
    extras = {"alibi_slopes": (*lead, 2, 4), "dropout_rng": (*lead, 2)}
    extras = {name: extras[name] for name in optional}
    if kind == "forward":
        callback = cuflash_jax._forward_callback(flags, 0.125, "ieee", optional)
        inputs, outputs = dict(q=q, k=kv, v=kv), dict(out=q, lse=lse)
        names = api.FORWARD_ARRAYS
    else:
        work = cuflash_jax._work_buffers(q)
        callback = cuflash_jax._backward_callback(flags, 0.125, False, optional, tuple(work))
        inputs = dict(dout=q, q=q, k=kv, v=kv, out=q, lse=lse)
        outputs = dict(dq=q, dk=kv, dv=kv) | {name: shape for name, (shape, _) in work.items()}
        names = api.BACKWARD_ARRAYS
    dtypes = {"lse": "float32", "delta": "float32", "dq_accum": "float32", "dq_semaphore": "int32",
              "alibi_slopes": "float32", "dropout_rng": "uint32"}

    def call(base, dtype="bfloat16", shapes=None, stream=7, offsets=None):
        shapes, offsets = shapes or {}, offsets or {}
        given = {name: _XlaBuffer(shapes.get(name, shape), dtypes.get(name, dtype),
                                  base + 4096 * i + offsets.get(name, 0))
                 for i, (name, shape) in enumerate((inputs | outputs | extras).items())}
        context = type("Context", (), {"stream": stream})()
        callback(context, [given[name] for name in outputs], *(given[name] for name in inputs | extras))
        return {name: buffer.__cuda_array_interface__["data"][0] for name, buffer in given.items()}

    pointers = call(1 << 20)
    assert len(made) == 1
    plan_shapes, dtype, aligned, maps_aligned = made[0]
    assert dtype == "bfloat16" and aligned and maps_aligned == ((True, True) if kind == "backward" else (False, False))
    assert {name: shape for name, shape in plan_shapes.items() if shape is not None} == inputs | outputs | extras
    plan = fresh_plans.get(next(iter(fresh_plans._entries)))
    written, stream, slots = plan.launches[-1]
    assert stream == 7 and slots is None  # a plan's first launch writes every slot
    assert {name: written[names.index(name)] for name in pointers} == pointers
    assert all(p == 0 for name, p in zip(names, written) if name not in pointers)

    pointers = call(2 << 20, stream=9)
    assert len(made) == 1
    written, stream, slots = plan.launches[-1]
    assert stream == 9 and sorted(slots) == sorted(names.index(name) for name in pointers)
    assert {name: written[names.index(name)] for name in pointers} == pointers

    first = next(iter(inputs))
    call(1 << 20, shapes={first: (*lead, 2, 51, 4, 64)})
    call(1 << 20, dtype="float16")
    call((1 << 20) + 8)
    assert len(made) == 4 and [m[1] for m in made[1:]] == ["bfloat16", "float16", "bfloat16"]
    assert not made[3][2]  # the misaligned call's plan knows it
    if kind == "backward":
        call(1 << 20, offsets={"dq": 8})
        assert len(made) == 5 and made[4][2:] == (True, (False, True))

    class HostBuffer:
        shape, dtype = q, np.dtype("bfloat16")

    context = type("Context", (), {"stream": 7})()
    count = len(made)
    with pytest.raises(TypeError, match=f"{first} is not in GPU memory"):
        callback(context, [HostBuffer() for _ in outputs], *(HostBuffer() for _ in inputs | extras))
    assert len(made) == count


def test_work_arena_lays_buffers_out_aligned_and_apart():
    """A backward's work buffers in one allocation: each at a 256-byte
    aligned offset (the alignment separate allocations had), none
    overlapping, the total covering the last."""
    buffers = api.backward_work_buffers(3, 5, 127, 64, None, False)
    arena = api.WorkArena.of(buffers)
    assert [name for name, *_ in arena.buffers] == list(buffers)
    ends = 0
    for name, shape, dtype, offset in arena.buffers:
        assert offset % 256 == 0 and offset >= ends and (shape, dtype) == tuple(buffers[name])
        ends = offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
    assert ends <= arena.nbytes < ends + 256
    assert api.WorkArena.of({}).nbytes == 0 and api.WorkArena.of({"x": ((0, 4), "float32")}).nbytes == 0


class _NumpyBridge:
    """Stands for a call's bridge on the CPU: outputs are NumPy arrays, laid
    out as ``Bridge.empty`` lays them out."""

    def empty(self, shape, dtype, like_strides=None):
        from cuflash._interop import dense_strides_like

        dtype = np.dtype(dtype)
        strides = (dense_strides_like(tuple(shape), tuple(like_strides)) if like_strides is not None
                   else api.contiguous_strides(tuple(shape)))
        size = max((n - 1) * s for n, s in zip(shape, strides)) + 1 if 0 not in shape else 0
        array = np.lib.stride_tricks.as_strided(np.empty(size, dtype), shape,
                                                tuple(s * dtype.itemsize for s in strides))
        return array, array


def test_heads_first_outputs_are_made_in_the_callers_axes():
    """With heads_first, an output is allocated (batch, nheads, seqlen,
    head_dim), dense like the caller's q, and the kernels' view of it is
    (batch, seqlen, nheads, head_dim); the log-sum-exp (3-D) is untouched,
    and what later calls allocate (shape, element strides) is the caller's."""
    views = {}
    q_heads_first_strides = (4 * 7 * 16, 7 * 16, 16, 1)  # a contiguous (2, 4, 7, 16) q ...
    kernel_like = (q_heads_first_strides[0], q_heads_first_strides[2], q_heads_first_strides[1], 1)  # ... as seen
    shape, dtype, strides, native = api._new_output(_NumpyBridge(), views, "out", (2, 7, 4, 16), "float16",
                                                    kernel_like, heads_first=True)
    assert shape == native.shape == (2, 4, 7, 16) and strides == q_heads_first_strides
    assert views["out"].shape == (2, 7, 4, 16) and np.shares_memory(views["out"], native)
    assert api._new_output(_NumpyBridge(), views, "lse", (2, 4, 7), "float32", None, heads_first=True)[0] == (2, 4, 7)
    plain = api._new_output(_NumpyBridge(), {}, "out", (2, 7, 4, 16), "float16", kernel_like)
    assert plain[0] == (2, 7, 4, 16) and plain[2] == kernel_like


def test_heads_first_views_are_swapped_and_other_ranks_refused():
    views = {"q": np.zeros((2, 4, 7, 16)), "k": np.zeros((2, 1, 9, 16)), "lse": np.zeros((2, 4, 7))}
    api._seqlen_first_views(views, ("q", "k", "v", "out"))
    assert views["q"].shape == (2, 7, 4, 16) and views["k"].shape == (2, 9, 1, 16) and views["lse"].shape == (2, 4, 7)
    with pytest.raises(ValueError, match=r"v must be \(batch, nheads, seqlen, head_dim\) with heads_first=True, "
                                         r"got shape \(9, 16\)"):
        api._seqlen_first_views({"v": np.zeros((9, 16))}, ("v",))


def test_work_arena_views_lie_inside_one_allocation():
    buffers = {"delta": ((4, 33), "float32"), "dq_accum": ((33, 4, 8), "float32"), "dq_semaphore": ((1, 4, 2), "int32")}
    arena = api.WorkArena.of(buffers)
    views = {}
    arena.allocate(_NumpyBridge(), views)
    for name, (shape, dtype) in buffers.items():
        assert views[name].shape == shape and views[name].dtype == np.dtype(dtype)
        assert views[name].flags.c_contiguous
    starts = sorted((views[name].__array_interface__["data"][0], name) for name in buffers)
    origin = starts[0][0]
    assert [start - origin for start, _ in starts] == [offset for _, _, _, offset in arena.buffers]


def test_plan_rejects_a_struct_it_cannot_address():
    with pytest.raises(KeyError, match="no field 'bogus.ptr'"):
        LaunchPlan(0, [_forward_struct()], ("bogus.ptr",), [])
    with pytest.raises(ValueError, match="one element"):
        LaunchPlan(0, [np.zeros(2, dtype=FORWARD_PARAMS)], api.FORWARD_SLOTS, [])
    with pytest.raises(KeyError, match="struct 0 has no field 'partial.ptr'"):
        LaunchPlan(0, [_forward_struct()], (((0, "partial.ptr"),),), [])


def test_plan_cache_is_bounded_and_least_recently_used_goes_first():
    cache = PlanCache(max_entries=3)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("d", "D")
    assert cache.get("b") is None and [cache.get(k) for k in "acd"] == ["A", "C", "D"]
    assert len(cache) == 3
    # refresh: only the entry kept under the key, which becomes the most recent (as get makes it)
    a, c = cache.get("a"), cache.get("c")  # c is now the most recent
    assert cache.refresh("a", a) and not cache.refresh("a", "other") and not cache.refresh("b", "B")
    cache.put("e", "E")
    assert cache.get("d") is None and cache.get("a") is a
    cache.shortcuts["short"] = c
    cache.clear()
    assert len(cache) == 0 and not cache.shortcuts and not cache.refresh("a", a)
    with pytest.raises(ValueError, match="at least 1"):
        PlanCache(0)


def test_signature_refuses_unknown_classes_and_unhashable_flags():
    assert api._signature("forward", [np.zeros(3)] + [None] * 4, ())[0] is None  # NumPy: full path, clear error
    key, pointers = api._signature("forward", [None] * 5, ([],))
    assert api._cached_call(key, [None] * 5, pointers) is None  # an unhashable flag: the full path explains it
    key, pointers = api._signature("forward", [None] * 5, (bool, True))
    assert pointers == [0] * 5 and key == ("forward", (None,) * 5, (bool, True), True)
    assert not api.pointers_aligned("backward", [0, 16, 32, 8, 0, 0, 0, 64, 80, 0, 0])  # v misaligned
    assert api.pointers_aligned("backward", [0, 16, 32, 48, 4, 4, 0, 64, 80, 4, 0])  # out, lse, delta are not copied


class _LaneArray:
    """A fast-lane array stand-in: its signature part is its layout."""

    def __init__(self, pointer, layout="dense"):
        self.pointer, self.layout = pointer, layout


class _RecordedPlan:
    """A plan stand-in recording the pointers of the slots each launch writes."""

    def __init__(self, device=0):
        self.device, self.launches = device, []

    def launch(self, pointers, stream, slots=None):
        self.launches.append(([pointers[i] for i in slots], stream))


def test_backward_following_runs_the_remembered_call_on_six_pointers(monkeypatch):
    """A backward after a cached forward looks its plan up on the forward's
    call by dout's signature part, alignment and ``deterministic``: the
    first takes attention_backward's path (``_backward``) and is
    remembered, the next runs it on dout, q, k, v, out, lse (the slots it
    writes all ints: absent arrays' slots are not written); a misaligned
    dout, another deterministic flag, another current device or no forward
    call take the signature path again; a forward keeps at most 16."""
    monkeypatch.setitem(_interop.SIGNATURES, _LaneArray, lambda x: (x.layout, x.pointer))
    monkeypatch.setitem(_interop.POINTERS, _LaneArray, lambda x: x.pointer)
    device = {"current": 0}

    def follower_call(plan):
        outputs = tuple((index, lambda index=index: (f"grad{index}", 0x1000 * index)) for index in (6, 7, 8))
        live = (0, 1, 2, 3, 4, 5, 6, 7, 8, api.BACKWARD_ARRAYS.index("dropout_offset"))
        return api.CachedCall(plan, outputs, None, live, lambda: 99, lambda: device["current"])

    general = []

    def signature_path(*args):
        general.append(args)
        plan = _RecordedPlan()
        follower = follower_call(plan)
        arrays = list(args[:6]) + [None] * (len(api.BACKWARD_ARRAYS) - 6)
        follower.run(arrays, [0] * len(arrays))
        return arrays, follower

    monkeypatch.setattr(api, "_backward", signature_path)
    forward = api.CachedCall(_RecordedPlan(), (), None, (), lambda: 0, lambda: 0)
    q, k, v, out, lse = (_LaneArray(0x100 * i) for i in range(1, 6))
    flags = dict(causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0, heads_first=True)

    def backward(dout, deterministic=False, call=forward):
        return api.backward_following(call, dout, q, k, v, out, lse, deterministic=deterministic, **flags)

    assert backward(_LaneArray(0x700)) == ("grad6", "grad7", "grad8") and len(general) == 1
    assert general[0][6:] == (True, None, (-1, -1), 0.0, None, 0.0, None, 0, None, None, None, False, None, None, None,
                              True)
    follower = forward.followers[("dense", True, False)]
    assert backward(_LaneArray(0x800)) == ("grad6", "grad7", "grad8") and len(general) == 1
    assert follower.plan.launches[-1] == ([0x800, 0x100, 0x200, 0x300, 0x400, 0x500, 0x6000, 0x7000, 0x8000, 0], 99)
    backward(_LaneArray(0x808))  # misaligned dout: a plan of its own
    backward(_LaneArray(0x800), deterministic=True)
    backward(_LaneArray(0x800, layout="strided"))
    assert len(general) == 4 and len(forward.followers) == 4
    device["current"] = 1
    backward(_LaneArray(0x800))
    assert len(general) == 5
    device["current"] = 0
    backward(_LaneArray(0x800), call=None)
    assert len(general) == 6
    for i in range(api._MAX_FOLLOWERS):
        backward(_LaneArray(0x800, layout=i))
    assert len(forward.followers) <= api._MAX_FOLLOWERS


def _plain_forward_call(device, key):
    """A forward's cached call stand-in (kept in ``api.plans`` under
    ``key``) that allocates out and lse and records its launches."""
    outputs = tuple((index, lambda index=index: (f"out{index}", 0x1000 * index)) for index in (3, 4))
    live = (0, 1, 2, 3, 4, api.FORWARD_ARRAYS.index("dropout_offset"))
    call = api.CachedCall(_RecordedPlan(), outputs, None, live, lambda: 99, lambda: device["current"], key=key)
    api.plans.put(key, call)
    return call


def test_forward_plain_runs_the_cached_call_on_three_signatures(monkeypatch):
    """A forward without variants (the differentiable route's) that ran
    from a cached call is remembered under q's, k's and v's signature parts,
    their alignment and the flags (their classes too): the next such call
    runs it on three pointers without _attention, and keeps it recent in the
    plan cache; other parts, a misaligned q, k or v, other flags or flag
    classes, another current device, a cleared plan cache, a call evicted
    from it or a call that did not run from a cached call take _attention's
    path; at most 64 are kept."""
    from cuflash._launch import PlanCache

    monkeypatch.setitem(_interop.SIGNATURES, _LaneArray, lambda x: (x.layout, x.pointer))
    monkeypatch.setattr(api, "plans", PlanCache())
    device = {"current": 0}
    signature_path = []

    def attention(*args):
        signature_path.append(args)
        # The first call plans (no cached call); the others are cached, each under a key of its own.
        call = _plain_forward_call(device, len(signature_path)) if len(signature_path) > 1 else None
        arrays = [*args[:3], None, None, *api._PLAIN_FORWARD_REST]
        (call or _plain_forward_call(device, "planned")).run(arrays, [0] * len(arrays))
        return arrays, call

    monkeypatch.setattr(api, "_attention", attention)
    q, k, v = (_LaneArray(0x100 * i) for i in range(1, 4))

    def forward(q=q, k=k, v=v, causal=True, scale=None, precision="ieee", heads_first=True):
        return api.forward_plain(q, k, v, causal, scale, precision, heads_first)

    assert forward()[:2] == ("out3", "out4") and forward()[2] is not None and len(signature_path) == 2
    assert signature_path[0][3:] == (True, None, *api.Variants().values(), True, None, None, "ieee", None, True)
    out, lse, call = forward(q=_LaneArray(0x400))
    assert (out, lse) == ("out3", "out4") and len(signature_path) == 2
    assert call.plan.launches[-1] == ([0x400, 0x200, 0x300, 0x3000, 0x4000, 0], 99)
    others = (dict(causal=False), dict(causal=1), dict(scale=0.5), dict(scale=np.float64(0.5)),
              dict(precision="3xtf32"), dict(heads_first=False), dict(heads_first=1), dict(q=_LaneArray(0x408)),
              dict(q=_LaneArray(0x400, "strided")), dict(k=_LaneArray(0x200, "strided")),
              dict(v=_LaneArray(0x300, "strided")))
    for other in others:
        before = len(signature_path)
        forward(**other)
        assert len(signature_path) == before + 1, other
    # One alignment bit for the three, as in _attention's key: a misaligned k or v finds the misaligned q's call.
    before = len(signature_path)
    misaligned = forward(q=_LaneArray(0x408))[2]
    assert forward(k=_LaneArray(0x208))[2] is misaligned and forward(v=_LaneArray(0x304))[2] is misaligned
    assert misaligned.plan.launches[-1][0][:3] == [0x100, 0x200, 0x304] and len(signature_path) == before
    assert forward(scale=np.float64(0.5))[2] is not forward(scale=0.5)[2]  # each class its own call
    monkeypatch.setattr(api, "plans", PlanCache(max_entries=4))
    forward()  # cached (the stand-in's calls after the first are) and remembered
    for _ in range(2 * api.plans.max_entries):  # the remembered call stays recent: never evicted by the others
        before = len(signature_path)
        forward()
        forward(causal=len(signature_path))  # a new flag value: a plan of its own
        assert len(signature_path) == before + 1
    device["current"] = 1
    before = len(signature_path)
    forward()
    assert len(signature_path) == before + 1
    device["current"] = 0
    api.plans.clear()
    forward()
    assert len(signature_path) == before + 2
    cached = forward()[2]
    for i in range(api.plans.max_entries):  # evicted by four other plans: no longer served
        forward(causal=f"other{i}")
    assert api.plans.get(cached.key) is None
    forward()
    assert len(signature_path) == before + 3 + api.plans.max_entries
    monkeypatch.setattr(api, "plans", PlanCache())
    for i in range(api._MAX_PLAIN_FORWARDS + 1):
        forward(q=_LaneArray(0x400, layout=i))
    assert len(api.plans.shortcuts) <= api._MAX_PLAIN_FORWARDS
    before = len(signature_path)
    assert api.forward_plain(q, k, v, True, [], "ieee", True)[0] == "out3"  # an unhashable flag: _attention's path
    assert len(signature_path) == before + 1
    # Without the log-sum-exp: a short key of its own, whose call runs on the three pointers and returns no lse.
    monkeypatch.setattr(api, "plans", PlanCache())
    with_lse = forward()[2]
    before = len(signature_path)
    plain = api.forward_plain(q, k, v, True, None, "ieee", True, False)
    assert plain[:2] == ("out3", None) and plain[2] is not with_lse and len(signature_path) == before + 1
    assert signature_path[-1][3 + len(api.Variants().values()) + 2] is False
    out, lse, call = api.forward_plain(_LaneArray(0x500), k, v, True, None, "ieee", True, False)
    assert (out, lse, call) == ("out3", None, plain[2]) and len(signature_path) == before + 1
    assert call.plan.launches[-1] == ([0x500, 0x200, 0x300, 0x3000, 0x4000, 0], 99)
    assert forward()[2] is with_lse and len(signature_path) == before + 1


def test_attention_without_options_takes_the_short_key(monkeypatch):
    """``cuflash.attention`` with every option left as its default runs
    through forward_plain (q, k, v, the flags and whether lse is returned:
    a plan fixed by those); an option given, even ``out``, ``num_splits``
    or a non-bool ``return_lse``, takes _attention's full path with every
    argument as given."""
    taken = []

    def forward_plain(q, k, v, causal, softmax_scale, fp32_precision, heads_first, return_lse=True):
        taken.append(("plain", causal, softmax_scale, fp32_precision, heads_first, return_lse))
        return "out", "lse" if return_lse else None, None

    def attention(*args):
        taken.append(("full", *args[3:]))
        return [*args[:3], "out", "lse"], None

    monkeypatch.setattr(api, "forward_plain", forward_plain)
    monkeypatch.setattr(api, "_attention", attention)
    q = k = v = object()
    assert api.attention(q, k, v) == "out"
    assert api.attention(q, k, v, causal=True, softmax_scale=0.5, fp32_precision="3xtf32", heads_first=True,
                         return_lse=True) == ("out", "lse")
    assert taken == [("plain", False, None, "ieee", False, False), ("plain", True, 0.5, "3xtf32", True, True)]
    options = [dict(window_size=(4, 0)), dict(softcap=30.0), dict(alibi_slopes="slopes"), dict(dropout_p=0.1),
               dict(dropout_seed=1), dict(dropout_offset=3), dict(score_mod="score"), dict(mask_mod="mask"),
               dict(mod_arrays={}), dict(out="out"), dict(lse="lse"), dict(num_splits=1), dict(return_lse=1),
               dict(window_size=[-1, -1])]
    for option in options:
        taken.clear()
        api.attention(q, k, v, **option)
        assert len(taken) == 1 and taken[0][0] == "full", option
        name, value = next(iter(option.items()))
        position = ["window_size", "softcap", "alibi_slopes", "dropout_p", "dropout_seed", "dropout_offset",
                    "score_mod", "mod_arrays", "mask_mod", "return_lse", "out", "lse", "fp32_precision",
                    "num_splits", "heads_first"].index(name)
        assert taken[0][3 + position] is value, option


def test_forward_plain_short_keys_fix_attentions_keys(monkeypatch):
    """Two forwards without variants share forward_plain's short key
    exactly where _attention's real plan-cache keys are equal, over calls
    that differ in each array's layout, dtype, device and alignment, in
    each flag's value and class and in whether the log-sum-exp is returned."""
    from cuflash._launch import PlanCache

    class _Array:
        def __init__(self, pointer=0x100, part="dense"):
            self.pointer, self.part = pointer, part

    monkeypatch.setitem(_interop.SIGNATURES, _Array, lambda x: (x.part, x.pointer))
    full_keys = []

    def cached_call(key, arrays, pointers):
        full_keys.append(key)
        return _plain_forward_call({"current": 0}, key)

    monkeypatch.setattr(api, "_cached_call", cached_call)
    base = dict(q=_Array(), k=_Array(0x200), v=_Array(0x300), causal=True, scale=None, precision="ieee",
                heads_first=True, return_lse=True)
    changes = [{}, dict(q=_Array(0x1100)), dict(q=_Array(0x108)), dict(k=_Array(0x208)), dict(v=_Array(0x304)),
               dict(q=_Array(part="strided")), dict(k=_Array(0x200, "bf16")), dict(v=_Array(0x300, "gpu1")),
               dict(causal=False), dict(causal=1), dict(scale=0.5), dict(scale=1), dict(scale=np.float32(0.5)),
               dict(precision="3xtf32"), dict(heads_first=False), dict(heads_first=1), dict(return_lse=False)]
    pairs = []
    for change in changes:
        monkeypatch.setattr(api, "plans", PlanCache())
        call = dict(base, **change)
        api.forward_plain(call["q"], call["k"], call["v"], call["causal"], call["scale"], call["precision"],
                          call["heads_first"], call["return_lse"])
        (short_key,) = api.plans.shortcuts
        pairs.append((short_key, full_keys[-1]))
    for short_a, full_a in pairs:
        for short_b, full_b in pairs:
            assert (short_a == short_b) == (full_a == full_b)
    # All distinct but the pointer moved within its layout, and the three misaligned calls (one alignment bit).
    assert len({full for _, full in pairs}) == len(changes) - 3


# --- on the GPU ---

def _cupy():
    return pytest.importorskip("cupy")


def _check_forward(out, q, k, v, causal=False):
    """``out`` against float64, with the same-precision baseline (CuPy inputs)."""
    scale = 1 / np.sqrt(q.shape[-1])
    assert_output_accurate(out, attention_reference(q, k, v, causal=causal)[0],
                           naive_attention_same_precision(q, k, v, causal=causal, softmax_scale=scale))


@pytest.fixture
def fresh_plans(monkeypatch):
    """An empty plan cache of its own for one test."""
    monkeypatch.setattr(api, "plans", PlanCache())
    return api.plans


@pytest.fixture
def full_path_counter(monkeypatch):
    """Counts calls that took the full (validating, planning) path."""
    counts = {"forward": 0, "backward": 0}
    forward, backward = api._attention_forward, api._attention_backward

    def counted_forward(*args, **kwargs):
        counts["forward"] += 1
        return forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        counts["backward"] += 1
        return backward(*args, **kwargs)

    monkeypatch.setattr(api, "_attention_forward", counted_forward)
    monkeypatch.setattr(api, "_attention_backward", counted_backward)
    return counts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_second_call_of_a_signature_reuses_its_plan(dtype, fresh_plans, full_path_counter):
    cupy = _cupy()
    import cuflash

    q, k, v = random_qkv(cupy, 2, 127, 130, 4, 2, 64, cupy.dtype(dtype), seed=1)
    first, first_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert full_path_counter["forward"] == 1 and len(fresh_plans) == 1
    q2, k2, v2 = random_qkv(cupy, 2, 127, 130, 4, 2, 64, cupy.dtype(dtype), seed=2)  # new pointers, same signature
    out, lse = cuflash.attention(q2, k2, v2, causal=True, return_lse=True)
    assert full_path_counter["forward"] == 1 and len(fresh_plans) == 1
    again = cuflash.attention(q, k, v, causal=True, return_lse=True)[0]
    assert bool((again == first).all())  # bitwise: same plan, same inputs
    _check_forward(out, q2, k2, v2, causal=True)
    dout = cupy.asarray(np.random.default_rng(3).standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    for _ in range(2):
        grads = cuflash.attention_backward(dout, q2, k2, v2, out, lse, causal=True)
    assert full_path_counter["backward"] == 1 and len(fresh_plans) == 2
    baselines = naive_attention_backward_same_precision(dout, q2, k2, v2, causal=True, softmax_scale=1 / 8)
    for got, want, base in zip(grads, attention_backward_reference(dout, q2, k2, v2, causal=True), baselines):
        assert_output_accurate(got, want, base)


@pytest.mark.gpu
def test_plan_does_not_serve_other_strides(fresh_plans):
    cupy = _cupy()
    import cuflash

    for layout in ("bshd", "bhsd", "sliced"):
        q, k, v = random_qkv(cupy, 2, 100, 90, 4, 4, 64, cupy.float16, layout=layout, seed=4)
        out = cuflash.attention(q, k, v)
        _check_forward(out, q, k, v)
        # The output is laid out like q (dimension order), dense.
        assert np.argsort(out.strides).tolist() == np.argsort(q.strides, kind="stable").tolist() or layout == "sliced"
    assert len(fresh_plans) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_plan_for_aligned_pointers_does_not_serve_misaligned_ones(head_dim, fresh_plans):
    """Same shapes and strides, one pointer 2 bytes off a 16-byte boundary:
    the tensor-core kernels' 16-byte copies would be misaligned there, so
    the call must get a plan of its own (the SIMT kernel)."""
    cupy = _cupy()
    import cuflash

    shape = (2, 70, 4, head_dim)
    size = int(np.prod(shape))
    rng = np.random.default_rng(5)
    buffers = [cupy.asarray(rng.standard_normal(size + 8).astype(np.float32)).astype(cupy.float16) for _ in range(3)]
    aligned = [b[:size].reshape(shape) for b in buffers]
    shifted = [aligned[0], aligned[1], buffers[2][1:size + 1].reshape(shape)]  # v misaligned, same strides
    assert shifted[2].strides == aligned[2].strides and shifted[2].data.ptr % 16 == 2
    for arrays in (aligned, shifted, aligned):
        out = cupy.full(shape, cupy.nan, dtype=cupy.float16)
        cuflash.attention(*arrays, causal=True, out=out)
        _check_forward(out, *arrays, causal=True)
    assert len(fresh_plans) == 2
    alignment_bits = sorted(key[-1] for key in fresh_plans._entries)
    assert alignment_bits == [False, True]


@pytest.mark.gpu
def test_plan_does_not_serve_other_flags_or_bad_input(fresh_plans, monkeypatch):
    cupy = _cupy()
    import cuflash

    q, k, v = random_qkv(cupy, 1, 50, 64, 2, 2, 32, cupy.float32, seed=6)
    for causal, scale in ((True, None), (False, None), (True, 0.3), (True, np.float64(0.3))):
        out = cuflash.attention(q, k, v, causal=causal, softmax_scale=scale)
        assert_output_accurate(out, attention_reference(q, k, v, causal=causal, softmax_scale=scale)[0])
    assert len(fresh_plans) == 4
    monkeypatch.setattr(LaunchPlan, "launch", lambda *a, **k: pytest.fail("launched on bad input"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash.attention(q, k, v, causal=1)  # equal to True and hashed alike, but not a bool
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        cuflash.attention(q, k, v, softmax_scale=True)
    with pytest.raises(TypeError, match="k must have the same dtype as q"):
        cuflash.attention(q, k.astype(cupy.float16), v)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        cuflash.attention(q, k, v, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cuflash.attention_backward(q, q, k, v, q, cupy.zeros((1, 2, 50), cupy.float32), deterministic="yes")


@pytest.mark.gpu
def test_cached_plan_runs_on_the_stream_of_each_call(fresh_plans):
    """Warm the plan on one stream, then call from another stream whose
    inputs are written behind a long spin: the call must run behind it."""
    cupy = _cupy()
    import cuflash

    spin = cupy.RawKernel(SPIN_AND_COPY, "spin_and_copy")
    rng = cupy.random.default_rng(7)
    q_src, k, v = (rng.standard_normal((2, 300, 4, 64), dtype=cupy.float32) for _ in range(3))
    cuflash.attention(q_src, k, v, causal=True, return_lse=True)  # plan made on the default stream
    cupy.cuda.Device().synchronize()
    for _ in range(2):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            q = cupy.zeros_like(q_src)
            spin((64,), (256,), (q_src, q, np.int64(q.size), np.int64(300_000_000)))
            out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            dq = cuflash.attention_backward(cupy.ones_like(out), q, k, v, out, lse, causal=True)[0]
            stream.synchronize()
        assert_output_accurate(out, attention_reference(q_src, k, v, causal=True)[0])
        assert_output_accurate(dq, attention_backward_reference(cupy.ones_like(out), q_src, k, v, causal=True)[0])
    assert len(fresh_plans) == 2


@pytest.mark.gpu
def test_torch_cached_plan_runs_on_the_current_stream(fresh_plans):
    torch = pytest.importorskip("torch")
    import cuflash

    gen = torch.Generator(device="cuda").manual_seed(8)
    q_src, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cuflash.attention(q_src, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q = torch.zeros_like(q_src)
        torch.cuda._sleep(200_000_000)
        q.copy_(q_src)
        out = cuflash.attention(q, k, v)
        result = out.clone()
    side.synchronize()
    import cupy

    views = [cupy.from_dlpack(x) for x in (q_src, k, v)]
    _check_forward(cupy.from_dlpack(result), *views)
    assert len(fresh_plans) == 1


@pytest.mark.gpu
def test_torch_cached_calls_allocate_outputs_and_one_work_buffer(fresh_plans):
    """A cached forward allocates its output and log-sum-exp (or, without
    return_lse, one work allocation holding the latter), a cached backward
    dq, dk, dv and one allocation for its work buffers (delta, the float32
    dQ accumulator, counters), from PyTorch's caching allocator; the
    gradients stay right when the arena is reused by the next call."""
    torch = pytest.importorskip("torch")
    import cupy
    import cuflash

    gen = torch.Generator(device="cuda").manual_seed(10)
    q, k, v, dout = (torch.randn(2, 130, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert len(fresh_plans) == 2

    def allocations(call):
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        result = call()
        return torch.cuda.memory_stats()["allocation.all.allocated"] - before, result

    count, (out, lse) = allocations(lambda: cuflash.attention(q, k, v, causal=True, return_lse=True))
    assert count == 2
    for _ in range(2):  # without return_lse the log-sum-exp goes into the work allocation
        count, alone = allocations(lambda: cuflash.attention(q, k, v, causal=True))
        assert count == 2 and torch.equal(alone, out)
    assert len(fresh_plans) == 3
    for _ in range(2):
        count, grads = allocations(lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True))
        assert count == 4 and len(fresh_plans) == 3
    views = [cupy.from_dlpack(x) for x in (dout, q, k, v)]
    baselines = naive_attention_backward_same_precision(*views, causal=True, softmax_scale=1 / 8)
    for got, want, base in zip(grads, attention_backward_reference(*views, causal=True), baselines):
        assert_output_accurate(cupy.from_dlpack(got), want, base)


@pytest.mark.gpu
def test_heads_first_calls_match_seqlen_first_ones(fresh_plans):
    """heads_first=True takes (batch, nheads, seqlen, head_dim) arrays and
    gives outputs so laid out, bitwise equal to the same call on the
    swapped views, on the full path and from the cached plan; its plans are
    its own; a 3-D array is refused naming it."""
    cupy = _cupy()
    import cuflash

    q, k, v = random_qkv(cupy, 2, 77, 90, 4, 2, 64, cupy.float16, seed=11)
    dout = cupy.asarray(np.random.default_rng(12).standard_normal(q.shape)).astype(q.dtype)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    first = [x.swapaxes(1, 2) for x in (q, k, v, dout, out)]
    for call in range(2):
        hq, hk, hv, hdout, _ = (cupy.ascontiguousarray(x) for x in first)  # new pointers each call
        h_out, h_lse = cuflash.attention(hq, hk, hv, causal=True, return_lse=True, heads_first=True)
        assert h_out.shape == hq.shape and h_out.strides == hq.strides
        assert bool((h_out == first[4]).all()) and bool((h_lse == lse).all())
        h_grads = cuflash.attention_backward(hdout, hq, hk, hv, h_out, h_lse, causal=True, heads_first=True)
        for got, like, want in zip(h_grads, (hq, hk, hv), grads):
            assert got.shape == like.shape and got.strides == like.strides
            cupy.testing.assert_allclose(got.swapaxes(1, 2), want, atol=2e-3, rtol=0)  # dq: float32 atomics
    assert len(fresh_plans) == 4
    with pytest.raises(ValueError, match=r"k must be \(batch, nheads, seqlen, head_dim\) with heads_first"):
        cuflash.attention(hq, hk[0], hv, heads_first=True)
    with pytest.raises(TypeError, match="heads_first must be a bool"):
        cuflash.attention(hq, hk, hv, heads_first=1)


@pytest.mark.gpu
def test_plan_does_not_serve_another_device(fresh_plans):
    cupy = _cupy()
    import cuflash

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs 2 GPUs")
    results = []
    for device in (0, 1, 0):
        with cupy.cuda.Device(device):
            q, k, v = random_qkv(cupy, 1, 64, 64, 2, 2, 64, cupy.float16, seed=9)
            out = cuflash.attention(q, k, v)
            assert out.device.id == device
            results.append(out.get())
    with cupy.cuda.Device(0):
        q, k, v = random_qkv(cupy, 1, 64, 64, 2, 2, 64, cupy.float16, seed=9)
    with cupy.cuda.Device(1):  # arrays on GPU 0, GPU 1 current: the plan of GPU 0 on the full path
        out = cuflash.attention(q, k, v)
    assert out.device.id == 0 and np.array_equal(out.get(), results[0])
    assert np.array_equal(results[0], results[1]) and len(fresh_plans) == 2


def test_launch_module_names_no_framework():
    """The plan machinery is framework-neutral: only interop knows frameworks."""
    import inspect

    source = inspect.getsource(_launch)
    assert "torch" not in source and "jax" not in source
