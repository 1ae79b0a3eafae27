"""A local lm-evaluation-harness task folder written into a test's tmp_path: multiple-choice
(loglikelihood), short-answer (generate_until) and perplexity (loglikelihood_rolling) items over local
JSONL files, so no dataset is fetched from the Hub."""

from __future__ import annotations

import json
from pathlib import Path

CAPITALS = [
    ("France", "Paris"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Canada", "Ottawa"),
    ("Norway", "Oslo"),
]
WORDS = ["red", "blue", "green", "seven", "three", "cat", "dog", "river", "stone", "cloud"]


def mc_items(n: int = 20) -> list[dict]:
    """``n`` multiple-choice questions (4 choices): capitals, then small sums."""
    items = []
    for i in range(n):
        if i < len(CAPITALS):
            country, city = CAPITALS[i]
            others = [c for _, c in CAPITALS if c != city]
            choices = [city, others[i % 9], others[(i + 3) % 9], others[(i + 5) % 9]]
            question = f"What is the capital of {country}?"
        else:
            a, b = i, 2 * i - 17
            s = a + b
            choices = [str(s), str(s + 1), str(s - 2), str(s + 10)]
            question = f"What is {a} + {b}?"
        rot = i % 4  # the answer is not always the first choice
        choices = choices[rot:] + choices[:rot]
        items.append({"question": question, "choices": choices, "label": (4 - rot) % 4})
    return items


def gen_items(n: int = 10) -> list[dict]:
    return [{"question": f"Repeat the word: {w}", "answer": w} for w in WORDS[:n]]


def text_items(n: int = 4) -> list[dict]:
    return [{"text": " ".join(WORDS[i:] + WORDS[:i]) + "."} for i in range(n)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_tasks(folder: Path, n_mc: int = 20, n_gen: int = 10, n_text: int = 4) -> Path:
    """Tasks ``local_mc``, ``local_gen`` and ``local_ppl`` (YAML + JSONL) in ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    mc = _jsonl(folder / "mc.jsonl", mc_items(n_mc))
    gen = _jsonl(folder / "gen.jsonl", gen_items(n_gen))
    text = _jsonl(folder / "text.jsonl", text_items(n_text))
    (folder / "local_mc.yaml").write_text(
        f"""task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
        encoding="utf-8",
    )
    (folder / "local_gen.yaml").write_text(
        f"""task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
        encoding="utf-8",
    )
    (folder / "local_ppl.yaml").write_text(
        f"""task: local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {text}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""",
        encoding="utf-8",
    )
    return folder
