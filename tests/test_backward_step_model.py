"""tools/backward_step_model.py: the Hopper backward step's tensor and
shared-memory cost against what ncu and the builds measured (CPU only)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import backward_step_model as model  # noqa: E402
from cuflash._tiling import MAX_SMEM_BYTES, WGMMA_BACKWARD_TILES, wgmma_backward_tiling  # noqa: E402


def test_head_dim_128_step_matches_the_profile():
    """ncu on the d128 dK/dV kernel (64 x 128, full 4k, H200): 398.7 M LSU
    shared wavefronts over 2048 blocks of 64 steps, 3042 a step, and 198.73
    KiB of dynamic shared memory a block, to which the claimed mode's store
    warp later added an mbarrier and an 8-byte slot, and the direct mode's
    delta warps an mbarrier a stage."""
    step = model.BackwardStep(128, 64)
    assert step.tensor_cycles() == 2560
    assert step.shared_cycles() == pytest.approx(398_741_266 / (2048 * 64), rel=0.02)
    assert step.shared_memory_bytes() == 198_728 + 16 + 2 * 8
    operands = step.operand_bytes()
    assert operands["S^T"] == operands["dP^T"] == operands["dQ"] == 2 * operands["dV"] == 64 * 1024


def test_dq_by_turns_reads_a_quarter_less_for_dq():
    """The kernel's form at head dim 128 (2c40d98): one m64n128 product of
    dQ a step, by one consumer, reads dS once (A) and K's 128 columns (B)
    where the split form's two m64n64 read dS twice: 48 KB instead of 64, the
    other products and traffic alike."""
    split, turns = model.BackwardStep(128, 64), model.BackwardStep(128, 64, dq_by_turns=True)
    assert turns.operand_bytes()["dQ"] == 48 * 1024
    assert split.shared_cycles() - turns.shared_cycles() == 16 * 1024 / model.SHARED_BYTES_PER_CYCLE
    assert turns.tensor_cycles() == split.tensor_cycles()


def test_the_tables_tiles_fit_and_the_rejected_ones_do_not():
    for head_dim in (64, 128):
        tiling = wgmma_backward_tiling("bfloat16", head_dim)
        step = model.BackwardStep(head_dim, tiling.block_m, tiling.block_n)
        assert step.accumulator_registers() <= model.ACCUMULATOR_REGISTERS
        assert step.shared_memory_bytes() == tiling.backward_dkdv_smem_bytes("bfloat16") <= MAX_SMEM_BYTES
    # 80 rows with dQ transposed: fewer shared bytes per FLOP, but beyond the
    # accumulator bound (it spilled 16 bytes) and 680 bytes short of the
    # limit then (664 since the direct mode's barriers).
    eighty = model.BackwardStep(128, 80, dq_transposed=True)
    table = model.BackwardStep(128, *WGMMA_BACKWARD_TILES[128][:2])
    assert eighty.shared_cycles() / eighty.tensor_cycles() < table.shared_cycles() / table.tensor_cycles()
    assert eighty.accumulator_registers() > model.ACCUMULATOR_REGISTERS
    assert MAX_SMEM_BYTES - eighty.shared_memory_bytes() == 680 - 2 * 8
    wide = model.BackwardStep(128, 128)
    assert wide.accumulator_registers() > model.ACCUMULATOR_REGISTERS
    assert wide.shared_memory_bytes() > MAX_SMEM_BYTES


def test_the_table_prints(capsys):
    assert model.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == len(model.CANDIDATES) + 2 and "(> 192)" in out
