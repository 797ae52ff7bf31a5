"""Functional core: :func:`attention`, :func:`explain`, the backends and their cost model.

Backends live one file each in ``backend/`` and register themselves when imported;
``reference`` is the oracle of the others. Each declares its :class:`Capabilities` and
plans calls as device-neutral :class:`Work`, priced by a :class:`DeviceProfile`
(see :mod:`multihead.functional.profiles`).
"""

from . import profiles, registry
from .capabilities import Capabilities
from .cost import DeviceProfile, Work
from .dispatch import Explanation, attention, explain
from .registry import Backend, Plan, backends, register

registry.discover()

__all__ = ["attention", "explain", "Explanation", "backends", "Backend", "Plan", "register",
           "Capabilities", "Work", "DeviceProfile", "profiles"]
