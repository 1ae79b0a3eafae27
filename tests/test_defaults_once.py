"""No option default is written twice. The declarations (every field declared with ``option(...)``: the
intervention methods' options and the server's :class:`~aligntax.serve.settings.ServerSettings`) are
walked together with the command line (every command of ``aligntax``) and the library entry points that
take the server's settings:

- a command-line option generated from a declaration has no default of its own (the value comes from
  the field, and ``--help`` shows the field's);
- the app and both serving engines take the settings object, never one of its settings as a keyword
  with a default of its own;
- the run configurations and the command line do not add new pairs of the same default written twice
  (the pairs still written in both places are listed, to be declared once as the server's are; a pair
  removed from the code must leave the list too, so the list only shrinks)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import typer.main

from aligntax.cli import app
from aligntax.interventions.options import flag_of, spec_of
from aligntax.interventions.registry import METHODS
from aligntax.serve.settings import ServerSettings


def declared() -> dict[str, str]:
    """Every command-line flag of a declared option -> where it is declared (``Class.field``)."""
    owners = [m.options for m in METHODS.values()] + [ServerSettings]
    out: dict[str, str] = {}
    for cls in owners:
        for f in dataclasses.fields(cls):
            spec = spec_of(f)
            if spec.cli and "option" in f.metadata:
                for flag in (flag_of(f), *spec.aliases):
                    out[flag] = f"{cls.__name__}.{f.name}"
    return out


def commands():
    """(command path, click parameter) of every option of every ``aligntax`` command."""
    root = typer.main.get_command(app)

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
            return
        for p in cmd.params:
            yield " ".join(path), p

    yield from walk(root, [])


def test_options_generated_from_declarations_have_no_default_of_their_own():
    flags = declared()
    twice = []
    for path, p in commands():
        for flag in p.opts:
            if flag in flags and p.default is not None:
                twice.append(f"aligntax {path} {flag}: default {p.default!r} here and in {flags[flag]}")
    assert not twice, "\n".join(twice)
    # the walk sees the generated options: the server's and the steering options are there
    seen = {flag for _, p in commands() for flag in p.opts}
    assert {"--max-batch-size", "--request-timeout", "--eta", "--gate"} <= seen


def test_the_app_and_the_engines_take_the_settings_not_their_own_defaults():
    from aligntax.backends.vllm.serve_engine import VllmServeEngine
    from aligntax.backends.vllm.serving import create_vllm_app
    from aligntax.serve.app import create_app, serve
    from aligntax.serve.engine import BatchEngine

    names = {f.name for f in dataclasses.fields(ServerSettings)}
    for fn in (create_app, serve, BatchEngine.__init__, VllmServeEngine.__init__, create_vllm_app):
        params = set(inspect.signature(fn).parameters)
        assert not params & names, f"{fn.__qualname__} takes {sorted(params & names)} beside the settings"


# Run configurations whose fields the command line still writes a default for; each pair is
# (command, option). They are to be declared once, as ServerSettings is; the list must only shrink.
RUN_CONFIGS = {
    "aligntax.runs.eval": "EvalConfig",
    "aligntax.runs.knowns": "KnownsConfig",
    "aligntax.runs.mc": "MCConfig",
    "aligntax.runs.demo": "DemoConfig",
    "aligntax.vat.runner": "VATConfig",
    "aligntax.lmeval.run": "LmEvalConfig",
}
KNOWN_TWICE = {
    ("data fetch", "progress"),
    ("demo", "backend"),
    ("demo", "batch_size"),
    ("demo", "max_new_tokens"),
    ("demo", "model"),
    ("demo", "progress"),
    ("export", "dtype"),
    ("fluency", "progress"),
    ("generate", "backend"),
    ("generate", "batch_size"),
    ("generate", "max_new_tokens"),
    ("generate", "progress"),
    ("generate", "top_p"),
    ("knowns", "batch_size"),
    ("knowns", "data"),
    ("knowns", "max_new_tokens"),
    ("knowns", "progress"),
    ("knowns", "split"),
    ("mc", "batch_size"),
    ("mc", "data"),
    ("mc", "progress"),
    ("serve", "backend"),
    ("vat matrix", "batch_size"),
    ("vat matrix", "data"),
    ("vat rescore", "bootstrap_method"),
    ("vat rescore", "eps"),
    ("vat run", "batch_size"),
    ("vat run", "data"),
    ("vat run", "progress"),
    ("vat run", "split"),
}


def test_no_new_default_is_written_both_in_a_command_and_a_run_configuration():
    fields: dict[tuple[str, str], set[str]] = {}  # (field, its default as text) -> the configs
    for module, name in RUN_CONFIGS.items():
        cls = getattr(importlib.import_module(module), name)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and f.default is not None:
                fields.setdefault((f.name, str(f.default)), set()).add(name)
    found, new = set(), []
    for path, p in commands():
        where = fields.get((p.name, str(p.default)))
        if p.default in (None, False) or not where or path.startswith("els "):
            continue  # (the ELS commands' options are being declared once in their configs)
        found.add((path, p.name))
        if (path, p.name) not in KNOWN_TWICE:
            flag = "--" + p.name.replace("_", "-")
            new.append(f"aligntax {path} {flag}: {p.default!r} here and in {sorted(where)}")
    assert not new, "defaults written twice (declare the option once):\n" + "\n".join(new)
    gone = sorted(KNOWN_TWICE - found)
    assert not gone, f"declared once now: remove {gone} from KNOWN_TWICE"
