"""What ``einshard.explain`` returns: per-op records and the whole program's totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.layout import Layout, MeshAxis

__all__ = ["OpReport", "ProgramReport"]

# Results


@dataclass(frozen=True)
class OpReport:
    """One operation of the program that computes or communicates."""

    index: int
    primitive: str
    phase: str  # 'forward' or 'backward'
    expression: str  # the annotated einsum for dots, else a short description
    out_layout: Layout | None
    collectives: tuple[Any, ...]  # einshard.Collective
    flops: float
    time_s: float
    repeat: int = 1  # how many times it runs (scan length)
    note: str = ""

    @property
    def comm_bytes(self) -> float:
        return self.repeat * sum(c.bytes for c in self.collectives)


@dataclass(frozen=True)
class ProgramReport:
    """What a whole step costs under the arguments' layouts.

    Attributes:
        ops: the operations that compute (dots) or communicate, in program order.
        flops: FLOPs per device, all ops.
        comm_bytes: bytes each device sends, all collectives.
        comm_count: number of collectives (scan bodies counted per iteration).
        peak_bytes: peak live bytes per device (arguments included), from a liveness walk.
        time_s: estimated step time on the profile (compute + communication, no overlap).
        phases: per phase ('forward', 'backward') totals of flops, bytes, count and time.
        unfollowed: primitives whose layout rule einshard does not know (outputs assumed replicated).
        analysis_s: how long the analysis took.
    """

    ops: tuple[OpReport, ...]
    flops: float
    comm_bytes: float
    comm_count: int
    peak_bytes: int
    time_s: float
    phases: dict[str, dict[str, float]]
    unfollowed: tuple[str, ...]
    mesh: tuple[MeshAxis, ...]
    profile: Any
    analysis_s: float = 0.0
    # Where JAX's explicit sharding refused the program as written (einshard.check_explicit's report): the ops it
    # rejects, with lines and fixes; the costs above are the program's with the check's assumed fixes applied.
    explicit: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": {m.name: m.size for m in self.mesh},
            "flops": self.flops,
            "comm_bytes": self.comm_bytes,
            "comm_count": self.comm_count,
            "peak_bytes": self.peak_bytes,
            "time_s": self.time_s,
            "phases": self.phases,
            "unfollowed": list(self.unfollowed),
            "analysis_s": self.analysis_s,
            "explicit": self.explicit.to_dict() if self.explicit is not None else None,
            "ops": [
                {
                    "index": op.index,
                    "primitive": op.primitive,
                    "phase": op.phase,
                    "expression": op.expression,
                    "out": str(op.out_layout) if op.out_layout is not None else None,
                    "collectives": [
                        {"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes * op.repeat} for c in op.collectives
                    ],
                    "flops": op.flops * op.repeat,
                    "time_s": op.time_s * op.repeat,
                    "repeat": op.repeat,
                    "note": op.note,
                }
                for op in self.ops
            ],
        }

    def __str__(self) -> str:
        mesh = ", ".join(f"{m.name}={m.size}" for m in self.mesh)
        lines = [f"mesh: {mesh}   profile: {getattr(self.profile, 'name', self.profile)}"]
        if self.explicit is not None and self.explicit.findings:
            n = len(self.explicit.findings)
            lines.append(
                f"JAX rejects {n} op{'s' if n != 1 else ''} of this program on its Explicit axes (below); "
                "costed as it runs with the fixes the check assumes"
            )
        header = f"{'#':>4}  {'phase':<8} {'op':<40} {'collectives':<44} {'GFLOP/dev':>10} {'comm/dev':>10}"
        lines.append(header)
        lines.append("-" * len(header))
        for op in self.ops:
            colls = ", ".join(f"{c.kind}@{'·'.join(c.axes)}" for c in op.collectives) or "-"
            rep = f" ×{op.repeat}" if op.repeat > 1 else ""
            lines.append(
                f"{op.index:>4}  {op.phase:<8} {(op.expression + rep)[:40]:<40} {colls[:44]:<44} "
                f"{op.flops * op.repeat / 1e9:>10.3f} {_bytes(op.comm_bytes):>10}"
            )
        lines.append("-" * len(header))
        for phase, tot in self.phases.items():
            lines.append(
                f"{phase:<9} {tot['flops'] / 1e9:.3f} GFLOP/device, {int(tot['count'])} collectives, "
                f"{_bytes(tot['bytes'])} sent/device, ~{tot['time_s'] * 1e3:.3f} ms"
            )
        lines.append(
            f"total     {self.flops / 1e9:.3f} GFLOP/device, {self.comm_count} collectives, "
            f"{_bytes(self.comm_bytes)} sent/device, peak {_bytes(self.peak_bytes)}/device, "
            f"~{self.time_s * 1e3:.3f} ms/step (no overlap)"
        )
        if self.unfollowed:
            lines.append("not followed (outputs assumed replicated): " + ", ".join(self.unfollowed))
        lines.append(f"analysed in {self.analysis_s * 1e3:.1f} ms")
        if self.explicit is not None and self.explicit.findings:
            lines.append(str(self.explicit))
        return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
