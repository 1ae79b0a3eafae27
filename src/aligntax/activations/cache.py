"""Activation caches on disk: safetensors shards plus one JSON sidecar.

Layout of a cache folder::

    cache.json              # fingerprint, layers, position, hidden size, metadata, and per shard:
                            #   file, prompt ids, labels, row count
    shard-00000.safetensors # "layer.<l>": float32 [rows, d] per layer, "row_index": int64 [rows]
    shard-00001.safetensors

A shard is written first and only then listed in ``cache.json`` (each written atomically), so an
interrupted capture leaves a consistent cache and :func:`capture_to_cache` resumes where it stopped.
Nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from aligntax.artefacts import check_fingerprint, check_format, read_json, save_tensors, write_json
from aligntax.errors import CompatibilityError, DataError

FORMAT = "aligntax.activations/1"
SIDECAR = "cache.json"


@dataclass
class ActivationCache:
    """Captured activations for N prompts at some layers.

    ``acts[layer]`` has one row per prompt for positions ``last``/``mean`` (``row_index`` is None) or
    one row per response token for ``response`` (``row_index[r]`` is the prompt of row r).
    ``labels`` holds one JSON value per prompt (e.g. ``{"label": "harmful", "refused": true}``).
    """

    acts: dict[int, torch.Tensor]
    position: str = "last"
    prompt_ids: list[str] = field(default_factory=list)
    labels: list = field(default_factory=list)
    row_index: torch.Tensor | None = None
    fingerprint: dict = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.acts = {int(k): v.float().contiguous() for k, v in self.acts.items()}
        rows = {v.shape[0] for v in self.acts.values()}
        if len(rows) > 1:
            raise DataError(f"Activation layers have different row counts: {sorted(rows)}")
        n_rows = rows.pop() if rows else 0
        if not self.prompt_ids:
            n = (
                n_rows
                if self.row_index is None
                else (int(self.row_index.max()) + 1 if len(self.row_index) else 0)
            )
            self.prompt_ids = [str(i) for i in range(n)]
        self.prompt_ids = [str(p) for p in self.prompt_ids]
        if len(set(self.prompt_ids)) != len(self.prompt_ids):
            raise DataError("Duplicate prompt ids in the activation cache.")
        if self.labels and len(self.labels) != len(self.prompt_ids):
            raise DataError(f"{len(self.prompt_ids)} prompts but {len(self.labels)} labels.")
        if self.row_index is None and n_rows != len(self.prompt_ids):
            raise DataError(f"{len(self.prompt_ids)} prompt ids but {n_rows} activation rows.")
        if self.row_index is not None and len(self.row_index) != n_rows:
            raise DataError(f"row_index has {len(self.row_index)} entries for {n_rows} rows.")

    @property
    def layers(self) -> list[int]:
        return sorted(self.acts)

    @property
    def hidden_size(self) -> int:
        return int(next(iter(self.acts.values())).shape[-1]) if self.acts else 0

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.acts[int(layer)]

    # ---- disk -------------------------------------------------------------------------------------
    def _sidecar_header(self) -> dict:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "layers": self.layers,
            "position": self.position,
            "hidden_size": self.hidden_size,
            "metadata": self.metadata,
            "shards": [],
        }

    def _shard_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"layer.{layer}": a.contiguous() for layer, a in self.acts.items()}
        index = self.row_index if self.row_index is not None else torch.arange(len(self.prompt_ids))
        tensors["row_index"] = index.long().contiguous()
        return tensors

    def save(self, directory: str | Path) -> Path:
        """Write the cache as a single shard, replacing any cache already in ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("shard-*.safetensors"):
            old.unlink()
        (directory / SIDECAR).unlink(missing_ok=True)
        return self.append_to(directory)

    def append_to(self, directory: str | Path) -> Path:
        """Append these prompts as a new shard of the cache in ``directory`` (created if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        side = directory / SIDECAR
        if side.is_file():
            meta = read_json(side)
            _check_format(meta, directory)
            check_fingerprint(meta.get("fingerprint"), self.fingerprint or None, "activation cache")
            if meta["layers"] != self.layers or meta["position"] != self.position:
                raise CompatibilityError(
                    f"Cannot append to {directory}: it holds layers {meta['layers']} at position "
                    f"'{meta['position']}', these are layers {self.layers} at '{self.position}'."
                )
            if meta.get("hidden_size") and self.acts and meta["hidden_size"] != self.hidden_size:
                raise CompatibilityError(
                    f"Cannot append to {directory}: hidden size {meta['hidden_size']} "
                    f"there, {self.hidden_size} here."
                )
            seen = {p for s in meta["shards"] for p in s["prompt_ids"]}
            dup = seen.intersection(self.prompt_ids)
            if dup:
                raise DataError(f"Prompt ids already in {directory}: {sorted(dup)[:5]}")
            meta["metadata"] = {**meta.get("metadata", {}), **self.metadata}
        else:
            meta = self._sidecar_header()
        name = f"shard-{len(meta['shards']):05d}.safetensors"
        save_tensors(self._shard_tensors(), directory / name, FORMAT)
        meta["shards"].append(
            {
                "file": name,
                "n_prompts": len(self.prompt_ids),
                "n_rows": int(next(iter(self.acts.values())).shape[0]) if self.acts else 0,
                "prompt_ids": self.prompt_ids,
                "labels": list(self.labels),
            }
        )
        write_json(side, meta)
        return directory

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_fingerprint: dict | None = None,
        layers: Sequence[int] | None = None,
    ) -> ActivationCache:
        """Load all shards (optionally only some layers); refuse a cache made for another model."""
        directory = Path(directory)
        side = directory / SIDECAR
        if not side.is_file():
            raise DataError(f"No activation cache in {directory} (missing {SIDECAR}).")
        meta = read_json(side)
        _check_format(meta, directory)
        check_fingerprint(meta.get("fingerprint"), expect_fingerprint, f"activation cache {directory}")
        want = [int(x) for x in (layers if layers is not None else meta["layers"])]
        missing = set(want) - set(meta["layers"])
        if missing:
            raise DataError(
                f"Activation cache {directory} has layers {meta['layers']}, not {sorted(missing)}."
            )
        acts: dict[int, list[torch.Tensor]] = {layer: [] for layer in want}
        ids: list[str] = []
        labels: list = []
        rows: list[torch.Tensor] = []
        for shard in meta["shards"]:
            tensors = load_file(str(directory / shard["file"]))
            for layer in want:
                acts[layer].append(tensors[f"layer.{layer}"])
            rows.append(tensors["row_index"] + len(ids))
            ids += shard["prompt_ids"]
            labels += shard.get("labels") or [None] * shard["n_prompts"]
        d = int(meta.get("hidden_size") or 0)
        cat = {layer: torch.cat(v) if v else torch.empty(0, d) for layer, v in acts.items()}
        row_index = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        if meta["position"] != "response":
            row_index = None
        if all(lab is None for lab in labels):
            labels = []
        return cls(
            cat,
            meta["position"],
            ids,
            labels,
            row_index,
            meta.get("fingerprint") or {},
            meta.get("metadata") or {},
        )

    @staticmethod
    def saved_ids(directory: str | Path) -> set[str]:
        """Prompt ids already in the cache at ``directory`` (empty if there is none)."""
        side = Path(directory) / SIDECAR
        if not side.is_file():
            return set()
        return {p for s in read_json(side)["shards"] for p in s["prompt_ids"]}


def _check_format(meta: dict, directory: Path) -> None:
    check_format(meta, FORMAT, directory / SIDECAR, "activation cache")


def capture_to_cache(
    lm,
    prompts: Sequence[str | list[dict]],
    prompt_ids: Sequence[str],
    layers,
    directory: str | Path,
    position: str = "last",
    labels: Sequence | None = None,
    system: str | None = None,
    responses: Sequence[str] | None = None,
    shard_size: int = 256,
    batch_size: int = 32,
    progress: bool = True,
    metadata: dict | None = None,
    intervention=None,
) -> ActivationCache:
    """Capture into ``directory`` shard by shard, skipping prompt ids already there; return the whole cache."""
    from aligntax.activations.capture import capture, resolve_layers

    if len(prompt_ids) != len(prompts):
        raise DataError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt ids.")
    if labels is not None and len(labels) != len(prompts):
        raise DataError(f"{len(prompts)} prompts but {len(labels)} labels.")
    layer_ids = resolve_layers(lm.model, layers)
    done = ActivationCache.saved_ids(directory)
    todo = [i for i, pid in enumerate(prompt_ids) if str(pid) not in done]
    meta = {**(metadata or {}), "system": system}
    for start in range(0, len(todo), shard_size):
        idx = todo[start : start + shard_size]
        out = capture(
            lm,
            [prompts[i] for i in idx],
            layer_ids,
            position,
            system,
            batch_size,
            [responses[i] for i in idx] if responses is not None else None,
            progress,
            intervention,
            return_index=True,
        )
        acts, rows = out
        ActivationCache(
            acts,
            position,
            [str(prompt_ids[i]) for i in idx],
            [labels[i] for i in idx] if labels is not None else [],
            rows if position == "response" else None,
            dict(lm.fingerprint),
            meta,
        ).append_to(directory)
    if not Path(directory, SIDECAR).is_file():
        raise DataError("Nothing to capture: no prompts given.")
    return ActivationCache.load(directory, expect_fingerprint=lm.fingerprint or None)
