"""The demo: every layout trains the transformer to the single-device loss; checkpoints; Ctrl-C; 2 processes."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from einshard import checkpoint
from einshard_apps.demo import Trainer, batch_at, load_corpus
from einshard_apps.models.transformer import Config
from einshard_apps.presets import PRESETS, Preset, load_rules

CFG = Config(layers=2, width=32, heads=8, ffn=64, seq=16)
BATCH = 8
STEPS = 3


@pytest.fixture(scope="module")
def corpus() -> bytes:
    return load_corpus()


@pytest.fixture(scope="module")
def reference(corpus) -> list[float]:
    """The single-device losses every layout must reproduce."""
    t = Trainer(PRESETS["dp"], {"data": 1, "model": 1}, CFG, corpus, batch=BATCH, devices=jax.devices()[:1])
    return [t.step() for _ in range(STEPS)]


def test_corpus_is_shipped_and_batches_are_deterministic(corpus):
    assert len(corpus) > 10_000 and b"Four score and seven years ago" in corpus
    a, b = batch_at(corpus, 3, 4, 16, 0), batch_at(corpus, 3, 4, 16, 0)
    assert a.shape == (4, 17) and a.dtype == np.int32 and (a == b).all()
    assert not (batch_at(corpus, 4, 4, 16, 0) == a).all()


def test_any_utf8_file_is_a_corpus(tmp_path):
    from einshard import EinshardError

    text = tmp_path / "poem.txt"
    text.write_text("Ünïcode is bytes too. " * 10, encoding="utf-8")
    assert load_corpus(str(text)) == text.read_bytes()
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(EinshardError, match="not UTF-8 text"):
        load_corpus(str(binary))
    with pytest.raises(EinshardError, match="cannot read"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(EinshardError, match="needs at least 66"):
        batch_at(b"short", 0, 2, 64, 0)


def test_reference_learns(reference):
    assert reference[0] > reference[-1]  # the loss goes down on real text
    assert abs(reference[0] - np.log(256)) < 1.0  # starts near a uniform guess over bytes


# The default run trains two layouts (jit hybrid DP x TP, the explicit pipeline program); the slow run trains every
# preset (and the docs' CLI test runs the whole demo).
DEFAULT_RUN_PRESETS = ("hybrid", "pipeline")


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT_RUN_PRESETS else pytest.param(n, marks=pytest.mark.slow) for n in PRESETS]
)
def test_every_layout_matches_single_device(name, corpus, reference):
    preset = PRESETS[name]
    t = Trainer(preset, preset.default_mesh(8), CFG, corpus, batch=BATCH)
    losses = [t.step() for _ in range(STEPS)]
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-5)
    # The state really is laid out as the preset says.
    wq = t.state["params"]["layers"]["attn"]["wq"]
    want = {
        "dp": (2, 32, 8, 4),
        "fsdp": (2, 4, 8, 4),
        "tp": (2, 32, 1, 4),
        "hybrid": (2, 32, 4, 4),
        "tp-async": (2, 32, 2, 4),  # data=2, model=4
        "pipeline": (1, 32, 8, 4),  # stage=2: one layer per stage
    }
    if name in want:
        assert wq.sharding.shard_shape(wq.shape) == want[name]
    mu = t.state["opt"][0].mu["layers"]["attn"]["wq"]
    assert mu.sharding == wq.sharding  # AdamW moments follow their parameter
    if name == "tp-async":
        # The projections run as collective-matmul rings: collective-permutes, and no all-gather at all
        # (the sums left are the softmax's pmax/psum over model and the gradients of replicated weights).
        hlo = t.compile().as_text()
        assert _count(hlo, "collective-permute") >= 6 * 3  # 6 ring einsums x (model - 1) steps, forward alone
        assert _count(hlo, "all-gather") == 0
    if name == "pipeline":
        plan = "\n".join(t.step_fn.plan(t.state, t.place_batch(0)))
        assert "bubble: 33%" in plan and "2 micro-batches" in plan  # (2-1)/(2+2-1): 2 rows per data shard
        assert _count(t.compile().as_text(), "collective-permute") >= 1


def _count(hlo: str, op: str) -> int:
    return len(re.findall(rf"\s{op}(?:-start)?\(", hlo))


@pytest.mark.slow  # an explicit tp-async program: minutes of compiling on 2 cores
def test_tp_async_sync_schedule_is_the_baseline(corpus, reference):
    """--ring sync: the same program with plain all-gathers / reduce-scatters: same loss, no rings."""
    t = Trainer(PRESETS["tp-async"], {"data": 2, "model": 4}, CFG, corpus, batch=BATCH, step_options={"ring": "sync"})
    hlo = t.compile().as_text()
    assert _count(hlo, "all-gather") > 0 and _count(hlo, "collective-permute") == 0
    np.testing.assert_allclose([t.step()], reference[:1], rtol=2e-5, atol=2e-5)


def test_explicit_step_options_and_meshes_are_checked(corpus):
    from einshard import EinshardError

    with pytest.raises(
        EinshardError, match=r"--layout tp does not take --microbatches \(it belongs to --layout pipeline\)"
    ):
        Trainer(PRESETS["tp"], {"data": 1, "model": 8}, CFG, corpus, batch=BATCH, step_options={"microbatches": 2})
    with pytest.raises(EinshardError, match=r"mesh axis 'stage' is not an axis of the mesh \('data': 4, 'model': 2\)"):
        Trainer(PRESETS["pipeline"], {"data": 4, "model": 2}, CFG, corpus, batch=BATCH)
    with pytest.raises(EinshardError, match=r"mesh axis 'model' is not an axis of the mesh \('stage': 2, 'data': 4\)"):
        Trainer(PRESETS["tp-async"], {"stage": 2, "data": 4}, CFG, corpus, batch=BATCH)


@pytest.mark.slow  # an explicit tp-async program: minutes of compiling on 2 cores
def test_checkpoint_from_pipeline_resumes_as_tp_async(tmp_path, corpus, reference):
    """Save under the pipeline layout (layers over 'stage'), resume under asynchronous TP: the losses continue."""
    path = str(tmp_path / "pipe")
    first = Trainer(PRESETS["pipeline"], {"stage": 2, "data": 4}, CFG, corpus, batch=BATCH)
    losses = [first.step() for _ in range(2)]
    first.save(path)
    second = Trainer(PRESETS["tp-async"], {"data": 2, "model": 4}, CFG, corpus, batch=BATCH, resume=path)
    assert second.step_index == 2
    losses.append(second.step())
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-5)


def test_rules_file_json_and_text(tmp_path, corpus):
    text = tmp_path / "rules.txt"
    text.write_text(
        "# Megatron MLP only\nmesh: data=2,model=4\nbatch: b s -> b@data s\n"
        "w_in: l d f -> l d f@model\nw_out: l f d -> l f@model d\n.*: ... -> ...\n"
    )
    preset, mesh = load_rules(text)
    assert mesh == {"data": 2, "model": 4} and preset.batch == "b s -> b@data s"
    assert list(preset.params) == ["w_in", "w_out", ".*"]
    js = tmp_path / "rules.json"
    js.write_text('{"batch": "b s -> b@data s", "params": {"w_in": "l d f -> l d f@model", ".*": "... -> ..."}}')
    preset_js, mesh_js = load_rules(js)
    assert mesh_js is None and preset_js.params["w_in"] == "l d f -> l d f@model"
    t = Trainer(preset, mesh, CFG, corpus, batch=BATCH)
    w_in, wq = t.state["params"]["layers"]["mlp"]["w_in"], t.state["params"]["layers"]["attn"]["wq"]
    assert w_in.sharding.shard_shape(w_in.shape) == (2, 32, 16) and wq.sharding.is_fully_replicated
    assert t.batch_sharding.shard_shape((BATCH, CFG.seq + 1)) == (4, 17)


def test_rules_errors(tmp_path):
    from einshard import EinshardError

    bad = tmp_path / "bad.txt"
    bad.write_text("w_in l d f -> l d f@model\n")
    with pytest.raises(EinshardError, match="line 1: expected 'pattern: expression'"):
        load_rules(bad)
    none = tmp_path / "none.txt"
    none.write_text("batch: b s -> b@data s\n")
    with pytest.raises(EinshardError, match="no parameter rules"):
        load_rules(none)


def test_no_rule_for_a_parameter_is_an_error(corpus):
    from einshard import EinshardError

    partial = Preset("partial", "", {"w_in": "l d f -> l d f@model"}, "b s -> b s")
    with pytest.raises(EinshardError, match=r"no rule matches the leaf at \['embed'\]\['positions'\]"):
        Trainer(partial, {"data": 1, "model": 8}, CFG, corpus, batch=BATCH)


@pytest.mark.slow  # demo training in two layouts; tests/test_checkpoint.py restores onto other layouts in the default run
def test_checkpoint_resume_in_another_layout(tmp_path, corpus, reference):
    """Train 2 steps data parallel, save, resume as 2-D FSDP x TP: the losses continue as if never stopped."""
    path = str(tmp_path / "state")
    first = Trainer(PRESETS["dp"], {"data": 8, "model": 1}, CFG, corpus, batch=BATCH)
    losses = [first.step() for _ in range(2)]
    first.save(path)
    meta = checkpoint.read_meta(path)
    assert meta["format"] == checkpoint.FORMAT and meta["step"] == 2 and meta["layout"] == "dp"
    by_path = {leaf["path"]: leaf for leaf in meta["leaves"]}
    assert by_path["['params']['layers']['attn']['wq']"]["expression"] == "... -> ..."
    assert by_path["['params']['layers']['attn']['wq']"]["shape"] == [2, 32, 8, 4]

    second = Trainer(PRESETS["fsdp-tp"], {"data": 4, "model": 2}, CFG, corpus, batch=BATCH, resume=path)
    assert second.step_index == 2
    wq = second.state["params"]["layers"]["attn"]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "data", "model", None)
    losses.append(second.step())
    np.testing.assert_allclose(losses, reference, rtol=2e-5, atol=2e-5)

    # Restored to the layouts saved with it when no new ones are given.
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), first.state)
    back = checkpoint.restore(path, like, mesh=first.mesh)
    assert back["params"]["unembed"].sharding.is_fully_replicated  # saved as '... -> ...' (data parallel)
    np.testing.assert_array_equal(np.asarray(back["params"]["unembed"]), np.asarray(first.state["params"]["unembed"]))


def test_resume_with_another_model_is_refused(tmp_path, corpus):
    from einshard import EinshardError

    path = str(tmp_path / "state")
    Trainer(PRESETS["dp"], {"data": 8, "model": 1}, CFG, corpus, batch=BATCH).save(path)
    other = Config(layers=1, width=32, heads=8, ffn=64, seq=16)
    with pytest.raises(EinshardError, match="the checkpoint's model"):
        Trainer(PRESETS["dp"], {"data": 8, "model": 1}, other, corpus, batch=BATCH, resume=path)


# ---------------------------------------------------------------------------
# The command, as a user runs it

TINY = ["--layers", "2", "--width", "32", "--heads", "8", "--ffn", "64", "--seq", "16", "--batch", "8", "--plain"]


def _env(devices: int | None = 8) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _demo(*args: str, devices: int | None = 8, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "einshard", "demo", *args],
        capture_output=True,
        text=True,
        env=_env(devices),
        timeout=timeout,
    )


# `einshard demo --steps 2` as the README runs it: tests/test_docs.py::test_every_cli_line_runs (what it prints).


@pytest.mark.slow
def test_one_layout_with_mesh_and_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    out = _demo(
        "--layout", "hybrid", "--mesh", "data=2,model=4", "--steps", "2", "--no-check", "--checkpoint", str(path), *TINY
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh: data=2, model=4" in out.stdout and f"saved step 2 to {path}" in out.stdout
    out2 = _demo("--layout", "tp", "--steps", "1", "--no-check", "--resume", str(path), *TINY)
    assert out2.returncode == 0, out2.stderr[-3000:]
    assert re.search(r"^tp\s+data=1,model=8\s.*\s3\s+\d\.\d{4}", out2.stdout, re.M)  # step 3 after resuming at 2


@pytest.mark.slow
def test_pipeline_circular_from_the_command_line():
    four_layers = [*TINY[2:], "--layers", "4"]  # each option once: a repeated one is refused (issue 25)
    out = _demo("--layout", "pipeline", "--schedule", "circular", "--steps", "2", *four_layers)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "einshard.pipeline(circular) over the 4 stacked layers" in out.stdout
    assert "2 rounds" in out.stdout and "loss matches the single-device run: yes" in out.stdout
    out = _demo("--layout", "tp", "--schedule", "circular", *TINY)
    assert out.returncode == 2 and "--schedule applies to --layout pipeline only" in out.stderr


@pytest.mark.slow
def test_rules_file_from_the_command_line(tmp_path):
    rules = tmp_path / "mine.txt"
    rules.write_text("mesh: data=2,model=4\nbatch: b s -> b@data s\nw_in: l d f -> l d f@modle\n.*: ... -> ...\n")
    out = _demo("--rules", str(rules), "--no-check", *TINY)
    assert out.returncode == 2
    assert "['layers']['mlp']['w_in']" in out.stderr and "mesh axis 'modle'" in out.stderr
    assert "Did you mean 'model'?" in out.stderr
    assert "step 1/" not in out.stdout  # found by the shape check, before any training
    out = _demo("--rules", str(rules), "--layout", "dp", *TINY)
    assert out.returncode == 2 and "--rules replaces --layout" in out.stderr


def test_bad_arguments_exit_2(capsys):
    """Refused before any training, with exit status 2 (in-process: cli.main as `einshard demo` runs it)."""
    from einshard_apps.cli import main

    assert main(["demo", "--layout", "nope", *TINY]) == 2
    assert "is not a preset" in capsys.readouterr().err
    assert main(["demo", "--mesh", "data=3,model=2", "--layout", "dp", *TINY]) == 2
    assert "6 devices" in capsys.readouterr().err
    small_heads = ["--heads", "4", "--width", "32", "--ffn", "64", "--seq", "16", "--batch", "8", "--no-check"]
    assert main(["demo", "--layout", "tp", "--mesh", "data=1,model=8", *small_heads]) == 2
    err = capsys.readouterr().err
    assert "h@model" in err and "Pad the axis to 8" in err


@pytest.mark.slow
def test_ctrl_c_stops_saves_and_prints_the_table(tmp_path):
    path = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "einshard",
            "demo",
            "--layout",
            "dp",
            "--steps",
            "100000",
            "--no-check",
            "--checkpoint",
            str(path),
            *TINY,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "collectives XLA runs per step" in line:
            break
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    text = "".join(seen) + rest
    assert proc.returncode == 130, err[-2000:]
    assert "(stopped)" in text and f"interrupted: stopped after the last finished step (state saved to {path})" in text
    meta = checkpoint.read_meta(path)
    assert meta["step"] > 0


@pytest.mark.slow
def test_two_processes_same_loss_as_one():
    out = _demo("--layout", "hybrid", "--processes", "2", "--steps", "3", *TINY, devices=None)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "8 cpu devices in 2 processes" in text
    assert "loss matches the single-device run: yes" in text
    assert text.count("== hybrid:") == 1  # only process 0 prints
    assert "[Gloo]" not in text


def test_a_workers_cpp_output_cannot_land_inside_its_python_lines():
    # gloo's C++ side writes "[Gloo] Rank 0 is connected ..." to fd 1 while Python's block-buffered stdout holds a
    # half-written line: CI once saw "...93.4 KiB\n0[Gloo] Rank 0 ..." in the relayed output. A worker keeps the
    # two apart: fd 1 goes to its log, Python's lines to the launcher's pipe.
    child = (
        "import os, sys\n"
        "from einshard_apps.demo.launcher import _keep_cpp_chatter_off_stdout\n"
        "sys.stdout.write('half a line ')\n"
        "_keep_cpp_chatter_off_stdout()\n"
        "sys.stdout.write('and the rest')\n"
        "os.write(1, b'[Gloo] Rank 0 is connected to 3 peer ranks.\\n')\n"
        "print()\n"
        "print('next line')\n"
    )
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "half a line and the rest\nnext line\n"
    assert "[Gloo] Rank 0 is connected" in out.stderr


def test_plot_writes_loss_curves_and_bytes(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install 'einshard[plot]'")
    from einshard_apps.demo import RunResult, write_plot

    runs = [
        RunResult(name, {"data": 8}, losses=[5.0, 4.0], per_param_bytes={"['unembed']": size})
        for name, size in (("dp", 1024), ("fsdp", 128))
    ]
    path = tmp_path / "demo.svg"
    assert write_plot(str(path), runs, None) == f"plot written to {path}"
    svg = path.read_text()
    assert "<svg" in svg and "training loss" in svg and "parameter bytes per device" in svg


def test_the_demo_says_it_is_compiling_before_each_layout_compiles(corpus):
    """Each layout's compile takes seconds: a line says so first, once (issue 22: 5-14 s without a word)."""
    from einshard_apps.demo.loop import train_layout
    from einshard_apps.models.transformer import Config

    tiny = Config(layers=1, width=16, heads=2, ffn=32, seq=16)
    t = Trainer(PRESETS["tp"], {"data": 1, "model": 2}, tiny, corpus, batch=4, devices=jax.devices()[:2])
    said: list[str] = []
    res = train_layout(t, 1, say=said.append, plain=True)
    compiling = [line for line in said if line.startswith("compiling")]
    assert compiling == ["compiling tp (data=1, model=2)..."], said
    assert said.index(compiling[0]) == 0 and res.compile_s > 0  # before anything else, and only once
    t.compile(said.append)  # compiled already: nothing more to say
    assert [line for line in said if line.startswith("compiling")] == compiling


def test_docs_demo_table_shows_the_memory_each_layout_holds(corpus):
    """docs/demo.md's table is the demo's output: its per-device memory columns equal what each layout's trainer
    holds on the default model (issue 22: the page said 337.5 KiB for pipeline where the demo printed 273.5)."""
    from einshard_apps.demo import SINGLE_DEVICE
    from einshard_apps.demo.report import kib
    from einshard_apps.models.transformer import Config

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "demo.md").read_text(encoding="utf-8")
    rows = re.findall(r"^(1 device|[\w-]+)\s+(\S+=\S+)\s+([\d.]+ [KM]iB)\s+([\d.]+ [KM]iB)\s", page, re.M)
    assert [r[0] for r in rows] == ["1 device", *PRESETS], rows
    cfg = Config(layers=2, width=64, heads=8, ffn=256, seq=64)  # the demo's defaults
    for name, mesh_text, weights, with_adamw in rows:
        sizes = {k: int(v) for k, v in (part.split("=") for part in mesh_text.split(","))}
        preset, devices = (SINGLE_DEVICE, jax.devices()[:1]) if name == "1 device" else (PRESETS[name], None)
        t = Trainer(preset, sizes, cfg, corpus, batch=16, devices=devices)
        got = t.bytes_per_device()
        assert (kib(got[0]), kib(got[1])) == (weights, with_adamw), (name, got)
