"""``aligntax vat``: measure the value alignment tax of an intervention."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from aligntax.cli.options import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    ProgressOpt,
    check_dtype,
    fail,
    steering_options,
    use_device,
)
from aligntax.errors import AligntaxError
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.vat.methods import REGISTRY

app = typer.Typer(
    help="Value Alignment Tax: how an intervention aimed at one Schwartz value moves all ten.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _fail(exc: Exception) -> None:
    fail(exc)


def _sample_by(sample_by: str, data: str) -> str:
    from aligntax.vat.items import sample_by_for

    if sample_by not in ("item", "scene", "auto"):
        raise typer.BadParameter("--sample-by must be item, scene or auto")
    return sample_by_for(data, sample_by)


def _strata(text: str | None) -> list[str] | None:
    return None if not text else [x.strip() for x in text.split(",") if x.strip()]


def _default_out(model: str, intervention: str, target: str) -> Path:
    from aligntax.vat.schwartz import CODES

    short = model.split(":")[-1].split("/")[-1].replace(".gguf", "")
    return Path("vat-runs") / f"{short}-{intervention}-{CODES[target].lower()}"


def _default_intervention(iv_args: dict, post_model: str | None) -> str:
    """Without --intervention: adapter with --adapter, none with --post-model, else persona."""
    return "adapter" if iv_args.get("adapter") is not None else "none" if post_model else "persona"


@app.command("run")
@steering_options(methods=REGISTRY)
def run(
    target: str = typer.Option(..., "--target", "-t", help="target value (any of the 10, e.g. Benevolence)"),
    model: ModelOpt = None,
    data: str = typer.Option(
        "builtin", "--data", "-d", help="builtin | value-action-lens | Hub id | .jsonl/.json/.csv file"
    ),
    intervention: str | None = typer.Option(
        None,
        "--intervention",
        "-i",
        help="none | persona | fewshot-K | persona-fewshot-K | steer | lora | dpo | adapter | oracle | uniform, or "
        "any steering method (els, cast, refusal-ablation, ...: `aligntax vat methods`) (default: persona; "
        "adapter with --adapter; none with --post-model; els with --steer alone)",
    ),
    iv_args: dict | None = None,
    post_model: str | None = typer.Option(
        None,
        help="judge 'post' with this model (pre: --model), e.g. a fine-tuned checkpoint against its base",
    ),
    control: Path | None = typer.Option(
        None,
        help="a finished control run on the same items: lift-adjusted "
        "drifts = shift minus the control's shift, item by item",
    ),
    limit_per_value: int | None = typer.Option(
        None, help="evaluate at most N items per value (balanced polarity)"
    ),
    scenes: int | None = typer.Option(None, help="evaluate only N randomly chosen scenes"),
    sample_by: str = typer.Option(
        "auto",
        help="with --limit-per-value: item (spread over scenes) | scene (whole "
        "scenes holding every value, for the coupling) | auto (scene for "
        "ValueActionLens, item otherwise)",
    ),
    per_scene_value: int = typer.Option(2, help="--sample-by scene: items of each value per scene"),
    strata: str | None = typer.Option(
        None,
        help="only these desirability strata, comma-separated: congruent, incongruent, neutral, unlabelled",
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="output folder (rerun to resume)"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    batch_size: int = typer.Option(16, help="prompts per forward pass"),
    train_fraction: float = typer.Option(
        0.2, help="share of scenes held out for few-shot/steer/lora/dpo data"
    ),
    split_by: str = typer.Option("scene", help="scene | context | item"),
    templates: str = typer.Option(
        "acceptable", help="comma-separated templates (names: acceptable, appropriate, rate)"
    ),
    reverse_order: bool = typer.Option(False, help="also ask with the reversed scale and average"),
    method: str = typer.Option("logits", help="logits (next-token probabilities) | generate (parse text)"),
    scale_max: int = typer.Option(5, help="Likert scale 1..N (N <= 9)"),
    seed: int = typer.Option(0),
    bootstrap: int = typer.Option(500, help="bootstrap repetitions (0: none)"),
    permutations: int = typer.Option(999, help="Mantel permutations"),
    null_reps: int = typer.Option(200, help="permutations for the no-coupling nVAT baseline (0: skip)"),
    no_cache: bool = typer.Option(False, help="do not read or write the judgment cache"),
    field: list[str] = typer.Option([], help="Hub field mapping OURS=COLUMN (repeatable)"),
    split: str = typer.Option("test", help="Hub dataset split"),
    ray: str | None = typer.Option(
        None,
        "--ray",
        help="judge the chunks of items on replicas of the model over Ray: 'local' (a new cluster "
        "on this machine), 'auto', HOST:6379 or ray://HOST:10001 (docs/ray.md)",
    ),
    workers: int | None = typer.Option(None, help="--ray: replicas of the model (default: as many as fit)"),
    worker_cpus: float = typer.Option(1.0, help="--ray: CPUs per replica (also its torch threads)"),
    worker_gpus: float | None = typer.Option(
        None, help="--ray: GPUs per replica (default 1 when the cluster has GPUs, else 0)"
    ),
    progress: ProgressOpt = True,
) -> None:
    """Judge the items before and after an intervention and write items.jsonl, results.json, report.md.
    The intervention's options are those of every steering command (--steer, --vectors, --layers, ...)
    and of the value-targeted methods (--strength, --steps, --adapter-dir, --oracle-gain, ...)."""
    from aligntax.cli.options import check_intervention, check_out_folder
    from aligntax.models import load_model
    from aligntax.vat.items import evaluation_items
    from aligntax.vat.judge import JudgeConfig, LikertScale
    from aligntax.vat.methods import build_intervention
    from aligntax.vat.runner import VATConfig, run_vat
    from aligntax.vat.schwartz import resolve_value

    iv_args = dict(iv_args or {})
    try:
        check_dtype(dtype)
        use_device(device)
        dtype = dtype or "bf16"
        if intervention is None:
            intervention = _default_intervention(iv_args, post_model)
            check_intervention(intervention, iv_args, model, methods=REGISTRY)
        REGISTRY.resolve(intervention)  # fewshot-K needs its K
        check_out_folder(out)
        t = resolve_value(target)
        kwargs = {}
        if field:
            kwargs["fields"] = dict(f.split("=", 1) for f in field)
        if field or "/" in data and not Path(data).exists():
            kwargs["split"] = split
        by = _sample_by(sample_by, data)
        eval_items, train_items = evaluation_items(
            data,
            train_fraction=train_fraction,
            split_by=split_by,
            per_value=limit_per_value,
            scenes=scenes,
            sample_by=by,
            per_scene_value=per_scene_value,
            strata=_strata(strata),
            seed=seed,
            **kwargs,
        )
        jcfg = JudgeConfig(
            scale=LikertScale(1, scale_max),
            templates=tuple(templates.split(",")),
            orders=("normal", "reversed") if reverse_order else ("normal",),
            method=method,
            batch_size=batch_size,
            cache=not no_cache,
        )
        out_dir = out or _default_out(model, intervention, t)
        typer.echo(
            f"{len(eval_items)} evaluation items, {len(train_items)} held-out training items; "
            f"output {out_dir}",
            err=True,
        )
        lm = load_model(model, dtype=dtype)
        post_lm = load_model(post_model, dtype=dtype) if post_model else None
        # the arguments of build_intervention besides the name, model, target and training items; a
        # trained adapter goes to OUT/adapter unless --adapter-dir says otherwise
        options = dict(
            seed=seed,
            exclude_ids={it.id for it in eval_items},
            options=iv_args,
            adapter_dir=str(out_dir / "adapter"),
        )
        iv = build_intervention(intervention, lm, t, train_items, jcfg, progress=progress, **options)
        adapter = iv_args.get("adapter")
        cfg = VATConfig(
            judge=jcfg,
            bootstrap_reps=bootstrap,
            n_perm=permutations,
            nvat_null_reps=null_reps,
            seed=seed,
            progress=progress,
            extra={
                "data": data,
                "intervention": intervention,
                "limit_per_value": limit_per_value,
                "scenes": scenes,
                "train_fraction": train_fraction,
                "split_by": split_by,
                "sample_by": by,
                "strata": strata,
                "post_model": post_model,
                "adapter": None if adapter is None else str(adapter),
            },
        )
        if ray is None:
            if workers is not None or worker_gpus is not None:
                raise AligntaxError("--workers and --worker-gpus go with --ray ADDRESS (e.g. --ray local).")
            res = run_vat(lm, eval_items, t, iv, out_dir, cfg, post_lm=post_lm, control=control)
        else:
            from aligntax.runs.distributed import RayConfig, replicas_of

            ray_cfg = RayConfig(address=ray, workers=workers, cpus=worker_cpus, gpus=worker_gpus)
            build = {"name": intervention, "target": t, "train_items": train_items, "options": options}
            with replicas_of(ray_cfg, model, dtype) as replicas:
                res = run_vat(
                    lm,
                    eval_items,
                    t,
                    iv,
                    out_dir,
                    cfg,
                    post_lm=post_lm,
                    control=control,
                    replicas=replicas,
                    build=build,
                )
    except AligntaxError as exc:
        _fail(exc)
        return
    v = res["vat"]
    sp = res["specificity"]
    typer.echo(
        json.dumps(
            {
                "out": str(out_dir),
                "target": t,
                "gain": res["gain"],
                "vat": {"signed": v["signed"], "absolute": v["absolute"], "reason": v["reason"]},
                "specificity": {k: sp.get(k) for k in ("value", "ci95", "interpretation")},
                "nvat": res["nvat"],
                "circumplex_test": {k: res["circumplex_test"].get(k) for k in ("statistic", "p_value")},
            },
            indent=2,
        )
    )


@app.command("compare")
def compare_cmd(
    dirs: list[Path] = typer.Argument(..., help="VAT run folders"),
    out: Path | None = typer.Option(None, "--out", "-o", help="where to write the comparison"),
    eval_run: list[Path] = typer.Option(
        [],
        "--eval",
        help="an `aligntax eval` run folder (repeatable): adds the refusal-side table and refusal_side.png",
    ),
    eval_baseline: Path | None = typer.Option(None, help="the unsteered `aligntax eval` run to compare with"),
    paired: bool = typer.Option(
        True,
        help="with two or more runs: check shared items, judge and model "
        "and write paired per-value differences against the first run",
    ),
    bootstrap: int = typer.Option(2000, help="scene-bootstrap draws of the paired differences"),
    seed: int = typer.Option(0),
) -> None:
    """Gain versus tax across runs: gain_vs_tax.png and compare.md (plus the refusal side with --eval), and
    paired differences against the first run (paired.md, paired.json)."""
    from aligntax.vat.report import compare
    from aligntax.vat.sweep import paired_compare

    try:
        c = compare(dirs, out, eval_dirs=eval_run, eval_baseline=eval_baseline)
        if paired and len(dirs) >= 2:
            paired_compare(dirs, c.markdown.parent, reps=bootstrap, seed=seed)
            text = c.markdown.read_text() + "\n" + (c.markdown.parent / "paired.md").read_text()
            c.markdown.write_text(text)
    except AligntaxError as exc:
        _fail(exc)
        return
    typer.echo(c.markdown.read_text())
    typer.echo(f"wrote {c.markdown} and {c.png}", err=True)


@app.command("rescore")
def rescore_cmd(
    dirs: list[Path] = typer.Argument(..., help="VAT run folders"),
    bootstrap: int = typer.Option(500, help="bootstrap repetitions (0: none)"),
    permutations: int = typer.Option(999, help="Mantel permutations"),
    null_reps: int = typer.Option(200, help="permutations for the no-coupling nVAT baseline"),
    eps: float = typer.Option(1e-3, help="|gain| below which GND and VAT are undefined"),
    coupling: str = typer.Option("spearman", help="spearman | kendall | pearson"),
    include_diagonal: bool = typer.Option(False, help="count the diagonal of R in nVAT"),
    control: Path | None = typer.Option(None, help="a control run: adds lift-adjusted drifts"),
    bootstrap_method: str = typer.Option("scene", help="scene (percentile) | subsample (earlier)"),
    seed: int = typer.Option(0),
) -> None:
    """Recompute results.json and the report from items.jsonl with new metric settings (no model)."""
    from aligntax.vat.runner import VATConfig, rescore

    try:
        for d in dirs:
            res = rescore(
                d,
                VATConfig(
                    bootstrap_reps=bootstrap,
                    n_perm=permutations,
                    eps=eps,
                    nvat_null_reps=null_reps,
                    bootstrap_method=bootstrap_method,
                    coupling_method=coupling,
                    include_diagonal=include_diagonal,
                    seed=seed,
                ),
                control=control,
            )
            typer.echo(
                f"{d}: gain {res['gain']['value']:+.4f}, VAT abs {res['vat']['absolute']}, "
                f"S_T {res['specificity']['value']:+.4f} {res['specificity']['ci95']}, "
                f"nVAT {res['nvat']:.3f}"
            )
    except AligntaxError as exc:
        _fail(exc)


@app.command("matrix")
@steering_options(methods=REGISTRY)
def matrix_cmd(
    out: Path = typer.Option(
        ..., "--out", "-o", help="folder: one run per target in OUT/<code>/, matrix.json/md"
    ),
    runs: list[Path] = typer.Option([], "--from", help="build the matrix from ten finished runs instead"),
    intervention: str = typer.Option("fewshot-8", "--intervention", "-i", help="as for `vat run`"),
    iv_args: dict | None = None,
    model: ModelOpt = None,
    post_model: str | None = typer.Option(None, help="judge 'post' with this model"),
    data: str = typer.Option("builtin", "--data", "-d"),
    limit_per_value: int | None = typer.Option(None, help="evaluate at most N items per value"),
    scenes: int | None = typer.Option(None, help="evaluate only N randomly chosen scenes"),
    sample_by: str = typer.Option(
        "item", help="with --limit-per-value: item | scene | auto (as for `vat run`)"
    ),
    per_scene_value: int = typer.Option(2, help="--sample-by scene: items of each value per scene"),
    strata: str | None = typer.Option(None, help="only these desirability strata (comma-separated)"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    batch_size: int = typer.Option(16),
    train_fraction: float = typer.Option(0.2),
    bootstrap: int = typer.Option(500),
    permutations: int = typer.Option(999, help="Mantel permutations of each run"),
    matrix_permutations: int = typer.Option(9999, help="permutations of the matrix tests"),
    null_reps: int = typer.Option(0, help="nVAT-null permutations of each run (0: skip)"),
    seed: int = typer.Option(0),
    no_cache: bool = typer.Option(False),
) -> None:
    """The intervention aimed at each of the ten values: the 10 x 10 shift matrix, double-centred, with a
    permutation test of its diagonal and a Mantel test against distance on the Schwartz circle. The
    intervention's options are those of `vat run`."""
    from aligntax.cli.options import check_out_folder
    from aligntax.vat.matrix import matrix_from_runs, run_matrix, write_matrix

    try:
        check_dtype(dtype)
        use_device(device)
        dtype = dtype or "bf16"
        check_out_folder(out)
        if runs:
            res = write_matrix(matrix_from_runs(runs), out, n_perm=matrix_permutations, seed=seed)
        else:
            from aligntax.models import load_model
            from aligntax.vat.items import load_items, sample_items, split_items
            from aligntax.vat.judge import JudgeConfig
            from aligntax.vat.methods import build_intervention
            from aligntax.vat.runner import VATConfig

            items = load_items(data)
            eval_items, train_items = split_items(items, train_fraction, seed=seed)
            by = _sample_by(sample_by, data)
            eval_items = sample_items(
                eval_items,
                per_value=limit_per_value,
                scenes=scenes,
                seed=seed,
                strata=_strata(strata),
                by=by,
                per_scene_value=per_scene_value,
            )
            jcfg = JudgeConfig(batch_size=batch_size, cache=not no_cache)
            lm = load_model(model, dtype=dtype)
            post_lm = load_model(post_model, dtype=dtype) if post_model else None
            ids = {it.id for it in eval_items}
            cfg = VATConfig(
                judge=jcfg,
                bootstrap_reps=bootstrap,
                n_perm=permutations,
                nvat_null_reps=null_reps,
                seed=seed,
                extra={
                    "data": data,
                    "intervention": intervention,
                    "limit_per_value": limit_per_value,
                    "scenes": scenes,
                    "sample_by": by,
                    "strata": strata,
                },
            )
            res = run_matrix(
                lm,
                eval_items,
                lambda t: build_intervention(
                    intervention,
                    lm,
                    t,
                    train_items,
                    jcfg,
                    seed=seed,
                    exclude_ids=ids,
                    options=iv_args,
                    adapter_dir=out / "adapters" / t.lower(),
                ),
                out,
                cfg,
                post_lm=post_lm,
                n_perm=matrix_permutations,
            )
    except AligntaxError as exc:
        _fail(exc)
        return
    typer.echo((out / "matrix.md").read_text())
    typer.echo(
        json.dumps({"diagonal_test": res["diagonal_test"], "mantel": res["mantel"]}, indent=2), err=True
    )


@app.command("sweep")
def sweep_cmd(
    out: Path = typer.Option(
        ..., "--out", "-o", help="sweep folder: OUT/<model>/<intervention>/<code>/ per cell"
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="a YAML file with the keys of the flags (models, interventions, targets, data, ...)",
    ),
    model: list[str] = typer.Option([], "--model", "-m", help="model spec (repeatable)"),
    intervention: list[str] = typer.Option([], "--intervention", "-i", help="intervention (repeatable)"),
    target: list[str] = typer.Option([], "--target", "-t", help="target value (repeatable; default all ten)"),
    data: str | None = typer.Option(None, "--data", "-d"),
    limit_per_value: int | None = typer.Option(None),
    scenes: int | None = typer.Option(None),
    sample_by: str | None = typer.Option(None, help="item | scene"),
    strata: str | None = typer.Option(None, help="comma-separated desirability strata"),
    bootstrap: int | None = typer.Option(None),
    permutations: int | None = typer.Option(None),
    seed: int | None = typer.Option(None),
) -> None:
    """Models x interventions x targets, one resumable run folder per cell, and a summary table
    (summary.md, summary.csv, summary.json). Rerun the same command to resume; flags override the YAML."""
    from aligntax.cli.options import check_out_folder
    from aligntax.vat.sweep import SweepSpec, run_sweep

    try:
        check_out_folder(out)
        d: dict = {}
        if config is not None:
            import yaml

            try:
                d = yaml.safe_load(config.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise AligntaxError(f"sweep config {config}: {exc}") from None
            if not isinstance(d, dict):
                raise AligntaxError(f"sweep config {config}: expected a mapping of keys")
        flags = {
            "models": model or None,
            "interventions": intervention or None,
            "targets": target or None,
            "data": data,
            "limit_per_value": limit_per_value,
            "scenes": scenes,
            "sample_by": sample_by,
            "strata": _strata(strata),
            "bootstrap": bootstrap,
            "permutations": permutations,
            "seed": seed,
        }
        d.update({k: v for k, v in flags.items() if v is not None})
        d.setdefault("models", [DEFAULT_MODEL])
        spec = SweepSpec.from_dict(d)
        rows = run_sweep(spec, out, log=lambda m: typer.echo(m, err=True))
    except AligntaxError as exc:
        _fail(exc)
        return
    typer.echo((out / "summary.md").read_text())
    failed = [r for r in rows if str(r.get("status", "")).startswith("failed")]
    if failed:
        typer.echo(f"{len(failed)} cell(s) failed; see summary.md", err=True)
        raise typer.Exit(1)


@app.command("persona")
def persona_cmd(target: str = typer.Option(..., "--target", "-t", help="target value")) -> None:
    """Print the value-persona system prompt of a target, e.g. for `aligntax eval --system`."""
    from aligntax.vat.methods import persona_text

    try:
        typer.echo(persona_text(target))
    except (AligntaxError, ValueError) as exc:
        _fail(exc)


@app.command("methods")
def methods_cmd() -> None:
    """List the interventions vat run takes: the value-targeted methods with their options, then the
    steering methods of the intervention registry (their options through the steering flags)."""
    from aligntax.interventions.registry import describe
    from aligntax.vat.methods import describe_vat

    typer.echo("value-targeted methods (fewshot-K / persona-fewshot-K name K):")
    typer.echo(describe_vat())
    typer.echo("\nsteering methods:")
    typer.echo(describe())


@app.command("values")
def values_cmd(
    convention: str = typer.Option("wedge", help="circular distance convention: wedge | ten"),
) -> None:
    """Print the Schwartz value circle, groups, refined values and SVS items."""
    from rich.console import Console
    from rich.table import Table

    from aligntax.vat.schwartz import CODES, VALUES, circle_text, distance_matrix

    try:
        text, matrix = circle_text(convention), distance_matrix(convention).astype(int)
    except ValueError as exc:
        _fail(exc)
    typer.echo(text)
    table = Table(title=f"Circular distance between values ({convention} convention, circle order)")
    table.add_column("value", no_wrap=True)
    for v in VALUES:
        table.add_column(CODES[v], justify="right")
    for v, row in zip(VALUES, matrix, strict=True):
        table.add_row(f"{v} ({CODES[v]})", *(str(int(x)) for x in row))
    Console().print(table)


if __name__ == "__main__":  # pragma: no cover
    app()
