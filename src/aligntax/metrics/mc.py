"""Multiple-choice accuracy, with and without an intervention: does steered text stay sane?

Each question goes to the model as a chat prompt that lists the options as lettered lines (``A. ...``),
followed by the start of its answer, "The correct answer is" (:data:`ANSWER_PREFIX`). The model's
choice is the option letter with the highest next-token probability there (the letter with and
without a leading space, each where it is a single token, summed). No text is generated, so the score
depends on no judge and no parsing of free text. (Small chat models asked to reply with a bare letter
tend to answer "A" whatever the question; the answer lead-in makes them pick between the options.)

Prompts run in batches with left padding (position ids from the attention mask, as generation uses
them) inside the intervention's ``attach`` context with a :class:`SteerContext`, exactly like a
generation step: ELS steers the hidden state of the last prompt token, the one that predicts the
letter. Message-rewriting interventions (system prompts) apply as well. The model runs in
:mod:`aligntax.runs.mc` (``score_items``, ``mc_accuracy``, ``run_mc``); this module holds the questions,
the prompt text and the scoring of the logits.

``letter_mass`` is the probability the model puts on any option letter at all: a steered model that
stops answering in the expected form shows it there even when its argmax letter happens to be right.

The built-in set (``builtin``, ``aligntax/resources/mc/general.jsonl``) has 137 four-option questions
written for aligntax on science, geography, arithmetic, history, everyday reasoning and language, with
the correct letters balanced over A-D within every subject. :func:`load_mc` also reads a user file
(JSONL, JSON, CSV or TSV) with the same fields.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aligntax.errors import AligntaxError, DataError
from aligntax.interventions.base import Intervention
from aligntax.metrics.rates import rate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

LETTERS = "ABCDEFGH"
BUILTIN = "builtin"
BUILTIN_PATH = Path(__file__).resolve().parent.parent / "resources" / "mc" / "general.jsonl"
INSTRUCTION = "Answer the following multiple-choice question."
ANSWER_PREFIX = "The correct answer is"


@dataclass(frozen=True)
class MCItem:
    """One question: ``choices`` (2 to 8 options) and the 0-based index of the correct one."""

    id: str
    question: str
    choices: tuple[str, ...]
    answer: int
    subject: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "subject": self.subject,
            "question": self.question,
            "choices": list(self.choices),
            "answer": self.answer,
        }


# ------------------------------------------------------------------------------------------ loading
def load_mc(source: str | Path = BUILTIN, limit: int | None = None) -> list[MCItem]:
    """The built-in set (``"builtin"``) or a user file.

    A file is JSONL, JSON (an array of records), CSV or TSV, one question per record, with the fields
    ``question``, ``choices`` and ``answer`` (required) and ``id`` and ``subject`` (optional; the id
    defaults to the record number). ``choices`` is a list of 2 to 8 distinct non-empty strings (in a
    CSV cell: a JSON list); a CSV may give the options as columns ``A``, ``B``, ... instead.
    ``answer`` is the 0-based index of the correct option or its letter (``"A"``...). Every problem is
    a :class:`DataError` naming the file and record.
    """
    from aligntax.data._io import read_table

    path = BUILTIN_PATH if str(source) == BUILTIN else Path(source)
    table = read_table(path)
    letter_cols = []
    for letter in LETTERS:
        col = table.find_column([letter])
        if col is None:
            break
        letter_cols.append(col)
    q_col = table.find_column(["question"])
    c_col = table.find_column(["choices"])
    a_col = table.find_column(["answer"])
    missing = [name for name, col in (("question", q_col), ("answer", a_col)) if col is None]
    if c_col is None and len(letter_cols) < 2:
        missing.insert(1, "choices")
    if missing:
        from aligntax.data._io import describe_columns

        raise DataError(
            f"{table.name}: missing field(s) {', '.join(repr(m) for m in missing)} for a "
            f"multiple-choice set; the file has: {describe_columns(table.columns)}"
        )
    id_col, s_col = table.find_column(["id"]), table.find_column(["subject"])
    items: list[MCItem] = []
    seen: dict[str, str] = {}
    for row in table.rows:
        where = f"{table.name}, {row.where}"
        v = row.values
        question = v.get(q_col) if q_col is not None else None
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where}: 'question' must be a non-empty string")
        choices = _choices(
            v.get(c_col) if c_col is not None else [v.get(c) for c in letter_cols],
            where,
            from_columns=c_col is None,
        )
        answer = _answer(v.get(a_col) if a_col is not None else None, len(choices), where)
        item_id = v.get(id_col) if id_col is not None else None
        item_id = str(row.num) if item_id is None or str(item_id).strip() == "" else str(item_id).strip()
        if item_id in seen:
            raise DataError(f"{where}: duplicate id {item_id!r} (also at {seen[item_id]})")
        seen[item_id] = row.where
        subject = v.get(s_col) if s_col is not None else None
        items.append(
            MCItem(item_id, question.strip(), choices, answer, "" if subject is None else str(subject))
        )
        if limit is not None and len(items) >= limit:
            break
    return items


def _choices(raw: Any, where: str, from_columns: bool) -> tuple[str, ...]:
    if from_columns:  # options in columns A, B, ...: trailing empty cells are absent options
        raw = list(raw)
        while raw and (raw[-1] is None or str(raw[-1]).strip() == ""):
            raw.pop()
    elif isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise DataError(
                f"{where}: 'choices' must be a list of strings (in a CSV cell, a JSON list such "
                f'as ["red", "blue"]); got {raw[:60]!r}'
            ) from None
    if not isinstance(raw, list):
        raise DataError(f"{where}: 'choices' must be a list of strings, got {type(raw).__name__}")
    if not 2 <= len(raw) <= len(LETTERS):
        raise DataError(f"{where}: {len(raw)} choices; a question needs 2 to {len(LETTERS)}")
    out = []
    for i, c in enumerate(raw):
        if isinstance(c, bool) or not isinstance(c, str | int | float) or not str(c).strip():
            raise DataError(f"{where}: choice {LETTERS[i]} is empty or not text")
        out.append(str(c).strip())
    if len(set(out)) != len(out):
        raise DataError(f"{where}: the choices are not distinct: {out}")
    return tuple(out)


def _answer(raw: Any, n: int, where: str) -> int:
    letters = LETTERS[:n]
    if isinstance(raw, str):
        text = raw.strip()
        if len(text) == 1 and text.upper() in LETTERS:
            idx = LETTERS.index(text.upper())
        elif text.lstrip("-").isdigit():
            idx = int(text)
        else:
            raise DataError(
                f"{where}: 'answer' must be an option index (0-{n - 1}) or letter "
                f"({', '.join(letters)}); got {raw!r}"
            )
    elif isinstance(raw, int) and not isinstance(raw, bool):
        idx = raw
    elif isinstance(raw, float) and raw.is_integer():
        idx = int(raw)
    else:
        raise DataError(
            f"{where}: 'answer' must be an option index (0-{n - 1}) or letter "
            f"({', '.join(letters)}); got {raw!r}"
        )
    if not 0 <= idx < n:
        raise DataError(
            f"{where}: answer {raw!r} is out of range for {n} choices (index 0-{n - 1}, "
            f"letter {letters[0]}-{letters[-1]})"
        )
    return idx


# ------------------------------------------------------------------------------------------ scoring
def mc_prompt(item: MCItem) -> str:
    """The user message for a question: instruction, question, lettered options."""
    options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(item.choices))
    return f"{INSTRUCTION}\n\n{item.question}\n{options}"


def mc_text(
    tokenizer: PreTrainedTokenizerBase,
    item: MCItem,
    system: str | None = None,
    intervention: Intervention | None = None,
) -> str:
    """The scored text: the chat-templated prompt (with the generation prompt) plus :data:`ANSWER_PREFIX`."""
    from aligntax.generation.chat import build_messages, render_chat

    return render_chat(tokenizer, build_messages(mc_prompt(item), system, intervention)) + ANSWER_PREFIX


def option_token_ids(tokenizer: PreTrainedTokenizerBase, n: int = 4) -> list[list[int]]:
    """For each of the first ``n`` letters, the ids of the single tokens that spell it ("A", " A")."""
    out: list[list[int]] = []
    for letter in LETTERS[:n]:
        ids = []
        for variant in (letter, " " + letter):
            toks = tokenizer.encode(variant, add_special_tokens=False)
            if len(toks) == 1 and toks[0] not in ids:
                ids.append(int(toks[0]))
        if not ids:
            raise AligntaxError(f"The tokenizer has no single token for the option letter {letter!r}.")
        out.append(ids)
    flat = [t for ids in out for t in ids]
    if len(set(flat)) != len(flat):
        raise AligntaxError("Two option letters share a token in this tokenizer.")
    return out


@dataclass
class MCScore:
    """Per question: the probability of each option (normalised over the options), the predicted
    option, and the probability mass on any option letter."""

    probs: list[float]
    pred: int
    letter_mass: float


def mc_score(logp: torch.Tensor, letter_ids: Sequence[Sequence[int]], n: int) -> MCScore:
    """One question's score from the next-token log-probabilities (``[vocab]``) after its text
    (:func:`mc_text`): each of its ``n`` options gets the summed probability of its letter tokens
    (``letter_ids``, from :func:`option_token_ids`), normalised over the options."""
    per = torch.stack([torch.logsumexp(logp[letter_ids[k]], dim=0) for k in range(n)])
    if not torch.isfinite(per).all():
        raise AligntaxError("Non-finite option scores: the model produced NaN/inf logits.")
    probs = torch.softmax(per, dim=0)
    return MCScore(
        [float(p) for p in probs], int(per.argmax()), float(torch.logsumexp(per, dim=0).exp().clamp(0.0, 1.0))
    )


def accuracy_block(flags: list[bool]) -> dict[str, Any]:
    r = rate(flags)
    return {"n": r.n, "correct": r.k, "accuracy": r.value, "ci95": list(r.ci95)}


def mc_results(items: Sequence[MCItem], scores: Sequence[MCScore]) -> dict[str, Any]:
    """Accuracy with a Wilson 95% interval, per subject, the mean letter mass, and one row per item."""
    rows = [
        {
            **it.to_dict(),
            "pred": s.pred,
            "correct": s.pred == it.answer,
            "probs": [round(p, 6) for p in s.probs],
            "letter_mass": round(s.letter_mass, 6),
        }
        for it, s in zip(items, scores, strict=True)
    ]
    subjects = sorted({r["subject"] for r in rows})
    return {
        **accuracy_block([r["correct"] for r in rows]),
        "letter_mass_mean": sum(s.letter_mass for s in scores) / len(scores),
        "by_subject": {s: accuracy_block([r["correct"] for r in rows if r["subject"] == s]) for s in subjects}
        if subjects != [""]
        else {},
        "rows": rows,
    }


def format_accuracy(res: dict[str, Any]) -> str:
    """``"62.0% [53.6, 69.7] (85/137)"``."""
    lo, hi = res["ci95"]
    return f"{100 * res['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({res['correct']}/{res['n']})"
