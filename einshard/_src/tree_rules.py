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
  or None, is an error naming the pattern;
* a Flax NNX variable's path is the same with or without its ``.value``: a
  pattern written for ``nnx.state(model)`` flattened to arrays
  (``['up']['kernel'].value``, what ``einshard.plan`` sees) matches the variable
  ``init_sharded`` lays out (``['up']['kernel']``), and the other way round;
* no rule set is silently empty: a mapping whose patterns match no leaf, or
  that leaves a leaf of :data:`LARGE_LEAF_BYTES` or more replicated, warns
  (:class:`~einshard.errors.EinshardWarning`) naming the leaf.

Rules files (:func:`read_rules_file`; ``LayoutPlan.save_rules`` and
``einshard plan --rules-out`` write them, ``einshard demo --rules``,
``einshard.nnx.init_sharded(rules=path)`` and ``einshard.einshard(tree, path)``
read them) are JSON ``{"params": {pattern: expression}, "batch": expression,
"mesh": {name: size}}`` (``batch`` and ``mesh`` optional), or the same as
``pattern: expression`` lines (``mesh: data=4,model=2``, ``batch: ...``).

Example:
    >>> from einshard.placement import leaf_expressions
    >>> leaf_expressions({'w1': 0, 'b': 0}, {r"w\\d": 'd f -> d f@model', '.*': None})
    (None, 'd f -> d f@model')
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ._caches import register
from ._checks import RULES, naming
from ._compat import dtype_itemsize
from .errors import EinshardError, EinshardWarning

__all__ = [
    "Rules",
    "RulesFile",
    "leaf_expressions",
    "compile_rules",
    "read_rules_file",
    "cache_clear",
    "UNMATCHED",
    "LARGE_LEAF_BYTES",
]

Rules = str | Mapping[str, "str | None"] | os.PathLike[str]

LARGE_LEAF_BYTES = 64 * 2**20
"""A leaf at least this large that path rules leave replicated warns: one copy per device is rarely meant."""

# A Flax NNX variable flattens to its value under this attribute key: ``['up']['kernel'].value``.
_VALUE_SUFFIX = ".value"


@dataclass(frozen=True)
class RulesFile:
    """A rules file as read: the parameter rules, the batch's expression and the mesh, when it gives them."""

    params: dict[str, str | None]
    batch: str | None = None
    mesh: dict[str, int] | None = None


def read_rules_file(path: str | os.PathLike[str]) -> RulesFile:
    """Read a rules file: JSON ``{"params": {pattern: expression}, "batch": ..., "mesh": ...}`` or the same as
    ``pattern: expression`` lines (``#`` starts a comment; ``mesh`` and ``batch`` are reserved names).

    JSON ``null`` as an expression means what None means in path rules: leave the leaf as it is.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path) or "\x00" in str(path):
        raise EinshardError(
            f"read_rules_file: path= takes the rules file's path (a non-empty str or os.PathLike), got "
            f"{type(path).__name__} {path!r:.60}"
        )
    p = pathlib.Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        raise EinshardError(f"rules file {str(p)!r}: cannot read it: {getattr(err, 'strerror', None) or err}") from None
    if text.lstrip().startswith("{"):
        params, batch, mesh = _json_rules(p, text)
    else:
        params, batch, mesh = _line_rules(p, text)
    if not params:
        raise EinshardError(f"rules file {p}: no parameter rules (pattern: expression)")
    try:
        compile_rules(params)
    except EinshardError as err:
        raise EinshardError(f"rules file {p}: {err.reason}") from None
    return RulesFile(params, batch, mesh)


_FORMAT = '{"params": {PATTERN: EXPR}, "batch": EXPR, "mesh": {NAME: SIZE}} (batch and mesh optional)'


def _json_rules(p: pathlib.Path, text: str) -> tuple[dict[str, str | None], str | None, dict[str, int] | None]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise EinshardError(f"rules file {p}: not valid JSON: {err}") from None
    if not isinstance(data, dict) or not isinstance(data.get("params", {}), dict):
        raise EinshardError(f"rules file {p}: expected {_FORMAT}")
    unknown = set(data) - {"params", "batch", "mesh"}
    if unknown:
        raise EinshardError(
            f"rules file {p}: unknown keys {sorted(unknown)}; the keys are batch, params, mesh",
            hint=f'A rules file is {_FORMAT}: put the path patterns under "params".',
        )
    params = {str(k): None if v is None else str(v) for k, v in data.get("params", {}).items()}
    batch = data.get("batch")
    mesh_value = data.get("mesh")
    if isinstance(mesh_value, dict):
        mesh: dict[str, int] | None = {str(k): int(v) for k, v in mesh_value.items()}
    else:
        mesh = _mesh_text(p, str(mesh_value)) if mesh_value else None
    return params, None if batch is None else str(batch), mesh


def _line_rules(p: pathlib.Path, text: str) -> tuple[dict[str, str | None], str | None, dict[str, int] | None]:
    params: dict[str, str | None] = {}
    batch: str | None = None
    mesh: dict[str, int] | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        # The pattern ends at the first ':' followed by whitespace ('{U:model}' has none).
        match = re.match(r"(.+?):\s+(.*)$", line)
        if not match:
            raise EinshardError(f"rules file {p}, line {lineno}: expected 'pattern: expression', got {raw.strip()!r}")
        key, value = match.group(1).strip(), match.group(2).strip()
        if key == "mesh":
            mesh = _mesh_text(p, value)
        elif key == "batch":
            batch = value
        else:
            params[key] = value
    return params, batch, mesh


def _mesh_text(p: pathlib.Path, text: str) -> dict[str, int]:
    """``'data=4,model=2'`` -> ``{'data': 4, 'model': 2}``."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not name.isidentifier() or not size.isdigit() or int(size) < 1 or name in out:
            raise EinshardError(
                f"rules file {p}: mesh takes distinct name=size pairs like data=4,model=2; got {text!r}"
            )
        out[name] = int(size)
    return out


def as_rules(rules: Any) -> Any:
    """``rules`` with a rules file (a ``pathlib.Path`` or other ``os.PathLike``) read to its parameter rules."""
    if isinstance(rules, os.PathLike):
        return read_rules_file(rules).params
    return rules


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
    rules = as_rules(rules)
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


def path_keys(path: Sequence[Any], leaf: Any) -> tuple[str, ...]:
    """The strings a leaf's path rules are searched in: its ``keystr`` path, and the same with or without a
    Flax NNX variable's ``.value`` (a variable taken as a leaf, or its value flattened out of it)."""
    key = jax.tree_util.keystr(tuple(path))
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        return key, key[: -len(_VALUE_SUFFIX)]
    if _is_nnx_variable(leaf):
        return key, key + _VALUE_SUFFIX
    return (key,)


def _is_nnx_variable(x: Any) -> bool:
    # (by its type's module and name: this module never imports Flax)
    return any(t.__name__ == "Variable" and t.__module__.startswith("flax.nnx") for t in type(x).__mro__)


def _match(tree: Any, rules: Mapping[str, Any], is_leaf: Any, unmatched: Any) -> tuple[Any, ...]:
    compiled = compile_rules(rules)
    texts = []
    matched_any = False  # (a rule may be None, so the texts alone cannot say)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    for path, leaf in flat:
        keys = path_keys(path, leaf)
        for _, regex, rule in compiled:
            if any(regex.search(k) for k in keys):
                texts.append(rule)
                matched_any = True
                break
        else:
            if unmatched is not None:
                texts.append(unmatched)
                continue
            listed = ", ".join(repr(p) for p, _, _ in compiled)
            raise EinshardError(
                f"no rule matches the leaf at {keys[0]} (patterns tried, in order: {listed})",
                hint="Add a pattern for it, or a catch-all last rule such as '.*': '... -> ...'.",
            )
    if flat and compiled and not matched_any:
        shown = ", ".join(_shown(p) for p, _ in flat[:3]) + (", ..." if len(flat) > 3 else "")
        warnings.warn(
            f"the path rules match no leaf of the tree (patterns: {', '.join(repr(p) for p, _, _ in compiled)}; "
            f"its paths look like {shown}): every leaf gets the fallback",
            EinshardWarning,
            stacklevel=4,
        )
    warn_replicated([(p, leaf) for p, leaf in flat], texts, skip=unmatched)
    return tuple(texts)


def _shown(path: Sequence[Any]) -> str:
    """A leaf's path as the rules see it; the tree itself when it is one leaf."""
    return jax.tree_util.keystr(tuple(path)) or "(the root: a single leaf)"


def _replicates(text: Any) -> bool:
    """Whether a rule leaves its leaf whole on every device: None, or an expression whose right side names no
    mesh axis and no count (axis names are letters and ``_``: a digit or ``*`` is a count, ``@`` a mesh axis)."""
    if text is None:
        return True
    if not isinstance(text, str) or "->" not in text:
        return False
    return re.search(r"[@\d*]", text.split("->", 1)[1]) is None


def _nbytes(leaf: Any) -> int:
    value = leaf.get_value() if _is_nnx_variable(leaf) and hasattr(leaf, "get_value") else leaf
    value = getattr(value, "value", value) if _is_nnx_variable(value) else value
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        return math.prod(int(s) for s in shape) * dtype_itemsize(dtype)
    except TypeError:  # not a dtype at all (an object's own .dtype attribute): nothing to warn about
        return 0


def warn_replicated(leaves: Sequence[tuple[Any, Any]], texts: Sequence[Any], *, skip: Any = None) -> None:
    """Warn for each leaf of :data:`LARGE_LEAF_BYTES` or more that its rule leaves replicated, naming it.

    ``leaves``: (path, leaf) pairs; ``texts``: each one's rule; ``skip``: a marker whose leaves are not decided
    yet (the caller falls back to something else, and checks what it chose)."""
    big = []
    for (path, leaf), text in zip(leaves, texts, strict=True):
        if (skip is not None and text is skip) or not _replicates(text):
            continue
        sharding = getattr(leaf, "sharding", None)
        if text is None and sharding is not None and not sharding.is_fully_replicated:
            continue  # None leaves a leaf as it is, and this one is already split
        n = _nbytes(leaf)
        if n >= LARGE_LEAF_BYTES:
            big.append(f"{_shown(path)} ({n / 2**20:.0f} MiB)")
    if big:
        warnings.warn(
            f"the path rules leave {len(big)} large leaf/leaves replicated, a whole copy on every device: "
            + ", ".join(big[:5])
            + (", ..." if len(big) > 5 else "")
            + ". Give them a rule that splits them (or None/'... -> ...' on purpose, and silence this warning).",
            EinshardWarning,
            stacklevel=5,
        )


def _rules_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """``rules=`` of a public wrapper: None, one expression, a rules file (read now: the functions behind these
    wrappers take its rules as a mapping) or path-pattern rules compiled now (errors name it)."""
    if value is None or isinstance(value, str):
        return value
    with naming(where, name):
        if isinstance(value, os.PathLike):
            return read_rules_file(value).params
        compile_rules(value)
    return value


RULES["rules"] = _rules_rule
