"""The planner: ``einshard.plan(fn, *args)`` picks the layouts that make a step fastest within a memory budget.

It traces ``fn`` once and costs every candidate assignment with the one cost
model einshard has, :func:`einshard.explain` (through
:class:`~einshard.analysis.program.TracedProgram`, which remembers per-op
costs), so a plan's numbers are exactly what ``explain`` prints for it.

How it works:

1. **Groups.**  Parameters (by default the first argument) are grouped by role:
   the path with list indices generalised (``['layers'][3]['w1']`` →
   ``['layers'][*]['w1']``); leaves of one group share one layout.  A leaf
   under a ``layers``/``blocks``/``stack`` key whose leading axis is shared by
   its siblings is a *stacked* layer axis (named ``l``).  The data arguments
   (the rest) form one group: the batch (leading) axis and, for rank ≥ 2, the
   sequence axis.
2. **Candidates** per group, einshard expressions over the mesh axes (of size
   > 1), pruned to those that divide: replicated; one axis split over one mesh
   axis (column/row tensor parallel, or FSDP when that mesh axis also splits
   the batch); one axis over two mesh axes; two axes over two mesh axes
   (FSDP × TP); a stacked layer axis over one mesh axis (the pipeline-stage
   layout, costed as ``jit`` runs it: the stack is gathered every step).  The
   batch: replicated, the batch axis over every non-empty set of mesh axes
   (in mesh order), and sequence parallel (sequence axis over a mesh axis the
   batch does not use).  Groups below 0.1 % of the parameter bytes stay
   replicated (their layout cannot matter for memory and barely for time).
3. **Score** of an assignment: ``explain``'s step time (objectives
   ``'training'``, ``'inference'``), memory per device (``'memory'``) or bytes
   sent per device (``'communication'``); ties broken by time, then memory,
   then communication.  Memory per device = ``explain``'s peak live bytes
   (arguments, activations, gradients that ``fn`` returns) + optimizer state:
   ``optimizer_bytes_per_param`` bytes for each parameter element held by the
   device, default 8 for ``'training'`` (Adam's two moments in float32,
   sharded like their parameter) and 0 otherwise.  An assignment that exceeds
   ``memory_budget`` ranks after every one that fits, least memory first.
4. **Search.**  Exhaustive when the product of candidate counts is at most
   ``exhaustive_limit`` (2048); else coordinate descent: starting from a few
   assignments (data parallel, fully sharded, and ``restarts`` seeded random
   ones), each group in turn (batch first, then parameter groups by size) takes
   its best candidate with the others fixed, until a full round changes
   nothing; then, from the best end point, every two groups move together
   (all their pairs of candidates) when that is at most ``pair_limit`` (512)
   assignments, descending again after each improvement.  It is a heuristic:
   tests measure it against brute force.

Example:
    >>> import jax, jax.numpy as jnp, einshard
    >>> def loss(p, x):
    ...     return jnp.mean((jnp.tanh(x @ p['w1']) @ p['w2']) ** 2)
    >>> params = {'w1': jax.ShapeDtypeStruct((1024, 4096), jnp.float32),
    ...           'w2': jax.ShapeDtypeStruct((4096, 1024), jnp.float32)}
    >>> batch = jax.ShapeDtypeStruct((65536, 1024), jnp.float32)
    >>> r = einshard.plan(jax.value_and_grad(loss), params, batch,
    ...                   mesh={'data': 8}, profile='h100')
    >>> r.rules[r"^\\['w1'\\]$"], r.data_rules[0]['^$']
    ('x y -> x y', 'b s -> b@data s')
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..core.layout import MeshAxis
from ..errors import EinshardError
from .cost import human_bytes, human_time
from .program import ProgramReport, TracedProgram, trace

__all__ = ["plan", "PlanResult", "Alternative", "Candidate", "Group", "parse_bytes"]

OBJECTIVES = ("training", "inference", "memory", "communication")
EXHAUSTIVE_LIMIT = 2048
PAIR_LIMIT = 512
SMALL_GROUP_FRACTION = 1e-3
_STACK_KEY = re.compile(r"layer|block|stack|scan|repeat", re.IGNORECASE)


# ---------------------------------------------------------------------------
# Inputs


def parse_bytes(budget: int | float | str | None) -> int | None:
    """A memory budget in bytes from a number or a string like ``'16GiB'``, ``'1.5 GB'``, ``'512MiB'``.

    Example:
        >>> parse_bytes('16GiB') == 16 * 2**30, parse_bytes('2 GB'), parse_bytes(None)
        (True, 2000000000, None)
    """
    if budget is None:
        return None
    if isinstance(budget, (int, float)):
        return int(budget)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
    if not m:
        raise EinshardError(f"memory_budget {budget!r} is not a size: use bytes or a string like '16GiB', '2GB'")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    scale |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(m.group(1)) * scale[unit])


def _mesh_axes(mesh: Any, args: tuple[Any, ...] = ()) -> tuple[MeshAxis, ...]:
    """``mesh=``, else the current mesh (``jax.set_mesh``), else the arguments', else an EinshardError."""
    from ..core.mesh import mesh_axes, resolve_mesh

    return mesh_axes(resolve_mesh(mesh, args, what="einshard.plan()", check_operands=False))


def _param_invars(args: tuple[Any, ...], p_idx: Sequence[int]) -> list[int]:
    """The jaxpr input index of each parameter leaf (parameters are ``args[i]`` for i in ``p_idx``, in that order)."""
    starts, n = [], 0
    for x in args:
        starts.append(n)
        n += len(jax.tree_util.tree_leaves(x))
    return [starts[i] + j for i in p_idx for j in range(len(jax.tree_util.tree_leaves(args[i])))]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in np.shape(x)) if not hasattr(x, "shape") else tuple(int(s) for s in x.shape)


def _itemsize(x: Any) -> int:
    return int(np.dtype(getattr(x, "dtype", np.float32)).itemsize)


# ---------------------------------------------------------------------------
# Groups and candidates


@dataclass(frozen=True)
class Candidate:
    """One layout for a group: which mesh axes split each tensor axis.

    For the batch group ``dims`` is ``(batch axes, sequence axes)`` and applies
    to every data leaf (the sequence axes to leaves of rank ≥ 2).
    """

    dims: tuple[tuple[str, ...], ...]

    @property
    def sharded(self) -> int:
        return sum(len(d) for d in self.dims)


@dataclass(frozen=True)
class Group:
    """Parameter leaves that share one layout (or the batch: every data leaf).

    Attributes:
        pattern: the regular expression of ``rules`` (``einshard(params, rules)`` matches it on paths).
        display: the path with indices generalised, ``['layers'][*]['w1']``.
        names: the tensor axis names of its expressions (``l`` = a stacked layer axis).
        shapes: the shapes of its leaves.
        leaves: indices of its leaves among the parameters' leaves.
        nbytes: bytes of all its leaves.
        candidates: its candidate layouts, replicated first.
    """

    pattern: str
    display: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    leaves: tuple[int, ...]
    nbytes: int
    stacked: bool
    candidates: tuple[Candidate, ...] = ()
    is_batch: bool = False
    # The dimensions its matmuls contract (:func:`contracted_dims`); None: unknown (no matmul reads it).
    contracted: frozenset[int] | None = None

    def expression(self, cand: Candidate, rank: int | None = None) -> str:
        """The einshard expression of ``cand`` for this group (a data leaf of rank ``rank``)."""
        if self.is_batch:
            names = _data_names(rank or 0)
            dims = [cand.dims[0], cand.dims[1] if len(names) >= 2 else ()] + [()] * max(0, len(names) - 2)
            dims = dims[: len(names)]
        else:
            names, dims = list(self.names), list(cand.dims)
        left = " ".join(names)
        right = " ".join(_item(n, d) for n, d in zip(names, dims))
        return f"{left} -> {right}"


def _item(name: str, axes: tuple[str, ...]) -> str:
    if not axes:
        return name
    return f"{name}@{axes[0]}" if len(axes) == 1 else f"{name}@({','.join(axes)})"


def _data_names(rank: int) -> list[str]:
    base = ["b", "s", "d", "e", "f", "g", "h"]
    return (
        base[:rank] if rank <= 2 else ["b", "s", *base[2:rank]] if rank <= len(base) else [f"a{i}" for i in range(rank)]
    )


def _param_names(rank: int, stacked: bool) -> tuple[str, ...]:
    letters = ["x", "y", "z", "w", "v", "u", "t"]
    rest = rank - 1 if stacked else rank
    names = letters[:rest] if rest <= len(letters) else [f"a{i}" for i in range(rest)]
    return tuple(["l", *names] if stacked else names)


_INDEX = re.compile(r"\[(\d+)\]")


def _groups(params: Any, mesh: tuple[MeshAxis, ...]) -> tuple[list[Group], list[tuple[Any, Any]]]:
    """Parameter groups by role (indices generalised, split again where shapes differ)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = [jax.tree_util.keystr(path) for path, _ in leaves]
    # A stacked layer axis: under a layer-ish key, with a leading size its siblings share.
    leading: dict[str, set[int]] = {}
    for key, (_, x) in zip(keys, leaves):
        m = _STACK_KEY.search(key)
        if m and len(_shape(x)) >= 2 and not _INDEX.search(key):
            leading.setdefault(key[: m.end()], set()).add(_shape(x)[0])
    by_pattern: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        general = _INDEX.sub("[*]", key)
        by_pattern.setdefault(general, []).append(i)
    groups: list[Group] = []
    for general, members in by_pattern.items():
        if len({_shape(leaves[i][1]) for i in members}) == 1:
            parts = [(general, members)]
        else:  # same role, different shapes: each leaf its own group
            parts = [(keys[i], [i]) for i in members]
        for display, part in parts:
            pattern = (
                "^"
                + "".join(
                    r"\[\d+\]" if tok == "[*]" else re.escape(tok) for tok in re.split(r"(\[\*\])", display) if tok
                )
                + "$"
            )
            shape = _shape(leaves[part[0]][1])
            m = _STACK_KEY.search(display)
            prefix = display[: m.end()] if m else ""
            stacked = bool(
                m
                and "[*]" not in display
                and len(shape) >= 2
                and shape[0] > 1
                and leading.get(prefix) == {shape[0]}
                and sum(1 for k in keys if k.startswith(prefix)) > 1
            )
            nbytes = sum(int(math.prod(_shape(leaves[i][1]))) * _itemsize(leaves[i][1]) for i in part)
            groups.append(
                Group(
                    pattern,
                    display,
                    _param_names(len(shape), stacked),
                    tuple(_shape(leaves[i][1]) for i in part),
                    tuple(part),
                    nbytes,
                    stacked,
                )
            )
    return groups, leaves


def _divides(shapes: Iterable[tuple[int, ...]], dims: Sequence[tuple[str, ...]], sizes: dict[str, int]) -> bool:
    return all(s[i] % math.prod(sizes[m] for m in d) == 0 for s in shapes for i, d in enumerate(dims) if d)


def _param_candidates(group: Group, mesh: tuple[MeshAxis, ...], small: bool) -> tuple[Candidate, ...]:
    """Replicated, TP/FSDP on one axis, one axis over two mesh axes, FSDP×TP, pipeline stages."""
    rank = len(group.names)
    sizes = {m.name: m.size for m in mesh}
    axes = [m.name for m in mesh if m.size > 1]
    none: tuple[tuple[str, ...], ...] = tuple(() for _ in range(rank))
    out = [Candidate(none)]
    if small or rank == 0:
        return tuple(out)
    body = range(1, rank) if group.stacked else range(rank)

    def put(assign: dict[int, tuple[str, ...]]) -> None:
        dims = tuple(assign.get(i, ()) for i in range(rank))
        cand = Candidate(dims)
        if cand not in out and _divides(group.shapes, dims, sizes):
            out.append(cand)

    for i in body:
        for a in axes:
            put({i: (a,)})
    for a, b in itertools.combinations(axes, 2):
        for i in body:
            put({i: (a, b)})
        for i, j in itertools.permutations(body, 2):
            put({i: (a,), j: (b,)})
    if len(axes) > 2:
        for i in body:
            put({i: tuple(axes)})
    if group.stacked:
        for a in axes:
            put({0: (a,)})  # pipeline stages: the layer stack split over a mesh axis
    return tuple(out)


def _batch_candidates(data_shapes: Sequence[tuple[int, ...]], mesh: tuple[MeshAxis, ...]) -> tuple[Candidate, ...]:
    """Replicated, the batch axis over every set of mesh axes, and sequence parallel."""
    sizes = {m.name: m.size for m in mesh}
    axes = [m.name for m in mesh if m.size > 1]
    batched = [s for s in data_shapes if len(s) >= 1]
    seqd = [s for s in data_shapes if len(s) >= 2]
    out: list[Candidate] = []
    for k in range(0, len(axes) + 1):
        for batch in itertools.combinations(axes, k):
            if not all(s[0] % math.prod(sizes[m] for m in batch) == 0 for s in batched):
                continue
            out.append(Candidate((batch, ())))
            if not seqd:
                continue
            for a in axes:
                if a in batch:
                    continue
                if all(s[1] % sizes[a] == 0 for s in seqd):
                    out.append(Candidate((batch, (a,))))
    return tuple(out)


# ---------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Alternative:
    """A costed assignment: its rules and what ``explain`` says it costs."""

    label: str
    rules: dict[str, str]
    data_rules: tuple[dict[str, str | None], ...]
    time_s: float
    memory_bytes: int
    comm_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"data_rules": [dict(r) for r in self.data_rules]}

    def line(self) -> str:
        fit = "" if self.fits else "  (over budget)"
        return (
            f"{self.label:<34} {human_time(self.time_s):>10}/step  {human_bytes(self.memory_bytes):>10}/device  "
            f"{human_bytes(self.comm_bytes):>10} sent{fit}"
        )


@dataclass(frozen=True)
class PlanResult:
    """What ``einshard.plan`` chose, what it costs, and why.

    Attributes:
        rules: ordered mapping path pattern → expression for the parameters:
            ``einshard.einshard(params, result.rules, mesh=mesh)``.
        data_rules: one such mapping per data argument (``einshard(batch, result.data_rules[0], mesh=mesh)``).
        time_s, memory_bytes, comm_bytes: the choice's step time, memory per device
            (peak + optimizer state) and bytes sent per device.
        fits: whether ``memory_bytes`` is within the budget (True when there is none).
        warning: why the result does not fit, else ''.
        alternatives: the runners-up, best first, and the presets (``dp``, ``fsdp``, and yours).
        explanation: why this choice, in words.
        report: the :class:`~einshard.analysis.program.ProgramReport` of the choice.
        strategies: a short strategy name per parameter group (and ``batch``).
        method: ``'exhaustive'`` or ``'coordinate descent'``; evaluated: how many assignments were costed.
    """

    rules: dict[str, str]
    data_rules: tuple[dict[str, str | None], ...]
    time_s: float
    memory_bytes: int
    comm_bytes: float
    fits: bool
    warning: str
    alternatives: tuple[Alternative, ...]
    explanation: str
    report: ProgramReport = field(repr=False)
    strategies: dict[str, str] = field(default_factory=dict)
    objective: str = "training"
    memory_budget: int | None = None
    method: str = "exhaustive"
    evaluated: int = 0
    space: int = 0
    planning_s: float = 0.0

    def place(self, params: Any, *data: Any, mesh: Any = None) -> tuple[Any, ...]:
        """``(params, *data)`` laid out by the plan's rules (``einshard.einshard`` on each)."""
        from ..placement import einshard

        placed = [einshard(params, self.rules, mesh=mesh)]
        placed += [einshard(x, rules, mesh=mesh) for x, rules in zip(data, self.data_rules)]
        return tuple(placed)

    def save_rules(self, path: str, mesh: dict[str, int] | None = None) -> None:
        """Write the choice as a rules file: ``{"params": {pattern: expression}, "batch": expression, "mesh": sizes}``.

        ``einshard demo --rules PATH`` reads it; ``einshard.einshard(params, json.load(f)["params"])``
        places parameters with it.  ``batch`` is the first data argument's expression when it is
        one array.
        """
        out: dict[str, Any] = {"params": self.rules}
        if self.data_rules and len(self.data_rules[0]) == 1:
            (expr,) = self.data_rules[0].values()
            if expr is not None:
                out["batch"] = expr
        if mesh is not None:
            out["mesh"] = dict(mesh)
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": dict(self.rules),
            "data_rules": [dict(r) for r in self.data_rules],
            "time_s": self.time_s,
            "memory_bytes": self.memory_bytes,
            "comm_bytes": self.comm_bytes,
            "fits": self.fits,
            "warning": self.warning,
            "objective": self.objective,
            "memory_budget": self.memory_budget,
            "strategies": dict(self.strategies),
            "method": self.method,
            "evaluated": self.evaluated,
            "space": self.space,
            "planning_s": self.planning_s,
            "alternatives": [a.to_dict() for a in self.alternatives],
            "explanation": self.explanation,
        }

    def __str__(self) -> str:
        budget = human_bytes(self.memory_budget) if self.memory_budget is not None else "none"
        lines = [
            f"plan ({self.objective}, budget {budget}): {human_time(self.time_s)}/step, "
            f"{human_bytes(self.memory_bytes)}/device, {human_bytes(self.comm_bytes)} sent/device"
            + ("" if self.fits else "  ** DOES NOT FIT **"),
            "rules:",
        ]
        width = max([len(p) for p in self.rules] + [10])
        for pattern, expr in self.rules.items():
            lines.append(f"  {pattern:<{width}}  {expr!r}")
        for i, data in enumerate(self.data_rules):
            for pattern, data_expr in data.items():
                lines.append(f"  data[{i}] {pattern:<{max(width - 8, 2)}}  {data_expr!r}")
        lines.append("why:")
        lines += ["  " + ln for ln in self.explanation.splitlines()]
        if self.alternatives:
            lines.append("alternatives:")
            lines += ["  " + a.line() for a in self.alternatives]
        lines.append(
            f"searched {self.evaluated} of {self.space} assignments ({self.method}) in {self.planning_s:.2f} s"
        )
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Costing


@dataclass(frozen=True)
class _Score:
    fits: bool
    primary: float
    time_s: float
    memory: int
    comm: float
    sharded: int
    report: ProgramReport = field(compare=False, repr=False)

    @property
    def key(self) -> tuple[Any, ...]:
        if not self.fits:
            return (1, self.memory, self.time_s, self.comm, self.sharded)
        return (0, self.primary, self.time_s, self.memory, self.comm, self.sharded)


class _Costs:
    """Scores assignments (tuples of candidate indices, batch group last) with the traced program."""

    def __init__(
        self,
        traced: TracedProgram,
        groups: list[Group],
        batch: Group,
        n_param_leaves: int,
        data_structure: list[tuple[Any, list[int]]],
        objective: str,
        budget: int | None,
        opt_bytes: float,
    ) -> None:
        self.traced, self.groups, self.batch = traced, groups, batch
        self.n_param_leaves = n_param_leaves
        self.data_structure = data_structure
        self.objective, self.budget, self.opt_bytes = objective, budget, opt_bytes
        self.sizes = {m.name: m.size for m in traced.mesh}
        self.cache: dict[tuple[int, ...], _Score] = {}

    def specs(self, assign: tuple[int, ...]) -> list[Any]:
        P = jax.sharding.PartitionSpec
        leaf_specs: list[Any] = [None] * self.n_param_leaves
        for g, c in zip(self.groups, assign):
            spec = P(*[(d if len(d) > 1 else d[0]) if d else None for d in g.candidates[c].dims])
            for i in g.leaves:
                leaf_specs[i] = spec
        data = self.batch.candidates[assign[-1]]
        out = []
        for treedef, ranks in self.data_structure:
            specs = []
            for r in ranks:
                dims: list[Any] = [None] * r
                if r >= 1 and data.dims[0]:
                    dims[0] = data.dims[0] if len(data.dims[0]) > 1 else data.dims[0][0]
                if r >= 2 and data.dims[1]:
                    dims[1] = data.dims[1][0]
                specs.append(P(*dims))
            out.append(jax.tree_util.tree_unflatten(treedef, specs))
        return [leaf_specs, out]

    def score(self, assign: tuple[int, ...]) -> _Score:
        hit = self.cache.get(assign)
        if hit is not None:
            return hit
        leaf_specs, data_specs = self.specs(assign)
        params_specs = jax.tree_util.tree_unflatten(self.params_treedef, leaf_specs)
        out_specs = [None if i is None else leaf_specs[i] for i in self.out_params]
        report = self.traced.report(self.in_specs(params_specs, data_specs), out_specs)
        memory = report.peak_bytes + self.optimizer_bytes(assign)
        fits = self.budget is None or memory <= self.budget
        primary = {
            "training": report.time_s,
            "inference": report.time_s,
            "memory": float(memory),
            "communication": report.comm_bytes,
        }[self.objective]
        sharded = sum(g.candidates[c].sharded for g, c in zip(self.groups, assign))
        score = _Score(fits, primary, report.time_s, memory, report.comm_bytes, sharded, report)
        self.cache[assign] = score
        return score

    def optimizer_bytes(self, assign: tuple[int, ...]) -> int:
        if not self.opt_bytes:
            return 0
        total = 0.0
        for g, c in zip(self.groups, assign):
            dims = g.candidates[c].dims
            split = math.prod(self.sizes[m] for d in dims for m in d)
            total += sum(math.prod(s) for s in g.shapes) / split
        return int(total * self.opt_bytes)

    out_params: list[int | None] = []  # per output leaf: the parameter leaf it is laid out like (gradients)
    # set by plan(): how to put the params' and data's specs back in fn's argument order
    params_treedef: Any = None
    in_specs: Callable[[Any, list[Any]], Any] = staticmethod(lambda p, d: None)  # type: ignore[assignment]


# ---------------------------------------------------------------------------
# Search


def _exhaustive(costs: _Costs, counts: list[int]) -> list[tuple[int, ...]]:
    for assign in itertools.product(*[range(n) for n in counts]):
        costs.score(assign)
    return sorted(costs.cache, key=lambda a: costs.cache[a].key)


def _coordinate_descent(
    costs: _Costs, counts: list[int], starts: list[tuple[int, ...]], pair_limit: int, max_rounds: int = 8
) -> list[tuple[int, ...]]:
    # Batch first (it decides what is FSDP and what is TP), then parameter groups, largest first.
    order = [len(counts) - 1] + sorted(range(len(counts) - 1), key=lambda g: -costs.groups[g].nbytes)

    def descend(current: tuple[int, ...]) -> tuple[int, ...]:
        for _ in range(max_rounds):
            before = current
            for g in order:
                options = [current[:g] + (c,) + current[g + 1 :] for c in range(counts[g])]
                current = min(options, key=lambda a: costs.score(a).key)
            if current == before:
                break
        return current

    def pair_moves(current: tuple[int, ...]) -> tuple[int, ...]:
        # Two groups move together: a layout can pay off only with its neighbour's (a row-parallel
        # weight after a column-parallel one; a group's FSDP axis with the batch's axes), and single
        # moves stall there.
        options = [current]
        for i, j in itertools.combinations(range(len(counts)), 2):
            for ci in range(counts[i]):
                for cj in range(counts[j]):
                    a = list(current)
                    a[i], a[j] = ci, cj
                    options.append(tuple(a))
        return min(options, key=lambda a: costs.score(a).key)

    ends = [descend(start) for start in starts]
    best = min(ends, key=lambda a: costs.score(a).key)
    if sum(a * b for a, b in itertools.combinations(counts, 2)) <= pair_limit:
        for _ in range(max_rounds):
            moved = pair_moves(best)
            if moved == best:
                break
            best = descend(moved)
    return sorted(costs.cache, key=lambda a: costs.cache[a].key)


# ---------------------------------------------------------------------------
# Naming and explaining


# Primitives that pass a parameter on unchanged (dimension for dimension) into a sub-computation or a copy.
_PASS_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision", "sharding_constraint"})


def contracted_dims(jaxpr: Any, leaf_vars: Sequence[int]) -> dict[int, frozenset[int]]:
    """Which dimensions of each parameter leaf its matmuls contract (read from the traced program).

    ``leaf_vars[k]`` is the jaxpr input of parameter leaf ``k``.  A leaf is
    followed through dtype casts, transposes, calls (``pjit``, remat, custom
    derivatives) and ``scan`` (a stacked leaf loses its leading axis in the
    body); at each ``dot_general`` its contracting dimensions are recorded.
    This is what names a split ``tp-row`` (a contracted axis: partial sums) or
    ``tp-col`` (a free axis) whatever the weight's axis order: ``(in, out)``
    Flax kernels, ``(out, in)`` Equinox weights, 3-D attention kernels.
    Leaves no matmul reads are absent.
    """
    found: dict[int, set[int]] = {}

    def walk(jx: Any, track: dict[Any, tuple[int, tuple[int, ...]]]) -> None:
        # track: var -> (leaf, the leaf's dimension behind each of the var's dimensions)
        for eqn in jx.eqns:
            ins = [(i, track[v]) for i, v in enumerate(eqn.invars) if _hashable(v) and v in track]
            if not ins:
                continue
            name = eqn.primitive.name
            if name == "dot_general":
                (lc, rc), _ = eqn.params["dimension_numbers"]
                for i, (leaf, dims) in ins:
                    for d in lc if i == 0 else rc if i == 1 else ():
                        found.setdefault(leaf, set()).add(dims[d])
            elif name in _PASS_THROUGH:
                track[eqn.outvars[0]] = ins[0][1]
            elif name == "transpose":
                leaf, dims = ins[0][1]
                track[eqn.outvars[0]] = (leaf, tuple(dims[p] for p in eqn.params["permutation"]))
            elif name == "scan":
                body = eqn.params["jaxpr"].jaxpr
                n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
                sub: dict[Any, tuple[int, tuple[int, ...]]] = {}
                for i, (leaf, dims) in ins:
                    inner = body.invars[i]
                    sub[inner] = (leaf, dims[1:]) if i >= n_consts + n_carry else (leaf, dims)
                walk(body, sub)
            else:
                inner_jaxpr = _sub_jaxpr(eqn)
                if inner_jaxpr is not None and len(inner_jaxpr.invars) == len(eqn.invars):
                    walk(inner_jaxpr, {inner_jaxpr.invars[i]: t for i, t in ins})

    invars = jaxpr.invars
    start = {invars[v]: (k, tuple(range(len(invars[v].aval.shape)))) for k, v in enumerate(leaf_vars)}
    walk(jaxpr, start)
    return {k: frozenset(v) for k, v in found.items()}


def _hashable(v: Any) -> bool:
    return not hasattr(v, "val")  # jaxpr Literals are neither tracked nor hashable on every JAX


def _sub_jaxpr(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None


def _strategy(group: Group, cand: Candidate, batch_axes: tuple[str, ...]) -> str:
    """A short name: replicated, fsdp(data), tp-col(model), fsdp(data)+tp-row(model), pipeline(stage).

    A split of a dimension the group's matmuls contract is ``tp-row`` (partial
    sums), of another dimension ``tp-col``; without that knowledge (a leaf no
    matmul reads), the last dimension of a matrix is taken as its output.
    """
    parts = []
    rank = len(group.names)
    for i, d in enumerate(cand.dims):
        if not d:
            continue
        if group.stacked and i == 0:
            parts.append(f"pipeline({','.join(d)})")
            continue
        fsdp = tuple(m for m in d if m in batch_axes)
        tp = tuple(m for m in d if m not in batch_axes)
        if fsdp:
            parts.append(f"fsdp({','.join(fsdp)} on {group.names[i]})" if rank >= 2 else f"fsdp({','.join(fsdp)})")
        if tp:
            if group.contracted is not None and rank >= 2:
                kind = "tp-row" if i in group.contracted else "tp-col"
            else:
                kind = "tp-col" if i == rank - 1 and rank >= 2 else "tp-row" if rank >= 2 else "tp"
            parts.append(f"{kind}({','.join(tp)})")
    return "+".join(parts) or "replicated"


def _short(display: str) -> str:
    """``['layers'][*]['w1']`` → ``layers.*.w1`` (for one-line labels)."""
    parts = re.findall(r"\['([^']*)'\]|\[(\*|\d+)\]|\.(\w+)", display)
    return ".".join(next(p for p in tup if p) for tup in parts) or display


def _batch_strategy(cand: Candidate) -> str:
    batch, seq = cand.dims
    parts = []
    if batch:
        parts.append(f"dp({','.join(batch)})")
    if seq:
        parts.append(f"seq({','.join(seq)})")
    return "+".join(parts) or "replicated batch"


# ---------------------------------------------------------------------------
# Entry point


def plan(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Any = None,
    profile: Any = None,
    memory_budget: int | float | str | None = None,
    objective: str = "training",
    param_args: Sequence[int] | None = None,
    data_args: Sequence[int] | None = None,
    optimizer_bytes_per_param: float | None = None,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    restarts: int = 3,
    pair_limit: int = PAIR_LIMIT,
    seed: int = 0,
    presets: Mapping[str, tuple[Mapping[str, str], Mapping[str, str] | Sequence[Mapping[str, str]]]] | None = None,
    n_alternatives: int = 5,
    **kwargs: Any,
) -> PlanResult:
    """Choose einshard layouts for ``fn``'s parameters and batch: fastest within ``memory_budget``.

    Args:
        fn: a training step (or ``jax.value_and_grad`` of a loss) for ``'training'``, a forward pass for
            ``'inference'``; called as ``fn(*args, **kwargs)``.
        args: pytrees of arrays or ``jax.ShapeDtypeStruct``s; the first is the parameters, the rest data.
        mesh: a Mesh, or axis sizes ``{'data': 256, 'model': 8}`` (plan a 2048-device mesh from sizes only);
            None: the current mesh (``jax.set_mesh``), else the arguments' mesh, else an EinshardError.
        profile: hardware profile for time (``'h100'``, ``'tpu-v5p'``, ``'cpu'`` or an ``einshard.Profile``).
        memory_budget: bytes per device (or ``'16GiB'``); None: no limit.
        objective: ``'training'`` / ``'inference'`` (step time), ``'memory'`` (bytes per device),
            ``'communication'`` (bytes sent per device).
        param_args, data_args: which positional arguments are parameters / data (default ``[0]`` / the rest);
            any other argument stays replicated.
        optimizer_bytes_per_param: optimizer state per parameter element (default 8, Adam's two f32
            moments, for ``'training'``; 0 otherwise).
        exhaustive_limit: search exhaustively when there are at most this many assignments.
        restarts: random starts of the coordinate descent (besides data-parallel and fully-sharded starts).
        pair_limit: after the descent, also try moving every two groups together when that costs at
            most this many assignments.
        presets: hand-written layouts to cost alongside: ``{name: (param_rules, data_rules)}``; they appear
            in ``alternatives`` and the explanation (``dp`` and ``fsdp`` are always there).

    Returns:
        A :class:`PlanResult`; ``result.rules`` plugs into ``einshard.einshard(params, result.rules, mesh=mesh)``.
    """
    start = time.perf_counter()
    if objective not in OBJECTIVES:
        raise EinshardError(f"plan(): objective must be one of {OBJECTIVES}, got {objective!r}")
    if not args:
        raise EinshardError("plan() needs the function's arguments (the parameters first)")
    budget = parse_bytes(memory_budget)
    mesh_axes = _mesh_axes(mesh, args)
    p_idx = list(param_args) if param_args is not None else [0]
    d_idx = list(data_args) if data_args is not None else [i for i in range(len(args)) if i not in p_idx]
    params = tuple(args[i] for i in p_idx) if len(p_idx) != 1 else args[p_idx[0]]
    opt_bytes = (
        optimizer_bytes_per_param
        if optimizer_bytes_per_param is not None
        else (8.0 if objective == "training" else 0.0)
    )

    traced = trace(fn, *args, mesh={m.name: m.size for m in mesh_axes}, profile=profile, **kwargs)
    groups, leaves = _groups(params, mesh_axes)
    contracted = contracted_dims(traced.jaxpr, _param_invars(args, p_idx))
    groups = [
        dataclasses.replace(g, contracted=contracted.get(g.leaves[0])) if g.leaves[0] in contracted else g
        for g in groups
    ]
    total_param_bytes = sum(g.nbytes for g in groups) or 1
    groups = [
        dataclasses.replace(
            g, candidates=_param_candidates(g, mesh_axes, g.nbytes < SMALL_GROUP_FRACTION * total_param_bytes)
        )
        for g in groups
    ]
    data_structure = []
    data_shapes: list[tuple[int, ...]] = []
    for i in d_idx:
        flat, treedef = jax.tree_util.tree_flatten(args[i])
        data_structure.append((treedef, [len(_shape(x)) for x in flat]))
        data_shapes += [_shape(x) for x in flat]
    batch = Group("", "batch", (), tuple(data_shapes), (), 0, False, _batch_candidates(data_shapes, mesh_axes), True)
    costs = _Costs(traced, groups, batch, len(leaves), data_structure, objective, budget, opt_bytes)
    params_treedef = jax.tree_util.tree_structure(params)
    costs.params_treedef = params_treedef

    def in_specs(params_specs: Any, data_specs: list[Any]) -> Any:
        full: list[Any] = [None] * len(args)
        if len(p_idx) == 1:
            full[p_idx[0]] = params_specs
        else:
            for i, sub in zip(p_idx, params_specs):
                full[i] = sub
        for i, sub in zip(d_idx, data_specs):
            full[i] = sub
        for i in range(len(args)):
            if full[i] is None:
                full[i] = jax.tree_util.tree_map(lambda _: None, args[i])
        return tuple(full)

    costs.in_specs = in_specs  # type: ignore[assignment]
    costs.out_params = _like_params(traced.out_shape, params)
    counts = [len(g.candidates) for g in groups] + [len(batch.candidates)]
    space = math.prod(counts)
    presets_assign = _preset_assignments(groups, batch, mesh_axes)
    if space <= exhaustive_limit:
        method = "exhaustive"
        ranked = _exhaustive(costs, counts)
    else:
        method = "coordinate descent"
        rng = random.Random(seed)
        starts = list(presets_assign.values())
        starts += [tuple(rng.randrange(n) for n in counts) for _ in range(restarts)]
        ranked = _coordinate_descent(costs, counts, starts, pair_limit)
    best = ranked[0]
    chosen = costs.score(best)

    def rules_of(assign: tuple[int, ...]) -> tuple[dict[str, str], tuple[dict[str, str | None], ...]]:
        rules = {g.pattern: g.expression(g.candidates[c]) for g, c in zip(groups, assign)}
        data_rules = []
        for i in d_idx:
            flat = jax.tree_util.tree_flatten_with_path(args[i])[0]
            r: dict[str, str | None] = {}
            for path, x in flat:
                pattern = "^" + re.escape(jax.tree_util.keystr(path)) + "$"
                rank = len(_shape(x))
                r[pattern] = batch.expression(batch.candidates[assign[-1]], rank) if rank else None
            data_rules.append(r)
        return rules, tuple(data_rules)

    def label_of(assign: tuple[int, ...]) -> str:
        bax = batch.candidates[assign[-1]].dims[0]
        names = [
            f"{_short(g.display)}={_strategy(g, g.candidates[c], bax)}"
            for g, c in zip(groups, assign)
            if g.candidates[c].sharded
        ]
        return _batch_strategy(batch.candidates[assign[-1]]) + " · " + (", ".join(names) or "params replicated")

    def alternative(label: str, assign: tuple[int, ...]) -> Alternative:
        s = costs.score(assign)
        r, d = rules_of(assign)
        return Alternative(label, r, d, s.time_s, s.memory, s.comm, s.fits)

    alts = [alternative(label_of(a), a) for a in ranked[1 : 1 + n_alternatives]]
    preset_alts = [alternative(f"preset {name}", a) for name, a in presets_assign.items()]
    for name, (prules, pdata) in (presets or {}).items():
        preset_alts.append(_user_preset(name, prules, pdata, traced, args, p_idx, d_idx, costs))
    rules, data_rules = rules_of(best)
    bax = batch.candidates[best[-1]].dims[0]
    strategies = {g.display: _strategy(g, g.candidates[c], bax) for g, c in zip(groups, best)}
    strategies["batch"] = _batch_strategy(batch.candidates[best[-1]])
    warning = ""
    if not chosen.fits:
        warning = (
            f"no layout fits the memory budget: the least-bad needs {human_bytes(chosen.memory)}/device "
            f"> budget {human_bytes(budget or 0)}; returned anyway (fits=False)"
        )
    explanation = _explain(
        chosen, best, groups, batch, costs, preset_alts, alts, strategies, budget, objective, warning
    )
    return PlanResult(
        rules=rules,
        data_rules=data_rules,
        time_s=chosen.time_s,
        memory_bytes=chosen.memory,
        comm_bytes=chosen.comm,
        fits=chosen.fits,
        warning=warning,
        alternatives=tuple(alts + preset_alts),
        explanation=explanation,
        report=chosen.report,
        strategies=strategies,
        objective=objective,
        memory_budget=budget,
        method=method,
        evaluated=len(costs.cache),
        space=space,
        planning_s=time.perf_counter() - start,
    )


def _like_params(out_shape: Any, params: Any) -> list[int | None]:
    """Per output leaf, the parameter leaf it mirrors (gradients, updated parameters), else None.

    Such outputs are returned laid out like their parameters (``out_shardings`` of a training step),
    so FSDP gradients are reduce-scattered and held sharded rather than replicated.
    """
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    p_shapes = [_shape(x) for x in p_leaves]

    def match(tree: Any) -> list[int | None]:
        leaves, tdef = jax.tree_util.tree_flatten(tree)
        if tdef == p_def and [_shape(x) for x in leaves] == p_shapes:  # type: ignore[operator]
            return list(range(len(leaves)))
        if isinstance(tree, (tuple, list)) and leaves and tree:
            return [i for sub in tree for i in match(sub)]
        return [None] * len(leaves)

    return match(out_shape)


def _preset_assignments(groups: list[Group], batch: Group, mesh: tuple[MeshAxis, ...]) -> dict[str, tuple[int, ...]]:
    """``dp`` (replicated parameters, batch over every axis that divides) and ``fsdp`` (each group's largest
    split over the batch's axes)."""
    best_batch = max(
        range(len(batch.candidates)),
        key=lambda c: (len(batch.candidates[c].dims[0]), -len(batch.candidates[c].dims[1])),
    )
    bax = set(batch.candidates[best_batch].dims[0])
    dp = tuple(0 for _ in groups) + (best_batch,)
    fsdp = []
    for g in groups:
        options = [
            (sum(len(d) for d in c.dims), -i, i)
            for i, c in enumerate(g.candidates)
            if all(m in bax for d in c.dims for m in d) and not (g.stacked and c.dims[0])
        ]
        fsdp.append(max(options)[2] if options else 0)
    return {"dp": dp, "fsdp": (*fsdp, best_batch)}


def _user_preset(
    name: str,
    prules: Mapping[str, str],
    pdata: Mapping[str, str] | Sequence[Mapping[str, str]],
    traced: TracedProgram,
    args: tuple[Any, ...],
    p_idx: list[int],
    d_idx: list[int],
    costs: _Costs,
) -> Alternative:
    """Cost a hand-written preset with the same model (rules are matched on paths, as einshard() does)."""
    data_list = [pdata] * len(d_idx) if isinstance(pdata, Mapping) or isinstance(pdata, str) else list(pdata)

    def pick(rules: Any, tree: Any) -> Any:
        if isinstance(rules, str):
            return jax.tree_util.tree_map(lambda _: rules, tree)
        compiled = [(re.compile(p), e) for p, e in rules.items()]

        def one(path: Any, _: Any) -> Any:
            key = jax.tree_util.keystr(path)
            for rx, e in compiled:
                if rx.search(key):
                    return e
            raise EinshardError(f"preset {name!r}: no rule matches {key}")

        return jax.tree_util.tree_map_with_path(one, tree)

    full: list[Any] = []
    for i in range(len(args)):
        if i in p_idx:
            full.append(pick(prules, args[i]))
        elif i in d_idx:
            full.append(pick(data_list[d_idx.index(i)], args[i]))
        else:
            full.append(jax.tree_util.tree_map(lambda _: None, args[i]))
    p_exprs = jax.tree_util.tree_leaves(full[p_idx[0]]) if len(p_idx) == 1 else []
    out_specs = None
    if p_exprs:
        from ..core.layout import resolve_named
        from ..parsing import parse_placement

        p_specs = [
            jax.sharding.PartitionSpec(*resolve_named(parse_placement(e), _shape(x), traced.mesh).spec_entries())
            for e, x in zip(p_exprs, jax.tree_util.tree_leaves(args[p_idx[0]]))
        ]
        out_specs = [None if i is None else p_specs[i] for i in costs.out_params]
    report = traced.report(tuple(full), out_specs)
    flat_rules = jax.tree_util.tree_leaves(full[p_idx[0]]) if len(p_idx) == 1 else []
    opt = 0.0
    if costs.opt_bytes:
        from ..core.layout import resolve_named
        from ..parsing import parse_placement

        for x, e in zip(jax.tree_util.tree_leaves(args[p_idx[0]]), flat_rules):
            lay = resolve_named(parse_placement(e), _shape(x), traced.mesh)
            opt += math.prod(lay.shard_shape) * costs.opt_bytes
    memory = report.peak_bytes + int(opt)
    fits = costs.budget is None or memory <= costs.budget
    data_rules: tuple[dict[str, str | None], ...] = tuple(
        dict(d) if isinstance(d, Mapping) else {".*": d} for d in data_list
    )
    return Alternative(
        f"preset {name}",
        dict(prules) if isinstance(prules, Mapping) else {".*": prules},
        data_rules,
        report.time_s,
        memory,
        report.comm_bytes,
        fits,
    )


def _explain(
    chosen: _Score,
    best: tuple[int, ...],
    groups: list[Group],
    batch: Group,
    costs: _Costs,
    presets: list[Alternative],
    alts: list[Alternative],
    strategies: dict[str, str],
    budget: int | None,
    objective: str,
    warning: str,
) -> str:
    lines = []
    if warning:
        lines.append("WARNING: " + warning + ".")
    r = chosen.report
    compute = sum(op.flops * op.repeat for op in r.ops) / costs.traced.rules.profile.flops
    lines.append(
        f"chosen: {strategies['batch']}; " + "; ".join(f"{k}: {v}" for k, v in strategies.items() if k != "batch")
    )
    lines.append(
        f"step ≈ {human_time(chosen.time_s)}: compute {human_time(compute)}, "
        f"communication {human_time(max(chosen.time_s - compute, 0.0))} ({human_bytes(chosen.comm)} sent/device); "
        f"memory {human_bytes(chosen.memory)}/device"
        + (f" (incl. optimizer state {human_bytes(costs.optimizer_bytes(best))})" if costs.opt_bytes else "")
        + (f" of a {human_bytes(budget)} budget" if budget is not None else "")
    )
    dp = next((p for p in presets if p.label == "preset dp"), None)
    any_param_sharded = any(g.candidates[c].sharded for g, c in zip(groups, best))
    if dp is not None:
        if not dp.fits and any_param_sharded:
            lines.append(
                f"parameters are sharded because the model does not fit replicated (data parallel): "
                f"{human_bytes(dp.memory_bytes)} > {human_bytes(budget or 0)} budget"
            )
        elif not any_param_sharded and dp.fits:
            lines.append(
                f"parameters stay replicated: the model fits replicated ({human_bytes(dp.memory_bytes)}"
                + (f" ≤ {human_bytes(budget)}" if budget is not None else "")
                + ") and sharding them would only add communication"
            )
        elif any_param_sharded and objective in ("training", "inference") and dp.time_s > chosen.time_s:
            lines.append(
                f"sharding parameters is faster than data parallel ({human_time(chosen.time_s)} vs "
                f"{human_time(dp.time_s)}/step): at this per-device batch the gradient all-reduce costs more "
                f"than the activation collectives tensor parallelism adds"
            )
    if alts:
        nxt = alts[0]
        if objective in ("training", "inference") and chosen.time_s > 0:
            gap = (nxt.time_s / chosen.time_s - 1) * 100
            lines.append(
                f"runner-up: {nxt.label}: {gap:+.1f}% time, {human_bytes(nxt.memory_bytes)}/device"
                + ("" if nxt.fits else " (over budget)")
            )
        else:
            lines.append(f"runner-up: {nxt.label}")
    return "\n".join(lines)
