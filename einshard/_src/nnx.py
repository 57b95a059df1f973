"""Flax NNX: einshard expressions as parameter sharding metadata, and models created directly sharded.

Needs the optional extra ``pip install 'einshard[flax]'``.

Two ways to say where each NNX variable lives:

* in the model definition, ``with_layout(initializer, 'i o -> i o@model')``
  wraps an initializer so the variable carries the expression as metadata
  (``variable.get_metadata()['einshard']``);
* from outside, rules over ``nnx.state`` paths: ``{'kernel': 'i o -> i o@model',
  'bias': 'o -> o'}`` (regular expressions searched in the variable's path; the
  first match wins).  Rules win over metadata.

:func:`init_sharded` then creates the model under ``jax.jit`` with those
layouts as ``out_shardings``: every device computes only its own block of
each parameter, so a model larger than one device's memory never exists whole
on any device.

Example (run by tests/test_nnx.py, which skips when Flax is not installed)::

    import jax
    from flax import nnx
    import einshard.nnx as esx

    mesh = jax.make_mesh((8,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = esx.with_layout(nnx.initializers.lecun_normal(), 'i o -> i o@model')
            self.up = nnx.Linear(16, 64, kernel_init=init, use_bias=False, rngs=rngs)

    model = esx.init_sharded(lambda: MLP(nnx.Rngs(0)), mesh=mesh)
    model.up.kernel[...].sharding.spec    # P(None, 'model')

This module imports without Flax (so the rest of einshard never needs it);
its functions raise ImportError with the install command when Flax is missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import jax

from . import _checks
from .core.logical import AxisRulesLike, takes_axis_rules
from .errors import EinshardError
from .placement import sharding
from .tree_rules import UNMATCHED, as_rules, leaf_expressions, warn_replicated

try:
    from flax import nnx
except ImportError:  # pragma: no cover - exercised only without the extra
    nnx = None  # type: ignore[assignment]

__all__ = ["with_layout", "layout_of", "state_shardings", "init_function", "init_sharded"]

METADATA_KEY = "einshard"


def _require_flax() -> None:
    if nnx is None:
        raise ImportError("einshard.nnx needs Flax NNX: pip install 'einshard[flax]'")


def with_layout(initializer: Callable[..., Any], expr: str) -> Callable[..., Any]:
    """``initializer`` whose variable carries the einshard expression ``expr`` as metadata."""
    _require_flax()
    if not isinstance(expr, str):
        raise EinshardError(f"with_layout takes an einshard expression string, got {type(expr).__name__}")
    return nnx.with_metadata(initializer, **{METADATA_KEY: expr})  # type: ignore[arg-type]


def layout_of(variable: Any) -> str | None:
    """The expression a variable was annotated with by :func:`with_layout`, or None."""
    metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    return metadata.get(METADATA_KEY)


def _is_variable(x: Any) -> bool:
    return nnx is not None and isinstance(x, nnx.Variable)


def _value(var: Any) -> Any:
    # flax >= 0.12 spells it get_value(); older releases .value
    return var.get_value() if hasattr(var, "get_value") else var.value


@takes_axis_rules()
def state_shardings(
    state: Any,
    mesh: jax.sharding.Mesh,
    rules: Mapping[str, str | None] | os.PathLike[str] | None = None,
    *,
    default: str | None = "... -> ...",
    axis_rules: AxisRulesLike | None = None,
) -> Any:
    """A tree like ``state`` (an ``nnx.State``) holding each variable's ``NamedSharding``.

    Each variable's expression is the first rule whose pattern is found in its
    path (``jax.tree_util.keystr``, with or without the ``.value`` that
    ``einshard.plan`` sees on the state flattened to arrays; ``rules`` may be
    a rules file's path, as ``LayoutPlan.save_rules`` writes it; einshard's one matcher,
    :mod:`einshard.tree_rules`: a rule of None means replicated, a pattern that
    is not a regular expression is an error naming it), else its
    :func:`with_layout` metadata, else ``default`` (replicated);
    ``default=None`` makes an unannotated variable an error instead.  ``axis_rules``: a table for
    logical names in the expressions (docs/logical-axes.md).
    """
    _require_flax()
    # A rule matches a variable's path with or without its '.value' (einshard.tree_rules), so einshard.plan's
    # rules, written for the state flattened to arrays, lay out the variables here (issue 22).
    matched = iter(leaf_expressions(state, dict(as_rules(rules) or {}), is_leaf=_is_variable, unmatched=UNMATCHED))
    fallen_back: list[tuple[Any, Any]] = []  # (path, variable) of those metadata or the default decided
    fallback_texts: list[str | None] = []

    def pick(path: Any, var: Any) -> Any:
        key = jax.tree_util.keystr(path)
        expr = next(matched)
        if expr is None:  # a rule that says None leaves the variable replicated, as everywhere in einshard
            expr = "... -> ..."
        elif expr is UNMATCHED:
            expr = layout_of(var) if _is_variable(var) else None
            if expr is None:
                expr = default
            fallen_back.append((path, var))
            fallback_texts.append(expr)
        if expr is None:
            raise EinshardError(
                f"the variable at {key} has no einshard layout (no rule matches, no with_layout metadata)",
                hint="Annotate it with einshard.nnx.with_layout, add a rule, or pass default='... -> ...'.",
            )
        value = _value(var) if _is_variable(var) else var
        try:
            sh = sharding(expr, tuple(value.shape), mesh=mesh)
        except EinshardError as err:
            raise EinshardError(
                f"at {key} (shape {tuple(value.shape)}): {err.reason}", err.expression, err.column, err.hint
            ) from None
        return var.replace(sh) if _is_variable(var) else sh

    out = jax.tree_util.tree_map_with_path(pick, state, is_leaf=_is_variable)
    if rules:  # rules were given: a large variable left replicated by the fallback is said, by path
        warn_replicated(fallen_back, fallback_texts)
    return out


@takes_axis_rules()
def init_function(
    make_model: Callable[[], Any],
    *,
    mesh: jax.sharding.Mesh,
    rules: Mapping[str, str | None] | os.PathLike[str] | None = None,
    default: str | None = "... -> ...",
    axis_rules: AxisRulesLike | None = None,
) -> tuple[Any, Any]:
    """``(create, graphdef)``: ``create()`` is the jitted initialiser returning the sharded ``nnx.State``.

    Nothing is computed until ``create()`` is called; ``create.lower().compile()``
    shows what one device will hold (``memory_analysis()``).
    """
    _require_flax()
    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_state = nnx.split(abstract)
    out = state_shardings(abstract_state, mesh, rules, default=default)

    def build() -> Any:
        return nnx.state(make_model())

    return jax.jit(build, out_shardings=out), graphdef


@takes_axis_rules()
def init_sharded(
    make_model: Callable[[], Any],
    *,
    mesh: jax.sharding.Mesh,
    rules: Mapping[str, str | None] | os.PathLike[str] | None = None,
    default: str | None = "... -> ...",
    axis_rules: AxisRulesLike | None = None,
) -> Any:
    """Create ``make_model()`` directly sharded: each device only ever holds its blocks of the parameters."""
    create, graphdef = init_function(make_model, mesh=mesh, rules=rules, default=default)
    return nnx.merge(graphdef, create())


# The public names check their arguments by name (einshard._checks.RULES); a mesh is required here.
def _concrete_mesh(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    if not isinstance(value, jax.sharding.Mesh):
        return _checks.fail(where, name, "a jax.sharding.Mesh", value)
    from .core.mesh import as_mesh

    return as_mesh(value)


def _expression_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from .parsing import parse_placement

    _checks.check_str(value, where, name)
    parse_placement(value)
    return value


def _variable_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    return value if _is_variable(value) else _checks.fail(where, name, "an nnx.Variable", value)


with_layout = _checks.checked(with_layout, "einshard.nnx.with_layout", expr=_expression_rule)
layout_of = _checks.checked(layout_of, "einshard.nnx.layout_of", variable=_variable_rule)
state_shardings = _checks.checked(state_shardings, "einshard.nnx.state_shardings", mesh=_concrete_mesh)
init_function = _checks.checked(init_function, "einshard.nnx.init_function", mesh=_concrete_mesh)
init_sharded = _checks.checked(init_sharded, "einshard.nnx.init_sharded", mesh=_concrete_mesh)
