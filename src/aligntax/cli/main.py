"""The ``aligntax`` command line: a thin layer over the library."""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import closing
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from aligntax import __version__
from aligntax.cli.options import (
    AligntaxGroup,
    DeviceOpt,
    DtypeOpt,
    InterventionOpt,
    ModelOpt,
    ProgressOpt,
    ProgressOrConfigOpt,
    check_datasets,
    check_dtype,
    check_intervention,
    check_judge,
    check_layers,
    check_out_file,
    check_out_folder,
    check_range,
    deprecated,
    ensure_datasets,
    grid_options,
    resolve_model,
    set_debug,
    steering_options,
    use_device,
)
from aligntax.cli.options import fail as _fail
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
from aligntax.errors import AligntaxError, UsageError
from aligntax.interventions.options import parse_value
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runs.fsio import write_json_atomic

app = typer.Typer(
    cls=AligntaxGroup,
    help="aligntax: measure and cut the alignment tax of open-weight LLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="List, fetch and inspect models.", no_args_is_help=True)
data_app = typer.Typer(help="Benchmark datasets.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")
console = Console(stderr=True)

# Generation options shared by eval, generate, knowns and the demo; their defaults are
# aligntax.defaults (48 new tokens, greedy), shown in every --help.
TEMPERATURE_HELP = "0: greedy (the same answers every run); above 0: sample at this temperature"


def _version(value: bool) -> None:
    if value:
        print(f"aligntax {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", envvar="ALIGNTAX_DEBUG", help="on an error, also print the full traceback"),
    ] = False,
) -> None:
    """aligntax: measure and cut the alignment tax of open-weight LLMs."""
    set_debug(debug)


def _sampling(temperature: float | None) -> tuple[bool | None, float | None]:
    """``(do_sample, temperature)`` from ``--temperature`` (0: greedy; None: not given)."""
    if temperature is None:
        return None, None
    check_range(temperature, "nonnegative", "--temperature")
    return (True, temperature) if temperature > 0 else (False, None)


# ---------------------------------------------------------------- models
@models_app.command("list")
def models_list(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """List the embedded models and whether they are in the cache."""
    from aligntax.models.embedded import EMBEDDED_MODELS, converted_dir, is_fetched

    rows = [
        {
            "spec": f"embedded:{name}",
            "description": m.description,
            "cached": is_fetched(name),
            "cache_path": str(converted_dir(name)),
        }
        for name, m in EMBEDDED_MODELS.items()
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table()
    table.add_column("spec", no_wrap=True, min_width=max(len(r["spec"]) for r in rows))  # never truncated
    for name in ("description", "cached", "cache path"):
        table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(r["spec"], r["description"], "yes" if r["cached"] else "no", r["cache_path"])
    Console().print(table)
    Console().print("Also accepted: a Hugging Face Hub id (org/name), a local model folder, a .gguf file.")


@models_app.command("fetch")
def models_fetch(
    name: str = typer.Argument(..., help="embedded model name, e.g. qwen2.5-coder-0.5b-instruct"),
    force: bool = typer.Option(False, help="rebuild even if cached"),
) -> None:
    """Download, verify (sha256) and convert an embedded model to safetensors in the cache."""
    from aligntax.models import fetch_embedded

    try:
        path = fetch_embedded(name.removeprefix("embedded:"), force=force)
    except AligntaxError as exc:
        _fail(exc)
    print(path)


@models_app.command("info")
def models_info(spec: str = typer.Argument(DEFAULT_MODEL, help="model spec")) -> None:
    """Architecture, layers, hidden size, dtype, chat template and cache path of a model."""
    from aligntax.models import model_info

    try:
        info = model_info(spec)
    except AligntaxError as exc:
        _fail(exc)
    print(json.dumps(info, indent=2))


# ---------------------------------------------------------------- data
@data_app.command("list")
def data_list(as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Named datasets: present or absent, and the data root each is read from (roots searched in order)."""
    from aligntax.data.fetch import fetchable
    from aligntax.data.registry import DATASETS, data_roots, dataset_location

    rows = []
    for name, spec in DATASETS.items():
        path, origin = dataset_location(name)
        if path is not None:
            state = "present"
        elif spec.package is not None or fetchable(spec.path):
            state = "absent"
        else:
            state = "absent (no upstream)"
        rows.append(
            {
                "name": name,
                "state": state,
                "present": path is not None,
                "read_from": origin if path is not None else None,
                "path": str(path) if path is not None else None,
                "description": spec.description,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table("name", "state", "read from", "description")
    for r in rows:
        table.add_row(r["name"], r["state"], r["read_from"] or "-", r["description"])
    out = Console()
    out.print(table)
    out.print("Data roots searched, in order (`aligntax data fetch NAME|all` stores into the last):")
    for i, root in enumerate(data_roots(), 1):
        out.print(f"  {i}. {root.describe()}", markup=False, highlight=False)
    if any(r["state"] == "absent (no upstream)" for r in rows):
        out.print("Absent files with no upstream: copy them into a data root (ALIGNTAX_DATA).")


MirrorFromOpt = Annotated[
    str | None,
    typer.Option(
        "--from",
        help="a mirror folder or base URL laid out like the upstream URLs (ROOT/raw.githubusercontent.com/..., "
        "ROOT/huggingface.co/..., ROOT/aligntax-derived/...; `aligntax data mirror` writes one); default "
        "ALIGNTAX_DATA_MIRROR",
    ),
]


@data_app.command("fetch")
def data_fetch(
    names: list[str] = typer.Argument(
        ..., help="named datasets, file groups (xstest-labeled, jbb-artifacts, gsm8k, ...), or all"
    ),
    source: MirrorFromOpt = None,
    force: bool = typer.Option(False, help="download again even if a verified copy is there"),
    progress: ProgressOpt = True,
) -> None:
    """Download benchmark files from their pinned upstream commits (or make them from one: the PHTest
    splits), check each sha256 and store them in the cache (ALIGNTAX_CACHE/data), where the loaders find
    them; print where each file is."""
    from aligntax.data.fetch import fetch_datasets

    try:
        every = any(n.strip().lower() == "all" for n in names)
        res = fetch_datasets(list(names), mirror=source, force=force, keep_going=every, progress=progress)
    except AligntaxError as exc:
        _fail(exc)
    for path in res.fetched:
        print(f"fetched  {path}")
    for path in [*res.present, *res.packaged]:
        print(f"present  {path}")
    for rel, why in res.skipped.items():
        console.print(f"skipped  {rel}: {why}", markup=False, highlight=False)
    if res.failed:
        _fail(AligntaxError("\n".join(res.failed.values())))


@data_app.command("mirror")
def data_mirror(
    out: Path = typer.Argument(..., help="the mirror folder (created; files already there are kept)"),
) -> None:
    """Write a data mirror from the files present here (shared data folder, cache), laid out like the
    upstream URLs, each copied only when its sha256 is the pinned one. A machine without network access
    fetches from it: ALIGNTAX_DATA_MIRROR=DIR aligntax data fetch all (or --from DIR)."""
    from aligntax.data.mirror import write_mirror

    try:
        check_out_folder(out, "DIR")
        res = write_mirror(out)
    except AligntaxError as exc:
        _fail(exc)
    for rel in res.missing:
        console.print(f"missing  {rel} (in no data root: `aligntax data fetch all` first)", markup=False)
    for rel, got in res.mismatched.items():
        console.print(f"differs  {rel} (sha256 {got}, not the pinned one): left out", markup=False)
    print(f"mirror {out}: {len(res.written)} files written, {len(res.present)} already there")
    if res.mismatched:
        _fail(AligntaxError(f"{len(res.mismatched)} files differ from their pins and were left out"), code=1)


# ---------------------------------------------------------------- generate / judge / eval
# The intervention options of generate, chat, eval, mc and knowns: --intervention plus every registered
# method's options (aligntax.interventions.options), added to a command by @steering_options.


@app.command()
@steering_options
def generate(
    prompt: list[str] = typer.Argument(None, help="prompts; or use --in"),
    model: ModelOpt = None,
    in_file: Path | None = typer.Option(None, "--in", help="prompts: a file or dataset name"),
    out: Path | None = typer.Option(None, help="write JSONL to this file instead of stdout"),
    system: str | None = typer.Option(None, help="system prompt"),
    max_new_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, help="tokens generated per prompt at most"),
    batch_size: int = typer.Option(32, help="prompts per batch"),
    temperature: float = typer.Option(DEFAULT_TEMPERATURE, help=TEMPERATURE_HELP),
    top_p: float = typer.Option(1.0, help="nucleus sampling (with a temperature above 0)"),
    seed: int | None = typer.Option(None, help="seed of the sampling"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    limit: int | None = typer.Option(None, help="with --in: the first N prompts"),
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    progress: ProgressOpt = True,
    backend: str = typer.Option("hf", help="hf, or vllm (continuous batching; ./run setup-vllm)"),
) -> None:
    """Generate chat responses for prompts, in batches. Each JSONL line records the intervention used."""
    from aligntax.generation import GenerationConfig
    from aligntax.generation.source import SourceSpec
    from aligntax.runs.sources import generation_source

    try:
        check_out_file(out)
        check_dtype(dtype)
        use_device(device)
        check_range(max_new_tokens, "positive_count", "--max-new-tokens")
        check_range(batch_size, "positive_count", "--batch-size")
        check_range(top_p, "probability", "--top-p")
        do_sample, temp = _sampling(temperature)
        if limit is not None:
            check_range(limit, "count", "--limit")
        source = generation_source(backend)
        prompts = list(prompt or [])
        ids = [str(i) for i in range(len(prompts))]
        if in_file is not None:
            from aligntax.data import load_prompts

            check_datasets([str(in_file)], "--in")
            ensure_datasets([str(in_file)], progress, "generate")
            items = load_prompts(str(in_file), limit=limit, default_label="benign")  # labels unused
            prompts += [it.prompt for it in items]
            ids += [it.id for it in items]
        if not prompts:
            raise UsageError("No prompts: give them as arguments or with --in")
        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            system=system,
            do_sample=bool(do_sample),
            top_p=top_p,
            seed=seed,
            **({"temperature": temp} if temp is not None else {}),
        )
    except AligntaxError as exc:
        _fail(exc)
    name = intervention if intervention != "none" else None
    with source.open(SourceSpec(model, dtype or "bf16", name, dict(iv_args or {}), batch_size)) as gen:
        gens: list = [None] * len(prompts)
        for idx, batch in gen.iter_generate(prompts, cfg, progress=progress):
            for i, g in zip(idx, batch, strict=True):
                gens[i] = g
    used = {"intervention": intervention or "none", **({"intervention_args": iv_args} if iv_args else {})}
    fh = open(out, "w") if out else sys.stdout
    for i, g in zip(ids, gens, strict=True):
        fh.write(
            json.dumps(
                {
                    "id": i,
                    "prompt": g.prompt,
                    "response": g.response,
                    "finish_reason": g.finish_reason,
                    **used,
                },
                ensure_ascii=False,
            )
            + "\n"
        )
    if out:
        fh.close()


def _make_iv(lm, intervention: str | None, iv_args: dict | None):
    if not intervention or intervention == "none":
        return None
    from aligntax.interventions.registry import make_intervention

    return make_intervention(intervention, lm, **(iv_args or {}))


@app.command()
@steering_options
def chat(
    model: ModelOpt = None,
    system: str | None = typer.Option(None, help="system prompt"),
    max_new_tokens: int = typer.Option(256, help="tokens per reply at most (a chat answers at length)"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
) -> None:
    """Interactive chat (one line a turn; an empty line or Ctrl-D ends)."""
    from aligntax.generation import GenerationConfig
    from aligntax.generation import generate as gen
    from aligntax.models import load_model

    try:
        check_dtype(dtype)
        use_device(device)
        lm = load_model(model, dtype=dtype or "bf16")
        iv = _make_iv(lm, intervention, iv_args)
    except AligntaxError as exc:
        _fail(exc)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=1)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        reply = gen(lm, [history], cfg, iv, progress=False)[0].response
        history.append({"role": "assistant", "content": reply})
        print(f"model> {reply}")


@app.command()
def judge(
    in_file: Path = typer.Option(..., "--in", help="JSONL with prompt and response"),
    out: Path = typer.Option(..., help="output JSONL (adds refused and refusal_score)"),
    judge_name: str = typer.Option("classifier", "--judge", help="keyword, prefix, classifier, llm"),
) -> None:
    """Judge refusals in a JSONL file of (prompt, response) lines."""
    from aligntax.judges import get_judge, judge_jsonl

    try:
        check_judge(judge_name)
        if not in_file.is_file():
            raise UsageError(f"--in {in_file}: no such file.")
        check_out_file(out)
        summary = judge_jsonl(in_file, out, get_judge(judge_name))
    except AligntaxError as exc:
        _fail(exc)
    console.print(
        f"judged {summary['n']} lines ({summary['n_refused']} refused) with {summary['judge']} -> {out}"
    )


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


def _ray_config(address: str | None, workers: int | None, cpus: float, gpus: float | None):
    """The Ray settings of ``--ray`` and its options (None without ``--ray``)."""
    if address is None:
        if workers is not None or gpus is not None:
            raise AligntaxError("--workers and --worker-gpus go with --ray ADDRESS (e.g. --ray local).")
        return None
    from aligntax.runs.distributed import RayConfig

    return RayConfig(address=address, workers=workers, cpus=cpus, gpus=gpus)


@app.command("eval")
@steering_options
def eval_cmd(
    data: list[str] = typer.Option(None, "--data", help="file or dataset name; repeatable"),
    out: Path | None = typer.Option(None, help="run folder (required, here or in --config; a rerun resumes)"),
    model: ModelOpt = None,
    config: Path | None = typer.Option(None, help="YAML config; flags override it"),
    judge_name: str | None = typer.Option(
        None, "--judge", help="keyword, prefix, classifier, llm", show_default="classifier"
    ),
    system: str | None = typer.Option(None, help="system prompt"),
    max_new_tokens: int | None = typer.Option(
        None, help="tokens generated per prompt at most", show_default=str(DEFAULT_MAX_NEW_TOKENS)
    ),
    limit: int | None = typer.Option(None, help="first N items of each dataset"),
    subset: list[str] = typer.Option(
        None,
        help="NAME=N: at most N prompts of each source of dataset NAME (a group: of each part), drawn at "
        "random with a fixed seed; repeatable (e.g. jbb-attacks=40, as the quick demo)",
    ),
    batch_size: int | None = typer.Option(None, help="prompts per batch", show_default="32"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    temperature: float | None = typer.Option(
        None, help=TEMPERATURE_HELP, show_default=str(DEFAULT_TEMPERATURE)
    ),
    top_p: float | None = typer.Option(
        None, help="nucleus sampling (with a temperature above 0)", show_default="1.0"
    ),
    seed: int | None = typer.Option(None, help="seed of the sampling"),
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    reuse_unsteered: Path | None = typer.Option(
        None,
        help="an unsteered run folder with the same settings: rows the intervention leaves unsteered "
        "(ELS harm gate, CAST condition) take their answers from it instead of being generated",
    ),
    compare_to: Path | None = typer.Option(
        None,
        help="an earlier run folder over the same prompts (default: --reuse-unsteered): the paired change "
        "against it per dataset (turned compliant/refusing, exact McNemar p)",
    ),
    progress: ProgressOrConfigOpt = None,
    ray: RayOpt = None,
    workers: WorkersOpt = None,
    worker_cpus: WorkerCpusOpt = 1.0,
    worker_gpus: WorkerGpusOpt = None,
    device_map: DeviceMapOpt = None,
    backend: str | None = typer.Option(
        None, help="hf, or vllm (continuous batching; ./run setup-vllm)", show_default="hf"
    ),
) -> None:
    """Evaluate over-refusal and safety; resumable run folder with samples.jsonl, results.json, report.md."""
    from aligntax.config import load_config
    from aligntax.runs import EvalConfig, run_eval
    from aligntax.runs.sources import generation_source

    try:
        do_sample, temp = _sampling(temperature)
        if out is None and "out" not in _yaml_keys(config):
            raise UsageError("eval needs --out DIR (the run folder; a rerun with the same DIR resumes).")
        cfg = load_config(
            EvalConfig,
            config,
            data=list(data) if data else None,
            out=str(out) if out else None,
            model=model,
            judge=judge_name,
            system=system,
            max_new_tokens=max_new_tokens,
            limit=limit,
            subsets=_subsets(subset),
            batch_size=batch_size,
            dtype=dtype,
            do_sample=do_sample,
            temperature=temp,
            top_p=top_p,
            seed=seed,
            intervention=intervention,
            intervention_args=iv_args or None,
            reuse_unsteered=str(reuse_unsteered) if reuse_unsteered else None,
            compare_to=str(compare_to) if compare_to else None,
            progress=progress,
            device_map=device_map,
            backend=backend,
        )
        if config is not None:  # the model may come from the file: resolved with the merged settings
            from aligntax.runs.provenance import intervention_folder

            given = model or ("model" in _yaml_keys(config) and cfg.model) or None
            cfg.model = resolve_model(given, intervention_folder(cfg.intervention_args))
        use_device(device)
        _check_eval(cfg)
        ensure_datasets(cfg.data, cfg.progress is not False, "eval")
        source = generation_source(cfg.backend, _ray_config(ray, workers, worker_cpus, worker_gpus))
    except AligntaxError as exc:
        _fail(exc)
    with closing(source):
        results = run_eval(cfg, source=source)
    Console().print(_eval_table(results))
    console.print(f"run folder: {cfg.out}")


def _yaml_keys(config: Path | None) -> set[str]:
    """The keys a YAML config sets (``max-new-tokens`` read as ``max_new_tokens``); none without one."""
    if config is None or not Path(config).is_file():
        return set()
    import yaml

    try:
        loaded = yaml.safe_load(Path(config).read_text()) or {}
    except yaml.YAMLError:
        return set()
    return {str(k).replace("-", "_") for k in loaded} if isinstance(loaded, dict) else set()


def _check_eval(cfg) -> None:
    """Everything an evaluation's settings can be checked for before a model is loaded."""
    if not cfg.data:
        raise UsageError("No data given: pass at least one --data FILE_OR_NAME")
    check_datasets(cfg.data)
    check_judge(cfg.judge)
    check_out_folder(cfg.out)
    check_range(cfg.max_new_tokens, "positive_count", "--max-new-tokens")
    check_range(cfg.batch_size, "positive_count", "--batch-size")
    if cfg.limit is not None:
        check_range(cfg.limit, "count", "--limit")
    stray = sorted(set(cfg.subsets or {}) - set(cfg.data))
    if stray:
        raise UsageError(f"--subset {', '.join(stray)}: not among the --data sets ({', '.join(cfg.data)}).")
    check_range(cfg.temperature, "nonnegative", "--temperature")
    check_range(cfg.top_p, "probability", "--top-p")
    check_dtype(cfg.dtype)
    for flag, folder in (("--reuse-unsteered", cfg.reuse_unsteered), ("--compare-to", cfg.compare_to)):
        if folder and not Path(folder).is_dir():
            raise UsageError(f"{flag} {folder}: no such run folder.")
    check_intervention(cfg.intervention, cfg.intervention_args, cfg.model)


def _eval_table(results: dict) -> Table:
    """The evaluation's summary as a rich table: one row per dataset and label (n, the rate that matters
    for that label and its 95% interval; with a reference run, the paired change)."""
    from aligntax.reports.markdown import fmt_change, fmt_rate

    paired = (results.get("paired") or {}).get("datasets")
    table = Table(
        "dataset", "label", "n", "metric", "rate [95% CI]", *(("change, paired",) if paired else ())
    )
    table.columns[2].justify = "right"

    def change(key: str, label: str) -> tuple[str, ...]:
        if not paired:
            return ()
        c = paired.get(key, {}).get(label)
        return (fmt_change(c) if c else "",)

    def rows(name: str, block: dict, key: str) -> None:
        if "benign" in block:
            b = block["benign"]
            table.add_row(
                name,
                "benign",
                str(b["n"]),
                "compliance",
                fmt_rate(b["compliance_rate"], b["ci95"]),
                *change(key, "benign"),
            )
            if "useful_compliance_rate" in b:
                table.add_row(
                    name,
                    "benign",
                    str(b["n"]),
                    "useful compliance",
                    fmt_rate(b["useful_compliance_rate"], b["useful_ci95"]),
                    *(("",) if paired else ()),
                )
        if "harmful" in block:
            h = block["harmful"]
            table.add_row(
                name,
                "harmful",
                str(h["n"]),
                "refusal",
                fmt_rate(h["refusal_rate"], h["ci95"]),
                *change(key, "harmful"),
            )

    for name, block in results.get("datasets", {}).items():
        rows(name, block, name)
    table.add_section()
    rows("overall", results, "all")
    return table


@app.command()
def rejudge(
    run: Path = typer.Argument(..., help="an evaluation run folder"),
    judge_name: str | None = typer.Option(None, "--judge", help="default: the run's own judge"),
) -> None:
    """Judge an existing run's responses again and rewrite its samples, results and report."""
    from aligntax.runs.eval import rejudge as rejudge_run

    try:
        check_judge(judge_name)
        if not run.is_dir():
            raise UsageError(f"{run}: no such run folder.")
        results = rejudge_run(run, judge_name)
    except AligntaxError as exc:
        _fail(exc)
    Console().print(_eval_table(results))


@app.command()
def fluency(
    run: Path = typer.Argument(..., help="an evaluation run folder"),
    model: str | None = typer.Option(
        None, "--model", "-m", help="reference model spec (default: the run's model, unsteered)"
    ),
    source: list[str] = typer.Option(None, help="only these datasets"),
    label: str | None = typer.Option("benign", help="only items with this label ('' for all)"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Perplexity of a run's responses under the unsteered reference model; writes RUN/fluency.json."""
    from aligntax.metrics.fluency import perplexity
    from aligntax.models import load_model
    from aligntax.runs.jsonl import read_jsonl

    try:
        if not (run / "config.json").is_file() or not (run / "samples.jsonl").is_file():
            raise UsageError(f"{run}: not an evaluation run folder (no config.json / samples.jsonl).")
        cfg = json.loads((run / "config.json").read_text())
        rows = [
            r
            for r in read_jsonl(run / "samples.jsonl")
            if (not source or r["source"] in source)
            and (not label or r["label"] == label)
            and r["response"].strip()
        ]
        if not rows:
            raise AligntaxError(f"No responses to score in {run}")
        check_dtype(dtype)
        use_device(device)
        lm = load_model(model or cfg["model"], dtype=dtype or cfg.get("dtype", "bf16"))
        res = {
            "reference_model": model or cfg["model"],
            "label": label or None,
            "sources": source or None,
            **perplexity(lm, [r["prompt"] for r in rows], [r["response"] for r in rows], progress=progress),
        }
    except (AligntaxError, FileNotFoundError) as exc:
        _fail(exc)
    write_json_atomic(run / "fluency.json", res)
    print(json.dumps(res, indent=2))


def _check_builtin_or_file(data: str, named: tuple[str, ...] = ()) -> None:
    """``--data`` of the question sets that ship with aligntax: 'builtin', one of ``named`` or an existing
    file."""
    if data != "builtin" and data not in named and not Path(data).is_file():
        also = "".join(f", '{n}'" for n in named)
        raise UsageError(f"--data {data}: file not found (give a file, or 'builtin'{also}).")


@app.command("mc")
@steering_options
def mc_cmd(
    out: Path = typer.Option(..., help="output folder (results.json, samples.jsonl)"),
    model: ModelOpt = None,
    data: str = typer.Option("builtin", help="'builtin' (137 general questions) or a JSONL/JSON/CSV file"),
    limit: int | None = typer.Option(None, help="first N questions"),
    system: str | None = typer.Option(None, help="system prompt"),
    batch_size: int = typer.Option(16, help="prompts per batch"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    progress: ProgressOpt = True,
) -> None:
    """Multiple-choice accuracy (next-token letter probabilities), with or without an intervention."""
    from aligntax.metrics.mc import format_accuracy
    from aligntax.runs.mc import MCConfig, run_mc

    try:
        check_out_folder(out)
        check_range(batch_size, "positive_count", "--batch-size")
        check_dtype(dtype)
        use_device(device)
        _check_builtin_or_file(data)
        cfg = MCConfig(
            out=str(out),
            model=model,
            data=data,
            limit=limit,
            system=system,
            batch_size=batch_size,
            dtype=dtype or "bf16",
            intervention=intervention,
            intervention_args=iv_args,
            progress=progress,
        )
    except AligntaxError as exc:
        _fail(exc)
    res = run_mc(cfg)
    table = Table("subject", "n", "accuracy [95% CI]")
    for subject, r in res["by_subject"].items():
        table.add_row(subject, str(r["n"]), format_accuracy(r))
    table.add_row("all", str(res["n"]), format_accuracy(res))
    Console().print(table)
    console.print(f"mean probability on the option letters: {res['letter_mass_mean']:.3f}; results: {out}")


@app.command("knowns")
@steering_options
def knowns_cmd(
    out: Path = typer.Option(
        ..., help="output folder (samples.jsonl, results.json, report.md); a rerun resumes"
    ),
    model: ModelOpt = None,
    data: str = typer.Option(
        "builtin",
        help="'builtin' (360 everyday questions), 'gsm8k-test' / 'gsm8k-val' (maths word problems, the "
        "final number scored; --limit takes a sample stratified by solution steps) or a JSONL/JSON file",
    ),
    split: str = typer.Option("test", help="test, val (for choosing settings) or all"),
    limit: int | None = typer.Option(None, help="first N items of the split"),
    compare_to: str | None = typer.Option(
        None, help="another knowns run folder: paired change over shared items"
    ),
    system: str | None = typer.Option(None, help="system prompt"),
    max_new_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, help="tokens generated per question at most"),
    batch_size: int = typer.Option(32, help="prompts per batch"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    progress: ProgressOpt = True,
) -> None:
    """Known-answer accuracy of greedy answers to everyday questions, with or without an intervention."""
    from aligntax.metrics.mc import format_accuracy
    from aligntax.runs.knowns import KnownsConfig, run_knowns

    try:
        check_out_folder(out)
        check_range(max_new_tokens, "positive_count", "--max-new-tokens")
        check_range(batch_size, "positive_count", "--batch-size")
        check_dtype(dtype)
        use_device(device)
        from aligntax.metrics.knowns import GSM8K_SETS

        _check_builtin_or_file(data, tuple(GSM8K_SETS))
        if compare_to and not Path(compare_to).is_dir():
            raise UsageError(f"--compare-to {compare_to}: no such run folder.")
        cfg = KnownsConfig(
            out=str(out),
            model=model,
            data=data,
            split=split,
            limit=limit,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            dtype=dtype or "bf16",
            system=system,
            intervention=intervention,
            intervention_args=iv_args,
            compare_to=compare_to,
            progress=progress,
        )
    except AligntaxError as exc:
        _fail(exc)
    res = run_knowns(cfg)
    paired = res.get("paired")
    table = Table(
        "kind", "n", "accuracy [95% CI]", *(("paired change", "gained", "lost", "p") if paired else ())
    )
    for kind, r in [*res["by_kind"].items(), ("all", res)]:
        extra = ()
        if paired:
            c = paired["by_kind"].get(kind) if kind != "all" else paired
            extra = (
                (f"{100 * c['diff']:+.1f} pts", str(c["gained"]), str(c["lost"]), f"{c['p_value']:.3g}")
                if c
                else ("", "", "", "")
            )
        table.add_row(kind, str(r["n"]), format_accuracy(r), *extra)
    Console().print(table)
    console.print(f"results: {out}")


els_app = typer.Typer(
    help="Energy Landscape Steering: train energy models and tune steering.", no_args_is_help=True
)
app.add_typer(els_app, name="els")


def _subsets(values: list[str] | None) -> dict[str, int] | None:
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


def _split_list(values: list[str] | None) -> list | None:
    """A repeated option: None when not given, [] for a single 'none'."""
    if not values:
        return None
    return [] if [v.strip().lower() for v in values] == ["none"] else list(values)


@els_app.command("train")
def els_train(
    out: Path = typer.Option(..., help="output folder (energy models, vectors, report)"),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="model spec: a Hugging Face Hub id (Qwen/Qwen2.5-7B-Instruct), a model folder, a .gguf file "
        "or embedded:NAME; recorded in the folder, which every command that takes it then uses",
        show_default=DEFAULT_MODEL,
    ),
    config: Path | None = typer.Option(None, help="YAML config"),
    benign: list[str] = typer.Option(None, help="over-refusal prompts (default orbench-hard-train)"),
    harmful: list[str] = typer.Option(None, help="harmful prompts (default harmful-train)"),
    harmless: list[str] = typer.Option(None, help="harmless prompts for the vector baselines"),
    limit_benign: int | None = typer.Option(None),
    limit_harmful: int | None = typer.Option(None),
    layers: str | None = typer.Option(None, help="comma-separated layer indices, e.g. 17,19 (default all)"),
    objective: str | None = typer.Option(None, help="infonce or logistic"),
    preset: str | None = typer.Option(None, help="small or paper (widths)"),
    energy_folds: int | None = typer.Option(
        None,
        help="rank layers by validation accuracy over this many "
        "disjoint folds (default 5; 1: one 80/20 split)",
    ),
    epochs: int | None = typer.Option(None),
    lr: float | None = typer.Option(None),
    judge_name: str | None = typer.Option(None, "--judge"),
    max_new_tokens: int | None = typer.Option(
        None, help="tokens generated per prompt for the labels", show_default=str(DEFAULT_MAX_NEW_TOKENS)
    ),
    batch_size: int | None = typer.Option(None, help="prompts per batch", show_default="32"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    train_gate: bool | None = typer.Option(
        None, "--train-gate/--no-train-gate", help="also train the harm gate", show_default="train-gate"
    ),
    gate: bool | None = typer.Option(None, "--gate/--no-gate", hidden=True),
    gate_harmful: list[str] = typer.Option(
        None,
        help="extra harmful prompts for the harm gate (default orbench-toxic, "
        "strongreject, maliciousinstruct, do-not-answer; 'none': no extra)",
    ),
    limit_gate_harmful: int | None = typer.Option(
        None, help="sample at most this many of each set (default 600)"
    ),
    gate_benign: list[str] = typer.Option(
        None, help="extra benign prompts for the harm gate (default orbench-hard-train; 'none': no extra)"
    ),
    limit_gate_benign: int | None = typer.Option(
        None, help="sample at most this many of each set (default all)"
    ),
    gate_pairs: list[str] = typer.Option(
        None,
        help="contrast pairs for the harm gate, benign and harmful prompts "
        "sharing a sensitive word (e.g. contrast-pairs: its train split; default none)",
    ),
    gate_pairs_weight: float | None = typer.Option(
        None, help="weight of each contrast-pair prompt in the gate's fit (default 5)"
    ),
    gate_recall: str | None = typer.Option(
        None,
        help="the gate's threshold holds back this share of the harmful training prompts out of fold "
        "(default 0.99; 'none': threshold 0.5)",
    ),
    gate_ensemble: bool | None = typer.Option(
        None,
        help="also try the mean of one probe per candidate layer, kept when its cross-validated "
        "balanced accuracy is higher (default off)",
    ),
    harm_pairs: list[str] = typer.Option(
        None,
        help="contrast pairs for the harm basis (default contrast-pairs; 'none': per-prompt differences)",
    ),
    ray: RayOpt = None,
    workers: WorkersOpt = None,
    worker_cpus: WorkerCpusOpt = 1.0,
    worker_gpus: WorkerGpusOpt = None,
    progress: ProgressOrConfigOpt = None,
) -> None:
    """Label the model's behaviour, capture activations, train one energy model per layer (with --ray, the
    label generation and the states recorded during it run on replicas of the model over Ray)."""
    from aligntax.config import load_config
    from aligntax.runs.els_train import ELSTrainConfig, train_els

    try:
        if gate is not None:
            deprecated("--gate/--no-gate of els train", "--train-gate/--no-train-gate")
            train_gate = gate if train_gate is None else train_gate
        layer_list = parse_value(layers, "layers", "--layers") if layers else None
        cfg = load_config(
            ELSTrainConfig,
            config,
            out=str(out),
            model=model,
            benign=_split_list(benign),
            harmful=_split_list(harmful),
            harmless=_split_list(harmless),
            limit_benign=limit_benign,
            limit_harmful=limit_harmful,
            layers=layer_list,
            objective=objective,
            preset=preset,
            energy_folds=energy_folds,
            epochs=epochs,
            lr=lr,
            judge=judge_name,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            dtype=dtype,
            gate=train_gate,
            gate_harmful=_split_list(gate_harmful),
            limit_gate_harmful=limit_gate_harmful,
            gate_benign=_split_list(gate_benign),
            limit_gate_benign=limit_gate_benign,
            gate_pairs=_split_list(gate_pairs),
            gate_pairs_weight=gate_pairs_weight,
            gate_ensemble=gate_ensemble,
            progress=progress,
            harm_pairs=_split_list(harm_pairs),
        )
        if gate_recall is not None:
            value = parse_value(gate_recall, "float_or_none", "--gate-recall")
            cfg.gate_recall = None if value == "none" else value
        check_out_folder(cfg.out)
        check_judge(cfg.judge)
        check_dtype(cfg.dtype)
        use_device(device)
        check_range(cfg.layers, "count", "--layers")
        check_layers(cfg.model, cfg.layers)
        check_datasets(
            [
                *(cfg.benign or []),
                *(cfg.harmful or []),
                *(cfg.harmless or []),
                *(cfg.gate_harmful or []),
                *(cfg.gate_benign or []),
                *(cfg.gate_pairs or []),
            ],
            "a dataset",
        )
        ensure_datasets(
            [
                *(cfg.benign or []),
                *(cfg.harmful or []),
                *(cfg.harmless or []),
                *(cfg.gate_harmful or []),
                *(cfg.gate_benign or []),
                *(cfg.gate_pairs or []),
                *(cfg.harm_pairs or []),
            ],
            cfg.progress,
            "els train",
        )
        for flag, value, rule in (
            ("--epochs", cfg.epochs, "positive_count"),
            ("--lr", cfg.lr, "positive"),
            ("--max-new-tokens", cfg.max_new_tokens, "positive_count"),
            ("--batch-size", cfg.batch_size, "positive_count"),
            ("--energy-folds", cfg.energy_folds, "positive_count"),
        ):
            check_range(value, rule, flag)
        ray_cfg = _ray_config(ray, workers, worker_cpus, worker_gpus)
    except AligntaxError as exc:
        _fail(exc)
    train_els(cfg, ray=ray_cfg)
    console.print(f"energy models and report: {out}")


@els_app.command("distill")
def els_distill(
    steer: Path = typer.Option(
        ..., help="folder written by `aligntax els train` (its tuned ELS setting is distilled)"
    ),
    out: Path = typer.Option(..., help="new adapter folder (peft adapter + els_lora.json)"),
    model: str | None = typer.Option(
        None, "--model", "-m", help="model spec (default: the model the ELS folder was trained on)"
    ),
    config: Path | None = typer.Option(None, help="YAML config"),
    layers: str | None = typer.Option(
        None,
        help="comma-separated adapted blocks (default: each steered block and --before blocks before it)",
    ),
    before: int | None = typer.Option(
        None, help="blocks before each steered one that get the adapter (default 2)"
    ),
    rank: int | None = typer.Option(None, help="LoRA rank (default 8)"),
    alpha: float | None = typer.Option(None, help="LoRA alpha (default 2 x rank)"),
    epochs: int | None = typer.Option(None, help="passes over the training states (default 6)"),
    lr: float | None = typer.Option(None, help="learning rate (default 1e-3)"),
    batch_size: int | None = typer.Option(None),
    limit_benign: int | None = typer.Option(
        None, help="benign training prompts, sampled (default 300), plus the benign contrast halves"
    ),
    limit_harmful: int | None = typer.Option(
        None, help="harmful prompts besides the harmful contrast halves, which are all kept (default 300)"
    ),
    preserve_weight: float | None = typer.Option(
        None, help="weight of the harmful rows' unsteered targets (default 3)"
    ),
    limit_retain: int | None = typer.Option(
        None,
        help="everyday rows (harmless instructions, GSM8K training questions) kept unsteered (default 300)",
    ),
    retain_weight: float | None = typer.Option(None, help="weight of their unsteered targets (default 3)"),
    benign_target: str | None = typer.Option(
        None,
        help="benign rows' target: 'els' (ELS's own decision, its harm "
        "gate included) or 'label' (the gate left out: the label "
        "says benign) (default label)",
    ),
    harmful_target: str | None = typer.Option(
        None,
        help="harmful rows' target: 'unsteered' or 'refusal' (the "
        "folder's refusal vector added) (default refusal)",
    ),
    refusal_coeff: float | None = typer.Option(
        None, help="the refusal vector's strength for --harmful-target refusal (default 1)"
    ),
    pairs: list[str] = typer.Option(None, help="contrast pairs (default contrast-pairs; 'none': none)"),
    limit_pairs: int | None = typer.Option(None, help="contrast pairs kept, sampled by pair (default: all)"),
    retain: str | None = typer.Option(
        None, help="everyday rows' sources, comma-separated: harmless, gsm8k-train (default both)"
    ),
    retain_ce: float | None = typer.Option(
        None,
        help="weight of the everyday rows' answer term: cross-entropy against the model's own greedy "
        "answer tokens (0: their states only; default 1)",
    ),
    retain_answer_tokens: int | None = typer.Option(None, help="everyday answers' tokens (default 48)"),
    answer_tokens: int | None = typer.Option(
        None, help="steered answer tokens when the ELS setting has no horizon (default 16)"
    ),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    seed: int | None = typer.Option(None),
    els_set: list[str] | None = typer.Option(
        None,
        "--els-set",
        help="KEY=VALUE of the ELS setting distilled, over the folder's tuned one (e.g. eta=0.3)",
    ),
    progress: ProgressOpt = True,
) -> None:
    """Distil the folder's ELS steering into a LoRA adapter (intervention els-lora): teacher-forced MSE on the
    state leaving the last steered block, ELS-steered on benign prompts, unsteered on harmful ones."""
    from aligntax.config import load_config
    from aligntax.runs.els_lora import DistillConfig, distill_els_lora

    check_intervention("els", {"path": str(steer)})
    try:
        from aligntax.interventions.options import spec_of
        from aligntax.interventions.registry import ElsOptions

        specs = {f.name: spec_of(f) for f in dataclasses.fields(ElsOptions) if f.name != "path"}
        els = {}
        for pair in els_set or []:
            key, sep, value = pair.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in specs:
                raise AligntaxError(
                    f"--els-set takes KEY=VALUE with KEY one of {', '.join(specs)}; got {pair!r}."
                )
            els[key] = parse_value(value, specs[key].parse, f"--els-set {key}")
        check_dtype(dtype)
        use_device(device)
        if model is not None:
            resolve_model(model, steer)  # a model the folder was not trained on: one line, before loading
        cfg = load_config(
            DistillConfig,
            config,
            steer=str(steer),
            out=str(out),
            model=model,
            layers=[int(x) for x in layers.split(",")] if layers else None,
            before=before,
            rank=rank,
            alpha=alpha,
            epochs=epochs,
            lr=lr,
            batch_size=batch_size,
            limit_benign=limit_benign,
            limit_harmful=limit_harmful,
            preserve_weight=preserve_weight,
            benign_target=benign_target,
            limit_retain=limit_retain,
            retain_weight=retain_weight,
            harmful_target=harmful_target,
            refusal_coeff=refusal_coeff,
            pairs=_split_list(pairs),
            limit_pairs=limit_pairs,
            retain=[x.strip() for x in retain.split(",") if x.strip()] if retain else None,
            retain_ce=retain_ce,
            retain_answer_tokens=retain_answer_tokens,
            answer_tokens=answer_tokens,
            dtype=dtype,
            seed=seed,
            els=els or None,
            progress=progress,
        )
        ensure_datasets(
            [*(cfg.pairs or []), *(r for r in cfg.retain if r != "harmless")], progress, "els distill"
        )
        meta = distill_els_lora(cfg)
    except AligntaxError as exc:
        _fail(exc)
    print(
        json.dumps(
            {k: meta[k] for k in ("layers", "target_block", "steered_layers", "data", "loss", "seconds")},
            indent=2,
        )
    )
    console.print(f"adapter: {out}")


@els_app.command("harm-basis")
def els_harm_basis(
    steer: Path = typer.Option(..., help="folder written by `aligntax els train`"),
    pairs: list[str] = typer.Option(
        None,
        help="contrast pairs whose differences give the directions after the "
        "first (default contrast-pairs; 'none': per-prompt differences)",
    ),
    k: int | None = typer.Option(None, help="directions saved per layer (default 8)"),
    batch_size: int | None = typer.Option(None),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Compute the harm basis (harm_basis.safetensors) of a folder trained before it was part of training:
    what ELS steps are projected off with --harm-orth K."""
    from aligntax.runs.els_train import harm_basis_for_folder

    check_intervention("els", {"path": str(steer)})
    try:
        check_dtype(dtype)
        use_device(device)
        basis = harm_basis_for_folder(
            steer, pairs=_split_list(pairs), k=k, batch_size=batch_size, progress=progress, dtype=dtype
        )
    except AligntaxError as exc:
        _fail(exc)
    console.print(f"harm basis: {len(basis.directions)} layers x {basis.k_max} directions in {steer}")


@els_app.command("row-strength")
def els_row_strength(
    steer: Path = typer.Option(..., help="folder written by `aligntax els train` (with its harm basis)"),
    model: str | None = typer.Option(
        None, "--model", "-m", help="model spec (default: the model the ELS folder was trained on)"
    ),
    layers: str | None = typer.Option(None, help="steered layers (default: the folder's tuned setting)"),
    eta: float | None = typer.Option(None),
    steps: int | None = typer.Option(None),
    horizon: int | None = typer.Option(None),
    harm_orth: int | None = typer.Option(None),
    limit_benign: int | None = typer.Option(None, help="over-refused benign training prompts (default 200)"),
    limit_harmful: int | None = typer.Option(None, help="harmful training prompts (default 200)"),
    max_new_tokens: int | None = typer.Option(None, help="default 32"),
    flip_weight: float | None = typer.Option(None, help="weight of the rows steering decides (default 3)"),
    floor: float | None = typer.Option(
        None, help="strengths below this are 0: the row is held back (default 0.1)"
    ),
    judge_name: str | None = typer.Option(None, "--judge"),
    batch_size: int | None = typer.Option(None),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Fit the learned per-row ELS strength (row_strength.safetensors) to the outcome of steering the
    folder's over-refused benign and harmful training prompts; used with --row-strength on."""
    from aligntax.config import load_config
    from aligntax.runs.strength import StrengthConfig, fit_strength

    try:
        model = resolve_model(model, steer) if steer.is_dir() else model
        check_dtype(dtype)
        use_device(device)
    except AligntaxError as exc:
        _fail(exc)
    check_intervention(
        "els", {"path": str(steer), "layers": [int(x) for x in layers.split(",")] if layers else None}, model
    )
    try:
        cfg = load_config(
            StrengthConfig,
            None,
            steer=str(steer),
            model=model,
            layers=[int(x) for x in layers.split(",")] if layers else None,
            eta=eta,
            steps=steps,
            horizon=horizon,
            harm_orth=harm_orth,
            limit_benign=limit_benign,
            limit_harmful=limit_harmful,
            max_new_tokens=max_new_tokens,
            flip_weight=flip_weight,
            floor=floor,
            judge=judge_name,
            batch_size=batch_size,
            dtype=dtype,
            progress=progress,
        )
        res = fit_strength(cfg)
    except AligntaxError as exc:
        _fail(exc)
    print(json.dumps(res, indent=2, default=str))


@els_app.command("sweep")
@grid_options
def els_sweep(
    steer: Path = typer.Option(..., help="folder written by `aligntax els train`"),
    out: Path | None = typer.Option(None, help="default STEER/sweep"),
    model: str | None = typer.Option(
        None, "--model", "-m", help="model spec (default: the model the ELS folder was trained on)"
    ),
    config: Path | None = typer.Option(None),
    benign: list[str] = typer.Option(
        None,
        help="validation benign sets (default orbench-hard-val, phtest-harmless-val, contrast-benign-val)",
    ),
    harmful: list[str] = typer.Option(
        None, help="validation harmful sets (default harmful-val, harmbench-val, contrast-harmful-val)"
    ),
    jailbreak: list[str] = typer.Option(
        None,
        help="jailbreak-wrapped harmful validation sets whose refusal a setting must keep within "
        "--jailbreak-tolerance (default wildguard-adv-val; 'none': not checked)",
    ),
    jailbreak_tolerance: float | None = typer.Option(
        None, help="largest jailbreak-refusal loss allowed (default 0)"
    ),
    method: str | None = typer.Option(None, help="first-token (screen, then confirm) or generate"),
    knowns: str | None = typer.Option(
        None,
        help="everyday questions with known answers whose val split a setting "
        "must keep within --knowns-tolerance ('builtin', a file, or 'none')",
    ),
    knowns_tolerance: float | None = typer.Option(None, help="largest accuracy loss allowed (default 0.02)"),
    limit: int | None = typer.Option(
        None,
        help="at most N prompts of each validation set and known-answer questions (sampled; default all)",
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        help="tokens generated per validation prompt (short: the sweep screens many settings)",
        show_default="24",
    ),
    baselines: bool | None = typer.Option(None, help="also score the baselines"),
    leak: list[str] = typer.Option(
        None,
        help="held-out harmful sets: refusal on the prompts each gated setting's "
        "harm gate passes, steered and unsteered (e.g. orbench-toxic)",
    ),
    limit_leak: int | None = typer.Option(None, help="at most N prompts of each leak set (sampled)"),
    leak_constraint: bool | None = typer.Option(
        None, help="the selected setting must keep every leaked refusal"
    ),
    lora: list[str] = typer.Option(
        None,
        help="an els-lora adapter folder (aligntax els distill) scored beside ELS "
        "at each --lora-scales (repeatable); the best is best_lora",
    ),
    lora_scales: str | None = typer.Option(None, help="comma-separated adapter scales (default 1)"),
    halving: int | None = typer.Option(
        None,
        help="successive halving: every setting on a stratified 1/N of the "
        "validation prompts, the --halving-keep best on all of them",
    ),
    halving_keep: int | None = typer.Option(
        None, help="settings scored on every prompt after the first round (default 2)"
    ),
    judge_name: str | None = typer.Option(None, "--judge"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    ray: RayOpt = None,
    workers: WorkersOpt = None,
    worker_cpus: WorkerCpusOpt = 1.0,
    worker_gpus: WorkerGpusOpt = None,
    device_map: DeviceMapOpt = None,
    grid: dict | None = None,
    backend: str | None = typer.Option(
        None,
        help="hf, or vllm: the settings' answers from a vLLM engine (./run setup-vllm)",
        show_default="hf",
    ),
    progress: ProgressOrConfigOpt = None,
) -> None:
    """Grid over steering strength on validation data, with a compliance-vs-safety Pareto plot."""
    from aligntax.config import load_config
    from aligntax.runs.els_sweep import SweepConfig, run_sweep
    from aligntax.runs.sources import generation_source

    try:
        cfg = load_config(
            SweepConfig,
            config,
            steer=str(steer),
            out=str(out) if out else None,
            model=model,
            benign=_split_list(benign),
            harmful=_split_list(harmful),
            jailbreak=_split_list(jailbreak),
            jailbreak_tolerance=jailbreak_tolerance,
            method=method,
            **(grid or {}),
            knowns_tolerance=knowns_tolerance,
            limit=limit,
            max_new_tokens=max_new_tokens,
            baselines=baselines,
            judge=judge_name,
            dtype=dtype,
            leak=_split_list(leak),
            limit_leak=limit_leak,
            leak_constraint=leak_constraint,
            halving=halving,
            halving_keep=halving_keep,
            device_map=device_map,
            backend=backend,
            progress=progress,
            lora=_split_list(lora),
            lora_scales=[
                float(parse_value(x, "float", "--lora-scales")) for x in lora_scales.split(",") if x.strip()
            ]
            if lora_scales
            else None,
        )
        if knowns is not None:
            cfg.knowns = None if knowns.strip().lower() == "none" else knowns
        source = generation_source(cfg.backend, _ray_config(ray, workers, worker_cpus, worker_gpus))
        check_intervention("els", {"path": cfg.steer})
        cfg.model = resolve_model(cfg.model, cfg.steer)
        check_dtype(cfg.dtype)
        use_device(device)
        check_out_folder(cfg.out)
        check_judge(cfg.judge)
        sets = [*(cfg.benign or []), *(cfg.harmful or []), *(cfg.jailbreak or []), *(cfg.leak or [])]
        check_datasets(sets, "a dataset")
        ensure_datasets(sets, cfg.progress, "els sweep")
        check_layers(cfg.model, [x for lay in cfg.layers or [] for x in lay], "--layers-grid")
        check_range(cfg.max_new_tokens, "positive_count", "--max-new-tokens")
    except AligntaxError as exc:
        _fail(exc)
    with closing(source):
        res = run_sweep(cfg, source=source)
    print(json.dumps(res, indent=2))


@app.command()
def demo(
    out: Path | None = typer.Option(
        None,
        help="run folder (default runs/demo, runs/demo-full with --full; with --backend vllm runs/demo-vllm)",
    ),
    full: bool = typer.Option(
        False,
        "--full",
        help="the complete evaluation: 600 training prompts per set, every "
        "sweep setting on every validation prompt, every baseline on "
        "the test sets (about 2.5 times as long)",
    ),
    model: str = typer.Option(
        DEFAULT_MODEL,
        "--model",
        "-m",
        help="model spec: a Hugging Face Hub id (Qwen/Qwen2.5-7B-Instruct), a model folder, a .gguf file or "
        "embedded:NAME",
    ),
    limit: int | None = typer.Option(None, help="first N items of each test set"),
    max_new_tokens: int = typer.Option(
        DEFAULT_MAX_NEW_TOKENS, help="tokens generated per test prompt at most"
    ),
    judge_name: str = typer.Option("classifier", "--judge", help="keyword, prefix, classifier, llm"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    batch_size: int = typer.Option(96, help="prompts per batch (vLLM: the engine's sequence slots)"),
    backend: str = typer.Option(
        "hf",
        help="hf, or vllm: every generation of the evaluations, sweep and "
        "known-answer check on one vLLM engine (./run setup-vllm)",
    ),
    mechanisms: str | None = typer.Option(
        None,
        help="front mechanisms in the validation sweep beside ELS, "
        "comma-separated: harm-orth, row-strength, els-lora (default "
        "harm-orth; with --full also row-strength); 'none': plain ELS",
    ),
    progress: ProgressOpt = True,
) -> None:
    """The main job: baseline eval, ELS training, validation sweep, steered eval and a report."""
    from aligntax.runs.demo import check_mechanisms, demo_config, demo_datasets, run_demo
    from aligntax.runs.sources import generation_source

    out = out or Path(
        ("runs/demo" if backend == "hf" else f"runs/demo-{backend}") + ("-full" if full else "")
    )
    try:
        source = generation_source(backend)
        check_out_folder(out)
        check_judge(judge_name)
        check_dtype(dtype)
        use_device(device)
        check_range(max_new_tokens, "positive_count", "--max-new-tokens")
        check_range(batch_size, "positive_count", "--batch-size")
        picked = (
            None
            if mechanisms is None
            else [m.strip() for m in mechanisms.split(",") if m.strip() and m.strip() != "none"]
        )
        check_mechanisms(picked or [])
        cfg = demo_config(
            full,
            out=str(out),
            model=model,
            limit=limit,
            max_new_tokens=max_new_tokens,
            judge=judge_name,
            dtype=dtype,
            batch_size=batch_size,
            backend=backend,
            progress=progress,
            mechanisms=picked,
        )
        ensure_datasets(demo_datasets(cfg), progress, "demo")
    except AligntaxError as exc:
        _fail(exc)
    with closing(source):
        run_demo(cfg, source=source)
    Console().print((out / "report.md").read_text())


def _mount_faces() -> None:
    """The sub-commands whose faces live in their own modules of this package: ``vat``, ``audit``,
    ``serve``, ``lm-eval`` (lm-eval itself is imported when the command runs), ``bundle`` and ``export``."""
    from aligntax.cli.audit import audit_command
    from aligntax.cli.bundles import mount as mount_bundles
    from aligntax.cli.lmeval import lm_eval_command
    from aligntax.cli.serve import serve_command
    from aligntax.cli.vat import app as vat_app

    app.add_typer(vat_app, name="vat")
    app.command("audit")(audit_command)
    app.command("serve")(serve_command)
    app.command("lm-eval")(lm_eval_command)
    mount_bundles(app)


_mount_faces()

if __name__ == "__main__":
    app()
