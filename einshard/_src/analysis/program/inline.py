"""The program as XLA partitions it: its nested ``jit`` calls that fix no layout inlined into it.

A ``jax.jit`` function called inside the traced one (the user's jitted train step passed whole, ``jax.grad`` of a
jitted loss, a jitted layer) is a ``jit`` equation with a body.  XLA inlines such calls before its sharding
propagation runs (Shardy's to a fixed point, both ways: :mod:`.open_values`), so a value made inside the body takes
the split its readers outside hand it, and the other way round.  Measured on tests/test_open_values.py's programs
wrapped in ``jax.jit`` (XLA:CPU, (data=4, model=2) Auto): XLA compiles each exactly as the unwrapped program
(``tanh_residual``'s loss: 1 collective-permute and 2 all-reduces); explain, which walked the body as a call and
followed open values in the program's own equations only, found none of them (1 all-reduce; its gradient none).

A call that fixes something stays a call: ``in_shardings``/``out_shardings`` (placements at its border), donated
or layout-pinned arguments, compiler options, or constants closed over (none of these are XLA's plain inlining).
Bodies of loops, ``remat`` and custom derivatives stay as they are: their rules walk them.

The one exception is the program that *is* a ``jit`` call (:func:`sole_call`): ``explain(train_step, ...)`` of a
``jax.jit(step, in_shardings=..., out_shardings=..., donate_argnums=...)``.  There the call's shardings are the
program's own argument and output layouts, as XLA compiles them, and its body is the program.
"""

from __future__ import annotations

from typing import Any

__all__ = ["inlined_calls", "sole_call"]

_CALL = "jit"


def _inlinable(eqn: Any) -> bool:
    """Whether XLA inlines this ``jit`` call as plain code: it fixes no layout, donates nothing, closes over
    nothing and sets no compiler option."""
    if eqn.primitive.name != _CALL:
        return False
    params = eqn.params
    closed = params.get("jaxpr")
    consts = getattr(closed, "consts", None)
    if closed is None or consts or not hasattr(closed, "jaxpr"):
        return False
    unspecified = _unspecified_type()
    for key in ("in_shardings", "out_shardings"):
        if any(not isinstance(s, unspecified) for s in params.get(key, ())):
            return False
    if any(params.get("donated_invars", ())) or params.get("compiler_options_kvs"):
        return False
    return all(lay is None for key in ("in_layouts", "out_layouts") for lay in params.get(key, ()))


def _unspecified_type() -> type:
    from jax._src.named_sharding import UnspecifiedValue

    return UnspecifiedValue


def inlined_calls(jaxpr: Any) -> Any:
    """``jaxpr`` with every top-level ``jit`` call XLA inlines (:func:`_inlinable`) replaced by its body's
    equations, recursively; the jaxpr itself where it has none.  Each inlined copy of a body gets fresh variables
    (JAX reuses one traced body for every call of a function on the same shapes)."""
    if not any(_inlinable(e) for e in jaxpr.eqns):
        return jaxpr
    from jax._src import core

    sub: dict[Any, Any] = {}  # a variable of the program or a body -> the atom it now is

    def atom(v: Any) -> Any:
        return v if isinstance(v, core.Literal) else sub.get(v, v)

    def emit(eqns: Any, out: list[Any], fresh: bool) -> None:
        for eqn in eqns:
            ins = [atom(v) for v in eqn.invars]
            if _inlinable(eqn):
                body = eqn.params["jaxpr"].jaxpr
                for b, a in zip(body.invars, ins):
                    sub[b] = a
                emit(body.eqns, out, True)
                for o, b in zip(eqn.outvars, body.outvars):
                    if not isinstance(o, core.DropVar):
                        sub[o] = atom(b)
                continue
            outs = eqn.outvars
            if fresh:
                # (a body's own variables: renamed in each copy, as the same body may be inlined many times)
                outs = []
                for o in eqn.outvars:
                    if isinstance(o, core.DropVar):
                        outs.append(o)
                    else:
                        new = core.Var(o.aval)
                        sub[o] = new
                        outs.append(new)
            if fresh or any(a is not v for a, v in zip(ins, eqn.invars)):
                eqn = eqn.replace(invars=ins, outvars=outs)
            out.append(eqn)

    eqns: list[Any] = []
    emit(jaxpr.eqns, eqns, False)
    return jaxpr.replace(eqns=eqns, outvars=[atom(v) for v in jaxpr.outvars])


def sole_call(jaxpr: Any) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]] | None:
    """``(body, in_specs, out_specs)`` where ``jaxpr`` is one ``jit`` call of its own arguments returning its own
    outputs (the user's jitted step traced whole), or None.

    XLA compiles such a program as its body, with the call's ``in_shardings`` / ``out_shardings`` as its argument
    and output layouts: a PartitionSpec per argument and per output where the call names one (a ``NamedSharding``),
    None where it leaves the layout to the caller or to XLA.  Donation only aliases buffers, so a donating call is
    one too.  A call that closes over constants, sets compiler options or pins a memory layout is left a call, as
    is one whose shardings are not ``NamedSharding`` s."""
    if len(jaxpr.eqns) != 1:
        return None
    eqn = jaxpr.eqns[0]
    if eqn.primitive.name != _CALL or list(eqn.invars) != list(jaxpr.invars):
        return None
    if len(eqn.outvars) != len(jaxpr.outvars) or any(a is not b for a, b in zip(eqn.outvars, jaxpr.outvars)):
        return None
    params = eqn.params
    closed = params.get("jaxpr")
    if closed is None or getattr(closed, "consts", None) or not hasattr(closed, "jaxpr"):
        return None
    if params.get("compiler_options_kvs") or any(
        lay is not None for key in ("in_layouts", "out_layouts") for lay in params.get(key, ())
    ):
        return None
    from jax.sharding import NamedSharding

    unspecified = _unspecified_type()
    specs: list[tuple[Any, ...]] = []
    for key, n in (("in_shardings", len(eqn.invars)), ("out_shardings", len(eqn.outvars))):
        given = tuple(params.get(key, ())) or (None,) * n
        if any(s is not None and not isinstance(s, (unspecified, NamedSharding)) for s in given):
            return None
        specs.append(tuple(s.spec if isinstance(s, NamedSharding) else None for s in given))
    return closed.jaxpr, specs[0], specs[1]
