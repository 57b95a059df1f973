"""``einshard audit`` (issue 24): a rule set in each format on the CLI's model step, reported from sizes only."""

import json

import pytest

from einshard_apps import cli


@pytest.mark.parametrize(
    ("rules", "unmatched"),
    [
        ({"params": {"w1": "x y -> x y@model", "w2": "y z -> y@model z"}}, None),
        ({"params": {"w1": "x y -> x y@mlp", "w2": "y z -> y@mlp z"}, "axis_rules": {"mlp": "model"}}, None),
        ({"keras": {"w1": [None, "model"], "mlp/w2": ["model", None]}}, "w2"),
        ({"logical_axis_rules": [["embed", None], ["mlp", "model"]], "logical_axes": {"w1": ["embed", "mlp"]}}, "w2"),
    ],
    ids=["einshard", "einshard-logical", "keras", "maxtext"],
)
def test_audit_reads_each_format(tmp_path, capsys, rules, unmatched):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(rules))
    code = cli.main(["audit", "--rules", str(path), "--mesh", "data=4,model=2", "--width", "256", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert [u["leaf"] for u in report["unmatched"]] == ([unmatched] if unmatched else [])
    assert code == (1 if unmatched else 0)
    assert report["collectives"] and report["plan"]["rules"] and report["memory_bytes"] > 0
    w1 = next(r for r in report["rules"] if "w1" in r["leaves"])
    assert w1["bytes"] == 256 * 512 * 4


def test_audit_text_and_a_bad_rules_file(tmp_path, capsys):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"keras": {"w1": [None, "model"]}}))
    assert (
        cli.main(["audit", "--rules", str(path), "--mesh", "data=4,model=2", "--width", "256", "--budget", "1KiB"]) == 1
    )
    out = capsys.readouterr().out
    assert "no rule matches (replicated on every device)" in out and "w2  (512, 128)  256 KiB" in out
    assert "OVER BUDGET" in out and "plan's choice:" in out and "step (explain):" in out
    path.write_text(json.dumps({"rules": {}}))
    assert cli.main(["audit", "--rules", str(path)]) == 2
    assert "expected the key 'params'" in capsys.readouterr().err


def test_a_plan_written_by_einshard_plan_audits_as_the_plan(tmp_path, capsys):
    path = tmp_path / "planned.json"
    common = ["--mesh", "data=4,model=2", "--width", "256", "--budget", "64MiB"]
    assert cli.main(["plan", *common, "--rules-out", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["audit", "--rules", str(path), *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["differences"] == [] and report["unmatched"] == []
    assert report["time_s"] == pytest.approx(report["plan"]["time_s"])
    assert report["memory_bytes"] == report["plan"]["memory_bytes"]


def _mlp():
    import jax
    import jax.numpy as jnp

    params = {"w1": jax.ShapeDtypeStruct((256, 512), jnp.float32), "w2": jax.ShapeDtypeStruct((512, 128), jnp.float32)}

    def loss(p, x):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)

    return jax.value_and_grad(loss), params, jax.ShapeDtypeStruct((1024, 256), jnp.float32)


def test_audit_of_einshard_rules_with_logical_names_and_a_typo():
    import einshard

    step, params, x = _mlp()
    rules = {r"\['w1'\]": "x y -> x y@mlp", r"\['w_2'\]": "y z -> y@mlp z"}  # 'w_2': a typo, w2 is left out
    report = einshard.audit(
        step,
        params,
        x,
        rules=rules,
        mesh={"data": 4, "model": 2},
        axis_rules={"mlp": "model"},
        data_rules="b x -> b@data x",
    )
    assert [m.leaf.name for m in report.unmatched] == ["w2"]
    assert report.imported.leaves[0].expression == "x y -> x y@model"
    assert [(r.source, len(r.leaves)) for r in report.rules] == [(r"\['w1'\]", 1), (r"\['w_2'\]", 0)]
    assert report.report.comm_count > 0 and report.collectives()


def test_audit_refuses_what_it_cannot_read():
    import einshard

    step, params, x = _mlp()
    with pytest.raises(einshard.EinshardError, match="needs the step's arguments"):
        einshard.audit(step, rules={}, mesh={"data": 4})
    with pytest.raises(einshard.EinshardError, match="audit\\(rules=\\) takes einshard path rules"):
        einshard.audit(step, params, x, rules=3, mesh={"data": 4})
    with pytest.raises(einshard.EinshardError, match="batch_axis 'batch' is not an axis of the mesh"):
        einshard.audit(step, params, x, rules="... -> ...", mesh={"data": 4}, batch_axis="batch")


def test_audit_lists_logical_names_flax_leaves_whole_and_reads_ellipses():
    import jax
    import jax.numpy as jnp

    import einshard
    from einshard import interop

    step, params, x = _mlp()
    rules = [("embed", "model"), ("mlp", "model")]  # both want 'model': in w1 mlp loses, in w2 embed wins
    names = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}
    sizes = {"data": 4, "model": 2}
    read = interop.from_maxtext(rules, names, params, mesh=sizes)
    assert [m.spec for m in read.leaves] == [jax.P("model", None), jax.P(None, "model")]
    report = einshard.audit(step, params, x, rules=read, mesh=sizes)
    assert [(m.leaf.name, f) for m, f in report.fallbacks] == [("w1", ("mlp",)), ("w2", ("mlp",))]
    assert "Flax's fallback" in str(report) and report.to_dict()["fallbacks"][0]["names"] == ["mlp"]
    # '...' in einshard rules: the spec has one entry per dimension
    cube = {"w": jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)}
    from einshard._src.audit import _as_imported  # (the module: einshard.audit is the function)

    read = _as_imported({"w": "... y -> ... y@model"}, cube, sizes)
    assert read.leaves[0].spec == jax.P(None, None, "model")
