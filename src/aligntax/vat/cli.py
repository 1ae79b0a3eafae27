"""``aligntax vat``: measure the value alignment tax of an intervention."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from aligntax.errors import AligntaxError
from aligntax.models.spec import DEFAULT_MODEL

app = typer.Typer(
    help="Value Alignment Tax: how an intervention aimed at one Schwartz value moves all ten.",
    no_args_is_help=True, pretty_exceptions_enable=False)


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(2)


def _default_out(model: str, intervention: str, target: str) -> Path:
    from aligntax.vat.schwartz import CODES

    short = model.split(":")[-1].split("/")[-1].replace(".gguf", "")
    return Path("vat-runs") / f"{short}-{intervention}-{CODES[target].lower()}"


@app.command("run")
def run(
    target: str = typer.Option(..., "--target", "-t", help="target value (any of the 10, e.g. Benevolence)"),
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m", help="model spec"),
    data: str = typer.Option("builtin", "--data", "-d",
                             help="builtin | value-action-lens | Hub id | .jsonl/.json/.csv file"),
    intervention: str = typer.Option("persona", "--intervention", "-i",
                                     help="none | persona | fewshot-2/4/8 | persona-fewshot-2/4/8 | steer | lora "
                                          "| dpo | els"),
    limit_per_value: int | None = typer.Option(None, help="evaluate at most N items per value (balanced polarity)"),
    scenes: int | None = typer.Option(None, help="evaluate only N randomly chosen scenes"),
    out: Path | None = typer.Option(None, "--out", "-o", help="output folder (rerun to resume)"),
    dtype: str = typer.Option("bf16", help="bf16 | fp32 | fp16"),
    batch_size: int = typer.Option(16, help="prompts per forward pass"),
    strength: float = typer.Option(4.0, help="steering strength (multiplies the mean-difference vector)"),
    layer: int | None = typer.Option(None, help="steering layer (default: middle)"),
    steps: int | None = typer.Option(None, help="training steps for lora/dpo (default 30/20)"),
    lr: float | None = typer.Option(None, help="learning rate for lora/dpo"),
    adapter_dir: Path | None = typer.Option(None, help="where to save (or load) the lora/dpo adapter"),
    energy_dir: Path | None = typer.Option(None, help="els: energy bank folder from `aligntax els train`"),
    train_fraction: float = typer.Option(0.2, help="share of scenes held out for few-shot/steer/lora/dpo data"),
    split_by: str = typer.Option("scene", help="scene | context | item"),
    templates: str = typer.Option("acceptable", help="comma-separated templates (names: acceptable, appropriate, rate)"),
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
) -> None:
    """Judge the items before and after an intervention and write items.jsonl, results.json, report.md."""
    from aligntax.models import load_model
    from aligntax.vat.interventions import build_intervention
    from aligntax.vat.items import load_items, sample_items, split_items
    from aligntax.vat.judge import JudgeConfig, LikertScale
    from aligntax.vat.runner import VATConfig, run_vat
    from aligntax.vat.schwartz import resolve_value

    try:
        t = resolve_value(target)
        kwargs = {}
        if field:
            kwargs["fields"] = dict(f.split("=", 1) for f in field)
        if field or "/" in data and not Path(data).exists():
            kwargs["split"] = split
        items = load_items(data, **kwargs)
        eval_items, train_items = split_items(items, train_fraction, seed=seed, by=split_by)
        eval_items = sample_items(eval_items, per_value=limit_per_value, scenes=scenes, seed=seed)
        jcfg = JudgeConfig(scale=LikertScale(1, scale_max), templates=tuple(templates.split(",")),
                           orders=("normal", "reversed") if reverse_order else ("normal",), method=method,
                           batch_size=batch_size, cache=not no_cache)
        out_dir = out or _default_out(model, intervention, t)
        typer.echo(f"{len(eval_items)} evaluation items, {len(train_items)} held-out training items; "
                   f"output {out_dir}", err=True)
        lm = load_model(model, dtype=dtype)
        iv = build_intervention(intervention, lm, t, train_items, jcfg, strength=strength, layer=layer,
                                steps=steps, lr=lr, adapter_dir=adapter_dir or (out_dir / "adapter"),
                                energy_dir=energy_dir, seed=seed,
                                exclude_ids={it.id for it in eval_items}, progress=True)
        cfg = VATConfig(judge=jcfg, bootstrap_reps=bootstrap, n_perm=permutations, nvat_null_reps=null_reps,
                        seed=seed,
                        extra={"data": data, "intervention": intervention, "limit_per_value": limit_per_value,
                               "scenes": scenes, "train_fraction": train_fraction, "split_by": split_by})
        res = run_vat(lm, eval_items, t, iv, out_dir, cfg)
    except AligntaxError as exc:
        _fail(exc)
        return
    v = res["vat"]
    typer.echo(json.dumps({"out": str(out_dir), "target": t, "gain": res["gain"], "vat": {
        "signed": v["signed"], "absolute": v["absolute"], "reason": v["reason"]}, "nvat": res["nvat"],
        "circumplex_test": {k: res["circumplex_test"].get(k) for k in ("statistic", "p_value")}}, indent=2))


@app.command("compare")
def compare_cmd(dirs: list[Path] = typer.Argument(..., help="VAT run folders"),
                out: Path | None = typer.Option(None, "--out", "-o", help="where to write the comparison"),
                eval_run: list[Path] = typer.Option([], "--eval", help="an `aligntax eval` run folder (repeatable): "
                                                    "adds the refusal-side table and refusal_side.png"),
                eval_baseline: Path | None = typer.Option(None, help="the unsteered `aligntax eval` run to compare with")
                ) -> None:
    """Gain versus tax across runs: gain_vs_tax.png and compare.md (plus the refusal side with --eval)."""
    from aligntax.vat.report import compare

    try:
        c = compare(dirs, out, eval_dirs=eval_run, eval_baseline=eval_baseline)
    except AligntaxError as exc:
        _fail(exc)
        return
    typer.echo(c.markdown.read_text())
    typer.echo(f"wrote {c.markdown} and {c.png}", err=True)


@app.command("rescore")
def rescore_cmd(dirs: list[Path] = typer.Argument(..., help="VAT run folders"),
                bootstrap: int = typer.Option(500, help="bootstrap repetitions (0: none)"),
                permutations: int = typer.Option(999, help="Mantel permutations"),
                null_reps: int = typer.Option(200, help="permutations for the no-coupling nVAT baseline"),
                eps: float = typer.Option(1e-3, help="|gain| below which GND and VAT are undefined"),
                coupling: str = typer.Option("spearman", help="spearman | kendall | pearson"),
                include_diagonal: bool = typer.Option(False, help="count the diagonal of R in nVAT"),
                seed: int = typer.Option(0)) -> None:
    """Recompute results.json and the report from items.jsonl with new metric settings (no model)."""
    from aligntax.vat.runner import VATConfig, rescore

    try:
        for d in dirs:
            res = rescore(d, VATConfig(bootstrap_reps=bootstrap, n_perm=permutations, eps=eps,
                                       nvat_null_reps=null_reps,
                                       coupling_method=coupling, include_diagonal=include_diagonal, seed=seed))
            typer.echo(f"{d}: gain {res['gain']['value']:+.4f}, VAT abs {res['vat']['absolute']}, "
                       f"nVAT {res['nvat']:.3f}")
    except AligntaxError as exc:
        _fail(exc)


@app.command("persona")
def persona_cmd(target: str = typer.Option(..., "--target", "-t", help="target value")) -> None:
    """Print the value-persona system prompt of a target, e.g. for `aligntax eval --system`."""
    from aligntax.vat.interventions import persona_text

    try:
        typer.echo(persona_text(target))
    except (AligntaxError, ValueError) as exc:
        _fail(exc)


@app.command("values")
def values_cmd(convention: str = typer.Option("wedge", help="circular distance convention: wedge | ten")) -> None:
    """Print the Schwartz value circle, groups, refined values and SVS items."""
    from aligntax.vat.schwartz import circle_text, distance_matrix

    try:
        typer.echo(circle_text(convention))
        typer.echo("Distance matrix (circle order):")
        typer.echo(str(distance_matrix(convention).astype(int)))
    except ValueError as exc:
        _fail(exc)


if __name__ == "__main__":  # pragma: no cover
    app()
