"""``aligntax els``: train energy models, distil them into an adapter, and tune steering on validation."""

from __future__ import annotations

import dataclasses
import json
from contextlib import closing
from pathlib import Path

import typer

from aligntax.cli.options import (
    DeviceMapOpt,
    DeviceOpt,
    DtypeOpt,
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
    check_layers,
    check_out_folder,
    check_range,
    console,
    deprecated,
    ensure_datasets,
    grid_options,
    ray_config,
    resolve_model,
    split_list,
    use_device,
)
from aligntax.cli.options import fail as _fail
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError
from aligntax.interventions.options import parse_value
from aligntax.models.spec import DEFAULT_MODEL

app = typer.Typer(
    help="Energy Landscape Steering: train energy models and tune steering.", no_args_is_help=True
)


@app.command("train")
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
            benign=split_list(benign),
            harmful=split_list(harmful),
            harmless=split_list(harmless),
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
            gate_harmful=split_list(gate_harmful),
            limit_gate_harmful=limit_gate_harmful,
            gate_benign=split_list(gate_benign),
            limit_gate_benign=limit_gate_benign,
            gate_pairs=split_list(gate_pairs),
            gate_pairs_weight=gate_pairs_weight,
            gate_ensemble=gate_ensemble,
            progress=progress,
            harm_pairs=split_list(harm_pairs),
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
        ray_cfg = ray_config(ray, workers, worker_cpus, worker_gpus)
    except AligntaxError as exc:
        _fail(exc)
    train_els(cfg, ray=ray_cfg)
    console.print(f"energy models and report: {out}")


@app.command("distill")
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
            pairs=split_list(pairs),
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


@app.command("harm-basis")
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
            steer, pairs=split_list(pairs), k=k, batch_size=batch_size, progress=progress, dtype=dtype
        )
    except AligntaxError as exc:
        _fail(exc)
    console.print(f"harm basis: {len(basis.directions)} layers x {basis.k_max} directions in {steer}")


@app.command("row-strength")
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


@app.command("sweep")
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
            benign=split_list(benign),
            harmful=split_list(harmful),
            jailbreak=split_list(jailbreak),
            jailbreak_tolerance=jailbreak_tolerance,
            method=method,
            **(grid or {}),
            knowns_tolerance=knowns_tolerance,
            limit=limit,
            max_new_tokens=max_new_tokens,
            baselines=baselines,
            judge=judge_name,
            dtype=dtype,
            leak=split_list(leak),
            limit_leak=limit_leak,
            leak_constraint=leak_constraint,
            halving=halving,
            halving_keep=halving_keep,
            device_map=device_map,
            backend=backend,
            progress=progress,
            lora=split_list(lora),
            lora_scales=[
                float(parse_value(x, "float", "--lora-scales")) for x in lora_scales.split(",") if x.strip()
            ]
            if lora_scales
            else None,
        )
        if knowns is not None:
            cfg.knowns = None if knowns.strip().lower() == "none" else knowns
        source = generation_source(cfg.backend, ray_config(ray, workers, worker_cpus, worker_gpus))
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
