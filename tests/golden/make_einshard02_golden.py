"""Record einshard 0.2's layouts as golden data for tests/test_einshard02_compat.py.

einshard 0.2 needs Python >= 3.12, CI runs 3.11, so its answers are recorded
once and committed.  Run with the old library installed, on 8 simulated devices:

    /root/venv312/bin/python tests/golden/make_einshard02_golden.py      # 8 devices: einshard02.json
    /root/venv312/bin/python tests/golden/make_einshard02_golden.py 1    # einshard02_1dev.json (also 2, 4)

The cases are generated deterministically (a seeded generator over shapes,
axis orders, counts, stars, standalone replications and '...'), then each is
given to einshard 0.2.  For an accepted case the file records the mesh shape,
the shard shape and ``devices_indices_map`` (device id -> [start, stop] per
axis); for a rejected one, the exception 0.2 raised.
"""

from __future__ import annotations

import os
import sys

N_DEVICES = int(sys.argv[1]) if len(sys.argv) > 1 else 8
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={N_DEVICES}"

import json  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import einshard  # noqa: E402  (einshard 0.2: einshard, make_sharding)

OUT = pathlib.Path(__file__).with_name("einshard02.json" if N_DEVICES == 8 else f"einshard02_{N_DEVICES}dev.json")
SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 8, 16, 32, 4]
COUNTS = [None, None, None, None, 1, 2, 2, 4, 8, 3]
REPLICAS = ["2", "*", "2*", "4", "8", "1", "3"]
# The main table is on 8 devices; smaller tables on 1, 2 and 4 devices.
N_ACCEPTED, N_REJECTED = (320, 200) if N_DEVICES == 8 else (100, 60)


def random_case(rng: random.Random) -> tuple[tuple[int, ...], str]:
    rank = rng.randint(1, 3)
    shape = tuple(rng.choice(SIZES) for _ in range(rank))
    names = list("abc"[:rank])
    # '...' replaces a contiguous run of axes on the left (sometimes all of them).
    elided: tuple[int, int] | None = None
    if rng.random() < 0.3:
        start = rng.randint(0, rank - 1)
        stop = rng.randint(start + 1, rank)
        elided = (start, stop)
    left = names[: elided[0]] + ["..."] + names[elided[1] :] if elided else list(names)
    named = [n for n in left if n != "..."]
    right: list[str] = []
    for name in rng.sample(named, len(named)):
        count = rng.choice(COUNTS)
        star = rng.random() < 0.35
        right.append(name + (str(count) if count is not None else "") + ("*" if star else ""))
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        right.insert(rng.randint(0, len(right)), rng.choice(REPLICAS))
    if elided:
        right.insert(rng.randint(0, len(right)), "...")
    return shape, " ".join(left) + " -> " + " ".join(right)


# Cases from einshard 0.2's documentation and from ecosystem.md's survey, always recorded.
FIXED = [
    ((128, 256), "x y -> x y*"),  # tutorial MLP, W1
    ((256, 64), "y z -> y* z"),  # tutorial MLP, W2
    ((8, 128), "... -> * ..."),  # tutorial MLP, X
    ((4, 8), "a b -> 2 a2 b2"),
    ((4, 8), "a b -> 2 a2* b*"),
    ((4, 8), "a b -> * a2 b"),
    ((4, 8), "a b -> * a* b2*"),
    ((4, 8, 20, 10), "a ... d -> 2 a2 ... d2"),
    ((4, 8, 20, 10), "a b c d -> 2 a2 b c d2"),
    ((4, 4), "a b -> * a* b*"),
    ((8, 8), "a b -> a2* b*"),
    ((4, 8), "a b -> a* b*"),  # rejected by 0.2: sqrt(8)
    ((4, 8), "a b -> a b"),  # rejected by 0.2: must write '* a b'
    ((4, 8), "a b -> a3 b"),
    ((5, 8), "a b -> a8 b"),
    ((4, 8), "a b -> a"),
    ((4, 8), "a -> a*"),
    ((4, 8), "a a -> a* a"),
    ((4, 8), "a1 b -> a1* b"),
    ((4, 8), "a b -> (a b)*"),
    ((4, 8), "a b -> a0 b"),
    ((4, 8), "α β -> α* β"),
    ((2,), "... -> * ..."),
    ((2, 8), "a b -> 2 a b*"),
    ((2, 8), "... a -> 2 ... a*"),
    ((4, 16, 8), "a b c -> a2* b2 c*"),
    ((16, 8), "a b -> b a*"),
    ((8, 4), "a b -> b2 a4"),
    ((8,), "a -> a8"),
    ((8, 2), "a b -> a4 b2"),
    # '...' standing for no axes, scalars, rank 4 in another order.
    ((8,), "a ... -> ... a*"),
    ((), "... -> * ..."),
    ((8,), "... a -> a2 ... *"),
    ((2, 4, 8, 2), "a b c d -> d c* b a2"),
    ((2, 4, 8, 2), "a ... d -> d2 ... 2 a2"),
]
# einshard 0.2 accepts these but gets them wrong; recorded apart.
ACCEPTED_BUT_WRONG = [((4, 8), "a b -> a b c*")]


def index_pairs(idx: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(idx, shape, strict=True)]


def record(shape: tuple[int, ...], expr: str) -> dict:
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    try:
        y = einshard.einshard(x, expr)
        sh = y.sharding
        indices = sh.devices_indices_map(shape)
        placed = {d.id: index_pairs(i, shape) for d, i in indices.items()}
        for shard in y.addressable_shards:  # 0.2's values are the slices it names
            assert np.array_equal(np.asarray(shard.data), x[shard.index])
    except Exception as err:  # noqa: BLE001  (recording what 0.2 does, whatever it is)
        return {"shape": list(shape), "expr": expr, "error": type(err).__name__, "message": str(err)[:300]}
    return {
        "shape": list(shape),
        "expr": expr,
        "mesh": {k: int(v) for k, v in sh.mesh.shape.items()},
        "spec": [e if e is None or isinstance(e, str) else list(e) for e in sh.spec],
        "shard_shape": list(sh.shard_shape(shape)),
        "indices": {str(k): v for k, v in sorted(placed.items())},
    }


def main() -> None:
    assert jax.device_count() == N_DEVICES
    assert einshard.__version__ == "0.2.0", einshard.__version__
    rng = random.Random(20241122)
    cases = list(FIXED)
    seen = set(cases)
    accepted, rejected = [], []
    for shape, expr in cases:
        rec = record(shape, expr)
        (rejected if "error" in rec else accepted).append(rec)
    # Generated cases until N_ACCEPTED are accepted, keeping the first N_REJECTED rejections.
    for _ in range(100_000):
        if len(accepted) >= N_ACCEPTED:
            break
        case = random_case(rng)
        if case in seen:
            continue
        seen.add(case)
        rec = record(*case)
        if "error" not in rec:
            accepted.append(rec)
        elif len(rejected) < N_REJECTED:
            rejected.append(rec)
    wrong = [record(shape, expr) for shape, expr in ACCEPTED_BUT_WRONG]
    data = {
        "generator": "tests/golden/make_einshard02_golden.py",
        "einshard": einshard.__version__,
        "jax": jax.__version__,
        "n_devices": N_DEVICES,
        "accepted": accepted,
        "rejected": rejected,
        "accepted_but_wrong": wrong,
    }
    OUT.write_text(json.dumps(data, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(accepted)} accepted, {len(rejected)} rejected -> {OUT}")


if __name__ == "__main__":
    main()
