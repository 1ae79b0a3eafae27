"""Every ELS option is one field of ``ElsOptions``: each field must reach every face (the settings and
their fallbacks, ``from_dir``, the command line, the sweep grid, the kernel and ``config()``), so a new
field that some face does not carry fails here."""

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from aligntax.cli import app
from aligntax.energy.gate import HarmGate
from aligntax.errors import AligntaxError
from aligntax.interventions import els
from aligntax.interventions.els import DEFAULT_SETTINGS, TUNED_KEYS, VALUE_KEYS, ElsOptions, EnergySteering
from aligntax.interventions.options import flag_of, spec_of
from aligntax.runs.els_score import OPTIONAL_ELS_KEYS
from aligntax.runs.els_sweep import SweepConfig
from tiny import save_tiny_bank, tiny_lm

H = 32
FIELDS = [f for f in dataclasses.fields(ElsOptions) if f.name != "path"]
# a value of each option other than its fallback, by how the option is read; text options name theirs
_BY_PARSE = {"float": 0.25, "float_or_none": 0.125, "int": 2, "int_or_none": 2}
_TEXT = {"positions": "generated", "scale_by_norm": False, "grad_method": "autograd"}


def sample(name: str):
    f = next(f for f in FIELDS if f.name == name)
    value = _TEXT[name] if name in _TEXT else _BY_PARSE[spec_of(f).parse]
    assert value != spec_of(f).fallback, name
    return value


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


@pytest.fixture(scope="module")
def folder(lm, tmp_path_factory):
    """An energy bank with a harm gate at layer 0 (before every steered layer), threshold 0.5."""
    d = save_tiny_bank(lm, tmp_path_factory.mktemp("bank"), n=24, epochs=1)
    torch.manual_seed(0)
    HarmGate(
        [0],
        torch.randn(1, H),
        torch.zeros(1),
        torch.zeros(1, H),
        torch.ones(1, H),
        threshold=0.5,
        fingerprint=lm.fingerprint,
    ).save(d)
    return d


def test_every_option_has_a_fallback_setting_and_is_taken_by_from_dir(tmp_path):
    assert list(DEFAULT_SETTINGS) == [f.name for f in FIELDS]
    assert all(DEFAULT_SETTINGS[f.name] == spec_of(f).fallback for f in FIELDS)
    assert set(TUNED_KEYS) == {f.name for f in FIELDS if spec_of(f).grid}
    for f in FIELDS:
        value = [1] if f.name == "layers" else True if f.name in ("gate", "row_strength") else sample(f.name)
        assert els.resolve_settings(None, **{f.name: value})[0][f.name] == value
        with pytest.raises(AligntaxError) as err:  # taken: the folder (empty) is what is refused
            EnergySteering.from_dir(tmp_path, None, **{f.name: value})
        assert "Unknown" not in str(err.value), f.name
    with pytest.raises(AligntaxError, match="Unknown ELS options for from_dir: bogus"):
        EnergySteering.from_dir(tmp_path, None, bogus=1)
    with pytest.raises(AligntaxError, match="no option bogus"):
        EnergySteering({}, bogus=1)


def test_every_value_option_reaches_the_kernel_and_config(lm, folder):
    for name in VALUE_KEYS:
        value = sample(name)
        iv = EnergySteering.from_dir(folder, lm, gate=True, **{name: value})
        assert iv.settings[name] == value and getattr(iv, name) == value, name
        assert iv.kernel(lm.num_layers).settings[name] == value, name
        cfg = iv.config()
        assert (cfg["gate"]["ramp"] if name == "gate_ramp" else cfg[name]) == value, name


def test_every_loaded_option_is_read_by_from_dir(lm, folder):
    """The options from_dir turns into loaded parts: each shows in the intervention, or asks for its file."""
    checks = {
        "layers": lambda: EnergySteering.from_dir(folder, lm, layers=[2]).config()["layers"] == [2],
        "top_k": lambda: len(EnergySteering.from_dir(folder, lm, top_k=2).models) == 2,
        "gate": lambda: EnergySteering.from_dir(folder, lm, gate=0.3).config()["gate"]["threshold"] == 0.3,
        "harm_orth": lambda: _refused("no harm basis", harm_orth=2),
        "row_strength": lambda: _refused("no row strength model", row_strength=True),
    }

    def _refused(match, **kw):
        with pytest.raises(AligntaxError, match=match):
            EnergySteering.from_dir(folder, lm, **kw)
        return True

    assert set(checks) == set(DEFAULT_SETTINGS) - set(VALUE_KEYS)
    for name, check in checks.items():
        assert check(), name


def test_every_option_is_on_the_command_line_and_in_the_sweep_grid():
    env = {"COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}
    res = CliRunner().invoke(app, ["eval", "--help"], env=env)
    assert res.exit_code == 0, res.output
    grid = {f.name: f for f in dataclasses.fields(SweepConfig)}
    for f in FIELDS:
        spec = spec_of(f)
        if spec.cli:
            assert flag_of(f) in res.output, f.name
        if spec.grid:
            assert f.name in grid and grid[f.name].default_factory() == list(spec.grid_default), f.name
        assert (f.name in OPTIONAL_ELS_KEYS) == (spec.grid and spec.optional), f.name
