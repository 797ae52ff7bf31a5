"""All-or-nothing ``load_state_dict``: a checkpoint that does not fit is refused before any
tensor is copied, so a failed load never leaves a half-loaded module.

``torch.nn.Module.load_state_dict`` copies every tensor that fits, then raises for the
rest. :class:`AllOrNothing` checks first, both when its own ``load_state_dict`` is called
and when a parent's load reaches it (a model holding it, an ``nn.Sequential``): there it
raises before copying anything of its own subtree if a tensor has another shape or is not
a tensor. (A key missing from a parent's strict load is the parent's to report: torch
does, after copying the rest, and does not tell the children whether the load is strict.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def load_problems(module: nn.Module, state_dict: Mapping, strict: bool,
                  prefix: str = "") -> list[str]:
    """What a load of ``state_dict`` into ``module`` (its keys under ``prefix``) would fail
    on: a key of another shape or not a tensor, a tensor with no values (on the meta device)
    or a complex one for a real tensor (torch would drop its imaginary part), and
    (``strict``) keys missing or unexpected. A submodule's ``_optional_keys`` (RoPE's
    ``inv_freq``) may be present or not.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 3)
        >>> load_problems(lin, {"weight": torch.zeros(3, 3), "bias": torch.zeros(3)}, True)
        ['weight has shape (3, 3) in the checkpoint but (3, 2) here']
    """
    own = module.state_dict(keep_vars=True)
    optional = {f"{name}.{key}" if name else key: getattr(sub, key)   # a submodule's
                for name, sub in module.named_modules()               # _optional_keys: kept
                for key in getattr(sub, "_optional_keys", ())}        # where present
    own = {**own, **optional}
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
    if strict:
        missing = [prefix + k for k in own if prefix + k not in state_dict and k not in optional]
        unexpected = [k for k in state_dict
                      if isinstance(k, str) and k.startswith(prefix) and k[len(prefix):] not in own]
        problems += [f"{what} keys {keys}" for what, keys in
                     (("missing", missing), ("unexpected", unexpected)) if keys]
    return problems


class AllOrNothing(nn.Module):
    """A module whose state-dict loads copy everything or nothing (see the module's doc).

    Subclasses may define ``_sizes()``, a line the error shows (the sizes that shape the
    parameters), and ``_layout_hint(keys)``: the fix for a checkpoint whose ``keys`` (its
    names below this module) are another library's layout, or None.
    """

    def _refuse(self, state_dict, strict: bool, prefix: str = "") -> None:
        problems = load_problems(self, state_dict, strict, prefix)
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
        hint = hint([k[len(prefix):] for k in state_dict if isinstance(k, str)
                     and k.startswith(prefix)]) if hint else None
        advice = f"{hint}. " if hint else advice
        where = f" at {prefix[:-1]!r}" if prefix else ""
        raise RuntimeError(f"{type(self).__name__}.load_state_dict{where}: {'; '.join(problems)}. "
                           f"{advice}Nothing {'of it ' if prefix else ''}was loaded")

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
            self._refuse(state_dict, strict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if prefix:      # a parent's load: check this subtree's shapes first (torch passes
            self._refuse(state_dict, False, prefix)     # strict=True here whatever the
            # caller's, and reports missing keys itself, after copying what fits)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
