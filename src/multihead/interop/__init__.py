"""Interop with code we did not write: ``torch.nn.MultiheadAttention`` (and its conventions)."""

from .torch_mha import MultiheadAttention, from_torch, to_torch

__all__ = ["from_torch", "to_torch", "MultiheadAttention"]
