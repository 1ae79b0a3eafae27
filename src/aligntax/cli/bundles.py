"""``aligntax bundle save|push|pull`` and ``aligntax export``, mounted by :func:`mount`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from aligntax.cli.options import fail
from aligntax.errors import AligntaxError

bundle_app = typer.Typer(
    help="Steering bundles: pack a trained steering folder with a model card; share it on "
    "the Hugging Face Hub.",
    no_args_is_help=True,
)


def _fail(exc: Exception) -> None:
    fail(exc)


def _options(pairs: list[str] | None) -> dict:
    """``KEY=VALUE`` pairs; a value is read as JSON when it parses (numbers, lists, true/false, null)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AligntaxError(f"--set takes KEY=VALUE, got {pair!r}.")
        try:
            out[key.strip().replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip().replace("-", "_")] = value
    return out


@bundle_app.command("save")
def bundle_save(
    source: Path = typer.Argument(
        ...,
        help="steering folder: an `aligntax els train` folder, an `aligntax els distill` adapter folder, "
        "or a vector folder",
    ),
    out: Path = typer.Option(..., help="new bundle folder"),
    method: str | None = typer.Option(
        None,
        help="els (default for a folder with energy.json), els-lora (default for a folder with "
        "els_lora.json), refusal-ablation, refusal-add, false-refusal-ablation or cast",
    ),
    results: list[Path] | None = typer.Option(
        None,
        "--results",
        help="an `aligntax eval` run folder made with this "
        "steering and setting, or unsteered (repeatable): its rates go into "
        "the card",
    ),
    setting: list[str] | None = typer.Option(
        None,
        "--set",
        help="KEY=VALUE of the setting (e.g. eta=0.35, "
        "layers=[19], gate=true; scale=0.5 for els-lora; layer=20, coeff=1.0); repeatable",
    ),
    base_model: str | None = typer.Option(None, help="the base model's Hub id, for the card"),
    repo_id: str | None = typer.Option(None, help="the Hub repository the card's loading lines name"),
) -> None:
    """Pack a steering folder into a bundle (safetensors, JSON, model card)."""
    from aligntax.bundles import save_pretrained

    try:
        path = save_pretrained(
            source,
            out,
            method=method,
            results=[str(r) for r in results or []],
            base_model=base_model,
            repo_id=repo_id,
            **_options(setting),
        )
    except AligntaxError as exc:
        _fail(exc)
    print(path)


@bundle_app.command("push")
def bundle_push(
    folder: Path = typer.Argument(..., help="bundle folder (aligntax bundle save)"),
    repo_id: str = typer.Option(..., help="Hub repository, org/name"),
    token: str | None = typer.Option(None, help="Hub token (default: HF_TOKEN or the saved login)"),
    private: bool = typer.Option(True, help="create the repository private"),
) -> None:
    """Upload a bundle to a Hugging Face Hub model repository (created if missing)."""
    from aligntax.bundles import push_to_hub

    try:
        info = push_to_hub(folder, repo_id, token=token, private=private)
    except AligntaxError as exc:
        _fail(exc)
    print(getattr(info, "commit_url", None) or info)


@bundle_app.command("pull")
def bundle_pull(
    ref: str = typer.Argument(..., help="Hub id (org/name) of a bundle"),
    out: Path = typer.Option(..., help="folder to download into"),
    revision: str | None = typer.Option(None, help="branch, tag or commit"),
) -> None:
    """Download a bundle (safetensors, JSON and Markdown only) into a folder usable as --steer / --vectors."""
    from aligntax.bundles import load_bundle

    try:
        b = load_bundle(ref, revision=revision, local_dir=out)
    except AligntaxError as exc:
        _fail(exc)
    print(b.path)


def export_command(
    intervention: str = typer.Option(
        ...,
        help="refusal-ablation, false-refusal-ablation, refusal-add (refusal-addition: the same) or els-lora",
    ),
    vectors: Path | None = typer.Option(None, help="vector folder (aligntax els train writes DIR/vectors)"),
    steer: Path | None = typer.Option(None, help="els-lora: the adapter folder (aligntax els distill)"),
    lora_scale: float | None = typer.Option(None, help="els-lora: the adapter's scale (default 1)"),
    out: Path = typer.Option(
        ..., help="new Hugging Face model folder; with --format gguf, the new .gguf file"
    ),
    format: str = typer.Option(
        "hf",
        "--format",
        help="hf: a Hugging Face model folder; gguf: one GGUF file with the tokenizer and chat template "
        "(llama.cpp, ollama; Qwen2 and Llama models)",
    ),
    layer: int | None = typer.Option(
        None,
        help="the vector's layer (default: the folder's); addition: also the block whose input receives it",
    ),
    coeff: float | None = typer.Option(
        None, help="addition: scale of the vector (default 1); ablation: must be 1"
    ),
    model: str | None = typer.Option(None, help="model spec (default: the vector folder's model)"),
    dtype: str = typer.Option(
        "bf16", help="dtype the model is loaded and written in (bf16, fp16 or fp32; GGUF: bf16, f16, f32)"
    ),
) -> None:
    """Write a model with a vector intervention baked into its weights, or the els-lora adapter merged into
    them: a plain Hugging Face folder, or one GGUF file (--format gguf)."""
    from aligntax.bundles.export import FORMATS, canonical_method, export_lora_model, export_model
    from aligntax.models import load_model

    try:
        from aligntax.cli.options import UsageError, check_out_folder

        if format not in FORMATS:
            raise UsageError(f"--format {format}: use one of {', '.join(FORMATS)}.")
        check_out = _check_gguf_out if format == "gguf" else check_out_folder
        dtype = {"f32": "fp32", "f16": "fp16"}.get(dtype, dtype)
        if canonical_method(intervention) == "els-lora":
            if steer is None or vectors is not None:
                raise AligntaxError(
                    "els-lora is exported from its adapter folder: give --steer DIR (not --vectors)."
                )
            check_out(out)
            side = steer / "els_lora.json"
            spec = model or (
                (json.loads(side.read_text()).get("fingerprint") or {}).get("spec")
                if side.is_file()
                else None
            )
            if not spec:
                raise AligntaxError("Give --model: the adapter folder names no model.")
            lm = load_model(spec, dtype=dtype, device="cpu")
            print(export_lora_model(lm, steer, out, scale=lora_scale, format=format))
            return
        if vectors is None or steer is not None or lora_scale is not None:
            raise AligntaxError(
                f"{intervention} is exported from a vector folder: give --vectors DIR "
                "(--steer and --lora-scale are for els-lora)."
            )
        check_out(out)
        if not (vectors / "vectors.json").is_file():
            raise AligntaxError(
                f"--vectors {vectors} holds no vectors.json: not a vector folder "
                "(aligntax els train writes DIR/vectors)."
            )
        spec = (
            model or (json.loads((vectors / "vectors.json").read_text()).get("fingerprint") or {}).get("spec")
            if (vectors / "vectors.json").is_file()
            else model
        )
        if not spec:
            raise AligntaxError("Give --model: the vector folder names no model.")
        lm = load_model(spec, dtype=dtype, device="cpu")
        scale = {} if coeff is None else {"coeff": coeff}  # export_model's default otherwise
        path = export_model(lm, vectors, intervention, out, layer=layer, format=format, **scale)
    except AligntaxError as exc:
        _fail(exc)
    print(path)


def _check_gguf_out(out: Path) -> None:
    """``--out`` of a GGUF export: a new file whose name ends in .gguf, in a folder (made if missing)."""
    from aligntax.cli.options import UsageError, check_out_folder

    if out.suffix != ".gguf":
        raise UsageError(f"--out {out}: a GGUF export is one file; give a name ending in .gguf.")
    if out.exists():
        raise UsageError(f"--out {out} exists; choose a new file for the exported model.")
    check_out_folder(out.parent)


def mount(app: typer.Typer) -> None:
    """Add ``bundle`` and ``export`` to the ``aligntax`` command line."""
    app.add_typer(bundle_app, name="bundle")
    app.command("export")(export_command)
