"""cuflash: exact FlashAttention for any Python GPU framework.

CUDA C++ kernels compiled at run time by CuPy (NVRTC); CuPy arrays, PyTorch
tensors, JAX arrays and any DLPack producer in, arrays of the same kind out.
"""

from ._cuda import CudaSetupError
from .api import (attention, attention_backward, attention_varlen, attention_varlen_backward, attention_with_kvcache,
                  merge_attention_states)
from .block_mask import BlockMask, block_mask
from .dropout import dropout_mask
from .warmup import warmup

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "attention_with_kvcache",
           "merge_attention_states", "dropout_mask", "block_mask", "BlockMask",
           "warmup", "CudaSetupError", "__version__"]
