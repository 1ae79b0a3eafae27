"""Each intervention's options, declared once.

A method registers itself with :func:`register` (name, a typed options dataclass, a builder). Every
field of an options dataclass is declared with :func:`option`: its help text, its command-line flag
(and old spellings), how a text value is read, whether it is an axis of the ``aligntax els sweep``
grid, and whether a server client may set it per request. The command-line options of generate, chat,
eval, mc and knowns, the YAML ``intervention_args`` keys (the field names), the sweep's grid options
and the server's per-request fields are all read from here, so a new method or option is declared in
one place.

This module imports nothing of aligntax but the errors: every layer may read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aligntax.errors import AligntaxError

__all__ = ["CHECKS", "METHODS", "Method", "OptionSpec", "check_value", "cli_options", "option", "options_of",
           "parse_value", "register"]


@dataclass(frozen=True)
class OptionSpec:
    """How one option is shown and read.

    ``parse``: ``float``, ``int``, ``str``, ``float_or_none`` / ``int_or_none`` (a number, or ``none``
    to turn a tuned setting off), ``gate`` (a probability, ``saved`` or ``none``), ``layers``
    (comma-separated ints), ``switch`` (``on``/``saved`` or ``off``/``none``). ``check``: the range rule
    a value must meet (a key of :data:`CHECKS`,
    applied on every face: command line, sweep grids, YAML ``intervention_args``, the library's keyword
    options); ``none`` / ``saved`` pass. ``cli``: offered on the command line; ``grid``: an axis of the
    ELS sweep (comma-separated values); ``request``: a server client may set it per request."""

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    parse: str = "str"
    check: str | None = None
    cli: bool = True
    grid: bool = False
    request: bool = False


# Range rules: name -> (test of one finite number, what the message says the option takes). Every
# rule also refuses nan and infinities.
CHECKS: dict[str, tuple[Callable[[float], bool], str]] = {
    "finite": (lambda v: True, "a finite number"),
    "positive": (lambda v: v > 0, "a finite number > 0"),
    "nonnegative": (lambda v: v >= 0, "a finite number >= 0"),
    "count": (lambda v: v >= 0 and float(v).is_integer(), "a whole number >= 0"),
    "positive_count": (lambda v: v >= 1 and float(v).is_integer(), "a whole number >= 1"),
    "probability": (lambda v: 0 <= v <= 1, "a probability between 0 and 1"),
}


def check_value(value: Any, check: str | None, flag: str) -> Any:
    """``value`` when it meets the range rule ``check`` (each entry of a list does); else a clear
    error naming ``flag``. ``None``, ``"none"``, booleans (the gate's ``saved``) and text pass."""
    if check is None or value is None:
        return value
    test, what = CHECKS[check]
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v) or not test(v):
            raise AligntaxError(f"{flag} takes {what}, not {v!r}.")
    return value


def option(help: str, default: Any = None, **spec) -> Any:
    """A dataclass field carrying its :class:`OptionSpec`."""
    return field(default=default, metadata={"option": OptionSpec(help, **spec)})


def spec_of(f: dataclasses.Field) -> OptionSpec:
    return f.metadata.get("option") or OptionSpec(help=f.name)


def flag_of(f: dataclasses.Field) -> str:
    return spec_of(f).flag or "--" + f.name.replace("_", "-")


@dataclass(frozen=True)
class Method:
    """A registered intervention: its name, options dataclass, builder ``build(lm, options)`` and a line of help."""

    name: str
    options: type
    build: Callable[[Any, Any], Any]
    help: str

    def make(self, lm=None, *, only_known: bool = False, **kwargs):
        """Build with keyword options (None values ignored; ``dir=``/``directory=`` mean ``path=``); an
        option the method does not take is refused, or, with ``only_known``, left out (a caller holding
        the options of several methods)."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        if only_known:
            known = {f.name for f in dataclasses.fields(self.options)}
            kwargs = {k: v for k, v in kwargs.items() if k in known or k in ("dir", "directory")}
        for alias in ("dir", "directory"):
            if alias in kwargs:
                if "path" in kwargs:
                    raise AligntaxError(f"Intervention '{self.name}': give the folder once (path= or {alias}=).")
                kwargs["path"] = kwargs.pop(alias)
        self.check(kwargs)
        return self.build(lm, self.options(**kwargs))

    def check(self, kwargs: dict) -> None:
        """Refuse an option the method does not take, or a value outside its option's range rule."""
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        unknown = sorted(set(kwargs) - set(fields) - {"dir", "directory"})
        if unknown:
            raise AligntaxError(f"Unknown options for intervention '{self.name}': {', '.join(unknown)} "
                                f"(it takes {', '.join(sorted(fields)) or 'none'}).")
        for name, value in kwargs.items():
            if name in fields:
                check_value(value, spec_of(fields[name]).check, f"{self.name} option {name}")


METHODS: dict[str, Method] = {}


def register(name: str, options: type, help: str, registry: dict[str, Method] | None = None) -> Callable:
    """Decorator: register ``build(lm, options) -> Intervention`` as intervention ``name`` in ``registry``
    (default :data:`METHODS`, the steering methods; the value alignment tax layers its value-targeted
    methods, built from a context instead of a model, on them: :mod:`aligntax.vat.methods`)."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"{options!r} is not a dataclass")
    table = METHODS if registry is None else registry

    def deco(build: Callable) -> Callable:
        if name in table:
            raise AligntaxError(f"Intervention '{name}' is registered twice.")
        table[name] = Method(name, options, build, help)
        return build
    return deco


def options_of(name: str) -> list[dataclasses.Field]:
    return list(dataclasses.fields(METHODS[name].options))


def parse_value(text: Any, parse: str, flag: str) -> Any:
    """A text value (command line, comma-separated grid entry) read as ``parse`` says."""
    if not isinstance(text, str):
        return text
    t = text.strip()
    try:
        if parse in ("float_or_none", "int_or_none", "gate") and t.lower() == "none":
            return "none"
        if parse == "switch":
            if t.lower() in ("on", "saved", "true", "yes", "1"):
                return True
            if t.lower() in ("off", "none", "false", "no", "0"):
                return "none"
            raise ValueError(t)
        if parse == "gate":
            return True if t.lower() == "saved" else float(t)
        if parse in ("float", "float_or_none"):
            return float(t)
        if parse in ("int", "int_or_none"):
            return int(t)
        if parse == "layers":
            return [int(x) for x in t.split(",") if x.strip()]
    except ValueError:
        kind = {"gate": "a probability, 'saved' or 'none'", "layers": "comma-separated layer numbers",
                "switch": "'on' or 'off'"}.get(
            parse, "a number" + (" or 'none'" if parse.endswith("_or_none") else ""))
        raise AligntaxError(f"{flag} takes {kind}, not {text!r}.") from None
    return t


@dataclass(frozen=True)
class CliOption:
    """One command-line option shared by the methods that declare it (same flag, same field name)."""

    flag: str
    aliases: tuple[str, ...]
    name: str  # the options field (the ``intervention_args`` key)
    help: str
    parse: str
    methods: tuple[str, ...]
    grid: bool
    check: str | None = None

    @property
    def param(self) -> str:
        """A Python parameter name for the flag."""
        return "iv_" + self.flag.lstrip("-").replace("-", "_")


def cli_options(methods: Mapping[str, Method] | None = None) -> list[CliOption]:
    """Every command-line option of the registered methods (of ``methods``, default :data:`METHODS`),
    one per flag, in declaration order."""
    out: dict[str, CliOption] = {}
    for method in (METHODS if methods is None else methods).values():
        for f in dataclasses.fields(method.options):
            spec = spec_of(f)
            if not spec.cli:
                continue
            flag = flag_of(f)
            prev = out.get(flag)
            if prev is None:
                out[flag] = CliOption(flag, spec.aliases, f.name, spec.help, spec.parse, (method.name,), spec.grid,
                                      spec.check)
            else:
                if prev.name != f.name or prev.parse != spec.parse or prev.check != spec.check:
                    raise AligntaxError(f"{flag} means different options in {prev.methods} and {method.name}.")
                out[flag] = dataclasses.replace(prev, methods=(*prev.methods, method.name),
                                                aliases=tuple(dict.fromkeys(prev.aliases + spec.aliases)))
    return list(out.values())


def intervention_args(name: str | None, given: dict[str, Any], methods: Mapping[str, Method] | None = None) -> dict:
    """``intervention_args`` from command-line values ``{param: text or value}`` (None: not given) of the
    options of ``methods`` (default :data:`METHODS`): each read as its option says; an option the
    chosen method does not take is refused."""
    table = METHODS if methods is None else methods
    method = table.get(name) if name else None
    args: dict = {}
    for opt in cli_options(methods):
        value = given.get(opt.param)
        if value is None:
            continue
        if method is not None and method.name not in opt.methods:
            raise AligntaxError(f"{opt.flag} is an option of {', '.join(opt.methods)}, not of '{name}'.")
        args[opt.name] = check_value(parse_value(value, opt.parse, opt.flag), opt.check, opt.flag)
    return args


def grid_values(text: str | None, opt: CliOption) -> list | None:
    """A sweep grid axis: ``"none,0,0.5"`` -> ``[None, 0.0, 0.5]``; ``layers`` sets are separated by ``;``."""
    if not text:
        return None
    parts = text.split(";") if opt.parse == "layers" else text.split(",")
    values = [check_value(parse_value(x, opt.parse, opt.flag), opt.check, opt.flag) for x in parts if x.strip()]
    return [None if v == "none" else v for v in values]
