"""``vat sweep`` (models x interventions x targets, one resumable run folder per cell, a summary table) and
the paired comparison behind ``vat compare`` (item-by-item differences between runs on shared items).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aligntax.errors import AligntaxError, DataError
from aligntax.runfolder import RunLockedError, WriteError, check_settings, run_lock, write_text_atomic
from aligntax.vat.schwartz import CODES, VALUES, resolve_value


# ----------------------------------------------------------------- paired comparison of runs
def _load_run(d: str | Path) -> tuple[dict, list[dict]]:
    from aligntax.vat.runner import read_rows

    d = Path(d)
    if not (d / "results.json").is_file() or not (d / "items.jsonl").is_file():
        raise AligntaxError(f"{d} is not a finished VAT run (needs results.json and items.jsonl)")
    return json.loads((d / "results.json").read_text()), read_rows(d / "items.jsonl")


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _model_id(res: dict) -> dict:
    fp = res.get("model_fingerprint") or {}
    post = res.get("post_model_fingerprint")
    return {"model": fp, "post_model": post}


def check_comparable(
    ref: tuple[dict, list[dict]], other: tuple[dict, list[dict]], ref_name: str = "A", other_name: str = "B"
) -> dict:
    """What two runs share: items (same id with the same value and polarity), judge configuration and
    model. Different judge settings (scale, templates, orders, method) make the shifts incomparable and
    raise ``AligntaxError``, as does an item id whose value or polarity differs, or no shared item. A
    different model is allowed (a sweep over models) but reported: the paired difference then mixes
    model and intervention."""
    (ra, rows_a), (rb, rows_b) = ref, other
    ja = (ra.get("config") or {}).get("judge")
    jb = (rb.get("config") or {}).get("judge")
    keys = ("scale", "templates", "orders", "method", "system")
    if ja and jb:
        diff = [k for k in keys if not _same(ja.get(k), jb.get(k))]
        if diff:
            raise AligntaxError(
                f"{ref_name} and {other_name} use different judges ({', '.join(diff)} differ); "
                "their shifts are not comparable"
            )
    by_a = {r["id"]: r for r in rows_a}
    shared, only_b = [], 0
    for r in rows_b:
        a = by_a.get(r["id"])
        if a is None:
            only_b += 1
            continue
        if resolve_value(a["value"]) != resolve_value(r["value"]) or int(a["polarity"]) != int(r["polarity"]):
            raise AligntaxError(
                f"item {r['id']} has a different value or polarity in {ref_name} and {other_name}; "
                "the runs were made on different item sets"
            )
        shared.append(r["id"])
    if not shared:
        raise AligntaxError(f"{ref_name} and {other_name} share no item")
    same_model = _same(_model_id(ra), _model_id(rb))
    return {
        "shared_items": len(shared),
        "only_in_reference": len(rows_a) - len(shared),
        "only_in_other": only_b,
        "same_judge": True,
        "same_model": same_model,
        "note": None
        if same_model
        else "the runs use different models: the paired difference mixes the model and the intervention",
    }


def paired_difference(
    rows_ref: Sequence[dict],
    rows_other: Sequence[dict],
    reps: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    alpha: float = 0.05,
    order: Sequence[str] = VALUES,
) -> dict:
    """Per value: mean over shared polar items of d_i(other) - d_i(reference), with a scene-bootstrap
    percentile interval (scenes drawn with replacement, n of n), a scene-level sign-flip test and
    Benjamini-Hochberg over the values."""
    from aligntax.vat import stats as ST
    from aligntax.vat.metrics import benjamini_hochberg

    ref = {r["id"]: r for r in rows_ref if r.get("pre") is not None and r.get("post") is not None}
    vals, grp, dd = [], [], []
    for r in rows_other:
        a = ref.get(r["id"])
        if a is None or r.get("pre") is None or r.get("post") is None or int(r["polarity"]) == 0:
            continue
        p = float(r["polarity"])
        x = p * (float(r["post"]) - float(r["pre"])) - p * (float(a["post"]) - float(a["pre"]))
        if not math.isfinite(x):
            continue
        vals.append(resolve_value(r["value"]))
        grp.append(str(r.get("group") or r["id"]))
        dd.append(x)
    if not dd:
        return {"n_paired": 0, "reason": "no shared polar item"}
    d, values, groups = np.array(dd), np.array(vals), np.array(grp)
    scenes, S, N = ST.scene_sums(d, values, groups, order)
    ci = [None] * len(order)
    if len(scenes) >= 2 and reps > 0:
        rng = np.random.default_rng(seed)
        W = rng.multinomial(len(scenes), np.full(len(scenes), 1.0 / len(scenes)), size=reps).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            B = np.where(W @ N > 0, (W @ S) / np.where(W @ N > 0, W @ N, 1.0), np.nan)
        ci = [ST._pct(B[:, j], level) for j in range(len(order))]
    X = ST.scene_means(d, values, groups, order)
    ps = [ST._sign_flip(X[:, j], 9999, seed) for j in range(len(order))]
    qs, rej = benjamini_hochberg(ps, alpha)
    per_value = {}
    for j, v in enumerate(order):
        m = values == v
        per_value[v] = {
            "value": float(d[m].mean()) if m.any() else None,
            "ci95": ci[j],
            "covers_zero": ST.covers_zero(ci[j]),
            "p_value_scene": ps[j],
            "q_value": qs[j],
            "significant": rej[j],
            "n": int(m.sum()),
            "n_scenes": int(np.isfinite(X[:, j]).sum()),
        }
    return {
        "n_paired": len(dd),
        "n_scenes": len(scenes),
        "definition": "d_i(other) - d_i(reference) on shared items, per value",
        "interval": f"scene bootstrap ({reps} draws of n of n scenes), percentile",
        "per_value": per_value,
    }


def paired_compare(dirs: Sequence[str | Path], out_dir: str | Path, reps: int = 2000, seed: int = 0) -> dict:
    """Each run against the first (the reference): the checks of ``check_comparable`` and the paired
    per-value differences. Writes ``paired.json`` and ``paired.md`` into ``out_dir``."""
    from aligntax.vat.runner import json_safe, write_json_atomic

    if len(dirs) < 2:
        raise AligntaxError("A paired comparison needs at least two runs (the first is the reference)")
    runs = [_load_run(d) for d in dirs]
    ref_name = Path(dirs[0]).name
    out = {"reference": str(dirs[0]), "comparisons": []}
    for d, run in zip(dirs[1:], runs[1:], strict=True):
        chk = check_comparable(runs[0], run, ref_name, Path(d).name)
        diff = paired_difference(runs[0][1], run[1], reps=reps, seed=seed)
        out["comparisons"].append(
            {
                "run": str(d),
                "target": run[0]["target"],
                "reference_target": runs[0][0]["target"],
                "checks": chk,
                **diff,
            }
        )
    o = Path(out_dir)
    o.mkdir(parents=True, exist_ok=True)
    out = json_safe(out)
    write_json_atomic(o / "paired.json", out)
    md = [
        f"## Paired differences against `{ref_name}`",
        "",
        "Per value: mean over shared items of the shift in the run minus the shift in the reference "
        "(Likert points, polarity-signed), with a scene-bootstrap 95% interval; * = Benjamini-Hochberg "
        "significant (scene-level sign-flip tests).",
        "",
        "| run | shared items | same model | " + " | ".join(CODES[v] for v in VALUES) + " |",
        "|---|---:|---|" + "---|" * len(VALUES),
    ]
    for c in out["comparisons"]:
        cells = []
        for v in VALUES:
            x = (c.get("per_value") or {}).get(v) or {}
            if x.get("value") is None:
                cells.append("n/a")
                continue
            ci = x.get("ci95")
            cells.append(
                f"{x['value']:+.3f}{'*' if x.get('significant') else ''}"
                + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")
            )
        md.append(
            f"| {Path(c['run']).name} | {c['checks']['shared_items']} | "
            f"{'yes' if c['checks']['same_model'] else 'no'} | " + " | ".join(cells) + " |"
        )
    notes = {c["checks"]["note"] for c in out["comparisons"] if c["checks"].get("note")}
    md += ["", *[f"- {n}" for n in sorted(notes)], ""]
    write_text_atomic(o / "paired.md", "\n".join(md))
    return out


# ----------------------------------------------------------------- sweep
@dataclass
class SweepSpec:
    models: list[str]
    interventions: list[str]
    targets: list[str] = field(default_factory=lambda: list(VALUES))
    data: str = "builtin"
    limit_per_value: int | None = None
    scenes: int | None = None
    sample_by: str = "item"
    strata: list[str] | None = None
    train_fraction: float = 0.2
    dtype: str = "bf16"
    batch_size: int = 16
    strength: float = 4.0
    steps: int | None = None
    oracle_gain: float = 0.5
    seed: int = 0
    bootstrap: int = 500
    permutations: int = 999
    null_reps: int = 0
    cache: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> SweepSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise DataError(f"sweep config: unknown keys {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        for k in ("models", "interventions", "targets", "strata"):
            if isinstance(d.get(k), str):
                d[k] = [x.strip() for x in d[k].split(",") if x.strip()]
        if not d.get("models") or not d.get("interventions"):
            raise DataError("sweep config: needs at least one model and one intervention")
        if d.get("targets") in (None, [], ["all"]):
            d["targets"] = list(VALUES)
        d["targets"] = [resolve_value(t) for t in d["targets"]]
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SweepSpec:
        import yaml

        try:
            d = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise DataError(f"sweep config {path}: {exc}") from None
        if not isinstance(d, dict):
            raise DataError(f"sweep config {path}: expected a mapping of keys")
        return cls.from_dict(d)


def model_short(spec: str) -> str:
    return spec.split(":")[-1].split("/")[-1].replace(".gguf", "").replace(" ", "_") or "model"


def cell_dir(out: str | Path, model: str, intervention: str, target: str) -> Path:
    return Path(out) / model_short(model) / intervention / CODES[resolve_value(target)].lower()


def _complete(d: Path, ids: set[str]) -> bool:
    from aligntax.vat.runner import read_rows

    if not (d / "results.json").is_file():
        return False
    done = {r["id"] for r in read_rows(d / "items.jsonl")}
    return ids <= done


def run_sweep(
    spec: SweepSpec,
    out_dir: str | Path,
    load_model: Callable | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Every (model, intervention, target) cell into ``out/<model>/<intervention>/<code>/``. A cell whose
    run is complete (results.json and every evaluation item judged) is skipped, an interrupted one
    resumes (``run_vat``), and a failing cell is recorded and the sweep goes on. Writes
    ``sweep.json`` (the spec), ``summary.json``, ``summary.csv`` and ``summary.md``."""
    if load_model is None:
        from aligntax.models import load_model
    log = log or (lambda s: None)
    out = Path(out_dir)
    with run_lock(out):  # one writer per sweep folder (each cell's folder has its own lock too)
        # a sweep becomes bound with its first judged item: a changed setting would mix cells made with
        # two settings in one summary (adding models, interventions or targets extends it)
        bound = any(out.glob("*/*/*/items.jsonl"))
        spec_d = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
        check_settings(out, "sweep.json", spec_d, _SWEEP_KEYS, bound, "VAT sweep")
        return _run_sweep(spec, out, load_model, progress, log)


# The sweep settings that change a cell's result (all but the lists of cells and the cache switch).
_SWEEP_KEYS = tuple(
    k for k in SweepSpec.__dataclass_fields__ if k not in ("models", "interventions", "targets", "cache")
)


def _run_sweep(spec: SweepSpec, out: Path, load_model, progress: bool, log) -> list[dict]:
    from aligntax.vat.items import load_items, sample_items, split_items
    from aligntax.vat.judge import JudgeConfig
    from aligntax.vat.methods import build_intervention
    from aligntax.vat.runner import VATConfig, run_vat

    items = load_items(spec.data)
    ev, tr = split_items(items, spec.train_fraction, seed=spec.seed)
    ev = sample_items(
        ev,
        per_value=spec.limit_per_value,
        scenes=spec.scenes,
        seed=spec.seed,
        strata=spec.strata,
        by=spec.sample_by,
    )
    ids = {it.id for it in ev}
    jcfg = JudgeConfig(batch_size=spec.batch_size, cache=spec.cache)
    cells = []
    for model in spec.models:
        todo = [
            (iv, t)
            for iv in spec.interventions
            for t in spec.targets
            if not _complete(cell_dir(out, model, iv, t), ids)
        ]
        lm = load_model(model, dtype=spec.dtype) if todo else None
        for iv_name in spec.interventions:
            for t in spec.targets:
                d = cell_dir(out, model, iv_name, t)
                cell = {"model": model, "intervention": iv_name, "target": t, "dir": str(d)}
                if (iv_name, t) not in todo:
                    # the same status as when it was judged now: the summary does not depend on
                    # which invocation finished the cell
                    log(f"sweep: {model} / {iv_name} / {t}: complete, skipped")
                    cells.append({**cell, "status": "done"})
                    continue
                log(f"sweep: {model} / {iv_name} / {t} -> {d}")
                try:
                    iv = build_intervention(
                        iv_name,
                        lm,
                        t,
                        tr,
                        jcfg,
                        strength=spec.strength,
                        steps=spec.steps,
                        seed=spec.seed,
                        exclude_ids=ids,
                        adapter_dir=d / "adapter",
                        oracle_gain=spec.oracle_gain,
                        progress=progress,
                    )
                    cfg = VATConfig(
                        judge=jcfg,
                        bootstrap_reps=spec.bootstrap,
                        n_perm=spec.permutations,
                        nvat_null_reps=spec.null_reps,
                        seed=spec.seed,
                        progress=progress,
                        extra={
                            "data": spec.data,
                            "intervention": iv_name,
                            "sweep": str(out),
                            "limit_per_value": spec.limit_per_value,
                            "scenes": spec.scenes,
                            "sample_by": spec.sample_by,
                            "strata": spec.strata,
                        },
                    )
                    run_vat(lm, ev, t, iv, d, cfg)
                    cells.append({**cell, "status": "done"})
                except (WriteError, RunLockedError):
                    raise  # a full disk or a second writer ends the sweep; a rerun resumes it
                except AligntaxError as exc:
                    cells.append({**cell, "status": f"failed: {exc}"})
                    log(f"sweep: cell failed: {exc}")
    rows = write_summary(cells, out)
    return rows


def _get(d: dict | None, *path):
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def summary_row(cell: dict) -> dict:
    f = Path(cell["dir"]) / "results.json"
    row = {k: cell[k] for k in ("model", "intervention", "target", "status")}
    if not f.is_file() or cell["status"].startswith("failed"):
        return row
    r = json.loads(f.read_text())
    row.update(
        {
            "n_items": r.get("n_items"),
            "gain": _get(r, "gain", "value"),
            "gain_ci95": _get(r, "gain", "ci95"),
            "specificity": _get(r, "specificity", "value"),
            "specificity_ci95": _get(r, "specificity", "ci95"),
            "mean_off_target_drift": _get(r, "specificity", "mean_off_target_drift"),
            "vat_absolute": _get(r, "vat", "absolute"),
            "vat_reason": _get(r, "vat", "reason"),
            "gain_congruent": _get(r, "strata", "congruent", "gain", "value"),
            "gain_incongruent": _get(r, "strata", "incongruent", "gain", "value"),
            "neutral_lift": _get(r, "strata", "neutral", "lift", "value"),
        }
    )
    return row


def write_summary(cells: Sequence[dict], out: str | Path) -> list[dict]:
    from aligntax.vat.runner import json_safe, write_json_atomic

    out = Path(out)
    rows = [json_safe(summary_row(c)) for c in cells]
    write_json_atomic(out / "summary.json", rows)
    cols = [
        "model",
        "intervention",
        "target",
        "status",
        "n_items",
        "gain",
        "gain_ci95",
        "specificity",
        "specificity_ci95",
        "mean_off_target_drift",
        "vat_absolute",
        "gain_congruent",
        "gain_incongruent",
        "neutral_lift",
    ]
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()})
    write_text_atomic(out / "summary.csv", buf.getvalue())

    def f(x, ci=None):
        if x is None:
            return "n/a"
        return f"{x:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")

    md = [
        "# VAT sweep",
        "",
        "| model | intervention | target | n | gain [95% CI] | S_T [95% CI] | "
        "off-target drift | VAT abs | gain congruent | gain incongruent | neutral lift | status |",
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        vat = r.get("vat_absolute")
        md.append(
            f"| {model_short(r['model'])} | {r['intervention']} | {r['target']} | {r.get('n_items', 'n/a')} | "
            f"{f(r.get('gain'), r.get('gain_ci95'))} | {f(r.get('specificity'), r.get('specificity_ci95'))} | "
            f"{f(r.get('mean_off_target_drift'))} | {'withheld' if vat is None and r.get('n_items') else f(vat)} "
            f"| {f(r.get('gain_congruent'))} | {f(r.get('gain_incongruent'))} | {f(r.get('neutral_lift'))} | "
            f"{r['status']} |"
        )
    write_text_atomic(out / "summary.md", "\n".join(md) + "\n")
    return rows
