#!/usr/bin/env bash
# Nsight Compute profile of the forward against cuDNN's (PyTorch SDPA's cuDNN backend) at one point of the
# FlashAttention-2 grid (bf16, 16k tokens, hidden 2048): per kernel its duration, DRAM bytes and throughput,
# L2 hit rate and reads, instructions, launch shape, then the warp-state and source-counter sections (stall
# reasons), and the source page by SASS line (ncu_source_<impl>.csv) with tools/sass_profile.py's summary of
# it (ncu_sass_<impl>.md). Reports land in $OUT; the summary table of docs/perf-notes.md's d128 causal 512
# comparison came from this run, its "by SASS line" table from the source page.
#
#   OUT=/tmp/out bash tools/ncu_forward.sh 512 128 1      (seqlen, head_dim, causal)
source "$(dirname "$0")/ncu_setup.sh"
seqlen=${1:-512} head_dim=${2:-128} causal=${3:-1}
# The workload lives in a file: Nsight Compute does not pass exported shell functions to its child.
workload=$(mktemp -d)/ncu_forward_workload.py  # outside $OUT: the device returns 8 files at most
cat > "$workload" <<'PY'
import sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa
import cuflash
impl, seqlen, head_dim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
causal, repetitions = sys.argv[4] == "1", int(sys.argv[5])
q, k, v = (torch.randn(16384 // seqlen, seqlen, 2048 // head_dim, head_dim, device="cuda", dtype=torch.bfloat16)
           for _ in range(3))
q_t, k_t, v_t = (x.transpose(1, 2).contiguous() for x in (q, k, v))
with torch.no_grad():
    for _ in range(repetitions):
        if impl == "cuflash":
            cuflash.attention(q, k, v, causal=causal)
        else:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                sdpa(q_t, k_t, v_t, is_causal=causal)
torch.cuda.synchronize()
PY
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
metrics+=,lts__t_sectors_srcunit_tex_op_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum
metrics+=,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic
declare -A kernels=([cuflash]="flash_forward" [cudnn]="sdpa|fprop|fmha|flash")
for impl in cuflash cudnn; do
  python3 "$workload" "$impl" "$seqlen" "$head_dim" "$causal" 1 > /dev/null  # compiles outside the profile
  common=(--clock-control none --target-processes all --kernel-name "regex:${kernels[$impl]}" --launch-skip 1
          --launch-count 1)
  "$NCU" "${common[@]}" --metrics "$metrics" python3 "$workload" "$impl" "$seqlen" "$head_dim" "$causal" 2 \
    > "$OUT/ncu_metrics_$impl.txt" 2>&1
  "$NCU" "${common[@]}" --section WarpStateStats --section SourceCounters --section SchedulerStats \
    --import-source no -o "$OUT/ncu_$impl" python3 "$workload" "$impl" "$seqlen" "$head_dim" "$causal" 2 \
    > /dev/null 2>&1
  export_report "$OUT/ncu_$impl" "$OUT/ncu_stalls_$impl.txt" "$impl" --print-details all
  echo "== $impl (seqlen $seqlen, head_dim $head_dim, causal=$causal)"
  grep -E "\(1?[0-9]+, 1, 1\)x\(|^\s+(gpu__|dram__|lts__|sm__|smsp__|launch__)" "$OUT/ncu_metrics_$impl.txt"
  grep -E "Warp Cycles Per Issued|Stall (Wait|Barrier|Long Scoreboard)" "$OUT/ncu_stalls_$impl.txt"
done
