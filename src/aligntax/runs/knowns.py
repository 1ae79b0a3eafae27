"""The ``aligntax knowns`` run folder: generate the answers to the known-answer set and score them.

:func:`run_knowns` generates greedy answers (the project's batched generation, with or without an
intervention), appends them to ``OUT/samples.jsonl`` as they are produced (a rerun resumes), and writes
``OUT/results.json`` (accuracy with Wilson 95% intervals, overall and per kind; with ``compare_to`` the
paired change against another run) and ``OUT/report.md``. The items, the answer matching and the
accuracy are :mod:`aligntax.metrics.knowns`'s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError
from aligntax.metrics.knowns import (
    BUILTIN,
    BUILTIN_PATH,
    KnownItem,
    accuracy_by_kind,
    knowns_report,
    load_known_answers,
)
from aligntax.metrics.rates import paired_change
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runfolder import (
    check_settings,
    read_where,
    run_lock,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)


@dataclass
class KnownsConfig:
    """Settings of ``aligntax knowns``."""

    out: str
    model: str = DEFAULT_MODEL
    data: str = BUILTIN
    split: str = "test"
    limit: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = 32
    dtype: str = "bf16"
    system: str | None = None
    intervention: str | None = None
    intervention_args: dict = field(default_factory=dict)
    # Another knowns run folder: results get the paired change against it over the ids both hold.
    compare_to: str | None = None
    # An unsteered knowns run folder with the same settings: questions the intervention leaves unsteered
    # (ELS harm gate and row decision, CAST condition) take their answers from it instead of being
    # generated again (``"reused": true`` in the samples)
    reuse_unsteered: str | None = None
    progress: bool = True
    # "hf" (aligntax's own batched loop) or "vllm" (aligntax.backends.vllm; lm may be a started VllmModel)
    backend: str = "hf"

    def generation(self):
        from aligntax.generation import GenerationConfig

        return GenerationConfig(
            max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, system=self.system
        )


def _reuse_unsteered(cfg: KnownsConfig, decider, todo: list, samples_path: Path, steering: dict) -> list:
    """Copy the unsteered knowns run's answers of the questions the intervention leaves unsteered into
    the samples; returns the questions still to generate."""
    from aligntax.activations.decisions import rows_to_copy
    from aligntax.runs.jsonl import append_jsonl, read_jsonl

    src = Path(cfg.reuse_unsteered)
    if not (src / "config.json").is_file() or not (src / "samples.jsonl").is_file():
        raise AligntaxError(
            f"reuse_unsteered {src}: not a knowns run folder (no config.json / samples.jsonl)."
        )
    from aligntax.runs.eval import _read_intervention, _setting_diffs

    old = json.loads((src / "config.json").read_text())
    used = old.get("intervention") or ((_read_intervention(src) or {}).get("name") or "none")
    if used != "none":
        raise AligntaxError(
            f"reuse_unsteered {src}: that run used the intervention {used!r}; it must be unsteered."
        )

    diffs = _setting_diffs(old, cfg, ("model", "data", "system", "max_new_tokens", "dtype", "backend"))
    if diffs:
        raise AligntaxError(f"reuse_unsteered {src} was made with other settings ({'; '.join(diffs)}).")
    prior = {r["id"]: r for r in read_jsonl(src / "samples.jsonl", repair=True)}
    known = [it.id in prior and prior[it.id].get("prompt") == it.prompt for it in todo]
    copy = rows_to_copy(decider, [it.prompt for it in todo], known, cfg.system, cfg.batch_size)
    reuse = [it for it, c in zip(todo, copy, strict=True) if c]
    append_jsonl(
        samples_path,
        [
            {
                **it.to_dict(),
                "response": prior[it.id]["response"],
                "correct": it.check(prior[it.id]["response"]),
                "n_tokens": prior[it.id].get("n_tokens"),
                "finish_reason": prior[it.id].get("finish_reason"),
                "reused": True,
                **({"steering": steering[it.id]} if it.id in steering else {}),
            }
            for it in reuse
        ],
    )
    return [it for it, c in zip(todo, copy, strict=True) if not c]


# Fields that change what a sample is; a resumed run must agree on all of them.
_RESULT_FIELDS = (
    "model",
    "data",
    "system",
    "max_new_tokens",
    "dtype",
    "intervention",
    "intervention_args",
    "backend",
)


def _check_resume(out: Path, cfg: KnownsConfig) -> dict | None:
    """The settings header rule (``config.json``): a folder with samples refuses other settings; no
    sample yet is a new run, whatever it records. Writes the header; returns where the folder was when
    its samples were written."""
    from aligntax.runs.eval import _OLDER_DEFAULTS, has_samples

    bound = has_samples(out)
    was = read_where(out) if bound else None
    check_settings(
        out, "config.json", asdict(cfg), _RESULT_FIELDS, bound, "knowns run", defaults=_OLDER_DEFAULTS
    )
    return was


def run_knowns(
    cfg: KnownsConfig, lm=None, intervention=None, source=None, items: Sequence[KnownItem] | None = None
) -> dict:
    """Run (or resume) the check; returns the results dict also written to ``OUT/results.json``.

    Answers already in ``OUT/samples.jsonl`` (same id and prompt) are not generated again. Every stored
    response is scored again against the items' current accepted answers, so a corrected answer list
    applies to a finished run on the next invocation (``samples.jsonl`` is rewritten when a verdict changes).
    ``source``: the :class:`~aligntax.generation.source.GenerationSource` of ``cfg.backend`` (picked
    from it, and closed at the end, when not given); ``lm`` / ``intervention``: loaded by the caller.
    ``items``: the questions to answer (a subset of ``cfg.data``), instead of loading them.
    """
    from aligntax.runs.sources import check_source, generation_source

    own = source is None
    source = source or generation_source(cfg.backend)
    try:
        check_source(source, cfg.backend)
        with run_lock(cfg.out):  # one writer per run folder
            return _run_knowns(cfg, lm, intervention, source, items)
    finally:
        if own:
            source.close()


def _run_knowns(cfg: KnownsConfig, lm, intervention, source, items=None) -> dict:
    from aligntax.generation.source import SourceSpec
    from aligntax.runs.eval import _previous, _read_intervention, _record_intervention
    from aligntax.runs.jsonl import append_jsonl, read_jsonl

    items = list(items) if items is not None else load_known_answers(cfg.data, cfg.split, cfg.limit)
    out = Path(cfg.out)
    was = _check_resume(out, cfg)
    samples_path = out / "samples.jsonl"
    by_id = {it.id: it for it in items}
    done = {
        r["id"]
        for r in read_jsonl(samples_path, repair=True)
        if r.get("id") in by_id and r.get("prompt") == by_id[r["id"]].prompt
    }
    todo = [it for it in items if it.id not in done]

    t0 = time.perf_counter()
    gen_seconds, n_tokens, n_reused = 0.0, 0, 0
    if todo:
        source.check(loaded_intervention=intervention is not None)
        name = cfg.intervention if cfg.intervention != "none" else None
        spec = SourceSpec(cfg.model, cfg.dtype, name, dict(cfg.intervention_args or {}), cfg.batch_size)
        with source.open(spec, lm, intervention) as gen:
            lm, intervention = gen.lm, gen.intervention
            _record_intervention(out, intervention, was)
            decider = gen.decider()
            info = (
                decider.row_info([it.prompt for it in todo], cfg.system, cfg.batch_size)
                if intervention is not None and decider is not None
                else None
            )
            steering = {it.id: r for it, r in zip(todo, info, strict=True)} if info is not None else {}
            if cfg.reuse_unsteered and intervention is not None and decider is not None:
                before = len(todo)
                todo = _reuse_unsteered(cfg, decider, todo, samples_path, steering)
                n_reused = before - len(todo)
            tb = time.perf_counter()
            for idx, gens in gen.iter_generate(
                [it.prompt for it in todo], cfg.generation(), progress=cfg.progress, desc="knowns"
            ):
                gen_seconds += time.perf_counter() - tb
                n_tokens += sum(g.n_tokens for g in gens)
                append_jsonl(
                    samples_path,
                    [
                        {
                            **todo[i].to_dict(),
                            "response": g.response,
                            "correct": todo[i].check(g.response),
                            "n_tokens": g.n_tokens,
                            "finish_reason": g.finish_reason,
                            **({"steering": steering[todo[i].id]} if todo[i].id in steering else {}),
                        }
                        for i, g in zip(idx, gens, strict=True)
                    ],
                )
                tb = time.perf_counter()
    rows = _rescore(samples_path, by_id)
    flags = [rows[it.id]["correct"] for it in items]
    cut = [not rows[it.id]["correct"] and rows[it.id].get("finish_reason") == "length" for it in items]
    prev = _previous(out)
    results = {
        "config": asdict(cfg),
        "data": str(BUILTIN_PATH) if cfg.data == BUILTIN else cfg.data,
        "model_fingerprint": getattr(lm, "fingerprint", None) or prev.get("model_fingerprint"),
        "intervention": _read_intervention(out),
        **accuracy_by_kind(items, flags),
        **_steered_rows([rows[it.id] for it in items]),
        # wrong answers that ran into max_new_tokens (a long preamble, not necessarily a wrong answer)
        "cut_off": {
            "all": sum(cut),
            **{
                k: sum(c for it, c in zip(items, cut, strict=True) if it.kind == k)
                for k in dict.fromkeys(it.kind for it in items)
            },
        },
        **_paired_against(cfg.compare_to, items, flags),
        "timing": {
            "wall_seconds": round(time.perf_counter() - t0, 2),
            "generation_seconds": round(gen_seconds, 2),
            "generated_tokens": n_tokens,
            "new_samples": len(todo),
            "reused_unsteered_samples": n_reused,
            "resumed_samples": len(done),
        },
    }
    write_json_atomic(out / "results.json", results)
    write_text_atomic(out / "report.md", knowns_report(results, [rows[it.id] for it in items]))
    return results


def _steered_rows(rows: Sequence[dict]) -> dict:
    """``{"steered_rows": n}``: how many answers the intervention steered (by the samples' ``steering``
    records); ``{}`` when none has one."""
    infos = [r["steering"] for r in rows if "steering" in r]
    return {"steered_rows": sum(bool(i.get("steered")) for i in infos)} if infos else {}


def _rescore(samples_path: Path, by_id: dict[str, KnownItem]) -> dict[str, dict]:
    """The stored row of each item (the last one with its current prompt), scored against its current
    answers. ``samples.jsonl`` is rewritten atomically, keeping one row per item in the items' order,
    when a stored verdict or answer list is out of date, an item has superseded rows (an earlier prompt,
    a repeat) or the rows are out of order (a resumed run appends in its own batch order)."""
    from aligntax.runs.jsonl import read_jsonl

    all_rows = read_jsonl(samples_path)
    rows: dict[str, dict] = {}
    for r in all_rows:
        it = by_id.get(r.get("id"))
        if it is not None and r.get("prompt") == it.prompt:
            rows[it.id] = r
    kept = [r for r in all_rows if r.get("id") not in by_id or rows.get(r["id"]) is r]
    stale = len(kept) != len(all_rows)
    order = {item_id: i for i, item_id in enumerate(by_id)}
    ranked = sorted(kept, key=lambda r: order.get(r.get("id"), len(order)))
    stale |= ranked != kept
    kept = ranked
    for item_id, r in rows.items():
        it = by_id[item_id]
        fresh = {**r, **it.to_dict(), "correct": it.check(r["response"])}
        stale |= fresh != r
        r.clear()
        r.update(fresh)
    if stale:
        write_jsonl_atomic(samples_path, kept)
    return rows


def _paired_against(ref: str | None, items: Sequence[KnownItem], flags: Sequence[bool]) -> dict:
    """``{"paired": ...}``: this run's correctness against the run folder ``ref`` over the ids both hold,
    both sides scored with the current answers (:func:`aligntax.metrics.rates.paired_change`, overall and
    per kind); ``{}`` without ``ref``."""
    from aligntax.runs.jsonl import read_jsonl

    if not ref:
        return {}
    path = Path(ref) / "samples.jsonl"
    if not path.is_file():
        raise AligntaxError(
            f"Cannot compare with {ref}: it holds no samples.jsonl (not a knowns run folder)."
        )
    theirs = {r["id"]: r for r in read_jsonl(path) if "response" in r and "id" in r}
    pairs: list[tuple[KnownItem, bool, bool]] = []
    for it, mine in zip(items, flags, strict=True):
        r = theirs.get(it.id)
        if r is None:
            continue
        if r.get("prompt") != it.prompt:
            raise AligntaxError(
                f"Cannot compare with {ref}: its item {it.id!r} has another prompt "
                f"({r.get('prompt')!r}); was it made from other data?"
            )
        pairs.append((it, it.check(r["response"]), mine))
    if not pairs:
        raise AligntaxError(f"Cannot compare with {ref}: it holds none of this run's items.")

    def change(sel: list[tuple[KnownItem, bool, bool]]) -> dict:
        return paired_change([b for _, b, _ in sel], [a for _, _, a in sel])

    kinds = list(dict.fromkeys(it.kind for it, _, _ in pairs))
    return {
        "paired": {
            "against": str(ref),
            "n_pairs": len(pairs),
            "unmatched": len(items) - len(pairs),
            **change(pairs),
            "by_kind": {k: change([p for p in pairs if p[0].kind == k]) for k in kinds},
        }
    }
