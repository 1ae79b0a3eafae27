"""``aligntax eval``: generate, judge and score, appending every sample as it is produced.

Rerunning the same command after a crash or Ctrl-C resumes: finished (source, id) pairs are read back
from ``samples.jsonl`` and skipped, so nothing is redone and nothing is duplicated. A resumed run must
have the same settings (``config.json``), and the same model fingerprint, intervention folder content
and judge weights as recorded in ``provenance.json`` (see :mod:`aligntax.runs.provenance`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aligntax.activations.decisions import remembered_prefill_states, rows_to_copy
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError
from aligntax.generation import GenerationConfig
from aligntax.generation.source import GenerationSource, SourceSpec
from aligntax.metrics import summarize_refusals
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runfolder import (
    SettingsChanged,
    check_settings,
    read_where,
    run_lock,
    settings_diffs,
    write_header,
    write_json_atomic,
    write_jsonl_atomic,
)
from aligntax.runs.jsonl import append_jsonl, read_jsonl
from aligntax.runs.provenance import (
    check_intervention,
    check_judge,
    check_model,
    folder_digest,
    intervention_folder,
    judge_identity,
    read_provenance,
    write_provenance,
)
from aligntax.runs.sources import check_source, generation_source

# Fields that change what a sample is; a resumed run must agree on all of them.
_RESULT_FIELDS = (
    "model",
    "judge",
    "system",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_p",
    "seed",
    "dtype",
    "intervention",
    "intervention_args",
    "backend",
)
# Settings added after run folders were first written: the value an older config.json (without them) had.
_OLDER_DEFAULTS = {"backend": "hf"}


@dataclass
class EvalConfig:
    data: list[str] = field(default_factory=list)
    out: str = "runs/eval"
    model: str = DEFAULT_MODEL
    judge: str = "classifier"
    system: str | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    limit: int | None = None
    # at most N prompts of each source of the named datasets (a group such as jbb-attacks: of each part),
    # drawn at random with a fixed seed (:func:`sampled`), e.g. {"jbb-attacks": 40}
    subsets: dict[str, int] = field(default_factory=dict)
    batch_size: int = 32
    dtype: str = "bf16"
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    intervention: str | None = None
    intervention_args: dict = field(default_factory=dict)
    # An unsteered run folder (same model, system prompt and greedy generation settings): rows the
    # intervention leaves unsteered, decided from the prompt (the ELS harm gate, CAST's condition), take
    # their answers from it instead of being generated again.
    reuse_unsteered: str | None = None
    # An earlier run folder over the same prompts (default: reuse_unsteered): results.json and the report
    # get the paired change against it per dataset (items turned compliant / refusing, exact McNemar p).
    compare_to: str | None = None
    # "auto" (or accelerate's {module: device}): split a model larger than one device over several
    device_map: str | None = None
    # "hf" (aligntax's own batched loop) or "vllm" (continuous batching, aligntax.backends.vllm)
    backend: str = "hf"
    progress: bool = True

    def source_spec(self) -> SourceSpec:
        """What the run generates with (:meth:`~aligntax.generation.source.GenerationSource.open`)."""
        return SourceSpec(
            self.model,
            self.dtype,
            self.intervention,
            dict(self.intervention_args or {}),
            self.batch_size,
            self.device_map,
        )

    def generation(self) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=self.do_sample,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            batch_size=self.batch_size,
            system=self.system,
        )


def sampled(items: list, limit: int | None, seed: int) -> list:
    """At most ``limit`` of ``items``, drawn at random (fixed seed), in their original order."""
    import torch

    if limit is None or len(items) <= limit:
        return items
    keep = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))[:limit]
    return [items[i] for i in sorted(keep.tolist())]


def eval_items(cfg: EvalConfig) -> list:
    """The prompts of an evaluation: each dataset of ``cfg.data`` (its first ``cfg.limit``), the sets named
    in ``cfg.subsets`` sampled to their size per source."""
    items = load_prompt_sets(cfg.data, cfg.limit)
    for spec, n in (cfg.subsets or {}).items():
        sources = {it.source for it in load_prompt_sets([spec], cfg.limit)}
        keep = {
            (it.source, it.id)
            for src in sources
            for it in sampled([it for it in items if it.source == src], int(n), 0)
        }
        items = [it for it in items if it.source not in sources or (it.source, it.id) in keep]
    return items


def load_prompt_sets(specs: list[str], limit: int | None = None) -> list:
    """The items of several datasets (files, names or Hub ids), in order; ``limit`` applies to each.
    Two inputs that would give rows the same source are refused
    (:func:`aligntax.data.load_prompt_sets`)."""
    from aligntax.data import load_prompt_sets as load_sets

    return load_sets(specs, limit=limit)


def _setting_diffs(old: dict, cfg: EvalConfig, fields) -> list[str]:
    """``"field: old -> new"`` for each of ``fields`` where a run's saved config differs from ``cfg``."""
    new, old = asdict(cfg), {**_OLDER_DEFAULTS, **old}
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in fields if old.get(k) != new.get(k)]


def _sample(
    it,
    response: str,
    refused: bool,
    refusal_score: float,
    judge: str,
    n_tokens: int,
    finish_reason: str,
    **extra,
) -> dict:
    """One line of ``samples.jsonl``."""
    return {
        **it.to_dict(),
        "response": response,
        "refused": refused,
        "refusal_score": round(float(refusal_score), 6),
        "judge": judge,
        "n_tokens": n_tokens,
        "finish_reason": finish_reason,
        **extra,
    }


def has_samples(out: Path) -> bool:
    """A folder becomes a run when its first sample is written: before that (a run that failed while
    loading, say), its ``config.json`` and ``provenance.json`` bind nothing and a new run may start there."""
    path = Path(out) / "samples.jsonl"
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _check_resume(out: Path, cfg: EvalConfig) -> dict:
    """Refuse to resume a run made with other settings (the header ``config.json``), or with another
    intervention folder's content; returns the folder's provenance (``provenance.json``, with the
    intervention folder's digest now). A folder holding no samples yet is new, whatever it records."""
    bound = has_samples(out)
    check_settings(
        out, "config.json", asdict(cfg), _RESULT_FIELDS, bound, defaults=_OLDER_DEFAULTS, write=False
    )
    saved = read_provenance(out) if bound else {}
    folder = intervention_folder(cfg.intervention_args) if cfg.intervention else None
    digest = folder_digest(folder, saved.get("intervention")) if folder else None
    if digest is None:
        return saved
    check_intervention(out, saved.get("intervention"), digest)
    return {**saved, "intervention": digest}


def _check_loaded(out: Path, saved: dict, lm=None, judge=None) -> dict:
    """Refuse to resume with another model (its fingerprint: ``provenance.json`` or, for runs made before
    it, ``results.json``) or another judge (its weights' hash and settings); absent = not checked.
    Returns the provenance with what is loaded now."""
    new = dict(saved)
    fp = getattr(lm, "fingerprint", None) if lm is not None else None
    if fp:
        check_model(out, saved.get("model_fingerprint") or _previous(out).get("model_fingerprint"), fp)
        new["model_fingerprint"] = dict(fp)
    if judge is not None:
        ident = judge_identity(judge)
        check_judge(out, saved.get("judge"), ident)
        new["judge"] = ident
    return new


def _save_provenance(out: Path, old: dict, new: dict) -> dict:
    if new != old:
        write_provenance(out, new)
    return new


def activation_id(item) -> str:
    """The prompt id under which a prompt's states are kept in an activation cache: ``"{source}/{id}"``."""
    return f"{item.source}/{item.id}"


def run_eval(
    cfg: EvalConfig,
    lm=None,
    judge=None,
    intervention=None,
    items=None,
    recorder=None,
    ray=None,
    source: GenerationSource | None = None,
) -> dict:
    """Run (or resume) an evaluation; returns the results dict also written to ``results.json``.

    ``items`` (PromptItems) replaces loading ``cfg.data`` when given. ``recorder`` (a
    :class:`~aligntax.activations.recorder.PrefillRecorder`, unsteered runs only) keeps the prompt states
    of every row generated now under ``"{source}/{id}"``. ``source`` (a
    :class:`~aligntax.generation.source.GenerationSource` of the backend ``cfg.backend`` names) generates
    the answers; without one it is picked from ``cfg.backend`` and ``ray`` (a
    :class:`~aligntax.runs.distributed.RayConfig`, or started
    :class:`~aligntax.runs.distributed.Replicas`: replicas of the model over Ray generate, and record
    the prompt states for ``recorder``; this process judges and writes) and closed at the end. ``lm``
    and ``intervention``: loaded by the caller, where the source takes them (the vLLM backend: ``lm`` a
    started :class:`~aligntax.backends.vllm.engine.VllmModel`, no loaded intervention).
    """

    if not cfg.data and items is None:
        raise AligntaxError("No data given: pass at least one --data FILE_OR_NAME")
    if recorder is not None and (intervention is not None or cfg.intervention):
        raise AligntaxError("Prompt states can be recorded only in an unsteered run.")
    own = source is None
    source = source or generation_source(cfg.backend, ray)
    try:
        check_source(source, cfg.backend)
        source.check(
            recorder=recorder is not None,
            loaded_intervention=intervention is not None,
            loaded_model=lm is not None,
        )
        out = Path(cfg.out)
        with run_lock(out):  # one writer per run folder; a second is refused
            return _run_eval(cfg, out, lm, judge, intervention, items, recorder, source)
    finally:
        if own:
            source.close()


def _run_eval(
    cfg: EvalConfig,
    out: Path,
    lm,
    judge,
    intervention,
    items,
    recorder,
    source: GenerationSource | None = None,
) -> dict:
    from aligntax.judges import get_judge

    saved = read_provenance(out) if has_samples(out) else {}
    was = read_where(out) if has_samples(out) else None  # where the folder was when it wrote its samples
    prov = _check_loaded(out, _check_resume(out, cfg), lm, judge)  # the model / judge given, if any
    write_header(out, "config.json", asdict(cfg))
    prov = _save_provenance(out, saved, prov)
    samples_path = out / "samples.jsonl"

    if items is None:
        items = eval_items(cfg)
    done_rows = read_jsonl(samples_path, repair=True)
    _check_prompts(out, done_rows, items)
    done = {(r["source"], r["id"]) for r in done_rows}
    wanted = {(it.source, it.id) for it in items}
    uniq = list({(it.source, it.id): it for it in reversed(items)}.values())[::-1]  # first of each key
    todo = [it for it in uniq if (it.source, it.id) not in done]

    t0 = time.perf_counter()
    gen_seconds, n_tokens, n_reused = 0.0, 0, 0
    run_stats: dict = {}  # the hooks' statistics of every batch generated now (ELS: energy before/after per layer)
    if todo:
        with source.open(cfg.source_spec(), lm, intervention) as gen:
            lm, intervention = gen.lm, gen.intervention
            if intervention is None and cfg.intervention:  # "none" on an engine that steers nothing: recorded
                from aligntax.interventions.registry import make_intervention

                intervention = make_intervention(cfg.intervention, lm, **cfg.intervention_args)
            _record_intervention(out, intervention, was)
            judge = judge or get_judge(cfg.judge)
            prov = _save_provenance(out, prov, _check_loaded(out, prov, lm, judge))
            steering: dict = {}  # per (source, id): what the intervention decided for the row before generating
            decider = gen.decider()  # None: nothing decided per row
            # decisions and batches are made over every item, whatever is already done, so that a
            # resumed run decides and batches each row as an uninterrupted one did (the same answers
            # and states to the last bit); a row already stored is generated again only when it shares
            # a batch with a missing one, and not stored twice
            pending = {(it.source, it.id) for it in todo}
            with remembered_prefill_states():  # one prefill pass serves the records and the reuse decision
                info = (
                    decider.row_info([it.prompt for it in uniq], cfg.system, cfg.batch_size)
                    if intervention is not None and decider is not None
                    else None
                )
                if info is not None:
                    steering = {(it.source, it.id): r for it, r in zip(uniq, info, strict=True)}
                to_generate = uniq
                if cfg.reuse_unsteered and intervention is not None and decider is not None:
                    to_generate, n_reused = _reuse_unsteered(
                        cfg, decider, uniq, pending, judge, samples_path, steering
                    )
                    pending &= {(it.source, it.id) for it in to_generate}  # the copied ones are stored
            plan = aligned_rows(
                gen,
                [it.prompt for it in to_generate],
                [(it.source, it.id) in pending for it in to_generate],
                cfg.generation(),
            )
            batch_rows = [to_generate[i] for i in plan]
            todo = [it for it in batch_rows if (it.source, it.id) in pending]
            batches = gen.iter_generate(
                [it.prompt for it in batch_rows],
                cfg.generation(),
                progress=cfg.progress,
                desc="eval",
                recorder=recorder,
            )
            tb = time.perf_counter()
            for idx, gens in batches:
                gen_seconds += time.perf_counter() - tb
                n_tokens += sum(g.n_tokens for g in gens)
                batch_items = [batch_rows[i] for i in idx]
                if recorder is not None:
                    recorder.keep([activation_id(it) for it in batch_items], [it.label for it in batch_items])
                    recorder.flush()  # the batch's states stored before its samples
                verdicts = judge.judge([it.prompt for it in batch_items], [g.response for g in gens])
                append_jsonl(
                    samples_path,
                    [
                        _sample(
                            it,
                            g.response,
                            v.refused,
                            v.refusal_score,
                            judge.name,
                            g.n_tokens,
                            g.finish_reason,
                            **_steering_field(steering, it, gen.decided.get(i)),
                        )
                        for i, it, g, v in zip(idx, batch_items, gens, verdicts, strict=True)
                        if (it.source, it.id) in pending
                    ],
                )
                tb = time.perf_counter()
            run_stats = gen.stats()
    rows = _in_item_order(samples_path, items)
    rows = [r for r in rows if (r["source"], r["id"]) in wanted]
    prev = _previous(out)
    results = {
        "config": asdict(cfg),
        "model_fingerprint": getattr(lm, "fingerprint", None) or prev.get("model_fingerprint"),
        **summarize_refusals(rows),
        **steering_summary(rows),
        **_steering_stats(prev if done else {}, run_stats),
        "intervention": _read_intervention(out),
        **_paired_against(cfg, rows),
        "timing": _timing(
            prev.get("timing", {}) if done else {},
            time.perf_counter() - t0,
            gen_seconds,
            n_tokens,
            len(todo),
            len(done & wanted),
            n_reused,
        ),
    }
    write_json_atomic(out / "results.json", results)
    from aligntax.reports import write_eval_report

    write_eval_report(results, out / "report.md")
    return results


def _check_prompts(out: Path, rows: list[dict], items) -> None:
    """The data part of the resume key: a stored sample whose (source, id) names an item with another
    prompt now was made from other data; refused, naming the first such row."""
    prompts = {(it.source, it.id): it.prompt for it in items}
    changed = [
        f"{r['source']}/{r['id']}"
        for r in rows
        if (r.get("source"), r.get("id")) in prompts and r.get("prompt") != prompts[(r["source"], r["id"])]
    ]
    if changed:
        raise SettingsChanged(
            f"{out} holds samples of other prompts under the same ids ({len(changed)} rows, e.g. "
            f"{changed[0]}): the data changed. Use another --out, or delete the folder to start again."
        )


def _in_item_order(path: Path, items) -> list[dict]:
    """The samples, rewritten (atomically) in the items' order when they are not in it yet (a resumed
    run appends in its own batch order): a resumed folder ends with the same bytes as an uninterrupted
    one. Rows of no current item keep their place after the others."""
    rows = read_jsonl(path)
    order = {(it.source, it.id): i for i, it in enumerate(items)}
    ranked = sorted(
        range(len(rows)), key=lambda i: (order.get((rows[i]["source"], rows[i]["id"]), len(order)), i)
    )
    if ranked != list(range(len(rows))):
        rows = [rows[i] for i in ranked]
        write_jsonl_atomic(path, rows)
    return rows


def _steering_stats(prev: dict, new: dict) -> dict:
    """``{"steering_stats": ...}``: the steering hooks' statistics over every invocation that generated
    rows in this run folder (per steered ELS layer: positions, positions moved, mean energy before and
    after the descent; decisions' row counts); ``{}`` when nothing was steered."""
    from aligntax.interventions.kernels import merge_stats

    merged = merge_stats(
        json.loads(json.dumps(prev.get("steering_stats") or {})), json.loads(json.dumps(new))
    )
    return {"steering_stats": merged} if merged else {}


def _record_intervention(out: Path, intervention, was: dict | None = None) -> None:
    """Write the intervention's resolved settings (e.g. ELS settings taken from a tuned ``best.json``) to
    ``intervention.json``; a resumed run whose intervention resolves differently is refused, so that
    samples made with two settings never mix. ``was``: where the folder was when the samples were written
    (:func:`~aligntax.runfolder.read_where`: paths that moved with it are the same setting)."""
    resolved = json.loads(
        json.dumps(intervention.config() if intervention is not None else None, default=str)
    )
    path = out / "intervention.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if settings_diffs({"s": _settings(old)}, {"s": _settings(resolved)}, ["s"], out, was=was or {}):
            raise AligntaxError(
                f"{out} was run with intervention settings {json.dumps(_settings(old))}, but they now resolve to "
                f"{json.dumps(_settings(resolved))} (did the folder's sweep/best.json change?). Use another --out, "
                "or give the settings explicitly."
            )
        return
    write_json_atomic(path, resolved)


def _settings(cfg):
    return {k: v for k, v in cfg.items() if k != "settings_from"} if isinstance(cfg, dict) else cfg


def _read_intervention(out: Path) -> dict | None:
    path = out / "intervention.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _steering_field(steering: dict, item, engine: dict | None = None) -> dict:
    """``{"steering": {...}}`` for a sample whose row the intervention decided on (else ``{}``); with the
    vLLM backend, the strength its engine applied to the row as ``engine_strength``."""
    info = steering.get((item.source, item.id))
    if info is not None and engine is not None:
        info = {**info, "engine_strength": round(float(engine["strength"]), 4)}
    return {"steering": info} if info is not None else {}


def steering_summary(rows: list[dict]) -> dict:
    """``{"steering": ...}``: per dataset and label, how many rows the intervention steered (``steering``
    records in the samples), their mean strength, and the harm probability and row energy quartiles;
    ``{}`` when no sample has a record."""
    import statistics

    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "steering" in r:
            groups.setdefault(f"{r['source']}/{r['label']}", []).append(r["steering"])
    if not groups:
        return {}

    def quartiles(values: list[float]) -> list[float] | None:
        if len(values) < 2:
            return [round(v, 4) for v in values] or None
        q = statistics.quantiles(values, n=4, method="inclusive")
        return [round(min(values), 4), *(round(x, 4) for x in q), round(max(values), 4)]

    out = {}
    for key, infos in sorted(groups.items()):
        steered = [i for i in infos if i.get("steered")]
        out[key] = {
            "rows": len(infos),
            "steered": len(steered),
            "mean_strength": round(sum(i.get("strength", 1.0) for i in steered) / len(steered), 4)
            if steered
            else None,
            "harm_p": quartiles([i["harm_p"] for i in infos if "harm_p" in i]),
            "energy": quartiles([i["energy"] for i in infos if "energy" in i]),
        }
    return {"steering": out}


def aligned_rows(gen, prompts: list, pending: list[bool], generation) -> list[int]:
    """Indices of ``prompts`` to generate now: every row of each batch that generation forms over all of
    them (:func:`~aligntax.generation.batching.length_order_batches`) holding a ``pending`` row, in the
    plan's order. Generated in that order, they are batched as the whole list was, so a resumed run
    generates the batches an uninterrupted run did. A generator that cannot tell prompt lengths gets the
    pending rows alone."""
    from aligntax.generation.batching import length_order_batches

    lengths = getattr(gen, "prompt_lengths", None)
    if lengths is None or all(pending):
        return [i for i, p in enumerate(pending) if p]
    plan = length_order_batches(
        lengths(prompts, generation.system), generation.batch_size, generation.max_batch_tokens
    )
    return [i for batch in plan if any(pending[j] for j in batch) for i in batch]


def _reuse_unsteered(
    cfg: EvalConfig,
    decider,
    items: list,
    pending: set,
    judge,
    samples_path: Path,
    steering: dict | None = None,
) -> tuple[list, int]:
    """Decide, over every item, which rows the intervention leaves unsteered and the unsteered run
    ``cfg.reuse_unsteered`` answered (decided over all, so a resumed run decides as an uninterrupted
    one); copy the answers of those still ``pending`` (appended to the samples with ``"reused":
    True``). Returns the items that are generated instead (copied ones left out) and how many were
    copied now."""
    src = Path(cfg.reuse_unsteered)
    cfg_path, samples = src / "config.json", src / "samples.jsonl"
    if not cfg_path.is_file() or not samples.is_file():
        raise AligntaxError(
            f"--reuse-unsteered {src}: not an evaluation run folder (no config.json / samples.jsonl)."
        )
    old = json.loads(cfg_path.read_text())
    used = old.get("intervention") or ((_read_intervention(src) or {}).get("name") or "none")
    if used != "none":
        raise AligntaxError(
            f"--reuse-unsteered {src}: that run used the intervention '{used}'; it must be an unsteered run."
        )
    if old.get("do_sample") or cfg.do_sample:
        raise AligntaxError(
            "--reuse-unsteered needs greedy decoding in both runs (sampled answers are not reproducible)."
        )
    diffs = _setting_diffs(old, cfg, ("model", "system", "max_new_tokens", "dtype", "backend"))
    if diffs:
        raise AligntaxError(f"--reuse-unsteered {src} was made with other settings ({'; '.join(diffs)}).")
    prior = {(r["source"], r["id"]): r for r in read_jsonl(samples, repair=True)}
    known = [(it.source, it.id) in prior and prior[(it.source, it.id)]["prompt"] == it.prompt for it in items]
    copy = rows_to_copy(decider, [it.prompt for it in items], known, cfg.system, cfg.batch_size)
    reuse = [it for it, c in zip(items, copy, strict=True) if c and (it.source, it.id) in pending]
    rest = [it for it, c in zip(items, copy, strict=True) if not c]
    if not reuse:
        return rest, 0
    rows = [prior[(it.source, it.id)] for it in reuse]
    if all(r.get("judge") == judge.name for r in rows):
        verdicts = [(r["refused"], r["refusal_score"]) for r in rows]
    else:
        verdicts = [
            (v.refused, v.refusal_score)
            for v in judge.judge([r["prompt"] for r in rows], [r["response"] for r in rows])
        ]
    append_jsonl(
        samples_path,
        [
            _sample(
                it,
                r["response"],
                refused,
                score,
                judge.name,
                r["n_tokens"],
                r["finish_reason"],
                reused=True,
                **_steering_field(steering or {}, it),
            )
            for it, r, (refused, score) in zip(reuse, rows, verdicts, strict=True)
        ],
    )
    return rest, len(reuse)


def _timing(
    prev: dict, wall: float, gen_seconds: float, n_tokens: int, new: int, resumed: int, reused: int = 0
) -> dict:
    """Throughput over every invocation that produced samples in this run folder."""
    gen_total = prev.get("generation_seconds_total", 0.0) + gen_seconds
    tok_total = prev.get("generated_tokens_total", 0) + n_tokens
    return {
        "wall_seconds": round(wall, 2),
        "generation_seconds": round(gen_seconds, 2),
        "generated_tokens": n_tokens,
        "new_samples": new,
        "reused_unsteered_samples": reused,
        "resumed_samples": resumed,
        "generation_seconds_total": round(gen_total, 2),
        "generated_tokens_total": tok_total,
        "tokens_per_second": round(tok_total / gen_total, 2) if gen_total else None,
    }


def _paired_against(cfg: EvalConfig, rows: list[dict]) -> dict:
    """``{"paired": ...}``: the paired change of this run's rows against the run ``cfg.compare_to`` (or
    ``cfg.reuse_unsteered``), over the items both hold (:func:`aligntax.metrics.paired_changes`); ``{}``
    without one. Verdicts are compared as each run stored them (``judges`` names both runs' judges)."""
    from aligntax.metrics import paired_changes

    ref = cfg.compare_to or cfg.reuse_unsteered
    if not ref:
        return {}
    path = Path(ref) / "samples.jsonl"
    if not path.is_file():
        raise AligntaxError(
            f"Cannot compare with {ref}: it holds no samples.jsonl (not an evaluation run folder)."
        )
    mine = {(r["source"], r["id"]) for r in rows}
    before = [r for r in read_jsonl(path) if (r["source"], r["id"]) in mine]
    if not before:
        raise AligntaxError(f"Cannot compare with {ref}: it holds none of this run's prompts.")
    changes = paired_changes(before, rows)
    judges = {
        "reference": sorted({r.get("judge", "?") for r in before}),
        "this run": sorted({r.get("judge", "?") for r in rows}),
    }
    return {
        "paired": {
            "against": str(ref),
            "judges": judges,
            "n_pairs": len(before),
            "unmatched": changes["unmatched"],
            "datasets": changes["datasets"],
        }
    }


def _previous(out: Path) -> dict:
    path = out / "results.json"
    return json.loads(path.read_text()) if path.exists() else {}


def rejudge(out: str | Path, judge_name: str | None = None, judge=None) -> dict:
    """Judge the responses of an existing run folder again (a new judge, or a retrained one) and rewrite
    ``samples.jsonl``, ``results.json`` and ``report.md``; no generation. The rewrite is atomic."""

    out = Path(out)
    prev = _previous(out)
    if not prev or not (out / "samples.jsonl").exists():
        raise AligntaxError(f"{out} is not a finished evaluation run (no results.json / samples.jsonl)")
    with run_lock(out):
        return _rejudge(out, prev, judge_name, judge)


def _rejudge(out: Path, prev: dict, judge_name: str | None, judge) -> dict:
    from aligntax.judges import get_judge

    cfg = EvalConfig(**prev["config"])
    cfg.judge = judge_name or cfg.judge
    judge = judge or get_judge(cfg.judge)
    rows = read_jsonl(out / "samples.jsonl", repair=True)
    verdicts = judge.judge([r["prompt"] for r in rows], [r["response"] for r in rows])
    for r, v in zip(rows, verdicts, strict=True):
        r.update(refused=v.refused, refusal_score=round(float(v.refusal_score), 6), judge=judge.name)
    write_jsonl_atomic(out / "samples.jsonl", rows)
    write_header(out, "config.json", asdict(cfg))
    saved = read_provenance(out)
    if saved:  # the samples are judged by this judge now
        _save_provenance(out, saved, {**saved, "judge": judge_identity(judge)})
    results = {
        **prev,
        "config": asdict(cfg),
        **summarize_refusals(rows),
        **steering_summary(rows),
        **_paired_against(cfg, rows),
    }
    write_json_atomic(out / "results.json", results)
    from aligntax.reports import write_eval_report

    write_eval_report(results, out / "report.md")
    return results
