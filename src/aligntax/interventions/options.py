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
from typing import TYPE_CHECKING, Any

from aligntax.errors import AligntaxError

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

__all__ = [
    "CHECKS",
    "METHODS",
    "PATH_KEYS",
    "Method",
    "OptionSpec",
    "check_value",
    "cli_options",
    "grid_fields",
    "need_path",
    "option",
    "options_of",
    "parse_value",
    "register",
    "split_path",
]


@dataclass(frozen=True)
class OptionSpec:
    """How one option is shown and read.

    ``parse``: ``float``, ``int``, ``str``, ``float_or_none`` / ``int_or_none`` (a number, or ``none``
    to turn a tuned setting off), ``gate`` (a probability, ``saved`` or ``none``), ``layers``
    (comma-separated ints), ``switch`` (``on``/``saved`` or ``off``/``none``). ``check``: the range rule
    a value must meet (a key of :data:`CHECKS`,
    applied on every face: command line, sweep grids, YAML ``intervention_args``, the library's keyword
    options); ``none`` / ``saved`` pass. ``cli``: offered on the command line; ``grid``: an axis of the
    ELS sweep (comma-separated values), ``grid_default`` its values when a sweep does not give them, and
    ``off`` a value that means the same as none (left out of a sweep setting, as none is);
    ``optional``: added after the first sweeps, so a sweep setting leaves it out of its key when unset
    (None or ``off``) and rows scored before it existed keep theirs; ``request``: a server client may set
    it per request. ``fallback``: the value a builder takes when no one gives the option (ELS: neither
    the caller nor the folder's tuned setting; ``DEFAULT_SETTINGS`` is read from it). ``envvar``: the
    environment variable the command line reads when the flag is not given (a settings field)."""

    help: str
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    parse: str = "str"
    check: str | None = None
    cli: bool = True
    grid: bool = False
    grid_default: tuple[Any, ...] = (None,)
    off: Any = None
    optional: bool = False
    request: bool = False
    fallback: Any = None
    envvar: str | None = None

    @property
    def value_type(self) -> Any:
        """The type of one value of this option as the builders take it (a sweep grid holds a list of them)."""
        return _VALUE_TYPES.get(self.parse, str)


_VALUE_TYPES: dict[str, Any] = {
    "float": float,
    "int": int,
    "float_or_none": float | None,
    "int_or_none": int | None,
    "gate": float | bool | None,
    "switch": bool | None,
    "layers": list[int],
}


# Range rules: name -> (test of one finite number, what the message says the option takes). Every
# rule also refuses nan and infinities.
CHECKS: dict[str, tuple[Callable[[float], bool], str]] = {
    "finite": (lambda v: True, "a finite number"),
    "positive": (lambda v: v > 0, "a finite number > 0"),
    "nonnegative": (lambda v: v >= 0, "a finite number >= 0"),
    "count": (lambda v: v >= 0 and float(v).is_integer(), "a whole number >= 0"),
    "positive_count": (lambda v: v >= 1 and float(v).is_integer(), "a whole number >= 1"),
    "probability": (lambda v: 0 <= v <= 1, "a probability between 0 and 1"),
    "at_least_one": (lambda v: v >= 1, "a number >= 1"),
    "port": (
        lambda v: 0 <= v <= 65535 and float(v).is_integer(),
        "a TCP port from 0 (any free one) to 65535",
    ),
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


def option(help: str, default: Any = None, **spec: Any) -> Any:
    """A dataclass field carrying its :class:`OptionSpec`."""
    return field(default=default, metadata={"option": OptionSpec(help, **spec)})


def spec_of(f: dataclasses.Field[Any]) -> OptionSpec:
    return f.metadata.get("option") or OptionSpec(help=f.name)


def flag_of(f: dataclasses.Field[Any]) -> str:
    return spec_of(f).flag or "--" + f.name.replace("_", "-")


PATH_KEYS = ("path", "dir", "directory")  # the spellings of an intervention's folder option


def split_path(options: dict[str, Any], name: str) -> tuple[Any, dict[str, Any]]:
    """An intervention's folder, given as ``path=``, ``dir=`` or ``directory=`` (None when none is set), and
    its other options that are set; the folder given under two spellings is refused (``name``: the
    intervention, for the message)."""
    given = [k for k in PATH_KEYS if options.get(k) is not None]
    if len(given) > 1:
        raise AligntaxError(f"Intervention '{name}': give the folder once (path= or {given[1]}=).")
    rest = {k: v for k, v in options.items() if k not in PATH_KEYS and v is not None}
    return (options[given[0]] if given else None), rest


def need_path(name: str, path: str | None) -> str:
    """The folder option of intervention ``name``, which loads a saved artefact from it: refused when missing."""
    if not path:
        raise AligntaxError(f"Intervention '{name}' needs dir= (the folder of its saved artefact).")
    return path


@dataclass(frozen=True)
class Method:
    """A registered intervention: its name, options dataclass, builder ``build(lm, options)`` and a line of help."""

    name: str
    options: type
    build: Callable[[Any, Any], Any]
    help: str

    def make(self, lm: LoadedModel | None = None, *, only_known: bool = False, **kwargs: Any) -> Any:
        """Build with keyword options (None values ignored; ``dir=``/``directory=`` mean ``path=``); an
        option the method does not take is refused, or, with ``only_known``, left out (a caller holding
        the options of several methods)."""
        if only_known:
            known = {f.name for f in dataclasses.fields(self.options)}
            kwargs = {k: v for k, v in kwargs.items() if k in known or k in PATH_KEYS}
        path, kwargs = split_path(kwargs, self.name)
        if path is not None:
            kwargs["path"] = path
        self.check(kwargs)
        return self.build(lm, self.options(**kwargs))

    def check(self, kwargs: dict[str, Any]) -> None:
        """Refuse an option the method does not take, or a value outside its option's range rule."""
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        unknown = sorted(set(kwargs) - set(fields) - set(PATH_KEYS))
        if unknown:
            raise AligntaxError(
                f"Unknown options for intervention '{self.name}': {', '.join(unknown)} "
                f"(it takes {', '.join(sorted(fields)) or 'none'})."
            )
        for name, value in kwargs.items():
            if name in fields:
                check_value(value, spec_of(fields[name]).check, f"{self.name} option {name}")


METHODS: dict[str, Method] = {}


def register(
    name: str, options: type, help: str, registry: dict[str, Method] | None = None
) -> Callable[..., Any]:
    """Decorator: register ``build(lm, options) -> Intervention`` as intervention ``name`` in ``registry``
    (default :data:`METHODS`, the steering methods; the value alignment tax layers its value-targeted
    methods, built from a context instead of a model, on them: :mod:`aligntax.vat.methods`)."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"{options!r} is not a dataclass")
    table = METHODS if registry is None else registry

    def deco(build: Callable[..., Any]) -> Callable[..., Any]:
        if name in table:
            raise AligntaxError(f"Intervention '{name}' is registered twice.")
        table[name] = Method(name, options, build, help)
        return build

    return deco


def options_of(name: str) -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(METHODS[name].options))


def grid_fields(name: str) -> list[dataclasses.Field[Any]]:
    """The options of method ``name`` that are axes of the sweep grid (declared ``grid=True``), in order."""
    return [f for f in options_of(name) if spec_of(f).grid]


_KEYWORDS = {"float_or_none": ("none",), "int_or_none": ("none",), "gate": ("none", "saved")}


def parse_value(value: Any, parse: str, flag: str, *, json: bool = False) -> Any:
    """One option value as the builders take it, read as ``parse`` says (see :class:`OptionSpec`); a value
    it cannot read is an :class:`AligntaxError` naming ``flag``.

    Text (the command line, a comma-separated grid entry, lm-eval's model args) is parsed; any other value
    (YAML, lm-eval) is taken as it is, a single layer number as a one-element list. With ``json`` (a server
    request's JSON) a value must already have its type: a finite number, an integer, a non-empty list of
    integers, and text only for the words ``none`` and ``saved``. ``none`` gives ``"none"`` (off, even if
    tuned), ``saved`` gives True."""
    if json:
        return _json_value(value, parse, flag)
    if not isinstance(value, str):
        return (
            [value] if parse == "layers" and isinstance(value, int) and not isinstance(value, bool) else value
        )
    t = value.strip()
    try:
        if parse in _KEYWORDS and t.lower() == "none":
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
        kind = {
            "gate": "a probability, 'saved' or 'none'",
            "layers": "comma-separated layer numbers",
            "switch": "'on' or 'off'",
        }.get(parse, "a number" + (" or 'none'" if parse.endswith("_or_none") else ""))
        raise AligntaxError(f"{flag} takes {kind}, not {value!r}.") from None
    return t


def _json_value(value: Any, parse: str, flag: str) -> Any:
    """:func:`parse_value` of a JSON value: the value when it has ``parse``'s type."""
    if isinstance(value, str) and value in _KEYWORDS.get(parse, ()):
        return True if value == "saved" else value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if parse in ("float", "float_or_none", "gate") and number and math.isfinite(value):
        return float(value)
    if parse in ("int", "int_or_none") and number and isinstance(value, int):
        return value
    if (
        parse == "layers"
        and isinstance(value, list)
        and value
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    ):
        return list(value)
    if parse == "str" and isinstance(value, str):
        return value
    raise AligntaxError(f"{flag} cannot be {value!r} (it is read as {parse}).")


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
                out[flag] = CliOption(
                    flag, spec.aliases, f.name, spec.help, spec.parse, (method.name,), spec.grid, spec.check
                )
            else:
                if prev.name != f.name or prev.parse != spec.parse or prev.check != spec.check:
                    raise AligntaxError(
                        f"{flag} means different options in {prev.methods} and {method.name}."
                    )
                out[flag] = dataclasses.replace(
                    prev,
                    methods=(*prev.methods, method.name),
                    aliases=tuple(dict.fromkeys(prev.aliases + spec.aliases)),
                )
    return list(out.values())


def intervention_args(
    name: str | None, given: dict[str, Any], methods: Mapping[str, Method] | None = None
) -> dict[str, Any]:
    """``intervention_args`` from command-line values ``{param: text or value}`` (None: not given) of the
    options of ``methods`` (default :data:`METHODS`): each read as its option says; an option the
    chosen method does not take is refused."""
    table = METHODS if methods is None else methods
    method = table.get(name) if name else None
    args: dict[str, Any] = {}
    for opt in cli_options(methods):
        value = given.get(opt.param)
        if value is None:
            continue
        if method is not None and method.name not in opt.methods:
            raise AligntaxError(f"{opt.flag} is an option of {', '.join(opt.methods)}, not of '{name}'.")
        args[opt.name] = check_value(parse_value(value, opt.parse, opt.flag), opt.check, opt.flag)
    return args


def grid_values(text: str | None, opt: CliOption) -> list[Any] | None:
    """A sweep grid axis: ``"none,0,0.5"`` -> ``[None, 0.0, 0.5]``; ``layers`` sets are separated by ``;``."""
    if not text:
        return None
    parts = text.split(";") if opt.parse == "layers" else text.split(",")
    values = [
        check_value(parse_value(x, opt.parse, opt.flag), opt.check, opt.flag) for x in parts if x.strip()
    ]
    return [None if v == "none" else v for v in values]
