"""Names that left the top level in 0.4 (docs/architecture.md, "Renamed in 0.4"): still reachable as ``einshard.<name>``, with a
warning that names their public home.  The root re-exports :func:`__getattr__` (a face holds no logic)."""

from __future__ import annotations

import importlib
import warnings

# name -> (public module, attribute)
MOVED: dict[str, tuple[str, str]] = {
    "Plan": ("einshard.analysis", "EinsumPlan"),
    "PlanResult": ("einshard.planner", "LayoutPlan"),
    "Collective": ("einshard.analysis", "Collective"),
    "MeshAxis": ("einshard.placement", "MeshAxis"),
    "Expression": ("einshard.placement", "Expression"),
    "parse": ("einshard.placement", "parse"),
    "anonymous_mesh": ("einshard.placement", "anonymous_mesh"),
    "EinsumProgram": ("einshard.lowering", "EinsumProgram"),
}
# The two that are at the top level under a new name.
RENAMED = {"Plan": "EinsumPlan", "PlanResult": "LayoutPlan"}


def __getattr__(name: str) -> object:
    if name not in MOVED:
        raise AttributeError(f"module 'einshard' has no attribute {name!r}")
    module, attribute = MOVED[name]
    new = f"einshard.{RENAMED[name]}" if name in RENAMED else f"{module}.{attribute}"
    warnings.warn(f"einshard.{name} is now {new} (einshard 0.4)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), attribute)
