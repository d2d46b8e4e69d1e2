#!/usr/bin/env python3
"""Validate ``cuflash simulate --algorithm cuflash`` against Nsight Compute.

Profiles cuflash's own kernels (forward; backward = preprocess + dK/dV +
dQ conversion) on the GPU for several shapes with
``ncu --clock-control none`` and sets the measured traffic beside the
simulator's prediction:

* requested: global-memory sectors the kernels' loads, asynchronous copies
  (cp.async), stores and reductions asked of L1
  (``l1tex__t_sectors_pipe_lsu_mem_global_op_{ld,ldgsts,st,red}``) and of
  L2 (``lts__t_sectors_srcunit_tex_op_{read,write,red}``), 32 bytes each,
  against the simulator's exact requested bytes (copy-engine loads bypass
  L1: the L1 column then holds what the kernels still load through it);
* DRAM reads and writes apart (``dram__bytes_{read,write}``) against the
  simulator's L2-model estimate of each. Writes also count the write-back:
  a pass's dirty lines still in L2 when its last kernel ends reach DRAM
  later, so after each pass a drain kernel (``flush_l2_by_reading``, a read
  of four times the L2) evicts them and its DRAM writes are the pass's
  write-back. For that the caches are not flushed between kernels
  (``--cache-control none``; the drain before each pass leaves L2 holding
  only clean lines of its own buffer) and every metric pass replays the
  whole workload (``--replay-mode application``), not the kernel alone.

Two of the shapes keep K and V (and Q) far beyond the 50 MB L2, where the
simulator's L2 model matters (marked "> L2").

Usage (on a GPU machine with ncu):  python3 tools/ncu_validate.py [--out DIR]
Writes ``ncu_validation.json`` and ``ncu_validation.md`` under DIR ($OUT or .).
``--render FILE.json`` prints the table of a stored run (docs/io-validation.md
holds the rendering of docs/ncu_validation_h100.json; a CPU test keeps them
equal).
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

#: (batch, nheads, nheads_k, seqlen, head_dim, causal); bf16. The last two
#: are far beyond the H100's 50 MB L2 (K and V 512 MB and 1 GB; Q too).
SHAPES = [
    (1, 8, 8, 2048, 64, False),
    (1, 8, 8, 4096, 128, True),
    (2, 16, 4, 2048, 128, False),
    (4, 16, 16, 1024, 64, True),
    (4, 32, 8, 32768, 128, False),
    (1, 32, 32, 65536, 128, True),
]
#: The drain kernel's buffer: four times the largest L2 of the presets, so
#: that reading it evicts every line a pass left.
DRAIN_BYTES = 256 << 20
DRAIN_KERNEL = "flush_l2_by_reading"

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

_DRAIN_SOURCE = r"""
extern "C" __global__ void flush_l2_by_reading(const int4* data, long long count, int* sink) {
    int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        const int4 x = __ldcg(data + i);
        acc ^= x.x ^ x.y ^ x.z ^ x.w;
    }
    if (acc == 0x7fffffff) {  // never in practice: keeps the loads, writes nothing
        atomicAdd(sink, acc);
    }
}
"""


def workload() -> None:
    """Per shape: drain, forward, drain, backward, drain (the process ncu
    profiles; the inputs are made before the first drain)."""
    import cupy

    import cuflash

    drain_kernel = cupy.RawKernel(_DRAIN_SOURCE, DRAIN_KERNEL)
    drain_buffer = cupy.ones(DRAIN_BYTES // 4, dtype=cupy.int32)
    sink = cupy.zeros(1, dtype=cupy.int32)

    def drain() -> None:
        drain_kernel((1024,), (256,), (drain_buffer, cupy.int64(DRAIN_BYTES // 16), sink))

    for batch, nheads, nheads_k, seqlen, head_dim, causal in SHAPES:
        rng = cupy.random.default_rng(0)
        bf16 = cupy.dtype("bfloat16")
        q = rng.standard_normal((batch, seqlen, nheads, head_dim), dtype=cupy.float32).astype(bf16)
        k, v = (rng.standard_normal((batch, seqlen, nheads_k, head_dim), dtype=cupy.float32).astype(bf16)
                for _ in range(2))
        dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(bf16)
        drain()
        out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        drain()
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
        drain()
        cupy.cuda.Device().synchronize()
        del q, k, v, dout, out, lse
        cupy.get_default_memory_pool().free_all_blocks()


def predictions(machine_name: str) -> list[dict]:
    from cuflash.simulate import MACHINES, Problem, run

    machine = MACHINES[machine_name]
    rows = []
    for batch, nheads, nheads_k, seqlen, head_dim, causal in SHAPES:
        problem = Problem(batch=batch, nheads=nheads, nheads_k=nheads_k, seqlen_q=seqlen, head_dim=head_dim,
                          element_size=2, causal=causal)
        kv_bytes = 2 * batch * seqlen * nheads_k * head_dim * 2
        for passes in ("fwd", "bwd"):
            traffic = run("cuflash", problem, machine, passes)
            rows.append({"shape": f"b{batch} h{nheads}/{nheads_k} n{seqlen} d{head_dim}{' causal' if causal else ''}",
                         "pass": passes, "beyond_l2": kv_bytes > machine.l2_bytes,
                         "predicted_requested": traffic.total("requested"),
                         "predicted_dram": traffic.total("dram"),
                         "predicted_dram_read": traffic.total("dram", "read"),
                         "predicted_dram_write": traffic.total("dram", "write")})
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
    command = [ncu, "--clock-control", "none", "--cache-control", "none", "--replay-mode", "application",
               "--target-processes", "all", "--kernel-name", f"regex:flash_|{DRAIN_KERNEL}",
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
    """The predictions beside the profiled kernels, which come per shape as
    drain, forward, drain, the backward's kernels, drain: each pass's DRAM
    writes during its kernels and, as its write-back, the next drain's."""
    rows, position = [], 0

    def take(count: int, drain: bool) -> list[dict]:
        nonlocal position
        group = kernels[position: position + count]
        position += count
        if len(group) != count or any((k["kernel"].endswith(DRAIN_KERNEL)) != drain for k in group):
            raise SystemExit(f"unexpected kernels at {position - count}: {[k['kernel'] for k in group]}")
        return group

    for row in predicted:
        if row["pass"] == "fwd":
            take(1, drain=True)  # the drain before the shape's forward: the inputs' write-back
        group = take(KERNELS_PER_SHAPE[row["pass"]], drain=False)
        (after,) = take(1, drain=True)
        l1 = 32 * sum(sum(v for name, v in k.items() if name.startswith("l1_")) for k in group)
        l2 = 32 * sum(k["l2_read"] + k["l2_write"] + k["l2_red"] for k in group)
        dram_read = sum(k["dram_read"] for k in group)
        dram_write = sum(k["dram_write"] for k in group)
        write_back = after["dram_write"]
        written = dram_write + write_back
        rows.append({**row, "kernels": [k["kernel"] for k in group], "measured_l1_requested": l1,
                     "measured_l2_requested": l2, "measured_dram_read": dram_read,
                     "measured_dram_write": dram_write, "measured_write_back": write_back,
                     "measured_dram": dram_read + written,
                     "l2_over_predicted": l2 / row["predicted_requested"],
                     "l1_over_predicted": l1 / row["predicted_requested"],
                     "dram_read_over_predicted": _ratio(dram_read, row["predicted_dram_read"]),
                     "dram_write_over_predicted": _ratio(written, row["predicted_dram_write"]),
                     "dram_over_predicted": _ratio(dram_read + written, row["predicted_dram"])})
    if position != len(kernels):
        raise SystemExit(f"expected {position} profiled kernels, got {len(kernels)}")
    return rows


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted else None


def markdown(result: dict) -> str:
    """The table of a run (``ncu_validation.json``'s contents)."""
    lines = [f"Device: {result['device']}. Bytes in MB (10^6). Requested = sectors x 32 B. DRAM writes: during "
             "the pass's kernels + the write-back its drain found.", "",
             "| shape | pass | predicted requested | L1 requested | L2 requested | L2 / predicted | "
             "predicted DRAM read | measured read | read / predicted | predicted DRAM write | "
             "measured write + write-back | write / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mb(x: float) -> str:
        return f"{x / 1e6:.1f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in result["rows"]:
        shape = r["shape"] + (" (> L2)" if r["beyond_l2"] else "")
        lines.append(f"| {shape} | {r['pass']} | {mb(r['predicted_requested'])} | {mb(r['measured_l1_requested'])} | "
                     f"{mb(r['measured_l2_requested'])} | {r['l2_over_predicted']:.3f} | "
                     f"{mb(r['predicted_dram_read'])} | {mb(r['measured_dram_read'])} | "
                     f"{ratio(r['dram_read_over_predicted'])} | {mb(r['predicted_dram_write'])} | "
                     f"{mb(r['measured_dram_write'])} + {mb(r['measured_write_back'])} | "
                     f"{ratio(r['dram_write_over_predicted'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--machine", default="h100", help="simulator preset (h100 or h200)")
    parser.add_argument("--render", metavar="JSON", help="print the table of a stored run and exit")
    args = parser.parse_args()
    if args.workload:
        workload()
        return
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())))
        return
    import cupy

    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"device": device, "commit": os.environ.get("CUFLASH_COMMIT", ""),
              "rows": compare(predictions(args.machine), profile(out_dir))}
    (out_dir / "ncu_validation.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out_dir / "ncu_validation.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
