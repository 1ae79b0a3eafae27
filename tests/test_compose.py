"""ELS on top of an els-lora adapter (``els-compose``) on tiny random models: zero strength is the unsteered
model, the adapter's per-row gate leaves the rows it holds exactly unsteered and the others exactly as the
adapter alone steers them, batched equals unbatched and cached equals uncached, ELS decides on the adapted
model's states, and the records say which rows each part touched."""

from __future__ import annotations

import pytest
import torch

from aligntax.energy.gate import HarmGate
from aligntax.errors import AligntaxError
from aligntax.interventions.compose import ComposedSteering
from aligntax.interventions.lora import ElsLora
from aligntax.interventions.registry import make_intervention
from tiny import PROMPTS, hook_counts, run_steered, save_tiny_bank, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A tiny Qwen2 model (fp32), an ELS folder steering block 2 with a harm gate reading block 1 (random
    weights, so p(harmful) differs per prompt), and a LoRA adapter on blocks 1-2 with random weights."""
    from peft import LoraConfig, get_peft_model

    from aligntax.interventions.lora import FORMAT, SIDECAR
    from aligntax.runs.fsio import write_json_atomic

    lm = tiny_lm("qwen2", hidden=32, layers=4)
    root = tmp_path_factory.mktemp("compose")
    els = save_tiny_bank(lm, root / "els")
    h = lm.hidden_size
    g = torch.Generator().manual_seed(3)
    HarmGate(
        [1],
        torch.randn(1, h, generator=g),
        torch.zeros(1),
        torch.zeros(1, h),
        torch.ones(1, h),
        threshold=0.5,
        fingerprint=lm.fingerprint,
    ).save(els)
    torch.manual_seed(0)
    targets = [f"model.layers.{i}.self_attn.{m}" for i in (1, 2) for m in ("q_proj", "v_proj")]
    peft = get_peft_model(
        lm.model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    adapter = root / "adapter"
    peft.save_pretrained(str(adapter), safe_serialization=True)
    lm.model = peft.unload()  # the plain model back, unchanged
    write_json_atomic(
        adapter / SIDECAR,
        {"format": FORMAT, "fingerprint": dict(lm.fingerprint), "layers": [1, 2], "target_block": 2},
    )
    return lm, els, adapter


def _compose(lm, els, adapter, lora_gate=None, scale=1.0, **els_options):
    options = {
        "layers": [2],
        "eta": 2.0,
        "horizon": 3,
        "gate": "none",
        "row_threshold": "none",
        **els_options,
    }
    return ComposedSteering(
        make_intervention("els", lm, path=str(els), **options), ElsLora.load(adapter, lm, scale), lora_gate
    )


def _p_harmful(lm, iv, prompts):
    from aligntax.activations.decisions import row_info

    return [r["harm_p"] for r in row_info(iv, lm, prompts)]


def test_zero_strength_is_the_unsteered_model(parts):
    lm, els, adapter = parts
    before = hook_counts(lm.model)
    base = run_steered(lm, PROMPTS)
    iv = _compose(lm, els, adapter, scale=0.0, steps=0)
    toks, logits, _, _ = run_steered(lm, PROMPTS, iv)
    assert torch.equal(toks, base[0]) and torch.equal(logits, base[1])
    assert hook_counts(lm.model) == before


def test_the_adapter_gate_splits_rows_exactly(parts):
    """Rows the gate rates below ``lora_gate`` run exactly as unsteered, the others exactly as under the
    adapter alone (ELS held back everywhere by an unreachable row energy cut-off)."""
    lm, els, adapter = parts
    held_els = {"row_threshold": 1e9}
    probe = _compose(lm, els, adapter, lora_gate=0.0, gate=0.99, **held_els)
    p = _p_harmful(lm, probe, PROMPTS)
    cut = sorted(p)[len(p) // 2]
    on = [x >= cut for x in p]
    assert 0 < sum(on) < len(on)
    base = run_steered(lm, PROMPTS)
    alone = run_steered(lm, PROMPTS, ElsLora.load(adapter, lm))
    iv = _compose(lm, els, adapter, lora_gate=cut, gate=0.99, **held_els)
    toks, logits, _, _ = run_steered(lm, PROMPTS, iv)
    for i, acts in enumerate(on):
        want = alone if acts else base
        assert torch.equal(toks[i], want[0][i]) and torch.allclose(logits[i], want[1][i], atol=1e-5), i
    assert not torch.equal(alone[1], base[1])  # the adapter does change the rows it acts on
    from aligntax.activations.decisions import row_info, unsteered_rows

    records = row_info(iv, lm, PROMPTS)
    assert [r["adapter"] for r in records] == on and not any(r["els_steered"] for r in records)
    assert unsteered_rows(iv, lm, PROMPTS) == [not x for x in on]


def test_batched_equals_unbatched_and_cached_equals_uncached(parts):
    lm, els, adapter = parts
    probe = _compose(lm, els, adapter, lora_gate=0.0, gate=0.99)
    p = _p_harmful(lm, probe, PROMPTS)
    iv = _compose(lm, els, adapter, lora_gate=sorted(p)[len(p) // 2], gate=0.99)
    toks, logits, _, _ = run_steered(lm, PROMPTS, iv)
    toks_nc, logits_nc, _, _ = run_steered(lm, PROMPTS, iv, use_cache=False)
    assert torch.equal(toks, toks_nc) and torch.allclose(logits, logits_nc, atol=1e-4)
    for i, prompt in enumerate(PROMPTS):
        t1, l1, _, _ = run_steered(lm, [prompt], iv)
        assert torch.equal(t1[0], toks[i]) and torch.allclose(l1[0], logits[i], atol=1e-4), i


def test_els_decides_on_the_adapted_states(parts):
    """The row energy ELS decides by is read from the model with the adapter on (in the records, and
    in generation): a cut-off between the adapted and unadapted energies of a row flips its decision."""
    from aligntax.activations.decisions import row_info

    lm, els, adapter = parts
    plain = make_intervention(
        "els", lm, path=str(els), layers=[2], eta=2.0, horizon=3, gate="none", row_threshold=-1e9
    )
    unadapted = [r["energy"] for r in row_info(plain, lm, PROMPTS)]
    adapted = [r["energy"] for r in row_info(_compose(lm, els, adapter, row_threshold=-1e9), lm, PROMPTS)]
    assert all(abs(a - b) > 1e-4 for a, b in zip(adapted, unadapted, strict=True))
    i = max(range(len(PROMPTS)), key=lambda k: abs(adapted[k] - unadapted[k]))
    cut = (adapted[i] + unadapted[i]) / 2
    iv = _compose(lm, els, adapter, row_threshold=cut)
    record = row_info(iv, lm, [PROMPTS[i]])[0]
    assert record["els_steered"] == (adapted[i] > cut) != (unadapted[i] > cut)
    # generation decides the same way: ELS's move shows in the logits exactly when it steers the row
    adapter_only = _compose(lm, els, adapter, row_threshold=1e9)
    moved = not torch.equal(
        run_steered(lm, [PROMPTS[i]], iv)[1], run_steered(lm, [PROMPTS[i]], adapter_only)[1]
    )
    assert moved == record["els_steered"]


def test_apply_leaves_the_model_unchanged_and_options_are_checked(parts):
    lm, els, adapter = parts
    before = hook_counts(lm.model)
    iv = make_intervention(
        "els-compose", lm, path=str(els), adapter=str(adapter), layers=[2], gate=True, lora_gate=0.3
    )
    assert iv.config()["lora_gate"] == 0.3 and iv.config()["adapter"]["path"] == str(adapter)
    tok = lm.tokenizer
    batch = tok(
        [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for p in PROMPTS[:3]
        ],
        padding=True,
        padding_side="left",
        add_special_tokens=False,
        return_tensors="pt",
    )
    with iv.apply(lm.model), torch.no_grad():
        lm.model.generate(**batch, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert hook_counts(lm.model) == before
    with pytest.raises(AligntaxError, match="adapter="):
        make_intervention("els-compose", lm, path=str(els))
    with pytest.raises(AligntaxError, match="harm gate"):
        make_intervention("els-compose", lm, path=str(els), adapter=str(adapter), gate="none", lora_gate=0.3)
    assert not iv.kernel_only  # the vLLM backend refuses it (its adapter hooks are not a row kernel)


def test_a_selected_setting_is_what_steer_dir_applies(parts, tmp_path):
    """A folder's ``selection.json`` (the demo's choice) is applied exactly by ``--steer DIR`` and by
    ``load_intervention(DIR)``, options given beside it overriding it; its folders are relative, so the
    folder can move."""
    import shutil

    from aligntax import load_intervention
    from aligntax.cli.options import steering_options
    from aligntax.interventions.selection import read_selection, selection_record
    from aligntax.runs.fsio import write_json_atomic

    lm, els, adapter = parts
    demo = tmp_path / "demo"
    shutil.copytree(els, demo / "els")
    shutil.copytree(adapter, demo / "els-lora")
    args = {"path": str(demo / "els"), "adapter": str(demo / "els-lora"), "layers": [2], "lora_gate": 0.3}
    record = selection_record(demo, "els-compose", args, model="tiny", chosen_on="validation")
    assert record["args"]["path"] == "els" and record["args"]["adapter"] == "els-lora"
    write_json_atomic(demo / "selection.json", record)
    moved = tmp_path / "moved"
    demo.rename(moved)
    name, resolved, _ = read_selection(moved)
    assert name == "els-compose" and resolved["path"] == str(moved / "els")
    iv = load_intervention(moved, lm)
    assert (
        iv.name == "els-compose"
        and iv.lora_gate == 0.3
        and iv.config()["adapter"]["path"] == str(moved / "els-lora")
    )
    assert load_intervention(moved, lm, lora_gate=0.6).lora_gate == 0.6
    seen = {}

    @steering_options
    def command(intervention=None, iv_args=None, model=None, config=None):
        seen.update(name=intervention, args=iv_args)

    command(iv_steer=str(moved), iv_lora_gate="0.5")
    assert seen["name"] == "els-compose" and seen["args"]["lora_gate"] == 0.5
    assert seen["args"]["path"] == str(moved / "els") and seen["args"]["adapter"] == str(moved / "els-lora")
    shutil.rmtree(moved / "els-lora")
    with pytest.raises(AligntaxError, match="els-lora"):
        load_intervention(moved, lm)


def test_rows_leaving_the_batch_keep_their_adapter_choice(parts):
    """aligntax's own greedy loop drops finished rows from the batch: each row keeps the adapter choice
    made at its prompt (the same answers as with every row kept to the end, and as one prompt at a time)."""
    from aligntax.generation import GenerationConfig, generate
    from tiny import end_token_for_varied_lengths

    lm, els, adapter = parts
    probe = _compose(lm, els, adapter, lora_gate=0.0, gate=0.99)
    p = _p_harmful(lm, probe, PROMPTS)
    iv = _compose(lm, els, adapter, lora_gate=sorted(p)[len(p) // 2], gate=0.99)
    keep = GenerationConfig(max_new_tokens=12, batch_size=16, drop_finished=False)
    long = generate(lm, PROMPTS, keep, iv, progress=False)
    rows = [lm.tokenizer(g.response, add_special_tokens=False)["input_ids"] for g in long]
    eos = lm.model.generation_config.eos_token_id
    lm.model.generation_config.eos_token_id = end_token_for_varied_lengths(rows)
    try:
        kept = generate(lm, PROMPTS, keep, iv, progress=False)
        dropped = generate(
            lm, PROMPTS, GenerationConfig(max_new_tokens=12, batch_size=16), iv, progress=False
        )
        alone = [generate(lm, [q], keep, iv, progress=False)[0] for q in PROMPTS]
    finally:
        lm.model.generation_config.eos_token_id = eos
    assert [g.response for g in dropped] == [g.response for g in kept] == [g.response for g in alone]
    assert len({g.n_tokens for g in kept if g.finish_reason == "stop"}) >= 2


def test_prompts_longer_than_the_domain_are_held_back(parts):
    """``max_prompt_tokens``: ELS (and in a composition, the adapter too) leaves a row whose chat-templated
    prompt is longer than the limit exactly unsteered; the records give each row's prompt length, the same
    the generation hooks read from the position ids."""
    from aligntax.activations.capture import chat_ids
    from aligntax.activations.decisions import row_info, unsteered_rows

    lm, els, adapter = parts
    lengths = chat_ids(lm, PROMPTS)[1]
    cut = sorted(lengths)[len(lengths) // 2]
    short = [n <= cut for n in lengths]
    assert 0 < sum(short) < len(short)
    for build in (
        lambda **kw: make_intervention("els", lm, path=str(els), layers=[2], eta=2.0, horizon=3, **kw),
        lambda **kw: _compose(lm, els, adapter, **kw),
    ):
        iv = build(gate="none", row_threshold="none", max_prompt_tokens=cut)
        records = row_info(iv, lm, PROMPTS)
        assert [r["prompt_tokens"] for r in records] == lengths
        assert [r["steered"] for r in records] == short and unsteered_rows(iv, lm, PROMPTS) == [
            not s for s in short
        ]
        base = run_steered(lm, PROMPTS)
        free = run_steered(lm, PROMPTS, build(gate="none", row_threshold="none"))
        toks, logits, _, _ = run_steered(lm, PROMPTS, iv)
        for i, inside in enumerate(short):
            want = free if inside else base
            assert torch.allclose(logits[i], want[1][i], atol=1e-5), (i, inside)
        assert not torch.allclose(free[1], base[1])


def test_the_domain_limit_in_aligntax_generation(parts):
    """Through aligntax's own loop (shared prompt prefix computed once, finished rows dropped), rows longer
    than ``max_prompt_tokens`` answer as unsteered and the others as without the limit."""
    from aligntax.activations.capture import chat_ids
    from aligntax.generation import GenerationConfig, generate

    lm, els, adapter = parts
    lengths = chat_ids(lm, PROMPTS)[1]
    cut = sorted(lengths)[len(lengths) // 2]
    cfg = GenerationConfig(max_new_tokens=6, batch_size=16)
    opts = dict(layers=[2], eta=2.0, horizon=3, gate="none", row_threshold="none")
    base = [g.response for g in generate(lm, PROMPTS, cfg, progress=False)]
    free = [
        g.response
        for g in generate(
            lm, PROMPTS, cfg, make_intervention("els", lm, path=str(els), **opts), progress=False
        )
    ]
    held = make_intervention("els", lm, path=str(els), max_prompt_tokens=cut, **opts)
    got = [g.response for g in generate(lm, PROMPTS, cfg, held, progress=False)]
    assert got == [f if n <= cut else b for f, b, n in zip(free, base, lengths, strict=True)]
    assert free != base
