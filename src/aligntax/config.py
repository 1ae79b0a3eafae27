"""YAML config files with command-line overrides, into typed dataclasses.

The values of a file are checked against the dataclass's field types (pydantic) before anything runs:
a value of the wrong type is one error naming the key and the type it needs, and a single value where a
list is expected (``data: xstest``) is a list of that one value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from aligntax.errors import AligntaxError

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Build ``cls`` from a YAML file (optional) and overrides; overrides that are None are ignored.

    Keys may be spelt with ``-`` or ``_``. Unknown keys and values of the wrong type are an
    :class:`AligntaxError` (naming the file, the key and the expected type); a value overridden by a
    flag is not checked."""
    values: dict[str, Any] = {}
    given = {k: v for k, v in overrides.items() if v is not None}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise AligntaxError(f"Config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise AligntaxError(f"Config file {p} is not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(loaded, dict):
            raise AligntaxError(f"Config file {p} must hold a mapping of option: value")
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
        _check_unknown(cls, values, f"config file {p}")
        values.update(
            check_types(cls, {k: v for k, v in values.items() if k not in given}, f"Config file {p}")
        )
    values.update(given)
    _check_unknown(cls, values, cls.__name__)
    return cls(**values)


def _check_unknown(cls, values: dict, where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise AligntaxError(
            f"Unknown config keys for {cls.__name__} in {where}: {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )


def check_types(cls, values: dict[str, Any], where: str) -> dict[str, Any]:
    """``values`` (field name -> value) checked against the field types of the dataclass ``cls`` and
    converted where the conversion is lossless ("16" -> 16; a single value -> a one-element list);
    :class:`AligntaxError` naming every key of the wrong type."""
    from pydantic import ValidationError

    hints = _hints(cls)
    out, bad = {}, []
    for key, value in values.items():
        tp = hints.get(key)
        if tp is None:
            out[key] = value
            continue
        if value is not None and _wants_list(tp) and not isinstance(value, list | tuple):
            value = [value]
        try:
            out[key] = _adapter(tp).validate_python(value)
        except ValidationError:
            bad.append(f"{key}: expected {type_name(tp)}, got {_show(values[key])}")
    if bad:
        raise AligntaxError(f"{where}: {'; '.join(bad)}")
    return out


@cache
def _hints(cls) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):  # a field type only known to type checkers: not checked
        return {}


@cache
def _adapter(tp):
    from pydantic import ConfigDict, TypeAdapter

    return TypeAdapter(tp, config=ConfigDict(arbitrary_types_allowed=True))


def _wants_list(tp) -> bool:
    if typing.get_origin(tp) in (list, tuple):
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(typing.get_origin(a) in (list, tuple) for a in typing.get_args(tp))
    return False


def type_name(tp) -> str:
    """A field type as a reader writes it: ``int``, ``list[str]``, ``float | None``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"
