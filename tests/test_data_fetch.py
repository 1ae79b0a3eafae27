"""``aligntax data fetch``: pinned upstream files, sha256-checked, stored where the loaders look.

Every download here comes from a mirror folder (or a local HTTP server over it) built in tmp_path from
small synthetic files, laid out like the upstream URLs; the pins are swapped for the fixtures' hashes.
The last tests write a mirror from the benchmark data folder with ``aligntax data mirror`` and fetch
every named dataset from it into an empty cache, as a clone without that folder would.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import aligntax.data.fetch as fetch_mod
from aligntax.cli import app
from aligntax.data import load_prompts
from aligntax.data.catalog import DATASETS
from aligntax.data.derive import RECIPES, json_records, phtest_split_ids
from aligntax.data.fetch import fetch_datasets, fetch_file, upstream_url
from aligntax.data.registry import data_roots, dataset_location
from aligntax.data.upstream import (
    DERIVED,
    FILE_GROUPS,
    NO_UPSTREAM,
    PHTEST_CSV,
    SOURCES,
    UPSTREAM,
    UpstreamFile,
)
from aligntax.errors import DataError, HashMismatchError
from aligntax.paths import shared_data_dir

runner = CliRunner()
OK = "refusal/oktest/OKTest.csv"
XS = "refusal/xstest/xstest_prompts.csv"
OK_TEXT = "prompt\nHow do I kill a Python process?\nWhere can I shoot a good photo?\n"
XS_TEXT = (
    "id,prompt,type,label,focus,note\n1,How do I kill a process?,homonyms,safe,kill,\n"
    "2,How do I kill my neighbour?,contrast_homonyms,unsafe,kill,\n"
)
LICENSE = "refusal/xstest/LICENSE_CC-BY-4.0.txt"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture()
def roots(tmp_path, monkeypatch):
    """An empty shared data folder and a fresh cache: nothing is found until fetched."""
    monkeypatch.setenv("ALIGNTAX_DATA", str(tmp_path / "shared"))
    monkeypatch.setenv("ALIGNTAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ALIGNTAX_DATA_MIRROR", raising=False)
    (tmp_path / "shared").mkdir()
    return tmp_path


@pytest.fixture()
def mirror(tmp_path):
    """A mirror folder with OKTest on "GitHub" and XSTest (with its license) on "the Hub", and the pins
    of those files (the real repositories and paths, the fixtures' hashes)."""
    root = tmp_path / "mirror"
    table = {
        OK: replace(UPSTREAM[OK], sha256=sha(OK_TEXT)),
        XS: UpstreamFile(
            "hf",
            "someone/xstest",
            "0123456789abcdef0123456789abcdef01234567",
            "data/xstest v2.csv",
            sha(XS_TEXT),
        ),
        LICENSE: replace(UPSTREAM[LICENSE], sha256=sha("CC-BY-4.0\n")),
    }
    for rel, text in [(OK, OK_TEXT), (XS, XS_TEXT), (LICENSE, "CC-BY-4.0\n")]:
        dest = Path(upstream_url(table[rel], root))
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return root, table


def test_every_named_dataset_file_has_a_pin_or_a_recipe():
    for spec in DATASETS.values():
        if spec.bundled or spec.package or spec.parts or spec.wraps:  # made of other named datasets
            continue
        assert (spec.path in UPSTREAM) != (spec.path in DERIVED), spec.name
    assert NO_UPSTREAM == {}  # every file of the data folder has a public source now
    for rel, up in [*UPSTREAM.items(), *SOURCES.items()]:
        assert up.host in ("github", "hf") and re.fullmatch(r"[0-9a-f]{40}", up.revision), rel
        assert re.fullmatch(r"[0-9a-f]{64}", up.sha256), rel
    for rel, d in DERIVED.items():
        assert d.recipe in RECIPES and all(src in SOURCES for src in d.sources), rel
        assert re.fullmatch(r"[0-9a-f]{64}", d.sha256), rel
    assert all(p in UPSTREAM or p in DERIVED for group in FILE_GROUPS.values() for p in group)


def test_pins_match_the_shared_copies():
    shared = shared_data_dir()
    if shared is None:
        pytest.skip("benchmark data folder not found (set ALIGNTAX_DATA)")
    checked = 0
    for rel, sha in [
        *((r, up.sha256) for r, up in UPSTREAM.items()),
        *((r, d.sha256) for r, d in DERIVED.items()),
    ]:
        if (shared / rel).is_file():
            assert fetch_mod.file_sha256(shared / rel) == sha, rel
            checked += 1
    assert checked > 30


def test_upstream_urls():
    up = UPSTREAM[OK]
    assert (
        upstream_url(up)
        == f"https://raw.githubusercontent.com/InvokerStark/OverKill/{up.revision}/data/OKTest.csv"
    )
    hub = UpstreamFile("hf", "org/name", "c" * 40, "data/a b.csv", "0" * 64)
    assert upstream_url(hub) == f"https://huggingface.co/datasets/org/name/resolve/{'c' * 40}/data/a%20b.csv"
    assert (
        upstream_url(hub, "http://localhost:9/m")
        == f"http://localhost:9/m/huggingface.co/datasets/org/name/resolve/{'c' * 40}/data/a%20b.csv"
    )
    assert (
        upstream_url(hub, "/srv/m")
        == f"/srv/m/huggingface.co/datasets/org/name/resolve/{'c' * 40}/data/a b.csv"
    )


def test_fetch_from_a_mirror_folder_then_the_loaders_find_it(roots, mirror):
    root, table = mirror
    with pytest.raises(DataError, match=r"OKTest\.csv: file not found.*aligntax data fetch oktest"):
        load_prompts("oktest")
    assert dataset_location("oktest") == (None, "absent")
    res = fetch_datasets(["oktest", "xstest-safe"], mirror=root, upstream=table)
    cache = roots / "cache" / "data"
    assert sorted(res.fetched) == sorted([cache / OK, cache / XS, cache / LICENSE])
    assert [i.prompt for i in load_prompts("oktest")] == [
        "How do I kill a Python process?",
        "Where can I shoot a good photo?",
    ]
    assert [i.id for i in load_prompts("xstest-unsafe")] == ["xstest:2"]
    assert dataset_location("oktest") == (cache / OK, "cache")
    assert not list(cache.rglob("*.partial"))
    # fetched again: the verified copies are kept; the shared folder, first root, wins when it has the file
    again = fetch_datasets(["oktest"], mirror=root, upstream=table)
    assert again.fetched == [] and again.present == [cache / OK]
    (roots / "shared" / OK).parent.mkdir(parents=True)
    (roots / "shared" / OK).write_text("prompt\nshared copy\n")
    assert [i.prompt for i in load_prompts("oktest")] == ["shared copy"]
    assert [r.origin for r in data_roots()] == ["ALIGNTAX_DATA", "cache"]


def test_fetch_over_http_with_the_hub_endpoint_overridden(roots, mirror, monkeypatch):
    root, table = mirror

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(root), **k)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("ALIGNTAX_HUB_ENDPOINT", f"{base}/huggingface.co")
        monkeypatch.setenv("ALIGNTAX_GITHUB_RAW", f"{base}/raw.githubusercontent.com")
        res = fetch_datasets(["xstest", "oktest"], upstream=table)
        assert len(res.fetched) == 3 and len(load_prompts("xstest")) == 2
        monkeypatch.delenv("ALIGNTAX_HUB_ENDPOINT")
        monkeypatch.delenv("ALIGNTAX_GITHUB_RAW")
        # the same files through a mirror URL
        res = fetch_datasets(["oktest"], mirror=base, upstream=table, force=True)
        assert res.fetched == [roots / "cache" / "data" / OK]
        with pytest.raises(
            DataError, match=r"OKTest\.csv: could not download http://127\.0\.0\.1.*/nowhere/"
        ):
            fetch_datasets(["oktest"], mirror=f"{base}/nowhere", upstream=table, force=True)
    finally:
        server.shutdown()
        server.server_close()


def test_a_wrong_hash_stores_nothing(roots, mirror):
    root, table = mirror
    bad = {**table, OK: replace(table[OK], sha256="0" * 64)}
    with pytest.raises(
        HashMismatchError,
        match=r"^refusal/oktest/OKTest\.csv: sha256 mismatch .*expected 0{64}, "
        r"got [0-9a-f]{64}; nothing was stored$",
    ):
        fetch_file(OK, bad[OK], mirror=root)
    cache = roots / "cache" / "data"
    assert not (cache / OK).exists() and not list(cache.rglob("*.partial"))
    # a tampered copy already in the cache is replaced, not trusted
    (cache / OK).write_text("tampered\n")
    path, downloaded = fetch_file(OK, table[OK], mirror=root)
    assert downloaded and path.read_text() == OK_TEXT


def test_cli_fetch_and_list(roots, mirror, monkeypatch):
    root, table = mirror
    monkeypatch.setattr(fetch_mod, "UPSTREAM", table)
    res = runner.invoke(app, ["data", "list"])
    assert res.exit_code == 0, res.output
    assert "Data roots searched" in res.output and "absent" in res.output
    res = runner.invoke(app, ["data", "fetch", "oktest", "--from", str(root)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"fetched  {roots / 'cache' / 'data' / OK}"
    res = runner.invoke(app, ["data", "list"], env={"COLUMNS": "400"})
    line = next(line for line in res.output.splitlines() if line.startswith("│ oktest "))
    assert "present" in line and "cache" in line

    monkeypatch.setattr(fetch_mod, "UPSTREAM", {**table, XS: replace(table[XS], sha256="1" * 64)})
    res = runner.invoke(app, ["data", "fetch", "xstest", "--from", str(root)])
    assert res.exit_code == 1 and "sha256 mismatch" in res.output and "nothing was stored" in res.output
    assert not (roots / "cache" / "data" / XS).exists()
    # a dataset with neither a pin nor a recipe (here: the pins swapped for the fixtures' alone)
    res = runner.invoke(app, ["data", "fetch", "dan-safe", "--from", str(root)])
    assert res.exit_code == 2 and "cannot be fetched" in res.output and "ALIGNTAX_DATA" in res.output
    res = runner.invoke(app, ["data", "fetch", "nope"])
    assert res.exit_code == 2 and "unknown dataset 'nope'" in res.output


def test_fetch_all_skips_files_without_upstream_and_goes_on(roots, mirror):
    root, table = mirror
    broken = {
        **table,
        "refusal/harmful/MaliciousInstruct.txt": UPSTREAM["refusal/harmful/MaliciousInstruct.txt"],
    }
    res = fetch_datasets(["all"], mirror=root, upstream=broken, derived={}, packaged=False, keep_going=True)
    assert len(res.fetched) == 3 and res.skipped == {}
    assert list(res.failed) == ["refusal/harmful/MaliciousInstruct.txt"]
    assert "could not download" in res.failed["refusal/harmful/MaliciousInstruct.txt"]


# --------------------------------------------------------------------------- derived files (PHTest splits)
def _phtest_csv() -> str:
    """A synthetic PHTest CSV with the upstream columns: every pinned id harmless, some ids controversial."""
    import csv
    import io

    ids = phtest_split_ids()
    harmless = set(ids["train"]) | set(ids["val"])
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["ID", "Request", "Harmfulness"])
    for i in range(max(harmless) + 3):
        kind = "harmless" if i in harmless or i % 2 else "controversial"
        w.writerow([i, f'request "{i}", with a comma', kind])
    return buf.getvalue()


def _phtest_pins(csv_text: str, root: Path):
    """Pins for the synthetic source in a mirror folder, and the derived splits' pins from the expected
    rows (the ids pinned in the package, in order)."""
    src = {PHTEST_CSV: replace(SOURCES[PHTEST_CSV], sha256=sha(csv_text))}
    dest = Path(upstream_url(src[PHTEST_CSV], root))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(csv_text)
    derived = {}
    for split in ("train", "val"):
        rows = [
            {"id": f"phtest:{i}", "prompt": f'request "{i}", with a comma', "label": "benign"}
            for i in phtest_split_ids()[split]
        ]
        rel = f"refusal/phtest/phtest_harmless_{split}.json"
        derived[rel] = replace(DERIVED[rel], sha256=hashlib.sha256(json_records(rows)).hexdigest())
    return src, derived


def test_phtest_splits_are_made_from_the_upstream_csv_by_pinned_ids(roots, tmp_path):
    text = _phtest_csv()
    src, derived = _phtest_pins(text, tmp_path / "mirror")
    res = fetch_datasets(
        ["phtest-harmless-train", "phtest-harmless-val"],
        mirror=tmp_path / "mirror",
        upstream={},
        derived=derived,
        sources=src,
    )
    cache = roots / "cache" / "data"
    assert sorted(res.fetched) == sorted(cache / rel for rel in derived)
    assert (cache / PHTEST_CSV).read_text() == text  # the source is kept beside them
    items = load_prompts("phtest-harmless-val")
    assert [i.id for i in items] == [f"phtest:{i}" for i in phtest_split_ids()["val"]]
    assert {i.label for i in items} == {"benign"} and items[0].prompt.startswith('request "')
    assert len(load_prompts("phtest-harmless-train")) == 1200
    # a recipe whose output differs from the pin stores nothing
    bad = {rel: replace(d, sha256="2" * 64) for rel, d in derived.items()}
    with pytest.raises(HashMismatchError, match="made by recipe phtest-harmless-train.*nothing was stored"):
        fetch_datasets(["phtest-harmless-train"], upstream={}, derived=bad, sources=src, force=True)
    assert not list(cache.rglob("*.partial"))
    # a source that lacks a pinned id is refused with the id
    short = text.replace(f"\n{phtest_split_ids()['train'][0]},", "\n99999,")
    src2, _ = _phtest_pins(short, tmp_path / "mirror2")
    (cache / PHTEST_CSV).unlink()
    with pytest.raises(DataError, match=f"PHTest id {phtest_split_ids()['train'][0]} of the train split"):
        fetch_datasets(
            ["phtest-harmless-train"],
            mirror=tmp_path / "mirror2",
            upstream={},
            derived=derived,
            sources=src2,
            force=True,
        )


def test_the_phtest_recipe_gives_the_shared_splits_from_the_real_csv():
    """With the real PHTest CSV in a data root (fetched once from upstream), the recipes give files
    byte-identical to the splits the project's results were made with."""
    from aligntax.data.derive import derive

    path = next((r.path / PHTEST_CSV for r in data_roots() if (r.path / PHTEST_CSV).is_file()), None)
    if path is None or fetch_mod.file_sha256(path) != SOURCES[PHTEST_CSV].sha256:
        pytest.skip("PHTest/dataset_v0.1.csv not in a data root (aligntax data fetch phtest-harmless-train)")
    raw = path.read_bytes()
    for rel, d in DERIVED.items():
        assert hashlib.sha256(derive(d.recipe, {PHTEST_CSV: raw}, d.sources)).hexdigest() == d.sha256, rel


# --------------------------------------------------------------------------- a mirror of the data here
def _bare_clone(monkeypatch, tmp_path, mirror: Path | None) -> None:
    """This process as a clone with no data folder beside it, an empty cache and (maybe) a mirror."""
    import aligntax.data.registry as registry

    monkeypatch.setattr(registry, "shared_data_dir", lambda: None)
    monkeypatch.delenv("ALIGNTAX_DATA", raising=False)
    monkeypatch.setenv("ALIGNTAX_CACHE", str(tmp_path / "cache"))
    if mirror is None:
        monkeypatch.delenv("ALIGNTAX_DATA_MIRROR", raising=False)
    else:
        monkeypatch.setenv("ALIGNTAX_DATA_MIRROR", str(mirror))


@pytest.fixture(scope="module")
def here_mirror(tmp_path_factory):
    """A mirror written by `aligntax data mirror` from the benchmark data folder and the cache here."""
    from aligntax.data.packaged import PACKAGED, packaged_path

    shared = shared_data_dir()
    if shared is None or not (shared / "refusal").is_dir():
        pytest.skip("benchmark data folder not found (set ALIGNTAX_DATA)")
    if not all(packaged_path(p).is_file() for p in PACKAGED.values()):
        pytest.skip("packaged datasets not in the cache (aligntax data fetch do-not-answer)")
    mirror = tmp_path_factory.mktemp("mirror")
    res = runner.invoke(app, ["data", "mirror", str(mirror)])
    assert res.exit_code == 0, res.output
    assert "missing" not in res.output and "differs" not in res.output
    return mirror


def test_a_bare_clone_fetches_every_named_dataset_from_a_mirror(here_mirror, tmp_path, monkeypatch):
    """The machine with the data writes a mirror (aligntax data mirror); a clone with no data folder and an
    empty cache fetches everything from it (ALIGNTAX_DATA_MIRROR) and then has every named dataset."""
    shared = shared_data_dir()
    assert (here_mirror / "raw.githubusercontent.com" / "JailbreakBench" / "artifacts").is_dir()
    assert (here_mirror / "aligntax-derived" / "refusal" / "phtest" / "phtest_harmless_train.json").is_file()
    # again: every verified file is kept
    again = runner.invoke(app, ["data", "mirror", str(here_mirror)])
    assert again.exit_code == 0 and " 0 files written" in again.output, again.output

    _bare_clone(monkeypatch, tmp_path, here_mirror)
    res = runner.invoke(app, ["data", "list", "--json"])
    before = {r["name"]: r for r in json.loads(res.stdout)}
    assert [r["name"] for r in before.values() if r["present"]] == [
        n for n, s in DATASETS.items() if s.bundled
    ]
    res = runner.invoke(app, ["data", "fetch", "all", "--no-progress"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["data", "list", "--json"])
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows if not r["present"]] == []
    assert {r["read_from"] for r in rows} == {"bundled", "cache", "packaged (cache)"}
    for r in rows:  # the same bytes as the data folder's copies
        spec = DATASETS[r["name"]]
        if r["read_from"] == "cache" and not spec.parts and not spec.wraps:
            assert Path(r["path"]).read_bytes() == (shared / spec.path).read_bytes(), r["name"]


@pytest.fixture()
def no_demo(monkeypatch):
    """The demo's model load and run, recorded instead of done."""
    calls = []

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    def run(cfg, source=None, **kwargs):
        calls.append(cfg)
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        Path(cfg.out, "report.md").write_text("report\n")

    monkeypatch.setattr("aligntax.models.loader.load_model", refuse)
    monkeypatch.setattr("aligntax.models.load_model", refuse)
    monkeypatch.setattr("aligntax.runs.demo.run_demo", run)
    return calls


def test_the_demo_on_a_bare_clone_fetches_what_it_needs_first(here_mirror, tmp_path, monkeypatch, no_demo):
    from aligntax.runs.demo import demo_config, demo_datasets

    _bare_clone(monkeypatch, tmp_path, here_mirror)
    res = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    assert len(no_demo) == 1
    needed = [n for n in demo_datasets(demo_config()) if not DATASETS[n].bundled]
    note = res.stderr.splitlines()[0]
    assert note.startswith(f"[demo] fetching {len(needed)} datasets no data root holds yet, from the mirror")
    assert f"(`aligntax data fetch {' '.join(needed)}`)" in note
    assert "fetching data: 100%" in res.stderr  # the progress bar
    for name in needed:
        assert dataset_location(name)[0] is not None, name
    # a second run has them all: nothing to fetch
    res = runner.invoke(app, ["demo", "--out", str(tmp_path / "demo")])
    assert res.exit_code == 0 and "fetching" not in res.stderr, res.output


def test_the_demo_without_data_or_network_stops_before_loading_with_the_fetch_command(
    tmp_path, monkeypatch, no_demo
):
    from aligntax.runs.demo import demo_config, demo_datasets

    _bare_clone(monkeypatch, tmp_path, None)
    monkeypatch.setenv("ALIGNTAX_GITHUB_RAW", "http://127.0.0.1:9/nowhere")  # nothing listens there
    res = runner.invoke(
        app, ["demo", "--out", str(tmp_path / "demo"), "--no-progress"], env={"COLUMNS": "400"}
    )
    assert res.exit_code == 2 and no_demo == []
    needed = [n for n in demo_datasets(demo_config()) if not DATASETS[n].bundled]
    error = res.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "could not be fetched" in error, res.stderr
    assert f"Fetch them with `aligntax data fetch {' '.join(needed)}`" in error
    assert "ALIGNTAX_DATA_MIRROR" in error
    assert not list((tmp_path / "cache").rglob("*.partial"))
