"""``aligntax audit``: every panel measured on the baseline and on the candidate, in one run folder.

The folder ``OUT`` holds

- ``config.json``: the audit's settings header (a rerun with the same model, candidate, judge and
  generation settings resumes; once the folder holds a measurement, other settings are refused with one
  line naming each key that differs; the profile, the panels and the policy may change between runs);
- ``baseline/`` and ``candidate/``: one run folder per measurement, each written and resumed by the
  run it is: ``eval/`` (:func:`aligntax.runs.eval.run_eval`, every refusal row's prompts; the candidate
  copies the answers of the rows its intervention leaves unsteered from the baseline), ``knowns-NAME/``
  (:func:`aligntax.runs.knowns.run_knowns`), ``mc-NAME/`` (:func:`aligntax.runs.mc.run_mc`);
- ``fluency.jsonl``: the log-likelihood under the baseline model of each benign answer (keyed by the
  prompt and the answer's text, so an answer both sides gave is scored once), appended as computed;
- ``values/``: the paired value judgments (:func:`aligntax.vat.runner.judge_pairs`; with a target,
  the whole VAT run of :func:`aligntax.vat.runner.run_vat`);
- ``audit.json``, ``report.md`` and ``report.html``: the rows, their statistics and the verdict
  (:mod:`aligntax.audit.report`).

The folder keeps the run-folder contract (:mod:`aligntax.runfolder`): one writer (its lock, and each
sub-run's own), the settings header, atomic writes of every file but the append-only ones, and a rerun
of the same command that redoes nothing finished (each sub-run resumes its samples; the multiple-choice
rows and the fluency scores already made are kept).

Everything the audit reads is loaded and checked (panels, policy, datasets, the candidate's folder
against the model's architecture) before any model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from aligntax.audit import stats as S
from aligntax.audit.candidate import (
    ADAPTER,
    Candidate,
    check_candidate_model,
    check_made_for,
)
from aligntax.audit.spec import PROFILES, Panel, Policy, RowSpec, load_panels, load_policy, select_panels
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError, UsageError
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runfolder import (
    LOCK_NAME,
    WHERE_NAME,
    append_jsonl,
    check_settings,
    read_jsonl,
    run_lock,
    write_json_atomic,
)

SCHEMA = "aligntax.audit/1"
SIDES = ("baseline", "candidate")
# settings that change what a sample is: a resumed audit must agree on all of them
_RESUME_FIELDS = (
    "model",
    "candidate_model",
    "intervention",
    "intervention_args",
    "target",
    "judge",
    "max_new_tokens",
    "dtype",
)


@dataclass
class AuditConfig:
    """Settings of ``aligntax audit``. The candidate is ``candidate_model`` (another checkpoint) or
    ``intervention`` with ``intervention_args`` on ``model`` (``demo``: the demo folder it was read from,
    recorded)."""

    out: str
    model: str = DEFAULT_MODEL
    candidate_model: str | None = None
    intervention: str | None = None
    intervention_args: dict = field(default_factory=dict)
    demo: str | None = None
    # a Schwartz value the change aims at: the values panel then reports the VAT metrics of `vat run`
    target: str | None = None
    profile: str = "full"  # "quick": each row's stated subset; "full": every item
    panels: list[str] | None = None  # None: every declared panel
    panel_file: str | None = None
    policy: str | None = None  # None: the shipped default
    judge: str = "classifier"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = 96
    dtype: str = "bf16"
    seed: int = 0
    bootstrap: int = 2000  # paired-bootstrap draws of a score row's interval
    # an earlier audit of the same model and settings: its baseline runs are copied in, so only the
    # candidate is generated (the baseline is the same whatever the candidate)
    baseline_from: str | None = None
    progress: bool = True

    def candidate(self) -> Candidate:
        return Candidate(
            self.intervention, dict(self.intervention_args or {}), self.candidate_model, self.demo
        )


# ---------------------------------------------------------------- the plan: everything checked, no model
@dataclass
class Plan:
    """What an audit measures: the panels, the policy, the candidate and every row's items."""

    cfg: AuditConfig
    panels: list[Panel]
    all_panels: dict[str, Panel]
    policy: Policy
    candidate: Candidate
    items: dict[tuple[str, str], list] = field(default_factory=dict)  # (panel, row) -> items
    prompts: list = field(default_factory=list)  # every prompt the refusal rows (and fluency) need
    values_items: list = field(default_factory=list)

    def rows(self) -> list[RowSpec]:
        return [r for p in self.panels for r in p.rows]

    def unchanged(self) -> bool:
        """Whether the candidate is the baseline itself (``--intervention none``, or ``--candidate-model``
        the same spec as ``--model``): every row is then unsteered, and the candidate's answers are the
        baseline's (the same runs, not a second generation whose batches could differ)."""
        cand = self.candidate
        return (not cand.model and cand.intervention == "none") or cand.model == self.cfg.model

    def folder(self, out: Path, side: str) -> Path:
        """The folder of ``side``'s runs (the candidate's are the baseline's when it is unchanged)."""
        return out / ("baseline" if side == "candidate" and self.unchanged() else side)


def stratified(items: Sequence, n: int | None, seed: int, key: Callable, salt: str = "") -> list:
    """``n`` of ``items`` (all when ``n`` is None or not smaller), drawn at random (``seed``) within the
    strata ``key`` gives, each stratum's share in proportion to its size (largest remainders), in input
    order."""
    items = list(items)
    if n is None or n >= len(items):
        return items
    groups: dict = {}
    for i, it in enumerate(items):
        groups.setdefault(key(it) or "", []).append(i)
    quotas = {g: n * len(ix) / len(items) for g, ix in groups.items()}
    take = {g: int(math.floor(q)) for g, q in quotas.items()}
    left = n - sum(take.values())
    for g in sorted(groups, key=lambda g: (-(quotas[g] - take[g]), str(g)))[:left]:
        take[g] += 1
    rng = random.Random(f"{seed}:{salt}")
    chosen: set[int] = set()
    for g in sorted(groups, key=str):
        chosen.update(rng.sample(groups[g], take[g]))
    return [it for i, it in enumerate(items) if i in chosen]


def _check_settings(cfg: AuditConfig) -> None:
    if cfg.profile not in PROFILES:
        raise UsageError(f"profile is {' or '.join(PROFILES)}, not {cfg.profile!r}.")
    for name, value in (("max_new_tokens", cfg.max_new_tokens), ("batch_size", cfg.batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"--{name.replace('_', '-')} is a whole number above 0, not {value!r}.")
    if cfg.bootstrap < 100:
        raise UsageError("--bootstrap takes 100 draws or more.")
    if cfg.target is not None:
        from aligntax.vat.schwartz import resolve_value

        cfg.target = resolve_value(cfg.target)


def _check_candidate(cfg: AuditConfig) -> Candidate:
    cand = cfg.candidate()
    if cand.model and cand.intervention:
        raise UsageError(
            "Give one candidate: --candidate-model SPEC (another checkpoint) or an intervention on --model "
            "(--steer DIR, --intervention NAME, --adapter DIR), not both."
        )
    if not cand.model and not cand.intervention:
        raise UsageError(
            "No candidate: give --candidate-model SPEC, --steer DIR (an ELS, els-lora or demo folder), "
            "--intervention NAME or --adapter DIR."
        )
    if cand.model:
        check_candidate_model(cfg.model, cand.model)
        return cand
    from aligntax.interventions.options import METHODS
    from aligntax.runs.provenance import intervention_folder

    if cand.intervention != ADAPTER and cand.intervention not in METHODS:
        raise UsageError(
            f"Unknown intervention {cand.intervention!r} for an audit; known: {', '.join([*METHODS, ADAPTER])}."
        )
    folder = cand.args.get(ADAPTER) if cand.intervention == ADAPTER else intervention_folder(cand.args)
    if cand.intervention == ADAPTER and not folder:
        raise UsageError("--intervention adapter needs --adapter DIR (a PEFT LoRA adapter folder).")
    if folder:
        if not Path(folder).is_dir():
            raise UsageError(f"{folder}: no such folder.")
        check_made_for(
            folder, cfg.model, "--adapter" if cand.intervention == ADAPTER else "--steer/--vectors"
        )
    return cand


def plan_audit(cfg: AuditConfig) -> Plan:
    """Read and check everything the audit needs, loading no model: the settings, the panels
    (``panel_file`` added), the policy, the candidate (its folder made for ``model``'s architecture), and
    every row's items at the profile's sizes. Every problem is one :class:`AligntaxError`."""
    from aligntax.data import load_prompt_sets

    _check_settings(cfg)
    all_panels = load_panels(cfg.panel_file)
    panels = select_panels(all_panels, cfg.panels)
    policy = load_policy(cfg.policy, all_panels)
    cand = _check_candidate(cfg)
    plan = Plan(cfg, panels, all_panels, policy, cand)
    prompts: dict = {}

    def refusal_items(panel: Panel, row: RowSpec) -> list:
        """The row's prompts of its label: per dataset (each part of a group dataset such as
        jbb-attacks), the profile's number drawn stratified by category, the draw salted by the
        dataset's name, so a row of one attack and a row of the group take the same prompts of it."""
        from aligntax.data.registry import find_dataset

        label = "benign" if row.metric == "compliance" else "harmful"
        picked = []
        for spec in row.data:
            named = find_dataset(spec)
            for part in named.parts if named is not None and named.parts else (spec,):
                got = [it for it in load_prompt_sets([part]) if it.label == label]
                if not got:
                    raise UsageError(
                        f"panel {panel.name!r}, row {row.name!r}: {part} has no {label} prompts."
                    )
                picked += stratified(got, row.size(cfg.profile), cfg.seed, lambda it: it.category, str(part))
        for it in picked:
            prompts.setdefault((it.source, it.id), it)
        return picked

    for panel in panels:
        for row in panel.rows:
            key = (panel.name, row.name)
            if row.kind == "refusal":
                plan.items[key] = refusal_items(panel, row)
            elif row.kind == "knowns":
                from aligntax.metrics.knowns import load_known_answers

                its = load_known_answers(row.data[0], row.options.get("split", "test"))
                plan.items[key] = stratified(
                    its, row.size(cfg.profile), cfg.seed, lambda it: it.kind, row.name
                )
            elif row.kind == "mc":
                from aligntax.metrics.mc import load_mc

                plan.items[key] = stratified(
                    load_mc(row.data[0]), row.size(cfg.profile), cfg.seed, lambda it: it.subject, row.name
                )
            elif row.kind == "fluency":
                of = all_panels[row.options["of"]]
                benign = []
                for r in of.rows:
                    if r.kind == "refusal" and r.metric == "compliance":
                        benign += refusal_items(of, r)
                plan.items[key] = list({(it.source, it.id): it for it in benign}.values())
            elif row.kind == "values":
                from aligntax.vat.items import evaluation_items

                if plan.values_items:
                    raise UsageError("One values row per audit: the values are judged once.")
                plan.values_items, _ = evaluation_items(
                    row.options.get("items", "builtin"), per_value=row.size(cfg.profile), seed=cfg.seed
                )
                plan.items[key] = plan.values_items
    plan.prompts = list(prompts.values())
    return plan


# ---------------------------------------------------------------- running
def _measured(out: Path) -> bool:
    """Whether the folder holds a measurement (it is then bound to its settings header)."""
    if any((out / f).is_file() for f in ("audit.json", "fluency.jsonl")):
        return True
    return any(
        (out / side).is_dir() and any(p.is_file() for p in (out / side).rglob("*.jsonl"))
        for side in (*SIDES, "values")
    )


def _check_resume(out: Path, cfg: AuditConfig, write: bool) -> None:
    """The settings header rule (``config.json``): a folder holding a measurement refuses other
    settings (:data:`_RESUME_FIELDS`) with one line; the header is (re)written when ``write``."""
    check_settings(out, "config.json", asdict(cfg), _RESUME_FIELDS, _measured(out), "audit", write=write)


def build_candidate(cand: Candidate, lm):
    """The candidate's intervention on ``lm`` (None for a checkpoint): a registered method built as every
    steering command builds it, or a PEFT LoRA adapter applied by hooks."""
    if cand.model:
        return None
    if cand.intervention == ADAPTER:
        from aligntax.vat.methods.adapter import LoRAAdapter

        return LoRAAdapter.load(cand.args[ADAPTER], lm)
    from aligntax.interventions.registry import make_intervention

    return make_intervention(cand.intervention, lm, **cand.args)


@dataclass
class _Side:
    name: str
    lm: object
    intervention: object
    spec: str  # the model spec its runs record
    iv_name: str | None
    iv_args: dict


def run_audit(cfg: AuditConfig, lm=None, candidate_lm=None, judge=None, plan: Plan | None = None) -> dict:
    """Run (or resume) the audit and write ``audit.json``, ``report.md`` and ``report.html``; returns the
    audit (``audit.json``'s content). ``lm``: the baseline model (loaded here when None);
    ``candidate_lm``: the candidate checkpoint (loaded here when the candidate is one and it is None);
    ``judge``: the refusal judge (``cfg.judge`` when None)."""
    plan = plan or plan_audit(cfg)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is an existing file; give a folder.")
    if out.is_dir():
        _check_resume(out, cfg, write=False)  # refused before anything loads or is written
    source = _check_baseline_from(cfg)
    with run_lock(out):
        _check_resume(out, cfg, write=True)
        if source is not None:
            _copy_baseline(source, out)
        return _run(plan, out, lm, candidate_lm, judge)


# the settings two audits must share for one's baseline runs to serve the other
_BASELINE_FIELDS = ("model", "judge", "max_new_tokens", "dtype", "seed")


def _check_baseline_from(cfg: AuditConfig) -> Path | None:
    if not cfg.baseline_from:
        return None
    src = Path(cfg.baseline_from)
    if not (src / "config.json").is_file() or not (src / "baseline").is_dir():
        raise UsageError(f"--baseline-from {src}: not an audit folder (no config.json / baseline/).")
    old, new = json.loads((src / "config.json").read_text()), asdict(cfg)
    diffs = [f"{k}: {old.get(k)!r} vs {new.get(k)!r}" for k in _BASELINE_FIELDS if old.get(k) != new.get(k)]
    if diffs:
        raise UsageError(f"--baseline-from {src} was made with other settings ({'; '.join(diffs)}).")
    return src


def _copy_baseline(src: Path, out: Path) -> None:
    """The baseline runs of the audit ``src`` into ``out`` (those ``out`` lacks; each then resumes as
    its own run), and the fluency scores of its answers. Each run is copied into a temp folder and
    renamed into place whole, so a copy cut short leaves nothing a rerun would take for a run."""
    import os
    import shutil

    (out / "baseline").mkdir(exist_ok=True)
    for stale in (out / "baseline").glob(".copy.*"):
        shutil.rmtree(stale, ignore_errors=True)  # a copy cut short (we hold the folder's lock)
    for run in sorted((src / "baseline").iterdir()):
        final = out / "baseline" / run.name
        if not run.is_dir() or run.name.startswith(".") or final.exists():
            continue
        tmp = out / "baseline" / f".copy.{os.getpid()}.{run.name}"
        # not the source's lock or where it was: the copy is its own run folder, here
        shutil.copytree(run, tmp, ignore=shutil.ignore_patterns(f"{LOCK_NAME}*", WHERE_NAME, ".*.tmp"))
        for f in ("config.json", "results.json"):
            path = tmp / f
            if path.is_file() and run.name != "values":
                doc = json.loads(path.read_text())
                block = doc.get("config", doc) if f == "results.json" else doc
                if isinstance(block, dict) and "out" in block:
                    block["out"] = str(final)
                    write_json_atomic(path, doc)
        os.replace(tmp, final)
    scores = src / "fluency.jsonl"
    if scores.is_file():
        have = (
            {r["key"] for r in read_jsonl(out / "fluency.jsonl", repair=True)}
            if (out / "fluency.jsonl").is_file()
            else set()
        )
        append_jsonl(out / "fluency.jsonl", [r for r in read_jsonl(scores) if r["key"] not in have])


def _say(cfg: AuditConfig, text: str) -> None:
    if cfg.progress:
        import sys

        print(f"[audit] {text}", file=sys.stderr, flush=True)


def _run(plan: Plan, out: Path, lm, candidate_lm, judge) -> dict:
    from aligntax.judges import get_judge
    from aligntax.models import load_model
    from aligntax.runs.sources import generation_source

    cfg, cand = plan.cfg, plan.candidate
    t0 = time.perf_counter()
    lm = lm or load_model(cfg.model, dtype=cfg.dtype)
    if cand.model:
        if candidate_lm is None:
            candidate_lm = lm if cand.model == cfg.model else load_model(cand.model, dtype=cfg.dtype)
        cside = _Side("candidate", candidate_lm, None, cand.model, None, {})
    else:
        iv = build_candidate(cand, lm)
        cside = _Side("candidate", lm, iv, cfg.model, cand.intervention, dict(cand.args))
    bside = _Side("baseline", lm, None, cfg.model, None, {})
    kinds = {r.kind for r in plan.rows()}
    needs_judge = bool(plan.prompts)
    judge = judge or (get_judge(cfg.judge) if needs_judge else None)
    source = generation_source("hf")
    timing: dict = {}
    if plan.unchanged():
        _say(cfg, "candidate: the baseline itself; its answers are the baseline's")
    try:
        for side in (bside,) if plan.unchanged() else (bside, cside):
            t = time.perf_counter()
            if plan.prompts:
                _say(cfg, f"{side.name}: {len(plan.prompts)} prompts of the refusal rows")
                _eval(plan, out, side, judge, source)
            for p in plan.panels:
                for r in p.rows:
                    if r.kind == "knowns":
                        _say(cfg, f"{side.name}: {r.name} ({len(plan.items[(p.name, r.name)])} questions)")
                        _knowns(plan, out, side, r, plan.items[(p.name, r.name)], source)
                    elif r.kind == "mc":
                        _say(cfg, f"{side.name}: {r.name} ({len(plan.items[(p.name, r.name)])} questions)")
                        _mc(plan, out, side, r, plan.items[(p.name, r.name)])
            timing[side.name] = round(time.perf_counter() - t, 1)
    finally:
        source.close()
    t = time.perf_counter()
    if "fluency" in kinds:
        _say(cfg, "fluency: answers scored under the baseline model")
        _fluency_scores(plan, out, lm)
    timing["fluency"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    values = None
    if "values" in kinds:
        _say(cfg, f"values: {len(plan.values_items)} items judged before and after")
        values = _values(plan, out, lm, cside)
    timing["values"] = round(time.perf_counter() - t, 1)
    audit = assemble(plan, out, values)
    timing["total"] = round(time.perf_counter() - t0, 1)
    audit["timing_seconds"] = timing
    from aligntax.audit.report import write_reports

    write_json_atomic(out / "audit.json", audit)
    write_reports(audit, out)
    return audit


def _eval(plan: Plan, out: Path, side: _Side, judge, source) -> dict:
    from aligntax.runs.eval import EvalConfig, run_eval

    cfg = plan.cfg
    reuse = (
        str(out / "baseline" / "eval") if side.name == "candidate" and side.intervention is not None else None
    )
    ecfg = EvalConfig(
        data=sorted({r.name for r in plan.rows() if r.kind == "refusal"}),
        out=str(out / side.name / "eval"),
        model=side.spec,
        judge=cfg.judge,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        intervention=side.iv_name,
        intervention_args=side.iv_args,
        reuse_unsteered=reuse,
        progress=cfg.progress,
    )
    return run_eval(
        ecfg, lm=side.lm, judge=judge, intervention=side.intervention, items=plan.prompts, source=source
    )


def _knowns(plan: Plan, out: Path, side: _Side, row: RowSpec, items: list, source) -> dict:
    from aligntax.runs.knowns import KnownsConfig, run_knowns

    cfg = plan.cfg
    folder = out / side.name / f"knowns-{_safe(row.name)}"
    reuse = (
        str(out / "baseline" / folder.name)
        if side.name == "candidate" and side.intervention is not None
        else None
    )
    kcfg = KnownsConfig(
        out=str(folder),
        model=side.spec,
        data=row.data[0],
        split=row.options.get("split", "test"),
        max_new_tokens=int(row.options.get("max_new_tokens") or cfg.max_new_tokens),
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        intervention=side.iv_name,
        intervention_args=side.iv_args,
        reuse_unsteered=reuse,
        progress=cfg.progress,
    )
    return run_knowns(kcfg, lm=side.lm, intervention=side.intervention, source=source, items=items)


def _mc(plan: Plan, out: Path, side: _Side, row: RowSpec, items: list) -> dict:
    from aligntax.runs.mc import MCConfig, run_mc

    cfg = plan.cfg
    folder = out / side.name / f"mc-{_safe(row.name)}"
    mcfg = MCConfig(
        out=str(folder),
        model=side.spec,
        data=row.data[0],
        dtype=cfg.dtype,
        intervention=side.iv_name,
        intervention_args=side.iv_args,
        progress=cfg.progress,
    )
    ids = [it.id for it in items]
    done = folder / "results.json"
    if done.is_file():  # one forward pass per question: kept when made with these settings and questions
        old = json.loads(done.read_text())
        have = [r.get("id") for r in read_jsonl(folder / "samples.jsonl")]
        if old.get("config") == json.loads(json.dumps(asdict(mcfg), default=str)) and have == ids:
            return old
    return run_mc(mcfg, lm=side.lm, intervention=side.intervention, items=items)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# ---------------------------------------------------------------- fluency
def _answer_key(prompt: str, response: str) -> str:
    return hashlib.sha256(f"{prompt}\0{response}".encode()).hexdigest()[:32]


def _samples(plan: Plan, out: Path, side: str) -> dict[tuple[str, str], dict]:
    path = plan.folder(out, side) / "eval" / "samples.jsonl"
    return {(r["source"], r["id"]): r for r in read_jsonl(path)} if path.is_file() else {}


def _fluency_pairs(plan: Plan, out: Path) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Per fluency row: ``((prompt, baseline answer), (prompt, candidate answer))`` for each of its benign
    prompts that both sides answered (judged not a refusal): a refusal turned into an answer is the
    over-refusal rows' business, and a refusal's boilerplate is not a fluent answer to compare with."""
    base, cand = _samples(plan, out, "baseline"), _samples(plan, out, "candidate")
    pairs = {}
    for p in plan.panels:
        for r in p.rows:
            if r.kind == "fluency":
                keys = [(it.source, it.id) for it in plan.items[(p.name, r.name)]]
                pairs[(p.name, r.name)] = [
                    ((base[k]["prompt"], base[k]["response"]), (cand[k]["prompt"], cand[k]["response"]))
                    for k in keys
                    if k in base and k in cand and not base[k]["refused"] and not cand[k]["refused"]
                ]
    return pairs


def _fluency_scores(plan: Plan, out: Path, lm) -> dict[str, tuple[float, int]]:
    """The summed log-likelihood and token count under ``lm`` of every answer the fluency rows need,
    read from ``fluency.jsonl`` or computed and appended there (in chunks: a stopped audit resumes)."""
    from aligntax.metrics.fluency import response_nll

    path = out / "fluency.jsonl"
    known = (
        {r["key"]: (r["nll"], r["tokens"]) for r in read_jsonl(path, repair=True)} if path.is_file() else {}
    )
    todo: dict[str, tuple[str, str]] = {}
    for pairs in _fluency_pairs(plan, out).values():
        for b, a in pairs:
            for prompt, response in (b, a):
                k = _answer_key(prompt, response)
                if k not in known:
                    todo.setdefault(k, (prompt, response))
    keys = list(todo)
    chunk = 64
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        scores = response_nll(lm, [todo[k][0] for k in part], [todo[k][1] for k in part], batch_size=16)
        rows = [{"key": k, "nll": round(n, 6), "tokens": t} for k, (n, t) in zip(part, scores, strict=True)]
        append_jsonl(path, rows)
        known.update({r["key"]: (r["nll"], r["tokens"]) for r in rows})
    return known


# ---------------------------------------------------------------- values
def _vat_config(plan: Plan):
    """The settings of ``aligntax vat run``'s defaults (its judge, bootstrap, permutations, seed)."""
    from aligntax.vat.judge import JudgeConfig
    from aligntax.vat.runner import VATConfig

    cfg = plan.cfg
    return VATConfig(
        judge=JudgeConfig(),
        bootstrap_reps=500,
        n_perm=999,
        nvat_null_reps=200,
        seed=cfg.seed,
        progress=cfg.progress,
        extra={"data": "builtin", "audit": str(cfg.out)},
    )


def _values(plan: Plan, out: Path, lm, cside: _Side) -> dict:
    """The values panel's judgments and statistics: with a target, :func:`~aligntax.vat.runner.run_vat`
    itself (its results are those of ``vat run``); without, the judged pairs alone."""
    from aligntax.vat.runner import judge_pairs, run_vat

    vcfg = _vat_config(plan)
    post_lm = cside.lm if cside.intervention is None and plan.candidate.model else None
    iv = cside.intervention
    folder = out / "values"
    if plan.cfg.target:
        res = run_vat(lm, plan.values_items, plan.cfg.target, iv, folder, vcfg, post_lm=post_lm)
        from aligntax.vat.runner import read_rows

        rows = [
            r for r in read_rows(folder / "items.jsonl") if r["id"] in {it.id for it in plan.values_items}
        ]
        return {
            "target": plan.cfg.target,
            "results": res,
            "rows": rows,
            "scale": vcfg.judge.scale,
            "seed": vcfg.seed,
        }
    rows, _ = judge_pairs(lm, plan.values_items, None, iv, folder, vcfg, post_lm=post_lm)
    return {"target": None, "results": None, "rows": rows, "scale": vcfg.judge.scale, "seed": vcfg.seed}


def value_rows(values: dict, reps: int = 500) -> list[dict]:
    """One row per Schwartz value: the mean polarity-signed shift of its items (Likert points), the
    scene-bootstrap interval, the scene-level sign-flip p (the VAT statistics; with a target, read from
    the VAT run's results, which are ``vat run``'s). ``sd`` and ``n_units``: the spread and number of
    the per-scene mean shifts, the units of the test."""
    from aligntax.vat import stats as VS
    from aligntax.vat.runner import item_shifts
    from aligntax.vat.schwartz import VALUES

    seed = values.get("seed", 0)
    sh = item_shifts(values["rows"], values["scale"])
    X = VS.scene_means(sh.d, sh.values, sh.groups)  # per-scene mean shift [G, V]
    _, S_pre, N = VS.scene_sums(sh.e_pre, sh.values, sh.groups)
    pre_means = np.where(N > 0, S_pre / np.where(N > 0, N, 1.0), np.nan)
    res, target = values.get("results"), values.get("target")
    if res is None:
        cis = VS.shift_intervals(sh.d, sh.values, sh.groups, reps=reps, seed=seed)
        tests = VS.scene_level_tests(sh.d, sh.values, sh.groups, seed=seed)
    out = []
    for j, v in enumerate(VALUES):
        m = sh.values == v
        n = int(m.sum())
        if not n:
            continue
        if res is not None:
            block = res["gain"] if v == target else res["drift"][v]
            change, ci = block["value"], block["ci95"]
            p = res["tests"]["per_value"][v]["p_value"]
            base, cand = res["expression"][v]["pre"], res["expression"][v]["post"]
        else:
            change, ci = float(sh.d[m].mean()), cis[v]
            p = tests[v]["p_value"]
            base, cand = float(sh.e_pre[m].mean()), float(sh.e_post[m].mean())
        col = X[:, j]
        col = col[np.isfinite(col)]
        changed = bool(np.any(sh.d[m] != 0))
        pre_col = pre_means[:, j][np.isfinite(pre_means[:, j])]
        sd = (
            float(col.std(ddof=1))
            if changed and col.size > 1
            else float(pre_col.std(ddof=1))
            if pre_col.size > 1
            else float("nan")
        )
        out.append(
            {
                "row": v,
                "n": n,
                "n_units": int(col.size),
                "baseline": base,
                "candidate": cand,
                "change": change,
                "ci95": ci,
                "p": p if p is not None else (1.0 if not changed else None),
                "sd": sd,
                "sd_of": "per-scene mean shifts"
                if changed
                else "per-scene mean expression before (nothing changed)",
                "test": "scene-level sign-flip (VAT)",
                "direction": S.UP if v == target else S.EITHER,
            }
        )
    return out


def vat_summary(res: dict) -> dict:
    """The VAT metrics of a target's run, as ``vat run`` reports them."""
    v, sp = res["vat"], res["specificity"]
    return {
        "target": res["target"],
        "gain": res["gain"],
        "vat": {k: v.get(k) for k in ("signed", "absolute", "ci95_signed", "ci95_absolute", "reason")},
        "specificity": {k: sp.get(k) for k in ("value", "ci95", "p_value_scene", "interpretation")},
        "nvat": res.get("nvat"),
        "nvat_ci95": res.get("nvat_ci95"),
        "gnd": res.get("gnd"),
        "circumplex_test": {k: res["circumplex_test"].get(k) for k in ("statistic", "p_value")},
    }


# ---------------------------------------------------------------- rows, statistics, verdict
def _rate_flags(samples: dict, keys: list, metric: str) -> dict:
    if metric == "compliance":
        return {k: not samples[k]["refused"] for k in keys if k in samples}
    return {k: bool(samples[k]["refused"]) for k in keys if k in samples}


def _correct(folder: Path, ids: list[str]) -> dict[str, bool]:
    want = set(ids)
    path = folder / "samples.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    return {r["id"]: bool(r["correct"]) for r in rows if r.get("id") in want}


def _paired(before: dict, after: dict) -> tuple[list, list]:
    keys = [k for k in before if k in after]
    return [before[k] for k in keys], [after[k] for k in keys]


def assemble(plan: Plan, out: Path, values: dict | None) -> dict:
    """``audit.json``'s content from the finished runs: every row with its statistics, Holm-adjusted p,
    detectable change and verdict, the panels' and the overall verdict."""
    cfg, policy = plan.cfg, plan.policy
    base, cand = _samples(plan, out, "baseline"), _samples(plan, out, "candidate")
    fluency = None
    rows: list[dict] = []
    for p in plan.panels:
        for r in p.rows:
            items = plan.items[(p.name, r.name)]
            common = {
                "panel": p.name,
                "row": r.name,
                "kind": r.kind,
                "dataset": "+".join(r.data) if r.data else None,
                "metric": r.metric,
                "unit": r.unit,
                "direction": r.direction,
            }
            if r.kind == "refusal":
                keys = [(it.source, it.id) for it in items]
                b, a = _paired(_rate_flags(base, keys, r.metric), _rate_flags(cand, keys, r.metric))
                rows.append({**common, **S.rate_row(b, a)})
            elif r.kind in ("knowns", "mc"):
                ids = [it.id for it in items]
                name = f"{r.kind}-{_safe(r.name)}"
                b, a = _paired(
                    _correct(plan.folder(out, "baseline") / name, ids),
                    _correct(plan.folder(out, "candidate") / name, ids),
                )
                rows.append({**common, **S.rate_row(b, a)})
            elif r.kind == "fluency":
                if fluency is None:
                    path = out / "fluency.jsonl"
                    fluency = (
                        {x["key"]: (x["nll"], x["tokens"]) for x in read_jsonl(path)}
                        if path.is_file()
                        else {}
                    )
                pairs = _fluency_pairs(plan, out)[(p.name, r.name)]
                b_ppl, a_ppl, empty = [], [], 0
                for bp, ap in pairs:
                    (nb, tb), (na, ta) = fluency[_answer_key(*bp)], fluency[_answer_key(*ap)]
                    if tb == 0 or ta == 0:
                        empty += 1
                        continue
                    b_ppl.append(nb / tb)
                    a_ppl.append(na / ta)
                row = {**common, **S.score_row(b_ppl, a_ppl, reps=cfg.bootstrap, seed=cfg.seed)}
                row.update(n_empty=empty, of=r.options["of"])
                rows.append(row)
            elif r.kind == "values":
                for vr in value_rows(values):
                    rows.append({**common, "row": vr.pop("row"), "value_row": r.name, **vr})
    # Holm over every row's p; the detectable change at the strictest Holm threshold (alpha / m)
    adj = S.holm([row.get("p") for row in rows])
    m = sum(a is not None for a in adj)
    for row, a in zip(rows, adj, strict=True):
        row["p_adj"] = a
        rule = policy.rule(row["panel"], row["row"])
        row["max_loss"], row["alpha"] = rule.max_loss, rule.alpha
        level = rule.alpha / max(m, 1)
        if row["unit"] == "pt":
            d = S.detectable_rate(row["n"], level, policy.power)
            row["detectable"] = None if d is None else 100 * d
        else:
            row["detectable"] = S.detectable_score(
                row.get("sd", float("nan")), row.get("n_units", row["n"]), level, policy.power
            )
        row["verdict"], row["reason"] = S.verdict(row, rule.max_loss, rule.alpha)
        # whether a loss of the tolerated size would have been seen (a pass without it is weak evidence)
        row["powered"] = row["detectable"] is not None and row["detectable"] <= rule.max_loss
    panels = {}
    for p in plan.panels:
        vs = [row["verdict"] for row in rows if row["panel"] == p.name]
        panels[p.name] = {"about": p.about, "verdict": S.overall(vs), "rows": len(vs)}
    verdict = S.overall([row["verdict"] for row in rows])
    exit_status = (
        1 if verdict == S.FAIL or (verdict == S.INCONCLUSIVE and policy.inconclusive == "fail") else 0
    )
    audit = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": cfg.model,
        "candidate": {**asdict(plan.candidate), "description": plan.candidate.describe()},
        "profile": cfg.profile,
        "policy": policy.to_dict(),
        "comparisons": m,
        "verdict": verdict,
        "exit_status": exit_status,
        "panels": panels,
        "rows": [_clean(r) for r in rows],
        "config": asdict(cfg),
    }
    if values is not None and values.get("results") is not None:
        audit["vat"] = _clean(vat_summary(values["results"]))
    return audit


def _clean(obj):
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def rescore(out: str | Path, policy: str | None = None) -> dict:
    """Recompute the rows and verdict of a finished audit from its folder, under ``policy`` (default:
    the one it was run with): no model is loaded."""
    out = Path(out)
    path = out / "config.json"
    if not path.is_file() or not (out / "audit.json").is_file():
        raise AligntaxError(f"{out} is not a finished audit (no config.json / audit.json).")
    cfg = AuditConfig(**json.loads(path.read_text()))
    cfg.policy = policy if policy is not None else cfg.policy
    plan = plan_audit(cfg)
    with run_lock(out):
        return _rescore(plan, out)


def _rescore(plan: Plan, out: Path) -> dict:
    values = None
    if any(r.kind == "values" for r in plan.rows()):
        values = _values_from_folder(plan, out)
    audit = assemble(plan, out, values)
    audit["timing_seconds"] = json.loads((out / "audit.json").read_text()).get("timing_seconds")
    from aligntax.audit.report import write_reports

    write_json_atomic(out / "audit.json", audit)
    write_reports(audit, out)
    return audit


def _values_from_folder(plan: Plan, out: Path) -> dict:
    from aligntax.vat.runner import read_rows

    vcfg = _vat_config(plan)
    want = {it.id for it in plan.values_items}
    rows = [r for r in read_rows(out / "values" / "items.jsonl") if r["id"] in want]
    res = None
    if plan.cfg.target:
        res = json.loads((out / "values" / "results.json").read_text())
    return {
        "target": plan.cfg.target,
        "results": res,
        "rows": rows,
        "scale": vcfg.judge.scale,
        "seed": vcfg.seed,
    }
