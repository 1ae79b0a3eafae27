"""Steering bundles: a trained steering folder packed to be shared like an adapter.

A bundle is a folder of safetensors and JSON files plus a model card::

    README.md            model card: YAML front matter (library_name: aligntax, base model and fingerprint,
                         method, setting, training data, measured rates) and how to load it
    bundle.json          format, method, setting, base model, training data, measured rates, files
    energy.json, energy.safetensors, gate.json, gate.safetensors, sweep/best.json, train_config.json   (ELS)
    vectors.json, vectors.safetensors                                                               (vectors)
    adapter_config.json, adapter_model.safetensors, els_lora.json            (els-lora: ELS distilled, peft)

The steering files keep their own formats, so a bundle folder is also a steering folder for every
command (``--steer DIR`` for ELS and els-lora, ``--vectors DIR``). An ELS bundle's ``sweep/best.json`` holds the
bundle's setting, so the folder resolves to it everywhere. Folders are read in place; Hub ids are
downloaded with ``huggingface_hub.snapshot_download`` (safetensors, JSON and Markdown only). A folder
holding any other file (a pickle, a ``.bin``) is refused.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from aligntax.bundles.card import (
    check_run_fingerprint,
    hub_base_model,
    is_hub_id,
    read_run,
    render_card,
)
from aligntax.errors import AligntaxError, DataError

__all__ = [
    "ALLOWED_SUFFIXES",
    "Bundle",
    "check_files",
    "from_pretrained",
    "load_bundle",
    "push_to_hub",
    "resolve_bundle",
    "save_pretrained",
]

FORMAT = "aligntax.bundle/1"
MANIFEST = "bundle.json"
CARD = "README.md"
ALLOWED_SUFFIXES = (".safetensors", ".json", ".md")
ALLOW_PATTERNS = ["*.safetensors", "*.json", "*.md", "**/*.safetensors", "**/*.json", "**/*.md"]
VECTOR_METHODS = ("refusal-add", "refusal-ablation", "false-refusal-ablation", "cast")
METHODS = ("els", "els-lora", *VECTOR_METHODS)
_ELS_FILES = ("energy.json", "energy.safetensors", "gate.json", "gate.safetensors", "train_config.json")
_VECTOR_FILES = ("vectors.json", "vectors.safetensors")
_LORA_FILES = ("adapter_config.json", "adapter_model.safetensors", "els_lora.json")
# what the card records of an els-lora adapter's distillation (its els_lora.json)
_LORA_RECORD = ("source", "layers", "target_block", "steered_layers", "modules", "hyper", "data", "loss")


@dataclass
class Bundle:
    """A bundle folder and its manifest."""

    path: Path
    manifest: dict

    @property
    def method(self) -> str:
        return self.manifest["method"]

    @property
    def setting(self) -> dict:
        return dict(self.manifest.get("setting") or {})

    def intervention(self, lm=None, **options):
        """The bundle's intervention for ``lm`` (its fingerprint checked); ``options`` override the setting
        (``name=`` another method of the same vectors, without the bundle's setting)."""
        from aligntax.interventions.registry import make_intervention

        name = options.pop("name", None) or self.method
        if name == "els":  # the setting is the folder's sweep/best.json
            return make_intervention("els", lm, dir=str(self.path), **options)
        if self.method in ("els", "els-lora") and name != self.method:
            what = "ELS energy models" if self.method == "els" else "an els-lora adapter"
            raise AligntaxError(f"Bundle {self.path} holds {what}, not vectors for '{name}'.")
        base = self.setting if name == self.method else {}
        return make_intervention(name, lm, dir=str(self.path), **{**base, **options})


# ---- files ---------------------------------------------------------------------------------------------------
def check_files(folder: str | Path) -> list[str]:
    """The bundle's files (relative paths); DataError naming any file that is not safetensors, JSON or
    Markdown (hidden files and folders, such as ``.git``, are not part of a bundle and are skipped)."""
    folder = Path(folder)
    files, bad = [], []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not p.is_file():
            continue
        (files if p.suffix.lower() in ALLOWED_SUFFIXES else bad).append(rel.as_posix())
    if bad:
        raise DataError(
            f"{folder} holds files a steering bundle may not contain: {', '.join(bad)}. Bundles hold "
            "safetensors, JSON and Markdown only (no pickles or other code-carrying formats)."
        )
    return files


def _els_setting(source: Path, options: dict) -> dict:
    """The ELS setting a bundle records: the options a sweep tunes, and any other one given."""
    from aligntax.interventions.els import TUNED_KEYS, resolve_settings

    setting, _ = resolve_settings(source, **options)
    return {k: v for k, v in setting.items() if k in TUNED_KEYS or k in options}


def _els_best(source: Path, setting: dict) -> dict:
    """``sweep/best.json`` of the bundle: the setting, with the source sweep's validation scores when the
    sweep selected exactly this setting."""
    from aligntax.interventions.els import tuned_settings

    path = source / "sweep" / "best.json"
    if path.is_file() and tuned_settings(source) is not None and _els_setting(source, {}) == setting:
        src = json.loads(path.read_text())
        row = {k: v for k, v in (src.get("best") or {}).items() if k != "key"}
        return {
            "best": {**row, "args": dict(setting)},
            "selected": "on validation data by aligntax els sweep",
            **{k: src[k] for k in ("method", "max_new_tokens", "benign", "harmful", "knowns") if k in src},
        }
    return {"best": {"args": dict(setting)}, "selected": "given when the bundle was saved"}


def _training_data(source: Path, method: str, vectors_meta: dict | None) -> dict:
    """What the steering was trained on, as the folder records it (``vectors_meta``: a vector folder's
    metadata, or what an els-lora folder records of its distillation)."""
    if method == "els-lora":
        return {"distillation": dict(vectors_meta or {})}
    cfg_path = (source if method == "els" else source.parent) / "train_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
    if method == "els":
        bank = json.loads((source / "energy.json").read_text()).get("metadata") or {}
        out: dict = {
            "energy_models": {
                k: bank[k]
                for k in (
                    "benign",
                    "harmful",
                    "judge",
                    "n_benign",
                    "n_harmful",
                    "benign_refused",
                    "harmful_refused",
                    "n_states",
                )
                if k in bank
            }
        }
        if (source / "gate.json").is_file():
            info = json.loads((source / "gate.json").read_text()).get("info") or {}
            out["harm_gate"] = {
                k: info[k] for k in ("benign", "harmful", "n", "n_harmful", "recall_target") if k in info
            }
        if cfg:
            out["train_config"] = {
                k: cfg[k]
                for k in (
                    "model",
                    "benign",
                    "harmful",
                    "harmless",
                    "limit_benign",
                    "limit_harmful",
                    "limit_harmless",
                    "gate_benign",
                    "gate_harmful",
                    "limit_gate_benign",
                    "limit_gate_harmful",
                    "judge",
                    "max_new_tokens",
                    "dtype",
                    "seed",
                )
                if k in cfg
            }
        return out
    out = {"vectors": {k: v for k, v in (vectors_meta or {}).items()}}
    if cfg and source.name == "vectors" and (source.parent / "energy.json").is_file():
        # aligntax els train: refusal = harmful - harmless, false refusal = benign look-alikes - harmless
        out["prompts"] = {
            "harmful": cfg.get("harmful"),
            "limit_harmful": cfg.get("limit_harmful"),
            "harmless": cfg.get("harmless"),
            "limit_harmless": cfg.get("limit_harmless"),
            "pseudo_harmful": cfg.get("benign"),
            "limit_pseudo_harmful": cfg.get("limit_benign"),
            "model": cfg.get("model"),
            "dtype": cfg.get("dtype"),
        }
    else:
        out["prompts"] = "not recorded in the vector folder"
    return out


def _vectors_source(source: Path) -> Path:
    if (source / "vectors.json").is_file():
        return source
    if (source / "vectors" / "vectors.json").is_file():
        return source / "vectors"
    raise DataError(f"{source} holds no steering vectors (vectors.json, or vectors/vectors.json).")


def _config_of(iv) -> dict:
    return _strip(iv.config())


def _check_run(
    run_dir: Path, source: Path, method: str, files: list[str], iv_cfg: dict, fingerprint: dict
) -> dict:
    """The rates of a run made with this steering (or unsteered), refusing runs of other steering."""
    rates, prov, iv = read_run(run_dir)
    check_run_fingerprint(prov.get("model_fingerprint") or {}, fingerprint, str(run_dir))
    if rates.intervention == "none":
        return rates.to_dict()
    if rates.intervention != method:
        raise AligntaxError(
            f"Run {run_dir} used the intervention '{rates.intervention}', not this bundle's "
            f"'{method}' (give its own runs, or unsteered ones)."
        )
    recorded = (prov.get("intervention") or {}).get("files") or {}
    if not recorded:
        raise AligntaxError(
            f"Run {run_dir} records no digest of its steering folder (provenance.json), so its rates "
            "cannot be tied to this folder."
        )
    checked = [f for f in files if f in recorded]
    if not any(f.endswith(".safetensors") for f in checked) or any(
        recorded[f].get("sha256") != _sha256(source / f) for f in checked
    ):
        raise AligntaxError(
            f"Run {run_dir} was made with another steering folder than {source} (its files differ)."
        )
    if _strip(iv) != iv_cfg:
        raise AligntaxError(
            f"Run {run_dir} steered with another setting ({json.dumps(_strip(iv))}) than the bundle's "
            f"({json.dumps(iv_cfg)})."
        )
    return rates.to_dict()


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _strip(cfg: dict) -> dict:
    """An intervention's config without where its folders lay (the files are compared by their sha256)."""
    cfg = json.loads(json.dumps(cfg or {}, default=str))
    return {k: v for k, v in cfg.items() if k not in ("source", "settings_from", "path")}


# ---- save / load ----------------------------------------------------------------------------------------
def save_pretrained(
    source: str | Path,
    out: str | Path,
    method: str | None = None,
    results=(),
    base_model: str | None = None,
    repo_id: str | None = None,
    **options,
) -> Path:
    """Pack the steering folder ``source`` into the bundle folder ``out`` (new or empty); returns it.

    ``method``: ``els`` (default for a folder with ``energy.json``), ``els-lora`` (default for an
    ``aligntax els distill`` folder, which holds ``els_lora.json``) or a vector method (``refusal-ablation``,
    ``refusal-add``, ``false-refusal-ablation``, ``cast``; the vectors of ``source`` or ``source/vectors``).
    ``options``: the setting (as ``make_intervention`` takes it: ``eta=``, ``layers=``, ``gate=`` ... for
    ELS, on top of the folder's tuned setting; ``scale=`` for els-lora; ``layer=``, ``coeff=`` ... for
    vectors). ``results``: run
    folders of ``aligntax eval`` made with this steering and setting (or unsteered), whose rates go
    into the card; runs of another model, folder or setting are refused. ``base_model``: the base
    model's Hub id for the card, when the fingerprint's spec is not one. ``repo_id``: named in the card."""
    from aligntax.interventions.registry import make_intervention

    source = Path(source).expanduser()
    if not source.is_dir():
        raise AligntaxError(f"{source} is not a folder.")
    if method is None:
        if (source / "els_lora.json").is_file():
            method = "els-lora"
        elif (source / "energy.json").is_file():
            method = "els"
        else:
            raise AligntaxError(
                f"{source} holds no energy bank and no els-lora adapter: say which vector method to "
                "bundle (method=, --method)."
            )
    if method not in METHODS:
        raise AligntaxError(f"Unknown bundle method '{method}'; use one of {', '.join(METHODS)}.")
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise AligntaxError(f"{out} exists and is not empty; choose a new folder for the bundle.")
    options = {k: v for k, v in options.items() if v is not None}
    vectors_meta = None
    if method == "els":
        setting = _els_setting(source, options)
        iv = make_intervention("els", None, dir=str(source), **options)
        files = [f for f in _ELS_FILES if (source / f).is_file()]
        art = json.loads((source / "energy.json").read_text())
        folder = source
    elif method == "els-lora":
        iv = make_intervention("els-lora", None, dir=str(source), **options)
        setting = {"scale": iv.scale}
        files = list(_LORA_FILES)
        art = dict(iv.meta)
        vectors_meta = {k: art[k] for k in _LORA_RECORD if k in art}
        folder = source
    else:
        folder = _vectors_source(source)
        iv = make_intervention(method, None, dir=str(folder), **options)
        vmeta = json.loads((folder / "vectors.json").read_text())
        vectors_meta = vmeta.get("metadata") or {}
        setting = {**_vector_defaults(method, vmeta), **options}
        files = list(_VECTOR_FILES)
        art = vmeta
    fingerprint = dict(art.get("fingerprint") or {})
    iv_cfg = _config_of(iv)
    runs = [_check_run(Path(r), folder, method, files, iv_cfg, fingerprint) for r in results]
    spec = fingerprint.get("spec")
    manifest = {
        "format": FORMAT,
        "method": method,
        "setting": setting,
        "intervention": iv_cfg,
        "base_model": {
            "spec": spec,
            "hub_id": base_model or hub_base_model(spec),
            "fingerprint": fingerprint,
        },
        "training_data": _training_data(folder, method, vectors_meta),
        "results": runs,
        "files": [],
        "repo_id": repo_id,
    }
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(folder / f, out / f)
    if method == "els":
        (out / "sweep").mkdir()
        (out / "sweep" / "best.json").write_text(json.dumps(_els_best(source, setting), indent=2) + "\n")
    manifest["files"] = sorted([*check_files(out), MANIFEST, CARD])
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    (out / CARD).write_text(render_card(manifest))
    return out


def _vector_defaults(method: str, vmeta: dict) -> dict:
    """The vector method's layer made explicit (the folder's chosen layer), so the card states it."""
    if method == "cast":
        return {}
    kind = "false_refusal" if method == "false-refusal-ablation" else "refusal"
    layers = sorted(int(x) for x in (vmeta.get("vectors") or {}).get(kind, []))
    chosen = (vmeta.get("metadata") or {}).get("layer")
    if not layers:
        raise DataError(f"The vector folder holds no '{kind}' vectors for {method}.")
    return {
        "layer": int(chosen) if chosen is not None and int(chosen) in layers else layers[len(layers) // 2]
    }


def resolve_bundle(
    ref: str | Path,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | Path | None = None,
    local_dir: str | Path | None = None,
) -> Path:
    """A local folder as it is, or a Hub id downloaded (safetensors, JSON and Markdown only); its files
    checked (:func:`check_files`)."""
    text = str(ref)
    path = Path(text).expanduser()
    if path.is_dir():
        check_files(path)
        return path
    if not is_hub_id(text):
        raise AligntaxError(f"{text!r} is neither a bundle folder nor a Hub id (org/name).")
    from huggingface_hub import snapshot_download

    try:
        got = snapshot_download(
            text,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            local_dir=local_dir,
            allow_patterns=ALLOW_PATTERNS,
            library_name="aligntax",
        )
    except Exception as exc:  # network, authentication, missing repository: one clear message
        raise AligntaxError(
            f"Could not download the bundle {text!r} from the Hugging Face Hub: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from exc
    got = Path(got)
    check_files(got)
    return got


def load_bundle(ref: str | Path, **download) -> Bundle:
    """The bundle at a folder or Hub id (see :func:`resolve_bundle`)."""
    path = resolve_bundle(ref, **download)
    man = path / MANIFEST
    if not man.is_file():
        raise DataError(
            f"{path} is not a steering bundle (no {MANIFEST}); save one with aligntax bundle save."
        )
    manifest = json.loads(man.read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{man} is not an aligntax bundle (format {manifest.get('format')!r}).")
    if manifest.get("method") not in METHODS:
        raise DataError(f"{man} names an unknown method {manifest.get('method')!r}.")
    missing = [f for f in manifest.get("files") or [] if not (path / f).is_file()]
    if missing:
        raise DataError(f"Bundle {path} lacks files its manifest lists: {', '.join(missing)}.")
    return Bundle(path, manifest)


def from_pretrained(
    ref: str | Path, lm=None, revision: str | None = None, token: str | None = None, **options
):
    """The intervention of the bundle at ``ref`` (a folder or a Hub id) for ``lm`` (fingerprint checked);
    ``options`` override its setting."""
    return load_bundle(ref, revision=revision, token=token).intervention(lm, **options)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    token: str | None = None,
    private: bool = True,
    commit_message: str | None = None,
    revision: str | None = None,
):
    """Upload a bundle folder to the Hub model repository ``repo_id`` (created when missing), through
    ``HfApi().create_repo`` and ``upload_folder``; safetensors, JSON and Markdown only. Returns the
    commit info ``upload_folder`` returns."""
    from huggingface_hub import HfApi

    b = load_bundle(folder)
    if b.manifest.get("repo_id") != repo_id:  # the card's loading lines name the repository
        b.manifest["repo_id"] = repo_id
        (b.path / MANIFEST).write_text(json.dumps(b.manifest, indent=2, default=str) + "\n")
        (b.path / CARD).write_text(render_card(b.manifest))
    api = HfApi(token=token)
    api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=str(b.path),
        repo_type="model",
        token=token,
        revision=revision,
        allow_patterns=ALLOW_PATTERNS,
        commit_message=commit_message or f"aligntax steering bundle ({b.method})",
    )
