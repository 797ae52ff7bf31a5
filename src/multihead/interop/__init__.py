"""Interop with code we did not write.

- ``torch.nn.MultiheadAttention`` and its conventions: :mod:`.torch_mha` (imported here).
- Hugging Face ``transformers``: ``import multihead.interop.hf`` registers
  ``attn_implementation="multihead"`` (:mod:`.hf`, :mod:`.hf_masks`); it is not imported
  here, so ``import multihead`` never imports ``transformers``.
"""

from .torch_mha import MultiheadAttention, from_torch, to_torch

__all__ = ["from_torch", "to_torch", "MultiheadAttention"]
