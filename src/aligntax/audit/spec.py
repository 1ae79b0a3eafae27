"""The audit's panels and its policy, read from YAML and checked before anything is loaded.

The panels are declared once, in ``aligntax/resources/audit/panels.yaml``; a file given with
``--panel-file`` has the same layout and adds panels (or replaces one of the same name). The policy
(``aligntax/resources/audit/policy.yaml`` by default, ``--policy FILE`` otherwise) says per panel (and
optionally per row) the largest loss tolerated and the significance level. Every problem is one
:class:`~aligntax.errors.UsageError` naming the file, the panel and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from aligntax.audit.stats import DOWN, EITHER, UP
from aligntax.errors import UsageError

RESOURCES = Path(__file__).resolve().parent.parent / "resources" / "audit"
DEFAULT_PANELS = RESOURCES / "panels.yaml"
DEFAULT_POLICY = RESOURCES / "policy.yaml"
PROFILES = ("quick", "full")


@dataclass(frozen=True)
class Kind:
    """What a row of one kind measures: its unit, which way is better, the keys a row of it takes."""

    unit: str
    direction: str
    keys: frozenset[str]
    required: frozenset[str] = frozenset()


_COMMON = frozenset({"kind", "name", "quick", "full"})
KINDS: dict[str, Kind] = {
    "refusal": Kind("pt", UP, _COMMON | {"data", "metric"}, frozenset({"data"})),
    "knowns": Kind("pt", UP, _COMMON | {"data", "split", "max_new_tokens"}),
    "mc": Kind("pt", UP, _COMMON | {"data"}),
    "fluency": Kind("nats", DOWN, frozenset({"kind", "name", "of"}), frozenset({"of"})),
    "values": Kind("Likert", EITHER, _COMMON | {"items"}),
}
METRICS = {
    "refusal": ("compliance", "refusal"),
    "knowns": ("accuracy",),
    "mc": ("accuracy",),
    "fluency": ("log-perplexity",),
    "values": ("shift",),
}


@dataclass(frozen=True)
class RowSpec:
    """One declared row of a panel (a values row stands for the ten values)."""

    panel: str
    kind: str
    name: str
    metric: str
    data: tuple[str, ...] = ()
    quick: int | None = None
    full: int | None = None
    options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def unit(self) -> str:
        return KINDS[self.kind].unit

    @property
    def direction(self) -> str:
        return KINDS[self.kind].direction

    def size(self, profile: str) -> int | None:
        """Items this row takes in ``profile`` (None: all)."""
        return self.quick if profile == "quick" else self.full


@dataclass(frozen=True)
class Panel:
    name: str
    about: str
    rows: tuple[RowSpec, ...]


def _yaml(path: Path, what: str) -> dict:
    if not path.is_file():
        raise UsageError(f"{what} {path}: no such file.")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UsageError(f"{what} {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{what} {path} must hold a mapping (got {type(doc).__name__}).")
    return doc


def _size(value, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{where}: a size is a whole number of items above 0 or null (all), not {value!r}.")
    return value


def _row(panel: str, metric: str | None, raw, i: int, where: str) -> RowSpec:
    here = f"{where}: panel {panel!r}, row {i}"
    if not isinstance(raw, dict):
        raise UsageError(f"{here} must be a mapping with a kind, e.g. {{kind: refusal, data: xstest-safe}}.")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise UsageError(f"{here}: unknown kind {kind!r}; known: {', '.join(KINDS)}.")
    spec = KINDS[kind]
    unknown = sorted(set(raw) - spec.keys)
    if unknown:
        raise UsageError(
            f"{here}: a {kind} row takes no {', '.join(unknown)} (it takes {', '.join(sorted(spec.keys))})."
        )
    missing = sorted(spec.required - set(raw))
    if missing:
        raise UsageError(f"{here}: a {kind} row needs {', '.join(missing)}.")
    data = raw.get("data")
    if data is not None:
        data = [data] if isinstance(data, str) else data
        if not isinstance(data, list) or not data or not all(isinstance(d, str) and d.strip() for d in data):
            raise UsageError(f"{here}: data is a dataset (a name, a file or a Hub id) or a list of them.")
    row_metric = raw.get("metric", metric if kind == "refusal" else None) or METRICS[kind][0]
    if row_metric not in METRICS[kind]:
        raise UsageError(
            f"{here}: a {kind} row's metric is {' or '.join(METRICS[kind])}, not {row_metric!r}."
        )
    if kind == "refusal" and raw.get("metric") is None and metric is None:
        raise UsageError(
            f"{here}: a refusal row needs a metric (compliance or refusal), on the row or its panel."
        )
    name = raw.get("name") or ("+".join(data) if kind == "refusal" else kind)
    if not isinstance(name, str):
        raise UsageError(f"{here}: name is a string.")
    options = {k: v for k, v in raw.items() if k not in ("kind", "name", "quick", "full", "data", "metric")}
    if kind == "knowns":
        options.setdefault("split", "test")
        mnt = options.get("max_new_tokens")
        if mnt is not None and (isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1):
            raise UsageError(f"{here}: max_new_tokens is a whole number above 0.")
    if kind == "values":
        options.setdefault("items", "builtin")
    return RowSpec(
        panel=panel,
        kind=kind,
        name=name,
        metric=row_metric,
        data=tuple(data or (["builtin"] if kind in ("knowns", "mc") else [])),
        quick=_size(raw.get("quick"), f"{here}, quick"),
        full=_size(raw.get("full"), f"{here}, full"),
        options=options,
    )


def parse_panels(doc: dict, where: str) -> dict[str, Panel]:
    """The panels of a parsed panels file (``{"panels": {name: {about, metric, rows}}}``)."""
    unknown = sorted(set(doc) - {"panels"})
    if unknown:
        raise UsageError(
            f"{where}: unknown keys {', '.join(unknown)}; a panels file holds panels: {{name: ...}}."
        )
    raw = doc.get("panels")
    if not isinstance(raw, dict) or not raw:
        raise UsageError(f"{where}: panels must be a mapping of panel name to {{about, metric, rows}}.")
    out: dict[str, Panel] = {}
    for name, body in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise UsageError(f"{where}: a panel name must be a string, not {name!r}.")
        if not isinstance(body, dict):
            raise UsageError(f"{where}: panel {name!r} must be a mapping with rows.")
        extra = sorted(set(body) - {"about", "metric", "rows"})
        if extra:
            raise UsageError(
                f"{where}: panel {name!r} takes no {', '.join(extra)} (it takes about, metric, rows)."
            )
        metric = body.get("metric")
        if metric is not None and metric not in METRICS["refusal"]:
            raise UsageError(f"{where}: panel {name!r}: metric is compliance or refusal, not {metric!r}.")
        rows_raw = body.get("rows")
        if not isinstance(rows_raw, list) or not rows_raw:
            raise UsageError(f"{where}: panel {name!r} needs rows: a list of {{kind: ..., ...}}.")
        rows = tuple(_row(name, metric, r, i, where) for i, r in enumerate(rows_raw, start=1))
        names = [r.name for r in rows]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UsageError(
                f"{where}: panel {name!r} has two rows named {', '.join(dup)}; give each a name."
            )
        out[name] = Panel(name, str(body.get("about") or ""), rows)
    return out


def load_panels(extra: str | Path | None = None) -> dict[str, Panel]:
    """The declared panels, with those of ``extra`` (a panels file) added or replacing their namesakes;
    every fluency row's ``of`` names a panel with refusal rows."""
    panels = parse_panels(_yaml(DEFAULT_PANELS, "panels file"), str(DEFAULT_PANELS))
    if extra is not None:
        panels.update(parse_panels(_yaml(Path(extra), "--panel-file"), f"--panel-file {extra}"))
    for p in panels.values():
        for r in p.rows:
            if r.kind == "fluency":
                of = r.options.get("of")
                target = panels.get(of) if isinstance(of, str) else None
                if target is None or not any(
                    x.kind == "refusal" and x.metric == "compliance" for x in target.rows
                ):
                    raise UsageError(
                        f"panel {p.name!r}, row {r.name!r}: of {of!r} must name a panel with compliance rows "
                        f"(known panels: {', '.join(panels)})."
                    )
    return panels


def select_panels(panels: dict[str, Panel], names: list[str] | None) -> list[Panel]:
    """The panels named (all, in declaration order, when None); an unknown name is a usage error."""
    if not names:
        return list(panels.values())
    unknown = [n for n in names if n not in panels]
    if unknown:
        raise UsageError(f"Unknown panel {', '.join(map(repr, unknown))}; known: {', '.join(panels)}.")
    return [panels[n] for n in dict.fromkeys(names)]


# ---------------------------------------------------------------- policy
@dataclass(frozen=True)
class Rule:
    """What one row tolerates: the largest loss (in its unit) and the significance level."""

    max_loss: float
    alpha: float


@dataclass(frozen=True)
class Policy:
    alpha: float
    power: float
    inconclusive: str  # "pass" or "fail": the exit status of an inconclusive audit
    default: dict
    panels: dict
    source: str

    def rule(self, panel: str, row: str) -> Rule:
        """The rule of a row: its own entry, else its panel's, else the policy's default."""
        p = self.panels.get(panel) or self.default
        r = (p.get("rows") or {}).get(row, {})
        max_loss = r.get("max_loss", p.get("max_loss", self.default.get("max_loss")))
        alpha = r.get("alpha", p.get("alpha", self.default.get("alpha", self.alpha)))
        return Rule(float(max_loss), float(alpha))

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "alpha": self.alpha,
            "power": self.power,
            "inconclusive": self.inconclusive,
            "default": self.default,
            "panels": self.panels,
        }


def _prob(value, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < 1:
        raise UsageError(f"{where}: {key} is a probability between 0 and 1 (exclusive), not {value!r}.")
    return float(value)


def _rule_block(raw, where: str, rows_ok: bool) -> dict:
    if not isinstance(raw, dict):
        raise UsageError(f"{where} must be a mapping such as {{max_loss: 5}}.")
    allowed = {"max_loss", "alpha"} | ({"rows"} if rows_ok else set())
    extra = sorted(set(raw) - allowed)
    if extra:
        raise UsageError(f"{where}: unknown keys {', '.join(extra)} (it takes {', '.join(sorted(allowed))}).")
    out: dict = {}
    if "max_loss" in raw:
        v = raw["max_loss"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UsageError(f"{where}: max_loss is a number of 0 or more, not {v!r}.")
        out["max_loss"] = float(v)
    if "alpha" in raw:
        out["alpha"] = _prob(raw["alpha"], where, "alpha")
    if rows_ok and "rows" in raw:
        if not isinstance(raw["rows"], dict):
            raise UsageError(f"{where}: rows is a mapping of row name to {{max_loss, alpha}}.")
        out["rows"] = {str(k): _rule_block(v, f"{where}, row {k!r}", False) for k, v in raw["rows"].items()}
    return out


def parse_policy(doc: dict, where: str, panels: dict[str, Panel] | None = None) -> Policy:
    """A policy from a parsed YAML mapping; with ``panels``, every panel and row it names must exist."""
    allowed = {"alpha", "power", "inconclusive", "default", "panels"}
    extra = sorted(set(doc) - allowed)
    if extra:
        raise UsageError(
            f"{where}: unknown keys {', '.join(extra)} (a policy takes {', '.join(sorted(allowed))})."
        )
    alpha = _prob(doc.get("alpha", 0.05), where, "alpha")
    power = _prob(doc.get("power", 0.8), where, "power")
    inconclusive = doc.get("inconclusive", "pass")
    if inconclusive not in ("pass", "fail"):
        raise UsageError(
            f"{where}: inconclusive is pass or fail (the exit status it gives), not {inconclusive!r}."
        )
    default = _rule_block(doc.get("default", {}), f"{where}, default", False)
    raw = doc.get("panels", {}) or {}
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: panels is a mapping of panel name to {{max_loss, alpha, rows}}.")
    blocks = {str(k): _rule_block(v, f"{where}, panel {k!r}", True) for k, v in raw.items()}
    if panels is not None:
        from aligntax.vat.schwartz import VALUES

        for name, block in blocks.items():
            if name not in panels:
                raise UsageError(f"{where}: panel {name!r} is not a panel; known: {', '.join(panels)}.")
            known = {r.name for r in panels[name].rows}
            if any(r.kind == "values" for r in panels[name].rows):
                known |= set(VALUES)
            for row in block.get("rows", {}):
                if row not in known:
                    raise UsageError(
                        f"{where}: panel {name!r} has no row {row!r}; its rows: {', '.join(sorted(known))}."
                    )
        for p in panels.values():
            if "max_loss" not in blocks.get(p.name, {}) and "max_loss" not in default:
                raise UsageError(f"{where}: no max_loss for panel {p.name!r} and no default max_loss.")
    return Policy(alpha, power, inconclusive, default, blocks, where)


def load_policy(path: str | Path | None = None, panels: dict[str, Panel] | None = None) -> Policy:
    """The policy of ``path`` (the shipped default when None)."""
    p = Path(path) if path is not None else DEFAULT_POLICY
    return parse_policy(_yaml(p, "--policy" if path is not None else "policy"), str(p), panels)
