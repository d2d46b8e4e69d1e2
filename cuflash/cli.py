"""The ``cuflash`` command line: ``cuflash simulate`` counts the HBM traffic
of attention algorithms (pure Python, no GPU)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import click

from .simulate import ALGORITHMS, MACHINES, PASSES, Problem, explain, format_csv, format_table, run, summarize
from .simulate.report import format_bytes
from .simulate.timing import compare_with_bench, decode_table_rows, estimate, ranking_agreement

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


class SizeType(click.ParamType):
    """An integer with an optional binary suffix: 16k = 16384, 192KB = 196608."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", str(value).lower())
        if not match:
            self.fail(f"expected a whole number with an optional k/M/G suffix, got {value!r}", param, ctx)
        return int(match.group(1)) * _SUFFIX[match.group(2)]


SIZE = SizeType()


def _size_list(text: str, ctx) -> list[int]:
    return [SIZE.convert(item, None, ctx) for item in text.split(",") if item.strip()]


@click.group(invoke_without_command=True)
@click.version_option(package_name="cuflash")
@click.pass_context
def main(ctx):
    """cuflash: exact FlashAttention for any Python GPU framework."""
    if ctx.invoked_subcommand is None:  # a bare `cuflash` shows what it can do
        click.echo(ctx.get_help())


EXAMPLE = """\b
Example, the FlashAttention paper's Figure 2 (A100, forward + backward):
  cuflash simulate --machine a100 --batch 64 --heads 16 --seqlen 1024 \\
      --head-dim 64 --dtype fp16 --key-padding-mask -a pytorch -a flash1
"""


@main.command(epilog=EXAMPLE)
@click.option("--batch", "-b", type=SIZE, default=1, show_default=True)
@click.option("--heads", type=SIZE, default=16, show_default=True, help="query heads")
@click.option("--kv-heads", type=SIZE, default=None, help="key/value heads (default: --heads)")
@click.option("--seqlen", "-n", type=SIZE, default="1024", show_default=True, help="sequence length, e.g. 16k")
@click.option("--seqlen-q", type=SIZE, default=None, help="query length (default: --seqlen)")
@click.option("--seqlen-k", type=SIZE, default=None, help="key length (default: --seqlen)")
@click.option("--head-dim", "-d", type=SIZE, default=64, show_default=True)
@click.option("--dtype", type=click.Choice(sorted(_DTYPE_BYTES)), default="fp16", show_default=True)
@click.option("--element-bytes", type=int, default=None, help="bytes per element (overrides --dtype)")
@click.option("--causal/--no-causal", default=False, show_default=True)
@click.option("--dropout", is_flag=True, help="dropout in the pytorch pipeline (a one-byte mask in HBM)")
@click.option("--key-padding-mask", is_flag=True, help="key-padding masked_fill in the pytorch pipeline")
@click.option("--deterministic", is_flag=True, help="cuflash's deterministic backward (dQ pass, no atomics)")
@click.option("--page-size", type=SIZE, default=None,
              help="K/V in a paged cache of this many tokens per page, read through a block table")
@click.option("--append", is_flag=True, help="the --seqlen-q new tokens' K/V are appended to the cache by the same "
                                             "call (the cache then holds --seqlen-k tokens)")
@click.option("--splits", default=None,
              help="split-KV: thread blocks per query block, a count or 'auto' (default: each algorithm's own: "
                   "flash-decoding auto, the others 1)")
@click.option("--pack-gqa/--no-pack-gqa", default=None,
              help="run the query heads of a K/V head as one block's rows (default: each algorithm's own: "
                   "flash-decoding for one-token queries, the others not)")
@click.option("--block-density", type=float, default=1.0, show_default=True,
              help="block-sparse attention (Proposition 4): the fraction of blocks the mask keeps")
@click.option("--pass", "passes", type=click.Choice(PASSES), default="fwd+bwd", show_default=True)
@click.option("--machine", type=click.Choice(sorted(MACHINES), case_sensitive=False), default="a100",
              show_default=True)
@click.option("--sram", type=SIZE, default=None, help="SRAM per SM in bytes, e.g. 96KB (overrides the preset's)")
@click.option("--sms", type=SIZE, default=None, help="SMs (overrides the preset's)")
@click.option("--l2", type=SIZE, default=None, help="L2 bytes, e.g. 50MB (overrides the preset's)")
@click.option("--bandwidth", type=float, default=None, help="DRAM bandwidth in TB/s (overrides the preset's)")
@click.option("--matmul-tflops", type=float, default=None,
              help="dense 16-bit tensor-core TFLOP/s (overrides the preset's)")
@click.option("--measured", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a tools/bench.py JSON file: the time model beside its measured times, error per row")
@click.option("--algorithm", "-a", "algorithms", type=click.Choice(list(ALGORITHMS)), multiple=True,
              help="repeat for several; default: all")
@click.option("--block-m", type=SIZE, default=None, help="override the query block size (Br)")
@click.option("--block-n", type=SIZE, default=None, help="override the key block size (Bc)")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--csv", "as_csv", is_flag=True, help="print CSV (one row per algorithm and sweep value)")
@click.option("--sweep", type=click.Choice(["seqlen", "kv-len", "head-dim", "sram", "block-n"]), default=None,
              help="vary one quantity over --values (seqlen: both lengths; kv-len: the key length, with "
                   "--seqlen-q or --seqlen as the query length, e.g. decoding with --seqlen-q 1; block-n: the "
                   "key block size Bc, as the FlashAttention paper's Figure 2, middle)")
@click.option("--values", default=None, help="comma-separated sweep values, e.g. 1k,2k,4k,8k,16k")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), default=None,
              help="with --sweep: draw traffic and time against the swept value (needs matplotlib)")
@click.option("--explain", "show_explain", is_flag=True, help="print every term with its formula")
@click.option("--gpus", type=SIZE, default=None,
              help="context parallelism over this many GPUs: the sequence sharded, per-GPU traffic and time")
@click.option("--strategy", type=click.Choice(["ring", "ulysses", "auto"]), default="auto", show_default=True,
              help="with --gpus: ring attention, all-to-all over heads, or the faster")
@click.option("--link-bandwidth", type=float, default=None,
              help="with --gpus: GB/s each way per GPU between GPUs (default: the machine's NVLink)")
@click.option("--unbalanced", is_flag=True, help="with --gpus and a causal ring: contiguous shards, not balanced")
def simulate(batch, heads, kv_heads, seqlen, seqlen_q, seqlen_k, head_dim, dtype, element_bytes, causal, dropout,
             key_padding_mask, deterministic, page_size, append, splits, pack_gqa, block_density, passes, machine,
             sram, sms, l2, bandwidth, matmul_tflops, measured, algorithms, block_m, block_n, as_json, as_csv, sweep,
             values, plot, show_explain, gpus, strategy, link_bandwidth, unbalanced):
    """Count the HBM traffic of attention algorithms.

    Two levels: the bytes each algorithm's loads and stores request from global
    memory (exact, the FlashAttention paper's "HBM accesses"), and an estimate
    of DRAM traffic after the L2 cache (what a profiler measures). Also FLOPs,
    arithmetic intensity, a roofline time, and a time model of the tiled
    algorithms (thread blocks in waves, the tensor cores, exponentials and
    CUDA cores of each SM; fitted to an H100's measurements).

    Algorithms: standard (Algorithm 0), pytorch (the unfused pipeline),
    flash1 (FlashAttention Algorithm 1/4), flash2 (FlashAttention-2),
    flash-decoding (FlashAttention-2's inference path: split-KV, GQA packing),
    cuflash (this library's kernels, tile for tile).

    With --gpus: context parallelism (ring attention or Ulysses) of
    cuflash's kernels, per GPU (cuflash.simulate.distributed).
    """
    ctx = click.get_current_context()
    if as_json and as_csv:
        raise click.UsageError("choose one of --json and --csv")
    if show_explain and (as_json or as_csv):
        raise click.UsageError("--explain prints text; leave out --json and --csv")
    if splits is not None and splits != "auto":
        try:
            splits = SIZE.convert(splits, None, ctx)
        except click.BadParameter:
            raise click.BadParameter(f"expected a whole number or 'auto', got {splits!r}", param_hint="--splits") \
                from None
    if plot and not sweep:
        raise click.UsageError("--plot needs --sweep")
    if sweep and not values:
        raise click.UsageError("--sweep needs --values")
    if values is not None and not sweep:
        raise click.UsageError("--values needs --sweep")
    if show_explain and sweep:
        raise click.UsageError("--explain explains one problem; leave out --sweep")
    if sweep == "seqlen" and (seqlen_q is not None or seqlen_k is not None):
        raise click.UsageError("--sweep seqlen sets both lengths; to vary the key length with a fixed query "
                               "length use --sweep kv-len with --seqlen-q")
    if sweep == "kv-len" and seqlen_k is not None:
        raise click.UsageError("--sweep kv-len sets the key length; leave out --seqlen-k")
    if sweep == "block-n" and block_n is not None:
        raise click.UsageError("--sweep block-n sets the key block size; leave out --block-n")
    sweep_values = _size_list(values, ctx) if sweep else []
    if sweep and not sweep_values:
        raise click.UsageError(f"--values gave no values: {values!r}")
    if plot:
        _check_plot_target(plot)
    algorithms = list(algorithms) or list(ALGORITHMS)

    def given(value, default):
        # 0 is a value (and an error where it is not meaningful), not "not given".
        return default if value is None else value

    def problem_for(q_len=None, k_len=None, d=None):
        try:
            return Problem(batch=batch, nheads=heads, nheads_k=given(kv_heads, heads),
                           seqlen_q=given(q_len, given(seqlen_q, seqlen)),
                           seqlen_k=given(k_len, given(seqlen_k, seqlen)),
                           head_dim=given(d, head_dim), element_size=given(element_bytes, _DTYPE_BYTES[dtype]),
                           causal=causal, dropout=dropout, key_padding_mask=key_padding_mask,
                           deterministic=deterministic, page_size=page_size, append=append, num_splits=splits,
                           pack_gqa=pack_gqa, block_density=block_density)
        except ValueError as error:
            raise click.BadParameter(str(error)) from None

    overrides = {"sms": sms, "l2_bytes": l2, "hbm_bandwidth": None if bandwidth is None else bandwidth * 1e12,
                 "matmul_flops": None if matmul_tflops is None else matmul_tflops * 1e12}
    for name, value in overrides.items():
        if value is not None and value <= 0:
            raise click.BadParameter(f"{name} must be positive, got {value}")
    if measured:
        if sweep or show_explain or as_csv:
            raise click.UsageError("--measured compares a benchmark file's rows; leave out --sweep, --explain, --csv")
        _compare_with_measured(measured, machine, ctx, overrides, as_json)
        return
    base_machine = _machine(machine, sram, overrides)
    if gpus is not None or link_bandwidth is not None or unbalanced or strategy != "auto":
        if gpus is None:
            raise click.UsageError("--strategy, --link-bandwidth and --unbalanced go with --gpus")
        if sweep or show_explain or as_csv or ctx.get_parameter_source("algorithms") is not \
                click.core.ParameterSource.DEFAULT:
            raise click.UsageError("--gpus models cuflash's kernels on one problem: leave out --sweep, --explain, "
                                   "--csv and --algorithm")
        _simulate_distributed(problem_for(), base_machine, gpus, strategy, link_bandwidth, unbalanced, passes,
                              as_json)
        return
    if "flash1" in algorithms and not sweep:
        _warn_outside_theorem2(problem_for(), base_machine)

    def summaries_for(problem, target, keys_per_block=block_n):
        out = []
        for name in algorithms:
            try:
                traffic = run(name, problem, target, passes, block_m, keys_per_block)
            except ValueError as error:
                raise click.BadParameter(str(error)) from None
            # The time model follows the tiles the algorithms choose; with
            # --block-m/--block-n it is left out rather than made up.
            model = None if block_m or keys_per_block else estimate(name, problem, target, passes)
            out.append((traffic, summarize(traffic, target, model)))
        return out

    if not sweep:
        problem = problem_for()
        results = summaries_for(problem, base_machine)
        if as_json:
            click.echo(json.dumps({"problem": problem.__dict__, "machine": base_machine.__dict__, "pass": passes,
                                   "results": [s for _, s in results]}, indent=2))
        elif as_csv:
            click.echo(format_csv([(None, s) for _, s in results]), nl=False)
        else:
            click.echo(format_table([s for _, s in results], _header(problem, base_machine, passes)))
        if show_explain:
            for traffic, _ in results:
                click.echo("\n" + explain(traffic))
        return

    records = []
    with click.progressbar(sweep_values, label=f"sweeping {sweep}", file=sys.stderr) as bar:
        for value in bar:
            if sweep == "seqlen":
                problem, target = problem_for(q_len=value, k_len=value), base_machine
            elif sweep == "kv-len":
                problem, target = problem_for(k_len=value), base_machine
            elif sweep == "head-dim":
                problem, target = problem_for(d=value), base_machine
            elif sweep == "block-n":
                records += [(value, s) for _, s in summaries_for(problem_for(), base_machine, value)]
                continue
            else:
                problem, target = problem_for(), _machine(machine, value, overrides)
            records += [(value, s) for _, s in summaries_for(problem, target)]
    if as_json:  # the single run's shape, plus the swept quantity and each result's value
        click.echo(json.dumps({"problem": problem_for().__dict__, "machine": base_machine.__dict__, "pass": passes,
                               "sweep": sweep, "results": [{"value": v, **s} for v, s in records]}, indent=2))
    elif as_csv:
        click.echo(format_csv(records), nl=False)
    else:
        click.echo(_sweep_table(sweep, records))
    if plot:
        _plot(plot, sweep, records, base_machine)


def _simulate_distributed(problem, target, gpus: int, strategy: str, link_bandwidth: float | None, unbalanced: bool,
                          passes: str, as_json: bool) -> None:
    """``cuflash simulate --gpus``: ring attention, Ulysses, or the faster."""
    from .simulate import distributed

    if link_bandwidth is not None and link_bandwidth <= 0:
        raise click.BadParameter(f"must be positive, got {link_bandwidth}", param_hint="--link-bandwidth")
    link = None if link_bandwidth is None else link_bandwidth * 1e9
    try:
        if strategy == "ring":
            results = [distributed.ring(problem, target, gpus, passes, balanced=not unbalanced, link_bandwidth=link)]
        elif strategy == "ulysses":
            results = [distributed.ulysses(problem, target, gpus, passes, link_bandwidth=link)]
        else:
            results = [distributed.ring(problem, target, gpus, passes, balanced=not unbalanced, link_bandwidth=link)]
            if problem.nheads % gpus == 0:
                results.append(distributed.ulysses(problem, target, gpus, passes, link_bandwidth=link))
    except (ValueError, KeyError) as error:
        message = (f"no NVLink preset for {target.name}: give --link-bandwidth" if isinstance(error, KeyError)
                   else str(error))
        raise click.BadParameter(message) from None
    best = min(results, key=lambda result: result.seconds)
    if as_json:
        click.echo(json.dumps({"problem": problem.__dict__, "machine": target.name, "pass": passes,
                               "results": [distributed.as_dict(r) for r in results], "faster": best.strategy},
                              indent=2))
        return
    for result in results:
        click.echo("\n".join(distributed.report(result)))
    if len(results) > 1:
        click.echo(f"faster here: {best.strategy}")


def _machine(name: str, sram: int | None, overrides: dict):
    """The preset with --sram and the other overrides applied."""
    chosen = MACHINES[name] if sram is None else MACHINES[name].with_sram(sram)
    given = {key: value for key, value in overrides.items() if value is not None}
    if given:
        label = ", ".join(f"{key} {value:g}" for key, value in given.items())
        chosen = dataclasses.replace(chosen, name=f"{chosen.name} ({label})", **given)
    return chosen


def _compare_with_measured(path: str, machine_name: str, ctx, overrides: dict, as_json: bool) -> None:
    """The time model of cuflash and flash2 beside a bench file's measured
    cuflash and SDPA flash times (its 16-bit forward and backward rows), as
    a Markdown table with the error per row and the largest errors."""
    try:
        with open(path) as handle:
            bench = json.load(handle)
        rows = list(bench["rows"]) + decode_table_rows(bench.get("decode", []))
        device = str(bench.get("environment", {}).get("device", ""))
        if ctx.get_parameter_source("machine") is click.core.ParameterSource.DEFAULT:
            machine_name = next((name for name in MACHINES if name.upper() in device.upper()), machine_name)
        target = _machine(machine_name, None, overrides)
        records = compare_with_bench(rows, target)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise click.BadParameter(f"{path} is not a tools/bench.py JSON file: {error}") from None
    except ValueError as error:  # a row the model cannot take
        raise click.BadParameter(f"{path}: {error}") from None
    if not records:
        raise click.BadParameter(f"{path} has no 16-bit fwd, bwd or decode rows")
    if as_json:
        click.echo(json.dumps({"file": path, "machine": target.name, "rows": records}, indent=2))
        return
    click.echo(f"Time model on {target.name} against {path} ({device or 'device not recorded'}); "
               "error = model / measured - 1.\n")
    click.echo("| pass | dtype | head_dim | causal | seqlen | batch x heads | algorithm | measured ms | model ms "
               "| error |")
    click.echo("|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        seqlen = r["seqlen_k"] if r["seqlen_q"] == r["seqlen_k"] else f"{r['seqlen_q']} x {r['seqlen_k']}"
        heads = r["heads"] if r["kv_heads"] == r["heads"] else f"{r['heads']}/{r['kv_heads']}"
        pages = f", pages of {r['page_size']}" if r["page_size"] else ""
        click.echo(f"| {r['pass']} | {r['dtype']} | {r['head_dim']} | {'yes' if r['causal'] else 'no'} | "
                   f"{seqlen}{pages} | {r['batch']} x {heads} | {r['algorithm']} | {r['measured_ms']:.4g} | "
                   f"{r['model_ms']:.4g} | {r['error']:+.1%} |")
    click.echo("")
    agree, points = ranking_agreement(records)
    if points:
        click.echo(f"ranking of cuflash and the other algorithm as measured at {agree} of {points} points")
    for algorithm in dict.fromkeys(r["algorithm"] for r in records):
        for pass_name in dict.fromkeys(r["pass"] for r in records):
            errors = [abs(r["error"]) for r in records if r["algorithm"] == algorithm and r["pass"] == pass_name]
            if errors:
                click.echo(f"{algorithm} {pass_name}: largest error {max(errors):.1%}, "
                           f"mean {sum(errors) / len(errors):.1%} over {len(errors)} rows")


def _warn_outside_theorem2(problem: Problem, machine) -> None:
    """FlashAttention's Theorem 2 (HBM accesses Theta(N^2 d^2 / M)) holds for
    d <= M <= N d, M the SRAM size in elements."""
    elements = machine.sram_per_sm // problem.element_size
    length = max(problem.seqlen_q, problem.seqlen_k)
    if not problem.head_dim <= elements <= length * problem.head_dim:
        click.echo(f"warning: SRAM of {elements} elements is outside Theorem 2's range d <= M <= N d "
                   f"({problem.head_dim} .. {length * problem.head_dim}); flash1's counts are still exact, "
                   "its Theta(N^2 d^2 / M) scaling does not apply", err=True)


def _header(problem: Problem, machine, passes: str) -> str:
    return (f"batch {problem.batch}, heads {problem.nheads} (kv {problem.nheads_k}), "
            f"seqlen {problem.seqlen_q}x{problem.seqlen_k}, head_dim {problem.head_dim}, "
            f"{problem.element_size}-byte elements, {'causal' if problem.causal else 'not causal'}"
            f"{', key-padding mask' if problem.key_padding_mask else ''}{', dropout' if problem.dropout else ''}"
            f"{f', pages of {problem.page_size}' if problem.page_size else ''}"
            f"{', K/V appended' if problem.append else ''}"
            f"{f', splits {problem.num_splits}' if problem.num_splits is not None else ''}"
            f"{'' if problem.pack_gqa is None else ', GQA packed' if problem.pack_gqa else ', GQA not packed'}"
            f"{f', block density {problem.block_density:g}' if problem.block_density < 1 else ''}; "
            f"pass {passes}; machine {machine.name}: {machine.sms} SMs, SRAM {machine.sram_per_sm} B/SM, "
            f"L2 {machine.l2_bytes / 2**20:.0f} MiB, {machine.hbm_bandwidth / 1e12:.2f} TB/s")


def _sweep_table(sweep: str, records) -> str:
    lines = [f"{sweep:>10}  {'algorithm':10}  {'requested':>12}  {'DRAM (est.)':>12}  {'GFLOPs':>10}  "
             f"{'roofline ms':>11}  {'model ms':>10}"]
    for value, s in records:
        model = s.get("time_model")
        lines.append(f"{value:>10}  {s['algorithm']:10}  {format_bytes(s['requested_bytes']):>12}  "
                     f"{format_bytes(s['dram_bytes']):>12}  {s['flops'] / 1e9:10.1f}  "
                     f"{s['roofline']['estimate_s'] * 1e3:11.4g}  "
                     f"{'-' if model is None else format(model['seconds'] * 1e3, '.4g'):>10}")
    return "\n".join(lines)


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'cuflash[plot]'") from None
    return plt


#: The file types matplotlib's Agg canvas writes (so a bad name fails before matplotlib is imported).
_PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif", "tiff",
                 "webp")


def _check_plot_target(path: str) -> None:
    """Fails in one line, before any work, where the plot could not be written."""
    import os

    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise click.BadParameter(f"directory {directory} does not exist", param_hint="--plot")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in _PLOT_FORMATS:
        raise click.BadParameter(f"expected a file name ending in one of {', '.join(_PLOT_FORMATS)}, got {path!r}",
                                 param_hint="--plot")
    _matplotlib()


def _estimated_seconds(summary: dict) -> float:
    """A summary's time: the time model's, or the roofline's where there is none."""
    return (summary.get("time_model") or {}).get("seconds") or summary["roofline"]["estimate_s"]


def roofline_points(records) -> dict[str, list[tuple[float, float]]]:
    """Per algorithm, (arithmetic intensity in FLOP per DRAM byte, achieved
    TFLOP/s by the time model, or by the roofline where there is none) of
    each sweep point: where the algorithm sits under the machine's roofline."""
    points: dict[str, list[tuple[float, float]]] = {}
    for _, s in records:
        points.setdefault(s["algorithm"], []).append((s["intensity_dram"], s["flops"] / _estimated_seconds(s) / 1e12))
    return points


def _plot(path: str, sweep: str, records, machine) -> None:
    plt = _matplotlib()
    figure, (traffic_axis, time_axis, roofline_axis) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name in dict.fromkeys(s["algorithm"] for _, s in records):
        xs = [v for v, s in records if s["algorithm"] == name]
        rows = [s for _, s in records if s["algorithm"] == name]
        line, = traffic_axis.plot(xs, [s["dram_bytes"] for s in rows], marker="o", label=f"{name} (DRAM est.)")
        traffic_axis.plot(xs, [s["requested_bytes"] for s in rows], linestyle="--", color=line.get_color(),
                          label=f"{name} (requested)")
        time_axis.plot(xs, [_estimated_seconds(s) * 1e3 for s in rows], marker="o", label=name)
    placed = roofline_points(records)
    for name, points in placed.items():
        roofline_axis.plot(*zip(*points), marker="o", label=name)
    intensities = [x for points in placed.values() for x, _ in points if x > 0]
    if intensities:
        ridge = machine.matmul_flops / machine.hbm_bandwidth
        low, high = min(min(intensities), ridge) / 2, max(max(intensities), ridge) * 2
        roofline_axis.plot([low, ridge, high], [low * machine.hbm_bandwidth / 1e12, machine.matmul_flops / 1e12,
                                                machine.matmul_flops / 1e12], color="black", linewidth=1,
                           label=f"{machine.name} roofline")
    for axis, title, xlabel in ((traffic_axis, "HBM traffic (bytes)", sweep),
                                (time_axis, "time model, else roofline (ms)", sweep),
                                (roofline_axis, "TFLOP/s against FLOP per DRAM byte", "arithmetic intensity")):
        axis.set_xscale("log", base=2 if axis is not roofline_axis else 10)
        axis.set_yscale("log")
        axis.set_xlabel(xlabel)
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    click.echo(f"wrote {path}", err=True)


#: The configurations ``cuflash info`` evaluates: dtypes and head dims of common models.
_INFO_DTYPES = ("bfloat16", "float16", "float32")
_INFO_HEAD_DIMS = (64, 80, 96, 128, 256)


@main.command()
@click.option("--capability", type=int, default=None,
              help="evaluate the kernel choices for this compute capability (e.g. 90, 80) instead of GPU 0's")
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def info(capability, as_json):
    """What cuflash finds on this machine: versions, GPUs, which kernel each
    common configuration runs and why, and the kernel cache."""
    report = {"versions": _versions(), "gpus": _gpus()}
    generation, smem_limit = capability, None
    if generation is None and report["gpus"]:
        from . import api

        generation = api._kernel_generation(0)
        smem_limit = api._shared_memory_per_block(0)  # 99 KiB GPUs take other tiles, or other kernels
    report["generation"] = generation
    report["kernels"] = _kernel_choices(generation, smem_limit) if generation is not None else []
    report["kernel_cache"] = _kernel_cache()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo("versions: " + ", ".join(f"{name} {version}" for name, version in report["versions"].items()))
    if report["gpus"]:
        for gpu in report["gpus"]:
            click.echo(f"GPU {gpu['index']}: {gpu['name']}, compute capability {gpu['capability']}, "
                       f"{gpu['memory_gib']:.0f} GiB")
    else:
        click.echo("GPU: no CUDA GPU found" + ("" if capability else " (pass --capability 90 or 80 to see what one "
                                                                   "would run)"))
    if report["kernels"]:
        click.echo(f"\nkernels on compute capability {generation} (16-byte aligned rows, softmax_scale > 0; "
                   "other inputs run on the SIMT kernels):")
        for row in report["kernels"]:
            click.echo(f"  {row['dtype']:9} d{row['head_dim']:<4} forward {row['forward']:14} "
                       f"backward {row['backward']:20} deterministic {row['deterministic']}")
            for note in row["why"]:
                click.echo(f"      {note}")
    cache = report["kernel_cache"]
    click.echo(f"\nkernel cache: {cache['path']} ({cache['files']} files, {format_bytes(cache['bytes'])})")


_WARMUP_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@main.command()
@click.option("--dtype", "dtypes", type=click.Choice(sorted(_WARMUP_DTYPES)), multiple=True,
              help="repeatable; default bf16 and fp16")
@click.option("--head-dim", "head_dims", type=int, multiple=True, help="repeatable; default 64 and 128")
@click.option("--mask", type=click.Choice(["none", "causal", "both"]), default="both", show_default=True)
@click.option("--forward-only", is_flag=True, help="leave out the backward")
@click.option("--deterministic", is_flag=True, help="also the deterministic backward")
@click.option("--device", type=int, default=None, help="GPU index (default: the current one)")
@click.option("--workers", type=int, default=8, show_default=True, help="compilations at once")
def warmup(dtypes, head_dims, mask, forward_only, deterministic, device, workers):
    """Compile the kernels a model will use, ahead of time.

    Plans each call as the launcher does on this GPU (forward per dtype, head
    dim and mask; backward per dQ mode), which compiles its kernels into
    CuPy's kernel cache: later processes load them instead of compiling
    (seconds per kernel). For deployment images and CUDA-graph capture.
    """
    import time

    from .warmup import configurations
    from .warmup import warmup as compile_ahead

    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - any failure here means no usable GPU
        raise click.ClickException(f"warmup compiles for a GPU and found none: {error}") from None
    dtype_names = [_WARMUP_DTYPES[d] for d in dtypes] or ["bfloat16", "float16"]
    dims = list(head_dims) or [64, 128]
    causal = {"none": (False,), "causal": (True,), "both": (False, True)}[mask]
    modes = (False, True) if deterministic else (False,)
    total = len(configurations(dtype_names, dims, causal, not forward_only, modes, ("ieee", "3xtf32")))
    start = time.perf_counter()
    try:
        with click.progressbar(length=total, label="compiling", file=sys.stderr) as bar:
            keys = compile_ahead(dtype_names, dims, causal=causal, backward=not forward_only, deterministic=modes,
                                 device=device, workers=workers, progress=lambda config: bar.update(1))
    except (TypeError, ValueError) as error:
        raise click.BadParameter(str(error)) from None
    cache = _kernel_cache()
    click.echo(f"{len(keys)} kernels ready in {time.perf_counter() - start:.1f} s; cache {cache['path']} "
               f"({cache['files']} files, {format_bytes(cache['bytes'])})")


def _versions() -> dict:
    import importlib.metadata
    import platform

    import numpy

    versions = {"python": platform.python_version(), "numpy": numpy.__version__}
    try:
        versions["cuflash"] = importlib.metadata.version("cuflash")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        versions["cuflash"] = "not installed"
    try:
        import cupy

        versions["cupy"] = cupy.__version__
        versions["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        versions["cuda driver"] = str(cupy.cuda.runtime.driverGetVersion())
    except Exception as error:  # no CuPy, no driver: say so, do not fail
        versions.setdefault("cupy", "not installed")
        versions["cuda"] = f"unavailable ({type(error).__name__})"
    return versions


def _gpus() -> list[dict]:
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device
        return []
    gpus = []
    for index in range(count):
        properties = cupy.cuda.runtime.getDeviceProperties(index)
        gpus.append({"index": index, "name": properties["name"].decode(),
                     "capability": int(cupy.cuda.Device(index).compute_capability),
                     "memory_gib": properties["totalGlobalMem"] / 2**30})
    return gpus


def _kernel_choices(generation: int, smem_limit: int | None = None) -> list[dict]:
    """Per common (dtype, head dim): the forward, backward and deterministic
    backward kernel families the launcher picks on a GPU of this generation
    giving a block ``smem_limit`` bytes of shared memory (None: enough), and
    why the preferred ones do not apply."""
    from ._kernel_families import FAMILIES, family_of, select

    rows = []
    for dtype in _INFO_DTYPES:
        for head_dim in _INFO_HEAD_DIMS:
            choice, skipped = {}, {}  # skipped: reason -> the preferred families it rules out
            for label, role, deterministic in (("forward", "forward", False), ("backward", "backward-dkdv", False),
                                               ("deterministic", "backward-dkdv", True)):
                tiling = select(role, dtype, head_dim, generation, deterministic=deterministic, smem_limit=smem_limit)
                chosen = family_of(role, tiling.kernel)
                choice[label] = chosen.name + (f" ({chosen.dq_mode(True)} dQ)" if deterministic else "")
                for family in FAMILIES[:FAMILIES.index(chosen)]:
                    reason = family.role == role and family.why_not(dtype, head_dim, generation,
                                                                    deterministic=deterministic, smem_limit=smem_limit)
                    if reason and family.name not in skipped.setdefault(reason, []):
                        skipped[reason].append(family.name)
            why = [f"not {', '.join(names)}: {reason}" for reason, names in skipped.items()]
            rows.append({"dtype": dtype, "head_dim": head_dim, **choice, "why": why})
    return rows


def _kernel_cache() -> dict:
    """CuPy's on-disk kernel cache, where cuflash's compiled kernels live."""
    import os

    path = os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))
    files = total = 0
    if os.path.isdir(path):
        for root, _, names in os.walk(path):
            for name in names:
                files += 1
                total += os.path.getsize(os.path.join(root, name))
    return {"path": path, "files": files, "bytes": total}

