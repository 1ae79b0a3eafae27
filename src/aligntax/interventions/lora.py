"""ELS distilled into a LoRA adapter (``els-lora``): the adapter ``aligntax els distill`` trains, applied
by hooks.

The folder is a standard peft LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) plus
the aligntax sidecar ``els_lora.json`` (format, the model fingerprint, the adapted blocks and modules,
the hyper-parameters, the ELS folder it was distilled from). Loading reads safetensors and JSON only
(a folder holding a pickle-based file such as ``adapter_model.bin`` is refused) and refuses an adapter
made for another model.

:class:`ElsLora` adds ``lora_scale * s * B (A x)`` (``s = lora_alpha / r``) to the output of every
adapted Linear layer through forward hooks, so the user's model is never changed: the hooks live inside
:meth:`~aligntax.interventions.base.Intervention.attach` and are removed on exit. At ``lora_scale`` 0
no hook is attached at all, so the logits are exactly the unsteered model's. The adapter acts at every
position (it has no per-row decision: the harm distinction is in its weights), so no prompt prefix is
computed without it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aligntax.artefacts import check_fingerprint
from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.hooks import hooks_attached
from aligntax.interventions.base import Intervention, SteerContext
from aligntax.interventions.options import need_path, option, register

if TYPE_CHECKING:
    from aligntax.models.loader import LoadedModel

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "FORMAT",
    "SIDECAR",
    "ElsLora",
    "is_els_lora_dir",
    "read_lora_weights",
]

FORMAT = "aligntax.els-lora/1"
SIDECAR = "els_lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# files that unpickle when read: never loaded, and a folder holding one is refused
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_LORA_KEY = re.compile(r"^(?P<mod>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


def is_els_lora_dir(path: str | Path | None) -> bool:
    """Whether ``path`` is a folder written by ``aligntax els distill`` (it holds ``els_lora.json``)."""
    return path is not None and (Path(path) / SIDECAR).is_file()


def _check_folder(path: Path) -> None:
    if not path.is_dir():
        raise AligntaxError(
            f"{path} is not a folder (an els-lora adapter folder from `aligntax els distill`)."
        )
    pickled = sorted(p.name for p in path.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickled:
        raise AligntaxError(
            f"{path} holds {', '.join(pickled)}: pickle-based files are never loaded; an els-lora "
            f"adapter is {ADAPTER_WEIGHTS} with {ADAPTER_CONFIG} and {SIDECAR}."
        )
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, SIDECAR):
        if not (path / name).is_file():
            raise AligntaxError(
                f"{path} is not an els-lora adapter folder: {name} is missing "
                "(write one with `aligntax els distill`)."
            )


def lora_config_problems(cfg: dict[str, Any]) -> list[str]:
    """The settings of a LoRA ``adapter_config.json`` that hooks adding ``s * B @ A`` to Linear outputs
    cannot reproduce exactly (the peft type is checked by the caller)."""
    problems = []
    if cfg.get("use_dora"):
        problems.append("use_dora (DoRA magnitude vectors)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("rank_pattern/alpha_pattern")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out (Conv1D layers)")
    if cfg.get("bias", "none") not in (None, "none"):
        problems.append(f"bias={cfg.get('bias')!r} (trained biases)")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save={cfg.get('modules_to_save')} (fully trained layers)")
    return problems


def lora_scale(cfg: dict[str, Any]) -> float:
    """A LoRA adapter's scale: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    return alpha / r**0.5 if cfg.get("use_rslora") else alpha / r


def read_lora_weights(
    path: str | Path, cfg: dict[str, Any]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{module name: (A [r, in], B [out, r], s)}`` of a peft LoRA folder (``s = alpha / r``, or
    ``alpha / sqrt(r)`` with rsLoRA), float32. Anything hooks cannot reproduce exactly (DoRA, rank or
    alpha patterns, trained biases, modules to save, tensors other than Linear LoRA weights) is refused."""
    from safetensors.torch import load_file

    path = Path(path)
    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {cfg.get('peft_type')!r}")
    problems += lora_config_problems(cfg)
    s = lora_scale(cfg)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / ADAPTER_WEIGHTS)).items():
        m = _LORA_KEY.match(key)
        if m is None or tensor.ndim != 2:
            problems.append(f"tensor {key}")
            continue
        pairs.setdefault(m.group("mod").removeprefix("base_model.model."), {})[m.group("part")] = (
            tensor.float()
        )
    half = sorted(m for m, p in pairs.items() if len(p) != 2)
    if half:
        problems.append(f"layers with only one of lora_A/lora_B: {half[:4]}")
    if problems:
        raise AligntaxError(
            f"{path}: this adapter has parts an els-lora adapter does not: " + "; ".join(problems)
        )
    if not pairs:
        raise AligntaxError(f"{path}: the adapter holds no LoRA weights.")
    return {m: (p["lora_A"], p["lora_B"], s) for m, p in sorted(pairs.items())}


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        h.update((path / name).read_bytes())
    return h.hexdigest()


class ElsLora(Intervention):
    """A distilled ELS adapter applied by forward hooks (see the module docstring)."""

    name = "els-lora"
    kernel_only = False  # hooks on the linear layers, not a row kernel

    def __init__(
        self,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
        scale: float = 1.0,
        meta: dict[str, Any] | None = None,
        path: str | Path | None = None,
    ):
        if not weights:
            raise AligntaxError("An els-lora adapter needs at least one adapted layer.")
        scale = float(scale)
        if not (scale == scale and abs(scale) != float("inf")):
            raise AligntaxError(f"lora_scale must be a finite number; got {scale}.")
        self.weights = weights
        self.scale = scale
        self.meta = dict(meta or {})
        self.path = None if path is None else Path(path)
        self._sha = _sha(self.path) if self.path is not None else None

    @classmethod
    def load(cls, path: str | Path, lm: LoadedModel | None = None, scale: float | None = None) -> ElsLora:
        """Read an ``aligntax els distill`` folder; with ``lm``, refuse it when it was made for another
        model (fingerprint, then every adapted layer's name and shape)."""
        path = Path(path)
        _check_folder(path)
        meta = json.loads((path / SIDECAR).read_text())
        if meta.get("format") != FORMAT:
            raise AligntaxError(f"{path / SIDECAR} has format {meta.get('format')!r}, not {FORMAT!r}.")
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        if lm is not None:
            check_fingerprint(
                meta.get("fingerprint"),
                dict(lm.fingerprint) if lm.fingerprint else None,
                f"els-lora adapter {path}",
            )
        weights = read_lora_weights(path, cfg)
        if lm is not None:
            check_modules(lm.model, weights, str(path))
        return cls(weights, 1.0 if scale is None else scale, meta, path)

    @property
    def layers(self) -> list[int]:
        return list(self.meta.get("layers") or [])

    @contextmanager
    def attach(
        self,
        model: nn.Module,
        ctx: SteerContext,
        row_mask: Callable[[], torch.Tensor | None] | None = None,
    ) -> Iterator[None]:
        """The adapter's hooks for one batched call. ``row_mask``: a callable giving, when a layer runs,
        a ``[batch]`` bool tensor of the rows the update is added to (None from it: every row)."""
        if self.scale == 0.0:  # nothing to add: the model runs exactly as unsteered
            yield
            return
        check_modules(model, self.weights, str(self.path or "adapter"))
        regs = []
        for mod_name, (a, b, s) in self.weights.items():
            cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

            def hook(
                module: nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                output: torch.Tensor,
                a: torch.Tensor = a,
                b: torch.Tensor = b,
                s: float = s * self.scale,
                cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = cache,
            ) -> torch.Tensor | None:
                x = args[0] if args else kwargs["input"]
                mask = row_mask() if row_mask is not None else None
                if mask is not None and not bool(mask.any()):
                    return None  # no row of the batch takes the adapter
                if x.device not in cache:
                    cache[x.device] = (a.to(x.device), b.to(x.device))
                a_, b_ = cache[x.device]
                delta = nn.functional.linear(nn.functional.linear(x.to(a_.dtype), a_), b_) * s
                if mask is not None:
                    delta = delta * mask.to(device=delta.device, dtype=delta.dtype).view(
                        -1, *[1] * (delta.dim() - 1)
                    )
                return output + delta.to(output.dtype)

            regs.append((model.get_submodule(mod_name), hook, False))
        with hooks_attached(regs):
            yield

    def merged_deltas(self) -> dict[str, torch.Tensor]:
        """``{module name: lora_scale * s * B @ A}`` (float32): what merging adds to each weight."""
        return {m: (b @ a) * (s * self.scale) for m, (a, b, s) in self.weights.items()}

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": None if self.path is None else str(self.path),
            "lora_scale": self.scale,
            "adapter_sha256": self._sha,
            "layers": self.layers,
            "source": (self.meta.get("source") or {}).get("path"),
        }


@dataclass
class ElsLoraOptions:
    path: str | None = option(
        "energy model folder (implies --intervention els), or an els-lora adapter folder "
        "(aligntax els distill)",
        flag="--steer",
    )
    scale: float | None = option(
        "els-lora: multiplier of the adapter's update (0: the unsteered model; default 1)",
        flag="--lora-scale",
        parse="float",
        check="finite",
    )


@register(
    "els-lora", ElsLoraOptions, "ELS distilled into a LoRA adapter (aligntax els distill), applied by hooks"
)
def _els_lora(lm: LoadedModel | None, o: ElsLoraOptions) -> ElsLora:
    return ElsLora.load(need_path("els-lora", o.path), lm, scale=o.scale)


def check_modules(model: nn.Module, weights: dict[str, Any], what: str) -> None:
    """Every adapted layer exists in ``model`` as a Linear layer of the adapter's shape."""
    for name, (a, b, _) in weights.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CompatibilityError(
                f"Layer '{name}' of {what} does not exist in this model: the adapter was "
                "made for another model."
            ) from None
        if not isinstance(module, nn.Linear) or (module.in_features, module.out_features) != (
            a.shape[1],
            b.shape[0],
        ):
            raise CompatibilityError(
                f"Layer '{name}' of {what} expects a Linear {a.shape[1]} -> {b.shape[0]}, but "
                f"the model's is {type(module).__name__} "
                f"{getattr(module, 'in_features', '?')} -> {getattr(module, 'out_features', '?')}: "
                "the adapter was made for another model."
            )
