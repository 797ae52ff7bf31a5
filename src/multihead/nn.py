"""Drop-in replacements for ``torch.nn`` classes: ``multihead.nn.MultiheadAttention``."""

from .interop.torch_mha import MultiheadAttention

__all__ = ["MultiheadAttention"]
