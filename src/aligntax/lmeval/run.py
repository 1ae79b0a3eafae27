"""``aligntax lm-eval``: an lm-evaluation-harness run of a model loaded by aligntax, optionally steered,
written into a run folder.

The arguments after ``--`` are lm-eval's own (``--tasks``, ``--num_fewshot``, ``--batch_size``,
``--limit``, ``--include_path``, ``--apply_chat_template``, ``--log_samples``, ...), parsed by lm-eval's
parser. The run folder gets:

- ``results.json``: the settings (model spec, dtype, intervention config, lm-eval arguments and
  version), the model fingerprint, and per variant (``unsteered``, ``steered``) each task's metrics;
- ``lm_eval_<variant>.json``: lm-eval's whole results object for that variant;
- ``samples_<variant>_<task>.jsonl`` with ``--log_samples``;
- ``report.md``: the scores, side by side with ``--compare`` (the capability tax: steered minus
  unsteered).

With ``--compare`` the unsteered baseline is scored through the same code path as the steered run
(see :mod:`aligntax.lmeval.model`), so the difference is the intervention's alone.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aligntax.errors import AligntaxError
from aligntax.runs.fsio import run_lock, write_json_atomic, write_text_atomic

# lm-eval options aligntax sets itself (the model, and where results go)
_OWNED = {"--model": "--model", "--model_args": "--model", "--output_path": "--out", "-o": "--out"}


@dataclass
class LmEvalConfig:
    model: str
    dtype: str = "bf16"
    device: str | None = None
    intervention: str | None = None
    steer: str | None = None
    vectors: str | None = None
    options: dict = field(default_factory=dict)  # intervention options (eta, layers, ...)
    compare: bool = False
    lm_eval_args: list[str] = field(default_factory=list)


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise AligntaxError(
            "lm-evaluation-harness is not installed: pip install 'aligntax[lmeval]' "
            f"(or pip install lm_eval) ({exc})."
        ) from None


def parse_lm_eval_args(args: list[str]):
    """lm-eval's :class:`EvaluatorConfig` from its command-line arguments (``--model`` and
    ``--output_path`` are aligntax's: refused)."""
    require_lm_eval()
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    for a in args:
        flag = a.split("=", 1)[0]
        if flag in _OWNED:
            raise AligntaxError(
                f"lm-eval's {flag} is set by aligntax lm-eval: use its {_OWNED[flag]} instead."
            )
    parser = HarnessCLI()._parser
    try:
        namespace = parser.parse_args(["run", "--model", "aligntax", *args])
    except SystemExit as exc:
        raise AligntaxError(f"lm-eval could not parse its arguments {args} (see its message above).") from exc
    namespace.output_path = None
    log_samples = bool(getattr(namespace, "log_samples", False))
    namespace.log_samples = False  # validated without an output path; aligntax writes the samples
    try:
        cfg = EvaluatorConfig.from_cli(namespace)
    except (ValueError, TypeError) as exc:
        raise AligntaxError(f"lm-eval arguments: {exc}") from exc
    cfg.log_samples = log_samples
    return cfg


def _hflm_kwargs(cfg) -> dict:
    """``HFLM`` options from lm-eval's --model_args-free configuration: batch size and device."""
    kwargs = {"batch_size": cfg.batch_size if cfg.batch_size is not None else 1}
    if cfg.max_batch_size is not None:
        kwargs["max_batch_size"] = cfg.max_batch_size
    return kwargs


def _evaluate(model, cfg, task_manager) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=model,
        tasks=cfg.tasks,
        num_fewshot=cfg.num_fewshot,
        use_cache=cfg.use_cache,
        limit=cfg.limit,
        samples=cfg.samples,
        check_integrity=cfg.check_integrity,
        write_out=cfg.write_out,
        log_samples=cfg.log_samples,
        system_instruction=cfg.system_instruction,
        apply_chat_template=cfg.apply_chat_template,
        fewshot_as_multiturn=cfg.fewshot_as_multiturn,
        gen_kwargs=cfg.gen_kwargs,
        task_manager=task_manager,
        verbosity=cfg.verbosity,
        predict_only=cfg.predict_only,
        random_seed=cfg.seed[0] if cfg.seed else None,
        numpy_random_seed=cfg.seed[1] if cfg.seed else None,
        torch_random_seed=cfg.seed[2] if cfg.seed else None,
        fewshot_random_seed=cfg.seed[3] if cfg.seed else None,
        confirm_run_unsafe_code=cfg.confirm_run_unsafe_code,
        metadata=cfg.metadata,
    )


def scores(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm-eval's results (numbers only, stderr kept as ``metric_stderr``)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        row = {}
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or key == "sample_len":
                continue
            value = float(value)
            row[key.replace(",none", "")] = value if math.isfinite(value) else None
        out[task] = row
    return out


def _num(x: float, sign: str = "") -> str:
    return f"{x:{sign}.4g}" if abs(x) >= 1e4 else f"{x:{sign}.4f}"


def _report(config: LmEvalConfig, result: dict) -> str:
    variants = list(result["scores"])
    lines = [f"# lm-eval: {config.model}", ""]
    iv = result.get("intervention")
    lines += [f"Intervention: `{json.dumps(iv)}`" if iv else "Intervention: none (unsteered)", ""]
    lines += [f"lm-eval {result['lm_eval_version']} arguments: `{' '.join(config.lm_eval_args)}`", ""]
    head = ["task", "metric", *variants] + (["steered - unsteered"] if len(variants) == 2 else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = result["scores"][variants[0]]
    for task in sorted(first):
        for metric in sorted(k for k in first[task] if not k.endswith("_stderr")):
            vals = [result["scores"][v].get(task, {}).get(metric) for v in variants]
            cells = ["-" if x is None else _num(x) for x in vals]
            if len(vals) == 2:
                cells.append("-" if None in vals else _num(vals[1] - vals[0], "+"))
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    lines += ["", f"Time: {result['seconds']:.1f} s"]
    return "\n".join(lines) + "\n"


def run_lm_eval(config: LmEvalConfig, out: str | Path, lm=None) -> dict:
    """Run lm-eval as ``config`` says and write the run folder ``out``; returns ``results.json``'s
    content. ``lm`` (a loaded model) skips loading ``config.model``."""
    require_lm_eval()
    import lm_eval
    from lm_eval.utils import handle_non_serializable

    from aligntax.interventions.base import NoIntervention
    from aligntax.lmeval.model import AligntaxLM, build_intervention
    from aligntax.models.loader import load_model

    cfg = parse_lm_eval_args(config.lm_eval_args)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with run_lock(out):
        task_manager = cfg.process_tasks(cfg.metadata)
        if lm is None:
            lm = load_model(config.model, dtype=config.dtype, device=config.device)
        iv = build_intervention(lm, config.intervention, config.steer, config.vectors, **config.options)
        if config.compare and iv is None:
            raise AligntaxError(
                "--compare needs an intervention (--steer, or --intervention with --vectors)."
            )
        variants = {"steered": iv} if iv is not None else {"unsteered": None}
        if config.compare:
            variants = {"unsteered": NoIntervention(), "steered": iv}
        all_scores, steered_forwards = {}, {}
        for variant, intervention in variants.items():
            model = AligntaxLM(lm=lm, intervention=intervention, **_hflm_kwargs(cfg))
            results = _evaluate(model, cfg, task_manager)
            if results is None:  # a non-zero rank in a distributed run
                continue
            samples = results.pop("samples", None)
            write_json_atomic(out / f"lm_eval_{variant}.json", results, default=handle_non_serializable)
            for task, rows in (samples or {}).items():
                text = "".join(
                    json.dumps(r, default=handle_non_serializable, ensure_ascii=False) + "\n" for r in rows
                )
                write_text_atomic(out / f"samples_{variant}_{task}.jsonl", text)
            all_scores[variant] = scores(results)
            steered_forwards[variant] = model.steered_forwards
        result = {
            "kind": "lm-eval",
            "config": asdict(config),
            "lm_eval_version": lm_eval.__version__,
            "lm_eval": {
                "tasks": cfg.tasks,
                "num_fewshot": cfg.num_fewshot,
                "limit": cfg.limit,
                "batch_size": cfg.batch_size,
                "apply_chat_template": cfg.apply_chat_template,
            },
            "model_fingerprint": lm.fingerprint,
            "intervention": None if iv is None else iv.config(),
            "scores": all_scores,
            "steered_forwards": steered_forwards,
            "seconds": time.perf_counter() - start,
        }
        if config.compare and len(all_scores) == 2:
            result["tax"] = {
                task: {
                    m: (
                        None
                        if v is None or all_scores["unsteered"][task].get(m) is None
                        else v - all_scores["unsteered"][task][m]
                    )
                    for m, v in metrics.items()
                    if not m.endswith("_stderr")
                }
                for task, metrics in all_scores["steered"].items()
            }
        write_json_atomic(out / "results.json", result, default=str)
        write_text_atomic(out / "report.md", _report(config, result))
    return result
