"""Second-order gradients on every backend: a backward that builds a graph
(``create_graph=True``: double backward, a gradient penalty, a hessian-vector product,
MAML's inner step) gets gradients it can differentiate again.

The ``reference`` backend computes attention with differentiable torch ops, so its
gradients differentiate as they are. The fused backends do not: torch's SDPA kernels have
no double backward (``derivative for aten::_scaled_dot_product_..._backward is not
implemented``), and neither have our own kernels' backwards. In a backward that builds a
graph, they give q, k, v (and any bias tensor) the gradients the reference backend's
differentiable ops give on the forward's own inputs (:func:`reference_gradients`), two ways:

- our own autograd Functions (``blocksparse``; ``triton``'s eager kernels, given a
  :func:`spec`) do it in their backward, which otherwise runs the kernels: no extra node,
  so a training step pays no host time for it (capability ``second_order``);
- torch's fused kernels (``sdpa``, ``varlen``) cannot, so :func:`attention` passes their
  outputs through :func:`differentiable_again`, a node that does nothing in a plain
  backward (the gradients flow on to the kernel's own backward, at the kernel's speed)
  and, in one that builds a graph, gives the reference's gradients while the kernel's
  backward receives none (so nothing it computes enters the new graph).

That backward costs what the reference costs: ``(Sq, Sk)`` weights per head.

Where it does not run:
- dropout: the fused kernel's random mask cannot be replayed, so the outputs are not
  wrapped: a backward that builds a graph gets the kernel's gradients, which serve where
  they are not differentiated again (a hessian-vector product of the layers after
  attention) and give torch's error where they are (its fused kernels; on a CPU, torch
  runs dropout through its composite math operator, whose gradients do differentiate
  again; ``backend="reference"`` draws its dropout with torch ops, and differentiates its
  gradients);
- ``torch.compile``, which does not differentiate a backward again itself (torch's error),
  and ``torch.func`` transforms, whose wrapped tensors no autograd Function of this kind
  takes: there the outputs are not wrapped. Reverse over reverse inside ``torch.func``
  (``grad(grad(f))``) is met by the capabilities instead (``second_order``, and
  ``transforms`` for our Functions), which keep ``auto`` on the reference there; a Triton
  backward asked to build a graph without a :func:`spec` (``multihead.kernels.ops`` called
  directly, or a graph ``torch.compile`` built) raises :func:`refuse_second_order`'s error
  at once.

The node's cost: a Python autograd node per call that records gradients (about 14 us of
host time on a 2-core Xeon, ``python -m benchmarks.dispatch --overhead``; 33 us of a
training step's 204 on the Triton kernels' stubbed launches, ``benchmarks.triton_host``,
before they did it in their own backward); none without them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._dtypes import without_autocast


def refuse_second_order(backend: str) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode is on inside it).

    Example:
        >>> import torch
        >>> with torch.no_grad():                   # as in a plain backward
        ...     refuse_second_order("triton")
    """
    if torch.is_grad_enabled():
        raise RuntimeError(second_order_message(backend, "a backward with create_graph=True"))


def second_order_message(backend: str, what: str) -> str:
    """The error's text: what was asked, and the backend that gives it."""
    return (f"the {backend} backend's gradients are first-order only, and {what} (double "
            f"backward, a gradient penalty through attention, hessian) differentiates them "
            f"again: pass backend='reference' to multihead.attention (or set "
            f"multihead.MultiHeadAttention's backend), whose gradients are differentiable")


def wanted(call) -> bool:
    """Whether :func:`differentiable_again` should wrap the outputs of ``call`` (an
    :class:`~multihead.functional._call.AttentionCall`): gradients are recorded, without
    dropout, and neither ``torch.compile`` nor a ``torch.func`` transform is running."""
    return (call.requires_grad and not call.dropout_p
            and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active())


def differentiable_again(call, backend: str, outputs: tuple) -> tuple:
    """The outputs ``(out, weights or None, lse or None)`` of ``backend`` on ``call``,
    passed through a node whose backward, when it builds a graph, gives the reference's
    differentiable gradients (see the module's docstring); a plain backward goes on to the
    backend's own. Each output returned shares the memory of the one given.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
        >>> out = mh.attention(q, q, q, backend="sdpa")      # wrapped by attention itself
        >>> g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        >>> g.requires_grad                                  # differentiable again
        True
    """
    _, w, lse = outputs
    m = call.effective_mask
    # learned biases, each once (the mask's other tensors take no gradient)
    biases = () if m is None else tuple({id(t): t for t in m._tensors()
                                         if t.requires_grad}.values())
    spec = _Spec(m, call.scale, backend, w is not None, lse is not None,
                 None if m is None else m._versions())
    given = tuple(t for t in outputs if t is not None)
    it = iter(_Again.apply(spec, *given, call.q, call.k, call.v, *biases))
    return tuple(None if t is None else next(it) for t in outputs)


def spec(mask, scale: float, backend: str, versions=None) -> "_Spec":
    """What a backend's own autograd Function keeps to give :func:`reference_gradients`
    in a backward that builds a graph, for its outputs ``(out, lse)``: the mask (its
    tensors' ``versions`` as the forward read them; default: read now) and the scale.

    Example:
        >>> import multihead as mh
        >>> spec(mh.masks.causal(), 0.125, "triton").lse
        True
    """
    if versions is None and mask is not None:
        versions = mask._versions()
    return _Spec(mask, scale, backend, False, True, versions)


class _Spec(NamedTuple):
    """What the backward needs besides tensors (none of q, k, v: those are saved, so that
    torch frees them after a plain backward, and saved-tensor hooks see them): the mask
    and scale, which extra outputs were given and the mask's tensor versions as the
    forward read them."""

    mask: object
    scale: float
    backend: str
    weights: bool
    lse: bool
    versions: tuple | None

    @property
    def n_outputs(self) -> int:
        return 1 + self.weights + self.lse


def reference_gradients(spec: _Spec, inputs: tuple, grads: tuple, needed) -> tuple:
    """The reference backend's gradients of the call on ``inputs`` (q, k, v, biases) for
    the output gradients ``grads`` (None: unused), as a graph that can be differentiated;
    None for the inputs not ``needed`` (a frozen k, say)."""
    from .functional.dispatch import attention
    m = spec.mask
    if m is not None:
        m._check_unchanged(spec.versions, f"{spec.backend} backward with create_graph=True")
    q, k, v = (t.view_as(t) for t in inputs[:3])          # one handle each (k may be v)
    with torch.autocast(q.device.type, enabled=False):    # the forward's dtypes, as it ran
        got = attention(q, k, v, mask=m, scale=spec.scale, backend="reference",
                        return_weights=spec.weights, return_lse=spec.lse)
    got = got if isinstance(got, tuple) else (got,)
    # (an output that depends on no input wanted here has no graph: the lse, when only v
    # takes a gradient, contributes nothing)
    pairs = [(o, g) for o, g in zip(got, grads) if g is not None and o.requires_grad]
    wrt = [t for t, need in zip((q, k, v, *inputs[3:]), needed) if need]
    if not pairs or not wrt:
        return (None,) * len(inputs)
    found = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                     create_graph=True, allow_unused=True))
    return tuple(next(found) if need else None for need in needed)


class _Again(torch.autograd.Function):
    @classmethod
    def apply(cls, *args):
        # torch's apply binds the arguments to forward's signature first, which returns them
        # unchanged for positional ones at about 15 us a call (see kernels.ops._Direct)
        return super(torch.autograd.Function, cls).apply(*args)

    @staticmethod
    def forward(ctx, spec: _Spec, *tensors):
        n = spec.n_outputs
        ctx.spec = spec
        ctx.set_materialize_grads(False)                   # unused outputs stay None
        ctx.save_for_backward(*tensors[n:])                # q, k, v, biases
        # the same memory and version counter, not a view: a write in place into one is
        # then what it was on the kernel's own output (torch's check of saved tensors)
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    @without_autocast
    def backward(ctx, *grads):
        needed = ctx.needs_input_grad[1 + len(grads):]      # q, k, v, biases
        if not torch.is_grad_enabled():                     # a plain backward: the kernel's
            return (None, *grads, *(None,) * len(needed))
        # building a graph: the reference's gradients, and none for the kernel's outputs
        return (None, *(None,) * len(grads),
                *reference_gradients(ctx.spec, ctx.saved_tensors, grads, needed))
