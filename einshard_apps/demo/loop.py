"""The training loop of one layout: progress display, Ctrl-C handling agreed across processes, the run's record."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from .report import layout_rows
from .trainer import RunResult, Trainer

__all__ = ["StopFlag", "train_layout"]


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


class StopFlag:
    """Ctrl-C asks to stop after the current step (a second Ctrl-C interrupts at once)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> StopFlag:
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
    stop: StopFlag | None = None,
    name: str | None = None,
) -> RunResult:
    """Run ``steps`` steps of ``trainer``, showing progress; stop early when Ctrl-C was pressed."""
    import jax

    res = RunResult(name or trainer.preset.name, trainer.mesh_sizes, first_step=trainer.step_index)
    trainer.compile(say if jax.process_index() == 0 else None)
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
