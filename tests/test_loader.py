"""Kernel loader: source discovery, the cache key (CPU), and compilation,
memoisation and thread safety (GPU)."""

import shutil
import threading

import pytest

from cuflash._kernel_families import FAMILY
from cuflash._loader import KernelLoader, compile_options, kernel_source_dir, source_hash
from cuflash._masks import MASKS
from cuflash._tiling import forward_tiling


def test_sources_are_found():
    source_dir = kernel_source_dir()
    assert (source_dir / "flash_fwd.cu").is_file()
    assert (source_dir / "online_softmax.cuh").is_file()


@pytest.mark.parametrize("changed", ["online_softmax.cuh", "masks.cuh", "flash_fwd.cu", "params.cuh"])
def test_cache_key_changes_when_any_source_file_changes(tmp_path, changed):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(kernel_source_dir(), copy)
    before = compile_options(copy, "90", (13, 0))
    path = copy / changed
    path.write_text(path.read_text() + "\n// edited\n")
    after = compile_options(copy, "90", (13, 0))
    assert before != after
    assert source_hash(copy) in " ".join(after)


def test_cache_key_changes_when_a_header_is_added(tmp_path):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(kernel_source_dir(), copy)
    before = source_hash(copy)
    (copy / "new_header.cuh").write_text("#pragma once\n")
    assert source_hash(copy) != before


def test_cache_key_is_stable_for_unchanged_sources(tmp_path):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(kernel_source_dir(), copy)
    assert source_hash(copy) == source_hash(kernel_source_dir())


def test_hopper_gets_sm90a_only_with_a_recent_nvrtc():
    source_dir = kernel_source_dir()
    assert "-arch=sm_90a" in compile_options(source_dir, "90", (13, 0))
    assert "-arch=sm_90a" in compile_options(source_dir, "90", (12, 9))
    assert "-arch=sm_90a" not in compile_options(source_dir, "90", (12, 8))
    assert not any(o.startswith("-arch") for o in compile_options(source_dir, "80", (13, 0)))


def test_variant_name_expression_and_key_are_readable():
    variant = FAMILY["forward"].variant("bfloat16", forward_tiling("bfloat16", 100), MASKS["causal"])
    assert variant.name_expression == ("cuflash::flash_forward_kernel<__nv_bfloat16, 128, 32, 64, 4, "
                                       "cuflash::CausalMask, cuflash::IdentityScore, cuflash::DenseBatch>")
    assert variant.key == "forward/bfloat16/hdim128/m32n64w4/causal"
    other = FAMILY["forward"].variant("bfloat16", forward_tiling("bfloat16", 100), MASKS["none"])
    assert other.key == "forward/bfloat16/hdim128/m32n64w4/none"


@pytest.mark.gpu
def test_loader_builds_once_per_variant_and_device_across_threads():
    import cupy

    loader = KernelLoader()
    variant = FAMILY["forward"].variant("float16", forward_tiling("float16", 64), MASKS["none"])
    results = []
    threads = [threading.Thread(target=lambda: results.append(loader.get(variant, 0))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert loader.get(variant, 0) is results[0]
    assert isinstance(results[0], cupy.RawKernel)


@pytest.mark.gpu
def test_loader_raises_the_shared_memory_limit_for_large_tiles():
    variant = FAMILY["forward"].variant("float32", forward_tiling("float32", 256), MASKS["causal"])
    assert variant.smem_bytes > 48 * 1024
    kernel = KernelLoader().get(variant, 0)
    assert kernel.max_dynamic_shared_size_bytes >= variant.smem_bytes
