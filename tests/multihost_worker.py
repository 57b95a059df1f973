"""One process of a real multi-process einshard run (launched by tests/test_multihost.py).

Usage::

    python tests/multihost_worker.py --port PORT --process-id I [--num-processes 2] [--local-devices 4]

(``EINSHARD_COORDINATOR_PORT`` / ``EINSHARD_PROCESS_ID`` / ``EINSHARD_NUM_PROCESSES``
work as well.)  Each process gets ``--local-devices`` simulated CPU devices,
joins ``jax.distributed`` on 127.0.0.1 with gloo CPU collectives, and runs
every scenario below.  Each scenario checks, on this process, that every
addressable shard holds exactly the slice of the global array that
``devices_indices_map`` names, then runs a jitted reduction over the whole
(global) pytree.  On success the last stdout line is
``EINSHARD_RESULT {json}`` with the reductions; on failure the process
prints the scenario and the reason to stderr and exits with status 1.

The data are a deterministic function of the shapes (see :func:`global_data`),
so the launching test recomputes the expected reductions with numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import distributed_setup  # sets the device flags, then imports JAX (in main)
import numpy as np  # JAX itself is imported only in main(), after the device flags are set

RESULT_PREFIX = "EINSHARD_RESULT "

# Global shapes shared with the test (which recomputes the reductions with numpy).
SHAPES = {"x": (8, 16), "w1": (16, 8), "b1": (8,), "w2": (8, 4)}


def global_data() -> dict:
    """The global pytree, the same on every process: small integers, exact in float32."""
    out = {}
    for k, (name, shape) in enumerate(sorted(SHAPES.items())):
        n = int(np.prod(shape))
        out[name] = ((np.arange(n, dtype=np.int64) * (3 + 2 * k)) % 7 - 3).astype(np.float32).reshape(shape)
    return out


def reduce_tree(xp, tree):
    """The reduction both the workers (jnp, jitted) and the test (numpy) compute: a tiny MLP and a sum of squares."""
    h = xp.maximum(tree["x"] @ tree["w1"] + tree["b1"], 0.0)
    # sum(h @ w2), written without a matmul over a sharded contraction (which
    # Explicit mesh axes would want an out_sharding for).
    return {
        "mlp": xp.sum(h * xp.sum(tree["w2"], axis=1)),
        "squares": sum(xp.sum(v * v) for v in tree.values()),
    }


def _args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=env("EINSHARD_COORDINATOR_PORT"))
    p.add_argument("--process-id", type=int, default=env("EINSHARD_PROCESS_ID"))
    p.add_argument("--num-processes", type=int, default=int(env("EINSHARD_NUM_PROCESSES", "2")))
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--timeout", type=int, default=60, help="seconds to wait for the other processes to join")
    p.add_argument(
        "--quick", action="store_true", help="only the first scenarios (counts, path rules, process-local data)"
    )
    p.add_argument("--fault", choices=sorted(FAULTS), help="run one fault scenario instead (see run_fault)")
    p.add_argument("--path", help="a checkpoint directory, for the fault scenarios that save")
    a = p.parse_args()
    if a.port is None or a.process_id is None:
        p.error("need --port and --process-id (or EINSHARD_COORDINATOR_PORT and EINSHARD_PROCESS_ID)")
    return a


class ScenarioFailed(Exception):
    pass


class _QuickRunDone(Exception):
    """--quick: the scenarios the default test run checks are done."""


# Fault scenarios: what process 1 does differently (process 0 always does the plain thing).
FAULTS = {
    "local-shape": "process_local=True with 5 rows on process 1, 4 on process 0",
    "global-shape": "process_local=False with a (8, 17) array on process 1, (8, 16) on process 0",
    "expression": "process 1 places with another expression",
    "save-tree": "process 1 saves a tree with one more leaf",
    "save-layout": "process 1 saves a leaf laid out differently",
    "dead-peer-placement": "process 1 dies before placing",
    "dead-peer-save": "process 1 dies before saving",
    "dead-peer-mid-save": "process 1 dies after the save's agreement, as orbax starts writing",
}
PEER_TIMEOUT_S = 5


def run_fault(jax, fault: str, path: str | None) -> dict:
    """Run one fault scenario on this process: {'error': the EinshardError's text or None, 'seconds': how long}."""
    import signal
    import time

    from einshard import EinshardError, checkpoint, einshard, multihost

    multihost.set_peer_timeout(PEER_TIMEOUT_S)
    me = jax.process_index()
    odd = me == 1
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    glob = global_data()
    if fault in ("dead-peer-placement", "dead-peer-save") and odd:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "dead-peer-mid-save" and odd:
        from einshard._src.checkpoint import _integrity

        _integrity.start_digests = lambda leaves: os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if fault in ("local-shape", "dead-peer-placement"):
            rows = 5 if odd and fault == "local-shape" else 4
            einshard(glob["x"][:rows], "b d -> b@data d", mesh=mesh, process_local=True)
        elif fault == "global-shape":
            x = np.zeros((8, 17), np.float32) if odd else glob["x"]
            einshard(x, "b d -> b@data d", mesh=mesh)
        elif fault == "expression":
            einshard(glob["x"], "b d -> b d@model" if odd else "b d -> b@data d", mesh=mesh)
        else:
            rules = {r"\['w1'\]": "d f -> d f@model", ".*": "a ... -> a@data ..."}
            if fault == "save-layout" and odd:
                rules = {".*": "a ... -> a@data ..."}
            with multihost.unchecked():  # host data placed without a collective: the save's own check must catch it
                tree = einshard(glob, rules, mesh=mesh)
            if fault == "save-tree" and odd:
                tree = {**tree, "extra": tree["b1"]}
            assert path is not None
            checkpoint.save(path, tree)
    except EinshardError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def main() -> int:
    args = _args()
    jax = distributed_setup.start(args.port, args.num_processes, args.process_id, args.local_devices, args.timeout)
    if args.fault:
        report = run_fault(jax, args.fault, args.path)
        print(RESULT_PREFIX + json.dumps({"process": jax.process_index(), **report}), flush=True)
        sys.stdout.flush()
        # Wait (bounded) until every live process has reported: the coordinator (process 0) leaving first
        # makes the runtime abort the others.  Then skip jax.distributed's exit hook, which waits for the dead.
        from jax._src import distributed

        try:
            distributed.global_state.client.wait_at_barrier("multihost_worker.exit", 10_000)
        except Exception:
            pass
        os._exit(0)
    import jax.numpy as jnp
    from jax.sharding import AxisType

    from einshard import einshard

    me = jax.process_index()
    n_proc = jax.process_count()
    expected_devices = args.num_processes * args.local_devices
    if n_proc != args.num_processes or jax.device_count() != expected_devices:
        print(
            f"process {me}: expected {args.num_processes} processes x {args.local_devices} devices, "
            f"got {n_proc} processes, {jax.device_count()} devices",
            file=sys.stderr,
        )
        return 1

    glob = global_data()
    rows_per_process = SHAPES["x"][0] // n_proc
    mine = slice(me * rows_per_process, (me + 1) * rows_per_process)

    def check_shards(name: str, arr, want) -> None:
        """Every addressable shard is on this process and holds the slice the sharding names; none is missing."""
        if tuple(arr.shape) != want.shape:
            raise ScenarioFailed(f"{name}: global shape {tuple(arr.shape)}, want {want.shape}")
        index_map = arr.sharding.devices_indices_map(tuple(arr.shape))
        local_devices = {d for d in index_map if d.process_index == me}
        got_devices = {s.device for s in arr.addressable_shards}
        if got_devices != local_devices:
            raise ScenarioFailed(f"{name}: addressable shards on {got_devices}, want this process's {local_devices}")
        for s in arr.addressable_shards:
            if not np.array_equal(np.asarray(s.data), want[s.index]):
                raise ScenarioFailed(f"{name}: shard on {s.device} at {s.index} holds the wrong values")

    def check_tree(name: str, tree, want: dict) -> None:
        if set(tree) != set(want):
            raise ScenarioFailed(f"{name}: leaves {sorted(tree)}, want {sorted(want)}")
        for k in want:
            arr = tree[k]
            if not isinstance(arr, jax.Array):
                raise ScenarioFailed(f"{name}: leaf {k} is a {type(arr).__name__}, not a jax.Array")
            if arr.is_fully_addressable:
                raise ScenarioFailed(f"{name}: leaf {k} lives on this process only ({arr.sharding})")
            check_shards(f"{name}[{k!r}]", arr, want[k])

    reduce_jit = jax.jit(lambda t: reduce_tree(jnp, t))

    def reduced(tree) -> dict:
        out = reduce_jit(tree)
        # Scalars come back replicated on every device: every process can read them.
        return {k: float(np.asarray(v)) for k, v in out.items()}

    meshes = {
        "auto": jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
        "explicit": jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2),
    }
    rules = {
        r"\['x'\]": "b d -> b@data d",
        r"\['w1'\]": "d f -> d f@model",
        r"\['b1'\]": "f -> f@model",
        r"\['w2'\]": "f o -> f@model o",
    }

    # The meshes must really cross processes, or this run proves nothing multi-host.
    for kind, mesh in meshes.items():
        owners = [{d.process_index for d in row} for row in mesh.devices]
        if owners != [{p} for p in range(n_proc)]:
            print(f"process {me}: the {kind} mesh's 'data' rows are on processes {owners}", file=sys.stderr)
            return 1

    results: dict = {}
    scenario = "?"
    try:
        # 1. Global host pytree, one count expression: anonymous mesh over all 8 global devices.
        scenario = "global/counts"
        tree = einshard(glob, "a ... -> a* ...")
        check_tree(scenario, tree, glob)
        if tree["x"].sharding.mesh.devices.size != jax.device_count():
            raise ScenarioFailed(f"{scenario}: anonymous mesh has {tree['x'].sharding.mesh.devices.size} devices")
        results[scenario] = reduced(tree)

        # 2./3. Global host pytree, path-pattern rules, '@' on jax.make_mesh (Auto and Explicit axes).
        for kind, mesh in meshes.items():
            scenario = f"global/rules/{kind}"
            tree = einshard(glob, rules, mesh=mesh)
            check_tree(scenario, tree, glob)
            with jax.set_mesh(mesh):
                results[scenario] = reduced(tree)
            # The same through jax.set_mesh instead of mesh=.
            scenario = f"global/rules/{kind}/set_mesh"
            with jax.set_mesh(mesh):
                tree = einshard(glob, rules)
                check_tree(scenario, tree, glob)
                results[scenario] = reduced(tree)

        # 4. Each process reads only its own shards of the global array: rows this
        # process does not hold are poisoned (NaN) here, and must not leak in.
        scenario = "global/own-shards-only"
        mesh = meshes["auto"]
        poisoned = dict(glob)
        x = np.full_like(glob["x"], np.nan)
        x[mine] = glob["x"][mine]
        poisoned["x"] = x
        tree = einshard(poisoned, rules, mesh=mesh)
        check_tree(scenario, tree, glob)
        results[scenario] = reduced(tree)

        # 5. Process-local data, as a data loader yields it: each process passes its own rows.
        local_batch = {"x": glob["x"][mine]}
        for kind, mesh in meshes.items():
            scenario = f"process_local/{kind}"
            batch = einshard(local_batch, "b d -> b@data d", mesh=mesh, process_local=True)
            check_tree(scenario, batch, {"x": glob["x"]})
            params = einshard({k: v for k, v in glob.items() if k != "x"}, rules, mesh=mesh)
            with jax.set_mesh(mesh):
                results[scenario] = reduced({**params, **batch})

        if args.quick:
            raise _QuickRunDone

        # 6. Process-local with counts: rows split over all 8 devices, 4 of them on each process.
        scenario = "process_local/counts"
        batch = einshard(local_batch, "b d -> b* d", process_local=True)
        check_tree(scenario, batch, {"x": glob["x"]})
        params = einshard({k: v for k, v in glob.items() if k != "x"}, "a ... -> a* ...")
        if batch["x"].sharding.mesh is not params["w1"].sharding.mesh:
            raise ScenarioFailed(f"{scenario}: separate calls built separate anonymous meshes")
        results[scenario] = reduced({**params, **batch})

        # 7. Process-local with a mixed rule set: the batch split across processes,
        # a small table replicated across them (each process passes all of it).
        scenario = "process_local/replicated-across-processes"
        mesh = meshes["auto"]
        table = glob["w2"]
        mixed = einshard(
            {"x": glob["x"][mine], "table": table},
            {r"\['x'\]": "b d -> b@data d", r"\['table'\]": "f o -> f@model o"},
            mesh=mesh,
            process_local=True,
        )
        check_tree(scenario, mixed, {"x": glob["x"], "table": table})
        results[scenario] = reduced({**einshard(glob, rules, mesh=mesh), "x": mixed["x"]})

        # 8. A single array (not a pytree), global and process-local.
        scenario = "single-array"
        arr = einshard(glob["x"], "b d -> b@data d@model", mesh=meshes["explicit"])
        check_shards(scenario, arr, glob["x"])
        arr = einshard(glob["x"][mine], "b d -> b@data d@model", mesh=meshes["explicit"], process_local=True)
        check_shards(scenario + "/process_local", arr, glob["x"])

        # 9. A jax.Array held whole on this process (committed to a local device) is the
        # global value too; jax.device_put alone refuses it.
        scenario = "global/local-jax-arrays"
        local_dev = jax.local_devices()[0]
        on_device = {k: jax.device_put(v, local_dev) for k, v in glob.items()}
        tree = einshard(on_device, rules, mesh=meshes["auto"])
        check_tree(scenario, tree, glob)
        results[scenario] = reduced(tree)

        # 10. Re-laying out global arrays: anonymous mesh -> named mesh -> another spec.
        scenario = "global/relayout"
        tree = einshard(einshard(glob, "a ... -> a* ..."), rules, mesh=meshes["auto"])
        check_tree(scenario, tree, glob)
        tree = einshard(tree, {r"\['x'\]": "b d -> b d@model", ".*": "... -> ..."}, mesh=meshes["auto"])
        check_tree(scenario, tree, glob)
        if tree["x"].sharding.spec != jax.sharding.PartitionSpec(None, "model"):
            raise ScenarioFailed(f"{scenario}: x has spec {tree['x'].sharding.spec}")
        results[scenario] = reduced(tree)

        # 11. Process-local data with two stars, where the split depends on the global shape:
        # on an unknown shape 'b* d*' splits 8 devices 4 x 2, on the global (8, 3) it is 8 x 1.
        scenario = "process_local/stars"
        narrow = np.arange(SHAPES["x"][0] * 3, dtype=np.float32).reshape(-1, 3)
        arr = einshard(jnp.asarray(narrow[mine]), "b d -> b* d*", process_local=True)
        check_shards(scenario, arr, narrow)
        if arr.sharding != einshard(narrow, "b d -> b* d*").sharding:
            raise ScenarioFailed(f"{scenario}: layout {arr.sharding} differs from the global call's")

        # 13. Inside jax.jit, einshard constrains the (global) traced values instead of moving data.
        for kind, mesh in meshes.items():
            scenario = f"jit/constraint/{kind}"
            relaid = {r"\['x'\]": "b d -> b@model d", r"\['w1'\]": "d f -> d f@data", ".*": "f ... -> f@data ..."}
            with jax.set_mesh(mesh):
                tree = einshard(glob, rules)
                moved = jax.jit(lambda t: einshard(t, relaid))(tree)  # noqa: B023
                check_tree(scenario, moved, glob)
                want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None))
                if not moved["x"].sharding.is_equivalent_to(want, 2):
                    raise ScenarioFailed(f"{scenario}: x came out of jit as {moved['x'].sharding.spec}")
                out = jax.jit(lambda t: reduce_tree(jnp, einshard(t, relaid)))(tree)  # noqa: B023
                results[scenario] = {k: float(np.asarray(v)) for k, v in out.items()}

        # 12. process_local=True on an already global array is an error, not a silent re-slice.
        scenario = "process_local/rejects-global"
        try:
            einshard(tree["x"], "b d -> b@data d", mesh=meshes["auto"], process_local=True)
        except ValueError as err:
            if "already global" not in str(err):
                raise ScenarioFailed(f"{scenario}: unexpected message {err}") from None
        else:
            raise ScenarioFailed(f"{scenario}: accepted a global array as process-local data")
    except _QuickRunDone:
        pass
    except Exception as err:  # report which scenario failed, then fail the process
        detail = str(err) if isinstance(err, ScenarioFailed) else traceback.format_exc()
        print(f"process {me}: scenario {scenario} failed: {detail}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Skip jax.distributed's exit hook: it would wait for the other process
        # (possibly stuck in a collective) for minutes.
        os._exit(1)

    print(RESULT_PREFIX + json.dumps({"process": me, "results": results}, sort_keys=True), flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
