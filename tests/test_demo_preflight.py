"""The demo checks every layout against the model's shapes before any training, and names the flag to change."""

import pytest

from einshard import EinshardError
from einshard_apps.cli import main
from einshard_apps.demo import check_layout_fits
from einshard_apps.models.transformer import Config
from einshard_apps.presets import PRESETS

CFG = Config(layers=2, width=64, heads=8, ffn=256, seq=64)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_fits_the_default_model_on_its_default_mesh(name):
    preset = PRESETS[name]
    check_layout_fits(preset, preset.default_mesh(8), CFG, batch=16)


@pytest.mark.parametrize(
    "name, mesh, cfg, batch, flag",
    [
        ("pipeline", {"stage": 4, "data": 2}, CFG, 16, "--layers"),
        ("dp", {"data": 8, "model": 1}, CFG, 12, "--batch"),
        ("tp", {"data": 1, "model": 8}, Config(layers=2, width=64, heads=4, ffn=256, seq=64), 16, "--heads"),
    ],
)
def test_a_layout_that_does_not_fit_names_the_flag(name, mesh, cfg, batch, flag):
    with pytest.raises(EinshardError) as err:
        check_layout_fits(PRESETS[name], mesh, cfg, batch=batch)
    assert flag in str(err.value) and f"layout {name!r}" in str(err.value)


def test_the_cli_reports_it_before_training(capsys):
    code = main(["demo", "--layout", "pipeline", "--mesh", "stage=4,data=2", "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and "--layers" in err and "does not fit" in err
    assert "single device" not in out  # no reference training ran first
