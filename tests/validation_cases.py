"""Bad-input cases of the forward API, shared by the CPU tests (on
TensorMeta) and the GPU tests (on real CuPy arrays)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cuflash._validation import contiguous_strides

__all__ = ["BAD_BACKWARD_CASES", "BAD_FORWARD_CASES", "GOOD_BACKWARD_SHAPES", "GOOD_SHAPES", "contiguous_strides",
           "make_cupy_arrays"]

GOOD_SHAPES = {"q": (2, 17, 4, 40), "k": (2, 33, 2, 40), "v": (2, 33, 2, 40)}
GOOD_BACKWARD_SHAPES = {**GOOD_SHAPES, "dout": (2, 17, 4, 40), "out": (2, 17, 4, 40), "lse": (2, 4, 17)}
#: dtype of each array of a good call; float16 where not named.
GOOD_DTYPES = {"lse": "float32"}




@dataclass(frozen=True)
class BadCase:
    id: str
    error: type
    match: str
    changes: dict = field(default_factory=dict)  # array name -> spec overrides (None removes)
    options: dict = field(default_factory=lambda: {"causal": False, "softmax_scale": None})
    needs_two_gpus: bool = False
    base: dict = field(default_factory=lambda: GOOD_SHAPES)

    def arrays(self) -> dict:
        """name -> {shape, dtype[, strides, device]} of every array of the call."""
        specs = {name: {"shape": shape, "dtype": GOOD_DTYPES.get(name, "float16")} for name, shape in self.base.items()}
        for name, change in self.changes.items():
            default = {"shape": GOOD_SHAPES[{"dk": "k", "dv": "v"}.get(name, "q")],
                       "dtype": GOOD_DTYPES.get(name, "float16")}
            specs[name] = {**specs.get(name, default), **change}
        return specs


def _options(**kwargs):
    return {"causal": False, "softmax_scale": None, **kwargs}


BAD_FORWARD_CASES = [
    BadCase("float64-dtype", TypeError, "q must have dtype float16, bfloat16 or float32, got float64",
            {"q": {"dtype": "float64"}}),
    BadCase("int-dtype", TypeError, "k must have dtype float16, bfloat16 or float32, got int32",
            {"k": {"dtype": "int32"}}),
    BadCase("mixed-dtypes", TypeError, r"v must have the same dtype as q \(float16\), got bfloat16",
            {"v": {"dtype": "bfloat16"}}),
    BadCase("rank-3", ValueError, r"q must have 4 dimensions .* got shape \(2, 17, 160\)",
            {"q": {"shape": (2, 17, 160)}}),
    BadCase("rank-5", ValueError, r"k must have 4 dimensions .* got shape \(2, 33, 2, 40, 1\)",
            {"k": {"shape": (2, 33, 2, 40, 1)}}),
    BadCase("batch-mismatch", ValueError, r"k must have batch size 2 like q, got shape \(3, 33, 2, 40\)",
            {"k": {"shape": (3, 33, 2, 40)}, "v": {"shape": (3, 33, 2, 40)}}),
    BadCase("head-dim-mismatch", ValueError, r"k must have head_dim 40 like q, got shape \(2, 33, 2, 48\)",
            {"k": {"shape": (2, 33, 2, 48)}, "v": {"shape": (2, 33, 2, 48)}}),
    BadCase("nheads-not-divisible", ValueError, r"q's nheads \(4\) must be a multiple of k's nheads_k \(3\)",
            {"k": {"shape": (2, 33, 3, 40)}, "v": {"shape": (2, 33, 3, 40)}}),
    BadCase("kv-length-mismatch", ValueError, r"v must have the shape of k \(2, 33, 2, 40\) .* got \(2, 32, 2, 40\)",
            {"v": {"shape": (2, 32, 2, 40)}}),
    BadCase("last-dim-strided", ValueError, r"q must be contiguous in its last dimension \(stride 1\), got strides \(5440, 320, 80, 2\)",
            {"q": {"strides": (5440, 320, 80, 2)}}),
    BadCase("head-dim-zero", ValueError, r"q's head_dim \(last dimension\) must be between 1 and 256, got 0",
            {name: {"shape": shape[:3] + (0,)} for name, shape in GOOD_SHAPES.items()}),
    BadCase("head-dim-too-large", ValueError, r"q's head_dim \(last dimension\) must be between 1 and 256, got 257",
            {name: {"shape": shape[:3] + (257,)} for name, shape in GOOD_SHAPES.items()}),
    BadCase("different-gpus", ValueError, "k is on GPU 1 but q is on GPU 0",
            {"k": {"device": 1}}, needs_two_gpus=True),
    BadCase("out-wrong-shape", ValueError, r"out must have the shape of q \(2, 17, 4, 40\), got \(2, 17, 4, 41\)",
            {"out": {"shape": (2, 17, 4, 41)}}),
    BadCase("out-wrong-dtype", TypeError, r"out must have the dtype of q \(float16\), got float32",
            {"out": {"dtype": "float32"}}),
    BadCase("out-broadcast", ValueError, "out must not be a broadcast view",
            {"out": {"strides": (0, 160, 40, 1)}}),
    BadCase("scale-nan", ValueError, "softmax_scale must be finite, got nan", options=_options(softmax_scale=float("nan"))),
    BadCase("scale-inf", ValueError, "softmax_scale must be finite, got inf", options=_options(softmax_scale=float("inf"))),
    BadCase("scale-not-a-number", TypeError, "softmax_scale must be a real number or None, got str",
            options=_options(softmax_scale="0.1")),
    BadCase("causal-not-bool", TypeError, "causal must be a bool, got str 'yes'", options=_options(causal="yes")),
    BadCase("fp32-precision-unknown", ValueError, r"fp32_precision must be one of \('ieee', '3xtf32'\), got 'tf32'",
            options=_options(fp32_precision="tf32")),
    BadCase("fp32-precision-not-a-string", TypeError, "fp32_precision must be a str, one of .*, got NoneType",
            options=_options(fp32_precision=None)),
    BadCase("lse-buffer-wrong-dtype", TypeError, "lse must have dtype float32 .* got float16",
            {"lse": {"shape": (2, 4, 17), "dtype": "float16"}}),
    BadCase("lse-buffer-wrong-shape", ValueError, r"lse must have shape \(batch, nheads, seqlen_q\) = \(2, 4, 17\), got \(2, 17, 4\)",
            {"lse": {"shape": (2, 17, 4), "dtype": "float32"}}),
    BadCase("lse-buffer-not-contiguous", ValueError, r"lse must be C-contiguous, got strides \(136, 34, 1\)",
            {"lse": {"shape": (2, 4, 17), "dtype": "float32", "strides": (136, 34, 1)}}),
]


def _backward(id, error, match, changes=None, **options):
    return BadCase(id, error, match, changes or {}, options=_backward_options(**options),
                   needs_two_gpus=any("device" in c for c in (changes or {}).values()),
                   base=GOOD_BACKWARD_SHAPES)


def _backward_options(**kwargs):
    return {"causal": False, "softmax_scale": None, "deterministic": False, **kwargs}


BAD_BACKWARD_CASES = [
    _backward("dout-wrong-shape", ValueError, r"dout must have the shape of q \(2, 17, 4, 40\) .* got \(2, 16, 4, 40\)",
              {"dout": {"shape": (2, 16, 4, 40)}}),
    _backward("dout-wrong-dtype", TypeError, r"dout must have the dtype of q \(float16\), got bfloat16",
              {"dout": {"dtype": "bfloat16"}}),
    _backward("out-wrong-shape", ValueError, r"out must have the shape of q \(2, 17, 4, 40\) .* got \(2, 17, 4, 39\)",
              {"out": {"shape": (2, 17, 4, 39)}}),
    _backward("out-wrong-dtype", TypeError, r"out must have the dtype of q \(float16\), got float32",
              {"out": {"dtype": "float32"}}),
    _backward("lse-wrong-dtype", TypeError, r"lse must have dtype float32 .* got float16", {"lse": {"dtype": "float16"}}),
    _backward("lse-wrong-shape", ValueError, r"lse must have shape \(batch, nheads, seqlen_q\) = \(2, 4, 17\), got \(2, 17, 4\)",
              {"lse": {"shape": (2, 17, 4)}}),
    _backward("lse-last-dim-strided", ValueError, r"lse must be contiguous in its last dimension",
              {"lse": {"strides": (136, 34, 2)}}),
    _backward("dq-wrong-shape", ValueError, r"dq must have the shape of q \(2, 17, 4, 40\), got \(2, 17, 2, 40\)",
              {"dq": {"shape": (2, 17, 2, 40)}}),
    _backward("dk-wrong-dtype", TypeError, r"dk must have the dtype of k \(float16\), got float32",
              {"dk": {"dtype": "float32"}}),
    _backward("dv-wrong-shape", ValueError, r"dv must have the shape of v \(2, 33, 2, 40\), got \(2, 33, 4, 40\)",
              {"dv": {"shape": (2, 33, 4, 40)}}),
    _backward("dk-broadcast", ValueError, "dk must not be a broadcast view",
              {"dk": {"strides": (0, 80, 40, 1)}}),
    _backward("k-head-dim-mismatch", ValueError, r"k must have head_dim 40 like q",
              {"k": {"shape": (2, 33, 2, 48)}, "v": {"shape": (2, 33, 2, 48)}}),
    _backward("deterministic-not-bool", TypeError, "deterministic must be a bool, got int 1", deterministic=1),
    _backward("causal-not-bool", TypeError, "causal must be a bool, got NoneType None", causal=None),
    _backward("dout-other-gpu", ValueError, "dout is on GPU 1 but q is on GPU 0", {"dout": {"device": 1}}),
]


def make_cupy_arrays(case: BadCase) -> dict:
    """Real GPU arrays for a case's specs (strided specs as views into a buffer)."""
    import cupy

    arrays = {}
    for name, spec in case.arrays().items():
        dtype = cupy.dtype(spec["dtype"])
        shape = spec["shape"]
        if "strides" in spec:
            span = 1 + sum((size - 1) * stride for size, stride in zip(shape, spec["strides"]))
            base = cupy.zeros(max(span, 1), dtype=dtype)
            arrays[name] = cupy.lib.stride_tricks.as_strided(
                base, shape=shape, strides=[stride * dtype.itemsize for stride in spec["strides"]])
        else:
            arrays[name] = cupy.zeros(shape, dtype=dtype)
    return arrays
