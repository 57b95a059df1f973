"""``einshard demo``: train a small transformer language model under any parallelism written as einshard expressions.

The same model, the same seed and the same batches are trained under every
layout of :data:`einshard_apps.presets.PRESETS` (data parallel, FSDP, tensor
parallel, hybrid, 2-D FSDP x TP, asynchronous TP with collective-matmul rings,
a pipeline over the stacked layers) or your own ``--rules``.  Before training it
prints the mesh, every parameter's layout (expression, JAX type in your axis
names, bytes per device) and the plan of one step; after, a table comparing
the layouts with a single-device run of the same training.

With no accelerator it runs on ``--devices`` simulated CPU devices (default 8);
``--processes 2`` runs the same training as 2 local processes with
``jax.distributed``, the way it runs on a multi-host cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from einshard.core.collectives import KINDS
from einshard.errors import EinshardError

from .presets import PRESETS, Preset, load_rules, parse_mesh

__all__ = ["run", "RunResult", "Trainer", "load_corpus", "batch_at", "print_plan"]


# ---------------------------------------------------------------------------
# Data


def load_corpus(path: str | None = None) -> bytes:
    """The training text as bytes: ``path`` (UTF-8), or the corpus shipped in ``einshard_apps/data``."""
    if path is None:
        return importlib.resources.files("einshard_apps").joinpath("data", "corpus.txt").read_bytes()
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as err:
        raise EinshardError(f"--data: cannot read {path!r}: {err.strerror}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise EinshardError(f"--data: {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    return raw


def batch_at(corpus: bytes, step: int, batch: int, seq: int, seed: int) -> Any:
    """The global batch of step ``step``: ``batch`` random windows of ``seq + 1`` bytes, the same on every process.

    Example:
        >>> batch_at(b"hello world, hello einshard", 0, 2, 4, 0).shape
        (2, 5)
    """
    import numpy as np

    if len(corpus) < seq + 2:
        raise EinshardError(f"the text has {len(corpus)} bytes; --seq {seq} needs at least {seq + 2}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(corpus) - seq - 1, size=batch)
    data = np.frombuffer(corpus, dtype=np.uint8)
    return np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------
# Checking a layout before training

# Which command-line flag sets the size of each axis the presets name.
_AXIS_FLAGS = {"l": "--layers", "b": "--batch", "d": "--width", "h": "--heads", "f": "--ffn", "s": "--seq"}


def check_layout_fits(preset: Preset, mesh: dict[str, int], cfg: Any, batch: int, seed: int = 0) -> None:
    """Resolve every expression of ``preset`` against the model's and the batch's shapes on ``mesh`` (sizes only).

    Costs no device work (``jax.eval_shape``), so a layout that cannot fit is reported before any training,
    with the flag that changes the offending size.
    """
    import jax

    from einshard.placement import layout as _layout
    from einshard.tree_rules import leaf_expressions

    from .models.transformer import init

    abstract = jax.eval_shape(lambda: init(cfg, seed))
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    try:
        texts = leaf_expressions(abstract, preset.params)
    except EinshardError as err:
        raise EinshardError(f"layout {preset.name!r}: {err.reason}", err.expression, err.column, err.hint) from None
    checks = [(jax.tree_util.keystr(path), tuple(leaf.shape), text) for (path, leaf), text in zip(leaves, texts)]
    checks.append(("the batch", (batch, cfg.seq + 1), preset.batch))
    for where, shape, text in checks:
        if text is None:
            continue
        try:
            _layout(text, shape, mesh=mesh)
        except EinshardError as err:
            flags = [f"{flag} (axis '{axis}')" for axis, flag in _AXIS_FLAGS.items() if f"'{axis}'" in err.reason]
            hint = err.hint or ""
            if flags:  # a size that does not split: say which flag sets it
                hint = (hint + " " if hint else "") + "Change " + " or ".join(flags) + ", or choose another --mesh."
            mesh_text = ",".join(f"{k}={v}" for k, v in mesh.items())
            raise EinshardError(
                f"layout {preset.name!r} on mesh {mesh_text} does not fit {where} (shape {shape}): {err.reason}",
                err.expression,
                err.column,
                hint,
            ) from None


# ---------------------------------------------------------------------------
# One layout's training


@dataclass
class RunResult:
    """What one layout's training gave."""

    name: str
    mesh: dict[str, int]
    losses: list[float] = field(default_factory=list)
    first_step: int = 0
    compile_s: float = 0.0
    tokens_per_s: float = 0.0
    param_bytes: int = 0  # weights per device
    state_bytes: int = 0  # weights + optimizer state per device
    per_param_bytes: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False


def _tree_bytes_per_device(tree: Any) -> int:
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize
    return total


def make_jit_step(loss: Callable[..., Any], tx: Any, state_shardings: Any, batch_sharding: Any, mesh: Any) -> Any:
    """The default step builder: ``jax.jit`` with the layouts as in/out shardings; XLA inserts the collectives."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        value, grads = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    scalar = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step, in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, scalar), donate_argnums=0
    )


def _shardings(expressions: Any, abstract: Any, mesh: Any, what: str | None = None) -> Any:
    """``einshard.sharding`` for every leaf; an error names the leaf it is about."""
    import jax

    import einshard

    def one(path: Any, expr: str, leaf: Any) -> Any:
        try:
            return einshard.sharding(expr, leaf.shape, mesh=mesh)
        except EinshardError as err:
            where = what or jax.tree_util.keystr(path)
            raise EinshardError(
                f"at {where} (shape {tuple(leaf.shape)}): {err.reason}", err.expression, err.column, err.hint
            ) from None

    return jax.tree_util.tree_map_with_path(one, expressions, abstract)


class Trainer:
    """One layout of the demo model on one mesh: the placed state, the compiled step, the batches.

    Example (a tiny model, tensor parallel over 2 devices; ``t.step()`` would compile and train one step):
        >>> import jax
        >>> from einshard_apps.demo import Trainer, load_corpus
        >>> from einshard_apps.presets import PRESETS
        >>> from einshard_apps.models.transformer import Config
        >>> cfg = Config(layers=1, width=16, heads=2, ffn=32, seq=16)
        >>> t = Trainer(PRESETS['tp'], {'data': 1, 'model': 2}, cfg, load_corpus(), batch=4, devices=jax.devices()[:2])
        >>> t.state['params']['layers']['attn']['wq'].sharding.spec
        P(None, None, 'model', None)
        >>> t.state['opt'][0].mu['layers']['attn']['wq'].sharding.spec   # AdamW moments follow their weight
        P(None, None, 'model', None)
    """

    def __init__(
        self,
        preset: Preset,
        mesh_sizes: dict[str, int],
        cfg: Any,
        corpus: bytes,
        *,
        batch: int,
        lr: float = 3e-3,
        seed: int = 0,
        devices: Any = None,
        resume: str | None = None,
        step_options: dict[str, Any] | None = None,
    ) -> None:
        import jax
        import numpy as np
        import optax
        from jax.sharding import AxisType

        import einshard

        from .models import transformer
        from .presets import expressions_for

        self.preset, self.cfg, self.corpus, self.batch, self.seed = preset, cfg, corpus, batch, seed
        self.mesh_sizes = dict(mesh_sizes)
        devices = list(jax.devices() if devices is None else devices)
        n = math.prod(mesh_sizes.values())
        if n != len(devices):
            shown = ",".join(f"{k}={v}" for k, v in mesh_sizes.items())
            raise EinshardError(f"--mesh {shown} has {n} devices, but there are {len(devices)}")
        self.mesh = jax.sharding.Mesh(
            np.asarray(devices).reshape(tuple(mesh_sizes.values())),
            tuple(mesh_sizes),
            axis_types=(AxisType.Auto,) * len(mesh_sizes),
        )
        self.tx = optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=0.01)
        host_params = transformer.init(cfg, seed)
        self.param_expressions = expressions_for(host_params, preset.params)
        abstract_opt = jax.eval_shape(self.tx.init, host_params)
        self.expressions = {
            "params": self.param_expressions,
            "opt": optax.tree_utils.tree_map_params(
                self.tx,
                lambda _, e: e,
                abstract_opt,
                self.param_expressions,
                transform_non_params=lambda _: "... -> ...",
            ),
        }
        abstract = {"params": jax.eval_shape(lambda p: p, host_params), "opt": abstract_opt}
        self.state_shardings = _shardings(self.expressions, abstract, self.mesh)
        batch_shape = (batch, cfg.seq + 1)
        self.batch_sharding = _shardings(preset.batch, jax.ShapeDtypeStruct(batch_shape, np.int32), self.mesh, "batch")
        self.step_index = 0
        if resume:
            from einshard import checkpoint

            meta = checkpoint.read_meta(resume)
            if meta.get("config") != cfg.as_dict():
                raise EinshardError(
                    f"--resume {resume}: the checkpoint's model {meta.get('config')} is not this run's {cfg.as_dict()}"
                )
            self.state = checkpoint.restore(resume, abstract, mesh=self.mesh, expressions=self.expressions)
            self.step_index = int(meta.get("step", 0))
        else:
            # The parameters are placed by the preset's rules: einshard(tree, {pattern: expression}).
            params = einshard.einshard(host_params, dict(preset.params), mesh=self.mesh)
            opt = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt"])(params)
            self.state = {"params": params, "opt": opt}
        build = preset.step_builder or make_jit_step
        loss = transformer.loss_fn
        options = {k: v for k, v in (step_options or {}).items() if v is not None}
        refused = sorted(set(options) - set(preset.step_options))
        if refused:
            flags = ", ".join("--" + k.replace("_", "-") for k in refused)
            takes = [p.name for p in PRESETS.values() if set(refused) <= set(p.step_options)]
            where = f" (it belongs to --layout {', '.join(takes)})" if takes else ""
            raise EinshardError(f"--layout {preset.name} does not take {flags}{where}")
        self.step_fn = build(loss, self.tx, self.state_shardings, self.batch_sharding, self.mesh, **options)
        self._compiled: Any = None
        self.compile_s = 0.0

    # -- batches -------------------------------------------------------------
    def place_batch(self, step: int) -> Any:
        """The batch of ``step`` on the mesh; under jax.distributed each process feeds only its own rows."""

        import einshard

        global_batch = batch_at(self.corpus, step, self.batch, self.cfg.seq, self.seed)
        if self.batch_sharding.is_fully_addressable:
            return einshard.einshard(global_batch, self.preset.batch, mesh=self.mesh)
        index_map = self.batch_sharding.addressable_devices_indices_map(global_batch.shape)
        rows = sorted({idx[0].indices(self.batch)[:2] for idx in index_map.values() if idx is not None})
        lo, hi = rows[0][0], max(r[1] for r in rows)
        local = global_batch[lo:hi]  # what this host's data loader would read
        return einshard.einshard(local, self.preset.batch, mesh=self.mesh, process_local=True)

    # -- compile and run -------------------------------------------------------
    def compile(self) -> Any:
        if self._compiled is None:
            start = time.perf_counter()
            import jax

            fn = self.step_fn if hasattr(self.step_fn, "lower") else jax.jit(self.step_fn)
            self._compiled = fn.lower(self.state, self.place_batch(self.step_index)).compile()
            self.compile_s = time.perf_counter() - start
        return self._compiled

    def step(self) -> float:
        compiled = self.compile()
        batch = self.place_batch(self.step_index)
        self.state, loss = compiled(self.state, batch)
        self.step_index += 1
        return float(loss)

    def bytes_per_device(self) -> tuple[int, int]:
        return _tree_bytes_per_device(self.state["params"]), _tree_bytes_per_device(self.state)

    def save(self, path: str, meta: dict[str, Any] | None = None) -> None:
        from einshard import checkpoint

        info = {
            "step": self.step_index,
            "config": self.cfg.as_dict(),
            "layout": self.preset.name,
            "mesh": self.mesh_sizes,
            "seed": self.seed,
            **(meta or {}),
        }
        checkpoint.save(path, self.state, self.expressions, info, overwrite=True)


# ---------------------------------------------------------------------------
# Printing


def _kib(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.1f} KiB"


def layout_rows(trainer: Trainer) -> list[tuple[str, str, str, str, int]]:
    """(path, shape, expression, typed layout, bytes per device) for every parameter."""
    import jax

    import einshard

    from .models.transformer import AXES

    rows = []
    flat_exprs = jax.tree_util.tree_leaves(trainer.param_expressions)
    flat = jax.tree_util.tree_flatten_with_path(trainer.state["params"])[0]
    for (path, arr), expr in zip(flat, flat_exprs):
        typed = einshard.layout(expr, arr.shape, mesh=trainer.mesh)
        names = AXES.get(jax.tree_util.keystr(path), "").split()
        if len(names) == len(typed.axes) and any(a.startswith("...") for a in typed.axes):
            typed = dataclasses.replace(typed, axes=tuple(names))  # '...' axes shown by the model's names
        nbytes = typed.bytes_per_device(arr.dtype.itemsize)
        shape = "x".join(map(str, arr.shape))
        rows.append((jax.tree_util.keystr(path), shape, expr, str(typed), nbytes))
    return rows


_COLLECTIVES = KINDS  # the one collective vocabulary (einshard.core.collectives)


def compiled_summary(compiled: Any) -> list[str]:
    """What XLA compiled for one step: collective ops in the program and memory per device (measured, not predicted)."""
    import re

    lines = []
    try:
        text = compiled.as_text()
    except Exception:  # some backends cannot print their executable
        text = ""
    counts = {}
    for op in _COLLECTIVES:
        n = len(re.findall(rf"\s{op}(?:-start)?\(", text))
        if n:
            counts[op] = n
    shown = ", ".join(f"{n} {op}" for op, n in counts.items()) or "none"
    lines.append(
        f"collectives in the compiled step: {shown} (ops in the program; the layer scan runs its body per layer)"
    )
    try:
        mem = compiled.memory_analysis()
    except Exception:
        mem = None
    if mem is not None:
        lines.append(
            "memory per device (XLA): arguments "
            f"{_kib(mem.argument_size_in_bytes)}, outputs {_kib(mem.output_size_in_bytes)}, "
            f"temporaries {_kib(mem.temp_size_in_bytes)}"
        )
    return lines


def print_plan(trainer: Trainer, say: Callable[[str], None]) -> None:
    """The plan of one layout, printed before training.

    Today: the mesh, every parameter's layout with its bytes per device, and
    what XLA compiled for the step.  When the analyzer is part of einshard
    (``einshard.explain``), its per-step plan (collectives per layer, bytes,
    FLOPs, estimated time) is printed here too.
    """
    import einshard

    mesh = ", ".join(f"{k}={v}" for k, v in trainer.mesh_sizes.items())
    say(f"mesh: {mesh}   batch: {trainer.preset.batch!r}  ({trainer.batch} x {trainer.cfg.seq + 1} tokens)")
    rows = layout_rows(trainer)
    w_path = max(len(r[0]) for r in rows)
    w_shape = max(len(r[1]) for r in rows)
    w_expr = max(len(repr(r[2])) for r in rows)
    w_typed = max(len(r[3]) for r in rows)
    say(f"  {'parameter':<{w_path}}  {'shape':<{w_shape}}  {'expression':<{w_expr}}  {'layout':<{w_typed}}  per device")
    for path, shape, expr, typed, nbytes in rows:
        say(f"  {path:<{w_path}}  {shape:<{w_shape}}  {expr!r:<{w_expr}}  {typed:<{w_typed}}  {_kib(nbytes):>10}")
    weights, state = trainer.bytes_per_device()
    full = sum(_full_bytes(r[1]) for r in rows)
    say(
        f"  weights per device: {_kib(weights)} of {_kib(full)} ({weights / full:.0%}); with AdamW state: {_kib(state)}"
    )
    plan = getattr(trainer.step_fn, "plan", None)
    if plan is not None:  # an explicit program describes itself (rings, pipeline schedule)
        for line in plan(trainer.state, trainer.place_batch(trainer.step_index)):
            say("  " + line)
    explain = getattr(einshard, "explain", None)
    if explain is not None:
        say(str(explain(trainer.step_fn, trainer.state, trainer.place_batch(trainer.step_index))))
    for line in compiled_summary(trainer.compile()):
        say("  " + line)


def _full_bytes(shape_text: str) -> int:
    return math.prod(int(s) for s in shape_text.split("x")) * 4


# ---------------------------------------------------------------------------
# Progress


class _Progress:
    """A rich progress bar on a terminal, plain lines otherwise (and from processes other than 0: nothing)."""

    def __init__(self, name: str, total: int, say: Callable[[str], None], plain: bool, quiet: bool) -> None:
        self.name, self.total, self.say, self.quiet = name, total, say, quiet
        self.bar: Any = None
        self.every = max(1, total // 5)
        self.last = time.perf_counter()
        if not quiet and not plain and sys.stdout.isatty():
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:
                pass
            else:
                self.bar = Progress(
                    TextColumn(f"  {name}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tokens/s"),
                    TimeElapsedColumn(),
                    transient=False,
                )
                self.bar.start()
                self.task = self.bar.add_task(name, total=total, loss=float("nan"), tps=0.0)

    def update(self, done: int, loss: float, tps: float) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=done, loss=loss, tps=tps)
        elif done % self.every == 0 or done == self.total or time.perf_counter() - self.last > 5:
            # A fifth of the run at a time, and at least every few seconds on long runs.
            self.last = time.perf_counter()
            self.say(f"  {self.name} step {done}/{self.total}  loss {loss:.4f}  {tps:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _StopFlag:
    """Ctrl-C asks to stop after the current step (a second Ctrl-C interrupts at once)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _StopFlag:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C stays a KeyboardInterrupt
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def agreed(self) -> bool:
        """Whether any process asked to stop (all processes must stop after the same step)."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.array([self.requested], np.int32))
        return bool(np.asarray(flags).any())


def train_layout(
    trainer: Trainer,
    steps: int,
    *,
    say: Callable[[str], None],
    plain: bool,
    stop: _StopFlag | None = None,
    name: str | None = None,
) -> RunResult:
    """Run ``steps`` steps of ``trainer``, showing progress; stop early when Ctrl-C was pressed."""
    import jax

    res = RunResult(name or trainer.preset.name, trainer.mesh_sizes, first_step=trainer.step_index)
    trainer.compile()
    res.compile_s = trainer.compile_s
    res.param_bytes, res.state_bytes = trainer.bytes_per_device()
    res.per_param_bytes = {r[0]: r[4] for r in layout_rows(trainer)}
    bar = _Progress(res.name, steps, say, plain, quiet=jax.process_index() != 0)
    tokens = trainer.batch * trainer.cfg.seq
    elapsed = 0.0
    try:
        for i in range(steps):
            if stop is not None and stop.agreed():
                res.interrupted = True
                break
            start = time.perf_counter()
            loss = trainer.step()
            dt = time.perf_counter() - start
            elapsed += dt
            res.losses.append(loss)
            bar.update(i + 1, loss, tokens / dt if dt > 0 else 0.0)
    finally:
        bar.close()
    if res.losses and elapsed > 0:
        res.tokens_per_s = tokens * len(res.losses) / elapsed
    return res


# ---------------------------------------------------------------------------
# The command


def _configure_jax(args: argparse.Namespace) -> None:
    import jax

    if args.process_id is not None:
        jax.config.update("jax_num_cpu_devices", max(1, args.devices // args.processes))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
        return
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return  # the caller chose the simulated device count
    try:
        # Only the CPU backend reads it: with an accelerator the real devices are used.
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:
        pass  # the backend is already up (einshard_apps.cli.main called in-process): keep its devices


def _chosen_presets(args: argparse.Namespace) -> tuple[list[Preset], dict[str, int] | None]:
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.rules:
        if args.layout not in (None,):
            raise EinshardError("--rules replaces --layout: give one of them")
        preset, file_mesh = load_rules(args.rules)
        return [preset], mesh or file_mesh
    name = args.layout or "all"
    if name == "all":
        return list(PRESETS.values()), mesh
    if name not in PRESETS:
        raise EinshardError(f"--layout {name!r} is not a preset; the presets are: {', '.join(PRESETS)}, all")
    return [PRESETS[name]], mesh


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``args.processes`` local workers of this same command under jax.distributed; forward Ctrl-C."""
    if args.devices % args.processes:
        raise EinshardError(f"--devices {args.devices} does not split over --processes {args.processes}")
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    # Each worker sets its own device count; a count in XLA_FLAGS would override it.
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    )
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(args.processes)]
    procs = []
    for pid in range(args.processes):
        cmd = [sys.executable, "-m", "einshard", "demo", *argv, "--process-id", str(pid), "--coordinator", coordinator]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE if pid == 0 else subprocess.DEVNULL,  # only process 0 prints
                text=True,
                stderr=logs[pid],
                start_new_session=True,  # Ctrl-C reaches this launcher alone; it tells the workers
            )
        )
    # Process 0's output, minus gloo's connection chatter (printed by its C++ side).
    relay = threading.Thread(target=_relay, args=(procs[0].stdout,), daemon=True)
    relay.start()
    interrupted = False
    try:
        while any(p.poll() is None for p in procs):
            try:
                time.sleep(0.1)
            except KeyboardInterrupt:
                interrupted = True
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGINT)
            if any(p.returncode not in (None, 0, 130) for p in procs):
                # One worker failed: the others would wait for it forever in a collective.
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    relay.join(timeout=5)
    codes = [p.returncode for p in procs]
    if interrupted or codes[0] == 130:
        return 130
    if any(codes):
        for pid, (log, code) in enumerate(zip(logs, codes)):
            if code:
                log.seek(0)
                tail = [ln for ln in log.read().splitlines() if "[Gloo]" not in ln][-15:]
                print(f"einshard demo: process {pid} exited with {code}:", *tail, sep="\n  ", file=sys.stderr)
        return next(c for c in codes if c) if codes[0] == 0 else codes[0]
    return 0


def _relay(stream: Any) -> None:
    for line in stream:
        if not line.startswith("[Gloo]"):
            sys.stdout.write(line)
            sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    if args.processes > 1 and args.process_id is None:
        return _launch(args, _rebuild_argv(args))
    presets, mesh_arg = _chosen_presets(args)
    try:
        import optax  # noqa: F401
    except ImportError:
        raise EinshardError("einshard demo trains with optax: pip install 'einshard[examples]'") from None
    if (args.checkpoint or args.resume) and len(presets) > 1:
        raise EinshardError("--checkpoint and --resume save one layout's state: pick one with --layout")
    options = {
        k: v for k, v in (("ring", args.ring), ("microbatches", args.microbatches), ("schedule", args.schedule)) if v
    }
    for key in options:
        if not any(key in p.step_options for p in presets):
            owners = ", ".join(p.name for p in PRESETS.values() if key in p.step_options) or "none"
            raise EinshardError(f"--{key} applies to --layout {owners} only")
    if mesh_arg and len(presets) > 1:
        # '--layout all --mesh data=2,model=4': the presets written for other mesh axes are left out.
        skipped = [p.name for p in presets if set(p.default_mesh(math.prod(mesh_arg.values()))) != set(mesh_arg)]
        presets = [p for p in presets if p.name not in skipped]
        if skipped:
            print(f"--mesh {args.mesh}: leaving out {', '.join(skipped)} (other mesh axes)", file=sys.stderr)
        if not presets:
            raise EinshardError(f"--mesh {args.mesh}: no preset uses these mesh axes")
    _configure_jax(args)

    import jax

    import einshard

    from .models.transformer import Config, count_params, init

    is_main = jax.process_index() == 0

    def say(text: str = "") -> None:
        if is_main:
            print(text, flush=True)

    if mesh_arg and math.prod(mesh_arg.values()) != jax.device_count():
        shown = ",".join(f"{k}={v}" for k, v in mesh_arg.items())
        raise EinshardError(
            f"--mesh {shown} has {math.prod(mesh_arg.values())} devices, but there are {jax.device_count()}"
        )
    cfg = Config(layers=args.layers, width=args.width, heads=args.heads, ffn=args.ffn, seq=args.seq)
    corpus = load_corpus(args.data)
    n = jax.device_count()
    for preset in presets:  # every layout checked against the model's shapes before any training starts
        check_layout_fits(preset, mesh_arg or preset.default_mesh(n), cfg, args.batch, args.seed)
    platform = jax.devices()[0].platform
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"einshard {einshard.__version__} on jax {jax.__version__}: {n} {platform} devices{procs}")
    params_count = count_params(init(cfg, args.seed))
    say(
        f"model: byte-level transformer, {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, "
        f"MLP {cfg.ffn}, {params_count:,} parameters; text: {args.data or 'einshard_apps/data/corpus.txt'} "
        f"({len(corpus):,} bytes); {args.steps} AdamW steps of {args.batch} x {cfg.seq} tokens"
    )
    results: list[RunResult] = []
    reference: RunResult | None = None
    code = 0
    saved = False
    with _StopFlag() as stop:
        if args.check:
            names = tuple((mesh_arg or presets[0].default_mesh(n)).keys())
            say(f"\n== single device: the same training on {jax.devices()[0]}, the reference for every layout")
            ref = Trainer(
                SINGLE_DEVICE,
                dict.fromkeys(names, 1),
                cfg,
                corpus,
                batch=args.batch,
                lr=args.lr,
                seed=args.seed,
                devices=jax.local_devices()[:1],
                resume=args.resume,
            )
            reference = train_layout(ref, args.steps, say=say, plain=args.plain, stop=stop, name="1 device")
        for preset in presets:
            if stop.requested:
                break
            sizes = mesh_arg or preset.default_mesh(n)
            say(f"\n== {preset.name}: {preset.what}")
            trainer = Trainer(
                preset,
                sizes,
                cfg,
                corpus,
                batch=args.batch,
                lr=args.lr,
                seed=args.seed,
                resume=args.resume,
                step_options=options if len(presets) == 1 else _accepted(options, preset),
            )
            print_plan(trainer, say)
            res = train_layout(trainer, args.steps, say=say, plain=args.plain, stop=stop)
            results.append(res)
            if reference is not None:
                ok, diff = _matches(res, reference)
                say(f"  loss matches the single-device run: {'yes' if ok else 'NO'} (max |diff| {diff:.1e})")
                if not ok:
                    code = 1
            if args.checkpoint:
                trainer.save(args.checkpoint)
                saved = True
                say(f"  saved step {trainer.step_index} to {args.checkpoint}")
        interrupted = stop.requested
    say("")
    for line in final_table(results, reference):
        say(line)
    if len(results) > 1:
        say(
            "\nEvery layout trains the same model to the same loss: only where the arrays live changes, and with it "
            "the memory per device and the collectives XLA inserts. Pick one with --layout NAME, write your own "
            "with --rules FILE, draw one with `einshard show`."
        )
    if args.plot and is_main:
        say(write_plot(args.plot, results, reference))
    if interrupted:
        say(
            "interrupted: stopped after the last finished step"
            + (f" (state saved to {args.checkpoint})" if saved else "")
        )
        return 130
    return code


# The reference every layout is compared with: the same training, every array whole on one device.
SINGLE_DEVICE = Preset("1 device", "the same training on one device", {".*": "... -> ..."}, "b s -> b s")


def _accepted(options: dict[str, Any], preset: Preset) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in preset.step_options}


def _rebuild_argv(args: argparse.Namespace) -> list[str]:
    """The command line of this run, minus --processes handling, for the workers."""
    out: list[str] = []
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key == "check":
            out.append("--check" if value else "--no-check")
        elif key in ("command", "process_id", "coordinator") or value is None or value is False:
            continue
        elif value is True:
            out.append(flag)
        else:
            out.extend([flag, str(value)])
    return out


def _matches(res: RunResult, ref: RunResult) -> tuple[bool, float]:
    n = min(len(res.losses), len(ref.losses))
    if n == 0:
        return True, 0.0
    diff = max(abs(a - b) for a, b in zip(res.losses[:n], ref.losses[:n]))
    # Sharded sums add in another order: agreement to float32 rounding, grown a little by the optimizer.
    return diff <= 1e-4 * max(1.0, max(abs(x) for x in ref.losses[:n])), diff


def final_table(results: list[RunResult], reference: RunResult | None) -> list[str]:
    """One row per layout: mesh, memory per device, compile time, speed, loss, agreement with one device."""
    rows = [("layout", "mesh", "weights/dev", "+AdamW/dev", "compile", "tokens/s", "steps", "loss", "vs 1 device")]
    for r in ([reference] if reference else []) + results:
        last = f"{r.losses[-1]:.4f}" if r.losses else "-"
        if reference is None or r is reference:
            versus = "-"
        else:
            ok, diff = _matches(r, reference)
            versus = f"{'same' if ok else 'DIFFERS'} ({diff:.0e})"
        rows.append(
            (
                r.name,
                ",".join(f"{k}={v}" for k, v in r.mesh.items()),
                _kib(r.param_bytes),
                _kib(r.state_bytes),
                f"{r.compile_s:.1f}s",
                f"{r.tokens_per_s:,.0f}",
                f"{r.first_step + len(r.losses)}" + (" (stopped)" if r.interrupted else ""),
                last,
                versus,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def write_plot(path: str, results: list[RunResult], reference: RunResult | None) -> str:
    """Loss curves and per-parameter bytes per device, one line/bar group per layout (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install 'einshard[plot]'); {path} not written"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ([reference] if reference else []) + results:
        steps = range(r.first_step + 1, r.first_step + len(r.losses) + 1)
        left.plot(list(steps), r.losses, label=r.name, linestyle="--" if r is reference else "-")
    left.set_xlabel("step")
    left.set_ylabel("loss (nats/byte)")
    left.set_title("training loss")
    left.legend()
    names = list(results[0].per_param_bytes) if results else []
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        right.bar(
            [j + i * width for j in range(len(names))],
            [r.per_param_bytes[n] / 1024 for n in names],
            width,
            label=r.name,
        )
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    right.set_xticklabels([n.replace("['", "").replace("']", ".").rstrip(".") for n in names], rotation=70, fontsize=7)
    right.set_ylabel("KiB per device")
    right.set_title("parameter bytes per device")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"


if __name__ == "__main__":  # pragma: no cover
    from .cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
