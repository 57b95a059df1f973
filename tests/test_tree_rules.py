"""The one path-rule matcher (einshard/tree_rules.py), against a naive reference, and its errors."""

import re

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from einshard import EinshardError
from einshard._src.tree_rules import UNMATCHED, cache_clear, leaf_expressions

KEYS = ["w1", "w2", "b", "kernel", "bias", "embed"]


def reference(tree, rules):
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = jax.tree_util.keystr(path)
        out.append(next((e for p, e in rules.items() if re.search(p, key)), UNMATCHED))
    return tuple(out)


trees = st.recursive(
    st.just(0), lambda inner: st.dictionaries(st.sampled_from(KEYS), inner, min_size=1, max_size=3), max_leaves=8
)
rule_sets = st.dictionaries(
    st.sampled_from([r"w\d", "w1", "b", r"kernel$", "embed", r"\['b'\]", "^$", "bias"]),
    st.sampled_from(["d f -> d f@model", "... -> ...", None]),
    max_size=4,
)


@given(trees, rule_sets)
def test_first_pattern_found_in_the_path_wins(tree, rules):
    want = reference(tree, rules)
    assert leaf_expressions(tree, rules, unmatched=UNMATCHED) == want
    if UNMATCHED in want:
        with pytest.raises(EinshardError, match="no rule matches the leaf at"):
            leaf_expressions(tree, rules)
    else:
        assert leaf_expressions(tree, rules) == want


def test_one_expression_for_every_leaf():
    assert leaf_expressions({"a": 0, "b": [0, 0]}, "... -> ...") == ("... -> ...",) * 3


@pytest.mark.parametrize(
    "rules, words",
    [({"(": "a -> a"}, "not a valid regular expression"), ({".*": 3}, "is a int"), (["a -> a"], "got list")],
)
def test_bad_rules_name_the_pattern(rules, words):
    with pytest.raises(EinshardError, match=re.escape(words)):
        leaf_expressions({"a": 0}, rules)


def test_repeated_calls_reuse_the_match():
    cache_clear()
    rules = {"w": "d f -> d f@model", ".*": None}
    first = leaf_expressions({"w": 0, "b": 0}, rules)
    assert leaf_expressions({"w": 1, "b": 2}, rules) is first  # same structure: no re-matching
