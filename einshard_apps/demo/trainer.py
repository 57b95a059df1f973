"""One layout of the demo model on one mesh: the placed state, the compiled step, the batches (:class:`Trainer`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: the command line imports jax lazily)
    from einshard._src.core.mesh import AnyMesh, MeshLike

from einshard.errors import EinshardError

from ..presets import PRESETS, Preset
from .data import batch_at

__all__ = ["RunResult", "Trainer", "make_jit_step"]


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


def make_jit_step(loss: Callable[..., Any], tx: Any, state_shardings: Any, batch_sharding: Any, mesh: AnyMesh) -> Any:
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


def _shardings(expressions: Any, abstract: Any, mesh: MeshLike, what: str | None = None) -> Any:
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

    The mesh's axes are Auto (XLA lays the step out by propagation); ``explicit_axes=True`` makes them Explicit
    (``jax.make_mesh``'s default, where JAX types the step: the model says the layouts JAX cannot infer).

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
        explicit_axes: bool = False,
    ) -> None:
        import jax
        import numpy as np
        import optax
        from jax.sharding import AxisType

        import einshard

        from ..models import transformer
        from ..presets import expressions_for

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
            # Auto axes: XLA lays out the step by propagation; Explicit (jax.make_mesh's default): JAX types it, and
            # the model says the layouts JAX cannot infer (einshard_apps.models.transformer).
            axis_types=(AxisType.Explicit if explicit_axes else AxisType.Auto,) * len(mesh_sizes),
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
            # A rule of None (leave the leaf as it is) places a host array whole on every device.
            rules = {k: "... -> ..." if v is None else v for k, v in preset.params.items()}
            params = einshard.einshard(host_params, rules, mesh=self.mesh)
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
    def compile(self, say: Callable[[str], None] | None = None) -> Any:
        """The compiled step (compiled on first use); ``say`` announces the compile, which takes seconds per
        layout, so a demo's output does not stop without a word."""
        if self._compiled is None:
            if say is not None:
                mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_sizes.items())
                say(f"compiling {self.preset.name} ({mesh})...")
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
