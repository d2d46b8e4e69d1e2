#!/usr/bin/env python3
"""Validate ``cuflash simulate --algorithm cuflash`` against Nsight Compute.

Profiles cuflash's own kernels (forward; backward = preprocess + dK/dV +
dQ conversion) on the GPU for several shapes with
``ncu --clock-control none`` and sets the measured traffic beside the
simulator's prediction:

* requested: global-memory sectors the kernels' loads, asynchronous copies
  (cp.async, the tensor-core forward's loads), stores and reductions asked of
  L1 (``l1tex__t_sectors_pipe_lsu_mem_global_op_{ld,ldgsts,st,red}``) and of
  L2 (``lts__t_sectors_srcunit_tex_op_{read,write,red}``), 32 bytes each,
  against the simulator's exact requested bytes;
* DRAM: ``dram__bytes_{read,write}`` against the simulator's L2-model estimate.

Usage (on a GPU machine with ncu):  python3 tools/ncu_validate.py [--out DIR]
Writes ``ncu_validation.json`` and ``ncu_validation.md`` under DIR ($OUT or .).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: (batch, nheads, nheads_k, seqlen, head_dim, causal); bf16.
SHAPES = [
    (1, 8, 8, 2048, 64, False),
    (1, 8, 8, 4096, 128, True),
    (2, 16, 4, 2048, 128, False),
    (4, 16, 16, 1024, 64, True),
]

METRICS = {
    "l1_ld": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1_st": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "l1_red": "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum",
    "l2_read": "lts__t_sectors_srcunit_tex_op_read.sum",
    "l2_write": "lts__t_sectors_srcunit_tex_op_write.sum",
    "l2_red": "lts__t_sectors_srcunit_tex_op_red.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
}
KERNELS_PER_SHAPE = {"fwd": 1, "bwd": 3}  # forward; preprocess, dK/dV, convert


def workload() -> None:
    """Runs forward and backward once per shape (the process ncu profiles)."""
    import cupy

    import cuflash

    for batch, nheads, nheads_k, seqlen, head_dim, causal in SHAPES:
        rng = cupy.random.default_rng(0)
        bf16 = cupy.dtype("bfloat16")
        q = rng.standard_normal((batch, seqlen, nheads, head_dim), dtype=cupy.float32).astype(bf16)
        k, v = (rng.standard_normal((batch, seqlen, nheads_k, head_dim), dtype=cupy.float32).astype(bf16)
                for _ in range(2))
        dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(bf16)
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        cupy.cuda.Device().synchronize()


def predictions(machine_name: str) -> list[dict]:
    from cuflash.simulate import MACHINES, Problem, run

    machine = MACHINES[machine_name]
    rows = []
    for batch, nheads, nheads_k, seqlen, head_dim, causal in SHAPES:
        problem = Problem(batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen, head_dim=head_dim,
                          element_size=2, causal=causal)
        for passes in ("fwd", "bwd"):
            traffic = run("cuflash", problem, machine, passes)
            rows.append({"shape": f"b{batch} h{nheads}/{nheads_k} n{seqlen} d{head_dim}{' causal' if causal else ''}",
                         "pass": passes, "predicted_requested": traffic.total("requested"),
                         "predicted_dram": traffic.total("dram")})
    return rows


#: Sectors of cp.async (LDGSTS) global loads, the tensor-core forward's only
#: loads; ncu names them per cache policy, and versions differ in which exist.
LDGSTS_METRICS = ("l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts",
                  "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts_cache_access",
                  "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts_cache_bypass")


def _available_ldgsts_metrics(ncu: str) -> dict[str, str]:
    """The total if ncu has it, else the per-policy parts it has."""
    listed = set(subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout.split())
    names = [LDGSTS_METRICS[0]] if LDGSTS_METRICS[0] in listed else [n for n in LDGSTS_METRICS[1:] if n in listed]
    return {f"l1_ldgsts_{i}": f"{name}.sum" for i, name in enumerate(names)}


def profile(out_dir: Path) -> list[dict]:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    metrics = {**METRICS, **_available_ldgsts_metrics(ncu)}
    log = Path(tempfile.mkdtemp()) / "ncu_raw.csv"
    command = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", "regex:flash_",
               "--metrics", ",".join(metrics.values()), "--csv", "--page", "raw", "--log-file", str(log),
               sys.executable, __file__, "--workload"]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    text = log.read_text()
    table = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
    header, rows = table[0], [r for r in table[2:] if r and r[0].isdigit()]  # skip the units row
    column = {name: header.index(metric) for name, metric in metrics.items()}
    name_column = header.index("Kernel Name")
    kernels = []
    for row in rows:
        values = {name: float(row[index].replace(",", "")) for name, index in column.items()}
        kernels.append({"kernel": row[name_column].split("<")[0].split("(")[0], **values})
    return kernels


def compare(predicted: list[dict], kernels: list[dict]) -> list[dict]:
    rows, position = [], 0
    for row in predicted:
        count = KERNELS_PER_SHAPE[row["pass"]]
        group = kernels[position: position + count]
        position += count
        l1 = 32 * sum(sum(v for name, v in k.items() if name.startswith("l1_")) for k in group)
        l2 = 32 * sum(k["l2_read"] + k["l2_write"] + k["l2_red"] for k in group)
        dram = sum(k["dram_read"] + k["dram_write"] for k in group)
        rows.append({**row, "kernels": [k["kernel"] for k in group], "measured_l1_requested": l1,
                     "measured_l2_requested": l2, "measured_dram": dram,
                     "l2_over_predicted": l2 / row["predicted_requested"],
                     "l1_over_predicted": l1 / row["predicted_requested"],
                     "dram_over_predicted": dram / row["predicted_dram"] if row["predicted_dram"] else None})
    if position != len(kernels):
        raise SystemExit(f"expected {position} profiled kernels, got {len(kernels)}")
    return rows


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"Device: {device}. Bytes in MB (10^6). Requested = sectors x 32 B.", "",
             "| shape | pass | predicted requested | L1 requested | L2 requested | L2 / predicted | "
             "predicted DRAM | measured DRAM | DRAM / predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['pass']} | {r['predicted_requested'] / 1e6:.1f} | "
                     f"{r['measured_l1_requested'] / 1e6:.1f} | {r['measured_l2_requested'] / 1e6:.1f} | "
                     f"{r['l2_over_predicted']:.3f} | {r['predicted_dram'] / 1e6:.1f} | "
                     f"{r['measured_dram'] / 1e6:.1f} | {r['dram_over_predicted']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--machine", default="h100", help="simulator preset (h100 or h200)")
    args = parser.parse_args()
    if args.workload:
        workload()
        return
    import cupy

    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = compare(predictions(args.machine), profile(out_dir))
    (out_dir / "ncu_validation.json").write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    table = markdown(rows, device)
    (out_dir / "ncu_validation.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
