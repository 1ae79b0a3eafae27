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

The run folder of ``aligntax knowns`` (generating the answers, resuming, comparing with another run) is
:mod:`aligntax.runs.knowns`; this module only loads and scores.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aligntax.errors import AligntaxError, DataError
from aligntax.metrics.mc import accuracy_block, format_accuracy

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
    # "contains": an accepted answer occurs in the response (:func:`is_correct`); "final-number": the
    # response's final number equals the answer (:func:`final_number`; GSM8K)
    scoring: str = "contains"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "prompt": self.prompt,
            "kind": self.kind,
            "split": self.split,
            "answers": list(self.answers),
        }
        if self.case_sensitive:
            out["case_sensitive"] = True
        if self.options:
            out["options"] = list(self.options)
        if self.scoring != "contains":
            out["scoring"] = self.scoring
        return out

    def check(self, response: str) -> bool:
        if self.scoring == "final-number":
            return final_number_correct(response, self.answers)
        return is_correct(response, self.answers, case_sensitive=self.case_sensitive, options=self.options)


# GSM8K as a known-answer set: the test split, and a validation split held out of train (its last rows;
# the rows before it may serve as everyday training rows, e.g. ``els distill``'s retained answers)
GSM8K_VAL_FROM = 7000
GSM8K_SETS = {"gsm8k-test": ("gsm8k-test", "test"), "gsm8k-val": ("gsm8k-train", "val")}
# what a GSM8K question is asked with: the model works it out, then states the number
GSM8K_INSTRUCTION = "Solve it step by step, then give the final answer on the last line as: Answer: <number>"


# ------------------------------------------------------------------------------------------ loading
def load_known_answers(
    data: str | Path = BUILTIN, split: str | None = None, limit: int | None = None
) -> list[KnownItem]:
    """The built-in set (``"builtin"``) or a user JSONL/JSON file, optionally one split and the first
    ``limit`` items of it.

    Every record needs ``id``, ``prompt``, ``answers`` (a non-empty list of strings or numbers, or one
    string), ``kind`` (any name) and ``split`` (``val`` or ``test``); ``case_sensitive`` (bool) and
    ``options`` (list of strings) are optional. ``split`` None or ``"all"`` keeps both splits. Every
    problem is a :class:`DataError` naming the file and record.
    """
    from aligntax.data._io import describe_columns, read_table

    if str(data) in GSM8K_SETS:
        return load_gsm8k(str(data), limit)
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
        raise DataError(
            f"{table.name}: missing field(s) {', '.join(repr(m) for m in missing)} for a "
            f"known-answer set; the file has: {describe_columns(table.columns)}"
        )
    items: list[KnownItem] = []
    seen: dict[str, str] = {}
    for row in table.rows:
        where = f"{table.name}, {row.where}"
        v = row.values
        item_id, prompt, kind = (
            _text(_cell(v, cols[name]), name, where) for name in ("id", "prompt", "kind")
        )
        item_split = _text(_cell(v, cols["split"]), "split", where)
        if item_split not in SPLITS:
            raise DataError(f"{where}: 'split' must be one of {', '.join(SPLITS)}; got {item_split!r}")
        if item_id in seen:
            raise DataError(f"{where}: duplicate id {item_id!r} (also at {seen[item_id]})")
        seen[item_id] = row.where
        case = v.get(cols["case_sensitive"]) if cols["case_sensitive"] else None
        if case is not None and not isinstance(case, bool):
            raise DataError(f"{where}: 'case_sensitive' must be true or false; got {case!r}")
        options = v.get(cols["options"]) if cols["options"] else None
        item = KnownItem(
            item_id,
            prompt,
            _strings(_cell(v, cols["answers"]), "answers", where),
            kind,
            item_split,
            bool(case),
            _strings(options, "options", where) if options is not None else (),
        )
        if split in (None, "all", item.split):
            items.append(item)
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DataError(f"{table.name}: no items in the split {split!r}.")
    return items


def load_gsm8k(name: str = "gsm8k-test", limit: int | None = None) -> list[KnownItem]:
    """GSM8K as known-answer items (:data:`GSM8K_SETS`: ``gsm8k-test``, or ``gsm8k-val``, train's rows from
    :data:`GSM8K_VAL_FROM` on), scored by the final number; the question asked with
    :data:`GSM8K_INSTRUCTION`. The kind is the worked solution's number of calculation steps (``steps-N``,
    5 and more together); ``limit`` keeps a sample stratified by it (the same for every run)."""
    import json
    import random

    from aligntax.data.registry import dataset_path

    if limit is not None and limit < 1:
        raise AligntaxError("limit must be >= 1.")
    dataset, split = GSM8K_SETS[name]
    path = dataset_path(dataset)
    items = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip() or (split == "val" and i < GSM8K_VAL_FROM):
            continue
        rec = json.loads(line)
        answer = rec["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
        steps = min(rec["answer"].count("<<"), 5)
        prompt = f"{rec['question'].strip()}\n\n{GSM8K_INSTRUCTION}"
        items.append(
            KnownItem(f"{dataset}:{i}", prompt, (answer,), f"steps-{steps}", split, scoring="final-number")
        )
    if limit is None or limit >= len(items):
        return items
    by_kind: dict[str, list[KnownItem]] = {}
    for it in items:
        by_kind.setdefault(it.kind, []).append(it)
    rng = random.Random(0)
    # each kind's share of the sample in proportion to its size (largest remainders), drawn at random
    quota = {k: limit * len(v) / len(items) for k, v in by_kind.items()}
    take = {k: int(q) for k, q in quota.items()}
    for k in sorted(quota, key=lambda k: take[k] - quota[k])[: limit - sum(take.values())]:
        take[k] += 1
    chosen = {it.id for k, v in by_kind.items() for it in rng.sample(v, take[k])}
    return [it for it in items if it.id in chosen]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(response: str) -> float | None:
    """The number a worked answer ends on: the first number after its last "answer" (as in
    "Answer: 18", "the answer is $18"), else its last number; thousands separators, ``$`` and ``%``
    ignored. None when it has no number."""
    text = normalize(response).replace("$", "")
    cut = text.rfind("answer")
    tail = _NUMBER.search(text, cut) if cut >= 0 else None
    if tail is None:
        numbers = list(_NUMBER.finditer(text))
        tail = numbers[-1] if numbers else None
    return float(tail.group()) if tail else None


def final_number_correct(response: str, answers: Iterable[str]) -> bool:
    """Whether the response's :func:`final_number` equals one of ``answers`` (numbers)."""
    got = final_number(response)
    return got is not None and any(abs(got - float(a)) < 1e-6 for a in answers)


def _cell(values: dict[str, Any], col: str | None) -> Any:
    """A row's value in column ``col`` (None when the table has no such column)."""
    return values.get(col) if col is not None else None


def _text(raw: Any, name: str, where: str) -> str:
    if isinstance(raw, bool) or not isinstance(raw, str | int) or not str(raw).strip():
        raise DataError(f"{where}: {name!r} must be a non-empty string; got {raw!r}")
    return str(raw).strip()


def _strings(raw: Any, name: str, where: str) -> tuple[str, ...]:
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


def _pattern(answer: str) -> re.Pattern[str]:
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


def is_correct(
    response: str, answers: Iterable[str], *, case_sensitive: bool = False, options: Sequence[str] = ()
) -> bool:
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


def accuracy_by_kind(items: Sequence[KnownItem], flags: Sequence[bool]) -> dict[str, Any]:
    """Accuracy with a Wilson 95% interval overall, and per kind under ``by_kind``."""
    kinds = sorted({it.kind for it in items}, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k))
    return {
        **accuracy_block(list(flags)),
        "by_kind": {
            k: accuracy_block([f for it, f in zip(items, flags, strict=True) if it.kind == k]) for k in kinds
        },
    }


def knowns_report(results: dict[str, Any], rows: Sequence[dict[str, Any]], n_wrong: int = 10) -> str:
    """A short markdown report: accuracy per kind, the paired change if any, the first wrong answers."""
    cfg = results["config"]
    iv = results.get("intervention") or {}
    lines = [
        f"# Known-answer check: {cfg['model']}",
        "",
        f"Data {cfg['data']} (split {cfg['split']}), greedy, {cfg['max_new_tokens']} new tokens; "
        f"intervention: {iv.get('name', 'none') if isinstance(iv, dict) else 'none'}.",
        "",
        "| kind | n | accuracy [95% CI] |",
        "|---|---:|---|",
    ]
    for kind, r in results["by_kind"].items():
        lines.append(f"| {kind} | {r['n']} | {format_accuracy(r)} |")
    lines.append(f"| **all** | {results['n']} | {format_accuracy(results)} |")
    cut = results.get("cut_off", {})
    if cut.get("all"):
        per = ", ".join(f"{k} {n}" for k, n in cut.items() if k != "all" and n)
        lines += [
            "",
            f"{cut['all']} wrong answers stopped at {cfg['max_new_tokens']} new tokens without giving "
            f"an accepted answer ({per}).",
        ]
    if "paired" in results:
        p = results["paired"]
        lines += [
            "",
            f"Paired against {p['against']} ({p['n_pairs']} shared items):",
            "",
            "| kind | before | after | gained | lost | McNemar p |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for kind, c in [*p["by_kind"].items(), ("all", p)]:
            lines.append(
                f"| {kind} | {100 * c['before']:.1f}% | {100 * c['after']:.1f}% | {c['gained']} | "
                f"{c['lost']} | {c['p_value']:.3g} |"
            )
    wrong = [r for r in rows if not r["correct"]]
    if wrong:
        lines += ["", f"Wrong answers ({len(wrong)}; the first {min(n_wrong, len(wrong))}):", ""]
        for r in wrong[:n_wrong]:
            reply = " ".join(r["response"].split())
            lines.append(
                f"- `{r['id']}` {r['prompt']} (accepted: {', '.join(r['answers'])}) -> "
                f"{reply[:160]}{'...' if len(reply) > 160 else ''}"
            )
    return "\n".join(lines) + "\n"
