#!/usr/bin/env bash
# One-shot GPU check: runs the whole test suite (GPU tests included), the
# Nsight Compute validation of the IO simulator and the forward benchmark on a
# machine with a CUDA GPU, writes logs and JSON under $OUT, and prints a short
# table last. Fails if any test failed, errored or was skipped:
# on a GPU machine nothing may skip.
#
#   OUT=/tmp/out CUFLASH_COMMIT=$(git rev-parse HEAD) bash tools/gpu_check.sh [extra pytest args]
#
# Within the device tool's 600 s a call (16 workers, H100), the whole run
# no longer fits: compiling every kernel variant with nvcc
# (test_every_variant_compiles_and_is_reported) takes 7-9 minutes of it.
# Run it as two calls: this script with -k "not test_every_variant_compiles",
# then pytest -n 16 tests/test_kernel_report.py. The bench of record (bf16
# and fp16, forward and backward, as the user sees it, host tables) takes a
# call of its own: CUFLASH_SKIP_TESTS=1 CUFLASH_SKIP_SANITIZER=1 CUFLASH_SKIP_NCU=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash-cupy-cache}
PYTHON=${PYTHON:-python3}
COMMIT=${CUFLASH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

{
  echo "commit: $COMMIT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PYTHON" - <<'PY'
import importlib
for name in ("cupy", "numpy", "torch", "jax", "pytest"):
    try:
        print(f"{name}: {importlib.import_module(name).__version__}")
    except Exception as exc:  # report, the tests will fail on it
        print(f"{name}: not importable ({exc})")
import cupy
print("nvrtc:", cupy.cuda.nvrtc.getVersion(), "device:", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PY
} 2>&1 | tee "$OUT/environment.txt"

# Tests in CUFLASH_PYTEST_WORKERS processes (pytest-xdist; default 4 where it
# is installed, 1 = serial): compiling the kernel variants dominates a cold run.
workers=${CUFLASH_PYTEST_WORKERS:-4}
parallel=()
if [ "$workers" -gt 1 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers")
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several JAX processes share the GPU
fi
start=$(date +%s)
tests_run=1
if [ "${CUFLASH_SKIP_TESTS:-0}" = "1" ]; then
  # A call of its own for the bench of record (tests, sanitizers and the bench
  # together outrun the device tool's 600 s): the summary says the tests did
  # not run, and the result rests on the other checks.
  tests_run=0
  pytest_rc=0
elif [ ${#parallel[@]} -gt 0 ]; then
  # Tests that need the GPU to themselves (marker "exclusive": most of its
  # memory, or timings) run after the parallel pass, one at a time.
  "$PYTHON" -m pytest tests -p no:cacheprovider -q -rfEs --durations=15 "${parallel[@]}" -m "not exclusive" \
    --junitxml="$OUT/tests.xml" "$@" 2>&1 | tee "$OUT/tests.log"
  pytest_rc=${PIPESTATUS[0]}
  "$PYTHON" -m pytest tests -p no:cacheprovider -q -rfEs -m exclusive --junitxml="$OUT/tests_exclusive.xml" "$@" \
    2>&1 | tee -a "$OUT/tests.log"
  exclusive_rc=${PIPESTATUS[0]}
  [ "$exclusive_rc" -eq 5 ] && exclusive_rc=0  # none selected (a subset run)
  [ "$pytest_rc" -eq 0 ] && pytest_rc=$exclusive_rc
else
  "$PYTHON" -m pytest tests -p no:cacheprovider -q -rfEs --durations=15 \
    --junitxml="$OUT/tests.xml" "$@" 2>&1 | tee "$OUT/tests.log"
  pytest_rc=${PIPESTATUS[0]}
fi
elapsed=$(( $(date +%s) - start ))

# IO simulator against Nsight Compute (issue: cuflash simulate is checked
# against hardware counters). Skipped with CUFLASH_SKIP_NCU=1.
ncu_rc=0
if [ "${CUFLASH_SKIP_NCU:-0}" != "1" ]; then
  "$PYTHON" tools/ncu_validate.py --out "$OUT" > "$OUT/ncu_validation.log" 2>&1
  ncu_rc=$?
  tail -n 12 "$OUT/ncu_validation.log"
fi

# compute-sanitizer on the warp-specialised Hopper kernels (tools/sanitize.py):
# memcheck, racecheck and synccheck must report nothing. Skipped with
# CUFLASH_SKIP_SANITIZER=1 or off Hopper.
sanitizer_rc=0
if [ "${CUFLASH_SKIP_SANITIZER:-0}" != "1" ] && command -v compute-sanitizer > /dev/null \
   && nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q "^9\.0"; then
  for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 1 "$PYTHON" tools/sanitize.py \
      > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    echo "compute-sanitizer $tool: rc $rc, $(grep "SUMMARY" "$OUT/sanitizer_$tool.log" | tail -n 1)"
    [ $rc -ne 0 ] && sanitizer_rc=$rc && tail -n 30 "$OUT/sanitizer_$tool.log"
  done
fi

# Forward and backward (bf16, fp16; backward default and deterministic) speed against PyTorch SDPA (flash,
# cuDNN) on the FlashAttention-2 grid: table in bench.log (bf16 rows echoed, then the ratios to cuDNN against
# issue 17's bars per dtype), rows in bench.json. Skipped with CUFLASH_SKIP_BENCH=1.
bench_rc=0
if [ "${CUFLASH_SKIP_BENCH:-0}" != "1" ]; then
  # CUFLASH_BENCH_ARGS replaces the default run's arguments (e.g. --variants-only).
  CUFLASH_COMMIT="$COMMIT" "$PYTHON" tools/bench.py ${CUFLASH_BENCH_ARGS:---deterministic} --out "$OUT" \
    > "$OUT/bench.log" 2>&1
  bench_rc=$?
  grep -v "^#" "$OUT/bench.log" | grep -v "| float16 |" | tail -n 80
fi

"$PYTHON" - "$OUT" "$COMMIT" "$pytest_rc" "$elapsed" "$ncu_rc" "$bench_rc" "$sanitizer_rc" "$tests_run" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
out, commit, rc, elapsed, ncu_rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
bench_rc, sanitizer_rc, tests_run = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8] == "1"
counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
roots = [ET.parse(f"{out}/{name}").getroot() for name in ("tests.xml", "tests_exclusive.xml")
         if tests_run and os.path.exists(f"{out}/{name}")]
for root in roots:
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
# Tests that need more GPUs than this machine has, or a Hopper GPU on another
# kind, may skip; nothing else may.
ALLOWED_SKIPS = ("needs 2 GPUs", "needs an sm_90 GPU")
allowed_skips = [case.get("name") for root in roots for case in root.iter("testcase")
                 for skipped in case.findall("skipped")
                 if any(reason in (skipped.get("message") or "") for reason in ALLOWED_SKIPS)]
counts["skipped"] -= len(allowed_skips)
env = open(f"{out}/environment.txt").read().splitlines()
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"] - len(allowed_skips)
ok = (rc == 0 and ncu_rc == 0 and bench_rc == 0 and sanitizer_rc == 0 and counts["failures"] == 0 and counts["errors"] == 0
      and counts["skipped"] == 0
      and (counts["tests"] > 0 if tests_run else os.path.exists(f"{out}/bench.json")))  # something ran
summary = {"commit": commit, "ok": ok, "tests_run": tests_run, "passed": passed, "failed": counts["failures"],
           "errors": counts["errors"], "skipped": counts["skipped"],
           "skipped_for_lack_of_gpus": allowed_skips,
           "seconds": elapsed, "ncu_validation_rc": ncu_rc, "bench_rc": bench_rc, "sanitizer_rc": sanitizer_rc,
           "environment": env}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
print()
print("| gpu_check | value |")
print("|---|---|")
for line in env[:2]:
    print(f"| env | {line} |")
if not tests_run:
    print("| tests | not run (CUFLASH_SKIP_TESTS=1) |")
for key in ("passed", "failed", "errors", "skipped", "seconds", "ncu_validation_rc", "bench_rc", "sanitizer_rc"):
    print(f"| {key} | {summary[key]} |")
try:
    rows = json.load(open(f"{out}/bench.json"))["rows"]
    for pass_name in ("fwd", "bwd", "fwd+bwd"):
        for dtype in ("bfloat16", "float16"):
            chosen = [r for r in rows if r["dtype"] == dtype and r["pass"] == pass_name]
            ratios = [r["cuflash_over_flash"] for r in chosen if "cuflash_over_flash" in r]
            cudnn = [r["cuflash_over_cudnn"] for r in chosen if "cuflash_over_cudnn" in r]
            if ratios:
                print(f"| bench {dtype} {pass_name} cuflash/flash | min {min(ratios):.2f}, max {max(ratios):.2f}, "
                      f">= 1.0 at {sum(x >= 1.0 for x in ratios)}/{len(ratios)}; "
                      f"cuflash/cuDNN {min(cudnn):.2f}-{max(cudnn):.2f} |")
except FileNotFoundError:
    print("| bench | not run |")
try:
    bench = json.load(open(f"{out}/bench.json"))
    for pass_name in ("fwd", "fwd+bwd"):
        for seqlen in sorted({r["seqlen"] for r in bench["rows"]}):
            user = [r["user_cuflash_over_flash"] for r in bench["rows"] if r["pass"] == pass_name
                    and r["dtype"] == "bfloat16" and r["seqlen"] == seqlen and "user_cuflash_over_flash" in r]
            if user:
                print(f"| as the user sees it, bf16 {pass_name} seqlen {seqlen}: cuflash/flash | "
                      f"{min(user):.2f}-{max(user):.2f} |")
    for row in bench.get("host_overhead", []):
        print(f"| host µs, {row['what']}: {row['call']} | {row['host_us']:.1f} |")
    for row in bench.get("jax_jit", []):
        p = row["point"]
        value = f"{row['us']:.1f}" if "us" in row else row["error"]
        print(f"| jax.jit µs, {row['call']} {row.get('pass', '')} at seqlen {p['seqlen']}, d {p['head_dim']} | "
              f"{value} |")
    variants = bench.get("variants", [])
    for row in variants:
        if row["variant"] == "window" and row["seqlen"] == max(r["seqlen"] for r in variants):
            print(f"| window {row['window']} vs causal at {row['seqlen']}, {row['pass']} | {row['speedup']:.2f}x |")
    costs = [row["cost"] for row in variants if "cost" in row and row["variant"] != "dropout"]
    if costs:
        print(f"| softcap / ALiBi cost over plain | max {max(costs):.3f}, <= 1.15 at "
              f"{sum(c <= 1.15 for c in costs)}/{len(costs)} |")
    dropout = [row["cost"] for row in variants if row["variant"] == "dropout"]
    if dropout:
        print(f"| dropout cost over plain | {min(dropout):.2f}-{max(dropout):.2f} |")
except (FileNotFoundError, KeyError):
    pass
print(f"| skipped (needs 2 GPUs, or Hopper) | {len(allowed_skips)} |")
try:
    for name, row in json.load(open(f"{out}/e2e_losses.json")).items():
        print(f"| e2e {name} | loss {row['reference'][0]:.3f} -> {row['reference'][-1]:.3f} (reference), "
              f"{row['cuflash'][-1]:.3f} (cuflash); max gap {row['max_gap_of_initial']:.4f} of initial "
              f"(tolerance {row['tolerance']}) |")
except FileNotFoundError:
    print("| e2e | not run |")
print(f"| result | {'PASS' if ok else 'FAIL'} |")
sys.exit(0 if ok else 1)
PY
