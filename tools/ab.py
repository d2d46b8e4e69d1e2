#!/usr/bin/env python3
"""A/B of cuflash builds or rules: GPU time of chosen points, the candidates
in alternating processes, the best of each over the rounds, beside cuDNN.

A mode is a source tree (a checkout, or ``git archive <commit> cuflash
kernels_cu | tar -x -C DIR``) and optionally patches applied in its process
before anything runs (a rule switched off: ``MODULE.ATTR=EXPRESSION``, the
expression evaluated with nothing imported). Each round runs every mode
once, in order, in its own process (its own kernel cache and plans), so that
a drift of the machine's speed hits all modes alike; a point's time is the
best over the rounds, cuDNN's too (it runs in every process).

  python3 tools/ab.py --mode base=scratch/old --mode new=. --points "128:none:4096 112:causal:512"
  python3 tools/ab.py --mode narrow=. --mode padded=. \\
      --patch "padded:cuflash._tiling.wgmma_product_dim=lambda head_dim, padded: 0" --points "112:none:4096"

Points are HEAD_DIM:MASK:SEQLEN (MASK none or causal) on the FlashAttention-2
grid's shapes (16384 tokens, hidden 2048: batch 16384 // seqlen, heads
2048 // head_dim, as tools/bench.py's head-dim sweep), timed as
tools/bench.py times them (CUDA events, the stream held, medians; the
backward is ``cuflash.attention_backward`` against SDPA's autograd
backward; ``--pass bwd-deterministic`` its deterministic mode, against the
same cuDNN backward). Prints one line per point: each mode's ms and ratio to cuDNN,
and the last mode's change against the first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
MASKS = ("none", "causal")
#: Passes a point can be timed in: the forward, the backward, and the
#: backward's deterministic (ordered dQ) mode.
PASSES = ("fwd", "bwd", "bwd-deterministic")


@dataclass(frozen=True)
class Point:
    """A shape of the grid to time: its head dim, mask and sequence length."""

    head_dim: int
    causal: bool
    seqlen: int

    @property
    def name(self) -> str:
        return f"d{self.head_dim} {'causal' if self.causal else 'full'} {self.seqlen}"


def parse_point(text: str) -> Point:
    """``HEAD_DIM:MASK:SEQLEN`` -> Point; a clear error otherwise."""
    parts = text.split(":")
    if len(parts) != 3 or parts[1] not in MASKS or not (parts[0].isdigit() and parts[2].isdigit()):
        raise ValueError(f"a point is HEAD_DIM:MASK:SEQLEN with MASK one of {MASKS}, got {text!r}")
    head_dim, seqlen = int(parts[0]), int(parts[2])
    if not (0 < head_dim <= 256 and 0 < seqlen <= 16384):
        raise ValueError(f"{text!r}: head_dim from 1 to 256 and seqlen from 1 to 16384 (the grid's 16384 tokens)")
    return Point(head_dim, parts[1] == "causal", seqlen)


def parse_mode(text: str) -> tuple[str, Path]:
    """``NAME=DIR`` -> (name, absolute tree), the tree holding ``cuflash/``."""
    name, sep, tree = text.partition("=")
    if not sep or not name or not tree:
        raise ValueError(f"a mode is NAME=DIR, got {text!r}")
    path = Path(tree).resolve()
    if not (path / "cuflash" / "__init__.py").is_file():
        raise ValueError(f"mode {name!r}: {path} holds no cuflash/ package")
    return name, path


def parse_patch(text: str) -> tuple[str, str, str, str]:
    """``MODE:MODULE.ATTR=EXPRESSION`` -> (mode, module, attribute, expression)."""
    mode, sep, rest = text.partition(":")
    target, eq, expression = rest.partition("=")
    module, dot, attribute = target.strip().rpartition(".")
    if not (sep and eq and dot and mode and module and attribute and expression.strip()):
        raise ValueError(f"a patch is MODE:MODULE.ATTR=EXPRESSION, got {text!r}")
    return mode, module, attribute, expression.strip()


def worker_command(mode: str, points: list[str], passes: list[str], dtype: str, patches: list[str]) -> list[str]:
    """The command line of one mode's process (run in its tree)."""
    command = [sys.executable, str(TOOLS / "ab.py"), "--worker", mode, "--dtype", dtype,
               "--points", " ".join(points)]
    for pass_name in passes:
        command += ["--pass", pass_name]
    for patch in patches:
        command += ["--patch", patch]
    return command


def timed_backend(pass_name: str) -> str:
    """The key of cuflash's time in ``tools/bench.py``'s timings of a pass
    (the deterministic backward's beside the default one's; cuDNN's
    backward, which has no such mode, stays the reference)."""
    return "cuflash-deterministic" if pass_name == "bwd-deterministic" else "cuflash"


def best_of(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    """The fastest cuflash time and cuDNN time per (point, pass, mode) over the rounds."""
    best = {}
    for row in rows:
        key = (row["point"], row["pass"], row["mode"])
        kept = best.setdefault(key, {"cuflash": row["cuflash"], "cudnn": row.get("cudnn")})
        kept["cuflash"] = min(kept["cuflash"], row["cuflash"])
        if row.get("cudnn") is not None:
            kept["cudnn"] = row["cudnn"] if kept["cudnn"] is None else min(kept["cudnn"], row["cudnn"])
    return best


def summary(rows: list[dict], modes: list[str]) -> list[str]:
    """One markdown row per (point, pass): each mode's best ms (ratio to
    cuDNN's best in that mode's processes) and the last mode against the first."""
    best = best_of(rows)
    lines = ["| point | pass | " + " | ".join(modes) + f" | {modes[-1]} vs {modes[0]} |",
             "|---|---|" + "---|" * len(modes) + "---|"]
    for point, pass_name in dict.fromkeys((row["point"], row["pass"]) for row in rows):
        cells = []
        for mode in modes:
            entry = best.get((point, pass_name, mode))
            if entry is None:
                cells.append("-")
                continue
            ratio = "" if entry["cudnn"] is None else f" ({entry['cudnn'] / entry['cuflash']:.3f})"
            cells.append(f"{entry['cuflash']:.3f}{ratio}")
        first, last = best.get((point, pass_name, modes[0])), best.get((point, pass_name, modes[-1]))
        change = "-" if first is None or last is None else f"{100 * (last['cuflash'] / first['cuflash'] - 1):+.1f}%"
        lines.append(f"| {point} | {pass_name} | " + " | ".join(cells) + f" | {change} |")
    return lines


def import_tree_cuflash(tree: Path):
    """Imports ``tree``'s cuflash and checks that it is the one loaded.

    It must come first: tools/bench.py puts its own checkout at the front of
    sys.path when imported, so a mode's tree imported after it would
    silently run that checkout's cuflash (every mode the same code)."""
    tree = tree.resolve()
    sys.path.insert(0, str(tree))
    import cuflash

    origin = Path(cuflash.__file__).resolve()
    if tree not in origin.parents:
        raise RuntimeError(f"the mode's tree is {tree}, but cuflash was imported from {origin}")
    return cuflash


def run_worker(mode: str, points: list[Point], passes: list[str], dtype: str, patches: list[str]) -> None:
    """Times the points with the mode's cuflash (its tree is the working
    directory), after this mode's patches; prints one JSON line per point
    and pass."""
    import importlib

    import_tree_cuflash(Path.cwd())
    for patch in patches:
        patch_mode, module, attribute, expression = parse_patch(patch)
        if patch_mode == mode:
            setattr(importlib.import_module(module), attribute, eval(expression, {}))  # noqa: S307 (the caller's own code)
    import torch
    from bench import HIDDEN, TOKENS, measure_backward, measure_point  # tools/, this script's directory, is on sys.path

    torch_dtype = getattr(torch, dtype)
    for point in points:
        heads, batch = HIDDEN // point.head_dim, TOKENS // point.seqlen
        generator = torch.Generator(device="cuda").manual_seed(point.seqlen + point.head_dim)
        q, k, v = (torch.randn(batch, point.seqlen, heads, point.head_dim, device="cuda", dtype=torch_dtype,
                               generator=generator) for _ in range(3))
        sdpa_inputs = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))
        for pass_name in passes:
            if pass_name == "fwd":
                timings, _ = measure_point(q, k, v, sdpa_inputs, point.causal, {}, 10, 15)
            else:
                deterministic = pass_name == "bwd-deterministic"
                timings = measure_backward(q, k, v, sdpa_inputs, point.causal, 10, 15, deterministic=deterministic)
            print(json.dumps({"mode": mode, "point": point.name, "pass": pass_name,
                              "cuflash": timings[timed_backend(pass_name)], "cudnn": timings.get("cudnn")}),
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", default=[], help="NAME=DIR, in the order they run")
    parser.add_argument("--patch", action="append", default=[], help="MODE:MODULE.ATTR=EXPRESSION")
    parser.add_argument("--points", required=True, help="HEAD_DIM:MASK:SEQLEN ..., space-separated")
    parser.add_argument("--pass", dest="passes", action="append", choices=PASSES, help="default: fwd")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="also write every round's rows here (JSON lines)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    passes = args.passes or ["fwd"]
    try:
        points = [parse_point(text) for text in args.points.split()]
        patches = [parse_patch(text) for text in args.patch]
        if args.worker is not None:
            run_worker(args.worker, points, passes, args.dtype, args.patch)
            return 0
        modes = [parse_mode(text) for text in args.mode]
    except ValueError as exc:
        parser.error(str(exc))
    names = [name for name, _ in modes]
    if len(names) < 2 or len(set(names)) != len(names):
        parser.error("give two or more modes with distinct names")
    unknown = {mode for mode, *_ in patches} - set(names)
    if unknown:
        parser.error(f"patches name modes that were not given: {sorted(unknown)}")
    rows = []
    for round_index in range(args.rounds):
        for name, tree in modes:
            # The worker puts its tree (its working directory) first on sys.path itself.
            result = subprocess.run(worker_command(name, args.points.split(), passes, args.dtype, args.patch),
                                    cwd=tree, capture_output=True, text=True)
            if result.returncode != 0:
                print(result.stdout + result.stderr, file=sys.stderr)
                return result.returncode
            for line in result.stdout.splitlines():
                if line.startswith("{"):
                    rows.append(dict(json.loads(line), round=round_index))
                    print(line, flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print("\n".join(summary(rows, names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
