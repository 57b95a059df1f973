"""einshard.checkpoint on orbax: round trips across layouts and meshes, 2 processes, interrupted saves, errors."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from device_count import device_env, run_pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard import EinshardError, checkpoint, describe, einshard

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
SHAPES = {"emb": (16, 8), "w": (8, 32), "b": (12,), "step": ()}


def host_tree() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    tree = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items() if s}
    tree["step"] = np.int32(5)
    return tree


# The layouts saved: split over one axis, both, and replicated.
SAVED = {r"\['emb'\]": "v d -> v@data d", r"\['w'\]": "d f -> d f@(data,model)", r"\['b'\]": "f -> f@model", ".*": "->"}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], kind: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


def _assert_tree_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def _save_8(tmp_path: pathlib.Path, kind: AxisType = AxisType.Explicit, name: str = "ckpt") -> tuple[str, dict]:
    mesh = _mesh((4, 2), ("data", "model"), kind)
    tree = einshard(host_tree(), SAVED, mesh=mesh)
    path = str(tmp_path / name)
    checkpoint.save(path, tree, meta={"step": 5, "note": "hello"})
    return path, tree


# ---------------------------------------------------------------------------
# Round trips in this process (8 devices)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_round_trip_keeps_expressions_mesh_and_values(tmp_path, kind):
    path, tree = _save_8(tmp_path, kind)
    meta = checkpoint.read_meta(path)
    assert meta["format"] == checkpoint.FORMAT and meta["step"] == 5 and meta["note"] == "hello"
    assert meta["meshes"] == [{"axes": [["data", 4, kind.name], ["model", 2, kind.name]]}]
    by_path = {leaf["path"]: leaf for leaf in meta["leaves"]}
    for key in SHAPES:
        assert by_path[f"['{key}']"]["expression"] == describe(tree[key])  # what describe() reads from the leaf
        assert by_path[f"['{key}']"]["shape"] == list(SHAPES[key])
    assert by_path["['w']"]["expression"] == "a b -> a b@(data,model)"

    back = checkpoint.restore(path)  # no like=, no mesh=: the saved tree on the saved mesh shape
    _assert_tree_equal(back, host_tree())
    for k in SHAPES:
        assert back[k].sharding.is_equivalent_to(tree[k].sharding, len(SHAPES[k])), k
        assert back[k].sharding.mesh.axis_types == (kind, kind)


@pytest.mark.parametrize(
    ("shape", "names", "rules"),
    [
        ((2, 4), ("data", "model"), None),  # the saved expressions on another mesh shape
        ((8,), ("x",), {r"\['emb'\]": "v d -> v d@x", r"\['w'\]": "d f -> d@x f", ".*": "... -> ..."}),
        ((2, 2, 2), ("p", "q", "r"), {r"\['w'\]": "d f -> d@p f@(q,r)", r"\['emb'\]": "v d -> v@(r,p) d", ".*": None}),
    ],
    ids=["2x4-saved", "8-new", "2x2x2-new"],
)
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_restore_onto_other_meshes_and_expressions(tmp_path, shape, names, rules, kind):
    path, _ = _save_8(tmp_path)
    mesh = _mesh(shape, names, kind)
    if rules is not None and rules.get(".*", "") is None:
        # A rule of None keeps the saved expression: it names 'data'/'model', which this mesh lacks.
        with pytest.raises(EinshardError, match=r"at \['b'\] \(shape \(12,\)\): .*mesh axis 'model'"):
            checkpoint.restore(path, host_tree(), expressions=rules, mesh=mesh)
        rules = {**rules, ".*": "... -> ..."}
    back = checkpoint.restore(path, host_tree(), expressions=rules, mesh=mesh)
    _assert_tree_equal(back, host_tree())
    saved = {leaf["path"]: leaf["expression"] for leaf in checkpoint.read_meta(path)["leaves"]}
    for k, leaf in back.items():
        expr = saved[f"['{k}']"] if rules is None else next(e for p, e in rules.items() if re.search(p, f"['{k}']"))
        expected = NamedSharding(mesh, einshard_spec(expr, SHAPES[k], mesh))
        assert leaf.sharding.is_equivalent_to(expected, len(SHAPES[k])), (k, leaf.sharding, expr)


def einshard_spec(expr: str, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    import einshard as es

    return es.spec(expr, shape, mesh=mesh)


def test_restore_under_set_mesh_with_a_tree_of_expressions_and_like_structs(tmp_path):
    path, _ = _save_8(tmp_path)
    mesh = _mesh((2, 4), ("model", "data"), AxisType.Explicit)
    like = {k: jax.ShapeDtypeStruct(s, np.float32 if s else np.int32) for k, s in SHAPES.items()}
    exprs = {"emb": "v d -> v@model d@data", "w": "d f -> d f", "b": "f -> f@data", "step": "->"}
    with jax.set_mesh(mesh):
        back = checkpoint.restore(path, like, expressions=exprs)
    _assert_tree_equal(back, host_tree())
    assert back["emb"].sharding.spec == P("model", "data") and back["emb"].sharding.mesh == mesh
    assert back["b"].sharding.spec == P("data")


def test_like_leaves_with_shardings_are_restored_with_them(tmp_path):
    """orbax's idiom: ShapeDtypeStructs (or live arrays) carrying shardings; expressions= still wins."""
    path, tree = _save_8(tmp_path)
    mesh = _mesh((2, 4), ("x", "y"), AxisType.Auto)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P())) for k, v in tree.items()}
    like["w"] = jax.ShapeDtypeStruct(SHAPES["w"], np.float32, sharding=NamedSharding(mesh, P("y", "x")))
    back = checkpoint.restore(path, like, expressions={"emb": "v d -> v@x d", ".*": None}, mesh=mesh)
    _assert_tree_equal(back, host_tree())
    assert back["w"].sharding == like["w"].sharding  # from like
    assert back["emb"].sharding.spec == P("x", None)  # from expressions=, over like's replicated sharding
    assert back["b"].sharding.is_fully_replicated and back["b"].sharding.mesh == mesh
    live = checkpoint.restore(path, back)  # live arrays as like: their layouts
    assert all(live[k].sharding == back[k].sharding for k in SHAPES)


def test_restore_casts_to_the_dtype_of_like(tmp_path):
    path, _ = _save_8(tmp_path)
    like = {**host_tree(), "w": jax.ShapeDtypeStruct(SHAPES["w"], jax.numpy.bfloat16)}
    back = checkpoint.restore(path, like)
    assert back["w"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(back["w"]), host_tree()["w"].astype(jax.numpy.bfloat16))


def test_nested_tree_with_optax_state_and_count_layouts(tmp_path):
    optax = pytest.importorskip("optax")
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Auto)
    params = einshard(
        {"w": host_tree()["w"], "b": host_tree()["b"]}, {"w": "d f -> d@data f", "b": "f -> f@model"}, mesh=mesh
    )
    opt = optax.adam(1e-3).init(params)
    counts = einshard(np.ones((8, 4), np.float32), "a b -> a4 b2")  # an anonymous (count) mesh
    state = {"params": params, "opt": opt, "counts": counts}
    path = tmp_path / "nested"
    checkpoint.save(path, state)
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    back = checkpoint.restore(path, like)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(b.sharding, NamedSharding):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        else:  # optax's step count sits on one device: saved as '->', restored replicated
            assert a.sharding.is_fully_replicated
    assert describe(back["counts"]) == "a b -> a4 b2"


def test_async_save_returns_a_handle(tmp_path):
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    tree = einshard(host_tree(), SAVED, mesh=mesh)
    handle = checkpoint.save(tmp_path / "async", tree, blocking=False)
    handle.wait_until_finished()
    assert handle.done() and "done" in repr(handle)
    handle.wait_until_finished()  # a second wait is a no-op
    _assert_tree_equal(checkpoint.restore(tmp_path / "async"), host_tree())


def test_overwrite_replaces_atomically_and_a_half_swap_still_restores(tmp_path):
    path, tree = _save_8(tmp_path)
    doubled = jax.tree.map(lambda x: x * 2, tree)
    with pytest.raises(EinshardError, match="(?s)a checkpoint already exists at .*overwrite=True"):
        checkpoint.save(path, doubled)
    checkpoint.save(path, doubled, overwrite=True)
    _assert_tree_equal(checkpoint.restore(path), jax.tree.map(lambda x: x * 2, host_tree()))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing staged or set aside is left behind
    # In the background: the old checkpoint stays in place until wait_until_finished() swaps the new one in.
    handle = checkpoint.save(path, jax.tree.map(lambda x: x * 3, tree), overwrite=True, blocking=False)
    _assert_tree_equal(checkpoint.restore(path), jax.tree.map(lambda x: x * 2, host_tree()))
    handle.wait_until_finished()
    _assert_tree_equal(checkpoint.restore(path), jax.tree.map(lambda x: x * 3, host_tree()))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    # A crash between the swap's two renames leaves the previous checkpoint aside: it restores.
    os.rename(path, path + ".einshard-previous")
    _assert_tree_equal(checkpoint.restore(path), jax.tree.map(lambda x: x * 3, host_tree()))


def test_expressions_given_to_save_must_describe_the_leaves(tmp_path):
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    tree = einshard(host_tree(), SAVED, mesh=mesh)
    checkpoint.save(tmp_path / "named", tree, SAVED)  # the rules it was placed with
    assert checkpoint.read_meta(tmp_path / "named")["leaves"][1]["expression"] == "v d -> v@data d"
    with pytest.raises(EinshardError, match=r"at \['emb'\]: the expression 'v d -> v d@data' lays the leaf out as"):
        checkpoint.save(
            tmp_path / "wrong", tree, {"emb": "v d -> v d@data", ".*": None, "w": "d f -> d f@(data,model)"}
        )
    assert not (tmp_path / "wrong").exists()


# ---------------------------------------------------------------------------
# The format before orbax


def test_old_npz_checkpoints_still_restore(tmp_path):
    """A file of format einshard-checkpoint/1 (einshard <= 0.3: gathered arrays in one .npz) restores as before."""
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    data = host_tree()
    leaves = [
        {"key": f"leaf_{i}", "path": f"['{k}']", "expression": "... -> ...", "shape": list(np.shape(v)), "dtype": "f"}
        for i, (k, v) in enumerate(sorted(data.items()))
    ]
    header = {"format": "einshard-checkpoint/1", "leaves": leaves, "step": 3}
    arrays = {e["key"]: data[k] for e, k in zip(leaves, sorted(data))}
    path = tmp_path / "old.npz"
    np.savez(path, __einshard__=np.array(json.dumps(header)), **arrays)
    assert checkpoint.read_meta(path)["step"] == 3
    back = checkpoint.restore(path, data, expressions={"emb": "v d -> v@data d", ".*": None}, mesh=mesh)
    _assert_tree_equal(back, data)
    assert back["emb"].sharding.spec == P("data", None) and back["w"].sharding.is_fully_replicated


# ---------------------------------------------------------------------------
# Errors


def test_missing_and_foreign_paths(tmp_path):
    with pytest.raises(EinshardError, match=r"there is no checkpoint at '.*nowhere'"):
        checkpoint.restore(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EinshardError, match=r"'.*empty' is not a complete einshard checkpoint"):
        checkpoint.read_meta(tmp_path / "empty")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(EinshardError, match=r"'.*text.npz' is not an einshard checkpoint"):
        checkpoint.restore(tmp_path / "text.npz")


def test_plain_orbax_checkpoint_and_damaged_metadata(tmp_path):
    import orbax.checkpoint as ocp

    ck = ocp.StandardCheckpointer()
    ck.save(tmp_path / "plain", {"a": np.ones(4)})
    ck.wait_until_finished()
    ck.close()
    with pytest.raises(EinshardError, match="an orbax checkpoint without an einshard header"):
        checkpoint.restore(tmp_path / "plain")
    path, _ = _save_8(tmp_path)
    (pathlib.Path(path) / "_CHECKPOINT_METADATA").write_text("{broken")
    with pytest.raises(EinshardError, match=r"ckpt': the checkpoint's metadata file is damaged"):
        checkpoint.restore(path)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned read coroutines
@pytest.mark.parametrize("damage", ["garbage", "truncated", "deleted"])
def test_damaged_array_files_name_the_checkpoint(tmp_path, damage):
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    big = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)  # too big to inline in the index
    checkpoint.save(tmp_path / "big", {"a": einshard(big, "a b -> a@data b", mesh=mesh)})
    files = [f for f in (tmp_path / "big").rglob("*") if f.is_file() and "ocdbt.process_" in str(f)]
    largest = max(files, key=lambda f: f.stat().st_size)
    if damage == "garbage":
        largest.write_bytes(b"x" * largest.stat().st_size)
    elif damage == "truncated":
        largest.write_bytes(largest.read_bytes()[:1000])
    else:
        largest.unlink()
    name = re.escape(largest.relative_to(tmp_path / "big").as_posix())
    with pytest.raises(EinshardError, match=rf"checkpoint '.*big' is damaged: {name} \((missing|.*differs|\d+ bytes)"):
        checkpoint.restore(tmp_path / "big")
    # Unverified, orbax's own failure still becomes an EinshardError naming the checkpoint.
    with pytest.raises(EinshardError, match=r"cannot restore the checkpoint at '.*big', its files are damaged"):
        checkpoint.restore(tmp_path / "big", verify=False)


def test_tree_paths_that_differ_are_named(tmp_path):
    path, _ = _save_8(tmp_path)
    like = {**host_tree(), "extra": np.zeros(3)}
    del like["b"]
    with pytest.raises(EinshardError) as err:
        checkpoint.restore(path, like)
    assert "the checkpoint has no leaf ['extra']" in str(err.value)
    assert "it holds ['b'], which the target tree lacks" in str(err.value)
    with pytest.raises(
        EinshardError, match=r"checkpoint leaf \['w'\] has shape \(8, 32\), but the target tree expects \(8, 16\)"
    ):
        checkpoint.restore(path, {**host_tree(), "w": np.zeros((8, 16))})


def test_layouts_that_do_not_fit_name_leaf_axis_and_sizes(tmp_path):
    path, _ = _save_8(tmp_path)
    mesh = _mesh((8,), ("data",), AxisType.Explicit)
    with pytest.raises(EinshardError, match=r"at \['b'\] \(shape \(12,\)\): .*'model'"):
        checkpoint.restore(path, mesh=mesh)  # the saved 'f -> f@model' on a mesh without 'model'
    with pytest.raises(EinshardError, match=r"at \['b'\] \(shape \(12,\)\): axis 'f' has size 12.*@data\(8\)"):
        checkpoint.restore(path, expressions={"b": "f -> f@data", ".*": "... -> ..."}, mesh=mesh)


def test_bad_meta_is_refused_before_writing(tmp_path):
    tree = {"w": einshard(np.ones((8, 8), np.float32), "a b -> a* b")}
    with pytest.raises(EinshardError, match=r"meta keys \['leaves'\] are reserved"):
        checkpoint.save(tmp_path / "a", tree, meta={"leaves": 1})
    with pytest.raises(EinshardError, match="meta must be JSON-serialisable"):
        checkpoint.save(tmp_path / "b", tree, meta={"when": object()})
    with pytest.raises(EinshardError, match="the tree has no leaves"):
        checkpoint.save(tmp_path / "c", {})
    assert not any(tmp_path.iterdir())


def test_imports_without_orbax_and_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import orbax.checkpoint now raises ImportError
    monkeypatch.setitem(sys.modules, "orbax", None)
    with pytest.raises(EinshardError, match=r"pip install 'einshard\[checkpoint\]'"):
        checkpoint.save(tmp_path / "x", {"w": np.ones(2)})
    code = "import sys; sys.modules['orbax'] = None; import einshard.checkpoint, einshard; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=device_env(1), cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


# ---------------------------------------------------------------------------
# Other device counts (a subprocess each)


@pytest.mark.slow
def test_restore_on_one_device_and_on_four(tmp_path):
    """Saved over 8 devices, restored by a run that has 1 (or 4): with mesh=, and refused without it."""
    if jax.device_count() == 8:
        path, _ = _save_8(tmp_path)
        for n in (1, 4):
            run_pytest(n, f"{__file__}::test_restore_on_one_device_and_on_four", EINSHARD_TEST_CKPT=path)
        return
    path = os.environ["EINSHARD_TEST_CKPT"]
    n = jax.device_count()
    with pytest.raises(
        EinshardError, match=rf"saved on the mesh \('data': 4, 'model': 2\) of 8 devices, but this run has {n}"
    ):
        checkpoint.restore(path)
    mesh = _mesh((n, 1), ("data", "model"), AxisType.Explicit)
    rules = {"emb": "v d -> v@data d", "w": "d f -> d f@data", ".*": "... -> ..."}
    back = checkpoint.restore(path, expressions=rules, mesh=mesh)
    _assert_tree_equal(back, host_tree())
    assert back["w"].sharding.shard_shape(SHAPES["w"]) == (8, 32 // n)


# ---------------------------------------------------------------------------
# Two real processes (jax.distributed, 2 x 4 CPU devices)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(mode: str, path: pathlib.Path, logs: pathlib.Path) -> list[dict]:
    worker = HERE / "checkpoint_worker.py"
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    procs = []
    for pid in range(2):
        out = open(logs / f"{mode}{pid}.out", "w")  # files, not pipes: no pipe can fill and block
        cmd = [sys.executable, str(worker), "--port", str(port), "--process-id", str(pid), "--mode", mode]
        procs.append(subprocess.Popen([*cmd, "--path", str(path)], stdout=out, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [(logs / f"{mode}{pid}.out").read_text() for pid in range(2)]
    assert all(p.returncode == 0 for p in procs), "\n".join(t[-3000:] for t in texts)
    prefix = "EINSHARD_RESULT "
    return [json.loads(next(line[len(prefix) :] for line in t.splitlines() if line.startswith(prefix))) for t in texts]


def _worker_module():
    spec = importlib.util.spec_from_file_location("checkpoint_worker", HERE / "checkpoint_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_two_processes_save_own_shards_and_restore_anywhere(tmp_path):
    worker = _worker_module()
    path = tmp_path / "two"
    saved = _two_processes("save", path, tmp_path)
    data = worker.global_data()
    total = sum(v.nbytes for v in data.values())
    # Each process wrote into its own OCDBT database, no more than the shards its devices hold,
    # and together one copy of everything (zstd shrinks random float32 by under 15%).
    written = [sum(f.stat().st_size for f in (path / f"ocdbt.process_{p}").rglob("*") if f.is_file()) for p in (0, 1)]
    for p, result in enumerate(saved):
        held = {k: _held_bytes(k, p) for k in data}  # distinct shards on this process's devices
        assert 0 < written[p] <= sum(held.values()) + 4096, (p, written, held)
        assert written[p] < 0.8 * total, (p, written, total)
        assert sum(result["own_bytes"].values()) <= sum(held.values())
    assert 0.85 * total <= sum(written) <= total + 8192, (written, total)
    assert sorted(os.listdir(path / "array_metadatas")) == ["process_0", "process_1"]
    assert not list(tmp_path.glob("two.*"))  # the overwrite's staged and previous checkpoints are gone

    restored = _two_processes("restore", path, tmp_path)
    for r in restored:
        assert r["step"] == 7
        assert r["saved_specs"] == {k: _spec_text(e) for k, (_, e) in worker.SAVED.items()}
        for k, s in r["sums"].items():
            assert s == pytest.approx(float(data[k].sum()), rel=1e-5, abs=1e-3), k
    assert restored[0]["sums"] == restored[1]["sums"]

    # One process with 8 devices reads the 2-process checkpoint: the saved mesh shape, or new layouts.
    back = checkpoint.restore(path)
    _assert_tree_equal(back, data)
    assert back["both"].sharding.spec == P(("data", "model"), None)
    mesh = _mesh((4, 2), ("rows", "cols"), AxisType.Auto)
    moved = checkpoint.restore(path, expressions=worker.NEW, mesh=mesh)
    _assert_tree_equal(moved, data)


def _held_bytes(name: str, process: int) -> int:
    """Bytes of the distinct shards of ``name`` on ``process``'s 4 devices under the worker's saved layout."""
    worker = _worker_module()
    shape, expr = worker.SAVED[name]
    mesh = _mesh((2, 4), ("data", "model"), AxisType.Explicit)
    sh = NamedSharding(mesh, einshard_spec(expr, shape, mesh))
    mine = list(mesh.devices[process])  # mesh row i plays process i, as in the worker
    index = sh.devices_indices_map(shape)
    distinct = {tuple((s.start, s.stop) for s in index[d]) for d in mine}
    return sum(4 * int(np.prod([(b or n) - (a or 0) for (a, b), n in zip(k, shape)])) for k in distinct)


def _spec_text(expr: str) -> str:
    mesh = _mesh((2, 4), ("data", "model"), AxisType.Explicit)
    worker = _worker_module()
    shape = next(s for s, e in worker.SAVED.values() if e == expr)
    return str(tuple(einshard_spec(expr, shape, mesh)))


# ---------------------------------------------------------------------------
# A save killed midway


KILLED_SAVE = textwrap.dedent(
    """
    import sys, numpy as np, jax
    from einshard import checkpoint, einshard
    path, mode = sys.argv[1], sys.argv[2]
    mesh = jax.make_mesh((4, 2), ('data', 'model'))
    rows = 2048 if mode == 'first' else 32768
    big = {'w': einshard(np.full((rows, 1024), 1.0 if mode == 'first' else 2.0, np.float32) +
                         np.random.default_rng(0).standard_normal((rows, 1024)).astype(np.float32),
                         'a b -> a@data b@model', mesh=mesh)}
    print('saving', flush=True)
    checkpoint.save(path + ('/step_2' if mode == 'next' else '/step_1'), big, overwrite=(mode == 'overwrite'),
                    meta={'mode': mode})
    print('saved', flush=True)
    """
)


def _wait_for_partial_write(parent: pathlib.Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Bytes in orbax's temporary directory once more than 1 MiB of array data has reached it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for tmp in parent.glob("*orbax-checkpoint-tmp*"):
            try:
                size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            except OSError:  # renamed or replaced while we looked
                continue
            if size > 1 << 20:
                return size
        time.sleep(0.02)
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["next", "overwrite"])
def test_a_killed_save_leaves_the_previous_checkpoint_restorable(tmp_path, mode):
    """SIGKILL a 128 MiB save (into a new step, or overwriting): the previous checkpoint restores whole."""
    env = device_env(8, PYTHONPATH=str(ROOT))
    script = tmp_path / "save.py"
    script.write_text(KILLED_SAVE)
    first = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "first"], env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr[-3000:]
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), mode], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "saving"
    written = _wait_for_partial_write(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    rest = proc.communicate(timeout=60)[0]
    assert "saved" not in rest, "the save finished before it was killed: make it bigger"
    assert written > 1 << 20  # killed mid-write: part of the 128 MiB is on disk, in orbax's temporary directory
    # Nothing under the real name of the unfinished save: it does not restore at all, half or whole.
    assert not (tmp_path / "step_2").exists()
    with pytest.raises(EinshardError, match="there is no checkpoint at"):
        checkpoint.restore(tmp_path / "step_2")
    for leftover in tmp_path.glob("*orbax-checkpoint-tmp*"):  # nor does orbax's temporary directory
        with pytest.raises(EinshardError, match="is not a complete einshard checkpoint"):
            checkpoint.restore(leftover)
    back = checkpoint.restore(tmp_path / "step_1")
    assert checkpoint.read_meta(tmp_path / "step_1")["mode"] == "first"
    rng = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.float32(1.0) + rng)
    # The next save over the same path cleans up what the killed one left.
    tree = {"w": einshard(np.zeros((8, 8), np.float32), "a b -> a b")}
    checkpoint.save(tmp_path / "step_1", tree, overwrite=True)
    np.testing.assert_array_equal(np.asarray(checkpoint.restore(tmp_path / "step_1")["w"]), 0)
    shutil.rmtree(tmp_path / "step_1")


# ---------------------------------------------------------------------------
# Never lose, mix or hang: concurrent writers, colliding names, damaged files, a full disk, interrupted swaps


def _small_tree(value: float) -> dict:
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    rows = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    return {"w": einshard(rows + value, "a b -> a@data b@model", mesh=mesh), "step": np.int32(value)}


def _values(tree: dict) -> dict:
    return {k: np.asarray(v) for k, v in tree.items()}


def test_saves_from_several_threads_to_separate_paths(tmp_path):
    import threading

    trees = [_small_tree(i) for i in range(6)]
    errors: list[BaseException] = []

    def save(i: int) -> None:
        try:
            checkpoint.save(tmp_path / f"t{i}", trees[i], meta={"i": i})
        except BaseException as err:  # collected: the assertion below shows it
            errors.append(err)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(len(trees))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a save hung"
    assert errors == []
    for i, tree in enumerate(trees):
        _assert_tree_equal(checkpoint.restore(tmp_path / f"t{i}"), _values(tree))
    assert sorted(os.listdir(tmp_path)) == sorted(f"t{i}" for i in range(len(trees)))  # no lock or staging left


def test_a_second_writer_to_one_path_is_refused_at_once(tmp_path):
    path = tmp_path / "ckpt"
    first = checkpoint.save(path, _small_tree(1), blocking=False)  # holds the path's lock until it finishes
    start = time.monotonic()
    with pytest.raises(
        EinshardError,
        match=r"another save is writing the checkpoint at '.*ckpt': thread '.*' of "
        r"this process on host .* holds '.*ckpt.einshard-lock'",
    ):
        checkpoint.save(path, _small_tree(2), overwrite=True)
    assert time.monotonic() - start < 5
    first.wait_until_finished()
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(1)))
    checkpoint.save(path, _small_tree(3), overwrite=True)  # the lock is free again
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(3)))


def test_racing_threads_on_one_path_never_mix_or_hang(tmp_path):
    import threading

    path = tmp_path / "ckpt"
    checkpoint.save(path, _small_tree(0))
    outcome: dict[int, str] = {}

    def save(i: int) -> None:
        try:
            checkpoint.save(path, _small_tree(i), overwrite=True)
            outcome[i] = "saved"
        except EinshardError as err:
            outcome[i] = "refused" if "another save is writing" in str(err) else f"error: {err}"

    for _ in range(3):
        threads = [threading.Thread(target=save, args=(i,)) for i in (1, 2, 3, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a save hung"
        assert set(outcome.values()) <= {"saved", "refused"}, outcome
        saved = [i for i, o in outcome.items() if o == "saved"]
        assert saved
        back = checkpoint.restore(path)
        assert int(back["step"]) in saved
        _assert_tree_equal(back, _values(_small_tree(int(back["step"]))))  # whole, never a mix
        outcome.clear()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_lock_file_left_by_a_dead_writer_does_not_block(tmp_path):
    path = tmp_path / "ckpt"
    (tmp_path / "ckpt.einshard-lock").write_text('{"pid": 999999999, "host": "gone", "since": 0}')
    checkpoint.save(path, _small_tree(1))  # flock died with its owner: the file alone holds nothing
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(1)))


@pytest.mark.parametrize(
    "tree, shown",
    [
        ({"a.b": np.ones(2), "a": {"b": np.zeros(2)}}, (r"\['a'\]\['b'\]", r"\['a.b'\]", "'a.b'")),
        ({"layer.0": np.ones(2), "layer": [np.zeros(2)]}, (r"\['layer'\]\[0\]", r"\['layer.0'\]", "'layer.0'")),
    ],
    ids=["dotted-key", "dotted-index"],
)
def test_leaf_paths_that_orbax_would_store_under_one_name_are_refused(tmp_path, tree, shown):
    with pytest.raises(EinshardError, match="would be stored under the same name") as err:
        checkpoint.save(tmp_path / "c", tree)
    for part in shown:
        assert re.search(part, str(err.value)), (part, str(err.value))
    assert not (tmp_path / "c").exists()
    assert sorted(os.listdir(tmp_path)) == []


def _stored_files(path: pathlib.Path) -> list[pathlib.Path]:
    return sorted(f for f in path.rglob("*") if f.is_file())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned read coroutines
@pytest.mark.parametrize("damage", ["bit-flip", "truncation"])
def test_damage_to_any_stored_file_is_found(tmp_path, damage):
    """Every file of the checkpoint, flipped or truncated in turn: never a silent restore."""
    path = tmp_path / "ckpt"
    checkpoint.save(path, _small_tree(7), meta={"step": 7})
    pristine = {f: f.read_bytes() for f in _stored_files(path)}
    assert any(f.name == "einshard-checksums.json" for f in pristine)
    rng = np.random.default_rng(0 if damage == "bit-flip" else 1)
    for file, data in pristine.items():
        if damage == "bit-flip":
            damaged = bytearray(data)
            at = int(rng.integers(len(data)))
            damaged[at] ^= 1 << int(rng.integers(8))
            file.write_bytes(bytes(damaged))
        else:
            file.write_bytes(data[: int(rng.integers(len(data)))])
        name = file.relative_to(path).as_posix()
        with pytest.raises(EinshardError) as err:
            checkpoint.restore(path)
        assert "ckpt" in str(err.value), (name, str(err.value))
        if name != "einshard-checksums.json":
            assert name in str(err.value) or "metadata" in str(err.value), (name, str(err.value))
        file.write_bytes(data)
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(7)))


def test_a_flipped_bit_in_array_data_names_the_leaf_and_the_file(tmp_path):
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    big = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)  # compresses, so a flip changes a value
    checkpoint.save(tmp_path / "c", {"w": einshard(big, "a b -> a@data b", mesh=mesh), "b": np.ones(3, np.float32)})
    largest = max(_stored_files(tmp_path / "c"), key=lambda f: f.stat().st_size)
    name = largest.relative_to(tmp_path / "c").as_posix()
    pristine = largest.read_bytes()
    named_leaf = 0
    for at in range(len(pristine) // 8, len(pristine), len(pristine) // 8):  # where the flip lands decides
        damaged = bytearray(pristine)  # whether the data still decode (to wrong values) or not
        damaged[at] ^= 4
        largest.write_bytes(bytes(damaged))
        with pytest.raises(EinshardError) as err:
            checkpoint.restore(tmp_path / "c")
        text = str(err.value)
        assert f"is damaged: {name} (its sha256 differs" in text
        named_leaf += "the values of ['w'] read from them are wrong" in text
    assert named_leaf, "no flip decoded to wrong values: the leaf was never named"
    largest.write_bytes(pristine)
    np.testing.assert_array_equal(np.asarray(checkpoint.restore(tmp_path / "c")["w"]), big)


def test_value_digests_do_not_depend_on_the_layout():
    from einshard._src.checkpoint import _integrity

    x = np.random.default_rng(0).standard_normal((16, 24)).astype(np.float32)
    mesh = _mesh((4, 2), ("data", "model"), AxisType.Explicit)
    layouts = [
        x,
        einshard(x, "a b -> a@data b@model", mesh=mesh),
        einshard(x, "a b -> b a", mesh=mesh),
        einshard(x, "a b -> a b*"),
    ]
    digests = _integrity.finish_digests(_integrity.start_digests(layouts))
    assert len(set(digests)) == 1
    for i in (0, 17, 383):  # one flipped bit anywhere changes it
        flipped = x.copy().view(np.uint32)
        flipped.flat[i] ^= 1 << (i % 32)
        assert _integrity.finish_digests(_integrity.start_digests([flipped.view(np.float32)]))[0] != digests[0]
    for dtype in (np.int8, np.uint16, np.bool_, np.complex64, "bfloat16"):
        assert _integrity.finish_digests(_integrity.start_digests([np.ones((3, 5), dtype)]))[0] is not None


@settings(max_examples=8)
@given(
    rows=st.sampled_from([4, 8, 12]),
    cols=st.sampled_from([2, 6, 16]),
    dtype=st.sampled_from(["float32", "bfloat16", "int8", "uint16", "bool", "complex64"]),
    layout=st.sampled_from(["a b -> a@data b", "a b -> a b@model", "a b -> a@(data,model) b", "a b -> a b"]),
    seed=st.integers(0, 2**16),
)
def test_digest_is_the_same_for_every_layout_and_changes_with_any_one_bit(rows, cols, dtype, layout, seed):
    """Property: the digest of a laid-out array equals the host array's; one flipped bit changes it."""
    from einshard._src.checkpoint import _integrity

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=rows * cols * np.dtype(jax.numpy.dtype(dtype)).itemsize, dtype=np.uint8)
    host = raw.view(jax.numpy.dtype(dtype)).reshape(rows, cols) if dtype != "bool" else raw.reshape(rows, cols) > 127
    mesh = _mesh((2, 2), ("data", "model"), AxisType.Explicit)
    try:
        placed = einshard(host, layout, mesh=mesh)
    except EinshardError:
        return  # the layout does not divide this shape
    want, got = _integrity.finish_digests(_integrity.start_digests([host, placed]))
    assert want == got is not None
    flipped = bytearray(host.tobytes())
    at = int(rng.integers(len(flipped)))
    flipped[at] ^= 1 << (0 if dtype == "bool" else int(rng.integers(8)))
    other = np.frombuffer(bytes(flipped), host.dtype).reshape(host.shape)
    assert _integrity.finish_digests(_integrity.start_digests([other]))[0] != want


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's abandoned write futures
@pytest.mark.parametrize("where", ["orbax-metadata", "checksums"])
def test_a_full_disk_leaves_the_previous_checkpoint_and_no_staging(tmp_path, monkeypatch, where):
    import errno

    from etils import epath

    from einshard._src.checkpoint import _integrity

    path = tmp_path / "ckpt"
    checkpoint.save(path, _small_tree(1))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "orbax-metadata":
        monkeypatch.setattr(epath.Path, "write_text", full)
    else:
        monkeypatch.setattr(_integrity, "write_manifest", full)
    with pytest.raises(EinshardError, match=r"cannot save the checkpoint at '.*ckpt': the disk is full"):
        checkpoint.save(path, _small_tree(2), overwrite=True)
    with pytest.raises(EinshardError, match="the disk is full"):
        checkpoint.save(tmp_path / "new", _small_tree(2))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # staging, orbax's temporary directory and the lock: gone
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(1)))
    checkpoint.save(path, _small_tree(3), overwrite=True)
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(3)))


def _leftovers(tmp_path: pathlib.Path, state: str) -> pathlib.Path:
    """A checkpoint directory as an interrupted save or swap leaves it (old = step 1, new = step 2)."""
    path = tmp_path / "ckpt"
    checkpoint.save(path, _small_tree(1))
    checkpoint.save(tmp_path / "new", _small_tree(2))
    previous, staged = tmp_path / "ckpt.einshard-previous", tmp_path / "ckpt.einshard-next"
    if state == "after-first-rename":  # PATH -> previous done, next -> PATH not yet
        os.rename(path, previous)
        os.rename(tmp_path / "new", staged)
    elif state == "staged-incomplete":  # PATH -> previous done, the staged save had not finished
        os.rename(path, previous)
        os.rename(tmp_path / "new", staged)
        (staged / "einshard-checksums.json").unlink()
    elif state == "after-second-rename":  # previous not removed yet
        os.rename(path, previous)
        os.rename(tmp_path / "new", path)
    elif state == "stale-staging":  # a save killed while writing
        os.rename(tmp_path / "new", staged)
        (staged / "einshard-checksums.json").unlink()
        (tmp_path / "ckpt.einshard-next.orbax-checkpoint-tmp-1234").mkdir()
    return path


@pytest.mark.parametrize(
    "state, step",
    [("after-first-rename", 2), ("staged-incomplete", 1), ("after-second-rename", 2), ("stale-staging", 1)],
)
@pytest.mark.parametrize("by", ["restore", "save"])
def test_leftovers_of_an_interrupted_swap_are_recovered(tmp_path, state, step, by):
    path = _leftovers(tmp_path, state)
    if by == "restore":
        _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(step)))
    else:
        with pytest.raises(EinshardError, match="a checkpoint already exists"):  # recovered first, so it exists
            checkpoint.save(path, _small_tree(9))
        _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(step)))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# ---------------------------------------------------------------------------
# kill -9 at random points of save and of the overwrite swap; concurrent writer processes (subprocesses)

WRITER = textwrap.dedent(
    """
    import os, signal, shutil, sys, time
    import numpy as np, jax
    from einshard import EinshardError, checkpoint, einshard
    from einshard._src.checkpoint import _guard
    path, first, count, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mesh = jax.make_mesh((4, 2), ('data', 'model'))

    def tree(i):
        rows = np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + i
        return {'w': einshard(rows, 'a b -> a@data b@model', mesh=mesh), 'step': np.int32(i)}

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    renames = []
    real_rename, real_rmtree = os.rename, shutil.rmtree
    def rename(src, dst):  # the swap's renames: kill after the n-th
        real_rename(src, dst)
        if not str(dst).endswith(('/ckpt', '/ckpt.einshard-previous')):
            return  # orbax's own renames inside the staging directory
        renames.append(dst)
        if kill_at == f'after-rename-{len(renames)}':
            die()
    def rmtree(p, *a, **k):
        if kill_at == 'removing-previous' and str(p).endswith('.einshard-previous') and os.path.exists(p):
            real_rmtree(os.path.join(p, 'd'), ignore_errors=True)  # half removed, then killed
            die()
        return real_rmtree(p, *a, **k)
    if kill_at.startswith('after-rename') or kill_at == 'removing-previous':
        _guard.os.rename, _guard.shutil.rmtree = rename, rmtree
    if kill_at == 'before-swap':
        _guard.swap_in = die
    for i in range(first, first + count):
        try:
            checkpoint.save(path, tree(i), overwrite=True, meta={'i': i})
            print('saved', i, flush=True)
        except EinshardError as err:
            print('refused' if 'another save is writing' in str(err) else f'error {err!r}', i, flush=True)
    """
)


def _writer(tmp_path: pathlib.Path, first: int, count: int, kill_at: str = "none") -> subprocess.Popen:
    script = tmp_path / "writer.py"
    if not script.exists():
        script.write_text(WRITER)
    env = device_env(8, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(script), str(tmp_path / "ckpt"), str(first), str(count), kill_at]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _writer_tree(i: int) -> dict:
    return {"w": np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + i, "step": np.int32(i)}


def _restores_whole(path: pathlib.Path, allowed: set[int]) -> int:
    back = checkpoint.restore(path)
    step = int(back["step"])
    assert step in allowed, (step, allowed)
    _assert_tree_equal(back, _writer_tree(step))  # whole, never a mix of two saves
    return step


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_at, step",
    [("before-swap", 0), ("after-rename-1", 1), ("after-rename-2", 1), ("removing-previous", 1)],
)
def test_a_save_killed_inside_the_overwrite_swap_keeps_a_whole_checkpoint(tmp_path, kill_at, step):
    checkpoint.save(tmp_path / "ckpt", jax.tree.map(np.asarray, _writer_tree(0)))
    proc = _writer(tmp_path, 1, 1, kill_at)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (out, err[-3000:])
    # The first reader recovers the right one: the new checkpoint once it was complete, else the old.
    assert _restores_whole(tmp_path / "ckpt", {step}) == step
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "writer.py"]
    checkpoint.save(tmp_path / "ckpt", jax.tree.map(np.asarray, _writer_tree(5)), overwrite=True)
    assert _restores_whole(tmp_path / "ckpt", {5}) == 5


@pytest.mark.slow
def test_saves_killed_at_random_points_always_leave_a_whole_checkpoint(tmp_path):
    rng = np.random.default_rng(25)
    checkpoint.save(tmp_path / "ckpt", jax.tree.map(np.asarray, _writer_tree(0)))
    last = 0
    for trial in range(6):
        first = 100 * (trial + 1)
        proc = _writer(tmp_path, first, 50)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the first save is done: JAX is up, the loop is running
        assert line.startswith("saved"), (line, proc.stderr.read() if proc.stderr else "")
        time.sleep(float(rng.uniform(0, 0.5)))
        proc.send_signal(signal.SIGKILL)
        rest = proc.communicate(timeout=60)[0]
        saved = [int(line.split()[1]) for line in [line, *rest.splitlines()] if line.startswith("saved")]
        # The checkpoint is the last save reported, or the one after it (complete, killed before it printed).
        last = _restores_whole(tmp_path / "ckpt", {saved[-1], saved[-1] + 1})
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "writer.py"]
    assert last >= 600


@pytest.mark.slow
def test_two_writer_processes_on_one_path_never_mix_or_hang(tmp_path):
    checkpoint.save(tmp_path / "ckpt", jax.tree.map(np.asarray, _writer_tree(0)))
    procs = [_writer(tmp_path, 1000 * (k + 1), 15) for k in range(2)]
    outcomes: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        outcomes += out.splitlines()
    kinds = {line.split()[0] for line in outcomes}
    assert kinds <= {"saved", "refused"}, outcomes
    saved = {int(line.split()[1]) for line in outcomes if line.startswith("saved")}
    assert saved
    _restores_whole(tmp_path / "ckpt", saved)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "writer.py"]


FILE_SIZE_LIMITED = textwrap.dedent(
    """
    import os, resource, signal, sys
    import numpy as np, jax
    from einshard import EinshardError, checkpoint, einshard
    path = sys.argv[1]
    mesh = jax.make_mesh((4, 2), ('data', 'model'))
    # Past 100 kB every write fails inside tensorstore (EFBIG, as ENOSPC would), not in Python we could patch.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    big = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    try:
        checkpoint.save(path, {'w': einshard(big, 'a b -> a@data b', mesh=mesh)}, overwrite=True)
    except EinshardError as err:
        print('refused:', err, flush=True)
    """
)


@pytest.mark.slow
def test_a_write_failing_inside_tensorstore_leaves_the_previous_checkpoint(tmp_path):
    checkpoint.save(tmp_path / "ckpt", {"w": np.zeros((8, 8), np.float32)})
    script = tmp_path / "limited.py"
    script.write_text(FILE_SIZE_LIMITED)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        env=device_env(8, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"refused: cannot save the checkpoint at '.*ckpt': a file size limit was hit \(.*File too large", proc.stdout
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "limited.py"]
    np.testing.assert_array_equal(np.asarray(checkpoint.restore(tmp_path / "ckpt")["w"]), 0)


def test_an_interrupt_during_a_save_stays_an_interrupt_and_cleans_up(tmp_path, monkeypatch):
    from einshard._src.checkpoint import _integrity

    path = tmp_path / "ckpt"
    checkpoint.save(path, _small_tree(1))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_integrity, "write_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, _small_tree(2), overwrite=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    checkpoint.save(path, _small_tree(3), overwrite=True)  # the lock was released
    _assert_tree_equal(checkpoint.restore(path), _values(_small_tree(3)))


def test_a_missing_checksums_file_is_refused_but_old_checkpoints_restore(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save(path, _small_tree(1))
    (path / "einshard-checksums.json").unlink()
    with pytest.raises(EinshardError, match="was written with checksums, but its checksums file .* is missing"):
        checkpoint.restore(path)
    _assert_tree_equal(checkpoint.restore(path, verify=False), _values(_small_tree(1)))
    with pytest.raises(EinshardError, match="verify must be True or False"):
        checkpoint.restore(path, verify="yes")
    # A checkpoint written before einshard stored checksums (no "checksums" key, no file) restores as it is.
    import orbax.checkpoint as ocp

    header = {k: v for k, v in checkpoint.read_meta(path).items() if k != "checksums"}
    old = ocp.StandardCheckpointer()
    old.save(tmp_path / "old", _small_tree(4), custom_metadata={"einshard": header})
    old.wait_until_finished()
    old.close()
    _assert_tree_equal(checkpoint.restore(tmp_path / "old"), _values(_small_tree(4)))


def test_overwrite_replaces_a_plain_file_at_the_path(tmp_path):
    (tmp_path / "ckpt").write_text("not a checkpoint")
    with pytest.raises(EinshardError, match="a checkpoint already exists"):
        checkpoint.save(tmp_path / "ckpt", _small_tree(1))
    checkpoint.save(tmp_path / "ckpt", _small_tree(1), overwrite=True)
    _assert_tree_equal(checkpoint.restore(tmp_path / "ckpt"), _values(_small_tree(1)))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
