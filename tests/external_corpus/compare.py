"""One external case against XLA: explain's collectives and peak memory vs the compiled HLO, values vs unsharded.

The comparison is tests/test_explain_corpus.py's (kinds and counts exact, CPU reduce-scatter ≡ all-reduce +
dynamic-slice via :func:`einshard.testing.hlo.normalized`, bytes per device within 10%, peak memory per device
within 25% of ``memory_analysis()``), made to return a record instead of asserting, so that one run can both
check the contract (never silent) and write the match table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import cache
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.program import trace
from einshard._src.analysis.program.movement import CONFLICT_NOTE
from einshard._src.analysis.program.report import ApproximateBound
from einshard._src.testing.bounds import Gaps, Measured, within_bound
from einshard._src.testing.bounds import gaps as _gaps
from einshard.testing import hlo

from . import MESH_AXES, MESH_SHAPE, Family, specs_for
from .families import FAMILIES

MeshKind = Literal["auto", "explicit"]
Mode = Literal["fwd", "grad", "step"]  # step: loss, grad and the optimizer update (Family.step)
Status = Literal["match", "incomplete", "said-so", "silent", "error"]
# The statuses the contract accepts: explain matches XLA, or its first line says where and by how much it may not.
SAID = ("match", "incomplete", "said-so")
BYTES_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.25
MESH_KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


@dataclass(frozen=True)
class Outcome:
    """What one case measured. ``status``: 'match', 'incomplete' or 'said-so' (the report says so), 'silent'."""

    case: str
    family: str
    library: str
    complete: bool
    unfollowed: tuple[str, ...]
    auto_axes: bool  # JAX refused the Explicit program as written: it runs wrapped in jax.sharding.auto_axes
    explain_kinds: dict[str, int]
    xla_kinds: dict[str, int]
    explain_bytes: float
    xla_bytes: float
    explain_peak: int
    xla_peak: int
    values_equal: bool
    misses: tuple[str, ...] = field(default=())  # which comparisons failed, in words
    error: str = ""  # explain raised instead of reporting (a defect, whatever the error's type)
    # The report's approximate marks (its first line): where, and how far it says XLA may be (None: no bound).
    approximate_at: tuple[str, ...] = ()
    bound_collectives: int | None = 0
    bound_bytes: float | None = 0.0
    bound_peak: float = 0.0
    conflict_marks: int = 0  # ops marked as a layout conflict XLA may settle upstream (movement.mark_conflict)

    @property
    def kinds_match(self) -> bool:
        return self.explain_kinds == self.xla_kinds

    @property
    def gaps(self) -> Gaps:
        """How far explain is from XLA, in the bound's terms (0 where a comparison is within its tolerance)."""
        return gaps(self)

    @property
    def within_bound(self) -> bool:
        """Whether every miss lies within the bound the report states (strict: no tolerance added to it)."""
        if not self.approximate_at:
            return False
        bound = ApproximateBound(self.bound_collectives, self.bound_bytes, self.bound_peak)
        return within_bound(self.gaps, bound)

    @property
    def status(self) -> Status:
        """'match'; 'incomplete' or 'said-so' (the report's first line says it may differ, and by enough);
        'silent' (complete, and wrong beyond what it says: a defect) or 'error'."""
        if self.error:
            return "error"
        if not self.misses:
            return "match"
        if not self.complete:
            return "incomplete"
        return "said-so" if self.within_bound else "silent"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kinds_match": self.kinds_match, "status": self.status, "gaps": asdict(self.gaps)}


def gaps(o: Outcome) -> Gaps:
    """How far explain is from XLA in the bound's terms (einshard._src.testing.bounds: the primitive tests' rule)."""
    return _gaps(
        Measured(o.explain_kinds, o.explain_bytes, o.explain_peak),
        Measured(o.xla_kinds, o.xla_bytes, o.xla_peak),
        bytes_tolerance=BYTES_TOLERANCE,
        peak_range=(1 - MEMORY_TOLERANCE, 1 + MEMORY_TOLERANCE),
    )


def mesh_of(kind: MeshKind) -> jax.sharding.Mesh:
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(MESH_KINDS[kind],) * len(MESH_AXES))


@cache
def _unsharded(family: str, mode: Mode) -> Any:
    f = FAMILIES[family]()
    fn, params = _function(f, mode)
    return jax.device_get(jax.jit(fn)(params, f.batch))


def _function(family: Family, mode: Mode) -> tuple[Any, Any]:
    """(the function a mode runs, its first argument): the loss, its gradient, or the training step."""
    if mode == "step":
        if family.step is None:
            raise ValueError(f"{family.name} has no training step")
        return family.step, (family.params, family.opt_state)
    return (jax.grad(family.loss) if mode == "grad" else family.loss), family.params


def _close(a: Any, b: Any) -> bool:
    return all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=1e-3, atol=1e-5)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1.0)


def _program(fn: Any, psh: Any, bsh: Any, out_sh: Any, params: Any, batch: Any, mesh: Any) -> tuple[Any, Any, bool]:
    """(the function as run, its compiled form, whether it needed auto_axes): JAX's refusal, not ours, decides."""
    jitted = lambda f: jax.jit(f, in_shardings=(psh, bsh), out_shardings=out_sh)  # noqa: E731
    with jax.set_mesh(mesh):
        try:
            return fn, jitted(fn).lower(params, batch).compile(), False
        except Exception:  # noqa: BLE001 -- JAX's sharding-in-types refusal comes as several error types
            if all(t == AxisType.Auto for t in mesh.axis_types):
                raise
        wrapped = jax.sharding.auto_axes(fn, out_sharding=out_sh)
        return wrapped, jitted(wrapped).lower(params, batch).compile(), True


def measure(family_name: str, strategy: str, mode: Mode, kind: MeshKind) -> Outcome:
    family = FAMILIES[family_name]()
    mesh = mesh_of(kind)
    fn, inputs = _function(family, mode)
    pexpr, bexpr = specs_for(family, strategy, inputs)
    place = lambda e, a: einshard.sharding(e, a.shape, mesh=mesh)  # noqa: E731
    psh, bsh = jax.tree.map(place, pexpr, inputs), jax.tree.map(place, bexpr, family.batch)
    # A gradient and a training step's new (params, opt_state) are laid out as their inputs; a loss replicated.
    out_sh = NamedSharding(mesh, P()) if mode == "fwd" else psh
    # Placed inputs, as users pass them: on an Explicit mesh their types carry the layout JAX checks.
    params, batch = jax.device_put(inputs, psh), jax.device_put(family.batch, bsh)
    fn, compiled, wrapped = _program(fn, psh, bsh, out_sh, params, batch, mesh)
    with jax.set_mesh(mesh):
        try:
            # Traced from the placed inputs the step is compiled from: on an Explicit mesh their types decide
            # the program JAX writes (a transposed broadcast typed replicated is an all-gather in XLA's HLO).
            report = trace(fn, params, batch, mesh=mesh).report(
                (pexpr, bexpr), [s.spec for s in jax.tree.leaves(out_sh)]
            )
        except Exception as e:  # noqa: BLE001 -- recorded: the table lists what explain raised on
            report, error = None, f"{type(e).__name__}: {e}"[:300]
        else:
            error = ""
        got = jax.device_get(jax.jit(fn, in_shardings=(psh, bsh), out_shardings=out_sh)(params, batch))
    xla = hlo.normalized(compiled.as_text())
    values_equal = _close(got, _unsharded(family_name, mode))
    if report is None:
        return _failed(family_name, family.library, strategy, mode, kind, wrapped, values_equal, xla, error)
    explain_kinds = Counter(
        c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1
    )
    # Per step: a collective inside a while loop (a scan over layers) counts once per iteration, as explain's
    # op.repeat does.
    xla_kinds = Counter({k: n for k, n in _per_step(xla).items()})
    explain_bytes = float(sum(c.bytes * op.repeat for op in report.ops for c in op.collectives))
    xla_bytes = float(sum(c.sent_bytes * c.runs for c in xla))
    mem = compiled.memory_analysis()
    xla_peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    misses = []
    if explain_kinds != xla_kinds:
        misses.append(f"collectives: explain {_words(explain_kinds)} vs XLA {_words(xla_kinds)}")
    if not _within(explain_bytes, xla_bytes, BYTES_TOLERANCE):
        misses.append(f"bytes: explain {explain_bytes:.0f} vs XLA {xla_bytes:.0f}")
    if not _within(report.peak_bytes, xla_peak, MEMORY_TOLERANCE):
        misses.append(f"peak: explain {report.peak_bytes} vs XLA {xla_peak}")
    return Outcome(
        case=case_id(family_name, strategy, mode, kind),
        family=family_name,
        library=family.library,
        complete=report.complete,
        unfollowed=tuple(report.unfollowed),
        auto_axes=wrapped,
        explain_kinds=dict(sorted(explain_kinds.items())),
        xla_kinds=dict(sorted(xla_kinds.items())),
        explain_bytes=explain_bytes,
        xla_bytes=xla_bytes,
        explain_peak=int(report.peak_bytes),
        xla_peak=int(xla_peak),
        values_equal=values_equal,
        misses=tuple(misses),
        approximate_at=tuple(report.approximate_at),
        bound_collectives=report.approximate_bound.collectives,
        bound_bytes=report.approximate_bound.bytes,
        bound_peak=report.approximate_bound.peak,
        conflict_marks=sum(CONFLICT_NOTE in op.note for op in report.ops),
    )


def _failed(
    family: str, library: str, strategy: str, mode: str, kind: str, wrapped: bool, ok: bool, xla: list, error: str
) -> Outcome:
    kinds = _per_step(xla)
    return Outcome(
        case_id(family, strategy, mode, kind),
        family,
        library,
        False,
        (),
        wrapped,
        {},
        dict(sorted(kinds.items())),
        0.0,
        float(sum(c.sent_bytes * c.runs for c in xla)),
        0,
        0,
        ok,
        ("explain raised",),
        error,
    )


def _per_step(xla: list) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for c in xla:
        kinds[c.kind] += c.runs
    return kinds


def _words(kinds: Counter[str]) -> str:
    return ", ".join(f"{n}×{k}" for k, n in sorted(kinds.items())) or "none"


def case_id(family: str, strategy: str, mode: str, kind: str) -> str:
    return f"{kind}-{family}-{strategy}-{mode}"
