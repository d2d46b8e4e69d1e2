"""IO-cost simulator of attention algorithms: bytes moved between HBM and
the chip, FLOPs, and a roofline estimate. Pure Python; no GPU needed.

>>> from cuflash.simulate import Problem, MACHINES, run
>>> t = run("flash2", Problem(batch=1, nheads=1, seqlen_q=256, head_dim=64), MACHINES["a100"], "fwd",
...         block_m=64, block_n=64)
>>> t.total("requested")
328704
"""

from .algorithms import ALGORITHMS, NONMATMUL, PASSES, key_sweep, query_sweep, roofline_seconds, run
from .machines import MACHINES, Machine
from .report import explain, format_csv, format_table, summarize
from .traffic import Problem, Traffic

__all__ = ["ALGORITHMS", "MACHINES", "NONMATMUL", "PASSES", "Machine", "Problem", "Traffic", "explain",
           "format_csv", "format_table", "key_sweep", "query_sweep", "roofline_seconds", "run", "summarize"]
