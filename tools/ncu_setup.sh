# Sourced by the tools/ncu_*.sh profiles: runs from the checkout, reports under $OUT (a new temporary
# folder where unset), cuflash importable from the checkout, its kernel cache shared across runs, $NCU the
# Nsight Compute command line.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash-cupy-cache}
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
