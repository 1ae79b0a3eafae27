"""Command-line building blocks shared by :mod:`aligntax.cli` and the optional sub-commands (lm-eval,
bundles, serve, vat): the one error path, the checks every command runs before it loads a model or
writes to ``--out``, and the steering options every steering command gets from the intervention
registry (:mod:`aligntax.interventions.options`), declared once.

The error path: every failure ends with one line on stderr (``error: ...``, rich markup escaped so
install hints such as ``pip install 'aligntax[lmeval]'`` keep their brackets) and exit status 2 for a
usage error (a bad option value, an unknown name, a bad path; :class:`~aligntax.errors.AligntaxError`)
or 1 for a runtime failure (any other exception). ``--debug`` or ``ALIGNTAX_DEBUG=1`` also prints the
traceback."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
import traceback
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as click_exc

from aligntax.config import load_config
from aligntax.errors import AligntaxError, UsageError
from aligntax.interventions.options import Method, check_value, flag_of, spec_of
from aligntax.interventions.registry import INTERVENTIONS, cli_options, grid_values, intervention_args
from aligntax.interventions.selection import is_selection_dir, read_selection

__all__ = [
    "AligntaxGroup",
    "InterventionOpt",
    "check_datasets",
    "check_intervention",
    "check_judge",
    "check_layers",
    "check_out_file",
    "check_out_folder",
    "check_port",
    "check_range",
    "deprecated",
    "DeviceOpt",
    "DtypeOpt",
    "ensure_datasets",
    "ModelOpt",
    "ProgressOpt",
    "ProgressOrConfigOpt",
    "resolve_model",
    "use_device",
    "fail",
    "grid_options",
    "model_num_layers",
    "settings_options",
    "steering_options",
]

console = Console(stderr=True)
_DEBUG = {"on": False}


def debug_enabled() -> bool:
    return _DEBUG["on"] or os.environ.get("ALIGNTAX_DEBUG", "").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
    )


def set_debug(on: bool) -> None:
    _DEBUG["on"] = bool(on)


def exit_code(exc: BaseException) -> int:
    """2 for a usage error (an :class:`AligntaxError` unless its class says otherwise), 1 for the rest."""
    if isinstance(exc, AligntaxError):
        return int(getattr(exc, "exit_code", 2))
    if isinstance(exc, click_exc.UsageError):
        return 2
    return 1


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def fail(exc: BaseException, code: int | None = None) -> typing.NoReturn:
    """Print one line on stderr (``error: ...``; the traceback too under ``--debug``) and exit with
    ``code`` (default: 2 for a usage error, 1 for a runtime failure)."""
    if debug_enabled() and exc.__traceback__ is not None:
        traceback.print_exception(exc, file=sys.stderr)
    message = _one_line(str(exc)) or type(exc).__name__
    if not isinstance(exc, (AligntaxError, click_exc.UsageError)):
        message = f"{type(exc).__name__}: {message}"
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(exit_code(exc) if code is None else code)


def deprecated(old: str, new: str) -> None:
    """One line on stderr: ``old`` still works, ``new`` is its name now."""
    console.print(f"note: {escape(old)} is deprecated; use {escape(new)}", soft_wrap=True, highlight=False)


# Option spellings removed in 0.2 (CHANGELOG.md): (the command, or None for any) -> the spelling now.
# Typing one is a usage error naming its replacement.
REMOVED_OPTIONS: dict[str, tuple[str | None, str]] = {
    "--sample": (None, "--temperature T (above 0 samples)"),
    "--energy-dir": ("vat run", "--steer"),
    "--layers": ("els sweep", "--layers-grid"),
}


def removed_option(exc: click_exc.NoSuchOption) -> UsageError | None:
    """The error for an option spelling removed in 0.2 (:data:`REMOVED_OPTIONS`), else None."""
    name = exc.option_name
    command, new = REMOVED_OPTIONS.get(name, (None, ""))
    path = exc.ctx.command_path if exc.ctx is not None else ""
    if not new or (command is not None and not path.endswith(" " + command)):
        return None
    return UsageError(f"{name} was removed in 0.2; use {new} (CHANGELOG.md).")


class AligntaxGroup(TyperGroup):
    """The root command group: whatever a command raises (or click's own usage errors) ends in
    :func:`fail`, so every failure looks the same."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, KeyboardInterrupt, click_exc.NoArgsIsHelpError):
            raise
        except click_exc.NoSuchOption as exc:
            fail(removed_option(exc) or UsageError(exc.format_message()))
        except click_exc.UsageError as exc:
            fail(UsageError(exc.format_message()))
        except Exception as exc:  # noqa: BLE001 - the one error path of the command line
            fail(exc)


# ---------------------------------------------------------------- checks before loading or writing
def check_range(value: Any, check: str, flag: str) -> Any:
    """A command's own option (``--max-new-tokens``, ``--batch-size``, ...) against a range rule of
    :data:`aligntax.interventions.options.CHECKS`."""
    return check_value(value, check, flag)


def check_port(port: int | None, flag: str = "--port") -> None:
    if port is not None and not 0 <= int(port) <= 65535:  # 0: any free port (the OS chooses)
        raise UsageError(f"{flag} takes a TCP port from 0 (any free one) to 65535, not {port}.")


def check_out_folder(out: str | Path | None, flag: str = "--out") -> None:
    """``--out`` names a run folder: refused when it is an existing file (or inside one), or when it
    (or the folder it would be made in) cannot be written: a read-only file system, no permission."""
    if out is None:
        return
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {out} is an existing file; give a folder (new, or a run folder to resume).")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{flag} {out}: {parent} is a file, not a folder.")
            break
    from aligntax.runfolder import check_writable

    check_writable(path, flag)


def check_out_file(out: str | Path | None, flag: str = "--out") -> None:
    """``--out`` names an output file: refused when it is a folder or its folder does not exist."""
    if out is None:
        return
    path = Path(out).expanduser()
    if path.is_dir():
        raise UsageError(f"{flag} {out} is a folder; give a file name (e.g. {Path(out) / 'out.jsonl'}).")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {out}: the folder {path.parent} does not exist.")


def check_judge(name: str | None) -> None:
    if name is None:
        return
    from aligntax.judges.registry import available_judges

    known = available_judges()
    if name.strip().lower() not in known:
        raise UsageError(f"Unknown judge '{name}'; choose one of: {', '.join(known)}.")


def check_datasets(specs: list[str] | None, flag: str = "--data") -> None:
    """Each spec is a named dataset, an existing file or a Hub id (read the same way
    :func:`aligntax.data.load_prompts` reads it); nothing is loaded."""
    from aligntax.data.api import not_found_message
    from aligntax.data.hub import HUB_PREFIX, looks_like_hub_id
    from aligntax.data.registry import find_dataset

    for spec in specs or []:
        text = str(spec).strip()
        if not text:
            raise UsageError(f"{flag}: empty dataset spec; give a file path, a named dataset or a Hub id.")
        if (
            text.startswith(HUB_PREFIX)
            or find_dataset(text) is not None
            or Path(text).expanduser().exists()
            or looks_like_hub_id(text)
        ):
            continue
        raise UsageError(f"{flag}: {not_found_message(text)}")


def ensure_datasets(names: list[str] | None, progress: bool = True, what: str = "data") -> None:
    """Fetch the named datasets among ``names`` that no data root holds yet (from their pinned upstream, or
    ``ALIGNTAX_DATA_MIRROR``), saying so, with a progress bar; files, Hub ids and datasets present are left
    alone. When they cannot be fetched: a DataError naming the one command that fetches them. Called before
    a command loads its model."""
    from aligntax.data.fetch import fetch_datasets, missing_datasets
    from aligntax.errors import DataError

    missing = missing_datasets([str(n) for n in names or []])
    if not missing:
        return
    command = "aligntax data fetch " + " ".join(missing)
    mirror = os.environ.get("ALIGNTAX_DATA_MIRROR")
    where = f"the mirror {mirror}" if mirror else "their pinned upstream"
    console.print(
        f"{escape(f'[{what}]')} fetching {len(missing)} dataset{'s' if len(missing) > 1 else ''} no data root "
        f"holds yet, from {escape(where)}: {', '.join(missing)} (`{command}`)",
        soft_wrap=True,
        highlight=False,
    )
    try:
        fetch_datasets(missing, progress=progress)
    except AligntaxError as exc:
        raise DataError(
            f"{', '.join(missing)} could not be fetched ({_one_line(str(exc))[:300]}). Fetch them with "
            f"`{command}` (with ALIGNTAX_DATA_MIRROR=DIR from a mirror written by `aligntax data mirror`), "
            "or set ALIGNTAX_DATA to a folder holding them."
        ) from None


def _config_layers(cfg: dict) -> int | None:
    for block in (cfg, cfg.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(block.get(key), int):
                return block[key]
    return None


def gguf_num_layers(path: str | Path) -> int | None:
    """The decoder blocks of a .gguf file from its metadata (``{architecture}.block_count``); tensors are
    memory-mapped, not read. None when the file does not say."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception:  # noqa: BLE001 - an unreadable file fails later with the loader's own message
        return None

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    count = value(f"{arch}.block_count") if isinstance(arch, str) else None
    return int(count) if isinstance(count, int) else None


def _hub_config(repo: str) -> Path | None:
    """A Hub model's config.json: from the cache, else downloaded alone (a few kB; the weights are not).
    Offline (``HF_HUB_OFFLINE``) and not cached: None, and the loader says so. A Hub that cannot be
    reached raises the loader's one-line error here, before anything else is done."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, "config.json")
    except Exception:  # noqa: BLE001 - no cache
        found = None
    if isinstance(found, str):
        return Path(found)
    from aligntax.models.loader import hub_offline

    if hub_offline():
        return None
    try:
        return Path(hf_hub_download(repo, "config.json"))
    except Exception as exc:  # noqa: BLE001 - reported as the loader reports it
        from aligntax.errors import ModelSpecError

        raise ModelSpecError(
            f"Could not load Hub model '{repo}': its config.json could not be read "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}). Use an embedded model "
            f"or a local path, or check the id and the network."
        ) from exc


def _model_config(spec: str | None) -> dict | None:
    """The ``config.json`` of model ``spec`` without loading weights (its text config for a multimodal
    model): of a model folder, of the embedded model (cached), of a Hub model (cached, else that file
    alone is downloaded); a .gguf file's block count as ``num_hidden_layers``. None when no config is at
    hand (offline, not cached). A bad spec raises its usage error."""
    from aligntax.models.embedded import converted_dir
    from aligntax.models.spec import DEFAULT_MODEL, parse_spec

    ms = parse_spec(spec or DEFAULT_MODEL)
    path: Path | None = None
    if ms.kind == "embedded":
        path = converted_dir(ms.value) / "config.json"
    elif ms.kind == "dir":
        path = Path(ms.value) / "config.json"
    elif ms.kind == "gguf":
        n = gguf_num_layers(ms.value)
        return None if n is None else {"num_hidden_layers": n}
    elif ms.kind == "hub":
        path = _hub_config(ms.value)
    if path is None or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def model_num_layers(spec: str | None) -> int | None:
    """The number of decoder blocks of model ``spec`` without loading weights (:func:`_model_config`);
    None when no config is at hand. A bad spec raises its usage error."""
    cfg = _model_config(spec)
    return None if cfg is None else _config_layers(cfg)


def model_facts(spec: str | None) -> dict:
    """What the config of model ``spec`` says of the fingerprint keys an artefact is checked by
    (``model_type``, ``num_layers``, ``hidden_size``), without loading weights; {} when unknown."""
    cfg = _model_config(spec) or {}
    facts = {
        "model_type": cfg.get("model_type"),
        "num_layers": _config_layers(cfg),
        "hidden_size": next(
            (cfg[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(cfg.get(k), int)), None
        ),
    }
    return {k: v for k, v in facts.items() if v is not None}


MODEL_HELP = (
    "model spec: a Hub id (Qwen/Qwen2.5-7B-Instruct), a model folder, a .gguf file or embedded:NAME "
    "(default: the model the --steer/--vectors folder was made for, else embedded:qwen2.5-coder-0.5b-instruct)"
)
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help=MODEL_HELP)]
DtypeOpt = Annotated[
    str | None, typer.Option("--dtype", help="bf16, fp16 or fp32: the weights' dtype", show_default="bf16")
]
DEVICE_ENV = "ALIGNTAX_DEVICE"
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help=f"cpu, cuda, cuda:N or mps: where the model runs (default: {DEVICE_ENV}, else cuda when "
        "available, else cpu)",
    ),
]


def _progress_switch(value: bool | None) -> bool | None:
    """``--no-progress`` also silences the bars of the libraries a command loads models and data with
    (transformers' "Loading weights", the Hugging Face Hub's downloads), for the whole process."""
    if value is False:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return value


ProgressOpt = Annotated[
    bool, typer.Option("--progress/--no-progress", help="show progress bars", callback=_progress_switch)
]
# the same, for a command whose settings may come from a YAML config (None: the config's, else on)
ProgressOrConfigOpt = Annotated[
    bool | None,
    typer.Option(
        "--progress/--no-progress",
        help="show progress bars",
        show_default="progress",
        callback=_progress_switch,
    ),
]


def check_dtype(dtype: str | None, flag: str = "--dtype") -> None:
    if dtype is None:
        return
    from aligntax.models.loader import DTYPES

    if str(dtype).lower() not in DTYPES:
        raise UsageError(f"{flag} {dtype}: use one of {', '.join(sorted(DTYPES))}.")


def use_device(device: str | None) -> None:
    """``--device``: checked, then the device every model of this process loads on (``ALIGNTAX_DEVICE``,
    read by :func:`aligntax.models.loader.load_model`; Ray replicas and subprocesses inherit it)."""
    if device is None:
        return
    import re

    text = device.strip().lower()
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", text):
        raise UsageError(f"--device {device}: use cpu, cuda, cuda:N or mps.")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {device}: torch {torch.__version__} here has no CUDA device (a CPU build, or no "
                "GPU): install the CUDA build with `./run setup --cuda`, or use --device cpu."
            )
        index = int(text.split(":", 1)[1]) if ":" in text else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices.")
    if text == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise UsageError("--device mps: no Apple GPU (MPS) here.")
    os.environ[DEVICE_ENV] = text


def resolve_model(model: str | None, folder: str | Path | None, flag: str = "--model") -> str:
    """The model a command runs: ``model`` when given, else the one the artefact ``folder`` (ELS, els-lora
    adapter, vectors) was made for, else the default model. A given model whose config (read without
    loading weights) differs from the folder's fingerprint in architecture, depth or width is a usage
    error naming both; one of the same shape is checked against the weights' digest when it loads."""
    from aligntax.artefacts import folder_model
    from aligntax.models.spec import DEFAULT_MODEL

    spec, fp = folder_model(folder)
    if model is None:
        return spec or DEFAULT_MODEL
    if not fp or model == spec:
        return model
    facts = model_facts(model)
    diffs = [
        k for k in ("model_type", "num_layers", "hidden_size") if k in fp and k in facts and fp[k] != facts[k]
    ]
    if diffs:
        have = ", ".join(f"{k} {facts[k]}" for k in diffs)
        want = ", ".join(f"{k} {fp[k]}" for k in diffs)
        raise UsageError(
            f"{flag} {model} ({have}) is not the model {folder} was made for ({spec or 'unnamed'}: {want}); "
            f"leave {flag} out to use that model, or give a folder made for {model}."
        )
    return model


def check_layers(model: str | None, layers: list | None, flag: str = "--layers") -> None:
    """Every layer index in ``layers`` (ints, or lists of ints for a grid) exists in ``model``."""
    flat = [
        int(x) for v in layers or [] if v is not None for x in (v if isinstance(v, (list, tuple)) else [v])
    ]
    if not flat:
        return
    n = model_num_layers(model)
    if n is None:
        return
    bad = sorted({x for x in flat if x < 0 or x >= n})
    if bad:
        raise UsageError(
            f"{flag}: layer{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} not in the model "
            f"({model or 'the default model'} has {n} layers, 0 to {n - 1})."
        )


# The file that marks each kind of intervention folder, and the option that names it.
_FOLDER_MARKERS = {
    "els": ("energy.json", "--steer", "aligntax els train --out DIR"),
    "vectors": ("vectors.json", "--vectors", "aligntax els train (it writes DIR/vectors)"),
}


def _folder_kind(name: str) -> str | None:
    if name == "els":
        return "els"
    if name in ("refusal-add", "refusal-ablation", "false-refusal-ablation", "cast"):
        return "vectors"
    return None


def check_intervention(
    name: str | None,
    iv_args: dict | None,
    model: str | None = None,
    layers: bool = True,
    methods: Mapping[str, Method] | None = None,
) -> None:
    """The intervention is registered (in ``methods``, default the intervention registry), its options
    meet their range rules, its folder exists and holds its marker file (``energy.json`` for ELS,
    ``vectors.json`` for the vector methods), and (with ``layers``) ``--layers`` fits the model and the
    bank."""
    from aligntax.interventions.options import METHODS
    from aligntax.runs.provenance import intervention_folder

    if not name:
        return
    table = METHODS if methods is None else methods
    if name not in table:
        raise UsageError(f"Unknown intervention '{name}'; known: {', '.join(table)}.")
    args = iv_args or {}
    table[name].check({k: v for k, v in args.items() if v is not None})  # YAML intervention_args too
    kind = _folder_kind(table[name].name)
    if kind is not None:
        marker, flag, how = _FOLDER_MARKERS[kind]
        folder = intervention_folder(args)
        if not folder:
            raise UsageError(f"--intervention {name} needs {flag} DIR (made by {how}).")
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise UsageError(f"{flag} {folder}: no such folder.")
        if not (path / marker).is_file():
            raise UsageError(f"{flag} {folder} holds no {marker}: not a folder made by {how}.")
    layers = args.get("layers") if layers else None
    if isinstance(layers, list):
        check_layers(model, layers)
        if kind == "els":
            _check_bank_layers(intervention_folder(args), layers)


def _check_bank_layers(folder: str | None, layers: list) -> None:
    try:
        arch = json.loads((Path(folder) / "energy.json").read_text()).get("arch") or {}
        have = sorted(int(k) for k in arch)
    except (OSError, ValueError, TypeError, AttributeError):
        return
    missing = sorted({int(x) for v in layers for x in (v if isinstance(v, list) else [v])} - set(have))
    if have and missing:
        raise UsageError(
            f"--layers: the energy bank {folder} has no model for layer"
            f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
            f"(it has {', '.join(map(str, have))})."
        )


# ---------------------------------------------------------------- steering options
InterventionOpt = Annotated[str | None, typer.Option(help="the intervention: " + ", ".join(INTERVENTIONS))]


def _iv_name(intervention: str | None, steer: str | None) -> str | None:
    """``--steer DIR`` alone means ELS, or els-lora for a folder ``aligntax els distill`` wrote."""
    if steer and not intervention:
        from pathlib import Path

        return "els-lora" if (Path(steer) / "els_lora.json").is_file() else "els"
    return intervention


def steering_options(fn=None, *, methods: Mapping[str, Method] | None = None):
    """Add ``--intervention`` and every registered intervention option to a command. The command
    declares ``intervention`` and ``iv_args`` parameters and receives the method's name (``--steer DIR``
    alone means els) and its ``intervention_args`` (each value read and range-checked as its option
    says; an option the method does not take is refused). An unknown method, a missing or wrong
    folder and ``--layers`` beyond the model are refused here, before the command loads anything.
    ``methods``: the registry the names and options come from (default the intervention registry;
    ``vat run`` passes its own, which layers the value-targeted methods on it)."""
    if fn is None:
        return functools.partial(steering_options, methods=methods)
    opts = cli_options(methods)
    hints = typing.get_type_hints(fn, include_extras=True)
    sig = inspect.signature(fn)
    keep = [
        p.replace(annotation=hints.get(n, p.annotation)) for n, p in sig.parameters.items() if n != "iv_args"
    ]
    types = {"float": float, "int": int}
    extra = [
        inspect.Parameter(
            o.param,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                types.get(o.parse, str) | None, typer.Option(o.flag, *o.aliases, help=o.help)
            ],
        )
        for o in opts
    ]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = {o.param: kwargs.pop(o.param, None) for o in opts}
        selected: dict = {}
        if not kwargs.get("intervention") and is_selection_dir(given.get("iv_steer")):
            # --steer DIR of a folder holding a selected setting (the demo's): exactly that setting,
            # options given beside it overriding its own
            try:
                kwargs["intervention"], selected, _ = read_selection(given.pop("iv_steer"))
            except AligntaxError as exc:
                fail(exc)
        name = _iv_name(kwargs.get("intervention"), given.get("iv_steer"))
        try:
            iv_args = {**selected, **intervention_args(name, given, methods)}
            # the folder's model unless --model says otherwise (a command reading a YAML config, whose
            # model may come from the file, resolves it with the merged settings itself)
            if "model" in kwargs and kwargs.get("config") is None:
                from aligntax.runs.provenance import intervention_folder

                kwargs["model"] = resolve_model(kwargs["model"], intervention_folder(iv_args))
            # a command reading a YAML config checks --layers against its merged settings itself
            check_intervention(
                name, iv_args, kwargs.get("model"), layers=kwargs.get("config") is None, methods=methods
            )
        except AligntaxError as exc:
            fail(exc)
        kwargs.update(intervention=name, iv_args=iv_args)
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=keep + extra)
    return wrapper


def grid_options(fn):
    """Add every ELS option that is a sweep grid axis to a command, as a comma-separated grid
    (``--eta 0.2,0.35``; ``none`` turns an option off). Layer sets are ``--layers-grid "17;19,20"``
    (sets separated by ``;``, each set written like ``--layers 17,19``). The command receives ``grid``:
    ``{field: [values]}`` for the axes given."""

    opts = [o for o in cli_options() if o.grid and "els" in o.methods]
    hints = typing.get_type_hints(fn, include_extras=True)
    sig = inspect.signature(fn)
    keep = [
        p.replace(annotation=hints.get(n, p.annotation)) for n, p in sig.parameters.items() if n != "grid"
    ]
    extra = []
    for o in opts:
        if o.parse == "layers":
            extra.append(
                inspect.Parameter(
                    o.param,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[
                        str | None,
                        typer.Option(
                            "--layers-grid",
                            help="layer sets to try, separated by ';', each like "
                            '--layers (e.g. "17;19,20")',
                        ),
                    ],
                )
            )
        else:
            extra.append(
                inspect.Parameter(
                    o.param,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[
                        str | None, typer.Option(o.flag, *o.aliases, help="comma-separated grid: " + o.help)
                    ],
                )
            )

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            grid = {o.name: v for o in opts if (v := grid_values(kwargs.pop(o.param, None), o)) is not None}
        except AligntaxError as exc:
            fail(exc)
        return fn(*args, grid=grid, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=keep + extra)
    return wrapper


# ---------------------------------------------------------------- settings dataclasses as options
def _option_type(tp: Any) -> type:
    """The one value type of a settings field (``int | None`` -> int) for the command line."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


def _field_help(f: dataclasses.Field) -> str:
    """The field's help and its default as typer shows one (``[default: 8000]``; the bracket escaped from
    rich markup); none shown for no default or a switch."""
    shown = f.default not in (None, False, True, dataclasses.MISSING)
    return spec_of(f).help + (f" \\[default: {f.default}]" if shown else "")


def settings_options(
    cls: type, param: str = "settings"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add to a command one option per field of the settings dataclass ``cls`` that is declared with
    :func:`~aligntax.interventions.options.option` and ``cli`` (its flag, help, environment variable
    and default from the declaration), and ``--config FILE``: a YAML file whose keys are the field
    names. The command receives ``param``: ``cls`` built from the file and the flags given (a flag wins
    over the file, the field's default applies where neither gives a value), every value checked as
    its option says; a bad value or key is one error line, before the command runs."""
    fields = [f for f in dataclasses.fields(cls) if spec_of(f).cli]
    hints = typing.get_type_hints(cls)

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        fn_hints = typing.get_type_hints(fn, include_extras=True)
        keep = [
            p.replace(annotation=fn_hints.get(n, p.annotation))
            for n, p in sig.parameters.items()
            if n != param
        ]
        clash = {p.name for p in keep} & ({f.name for f in fields} | {"config"})
        if clash:
            raise TypeError(f"{fn.__name__} has parameters named like {cls.__name__} fields: {sorted(clash)}")
        kw = inspect.Parameter.KEYWORD_ONLY
        help_config = "YAML file of these settings (keys: the option names, with _); options given here win."
        extra = [
            inspect.Parameter(
                "config", kw, default=None, annotation=Annotated[Path | None, typer.Option(help=help_config)]
            )
        ]
        for f in fields:
            spec = spec_of(f)
            option = typer.Option(flag_of(f), *spec.aliases, help=_field_help(f), envvar=spec.envvar)
            tp = _option_type(hints[f.name])
            extra.append(inspect.Parameter(f.name, kw, default=None, annotation=Annotated[tp | None, option]))

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            path = kwargs.pop("config", None)
            given = {f.name: kwargs.pop(f.name, None) for f in fields}
            try:
                kwargs[param] = load_config(cls, path, **given)
            except AligntaxError as exc:
                fail(exc)
            return fn(*args, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=keep + extra)  # type: ignore[attr-defined]
        return wrapper

    return deco


# Runs over Ray (aligntax.runs.distributed, docs/ray.md) and models split over devices.
RayOpt = Annotated[
    str | None,
    typer.Option(
        "--ray",
        help="generate on replicas of the model over Ray: 'local' (a new cluster on this machine), 'auto' "
        "(the cluster this machine belongs to, or RAY_ADDRESS), HOST:6379 or ray://HOST:10001",
    ),
]
WorkersOpt = Annotated[
    int | None, typer.Option(help="--ray: replicas of the model (default: as many as fit)")
]
WorkerCpusOpt = Annotated[float, typer.Option(help="--ray: CPUs per replica (also its torch threads)")]
WorkerGpusOpt = Annotated[
    float | None, typer.Option(help="--ray: GPUs per replica (default 1 when the cluster has GPUs, else 0)")
]
DeviceMapOpt = Annotated[
    str | None,
    typer.Option(help="'auto': split a model larger than one device over the devices (accelerate)"),
]


def ray_config(address: str | None, workers: int | None, cpus: float, gpus: float | None):
    """The Ray settings of ``--ray`` and its options (None without ``--ray``)."""
    if address is None:
        if workers is not None or gpus is not None:
            raise AligntaxError("--workers and --worker-gpus go with --ray ADDRESS (e.g. --ray local).")
        return None
    from aligntax.runs.distributed import RayConfig

    return RayConfig(address=address, workers=workers, cpus=cpus, gpus=gpus)


def subsets_option(values: list[str] | None) -> dict[str, int] | None:
    """``--subset NAME=N`` (repeatable) as ``{NAME: N}``; None when not given."""
    if not values:
        return None
    out = {}
    for v in values:
        name, sep, n = v.partition("=")
        if not sep or not name.strip() or not n.strip().isdigit() or int(n) < 1:
            raise UsageError(f"--subset takes NAME=N with N a positive whole number; got {v!r}.")
        out[name.strip()] = int(n)
    return out


def split_list(values: list[str] | None) -> list | None:
    """A repeated option: None when not given, [] for a single 'none'."""
    if not values:
        return None
    return [] if [v.strip().lower() for v in values] == ["none"] else list(values)
