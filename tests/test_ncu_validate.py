"""tools/ncu_validate.py without a GPU: how profiled kernels are matched to
the predictions (a drain kernel before each shape and after each pass,
whose DRAM writes are the pass's write-back), and that the table in
docs/io-validation.md is the rendering of the stored run."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import ncu_validate  # noqa: E402


def _kernel(name, dram_read=0.0, dram_write=0.0, l2=0.0, l1=0.0):
    return {"kernel": name, "l1_ld": l1, "l1_st": 0.0, "l1_red": 0.0, "l2_read": l2, "l2_write": 0.0,
            "l2_red": 0.0, "dram_read": dram_read, "dram_write": dram_write}


def _predicted(shape="b1 h1/1 n8 d8"):
    common = {"shape": shape, "beyond_l2": False, "predicted_requested": 64, "predicted_dram": 300,
              "predicted_dram_read": 200, "predicted_dram_write": 100}
    return [{**common, "pass": "fwd"}, {**common, "pass": "bwd"}]


def _profiled():
    drain = ncu_validate.DRAIN_KERNEL
    return [_kernel(drain, dram_read=9e9, dram_write=7.0),  # the inputs' write-back: nobody's
            _kernel("void flash_forward_wgmma_kernel", dram_read=150, dram_write=20, l2=2, l1=2),
            _kernel(drain, dram_read=9e9, dram_write=60),
            _kernel("void flash_bwd_preprocess", dram_read=10, dram_write=1, l2=1, l1=1),
            _kernel("void flash_backward_dkdv_wgmma_kernel", dram_read=100, dram_write=30, l2=1, l1=1),
            _kernel("void flash_bwd_convert_dq", dram_read=40, dram_write=9, l2=0, l1=0),
            _kernel(drain, dram_read=9e9, dram_write=50)]


def test_each_pass_takes_its_kernels_and_the_next_drains_write_back():
    fwd, bwd = ncu_validate.compare(_predicted(), _profiled())
    assert fwd["measured_dram_read"] == 150 and fwd["measured_dram_write"] == 20 and fwd["measured_write_back"] == 60
    assert fwd["dram_write_over_predicted"] == pytest.approx(0.8) and fwd["dram_read_over_predicted"] == 0.75
    assert fwd["measured_l2_requested"] == 64 and fwd["l2_over_predicted"] == 1.0
    assert bwd["kernels"] == ["void flash_bwd_preprocess", "void flash_backward_dkdv_wgmma_kernel",
                              "void flash_bwd_convert_dq"]
    assert bwd["measured_dram_read"] == 150 and bwd["measured_dram_write"] == 40 and bwd["measured_write_back"] == 50
    assert bwd["measured_dram"] == 240  # the drains' own reads are nobody's


def test_a_missing_drain_or_kernel_is_an_error():
    profiled = _profiled()
    with pytest.raises(SystemExit, match="unexpected kernels"):
        ncu_validate.compare(_predicted(), profiled[1:])  # no drain before the forward
    with pytest.raises(SystemExit, match="unexpected kernels"):
        ncu_validate.compare(_predicted(), profiled[:4] + profiled[5:])  # a backward kernel missing
    with pytest.raises(SystemExit, match="expected 7 profiled kernels, got 8"):
        ncu_validate.compare(_predicted(), profiled + [profiled[0]])


def test_the_doc_holds_the_stored_runs_table():
    result = json.loads((REPO / "docs" / "ncu_validation_h100.json").read_text())
    table = ncu_validate.markdown(result)
    assert table in (REPO / "docs" / "io-validation.md").read_text()
    beyond = [row for row in result["rows"] if row["beyond_l2"]]
    assert len({row["shape"] for row in beyond}) >= 2
    assert all(row["measured_dram_read"] > 0 and row["measured_dram_write"] + row["measured_write_back"] > 0
               for row in beyond)
