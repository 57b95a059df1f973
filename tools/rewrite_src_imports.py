#!/usr/bin/env python3
"""Rewrite imports of einshard's old module paths to the _src tree / public faces (issue 23, `_src` move).

Usage: python tools/rewrite_src_imports.py FILE...   (rewrites in place; prints the files it changed)
Safe to run twice.  Relative imports inside einshard/_src need no change (whole subtrees moved together).
"""

import re
import sys

# Old top-level modules that are now private (no face): every use goes to einshard._src.<name>.
PRIVATE_TOP = "_caches|_checks|_compat|_expression|_grammar|_placement|core|drawing|parsing|tree_rules"
# einshard.audit is also the root *function* einshard.audit: only its module forms move.
AUDIT_MODULE = r"^(\s*)(from|import) einshard\.audit\b"
# Submodules of the packages that keep a public face: the face re-exports the package's __all__,
# the submodules themselves are private now.
SUBMODULES = {
    "analysis": "argument_rules|cost|einsum|explicit|program",
    "lowering": "collective_matmul|einsum|padding|pipeline|pipeline_1f1b|pipeline_info|pipeline_stages"
    "|placing|schedules|shard_einsum|staging|steps|training",
    "planner": "combining|core|explanation|groups|inputs|pipelines|result|roles|scoring|search|verify",
    "interop": "_leaves|flax|keras|logical",
    "checkpoint": "_guard|_integrity|_npz",
    "testing": "checks|strategies",
}
RULES = [
    # einshard.parsing / einshard.core.layout / "einshard.tree_rules" ... anywhere (imports, dotted strings)
    (re.compile(rf"\beinshard\.({PRIVATE_TOP})\b"), r"einshard._src.\1"),
    # from einshard import parsing, tree_rules ...  (only whole-module imports of private modules)
    (re.compile(rf"^(\s*)from einshard import ({PRIVATE_TOP})\b", re.M), r"\1from einshard._src import \2"),
    (re.compile(AUDIT_MODULE, re.M), r"\1\2 einshard._src.audit"),
    (re.compile(r"([\"'])einshard\.audit\.([A-Za-z_]\w*)\1"), r"\1einshard._src.audit.\2\1"),
]
for package, subs in SUBMODULES.items():
    # statement forms only: einshard.lowering.pipeline is also a public *function* of the lowering face
    RULES.append(
        (re.compile(rf"^(\s*)(from|import) einshard\.{package}\.({subs})\b", re.M), rf"\1\2 einshard._src.{package}.\3")
    )
    # dotted strings naming a submodule (monkeypatch targets, sys.modules keys): "einshard.testing.strategies"
    RULES.append(
        (
            re.compile(rf"([\"'])einshard\.{package}\.({subs})(\.[A-Za-z_][\w.]*)?\1"),
            rf"\1einshard._src.{package}.\2\3\1",
        )
    )


def rewrite(text: str) -> str:
    for pattern, repl in RULES:
        text = pattern.sub(repl, text)
    return text.replace("einshard._src._src.", "einshard._src.")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = rewrite(old)
        if new != old:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print(path)
