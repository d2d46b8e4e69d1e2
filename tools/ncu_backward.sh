#!/usr/bin/env bash
# Nsight Compute profile of the tensor-core dK/dV kernel (flash_backward_dkdv_*) on the
# head-dim sweep's shape (bf16, seqlen 4096, 16k tokens, hidden 2048), one head dim per argument:
# the speed-of-light, memory, compute and warp-state sections, then the L2 throughput broken down
# by unit and the L2 sectors by operation (reads, writes, reductions); the source page by SASS line
# (ncu_source_<head_dim>.csv) with tools/sass_profile.py's summary (ncu_sass_<head_dim>.md). Reports land
# in $OUT, four files a head dim (the device returns 8 at most: two head dims a call).
#
#   OUT=/tmp/out bash tools/ncu_backward.sh 256 192 128     (CAUSAL=1 for the causal mask)
source "$(dirname "$0")/ncu_setup.sh"
causal=${CAUSAL:-0}
# The workload lives in a file: Nsight Compute does not pass exported shell functions to its child.
workload=$(mktemp -d)/ncu_backward_workload.py  # outside $OUT: the device returns 8 files at most
cat > "$workload" <<'PY'
import sys
import torch
import cuflash
head_dim, causal, repetitions = int(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
seqlen = 4096
q, k, v, dout = (torch.randn(16384 // seqlen, seqlen, 2048 // head_dim, head_dim, device="cuda",
                             dtype=torch.bfloat16) for _ in range(4))
out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
for _ in range(repetitions):
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
torch.cuda.synchronize()
PY
metrics=breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed
metrics+=,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_red.sum
metrics+=,lts__t_sectors_op_atom.sum,gpu__time_duration.sum
metrics+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
for head_dim in "$@"; do
  python3 "$workload" "$head_dim" "$causal" 1 > /dev/null  # compiles outside the profile
  common=(--clock-control none --target-processes all --kernel-name regex:flash_backward_dkdv --launch-skip 1 --launch-count 1)
  "$NCU" "${common[@]}" --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy --section SourceCounters --import-source no \
    -o "$OUT/ncu_bwd_$head_dim" python3 "$workload" "$head_dim" "$causal" 2 > /dev/null 2>&1
  export_report "$OUT/ncu_bwd_$head_dim" "$OUT/ncu_sections_$head_dim.txt" "$head_dim"
  "$NCU" "${common[@]}" --metrics "$metrics" python3 "$workload" "$head_dim" "$causal" 2 > "$OUT/ncu_l2_$head_dim.txt" 2>&1
  echo "== head_dim $head_dim (causal=$causal)"
  grep -E "Duration|Throughput|Registers Per|Eligible Warps" "$OUT/ncu_sections_$head_dim.txt"
  grep -E "^\s+(lts|gpu|sm__|l1tex)" "$OUT/ncu_l2_$head_dim.txt"
done
