"""Row kernels inside vLLM's flattened token batches (torch only: no vLLM import, testable anywhere).

vLLM runs the tokens of every scheduled request of one engine step as one flat batch: a request holds
the contiguous slice ``query_start_loc[i] : query_start_loc[i + 1]`` of it, a prompt chunk (chunked
prefill, prefix-cache hits) or one decode token, at absolute positions ``positions[slice]``.
:class:`BatchSteering` maps those tokens to requests and applies each request's
:class:`~aligntax.interventions.kernels.RowKernel` with the rule the Hugging Face backend uses
(:func:`~aligntax.interventions.kernels.edited_mask`):

- a request names a steering preset registered at start-up and a strength multiplier
  (:func:`parse_request`, from ``SamplingParams.extra_args``); a strength of 0 is plain generation;
- a preset whose decision reads the prompt's surprisal (ELS ``max_prompt_surprisal``) takes it from the
  request (``aligntax_prompt_nll``, scored before generating by
  :meth:`~aligntax.backends.vllm.engine.VllmModel.generate` from vLLM's prompt logprobs): a request
  without it is held back (run unsteered) and the omission is reported;
- the per-request decision (harm gate, row energy, CAST condition) is made on the step whose chunk
  holds the request's last prompt token, from the states entering ``decision_layers`` there, before
  any edit at those blocks; it is kept per request id and freed when the engine drops the request;
- an edit writes the residual stream entering a block: vLLM passes a block ``hidden_states`` and
  ``residual`` apart (the stream is their sum, or ``hidden_states`` alone before the first block), so
  an edited token gets ``hidden_states = new stream`` and ``residual = 0``; the block's fused
  add-and-norm then sees exactly the edited stream, and so does every later block. Other tokens are
  left bit for bit as they were.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch

from aligntax.errors import AligntaxError
from aligntax.interventions.kernels import PROMPT_NLL, PROMPT_TOKENS, RowKernel, Site, edited_mask

# The request fields a client may send (``SamplingParams.extra_args``; OpenAI clients: ``vllm_xargs``).
EXTRA_STEER = "aligntax_steer"
EXTRA_STRENGTH = "aligntax_strength"
EXTRA_PROMPT_NLL = "aligntax_prompt_nll"  # the prompt's surprisal, for a preset whose decision reads it
MAX_STRENGTH = 10.0


@dataclass(frozen=True)
class RequestSteer:
    """What one request asks for: a registered preset and a strength multiplier (0: not steered), and
    its prompt's surprisal (nats per user-message token) where the preset's decision reads it."""

    preset: str
    strength: float = 1.0
    prompt_nll: float | None = None


def parse_request(extra_args: dict | None, presets: Container[str]) -> RequestSteer | None:
    """The steering a request asks for in its ``extra_args`` (None: none). Only a registered preset
    name and a finite strength in ``[0, MAX_STRENGTH]`` are accepted (AligntaxError otherwise)."""
    if not extra_args or extra_args.get(EXTRA_STEER) in (None, "", "none"):
        if extra_args and extra_args.get(EXTRA_STRENGTH) is not None:
            raise AligntaxError(f"{EXTRA_STRENGTH} needs {EXTRA_STEER} (a steering preset).")
        return None
    name = extra_args[EXTRA_STEER]
    if not isinstance(name, str) or name not in presets:
        raise AligntaxError(
            f"Unknown steering preset {name!r}; registered: {', '.join(sorted(presets)) or 'none'}."
        )
    raw = extra_args.get(EXTRA_STRENGTH, 1.0)
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise AligntaxError(f"{EXTRA_STRENGTH} must be a number, not {raw!r}.")
    try:
        strength = float(raw)
    except ValueError:
        raise AligntaxError(f"{EXTRA_STRENGTH} must be a number, not {raw!r}.") from None
    if not math.isfinite(strength) or not 0.0 <= strength <= MAX_STRENGTH:
        raise AligntaxError(f"{EXTRA_STRENGTH} must lie in [0, {MAX_STRENGTH:g}]; got {raw!r}.")
    nll = extra_args.get(EXTRA_PROMPT_NLL)
    if nll is not None and (
        isinstance(nll, bool) or not isinstance(nll, int | float) or not math.isfinite(nll) or nll < 0
    ):
        raise AligntaxError(f"{EXTRA_PROMPT_NLL} must be a finite number >= 0, not {nll!r}.")
    return RequestSteer(name, strength, None if nll is None else float(nll))


@dataclass(frozen=True)
class StepBatch:
    """One engine step's flat token batch: request ``i`` holds tokens ``starts[i]:ends[i]``."""

    req_ids: list[str]
    starts: list[int]
    ends: list[int]
    prompt_lens: list[int]
    positions: torch.Tensor  # [tokens] absolute positions, long, on the CPU

    @classmethod
    def from_query_start_loc(
        cls,
        req_ids: Sequence[str],
        query_start_loc: Sequence[int],
        prompt_lens: Sequence[int],
        positions: torch.Tensor,
    ) -> StepBatch:
        n = len(req_ids)
        qsl = [int(x) for x in query_start_loc[: n + 1]]
        return cls(
            list(req_ids),
            qsl[:-1],
            qsl[1:],
            [int(x) for x in prompt_lens[:n]],
            positions.reshape(-1)[: qsl[-1] if qsl else 0].to("cpu", torch.long),
        )


@dataclass
class Preset:
    """A steering setting registered at start-up: its kernel, resolved config and statistics."""

    name: str
    kernel: RowKernel
    config: dict = field(default_factory=dict)
    site_stats: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


@dataclass
class _Live:
    """A steered request the engine holds: its preset, multiplier, prompt length and decided strength."""

    preset: str
    multiplier: float
    prompt_len: int
    prompt_nll: float | None = None
    strength: float | None = None  # multiplier x decision; None until decided
    parts: dict = field(default_factory=dict)


@dataclass
class _Group:
    """One preset's share of a step: its requests' tokens, and the requests deciding in this step."""

    preset: Preset
    req_ids: list[str]
    tok_idx: torch.Tensor  # [n] token indices in the flat batch
    tok_req: torch.Tensor  # [n] index into req_ids
    pos: torch.Tensor  # [n] absolute positions
    plen: torch.Tensor  # [n] prompt lengths
    deciding: list[int]  # indices into req_ids whose chunk holds the last prompt token (undecided)
    last_tok: list[int]  # their last prompt token's index in the flat batch
    read: dict = field(default_factory=dict)  # block -> [len(deciding), d] states at the last prompt token


class BatchSteering:
    """The per-worker steering state: registered presets, the live steered requests, the current step."""

    def __init__(self) -> None:
        self.presets: dict[str, Preset] = {}
        self.live: dict[str, _Live] = {}
        self.groups: list[_Group] = []
        self.records: dict[str, dict] = {}  # req id -> {"preset", "strength", "parts"} once decided
        self.keep_records = True  # off for a server, which never reads them (they would grow without bound)
        self.errors: list[str] = []
        self.trace: list[tuple] | None = None  # (req_id, position, layer, where) of every edited token
        self.steps = 0

    # ---- set-up ----------------------------------------------------------------------------------------
    def register(self, name: str, kernel: RowKernel, config: dict | None = None) -> None:
        if not name or not isinstance(name, str) or name == "none":
            raise AligntaxError(f"A steering preset needs a name (not {name!r}).")
        self.presets[name] = Preset(name, kernel, dict(config or {}))

    def unregister(self, name: str) -> bool:
        """Drop preset ``name`` and the live requests steered by it (a request still asking for it later
        runs unsteered). Returns whether it was registered."""
        if self.presets.pop(name, None) is None:
            return False
        for rid in [r for r, live in self.live.items() if live.preset == name]:
            del self.live[rid]
        self.groups = [g for g in self.groups if g.preset.name != name]
        return True

    def blocks(self) -> tuple[list[int], list[int], list[int]]:
        """The blocks that need a pre-hook (decisions, "pre" sites), a forward hook ("post" sites) and a
        forward hook on their attention sub-layer ("attn" sites)."""
        kinds: dict[str, set[int]] = {"pre": set(), "post": set(), "attn": set()}
        for p in self.presets.values():
            kinds["pre"] |= set(p.kernel.decision_layers)
            for s in p.kernel.sites:
                kinds[s.where].add(s.layer)
        return sorted(kinds["pre"]), sorted(kinds["post"]), sorted(kinds["attn"])

    # ---- one engine step ---------------------------------------------------------------------------------
    def begin_step(
        self, batch: StepBatch, asks: Sequence[RequestSteer | None], alive: Container[str]
    ) -> None:
        """Map this step's tokens to the steered requests; forget requests the engine no longer holds
        (``alive``: the ids it holds)."""
        self.groups = []
        for rid in [r for r in self.live if r not in alive]:
            del self.live[rid]
        by_preset: dict[str, list[int]] = {}
        for i, (rid, ask) in enumerate(zip(batch.req_ids, asks, strict=True)):
            if ask is None or ask.preset not in self.presets:
                continue
            live = self.live.get(rid)
            if live is None or live.preset != ask.preset or live.multiplier != ask.strength:
                live = self.live[rid] = _Live(ask.preset, ask.strength, batch.prompt_lens[i], ask.prompt_nll)
                kernel = self.presets[ask.preset].kernel
                if ask.strength == 0 or not kernel.decision_layers:
                    live.strength = ask.strength
                    if self.keep_records:
                        self.records[rid] = {"preset": ask.preset, "strength": ask.strength, "parts": {}}
            if live.strength == 0:
                continue
            by_preset.setdefault(ask.preset, []).append(i)
        if not by_preset:
            return
        self.steps += 1
        for name, rows in by_preset.items():
            preset = self.presets[name]
            kernel = preset.kernel
            idx, req, deciding, last_tok = [], [], [], []
            for j, i in enumerate(rows):
                s, e, plen = batch.starts[i], batch.ends[i], batch.prompt_lens[i]
                if e <= s:
                    continue
                idx.append(torch.arange(s, e))
                req.append(torch.full((e - s,), j, dtype=torch.long))
                first = int(batch.positions[s])
                holds_last = first <= plen - 1 < first + (e - s)
                live = self.live[batch.req_ids[i]]
                if kernel.decision_layers and holds_last:
                    deciding.append(j)  # decided here (again after a preemption: the same state)
                    last_tok.append(s + plen - 1 - first)
                    live.strength = None
                elif live.strength is None and kernel.positions == "all" and first < plen - 1:
                    self.errors.append(
                        f"request {batch.req_ids[i]}: steering every position with a per-request decision "
                        "needs the whole prompt in one step (chunked prefill split it)."
                    )
            if not idx:
                continue
            tok_idx = torch.cat(idx)
            tok_req = torch.cat(req)
            plens = torch.tensor([batch.prompt_lens[i] for i in rows], dtype=torch.long)
            self.groups.append(
                _Group(
                    preset,
                    [batch.req_ids[i] for i in rows],
                    tok_idx,
                    tok_req,
                    batch.positions[tok_idx],
                    plens[tok_req],
                    deciding,
                    last_tok,
                )
            )

    def pre_block(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None):
        """The pre-hook of block ``layer``: decisions read and made, then edits. Returns the new
        ``(hidden, residual)`` or None when nothing changed."""
        changed = False
        for g in self.groups:
            kernel = g.preset.kernel
            if g.deciding and layer in kernel.decision_layers:
                rows = torch.tensor(g.last_tok, device=hidden.device)
                g.read[layer] = _stream(hidden, residual, rows)
                if layer == max(kernel.decision_layers):
                    self._decide(g)
            for site in kernel.sites:
                if site.layer == layer and site.where == "pre":
                    out = self._edit(g, site, hidden, residual)
                    if out is not None:
                        hidden, residual = out
                        changed = True
        return (hidden, residual) if changed else None

    def post_block(
        self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None, where: str = "post"
    ):
        """The forward hook of block ``layer`` ("post" sites: the stream leaving it) or, with ``where="attn"``,
        of its attention sub-layer (``hidden``: what the attention writes into the stream; ``residual``
        None)."""
        changed = False
        for g in self.groups:
            for site in g.preset.kernel.sites:
                if site.layer == layer and site.where == where:
                    out = self._edit(g, site, hidden, residual)
                    if out is not None:
                        hidden, residual = out
                        changed = True
        return (hidden, residual) if changed else None

    def _decide(self, g: _Group) -> None:
        kernel = g.preset.kernel
        states = {b: g.read[b] for b in kernel.decision_layers}
        lives = [self.live[g.req_ids[j]] for j in g.deciding]
        states[PROMPT_TOKENS] = torch.tensor([live.prompt_len for live in lives])
        if kernel.needs_prompt_nll:  # a request that did not send it is held back (NaN is out of domain)
            for j, live in zip(g.deciding, lives, strict=True):
                if live.prompt_nll is None:
                    self.errors.append(
                        f"request {g.req_ids[j]}: preset {live.preset!r} holds prompts back by their "
                        f"surprisal and the request sent none ({EXTRA_PROMPT_NLL}); it ran unsteered."
                    )
            states[PROMPT_NLL] = torch.tensor(
                [math.nan if live.prompt_nll is None else live.prompt_nll for live in lives]
            )
        decision, parts = kernel.decide_with_parts(states)
        if parts:
            kernel.record_decisions(parts, g.preset.stats)
        decision = decision.detach().float().cpu()
        for k, j in enumerate(g.deciding):
            rid = g.req_ids[j]
            live = self.live[rid]
            live.strength = float(decision[k]) * live.multiplier
            live.parts = {name: round(float(p[k]), 6) for name, p in parts.items()}
            if self.keep_records:
                self.records[rid] = {"preset": live.preset, "strength": live.strength, "parts": live.parts}
        g.read.clear()

    def _edit(self, g: _Group, site: Site, hidden: torch.Tensor, residual: torch.Tensor | None):
        strength = torch.tensor([_strength(self.live[r]) for r in g.req_ids], dtype=torch.float32)[g.tok_req]
        mask = edited_mask(g.pos, g.plen, g.preset.kernel, site) & (strength > 0)
        if not bool(mask.any()):
            return None
        idx = g.tok_idx[mask].to(hidden.device)
        rows = _stream(hidden, residual, idx)
        stats = g.preset.site_stats.setdefault(site, {})
        new = g.preset.kernel.edit(site, rows, strength[mask].to(hidden.device), stats)
        if self.trace is not None:
            req = g.tok_req[mask].tolist()
            self.trace.extend(
                (g.req_ids[r], int(p), site.layer, site.where)
                for r, p in zip(req, g.pos[mask].tolist(), strict=True)
            )
        hidden = hidden.index_put((idx,), new.to(hidden.dtype))
        if residual is not None:
            residual = residual.index_fill(0, idx, 0)
        return hidden, residual

    # ---- results ------------------------------------------------------------------------------------------
    def take_records(self) -> dict[str, dict]:
        out, self.records = self.records, {}
        return out

    def summary(self) -> dict:
        """Per preset: its config and statistics (the kernel's summary of every edit since the last call,
        merged into the running totals), and the errors seen."""
        out = {}
        for name, p in self.presets.items():
            if p.site_stats:
                acc, p.site_stats = p.site_stats, {}
                try:
                    p.kernel.finish({s: a for s, a in acc.items() if a}, p.stats)
                except AligntaxError as exc:
                    self.errors.append(f"{name}: {exc}")
            out[name] = {"config": p.config, "stats": p.stats}
        return {"presets": out, "errors": list(self.errors), "live": len(self.live), "steps": self.steps}


def _strength(live: _Live) -> float:
    return 0.0 if live.strength is None else live.strength


def _stream(hidden: torch.Tensor, residual: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """The residual stream at tokens ``idx``: ``hidden + residual`` (``hidden`` alone before block 0)."""
    return hidden[idx] if residual is None else hidden[idx] + residual[idx]
