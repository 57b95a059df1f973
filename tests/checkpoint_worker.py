"""One process of a real multi-process checkpoint run (launched by tests/test_checkpoint.py).

Usage::

    python tests/checkpoint_worker.py --port PORT --process-id I --mode save|restore --path DIR
        [--num-processes 2] [--local-devices 4]

Each process gets ``--local-devices`` simulated CPU devices and joins
``jax.distributed`` on 127.0.0.1 (gloo).  ``save`` lays :func:`global_data`
out on a (data=2, model=4) Explicit mesh whose 'data' rows are the two
processes and saves it with ``einshard.checkpoint.save`` (over a first
checkpoint of zeros, with ``overwrite=True``); ``restore`` reads
it back twice, with the saved expressions and with new ones on a (4, 2) Auto
mesh, and checks that every addressable shard holds exactly its slice of the
global data.  The last stdout line is ``EINSHARD_RESULT {json}``; on failure
the process prints the reason to stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys

import distributed_setup  # sets the device flags, then imports JAX (in main)
import numpy as np  # JAX itself is imported only in main(), after the device flags are set

RESULT_PREFIX = "EINSHARD_RESULT "

# Saved layouts on the (data=2, model=4) mesh: split across processes, within them, and replicated.
SAVED = {
    "x": ((64, 256), "b d -> b@data d"),
    "w": ((256, 64), "d f -> d f@model"),
    "both": ((64, 64), "a b -> a@(data,model) b"),
    "bias": ((64,), "f -> f"),
}
# The layouts restored into, on a (rows=4, cols=2) Auto mesh.
NEW = {
    r"\['x'\]": "b d -> b d@rows",
    r"\['w'\]": "d f -> d@(rows,cols) f",
    r"\['both'\]": "a b -> a b",
    r"\['bias'\]": "f -> f@cols",
}


def global_data() -> dict[str, np.ndarray]:
    """The global pytree, the same on every process (and in the test): seeded random float32."""
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in SAVED.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--mode", choices=("save", "restore"), required=True)
    p.add_argument("--path", required=True)
    args = p.parse_args()
    jax = distributed_setup.start(args.port, args.num_processes, args.process_id, args.local_devices, 60)
    from jax.sharding import AxisType

    from einshard import checkpoint, einshard

    me = jax.process_index()
    glob = global_data()

    def check(name: str, arr: jax.Array) -> None:
        if arr.is_fully_addressable and jax.process_count() > 1:
            raise SystemExit(f"process {me}: {name} lives on this process only")
        for s in arr.addressable_shards:
            if not np.array_equal(np.asarray(s.data), glob[name][s.index]):
                raise SystemExit(f"process {me}: {name} shard on {s.device} at {s.index} holds the wrong values")

    result: dict = {"process": me}
    if args.mode == "save":
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
        tree = einshard(glob, {rf"\['{k}'\]": expr for k, (_, expr) in SAVED.items()}, mesh=mesh)
        # The bytes this process must write: its shards, one copy of each (replica 0).
        result["own_bytes"] = {
            k: sum(s.data.nbytes for s in v.addressable_shards if s.replica_id == 0) for k, v in tree.items()
        }
        # A first checkpoint, then replaced (overwrite=True: staged beside it, swapped in by process 0).
        checkpoint.save(args.path, jax.tree.map(lambda x: x * 0, tree), meta={"step": 6})
        checkpoint.save(args.path, tree, meta={"step": 7}, overwrite=True)
    else:
        back = checkpoint.restore(args.path)
        result["saved_specs"] = {k: str(tuple(v.sharding.spec)) for k, v in back.items()}
        for k, v in back.items():
            check(k, v)
        mesh = jax.make_mesh((4, 2), ("rows", "cols"), axis_types=(AxisType.Auto,) * 2)
        moved = checkpoint.restore(args.path, expressions=NEW, mesh=mesh)
        result["new_specs"] = {k: str(tuple(v.sharding.spec)) for k, v in moved.items()}
        for k, v in moved.items():
            check(k, v)
        result["sums"] = {k: float(jax.jit(lambda a: a.sum())(v)) for k, v in moved.items()}
        result["step"] = checkpoint.read_meta(args.path)["step"]
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
