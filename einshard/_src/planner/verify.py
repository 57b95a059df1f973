"""``plan(verify=k)``: the planner checks its best candidates with the compiler.

The cost model (``explain``) predicts; XLA decides.  Verification compiles
the ``k`` best assignments the search ranked and the best preset, shapes only
(``jax.ShapeDtypeStruct``s with ``NamedSharding``s: nothing is allocated or
run), on the mesh the plan is for, and reads from each compiled program:

* its collectives (:func:`einshard.testing.hlo.normalized`, loop bodies
  counted once per iteration), priced with the plan's profile
  (:meth:`~einshard.analysis.cost.Profile.collective_time`, once per HLO
  instruction: a combined collective pays its latency once; on a profile
  whose ``combined_latency`` is ``'per_piece'``, XLA:CPU's, once per piece);
* its peak memory per device, ``memory_analysis()``: arguments + outputs +
  temporaries - aliased, plus the optimizer state the cost model adds.

* its FLOPs per device, ``cost_analysis()`` (every op's: the elementwise
  ones explain does not count, and the work a layout leaves replicated).

**The rule.**  A candidate's compiled step time is its compiled compute
time (XLA's FLOPs per device on the profile) plus the profile's time of its
compiled collectives; where a compiled program has a while loop (XLA's cost
analysis counts a loop body once, not per iteration) or the backend reports
no FLOPs, every candidate's compute is the prediction's instead, so that all
are ranked on one count; it fits when its compiled memory is within the budget.  The
verified candidates are ranked by the objective on those compiled numbers
(``'training'``/``'inference'``: compiled time; ``'memory'``: compiled
memory; ``'communication'``: compiled bytes sent), those within the budget
first, the prediction's order breaking ties; the first is the plan.  Where
the compiler agrees with the prediction, that is the prediction's choice.

**Explicit axes.**  On a mesh with Explicit axes (``jax.make_mesh``'s default) each candidate is the *typed*
program: its arguments carry the candidate's layout in their types, as arrays placed so would, and JAX types
every op from them.  JAX refuses some of those programs while tracing (a contraction split on both operands:
*"Contracting dimensions are sharded and it is ambiguous how the output should be sharded"*); the user's step,
run as written on that layout, raises the same.  Such a candidate is *refused*: its row says so (JAX's first
line, at the user's source line, as ``explain`` reports the same layout), it is compiled on the same devices
with Auto axes (the program as ``jax.sharding.auto_axes`` would run it) and shows those numbers labelled as
such, and it ranks after every candidate JAX accepts.  Only where JAX refuses them all is one chosen, and then
the plan's first line says it needs ``auto_axes``.

**The cost.**  A 7B step's TPU compile is minutes of CPU, so each program is
compiled once: candidates whose shardings are equal (their assignments differ
only where no leaf's spec shows it) share one compile; each distinct program
is traced and lowered once, in the caller's thread (tracing is Python), and
the compiles run on a thread pool, all at once up to twice the CPUs this
process may use (:func:`compile_workers`): XLA's and libtpu's compiles release
the GIL.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh

from ..analysis.cost import Profile, human_bytes, human_time
from ..core.layout import MeshAxis
from ..core.mesh import MeshLike
from ..errors import EinshardError
from .scoring import Costs, Score, settled, unwalked_compute_s

__all__ = [
    "Verified",
    "OnAuto",
    "DEFAULT_VERIFY",
    "predicted_kinds",
    "verification_mesh",
    "compiled_numbers",
    "lower_on_shapes",
    "read_compiled",
    "compile_and_read",
    "compile_workers",
    "explicit_mesh_of",
    "refusal",
    "refused_on",
    "verify_assignments",
]

# Candidates compiled by default when the model is incomplete (an op without a layout rule): the best
# three the search ranked, and the best preset.
DEFAULT_VERIFY = 3


@dataclass(frozen=True)
class Verified:
    """One candidate, as predicted and as compiled.

    Attributes:
        label: the candidate's name (as in ``LayoutPlan.alternatives``).
        predicted_*: what the cost model says (step time, bytes sent per device, collectives, memory per device).
        compiled_*: the same read from XLA's compiled program (module doc: the rule).
        compiled_kinds: collective kind -> how many run per step, from the HLO (async ``-start``/``-done``
            pairs, as TPU emits them, counted once).
        predicted_kinds: the same, as ``explain`` predicts them (before XLA's combiner merges any).
        fits_hbm: with a target, whether the compiled memory fits one chip's HBM (None: no target).
        compiler: whose compiled program the ``compiled_*`` numbers are (``'XLA'``, ``'TPU compiler (v5p:2x2x2)'``).
        fits: whether the compiled memory is within the budget.
        chosen: whether this candidate is the plan.
    """

    label: str
    predicted_time_s: float
    predicted_comm_bytes: float
    predicted_count: int
    predicted_memory: int
    compiled_time_s: float
    compiled_comm_bytes: float
    compiled_count: int
    compiled_memory: int
    compiled_kinds: dict[str, int] = field(default_factory=dict)
    fits: bool = True
    chosen: bool = False
    predicted_kinds: dict[str, int] = field(default_factory=dict)
    # With a target (plan(target=...)): whether the compiled memory fits the chip's HBM, and the compiler's name.
    fits_hbm: bool | None = None
    compiler: str = "XLA"
    error: str = (
        ""  # a target's compiler that failed on this candidate (its first line); compiled_* then copy predicted_*
    )
    # Of the times: the compute (the rest is communication); compute_from says whose FLOPs the compiled one is
    # ('cost_analysis': XLA's, per device; 'prediction': explain's, where XLA's cannot be trusted: module doc).
    predicted_compute_s: float = 0.0
    compiled_compute_s: float = 0.0
    compute_from: str = "prediction"
    # JAX's refusal of this layout on the mesh's Explicit axes (its error's first line, at the user's line): the
    # compiled_* numbers are then the program compiled with Auto axes on the same devices (module doc), not this one.
    refused: str = ""

    @property
    def compiled_axes(self) -> str:
        """Whose axes the compiled numbers are: ``'Auto'`` for a refused candidate, else the mesh's own."""
        return "Auto" if self.refused else "the mesh's"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "predicted": {
                "time_s": self.predicted_time_s,
                "comm_bytes": self.predicted_comm_bytes,
                "count": self.predicted_count,
                "memory_bytes": self.predicted_memory,
                "compute_s": self.predicted_compute_s,
            },
            "compiled": {
                "time_s": self.compiled_time_s,
                "comm_bytes": self.compiled_comm_bytes,
                "count": self.compiled_count,
                "memory_bytes": self.compiled_memory,
                "kinds": dict(self.compiled_kinds),
                "compute_s": self.compiled_compute_s,
                "compute_from": self.compute_from,
            },
            "predicted_kinds": dict(self.predicted_kinds),
            "compiler": self.compiler,
            "fits_hbm": self.fits_hbm,
            "fits": self.fits,
            "chosen": self.chosen,
            "error": self.error,
            "refused": self.refused,
            "compiled_axes": self.compiled_axes,
        }

    def line(self) -> str:
        mark = "*" if self.chosen else " "
        if self.error:
            return f"{mark} {self.label:<34} did not compile ({self.compiler}): {self.error}"
        fit = "" if self.fits else "  (over budget)"
        if self.fits_hbm is not None:
            fit += "  fits HBM" if self.fits_hbm else "  (over HBM)"
        # Both sides counted per collective, before XLA's combiner merges any (compiled_count counts each piece of a
        # tuple-shaped op; predicted_count is the planner's combined ops, priced α once each).
        predicted = sum(self.predicted_kinds.values()) if self.predicted_kinds else self.predicted_count
        numbers = (
            f"time {human_time(self.predicted_time_s)} -> {human_time(self.compiled_time_s)}"
            f"  compute {human_time(self.predicted_compute_s)} -> {human_time(self.compiled_compute_s)}"
            f"  sent {human_bytes(self.predicted_comm_bytes)} -> {human_bytes(self.compiled_comm_bytes)}"
            f"  collectives {predicted} -> {self.compiled_count}"
            f"  memory {human_bytes(self.predicted_memory)} -> {human_bytes(self.compiled_memory)}{fit}"
        )
        kinds = (
            ""
            if self.predicted_kinds == self.compiled_kinds
            # explain names each collective it predicts; the compiled program's pieces are counted alike.
            else f"\n      kinds {_kinds(self.predicted_kinds)} before combining -> {_kinds(self.compiled_kinds)} "
            f"compiled ({self.compiler}{', Auto axes' if self.refused else ''})"
        )
        if self.refused:
            # Not this mesh's program: JAX refuses it as written; the numbers are the Auto-axes compile's, said so.
            return (
                f"{mark} {self.label:<34} REFUSED by JAX on the mesh's Explicit axes: {self.refused}\n"
                f"      compiled on Auto axes instead (as jax.sharding.auto_axes would run it): {numbers}{kinds}"
            )
        return f"{mark} {self.label:<34} {numbers}{kinds}"


def _kinds(kinds: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + "}" if kinds else "{none}"


def predicted_kinds(report: Any) -> dict[str, int]:
    """Collective kind -> how many ``explain`` predicts per step (scan bodies counted per iteration)."""
    out: dict[str, int] = {}
    for op in report.ops:
        for c in op.collectives:
            out[c.kind] = out.get(c.kind, 0) + op.repeat
    return out


def verification_mesh(
    mesh: MeshLike | None, args: Sequence[Any], mesh_axes: tuple[MeshAxis, ...], what: str = "plan(verify=...)"
) -> Mesh:
    """A concrete ``jax.sharding.Mesh`` to compile on: the caller's own (``mesh=``, ``jax.set_mesh``, the
    arguments'), else one built on this process's devices.

    A plan made from sizes (``mesh={'data': 4}``) compiles on the first devices, with Auto axes (the compiler
    propagates layouts through whatever ``fn`` does, as ``jax.jit`` runs it); one made on an AbstractMesh, on the
    first devices with its axis types.

    Raises:
        EinshardError: the mesh needs more devices than this process has.
    """
    from ..core.mesh import resolve_mesh

    found = resolve_mesh(mesh, args, what=what, check_operands=False)
    if isinstance(found, jax.sharding.Mesh) and not found.empty:
        return found
    n = math.prod(m.size for m in mesh_axes)
    devices = jax.devices()
    if n > len(devices):
        sizes = {m.name: m.size for m in mesh_axes}
        raise EinshardError(
            f"{what}: compiling the candidates needs the mesh's {n} devices ({sizes}); this process has "
            f"{len(devices)} ({devices[0].platform})",
            hint="Verify on a machine (or simulated CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=N) "
            "with the mesh's devices, or pass verify=0 to rank on the prediction alone.",
        )
    # A user's AbstractMesh keeps its axis types (Explicit ones type each candidate as its step would be typed).
    names = tuple(m.name for m in mesh_axes)
    types = (jax.sharding.AxisType.Auto,) * len(mesh_axes)
    if isinstance(mesh, jax.sharding.AbstractMesh) and tuple(mesh.axis_names) == names:
        types = tuple(mesh.axis_types)
    return jax.make_mesh(
        tuple(m.size for m in mesh_axes), tuple(m.name for m in mesh_axes), axis_types=types, devices=devices[:n]
    )


# What :func:`read_compiled` gives: (communication seconds on the profile, bytes sent per device, collectives per
# step, FLOPs per device by XLA's cost analysis or None, peak bytes per device or None, collectives by kind).
Numbers = tuple[float, float, int, float | None, int | None, dict[str, int]]


def lower_on_shapes(
    fn: Callable[..., Any],
    args: Sequence[Any],
    in_specs: Sequence[Any],
    out_specs: Any,
    mesh: Mesh,
    **kwargs: Any,
) -> jax.stages.Lowered:
    """``fn`` traced and lowered on shapes laid out as ``in_specs`` (one PartitionSpec or None per leaf of
    ``args``) and ``out_specs`` (a pytree prefix of the output: PartitionSpec, or None for the compiler's
    choice), on ``mesh``: nothing is allocated.  Tracing is Python (it holds the GIL), so it runs in the
    caller's thread, with ``mesh`` in context as a user's step runs (an Explicit mesh's types need it)."""
    jitted, shapes = _on_shapes(fn, args, in_specs, out_specs, mesh, kwargs)
    with jax.set_mesh(mesh):
        return jitted.lower(*shapes)


def _on_shapes(
    fn: Callable[..., Any],
    args: Sequence[Any],
    in_specs: Sequence[Any],
    out_specs: Any,
    mesh: Mesh,
    kwargs: dict[str, Any],
) -> tuple[Any, tuple[Any, ...]]:
    """``fn`` jitted with ``out_specs`` as its out_shardings, and ``args`` as shapes laid out as ``in_specs``."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    shapes = [
        jax.ShapeDtypeStruct(
            tuple(x.shape), x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec or jax.sharding.PartitionSpec())
        )
        for x, spec in zip(leaves, in_specs)
    ]
    out_shardings = jax.tree_util.tree_map(
        lambda s: None if s is None else jax.sharding.NamedSharding(mesh, s),
        out_specs,
        is_leaf=lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec),
    )
    jitted = jax.jit(functools.partial(fn, **kwargs), out_shardings=out_shardings)
    return jitted, tuple(jax.tree_util.tree_unflatten(treedef, shapes))


def explicit_mesh_of(
    mesh: MeshLike | None, args: Sequence[Any], mesh_axes: tuple[MeshAxis, ...]
) -> tuple[bool, Mesh | None]:
    """Whether the caller's mesh (``mesh=``, ``jax.set_mesh``, the arguments') has Explicit axes, and a concrete
    mesh with those axis types to trace candidates on (the caller's own, else :func:`verification_mesh`'s for a
    user's AbstractMesh; None where this process lacks its devices).  Sizes (``mesh={'data': 4}``) are planned as
    the program JAX runs on Auto axes: (False, None)."""
    from ..core.mesh import explicit_axes, resolve_mesh

    if isinstance(mesh, Mapping):
        return False, None
    try:
        found = resolve_mesh(mesh, args, what="plan()", check_operands=False, required=False)
    except EinshardError:
        return False, None
    if found is None or not explicit_axes(found):
        return False, None
    if isinstance(found, jax.sharding.Mesh) and not found.empty:
        return True, found
    if not isinstance(mesh, jax.sharding.AbstractMesh):
        return False, None  # an AbstractMesh of JAX's own making (from sizes): not the user's types
    try:
        return True, verification_mesh(mesh, args, mesh_axes)
    except EinshardError:
        return True, None


def refused_on(
    fn: Callable[..., Any],
    args: Sequence[Any],
    in_specs: Sequence[Any],
    out_specs: Any,
    mesh: Mesh,
    **kwargs: Any,
) -> str:
    """Whether JAX types ``fn`` with its arguments laid out as ``in_specs`` on ``mesh``'s Explicit axes (traced
    only, as :func:`lower_on_shapes` lays them out: nothing is lowered or compiled): '' where it does, else its
    refusal (:func:`refusal`).  The caller has traced ``fn`` untyped already, so any error here is the types'."""
    jitted, shapes = _on_shapes(fn, args, in_specs, out_specs, mesh, kwargs)
    try:
        with jax.set_mesh(mesh):
            jitted.trace(*shapes)
    except Exception as err:  # noqa: BLE001  (JAX's sharding errors have no common public type)
        return refusal(err)
    return ""


def typed_report(
    fn: Callable[..., Any],
    args: Sequence[Any],
    in_specs: Sequence[Any],
    out_specs: Any,
    mesh: Mesh,
    profile: Any,
    **kwargs: Any,
) -> Any:
    """explain's report of ``fn`` with its arguments typed as ``in_specs`` lay them out on ``mesh``'s Explicit axes
    (the typed program, where JAX types every op from the arguments' layouts; shapes only, nothing compiled), the
    parameters' outputs laid out as ``out_specs``.  The caller knows JAX types it (:func:`refused_on`)."""
    from ..analysis.program.trace import output_specs, trace

    _, shapes = _on_shapes(fn, args, in_specs, out_specs, mesh, kwargs)
    with jax.set_mesh(mesh):
        traced = trace(fn, *shapes, mesh=mesh, profile=profile, **kwargs)
    return traced.report(None, output_specs(traced.out_shape, out_specs, traced.mesh))


def collective_kinds(report: Any) -> dict[str, int]:
    """A report's collectives by kind, each op's counted per run (``op.repeat``), groups of one device left out."""
    kinds: dict[str, int] = {}
    for op in report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                kinds[c.kind] = kinds.get(c.kind, 0) + op.repeat
    return kinds


def read_compiled(compiled: Any, profile: Profile) -> Numbers:
    """A compiled program's collectives (priced on ``profile``, once per HLO instruction) and peak memory
    (``memory_analysis()``: arguments + outputs + temporaries - aliased), in :data:`Numbers`' order."""
    from ..testing import hlo

    by_instruction: dict[str, list[Any]] = {}
    for c in hlo.normalized(compiled.as_text() or ""):
        by_instruction.setdefault(c.name, []).append(c)
    comm_s = sent = 0.0
    count = 0
    kinds: dict[str, int] = {}
    for pieces in by_instruction.values():
        first = pieces[0]
        piece_sent = sum(c.sent_bytes for c in pieces)
        array = sum(c.array_bytes for c in pieces)
        if profile.combined_latency == "once":
            comm_s += first.runs * profile.collective_time(first.kind, first.group_size, piece_sent, array)
        else:  # each piece of a merged op is a collective of its own (XLA:CPU): its latency paid per piece
            comm_s += sum(
                c.runs * profile.collective_time(c.kind, c.group_size, c.sent_bytes, c.array_bytes) for c in pieces
            )
        sent += first.runs * piece_sent
        for c in pieces:
            count += c.runs
            kinds[c.kind] = kinds.get(c.kind, 0) + c.runs
    flops = compiled_flops(compiled)
    mem = compiled.memory_analysis()
    if mem is None:  # a backend that reports no memory: the prediction's figure stands (the caller's)
        return comm_s, sent, count, flops, None, kinds
    peak = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    return comm_s, sent, count, flops, peak, kinds


_WHILE = re.compile(r"\bwhile\(")


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs per device of a compiled (partitioned) program, by XLA's ``cost_analysis()``: every op's, the
    elementwise ones included (explain counts the dots').  None where it cannot be trusted or is missing: a
    program with a while loop (XLA's cost analysis counts a loop's body once, not once per iteration), or a
    backend that reports no cost analysis."""
    if _WHILE.search(compiled.as_text() or ""):
        return None
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001  (a backend without cost analysis raises its own error types)
        return None
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    if not isinstance(cost, dict) or "flops" not in cost:
        return None
    flops = float(cost["flops"])
    return flops if math.isfinite(flops) and flops >= 0 else None


def compile_and_read(lowered: jax.stages.Lowered, profile: Profile) -> Numbers:
    """Compile one lowered program and read it (:func:`read_compiled`).  XLA's compile (the CPU's and libtpu's)
    releases the GIL and is mostly one thread, so :func:`verify_assignments` runs several of these at once."""
    return read_compiled(lowered.compile(), profile)


def compiled_numbers(
    fn: Callable[..., Any],
    args: Sequence[Any],
    in_specs: Sequence[Any],
    out_specs: Any,
    mesh: Mesh,
    profile: Profile,
    **kwargs: Any,
) -> Numbers:
    """Compile ``fn`` on shapes laid out as ``in_specs`` and ``out_specs`` (:func:`lower_on_shapes`).

    Returns:
        (communication seconds on ``profile``, bytes sent per device, collectives per step,
        peak bytes per device (None where the backend has no ``memory_analysis()``), collectives by kind),
        all from the compiled program.
    """
    return compile_and_read(lower_on_shapes(fn, args, in_specs, out_specs, mesh, **kwargs), profile)


def compile_workers() -> int:
    """The CPUs this process may use: :func:`_compile_all` runs up to twice as many compiles at once."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows: no affinity call
        return max(1, os.cpu_count() or 1)


def _predicted(score: Any) -> tuple[float, float, int, int]:
    """A candidate's predicted (step time, bytes sent, collectives, memory), in :class:`Verified`'s order."""
    return score.time_s, score.comm, score.comm_ops or score.report.comm_count, score.memory


@dataclass(frozen=True)
class _Candidate:
    """One candidate to verify: its prediction and the shardings its program is compiled with."""

    rank: int
    label: str
    assign: tuple[int, ...]
    score: Any
    in_specs: tuple[Any, ...]
    out_specs: Any

    @property
    def program(self) -> tuple[Any, ...]:
        """What decides the compiled program: two candidates with equal shardings compile the same program
        (their assignments can differ only in what no leaf's spec shows), so it is compiled once."""
        out = jax.tree_util.tree_flatten(
            self.out_specs, is_leaf=lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec)
        )
        return (self.in_specs, tuple(out[0]), out[1])


class _Spread:
    """One spec repeated over the leaves of the subtree it lays out (not a pytree node: a leaf of the spread)."""

    def __init__(self, specs: list[Any]) -> None:
        self.specs = specs


def specs_per_leaf(arg: Any, specs: Any) -> list[Any]:
    """One spec per array leaf of ``arg`` (``jax.tree_util.tree_leaves``' order) from ``specs``, a tree prefix of
    ``arg`` whose leaves are PartitionSpecs or None.  Flattening ``specs`` alone would not do: where ``arg`` has an
    empty node (an Equinox layer's ``bias=None``), the spec tree unflattened from the parameters' structure holds a
    None that is no leaf of ``arg``, and every later spec would land on the wrong array."""
    P = jax.sharding.PartitionSpec
    spread = jax.tree_util.tree_map(
        lambda s, x: _Spread([s] * len(jax.tree_util.tree_leaves(x))),
        specs,
        arg,
        is_leaf=lambda s: s is None or isinstance(s, P),
    )
    runs = jax.tree_util.tree_leaves(spread, is_leaf=lambda r: isinstance(r, _Spread))
    return [s for run in runs for s in run.specs]


def candidate_of(costs: Costs, rank: int, label: str, assign: tuple[int, ...]) -> _Candidate:
    score: Score = costs.score(assign)
    flat_specs, out_specs = layout_specs(costs, *costs.specs(assign))
    return _Candidate(rank, label, assign, score, flat_specs, out_specs)


def layout_specs(costs: Costs, leaf_specs: list[Any], data_specs: list[Any]) -> tuple[tuple[Any, ...], Any]:
    """A layout's specs as ``verify=`` compiles it: one in_spec per array leaf of ``fn``'s arguments (the
    parameters' by leaf, the data arguments' by tree) and the out_specs (the parameters' outputs, their gradients,
    laid out like them)."""
    params_specs = jax.tree_util.tree_unflatten(costs.params_treedef, leaf_specs)
    full = costs.in_specs(params_specs, data_specs)
    flat_specs = tuple(s for arg, sub in zip(costs.args, full) for s in specs_per_leaf(arg, sub))
    out_leaves, out_def = jax.tree_util.tree_flatten(costs.traced.out_shape)
    out_specs = jax.tree_util.tree_unflatten(
        out_def, [None if i is None else leaf_specs[i] for i in costs.out_params[: len(out_leaves)]]
    )
    return flat_specs, out_specs


def _auto(mesh: Mesh) -> Mesh:
    """The same devices with Auto axes."""
    return jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    )


_PENDING: Numbers = (0.0, 0.0, 0, None, None, {})  # a compile not yet read (replaced before _compile_all returns)


@dataclass(frozen=True)
class OnAuto:
    """A candidate JAX refuses on the mesh's Explicit axes: why (:func:`refusal`), and the numbers of the same
    layout compiled with Auto axes on the same devices (the program ``jax.sharding.auto_axes`` would run)."""

    refused: str
    numbers: Numbers


def refusal(err: BaseException) -> str:
    """JAX's refusal on one line: its type and first line, and where in the user's code (as ``explain``'s explicit
    findings name it: the innermost frame outside JAX and libraries) when the traceback reaches it."""
    from ..analysis.explicit import plain_message, user_line

    text = str(err).strip()
    first = plain_message(text.splitlines()[0]) if text else ""
    where = user_line(err)
    return f"{type(err).__name__}: {first}" + ("" if where == "unknown" else f" (at {where})")


def _compile_all(
    fn: Callable[..., Any],
    costs: Costs,
    programs: Sequence[_Candidate],
    mesh: Mesh,
    kwargs: dict[str, Any],
    compiler: str,
) -> list[Numbers | OnAuto | BaseException]:
    """Each distinct program lowered (here, one after another: tracing holds the GIL) and compiled (on a
    thread pool, up to twice :func:`compile_workers` at once: a 7B step's TPU compile is minutes of CPU), in
    ``programs``' order; a target compiler's failure is returned, not raised (the caller reports it).  On a mesh
    with Explicit axes a program JAX refuses (or XLA fails on) is compiled again with Auto axes: where that
    compiles, the candidate is refused (:class:`OnAuto`, module doc); where it fails too, ``fn`` fails whatever
    the axes, and that is raised."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def on_auto(c: _Candidate, err: BaseException) -> OnAuto:
        if not explicit:
            raise EinshardError(
                f"plan(verify=...): XLA could not compile candidate {c.label!r}: {type(err).__name__}: {err}"
            ) from err
        try:
            numbers = compiled_numbers(
                fn, costs.args, c.in_specs, c.out_specs, _auto(mesh), c.score.report.profile.pricing(), **kwargs
            )
        except Exception:  # noqa: BLE001  (fn fails on Auto axes too: the user's own error, as JAX raised it)
            raise err from None
        return OnAuto(refusal(err), numbers)

    lowered: list[jax.stages.Lowered | BaseException] = []
    for c in programs:
        try:
            lowered.append(lower_on_shapes(fn, costs.args, c.in_specs, c.out_specs, mesh, **kwargs))
        except Exception as err:  # noqa: BLE001  (JAX's and XLA's errors have no common type)
            lowered.append(err)
    # A lowering's error stays the result; the others are replaced by their compiles' below.
    results: list[Numbers | OnAuto | BaseException] = [
        low if isinstance(low, BaseException) else _PENDING for low in lowered
    ]
    jobs = {i: low for i, low in enumerate(lowered) if not isinstance(low, BaseException)}
    # Up to twice the CPUs at once, not one per CPU: the compiles take about equal CPU time, so a pool of one
    # per CPU leaves a last round with idle cores (3 compiles on 2 CPUs: 2 rounds, where all at once take 1.5);
    # measured on the 7B step under load, the third compile ran alone for 500 s after the first two.  The cap
    # bounds the memory of compiles in flight (a 7B step's TPU compile holds ~1 GB).
    with ThreadPoolExecutor(max_workers=max(1, min(2 * compile_workers(), len(jobs)))) as pool:
        futures = {
            i: pool.submit(compile_and_read, low, programs[i].score.report.profile.pricing()) for i, low in jobs.items()
        }
        for i, future in futures.items():
            try:
                results[i] = future.result()
            except Exception as err:  # noqa: BLE001
                results[i] = err
    if compiler == "XLA":
        for i, (c, got) in enumerate(zip(programs, results)):
            if isinstance(got, BaseException):
                results[i] = on_auto(c, got)
    return results


def verify_assignments(
    fn: Callable[..., Any],
    costs: Costs,
    candidates: Sequence[tuple[str, tuple[int, ...]]],
    mesh: Mesh,
    kwargs: dict[str, Any],
    hbm_bytes: int | None = None,
    compiler: str = "XLA",
) -> list[tuple[Verified, tuple[int, ...]]]:
    """Each candidate (label, assignment) predicted and compiled, ranked by the compiled numbers (module doc);
    the first is marked chosen.  Candidates whose shardings are equal share one compile; the distinct programs
    compile concurrently (:func:`_compile_all`)."""
    wanted = [candidate_of(costs, rank, label, assign) for rank, (label, assign) in enumerate(candidates)]
    distinct: dict[tuple[Any, ...], int] = {}
    for c in wanted:
        distinct.setdefault(c.program, len(distinct))
    firsts = {index: next(c for c in wanted if distinct[c.program] == index) for index in distinct.values()}
    compiled = _compile_all(fn, costs, [firsts[k] for k in range(len(firsts))], mesh, kwargs, compiler)
    # XLA's FLOPs where every compiled program has them (no loops), else the prediction's for all: one count.
    by_xla = all(
        isinstance(n, BaseException) or (n.numbers if isinstance(n, OnAuto) else n)[3] is not None for n in compiled
    )
    rows: list[tuple[tuple[Any, ...], Verified, tuple[int, ...]]] = []
    for c in wanted:
        label, assign, score, rank = c.label, c.assign, c.score, c.rank
        numbers = compiled[distinct[c.program]]
        if isinstance(numbers, BaseException):
            # A target's compiler (libtpu) failing on one candidate is its bug or a version mismatch, not
            # the plan's: that candidate is reported unverified and ranked last; the others still decide.
            err = numbers
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            predicted = _predicted(score)
            failed = Verified(
                label,
                *predicted,
                *predicted,  # nothing compiled: the compiled columns repeat the prediction
                fits=False,
                predicted_kinds=predicted_kinds(score.report),
                compiler=compiler,
                error=f"{type(err).__name__}: {first}",
                predicted_compute_s=score.compute_s,
                compiled_compute_s=score.compute_s,
            )
            rows.append(((True, True, True, 0.0, 0.0, 0.0, 0, rank), failed, assign))
            continue
        refused = numbers.refused if isinstance(numbers, OnAuto) else ""
        comm_s, sent, count, flops, peak, kinds = numbers.numbers if isinstance(numbers, OnAuto) else numbers
        memory = score.memory if peak is None else peak + costs.optimizer_bytes(assign)
        fits = costs.budget is None or memory <= costs.budget
        # XLA's FLOPs replace the walk's; what no FLOP count sees (a profile's kernel and element prices) stays priced
        compute_s = (
            flops / score.report.profile.flops + unwalked_compute_s(score.report)
            if by_xla and flops is not None
            else score.compute_s
        )
        time_s = compute_s + comm_s
        primary = {"memory": float(memory), "communication": sent}.get(costs.objective, time_s)
        row = Verified(
            label,
            *_predicted(score),
            time_s,
            sent,
            count,
            memory,
            dict(kinds),
            fits,
            predicted_kinds=predicted_kinds(score.report),
            fits_hbm=None if hbm_bytes is None else memory <= hbm_bytes,
            compiler=compiler,
            predicted_compute_s=score.compute_s,
            compiled_compute_s=compute_s,
            compute_from="cost_analysis" if by_xla and flops is not None else "prediction",
            refused=refused,
        )
        # A layout JAX refuses on the Explicit axes ranks after every one it accepts: the user's step, run as
        # written, raises on it (its numbers are the Auto program's).
        key = (False, bool(refused), not fits, settled(primary), settled(time_s), settled(sent), memory, rank)
        rows.append((key, row, assign))
    rows.sort(key=lambda r: r[0])
    if rows and rows[0][1].error:
        raise EinshardError(
            f"plan(verify=...): the {compiler} compiled none of the {len(rows)} candidates; the first: "
            f"{rows[0][1].label!r}: {rows[0][1].error}",
            hint="A libtpu that does not match this jax fails so (jax 0.10.2 pins libtpu 0.0.42.*: "
            "pip install 'jax[tpu]==<your jax>' or 'einshard[tpu]'); or pass verify=0 to plan on the prediction.",
        )
    out = []
    for k, (_, row, assign) in enumerate(rows):
        out.append((row if k else _chosen(row), assign))
    return out


def _chosen(row: Verified) -> Verified:
    import dataclasses

    return dataclasses.replace(row, chosen=True)
