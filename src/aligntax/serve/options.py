"""Per-request steering options, read from the intervention registry.

A request to the steered model may set options of the served method with
``{"aligntax": {"options": {"eta": 0.2, "horizon": 8}}}``. The allowed keys are the fields of the
method's options dataclass declared ``request=True`` (:mod:`aligntax.interventions.registry`: numbers,
layer lists and the ELS gate; never folders or text), each checked against its ``parse`` kind:

========================  =========================================  ==========================
parse                     JSON value                                  type (``/v1/models``)
========================  =========================================  ==========================
``float``                 a finite number                             ``number``
``int``                   an integer in [0, :data:`MAX_INT`]          ``integer``
``float_or_none``         a finite number or ``"none"``               ``number | "none"``
``int_or_none``           an integer or ``"none"``                    ``integer | "none"``
``gate``                  a probability in (0, 1), ``"saved"``,       ``number | "saved" | "none"``
                          ``"none"``
``layers``                a list of layer numbers                     ``array<integer>``
========================  =========================================  ==========================

A request with options is steered by an intervention built for the server's own options updated with
the request's (:class:`InterventionCache`: built once per distinct option set, the
``maxsize`` most recently used kept).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aligntax.errors import AligntaxError
from aligntax.interventions.options import METHODS, parse_value, spec_of
from aligntax.interventions.registry import make_intervention
from aligntax.serve.protocol import invalid

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

MAX_INT = 1024  # the largest integer a request may give (steps, horizon, top_k, layer numbers)
MAX_LAYERS = 256  # the longest layer list
_TYPES = {
    "float": "number",
    "int": "integer",
    "float_or_none": 'number | "none"',
    "int_or_none": 'integer | "none"',
    "gate": 'number | "saved" | "none"',
    "layers": "array<integer>",
}
_EXPECTED = {
    "float": "a finite number",
    "int": f"an integer from 0 to {MAX_INT}",
    "float_or_none": "a finite number or 'none'",
    "int_or_none": f"an integer from 0 to {MAX_INT} or 'none'",
    "gate": "a probability between 0 and 1 (exclusive), 'saved' or 'none'",
    "layers": f"a list of at most {MAX_LAYERS} layer numbers (integers from 0 to {MAX_INT})",
}


@dataclass(frozen=True)
class RequestField:
    """One per-request option of a method: the key, its JSON type, how it is checked, its help."""

    name: str
    parse: str
    help: str

    @property
    def type(self) -> str:
        return _TYPES[self.parse]

    def card(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "help": self.help}

    def check(self, value: Any) -> Any:
        """The value as the builder takes it (:func:`~aligntax.interventions.options.parse_value` of a JSON
        value), or None when it is not of this field's type or outside the server's bounds."""
        try:
            v = parse_value(value, self.parse, self.name, json=True)
        except AligntaxError:
            return None
        return v if _within_bounds(v, self.parse) else None


def _within_bounds(value: Any, parse: str) -> bool:
    """Whether a parsed request value is within what a request may ask: integers in [0, :data:`MAX_INT`],
    at most :data:`MAX_LAYERS` layers, a gate strictly between 0 and 1."""
    if parse in ("int", "int_or_none") and value != "none":
        return bool(0 <= value <= MAX_INT)
    if parse == "layers":
        return len(value) <= MAX_LAYERS and all(0 <= x <= MAX_INT for x in value)
    if parse == "gate" and isinstance(value, float):
        return 0.0 < value < 1.0
    return True


def request_fields(method: str | None) -> list[RequestField]:
    """The per-request options of registered method ``method`` (none for an unknown method or None)."""
    if method not in METHODS:
        return []
    out = []
    for f in dataclasses.fields(METHODS[method].options):
        spec = spec_of(f)
        if spec.request:
            if spec.parse not in _TYPES:
                raise AligntaxError(
                    f"Option '{f.name}' of '{method}' is marked per request but is read as "
                    f"'{spec.parse}', which a request cannot send."
                )
            out.append(RequestField(f.name, spec.parse, spec.help))
    return out


def parse_request_options(fields: list[RequestField], raw: dict[str, Any], model: str) -> dict[str, Any]:
    """The request's ``aligntax.options`` checked against ``fields``; a 400 naming the first bad key."""
    by_name = {f.name: f for f in fields}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        param = f"aligntax.options.{key}"
        field = by_name.get(key)
        if field is None:
            takes = ", ".join(by_name) if by_name else "none"
            raise invalid(
                f"Unrecognized steering option '{param}' for the model '{model}' (it takes: {takes}).",
                param,
                "unknown_parameter",
            )
        checked = field.check(value)
        if checked is None:
            got = (
                repr(value)
                if isinstance(value, (int, float, str, bool)) or value is None
                else type(value).__name__
            )
            if len(got) > 60:
                got = got[:57] + "..."
            raise invalid(
                f"Invalid value for '{param}': expected {_EXPECTED[field.parse]} (got {got}).",
                param,
                "invalid_type",
            )
        out[key] = checked
    return out


def options_key(options: dict[str, Any]) -> tuple[Any, ...]:
    """A hashable key of an option set (lists become tuples)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


class InterventionCache:
    """Interventions built per distinct option set (LRU, ``maxsize`` kept).

    ``build(options)`` makes one; concurrent requests with the same new options build it once."""

    def __init__(self, build: Callable[[dict[str, Any]], Any], maxsize: int = 16):
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.build = build
        self.maxsize = maxsize
        self._items: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()  # guards _items
        self._build_lock = threading.Lock()  # one build at a time
        self.builds = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, options: dict[str, Any]) -> Any:
        key = options_key(options)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        with self._build_lock:
            with self._lock:
                if key in self._items:
                    self._items.move_to_end(key)
                    return self._items[key]
            iv = self.build(dict(options))
            self.builds += 1
            with self._lock:
                self._items[key] = iv
                while len(self._items) > self.maxsize:
                    self._items.popitem(last=False)
        return iv


class RequestSteering:
    """The served method's per-request options and the interventions built for them."""

    def __init__(
        self,
        method: str,
        lm: LoadedModel,
        base_options: dict[str, Any] | None = None,
        maxsize: int = 16,
        check: Callable[[Any], None] | None = None,
    ) -> None:
        if method not in METHODS:
            raise AligntaxError(f"Unknown intervention '{method}'; known: {', '.join(METHODS)}.")
        self.method = method
        self.base = dict(base_options or {})
        self.fields = request_fields(method)

        def build(opts: dict[str, Any]) -> Any:
            iv = make_intervention(method, lm, **{**self.base, **opts})
            if check is not None:  # raises for an intervention the engine cannot serve
                check(iv)
            return iv

        self.cache = InterventionCache(build, maxsize)

    def parse(self, raw: dict[str, Any], model: str) -> dict[str, Any]:
        return parse_request_options(self.fields, raw, model)

    def intervention(self, options: dict[str, Any]) -> Any:
        """The intervention for ``options`` (built on first use); a 400 when the builder refuses them."""
        try:
            return self.cache.get(options)
        except AligntaxError as exc:
            raise invalid(f"These steering options cannot be used: {exc}", "aligntax.options") from None
        except (ValueError, TypeError) as exc:
            raise invalid(f"These steering options cannot be used: {exc}", "aligntax.options") from None

    def card(self) -> dict[str, Any]:
        return {"method": self.method, "options": [f.card() for f in self.fields]}


__all__ = [
    "MAX_INT",
    "InterventionCache",
    "RequestField",
    "RequestSteering",
    "options_key",
    "parse_request_options",
    "request_fields",
]
