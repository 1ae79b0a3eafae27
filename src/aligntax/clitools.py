"""Command-line building blocks shared by :mod:`aligntax.cli` and the optional sub-commands (lm-eval,
bundles): the clear-error exit, and the steering options every steering command gets from the
intervention registry (:mod:`aligntax.interventions.options`), declared once."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated

import typer
from rich.console import Console

from aligntax.errors import AligntaxError
from aligntax.interventions.registry import INTERVENTIONS, cli_options, grid_values, intervention_args

__all__ = ["InterventionOpt", "fail", "grid_options", "steering_options"]

console = Console(stderr=True)


def fail(exc: Exception) -> typing.NoReturn:
    """Print a clear error (no traceback) and exit with status 2."""
    console.print(f"[bold red]error:[/] {exc}", soft_wrap=True)  # no line breaks inside paths
    raise typer.Exit(2)


InterventionOpt = Annotated[str | None, typer.Option(help="the intervention: " + ", ".join(INTERVENTIONS))]


def _iv_name(intervention: str | None, steer: str | None) -> str | None:
    """``--steer DIR`` alone means ELS, or els-lora for a folder ``aligntax els distill`` wrote."""
    if steer and not intervention:
        from pathlib import Path

        return "els-lora" if (Path(steer) / "els_lora.json").is_file() else "els"
    return intervention


def steering_options(fn):
    """Add ``--intervention`` and every registered intervention option to a command. The command
    declares ``intervention`` and ``iv_args`` parameters and receives the method's name (``--steer DIR``
    alone means els) and its ``intervention_args`` (each value read as its option says; an option the
    method does not take is refused)."""

    opts = cli_options()
    hints = typing.get_type_hints(fn, include_extras=True)
    sig = inspect.signature(fn)
    keep = [p.replace(annotation=hints.get(n, p.annotation)) for n, p in sig.parameters.items() if n != "iv_args"]
    types = {"float": float, "int": int}
    extra = [inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Annotated[types.get(o.parse, str) | None,
                                                    typer.Option(o.flag, *o.aliases, help=o.help)])
             for o in opts]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = {o.param: kwargs.pop(o.param, None) for o in opts}
        name = _iv_name(kwargs.get("intervention"), given.get("iv_steer"))
        try:
            iv_args = intervention_args(name, given)
        except AligntaxError as exc:
            fail(exc)
        kwargs.update(intervention=name, iv_args=iv_args)
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=keep + extra)
    return wrapper


def grid_options(fn):
    """Add every ELS option that is a sweep grid axis to a command, as a comma-separated grid
    (``--eta 0.2,0.35``; ``none`` turns an option off; ``--layers 17;19,20`` gives layer sets). The
    command receives ``grid``: ``{field: [values]}`` for the axes given."""

    opts = [o for o in cli_options() if o.grid and "els" in o.methods]
    hints = typing.get_type_hints(fn, include_extras=True)
    sig = inspect.signature(fn)
    keep = [p.replace(annotation=hints.get(n, p.annotation)) for n, p in sig.parameters.items() if n != "grid"]
    extra = [inspect.Parameter(o.param, inspect.Parameter.KEYWORD_ONLY, default=None,
                               annotation=Annotated[str | None, typer.Option(
                                   o.flag, *o.aliases, help="comma-separated grid: " + o.help)])
             for o in opts]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            grid = {o.name: v for o in opts if (v := grid_values(kwargs.pop(o.param, None), o)) is not None}
        except AligntaxError as exc:
            fail(exc)
        return fn(*args, grid=grid, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=keep + extra)
    return wrapper


