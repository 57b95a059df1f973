"""Values no layout fixes take the split their elementwise readers' partners have: Shardy's propagation both ways.

The walk follows layouts forward, in program order: a value is laid out where it is made, from its operands.
XLA's sharding propagation (Shardy) instead runs to a fixed point, both ways through every op: a value that
nothing fixes (not a program argument, not a placement's result: an *open* value) takes a split that any of its
readers brings back to it, from whichever of their operands has one, however late in the program that reader
is.  The split then holds at every other reader of the value.  Measured on one-op-pair programs (XLA:CPU,
``.compile().as_text()``; tests/test_open_values.py):

- ``x = t * 2`` (``t`` a replicated argument), ``mean((x + tanh(x @ w))**2)`` with ``w[32, 32@model]``: XLA splits
  ``x`` on d over ``model`` from where it is made, its dot then re-splits x's contraction onto the idle mesh axis
  (a collective-permute and an all-reduce); the forward walk had kept ``x`` whole (one all-reduce).  The same with
  ``t`` itself in place of ``x`` (an argument: fixed) keeps it whole, as the walk does.
- ``x = exp(t)``, ``sum(x, -1) * (x + p)`` with ``p`` split on d: the sum over d all-reduces in XLA's program.
- an embedding lookup ``table[ids]`` read by a residual add with a column-split projection's result (keras-hub's
  Falcon, BLOOM, GPT-NeoX, OPT, DeBERTa, RoFormer and ESM-2 under a generic column split): the lookup's output
  is split on d, and the first layer norm's sums over ``model`` follow.

- a dot reads an open value against a partner split on their contracted (or batch) dimensions: the value takes the
  partner's split there (a free slice; Shardy shares those factors between the operands), and its other readers
  read it so: ``x = exp(t)``, ``x + tanh(x @ w)`` with ``w``'s rows over 'a' reduce-scatters the dot's partial sum
  onto the add's split, the result left open (:func:`_dot_reader_split`).  A split the value has there already grows
  to the partner's where it is its prefix.

The walk reproduces the fixed point by walking again.  After a walk, :func:`found_splits` reads the split each
open value's elementwise readers hand it: the split a reader's result has on an axis the value leaves whole, where
another operand of the reader has it too (a split only the value itself brought there hands it nothing), where its
readers agree; :func:`spread_back` carries it back through the elementwise ops that make the value.  The program is
walked again with each such value moved to that split where it is made (``Walker.open_splits``), the splits adding
up as Shardy's only add mesh axes, until a walk finds nothing new (at most :data:`MAX_WALKS`), or finds only splits
that nothing but their readers' own slices read (:func:`settled_in_place`: laid out without a walk).  A walk that
steps such a reader with a split it was not given, or replays a copy whose tape says its readers hand one, stops at
the end of that stretch (:class:`Reopened`): the rest of it would be walked again.  On a mesh mixing Explicit and
Auto axes a value's type fixes its Explicit axes: only its Auto axes are open.

An open value here is one the program's own jaxpr makes (not a call body's: those are walked once per entering
layouts and replayed, :mod:`.blocks`) whose type does not fix its layout: on Explicit axes JAX's types do, and XLA
keeps them (measured on the same programs: the residual's x, typed whole, is sliced at the add and stays whole for
its other readers).  A repeated stretch of the program (:mod:`.segment_memo`) that makes a value moved so keys its
tapes by those values' splits too (by their tokens in it): the copies of a run whose values are moved alike are
recorded once and replayed, so that a split found in every layer costs no more walking at 2L layers than at L
(tests/test_segment_memo.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...core.layout import Layout
from .costing import OpCosts, is_free
from .rules_structural import all_explicit
from .values import ELEMENTWISE, PLACEMENTS

__all__ = [
    "OpenReader",
    "OpenValues",
    "open_values",
    "reader_split",
    "paired_axes",
    "found_splits",
    "spread_back",
    "MAX_WALKS",
    "Reopened",
]

# Walks of one report at most: the first, and a walk per round of splits found (one round settles the programs
# measured: a split found makes its value's other readers follow it, and what they make is not open again).
MAX_WALKS = 3

Dims = tuple[tuple[str, ...], ...]


class Reopened(Exception):
    """A walk met a reader handing an open value a split it was not walked with: it stops where it is (at the end
    of the stretch it records, so that no tape is left half made) and the program is walked again with it."""

    def __init__(self, found: dict[int, Dims]) -> None:
        super().__init__(found)
        self.found = found


# (the elementwise reader, the open value's operand index there, the open value)
OpenReader = tuple[Any, int, Any]


@dataclass(frozen=True)
class OpenValues:
    """A program's open values: their elementwise readers, and the equation that makes each (by id)."""

    readers: tuple[OpenReader, ...]
    made_by: Mapping[int, Any]
    # id(value) -> the Explicit mesh axes of its type, on a mesh that mixes Explicit and Auto axes (its type fixes
    # its split over those: only its Auto axes are open)
    fixed: Mapping[int, frozenset[str]]
    # id(reader) -> ((the open value's operand index, the value), ...): what a walk asks at each reader it steps
    at: Mapping[int, tuple[tuple[int, Any], ...]]
    # id(dot reader) -> ((another dot reading its partner, the partner's operand index there), ...): where the
    # partner is read by other dots too (:func:`_dot_reader_split` asks them)
    shared: Mapping[int, tuple[tuple[Any, int], ...]] = field(default_factory=dict)


def open_values(costs: OpCosts, jaxpr: Any) -> OpenValues:
    """``jaxpr``'s open values (a value made by one of its own equations that fixes nothing, its type not its
    layout) and their readers, each with the value's operand index: elementwise readers of their own shape, and
    dots whose other operand no other dot reads.  A fact of the
    jaxpr: found once per program."""
    table = costs.open_values
    hit = table.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    made: dict[int, Any] = {}
    fixed: dict[int, frozenset[str]] = {}
    found: list[OpenReader] = []
    # How many dots read each value: a partner another dot reads too (a weight read by the hidden states' dot and
    # by another's) is gathered for that one, and XLA reads that copy here too, the open value staying as it is
    # (measured: keras-hub DeBERTa's relative embeddings, normed, against the FSDP query and key kernels: no
    # reduce-scatter in XLA's program, where a lone dot's row-split kernel splits its open operand).
    # Only where the partner is split there, though: a router kernel w[d, e@model] read by the logits' dot x . w
    # (its split on a free axis: nothing gathered) and by the backward's dlogits . w^T hands the open cotangent its
    # experts split, and XLA all-reduces the (tokens, d) product (measured: keras-hub GPT-OSS's tensor-parallel
    # gradient; tests/test_open_values.py), so the other dots' pairing of the partner is kept and asked at the walk.
    dots_reading: dict[int, list[tuple[Any, int]]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            for j, v in enumerate(eqn.invars[:2]):
                if not hasattr(v, "val"):
                    dots_reading.setdefault(id(v), []).append((eqn, j))
    shared: dict[int, tuple[tuple[Any, int], ...]] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ELEMENTWISE:
            shape = getattr(eqn.outvars[0].aval, "shape", None)
            for k, v in enumerate(eqn.invars):
                if not hasattr(v, "val") and id(v) in made and getattr(v.aval, "shape", None) == shape and shape:
                    found.append((eqn, k, v))
        elif name == "dot_general":
            # (a dot shares its contracted and batch factors between its operands: Shardy hands an open operand the
            # split its partner has there -- a free slice of it -- and its other readers then read it split)
            for k, v in enumerate(eqn.invars[:2]):
                partner = eqn.invars[1 - k]
                if hasattr(v, "val") or id(v) not in made or partner is v or hasattr(partner, "val"):
                    continue
                others = tuple((o, j) for o, j in dots_reading.get(id(partner), ()) if o is not eqn)
                if others:
                    shared[id(eqn)] = others
                found.append((eqn, k, v))
        if name not in PLACEMENTS:  # (a placement fixes its result: never open)
            for v in eqn.outvars:
                # (on Explicit axes a value's type is its layout: JAX's, fixed where it is made; XLA keeps it)
                if not all_explicit(v.aval):
                    made[id(v)] = eqn
                    explicit = _explicit_axes(v.aval)
                    if explicit:
                        fixed[id(v)] = explicit
    at: dict[int, list[tuple[int, Any]]] = {}
    for reader, k, v in found:
        at.setdefault(id(reader), []).append((k, v))
    opened = OpenValues(tuple(found), made, fixed, {i: tuple(kv) for i, kv in at.items()}, shared)
    table[id(jaxpr)] = (jaxpr, opened)
    return opened


def _explicit_axes(aval: Any) -> frozenset[str]:
    """The Explicit axes of the mesh a value's type names (none on an Auto mesh, or with no mesh in its type)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    names, types = getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ())
    return frozenset(n for n, t in zip(names, types) if "Explicit" in str(t))


def reader_split(
    eqn: Any,
    k: int,
    x: Any,
    env: Mapping[Any, Layout],
    own: Layout | None,
    fixed: frozenset[str] = frozenset(),
    others: tuple[tuple[Any, int], ...] = (),
) -> Dims | None:
    """The split one elementwise reader ``eqn`` hands the open value ``x`` (its ``k``-th operand, laid out ``own``
    as its own operands made it), or None where it hands none.

    The split the reader's result has (its op's factors, shared by every operand) on an axis ``x`` leaves whole,
    where another operand has it too: a split that ``x``'s own layout brought to the result hands it nothing.
    ``others``: a dot reader's other dots reading its partner (:attr:`OpenValues.shared`)."""
    if eqn.primitive.name == "dot_general":
        return _dot_reader_split(eqn, k, env, own, fixed, others)
    res = env.get(eqn.outvars[0])
    if own is None or res is None:
        return None
    # (most readers' results are split as the value is: asked of thousands of readers after every walk)
    if res.dims == own.dims or not any(d and not o for d, o in zip(res.dims, own.dims)):
        return None
    if is_free(own) or own.unreduced or is_free(res) or res.unreduced:
        return None
    partners = []
    for j, p in enumerate(eqn.invars):
        if j == k or hasattr(p, "val") or p is x:
            continue
        lay = env.get(p)
        if lay is not None and not is_free(lay) and not lay.unreduced and len(lay.shape) == len(own.shape):
            partners.append(lay)
    used = {m for d in own.dims for m in d} | fixed  # (its type's Explicit axes are not its to take)
    wanted: list[tuple[str, ...]] = list(own.dims)
    for i, d in enumerate(res.dims):
        # (a partner broadcast from size 1 along an axis, lax's implicit broadcast, hands that axis nothing)
        if (
            d
            and not own.dims[i]
            and not used & set(d)
            and any(lay.dims[i] == d and lay.shape[i] == own.shape[i] for lay in partners)
        ):
            wanted[i] = d
            used |= set(d)
    dims = tuple(wanted)
    return None if dims == own.dims else dims


def paired_axes(eqn: Any, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A dot's axes its operand ``k`` shares with the other operand, in pairs: ``k``'s contracted then batch axes,
    and the other's they pair with (the factors XLA's propagation carries from one operand to the other)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = tuple(lc) + tuple(lb), tuple(rc) + tuple(rb)
    return (lhs, rhs) if k == 0 else (rhs, lhs)


def _dot_reader_split(
    eqn: Any,
    k: int,
    env: Mapping[Any, Layout],
    own: Layout | None,
    fixed: frozenset[str],
    others: tuple[tuple[Any, int], ...] = (),
) -> Dims | None:
    """The split a dot hands its open ``k``-th operand: its partner's split on their shared (contracted and batch)
    dimensions, on mesh axes the value leaves unused (Shardy's factor propagation; measured, ``x = exp(t)``,
    ``x + tanh(x @ w)`` with ``w``'s rows over 'a': x takes its columns over 'a', and the add's result with it).
    None where another dot reading the partner (``others``) pairs a split dimension of it with its own operand: it
    may gather the partner there, and XLA reads that copy here too (see :func:`open_values`)."""
    partner = env.get(eqn.invars[1 - k])
    # (asked of every dot reading an open value after every walk: a partner split nowhere, most weights under data
    # parallelism, hands nothing)
    if own is None or partner is None or not any(partner.dims):
        return None
    if is_free(own) or own.unreduced or is_free(partner) or partner.unreduced:
        return None
    for other, j in others:
        # (another dot pairing a split dimension of the partner with its own operand may gather it there: kept
        # whole, as XLA reads that copy -- keras-hub DeBERTa; asking the operand's layout instead, known only once
        # the walk reaches that dot, hands splits the three walks do not settle on DeBERTa's gradients)
        if any(partner.dims[i] for i in paired_axes(other, j)[0] if i < len(partner.dims)):
            return None
    mine, theirs = paired_axes(eqn, k)
    wanted: list[tuple[str, ...]] | None = None
    used: set[str] = set()
    for i, j in zip(mine, theirs):
        d = partner.dims[j]
        if not d:
            continue
        mine_i = own.dims[i]
        # (a split the value has there already grows to the partner's where it is its prefix: Shardy adds the
        # minor axes, x[16, 32@b] read against w[32@(b, c), 32] is split (b, c))
        more = d[len(mine_i) :] if d[: len(mine_i)] == mine_i else ()
        if not more or own.shape[i] != partner.shape[j]:
            continue
        if wanted is None:
            wanted, used = list(own.dims), {m for o in own.dims for m in o} | fixed
        if not used & set(more):
            wanted[i] = d
            used |= set(more)
    if wanted is None:
        return None
    dims = tuple(wanted)
    return None if dims == own.dims else dims


def found_splits(opened: OpenValues, env: Mapping[Any, Layout], natural: Mapping[int, Layout]) -> dict[int, Dims]:
    """The split each open value takes from its readers (:func:`reader_split`), by id; a value two readers hand
    different splits takes none (which of them XLA's propagation takes first is its order, not a rule this
    reproduces).  A split found also reaches, back through the elementwise ops that make the value, their open
    operands of its shape (an embedding's layer norm, split where the lookup's output is: its sums over the split
    axis follow).  ``natural``: a value moved to a split a walk applied, by id, as its own operands made it."""
    out: dict[int, Dims | None] = {}
    fixed, shared = opened.fixed, opened.shared
    none: frozenset[str] = frozenset()
    for eqn, k, x, ident, result in _reader_rows(opened):
        own = natural.get(ident) or env.get(x)
        if result is not None:
            # reader_split's first answers, inline (asked of thousands of readers after every walk, most hand
            # nothing): an elementwise reader hands nothing where either layout is unbound or where its result
            # is split nowhere its operand is not.
            if own is None:
                continue
            res = env.get(result)
            if res is None:
                continue
            if res.dims == own.dims or not any(d and not o for d, o in zip(res.dims, own.dims)):
                continue
        dims = reader_split(eqn, k, x, env, own, fixed.get(ident, none), shared.get(id(eqn), ()))
        if dims is not None:
            out[ident] = dims if out.get(ident, dims) == dims else None
    return spread_back(opened, {i: d for i, d in out.items() if d is not None}, env, natural)


def _reader_rows(opened: OpenValues) -> tuple[tuple[Any, int, Any, int, Any], ...]:
    """``opened``'s readers as :func:`found_splits` reads them, made once per program's open values: (the reader,
    the operand index, the open value, its id, the reader's result where :func:`reader_split` reads it first (an
    elementwise reader's), else None)."""
    rows = opened.__dict__.get("_rows")
    if rows is None:
        rows = tuple(
            (eqn, k, x, id(x), None if eqn.primitive.name == "dot_general" else eqn.outvars[0])
            for eqn, k, x in opened.readers
        )
        object.__setattr__(opened, "_rows", rows)  # (a cache beside the frozen fields, not one of them)
    return rows


def spread_back(
    opened: OpenValues, found: dict[int, Dims], env: Mapping[Any, Layout], natural: Mapping[int, Layout]
) -> dict[int, Dims]:
    """``found`` with each split also on the open operands, of the value's shape, of the elementwise ops that make
    it, and theirs in turn: XLA's propagation carries it back through them."""
    found = dict(found)
    stack = list(found.items())
    while stack:
        i, dims = stack.pop()
        eqn = opened.made_by.get(i)
        if eqn is None or eqn.primitive.name not in ELEMENTWISE:
            continue
        for y in eqn.invars:
            if hasattr(y, "val") or id(y) not in opened.made_by or id(y) in found:
                continue
            own = natural.get(id(y)) or env.get(y)
            if own is None or is_free(own) or own.unreduced or len(own.dims) != len(dims):
                continue
            if tuple(getattr(y.aval, "shape", ())) != tuple(eqn.outvars[0].aval.shape):
                continue  # (a size-1 broadcast operand: its own axes)
            used = {m for d in own.dims for m in d} | opened.fixed.get(id(y), frozenset())
            wanted = tuple(o if o or used & set(d) else d for o, d in zip(own.dims, dims))
            if wanted != own.dims:
                found[id(y)] = wanted
                stack.append((id(y), wanted))
    return found


def settled_in_place(
    opened: OpenValues,
    new: Mapping[int, Dims],
    env: Mapping[Any, Layout],
    uses: Mapping[int, list[tuple[Any, int]]],
    outputs: frozenset[int],
) -> bool:
    """Whether every value of ``new`` is read only by elementwise readers whose results already have its split there
    (each of them slices it so: free), is no output of the program, and is made by an op none of whose operands
    ``new`` moves: then a walk with ``new`` moves nothing but those values' own buffers, and its only difference
    from the walk done is their layouts (a slice records no op), which the caller sets instead of walking again."""
    for i, dims in new.items():
        if i in outputs:
            return False
        maker = opened.made_by.get(i)
        if maker is None or any(not hasattr(x, "val") and id(x) in new for x in maker.invars):
            return False
        for reader, _ in uses.get(i, ()):
            if reader.primitive.name not in ELEMENTWISE:
                return False
            res = env.get(reader.outvars[0])
            if res is None or is_free(res) or res.unreduced or len(res.dims) != len(dims):
                return False
            if any(d and r != d for r, d in zip(res.dims, dims)):
                return False
    return True
