"""Summaries of simulated traffic: dictionaries, tables, CSV, explanations."""

from __future__ import annotations

import csv
import io

from .algorithms import roofline_seconds
from .machines import Machine
from .traffic import Traffic


def summarize(t: Traffic, machine: Machine, time_model: dict | None = None) -> dict:
    """Everything the report shows, as plain numbers (bytes, FLOPs, seconds);
    ``time_model``: ``timing.estimate``'s result for the same run."""
    requested = t.total("requested")
    dram = t.total("dram")
    flops = t.matmul_flops + t.other_flops
    peak, peak_phase, peak_tensors = t.peak_memory()
    return {
        "algorithm": t.algorithm,
        "blocks": dict(t.blocks),
        "tensors": t.by_tensor(),
        "requested_read_bytes": t.total("requested", "read"),
        "requested_write_bytes": t.total("requested", "write"),
        "requested_bytes": requested,
        "dram_read_bytes": t.total("dram", "read"),
        "dram_write_bytes": t.total("dram", "write"),
        "dram_bytes": dram,
        "element_accesses": t.element_accesses,
        "matmul_flops": t.matmul_flops,
        "other_flops": t.other_flops,
        "flops": flops,
        "intensity_requested": flops / requested if requested else float("inf"),
        "intensity_dram": flops / dram if dram else float("inf"),
        "roofline": roofline_seconds(t, machine),
        "peak_memory_bytes": peak,
        "peak_memory_phase": peak_phase,
        "peak_memory_tensors": peak_tensors,
        "time_model": time_model,
        "notes": list(t.notes),
    }


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest decimal unit (B, KB, MB, GB, TB) that keeps the
    value at least 1, four significant digits: small problems do not print 0.000."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_table(summaries: list[dict], header: str) -> str:
    """A readable report: totals per algorithm, then traffic by tensor."""
    lines = [header, ""]
    columns = ("algorithm", "requested", "DRAM (est.)", "GFLOPs", "FLOP/B (DRAM)", "roofline ms", "bound",
               "model ms", "peak memory")
    rows = []
    for s in summaries:
        roof = s["roofline"]
        bound = "memory" if roof["memory_s"] >= roof["compute_s"] else "compute"
        model = s.get("time_model")
        rows.append((s["algorithm"], format_bytes(s["requested_bytes"]), format_bytes(s["dram_bytes"]),
                     f"{s['flops'] / 1e9:.1f}", f"{s['intensity_dram']:.1f}", f"{roof['estimate_s'] * 1e3:.4g}",
                     bound, "-" if model is None else f"{model['seconds'] * 1e3:.4g}",
                     format_bytes(s["peak_memory_bytes"])))
    lines += _align([columns] + rows)
    for s in summaries:
        lines += ["", f"{s['algorithm']}: traffic by tensor"
                  + (f"   blocks: {', '.join(f'{k}={v}' for k, v in s['blocks'].items())}" if s["blocks"] else "")]
        tensor_rows = [("tensor", "read", "write", "DRAM read", "DRAM write", "elements")]
        for name, row in s["tensors"].items():
            tensor_rows.append((name, format_bytes(row["read"]), format_bytes(row["write"]),
                                format_bytes(row["dram_read"]), format_bytes(row["dram_write"]),
                                f"{row['elements']:,}"))
        lines += _align(tensor_rows)
        lines += [f"  note: {note}" for note in s["notes"]]
        if s["peak_memory_bytes"]:
            lines.append(f"  peak memory: {format_bytes(s['peak_memory_bytes'])} in {s['peak_memory_phase']} ("
                         + ", ".join(f"{name} {format_bytes(size)}" for name, size in s["peak_memory_tensors"].items())
                         + ")")
        if s.get("time_model"):
            lines.append("  time model: " + "; ".join(
                f"{launch['name']} {launch['seconds'] * 1e3:.4g} ms"
                + (f" ({launch['waves']:.2f} waves of {launch['blocks_per_sm']}/SM)" if launch["waves"] else "")
                for launch in s["time_model"]["launches"]))
    return "\n".join(lines)


def _align(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    out = []
    for index, row in enumerate(rows):
        out.append("  ".join(str(cell).rjust(width) if i else str(cell).ljust(width)
                             for i, (cell, width) in enumerate(zip(row, widths))))
        if index == 0:
            out.append("  ".join("-" * width for width in widths))
    return out


CSV_FIELDS = ("sweep_value", "algorithm", "requested_bytes", "requested_read_bytes", "requested_write_bytes",
              "dram_bytes", "dram_read_bytes", "dram_write_bytes", "element_accesses", "matmul_flops",
              "other_flops", "intensity_dram", "estimate_s", "model_s", "peak_memory_bytes")


def format_csv(records: list[tuple[object, dict]]) -> str:
    """One row per (sweep value, algorithm)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for value, s in records:
        row = {key: s.get(key) for key in CSV_FIELDS if key in s}
        row.update(sweep_value=value, estimate_s=s["roofline"]["estimate_s"],
                   model_s=s["time_model"]["seconds"] if s.get("time_model") else None)
        writer.writerow(row)
    return buffer.getvalue()


def explain(t: Traffic) -> str:
    """Each term of the ledger with its formula, identical formulas merged."""
    merged: dict[tuple[str, str, str], list[int]] = {}
    for term in t.terms:
        key = (term.tensor, term.kind, term.formula)
        entry = merged.setdefault(key, [0, 0])
        entry[0] += term.requested
        entry[1] += term.dram
    lines = [f"{t.algorithm}:"]
    for (tensor, kind, formula), (requested, dram) in merged.items():
        lines.append(f"  {tensor:>12} {kind:5} {format_bytes(requested):>10} requested, {format_bytes(dram):>10} DRAM"
                     f"  <- {formula}")
    lines += [f"  FLOPs: {formula}" for formula in t.flop_formulas]
    return "\n".join(lines)
