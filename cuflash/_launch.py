"""Launch plans: the kernels of one call signature, ready to run with new
pointers on a given stream, and the bounded cache that keeps them.

A plan is made once per signature (framework, dtypes, shapes, strides,
devices, pointer alignment, flags) after the full validation in
``cuflash.api``. Its parameter structs hold every field that the signature
fixes (sizes, strides, scale, block counts); a call writes only the
pointers and launches through the driver (``cuLaunchKernel``), which copies
the struct at launch: no per-call NumPy packing, no CuPy argument parsing.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ._params import flat_fields


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch of a plan: a compiled kernel (``cupy.RawKernel``),
    a one-dimensional grid and block, dynamic shared memory, and which of the
    plan's parameter structs it takes. ``dependent``: launched with
    programmatic stream serialization (Hopper and later; kernels_cu/
    grid_dependency.cuh), so it may be scheduled before the kernel ahead of
    it on the stream finishes; the kernel must wait for that kernel's
    results itself (``wait_for_prerequisite_grids``) before reading them."""

    kernel: object
    grid: int
    threads: int
    smem_bytes: int
    struct: int = 0
    dependent: bool = False


# cuLaunchKernelEx's arguments (cuda.h, CUDA 12+): CUlaunchAttribute is an
# id, padding to 8 bytes and a 64-byte value union; CUlaunchConfig the grid,
# block, shared memory, stream and attribute array.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


_launch_kernel_ex = None


def launch_kernel_ex(config, function: int, arguments: int, extra) -> int:
    """cuLaunchKernelEx from the CUDA driver library (loaded on first use):
    the driver's status."""
    global _launch_kernel_ex
    if _launch_kernel_ex is None:
        loaded = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        loaded.restype = ctypes.c_int
        loaded.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_kernel_ex = loaded
    return _launch_kernel_ex(config, function, arguments, extra)


class _DependentLaunchConfig:
    """cuLaunchKernelEx's config of a kernel launched with programmatic
    stream serialization: built once, its stream set per call."""

    def __init__(self, grid: int, threads: int, smem_bytes: int):
        self.attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.config = _LaunchConfig(grid=(ctypes.c_uint * 3)(grid, 1, 1), block=(ctypes.c_uint * 3)(threads, 1, 1),
                                    shared_mem_bytes=smem_bytes, attributes=ctypes.pointer(self.attribute),
                                    attribute_count=1)
        self.reference = ctypes.byref(self.config)


def _word_index(dtype: np.dtype, field: str) -> int | None:
    """Index of ``field`` (a dotted path, e.g. ``q.ptr``) among the struct's
    8-byte words; None where the struct has no such field."""
    offset = dict(flat_fields(dtype)).get(field)
    return None if offset is None else offset // 8


class LaunchPlan:
    """Kernels of one call signature with their parameter structs filled in
    but for the pointers, which ``launch`` writes before each call.

    ``slots`` says where each pointer goes, in the order ``launch``
    receives them: a field name (``q.ptr``, ``lse``, ...), written into
    every struct that has it (at least one must), or a sequence of
    (struct index, field) pairs, possibly empty (a pointer this plan does not
    use), where one array fills different fields of different structs (a
    split-KV forward's partial results are its forward kernel's ``out`` and
    its merge kernel's ``partial``).
    ``tensor_maps`` pairs a slot with the encoder of a tensor map inside a
    struct (``cuflash._tensor_maps.TensorMapEncoder``): the map is encoded
    again for a call whose pointer in that slot differs from the last one's.
    Thread-safe: the structs are shared, so a lock spans writing them and
    launching (the driver has copied the arguments when the launch returns).
    """

    def __init__(self, device: int, structs: Sequence[np.ndarray], slots: Sequence,
                 launches: Sequence[KernelLaunch], tensor_maps: Sequence[tuple[str, object]] = (),
                 work_buffers: dict | None = None):
        self.device = device
        #: name -> (shape, dtype) of the work buffers a call allocates for
        #: this plan (each call its own, on its stream), by slot name
        self.work_buffers = dict(work_buffers or {})
        self._structs = list(structs)
        for struct in self._structs:
            if struct.shape != (1,) or struct.dtype.itemsize % 8:
                raise ValueError("a parameter struct is one element of whole 8-byte words")
        # ctypes views of the structs' words: a ctypes item store costs a
        # fraction of a NumPy scalar assignment, and this is the per-call path.
        words = [(ctypes.c_uint64 * (struct.dtype.itemsize // 8)).from_address(struct.ctypes.data)
                 for struct in self._structs]
        self._writes = tuple(tuple((words[i], index) for i, index in self._targets(slot)) for slot in slots)
        # cuLaunchKernel's kernelParams: an array of one pointer, to the struct.
        self._argument_arrays = [np.array([struct.ctypes.data], dtype=np.uint64) for struct in self._structs]
        # (function, grid, threads, shared memory, arguments, the config of a dependent launch or None)
        self._launches = tuple(
            (int(launch.kernel.kernel.ptr), launch.grid, launch.threads, launch.smem_bytes,
             self._argument_arrays[launch.struct].ctypes.data,
             _DependentLaunchConfig(launch.grid, launch.threads, launch.smem_bytes) if launch.dependent else None)
            for launch in launches
        )
        self._tensor_maps = tuple((list(slots).index(slot), encoder) for slot, encoder in tensor_maps)
        self._lock = threading.Lock()
        from cupy.cuda import driver

        self._launch_kernel = driver.launchKernel
        self._launch_kernel_ex = launch_kernel_ex

    def _targets(self, slot) -> list[tuple[int, int]]:
        """(struct index, word index) of each field ``slot`` fills."""
        if isinstance(slot, str):
            targets = [(i, index) for i, struct in enumerate(self._structs)
                       if (index := _word_index(struct.dtype, slot)) is not None]
            if not targets:
                raise KeyError(f"the parameter structs have no field {slot!r}")
            return targets
        targets = []
        for i, field in slot:
            index = _word_index(self._structs[i].dtype, field)
            if index is None:
                raise KeyError(f"parameter struct {i} has no field {field!r}")
            targets.append((i, index))
        return targets

    @property
    def kernel_count(self) -> int:
        return len(self._launches)

    def launch(self, pointers: Sequence[int], stream: int, slots: Sequence[int] | None = None) -> None:
        """Writes ``pointers`` (one per slot) and launches every kernel on
        ``stream`` (a ``cudaStream_t`` as an int). The current CUDA device
        must be the plan's. ``slots``: the indices of the pointers to write
        (default: all); a cached call passes those its signature leaves
        open, the others (absent arrays, null) keeping what its first call
        wrote."""
        launch_kernel = self._launch_kernel
        with self._lock:
            if slots is None:
                for writes, pointer in zip(self._writes, pointers):
                    for words, index in writes:
                        words[index] = pointer
            else:
                all_writes = self._writes
                for slot in slots:
                    pointer = pointers[slot]
                    for words, index in all_writes[slot]:
                        words[index] = pointer
            for slot, encoder in self._tensor_maps:
                if pointers[slot] != encoder.pointer:  # the same array as last call: its map is in place
                    encoder.encode(pointers[slot])
            for function, grid, threads, smem_bytes, arguments, dependent in self._launches:
                if dependent is None:
                    launch_kernel(function, grid, 1, 1, threads, 1, 1, smem_bytes, stream, arguments, 0)
                    continue
                dependent.config.stream = stream
                status = self._launch_kernel_ex(dependent.reference, function, arguments, None)
                if status:
                    from cupy.cuda import driver

                    raise driver.CUDADriverError(status)


class PlanCache:
    """A bounded least-recently-used map from call signatures to plans."""

    def __init__(self, max_entries: int = 512):
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        #: Entries looked up by a shorter key that fixes a full one
        #: (``cuflash.api.forward_plain``); emptied with the cache.
        self.shortcuts: dict = {}

    def get(self, key):
        entry = self._entries.get(key)
        if entry is not None:
            try:
                self._entries.move_to_end(key)
            except KeyError:  # evicted by another thread since the lookup
                pass
        return entry

    def refresh(self, key, entry) -> bool:
        """Whether ``entry`` is still the cache's entry under ``key`` (not
        evicted, cleared or replaced); if so, it becomes the most recently
        used, as ``get`` makes it."""
        return self.get(key) is entry

    def put(self, key, entry) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.shortcuts.clear()

    def __len__(self) -> int:
        return len(self._entries)
