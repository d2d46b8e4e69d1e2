"""User score and mask functions without a GPU: tracing (what it takes,
what it refuses and how it says so), the derivative with respect to the
score, and the CUDA C generated from a trace, compiled for the host and run
over every (batch, head, query, key) of a small grid against the same
Python function evaluated with NumPy (values, conditions, clamped array
reads, Python's floor division) and against finite differences (the
derivative)."""

import subprocess

import numpy as np
import pytest

from cuflash import mods
from cuflash._loader import kernel_source_dir
from tests.helpers import needs_nvcc

GRID = (2, 3, 7, 11)  # batch, heads, queries, keys


def relative_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, mods.minimum(mods.maximum(q_idx - kv_idx, -4), 4) + 4]


def softcap_causal(score, b, h, q_idx, kv_idx):
    return 2.5 * mods.tanh(score / 2.5) + mods.where(q_idx >= kv_idx, 0.0, -1.5) * abs(score)


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx - kv_idx)


def smooth(score, b, h, q_idx, kv_idx):
    return mods.log(1.0 + mods.exp(score)) * (q_idx // 2 - kv_idx % 3 + 1) / (h + 1)


def out_of_range(score, b, h, q_idx, kv_idx, table):
    return score * table[b - 1, q_idx + kv_idx - 5]  # reads clamped indices at both ends


def document_mask(b, h, q_idx, kv_idx, doc):
    return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)


def window_or_sink(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx <= 3) & (kv_idx <= q_idx)) | (kv_idx == 0) | ~(h != 1)


def causal_band(b, h, q_idx, kv_idx):  # positions alone: a rule without parts
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 5)


def _arrays(name):
    rng = np.random.default_rng(0)
    # values exactly representable in bfloat16, so every dtype reads the same numbers
    exact = lambda shape: rng.integers(-16, 16, shape).astype(np.float32) / 8  # noqa: E731
    return {
        "relative_bias": {"table": exact((3, 9)).astype(np.dtype("bfloat16"))},
        "alibi": {"slopes": np.array([0.5, 0.25, 0.125], dtype=np.float32)},
        "out_of_range": {"table": exact((2, 4)).astype(np.float16)},
        "document_mask": {"doc": rng.integers(0, 3, (2, 11)).astype(np.int32)},
    }.get(name, {})


SCORE_MODS = [relative_bias, softcap_causal, alibi, smooth, out_of_range]
MASK_MODS = [document_mask, window_or_sink, causal_band]


def _c_array(name: str, array: np.ndarray) -> str:
    values = ", ".join(repr(float(x)) if array.dtype.kind == "f" or array.dtype.name == "bfloat16" else str(int(x))
                       for x in np.asarray(array, dtype=np.float64 if array.dtype.kind == "f" or
                                           array.dtype.name == "bfloat16" else np.int64).ravel())
    storage = mods.ARRAY_TYPES[array.dtype.name]
    if array.dtype.name in ("float16", "bfloat16"):
        convert = "__float2half" if array.dtype.name == "float16" else "__float2bfloat16"
        return (f"static const float {name}_values[] = {{{values}}};\n{storage} {name}[{array.size}];\n"
                f"for (int i = 0; i < {array.size}; ++i) {name}[i] = {convert}({name}_values[i]);\n")
    return f"static const {storage} {name}[] = {{{values}}};\n"


def _run_generated(tmp_path, functions: str, arrays: dict, call: str) -> np.ndarray:
    """Compiles ``functions`` with the arrays defined and prints ``call`` over the grid."""
    batch, heads, queries, keys = GRID
    body = "".join(_c_array(name, array) for name, array in arrays.items())
    body += f"const void* arrays[] = {{{', '.join(arrays) or 'nullptr'}}};\n"
    body += (f"for (int b = 0; b < {batch}; ++b) for (int h = 0; h < {heads}; ++h) "
             f"for (int q_idx = 0; q_idx < {queries}; ++q_idx) for (int kv_idx = 0; kv_idx < {keys}; ++kv_idx) {{\n"
             f"const float score = 0.37f * (q_idx - 2 * kv_idx + b + h) - 0.5f;\n"
             f'printf("%.9g\\n", (double)({call}));\n}}\n')
    source = tmp_path / "mods_probe.cu"
    source.write_text(f'#include <cstdio>\n#include "{mods.HEADER}"\nusing namespace cuflash;\n{functions}\n'
                      f"int main() {{\n{body}return 0;\n}}\n")
    binary = tmp_path / "mods_probe"
    subprocess.run(["nvcc", "-std=c++17", f"-I{kernel_source_dir()}", str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()
    return np.array(out, dtype=np.float64).reshape(GRID)


def _grid_scores() -> np.ndarray:
    b, h, q, kv = np.meshgrid(*(np.arange(n) for n in GRID), indexing="ij")
    return (np.float32(0.37) * (q - 2 * kv + b + h).astype(np.float32) - np.float32(0.5)).astype(np.float64)


@needs_nvcc
@pytest.mark.parametrize("fn", SCORE_MODS, ids=lambda f: f.__name__)
def test_generated_score_code_computes_the_function_and_its_derivative(tmp_path, fn):
    arrays = _arrays(fn.__name__)
    trace = mods.trace_score_mod(fn, arrays)
    functions = (mods.cuda_function("value", trace.value, trace.arrays, True)
                 + mods.cuda_function("gradient", trace.gradient, trace.arrays, True))
    scores = _grid_scores()
    got = _run_generated(tmp_path, functions, arrays, "value(score, b, h, q_idx, kv_idx, arrays)")
    np.testing.assert_allclose(got, mods.evaluate_score_mod(fn, scores, arrays), rtol=2e-6, atol=2e-6)
    got_gradient = _run_generated(tmp_path, functions, arrays, "gradient(score, b, h, q_idx, kv_idx, arrays)")
    step = 1e-6
    numeric = (mods.evaluate_score_mod(fn, scores + step, arrays)
               - mods.evaluate_score_mod(fn, scores - step, arrays)) / (2 * step)
    np.testing.assert_allclose(got_gradient, numeric, rtol=1e-4, atol=1e-5)


@needs_nvcc
@pytest.mark.parametrize("fn", MASK_MODS, ids=lambda f: f.__name__)
def test_generated_mask_code_is_the_condition(tmp_path, fn):
    arrays = _arrays(fn.__name__)
    trace = mods.trace_mask_mod(fn, arrays)
    got = _run_generated(tmp_path, mods.cuda_function("visible", trace.value, trace.arrays, False), arrays,
                         "visible(b, h, q_idx, kv_idx, arrays)")
    np.testing.assert_array_equal(got.astype(bool), mods.evaluate_mask_mod(fn, GRID, arrays))


@needs_nvcc
@pytest.mark.parametrize("fn", MASK_MODS, ids=lambda f: f.__name__)
def test_generated_rule_in_parts_is_the_condition(tmp_path, fn):
    """The kernels' rule (mask_rule): its row part, key part and their
    combination give the condition at every point."""
    arrays = _arrays(fn.__name__)
    trace = mods.trace_mask_mod(fn, arrays)
    cxx, code = mods.mask_rule(trace)
    got = _run_generated(tmp_path, code, arrays, f"{cxx}::combine({cxx}::row(arrays, b, h, q_idx), "
                         f"{cxx}::key(arrays, b, h, kv_idx), arrays, b, h, q_idx, kv_idx)")
    np.testing.assert_array_equal(got.astype(bool), mods.evaluate_mask_mod(fn, GRID, arrays))


def test_rule_parts_split_what_reads_one_position():
    """What reads no key position is a row part, what reads the key but
    not the query position a key part; what reads both stays per score."""
    rows, keys = mods.rule_parts(mods.trace_mask_mod(document_mask, _arrays("document_mask")).value)
    assert [(p.op, mods.reads_variable(p, "q_idx"), mods.reads_variable(p, "kv_idx")) for p in rows] == [
        ("load", True, False)]
    assert [(p.op, mods.reads_variable(p, "q_idx"), mods.reads_variable(p, "kv_idx")) for p in keys] == [
        ("load", False, True)]
    rows, keys = mods.rule_parts(mods.trace_mask_mod(window_or_sink).value)
    assert [p.op for p in rows] == ["not"] and not mods.reads_variable(rows[0], "q_idx")  # ~(h != 1): per head
    assert [p.op for p in keys] == ["=="] and mods.reads_variable(keys[0], "kv_idx")  # kv_idx == 0
    cxx, code = mods.mask_rule(mods.trace_mask_mod(document_mask, _arrays("document_mask")))
    combine = code[code.index("combine("):code.index("visible(")]
    assert "arrays[0]" not in combine and "(row.p0 == key.p0)" in combine  # no array read per score


@needs_nvcc
def test_integer_division_and_modulo_are_pythons(tmp_path):
    def floors(score, b, h, q_idx, kv_idx):
        return (q_idx - 5) // (kv_idx - 4) * 100 + (q_idx - 5) % (kv_idx - 4)

    trace = mods.trace_score_mod(floors)
    got = _run_generated(tmp_path, mods.cuda_function("value", trace.value, (), True), {},
                         "value(score, b, h, q_idx, kv_idx, arrays)")
    q, kv = np.meshgrid(np.arange(GRID[2]), np.arange(GRID[3]), indexing="ij")
    divisor = kv - 4
    with np.errstate(divide="ignore"):
        want = np.where(divisor == 0, 0, (q - 5) // np.where(divisor == 0, 1, divisor) * 100
                        + (q - 5) % np.where(divisor == 0, 1, divisor))
    np.testing.assert_array_equal(got[0, 0], want)


def test_derivative_rules():
    score = mods.Expr("var", ("score",), "float")
    assert mods.derivative(score * 3.0 + 1.0).same_as(mods._constant(3.0))
    # where, min/max: the derivative of the branch taken, its condition kept
    trace = mods.trace_score_mod(lambda s, b, h, q, kv: mods.where(q > kv, s * 2.0, mods.maximum(s, 0.0)))
    gradient = "\n".join(mods.cuda_statements(trace.gradient, (), "g"))
    assert "(q_idx > kv_idx)" in gradient and "(score >= 0.0f)" in gradient
    # a function of the score alone may be folded across heads and rows (decoding's GQA packing)
    assert mods.trace_score_mod(lambda s, b, h, q, kv: s * s).reads_position is False
    assert mods.trace_score_mod(alibi, _arrays("alibi")).reads_position is True


def test_trace_keys_name_the_function_and_change_with_it():
    first = mods.trace_key(mods.trace_score_mod(softcap_causal))
    assert first.startswith("softcap_causal_") and first == mods.trace_key(mods.trace_score_mod(softcap_causal))
    assert first != mods.trace_key(mods.trace_score_mod(smooth))
    # the arrays' shapes are part of the code (their strides are constants in it)
    small = mods.trace_key(mods.trace_score_mod(alibi, {"slopes": np.zeros(3, np.float32)}))
    large = mods.trace_key(mods.trace_score_mod(alibi, {"slopes": np.zeros(4, np.float32)}))
    assert small != large


@pytest.mark.parametrize("fn,arrays,error,match", [
    (lambda s, b, h, q, kv: s if q > kv else 0.0, {}, TypeError, "no truth value: .* use cuflash.mods.where"),
    (lambda s, b, h, q, kv: max(s, 0.0), {}, TypeError, "minimum and maximum instead of min and max"),
    (lambda s, b, h, q, kv: q > kv, {}, TypeError, "score_mod must return a number .* is a mask_mod"),
    (lambda s, b, h, q, kv, t: s + t[s], {"t": np.zeros(4, np.float32)}, TypeError, "takes integer indices"),
    (lambda s, b, h, q, kv, t: s + t[q], {"t": np.zeros((4, 4), np.float32)}, IndexError, "has 2 dimensions"),
    (lambda s, b, h, q, kv: s + float("-inf"), {}, ValueError, "must be finite"),
    (lambda s, b, h, q, kv: s + "a", {}, TypeError, "got str"),
    (lambda s, b, h, q, kv: s + 2**40, {}, ValueError, "must fit 32 bits"),
    (lambda s, b, h, q, kv, t: s, {"t": np.zeros(4, np.float64)}, TypeError, "must have one of the dtypes"),
    (lambda s, b, h, q, kv, t: s, {"t": np.zeros((0, 2), np.float32)}, ValueError, "no empty one"),
    (lambda s, b: s, {}, TypeError, r"score_mod must take \(score, b, h, q_idx, kv_idx, \*\*arrays\)"),
    (lambda s, b, h, q, kv: (q % 2.5) + s, {}, TypeError, "takes int values"),
])
def test_what_cannot_be_traced_is_explained(fn, arrays, error, match):
    with pytest.raises(error, match=match):
        mods.trace_score_mod(fn, arrays)


def test_mask_mod_must_return_a_condition():
    with pytest.raises(TypeError, match="mask_mod must return a condition"):
        mods.trace_mask_mod(lambda b, h, q, kv: q - kv)
    with pytest.raises(TypeError, match="compares numbers, or two conditions"):
        mods.trace_mask_mod(lambda b, h, q, kv: (q > kv) < (q > 0))


def test_numpy_evaluation_clamps_indices_like_the_kernels():
    table = np.arange(4.0)
    got = mods.evaluate_score_mod(lambda s, b, h, q, kv, t: s + t[q - 2], np.zeros((1, 1, 8, 1)), {"t": table})
    np.testing.assert_array_equal(got[0, 0, :, 0], [0, 0, 0, 1, 2, 3, 3, 3])


def test_cuda_expressions_make_a_policy_with_typed_array_pointers():
    raw = mods.cuda("score + table[h * 8 + min(max(q_idx - kv_idx, -4), 3) + 4]", gradient="1.0f", name="rel")
    trace = raw.bound({"table": np.zeros((3, 8), np.float16)})
    cxx, code = mods.score_policy(trace)
    assert cxx.startswith("cuflash::UserScore_rel_") and "const __half* const table" in code
    assert mods.trace_key(trace) != mods.trace_key(mods.cuda("score", "1.0f", "rel").bound({}))
    assert trace.reads_position  # never folded across heads or rows
    with pytest.raises(TypeError, match="non-empty CUDA-C expression"):
        mods.cuda("")


@needs_nvcc
def test_user_policies_compile_into_the_kernels(tmp_path):
    """A traced function's and a CUDA-C one's policies, built into the
    Hopper forward and backward and the SIMT backward as NVRTC would build
    them (tools/kernel_report.py's ptxas run, no GPU)."""
    import sys

    sys.path.insert(0, str(kernel_source_dir().parent / "tools"))
    import kernel_report
    from cuflash._kernel_families import FAMILY
    from cuflash._masks import MASKS, register_score_transform, with_dropout

    traced = register_score_transform(mods.trace_score_mod(alibi, _arrays("alibi")))
    raw = register_score_transform(mods.cuda("score - slopes[h] * abs(q_idx - kv_idx)", "1.0f", "raw_alibi")
                                   .bound(_arrays("alibi")))
    variants = []
    for family, dtype, arch in (("forward-wgmma", "bfloat16", "sm_90a"), ("backward-dkdv-wgmma", "bfloat16", "sm_90a"),
                                ("backward-dkdv", "float32", "sm_80")):
        tiling = FAMILY[family].tiles_on(dtype, 64, 90 if arch == "sm_90a" else 80)
        for score in (traced, raw, with_dropout(raw)):
            variants.append((FAMILY[family].variant(dtype, tiling, MASKS["causal"], score), arch))
    for variant, arch in variants:
        (row,) = kernel_report.compile_report([variant], arch)
        assert row["registers"] > 0, row


def test_float_positions_are_used_only_where_exact():
    q, k = (mods.Expr("var", (name,), "int") for name in ("q_idx", "kv_idx"))
    assert mods._float_bound(abs(q - k) + 5) == 2 * mods.FLOAT_POSITION_LIMIT + 5
    assert mods._float_bound(mods.minimum(q, k) - 1) is not None
    assert mods._float_bound(q * 3) is None  # products could leave float's exact range
    assert mods._float_bound(q + k + q + k) is None  # four positions reach 2**24
    assert mods._float_bound(q // 7) is None


def test_score_policies_hoist_per_head_parts_and_fold_the_scale():
    trace = mods.trace_score_mod(alibi, _arrays("alibi"))
    cxx, code = mods.score_policy(trace)
    assert cxx.endswith("<{precise}>")
    transform = code[code.index("float transform(float raw, int q_idx, int kv_idx, float q_idx_f"):]
    transform = transform[:transform.index("}")]
    assert "fabsf((q_idx_f - kv_idx_f))" in transform and "arrays[" not in transform  # slope read once per head
    assert "return raw - result;" in transform  # the scale folded into the hoisted slope
    assert "u1 = (u0 * inverse_scale);" in code
    _, wide = mods.score_policy(trace, float_positions=False)
    assert "q_idx_f - kv_idx_f" not in wide and "(q_idx - kv_idx)" in wide  # integers, converted per score
    capped = mods.score_policy(mods.trace_score_mod(softcap_causal))[1]
    assert "mod_tanh<kPrecise>" in capped and "(kPrecise ? " in capped  # fast tanh, reciprocal for 16-bit inputs
    assert "mod_exp<kPrecise>" in mods.score_policy(mods.trace_score_mod(smooth))[1]
