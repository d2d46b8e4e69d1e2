"""``cuflash.warmup`` / ``cuflash warmup``: compiling the kernels a model
will use ahead of time. CPU: what it plans and how it refuses bad input;
GPU: a later process's first call loads instead of compiling."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import cuflash
from cuflash.cli import main
from cuflash.warmup import configurations

REPO = Path(__file__).resolve().parent.parent


def test_it_plans_a_forward_per_mask_and_a_backward_per_dq_mode():
    configs = configurations(["bfloat16", "float16"], [64, 128], (False, True), True, (False,), ("ieee", "3xtf32"))
    assert len(configs) == 2 * 2 * 2 * 2
    assert {c["pass_name"] for c in configs} == {"forward", "backward"}
    fp32 = configurations(["float32"], [64], (True,), True, (False, True), ("ieee", "3xtf32"))
    # float32: a forward per precision, a backward per dQ mode
    assert sorted((c["pass_name"], c.get("fp32_precision"), c.get("deterministic")) for c in fp32) == [
        ("backward", None, False), ("backward", None, True), ("forward", "3xtf32", None), ("forward", "ieee", None)]
    assert len(configurations(["float16"], [64], (False,), False, (False,), ("ieee",))) == 1


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dtypes=["int8"]), ValueError, "dtypes must be among"),
    (dict(head_dims=[0]), ValueError, "head_dims must be integers from 1 to 256"),
    (dict(head_dims=[300]), ValueError, "head_dims must be integers from 1 to 256"),
    (dict(head_dims=[64.0]), ValueError, "head_dims must be integers"),
    (dict(causal=[]), TypeError, "causal must be a non-empty sequence of bools"),
    (dict(causal=["yes"]), TypeError, "causal must be a non-empty sequence of bools"),
    (dict(deterministic=[1]), TypeError, "deterministic must be a non-empty sequence of bools"),
    (dict(fp32_precision=["tf32"]), ValueError, "fp32_precision must be among"),
    (dict(backward="yes"), TypeError, "backward must be a bool"),
    (dict(workers=0), ValueError, "workers must be at least 1"),
])
def test_bad_arguments_are_refused_before_anything_compiles(kwargs, error, match):
    with pytest.raises(error, match=match):
        cuflash.warmup(**kwargs)


def test_cli_without_a_gpu_says_so(monkeypatch):
    import cupy

    def no_gpu():
        raise cupy.cuda.runtime.CUDARuntimeError(100)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_gpu)
    result = CliRunner().invoke(main, ["warmup"])
    assert result.exit_code != 0 and "warmup compiles for a GPU and found none" in result.output


_FIRST_CALL = textwrap.dedent("""
    import sys, time
    import cupy, cuflash
    q, k, v, dout = (cupy.random.standard_normal((2, 300, 4, 80), dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
                     for _ in range(4))
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    cupy.cuda.Device().synchronize()
    print(time.perf_counter() - start)
""")


def _first_call_seconds(cache: Path) -> float:
    env = {**os.environ, "CUPY_CACHE_DIR": str(cache), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True, check=True)
    return float(result.stdout.split()[-1])


@pytest.mark.gpu
@pytest.mark.exclusive
def test_after_warmup_a_new_process_first_call_takes_under_0_2_s(tmp_path):
    """`cuflash warmup` in one process; in the next, the first forward +
    backward of a warmed-up kind (bf16, head dim 80, causal) loads its
    kernels from the cache instead of compiling them; a process with an
    empty cache pays the compilation."""
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    env = {**os.environ, "CUPY_CACHE_DIR": str(warm), "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "cuflash", "warmup", "--dtype", "bf16", "--head-dim", "80",
                             "--mask", "causal"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kernels ready" in result.stdout and str(warm) in result.stdout
    print(f"warmup: {time.perf_counter() - start:.1f} s")
    assert _first_call_seconds(warm) < 0.2
    assert _first_call_seconds(cold) > 0.5  # what warming up saves


def test_it_plans_the_launchers_kernels_without_compiling_here(monkeypatch):
    """On a stand-in Hopper (no GPU needed): warmup asks the loader for
    exactly the kernels the launcher's plans launch: the forward per mask,
    the backward's preprocess, dK/dV (atomic, ordered, claimed and direct
    dQ) and dQ conversion."""
    from cuflash import api

    from types import SimpleNamespace

    requested = []
    compiled = SimpleNamespace(kernel=SimpleNamespace(ptr=0))  # what a plan reads of a cupy.RawKernel

    def get(variant, device):
        requested.append((variant.key, device))
        return compiled

    monkeypatch.setattr(api.loader, "get", get)
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    seen = []
    cuflash.warmup(["bfloat16"], [80], causal=[False, True], deterministic=[False, True], device=3,
                   progress=seen.append)
    keys = {key for key, _ in requested}
    assert {device for _, device in requested} == {3} and len(seen) == 2 + 2 * 2
    assert {k.split("/")[0] for k in keys} == {"forward-wgmma", "backward-preprocess", "backward-dkdv-wgmma",
                                              "backward-convert-dq"}
    dkdv = sorted(k for k in keys if k.startswith("backward-dkdv-wgmma/"))
    # A causal call with as many queries as keys stores each dQ block's first
    # tile (api.stores_first_dq); one of a single key block stores dQ itself,
    # deterministic or not (api.stores_dq_directly).
    # Head dim 80's products stop at 80 columns of the 96 (wgmma_product_dim).
    assert [k.split("/", 2)[2] for k in dkdv] == [
        "hdim96/m64n128w12/causal/q2/k80/claimed-dq", "hdim96/m64n128w12/causal/q2/k80/direct-dq",
        "hdim96/m64n128w12/causal/q2/k80/ordered-dq",
        "hdim96/m64n128w12/none/q2/k80/atomic-dq", "hdim96/m64n128w12/none/q2/k80/direct-dq",
        "hdim96/m64n128w12/none/q2/k80/ordered-dq"]
    # none and causal, each with persistent blocks (up to 8192 keys) and
    # without (past them); the forward's products stop at 80 columns too
    forward = [k for k in keys if k.startswith("forward-wgmma/bfloat16/hdim96/")]
    assert len(forward) == 4 and all(k.endswith("/k80") for k in forward)


def test_it_plans_every_forward_tile_a_call_length_can_take(monkeypatch):
    """Head dim 64's forward changes tiles with the key count (short-sequence
    tiles, persistent blocks' limits): warmup plans a call in each range, so
    a longer call than 128 keys does not compile on its first run (nor fail
    under CUDA-graph capture)."""
    import importlib
    from types import SimpleNamespace

    from cuflash import api
    from cuflash._tiling import wgmma_forward_for_call, wgmma_forward_tiling

    warmup_module = importlib.import_module("cuflash.warmup")
    requested = set()
    compiled = SimpleNamespace(kernel=SimpleNamespace(ptr=0))
    monkeypatch.setattr(api.loader, "get", lambda variant, device: requested.add(variant.key) or compiled)
    monkeypatch.setattr(api, "_kernel_generation", lambda device: 90)
    monkeypatch.setattr(api, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(api, "_shared_memory_per_block", lambda device: 227 * 1024)
    cuflash.warmup(["bfloat16"], [64], causal=[False, True], backward=False, device=0)
    forwards = {key for key in requested if key.startswith("forward-wgmma/")}
    table = wgmma_forward_tiling("bfloat16", 64)
    expected = set()
    for causal in (False, True):
        for keys in (1, 600, 1024, 1500, 2048, 3000, 8192, 9000, 100000):
            tiling = wgmma_forward_for_call(table, "bfloat16", 64, "causal" if causal else "none", "dense", False,
                                            keys)
            tile = (f"/m{tiling.block_m}n{tiling.block_n}w{tiling.warps}/{'causal' if causal else 'none'}/"
                    f"b{tiling.blocks_per_sm}/s{tiling.kv_stages}" + ("/persistent" if tiling.persistent else ""))
            expected.add(f"forward-wgmma/bfloat16/hdim64{tile}")
    assert forwards == expected and len(expected) == 8, sorted(forwards ^ expected)
    assert warmup_module.forward_key_counts()[0] == 128
