"""What ``einshard.explain`` returns: per-op records and the whole program's totals."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...core.layout import Layout, MeshAxis

__all__ = ["OpReport", "OpBound", "ProgramReport", "ApproximateBound", "default_bound"]

# An op's note starts with this when its collectives turn on an XLA heuristic explain does not reproduce
# (the same word as movement.APPROXIMATE, which the rules write; kept here so the report imports no rule module).
APPROXIMATE_MARK = "approximate"
# Words of an approximate note whose difference has no static bound (a while loop's run-time trip count).
UNBOUNDED_MARKS = ("known at run time",)

# Results


@dataclass(frozen=True)
class OpBound:
    """How far XLA may be from explain at one approximate op: collectives, bytes sent, and peak bytes."""

    collectives: int
    bytes: float
    peak: float = 0.0  # how much higher XLA's peak may be (values it holds whole where explain holds pieces)


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
    where: str = ""  # the user's source line, 'file:line (function)' ('' for the program's outputs)
    inside: str = ""  # the library line it runs in (Flax's Linear.__call__), where that is not the user's
    reads: tuple[str, ...] = ()  # what it reads, in the user's words: argument paths ('params.dense.kernel')
    # An approximate op's own bound, where its rule knows XLA's alternative moves more than the op's collectives
    # (a layout conflict XLA may settle on other values: see movement.mark_conflict); None: the default bound.
    bound: OpBound | None = None
    # id of the equation whose rule knows XLA's other choice here (0: none): the report walks the program under
    # that choice too, and the op's bound covers the difference to the program's end (see :mod:`.alternatives`).
    alternative: int = 0

    @property
    def comm_bytes(self) -> float:
        return self.repeat * sum(c.bytes for c in self.collectives)

    @property
    def approximate(self) -> bool:
        """Whether its collectives turn on an XLA heuristic explain does not reproduce (the note says what)."""
        return self.note.startswith(APPROXIMATE_MARK)


@dataclass(frozen=True)
class ApproximateBound:
    """How far XLA's collectives may be from explain's, summed over the approximate ops.

    XLA's choice at such an op is either explain's or another way of moving the same data: for each
    collective explain charges there over a group of n devices, at most n - 1 collectives (a
    collective-permute per distance) and at most its whole buffer (every run counted).  ``None`` fields:
    no static bound (a while loop whose trip count is a run-time value).
    """

    collectives: int | None
    bytes: float | None
    peak: float = 0.0  # how far XLA's peak memory may be from explain's (0: the marks do not touch it)

    def __str__(self) -> str:
        if self.collectives is None or self.bytes is None:
            return "by an amount known only at run time"
        n = self.collectives
        peak = f", its peak memory by up to {_bytes(self.peak)}/device" if self.peak else ""
        return f"by up to {n} collective{'s' if n != 1 else ''} and {_bytes(self.bytes)}/device{peak}"


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
        unfollowed: primitives einshard has no layout rule for.  Each is priced as XLA runs an op it
            cannot partition (split operands all-gathered, computed replicated); the report is then
            incomplete (:attr:`complete` is False) and says so on its first line.
        analysis_s: how long the analysis took.
        unfollowed_at: where those ops are, one entry per primitive: ``'sort at model.py:12 (loss)'``.
    """

    ops: Sequence[OpReport]  # a tuple, or for a ranking costing an OpLog (replayed ops made when read)
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
    unfollowed_at: tuple[str, ...] = ()
    # Where JAX's explicit sharding refused the program as written (einshard.check_explicit's report): the ops it
    # rejects, with lines and fixes; the costs above are the program's with the check's assumed fixes applied.
    explicit: Any = None
    # What peak_bytes cannot bound tightly, with the measured bound (memory.peak_caveat): '' when it can.
    peak_note: str = ""
    # Approximate ops whose rule knows XLA's other choice but whose fork was not walked (beyond
    # alternatives.MAX_FORKS): their bound is the op's own, not what the choice changes downstream.
    alternatives_unwalked: int = 0
    # Values no layout fixes whose readers still hand them a split after the last walk (open_values.MAX_WALKS): XLA's
    # propagation would split them where they are made, which the costs above do not.
    unsettled: int = 0
    # Per output of the program, the mesh axes each dimension is split over as the program returns it (its last
    # walk's, the open values moved: where XLA's propagation leaves a result no layout is asked of).
    output_dims: tuple[tuple[tuple[str, ...], ...], ...] = ()

    @property
    def complete(self) -> bool:
        """Whether every op had a layout rule (else its numbers rest on the replicate-it fallback)."""
        return not self.unfollowed

    @property
    def approximate_ops(self) -> tuple[OpReport, ...]:
        """The ops whose collectives turn on an XLA heuristic explain does not reproduce."""
        return tuple(op for op in self.ops if op.approximate)

    @property
    def approximate(self) -> bool:
        """Whether some op's collectives may differ from XLA's (:attr:`approximate_at` says which, by how much)."""
        return bool(self.approximate_ops)

    @property
    def approximate_at(self) -> tuple[str, ...]:
        """Where the approximate ops are, one entry per primitive and line: ``'pad at model.py:12 (f)'``."""
        seen: dict[str, None] = {}
        for op in self.approximate_ops:
            seen.setdefault(f"{op.primitive} at {op.where}" if op.where else op.primitive)
        return tuple(seen)

    @property
    def approximate_bound(self) -> ApproximateBound:
        """How far XLA's collectives may be from the report's (zero when nothing is approximate)."""
        ops = self.approximate_ops
        if any(mark in op.note for op in ops for mark in UNBOUNDED_MARKS):
            return ApproximateBound(None, None)
        bounds = [op.bound or default_bound(op) for op in ops]
        return ApproximateBound(
            sum(b.collectives * op.repeat for b, op in zip(bounds, ops)),
            sum(b.bytes * op.repeat for b, op in zip(bounds, ops)),
            sum(b.peak for b in bounds),  # a buffer held once, not once per iteration
        )

    def headline(self) -> str:
        """The first line: completeness, approximate ops, the mesh and the profile the times are for."""
        mesh = ", ".join(f"{m.name}={m.size}" for m in self.mesh)
        line = f"mesh: {mesh}   profile: {getattr(self.profile, 'name', self.profile)}"
        if self.caveat:  # a TPU profile: where its compiler departs from the model leads the report
            line = f"{line}   {self.caveat}"
        marks: list[str] = []
        if self.explicit is not None and self.explicit.findings:
            # The program as written does not run on these Explicit axes: lead with it, as plan's first line does.
            n, first = len(self.explicit.findings), self.explicit.findings[0]
            marks.append(
                f"REFUSED ON EXPLICIT AXES: JAX rejects {n} op{'s' if n != 1 else ''} of this program "
                f"(the first: {first.primitive} at {first.where}; below): as written it raises; costed as it runs "
                "with the fixes the check assumes"
            )
        if not self.complete:
            where = "; ".join(self.unfollowed_at) or ", ".join(self.unfollowed)
            marks.append(
                f"INCOMPLETE: no layout rule for {where} (priced as XLA runs an op it cannot partition: "
                f"operands all-gathered, computed replicated; check with einshard.plan(verify=) or the HLO)"
            )
        if self.approximate:
            n = len(self.approximate_ops)
            marks.append(
                f"APPROXIMATE: {n} op{'s' if n != 1 else ''} turn{'s' if n == 1 else ''} on an XLA heuristic "
                f"explain does not reproduce ({'; '.join(self.approximate_at)}): XLA's collectives may differ "
                f"{self.approximate_bound}"
                + (
                    f" (bound local at {self.alternatives_unwalked} further choice"
                    f"{'s' if self.alternatives_unwalked != 1 else ''}: not walked to the program's end)"
                    if self.alternatives_unwalked
                    else ""
                )
            )
        if self.unsettled:
            n = self.unsettled
            marks.append(
                f"UNSETTLED: {n} value{'s' if n != 1 else ''} no layout fixes still take{'s' if n == 1 else ''} a "
                "split from a reader after the last walk: XLA splits them where they are made, these costs do not"
            )
        return "   ".join([*marks, line])

    @property
    def caveat(self) -> str:
        """What explain does not model of the profile's compiler ('' where it does): on the first line."""
        return str(getattr(self.profile, "caveat", ""))

    def to_dict(self) -> dict[str, Any]:
        return {
            "complete": self.complete,
            "profile": getattr(self.profile, "name", str(self.profile)),
            "caveat": self.caveat,
            "unfollowed_at": list(self.unfollowed_at),
            "approximate": self.approximate,
            "approximate_at": list(self.approximate_at),
            "approximate_bound": {
                "collectives": self.approximate_bound.collectives,
                "bytes": self.approximate_bound.bytes,
                "peak": self.approximate_bound.peak,
            },
            "alternatives_unwalked": self.alternatives_unwalked,
            "unsettled": self.unsettled,
            "output_dims": [[list(d) for d in dims] for dims in self.output_dims],
            "mesh": {m.name: m.size for m in self.mesh},
            "flops": self.flops,
            "comm_bytes": self.comm_bytes,
            "comm_count": self.comm_count,
            "peak_bytes": self.peak_bytes,
            "peak_note": self.peak_note,
            "time_s": self.time_s,
            "phases": self.phases,
            "unfollowed": list(self.unfollowed),
            "analysis_s": self.analysis_s,
            "explicit": self.explicit.to_dict() if self.explicit is not None else None,
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
                    "where": op.where,
                    "inside": op.inside,
                    "reads": list(op.reads),
                }
                for op in self.ops
            ],
        }

    def __str__(self) -> str:
        lines = [self.headline()]
        # Columns as wide as their widest entry: nothing is cut (an op's expression is what says which it is).
        texts = [op.expression + (f" ×{op.repeat}" if op.repeat > 1 else "") for op in self.ops]
        colls_of = [", ".join(f"{c.kind}@{'·'.join(c.axes)}" for c in op.collectives) or "-" for op in self.ops]
        w_op = max([40, *map(len, texts)])
        w_coll = max([44, *map(len, colls_of)])
        header = f"{'#':>4}  {'phase':<8} {'op':<{w_op}} {'collectives':<{w_coll}} {'GFLOP/dev':>10} {'comm/dev':>10}"
        lines.append(header)
        lines.append("-" * len(header))
        for op, text, colls in zip(self.ops, texts, colls_of):
            lines.append(
                f"{op.index:>4}  {op.phase:<8} {text:<{w_op}} {colls:<{w_coll}} "
                f"{op.flops * op.repeat / 1e9:>10.3f} {_bytes(op.comm_bytes):>10}"
            )
            if op.where or op.reads:
                at = f"at {op.where}" + (f" (inside {op.inside})" if op.inside else "") if op.where else ""
                reads = "reads " + ", ".join(op.reads) if op.reads else ""
                lines.append(" " * 16 + "; ".join(t for t in (at, reads) if t))
            if op.approximate:
                lines.append(" " * 16 + op.note)
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
        if self.peak_note:
            lines.append(self.peak_note)
        if self.unfollowed:
            lines.append(
                "no layout rule (operands all-gathered, computed replicated, as XLA does): "
                + ", ".join(self.unfollowed)
            )
        lines.append(f"analysed in {self.analysis_s * 1e3:.1f} ms")
        if self.explicit is not None and self.explicit.findings:
            lines.append(str(self.explicit))
        return "\n".join(lines)


def default_bound(op: OpReport) -> OpBound:
    """An approximate op's bound when its rule names none: XLA moves the same data its own way."""
    # Where XLA moves the data its own way (a collective-permute per distance, all-to-alls) it sends each
    # of a collective's group_size - 1 peers at most one piece, and no more than the whole buffer; and it may
    # hold that whole buffer where explain holds a piece (an all-reduce kept whole for a reduce-scatter).
    whole = sum(c.array_bytes for c in op.collectives)
    return OpBound(max(1, sum(max(1, c.group_size - 1) for c in op.collectives)), whole, whole)


def in_user_axis_names(expression: str, lhs: Layout | None, rhs: Layout | None, dimension_numbers: Any) -> str:
    """A dot's annotated einsum (``b@data a, a c@model -> b@data c@model``, axes lettered by position) with the
    axis names of the user's expressions where its operands carry them (an argument placed by
    ``'b d -> b@data d'`` keeps ``b`` and ``d``): the report reads in the user's words.  A letter whose operands
    name it differently, or a name two letters would share, keeps its letter (the einsum stays unambiguous)."""
    if lhs is None or rhs is None or ": " in expression:
        return expression
    from .costing import as_hashable

    return _renamed_by_user(expression, lhs.axes, rhs.axes, as_hashable(dimension_numbers))


@functools.lru_cache(maxsize=65536)
def _renamed_by_user(expression: str, laxes: tuple[str, ...], raxes: tuple[str, ...], dimension_numbers: Any) -> str:
    """:func:`in_user_axis_names` by the operands' axis names (remembered: the planner records each dot of the
    program in every costing, with a few expressions and names between them)."""
    from .costing import dot_letters

    lnames, rnames, _ = dot_letters(len(laxes), len(raxes), dimension_numbers)
    rename: dict[str, str] = {}
    clash: set[str] = set()
    for letters, axes in ((lnames, laxes), (rnames, raxes)):
        for letter, axis in zip(letters, axes):
            if re.fullmatch(r"d\d+", axis) or axis.startswith("..."):
                continue  # positional (a PartitionSpec's or an intermediate's): no name of the user's
            if rename.get(letter, axis) != axis:
                clash.add(letter)
            rename.setdefault(letter, axis)
    names = [n for k, n in rename.items() if k not in clash]
    unique = {k: n for k, n in rename.items() if k not in clash and names.count(n) == 1}
    kept_letters = (set(lnames) | set(rnames)) - set(unique)
    mapping = {k: n for k, n in unique.items() if n not in kept_letters}
    if not mapping:
        return expression
    # Only einsum axes are renamed: never a mesh axis (after '@', inside '@(...)') or a pending sum ('{U:...}').
    return re.sub(r"(?<![\w@(,:{])([a-z]{1,2})\b(?![\w(])", lambda m: mapping.get(m.group(1), m.group(1)), expression)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
