"""What a run folder's samples were made with, beyond its settings: the model's fingerprint, the content
of the intervention's folder and the judge's weights. Kept in ``provenance.json`` next to
``config.json``, so that a resumed run can refuse to mix samples made with another model, another
trained intervention or another judge under the same settings.

Each entry is checked only when both the saved and the current value are known: runs made before
this file existed (or whose model or judge was not loaded yet) stay resumable.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from aligntax.errors import AligntaxError

PROVENANCE_NAME = "provenance.json"
# The files of an artefact folder its loaders read: tensors and JSON at its top level (a tuned setting
# such as ELS's sweep/best.json is checked by intervention.json, the resolved settings, instead), less
# the files of a run folder, which change as runs write them, and a training run's summary (its wall
# times change when a finished training is resumed; nothing steers by it).
_DIGEST_SUFFIXES = (".safetensors", ".json", ".pt", ".bin", ".npy", ".npz")
_RUN_FILES = frozenset(
    {"config.json", "results.json", "provenance.json", "intervention.json", "train_summary.json"}
)
# fingerprint keys that identify the weights (``spec`` is how the model was named: checked by the settings)
_FINGERPRINT_KEYS = ("model_type", "num_layers", "hidden_size", "vocab_size", "embedding_digest")


class ProvenanceMismatch(AligntaxError):
    """A resumed run's model, intervention folder or judge is not the one its samples were made with."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def folder_digest(folder: str | Path, previous: dict | None = None) -> dict | None:
    """``{"path", "sha256", "files": {name: {"size", "mtime_ns", "sha256"}}}`` over the tensor and JSON
    files at the top of an artefact folder; None when ``folder`` is not a folder. A file whose size and
    mtime match ``previous`` keeps its recorded hash (no re-reading: cheap on every resume)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    names = sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file()
        and p.suffix.lower() in _DIGEST_SUFFIXES
        and not p.name.startswith(".")
        and p.name not in _RUN_FILES
    )
    known = (previous or {}).get("files", {}) if isinstance(previous, dict) else {}
    files, total = {}, hashlib.sha256()
    for name in names:
        st = (folder / name).stat()
        old = known.get(name)
        if (
            isinstance(old, dict)
            and old.get("size") == st.st_size
            and old.get("mtime_ns") == st.st_mtime_ns
            and old.get("sha256")
        ):
            digest = old["sha256"]
        else:
            digest = _sha256_file(folder / name)
        files[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        total.update(f"{name}\0{digest}\n".encode())
    return {"path": str(folder), "sha256": total.hexdigest(), "files": files}


def intervention_folder(args: dict | None) -> str | None:
    """The artefact folder in an intervention's arguments (``path``, ``dir`` or ``directory``)."""
    args = args or {}
    for key in ("path", "dir", "directory"):
        if isinstance(args.get(key), str) and args[key]:
            return args[key]
    return None


def judge_identity(judge) -> dict:
    """What identifies a judge's verdicts: its name, the hash of its weights where it has some (the
    classifier's ``weights_sha256``) and its settings; ``sha256`` over all of it."""
    meta = getattr(judge, "meta", None)
    ident: dict = {"name": getattr(judge, "name", type(judge).__name__)}
    if isinstance(meta, dict) and meta.get("weights_sha256"):
        ident["weights_sha256"] = meta["weights_sha256"]
        ident["settings"] = {k: getattr(judge, k, None) for k in ("threshold", "short_refusal_floor")}
    else:
        try:
            cfg = judge.config()
        except Exception:  # pragma: no cover - a judge without a config
            cfg = {}
        ident["settings"] = {k: v for k, v in cfg.items() if k not in ("name", "weights")}
    text = json.dumps(ident, sort_keys=True, default=str)
    return {**ident, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def read_provenance(out: Path) -> dict:
    path = Path(out) / PROVENANCE_NAME
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_provenance(out: Path, data: dict) -> None:
    from aligntax.runs.fsio import write_json_atomic

    write_json_atomic(Path(out) / PROVENANCE_NAME, data)


def check_model(out: Path, saved: dict | None, current: dict | None) -> None:
    """Refuse when the loaded model's fingerprint differs from the one the samples were made with."""
    if not saved or not current:
        return
    from aligntax.artefacts import fingerprint_diffs

    diffs = [
        f"{k}: {saved[k]!r} -> {current[k]!r}" for k in fingerprint_diffs(saved, current, _FINGERPRINT_KEYS)
    ]
    if diffs:
        raise ProvenanceMismatch(
            f"{out} was run with another model: its fingerprint changed ({'; '.join(diffs)}); the weights "
            "under the same model spec are not the ones the saved samples were made with. Use another --out, "
            "or delete the folder to start again."
        )


def check_intervention(out: Path, saved: dict | None, current: dict | None) -> None:
    """Refuse when the intervention folder's files changed since the samples were made."""
    if not saved or not current or saved.get("sha256") == current.get("sha256"):
        return
    old, new = saved.get("files", {}), current.get("files", {})
    changed = sorted(n for n in set(old) & set(new) if old[n].get("sha256") != new[n].get("sha256"))
    added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    what = "; ".join(
        part
        for part in (
            f"changed: {', '.join(changed)}" if changed else "",
            f"added: {', '.join(added)}" if added else "",
            f"removed: {', '.join(removed)}" if removed else "",
        )
        if part
    )
    raise ProvenanceMismatch(
        f"{out} was run with other contents of the intervention folder {current.get('path')} ({what}); "
        "samples made with the old and the new artefact would mix. Use another --out, or delete the folder "
        "to start again."
    )


def check_judge(out: Path, saved: dict | None, current: dict | None) -> None:
    """Refuse when the judge (its weights or settings) differs from the one the samples were judged with."""
    if not saved or not current or saved.get("sha256") == current.get("sha256"):
        return
    diffs = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in ("name", "weights_sha256", "settings")
        if saved.get(k) != current.get(k)
    ]
    raise ProvenanceMismatch(
        f"{out} was judged with another judge ({'; '.join(diffs)}): the {current.get('name')} judge's weights "
        "or settings changed. Use another --out, or `aligntax rejudge` the folder with the new judge first."
    )
