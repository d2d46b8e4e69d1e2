"""Tensor maps of the Hopper forward (cuflash/_tensor_maps.py): the geometry
handed to cuTensorMapEncodeTiled, encoding in place inside a plan's struct,
and re-encoding only for a changed pointer. The driver function is replaced
by a recorder here; tests/test_forward_wgmma_gpu.py runs the real one."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuflash import api
from cuflash._launch import KernelLaunch, LaunchPlan
from cuflash._params import NO_VARIANT, WGMMA_FORWARD_PARAMS, pack
from cuflash._tensor_maps import TensorMapEncoder, TensorMapError, TileBox, map_geometry
from cuflash._tiling import widest_swizzle_bytes


def _byte_strides(shape, order, itemsize=2):
    """Byte strides of a (batch, seqlen, heads, dim) view of a dense array
    stored with its dimensions in ``order`` (outermost first)."""
    strides, step = {}, itemsize
    for axis in reversed(order):
        strides[axis] = step
        step *= shape[axis]
    return tuple(strides[axis] for axis in range(4))


def test_geometry_of_the_flash_layout_is_innermost_first():
    shape = (3, 1000, 8, 128)  # (batch, seqlen, heads, head_dim), heads after seqlen in memory
    strides = _byte_strides(shape, (0, 1, 2, 3))
    dims, byte_strides, box = map_geometry(shape, strides, TileBox(rows=128, cols=128))
    assert dims == (128, 1000, 8, 3)
    assert byte_strides == (8 * 128 * 2, 128 * 2, 1000 * 8 * 128 * 2)  # seqlen, heads, batch
    assert box == (64, 128, 1, 1)  # one 128-byte swizzle panel of 128 rows


def test_geometry_of_an_sdpa_layout_view():
    shape = (2, 17, 4, 96)  # viewed as (batch, seqlen, heads, dim), stored (batch, heads, seqlen, dim)
    strides = _byte_strides(shape, (0, 2, 1, 3))
    dims, byte_strides, box = map_geometry(shape, strides, TileBox(rows=48, cols=96))
    assert dims == (96, 17, 4, 2)
    assert byte_strides == (96 * 2, 17 * 96 * 2, 4 * 17 * 96 * 2)
    assert box == (32, 48, 1, 1)  # 96 columns: 64-byte panels of 32


@pytest.mark.parametrize("cols,expected", [(32, 64), (64, 128), (96, 64), (128, 128), (192, 128), (256, 128),
                                           (48, 32), (16, 32)])
def test_swizzle_widths_match_the_kernels_tiles(cols, expected):
    assert widest_swizzle_bytes(cols) == expected
    assert TileBox(rows=64, cols=cols).panel_cols * 2 == expected


def test_dimensions_of_one_entry_take_any_stride():
    # One sequence entry and one head: their strides are never stepped over
    # (here 8 bytes, which the driver would refuse), the map gets a granule.
    shape = (2, 1, 1, 64)
    dims, byte_strides, _ = map_geometry(shape, (128, 8, 8, 2), TileBox(rows=64, cols=64))
    assert dims == (64, 1, 1, 2) and byte_strides == (16, 16, 128)


@pytest.mark.parametrize("strides", [(4096, -256, 64, 2), (4096, 264, 8, 2), (0, 256, 64, 2)])
def test_strides_a_map_cannot_describe_are_refused(strides):
    shape = (2, 8, 4, 32)
    with pytest.raises(ValueError, match="positive strides that are multiples of 16 bytes"):
        map_geometry(shape, strides, TileBox(rows=64, cols=32))


class _RecordedEncode:
    def __init__(self, status=0):
        self.calls = []
        self.status = status

    def __call__(self, address, data_type, rank, pointer, dims, strides, box, element_strides, interleave, swizzle,
                 promotion, fill):
        self.calls.append({
            "address": address.value, "data_type": data_type, "rank": rank, "pointer": pointer.value,
            "dims": list(dims), "strides": list(strides), "box": list(box),
            "element_strides": list(element_strides), "interleave": interleave, "swizzle": swizzle, "fill": fill,
        })
        # Writes a recognisable pattern where the map goes, as the driver would write the map.
        ctypes.memset(address.value, 0xAB, 128)
        return self.status


def _aligned_buffer():
    storage = np.zeros(128 + 64, dtype=np.uint8)
    start = -storage.ctypes.data % 64
    return storage, storage.ctypes.data + start


def test_encoder_passes_the_geometry_and_encodes_only_new_pointers():
    storage, address = _aligned_buffer()
    recorded = _RecordedEncode()
    shape = (2, 300, 4, 128)
    encoder = TensorMapEncoder(address, "bfloat16", shape, _byte_strides(shape, (0, 1, 2, 3)),
                               TileBox(rows=128, cols=128), encode=recorded)
    encoder.encode(0x7000)
    encoder.encode(0x7000)  # same pointer: the map in place is still right
    encoder.encode(0x9000)
    assert [call["pointer"] for call in recorded.calls] == [0x7000, 0x9000]
    call = recorded.calls[0]
    assert call["address"] == address and call["rank"] == 4 and call["data_type"] == 9  # bfloat16
    assert call["dims"] == [128, 300, 4, 2] and call["box"] == [64, 128, 1, 1]
    assert call["strides"] == [4 * 128 * 2, 128 * 2, 300 * 4 * 128 * 2]
    assert call["element_strides"] == [1, 1, 1, 1] and call["interleave"] == 0
    assert call["swizzle"] == 3 and call["fill"] == 0  # 128-byte swizzle; zeros out of bounds
    assert storage[address - storage.ctypes.data] == 0xAB


def test_encoder_copies_back_the_maps_of_recent_pointers():
    storage, address = _aligned_buffer()
    calls = []

    def encode(address_arg, data_type, rank, pointer, *rest):
        calls.append(pointer.value)
        # A map that depends on the pointer, as the driver's does.
        ctypes.memset(address_arg.value, pointer.value >> 12, 128)
        return 0

    encoder = TensorMapEncoder(address, "float16", (1, 64, 1, 64), (8192, 128, 128, 2), TileBox(rows=64, cols=64),
                               encode=encode, remembered=2)
    offset = address - storage.ctypes.data
    for pointer in (0x1000, 0x2000, 0x1000, 0x3000, 0x2000):
        encoder.encode(pointer)
        assert (storage[offset:offset + 128] == pointer >> 12).all()
    # 0x1000 came back while remembered; 0x2000 had been pushed out by 0x1000 and 0x3000.
    assert calls == [0x1000, 0x2000, 0x3000, 0x2000]


def test_encoder_reports_a_refusal_and_tries_again_next_call():
    _, address = _aligned_buffer()
    recorded = _RecordedEncode(status=1)
    encoder = TensorMapEncoder(address, "float16", (1, 64, 1, 64), (8192, 128, 128, 2),
                               TileBox(rows=64, cols=64), encode=recorded)
    with pytest.raises(TensorMapError, match=r"CUresult 1\) for dims \[64, 64, 1, 1\]"):
        encoder.encode(0x1000)
    with pytest.raises(TensorMapError):
        encoder.encode(0x1000)  # not remembered as encoded
    assert len(recorded.calls) == 2 and recorded.calls[0]["data_type"] == 6  # float16


def test_encoder_refuses_misaligned_addresses():
    storage, address = _aligned_buffer()
    with pytest.raises(ValueError, match="64-byte aligned"):
        TensorMapEncoder(address + 16, "float16", (1, 64, 1, 64), (8192, 128, 128, 2), TileBox(rows=64, cols=64))
    encoder = TensorMapEncoder(address, "float16", (1, 64, 1, 64), (8192, 128, 128, 2), TileBox(rows=64, cols=64),
                               encode=_RecordedEncode())
    with pytest.raises(ValueError, match="16-byte aligned base pointer"):
        encoder.encode(0x1008)


def test_plan_encodes_maps_for_changed_pointers_before_launching(monkeypatch):
    from cupy.cuda import driver

    events = []
    recorded = _RecordedEncode()

    def encode(*arguments):
        events.append(("encode", arguments[3].value))
        return recorded(*arguments)

    monkeypatch.setattr(driver, "launchKernel", lambda *arguments: events.append(("launch",)))
    struct = pack(WGMMA_FORWARD_PARAMS, q=(0, 1, 2, 3), k=(0, 4, 5, 6), v=(0, 7, 8, 9), out=(0, 10, 11, 12), lse=0,
                  lse_batch_stride=13, lse_head_stride=14, size=(1, 2, 3, 4, 5, 6, 0, 0, 4, 5, 0, 0, 0, 0), num_m_blocks=15,
                  softmax_scale_log2=0.5, kv_pair_maps=0, num_splits=1, out_split_stride=0, lse_split_stride=0,
                  variant=NO_VARIANT)
    assert struct.ctypes.data % 64 == 0
    shape = (1, 64, 2, 64)
    strides = _byte_strides(shape, (0, 1, 2, 3))
    maps = [(f"{name}.ptr", TensorMapEncoder(struct.ctypes.data + WGMMA_FORWARD_PARAMS.fields[f"{name}_map"][1],
                                             "float16", shape, strides, TileBox(rows=64, cols=64), encode=encode))
            for name in ("q", "k", "v")]
    plan = LaunchPlan(0, [struct], api.FORWARD_SLOTS,
                      [KernelLaunch(type("K", (), {"kernel": type("F", (), {"ptr": 1})()})(), 1, 384, 0)], maps)
    plan.launch([0x1000, 0x2000, 0x3000, 0x4000, 0x5000], stream=0)
    plan.launch([0x1000, 0x2000, 0x3000, 0x6000, 0x7000], stream=0)  # new outputs only
    plan.launch([0x1000, 0x8000, 0x3000, 0x6000, 0x7000], stream=0)  # a new K
    assert events == [("encode", 0x1000), ("encode", 0x2000), ("encode", 0x3000), ("launch",), ("launch",),
                      ("encode", 0x8000), ("launch",)]
    # Each map landed in its own field of the struct the kernel receives.
    written = struct.view(np.uint8)
    for name in ("q", "k", "v"):
        offset = WGMMA_FORWARD_PARAMS.fields[f"{name}_map"][1]
        assert (written[offset:offset + 128] == 0xAB).all()
    assert struct["num_m_blocks"][0] == 15 and struct["k"]["ptr"][0] == 0x8000


@pytest.mark.parametrize("head_dim,q_panel,kv_panel", [
    (64, 64, 64),    # 128 rows: each consumer's dQ is one m64 tile of all 64 columns
    (96, 32, 16),    # narrowed panels: dK/dV columns 96 (64-byte), dQ blocks of 48 (32-byte)
    (128, 64, 64),
    (256, 64, 64),   # split head dim: each consumer's 128 columns of dK/dV, 128 of dQ
])
@pytest.mark.parametrize("direct", [False, True], ids=["accumulated", "direct"])
def test_backward_maps_follow_the_kernels_tiles(head_dim, q_panel, kv_panel, direct):
    """The Hopper backward's maps: Q and dO by block_m rows, K and V by
    block_n, in the swizzles WgmmaBackwardTraits narrows its tiles to (a
    wrong panel width would load columns in the wrong places), and the
    float32 dQ accumulator as 32-column boxes of block_m rows with the
    128-byte swizzle, over the accumulator's own (batch, seqlen_q, heads,
    head_dim) layout and the unpadded head dim; in the direct dQ mode dq
    itself instead, and out (from which that kernel computes delta), each in
    Q's boxes over its own layout (here dq heads first, out with padded rows)."""
    from types import SimpleNamespace

    from cuflash._params import WGMMA_BACKWARD_PARAMS
    from cuflash._tiling import wgmma_backward_tiling, wgmma_direct_computes_delta

    tiling = wgmma_backward_tiling("bfloat16", head_dim)
    assert wgmma_direct_computes_delta(tiling)  # every head dim here: its O tiles fit
    problem = SimpleNamespace(dtype="bfloat16", batch=2, seqlen_q=300, nheads=4, head_dim=head_dim - 8)
    shape = (2, 300, 4, head_dim - 8)
    layouts = {name: api.Layout.contiguous(shape, "bfloat16") for name in ("q", "k", "v", "dout")}
    heads_first = api.Layout.contiguous((2, 4, 300, head_dim - 8), "bfloat16")
    strides = heads_first.strides
    layouts["dq"] = api.Layout(shape, (strides[0], strides[2], strides[1], strides[3]), 2)
    out_strides = (300 * 4 * head_dim * 2, 4 * head_dim * 2, head_dim * 2, 2)  # rows padded to the bucket
    layouts["out"] = api.Layout(shape, out_strides, 2)
    storage = np.zeros(WGMMA_BACKWARD_PARAMS.itemsize + 64, dtype=np.uint8)
    start = -storage.ctypes.data % 64
    struct = storage[start:start + WGMMA_BACKWARD_PARAMS.itemsize].view(WGMMA_BACKWARD_PARAMS)
    maps = dict(api._wgmma_backward_maps(problem, layouts, tiling, struct, direct, delta_in_kernel=direct))
    dq_slot = "dq.ptr" if direct else "dq_accum"
    assert set(maps) == {"q.ptr", "dout.ptr", "k.ptr", "v.ptr", dq_slot} | ({"out.ptr"} if direct else set())
    recorded = _RecordedEncode()
    boxes, calls = {}, {}
    fields = {"q.ptr": "q_map", "dout.ptr": "do_map", "k.ptr": "k_map", "v.ptr": "v_map", dq_slot: "dq_map",
              "out.ptr": "o_map"}
    for slot, encoder in maps.items():
        encoder._encode = recorded
        encoder.encode(0x10000)
        calls[slot] = call = recorded.calls[-1]
        boxes[slot] = (call["box"][:2], call["swizzle"], call["data_type"])
        assert call["address"] == struct.ctypes.data + WGMMA_BACKWARD_PARAMS.fields[fields[slot]][1]
    swizzle_mode = {32: 1, 64: 2, 128: 3}
    assert boxes["q.ptr"] == boxes["dout.ptr"] == ([q_panel, tiling.block_m], swizzle_mode[2 * q_panel], 9)
    assert boxes["k.ptr"] == boxes["v.ptr"] == ([kv_panel, tiling.block_n], swizzle_mode[2 * kv_panel], 9)
    dq_call = calls[dq_slot]
    assert dq_call["dims"] == [head_dim - 8, 300, 4, 2]
    if direct:
        assert boxes["dq.ptr"] == boxes["out.ptr"] == boxes["q.ptr"]
        assert dq_call["strides"] == [2 * (head_dim - 8), 2 * 300 * (head_dim - 8), 2 * 4 * 300 * (head_dim - 8)]
        assert calls["out.ptr"]["dims"] == [head_dim - 8, 300, 4, 2]
        assert calls["out.ptr"]["strides"] == [out_strides[1], out_strides[2], out_strides[0]]
    else:
        assert boxes["dq_accum"] == ([32, tiling.block_m], 3, 7)
        assert dq_call["strides"] == [4 * 4 * (head_dim - 8), 4 * (head_dim - 8), 4 * 300 * 4 * (head_dim - 8)]


@pytest.mark.parametrize("shape,order,padded,expected", [
    ((2, 300, 28, 72), (0, 1, 2, 3), 96, True),    # rows of 144 bytes, heads contiguous and even
    ((2, 300, 8, 40), (0, 1, 2, 3), 64, True),
    ((1, 300, 2, 200), (0, 1, 2, 3), 256, True),
    ((2, 300, 19, 104), (0, 1, 2, 3), 128, False),  # an odd head count: rows 3952 bytes apart, mid-sector
    ((2, 300, 28, 72), (0, 2, 1, 3), 96, False),    # heads first: a head's rows alternate within sectors
    ((2, 300, 28, 80), (0, 1, 2, 3), 96, False),    # rows of whole sectors: nothing to gain
    ((2, 300, 4, 64), (0, 1, 2, 3), 64, False),
])
def test_head_pair_geometry_only_where_rows_end_mid_sector(shape, order, padded, expected):
    """The head-pair view K and V take in the Hopper forward (params.cuh's
    k_pair_maps): pairs of heads, 8 columns (16 bytes) wider than a head,
    the pair stride two heads, the odd heads' map 16 bytes before head 1;
    only where every head's rows start alike and the reads stay in the
    array's rows."""
    from cuflash._tensor_maps import head_pair_geometry

    strides = _byte_strides(shape, order)
    geometry = head_pair_geometry(shape, strides, 2, padded)
    assert (geometry is not None) == expected
    if expected:
        batch, seqlen, heads, head_dim = shape
        pair_shape, pair_strides, odd_offset = geometry
        assert pair_shape == (batch, seqlen, heads // 2, head_dim + 8)
        assert pair_strides == (strides[0], strides[1], 2 * strides[2], 2)
        assert odd_offset == 2 * head_dim - 16
        # the odd heads' last byte read is their own last one; the even heads' the next head's 16th
        assert odd_offset + pair_shape[3] * 2 == strides[2] + head_dim * 2


def test_head_pair_geometry_needs_a_padded_tile_with_room():
    from cuflash._tensor_maps import head_pair_geometry

    shape = (1, 64, 4, 88)
    assert head_pair_geometry(shape, _byte_strides(shape, (0, 1, 2, 3)), 2, 96) is not None
    assert head_pair_geometry(shape, _byte_strides(shape, (0, 1, 2, 3)), 2, 88) is None


def test_forward_plan_encodes_head_pair_maps_at_their_offsets():
    """A Hopper forward at head dim 72 with K and V in the flash layout: two
    more maps each, over head pairs, the odd heads' 128 bytes past the
    pointer, and the struct's kv_pair_maps bits set; V heads first takes none."""
    from types import SimpleNamespace

    from cuflash._tiling import Tiling

    shape = (2, 300, 4, 72)
    tiling = Tiling(head_dim_padded=96, block_m=128, block_n=128, warps=12, kernel="wgmma", kv_stages=3)
    problem = SimpleNamespace(dtype="bfloat16", is_empty=False)
    layouts = {name: api.Layout.contiguous(shape, "bfloat16") for name in ("q", "k", "v", "out")}
    assert [g is not None for g in api._kv_pair_geometries(problem, layouts, tiling)] == [True, True]
    heads_first = api.Layout(shape, _byte_strides(shape, (0, 2, 1, 3)), 2)
    assert [g is not None for g in api._kv_pair_geometries(problem, {**layouts, "v": heads_first}, tiling)] == [
        True, False]
    storage = np.zeros(WGMMA_FORWARD_PARAMS.itemsize + 64, dtype=np.uint8)
    start = -storage.ctypes.data % 64
    struct = storage[start:start + WGMMA_FORWARD_PARAMS.itemsize].view(WGMMA_FORWARD_PARAMS)
    maps = api._forward_tensor_maps(problem, layouts, tiling, struct)
    recorded = _RecordedEncode()
    pair_calls = {}
    for slot, encoder in maps:
        encoder._encode = recorded
        encoder.encode(0x10000)
        field = next(name for name in WGMMA_FORWARD_PARAMS.names
                     if WGMMA_FORWARD_PARAMS.fields[name][1] == encoder.address - struct.ctypes.data)
        if "pair" in field:
            assert slot == f"{field[0]}.ptr"
            pair_calls[field] = recorded.calls[-1]
    assert sorted(pair_calls) == ["k_pair_map0", "k_pair_map1", "v_pair_map0", "v_pair_map1"]
    for name in ("k", "v"):
        even, odd = pair_calls[f"{name}_pair_map0"], pair_calls[f"{name}_pair_map1"]
        assert even["pointer"] == 0x10000 and odd["pointer"] == 0x10000 + 128
        assert even["dims"] == odd["dims"] == [80, 300, 2, 2]
        assert even["strides"] == [4 * 72 * 2, 2 * 72 * 2, 300 * 4 * 72 * 2]
        assert even["box"] == [32, 128, 1, 1] and even["fill"] == 0
