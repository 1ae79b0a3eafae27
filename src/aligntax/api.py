"""The top-level library entry points, re-exported lazily by :mod:`aligntax`:
:func:`load_model` and :func:`load_intervention`."""

from __future__ import annotations

from pathlib import Path

from aligntax.errors import AligntaxError
from aligntax.models.loader import as_loaded_model, load_model

__all__ = ["load_intervention", "load_model"]


def load_intervention(dir_or_name: str | Path, lm=None, tokenizer=None, **options):
    """An :class:`~aligntax.interventions.base.Intervention` from a name or a saved folder.

    - a name of :data:`aligntax.interventions.registry.INTERVENTIONS` (``"els"``, ``"refusal-ablation"``,
      ``"system-prompt"``, ...): built by :func:`~aligntax.interventions.registry.make_intervention`
      with ``options`` (``dir=`` for the ones that load a folder);
    - a folder: an energy bank (it holds ``energy.json``) is ELS, an ``aligntax els distill`` adapter
      (``els_lora.json``) is els-lora (``scale=``); a vector folder (``vectors.json``)
      needs ``name=`` the vector method (``refusal-add``, ``refusal-ablation``,
      ``false-refusal-ablation``, ``cast``). ``name=`` also overrides the ELS default.

    - a folder holding a selected setting (``selection.json``: the folder ``aligntax demo`` writes): exactly
      that setting (``options`` override it);
    - a steering bundle (a folder with ``bundle.json``, or a Hub id ``org/name``): its method and setting
      (:func:`aligntax.bundles.from_pretrained`; ``options`` override the setting).

    ``lm`` (a :class:`~aligntax.models.loader.LoadedModel` from :func:`load_model`, or a plain transformers
    ``PreTrainedModel`` with its ``tokenizer``) checks the artefact's model fingerprint; the dtype the
    model runs in does not matter (an artefact made in float32 fits the model in bfloat16)."""
    from aligntax.energy.bank import SIDECAR as ENERGY_SIDECAR
    from aligntax.interventions.options import PATH_KEYS
    from aligntax.interventions.registry import INTERVENTIONS, make_intervention
    from aligntax.interventions.vectors import SIDECAR as VECTORS_SIDECAR

    if lm is not None:
        lm = as_loaded_model(lm, tokenizer)
    text = str(dir_or_name)
    name = options.pop("name", None)
    if name is None and text in INTERVENTIONS:
        return make_intervention(text, lm, **options)
    path = Path(text).expanduser()
    from aligntax.bundles.bundle import MANIFEST, from_pretrained
    from aligntax.bundles.card import is_hub_id

    if (path / MANIFEST).is_file() or (not path.is_dir() and is_hub_id(text)):  # a steering bundle
        return from_pretrained(text, lm, **({"name": name} if name else {}), **options)
    if not path.is_dir():
        raise AligntaxError(
            f"{text!r} is neither an intervention name ({', '.join(INTERVENTIONS)}) nor a folder."
        )
    from aligntax.interventions.selection import is_selection_dir, read_selection

    if name is None and is_selection_dir(path):  # a setting selected on validation (aligntax demo's folder)
        name, selected, _ = read_selection(path)
        return make_intervention(name, lm, **{**selected, **options})
    if name is None:
        if (path / ENERGY_SIDECAR).is_file():
            name = "els"
        elif (path / "els_lora.json").is_file():  # ELS distilled into a LoRA adapter (aligntax els distill)
            name = "els-lora"
        elif (path / VECTORS_SIDECAR).is_file():
            raise AligntaxError(
                f"{path} holds steering vectors: say which method with name= (refusal-add, refusal-ablation, "
                "false-refusal-ablation or cast)."
            )
        else:
            raise AligntaxError(
                f"{path} holds neither an energy bank ({ENERGY_SIDECAR}) nor vectors ({VECTORS_SIDECAR})."
            )
    if any(k in options for k in PATH_KEYS):
        raise AligntaxError("Give the folder once: as the first argument or as dir=, not both.")
    return make_intervention(name, lm, dir=str(path), **options)
