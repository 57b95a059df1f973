"""The einsum analysis' records and their one trusted constructor each (``Problem.trusted``,
``Candidate.trusted``, ``EinsumPlan.trusted``): the same records as the dataclasses' own constructors, and with
``EINSHARD_CHECKS=1`` each record's invariants checked where it is built."""

import dataclasses
import subprocess
import sys
import types
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard
from einshard._src.analysis.cost import get_profile
from einshard._src.analysis.einsum import model
from einshard._src.analysis.einsum.analyze import plan_einsum
from einshard._src.analysis.einsum.model import Candidate, Problem
from einshard._src.analysis.einsum.plan import EinsumPlan
from einshard._src.core.layout import Layout, MeshAxis

MESH = (MeshAxis("data", 4), MeshAxis("model", 2))
X = Layout(("b", "d"), (64, 128), MESH, (("data",), ()))
W = Layout(("d", "f"), (128, 256), MESH, ((), ("model",)))
SIZES = (("b", 64), ("d", 128), ("f", 256))

EINSUMS = [
    "b@data x, x y@model -> b? y?",
    "b x@model, x@model y -> b? y?",
    "b x@model, x@model y -> b y",
    "b x@model, x@model y -> b y@model",
    "b x@model, x@model y -> b y {U:model}",
    "b@data x@model, x y -> b? y?",
    "b@(data,model) x, x y -> b? y?",
    "b z@model x, x y -> b? y?",
    "b h@model s d, b h@model t d -> b? h? s? t?",
    "b@data d, b@data f -> d? f?",
    "b x, x y -> b y",
]


def _analyze_fresh(expr: str, mesh: dict[str, int], sizes: object) -> EinsumPlan:
    einshard.clear_caches()  # every record built again, not replayed from a cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return einshard.analyze(expr, mesh=mesh, sizes=sizes, dtype="bf16", profile="h100")


def _summary(plan: EinsumPlan) -> tuple[object, ...]:
    return (plan.to_dict(), [a.to_dict(alternatives=False) for a in plan.alternatives])


@settings(max_examples=15, deadline=None)
@given(
    st.sampled_from(EINSUMS),
    st.sampled_from([{"data": 4, "model": 2}, {"data": 2, "model": 4}, {"data": 1, "model": 2}]),
    st.sampled_from([8, 16, 64]),
)
def test_every_record_the_analyzer_builds_keeps_its_invariants(expr, mesh, size):
    """With the checks on, every Problem, Candidate and EinsumPlan built (the plan's alternatives too) passes
    its invariants, and the answer is the one the unchecked run gives."""
    sizes = {n: size for n in "bxyzhstdf"}
    names = {n for n in expr if n.isalpha() and len(n) == 1 and n in sizes}
    sizes = {n: s for n, s in sizes.items() if n in names}
    try:
        unchecked = _summary(_analyze_fresh(expr, mesh, sizes))
    except einshard.EinshardError:
        return  # an indivisible split at these sizes: nothing is built
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model, "CHECKS", True)
        checked = _summary(_analyze_fresh(expr, mesh, sizes))
        # sizes= as another Mapping than a dict: the general path (every argument checked) builds the records
        general = _summary(_analyze_fresh(expr, mesh, types.MappingProxyType(sizes)))
    einshard.clear_caches()
    assert checked == general == unchecked


def test_the_trusted_constructors_build_the_dataclasses_records():
    problem = Problem((X, W), ("b", "f"), SIZES, MESH, None, 2, get_profile("h100"), scatter_chosen=True)
    assert Problem.trusted(**vars(problem)) == problem
    plan = plan_einsum((X, W), ("b", "f"), dtype="bf16", profile="h100")
    cand = plan.candidate
    assert cand is not None
    assert Candidate.trusted(**vars(cand)) == Candidate(**vars(cand))
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(EinsumPlan)}
    rebuilt = EinsumPlan.trusted(**fields)
    assert rebuilt == EinsumPlan(**fields) == plan
    assert rebuilt.to_dict() == plan.to_dict()


@pytest.fixture
def checks(monkeypatch):
    monkeypatch.setattr(model, "CHECKS", True)


def test_a_problem_off_its_mesh_is_refused_where_it_is_built(checks):
    other = Layout(("b", "d"), (64, 128), (MeshAxis("data", 8),), ((), ()))
    with pytest.raises(einshard.EinshardError, match=r"EINSHARD_CHECKS=1.*Problem has operand 1 on the mesh"):
        Problem.trusted((other, W), ("b", "f"), SIZES, MESH, None, 2, get_profile("h100"))
    with pytest.raises(
        einshard.EinshardError, match=r"Problem has operand 1's axis 'd' of size 128, but sizes= says 64"
    ):
        Problem.trusted((X, W), ("b", "f"), (("b", 64), ("d", 64), ("f", 256)), MESH, None, 2, get_profile("h100"))
    with pytest.raises(einshard.EinshardError, match=r"Problem has output axes \['g'\] without a size"):
        Problem.trusted((X, W), ("b", "g"), SIZES, MESH, None, 2, get_profile("h100"))


def test_a_candidate_or_plan_that_does_not_add_up_is_refused(checks):
    plan = plan_einsum((X, W), ("b", "f"), dtype="bf16", profile="h100")
    cand = plan.candidate
    assert cand is not None
    with pytest.raises(einshard.EinshardError, match="Candidate sends 1 bytes, but its collectives send"):
        Candidate.trusted(**{**vars(cand), "comm_bytes": 1})
    with pytest.raises(einshard.EinshardError, match="Candidate has the resolution 'whatever'"):
        Candidate.trusted(**{**vars(cand), "resolution": "whatever"})
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(EinsumPlan)}
    with pytest.raises(einshard.EinshardError, match="EinsumPlan says otherwise than the candidate"):
        EinsumPlan.trusted(**{**fields, "flops": plan.flops + 1})
    with pytest.raises(einshard.EinshardError, match="EinsumPlan does 1 FLOPs per device of 0 in all"):
        EinsumPlan.trusted(**{**fields, "candidate": None, "flops": 1, "total_flops": 0})


@pytest.mark.slow  # a fresh interpreter importing JAX
def test_the_checks_are_off_unless_the_environment_asks():
    assert model.checks_enabled() is False  # the test run's environment does not set EINSHARD_CHECKS
    code = "from einshard._src.analysis.einsum import model; print(model.checks_enabled())"
    env = {"EINSHARD_CHECKS": "1", "JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
