"""``aligntax lm-eval``: mounted by :mod:`aligntax.cli` when lm-eval (extra ``lmeval``) is installed.

Register with ``app.command("lm-eval")(lm_eval_command)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from aligntax.cli.options import (
    DeviceOpt,
    DtypeOpt,
    InterventionOpt,
    ModelOpt,
    check_dtype,
    check_out_folder,
    fail,
    steering_options,
    use_device,
)


@steering_options
def lm_eval_command(
    lm_eval_args: Annotated[
        list[str] | None,
        typer.Argument(
            help="lm-eval's own arguments, after '--': --tasks, --num_fewshot, --batch_size, --limit, "
            "--include_path, --apply_chat_template, --log_samples, ..."
        ),
    ] = None,
    model: ModelOpt = None,
    out: Annotated[Path, typer.Option(help="run folder")] = Path("runs/lm-eval"),
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    intervention: InterventionOpt = None,
    iv_args: dict | None = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare", help="also run unsteered and report both side by side (the capability tax)"
        ),
    ] = False,
) -> None:
    """Run lm-evaluation-harness on a model loaded by aligntax, optionally steered, into a run folder."""
    from rich.console import Console

    from aligntax.errors import AligntaxError, UsageError
    from aligntax.lmeval.run import LmEvalConfig, require_lm_eval, run_lm_eval

    console = Console(stderr=True)
    options = dict(iv_args or {})
    folder = options.pop("path", None)
    config = LmEvalConfig(
        model=model,
        dtype=dtype or "bf16",
        device=device,
        intervention=intervention,
        steer=folder if intervention == "els" else None,
        vectors=folder if intervention != "els" else None,
        options=options,
        compare=compare,
        lm_eval_args=list(lm_eval_args or []),
    )
    try:
        if not config.lm_eval_args:
            raise UsageError("give lm-eval's arguments after '--', e.g. -- --tasks arc_easy")
        check_out_folder(out)
        check_dtype(dtype)
        use_device(device)
        require_lm_eval()
        run_lm_eval(config, out)
    except AligntaxError as exc:
        fail(exc)
    print((out / "report.md").read_text(encoding="utf-8"))
    console.print(f"wrote {out}/results.json and report.md")
