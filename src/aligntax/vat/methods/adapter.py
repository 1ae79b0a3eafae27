"""``adapter``: a PEFT LoRA adapter applied by forward hooks (:class:`LoRAAdapter`), read only. The
adapters ``lora`` and ``dpo`` train (:mod:`aligntax.vat.train`) are applied the same way; each carries
``vat_adapter.json`` beside it (its method, target and base model), and a folder holding an adapter
aligntax did not make is never written into (:func:`guard_adapter_folder`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from aligntax.errors import AligntaxError, CompatibilityError
from aligntax.interventions.base import Intervention, SteerContext, hooks_attached
from aligntax.interventions.options import option
from aligntax.vat.methods.base import VatContext, register_vat

__all__ = ["ADAPTER_META", "AdapterOptions", "LoRAAdapter", "guard_adapter_folder"]

ADAPTER_META = "vat_adapter.json"


def _adapter_sha(path: Path) -> str:
    h = hashlib.sha256()
    for name in ("adapter_model.safetensors", "adapter_model.bin", "adapter_config.json"):
        f = path / name
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _same_model(a: dict, b: dict) -> bool:
    keys = ("model_type", "num_layers", "hidden_size", "vocab_size", "embedding_digest")
    return all(a.get(k) == b.get(k) for k in keys)


_LORA_KEY = re.compile(r"^(?P<mod>.+)\.(?P<part>lora_A|lora_B)(?:\.[^.]+)?\.weight$")


def _read_lora(path: Path, cfg: dict, lm=None) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The (A, B, scale) of every adapted Linear layer of a PEFT LoRA adapter folder. Anything this
    hook-based application cannot reproduce exactly is refused with the offending keys named, never
    dropped: other PEFT types, DoRA, rank/alpha patterns, fan_in_fan_out layers, trained biases,
    ``modules_to_save`` (fully trained copies of layers), embedding LoRA, or any other tensor. With
    ``lm``, every adapted layer must exist in the model as a Linear of matching shape."""
    from safetensors.torch import load_file

    problems = []
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AligntaxError(
            f"{path}: only LoRA adapters are supported (got peft_type {cfg.get('peft_type')})"
        )
    from aligntax.interventions.lora import lora_config_problems, lora_scale

    problems += lora_config_problems(cfg)
    wfile = path / "adapter_model.safetensors"
    if wfile.is_file():
        state = load_file(str(wfile))
    elif (path / "adapter_model.bin").is_file():
        state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise AligntaxError(f"{path} has no adapter_model.safetensors or adapter_model.bin")
    scale = lora_scale(cfg)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unsupported = []
    for key, tensor in state.items():
        m = _LORA_KEY.match(key)
        if m is None or tensor.ndim != 2:
            unsupported.append(key)
            continue
        mod = m.group("mod").removeprefix("base_model.model.")
        pairs.setdefault(mod, {})[m.group("part")] = tensor.float()
    if unsupported:
        shown = ", ".join(unsupported[:6]) + (
            f" and {len(unsupported) - 6} more" if len(unsupported) > 6 else ""
        )
        problems.append(f"tensors other than Linear lora_A/lora_B weights: {shown}")
    half = [m for m, p in pairs.items() if len(p) != 2]
    if half:
        problems.append(f"layers with only one of lora_A/lora_B: {half[:4]}")
    if problems:
        raise AligntaxError(
            f"{path}: this LoRA adapter has parts that aligntax cannot apply exactly, and it "
            "refuses rather than drop them: " + "; ".join(problems)
        )
    weights = {m: (p["lora_A"], p["lora_B"], scale) for m, p in pairs.items()}
    if not weights:
        raise AligntaxError(f"No LoRA weights found in {path}")
    for m, (A, B, _) in weights.items():
        if A.shape[0] != B.shape[1]:
            raise AligntaxError(
                f"{path}: {m} has lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} of different ranks"
            )
        if lm is None:
            continue
        try:
            module = lm.model.get_submodule(m)
        except AttributeError:
            raise CompatibilityError(
                f"Adapter layer '{m}' of {path} does not exist in {lm.fingerprint.get('spec')}"
            ) from None
        if not isinstance(module, nn.Linear):
            raise CompatibilityError(f"Adapter layer '{m}' is a {type(module).__name__}, not a Linear layer")
        if (module.in_features, module.out_features) != (A.shape[1], B.shape[0]):
            raise CompatibilityError(
                f"Adapter layer '{m}' expects {A.shape[1]} -> {B.shape[0]} features but the model's layer is "
                f"{module.in_features} -> {module.out_features}: the adapter was made for another model"
            )
    return weights


def _is_ours(path: Path) -> bool:
    return (path / ADAPTER_META).is_file()


def guard_adapter_folder(path: str | Path, what: str = "write into") -> None:
    """Refuse to write into a folder that holds a PEFT adapter (adapter_config.json) that aligntax did
    not create (no vat_adapter.json beside it)."""
    path = Path(path)
    if (path / "adapter_config.json").is_file() and not _is_ours(path):
        raise AligntaxError(
            f"{path} holds an adapter (adapter_config.json) that aligntax did not create; "
            f"aligntax does not {what} it. Evaluate it with --adapter {path}, and choose "
            "another folder for training or output."
        )


@dataclass(eq=False)
class LoRAAdapter(Intervention):
    """A saved LoRA adapter applied through forward hooks: for each adapted Linear layer the hook adds
    ``scale * (x A^T) B^T`` to its output while attached. The model's weights and modules are never
    changed, so the base model is exactly restored on exit."""

    path: Path
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    meta: dict = field(default_factory=dict)
    name: str = "lora"

    @classmethod
    def load(cls, path: str | Path, lm=None) -> LoRAAdapter:
        """Load any PEFT LoRA adapter folder (read only: nothing is written there). Adapters trained by
        aligntax carry ``vat_adapter.json``, whose base-model fingerprint must match ``lm``; for others
        the layer names and shapes are checked against ``lm``."""
        path = Path(path)
        cfg_file = path / "adapter_config.json"
        if not cfg_file.is_file():
            raise AligntaxError(f"{path} is not a LoRA adapter folder (no adapter_config.json)")
        cfg = json.loads(cfg_file.read_text())
        meta = json.loads((path / ADAPTER_META).read_text()) if (path / ADAPTER_META).is_file() else {}
        if (
            lm is not None
            and meta.get("base_fingerprint")
            and not _same_model(meta["base_fingerprint"], lm.fingerprint)
        ):
            raise CompatibilityError(
                f"Adapter {path} was trained on {meta['base_fingerprint'].get('spec')}, "
                f"not on {lm.fingerprint.get('spec')}"
            )
        weights = _read_lora(path, cfg, lm)
        name = meta.get("method", "lora" if meta else "adapter")
        return cls(path=path, weights=weights, meta=meta, name=name)

    @contextmanager
    def attach(self, model: nn.Module, ctx: SteerContext) -> Iterator[None]:
        regs = []
        for mod_name, (A, B, scale) in self.weights.items():
            try:
                module = model.get_submodule(mod_name)
            except AttributeError as exc:
                raise CompatibilityError(f"Adapter layer '{mod_name}' does not exist in this model") from exc
            cache: dict = {}

            def hook(module, args, kwargs, output, A=A, B=B, scale=scale, cache=cache):
                x = args[0] if args else kwargs["input"]
                key = (x.device, x.dtype)
                if key not in cache:
                    cache[key] = (A.to(device=x.device, dtype=x.dtype), B.to(device=x.device, dtype=x.dtype))
                a, b = cache[key]
                return output + scale * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)

            regs.append((module, hook, False))
        with hooks_attached(regs):
            yield

    def config(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "sha": _adapter_sha(self.path),
            "target": self.meta.get("target"),
            "method": self.meta.get("method"),
            "steps": self.meta.get("steps"),
        }


@dataclass
class AdapterOptions:
    adapter: str | None = option(
        "evaluate this PEFT LoRA adapter folder (read only; implies --intervention adapter)"
    )


@register_vat("adapter", AdapterOptions, "an existing PEFT LoRA adapter, read only")
def _adapter(ctx: VatContext, o: AdapterOptions) -> Intervention:
    if o.adapter is None:
        raise AligntaxError("The adapter intervention needs --adapter PATH (a PEFT LoRA adapter folder)")
    return LoRAAdapter.load(o.adapter, ctx.lm)
