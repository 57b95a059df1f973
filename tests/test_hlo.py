"""einshard.testing.hlo on HLO text in every form XLA prints (synthetic snippets modelled on CPU, GPU and TPU output)."""

from __future__ import annotations

import pytest

from einshard.testing import hlo

HEADER = "HloModule jit_f, entry_computation_layout={(f32[16,256]{1,0})->f32[64,256]{1,0}}, num_partitions=8\n"


def one(text: str) -> hlo.HloCollective:
    (c,) = hlo.collectives(HEADER + text)
    return c


def test_replica_groups_explicit_iota_and_mesh_forms():
    c = one(
        "  %ag = f32[64,256]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}"
    )
    assert (c.kind, c.group_size, c.groups, c.array_bytes) == ("all-gather", 4, ((0, 1, 2, 3), (4, 5, 6, 7)), 65536)
    c = one("  %ag = f32[64,256]{1,0} all-gather(%p), replica_groups=[2,4]<=[8], dimensions={0}")
    assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    c = one("  %ag = f32[32,256]{1,0} all-gather(%p), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}")
    assert c.group_size == 2 and c.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    c = one("  %ar = f32[8]{0} all-reduce(%p), replica_groups=mesh['x'=2,'y'=4] {'y'}, to_apply=%add")
    assert c.group_size == 4 and c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    c = one("  %ar = f32[8]{0} all-reduce(%p), replica_groups=mesh['x'=2,'y'=4] {'x'}, to_apply=%add")
    assert c.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    c = one(
        "  %ag = f32[128,256]{1,0} all-gather(%p), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1,"
        "'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, use_global_device_ids=true"
    )
    assert c.group_size == 4 and c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    c = one("  %ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add")
    assert c.group_size == 8 and c.groups is None  # all devices (num_partitions)


def test_async_pairs_count_once_with_the_done_shape_and_start_attributes():
    text = (
        "  %ags = (f32[16,256]{1,0}, f32[64,256]{1,0}) all-gather-start(%p), replica_groups=[2,4]<=[8], dimensions={0}\n"
        "  %agd = f32[64,256]{1,0} all-gather-done(%ags)\n"
        "  %ars = f32[64,256]{1,0} all-reduce-start(%agd), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add\n"
        "  %ard = f32[64,256]{1,0} all-reduce-done(%ars)\n"
        "  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}\n"
        "  ROOT %cpd = f32[4]{0} collective-permute-done(%cps)\n"
    )
    got = [(c.kind, c.array_bytes, c.group_size) for c in hlo.collectives(HEADER + text)]
    assert got == [("all-gather", 65536, 4), ("all-reduce", 65536, 2), ("collective-permute", 16, 2)]


def test_tuples_all_to_all_pieces_and_combined_collectives():
    c = one(
        "  %a2a = (f32[16,1,32]{2,1,0}, f32[16,1,32]{2,1,0}, f32[16,1,32]{2,1,0}, f32[16,1,32]{2,1,0}) "
        "all-to-all(%a, %b, %c, %d), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}"
    )
    assert (c.kind, c.array_bytes, len(c.shapes)) == ("all-to-all", 4 * 16 * 32 * 4, 4)
    combined = hlo.collectives(
        HEADER + "  %ar = (f32[16]{0}, bf16[8,8]{1,0}) all-reduce(%x, %y), replica_groups={{0,1}}, to_apply=%add"
    )
    assert [(c.kind, c.array_bytes) for c in combined] == [("all-reduce", 64), ("all-reduce", 128)]


def test_reduce_scatter_forms():
    # GPU/TPU: a real reduce-scatter; its buffer is the full input (result x group).
    c = one("  %rs = f32[16,256]{1,0} reduce-scatter(%x), replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add")
    assert (c.kind, c.bytes, c.array_bytes) == ("reduce-scatter", 16384, 65536)
    # CPU: all-reduce, then a dynamic-slice of its result, directly or inside a fusion.
    direct = (
        "  %ar = f32[64,256]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add\n"
        "  ROOT %ds = f32[16,256]{1,0} dynamic-slice(%ar, %i, %j), dynamic_slice_sizes={16,256}\n"
    )
    fused = (
        "%fused_slice (p0: f32[64,256], p1: s32[]) -> f32[16,256] {\n"
        "  %p0 = f32[64,256]{1,0} parameter(0)\n"
        "  ROOT %ds = f32[16,256]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={16,256}\n"
        "}\n\n"
        "ENTRY %main (x: f32[64,256]) -> f32[16,256] {\n"
        "  %ar = f32[64,256]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add\n"
        "  ROOT %f = f32[16,256]{1,0} fusion(%ar, %i), kind=kLoop, calls=%fused_slice\n"
        "}\n"
    )
    for text in (direct, fused):
        (raw,) = hlo.collectives(HEADER + text)
        assert raw.kind == "all-reduce" and raw.sliced
        (norm,) = hlo.normalized(HEADER + text)
        assert (norm.kind, norm.array_bytes, norm.group_size) == ("reduce-scatter", 65536, 4)
    plain = hlo.normalized(
        HEADER + "  ROOT %ar = f32[64,256]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add"
    )
    assert plain[0].kind == "all-reduce" and not plain[0].sliced


def test_a_combined_all_reduce_counts_each_piece_sliced_or_not():
    """XLA's combiner merges a CPU reduce-scatter (all-reduce + slice) with a plain all-reduce: one tuple op."""
    text = (
        "  %ar = (f32[64,256]{1,0}, f32[8]{0}) all-reduce(%x, %y), replica_groups=[2,4]<=[8], to_apply=%add\n"
        "  %g0 = f32[64,256]{1,0} get-tuple-element(%ar), index=0\n"
        "  %g1 = f32[8]{0} get-tuple-element(%ar), index=1\n"
        "  %ds = f32[16,256]{1,0} dynamic-slice(%g0, %i, %j), dynamic_slice_sizes={16,256}\n"
        "  ROOT %t = (f32[16,256]{1,0}, f32[8]{0}) tuple(%ds, %g1)\n"
    )
    got = [(c.kind, c.array_bytes) for c in hlo.normalized(HEADER + text)]
    assert got == [("reduce-scatter", 65536), ("all-reduce", 32)]


def test_sent_bytes_follow_the_ring_formulas_and_single_device_groups_are_dropped():
    c = one("  %ar = f32[64,256]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add")
    assert c.sent_bytes == 2 * 3 / 4 * 65536
    trivial = HEADER + "  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0},{1},{2},{3}}, to_apply=%add"
    assert hlo.collectives(trivial)[0].group_size == 1 and hlo.normalized(trivial) == []
    assert hlo.signature(hlo.normalized(HEADER + "  %ag = f32[4]{0} all-gather(%p), replica_groups=[4,2]<=[8]")) == {
        ("all-gather", 16, 2): 1
    }


def test_collectives_in_loops_run_once_per_iteration_as_explain_counts_them():
    """A ``lax.scan`` over layers compiles to a while loop: its body's collectives run once per layer.

    Computation headers whose parameter tuples carry ``/*index=5*/`` comments (six or more values) are
    still headers; the count of collectives XLA runs equals explain's count (each op times its repeat).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import einshard

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layers = 3

    def loss(ws, x, a, b, c, d):  # six carried values: the body's header gets an /*index=5*/ comment
        def body(h, w):
            return jnp.tanh(h @ w) + a + b + c + d, None

        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    args = (jnp.ones((layers, 16, 16)), jnp.ones((8, 16)), *(jnp.ones((8, 16)) for _ in range(4)))
    specs = (P(None, "model", None), P("data", "model"), *(P() for _ in range(4)))
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    text = jax.jit(loss, in_shardings=shardings).lower(*args).compile().as_text()
    xla = hlo.normalized(text)
    in_loop = [c for c in xla if c.runs == layers]
    assert in_loop, "the body's collective runs once per layer"
    report = einshard.explain(loss, *args, mesh=mesh, in_specs=specs)
    predicted = sum(op.repeat for op in report.ops for c in op.collectives if c.group_size > 1)
    assert sum(c.runs for c in xla) == predicted


_COMPILE_ONE = """
import hashlib
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
def f(w, x):
    return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0] ** 2)
shardings = (NamedSharding(mesh, P(None, None, "model")), NamedSharding(mesh, P("data")))
c = jax.jit(jax.grad(f), in_shardings=shardings).lower(jnp.ones((3, 64, 64)), jnp.ones((32, 64))).compile()
m = c.memory_analysis()
print(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, hashlib.md5(c.as_text().encode()).hexdigest())
"""


@pytest.mark.slow
def test_the_suites_llvm_optimisation_level_changes_neither_hlo_nor_memory():
    """conftest.py compiles the tests with --xla_backend_optimization_level=0: what the tests compare is the same."""
    import os
    import subprocess
    import sys

    outs = []
    for level in ("", " --xla_backend_optimization_level=0"):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8" + level)
        proc = subprocess.run(
            [sys.executable, "-c", _COMPILE_ONE], env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout.strip())
    assert outs[0] == outs[1]


def test_an_all_reduce_is_a_reduce_scatter_only_when_its_own_value_is_sliced():
    """A fusion that reads an all-reduce and slices another operand (a layer of stacked weights) or uses it
    as a slice index leaves it an all-reduce; slicing it after a bitcast inside the fusion is a reduce-scatter."""
    fused = (
        "%fused_layer (p0: f32[4,64,64], p1: s32[], p2: f32[64]) -> f32[1,64] {\n"
        "  %p2 = f32[64]{0} parameter(2)\n"
        "  %b = f32[1,64]{1,0} bitcast(%p2)\n"
        "  %p0 = f32[4,64,64]{2,1,0} parameter(0)\n"
        "  %p1 = s32[] parameter(1)\n"
        "  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,64,64}\n"
        "  %s = f32[1,1,64]{2,1,0} slice(%ds), slice={[0:1], [0:1], [0:64]}\n"
        "  %w = f32[1,64]{1,0} bitcast(%s)\n"
        "  ROOT %m = f32[1,64]{1,0} multiply(%b, %w)\n"
        "}\n\n"
        "%fused_rs (q0: s32[], q1: f32[64]) -> f32[8] {\n"
        "  %q1 = f32[64]{0} parameter(1)\n"
        "  %q0 = s32[] parameter(0)\n"
        "  %n = f32[64]{0} negate(%q1)\n"
        "  ROOT %ds2 = f32[8]{0} dynamic-slice(%n, %q0), dynamic_slice_sizes={8}\n"
        "}\n\n"
        "ENTRY %main (ws: f32[4,64,64], x: f32[64], i: s32[]) -> f32[1,64] {\n"
        "  %ar = f32[64]{0} all-reduce(%x), replica_groups={}, to_apply=%add\n"
        "  %ari = s32[] all-reduce(%i), replica_groups={}, to_apply=%add\n"
        "  %f = f32[1,64]{1,0} fusion(%ws, %ari, %ar), kind=kLoop, calls=%fused_layer\n"
        "  %ds3 = f32[8]{0} dynamic-slice(%x, %ari), dynamic_slice_sizes={8}\n"
        "  %ar2 = f32[64]{0} all-reduce(%x), replica_groups={}, to_apply=%add\n"
        "  ROOT %g = f32[8]{0} fusion(%ari, %ar2), kind=kLoop, calls=%fused_rs\n"
        "}\n"
    )
    got = [(c.name, c.kind) for c in hlo.normalized(HEADER + fused)]
    assert got == [("ar", "all-reduce"), ("ari", "all-reduce"), ("ar2", "reduce-scatter")]


def test_a_fusion_operand_past_the_fifth_is_read_by_its_name():
    """XLA prints a sixth operand on as ``/*index=5*/%name``: an all-reduce read there and sliced to 1/n inside
    the fusion is a reduce-scatter (XLA:CPU's form of the FSDP LayerNorm gradient's [8, 8] sum in nnx_gpt,
    read as an all-reduce while the comment hid the operand's name)."""
    fused = (
        "%fused_six (a0: f32[2], a1: f32[2], a2: f32[2], a3: f32[2], a4: s32[], a5: f32[8]) -> f32[2] {\n"
        "  %a5 = f32[8]{0} parameter(5)\n"
        "  %a4 = s32[] parameter(4)\n"
        "  %a0 = f32[2]{0} parameter(0)\n"
        "  %ds = f32[2]{0} dynamic-slice(%a5, %a4), dynamic_slice_sizes={2}\n"
        "  ROOT %m = f32[2]{0} add(%ds, %a0)\n"
        "}\n\n"
        "ENTRY %main (x: f32[8], y: f32[2], i: s32[]) -> f32[2] {\n"
        "  %ar = f32[8]{0} all-reduce(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add\n"
        "  ROOT %f = f32[2]{0} fusion(%y, %y, %y, %y, %i, /*index=5*/%ar), kind=kLoop, calls=%fused_six\n"
        "}\n"
    )
    assert [(c.name, c.kind) for c in hlo.normalized(HEADER + fused)] == [("ar", "reduce-scatter")]


def test_a_scan_whose_fusions_slice_stacked_weights_keeps_its_all_reduces(devices):
    """Compiled: inside a ``lax.scan`` over stacked weights every fusion dynamic-slices a layer; the batch sum's
    all-reduce stays an all-reduce (its bytes match), and an FSDP gradient's reduce-scatter is still one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    layers, width, batch = 4, 64, 32

    def mixed(ws, x):
        def body(h, w):
            total = jnp.sum(h, axis=0)  # over the data-split batch: an all-reduce every layer
            return h + jnp.tanh(total[None, :] * w[0][None, :]), None

        return jax.lax.scan(body, x, ws)[0]

    def loss(ws, x):
        return jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    x = sds((batch, width), P("data"))
    text = jax.jit(mixed).lower(sds((layers, width, width), P()), x).compile().as_text()
    assert "dynamic-slice" in text
    (ar,) = hlo.normalized(text)
    assert (ar.kind, ar.array_bytes, ar.group_size, ar.runs) == ("all-reduce", 4 * width, 8, layers)
    assert ar.sent_bytes == 2 * 7 / 8 * 4 * width
    fsdp = sds((layers, width, width), P(None, "data"))
    grad = jax.jit(jax.grad(loss), out_shardings=fsdp.sharding).lower(fsdp, x).compile().as_text()
    kinds = sorted((c.kind, c.runs) for c in hlo.normalized(grad))
    assert kinds == [("all-gather", layers), ("all-gather", layers), ("reduce-scatter", layers)]


def test_collective_counts_and_bytes_count_each_collective_per_run():
    """The one counter the differential tests share: kinds and array bytes of :func:`hlo.normalized`, a loop's
    collective counted once per trip (what explain's ``op.repeat`` counts)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    layers = 3

    def loss(ws, x):
        return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0])

    shardings = (NamedSharding(mesh, P(None, "model", None)), NamedSharding(mesh, P("data", "model")))
    text = jax.jit(loss, in_shardings=shardings).lower(jnp.ones((layers, 16, 16)), jnp.ones((8, 16))).compile()
    text = text.as_text()
    found = hlo.normalized(text)
    assert any(c.runs == layers for c in found)
    counts = hlo.collective_counts(text)
    assert sum(counts.values()) == sum(c.runs for c in found) > len(found)
    assert set(counts) == {c.kind for c in found}
    assert hlo.collective_bytes(text) == sum(c.array_bytes * c.runs for c in found)
    assert hlo.collective_counts("") == {} and hlo.collective_bytes("") == 0


def test_an_all_reduce_also_read_whole_stays_an_all_reduce():
    """An all-reduce one fusion slices and another reads whole (the forward's scatter-add sum, squared whole for
    x's gradient and sliced by the backward gather of the updates' split: XLA:CPU's HLO of the gradient of
    x.at[i].add(u[8@a, 16])) is an all-reduce: a reduce-scatter hands no device the whole sum."""
    text = (
        "%fused_slice (p0: f32[64,256], p1: s32[]) -> f32[16,256] {\n"
        "  %p0 = f32[64,256]{1,0} parameter(0)\n"
        "  %p1 = s32[] parameter(1)\n"
        "  ROOT %ds = f32[16,256]{1,0} dynamic-slice(%p0, %p1, %c), dynamic_slice_sizes={16,256}\n"
        "}\n\n"
        "%fused_whole (q0: f32[64,256]) -> f32[64,256] {\n"
        "  %q0 = f32[64,256]{1,0} parameter(0)\n"
        "  ROOT %m = f32[64,256]{1,0} multiply(%q0, %q0)\n"
        "}\n\n"
        "ENTRY %main (x: f32[64,256], i: s32[]) -> (f32[64,256], f32[16,256]) {\n"
        "  %ar = f32[64,256]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add\n"
        "  %w = f32[64,256]{1,0} fusion(%ar), kind=kLoop, calls=%fused_whole\n"
        "  %s = f32[16,256]{1,0} fusion(%ar, %i), kind=kLoop, calls=%fused_slice\n"
        "  ROOT %t = (f32[64,256]{1,0}, f32[16,256]{1,0}) tuple(%w, %s)\n"
        "}\n"
    )
    (c,) = hlo.normalized(HEADER + text)
    assert (c.kind, c.sliced, c.array_bytes) == ("all-reduce", False, 65536)
    # A direct dynamic-slice next to a whole reader: an all-reduce too.
    direct = (
        "  %ar = f32[64,256]{1,0} all-reduce(%x), replica_groups=[2,4]<=[8], to_apply=%add\n"
        "  %ds = f32[16,256]{1,0} dynamic-slice(%ar, %i, %j), dynamic_slice_sizes={16,256}\n"
        "  ROOT %t = (f32[64,256]{1,0}, f32[16,256]{1,0}) tuple(%ar, %ds)\n"
    )
    assert [c.kind for c in hlo.normalized(HEADER + direct)] == ["all-reduce"]


@pytest.mark.parametrize("perm", [[(0, 1)], [(1, 0)], [(0, 1), (1, 0)]], ids=["one-way", "back", "swap"])
def test_a_two_device_permute_is_kept_as_explain_reports_it(perm):
    """A permute over two devices moves data whether one or both send: normalized() keeps it (a one-way
    permute, {{0,1}}, read as a group of one sender, was dropped as a no-op), as explain reports it."""
    from collections import Counter

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import einshard

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    f = jax.shard_map(lambda a: jax.lax.ppermute(a, "x", perm), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = jax.ShapeDtypeStruct((16,), jnp.float32)
    text = jax.jit(f).lower(x).compile().as_text()
    got = hlo.signature(hlo.normalized(text))
    report = einshard.explain(f, x, mesh=mesh, in_specs=(P("x"),))
    want = Counter((c.kind, c.array_bytes, c.group_size) for op in report.ops for c in op.collectives)
    assert got == want == Counter({("collective-permute", 32, 2): 1})
    assert hlo.collective_counts(text) == Counter({"collective-permute": 1})


def _sliced_by_table(table: str) -> str:
    """XLA:CPU's HLO of sum(x[16@a, 16], 0) resharded on Explicit (2, 2, 2) axes: an all-reduce over 'a' (groups
    {0, 4}, {1, 5}, ...) whose fusion slices a half at the offset a per-partition table gives each device."""
    return (
        "%fused (p0: f32[16], p1: u32[8], p2: u32[]) -> f32[8] {\n"
        "  %p0 = f32[16]{0} parameter(0)\n"
        "  %p1 = u32[8]{0} parameter(1)\n"
        "  %p2 = u32[] parameter(2)\n"
        "  %row = u32[1]{0} dynamic-slice(%p1, %p2), dynamic_slice_sizes={1}\n"
        "  %lo = u32[1]{0} constant({0})\n"
        "  %hi = u32[1]{0} constant({1})\n"
        "  %clamped = u32[1]{0} clamp(%lo, %row, %hi)\n"
        "  %signed = s32[1]{0} convert(%clamped)\n"
        "  %eight = s32[1]{0} constant({8})\n"
        "  %scaled = s32[1]{0} multiply(%signed, %eight)\n"
        "  %at = s32[] bitcast(%scaled)\n"
        "  ROOT %ds = f32[8]{0} dynamic-slice(%p0, %at), dynamic_slice_sizes={8}\n"
        "}\n\n"
        "ENTRY %main (x: f32[8,16]) -> f32[8] {\n"
        "  %pid = u32[] partition-id()\n"
        "  %ar = f32[16]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a'}, "
        "use_global_device_ids=true, to_apply=%add\n"
        f"  %table = u32[8]{{0}} constant({table})\n"
        "  ROOT %f = f32[8]{0} fusion(%ar, %table, %pid), kind=kLoop, calls=%fused\n"
        "}\n"
    )


def test_a_slice_each_group_member_keeps_alike_is_no_reduce_scatter():
    """A reduce-scatter hands each device of a group its own piece.  Sliced by another mesh axis ('c': the table
    {0, 1, 0, 1, ...} gives devices 0 and 4 the same half), the all-reduce is one and the slice local; sliced by
    the group's own axis ('a': {0, 0, 0, 0, 1, 1, 1, 1}) it is CPU's reduce-scatter."""
    (by_c,) = hlo.normalized(HEADER + _sliced_by_table("{0, 1, 0, 1, 0, 1, 0, 1}"))
    assert (by_c.kind, by_c.sliced, by_c.array_bytes) == ("all-reduce", False, 64)
    (by_a,) = hlo.normalized(HEADER + _sliced_by_table("{0, 0, 0, 0, 1, 1, 1, 1}"))
    assert (by_a.kind, by_a.sliced, by_a.array_bytes) == ("reduce-scatter", True, 64)


@pytest.mark.parametrize("dst, kind", [("a", "reduce-scatter"), ("b", "all-reduce"), ("c", "all-reduce")])
def test_a_sum_resharded_is_scattered_only_by_its_summed_axis(devices, dst, kind):
    """Compiled: sum(x[16@a, 16], 0) resharded to P(dst) on Explicit (2, 2, 2) axes.  XLA:CPU all-reduces over
    'a' and slices by dst: a reduce-scatter only where dst is 'a' (each device of a group keeps its own half)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    x = jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P("a", None)))
    with jax.set_mesh(mesh):
        text = jax.jit(lambda v: jax.sharding.reshard(jnp.sum(v, axis=0), P(dst))).lower(x).compile().as_text()
    assert [c.kind for c in hlo.normalized(text)] == [kind]
