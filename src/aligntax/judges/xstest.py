"""The XSTest human-labelled model completions (Röttger et al. 2024), used to train and validate judges.

Five CSVs, one per model (gpt4, llama2new, llama2orig, mistralguard, mistralinstruct), 450 rows each,
with the columns id,type,prompt,completion,...,final_label. ``final_label`` is one of
1_full_compliance, 2_full_refusal, 3_partial_refusal; a refusal is a full OR a partial refusal.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from aligntax.errors import DataError
from aligntax.paths import fetched_data_dir, shared_data_dir

XSTEST_SUBDIR = Path("refusal") / "xstest" / "model_completions_human_labeled"
LABELS = ("1_full_compliance", "2_full_refusal", "3_partial_refusal")
REFUSAL_LABELS = frozenset({"2_full_refusal", "3_partial_refusal"})


@dataclass(frozen=True)
class LabeledCompletion:
    model: str  # e.g. "gpt4" (from the file name xstest_v2_completions_gpt4.csv)
    id: str
    type: str
    prompt: str
    completion: str
    label: str

    @property
    def refused(self) -> bool:
        return self.label in REFUSAL_LABELS


def xstest_dir(data_dir: str | Path | None = None) -> Path | None:
    """The folder of the labelled CSVs: ``data_dir`` (the shared data root or the folder itself), else
    the shared data folder, else the files ``aligntax data fetch xstest-labeled`` stored; None when it
    cannot be found."""
    roots = [Path(data_dir)] if data_dir is not None else []
    if data_dir is None:
        roots += [p for p in (shared_data_dir(), fetched_data_dir()) if p is not None]
    for root in roots:
        for cand in (root, root / XSTEST_SUBDIR):
            if cand.is_dir() and any(cand.glob("*.csv")):
                return cand
    return None


def load_xstest_labeled(data_dir: str | Path | None = None) -> list[LabeledCompletion]:
    """All labelled completions, model by model (sorted by file name), rows in file order."""
    folder = xstest_dir(data_dir)
    if folder is None:
        raise DataError(
            "XSTest human-labelled completions not found. Point ALIGNTAX_DATA (or data_dir) at the shared "
            f"data folder that holds {XSTEST_SUBDIR}/*.csv, or run `aligntax data fetch xstest-labeled`."
        )
    rows: list[LabeledCompletion] = []
    for path in sorted(folder.glob("*.csv")):
        model = path.stem.rsplit("_", 1)[-1]
        with open(path, newline="", encoding="utf-8") as fh:
            for i, rec in enumerate(csv.DictReader(fh), start=2):
                label = (rec.get("final_label") or "").strip()
                if label not in LABELS:
                    raise DataError(
                        f"{path}:{i}: unexpected final_label {label!r}; expected one of {LABELS}."
                    )
                rows.append(
                    LabeledCompletion(
                        model=model,
                        id=rec["id"],
                        type=rec.get("type", ""),
                        prompt=rec["prompt"],
                        completion=rec["completion"],
                        label=label,
                    )
                )
    if not rows:
        raise DataError(f"No labelled rows in {folder}.")
    return rows
