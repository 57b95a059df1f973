"""Writing einshard rules as logical rules + per-variable names (Flax, MaxText) and reading them back gives the
same layouts, whatever the names collide (issue 24; hypothesis)."""

import jax
import jax.numpy as jnp
from hypothesis import given
from hypothesis import strategies as st

import einshard
from einshard import interop
from einshard._src.interop._leaves import spec_expression

MESH = {"data": 2, "fsdp": 2, "model": 2}


@st.composite
def leaf_layouts(draw):
    """Per leaf: a rank, axis names drawn from a small pool (so that names collide across leaves) and a split."""
    leaves = {}
    for i in range(draw(st.integers(1, 5))):
        rank = draw(st.integers(0, 3))
        names = draw(st.lists(st.sampled_from("xyzw"), min_size=rank, max_size=rank, unique=True))
        free = list(MESH)
        entries = []
        for _ in range(rank):
            k = draw(st.integers(0, min(2, len(free))))
            group = tuple(draw(st.permutations(free))[:k])
            free = [m for m in free if m not in group]
            entries.append(group or None)
        leaves[f"layer{i}/w"] = (rank, spec_expression(entries, rank, names))
    return leaves


@given(leaf_layouts())
def test_to_logical_then_from_logical_gives_the_same_layouts(layouts):
    params = {name: jax.ShapeDtypeStruct((8,) * rank, jnp.float32) for name, (rank, _) in layouts.items()}
    rules = {"^\\['" + name + "'\\]$": text for name, (_, text) in layouts.items()}
    written = interop.to_logical(rules, params, MESH)
    assert len(set(written.axis_rules.names)) == len(written.axis_rules.rules)  # one rule per name
    data = written.maxtext()
    back = interop.from_maxtext(data["logical_axis_rules"], data["logical_axes"], params, mesh=MESH)
    for m in back.leaves:
        want = einshard.spec(layouts[m.leaf.name][1], m.leaf.shape, mesh=MESH)
        assert _padded(m.spec, len(m.leaf.shape)) == _padded(want, len(m.leaf.shape)), (m.leaf.name, m.expression)
    flax_back = interop.from_logical(written.flax_rules(), written.names, params, mesh=MESH, fmt="flax")
    assert [m.spec for m in flax_back.leaves] == [m.spec for m in back.leaves]


def _padded(spec, rank):
    entries = [e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in tuple(spec)]
    return tuple(entries) + (None,) * (rank - len(entries))
