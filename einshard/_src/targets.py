"""Targets: the hardware a plan is for, when it is not the hardware this runs on.

``target='tpu:v5p:4x4x4'`` (``explain``, ``plan``; ``einshard plan --target``)
names a TPU slice: a generation and its chip topology.  With libtpu installed
(``pip install 'einshard[tpu]'``; no TPU needed) JAX describes that slice's
devices (``jax.experimental.topologies``), einshard builds the mesh over them
and ``plan(verify=k)`` compiles each candidate with the TPU compiler itself,
shapes only, reading its collectives and ``memory_analysis()``.

``target='gpu:h100x8'`` names GPUs: a profile only (no GPU compiler runs
without the device), and the plan says that no compiler check was possible.

Each chip's numbers, with their public sources (docs/targets.md lists them):

=========  ==========  ========  ========================  ==========
chip       bf16 FLOP/s HBM/chip  ICI, bidirectional/axis   torus
=========  ==========  ========  ========================  ==========
TPU v4     2.75e14     32 GiB    9.0e10 B/s                3-D
TPU v5e    1.97e14     16 GiB    9.0e10 B/s                2-D
TPU v5p    4.59e14     95 GiB    1.8e11 B/s                3-D
TPU v6e    9.18e14     32 GiB    1.8e11 B/s                2-D
H100 SXM   9.89e14     80 GB     4.5e11 B/s (NVLink)       switch
H200 SXM   9.89e14     141 GB    4.5e11 B/s (NVLink)       switch
=========  ==========  ========  ========================  ==========

Example:
    >>> from einshard.targets import parse_target
    >>> t = parse_target('tpu:v5p:4x4x4')
    >>> t.chips, t.profile.name, t.hbm_bytes // 2**30
    (64, 'tpu-v5p', 95)
    >>> parse_target('gpu:h100x8').compiles
    False
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ._checks import describe_value
from .analysis.cost import Profile
from .core.mesh import MeshLike
from .errors import EinshardError

__all__ = ["Chip", "Target", "CHIPS", "parse_target", "target_mesh", "target_devices", "libtpu_available", "on_target"]

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One accelerator chip's public numbers (the profile a target's times are for).

    Attributes:
        name: the profile's name (``'tpu-v5p'``).
        platform: ``'tpu'`` (compiled through libtpu) or ``'gpu'`` (a profile only).
        flops: dense bf16 FLOP/s per chip.
        hbm_bytes: HBM per chip.
        bandwidth: bytes/s one chip sends over one mesh axis (ICI: both directions of the axis's links).
        torus: the interconnect: ``3`` / ``2`` (a 3-D / 2-D TPU torus, each axis a ring) or ``0`` (a switch).
        source: where the numbers come from.
    """

    name: str
    platform: Literal["tpu", "gpu"]
    flops: float
    hbm_bytes: int
    bandwidth: float
    torus: Literal[0, 2, 3]
    source: str

    @property
    def profile(self) -> Profile:
        # TPU ICI: ~1 µs per hop (scaling book); NVLink: ~2 µs per step (einshard's h100 profile).
        if self.platform == "tpu":
            return Profile(
                self.name, flops=self.flops, bandwidth=self.bandwidth, latency=1e-6, topology="ring", tiling="tpu"
            )
        return Profile(self.name, flops=self.flops, bandwidth=self.bandwidth, latency=2e-6)


_CLOUD = "cloud.google.com/tpu/docs/"
_BOOK = "jax-ml.github.io/scaling-book/tpus (ICI bandwidth table)"

# The registry of chips a target may name: generation -> its numbers.
CHIPS: dict[str, Chip] = {
    "v4": Chip("tpu-v4", "tpu", 2.75e14, 32 * GiB, 9.0e10, 3, f"{_CLOUD}v4; {_BOOK}"),
    "v5e": Chip("tpu-v5e", "tpu", 1.97e14, 16 * GiB, 9.0e10, 2, f"{_CLOUD}v5e; {_BOOK}"),
    "v5p": Chip("tpu-v5p", "tpu", 4.59e14, 95 * GiB, 1.8e11, 3, f"{_CLOUD}v5p; {_BOOK}"),
    "v6e": Chip("tpu-v6e", "tpu", 9.18e14, 32 * GiB, 1.8e11, 2, f"{_CLOUD}v6e; {_BOOK}"),
    "h100": Chip(
        "h100", "gpu", 989e12, 80 * 10**9, 450e9, 0, "nvidia.com/en-us/data-center/h100 (SXM); scaling-book gpus"
    ),
    "h200": Chip(
        "h200", "gpu", 989e12, 141 * 10**9, 450e9, 0, "nvidia.com/en-us/data-center/h200 (SXM); scaling-book gpus"
    ),
}

_TPU = re.compile(r"^tpu:(?P<gen>v\w+?):(?P<topo>\d+(?:x\d+){1,2})$")
_GPU = re.compile(r"^gpu:(?P<gen>\w+?)x(?P<n>\d+)$")


@dataclass(frozen=True)
class Target:
    """A slice of hardware to plan for: ``'tpu:v5p:4x4x4'`` or ``'gpu:h100x8'``.

    Attributes:
        spec: the text it was parsed from.
        chip: the chip's numbers.
        topology: the chip grid (``(4, 4, 4)``; GPUs: ``(n,)``).
    """

    spec: str
    chip: Chip
    topology: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.topology)

    @property
    def profile(self) -> Profile:
        return self.chip.profile

    @property
    def hbm_bytes(self) -> int:
        return self.chip.hbm_bytes

    @property
    def compiles(self) -> bool:
        """Whether its compiler runs here without the hardware (TPU, through libtpu)."""
        return self.chip.platform == "tpu"

    @property
    def topology_name(self) -> str:
        """The name JAX's ``get_topology_desc`` takes (``'v5p:4x4x4'``)."""
        return self.spec.split(":", 1)[1]

    def default_mesh(self) -> dict[str, int]:
        """The mesh a target gets when none is given: ``model`` over the last topology axis (one ring of
        ICI links), ``data`` over the rest; GPUs: ``data`` over all."""
        if not self.compiles or len(self.topology) == 1:
            return {"data": self.chips}
        return {"data": self.chips // self.topology[-1], "model": self.topology[-1]}

    def note(self) -> str:
        """What the target's numbers are, and what checks them: one line for reports."""
        check = (
            f"{self.profile.caveat}; plan(verify=) compiles with the TPU compiler (libtpu, shapes only)"
            if self.compiles
            else "a profile only: no compiler check is possible without the device"
        )
        return (
            f"target {self.spec}: {self.chips} chips, {self.hbm_bytes / GiB:.0f} GiB HBM each, "
            f"{self.chip.flops:.3g} FLOP/s, {self.chip.bandwidth:.3g} B/s per axis; {check}"
        )


def parse_target(spec: str | Target) -> Target:
    """``'tpu:v5p:4x4x4'`` / ``'gpu:h100x8'`` -> a :class:`Target`.

    Raises:
        EinshardError: not a target's form, or a chip the registry has not.
    """
    if isinstance(spec, Target):
        return spec
    if not isinstance(spec, str):
        raise EinshardError(
            f"target= takes a target's name ('tpu:v5p:4x4x4', 'gpu:h100x8') or a Target, got {describe_value(spec)}"
        )
    text = spec.strip().lower()
    tpu, gpu = _TPU.match(text), _GPU.match(text)
    known = ", ".join(k for k in CHIPS)
    if tpu is not None:
        chip = CHIPS.get(tpu["gen"])
        if chip is None or chip.platform != "tpu":
            raise EinshardError(
                f"target {spec!r}: no TPU generation {tpu['gen']!r}",
                hint=f"Known chips: {known}.",
            )
        topology = tuple(int(d) for d in tpu["topo"].split("x"))
        if len(topology) != chip.torus or 0 in topology:
            raise EinshardError(
                f"target {spec!r}: a {tpu['gen']} slice is a {chip.torus}-D grid of chips, got {tpu['topo']!r}",
                hint="e.g. 'tpu:v5p:2x2x2', 'tpu:v5e:2x2'.",
            )
        return Target(text, chip, topology)
    if gpu is not None:
        chip = CHIPS.get(gpu["gen"])
        if chip is None or chip.platform != "gpu" or int(gpu["n"]) < 1:
            raise EinshardError(f"target {spec!r}: no GPU {gpu['gen']!r}", hint=f"Known chips: {known}.")
        return Target(text, chip, (int(gpu["n"]),))
    raise EinshardError(
        f"target {spec!r} is not a target: write 'tpu:GENERATION:TOPOLOGY' ('tpu:v5p:4x4x4') or "
        f"'gpu:CHIPxCOUNT' ('gpu:h100x8')",
        hint=f"Known chips: {known}.",
    )


def libtpu_available() -> bool:
    """Whether libtpu is installed (the ``[tpu]`` extra), without loading it."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def target_devices(target: str | Target) -> Any:
    """The target's TPU devices as JAX describes them (``topologies.get_topology_desc``), no TPU needed.

    Raises:
        EinshardError: libtpu is not installed (naming the ``[tpu]`` extra), the target is a GPU, or
            libtpu refuses the topology.
    """
    target = parse_target(target)
    if not target.compiles:
        raise EinshardError(
            f"target {target.spec!r}: no compiler for {target.chip.name} runs without the device; "
            "the target gives a profile only"
        )
    if not libtpu_available():
        raise EinshardError(
            f"target {target.spec!r} compiles with the TPU compiler, which comes with libtpu: not installed",
            hint="pip install 'einshard[tpu]' (libtpu from PyPI; no TPU needed), or pass verify=0 to plan on "
            "the target's profile alone.",
        )
    return _topology(target.topology_name)


@functools.cache  # one description per topology name: libtpu builds it once
def _topology(name: str) -> Any:
    import os

    from jax.experimental import topologies

    # libtpu takes a machine-wide lock file (/tmp/libtpu_lockfile) meant for processes that own TPU chips;
    # describing and compiling for a topology owns none, so several processes (pytest-xdist workers, two
    # plans) may do it at once.  A user's own setting is kept.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as err:  # noqa: BLE001  (libtpu's errors have no common type)
        raise EinshardError(f"target 'tpu:{name}': libtpu refused the topology: {type(err).__name__}: {err}") from err


def _mesh_sizes(sizes: Any, what: str) -> dict[str, int]:
    """Mesh axis sizes given for a target: names to counts >= 1 (an EinshardError naming ``sizes``/``mesh=``)."""
    if not isinstance(sizes, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
        for k, v in sizes.items()
    ):
        raise EinshardError(f"{what} takes mesh axis sizes like {{'data': 2, 'model': 2}}, got {describe_value(sizes)}")
    return {k: int(v) for k, v in sizes.items()}


def target_mesh(target: str | Target, sizes: Mapping[str, int]) -> Any:
    """A ``jax.sharding.Mesh`` of the target's TPU devices with axes ``sizes`` (Auto axes, as
    ``topologies.make_mesh`` builds it: the compiler propagates layouts through the step).

    Raises:
        EinshardError: the sizes do not multiply to the target's chips (naming both), or as
            :func:`target_devices`.
    """
    target = parse_target(target)
    sizes = _mesh_sizes(sizes, "target_mesh(): sizes=")
    n = math.prod(sizes.values())
    if n != target.chips:
        raise EinshardError(
            f"target {target.spec!r} has {target.chips} chips; the mesh {dict(sizes)} has {n}",
            hint=f"Give a mesh whose sizes multiply to {target.chips}, e.g. {target.default_mesh()}.",
        )
    from jax.experimental import topologies

    topo = target_devices(target)
    return topologies.make_mesh(topo, tuple(sizes.values()), tuple(sizes))


def on_target(target: str | Target, mesh: MeshLike, profile: Any, what: str) -> tuple[dict[str, int], Any]:
    """``(mesh sizes, profile)`` for analysing on ``target``: ``mesh=`` as sizes, a Mesh's or AbstractMesh's
    sizes, else the target's default mesh (their product must be the target's chips); ``profile=``, else
    the target's chip's.

    Raises:
        EinshardError: not a target, or a mesh of another device count (naming both).
    """
    tgt = parse_target(target)
    if mesh is None:
        sizes = tgt.default_mesh()
    elif isinstance(mesh, Mapping):
        sizes = _mesh_sizes(mesh, f"{what}: with target={tgt.spec!r}, mesh=")
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "axis_sizes"):
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    else:
        raise EinshardError(f"{what}: with target={tgt.spec!r}, mesh= must be axis sizes or a Mesh, got {mesh!r}")
    if math.prod(sizes.values()) != tgt.chips:
        raise EinshardError(
            f"{what}: target {tgt.spec!r} has {tgt.chips} chips; the mesh {sizes} has {math.prod(sizes.values())}",
            hint=f"Give a mesh whose sizes multiply to {tgt.chips}, e.g. {tgt.default_mesh()}.",
        )
    return sizes, tgt.profile if profile is None else profile
