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
