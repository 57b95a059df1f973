"""Write the primitives that jax.numpy, jax.nn, lax, optax, Flax, Equinox and Keras 3 emit in training steps.

Run from the repository root (8 CPU devices are not needed: nothing is compiled)::

    python tools/list_primitives.py            # rewrites einshard/_src/analysis/program/primitives.json

Two sources, both traced with ``jax.make_jaxpr`` (forward and ``jax.grad`` of a sum, sub-jaxprs walked):

* a sweep over every public function of ``jax.numpy``, ``jax.nn``, ``jax.lax``, ``optax``'s losses and
  ``keras.ops`` (``KERAS_BACKEND=jax``) that accepts one float array (or two, or an array and an ``axis`` or a
  count of 2: ``jnp.tile(x, 2)``, ``jnp.repeat(x, 2)``): what they emit without hand-picked arguments;
* the building blocks of training steps that take structured arguments (convolutions, pooling, attention,
  top-k routing, rotary embeddings, scans, remat, loops, branches, Flax (nnx and linen), Equinox and Keras
  layers, optax updates).

The result is data (a sorted list with the sources that emit each primitive), read by
``einshard._src.analysis.program.coverage`` and docs/coverage.md's test.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

OUT = Path(__file__).resolve().parent.parent / "einshard" / "_src" / "analysis" / "program" / "primitives.json"

# Names that are not numerical building blocks (I/O, dtype queries, debugging, random keys' plumbing).
SKIP = {
    "save", "savez", "load", "fromfile", "fromstring", "frombuffer", "fromiter", "fromfunction", "printoptions",
    "set_printoptions", "get_printoptions", "show_config", "info", "vectorize", "frompyfunc", "piecewise",
    "debug_callback", "print", "pure_callback", "io_callback", "linalg", "fft", "einsum_path", "from_dlpack",
    "nonzero", "flatnonzero", "argwhere", "unique", "unique_all", "unique_counts", "unique_inverse", "unique_values",
    "setdiff1d", "union1d", "intersect1d", "setxor1d", "extract", "compress", "trim_zeros", "histogram",
    "histogram2d", "histogramdd", "bincount", "digitize", "pad", "array_split", "nanpercentile", "nanquantile",
}  # fmt: skip


def primitives_of(jaxpr: Any, into: set[str]) -> set[str]:
    """Every primitive name in a jaxpr and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        into.add(eqn.primitive.name)
        for sub in jax.core.jaxprs_in_params(eqn.params) if hasattr(jax.core, "jaxprs_in_params") else _subs(eqn):
            primitives_of(sub, into)
    return into


def _subs(eqn: Any) -> Iterable[Any]:
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(getattr(x, "jaxpr", None), "eqns"):
                yield x.jaxpr


def trace(fn: Callable[..., Any], *args: Any) -> set[str]:
    """Primitives of ``fn(*args)`` and of the gradient of its float outputs' sum with respect to float args."""
    found: set[str] = set()
    primitives_of(jax.make_jaxpr(fn)(*args).jaxpr, found)
    floats = [i for i, a in enumerate(args) if all(_is_float(x) for x in jax.tree.leaves(a))]
    if floats:

        def total(*xs: Any) -> Any:
            leaves = [x for x in jax.tree.leaves(fn(*xs)) if jnp.issubdtype(x.dtype, jnp.floating)]
            return sum(jnp.sum(x.astype(jnp.float32)) for x in leaves)

        try:
            primitives_of(jax.make_jaxpr(jax.grad(total, argnums=tuple(floats)))(*args).jaxpr, found)
        except Exception:  # not differentiable (integer-valued results, sorting keys): the forward stands
            pass
    return found


def _is_float(x: Any) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.floating))


def sweep(module: Any, prefix: str) -> dict[str, set[str]]:
    """Call every public function of ``module`` on generic float arguments; keep what traces."""
    x = jnp.linspace(0.1, 0.9, 32, dtype=jnp.float32).reshape(4, 8)
    y = x[::-1] + 0.5
    # (x, 2) after (x, 1): a count of 1 is an identity for tile/repeat-like functions, which then emit nothing.
    attempts: list[tuple[Any, ...]] = [(x,), (x, y), (x, 1), (x, x[0]), (x, 2)]
    out: dict[str, set[str]] = {}
    for name in sorted(dir(module)):
        if name.startswith("_") or name in SKIP:
            continue
        fn = getattr(module, name)
        if not callable(fn) or inspect.isclass(fn):
            continue
        for args in attempts:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    prims = trace(fn, *args)
            except Exception:
                continue
            if not prims and args is not attempts[-1]:
                continue  # emitted nothing (an identity at these arguments): try the next
            out[f"{prefix}.{name}"] = prims
            break
    return out


def blocks() -> dict[str, Callable[[], set[str]]]:
    """Training-step building blocks whose arguments a sweep cannot guess."""
    f32 = jnp.float32
    img = jnp.ones((2, 8, 8, 4), f32)
    ker = jnp.ones((3, 3, 4, 6), f32)
    seq = jnp.ones((2, 8, 4, 16), f32)
    logits = jnp.ones((4, 10), f32)
    labels = jnp.arange(4) % 10

    def conv(x: Any, k: Any) -> Any:
        return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def rope(x: Any) -> Any:
        a, b = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([a * 0.5 - b * 0.3, b * 0.5 + a * 0.3], axis=-1)

    def router(x: Any) -> Any:
        vals, idx = lax.top_k(jax.nn.softmax(x), 2)
        return vals * jax.nn.one_hot(idx, 10).sum(1)[:, :2]

    def layers(x: Any, w: Any) -> Any:
        body = jax.checkpoint(lambda h, wi: (jnp.tanh(h @ wi), None))
        return lax.scan(body, x, w)[0]

    def loop(x: Any) -> Any:
        return lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h), x)

    def branch(x: Any) -> Any:
        return lax.cond(x.sum() > 0, jnp.tanh, jnp.sin, x)

    def windows(x: Any) -> Any:
        pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        summed = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return pooled + summed

    def typed_keys(x: Any) -> Any:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(jax.random.split(jax.random.key(0), x.shape[0]))
        keep = jax.vmap(lambda k, row: jax.random.bernoulli(jax.random.clone(k), 0.9, row.shape))(keys, x)
        again = jax.random.wrap_key_data(jax.random.key_data(keys))
        return jnp.where(keep, x, 0.0).sum() + jax.random.key_data(again).sum()

    def dyn(x: Any, i: Any) -> Any:
        return lax.dynamic_update_slice(x, lax.dynamic_slice(x, (i, 0), (2, 8)) * 2, (0, i))

    out: dict[str, Callable[[], set[str]]] = {
        "lax.conv_general_dilated": lambda: trace(conv, img, ker),
        "lax.reduce_window (max and sum pools)": lambda: trace(windows, img),
        "rotary embedding (split + concatenate)": lambda: trace(rope, seq),
        "top-k router": lambda: trace(router, logits),
        "lax.scan + jax.checkpoint": lambda: trace(layers, jnp.ones((4, 16), f32), jnp.ones((3, 16, 16), f32)),
        "lax.fori_loop": lambda: trace(loop, jnp.ones((4, 16), f32)),
        "lax.cond": lambda: trace(branch, jnp.ones((4, 16), f32)),
        "dynamic_slice / dynamic_update_slice": lambda: trace(dyn, jnp.ones((8, 8), f32), 1),
        "jax.nn.dot_product_attention": lambda: trace(jax.nn.dot_product_attention, seq, seq, seq),
        "jnp.pad": lambda: trace(lambda a: jnp.pad(a, ((1, 1), (2, 0))), logits),
        "jnp.take_along_axis": lambda: trace(lambda a: jnp.take_along_axis(a, labels[:, None], 1), logits),
        # Typed keys (jax.random.key, nnx.Rngs): a dropout key batch split, folded, drawn from, cloned, unwrapped.
        "jax.random with typed keys (split, fold_in, bernoulli, clone, key_data, wrap_key_data)": lambda: trace(
            typed_keys, jnp.ones((4, 16), f32)
        ),
    }
    try:
        import optax

        def opt_step(p: Any) -> Any:
            tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
            updates, _ = tx.update(p, tx.init(p), p)
            return optax.apply_updates(p, updates)

        out["optax.adamw + clip_by_global_norm"] = lambda: trace(opt_step, {"w": jnp.ones((4, 8), f32)})
        out["optax.softmax_cross_entropy_with_integer_labels"] = lambda: trace(
            lambda a: optax.softmax_cross_entropy_with_integer_labels(a, labels), logits
        )
        out["optax.sigmoid_binary_cross_entropy"] = lambda: trace(
            lambda a: optax.sigmoid_binary_cross_entropy(a, jnp.zeros_like(a)), logits
        )
    except ImportError:
        pass
    try:
        from flax import nnx

        def flax_model() -> set[str]:
            rngs = nnx.Rngs(0)
            conv_l = nnx.Conv(4, 6, (3, 3), rngs=rngs)
            norm = nnx.LayerNorm(6, rngs=rngs)
            bn = nnx.BatchNorm(6, use_running_average=True, rngs=rngs)  # training stats mutate state
            attn = nnx.MultiHeadAttention(4, 16, decode=False, rngs=rngs)
            emb = nnx.Embed(10, 16, rngs=rngs)

            def f(x: Any, t: Any) -> Any:
                h = bn(norm(conv_l(x)))
                h = nnx.max_pool(h, (2, 2), (2, 2)) + nnx.avg_pool(h, (2, 2), (2, 2))
                a = attn(emb(t) + t[..., None].astype(f32))
                # Dropout's key is made inside the trace (a module's Rngs count cannot be bumped under make_jaxpr).
                drop = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=1))
                return h.sum() + drop(a).sum()

            return trace(f, img, jnp.ones((2, 8), jnp.int32))

        out["flax.nnx layers (Conv, LayerNorm, BatchNorm, pools, MultiHeadAttention, Embed, Dropout)"] = flax_model
    except ImportError:
        pass
    try:
        import equinox as eqx

        def eqx_model() -> set[str]:
            key = jax.random.PRNGKey(0)
            conv_l = eqx.nn.Conv2d(4, 6, 3, padding=1, key=key)
            pool = eqx.nn.MaxPool2d(2, 2)
            mha = eqx.nn.MultiheadAttention(4, 16, key=key)
            norm = eqx.nn.LayerNorm(16)
            rms = eqx.nn.RMSNorm(16)
            gru = eqx.nn.GRUCell(16, 16, key=key)
            lstm = eqx.nn.LSTMCell(16, 16, key=key)
            rope = eqx.nn.RotaryPositionalEmbedding(4)
            emb = eqx.nn.Embedding(10, 16, key=key)
            avg = eqx.nn.AdaptiveAvgPool2d((2, 2))
            group = eqx.nn.GroupNorm(2, 6)
            mlp = eqx.nn.MLP(16, 16, 32, 2, key=key)

            def f(x: Any, s: Any) -> Any:
                h = pool(conv_l(x))
                h = group(h).sum() + avg(h).sum()

                def heads(q: Any, k: Any, v: Any) -> Any:  # rotary on each head, as eqx's docs show
                    turn = jax.vmap(rope, in_axes=1, out_axes=1)
                    return turn(q), turn(k), v

                a = jax.vmap(norm)(mha(s, s, s, process_heads=heads)) + jax.vmap(rms)(s)
                e = jax.vmap(emb)(jnp.arange(8) % 10) + jax.vmap(mlp)(s)
                c, m = lstm(s[0], (s[1], s[2]))
                return h + a.sum() + e.sum() + gru(s[0], s[1]).sum() + c.sum() + m.sum()

            return trace(f, jnp.ones((4, 8, 8), f32), jnp.ones((8, 16), f32))

        out[
            "equinox.nn layers (Conv2d, MaxPool2d, AdaptiveAvgPool2d, GroupNorm, MultiheadAttention with "
            "RotaryPositionalEmbedding, LayerNorm, RMSNorm, Embedding, MLP, GRUCell, LSTMCell)"
        ] = eqx_model
    except ImportError:
        pass
    try:
        import flax.linen as nn

        class _LinenBlock(nn.Module):
            @nn.compact
            def __call__(self, x: Any, _: Any) -> Any:
                y = nn.LayerNorm()(x)
                x = x + nn.SelfAttention(num_heads=2, qkv_features=16)(y)
                y = nn.RMSNorm()(x)
                return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(y))), None

        class _LinenNet(nn.Module):
            @nn.compact
            def __call__(self, x: Any, img: Any) -> Any:
                scan = nn.scan(
                    nn.remat(_LinenBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=2
                )
                h = scan()(x, None)[0]
                c = nn.Conv(6, (3, 3), strides=2)(img)
                c = nn.GroupNorm(num_groups=2)(nn.avg_pool(c, (2, 2), (2, 2)))
                return h.sum() + c.sum()

        def linen_model() -> set[str]:
            net = _LinenNet()
            x = jnp.ones((2, 8, 16), f32)
            variables = net.init(jax.random.PRNGKey(0), x, img)
            return trace(lambda v, a, b: net.apply(v, a, b), variables, x, img)

        out[
            "flax.linen layers (nn.scan of nn.remat blocks, SelfAttention, Dense, LayerNorm, RMSNorm, Conv, GroupNorm, avg_pool)"
        ] = linen_model
    except ImportError:
        pass
    out |= _keras_blocks()
    return out


def _keras_blocks() -> dict[str, Callable[[], set[str]]]:
    """Keras 3 layers on the JAX backend, called through ``stateless_call`` (as a JAX training step runs them)."""
    if os.environ.get("KERAS_BACKEND", "jax") != "jax":
        return {}
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras
    except ImportError:
        return {}
    f32 = jnp.float32

    def keras_model() -> set[str]:
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(10, 16)(tokens)
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 8)(h, h))
        h = keras.layers.Dense(32, activation="gelu")(h)
        h = keras.layers.Dropout(0.1)(keras.layers.Dense(16)(h))
        g = keras.layers.GRU(8)(h)
        img = keras.Input((8, 8, 3))
        c = keras.layers.Conv2D(6, 3, padding="same")(img)
        c = keras.layers.BatchNormalization()(c)
        c = keras.layers.MaxPooling2D()(keras.layers.ReLU()(c))
        c = keras.layers.GlobalAveragePooling2D()(keras.layers.DepthwiseConv2D(3, padding="same")(c))
        model = keras.Model([tokens, img], keras.layers.Concatenate()([g, c]))

        def f(trainable: Any, non_trainable: Any, t: Any, i: Any) -> Any:
            out, _ = model.stateless_call(trainable, non_trainable, [t, i], training=True)
            return out

        trainable = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]
        t = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 10
        return trace(f, trainable, frozen, t, jnp.ones((2, 8, 8, 3), f32))

    return {
        "keras layers (Embedding, MultiHeadAttention, LayerNormalization, Dense, Dropout, GRU, Conv2D, "
        "BatchNormalization, MaxPooling2D, DepthwiseConv2D, GlobalAveragePooling2D)": keras_model
    }


def collect() -> dict[str, list[str]]:
    """primitive -> the sources (public functions or blocks) that emit it, sorted."""
    by_source: dict[str, set[str]] = {}
    by_source |= sweep(jnp, "jnp")
    by_source |= sweep(jax.nn, "jax.nn")
    by_source |= sweep(lax, "lax")
    try:
        import optax

        by_source |= sweep(optax.losses, "optax.losses")
    except ImportError:
        pass
    if os.environ.setdefault("KERAS_BACKEND", "jax") == "jax":
        try:
            import keras

            by_source |= sweep(keras.ops, "keras.ops")
        except ImportError:
            pass
    for name, make in blocks().items():
        by_source[name] = make()
    by_prim: dict[str, set[str]] = {}
    for source, prims in by_source.items():
        for p in prims:
            by_prim.setdefault(p, set()).add(source)
    return {p: sorted(s) for p, s in sorted(by_prim.items())}


def main() -> None:
    found = collect()
    data = {
        "generated_by": "tools/list_primitives.py",
        "jax": jax.__version__,
        "primitives": {p: {"sources": len(s), "example": s[0]} for p, s in found.items()},
    }
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{len(found)} primitives -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
