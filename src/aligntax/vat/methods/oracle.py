"""Validation oracles: known-answer interventions (``oracle``: the target's items only; ``uniform``:
every item) that move the judge's label distribution by a set amount, so the pipeline's metrics can
be checked against the answer they must give."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aligntax.errors import AligntaxError
from aligntax.interventions.base import Intervention
from aligntax.interventions.options import option
from aligntax.vat.items import ValueItem
from aligntax.vat.methods.base import VatContext, register_vat
from aligntax.vat.schwartz import resolve_value

__all__ = ["OracleBias", "OracleOptions"]


@dataclass
class OracleBias(Intervention):
    """A known-answer intervention for validating the pipeline. The model runs unchanged; for each item
    in scope the judge's label distribution gets a logit bias toward the value-consistent label (the top
    of the scale for a supporting action, the bottom for a violating one).

    - ``scope="target"`` (``oracle``): only the target's items are biased, so every off-target drift is
      exactly 0 and the gain is the set ``gain``.
    - ``scope="all"`` (``uniform``): every item is biased alike: a uniform lift of all ten values, whose
      specificity S_T is 0.
    - ``gain``: the bias is solved per item (closed form) so that the item's polarity-signed expected
      score moves by exactly ``gain`` Likert points (items that cannot move that far get the most their
      distribution allows, bias 30). ``bias``: a fixed logit bias instead.
    """

    target: str = ""
    scope: str = "target"
    gain: float | None = 0.5
    bias: float | None = None
    name: str = "oracle"
    prefix_free = True
    max_bias: float = 30.0

    def __post_init__(self):
        self.target = resolve_value(self.target)
        if self.scope not in ("target", "all"):
            raise AligntaxError("OracleBias scope must be 'target' or 'all'")
        if (self.gain is None) == (self.bias is None):
            raise AligntaxError("OracleBias needs exactly one of gain and bias")
        if self.gain is not None and self.gain < 0:
            raise AligntaxError("the oracle gain must be >= 0 (it moves toward the value-consistent label)")
        self.name = "oracle" if self.scope == "target" else "uniform"
        self.capped = 0

    def adjust_probs(self, item: ValueItem, probs, points):
        """New label probabilities (canonical order) for ``item``, or None to leave it unchanged."""
        import numpy as np

        if (self.scope == "target" and item.value != self.target) or item.polarity == 0:
            return None  # neutral items have no value-consistent label
        c = len(points) - 1 if item.polarity > 0 else 0
        p = np.asarray(probs, dtype=float)
        p = p / p.sum()  # stored readings sum to 1 only up to float32 rounding
        e0 = float(p @ points)
        if self.bias is not None:
            u = math.expm1(self.bias)
        else:
            goal = e0 + (self.gain if item.polarity > 0 else -self.gain)
            room = points[c] - goal
            if p[c] <= 0 or (room <= 0 if item.polarity > 0 else room >= 0):
                self.capped += 1
                u = math.expm1(self.max_bias)
            else:
                u = (goal - e0) / (p[c] * room)
        q = p.copy()
        q[c] = p[c] * (1.0 + u)
        return q / q.sum()

    def config(self) -> dict:
        return {
            "name": self.name,
            "target": self.target,
            "scope": self.scope,
            "gain": self.gain,
            "bias": self.bias,
        }


@dataclass
class OracleOptions:
    oracle_gain: float = option(
        "oracle/uniform: the shift each biased item gets (Likert points)",
        0.5,
        parse="float",
        check="nonnegative",
    )
    oracle_bias: float | None = option(
        "oracle/uniform: a fixed logit bias instead of --oracle-gain", parse="float", check="finite"
    )


def _oracle(scope: str):
    def build(ctx: VatContext, o: OracleOptions) -> Intervention:
        return OracleBias(
            target=ctx.target,
            scope=scope,
            gain=None if o.oracle_bias is not None else o.oracle_gain,
            bias=o.oracle_bias,
        )

    return build


register_vat("oracle", OracleOptions, "validation: a known logit bias on the target's items only")(
    _oracle("target")
)
register_vat("uniform", OracleOptions, "validation: the same bias on every item (a uniform lift)")(
    _oracle("all")
)
