"""``aligntax audit``: the alignment-tax report card of a change to a model, and a release gate.

Register with ``app.command("audit")(audit_command)``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from aligntax.cli.options import InterventionOpt, check_intervention, check_judge, check_out_folder, fail
from aligntax.cli.options import steering_options as _steering_options
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError, UsageError
from aligntax.models.spec import DEFAULT_MODEL


def _methods() -> dict:
    """The methods an audit takes: every steering method, and ``adapter`` (a PEFT LoRA adapter)."""
    from aligntax.interventions.options import METHODS
    from aligntax.vat.methods import REGISTRY

    return {**METHODS, "adapter": REGISTRY["adapter"]}


def _demo_folder(fn):
    """``--steer DIR`` naming a demo folder (``aligntax demo --out DIR``) stands for the setting the demo
    selected, and the audit records the folder (``demo``). A folder's ``selection.json`` is applied by
    the steering options themselves; a demo folder written before it recorded one is taken out of them,
    and the command reads the setting its steered evaluation ran."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from aligntax.audit.candidate import is_demo_folder
        from aligntax.interventions.selection import is_selection_dir

        steer = kwargs.get("iv_steer")
        if is_demo_folder(steer):
            kwargs["demo"] = str(steer)
            if not is_selection_dir(steer):
                kwargs["iv_steer"] = None
        return fn(*args, **kwargs)

    return wrapper


def _list(text: str | None) -> list[str] | None:
    return None if not text else [x.strip() for x in text.split(",") if x.strip()] or None


@_demo_folder
@_steering_options(methods=_methods())
def audit_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="the audit's run folder (rerun to resume)")],
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="the baseline model spec", show_default=DEFAULT_MODEL)
    ] = None,
    candidate_model: Annotated[
        str | None,
        typer.Option(help="the candidate: another checkpoint (a fine-tune, a merged export) against --model"),
    ] = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            help="the Schwartz value the change aims at: the values panel adds the VAT metrics of `vat run`",
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option("--quick/--full", help="quick: each row's stated stratified subset; full: every item"),
    ] = False,
    panels: Annotated[
        str | None,
        typer.Option(help="only these panels, comma-separated (default: all; see --panel-file)"),
    ] = None,
    panel_file: Annotated[
        Path | None, typer.Option(help="a YAML file of panels added to the declared ones (docs/audit.md)")
    ] = None,
    policy: Annotated[
        Path | None,
        typer.Option(
            help="a YAML policy: tolerated loss and significance level per panel (default: shipped)"
        ),
    ] = None,
    judge_name: Annotated[str, typer.Option("--judge", help="refusal judge")] = "classifier",
    max_new_tokens: Annotated[
        int | None,
        typer.Option(help="tokens generated per prompt at most", show_default=str(DEFAULT_MAX_NEW_TOKENS)),
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="prompts per batch", show_default="96")] = None,
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32", show_default="bf16")] = None,
    seed: Annotated[int, typer.Option(help="the subsets' draw and the bootstrap")] = 0,
    baseline_from: Annotated[
        Path | None,
        typer.Option(
            help="an earlier audit of the same model and settings: its baseline runs are copied, "
            "only the candidate is generated"
        ),
    ] = None,
    rescore: Annotated[
        bool,
        typer.Option(
            "--rescore", help="recompute the rows and verdict of the finished audit in --out (no model)"
        ),
    ] = False,
    demo: Annotated[str | None, typer.Option(hidden=True)] = None,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="show progress", show_default="progress")
    ] = None,
) -> None:
    """Audit a change to a model: over-refusal, harmful refusal, jailbreak, capability and value panels on
    the baseline and the candidate, paired tests with the Holm correction, the detectable change of each
    row, and a policy's verdict. Exit status 0 on pass, 1 on fail (2: bad input). The candidate is
    --candidate-model SPEC, or an intervention on --model (--steer DIR: an ELS, els-lora or demo folder;
    --intervention NAME with its options; --adapter DIR)."""
    from aligntax.audit import AuditConfig, plan_audit, run_audit
    from aligntax.audit import rescore as rescore_audit
    from aligntax.audit.report import markdown

    iv_args = dict(iv_args or {})
    try:
        check_out_folder(out)
        if rescore:
            audit = rescore_audit(out, None if policy is None else str(policy))
        else:
            if demo is not None and intervention is None:  # a demo folder without selection.json
                from aligntax.audit.candidate import demo_selection

                if iv_args:
                    raise UsageError(
                        f"--steer {demo} is a demo folder: it takes the demo's selection as it is."
                    )
                sel = demo_selection(demo)
                intervention, iv_args = sel.intervention, sel.args
                check_intervention(intervention, iv_args, model, methods=_methods())
            if intervention is None and iv_args.get("adapter") is not None:
                intervention = "adapter"
            check_judge(judge_name)
            given = dict(model=model, max_new_tokens=max_new_tokens, batch_size=batch_size, dtype=dtype)
            given["progress"] = progress
            cfg = AuditConfig(
                out=str(out),
                candidate_model=candidate_model,
                intervention=intervention,
                intervention_args=iv_args,
                demo=demo,
                target=target,
                profile="quick" if quick else "full",
                panels=_list(panels),
                panel_file=None if panel_file is None else str(panel_file),
                policy=None if policy is None else str(policy),
                judge=judge_name,
                seed=seed,
                baseline_from=None if baseline_from is None else str(baseline_from),
                **{k: v for k, v in given.items() if v is not None},  # unset: AuditConfig's defaults
            )
            plan = plan_audit(cfg)  # every input checked; no model loaded yet
            audit = run_audit(cfg, plan=plan)
    except AligntaxError as exc:
        fail(exc)
    typer.echo(markdown(audit))
    typer.echo(
        f"verdict: {audit['verdict']} (exit status {audit['exit_status']}); {out / 'report.html'}", err=True
    )
    raise typer.Exit(audit["exit_status"])
