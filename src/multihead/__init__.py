"""multihead: multi-head attention for PyTorch, correct on every backend and honest about
what each head does.

Example:
    >>> import torch, multihead as mh
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> mh.attention(q, k, v, mask=mh.masks.causal()).shape
    torch.Size([1, 2, 4, 8])
"""

from . import _cpu_math, masks
from .functional import attention, backends, explain, profiles
from .modules import KVCache, MultiHeadAttention, PagedKVCache, RotaryEmbedding
from .modules.loading import load_state_dict
from . import interop, nn  # noqa: E402  (interop uses the public API above)

_cpu_math.settle()           # before any parallel math: see multihead/_cpu_math.py

__version__ = "0.1.0"

__all__ = ["attention", "explain", "backends", "profiles", "masks", "MultiHeadAttention", "RotaryEmbedding",
           "KVCache", "PagedKVCache", "load_state_dict",
           "interop", "nn", "__version__"]
