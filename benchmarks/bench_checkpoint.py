"""Checkpoint cost: einshard.checkpoint (orbax, each process writes its own shards) vs the gathered .npz of einshard <= 0.3.

Run from the repository root::

    python benchmarks/bench_checkpoint.py                  # 256 MiB over 8 simulated CPU devices, 3 repeats
    python benchmarks/bench_checkpoint.py --mib 1024       # the issue's 1 GiB (needs ~5 GiB free, minutes)
    python benchmarks/bench_checkpoint.py --update-docs    # also refresh docs/benchmarks.md's table

Every measurement runs in a fresh process (so its peak host memory is its own):
the child builds the pytree directly on the devices (no host copy), does the
operation once (the first in a process: imports, thread pools, compiled
transfers; timed apart), resets the kernel's RSS high-water mark
(``/proc/self/clear_refs``), does it again and reports the time (for an
orbax save also when ``save(blocking=False)`` returned) and how far the high-water mark rose
above the RSS before the operation (``VmHWM - VmRSS``; where
``clear_refs`` is unavailable, ``resource.getrusage`` high-water minus the
RSS before).  On simulated CPU devices the arrays themselves live in host
memory, so a restore's figure includes the restored tree; a save's figure is
pure overhead.  orbax and npz alternate (A B B A ...) in the same run; the
table reports medians.

Writes ``benchmarks/results/checkpoint.json`` (raw numbers, machine, versions)
and ``benchmarks/results/checkpoint.md`` (the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The pytree: a transformer-like set of leaves, sharded several ways over a (data=4, model=2) mesh.
LAYOUTS = {
    "embed": ("v d", "v d -> v@data d"),
    "w_in": ("d f", "d f -> d f@model"),
    "w_out": ("f d", "f d -> f@model d"),
    "attn": ("d h", "d h -> d@data h@model"),
    "norm": ("d", "d -> d"),
}


# ---------------------------------------------------------------------------
# The child: one measurement


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _shapes(mib: int) -> dict[str, tuple[int, ...]]:
    """Leaf shapes totalling ``mib`` MiB of float32 (d = 1024; the 2-D leaves share the rest)."""
    d = 1024
    rows = (mib * (1 << 20) // 4 - d) // d // 4  # four 2-D leaves of rows x d (or d x rows)
    rows -= rows % 8
    return {"embed": (rows, d), "w_in": (d, rows), "w_out": (rows, d), "attn": (d, rows), "norm": (d,)}


def _old_npz_save(path: str, tree: dict[str, Any], expressions: dict[str, str]) -> None:
    """einshard <= 0.3's checkpoint.save: gather every leaf to a whole host array, one .npz, written by process 0."""
    import numpy as np

    arrays, leaves = {}, []
    for i, (key, leaf) in enumerate(sorted(tree.items())):
        full = np.asarray(leaf)
        arrays[f"leaf_{i}"] = full
        leaves.append(
            {
                "key": f"leaf_{i}",
                "path": f"['{key}']",
                "expression": expressions[key],
                "shape": list(full.shape),
                "dtype": str(full.dtype),
            }
        )
    header = {"format": "einshard-checkpoint/1", "leaves": leaves}
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, __einshard__=np.array(json.dumps(header)), **arrays)
    os.replace(tmp, path)


def child(args: argparse.Namespace) -> int:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np

    import einshard
    from einshard import checkpoint

    mesh = jax.make_mesh((4, args.devices // 4), ("data", "model"))
    shapes = _shapes(args.mib)
    exprs = {k: e for k, (_, e) in LAYOUTS.items()}
    shardings = {k: einshard.sharding(exprs[k], s, mesh=mesh) for k, s in shapes.items()}
    like = {k: jax.ShapeDtypeStruct(s, np.float32, sharding=shardings[k]) for k, s in shapes.items()}
    path = os.path.join(args.dir, "ckpt.npz" if args.format == "npz" else "ckpt")

    def make_tree() -> dict[str, Any]:
        # Made on the devices (no host copy): the host holds only what the save itself allocates.
        tree = jax.jit(
            lambda: {k: jax.random.normal(jax.random.key(i), s, np.float32) for i, (k, s) in enumerate(shapes.items())},
            out_shardings=shardings,
        )()
        return jax.block_until_ready(tree)

    tree: dict[str, Any] = {}
    if args.op == "save":
        tree = make_tree()
        if os.path.exists(path):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    tree_bytes = sum(4 * int(np.prod(s)) for s in shapes.values())

    def once(target: str) -> tuple[float, float]:
        """(seconds until the call returns, seconds until the operation is complete)."""
        start = time.perf_counter()
        returned = None
        if args.op == "save" and args.format == "orbax":
            handle = checkpoint.save(target, tree, exprs, blocking=False)
            returned = time.perf_counter() - start
            handle.wait_until_finished()
        elif args.op == "save":
            _old_npz_save(target, tree, exprs)
        else:
            jax.block_until_ready(checkpoint.restore(target, like, mesh=mesh))
        total = time.perf_counter() - start
        return (total if returned is None else returned), total

    # The first full-size operation in a process (imports orbax, starts tensorstore, compiles the transfers) is
    # reported apart; the table's main figures are a second one, as a training loop repeats it.
    first = once(path + "-first" if args.op == "save" else path)[1]
    if args.op == "save":
        target = path + "-first"
        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
        # New arrays: jax caches an array's host copy (np.asarray), which would make a second gather free.
        tree.clear()
        tree.update(make_tree())
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS, so RSS is what is really held
    before = _status("VmRSS")
    exact = _reset_peak()
    if not exact:
        import resource

        before_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    returned, seconds = once(path)
    if exact:
        rise = _status("VmHWM") - before
    else:
        import resource

        rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(before, before_peak)
    out = {"seconds": seconds, "returned": returned, "first": first, "peak_rise": rise, "tree_bytes": tree_bytes}
    print(json.dumps({**out, "exact_peak": exact}))
    return 0


# ---------------------------------------------------------------------------
# The parent: alternate formats, medians, tables


def _measure(fmt: str, op: str, workdir: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--format", fmt, "--op", op, "--dir", workdir]
    cmd += ["--mib", str(args.mib), "--devices", str(args.devices)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{fmt} {op} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / (1 << 20):,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="size of the pytree in MiB (float32)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (a multiple of 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--update-docs", action="store_true", help="replace the table on docs/benchmarks.md")
    p.add_argument("--table-only", action="store_true", help="rewrite the table from checkpoint.json, no measuring")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--format", choices=("orbax", "npz"), help=argparse.SUPPRESS)
    p.add_argument("--op", choices=("save", "restore"), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.table_only:
        return _finish(json.loads((args.out / "checkpoint.json").read_text()), args)
    load_start = list(os.getloadavg())
    workdir = tempfile.mkdtemp(prefix="einshard-bench-ckpt-")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {f: {"save": [], "restore": []} for f in ("orbax", "npz")}
    began = time.perf_counter()
    try:
        for r in range(args.repeats):
            order = ("orbax", "npz") if r % 2 == 0 else ("npz", "orbax")
            for fmt in order:
                for op in ("save", "restore"):
                    runs[fmt][op].append(_measure(fmt, op, workdir, args))
                    print(fmt, op, runs[fmt][op][-1], flush=True)
        disk = {
            "orbax": sum(f.stat().st_size for f in Path(workdir, "ckpt").rglob("*") if f.is_file()),
            "npz": Path(workdir, "ckpt.npz").stat().st_size,
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import jax
    import orbax.checkpoint as ocp

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"jax": jax.__version__, "orbax-checkpoint": ocp.__version__, "python": platform.python_version()},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "load_average": {"start": load_start, "end": list(os.getloadavg())},
        "devices": args.devices,
        "tree_bytes": runs["orbax"]["save"][0]["tree_bytes"],
        "repeats": args.repeats,
        "disk_bytes": disk,
        "runs": runs,
        "wall_seconds": time.perf_counter() - began,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    return _finish(result, args)


def _table(result: dict[str, Any]) -> str:
    runs, tree_bytes, disk = result["runs"], result["tree_bytes"], result["disk_bytes"]
    med = {
        f: {op: {k: statistics.median(m[k] for m in ms) for k in ("seconds", "peak_rise")} for op, ms in d.items()}
        for f, d in runs.items()
    }
    o, n = med["orbax"], med["npz"]
    rows = [
        "| operation | orbax (`einshard.checkpoint`) | gathered `.npz` (einshard <= 0.3) | orbax / npz |",
        "|---|---|---|---|",
    ]
    first = {f: {op: statistics.median(m["first"] for m in ms) for op, ms in d.items()} for f, d in runs.items()}
    returned = statistics.median(m["returned"] for m in runs["orbax"]["save"])
    for op in ("save", "restore"):
        ratio = o[op]["seconds"] / n[op]["seconds"]
        rows.append(
            f"| {op}: time | {o[op]['seconds']:.2f} s | {n[op]['seconds']:.2f} s | "
            f"**{ratio:.2f}×** ({'slower' if ratio > 1 else 'faster'}) |"
        )
        if op == "save":
            rows.append(
                f"| save: time until `save(..., blocking=False)` returns (the rest is written in the background) | "
                f"{returned:.2f} s | (blocks) | {returned / n[op]['seconds']:.2f}× |"
            )
        rows.append(
            f"| {op}: peak host memory above the resident state | {_mib(o[op]['peak_rise'])} | "
            f"{_mib(n[op]['peak_rise'])} | {o[op]['peak_rise'] / max(n[op]['peak_rise'], 1):.2f}× |"
        )
        rows.append(
            f"| {op}: the first one in a fresh process (imports, thread pools, compiling transfers) | "
            f"{first['orbax'][op]:.2f} s | {first['npz'][op]:.2f} s | {first['orbax'][op] / first['npz'][op]:.2f}× |"
        )
    rows.append(f"| on disk | {_mib(disk['orbax'])} | {_mib(disk['npz'])} | |")
    exact = all(m["exact_peak"] for d in runs.values() for ms in d.values() for m in ms)
    load = result.get("load_average")
    load_text = (
        f"load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end"
        if load
        else f"load average {result.get('load_average_observed', 'not recorded')}"
    )
    v = result["versions"]
    return "\n".join(
        [
            f"A {_mib(tree_bytes)} float32 pytree (5 leaves, split over data=4 × model={result['devices'] // 4}: rows, "
            f"columns, both, replicated), saved and restored with the saved layouts; medians of {result['repeats']}, "
            "each in a fresh process that first does the same operation once (timed apart) and then the measured one.",
            "",
            *rows,
            "",
            "Peak host memory: how far the process's RSS high-water mark rose above its RSS before the operation "
            f"({'VmHWM reset through /proc/self/clear_refs' if exact else 'getrusage'}). On simulated CPU devices the "
            "arrays live in host memory too, so a restore's figure includes the restored tree itself "
            f"({_mib(tree_bytes)}); a save's is overhead: the npz path gathers every leaf into a whole host copy, "
            "orbax copies every shard this process holds off its device, then compresses (zstd) and writes it. One "
            "process holds all 8 devices here, so its shards are the whole tree; under jax.distributed each process "
            "copies and writes only its own shards, while the npz path gathers the whole tree in every process.",
            "",
            f"jax {v['jax']}, orbax-checkpoint {v['orbax-checkpoint']}, Python {v['python']}, {result['machine']}, "
            f"{result['devices']} simulated CPU devices; {load_text}; {result['date']}.",
        ]
    )


def _finish(result: dict[str, Any], args: argparse.Namespace) -> int:
    table = _table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint.md").write_text(table + "\n")
    print(table)
    if args.update_docs:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from update_docs import PAGE, update

        PAGE.write_text(update(PAGE.read_text(), "checkpoint", table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
