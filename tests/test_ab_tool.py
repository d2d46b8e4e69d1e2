"""tools/ab.py without a GPU: its arguments, the worker's command line and
the summary of rounds."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import ab  # noqa: E402


def test_points_parse_and_bad_ones_are_named():
    assert ab.parse_point("112:causal:512") == ab.Point(112, True, 512)
    assert ab.parse_point("40:none:4096").name == "d40 full 4096"
    for bad in ("112:window:512", "112:causal", "x:none:512", "0:none:512", "64:none:32768"):
        with pytest.raises(ValueError, match=repr(bad)):
            ab.parse_point(bad)


def test_modes_need_a_tree_with_cuflash(tmp_path):
    (tmp_path / "cuflash").mkdir()
    (tmp_path / "cuflash" / "__init__.py").write_text("")
    assert ab.parse_mode(f"old={tmp_path}") == ("old", tmp_path.resolve())
    with pytest.raises(ValueError, match="holds no cuflash"):
        ab.parse_mode(f"old={tmp_path / 'cuflash'}")
    with pytest.raises(ValueError, match="NAME=DIR"):
        ab.parse_mode("old")


def test_patches_name_mode_target_and_expression():
    assert ab.parse_patch("padded:cuflash._tiling.wgmma_product_dim=lambda head_dim, padded: 0") == (
        "padded", "cuflash._tiling", "wgmma_product_dim", "lambda head_dim, padded: 0")
    for bad in ("padded:wgmma_product_dim=0", "cuflash._tiling.x=0", "padded:cuflash._tiling.x="):
        with pytest.raises(ValueError, match="MODE:MODULE.ATTR=EXPRESSION"):
            ab.parse_patch(bad)


def test_a_worker_runs_this_file_with_the_mode_its_points_and_patches():
    command = ab.worker_command("new", ["128:none:4096", "64:causal:512"], ["fwd", "bwd"], "float16",
                                ["new:cuflash.x.y=1"])
    assert command[1] == str(REPO / "tools" / "ab.py")
    assert command[2:] == ["--worker", "new", "--dtype", "float16", "--points", "128:none:4096 64:causal:512",
                           "--pass", "fwd", "--pass", "bwd", "--patch", "new:cuflash.x.y=1"]


def test_the_deterministic_backward_is_a_pass_of_its_own():
    command = ab.worker_command("new", ["128:none:4096"], ["bwd-deterministic"], "bfloat16", [])
    assert command[-2:] == ["--pass", "bwd-deterministic"]
    assert [ab.timed_backend(name) for name in ab.PASSES] == ["cuflash", "cuflash", "cuflash-deterministic"]
    with pytest.raises(SystemExit):
        ab.main(["--points", "128:none:4096", "--pass", "bwd-ordered", "--mode", "a=.", "--mode", "b=."])


def test_the_summary_takes_each_modes_best_round_and_compares_last_with_first():
    rows = [
        {"mode": "old", "point": "d128 full 4096", "pass": "fwd", "cuflash": 0.70, "cudnn": 0.81},
        {"mode": "new", "point": "d128 full 4096", "pass": "fwd", "cuflash": 0.66, "cudnn": 0.80},
        {"mode": "old", "point": "d128 full 4096", "pass": "fwd", "cuflash": 0.68, "cudnn": 0.79},
        {"mode": "new", "point": "d128 full 4096", "pass": "fwd", "cuflash": 0.67, "cudnn": None},
    ]
    lines = ab.summary(rows, ["old", "new"])
    assert lines[0] == "| point | pass | old | new | new vs old |"
    assert lines[2] == "| d128 full 4096 | fwd | 0.680 (1.162) | 0.660 (1.212) | -2.9% |"


def test_main_refuses_one_mode_and_patches_of_unknown_modes(tmp_path, capsys):
    (tmp_path / "cuflash").mkdir()
    (tmp_path / "cuflash" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        ab.main(["--mode", f"a={tmp_path}", "--points", "64:none:512"])
    assert "two or more modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--mode", f"a={tmp_path}", "--mode", f"b={tmp_path}", "--points", "64:none:512",
                 "--patch", "c:cuflash.x.y=1"])
    assert "not given: ['c']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--mode", f"a={tmp_path}", "--mode", f"b={tmp_path}", "--points", "64:sliding:512"])
    assert "HEAD_DIM:MASK:SEQLEN" in capsys.readouterr().err


def _fake_tree(root: Path, marker: str) -> Path:
    (root / "cuflash").mkdir(parents=True)
    (root / "cuflash" / "__init__.py").write_text(f"MARKER = {marker!r}\n")
    return root


def test_a_workers_cuflash_is_its_trees_even_after_bench_is_imported(tmp_path):
    """tools/bench.py puts this checkout first on sys.path when imported: a
    worker that imported it before its tree's cuflash ran this checkout's
    code in every mode (the A/Bs of tree modes then measured one build)."""
    import subprocess

    tree = _fake_tree(tmp_path / "old", "old tree")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import ab; from pathlib import Path; "
              "ab.import_tree_cuflash(Path(sys.argv[2])); import bench, cuflash; print(cuflash.MARKER)")
    result = subprocess.run([sys.executable, "-c", script, str(REPO / "tools"), str(tree)],
                            cwd=tree, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "old tree"


def test_a_worker_refuses_a_cuflash_from_elsewhere(tmp_path):
    import subprocess

    first, second = _fake_tree(tmp_path / "a", "a"), _fake_tree(tmp_path / "b", "b")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import ab; from pathlib import Path; "
              "ab.import_tree_cuflash(Path(sys.argv[2])); ab.import_tree_cuflash(Path(sys.argv[3]))")
    result = subprocess.run([sys.executable, "-c", script, str(REPO / "tools"), str(first), str(second)],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert f"the mode's tree is {second.resolve()}, but cuflash was imported from {first.resolve()}" in result.stderr
