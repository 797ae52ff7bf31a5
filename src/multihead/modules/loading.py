"""All-or-nothing ``load_state_dict``: a checkpoint that does not fit is refused before any
tensor is copied, so a failed load never leaves a half-loaded module.

``torch.nn.Module.load_state_dict`` copies every tensor that fits, then raises for the
rest. :class:`AllOrNothing` checks first, both when its own ``load_state_dict`` is called
and when a parent's load reaches it (a model holding it, an ``nn.Sequential``): there it
raises before copying anything of its own subtree if a tensor has another shape or is not
a tensor. (A key missing from a parent's strict load is the parent's to report: torch
does, after copying the rest, and does not tell the children whether the load is strict.)
A parent's load has copied the modules it reached before, which no child can undo:
:func:`load_state_dict` loads a whole model all or nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn


def load_problems(module: nn.Module, state_dict: Mapping, strict: bool,
                  prefix: str = "", assign: bool = False) -> list[str]:
    """What a load of ``state_dict`` into ``module`` (its keys under ``prefix``) would fail
    on: a key of another shape or not a tensor, a tensor with no values (on the meta device)
    or a complex one for a real tensor (torch would drop its imaginary part), and
    (``strict``) keys missing or unexpected. A submodule's ``_optional_keys`` (RoPE's
    ``inv_freq``) may be present or not. With ``assign`` (the checkpoint's tensors become
    the parameters), one module's floating-point tensors of two dtypes or devices (its
    forward would fail inside torch's matmul).

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 3)
        >>> load_problems(lin, {"weight": torch.zeros(3, 3), "bias": torch.zeros(3)}, True)
        ['weight has shape (3, 3) in the checkpoint but (3, 2) here']
    """
    optional = _optional(module)                       # (kept where the checkpoint has them)
    own = {**module.state_dict(keep_vars=True), **optional}
    problems = []
    for key, mine in own.items():
        theirs = state_dict.get(prefix + key)
        if key in optional and prefix + key in state_dict:
            owner, _, local = key.rpartition(".")
            problem = module.get_submodule(owner)._optional_problem(local, theirs)
            if problem:
                problems.append(f"{prefix}{owner}{'.' if owner else ''}{problem}")
                continue
        if isinstance(theirs, torch.Tensor) and theirs.shape != mine.shape:
            problems.append(f"{prefix}{key} has shape {tuple(theirs.shape)} in the checkpoint "
                            f"but {tuple(mine.shape)} here")
        elif prefix + key in state_dict and not isinstance(theirs, torch.Tensor):
            problems.append(f"{prefix}{key} is a {type(theirs).__name__} in the checkpoint, "
                            f"not a tensor")
        elif theirs is not None and theirs.is_meta and not mine.is_meta:
            problems.append(f"{prefix}{key} is on the meta device in the checkpoint (it holds "
                            f"no values: save the model after its weights are materialised)")
        elif theirs is not None and theirs.is_complex() and not mine.is_complex():
            problems.append(f"{prefix}{key} is {theirs.dtype} in the checkpoint but "
                            f"{mine.dtype} here (its imaginary part would be dropped)")
    if assign:
        problems += _mixed(module, state_dict, prefix)
    if strict:
        missing = [prefix + k for k in own if prefix + k not in state_dict and k not in optional]
        unexpected = [k for k in state_dict
                      if isinstance(k, str) and k.startswith(prefix) and k[len(prefix):] not in own]
        problems += [f"{what} keys {keys}" for what, keys in
                     (("missing", missing), ("unexpected", unexpected)) if keys]
    return problems


_PARAMETRIZED = re.compile(r"(^|.*\.)parametrizations\.([^.]+)\..+")


def _parametrization_hint(own, theirs) -> str | None:
    """The fix where the module and the checkpoint (their keys) differ only in which
    tensors are parametrized (``torch.nn.utils.parametrize`` stores ``weight`` as
    ``parametrizations.weight.original``), or None.

    Example:
        >>> _parametrization_hint(["parametrizations.weight.original", "bias"], ["weight", "bias"])
        'This module parametrizes weight, the checkpoint holds it plain: load the checkpoint before registering the parametrization, or remove it first (torch.nn.utils.parametrize.remove_parametrizations)'
    """
    own, theirs = set(own), set(theirs)
    plain = lambda k: _PARAMETRIZED.sub(r"\1\2", k)                   # noqa: E731
    here, there = own - theirs, theirs - own
    if not (here or there) or {plain(k) for k in here} != {plain(k) for k in there}:
        return None
    ours = sorted({plain(k) for k in here if _PARAMETRIZED.match(k)})
    if ours:
        return (f"This module parametrizes {', '.join(ours)}, the checkpoint holds "
                f"{'it' if len(ours) == 1 else 'them'} plain: load the checkpoint before "
                f"registering the parametrization, or remove it first "
                f"(torch.nn.utils.parametrize.remove_parametrizations)")
    names = sorted({plain(k) for k in there if _PARAMETRIZED.match(k)})
    return (f"The checkpoint parametrizes {', '.join(names)}, this module does not: register "
            f"the same parametrization (torch.nn.utils.parametrize) before loading")


def _optional(module: nn.Module) -> dict:
    """``module``'s tensors that a checkpoint may hold or not, by their state-dict names:
    each submodule's ``_optional_keys`` (RoPE's ``inv_freq``)."""
    return {f"{name}.{key}" if name else key: getattr(sub, key)
            for name, sub in module.named_modules() for key in getattr(sub, "_optional_keys", ())}


def _mixed(module: nn.Module, state_dict: Mapping, prefix: str) -> list[str]:
    """Each of our modules (an :class:`AllOrNothing` in ``module``, or ``module`` itself)
    whose floating-point tensors after an ``assign=True`` load would have two dtypes or
    devices (the checkpoint's where it has the key, the module's own where not): its
    forward would fail in torch's matmul. A RoPE's frequencies (``_optional_keys``) are
    kept in float32 or wider on purpose, and the rest of a model may mix dtypes (float32
    norms beside bfloat16 layers)."""
    problems = []
    for name, sub in module.named_modules():
        if not isinstance(sub, AllOrNothing):
            continue
        at = f"{prefix}{name}." if name else prefix
        optional = _optional(sub)
        kinds = {}
        for key, mine in sub.state_dict(keep_vars=True).items():
            theirs = state_dict.get(at + key)
            t = theirs if isinstance(theirs, torch.Tensor) else mine
            if key not in optional and t.is_floating_point() and mine.is_floating_point():
                kinds.setdefault((t.dtype, t.device), at + key)
        if len(kinds) > 1:
            shown = ", ".join(f"{k} is {d} on {v}" for (d, v), k in kinds.items())
            problems.append(f"{shown} once loaded (the checkpoint's tensor, or the module's "
                            f"own where the checkpoint has none): assigned (assign=True), the "
                            f"module would hold both and its forward fail; convert the "
                            f"checkpoint's tensors to the module's dtype and device, or load "
                            f"without assign (which copies them into the module's own)")
    return problems


def load_state_dict(model: nn.Module, state_dict: Mapping, strict: bool = True,
                    assign: bool = False):
    """``model.load_state_dict(state_dict, strict, assign)``, all or nothing for any model
    (one holding several :class:`multihead.MultiHeadAttention` layers, say). torch's own
    load copies each module it reaches, so a layer refusing the checkpoint would leave the
    layers before it loaded. Here our layers check their keys, shapes and dtypes first;
    then torch's load runs (its hooks and rules for old checkpoints included), and if it
    raises, every parameter and buffer is put back: the same tensors, their values
    restored. The model's state is copied, on its device, for the time of the load.

    Returns:
        torch's ``(missing_keys, unexpected_keys)`` (empty where ``strict``).

    Raises:
        RuntimeError: torch's, or naming each problem in our layers; nothing is loaded.

    Example:
        >>> import torch, multihead as mh
        >>> model = torch.nn.Sequential(mh.MultiHeadAttention(16, 4), mh.MultiHeadAttention(16, 4))
        >>> other = torch.nn.Sequential(mh.MultiHeadAttention(16, 4),
        ...                             mh.MultiHeadAttention(16, 4, num_kv_heads=2))
        >>> before = model[0].in_proj_weight.clone()
        >>> mh.load_state_dict(model, other.state_dict())
        Traceback (most recent call last):
        ...
        RuntimeError: load_state_dict: 1.in_proj_weight has shape (32, 16) in the checkpoint but (48, 16) here; ... Nothing was loaded
        >>> torch.equal(model[0].in_proj_weight, before)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors (model.state_dict()"
                        f"'s), got {type(state_dict).__name__}")
    problems, checked = [], []
    for name, sub in model.named_modules():                 # our outermost layers
        at = f"{name}." if name else ""
        if isinstance(sub, AllOrNothing) and not any(at.startswith(c) for c in checked):
            checked.append(at)
            problems += load_problems(sub, state_dict, False, at, assign)
    if problems:
        raise RuntimeError(f"load_state_dict: {'; '.join(problems)}. Nothing was loaded")
    saved = _snapshot(model)
    try:
        return model.load_state_dict(state_dict, strict=strict, assign=assign)
    except BaseException:
        _restore(saved)
        raise


def _snapshot(model: nn.Module) -> list:
    """Every parameter and buffer of ``model``: where it is held, the tensor, a copy of its
    values (a lazy module's uninitialized parameter has none, and is left out)."""
    lazy = nn.parameter.UninitializedTensorMixin
    return [(store, key, t, t.detach().clone())
            for m in model.modules() for store in (m._parameters, m._buffers)
            for key, t in store.items() if t is not None and not isinstance(t, lazy)]


@torch.no_grad()
def _restore(saved: list) -> None:
    """Put :func:`_snapshot`'s tensors back in their modules, with their values."""
    for store, key, t, values in saved:
        store[key] = t
        t.copy_(values)


class AllOrNothing(nn.Module):
    """A module whose state-dict loads copy everything or nothing (see the module's doc).

    Subclasses may define ``_sizes()``, a line the error shows (the sizes that shape the
    parameters), and ``_layout_hint(keys)``: the fix for a checkpoint whose ``keys`` (its
    names below this module) are another library's layout, or None.
    """

    def _refuse(self, state_dict, strict: bool, prefix: str = "", assign: bool = False) -> None:
        problems = load_problems(self, state_dict, strict, prefix, assign)
        if not problems:
            return
        keys = any(p.startswith(("missing", "unexpected")) for p in problems)
        advice = ""
        if keys or any(" has shape " in p for p in problems):     # (else the problems say it)
            loose = " (or pass strict=False to load the keys that match)" if keys else ""
            sizes = getattr(self, "_sizes", None)
            what = f"This module is {sizes()}; build it" if sizes else "Build the module"
            advice = f"{what} with the checkpoint's sizes{loose}. "
        hint = getattr(self, "_layout_hint", None)
        theirs = [k[len(prefix):] for k in state_dict if isinstance(k, str) and k.startswith(prefix)]
        hint = (hint(theirs) if hint else None) or (
            _parametrization_hint(self.state_dict(keep_vars=True), theirs) if strict else None)
        advice = f"{hint}. " if hint else advice
        where = f" at {prefix[:-1]!r}" if prefix else ""
        parent = (" (but the load of the model holding it has copied the modules it reached "
                  "before: multihead.load_state_dict(model, state_dict) checks the whole model "
                  "first)") if prefix else ""
        raise RuntimeError(f"{type(self).__name__}.load_state_dict{where}: {'; '.join(problems)}. "
                           f"{advice}Nothing {'of it ' if prefix else ''}was loaded{parent}")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As :meth:`torch.nn.Module.load_state_dict`, but all or nothing: the keys and
        shapes are checked before any tensor is copied, so a checkpoint of other sizes
        leaves the module as it was (torch's copies the tensors that fit, then raises).

        Raises:
            RuntimeError: naming each key missing, unexpected (``strict``) or of another
                shape; nothing is loaded.

        Example:
            >>> import torch, multihead as mh
            >>> gqa = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
            >>> before = gqa.out_proj.weight.clone()
            >>> try:
            ...     gqa.load_state_dict(torch.nn.MultiheadAttention(16, 4).state_dict())
            ... except RuntimeError as e:
            ...     print(str(e)[:60])
            MultiHeadAttention.load_state_dict: in_proj_weight has shape
            >>> torch.equal(gqa.out_proj.weight, before)
            True
        """
        if isinstance(state_dict, Mapping):
            self._refuse(state_dict, strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if prefix:      # a parent's load: check this subtree's shapes first (torch passes
            self._refuse(state_dict, False, prefix,     # strict=True here whatever the
                         local_metadata.get("assign_to_params_buffers", False))
            # caller's, and reports missing keys itself, after copying what fits)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
