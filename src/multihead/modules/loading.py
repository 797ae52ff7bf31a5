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

torch's load hooks keep working: the check runs after the module's load pre-hooks (which
may rename or convert an old checkpoint's keys); where a submodule has pre-hooks (run as
torch's load reaches it, after this module's check would), or a module of the subtree has
a post-hook (which may forgive missing or unexpected keys), torch's load runs first and
checks, the keys are checked after the hooks, and a refused load is put back.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Mapping
from dataclasses import dataclass

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
        if key.rpartition(".")[2] == _EXTRA_STATE:
            continue                 # (whatever the module's set_extra_state takes, as torch)
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
        problems += _unassignable(module, state_dict, prefix) + _mixed(module, state_dict, prefix)
    if strict:
        missing = [prefix + k for k in own if prefix + k not in state_dict and k not in optional]
        unexpected = [k for k in state_dict
                      if isinstance(k, str) and k.startswith(prefix) and k[len(prefix):] not in own]
        problems += [f"{what} keys {keys}" for what, keys in
                     (("missing", missing), ("unexpected", unexpected)) if keys]
    return problems


#: the key of a module's extra state (``get_extra_state``) in its state dict, as torch names it
_EXTRA_STATE = "_extra_state"


def _has_extra_state(model: nn.Module) -> bool:
    """Whether a module in ``model`` keeps extra state: its ``set_extra_state`` (user code)
    runs last in torch's load, after the tensors are copied, and may raise."""
    return any(type(m).get_extra_state is not nn.Module.get_extra_state for m in model.modules())


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


def _unassignable(module: nn.Module, state_dict: Mapping, prefix: str) -> list[str]:
    """``module``'s parameters that require grad whose checkpoint tensor is not floating
    point: assigned (``assign=True``), torch would fail making it a Parameter, after
    assigning the tensors before it."""
    problems = []
    for key, mine in module.named_parameters(remove_duplicate=False):
        theirs = state_dict.get(prefix + key)
        if mine.requires_grad and isinstance(theirs, torch.Tensor) and not (
                theirs.is_floating_point() or theirs.is_complex()):
            problems.append(f"{prefix}{key} is {theirs.dtype} in the checkpoint, which a "
                            f"parameter that requires grad cannot be assigned (assign=True): "
                            f"convert it to {mine.dtype}, or load without assign (which "
                            f"copies it into the module's own)")
    return problems


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
    layers before it loaded. Here torch's load runs (its hooks and rules for old
    checkpoints included); each of our layers it reaches checks its shapes and dtypes
    (after the pre-hooks) and notes what does not fit; if any did, or torch raises, every
    module is put back: its attributes, the same tensors, their values restored. The
    model's state is copied, on its device, for the time of the load.

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
    load = _Load(model, strict_keys=False, problems=[],   # our layers note, copy nothing
                 members={id(m) for m in model.modules()})
    saved = _snapshot(model)
    token = _LOAD.set(load)
    refused = None
    try:
        keys = model.load_state_dict(state_dict, strict=strict, assign=assign)
    except Exception as e:             # (a tensor of our layers' children torch failed on,
        refused = e                    # say: our layers' words say why, where they have some)
    except BaseException:
        _restore(saved)
        raise
    finally:
        _LOAD.reset(token)
    if load.problems or refused:
        _restore(saved)
        if not load.problems:
            raise refused
        raise RuntimeError(f"load_state_dict: {'; '.join(load.problems)}. Nothing was "
                           f"loaded") from refused
    return keys


@dataclass
class _Load:
    """A load in progress: the module whose ``load_state_dict`` was called, whether its
    own check also covers missing and unexpected keys, and (for :func:`load_state_dict`)
    where our layers note their problems instead of raising."""
    root: nn.Module
    strict_keys: bool
    problems: list | None = None
    members: set | None = None        # (ids of the modules whose problems are collected)

    def collects(self, module: nn.Module) -> bool:
        return self.problems is not None and id(module) in self.members


def _ran_already(*args, **kwargs) -> None:
    """Stands in for a load pre-hook that our load has run, while torch's runs."""


def _hooked_below(module: nn.Module) -> bool:
    """Whether a module below ``module`` has load pre-hooks: torch runs them as its load
    reaches that module, after ``module``'s check of its whole subtree would have run."""
    return any(m._load_state_dict_pre_hooks for m in module.modules() if m is not module)


_LOAD: contextvars.ContextVar = contextvars.ContextVar("multihead_load", default=None)


def _snapshot(model: nn.Module) -> list:
    """What :func:`_restore` needs to put ``model`` back as it is: each module's attributes
    (a RoPE's note of its frequencies, say), and each parameter and buffer: where it is
    held, the tensor, and a copy of its values (a lazy module's uninitialized parameter,
    which a load materializes in place, its class and empty data instead)."""
    lazy = nn.parameter.UninitializedTensorMixin
    attrs = [(m, dict(m.__dict__)) for m in model.modules()]
    tensors = [(store, key, t, (type(t), t.data) if isinstance(t, lazy) else t.detach().clone())
               for m in model.modules() for store in (m._parameters, m._buffers)
               for key, t in store.items() if t is not None]
    return [attrs, tensors]


@torch.no_grad()
def _restore(saved: list) -> None:
    """Put :func:`_snapshot`'s modules back: their attributes, their tensors, and the
    values of those that changed (only those: a write counts as a change for some, as the
    version a RoPE notes of its frequencies)."""
    attrs, tensors = saved
    for m, state in attrs:
        m.__dict__.clear()
        m.__dict__.update(state)
    for store, key, t, values in tensors:
        store[key] = t
        if isinstance(values, tuple):                       # (lazy: materialized in place)
            if type(t) is not values[0]:
                t.data, t.__class__ = values[1], values[0]
        elif (t.dtype, t.shape, t.device) != (values.dtype, values.shape, values.device):
            t.data = values                     # (swapped in place: torch's swap mode)
        elif not t.is_meta and not torch.equal(t, values):
            t.copy_(values)


class AllOrNothing(nn.Module):
    """A module whose state-dict loads copy everything or nothing (see the module's doc).

    Subclasses may define ``_sizes()``, a line the error shows (the sizes that shape the
    parameters), and ``_layout_hint(keys)``: the fix for a checkpoint whose ``keys`` (its
    names below this module) are another library's layout, or None.
    """

    def _refuse(self, problems: list[str], state_dict, strict: bool, prefix: str = "") -> None:
        """Raise a RuntimeError naming ``problems`` (:func:`load_problems`'s) with the fix."""
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
        Load hooks run as in torch: the module's pre-hooks before the check; where a
        submodule has pre-hooks, or a post-hook may forgive keys, torch's load runs first,
        the keys are checked after the hooks, and a refused load is put back.

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
        load = _LOAD.get()
        if not isinstance(state_dict, Mapping) or (load is not None and load.collects(self)):
            # (torch's error names a bad state_dict; multihead.load_state_dict checks)
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        # a pre-hook below this module, or a post-hook that may forgive keys: torch's load
        # runs first, the keys are checked after it, and a refused load is put back
        below = _hooked_below(self)
        later = below or (strict and any(m._load_state_dict_post_hooks for m in self.modules()))
        saved = _snapshot(self) if later or _has_extra_state(self) else None
        token = _LOAD.set(_Load(self, strict_keys=strict and not later))
        try:
            keys = super().load_state_dict(state_dict, strict=strict and not later,
                                           assign=assign)
            if later and strict and (keys.missing_keys or keys.unexpected_keys):
                problems = [f"{what} keys {found}" for what, found in
                            (("missing", keys.missing_keys),
                             ("unexpected", keys.unexpected_keys)) if found]
                self._refuse(problems, state_dict, strict)
            return keys
        except BaseException:
            if saved is not None:
                _restore(saved)
            raise
        finally:
            _LOAD.reset(token)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        hooks = self._load_state_dict_pre_hooks
        for hook in hooks.values():     # torch runs them first (they may convert old keys)
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs)
        load = _LOAD.get()
        # (a parent's load passes strict=True whatever the caller's, and reports missing
        # keys itself, after copying what fits: only our own load checks keys here)
        keys = load is not None and load.root is self and not prefix and load.strict_keys
        problems = [] if _hooked_below(self) else load_problems(   # (torch's check, then)
            self, state_dict, keys, prefix, local_metadata.get("assign_to_params_buffers", False))
        if problems and load is not None and load.collects(self):
            load.problems += [p for p in problems if p not in load.problems]
            return                       # (multihead.load_state_dict puts the model back)
        if problems:
            self._refuse(problems, state_dict, keys, prefix)
        # (run above: torch's would run them again. Each is stood in for by a no-op in
        # this same dict while torch's load runs, then put back where still there: a hook
        # registered meanwhile is kept, and one whose handle removes it meanwhile is gone)
        kept = dict(hooks)
        for key in kept:
            hooks[key] = _ran_already
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        finally:
            for key, hook in kept.items():
                if key in hooks:
                    hooks[key] = hook
