"""Scenario-action items and their loaders.

Every loader produces ``ValueItem`` records: a context, one action in it, the basic Schwartz value the
action bears on, and a polarity (+1 the action supports/expresses the value, -1 it violates/resists it).

Sources
-------
- ``builtin``: the scenario-action set shipped with aligntax (20 everyday scenes x 10 values x 2
  polarities = 400 items), ``aligntax/resources/vat/builtin.jsonl``.
- ``value-action-lens`` (or a path to ``value_action_gap_full_data_generation.csv``): ValueActionLens
  (EMNLP 2025), 12 countries x 11 topics x 56 SVS items x 2 polarities.
- ``Tinyhope/Value_Alignment_Tax`` (or ``hub:ORG/NAME``): the VAT dataset on the Hugging Face Hub, read
  with ``datasets.load_dataset`` and a configurable field mapping.
- any ``.jsonl``/``.json``/``.csv`` file with the columns ``context``, ``action``, ``value``,
  ``polarity`` (optional: ``id``, ``svs_item``, ``scene``, ``country``, ``topic``).
"""

from __future__ import annotations

import ast
import csv
import json
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from aligntax.errors import DataError
from aligntax.vat.schwartz import VALUES, UnknownValueError, resolve_svs_item, resolve_value


@dataclass(frozen=True)
class ValueItem:
    id: str
    context: str
    action: str
    value: str  # one of schwartz.VALUES
    polarity: int  # +1 supports the value, -1 violates it, 0 neutral (neither)
    svs_item: str | None = None
    scene: str | None = None
    country: str | None = None
    topic: str | None = None
    source: str | None = None
    # congruent: supporting the value is also the socially approved action; incongruent: supporting it is
    # the socially disapproved one (e.g. Power by bullying); neutral: the action neither supports nor
    # violates the value (polarity 0). None when the source does not say (ValueActionLens, files).
    desirability: str | None = None

    @property
    def stratum(self) -> str:
        """The desirability stratum, 'unlabelled' when the source gives none."""
        return self.desirability or ("neutral" if self.polarity == 0 else "unlabelled")

    @property
    def group(self) -> str:
        """The scene (or context group) used for per-scene aggregation: ``scene`` if given, else
        ``country / topic``, else the context text."""
        if self.scene:
            return self.scene
        if self.country or self.topic:
            return f"{self.country or '?'} / {self.topic or '?'}"
        return self.context

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------- parsing helpers
_POLARITY = {
    "1": 1,
    "+1": 1,
    "positive": 1,
    "pos": 1,
    "+": 1,
    "support": 1,
    "supports": 1,
    "supporting": 1,
    "express": 1,
    "expresses": 1,
    "true": 1,
    "yes": 1,
    "-1": -1,
    "negative": -1,
    "neg": -1,
    "-": -1,
    "violate": -1,
    "violates": -1,
    "violating": -1,
    "resist": -1,
    "resists": -1,
    "oppose": -1,
    "opposes": -1,
    "false": -1,
    "no": -1,
    "0": 0,
    "neutral": 0,
    "none": 0,
}
DESIRABILITY = ("congruent", "incongruent", "neutral")
STRATA = (*DESIRABILITY, "unlabelled")


def parse_polarity(raw, where: str = "") -> int:
    """+1, -1 or 0 (neutral) from 1/-1/0, 'positive'/'negative'/'neutral', 'support'/'violate', booleans."""
    if isinstance(raw, bool):
        return 1 if raw else -1
    if isinstance(raw, int | float) and raw in (1, -1, 0):
        return int(raw)
    key = str(raw).strip().lower()
    if key.endswith(".0"):
        key = key[:-2]
    if key in _POLARITY:
        return _POLARITY[key]
    raise DataError(f"{where}bad polarity {raw!r}: use +1/-1/0, positive/negative/neutral or support/violate")


def parse_desirability(raw, polarity: int, where: str = "") -> str | None:
    """The desirability stratum of an item: congruent, incongruent or neutral (None when absent; a
    polarity-0 item without one is neutral). Neutral goes with polarity 0 and only with it."""
    if raw is None or str(raw).strip() == "":
        return "neutral" if polarity == 0 else None
    key = str(raw).strip().lower()
    if key not in DESIRABILITY:
        raise DataError(f"{where}bad desirability {raw!r}: use congruent, incongruent or neutral")
    if (key == "neutral") != (polarity == 0):
        raise DataError(
            f"{where}desirability '{key}' does not fit polarity {polarity:+d} (neutral items, and "
            "only they, have polarity 0)"
        )
    return key


def parse_value(raw, where: str = "") -> tuple[str, str | None]:
    """(basic value, SVS item or None) for a value name, refined value name or SVS item name."""
    if raw is None or str(raw).strip() == "":
        raise DataError(f"{where}empty value name")
    try:
        basic = resolve_value(str(raw))
    except UnknownValueError as exc:
        raise DataError(f"{where}{exc}") from None
    return basic, resolve_svs_item(str(raw))


_FENCE = re.compile(r"```(?:json|JSON)?\s*(\{.*?\})\s*```", re.S)
_ACTION_RE = re.compile(
    r"""["']Human Action["']\s*:\s*(["'])(?P<text>.*?)\1\s*,\s*["'](?:Feature Attributions|Natural Language Explanation)""",
    re.S,
)
_ACTION_RE_LOOSE = re.compile(r"""["']Human Action["']\s*:\s*(["'])(?P<text>.*?)\1\s*[,}]""", re.S)


def parse_human_action(raw: str) -> str | None:
    """The "Human Action" text of a ValueActionLens ``generation_prompt`` cell.

    The cells are model outputs: JSON, Python-literal dicts with single quotes, JSON inside a
    Markdown code fence after a chatty preamble, or single-quoted dicts whose strings contain
    apostrophes (not parseable at all). Tried in that order, with a regular expression as the last
    resort. Returns None when no action can be found."""
    if not isinstance(raw, str) or not raw.strip():
        return None
    text = raw.strip()
    candidates = [text]
    m = _FENCE.search(text)
    if m:
        candidates.insert(0, m.group(1))
    brace = text.find("{")
    if brace > 0:
        candidates.append(text[brace : text.rfind("}") + 1])
    for cand in candidates:
        for loader in (json.loads, ast.literal_eval):
            try:
                obj = loader(cand)
            except Exception:  # noqa: BLE001 - any parse failure means: try the next form
                continue
            if isinstance(obj, dict):
                for key in ("Human Action", "human_action", "action", "Action"):
                    if isinstance(obj.get(key), str) and obj[key].strip():
                        return obj[key].strip()
    for rx in (_ACTION_RE, _ACTION_RE_LOOSE):
        m = rx.search(text)
        if m and m.group("text").strip():
            return m.group("text").replace("\\'", "'").replace('\\"', '"').strip()
    return None


# ----------------------------------------------------------------- ValueActionLens
VAL_CONTEXT_TEMPLATE = "A person living in {country} describes something they do in the area of {topic}."
_THE = (
    "United States",
    "United Kingdom",
    "Philippines",
    "Netherlands",
    "United Arab Emirates",
    "Czech Republic",
    "Dominican Republic",
    "Central African Republic",
)


def _country_phrase(country: str) -> str:
    return f"the {country}" if country in _THE else country


def load_value_action_lens(
    path: str | Path | None = None,
    *,
    context_template: str = VAL_CONTEXT_TEMPLATE,
    skip_unparsed: bool = True,
) -> list[ValueItem]:
    """Load the ValueActionLens CSV (14,784 rows: country, topic, value = SVS item, polarity,
    generation_prompt). The SVS item is mapped to its basic value; the action is the "Human Action" of
    the JSON in ``generation_prompt``; the context is built from country and topic. Item ids are
    ``val-<data row number, from 0>`` (the file's own index columns repeat). Rows whose action cannot be
    parsed (the generator's refusals) are skipped (``skip_unparsed``) or raise ``DataError``."""
    if path is None:
        from aligntax.paths import shared_data_dir

        base = shared_data_dir()
        path = (
            base / "values" / "value_action_lens" / "value_action_gap_full_data_generation.csv"
            if base
            else None
        )
        if path is None or not Path(path).is_file():
            raise DataError(
                "ValueActionLens CSV not found: pass its path (value_action_gap_full_data_"
                "generation.csv) or set ALIGNTAX_DATA to the shared data folder."
            )
    path = Path(path)
    rows = _read_csv(path)
    need = {"country", "topic", "value", "polarity", "generation_prompt"}
    missing = need - set(rows[0])
    if missing:
        raise DataError(
            f"{path}: not a ValueActionLens file, missing columns {sorted(missing)} (found {sorted(rows[0])})"
        )
    items = []
    for i, row in enumerate(rows):
        where = f"{path.name} row {i + 2}: "
        action = parse_human_action(row["generation_prompt"])
        if action is None:
            if skip_unparsed:
                continue
            raise DataError(f"{where}no 'Human Action' in generation_prompt")
        basic, svs = parse_value(row["value"], where)
        country, topic = row["country"].strip(), row["topic"].strip()
        items.append(
            ValueItem(
                id=f"val-{i}",
                context=context_template.format(country=_country_phrase(country), topic=topic),
                action=action,
                value=basic,
                polarity=parse_polarity(row["polarity"], where),
                svs_item=svs or str(row["value"]).strip(),
                scene=f"{country} / {topic}",
                country=country,
                topic=topic,
                source="value-action-lens",
            )
        )
    if not items:
        raise DataError(f"{path}: no usable rows")
    return items


# ----------------------------------------------------------------- generic files
_FIELD_ALIASES = {
    "context": ("context", "scenario", "situation", "scene_description", "prompt"),
    "action": ("action", "action_text", "human_action", "behavior", "behaviour"),
    "value": ("value", "basic_value", "schwartz_value", "svs_value"),
    "polarity": ("polarity", "label", "direction"),
}


def _read_csv(path: Path) -> list[dict]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not a UTF-8 text file ({exc})") from None
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV file ({exc})") from None
    if not rows:
        raise DataError(f"{path}: the file has no data rows")
    return rows


def _read_json_rows(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise DataError(f"{path}: the file is empty")
    if path.suffix.lower() == ".json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        rows = obj.get("items", obj.get("data")) if isinstance(obj, dict) else obj
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of objects (or {{'items': [...]}})")
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}: line {n} is not valid JSON ({exc.msg})") from None
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    for n, r in enumerate(rows, start=1):
        if not isinstance(r, dict):
            raise DataError(f"{path}: row {n} is not a JSON object")
    return rows


def items_from_records(
    records: Sequence[dict], *, source: str, where: str = "", fields: dict[str, str] | None = None
) -> list[ValueItem]:
    """Build items from dict records, mapping field names (``fields``: our name -> record key) with
    common aliases as fallback. Raises ``DataError`` naming the first bad record."""
    if not records:
        raise DataError(f"{where}no rows")
    keys = set().union(*(r.keys() for r in records[:50]))
    mapping = {}
    for ours, aliases in _FIELD_ALIASES.items():
        if fields and ours in fields:
            if fields[ours] not in keys:
                raise DataError(
                    f"{where}field '{fields[ours]}' (for {ours}) not found; columns: {sorted(keys)}"
                )
            mapping[ours] = fields[ours]
            continue
        found = next((a for a in aliases if a in keys), None)
        if found is None:
            raise DataError(
                f"{where}missing column '{ours}' (columns: {sorted(keys)}). Items need "
                "context, action, value and polarity."
            )
        mapping[ours] = found
    opt = {
        k: (fields or {}).get(k, k) for k in ("id", "svs_item", "scene", "country", "topic", "desirability")
    }
    items, seen = [], set()
    for n, r in enumerate(records, start=1):
        w = f"{where}row {n}: "
        ctx, act = r.get(mapping["context"]), r.get(mapping["action"])
        if not isinstance(ctx, str) or not ctx.strip() or not isinstance(act, str) or not act.strip():
            raise DataError(f"{w}empty context or action")
        basic, svs = parse_value(r.get(mapping["value"]), w)
        rid = str(r.get(opt["id"]) if r.get(opt["id"]) not in (None, "") else f"{source}-{n}")
        if rid in seen:
            raise DataError(f"{w}duplicate id '{rid}'")
        seen.add(rid)

        def _opt(k, rec=r):
            v = rec.get(opt[k])
            return None if v in (None, "") else str(v)

        pol = parse_polarity(r.get(mapping["polarity"]), w)
        items.append(
            ValueItem(
                id=rid,
                context=ctx.strip(),
                action=act.strip(),
                value=basic,
                polarity=pol,
                svs_item=_opt("svs_item") or svs,
                scene=_opt("scene"),
                country=_opt("country"),
                topic=_opt("topic"),
                source=source,
                desirability=parse_desirability(_opt("desirability"), pol, w),
            )
        )
    return items


def load_item_file(path: str | Path, fields: dict[str, str] | None = None) -> list[ValueItem]:
    """A generic JSONL / JSON / CSV file with context, action, value, polarity columns."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"Item file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        rows = _read_csv(path)
        if {"generation_prompt", "country", "topic"} <= set(rows[0]):
            return load_value_action_lens(path)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        rows = _read_json_rows(path)
    else:
        raise DataError(f"{path}: unsupported file type '{suffix}' (use .jsonl, .json or .csv)")
    return items_from_records(rows, source=path.stem, where=f"{path.name}: ", fields=fields)


# ----------------------------------------------------------------- built-in set
BUILTIN_NAME = "builtin"


def builtin_path() -> Path:
    return Path(str(resources.files("aligntax").joinpath("resources", "vat", "builtin.jsonl")))


def load_builtin() -> list[ValueItem]:
    """The built-in scenario-action set (520 items in 20 scenes): per scene and value a congruent minimal
    pair (400), plus per value 4 desirability-incongruent pairs (80) and 4 neutral items (40), two of each
    kind per scene. Every item has a ``desirability``."""
    return items_from_records(_read_json_rows(builtin_path()), source=BUILTIN_NAME, where="builtin: ")


# ----------------------------------------------------------------- the VAT dataset on the Hub
VAT_HUB_ID = "Tinyhope/Value_Alignment_Tax"
# Candidate column names per field, tried in order (the dataset card is the authority: pass
# ``fields=`` when they differ).
VAT_FIELD_CANDIDATES: dict[str, tuple[str, ...]] = {
    "context": ("scenario", "context", "scene_description", "situation"),
    "action": ("action", "Human Action", "human_action", "action_text", "behavior"),
    "value": ("value", "svs_value", "value_name"),
    "polarity": ("polarity", "label", "direction"),
    "scene": ("scene", "scene_id", "scenario_id"),
    "country": ("country",),
    "topic": ("topic",),
    "id": ("id", "item_id", "uid"),
}


def load_vat_hub(
    repo_id: str = VAT_HUB_ID,
    split: str = "test",
    *,
    fields: dict[str, str] | None = None,
    config: str | None = None,
) -> list[ValueItem]:
    """The VAT dataset via ``datasets.load_dataset``. ``fields`` maps our fields (context, action,
    value, polarity, scene, country, topic, id) to dataset columns; unset ones are guessed from
    ``VAT_FIELD_CANDIDATES``. When the context is missing but country/topic/scene exist, a context is
    built from them. Fails with ``DataError`` offline or when the columns do not fit."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise DataError("Loading the VAT dataset needs the 'datasets' package") from exc
    try:
        ds = datasets.load_dataset(repo_id, config, split=split)
    except Exception as exc:  # noqa: BLE001 - network, auth, missing split: all reported the same way
        raise DataError(
            f"Could not load the dataset '{repo_id}' (split '{split}') from the Hugging Face Hub: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. The Hub may be unreachable "
            "(offline); use the built-in set (--data builtin), ValueActionLens or a local JSONL/CSV file."
        ) from exc
    columns = list(ds.column_names)
    mapping: dict[str, str] = {}
    for ours, cands in VAT_FIELD_CANDIDATES.items():
        if fields and ours in fields:
            if fields[ours] not in columns:
                raise DataError(f"{repo_id}: column '{fields[ours]}' (for {ours}) not in {columns}")
            mapping[ours] = fields[ours]
        else:
            hit = next((c for c in cands if c in columns), None)
            if hit:
                mapping[ours] = hit
    for need in ("action", "value", "polarity"):
        if need not in mapping:
            raise DataError(
                f"{repo_id}: cannot find the '{need}' column among {columns}; pass "
                f"fields={{'{need}': 'COLUMN'}} (CLI: --field {need}=COLUMN)"
            )
    records = []
    for i, row in enumerate(ds):
        rec = {k: row.get(c) for k, c in mapping.items()}
        if not rec.get("context"):
            parts = [f"{k}: {rec[k]}" for k in ("country", "topic", "scene") if rec.get(k)]
            if not parts:
                raise DataError(
                    f"{repo_id}: no context column and no country/topic/scene to build one; "
                    "pass fields={'context': 'COLUMN'}"
                )
            rec["context"] = "Setting - " + "; ".join(parts) + "."
        if rec.get("action") is not None and not isinstance(rec["action"], str):
            rec["action"] = str(rec["action"])
        rec.setdefault("id", f"vat-{split}-{i}")
        if rec.get("id") in (None, ""):
            rec["id"] = f"vat-{split}-{i}"
        records.append(rec)
    identity = {k: k for k in ("context", "action", "value", "polarity")}
    return items_from_records(records, source=f"hub:{repo_id}", where=f"{repo_id}: ", fields=identity)


# ----------------------------------------------------------------- dispatch
def load_items(source: str | Path = BUILTIN_NAME, **kwargs) -> list[ValueItem]:
    """Load items by name or path: ``builtin``; ``value-action-lens`` / ``val`` (the shared copy) or
    the CSV path; a Hub id ``Tinyhope/Value_Alignment_Tax`` or ``hub:ORG/NAME``; a JSONL/JSON/CSV file."""
    s = str(source).strip()
    low = s.lower()
    if low in (BUILTIN_NAME, "builtin.jsonl"):
        return load_builtin()
    if low in ("value-action-lens", "valueactionlens", "val", "value_action_lens"):
        return load_value_action_lens(**kwargs)
    p = Path(s).expanduser()
    if p.exists():
        return load_item_file(p, **kwargs)
    if low.startswith("hub:"):
        return load_vat_hub(s[4:], **kwargs)
    if re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", s) and not p.suffix:
        return load_vat_hub(s, **kwargs)
    raise DataError(
        f"Unknown item source '{s}': use 'builtin', 'value-action-lens', a Hub id such as "
        f"{VAT_HUB_ID}, or a .jsonl/.json/.csv file"
    )


# ----------------------------------------------------------------- sampling and splitting
def _by_cell(items: Iterable[ValueItem]) -> dict[tuple[str, int], list[ValueItem]]:
    cells: dict[tuple[str, int], list[ValueItem]] = defaultdict(list)
    for it in items:
        cells[(it.value, it.polarity)].append(it)
    return cells


def _alloc(total: int, sizes: dict[str, int]) -> dict[str, int]:
    """Split ``total`` over the keys in proportion to ``sizes`` (largest remainder; ties in key order)."""
    n = sum(sizes.values())
    if n == 0:
        return {k: 0 for k in sizes}
    if total >= n:
        return dict(sizes)
    exact = {k: total * c / n for k, c in sizes.items()}
    out = {k: int(x) for k, x in exact.items()}
    rest = total - sum(out.values())
    for k in sorted(sizes, key=lambda k: -(exact[k] - out[k]))[:rest]:
        out[k] += 1
    return out


def _spread_pick(cell: list[ValueItem], cap: int, rng: random.Random) -> list[ValueItem]:
    """Up to ``cap`` items of a cell, spread over scenes: shuffled, then round-robin by group."""
    cell = sorted(cell, key=lambda it: it.id)
    rng.shuffle(cell)
    by_group: dict[str, list[ValueItem]] = defaultdict(list)
    for it in cell:
        by_group[it.group].append(it)
    order = sorted(by_group, key=lambda g: rng.random())
    picked: list[ValueItem] = []
    while len(picked) < min(cap, len(cell)):
        for g in order:
            if by_group[g] and len(picked) < cap:
                picked.append(by_group[g].pop())
    return picked


def sample_items(
    items: Sequence[ValueItem],
    *,
    per_value: int | None = None,
    per_value_polarity: int | None = None,
    values: Sequence[str] | None = None,
    scenes: int | Sequence[str] | None = None,
    seed: int = 0,
    strata: Sequence[str] | None = None,
    by: str = "item",
    per_scene_value: int = 2,
) -> list[ValueItem]:
    """A reproducible subset.

    - ``values``: keep only these values (any resolvable names); ``strata``: only these desirability
      strata (congruent, incongruent, neutral, unlabelled).
    - ``scenes``: keep only these scene groups, or (an int) that many groups chosen at random.
    - ``per_value`` (``by="item"``): at most this many items per value, spread over scenes. The number is
      shared among the value's desirability strata in proportion to their sizes, and within a stratum
      split evenly across the polarities (the extra one of an odd number goes to +1); with one stratum
      this is the plain half-and-half split. ``per_value_polarity`` caps each (value, stratum, polarity)
      cell directly.
    - ``per_value`` with ``by="scene"``: whole scenes, for the coupling statistics (which correlate the
      per-scene mean shifts of two values, so every chosen scene should hold every value): enough
      randomly chosen scenes that hold all values to reach ``per_value`` items per value, and in each
      scene ``per_scene_value`` items of every value (balanced polarity).
    The result keeps the input order."""
    rng = random.Random(seed)
    pool = list(items)
    if values is not None:
        keep = {resolve_value(v) for v in values}
        pool = [it for it in pool if it.value in keep]
    if strata is not None:
        bad = set(strata) - set(STRATA)
        if bad:
            raise DataError(f"Unknown strata {sorted(bad)}; use {', '.join(STRATA)}")
        pool = [it for it in pool if it.stratum in set(strata)]
    if scenes is not None:
        groups = sorted({it.group for it in pool})
        if isinstance(scenes, int):
            chosen = set(rng.sample(groups, min(scenes, len(groups))))
        else:
            chosen = set(scenes)
            unknown = chosen - set(groups)
            if unknown:
                raise DataError(f"Unknown scenes {sorted(unknown)[:5]}; known: {groups[:10]}...")
        pool = [it for it in pool if it.group in chosen]
    if by not in ("item", "scene"):
        raise DataError("sample by 'item' or 'scene'")
    if by == "scene" and per_value is not None:
        return _sample_scenes(pool, per_value, per_scene_value, rng)
    if per_value is None and per_value_polarity is None:
        return pool
    chosen_ids: set[str] = set()
    by_value: dict[str, list[ValueItem]] = defaultdict(list)
    for it in pool:
        by_value[it.value].append(it)
    for _value, members in sorted(by_value.items()):
        by_stratum: dict[str, list[ValueItem]] = defaultdict(list)
        for it in members:
            by_stratum[it.stratum].append(it)
        order = sorted(by_stratum, key=STRATA.index)
        share = _alloc(per_value, {k: len(by_stratum[k]) for k in order}) if per_value is not None else None
        for k in order:
            for (_v, pol), cell in sorted(_by_cell(by_stratum[k]).items()):  # the order of earlier versions
                if per_value_polarity is not None:
                    cap = per_value_polarity
                elif pol == 0:
                    cap = share[k]
                else:
                    cap = (share[k] + 1) // 2 if pol > 0 else share[k] // 2
                chosen_ids.update(it.id for it in _spread_pick(cell, cap, rng))
    return [it for it in pool if it.id in chosen_ids]


def _sample_scenes(
    pool: list[ValueItem], per_value: int, per_scene_value: int, rng: random.Random
) -> list[ValueItem]:
    if per_scene_value < 1:
        raise DataError("per_scene_value must be >= 1")
    by_group: dict[str, list[ValueItem]] = defaultdict(list)
    for it in pool:
        by_group[it.group].append(it)
    present = {it.value for it in pool}
    full = sorted(g for g, its in by_group.items() if {it.value for it in its} >= present)
    if not full:
        raise DataError("No scene holds every value; sample by item instead")
    n_scenes = min(len(full), max(1, -(-per_value // per_scene_value)))
    chosen = rng.sample(full, n_scenes)
    ids: set[str] = set()
    for g in chosen:
        for v in sorted(present):
            cell = sorted((it for it in by_group[g] if it.value == v), key=lambda it: it.id)
            rng.shuffle(cell)
            sup = [it for it in cell if it.polarity > 0]
            vio = [it for it in cell if it.polarity < 0]
            neu = [it for it in cell if it.polarity == 0]
            picked: list[ValueItem] = []
            while len(picked) < min(per_scene_value, len(cell)):
                for part in (sup, vio, neu):  # alternate polarities
                    if part and len(picked) < per_scene_value:
                        picked.append(part.pop(0))
            ids.update(it.id for it in picked)
    return [it for it in pool if it.id in ids]


def split_items(
    items: Sequence[ValueItem], train_fraction: float = 0.2, seed: int = 0, by: str = "scene"
) -> tuple[list[ValueItem], list[ValueItem]]:
    """(evaluation items, training items). Interventions that need examples (few-shot, steering, LoRA,
    DPO) draw them from the training part only, so no evaluation item or context leaks into them.

    ``by="scene"`` puts whole scene groups on one side (as the VAT paper splits by scenario);
    ``by="context"`` splits by context text; ``by="item"`` splits items within each (value, polarity)."""
    if not 0.0 <= train_fraction < 1.0:
        raise ValueError("train_fraction must be in [0, 1)")
    if train_fraction == 0:
        return list(items), []
    rng = random.Random(seed)
    if by == "item":
        train_ids: set[str] = set()
        for _cell, members in sorted(_by_cell(items).items()):
            members = sorted(members, key=lambda it: it.id)
            rng.shuffle(members)
            train_ids.update(it.id for it in members[: round(train_fraction * len(members))])
    else:
        key = (lambda it: it.group) if by == "scene" else (lambda it: it.context)
        if by not in ("scene", "context"):
            raise ValueError("by must be 'scene', 'context' or 'item'")
        groups = sorted({key(it) for it in items})
        rng.shuffle(groups)
        n_train = max(1, round(train_fraction * len(groups))) if len(groups) > 1 else 0
        train_groups = set(groups[:n_train])
        train_ids = {it.id for it in items if key(it) in train_groups}
    ev = [it for it in items if it.id not in train_ids]
    tr = [it for it in items if it.id in train_ids]
    return ev, tr


_VAL_NAMES = ("value-action-lens", "valueactionlens", "val", "value_action_lens")


def sample_by_for(data: str, sample_by: str = "auto") -> str:
    """How a subset of ``data`` is drawn: ``sample_by`` (item or scene), or for ``auto`` scene with
    ValueActionLens (whole scenes, for the coupling) and item otherwise."""
    if sample_by == "auto":
        return "scene" if data.strip().lower() in _VAL_NAMES else "item"
    if sample_by not in ("item", "scene"):
        raise DataError("sample_by must be item, scene or auto")
    return sample_by


def evaluation_items(
    data: str | Path = BUILTIN_NAME,
    *,
    train_fraction: float = 0.2,
    split_by: str = "scene",
    per_value: int | None = None,
    scenes: int | None = None,
    sample_by: str = "auto",
    per_scene_value: int = 2,
    strata: Sequence[str] | None = None,
    seed: int = 0,
    **load_kwargs,
) -> tuple[list[ValueItem], list[ValueItem]]:
    """The items a VAT run measures and those it holds out for training (``aligntax vat run``'s
    selection): :func:`load_items` of ``data``, :func:`split_items` by ``split_by``, then
    :func:`sample_items` of the evaluation part (at most ``per_value`` items per value, ``scenes``
    random scenes, drawn as :func:`sample_by_for` says)."""
    items = load_items(data, **load_kwargs)
    eval_items, train_items = split_items(items, train_fraction, seed=seed, by=split_by)
    eval_items = sample_items(
        eval_items,
        per_value=per_value,
        scenes=scenes,
        seed=seed,
        strata=strata,
        by=sample_by_for(str(data), sample_by),
        per_scene_value=per_scene_value,
    )
    return eval_items, train_items


def value_counts(items: Iterable[ValueItem]) -> dict[str, dict[int, int]]:
    """Items per value and polarity (the key 0 only where a value has neutral items)."""
    out = {v: {1: 0, -1: 0} for v in VALUES}
    for it in items:
        out[it.value][it.polarity] = out[it.value].get(it.polarity, 0) + 1
    return out
