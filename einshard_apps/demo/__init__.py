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

The modules, in the order a run uses them:

* :mod:`~einshard_apps.demo.preflight` — flags and layouts checked before any training;
* :mod:`~einshard_apps.demo.launcher` — JAX set-up, and ``--processes`` workers;
* :mod:`~einshard_apps.demo.data` — the text and its batches;
* :mod:`~einshard_apps.demo.trainer` — :class:`Trainer`: one layout's placed state and compiled step;
* :mod:`~einshard_apps.demo.loop` — :func:`train_layout`: the steps, progress, Ctrl-C;
* :mod:`~einshard_apps.demo.report` — the layout table, what XLA compiled, the final table, the plot;
* :mod:`~einshard_apps.demo.command` — ``run(args)``, which strings them together.
"""

from .command import SINGLE_DEVICE, run
from .data import batch_at, load_corpus
from .loop import train_layout
from .preflight import check_layout_fits
from .report import compiled_summary, final_table, layout_rows, print_plan, write_plot
from .trainer import RunResult, Trainer, make_jit_step

__all__ = [
    "run",
    "SINGLE_DEVICE",
    "RunResult",
    "Trainer",
    "make_jit_step",
    "train_layout",
    "load_corpus",
    "batch_at",
    "check_layout_fits",
    "print_plan",
    "layout_rows",
    "compiled_summary",
    "final_table",
    "write_plot",
]
