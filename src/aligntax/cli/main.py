"""The ``aligntax`` command line: a thin layer over the library."""

from __future__ import annotations

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
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
    InterventionOpt,
    ModelOpt,
    ProgressOpt,
    ProgressOrConfigOpt,
    RayOpt,
    WorkerCpusOpt,
    WorkerGpusOpt,
    WorkersOpt,
    check_datasets,
    check_dtype,
    check_intervention,
    check_judge,
    check_out_file,
    check_out_folder,
    check_range,
    ensure_datasets,
    ray_config,
    resolve_model,
    set_debug,
    steering_options,
    subsets_option,
    use_device,
)
from aligntax.cli.options import fail as _fail
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE
from aligntax.errors import AligntaxError, UsageError
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
            subsets=subsets_option(subset),
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
        source = generation_source(cfg.backend, ray_config(ray, workers, worker_cpus, worker_gpus))
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
    """The sub-commands whose faces live in their own modules of this package: ``els``, ``vat``, ``audit``,
    ``serve``, ``lm-eval`` (lm-eval itself is imported when the command runs), ``bundle`` and ``export``."""
    from aligntax.cli.audit import audit_command
    from aligntax.cli.bundles import mount as mount_bundles
    from aligntax.cli.els import app as els_app
    from aligntax.cli.lmeval import lm_eval_command
    from aligntax.cli.serve import serve_command
    from aligntax.cli.vat import app as vat_app

    app.add_typer(els_app, name="els")
    app.add_typer(vat_app, name="vat")
    app.command("audit")(audit_command)
    app.command("serve")(serve_command)
    app.command("lm-eval")(lm_eval_command)
    mount_bundles(app)


_mount_faces()

if __name__ == "__main__":
    app()
