"""Peak live bytes per device: a liveness walk over the top-level program, from each value's layout.

What ``ProgramReport.peak_bytes`` reports, and what the planner's memory budget
is built on (``einshard.planner.combining``).  Checked against XLA's buffer
assignment (``compiled.memory_analysis()``: arguments + outputs + temporaries)
on the corpus (tests/test_explain_corpus.py).  It models what XLA does with
buffers, not just what the jaxpr names:

* **inlining**: nested calls (``jit``: ``jax.nn.log_softmax``, ``take_along_axis``;
  custom derivatives; remat) are inlined, as XLA inlines them before it fuses;
  a placement that keeps its value's layout (``auto_axes``' reshards) is its
  operand's buffer; a scan adds one iteration's buffers (its body's temporaries,
  each stacked input's slice and that slice's gathered copy) to the loop's
  operands and results, a while loop its body's temporaries; branches count
  through their inputs and outputs;
* **fusion**: a value made by an elementwise op and read once, by an elementwise
  op, a broadcast, a reshape or a reduction, never gets a buffer (XLA fuses the
  chain into one loop); the buffers it reads are held until that loop runs.  Read
  more than once, it fuses too where all its readers end in one loop (XLA fuses
  consumers first); a reduction over size-1 axes only is a reshape (a bitcast); a
  matrix transpose read only by dots is folded into them (their dimension numbers);
* **in place**: an elementwise result, a scatter's or an update's, is written
  into an operand's buffer of the same size that dies there (buffer
  assignment's operand sharing), and ``A + scatter(0, i, u)`` is a scatter
  into ``A``;
* **transposed dot operands**: an elementwise result read only by a dot
  that needs it transposed is written transposed by its producer's fusion
  (no copy beside it, never in place); read as it is by another dot too, it is
  written both ways by two fusions made together (a hidden layer's cotangent);
  a weight is copied once before the first dot that needs it transposed and held
  to the last (:meth:`_Program._copy_transposed`);
* **gathered arguments**: an argument the walk all-gathered (an FSDP weight)
  is gathered by XLA at the start of the step, and the gathered copy held to
  the argument's last use, a buffer of its own beside the argument's shard
  (one gathered along a dimension other than its major one is transposed
  before and after the all-gather: held twice more while it is gathered); so is
  a value made from one argument alone (a weight's transpose, cast or
  reshape: a view of it, gathered in the argument's place: :func:`_from_arguments`);
* **all-reduces**: XLA:CPU's all-reduce writes a new buffer, so a partial sum and its
  sum are both live while it runs (a data-parallel scan's weight gradients, summed
  in each backward iteration);
* **reduce-scatters**: XLA:CPU has none: a sum that lands split finer than its partial is all-reduced whole and
  sliced after, so the whole partial and the whole sum are live together (:func:`_whole_sum_beside`); a dot
  operand held whole along a dimension the result splits is sliced into a buffer of its own first
  (:func:`_sliced_operand`);
* **all-to-alls**: XLA:CPU moves an operand by an all-to-all of one piece per device:
  its send pieces and its receive pieces (each the operand's shard) are live while it
  runs, besides the operand and the op's result;
* **random bits**: a ``random_bits`` result is the two u32 state words per element of XLA:CPU's threefry
  loop, read by the fusion that consumes the bits (no buffer of its own; an output's buffer is that fusion's
  result), with the loop's temporaries while it runs (:func:`_loop_bytes`); bits made from the key alone are
  made at the start of the step, their words held to their reader (:func:`_random_bits`); rbg's bits hold
  nothing of their own (XLA:CPU expands RngBitGenerator into their reader's loop).  This is the one model of
  the bits' bytes: :data:`HASH_SCRATCH` is split's and fold_in's;
* **combined sums**: a partial sum whose reduced value only leaves the
  program (a gradient's all-reduce) waits for XLA's all-reduce combiner,
  which issues the step's independent all-reduces together once the last
  partial is made: the partial buffers stay live until then and are freed
  after it; a lone one (nothing to combine with) is all-reduced right after
  the step that makes it, and its partial freed there.

The walk tells this module about the last four by binding, next to each value's
layout, the layout of its gathered copy (``layouts[Gathered(v)]``) and of its
pending partial sum (``layouts[Partial(v)]``), and of an operand the equation making
``v`` moves by an all-to-all (``layouts[Sent(v)]``) (see :mod:`.walker` and the
``dot_general``/reduction rules); about the first, by keeping the environment
of each nested call it walked into (``Walker.sub_envs``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core.layout import Layout
from ..cost import ReduceScatter, Tiling, buffer_bytes
from .costing import is_free
from .peak_summary import Steps, Stretch, Summary, SummaryMemo, fold, fold_runs, stretches
from .registry import sub_jaxpr
from .values import (
    DOT_GATHERED,
    ELEMENTWISE,
    PLACEMENTS,
    REDUCTIONS,
    Derived,
    Gathered,
    Partial,
    Sent,
    dtype_itemsize,
)

__all__ = [
    "peak_bytes",
    "peak_caveat",
    "PeakCache",
    "SCRATCH",
    "window_scratch",
    "dot_scratch",
    "HASH_SCRATCH",
    "hash_scratch",
]


# Ops XLA fuses into one loop with their elementwise producers (loop and input fusion), with the reductions
# (values.REDUCTIONS).
_FUSING_SHAPE_OPS = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "tile"}
# Ops that read or write whole buffers, or leave the loop (scans, cumulative ops, random bits).
_NOT_FUSED = {
    "cumsum",
    "cumlogsumexp",
    "cummax",
    "cummin",
    "cumprod",
    "random_bits",
    "threefry2x32",
    "optimization_barrier",
}
# Ops that write their first operand's buffer in place when it dies there (XLA's in-place scatter and update).
_UPDATES_IN_PLACE = {"scatter-add", "scatter_add", "scatter", "scatter-sub", "scatter_sub", "dynamic_update_slice"}
_ADDS = {"add", "add_any"}
# Ops that bring a value to a named layout: the same buffer when the layout does not change.
# Loops whose body the walk kept (rules_control.scan): one iteration's buffers count on top of the loop's.
_LOOPS = {"scan", "while"}


def _slices_of_arguments_first(eqns: Sequence[Any], is_argument: Callable[[Any], bool]) -> list[Any]:
    """Equations in the order XLA:CPU's scheduler runs them as far as buffers go: a static slice of one of the
    program's arguments (a layer's weights ``w[i]`` of a stacked ``w``), with the views and placements of the
    argument it reads, first; then the rest in program order (in a call's body, which XLA inlines: first in the
    body; an ``auto_axes`` program is one such call, its arguments resharded first).

    XLA copies such a slice into a buffer of its own (``slice_bitcast_fusion``) and, as it reads nothing the step
    computes, schedules it at the step's start, as it does an argument's gathers (:func:`_from_arguments`): every
    layer's slice is live from there to its last reader.  Measured on the forward of Python loops over stacked
    weights (the unrolled decoder's ``params[i]``; tests/test_memory_property.py's ``stacked`` structures): the walk,
    slicing each layer where it runs, held 0.63-0.68x XLA's peak at 4 layers."""
    made_by: dict[Any, Any] = {}  # an argument's view -> the equation making it
    for e in eqns:
        ins = [v for v in e.invars if not hasattr(v, "val")]
        if (
            len(ins) == 1
            and len(e.outvars) == 1
            and (e.primitive.name in _VIEWS or e.primitive.name in PLACEMENTS)
            and (ins[0] in made_by or is_argument(ins[0]))
        ):
            made_by[e.outvars[0]] = e
    moved: set[int] = set()
    for e in eqns:
        if e.primitive.name == "slice" and e.outvars[0] in made_by:
            todo = [e]
            while todo:  # the slice and the views it reads, back to the argument
                m = todo.pop()
                if id(m) not in moved:
                    moved.add(id(m))
                    todo.extend(made_by[v] for v in m.invars if not hasattr(v, "val") and v in made_by)
    if not moved:
        return list(eqns)
    return [e for e in eqns if id(e) in moved] + [e for e in eqns if id(e) not in moved]


def _loop_body(eqn: Any) -> Any:
    """The jaxpr a call or a loop runs each time (a while loop's body; its condition holds scalars)."""
    return eqn.params["body_jaxpr"] if eqn.primitive.name == "while" else sub_jaxpr(eqn)


def _step_name(eqn: Any) -> str:
    """The op the memory walk treats ``eqn`` as: its primitive, but a reduction over size-1 axes only is a reshape.

    XLA's algebraic simplifier rewrites such a reduce as a reshape, a bitcast of its operand (the gradient of
    ``expand_dims(x, 0) * ones((n, ...))`` sums the cotangent over the size-1 axis: measured, no buffer of its
    own, the result written where its operand was)."""
    name = eqn.primitive.name
    if name in REDUCTIONS and name not in ("argmax", "argmin"):
        shape = getattr(eqn.invars[0].aval, "shape", None)
        axes = eqn.params.get("axes")
        if shape is not None and axes is not None and all(int(shape[a]) == 1 for a in axes):
            return "reshape"
    return name


# Ops XLA:CPU's instruction fusion may duplicate into each fusion that reads them (CpuInstructionFusion's
# IsExpensive is false for them: adds, products, comparisons, selects, conversions, moves of elements); every other
# op (tanh, exp, rsqrt, a float division, ...) is computed once, its result a buffer its readers share.  A name
# maps to a test of the equation where its cost turns on its parameters.
_CHEAP: dict[str, Callable[[Any], bool]] = {
    **dict.fromkeys(
        (
            "add",
            "add_any",
            "sub",
            "mul",
            "max",
            "min",
            "neg",
            "abs",
            "sign",
            "floor",
            "ceil",
            "round",
            "select_n",
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
            "square",  # a multiply
            "copy",
            "copy_p",
            "clamp",
            "is_finite",
            "reduce_precision",
            "real",
            "imag",
            "stop_gradient",
            "pjit_identity",
            "shift_left",
            "shift_right_logical",
            "shift_right_arithmetic",
            "population_count",
            "bitcast_convert_type",
            "broadcast_in_dim",
            "reshape",
            "squeeze",
            "expand_dims",
            "transpose",
            "iota",
        ),
        lambda eqn: True,
    ),
    # A division by a constant is a product by its inverse (XLA's algebraic simplifier: measured, ``x / 3.0`` is a
    # multiply in the compiled HLO); by a computed value it is expensive.
    "div": lambda eqn: hasattr(eqn.invars[1], "val"),
    # x ** n for n >= 0 is a chain of multiplies; a negative n divides (expensive).
    "integer_pow": lambda eqn: int(eqn.params.get("y", -1)) >= 0,
    # f32 -> bf16 checks for NaNs (expensive); any other conversion is a shift or a cast.
    "convert_element_type": lambda eqn: (
        not (
            str(eqn.params.get("new_dtype")) == "bfloat16"
            and str(getattr(eqn.invars[0].aval, "dtype", "")) == "float32"
        )
    ),
}


def _is_cheap(eqn: Any) -> bool:
    """Whether XLA:CPU may recompute ``eqn``'s result in each fusion that reads it (:data:`_CHEAP`)."""
    test = _CHEAP.get(eqn.primitive.name)
    return test is not None and test(eqn)


def _literals(eqn: Any) -> tuple[tuple[Any, ...], ...]:
    """The constants XLA broadcasts for ``eqn``'s scalar literals: (value, dtype, the result's shape) each, for an
    elementwise equation (``max x 0.0``) or a broadcast of a literal (``broadcast_in_dim 0.0``).  XLA writes each
    as one broadcast of a constant, and its CSE makes the broadcasts of one value to one shape one instruction
    (:func:`_shared_constants`)."""
    name = eqn.primitive.name
    if (name not in _FUSIBLE_ELEMENTWISE and name != "broadcast_in_dim") or len(eqn.outvars) != 1:
        return ()
    shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    if not shape:
        return ()  # a scalar result: nothing is broadcast
    out = []
    for v in eqn.invars:
        val = getattr(v, "val", None)
        if val is None or getattr(v.aval, "shape", None) != ():
            continue
        out.append((np.asarray(val).item(), str(v.aval.dtype), shape))
    return tuple(out)


def _fusible_elementwise() -> frozenset[str]:
    # tile is a broadcast to (repeats, size) and a reshape in XLA: fused as a broadcast is.  A reshape, squeeze
    # or expand_dims is a bitcast of its operand, computed inside its one reader's fusion as XLA does (the
    # gradient of a tile or a broadcast: the cotangent reshaped to (repeats, size) and summed, one fusion).
    # A bitcast_convert_type (the uniform's u32 -> f32 of random bits) is elementwise in XLA's loop fusion too
    # (measured: bernoulli of rbg keys[16@a] holds no u32 or f32 buffer of the bits, XLA:CPU: 420 B in all).
    # A pad is a loop op too: the gradient of a Python loop over a stacked weight's rows (``w[i]``) pads each
    # layer's gradient into the stack and sums the pads, and XLA:CPU computes that whole chain as one loop fusion
    # reading the layers' gradients (``pad_add_fusion``), with no stack-sized buffer per layer.  Held as buffers,
    # the pads all lived to the chain's end: peak grew as the square of the depth (16 layers: 4.3x XLA's, 32:
    # 7.8x; tests/test_memory_rules.py).
    return frozenset(ELEMENTWISE - _NOT_FUSED) | {
        "bitcast_convert_type",
        "broadcast_in_dim",
        "iota",
        "tile",
        "reshape",
        "squeeze",
        "expand_dims",
        "pad",
    }


_FUSIBLE_ELEMENTWISE = frozenset(ELEMENTWISE - _NOT_FUSED)


def _fusing() -> frozenset[str]:
    return frozenset(_FUSING_SHAPE_OPS | REDUCTIONS)


# A value of the flattened program: a top-level jaxpr variable, or (call path, variable) inside a nested call.
Key = Any


@dataclass(frozen=True)
class _Broadcast:
    """The broadcast XLA makes of an operand an elementwise equation reads with size-1 dimensions (a jaxpr's
    implicit broadcasting, ``mul x:f32[8,16,32] g:f32[1,1,32]``): an HLO broadcast of its own, one per operand and
    shape (XLA's CSE), laid out as ``like`` (the first reader's result, of its shape).  Fused into loop fusions as
    any broadcast; a YNNPACK fusion reads it materialised (measured: a LayerNorm's scale and its ``rsqrt``
    broadcast to the activations' shape, held from the forward to the backward's reductions on keras_vit)."""

    of: Key
    shape: tuple[int, ...]
    like: Key = field(compare=False, hash=False)

    @property
    def aval(self) -> Any:
        return _aval(self.like)


@dataclass(frozen=True)
class _Transposed:
    """The transposed copy XLA:CPU writes of a dot operand out of its canonical order (:func:`dot_scratch`) when
    other steps read the operand too: a buffer of its own, laid out as ``like`` and made by a fusion of its own
    beside the operand's (:meth:`_Program._copy_transposed`)."""

    like: Key

    @property
    def aval(self) -> Any:
        return _aval(self.like)


# Keys laid out as another value (their ``like``): a broadcast as its first reader's result, a transposed copy as
# the value it copies.
_LAID_AS_ANOTHER = (_Broadcast, _Transposed)


@dataclass(frozen=True)
class _Step:
    """One equation of the program with its nested calls inlined: operands and results as keys."""

    name: str
    ins: tuple[Key, ...]
    outs: tuple[Key, ...]
    inside: int = 0  # a loop's: the bytes one iteration holds besides the loop's operands and results
    cheap: bool = False  # XLA:CPU would recompute it in each fusion reading it (_is_cheap)
    # The scalar literals it reads, each as the constant XLA broadcasts to its result's shape (:func:`_literals`).
    literals: tuple[tuple[Any, ...], ...] = ()


class _Program:
    """The top-level jaxpr with the nested calls the walk entered (jit, custom derivatives, remat) inlined.

    XLA inlines them before it fuses, so a nested ``jax.nn.log_softmax`` or ``take_along_axis``
    fuses with its caller's ops; counting a call through its inputs and outputs only kept its
    results (and the caller's values around it) as buffers XLA never makes.  ``inner`` holds the
    environments of the calls the walker entered, by call path (``Walker.sub_envs``); a call not
    in it (a scan, a loop, a branch) stays one opaque step.
    """

    def __init__(
        self,
        jaxpr: Any,
        layouts: dict[Any, Layout],
        inner: dict[tuple[int, ...], dict[Any, Layout]],
        reuse: bool = False,
        body: bool = False,
        absorb: bool = True,
        slices_first: bool = True,
        dot_copies: bool = True,
    ):
        self.jaxpr, self.layouts, self.inner = jaxpr, layouts, inner
        self.body = body  # a loop's body: its arguments are the loop's buffers and slices (_absorb_transposes)
        # XLA:CPU copies a static slice of an argument and runs it first (_slices_of_arguments_first); the TPU
        # compiler reads it in place (a 4-layer loop over stacked weights: temporaries 0 B).
        self.slices_first = slices_first
        # XLA:CPU copies a dot operand out of its canonical order into a transposed buffer, and a piece of one the
        # result splits finer into a buffer of its own (dot_scratch); the TPU compiler lays the operand out for its
        # dot and reads the piece in place (no copy: peak_bytes).
        self.dot_copies = dot_copies
        self.alias: dict[Key, Key | None] = {}  # a call's inputs and results -> the values they are
        self.gathered: dict[Key, Layout] = {}  # arguments gathered inside a call, by the argument
        self.steps: list[_Step] = []
        # What of the flattening the layouts decided, so that another costing can reuse it (:meth:`holds`,
        # :meth:`rebound`): each placement's keep-or-copy test (the value, its environment's path, the
        # placement's result, the answer), each gathered copy's source (in the order met: the larger wins, the
        # first among equals), and each loop step (its one iteration's bytes are the layouts').
        self.placements: list[tuple[Key, tuple[int, ...], Any, bool]] = []
        self.copies: list[tuple[Key, tuple[int, ...], Any]] = []
        self.loops: list[tuple[int, Any, Any, tuple[int, ...]]] = []
        # Steps whose scratch bytes the layouts size (window_scratch): (step index, equation, call path).
        self.windows: list[tuple[int, Any, tuple[int, ...]]] = []
        # The window steps' scratch by what it read (:meth:`_scratch`), and, with ``reuse`` (a PeakCache's
        # flattening), each loop body's flattenings and stretch summaries (:meth:`_iteration`), kept across
        # costings (a rebound and an absorbed variant share them); without, a loop's body is flattened and walked
        # whole each time.
        self.scratch_memo = _ScratchMemo()
        self.fixed_scratch: set[int] = set()  # window steps whose scratch read no layout: never sized again
        # By dot step: the operands (0 lhs, 1 rhs) whose transposed copy XLA writes in their producer's fusion
        # (:meth:`_absorb_transposes`): no scratch of their own.
        self.absorbed: dict[int, frozenset[int]] = {}
        self.written_transposed: set[Key] = set()  # those operands: each a buffer of its own (never in place)
        # The arguments dots read through a transposed copy made before the first (:meth:`_copy_transposed`), and
        # each dot operand tested for one with whether it was gathered then (:meth:`_ungathered`).
        self.copied_args: list[Key] = []
        self.gather_tested: list[tuple[tuple[int, ...], Any, bool]] = []
        # Each copy's place in ``copies`` by the (call path, value) whose Gathered layout it reads (made once).
        self.copy_at: dict[tuple[tuple[int, ...], Any], list[int]] | None = None
        self.resized: dict[tuple[int, int], _Step] = {}  # steps with another costing's scratch (shared)
        self.window_rows: Any = None  # (:meth:`_window_rows`)
        self.derived: list[tuple[tuple[int, ...], Derived, Layout]] | None = None  # (bound_derived)
        self.loop_cache = PeakCache() if reuse else None
        self.liveness: dict[Any, _Liveness] = {}  # by the free-ness of the in-place bases it tested
        self.stretches: dict[Any, tuple[Stretch, ...]] = {}  # its steps cut for peak_summary, by liveness
        self.sizings: dict[Any, _Sizing] = {}  # where each stretch's buffers' layouts are read (_sizing_of)
        self.made_broadcasts: set[_Broadcast] = set()  # (_broadcasts)
        # What costings ask of the steps' names and operands alone (the same for every rebound, which keeps them;
        # an absorbed variant's steps are its own): the float reductions YNNPACK may run (:func:`_ynn_reductions`).
        self.step_facts: dict[str, Any] = {}
        # By liveness and partial sums: those alone; by liveness and a pair of steps: whether one feeds the other
        self.lone_sums: dict[Any, Any] = {}  # (_lone_sums)
        # A loop body's values made from its constants alone (:func:`_invariant_keys`), found once per body: a list
        # shared by the rebounds (the flattening's), holding one tuple once found.
        self.invariant_memo: list[tuple[tuple[Key, bool], ...]] = []
        self.args = [v for v in jaxpr.invars if not hasattr(v, "val")]
        self.arg_set = frozenset(self.args)  # (what _slices_of_arguments_first asks of each call body's operands)
        self._flatten(jaxpr, ())
        self.outputs: dict[Key, Any] = {}  # resolved output -> the program's output variable (its layout)
        for v in jaxpr.outvars:
            k = self.key(v, ())
            if k is not None:
                self.outputs.setdefault(k, v)
        self.bases = _in_place_bases(self)  # whose free-ness decides what fuses (the liveness' key)
        if absorb:  # (a PeakCache keeps one unabsorbed: each answer of the gathered tests absorbs a rebound of it)
            self._absorb_transposes()

    def absorbed_variant(self, layouts: dict[Any, Layout], inner: dict[tuple[int, ...], dict[Any, Layout]]) -> _Program:
        """This flattening, made without :meth:`_absorb_transposes` (``absorb=False``), read under ``layouts`` and
        ``inner`` (for which :meth:`holds`) and then absorbed there: the program ``_Program(jaxpr, layouts, inner)``
        makes, without flattening the jaxpr again.

        Which dot operands are read through a transposed copy turns on whether the walk gathered them
        (:meth:`_ungathered`): a search that moves a weight between split and gathered makes a flattening per
        answer.  The steps before the copies (the inlined calls, the aliases, the placements' answers) are the
        same for every answer: they are made once, and each answer only absorbs its copies into a rebound of
        them.  What absorbing writes is the variant's own (the rebound shares the rest, read only)."""
        other = self.rebound(layouts, inner)
        other.steps = list(other.steps)  # (absorbing resizes and inserts steps)
        other.fixed_scratch = set(self.fixed_scratch)
        other.absorbed = dict(self.absorbed)
        other.written_transposed = set(self.written_transposed)
        other.copied_args = list(self.copied_args)
        other.gather_tested = list(self.gather_tested)
        other.resized = {}
        other.liveness, other.stretches, other.sizings, other.lone_sums = {}, {}, {}, {}
        other.step_facts = {}
        other._absorb_transposes()
        return other

    def _absorb_transposes(self) -> None:
        """Find the dots whose transposed operand XLA writes transposed in the first place, and size them so.

        A dot_general operand out of XLA:CPU's canonical order is copied transposed first (:func:`dot_scratch`);
        where that operand is an elementwise result read by this dot only, the copy is a loop op XLA fuses into
        its producer's loop fusion: the fusion writes the transposed operand and nothing else, so the copy is
        the operand's one buffer, not scratch beside it.  Measured on the data-parallel gradient of a dense
        layer, ``grad(lambda w, x: mean((x @ w) ** 2))`` (x ``f32[8,16,32]`` split on its batch over 4 devices):
        XLA:CPU's ``copy_bitcast_fusion`` computes the cotangent ``f32[64,32]`` already transposed, one 8 KiB
        buffer where the walk held the cotangent and its copy (tests/test_memory_rules.py).  A transposed write
        is never in place: that fusion's result is a buffer beside its operands (the walk's ``donors``), as
        XLA's is beside the forward's product it reads (on a (2, 2, 2) mesh, both in its temporaries)."""
        elementwise = frozenset(ELEMENTWISE - _NOT_FUSED)
        reads: dict[Key, int] = {}
        producer: dict[Key, int] = {}
        for i, step in enumerate(self.steps):
            for k in step.ins:
                reads[k] = reads.get(k, 0) + 1
            for k in step.outs:
                producer[k] = i
        args = set(self.args)
        # Each dot: its step, equation, call path, operands' keys and the operands it reads out of canonical order.
        dots: list[tuple[int, Any, tuple[int, ...], list[Key | None], tuple[int, ...]]] = []
        read_as_is: set[Key] = set()  # operands a dot reads in their own order
        for i, eqn, path in self.windows:
            if eqn.primitive.name == "dot_general":
                keys = [self.key(v, path) for v in eqn.invars[:2]]
                transposed = _copied_operands(eqn) if self.dot_copies else ()
                dots.append((i, eqn, path, keys, transposed))
                read_as_is.update(k for p, k in enumerate(keys) if p not in transposed)
        copied: dict[int, frozenset[int]] = {}  # by dot step: its operands read through a _Transposed copy
        for i, eqn, path, keys, transposed in dots:
            made = [k is not None and k not in args and k not in self.outputs and k in producer for k in keys]

            # (An operand the walk gathers for this dot is copied as gathered: its dot's scratch, as before.)
            # (Tested last, only where the answer decides: each test is noted for :meth:`holds`, and a test whose
            # answer changes nothing would split the planner's cache of flattenings for nothing.)
            def whole(p: int, path: tuple[int, ...] = path, eqn: Any = eqn) -> bool:
                return self._ungathered(path, eqn.invars[p])

            # (Any operand so made and read is a write of that fusion's, in the dot's order or not: never in place.)
            absorbed = frozenset(
                p
                for p in range(2)
                if made[p] and reads.get(keys[p]) == 1 and self.steps[producer[keys[p]]].name in elementwise
            )
            # Read by another dot in its own order too (a buffer whatever else reads it), made by a cheap loop op's
            # fusion (a transpose is a loop op too: the fusion writing it is its elementwise operand's).  (Read by
            # loop ops besides, its readers' fusions may compute it: not measured, the dot's scratch as before.)
            shared = frozenset(
                p
                for p in transposed
                if made[p]
                and p not in absorbed
                and keys[p] in read_as_is
                and self.steps[producer[keys[p]]].cheap
                and self.steps[producer[keys[p]]].name in elementwise | {"transpose"}
                and whole(p)
            )
            # An argument (a weight) copied into the dot's order: one copy, made from the argument alone before the
            # first dot reading it so, held to the last (:meth:`_copy_transposed`).  Not a loop body's (a layer's
            # slice of stacked weights): a copy beside the slice overstated flax_scan's dp gradient (324096 B; the
            # walk without it 307712 B, XLA 289488 B).
            weights = frozenset(p for p in transposed if keys[p] in args and not self.body and whole(p))
            shared |= weights
            if shared:
                copied[i] = shared
            if absorbed or shared:
                self.absorbed[i] = absorbed | shared
                self.written_transposed.update(keys[p] for p in absorbed)
        if copied:
            self._copy_transposed(copied, producer)
        for i, eqn, path in self.windows:
            if i in self.absorbed:
                self.fixed_scratch.discard(i)
                self._resize(i, self._scratch(i, eqn, self.env(path)))

    def _copy_transposed(self, copied: dict[int, frozenset[int]], producer: dict[Key, int]) -> None:
        """Read each dot operand of ``copied`` (by dot step, its operands) through a :class:`_Transposed` copy,
        made by a step right after the operand's producer from that producer's operands (an argument's: right
        before the first dot reading it so, from the argument).

        An operand out of XLA:CPU's canonical order that other steps read too (the cotangent of a hidden layer,
        read by the dot that carries it back and by the one that makes the weight's gradient) is not written
        transposed in the first place: layout assignment copies it transposed for the dot, and instruction
        fusion, its producer cheap (a product, a sum), duplicates the producer into that copy.  Two fusions
        from the same operands, scheduled together: the operand and its transposed copy are two buffers, made
        before either dot runs, and the producer's operands are held until both are made.  Measured on the
        expert-parallel gradient of a SwiGLU expert MLP (XLA:CPU's ``multiply_bitcast_fusion`` and
        ``copy_bitcast_fusion.5`` write the up projection's cotangent f32[64,64] and its transpose from the same
        operands; both, the gate's pair and the forward's three products live at the peak;
        tests/test_memory_rules.py); the walk had held the copy only while the weight-gradient dot ran.  (An
        operand read by this dot alone is written transposed by its producer: ``absorbed`` above.)

        An argument's copy is one buffer every dot reading the argument so shares (CSE), held from the first to
        the last: on that MLP the gate and up weights' copies (``copy_bitcast_fusion.12/.13``, read by the
        forward's dots and the backward's) live at the peak; on kh_llama's dp forward one copy read by one dot
        is made right before it (exact, as the dot's scratch was).  XLA's scheduler may make it earlier (the
        one-layer repro in tests/test_memory_rules.py: at the start), which the walk does not follow."""
        made: dict[Key, _Transposed] = {}
        after: dict[int, list[_Step]] = {}  # by producer step: the copies made right after it
        before: dict[int, list[_Step]] = {}  # by dot step: the arguments' copies made right before it
        dots: dict[int, _Step] = {}
        windows = {i: (eqn, path) for i, eqn, path in self.windows}
        for i, positions in copied.items():
            eqn, path = windows[i]
            ins = []
            for p, v in enumerate(eqn.invars):
                k = self.key(v, path)
                if k is None:
                    continue
                if p in positions:
                    t = made.get(k)
                    if t is None:
                        t = made[k] = _Transposed(k)
                        self.written_transposed.add(t)
                        if k in producer:
                            j = producer[k]
                            after.setdefault(j, []).append(_Step("copy", self.steps[j].ins, (t,)))
                        else:
                            before.setdefault(i, []).append(_Step("copy", (k,), (t,)))
                            self.copied_args.append(k)
                    k = t
                ins.append(k)
            dots[i] = dataclasses.replace(self.steps[i], ins=tuple(ins))
        # The new steps shift every later step: renumber what the flattening noted by step.
        moved: dict[int, int] = {}
        steps: list[_Step] = []
        for i, step in enumerate(self.steps):
            steps.extend(before.get(i, ()))
            moved[i] = len(steps)
            steps.append(dots.get(i, step))
            steps.extend(after.get(i, ()))
        self.steps = steps
        self.windows = [(moved[i], eqn, path) for i, eqn, path in self.windows]
        self.loops = [(moved[i], eqn, sub, sub_path) for i, eqn, sub, sub_path in self.loops]
        self.absorbed = {moved[i]: ps for i, ps in self.absorbed.items()}
        self.fixed_scratch = {moved[i] for i in self.fixed_scratch}
        self.resized = {}

    def _ungathered(self, path: tuple[int, ...], v: Any) -> bool:
        """Whether the walk binds no gathered copy of ``v`` (of the call at ``path``) under these layouts (noted,
        for :meth:`holds`: a rebound under other layouts must answer alike)."""
        gathered = self.env(path).get(Gathered(v)) is not None
        self.gather_tested.append((path, v, gathered))
        return not gathered

    def key(self, v: Any, path: tuple[int, ...]) -> Key | None:
        if hasattr(v, "val"):
            return None
        k = (path, v) if path else v
        while k in self.alias:
            k = self.alias[k]
            if k is None:
                return None
        return k

    def _flatten(self, jaxpr: Any, path: tuple[int, ...]) -> None:
        eqns = (
            _slices_of_arguments_first(jaxpr.eqns, lambda v: self.key(v, path) in self.arg_set)
            if self.slices_first
            else jaxpr.eqns
        )
        for eqn in eqns:
            sub_path = (*path, id(eqn))
            sub = _loop_body(eqn) if sub_path in self.inner else None
            if sub is None and self._keeps_buffer(eqn, path):
                continue
            if sub is not None and eqn.primitive.name in _LOOPS:
                ins = tuple(k for k in (self.key(v, path) for v in eqn.invars) if k is not None)
                outs = tuple(k for k in (self.key(v, path) for v in eqn.outvars) if k is not None)
                self.loops.append((len(self.steps), eqn, sub, sub_path))
                self.steps.append(_Step(eqn.primitive.name, ins, outs, self._iteration(eqn, sub, sub_path)))
                continue
            if sub is None:
                ins = tuple(k for k in (self.key(v, path) for v in eqn.invars) if k is not None)
                outs = tuple(k for k in (self.key(v, path) for v in eqn.outvars) if k is not None)
                if len(outs) == 1 and eqn.primitive.name in _FUSIBLE_ELEMENTWISE:
                    ins = self._broadcasts(ins, outs[0])
                env = self.inner[path] if path else self.layouts
                if eqn.primitive.name in (
                    "select_and_scatter_add",
                    "dynamic_update_slice",
                    "dot_general",
                ):  # sized by the layouts: a reuse under other layouts sizes it again (rebound)
                    self.windows.append((len(self.steps), eqn, path))
                    scratch = self._scratch(len(self.steps), eqn, env)
                else:
                    scratch = window_scratch(eqn, env, dot_copies=self.dot_copies)
                self.steps.append(_Step(_step_name(eqn), ins, outs, scratch, _is_cheap(eqn), _literals(eqn)))
                continue
            body = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            operands = eqn.invars[len(eqn.invars) - len(body.invars) :]
            env = self.inner[sub_path]
            for iv, ov in zip(body.invars, operands):
                outer = self.key(ov, path)
                self.alias[(sub_path, iv)] = outer
                if outer is not None:
                    self.copies.append((outer, sub_path, iv))
                    self._note_copy(outer, env.get(Gathered(iv)))
            self._flatten(body, sub_path)
            for ov, iv in zip(eqn.outvars, body.outvars):
                self.alias[(path, ov) if path else ov] = self.key(iv, sub_path)

    def _broadcasts(self, ins: tuple[Key, ...], out: Key) -> tuple[Key, ...]:
        """``ins`` with each operand the equation broadcasts implicitly (size-1 dimensions of the result's rank)
        read through its :class:`_Broadcast`, a step made before its first reader."""
        shape = tuple(int(d) for d in getattr(_aval(out), "shape", ()))
        n = math.prod(shape)
        read = []
        for k in ins:
            kshape = tuple(int(d) for d in getattr(_aval(k), "shape", ()))
            if len(kshape) != len(shape) or kshape == shape or math.prod(kshape) <= 1 or math.prod(kshape) >= n:
                read.append(k)
                continue
            b = _Broadcast(k, shape, out)
            if b not in self.made_broadcasts:
                self.made_broadcasts.add(b)
                self.steps.append(_Step("broadcast_in_dim", (k,), (b,), 0, True))
            read.append(b)
        return tuple(read)

    def _iteration(self, eqn: Any, sub: Any, sub_path: tuple[int, ...]) -> int:
        """The bytes one iteration of a scan holds on top of the loop's operands and results.

        XLA's while loop runs its body in the loop's own buffers: the carry in and out, the
        consts and the stacked inputs and outputs are the loop's operands and results (counted
        outside).  Each iteration's slice of a stacked input is a buffer of its own when a
        non-fused op reads it (measured: a dot reading one layer of stacked weights makes XLA
        copy the layer), gathered to its whole when the walk all-gathered it (an FSDP layer),
        and the body's temporaries live as a program's do.
        """
        from .rules_control import scan_counts

        body = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        # A while loop's body reads only its consts and carry, the loop's own buffers.
        n_consts, n_carry = scan_counts(eqn.params) if eqn.primitive.name == "scan" else (0, len(body.invars))
        env = self.inner[sub_path]
        nested = {
            p[len(sub_path) :]: e for p, e in self.inner.items() if p[: len(sub_path)] == sub_path and p != sub_path
        }
        cache = self.loop_cache
        inner = (
            _Program(body, env, nested, body=True, slices_first=self.slices_first, dot_copies=self.dot_copies)
            if cache is None
            else cache.program(body, env, nested, True, self.slices_first, self.dot_copies)
        )
        elsewhere = frozenset(inner.key(v, ()) for v in body.invars[: n_consts + n_carry])
        # The values the body makes from its constants alone are made before the loop and held across it (_hoisted).
        consts = body.invars[: n_consts if eqn.primitive.name == "scan" else int(eqn.params["body_nconsts"])]
        made_before, held = _hoisted(inner, env, body, consts)
        memo = None if cache is None else cache.summaries
        return held + _peak(inner, env, elsewhere=elsewhere | made_before, results_elsewhere=True, memo=memo)

    def _summed(self) -> list[tuple[int, Key, int, int]]:
        """Per all-reduce of this program (a step whose result has a pending partial sum), in program order: its
        step, its result, and the bytes of its partial sum and of its sum."""
        out = []
        fusible = _fusible_elementwise()
        for i, step in enumerate(self.steps):
            for k in step.outs:
                part = self.layout(k, Partial)
                lay = self.layout(k)
                if part is None or lay is None or is_free(lay) or step.name in fusible:
                    continue
                item = dtype_itemsize((k[1] if isinstance(k, tuple) else k).aval.dtype)
                out.append((i, k, math.prod(part.shard_shape) * item, math.prod(lay.shard_shape) * item))
        return out

    def _ancestors(self, i: int) -> set[int]:
        """The steps step ``i`` reads from, transitively."""
        producer = {k: j for j, step in enumerate(self.steps[:i]) for k in step.outs}
        seen: set[int] = set()
        todo = [producer[k] for k in self.steps[i].ins if k in producer]
        while todo:
            j = todo.pop()
            if j not in seen:
                seen.add(j)
                todo.extend(producer[k] for k in self.steps[j].ins if k in producer)
        return seen

    def _keeps_buffer(self, eqn: Any, path: tuple[int, ...]) -> bool:
        """Alias a placement that leaves its value's layout as it was to its operand: XLA makes no copy.

        ``jax.sharding.auto_axes`` reshards every input into its Auto region (and its results back),
        ``jax.lax.with_sharding_constraint`` may name the layout a value already has: each is a new
        jaxpr value but the same buffer (measured: a keras-hub decoder under ``auto_axes`` on an
        Explicit mesh has the same ``memory_analysis()`` as on an Auto mesh).  An FSDP weight's
        gathered copy, bound to the placement's result, is the operand's.
        """
        if eqn.primitive.name not in PLACEMENTS or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
            return False
        (iv,), (ov,) = eqn.invars, eqn.outvars
        src = self.key(iv, path)
        if src is None:
            return False
        kept = self._keeps_layout(src, path, ov)
        self.placements.append((src, path, ov, kept))
        if not kept:
            return False
        self.alias[(path, ov) if path else ov] = src
        self.copies.append((src, path, ov))
        self._note_copy(src, self.env(path).get(Gathered(ov)))
        return True

    def env(self, path: tuple[int, ...]) -> dict[Any, Layout]:
        return self.inner[path] if path else self.layouts

    def _keeps_layout(self, src: Key, path: tuple[int, ...], ov: Any) -> bool:
        before, after = self.layout(src), self.env(path).get(ov)
        return not (before is None or after is None or before.dims != after.dims or before.unreduced != after.unreduced)

    def _note_copy(self, src: Key, copy: Layout | None) -> None:
        """``src``'s gathered copy is ``copy`` where it is larger than the one noted so far."""
        if copy is not None:
            old = self.gathered.get(src)
            if old is None or math.prod(copy.shard_shape) > math.prod(old.shard_shape):
                self.gathered[src] = copy

    # -- reuse between costings ------------------------------------------------
    def holds(self, layouts: dict[Any, Layout], inner: dict[tuple[int, ...], dict[Any, Layout]]) -> bool:
        """Whether flattening this jaxpr under ``layouts`` and ``inner`` would make these steps and aliases:
        the same calls entered (the caller keys by them) and every placement's test answered alike."""
        if inner.keys() != self.inner.keys():
            return False
        other = _Program.__new__(_Program)
        other.layouts, other.inner = layouts, inner
        for path, v, gathered in self.gather_tested:
            if ((inner[path] if path else layouts).get(Gathered(v)) is not None) != gathered:
                return False  # a dot operand copied transposed is gathered now, or the other way round
        return all(other._keeps_layout(src, path, ov) == kept for src, path, ov, kept in self.placements)

    def rebound(self, layouts: dict[Any, Layout], inner: dict[tuple[int, ...], dict[Any, Layout]]) -> _Program:
        """This flattening read under ``layouts`` and ``inner`` (for which :meth:`holds`): the steps, aliases and
        liveness shared, the gathered copies and the loops' iteration bytes theirs."""
        other = _Program.__new__(_Program)
        other.__dict__.update(self.__dict__)
        other.layouts, other.inner, other.gathered = layouts, inner, {}
        other.derived = None
        if self.copy_at is None:
            self.copy_at = {}
            for n, (_, path, v) in enumerate(self.copies):
                self.copy_at.setdefault((path, v), []).append(n)
        # Only the copies whose value has a gathered layout bound note one (in the order met, as _flatten).
        found = {}
        for path, key, lay in other.bound_derived():
            if key.__class__ is Gathered:
                for n in self.copy_at.get((path, key.of), ()):
                    found[n] = lay
        for n in sorted(found):
            other._note_copy(self.copies[n][0], found[n])
        if self.loops or len(self.windows) > len(self.fixed_scratch):
            other.steps = list(self.steps)
            for i, eqn, sub, sub_path in self.loops:
                other._resize(i, other._iteration(eqn, sub, sub_path))
            # The layers of an unrolled stack share their calls' environments (a replayed copy binds its tape's)
            # and, traced alike, their equations: a window's scratch is a function of the two, so it is found
            # once per (environment, equation) in this costing (the objects live while it runs).
            answers: dict[tuple[int, int, frozenset[int] | None], int] = {}
            fixed = self.fixed_scratch
            self.scratch_memo.bound()
            steps = other.steps
            paths, rows = self._window_rows()
            envs = [inner[path] if path else layouts for path in paths]
            env_ids = list(map(id, envs))
            for i, eqn, at, eqn_id, absorbed in rows:
                if i not in fixed:
                    known = (env_ids[at], eqn_id, absorbed)
                    answer = answers.get(known)
                    if answer is None:
                        answer = answers[known] = self._scratch(i, eqn, envs[at])
                    if steps[i].inside != answer:  # (_resize, inlined: thousands of windows per costing)
                        other._resize(i, answer)
        return other

    def _window_rows(
        self,
    ) -> tuple[list[tuple[int, ...]], list[tuple[int, Any, int, int, frozenset[int] | None]]]:
        """The window steps as :meth:`rebound` reads them at each costing: the call paths they read, and by window
        (its step, equation, its path's place in those, the equation's id, its absorbed operands); made once per
        steps' numbering (a rebound shares its flattening's windows and absorbed operands, and so these)."""
        made = self.window_rows
        if made is not None and made[0] is self.windows and made[1] is self.absorbed:
            return made[2], made[3]
        at: dict[tuple[int, ...], int] = {}
        absorbed = self.absorbed
        rows = [(i, eqn, at.setdefault(path, len(at)), id(eqn), absorbed.get(i)) for i, eqn, path in self.windows]
        self.window_rows = (self.windows, self.absorbed, list(at), rows)
        return list(at), rows

    def _resize(self, i: int, inside: int) -> None:
        """Step ``i`` holds ``inside`` bytes of scratch (a new step only where that changes)."""
        if self.steps[i].inside != inside:
            step = self.resized.get((i, inside))
            if step is None:
                step = self.resized[(i, inside)] = dataclasses.replace(self.steps[i], inside=inside)
            self.steps[i] = step

    def bound_derived(self) -> list[tuple[tuple[int, ...], Derived, Layout]]:
        """Every gathered copy, partial sum and moved operand bound in this costing's environments: (the call
        path of its environment, its key, its layout).  A few hundred among a deep model's tens of thousands of
        values: what asks of them goes through these, not through a lookup per value."""
        if self.derived is None:
            # Calls replayed from one tape share its environment: each environment is read once.
            bound: dict[int, list[tuple[Derived, Layout]]] = {}
            self.derived = []
            for path, env in (((), self.layouts), *self.inner.items()):
                found = bound.get(id(env))
                if found is None:
                    found = bound[id(env)] = [(key, lay) for key, lay in env.items() if isinstance(key, Derived)]
                self.derived.extend((path, key, lay) for key, lay in found)
        return self.derived

    def _scratch(self, i: int, eqn: Any, env: dict[Any, Layout]) -> int:
        """:func:`window_scratch` of step ``i`` under ``env``, reused from an earlier answer that read equal layouts
        (a dot in canonical order reads none: its scratch is 0 whatever the layouts).

        ``window_scratch`` is a function of the equation (read only through its primitive, parameters and
        operands' and results' types: :func:`_scratch_form`) and of the layouts it reads; each answer is kept
        with what it read (:class:`_Reads`), named by the equation's own values (the layers of an unrolled stack
        are equations alike on values of their own), and reused for every equation alike where each of those
        reads gives an equal layout now (:class:`_ScratchMemo`)."""
        memo = self.scratch_memo
        absorbed = self.absorbed.get(i, frozenset())
        get, by_object = env.get, memo.by_object
        view = memo.view(eqn, absorbed)
        for at, (keys, answers) in enumerate(view):
            token = []
            for k in keys:  # (loops, not comprehensions: hundreds of dots per costing)
                lay = get(k)
                if lay is None:
                    token.append(-1)
                    continue
                hit = by_object.get(id(lay))
                token.append(memo.number(lay) if hit is None else hit[1])
            answer = answers.get(tuple(token))
            if answer is not None:
                if not keys:
                    self.fixed_scratch.add(i)  # it reads no layout: the same under every costing's
                if at:  # tried first next time: the next layer's equation reads alike (any match is the answer)
                    view.insert(0, view.pop(at))
                return answer
        log = _Reads(env)
        answer = window_scratch(eqn, log, absorbed, self.dot_copies)  # type: ignore[arg-type]  # logged
        if not log.read:
            self.fixed_scratch.add(i)  # it read no layout: the same under every costing's
        memo.keep(eqn, absorbed, log.read, answer)
        return answer

    def layout(self, k: Key, derived: type[Derived] | None = None) -> Layout | None:
        if isinstance(k, _LAID_AS_ANOTHER):
            return None if derived is not None else self.layout(k.like)
        if isinstance(k, tuple):
            path, v = k
            env = self.inner[path]
        else:
            v, env = k, self.layouts
        return env.get(derived(v) if derived is not None else v)


class _ScratchMemo:
    """The window steps' scratch answers (:meth:`_Program._scratch`) by what they read, shared by a flattening,
    its rebounds and its absorbed variants (a function of the equation's form and the layouts read, not of the
    costing).

    A read is named by the equation's own value it reads (its position among the operands and results, and the
    derived buffer of it: a gathered copy, a partial sum), so that equations of one form share answers; a read
    of any other value keys the answer by the equation itself (its own form).  Layouts are numbered: equal
    layouts of one kind (``_same``) are one number."""

    # Bounded: a long search meets new layouts for ever; past this many numbered layouts or kept answers, all
    # are dropped (between costings: :meth:`bound`).
    LIMIT = 50_000

    def __init__(self) -> None:
        # By equation (by identity: the flattening's jaxpr holds them): its form's number and its values in order.
        self.forms: dict[int, tuple[int, tuple[Any, ...]]] = {}
        self.form_numbers: dict[Any, int] = {}  # forms (hashed once per equation), numbered
        self.own: dict[int, int] = {}  # by equation: its own form's number, where an answer read another value
        # By (form, absorbed operands): each set of reads met, with its answers by the layouts read (numbered).
        self.known: dict[tuple[int, frozenset[int]], list[tuple[tuple[Any, ...], dict[tuple[int, ...], int]]]] = {}
        # By (equation, absorbed operands): the answers of its form's entries (and its own), each with the keys
        # its reads are for that equation, how many of those entries it has so, and :attr:`answers` then.
        self.views: dict[
            tuple[int, frozenset[int]], tuple[list[tuple[tuple[Any, ...], dict[Any, int]]], list[int]]
        ] = {}
        self.numbers: dict[tuple[type, Layout], int] = {}  # layouts by kind and value
        # Layouts by object: each held here (its id stays its own), so that a layout met again in a later costing
        # (a replayed layer binds its tape's) is not hashed again.
        self.by_object: dict[int, tuple[Layout, int]] = {}
        self.answers = 0

    def form_of(self, eqn: Any) -> tuple[int, tuple[Any, ...]]:
        """``eqn``'s form, numbered (:func:`_scratch_form`), and its values in order."""
        form, values = _scratch_form(eqn)
        return self.form_numbers.setdefault(form, len(self.form_numbers)), values

    def view(self, eqn: Any, absorbed: frozenset[int]) -> list[tuple[tuple[Any, ...], dict[tuple[int, ...], int]]]:
        """The answers kept for ``eqn``'s form (and for ``eqn`` itself) with ``absorbed``, each with the keys of
        ``eqn`` its reads name (made once per equation and entry)."""
        found = self.views.get((id(eqn), absorbed))
        if found is not None and found[1][2] == self.answers:
            return found[0]  # (no answer kept since it was made)
        if found is None:
            form = self.forms.get(id(eqn))
            if form is None:
                form = self.forms[id(eqn)] = self.form_of(eqn)
            found = self.views[(id(eqn), absorbed)] = ([], [0, 0, -1])
        view, synced = found
        form_no, values = self.forms[id(eqn)]
        own = self.own.get(id(eqn))
        for n, sig in enumerate((form_no, own)):
            if sig is None:
                continue
            entries = self.known.get((sig, absorbed), ())
            for reads, answers in entries[synced[n] :]:
                view.append((_keys_read(reads, values), answers))
            synced[n] = len(entries)
        synced[2] = self.answers
        return view

    def number(self, lay: Layout) -> int:
        """``lay``'s number: equal for layouts equal and of one kind."""
        hit = self.by_object.get(id(lay))
        if hit is None:
            hit = self.by_object[id(lay)] = (lay, self.numbers.setdefault((lay.__class__, lay), len(self.numbers)))
        return hit[1]

    def keep(self, eqn: Any, absorbed: frozenset[int], read: list[tuple[Any, Any]], answer: int) -> None:
        """Keep ``answer``, found for ``eqn`` (with ``absorbed``) by reading ``read`` (keys and layouts, in order)."""
        form = self.forms[id(eqn)]  # (:meth:`view` made it)
        reads = _reads_named(read, form[1])
        sig = form[0]
        if reads is None:  # (it read a value not the equation's: an answer for this equation alone)
            reads = tuple(("key", k) for k, _ in read)
            sig = self.own.get(id(eqn), -1)
            if sig < 0:
                sig = self.own[id(eqn)] = self.form_numbers.setdefault(("own", id(eqn)), len(self.form_numbers))
        token = tuple(-1 if lay is None else self.number(lay) for _, lay in read)
        entries = self.known.setdefault((sig, absorbed), [])
        answers = next((found for known_reads, found in entries if known_reads == reads), None)
        if answers is None:
            answers = {}
            entries.append((reads, answers))
        answers[token] = answer
        self.answers += 1

    def bound(self) -> None:
        """Drop every answer and numbered layout once either passes :attr:`LIMIT`, and the layouts held by object
        once they do (called between costings)."""
        if self.answers > self.LIMIT or len(self.numbers) > self.LIMIT:
            self.known, self.views, self.numbers, self.by_object, self.answers = {}, {}, {}, {}, 0
        elif len(self.by_object) > self.LIMIT:
            self.by_object = {}


def _scratch_form(eqn: Any) -> tuple[Any, tuple[Any, ...]]:
    """What :func:`window_scratch` reads of ``eqn`` but its values' layouts, hashable (equal for the equations
    it answers alike), and the equation's values in order (operands, then results).  An equation with a literal
    operand or unhashable parameters is its own form."""
    values = (*eqn.invars, *eqn.outvars)
    if any(hasattr(v, "val") for v in eqn.invars):
        return ("own", id(eqn)), values
    try:
        params = tuple(sorted(eqn.params.items()))
        form = (eqn.primitive.name, params, tuple(v.aval for v in values), len(eqn.invars))
        hash(form)
    except TypeError:
        return ("own", id(eqn)), values
    return form, values


def _reads_named(read: list[tuple[Any, Any]], values: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """``read``'s keys named by the equation's values (:class:`_ScratchMemo`): ``(position, None)`` for the value
    itself, ``(position, kind)`` for a buffer derived from it; None where one reads any other value."""
    at = {id(v): n for n, v in enumerate(values)}
    out = []
    for k, _ in read:
        if isinstance(k, Derived):
            n = at.get(id(k.of))
            kind: type | None = k.__class__
        else:
            n, kind = at.get(id(k)), None
        if n is None or values[n] is not (k.of if kind is not None else k):
            return None
        out.append((n, kind))
    return tuple(out)


def _keys_read(reads: tuple[Any, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The keys ``reads`` (as :func:`_reads_named` names them) are for the equation whose values are ``values``."""
    out = []
    for n, kind in reads:
        if n == "key":
            out.append(kind)  # (an equation's own form: the key itself)
        else:
            out.append(values[n] if kind is None else kind(values[n]))
    return tuple(out)


class _Reads:
    """A read-only view of an environment that logs each read (key, layout): what an answer depended on."""

    def __init__(self, env: dict[Any, Layout]) -> None:
        self.env = env
        self.read: list[tuple[Any, Any]] = []

    def get(self, key: Any, default: Any = None) -> Any:
        lay = self.env.get(key)
        self.read.append((key, lay))
        return default if lay is None else lay

    def __getitem__(self, key: Any) -> Any:
        lay = self.get(key)
        if lay is None:
            raise KeyError(key)
        return lay

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None


def _same(a: Layout | None, b: Layout | None) -> bool:
    """Equal layouts of the same kind (a free constant's is not a placed value's), or both absent."""
    return a is b or (a is not None and b is not None and type(a) is type(b) and a == b)


def dot_scratch(eqn: Any, env: dict[Any, Layout], absorbed: frozenset[int] = frozenset(), copies: bool = True) -> int:
    """Bytes per device XLA:CPU holds while it runs a dot_general, besides its operands and result: the
    transposed copies of operands not in its canonical order.

    XLA:CPU computes a dot as a batched matrix product of ``[batch..., free..., contracted...]`` by
    ``[batch..., contracted..., free...]`` (its dot decomposer reshapes each operand so); an operand whose
    dimensions are in another order is transposed into a copy first, unless its batch dimensions lead and one
    free and one contracted dimension follow them (the matrix product reads those either way round).  Measured
    on one-op programs (``memory_analysis()``: temp bytes): ``(64, 8, 32)`` with batch dimension 1 copies the
    whole lhs, ``(32, 8, 16)`` with batch dimension 1 the rhs, ``(8, 8, 8, 8)`` contracting (0, 1) or (0, 2) the
    lhs; contracting (2, 3), any 2-D dot, and a ``(16, 16, 12)`` rhs with batch 0 contracting 2, nothing.  A
    narrower float's copy is f32 (computed in f32 on the CPU).  ``absorbed``: the operands (0 lhs, 1 rhs) whose
    producer's fusion writes them transposed (:meth:`_Program._absorb_transposes`): no copy.  ``copies``: whether
    the compiler copies a dot's operands so, transposed or sliced (False: the TPU compiler's, which lays an operand
    out for its dot and reads a slice of it in place, :func:`peak_bytes`): nothing held, no layout read.
    """
    if not copies:
        return 0
    total = 0
    copied = _copied_operands(eqn)
    for k in range(2):
        if k in absorbed:
            continue
        v = eqn.invars[k]
        lay = env.get(Gathered(v)) or env.get(v)
        shape = lay.shard_shape if lay is not None and not is_free(lay) else v.aval.shape
        piece = _sliced_operand(eqn, k, tuple(int(n) for n in shape), env)
        if k in copied:  # (the copy is of the piece: XLA fuses the slice into the transposing copy)
            size = max(dtype_itemsize(v.aval.dtype), 4) if hasattr(v.aval, "dtype") else 4
            total += math.prod(piece or shape) * size
        elif piece is not None:
            total += math.prod(piece) * dtype_itemsize(v.aval.dtype)
    return total


def _sliced_operand(eqn: Any, k: int, shape: tuple[int, ...], env: dict[Any, Layout]) -> tuple[int, ...] | None:
    """The piece of dot operand ``k`` (its block ``shape``) XLA slices out before the dot, where the result splits
    a batch or free dimension finer than the operand holds it (None: none).

    The SPMD partitioner computes each device's block of the result from the matching block of each operand: an
    operand held whole (or split coarser) along a dimension the result splits is dynamic-sliced first, into a
    buffer of its own (a dot fuses no slice).  Measured on Explicit axes, ``einsum('bmk,kn->bmn')`` of a whole
    x[8, 16, 32] and y[32, 8@a] typed [8@c, 16, 8] on (2, 2, 2): XLA holds x's [4, 16, 32] slice beside x (28160 B;
    the walk 19968 B); so at k = 64 and n = 64, and with the result split on n too.  Sized from the result's
    layout as the dot computes it: its partial sum's where it has one (a sum scattered after the dot is not a
    slice of an operand)."""
    out = eqn.outvars[0]
    res = env.get(Partial(out)) or env.get(out)
    if res is None or is_free(res):
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contracted, batch = (lc, lb) if k == 0 else (rc, rb)
    rank = len(shape)
    free = [a for a in range(rank) if a not in contracted and a not in batch]
    # The result's dimensions: the batch ones, then the lhs' free ones, then the rhs'.
    lhs_free = len(eqn.invars[0].aval.shape) - len(lc) - len(lb)
    offset = len(lb) + (0 if k == 0 else lhs_free)
    to_result = {a: n for n, a in enumerate(batch)} | {a: offset + n for n, a in enumerate(free)}
    whole = res.shard_shape
    piece = tuple(min(n, int(whole[to_result[a]])) if a in to_result else n for a, n in enumerate(shape))
    return piece if piece != shape else None


def _copied_operands(eqn: Any) -> tuple[int, ...]:
    """The operands (0 lhs, 1 rhs) of a dot_general that XLA:CPU copies into its canonical order before the dot
    (:func:`dot_scratch`): a matter of the dimension numbers and ranks alone, not of the layouts."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = []
    for k, (contracted, batch) in enumerate(((lc, lb), (rc, rb))):
        rank = len(eqn.invars[k].aval.shape)
        free = [a for a in range(rank) if a not in contracted and a not in batch]
        canonical = [*batch, *free, *contracted] if k == 0 else [*batch, *contracted, *free]
        leading = list(batch) == list(range(len(batch)))
        if leading and (canonical == sorted(canonical) or (len(free) <= 1 and len(contracted) <= 1)):
            continue  # (one free and one contracted dimension after the batch: read either way round)
        out.append(k)
    return tuple(out)


def window_scratch(
    eqn: Any, env: dict[Any, Layout], absorbed: frozenset[int] = frozenset(), dot_copies: bool = True
) -> int:
    """Bytes per device XLA:CPU holds while it runs a max pool's gradient, besides the op's operands and result.

    XLA:CPU has no select-and-scatter kernel: it expands the op into a windowed arg-max over (value, index)
    pairs and a scatter, holding a copy of the (padded) operand with one s32 index array per dimension but
    one, and the source with one s32 index per dimension.  Measured on one-op ``jax.grad`` of unpadded max
    pools, ranks 3 to 5, windows 2-3, strides 1-2 (``memory_analysis()`` minus explain's walk, to within
    48 bytes): ``rank·P + (rank+1)·S`` for f32, P the operand's elements and S the source's, 4 bytes each.
    Narrower floats are computed in f32 on the CPU (held at 4 bytes here, a floor: bf16 measured more).
    """
    if eqn.primitive.name == "dynamic_update_slice":
        return _update_scratch(eqn, env)
    if eqn.primitive.name == "dot_general":
        return dot_scratch(eqn, env, absorbed, dot_copies)
    if eqn.primitive.name in HASH_SCRATCH:
        return hash_scratch(eqn, env)
    if eqn.primitive.name != "select_and_scatter_add":
        return 0
    source, operand = eqn.invars[0], eqn.invars[1]
    rank = len(operand.aval.shape)
    size = max(dtype_itemsize(operand.aval.dtype), 4)
    padded = _block(operand, env.get(operand), eqn.params.get("padding"))
    return (size + 4 * (rank - 1)) * padded + (size + 4 * rank) * _block(source, env.get(source))


def _block(v: Any, lay: Layout | None, pads: Any = None) -> int:
    """The elements of ``v`` a device holds under ``lay`` (whole where none or free), with ``pads`` (per dimension,
    (low, high)) along its unsplit dimensions: a split one pads at its edge devices only."""
    shape = list(lay.shard_shape if lay is not None and not is_free(lay) else v.aval.shape)
    if pads is not None:
        dims = lay.dims if lay is not None and not is_free(lay) else ((),) * len(shape)
        shape = [n + (lo + hi if not d else 0) for n, d, (lo, hi) in zip(shape, dims, pads)]
    return math.prod(int(n) for n in shape)


def _pool_gradient_holds(
    prog: _Program, info: _Liveness, steps: list[_Step]
) -> list[tuple[int, int, int, int, int, int]]:
    """Per max pool gradient (``select_and_scatter_add``) whose operand a step makes, how XLA:CPU's expansion of it is
    scheduled: (the step that makes the operand, the gradient's step, the bytes of the index arrays held from the
    program's start to the arg-max, of the arg-max's indices held from there to the scatter, of the arg-max's pooled
    values while it runs, of the operand's padding for it).

    :func:`window_scratch` holds the expansion's buffers at the gradient's step, as a one-op gradient of a pool of
    an argument measures them.  Where the program makes the operand (a ReLU before the pool), XLA:CPU's scheduler runs
    the arg-max as soon as the operand is made, in the forward: the one s32 iota per dimension it reads, which read
    nothing, are made at the program's start (as is the scatter's zero-filled result) and held to it, and its
    indices then wait for the backward's scatter.  Measured on ``grad`` of keras-hub's VGGBackbone (conv, bias and
    ReLU, 2x2 max pool, twice) on a (4, 2) mesh (buffer assignment: wrapped_iota x4 per pool at the start, the
    arg-max's (f32, s32 x4) right after the ReLU, the indices concatenated and read by the scatter in the backward);
    the walk had held the index arrays at the gradient's step only, beside what the backward holds there: 0.69x
    XLA's peak, 0.85x now.

    The gradient's step keeps :func:`window_scratch`'s measure, though XLA:CPU's buffers there are fewer (the iotas
    are freed in the forward): the walk holds nothing there of the parameters' copies XLA:CPU also makes at the
    program's start and holds to the backward convolutions reading them (the kernels reversed and transposed for
    the input gradients, the input transposed for the kernel's: 258 KiB at keras-hub ResNet's tp peak), and with
    the step's scratch dropped that tp gradient went from 0.90x to 0.73x XLA's peak; kept, it is 0.94x."""
    # (The max pool gradients among the window steps, found once per list of them: a deep model's dots are there too,
    # thousands, asked at every costing.)
    facts = prog.step_facts.get("pool_gradients")
    if facts is None or facts[0] is not prog.windows:
        found = [
            (at, eqn)
            for at, eqn, path in prog.windows
            if eqn.primitive.name == "select_and_scatter_add" and not path and len(steps[at].ins) >= 2
        ]
        facts = prog.step_facts["pool_gradients"] = (prog.windows, found)
    out: list[tuple[int, int, int, int, int, int]] = []
    for at, eqn in facts[1]:
        made_at = info.producer.get(steps[at].ins[1])
        if made_at is None or made_at >= at - 1:
            continue  # a pool of an argument (or an arg-max right before its scatter): window_scratch's measure
        source, operand = eqn.invars[0], eqn.invars[1]
        rank = len(operand.aval.shape)
        size = max(dtype_itemsize(operand.aval.dtype), 4)
        lay = prog.layouts.get(operand)
        padded, whole = _block(operand, lay, eqn.params.get("padding")), _block(operand, lay)
        pooled = _block(source, prog.layouts.get(source))
        # (window_scratch's rank·P + (rank+1)·S: the iotas, then the arg-max's pooled values and indices)
        iotas = (size + 4 * (rank - 1)) * padded
        padding = size * (padded - whole)
        out.append((made_at, at, iotas, 4 * rank * pooled, size * pooled, padding))
    return out


def _update_scratch(eqn: Any, env: dict[Any, Layout]) -> int:
    """Bytes per device XLA holds while it writes an update into a constant whose result is split where the
    update does not span it (dynamic_slice's gradient on Explicit axes, typed like the operand): the update
    lands anywhere along those axes, so XLA writes it into a buffer whole along them and slices the result's
    piece from it (measured: the (2, 1) slice of [16@c, 16], its gradient holds a whole [16, 16] besides the
    gathered operand and the piece)."""
    base, update, out = eqn.invars[0], eqn.invars[1], eqn.outvars[0]
    lay, base_lay = env.get(out), env.get(base)
    if lay is None or is_free(lay) or (base_lay is not None and not is_free(base_lay)):
        return 0
    shape = [
        n if int(u) != int(n) and d else s
        for n, u, d, s in zip(out.aval.shape, update.aval.shape, lay.dims, lay.shard_shape)
    ]
    if list(shape) == list(lay.shard_shape):
        return 0
    return math.prod(int(n) for n in shape) * dtype_itemsize(out.aval.dtype)


def _invariant_keys(prog: _Program, body: Any, consts: list[Any]) -> tuple[tuple[Key, bool], ...]:
    """The values a loop body (flattened as ``prog``) makes from its constants alone, that are neither constants
    nor views of one (:func:`_from_arguments`: their gathered copies are the walk's already), each with whether a
    step of the body that is not invariant reads it; found once per body (a function of the jaxpr alone)."""
    if not prog.invariant_memo:
        from .rules_loops import invariant_values

        ids = invariant_values(body, consts)
        views = _from_arguments(prog, frozenset())
        args = set(prog.args)
        read_in_loop = {
            id(v) for e in body.eqns if not all(id(o) in ids for o in e.outvars) for v in e.invars if id(v) in ids
        }
        read_in_loop.update(id(v) for v in body.outvars if id(v) in ids)
        found = []
        for e in body.eqns:
            for v in e.outvars:
                k = prog.key(v, ())
                if id(v) in ids and k is not None and not isinstance(k, tuple) and k not in args and k not in views:
                    found.append((k, id(v) in read_in_loop))
        prog.invariant_memo.append(tuple(found))
    return prog.invariant_memo[0]


def _hoisted(prog: _Program, env: dict[Any, Layout], body: Any, consts: list[Any]) -> tuple[frozenset[Key], int]:
    """A loop body's loop-invariant values (:func:`_invariant_keys`): made before the loop, none a temporary of a
    trip; and the bytes the loop holds of them across every trip: each one a step of the trip reads, as the trip
    reads it (its gathered copy where the walk gathered it).

    XLA's while-loop invariant code motion makes them (and their all-gathers: rules_loops.invariant_values, as
    the walker counts them) once, before the loop, and carries them in the loop's state.  Measured on Flax's
    ``OptimizedLSTMCell`` under ``nn.RNN``, FSDP (kernels split on their inputs): the cell concatenates its
    gates' kernels and biases in the body; XLA:CPU concatenates the shards and gathers each concatenation before
    the loop, and its while's state tuple holds the gathered f32[64,256] and f32[32,256] and the f32[256] bias
    for the whole loop, beside each trip's temporaries (buffer assignment)."""
    keys = _invariant_keys(prog, body, consts)
    held = 0
    for k, read in keys:
        if not read:
            continue
        lay = env.get(Gathered(k))
        if lay is None:
            lay = env.get(k)
        if lay is not None and is_free(lay):
            continue
        shape = tuple(lay.shard_shape) if lay is not None else tuple(k.aval.shape)
        held += buffer_bytes(shape, dtype_itemsize(k.aval.dtype), "dense")
    return frozenset(k for k, _ in keys), held


class PeakCache:
    """What peak memory can reuse between costings of one program (the planner costs it hundreds of times).

    Flattening the program (calls inlined, placements that keep their layout aliased) and its liveness
    (who reads what, what fuses, when each buffer dies, which partial sums only leave) depend on the
    layouts only through which calls the walk entered, whether each placement keeps its value's layout,
    whether each dot operand read through a transposed copy was gathered for its dot, and whether each
    in-place update's base is a free constant; the bytes of each buffer, the gathered copies and the loops'
    iterations are the layouts' own.  So a flattening is kept by the calls entered, reused where every
    placement and gathered test answers as it did (:meth:`_Program.holds`), and its liveness by the free-ness
    of the bases it tested; each costing then only sizes the buffers and walks the steps once.  The jaxpr is
    flattened once per placements' answers: each answer of the gathered tests absorbs its transposed copies
    into that flattening (:meth:`_Program.absorbed_variant`), with a liveness of its own.
    Reuse never changes a result (tests/test_memory_cache.py draws layouts and compares with none).
    """

    def __init__(self) -> None:
        self.programs: dict[Any, list[_Program]] = {}  # (id(jaxpr), the calls entered, slices first) -> flattenings
        # The flattenings before their dots' transposed copies are absorbed, by the same key: each holds the
        # steps every answer of the gathered tests shares (:meth:`_Program.absorbed_variant`).
        self.unabsorbed: dict[Any, list[_Program]] = {}
        self.flattened = 0  # flattenings of the jaxpr made (counted, for tests)
        self.absorbed = 0  # programs absorbed from one: one per answer of the gathered tests
        self.reused = 0  # costings that reused one
        # Each stretch's liveness walk by its structure and numbers (peak_summary): the peak folds them.
        self.summaries = SummaryMemo()

    def program(
        self,
        jaxpr: Any,
        layouts: dict[Any, Layout],
        inner: dict[tuple[int, ...], dict[Any, Layout]],
        body: bool = False,
        slices_first: bool = True,
        dot_copies: bool = True,
    ) -> _Program:
        key = (id(jaxpr), frozenset(inner), slices_first, dot_copies)
        known = self.programs.setdefault(key, [])
        for prog in known:
            if prog.jaxpr is jaxpr and prog.holds(layouts, inner):
                self.reused += 1
                return prog.rebound(layouts, inner)
        # No flattening's gathered tests answer so: absorb this costing's copies into the unabsorbed flattening
        # whose placements answer alike (made here the first time).
        base = next((b for b in self.unabsorbed.get(key, ()) if b.jaxpr is jaxpr and b.holds(layouts, inner)), None)
        if base is None:
            self.flattened += 1
            base = _Program(
                jaxpr,
                layouts,
                inner,
                reuse=True,
                body=body,
                absorb=False,
                slices_first=slices_first,
                dot_copies=dot_copies,
            )
            self.unabsorbed.setdefault(key, []).append(base)
        self.absorbed += 1
        prog = base.absorbed_variant(layouts, inner)
        known.append(prog)
        return prog


def peak_bytes(
    jaxpr: Any,
    layouts: dict[Any, Layout],
    inner: dict[tuple[int, ...], dict[Any, Layout]] | None = None,
    tiling: Tiling = "dense",
    cache: PeakCache | None = None,
    reduce_scatter: ReduceScatter | None = None,
) -> int:
    """Peak live bytes per device over the program, from each value's layout.

    ``layouts``: the top-level values' layouts (the program's outputs at their output layouts);
    ``inner``: the environments of the nested calls the walk entered (``Walker.sub_envs``),
    which are inlined as XLA inlines them.  Arguments stay allocated for the whole step (nothing
    is donated); other values die after their last use, a fused value's operands after its
    fusion's; a scan or a while loop adds one iteration; branches count through their inputs and outputs.  Fused
    temporaries, in-place results, gathered arguments and combined partial sums as the module says.

    ``tiling``: how the device lays a buffer out (the profile's: a TPU pads to its tiles, :func:`buffer_bytes`).
    ``cache``: what earlier costings of this program flattened (see :class:`PeakCache`); the result is the same.
    ``reduce_scatter``: how the compiler runs a sum that lands split (the profile's): ``'all-reduce'`` (XLA:CPU)
    holds the whole sum beside its slice; None: as the tiling's compiler does (dense: XLA:CPU's).
    """
    inner = inner or {}
    whole_sums = None if reduce_scatter is None else reduce_scatter == "all-reduce"
    xla_cpu = tiling == "dense" and whole_sums is not False  # (as _peak tells XLA:CPU: its YNNPACK fusions)
    # A dot operand out of XLA:CPU's canonical order is copied transposed, and the piece of an operand a dot's result
    # splits finer is sliced into a buffer first (dot_scratch), measured on XLA:CPU; the TPU compiler lays the
    # operand out for its dot and reads the slice in place (libtpu, v5e:2x4, tests/test_target_tpu_model.py: the
    # gradient of two tensor-parallel dense layers f32[64,2048,2048] @ [2048,4096] @ [4096,2048], 1088 MiB per chip,
    # the walk 1312 MiB with the transposed copies, 1088 without; einsum('bmk,kn->bmn') of a whole x[64,2048,2048]
    # and y[2048,1024@a] into [64@c,2048,1024@a], 1212 MB, the walk 1749 MB with x's slice, 1212 without).  A GPU's
    # compiler keeps XLA:CPU's (dense: not measured there).
    dot_copies = tiling == "dense"
    if cache is None:
        prog = _Program(jaxpr, layouts, inner, slices_first=xla_cpu, dot_copies=dot_copies)
        return _peak(prog, layouts, tiling=tiling, whole_sums=whole_sums)
    prog = cache.program(jaxpr, layouts, inner, slices_first=xla_cpu, dot_copies=dot_copies)
    return _peak(prog, layouts, tiling=tiling, memo=cache.summaries, whole_sums=whole_sums)


@dataclass(frozen=True)
class _Liveness:
    """When each buffer of a flattened program is made, read and freed: the layouts' part left out."""

    readers: dict[Key, list[int]]
    producer: dict[Key, int]
    fused: frozenset[Key]  # values with no buffer of their own (computed in their readers' fusions)
    until: dict[Key, int]  # each buffer's last step (a fused value's readers' for its operands)
    dies: dict[int, list[Key]]  # the buffers freed after each step
    leaves: frozenset[Key]  # values only on their way out of the program (their partial sums wait)
    donors: dict[int, tuple[Key, ...]] = field(default_factory=dict)  # by step: buffers it may write into
    # By step: the arguments read there last whose gathered copies (a temporary of XLA's all-gather, not the
    # caller's buffer) it may write its result into, as it may a dying operand's (``donors``).
    copy_donors: dict[int, tuple[Key, ...]] = field(default_factory=dict)
    # The random bits XLA:CPU makes in a threefry loop: (step, the bits, whether made from the key alone, the
    # values of their shape elementwise ops make from them: on Auto axes the most split of those is theirs).
    bits: tuple[tuple[int, Key, bool, tuple[Key, ...]], ...] = ()
    # The views of one argument (a weight's transpose, cast, reshape or static slice): XLA's scheduler gathers
    # them at the start of the step as it gathers the arguments (:func:`_from_arguments`).
    from_args: frozenset[Key] = frozenset()
    # The convolutions whose input is a value the program makes (no argument): by step, that input and whether
    # the step is its last reader, and the names the walk may bind its gathered copy to (:func:`_conv_gather_bytes`).
    conv_inputs: tuple[tuple[int, Key, bool, tuple[Key, ...]], ...] = ()
    # The 1x1 convolutions XLA:CPU computes inside a reduction's YNNPACK fusion (:func:`_convs_in_ynn`).
    ynn_convs: frozenset[int] = frozenset()
    # The broadcast constants YNNPACK fusions read materialised: (their last such reader, a value of the constant's
    # shape and split: that reader's result), each held from the start (:func:`_shared_constants`).
    ynn_constants: tuple[tuple[int, Key], ...] = ()


def _in_place_bases(prog: _Program) -> list[Key]:
    """The bases of scatters whose fusing with their one add depends on the base being a free constant."""
    steps = prog.steps
    readers: dict[Key, list[int]] = {}
    for i, step in enumerate(steps):
        for k in step.ins:
            readers.setdefault(k, []).append(i)
    out = []
    for step in steps:
        if step.name in _UPDATES_IN_PLACE and step.name != "dynamic_update_slice":
            for k in step.outs:
                reads = readers.get(k, [])
                if k not in prog.outputs and len(reads) == 1 and steps[reads[0]].name in _ADDS:
                    out.append(step.ins[0])
    return out


def _liveness(
    prog: _Program,
    free: dict[Key, bool],
    ynn: frozenset[int] = frozenset(),
    transposing: frozenset[int] = frozenset(),
) -> _Liveness:
    """``prog``'s :class:`_Liveness`, where ``free`` says which in-place bases are free constants, ``ynn``
    which reductions XLA:CPU runs as YNNPACK fusions (:func:`_ynn_reductions`) and ``transposing`` which elementwise
    steps write their result in another layout than their operands' (:func:`_written_gather_major`)."""
    steps, outputs = prog.steps, prog.outputs
    n = len(steps)
    dead = _dead_steps(steps, outputs)
    readers: dict[Key, list[int]] = {}
    producer: dict[Key, int] = {}
    for i, step in enumerate(steps):
        if i not in dead:
            for k in step.ins:
                readers.setdefault(k, []).append(i)
        for k in step.outs:
            producer[k] = i
    fusible = _fusible_elementwise()
    fusing = fusible | _fusing()
    in_ynn = _in_ynn(steps, readers, ynn)
    recomputed = _duplicated(steps, readers, producer, outputs, fusible, fusing, in_ynn)
    dots_in_ynn = _convs_in_ynn(steps, readers, in_ynn)
    bits = _random_bits(steps, dead, outputs, producer)
    bits_keys = frozenset(k for _, k, _ in bits)

    def is_fused(k: Key) -> bool:
        """No buffer of its own: computed inside the fusion of each of its readers.

        An elementwise value read once, by an op that fuses with its producer, is computed in
        that op's loop.  A value read twice gets a buffer, cheap or not: measured on XLA:CPU,
        whose reductions (YNNPACK fusions) read a materialised operand when it is shared
        (duplicating a cheap ``x - max`` into both its readers halved the estimate of a
        one-hot cross-entropy).  A scatter-add into a broadcast constant read by one add is
        folded into it (XLA's ``A + scatter(0, i, u) -> scatter(A, i, u)``: the add's other
        operand is updated in place), as in the integer-label cross-entropy's gradient.
        """
        if k in outputs or k not in producer:
            return False
        if k in bits_keys:
            return True  # the threefry loop's two state words, read by its readers' fusion (_random_bits)
        if producer[k] in dots_in_ynn:
            return True  # a 1x1 conv computed inside the YNNPACK fusion of the reduction reading it (_convs_in_ynn)
        name, reads = steps[producer[k]].name, readers.get(k, [])
        if folded and not folded.isdisjoint(reads):
            return False  # a dot reads it through the transpose folded into it: a buffer
        if name == "transpose" and reads and all(steps[r].name == "dot_general" for r in reads) and _rank(k) == 2:
            # XLA's transpose folding: a matrix transpose read only by dots is their dimension numbers, no copy
            # (x @ w.T reads w; measured: a row-parallel x @ w then @ w.T holds no transposed w).
            folded.add(producer[k])
            return True
        if name in _UPDATES_IN_PLACE and name != "dynamic_update_slice":
            base = steps[producer[k]].ins[0]
            return len(reads) == 1 and steps[reads[0]].name in _ADDS and free[base]
        # A transpose read once fuses into its reader's loop too (XLA:CPU's loop fusion: the gradient of
        # sum(x.T ** 2) is one fusion reading x, measured); it never writes in place (not a donor below).
        if (name not in fusible and name != "transpose") or not all(steps[r].name in fusing for r in reads):
            return False
        return len(reads) <= 1

    # A dead step's results take no buffer (XLA removes the step), as fused values do not.  A value read more
    # than once fuses too when every reader ends in one fusion (XLA fuses consumers first: by the time it
    # reaches the value, all of its readers are in that one loop, which computes it once; the gradient of
    # tanh(x.T) is one loop, measured).  Readers in different fusions (two reductions) each read a buffer.
    fused_set: set[Key] = set()
    folded: set[int] = set()  # transposes folded into the dots reading them (is_fused)
    root: dict[int, int] = {}  # by step: the step whose fusion computes it (itself unless its results fuse)

    def root_of(i: int) -> int:
        return root.get(i, i)

    for i in range(n - 1, -1, -1):
        step = steps[i]
        roots: set[int] = set()
        for k in step.outs:
            if i in dead:
                fused_set.add(k)
                continue
            if is_fused(k):
                fused_set.add(k)
                roots.update(root_of(r) for r in readers.get(k, []))
            elif (not folded or folded.isdisjoint(readers.get(k, ()))) and _fuses_into_one(
                k, i, steps, readers, outputs, fusible, fusing, root_of
            ):
                fused_set.add(k)
                roots.update(root_of(r) for r in readers[k])
            elif k in recomputed and k not in outputs and recomputed[k] >= set(readers[k]):
                # Recomputed in every reader's fusion (XLA duplicates it into each): no buffer of its own.
                fused_set.add(k)
                roots.update(root_of(r) for r in readers[k])
            else:
                roots.add(i)
        if step.outs and len(roots) == 1:
            root[i] = roots.pop()
    fused = frozenset(fused_set)
    # Until when each buffer is needed: its last reader, or, read by a fused value, that value's readers'.  A value
    # XLA recomputes in a reader's fusion is not read there: its operands are, to that fusion's end (``again``).
    until: dict[Key, int] = dict.fromkeys(outputs, n)
    again: dict[Key, int] = {}  # by recomputed value: the last step whose fusion recomputes it
    for i in range(n - 1, -1, -1):
        step = steps[i]
        outs = step.outs
        end = max([until.get(o, i) for o in outs]) if outs and fused.issuperset(outs) else i
        if again:
            for o in outs:
                later = again.get(o)
                if later is not None and later > end:
                    end = later
        for k in step.ins:
            into = recomputed.get(k)
            if into is not None and i in into:
                if again.get(k, -1) < end:
                    again[k] = end
            elif until.get(k, -1) < end:
                until[k] = end
    dies: dict[int, list[Key]] = {}
    args = set(prog.args)
    for k, end in until.items():
        if k not in args and k not in outputs:
            dies.setdefault(end, []).append(k)

    def fusion_inputs_of(keys: tuple[Key, ...]) -> list[Key]:
        """The buffers a fusion reading ``keys`` reads (its fused operands' operands, recursively)."""
        if fused.isdisjoint(keys):
            return list(dict.fromkeys(reversed(keys)))  # (the search below, none fused: last first, each once)
        out: list[Key] = []
        todo, seen = list(keys), set()
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            if k in fused:
                todo.extend(steps[producer[k]].ins)
            else:
                out.append(k)
        return out

    # The buffers each elementwise, scatter or update step may write its result into: operands of its fusion
    # that die there (whether one does is a matter of bytes, the layouts').
    donors: dict[int, tuple[Key, ...]] = {}
    copy_donors: dict[int, tuple[Key, ...]] = {}
    written = prog.written_transposed
    # The steps where an argument's last use is: with ``dies``, every step where some buffer is read last (an
    # output's ``until`` is past the last step), so the only steps whose fusion inputs can donate.
    args_end = {until[v] for v in args if v in until}
    for i, step in enumerate(steps):
        if step.outs and (step.name in fusible or step.name in _UPDATES_IN_PLACE):
            if (written and not written.isdisjoint(step.outs)) or i in transposing:
                # Written transposed for a dot (_Program._absorb_transposes), or gathered-dimension major for the
                # all-gather after it (_written_gather_major): never in place.
                donors[i] = ()
                continue
            if i not in dies and i not in args_end:
                donors[i] = ()  # nothing is read last here: no operand to write into
                continue
            base = step.ins[:1] if step.name in _UPDATES_IN_PLACE else step.ins
            if step.name == "dynamic_update_slice" and _aval(step.ins[1]).shape == _aval(step.ins[0]).shape:
                # An update as large as its operand replaces it (XLA's algebraic simplifier: the result is the
                # update, measured on x[16@b] by u[16@(a,b)]: the gathered u is the output, x never read).
                base = step.ins[1:2]
            into_own: list[Key] = []
            into_copy: list[Key] = []
            for d in fusion_inputs_of(base):
                if until.get(d) == i:
                    (into_copy if d in args else into_own).append(d)
            donors[i] = tuple(into_own)
            if into_copy:
                copy_donors[i] = tuple(into_copy)
    leaves = frozenset(_leaves_program(steps, set(outputs)))
    # The random bits with the values of their shape that elementwise ops make from them: on Auto axes XLA's
    # sharding propagation splits the bits as the most split of those (_bits_word_bytes).
    read_as = tuple((i, k, first, _elementwise_from(k, steps, readers, fusible)) for i, k, first in bits)
    args = set(prog.args)
    # (A conv computed inside a reduction's YNNPACK fusion holds its input to that fusion's end, but no later step
    # reads it: it is the last reader still.)
    conv_in = [
        (i, step.ins[0], until.get(step.ins[0]) == i or (i in dots_in_ynn and readers.get(step.ins[0]) == [i]))
        for i, step in enumerate(steps)
        if step.name == "conv_general_dilated" and i not in dead and step.ins and step.ins[0] not in args
    ]
    # The walk binds a gathered copy to the value its reader read: a call's result, its body's value here (alias).
    names: dict[Key, list[Key]] = {k: [k] for _, k, _ in conv_in}
    if names:
        for name in prog.alias:
            k = prog.key(name[1], name[0]) if isinstance(name, tuple) else prog.key(name, ())
            if k in names:
                names[k].append(name)
    conv_inputs = tuple((i, k, last, tuple(names[k])) for i, k, last in conv_in)
    return _Liveness(
        readers,
        producer,
        fused,
        until,
        dies,
        leaves,
        donors,
        copy_donors,
        read_as,
        _from_arguments(prog, dead),
        conv_inputs,
        dots_in_ynn,
        _shared_constants(steps, dead, ynn, in_ynn),
    )


def _shared_constants(
    steps: list[_Step], dead: frozenset[int], ynn: frozenset[int], in_ynn: frozenset[int]
) -> tuple[tuple[int, Key], ...]:
    """The broadcast constants (:func:`_literals`) read inside a YNNPACK fusion that other steps read too.

    XLA's CSE makes every broadcast of one constant to one shape one instruction; a loop fusion recomputes it,
    but a YNNPACK fusion duplicates nothing into it (:func:`_in_ynn`), so a broadcast shared with a step outside
    it is a buffer that fusion reads.  It reads nothing the step computes, so XLA:CPU's scheduler makes it at the
    start, with the arguments' own copies, and holds it to its last reader.  Measured on the gradient of a ReLU
    summed by a reduction YNNPACK runs: ``max(y, 0)`` in the fusion and the gradient's ``y > 0`` and
    ``select(.., 0)`` outside it share one materialised ``f32[2,16,16,16]`` zero, made before the convolution
    that makes ``y`` (tests/test_memory_rules.py); a ReLU alone (no gradient) folds the zero into its fusion.
    Only a constant at the shape a reduction of the fusion reads counts: one a smaller operand reads (a mean's
    ``/ 32`` on ``[rows, 1]``, broadcast into the fusion afterwards) is folded (measured: the residual stream's
    LayerNorms, exact without it)."""
    reduced = {_elements(steps[r].ins[0]) for r in ynn if steps[r].ins}
    readers: dict[tuple[Any, ...], list[int]] = {}
    for i, step in enumerate(steps):
        if i not in dead:
            for c in dict.fromkeys(step.literals):
                readers.setdefault(c, []).append(i)
    out = []
    for reads in readers.values():
        inside = [
            i
            for i in reads
            if i in in_ynn
            and steps[i].name in _YNN_ELEMENTWISE
            and steps[i].outs
            and _elements(steps[i].outs[0]) in reduced
        ]
        if inside and len(reads) > len(inside):
            last = max(inside)
            out.append((last, steps[last].outs[0]))
    return tuple(out)


# The ops that make a weight's other view: its layout, dtype or a static piece of it, from it alone.  (A
# dynamic_slice reading the argument alone has literal starts: a static slice, as JAX writes a table read
# ``dynamic_slice(b, (0,) * b.ndim, b.shape)``; one with traced starts reads them too and is not a view.)
_VIEWS = frozenset(
    {
        "transpose",
        "convert_element_type",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "rev",
    }
)


def _from_arguments(prog: _Program, dead: frozenset[int] | set[int]) -> frozenset[Key]:
    """The views of one argument: values each made by a view op (:data:`_VIEWS`) of an argument or of such a value.

    An FSDP weight reaches its dot through a transpose (``x @ w.T``, Equinox's and Flax's ``(out, in)``
    kernels), a cast (a bf16 compute dtype), a reshape (attention's heads) or a static slice (a layer of a
    stacked weight): the walk gathers that value, not the argument.  It reads nothing the step computes, so
    XLA's scheduler is free to run it, and its all-gather, first; XLA:CPU does, as it does the arguments' own
    gathers (measured on ``tanh(x @ w.T)`` three layers deep, each ``w`` split along ``in``: the three shards
    transposed and all-gathered before the first dot, the three gathered ``f32[64,64]`` held together, 59396 B,
    as for ``x @ w``).  A value that reads two (an activation: the batch and a weight) is not one: XLA gathers
    that where it is made."""
    known: set[Key] = set(prog.args)
    out: set[Key] = set()
    for i, step in enumerate(prog.steps):
        if i in dead or len(step.ins) != 1 or not (step.name in _VIEWS or _promotes_rank(step)):
            continue
        if step.ins[0] in known:
            known.update(step.outs)
            out.update(step.outs)
    return frozenset(out)


def _promotes_rank(step: _Step) -> bool:
    """Whether ``step`` is a broadcast_in_dim that only adds unit axes (JAX's rank promotion of a bias, ``b[h]`` to
    ``[1, h]``): a reshape in XLA, so a view as :data:`_VIEWS`' ops are."""
    return (
        step.name == "broadcast_in_dim"
        and len(step.outs) == 1
        and len(step.ins) == 1
        and _elements(step.outs[0]) == _elements(step.ins[0])
    )


def _combined_at(
    body: _Program, until: dict[Key, int], size: Callable[[Key], int], whole_sums: bool = True
) -> dict[int, int]:
    """By step of a loop body: what it holds more because XLA combines the body's all-reduces into one.

    XLA's all-reduce combiner merges the independent all-reduces of one computation into a single all-reduce
    of a tuple, issued where the last of them is ready: a loop body that sums several partial results per trip (a
    recurrent gradient with the batch split: each weight's whole partial gradient, reduce-scattered to the
    weight's split every trip) holds every partial sum and every sum at once there, where the walk (each
    all-reduce running where its operand is made) holds one pair at a time.  Measured on a GRU over ``lax.scan``,
    FSDP weights, the batch split over the same mesh axis: one combined all-reduce of ``f32[192,32]``,
    ``f32[192]``, ``f32[192,64]`` per backward trip, all six buffers live at XLA:CPU's peak.  So at the group's
    last all-reduce, each earlier member adds its partial sum, and its sum where the walk has freed it by then
    (sized as the walk sizes it: a sum that is the body's stacked output is the loop's buffer, counted outside).
    A group grows, in program order, while each new all-reduce reads no member's sum: a row-parallel layer's two
    sums in a row (attention, then MLP) stay two all-reduces, each held alone.

    Only sums the body adds to its carry (a loop-invariant weight's gradient, accumulated over the trips) are
    grouped: a scanned layer stack's per-layer gradients (stacked outputs; Flax ``nn.scan``, Haiku
    ``layer_stack``) are combined by XLA too, but held together there the walk overstates XLA's peak (1.34x on
    the corpus's flax_scan fsdp gradient, 1.11x without): the walk holds something else at that point that XLA
    does not, not yet found, so they stay as they were."""
    args = set(body.args)
    accumulated = {
        k for step in body.steps if step.name in _ADDS and any(a in args for a in step.ins) for k in step.ins
    }
    # (A sum re-laid on its way into the carry is added there too: a weight gradient's dot writes it transposed,
    # ``dot_general(dy, x)`` of an (in, out) weight, then a transpose to the carry's layout.)
    for step in reversed(body.steps):
        if step.name in _ON_THE_WAY_OUT and all(k in accumulated for k in step.outs):
            accumulated.update(step.ins)
    summed = [m for m in body._summed() if m[1] in accumulated]
    if len(summed) < 2:
        return {}
    groups: list[list[tuple[int, Key, int, int]]] = []
    for member in summed:
        before = body._ancestors(member[0])
        if groups and not any(j in before for j, *_ in groups[-1]):
            groups[-1].append(member)
        else:
            groups.append([member])
    out: dict[int, int] = {}
    for group in groups:
        last = group[-1][0]
        extra = sum(
            part + (_whole_sum_beside(part, size(k), whole_sums) or (size(k) if until.get(k, last) < last else 0))
            for i, k, part, _ in group
            if i != last
        )
        if extra:
            out[last] = out.get(last, 0) + extra
    return out


def _fuses_into_one(
    k: Key,
    i: int,
    steps: list[_Step],
    readers: dict[Key, list[int]],
    outputs: Any,
    fusible: frozenset[str],
    fusing: frozenset[str],
    root_of: Callable[[int], int],
) -> bool:
    """Whether ``k`` (made by step ``i``, read more than once) is computed inside the one fusion all its readers
    end in: an elementwise value whose readers all fuse with their producers and share one root fusion."""
    reads = readers.get(k, [])
    if k in outputs or len(reads) < 2 or steps[i].name not in fusible:
        return False
    if not all(steps[r].name in fusing for r in reads):
        return False
    return len({root_of(r) for r in reads}) == 1


# Descendants of a value the search for its paths to its readers visits at most (:func:`_fuses_on_all_paths`):
# paths longer than a layer's elementwise tail cross a dot or a collective, which no fusion takes in.
_PATH_BUDGET = 256


def _elements(k: Key) -> int:
    return _shape_elements(tuple(getattr(_aval(k), "shape", ())))


def _true_rank(k: Key) -> int:
    return _shape_true_rank(tuple(getattr(_aval(k), "shape", ())))


# (By shape: a deep model's tens of thousands of values have a few dozen shapes, asked of at every flattening.)
@functools.lru_cache(maxsize=4096)
def _shape_elements(shape: tuple[Any, ...]) -> int:
    return math.prod(int(d) for d in shape)


@functools.lru_cache(maxsize=4096)
def _shape_true_rank(shape: tuple[Any, ...]) -> int:
    return sum(1 for d in shape if int(d) != 1)


def _at_most_unary(step: _Step, steps: list[_Step], producer: dict[Key, int]) -> bool:
    """XLA's ``EffectivelyAtMostUnary``: at most one operand as large as the result that is not a broadcast (or an
    iota, or a scalar): duplicating such an op into a fusion reads no more inputs than reading its result."""
    rank = max((_true_rank(k) for k in step.outs), default=0)
    big = 0
    for k in set(step.ins):
        j = producer.get(k)
        made = steps[j] if j is not None else None
        if made is not None and (
            made.name == "iota"
            or (made.name == "broadcast_in_dim" and (not made.ins or _elements(made.ins[0]) < _elements(k)))
        ):
            continue  # (a broadcast of a constant has no operand the walk keys)
        if _true_rank(k) >= rank:
            big += 1
            if big > 1:
                return False
    return True


def _reuses_elements(step: _Step) -> bool:
    """XLA's ``ReusesOperandElements`` for the ops the walk fuses: a broadcast (or tile) that repeats its operand."""
    return (
        step.name in ("broadcast_in_dim", "tile")
        and bool(step.ins)
        and _elements(step.outs[0]) > _elements(step.ins[0])
    )


def _accepts(reader: _Step, made: _Step, fusing: frozenset[str]) -> bool:
    """XLA:CPU's ``ShouldFuse(reader, made)`` in the walk's terms: the reader is a loop or reduction fusion, the
    producer is loop-fusible, and an expensive producer is not fused into a reader that reads each element many
    times (a broadcast of a reduction)."""
    if reader.name not in fusing or made.name not in fusing:
        return False
    return made.cheap or not _reuses_elements(reader)


# The reductions XLA:CPU hands to YNNPACK (ynn_support.cc: a sum, max or min of floats whose operand or result has
# at least this many elements per device, IsInstructionPreferredByYnn); each is a custom fusion that instruction
# fusion leaves alone: it reads its operands' buffers, never recomputes a shared producer.
# The windowed max and min too (a max pool: measured on relu(conv(relu(conv(x)))) pooled 2x2, XLA:CPU's
# ``ynn_fusion`` takes the second ReLU into the pool and reads its zero, a materialised f32[8,16,16,4] the first ReLU
# shares: explain had left the pool a loop fusion, 0.74x XLA's peak; tests/test_memory_rules.py).
_YNN_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_window_sum", "reduce_window_max", "reduce_window_min"}
)
_YNN_MIN_ELEMENTS = 4096
# The elementwise ops the YNNPACK fusion takes in with the reduction they feed (read by it alone): its unary and
# binary operators, broadcasts and reshapes (measured: a LayerNorm's square, a mean pool's scale and shift).
_YNN_ELEMENTWISE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "pow",
        "neg",
        "abs",
        "sign",
        "exp",
        "expm1",
        "log",
        "log1p",
        "tanh",
        "logistic",
        "rsqrt",
        "sqrt",
        "erf",
        "sin",
        "cos",
        "tan",
        "floor",
        "ceil",
        "round",
        "square",
        "integer_pow",
        "convert_element_type",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
    }
)


def _ynn_reductions(prog: _Program) -> frozenset[int]:
    """The reduction steps XLA:CPU runs as YNNPACK fusions under this costing's layouts (per-device sizes)."""
    facts = prog.step_facts.get("reductions")
    if facts is None:  # (found once per flattening: a deep model's tens of thousands of steps hold a few thousand)
        candidates = [
            (i, step.ins[0], step.outs[0])
            for i, step in enumerate(prog.steps)
            if step.name in _YNN_REDUCTIONS and step.ins and step.outs and _floating(_aval(step.ins[0]))
        ]
        # Which hold enough elements per device under any layout (the least block any split of the mesh's axes over
        # the dimensions leaves), and which under none (a block is at most the whole): only the others are asked of
        # each costing's layouts (an 80-layer llama's norms and softmaxes, thousands, are large whatever their split).
        axes = _mesh_axis_sizes(prog)
        held: list[int] = []
        ask: list[tuple[int, Key, Key]] = []
        for i, k, result in candidates:
            shapes = [tuple(int(d) for d in getattr(_aval(v), "shape", ())) for v in (k, result)]
            if max(math.prod(shape) for shape in shapes) < _YNN_MIN_ELEMENTS:
                continue
            if axes is not None and max(_least_block(shape, axes) for shape in shapes) >= _YNN_MIN_ELEMENTS:
                held.append(i)
            else:
                ask.append((i, k, result))
        facts = prog.step_facts["reductions"] = (frozenset(held), ask)
    always: frozenset[int] = facts[0]
    ask = facts[1]
    out = [
        i
        for i, k, result in ask
        if _shard_elements(prog, k) >= _YNN_MIN_ELEMENTS or _shard_elements(prog, result) >= _YNN_MIN_ELEMENTS
    ]
    return always | frozenset(out) if out else always


def _written_gather_major(prog: _Program) -> tuple[frozenset[int], frozenset[int]]:
    """The max pools and the elementwise steps XLA:CPU writes with a dimension other than the major one major, under
    this costing's layouts: (the pools, which are then no YNNPACK fusions; the elementwise steps, whose result is
    then no operand's buffer).

    Where the walk gathers a convolution's input along a dimension that is not its major one (an NHWC activation's
    channels), XLA:CPU's layout assignment lays the value out with that dimension major for the all-gather, and
    carries that layout back through the ops that take any (a max pool, the elementwise ops before it) to the first
    op whose own layout is fixed (a convolution): the fusion right after it writes the transposed layout, a new
    buffer beside the convolution's result, and the pool runs as a plain reduce-window, which YNNPACK does not take
    in that layout.  Measured on keras-hub's VGGBackbone with its kernels split on their output channels over 2
    devices (conv, bias and ReLU, 2x2 max pool, then a conv whose input XLA gathers on its channels): the ReLU's
    f32[8,16,16,4] written ``{2,1,0,3}`` next to the convolution's ``{3,2,1,0}`` result, 92980 B where the walk,
    with the ReLU written into the convolution's buffer and fused into a YNNPACK pool, held 68400 B (0.74x).
    Where XLA splits the input's channels instead and sums the products (the second kernel twice as wide: no
    all-gather), nothing is transposed and the walk held the right bytes already."""
    facts = prog.step_facts.get("gather_major")
    if facts is None:
        # (found once per flattening: per convolution whose input the program makes, that input, the pools back
        # from it and the elementwise step that makes what they pool; a few per model)
        steps = prog.steps
        producer = {k: i for i, step in enumerate(steps) for k in step.outs}
        fusible = _fusible_elementwise()
        args = set(prog.args)
        found: list[tuple[Key, tuple[int, ...], int]] = []
        for step in steps:
            if step.name != "conv_general_dilated" or not step.ins or step.ins[0] in args:
                continue
            k = step.ins[0]
            at, pools = producer.get(k), []
            while at is not None and steps[at].name in _LAYOUT_FOLLOWING and steps[at].ins:
                if steps[at].name.startswith("reduce_window"):
                    pools.append(at)
                at = producer.get(steps[at].ins[0])
            if at is not None and steps[at].name in fusible:
                found.append((k, tuple(pools), at))
        facts = prog.step_facts["gather_major"] = tuple(found)
    pooled: list[int] = []
    writers: list[int] = []
    for k, pools, writer in facts:
        copy, lay = prog.layout(k, Gathered), prog.layout(k)
        if copy is None or lay is None or is_free(copy) or is_free(lay):
            continue
        if _minor_gather(tuple(int(n) for n in _aval(k).shape), lay, copy):
            pooled.extend(pools)
            writers.append(writer)
    return frozenset(pooled), frozenset(writers)


# The ops between a convolution's input and the elementwise step that makes it through which XLA:CPU's layout
# assignment carries the all-gather's layout (they take their operand in any layout): max and mean pools, casts.
_LAYOUT_FOLLOWING = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum", "convert_element_type"})


def _mesh_axis_sizes(prog: _Program) -> tuple[int, ...] | None:
    """The sizes of the mesh axes the layouts bound in ``prog``'s environments are over (None: no layout bound, or
    layouts over meshes of other sizes: then every costing is asked)."""
    meshes = {id(lay.mesh): lay.mesh for env in (prog.layouts, *prog.inner.values()) for lay in env.values()}
    kinds = {tuple(int(m.size) for m in mesh) for mesh in meshes.values()}
    return next(iter(kinds)) if len(kinds) == 1 else None


@functools.lru_cache(maxsize=4096)
def _least_block(shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
    """The fewest elements a device's block of ``shape`` holds under any layout over mesh axes of sizes ``axes``
    (each axis splitting one dimension or none, a dimension split by the product of its axes, floor-divided as
    ``Layout.shard_shape`` divides)."""
    least = math.prod(shape)
    for placed in itertools.product(range(len(shape) + 1), repeat=len(axes)):
        splits = [1] * len(shape)
        for size, dim in zip(axes, placed):
            if dim < len(shape):
                splits[dim] *= size
        least = min(least, math.prod(d // n for d, n in zip(shape, splits)))
    return least


def _floating(aval: Any) -> bool:
    """Whether ``aval`` holds floats (the reductions YNNPACK takes: f32, bf16, f16, f64)."""
    return getattr(getattr(aval, "dtype", None), "kind", "") == "f"


def _shard_elements(prog: _Program, k: Key) -> int:
    lay = prog.layout(k)
    shape = lay.shard_shape if lay is not None else getattr(_aval(k), "shape", ())
    return math.prod(int(d) for d in shape)


def _in_ynn(steps: list[_Step], readers: dict[Key, list[int]], ynn: frozenset[int]) -> frozenset[int]:
    """The steps computed inside YNNPACK fusions: the ``ynn`` reductions and the elementwise chains each alone
    feeds (a custom fusion: XLA's instruction fusion duplicates nothing into it)."""
    inside = set(ynn)
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if i in inside or step.name not in _YNN_ELEMENTWISE or len(step.outs) != 1:
            continue
        reads = readers.get(step.outs[0], [])
        if len(reads) == 1 and reads[0] in inside:
            inside.add(i)
    return frozenset(inside)


def _convs_in_ynn(steps: list[_Step], readers: dict[Key, list[int]], inside: frozenset[int]) -> frozenset[int]:
    """The convolutions XLA:CPU computes inside a YNNPACK fusion (``inside``: :func:`_in_ynn`): a 1x1 conv of
    stride 1 and no padding (a dot, as XLA:CPU rewrites it) whose result only that fusion reads.  Its result gets
    no buffer (measured, replicated on XLA:CPU: relu(conv(x, w)) summed, x (8,8,8,16) NHWC against a 1x1x16x32
    kernel: the arguments and 4 bytes, where the walk held the f32[8,8,8,32] result, 2.9x; a 3x3 conv, or the
    result read twice: the result held).  Found from the shapes: the result's is the input's but for one axis (the
    features), and the kernel's only axes longer than 1 are the input's and the result's features."""
    out = []
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if step.name != "conv_general_dilated" or len(step.outs) != 1 or len(step.ins) != 2:
            continue
        reads = readers.get(step.outs[0], [])
        if len(reads) != 1 or reads[0] not in inside:
            continue
        x, w, y = (tuple(int(d) for d in getattr(_aval(k), "shape", ())) for k in (*step.ins, step.outs[0]))
        if len(x) != len(y):
            continue
        differ = [d for d in range(len(x)) if x[d] != y[d]]
        long = sorted(n for n in w if n != 1)
        if len(differ) == 1:
            dot = long == sorted(n for n in (x[differ[0]], y[differ[0]]) if n != 1)
        else:  # as many features out as in: the kernel square, its side one of the input's axes
            dot = not differ and len(long) == 2 and long[0] == long[1] and long[0] in x
        if dot:
            out.append(i)
    return frozenset(out)


def _ynn_conv_copies(
    prog: _Program,
    info: _Liveness,
    steps: list[_Step],
    i: int,
    size: Callable[[Key], int],
    nbytes_as: Callable[[Key, Layout | None], int],
    fusible: frozenset[str],
) -> int:
    """The copies a 1x1 convolution computed inside a YNNPACK fusion (:func:`_convs_in_ynn`) holds while it runs:
    its operands in a dot's row-major order where they are not (features not the input's last axis: NCHW; the
    kernel's two feature axes not its last: OIHW).  An input an elementwise op makes for it alone is written in
    that order by its own fusion (the walk holds that buffer already); an input the walk gathered for it is
    :func:`_conv_gather_bytes`'s.  Measured, replicated on XLA:CPU: sum(relu(conv(x, w)).mean((2, 3))), x
    (8,16,8,8) NCHW against a (32,16,1,1) kernel: the arguments, the f32[8,8,8,16] copy of x and the f32[1,1,16,32]
    copy of w (70660 B); relu(x) as the input: the same, its fusion writing the copy."""
    step = steps[i]
    x, w = step.ins[0], step.ins[1]
    xs, ys = (tuple(int(d) for d in getattr(_aval(k), "shape", ())) for k in (x, step.outs[0]))
    axis = next((d for d, (a, b) in enumerate(zip(xs, ys)) if a != b), None)
    held = 0
    if axis is not None and axis != len(xs) - 1 and prog.layout(x, Gathered) is None:
        made = info.producer.get(x)
        own = made is not None and steps[made].name in fusible and info.readers.get(x) == [i]
        held += 0 if own else size(x)
    ws = tuple(int(d) for d in getattr(_aval(w), "shape", ()))
    long_axes = [d for d, n in enumerate(ws) if n != 1]
    if long_axes and long_axes != list(range(len(ws) - len(long_axes), len(ws))):
        copy = prog.layout(w, Gathered)
        held += nbytes_as(w, copy) if copy is not None else size(w)
    return held


def _fuses_on_all_paths(
    i: int,
    users: set[int],
    steps: list[_Step],
    readers: dict[Key, list[int]],
    producer: dict[Key, int],
    blocked: set[int],
    fusing: frozenset[str],
    custom: frozenset[int],
) -> bool:
    """XLA's ``CanFuseOnAllPaths`` from step ``i`` to each of its readers ``users``: every step on a path between
    them is a fusion that takes in the step before it on that path, none is one XLA refuses to duplicate
    (``blocked``).  A path that leaves the budget of steps is taken to cross a dot or a collective."""
    hi = max(users)
    desc: set[int] = set()
    todo = list(users)
    while todo:
        j = todo.pop()
        if j in desc or j > hi:
            continue
        desc.add(j)
        if len(desc) > _PATH_BUDGET:
            return False
        for o in steps[j].outs:
            todo.extend(readers.get(o, ()))
    on = set(users)
    todo = list(users)
    while todo:
        j = todo.pop()
        for k in steps[j].ins:
            p = producer.get(k)
            if p is not None and p != i and p in desc and p not in on:
                on.add(p)
                todo.append(p)
    for j in on:
        for k in steps[j].ins:
            p = producer.get(k)
            if p is None or (p != i and p not in on):
                continue
            if j in custom or not _accepts(steps[j], steps[p], fusing) or (p != i and p in blocked):
                return False
    return True


def _duplicated(
    steps: list[_Step],
    readers: dict[Key, list[int]],
    producer: dict[Key, int],
    outputs: Any,
    fusible: frozenset[str],
    fusing: frozenset[str],
    custom: frozenset[int] = frozenset(),
) -> dict[Key, frozenset[int]]:
    """The values XLA:CPU's instruction fusion recomputes inside the fusions reading them, each with those readers.

    XLA fuses consumers first and duplicates a producer into each consumer fusion that takes it in, keeping it
    for the readers that do not (a dot, a collective, the program's output), where the producer is cheap (not
    ``IsExpensive``) and duplicating it reads no more than its result does: it is at most unary, or its operands
    hold no more elements than it, or it fuses into every reader on every path (``ComputeGloballyUnfusible``).
    So a residual stream ``x = ln(x + f(x))`` is never materialised for the next layer's statistics and its
    residual add: each of those fusions recomputes it from the earlier layers' sums, which stay live
    (tests/test_memory_rules.py::test_residual_stream_is_recomputed_in_each_reader)."""
    blocked: set[int] = set()  # XLA's do_not_duplicate: steps whose results are read from one buffer by all
    out: dict[Key, frozenset[int]] = {}
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if len(step.outs) != 1 or step.name not in fusible:
            continue
        k = step.outs[0]
        users = set(readers.get(k, ()))
        if not users:
            continue
        # (The operands' elements first: a unary op's are its result's, and the test of its operands is not made.)
        if sum(map(_elements, set(step.ins))) > _elements(k) and not _at_most_unary(step, steps, producer):
            if not _fuses_on_all_paths(i, users, steps, readers, producer, blocked, fusing, custom):
                blocked.add(i)
                continue
        if not step.cheap or len(users) + (k in outputs) < 2:
            continue
        into = frozenset(r for r in users if r not in custom and _accepts(steps[r], step, fusing))
        if into:
            out[k] = into
    return out


def _rank(k: Key) -> int:
    aval = (k[1] if isinstance(k, tuple) else k).aval
    return len(getattr(aval, "shape", ()))


def _dead_steps(steps: list[_Step], outputs: Any) -> frozenset[int]:
    """The steps whose results nothing live reads (XLA's dead code elimination removes them).

    ``jax.grad`` keeps the forward's loss in the program though nothing reads it (``_ = reduce_sum c``): the
    values only it read (the squares of ``sum(y ** 2)``) are no buffers in XLA, and a value it shared with the
    gradient (``y``, read by the square and by ``2 * y``) is read once, so fuses into its live reader.
    A step with no results (an effect) is live."""
    needed: set[Key] = set(outputs)
    dead: set[int] = set()
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if step.outs and needed.isdisjoint(step.outs):
            dead.add(i)
            continue
        needed.update(step.ins)
    return frozenset(dead)


# XLA:CPU makes ``random_bits`` (a threefry hash of a typed key) in a while loop over two u32 state words per
# element of the bits, whatever their width up to 32 (8-, 16- and 32-bit bits measured alike), and reads both words
# in the fusion that consumes the bits (shift, or, the uniform's and the mask's arithmetic): the bits are never a
# buffer of their own.  Each trip copies both words before it writes the next pair: four words while the loop runs.
_BITS_WORDS = 2
# While the threefry loop runs, XLA:CPU holds besides its two state words one more per element (the body's
# temporary) and, where the bits are read in a fusion, one more of the walk's: the reader's result, which XLA
# allocates apart from its temporaries before the loop runs (the walk makes it after).  Where the bits are the
# program's output, that buffer is theirs, counted by the walk (:func:`_loop_bytes`).
_BITS_LOOP_WORDS = 4
# The threefry loop's own small buffers (XLA:CPU buffer assignment, every buffer 64-byte aligned): six per-key u32
# arrays (the key words, their XOR, the counters' high words: one u32 per key the device hashes) and the loop's
# tuple, round constants and counters (388 bytes).  Measured on one-op ``vmap`` of bits (16,) over 16-256 keys,
# whole and split over 8 devices: the loop's buffers are exactly 3 words + 6 per-key arrays + 388 bytes
# (tests/test_prng_rules.py); on ``x * bernoulli(key, 0.9, x.shape)``: 772 bytes beside the words.
_BITS_KEY_ARRAYS, _BITS_LOOP_FIXED, _ALIGN = 6, 388, 64
# The key impls whose random_bits XLA:CPU computes in that loop (rbg and unsafe_rbg draw theirs with
# RngBitGenerator: no loop of this shape).
_THREEFRY_BITS = frozenset({"threefry2x32"})


# A value with at most this many elements is a key's (a typed key, its u32[2] data, a split's pair, a fold-in's
# counter): bits that read nothing larger are made from the key alone.
_KEY_ELEMENTS = 64


def _random_bits(
    steps: list[_Step], dead: frozenset[int], outputs: Any, producer: dict[Key, int]
) -> tuple[tuple[int, Key, bool], ...]:
    """The random bits the program makes (step, bits, whether made from the key alone and read by the program),
    the dead left out.

    Bits that read only a key (nothing larger, transitively) are made by XLA at the start of the step: its
    scheduler runs the threefry loops before anything else, each loop's two words then held to the fusion that
    reads the bits.  Measured on XLA:CPU (buffer assignment): ``x * bernoulli(key, 0.9, x.shape)`` holds x, the
    result and three or four words of x's elements (the loop's pair and its copies), split or not; two dropouts
    with a dot between run both loops first (six words at the peak, the first pair's four beside the second's
    copies); the GPT-2 decoder's seven dropouts (keras-hub, FSDP) all run before its first layer.
    """
    out = []
    for i, step in enumerate(steps):
        if step.name != "random_bits" or i in dead or not step.outs:
            continue
        # (An output is a buffer, made by the loop's last fusion where the loop runs: never made first.)
        out.append((i, step.outs[0], step.outs[0] not in outputs and _from_key_alone(i, steps, producer)))
    return tuple(out)


def _from_key_alone(i: int, steps: list[_Step], producer: dict[Key, int]) -> bool:
    """Whether step ``i`` reads, transitively, only values of at most ``_KEY_ELEMENTS`` elements."""
    todo, seen = list(steps[i].ins), set()
    while todo:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        shape = getattr((k[1] if isinstance(k, tuple) else k).aval, "shape", ())
        if math.prod(int(n) for n in shape) > _KEY_ELEMENTS:
            return False
        j = producer.get(k)
        if j is not None:
            todo.extend(steps[j].ins)
    return True


# How far the bits' split is looked for along the elementwise ops that read them (a mask is a few ops from its use).
_BITS_READERS = 32


def _elementwise_from(
    k: Key, steps: list[_Step], readers: dict[Key, list[int]], fusible: frozenset[str]
) -> tuple[Key, ...]:
    """The values of ``k``'s shape that elementwise ops make from it, transitively (at most ``_BITS_READERS``)."""
    shape = getattr(_aval(k), "shape", None)
    out: list[Key] = []
    todo, seen = [k], {k}
    while todo and len(out) < _BITS_READERS:
        for r in readers.get(todo.pop(0), []):
            if steps[r].name not in fusible and steps[r].name != "bitcast_convert_type":
                continue  # (a bitcast of the same shape: the uniform's u32 -> f32)
            for o in steps[r].outs:
                if o not in seen and getattr(_aval(o), "shape", None) == shape:
                    seen.add(o)
                    out.append(o)
                    todo.append(o)
    return tuple(out)


def _aval(k: Key) -> Any:
    return (k[1] if isinstance(k, tuple) else k).aval


def _bits_word_bytes(k: Key, lay: Layout | None) -> int:
    """The bytes of one threefry state word for the bits ``k`` per device: 4 per element of its piece.

    ``lay``: the most split layout of the values of the bits' shape that elementwise ops make from them (else
    the bits' own): on Auto axes XLA's sharding propagation gives the bits that split (the threefry loop is
    elementwise in its counters: ``x[64@a, 128] * bernoulli(key, 0.9, x.shape)`` makes each device's eighth,
    measured; ``x * normal(key, x.shape)`` too, through the normal's ``erf_inv``).
    Where the mesh's axes are all Explicit the bits' type is their layout instead (JAX types ``bernoulli``'s
    bits replicated: XLA makes them whole on every device and slices its piece in the reader's fusion, measured
    on the same program: four whole words)."""
    aval = _aval(k)
    shape = tuple(int(n) for n in getattr(aval, "shape", ()))
    typed = _typed_shard_shape(aval)
    if typed is not None:
        shape = typed
    elif lay is not None and not is_free(lay):
        shape = tuple(int(n) for n in lay.shard_shape)
    return math.prod(shape) * 4


def _aligned(n: int) -> int:
    """``n`` bytes as XLA:CPU allocates them: in 64-byte aligned buffers."""
    return -(-n // _ALIGN) * _ALIGN


def _bits_impl(step: _Step) -> str | None:
    """The impl of the keys a ``random_bits`` step draws from (``'threefry2x32'``, ``'rbg'``, ...)."""
    return getattr(getattr(getattr(_aval(step.ins[0]), "dtype", None), "_impl", None), "name", None)


def _loop_bytes(step: _Step, word: int, is_output: bool, keys: Layout | None) -> int:
    """What a ``random_bits`` step holds while its threefry loop runs, beyond the two state words it then keeps
    (``word``: one u32 per element of the bits on the device; ``keys``: the key batch's layout).

    Two more words (:data:`_BITS_LOOP_WORDS`; one where the bits are the output, whose buffer is theirs) and the
    loop's small buffers, each 64-byte aligned: the words (a piece under 64 bytes still takes 64), six per-key
    arrays and 388 fixed bytes (:data:`_BITS_KEY_ARRAYS`, measured on one-op programs)."""
    shape = keys.shard_shape if keys is not None and not is_free(keys) else getattr(_aval(step.ins[0]), "shape", ())
    per_key = _aligned(4 * math.prod(int(n) for n in shape))
    words = (_BITS_LOOP_WORDS - (1 if is_output else 0)) * _aligned(word) - _BITS_WORDS * word
    return words + _BITS_KEY_ARRAYS * per_key + _BITS_LOOP_FIXED


def _typed_shard_shape(aval: Any) -> tuple[int, ...] | None:
    """The piece of ``aval`` per device its type names, where every axis of its mesh is Explicit (else None)."""
    sharding = getattr(aval, "sharding", None)
    mesh: Any = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if not types or not all("Explicit" in str(t) for t in types):
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    spec = list(getattr(sharding, "spec", ())) + [None] * len(aval.shape)
    out = []
    for n, entry in zip(aval.shape, spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(-(-int(n) // math.prod(sizes[a] for a in names)))
    return tuple(out)


def _peak(
    prog: _Program,
    layouts: dict[Any, Layout],
    elsewhere: frozenset[Key] = frozenset(),
    results_elsewhere: bool = False,
    tiling: Tiling = "dense",
    memo: SummaryMemo | None = None,
    whole_sums: bool | None = None,
) -> int:
    """The liveness walk over a flattened program (or a loop body: ``elsewhere`` inputs and, with
    ``results_elsewhere``, its results are the loop's buffers, held outside it; they count 0 here).

    ``memo``: walk the program stretch by stretch (:mod:`.peak_summary`), each stretch's walk summarised once
    per structure and numbers and reused; the same peak as the whole-program walk.
    ``whole_sums``: a sum that lands split holds its whole sum beside the slice (:func:`_whole_sum_beside`);
    None: on the dense tiling (XLA:CPU's; a loop body's walk, which is given no profile, so far)."""
    steps, outputs = prog.steps, prog.outputs
    if whole_sums is None:
        whole_sums = tiling == "dense"
    # Buffer bytes by (shape, split, type, tiles): the thousands of values of a deep model share a few dozen.
    by_shape: dict[tuple[Any, ...], int] = {}

    def nbytes_as(k: Key, lay: Layout | None, tiles: Tiling = "dense") -> int:
        aval = (k[1] if isinstance(k, tuple) else k).aval
        if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
            return 0
        if lay is not None and is_free(lay):
            # A broadcast constant: XLA fuses it into its consumers (and sinks it into
            # loops that take it as an invariant), it is not materialised.
            return 0
        # The mesh by identity (the walk's layouts share one tuple; an equal one elsewhere only misses): hashing
        # its axes for each of a deep model's tens of thousands of buffers per costing cost more than the sizing.
        token = (
            (tuple(aval.shape), None, aval.dtype, tiles)
            if lay is None
            else (lay.shape, lay.dims, id(lay.mesh), aval.dtype, tiles)
        )
        hit = by_shape.get(token)
        if hit is None:
            shape = lay.shard_shape if lay is not None else tuple(aval.shape)
            hit = by_shape[token] = buffer_bytes(tuple(shape), dtype_itemsize(aval.dtype), tiles)
        return hit

    # The program's arguments and outputs are buffers in device memory, padded to the device's tiles (on a TPU
    # exactly as its memory_analysis() says, tests/test_target_tpu_model.py); its temporaries keep their own
    # bytes: the TPU compiler holds small fused intermediates on chip (a whole kh_llama TP forward: 0 bytes of
    # temporaries), and padding them overstated the external corpus' peaks 1.5-5x (docs/targets.md).
    boundary = frozenset(prog.args) if tiling != "dense" else frozenset()

    def size(k: Key) -> int:
        if k in elsewhere or (results_elsewhere and k in outputs):
            return 0
        out = outputs.get(k)
        if out is not None:
            # An output is a buffer even where its layout is free (random bits from a whole key, whose readers
            # would choose their split): XLA makes it whole, as the walk's result layout says.
            lay = layouts.get(out)
            return nbytes_as(k, None if lay is not None and is_free(lay) else lay, tiling)
        return nbytes_as(k, prog.layout(k), tiling if k in boundary else "dense")

    def is_free_key(k: Key) -> bool:
        lay = prog.layout(k)
        return lay is not None and is_free(lay)

    free = {k: is_free_key(k) for k in prog.bases}
    # YNNPACK is XLA:CPU's alone: a TPU's or a GPU's compiler fuses its reductions itself.  Whether the compiler is
    # XLA:CPU is what ``whole_sums`` already says (the profile's reduce_scatter='all-reduce'; a loop body's walk, given
    # no profile, as the tiling's compiler: dense is XLA:CPU's).
    ynn = _ynn_reductions(prog) if tiling == "dense" and whole_sums else frozenset()
    pools, gather_major = (
        _written_gather_major(prog) if tiling == "dense" and whole_sums else (frozenset(), frozenset())
    )
    if pools:
        ynn -= pools
    live_key = (tuple(free.items()), ynn, gather_major)
    info = prog.liveness.get(live_key)
    if info is None:
        info = prog.liveness[live_key] = _liveness(prog, free, ynn, gather_major)
    fused, until, dies, leaves, donor_of = info.fused, info.until, info.dies, info.leaves, info.donors
    fusible = _fusible_elementwise()
    args = set(prog.args)
    # A loop body's all-reduces combined into one (its partial sums and sums held together there).
    combined = _combined_at(prog, until, size, whole_sums) if results_elsewhere else {}

    # Gathered copies of arguments, live from the start to the argument's last use.
    gathered = dict(prog.gathered)
    for v in prog.args:
        copy = layouts.get(Gathered(v))
        if copy is not None:
            gathered[v] = copy
    # A gathered copy is a buffer of its own beside its argument's (sized as its argument is, tiles and all): the
    # all-gather writes a temporary, and an argument's buffer is the caller's, never reused for one.  Measured
    # on tanh(x @ w) three layers deep, every w f32[64,64] split over 8 devices (XLA:CPU): the three gathered
    # f32[64,64] beside the three shards, 59396 B; the walk had counted each copy less its shard (0.90x).
    # In a loop body an argument is the iteration's slice of a stacked input (a temporary the loop makes each trip,
    # sized in the iteration's bytes), freed once gathered: the copy adds what it holds beyond the slice.
    extra_until = [
        (until[v], nbytes_as(v, c, tiling) - (size(v) if results_elsewhere else 0))
        for v, c in gathered.items()
        if v in until and v in args
    ]
    # The gathered copies of an argument's views (a weight's transpose or cast): gathered at the start as the
    # arguments are (:func:`_from_arguments`), each held to its value's last reader.
    if info.from_args:
        derived: dict[Key, Layout] = {}
        for path, d, lay in prog.bound_derived():
            if d.__class__ is Gathered:
                k = prog.key(d.of, path)
                if k in info.from_args and k in until:
                    old = derived.get(k)
                    if old is None or math.prod(lay.shard_shape) > math.prod(old.shard_shape):
                        derived[k] = lay
        extra_until.extend((until[k], nbytes_as(k, c)) for k, c in derived.items())
    # The broadcast constants YNNPACK fusions read materialised: made at the start, held to their last reader.
    extra_until.extend((end, nbytes_as(k, prog.layout(k))) for end, k in info.ynn_constants)
    # A convolution's input the program makes, gathered for it: the all-gather's result and (gathered along a
    # minor dimension) its copy back to row-major, while the convolution runs (_conv_gather_bytes).
    for i, k, last, names in info.conv_inputs:
        extra = _conv_gather_bytes(prog, steps[i], k, names, last, size, nbytes_as, fused)
        if extra:
            combined = dict(combined)
            combined[i] = combined.get(i, 0) + extra
    # A dot's operand the program makes, gathered for that dot: held from the value's first reader to the last dot
    # gathering it (XLA:CPU's scheduling: _dot_gather_holds), its row-major copy while it is gathered.  Added where
    # the copy is made and freed where its last dot runs, as a buffer is (not step by step: a copy held from a deep
    # model's forward to its backward would make every layer's stretch between them a walk of its own).
    hold_starts: dict[int, int] = {}
    hold_ends: dict[int, int] = {}
    if not results_elsewhere and tiling == "dense" and whole_sums:
        for made_at, freed_at, b, back in _dot_gather_holds(prog, info, nbytes_as):
            hold_starts[made_at] = hold_starts.get(made_at, 0) + b
            hold_ends[freed_at] = hold_ends.get(freed_at, 0) + b
            if back:
                combined = dict(combined)
                combined[made_at] = combined.get(made_at, 0) + b
        # A max pool's gradient whose operand the program makes: XLA:CPU's expansion of it scheduled apart
        # (_pool_gradient_holds).
        for made_at, at, iotas, indices, pooled, padding in _pool_gradient_holds(prog, info, steps):
            out = size(steps[at].outs[0]) if steps[at].outs else 0
            extra_until.append((made_at, iotas))  # the index arrays, made at the start, to the arg-max
            if out and at > 0:
                # The scatter's zeros, made at the start: its result's buffer (padded as the operand is, sliced after).
                extra_until.append((at - 1, out + padding))
            hold_starts[made_at] = hold_starts.get(made_at, 0) + indices
            hold_ends[at] = hold_ends.get(at, 0) + indices
            combined = dict(combined)
            # While the arg-max runs: its pooled values, and the operand padded for it (a copy where it pads).
            combined[made_at] = combined.get(made_at, 0) + pooled + (padding + out if padding else 0)
    for i in info.ynn_convs:
        extra = _ynn_conv_copies(prog, info, steps, i, size, nbytes_as, fusible)
        if extra:
            combined = dict(combined)
            combined[i] = combined.get(i, 0) + extra
    # Random bits: those made from the key alone are made first (their loops before anything else), their words
    # held from the start to their reader; the others where the program makes them (_random_bits).
    # Bits that are the program's output are a buffer of their own, made by the fusion that reads the loop's words
    # at the loop's step: their words are held there only.
    start_loops = [0]
    for i, k, first, spread in info.bits:
        if _bits_impl(steps[i]) not in _THREEFRY_BITS:
            continue  # rbg's RngBitGenerator: XLA:CPU expands it into its readers' elementwise loop, nothing held
        word = min(_bits_word_bytes(k, prog.layout(m)) for m in (k, *spread))
        held, loop = _BITS_WORDS * word, _loop_bytes(steps[i], word, k in outputs, prog.layout(steps[i].ins[0]))
        if first:
            extra_until.append((until[k], held))
            start_loops.append(loop)
        else:
            combined = dict(combined)
            combined[i] = combined.get(i, 0) + loop
            for j in range(i, (i if k in outputs else until[k]) + 1):
                combined[j] = combined.get(j, 0) + held

    live: dict[Key, int] = {v: size(v) for v in prog.args}
    total = sum(live.values())
    held = 0  # partial sums waiting for the combined all-reduce
    gathered_now = sum(b for _, b in extra_until)
    gathered_ends: dict[int, int] = {}
    for end, b in extra_until:
        gathered_ends[end] = gathered_ends.get(end, 0) + b
    # The gathered copies an elementwise or in-place step may write its result into, by step (their bytes): the
    # copy is XLA's temporary and dies at that step, so buffer assignment shares it with the result as it does
    # a dying operand's.  Measured on where(a > 0, a, b), a f32[24,16] split 8 ways and gathered whole (XLA:CPU:
    # the select written into a's gathered copy, 4080 B; the walk had held the copy beside the result, 5184 B).
    # (At the top level only: a loop body's copy is counted as what it adds to the trip's slice.)
    into_copies: dict[int, tuple[int, ...]] = {}
    if not results_elsewhere:
        for i, vs in info.copy_donors.items():
            bs = tuple(nbytes_as(v, gathered[v], tiling) for v in vs if v in gathered)
            if bs:
                into_copies[i] = bs
    # While it gathers, one argument gathered along a dimension other than its major one is held twice more.
    transposing = [
        size(v)
        + (0 if _reads_any_layout([steps[r].name for r in info.readers.get(v, [])]) else nbytes_as(v, c, tiling))
        for v, c in gathered.items()
        if v in args and _gathers_minor(v, c, layouts)
    ]
    # (The start's random-bits loops run one after another, with every earlier loop's words live.)
    peak = total + gathered_now + max([*transposing, *start_loops])

    # The pending partial sums bound in this costing (a few hundred, where a deep model's gradients have thousands of
    # values on their way out: prog.layout(k, Partial) for each of those made a key object each, per costing).
    partials = {
        ((path, d.of) if path else d.of): lay for path, d, lay in prog.bound_derived() if d.__class__ is Partial
    }

    held_of: dict[Key, int] = {}

    def held_bytes(k: Key) -> int:
        """The bytes of ``k``'s pending partial sum, held until the combined all-reduce (0: none)."""
        b = held_of.get(k)
        if b is None:
            part = partials.get(k)
            b = held_of[k] = nbytes_as(k, part) if part is not None else 0
        return b

    # A lone sum: the program's one partial sum that only leaves it.  XLA's all-reduce combiner has nothing to
    # combine it with, so its all-reduce runs right after the step that makes the partial (once that step's
    # operands are freed) and the partial is freed after it: partial then sum, not both held to the end.
    # Measured on grad(lambda w, x: mean((x @ w) ** 2)) with x's batch split (XLA:CPU: the partial dW, its
    # all-reduce and the transposed output share two 8 KiB buffers; tests/test_memory_rules.py).  Two or more
    # wait for the combined all-reduce as the module says.  A loop body's sums are _combined_at's.
    # (Asked of the bound partial sums, a few hundred, not of every value on its way out: thousands in a deep model.)
    leaving = [k for k in partials if k in leaves]
    # (Whether there is one: the search stops at the second, of the hundreds a deep model's gradients leave.)
    leaving_sums = (
        list(itertools.islice((k for k in leaving if k not in fused and held_bytes(k) and size(k)), 2))
        if not results_elsewhere
        else []
    )
    lone = len(leaving_sums) == 1
    # More than one: XLA's combiner issues them as one all-reduce once the last partial is made, and frees every
    # partial after it (the outputs made from the sums are written into them).  Measured on the data-parallel
    # gradient of two dense layers: the two partials and the two sums live at the tuple all-reduce, the
    # transposed outputs then in the partials' buffers (tests/test_memory_rules.py; the walk had held the
    # partials to the end beside the outputs: 1.16x XLA's peak).
    release_at, released, widened = -1, 0, 0
    if not results_elsewhere and not lone:
        # (One lookup of each producer and one call per sum: the few hundred gradients of a deep model leave.)
        made: list[tuple[int, int, Key]] = []
        producers = info.producer
        for k in leaving:
            made_step = producers.get(k)  # (a step's index: None only where no step makes it)
            if made_step is not None:
                b = held_bytes(k)
                if b:
                    made.append((made_step, b, k))
        if made:
            release_at, released = max(i for i, _, _ in made), sum(b for _, b, _ in made)
            widened = sum(_whole_sum_beside(b, size(k), whole_sums) for _, b, k in made) if whole_sums else 0

    def while_running(i: int) -> int:
        """The bytes step ``i`` holds only while it runs: a partial sum next to its sum where the step's result is
        all-reduced (XLA:CPU's all-reduce writes a new buffer; a sum that only leaves the program waits for the
        combiner instead: ``held_bytes``), and the send and receive pieces of an operand it moves by an
        all-to-all."""
        extra = combined.get(i, 0)
        for k in steps[i].outs:
            part = prog.layout(k, Partial)
            if part is not None and k not in leaves and k not in fused and size(k):
                b = nbytes_as(k, part)
                extra += b + _whole_sum_beside(b, size(k), whole_sums)
            sent = prog.layout(k, Sent)
            if sent is not None:
                extra += _sent_buffers(steps[i], k, nbytes_as(k, sent), size, dies.get(i, ()))
        return extra

    def walk(
        lo: int,
        hi: int,
        live: dict[Key, int],
        running: Callable[[int, int], int] | None = None,
        summing: Callable[[int, int], int] | None = None,
    ) -> Summary:
        """Steps ``lo`` to ``hi`` from the buffers ``live`` (updated), relative to the bytes live at ``lo``;
        ``running(i, 0)``: what step ``i`` holds while it runs, where known (else ``while_running``);
        ``summing(i, 0)``: the bytes of the sums its results are all-reduced into (:func:`_running_bytes`)."""
        total = held = gathered_now = 0
        top: int | None = None
        for i in range(lo, hi):
            step = steps[i]
            if hold_starts:
                gathered_now += hold_starts.get(i, 0)
            donors = None
            copies: list[int] | None = None  # the gathered copies dying here its results may be written into
            taken = 0  # the bytes of those its results took (no longer the copies', freed with them)
            later = part_now = 0  # a lone sum made here: its sum's bytes (made after the step), its partial's
            for k in step.outs:
                b = 0 if k in fused else size(k)
                if b and (step.name in fusible or step.name in _UPDATES_IN_PLACE):
                    # XLA writes an elementwise result (or a scatter's, or an update's) into an operand's
                    # buffer that dies here, when it is as large (buffer assignment's operand sharing).
                    if donors is None:
                        donors = list(donor_of[i])
                    for d in donors:
                        if live.get(d) == b:
                            total -= live.pop(d)
                            donors.remove(d)
                            break
                    else:
                        if copies is None:
                            copies = list(into_copies.get(i, ()))
                        if b in copies:
                            copies.remove(b)
                            gathered_now -= b
                            taken += b
                live[k] = b
                total += b
                if k in leaves:
                    if lone and b and k not in fused and held_bytes(k):
                        later, part_now = b, held_bytes(k)
                    else:
                        held += held_bytes(k)
            here = total - later + part_now + gathered_now + held + step.inside
            here += while_running(i) if running is None else running(i, 0)
            summed = 0 if summing is None else summing(i, 0)
            if summed:
                # XLA's all-reduce is an instruction after the step: the step's operands that die there are freed
                # before it runs, so the peak is the larger of (operands + partial) and (partial + sum), not all
                # three (measured: a tensor-parallel layer's second dot, its operand's buffer reused for the sum).
                freed = sum(live.get(k, 0) for k in dies.get(i, ()) if k not in step.outs)
                here -= min(summed, freed)
            if top is None or here > top:
                top = here
            gathered_now -= gathered_ends.get(i, 0) - taken
            if hold_ends:
                gathered_now -= hold_ends.get(i, 0)
            for k in dies.get(i, ()):
                total -= live.pop(k, 0)
            if part_now:  # the lone all-reduce, its operands' step done: the partial next to its sum
                # A sum that lands split finer than its partial (a reduce-scatter) is all-reduced whole by XLA:CPU,
                # then sliced: the whole sum is held next to the partial, not the piece (measured: the gradient of
                # x.at[i].add(u), u[8@a, 16]: all-reduce f32[8, 16], then the output's f32[1, 16] slice).
                after = total - later + part_now + max(later, part_now) + gathered_now + held
                if top is None or after > top:
                    top = after
            if i == release_at:  # the combined all-reduce: every partial next to every sum, then freed
                after = total + gathered_now + held + widened
                if top is None or after > top:
                    top = after
                held -= released
        return Summary(total, held, -gathered_now, top)

    start = total + gathered_now + held
    if memo is None:
        sums: dict[int, int] = {}
        _running_bytes(prog, info, size, nbytes_as, sums, whole_sums)
        sums = _lone_sums(prog, info, live_key, sums)
        return fold(peak, [walk(0, len(steps), live, None, sums.get)], start)
    plan = prog.stretches.get(live_key)
    if plan is None:
        plan = prog.stretches[live_key] = _stretches_of(prog, info, memo.forms)
    sizing_key = (live_key, tiling, elsewhere, results_elsewhere)
    sizing = prog.sizings.get(sizing_key)
    if sizing is None:
        sizing = prog.sizings[sizing_key] = _sizing_of(
            prog, plan, info, elsewhere, results_elsewhere, tiling, memo.forms
        )
    # The environments a slot names by number: the outputs' (``layouts``), the top level's, each call's.
    envs = [layouts, prog.layouts, *(prog.inner[p] for p in sizing.paths)]
    # Bytes by layout object: a deep model's buffers share a few hundred layouts (a replayed layer binds the
    # layouts its first copy's walk made), so most slots are one dict read here, not a sizing.
    by_lay: dict[tuple[int, int, str], int] = {}

    def sized(slots: tuple[_Slot, ...]) -> tuple[int, ...]:
        """The bytes of the buffers ``slots`` name, as :func:`size` (``alloc``) gives them."""
        out = []
        for e, v, k, item, tiles, unlaid in slots:
            if e < 0:
                out.append(0)
                continue
            lay = envs[e].get(v)
            if lay is None:
                out.append(unlaid)
                continue
            token = (id(lay), item, tiles)
            b = by_lay.get(token)
            if b is None:
                b = by_lay[token] = nbytes_as(k, lay, tiles)
            out.append(b)
        return tuple(out)

    # Bytes by layout object, and by layout (class, shape, split, mesh) for an object not met yet in this costing:
    # the walk makes new objects each costing, but a deep model's thousands of them are a few dozen layouts.
    by_class: dict[tuple[int, Tiling], dict[int, int]] = {}
    by_value: dict[tuple[Any, ...], int] = {}

    def grouped(groups: tuple[tuple[int, int, Tiling, tuple[Any, ...], tuple[Key, ...], tuple[int, ...]], ...]) -> Any:
        """The bytes of a stretch's buffers, group by group (as ``sized`` gives them, in the groups' order)."""
        out = []
        for e, item, tiles, vs, ks, unlaid in groups:
            get = envs[e].get
            known = by_class.get((item, tiles))
            if known is None:
                known = by_class[(item, tiles)] = {}
            found = tuple(map(known.get, map(id, map(get, vs))))  # (at C speed: most layouts are met already)
            if None not in found:
                out.append(found)
                continue
            # A layout not met yet in this costing, or none bound.
            lays = list(map(get, vs))
            bs = list(found)
            for j, b in enumerate(bs):
                if b is None:
                    lay = lays[j]
                    if lay is None:
                        bs[j] = unlaid[j]
                    else:
                        token = (lay.__class__, lay.shape, lay.dims, id(lay.mesh), item, tiles)
                        b = by_value.get(token)
                        if b is None:
                            b = by_value[token] = nbytes_as(ks[j], lay, tiles)
                        bs[j] = known[id(lay)] = b
            out.append(tuple(bs))
        return tuple(out)

    # What the steps hold only while they run: found from the few partial sums and moves the layouts bind, not
    # asked of every step (while_running is 0 at a step whose results have neither).
    sums = {}
    running = _running_bytes(prog, info, size, nbytes_as, sums, whole_sums)
    sums = _lone_sums(prog, info, live_key, sums)
    for i, b in combined.items():  # a loop body's combined all-reduce (while_running's ``combined``)
        running[i] = running.get(i, 0) + b
    # By stretch: (offset, bytes, bytes of its sums) of its steps that hold any.
    at_stretch: dict[int, list[tuple[int, int, int]]] = {}
    for i in sorted(running):
        at = bisect.bisect_right(sizing.starts, i) - 1
        at_stretch.setdefault(at, []).append((i - plan[at].start, running[i], sums.get(i, 0)))
    # By stretch: (offset, bytes made, bytes freed) of its steps where a dot's gathered operand is made or freed.
    holds_at: dict[int, list[tuple[int, int, int]]] = {}
    for i in sorted(hold_starts.keys() | hold_ends.keys()):
        at = bisect.bisect_right(sizing.starts, i) - 1
        holds_at.setdefault(at, []).append((i - plan[at].start, hold_starts.get(i, 0), hold_ends.get(i, 0)))
    partial_keys = partials.keys()  # (held_bytes is 0 for a key none of whose partial sums is bound)
    no_bytes, no_copies = itertools.repeat(0), itertools.repeat(())
    runs: list[list[Any]] = []  # [summary, count]: consecutive stretches walked alike, folded in one step
    for at, (s, (_, entering_slots)) in enumerate(zip(plan, sizing.slots)):
        numbers = (
            sizing.order[at],
            grouped(sizing.groups[at]),
            # (Most stretches' leaving values hold no partial sum in a costing: their zeros without a call each.)
            (0,) * len(s.leaves) if partial_keys.isdisjoint(s.leaves) else tuple(map(held_bytes, s.leaves)),
            tuple(steps[i].inside for i in s.sized),
            tuple(map(gathered_ends.get, s.ends, no_bytes)),  # (.get(i, 0) per end, at C speed)
            tuple(map(into_copies.get, s.ends, no_copies)),
            # By the layouts of their partial sums and moves (the steps that hold any, by offset).
            tuple(at_stretch.get(at, ())),
            tuple(holds_at.get(at, ())),
            lone,
            (release_at - s.start, released, widened) if s.start <= release_at < s.stop else None,
        )
        known = memo.get((s.form, numbers))
        if known is None:
            entering = dict(zip(s.entering, sized(entering_slots)))
            known = memo.put((s.form, numbers), walk(s.start, s.stop, entering, running.get, sums.get))
        if runs and runs[-1][0] == known:
            runs[-1][1] += 1
        else:
            runs.append([known, 1])
    memo.sized += len(by_shape)  # the buffer sizings this costing computed (by shape, split, type, tiles)
    return fold_runs(peak, [(r[0], r[1]) for r in runs], start)


# A buffer as a costing sizes it: (its environment's number, the key its layout is bound to there, the buffer's
# key, its element's bytes, its tiling, its bytes when no layout is bound); environment -1: it holds none.
_Slot = tuple[int, Any, Any, int, Tiling, int]


@dataclass(frozen=True)
class _Sizing:
    """Where a costing reads the layouts of each stretch's buffers (made by it, and live when it starts): found
    once per flattening, liveness and sizing context, so that a costing sizes them without resolving each key."""

    paths: tuple[tuple[int, ...], ...]  # the calls whose environments the slots read (numbers 2, 3, ...)
    starts: tuple[int, ...]  # each stretch's first step
    slots: tuple[tuple[tuple[_Slot, ...], tuple[_Slot, ...]], ...]  # by stretch: (made, entering)
    # By stretch, its buffers (made, then entering; those that hold nothing left out) grouped by environment,
    # element bytes and tiling, so that a costing reads a group's layouts and bytes in a few C-level passes:
    # (environment, element bytes, tiling, the keys read, the buffers' keys, their bytes with no layout bound).
    groups: tuple[tuple[tuple[int, int, Tiling, tuple[Any, ...], tuple[Key, ...], tuple[int, ...]], ...], ...]
    # By stretch, which slot each grouped byte is (interned): with the stretch's form, it makes the grouped bytes
    # name the same buffers that its slots' bytes in order name, so that either keys its summary.
    order: tuple[int, ...]


def _sizing_of(
    prog: _Program,
    plan: tuple[Stretch, ...],
    info: _Liveness,
    elsewhere: frozenset[Key],
    results_elsewhere: bool,
    tiling: Tiling,
    forms: dict[Any, int],
) -> _Sizing:
    """Each stretch's slots: ``size(k)`` of :func:`_peak` taken apart into what a costing reads (a layout)."""
    outputs = prog.outputs
    boundary = frozenset(prog.args) if tiling != "dense" else frozenset()
    paths: dict[tuple[int, ...], int] = {}

    def slot(k: Key, fused: bool) -> _Slot:
        aval = _aval(k)
        if fused or k in elsewhere or (results_elsewhere and k in outputs):
            return (-1, None, k, 0, "dense", 0)
        if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
            return (-1, None, k, 0, "dense", 0)
        item = dtype_itemsize(aval.dtype)
        out = outputs.get(k)
        laid = k.like if isinstance(k, _LAID_AS_ANOTHER) else k  # (a broadcast as its reader's result, ...)
        if out is not None:
            e, v, tiles = 0, out, tiling
        elif isinstance(laid, tuple):
            e, v, tiles = 2 + paths.setdefault(laid[0], len(paths)), laid[1], "dense"
        else:
            e, v, tiles = 1, laid, tiling if k in boundary else "dense"
        # (A tuple key is a call's value: never an argument of the program, so never on the boundary.)
        return (e, v, k, item, tiles, buffer_bytes(tuple(aval.shape), item, tiles))

    fused = info.fused
    slots = tuple((tuple(slot(k, False) for k in s.made), tuple(slot(k, k in fused) for k in s.entering)) for s in plan)
    groups, order = [], []
    for made, entering in slots:
        by: dict[tuple[int, int, Tiling], list[tuple[int, _Slot]]] = {}
        for n, sl in enumerate((*made, *entering)):
            if sl[0] >= 0:
                by.setdefault((sl[0], sl[3], sl[4]), []).append((n, sl))
        groups.append(
            tuple(
                (
                    e,
                    item,
                    tiles,
                    tuple(sl[1] for _, sl in members),
                    tuple(sl[2] for _, sl in members),
                    tuple(sl[5] for _, sl in members),
                )
                for (e, item, tiles), members in by.items()
            )
        )
        where = (len(made), tuple(tuple(n for n, _ in members) for members in by.values()))
        # (interned with the memo's stretch forms: one numbering for every program the memo keys)
        order.append(forms.setdefault(("grouped", where), len(forms)))
    return _Sizing(tuple(paths), tuple(s.start for s in plan), slots, tuple(groups), tuple(order))


def _whole_sum_beside(partial: int, result: int, whole_sums: bool = True) -> int:
    """The bytes of the whole sum XLA:CPU's all-reduce writes beside a sum's result, where that result is a slice
    of it: a partial sum that lands split finer than it is (a reduce-scatter) is all-reduced whole and sliced after.

    XLA:CPU makes no reduce-scatter: the SPMD partitioner's all-reduce of the whole partial then a dynamic-slice
    of each device's piece.  Measured on the FSDP gradient of one layer on Explicit axes, tanh(x @ a) @ b with a,
    b split on their first axis over 4 devices (the weight gradients typed like the weights): the two whole
    partials and the two whole sums live at the tuple all-reduce, the outputs' slices beside them
    (tests/test_memory_rules.py).  0 where the sum is its result (all-reduced in place of a slice), and where the
    compiler reduce-scatters (``whole_sums`` False: the profile's ``reduce_scatter='native'``).  XLA:GPU's
    ReduceScatterCreator makes the partitioner's all-reduce + dynamic-slice one reduce-scatter; the TPU compiler
    fuses the pair into one all-reduce-scatter fusion whose whole sum never reaches HBM (measured through libtpu on
    the layer above: no temporaries at all; tests/test_memory_rules.py)."""
    return partial if whole_sums and partial > result else 0


def _sent_buffers(step: _Step, k: Key, sent: int, size: Callable[[Key], int], dying: Any) -> int:
    """The bytes step ``step`` (making ``k``) holds while it runs for an operand it moves by an all-to-all of
    ``sent`` bytes a device: XLA:CPU's send pieces and receive buffer, beside the step's operands and result.

    A convolution moves its operand before it runs (and, a depthwise conv under FSDP, its result back after it:
    rules_windows._depthwise_regroup), never both at once: an operand that dies there is freed once its pieces are
    sliced, and the result is written after the receive buffer is read, so besides what outlives the step it holds
    two blocks at a time (pieces and receive buffer, receive buffer and result), not its operand, its result and
    both buffers.  Measured on one-op depthwise convs (8,16,8,8) over 4 (memory_analysis()): the input an argument,
    25012 B = the arguments and two blocks; the input a relu's (which dies there), the same; a rule that added
    both buffers to the operand and result had 32912 and 41104 B (tests/test_conv_rules.py)."""
    if step.name != "conv_general_dilated":
        return 2 * sent
    freed = sum(size(d) for d in dying if d in step.ins and d not in step.outs)
    return max(0, 2 * sent - size(k) - freed)


def _running_bytes(
    prog: _Program,
    info: _Liveness,
    size: Callable[[Key], int],
    nbytes_as: Callable[[Key, Layout | None], int],
    sums: dict[int, int] | None = None,
    whole_sums: bool = True,
) -> dict[int, int]:
    """What each step holds only while it runs (``_peak``'s ``while_running``), for the steps that hold any: found
    from the partial sums and moved operands the environments bind (a few hundred), not asked of every step.
    ``sums`` gets, by step, the bytes of the sums its partial results are all-reduced into."""
    producer, leaves, fused, outputs = info.producer, info.leaves, info.fused, prog.outputs
    out: dict[int, int] = {}
    # The layers of a stack share their calls' environments and variables: a value's size is found once per
    # (environment, variable), a partial sum's or a move's bytes once per (layout object, variable).
    sizes: dict[tuple[int, Any], int] = {}
    moved: dict[tuple[int, Any], int] = {}
    for path, key, lay in prog.bound_derived():
        kind = key.__class__
        if kind is not Partial and kind is not Sent:
            continue
        v = key.of
        k = (path, v) if path else v
        i = producer.get(k)
        if i is None:
            continue  # not a step's result (a call's operand or result, aliased): no step reads it so
        if kind is Partial:
            if k in leaves or k in fused:
                continue
            if k in outputs:
                held = size(k)
            else:
                env = id(prog.inner[path] if path else prog.layouts)
                held = sizes.get((env, v), -1)
                if held < 0:
                    held = sizes[(env, v)] = size(k)
            if not held:
                continue
            if sums is not None:
                sums[i] = sums.get(i, 0) + held
        b = moved.get((id(lay), v))
        if b is None:
            b = moved[(id(lay), v)] = nbytes_as(k, lay)
        if kind is Sent:
            b = _sent_buffers(prog.steps[i], k, b, size, info.dies.get(i, ()))
        else:
            b += _whole_sum_beside(b, held, whole_sums)
        if b:
            out[i] = out.get(i, 0) + b
    return out


def _lone_sums(prog: _Program, info: _Liveness, live_key: Any, sums: dict[int, int]) -> dict[int, int]:
    """``sums`` (by step, the bytes of the sums its partial results are all-reduced into) left to the all-reduces
    XLA runs alone, right after their step: each depends on the one before it and the one after depends on it
    (a tensor-parallel stack's layers).  Independent all-reduces (the projections of one hidden state) are
    combined into one tuple all-reduce, issued once the last partial is made: their steps' operands are not
    freed before it (measured: tests/test_primitive_rules_core.py's resplit projections)."""
    if not sums:
        return sums
    key = (live_key, frozenset(sums))
    alone = prog.lone_sums.get(key)
    if alone is None:
        order = sorted(sums)
        # Whether one step feeds the next is the flattening's and liveness' (its steps' values and readers), kept
        # by pair under ``live_key``: the sets of sums of a search's costings differ, their neighbouring pairs
        # mostly repeat (a deep stack's pairs of layers), and each search can walk thousands of steps.
        known = prog.lone_sums
        feeds = []
        for a, b in zip(order, order[1:]):
            pair = (live_key, a, b)
            reached = known.get(pair)
            if reached is None:
                reached = known[pair] = _reaches(a, b, prog.steps, info.readers)
            feeds.append(reached)
        alone = prog.lone_sums[key] = frozenset(
            i for n, i in enumerate(order) if (n == len(order) - 1 or feeds[n]) and (n == 0 or feeds[n - 1])
        )
    return {i: b for i, b in sums.items() if i in alone}


def _reaches(a: int, b: int, steps: list[_Step], readers: dict[Key, list[int]]) -> bool:
    """Whether step ``b`` reads what step ``a`` makes, transitively (the steps between them searched only)."""
    todo, seen = [a], set()
    while todo:
        j = todo.pop()
        for k in steps[j].outs:
            for r in readers.get(k, ()):
                if r == b:
                    return True
                if r < b and r not in seen:
                    seen.add(r)
                    todo.append(r)
    return False


def _stretches_of(prog: _Program, info: _Liveness, forms: dict[Any, int]) -> tuple[Stretch, ...]:
    """``prog``'s steps cut into stretches under the liveness ``info`` (:func:`.peak_summary.stretches`)."""
    steps = prog.steps
    # The steps whose scratch a costing may size anew (a loop's iteration, a window's or a dot's scratch), and
    # any other step with scratch (sized once, the flattening's): their bytes are a stretch's numbers.
    sized = frozenset(i for i, *_ in prog.loops)
    sized |= frozenset(i for i, *_ in prog.windows if i not in prog.fixed_scratch)
    sized |= frozenset(i for i, step in enumerate(steps) if step.inside)
    args = frozenset(prog.args)
    ends = frozenset(info.until[v] for v in args if v in info.until)
    ends |= frozenset(info.until[k] for _, k, first, _ in info.bits if first)  # (random bits made first)
    ends |= frozenset(info.until[k] for k in info.from_args if k in info.until)  # (their gathered copies)
    cut = Steps(
        [step.name for step in steps],
        [step.ins for step in steps],
        [step.outs for step in steps],
        info.producer,
        args,
        info.fused,
        info.leaves,
        info.donors,
        info.dies,
        sized,
        ends,
    )
    return stretches(cut, forms)


def _dot_steps(prog: _Program) -> dict[tuple[tuple[int, ...], int], tuple[int, Any]]:
    """The dot steps of ``prog`` by (call path, id of the dot's result): (step, equation).  Made once per steps'
    numbering (``step_facts``: shared by a flattening's rebounds, an absorbed variant's own)."""
    found = prog.step_facts.get("dots")
    if found is None:
        found = prog.step_facts["dots"] = {
            (path, id(eqn.outvars[0])): (i, eqn)
            for i, eqn, path in prog.windows
            if eqn.primitive.name == "dot_general" and eqn.outvars
        }
    return found


def _dot_gather_holds(
    prog: _Program, info: _Liveness, nbytes_as: Callable[[Key, Layout | None], int]
) -> list[tuple[int, int, int, bool]]:
    """The copies XLA:CPU holds of the dot operands the program makes and the walk all-gathers for a dot
    (values.GatheredLhs, GatheredRhs: an activation a weight-gradient dot reads whole along the split it had).

    XLA:CPU's scheduler issues such an all-gather early, right after the value's first reader (the forward's dot or
    elementwise op), and holds the gathered copy to the last dot reading it (the backward's weight gradient); where
    it gathers along a dimension other than the value's major one it also copies the gathered result back to
    row-major there (one more gathered size, while the gather runs).  One copy per value (CSE): the largest any of
    its dots gathers.  Measured on ``grad(lambda t, w: mean(square(x + tanh(x @ w))))``, x = t * 2 f32[8,8,32], w
    [32, 32@model] on a (4, 2) Auto mesh (tests/test_open_values.py's tanh_residual): XLA:CPU's temporaries at its
    peak are the gathered f32[8,8,32]{1,0,2} (all-gather right after the forward's dot) and its row-major copy,
    8 KiB each, besides the forward's product: 34836 B; the walk, which held neither, 24832 B (0.71x); with the
    copy held, 1.07x.  (On keras-hub's Falcon tensor-parallel gradient, the diagnosis' prototype: 0.70x -> 0.91x.)

    The copies: each its first and last step, its bytes, and whether it is copied back to row-major at its first."""
    dots = _dot_steps(prog)
    if not dots:
        return []
    readers, producer, fused = info.readers, info.producer, info.fused
    found: dict[Key, list[Any]] = {}  # by operand: [its gathering dots, its largest copy's bytes, that copy]
    for path, d, lay in prog.bound_derived():
        cls = d.__class__
        if cls is not DOT_GATHERED[0] and cls is not DOT_GATHERED[1]:
            continue
        at = dots.get((path, id(d.of)))
        if at is None or is_free(lay):
            continue
        i, eqn = at
        k = prog.key(eqn.invars[0 if cls is DOT_GATHERED[0] else 1], path)
        if k is None or k not in producer or k in fused or k in info.from_args or i not in readers.get(k, ()):
            # an argument or a view of one (gathered at the start: _peak's ``gathered``, ``from_args``), a fused
            # value, a dead dot
            continue
        b = nbytes_as(k, lay)
        row = found.get(k)
        if row is None:
            found[k] = [[i], b, lay]
        else:
            row[0].append(i)
            if b > row[1]:
                row[1], row[2] = b, lay
    out = []
    for k, (gathering, b, copy) in found.items():
        first, last = readers[k][0], max(gathering)
        # Gathered for its first reader: from there; else from the step after that reader.
        start = first if min(gathering) == first else min(first + 1, last)
        own = prog.layout(k)
        back = False
        # (Gathered at the dot itself, the copy it reads out of order is the dot's scratch: dot_scratch sizes it
        # from the gathered layout.  Measured on an FSDP MLP's step, tests/test_fsdp_gradient_rules.py: with the
        # row-major copy beside it too, 1.37x XLA's peak.)
        if own is not None and start < last:
            shape = tuple(int(n) for n in _aval(k).shape)
            major = next((d for d, n in enumerate(shape) if n > 1), 0)
            back = any(a != c for d, (a, c) in enumerate(zip(own.dims, copy.dims)) if d != major)
        out.append((start, last, b, back))
    return out


def _gathers_minor(v: Any, copy: Layout, layouts: dict[Any, Layout]) -> bool:
    """Whether ``v`` is all-gathered along a dimension other than its major (first non-unit) one.

    An all-gather concatenates whole blocks, so XLA lays the gathered dimension out major: it
    transposes the shard, gathers, and transposes the result back (measured on XLA:CPU on
    Equinox's ``(out, in)`` weights split along ``in``: a gathered-size all-gather result and
    its transposed copy, besides the shard's copy).
    """
    lay = layouts.get(v)
    return lay is not None and _minor_gather(tuple(v.aval.shape), lay, copy)


def _minor_gather(shape: tuple[int, ...], lay: Layout, copy: Layout) -> bool:
    """Whether ``copy`` gathers ``lay`` (of a value of ``shape``) along a dimension other than its major one."""
    major = next((d for d, n in enumerate(shape) if n > 1), 0)
    return any(a != b for d, (a, b) in enumerate(zip(lay.dims, copy.dims)) if d != major)


def _conv_gather_bytes(
    prog: _Program,
    step: _Step,
    k: Key,
    names: tuple[Key, ...],
    last: bool,
    size: Callable[[Key], int],
    nbytes_as: Callable[[Key, Layout | None], int],
    fused: frozenset[Key] = frozenset(),
) -> int:
    """What a convolution ``step`` holds while it runs beyond its input ``k``'s shard and its result, where the walk
    gathered ``k`` (a value the program makes; its gathered copy bound to one of ``names``) for it: 0 where it did
    not.

    XLA:CPU's producer writes the shard with the gathered dimension major, all-gathers it (the shard freed after),
    and where that dimension is not ``k``'s major one (an NHWC activation's channels) copies the gathered result
    back to row-major for the convolution: the gathered buffer and its copy live together.  Measured on
    ``conv(relu(conv(x, k0)), k1)``, x split on its batch, k0 and k1 on their output channels (the second
    convolution's input gathered on its channels; the Flax BatchNorm CNN's dp x tp forward, 0.64x before):
    XLA:CPU's temporaries are the f32[2,16,16,64] all-gather and its copy, 2x the gathered input; the walk had
    held neither.  The step's peak is the largest of the gather (shard + gathered), the copy (gathered + copy)
    and the convolution (its input + result), with the shard held on where a later step reads it."""
    copy = next((c for c in (prog.layout(n, Gathered) for n in names) if c is not None), None)
    lay = prog.layout(k)
    if copy is None or lay is None or is_free(copy) or step.name != "conv_general_dilated":
        return 0
    # (A result computed inside a YNNPACK fusion, _convs_in_ynn, has no buffer: only the copies are held.)
    gathered, shard, out = nbytes_as(k, copy), size(k), sum(size(o) for o in step.outs if o not in fused)
    minor = _minor_gather(tuple(int(n) for n in (k[1] if isinstance(k, tuple) else k).aval.shape), lay, copy)
    back = gathered if minor else 0  # the row-major copy the convolution reads (else it reads the gathered one)
    kept = 0 if last else shard
    peak = max(shard + gathered, kept + gathered + back, kept + (back or gathered) + out)
    return max(peak - shard - out, 0)


# Ops XLA:CPU computes in a loop fusion that indexes its operands in whatever layout they come in: an all-gather's
# minor-dimension result read only by them is not transposed back to row-major.  (Elementwise readers are loop
# fusions too, but not measured alone: the one draw at hand, jnp.where over operands split on different axes, is
# one XLA rematerialises whole, 2x what the walk holds either way; they keep the copy until one is.)
_ANY_LAYOUT_READERS = frozenset({"dynamic_update_slice"})


def _reads_any_layout(readers: list[str]) -> bool:
    """Whether every reader of an argument gathered along a minor dimension reads the gathered buffer as laid out.

    The all-gather of a minor dimension writes a buffer whose layout has that dimension major (see
    :func:`_gathers_minor`).  A dot reads row-major operands, so XLA copies the gathered buffer back (measured on
    Equinox's weights); a slicing loop fusion reads it in place: ``dynamic_update_slice(x[16, 24@a], u[16@a, 12])``'s
    fusion reads the ``{0,1}`` all-gather directly (2308 B of temporaries: the shard's copy, the two gathered
    buffers, no transposed-back copy).  Only dynamic_update_slice is measured so: the gradient of
    ``dynamic_slice(x[16@b, 16@a], (i, i), (1, 1))`` holds the transposed-back copy (XLA 2692 B; read as laid out,
    the walk said 1168 B), so a dynamic or static slice keeps it."""
    return bool(readers) and all(r in _ANY_LAYOUT_READERS for r in readers)


# Ops a gradient passes through on its way out (its value, re-laid or re-shaped).
_ON_THE_WAY_OUT = {"transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze", "expand_dims"}


def _leaves_program(steps: list[_Step], outputs: set[Key]) -> set[Key]:
    """Values read only by shape ops on the way to the program's outputs (or outputs themselves), and by the pads
    and sums of pads that lay a stacked weight's gradient out (:func:`_stacking_steps`)."""
    # (A broadcast that only adds unit axes is a reshape: the transpose of the squeeze of a layer's slice.)
    stacking = _stacking_steps(steps) | {i for i, step in enumerate(steps) if _promotes_rank(step)}
    # The readers of the values such an op reads: only theirs are asked below (a deep model has tens of thousands).
    asked = {k for i, step in enumerate(steps) if step.name in _ON_THE_WAY_OUT or i in stacking for k in step.ins}
    readers: dict[Key, list[int]] = {}
    for i, step in enumerate(steps):
        for k in step.ins:
            if k in asked:
                readers.setdefault(k, []).append(i)

    def passes(i: int) -> bool:
        return steps[i].name in _ON_THE_WAY_OUT or i in stacking

    out = set(outputs)
    for i in range(len(steps) - 1, -1, -1):
        if not passes(i):
            continue
        for k in steps[i].ins:
            if k in out:
                continue
            if all(passes(r) and all(o in out for o in steps[r].outs) for r in readers[k]):
                out.add(k)
    return out


def _stacking_steps(steps: list[_Step]) -> frozenset[int]:
    """The steps that lay per-layer gradients into a stacked weight's: each layer's padded into the stack at its
    row, and the pads summed (the gradient of a Python loop over the stack's rows, ``w[i]``).

    XLA:CPU computes that chain as one loop fusion reading each layer's gradient (``pad_add_fusion``), so a layer's
    gradient that is a partial sum is all-reduced on its own, before the fusion, and its all-reduce is independent
    of the other layers': the combiner issues them together, each partial and its sum live at the tuple all-reduce,
    as for gradients that only leave the program.  Measured on the data-parallel gradient of two such layers (XLA's
    buffer assignment: the four layer gradients' partials and their four sums held together, then the two stacks'
    fusions reading the sums)."""
    pads = {i for i, step in enumerate(steps) if step.name == "pad"}
    if not pads:
        return frozenset()
    chain = set(pads)
    made = {k: i for i in pads for k in steps[i].outs}
    for i, step in enumerate(steps):
        if step.name in ("add_any", "add") and step.ins and all(k in made for k in step.ins):
            chain.add(i)
            for k in step.outs:
                made[k] = i
    return frozenset(chain)


# Primitives whose XLA:CPU buffers the walk cannot bound tightly, with explain / XLA's peak as measured on
# drawn one-op programs and their gradients (tests/test_primitive_rules.py's MEMORY_BOUNDS read this table):
# convolutions and windows take scratch (a conv gradient's temporaries are several times its operands) and
# their pad + reduce_window chains are held whole; sorts and cumulative ops (a reduce_window scan on XLA:CPU)
# hold gathered candidates as scratch (measured 0.23-1.53x over top_k / sort / argsort / cumsum, forward and
# gradient, rows, columns and both split on 1-, 2- and 3-axis meshes); a cond's every branch allocates its
# temporaries, where the walk counts the cond through its operands and results.  The range is the one-op
# programs': where ops are marked approximate, XLA's peak may differ beyond it by their peak bound too
# (einshard._src.testing.bounds.gaps measures the distance beyond the range; a router's gradient whose
# layout conflict is marked reads 3.1x, within 0.1-1.55x plus that bound).
SCRATCH: dict[str, tuple[str, float, float]] = {
    **dict.fromkeys(
        ("conv_general_dilated", "reduce_window", "reduce_window_sum", "reduce_window_max", "select_and_scatter_add"),
        ("convolution and window scratch", 0.1, 1.75),
    ),
    **dict.fromkeys(
        # reduce: a tuple reducer's (jnp.minmax on jax 0.12) per-device partials, gathered over a split axis
        ("sort", "top_k", "argsort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "reduce"),
        ("sort and scan scratch", 0.1, 1.55),
    ),
    "cond": ("every branch's temporaries", 0.4, 1.75),
}


def peak_caveat(jaxpr: Any) -> str:
    """What the peak cannot bound tightly in ``jaxpr`` (nested calls and loops included), with the bound: '' if none.

    ``'peak approximate (convolution and window scratch: conv_general_dilated): explain / XLA measured
    0.1-1.75x, beyond that by the approximate ops' peak bound'``: the widest bound of the families the program
    holds; XLA's peak may lie outside that range by as much as the report's approximate bound says.
    """
    found: dict[str, list[str]] = {}
    todo, seen = [jaxpr], set()
    while todo:
        j = todo.pop()
        j = j.jaxpr if hasattr(j, "jaxpr") and not hasattr(j, "eqns") else j
        if id(j) in seen:
            continue
        seen.add(id(j))
        for eqn in j.eqns:
            family = SCRATCH.get(eqn.primitive.name)
            if family is not None and eqn.primitive.name not in found.setdefault(family[0], []):
                found[family[0]].append(eqn.primitive.name)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        todo.append(sub)
    found = {k: v for k, v in found.items() if v}
    if not found:
        return ""
    bounds = {why: (lo, hi) for why, lo, hi in SCRATCH.values()}
    lo = min(bounds[k][0] for k in found)
    hi = max(bounds[k][1] for k in found)
    what = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(found.items()))
    # The range is measured on one-op programs; an approximate op's peak bound (the first line) adds to it.
    return f"peak approximate ({what}): explain / XLA measured {lo:g}-{hi:g}x, beyond that by the approximate ops' peak bound"


# XLA:CPU hashes typed PRNG keys (threefry2x32) in a while loop over the rounds, holding its state words and
# counters besides the result: bytes of scratch per byte of the op's result on the device.  Measured on one-op
# programs over key batches of 16-256 (``vmap`` of bits (16,), split 3, fold_in), whole and split over 8 devices:
# ``memory_analysis()`` minus explain's walk is ``per_byte · result + 388`` exactly from 512 result bytes up, and
# never under a fixed 964 bytes (the loop's own buffers) below that (within 192 bytes).  Which key impls hash
# with threefry, per op: rbg splits and folds with it too but draws its bits with XLA's RngBitGenerator (no such
# loop); unsafe_rbg never does (measured: its split holds nothing beyond its result).
# ``random_bits`` is not here: its loop (measured here at 3.375 bytes per result byte + 388: three words per
# element, six per-key arrays of a 16-sample draw, 388 fixed) is held by the walk itself (:func:`_random_bits`,
# :func:`_loop_bytes`: the same bytes, exact on those one-op programs), fused bits' words held to their reader.
HASH_SCRATCH: dict[str, float] = {"random_split": 2.5, "random_fold_in": 4.5}
HASHED_BY_THREEFRY: dict[str, frozenset[str]] = {
    "random_split": frozenset({"threefry2x32", "rbg"}),
    "random_fold_in": frozenset({"threefry2x32", "rbg"}),
}
_HASH_FIXED, _HASH_FLOOR = 388, 964


def hash_scratch(eqn: Any, env: dict[Any, Layout]) -> int:
    """Bytes per device XLA:CPU holds while it hashes keys (:data:`HASH_SCRATCH`), besides the operands and result."""
    name = eqn.primitive.name
    impl = getattr(getattr(eqn.invars[0].aval.dtype, "_impl", None), "name", None)  # rules_random.key_impl
    if impl not in HASHED_BY_THREEFRY[name]:
        return 0
    out = eqn.outvars[0]
    lay = env.get(out)
    shape = lay.shard_shape if lay is not None and not is_free(lay) else out.aval.shape
    result = math.prod(int(n) for n in shape) * dtype_itemsize(out.aval.dtype)
    return max(_HASH_FLOOR, int(HASH_SCRATCH[name] * result) + _HASH_FIXED)
