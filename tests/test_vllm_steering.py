"""The vLLM backend's token-to-request mapping (torch only; runs without vLLM): flat token batches of
several requests, chunked prefill, decode steps, decisions, strength 0 and freed requests."""

from __future__ import annotations

import itertools

import pytest
import torch

from aligntax.backends.vllm.steering import BatchSteering, RequestSteer, StepBatch, edited_mask, parse_request
from aligntax.errors import AligntaxError
from aligntax.interventions.kernels import RowKernel, Site, edited


class AddKernel(RowKernel):
    """Adds ``strength`` to every coordinate at its sites; decides from the state entering block 0
    (strength 1 when its first coordinate is positive) when ``decide_layer`` is given."""

    def __init__(self, positions="last_and_generated", horizon=None, decide_layer=None, last=True):
        self.sites = [Site(1), Site(2, "post")]
        self.positions, self.horizon, self.last = positions, horizon, last
        self.decision_layers = [] if decide_layer is None else [decide_layer]

    def edits_last_prompt(self, site):
        return self.last

    def decision_parts(self, states):
        return {"sign": (states[self.decision_layers[0]][:, 0] > 0).float()}

    def edit(self, site, rows, strength, stats=None):
        return rows + strength[:, None].to(rows.dtype)


@pytest.mark.parametrize(
    "positions,horizon,last",
    itertools.product(["last_and_generated", "generated", "all"], [None, 0, 3], [True, False]),
)
def test_edited_mask_is_the_shared_rule(positions, horizon, last):
    k = AddKernel(positions, horizon, last=last)
    pos = torch.arange(0, 20).repeat(3)
    plen = torch.tensor([1, 7, 12]).repeat_interleave(20)
    for site in k.sites:
        want = [edited(int(p), int(n), k, site) for p, n in zip(pos, plen, strict=True)]
        assert edited_mask(pos, plen, k, site).tolist() == want


def _run_step(st, batch, asks, alive, d=4, layer=1):
    """One step through block ``layer``'s pre-hook; returns (hidden, residual, new hidden, new residual)."""
    n = len(batch.positions)
    hidden = torch.randn(n, d)
    residual = torch.randn(n, d)
    st.begin_step(batch, asks, alive)
    out = st.pre_block(layer, hidden, residual)
    return hidden, residual, out


def test_two_requests_chunked_prefill_then_decode():
    st = BatchSteering()
    st.register("add", AddKernel(horizon=2))
    st.trace = []
    ask = RequestSteer("add", 2.0)
    # step 1: request a's prompt (5 tokens) is split: positions 0-2 here, b (plain) holds its 3-token prompt
    b1 = StepBatch(["a", "b"], [0, 3], [3, 6], [5, 3], torch.tensor([0, 1, 2, 0, 1, 2]))
    _, _, out = _run_step(st, b1, [ask, None], {"a", "b"})
    assert out is None  # a's last prompt token (position 4) is not in this step
    # step 2: a's positions 3-4 (its last prompt token) and b's first decode token (position 3)
    b2 = StepBatch(["b", "a"], [0, 1], [1, 3], [3, 5], torch.tensor([3, 3, 4]))
    hidden, residual, out = _run_step(st, b2, [None, ask], {"a", "b"})
    new_h, new_r = out
    assert torch.equal(new_h[:2], hidden[:2]) and torch.equal(new_r[:2], residual[:2])  # b, a@3 untouched
    assert torch.allclose(new_h[2], hidden[2] + residual[2] + 2.0) and torch.equal(new_r[2], torch.zeros(4))
    # decode steps of a: horizon 2 edits the first 2 generated tokens fed back (positions 5, 6), not 7
    for pos, edited_now in ((5, True), (6, True), (7, False)):
        b = StepBatch(["a"], [0], [1], [5], torch.tensor([pos]))
        hidden, residual, out = _run_step(st, b, [ask], {"a"})
        assert (out is not None) == edited_now
    assert sorted(st.trace) == [("a", 4, 1, "pre"), ("a", 5, 1, "pre"), ("a", 6, 1, "pre")]
    st.begin_step(StepBatch([], [], [], [], torch.tensor([], dtype=torch.long)), [], set())
    assert st.live == {}  # a finished: its state is freed


def test_decision_is_made_on_the_chunk_with_the_last_prompt_token():
    st = BatchSteering()
    st.register("k", AddKernel(decide_layer=0))
    ask = RequestSteer("k", 1.0)
    batch = StepBatch(["x", "y"], [0, 3], [3, 6], [3, 3], torch.tensor([0, 1, 2, 0, 1, 2]))
    st.begin_step(batch, [ask, ask], {"x", "y"})
    h0 = torch.zeros(6, 4)
    h0[2, 0], h0[5, 0] = 1.0, -1.0  # x's last prompt token decides "steer", y's "hold back"
    assert st.pre_block(0, h0, None) is None  # block 0 only decides
    hidden, residual = torch.randn(6, 4), torch.randn(6, 4)
    new_h, _ = st.pre_block(1, hidden, residual)
    assert torch.allclose(new_h[2], hidden[2] + residual[2] + 1.0)
    assert torch.equal(new_h[5], hidden[5])
    recs = st.take_records()
    assert (
        recs["x"]["strength"] == 1.0 and recs["y"]["strength"] == 0.0 and recs["y"]["parts"] == {"sign": 0.0}
    )


def test_strength_zero_and_unknown_preset():
    st = BatchSteering()
    st.register("add", AddKernel())
    batch = StepBatch(["a"], [0], [3], [3], torch.tensor([0, 1, 2]))
    _, _, out = _run_step(st, batch, [RequestSteer("add", 0.0)], {"a"})
    assert out is None
    with pytest.raises(AligntaxError, match="Unknown steering preset"):
        parse_request({"aligntax_steer": "other"}, st.presets)
    with pytest.raises(AligntaxError, match="must lie in"):
        parse_request({"aligntax_steer": "add", "aligntax_strength": 1e9}, st.presets)
    with pytest.raises(AligntaxError, match="needs aligntax_steer"):
        parse_request({"aligntax_strength": 1.0}, st.presets)
    assert parse_request({"aligntax_steer": "add", "aligntax_strength": "0.5"}, st.presets) == RequestSteer(
        "add", 0.5
    )
    assert parse_request(None, st.presets) is None


def test_post_site_edits_the_stream_leaving_the_last_block():
    st = BatchSteering()
    st.register("add", AddKernel(positions="all"))
    batch = StepBatch(["a"], [0], [2], [2], torch.tensor([0, 1]))
    st.begin_step(batch, [RequestSteer("add", 1.0)], {"a"})
    hidden, residual = torch.randn(2, 4), torch.randn(2, 4)
    new_h, new_r = st.post_block(2, hidden, residual)
    assert torch.allclose(new_h, hidden + residual + 1.0) and torch.equal(new_r, torch.zeros(2, 4))


def test_records_off_keeps_nothing_but_steers_the_same():
    """A server turns the decision records off (``keep_records``): no record is kept per request, and the
    decisions and edits are the same."""
    results = []
    for keep in (True, False):
        st = BatchSteering()
        st.keep_records = keep
        st.register("k", AddKernel(decide_layer=0))
        st.register("add", AddKernel())
        batch = StepBatch(["x", "y", "z"], [0, 3, 6], [3, 6, 9], [3, 3, 3], torch.tensor([0, 1, 2] * 3))
        st.begin_step(
            batch, [RequestSteer("k", 1.0), RequestSteer("k", 1.0), RequestSteer("add", 1.0)], {"x", "y", "z"}
        )
        h0 = torch.zeros(9, 4)
        h0[2, 0], h0[5, 0] = 1.0, -1.0
        st.pre_block(0, h0, None)
        torch.manual_seed(0)
        hidden, residual = torch.randn(9, 4), torch.randn(9, 4)
        results.append(st.pre_block(1, hidden, residual))
        assert (len(st.take_records()) == 3) if keep else (st.records == {})
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
