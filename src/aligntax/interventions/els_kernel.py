"""The ELS math as a row kernel: energy, gradient, descent, and the per-row decision, in plain torch.

:class:`ElsKernel` is what both backends run (the Hugging Face hooks of
:func:`~aligntax.interventions.kernels.attach_kernel` and the vLLM worker's
:class:`~aligntax.backends.vllm.steering.BatchSteering`): it holds the energy models and the decision
parts it was given (harm gate, row strength model, harm directions) and nothing of loading, folders or
settings, which :class:`~aligntax.interventions.els.EnergySteering` resolves.

- descent: at each steered block, K steps ``h <- h - eta_l * s_row * u`` with ``u = g / ||g||``,
  ``g = dE_l/dh`` (float32, the energy model's closed-form backward or autograd on the energy MLP only),
  ``u`` projected off the block's harm directions when given; with a ``threshold`` a position moves only
  while its energy is above it;
- decision at the last prompt token: the harm gate's strength (0 at or above its threshold, a linear
  ramp below it with ``gate_ramp``), the row energy decision (the energy entering the first steered
  block above ``row_threshold``), or the learned per-row strength instead of both;
- which tokens: ``positions`` and ``horizon`` (:func:`~aligntax.interventions.kernels.edited`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from aligntax.energy.front import STRENGTH_FEATURES
from aligntax.energy.model import EnergyModel
from aligntax.errors import AligntaxError
from aligntax.interventions.kernels import PROMPT_NLL, PROMPT_TOKENS, RowKernel, Site, merge_stats

if TYPE_CHECKING:
    from aligntax.energy.front import RowStrength
    from aligntax.energy.gate import HarmGate

__all__ = ["ElsKernel"]


class ElsKernel(RowKernel):
    """ELS on the blocks of ``models`` (block -> energy model), each with its step size ``eta`` (block ->
    step, already in units of the residual norm where scaled). ``settings``: the value options of
    :class:`~aligntax.interventions.els.ElsOptions` as resolved (``steps``, ``threshold``, ``positions``,
    ``horizon``, ``grad_method``, ``gate_ramp``, ``row_threshold``, ...), kept as ``self.settings``.
    ``gate`` (a :class:`~aligntax.energy.gate.HarmGate`) with ``gate_threshold``, ``row_strength`` (a
    :class:`~aligntax.energy.front.RowStrength`) make the per-row decision with the settings' cut-offs;
    ``harm_dirs`` (block -> ``[k, d]`` orthonormal) the directions each step is projected off. The
    arguments are taken as given: :class:`~aligntax.interventions.els.EnergySteering` checks them."""

    def __init__(
        self,
        models: dict[int, EnergyModel],
        eta: dict[int, float],
        settings: Mapping[str, Any],
        *,
        gate: HarmGate | None = None,
        gate_threshold: float | None = None,
        harm_dirs: dict[int, torch.Tensor] | None = None,
        row_strength: RowStrength | None = None,
        surprisal_span: tuple[int, int] | None = None,
    ):
        self.settings = dict(settings)
        self.models, self.eta, self.steps = models, eta, settings["steps"]
        self.threshold, self.grad_method = settings["threshold"], settings["grad_method"]
        self.positions, self.horizon = settings["positions"], settings["horizon"]
        self.gate, self.gate_threshold, self.gate_ramp = gate, gate_threshold, settings["gate_ramp"]
        self.row_threshold, self.row_strength = settings["row_threshold"], row_strength
        self.max_prompt_tokens = settings.get("max_prompt_tokens")
        self.max_prompt_surprisal = settings.get("max_prompt_surprisal")
        self.needs_prompt_nll = self.max_prompt_surprisal is not None
        if self.needs_prompt_nll:  # where the hooks score the surprisal themselves (Hugging Face)
            self.prompt_nll_span = surprisal_span
        self.harm_dirs = harm_dirs or {}
        self.sites = [Site(layer) for layer in sorted(models)] if self.steps > 0 else []
        decision = list(gate.layers) if gate is not None else []
        if (
            self.row_threshold is not None
            or row_strength is not None
            or self.max_prompt_tokens is not None
            or self.max_prompt_surprisal is not None
        ):
            decision.append(self.first_layer)
        self.decision_layers = sorted(set(decision))
        self._device_models: dict[tuple[int, str], EnergyModel] = {}
        self._device_dirs: dict[tuple[int, str], torch.Tensor] = {}

    @property
    def first_layer(self) -> int:
        """The first steered block: the row energy decision reads the state entering it."""
        return min(self.models)

    # ---- the decision ------------------------------------------------------------------------------------
    def gate_scale(self, p: torch.Tensor) -> torch.Tensor:
        """Per-row strength from the harm gate's p(harmful): 0 at or above its threshold, 1 below
        ``gate_ramp`` (or below the threshold, without a ramp), linear in between."""
        t = cast(float, self.gate_threshold)  # given with the gate (EnergySteering)
        if self.gate_ramp is None:
            return (p < t).float()
        scale: torch.Tensor = ((t - p) / (t - self.gate_ramp)).clamp(0.0, 1.0).float()
        return scale

    def harm_p(self, states: dict[int, torch.Tensor]) -> torch.Tensor:
        """The harm gate's p(harmful) ``[N]`` from ``{block: [N, d]}`` at the last prompt token."""
        assert self.gate is not None  # asked only with a gate
        dev = states[self.gate.layer].device
        return self.gate.prob(self.gate.stack({b: states[b].to(dev) for b in self.gate.layers}))

    def row_energy(self, last: torch.Tensor) -> torch.Tensor:
        """Energy of the last prompt token's state entering the first steered block, ``[N, d] -> [N]``."""
        with torch.no_grad():
            energy: torch.Tensor = self._model_on(self.first_layer, last.device)(last.float(), check=False)
            return energy

    def row_features(
        self, states: dict[int, torch.Tensor], directions: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The row strength model's features ``[N, F]`` (:data:`~aligntax.energy.front.STRENGTH_FEATURES`)
        from ``{block: [N, d]}`` at the last prompt token (the gate's blocks and the first steered one).
        ``directions``: the unit refusal and harm directions at the first steered block (default: the
        row strength model's)."""
        if self.gate is None:
            raise AligntaxError("The row strength features read the harm gate's logit: no gate.")
        last = states[self.first_layer]
        dev = last.device
        gate_logit = self.gate.logit(self.gate.stack({b: states[b].to(dev) for b in self.gate.layers}))
        if directions is None:
            if self.row_strength is None:
                raise AligntaxError(
                    "row_features needs the refusal and harm directions (no row strength model)."
                )
            refusal, harm = self.row_strength.projections(last)
        else:
            refusal, harm = (last.float() @ d.to(dev).float() for d in directions)
        cols = {
            "gate_logit": gate_logit,
            "energy": self.row_energy(last),
            "refusal_proj": refusal,
            "harm_proj": harm,
        }
        return torch.stack([cols[f].float().to(dev) for f in STRENGTH_FEATURES], dim=-1)

    def in_domain(self, states: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """1 for rows whose prompt is at most ``max_prompt_tokens`` long and whose prompt surprisal is at
        most ``max_prompt_surprisal`` (None without either limit)."""
        domain = None
        for limit, key, what in (
            (self.max_prompt_tokens, PROMPT_TOKENS, "prompt length"),
            (self.max_prompt_surprisal, PROMPT_NLL, "prompt surprisal"),
        ):
            if limit is None:
                continue
            value = states.get(key)
            if value is None:
                raise AligntaxError(
                    f"The ELS domain needs each row's {what} with its decision (not given here)."
                )
            inside = (value.float() <= limit).float()
            domain = inside if domain is None else domain * inside.to(domain.device)
        return domain

    def decision_parts(self, states: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        parts = {}
        domain = self.in_domain(states)
        if domain is not None:  # a prompt unlike the training prompts is held back whatever else says
            parts["els_domain"] = domain
        if (
            self.row_strength is not None
        ):  # the learned strength replaces the gate's and the energy's cut-offs
            parts["els_strength"] = self.row_strength.strength(self.row_features(states))
            return parts
        if self.gate is not None:  # the strength the harm gate allows (0: held back)
            parts["els_gate"] = self.gate_scale(self.harm_p(states))
        if self.row_threshold is not None:  # 1 for rows whose last prompt token predicts a bad end
            parts["els_row_energy"] = (self.row_energy(states[self.first_layer]) > self.row_threshold).float()
        return parts

    @property
    def read_layers(self) -> list[int]:
        return sorted({self.first_layer, *self.decision_layers})

    def row_records(self, states: dict[int, torch.Tensor]) -> list[dict[str, Any]]:
        """Per row: ``energy`` (the row energy at the first steered block), ``harm_p`` (with a gate),
        ``steered`` (the gate and the row energy decision pass it) and ``strength``."""
        energy = self.row_energy(states[self.first_layer]).cpu()
        rows = [{"energy": round(float(e), 4)} for e in energy]
        if self.max_prompt_tokens is not None and PROMPT_TOKENS in states:
            for r, n in zip(rows, states[PROMPT_TOKENS].cpu().tolist(), strict=True):
                r["prompt_tokens"] = int(n)
        if self.max_prompt_surprisal is not None and PROMPT_NLL in states:
            for r, v in zip(rows, states[PROMPT_NLL].cpu().tolist(), strict=True):
                r["prompt_nll"] = round(float(v), 4)
        if self.gate is not None:
            for r, p in zip(rows, self.harm_p(states).cpu(), strict=True):
                r["harm_p"] = round(float(p), 4)
        if self.row_strength is not None:  # the model's probability, before the floor
            for r, p in zip(rows, self.row_strength.prob(self.row_features(states)).cpu(), strict=True):
                r["strength_p"] = round(float(p), 4)
        scale = self.decide(states).cpu() if self.decision_layers else torch.ones(len(rows))
        for r, sc in zip(rows, scale, strict=True):
            r.update(steered=bool(sc > 0 and self.steps > 0), strength=round(float(sc), 4))
        return rows

    # ---- the descent -------------------------------------------------------------------------------------
    def energy_and_grad(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The energy ``[...]`` and its gradient ``[..., d]`` of block ``layer``'s model at ``x`` (float32)."""
        model = self._model_on(layer, x.device)
        if self.grad_method == "closed":
            return model.energy_and_grad(x, check=False)
        # Autograd on a detached float32 leaf: the graph covers the energy MLP only, never the LLM.
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            e = model(leaf)
            (g,) = torch.autograd.grad(e.sum(), leaf)
        return e.detach(), g

    def steer(
        self, layer: int, x: torch.Tensor, row_scale: torch.Tensor, acc: dict[str, Any] | None = None
    ) -> torch.Tensor:
        """K energy-descent steps on ``x`` ``[B, T, d]`` (float32); ``row_scale`` ``[B, 1, 1]``. ``acc``: the
        block's accumulators (positions seen and moved, energy before and after, non-finite states)."""
        eta = self.eta[layer]
        q = self._dirs_on(layer, x.device)  # [k, d] orthonormal, or None
        scale = row_scale.to(x.device, torch.float32).view(-1, 1)  # [B, 1]
        rows_on = scale != 0  # [B, 1]
        bad = torch.zeros((), dtype=torch.bool, device=x.device)
        e0 = None
        first_active = None
        for _ in range(self.steps):
            finite = torch.isfinite(x).all(-1)  # [B, T]
            e, g = self.energy_and_grad(layer, torch.where(finite[..., None], x, torch.zeros_like(x)))
            active = rows_on & finite
            if self.threshold is not None:
                active = active & (e > self.threshold)
            bad = bad | (rows_on & ~finite).any()
            if e0 is None:
                e0, first_active = e, active
            norm = g.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            u = g / norm
            if q is not None:  # off the harm subspace: no move along what makes a prompt harmful
                u = u - (u @ q.T) @ q
            step = (eta * scale)[..., None] * u
            x = torch.where(active[..., None], x - step, x)
        if acc is not None and self.steps > 0:
            with torch.no_grad():
                finite = torch.isfinite(x).all(-1)
                e1 = self._model_on(layer, x.device)(
                    torch.where(finite[..., None], x, torch.zeros_like(x)), check=False
                )
            assert e0 is not None and first_active is not None  # self.steps > 0: the loop ran
            counted = rows_on.expand_as(e0)
            acc["positions"] = acc.get("positions", 0) + counted.sum()
            acc["steered"] = acc.get("steered", 0) + first_active.sum()
            acc["energy_before"] = acc.get("energy_before", 0) + torch.where(counted, e0, 0).sum()
            acc["energy_after"] = acc.get("energy_after", 0) + torch.where(counted, e1, 0).sum()
            acc["nonfinite"] = acc.get("nonfinite", torch.zeros((), dtype=torch.bool, device=x.device)) | bad
        return x

    def edit(
        self, site: Site, rows: torch.Tensor, strength: torch.Tensor, stats: dict[str, Any] | None = None
    ) -> torch.Tensor:
        n, d = rows.shape
        x = self.steer(site.layer, rows.float().view(n, 1, d), strength.view(n, 1, 1), stats)
        return x.view(n, d).to(rows.dtype)

    def finish(self, site_stats: dict[Site, dict[str, Any]], stats: dict[str, Any]) -> None:
        """Per steered layer: positions seen, positions moved, mean energy before and after (one device
        sync per layer); NaN/inf states at steered positions raise."""
        nonfinite = False
        summary: dict[int, dict[str, Any]] = {}  # by layer
        for site, a in site_stats.items():
            nonfinite = nonfinite or bool(a["nonfinite"])
            count = int(a["positions"])
            summary[site.layer] = {
                "positions": count,
                "steered": int(a["steered"]),
                "energy_before": float(a["energy_before"]) / count if count else None,
                "energy_after": float(a["energy_after"]) / count if count else None,
                "eta": self.eta[site.layer],
            }
        merge_stats(stats.setdefault("els", {}), cast(dict[str, Any], summary))  # keyed by layer
        if nonfinite:
            raise AligntaxError(
                "Energy steering met NaN/inf hidden states at steered positions; the model "
                "produced non-finite activations (try float32)."
            )

    # ---- the models and directions on the states' device ----------------------------------------------
    def _model_on(self, layer: int, device: torch.device) -> EnergyModel:
        """The layer's energy model on ``device`` (a copy, made once, when it lives elsewhere), eval mode."""
        key = (layer, str(device))
        m = self._device_models.get(key)
        if m is None:
            m = self.models[layer]
            if m.in_mean.device != torch.device(device):
                m = copy.deepcopy(m).to(device)
            m.eval()
            self._device_models[key] = m
        return m

    def _dirs_on(self, layer: int, device: torch.device) -> torch.Tensor | None:
        """The layer's harm directions ``[k, d]`` on ``device`` (float32), or None without any."""
        if not self.harm_dirs:
            return None
        key = (layer, str(device))
        q = self._device_dirs.get(key)
        if q is None:
            q = self._device_dirs[key] = self.harm_dirs[layer].to(device=device, dtype=torch.float32)
        return q
