"""The public API: what ``einshard.__all__`` lists, and the names that left the top level in 0.4."""

import importlib
import re

import pytest

import einshard

# Each moved name warns with its public home (a face, never an einshard._src path).
MOVED = {
    "Plan": "EinsumPlan",
    "PlanResult": "LayoutPlan",
    "parse": "einshard.placement.parse",
    "Expression": "einshard.placement.Expression",
    "Collective": "einshard.analysis.Collective",
    "MeshAxis": "einshard.placement.MeshAxis",
    "anonymous_mesh": "einshard.placement.anonymous_mesh",
    "EinsumProgram": "einshard.lowering.EinsumProgram",
}


def test_every_listed_name_exists_and_is_documented_in_the_readme():
    readme = open(__file__.replace("tests/test_public_api.py", "README.md"), encoding="utf-8").read()
    # 25: 22 before, then axis_rules and audit (logical axes and rule sets), check_explicit (Explicit meshes).
    assert len(einshard.__all__) == len(set(einshard.__all__)) <= 25
    for name in einshard.__all__:
        assert hasattr(einshard, name), name
        assert re.search(rf"`[^`\n]*\b{name}\b[^`\n]*`", readme), f"{name} is public but the README does not name it"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_still_works_and_warns_with_its_new_home(old):
    new = MOVED[old]
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        value = getattr(einshard, old)
    if new.startswith("einshard."):
        module, _, attribute = new.rpartition(".")
        assert value is getattr(importlib.import_module(module), attribute)
    else:
        assert value is getattr(einshard, new)
    assert old not in einshard.__all__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        einshard.nope  # noqa: B018
