"""plan()'s search knobs travel in one record, ``einshard.planner.SearchOptions``; every other keyword is the step's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard
from einshard.errors import EinshardError
from einshard.planner import SearchOptions

PARAMS = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
BATCH = jax.ShapeDtypeStruct((512, 64), jnp.float32)
MESH = {"data": 4, "model": 2}


def _loss(params, batch, scale=1.0):
    return scale * jnp.mean((jnp.tanh(batch @ params["w1"]) @ params["w2"]) ** 2)


STEP = jax.value_and_grad(_loss)


def test_the_defaults_are_the_search_plan_always_ran():
    assert SearchOptions() == SearchOptions(
        exhaustive_limit=256, max_evaluations=160, restarts=0, pair_limit=512, seed=0, n_alternatives=5
    )
    assert einshard.planner.EXHAUSTIVE_LIMIT == SearchOptions().exhaustive_limit


def test_a_search_options_record_is_frozen_and_hashable():
    options = SearchOptions(max_evaluations=40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_evaluations = 4  # type: ignore[misc]
    assert hash(options) == hash(SearchOptions(max_evaluations=np.int64(40)))  # numpy ints become ints
    assert SearchOptions(max_evaluations=np.int64(40)).max_evaluations.__class__ is int


@pytest.mark.parametrize(
    "field, value",
    [
        ("exhaustive_limit", -1),
        ("max_evaluations", 0),
        ("restarts", 1.5),
        ("pair_limit", "512"),
        ("seed", None),
        ("seed", True),
        ("n_alternatives", float("nan")),
    ],
)
def test_a_bad_knob_is_refused_at_construction_naming_its_field(field, value):
    with pytest.raises(EinshardError, match=rf"SearchOptions: {field}= takes an integer"):
        SearchOptions(**{field: value})


@given(
    exhaustive_limit=st.integers(0, 10**6),
    max_evaluations=st.integers(1, 10**6),
    restarts=st.integers(0, 100),
    pair_limit=st.integers(0, 10**6),
    seed=st.integers(-(2**63), 2**63),
    n_alternatives=st.integers(0, 100),
)
@settings(max_examples=50, deadline=None)
def test_every_valid_count_is_kept_as_given(**knobs):
    assert dataclasses.asdict(SearchOptions(**knobs)) == knobs


def test_search_takes_only_a_record():
    with pytest.raises(EinshardError, match=r"einshard.plan: search= takes an einshard.planner.SearchOptions"):
        einshard.plan(STEP, PARAMS, BATCH, mesh=MESH, search={"max_evaluations": 4})


def test_the_record_steers_the_search():
    exhaustive = einshard.plan(
        STEP, PARAMS, BATCH, mesh=MESH, profile="h100", verify=0, search=SearchOptions(exhaustive_limit=10**6)
    )
    descent = einshard.plan(
        STEP,
        PARAMS,
        BATCH,
        mesh=MESH,
        profile="h100",
        verify=0,
        search=SearchOptions(exhaustive_limit=0, max_evaluations=1, n_alternatives=1),
    )
    assert exhaustive.method == "exhaustive" and descent.method == "coordinate descent"
    assert exhaustive.evaluated == exhaustive.space > descent.evaluated
    searched = [a for a in descent.alternatives if not a.label.startswith("preset ")]
    assert len(searched) <= 1
    default = einshard.plan(STEP, PARAMS, BATCH, mesh=MESH, profile="h100", verify=0)
    same = einshard.plan(STEP, PARAMS, BATCH, mesh=MESH, profile="h100", verify=0, search=SearchOptions())
    assert (same.rules, same.data_rules, same.time_s, same.evaluated, same.method) == (
        default.rules,
        default.data_rules,
        default.time_s,
        default.evaluated,
        default.method,
    )


def test_a_keyword_named_like_a_knob_reaches_the_step():
    """A step with its own ``seed`` keyword gets it: before SearchOptions the search took it silently."""
    seen = []

    def loss(params, batch, *, seed):  # required: a call without it is a TypeError
        seen.append(jnp.shape(seed))  # (plan traces the keywords like the arguments: a scalar here)
        return jnp.mean((batch @ params["w1"] @ params["w2"]) ** 2) + seed

    einshard.plan(jax.value_and_grad(loss), PARAMS, BATCH, mesh=MESH, verify=0, seed=7)
    assert seen and set(seen) == {()}


def test_a_knob_written_as_a_keyword_names_its_new_home():
    with pytest.raises(EinshardError, match=r"max_evaluations=20 is a search option: pass search=einshard\.planner"):
        einshard.plan(STEP, PARAMS, BATCH, mesh=MESH, max_evaluations=20)


def test_the_steps_own_keywords_still_reach_it():
    base = einshard.plan(STEP, PARAMS, BATCH, mesh=MESH, profile="h100", verify=0)
    scaled = einshard.plan(STEP, PARAMS, BATCH, mesh=MESH, profile="h100", verify=0, scale=2.0)
    assert scaled.rules == base.rules
