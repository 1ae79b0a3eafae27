"""Row kernels: the one position rule, and each method's kernel applied to rows lands exactly where the
Hugging Face adapter puts it."""

from __future__ import annotations

import itertools

import pytest
import torch

from aligntax.activations.decisions import row_info, unsteered_rows
from aligntax.interventions.base import SteerContext
from aligntax.interventions.els import EnergySteering
from aligntax.interventions.kernels import RowKernel, Site, edited, token_slice
from aligntax.interventions.registry import make_intervention
from tiny import PROMPTS, record_block_inputs, save_tiny_vectors, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")
H = 32


class _Rule(RowKernel):
    def __init__(self, positions, horizon, last):
        self.positions, self.horizon, self._last = positions, horizon, last

    def edits_last_prompt(self, site):
        return self._last


@pytest.mark.parametrize("positions", ["last_and_generated", "generated", "all"])
def test_token_slice_is_the_edited_rule_for_contiguous_positions(positions):
    for horizon, last, plen, start, seq in itertools.product(
        [None, 0, 1, 3], [True, False], [1, 2, 5], range(0, 9), [1, 2, 6]
    ):
        k = _Rule(positions, horizon, last)
        sl = token_slice(seq, start, plen, k, Site(0))
        want = [i for i in range(seq) if edited(start + i, plen, k, Site(0))]
        assert list(range(seq))[sl] == want, (horizon, last, plen, start, seq)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("qwen2", hidden=H, layers=3)


@pytest.fixture(scope="module")
def vector_dir(lm, tmp_path_factory):
    return save_tiny_vectors(lm, tmp_path_factory.mktemp("vec"))


def _els(lm, **kw):
    from aligntax.energy.model import EnergyModel

    torch.manual_seed(1)
    models = {1: EnergyModel(H, [32, 16]), 2: EnergyModel(H, [32, 16])}
    return EnergySteering(models, eta=2.0, steps=3, scale_by_norm=False, **kw)


def _prompt_batch(lm):
    from aligntax.generation.chat import build_messages, encode_chats, render_chat

    texts = [render_chat(lm.tokenizer, build_messages(p)) for p in PROMPTS]
    return encode_chats(lm.tokenizer, texts, lm.device)


@pytest.mark.parametrize("name", ["els", "els-row", "refusal-add", "refusal-ablation", "cast"])
def test_kernel_rows_equal_the_adapter_at_the_first_site(lm, vector_dir, name):
    """A prefill forward with the intervention attached: the states entering the block after the first
    edited site equal the kernel's ``edit`` applied by hand to the unsteered rows that :func:`edited`
    selects, with the strength :meth:`RowKernel.decide` gives."""
    if name == "els":
        iv = _els(lm)
    elif name == "els-row":
        iv = _els(lm, row_threshold=0.0)
    else:
        iv = make_intervention(name, lm, dir=str(vector_dir))
    kernel = iv.kernel(3, H)
    site = kernel.sites[0]
    if name == "cast":  # the first site that edits the prompt forward (after the condition layer)
        site = next(s for s in kernel.sites if kernel.edits_last_prompt(s))
    enc = _prompt_batch(lm)
    plen = enc["input_ids"].shape[1]
    with torch.no_grad():
        store, remove = record_block_inputs(lm.model, [site.layer, *kernel.decision_layers])
        lm.model(**enc)
        remove()
    plain = store[site.layer][0]
    strength = torch.ones(len(PROMPTS))
    if kernel.decision_layers:
        strength = kernel.decide({b: store[b][0][:, plen - 1] for b in kernel.decision_layers})
    want = plain.clone()
    cols = [p for p in range(plen) if edited(p, plen, kernel, site)]
    for col in cols:
        want[:, col] = kernel.edit(site, plain[:, col], strength)
    ctx = SteerContext(prompt_len=plen)
    with torch.no_grad(), iv.attach(lm.model, ctx):
        store2, remove = record_block_inputs(lm.model, [site.layer])  # registered after: sees the edit
        lm.model(**enc)
        remove()
    got = store2[site.layer][0]
    assert cols, "the kernel must edit some prompt position"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.equal(got, plain) or not bool(strength.any())


def test_zero_strength_rows_are_unchanged_by_every_kernel(lm, vector_dir):
    x = torch.randn(6, H)
    s = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    for iv in (
        _els(lm),
        *(
            make_intervention(n, lm, dir=str(vector_dir))
            for n in ("refusal-add", "refusal-ablation", "false-refusal-ablation", "cast")
        ),
    ):
        kernel = iv.kernel(3, H)
        for site in kernel.sites:
            y = kernel.edit(site, x, s)
            assert torch.equal(y[s == 0], x[s == 0]), (iv.name, site)
            assert not torch.equal(y[s != 0], x[s != 0]), (iv.name, site)


def test_kernel_refuses_vectors_of_another_hidden_size(lm, vector_dir):
    from aligntax.errors import AligntaxError

    iv = make_intervention("refusal-add", lm, dir=str(vector_dir))
    with pytest.raises(AligntaxError, match="hidden size"):
        iv.kernel(3, H + 1)
    with pytest.raises(AligntaxError, match="does not exist"):
        _els(lm).kernel(2, H)


def test_generation_reports_steering_statistics_up(lm):
    """``iter_generate(stats=...)`` merges every batch's statistics: per steered layer the positions moved
    and the mean energy before and after (which descent lowers), and the decisions' counts."""
    from aligntax.generation import GenerationConfig, generate

    stats: dict = {}
    prompts = PROMPTS * 3
    generate(
        lm,
        prompts,
        GenerationConfig(max_new_tokens=4, batch_size=5),
        _els(lm, horizon=2),
        progress=False,
        stats=stats,
    )
    for layer in (1, 2):
        s = stats["els"][layer]
        # 12 rows x (the last prompt token + the first 2 generated tokens), in 3 batches
        assert s["positions"] == 12 * 3 and s["steered"] == 12 * 3
        assert s["energy_after"] < s["energy_before"]
    row_stats: dict = {}
    generate(
        lm,
        prompts,
        GenerationConfig(max_new_tokens=4, batch_size=5),
        _els(lm, row_threshold=0.0),
        progress=False,
        stats=row_stats,
    )
    assert row_stats["els_row_energy"]["rows"] == 12


def test_merge_stats_adds_counts_and_weights_means():
    from aligntax.interventions.kernels import merge_stats

    acc: dict = {}
    merge_stats(
        acc,
        {
            "els": {1: {"positions": 2, "steered": 1, "energy_before": 1.0, "energy_after": 0.0, "eta": 0.3}},
            "els_gate": {"rows": 4, "held": 1},
        },
    )
    merge_stats(
        acc,
        {
            "els": {1: {"positions": 6, "steered": 6, "energy_before": 3.0, "energy_after": 2.0, "eta": 0.3}},
            "els_gate": {"rows": 4, "held": 3},
        },
    )
    assert acc["els"][1] == {
        "positions": 8,
        "steered": 7,
        "energy_before": 2.5,
        "energy_after": 1.5,
        "eta": 0.3,
    }
    assert acc["els_gate"] == {"rows": 8, "held": 4}


def test_row_records_come_from_the_kernel_for_every_method_with_a_decision(lm, vector_dir):
    """``row_info`` and ``unsteered_rows`` read the kernel's decision: CAST now records per row whether
    its condition steered it, as ELS records its gate and row energy decision."""
    cast = make_intervention("cast", lm, dir=str(vector_dir))
    info = row_info(cast, lm, PROMPTS)
    held = unsteered_rows(cast, lm, PROMPTS)
    assert [not r["steered"] for r in info] == held and any(held) and not all(held)
    assert row_info(make_intervention("refusal-add", lm, dir=str(vector_dir)), lm, PROMPTS) is None
    els_info = row_info(_els(lm, row_threshold=0.0), lm, PROMPTS)
    assert set(els_info[0]) == {"energy", "steered", "strength"}
