"""Repeated top-level stretches (the inlined forward of unrolled layers) walked once per entering state.

:mod:`.segments` finds the copies of a repeated run of top-level equations.
With ``OpCosts.memoise_segments`` (on by default) the walker
(:meth:`~.walker.Walker.walk`) walks a copy while logging every read and
write it makes of the walker's state (the environment with its gathered
copies and partial sums, pending-sum tags, CSE history, uses, requested
layouts, program outputs, the dependency walker's masks), and keeps what it
did as a :class:`SegmentTape` only where the walk was **closed**: it read
its own values, the values entering it, and what the look-ahead of sharding
propagation reaches past it (the structure of up to :data:`AHEAD` consumers
deep, the layouts asked of program outputs among them, and values made after
the copy, which no copy's walk has bound yet: found empty, or the copy is
open).  The key holds the state of all that (:meth:`~.walker.Walker._segment_key`:
the entering values' layouts, gathered copies, partial sums, pending-sum tags
and the moves already made of them; the copy's wiring and horizon; the rows
its slices take along a split axis; the bodies it calls).  A copy whose walk
read anything else, walked a nested jaxpr in place, or met an op without a
rule is walked again at every copy.  A replay writes what the walk wrote onto
the other copy's values by position, so a replay is the walk it stands for or
does not happen (tests/test_segment_memo.py compares reports, peak memory,
combined costs and plans with and without it).

Three reads that differ from copy to copy are kept with the tape rather than in
the key, each checked where the tape is replayed: the padding its pads read
(:class:`PadGuard`), the layouts the caller asks of values past the copy that
its walk read (:func:`asked_hold`: the first and last layers' horizons reach
the gradients a planner asks layouts of, which their walks do not read), and
the look-ahead from a partial sum that runs on past
the copy's horizon (a tensor-parallel layer's sum, along the residual stream
to the loss: :func:`past_copy`), whose answer from there is kept and made
again, from the other copy's values, at each replay (:func:`searches_hold`).
A layer's row of a stack keys by what its slice's walk reads of it
(:func:`slice_row_class`), so every layer of a stack split along its layers
keys alike.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from ...core.layout import Layout
from .blocks import BodyStructures
from .costing import is_free
from .registry import sub_jaxpr
from .report import OpReport
from .segments import LAYER_INDEX, find_runs, param_token
from .values import DERIVED_NAMES, Gathered, GatheredLhs, GatheredRhs, Partial, Sent

__all__ = [
    "Copy",
    "SegmentPlan",
    "SegmentTape",
    "CopySlots",
    "ReadyTape",
    "ReplayAt",
    "Shelf",
    "copy_slots",
    "ready_tape",
    "replay_at",
    "replaced",
    "PadGuard",
    "pad_guard",
    "pad_guard_holds",
    "Recorder",
    "plan_segments",
    "past_copy",
    "unlogged",
    "note_search",
    "searches_hold",
    "slice_row_class",
    "AskedGuard",
    "asked_guard",
    "asked_hold",
    "note_asked",
    "RECORDING",
    "PLAIN",
    "PlainTable",
    "PlainOutputs",
    "record_table",
    "plain_table",
    "record_outputs",
    "plain_outputs",
]

Token = tuple[str, int]  # ("e", k): the copy's k-th entering value; ("i", k): the k-th value it makes


@dataclass(frozen=True)
class Copy:
    """One copy of a repeated run: its top-level positions and its values by position."""

    start: int
    stop: int
    template: int  # equal for the copies of one run
    eqns: tuple[Any, ...]
    entering: tuple[Any, ...]  # values it reads that are made before it (program inputs included), first read first
    inside: tuple[Any, ...]  # the values it makes, in order
    tokens: dict[int, Token]  # id(value) -> its token
    eqn_ids: frozenset[int]
    # Its slices: (offset, entering index or -1, start row, strides, operand shape, result shape).
    slices: tuple[tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    calls: tuple[tuple[int, int], ...]  # (offset, id(body)) of the calls it makes (a tape's ops name their equations)
    # (offset, padding_config) of its pads: the backward's glue pads each layer's gradient into the stack at the
    # layer's row.  Not in the key: a tape holds the configs its walk read (:class:`PadGuard`).
    pads: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]
    # Each operand, equation by equation: ("in", k) the k-th entering value, ("made", offset, j) a result of its own
    # equation at ``offset``, ("literal",): the copy's dataflow, whatever the signature that found it left out.
    wiring: tuple[tuple[Any, ...], ...]
    # The consumers of its values outside it, by structure (primitive, parameters, types, phase, operand index):
    # the look-ahead reads them (which consumer follows a value), never their layouts without leaving the copy.
    horizon: tuple[Hashable, ...]
    ahead: dict[int, int]  # id(value past it the look-ahead may follow) -> its index in ``horizon``'s visit
    leaves: bool  # one of its values is a program output
    # The tokens of its values read after it (by an equation past it, or as program outputs): with the values
    # entering it, the only ones whose layout's identity the walk reads again (the value-keyed memo of
    # Walker.change), so the only ones a replay binds a private copy of; the others take the tape's own layout.
    escaping: frozenset[Token] = frozenset()
    # Each entering value with its gathered copy's and pending sum's keys in the environment, its id and the source
    # a layout bound to it by the walk carries (Walker.bind's ``(1, id(value))``): the key reads all of them, at
    # every copy of every costing, made once.
    entering_keys: tuple[tuple[Any, Gathered, Partial, int, tuple[int, int]], ...] = ()
    # Its run, the bodies it calls, its wiring and what the elementwise readers' look-ahead of its dots reads of values
    # outside it (whether Shardy's elementwise-first pass splits them, rules_indexing.settled_in) as one small
    # integer (equal integers: all equal), for its key: the wiring alone is a tuple per operand, hashed at every
    # lookup of every copy of every costing.
    structure: int = -1
    # The ids of the values it makes (whether the caller asks for one of them is one set operation per copy).
    inside_ids: frozenset[int] = frozenset()
    entering_ids: tuple[int, ...] = ()  # id of each entering value, in order
    # Visit index in ``horizon`` -> id of the value past it there (``ahead`` inverted): a tape's asked guard names
    # values by index (:func:`asked_hold`).
    ahead_at: dict[int, int] = field(default_factory=dict)

    def value(self, token: Token) -> Any:
        return self.entering[token[1]] if token[0] == "e" else self.inside[token[1]]


@dataclass(frozen=True)
class SegmentPlan:
    jaxpr: Any  # held, so the id it is cached under stays its own
    copies: dict[int, Copy]  # by start position
    made_at: dict[int, int]  # id(top-level value) -> the position that makes it


def plan_segments(
    jaxpr: Any, known: BodyStructures, phase_of: Any, interned: dict[Hashable, int] | None = None
) -> SegmentPlan:
    """The copies of ``jaxpr``'s repeated runs of top-level equations (:func:`.segments.find_runs`).

    ``interned``: (run, calls, wiring, what its elementwise readers' look-ahead reads of values outside it) -> the
    integer :attr:`Copy.structure` names it by (shared by every program costed with one OpCosts, whose tapes these
    integers key)."""
    interned = {} if interned is None else interned
    outputs = {id(v) for v in jaxpr.outvars if not hasattr(v, "val")}
    eqns = jaxpr.eqns
    consumers: dict[int, list[tuple[int, int]]] = {}  # id(value) -> (position, operand index) of each use
    for p, e in enumerate(eqns):
        for k, v in enumerate(e.invars):
            if not hasattr(v, "val"):
                consumers.setdefault(id(v), []).append((p, k))
    shapes: dict[int, Hashable] = {}

    def shape_of(p: int) -> Hashable:
        """Equation ``p``'s structure without its operands' wiring."""
        hit = shapes.get(p)
        if hit is None:
            e = eqns[p]
            # A consumer's position parameters (a slice's rows, a pad's padding) are read by its own step only,
            # never by the look-ahead of an earlier copy's walk (consumer_split, _padded_back, _moved_downstream
            # read primitives, types and axis maps): left out, so that the layers' horizons are alike.
            skip = LAYER_INDEX.get(e.primitive.name, frozenset())
            params = tuple(sorted((k, param_token(x, known, phase_of)) for k, x in e.params.items() if k not in skip))
            hit = shapes[p] = (
                e.primitive.name,
                params,
                tuple(str(v.aval) for v in e.invars),
                tuple(str(v.aval) for v in e.outvars),
                phase_of(e),
            )
        return hit

    # Which values Shardy's elementwise-first pass splits (rules_indexing.settled_in; imported here, as that module
    # imports this one): the walk of a dot reads it of its elementwise readers' partners (a copy's own values: a
    # function of its wiring and of the answers of the values entering it that its pass-through ops read; values
    # outside it that its dots' look-ahead meets past it, _partners_ahead), a fact of the program's structure
    # outside the copy, so part of the copy's structure (its key); no walk of it reads the others'.
    from .rules_indexing import ELEMENTWISE_READER_STEPS, PASS_THROUGH, seeded_in, settled_in

    settled = settled_in(jaxpr)
    # Which of them carry a split the user fixed (rules_indexing.is_seeded: the program's arguments, placements, and
    # pass-through ops from them): the walk of a dot at a clash reads it of a partner entering the copy.
    seeded = seeded_in(jaxpr, True)
    made_at = {id(v): p for p, e in enumerate(eqns) for v in e.outvars}

    def is_settled(v: Any) -> bool:
        return id(v) not in made_at or id(v) in settled  # an argument or a constant is

    copies: dict[int, Copy] = {}
    for template, run in enumerate(find_runs(jaxpr, known, phase_of)):
        for span in run.copies():
            here = tuple(eqns[p] for p in span)
            made = {id(v) for e in here for v in e.outvars}
            entering: dict[int, Any] = {}
            for e in here:
                for v in e.invars:
                    if not hasattr(v, "val") and id(v) not in made:
                        entering.setdefault(id(v), v)
            inside = tuple(v for e in here for v in e.outvars)
            tokens: dict[int, Token] = {i: ("e", k) for k, i in enumerate(entering)}
            tokens.update({id(v): ("i", k) for k, v in enumerate(inside)})
            slices = tuple(
                (
                    off,
                    list(entering).index(id(e.invars[0])) if id(e.invars[0]) in entering else -1,
                    tuple(int(r) for r in e.params["start_indices"]),
                    tuple(int(x) for x in e.params.get("strides") or (1,) * len(e.params["start_indices"])),
                    tuple(int(x) for x in e.invars[0].aval.shape),
                    tuple(int(x) for x in e.outvars[0].aval.shape),
                )
                for off, e in enumerate(here)
                if e.primitive.name == "slice"
            )
            calls = tuple((off, id(sub_jaxpr(e))) for off, e in enumerate(here) if sub_jaxpr(e) is not None)
            pads = tuple(
                (off, tuple((int(lo), int(hi), int(mid)) for lo, hi, mid in e.params["padding_config"]))
                for off, e in enumerate(here)
                if e.primitive.name == "pad"
            )
            order = list(entering)
            produced = {id(v): (off, j) for off, e in enumerate(here) for j, v in enumerate(e.outvars)}
            wiring = tuple(
                ("literal",)
                if hasattr(v, "val")
                else ("in", order.index(id(v)))
                if id(v) in entering
                else ("made", *produced[id(v)])
                for e in here
                for v in e.invars
            )
            horizon, ahead = _horizon(inside, span, consumers, eqns, shape_of, outputs)
            inner = {id(v) for v in inside}
            partners = _partners_ahead(
                inside,
                span,
                consumers,
                eqns,
                functools.partial(_outside, inner, made_at, span.stop),
                is_settled,
                PASS_THROUGH,
                ELEMENTWISE_READER_STEPS,
            )
            # An entering value's answer, where one of the copy's pass-through ops reads it (a partner, or the
            # origin of its own values' answers).
            passed = {
                id(v) for e in here if e.primitive.name in PASS_THROUGH for v in e.invars if not hasattr(v, "val")
            }
            copies[span.start] = Copy(
                span.start,
                span.stop,
                template,
                here,
                tuple(entering.values()),
                inside,
                tokens,
                frozenset(id(e) for e in here),
                slices,
                calls,
                pads,
                wiring,
                horizon,
                ahead,
                bool(outputs & {id(v) for v in inside}),
                frozenset(
                    ("i", k)
                    for k, v in enumerate(inside)
                    if id(v) in outputs or any(p not in span for p, _ in consumers.get(id(v), ()))
                ),
                tuple((v, Gathered(v), Partial(v), id(v), (1, id(v))) for v in entering.values()),
                interned.setdefault(
                    (
                        template,
                        calls,
                        wiring,
                        tuple(
                            (is_settled(v), id(v) not in made_at or id(v) in seeded) if i in passed else None
                            for i, v in entering.items()
                        ),
                        partners,
                    ),
                    len(interned),
                ),
                frozenset(id(v) for v in inside),
                tuple(entering),
                {at: ident for ident, at in ahead.items()},
            )
    return SegmentPlan(jaxpr, copies, made_at)


# How far past a copy the look-ahead may follow values (consumer of a consumer...) and stay in the key.
AHEAD = 4


def _horizon(
    inside: tuple[Any, ...],
    span: range,
    consumers: dict[int, list[tuple[int, int]]],
    eqns: Any,
    shape_of: Any,
    outputs: set[int],
) -> tuple[tuple[Hashable, ...], dict[int, int]]:
    """The structure of what follows a copy's values out of it, :data:`AHEAD` consumers deep: for each value
    (its own, then those reached, in visit order) each consumer (one of its own equations by offset, or one
    past it by structure, with its results' visit indices) and whether it is a program output.  The values
    reached past it, by id -> visit index (their uses may be read: their consumers are in the structure)."""
    index: dict[int, int] = {id(v): i for i, v in enumerate(inside)}
    depth: dict[int, int] = {id(v): 0 for v in inside}
    queue = list(inside)
    ahead: dict[int, int] = {}
    out: list[Hashable] = []
    for v in queue:
        d = depth[id(v)]
        if d >= AHEAD:
            out.append(("unfollowed", id(v) in outputs))
            continue
        uses: list[Hashable] = []
        for p, k in consumers.get(id(v), ()):
            if p in span:
                uses.append(("in", p - span.start, k))
                continue
            results = []
            for o in eqns[p].outvars:
                if id(o) not in index:
                    index[id(o)] = len(index)
                    depth[id(o)] = d + 1
                    queue.append(o)
                results.append(index[id(o)])
            uses.append(("out", shape_of(p), k, tuple(results)))
        out.append((tuple(uses), id(v) in outputs))
        if d:
            ahead[id(v)] = index[id(v)]
    return tuple(out), ahead


def _outside(inner: set[int], made_at: dict[int, int], stop: int, v: Any) -> bool:
    """Whether ``v`` is made before a copy ends (at ``stop``; an argument or a constant too) and not by the copy
    (``inner``: the ids of its values)."""
    return id(v) not in inner and made_at.get(id(v), -1) < stop


def _partners_ahead(
    inside: tuple[Any, ...],
    span: range,
    consumers: dict[int, list[tuple[int, int]]],
    eqns: Any,
    outside: Callable[[Any], bool],
    settled: Callable[[Any], bool],
    pass_through: frozenset[str],
    steps: int,
) -> tuple[tuple[int, int, int, bool], ...]:
    """The other operands from outside a copy (``outside(value)``: made before it ends and not its own, the values
    entering it included) that the elementwise readers' look-ahead of its dots may meet past it
    (rules_indexing._elementwise_reader_split: a dot's result followed through ``pass_through`` readers and
    transposes, ``steps`` deep), as (visit index of the value followed, which of its uses, the operand's index,
    whether Shardy's elementwise-first pass splits it: ``settled(value)``).  Where that pass splits such a partner
    the look-ahead reads its layout; a copy without it (the layers before the last, whose results flow into the next
    layer's dot) reads nothing there, and Copy.horizon is not in the key: the copy's key holds these.  Followed from
    every value of the copy, past the copy at most ``steps`` readers deep (a superset of what a search reaches)."""
    index: dict[int, int] = {id(v): i for i, v in enumerate(inside)}
    depth: dict[int, int] = {id(v): 0 for v in inside}
    queue = list(inside)
    found: list[tuple[int, int, int, bool]] = []
    for v in queue:
        d = depth[id(v)]
        if d >= steps:
            continue
        for u, (p, k) in enumerate(consumers.get(id(v), ())):
            name = eqns[p].primitive.name
            if p in span or (name not in pass_through and name != "transpose"):
                continue  # inside the copy: its own values are followed from where they are made
            if name != "transpose":
                found.extend(
                    (index[id(v)], u, j, settled(x))
                    for j, x in enumerate(eqns[p].invars)
                    if j != k and not hasattr(x, "val") and outside(x)
                )
            for o in eqns[p].outvars:
                if id(o) not in index:
                    index[id(o)] = len(index)
                    depth[id(o)] = d + 1
                    queue.append(o)
    return tuple(found)


def slice_row_class(length: int, n: int, out_len: int, start: int, stride: int) -> Hashable:
    """What the walk of a static slice reads of its start along an axis split ``n`` ways (``length`` long, the
    result ``out_len`` long): rules_structural.slice_static reads it only through the collective-permutes it
    charges.  A result smaller than the split (a layer's row of a stack split along its layers: ``w[i]``) is
    brought to its first owner by one permute per further block it spans, sized by where in its block it starts:
    its class is those pieces, so that every layer of a stack split along its layers keys alike (else each copy
    of an unrolled decoder's layer is a key of its own under such a layout, stepped at every costing).  Any other
    slice along a split axis keys by its start."""
    if out_len == length:
        return None  # not moved: the rule does not read the start
    if stride == 1 and out_len % n and out_len < n and start >= 0:
        block = length // n
        first, last = start // block, (start + out_len - 1) // block
        return ("small", tuple(min(start + out_len, (j + 1) * block) - j * block for j in range(first + 1, last + 1)))
    return ("at", start)


# The layouts asked of values past a copy (program outputs in its horizon) that its walk read: (visit index in the
# horizon, the asked layout's dims or None where none is asked), sorted.
AskedGuard = tuple[tuple[int, Any], ...]


def asked_guard(asked: dict[int, Any]) -> AskedGuard:
    """The reads of asked layouts past the copy a recorder logged (:attr:`Recorder.asked`), as a tape keeps them."""
    return tuple(sorted(asked.items()))


def asked_hold(guard: AskedGuard, copy: Copy, requested: dict[int, Any]) -> bool:
    """Whether the caller asks of ``copy``'s values past it what it asked of the recorded copy's where that walk read
    it.  The key leaves the asked layouts out: a copy whose horizon reaches a program output (the first and last
    layers of a decoder, whose gradients the planner asks layouts of) keys as the others, and replays their tape
    where its walk reads none of them (its walk is the recorded one while every read answers alike)."""
    at = copy.ahead_at
    # A visit index past this copy's horizon (a shorter one: the program ends sooner after it) reads as not asked, as
    # the key did when it held the asked layouts: it compared those of each copy's own horizon.
    return all(requested.get(at.get(index, -1)) == dims for index, dims in guard)


def note_asked(w: Any, ids: Any) -> None:
    """Log, while a copy is recorded, whether the caller asks a layout of each of ``ids`` that lie in the copy's
    horizon: for a search that tests membership of many values at once (rules_indexing._rest_of_reach iterates the
    asked layouts or tests them through a view, which no recording table logs)."""
    requested = w.requested
    if type(requested) is not RecordingTable or requested.rec.why:
        return
    rec = requested.rec
    ahead, asked = rec.copy.ahead, rec.asked
    for i in ids:
        at = ahead.get(i)
        if at is not None and at not in asked:
            asked[at] = dict.get(requested, i)


# A copy's pads as its walk read them: per pad (offset, the axes its operand was split along: the only axes whose
# padding the pad rule reads, rules_structural.pad), and those axes' (low, high, interior).
PadGuard = tuple[tuple[int, tuple[int, ...], tuple[tuple[int, int, int], ...]], ...]


def pad_guard(copy: Copy, read: dict[int, tuple[int, ...]]) -> PadGuard:
    """The padding of ``copy``'s pads along the axes ``read`` says each pad's walk read (by offset)."""
    return tuple((off, read[off], tuple(config[a] for a in read[off])) for off, config in copy.pads if off in read)


def pad_guard_holds(guard: PadGuard, copy: Copy) -> bool:
    """Whether ``copy``'s pads pad as the recorded ones along the axes their walk read.

    The walk of a copy is a function of its key and of its pads' padding along the axes their operands are
    split on; while those agree, each pad's operand is the recorded one, step by step, so the axes read are
    the same too: the walk is the recorded one."""
    configs = dict(copy.pads)
    return all(tuple(configs[off][a] for a in axes) == seen for off, axes, seen in guard)


@dataclass(frozen=True)
class SegmentTape:
    """What walking one copy did, by token: replayed at another copy entering in the same state."""

    env: tuple[tuple[Token, Any, Layout, bool], ...]  # (value, derived kind or None, layout, a private copy)
    summed: tuple[tuple[Token, frozenset[str]], ...]
    made: tuple[tuple[Token, Hashable, Any], ...]
    ops: tuple[tuple[OpReport, int | None, Any], ...]  # (op, offset of its top-level equation, else its equation)
    sub_envs: tuple[tuple[int, tuple[int, ...], dict[Any, Layout]], ...]  # (offset of the call, path within, env)
    extra: Any  # the walker subclass's own record (see Walker.segment_end)
    pads: PadGuard = ()  # the padding its walk read (:func:`pad_guard_holds`)
    # The look-aheads (rules_indexing.consumer_split) that went on past the copy's horizon, with their answers from
    # there (:func:`past_copy`): another copy replays the tape where its own answer alike (:func:`searches_hold`).
    searches: tuple[Search, ...] = ()
    # The layouts the caller asks of values past the copy that its walk read, by visit index in the horizon (None: not
    # asked): another copy replays the tape where its own are alike (:func:`asked_hold`).
    asked: AskedGuard = ()
    # The splits its readers hand open values (open_values.reader_split), by the values' tokens, one group per reader
    # in program order: a replay notes them as stepping those readers would (Walker._open_replayed).
    opened: tuple[tuple[tuple[Token, Any], ...], ...] = ()
    # The layouts asked of its values past its horizon, as its walk found them (Recorder.asks): another copy replays
    # the tape where its own are alike (rules_indexing.asks_hold).
    asks: tuple[tuple[Token, bool, Any], ...] = ()


class Shelf(list):  # type: ignore[type-arg]
    """The tapes kept under one key (OpCosts.segment_tapes), in the order recorded, with, per copy, those whose
    padding holds at it (``picks``: id(copy) -> (the copy, held; how many tapes there were; those tapes)): a
    copy's pads are fixed, only the tapes' look-aheads past the copy are checked at each replay."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.picks: dict[int, tuple[Copy, int, tuple[SegmentTape, ...]]] = {}


# The kinds of environment key a replay writes under a value: the value itself, its gathered copy, its pending sum,
# its all-to-all buffers, a dot's gathered operands (by the dot's result) (values.py).  A copy's keys are laid out
# kind by kind (:class:`CopySlots`).
KINDS: tuple[Any, ...] = (None, Gathered, Partial, Sent, GatheredLhs, GatheredRhs)


@dataclass(frozen=True, eq=False)
class CopySlots:
    """A copy's values by slot (its entering values, then its own, as its tokens number them) with what a replay
    writes under each, made once per copy for every costing: the environment key of each kind
    (:data:`KINDS`, slot-major within a kind), each value's id and its moves' source.  A tape's writes are kept by
    slot (:class:`ReadyTape`): replaying them at a copy looks its keys up by index, not by token."""

    copy: Copy  # held, so that the id it is cached under stays its own
    keys: tuple[Any, ...]
    ids: tuple[int, ...]
    sources: tuple[tuple[int, int], ...]
    # The naming (Walker.value_names, eqn_where) and each equation's op words (where, inside, reads) under it.
    words: dict[str, Any] = field(default_factory=dict)
    # id(tape) -> the tape's writes at this copy (:func:`replay_at`), made at its first replay here.
    replays: dict[int, ReplayAt] = field(default_factory=dict)


def copy_slots(copy: Copy) -> CopySlots:
    """:class:`CopySlots` of ``copy``."""
    values = (*copy.entering, *copy.inside)
    keys = tuple(v if kind is None else kind(v) for kind in KINDS for v in values)
    ids = tuple(id(v) for v in values)
    return CopySlots(copy, keys, ids, tuple((1, i) for i in ids))


def slot_of(copy: Copy, token: Token) -> int:
    return token[1] if token[0] == "e" else len(copy.entering) + token[1]


@dataclass(frozen=True, eq=False)
class ReadyTape:
    """A tape's writes by slot, made once per tape (:func:`ready_tape`) and replayed at each copy entering like
    the one it was recorded at (copies of one key have as many entering values: their wiring is in the key).

    The environment's writes are kept as their last value per key, in first-write order: a dictionary update
    inserts new keys in that order and leaves each its last value, as the writes one by one do; a key whose last
    write binds a private copy of the layout is overwritten in place by one (where the value is read after the
    copy that replays it)."""

    tape: SegmentTape  # held, so that the id it is cached under stays its own
    env_at: tuple[int, ...]  # index into CopySlots.keys per key written
    env_lays: tuple[Layout, ...]
    private: tuple[tuple[Token, int, int, Layout], ...]  # (token, key index, slot, the tape's layout)
    summed_at: tuple[int, ...]  # slots
    summed_tags: tuple[frozenset[str], ...]
    made_at: tuple[int, ...]  # slots of the moved values
    made_moves: tuple[Hashable, ...]
    made_to: tuple[Any, ...]
    made_by: tuple[tuple[int, frozenset[Hashable]], ...]  # slot -> its moves
    # Whether it writes anything (a layout, a derived key, a pending-sum tag, a move) under a value entering the copy:
    # where not, a replay leaves every value made before the copy as it found it (Walker._carried).
    writes_entering: bool = True
    # The same indices as pickers (:func:`_picker`: a tuple of a copy's items at them, gathered at C speed), made
    # once per tape: a planner's costing records its own tapes, so nearly every replay makes its ReplayAt anew.
    pick_env: Callable[[tuple[Any, ...]], tuple[Any, ...]] = tuple
    pick_summed: Callable[[tuple[Any, ...]], tuple[Any, ...]] = tuple
    pick_made: Callable[[tuple[Any, ...]], tuple[Any, ...]] = tuple
    pick_made_by: Callable[[tuple[Any, ...]], tuple[Any, ...]] = tuple
    made_by_moves: tuple[frozenset[Hashable], ...] = ()
    # The private writes at a copy whose escaping tokens are these (Copy.escaping: equal for most copies of a key),
    # as (key index pickers, slot pickers, the tape's layouts): filled at the first replay at such a copy.
    private_at: dict[frozenset[Token], tuple[Any, Any, tuple[Layout, ...]]] = field(default_factory=dict)
    # The slots of the values whose layout it binds as a private copy (where the copy lets them escape): a key read
    # right after its replay finds each such value in one state at every copy (Walker._segment_key).
    private_slots: frozenset[int] = frozenset()
    # The equation each of its ops is recorded at, at a copy: a picker over the copy's equations followed by
    # ``op_inners`` (the equations inside its calls that ops were recorded at, the tape's own, in order).
    pick_op_eqns: Callable[[tuple[Any, ...]], tuple[Any, ...]] = tuple
    op_inners: tuple[Any, ...] = ()


def ready_tape(tape: SegmentTape, copy: Copy) -> ReadyTape:
    """``tape`` (recorded at ``copy``) by slot: :class:`ReadyTape`."""
    entering = len(copy.entering)
    n = entering + len(copy.inside)
    last: dict[int, tuple[Layout, Token | None]] = {}
    for tok, kind, lay, private in tape.env:
        at = KINDS.index(kind) * n + slot_of(copy, tok)
        last[at] = (lay, tok if private else None)
    moves: dict[int, set[Hashable]] = {}
    for tok, move, _ in tape.made:
        moves.setdefault(slot_of(copy, tok), set()).add(move)
    env_at = tuple(last)
    summed_at = tuple(slot_of(copy, tok) for tok, _ in tape.summed)
    made_at = tuple(slot_of(copy, tok) for tok, _, _ in tape.made)
    made_by = tuple((slot, frozenset(m)) for slot, m in moves.items())
    # An op at the copy's own equation is at the replaying copy's equation of that offset; one inside a call at the
    # tape's (copies of one key have as many equations: their structure is in the key).
    inners = tuple(inner for _, off, inner in tape.ops if off is None)
    at_eqn, j = [], len(copy.eqns)
    for _, off, _ in tape.ops:
        if off is None:
            at_eqn.append(j)
            j += 1
        else:
            at_eqn.append(off)
    return ReadyTape(
        tape,
        env_at,
        tuple(lay for lay, _ in last.values()),
        tuple((tok, at, at % n, lay) for at, (lay, tok) in last.items() if tok is not None),
        summed_at,
        tuple(tag for _, tag in tape.summed),
        made_at,
        tuple(move for _, move, _ in tape.made),
        tuple(to for _, _, to in tape.made),
        made_by,
        any(at % n < entering for at in last)
        or any(slot_of(copy, tok) < entering for tok, _ in tape.summed)
        or any(slot < entering for slot in moves),
        _picker(env_at),
        _picker(summed_at),
        _picker(made_at),
        _picker(tuple(slot for slot, _ in made_by)),
        tuple(m for _, m in made_by),
        {},
        frozenset(at for at, (_, tok) in last.items() if tok is not None and at < n),
        _picker(tuple(at_eqn)),
        inners,
    )


def _picker(at: tuple[int, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A function from a tuple to the tuple of its items at ``at`` (``operator.itemgetter`` returns a lone item
    for one index and refuses none)."""
    if not at:
        return lambda _: ()
    if len(at) == 1:
        only = at[0]
        return lambda items: (items[only],)
    return operator.itemgetter(*at)


@dataclass(frozen=True, eq=False)
class ReplayAt:
    """A :class:`ReadyTape`'s writes with one copy's keys, ids and sources put in (:func:`replay_at`), made once per
    tape and copy: a replay is then a few dictionary updates, not a list built by index per table at every copy of
    every costing (an 80-layer decoder replays ~150 copies a costing)."""

    ready: ReadyTape  # held, so that the id of its tape it is cached under stays its own
    # The environment keys written, in the tape's first-write order (each bound to its layout in ReadyTape.env_lays:
    # a replay updates the environment from the two, with no dictionary made per tape and copy).
    env_keys: tuple[Any, ...]
    private: tuple[tuple[Any, tuple[int, int], Layout], ...]  # (key, the value's source, the tape's layout)
    summed: dict[int, frozenset[str]]  # value id -> its pending-sum tag
    made: dict[tuple[tuple[int, int], Hashable], Any]  # (source, move) -> what it made
    made_by: tuple[tuple[tuple[int, int], frozenset[Hashable]], ...]  # source -> its moves


def replay_at(ready: ReadyTape, slots: CopySlots) -> ReplayAt:
    """``ready``'s writes at ``slots``' copy.  The private copies are those of the values read after the copy (its
    entering values and the ones it lets escape): each replay binds a new one of each (Walker._segment_replay)."""
    keys, sources = slots.keys, slots.sources
    escaping = slots.copy.escaping
    private = ready.private_at.get(escaping)
    if private is None:
        chosen = [(at, slot, lay) for tok, at, slot, lay in ready.private if tok[0] == "e" or tok in escaping]
        private = ready.private_at[escaping] = (
            _picker(tuple(at for at, _, _ in chosen)),
            _picker(tuple(slot for _, slot, _ in chosen)),
            tuple(lay for _, _, lay in chosen),
        )
    pick_keys, pick_sources, lays = private
    made_sources = ready.pick_made(sources)
    return ReplayAt(
        ready,
        ready.pick_env(keys),
        tuple(zip(pick_keys(keys), pick_sources(sources), lays)),
        dict(zip(ready.pick_summed(slots.ids), ready.summed_tags)),
        dict(zip(zip(made_sources, ready.made_moves), ready.made_to)) if made_sources else {},
        tuple(zip(ready.pick_made_by(sources), ready.made_by_moves)),
    )


def replaced(op: OpReport, changes: dict[str, Any]) -> OpReport:
    """``dataclasses.replace(op, **changes)`` without its per-call field introspection (an OpReport has no
    ``__post_init__``: its fields are copied as they are): a deep unrolled model replays thousands per costing."""
    new = object.__new__(OpReport)
    new.__dict__.update(op.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass
class Recorder:
    """The log of one copy's walk: its writes by token, and whether it stayed closed (``why`` says where not)."""

    copy: Copy
    made_at: dict[int, int]  # id(value) -> the top-level position that makes it (SegmentPlan.made_at)
    why: str = ""
    env: list[tuple[Token, Any, Layout]] = field(default_factory=list)
    summed: list[tuple[Token, frozenset[str]]] = field(default_factory=list)
    made: list[tuple[Token, Hashable, Any]] = field(default_factory=list)
    masks: list[Token] = field(default_factory=list)
    pads: dict[int, tuple[int, ...]] = field(default_factory=dict)  # offset of a pad -> the axes its step read
    # The look-aheads that went past the copy, answered unlogged from there (:func:`past_copy`).
    searches: list[Search] = field(default_factory=list)
    past: dict[Any, Any] = field(default_factory=dict)  # OpCosts.segment_past (past_start's structure, per program)
    # Visit index in the horizon -> the layout asked of the value there, where the walk read it (:func:`asked_hold`).
    asked: dict[int, Any] = field(default_factory=dict)
    # The layouts asked of its values that the walk found past its horizon, answered unlogged (rules_indexing's
    # asked_of_result and requested_dims): (the value's token, transposes followed, the answer).
    asks: list[tuple[Token, bool, Any]] = field(default_factory=list)

    def pad_read(self, offset: int, operand: Layout) -> None:
        """Note the axes whose padding the pad at ``offset`` reads: those its operand is split along (none for
        a free operand, which the rule returns free at once)."""
        self.pads[offset] = () if is_free(operand) else tuple(a for a, d in enumerate(operand.dims) if d)

    def leave(self, why: str) -> None:
        if not self.why:
            self.why = why

    def token(self, ident: int, channel: str) -> Token | None:
        tok = self.copy.tokens.get(ident)
        if tok is None:
            self.leave(f"{channel} of a value outside the copy")
        return tok

    def looked_ahead(self, ident: int, found: bool, channel: str) -> None:
        """A read (of a layout, a pending-sum tag) of a value outside the copy, by the look-ahead: a value the
        program makes after the copy is not bound yet in any copy's walk (the read finds nothing, whichever
        copy it is), so it does not leave the copy; anything else does."""
        if ident in self.copy.tokens:
            return
        if found or self.made_at.get(ident, -1) < self.copy.stop:
            self.leave(f"{channel} of a value outside the copy")


# A look-ahead that went past a copy's horizon, as its tape keeps it: (the token of the value searched from, the step
# the search left the horizon at, the search's course up to there (:func:`course`), the sum's layout and mesh axes,
# the conditions decided before that step, the answer of the search from there on).
Search = tuple[Token, int, Hashable, Layout, frozenset[str], tuple[tuple[int, bool], ...], Any]


def course(reach: Any, at: int) -> Hashable:
    """The course of ``reach``'s search before step ``at``, without its values: each step's axis map and
    conditions, each check's place and kind.  Equal courses from values of two copies entering alike take the same
    steps and make the same checks on the same layouts up to ``at``."""
    steps = tuple((axis_of, conds) for _, axis_of, conds in reach.steps[:at])
    return steps, tuple((s, c, kind, k, cond) for s, c, kind, _, k, cond in reach.checks if s < at)


def past_start(copy: Copy, reach: Any, at: int, cache: dict[tuple[int, int, int], frozenset[int] | None]) -> Any:
    """The values ``reach`` (a value's precomputed look-ahead, :class:`.lookahead.Reach`, from one of ``copy``'s
    values) visits from step ``at`` on, by id; None where a check from there on reads one of the copy's values (a
    replay at another copy checks that copy's search before binding them).  Kept in ``cache`` (per traced
    program: structure only)."""
    key = (copy.start, id(reach.var), at)
    if key in cache:
        return cache[key]
    tokens = copy.tokens
    reads_copy = any(
        step >= at and any(j != k and not hasattr(o, "val") and id(o) in tokens for j, o in enumerate(eqn.invars))
        for step, _, _, eqn, k, _ in reach.checks
    )
    found = None if reads_copy else frozenset(id(v) for v, _, _ in reach.steps[at:])
    cache[key] = found
    return found


def _past(w: Any, copy: Copy, reach: Any, cache: dict[Any, Any], at: int) -> bool:
    """Whether the search of ``reach`` from step ``at`` on reads nothing of ``copy`` (:func:`past_start`) and visits
    no program output the caller asks a layout of (its asked check reads ``requested``)."""
    start = past_start(copy, reach, at, cache)
    if start is None:
        return False
    requested = w.requested
    if len(start) < len(requested):  # from the smaller side (a planner asks a layout of every gradient)
        asked = requested.keys()  # (its view: a membership test no recording table logs, as the iteration below)
        return not any(i in asked for i in start)
    return not any(i in start for i in requested)


def past_copy(w: Any, reach: Any, at: int) -> bool:
    """Whether the look-ahead from ``reach.var`` (rules_indexing._checked_reach), at step ``at`` while a copy is
    recorded and closed, leaves the copy's horizon where the rest reads nothing of the copy (:func:`past_start`):
    the rest of the search is then answered
    without logging its reads (:func:`unlogged`) and kept with the tape (:func:`note_search`), and a copy replaying
    the tape must answer its own alike (:func:`searches_hold`).  Else the walk reads on, and a read past the
    horizon leaves the copy, as before."""
    rec = getattr(w.uses, "rec", None)
    if not isinstance(rec, Recorder) or rec.why:
        return False
    copy, ident = rec.copy, id(reach.steps[at][0])
    if ident in copy.tokens or ident in copy.ahead:
        return False  # within the horizon: read as the walk reads
    tok = copy.tokens.get(id(reach.var))
    return tok is not None and tok[0] == "i" and _past(w, copy, reach, rec.past, at)


@contextmanager
def unlogged(w: Any) -> Iterator[None]:
    """The walk's environment read without logging (the rest of a search past the copy: :func:`past_copy`)."""
    env: Any = w.env
    if type(env) is not RecordingEnv:
        yield
        return
    swapped: Any = env  # its class swapped back and forth, as Walker._segment_start does
    swapped.__class__ = PlainEnv
    try:
        yield
    finally:
        env.__class__ = RecordingEnv


def note_search(
    w: Any, reach: Any, at: int, out: Layout, sums: frozenset[str], passed: dict[int, bool], found: Any
) -> None:
    """Keep, with the copy being recorded, the answer of the search from ``reach.var`` past the copy (from step
    ``at`` on, ``passed``: the conditions decided before it)."""
    rec = w.uses.rec
    tok = rec.copy.tokens[id(reach.var)]
    rec.searches.append((tok, at, course(reach, at), out, sums, tuple(sorted(passed.items())), found))


def searches_hold(searches: tuple[Search, ...], copy: Copy, w: Any, cache: dict[Any, Any]) -> bool:
    """Whether the walk of ``copy`` would answer each of its searches past itself as the recorded copy's walk did.

    Up to the step the recorded search left its copy's horizon the search takes the recorded course (checked:
    :func:`course`) on the layouts the key holds (the copy's entering ones), so it decides each condition and
    check as the recorded one did; from there on it reads nothing of
    the copy (:func:`past_start`): only values made before the copy, bound now as when the walk would search, and
    values made after it, bound in neither.  Its answer from there, made now, is the walk's.
    """
    from .rules_indexing import reach_of, rest_of_reach  # the rules import this module: looked up when asked

    for tok, at, before, out, sums, passed, found in searches:
        reach = reach_of(w.costs, copy.value(tok))
        if reach is None or len(out.dims) != len(reach.steps[0][1]) or _course_of(reach, at, cache) != before:
            return False
        if not _past(w, copy, reach, cache, at):
            return False
        if rest_of_reach(w, reach, out, sums, at, dict(passed)) != found:
            return False
    return True


def _course_of(reach: Any, at: int, cache: dict[Any, Any]) -> Hashable:
    """:func:`course` of ``reach`` before step ``at``, made once per traced program (``cache``: OpCosts.segment_past,
    whose other keys are triples of ints): a reach is the program's structure, and a deep model's replays check
    the same searches at every copy of every costing."""
    key = ("course", id(reach), at)
    hit = cache.get(key)
    if hit is None or hit[0] is not reach:
        hit = cache[key] = (reach, course(reach, at))
    return hit[1]


def _env_ident(key: Any) -> int:
    of = getattr(key, "of", None)
    return id(of) if of is not None and type(key).__name__ in DERIVED_NAMES else id(key)


class PlainEnv(dict):  # type: ignore[type-arg]
    """The top-level environment while the segment memo is on (its class is swapped while a copy is recorded)."""

    rec: Recorder | None = None


class RecordingEnv(PlainEnv):
    """The environment while a copy is recorded: reads of values outside it leave it; writes are logged."""

    def get(self, key: Any, default: Any = None) -> Any:
        hit = dict.get(self, key, default)
        rec = self.rec
        # Most reads are of the copy's own values (their ids are its tokens; a derived key or a literal is
        # another object, never one of them): nothing to note, the look-ahead's reads go the long way.
        if rec is not None and id(key) not in rec.copy.tokens and not hasattr(key, "val"):
            rec.looked_ahead(_env_ident(key), hit is not default, "a layout")
        return hit

    def __getitem__(self, key: Any) -> Any:
        rec = self.rec
        if rec is not None and id(key) not in rec.copy.tokens:
            rec.looked_ahead(_env_ident(key), super().__contains__(key), "a layout")
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        hit = super().__contains__(key)
        if self.rec is not None:
            self.rec.looked_ahead(_env_ident(key), hit, "a layout")
        return hit

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.rec is not None:
            tok = self.rec.token(_env_ident(key), "a write")
            if tok is not None:
                kind = type(key) if type(key).__name__ in DERIVED_NAMES else None
                self.rec.env.append((tok, kind, value))
        super().__setitem__(key, value)


PLAIN, RECORDING = PlainEnv, RecordingEnv


class PlainTable(dict):  # type: ignore[type-arg]
    """A walker's table keyed by ``id(value)`` (summed, uses, requested, masks) or its CSE history, while no copy is
    recorded: :func:`record_table` swaps its class to :class:`RecordingTable` for a recording and
    :func:`plain_table` back, where copying it each way (it holds the whole program's entries) cost a deep
    program's every recording of every costing more than the recording's own walk."""


def record_table(table: dict[Any, Any], rec: Recorder, channel: str) -> RecordingTable:
    """``table`` logged for ``rec`` (:class:`RecordingTable`): the same object where it is a :class:`PlainTable`,
    else a logged copy."""
    if type(table) is PlainTable:
        table.__class__ = RecordingTable
        swapped: Any = table
        swapped._log(rec, channel)
        return cast(RecordingTable, swapped)
    return RecordingTable(table, rec, channel)


def plain_table(table: dict[Any, Any]) -> PlainTable:
    """``table`` no longer logged (the same object, its class swapped back to :class:`PlainTable`)."""
    if isinstance(table, RecordingTable):
        table.__dict__.clear()  # the recorder and its copy are not held on
        swapped: Any = table
        swapped.__class__ = PlainTable
        return cast(PlainTable, swapped)
    return PlainTable(table)


class RecordingTable(PlainTable):
    """A table keyed by ``id(value)`` (``channel``: summed, uses, requested, masks) or the CSE history, logged."""

    def __init__(self, data: Any, rec: Recorder, channel: str) -> None:
        super().__init__(data)
        self._log(rec, channel)

    def _log(self, rec: Recorder, channel: str) -> None:
        self.rec, self.channel = rec, channel
        # Reads that note nothing, answered without :meth:`_read`: any of the masks; of the other tables keyed by
        # id, a value the copy makes (and, of the pending-sum tags, one entering it too).
        self._tokens = rec.copy.tokens if channel != "made" else {}
        self._quiet_kinds = ("e", "i") if channel in ("summed", "masks") else ("i",)

    def _noted(self, key: Any) -> bool:
        """Whether a read of ``key`` may note something (else :meth:`_read` would return without a note)."""
        if self.channel == "masks":
            return False
        tok = self._tokens.get(key)
        return tok is None or tok[0] not in self._quiet_kinds

    def _ident(self, key: Any) -> int:
        if self.channel == "made":
            value = key[0] if isinstance(key, tuple) else None
            if not (isinstance(value, tuple) and value[0] == 1):
                self.rec.leave("the moves of a value not of the program")
                return -1
            return int(value[1])
        return int(key)

    def _read(self, key: Any, hit: Any) -> None:
        if self.channel == "masks":
            # The dependency walker reads the masks of the stepped equation's operands (a literal's id reads 0);
            # a dependence on a collective before the copy shows in the masks it makes (Walker.segment_end).
            return
        ident = self._ident(key)
        if self.channel in ("summed", "made"):  # nothing is summed or moved yet of a value made after the copy
            self.rec.looked_ahead(ident, dict.__contains__(self, key), self.channel)
            return
        if self.channel in ("uses", "requested"):
            at = self.rec.copy.ahead.get(ident)
            if at is not None:
                # A value the look-ahead reached past the copy: its consumers are in the key, the layout asked of it
                # kept with the tape (asked_hold).
                if self.channel == "requested" and at not in self.rec.asked:
                    self.rec.asked[at] = dict.get(self, key)
                return
        tok = self.rec.token(ident, self.channel)
        if tok is None:
            return
        if self.channel == "uses" and tok[0] == "e" and hit and any(id(e) not in self.rec.copy.eqn_ids for e, _ in hit):
            # An entering value's uses span the program; a value of its own has its consumers in the key
            # (Copy.horizon), and reading their layouts or uses leaves it.
            self.rec.leave("the look-ahead past the copy")
        elif self.channel in ("requested",) and tok[0] == "e":
            self.rec.leave("the requested layout of an entering value")

    def get(self, key: Any, default: Any = None) -> Any:
        hit = dict.get(self, key, default)
        if self._noted(key):
            self._read(key, hit)
        return hit

    def __getitem__(self, key: Any) -> Any:
        hit = super().__getitem__(key)
        if self._noted(key):
            self._read(key, hit)
        return hit

    def __contains__(self, key: Any) -> bool:
        hit = super().__contains__(key)
        if self._noted(key):
            self._read(key, super().get(key) if hit else None)
        return hit

    def __setitem__(self, key: Any, value: Any) -> None:
        tok = self.rec.token(self._ident(key), f"a write of {self.channel}")
        if tok is not None:
            if self.channel == "summed":
                self.rec.summed.append((tok, value))
            elif self.channel == "made":
                self.rec.made.append((tok, key[1], value))
            elif self.channel == "masks":
                self.rec.masks.append(tok)
            else:
                self.rec.leave(f"a write of {self.channel}")
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.rec.leave(f"a removal from {self.channel}")
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.rec.leave(f"a removal from {self.channel}")
        return super().pop(key, *default)

    def update(self, *a: Any, **k: Any) -> None:
        if self.channel != "uses":  # a nested walk's uses: its own values
            self.rec.leave(f"a bulk write of {self.channel}")
        super().update(*a, **k)


class PlainOutputs(set):  # type: ignore[type-arg]
    """The program's outputs (ids) while no copy is recorded (:class:`PlainTable`'s set)."""


def record_outputs(outputs: set[int], rec: Recorder) -> RecordingOutputs:
    """``outputs`` logged for ``rec``: the same object where it is a :class:`PlainOutputs`, else a logged copy."""
    if type(outputs) is PlainOutputs:
        outputs.__class__ = RecordingOutputs
        swapped: Any = outputs
        swapped.rec = rec
        return cast(RecordingOutputs, swapped)
    return RecordingOutputs(outputs, rec)


def plain_outputs(outputs: set[int]) -> PlainOutputs:
    """``outputs`` no longer logged."""
    if isinstance(outputs, RecordingOutputs):
        outputs.__dict__.clear()
        swapped: Any = outputs
        swapped.__class__ = PlainOutputs
        return cast(PlainOutputs, swapped)
    return PlainOutputs(outputs)


class RecordingOutputs(PlainOutputs):
    """The program's outputs (ids) while a copy is recorded: a test of a value outside it, or a change, leaves it."""

    def __init__(self, data: Any, rec: Recorder) -> None:
        super().__init__(data)
        self.rec = rec

    def __contains__(self, key: Any) -> bool:
        if key in self.rec.copy.ahead:
            return super().__contains__(key)  # in the copy's horizon
        self.rec.token(key, "program outputs")  # an entering value's: in the key (Walker._segment_key's ``leaving``)
        return super().__contains__(key)

    def add(self, key: Any) -> None:
        self.rec.leave("a program output added")
        super().add(key)

    def difference_update(self, *a: Any) -> None:
        self.rec.leave("program outputs removed")
        super().difference_update(*a)
