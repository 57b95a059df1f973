"""Read the collectives out of compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

What it handles (docs/theory.md, "HLO-parsing gotchas"):

* the five collective kinds, synchronous or as async ``*-start``/``*-done``
  pairs (counted once, with the ``-done``'s result shape and the ``-start``'s
  attributes);
* replica groups in all three textual forms: explicit ``{{0,1},{2,3}}``, iota
  ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and Shardy's
  ``mesh['x'=2,'y'=4] {'y'}`` (optionally with ``device_ids=(...)``); an
  empty ``{}`` means all devices;
* tuple shapes with spaces (``all-to-all`` returns one piece per peer: one
  collective); other tuple-shaped collectives are XLA's combiner merging
  independent ones, and count once per piece;
* the CPU form of a reduce-scatter: XLA's CPU backend emits an
  ``all-reduce`` whose result feeds a ``dynamic-slice`` (directly or inside a
  fusion).  Such an all-reduce is marked ``sliced=True``, and
  :func:`normalized` reports it as a reduce-scatter, the equivalence
  einshard's tests rely on.  Only a slice *of the all-reduced value* counts:
  the dynamic-slice's sliced operand (not an index) must be the all-reduce's
  result, or, inside a fusion, the fusion parameter it arrives as (through
  layout and elementwise ops).  A fusion that reads the all-reduce and slices
  some other operand (in a ``lax.scan`` body, every fusion that reads a layer
  of stacked weights) leaves it an all-reduce.  A piece of a combined (tuple)
  all-reduce is followed through its ``get-tuple-element``: the combiner merges
  such reduce-scatters with plain all-reduces.  The slice must keep 1/n of the value (n devices per
  group) or a finer part: an all-reduce over 4 devices whose result is cut in half (to move the halves
  elsewhere, as XLA does between two convolutions under a channel split) stays an all-reduce.  And the slices
  must be its only readers: an all-reduce whose whole result another consumer also reads (a forward sum
  squared whole whose backward gather slices it) stays an all-reduce.

``array_bytes`` uses the analyzer's convention (see einshard.analysis.cost):
the gathered result of an all-gather, the full input of a reduce-scatter
(result × group size), the buffer of an all-reduce, the local pieces of an
all-to-all, the permuted buffer.

Example:
    >>> text = '''HloModule m, num_partitions=8
    ... ENTRY %main {
    ...   %p = f32[16,256]{1,0} parameter(0)
    ...   %ag = f32[64,256]{1,0} all-gather(%p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
    ...   %ar = f32[64,256]{1,0} all-reduce(%ag), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
    ...   ROOT %ds = f32[16,256]{1,0} dynamic-slice(%ar, %i, %j), dynamic_slice_sizes={16,256}
    ... }'''
    >>> [(c.kind, c.array_bytes, c.group_size) for c in normalized(text)]
    [('all-gather', 65536, 4), ('reduce-scatter', 65536, 4)]
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from ..core.collectives import KINDS

__all__ = [
    "HloCollective",
    "collectives",
    "normalized",
    "signature",
    "collective_counts",
    "collective_bytes",
    "DTYPE_BYTES",
]


DTYPE_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip


@dataclass(frozen=True)
class HloCollective:
    """One collective in compiled HLO.

    Attributes:
        kind: one of the five kinds (``-start``/``-done`` folded).
        name: the instruction name.
        shapes: the result's arrays as (dtype, dims).
        bytes: bytes of the result (all tuple pieces).
        array_bytes: the buffer in the analyzer's convention (module doc).
        group_size: devices per replica group (for a permute: the devices that send or receive).
        groups: the device groups, when they could be worked out.
        sliced: an all-reduce whose result is dynamic-sliced: a reduce-scatter on CPU.
        line: the HLO line.
        runs: how many times it runs per execution: the product of the known trip counts of the while loops
            around it (a ``lax.scan`` over layers runs its body's collectives once per layer), summed over the
            places its computation is called from; 1 outside loops.
    """

    kind: str
    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    bytes: int
    array_bytes: int
    group_size: int
    groups: tuple[tuple[int, ...], ...] | None
    sliced: bool
    line: str
    runs: int = 1

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends, by the ring formulas of einshard.analysis.cost."""
        n, v = self.group_size, self.array_bytes
        if n <= 1:
            return 0.0
        if self.kind in ("all-gather", "reduce-scatter"):
            return (n - 1) / n * v
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * v
        if self.kind == "all-to-all":
            return (n - 1) / n * v
        return float(v)


_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s(?P<op>[a-z][\w\-]*)\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_COMP = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"\b(?:body|condition|calls|to_apply)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


# Ops that only re-lay a value out: the all-reduced value sliced after them is still the value sliced.
_LAYOUT_OPS = frozenset({"bitcast", "reshape", "copy", "convert", "transpose", "get-tuple-element"})


def _runs(calls: dict[str, list[tuple[str, int]]], order: list[str], entry: str | None) -> dict[str, int]:
    """Times each computation runs per execution of the entry: summed over its call sites, loops multiplied.

    HLO text prints a computation before every computation that calls it, so walking the
    computations in reverse order visits each caller before its callees.
    """
    runs = dict.fromkeys(order, 0)
    if entry is None:  # a fragment without an ENTRY: every computation once
        return dict.fromkeys(order, 1)
    runs[entry] = 1
    for comp in reversed(order):
        for callee, times in calls.get(comp, []):
            if callee in runs:
                runs[callee] += runs[comp] * times
    return runs


def _shapes(text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(out)


def _nbytes(shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in shapes)


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> list[int]:
    import numpy as np

    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if perm is not None:
        ids = ids.transpose(perm)
    return [int(i) for i in ids.reshape(dims).reshape(-1)]


def _groups(attrs: str, num_devices: int | None) -> tuple[int, tuple[tuple[int, ...], ...] | None]:
    """(group size, groups or None) from an instruction's attributes."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((\[[^)]*\)?)\))?\s*\{([^}]*)\}", attrs)
    if m:
        import numpy as np

        axes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        chosen = re.findall(r"'([^']+)'", m.group(3))
        sizes = dict(axes)
        n = math.prod(sizes[a] for a in chosen) if chosen else 1
        total = math.prod(sizes.values())
        ids = np.arange(total)
        if m.group(2):
            iota = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2))
            if iota:
                reshape = [int(x) for x in iota.group(1).split(",")]
                perm = [int(x) for x in iota.group(2).split(",")] if iota.group(2) else None
                ids = np.array(_iota([total], reshape, perm))
        grid = ids.reshape([s for _, s in axes])
        names = [a for a, _ in axes]
        order = [i for i, a in enumerate(names) if a not in chosen] + [names.index(a) for a in chosen]
        rows = grid.transpose(order).reshape(-1, n)
        return n, tuple(tuple(int(x) for x in g) for g in rows)
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        reshape = [int(x) for x in m.group(2).split(",")]
        perm = [int(x) for x in m.group(3).split(",")] if m.group(3) else None
        flat = _iota([math.prod(shape)], reshape, perm)
        n = shape[-1]
        return n, tuple(tuple(flat[i : i + n]) for i in range(0, len(flat), n))
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = tuple(
            tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
        )
        if groups:
            return len(groups[0]), groups
        return (num_devices or 1), None
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if m:
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(0))
        # The devices that take part: senders and receivers.  Counting senders only made a one-way permute
        # between two devices ({{0,1}}: device 0 sends, 1 receives) a "group of one", which normalized()
        # drops as a no-op although it moves data.  Where every receiver also sends (the swaps and rings
        # XLA emits for reshards) the two counts agree.
        moving = {int(x) for a, b in pairs if a != b for x in (a, b)}
        return len(moving), None
    return (num_devices or 1), None


def _loop_bound(args: list[str], attrs: str, constants: dict[str, int]) -> int | None:
    """A loop condition's ``i < N`` (or ``N > i``) as ``N``: a scan's counter runs from 0 (how jax lowers it)."""
    direction = re.search(r"direction=(\w+)", attrs)
    if direction is None or len(args) != 2:
        return None
    if direction.group(1) == "LT" and args[1] in constants:
        return constants[args[1]]
    if direction.group(1) == "GT" and args[0] in constants:
        return constants[args[0]]
    return None


def collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective in the HLO text, in order (async pairs once)."""
    header = re.search(r"num_partitions=(\d+)", hlo_text)
    num_devices = int(header.group(1)) if header else None
    lines = hlo_text.splitlines()
    # Pass 1: instructions, the computation each belongs to, and who consumes what.
    instrs: list[tuple[str, str, str, list[str], str, str]] = []  # name, shape, op, args, attrs, line
    comp_ops: dict[str, set[str]] = {}
    comp_of: dict[str, str] = {}  # instruction name -> its computation
    calls: dict[str, list[tuple[str, int]]] = {}  # computation -> (called computation, times per call)
    order: list[str] = []
    entry: str | None = None
    current = ""
    constants: dict[str, int] = {}  # integer scalar constants by instruction name
    tables: dict[str, tuple[int, ...]] = {}  # 1-d integer constants: the SPMD partitioner's per-partition offsets
    cond_trip: dict[str, int] = {}  # a loop condition computation -> its trip count, where it reads as one
    for line in lines:
        m = _INSTR.match(line)
        if not m:
            c = _COMP.match(line)
            # A computation's header has no '=' (an instruction's does) once /*index=5*/ comments are gone.
            if c and "=" not in re.sub(r"/\*.*?\*/", "", line.split("{")[0]):
                current = c.group("name")
                order.append(current)
                entry = current if c.group("entry") else entry
            continue
        # An operand past the fifth is printed after an /*index=N*/ comment: dropped, or the name would not
        # match (a fusion's sixth operand, the all-reduce it slices, read as some other value's).
        listed = re.sub(r"/\*.*?\*/", "", m.group("args"))
        args = [a.strip().lstrip("%") for a in listed.split(",") if a.strip()]
        args = [a.split()[-1].lstrip("%") if " " in a else a for a in args]
        instrs.append((m.group("name"), m.group("shape"), m.group("op"), args, m.group("attrs"), line.strip()))
        comp_ops.setdefault(current, set()).add(m.group("op"))
        comp_of[m.group("name")] = current
        if m.group("op") == "constant" and re.fullmatch(r"-?\d+", m.group("args").strip()):
            constants[m.group("name")] = int(m.group("args"))
        listed_ints = re.fullmatch(r"\{\s*(-?\d+(?:\s*,\s*-?\d+)*)\s*\}", m.group("args").strip())
        if m.group("op") == "constant" and listed_ints:
            tables[m.group("name")] = tuple(int(x) for x in listed_ints.group(1).split(","))
        if m.group("op") == "compare" and line.lstrip().startswith("ROOT"):
            bound = _loop_bound(args, m.group("attrs"), constants)
            if bound is not None:
                cond_trip[current] = bound
        trip = _TRIP.search(m.group("attrs"))
        times = 1
        if m.group("op") == "while":
            cond = re.search(r"\bcondition=%?([\w.\-]+)", m.group("attrs"))
            # TPU prints no known_trip_count: read the bound off its condition (printed before the loop).
            times = int(trip.group(1)) if trip else cond_trip.get(cond.group(1), 1) if cond else 1
        callees = _CALLED.findall(m.group("attrs"))
        for listed in _CALLED_LIST.findall(m.group("attrs")):
            callees += [x.strip().lstrip("%") for x in listed.split(",") if x.strip()]
        calls.setdefault(current, []).extend((callee, times) for callee in callees)
    runs = _runs(calls, order, entry)
    consumers: dict[str, list[tuple[str, str, list[str], str]]] = {}
    for cname, _, op, args, attrs, _ in instrs:
        for a in args:
            consumers.setdefault(a, []).append((cname, op, args, attrs))
    # Per computation: its parameters by number, and each instruction's element count (a fusion's body is
    # searched for a slice of the one parameter the collective arrives as).
    params: dict[tuple[str, int], str] = {}
    param_number: dict[str, int] = {}
    operands = {iname: args for iname, _, _, args, _, _ in instrs}
    op_of = {iname: op for iname, _, op, _, _, _ in instrs}
    elements: dict[str, int] = {}
    for iname, shape, op, _, _, line in instrs:
        elements[iname] = sum(math.prod(dims) for _, dims in _shapes(shape)) if "(" not in shape else -1
        if op == "parameter":
            number = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=.*?\sparameter\((\d+)\)", line)
            if number:
                params[(comp_of[iname], int(number.group(1)))] = iname
                param_number[iname] = int(number.group(1))

    def scatters(whole: str, piece: str, n: int) -> bool:
        """Whether slicing ``whole`` to ``piece`` keeps 1/n of it or a finer part: a reduce-scatter's slice.
        A slice to a coarser piece (half the channels after an all-reduce over 4 devices, which then
        moves them elsewhere) is no reduce-scatter: the all-reduce stays one."""
        big, small = elements.get(whole, -1), elements.get(piece, -1)
        if big <= 0 or small <= 0:
            return True  # sizes unknown (a tuple): read the slice as the reduce-scatter it usually is
        return big % small == 0 and (big // small) % n == 0

    def offset_tables(indices: list[str], caller: list[str] | None) -> list[tuple[int, ...]] | None:
        """The per-partition tables (constants indexed by partition-id) a slice's offsets ``indices`` are read
        from, followed back through the arithmetic that scales them (and out of a fusion, to ``caller``'s
        operands): the piece each device keeps is a function of their entries.  None where the offsets also
        read the partition's id some other way (the pieces are then not known from the tables alone)."""
        found: list[tuple[int, ...]] = []
        seen: set[str] = set()
        todo = list(indices)
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            k = param_number.get(v)
            if k is not None and caller is not None and k < len(caller):
                v = caller[k]  # a fusion's parameter: the caller's operand it arrives as
            if v in tables:
                found.append(tables[v])
                continue
            if op_of.get(v) in ("partition-id", "replica-id"):
                return None
            args = operands.get(v, [])
            if op_of.get(v) == "dynamic-slice" and args:
                table = args[0]
                k = param_number.get(table)
                table = caller[k] if k is not None and caller is not None and k < len(caller) else table
                if table in tables or op_of.get(table) in ("copy-done", "copy-start", "copy"):
                    todo.append(args[0])  # the table (through a copy), not its index: the partition id
                    continue
            todo.extend(args)
        return found

    def same_piece(indices: list[str], caller: list[str] | None, groups: tuple[tuple[int, ...], ...] | None) -> bool:
        """Whether two devices of a group keep the same piece: the slice's offsets come from per-partition tables
        alone, and their entries repeat within a group.  Then the all-reduce is one and the slice local, not a
        reduce-scatter, which hands each device of its group a piece of its own (measured: sum(x[16@a, 16], 0)
        resharded to P('c') on (2, 2, 2) all-reduces over a and slices by c, table {0, 1, 0, 1, ...}: both
        devices of the group {0, 4} keep the same half; XLA:TPU compiles the same)."""
        if groups is None:
            return False
        found = offset_tables(indices, caller)
        devices = max((d for g in groups for d in g), default=0)
        found = [t for t in found or [] if len(t) > devices]  # a one-entry constant is a bound, not a table
        if not found:
            return False
        return any(len({tuple(t[d] for t in found) for d in g}) < len(g) for g in groups)

    def slices_whole(
        value: str, n: int, caller: list[str] | None = None, groups: tuple[tuple[int, ...], ...] | None = None
    ) -> bool:
        """Whether ``value`` (or a layout/elementwise image of it, as many elements) is dynamic-sliced to 1/n,
        each device of a group (``groups``) keeping its own piece."""
        seen = {value}
        todo = [value]
        while todo:
            v = todo.pop()
            for cname, op, args, _ in consumers.get(v, []):
                if op == "dynamic-slice":
                    if args and args[0] == v and scatters(v, cname, n) and not same_piece(args[1:], caller, groups):
                        return True
                    continue  # ``v`` is an index of the slice, not what it slices
                if cname not in seen and (op in _LAYOUT_OPS or elements.get(cname) == elements.get(v)):
                    seen.add(cname)
                    todo.append(cname)
        return False

    starts = {name: attrs for name, _, op, _, attrs, _ in instrs if op.endswith("-start")}

    def sliced(name: str, n: int, groups: tuple[tuple[int, ...], ...] | None, piece: int | None = None) -> bool:
        """Whether ``name``'s result (or, of a tuple, piece ``piece``, read through get-tuple-element) is
        sliced to 1/n (``n`` devices per group) and read only so: an all-reduce whose whole result another
        consumer also reads (the forward's sum squared whole, its backward gather slicing it) is one."""
        cut = whole = False
        for cname, op, args, attrs in consumers.get(name, []):
            if piece is not None:
                index = re.search(r"\bindex=(\d+)", attrs)
                if op == "get-tuple-element" and index and int(index.group(1)) == piece and sliced(cname, n, groups):
                    return True
                continue
            if op == "dynamic-slice" and args and args[0] == name:
                if scatters(name, cname, n) and not same_piece(args[1:], None, groups):
                    cut = True
                else:
                    whole = True
                continue
            if op == "dynamic-slice":
                continue  # ``name`` is an index of the slice, not what it slices
            called = re.search(r"calls=%?([\w.\-]+)", attrs) if op == "fusion" else None
            if called is not None and "dynamic-slice" in comp_ops.get(called.group(1), set()):
                for k, a in enumerate(args):
                    param = params.get((called.group(1), k))
                    if a == name and param is not None and slices_whole(param, n, args, groups):
                        cut = True
                        break
                else:
                    whole = True
                continue
            whole = True
        return cut and not whole

    out: list[HloCollective] = []
    for name, shape, op, args, attrs, line in instrs:
        base = op.removesuffix("-start").removesuffix("-done")
        if base not in KINDS or op.endswith("-start"):
            continue
        if op.endswith("-done"):
            attrs = starts.get(args[0], "") if args else ""
        shapes = _shapes(shape)
        n, groups = _groups(attrs, num_devices)
        # XLA's combiners merge independent collectives into one with a tuple result; each piece is one
        # logical collective.  An all-to-all's tuple is its pieces (one per peer): one collective.
        pieces = [shapes] if base == "all-to-all" or len(shapes) <= 1 else [(s,) for s in shapes]
        for k, piece in enumerate(pieces):
            # A combined all-reduce's piece is sliced when its get-tuple-element is: the combiner merges
            # CPU's reduce-scatters (all-reduce + dynamic-slice) with plain all-reduces.
            is_sliced = base == "all-reduce" and sliced(name, n, groups, k if len(pieces) > 1 else None)
            nbytes = _nbytes(piece)
            array_bytes = nbytes * n if base == "reduce-scatter" else nbytes
            out.append(
                HloCollective(
                    base, name, piece, nbytes, array_bytes, n, groups, is_sliced, line, runs.get(comp_of[name], 1)
                )
            )
    return out


def normalized(hlo_text: str) -> list[HloCollective]:
    """:func:`collectives`, with CPU's all-reduce + dynamic-slice reported as a reduce-scatter.

    Collectives over groups of one device (no-ops XLA sometimes keeps) are dropped.
    """
    out = []
    for c in collectives(hlo_text):
        if c.group_size <= 1:
            continue
        if c.sliced:
            c = HloCollective(
                "reduce-scatter", c.name, c.shapes, c.bytes, c.array_bytes, c.group_size, c.groups, True, c.line, c.runs
            )
        out.append(c)
    return out


def signature(items: list[tuple[str, int, int]] | list[HloCollective]) -> Counter[tuple[str, int, int]]:
    """A multiset of (kind, array_bytes, group_size), to compare XLA with the analyzer."""
    return Counter((c.kind, c.array_bytes, c.group_size) if isinstance(c, HloCollective) else c for c in items)


def collective_counts(hlo_text: str) -> Counter[str]:
    """XLA's collectives by kind, as :func:`normalized` reads them (CPU's all-reduce + slice is a reduce-scatter,
    one-device groups dropped), each counted once per run: a collective inside a loop of 12 trips counts 12.

    What explain's report counts (``op.repeat`` per collective), so the two compare as they are::

        >>> text = jax.jit(f, in_shardings=...).lower(*args).compile().as_text()  # doctest: +SKIP
        >>> hlo.collective_counts(text) == Counter({"all-gather": 1, "reduce-scatter": 1})  # doctest: +SKIP
    """
    kinds: Counter[str] = Counter()
    for c in normalized(hlo_text):
        kinds[c.kind] += c.runs
    return kinds


def collective_bytes(hlo_text: str) -> int:
    """The bytes of XLA's collectives' arrays (``array_bytes``, each counted per run), as :func:`collective_counts`
    counts them: what explain's ``sum(c.array_bytes * op.repeat)`` is compared with."""
    return sum(c.array_bytes * c.runs for c in normalized(hlo_text))
