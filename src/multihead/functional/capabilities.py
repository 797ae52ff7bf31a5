"""What a backend supports, declared as data and checked in one place.

Each backend states its limits as a :class:`Capabilities` value (per device type where
they differ), like xFormers' ``SUPPORTED_*`` attributes; :meth:`Capabilities.reasons`
turns a call that exceeds them into short, readable reasons. Only what data cannot say
(document ids that are not contiguous runs, say) is left to a backend's own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .._dtypes import SUPPORTED_DTYPES
from ._call import AttentionCall
from .._tracing import tracing

#: leaf mask structures a backend can declare (compositions are "and", "or", "not");
#: "at_positions" (a leaf of kind "custom") for a backend that runs those and no other custom
MASK_KINDS = frozenset({"causal", "window", "padding", "document", "dense", "bias", "alibi",
                        "custom", "at_positions"})
ALL_DTYPES = frozenset(SUPPORTED_DTYPES)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def shown(n) -> str:
    """A size for a message: its digits, or ``"a traced size"`` for a symbolic one (while
    ``torch.compile`` traces or ``make_fx`` traces symbolically: formatting it would
    specialize the graph to it).

    Example:
        >>> shown(128)
        '128'
    """
    if torch.compiler.is_compiling() or type(n) is not int:    # (Dynamo takes a SymInt
        return "a traced size"                                  # for an int here)
    return str(n)


@dataclass(frozen=True)
class Capabilities:
    """The calls a backend can run.

    Attributes:
        devices: device types (``"cpu"``, ``"cuda"``); None (the default): any device.
        dtypes: input dtypes.
        max_head_dim: largest D and Dv.
        masks: leaf mask kinds it applies (see :data:`MASK_KINDS`).
        compositions: whether masks combined with ``&``, ``|``, ``~`` are accepted.
        weights: returns the attention weights.
        lse: returns the log-sum-exp of each row.
        dropout: applies dropout on the weights.
        bias_grad: propagates gradients into a bias tensor.
        traceable: runs inside ``torch.compile(fullgraph=True)``, ``torch.export``, ``make_fx``
            and on fake tensors (it reads no values on the host).
        transforms: runs under ``torch.func`` transforms (grad, vmap, jacrev, ...); False
            for a backend that reads a mask back to the host (rows), writes its tiles in
            place from an autograd Function (blocksparse) or launches its own kernels
            (triton): functorch's wrapped tensors allow none of these.
        empty_vmap: runs under ``torch.func.vmap`` over a dimension of size 0 (torch's
            fused kernels fall back to a loop over the samples there, which cannot run).
        cross_attention: accepts Sq != Sk.
        backward: gives gradients (a call that needs them goes elsewhere when it does not).
        forward_ad: gives forward-mode derivatives (``torch.func.jvp``, ``jacfwd``,
            ``torch.autograd.forward_ad`` dual tensors); False where torch's fused kernels
            or our own autograd Functions have no forward-mode rule.
        second_order: its gradients can be differentiated again (the reference's ops, or
            our autograd Functions, whose backward that builds a graph gives the reference's
            gradients). Where False, such a backward gets them from
            :func:`multihead.attention`'s node (:mod:`multihead._second_order`); under
            nested reverse-mode ``torch.func`` transforms (``grad(grad(f))``), where that
            cannot run, the backend is not used.

    Example:
        >>> Capabilities(devices=frozenset({"cuda"}), lse=True).lse
        True
    """

    devices: frozenset | None = None
    dtypes: frozenset = ALL_DTYPES
    max_head_dim: int = 1 << 16
    masks: frozenset = MASK_KINDS
    compositions: bool = True
    weights: bool = False
    lse: bool = False
    dropout: bool = False
    bias_grad: bool = False
    traceable: bool = True
    transforms: bool = True
    empty_vmap: bool = True
    cross_attention: bool = True
    backward: bool = True
    forward_ad: bool = True
    second_order: bool = False

    def reasons(self, call: AttentionCall, device_type: str) -> list[str]:
        """Why this backend cannot run ``call`` on ``device_type`` (empty when it can).

        Example:
            >>> import torch
            >>> from multihead.functional._call import make_call
            >>> q = torch.randn(1, 2, 4, 8)
            >>> call = make_call(q, q, q, mask=None, scale=None, dropout_p=0.1,
            ...                  return_weights=True, return_lse=False)
            >>> Capabilities(devices=frozenset({"cuda"})).reasons(call, "cpu")
            ['runs on cuda, not cpu', 'does not return attention weights', 'does not implement dropout']
        """
        out = []
        if self.devices is not None and device_type not in self.devices:
            out.append(f"runs on {', '.join(sorted(self.devices))}, not {device_type}")
        if call.q.dtype not in self.dtypes:
            names = ", ".join(sorted(_dtype_name(d) for d in self.dtypes))
            out.append(f"takes {names}, not {_dtype_name(call.q.dtype)}")
        if max(call.D, call.Dv) > self.max_head_dim:
            out.append(f"takes head dims up to {self.max_head_dim}, not {max(call.D, call.Dv)}")
        if call.return_weights and not self.weights:
            out.append("does not return attention weights")
        if call.return_lse and not self.lse:
            out.append("does not return the log-sum-exp")
        if call.dropout_p > 0 and not self.dropout:
            out.append("does not implement dropout")
        # (traced sizes: Sq == Sk where that is known without a guard, else cross-attention)
        if not self.cross_attention and not statically_known_true(call.Sq == call.Sk):
            out.append(f"needs Sq == Sk (got Sq={shown(call.Sq)}, Sk={shown(call.Sk)})")
        m = call.effective_mask
        if m is not None:
            if m.kind in ("and", "or", "not") and not self.compositions:
                out.append(f"does not apply composed masks ({m.kind})")
            label = lambda leaf: getattr(leaf, "kind_label", leaf.kind)  # noqa: E731
            kinds = sorted({label(leaf) for leaf in m.leaves()
                            if leaf.kind not in self.masks and label(leaf) not in self.masks})
            if kinds:
                why = (" (a padded KV cache puts a window or ALiBi at its tokens' positions "
                       "that way)" if "at_positions" in kinds else "")
                out.append(f"does not apply {', '.join(kinds)} masks{why}")
            if not self.bias_grad and m.requires_grad and torch.is_grad_enabled():
                out.append("gives no gradient w.r.t. a bias tensor")
        if not self.backward and call.requires_grad:
            out.append("has no backward (gradients are needed)")
        if not self.forward_ad and call.forward_ad:
            out.append("gives no forward-mode derivatives (jvp, jacfwd, dual tensors)")
        if not self.second_order and call.second_order:
            out.append("gives no second-order gradients under nested torch.func transforms "
                       "(grad of grad, jacrev of jacrev)")
        if not self.traceable and (tracing() or device_type == "meta"):
            out.append("reads values on the host, which fake and meta tensors do not have and "
                       "a traced graph cannot read (torch.compile, torch.export, make_fx, "
                       "FakeTensorMode, the meta device)")
        if not self.transforms and torch._C._are_functorch_transforms_active():
            out.append("does not run under torch.func transforms (grad, vmap, jacrev, ...)")
        elif not self.empty_vmap and call.vmapped_empty:
            out.append("cannot run under torch.func.vmap over a dimension of size 0 (torch's "
                       "kernel has no batching rule)")
        return out
