# Sourced by the tools/ncu_*.sh profiles: runs from the checkout, reports under $OUT (a new temporary
# folder where unset), cuflash importable from the checkout, its kernel cache shared across runs, $NCU the
# Nsight Compute command line, export_report the pages of a report they take.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash-cupy-cache}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)

# export_report REPORT DETAILS NAME [DETAILS_OPTIONS...]: REPORT.ncu-rep (taken with --section SourceCounters and
# --import-source no) as its details page in DETAILS, its source page by SASS line in $OUT/ncu_source_NAME.csv
# and tools/sass_profile.py's summary of that in $OUT/ncu_sass_NAME.md; the report itself is removed (what the
# pages hold is exported, and the device returns 8 files at most).
export_report() {
  local report=$1 details=$2 name=$3
  shift 3
  "$NCU" -i "$report.ncu-rep" --page details "$@" > "$details" 2>&1
  "$NCU" -i "$report.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source_$name.csv" 2>&1
  python3 tools/sass_profile.py "$OUT/ncu_source_$name.csv" --floor 0.02 --top 12 > "$OUT/ncu_sass_$name.md" 2>&1
  rm -f "$report.ncu-rep"
}
