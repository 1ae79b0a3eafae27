"""YAML config files: values checked against the config's field types before anything runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from aligntax.cli import app
from aligntax.config import load_config, type_name
from aligntax.errors import AligntaxError
from aligntax.runs import EvalConfig
from aligntax.runs.els_sweep import SweepConfig
from aligntax.runs.els_train import ELSTrainConfig


def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_a_value_of_the_wrong_type_names_the_key_and_the_type(tmp_path):
    path = _yaml(tmp_path, "data: [xstest]\nmax_new_tokens: sixteen\n")
    with pytest.raises(AligntaxError) as e:
        load_config(EvalConfig, path)
    msg = str(e.value)
    assert msg == f"Config file {path}: max_new_tokens: expected int, got 'sixteen' (str)"
    path = _yaml(tmp_path, "limit: many\ntemperature: hot\ndo_sample: [1, 2]\n")
    with pytest.raises(
        AligntaxError,
        match=r"limit: expected int \| None, got 'many'.*temperature: expected float, "
        r"got 'hot'.*do_sample: expected bool, got \[1, 2\] \(list\)",
    ):
        load_config(EvalConfig, path)
    # a flag overrides the bad value: the file's value is not used, so not checked
    assert (
        load_config(EvalConfig, _yaml(tmp_path, "max_new_tokens: sixteen\n"), max_new_tokens=8).max_new_tokens
        == 8
    )


def test_a_single_value_where_a_list_is_expected_is_a_list(tmp_path):
    cfg = load_config(EvalConfig, _yaml(tmp_path, "data: xstest\nmax-new-tokens: '16'\n"))
    assert cfg.data == ["xstest"] and cfg.max_new_tokens == 16
    sweep = load_config(
        SweepConfig, _yaml(tmp_path, "eta: 0.35\ngate: true\nhorizon: 16\nleak: orbench-toxic\n")
    )
    assert (sweep.eta, sweep.gate, sweep.horizon, sweep.leak) == ([0.35], [True], [16], ["orbench-toxic"])
    train = load_config(ELSTrainConfig, _yaml(tmp_path, "benign: orbench-hard-train\nlayers: 17\n"))
    assert train.benign == ["orbench-hard-train"] and train.layers == [17]
    with pytest.raises(AligntaxError, match=r"eta: expected list\[float\], got 'fast'"):
        load_config(SweepConfig, _yaml(tmp_path, "eta: fast\n"))


def test_unknown_keys_and_bad_yaml(tmp_path):
    with pytest.raises(AligntaxError, match="Unknown config keys for EvalConfig.*bogus"):
        load_config(EvalConfig, _yaml(tmp_path, "bogus: 1\n"))
    with pytest.raises(AligntaxError, match="not valid YAML"):
        load_config(EvalConfig, _yaml(tmp_path, "data: [xstest\n"))
    with pytest.raises(AligntaxError, match="must hold a mapping"):
        load_config(EvalConfig, _yaml(tmp_path, "- xstest\n"))


def test_a_saved_training_config_round_trips(tmp_path):
    from dataclasses import asdict

    cfg = ELSTrainConfig(layers=[1, 2], gate_recall=None)
    path = tmp_path / "train_config.json"
    path.write_text(json.dumps(asdict(cfg)))
    assert load_config(ELSTrainConfig, path) == cfg


def test_type_names():
    assert [type_name(t) for t in (int, list[str], float | None, list[float | bool | None], dict)] == [
        "int",
        "list[str]",
        "float | None",
        "list[float | bool | None]",
        "dict",
    ]


def test_eval_fails_on_a_bad_config_before_running(tmp_path):
    path = _yaml(tmp_path, "data: xstest\nmax_new_tokens: sixteen\n")
    res = CliRunner().invoke(app, ["eval", "--config", str(path), "--out", str(tmp_path / "run")])
    assert res.exit_code == 2
    assert "max_new_tokens: expected int, got 'sixteen'" in res.output
    assert not (tmp_path / "run").exists()
