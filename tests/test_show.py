"""einshard.show draws layouts of any rank: blocks, devices, copies, and the describe() expression."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import einshard
from einshard._src.drawing import render


def _mesh(sizes: dict[str, int]) -> jax.sharding.Mesh:
    n = int(np.prod(list(sizes.values())))
    return jax.sharding.Mesh(
        np.asarray(jax.devices()[:n]).reshape(tuple(sizes.values())),
        tuple(sizes),
        axis_types=(jax.sharding.AxisType.Auto,) * len(sizes),
    )


def _cells(text: str) -> dict[str, list[str]]:
    """Grid rows: row label -> the cells' device lists."""
    out = {}
    for line in text.splitlines():
        if "│" in line and "─" not in line:
            label, *cells = [c.strip() for c in line.split("│")]
            out[label] = cells
    return out


def _expected_cells(x, rows_dim, cols_dim, names):
    """Ground truth from JAX: which devices hold each (row block, column block)."""
    index_map = x.sharding.devices_indices_map(x.shape)
    want: dict[tuple, list[int]] = {}
    for d, idx in index_map.items():
        r = idx[rows_dim].indices(x.shape[rows_dim])[:2] if rows_dim is not None else None
        c = idx[cols_dim].indices(x.shape[cols_dim])[:2]
        want.setdefault((r, c), []).append(d.id)
    return want


def test_one_dimension_with_copies():
    mesh = _mesh({"x": 2, "y": 4})
    x = einshard.einshard(np.zeros(8, np.float32), "a -> a@x", mesh=mesh)
    text = render(x, names="a")
    assert text.splitlines()[0] == "f32[a:8@x]   'a -> a@x'"
    assert "columns: a (2 blocks)" in text
    assert _cells(text)[""] == ["0-3", "4-7"]
    assert "copies: each block is on 4 devices over y(4); replication groups: {0-3} {4-7}" in text


def test_two_dimensions_match_jax_block_map():
    mesh = _mesh({"data": 4, "model": 2})
    x = einshard.einshard(np.zeros((8, 6), np.float32), "r c -> r@data c@model", mesh=mesh)
    text = render(x, names="r c")
    cells = _cells(text)
    for (r, c), ids in _expected_cells(x, 0, 1, "r c").items():
        col = [0, 3].index(c[0])
        assert cells[f"r {r[0]}:{r[1]}"][col] == " ".join(map(str, sorted(ids)))
    assert "no copies" in text
    assert "each device holds r:2 c:3 (6 elements, 24 B)" in text


def test_three_dimensions_in_user_names():
    mesh = _mesh({"data": 4, "model": 2})
    x = einshard.einshard(np.zeros((8, 16, 32), np.float32), "b s d -> b@data s d@model", mesh=mesh)
    text = render(x, names="b s d -> b@data s d@model")
    assert "'b s d -> b@data s d@model'" in text.splitlines()[0]
    assert "rows: b (4 blocks)   columns: d (2 blocks)   whole on every device: s" in text
    assert _cells(text)["b 2:4"] == ["2", "3"]
    # JAX's own drawing gives up at this rank.
    with pytest.raises(ValueError):
        jax.debug.visualize_array_sharding(x)


def test_four_dimensions_one_grid_per_hidden_block():
    mesh = _mesh({"data": 2, "model": 2, "fsdp": 2})
    x = einshard.einshard(np.zeros((4, 8, 2, 6), np.float32), "b s d e -> b@data s@model d e@fsdp", mesh=mesh)
    text = render(x, dims="d,e", names="b s d e")
    assert "one grid per block of: b, s" in text
    for b in ("0:2", "2:4"):
        for s in ("0:4", "4:8"):
            assert f"b {b}  s {s}:" in text
    # Every device appears exactly once over all grids: 8 blocks, no copies.
    ids = [
        tok for cells in [line.split("│")[1:] for line in text.splitlines() if line.startswith(" d ")] for tok in cells
    ]
    assert sorted(int(t) for t in ids) == list(range(8))


def test_replicated_everywhere_and_abstract_arrays():
    mesh = _mesh({"data": 4, "model": 2})
    abstract = jax.ShapeDtypeStruct((4, 4), np.float32, sharding=einshard.sharding("a b -> a b", (4, 4), mesh=mesh))
    text = render(abstract)
    assert "copies: each block is on 8 devices over data(4) x model(2)" in text
    assert _cells(text)["a 0:4"] == ["0-7"]


def test_count_expression_uses_anonymous_mesh():
    x = einshard.einshard(np.zeros((8, 8), np.float32), "a b -> a4 b*")
    text = render(x)
    assert "(anonymous: from a count expression)" in text
    assert "'a b -> a4 b2'" in text


def test_bad_names_are_clear_errors():
    mesh = _mesh({"data": 8})
    x = einshard.einshard(np.zeros((8, 2), np.float32), "a b -> a@data b", mesh=mesh)
    with pytest.raises(einshard.EinshardError, match="3 axis names .* rank 2"):
        render(x, names="a b c")
    with pytest.raises(einshard.EinshardError, match="not an axis name"):
        render(x, dims="z", names="a b")


def test_show_prints(capsys):
    x = einshard.einshard(np.zeros((8,), np.float32), "a -> a*")
    einshard.show(x)
    assert "f32[a:8@a0]" in capsys.readouterr().out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the command chooses its own device count
    return subprocess.run(
        [sys.executable, "-m", "einshard", "show", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.slow
def test_cli_show():
    out = _cli("b s d -> b@data s d@model", "--shape", "8,16,32", "--mesh", "data=4,model=2")
    assert out.returncode == 0, out.stderr
    assert "f32[b:8@data s:16 d:32@model]" in out.stdout and "b 6:8 │ 6      │ 7" in out.stdout


@pytest.mark.slow
def test_cli_show_error_quotes_the_expression():
    out = _cli("a b -> a@data b", "--shape", "6,4", "--mesh", "data=4")
    assert out.returncode == 2
    assert "a b -> a@data b" in out.stderr and "Pad the axis to 8" in out.stderr
