"""Whole-program analysis: ``einshard.explain(fn, *args)``.

Traces ``fn`` to a jaxpr and walks it once, following each value's
:class:`~einshard.core.layout.Layout` from the arguments' shardings through
elementwise ops, broadcasts, reshapes, transposes, reductions and nested
``jit``/``scan``/``remat``/custom-derivative sub-jaxprs.  Every ``dot_general``
(einsum, matmul, dense layer, attention) is handed to :func:`einshard.analyze`
as an annotated einsum; where a value's layout must change (conflicting
operands, reductions over sharded axes, sharding constraints) the collective
comes from the analyzer's ``transition``.  Operations it cannot follow are
listed by name in the report, never silently guessed.

Nothing here moves data or compiles: the walk is far cheaper than
``jax.jit(fn).lower(...).compile()`` (see ``benchmarks/bench_analysis.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..core.layout import Layout, MeshAxis
from ..errors import EinshardError
from .api import _mesh_axes, analyze_layouts, dtype_info, spec_partitions
from .cost import Collective, get_profile
from .plan import side_string
from .primitives import transition
from .rule import Problem

__all__ = ["explain", "trace", "TracedProgram", "ProgramReport", "OpReport"]


# ---------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class OpReport:
    """One operation of the program that computes or communicates."""

    index: int
    primitive: str
    phase: str  # 'forward' or 'backward'
    expression: str  # the annotated einsum for dots, else a short description
    out_layout: Layout | None
    collectives: tuple[Any, ...]  # einshard.Collective
    flops: float
    time_s: float
    repeat: int = 1  # how many times it runs (scan length)
    note: str = ""

    @property
    def comm_bytes(self) -> float:
        return self.repeat * sum(c.bytes for c in self.collectives)


@dataclass(frozen=True)
class ProgramReport:
    """What a whole step costs under the arguments' layouts.

    Attributes:
        ops: the operations that compute (dots) or communicate, in program order.
        flops: FLOPs per device, all ops.
        comm_bytes: bytes each device sends, all collectives.
        comm_count: number of collectives (scan bodies counted per iteration).
        peak_bytes: peak live bytes per device (arguments included), from a liveness walk.
        time_s: estimated step time on the profile (compute + communication, no overlap).
        phases: per phase ('forward', 'backward') totals of flops, bytes, count and time.
        unfollowed: primitives whose layout rule einshard does not know (outputs assumed replicated).
        analysis_s: how long the analysis took.
    """

    ops: tuple[OpReport, ...]
    flops: float
    comm_bytes: float
    comm_count: int
    peak_bytes: int
    time_s: float
    phases: dict[str, dict[str, float]]
    unfollowed: tuple[str, ...]
    mesh: tuple[MeshAxis, ...]
    profile: Any
    analysis_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": {m.name: m.size for m in self.mesh},
            "flops": self.flops,
            "comm_bytes": self.comm_bytes,
            "comm_count": self.comm_count,
            "peak_bytes": self.peak_bytes,
            "time_s": self.time_s,
            "phases": self.phases,
            "unfollowed": list(self.unfollowed),
            "analysis_s": self.analysis_s,
            "ops": [
                {
                    "index": op.index,
                    "primitive": op.primitive,
                    "phase": op.phase,
                    "expression": op.expression,
                    "out": str(op.out_layout) if op.out_layout is not None else None,
                    "collectives": [
                        {"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes * op.repeat} for c in op.collectives
                    ],
                    "flops": op.flops * op.repeat,
                    "time_s": op.time_s * op.repeat,
                    "repeat": op.repeat,
                    "note": op.note,
                }
                for op in self.ops
            ],
        }

    def __str__(self) -> str:
        mesh = ", ".join(f"{m.name}={m.size}" for m in self.mesh)
        lines = [f"mesh: {mesh}   profile: {getattr(self.profile, 'name', self.profile)}"]
        header = f"{'#':>4}  {'phase':<8} {'op':<40} {'collectives':<44} {'GFLOP/dev':>10} {'comm/dev':>10}"
        lines.append(header)
        lines.append("-" * len(header))
        for op in self.ops:
            colls = ", ".join(f"{c.kind}@{'·'.join(c.axes)}" for c in op.collectives) or "-"
            rep = f" ×{op.repeat}" if op.repeat > 1 else ""
            lines.append(
                f"{op.index:>4}  {op.phase:<8} {(op.expression + rep)[:40]:<40} {colls[:44]:<44} "
                f"{op.flops * op.repeat / 1e9:>10.3f} {_bytes(op.comm_bytes):>10}"
            )
        lines.append("-" * len(header))
        for phase, tot in self.phases.items():
            lines.append(
                f"{phase:<9} {tot['flops'] / 1e9:.3f} GFLOP/device, {int(tot['count'])} collectives, "
                f"{_bytes(tot['bytes'])} sent/device, ~{tot['time_s'] * 1e3:.3f} ms"
            )
        lines.append(
            f"total     {self.flops / 1e9:.3f} GFLOP/device, {self.comm_count} collectives, "
            f"{_bytes(self.comm_bytes)} sent/device, peak {_bytes(self.peak_bytes)}/device, "
            f"~{self.time_s * 1e3:.3f} ms/step (no overlap)"
        )
        if self.unfollowed:
            lines.append("not followed (outputs assumed replicated): " + ", ".join(self.unfollowed))
        lines.append(f"analysed in {self.analysis_s * 1e3:.1f} ms")
        return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---------------------------------------------------------------------------
# The rules the walk needs from the per-einsum analyzer


@dataclass(frozen=True)
class _DotResult:
    out: Layout
    collectives: tuple[Any, ...]
    flops: float
    time_s: float
    expression: str


class _Rules:
    """Adapters onto the per-einsum analyzer: one einsum, one layout change."""

    def __init__(self, mesh: tuple[MeshAxis, ...], profile: Any) -> None:
        self.mesh = mesh
        self.mesh_sizes = {m.name: m.size for m in mesh}
        self.profile = get_profile(profile)
        # Per-op costs, keyed by the operands' layouts: a traced program costed
        # under many argument layouts (the planner) meets the same einsums again and again.
        self._dots: dict[tuple[Any, ...], _DotResult] = {}
        self._reshards: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.layouts: dict[tuple[Any, ...], Layout] = {}  # (shape, dims) -> Layout, as the walk builds them

    def dot(self, lhs: Layout, rhs: Layout, dimension_numbers: Any, dtype: Any) -> _DotResult:
        key = (lhs, rhs, _hashable(dimension_numbers), str(dtype))
        hit = self._dots.get(key)
        if hit is None:
            hit = self._dots[key] = self._dot(lhs, rhs, dimension_numbers, dtype)
        return hit

    def _dot(self, lhs: Layout, rhs: Layout, dimension_numbers: Any, dtype: Any) -> _DotResult:
        lnames, rnames, out_names = _dot_names(lhs, rhs, dimension_numbers)
        if _is_free(lhs) and not _is_free(rhs):
            lhs = _adopt(lhs, lnames, rhs, rnames, self.mesh_sizes)
        elif _is_free(rhs) and not _is_free(lhs):
            rhs = _adopt(rhs, rnames, lhs, lnames, self.mesh_sizes)
        dname, itemsize = dtype_info(dtype)
        ops = (_renamed(lhs, lnames), _renamed(rhs, rnames))
        sizes = dict(zip(lnames, lhs.shape)) | dict(zip(rnames, rhs.shape))
        problem = Problem(ops, tuple(out_names), tuple(sizes.items()), self.mesh, None, itemsize, self.profile)
        plan = analyze_layouts(problem, dname)
        out = plan.out_layout
        positional = Layout(tuple(f"d{i}" for i in range(len(out.axes))), out.shape, out.mesh, out.dims, out.unreduced)
        return _DotResult(positional, tuple(plan.collectives), float(plan.flops), float(plan.time), plan.expression)

    def reshard(self, src: Layout, dst: Layout, dtype: Any) -> tuple[Any, ...]:
        key = (src, dst, str(dtype))
        hit = self._reshards.get(key)
        if hit is None:
            _, itemsize = dtype_info(dtype)
            try:
                hit = tuple(transition(src, dst, itemsize=itemsize, profile=self.profile)[1])
            except EinshardError:
                # transition found no direct path (an intermediate layout would not divide):
                # gather to replicated, then slice, which always exists.
                whole = src.with_dims(tuple(() for _ in src.dims), src.unreduced)
                hit = tuple(transition(src, whole, itemsize=itemsize, profile=self.profile)[1])
                hit += tuple(transition(whole, dst, itemsize=itemsize, profile=self.profile)[1])
            self._reshards[key] = hit
        return hit

    def compute_time(self, flops: float) -> float:
        return self.profile.compute_time(flops)


def _hashable(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(e) for e in x)
    return x


def _renamed(lay: Layout, names: Sequence[str]) -> Layout:
    return Layout(tuple(names), lay.shape, lay.mesh, lay.dims, lay.unreduced)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _name(i: int) -> str:
    return _LETTERS[i] if i < 26 else _LETTERS[i // 26 - 1] + _LETTERS[i % 26]


def _dot_names(lhs: Layout, rhs: Layout, dn: Any) -> tuple[list[str], list[str], list[str]]:
    """Einsum axis names for a dot_general's operands and result (batch, lhs free, rhs free: XLA's order)."""
    (lc, rc), (lb, rb) = dn
    counter = iter(range(10**6))
    lnames = [""] * len(lhs.shape)
    rnames = [""] * len(rhs.shape)
    for i, j in zip(lb, rb):
        lnames[i] = rnames[j] = _name(next(counter))
    for i, j in zip(lc, rc):
        lnames[i] = rnames[j] = _name(next(counter))
    for i in range(len(lnames)):
        if not lnames[i]:
            lnames[i] = _name(next(counter))
    for j in range(len(rnames)):
        if not rnames[j]:
            rnames[j] = _name(next(counter))
    out = [lnames[i] for i in lb]
    out += [lnames[i] for i in range(len(lnames)) if i not in lb and i not in lc]
    out += [rnames[j] for j in range(len(rnames)) if j not in rb and j not in rc]
    return lnames, rnames, out


# ---------------------------------------------------------------------------
# The walk


@dataclass(frozen=True)
class _FreeLayout(Layout):
    """A value every device can make for itself (a broadcast constant, an iota, zeros).

    Its layout is whatever its consumer wants, at no cost: XLA propagates
    shardings backwards into such values, so a forward-only walk must not
    charge for bringing a replicated constant to a sharded operand's layout.
    """


def _is_free(lay: Layout) -> bool:
    return isinstance(lay, _FreeLayout)


def _adopt(
    free: Layout, names: Sequence[str], other: Layout, other_names: Sequence[str], sizes: dict[str, int]
) -> Layout:
    """Give a free operand the sharding its partner has on the axes they share."""
    by_name = dict(zip(other_names, other.dims))
    dims = []
    for n, size in zip(names, free.shape):
        d = by_name.get(n, ())
        ok = d and size % math.prod(sizes[m] for m in d) == 0
        dims.append(d if ok else ())
    return Layout(free.axes, free.shape, free.mesh, tuple(dims))


_ELEMENTWISE = {
    "add",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "pow",
    "integer_pow",
    "neg",
    "exp",
    "exp2",
    "log",
    "log1p",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "sqrt",
    "rsqrt",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "erf",
    "erf_inv",
    "select_n",
    "convert_element_type",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "stop_gradient",
    "square",
    "copy",
    "copy_p",
    "clamp",
    "nextafter",
    "rem",
    "atan2",
    "expm1",
    "is_finite",
    "reduce_precision",
    "imag",
    "real",
    "conj",
    "tan",
    "cbrt",
    "add_any",
    "pjit_identity",
    "optimization_barrier",
    "cumsum",
    "cumlogsumexp",
    "cummax",
    "cummin",
    "cumprod",
    "random_bits",
    "random_wrap",
    "random_unwrap",
    "threefry2x32",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "iota",
    "one_minus_square",  # jax >= 0.12: the derivative of tanh
}
# Collectives written out inside a shard_map body (jax.lax primitives) and the kinds they are.
_MANUAL_COLLECTIVES = {
    "psum": "all-reduce",
    "psum2": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "psum_scatter": "reduce-scatter",
    "ppermute": "collective-permute",
    "all_to_all": "all-to-all",
}
_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and", "reduce_or"}
_SUB_JAXPR = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_lin": None,
}


class _Walker:
    def __init__(self, rules: _Rules) -> None:
        self.rules = rules
        self.mesh = rules.mesh
        self.ops: list[OpReport] = []
        self.unfollowed: set[str] = set()
        self.counter = 0
        self._replicated: dict[tuple[int, ...], Layout] = {}

    # -- layouts -------------------------------------------------------------
    def replicated(self, aval: Any) -> Layout:
        shape = tuple(int(s) for s in getattr(aval, "shape", ()))
        lay = self._replicated.get(shape)
        if lay is None:
            lay = Layout(tuple(f"d{i}" for i in range(len(shape))), shape, self.mesh, tuple(() for _ in shape))
            self._replicated[shape] = lay
        return lay

    def free(self, aval: Any) -> Layout:
        shape = tuple(int(s) for s in getattr(aval, "shape", ()))
        return _FreeLayout(tuple(f"d{i}" for i in range(len(shape))), shape, self.mesh, tuple(() for _ in shape))

    def relayout(self, aval: Any, dims: Sequence[tuple[str, ...]]) -> Layout:
        if not any(dims):
            return self.replicated(aval)
        shape = tuple(int(s) for s in aval.shape)
        key = (shape, tuple(dims))
        hit = self.rules.layouts.get(key)
        if hit is None:
            hit = self.rules.layouts[key] = self._relayout(shape, dims)
        return hit

    def _relayout(self, shape: tuple[int, ...], dims: Sequence[tuple[str, ...]]) -> Layout:
        fixed = []
        used: set[str] = set()
        for size, d in zip(shape, dims):
            keep = tuple(m for m in d if m not in used)
            n = math.prod(self.rules.mesh_sizes[m] for m in keep)
            if keep and size % n == 0:
                fixed.append(keep)
                used.update(keep)
            else:
                fixed.append(())
        return Layout(tuple(f"d{i}" for i in range(len(shape))), shape, self.mesh, tuple(fixed))

    def record(
        self,
        eqn: Any,
        phase: str,
        expression: str,
        out: Layout | None,
        collectives: tuple[Any, ...],
        flops: float,
        time_s: float,
        repeat: int,
        note: str = "",
    ) -> None:
        if not collectives and not flops:
            return
        self.ops.append(
            OpReport(self.counter, eqn.primitive.name, phase, expression, out, collectives, flops, time_s, repeat, note)
        )
        self.counter += 1

    def change(self, eqn: Any, phase: str, src: Layout, dst: Layout, dtype: Any, repeat: int, why: str) -> None:
        if src.dims == dst.dims and src.unreduced == dst.unreduced:
            return
        colls = self.rules.reshard(src, dst, dtype)
        if colls:
            t = sum(getattr(c, "time", 0.0) for c in colls)
            self.record(eqn, phase, f"{why}: {side_string(src)} -> {side_string(dst)}", dst, colls, 0.0, t, repeat)

    # -- the walk ------------------------------------------------------------
    def walk(
        self,
        jaxpr: Any,
        in_layouts: list[Layout],
        repeat: int,
        phase_hint: str | None,
        env: dict[Any, Layout] | None = None,
    ) -> list[Layout]:
        env = {} if env is None else env

        def read(v: Any) -> Layout:
            if hasattr(v, "val"):  # a literal
                return self.replicated(v.aval)
            return env.get(v) or self.replicated(v.aval)

        for v, lay in zip(jaxpr.invars, in_layouts):
            env[v] = lay
        for v in jaxpr.constvars:
            env[v] = self.replicated(v.aval)
        for eqn in jaxpr.eqns:
            phase = phase_hint or ("backward" if "transpose" in str(eqn.source_info.name_stack) else "forward")
            outs = self.step(eqn, [read(v) for v in eqn.invars], repeat, phase)
            for v, lay in zip(eqn.outvars, outs):
                env[v] = lay
        return [read(v) for v in jaxpr.outvars]

    def step(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        name = eqn.primitive.name
        outs = eqn.outvars
        dtype = outs[0].aval.dtype if outs and hasattr(outs[0].aval, "dtype") else np.float32
        if name == "dot_general":
            res = self.rules.dot(ins[0], ins[1], eqn.params["dimension_numbers"], dtype)
            self.record(eqn, phase, res.expression, res.out, res.collectives, res.flops, res.time_s, repeat)
            return [self.relayout(outs[0].aval, res.out.dims)]
        if name in _ELEMENTWISE:
            return [self.elementwise(eqn, ins, repeat, phase, v.aval) for v in outs]
        if name == "broadcast_in_dim":
            out_aval = outs[0].aval
            if not ins[0].shape or _is_free(ins[0]):
                return [self.free(out_aval)]
            dims: list[tuple[str, ...]] = [()] * len(out_aval.shape)
            for i, j in enumerate(eqn.params["broadcast_dimensions"]):
                if ins[0].shape[i] == out_aval.shape[j]:
                    dims[j] = ins[0].dims[i]
            return [self.relayout(out_aval, dims)]
        if name in ("iota", "full", "zeros_like"):
            return [self.free(v.aval) for v in outs]
        if name == "transpose":
            perm = eqn.params["permutation"]
            return [self.relayout(outs[0].aval, [ins[0].dims[p] for p in perm])]
        if name in ("squeeze",):
            gone = set(eqn.params["dimensions"])
            return [self.relayout(outs[0].aval, [d for i, d in enumerate(ins[0].dims) if i not in gone])]
        if name == "expand_dims":
            dims = list(ins[0].dims)
            for ax in sorted(eqn.params["dimensions"]):
                dims.insert(ax, ())
            return [self.relayout(outs[0].aval, dims)]
        if name == "reshape":
            return [self.reshape(eqn, ins[0], outs[0].aval, repeat, phase)]
        if name in _REDUCTIONS:
            return [self.reduce(eqn, ins[0], outs[0].aval, repeat, phase)]
        if name == "pad":
            return [
                self.relayout(
                    outs[0].aval,
                    [d if a == b else () for d, a, b in zip(ins[0].dims, ins[0].shape, outs[0].aval.shape)],
                )
            ]
        if name in ("slice", "dynamic_slice"):
            return [self.slice(eqn, ins[0], outs[0].aval, repeat, phase)]
        if name in ("dynamic_update_slice", "scatter-add", "scatter_add", "scatter"):
            if _is_free(ins[0]) and len(ins) >= 3:
                # Updates scattered into zeros (the transpose of take_along_axis / a gather):
                # XLA lays the zeros out like the updates, on the axes they share whole.
                # Leading axes of equal size follow the most sharded non-free of updates and indices.
                sources = [lay for lay in ins[1:] if not _is_free(lay) and lay.shape]
                if sources:
                    src = max(sources, key=_sharding_degree)
                    out_shape = outs[0].aval.shape
                    dims = [
                        d if i < len(out_shape) and a == out_shape[i] else ()
                        for i, (d, a) in enumerate(zip(src.dims, src.shape))
                    ]
                    dims = (dims + [()] * len(out_shape))[: len(out_shape)]
                    return [self.relayout(outs[0].aval, dims)]
            return [self.relayout(outs[0].aval, ins[0].dims)]
        if name == "gather":
            return [self.gather(eqn, ins[0], ins[1], outs[0].aval, repeat, phase)]
        if name == "concatenate":
            return [self.concatenate(eqn, ins, outs[0].aval, repeat, phase)]
        if name in ("sharding_constraint", "reshard", "device_put"):
            return self.constraint(eqn, ins, repeat, phase)
        if name == "scan":
            return self.scan(eqn, ins, repeat, phase)
        if name == "shard_map":
            return self.shard_map(eqn, repeat, phase)
        if name in _MANUAL_COLLECTIVES:
            return self.manual_collective(eqn, ins, repeat, phase)
        if name in ("pvary", "axis_index", "pbroadcast"):
            return [self.replicated(v.aval) for v in outs]
        sub = self.sub_jaxpr(eqn)
        if sub is not None:
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            inner_outs = self.walk(inner, ins[-len(inner.invars) :] if inner.invars else [], repeat, _inherit(phase))
            # A sub-jaxpr's broadcast constants stay free: their consumer decides their layout.
            return [
                self.free(v.aval) if _is_free(lay) else self.relayout(v.aval, lay.dims)
                for v, lay in zip(outs, inner_outs)
            ]
        self.unfollowed.add(name)
        return [self.replicated(v.aval) for v in outs]

    def sub_jaxpr(self, eqn: Any) -> Any:
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            if (
                key in eqn.params
                and hasattr(eqn.params[key], "eqns")
                or (key in eqn.params and hasattr(getattr(eqn.params[key], "jaxpr", None), "eqns"))
            ):
                return eqn.params[key]
        return None

    def elementwise(self, eqn: Any, ins: list[Layout], repeat: int, phase: str, out_aval: Any) -> Layout:
        shape = tuple(int(s) for s in out_aval.shape)
        full = [lay for lay in ins if lay.shape == shape and not _is_free(lay)]
        if not full:
            return (
                self.free(out_aval) if all(_is_free(lay) or not lay.shape for lay in ins) else self.replicated(out_aval)
            )
        # The most sharded operand sets the layout; the others are brought to it.
        target = max(full, key=_sharding_degree)
        for lay in full:
            if lay is not target and lay.dims != target.dims:
                self.change(
                    eqn,
                    phase,
                    lay,
                    target.with_dims(target.dims, lay.unreduced),
                    out_aval.dtype,
                    repeat,
                    f"{eqn.primitive.name} operands disagree",
                )
        return self.relayout(out_aval, target.dims)

    def reduce(self, eqn: Any, src: Layout, out_aval: Any, repeat: int, phase: str) -> Layout:
        axes = set(eqn.params.get("axes", ()))
        sharded = tuple(m for i in sorted(axes) for m in src.dims[i])
        kept = [d for i, d in enumerate(src.dims) if i not in axes]
        out = self.relayout(out_aval, kept)
        if sharded:
            # A reduction over sharded axes leaves per-device partial results: one all-reduce completes them.
            pending = out.with_dims(out.dims, frozenset(sharded))
            self.change(eqn, phase, pending, out, out_aval.dtype, repeat, f"{eqn.primitive.name} over sharded axes")
        return out

    def reshape(self, eqn: Any, src: Layout, out_aval: Any, repeat: int, phase: str) -> Layout:
        out_shape = tuple(int(s) for s in out_aval.shape)
        dims = _reshape_dims(src.shape, src.dims, out_shape)
        if dims is not None and any(
            out_shape[i] % math.prod(self.rules.mesh_sizes[m] for m in d) for i, d in enumerate(dims)
        ):
            dims = None  # the sharded piece no longer divides evenly
        if dims is None:
            # The sharded axis does not survive the reshape whole: gather it first.
            gathered = src.with_dims(tuple(() for _ in src.dims))
            self.change(eqn, phase, src, gathered, out_aval.dtype, repeat, "reshape splits a sharded axis")
            return self.replicated(out_aval)
        return self.relayout(out_aval, dims)

    def slice(self, eqn: Any, src: Layout, out_aval: Any, repeat: int, phase: str) -> Layout:
        """A slice keeps whole axes' sharding; an axis it cuts must be gathered first."""
        out_shape = tuple(int(s) for s in out_aval.shape)
        cut = [i for i, (a, b) in enumerate(zip(src.shape, out_shape)) if a != b and src.dims[i]]
        dims = list(src.dims)
        if cut:
            for i in cut:
                dims[i] = ()
            self.change(
                eqn,
                phase,
                src,
                src.with_dims(tuple(dims)),
                out_aval.dtype,
                repeat,
                f"{eqn.primitive.name} cuts a sharded axis",
            )
        return self.relayout(out_aval, dims)

    def concatenate(self, eqn: Any, ins: list[Layout], out_aval: Any, repeat: int, phase: str) -> Layout:
        axis = eqn.params["dimension"]
        dims = [d if i != axis else () for i, d in enumerate(ins[0].dims)]
        for lay in ins:
            want = lay.with_dims(tuple(d if i != axis else () for i, d in enumerate(dims)))
            self.change(eqn, phase, lay, want, out_aval.dtype, repeat, "concatenate")
        return self.relayout(out_aval, dims)

    def gather(self, eqn: Any, operand: Layout, indices: Layout, out_aval: Any, repeat: int, phase: str) -> Layout:
        """Embedding-style gathers: whole operand axes keep their sharding, batch axes follow the indices."""
        dn = eqn.params["dimension_numbers"]
        sizes = eqn.params["slice_sizes"]
        out_rank = len(out_aval.shape)
        offset_dims = tuple(dn.offset_dims)
        collapsed = set(dn.collapsed_slice_dims)
        indexed = [i for i in range(len(operand.shape)) if sizes[i] != operand.shape[i]]
        if any(operand.dims[i] for i in indexed):
            gathered = operand.with_dims(tuple(() if i in indexed else d for i, d in enumerate(operand.dims)))
            self.change(eqn, phase, operand, gathered, out_aval.dtype, repeat, "gather indexes a sharded axis")
            operand = gathered
        dims: list[tuple[str, ...]] = [()] * out_rank
        kept = [i for i in range(len(operand.shape)) if i not in collapsed]
        for out_dim, op_dim in zip(offset_dims, kept):
            dims[out_dim] = operand.dims[op_dim]
        batch_out = [d for d in range(out_rank) if d not in offset_dims]
        index_dims = [i for i in range(len(indices.shape)) if i != getattr(dn, "index_vector_dim", len(indices.shape))]
        for out_dim, idx_dim in zip(batch_out, index_dims):
            dims[out_dim] = indices.dims[idx_dim]
        return self.relayout(out_aval, dims)

    def constraint(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        sh = eqn.params.get("sharding") or (eqn.params.get("dst_sharding") if "dst_sharding" in eqn.params else None)
        if isinstance(sh, (list, tuple)):
            sh = sh[0] if sh else None
        spec = getattr(sh, "spec", None)
        if spec is None:
            return ins[: len(eqn.outvars)]
        aval = eqn.outvars[0].aval
        dims = [(() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in spec]
        dims += [()] * (len(aval.shape) - len(dims))
        dst = self.relayout(aval, dims)
        self.change(eqn, phase, ins[0], dst, aval.dtype, repeat, "sharding constraint")
        return [dst]

    def shard_map(self, eqn: Any, repeat: int, phase: str) -> list[Layout]:
        """A manual region: its body sees local blocks and its collectives are written out.

        The body is walked on local (unsplit) layouts; each explicit collective
        (psum, all_gather, psum_scatter, ppermute, all_to_all) is priced by its
        ring formula on the local block.  The results are laid out as the
        region's out_specs say.
        """
        p = eqn.params
        body = p["jaxpr"]
        body = body.jaxpr if hasattr(body, "consts") else body
        self.walk(body, [self.replicated(v.aval) for v in body.invars], repeat, _inherit(phase))
        specs = p.get("out_specs") or ()
        outs = []
        for v, spec in zip(eqn.outvars, list(specs) + [None] * len(eqn.outvars)):
            entries = list(spec_partitions(spec)) if spec is not None else []
            entries += [None] * (len(v.aval.shape) - len(entries))
            dims = [(() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in entries]
            outs.append(self.relayout(v.aval, dims))
        return outs

    def manual_collective(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        """An explicit collective inside a shard_map body, priced on the local block it moves."""
        name = eqn.primitive.name
        p = eqn.params
        axes = p.get("axes", p.get("axis_name", ()))
        axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
        n = math.prod(self.rules.mesh_sizes.get(a, 1) for a in axes)
        kind = _MANUAL_COLLECTIVES[name]
        colls = []
        for v_in, v_out in zip(eqn.invars, eqn.outvars):
            if not hasattr(v_in.aval, "shape") or n <= 1:
                continue
            item = int(np.dtype(v_out.aval.dtype).itemsize)
            local_in = int(math.prod(v_in.aval.shape)) * item
            local_out = int(math.prod(v_out.aval.shape)) * item
            if kind == "all-reduce":
                array, sent = local_in, 2 * (n - 1) / n * local_in
            elif kind == "all-gather":
                array, sent = local_out, (n - 1) / n * local_out
            elif kind == "reduce-scatter":
                array, sent = local_in, (n - 1) / n * local_in
            elif kind == "all-to-all":
                array, sent = local_in, (n - 1) / n * local_in
            else:  # collective-permute: every device sends its block once
                array, sent = local_in, float(local_in)
            t = self.rules.profile.collective_time(kind, n, sent, array)
            colls.append(Collective(kind, axes, n, int(sent), array, t, "shard_map body", f"explicit {name}"))
        if colls:
            self.record(eqn, phase, f"{name} over {','.join(axes)} (explicit)", None, tuple(colls), 0.0,
                        sum(c.time for c in colls), repeat)  # fmt: skip
        return [self.replicated(v.aval) for v in eqn.outvars]

    def scan(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        p = eqn.params
        body = p["jaxpr"]
        body = body.jaxpr if hasattr(body, "consts") else body  # a ClosedJaxpr (jax < 0.12) or a Jaxpr
        if "num_consts" in p:
            n_consts, n_carry = p["num_consts"], p["num_carry"]
        else:  # jax >= 0.12: ft_in groups the operands as (consts, carry, xs)
            n_consts, n_carry = _scan_groups(p["ft_in"])[:2]
        length = int(p["length"])
        consts, carry, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
        xs_inner = [self.relayout(v.aval, lay.dims[1:]) for v, lay in zip(body.invars[n_consts + n_carry :], xs)]
        for v, lay in zip(eqn.invars[n_consts + n_carry :], xs):
            if lay.dims and lay.dims[0]:
                # Under jit, a scan over a stack sharded along the scanned axis (a layer
                # stack laid out 'l@stage ...') slices a sharded axis each iteration: XLA
                # gathers the stack.  Charged once per step, as the slice rule charges it;
                # a real pipeline schedule is einshard.pipeline's, not jit's.
                self.change(
                    eqn,
                    phase,
                    lay,
                    lay.with_dims(((), *lay.dims[1:])),
                    v.aval.dtype,
                    repeat,
                    "scan slices a sharded leading axis",
                )
        # A carry's layout is a fixed point of the body: walk it once quietly to
        # learn what the body makes of the carry, bring the initial carry there
        # (once, outside the loop), then walk it for real.
        quiet = _Walker(self.rules)
        quiet.record = lambda *a, **k: None  # type: ignore[method-assign]
        first = quiet.walk(body, [*consts, *carry, *xs_inner], 1, _inherit(phase))[:n_carry]
        settled = []
        for v, lay, out in zip(eqn.outvars[:n_carry], carry, first):
            want = self.relayout(v.aval, out.dims) if not _is_free(out) else lay
            if not _is_free(lay) and lay.dims != want.dims:
                self.change(eqn, phase, lay, lay.with_dims(want.dims), v.aval.dtype, repeat, "scan carry settles")
            settled.append(want)
        res = self.walk(body, [*consts, *settled, *xs_inner], repeat * length, _inherit(phase))
        carry_out, ys = res[:n_carry], res[n_carry:]
        outs = eqn.outvars
        out_layouts = [self.relayout(v.aval, lay.dims) for v, lay in zip(outs[:n_carry], carry_out)]
        out_layouts += [self.relayout(v.aval, [(), *lay.dims]) for v, lay in zip(outs[n_carry:], ys)]
        return out_layouts


def _scan_groups(ft_in: Any) -> list[int]:
    """Operand counts of (consts, carry, xs) from jax 0.12's ``ft_in``.

    It is a FlatTree: a tuple of three groups, a Pytree whose treedef has three
    children, or a filtered Pytree (``RightsOnly``) whose ``Right`` entries are the operands.
    """
    elts = getattr(ft_in, "elts", None)
    if elts is not None:
        return [len(e) for e in elts]
    filtered = type(ft_in).__name__ == "FTFiltered"
    pytree = ft_in.val if filtered else ft_in
    tree = getattr(pytree, "_tree", None)
    if tree is not None:
        vals, out, i = list(pytree.xs), [], 0
        for child in tree.children():
            chunk = vals[i : i + child.num_leaves]
            i += child.num_leaves
            out.append(sum(1 for x in chunk if getattr(x, "is_right", True)) if filtered else len(chunk))
        return out

    def count(x: Any) -> int:
        return sum(count(e) for e in x) if isinstance(x, (tuple, list)) else 1

    return [count(group) for group in ft_in]


def _sharding_degree(lay: Layout) -> int:
    """How many ways a layout splits its tensor (cheap: elementwise ops ask this a lot)."""
    sizes = lay.mesh_sizes
    n = 1
    for d in lay.dims:
        for m in d:
            n *= sizes[m]
    return n


def _inherit(phase: str) -> str | None:
    """Sub-jaxprs of a backward op are backward (their own name stacks do not say so)."""
    return "backward" if phase == "backward" else None


def _reshape_dims(
    src_shape: tuple[int, ...], src_dims: tuple[tuple[str, ...], ...], out_shape: tuple[int, ...]
) -> list[tuple[str, ...]] | None:
    """Where each sharded input axis lands after a reshape, or None if one cannot stay sharded.

    Axes are matched in groups whose sizes multiply to the same number; inside
    a group the sharding must sit on the group's major (first non-1) axis on
    both sides, which is the case where a block-sharded layout survives.
    """
    out: list[tuple[str, ...]] = [()] * len(out_shape)
    i = j = 0
    while i < len(src_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        a = src_shape[i] if i < len(src_shape) else 1
        b = out_shape[j] if j < len(out_shape) else 1
        while a != b:
            if a < b:
                i += 1
                if i >= len(src_shape):
                    return None
                gi.append(i)
                a *= src_shape[i]
            else:
                j += 1
                if j >= len(out_shape):
                    return None
                gj.append(j)
                b *= out_shape[j]
        sharded = [k for k in gi if k < len(src_shape) and src_dims[k]]
        if sharded:
            major_in = next(k for k in gi if src_shape[k] != 1)
            major_out = next((k for k in gj if k < len(out_shape) and out_shape[k] != 1), None)
            if sharded != [major_in] or major_out is None:
                return None
            out[major_out] = src_dims[major_in]
        i, j = gi[-1] + 1, gj[-1] + 1
    return out


# ---------------------------------------------------------------------------
# Entry point


def _arg_layouts(args: Sequence[Any], in_specs: Any, mesh: tuple[MeshAxis, ...]) -> list[Layout]:
    leaves = jax.tree_util.tree_leaves(args)
    if in_specs is None:
        specs: list[Any] = [getattr(getattr(x, "sharding", None), "spec", None) for x in leaves]
    else:
        specs = _broadcast_specs(args, in_specs)
    out = []
    sizes = {m.name: m.size for m in mesh}
    for x, spec in zip(leaves, specs):
        shape = tuple(int(s) for s in np.shape(x))
        if isinstance(spec, str):
            from ..core.layout import resolve_named
            from ..parsing import parse_placement

            lay = resolve_named(parse_placement(spec), shape, mesh)
            out.append(lay)
            continue
        entries = list(spec) if spec is not None else []
        entries += [None] * (len(shape) - len(entries))
        dims = tuple((() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in entries)
        for d in dims:
            for m in d:
                if m not in sizes:
                    raise EinshardError(
                        f"explain(): mesh axis {m!r} of an argument's sharding is not in the mesh {sizes}"
                    )
        out.append(Layout(tuple(f"d{i}" for i in range(len(shape))), shape, mesh, dims))
    return out


def _broadcast_specs(args: Sequence[Any], in_specs: Any) -> list[Any]:
    def is_leaf(s: Any) -> bool:
        return s is None or isinstance(s, (str, jax.sharding.PartitionSpec))

    specs_flat, spec_tree = jax.tree_util.tree_flatten(in_specs, is_leaf=is_leaf)
    try:
        per_arg = spec_tree.flatten_up_to(args)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as err:
        raise EinshardError(f"explain(): in_specs does not match the arguments' structure: {err}") from None
    out = []
    for spec, sub in zip(specs_flat, per_arg):
        out.extend([spec] * len(jax.tree_util.tree_leaves(sub)))
    return out


def _mesh_of(mesh: Any, args: Sequence[Any]) -> tuple[MeshAxis, ...]:
    """The mesh as the per-einsum analyzer reads it (given, the arguments', or the current one)."""
    found = _mesh_axes(mesh, tuple(jax.tree_util.tree_leaves(args)))
    if found is None:
        raise EinshardError(
            "explain() needs a mesh: pass mesh= (a Mesh or sizes like {'data': 4, 'model': 2}), "
            "lay the arguments out with einshard(), or call it under jax.set_mesh"
        )
    return found


def explain(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Any = None,
    in_specs: Any = None,
    profile: Any = None,
    **kwargs: Any,
) -> ProgramReport:
    """Explain what running ``fn(*args, **kwargs)`` costs under the arguments' layouts.

    Args:
        fn: any JAX function (a forward pass, a loss, ``jax.grad`` of one, a whole train step).
        args: arrays, ``jax.ShapeDtypeStruct``s (with ``sharding=`` or not) or pytrees of them.
        mesh: a Mesh, or axis sizes ``{'data': 4, 'model': 2}`` to analyse without devices;
            default the arguments' mesh, else the current mesh.
        in_specs: layouts for the arguments when they carry none: a pytree prefix of
            ``args`` with PartitionSpecs or einshard expressions (``'b d -> b@data d'``).
        profile: the hardware profile for time estimates (see ``einshard.analyze``).

    Returns:
        A :class:`ProgramReport`: op-by-op collectives, bytes, FLOPs per device, peak
        bytes per device and estimated step time, for forward and backward phases.

    Example:
        >>> import jax, jax.numpy as jnp, einshard
        >>> def loss(w, x):
        ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
        >>> w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        >>> r = einshard.explain(jax.grad(loss), w, x, mesh={'data': 4, 'model': 2},
        ...                      in_specs=('d f -> d f@model', 'b d -> b@data d'))
        >>> r.comm_count > 0 and r.flops > 0
        True
    """
    return trace(fn, *args, mesh=mesh, profile=profile, **kwargs).report(in_specs)


class TracedProgram:
    """A function traced once, to be costed under many argument layouts (what the planner needs).

    ``explain(fn, *args, in_specs=s)`` is ``trace(fn, *args).report(s)``; a
    TracedProgram also remembers what each einsum and each layout change cost,
    so re-costing under thousands of layouts walks the jaxpr without
    re-analysing the einsums it has already seen.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from einshard.analysis.program import trace
        >>> w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        >>> t = trace(lambda w, x: x @ w, w, x, mesh={'data': 4, 'model': 2})
        >>> dp = t.report(('d f -> d f', 'b d -> b@data d'))
        >>> tp = t.report(('d f -> d f@model', 'b d -> b d'))
        >>> dp.comm_bytes == tp.comm_bytes == 0 and tp.flops == 2 * dp.flops
        True
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        mesh_axes: tuple[MeshAxis, ...],
        rules: _Rules,
        kwargs: dict[str, Any],
    ) -> None:
        start = time.perf_counter()
        self.args = args
        self.mesh = mesh_axes
        self.rules = rules
        closed, self.out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        self.jaxpr = _dead_code_eliminated(closed.jaxpr)
        self.trace_s = time.perf_counter() - start

    def report(self, in_specs: Any = None, out_specs: Sequence[Any] | None = None) -> ProgramReport:
        """The :class:`ProgramReport` under ``in_specs`` (as ``explain``'s; None: the arguments' own shardings).

        ``out_specs``: optionally, one PartitionSpec (or None: as computed) per output leaf, as
        ``jax.jit(out_shardings=...)`` would ask: the output is brought there (its collective
        counted) and held that way (peak bytes).  The planner returns gradients laid out
        like their parameters, as FSDP training steps do.
        """
        start = time.perf_counter()
        in_layouts = _arg_layouts(self.args, in_specs, self.mesh)
        walker = _Walker(self.rules)
        layouts: dict[Any, Layout] = {}
        outs = walker.walk(self.jaxpr, in_layouts, 1, None, env=layouts)
        if out_specs is not None:
            for v, lay, spec in zip(self.jaxpr.outvars, outs, out_specs):
                if spec is None or hasattr(v, "val") or not getattr(v.aval, "shape", ()):
                    continue
                entries = list(spec) + [None] * (len(v.aval.shape) - len(spec))
                dst = walker.relayout(
                    v.aval, [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
                )
                if not _is_free(lay):
                    walker.change(_OUTPUT, "backward", lay, dst, v.aval.dtype, 1, "output layout")
                layouts[v] = dst
        peak = _peak_bytes(self.jaxpr, layouts)
        ops = tuple(walker.ops)
        phases: dict[str, dict[str, float]] = {}
        for op in ops:
            tot = phases.setdefault(op.phase, {"flops": 0.0, "bytes": 0.0, "count": 0.0, "time_s": 0.0})
            tot["flops"] += op.flops * op.repeat
            tot["bytes"] += op.comm_bytes
            tot["count"] += len(op.collectives) * op.repeat
            tot["time_s"] += op.time_s * op.repeat
        return ProgramReport(
            ops=ops,
            flops=sum(t["flops"] for t in phases.values()),
            comm_bytes=sum(t["bytes"] for t in phases.values()),
            comm_count=int(sum(t["count"] for t in phases.values())),
            peak_bytes=peak,
            time_s=sum(t["time_s"] for t in phases.values()),
            phases=phases,
            unfollowed=tuple(sorted(walker.unfollowed)),
            mesh=self.mesh,
            profile=self.rules.profile,
            analysis_s=time.perf_counter() - start,
        )


class _Output:
    """Stands for the program's end where an output is brought to its requested layout."""

    class primitive:  # noqa: N801 (mimics a jaxpr equation)
        name = "output"


_OUTPUT = _Output()


def trace(fn: Callable[..., Any], *args: Any, mesh: Any = None, profile: Any = None, **kwargs: Any) -> TracedProgram:
    """Trace ``fn(*args, **kwargs)`` once for costing under many layouts (see :class:`TracedProgram`)."""
    mesh_axes = _mesh_of(mesh, args)
    return TracedProgram(fn, args, mesh_axes, _Rules(mesh_axes, profile), kwargs)


def _dead_code_eliminated(jaxpr: Any) -> Any:
    """The jaxpr without values no output needs (a gradient's jaxpr still computes the primal loss).

    XLA drops that work too, so counting it would predict collectives XLA never runs.
    """
    try:
        from jax._src.interpreters import partial_eval as pe

        pruned, used_inputs = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    except Exception:  # internal API: analyse the whole jaxpr if it moved
        return jaxpr
    if not all(used_inputs):
        # Keep the signature: unused inputs stay as inputs.
        pruned = pruned.replace(invars=jaxpr.invars) if hasattr(pruned, "replace") else jaxpr
    return pruned


def _peak_bytes(jaxpr: Any, layouts: dict[Any, Layout]) -> int:
    """Peak live bytes per device over the top-level program, from each value's layout.

    Values die after their last use; sub-jaxprs (scan bodies, nested jits)
    count through their inputs and outputs only.
    """

    def nbytes(v: Any) -> int:
        aval = v.aval
        if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
            return 0
        lay = layouts.get(v)
        if lay is not None and _is_free(lay):
            # A broadcast constant: XLA fuses it into its consumers (and sinks it into
            # loops that take it as an invariant), it is not materialised.
            return 0
        shape = lay.shard_shape if lay is not None else tuple(aval.shape)
        return int(math.prod(shape)) * int(np.dtype(aval.dtype).itemsize)

    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not hasattr(v, "val"):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not hasattr(v, "val"):
            last_use[v] = len(jaxpr.eqns)
    live = {v: nbytes(v) for v in jaxpr.invars}
    peak = sum(live.values())
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            live[v] = nbytes(v)
        peak = max(peak, sum(live.values()))
        for v in eqn.invars:
            if not hasattr(v, "val") and last_use.get(v) == i:
                live.pop(v, None)
    return peak
