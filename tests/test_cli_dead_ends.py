"""The command line's dead ends (issue 11), run in-process through ``einshard_apps.cli.main`` as the shell runs it.

* flags and rules are checked before any training (no reference run first);
* a requested size is never silently replaced (``--batch 0`` is refused, ``--batch 32`` is what is planned);
* hints name command-line flags (``--mesh``, ``--sizes``), never Python arguments (``mesh=``, ``sizes=``);
* ``einshard plan`` suggests a ``einshard demo --rules`` command that the demo then accepts;
* ``einshard demo --layers 4 --mesh stage=4,data=2`` (docs/demo.md) passes every check; without ``--layers 4`` the
  default 2-layer model is refused before training, naming ``--layers``.

``einshard --help`` starting no JAX is tests/test_cli_help.py; the suggested command training to the
single-device loss is tests/test_planner.py::test_planned_rules_train_the_demo (slow).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from einshard_apps.cli import main

PYTHON_ARGUMENTS = re.compile(r"\b(mesh|sizes|shape|rules|batch)=[{'\"A-Za-z,\s]|Pass mesh=|sizes=\{")


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse refuses a flag's value
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["show", "a -> a@x", "--shape", "8"], "--mesh x=2"),
        (["show", "a -> a@y", "--shape", "8", "--mesh", "x=8"], "The mesh axes are: 'x'"),
        (["analyze", "b x@data, x y@model -> b y", "--sizes", "b=8,x=8,y=8"], "--mesh data=2"),
        (["analyze", "b x@data, x y@model -> b y", "--mesh", "data=4", "--sizes", "b=8,x=8,y=8"], "--mesh data=4,"),
        (["analyze", "b x@data, x y@modle -> b y", "--mesh", "data=4,model=2", "--sizes", "b=8,x=8,y=8"], "'model'"),
        (["analyze", "b x@data, x y@model -> b y", "--mesh", "data=4,model=2"], "--sizes b=N,x=N,y=N"),
        (["demo", "--layout", "dp", "--batch", "12", "--steps", "1"], "--batch"),
        (["demo", "--layout", "tp", "--ring", "sync", "--steps", "1"], "--layout tp-async"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_hints_name_flags_not_python_arguments(argv, flag, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2, (out, err)
    assert flag in err, err
    assert not PYTHON_ARGUMENTS.search(err), err
    assert "single device" not in out  # nothing trained


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--batch", "0"],
        ["plan", "--width", "-8"],
        ["demo", "--batch", "0"],
        ["demo", "--steps", "-1"],
        ["demo", "--layers", "0"],
        ["demo", "--devices", "0"],
        ["demo", "--microbatches", "0", "--layout", "pipeline"],
    ],
    ids=" ".join,
)
def test_a_size_is_refused_not_replaced(argv, capsys):
    code, out, err = _run(argv, capsys)
    assert code == 2 and argv[1] in err and ("positive integer" in err or "integer >= 0" in err), err
    assert not out


@pytest.mark.slow  # plans the transformer: ~10 s of CPU each, minutes on a loaded machine
@pytest.mark.parametrize("profile", ["cpu", "h100"])
def test_plan_suggests_a_demo_command_the_demo_accepts(profile, tmp_path, capsys):
    """The suggested command passes every check the demo makes before training (same parser, same preflight);
    the requested --batch is the planned one and is carried into the command."""
    import argparse

    from einshard_apps import arguments
    from einshard_apps.demo.preflight import check_arguments, check_layout_fits
    from einshard_apps.models.transformer import Config

    rules = tmp_path / "rules.json"
    argv = ["plan", "--model", "transformer", "--mesh", "data=4,model=2", "--budget", "2GiB", "--profile", profile]
    code, out, err = _run([*argv, "--batch", "32", "--rules-out", str(rules)], capsys)
    assert code == 0, err
    assert "batch (32, 65)" in out
    suggested = re.search(r"use: (einshard demo [^)\n]*)", out)
    assert suggested, out
    words = shlex.split(suggested.group(1))
    assert words[:4] == ["einshard", "demo", "--rules", str(rules)] and words[4:] == ["--batch", "32"]
    parser = argparse.ArgumentParser()
    arguments.demo(parser)
    args = parser.parse_args(words[2:])
    presets, mesh, _ = check_arguments(args)
    assert mesh == json.loads(rules.read_text())["mesh"]
    cfg = Config(layers=args.layers, width=args.width, heads=args.heads, ffn=args.ffn, seq=args.seq)
    for preset in presets:
        check_layout_fits(preset, mesh, cfg, args.batch)


def test_plan_for_the_mlp_does_not_suggest_the_demo(tmp_path, capsys):
    """The MLP's rules name w1/w2, which the demo's transformer does not have: no dead-end suggestion."""
    code, out, err = _run(["plan", "--mesh", "data=4,model=2", "--rules-out", str(tmp_path / "mlp.json")], capsys)
    assert code == 0, err
    assert "use: einshard demo" not in out and "plan that with --model transformer" in out


def test_the_docs_pipeline_mesh_passes_every_check(capsys):
    """docs/demo.md: `--layers 4 --mesh stage=4,data=2` runs only `pipeline`, and it fits."""
    import argparse

    from einshard_apps import arguments
    from einshard_apps.demo.preflight import check_arguments, check_layout_fits
    from einshard_apps.models.transformer import Config

    parser = argparse.ArgumentParser()
    arguments.demo(parser)
    args = parser.parse_args(["--layers", "4", "--mesh", "stage=4,data=2"])
    presets, mesh, _ = check_arguments(args)
    assert [p.name for p in presets] == ["pipeline"] and mesh == {"stage": 4, "data": 2}
    assert "leaving out" in capsys.readouterr().err
    check_layout_fits(presets[0], mesh, Config(layers=4), args.batch)


def test_the_default_model_on_four_stages_is_refused_before_training(capsys):
    code, out, err = _run(["demo", "--mesh", "stage=4,data=2", "--steps", "1"], capsys)
    assert code == 2 and "--layers" in err and "does not fit" in err
    assert "single device" not in out


def test_rules_are_checked_before_training(tmp_path, capsys):
    """A rules file whose patterns miss a parameter, or whose pattern is no regex, fails before any training."""
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"params": {"embed": "v d -> v d@data"}, "mesh": "data=8"}))
    code, out, err = _run(["demo", "--rules", str(missing), "--steps", "1"], capsys)
    assert code == 2 and "no rule matches the leaf at" in err and "single device" not in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"params": {"embed(": "v d -> v d"}, "mesh": "data=8"}))
    code, out, err = _run(["demo", "--rules", str(bad), "--steps", "1"], capsys)
    assert code == 2 and "'embed(' is not a valid regular expression" in err and "single device" not in out


def test_a_null_rule_leaves_the_parameter_replicated(tmp_path):
    """JSON null in a rules file means what None means in einshard's path rules (tree_rules): leave it whole."""
    from einshard_apps.presets import expressions_for, load_rules

    path = tmp_path / "null.json"
    path.write_text(json.dumps({"params": {"embed": None, ".*": "... -> ..."}, "mesh": "data=8"}))
    preset, _ = load_rules(path)
    assert preset.params["embed"] is None
    import numpy as np

    assert expressions_for({"embed": np.zeros((4, 2)), "w": np.zeros(3)}, preset.params) == {
        "embed": "... -> ...",
        "w": "... -> ...",
    }
