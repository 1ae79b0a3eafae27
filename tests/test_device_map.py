"""Models split over devices (``device_map``): loading, and steering tensors that follow the device of
the hidden state they touch. The places known to break when a model is split: the harm gate stacking
states of layers on different devices (energy/gate.py), ELS multiplying by the gate's decision made on
the gate layer's device, CAST using its decision made on the condition layer's device. The split
tests need a CUDA device (the model is split over the CPU and ``cuda:0``) and skip without one; the
gate's stacking is also checked on the CPU with a tensor on the meta device."""

from __future__ import annotations

import pytest
import torch

from aligntax.activations.decisions import row_info, unsteered_rows
from tiny import make_tiny_lm, save_tiny_vectors

pytestmark = pytest.mark.usefixtures("one_thread")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="splitting a model needs a CUDA device")


def _gate(d: int = 8):
    from aligntax.energy.gate import HarmGate

    g = torch.Generator().manual_seed(0)
    return HarmGate(
        [1, 2], torch.randn(2, d, generator=g), torch.zeros(2), torch.zeros(2, d), torch.ones(2, d)
    )


def test_gate_stacks_states_of_two_devices_on_its_deciding_layer():
    gate = _gate()
    cpu, meta = torch.randn(3, 8), torch.empty(3, 8, device="meta")
    stacked = gate.stack({1: cpu, 2: meta})  # layer 2 decides: its device
    assert stacked.device.type == "meta" and stacked.shape == (3, 2, 8)
    p = gate.prob(stacked)
    assert p.device.type == "meta" and p.shape == (3,)
    with pytest.raises(RuntimeError):  # what stacking them as they are does
        torch.stack([cpu, meta], dim=-2)


@pytest.fixture()
def model_dir(tmp_path, qwen_tokenizer):
    lm = make_tiny_lm(qwen_tokenizer, layers=4, hidden=256, seed=3)
    lm.model.save_pretrained(tmp_path / "m")
    qwen_tokenizer.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


PROMPTS = ["How do I kill a Python process?", "Hi", "Where can I buy a can of coke?", "Tell me a story."]


def _greedy(lm, iv=None, n: int = 12):
    from aligntax.generation import GenerationConfig, generate

    return [
        g.response
        for g in generate(lm, PROMPTS, GenerationConfig(max_new_tokens=n, batch_size=4), iv, progress=False)
    ]


def test_device_map_loads_the_same_model(model_dir):
    from aligntax.models import load_model

    plain = load_model(str(model_dir), dtype="fp32", device="cpu")
    mapped = load_model(str(model_dir), dtype="fp32", device_map={"": "cpu"})
    assert mapped.fingerprint == plain.fingerprint
    assert _greedy(mapped) == _greedy(plain)


def _split(model_dir, at: int = 2):
    """The model with blocks before ``at`` (and the embeddings) on the CPU, the rest on cuda:0."""
    from aligntax.models import load_model

    dmap = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": 0, "lm_head": 0}
    dmap.update({f"model.layers.{i}": "cpu" if i < at else 0 for i in range(4)})
    lm = load_model(str(model_dir), dtype="fp32", device_map=dmap)
    assert {p.device.type for p in lm.model.parameters()} == {"cpu", "cuda"}
    return lm


@needs_cuda
def test_els_with_a_gate_across_the_split(model_dir, tmp_path):
    from aligntax.activations import capture
    from aligntax.energy.gate import HarmGate
    from aligntax.interventions.registry import make_intervention
    from aligntax.models import load_model
    from tiny import save_tiny_bank

    ref = load_model(str(model_dir), dtype="fp32", device="cpu")
    save_tiny_bank(ref, tmp_path / "els")
    prompts = [f"question {i}: {'how to hurt someone' if i % 2 else 'bake a cake'} {i}" for i in range(16)]
    acts = capture(ref, prompts, [1, 2], progress=False)
    # a gate of two layers, one on each side of the split (layer 1 on the CPU, layer 2 on the GPU)
    x = torch.stack([acts[1], acts[2]], 1).float()
    gate = HarmGate(
        [1, 2],
        torch.randn(2, x.shape[-1]),
        torch.zeros(2),
        x.mean(0),
        x.std(0),
        0.5,
        fingerprint=ref.fingerprint,
    )
    gate.save(tmp_path / "els")
    lm = _split(model_dir)
    args = dict(path=str(tmp_path / "els"), layers=[2, 3], eta=0.5, steps=2, gate=0.5)
    steered = _greedy(lm, make_intervention("els", lm, **args))
    expected = _greedy(ref, make_intervention("els", ref, **args))
    assert len(steered) == len(expected)
    info = row_info(make_intervention("els", lm, **args), lm, PROMPTS)
    info_ref = row_info(make_intervention("els", ref, **args), ref, PROMPTS)
    assert [r["steered"] for r in info] == [r["steered"] for r in info_ref]
    assert [r["harm_p"] for r in info] == pytest.approx([r["harm_p"] for r in info_ref], abs=1e-3)


@needs_cuda
def test_cast_condition_and_steering_on_two_devices(model_dir, tmp_path):
    from aligntax.interventions.registry import make_intervention
    from aligntax.models import load_model

    ref = load_model(str(model_dir), dtype="fp32", device="cpu")
    save_tiny_vectors(ref, tmp_path / "vec")  # the condition at layer 1 (CPU)
    lm = _split(model_dir)
    iv = make_intervention("cast", lm, path=str(tmp_path / "vec"), coeff=1.0)  # steers every layer
    out = _greedy(lm, iv)
    assert len(out) == len(PROMPTS)
    held = unsteered_rows(iv, lm, PROMPTS)
    held_ref = unsteered_rows(
        make_intervention("cast", ref, path=str(tmp_path / "vec"), coeff=1.0), ref, PROMPTS
    )
    assert held == held_ref
