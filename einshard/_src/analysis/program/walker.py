"""The walk: one pass over a jaxpr, each value's layout followed from the arguments'.

Each equation is handed to the rule registered for its primitive
(:mod:`.registry`; the rules live in the ``rules_*`` modules, which the
package's ``__init__`` imports for their registration: this module does not,
and the rules type against :class:`.registry.WalkerLike`, not this class).  A rule returns its
outputs' layouts and records, through :meth:`Walker.change`, the collectives
that bring operands to the layouts it needs.  A primitive with no rule goes
to :func:`.registry.unfollowed` (:meth:`Walker.no_rule`): it is priced as XLA
runs an op its SPMD partitioner has no rule for (every split operand
all-gathered whole, the op computed replicated, its consumers slicing the
replicated result for free), and it is named, with its source line, in the
report, which then says it is incomplete.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ... import _checks
from ...core.layout import Layout, MeshAxis
from ..cost import Collective, sent_bytes
from ..einsum.plan import side_string
from .blocks import Tape, body_index, translate_env
from .costing import FreeLayout, OpCosts, is_free
from .open_values import Reopened, reader_split
from .oplog import CostTerms, OpLog, ReplayRun, cost_terms
from .registry import RULES, call_rule, sub_jaxpr, unfollowed
from .report import OpReport, in_user_axis_names
from .segment_memo import (
    PLAIN,
    RECORDING,
    Copy,
    CopySlots,
    PlainEnv,
    PlainOutputs,
    PlainTable,
    ReadyTape,
    Recorder,
    ReplayAt,
    SegmentPlan,
    SegmentTape,
    Shelf,
    asked_guard,
    asked_hold,
    copy_slots,
    pad_guard,
    pad_guard_holds,
    plain_outputs,
    plain_table,
    plan_segments,
    ready_tape,
    record_outputs,
    record_table,
    replaced,
    replay_at,
    searches_hold,
    slice_row_class,
)
from .values import CARRIERS, DOT_GATHERED, PLACEMENTS, Gathered, Sent, dtype_itemsize

__all__ = ["Walker"]


class Walker:
    """Follows layouts through one jaxpr (and, recursively, its sub-jaxprs)."""

    def __init__(self, costs: OpCosts, quiet: bool = False) -> None:
        self.costs = costs
        self.mesh: tuple[MeshAxis, ...] = costs.mesh
        self.quiet = quiet  # a dry run (a scan carry's fixed point): nothing is recorded
        # In program order; a replayed stretch's ops are made only when read (:mod:`.oplog`).
        self.ops = OpLog()
        self.unfollowed: set[str] = set()
        self.met_unfollowed = 0  # ops without a rule met (a repeated stretch holding one is never replayed)
        # Where each op without a rule is in the user's code ("file.py:12 (fn)"), by primitive, first seen first.
        self.unfollowed_at: dict[str, list[str]] = {}
        self._stepping: list[Any] = []  # the equations being stepped, outermost first (calls hold their bodies')
        self.counter = 0
        self._replicated: dict[tuple[int, ...], Layout] = {}
        # Layout changes already made to a value: XLA computes a gathered value once and
        # reuses it (CSE), e.g. an FSDP weight gathered in the forward pass and again for the backward.
        self._made: dict[tuple[Any, Any], Layout] = PlainTable()
        self._made_by: dict[Any, set[Any]] = {}  # the same, by value: the moves made of each (a segment's key)
        self._source: dict[int, tuple[int, int]] = {}  # id(layout in env) -> (walk, id(the jaxpr value))
        self._keep: list[Layout] = []  # holds the layouts _source names, so their ids stay theirs
        self._walks = 0
        # Values that are the all-reduced result of a dot, by id of the jaxpr variable -> the mesh axes
        # summed (carried through shape-only ops): XLA keeps them in partial-sum form for a consumer
        # dot that splits their contracted axis (see rules_indexing.match_contracting).
        self.summed: dict[int, frozenset[str]] = PlainTable()
        # The walk's look-ahead (XLA's propagation runs both ways): who consumes each value of the
        # jaxprs being walked, and the layouts bound so far (the innermost walk's environment).
        self.uses: dict[int, list[tuple[Any, int]]] = {}
        self.env: dict[Any, Layout] = {}
        self.program_outputs: set[int] = PlainOutputs()
        # Values whose layout XLA's propagation may not change (ids): the program's arguments and what a sharding
        # constraint places.  A layout conflict on any other value XLA may settle upstream (movement.mark_conflict).
        self.pinned: set[int] = set()
        # Values a loop's fixed carry split pulls to the split it takes (XLA's propagation from the loop's carry
        # back into its body, rules_control.carried_back): moved where they are computed.
        self.pulled: dict[int, tuple[tuple[str, ...], ...]] = {}
        # Open values (ids) moved to the split their readers' partners hand them where the program makes them, and
        # each one's layout as its own operands made it (:mod:`.open_values`: XLA's propagation both ways).
        self.open_splits: dict[int, tuple[tuple[str, ...], ...]] = {}
        self.open_natural: dict[int, Layout] = {}
        # The top-level elementwise readers of open values, by id of the equation -> (operand index, value) of each;
        # and the splits stepping them found that the walk was not given (it stops: open_values.Reopened).
        self.open_at: Mapping[int, tuple[tuple[int, Any], ...]] = {}
        self.open_shared: Mapping[int, tuple[tuple[Any, int], ...]] = {}  # (OpenValues.shared)
        self.open_fixed: Mapping[int, frozenset[str]] = {}  # (open_values.OpenValues.fixed)
        self.open_stop = False  # whether a split found at a reader stops the walk (not the report's last walk)
        # Whether a reader stepped or replayed handed a value a split the walk was not given (else no reader would,
        # asked again after the walk: open_values.found_splits is not asked).
        self.open_met = False
        # While a copy is recorded, per reader in order: the (id(value), split) it hands open values (its tape's
        # ``opened``).
        self._open_recorded: list[tuple[tuple[int, tuple[tuple[str, ...], ...]], ...]] | None = None
        self._reopen: dict[int, tuple[tuple[str, ...], ...]] = {}
        # The copies (by start) making a value of open_splits -> those values' tokens there and splits: in its key.
        self.open_copies: dict[int, tuple[Any, ...]] = {}
        # A loop body's constants, by id, with the loop's own repeat: a gather of one is made once, outside the
        # loop (XLA hoists the loop-invariant move; measured on the FSDP GRU's gradient: its recurrent weight
        # gathered once for the backward loop, not per trip).
        self.hoisted: dict[int, int] = {}
        # The layouts the caller asks for the program's outputs (``report(out_specs=)``), by id of the jaxpr
        # value: a scan whose stacked output is one sums each iteration's piece straight to that split.
        self.requested: dict[int, tuple[tuple[str, ...], ...]] = PlainTable()
        # The layouts asked along a chain of values to them, by the chain's signature (rules_indexing.asks_hold: a
        # deep model's copies ask alike of the stacked outputs their weight gradients become).
        self.asked_answers: dict[Any, Any] = {}
        # The environments of the nested calls walked into (jit, custom derivatives, remat), by the path of
        # call equations (ids) from the program: peak memory inlines them as XLA does (see :mod:`.memory`).
        self.sub_envs: dict[tuple[int, ...], dict[Any, Layout]] = {}
        self.call_path: tuple[int, ...] = ()
        # The user's words for the report (set by TracedProgram.report): each value's name (argument paths),
        # each equation's source line and the library line it is inside (by id of the equation).
        self.value_names: dict[Any, str] = {}
        self.eqn_where: dict[int, tuple[str, str]] = {}
        # The equation each op was recorded at (None: none of a jaxpr's), for a tape recorded around this walk.
        self.op_eqns: list[Any] = []
        # The copy replayed last, the state its key read, the environment, the equations stepped and jaxprs walked
        # then (:meth:`_carried`): the next copy of its run takes the state of the values entering both from there.
        self._last_replay: tuple[Copy, tuple[Any, ...], Any, int, int, ReadyTape] | None = None
        # (id of a replayed tape by slot, slot of a value the copy made) -> (the tape, that value's state as a
        # segment key reads it right after the replay): every copy of a run replaying that tape leaves its value at
        # that slot in that state (:meth:`_segment_key`).  Per walk: the state names the walk's mesh.
        self._made_states: dict[tuple[int, int], tuple[ReadyTape, Any, Any]] = {}
        # (id of the state before, id of the tape by slot replayed there, id of how the copies are wired) -> (those
        # three, held; the state a key reads where every value entering it is taken from there): a run's copies
        # key alike, so its states are kept as one object each (:attr:`_states`) and the next copy's is found here.
        self._state_after: dict[tuple[int, int, int], tuple[Any, Any, Any, tuple[Any, ...]]] = {}
        self._states: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # id of one of :attr:`_states` -> (it, held; its number in OpCosts.segment_states): found once per state.
        self._state_numbers: dict[int, tuple[tuple[Any, ...], int]] = {}
        self._made_in_of: dict[tuple[int, int], tuple[ReadyTape, Any, tuple[int, ...]]] = {}  # :meth:`_made_in`

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
        return FreeLayout(tuple(f"d{i}" for i in range(len(shape))), shape, self.mesh, tuple(() for _ in shape))

    def relayout(self, aval: Any, dims: Sequence[tuple[str, ...]]) -> Layout:
        """A positional layout of ``aval`` split as ``dims`` says, where that is possible.

        Splits that do not divide are dropped (the value is whole along that axis).
        A mesh axis asked for twice keeps its first use only: rules that can meet
        that case (a gather, a dot) settle it and pay for it before they call this
        (see :meth:`settle_repeats`).
        """
        if not any(dims):
            return self.replicated(aval)
        shape = tuple(int(s) for s in aval.shape)
        key = (shape, tuple(dims))
        hit = self.costs.layouts.get(key)
        if hit is None:
            hit = self.costs.layouts[key] = self._relayout(shape, dims)
        return hit

    def _relayout(self, shape: tuple[int, ...], dims: Sequence[tuple[str, ...]]) -> Layout:
        fixed = []
        used: set[str] = set()
        for size, d in zip(shape, dims):
            keep = tuple(m for m in d if m not in used)
            n = math.prod(self.costs.mesh_sizes[m] for m in keep)
            if keep and size % n == 0:
                fixed.append(keep)
                used.update(keep)
            else:
                fixed.append(())
        return Layout(tuple(f"d{i}" for i in range(len(shape))), shape, self.mesh, tuple(fixed))

    def settle_repeats(
        self, eqn: Any, phase: str, out_aval: Any, dims: Sequence[tuple[str, ...]], repeat: int, why: str
    ) -> list[tuple[str, ...]]:
        """Where a result would be split twice over one mesh axis, keep the first split and gather the second.

        (A table split over ``data`` looked up with indices split over ``data``.)
        The gather is charged on the result, at the layout it is left with: the
        all-gather that makes each device's block whole along the second axis.
        """
        used: set[str] = set()
        out: list[tuple[str, ...]] = []
        dropped: list[str] = []
        for d in dims:
            keep = tuple(m for m in d if m not in used)
            dropped += [m for m in d if m in used]
            used.update(keep)
            out.append(keep)
        if dropped and not self.quiet:
            lay = self.relayout(out_aval, out)
            n = math.prod(self.costs.mesh_sizes[m] for m in dropped)
            item = _itemsize(out_aval)
            array = math.prod(lay.shard_shape) * item
            sent = sent_bytes("all-gather", n, array)
            t = self.costs.profile.collective_time("all-gather", n, sent, array)
            coll = Collective("all-gather", tuple(dropped), n, int(sent), array, t, "result", why)
            self.record(eqn, phase, f"{why}: {side_string(lay)}", lay, (coll,), 0.0, t, repeat)
        return out

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
        if self.quiet or (not collectives and not flops):
            return
        if self.hoisted and collectives:
            repeat = self._hoisted_repeat(eqn, collectives, repeat)
        where, inside = self.eqn_where.get(id(eqn), ("", ""))
        if eqn.primitive.name == "output" and not where:
            where = "the program's output"
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (self.env.get(v) if not hasattr(v, "val") else None for v in eqn.invars[:2])
            expression = in_user_axis_names(expression, lhs, rhs, eqn.params["dimension_numbers"])
        names = self.value_names
        reads = tuple(
            dict.fromkeys(names[v] for v in getattr(eqn, "invars", ()) if not hasattr(v, "val") and v in names)
        )
        self.op_eqns.append(eqn)
        self.ops.append(
            OpReport(
                self.counter,
                eqn.primitive.name,
                phase,
                expression,
                out,
                collectives,
                flops,
                time_s,
                repeat,
                note,
                where,
                inside,
                reads,
            )
        )
        self.counter += 1

    def change(self, eqn: Any, phase: str, src: Layout, dst: Layout, dtype: Any, repeat: int, why: str) -> None:
        """Bring a value from ``src`` to ``dst`` and charge the collectives (once per value and target)."""
        if src.dims == dst.dims and src.unreduced == dst.unreduced:
            return
        value = self._source.get(id(src))
        key = (value, dst.dims)
        if value is not None and not src.unreduced:
            if id(dst) not in self._source:
                # A move in steps (a permute onto idle mesh axes, then a gather over them) is the same value's
                # all the way: XLA reuses each step for a later reader (CSE), so the next step's memo knows it.
                self._source[id(dst)] = value
                self._keep.append(dst)
            if key in self._made:
                # XLA reuses the value it already brought there; a dot reading a gathered copy another dot made
                # reads that copy (held to the last of them: memory._dot_gather_holds).
                if eqn.primitive.name == "dot_general" and math.prod(dst.shard_shape) > math.prod(src.shard_shape):
                    for p, v in enumerate(eqn.invars[:2]):
                        if not hasattr(v, "val") and self.env.get(v) is src:
                            self.bind_dot_copy(eqn, p, self._made[key])
                return
            self._made[key] = dst
            self._made_by.setdefault(value, set()).add(key[1])
        colls = self.costs.reshard(src, dst, dtype)
        if not src.unreduced and any(c.kind == "all-gather" for c in colls):
            dot = getattr(getattr(eqn, "primitive", None), "name", None) == "dot_general"
            for p, v in enumerate(getattr(eqn, "invars", ())):
                if not hasattr(v, "val") and self.env.get(v) is src:  # literals (a pad's value) are unhashable
                    self.bind_copy(v, dst)
                    if dot and p < 2:
                        self.bind_dot_copy(eqn, p, dst)
        if any(c.kind == "all-to-all" for c in colls):
            self.bind_sent(eqn, src)
        sliced = _sliced_before_sum(src, dst)
        if sliced is not None:
            # A pending sum brought to a finer split: slice first (free: the partial sums are the same on every
            # device of a mesh axis they are not summed over), then sum the smaller piece, as XLA does (never
            # all-reduce or reduce-scatter the whole and then slice; measured: an FSDP gradient [64, 128] summed
            # over data and asked [64@data, 128@model] is one reduce-scatter of the [64, 64] model piece,
            # 16384 B, not of the whole 32768 B).
            colls = self.costs.reshard(dst.with_dims(sliced, src.unreduced), dst, dtype)
        if colls and value is not None and value[1] in self.hoisted and all(c.kind == "all-gather" for c in colls):
            repeat = self.hoisted[value[1]]
        if colls:
            t = sum(getattr(c, "time", 0.0) for c in colls)
            self.record(eqn, phase, f"{why}: {side_string(src)} -> {side_string(dst)}", dst, colls, 0.0, t, repeat)

    def _hoisted_repeat(self, eqn: Any, collectives: tuple[Any, ...], repeat: int) -> int:
        """An op whose collectives all gather loop constants (:attr:`hoisted`) runs at the loop's own repeat, and so
        does every collective of an op that is itself loop-invariant (all it makes is :attr:`hoisted`): XLA's
        while-loop invariant code motion moves the op out of the loop with its collectives, whatever their kind
        (measured: OptimizedLSTMCell's gate kernels split on their outputs, concatenated in the body, are
        all-to-all'd once, outside the loop, not per step: tests/test_loop_invariant_rules.py)."""
        made = [self.hoisted.get(id(v)) for v in getattr(eqn, "outvars", ()) if not hasattr(v, "val")]
        if made and all(m is not None for m in made):
            return min(m for m in made if m is not None)
        if not all(c.kind == "all-gather" for c in collectives):
            return repeat
        read = [getattr(c, "operand", None) for c in collectives]
        invars = list(getattr(eqn, "invars", ()))
        positions = [k for k in read if isinstance(k, int) and 0 <= k < len(invars) and not hasattr(invars[k], "val")]
        if len(positions) != len(read):
            return repeat
        outer = [self.hoisted.get(id(invars[k])) for k in positions]
        return min(o for o in outer if o is not None) if all(o is not None for o in outer) else repeat

    def relay(self, v: Any, lay: Layout) -> Layout:
        """Lay ``v`` out anew as ``lay`` (a reader's split that XLA's propagation carries back to the value before
        any other reader took it): the value keeps its identity, so a move of it is made once (:meth:`change`'s
        memo, XLA's CSE) whichever reader asks for it first."""
        old = self.env.get(v)
        new = _private_copy(lay)
        key = self._source.get(id(old)) if old is not None else None
        if key is not None:
            self._source[id(new)] = key
            self._keep.append(new)
        self.env[v] = new
        return new

    def bind_copy(self, v: Any, lay: Layout) -> None:
        """Note that ``v`` is all-gathered to ``lay`` (peak memory counts the copy: see :mod:`.memory`)."""
        if self.quiet or hasattr(v, "val"):
            return
        key = Gathered(v)
        old = self.env.get(key)
        if old is None or math.prod(lay.shard_shape) > math.prod(old.shard_shape):
            self.env[key] = lay

    def bind_dot_copy(self, eqn: Any, p: int, lay: Layout) -> None:
        """Note that operand ``p`` (0 or 1) of the dot ``eqn`` is all-gathered to ``lay`` for that dot (peak memory
        holds the copy from the operand's first reader to its last such dot: see :mod:`.memory`), keyed by the dot's
        result (values.GatheredLhs, GatheredRhs).  Where it is gathered in steps, the largest is kept."""
        outs = getattr(eqn, "outvars", ())
        if self.quiet or not outs:
            return
        key = DOT_GATHERED[p](outs[0])
        old = self.env.get(key)
        if old is None or math.prod(lay.shard_shape) > math.prod(old.shard_shape):
            self.env[key] = lay

    def bind_sent(self, eqn: Any, lay: Layout) -> None:
        """Note that an operand of ``eqn``, laid out as ``lay``, is moved by an all-to-all (peak memory counts its
        send and receive buffers: see :mod:`.memory`).  Where several are, the largest is kept."""
        outs = getattr(eqn, "outvars", ())
        if self.quiet or not outs:
            return
        key = Sent(outs[0])
        old = self.env.get(key)
        if old is None or math.prod(lay.shard_shape) > math.prod(old.shard_shape):
            self.env[key] = lay

    def already_moved(self, ins: list[Layout], c: Any, as_move: bool = False, group: tuple[str, ...] = ()) -> bool:
        """Whether an analyzer step moving ``operand k`` of ``ins`` was already made to that value.  ``as_move``:
        the step is made here (a dot's own gather), so a later :meth:`change` of the value to its dims reuses it.
        ``group``: the step is made within XLA's partition of the dot into groups over those mesh axes
        (:func:`.rules_indexing.grouped_operand`), which shares it only with a step made alike, never with a move
        of the value made outside a group (nor the other way)."""
        tensor = getattr(c, "tensor", "")
        if not tensor.startswith("operand ") or c.kind != "all-gather":
            return False
        try:
            operand = ins[int(tensor.split()[1]) - 1]
        except (ValueError, IndexError):
            return False
        value = self._source.get(id(operand))
        if value is None:
            return False
        if group:
            made = (value, ("in group", group, c.kind, c.axes, c.array_bytes))
            if made in self._made:
                return True
            self._made[made] = ins[0]
            self._made_by.setdefault(value, set()).add(made[1])
            return False
        key = (value, (c.kind, c.axes, c.array_bytes))
        # The same gather made as a move of the value (``change``'s key: its target dims), by another dot's operand
        # placement (a cotangent gathered for a weight gradient, read again by the input gradient's dot).
        to = (value, tuple(tuple(m for m in d if m not in c.axes) for d in operand.dims))
        if key in self._made or to in self._made:
            return True
        self._made[key] = ins[0]
        self._made_by.setdefault(value, set()).add(key[1])
        if as_move:
            # ... and the other way: a later move of the value to those dims (``change``) reuses this gather.
            self._made[to] = operand.with_dims(to[1])
            self._made_by.setdefault(value, set()).add(to[1])
        return False

    def no_rule(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        """An op with no layout rule, priced as XLA runs an op it cannot partition, and named.

        XLA's SPMD partitioner replicates such an op: it all-gathers every split operand
        to the whole array, runs the op on every device, and its consumers dynamic-slice
        the replicated result back to their splits (free: no communication).
        """
        name = eqn.primitive.name
        self.unfollowed.add(name)
        self.met_unfollowed += 1
        if not self.quiet:
            where = self.unfollowed_at.setdefault(name, [])
            # The innermost equation with a line in the user's code: an op inside a library's jitted
            # function (jnp.sort is one) has only library frames; the call the user wrote has the line.
            site = next(filter(None, map(_source_line, reversed(self._stepping))), "unknown source line")
            if site not in where:
                where.append(site)
        for v, lay in zip(eqn.invars, ins):
            if hasattr(v, "val") or is_free(lay) or not any(lay.dims):
                continue
            whole = lay.with_dims(tuple(() for _ in lay.dims))
            self.change(eqn, phase, lay, whole, v.aval.dtype, repeat, f"{name} has no rule")
        return [self.replicated(v.aval) for v in eqn.outvars]

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
        self._walks += 1
        self.costs.counts.walks += 1
        serial = self._walks  # a jaxpr walked twice (a jitted function called twice) has new values each time
        # Repeated top-level stretches (the inlined forward of unrolled layers): see :mod:`.segment_memo`.
        # Not in a fork of the walk (alternatives: some marked op takes XLA's other choice): a tape recorded by the
        # main walk does not know which op is forced, so a fork steps every copy.
        memo = self.costs.memoise_segments and not self.costs.forced
        plan = self._segment_plan(jaxpr) if serial == 1 and memo else None
        given = env
        if plan is not None:
            env = PlainEnv(env)
            if type(self.uses) is dict:
                # Its class swapped while a copy is recorded (record_table), as the other tables: copying it in and
                # out of each recording (it holds every walked value's uses) grew with depth.
                self.uses = PlainTable(self.uses)

        def read(v: Any) -> Layout:
            if hasattr(v, "val"):  # a literal
                return self.replicated(v.aval)
            return env.get(v) or self.replicated(v.aval)

        def bind(v: Any, lay: Layout) -> None:
            if not isinstance(lay, FreeLayout) and not lay.unreduced:
                # A private copy, so that identical layouts of different values stay distinguishable
                # (the value-keyed memo of change()).
                lay = _private_copy(lay)
                self._source[id(lay)] = (serial, id(v))
                self._keep.append(lay)
            env[v] = lay

        self.uses.update(self.costs.uses_of(jaxpr))
        if self._walks == 1:  # the program itself: its results leave it
            self.program_outputs = PlainOutputs(id(v) for v in jaxpr.outvars if not hasattr(v, "val"))
            self.pinned.update(id(v) for v in jaxpr.invars)
        outer_env, self.env = self.env, env
        for v, lay in zip(jaxpr.invars, in_layouts):
            bind(v, lay)
        for v in jaxpr.constvars:
            bind(v, self.replicated(v.aval))
        eqns = jaxpr.eqns
        recording: _Recording | None = None
        constants: dict[Any, Any] = {}  # the walked jaxpr's literals broadcast to an array, by value
        i = 0
        while i < len(eqns):
            if plan is not None and recording is not None and i == recording.rec.copy.stop:
                self._segment_finish(recording, env)
                recording = None
            if self._reopen and recording is None and serial == 1:
                # Between two stretches of the program's own: no tape left half made.  (Checked once the copy being
                # recorded is finished, before the next one starts: the next one's recording was all wasted.)
                raise Reopened(self._reopen)
            if plan is not None:
                copy = plan.copies.get(i)
                if copy is not None and recording is None:
                    started = self._segment_start(plan, copy, env, repeat, phase_hint)
                    if started == "replayed":
                        i = copy.stop
                        continue
                    recording = started if isinstance(started, _Recording) else None
            eqn = eqns[i]
            i += 1
            self.costs.counts.equations += 1
            phase = phase_hint or self.costs.phase_of(eqn)
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name in CARRIERS and len(ins) == 1 and ins[0].unreduced:
                # A pending sum passes through a transpose or a conversion still pending (a gradient on
                # its way out: the output's layout decides how it is summed).
                pending = ins[0].unreduced
                outs = self.step(eqn, [ins[0].with_dims(ins[0].dims)], repeat, phase)
                for v, lay in zip(eqn.outvars, outs):
                    bind(v, lay.with_dims(lay.dims, pending))
                continue
            for k, (v, lay) in enumerate(zip(eqn.invars, ins)):
                if lay.unreduced:
                    # A pending sum meets a consumer: settle it once (rules take reduced values).
                    done = self.replicated(v.aval) if not any(lay.dims) else self.relayout(v.aval, lay.dims)
                    self.change(eqn, phase, lay, done, v.aval.dtype, repeat, "pending sum is consumed")
                    bind(v, done)
                    ins[k] = env[v]
            if recording is not None and eqn.primitive.name == "pad":
                recording.rec.pad_read(i - 1 - recording.rec.copy.start, ins[0])
            outs = self.step(eqn, ins, repeat, phase)
            if self.pulled:
                outs = self._pull(eqn, outs, repeat, phase)
            if self.open_splits and serial == 1:
                outs = self._opened(eqn, outs, repeat, phase)
            if eqn.primitive.name in _SHAPE_ONLY and self.summed:
                tag = self.summed.get(id(eqn.invars[0]))
                if tag:
                    self.summed[id(eqn.outvars[0])] = tag
            if eqn.primitive.name in PLACEMENTS:
                self.pinned.update(id(v) for v in eqn.outvars)
            if eqn.primitive.name == "broadcast_in_dim" and hasattr(eqn.invars[0], "val"):
                constants[eqn.outvars[0]] = eqn.invars[0].val
            same = _folded_operand(eqn, constants) if recording is None else None
            if same is not None and not outs[0].unreduced and outs[0].dims == read(same).dims:
                # XLA's algebraic simplifier folds x * 1 (and x + 0, x - 0) to x itself: the result is x's
                # value, and a move XLA makes of it is x's (its CSE).  (Not in a stretch being recorded: a replay
                # gives each copy's values their own identity.)
                env[eqn.outvars[0]] = read(same)
                if serial == 1 and self.open_at:
                    self._open_read(eqn, env)  # (a folded op still reads its operands: asked as any other reader)
                continue
            for v, lay in zip(eqn.outvars, outs):
                bind(v, lay)
            if serial == 1 and self.open_at:
                self._open_read(eqn, env)
        if recording is not None:
            self._segment_finish(recording, env)
        self.env = outer_env
        if env is not given:
            given.update(env)
        return [read(v) for v in jaxpr.outvars]

    def _pull(self, eqn: Any, outs: list[Layout], repeat: int, phase: str) -> list[Layout]:
        """Results a loop's fixed carry pulls elsewhere (:attr:`pulled`), moved where they are computed."""
        moved = list(outs)
        for k, v in enumerate(eqn.outvars):
            want = self.pulled.get(id(v))
            lay = moved[k] if k < len(moved) else None
            if want is None or lay is None or isinstance(lay, FreeLayout) or lay.unreduced or lay.dims == want:
                continue
            moved[k] = self.relayout(v.aval, want)
            # The scan rule's route: one move, or a gather whole and a slice where the running XLA does that.
            from .rules_control import dot_result_route

            src = lay
            for step in dot_result_route(self, v, lay, moved[k], v.aval.dtype, phase):
                self.change(eqn, phase, src, step, v.aval.dtype, repeat, "a loop carry's split, carried back")
                src = step
        return moved

    def _open_read(self, eqn: Any, env: dict[Any, Layout]) -> None:
        """Note the splits this reader hands open values the walk was not given (:attr:`_reopen`, where
        :attr:`open_stop`): the rest of the walk would be walked again.  In a copy being recorded every split a
        reader hands is kept for its tape, one group per reader (a copy replaying it notes them as its own readers
        would).

        Only the first reader that hands a new split stops the walk with its splits, wherever the walk then stops:
        a walk without the segment memo stops right after that reader, one recording a stretch at the stretch's
        end, and a split taken from a later reader there would be taken before the first one's moved it (the
        fixed point reached would depend on the memo: tests/test_segment_memo.py)."""
        recording = self._open_recorded
        if recording is None and self._reopen:
            return  # (the walk stops before its next equation: nothing more is taken)
        fresh = not self._reopen
        group = []
        for k, x in self.open_at.get(id(eqn), ()):
            if recording is None and id(x) in self.open_splits:
                continue
            fixed = self.open_fixed.get(id(x), frozenset())
            others = self.open_shared.get(id(eqn), ())
            dims = reader_split(eqn, k, x, env, env.get(x), fixed, others)
            if dims is None:
                continue
            group.append((id(x), dims))
            if id(x) not in self.open_splits:
                self.open_met = True
                if self.open_stop and fresh:
                    self._reopen[id(x)] = dims
        if recording is not None and group:
            recording.append(tuple(group))

    def _open_replayed(self, tape: SegmentTape, copy: Copy) -> None:
        """The splits the first of a replayed copy's readers to hand an open value a new one hands (as
        :meth:`_open_read`), as its tape's walk found them."""
        if self._reopen:
            return
        for group in tape.opened:
            for tok, dims in group:
                i = id(copy.value(tok))
                if i not in self.open_splits:
                    self.open_met = True
                    if not self.open_stop:
                        return
                    self._reopen[i] = dims
            if self._reopen:
                return

    def _opened(self, eqn: Any, outs: list[Layout], repeat: int, phase: str) -> list[Layout]:
        """Open results moved to the split their readers hand them (:attr:`open_splits`) where they are made: the
        split only adds mesh axes to axes the result leaves whole, a slice of what every device holds."""
        moved = list(outs)
        for k, v in enumerate(eqn.outvars):
            want = self.open_splits.get(id(v))
            lay = moved[k] if k < len(moved) else None
            if want is None or lay is None or is_free(lay) or lay.unreduced or lay.dims == want:
                continue
            if any(d and d != w[: len(d)] for d, w in zip(lay.dims, want)):
                continue  # (split otherwise in this walk: what the readers hand it is read again after)
            self.open_natural[id(v)] = lay
            moved[k] = self.relayout(v.aval, want)
            self.change(eqn, phase, lay, moved[k], v.aval.dtype, repeat, "an open value takes its readers' split")
        return moved

    def step(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        rule = RULES.get(eqn.primitive.name)
        if rule is None:
            rule = call_rule if sub_jaxpr(eqn) is not None else unfollowed
        self._stepping.append(eqn)
        try:
            return rule(self, eqn, ins, repeat, phase)
        finally:
            self._stepping.pop()

    # -- calls: identical blocks walked once (see :mod:`.blocks`) -----------------------------
    def walk_call(
        self,
        eqn: Any,
        body: Any,
        ins: list[Layout],
        repeat: int,
        phase_hint: str | None,
        leaving: tuple[int, ...] = (),
        asked: tuple[tuple[int, tuple[tuple[str, ...], ...]], ...] = (),
    ) -> list[Layout]:
        """The layouts a call's ``body`` returns for operands ``ins``, as a walk of it would find them
        (``leaving``: the positions of its results that leave the program; ``asked``: the layouts the caller
        asks of its results, by position).

        The body is walked in a sandbox walker (a call's values are its own: nothing of the walk
        around it enters) and what that walk did is kept as a :class:`~.blocks.Tape`, replayed here
        and, with ``costs.memoise_blocks``, at every later call of a body of the same structure under
        the same layouts.  The environments peak memory inlines are kept under this call's path.
        """
        costs = self.costs
        index = body_index(body, costs.structures, costs.phase_of)
        key = (
            type(self),
            self.quiet,
            costs.forced,  # a fork's walk of a body takes other choices: never the main walk's tape
            index.ordinal,
            tuple((type(x), x) for x in ins),
            repeat,
            phase_hint,
            leaving,
            asked,
        )
        # A fork of the walk (alternatives: a marked op takes XLA's other choice) walks every body: a tape shared
        # by structure would carry the forced choice to, or away from, calls of other bodies alike.
        memo = costs.memoise_blocks and not costs.forced
        tape = costs.tapes.get(key) if memo else None
        if tape is None:
            tape, repeatable = self._record(eqn, body, index, ins, repeat, phase_hint, leaving, asked)
            if repeatable and memo:
                costs.tapes[key] = tape
        else:
            costs.counts.replays += 1
        return self._replay(tape, eqn, index)

    def _record(
        self,
        eqn: Any,
        body: Any,
        index: Any,
        ins: list[Layout],
        repeat: int,
        phase_hint: str | None,
        leaving: tuple[int, ...],
        asked: tuple[tuple[int, tuple[tuple[str, ...], ...]], ...],
    ) -> tuple[Tape, bool]:
        """Walk ``body`` in a sandbox: its tape, and whether another call may replay it (not where it met an op
        without a rule: its sites are merged here, and the report names them at this call's site)."""
        self.costs.counts.recorded += 1
        box = type(self)(self.costs, quiet=self.quiet)
        box._walks = 1  # the body is not the program: only its results that leave the program leave it
        box.program_outputs = {id(body.outvars[k]) for k in leaving}
        box.requested = {id(body.outvars[k]): dims for k, dims in asked}
        box.value_names, box.eqn_where = self.value_names, self.eqn_where
        box._stepping = list(self._stepping)
        self.tape_begin(box, body)
        env: dict[Any, Layout] = {}
        outs = box.walk(body, ins, repeat, phase_hint, env=env)
        envs: list[tuple[tuple[int, ...], dict[Any, Layout]]] = []
        unplaced: dict[tuple[int, ...], dict[Any, Layout]] = {}  # envs of calls the index does not list
        if not self.quiet:
            envs.append(((), env))
            for path, sub in box.sub_envs.items():
                at = tuple(index.eqn_at.get(i, -1) for i in path)
                if -1 in at:
                    unplaced[path] = sub
                else:
                    envs.append((at, sub))
        where = [index.eqn_at.get(id(e)) for e in box.op_eqns]
        tape = Tape(index, tuple(outs), tuple(zip(box.ops, where)), tuple(envs), self.tape_extra(box, body))
        repeatable = True
        if unplaced:
            # A nested call the structure does not reach (a body under a parameter it does not read): kept
            # under this call's path as walked, and the tape is not replayed elsewhere.
            for path, sub in unplaced.items():
                self.sub_envs[(*self.call_path, id(eqn), *path)] = sub
            repeatable = False
        if box.unfollowed:
            # The report names such an op at its call site, the caller's: not a block's to repeat.
            self.met_unfollowed += 1
            self.unfollowed |= box.unfollowed
            for name, sites in box.unfollowed_at.items():
                here = self.unfollowed_at.setdefault(name, [])
                here += [s for s in sites if s not in here]
            repeatable = False
        return tape, repeatable

    def _replay(self, tape: Tape, eqn: Any, index: Any) -> list[Layout]:
        """Make the walk around the call as the tape's walk made it: its ops, its environments, its results."""
        same = index is tape.body
        names = self.value_names
        for op, at in tape.ops:
            changes: dict[str, Any] = {"index": self.counter}
            e = index.eqns[at] if at is not None else None
            if not same and e is not None:
                changes["where"], changes["inside"] = self.eqn_where.get(id(e), ("", ""))
                changes["reads"] = tuple(
                    dict.fromkeys(names[v] for v in e.invars if not hasattr(v, "val") and v in names)
                )
                if op.alternative:  # an offered alternative names this call's equation, as a walk here would
                    changes["alternative"] = id(e)
            self.ops.append(_replaced(op, changes))
            self.op_eqns.append(e)  # a tape recorded around this call places the op as this one did
            self.counter += 1
        here = (*self.call_path, id(eqn))
        for rel, env in tape.envs:
            path = (*here, *(id(index.eqns[p]) for p in rel))
            self.sub_envs[path] = env if same else translate_env(env, tape.body, index)
        self.tape_replay(tape, eqn)
        return list(tape.outs)

    # -- repeated top-level stretches: walked once per entering state (see :mod:`.segment_memo`) ---------
    def _segment_plan(self, jaxpr: Any) -> SegmentPlan:
        """The copies of ``jaxpr``'s repeated top-level runs (:func:`.segment_memo.plan_segments`), found once."""
        plans = self.costs.segment_plans
        hit = plans.get(id(jaxpr))
        if hit is None or hit.jaxpr is not jaxpr:
            hit = plans[id(jaxpr)] = plan_segments(
                jaxpr, self.costs.structures, self.costs.phase_of, self.costs.segment_structures
            )
        return hit

    def _segment_key(
        self, copy: Copy, env: dict[Any, Layout], repeat: int, phase_hint: str | None, carried: Any = None
    ) -> tuple[Any, tuple[Any, ...]]:
        """Everything the walk of ``copy`` may read outside it, where it stays closed (else its tape is not kept),
        and the state of the values entering it that the key holds by its number.

        ``carried``: (the state the key of the copy replayed just before this one read, how this copy is wired to
        that one, that replay's tape by slot), where nothing but that replay ran since and the replay wrote
        nothing under the values entering it (:meth:`_carried`): the state of a value that entered both is what
        that key read of it, taken from there, not read again (a layer's weights, read by every layer of a run).
        A value that copy made, bound by its replay to a private copy of the tape's layout, is in the state that
        replay leaves every copy's value at that slot in (its layout's, gathered copy's and pending sum's fields,
        its own source, its moves and pending-sum tag are the tape's: nothing else wrote them since the value was
        made), read at the first such copy and kept (:attr:`_made_states`).  Where every entering value is taken
        so, the state is a function of the state before, the tape and the wiring (:attr:`_state_after`): the
        copies of a run after its first few find theirs in one lookup."""
        if carried is not None:
            before, wired, ready = carried
            after = self._state_after.get((id(before), id(ready), id(wired)))
            if after is not None and after[0] is before and after[1] is ready and after[2] is wired:
                return self._key_of(copy, env, repeat, phase_hint, after[3], True), after[3]
            shared = wired[0]
            made_in = self._made_in(ready, wired)
        else:
            before, shared, made_in, ready, wired = (), (), (), None, None
        state: list[Any] = []
        get, sources, made_by, summed, mesh = env.get, self._source, self._made_by, self.summed, self.mesh
        none: frozenset[Any] = frozenset()
        append = state.append
        made_states = self._made_states
        reads = 0
        for j, (v, gathered_key, partial_key, ident, bound) in enumerate(copy.entering_keys):
            m = shared[j] if shared else -1
            if m >= 0:
                append(before[2 * m])
                append(before[2 * m + 1])
                continue
            slot = made_in[j] if made_in else -1
            if slot >= 0:
                kept = made_states.get((id(ready), slot))
                if kept is not None and kept[0] is ready:
                    append(kept[1])
                    append(kept[2])
                    continue
            reads += 1
            lay, gathered, partial = get(v), get(gathered_key), get(partial_key)
            if lay is None:
                fields, mine, moves = None, True, none
            else:
                source = sources.get(id(lay))
                made = made_by.get(source) if source is not None else None
                moves = frozenset(made) if made else none  # equal to an empty set's: most values were never moved
                mine = source is None or source == bound
                # _fields(lay, mesh), inline: the call is most of its cost at every entering value of every copy
                fields = (type(lay), lay.axes, lay.shape, lay.dims, lay.unreduced, 0 if lay.mesh is mesh else lay.mesh)
            # Most entering values have no gathered copy and no pending sum: their None is _fields's, uncalled.
            entry = (
                fields,
                None if gathered is None else _fields(gathered, mesh),
                None if partial is None else _fields(partial, mesh),
                mine,
                moves,
            )
            tag = summed.get(ident)
            append(entry)
            append(tag)
            if slot >= 0 and ready is not None:
                made_states[(id(ready), slot)] = (ready, entry, tag)
        self.costs.counts.segment_key_reads += reads
        kept_state = tuple(state)
        interned = not reads and wired is not None
        if interned:
            # Every value entering it was taken from the copy before (its state or its tape's): so is the next
            # copy's of a run wired alike after a replay of that tape.  One object per such state (a run's copies
            # key alike), so that the next copy's is found from this one by its id.
            kept_state = self._states.setdefault(kept_state, kept_state)
            self._state_after[(id(before), id(ready), id(wired))] = (before, ready, wired, kept_state)
        return self._key_of(copy, env, repeat, phase_hint, kept_state, interned), kept_state

    def _made_in(self, ready: ReadyTape, wired: Any) -> tuple[int, ...]:
        """Per value entering a copy wired to the one before as ``wired``: its slot in that copy where ``ready``'s
        replay there bound it a private layout, else -1 (found once per tape and wiring)."""
        hit = self._made_in_of.get((id(ready), id(wired)))
        if hit is None or hit[0] is not ready or hit[1] is not wired:
            private = ready.private_slots
            hit = self._made_in_of[(id(ready), id(wired))] = (
                ready,
                wired,
                tuple(s if s in private else -1 for s in wired[1]),
            )
        return hit[2]

    def _key_of(
        self,
        copy: Copy,
        env: dict[Any, Layout],
        repeat: int,
        phase_hint: str | None,
        state: tuple[Any, ...],
        interned: bool,
    ) -> Any:
        """:meth:`_segment_key` given the state it read of the values entering ``copy`` (``interned``: one of
        :attr:`_states`, whose number is found by its id)."""
        rows: Any = ()
        if copy.slices:
            entering = copy.entering
            split = tuple(
                lay.dims if k >= 0 and (lay := env.get(entering[k])) is not None and len(lay.dims) == len(row) else None
                for _, k, row, _, _, _ in copy.slices
            )
            kept = self.costs.segment_rows
            hit = kept.get((id(copy), split))
            if hit is None or hit[0] is not copy:
                hit = kept[(id(copy), split)] = (copy, self._slice_rows(copy, split))
            rows = hit[1]
        # Which entering values leave the program (a route carried back upstream stops at one: upstream.outer).
        outputs = self.program_outputs
        leaving = tuple(map(outputs.__contains__, copy.entering_ids)) if outputs else ()
        # The layouts the caller asks of values past the copy are not in the key: a tape keeps those its walk read
        # (segment_memo.asked_hold), and most walks read none (:meth:`_asked` keys the open copies by all of them).
        return (
            copy.structure,  # its run, the bodies it calls, its wiring
            type(self),
            self.quiet,
            repeat,
            phase_hint,
            self._state_number(state, interned),  # (the state by its number: hashed at every lookup)
            rows,
            leaving,
        )

    def _state_number(self, state: tuple[Any, ...], interned: bool) -> int:
        """``state``'s number in OpCosts.segment_states (a new one for a state no key held yet)."""
        if interned:
            hit = self._state_numbers.get(id(state))
            if hit is not None and hit[0] is state:
                return hit[1]
        numbers = self.costs.segment_states
        number = numbers.setdefault(state, len(numbers))
        if interned:
            self._state_numbers[id(state)] = (state, number)
        return number

    def _asked(self, copy: Copy) -> tuple[Any, ...]:
        """The layouts the caller asks for values the look-ahead may reach past ``copy`` (program outputs), by visit
        index: what an open copy's record is kept under besides its key (:meth:`_segment_start`).  Read from the
        smaller side (a planner asks a layout of every gradient: hundreds at every copy otherwise)."""
        requested = self.requested
        if not requested:
            return ()
        ahead = copy.ahead
        if len(ahead) < len(requested):
            return tuple(sorted((at, requested[i]) for i, at in ahead.items() if i in requested))
        return tuple(sorted((ahead[i], dims) for i, dims in requested.items() if i in ahead))

    def _carried(self, copy: Copy, env: dict[Any, Layout]) -> Any:
        """What :meth:`_segment_key` may take from the key of the copy replayed just before ``copy`` (None: nothing).

        Where that copy ends where this one starts, in the same environment, and no equation was stepped and no
        jaxpr walked since its replay (which wrote nothing under the values entering it: ReadyTape.writes_entering),
        a value entering both is as that key read it: the replay wrote its environment, pending-sum tags and moves
        under the replayed copy's own values only, and the layouts it bound are new objects, so no value made
        before it has another layout, gathered copy, pending sum, source or move now."""
        last = self._last_replay
        if last is None:
            return None
        prev, state, at, stepped, walks, ready = last
        if prev.stop != copy.start or at is not env or stepped != self.costs.counts.equations or walks != self._walks:
            return None
        kept = self.costs.segment_shared
        hit = kept.get((id(prev), id(copy)))
        if hit is None or hit[0] is not prev or hit[1] is not copy:
            where = {i: m for m, i in enumerate(prev.entering_ids)}
            wired = (tuple(where.get(i, -1) for i in copy.entering_ids), _made_slots(prev, copy))
            # One object per wiring: the copies of a run are wired alike to the one before.
            hit = kept[(id(prev), id(copy))] = (prev, copy, self.costs.segment_wirings.setdefault(wired, wired))
        return state, hit[2], ready

    def _slice_rows(self, copy: Copy, split: tuple[Any, ...]) -> tuple[Any, ...]:
        """The rows ``copy``'s slices take as its key holds them, given the splits of the values they slice
        (None: not an entering value's, or unbound): found once per copy and splits (OpCosts.segment_rows)."""
        rows = []
        sizes = self.costs.mesh_sizes
        for (off, k, row, strides, shape, out), dims in zip(copy.slices, split):
            if dims is not None:
                # Which row a layer slices matters only along a split axis (the devices holding it), and there
                # only as far as the slice's walk reads it (slice_row_class).
                rows.append(
                    (
                        off,
                        tuple(
                            slice_row_class(a, math.prod(sizes[m] for m in d), b, r, s) if d else None
                            for r, d, s, a, b in zip(row, dims, strides, shape, out)
                        ),
                    )
                )
            else:
                rows.append((off, row if k < 0 else tuple(None for _ in row)))
        return tuple(rows)

    def _segment_start(
        self, plan: SegmentPlan, copy: Copy, env: dict[Any, Layout], repeat: int, phase_hint: str | None
    ) -> _Recording | Literal["replayed", "plain"]:
        """Replay ``copy``, start recording it (its record), or walk it plainly."""
        if copy.leaves or (self.requested and not self.requested.keys().isdisjoint(copy.inside_ids)):
            self._last_replay = None
            return "plain"  # its values leave the program or are asked for: the look-ahead ends there
        key, state = self._segment_key(copy, env, repeat, phase_hint, self._carried(copy, env))
        opened = self.open_copies.get(copy.start) if self.open_copies else None
        if opened:
            key = (*key, opened)  # it makes values moved to their readers' splits (open_values), moved where made
        self._last_replay = None
        # The tapes of this key, one per padding its pads' walk read (each layer pads its gradient at its row).
        tapes = self.costs.segment_tapes.get(key, ())
        requested = self.requested
        tape = next(
            (
                t
                for t in self._padding_alike(tapes, copy)
                if (not t.asked or asked_hold(t.asked, copy, requested))
                and self._searches_hold(t, copy)
                and (not t.asks or self._asks_hold(t, copy))
            ),
            None,
        )
        if tape is not None:
            ready = self._segment_replay(tape, copy, env)
            self.costs.counts.segment_replays += 1
            if tape.opened and (self.open_stop or not self.open_met):
                self._open_replayed(tape, copy)
            if not ready.writes_entering:
                self._last_replay = (copy, state, env, self.costs.counts.equations, self._walks, ready)
            return "replayed"
        # An open copy's record is kept under its key and every layout asked past it (which of them its walk read
        # up to where it left, it does not say): as before the asked layouts left the key.
        key_open = (key, self._asked(copy))
        if any(pad_guard_holds(guard, copy) for guard in self.costs.segment_open.get(key_open, ())):
            # A copy entering in this state (and padding alike where the walk read it) read outside itself: this
            # walk reads what that one read, up to the same read, and is open too.  Walked without the logging.
            self.costs.counts.segments_open += 1
            return "plain"
        rec = Recorder(copy, plan.made_at, past=self.costs.segment_past)
        recording = _Recording(
            rec,
            key,
            key_open,
            len(self.ops),
            self._walks,
            self.met_unfollowed,
            len(self.sub_envs),
            (self.summed, self.uses, self.requested, self._made, self.program_outputs),
        )
        self.summed = record_table(self.summed, rec, "summed")
        self.uses = record_table(self.uses, rec, "uses")
        self.requested = record_table(self.requested, rec, "requested")
        self._made = record_table(self._made, rec, "made")
        self.program_outputs = record_outputs(self.program_outputs, rec)
        env.__class__ = RECORDING
        env.rec = rec  # type: ignore[attr-defined]
        recording.begun = self.segment_begin(copy, rec)
        self._open_recorded = [] if self.open_at else None
        return recording

    def _segment_finish(self, recording: _Recording, env: dict[Any, Layout]) -> None:
        """End a copy's recording: put the plain tables back, and keep its tape where its walk stayed closed."""
        rec, copy = recording.rec, recording.rec.copy
        opened, self._open_recorded = self._open_recorded or [], None
        env.__class__ = PLAIN
        env.rec = None  # type: ignore[attr-defined]
        self.summed = plain_table(self.summed)
        self.uses = plain_table(self.uses)
        self.requested = plain_table(self.requested)
        self._made = plain_table(self._made)
        self.program_outputs = plain_outputs(self.program_outputs)
        extra, closed = self.segment_end(copy, recording.begun, rec)
        if not closed:
            rec.leave("a dependence on a collective before the copy")
        if self._walks != recording.walks:
            rec.leave("a nested walk (its values are numbered by walk)")
        if self.met_unfollowed != recording.unfollowed:
            rec.leave("an op without a rule (named at its call site, which is each copy's own)")
        offsets = {id(e): off for off, e in enumerate(copy.eqns)}
        subs = []
        # The environments it added (sub_envs only grows, in insertion order: those past the count it began at).
        for path, sub in itertools.islice(self.sub_envs.items(), recording.paths, None):
            if not path or path[0] not in offsets:
                rec.leave("an environment outside the copy")
                break
            subs.append((offsets[path[0]], path[1:], sub))
        if rec.why:
            self.costs.counts.segments_open += 1
            self.costs.segment_open.setdefault(recording.key_open, []).append(pad_guard(copy, rec.pads))
            return
        writes = tuple(
            (tok, kind, lay, kind is None and self._source.get(id(lay)) == (1, id(copy.value(tok))))
            for tok, kind, lay in rec.env
        )
        ops = tuple(
            (op, offsets.get(id(e)) if e is not None else None, None if e is None or id(e) in offsets else e)
            for op, e in zip(self.ops[recording.ops :], self.op_eqns[recording.ops :])
        )
        tape = SegmentTape(
            writes,
            tuple(rec.summed),
            tuple(rec.made),
            ops,
            tuple(subs),
            extra,
            pad_guard(copy, rec.pads),
            tuple(rec.searches),
            asked_guard(rec.asked),
            tuple(
                kept
                for group in opened
                if (kept := tuple((copy.tokens[i], dims) for i, dims in group if i in copy.tokens))
            ),
            tuple(rec.asks),
        )
        self.costs.segment_tapes.setdefault(recording.key, Shelf()).append(tape)

    def _padding_alike(self, tapes: Sequence[SegmentTape], copy: Copy) -> Sequence[SegmentTape]:
        """The tapes of a key whose pads pad as ``copy``'s where their walk read it, in the order kept: a copy's
        padding is fixed, so found once per copy and number of tapes (:class:`.segment_memo.Shelf`'s picks)."""
        picks = getattr(tapes, "picks", None)
        if picks is None:  # not a shelf (none kept yet, or a list put there by hand)
            return [t for t in tapes if pad_guard_holds(t.pads, copy)]
        hit = picks.get(id(copy))
        if hit is None or hit[0] is not copy or hit[1] != len(tapes):
            hit = picks[id(copy)] = (copy, len(tapes), tuple(t for t in tapes if pad_guard_holds(t.pads, copy)))
        return hit[2]

    def _asks_hold(self, tape: SegmentTape, copy: Copy) -> bool:
        """Whether the layouts asked of ``copy``'s values past itself are those ``tape``'s walk found."""
        from .rules_indexing import asks_hold  # (the rules import the walker's modules: looked up when asked)

        return asks_hold(tape.asks, copy, self)

    def _searches_hold(self, tape: SegmentTape, copy: Copy) -> bool:
        """Whether ``copy``'s look-aheads past itself answer as those of the copy ``tape`` was recorded at."""
        return not tape.searches or searches_hold(tape.searches, copy, self, self.costs.segment_past)

    def _segment_replay(self, tape: SegmentTape, copy: Copy, env: dict[Any, Layout]) -> ReadyTape:
        """Make the walk's state as walking ``copy`` would: its writes onto this copy's values, its ops.

        The tape is kept by slot once (:func:`.segment_memo.ready_tape`), the copy's keys once
        (:func:`.segment_memo.copy_slots`) and the tape's writes under them once per copy
        (:func:`.segment_memo.replay_at`): a replay is bulk updates of the walker's tables, a private layout per
        value read after the copy, and one new op per op (its index and words this copy's).  Returns the tape by slot."""
        slots = self._slots(copy)
        ready = self._ready(tape, copy)
        at = self._replay_at(ready, slots)
        env.update(zip(at.env_keys, ready.env_lays))
        if at.private:
            source, keep = self._source, self._keep
            for key, src, lay in at.private:
                # A private copy per value read after the copy: the value-keyed memo of change() tells them apart.
                mine = _private_copy(lay)
                source[id(mine)] = src
                keep.append(mine)
                env[key] = mine
        if at.summed:
            self.summed.update(at.summed)
        if at.made:
            self._made.update(at.made)
            made_by = self._made_by
            for src, moves in at.made_by:
                had = made_by.get(src)
                if had is None:
                    made_by[src] = set(moves)
                else:
                    had |= moves
        eqns = copy.eqns
        # The copy's ops, made only when someone reads them (OpLog): what they sum to is the tape's ops'.
        self.ops.add_run(ReplayRun(tape.ops, self._copy_words(slots), eqns, self.counter, self._cost_terms(tape)))
        self.counter += len(tape.ops)
        self.op_eqns.extend(ready.pick_op_eqns(eqns + ready.op_inners if ready.op_inners else eqns))
        for off, rest, sub in tape.sub_envs:
            self.sub_envs[(id(eqns[off]), *rest)] = sub
        self.segment_replay(tape.extra, copy)
        return ready

    def _cost_terms(self, tape: SegmentTape) -> tuple[CostTerms, ...]:
        """What each of ``tape``'s ops adds to its phase's totals (:func:`.oplog.cost_terms`), made once per tape."""
        kept = self.costs.segment_terms
        hit = kept.get(id(tape))
        if hit is None or hit[0] is not tape:
            hit = kept[id(tape)] = (tape, tuple(cost_terms(op) for op, _, _ in tape.ops))
        return hit[1]

    def _ready(self, tape: SegmentTape, copy: Copy) -> ReadyTape:
        """``tape`` by slot, made once (OpCosts.segment_ready; ``copy``: one it replays at, whose slots number as
        those of the copy it was recorded at: copies of one key have as many values, their wiring is in the key)."""
        hit = self.costs.segment_ready.get(id(tape))
        if hit is None or hit.tape is not tape:
            hit = self.costs.segment_ready[id(tape)] = ready_tape(tape, copy)
        return hit

    def _replay_at(self, ready: ReadyTape, slots: CopySlots) -> ReplayAt:
        """``ready``'s writes at ``slots``' copy (:func:`.segment_memo.replay_at`), made once per tape and copy."""
        kept = slots.replays
        tape = ready.tape
        hit = kept.get(id(tape))
        if hit is None or hit.ready.tape is not tape:
            hit = kept[id(tape)] = replay_at(ready, slots)
        return hit

    def _slots(self, copy: Copy) -> CopySlots:
        """``copy``'s keys by slot, made once (OpCosts.segment_slots)."""
        hit = self.costs.segment_slots.get(id(copy))
        if hit is None or hit.copy is not copy:
            hit = self.costs.segment_slots[id(copy)] = copy_slots(copy)
        return hit

    def _copy_words(self, slots: CopySlots) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
        """Each of the copy's equations' op words under this walk's naming (:meth:`_words_of`), found once."""
        names, where = self.value_names, self.eqn_where
        kept = slots.words
        if kept.get("names") is not names or kept.get("where") is not where:
            kept.clear()
            kept["names"], kept["where"] = names, where
            kept["words"] = tuple(self._words_of(e) for e in slots.copy.eqns)
        words: tuple[tuple[str, str, tuple[str, ...]], ...] = kept["words"]
        return words

    def _words_of(self, eqn: Any) -> tuple[str, str, tuple[str, ...]]:
        """An op's words at ``eqn`` (its source line, the library line it is inside, the named values it reads), as
        :meth:`record` finds them: found once per equation and naming (OpCosts.words), a replay reads them."""
        names = self.value_names
        words = self.costs.words
        hit = words.get(id(eqn))
        if hit is None or hit[0] is not names or hit[1] is not eqn:
            where, inside = self.eqn_where.get(id(eqn), ("", ""))
            reads = tuple(dict.fromkeys(names[v] for v in eqn.invars if not hasattr(v, "val") and v in names))
            hit = words[id(eqn)] = (names, eqn, (where, inside, reads))
        return hit[2]

    def segment_begin(self, copy: Copy, rec: Recorder) -> Any:
        """Prepare to record ``copy`` (a subclass's hook: the dependency walker's masks)."""
        return None

    def segment_end(self, copy: Copy, begun: Any, rec: Recorder) -> tuple[Any, bool]:
        """What a subclass keeps of the recorded copy, and whether its part stayed closed."""
        return None, True

    def segment_replay(self, extra: Any, copy: Copy) -> None:
        """Replay the subclass's part of a copy's tape."""

    def tape_begin(self, box: Walker, body: Any) -> None:
        """Prepare the sandbox ``box`` before it records ``body`` (a subclass's hook)."""

    def tape_extra(self, box: Walker, body: Any) -> Any:
        """What a subclass records of the sandbox's walk besides ops and environments."""
        return None

    def tape_replay(self, tape: Tape, eqn: Any) -> None:
        """Replay the subclass's part of ``tape`` at the call ``eqn``."""

    def dtype(self, eqn: Any) -> Any:
        outs = eqn.outvars
        return outs[0].aval.dtype if outs and hasattr(outs[0].aval, "dtype") else "float32"


class _Recording:
    """A copy being recorded: its log and key, and the walk's state when it began."""

    def __init__(
        self,
        rec: Recorder,
        key: Any,
        key_open: Any,  # the key with the layouts asked past the copy (Walker._asked): where an open record is kept
        ops: int,
        walks: int,
        unfollowed: int,
        paths: int,  # how many environments sub_envs held when it began
        tables: tuple[Any, ...],
    ) -> None:
        self.rec, self.key, self.ops, self.walks, self.unfollowed, self.paths = rec, key, ops, walks, unfollowed, paths
        self.key_open = key_open
        self.tables = tables
        self.begun: Any = None


# Ops that move no values between positions' meaning: a dot's summed result stays "summed" through them.
_SHAPE_ONLY = {"reshape", "transpose", "convert_element_type", "copy", "copy_p", "squeeze", "expand_dims"}


_replaced = replaced


def _made_slots(prev: Copy, copy: Copy) -> tuple[int, ...]:
    """For each value entering ``copy``, its slot in ``prev`` (:func:`.segment_memo.slot_of`) where ``prev`` made it
    and lets it escape (a replay of ``prev`` binds it a private copy), else -1."""
    tokens, escaping, entering = prev.tokens, prev.escaping, len(prev.entering)
    slots = []
    for i in copy.entering_ids:
        tok = tokens.get(i)
        slots.append(entering + tok[1] if tok is not None and tok[0] == "i" and tok in escaping else -1)
    return tuple(slots)


def _fields(lay: Layout | None, mesh: tuple[MeshAxis, ...]) -> Any:
    """What a ``Layout`` compares equal by (its class and fields), as tuples of strings and ints that hash and
    compare at C speed: a segment's key holds one per entering value, at every copy of every costing (a Layout
    hashes and compares its mesh axes in Python).  The walk's own mesh (nearly always) as 0."""
    if lay is None:
        return None
    return (type(lay), lay.axes, lay.shape, lay.dims, lay.unreduced, 0 if lay.mesh is mesh else lay.mesh)


def _private_copy(lay: Layout) -> Layout:
    """A copy of a validated, fully reduced ``Layout`` (same fields and cached views), not re-validated:
    the walk binds one per value, thousands per walk."""
    d = lay.__dict__
    if lay.__class__ is Layout and "mesh_sizes" in d and not _checks.INVARIANTS:
        # Layout._derive's copy at C speed: a Layout's instance dict holds its fields and its cached mesh_sizes.
        new = _new_object(Layout)
        new.__dict__.update(d)
        return new
    # mesh_sizes: computed once on the shared layout, then shared with the copy
    return Layout._derive(lay.axes, lay.shape, lay.mesh, lay.dims, lay.unreduced, lay.mesh_sizes)


_new_object = object.__new__


# The identities XLA's algebraic simplifier folds to their operand before its SPMD partitioner runs: primitive ->
# (the constant, whether it may stand on either side).  x * 1, 1 * x, x + 0, 0 + x, x - 0 (measured: the moves of
# the result are x's, tests/test_external_repros.py); x / 1 is not among them (XLA moves x / 1 as a value of its own).
_IDENTITIES: dict[str, tuple[float, bool]] = {"mul": (1.0, True), "add": (0.0, True), "sub": (0.0, False)}


def _folded_operand(eqn: Any, constants: dict[Any, Any]) -> Any:
    """The operand ``eqn`` is equal to, where it is one of :data:`_IDENTITIES` with a constant (a literal, or a
    literal broadcast) of the same dtype, the result has the operand's shape and its type names no Explicit mesh
    axis; else None."""
    if eqn.primitive.name == "rev":
        # A reverse along size-1 dimensions only (a 1x1 kernel flipped for its conv's input gradient) is removed
        # by XLA's algebraic simplifier: the kernel gathered for the forward conv is the one the gradient's conv
        # reads (measured: an FSDP 1x1 conv's gradient, one all-gather of the kernel for both convs;
        # tests/test_depthwise_conv_rules.py).
        x = eqn.invars[0]
        return None if hasattr(x, "val") or any(int(x.aval.shape[d]) != 1 for d in eqn.params["dimensions"]) else x
    rule = _IDENTITIES.get(eqn.primitive.name)
    if rule is None or len(eqn.invars) != 2:
        return None
    unit, either_side = rule
    out = eqn.outvars[0].aval
    types = getattr(getattr(getattr(out, "sharding", None), "mesh", None), "axis_types", ())
    if any("Explicit" in str(t) for t in types):
        # On Explicit axes JAX annotates the op with its type's sharding and XLA partitions it as a value of its
        # own (measured: x * 1 read by a second dot on a (4, 2) Explicit mesh is re-split again, as x * 2 is).
        return None
    for k in (1, 0) if either_side else (1,):
        x, c = eqn.invars[1 - k], eqn.invars[k]
        if hasattr(x, "val") or getattr(x.aval, "shape", None) != out.shape or x.aval.dtype != out.dtype:
            continue
        value = c.val if hasattr(c, "val") else constants.get(c)
        if value is not None and _is_scalar(value, unit):
            return x
    return None


def _is_scalar(value: Any, unit: float) -> bool:
    """Whether a literal is the scalar ``unit`` (a NumPy or JAX scalar, or a Python number)."""
    try:
        return bool(getattr(value, "shape", ()) == () and float(value) == unit)
    except (TypeError, ValueError):
        return False


def _extends(src: tuple[tuple[str, ...], ...], dst: tuple[tuple[str, ...], ...]) -> bool:
    """Every axis of ``dst`` is split as in ``src`` or further (``src``'s mesh axes come first)."""
    return all(d[: len(s)] == s for s, d in zip(src, dst))


def _sliced_before_sum(src: Layout, dst: Layout) -> tuple[tuple[str, ...], ...] | None:
    """The split a pending sum (``src``, unreduced) takes locally before it is summed into ``dst``: each of
    ``dst``'s axes whose split names none of the summed mesh axes (the partial sums agree over the others, so
    any device can keep just its piece); None where ``src`` is no pending sum, ``dst`` is not a finer split of it,
    or there is nothing to slice first."""
    if not src.unreduced or not _extends(src.dims, dst.dims):
        return None
    sliced = tuple(d if not set(d) & src.unreduced else s for s, d in zip(src.dims, dst.dims))
    return sliced if sliced != src.dims else None


def _source_line(eqn: Any) -> str:
    """Where ``eqn`` comes from in the user's code, as JAX summarises it (``'model.py:12 (loss)'``)."""
    try:
        from jax.extend import source_info_util

        return str(source_info_util.summarize(eqn.source_info))
    except Exception:  # an equation without source info (the program's output step): none to name
        return ""


def _itemsize(aval: Any) -> int:
    return dtype_itemsize(aval.dtype)
