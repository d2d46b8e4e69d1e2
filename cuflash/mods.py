"""User score and mask functions: written as ordinary Python, traced once
into an expression graph, then turned into CUDA C (a kernel policy) and
differentiated with respect to the score (the backward's dS).

A score function ``score_mod(score, b, h, q_idx, kv_idx, **arrays)`` maps
the scaled score of query ``q_idx`` and key ``kv_idx`` of head ``h`` in
batch entry ``b`` to a new score; a mask function ``mask_mod(b, h, q_idx,
kv_idx, **arrays)`` says whether the query sees the key. Both receive the
arrays the call passes by name (a bias table, per-token document ids, ...)
and may use arithmetic, comparisons, ``where``, ``minimum``/``maximum``,
``abs``, ``exp``, ``log``, ``tanh``, ``&``/``|``/``~`` on conditions, and
indexing into those arrays with integer expressions::

    from cuflash import mods

    def relative_bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, mods.minimum(mods.maximum(q_idx - kv_idx, -128), 127) + 128]

    def same_document(b, h, q_idx, kv_idx, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

Tracing calls the function once with symbolic values (``trace_score_mod``,
``trace_mask_mod``): Python control flow on them (``if``, ``and``, ``or``,
``min``, ``max``) cannot be traced and raises a ``TypeError`` saying what
to use instead. Called with NumPy arrays the same functions compute
(``evaluate_score_mod``, ``evaluate_mask_mod``: the float64 references).
Indices are clamped to each array's bounds, in the kernels and in NumPy
alike: a wrong index reads a wrong element, never memory outside the array.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["where", "minimum", "maximum", "exp", "log", "tanh", "cuda", "Expr", "ScoreModTrace", "MaskModTrace",
           "RawScoreMod", "trace_score_mod", "trace_mask_mod", "evaluate_score_mod", "evaluate_mask_mod"]

#: The position arguments every function receives after the score, in order.
POSITIONS = ("b", "h", "q_idx", "kv_idx")
#: Array dtypes a function may index, and their C++ element types.
ARRAY_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int",
               "int64": "long long", "bool": "bool"}
_FLOATING = ("float32", "float16", "bfloat16")


class Expr:
    """A traced value: an operation (``op``) on arguments (``args``: other
    Exprs, or the constant / name / array of a leaf), with a kind: "float",
    "int" or "bool". Hash-consed by structure, so a sub-expression written
    twice is one node (one temporary in the generated code)."""

    __slots__ = ("op", "args", "kind", "_key")
    __array_priority__ = 1000  # NumPy scalars on the left defer to Expr's operators

    def __init__(self, op: str, args: tuple, kind: str):
        self.op, self.args, self.kind = op, args, kind
        self._key = (op, tuple(a._key if isinstance(a, Expr) else a for a in args), kind)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):  # an elementwise comparison, as in NumPy
        return _compare("==", self, other)

    def __ne__(self, other):
        return _compare("!=", self, other)

    def same_as(self, other) -> bool:
        return isinstance(other, Expr) and self._key == other._key

    def __bool__(self):
        raise TypeError("a traced value has no truth value: inside a score or mask function use "
                        "cuflash.mods.where(condition, a, b) instead of if / and / or, cuflash.mods.minimum and "
                        "maximum instead of min and max, and & | ~ to combine conditions")

    def __index__(self):
        raise TypeError("a traced value cannot index a Python sequence: index the arrays the call passes by name")

    def __repr__(self):
        return f"Expr({self.op}, {self.kind})"

    # arithmetic
    def __add__(self, other):
        return _arith("+", self, other)

    def __radd__(self, other):
        return _arith("+", other, self)

    def __sub__(self, other):
        return _arith("-", self, other)

    def __rsub__(self, other):
        return _arith("-", other, self)

    def __mul__(self, other):
        return _arith("*", self, other)

    def __rmul__(self, other):
        return _arith("*", other, self)

    def __truediv__(self, other):
        return _arith("/", self, other)

    def __rtruediv__(self, other):
        return _arith("/", other, self)

    def __floordiv__(self, other):
        return _integer("//", self, other)

    def __rfloordiv__(self, other):
        return _integer("//", other, self)

    def __mod__(self, other):
        return _integer("%", self, other)

    def __rmod__(self, other):
        return _integer("%", other, self)

    def __neg__(self):
        _need(self, ("float", "int"), "-x")
        return Expr("neg", (self,), self.kind)

    def __pos__(self):
        return self

    def __abs__(self):
        _need(self, ("float", "int"), "abs(x)")
        return Expr("abs", (self,), self.kind)

    # comparisons
    def __lt__(self, other):
        return _compare("<", self, other)

    def __le__(self, other):
        return _compare("<=", self, other)

    def __gt__(self, other):
        return _compare(">", self, other)

    def __ge__(self, other):
        return _compare(">=", self, other)

    # conditions
    def __and__(self, other):
        return _logical("&", self, other)

    def __rand__(self, other):
        return _logical("&", other, self)

    def __or__(self, other):
        return _logical("|", self, other)

    def __ror__(self, other):
        return _logical("|", other, self)

    def __invert__(self):
        _need(self, ("bool",), "~x")
        return Expr("not", (self,), "bool")


def _constant(value) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, (bool, np.bool_)):
        return Expr("const", (bool(value),), "bool")
    if isinstance(value, (int, np.integer)):
        if not -2**31 <= int(value) < 2**31:
            raise ValueError(f"integer constants in a score or mask function must fit 32 bits, got {value}")
        return Expr("const", (int(value),), "int")
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(float(value)):
            raise ValueError(f"float constants in a score or mask function must be finite, got {value} "
                             f"(mask keys with a mask function instead of -inf scores)")
        return Expr("const", (float(value),), "float")
    raise TypeError(f"a score or mask function may combine traced values with ints, floats and bools, "
                    f"got {type(value).__name__}")


def _need(x: Expr, kinds: tuple[str, ...], what: str) -> None:
    if x.kind not in kinds:
        raise TypeError(f"{what} takes {' or '.join(kinds)} values, got a {x.kind} one")


def _arith(op: str, a, b) -> Expr:
    a, b = _constant(a), _constant(b)
    for x in (a, b):
        _need(x, ("float", "int"), f"x {op} y")
    kind = "float" if op == "/" or "float" in (a.kind, b.kind) else "int"
    return Expr(op, (_as(a, kind), _as(b, kind)), kind)


def _integer(op: str, a, b) -> Expr:
    a, b = _constant(a), _constant(b)
    for x in (a, b):
        _need(x, ("int",), f"x {op} y")
    return Expr(op, (a, b), "int")


def _compare(op: str, a, b) -> Expr:
    a, b = _constant(a), _constant(b)
    if a.kind == "bool" or b.kind == "bool":
        if op not in ("==", "!=") or a.kind != b.kind:
            raise TypeError(f"x {op} y compares numbers, or two conditions with == / !=")
        return Expr(op, (a, b), "bool")
    kind = "float" if "float" in (a.kind, b.kind) else "int"
    return Expr(op, (_as(a, kind), _as(b, kind)), "bool")


def _logical(op: str, a, b) -> Expr:
    a, b = _constant(a), _constant(b)
    for x in (a, b):
        _need(x, ("bool",), f"x {op} y")
    return Expr(op, (a, b), "bool")


def _as(x: Expr, kind: str) -> Expr:
    """``x`` converted to ``kind`` ("float" from "int")."""
    if x.kind == kind:
        return x
    if x.op == "const":
        return Expr("const", (float(x.args[0]),), "float")
    return Expr("float", (x,), "float")


def _traced(*values) -> bool:
    return any(isinstance(v, Expr) for v in values)


def where(condition, a, b):
    """``a`` where ``condition`` holds, else ``b`` (NumPy's ``where`` on arrays)."""
    if not _traced(condition, a, b):
        return np.where(condition, a, b)
    condition, a, b = _constant(condition), _constant(a), _constant(b)
    _need(condition, ("bool",), "where's condition")
    if "bool" in (a.kind, b.kind):
        if a.kind != b.kind:
            raise TypeError("where takes two conditions or two numbers, not one of each")
        return Expr("where", (condition, a, b), "bool")
    kind = "float" if "float" in (a.kind, b.kind) else "int"
    return Expr("where", (condition, _as(a, kind), _as(b, kind)), kind)


def minimum(a, b):
    """The smaller of ``a`` and ``b`` (NumPy's ``minimum`` on arrays)."""
    if not _traced(a, b):
        return np.minimum(a, b)
    return _binary_function("min", a, b)


def maximum(a, b):
    """The larger of ``a`` and ``b`` (NumPy's ``maximum`` on arrays)."""
    if not _traced(a, b):
        return np.maximum(a, b)
    return _binary_function("max", a, b)


def _binary_function(op: str, a, b) -> Expr:
    a, b = _constant(a), _constant(b)
    for x in (a, b):
        _need(x, ("float", "int"), f"{op}imum")
    kind = "float" if "float" in (a.kind, b.kind) else "int"
    return Expr(op, (_as(a, kind), _as(b, kind)), kind)


def _unary_function(op: str, numpy_function):
    def function(x):
        if not _traced(x):
            return numpy_function(x)
        x = _constant(x)
        _need(x, ("float", "int"), op)
        return Expr(op, (_as(x, "float"),), "float")
    function.__name__ = op
    function.__doc__ = f"{op} of a float (NumPy's on arrays)."
    return function


exp = _unary_function("exp", np.exp)
log = _unary_function("log", np.log)
tanh = _unary_function("tanh", np.tanh)


@dataclass(frozen=True)
class ArraySpec:
    """What a trace knows of an array the call passes by name: its shape and
    dtype (C-contiguous); its address is read from the call."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def kind(self) -> str:
        return "float" if self.dtype in _FLOATING else "bool" if self.dtype == "bool" else "int"


class ArrayHandle:
    """An array as a traced function sees it: ``handle[i, j, ...]`` with
    integer expressions (one per dimension) is a load."""

    def __init__(self, index: int, spec: ArraySpec):
        self.index, self.spec = index, spec

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(self.spec.shape):
            raise IndexError(f"array {self.spec.name!r} has {len(self.spec.shape)} dimensions "
                             f"{self.spec.shape}, indexed with {len(key)}")
        indices = tuple(_constant(k) for k in key)
        for k in indices:
            if k.kind != "int":
                raise TypeError(f"array {self.spec.name!r} takes integer indices, got a {k.kind} one")
        return Expr("load", (self.index, *indices), self.spec.kind)

    def __len__(self):
        return self.spec.shape[0]


class ClampedArray:
    """A NumPy array indexed as the kernels index it (``evaluate_*``): each
    index clamped to its dimension, so both read the same element."""

    def __init__(self, array: np.ndarray):
        self.array = np.asarray(array)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != self.array.ndim:
            raise IndexError(f"an array of {self.array.ndim} dimensions indexed with {len(key)}")
        clamped = tuple(np.clip(np.asarray(k, dtype=np.int64), 0, n - 1) for k, n in zip(key, self.array.shape))
        return self.array[clamped]


def _array_specs(arrays: dict) -> tuple[ArraySpec, ...]:
    specs = []
    for name, array in arrays.items():
        if not name.isidentifier():
            raise ValueError(f"array names must be Python identifiers, got {name!r}")
        shape = tuple(int(n) for n in array.shape)
        dtype = array.dtype if isinstance(array, ArraySpec) else _dtype_name(array.dtype)
        if dtype not in ARRAY_TYPES:
            raise TypeError(f"array {name!r} must have one of the dtypes {sorted(ARRAY_TYPES)}, got {dtype}")
        if any(n == 0 for n in shape) or not shape:
            raise ValueError(f"array {name!r} must have at least one dimension and no empty one, got shape {shape}")
        specs.append(ArraySpec(name, shape, dtype))
    return tuple(specs)


def _dtype_name(dtype) -> str:
    """NumPy's name of an array's dtype: NumPy's, CuPy's, JAX's or PyTorch's
    (``torch.int32`` -> "int32")."""
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    return np.dtype(dtype).name if text != "bfloat16" else text


def _check_signature(fn: Callable, leading: tuple[str, ...], what: str) -> None:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # builtins and the like: the call below explains
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(leading) and not any(p.kind == p.VAR_POSITIONAL for p in parameters.values()):
        raise TypeError(f"{what} must take ({', '.join(leading)}, **arrays), got {getattr(fn, '__name__', fn)}"
                        f"{inspect.signature(fn)}")


@dataclass(frozen=True)
class ScoreModTrace:
    """A traced score function: the new score and its derivative with
    respect to the score, as expressions, and the arrays it reads."""

    name: str
    value: Expr
    gradient: Expr
    arrays: tuple[ArraySpec, ...]

    @property
    def reads_position(self) -> bool:
        """Whether the result depends on more than the score (a batch
        entry, head, query or key index, or an array)."""
        return _reads_position(self.value)


@dataclass(frozen=True)
class MaskModTrace:
    """A traced mask function: the condition (True: the query sees the key)."""

    name: str
    value: Expr
    arrays: tuple[ArraySpec, ...]


def _any_node(expr: Expr, predicate: Callable[[Expr], bool]) -> bool:
    """Whether some node of ``expr``'s graph satisfies ``predicate``."""
    seen, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if predicate(node):
            return True
        stack.extend(a for a in node.args if isinstance(a, Expr))
    return False


def _reads_position(expr: Expr) -> bool:
    return _any_node(expr, lambda node: node.op == "load" or (node.op == "var" and node.args[0] != "score"))


def _leaves(specs: tuple[ArraySpec, ...]) -> tuple[list[Expr], dict]:
    positions = [Expr("var", (name,), "int") for name in POSITIONS]
    handles = {spec.name: ArrayHandle(i, spec) for i, spec in enumerate(specs)}
    return positions, handles


def trace_score_mod(fn: Callable, arrays: dict | None = None) -> ScoreModTrace:
    """Traces ``fn(score, b, h, q_idx, kv_idx, **arrays)`` (``arrays``: name
    -> an array or anything with ``shape`` and ``dtype``): its value and its
    derivative with respect to ``score``."""
    specs = _array_specs(arrays or {})
    _check_signature(fn, ("score",) + POSITIONS, "score_mod")
    positions, handles = _leaves(specs)
    score = Expr("var", ("score",), "float")
    value = _constant(fn(score, *positions, **handles))
    if value.kind == "bool":
        raise TypeError("score_mod must return a number (a new score), got a condition: a function of "
                        "(b, h, q_idx, kv_idx) that says which keys a query sees is a mask_mod")
    value = _as(value, "float")
    return ScoreModTrace(getattr(fn, "__name__", "score_mod"), value, derivative(value), specs)


def trace_mask_mod(fn: Callable, arrays: dict | None = None) -> MaskModTrace:
    """Traces ``fn(b, h, q_idx, kv_idx, **arrays)``, which must return a condition."""
    specs = _array_specs(arrays or {})
    _check_signature(fn, POSITIONS, "mask_mod")
    positions, handles = _leaves(specs)
    value = _constant(fn(*positions, **handles))
    if value.kind != "bool":
        raise TypeError(f"mask_mod must return a condition (a comparison, or conditions combined with & | ~), "
                        f"got a {value.kind} value")
    return MaskModTrace(getattr(fn, "__name__", "mask_mod"), value, specs)


# --- differentiation with respect to the score ---

_ZERO = Expr("const", (0.0,), "float")
_ONE = Expr("const", (1.0,), "float")


def derivative(expr: Expr) -> Expr:
    """d expr / d score, an expression (0 where ``expr`` does not depend
    on the score: integers, conditions and array loads are constants)."""
    memo: dict = {}

    def d(node: Expr) -> Expr:
        key = node._key
        if key in memo:
            return memo[key]
        result = _derivative_of(node, d)
        memo[key] = result
        return result

    return _simplify(d(expr))


def _derivative_of(node: Expr, d) -> Expr:
    op, args = node.op, node.args
    if node.kind != "float" or op in ("const", "load", "float"):
        return _ZERO
    if op == "var":
        return _ONE if args[0] == "score" else _ZERO
    if op in ("+", "-"):
        return Expr(op, (d(args[0]), d(args[1])), "float")
    if op == "*":
        return Expr("+", (Expr("*", (d(args[0]), args[1]), "float"), Expr("*", (args[0], d(args[1])), "float")),
                    "float")
    if op == "/":  # (a' b - a b') / b^2
        a, b = args
        numerator = Expr("-", (Expr("*", (d(a), b), "float"), Expr("*", (a, d(b)), "float")), "float")
        return Expr("/", (numerator, Expr("*", (b, b), "float")), "float")
    if op == "neg":
        return Expr("neg", (d(args[0]),), "float")
    if op == "abs":  # sign(x) x'; 0 at x = 0 (a subgradient)
        x = args[0]
        sign = Expr("where", (Expr(">", (x, _ZERO), "bool"), _ONE,
                              Expr("where", (Expr("<", (x, _ZERO), "bool"), Expr("const", (-1.0,), "float"), _ZERO),
                                   "float")), "float")
        return Expr("*", (sign, d(x)), "float")
    if op == "exp":
        return Expr("*", (node, d(args[0])), "float")
    if op == "log":
        return Expr("/", (d(args[0]), args[0]), "float")
    if op == "tanh":  # (1 - tanh^2) x'
        return Expr("*", (Expr("-", (_ONE, Expr("*", (node, node), "float")), "float"), d(args[0])), "float")
    if op == "where":
        return Expr("where", (args[0], d(args[1]), d(args[2])), "float")
    if op in ("min", "max"):  # the derivative of the argument chosen (the first on ties)
        a, b = args
        chooses_a = Expr("<=" if op == "min" else ">=", (a, b), "bool")
        return Expr("where", (chooses_a, d(a), d(b)), "float")
    raise NotImplementedError(f"no derivative rule for {op}")  # every float op above has one


#: Operations on float constants that differentiation folds (in float64: the
#: folded constant is then rounded once, to float32, in the generated code).
_FOLDABLE = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
             "/": lambda a, b: a / b if b else math.copysign(math.inf, a), "neg": lambda a: -a}


def _simplify(expr: Expr) -> Expr:
    """Folds the zeros and ones differentiation leaves behind (x + 0, x * 1,
    0 * x, where(c, 0, 0)), bottom up."""
    memo: dict = {}

    def s(node: Expr) -> Expr:
        if not isinstance(node, Expr) or node.op in ("const", "var", "load"):
            return node
        if node._key in memo:
            return memo[node._key]
        args = tuple(s(a) if isinstance(a, Expr) else a for a in node.args)
        zero = [isinstance(a, Expr) and a.same_as(_ZERO) for a in args]
        one = [isinstance(a, Expr) and a.same_as(_ONE) for a in args]
        result = Expr(node.op, args, node.kind)
        if node.op == "+" and zero[0]:
            result = args[1]
        elif node.op in ("+", "-") and zero[1]:
            result = args[0]
        elif node.op == "-" and zero[0]:
            result = Expr("neg", (args[1],), "float")
        elif node.op == "*" and (zero[0] or zero[1]):
            result = _ZERO
        elif node.op == "*" and one[0]:
            result = args[1]
        elif node.op == "*" and one[1]:
            result = args[0]
        elif node.op == "/" and zero[0]:
            result = _ZERO
        elif node.op == "neg" and zero[0]:
            result = _ZERO
        elif node.op == "where" and args[1].same_as(args[2]):
            result = args[1]
        elif node.op in _FOLDABLE and all(isinstance(a, Expr) and a.op == "const" and a.kind == "float"
                                          for a in args):
            result = Expr("const", (float(_FOLDABLE[node.op](*(a.args[0] for a in args))),), "float")
        memo[node._key] = result
        return result

    return s(expr)


# --- CUDA C ---

_BINARY_C = {"+": "+", "-": "-", "*": "*", "/": "/", "<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==",
             "!=": "!=", "&": "&&", "|": "||"}
_FLOAT_FUNCTIONS = {"exp": "expf", "log": "logf", "tanh": "tanhf", "min": "fminf", "max": "fmaxf", "abs": "fabsf"}
_C_TYPES = {"float": "float", "int": "int", "bool": "bool"}


def _float_literal(value: float) -> str:
    text = repr(float(value))
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


class _CudaWriter:
    """Statements computing expressions, one temporary per distinct node."""

    def __init__(self, specs: tuple[ArraySpec, ...], array_pointer: str, precise: str, float_positions: bool = False):
        self.specs, self.array_pointer, self.precise = specs, array_pointer, precise
        self.float_positions = float_positions
        self.lines: list[str] = []
        self.names: dict = {}
        self.prefix = "t"  # the temporaries' names

    def emit(self, node: Expr) -> str:
        if node.op == "const":
            value = node.args[0]
            if node.kind == "float":
                return _float_literal(value)
            return ("true" if value else "false") if node.kind == "bool" else str(value)
        if node.op == "var":
            return node.args[0]
        if node._key in self.names:
            return self.names[node._key]
        code = self._expression(node)
        name = f"{self.prefix}{len(self.names)}"
        self.names[node._key] = name
        self.lines.append(f"const {_C_TYPES[node.kind]} {name} = {code};")
        return name

    def _expression(self, node: Expr) -> str:
        op, args = node.op, node.args
        if op == "load":
            spec = self.specs[args[0]]
            strides = [int(np.prod(spec.shape[i + 1:])) for i in range(len(spec.shape))]
            # 32-bit offsets where the array has fewer than 2**31 elements:
            # half the registers per index in the kernels' element loops.
            wide = int(np.prod(spec.shape)) >= 2**31
            offset = " + ".join(
                f"static_cast<long long>(min(max({self.emit(i)}, 0), {n - 1})) * {stride}LL" if wide else
                f"min(max({self.emit(i)}, 0), {n - 1}) * {stride}"
                for i, n, stride in zip(args[1:], spec.shape, strides))
            element = f"static_cast<const {ARRAY_TYPES[spec.dtype]}*>({self.array_pointer}[{args[0]}])[{offset}]"
            if spec.dtype in ("float16", "bfloat16"):
                return f"mod_load_float({element})"
            return f"static_cast<{_C_TYPES[spec.kind]}>({element})"
        if op == "float":
            if self.float_positions and _float_bound(args[0]) is not None:
                return _float_form(args[0])
            return f"static_cast<float>({self.emit(args[0])})"
        if op == "neg":
            return f"-{self.emit(args[0])}"
        if op == "not":
            return f"!{self.emit(args[0])}"
        if op == "abs":
            return f"{'fabsf' if node.kind == 'float' else 'abs'}({self.emit(args[0])})"
        if op in ("exp", "log", "tanh"):
            return f"mod_{op}<{self.precise}>({self.emit(args[0])})"
        if op in ("min", "max"):
            function = _FLOAT_FUNCTIONS[op] if node.kind == "float" else op
            return f"{function}({self.emit(args[0])}, {self.emit(args[1])})"
        if op == "where":
            return f"({self.emit(args[0])} ? {self.emit(args[1])} : {self.emit(args[2])})"
        if op == "//":
            return f"mod_floor_divide({self.emit(args[0])}, {self.emit(args[1])})"
        if op == "%":
            return f"mod_floor_modulo({self.emit(args[0])}, {self.emit(args[1])})"
        if op == "/" and node.kind == "float":
            divisor = args[1]
            if divisor.op == "const" and divisor.args[0] != 0:
                # 16-bit inputs: by the reciprocal (one multiply, not an IEEE division).
                return (f"({self.precise} ? {self.emit(args[0])} / {self.emit(divisor)} : "
                        f"{self.emit(args[0])} * {_float_literal(1.0 / divisor.args[0])})")
            return f"({self.emit(args[0])} / {self.emit(args[1])})"
        return f"({self.emit(args[0])} {_BINARY_C[op]} {self.emit(args[1])})"


#: Positions below this the kernels may hand a user score function as
#: floats too (``float_positions``): sums of two and a constant stay exact.
FLOAT_POSITION_LIMIT = 2**22
_FLOAT_EXACT = 2**24


def _float_bound(node: Expr) -> int | None:
    """A bound on |node| where ``node`` is an integer expression of the
    positions made of sums, differences, negation, abs, min and max (and
    constants) that float arithmetic computes exactly (every partial value
    below 2**24); None otherwise."""
    op, args = node.op, node.args
    if op == "var":
        bound = FLOAT_POSITION_LIMIT
    elif op == "const":
        bound = abs(int(args[0])) if node.kind == "int" and abs(int(args[0])) < FLOAT_POSITION_LIMIT else None
    elif op in ("neg", "abs"):
        bound = _float_bound(args[0])
    elif op in ("+", "-", "min", "max"):
        bounds = [_float_bound(a) for a in args]
        bound = None if None in bounds else (sum(bounds) if op in ("+", "-") else max(bounds))
    else:
        bound = None
    return bound if bound is not None and bound < _FLOAT_EXACT else None


_FLOAT_OPS = {"+": "+", "-": "-"}


def _float_form(node: Expr) -> str:
    """``node`` (``_float_bound`` holds) computed in float arithmetic on the
    positions as floats (q_idx_f, kv_idx_f; b and h converted once)."""
    op, args = node.op, node.args
    if op == "var":
        return {"q_idx": "q_idx_f", "kv_idx": "kv_idx_f"}.get(args[0], f"static_cast<float>({args[0]})")
    if op == "const":
        return _float_literal(args[0])
    if op == "neg":
        return f"(-{_float_form(args[0])})"
    if op == "abs":
        return f"fabsf({_float_form(args[0])})"
    if op in ("min", "max"):
        return f"{_FLOAT_FUNCTIONS[op]}({_float_form(args[0])}, {_float_form(args[1])})"
    return f"({_float_form(args[0])} {_FLOAT_OPS[op]} {_float_form(args[1])})"


def cuda_statements(expr: Expr, specs: tuple[ArraySpec, ...], result: str,
                    array_pointer: str = "arrays", precise: str = "true", float_positions: bool = False,
                    known: dict | None = None) -> list[str]:
    """C statements that compute ``expr`` into a new constant ``result``
    (the variables score, b, h, q_idx, kv_idx in scope; arrays at
    ``array_pointer[i]``, in the order of ``specs``; with
    ``float_positions`` also q_idx_f and kv_idx_f, the positions as floats,
    which conversions of exact position arithmetic to float use instead:
    a kernel derives them per fragment, without a conversion per score;
    ``known``: nodes already computed, by key, and the names they have)."""
    writer = _CudaWriter(specs, array_pointer, precise, float_positions)
    writer.names = dict(known or {})
    value = writer.emit(expr)
    return writer.lines + [f"const {_C_TYPES[expr.kind]} {result} = {value};"]


#: Header the generated code needs (its helpers: kernels_cu/user_mods.cuh).
HEADER = "user_mods.cuh"


def cuda_function(name: str, expr: Expr, specs: tuple[ArraySpec, ...], with_score: bool) -> str:
    """A host-and-device C++ function ``name`` computing ``expr`` from
    (score,) b, h, q_idx, kv_idx and the arrays' addresses."""
    parameters = (["float score"] if with_score else []) + [f"int {p}" for p in POSITIONS]
    parameters.append("const void* const* arrays")
    body = cuda_statements(expr, specs, "result")
    unused = _void_casts((["score"] if with_score else []) + list(POSITIONS) + ["arrays"], "    ")
    return (f"CUFLASH_HOST_DEVICE {_C_TYPES[expr.kind]} {name}({', '.join(parameters)}) {{\n{unused}"
            + "".join(f"    {line}\n" for line in body) + "    return result;\n}\n")


def _void_casts(names, indent: str) -> str:
    """Statements that mark generated functions' parameters used (a
    function of the positions alone still takes every one)."""
    return "".join(f"{indent}(void){name};\n" for name in names)


#: Arrays a call may pass to its score function (VariantParams::user_arrays).
MAX_ARRAYS = 4


@dataclass(frozen=True)
class RawScoreMod:
    """A score function written as CUDA-C expressions (``cuda``) instead of
    Python: ``value`` and ``gradient`` (its derivative by the score; None:
    forward only) over float ``score`` (scaled), ints ``b``, ``h``,
    ``q_idx``, ``kv_idx`` and each mod array as a typed const pointer of its
    name (C-contiguous: index it flat)."""

    value: str
    gradient: str | None = None
    name: str = "cuda"

    def bound(self, arrays: dict) -> "RawScoreModTrace":
        """This function with the arrays' shapes and dtypes of a call."""
        return RawScoreModTrace(self, _array_specs(arrays))


def cuda(value: str, gradient: str | None = None, name: str = "cuda") -> RawScoreMod:
    """A score function as CUDA-C expressions: ``cuflash.attention(...,
    score_mod=cuflash.mods.cuda("score - 0.1f * abs(q_idx - kv_idx)",
    gradient="1.0f"))``. The backward needs ``gradient``."""
    for what, text in (("value", value), ("gradient", gradient)):
        if text is not None and (not isinstance(text, str) or not text.strip()):
            raise TypeError(f"cuflash.mods.cuda's {what} must be a non-empty CUDA-C expression string, got {text!r}")
    return RawScoreMod(value, gradient, name)


@dataclass(frozen=True)
class RawScoreModTrace:
    """A raw score function bound to a call's arrays: what the kernels'
    policy is generated from, like a ``ScoreModTrace``."""

    mod: RawScoreMod
    arrays: tuple[ArraySpec, ...]
    #: a raw expression may read anything: never folded across heads or rows
    reads_position: bool = True

    @property
    def name(self) -> str:
        return self.mod.name


def _raw_statements(expression: str | None, specs: tuple[ArraySpec, ...]) -> list[str]:
    pointers = [f"const {ARRAY_TYPES[spec.dtype]}* const {spec.name} = static_cast<const {ARRAY_TYPES[spec.dtype]}*>"
                f"(arrays[{i}]); (void){spec.name};" for i, spec in enumerate(specs)]
    # No gradient: the launcher refuses a backward before any launch (api._attention_backward).
    return pointers + [f"const float result = static_cast<float>({expression if expression else '0.0f'});"]


def score_policy(trace, float_positions: bool = True) -> tuple[str, str]:
    """(C++ type, with ``{precise}`` to format as ``ScoreTransform.cxx``
    does, and code) of the kernels' score policy for a traced score
    function (kernels_cu/score_transforms.cuh's contract, with
    kGradientFromRaw), or a raw one (``cuda``): in raw-score units, as every
    transform works, so the function sees score = raw * softmax_scale and
    its result is divided by the scale again; its derivative with respect
    to the raw score is the function's with respect to the scaled one."""
    if len(trace.arrays) > MAX_ARRAYS:
        raise ValueError(f"a score function reads at most {MAX_ARRAYS} arrays, got {len(trace.arrays)}")
    name = f"UserScore_{trace_key(trace)}{'' if float_positions else '_int'}"
    members, hoisted = "", ""
    value_return = "result * inverse_scale"
    if isinstance(trace, RawScoreModTrace):
        value_lines = _raw_statements(trace.mod.value, trace.arrays)
        gradient_lines = _raw_statements(trace.mod.gradient, trace.arrays)
    else:
        value_expr, value_return = _raw_score_form(trace.value)
        uniform = _CudaWriter(trace.arrays, "arrays", "kPrecise")
        uniform.prefix = "u"
        for node in _uniform_parts(value_expr) + _uniform_parts(trace.gradient):
            uniform.emit(node)
        members = "".join(f"    {line.split(' = ')[0].removeprefix('const ')};\n" for line in uniform.lines)
        hoisted = "".join(f"        {line.removeprefix('const ').split(' ', 1)[1]}\n" for line in uniform.lines)
        value_lines = cuda_statements(value_expr, trace.arrays, "result", precise="kPrecise",
                                      float_positions=float_positions, known=uniform.names)
        gradient_lines = cuda_statements(trace.gradient, trace.arrays, "result", precise="kPrecise",
                                         known=uniform.names)
    value = "".join(f"        {line}\n" for line in value_lines)
    gradient = "".join(f"        {line}\n" for line in gradient_lines)
    code = f"""
#include "{HEADER}"
namespace cuflash {{
// Generated by cuflash.mods from the score function {trace.name!r}
// (kPrecise: float32 inputs, whose exp, log and tanh are the precise ones).
template <bool kPrecise>
struct {name} {{
    static constexpr bool kIsIdentity = false;
    static constexpr bool kDropout = false;
    static constexpr bool kGradientFromRaw = true;
    // The fragment walks pass the positions as floats too (transform's
    // last two arguments: exact below 2**22).
    static constexpr bool kFloatPositions = true;
    const void* const* arrays;
    float scale, inverse_scale;
    int b, h;
    // What depends on the head and batch entry alone, once per head.
{members}
    __device__ __forceinline__ {name}(const VariantParams& variant, SequenceBounds, index_t batch, index_t head)
        : arrays(variant.user_arrays),
          scale(variant.scale),
          inverse_scale(variant.inverse_scale),
          b(static_cast<int>(batch)),
          h(static_cast<int>(head)) {{
{hoisted}    }}
    __device__ __forceinline__ float transform(float raw, int q_idx, int kv_idx, float q_idx_f,
                                               float kv_idx_f) const {{
        (void)q_idx_f;
        (void)kv_idx_f;
        const float score = raw * scale;
        (void)score;
{value}        return {value_return};
    }}
    __device__ __forceinline__ float transform(float raw, int q_idx, int kv_idx) const {{
        return transform(raw, q_idx, kv_idx, static_cast<float>(q_idx), static_cast<float>(kv_idx));
    }}
    __device__ __forceinline__ float gradient_from_raw(float raw, int q_idx, int kv_idx) const {{
        const float score = raw * scale;
{gradient}        return result;
    }}
}};
}}  // namespace cuflash
"""
    return f"cuflash::{name}<{{precise}}>", code


def _position_reads(node: Expr, memo: dict) -> frozenset:
    """The positions among q_idx and kv_idx that ``node`` reads."""
    key = id(node)
    if key not in memo:
        if node.op == "var":
            memo[key] = frozenset({node.args[0]}) & {"q_idx", "kv_idx"}
        else:
            memo[key] = frozenset().union(*(_position_reads(a, memo) for a in node.args if isinstance(a, Expr)))
    return memo[key]


def rule_parts(expr: Expr) -> tuple[list[Expr], list[Expr]]:
    """(row parts, key parts) of a mask condition: its largest parts that
    read no key position (the same for every key of a query row: a
    document id ``doc[b, q_idx]``) and those that read the key position but
    no query position (``doc[b, kv_idx]``), constants and plain variables
    left out. A kernel's thread computes the parts of each of its rows and
    keys once per tile, then only what combines them per score."""
    memo, rows, keys, seen, stack = {}, {}, {}, set(), [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen or node.op in ("const", "var"):
            continue
        seen.add(id(node))
        reads = _position_reads(node, memo)
        if "kv_idx" not in reads:
            rows[node._key] = node
        elif "q_idx" not in reads:
            keys[node._key] = node
        else:
            stack.extend(a for a in node.args if isinstance(a, Expr))
    return list(rows.values()), list(keys.values())


def _part_function(struct: str, function: str, position: str, parts: list[Expr],
                   specs: tuple[ArraySpec, ...]) -> str:
    """A generated rule's row or key part: ``struct`` holding ``parts``'
    values and ``function`` computing them from b, h and ``position``."""
    writer = _CudaWriter(specs, "arrays", "true")
    values = [writer.emit(part) for part in parts]
    fields = "".join(f" {_C_TYPES[part.kind]} p{i};" for i, part in enumerate(parts))
    body = "".join(f"        {line}\n" for line in writer.lines)
    return (f"    struct {struct} {{{fields} }};\n"
            f"    static CUFLASH_HOST_DEVICE {struct} {function}(const void* const* arrays, int b, int h, "
            f"int {position}) {{\n{_void_casts(('arrays', 'b', 'h', position), '        ')}{body}"
            f"        return {struct}{{{', '.join(values)}}};\n    }}\n")


def mask_rule(trace: MaskModTrace) -> tuple[str, str]:
    """(C++ type, code) of the rule of a traced mask function: a struct
    whose ``visible(arrays, b, h, q_idx, kv_idx)`` is the condition, the
    ``Rule`` of the kernels' ``UserMask`` (kernels_cu/masks.cuh) and of the
    tile-map builder (kernels_cu/block_map.cu). The condition comes in
    three steps (``rule_parts``): ``row`` (what reads no key position),
    ``key`` (what reads no query position) and ``combine``, so that the
    tensor-core kernels evaluate a row's and a key's parts once per tile,
    not once per score (a document mask's two array reads become one
    comparison per score)."""
    if len(trace.arrays) > MAX_ARRAYS:
        raise ValueError(f"a mask function reads at most {MAX_ARRAYS} arrays, got {len(trace.arrays)}")
    name = f"UserRule_{trace_key(trace)}"
    row_parts, key_parts = rule_parts(trace.value)
    combined = _CudaWriter(trace.arrays, "arrays", "true")
    combined.names = {part._key: f"row.p{i}" for i, part in enumerate(row_parts)}
    combined.names |= {part._key: f"key.p{i}" for i, part in enumerate(key_parts)}
    result = combined.emit(trace.value)
    body = "".join(f"        {line}\n" for line in combined.lines)
    unused = _void_casts(("row", "key", "arrays", *POSITIONS), "        ")
    code = f"""
#include "{HEADER}"
namespace cuflash {{
// Generated by cuflash.mods from the mask function {trace.name!r}.
struct {name} {{
    static constexpr int kParts = {len(row_parts) + len(key_parts)};
{_part_function("Row", "row", "q_idx", row_parts, trace.arrays)}{_part_function("Key", "key", "kv_idx", key_parts, trace.arrays)}
    static CUFLASH_HOST_DEVICE bool combine(const Row& row, const Key& key, const void* const* arrays, int b, int h,
                                            int q_idx, int kv_idx) {{
{unused}{body}        return {result};
    }}
    static CUFLASH_HOST_DEVICE bool visible(const void* const* arrays, int b, int h, int q_idx, int kv_idx) {{
        return combine(row(arrays, b, h, q_idx), key(arrays, b, h, kv_idx), arrays, b, h, q_idx, kv_idx);
    }}
}};
}}  // namespace cuflash
"""
    return f"cuflash::{name}", code


def reads_variable(expr: Expr, name: str) -> bool:
    """Whether ``expr`` reads position ``name`` ("b", "h", "q_idx", "kv_idx")."""
    return _any_node(expr, lambda node: node.op == "var" and node.args[0] == name)


_ELEMENT_VARIABLES = ("score", "q_idx", "kv_idx")


def _per_element(node: Expr, memo: dict) -> bool:
    """Whether ``node`` reads the score or a position (else it is the same
    for every score of a head)."""
    key = id(node)
    if key not in memo:
        memo[key] = (node.op == "var" and node.args[0] in _ELEMENT_VARIABLES) or any(
            _per_element(a, memo) for a in node.args if isinstance(a, Expr))
    return memo[key]


def _uniform_parts(expr: Expr) -> list[Expr]:
    """The largest parts of ``expr`` that are the same for every score of a
    head (neither constants nor plain variables): the policy computes them
    once, in its constructor."""
    memo, found, seen, stack = {}, {}, set(), [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op in ("const", "var"):
            continue
        if not _per_element(node, memo):
            found[node._key] = node
            continue
        stack.extend(a for a in node.args if isinstance(a, Expr))
    return list(found.values())


def _raw_score_form(value: Expr) -> tuple[Expr, str]:
    """(expression, C return value) of a score function in raw-score units:
    ``score + bias`` (or minus) returns raw + bias * inverse_scale, the
    scale folded into the bias's head-uniform factor where it has one
    (ALiBi's slope) and no multiply by the scale; any other returns its
    value (``result``) times inverse_scale."""
    if value.op in ("+", "-") and value.args[0].op == "var" and value.args[0].args[0] == "score":
        bias, sign = value.args[1], value.op
    elif value.op == "+" and value.args[1].op == "var" and value.args[1].args[0] == "score":
        bias, sign = value.args[0], "+"
    else:
        return value, "result * inverse_scale"
    memo = {}
    if _per_element(bias, memo) and bias.op == "*" and bias.kind == "float":
        # The inverse scale joins the factor that is the same for every score.
        inverse = Expr("var", ("inverse_scale",), "float")
        left, right = bias.args
        if not _per_element(left, memo):
            bias = Expr("*", (Expr("*", (left, inverse), "float"), right), "float")
            return bias, f"raw {sign} result"
        if not _per_element(right, memo):
            bias = Expr("*", (left, Expr("*", (right, inverse), "float")), "float")
            return bias, f"raw {sign} result"
    if bias.kind != "float":
        bias = Expr("float", (bias,), "float")
    return bias, f"raw {sign} result * inverse_scale"


def trace_key(trace) -> str:
    """A readable, unique name of a trace: the function's name and a hash of
    its generated code and arrays."""
    if isinstance(trace, RawScoreModTrace):
        code = f"{trace.mod.value}\n{trace.mod.gradient}"
    else:
        parts = [trace.value] + ([trace.gradient] if isinstance(trace, ScoreModTrace) else [])
        code = "\n".join("\n".join(cuda_statements(p, trace.arrays, "r")) for p in parts)
    code += repr(trace.arrays)
    digest = hashlib.sha1(code.encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() else "_" for c in trace.name)[:40] or "fn"
    return f"{name}_{digest}"


# --- NumPy evaluation (the float64 references) ---

def _position_grids(batch: int, nheads: int, seqlen_q: int, seqlen_k: int):
    return np.meshgrid(np.arange(batch), np.arange(nheads), np.arange(seqlen_q), np.arange(seqlen_k),
                       indexing="ij", sparse=True)


def evaluate_score_mod(fn: Callable, scores: np.ndarray, arrays: dict | None = None) -> np.ndarray:
    """``fn`` applied to scaled scores (batch, nheads, seqlen_q, seqlen_k)
    with NumPy, the arrays indexed as the kernels index them (clamped)."""
    scores = np.asarray(scores, dtype=np.float64)
    grids = _position_grids(*scores.shape)
    wrapped = {name: ClampedArray(_host(array)) for name, array in (arrays or {}).items()}
    return np.broadcast_to(np.asarray(fn(scores, *grids, **wrapped), dtype=np.float64), scores.shape)


def evaluate_mask_mod(fn: Callable, shape: tuple[int, int, int, int], arrays: dict | None = None) -> np.ndarray:
    """``fn``'s condition over (batch, nheads, seqlen_q, seqlen_k), with NumPy."""
    grids = _position_grids(*shape)
    wrapped = {name: ClampedArray(_host(array)) for name, array in (arrays or {}).items()}
    return np.broadcast_to(np.asarray(fn(*grids, **wrapped), dtype=bool), shape)


def _host(array) -> np.ndarray:
    """A CuPy, PyTorch, JAX or NumPy array on the host, float64 where it is floating."""
    module = type(array).__module__
    if module.startswith("cupy"):
        array = array.get()
    elif module.startswith("torch"):
        array = array.detach().cpu()
        array = (array.float() if array.is_floating_point() else array).numpy()
    array = np.asarray(array)
    return array.astype(np.float64) if array.dtype.kind == "f" or array.dtype.name == "bfloat16" else array
