"""Judging a JSONL file of (prompt, response) records."""

from __future__ import annotations

import json
import os
from pathlib import Path

from aligntax.errors import DataError
from aligntax.judges.base import RefusalJudge


def _prompt_text(prompt, where: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        users = [m.get("content") for m in prompt if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise DataError(f"{where}: 'prompt' must be a string (or a list of chat messages with a user turn).")


def read_pairs(in_path: str | Path) -> tuple[list[dict], list[str], list[str]]:
    """Records, prompts and responses of a JSONL file; DataError naming the line for any problem."""
    path = Path(in_path)
    if not path.exists():
        raise DataError(f"Input file not found: {path}")
    if not path.is_file():
        raise DataError(f"Input path is not a file: {path}")
    records: list[dict] = []
    prompts: list[str] = []
    responses: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno}).") from None
            if not isinstance(rec, dict):
                raise DataError(
                    f"{where}: expected a JSON object with 'prompt' and 'response', got {type(rec).__name__}."
                )
            missing = [k for k in ("prompt", "response") if k not in rec]
            if missing:
                raise DataError(
                    f"{where}: missing key(s) {', '.join(repr(k) for k in missing)} "
                    "(each line needs 'prompt' and 'response')."
                )
            if not isinstance(rec["response"], str):
                raise DataError(
                    f"{where}: 'response' must be a string, got {type(rec['response']).__name__}."
                )
            prompts.append(_prompt_text(rec["prompt"], where))
            responses.append(rec["response"])
            records.append(rec)
    if not records:
        raise DataError(f"Input file is empty (no JSON lines): {path}")
    return records, prompts, responses


def judge_jsonl(in_path: str | Path, out_path: str | Path, judge: RefusalJudge) -> dict:
    """Copy ``in_path`` to ``out_path`` adding ``refused`` and ``refusal_score`` to every record.

    Returns a summary: {"n", "n_refused", "refusal_rate", "judge"}. The output is written to a
    temporary file and moved into place, so a failure leaves no half-written file.
    """
    records, prompts, responses = read_pairs(in_path)
    verdicts = judge.judge(prompts, responses)
    if len(verdicts) != len(records):
        raise DataError(
            f"The {judge.name} judge returned {len(verdicts)} verdicts for {len(records)} records."
        )
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for rec, v in zip(records, verdicts, strict=True):
                fh.write(
                    json.dumps(
                        {**rec, "refused": bool(v.refused), "refusal_score": float(v.refusal_score)},
                        ensure_ascii=False,
                    )
                    + "\n"
                )
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    n_ref = sum(bool(v.refused) for v in verdicts)
    return {
        "n": len(records),
        "n_refused": n_ref,
        "refusal_rate": n_ref / len(records),
        "judge": judge.config(),
    }
