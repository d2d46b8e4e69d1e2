"""Tensor maps for Hopper's Tensor Memory Accelerator (TMA).

A tensor map (``CUtensorMap``, 128 opaque bytes) describes a strided global
tensor and the box one copy moves into shared memory, in which swizzle. The
Hopper forward (``kernels_cu/flash_fwd_wgmma.cu``) reads its maps of Q, K and
V from its parameters. They are encoded on the host by the driver's
``cuTensorMapEncodeTiled``, called through ctypes (no dependency beyond the
driver CuPy already loads): once when a plan is made, and again in a call
only for an array whose pointer differs from the one encoded last.

A (batch, seqlen, heads, head_dim) array is described innermost dimension
first: head_dim, seqlen, heads, batch; the box is one swizzle panel of
columns by the kernel's block of rows, of one head of one batch entry.
Elements outside the array (rows past the sequence, columns past head_dim)
are copied as zeros.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass

from ._params import TENSOR_MAP, TENSOR_MAP_ALIGNMENT
from ._tiling import SECTOR_BYTES, widest_swizzle_bytes

TENSOR_MAP_BYTES = TENSOR_MAP.itemsize

#: CUtensorMapDataType of each dtype the Hopper kernels copy: the 16-bit
#: inputs, and the backward's float32 dQ accumulator.
_DATA_TYPE = {"float16": 6, "float32": 7, "bfloat16": 9}
_ELEMENT_BYTES = {"float16": 2, "float32": 4, "bfloat16": 2}
#: CUtensorMapSwizzle of each swizzle width in bytes (SwizzledTile::kSwizzleBytes).
_SWIZZLE = {32: 1, 64: 2, 128: 3}
_INTERLEAVE_NONE = 0
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0
#: The largest stride a map takes (bytes, exclusive) and the granule of every stride and of the base address.
_MAX_STRIDE = 1 << 40
_GRANULE = 16


class TensorMapError(RuntimeError):
    """The driver refused to encode a tensor map."""


@dataclass(frozen=True)
class TileBox:
    """What one map copies: a tile of ``rows`` rows by ``cols`` columns
    (the kernel's padded head dim) of ``element_bytes`` each, one swizzle
    panel per copy. The swizzle (bytes a panel row) defaults to the widest
    whose panels of 16-bit columns tile ``cols`` (``SwizzledTile``'s
    default, ``widest_swizzle_bytes``); kernels that narrow a tile's
    panels, and float32 tiles (``SwizzledFloatTile``: 128 bytes), give
    theirs as ``swizzle_width``."""

    rows: int
    cols: int
    swizzle_width: int | None = None
    element_bytes: int = 2

    @property
    def swizzle(self) -> int:
        return self.swizzle_width or widest_swizzle_bytes(self.cols)

    @property
    def panel_cols(self) -> int:
        return self.swizzle // self.element_bytes


def map_geometry(shape: tuple[int, ...], strides: tuple[int, ...], box: TileBox):
    """(dims, byte strides, box dims) of the map of a (batch, seqlen, heads,
    head_dim) array with byte ``strides``, innermost first. A dimension
    of one entry is never stepped over, so its stride is given as one
    granule whatever the array says (the driver checks every stride)."""
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    byte_strides = []
    for size, stride_bytes in ((seqlen, strides[1]), (heads, strides[2]), (batch, strides[0])):
        stride_bytes = stride_bytes if size > 1 else _GRANULE
        if stride_bytes <= 0 or stride_bytes % _GRANULE or stride_bytes >= _MAX_STRIDE:
            raise ValueError(f"a tensor map needs positive strides that are multiples of {_GRANULE} bytes "
                             f"below 2^40, got {stride_bytes} bytes")
        byte_strides.append(stride_bytes)
    return dims, tuple(byte_strides), (box.panel_cols, box.rows, 1, 1)


def head_pair_geometry(shape: tuple[int, ...], strides: tuple[int, ...], element_bytes: int,
                       head_dim_padded: int):
    """The head-pair view of a (batch, seqlen, heads, head_dim) array of
    byte ``strides`` that the Hopper forward copies K and V through where
    rows end 16 bytes into a sector (params.cuh's ``k_pair_maps``): ((batch,
    seqlen, heads / 2, head_dim + 16 bytes' worth), byte strides, the odd
    heads' map's offset from the array's start) or None. Over pairs of
    heads, so that no stride is shorter than the width it steps over; the
    even heads' map starts at the array (a head and the next one's first 16
    bytes), the odd heads' 16 bytes before head 1 (the previous head's last
    16 bytes and the head). Every row it reads then starts and ends on a
    sector where the array starts on one (the kernel checks the pointer),
    and stays inside the array's rows. Needs 16-bit elements, heads
    contiguous and an even number of them, rows and batch entries whole
    sectors apart, and the columns in the kernel's padded tile."""
    batch, seqlen, heads, head_dim = shape
    batch_stride, row_stride, head_stride, _ = strides
    spare = _GRANULE // element_bytes  # the neighbour's columns a row takes
    row_bytes = head_dim * element_bytes
    applies = (element_bytes == 2 and row_bytes % SECTOR_BYTES == _GRANULE and heads % 2 == 0
               and head_stride == row_bytes and row_stride % SECTOR_BYTES == 0
               and (batch == 1 or batch_stride % SECTOR_BYTES == 0) and head_dim + spare <= head_dim_padded)
    if not applies:
        return None
    return ((batch, seqlen, heads // 2, head_dim + spare), (batch_stride, row_stride, 2 * head_stride, element_bytes),
            row_bytes - _GRANULE)


def takes_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a (batch, seqlen, heads, head_dim) array of byte ``strides``
    can have a tensor map: no empty dimension (the driver takes none) and
    strides ``map_geometry`` accepts."""
    if 0 in shape:
        return False
    try:
        map_geometry(shape, strides, TileBox(rows=8, cols=8))
    except ValueError:
        return False
    return True


_encode_function = None


def _driver_encode():
    """cuTensorMapEncodeTiled from the CUDA driver library, loaded once."""
    global _encode_function
    if _encode_function is None:
        library = ctypes.CDLL("libcuda.so.1")
        function = library.cuTensorMapEncodeTiled
        function.restype = ctypes.c_int
        function.argtypes = [
            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ]
        _encode_function = function
    return _encode_function


class TensorMapEncoder:
    """Encodes the map of one array's layout (shape, byte strides) into 128
    bytes at ``address`` (64-byte aligned, inside a plan's parameter struct)
    for a given base pointer. The geometry is fixed at construction;
    ``encode(pointer)`` does nothing for the pointer encoded last, copies
    the bytes of one of the last ``remembered`` pointers back in place (a
    training loop hands the same few buffers over and over; a copy costs a
    fraction of the driver's encode), and asks the driver otherwise.
    ``encode`` replaces the driver's function (tests). ``offset``: bytes
    from the pointer to the map's base (a head-pair map of odd heads)."""

    def __init__(self, address: int, dtype_name: str, shape, strides, box: TileBox, encode=None,
                 remembered: int = 64, offset: int = 0):
        if box.element_bytes != _ELEMENT_BYTES[dtype_name]:
            raise ValueError(f"a box of {box.element_bytes}-byte elements does not fit a {dtype_name} array")
        if address % TENSOR_MAP_ALIGNMENT:
            raise ValueError(f"a tensor map must be {TENSOR_MAP_ALIGNMENT}-byte aligned, got address {address:#x}")
        dims, byte_strides, box_dims = map_geometry(tuple(shape), tuple(strides), box)
        if offset % _GRANULE:
            raise ValueError(f"a tensor map's base must stay {_GRANULE}-byte aligned, got an offset of {offset} bytes")
        self.address = address
        self.offset = offset
        self._encode = encode
        self._arguments = (
            ctypes.c_void_p(address), _DATA_TYPE[dtype_name], len(dims),
            (ctypes.c_uint64 * 4)(*dims), (ctypes.c_uint64 * 3)(*byte_strides), (ctypes.c_uint32 * 4)(*box_dims),
            (ctypes.c_uint32 * 4)(1, 1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE[box.swizzle], _L2_PROMOTION_256B,
            _OOB_FILL_ZEROS,
        )
        self.pointer = None
        self._remembered = remembered
        self._maps: OrderedDict[int, bytes] = OrderedDict()

    def encode(self, pointer: int) -> None:
        if pointer == self.pointer:
            return
        known = self._maps.get(pointer)
        if known is not None:
            ctypes.memmove(self.address, known, TENSOR_MAP_BYTES)
            self._maps.move_to_end(pointer)
            self.pointer = pointer
            return
        if pointer % _GRANULE:
            raise ValueError(f"a tensor map needs a {_GRANULE}-byte aligned base pointer, got {pointer:#x}")
        encode = self._encode or _driver_encode()
        address, data_type, rank, *rest = self._arguments
        status = encode(address, data_type, rank, ctypes.c_void_p(pointer + self.offset), *rest)
        if status != 0:
            dims, strides, box = (list(array) for array in rest[:3])
            raise TensorMapError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for dims {dims}, "
                                 f"byte strides {strides}, box {box}")
        self.pointer = pointer
        self._maps[pointer] = ctypes.string_at(self.address, TENSOR_MAP_BYTES)
        while len(self._maps) > self._remembered:
            self._maps.popitem(last=False)
