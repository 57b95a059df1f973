"""Placement: an expression says where an array lives (README, docs/default-mesh.md, docs/logical-axes.md).

What ``einshard`` puts at the top level (``einshard``, ``sharding``, ``spec``, ``layout``, ``describe``, ``show``,
``Layout``), plus what a user reaches for beyond it: the parsed expression (``parse``, ``Expression`` and its items),
the mesh helpers, path rules and rules files (``leaf_expressions``, ``read_rules_file``) and ``render``.
"""

from ._src.core import Layout, MeshAxis, resolve_mesh
from ._src.core.logical import axis_rules
from ._src.drawing import render, show
from ._src.parsing import (
    AxisItem,
    EllipsisItem,
    Expression,
    Item,
    ReplicaItem,
    Side,
    format_name,
    is_count_item,
    parse,
    parse_einsum,
    parse_placement,
)
from ._src.placement import (
    anonymous_mesh,
    describe,
    einshard,
    is_anonymous,
    layout,
    sharding,
    spec,
)
from ._src.tree_rules import (
    LARGE_LEAF_BYTES,
    UNMATCHED,
    Rules,
    RulesFile,
    compile_rules,
    leaf_expressions,
    read_rules_file,
)

__all__ = [
    "einshard",
    "sharding",
    "spec",
    "describe",
    "layout",
    "anonymous_mesh",
    "is_anonymous",
    "AxisItem",
    "ReplicaItem",
    "EllipsisItem",
    "Item",
    "Side",
    "Expression",
    "parse",
    "parse_placement",
    "parse_einsum",
    "format_name",
    "is_count_item",
    "Layout",
    "MeshAxis",
    "resolve_mesh",
    "axis_rules",
    "render",
    "show",
    "LARGE_LEAF_BYTES",
    "UNMATCHED",
    "Rules",
    "RulesFile",
    "compile_rules",
    "leaf_expressions",
    "read_rules_file",
]
