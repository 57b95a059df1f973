"""Training steps written as explicit programs: asynchronous tensor parallelism and a layer pipeline.

The demo's ``tp-async`` and ``pipeline`` presets (:mod:`einshard_apps.presets`) train
with these step builders instead of ``jax.jit`` + shardings:

* :func:`make_tp_async_step`: Megatron tensor parallelism, sequence-parallel
  style, as one ``jax.shard_map`` over ``data x model`` (``check_vma=True``):
  between blocks the activations ``x[r, d]`` (r = the data shard's b·s rows)
  are split over ``model`` by rows, ``'r d -> r@model d'``.  Each projection
  whose weight is split over ``model`` runs as a collective-matmul ring
  (:func:`einshard.lowering.allgather_einsum` /
  :func:`einshard.lowering.einsum_reduce_scatter`): the rows are gathered
  block by block while the matmul runs, and the row-parallel outputs are
  reduce-scattered by an accumulator travelling the ring.  Gradients come from
  ``jax.value_and_grad`` inside the shard_map (the rings transpose to reverse
  rings; the sums over ``data`` of replicated weights come from AD); AdamW
  updates each device's blocks.
* :func:`make_pipeline_step`: the stacked layer axis split over ``stage``;
  embed, :func:`einshard.pipeline` over the blocks (GPipe or circular), head,
  under ``jax.jit``.

A built step carries ``plan(state, batch) -> list[str]``, printed by the demo
before training.

Example (the plan of the asynchronous TP step; ``RING_EXPRESSIONS`` are the
einsums it runs as rings, in einshard notation):
    >>> from einshard_apps.explicit_steps import RING_EXPRESSIONS
    >>> RING_EXPRESSIONS['w_in']
    'r@model d, d f@model -> r f@model'
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: the command line imports jax lazily)
    from einshard.core.mesh import AnyMesh

from einshard.errors import EinshardError

__all__ = ["ExplicitStep", "RING_EXPRESSIONS", "make_tp_async_step", "make_pipeline_step"]

# The einsums the asynchronous TP step runs as rings, in einshard notation (r: the b·s rows of the data shard).
RING_EXPRESSIONS: dict[str, str] = {
    "embed": "r v@model, v@model d -> r@model d",  # one-hot lookup of the vocab-split table: reduce-scatter
    "qkv": "r@model d, d h@model k -> r h@model k",  # column-parallel: all-gather the rows
    "wo": "r h@model k, h@model k d -> r@model d",  # row-parallel: reduce-scatter the rows
    "w_in": "r@model d, d f@model -> r f@model",
    "w_out": "r f@model, f@model d -> r@model d",
    "unembed": "r@model d, d v@model -> r v@model",  # then a vocab-parallel softmax (pmax/psum over model)
}
_RING_KIND = {
    "embed": "einsum_reduce_scatter",
    "qkv": "allgather_einsum",
    "wo": "einsum_reduce_scatter",
    "w_in": "allgather_einsum",
    "w_out": "einsum_reduce_scatter",
    "unembed": "allgather_einsum",
}


@dataclass
class ExplicitStep:
    """A jitted training step plus the lines that describe its program (``plan``)."""

    jitted: Any
    describe: Callable[[Any, Any], list[str]] = field(default=lambda state, batch: [])

    def lower(self, *args: Any) -> Any:
        return self.jitted.lower(*args)

    def __call__(self, *args: Any) -> Any:
        return self.jitted(*args)

    def plan(self, state: Any, batch: Any) -> list[str]:
        return self.describe(state, batch)


def _specs(shardings: Any) -> Any:
    import jax

    return jax.tree.map(lambda s: s.spec, shardings)


def _mesh_sizes(mesh: AnyMesh) -> dict[str, int]:
    return {str(k): int(v) for k, v in mesh.shape.items()}


def _need_axes(mesh: AnyMesh, axes: Sequence[str], layout: str, example: str) -> None:
    sizes = _mesh_sizes(mesh)
    missing = [a for a in axes if a not in sizes]
    if missing:
        shown = ",".join(f"{k}={v}" for k, v in sizes.items())
        raise EinshardError(
            f"--layout {layout} needs the mesh axes {', '.join(axes)}; the mesh {shown} has no {', '.join(missing)}",
            hint=f"e.g. --mesh {example}",
        )


# ---------------------------------------------------------------------------
# Asynchronous tensor parallelism


def _tp_async_loss(params: Any, batch: Any, schedule: str) -> Any:
    """The mean loss of the local batch block, on this device's weight blocks (inside the shard_map)."""
    import jax
    import jax.numpy as jnp

    from einshard.lowering import allgather_einsum, einsum_reduce_scatter

    from .models.transformer import causal_attention, layer_norm

    n = jax.lax.axis_size("model")
    i = jax.lax.axis_index("model")
    inputs, targets = batch[:, :-1], batch[:, 1:]
    b, s = inputs.shape
    rows = b * s
    if rows % n:
        raise EinshardError(
            f"tp-async splits the {b} x {s} = {rows} token rows of each data shard over model={n}: "
            f"{rows} is not a multiple of {n}",
            hint="Choose --batch/--seq so that (batch / data) * seq is a multiple of the model axis.",
        )
    r = rows // n

    def gather_rows(sub: str, x: Any, w: Any) -> Any:  # column-parallel: [r@model ...] -> [r ...]
        return allgather_einsum(sub, x, w, axis_name="model", gathered=0, dim=0, schedule=schedule)

    def scatter_rows(sub: str, x: Any, w: Any) -> Any:  # row-parallel: partial [r ...] -> [r@model ...]
        return einsum_reduce_scatter(sub, x, w, axis_name="model", dim=0, schedule=schedule)

    # Embedding: a one-hot matmul against this device's vocabulary rows, reduce-scattered by rows.
    table = params["embed"]["tokens"]  # [v/n, d]
    vl = table.shape[0]
    ids = inputs.reshape(rows)
    onehot = (ids[:, None] == i * vl + jnp.arange(vl)[None, :]).astype(table.dtype)
    x = scatter_rows("rv,vd->rd", onehot, table)  # [r, d]: rows i*r .. (i+1)*r
    x = x + params["embed"]["positions"][(i * r + jnp.arange(r)) % s]

    def block(x: Any, p: Any) -> tuple[Any, None]:
        y = layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"])
        w = jnp.stack([p["attn"]["wq"], p["attn"]["wk"], p["attn"]["wv"]], axis=1)  # [d, 3, h/n, k]: one ring
        qkv = gather_rows("rd,dchk->rchk", y, w)  # [rows, 3, h/n, k]
        q, k, v = (qkv[:, c].reshape(b, s, *qkv.shape[2:]) for c in range(3))
        heads = causal_attention(q, k, v).reshape(rows, *qkv.shape[2:])
        x = x + scatter_rows("rhk,hkd->rd", heads, p["attn"]["wo"])
        y = layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"])
        hidden = jax.nn.gelu(gather_rows("rd,df->rf", y, p["mlp"]["w_in"]))
        return x + scatter_rows("rf,fd->rd", hidden, p["mlp"]["w_out"]), None

    x, _ = jax.lax.scan(block, x, params["layers"])
    y = layer_norm(x, params["final_ln"]["scale"], params["final_ln"]["bias"])
    logits = gather_rows("rd,dv->rv", y, params["unembed"]).astype(jnp.float32)  # [rows, v/n]
    # Vocabulary-parallel cross-entropy: the softmax's max and sum, and the target's logit, over 'model'.
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), "model")  # a constant shift
    lse = jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1), "model")) + top
    local = targets.reshape(rows) - i * vl
    hit = (local >= 0) & (local < vl)
    mine = jnp.take_along_axis(logits, jnp.clip(local, 0, vl - 1)[:, None], axis=-1)[:, 0]
    picked = jax.lax.psum(jnp.where(hit, mine, 0.0), "model")
    loss = jnp.mean(lse - picked)
    return jax.lax.pmean(loss, "data")


def make_tp_async_step(
    loss_fn: Any,
    tx: Any,
    state_shardings: Any,
    batch_sharding: Any,
    mesh: AnyMesh,
    *,
    ring: str = "one-way",
) -> ExplicitStep:
    """The ``tp-async`` training step: one ``jax.shard_map`` over ``data x model`` with collective-matmul rings.

    ``loss_fn`` is not called: the step computes the same loss from this
    device's blocks (see the module docstring).  ``ring`` is the collective
    matmul schedule (``'one-way'``, ``'two-way'``; ``'sync'`` for the plain
    collectives).
    """
    del loss_fn
    import jax
    import optax
    from jax.sharding import PartitionSpec

    _need_axes(mesh, ("data", "model"), "tp-async", "data=2,model=4")
    state_specs = _specs(state_shardings)
    batch_spec = batch_sharding.spec
    if any(a == "model" or (isinstance(a, tuple) and "model" in a) for a in batch_spec):
        raise EinshardError("tp-async keeps the token batch whole over 'model' (its rows are split inside the step)")

    def body(state: Any, batch: Any) -> tuple[Any, Any]:
        value, grads = jax.value_and_grad(_tp_async_loss)(state["params"], batch, ring)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(state_specs, batch_spec),
        out_specs=(state_specs, PartitionSpec()),
        check_vma=True,
    )
    jitted = jax.jit(mapped, donate_argnums=0)
    sizes = _mesh_sizes(mesh)
    n = sizes["model"]

    def describe(state: Any, batch: Any) -> list[str]:
        shown = " x ".join(f"{k}={v}" for k, v in sizes.items())
        permutes = {"one-way": n - 1, "two-way": 2 * (n - 1), "sync": 0}[ring] if n > 1 else 0
        how = f"{permutes} collective-permutes" if ring != "sync" else "plain collective"
        lines = [
            f"program: one jax.shard_map over {shown} (check_vma), gradients by jax.value_and_grad inside it;",
            "  between blocks the activations are 'r d -> r@model d' (r = the b*s rows of a data shard: "
            "sequence parallel)",
            f"  rings ({ring}, {how} each way; the backward pass runs the reverse rings):",
        ]
        w = max(len(e) for e in RING_EXPRESSIONS.values())
        for name, expr in RING_EXPRESSIONS.items():
            per = " per layer" if name in ("qkv", "wo", "w_in", "w_out") else ""
            lines.append(f"    {name:<8} {expr!r:<{w + 2}}  {_RING_KIND[name]}{per}")
        lines.append("  vocabulary-parallel softmax: pmax and psum over model; the loss pmean over data")
        return lines

    return ExplicitStep(jitted, describe)


# ---------------------------------------------------------------------------
# Pipeline over the stacked layers


# How the pipeline's ends hold their parameters (einshard.tree_rules path rules): the vocabulary over 'stage'.
END_LAYOUTS: dict[str, dict[str, str | None]] = {
    "embed": {"tokens": "v d -> v@stage d", "positions": None},
    "head": {"unembed": "d v -> d v@stage", "final_ln": None},
}


def default_microbatches(local_batch: int, stages: int) -> int:
    """The largest divisor of the per-device batch that is at most ``2 * stages`` (a smaller bubble, small blocks).

    Example:
        >>> default_microbatches(4, 2), default_microbatches(6, 2), default_microbatches(2, 4)
        (4, 3, 2)
    """
    return max(m for m in range(1, min(local_batch, 2 * stages) + 1) if local_batch % m == 0)


def make_pipeline_step(
    loss_fn: Any,
    tx: Any,
    state_shardings: Any,
    batch_sharding: Any,
    mesh: AnyMesh,
    *,
    param_layouts: Any = None,
    microbatches: int | None = None,
    schedule: str = "gpipe",
) -> ExplicitStep:
    """The ``pipeline`` training step: embed, :func:`einshard.pipeline` over ``params['layers']``, head, under jit.

    ``param_layouts`` are the preset's expressions for the stacked layers (the
    layer axis over ``stage``); ``microbatches`` per data shard (default
    :func:`default_microbatches`); ``schedule`` ``'gpipe'``, ``'circular'``
    (each micro-batch goes round the stages ``layers / stages`` times, one
    layer per visit) or ``'1f1b'`` (gradients from a 1F1B-ordered backward).
    """
    del loss_fn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from einshard.lowering import (
        PipelineEnd,
        pipeline,
        pipeline_info,
        vocab_parallel_cross_entropy,
        vocab_parallel_embed,
    )

    from .models.transformer import block, layer_norm

    _need_axes(mesh, ("stage", "data"), "pipeline", "stage=2,data=4")
    if schedule not in ("gpipe", "circular", "1f1b"):
        raise EinshardError(f"--schedule is gpipe, circular or 1f1b, got {schedule!r}")
    sizes = _mesh_sizes(mesh)
    stages, data = sizes["stage"], sizes["data"]

    def options(batch: Any, layers: int) -> dict[str, Any]:
        local = batch.shape[0] // data if batch.shape[0] % data == 0 else batch.shape[0]
        m = microbatches or default_microbatches(local, stages)
        if schedule == "circular":
            return {"microbatches": m, "schedule": "circular", "repeats": max(1, layers // stages)}
        return {"microbatches": m, "schedule": schedule, "repeats": 1}

    def layer(p: Any, h: Any) -> Any:
        return block(h, p)

    # The stages own the embedding and the head: the first stage's input function and the last stage's loss
    # run with the vocabulary split over 'stage' (each stage holds 1/S of the table and of the unembedding,
    # stored that way by the preset), not a copy of both on every stage.
    def embed_first(p: Any, tokens: Any) -> Any:
        return vocab_parallel_embed(p["tokens"], tokens, "stage") + p["positions"][: tokens.shape[1]]

    def loss_last(p: Any, h: Any, targets: Any) -> Any:
        x = layer_norm(h, p["final_ln"]["scale"], p["final_ln"]["bias"])
        logits = jnp.einsum("bsd,dv->bsv", x, p["unembed"]).astype(jnp.float32)
        return vocab_parallel_cross_entropy(logits, targets, "stage")  # per-token losses [b, s]

    def loss(params: Any, batch: Any) -> Any:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        layers = jax.tree.leaves(params["layers"])[0].shape[0]
        per_token = pipeline(
            layer,
            params["layers"],
            inputs,
            mesh=mesh,
            stage_axis="stage",
            data_axis="data",
            param_layouts=param_layouts,
            first=PipelineEnd(embed_first, params["embed"], layouts=END_LAYOUTS["embed"]),
            last=PipelineEnd(
                loss_last,
                {"final_ln": params["final_ln"], "unembed": params["unembed"]},
                layouts=END_LAYOUTS["head"],
                args=(targets,),
            ),
            **options(batch, layers),
        )
        return jnp.mean(per_token)  # the model's cross_entropy: the mean over tokens

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        value, grads = jax.value_and_grad(loss)(state["params"], batch)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, value

    scalar = NamedSharding(mesh, PartitionSpec())
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, scalar),
        donate_argnums=0,
    )

    def describe(state: Any, batch: Any) -> list[str]:
        layers_tree = state["params"]["layers"]
        layers = jax.tree.leaves(layers_tree)[0].shape[0]
        b, s1 = batch.shape
        width = state["params"]["unembed"].shape[0]
        h = jax.ShapeDtypeStruct((b, s1 - 1, width), state["params"]["unembed"].dtype)
        opts = options(batch, layers)
        info = pipeline_info(layers_tree, h, mesh=mesh, stage_axis="stage", data_axis="data", **opts)
        rounds = f", {info.repeats} rounds" if info.repeats > 1 else ""
        return [
            f"program: einshard.pipeline({opts['schedule']}) over the {layers} stacked layers, under jax.jit; "
            f"the layer axis over stage={stages}, the batch over data={data}; the first stage embeds and the "
            f"last computes the loss, with the vocabulary split over stage (1/{stages} of both tables per device)",
            f"  {info.stages} stages x {info.layers_per_visit} layer(s) per visit, {info.microbatches} micro-batches "
            f"of {'x'.join(map(str, info.microbatch_shape))} per data shard{rounds}: {info.iterations} iterations, "
            f"one collective-permute each",
            f"  bubble: {info.bubble_fraction:.0%} of stage-iterations idle "
            f"((S-1)/(M*R+S-1) = {info.stages - 1}/{info.iterations})",
            f"  activations kept per device for the backward pass: {info.activation_bytes / 1024:.1f} KiB "
            "(stage inputs per iteration and the result buffer; attention/MLP residuals on top)",
        ]

    return ExplicitStep(jitted, describe)
