"""Path rules: which expression each leaf of a pytree gets.

One matcher, used wherever einshard takes rules for a pytree (``einshard()``,
the demo's presets and rules files, Flax NNX state, ``fsdp``, ``pipeline``,
``plan``), so a rule means the same everywhere:

* a single expression string applies to every leaf;
* a mapping from path patterns to expressions is ordered: the first pattern
  (a regular expression) *found* in the leaf's ``jax.tree_util.keystr`` path
  wins (``re.search``, as scalax's ``TreePathShardingRule``);
* ``None`` as an expression leaves that leaf as it is (replicated/unchanged);
* a leaf no pattern matches is an :class:`~einshard.errors.EinshardError`
  naming its path and the patterns tried (or, where the caller has a fallback
  such as NNX metadata, the ``unmatched`` value);
* a pattern that is not a regular expression, or a rule that is not a string
  or None, is an error naming the pattern.

Example:
    >>> from einshard.tree_rules import leaf_expressions
    >>> leaf_expressions({'w1': 0, 'b': 0}, {r"w\\d": 'd f -> d f@model', '.*': None})
    (None, 'd f -> d f@model')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax

from ._caches import register
from ._checks import RULES, naming
from .errors import EinshardError

__all__ = ["Rules", "leaf_expressions", "compile_rules", "cache_clear", "UNMATCHED"]

Rules = str | Mapping[str, "str | None"]


class _Unmatched:
    def __repr__(self) -> str:
        return "UNMATCHED"


UNMATCHED: Any = _Unmatched()
"""Pass as ``unmatched=`` to get this marker for leaves no pattern matches instead of an error."""

# (tree structure, rules, unmatched) -> the expression of each leaf.  Leaf paths are a function of the
# tree structure, so a repeated call (einshard() per step) skips keystr and the regular expressions.
_CACHE: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_CACHE_MAX = 1024


def compile_rules(rules: Mapping[str, Any]) -> list[tuple[str, re.Pattern[str], str | None]]:
    """The rules' patterns compiled, each rule checked: an EinshardError names a bad pattern or rule."""
    if not isinstance(rules, Mapping):
        raise EinshardError(
            f"rules: path-pattern rules are a mapping {{pattern: expression}}, got {type(rules).__name__}"
        )
    compiled = []
    for pattern, rule in rules.items():
        if not isinstance(pattern, str):
            # bytes patterns cannot search the str paths keystr gives; other keys are no patterns at all
            raise EinshardError(
                f"rules: a path pattern is a string (a regular expression), got {type(pattern).__name__}: {pattern!r:.60}"
            )
        try:
            compiled.append((pattern, re.compile(pattern), rule))
        except re.error as err:
            raise EinshardError(
                f"rules: path pattern {pattern!r:.80} is not a valid regular expression: {err}"
            ) from None
        except (RecursionError, OverflowError, MemoryError):
            # Python's regex compiler recurses per nesting level and caps a pattern's code size.
            raise EinshardError(
                f"rules: path pattern {pattern!r:.80} ({len(pattern)} characters) is too deeply nested or too large "
                "for Python's regular expression compiler"
            ) from None
        if rule is not None and not isinstance(rule, str):
            raise EinshardError(
                f"rules: the rule for path pattern {pattern!r} is a {type(rule).__name__}: {rule!r}; "
                "a rule is an expression string, or None to leave the leaf as it is"
            )
    return compiled


def leaf_expressions(tree: Any, rules: Rules, *, is_leaf: Any = None, unmatched: Any = None) -> tuple[Any, ...]:
    """The expression (or None) of every leaf of ``tree``, in ``jax.tree_util.tree_flatten`` order.

    Args:
        tree: any pytree; only its structure and paths are read.
        rules: one expression for every leaf, or ordered ``{pattern: expression | None}``.
        is_leaf: as in ``jax.tree_util.tree_flatten`` (e.g. NNX variables as leaves).
        unmatched: None (a leaf no pattern matches is an error), or a value to return for such leaves
            (:data:`UNMATCHED`, for callers that fall back to something else).
    """
    treedef = jax.tree_util.tree_structure(tree, is_leaf=is_leaf)
    if isinstance(rules, str):
        return (rules,) * treedef.num_leaves  # type: ignore[attr-defined]
    if not isinstance(rules, Mapping):
        raise EinshardError(
            f"rules are an expression string or a mapping of path patterns to expressions, got {type(rules).__name__}"
        )
    try:
        key = (treedef, tuple(rules.items()), id(unmatched), is_leaf)
        return _CACHE[key]
    except KeyError:
        pass
    except (TypeError, ValueError):  # an unhashable rule, or node data that cannot be compared: no caching
        return _match(tree, rules, is_leaf, unmatched)
    texts = _match(tree, rules, is_leaf, unmatched)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = texts
    return texts


@register
def cache_clear() -> None:
    """Forget the per-structure matches (einshard.clear_caches() calls this)."""
    _CACHE.clear()


def _match(tree: Any, rules: Mapping[str, Any], is_leaf: Any, unmatched: Any) -> tuple[Any, ...]:
    compiled = compile_rules(rules)
    texts = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        key = jax.tree_util.keystr(path)
        for _, regex, rule in compiled:
            if regex.search(key):
                texts.append(rule)
                break
        else:
            if unmatched is not None:
                texts.append(unmatched)
                continue
            listed = ", ".join(repr(p) for p, _, _ in compiled)
            raise EinshardError(
                f"no rule matches the leaf at {key} (patterns tried, in order: {listed})",
                hint="Add a pattern for it, or a catch-all last rule such as '.*': '... -> ...'.",
            )
    return tuple(texts)


def _rules_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """``rules=`` of a public wrapper: None, one expression, or path-pattern rules compiled now (errors name it)."""
    if value is None or isinstance(value, str):
        return value
    with naming(where, name):
        compile_rules(value)
    return value


RULES["rules"] = _rules_rule
