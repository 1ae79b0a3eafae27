"""Known-answer capability check: does the model (steered or not) still answer everyday questions right?

The built-in set (``builtin``, ``aligntax/resources/knowns/everyday.jsonl``) has 360 everyday prompts
written for aligntax, 120 of each kind: ``arithmetic`` (the four operations with whole results, small
word problems), ``fact`` (capitals, chemical symbols, planets, days and months, units, authors, basic
science, geography) and ``instruction`` (spell a word backwards, plurals, opposites, one word in French
or Spanish, the next number of a sequence, letter counts, capital letters, the alphabetically first of
three words). Each kind is split half ``val`` (for choosing steering settings) and half ``test`` (for
reporting).

A response is scored by :func:`is_correct`: after normalising both texts (Unicode NFKC, markdown ``*``
and backticks removed, thousands separators dropped, whitespace collapsed, lowercased) it is correct when
one of the item's accepted answers occurs in it as a whole word or number: ``58`` is found in "100 minus
42 is 58." but not in "78", "158" or "5.8". Two optional item fields make the check strict where the
answer is in the prompt itself: ``case_sensitive`` (capital-letter items: "APPLE", not "apple") and
``options`` (the words a question offers: the first of them the response names must be an accepted
answer, so restating the question does not count).

:func:`run_knowns` generates greedy answers (the project's batched generation, with or without an
intervention), appends them to ``OUT/samples.jsonl`` as they are produced (a rerun resumes), and writes
``OUT/results.json`` (accuracy with Wilson 95% intervals, overall and per kind; with ``compare_to`` the
paired change against another run) and ``OUT/report.md``.
"""

from __future__ import annotations

import json
import os
import re
import time
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError, DataError
from aligntax.metrics.mc import _acc, format_accuracy
from aligntax.metrics.rates import paired_change
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runs.fsio import write_json_atomic

BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).resolve().parent.parent / "resources" / "knowns" / "everyday.jsonl"
KINDS = ("arithmetic", "fact", "instruction")
SPLITS = ("val", "test")


@dataclass(frozen=True)
class KnownItem:
    """One prompt and the short answers that count as correct.

    ``case_sensitive``: match the answers with their case (items that ask for capital letters).
    ``options``: the words the prompt offers; the first of them a response names must be an answer.
    """

    id: str
    prompt: str
    answers: tuple[str, ...]
    kind: str
    split: str
    case_sensitive: bool = False
    options: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {"id": self.id, "prompt": self.prompt, "kind": self.kind, "split": self.split,
               "answers": list(self.answers)}
        if self.case_sensitive:
            out["case_sensitive"] = True
        if self.options:
            out["options"] = list(self.options)
        return out

    def check(self, response: str) -> bool:
        return is_correct(response, self.answers, case_sensitive=self.case_sensitive, options=self.options)


# ------------------------------------------------------------------------------------------ loading
def load_known_answers(data: str | Path = BUILTIN, split: str | None = None,
                       limit: int | None = None) -> list[KnownItem]:
    """The built-in set (``"builtin"``) or a user JSONL/JSON file, optionally one split and the first
    ``limit`` items of it.

    Every record needs ``id``, ``prompt``, ``answers`` (a non-empty list of strings or numbers, or one
    string), ``kind`` (any name) and ``split`` (``val`` or ``test``); ``case_sensitive`` (bool) and
    ``options`` (list of strings) are optional. ``split`` None or ``"all"`` keeps both splits. Every
    problem is a :class:`DataError` naming the file and record.
    """
    from aligntax.data._io import describe_columns, read_table

    if split is not None and split not in (*SPLITS, "all"):
        raise AligntaxError(f"Unknown split {split!r}; expected one of {', '.join(SPLITS)} or all.")
    if limit is not None and limit < 1:
        raise AligntaxError("limit must be >= 1.")
    path = BUILTIN_PATH if str(data) == BUILTIN else Path(data)
    table = read_table(path)
    required = ("id", "prompt", "answers", "kind", "split")
    cols = {name: table.find_column([name]) for name in (*required, "case_sensitive", "options")}
    missing = [name for name in required if cols[name] is None]
    if missing:
        raise DataError(f"{table.name}: missing field(s) {', '.join(repr(m) for m in missing)} for a "
                        f"known-answer set; the file has: {describe_columns(table.columns)}")
    items: list[KnownItem] = []
    seen: dict[str, str] = {}
    for row in table.rows:
        where = f"{table.name}, {row.where}"
        v = row.values
        item_id, prompt, kind = (_text(v.get(cols[name]), name, where) for name in ("id", "prompt", "kind"))
        item_split = _text(v.get(cols["split"]), "split", where)
        if item_split not in SPLITS:
            raise DataError(f"{where}: 'split' must be one of {', '.join(SPLITS)}; got {item_split!r}")
        if item_id in seen:
            raise DataError(f"{where}: duplicate id {item_id!r} (also at {seen[item_id]})")
        seen[item_id] = row.where
        case = v.get(cols["case_sensitive"]) if cols["case_sensitive"] else None
        if case is not None and not isinstance(case, bool):
            raise DataError(f"{where}: 'case_sensitive' must be true or false; got {case!r}")
        options = v.get(cols["options"]) if cols["options"] else None
        item = KnownItem(item_id, prompt, _strings(v.get(cols["answers"]), "answers", where), kind, item_split,
                         bool(case), _strings(options, "options", where) if options is not None else ())
        if split in (None, "all", item.split):
            items.append(item)
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DataError(f"{table.name}: no items in the split {split!r}.")
    return items


def _text(raw, name: str, where: str) -> str:
    if isinstance(raw, bool) or not isinstance(raw, str | int) or not str(raw).strip():
        raise DataError(f"{where}: {name!r} must be a non-empty string; got {raw!r}")
    return str(raw).strip()


def _strings(raw, name: str, where: str) -> tuple[str, ...]:
    """A list of non-empty strings (numbers are written as text); one string is a list of one."""
    if isinstance(raw, str | int) and not isinstance(raw, bool):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: {name!r} must be a non-empty list of strings; got {raw!r}")
    out = []
    for x in raw:
        if isinstance(x, bool) or not isinstance(x, str | int) or not str(x).strip():
            raise DataError(f"{where}: {name!r} holds an empty or non-text entry: {x!r}")
        out.append(str(x).strip())
    return tuple(out)


# ------------------------------------------------------------------------------------------ scoring
_MARKDOWN = re.compile(r"[*`]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def normalize(text: str, case_sensitive: bool = False) -> str:
    """NFKC, markdown ``*``/backticks removed, ``1,000`` -> ``1000``, whitespace collapsed, lowercased
    (unless ``case_sensitive``)."""
    text = _THOUSANDS.sub("", _MARKDOWN.sub("", unicodedata.normalize("NFKC", text)))
    text = " ".join(text.split())
    return text if case_sensitive else text.lower()


def _pattern(answer: str) -> re.Pattern:
    """``answer`` as a whole word; a number also not as part of a decimal (``8`` is not in ``5.8``)."""
    left = r"(?<!\w)" + (r"(?<!\d[.,])" if answer[0].isdigit() else "")
    right = r"(?!\w)" + (r"(?![.,]\d)" if answer[-1].isdigit() else "")
    return re.compile(left + re.escape(answer) + right)


def _first_match(text: str, candidates: Iterable[str]) -> tuple[int, str] | None:
    """The candidate found earliest in ``text`` (the longest on a tie), with its position."""
    found = [(m.start(), -len(c), c) for c in candidates if c and (m := _pattern(c).search(text))]
    if not found:
        return None
    pos, _, cand = min(found)
    return pos, cand


def is_correct(response: str, answers: Iterable[str], *, case_sensitive: bool = False,
               options: Sequence[str] = ()) -> bool:
    """Whether ``response`` gives one of ``answers``: an answer occurs in it as a whole word or number,
    both normalised by :func:`normalize`. With ``options`` (the words the question offers), the option
    or answer the response names first must be an accepted answer."""
    text = normalize(response, case_sensitive)
    accepted = {normalize(a, case_sensitive) for a in answers} - {""}
    if not options:
        return any(_pattern(a).search(text) for a in accepted)
    first = _first_match(text, accepted | {normalize(o, case_sensitive) for o in options})
    return first is not None and first[1] in accepted


def score_responses(items: Sequence[KnownItem], responses: Sequence[str]) -> list[bool]:
    """:func:`is_correct` for each item and its response."""
    if len(items) != len(responses):
        raise ValueError(f"{len(items)} items but {len(responses)} responses")
    return [it.check(r) for it, r in zip(items, responses, strict=True)]


def accuracy_by_kind(items: Sequence[KnownItem], flags: Sequence[bool]) -> dict:
    """Accuracy with a Wilson 95% interval overall, and per kind under ``by_kind``."""
    kinds = sorted({it.kind for it in items}, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    return {**_acc(list(flags)),
            "by_kind": {k: _acc([f for it, f in zip(items, flags, strict=True) if it.kind == k]) for k in kinds}}


# ------------------------------------------------------------------------------------------ run folder
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

        return GenerationConfig(max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, system=self.system)


def _reuse_unsteered(cfg: KnownsConfig, decider, todo: list, samples_path: Path, steering: dict) -> list:
    """Copy the unsteered knowns run's answers of the questions the intervention leaves unsteered into
    the samples; returns the questions still to generate."""
    from aligntax.activations.decisions import rows_to_copy
    from aligntax.runs.jsonl import append_jsonl, read_jsonl

    src = Path(cfg.reuse_unsteered)
    if not (src / "config.json").is_file() or not (src / "samples.jsonl").is_file():
        raise AligntaxError(f"reuse_unsteered {src}: not a knowns run folder (no config.json / samples.jsonl).")
    from aligntax.runs.eval import _read_intervention, _setting_diffs

    old = json.loads((src / "config.json").read_text())
    used = old.get("intervention") or ((_read_intervention(src) or {}).get("name") or "none")
    if used != "none":
        raise AligntaxError(f"reuse_unsteered {src}: that run used the intervention {used!r}; it must be unsteered.")

    diffs = _setting_diffs(old, cfg, ("model", "data", "system", "max_new_tokens", "dtype", "backend"))
    if diffs:
        raise AligntaxError(f"reuse_unsteered {src} was made with other settings ({'; '.join(diffs)}).")
    prior = {r["id"]: r for r in read_jsonl(src / "samples.jsonl", repair=True)}
    known = [it.id in prior and prior[it.id].get("prompt") == it.prompt for it in todo]
    copy = rows_to_copy(decider, [it.prompt for it in todo], known, cfg.system, cfg.batch_size)
    reuse = [it for it, c in zip(todo, copy, strict=True) if c]
    append_jsonl(samples_path, [
        {**it.to_dict(), "response": prior[it.id]["response"], "correct": it.check(prior[it.id]["response"]),
         "n_tokens": prior[it.id].get("n_tokens"), "finish_reason": prior[it.id].get("finish_reason"),
         "reused": True, **({"steering": steering[it.id]} if it.id in steering else {})} for it in reuse])
    return [it for it, c in zip(todo, copy, strict=True) if not c]


# Fields that change what a sample is; a resumed run must agree on all of them.
_RESULT_FIELDS = ("model", "data", "system", "max_new_tokens", "dtype", "intervention", "intervention_args",
                  "backend")


def _check_resume(out: Path, cfg: KnownsConfig) -> None:
    from aligntax.runs.eval import _setting_diffs, has_samples

    path = out / "config.json"
    if not path.exists() or not has_samples(out):  # no sample yet: a new run, whatever it records
        return
    diffs = _setting_diffs(json.loads(path.read_text()), cfg, _RESULT_FIELDS)
    if diffs:
        raise AligntaxError(f"{out} holds a knowns run with different settings ({'; '.join(diffs)}). Use another "
                            "--out, or delete the folder to start again.")


def run_knowns(cfg: KnownsConfig, lm=None, intervention=None, source=None) -> dict:
    """Run (or resume) the check; returns the results dict also written to ``OUT/results.json``.

    Answers already in ``OUT/samples.jsonl`` (same id and prompt) are not generated again. Every stored
    response is scored again against the items' current accepted answers, so a corrected answer list
    applies to a finished run on the next invocation (``samples.jsonl`` is rewritten when a verdict changes).
    ``source``: the :class:`~aligntax.generation.source.GenerationSource` of ``cfg.backend`` (picked
    from it, and closed at the end, when not given); ``lm`` / ``intervention``: loaded by the caller.
    """
    from aligntax.runs.sources import check_source, generation_source

    own = source is None
    source = source or generation_source(cfg.backend)
    try:
        check_source(source, cfg.backend)
        return _run_knowns(cfg, lm, intervention, source)
    finally:
        if own:
            source.close()


def _run_knowns(cfg: KnownsConfig, lm, intervention, source) -> dict:
    from aligntax.generation.source import SourceSpec
    from aligntax.runs.eval import _previous, _read_intervention, _record_intervention
    from aligntax.runs.jsonl import append_jsonl, read_jsonl

    items = load_known_answers(cfg.data, cfg.split, cfg.limit)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    _check_resume(out, cfg)
    write_json_atomic(out / "config.json", asdict(cfg))
    samples_path = out / "samples.jsonl"
    by_id = {it.id: it for it in items}
    done = {r["id"] for r in read_jsonl(samples_path, repair=True)
            if r.get("id") in by_id and r.get("prompt") == by_id[r["id"]].prompt}
    todo = [it for it in items if it.id not in done]

    t0 = time.perf_counter()
    gen_seconds, n_tokens, n_reused = 0.0, 0, 0
    if todo:
        source.check(loaded_intervention=intervention is not None)
        name = cfg.intervention if cfg.intervention != "none" else None
        spec = SourceSpec(cfg.model, cfg.dtype, name, dict(cfg.intervention_args or {}), cfg.batch_size)
        with source.open(spec, lm, intervention) as gen:
            lm, intervention = gen.lm, gen.intervention
            _record_intervention(out, intervention)
            decider = gen.decider()
            info = decider.row_info([it.prompt for it in todo], cfg.system, cfg.batch_size) \
                if intervention is not None and decider is not None else None
            steering = {it.id: r for it, r in zip(todo, info, strict=True)} if info is not None else {}
            if cfg.reuse_unsteered and intervention is not None and decider is not None:
                before = len(todo)
                todo = _reuse_unsteered(cfg, decider, todo, samples_path, steering)
                n_reused = before - len(todo)
            tb = time.perf_counter()
            for idx, gens in gen.iter_generate([it.prompt for it in todo], cfg.generation(), progress=cfg.progress,
                                               desc="knowns"):
                gen_seconds += time.perf_counter() - tb
                n_tokens += sum(g.n_tokens for g in gens)
                append_jsonl(samples_path, [
                    {**todo[i].to_dict(), "response": g.response, "correct": todo[i].check(g.response),
                     "n_tokens": g.n_tokens, "finish_reason": g.finish_reason,
                     **({"steering": steering[todo[i].id]} if todo[i].id in steering else {})}
                    for i, g in zip(idx, gens, strict=True)])
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
        "cut_off": {"all": sum(cut), **{k: sum(c for it, c in zip(items, cut, strict=True) if it.kind == k)
                                        for k in dict.fromkeys(it.kind for it in items)}},
        **_paired_against(cfg.compare_to, items, flags),
        "timing": {"wall_seconds": round(time.perf_counter() - t0, 2), "generation_seconds": round(gen_seconds, 2),
                   "generated_tokens": n_tokens, "new_samples": len(todo), "reused_unsteered_samples": n_reused,
                   "resumed_samples": len(done)},
    }
    write_json_atomic(out / "results.json", results)
    (out / "report.md").write_text(knowns_report(results, [rows[it.id] for it in items]))
    return results


def _steered_rows(rows: Sequence[dict]) -> dict:
    """``{"steered_rows": n}``: how many answers the intervention steered (by the samples' ``steering``
    records); ``{}`` when none has one."""
    infos = [r["steering"] for r in rows if "steering" in r]
    return {"steered_rows": sum(bool(i.get("steered")) for i in infos)} if infos else {}


def _rescore(samples_path: Path, by_id: dict[str, KnownItem]) -> dict[str, dict]:
    """The stored row of each item (the last one with its current prompt), scored against its current
    answers. ``samples.jsonl`` is rewritten atomically, keeping one row per item, when a stored verdict or
    answer list is out of date or an item has superseded rows (an earlier prompt, a repeat)."""
    from aligntax.runs.jsonl import append_jsonl, read_jsonl

    all_rows = read_jsonl(samples_path)
    rows: dict[str, dict] = {}
    for r in all_rows:
        it = by_id.get(r.get("id"))
        if it is not None and r.get("prompt") == it.prompt:
            rows[it.id] = r
    kept = [r for r in all_rows if r.get("id") not in by_id or rows.get(r["id"]) is r]
    stale = len(kept) != len(all_rows)
    for item_id, r in rows.items():
        it = by_id[item_id]
        fresh = {**r, **it.to_dict(), "correct": it.check(r["response"])}
        stale |= fresh != r
        r.clear()
        r.update(fresh)
    if stale:
        tmp = samples_path.with_suffix(".jsonl.partial")
        tmp.unlink(missing_ok=True)
        append_jsonl(tmp, kept)
        os.replace(tmp, samples_path)
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
        raise AligntaxError(f"Cannot compare with {ref}: it holds no samples.jsonl (not a knowns run folder).")
    theirs = {r["id"]: r for r in read_jsonl(path) if "response" in r and "id" in r}
    pairs: list[tuple[KnownItem, bool, bool]] = []
    for it, mine in zip(items, flags, strict=True):
        r = theirs.get(it.id)
        if r is None:
            continue
        if r.get("prompt") != it.prompt:
            raise AligntaxError(f"Cannot compare with {ref}: its item {it.id!r} has another prompt "
                                f"({r.get('prompt')!r}); was it made from other data?")
        pairs.append((it, it.check(r["response"]), mine))
    if not pairs:
        raise AligntaxError(f"Cannot compare with {ref}: it holds none of this run's items.")

    def change(sel: list[tuple[KnownItem, bool, bool]]) -> dict:
        return paired_change([b for _, b, _ in sel], [a for _, _, a in sel])

    kinds = list(dict.fromkeys(it.kind for it, _, _ in pairs))
    return {"paired": {"against": str(ref), "n_pairs": len(pairs), "unmatched": len(items) - len(pairs),
                       **change(pairs),
                       "by_kind": {k: change([p for p in pairs if p[0].kind == k]) for k in kinds}}}


def knowns_report(results: dict, rows: Sequence[dict], n_wrong: int = 10) -> str:
    """A short markdown report: accuracy per kind, the paired change if any, the first wrong answers."""
    cfg = results["config"]
    iv = results.get("intervention") or {}
    lines = [f"# Known-answer check: {cfg['model']}", "",
             f"Data {cfg['data']} (split {cfg['split']}), greedy, {cfg['max_new_tokens']} new tokens; "
             f"intervention: {iv.get('name', 'none') if isinstance(iv, dict) else 'none'}.", "",
             "| kind | n | accuracy [95% CI] |", "|---|---:|---|"]
    for kind, r in results["by_kind"].items():
        lines.append(f"| {kind} | {r['n']} | {format_accuracy(r)} |")
    lines.append(f"| **all** | {results['n']} | {format_accuracy(results)} |")
    cut = results.get("cut_off", {})
    if cut.get("all"):
        per = ", ".join(f"{k} {n}" for k, n in cut.items() if k != "all" and n)
        lines += ["", f"{cut['all']} wrong answers stopped at {cfg['max_new_tokens']} new tokens without giving "
                      f"an accepted answer ({per})."]
    if "paired" in results:
        p = results["paired"]
        lines += ["", f"Paired against {p['against']} ({p['n_pairs']} shared items):", "",
                  "| kind | before | after | gained | lost | McNemar p |", "|---|---:|---:|---:|---:|---:|"]
        for kind, c in [*p["by_kind"].items(), ("all", p)]:
            lines.append(f"| {kind} | {100 * c['before']:.1f}% | {100 * c['after']:.1f}% | {c['gained']} | "
                         f"{c['lost']} | {c['p_value']:.3g} |")
    wrong = [r for r in rows if not r["correct"]]
    if wrong:
        lines += ["", f"Wrong answers ({len(wrong)}; the first {min(n_wrong, len(wrong))}):", ""]
        for r in wrong[:n_wrong]:
            reply = " ".join(r["response"].split())
            lines.append(f"- `{r['id']}` {r['prompt']} (accepted: {', '.join(r['answers'])}) -> "
                         f"{reply[:160]}{'...' if len(reply) > 160 else ''}")
    return "\n".join(lines) + "\n"
