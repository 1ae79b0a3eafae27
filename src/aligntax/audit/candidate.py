"""The change an audit measures (the candidate), and the checks made on it before any model is loaded.

A candidate is either an intervention on the baseline model (a registered steering method with its
folder and options, or a PEFT LoRA adapter: ``adapter``) or another checkpoint (``candidate_model``). A
demo folder (``aligntax demo --out DIR``) stands for the intervention its sweep selected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from aligntax.errors import CompatibilityError, ModelSpecError, UsageError

# the sidecar of each kind of intervention folder and where it keeps the model it was made for
_SIDECARS = (
    ("energy.json", "fingerprint"),
    ("vectors.json", "fingerprint"),
    ("els_lora.json", "fingerprint"),
    ("vat_adapter.json", "base_fingerprint"),
)
# the architecture fields of a fingerprint that a model's config.json also states
_ARCH = ("model_type", "num_layers", "hidden_size", "vocab_size")
# methods of the intervention registry that the audit does not take (none: the candidate is "nothing")
ADAPTER = "adapter"


@dataclass(frozen=True)
class Candidate:
    """What is compared with the baseline: ``model`` (another checkpoint) or ``intervention`` with its
    ``args`` on the baseline model; ``demo``: the demo folder it was read from."""

    intervention: str | None = None
    args: dict = field(default_factory=dict)
    model: str | None = None
    demo: str | None = None

    def describe(self) -> str:
        if self.model:
            return f"checkpoint {self.model}"
        shown = ", ".join(f"{k}={v}" for k, v in sorted(self.args.items()) if v is not None)
        where = f" (the selection of demo {self.demo})" if self.demo else ""
        return f"{self.intervention}" + (f" ({shown})" if shown else "") + where


def is_demo_folder(path: str | Path | None) -> bool:
    """A folder holding a selected setting (``selection.json``, the demo's choice) or, for a demo folder
    written before it recorded one, its steered evaluation (``steered/config.json``); not a steering
    folder itself."""
    from aligntax.interventions.selection import is_selection_dir

    if not path:
        return False
    p = Path(path)
    if not p.is_dir() or any((p / m).is_file() for m in ("energy.json", "els_lora.json", "vectors.json")):
        return False
    return is_selection_dir(p) or (p / "steered" / "config.json").is_file()


def demo_selection(folder: str | Path) -> Candidate:
    """The intervention a demo folder selected: its ``selection.json``
    (:func:`aligntax.interventions.selection.read_selection`) or, in a folder without one, the setting
    of its steered evaluation (``steered/config.json``), which ran the selection on the test sets."""
    from aligntax.interventions.selection import is_selection_dir, read_selection

    p = Path(folder)
    if is_selection_dir(p):
        name, args, _ = read_selection(p)
    else:
        cfg_path = p / "steered" / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text())
            name, args = cfg["intervention"], dict(cfg.get("intervention_args") or {})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(
                f"--steer {folder}: {cfg_path} is not a finished steered evaluation (which setting?)."
            ) from None
    if not name or name == "none":
        raise UsageError(f"--steer {folder}: the demo selected no setting (its sweep found none eligible).")
    return Candidate(intervention=str(name), args=dict(args), demo=str(folder))


def model_config(spec: str) -> dict | None:
    """The ``config.json`` of a model spec without loading weights: an embedded model (once fetched), a
    model folder, or a Hub model already in the local cache; None when none is at hand."""
    from aligntax.models.embedded import converted_dir
    from aligntax.models.spec import parse_spec

    try:
        ms = parse_spec(spec)
    except ModelSpecError:  # the loader says what is wrong with it, before loading anything
        return None
    path: Path | None = None
    if ms.kind == "embedded":
        path = converted_dir(ms.value) / "config.json"
    elif ms.kind == "dir":
        path = Path(ms.value) / "config.json"
    elif ms.kind == "hub":
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(ms.value, "config.json")
            path = Path(found) if isinstance(found, str) else None
        except Exception:  # noqa: BLE001 - no cache: nothing to compare
            path = None
    if path is None or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("text_config") or cfg if isinstance(cfg, dict) else None


def architecture(cfg: dict) -> dict:
    """The fingerprint fields a ``config.json`` states (model type, layers, width, vocabulary)."""

    def first(*keys):
        return next((cfg[k] for k in keys if isinstance(cfg.get(k), (int, str))), None)

    return {
        "model_type": first("model_type"),
        "num_layers": first("num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": first("hidden_size", "n_embd", "d_model"),
        "vocab_size": first("vocab_size"),
    }


def folder_fingerprint(folder: str | Path) -> tuple[str, dict] | None:
    """``(sidecar file, fingerprint)`` of the model an intervention folder was made for, or None."""
    for name, key in _SIDECARS:
        f = Path(folder) / name
        if f.is_file():
            try:
                fp = json.loads(f.read_text()).get(key)
            except (OSError, ValueError, AttributeError):
                return None
            return (name, fp) if isinstance(fp, dict) else None
    return None


def check_made_for(folder: str | Path, model: str, flag: str) -> None:
    """The intervention folder was made for a model of ``model``'s architecture (its sidecar's fingerprint
    against the model's ``config.json``); a mismatch is one line, before anything is loaded. Without a
    config at hand nothing is compared (the loaders compare the full fingerprint once the model is loaded)."""
    found = folder_fingerprint(folder)
    cfg = model_config(model)
    if found is None or cfg is None:
        return
    sidecar, fp = found
    have = architecture(cfg)
    diff = [
        f"{k} {fp.get(k)} vs {have[k]}"
        for k in _ARCH
        if fp.get(k) is not None and have[k] is not None and fp.get(k) != have[k]
    ]
    if diff:
        raise CompatibilityError(
            f"{flag} {folder} was made for {fp.get('spec') or 'another model'} ({sidecar}), not for {model}: "
            f"{'; '.join(diff)}."
        )


def check_candidate_model(model: str, candidate: str) -> None:
    """A candidate checkpoint reads the baseline's tokens: the same model type and vocabulary (from both
    ``config.json``; not compared when either is not at hand)."""
    a, b = model_config(model), model_config(candidate)
    if a is None or b is None:
        return
    x, y = architecture(a), architecture(b)
    diff = [
        f"{k} {y[k]} vs {x[k]}"
        for k in ("model_type", "vocab_size")
        if x[k] is not None and y[k] is not None and x[k] != y[k]
    ]
    if diff:
        raise CompatibilityError(
            f"--candidate-model {candidate} is not a checkpoint of {model}'s kind ({'; '.join(diff)}): "
            "an audit compares a model with a change of itself."
        )
