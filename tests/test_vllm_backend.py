"""The vLLM backend against the Hugging Face backend on a tiny random Qwen2 model saved as a real model
folder (float32): the same greedy tokens unsteered and steered (refusal-add, refusal-ablation, CAST,
ELS with horizon and row energy decision), mixed steered and plain requests in one batch, chunked
prefill (a token budget smaller than every prompt), requests arriving and finishing mid-batch, strength
0 equal to plain, and no request's steering touching another's tokens.

Runs in ``.venv-vllm`` (``./run setup-vllm``): ``.venv-vllm/bin/python -m pytest tests/test_vllm_backend.py``;
skipped where vLLM is not installed."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # the engine in this process: one start per module
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from aligntax.generation import GenerationConfig, generate  # noqa: E402
from tiny import PROMPTS, run_steered, save_tiny_bank, save_tiny_vectors, tiny_model, tiny_tokenizer  # noqa: E402

BUDGET = 7  # tokens per engine step: every prompt below is longer, so its prefill is chunked
MORE = PROMPTS + [
    "Write a haiku about rain.",
    "What is 2 + 2?",
    "Explain TCP in one line.",
    "How to make a bomb?",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from aligntax.models import load_model

    d = tmp_path_factory.mktemp("tiny-vllm")
    model = tiny_model("qwen2", hidden=128, layers=3, num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(d / "model")
    tiny_tokenizer().save_pretrained(d / "model")
    lm = load_model(str(d / "model"), dtype="fp32")
    save_tiny_vectors(lm, d / "vectors")
    save_tiny_bank(lm, d / "els")
    return d


@pytest.fixture(scope="module")
def lm(tiny_dir):
    from aligntax.models import load_model

    return load_model(str(tiny_dir / "model"), dtype="fp32")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from aligntax.backends.vllm.engine import VllmModel, VllmOptions

    eng = VllmModel(
        str(tiny_dir / "model"),
        dtype="fp32",
        options=VllmOptions(max_model_len=256, max_num_seqs=3, max_num_batched_tokens=BUDGET, kv_cache_gib=1),
    )
    return eng


# The HF reference decodes with ``model.generate`` (drop_finished=False), the plainest Hugging Face path.
CFG = GenerationConfig(max_new_tokens=8, batch_size=8, drop_finished=False)


def _tokens(gens):
    return [(g.response, g.n_tokens, g.finish_reason) for g in gens]


def _register(engine, lm, tiny_dir, name):
    """Register preset ``name`` in the engine and build the same intervention for the HF backend."""
    from aligntax.api import load_intervention

    options = {
        "add": ("vectors", {"name": "refusal-add", "coeff": 4.0}),
        "abl": ("vectors", {"name": "refusal-ablation"}),
        "cast": ("vectors", {"name": "cast", "threshold": 0.0}),
        "els": (
            "els",
            {"eta": 2.0, "steps": 2, "horizon": 3, "layers": [1, 2], "gate": "none", "row_threshold": "none"},
        ),
    }[name]
    folder, opts = options
    engine.register(name, str(tiny_dir / folder), **opts)
    return load_intervention(str(tiny_dir / folder), lm, **opts)


def test_prompts_are_chunked(engine):
    _, ids = engine.encode(MORE)
    assert min(len(x) for x in ids) > BUDGET  # every prefill below spans several engine steps


def test_unsteered_equals_hf(engine, lm):
    hf = generate(lm, MORE, CFG, progress=False)
    vl, decided = engine.generate(MORE, CFG)
    assert _tokens(vl) == _tokens(hf)
    assert decided == [None] * len(MORE)
    assert [g.n_prompt_tokens for g in vl] == [g.n_prompt_tokens for g in hf]


@pytest.mark.parametrize("name", ["add", "abl", "cast", "els"])
def test_steered_equals_hf(engine, lm, tiny_dir, name):
    iv = _register(engine, lm, tiny_dir, name)
    hf = generate(lm, MORE, CFG, iv, progress=False)
    vl, _ = engine.generate(MORE, CFG, steer=name)
    assert _tokens(vl) == _tokens(hf)
    plain = generate(lm, MORE, CFG, progress=False)
    assert _tokens(hf) != _tokens(plain)  # the setting changes answers, so equality is not vacuous


def _row_energies(lm, iv, prompts):
    """The energy of each prompt's last token entering the first steered block, from the model's own
    hidden states (one unpadded forward per prompt)."""
    out = []
    for p in prompts:
        text = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([lm.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            states = lm.model(ids, output_hidden_states=True).hidden_states
        kernel = iv.kernel(lm.num_layers)
        out.append(float(kernel.row_energy(states[kernel.first_layer][:, -1])))
    return out


def test_els_row_decision_equals_hf(engine, lm, tiny_dir):
    from aligntax.api import load_intervention

    base = {"eta": 2.0, "steps": 2, "horizon": 4, "layers": [1, 2], "gate": "none"}
    energy = _row_energies(lm, load_intervention(str(tiny_dir / "els"), lm, **base), MORE)
    ranked = sorted(energy)
    thr = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2  # half the rows pass
    opts = {**base, "row_threshold": thr}
    engine.register("els-row", str(tiny_dir / "els"), **opts)
    iv = load_intervention(str(tiny_dir / "els"), lm, **opts)
    hf = generate(lm, MORE, CFG, iv, progress=False)
    vl, decided = engine.generate(MORE, CFG, steer="els-row")
    assert _tokens(vl) == _tokens(hf)
    assert [d["strength"] > 0 for d in decided] == [e > thr for e in energy]
    assert [d["parts"]["els_row_energy"] for d in decided] == [float(e > thr) for e in energy]


def test_els_surprisal_domain_equals_hf(engine, lm, tiny_dir):
    """The prompt-surprisal domain: the engine scores each steered prompt from its own prompt
    log-probabilities (the hooks' score on the Hugging Face side) and sends it with the request; with the
    cut-off at the median, the rows above it run unsteered, the rest steered, token for token as the Hugging
    Face backend (whose hooks score it in a nested forward), and the decision records say which."""
    from aligntax.activations.decisions import prompt_surprisal
    from aligntax.api import load_intervention
    from aligntax.surprisal import template_span

    nll = prompt_surprisal(lm, MORE)
    vl_nll = engine.prompt_nll(engine.encode(MORE)[1], template_span(lm.tokenizer))
    assert vl_nll == pytest.approx(nll, abs=1e-3)
    ranked = sorted(nll)
    cut = (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2]) / 2
    opts = {"eta": 2.0, "steps": 2, "horizon": 4, "layers": [1, 2], "gate": "none", "row_threshold": "none"}
    engine.register("els-nll", str(tiny_dir / "els"), max_prompt_surprisal=cut, **opts)
    iv = load_intervention(str(tiny_dir / "els"), lm, max_prompt_surprisal=cut, **opts)
    hf = generate(lm, MORE, CFG, iv, progress=False)
    vl, decided = engine.generate(MORE, CFG, steer="els-nll")
    assert _tokens(vl) == _tokens(hf)
    inside = [v <= cut for v in nll]
    assert 0 < sum(inside) < len(inside)
    assert [d["parts"]["els_domain"] for d in decided] == [float(x) for x in inside]
    assert [d["strength"] > 0 for d in decided] == inside
    plain = generate(lm, MORE, CFG, progress=False)
    free = generate(lm, MORE, CFG, load_intervention(str(tiny_dir / "els"), lm, **opts), progress=False)
    for g, p, f, x in zip(_tokens(hf), _tokens(plain), _tokens(free), inside, strict=True):
        assert g == (f if x else p)
    assert any(f != p for f, p, x in zip(_tokens(free), _tokens(plain), inside, strict=True) if x)
    assert not [e for e in engine.summary()["errors"] if "els-nll" in e or "prompt_nll" in e]


def test_mixed_batch_and_isolation(engine, lm, tiny_dir):
    """Steered and plain requests share every step; each gets its own backend's answer, and the edits
    touch exactly a steered request's last prompt token and first H generated tokens at each site."""
    iv = _register(engine, lm, tiny_dir, "els")
    hf_steered = generate(lm, MORE, CFG, iv, progress=False)
    hf_plain = generate(lm, MORE, CFG, progress=False)
    rows = [i % 2 == 0 for i in range(len(MORE))]
    engine.trace(True)
    vl, _ = engine.generate(MORE, CFG, steer="els", steer_rows=rows)
    trace = engine.trace(False)
    want = [s if r else p for s, p, r in zip(_tokens(hf_steered), _tokens(hf_plain), rows, strict=True)]
    assert _tokens(vl) == want
    _, ids = engine.encode(MORE)
    by_req: dict[str, set] = {}
    for rid, pos, layer, where in trace:
        by_req.setdefault(rid, set()).add((pos, layer, where))
    assert len(by_req) == sum(rows)  # only the steered requests were touched
    lens = sorted(len(x) for x, r in zip(ids, rows, strict=True) if r)
    got = sorted(min(p for p, _, _ in s) + 1 for s in by_req.values())
    assert got == lens  # the first edited position is each steered request's last prompt token
    for s in by_req.values():
        first = min(p for p, _, _ in s)
        assert s == {(first + k, layer, "pre") for k in range(4) for layer in (1, 2)}  # horizon 3


def test_strength_zero_is_plain(engine, lm, tiny_dir):
    _register(engine, lm, tiny_dir, "add")
    engine.trace(True)
    vl, decided = engine.generate(MORE, CFG, steer="add", strengths=[0.0] * len(MORE))
    assert engine.trace(False) == []
    assert _tokens(vl) == _tokens(generate(lm, MORE, CFG, progress=False))
    assert decided == [None] * len(MORE)


def test_arrive_and_finish_mid_batch(engine, lm, tiny_dir):
    """Requests of different lengths through 3 sequence slots: they join as others finish; each one's
    tokens are the prefix of its own HF answer (greedy), steered or plain."""
    from vllm import SamplingParams

    from aligntax.backends.vllm.steering import EXTRA_STEER, EXTRA_STRENGTH

    iv = _register(engine, lm, tiny_dir, "add")
    _, ids = engine.encode(MORE)
    steered = [i % 3 != 1 for i in range(len(MORE))]
    hf_s = run_steered(lm, MORE, iv, max_new_tokens=12)[0].tolist()
    hf_p = run_steered(lm, MORE, None, max_new_tokens=12)[0].tolist()
    lengths = [3 + (5 * i) % 10 for i in range(len(MORE))]
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=0.0,
            ignore_eos=True,
            extra_args={EXTRA_STEER: "add", EXTRA_STRENGTH: 1.0} if s else None,
        )
        for n, s in zip(lengths, steered, strict=True)
    ]
    prompts = [
        {"prompt_token_ids": x, **({"cache_salt": "add"} if s else {})}
        for x, s in zip(ids, steered, strict=True)
    ]
    outs = engine.llm.generate(prompts, params, use_tqdm=False)
    for out, n, s, a, b in zip(outs, lengths, steered, hf_s, hf_p, strict=True):
        assert list(out.outputs[0].token_ids) == (a if s else b)[:n]
    assert engine.summary()["live"] == 0  # every finished request's state is freed


def test_unknown_preset_and_bad_strength_are_refused(engine):
    from aligntax.backends.vllm.steering import parse_request
    from aligntax.errors import AligntaxError

    with pytest.raises(AligntaxError, match="Unknown steering preset"):
        engine.generate(["hi"], CFG, steer="nope")
    with pytest.raises(AligntaxError, match="must lie in"):
        parse_request({"aligntax_steer": "add", "aligntax_strength": float("nan")}, {"add"})
    with pytest.raises(AligntaxError, match="must lie in"):
        parse_request({"aligntax_steer": "add", "aligntax_strength": -1}, {"add"})
    with pytest.raises(AligntaxError, match="Unknown steering preset"):
        parse_request({"aligntax_steer": "other"}, {"add"})


def test_no_steering_errors(engine):
    assert engine.summary()["errors"] == []


def test_eval_records_the_per_row_decisions_of_the_hf_backend(engine, lm, tiny_dir, tmp_path):
    """``aligntax eval --backend vllm`` with a method that decides per row (CAST's condition): every
    sample records the decision made before generating (on a Hugging Face copy of the model), equal to
    the Hugging Face backend's run, and the answers are the same (fp32)."""
    import json

    from aligntax.activations.decisions import row_info
    from aligntax.runs import EvalConfig, run_eval
    from aligntax.runs.jsonl import read_jsonl

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": str(i), "prompt": p, "label": "benign"}) + "\n" for i, p in enumerate(MORE))
    )
    args = {"path": str(tiny_dir / "vectors"), "threshold": 0.0}

    def run(backend: str, model):
        cfg = EvalConfig(
            data=[str(data)],
            out=str(tmp_path / backend),
            model=str(tiny_dir / "model"),
            dtype="fp32",
            judge="keyword",
            max_new_tokens=8,
            batch_size=3,
            backend=backend,
            progress=False,
            intervention="cast",
            intervention_args=args,
        )
        run_eval(cfg, lm=model)
        return {r["id"]: r for r in read_jsonl(tmp_path / backend / "samples.jsonl")}

    hf, vl = run("hf", lm), run("vllm", engine)
    from aligntax.api import load_intervention

    want = row_info(load_intervention(str(tiny_dir / "vectors"), lm, name="cast", threshold=0.0), lm, MORE)
    assert any(w["steered"] for w in want) and not all(w["steered"] for w in want)
    for i, w in enumerate(want):
        got = vl[str(i)]["steering"]
        assert {k: got[k] for k in w} == w == hf[str(i)]["steering"]
        assert got["engine_strength"] == w["strength"]  # the engine decided as the prefill did
        assert vl[str(i)]["response"] == hf[str(i)]["response"]
