"""torch's cuDNN SDPA kernel, where it costs or breaks what its peers do not.

On Hopper GPUs torch (2.5 on) runs ``F.scaled_dot_product_attention`` on cuDNN's kernel first
for fp16 and bf16. Two of its ways matter to us:

- **It builds an execution graph for each new shape.** A decoding loop's cache grows by a
  key every step, so every step built one: on an H100 (torch 2.11, bf16) a Llama layer's
  decoding step on a :class:`multihead.KVCache` took 50.6 ms through SDPA, Hugging Face's
  own SDPA layer 50.3 ms, its eager layer 1.1 ms (``python -m benchmarks.module_decode
  --device cuda --dtype bf16``). A call of a decoding step's size
  (:func:`skips_cudnn`) therefore runs with cuDNN's kernel switched off, on torch's flash
  or memory-efficient kernel, whose launch needs no graph; larger calls keep it (its
  forward ran 1.7-2x faster than flash's on prompts of 4k-16k).
- **Its backward takes no undefined output gradient.** In a backward that builds a graph,
  :mod:`multihead._second_order` gives the kernel's node none (the reference's gradients
  go to q, k, v instead); flash's and the efficient kernel's nodes then compute nothing,
  cuDNN's computes from memory nothing wrote (NaN came out) and returns gradients whose
  own derivative torch does not implement. :func:`mute_in_second_order` keeps that node
  out of such a backward.
"""

from __future__ import annotations

import torch

from ..._tracing import tracing

#: queries at most this many (the decode kernel's, :data:`multihead.kernels.decode.MAX_QUERIES`)
#: make a call of a decoding step's size, whose key length is new every step
DECODE_QUERIES = 16

_enabled, _switch = torch._C._get_cudnn_sdp_enabled, torch._C._set_sdp_use_cudnn
_flash, _efficient = torch._C._get_flash_sdp_enabled, torch._C._get_mem_efficient_sdp_enabled


def cudnn_switchable() -> bool:
    """Whether cuDNN's kernel is on and another fused kernel would take its place (a user
    who switched cuDNN off, or pinned SDPA to it with ``torch.nn.attention.sdpa_kernel``,
    keeps that).

    Example:
        >>> cudnn_switchable()
        True
    """
    return _enabled() and (_flash() or _efficient())


def skips_cudnn(device_type: str, Sq) -> bool:
    """Whether SDPA's call of ``Sq`` queries on a ``device_type`` device (the inputs', or
    the profile's that a plan is priced for) runs with cuDNN's kernel switched off: a
    decoding step's size on CUDA, where :func:`cudnn_switchable`. Never while a graph is
    traced (the compiler picks the kernel; a symbolic ``Sq`` is not compared).

    Example:
        >>> skips_cudnn("cpu", 1), skips_cudnn("cuda", 17)  # no cuDNN kernel; a prompt's size
        (False, False)
    """
    return device_type == "cuda" and not tracing() and Sq <= DECODE_QUERIES and \
        cudnn_switchable()


def run_without_cudnn(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with SDPA's cuDNN kernel switched off, and on again after,
    unless the switch was changed meanwhile (torch's switch is process-wide: a thread
    calling SDPA at the same time may miss cuDNN for that call, its speed, not its result;
    one that saves and restores the switch around our call, as ``sdpa_kernel`` does, may
    restore it off).

    Example:
        >>> import torch.nn.functional as F
        >>> q = torch.randn(1, 2, 1, 8)
        >>> out = run_without_cudnn(F.scaled_dot_product_attention, q, q, q)
        >>> out.shape, torch.backends.cuda.cudnn_sdp_enabled()
        (torch.Size([1, 2, 1, 8]), True)
    """
    _switch(False)
    try:
        return fn(*args, **kwargs)
    finally:
        if not _enabled():
            _switch(True)


def mute_in_second_order(call, out: torch.Tensor) -> None:
    """Keep ``out``'s node, where torch's cuDNN SDPA kernel made ``out``, out of a backward
    that builds a graph (grad mode on inside it): what it returns there is dropped. A plain
    backward runs it as torch does. Only where
    :func:`multihead._second_order.differentiable_again`'s node gives q, k, v their
    gradients in such a backward (:func:`multihead._second_order.wanted`).

    Example:
        >>> from types import SimpleNamespace
        >>> x = torch.randn(3, requires_grad=True)
        >>> mute_in_second_order(SimpleNamespace(q=x), x * 2)   # no cuDNN node: no hook
    """
    if out.is_cuda and out.requires_grad:
        _mute(call, out.grad_fn)


def _mute(call, node) -> None:
    """:func:`mute_in_second_order` on the node, where it is cuDNN's."""
    if node is None or "CudnnAttention" not in type(node).__name__:
        return
    from ..._second_order import wanted
    if wanted(call):
        node.register_hook(_dropped)


def _dropped(results, grads):
    """The node's post-hook: nothing of what it computed in a backward that builds a graph
    (torch lets no hook give it the output gradient it lacks: it computes from an undefined
    one, and what it returns goes nowhere)."""
    return tuple(None for _ in results) if torch.is_grad_enabled() else None
