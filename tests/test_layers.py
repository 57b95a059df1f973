"""The layers: the library never imports the applications, and lower layers never import higher ones."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "einshard"

# A module may import only from its own layer or the layers before it in this order.
ORDER = [
    "errors",
    "_caches",
    "_compat",
    "parsing",
    "layout",
    "mesh",
    "tree_rules",
    "placement",
    "show",
    "analysis",
    "lowering",
]


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
    return ORDER.index(parts[1]) if parts[1] in ORDER else None


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lower_layers_never_import_higher_ones(path):
    own = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if own is None:
        return  # the package root and integrations (nnx, checkpoint, testing) sit on top
    higher = [n for n in _imports(path) if (_layer(n) or 0) > own]
    assert not higher, f"{path.name} ({ORDER[own]}) imports {higher}"
