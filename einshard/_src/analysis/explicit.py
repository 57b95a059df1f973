"""The explicit-sharding assistant: ``einshard.check_explicit(fn, *args)``.

On a mesh with Explicit axes (``jax.make_mesh``'s default) JAX types every value with its sharding and refuses,
while tracing, an op whose result's sharding it cannot decide without collectives the user did not ask for:
a matmul contracting a split axis, a reshape merging or splitting split axes, a gather or scatter across them.
It stops at the first one.  The assistant names all of them before JAX raises, each with the user's source line,
the parameter paths the op reads, and the ``out_sharding=`` / ``jax.reshard`` / ``jax.sharding.auto_axes`` fixes
that make it legal, priced by einshard's analysis, cheapest first.

How: the function is traced once on arguments of the right shapes but no layout (replicated), where no op is
ambiguous and so JAX raises nothing, while the user's own ``out_sharding=`` and ``jax.reshard`` calls still trace
(a function JAX refuses even then is traced on the mesh's *Auto twin*, every axis Auto, where JAX decides nothing).
Then each equation is typed as JAX types it on the Explicit mesh: the equation's own
primitive's abstract evaluation (JAX's sharding rules themselves, not a copy of them) runs on operand types that
carry the layouts followed so far.  Where JAX's rule raises a ``ShardingTypeError``, the op is a finding; its
candidate fixes are typed the same way (a fix is offered only where JAX accepts it), and the cheapest one's result
type is followed on, so one finding does not hide the next.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from ..core.layout import Layout, MeshAxis, spec_dims
from ..core.mesh import AnyMesh, MeshLike, resolve_mesh
from ..errors import EinshardError
from .cost import Collective, human_bytes, human_time
from .program.rules_control import scan_body, scan_counts

__all__ = [
    "check_explicit",
    "explicit_check",
    "ExplicitReport",
    "Finding",
    "Fix",
    "explicit_twin",
    "auto_twin",
    "where_of",
]

FixKind = Literal["out_sharding", "reshard", "auto_axes"]

# Primitives whose parameter of this name is the result's sharding (JAX's ``out_sharding=``): a fix sets it.
_OUT_SHARDING_PARAM: dict[str, str] = {
    "dot_general": "out_sharding",
    "reshape": "sharding",
    "broadcast_in_dim": "sharding",
    "iota": "sharding",
}
# How the user passes that parameter, per primitive (what the fix's code says).
_OUT_SHARDING_CALL: dict[str, str] = {
    "dot_general": "the matmul (jnp.matmul / jnp.dot / jnp.einsum / lax.dot_general)",
    "reshape": "the reshape (jnp.reshape / x.reshape / lax.reshape)",
    "broadcast_in_dim": "the broadcast (jnp.broadcast_to / lax.broadcast_in_dim)",
    "iota": "the iota / arange",
}
# Indexing ops whose out_sharding JAX takes on ``.at[...]`` (it runs them with the axes Auto: XLA chooses).
_AT_CALL: dict[str, str] = {
    "gather": "x.at[idx].get(out_sharding=...)",
    "scatter": "x.at[idx].set(v, out_sharding=...)",
    "scatter-add": "x.at[idx].add(v, out_sharding=...)",
    "scatter_add": "x.at[idx].add(v, out_sharding=...)",
    "scatter-mul": "x.at[idx].mul(v, out_sharding=...)",
    "scatter_mul": "x.at[idx].mul(v, out_sharding=...)",
    "scatter-min": "x.at[idx].min(v, out_sharding=...)",
    "scatter_min": "x.at[idx].min(v, out_sharding=...)",
    "scatter-max": "x.at[idx].max(v, out_sharding=...)",
    "scatter_max": "x.at[idx].max(v, out_sharding=...)",
}
# Ops that hand their operand's meaning on unchanged: a parameter read through them is still that parameter.
_CARRIERS = frozenset(
    {
        "convert_element_type",
        "transpose",
        "reshape",
        "copy",
        "copy_p",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "sharding_constraint",
        "reshard",
        "mesh_cast",
        "optimization_barrier",
        "reduce_precision",
    }
)
# The fixes offered per op (cheapest first; auto_axes comes after them).
_MAX_FIXES = 4
# Calls whose sub-jaxpr takes the call's operands one to one (followed inside, inline).
_CALL_JAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


# -- records -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fix:
    """One way to make a rejected op legal, as JAX accepts it, with what it costs.

    Attributes:
        kind: ``'out_sharding'`` (pass the result's layout to the op), ``'reshard'`` (``jax.reshard`` an operand
            first) or ``'auto_axes'`` (run the op with the axes Auto: ``jax.sharding.auto_axes``, XLA chooses).
        spec: the PartitionSpec the fix asks for (the result's, or the resharded operand's).
        operand: for ``'reshard'``, the operand's position in the op (0-based), else None.
        code: the line to write.
        collectives: the collectives the fix costs (einshard's pricing), per device.
        comm_bytes: bytes each device sends.
        time_s: estimated time of those collectives on the profile.
        priced: False where XLA chooses the collectives (``auto_axes``, ``.at[...](out_sharding=)``) and
            the figure is an upper bound (the operand gathered whole).
    """

    kind: FixKind
    spec: PartitionSpec
    operand: int | None
    code: str
    collectives: tuple[Collective, ...]
    comm_bytes: float
    time_s: float
    priced: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "spec": str(self.spec),
            "operand": self.operand,
            "code": self.code,
            "collectives": [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes} for c in self.collectives],
            "comm_bytes": self.comm_bytes,
            "time_s": self.time_s,
            "priced": self.priced,
        }

    def cost_text(self) -> str:
        if not self.collectives:
            return "free (no collective)"
        colls = ", ".join(f"{c.kind}@{'·'.join(c.axes)}" for c in self.collectives)
        bound = "at most " if not self.priced else ""
        return f"{bound}{human_bytes(self.comm_bytes)}/device, ~{human_time(self.time_s)} ({colls})"


@dataclass(frozen=True)
class Operand:
    """An operand of a rejected op, in the user's words."""

    name: str  # the parameter path ('params.dense.kernel', 'x') or 'an intermediate (tanh at model.py:12)'
    shape: tuple[int, ...]
    spec: PartitionSpec

    def __str__(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        return f"{self.name} [{dims}] {self.spec}"


@dataclass(frozen=True)
class Finding:
    """One op JAX's sharding-in-types rejects on the Explicit mesh.

    Attributes:
        index: the finding's position in program order.
        primitive: the JAX primitive (``dot_general``, ``reshape``, ``gather``, ...).
        where: the user's source line, ``file:line (function)``: the innermost frame outside libraries
            (site-packages) and JAX, else the innermost outside JAX.
        inside: the innermost non-JAX frame when it is a library's (Flax's Linear), else ''.
        operands: what the op reads, with parameter paths and layouts.
        error: JAX's own message (what it raises).
        fixes: the ways to make it legal, cheapest first.
        assumed: the result layout the rest of the check assumes (the fix that keeps the operands' splits on
            the result where there is one, else the cheapest): later findings hold if that fix is the one taken.
    """

    index: int
    primitive: str
    where: str
    inside: str
    operands: tuple[Operand, ...]
    out_shape: tuple[int, ...]
    error: str
    fixes: tuple[Fix, ...]
    assumed: PartitionSpec = PartitionSpec()

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "primitive": self.primitive,
            "where": self.where,
            "inside": self.inside,
            "operands": [{"name": o.name, "shape": list(o.shape), "spec": str(o.spec)} for o in self.operands],
            "out_shape": list(self.out_shape),
            "error": self.error,
            "fixes": [f.to_dict() for f in self.fixes],
            "assumed": str(self.assumed),
        }

    def __str__(self) -> str:
        lines = [
            f"[{self.index}] {self.primitive} at {self.where}" + (f" (inside {self.inside})" if self.inside else "")
        ]
        for o in self.operands:
            lines.append(f"      reads {o}")
        lines.append(f"      JAX: {_first_sentence(self.error)}")
        if not self.fixes:
            lines.append("      no fix einshard can offer: reshard the operands by hand (see JAX's message)")
        for k, f in enumerate(self.fixes):
            lines.append(f"      fix {k + 1}: {f.code}")
            lines.append(f"             cost: {f.cost_text()}")
        if self.fixes:
            lines.append(f"      the check goes on with the result laid out {_p(self.assumed)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ExplicitReport:
    """What ``check_explicit`` found: every op JAX's explicit sharding rejects, with fixes.

    Attributes:
        findings: the rejected ops, in program order.
        unchecked: primitives whose typing could not be followed (their results taken as replicated), by name.
        mesh: the mesh's axes.
    """

    findings: tuple[Finding, ...]
    unchecked: tuple[str, ...]
    mesh: tuple[MeshAxis, ...]
    explicit_axes: tuple[str, ...] = field(default=())
    # JAX's refusal of the program for a reason no sharding rule gave (with the user's line), '' if none: the
    # findings are then those of the program traced without layouts.
    refused: str = ""

    @property
    def ok(self) -> bool:
        """True when JAX accepts every op (nothing found, nothing unchecked, nothing refused)."""
        return not self.findings and not self.unchecked and not self.refused

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": {m.name: m.size for m in self.mesh},
            "explicit_axes": list(self.explicit_axes),
            "findings": [f.to_dict() for f in self.findings],
            "unchecked": list(self.unchecked),
            "refused": self.refused,
        }

    def __str__(self) -> str:
        mesh = ", ".join(f"{m.name}={m.size}" for m in self.mesh)
        n = len(self.findings)
        head = f"explicit sharding on mesh {mesh} (Explicit: {', '.join(self.explicit_axes) or 'none'}): " + (
            f"{n} op{'s' if n != 1 else ''} JAX rejects" if n else "JAX accepts every op"
        )
        lines = [head]
        if self.refused:
            lines.append(f"JAX refuses the program before its sharding rules decide: {self.refused}")
        lines += [str(f) for f in self.findings]
        if self.unchecked:
            lines.append("not checked (results taken as replicated): " + ", ".join(self.unchecked))
        return "\n".join(lines)


# -- meshes --------------------------------------------------------------------------------------------------


def _with_types(mesh: AnyMesh, types: Callable[[str, Any], Any]) -> Any:
    names = tuple(mesh.axis_names)
    kinds = tuple(types(n, t) for n, t in zip(names, mesh.axis_types))
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(mesh.devices, names, axis_types=kinds)
    return jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), names, axis_types=kinds)


def auto_twin(mesh: AnyMesh) -> Any:
    """The same mesh with every axis Auto: tracing on it decides no sharding, so it raises no sharding error."""
    return _with_types(mesh, lambda _n, _t: AxisType.Auto)


def explicit_twin(mesh: AnyMesh) -> Any:
    """A mesh given by sizes (``{'data': 4}``) as JAX's default would make it: every axis Explicit."""
    return _with_types(mesh, lambda _n, t: AxisType.Explicit)


def _abstract(mesh: AnyMesh) -> Any:
    return mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh


# -- source lines --------------------------------------------------------------------------------------------


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    """The folders that hold installed distributions (``*.dist-info``): site-packages, and also a
    ``pip install --target`` folder on ``PYTHONPATH``, a conda or Bazel tree.  A frame under one is a library's,
    not the user's.  An editable install keeps its ``.dist-info`` in site-packages and its code in the project,
    so the user's own editable package still counts as theirs."""
    import importlib.metadata

    roots: set[str] = set()
    for dist in importlib.metadata.distributions():
        try:
            root = os.path.abspath(str(dist.locate_file("")))
        except Exception:  # a distribution finder of an unusual kind: no path to read
            continue
        if root != os.path.abspath(os.getcwd()):  # the user's working folder is theirs, whatever sits in it
            roots.add(root.rstrip(os.sep) + os.sep)
    return tuple(sorted(roots))


def _short_path(path: str) -> str:
    return _short_path_from(path, os.getcwd(), _installed_roots())


@functools.lru_cache(maxsize=4096)
def _short_path_from(path: str, cwd: str, roots: tuple[str, ...]) -> str:
    """:func:`_short_path` from the working folder ``cwd`` with the installed ``roots``: a deep model's tens of
    thousands of equations come from a few dozen files, so each file's short form is found once."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for root in roots:
        if path.startswith(root):
            return path[len(root) :]
    try:
        rel = os.path.relpath(path, cwd)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def _is_library(path: str) -> bool:
    return _is_library_among(path, _installed_roots())


@functools.lru_cache(maxsize=4096)
def _is_library_among(path: str, roots: tuple[str, ...]) -> bool:
    """Whether a frame's file is a library's (JAX's, one under an installed ``roots``, einshard's own): found once
    per file and roots (a deep model's naming asks it of every frame of every equation)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the einshard package
    return (
        "site-packages" in path
        or "dist-packages" in path
        or path.startswith(here)
        or path.startswith(sys.prefix)
        or path.startswith(roots)
    )


def _frames(source_info: Any) -> Iterator[Any]:
    try:
        from jax._src import source_info_util

        yield from source_info_util.user_frames(source_info.traceback)
    except Exception:  # internal API: no source lines if it moved
        return


def _frame_text(f: Any) -> str:
    return f"{_short_path(f.file_name)}:{f.start_line} ({f.function_name})"


def where_of(eqn: Any) -> tuple[str, str]:
    """An equation's source line in the user's code, and the library line it is inside ('' when the same).

    ``where``: the innermost frame neither in JAX nor in an installed library; ``inside``: the innermost frame
    outside JAX where that is a library's (Flax's ``Linear.__call__``), so the user sees both the line they wrote
    and the layer that runs the op.
    """
    frames = list(_frames(getattr(eqn, "source_info", None)))
    if not frames:
        return "unknown", ""
    own = next((f for f in frames if not _is_library(f.file_name)), None)
    if own is None:
        return _frame_text(frames[0]), ""
    inner = frames[0]
    return _frame_text(own), ("" if inner is own else _frame_text(inner))


# -- specs ---------------------------------------------------------------------------------------------------


def _entries(spec: PartitionSpec | None, ndim: int) -> list[tuple[str, ...]]:
    return list(spec_dims(spec if spec is not None else PartitionSpec(), ndim))


def _spec(dims: Sequence[tuple[str, ...]]) -> PartitionSpec:
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims))


def _typed(aval: Any, mesh: AnyMesh, spec: PartitionSpec) -> Any:
    """``aval`` typed with ``spec`` on the Explicit ``mesh`` (only its Explicit axes: JAX types nothing else)."""
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    dims = [tuple(m for m in d if m in explicit) for d in _entries(spec, len(aval.shape))]
    return aval.update(sharding=NamedSharding(mesh, _spec(dims)))


def _spec_of(aval: Any) -> PartitionSpec:
    s = getattr(aval, "sharding", None)
    return _spec(_entries(getattr(s, "spec", None), len(getattr(aval, "shape", ()))))


def _layout(
    shape: Sequence[int], spec: PartitionSpec, mesh: tuple[MeshAxis, ...], unreduced: frozenset[str] = frozenset()
) -> Layout:
    dims = tuple(_entries(spec, len(shape)))
    return Layout(tuple(f"d{i}" for i in range(len(shape))), tuple(int(s) for s in shape), mesh, dims, unreduced)


def _divides(shape: Sequence[int], dims: Sequence[tuple[str, ...]], sizes: dict[str, int]) -> bool:
    return all(s % math.prod(sizes[m] for m in d) == 0 for s, d in zip(shape, dims))


# -- the walk ------------------------------------------------------------------------------------------------


class _Walk:
    """Types a jaxpr traced on the Auto twin as JAX types it on the Explicit mesh."""

    def __init__(self, mesh: AbstractMesh, axes: tuple[MeshAxis, ...], profile: Any) -> None:
        from .program.costing import OpCosts

        self.mesh = mesh  # the Explicit AbstractMesh
        self.axes = axes
        self.sizes = {m.name: m.size for m in axes}
        self.costs = OpCosts(axes, profile)
        self.findings: list[Finding] = []
        self.unchecked: set[str] = set()
        self.names: dict[Any, str] = {}  # jaxpr value -> the parameter path or origin it stands for
        # The source lines of the calls being walked into: an op inside jnp's own jitted helpers (jnp.take) has
        # no frame of the user's, and is reported at the line that called the helper.
        self.calls: list[tuple[str, str]] = []
        self.roots: dict[Any, str] = {}  # jaxpr value -> the one argument path it is computed from alone
        self.typed = False  # walking a jaxpr typed by JAX itself (typed_jaxpr): its types are read, not computed

    def where(self, eqn: Any) -> tuple[str, str]:
        where, inside = where_of(eqn)
        if where == "unknown" and self.calls:
            return self.calls[-1]
        return where, inside

    # the values' names
    def name(self, v: Any) -> str:
        if hasattr(v, "val"):
            return f"the constant {np.asarray(v.val)!r}" if np.ndim(v.val) == 0 else "a constant"
        return self.names.get(v, "an intermediate")

    def walk(self, jaxpr: Any, in_avals: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            if self.typed and getattr(getattr(v.aval, "sharding", None), "mesh", None) == self.mesh:
                return v.aval  # a jaxpr traced with the layouts (typed_jaxpr): JAX's own types
            if hasattr(v, "val"):
                return _typed(v.aval, self.mesh, PartitionSpec())
            return env[v]

        for v in jaxpr.constvars:  # constants closed over: every device has them whole
            env[v] = _typed(v.aval, self.mesh, PartitionSpec())
        for v, a in zip(jaxpr.invars, in_avals):
            env[v] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.step(eqn, ins)
            for v, a in zip(eqn.outvars, outs):
                env[v] = a
            self._name_outputs(eqn)
        return [read(v) for v in jaxpr.outvars]

    def _name_outputs(self, eqn: Any) -> None:
        prim = eqn.primitive.name
        if prim in _CARRIERS and eqn.invars and not hasattr(eqn.invars[0], "val") and eqn.invars[0] in self.names:
            for v in eqn.outvars:
                self.names[v] = self.names[eqn.invars[0]]
                if eqn.invars[0] in self.roots:
                    self.roots[v] = self.roots[eqn.invars[0]]
            return
        where, _ = self.where(eqn)
        if prim in _CARRIERS and eqn.invars and hasattr(eqn.invars[0], "val"):
            for v in eqn.outvars:  # zeros a gradient accumulates into, a filled mask: a constant
                self.names.setdefault(v, f"a constant {prim} at {where}")
            return
        what = _call_name(eqn) or prim
        roots = {self.roots.get(v) for v in eqn.invars if not hasattr(v, "val")}
        root = next(iter(roots)) if len(roots) == 1 else None
        if root is not None:
            # Computed from one parameter alone (token ids bounds-checked inside jnp.take): still that parameter.
            for v in eqn.outvars:
                self.roots[v] = root
                self.names.setdefault(v, f"{root} (through {what} at {where})")
            return
        for v in eqn.outvars:
            self.names.setdefault(v, f"the result of {what} at {where}")

    def _sub(self, eqn: Any, sub: Any, ins: list[Any]) -> list[Any]:
        jaxpr = getattr(sub, "jaxpr", sub)
        for inner, outer in zip(jaxpr.invars, eqn.invars):
            if not hasattr(outer, "val") and outer in self.names:
                self.names[inner] = self.names[outer]
            if not hasattr(outer, "val") and outer in self.roots:
                self.roots[inner] = self.roots[outer]
        self.calls.append(self.where(eqn))
        try:
            outs = self.walk(jaxpr, ins)
        finally:
            self.calls.pop()
        for inner, outer in zip(jaxpr.outvars, eqn.outvars):
            if hasattr(inner, "val"):
                continue
            if inner in self.roots:
                self.roots[outer] = self.roots[inner]
                self.names[outer] = self.names[inner]
            elif inner in self.names and inner in set(jaxpr.invars):
                self.names[outer] = self.names[inner]
        return outs

    def step(self, eqn: Any, ins: list[Any]) -> list[Any]:
        prim = eqn.primitive.name
        sub = next((eqn.params[k] for k in _CALL_JAXPR_PARAMS if k in eqn.params), None)
        if prim == "scan":
            return self._scan(eqn, ins)
        if prim == "while":
            return self._while(eqn, ins)
        if prim == "cond":
            branches = eqn.params["branches"]
            outs = [self._sub_cond(b, ins[1:]) for b in branches]
            return outs[0]
        if sub is not None and hasattr(getattr(sub, "jaxpr", sub), "eqns"):
            return self._sub(eqn, sub, ins)
        if prim in ("sharding_constraint",):
            spec = getattr(eqn.params.get("sharding"), "spec", PartitionSpec())
            return [_typed(eqn.outvars[0].aval, self.mesh, spec)]
        return self._primitive(eqn, ins)

    def _sub_cond(self, branch: Any, ins: list[Any]) -> list[Any]:
        return self.walk(branch.jaxpr, ins)

    def _scan(self, eqn: Any, ins: list[Any]) -> list[Any]:
        p = eqn.params
        nc, ncarry = scan_counts(p)
        body = scan_body(p)
        xs = [
            a.update(shape=a.shape[1:], sharding=NamedSharding(self.mesh, _spec(_entries(_spec_of(a), a.ndim)[1:])))
            for a in ins[nc + ncarry :]
        ]
        for k, (inner, outer) in enumerate(zip(body.invars, eqn.invars)):
            if not hasattr(outer, "val") and outer in self.names:
                # A stacked parameter scanned over: each step reads one layer's slice of it.
                self.names[inner] = self.names[outer] + ("[layer]" if k >= nc + ncarry else "")
        outs = self.walk(body, ins[: nc + ncarry] + xs)
        carry = outs[:ncarry]
        ys = [
            _typed(o, self.mesh, PartitionSpec(None, *_spec_of(a)))
            for o, a in zip([v.aval for v in eqn.outvars[ncarry:]], outs[ncarry:])
        ]
        return carry + ys

    def _while(self, eqn: Any, ins: list[Any]) -> list[Any]:
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry = ins[cn + bn :]
        self.walk(p["cond_jaxpr"].jaxpr, ins[:cn] + carry)
        return self.walk(p["body_jaxpr"].jaxpr, ins[cn : cn + bn] + carry)

    def _eval(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> list[Any]:
        out, _ = eqn.primitive.abstract_eval(*ins, **params)
        return list(out) if eqn.primitive.multiple_results else [out]

    def _params(self, eqn: Any) -> dict[str, Any]:
        """The equation's parameters with shardings traced on the Auto twin retyped onto the Explicit mesh."""
        params = dict(eqn.params)
        for k, v in params.items():
            if isinstance(v, NamedSharding):
                params[k] = NamedSharding(self.mesh, v.spec)
        return params

    def _primitive(self, eqn: Any, ins: list[Any]) -> list[Any]:
        from jax._src.core import ShardingTypeError

        params = self._params(eqn)
        try:
            return self._eval(eqn, ins, params)
        except ShardingTypeError as err:
            return self._finding(eqn, ins, params, str(err))
        except Exception:
            # Not a sharding rule's refusal (an internal check this walk cannot satisfy): say so, go on replicated.
            self.unchecked.add(eqn.primitive.name)
            return [_typed(v.aval, self.mesh, PartitionSpec()) for v in eqn.outvars]

    # -- findings and fixes -----------------------------------------------------------------------------------

    def fixes(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> list[tuple[Fix, list[Any]]]:
        """Every fix JAX accepts, with its result types, cheapest first (a priced cost before an upper bound)."""
        fixes = self._out_sharding_fixes(eqn, ins, params) + self._reshard_fixes(eqn, ins, params)
        fixes.sort(key=lambda f: (f[0].time_s, f[0].comm_bytes, not f[0].priced, f[0].kind != "out_sharding"))
        return fixes

    def _finding(self, eqn: Any, ins: list[Any], params: dict[str, Any], error: str) -> list[Any]:
        fixes = _unique(self.fixes(eqn, ins, params))
        followed = self._followed(eqn, ins, fixes) if fixes else None
        # The cheapest few, and the one the check goes on with (the user sees what later findings assume).
        fixes = fixes[:_MAX_FIXES] + [f for f in fixes[_MAX_FIXES:] if f is followed]
        if fixes:
            fixes.append((self._auto_axes_fix(eqn, ins, fixes[0]), fixes[0][1]))
        where, inside = self.where(eqn)
        operands = tuple(
            Operand(self.name(v), tuple(int(s) for s in a.shape), _spec_of(a)) for v, a in zip(eqn.invars, ins)
        )
        outs = followed[1] if followed else [_typed(v.aval, self.mesh, PartitionSpec()) for v in eqn.outvars]
        self.findings.append(
            Finding(
                len(self.findings),
                eqn.primitive.name,
                where,
                inside,
                operands,
                tuple(int(s) for s in eqn.outvars[0].aval.shape),
                error,
                tuple(f for f, _ in fixes),
                _spec_of(outs[0]),
            )
        )
        return outs

    def _followed(self, eqn: Any, ins: list[Any], fixes: list[tuple[Fix, list[Any]]]) -> tuple[Fix, list[Any]]:
        """The fix whose result types the rest of the check assumes.

        A matmul's: the one that keeps the operands' splits of the free dims on the result and sums the contracted
        split away (a row-parallel layer summed back to the batch's layout, as Megatron does), where JAX accepts it.
        Another op's: the one that keeps the most mesh axes splitting the result, cheapest among those.  Following
        merely the cheapest (a reduce-scatter onto the batch dim, or indices gathered whole) would make every later
        op meet a layout the user did not choose, and report mismatches of einshard's making.
        """
        if eqn.primitive.name in ("dot_general", "gather"):
            candidates = self._out_candidates(eqn, ins)
            keeps = _spec(candidates[0]) if candidates else None
            for fix in fixes:
                if fix[0].kind == "out_sharding" and fix[0].spec == keeps:
                    return fix

        if eqn.primitive.name.startswith("scatter"):
            # A scatter's result is its operand updated: it keeps the operand's layout (a gradient's
            # scatter-add must match its parameter's type, or JAX's transpose refuses it).
            for fix in fixes:
                if _spec_of(fix[1][0]) == _spec_of(ins[0]):
                    return fix

        def kept(fix: tuple[Fix, list[Any]]) -> int:
            return sum(len(d) for d in _entries(_spec_of(fix[1][0]), len(fix[1][0].shape)))

        return max(fixes, key=kept)  # max keeps the first (cheapest) of equals

    def _legal(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> list[Any] | None:
        from jax._src.core import ShardingTypeError

        try:
            return self._eval(eqn, ins, params)
        except (ShardingTypeError, ValueError, TypeError):
            return None

    def _out_candidates(self, eqn: Any, ins: list[Any]) -> list[list[tuple[str, ...]]]:
        """Result layouts worth trying: the operands' splits carried to the result, the rest placed or dropped."""
        out_shape = tuple(int(s) for s in eqn.outvars[0].aval.shape)
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            le, re_ = _entries(_spec_of(ins[0]), ins[0].ndim), _entries(_spec_of(ins[1]), ins[1].ndim)
            base = [le[i] for i in lb]
            base += [le[i] for i in range(len(le)) if i not in lb and i not in lc]
            base += [re_[j] for j in range(len(re_)) if j not in rb and j not in rc]
            moving = tuple(dict.fromkeys(m for i in lc for m in le[i])) or tuple(
                dict.fromkeys(m for j in rc for m in re_[j])
            )
        elif eqn.primitive.name == "gather":
            base = _gather_result_dims(eqn, ins)
            moving = tuple(dict.fromkeys(m for a in ins for d in _entries(_spec_of(a), a.ndim) for m in d))
        else:
            base = [() for _ in out_shape]
            moving = tuple(dict.fromkeys(m for a in ins for d in _entries(_spec_of(a), a.ndim) for m in d))
        cands: list[list[tuple[str, ...]]] = []
        # A mesh axis the result would split twice (both operands' free dims) keeps its first use, or its last.
        for start in (_first_uses(base), _first_uses(base[::-1])[::-1]):
            used = {m for d in start for m in d}
            rest = tuple(m for m in moving if m not in used)
            cands.append(list(start))
            if rest:
                for i in range(len(out_shape)):
                    dims = list(start)
                    dims[i] = tuple(dims[i]) + rest
                    cands.append(dims)
        unique = list({tuple(c): c for c in cands}.values())
        return [c for c in unique if _divides(out_shape, c, self.sizes)]

    def _out_sharding_fixes(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> list[tuple[Fix, list[Any]]]:
        prim = eqn.primitive.name
        key = _OUT_SHARDING_PARAM.get(prim)
        out: list[tuple[Fix, list[Any]]] = []
        if key is not None and key in params:
            for dims in self._out_candidates(eqn, ins):
                spec = _spec(dims)
                trial = dict(params, **{key: NamedSharding(self.mesh, spec)})
                got = self._legal(eqn, ins, trial)
                if got is None:
                    continue
                try:
                    colls, priced = self._price_out(eqn, ins, spec), True
                except EinshardError:  # no layout change einshard can price: the gathered upper bound
                    colls, priced = self._price_gathered(eqn, ins), False
                code = f"pass out_sharding={_p(spec)} to {_OUT_SHARDING_CALL[prim]}"
                out.append((self._fix("out_sharding", spec, None, code, colls, priced), got))
        elif prim in _AT_CALL:
            for dims in self._out_candidates(eqn, ins):
                spec = _spec(dims)
                aval = _typed(eqn.outvars[0].aval, self.mesh, spec)
                colls = self._price_indexing(eqn, ins, spec)
                code = _AT_CALL[prim].replace("out_sharding=...", f"out_sharding={_p(spec)}")
                out.append((self._fix("out_sharding", spec, None, code, colls, False), [aval]))
        return out

    def _reshard_fixes(self, eqn: Any, ins: list[Any], params: dict[str, Any]) -> list[tuple[Fix, list[Any]]]:
        """Reshard one operand first: drop its split on one axis, or all of them."""
        out: list[tuple[Fix, list[Any]]] = []
        for k, (v, a) in enumerate(zip(eqn.invars, ins)):
            dims = _entries(_spec_of(a), a.ndim)
            if not any(dims):
                continue
            variants = [[d if j != i else () for j, d in enumerate(dims)] for i in range(len(dims)) if dims[i]]
            variants.append([() for _ in dims])
            for new in variants:
                spec = _spec(new)
                trial_ins = list(ins)
                trial_ins[k] = a.update(sharding=NamedSharding(self.mesh, spec))
                got = self._legal(eqn, trial_ins, params)
                if got is None:
                    continue
                colls = self.costs.reshard(
                    _layout(a.shape, _spec_of(a), self.axes), _layout(a.shape, spec, self.axes), a.dtype
                )
                code = f"reshard operand {k + 1} ({self.name(v)}) first: jax.reshard(x, {_p(spec)})"
                out.append((self._fix("reshard", spec, k, code, tuple(colls), True), got))
        return out

    def _auto_axes_fix(self, eqn: Any, ins: list[Any], best: tuple[Fix, list[Any]]) -> Fix:
        spec = _spec_of(best[1][0])
        code = f"wrap the op in jax.sharding.auto_axes(f, out_sharding={_p(spec)}) (XLA chooses its collectives)"
        if eqn.primitive.name in _AT_CALL:
            colls = self._price_indexing(eqn, ins, spec)
        else:
            colls = self._price_gathered(eqn, ins)
        return self._fix("auto_axes", spec, None, code, colls, False)

    def _fix(
        self, kind: FixKind, spec: PartitionSpec, operand: int | None, code: str, colls: Sequence[Any], priced: bool
    ) -> Fix:
        colls = tuple(colls)
        return Fix(
            kind,
            spec,
            operand,
            code,
            colls,
            float(sum(c.bytes for c in colls)),
            float(sum(getattr(c, "time", 0.0) for c in colls)),
            priced,
        )

    def _price_out(self, eqn: Any, ins: list[Any], spec: PartitionSpec) -> tuple[Any, ...]:
        """What asking for the result laid out as ``spec`` costs (einshard's pricing of the layout change)."""
        out_aval = eqn.outvars[0].aval
        shape = tuple(int(s) for s in out_aval.shape)
        dst = _layout(shape, spec, self.axes)
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            le, re_ = _entries(_spec_of(ins[0]), ins[0].ndim), _entries(_spec_of(ins[1]), ins[1].ndim)
            lsum = [m for i in lc for m in le[i]]
            rsum = [m for j in rc for m in re_[j]]
            summed = frozenset(lsum or rsum)
            natural = [le[i] for i in lb]
            natural += [le[i] for i in range(len(le)) if i not in lb and i not in lc]
            natural += [re_[j] for j in range(len(re_)) if j not in rb and j not in rc]
            seen: set[str] = set(summed)
            dims = []
            for d in natural:
                keep = tuple(m for m in d if m not in seen)
                seen.update(keep)
                dims.append(keep)
            colls: tuple[Any, ...] = ()
            if lsum and rsum and lsum != rsum:
                # The operands split the contraction differently: one is brought to the other's split first.
                b = ins[1]
                bd = _entries(_spec_of(b), b.ndim)
                moved = {m for i in lc for m in le[i]}
                fixed = [
                    tuple(le[lc[rc.index(j)]]) if j in rc else tuple(m for m in d if m not in moved)
                    for j, d in enumerate(bd)
                ]
                colls += self.costs.reshard(
                    _layout(b.shape, _spec_of(b), self.axes), _layout(b.shape, _spec(fixed), self.axes), b.dtype
                )
            src = _layout(shape, _spec(dims), self.axes, summed)
            return colls + tuple(self.costs.reshard(src, dst, out_aval.dtype))
        # A reshape (or another op asked for a layout): the operand gathered where the op cannot split it.
        return self._price_gathered(eqn, ins, spec)

    def _price_indexing(self, eqn: Any, ins: list[Any], spec: PartitionSpec) -> tuple[Any, ...]:
        """An upper bound of a gather or scatter XLA lays out (``.at[...](out_sharding=)`` runs it with the axes
        Auto): the operand gathered whole over its splits; then each device gathers its own indices' rows (a
        gather), or scatters its own updates into its copy, the copies summed over the axes splitting the
        indices or updates (a scatter); the result sliced to ``spec`` (free)."""
        operand = ins[0]
        src = _layout(operand.shape, _spec_of(operand), self.axes)
        colls = tuple(self.costs.reshard(src, src.with_dims(tuple(() for _ in src.dims)), operand.dtype))
        if eqn.primitive.name.startswith("scatter"):
            summed = frozenset(m for a in ins[1:] for d in _entries(_spec_of(a), a.ndim) for m in d)
            out = eqn.outvars[0].aval
            if summed:
                pending = _layout(out.shape, PartitionSpec(), self.axes, summed)
                keep = [tuple(m for m in d if m not in summed) for d in _entries(spec, len(out.shape))]
                colls += tuple(self.costs.reshard(pending, _layout(out.shape, _spec(keep), self.axes), out.dtype))
        return colls

    def _price_gathered(self, eqn: Any, ins: list[Any], spec: PartitionSpec | None = None) -> tuple[Any, ...]:
        """The upper bound of an op XLA lays out: its split operands gathered whole (the slicing after is free).

        A reshape whose result keeps the operand's blocks (the major dim's split carried to the merged or the
        first split dim) moves nothing: that case is free.
        """
        if (
            eqn.primitive.name == "reshape"
            and spec is not None
            and _reshape_keeps_blocks(ins[0], eqn, spec, self.sizes)
        ):
            return ()
        colls: tuple[Any, ...] = ()
        for a in ins:
            dims = _entries(_spec_of(a), a.ndim)
            if any(dims):
                src = _layout(a.shape, _spec_of(a), self.axes)
                colls += tuple(self.costs.reshard(src, src.with_dims(tuple(() for _ in dims)), a.dtype))
        return colls


class _Namer(_Walk):
    """The walk's naming alone (no typing): each value's name in the user's words and each equation's source line,
    for ``einshard.explain``'s report (the ops and collectives it lists say where they are and what they read)."""

    def __init__(self, axes: tuple[MeshAxis, ...]) -> None:
        super().__init__(AbstractMesh((), ()), axes, None)  # (an empty mesh: naming types nothing)
        self.eqn_where: dict[int, tuple[str, str]] = {}
        self._held: list[Any] = []  # the equations eqn_where names, held so their ids stay theirs
        self._last: tuple[Any, tuple[str, str]] | None = None  # the equation being named and its line

    def where(self, eqn: Any) -> tuple[str, str]:
        # An equation's line is asked when it is named and again when its outputs are (same call stack between:
        # step pushes and pops its own): found once (from its traceback: most of a deep model's naming).
        last = self._last
        if last is not None and last[0] is eqn:
            return last[1]
        return super().where(eqn)

    def walk(self, jaxpr: Any, in_avals: Sequence[Any]) -> list[Any]:
        for eqn in jaxpr.eqns:
            where = self.eqn_where[id(eqn)] = self.where(eqn)
            self._held.append(eqn)
            self.step(eqn, [None] * len(eqn.invars))
            self._last = (eqn, where)
            self._name_outputs(eqn)
            self._last = None
        return [None] * len(jaxpr.outvars)

    def step(self, eqn: Any, ins: list[Any]) -> list[Any]:
        if eqn.primitive.name in ("scan", "sharding_constraint"):
            if eqn.primitive.name == "scan":
                self._name_scan_body(eqn)
            return [None] * len(eqn.outvars)
        return super().step(eqn, ins)

    def _name_scan_body(self, eqn: Any) -> None:
        p = eqn.params
        n = sum(scan_counts(p))
        body = scan_body(p)
        for k, (inner, outer) in enumerate(zip(body.invars, eqn.invars)):
            if not hasattr(outer, "val") and outer in self.names:
                self.names[inner] = self.names[outer] + ("[layer]" if k >= n else "")
        self.calls.append(self.where(eqn))
        try:
            self.walk(body, [])
        finally:
            self.calls.pop()

    def _primitive(self, eqn: Any, ins: list[Any]) -> list[Any]:
        return [None] * len(eqn.outvars)


def value_names(
    jaxpr: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], axes: tuple[MeshAxis, ...]
) -> tuple[dict[Any, str], dict[int, tuple[str, str]]]:
    """Each value of ``jaxpr`` (``fn`` traced on ``args``, ``kwargs``) named in the user's words, as
    :func:`check_explicit` names operands (``params.dense.kernel``, ``tokens (through ...)``, ``the result of relu at
    model.py:12``), and each equation's source line and the library line it is inside (by ``id`` of the equation)."""
    namer = _Namer(axes)
    for v, n in zip(jaxpr.invars, _arg_names(fn, args, kwargs)):
        namer.names[v] = namer.roots[v] = n
    namer.walk(jaxpr, [])
    return namer.names, namer.eqn_where


def _reshape_keeps_blocks(operand: Any, eqn: Any, spec: PartitionSpec, sizes: dict[str, int]) -> bool:
    """Whether every device's block of the reshaped result is its block of the operand, reshaped (no data moves).

    True where the operand's splits are all on dims that start a merged group (or are split whole into a
    group whose first dim the split divides), and the result carries each such split on that group's first dim.
    """
    src = [int(s) for s in operand.shape]
    dst = [int(s) for s in eqn.params["new_sizes"]]
    sdims = _entries(_spec_of(operand), len(src))
    ddims = _entries(spec, len(dst))
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    return False
                a *= src[i]
                gi.append(i)
            else:
                j += 1
                if j >= len(dst):
                    return False
                b *= dst[j]
                gj.append(j)
        # Only the group's first operand dim may be split; it goes to the group's first result dim.
        if any(sdims[k] for k in gi[1:]) or any(ddims[k] for k in gj[1:]):
            return False
        split = sdims[gi[0]]
        if ddims[gj[0]] != split:
            return False
        if split and dst[gj[0]] % math.prod(sizes[m] for m in split):
            return False
        i += 1
        j += 1
    return all(not d for d in sdims[i:]) and all(not d for d in ddims[j:])


def _gather_result_dims(eqn: Any, ins: list[Any]) -> list[tuple[str, ...]]:
    """A gather's result split as its inputs say: the batch dims as the indices' dims, the slice's dims as the
    operand's dims they are taken whole from (a dim the gather indexes into, or slices part of, is whole)."""
    operand, indices = ins[0], ins[1]
    dn = eqn.params["dimension_numbers"]
    out_rank = len(eqn.outvars[0].aval.shape)
    od, id_ = _entries(_spec_of(operand), operand.ndim), _entries(_spec_of(indices), indices.ndim)
    sliced = [
        i
        for i in range(operand.ndim)
        if i not in dn.collapsed_slice_dims and i not in getattr(dn, "operand_batching_dims", ())
    ]
    batch_dims = iter(id_[:-1])  # the last indices dim is the index vector
    slice_dims = iter(sliced)
    out: list[tuple[str, ...]] = []
    for k in range(out_rank):
        if k in dn.offset_dims:
            i = next(slice_dims, None)
            whole = i is not None and eqn.params["slice_sizes"][i] == operand.shape[i]
            out.append(od[i] if i is not None and whole else ())
        else:
            out.append(next(batch_dims, ()))
    return _first_uses(out)


def _call_name(eqn: Any) -> str | None:
    """The function a call equation calls (``relu`` for ``jax.nn.relu``'s custom_jvp_call), where JAX kept it."""
    if isinstance(eqn.params.get("name"), str):
        return str(eqn.params["name"])
    sub = next((eqn.params[k] for k in _CALL_JAXPR_PARAMS if k in eqn.params), None)
    info = getattr(getattr(sub, "jaxpr", sub), "debug_info", None)
    name = getattr(info, "func_name", None)
    return name.split(" ")[0] if isinstance(name, str) and name else None


def _first_uses(dims: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """``dims`` with a mesh axis that splits two dims kept on the first only (a NamedSharding uses each once)."""
    used: set[str] = set()
    out = []
    for d in dims:
        keep = tuple(m for m in d if m not in used)
        used.update(keep)
        out.append(keep)
    return out


def _unique(fixes: list[tuple[Fix, list[Any]]]) -> list[tuple[Fix, list[Any]]]:
    seen: set[str] = set()
    out = []
    for f in fixes:
        if f[0].code not in seen:
            seen.add(f[0].code)
            out.append(f)
    return out


def _p(spec: PartitionSpec) -> str:
    parts = [repr(e) if e is not None else "None" for e in spec]
    return "P(" + ", ".join(parts) + ")"


def _first_sentence(msg: str) -> str:
    line = msg.strip().splitlines()[0] if msg.strip() else msg
    return line if len(line) <= 240 else line[:237] + "..."


# -- the entry point -----------------------------------------------------------------------------------------


def _arg_names(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """The user's names for the flattened argument leaves: the parameter's name and the leaf's path in it."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names: list[str] = []
    for i, a in enumerate(args):
        base = positional[i] if i < len(positional) else f"args[{i}]"
        names += _leaf_names(base, a)
    for k, a in kwargs.items():
        names += _leaf_names(k, a)
    return names


def _leaf_names(base: str, tree: Any) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = []
    for path, _ in leaves:
        text = jax.tree_util.keystr(path, simple=True, separator=".") if path else ""
        out.append(f"{base}.{text}" if text else base)
    return out


def _leaf_specs(
    leaves: list[Any], in_specs: Any, args: tuple[Any, ...], axes: tuple[MeshAxis, ...]
) -> list[PartitionSpec]:
    if in_specs is not None:
        from .program.trace import arg_layouts

        return [lay.to_spec() for lay in arg_layouts(args, in_specs, axes)]
    out = []
    for x in leaves:
        s = x.sharding if isinstance(x, jax.ShapeDtypeStruct) else getattr(x, "sharding", None)
        out.append(_spec(_entries(getattr(s, "spec", None), len(np.shape(x)))))
    return out


def _static_bound(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], list[bool]]:
    """``fn`` with its arguments' leaves that are not arrays (a PartitionSpec, a flag, a Python number) bound
    as constants, as ``jax.jit(static_argnames=...)`` would treat them; and which leaves stay arguments."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    keep = [hasattr(x, "shape") and hasattr(x, "dtype") for x in flat]
    if all(keep):
        return fn, args, kwargs, keep

    def bound(*dynamic: Any) -> Any:
        it = iter(dynamic)
        a, k = jax.tree_util.tree_unflatten(tree, [next(it) if d else x for d, x in zip(keep, flat)])
        return fn(*a, **k)

    return bound, tuple(x for x, d in zip(flat, keep) if d), {}, keep


def _current_mesh() -> Any:
    from ..core.mesh import current_mesh

    return current_mesh()


def _sds_mesh(leaves: list[Any]) -> Any:
    for x in leaves:
        s = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
        if isinstance(s, NamedSharding):
            return s.mesh
    return None


def _shape_only(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in np.shape(x)), x.dtype)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _past_sharding_errors(decide: Callable[..., Any]) -> Iterator[list[str]]:
    """Tracing in which an op JAX's sharding rules reject gets the result sharding ``decide`` gives, instead of
    stopping the trace (as if the user had applied that fix), so everything after it is typed by JAX as it will be.

    It replaces, while it lasts, the one function through which JAX's standard primitives call their sharding
    rule (``jax._src.lax.utils.call_shape_dtype_sharding_rule``) and the abstract-evaluation cache (which must
    not keep a result typed past an error).  Where that internal API has moved, it raises ``LookupError`` and the
    caller traces without layouts instead.  If an error was passed, JAX's tracing caches are cleared after, so
    no later ``jax.jit`` of the user's reuses a trace typed past an error (it must raise as it would have).
    The replacement is process-wide: check_explicit calls are serialised by a lock, but another thread tracing
    its own program at the same moment would pass its sharding errors too (run the check from one thread).
    """
    from jax._src.core import ShardingTypeError

    try:
        from jax._src.interpreters import partial_eval as pe
        from jax._src.lax import utils as lax_utils

        original = lax_utils.call_shape_dtype_sharding_rule
        cached = pe._cached_abstract_eval
    except (ImportError, AttributeError) as err:
        raise LookupError(str(err)) from None
    passed: list[str] = []

    def patched(
        prim: Any,
        shape_rule: Any,
        dtype_rule: Any,
        sharding_rule: Any,
        ur_rule: Any,
        multi_out: bool,
        *avals: Any,
        **params: Any,
    ) -> Any:
        try:
            return original(prim, shape_rule, dtype_rule, sharding_rule, ur_rule, multi_out, *avals, **params)
        except ShardingTypeError:
            if multi_out:
                raise
            shape, dtype = shape_rule(*avals, **params), dtype_rule(*avals, **params)
            sharding = decide(prim, list(avals), params, shape, dtype)
            if sharding is None:
                raise
            passed.append(prim.name)
            return shape, dtype, sharding

    def uncached(primitive: Any, *avals: Any, **params: Any) -> Any:
        return primitive.abstract_eval(*avals, **params)

    with _PATCH_LOCK:
        lax_utils.call_shape_dtype_sharding_rule = patched
        pe._cached_abstract_eval = uncached
        try:
            yield passed
        finally:
            lax_utils.call_shape_dtype_sharding_rule = original
            pe._cached_abstract_eval = cached
            if passed:
                jax.clear_caches()


class _Eqn:
    """An equation being traced (what a fix's search reads of one): its primitive, parameters and result."""

    def __init__(self, prim: Any, n_in: int, params: dict[str, Any], shape: Any, dtype: Any) -> None:
        self.primitive = prim
        self.params = params
        self.invars = [object() for _ in range(n_in)]
        self.outvars = [_Var(jax.core.ShapedArray(tuple(shape), dtype))]
        self.source_info = None


class _Var:
    def __init__(self, aval: Any) -> None:
        self.aval = aval


class Refused(Exception):
    """JAX refused the program while tracing it with its layouts, not through a sharding rule the check can
    pass: its message and the user's line."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.message, self.where = message, where


def plain_message(msg: str) -> str:
    """An exception's message on one line, without terminal colours (Keras adds them), at most 400 characters."""
    text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", msg).split())
    text = text.split(" -------------------- ")[0]  # JAX's note on its filtered traceback
    return text if len(text) <= 400 else text[:397] + "..."


def user_line(err: BaseException) -> str:
    """The innermost frame of ``err``'s traceback that is the user's (not JAX's, a library's or einshard's)."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__) if not _is_library(f.filename)]
    frames = [f for f in frames if "/jax/" not in f.filename]
    if not frames:
        return "unknown"
    f = frames[-1]
    return f"{_short_path(f.filename)}:{f.lineno} ({f.name})"


def typed_jaxpr(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: AbstractMesh,
    specs: Sequence[Any],
    walk: _Walk,
) -> Any:
    """``fn``'s jaxpr traced by JAX with the arguments' layouts on the Explicit ``mesh``, past the ops its sharding
    rules reject (each given the result layout of the fix the check assumes): every later op, the backward
    pass's included, is typed by JAX itself.  Raises ``LookupError`` where this cannot be done (JAX's internals
    moved, or JAX refuses the program somewhere this cannot pass)."""
    from jax._src.core import ShardingTypeError

    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    typed = [
        jax.ShapeDtypeStruct(tuple(int(d) for d in np.shape(x)), x.dtype, sharding=NamedSharding(mesh, s))
        for x, s in zip(flat, specs)
    ]
    s_args, s_kwargs = jax.tree_util.tree_unflatten(tree, typed)

    def decide(prim: Any, avals: list[Any], params: dict[str, Any], shape: Any, dtype: Any) -> Any:
        eqn = _Eqn(prim, len(avals), dict(params), shape, dtype)
        fixes = _unique(walk.fixes(eqn, avals, dict(params)))
        if not fixes:
            return None
        return walk._followed(eqn, avals, fixes)[1][0].sharding

    try:
        with _past_sharding_errors(decide), jax.sharding.use_abstract_mesh(mesh):
            return jax.make_jaxpr(fn, return_shape=True)(*s_args, **s_kwargs)
    except (ShardingTypeError, ValueError, TypeError) as err:
        # JAX refused the program for a reason no sharding rule gave (a value closed over inside auto_axes, a
        # scan whose carry changes layout): the user must hear it, with their line.
        raise Refused(plain_message(str(err)), user_line(err)) from None


def untyped_jaxpr(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], mesh: AbstractMesh) -> Any:
    """``fn``'s jaxpr traced so that JAX's sharding rules cannot stop it: on arguments of the right shapes
    but no layout (replicated), under the Explicit ``mesh``, where no op is ambiguous and the user's own
    ``out_sharding=`` / ``jax.reshard`` calls still trace; else (a function JAX refuses even so) on the mesh's
    Auto twin, where JAX decides nothing while tracing."""
    from jax._src.core import ShardingTypeError

    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    s_args, s_kwargs = jax.tree_util.tree_unflatten(tree, [_shape_only(x) for x in flat])
    try:
        with jax.sharding.use_abstract_mesh(_abstract(mesh)):
            return jax.make_jaxpr(fn, return_shape=True)(*s_args, **s_kwargs)
    except (ShardingTypeError, ValueError, TypeError):
        with jax.sharding.use_abstract_mesh(auto_twin(_abstract(mesh))):
            return jax.make_jaxpr(fn, return_shape=True)(*s_args, **s_kwargs)


def check_explicit(
    fn: Callable[..., Any],
    *args: Any,
    mesh: MeshLike | None = None,
    in_specs: Any = None,
    profile: Any = None,
    **kwargs: Any,
) -> ExplicitReport:
    """Name every op of ``fn(*args, **kwargs)`` that JAX's explicit sharding rejects, with fixes and their costs.

    Args:
        fn: any JAX function (a forward pass, a loss, ``jax.grad`` of one, a train step).
        args: arrays placed on the mesh, ``jax.ShapeDtypeStruct``s with ``sharding=``, or pytrees of them
            (NNX states included).
        mesh: a Mesh, or axis sizes ``{'data': 4, 'model': 2}`` (then every axis Explicit, as ``jax.make_mesh``
            makes them); default the arguments' mesh, else the current mesh (``jax.set_mesh``).
        in_specs: layouts for arguments that carry none, as ``einshard.explain`` takes them.
        profile: the hardware profile for the fixes' costs (see ``einshard.analyze``).

    Returns:
        An :class:`ExplicitReport`: each rejected op with its source line, the parameter paths it reads,
        JAX's message and the fixes JAX accepts, cheapest first.  ``str()`` prints it; ``to_dict()`` for tools.

    Example:
        >>> import jax, jax.numpy as jnp, einshard
        >>> from jax.sharding import PartitionSpec as P
        >>> def f(x, w):
        ...     return x @ w
        >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
        >>> w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
        >>> r = einshard.check_explicit(f, x, w, mesh={'data': 4, 'model': 2},
        ...                             in_specs=(P('data', 'model'), P('model', None)))
        >>> r.findings[0].primitive, r.findings[0].where
        ('dot_general', '<doctest einshard._src.analysis.explicit.check_explicit[2]>:2 (f)')
        >>> print(r.findings[0].fixes[0].code)
        pass out_sharding=P(('data', 'model'), None) to the matmul (jnp.matmul / jnp.dot / jnp.einsum / lax.dot_general)
    """
    from .._checks import check_callable, naming

    check_callable(fn, "check_explicit()", "fn")
    with naming("check_explicit()", "in_specs"):
        return explicit_check(fn, args, kwargs, mesh=mesh, in_specs=in_specs, profile=profile)[0]


def explicit_check(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    mesh: MeshLike | None = None,
    in_specs: Any = None,
    profile: Any = None,
) -> tuple[ExplicitReport, Any, Any]:
    """:func:`check_explicit`'s work, with the jaxpr it typed and the output's shape: the program as JAX will
    type it once the assumed fixes are applied (``einshard.explain`` costs that one where JAX refuses the
    program as written)."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if isinstance(mesh, dict):
        from ..core.mesh import as_mesh

        m = explicit_twin(as_mesh(mesh))
    elif mesh is None and _current_mesh() is None and _sds_mesh(leaves) is not None:
        m = _sds_mesh(leaves)  # shape-only arguments typed with a NamedSharding carry their mesh
    else:
        m = resolve_mesh(mesh, leaves, what="check_explicit()")
    from ..core.mesh import mesh_axes

    axes = mesh_axes(m)
    explicit = _abstract(m)
    names_of = [n for n, t in zip(explicit.axis_names, explicit.axis_types) if t == AxisType.Explicit]
    if not names_of:
        raise EinshardError(
            f"check_explicit(): the mesh {dict(zip(explicit.axis_names, explicit.axis_sizes))} has no Explicit axes; "
            "JAX checks shardings while tracing only on Explicit axes",
            hint="Make the mesh with jax.make_mesh(...) (Explicit by default), or pass mesh={'data': 4, ...}.",
        )
    specs = (
        _leaf_specs(leaves, in_specs, args, axes)
        if in_specs is None
        else _leaf_specs(jax.tree_util.tree_leaves(args), in_specs, args, axes)
        + _leaf_specs(jax.tree_util.tree_leaves(kwargs), None, (), axes)
    )
    names = _arg_names(fn, args, kwargs)
    fn, args, kwargs, keep = _static_bound(fn, args, kwargs)
    specs = [s for s, k in zip(specs, keep) if k]
    names = [n for n, k in zip(names, keep) if k]
    walk = _Walk(explicit, axes, profile)
    refused = ""
    try:
        closed, out_shape = typed_jaxpr(fn, args, kwargs, explicit, specs, walk)
        walk.typed = True
    except (LookupError, Refused) as err:
        if isinstance(err, Refused):
            refused = f"{err.message} (at {err.where})"
        try:
            closed, out_shape = untyped_jaxpr(fn, args, kwargs, explicit)
        except Exception as again:
            if not refused:
                raise EinshardError(f"check_explicit(): JAX cannot trace the function: {again}") from None
            report = ExplicitReport((), (), axes, tuple(names_of), refused)
            return report, None, None
    for v, n in zip(closed.jaxpr.invars, names):
        walk.names[v] = walk.roots[v] = n
    in_avals = [_typed(v.aval, explicit, s) for v, s in zip(closed.jaxpr.invars, specs)]
    with jax.sharding.use_abstract_mesh(explicit):
        walk.walk(closed.jaxpr, in_avals)
    report = ExplicitReport(tuple(walk.findings), tuple(sorted(walk.unchecked)), axes, tuple(names_of), refused)
    return report, closed, out_shape
