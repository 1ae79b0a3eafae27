"""The command line: every command has --help, and bad input exits with a clear message."""

import json

import pytest
from typer.testing import CliRunner

from aligntax.cli import app

runner = CliRunner()

COMMANDS = [
    [],
    ["models"],
    ["models", "list"],
    ["models", "fetch"],
    ["models", "info"],
    ["data", "list"],
    ["data", "fetch"],
    ["generate"],
    ["chat"],
    ["judge"],
    ["eval"],
    ["rejudge"],
    ["fluency"],
    ["demo"],
    ["els", "train"],
    ["els", "sweep"],
    ["vat", "run"],
    ["vat", "compare"],
    ["audit"],
    ["serve"],
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "root")
def test_help(cmd):
    res = runner.invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


def test_models_list():
    res = runner.invoke(app, ["models", "list"])
    assert res.exit_code == 0 and "embedded:qwen" in res.output and "embedded:smollm2" in res.output


def test_unknown_embedded_model_is_a_clear_error():
    res = runner.invoke(app, ["models", "info", "embedded:nope"])
    assert res.exit_code == 2 and "Unknown embedded model" in res.output


def test_repeated_list_options_take_none():
    from aligntax.cli.options import split_list

    assert split_list(None) is None and split_list([]) is None
    assert split_list(["none"]) == [] and split_list(["None "]) == []
    assert split_list(["a", "b"]) == ["a", "b"]


def test_eval_without_data_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["eval", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "No data given" in res.output


def test_eval_config_file_with_overrides_and_unknown_key(tmp_path):
    from aligntax.config import load_config
    from aligntax.errors import AligntaxError
    from aligntax.runs import EvalConfig

    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("data: [xstest]\nmax-new-tokens: 16\njudge: keyword\n")
    cfg = load_config(EvalConfig, cfg_file, max_new_tokens=32, judge=None)
    assert cfg.data == ["xstest"] and cfg.max_new_tokens == 32 and cfg.judge == "keyword"
    cfg_file.write_text("bogus: 1\n")
    with pytest.raises(AligntaxError, match="Unknown config keys"):
        load_config(EvalConfig, cfg_file)


def test_judge_command_round_trip(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"prompt": "p", "response": "I'm sorry, but I can't help with that."})
        + "\n"
        + json.dumps({"prompt": "q", "response": "Sure! Run `kill -9 1234`."})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    res = runner.invoke(app, ["judge", "--in", str(src), "--out", str(out), "--judge", "keyword"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["refused"] for r in rows] == [True, False]


def test_els_flags_take_none_to_turn_a_tuned_setting_off():
    from aligntax.errors import AligntaxError
    from aligntax.interventions.registry import cli_options, grid_values, intervention_args

    args = intervention_args(
        "els", {"iv_steer": "bank", "iv_energy_threshold": "none", "iv_gate": "0.3", "iv_horizon": "8"}
    )
    assert args == {"path": "bank", "threshold": "none", "gate": 0.3, "horizon": 8}
    assert intervention_args("els", {"iv_gate": "None"})["gate"] == "none"
    with pytest.raises(AligntaxError, match="--horizon"):
        intervention_args("els", {"iv_horizon": "eight"})
    opts = {o.flag: o for o in cli_options()}
    assert grid_values("none, 8,16", opts["--horizon"]) == [None, 8, 16]  # sweep grids parse the same way
    with pytest.raises(AligntaxError, match="--gate"):
        grid_values("0.5,half", opts["--gate"])
    # 'saved' is the gate's own (recall-calibrated) threshold, on the command line and in sweep grids
    assert intervention_args("els", {"iv_gate": "saved"})["gate"] is True
    assert grid_values("none,saved,0.5", opts["--gate"]) == [None, True, 0.5]
    assert grid_values("17;19,20", opts["--layers"]) == [[17], [19, 20]]
    # an option of another method is refused, naming the methods that take it
    with pytest.raises(
        AligntaxError, match="--eta is an option of els, els-compose, not of 'refusal-ablation'"
    ):
        intervention_args("refusal-ablation", {"iv_eta": "0.3"})


def test_every_registered_option_is_on_the_steering_commands_once():
    """The options are declared once (aligntax.interventions.registry) and every steering command gets
    all of them; --threshold stays an alias of --energy-threshold."""
    from aligntax.interventions.registry import cli_options

    env = {"COLUMNS": "300", "NO_COLOR": "1", "TERM": "dumb"}
    for cmd in ("generate", "chat", "eval", "mc", "knowns"):
        res = runner.invoke(app, [cmd, "--help"], env=env)
        assert res.exit_code == 0, res.output
        for o in cli_options():
            assert o.flag in res.output, (cmd, o.flag)
        assert "--threshold" in res.output
    res = runner.invoke(app, ["els", "sweep", "--help"], env=env)
    for flag in (
        "--eta",
        "--row-threshold",
        "--energy-threshold",
        "--gate-ramp",
        "--layers-grid",
        "--horizon",
    ):
        assert flag in res.output, flag


def test_a_wrong_option_for_the_method_is_a_clear_cli_error(tmp_path):
    res = runner.invoke(app, ["generate", "hi", "--intervention", "refusal-ablation", "--eta", "0.3"])
    assert res.exit_code == 2 and "--eta is an option of els" in res.output, res.output
    res = runner.invoke(app, ["generate", "hi", "--steer", str(tmp_path), "--horizon", "eight"])
    assert res.exit_code == 2 and "--horizon takes a number or 'none'" in res.output, res.output
