"""Steering bundles: save_pretrained / from_pretrained round trips steer to the same greedy tokens (tiny
random models, fp32; ELS with a harm gate and a tuned setting, vector methods), the folder holds
safetensors / JSON / Markdown only, the card carries the rates a real evaluation run measured, and
push_to_hub / Hub downloads go through HfApi and snapshot_download (stood in for by local copies)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import aligntax
from aligntax.activations import capture
from aligntax.activations.decisions import unsteered_rows
from aligntax.bundles import check_files, from_pretrained, load_bundle, push_to_hub, save_pretrained
from aligntax.bundles.card import read_front_matter
from aligntax.errors import AligntaxError, CompatibilityError, DataError
from aligntax.interventions import make_intervention
from tiny import PROMPTS, save_tiny_adapter, save_tiny_bank, save_tiny_vectors, tiny_lm

H = 32
N = 6

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


@pytest.fixture(scope="module")
def els_dir(lm, tmp_path_factory):
    """An ELS folder: energy bank, a harm gate that holds back some prompts but not all, a tuned setting."""
    from aligntax.energy.gate import HarmGate

    d = save_tiny_bank(lm, tmp_path_factory.mktemp("els"), n=16, epochs=2)
    h = capture(lm, PROMPTS, [1], progress=False)[1]
    torch.manual_seed(3)
    w = torch.randn(1, H)
    mu, sc = h.mean(0, keepdim=True), h.std(0, keepdim=True)
    s = (((h[:, None] - mu) / sc) * w).sum(-1).mean(-1).sort().values
    HarmGate([1], w, torch.full((1,), -float(s[1] + s[2]) / 2), mu, sc, fingerprint=lm.fingerprint).save(d)
    (d / "sweep").mkdir()
    (d / "sweep" / "best.json").write_text(
        json.dumps(
            {
                "best": {
                    "args": {
                        "layers": [1, 2],
                        "eta": 2.0,
                        "steps": 3,
                        "threshold": None,
                        "gate": True,
                        "horizon": 4,
                    }
                }
            }
        )
    )
    (d / "sweep" / "sweep.jsonl").write_text("{}\n")  # a sweep's other files stay behind
    return d


@pytest.fixture(scope="module")
def vector_dir(lm, tmp_path_factory):
    return save_tiny_vectors(lm, tmp_path_factory.mktemp("vectors"))


def hf_generate(lm, iv, prompts=PROMPTS):
    tok = lm.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    batch = tok(texts, padding=True, padding_side="left", add_special_tokens=False, return_tensors="pt")
    with iv.apply(lm.model), torch.no_grad():
        out = lm.model.generate(
            **batch,
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[:, batch["input_ids"].shape[1] :]


def unsteered(lm):
    return hf_generate(lm, make_intervention("none"))


def test_els_bundle_round_trip_steers_the_same(lm, els_dir, tmp_path):
    src = make_intervention("els", lm, dir=str(els_dir))
    assert src.gate is not None and sorted(src.models) == [1, 2]
    out = save_pretrained(els_dir, tmp_path / "b")
    files = check_files(out)
    assert sorted(files) == [
        "README.md",
        "bundle.json",
        "energy.json",
        "energy.safetensors",
        "gate.json",
        "gate.safetensors",
        "sweep/best.json",
    ]
    back = from_pretrained(out, lm)
    want, got = hf_generate(lm, src), hf_generate(lm, back)
    assert torch.equal(want, got)
    assert not torch.equal(want, unsteered(lm))  # the steering does something on these prompts
    held = unsteered_rows(back, lm, PROMPTS)
    assert held == unsteered_rows(src, lm, PROMPTS) and any(held) and not all(held)  # the gate travelled
    # the same through the top-level loader and as a plain --steer folder
    assert torch.equal(hf_generate(lm, aligntax.load_intervention(str(out), lm)), want)
    assert torch.equal(hf_generate(lm, make_intervention("els", lm, dir=str(out))), want)
    card = read_front_matter((out / "README.md").read_text())
    assert card["library_name"] == "aligntax"
    assert card["aligntax"]["method"] == "els"
    assert card["aligntax"]["setting"]["eta"] == 2.0 and card["aligntax"]["setting"]["horizon"] == 4
    assert card["aligntax"]["base_model_fingerprint"] == lm.fingerprint
    assert card["aligntax"]["results"] == []


def test_els_bundle_with_a_given_setting(lm, els_dir, tmp_path):
    out = save_pretrained(els_dir, tmp_path / "b", eta=0.5, gate="none", horizon="none")
    src = make_intervention("els", lm, dir=str(els_dir), eta=0.5, gate="none", horizon="none")
    back = from_pretrained(out, lm)
    assert back.gate is None and back.eta == 0.5
    assert torch.equal(hf_generate(lm, back), hf_generate(lm, src))
    best = json.loads((out / "sweep" / "best.json").read_text())
    assert best["selected"] == "given when the bundle was saved"
    # an option at load time still overrides the bundle's setting
    assert from_pretrained(out, lm, eta=1.5).eta == 1.5


@pytest.mark.parametrize(
    "method,opts", [("refusal-ablation", {}), ("refusal-add", {"coeff": 6.0, "layer": 2}), ("cast", {})]
)
def test_vector_bundle_round_trip_steers_the_same(lm, vector_dir, tmp_path, method, opts):
    out = save_pretrained(vector_dir, tmp_path / "b", method=method, **opts)
    assert sorted(check_files(out)) == ["README.md", "bundle.json", "vectors.json", "vectors.safetensors"]
    src = make_intervention(method, lm, dir=str(vector_dir), **opts)
    back = aligntax.load_intervention(str(out), lm)
    assert back.config() == src.config()
    want = hf_generate(lm, src)
    assert torch.equal(hf_generate(lm, back), want)
    if method != "cast":  # CAST may leave every row of this batch alone
        assert not torch.equal(want, unsteered(lm))
    setting = load_bundle(out).setting
    assert setting.get("layer") == opts.get("layer", 1 if method != "cast" else None)


def test_bundle_refuses_other_files_and_models(lm, vector_dir, tmp_path):
    out = save_pretrained(vector_dir, tmp_path / "b", method="refusal-ablation")
    (out / "extra.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(DataError, match="extra.bin"):
        from_pretrained(out, lm)
    (out / "extra.bin").unlink()
    (out / "sub").mkdir()
    (out / "sub" / "state.pkl").write_bytes(b"x")
    with pytest.raises(DataError, match="sub/state.pkl"):
        load_bundle(out)
    shutil.rmtree(out / "sub")
    other = tiny_lm("qwen2", hidden=H, layers=3, seed=7)
    with pytest.raises(CompatibilityError):
        from_pretrained(out, other)
    with pytest.raises(AligntaxError, match="not empty"):
        save_pretrained(vector_dir, out, method="refusal-ablation")
    with pytest.raises(AligntaxError, match="no energy bank"):
        save_pretrained(vector_dir, tmp_path / "c")
    with pytest.raises(DataError, match="not a steering bundle"):
        load_bundle(vector_dir)


def _eval(lm, out, data, intervention=None, args=None):
    from aligntax.judges import get_judge
    from aligntax.runs import EvalConfig, run_eval

    cfg = EvalConfig(
        data=[str(data)],
        out=str(out),
        judge="keyword",
        max_new_tokens=4,
        progress=False,
        intervention=intervention,
        intervention_args=args or {},
    )
    return run_eval(cfg, lm=lm, judge=get_judge("keyword"))


def test_card_carries_the_rates_the_runs_measured(lm, vector_dir, els_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": p, "label": "benign" if i % 2 else "harmful"} for i, p in enumerate(PROMPTS * 2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = _eval(lm, tmp_path / "base", data)
    steered = _eval(lm, tmp_path / "abl", data, "refusal-ablation", {"path": str(vector_dir)})
    out = save_pretrained(
        vector_dir, tmp_path / "b", method="refusal-ablation", results=[tmp_path / "base", tmp_path / "abl"]
    )
    card = read_front_matter((out / "README.md").read_text())
    runs = {r["run"]: r for r in card["aligntax"]["results"]}
    assert runs["abl"]["intervention"] == "refusal-ablation" and runs["base"]["intervention"] == "none"
    for name, res in (("base", base), ("abl", steered)):
        for label in ("benign", "harmful"):
            assert runs[name]["overall"][label] == {k: res[label][k] for k in runs[name]["overall"][label]}
            assert runs[name]["overall"][label]["ci95"] == res[label]["ci95"]
    assert runs["abl"]["overall"]["harmful"]["refusal_rate"] == steered["harmful"]["refusal_rate"]
    text = (out / "README.md").read_text()
    rate = steered["harmful"]["refusal_rate"]
    assert f"| abl | refusal-ablation | prompts | harmful: refusal | 4 | {100 * rate:.1f} |" in text
    # a run of another setting, another method or another folder is refused
    _eval(lm, tmp_path / "abl-half", data, "refusal-ablation", {"path": str(vector_dir), "coeff": 0.5})
    with pytest.raises(AligntaxError, match="another setting"):
        save_pretrained(
            vector_dir, tmp_path / "c", method="refusal-ablation", results=[tmp_path / "abl-half"]
        )
    with pytest.raises(AligntaxError, match="not this bundle's"):
        save_pretrained(vector_dir, tmp_path / "d", method="refusal-add", results=[tmp_path / "abl"])
    other = save_tiny_vectors(lm, tmp_path / "other-vectors")
    (other / "vectors.json").write_text(
        (other / "vectors.json").read_text().replace('"layer": 1', '"layer": 2')
    )
    with pytest.raises(AligntaxError, match="another steering folder"):
        save_pretrained(other, tmp_path / "e", method="refusal-ablation", layer=1, results=[tmp_path / "abl"])
    with pytest.raises(AligntaxError, match="another model"):
        save_pretrained(els_dir, tmp_path / "f", results=[_other_model_run(tmp_path, data)])


def test_els_lora_bundle_carries_its_rates_and_steers_the_same(lm, tmp_path):
    adapter = save_tiny_adapter(lm, tmp_path / "adapter")
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": p, "label": "benign" if i % 2 else "harmful"} for i, p in enumerate(PROMPTS * 2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _eval(lm, tmp_path / "base", data)
    lora = _eval(lm, tmp_path / "lora", data, "els-lora", {"path": str(adapter), "scale": 0.5})
    out = save_pretrained(adapter, tmp_path / "b", results=[tmp_path / "base", tmp_path / "lora"], scale=0.5)
    b = load_bundle(out)
    assert b.method == "els-lora" and b.setting == {"scale": 0.5}
    assert {"adapter_config.json", "adapter_model.safetensors", "els_lora.json"} <= set(b.manifest["files"])
    assert b.manifest["base_model"]["fingerprint"]["embedding_digest"] == lm.fingerprint["embedding_digest"]
    assert b.manifest["training_data"]["distillation"]["layers"] == [1, 2]
    card = (out / "README.md").read_text()
    rate = lora["harmful"]["refusal_rate"]
    assert f"| lora | els-lora | prompts | harmful: refusal | 4 | {100 * rate:.1f} |" in card
    assert "--format gguf --out merged.gguf" in card and "LoRA adapter distilled" in card
    runs = {r["run"]: r for r in read_front_matter(card)["aligntax"]["results"]}
    assert runs["lora"]["overall"]["harmful"]["refusal_rate"] == rate
    # the bundle steers as the adapter at that scale, from the folder, by name and through --steer
    src = make_intervention("els-lora", lm, dir=str(adapter), scale=0.5)
    for iv in (from_pretrained(out, lm), aligntax.load_intervention(str(out), lm)):
        assert iv.name == "els-lora" and iv.scale == 0.5
        assert torch.equal(hf_generate(lm, iv), hf_generate(lm, src))
    assert not torch.equal(hf_generate(lm, src), unsteered(lm))
    with pytest.raises(AligntaxError, match="another setting"):  # a run at another scale
        save_pretrained(adapter, tmp_path / "c", results=[tmp_path / "lora"], scale=1.0)
    with pytest.raises(AligntaxError, match="not vectors"):
        from_pretrained(out, lm, name="refusal-add")
    from aligntax import cli

    res = CliRunner().invoke(
        cli.app, ["bundle", "save", str(adapter), "--out", str(tmp_path / "d"), "--set", "scale=0.5"]
    )
    assert res.exit_code == 0, res.output
    assert load_bundle(tmp_path / "d").method == "els-lora"


def _other_model_run(tmp_path, data):
    other = tiny_lm("llama", hidden=H, layers=3)
    _eval(other, tmp_path / "other-model", data)
    return tmp_path / "other-model"


class _LocalHub:
    """Stands in for the Hub: create_repo records the repository, upload_folder copies the files its
    allow patterns select, snapshot_download returns the stored copy (filtered the same way)."""

    def __init__(self, root: Path):
        self.root, self.created, self.uploads = root, [], []

    def install(self, monkeypatch):
        import huggingface_hub

        hub = self

        def create_repo(api, repo_id, *, token=None, private=None, repo_type=None, exist_ok=False, **kw):
            hub.created.append(
                {"repo_id": repo_id, "private": private, "repo_type": repo_type, "exist_ok": exist_ok}
            )
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(
            api, *, repo_id, folder_path, allow_patterns=None, repo_type=None, commit_message=None, **kw
        ):
            files = hub._select(Path(folder_path), allow_patterns)
            dest = hub.root / repo_id
            for f in files:
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(folder_path) / f, dest / f)
            hub.uploads.append({"repo_id": repo_id, "files": files, "message": commit_message})
            return f"https://huggingface.co/{repo_id}/commit/local"

        def snapshot_download(repo_id, *, allow_patterns=None, **kw):
            src = hub.root / repo_id
            if not src.is_dir():
                raise OSError(f"Repository Not Found for url: https://huggingface.co/{repo_id}")
            dest = hub.root.parent / "snapshots" / repo_id
            for f in hub._select(src, allow_patterns):
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / f, dest / f)
            return str(dest)

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

    @staticmethod
    def _select(folder: Path, patterns) -> list[str]:
        from fnmatch import fnmatch

        out = []
        for p in sorted(folder.rglob("*")):
            rel = p.relative_to(folder).as_posix()
            if p.is_file() and (patterns is None or any(fnmatch(rel, pat) for pat in patterns)):
                out.append(rel)
        return out


def test_push_to_hub_and_load_by_hub_id(lm, els_dir, tmp_path, monkeypatch):
    hub = _LocalHub(tmp_path / "hub")
    hub.install(monkeypatch)
    out = save_pretrained(els_dir, tmp_path / "b")
    (out / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="notes.txt"):
        push_to_hub(out, "someone/els-tiny")
    assert hub.created == [] and hub.uploads == []
    (out / "notes.txt").unlink()
    push_to_hub(out, "someone/els-tiny", private=True)
    assert hub.created == [
        {"repo_id": "someone/els-tiny", "private": True, "repo_type": "model", "exist_ok": True}
    ]
    assert hub.uploads[0]["files"] == sorted(check_files(out))
    assert (
        'load_intervention("someone/els-tiny", lm)' in (hub.root / "someone/els-tiny/README.md").read_text()
    )
    src = make_intervention("els", lm, dir=str(els_dir))
    assert torch.equal(
        hf_generate(lm, aligntax.load_intervention("someone/els-tiny", lm)), hf_generate(lm, src)
    )
    with pytest.raises(AligntaxError, match="Could not download"):
        from_pretrained("someone/missing", lm)


def test_cli_bundle_save_push_pull(lm, vector_dir, tmp_path, monkeypatch):
    from aligntax.cli import app

    hub = _LocalHub(tmp_path / "hub")
    hub.install(monkeypatch)
    runner = CliRunner()
    res = runner.invoke(
        app,
        [
            "bundle",
            "save",
            str(vector_dir),
            "--out",
            str(tmp_path / "b"),
            "--method",
            "refusal-add",
            "--set",
            "coeff=4",
            "--set",
            "layer=2",
        ],
    )
    assert res.exit_code == 0, res.output
    assert load_bundle(tmp_path / "b").setting == {"layer": 2, "coeff": 4}
    res = runner.invoke(
        app, ["bundle", "push", str(tmp_path / "b"), "--repo-id", "someone/add", "--no-private"]
    )
    assert res.exit_code == 0, res.output
    assert hub.created[0]["private"] is False
    res = runner.invoke(app, ["bundle", "pull", "someone/add", "--out", str(tmp_path / "pulled")])
    assert res.exit_code == 0, res.output
    back = from_pretrained(res.output.strip().splitlines()[-1], lm)
    src = make_intervention("refusal-add", lm, dir=str(vector_dir), coeff=4, layer=2)
    assert torch.equal(hf_generate(lm, back), hf_generate(lm, src))
    res = runner.invoke(app, ["bundle", "save", str(vector_dir), "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and "no energy bank" in res.output
