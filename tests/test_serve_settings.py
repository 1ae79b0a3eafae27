"""The server's settings, declared once (:class:`aligntax.serve.settings.ServerSettings`): every field is
an option of ``aligntax serve`` with its help and default, a key of the ``--config`` YAML file (flags win
over the file), checked by the same range rule everywhere, and read by the app and the engine."""

from __future__ import annotations

import dataclasses
import re

import pytest
from typer.testing import CliRunner

import aligntax.serve.app as serve_app
from aligntax.cli import app
from aligntax.errors import AligntaxError
from aligntax.interventions.options import flag_of, spec_of
from aligntax.serve import ServerSettings, create_app
from serve_tiny import tiny_lm


@pytest.fixture(scope="module")
def lm(one_thread):
    return tiny_lm()


def _served(monkeypatch, lm, *args: str):
    """``aligntax serve ARGS`` with the model loading and uvicorn replaced: the app it would run."""
    seen = {}
    monkeypatch.setattr("aligntax.models.loader.load_model", lambda *a, **k: lm)
    monkeypatch.setattr(serve_app, "serve", lambda app, **kw: seen.setdefault("app", app))
    res = CliRunner().invoke(app, ["serve", *args])
    return res, seen.get("app")


def test_every_setting_is_an_option_with_its_declared_help_and_default():
    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    for f in dataclasses.fields(ServerSettings):
        spec = spec_of(f)
        found = [line for line in lines if re.match(rf"^\W*{flag_of(f)}\s", line)]  # its own row
        if not spec.cli:
            assert not found, f.name
            continue
        assert len(found) == 1, (f.name, found)
        assert spec.help.split(".")[0] in found[0]
        if f.default not in (None, True, False):
            assert f"[default: {f.default}]" in found[0], found[0]


def test_yaml_settings_with_flags_over_them_reach_the_app_and_the_engine(monkeypatch, lm, tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("port: 8123\nmax_batch_size: 4\nmax-tokens-limit: 100\nrequest_timeout: 7\n")
    res, served = _served(monkeypatch, lm, "--config", str(cfg), "--max-batch-size", "6", "--model-name", "m")
    assert res.exit_code == 0, res.output
    s = served.state.settings
    assert (s.port, s.max_batch_size, s.max_tokens_limit, s.request_timeout) == (8123, 6, 100, 7.0)
    assert s.batch_wait_ms == ServerSettings().batch_wait_ms  # neither given: the declared default
    assert served.state.engine.max_batch_size == 6 and served.state.handler.model_names() == ["m"]
    assert "http://127.0.0.1:8123/v1" in res.output


@pytest.mark.parametrize(
    ("yaml", "args", "message"),
    [
        ("max_batch_size: 0\n", [], "--max-batch-size takes a whole number >= 1, not 0."),
        ("max_batch: 3\n", [], "Unknown config keys for ServerSettings"),
        ("max_batch_size: lots\n", [], "max_batch_size: expected int"),
        ("", ["--request-timeout", "0"], "--request-timeout takes a finite number > 0, not 0.0."),
        ("", ["--port", "70000"], "--port takes a TCP port from 0 (any free one) to 65535, not 70000."),
    ],
)
def test_a_bad_setting_is_one_error_line_before_anything_loads(monkeypatch, tmp_path, yaml, args, message):
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml or "{}\n")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("aligntax.models.loader.load_model", no_model)
    res = CliRunner().invoke(app, ["serve", "--config", str(cfg), *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_the_library_checks_settings_as_the_command_line_does(lm):
    with pytest.raises(AligntaxError, match="--max-queue takes a whole number >= 1"):
        ServerSettings(max_queue=0)
    built = create_app(lm, None, ServerSettings(max_queue_wait_ms=50, max_tokens_limit=64))
    assert built.state.engine.max_queue_wait == pytest.approx(0.05)
    assert built.state.settings.model_name and built.state.settings.max_prompt_tokens  # resolved
