"""The layers: the library never imports the applications, and lower layers never import higher ones."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "einshard"

# A module may import only from its own layer or the layers before it in this order.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_checks"),  # the error type; the value checks of every public boundary (each layer adds its rules)
    ("_caches",),
    ("_compat",),
    ("_expression", "_grammar", "parsing"),  # syntax: the parsed objects, the Lark parser, the entry points
    ("core",),  # mesh resolver, Layout, the collective vocabulary
    ("tree_rules",),
    ("_placement", "placement", "multihost"),  # multihost: settings of the agreement checks between processes
    ("interop",),  # foreign rule sets (Keras LayoutMap, Flax metadata, MaxText lists) read into path rules and back
    ("drawing",),
    ("analysis", "targets"),  # targets: hardware profiles and TPU topologies that analysis and the planner aim at
    ("lowering",),
    ("planner",),  # searches layouts and pipeline schedules: costs them with analysis and lowering's models
]
ORDER = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# On top of the layers (they may import any of them): the package root and the integrations.
ON_TOP = {"__init__", "__main__", "nnx", "checkpoint", "testing", "audit"}


def _imports(path: pathlib.Path) -> set[str]:
    """The einshard modules a file imports (absolute names), relative imports resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {n for n in out if n.split(".")[0] in ("einshard", "einshard_apps")}


LIBRARY_FILES = [p for p in LIBRARY.rglob("*.py") if p.name != "__main__.py"]


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_the_applications(path):
    assert not [n for n in _imports(path) if n.startswith("einshard_apps")]


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "einshard" or len(parts) < 2:
        return None
    return ORDER.get(parts[1])


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lower_layers_never_import_higher_ones(path):
    own = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if own is None:
        return  # the package root and integrations (nnx, checkpoint, testing) sit on top
    higher = [n for n in _imports(path) if (_layer(n) or 0) > own]
    assert not higher, f"{path.name} (layer {LAYERS[own]}) imports {higher}"


def test_every_module_of_the_package_has_a_layer():
    names = {p.stem for p in LIBRARY.glob("*.py")} | {p.name for p in LIBRARY.iterdir() if (p / "__init__.py").exists()}
    assert names - set(ORDER) - ON_TOP == set()


# -- the layout algebra (issue 23): one copy, in core, built through one trusted constructor ----------------


def test_the_layout_algebra_imports_nothing_above_core():
    """core/moves.py (the moves, transition, apply_to_layout) needs layouts, the collective vocabulary and
    the error type only: pricing (analysis/cost.py) and running (lowering/steps.py) sit above it."""
    found = _imports(LIBRARY / "core" / "moves.py")
    assert found and all(n.startswith(("einshard.core.", "einshard.errors")) for n in found), found


def test_layouts_meshaxes_and_collectives_are_built_only_through_their_constructors():
    """No module fills a Layout, MeshAxis or Collective with ``object.__new__`` outside its trusted
    constructor (``_derive``, checked under EINSHARD_CHECKS=1)."""
    import re

    bypass = re.compile(r"__new__\((Layout|MeshAxis|Collective)\)")
    found = [str(p.relative_to(ROOT)) for p in LIBRARY_FILES if bypass.search(p.read_text())]
    assert found == []
