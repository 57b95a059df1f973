"""What communication and compute cost: hardware profiles and the :class:`Collective` record.

Bytes follow the ring formulas of the scaling book (docs/theory.md §b).  ``V`` is
the *full-along-the-axis* buffer one device group works on: the array's
bytes divided by the sharding factors of the other mesh axes.

=====================  ==========================  ==============================
collective             bytes sent per device        ``array_bytes`` (what HLO prints)
=====================  ==========================  ==============================
all-gather             (n-1)/n · V                  V, the gathered result
reduce-scatter         (n-1)/n · V                  V, the full (unscattered) input
all-reduce             2 (n-1)/n · V                V
all-to-all             (n-1)/n · s                  s, the local shard (V = n·s)
collective-permute     s                            s, the local shard
=====================  ==========================  ==============================

Time is α–β: ``hops · latency + bytes / bandwidth`` with ``hops`` = n-1 for a
ring pass (2(n-1) for an all-reduce, which is a reduce-scatter then an
all-gather) and 1 for a permute.  A collective over several mesh axes at once
(one all-reduce over ``('data', 'model')``) runs one ring pass per axis (XLA
on a TPU torus, NCCL's hierarchical rings), so its latency is Σ(n_i-1) hops,
not ∏n_i - 1 (scaling book, sharding.md: ``T_min·Σ|X_i|/2``); it is then never
slower than one collective per axis, which sends more bytes over as many hops.  On a ``ring`` topology (TPU ICI) an
all-to-all takes ``V / (4 W)`` (scaling book, sharding.md Problem 10); on a
``switch`` (an NVLink node, a CPU host) it takes its bytes over ``W``.

The layout algebra (:mod:`einshard.core.moves`) is unpriced; :func:`price` turns one of its
:class:`~einshard.core.moves.Move`\\ s into a :class:`Collective` with these formulas (:data:`RING_BYTES`, the one
copy: ``explain``'s explicit shard_map collectives read it too), and the priced moves below (``all_gather`` …
``transition``) are the algebra's moves, priced.

Example:
    >>> p = PROFILES["h100"]
    >>> round(p.collective_time("all-gather", 8, 7 / 8 * 2**30, 2**30) * 1e3, 3)   # ms for 1 GiB
    2.102
    >>> from einshard.placement import Layout, MeshAxis
    >>> a = Layout(("b", "d"), (64, 32), (MeshAxis("data", 4),), (("data",), ()))
    >>> b, c = all_gather(a, ("data",), itemsize=4)
    >>> b.dims, c.kind, c.bytes, c.array_bytes
    (((), ()), 'all-gather', 6144, 8192)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .. import _checks
from ..core import moves
from ..core.collectives import KINDS, CollectiveKind, Step, StepKind, Target
from ..core.layout import Layout
from ..core.moves import Move, mesh_sizes

__all__ = [
    "Profile",
    "PROFILES",
    "Tiling",
    "NarrowFloats",
    "ReduceScatter",
    "wire_itemsize",
    "buffer_bytes",
    "Collective",
    "KINDS",
    "RING_BYTES",
    "sent_bytes",
    "get_profile",
    "shared_profile",
    "host_cores",
    "cpu_profile",
    "default_profile",
    "profile_for",
    "price",
    "all_gather",
    "dynamic_slice",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "regroup",
    "transition",
]


# 'switch': all-to-all connected links (NVLink, a host); 'ring': a torus axis (TPU ICI).
TOPOLOGIES = ("switch", "ring")

# How a device lays a buffer out in memory: 'dense' (CPU, GPU: the array's own bytes) or 'tpu' (the TPU
# compiler's tiles: :func:`buffer_bytes`).
Tiling = Literal["dense", "tpu"]
TILINGS: tuple[Tiling, ...] = ("dense", "tpu")

# The width a collective carries a 16-bit float at: 'native' (NCCL, TPU ICI move bf16/f16 as they are) or 'f32'
# (XLA:CPU has no 16-bit float collectives: it converts the value to f32 around each one -- measured, a
# sharding constraint gathering bf16[8,64] blocks compiles to an f32[64,64] all-gather between two converts;
# dots, reductions and all-to-alls alike -- so each sends 4 bytes per element).
NarrowFloats = Literal["native", "f32"]
NARROW_FLOATS: tuple[NarrowFloats, ...] = ("native", "f32")
CombinedLatency = Literal["once", "per_piece"]
COMBINED_LATENCIES: tuple[CombinedLatency, ...] = ("once", "per_piece")
# How the compiler runs a sum that lands split (a reduce-scatter): 'native' (XLA:GPU's ReduceScatterCreator makes a
# reduce-scatter of the partitioner's all-reduce + dynamic-slice; the TPU compiler fuses the pair into one
# all-reduce-scatter fusion, measured through libtpu: no whole sum in HBM) or 'all-reduce' (XLA:CPU runs no such
# pass: the whole partial is all-reduced into a whole sum, then each device's piece sliced out of it).
ReduceScatter = Literal["native", "all-reduce"]
REDUCE_SCATTERS: tuple[ReduceScatter, ...] = ("native", "all-reduce")
# What a collective's latency counts: 'ring' (GPU, TPU: a ring pass per mesh axis the group spans, Σ(n_i - 1) hops,
# two passes for an all-reduce) or 'peers' (XLA:CPU: one rendezvous of the group's device threads, then each reads
# its n - 1 peers' buffers; measured, benchmarks/cpu_calibration.py --groups: an all-reduce, an all-gather and a
# reduce-scatter over the same group take the same time, and a group over both axes of a (4, 2) mesh the time of
# one of 8 devices (7 peers), not of a 4-ring and a 2-ring (4 hops)).
LatencySteps = Literal["ring", "peers"]
LATENCY_STEPS: tuple[LatencySteps, ...] = ("ring", "peers")
_NARROW = frozenset({"bf16", "f16"})


def wire_itemsize(dtype_name: str, itemsize: int, narrow_floats: NarrowFloats) -> int:
    """Bytes per element a collective sends of a ``dtype_name`` value on a compiler that moves 16-bit floats so.

    Example:
        >>> wire_itemsize("bf16", 2, "f32"), wire_itemsize("bf16", 2, "native"), wire_itemsize("s16", 2, "f32")
        (4, 2, 2)
    """
    return 4 if narrow_floats == "f32" and dtype_name in _NARROW else itemsize


# TPU buffers are whole pages of this many bytes (memory_analysis(): a scalar, a (1, 128) f32 take 512).
_TPU_PAGE = 512
# The minor dimension of a TPU tile is a vector register's 128 lanes.
_TPU_LANES = 128
# Rows of a tile: 8 sublanes; a short second-minor dimension gets the next power of two below it.
_TPU_SUBLANES = 8
# 32-bit words: a 16-bit (8-bit) type packs 2 (4) rows per word, so a tile has at least that many rows.
_TPU_WORD = 4


def _tpu_tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    rows = max(rows, _TPU_WORD // itemsize if itemsize < _TPU_WORD else 1)
    rows = 1 << (rows - 1).bit_length() if rows <= _TPU_SUBLANES else -(-rows // _TPU_SUBLANES) * _TPU_SUBLANES
    return rows * -(-cols // _TPU_LANES) * _TPU_LANES * itemsize


def buffer_bytes(shape: tuple[int, ...], itemsize: int, tiling: Tiling = "dense") -> int:
    """Bytes one buffer of ``shape`` (elements of ``itemsize`` bytes) takes in a device's memory.

    ``'dense'``: the array's own bytes.  ``'tpu'``: as the TPU compiler lays it out (measured against
    libtpu's ``memory_analysis()``, ``tests/test_target_tpu_model.py``): the two dimensions it makes minor
    are padded to tiles (the minor to 128 lanes; the second-minor to a power of two up to 8, then to a
    multiple of 8, and to at least 2 rows for a 16-bit, 4 for an 8-bit type), the others multiply; the
    compiler chooses which two are minor, and takes the pair that pads least (a (1000, 32, 2) int8 array
    is laid out with 1000 minor, not 2).  A rank-1 array is rows of 128; every buffer is whole 512-byte pages.

    Example:
        >>> buffer_bytes((3, 5), 4), buffer_bytes((3, 5), 4, "tpu"), buffer_bytes((8, 128), 4, "tpu")
        (60, 2048, 4096)
    """
    if tiling == "dense":
        return math.prod(shape) * itemsize
    if not shape:
        n = _tpu_tile_bytes(1, 1, itemsize)
    elif len(shape) == 1:
        n = _tpu_tile_bytes(-(-shape[0] // _TPU_LANES), _TPU_LANES, itemsize)
    elif math.prod(shape) == 0:
        return 0
    else:
        total = math.prod(shape)
        n = min(
            _tpu_tile_bytes(shape[i], shape[j], itemsize) * (total // (shape[i] * shape[j]))
            for i in range(len(shape))
            for j in range(len(shape))
            if i != j
        )
    return max(_TPU_PAGE, -(-n // _TPU_PAGE) * _TPU_PAGE)


@dataclass(frozen=True)
class Profile:
    """A device and its links, for α–β time estimates.

    Attributes:
        name: a short name (``'h100'``).
        flops: dense FLOP/s per device (at the dtype one trains in: bf16 on accelerators).
        bandwidth: bytes/s one device can send over the links of one mesh axis.
        latency: seconds per hop of a ring collective.
        topology: ``'switch'`` (all-to-all connected: NVLink, a host) or ``'ring'`` (a torus axis: TPU ICI).
        tiling: how a buffer is laid out in memory, for peak memory (:func:`buffer_bytes`): ``'dense'``
            (CPU, GPU) or ``'tpu'`` (the TPU compiler's tiles).  ``'tpu'`` also puts, on the first line of
            a report for this profile, where explain's collectives are XLA's CPU/GPU partitioning and the
            TPU compiler's differ (:data:`COMPILER_CAVEATS`).
        narrow_floats: the width its collectives carry bf16/f16 values at: ``'native'`` or ``'f32'``
            (XLA:CPU converts them to f32 around every collective: :func:`wire_itemsize`).
        host_cores: the cores the devices' compute shares, for simulated devices on one host (the ``cpu``
            profile: this process's usable cores, :func:`host_cores`); ``flops`` is then one device's FLOP/s
            with a core to itself.  More devices computing at once than cores take turns: each gets
            ``flops · host_cores / devices`` (:meth:`on_devices`).  None: each device computes on its own
            hardware (a GPU, a TPU chip).
        reduce_scatter: how its compiler runs a sum that lands split finer than its partial: ``'native'`` (GPU,
            TPU: a reduce-scatter) or ``'all-reduce'`` (XLA:CPU: the whole partial all-reduced, then sliced, so the
            whole sum is live beside the slice; peak memory holds it: ``memory._whole_sum_beside``).
        combined_latency: what a collective that XLA's combiner merged (one tuple-shaped op of several
            independent collectives) pays in latency: ``'once'`` (GPU, TPU: the merged op is one collective) or
            ``'per_piece'`` (XLA:CPU runs each piece of a tuple all-reduce as a collective of its own, measured:
            benchmarks/cpu_calibration.py's combined-all-reduce fit, ~the same time per piece as one all-reduce
            alone; so merging saves the step nothing).  The planner's combining credit (``combined.saved_s``)
            and ``plan(verify=)``'s pricing of the compiled collectives follow it.  The ``cpu`` profile keeps
            ``'once'``; ``cpu_profile(small_ops=True)`` takes ``'per_piece'`` with ``element_time`` priced (the
            comment above ``PROFILES``).
        op_overhead: seconds each op that computes (a dot) costs whatever its size: the kernel XLA launches
            (with a core to itself, shared as ``flops`` is: :meth:`on_devices`).  0: not priced (GPU, TPU).
        element_time: seconds per element of an activation a forward dot writes (per device, with a core to itself),
            per pass, for the elementwise and reduction work around it that the walk does not price (a bias, an
            activation, a norm, a residual read the products' results, and their transposes the cotangents in the
            backward; explain counts dot FLOPs only).  Paid twice where the program has a backward, and not on a
            backward product's result (a cotangent already counted, a weight gradient that no elementwise work
            follows): ``planner.scoring.unwalked_compute_s``.  On XLA:CPU's small steps that work, not the FLOPs, is
            most of the compute, and a layout that replicates a product replicates it too.  The planner adds both
            to a layout's compute; explain's report does not.  0: not priced (the ``cpu`` profile's default; GPU,
            TPU: their FLOP/s stand for a step's); ``cpu_profile(small_ops=True)`` prices both.
        collective_overhead: seconds every collective (each piece of a merged one under ``'per_piece'``) costs
            whatever its group's hops, before ``latency`` per hop: on XLA:CPU most of a small all-reduce's time
            is the rendezvous of the device threads (benchmarks/cpu_calibration.py's ``allreduce_shape``).  0: a
            collective is its hops (the default; GPU, TPU).
        latency_steps: what ``latency`` is paid per: ``'ring'`` (a ring hop: Σ(n_i - 1) over the mesh axes the group
            spans, twice for an all-reduce; GPU, TPU, the ``cpu`` profile's default) or ``'peers'`` (a peer of the
            group: n - 1 for every kind, as XLA:CPU runs a collective: :data:`LATENCY_STEPS`' comment;
            ``cpu_profile(small_ops=True)``).
    """

    name: str
    flops: float
    bandwidth: float
    latency: float
    topology: str = "switch"
    tiling: Tiling = "dense"
    narrow_floats: NarrowFloats = "native"
    host_cores: int | None = None
    combined_latency: CombinedLatency = "once"
    reduce_scatter: ReduceScatter = "native"
    op_overhead: float = 0.0
    element_time: float = 0.0
    collective_overhead: float = 0.0
    latency_steps: LatencySteps = "ring"
    # The profile that prices the collectives of a walk ranked on this one: set by :meth:`walking` on the profile it
    # makes, and no part of what a profile is (not a parameter, nor in equality, hash, repr).
    priced_as: Profile | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Every estimate divides by flops and bandwidth: a zero, a NaN or an infinity would make each plan's time
        # a ZeroDivisionError or NaN (and every comparison between plans false), so they are refused here.
        from .._checks import check_number, check_str

        check_str(self.name, "einshard.Profile", "name")
        check_number(self.flops, "einshard.Profile", "flops", positive=True)
        check_number(self.bandwidth, "einshard.Profile", "bandwidth", positive=True)
        check_number(self.latency, "einshard.Profile", "latency", minimum=0)
        check_number(self.op_overhead, "einshard.Profile", "op_overhead", minimum=0)
        check_number(self.element_time, "einshard.Profile", "element_time", minimum=0)
        check_number(self.collective_overhead, "einshard.Profile", "collective_overhead", minimum=0)
        if self.topology not in TOPOLOGIES:
            from ..errors import EinshardError

            raise EinshardError(
                f"einshard.Profile: topology= takes one of {', '.join(map(repr, TOPOLOGIES))}, got {self.topology!r}"
            )
        if self.tiling not in TILINGS:
            from ..errors import EinshardError

            raise EinshardError(
                f"einshard.Profile: tiling= takes one of {', '.join(map(repr, TILINGS))}, got {self.tiling!r}"
            )
        if self.host_cores is not None and (
            not isinstance(self.host_cores, int) or isinstance(self.host_cores, bool) or self.host_cores < 1
        ):
            from ..errors import EinshardError

            raise EinshardError(
                f"einshard.Profile: host_cores= takes a number of cores >= 1 or None, got {self.host_cores!r}"
            )
        if self.combined_latency not in COMBINED_LATENCIES:
            from ..errors import EinshardError

            raise EinshardError(
                "einshard.Profile: combined_latency= takes one of "
                f"{', '.join(map(repr, COMBINED_LATENCIES))}, got {self.combined_latency!r}"
            )
        if self.reduce_scatter not in REDUCE_SCATTERS:
            from ..errors import EinshardError

            raise EinshardError(
                "einshard.Profile: reduce_scatter= takes one of "
                f"{', '.join(map(repr, REDUCE_SCATTERS))}, got {self.reduce_scatter!r}"
            )
        if self.latency_steps not in LATENCY_STEPS:
            from ..errors import EinshardError

            raise EinshardError(
                "einshard.Profile: latency_steps= takes one of "
                f"{', '.join(map(repr, LATENCY_STEPS))}, got {self.latency_steps!r}"
            )
        if self.narrow_floats not in NARROW_FLOATS:
            from ..errors import EinshardError

            raise EinshardError(
                "einshard.Profile: narrow_floats= takes one of "
                f"{', '.join(map(repr, NARROW_FLOATS))}, got {self.narrow_floats!r}"
            )

    @property
    def caveat(self) -> str:
        """What explain does not model of this profile's compiler ('' where it models it): a report's first line."""
        return COMPILER_CAVEATS.get(self.tiling, "")

    def collective_time(
        self, kind: str, n: int, bytes_sent: float, array_bytes: float, axis_sizes: tuple[int, ...] | None = None
    ) -> float:
        """Seconds for one collective over a group of ``n`` devices.

        ``axis_sizes``: the sizes of the mesh axes the group spans (their
        product is ``n``); a ring pass per axis gives Σ(n_i-1) hops.  Without
        it the group is one ring of ``n``.  Under ``latency_steps='peers'`` the
        latency counts the group's n - 1 peers, whatever its kind and axes.
        """
        if n <= 1:
            return 0.0
        fixed = self.collective_overhead
        if kind == "collective-permute":
            return fixed + self.latency + bytes_sent / self.bandwidth
        if self.latency_steps == "peers":
            return fixed + self.latency * (n - 1) + bytes_sent / self.bandwidth
        ring = sum(axis_sizes) - len(axis_sizes) if axis_sizes else n - 1  # Σ(n_i - 1)
        if kind == "all-to-all":
            if self.topology == "ring":
                return fixed + self.latency * ring + n * array_bytes / (4 * self.bandwidth)
            return fixed + self.latency * ring + bytes_sent / self.bandwidth
        hops = 2 * ring if kind == "all-reduce" else ring
        return fixed + self.latency * hops + bytes_sent / self.bandwidth

    def compute_time(self, flops: float) -> float:
        return flops / self.flops

    def walking(self) -> Profile:
        """The profile explain's walk ranks XLA's alternatives on (an all-reduce over several mesh axes or one per
        axis, a gather or a sum of pending pieces): this one with the ring count and no fixed part per collective
        (``latency_steps='ring'``, ``collective_overhead=0``), itself where it already is; :meth:`pricing` is the
        way back to it.

        XLA's SPMD partitioner chooses a program's collectives by its own rules, whatever the host runs them at;
        the ring count is the law the walk's choices were proven under (the external corpus' 396 cases,
        benchmarks/results/external_table.json).  Walked under ``cpu_profile(small_ops=True)``'s law (a rendezvous
        plus a price per peer, every kind alike) 22 of those cases took other collectives than XLA compiles (an
        all-reduce for an all-gather in the Flax CNN, BatchNorm and LSTM and the Equinox GRU and depthwise-conv
        tensor-parallel programs), and an MLP's data-parallel step over both axes of a (4, 2) mesh 5 all-reduces,
        one per axis, where XLA compiles 3 over all 8 devices (tests/test_host_profile.py).  What the collectives
        cost when they run is the profile's own law: the planner prices them on :meth:`pricing`
        (``planner.scoring.repriced_comm_s``)."""
        if self.latency_steps == "ring" and self.collective_overhead == 0.0:
            return self
        walking = dataclasses.replace(self, latency_steps="ring", collective_overhead=0.0)
        object.__setattr__(walking, "priced_as", self)  # frozen: as dataclasses' own __init__ sets a field
        return walking

    def pricing(self) -> Profile:
        """The profile whose law prices the collectives walked on this one: the one :meth:`walking` made it from,
        else itself."""
        return self if self.priced_as is None else self.priced_as

    def small_op_time(self, out_elements: float) -> float:
        """Seconds, beyond its FLOPs, of one op that computes and writes ``out_elements`` elements per device: the
        kernel's fixed cost and the elementwise work on its result (``op_overhead``, ``element_time``)."""
        return self.op_overhead + out_elements * self.element_time

    def on_devices(self, devices: int) -> Profile:
        """The profile of one of ``devices`` devices that compute at once (a mesh's): with fewer ``host_cores``
        than devices, the host's FLOP/s shared among them; itself otherwise.

        Simulated CPU devices run as threads of one process: 8 of them on 2 cores take turns, so a layout that
        computes the whole step on every device (replicated) costs 8x the FLOPs of a data-parallel one in
        wall time, not the same time "in parallel" (measured: benchmarks/cpu_calibration.py, a matmul's FLOP/s
        per device with 1, 2, 4, 8 devices busy).  The result has ``host_cores=None`` (the sharing is in its
        ``flops``), so it is not shared again.
        """
        if self.host_cores is None or devices <= self.host_cores:
            return self
        share = self.host_cores / devices
        return dataclasses.replace(
            self,
            flops=self.flops * share,
            op_overhead=self.op_overhead / share,
            element_time=self.element_time / share,
            host_cores=None,
        )


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one, else the CPU count): what
    the simulated CPU devices of one process share."""
    import os

    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cpu_profile(cores: int | None = None, *, small_ops: bool = True) -> Profile:
    """The ``cpu`` profile of a host whose simulated devices share ``cores`` cores (default: this process's,
    :func:`host_cores`).

    ``small_ops=True`` (the default since session 19; ``False`` is sessions 1-18's FLOPs-and-ring-hops profile): also
    price what a small step's compute is mostly made of on XLA:CPU, the elementwise work
    on the activations the products write and each dot's kernel (``element_time``, ``op_overhead``: :data:`CPU_ELEMENT_TIME`,
    :data:`CPU_OP_OVERHEAD`), with each piece of a merged all-reduce paying its own latency (``combined_latency=
    'per_piece'``, as XLA:CPU runs it) and a collective's time as a fixed rendezvous plus a price per peer of its
    group, the same for every kind (``collective_overhead``, ``latency``, ``latency_steps='peers'``:
    :data:`CPU_COLLECTIVE_OVERHEAD`, :data:`CPU_HOP_LATENCY`).  The element price is paid on the forward
    products' results only (twice where the program has a backward): ``planner.scoring.unwalked_compute_s``.  explain's
    walk ranks XLA's alternatives on the ring count still (:meth:`Profile.walking`); the planner prices the walked
    collectives on this law (``planner.scoring.repriced_comm_s``).  The planned layouts it gives, and what it still
    gets wrong, are in the comment above ``PROFILES``."""
    return Profile(
        "cpu",
        flops=1e11,
        bandwidth=1e10,
        latency=CPU_HOP_LATENCY if small_ops else 2e-5,
        narrow_floats="f32",
        host_cores=host_cores() if cores is None else cores,
        reduce_scatter="all-reduce",
        combined_latency="per_piece" if small_ops else "once",
        op_overhead=CPU_OP_OVERHEAD if small_ops else 0.0,
        element_time=CPU_ELEMENT_TIME if small_ops else 0.0,
        collective_overhead=CPU_COLLECTIVE_OVERHEAD if small_ops else 0.0,
        latency_steps="peers" if small_ops else "ring",
    )


# A dot's fixed cost on XLA:CPU, with a core to itself: benchmarks/cpu_calibration.py --sweep fits
# time = overhead + FLOPs / rate over (n, n) @ (n, n) products, n = 8 ... 256, on 8 busy devices of a 2-core host:
# 0.1-1.4 µs per dot (load 8-13) and 21-24 GFLOP/s per device (the ``flops`` below, shared 8 on 2 cores: 25) --
# the products themselves run at the priced rate down to 32 x 32; their size changes only the fixed share.
CPU_OP_OVERHEAD = 3.5e-7
# The elementwise work per element of an activation a forward product writes, per pass (forward, and backward on its
# cotangent), with a core to itself (4 ns with 8 devices on 2 cores): planner.scoring.unwalked_compute_s.  The sweep
# (cpu_calibration.py --sweep, 8 busy devices) prices one such kernel at a row reduction's 9-10 ns per element, a
# fused tanh's 32 ns; 1 ns (of 0.25, 1, 2, 5 ns) gave the best predicted order of the 7 programs' measured layouts
# (results/plan_latency_modes.json, plan_prediction.json; Kendall tau 0.78 against 0.76 for the default profile).
# Which results carry it, measured (session 18): benchmarks/cpu_calibration.py --dots (2026-11-27, 2-core host, load
# 4-10, two runs; results/cpu_dots.json) timed products on 8 busy devices pairing equal FLOPs with results 4 Ki to
# 1 Mi elements large, the weight gradient's form (x^T @ dy: a small result over a long contraction) beside the
# forward one: a (1024, 16) @ (16, 1024) product (1 Mi elements) 1.0-1.2 ms, a (64, 4096)^T-form one of the same
# 33.6 MFLOP (4 Ki elements) 4.6-9.2 ms.  Fitted as FLOPs / rate + elements * price, the price per result element
# came out negative (-0.05, -0.13 ns), and the larger of the two terms fits no better (residual 73-78%): a product's
# result costs nothing beyond its FLOPs, so the price stands for the work that follows a result, which follows an
# activation and not a weight gradient.  Until session 18 it was paid on every product's result, weight gradients
# included: on the large planning sizes (tests/test_plan_hand_presets.py) that charged data parallelism for the
# gradients it leaves whole on every device, and the plan was a mirrored hybrid sending 1.4-1.6x a hand layout's
# XLA bytes at no fewer FLOPs (kh_llama 28.5 MB against dp_all's 17.4, priced 19.4 ms of element work against
# dp_all's 26.1).  Not measured: the FLOP rate varies with the product's form (the forward form 25-46 GFLOP/s per
# device, the weight gradient's 4-20, slowest where its result is smallest), which a FLOP count at one rate misses.
CPU_ELEMENT_TIME = 1e-9
# A collective on XLA:CPU is a rendezvous of its group's device threads, then each reads its n - 1 peers' buffers
# (latency_steps='peers'), whatever its kind: benchmarks/cpu_calibration.py --groups (2026-11-27, 2-core host, load
# 3-6; results/cpu_collectives_by_group.json) timed chains of all-reduces, all-gathers and reduce-scatters over 2, 4
# and 8 devices of the (4, 2) mesh ('model', 'data', both), 1 and 32 KiB per device: 41-50, 73-94 and 124-153 µs,
# the three kinds within 10% of each other at each size; fitted per kind as 29-38 µs fixed plus 14-17 µs per peer
# (n - 1), worst residual 4-9% (a log2(n) law fits as well only with a negative fixed part).  So 30 µs + 14 µs per
# peer: a 4-device collective 1.6x a 2-device one, the 8 of both axes 2.9x.  The ring count (Σ(n_i - 1) hops, an
# all-reduce twice) priced an all-gather at half an all-reduce and the 8 of both axes as 4 hops, 2x a 2-device one;
# with hops alone (no fixed part) a 4-device all-reduce at 3x a 2-device one, which made the planner put the many
# gradient pieces of the three transformers on the 2-device axis (a mirrored hybrid, 2.3x the hybrid's bytes, no
# faster).  The law moves with the load (at load 8-13 an all-reduce took 41/103/244 µs).
CPU_COLLECTIVE_OVERHEAD = 3.0e-5
CPU_HOP_LATENCY = 1.4e-5


PROFILES: dict[str, Profile] = {
    # cpu_profile(small_ops=True) since session 19; the history of both below.
    # A CPU host running simulated devices: ~100 GFLOP/s per device (a few AVX-512 cores), devices
    # "talk" through host memory copies at ~10 GB/s.  The latency per ring step is what a collective costs
    # inside a step, measured (benchmarks/cpu_calibration.py): 5 µs alone on an idle 16-core host but ~9 µs
    # inside a training step there, and ~45 µs on a 2-core host running 8 devices; 20 µs sits between, so a
    # tiny model is not split where the collectives' rendezvous costs more than the compute saved (the external
    # corpus' scanned stack: splitting the batch measured 1.2-1.5x slower than no split at all, predicted
    # faster at 5 µs).  Rough, for relative answers only.
    # XLA:CPU moves bf16/f16 values as f32 (narrow_floats, :func:`wire_itemsize`).  The simulated devices
    # share this host's cores (host_cores, :meth:`Profile.on_devices`): measured, a matmul runs at ~88 GFLOP/s
    # per device with 1 or 2 of 8 devices busy on a 2-core host, ~9-22 GFLOP/s with 4 or 8 busy.  XLA:CPU's
    # all-reduce thunk runs each piece of a combined (tuple) all-reduce as its own collective (a loop of
    # AllReduce calls, one per buffer), measured ~one all-reduce's time per piece (benchmarks/cpu_calibration.py);
    # combined_latency='per_piece' models it, but this profile keeps 'once', by measured step time
    # (benchmarks/plan_latency_modes.py, results/plan_latency_modes.json, load 11-26): on the demo's, the NNX and the
    # Equinox transformers the plan made under 'per_piece' (the batch replicated, Megatron splits: 2.2-3.3 MB and
    # 17-22 collectives per step) ran 1.2-2.0x slower than the plan made under 'once' (the batch over both axes:
    # 0.29 MB, 26-29 pieces), beyond the split-half noise in 5 of 6 runs.  What 'per_piece' alone gets wrong is the
    # other side of the trade: the elementwise work on whole activations, unpriced (cpu_profile(small_ops=True)
    # prices it: CPU_ELEMENT_TIME).  With it (session 16, load 14-21, benchmarks/plan_prediction.py --small-ops
    # --rounds 30, results/plan_prediction_small_ops.json) the four planned external families plan the replicated
    # step, 0 bytes, measured 1.00x (kh_llama), 1.00x (keras_vit, noise 27%), 1.02x (hk_stack, noise 21-37%) and
    # 0.91x (kh_t5, noise 2-5%) the fastest hand layout (0.94-1.17x under this profile, session 15), with the
    # predicted order of all layouts against the measured one at Kendall tau 0.80/0.40/0.60/0.80 (1.00/0.20/0.60/
    # 0.33).  But the three transformers plan a mirrored hybrid (Megatron over 'data', the batch over 'model':
    # 1.36 MB) that ran as fast as the best hand layout (nnx 33.0 vs hybrid 33.6 ms, eqx 41.9 vs 43.0, demo 45.4 vs
    # 39.8 +-76%; 20 rounds, benchmarks/plan_latency_modes.py) and sends 2.3x the hybrid's bytes at more FLOPs
    # (tests/test_planner_reality.py failed on it): the hop-proportional latency prices an all-reduce over the
    # 4 'data' devices at 3x one over the 2 'model' devices, so the plan put the many gradient pieces on 'model';
    # measured 1.7x at load 2 (42/70/127 µs over 2/4/8 devices: mostly a fixed cost), 2.5x at load 8-13.  The
    # option now prices a collective as XLA:CPU runs it, a fixed rendezvous plus a price per peer of its group, the
    # same for every kind (CPU_COLLECTIVE_OVERHEAD, CPU_HOP_LATENCY, latency_steps='peers'; session 17): the three
    # transformers pass tests/test_planner_reality.py under it, and the four families still plan the replicated
    # step, measured 0.89/0.95/0.80/0.88x the fastest hand layout (plan_prediction.py --small-ops --rounds 300, load
    # 8-12; keras_vit 1.05-1.35x in two other runs: its replicated step and tp trade places run to run).  On the LARGE
    # planning sizes (tests/test_plan_hand_presets.py) it planned layouts that sent 1.4-1.6x the XLA bytes of a hand
    # layout at no fewer FLOPs (kh_llama: the mirrored hybrid, 28.5 MB against dp_all's 17.4 MB; hk_stack: 33.8 MB
    # against dp_tp's 24.2 MB): the element price was paid on every dot's result, weight gradients included
    # (dp_all writes each weight's whole gradient per device, the hybrid a quarter of it: 26.1 against 19.4 ms).
    # Session 18 prices it on the forward products' results only, twice with a backward (CPU_ELEMENT_TIME's comment,
    # measured: a product's result elements cost nothing beyond its FLOPs): both large families plan dp_all's
    # program (17.4 MB, 22.1 MB: the fewest FLOPs, no hand layout sends 10% less), the three transformers still
    # pass tests/test_planner_reality.py, the four small families still plan the replicated step (measured 0.96/1.09/
    # 0.84/0.82x the fastest hand layout, --rounds 200, load 19-22: within noise).  Still an option:
    # under a memory budget (test_plan_hand_presets.py's budget test) hk_stack's plan sends 32.1 MB against dp_tp's
    # 24.2 at its FLOPs (predicted 282.51 against 282.73 ms: a tie the model cannot split), and measured (12
    # interleaved rounds, load 14-16) 1139 ms against dp_tp's 926 wall (1.23x, split-half noise ~10%), 388 against 386
    # ms of process CPU: the time apart is waiting, not compute, which the collectives' price does not reach.
    # planner.scoring.NEAR_TIE (session 18) settles such ties by bytes sent: that plan is now dp_tp's program
    # (24.19 MB by XLA).  The default since session 19, with its collectives chosen on the ring count and priced on
    # this law (Profile.walking: walked on this law 22 external corpus cases and an MLP's data-parallel step over
    # both axes took other collectives than XLA compiles; walked on the ring count none does).  Measured then
    # (plan_prediction.py --rounds 300, load 6-9, results/plan_prediction.json): the four small families plan the
    # replicated step, 0 bytes, 0.97/1.01/0.83/0.90x the fastest hand layout (tp in each; split-half noise 1-4%,
    # kh_t5's tp 13%).  Of the 8 tests that failed under it, one found that cause (test_plan_verify's MLP step: 5
    # all-reduces predicted, 3 compiled); the others had pinned the FLOPs-only profile's choices: a prediction the
    # compiler corrects (test_plan_verify, test_plan_explicit: now on cpu_profile(small_ops=False), the default shown
    # to rank first what the compiler chooses), compute without the element prices (test_host_profile).
    "cpu": cpu_profile(),
    # H100 SXM in an 8-GPU NVLink node: 989 TFLOP/s dense bf16 and 450 GB/s NVLink egress per GPU
    # (scaling book, gpus.md: "T_AG ≈ B/450e9", C/W ≈ 2200 tokens/GPU).  Per-hop latency ~2 µs (assumed:
    # the book measures AR bus bandwidth only for large messages).
    "h100": Profile("h100", flops=989e12, bandwidth=450e9, latency=2e-6),
    # TPU v5p: 4.59e14 bf16 FLOP/s and 1.8e11 B/s bidirectional ICI per axis (scaling book, sharding.md /
    # training.md: C/W = 2550), T_min ≈ 1 µs per hop; an axis is a (torus) ring.
    "tpu-v5p": Profile("tpu-v5p", flops=4.59e14, bandwidth=1.8e11, latency=1e-6, topology="ring", tiling="tpu"),
}

# What explain's collectives do not model of a profile's compiler, by its tiling: a report's first line says it.
# Measured on minimal programs (libtpu against XLA:CPU, docs/targets.md): the TPU compiler gathers a sharded
# weight again at each use (3 FSDP layers: 5 all-gathers forward, 18 with the gradient, against 3 and 7) and
# merges or reassociates gradient all-reduces (t5 TP gradient: 11 against 18), by heuristics and thresholds,
# and overlaps its async collectives with compute; its tile padding is modelled (buffer_bytes).
COMPILER_CAVEATS: dict[Tiling, str] = {
    "tpu": (
        # Each clause is a departure measured on the per-primitive cases (tests/test_target_primitives.py).
        "collectives as XLA's SPMD partitioner chooses them on CPU/GPU; the TPU compiler gathers sharded "
        "(FSDP) weights per use, merges collectives (gradient all-reduces, a gather over two axes), simplifies "
        "some away, partitions sorts, top_k and argmax its own way, and overlaps collectives with compute, by its "
        "own heuristics: compile with plan(verify=) for its numbers; memory in its tiles"
    ),
}


# The profile a device kind (``jax.devices()[0].device_kind``) runs as: the first key found in it, lower-cased,
# and whether the profile was measured for that kind (else the reports name the kind it stands in for: an
# H200 has an H100's FLOP/s and NVLink, more memory).
DEVICE_KINDS: tuple[tuple[str, str, bool], ...] = (
    ("h100", "h100", True),
    ("h200", "h100", False),
    ("v5p", "tpu-v5p", True),
)
# A device kind with no profile of its own runs as its platform's nearest one (named so on the reports).
PLATFORM_FALLBACK: dict[str, str] = {"gpu": "h100", "cuda": "h100", "rocm": "h100", "tpu": "tpu-v5p"}


def profile_for(platform: str, device_kind: str) -> Profile:
    """The profile of a device: ``'cpu'`` on a CPU, by its kind on a GPU/TPU (H100, H200: ``h100``;
    TPU v5p: ``tpu-v5p``); another accelerator gets its platform's profile, renamed to say it stands in."""
    if platform == "cpu":
        return PROFILES["cpu"]
    kind = device_kind.lower()
    for key, name, own in DEVICE_KINDS:
        if key in kind:
            return PROFILES[name] if own else _renamed(PROFILES[name], f"{name} (for {device_kind})")
    stand_in = PLATFORM_FALLBACK.get(platform, "cpu")
    return _renamed(PROFILES[stand_in], f"{stand_in} (stand-in for {device_kind}: no profile of its own)")


def _renamed(profile: Profile, name: str) -> Profile:
    import dataclasses

    return dataclasses.replace(profile, name=name)


def default_profile() -> Profile:
    """The profile of the machine this process runs on (its first device): what ``profile=None`` means."""
    import jax

    device = jax.devices()[0]
    return profile_for(device.platform, str(getattr(device, "device_kind", device.platform)))


def shared_profile(profile: Profile | str | None, mesh: tuple[Any, ...]) -> Profile:
    """:func:`get_profile`'s profile for one device of ``mesh`` (MeshAxis records) while every device of it
    computes: on simulated devices sharing a host's cores, the FLOP/s each gets (:meth:`Profile.on_devices`); as
    explain's walk ranks its alternatives on it (:meth:`Profile.walking`)."""
    return get_profile(profile).on_devices(math.prod(m.size for m in mesh)).walking()


def get_profile(profile: Profile | str | None) -> Profile:
    """A :class:`Profile` from itself, a preset name, or None (this machine's: :func:`default_profile`)."""
    if profile.__class__ is str:  # the common call: a preset's name as written in the table
        hit = PROFILES.get(profile)  # type: ignore[arg-type]
        if hit is not None:
            return hit
    from ..errors import EinshardError

    if profile is None:
        return default_profile()
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, str) and profile.lower() in PROFILES:
        return PROFILES[profile.lower()]
    raise EinshardError(
        f"unknown hardware profile {profile!r}",
        hint="Use one of " + ", ".join(repr(k) for k in PROFILES) + ", or an einshard.Profile(...).",
    )


@dataclass(frozen=True)
class Collective:
    """One collective an einsum needs, what it costs, and where it runs (the lowering runs :attr:`steps`).

    Attributes:
        kind: one of :data:`~einshard.core.collectives.KINDS`.
        axes: the mesh axis names it runs over (one collective over their devices together).
        group_size: devices per group (the product of the axes' sizes).
        bytes: bytes each device sends (ring formulas, module doc).
        array_bytes: the buffer it works on, per device group, as XLA prints its shape (module doc).
        time: α–β seconds on the profile.
        tensor: which tensor: ``'operand 1'``, ``'result'``, ...
        why: one line of reason.
        before, after: the tensor's layout before and after.
        operand: which tensor, for the lowering: the operand's position (0-based) or ``'out'``.
        dim: the tensor dimension it gathers, scatters onto, or moves a split away from.
        to_dim: an all-to-all's dimension that becomes split.
    """

    kind: CollectiveKind
    axes: tuple[str, ...]
    group_size: int
    bytes: int
    array_bytes: int
    time: float = 0.0
    tensor: str = ""
    why: str = ""
    before: Layout | None = field(default=None, compare=False, repr=False)
    after: Layout | None = field(default=None, compare=False, repr=False)
    operand: Target | None = None
    dim: int | None = None
    to_dim: int | None = None

    @property
    def steps(self) -> tuple[Step, ...]:
        """What the lowering runs for this collective, read off the record (no layouts compared).

        One step, except a reduce-scatter that also slices other mesh axes into its
        dimension, in an order that puts them between or before its own axes
        (``{U:m} y -> y@(d,m)``): the slices and the scatter then run in that order
        (slicing a pending sum is exact: each device slices its own partial value).
        """
        from ..errors import EinshardError

        if self.operand is None:
            raise EinshardError(f"{self}: no operand recorded, so it cannot be run")
        if self.kind == "collective-permute":
            if self.before is None or self.after is None:
                raise EinshardError(f"{self}: a permute runs only as a reorder of one tensor's mesh axes")
            return (Step(self.kind, self.operand, self.axes, reorder=(self.before.dims, self.after.dims)),)
        if self.kind == "reduce-scatter" and self.before is not None and self.after is not None:
            assert self.dim is not None
            had, new = self.before.dims[self.dim], self.after.dims[self.dim]
            if new[: len(had)] == had and new[len(had) :] != self.axes:
                out: list[Step] = []
                for m in new[len(had) :]:
                    kind: StepKind = "reduce-scatter" if m in self.axes else "dynamic-slice"
                    if out and out[-1].kind == kind:
                        out[-1] = Step(kind, self.operand, (*out[-1].mesh_axes, m), dim=self.dim)
                    else:
                        out.append(Step(kind, self.operand, (m,), dim=self.dim))
                return tuple(out)
        return (Step(self.kind, self.operand, self.axes, dim=self.dim, to_dim=self.to_dim),)

    @classmethod
    def _derive(cls, values: dict[str, Any]) -> Collective:
        """The trusted constructor: a Collective from ``values`` (every field by name), which the caller built
        (:func:`price`, or a priced record with its operand set).  The generated ``__init__`` is most of the
        cost of a record the analyzer makes per priced move, so it is skipped unless ``EINSHARD_CHECKS=1``
        (:data:`einshard._checks.INVARIANTS`), which checks that ``values`` names every field once."""
        if _checks.INVARIANTS and set(values) != _FIELDS:
            from ..errors import EinshardError

            raise EinshardError(
                f"internal: Collective._derive got fields {sorted(values)}; a Collective has {sorted(_FIELDS)}"
            )
        new = _new(cls)
        new.__dict__.update(values)  # a frozen dataclass without slots: as object.__setattr__ would
        return new

    def __str__(self) -> str:
        return f"{self.kind}@{','.join(self.axes)} ({self.tensor}, {_human(self.bytes)}/device)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "group_size": self.group_size,
            "bytes": self.bytes,
            "array_bytes": self.array_bytes,
            "time": self.time,
            "tensor": self.tensor,
            "why": self.why,
            "before": str(self.before) if self.before is not None else None,
            "after": str(self.after) if self.after is not None else None,
            "operand": self.operand,
            "dim": self.dim,
            "to_dim": self.to_dim,
        }


_new = object.__new__
_FIELDS = frozenset(f.name for f in fields(Collective))


# ---------------------------------------------------------------------------
# The byte formulas (module doc's table): one collective over ``n`` devices, each holding a block of
# ``local_in`` bytes before and ``local_out`` after, gives (array_bytes, bytes sent per device).
# A new collective kind adds its entry here (and its move in core.moves, its Step in lowering.steps).

RingBytes = Callable[[int, int, int], tuple[int, float]]

RING_BYTES: dict[CollectiveKind, RingBytes] = {
    # V is the gathered result
    "all-gather": lambda n, local_in, local_out: (local_out, (n - 1) / n * local_out),
    # V is the full (unscattered) input
    "reduce-scatter": lambda n, local_in, local_out: (local_in, (n - 1) / n * local_in),
    # a reduce-scatter then an all-gather
    "all-reduce": lambda n, local_in, local_out: (local_in, 2 * (n - 1) / n * local_in),
    # each device keeps 1/n of its shard and sends the rest
    "all-to-all": lambda n, local_in, local_out: (local_in, (n - 1) / n * local_in),
    # every device sends its block once; a regroup's permute sends the blocks of the finer split (the
    # coarser side's factor is gathered after it, or is whole already)
    "collective-permute": lambda n, local_in, local_out: (min(local_in, local_out), float(min(local_in, local_out))),
}


def sent_bytes(kind: CollectiveKind, n: int, array: float) -> float:
    """Bytes each of ``n`` devices sends in a ``kind`` on a buffer of ``array`` bytes in XLA's convention (the
    gathered result; the unscattered input): :data:`RING_BYTES` read at one buffer size, for the rules that
    know a buffer rather than the blocks before and after."""
    return RING_BYTES[kind](n, int(array), int(array))[1]


def _local_bytes(lay: Layout, itemsize: int) -> int:
    """``lay.bytes_per_device(itemsize)``, written out: this is the analyzer's innermost loop."""
    sizes = mesh_sizes(lay)
    n = itemsize
    for s, d in zip(lay.shape, lay.dims, strict=False):
        k = 1
        for m in d:
            k *= sizes[m]
        n *= s // k
    return n


def price(move: Move, *, itemsize: int = 4, profile: Profile | None = None, tensor: str = "") -> Collective:
    """The :class:`Collective` a move is, priced on ``profile`` (default ``'cpu'``) for elements of
    ``itemsize`` bytes: its bytes by :data:`RING_BYTES`, its time by :meth:`Profile.collective_time`."""
    kind, axes, n, before, after = move.kind, move.axes, move.group_size, move.before, move.after
    local_in = _local_bytes(before, itemsize)
    local_out = local_in if kind in _SAME_BLOCK else _local_bytes(after, itemsize)
    array_bytes, sent = RING_BYTES[kind](n, local_in, local_out)
    sent_i = int(round(sent)) if axes else 0  # a permute that moves no mesh axis sends nothing
    per_axis = tuple(map(mesh_sizes(before).__getitem__, axes))
    if math.prod(per_axis) != n:  # a regrouped gather runs over a factor of its axes: one ring of n
        per_axis = (n,)
    p = _CPU if profile is None else profile
    return Collective._derive(
        {
            "kind": kind,
            "axes": axes,
            "group_size": n,
            "bytes": sent_i,
            "array_bytes": array_bytes,
            "time": p.collective_time(kind, n, sent_i, array_bytes, per_axis),
            "tensor": tensor,
            "why": move.why,
            "before": before,
            "after": after,
            "operand": None,
            "dim": move.dim,
            "to_dim": move.to_dim,
        }
    )


# The kinds whose formula reads only the block before (the output block is not computed for them).
_SAME_BLOCK = frozenset({"reduce-scatter", "all-reduce", "all-to-all"})
_CPU = PROFILES["cpu"]


# ---------------------------------------------------------------------------
# The algebra's moves, priced: what einshard.analysis exports and the analyzer calls.


def all_gather(
    lay: Layout, axes: tuple[str, ...], *, itemsize: int = 4, profile: Profile = _CPU, tensor: str = "", why: str = ""
) -> tuple[Layout, Collective]:
    """:func:`einshard.core.moves.all_gather`, priced: gather mesh axes ``axes`` (the minor-most of one
    tensor axis) out of ``lay``."""
    after, move = moves.all_gather(lay, axes, why=why)
    return after, price(move, itemsize=itemsize, profile=profile, tensor=tensor)


def dynamic_slice(lay: Layout, axes: tuple[str, ...], axis: str | int) -> tuple[Layout, None]:
    """:func:`einshard.core.moves.dynamic_slice`: free (each device keeps its own block), so no price."""
    return moves.dynamic_slice(lay, axes, axis)


def all_reduce(
    lay: Layout, axes: tuple[str, ...], *, itemsize: int = 4, profile: Profile = _CPU, tensor: str = "", why: str = ""
) -> tuple[Layout, Collective]:
    """:func:`einshard.core.moves.all_reduce`, priced: ``{U:a} → complete``."""
    after, move = moves.all_reduce(lay, axes, why=why)
    return after, price(move, itemsize=itemsize, profile=profile, tensor=tensor)


def reduce_scatter(
    lay: Layout,
    axes: tuple[str, ...],
    axis: str | int,
    *,
    order: tuple[str, ...] | None = None,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    why: str = "",
) -> tuple[Layout, Collective]:
    """:func:`einshard.core.moves.reduce_scatter`, priced: ``{U:a} → x@a`` (``order``: the split after)."""
    after, move = moves.reduce_scatter(lay, axes, axis, order=order, why=why)
    return after, price(move, itemsize=itemsize, profile=profile, tensor=tensor)


def all_to_all(
    lay: Layout,
    axes: tuple[str, ...],
    src: str | int,
    dst: str | int,
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    why: str = "",
) -> tuple[Layout, Collective]:
    """:func:`einshard.core.moves.all_to_all`, priced: ``x@a y → x y@a``."""
    after, move = moves.all_to_all(lay, axes, src, dst, why=why)
    return after, price(move, itemsize=itemsize, profile=profile, tensor=tensor)


def collective_permute(
    lay: Layout,
    dims: tuple[tuple[str, ...], ...],
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    why: str = "",
) -> tuple[Layout, Collective]:
    """:func:`einshard.core.moves.collective_permute`, priced: the same mesh axes per tensor axis, reordered."""
    after, move = moves.collective_permute(lay, dims, why=why)
    return after, price(move, itemsize=itemsize, profile=profile, tensor=tensor)


def regroup(
    lay: Layout,
    axis: str | int,
    gone: tuple[str, ...],
    new: tuple[str, ...],
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
) -> tuple[Layout, tuple[Collective, ...]]:
    """:func:`einshard.core.moves.regroup`, priced: re-split ``axis`` from mesh axes ``gone`` to ``new``.

    Example:
        >>> from einshard.placement import Layout, MeshAxis
        >>> a = Layout(("c",), (16,), (MeshAxis("x", 4), MeshAxis("y", 2)), (("x",),))
        >>> b, steps = regroup(a, "c", ("x",), ("y",))
        >>> b.dims, [(s.kind, s.group_size, s.array_bytes) for s in steps]
        ((('y',),), [('collective-permute', 4, 16), ('all-gather', 2, 32)])
    """
    after, found = moves.regroup(lay, axis, gone, new)
    return after, tuple([price(m, itemsize=itemsize, profile=profile, tensor=tensor) for m in found])


def transition(
    src: Layout, dst: Layout, *, itemsize: int = 4, profile: Profile = _CPU, tensor: str = ""
) -> tuple[Layout, tuple[Collective, ...]]:
    """:func:`einshard.core.moves.transition`, priced: the collectives that take ``src`` to ``dst`` (same
    tensor, same mesh) in XLA's order.

    Raises EinshardError if ``dst`` holds pending sums ``src`` does not (a
    complete value cannot become a pending sum by communication).

    Example:
        >>> from einshard.placement import Layout, MeshAxis
        >>> mesh = (MeshAxis("x", 4),)
        >>> a = Layout(("a", "b"), (16, 32), mesh, (("x",), ()))
        >>> _, steps = transition(a, a.with_dims(((), ("x",))))
        >>> [(c.kind, c.array_bytes) for c in steps]      # V11: one all-to-all of the local shard
        [('all-to-all', 512)]
    """
    after, found = moves.transition(src, dst)
    if not found:  # the common answers: nothing to do, or free slices
        return after, ()
    return after, tuple([price(m, itemsize=itemsize, profile=profile, tensor=tensor) for m in found])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def human_bytes(n: float) -> str:
    """``human_bytes(3 * 2**20)`` → ``'3 MiB'``."""
    return _human(n)


def human_time(t: float) -> str:
    """``human_time(2.5e-6)`` → ``'2.5 µs'``."""
    if t == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"
