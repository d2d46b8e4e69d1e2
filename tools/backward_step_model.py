"""Tensor-core and shared-memory cost of one step of the Hopper backward.

One step of flash_bwd_wgmma.cu: a thread block holding `block_n` keys (64 a
consumer warpgroup, head dims up to 128) takes one query block of
`block_m` rows: S^T = K Q^T and dP^T = V dO^T (both operands in shared
memory), dV += P^T dO and dK += dS^T Q (A from registers), dQ = dS K (both
operands in shared memory: each consumer its share of the columns, or,
`dq_by_turns`, one consumer the whole tile, the two taking steps in turn,
as the kernel does at head dims 96 and 128 since 2c40d98; or,
`dq_transposed`, dQ^T = K^T dS^T, as the 80-row experiment had it), dS^T
staged by stmatrix, the float32 dQ tile
stored and read back by the copy engine. This model counts, per step,
the tensor cycles, the bytes the wgmma instructions read from shared
memory, the other shared-memory traffic, and the accumulator registers a
consumer thread needs, so that a decomposition can be judged before it
is built (docs/perf-notes.md, "Head dim 128's backward: four schedules").

What it was checked against (ncu, d128, 64 x 128, dQ's columns split, H200): 3042 LSU
shared wavefronts a step measured, 3072 modelled, counting the wgmma
operand reads, the dQ tile's bulk read and the LSU's own loads and stores
(an inference from the totals: ncu does not document which of the async
units it counts there); the step took 4492 cycles with shared memory at
71% of its throughput, which is this model's 3072 wavefronts at 68%.

    python tools/backward_step_model.py            # the candidates' table
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuflash._tiling import ELEMENT_SIZE, MAX_SMEM_BYTES, Tiling  # noqa: E402

#: Dense 16-bit tensor-core FLOPs an SM retires a cycle on Hopper (m64n256k16 in 128 cycles).
TENSOR_FLOPS_PER_CYCLE = 4096
#: Bytes of shared memory an SM reads or writes a cycle: one 128-byte wavefront.
SHARED_BYTES_PER_CYCLE = 128
#: Accumulator floats a consumer thread may hold beside its addressing
#: (WgmmaBackwardTraits' static_assert: dK, dV, S^T and dP^T within 192).
ACCUMULATOR_REGISTERS = 192
#: The model's inputs are 16-bit, as the Hopper kernels' are.
ELEMENT_BYTES = ELEMENT_SIZE["bfloat16"]


@dataclasses.dataclass(frozen=True)
class BackwardStep:
    """One step of the key-split Hopper backward (head dim <= 128)."""

    head_dim: int
    block_m: int
    block_n: int = 128
    dq_transposed: bool = False
    dq_by_turns: bool = False

    @property
    def consumers(self) -> int:
        return self.block_n // 64

    def tensor_cycles(self) -> float:
        """Five products of 2 block_m block_n head_dim FLOPs each."""
        return 10 * self.block_m * self.block_n * self.head_dim / TENSOR_FLOPS_PER_CYCLE

    def operand_bytes(self) -> dict[str, int]:
        """Bytes the step's wgmma read from shared memory, by product: per
        k16 step an m64 A is 64 x 16 elements, a B of n columns n x 16."""
        d, m, n, c = self.head_dim, self.block_m, self.block_n, self.consumers
        a_tile = 64 * 16 * ELEMENT_BYTES

        def b_tile(cols):
            return cols * 16 * ELEMENT_BYTES

        scores = c * (d // 16) * (a_tile + b_tile(m))  # S^T or dP^T: K (V) rows as A, Q (dO) as B
        accumulate = c * (m // 16) * b_tile(d)  # dV or dK: A in registers, dO (Q) as B
        if self.dq_transposed:
            dq = c * (n // 16) * (a_tile + b_tile(m))  # dQ^T: K^T columns as A, dS^T as B
        else:
            m_tiles = m // 64
            cols = d if self.dq_by_turns else d * m_tiles // c  # the columns one product covers
            dq = m_tiles * (d // cols) * (n // 16) * (a_tile + b_tile(cols))  # dQ: dS as A, K as B
        return {"S^T": scores, "dP^T": scores, "dV": accumulate, "dK": accumulate, "dQ": dq}

    def other_shared_bytes(self) -> dict[str, int]:
        """The rest of the step's shared-memory traffic the LSU or the copy
        engine's reads account for: dS^T staged, the dQ tile's float32
        stores (two-way bank conflicts in the untransposed layout, counted
        twice) and its bulk read, the rows' LSE and delta (float2 loads of
        four distinct addresses a warp: a wavefront each)."""
        d, m, n = self.head_dim, self.block_m, self.block_n
        conflicts = 1 if self.dq_transposed else 2
        statistics = self.consumers * 4 * (m // 8) * 2 * SHARED_BYTES_PER_CYCLE
        return {"dS^T staged": n * m * ELEMENT_BYTES, "dQ tile stored": conflicts * m * d * 4,
                "dQ tile read": m * d * 4, "LSE and delta": statistics}

    def shared_cycles(self) -> float:
        total = sum(self.operand_bytes().values()) + sum(self.other_shared_bytes().values())
        return total / SHARED_BYTES_PER_CYCLE

    def accumulator_registers(self) -> int:
        """Floats a consumer thread holds in its element-wise phase: dK and
        dV (head_dim / 2 each), S^T and dP^T (block_m / 2 each)."""
        return self.head_dim + self.block_m

    def shared_memory_bytes(self) -> int:
        tiling = Tiling(head_dim_padded=self.head_dim, block_m=self.block_m, block_n=self.block_n,
                        warps=4 * (self.consumers + 1), kernel="wgmma", q_stages=2)
        return tiling.backward_dkdv_smem_bytes("bfloat16")


#: Decompositions measured or considered (docs/perf-notes.md).
CANDIDATES = (
    ("d64, 128 rows (the table's)", BackwardStep(64, 128)),
    ("d128, 64 rows, dQ's columns split (profiled)", BackwardStep(128, 64)),
    ("d128, 64 rows, dQ by turns (the kernel's)", BackwardStep(128, 64, dq_by_turns=True)),
    ("d128, 80 rows, dQ^T (measured slower)", BackwardStep(128, 80, dq_transposed=True)),
    ("d128, 128 rows", BackwardStep(128, 128)),
)


def table(candidates=CANDIDATES) -> str:
    rows = ["| step | tensor cycles | shared cycles | shared / tensor | accumulators | shared memory |",
            "|---|---|---|---|---|---|"]
    for name, step in candidates:
        registers = step.accumulator_registers()
        smem = step.shared_memory_bytes()
        over_registers = "" if registers <= ACCUMULATOR_REGISTERS else f" (> {ACCUMULATOR_REGISTERS})"
        over_smem = "" if smem <= MAX_SMEM_BYTES else f" (> {MAX_SMEM_BYTES / 1024:.0f})"
        rows.append(f"| {name} | {step.tensor_cycles():.0f} | {step.shared_cycles():.0f} | "
                    f"{step.shared_cycles() / step.tensor_cycles():.2f} | {registers}{over_registers} | "
                    f"{smem / 1024:.1f} KiB{over_smem} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
