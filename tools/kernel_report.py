#!/usr/bin/env python3
"""Compile every kernel variant without a GPU and report its resources.

Writes one translation unit that explicitly instantiates every variant the
launcher can ask for (every family of ``cuflash/_kernel_families.py``, each
compiled head dim, every mask policy), compiles it with ``nvcc -cubin -Xptxas -v`` for each
architecture, and prints registers, stack frame, spill stores/loads and the
dynamic shared memory per variant. ``--fail-on-spill`` exits 1 if a variant
selected by ``--only`` spills past its limit (``spill_limit``).

  python3 tools/kernel_report.py [--arch sm_90a --arch sm_80] [--only forward/bfloat16] [--json] [--fail-on-spill]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cuflash._kernel_families import (FAMILIES, KernelVariant, cache_append_variants, claimed_dq_applies,  # noqa: E402
                                      direct_dq_applies, merge_variants)
from cuflash._loader import kernel_source_dir  # noqa: E402
from cuflash._masks import BATCH_LAYOUTS, CACHE_LAYOUTS, MASKS, SCORE_TRANSFORMS, built_in_masks  # noqa: E402
from cuflash._tiling import copy_engine_layouts  # noqa: E402

#: Batch layouts every tiled family is built for ("dense" first); the
#: KV-cache ones (CACHE_LAYOUTS) only where a family has them.
LAYOUTS = tuple(layout for layout in BATCH_LAYOUTS if layout not in CACHE_LAYOUTS)

#: Key prefixes of the fast-path (tensor-core) variants, which must not spill at all.
FAST_PATH = tuple(f"{f.name}/" for f in FAMILIES if f.kernel in ("mma", "wgmma"))
#: Key prefixes of the variants built for sm_90a only (wgmma); other
#: architectures do not compile them.
HOPPER_ONLY = tuple(f"{f.name}/" for f in FAMILIES if f.arch == "sm_90a")
_ARCH_FLAGS = {"sm_90a": "-gencode=arch=compute_90a,code=sm_90a", "sm_90": "-gencode=arch=compute_90,code=sm_90",
               "sm_80": "-gencode=arch=compute_80,code=sm_80", "sm_86": "-gencode=arch=compute_86,code=sm_86",
               "sm_89": "-gencode=arch=compute_89,code=sm_89"}


#: The heaviest policies (the most registers: a window's two offsets, the
#: soft cap and ALiBi's slope and offset, dropout's Philox state), compiled beside every mask with
#: the identity transform for dense batches: the other combinations are
#: their parts.
HEAVIEST = ("window", "softcap-alibi-dropout")


def _family_variants(family, dtype: str, tiling, layouts=("dense",)) -> list[KernelVariant]:
    """``family``'s variants of one tiling: every mask, both dQ modes of a
    dK/dV family that has them, each of ``layouts``; in dense batches the
    ``HEAVIEST`` policies too."""
    policies = [(mask, SCORE_TRANSFORMS["identity"]) for mask in built_in_masks()]
    heaviest = [(MASKS[HEAVIEST[0]], SCORE_TRANSFORMS[HEAVIEST[1]])]
    if tiling.persistent:  # the launcher takes it without a mask or causal, without dropout, dense batches only
        policies = [(MASKS[mask], SCORE_TRANSFORMS["identity"]) for mask in ("none", "causal")]
        heaviest = [(MASKS["causal"], SCORE_TRANSFORMS["softcap-alibi"])]
        layouts = [layout for layout in layouts if layout == "dense"]
    # A copy-engine decode tiling is built for its own layouts (copy_engine_layouts).
    layouts = [layout for layout in layouts if layout in (copy_engine_layouts(tiling) or (layout,))]
    return [family.variant(dtype, tiling, mask, score, dq_mode=mode, layout=layout)
            for layout in layouts for mask, score in policies + (heaviest if layout == "dense" else [])
            for mode in family.dq_modes or ("atomic",) if _mode_built(mode, mask, layout, tiling)]


def _mode_built(mode: str, mask, layout: str, tiling) -> bool:
    """Whether a dK/dV family's dQ ``mode`` is built for ``mask`` in ``layout`` batches on ``tiling``."""
    if mode == "claimed":
        return claimed_dq_applies(mask, layout, tiling.head_dim_padded)
    return mode != "direct" or direct_dq_applies(mask, layout)


def spill_limit(key: str) -> int:
    """Bytes of local memory (spill stores or loads) a variant may have.
    The tensor-core kernels on dense batches are the fast path: none. The
    mma.sync kernels on packed batches and KV caches (an A100's
    variable-length path, every GPU's KV-cache path) carry the sequences'
    row offsets or key counts and page lookups, and a few of their
    register-tight tiles spill (README: limits): up to 64 bytes, 136 for a
    window over a KV cache (the paged 128x64 tiles: 132 at d96 on sm_80
    since the softmax scale became a float32 parameter, 124 at d128); the Hopper
    kernels none there either. The SIMT kernels, not the fast path: up to 64.
    Dropout's Philox rounds (ten rounds per eight probabilities, beside the
    tiles' accumulators) spill on the register-tight tiles of every family:
    up to 256 bytes there (README: limits; its cost is in BENCHMARKS.md);
    so does a user mask's rule in the mma.sync forward."""
    if "dropout" in key:
        return 256
    if "/mask-" in key and key.startswith("backward-dkdv-wgmma/"):
        # Hopper's dK/dV kernel with a user's document mask: 12-20 bytes at
        # d128 (before and after the rule came in parts), 4-16 at d64 (128
        # query rows a step since 234dfa3); its forward spills none with one.
        return 24
    if "/mask-" in key and key.startswith(("forward-mma/", "backward-dkdv-mma/")):
        # A user mask (cuflash.mods) evaluated beside the mma.sync kernels'
        # accumulators (255 registers at d128 already) spills there, at d128
        # (bf16): a causal document mask up to 44 bytes in the forward (228
        # before its array reads came once a row and a key,
        # cuflash.mods.rule_parts), up to 88 in the dK/dV kernel on sm_90a
        # (108 before; 40 on sm_80), a window written as a mask function up
        # to 72 (README: limits).
        return 256 if key.startswith("forward-mma/") else 96
    other_layout = any(layout in key for layout in ("/packed", "/cache/", "/paged/"))
    if not key.startswith(FAST_PATH):
        return 64
    if other_layout and "wgmma" not in key:
        return 136 if "/window/" in key and ("/cache/" in key or "/paged/" in key) else 64
    if key.startswith("forward-mma/") and "/window/" in key and ("/hdim128/m128n64w4/" in key
                                                                  or "/hdim96/m128n64w4/" in key):
        # A window's two offsets beside the A100's tile of 128 rows x 64 keys
        # at head dims 96 and 128 (a Hopper runs the wgmma forward there):
        # 32 bytes at d128; 4-8 at d96 since the softmax scale became a
        # float32 parameter (d79a629: ptxas takes it as a constant operand
        # and allocates the tile's 255 registers otherwise; the float64 one,
        # converted once, held a register, and no d96 tile spilled).
        return 32
    if key.startswith("forward-mma/") and "/hdim192/m64n32w4/" in key:
        # The A100's d192 tile built for sm_90a at three blocks an SM (168
        # registers; a Hopper runs it only where the wgmma forward does not
        # apply, rows not 16-byte aligned): 12 bytes since the float32 scale
        # (d79a629), none on sm_80.
        return 12
    if key.startswith("backward-dkdv-wgmma/") and "/hdim64/m128n128w12/" in key and (
            "/window/" in key or "/packed/" in key):
        # Head dim 64's 128 query rows a step (S^T and dP^T 64 registers
        # each beside dK and dV's 64, of a consumer's 240): a window's two
        # offsets spill 12 bytes dense, 4 packed; a causal mask on a packed
        # batch 8 (the sequences' row offsets). The 64-row tile spilled none
        # and ran 7-10% slower (docs/perf-notes.md).
        return 12
    return 0


def all_variants() -> list[KernelVariant]:
    """Every instantiation the launcher can request: each family's compiled
    tiles with every mask (and both dQ modes of a dK/dV family that has
    them), for dense batches and for packed (variable-length) ones, which
    never take the decode tiles, and for KV caches (contiguous and paged) in
    the dtypes of a family that has them, every tile."""
    variants = []
    for family in FAMILIES:
        if family.role in ("merge", "cache-append"):
            variants += merge_variants() if family.role == "merge" else cache_append_variants()
            continue
        if family.tiles is None:
            variants += [family.variant(dtype) for dtype in family.dtypes]
            continue
        for dtype, tiling in family.compiled_tilings():
            variants += _family_variants(family, dtype, tiling)
        for dtype, tiling in family.compiled_tilings(other_tiles=False):
            variants += _family_variants(family, dtype, tiling, layouts=LAYOUTS[1:])
        for dtype, tiling in family.compiled_tilings():
            if dtype in family.cache_dtypes:
                variants += _family_variants(family, dtype, tiling, layouts=CACHE_LAYOUTS)
    return variants


def small_smem_only_keys() -> frozenset[str]:
    """Keys of the variants only GPUs with less shared memory per block than
    an A100 take (``KernelFamily.small_smem_tiles``, sm_86/sm_89): a Hopper
    (227 KiB) never builds them."""
    keys = set()
    for family in FAMILIES:
        if family.tiles is None:
            continue
        for dtype in family.dtypes:
            for head_dim in family.head_dims:
                small = family.small_smem_tiles(dtype, head_dim)
                if small is not None and small not in (family.tiles(dtype, head_dim),
                                                       family.hopper_tiles(dtype, head_dim)):
                    keys.update(v.key for v in _family_variants(family, dtype, small, layouts=LAYOUTS))
    return frozenset(keys)


#: Shared memory one block may use on each architecture (sharedMemPerBlockOptin):
#: a variant that needs more cannot launch there, and the launcher never picks it.
SMEM_PER_BLOCK = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024,
                  "sm_90a": 227 * 1024}


def _copy_engine_form_on_hopper(key: str) -> bool:
    """Whether a Hopper runs the variant of ``key`` in its copy-engine K/V
    form instead (``Tiling.kv_tma``): the one-tile decode tiles of dense
    batches and contiguous caches (a paged cache keeps both: page sizes that
    do not tile a key block gather their rows by cp.async)."""
    return "/split-keys" in key and "/tma" not in key and "/paged" not in key


def variants_for(variants, arch: str) -> list[KernelVariant]:
    """The variants ``arch`` builds: the Hopper-only ones on sm_90a alone,
    the thread-block cluster and copy-engine K/V ones on Hopper (where they
    replace the one-tile decode variants they are forms of), the
    small-shared-memory ones everywhere but Hopper, and only those whose
    shared memory fits the architecture's blocks."""
    hopper = arch.startswith("sm_90")
    small = small_smem_only_keys() if hopper else frozenset()
    return [v for v in variants if v.key not in small and v.smem_bytes <= SMEM_PER_BLOCK[arch]
            and (arch == "sm_90a" or not v.key.startswith(HOPPER_ONLY))
            and (not _copy_engine_form_on_hopper(v.key) if hopper else v.cluster_blocks == 1 and "/tma" not in v.key)]


def _translation_unit(variants) -> str:
    sources = sorted({v.source for v in variants})
    lines = [f'#include "{source}"' for source in sources]
    lines += list(dict.fromkeys(v.prelude for v in variants if v.prelude))  # generated policies (cuflash.mods)
    lines += [f"template __global__ void {v.name_expression}(const {v.params});" for v in variants]
    return "\n".join(lines) + "\n"


def _demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if tool is None:
        raise SystemExit("needs cu++filt or c++filt to read ptxas's report")
    result = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def _normalise(expression: str) -> str:
    """One spelling of a template instantiation, whichever demangler wrote it
    (cu++filt spells template arguments as ``(int)32`` and ``(bool)1``)."""
    expression = re.sub(r"\s+", "", expression)
    expression = expression.replace("(bool)1", "true").replace("(bool)0", "false")
    return re.sub(r"\((?:int|unsigned|long)\)", "", expression)


def _ptxas_log(variants, arch: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "variants.cu"
        source.write_text(_translation_unit(variants))
        command = ["nvcc", "-std=c++17", "-cubin", _ARCH_FLAGS[arch], "-Xptxas", "-v",
                   f"-I{kernel_source_dir()}", str(source), "-o", str(Path(tmp) / "variants.cubin")]
        result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"nvcc failed for {arch}:\n{result.stderr[-4000:]}")
    return result.stderr


def compile_report(variants, arch: str) -> list[dict]:
    """ptxas's resources for every variant. The fast-path variants are each
    compiled alone, as NVRTC compiles them at run time (one program per
    variant): register allocation near the 255 limit can differ by a few
    bytes of spill between one big translation unit and a small one, and the
    small one is what runs. The SIMT variants share one translation unit."""
    fast = [v for v in variants if v.key.startswith(FAST_PATH)]
    rest = [v for v in variants if not v.key.startswith(FAST_PATH)]
    jobs = [[v] for v in fast] + ([rest] if rest else [])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        log = "\n".join(pool.map(lambda group: _ptxas_log(group, arch), jobs))
    entries, current, serialized = {}, None, set()
    for line in log.splitlines():
        # ptxas made every wgmma wait for the previous one: C7520 (a wgmma in
        # a branch it must treat as divergent, see flash_fwd_wgmma.cu), C7514
        # (an accumulator read on a path where it sees the product in flight).
        if match := re.search(r"wgmma\.mma_async instructions are serialized.*in the function '(\w+)'", line):
            serialized.add(match.group(1))
        elif match := re.search(r"Compiling entry function '(\w+)'", line):
            current = match.group(1)
            entries[current] = {}
        elif current and (match := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            entries[current].update(stack=int(match.group(1)), spill_stores=int(match.group(2)),
                                    spill_loads=int(match.group(3)))
        elif current and (match := re.search(r"Used (\d+) registers", line)):
            entries[current]["registers"] = int(match.group(1))
    by_expression = {}
    for mangled, demangled in zip(entries, _demangle(list(entries))):
        expression = demangled.removeprefix("void ").split("(")[0]
        by_expression[_normalise(expression)] = {**entries[mangled], "wgmma_serialized": mangled in serialized}
    rows = []
    for variant in variants:
        found = by_expression.get(_normalise(variant.name_expression))
        if found is None:
            sample = ", ".join(sorted(by_expression)[:3])
            raise SystemExit(f"no ptxas report for {variant.name_expression} ({arch}); reported e.g. {sample}")
        rows.append({"variant": variant.key, "arch": arch, "threads": variant.threads,
                     "dynamic_smem": variant.smem_bytes, **found})
    return rows


def cuobjdump() -> str | None:
    """cuobjdump: on the PATH, or from the nvidia-cuda-cuobjdump wheel (the
    test extra's, with nvidia-cuda-nvdisasm, which it runs); None where
    neither is."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
    except ImportError:
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(location).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    return None


def sass_of(variant, arch: str = "sm_90a") -> list[str]:
    """One variant's SASS instructions (opcode and operands, one a line),
    compiled alone as NVRTC compiles it at run time."""
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp) / "variant.cu", Path(tmp) / "variant.cubin"
        source.write_text(_translation_unit([variant]))
        subprocess.run(["nvcc", "-std=c++17", "-cubin", _ARCH_FLAGS[arch], f"-I{kernel_source_dir()}", str(source),
                        "-o", str(cubin)], capture_output=True, text=True, check=True)
        tool = cuobjdump()
        # cuobjdump runs nvdisasm, which the wheels put beside it
        path = os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")])
        listing = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PATH": path}).stdout
    return [re.sub(r"\s*;.*", "", line.split("*/", 1)[1]).strip()
            for line in listing.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]


def exponentials_after_score_waits(sass: list[str]) -> list[int]:
    """For each wait for a score product alone (``WARPGROUP.DEPBAR.LE gsb0,
    0x1``: S_i, with P_{i-1} V_{i-1} still running), how many exponentials
    (``MUFU.EX2``) follow it before the next wgmma wait of any depth. The
    Hopper forward's softmax overlaps its own P V only where that count is
    the block's exponentials: ptxas hoists a wait for everything (``0x0``)
    above them when it shares their basic block (docs/perf-notes.md)."""
    counts, current = [], None
    for instruction in sass:
        if "WARPGROUP.DEPBAR.LE" in instruction:
            if current is not None:
                counts.append(current)
            current = 0 if instruction.endswith("0x1") else None
        elif current is not None and "MUFU.EX2" in instruction:
            current += 1
    return counts


_DOUBLE_PRECISION = re.compile(r"(^|\s)(DADD|DMUL|DFMA|DSETP|DMNMX|MUFU\.(RCP|RSQ)64H)\b|\bF2F\.[A-Z0-9.]*F64|\b[FI]2[FI]\.F64")


def double_precision_instructions(sass: list[str]) -> list[str]:
    """The instructions of ``sass`` on the double-precision pipe (arithmetic,
    compares, reciprocals and conversions to or from float64). The
    attention kernels have none: a float64 parameter read in a main loop is
    re-read and converted there each step (docs/perf-notes.md)."""
    return [instruction for instruction in sass if _DOUBLE_PRECISION.search(instruction)]


#: Integer ALU opcodes (per-thread registers; the uniform datapath's U*
#: opcodes are counted apart): address and index arithmetic.
_INTEGER_OPCODES = frozenset({"IMAD", "IADD3", "LOP3", "SHF", "LEA", "VIADD", "ISETP", "SEL", "IMNMX", "IABS",
                              "PRMT", "IADD", "MOV"})


def main_loop(sass: list[str]) -> list[str]:
    """The instructions of ``sass``'s main loop: of the spans from a
    conditional backward branch's target to the branch, the one holding the
    most wgmma (HGMMA), or for kernels without them the longest (an
    unconditional one is an out-of-line retry of a barrier wait jumping
    back into the loop). Instruction i sits at byte 16 i (one kernel a
    listing, as ``sass_of`` compiles it); the span keeps the code its
    skipped branches jump over (a masking block, a rare path)."""
    best, best_key = [], (0, 0)
    for index, instruction in enumerate(sass):
        match = re.search(r"^@\S+ BRA (0x[0-9a-f]+)", instruction)
        target = int(match.group(1), 16) // 16 if match else index
        if target >= index:
            continue
        span = sass[target:index + 1]
        key = (sum("HGMMA" in line for line in span), len(span))
        if key > best_key:
            best, best_key = span, key
    return best


def opcode_classes(instructions: list[str]) -> dict[str, int]:
    """How many of ``instructions`` are integer ALU work (``_INTEGER_OPCODES``),
    uniform-datapath (U*), wgmma, exponentials (MUFU) or other."""
    counts = {"integer": 0, "uniform": 0, "wgmma": 0, "mufu": 0, "other": 0}
    for instruction in instructions:
        words = instruction.split()
        opcode = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        kind = ("wgmma" if opcode == "HGMMA" else "mufu" if opcode == "MUFU" else "uniform" if opcode.startswith("U")
                else "integer" if opcode in _INTEGER_OPCODES else "other")
        counts[kind] += 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=sorted(_ARCH_FLAGS), help="default: sm_90a and sm_80")
    parser.add_argument("--only", default="", help="substring of the variant keys to report")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fail-on-spill", action="store_true",
                        help="exit 1 if a selected variant spills or has its wgmma serialised (CI: the FAST_PATH ones)")
    args = parser.parse_args()
    variants = [v for v in all_variants() if args.only in v.key]
    if not variants:
        raise SystemExit(f"no variant key contains {args.only!r}")
    rows = [row for arch in (args.arch or ["sm_90a", "sm_80"])
            for row in (compile_report(variants_for(variants, arch), arch) if variants_for(variants, arch) else [])]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'variant':58} {'arch':7} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8} {'smem':>7} "
              f"{'serial':>6}")
        for r in rows:
            print(f"{r['variant']:58} {r['arch']:7} {r['registers']:4d} {r['stack']:5d} {r['spill_stores']:8d} "
                  f"{r['spill_loads']:8d} {r['dynamic_smem']:7d} {'yes' if r['wgmma_serialized'] else '':>6}")
    spilling = [r for r in rows if max(r["spill_stores"], r["spill_loads"]) > spill_limit(r["variant"])]
    if spilling:
        print(f"{len(spilling)} variant(s) spill past their limit: "
              + ", ".join(f"{r['variant']} ({r['arch']})" for r in spilling), file=sys.stderr)
    serial = [r for r in rows if r["wgmma_serialized"]]
    if serial:
        print(f"{len(serial)} variant(s) have serialised wgmma (C7514, C7520): "
              + ", ".join(f"{r['variant']} ({r['arch']})" for r in serial), file=sys.stderr)
    return 1 if args.fail_on_spill and (spilling or serial) else 0


if __name__ == "__main__":
    sys.exit(main())
