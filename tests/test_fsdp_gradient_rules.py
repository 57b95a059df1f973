"""FSDP gradients read on inside the step: explain's collectives (kinds, counts per step, bytes, group sizes)
against XLA's compiled HLO, on minimal programs, Auto and Explicit meshes, placed inputs.

A scan over an FSDP layer stack (weights ``l a@data b``) leaves each iteration's weight gradient a partial sum
over ``data``.  Where the step returns the gradient split, XLA reduce-scatters each piece inside the loop
(tests/test_explain_scan_fsdp.py).  Where an optimizer reads the gradient (``p - lr * g``, Adam's moments) the
update's split reaches back into the loop the same way: 2 x L reduce-scatters, where explain all-reduced them
(the cause of the external corpus' explicit-nnx_scan-fsdp-step miss: nnx.scan under optax.adamw).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard.testing import hlo

L, D, F, B, S = 3, 32, 64, 8, 16
STACK = P(None, "data", None)  # an FSDP layer stack: each layer's first weight axis split over 'data'


def _loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    def body(h: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        return h + jnp.tanh(h @ w["a"]) @ w["b"], None

    return jnp.mean(jax.lax.scan(body, x, p)[0] ** 2)


def _sgd(carry: Any, x: jax.Array) -> Any:
    p, mu = carry
    g = jax.grad(_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), mu


def _momentum(carry: Any, x: jax.Array) -> Any:
    """Adam's first moment and a step along it (optax.adamw's update, elementwise on the stack's split)."""
    p, mu = carry
    g = jax.grad(_loss)(p, x)
    mu = jax.tree.map(lambda m, b: 0.9 * m + 0.1 * b, mu, g)
    return jax.tree.map(lambda a, m: a - 1e-3 * m, p, mu), mu


def _masked(carry: Any, x: jax.Array) -> Any:
    """The gradient read first by a replicated partner (a mask), then by the update: the mask does not split
    the sum, the update's split still reaches it (XLA's propagation takes the split operand's)."""
    p, mu = carry
    g = jax.grad(_loss)(p, x)
    return jax.tree.map(lambda a, b, m: a - 0.1 * b * m, p, g, mu), mu


def _replicated_update(carry: Any, x: jax.Array) -> Any:
    """The update lands on a replicated moment: nothing outside the loop splits the sum (all-reduces)."""
    p, mu = carry
    g = jax.grad(_loss)(p, x)
    return p, jax.tree.map(lambda m, b: 0.9 * m + 0.1 * b, mu, g)


STEPS: dict[str, tuple[Callable[..., Any], P]] = {
    "sgd": (_sgd, STACK),
    "momentum": (_momentum, STACK),
    "masked": (_masked, P()),
    "replicated-moment": (_replicated_update, P()),
}


def _mesh(kind: str) -> jax.sharding.Mesh:
    t = AxisType.Auto if kind == "auto" else AxisType.Explicit
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(t, t))


def _collectives(compiled: Any, report: Any) -> tuple[list[Any], list[Any]]:
    """(explain's, XLA's) collectives as (kind, array bytes, group size, runs per step), sorted."""
    xla = sorted((c.kind, c.array_bytes, c.group_size, c.runs) for c in hlo.normalized(compiled.as_text()))
    got = sorted(
        (c.kind, c.array_bytes, c.group_size, op.repeat)
        for op in report.ops
        for c in op.collectives
        if c.group_size > 1
    )
    return got, xla


def _compare(step: Callable[..., Any], mu_spec: P, kind: str) -> tuple[list[Any], list[Any]]:
    mesh = _mesh(kind)
    shapes = {"a": (L, D, F), "b": (L, F, D)}
    p_sh = {k: NamedSharding(mesh, STACK) for k in shapes}
    mu_sh = {k: NamedSharding(mesh, mu_spec) for k in shapes}
    x_sh = NamedSharding(mesh, P("data"))
    key = iter(jax.random.split(jax.random.key(0), 3))
    p = {k: jax.device_put(jax.random.normal(next(key), s), p_sh[k]) for k, s in shapes.items()}
    mu = {k: jax.device_put(jnp.zeros(s), mu_sh[k]) for k, s in shapes.items()}
    x = jax.device_put(jax.random.normal(next(key), (B, S, D)), x_sh)
    out_sh = (p_sh, mu_sh)
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, in_shardings=(out_sh, x_sh), out_shardings=out_sh).lower((p, mu), x).compile()
        report = trace(step, (p, mu), x, mesh=mesh).report(None, [s.spec for s in jax.tree.leaves(out_sh)])
    return _collectives(compiled, report)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("name", list(STEPS))
def test_a_scanned_fsdp_gradient_read_by_the_update_is_summed_as_xla_does(name: str, kind: str) -> None:
    step, mu_spec = STEPS[name]
    got, xla = _compare(step, mu_spec, kind)
    assert got == xla
    per_step = Counter()
    for k, _, _, runs in got:
        per_step[k] += runs
    if mu_spec == STACK:
        # Each layer's two weight gradients summed straight to the stack's split inside the loop.
        assert per_step["reduce-scatter"] == 2 * L


# A scanned FSDP layer whose activations are smaller than its weight (h[8@data, 32], w[l, 32@data, 32]): the backward
# dot dh . w[l]^T clashes on 'data' (dh's batch, w's rows).  By sizes alone the weight's split wins (the cotangent
# is gathered and the carry all-to-all'd); XLA keeps the carry's split, the one it enters the loop with, and
# gathers the weight (6 all-gathers and 3 reduce-scatters for 3 layers; explain said 9 all-gathers and 8
# all-to-alls, the brief's minimal Auto program).
LAYER_FORMS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "linear": lambda h, w: h @ w,
    "tanh": lambda h, w: jnp.tanh(h @ w),
    "residual": lambda h, w: h + jnp.tanh(h @ w),
}


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("form", list(LAYER_FORMS))
@pytest.mark.parametrize("layers, d, b", [(3, 32, 8), (4, 16, 32)])
def test_a_loop_carry_keeps_its_entering_split_through_a_dot_clash(
    form: str, kind: str, layers: int, d: int, b: int
) -> None:
    layer = LAYER_FORMS[form]

    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.mean(jax.lax.scan(lambda h, wi: (layer(h, wi), None), x, w)[0] ** 2)

    mesh = _mesh(kind)
    w_sh, x_sh = NamedSharding(mesh, STACK), NamedSharding(mesh, P("data"))
    key_w, key_x = jax.random.split(jax.random.key(1))
    w = jax.device_put(jax.random.normal(key_w, (layers, d, d)) / d, w_sh)
    x = jax.device_put(jax.random.normal(key_x, (b, d)), x_sh)
    fn = jax.value_and_grad(loss)
    out_sh = (NamedSharding(mesh, P()), w_sh)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(w_sh, x_sh), out_shardings=out_sh).lower(w, x).compile()
        report = trace(fn, w, x, mesh=mesh).report(None, [P(), STACK])
    got, xla = _collectives(compiled, report)
    assert got == xla
    assert not report.approximate_at
    per_step = Counter()
    for k, _, _, runs in got:
        per_step[k] += runs
    assert (per_step["all-gather"], per_step["reduce-scatter"], per_step["all-to-all"]) == (2 * layers, layers, 0)


# What was left of auto-nnx_scan-fsdp-grad/step, reduced: a scanned FSDP MLP h + tanh(h @ a[l]) @ b[l] whose
# activations (h[8@data, 8, 32]) are no larger than its weights.  XLA's backward loop computes a's gradient at the
# split asked of the stacked output ([d@data, f] per layer): it gathers the cotangent of z = h @ a (dz[b, s, f@data]
# whole, 32768 B) and all-to-alls h to its d split (2048 B), so the gradient needs no sum and no move after the
# loop; the input gradient dz . a[l]^T is computed at the carry's split (dz all-to-all'd to the batch split, a[l]
# gathered).  explain gathered h, landed the gradient on f's split and all-to-all'd the stack after the loop; it
# now brings a dot's operands to the split asked of its result (rules_indexing.asked_split_operands: the stacked
# output's split, asked inside the loop by rules_control's scan rule, and the carry's).
def test_a_scanned_fsdp_mlp_gradient_with_small_activations_is_xlas() -> None:
    mesh = _mesh("auto")
    shapes = {"a": (L, D, 4 * D), "b": (L, 4 * D, D)}
    p_sh = {k: NamedSharding(mesh, STACK) for k in shapes}
    x_sh = NamedSharding(mesh, P("data"))
    p = {k: jax.device_put(jnp.ones(s) / s[1], p_sh[k]) for k, s in shapes.items()}
    x = jax.device_put(jnp.ones((8, 8, D)), x_sh)
    fn = jax.grad(_loss)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(p_sh, x_sh), out_shardings=p_sh).lower(p, x).compile()
        report = trace(fn, p, x, mesh=mesh).report(None, [STACK, STACK])
    got, xla = _collectives(compiled, report)
    assert got == xla


# The same cause without a loop (what was left of the gradient side of auto-eqx_rotary / nnx_gpt / eqx_bert
# fsdp-grad): an FSDP MLP x + tanh(x @ a) @ b on Auto axes, x[8@data, 8, 32] no larger than a[32@data, 128].  a's
# gradient x^T . dz has dz[b, s, f@data] (a free split) and x split on its contracted batch.  XLA takes the split
# asked of the result ([d@data, f], the out_shardings) into the dot: dz gathered whole (32768 B) and x all-to-all'd
# to its d split (2048 B), the gradient made on a's split, though gathering x (8192 B) and all-to-alling the
# gradient after (4096 B) is fewer bytes: the choice is the propagation's (the result's sharding is carried back
# from the output before the dot is settled), not a cost.  Where a later dot reads the gathered cotangent (the
# input gradient of a deeper layer), the gather is made once (test below).
def test_an_fsdp_mlp_weight_gradient_is_made_on_its_asked_split() -> None:
    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return jnp.mean((x + jnp.tanh(x @ p["a"]) @ p["b"]) ** 2)

    mesh = _mesh("auto")
    fsdp = P("data", None)
    p_sh = {"a": NamedSharding(mesh, fsdp), "b": NamedSharding(mesh, fsdp)}
    x_sh = NamedSharding(mesh, P("data"))
    p = {"a": jax.device_put(jnp.ones((D, 4 * D)) / D, p_sh["a"]), "b": jax.device_put(jnp.ones((4 * D, D)), p_sh["b"])}
    x = jax.device_put(jnp.ones((8, 8, D)), x_sh)
    fn = jax.grad(loss)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(p_sh, x_sh), out_shardings=p_sh).lower(p, x).compile()
        report = trace(fn, p, x, mesh=mesh).report(None, [fsdp, fsdp])
    got, xla = _collectives(compiled, report)
    assert got == xla


# Layers unrolled (no loop): each layer's a-gradient dot gathers its cotangent dz (rules_indexing.asked_split_operands)
# and all-to-alls the activation onto the asked split; the input-gradient dot dz . a^T, whose only reader is the sum
# with the residual stream's cotangent (batch split), is computed at that split (dz all-to-all'd to it, a gathered),
# as Shardy's elementwise-first propagation settles it (rules_indexing._elementwise_reader_split); a gather one dot made
# and another reads is charged once (walker.already_moved shares the key of a move and of an analyzer step).
@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.parametrize("layers, b", [(2, 8), (3, 8), (2, 32)])
def test_an_unrolled_fsdp_mlp_gradient_is_xlas(kind: str, layers: int, b: int) -> None:
    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        for i in range(layers):
            x = x + jnp.tanh(x @ p[f"a{i}"]) @ p[f"b{i}"]
        return jnp.mean(x**2)

    mesh = _mesh(kind)
    fsdp = P("data", None)
    shapes = {f"{n}{i}": (D, 4 * D) if n == "a" else (4 * D, D) for i in range(layers) for n in "ab"}
    p_sh = {k: NamedSharding(mesh, fsdp) for k in shapes}
    x_sh = NamedSharding(mesh, P("data"))
    p = {k: jax.device_put(jnp.ones(s) / D, p_sh[k]) for k, s in shapes.items()}
    x = jax.device_put(jnp.ones((b, 8, D)), x_sh)
    fn = jax.grad(loss)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(p_sh, x_sh), out_shardings=p_sh).lower(p, x).compile()
        report = trace(fn, p, x, mesh=mesh).report(None, [fsdp] * len(shapes))
    got, xla = _collectives(compiled, report)
    assert got == xla


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-6) * scale


def _normed_mlp(h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """A pre-norm MLP block, as Flax NNX's and Equinox's are: h + gelu(norm(h) @ up) @ down."""
    return h + jax.nn.gelu(_layer_norm(h, w["scale"]) @ w["up"]) @ w["down"]


def _normed_mlp_stack(loop: str) -> Callable[[Any, jax.Array], jax.Array]:
    """The loss of L pre-norm MLP blocks: unrolled over a list of layers' weights, or a scan over their stack
    (with the body rematerialized: ``remat``)."""

    def loss(p: Any, x: jax.Array) -> jax.Array:
        body = lambda h, w: (_normed_mlp(h, w), None)  # noqa: E731
        if loop == "unrolled":
            for w in p:
                x = body(x, w)[0]
            return jnp.mean(x**2)
        return jnp.mean(jax.lax.scan(jax.checkpoint(body) if loop == "remat" else body, x, p)[0] ** 2)

    return loss


# What was left of auto-nnx_scan-fsdp-grad/step (and of the unrolled nnx_gpt / eqx_bert FSDP gradients' mul and
# add_any marks), reduced: a pre-norm FSDP MLP h + gelu(norm(h) @ up) @ down.  The input gradient of the up
# projection, dy = dz . up^T (dz[b, s, f@data] against up[d@data, f]: a free split clashing with a contracted one),
# is read by the norm's backward twice, dy * x_hat (the scale's gradient) and dy * scale, x_hat split on the batch.
# XLA's propagation settles those elementwise ops before the dot (Shardy's op priority), so dy is made on x_hat's
# batch split: dz all-to-all'd to it (8192 B), up's gather shared with the forward's (or the remat's), and the
# norm's backward needs no move.  explain made dy on d's split (the gathered dz reused), then moved it back in the
# norm's chain: per layer 3 all-to-alls, an all-gather and a reduce-scatter where XLA has one all-to-all and an
# all-reduce (the scanned corpus case: 24 all-to-alls against XLA's 18).  rules_indexing._elementwise_reader_split
# now takes the split from any elementwise reader's split partner, not only from a lone gradient sum.
# jax 0.12's XLA does not take the readers' split on Auto axes: it reports an "involuntary full rematerialization"
# of the input gradient's dot (devices=[1,1,4,2] to the batch split) and gathers it whole, one all-to-all fewer and
# one 32768 B all-gather more per layer than jax 0.10's (whose choice Shardy's propagation gives, and the walk follows).
# Seen on jax 0.12.0.1 (CI's py3.12) and on jax 0.11.2 (a lent GPU machine's image, CPU devices, 2026-11-27).
_JAX_011_REMATERIALIZES = pytest.mark.xfail(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11),
    strict=True,
    reason="jax 0.11+'s SPMD partitioner rematerializes the input gradient's dot in full (its own warning): per "
    "layer 3 all-to-alls and 2 whole all-gathers where jax 0.10 makes 4 and 1",
)


@pytest.mark.parametrize("kind", [pytest.param("auto", marks=_JAX_011_REMATERIALIZES), "explicit"])
@pytest.mark.parametrize("loop", ["unrolled", "scan", "remat"])
def test_a_normed_fsdp_mlp_input_gradient_takes_its_elementwise_readers_split(loop: str, kind: str) -> None:
    mesh = _mesh(kind)
    shapes = {"scale": (D,), "up": (D, 4 * D), "down": (4 * D, D)}
    specs = {"scale": P(), "up": P("data", None), "down": P("data", None)}
    if loop != "unrolled":  # a stack of layers: each weight split as an unrolled layer's
        shapes = {k: (L, *s) for k, s in shapes.items()}
        specs = {k: P(None, *s) for k, s in specs.items()}
    key = iter(jax.random.split(jax.random.key(2), 3 * L + 1))
    layers = [{k: 1 + jax.random.normal(next(key), s) / s[-1] for k, s in shapes.items()} for _ in range(L)]
    params: Any = layers if loop == "unrolled" else layers[0]
    w_sh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    p_sh = [w_sh] * L if loop == "unrolled" else w_sh
    x_sh = NamedSharding(mesh, P("data"))
    p = jax.device_put(params, p_sh)
    x = jax.device_put(jax.random.normal(next(key), (8, 8, D)), x_sh)
    fn = jax.grad(_normed_mlp_stack(loop))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(p_sh, x_sh), out_shardings=p_sh).lower(p, x).compile()
        report = trace(fn, p, x, mesh=mesh).report(None, [s.spec for s in jax.tree.leaves(p_sh)])
    got, xla = _collectives(compiled, report)
    assert got == xla
    mem = compiled.memory_analysis()
    xla_peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    assert 0.75 * xla_peak <= report.peak_bytes <= 1.25 * xla_peak  # the corpus' tolerance (external_corpus.compare)
    if kind == "auto":
        per_step = Counter()
        for k, _, _, runs in got:
            per_step[k] += runs
        # Per layer: the gelu's chain (4: the cotangent to the batch split and back) and the two input-gradient
        # dots' operands (2); none in the norm's backward.
        assert per_step["all-to-all"] == 6 * L


# The cause of auto/explicit-nnx_gpt-fsdp-step's misses (optax.adamw over an FSDP GPT), reduced.  A weight gradient
# x^T . dz whose operands clash (dz[b, s, f@data] split on a free axis, x[b@data, s, d] on the contracted batch) is
# made at the split asked of it (asked_split_operands) -- but in a training step no output asks: the optimizer's
# moments read it (0.9 * mu + 0.1 * g, 0.999 * nu + 0.001 * g * g).  Shardy's elementwise-first pass carries the
# moments' split (fixed by the step's arguments) to the gradient before the dot settles it, as an output's would:
# XLA gathers dz whole and all-to-alls x to the parameter's split, and the update needs no move.  explain gathered x,
# made the gradient on f's split and all-to-all'd it at each moment's add (rules_indexing._at_asked_split now reads
# the moment's split through _elementwise_reader_split(seeded=True), as _settle_passthrough_conflict does).
MLP_FORMS: dict[str, tuple[Callable[[jax.Array, jax.Array], jax.Array], tuple[int, ...], tuple[int, ...]]] = {
    # (the up projection, up's shape, down's shape); the down projection is x @ b throughout but in "transposed"
    "matmul": (lambda x, a: x @ a, (D, 4 * D), (4 * D, D)),
    "transposed": (lambda x, a: x @ a.T, (4 * D, D), (D, 4 * D)),
    "heads": (lambda x, a: jnp.einsum("bsd,dhk->bshk", x, a).reshape(*x.shape[:2], 4 * D), (D, 4, D), (4 * D, D)),
}


def _mlp_loss(form: str) -> Callable[[Any, jax.Array], jax.Array]:
    up = MLP_FORMS[form][0]

    def loss(p: Any, x: jax.Array) -> jax.Array:
        h = jnp.tanh(up(x, p["a"]))
        return jnp.mean((x + (h @ p["b"].T if form == "transposed" else h @ p["b"])) ** 2)

    return loss


def _optimizer_step(loss: Callable[..., Any], optimizer: str) -> Callable[..., Any]:
    """optax.adam's moments (no bias correction: elementwise alike) or SGD with momentum, over ``(p, *moments)``."""

    def step(carry: Any, x: Any) -> Any:
        p, *moments = carry
        g = jax.grad(loss)(p, x)
        mu = jax.tree.map(lambda m, b: 0.9 * m + 0.1 * b, moments[0], g)
        if optimizer == "momentum":
            return jax.tree.map(lambda a, m: a - 1e-3 * m, p, mu), mu
        nu = jax.tree.map(lambda n, b: 0.999 * n + 0.001 * b * b, moments[1], g)
        return jax.tree.map(lambda a, m, n: a - 1e-3 * m / (jnp.sqrt(n) + 1e-6), p, mu, nu), mu, nu

    return step


def _compare_step(
    loss: Callable[..., Any], shapes: dict[str, tuple[int, ...]], specs: dict[str, P], x: jax.Array, kind: str, opt: str
) -> tuple[list[Any], list[Any], Any, Any]:
    """(explain's, XLA's) collectives as (kind, array bytes, runs), the report and the compiled step."""
    mesh = _mesh(kind)
    step = _optimizer_step(loss, opt)
    p_sh = {k: NamedSharding(mesh, specs[k]) for k in shapes}
    n = 2 if opt == "momentum" else 3
    carry_sh = (p_sh,) * n
    keys = iter(jax.random.split(jax.random.key(3), len(shapes) * n))
    carry = tuple(
        {k: jax.device_put(jax.random.normal(next(keys), s) / 8, p_sh[k]) for k, s in shapes.items()} for _ in range(n)
    )
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, in_shardings=(carry_sh, x.sharding), out_shardings=carry_sh).lower(carry, x).compile()
        report = trace(step, carry, x, mesh=mesh).report(None, [s.spec for s in jax.tree.leaves(carry_sh)])
    # (XLA counts a collective-permute's group as the devices that send or receive; explain as the permute's ring)
    got = sorted((c.kind, c.array_bytes, op.repeat) for op in report.ops for c in op.collectives if c.group_size > 1)
    xla = sorted((c.kind, c.array_bytes, c.runs) for c in hlo.normalized(compiled.as_text()))
    return got, xla, report, compiled


def _valid_mlp_draws() -> list[tuple[str, str, int, str]]:
    """(kind, form, split dim, optimizer): on Explicit axes JAX refuses a forward dot whose operands split 'data'
    on two result factors (x's batch, the weight's free axis): those are left out."""
    out = []
    for kind in ("auto", "explicit"):
        for form in MLP_FORMS:
            for dim in (0, 1):
                free_split = (form == "transposed") == (dim == 0)  # up's f axis split over 'data'
                if kind == "explicit" and free_split:
                    continue
                out.extend((kind, form, dim, opt) for opt in ("momentum", "adam"))
    return out


# XLA:CPU's peak below the walk's by a third: the heads MLP's momentum step on Auto axes, its weights' rows split.
# The walk holds a gathered activation's copy for its one gathering dot besides the copy that dot makes into its
# own order (memory._dot_gather_holds): 137728 B against XLA's 102656 B (1.34x); without the held copy it was
# within 25%, and the cases that copy brought within 25% (tests/test_gathered_activation_peak.py, the against-x
# projection gradient) need it where the dot copies its operand as well.  Held out of the draws, as its own strict
# xfail below.
HELD_COPY_TWICE = ("auto", "heads", 0, "momentum")
MLP_DRAWS = st.sampled_from([d for d in _valid_mlp_draws() if d != HELD_COPY_TWICE])


def _check_mlp_step(draw: tuple[str, str, int, str]) -> None:
    kind, form, dim, opt = draw
    _, a_shape, b_shape = MLP_FORMS[form]
    shapes = {"a": a_shape, "b": b_shape}
    specs = {k: P(*[("data" if i == dim else None) for i in range(len(s))]) for k, s in shapes.items()}
    x = jax.random.normal(jax.random.key(4), (8, 8, D))
    got, xla, report, compiled = _compare_step(_mlp_loss(form), shapes, specs, x, kind, opt)
    assert got == xla
    # No move in the update: every parameter's gradient is made on its parameter's split.
    lines, first = inspect.getsourcelines(_optimizer_step)
    update = {f"test_fsdp_gradient_rules.py:{n}" for n in range(first, first + len(lines))}
    assert not [op.expression for op in report.ops if op.collectives and op.where.split(" ")[0].endswith(tuple(update))]
    mem = compiled.memory_analysis()
    xla_peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    # Peak memory is the memory walk's, not this rule's: where the parameters split f (up's free axis), it holds
    # less than XLA:CPU's buffer assignment does, before this rule as after (measured 0.62-0.77x, else 0.79-1.08x;
    # jax 0.12's buffer assignment holds more: 0.58x on ('auto', 'transposed', 0, 'momentum')).
    assert 0.55 * xla_peak <= report.peak_bytes <= 1.25 * xla_peak


@settings(max_examples=4, deadline=None, derandomize=True)
@given(draw=MLP_DRAWS)
def test_an_fsdp_weight_gradient_read_by_the_optimizers_moments_is_made_on_their_split(draw: Any) -> None:
    _check_mlp_step(draw)


@pytest.mark.slow
@settings(max_examples=20, deadline=None)
@given(draw=MLP_DRAWS)
def test_an_fsdp_weight_gradient_read_by_the_optimizers_moments_is_made_on_their_split_deep(draw: Any) -> None:
    _check_mlp_step(draw)


@pytest.mark.xfail(strict=True, reason="peak 1.34x: the gathered activation's copy held beside its dot's own copy")
def test_the_heads_mlps_momentum_step_holds_its_gathered_copy_once() -> None:
    _check_mlp_step(HELD_COPY_TWICE)


# The same cause at a lookup's gradient (the GPT's token table): jnp.take's transpose is a scatter-add inside a nested
# jit, whose result the optimizer's moments read outside it.  With the gradient returned split along the vocabulary,
# XLA moves the updates as the forward moved the ids (a collective-permute, an all-gather over the idle axis, the
# table's piece all-reduced: rules_indexing._moved_scatter_add); read by the moments, it does the same, where explain
# summed the whole table (one 8192 B all-reduce).  The call now hands its body the split the readers outside ask
# (rules_indexing.asked_of_call_result, for a result a scatter-add makes), and the scatter reads it (asked_of_table).
@pytest.mark.parametrize("opt", ["momentum", "adam"])
def test_an_fsdp_tables_gradient_read_by_the_optimizers_moments_is_moved_as_its_lookup(opt: str) -> None:
    def loss(p: Any, ids: jax.Array) -> jax.Array:
        return jnp.mean(jnp.tanh(jnp.take(p["t"], ids, axis=0)) ** 2)

    ids = jnp.arange(64, dtype=jnp.int32).reshape(8, 8) % 64
    got, xla, report, _ = _compare_step(loss, {"t": (64, D)}, {"t": P("data", None)}, ids, "auto", opt)
    assert got == xla
    kinds = Counter(k for k, _, _ in got)
    assert kinds["collective-permute"] == 3 and kinds["all-gather"] == 2  # the forward's moves and the scatter's
    assert not any(c.kind == "all-reduce" and c.array_bytes == 64 * D * 4 for op in report.ops for c in op.collectives)
