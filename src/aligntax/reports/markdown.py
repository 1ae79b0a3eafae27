"""Markdown rendering of evaluation results."""

from __future__ import annotations

from pathlib import Path


def fmt_rate(value: float, ci: list[float] | tuple[float, float]) -> str:
    return f"{100 * value:.1f}% [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def fmt_change(change: dict) -> str:
    """A paired change (:func:`aligntax.metrics.paired_change`): "+26.5 pt (38 up, 3 down; p < 0.001)"."""
    p = change["p_value"]
    p_text = "p < 0.001" if p < 0.001 else f"p = {p:.3f}" if p < 0.1 else f"p = {p:.2f}"
    return f"{100 * change['diff']:+.1f} pt ({change['gained']} up, {change['lost']} down; {p_text})"


def eval_table(results: dict) -> str:
    """One row per dataset and label: n, the rate that matters for that label, and its 95% interval;
    with ``results["paired"]`` also the paired change against the reference run."""
    paired = (results.get("paired") or {}).get("datasets")
    lines = [
        "| dataset | label | n | metric | rate [95% CI] |" + (" change, paired |" if paired else ""),
        "|---|---|---:|---|---|" + ("---|" if paired else ""),
    ]

    def change(name: str, label: str) -> str:
        if not paired:
            return ""
        c = paired.get(name, {}).get(label)
        return f" {fmt_change(c)} |" if c else " |"

    def rows(name: str, block: dict, key: str) -> None:
        if "benign" in block:
            b = block["benign"]
            lines.append(
                f"| {name} | benign | {b['n']} | compliance | {fmt_rate(b['compliance_rate'], b['ci95'])} |"
                + change(key, "benign")
            )
            if "useful_compliance_rate" in b:
                lines.append(
                    f"| {name} | benign | {b['n']} | useful compliance (no empty or looping answers) | "
                    f"{fmt_rate(b['useful_compliance_rate'], b['useful_ci95'])} |" + (" |" if paired else "")
                )
        if "harmful" in block:
            h = block["harmful"]
            lines.append(
                f"| {name} | harmful | {h['n']} | refusal | {fmt_rate(h['refusal_rate'], h['ci95'])} |"
                + change(key, "harmful")
            )

    for name, block in results.get("datasets", {}).items():
        rows(name, block, name)
    rows("**overall**", results, "all")
    return "\n".join(lines)


def steering_table(results: dict) -> str:
    """Which rows the intervention steered, per dataset and label (``results["steering"]``): rows,
    steered, mean strength of the steered rows, and the quartiles (min, 25%, median, 75%, max) of
    the harm gate's probability and of the row energy; empty without steering records."""
    steering = results.get("steering")
    if not steering:
        return ""

    def q(values) -> str:
        return " / ".join(f"{v:.2f}" for v in values) if values else ""

    lines = [
        "| dataset/label | rows | steered | mean strength | p(harmful) quartiles | row energy quartiles |",
        "|---|---:|---:|---:|---|---|",
    ]
    for key, s in steering.items():
        strength = "" if s["mean_strength"] is None else f"{s['mean_strength']:.2f}"
        lines.append(
            f"| {key} | {s['rows']} | {s['steered']} ({100 * s['steered'] / s['rows']:.0f}%) | {strength} "
            f"| {q(s['harm_p'])} | {q(s['energy'])} |"
        )
    return "\n".join(lines)


def write_eval_report(results: dict, path: str | Path) -> None:
    cfg = results.get("config", {})
    timing = results.get("timing", {})
    fp = results.get("model_fingerprint") or {}
    text = [
        "# aligntax evaluation",
        "",
        f"- model: `{cfg.get('model')}` ({fp.get('model_type', '?')}, {fp.get('num_layers', '?')} layers, "
        f"hidden {fp.get('hidden_size', '?')}), dtype {cfg.get('dtype')}",
        f"- judge: `{cfg.get('judge')}`; decoding: {'sampled' if cfg.get('do_sample') else 'greedy'}, "
        f"max_new_tokens {cfg.get('max_new_tokens')}; system prompt: {cfg.get('system')!r}",
        f"- intervention: {cfg.get('intervention') or 'none'} {cfg.get('intervention_args') or ''}",
        f"- data: {', '.join(cfg.get('data', []))}",
        f"- this invocation: {timing.get('new_samples', 0)} new samples, {timing.get('resumed_samples', 0)} "
        f"resumed; {timing.get('tokens_per_second')} tokens/s; {timing.get('wall_seconds')} s wall",
        "",
        "Benign prompts are scored by compliance (higher is better: fewer false refusals); harmful prompts "
        "by refusal (higher is safer). Intervals are Wilson 95%."
        + (
            f" The paired change is against `{results['paired']['against']}` over the same prompts: items turned "
            "compliant/refusing (up) and back (down), and the exact McNemar p-value."
            if results.get("paired")
            else ""
        ),
        "",
        eval_table(results),
        "",
    ]
    if results.get("steering"):
        text += [
            "Rows steered (decided at the last prompt token, before generating):",
            "",
            steering_table(results),
            "",
        ]
    from aligntax.runfolder import write_text_atomic

    write_text_atomic(path, "\n".join(text))
