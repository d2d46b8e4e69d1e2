"""Framework interop: seeing CuPy, PyTorch, JAX and other DLPack arrays as
CuPy arrays without copies, choosing the stream to launch on, and handing
results back as arrays of the caller's framework.

Everything framework-specific in cuflash lives here. PyTorch and JAX are
never imported by cuflash: an array of theirs can only arrive if the caller
already imported them, so they are looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ._cuda import gpu_access
from ._validation import contiguous_strides

#: DLPack device types (dlpack.h): host memory, CUDA device memory, CUDA managed memory.
_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13

CUPY, TORCH, JAX, DLPACK = "cupy", "torch", "jax", "dlpack"

_EXPECTED = "a CUDA GPU array (CuPy, PyTorch, JAX, or any object with __dlpack__)"


def _type_name(x) -> str:
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def _torch():
    return sys.modules.get("torch")


def _jax():
    return sys.modules.get("jax")


def _is_jax_tracer(x) -> bool:
    # jax.core.Tracer is the base of every traced value; look it up by name
    # along the class hierarchy so that no private JAX module is imported.
    return any(cls.__name__ == "Tracer" and cls.__module__.startswith("jax") for cls in type(x).__mro__)


def torch_device_error(name: str, tensor) -> TypeError:
    """The error for a torch.Tensor ``name`` outside GPU memory: the one
    ``framework_of`` raises, for wrappers that check before dispatching."""
    return TypeError(f"{name} must be {_EXPECTED}, got a torch.Tensor on device '{tensor.device}'")


def framework_of(x, name: str) -> str:
    """Which framework ``x`` belongs to; a ``TypeError`` naming ``name`` for
    anything that is not an array, or not in GPU memory."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return CUPY
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be {_EXPECTED}, got a NumPy array in host memory")
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cuda":
            raise torch_device_error(name, x)
        if x.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got a torch.Tensor with layout {x.layout}")
        return TORCH
    jax = _jax()
    if jax is not None and isinstance(x, jax.Array):
        if _is_jax_tracer(x):
            raise TypeError(
                f"{name} is a traced JAX value: cuflash.attention takes concrete arrays; inside jax.jit, "
                f"jax.grad or jax.vmap use cuflash.jax.attention, which runs on XLA's stream"
            )
        platforms = {device.platform for device in x.devices()}
        if platforms != {"gpu"}:
            raise TypeError(f"{name} must be {_EXPECTED}, got a JAX array on {sorted(platforms)}")
        return JAX
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type, _ = x.__dlpack_device__()
        if int(device_type) not in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED):
            where = "host memory" if int(device_type) == _DLPACK_CPU else f"DLPack device type {int(device_type)}"
            raise TypeError(f"{name} must be {_EXPECTED}, got {_type_name(x)} in {where}")
        return DLPACK
    raise TypeError(f"{name} must be {_EXPECTED}, got {_type_name(x)}")


def device_of(x, framework: str) -> int:
    """Index of the GPU that holds ``x``."""
    if framework == CUPY:
        return x.device.id
    if framework == TORCH:
        return x.device.index
    if framework == JAX:
        (device,) = x.devices()
        return device.local_hardware_id if device.local_hardware_id is not None else device.id
    return int(x.__dlpack_device__()[1])


@dataclass
class Bridge:
    """How one call moves arrays between the caller's framework and CuPy.

    ``framework`` is that of the call's first array (q): results come back
    in it. ``stream`` is the CuPy stream every kernel of the call runs on:
    PyTorch's current stream for PyTorch callers, CuPy's current stream
    otherwise.
    """

    framework: str
    device_id: int
    stream: object

    def as_cupy(self, x, framework: str):
        """``x`` as a CuPy array sharing its memory, ready on ``self.stream``.

        ``cupy.from_dlpack`` hands the consumer stream (CuPy's current one,
        which the caller has set to ``self.stream``) to the producer, which
        orders its pending work on ``x`` before it.
        """
        import cupy

        if framework == CUPY:
            return x
        if framework == JAX:
            # JAX runs on streams of its own; wait until x is computed.
            x.block_until_ready()
        if framework == TORCH and x.requires_grad:
            # PyTorch refuses to export a tensor that requires grad; the
            # kernels only read it, and detach() is a view, not a copy.
            x = x.detach()
        return cupy.from_dlpack(x)

    def empty(self, shape: tuple[int, ...], dtype, like_strides: tuple[int, ...] | None = None):
        """A new uninitialised output array: ``(native, cupy_view)``.

        ``like_strides`` (element strides of the array the output mirrors,
        e.g. q for out and dq): the output is dense with its dimensions laid
        out in the same order (``dense_strides_like``), as
        ``torch.empty_like`` does, so that a gradient matches its input's
        layout and autograd need not copy it, and SDPA-layout inputs get an
        SDPA-layout output. JAX outputs are always C-contiguous. PyTorch
        outputs come from PyTorch's caching allocator, on its current
        stream, so they behave as any tensor PyTorch made itself; other
        outputs come from CuPy's pool.
        """
        import cupy

        strides = None if like_strides is None or self.framework == JAX else dense_strides_like(shape, like_strides)
        if self.framework == TORCH:
            native = _torch_allocator(shape, dtype, self.device_id, strides)()[0]
            return native, cupy.from_dlpack(native)
        array = _cupy_allocator(shape, dtype, self.device_id, strides)()[0]
        return array, array

    def export(self, native, view):
        """The caller's-framework array for an output made by ``empty``."""
        if self.framework == JAX:
            import jax.numpy as jnp

            # JAX reads the buffer on its own stream: make sure our kernels
            # that wrote it have finished.
            self.stream.synchronize()
            return jnp.from_dlpack(view)
        return native


_TORCH_DTYPES = {
    "float16": lambda torch: torch.float16,
    "bfloat16": lambda torch: torch.bfloat16,
    "float32": lambda torch: torch.float32,
    "int32": lambda torch: torch.int32,  # the ordered backward's turn counters
    "uint8": lambda torch: torch.uint8,  # a call's work buffers, one allocation (api.WorkArena)
}


def bridge_for(first, framework: str, device_id: int) -> Bridge:
    """The bridge of a call whose first array is ``first``. A call first
    touches the GPU through CuPy here: where this machine cannot run the
    installed CuPy build (driver too old, none, no GPU) it raises
    ``cuflash.CudaSetupError`` saying why and what to install. (api._call,
    its caller, has imported CuPy by then, or said that none is installed.)"""
    import cupy

    with gpu_access(), cupy.cuda.Device(device_id):
        if framework == TORCH:
            stream = _cupy_stream_of_torch(_torch().cuda.current_stream(device_id), device_id)
        else:
            stream = cupy.cuda.get_current_stream()
    return Bridge(framework=framework, device_id=device_id, stream=stream)


def _cupy_stream_of_torch(torch_stream, device_id: int):
    """A CuPy view of a PyTorch CUDA stream (no new stream is created)."""
    import cupy

    if hasattr(torch_stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(torch_stream)
    import warnings

    with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14 but still works
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream, device_id)


# --- The fast lane: what a call with a cached plan reads of its arrays ---

def _cupy_signature(x):
    memory = x.data
    return (x.__class__, x.dtype, x.shape, x.strides, memory.device_id), memory.ptr


def _torch_signature(x):
    # is_cuda and the device index together: an index alone would let a
    # tensor of another device type with the same shapes match a CUDA plan.
    # (x.device instead took longer inside a training step: a new object
    # each call.)
    return (x.__class__, x.dtype, x.shape, x.stride(), x.get_device(), x.is_cuda), x.data_ptr()


def _cupy_pointer(x):
    return x.data.ptr


def _counter_word(x: int):
    """A call's dropout seed or offset: a value written into a plan slot
    (its class in the signature); outside [0, 2**64) the full path explains."""
    if not 0 <= x < 1 << 64:
        raise ValueError("not a 64-bit counter")
    return int, x


#: Array class -> function returning (its part of a call's signature, data
#: pointer). Filled as frameworks are first seen (``fast_lane``); any class
#: not here (JAX arrays, other DLPack producers, tensor subclasses) takes the
#: full path every call.
SIGNATURES = {int: _counter_word}


#: Array class -> function returning its data pointer: for arrays whose
#: signature part is known already (``cuflash.api.backward_following``).
POINTERS = {}


def call_signature(arrays):
    """``(signature, pointers)`` of a call's arrays (None entries allowed),
    or ``(None, None)`` where an array is not one the fast lane reads. The
    signature holds everything validation and planning depend on: class,
    dtype, shape, strides and device of each array."""
    # Most entries of a call's list are None (options not given): they are
    # skipped without a call, as this runs on every call.
    parts, pointers = [None] * len(arrays), [0] * len(arrays)
    try:
        for i, x in enumerate(arrays):
            if x is not None:
                parts[i], pointers[i] = SIGNATURES[x.__class__](x)
    except Exception:  # not a fast-lane class, or an array the full path will explain
        return None, None
    return tuple(parts), pointers


def current_device_getter():
    """() -> the current CUDA device of the calling thread."""
    from cupy.cuda import runtime

    return runtime.getDevice


def current_device() -> int:
    """The current CUDA device of this thread."""
    return current_device_getter()()


@dataclass(frozen=True)
class FastLane:
    """How calls with a cached plan allocate outputs and read the current
    stream, for one framework."""

    allocator: object  #: (shape, NumPy dtype, device, element strides or None) -> () -> (array, pointer)
    memory: object  #: (bytes, device) -> () -> (owner, pointer): device memory that is no array of the call's
    stream: object  #: device -> () -> current stream of that device, as an int


def dense_strides_like(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a dense array of ``shape`` whose dimensions are laid
    out in the order of ``strides`` (largest stride outermost; ties keep the
    dimension order). For a dense input this is its own strides; for a
    C-contiguous one, the C-contiguous strides."""
    order = sorted(range(len(shape)), key=lambda axis: (-strides[axis], axis))
    dense, step = [0] * len(shape), 1
    for axis in reversed(order):
        dense[axis] = step
        step *= max(shape[axis], 1)
    return tuple(dense)


def _cupy_allocator(shape, dtype, device, strides=None):
    """() -> (CuPy array, pointer) of ``shape`` and ``dtype`` on the current
    device (the fast path checks it is ``device``), with element ``strides``
    (dense) or C-contiguous: memory from CuPy's pool, the array made around
    it (cheaper than ``cupy.empty``, which parses its arguments each call)."""
    import cupy

    dtype = np.dtype(dtype)
    ndarray, alloc = cupy.ndarray, cupy.cuda.alloc
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if strides is None or strides == contiguous_strides(shape):
        def allocate():  # C-contiguous: the constructor's default strides, the cheapest call
            memory = alloc(nbytes)
            return ndarray(shape, dtype, memory), memory.ptr
        return allocate
    byte_strides = tuple(stride * dtype.itemsize for stride in strides)

    def allocate_strided():
        memory = alloc(nbytes)
        return ndarray(shape, dtype, memory, strides=byte_strides), memory.ptr
    return allocate_strided


def _cupy_memory(nbytes: int, device: int):
    """() -> (CuPy memory pointer, address) of ``nbytes`` from CuPy's pool
    on the current device: a call's work buffers, which need no array."""
    import cupy

    alloc = cupy.cuda.alloc

    def allocate():
        memory = alloc(nbytes)
        return memory, memory.ptr
    return allocate


def _torch_memory(nbytes: int, device: int):
    """() -> (uint8 tensor, address) of ``nbytes`` from PyTorch's caching
    allocator on its current stream: a call's work buffers."""
    return _torch_allocator((nbytes,), "uint8", device)


def _torch_allocator(shape, dtype, device, strides=None):
    """() -> (tensor, pointer) from PyTorch's caching allocator on its current
    stream, with element ``strides`` (dense) or C-contiguous.
    ``torch.empty_strided`` with every argument fixed: of PyTorch's
    allocation calls the cheapest on the host."""
    torch = _torch()
    dtype, where = _TORCH_DTYPES[np.dtype(dtype).name](torch), torch.device("cuda", device)
    strides = contiguous_strides(shape) if strides is None else strides
    empty_strided = torch.empty_strided

    def allocate():
        tensor = empty_strided(shape, strides, dtype=dtype, device=where)
        return tensor, tensor.data_ptr()
    return allocate


def _cupy_lane() -> FastLane:
    import cupy

    def stream(device):
        get_current_stream = cupy.cuda.get_current_stream
        return lambda: get_current_stream().ptr

    SIGNATURES[cupy.ndarray] = _cupy_signature
    POINTERS[cupy.ndarray] = _cupy_pointer
    return FastLane(_cupy_allocator, _cupy_memory, stream)


def _torch_lane() -> FastLane:
    import functools

    torch = _torch()

    def stream(device):
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return functools.partial(raw, device)
        return lambda: torch.cuda.current_stream(device).cuda_stream

    for tensor_class in (torch.Tensor, torch.nn.Parameter):
        SIGNATURES[tensor_class] = _torch_signature
        POINTERS[tensor_class] = torch.Tensor.data_ptr
    return FastLane(_torch_allocator, _torch_memory, stream)


_LANES = {CUPY: _cupy_lane, TORCH: _torch_lane}
_lanes: dict = {}


def fast_lane(framework: str) -> FastLane | None:
    """The fast lane of ``framework`` (CuPy, PyTorch), made on first use;
    None for frameworks calls of which always take the full path."""
    lane = _lanes.get(framework)
    if lane is None and framework in _LANES:
        lane = _lanes[framework] = _LANES[framework]()
    return lane
