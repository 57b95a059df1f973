"""The layers: the library never imports the applications, lower layers never import higher ones, and the public
module paths are a short, documented list of faces over the private ``einshard/_src`` tree (issue 23)."""

import ast
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ROOT / "einshard"
# The code lives here; the modules outside it are the public faces (re-exports only, see the end of this file).
SRC = LIBRARY / "_src"

# A module of einshard/_src may import only from its own layer or the layers before it in this order.
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
ON_TOP = {"__init__", "__main__", "nnx", "checkpoint", "testing", "audit", "moved"}  # moved: 0.4's renamed names


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
    if parts[:2] != ["einshard", "_src"] or len(parts) < 3:
        return None  # the package root and the public faces sit on top of every layer
    return ORDER.get(parts[2])


@pytest.mark.parametrize("path", LIBRARY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lower_layers_never_import_higher_ones(path):
    own = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if own is None:
        return  # the package root and integrations (nnx, checkpoint, testing) sit on top
    higher = [n for n in _imports(path) if (_layer(n) or 0) > own]
    assert not higher, f"{path.name} (layer {LAYERS[own]}) imports {higher}"


def test_every_module_of_the_package_has_a_layer():
    names = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert names - set(ORDER) - ON_TOP == set()


# Inside the einsum analysis (einshard/_src/analysis/einsum/): one way through.  A module imports only the ones
# before it: the records, the per-mesh-axis rule, the search over it, what analyze reads, the plan it returns,
# analyze itself.
EINSUM_ORDER = ("model", "options", "search", "read", "plan", "analyze")
EINSUM = SRC / "analysis" / "einsum"


def test_the_einsum_package_lists_every_module_in_its_order():
    assert {p.stem for p in EINSUM.glob("*.py")} - {"__init__"} == set(EINSUM_ORDER)


@pytest.mark.parametrize("name", EINSUM_ORDER)
def test_the_einsum_analysis_is_one_way(name):
    own = EINSUM_ORDER.index(name)
    later = set(EINSUM_ORDER[own + 1 :])
    prefix = "einshard._src.analysis.einsum."
    upward = sorted(n for n in _imports(EINSUM / f"{name}.py") if n.startswith(prefix) and n.split(".")[4] in later)
    assert not upward, f"analysis/einsum/{name}.py imports {upward}: the order is {' < '.join(EINSUM_ORDER)}"


# A leading underscore means "this module's own": no other module takes such a name (issue 23).  A name
# another module needs is public inside the package (no underscore; ``__all__`` lists what faces export).
# Importing a private *module* of the package (``from . import _caches``) is fine: that is the package's own.
# What remains, each entry (importer, module, name) with a one-line reason it is still private; none today (issue
# 23 named the last 34 publicly).  A new entry is a decision: prefer naming the name without its underscore.
KNOWN_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}


def _private_names_in(importer: str, is_package: bool, source: str) -> set[tuple[str, str, str]]:
    """(importer, module, name) for each ``from module import _name`` in ``source`` of an einshard module other
    than the importer, where ``_name`` is a name defined there, not one of the package's private submodules."""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    taken = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
        module = ".".join(p for p in (base, node.module or "") if p)
        if not module.startswith("einshard") or module == importer:
            continue
        taken |= {
            (importer, module, a.name)
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__") and f"{module}.{a.name}" not in MODULES
        }
    return taken


def test_no_module_takes_another_modules_private_name():
    taken = set().union(
        *(_private_names_in(_module_name(p), p.name == "__init__.py", p.read_text()) for p in LIBRARY_FILES)
    )
    new = sorted(taken - set(KNOWN_PRIVATE_IMPORTS))
    assert not new, f"private names taken across modules (name them without the underscore): {new}"
    gone = sorted(set(KNOWN_PRIVATE_IMPORTS) - taken)
    assert not gone, f"no longer taken: delete from KNOWN_PRIVATE_IMPORTS: {gone}"


def test_the_private_name_finder_tells_a_name_from_a_private_module():
    rules = "einshard._src.analysis.program.rules_structural"
    source = "from .memory import _fusing, peak_bytes\nfrom ... import _caches\nfrom ...errors import __doc__\n"
    assert _private_names_in(rules, False, source) == {(rules, "einshard._src.analysis.program.memory", "_fusing")}
    # In a package's __init__ the dots count from the package itself.
    init = "einshard._src.analysis.program"
    assert _private_names_in(init, True, "from .memory import _fusing\nfrom .. import _x\n") == {
        (init, f"{init}.memory", "_fusing"),
        (init, "einshard._src.analysis", "_x"),
    }


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in LIBRARY.rglob("*.py")}


def _module_level_imports(path: pathlib.Path) -> set[str]:
    """The einshard modules a file imports when it is imported: its module-level statements (``if
    TYPE_CHECKING:`` and ``try:`` blocks included, function and class bodies not), each name resolved to the
    module it names (``from .x import f`` names ``.x``; ``from . import x`` names ``.x`` when it is a module)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in MODULES else module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text()).body)
    return {n for n in found if n in MODULES and n != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed path through a strongly connected component, for the message: ``a -> b -> a``."""
    members = set(component)
    path = [component[0]]
    while True:
        step = min(w for w in graph[path[-1]] if w in members)
        if step in path:
            return path[path.index(step) :] + [step]
        path.append(step)


def test_the_library_has_no_import_cycles():
    """No module-level import cycle anywhere in the package (issue 23 ended the last three): a module imports only
    what is complete without it, so no module sees another half-initialised."""
    graph = {name: _module_level_imports(path) for name, path in MODULES.items()}
    cycles = [" -> ".join(_a_cycle(graph, c)) for c in _cycles(graph)]
    assert not cycles, "import cycles (module-level imports): " + "; ".join(cycles)


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# -- the layout algebra (issue 23): one copy, in core, built through one trusted constructor ----------------


def test_the_layout_algebra_imports_nothing_above_core():
    """core/moves.py (the moves, transition, apply_to_layout) needs layouts, the collective vocabulary and
    the error type only: pricing (analysis/cost.py) and running (lowering/steps.py) sit above it."""
    found = _imports(SRC / "core" / "moves.py")
    assert found and all(n.startswith(("einshard._src.core.", "einshard._src.errors")) for n in found), found


def test_layouts_meshaxes_and_collectives_are_built_only_through_their_constructors():
    """No module fills a Layout, MeshAxis or Collective with ``object.__new__`` outside its trusted
    constructor (``_derive``, checked under EINSHARD_CHECKS=1)."""
    import re

    bypass = re.compile(r"__new__\((Layout|MeshAxis|Collective)\)")
    found = [str(p.relative_to(ROOT)) for p in LIBRARY_FILES if bypass.search(p.read_text())]
    assert found == []


# -- the public module paths (issue 23): a short list of faces over einshard/_src -----------------------------
# Each public module path is a decision: a new one is added here and to docs/architecture.md's table, with
# what it is and where its code lives.  Everything else sits under einshard/_src and may change without notice.
PUBLIC_MODULES = {
    "einshard",
    "einshard.errors",
    "einshard.placement",
    "einshard.analysis",
    "einshard.planner",
    "einshard.lowering",
    "einshard.interop",
    "einshard.checkpoint",
    "einshard.targets",
    "einshard.nnx",
    "einshard.multihost",
    "einshard.testing",
    "einshard.testing.hlo",
}
# The command line's entry point (python -m einshard), not an importable API.
ENTRY_POINTS = {"einshard.__main__"}
FACES = {name: path for name, path in MODULES.items() if "_src" not in name.split(".") and name not in ENTRY_POINTS}


def test_the_public_module_paths_are_exactly_the_documented_list():
    assert set(FACES) == PUBLIC_MODULES, (
        f"public module paths (no _src in them) changed: new {sorted(set(FACES) - PUBLIC_MODULES)}, "
        f"gone {sorted(PUBLIC_MODULES - set(FACES))}; a public module is a decision: move code under "
        "einshard/_src, or add the path to PUBLIC_MODULES and to docs/architecture.md"
    )


def test_docs_architecture_lists_every_public_module_path():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("\n## ")[0]  # the first table
    listed = set(re.findall(r"^\| `(einshard(?:\.\w+)*)` \|", text, flags=re.M))
    assert listed == PUBLIC_MODULES, (sorted(listed - PUBLIC_MODULES), sorted(PUBLIC_MODULES - listed))


def _face_statements_that_are_not_re_exports(path: pathlib.Path) -> list[str]:
    """A face holds a docstring, imports from einshard._src or another face, ``__all__`` (and the root's
    ``__version__``): any other statement is logic, which belongs under _src."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    wrong = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom) and node.level:
            module = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            if module.startswith("einshard._src") or module in PUBLIC_MODULES:
                continue
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] in (["__all__"], ["__version__"]):
            if isinstance(node.value, (ast.List, ast.Constant)):
                continue
        wrong.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return wrong


@pytest.mark.parametrize("name", sorted(PUBLIC_MODULES))
def test_a_public_module_only_re_exports(name):
    import importlib

    path = FACES[name]
    assert _face_statements_that_are_not_re_exports(path) == [], f"{path.relative_to(ROOT)} holds logic"
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ lists names it does not have: {missing}"
    # What a face exports is defined under _src (or is a public submodule), never in the face itself.
    for attribute in exported:
        value = getattr(module, attribute)
        if inspect.ismodule(value):
            assert value.__name__ in PUBLIC_MODULES, (name, attribute, value.__name__)
        elif inspect.isfunction(value) or inspect.isclass(value):
            assert value.__module__.startswith("einshard._src."), (name, attribute, value.__module__)


def test_the_face_checker_names_logic():
    import tempfile

    with tempfile.TemporaryDirectory(dir=LIBRARY) as tmp:
        face = pathlib.Path(tmp) / "face.py"
        face.write_text('"""doc"""\nfrom .._src.errors import EinshardError\n__all__ = ["EinshardError"]\nX = 1\n')
        assert _face_statements_that_are_not_re_exports(face) == ["line 4: X = 1"]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_internals_never_import_a_public_face(path):
    """The faces re-export _src; an internal module importing a face would make the import order circular."""
    faces = [n for n in _imports(path) if n.split(".")[1:2] != ["_src"] and n != "einshard"]
    assert not faces, f"{path.relative_to(ROOT)} imports the public faces {faces}: import from einshard._src"
