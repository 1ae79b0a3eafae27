"""The audit's report card: ``report.md`` and one self-contained ``report.html`` (inline CSS and SVG, no
file or network access) with the tax chart, from ``audit.json``'s content."""

from __future__ import annotations

import html
import math
from pathlib import Path

from aligntax.audit.stats import DOWN, EITHER, FAIL, INCONCLUSIVE, PASS, UP
from aligntax.runfolder import write_text_atomic

COLOURS = {PASS: "#2e7d32", FAIL: "#c62828", INCONCLUSIVE: "#e69500"}
_UNIT = {"pt": " pt", "nats": " nats", "Likert": ""}


def _num(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}"


def _p(p) -> str:
    if p is None:
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def fmt_level(row: dict, key: str) -> str:
    """The baseline or candidate value of a row in its unit."""
    v = row.get(key)
    if v is None:
        return "-"
    if row["unit"] == "pt":
        return f"{v:.1f}%"
    if row["unit"] == "nats":
        return f"{v:.3f} (ppl {math.exp(v):.2f})"
    return f"{v:+.3f}"


def fmt_change(row: dict) -> str:
    """The change with its 95% interval, in the row's unit (and the items turned, for a rate)."""
    c, ci = row.get("change"), row.get("ci95") or [None, None]
    if c is None:
        return "-"
    d = 1 if row["unit"] == "pt" else 3
    text = f"{c:+.{d}f}{_UNIT[row['unit']]}"
    if ci[0] is not None and ci[1] is not None:
        text += f" [{ci[0]:+.{d}f}, {ci[1]:+.{d}f}]"
    if "gained" in row:
        text += f" ({row['gained']} up, {row['lost']} down)"
    return text


def fmt_amount(row: dict, x) -> str:
    if x is None:
        return "none at this n" if row["unit"] == "pt" else "-"
    d = 1 if row["unit"] == "pt" else 3
    return f"{x:.{d}f}{_UNIT[row['unit']]}"


def verdict_text(row: dict) -> str:
    """The row's verdict; a pass marked ``*`` when a loss of the tolerated size could have gone unseen."""
    return row["verdict"] + ("*" if row["verdict"] == PASS and not row.get("powered", True) else "")


def _direction_text(row: dict) -> str:
    return {UP: "higher is better", DOWN: "lower is better", EITHER: "any move is a cost"}[row["direction"]]


def _header(audit: dict) -> list[str]:
    pol = audit["policy"]
    return [
        f"# Audit: {audit['candidate']['description']} against {audit['model']}",
        "",
        f"**Verdict: {audit['verdict'].upper()}** (exit status {audit['exit_status']}); profile "
        f"{audit['profile']}; {audit['comparisons']} comparisons, Holm-corrected; policy {pol['source']} "
        f"(alpha {pol['alpha']:g}, power {pol['power']:g} for the detectable change, an inconclusive "
        f"audit exits as {pol['inconclusive']}).",
        "",
    ]


def markdown(audit: dict) -> str:
    """``report.md``: the verdict, one table per panel, the VAT metrics with a target, how to read it."""
    lines = _header(audit)
    lines += ["| panel | verdict | rows |", "|---|---|---:|"]
    for name, p in audit["panels"].items():
        lines.append(f"| {name} | {p['verdict']} | {p['rows']} |")
    for name, p in audit["panels"].items():
        lines += ["", f"## {name}: {p['verdict']}", ""]
        if p.get("about"):
            lines += [p["about"], ""]
        lines += [
            "| row | metric | n | baseline | candidate | change [95% CI] | p (Holm) | detectable | tolerated | verdict |",
            "|---|---|---:|---:|---:|---|---|---:|---:|---|",
        ]
        for r in audit["rows"]:
            if r["panel"] != name:
                continue
            lines.append(
                f"| {r['row']} | {r['metric']} ({_direction_text(r)}) | {r['n']} | {fmt_level(r, 'baseline')} | "
                f"{fmt_level(r, 'candidate')} | {fmt_change(r)} | {_p(r.get('p'))} ({_p(r.get('p_adj'))}) | "
                f"{fmt_amount(r, r.get('detectable'))} | {fmt_amount(r, r.get('max_loss'))} | {verdict_text(r)} |"
            )
        if name == "values" and audit.get("vat"):
            lines += ["", *vat_lines(audit["vat"])]
    lines += ["", *_reading()]
    return "\n".join(lines) + "\n"


def vat_lines(vat: dict) -> list[str]:
    g, v, sp = vat["gain"], vat["vat"], vat["specificity"]

    def ci(x):
        return f" [{x[0]:+.3f}, {x[1]:+.3f}]" if x else ""

    lines = [
        f"Target {vat['target']} (the VAT metrics of `aligntax vat run`): gain {_num(g.get('value'))}{ci(g.get('ci95'))}; "
        f"specificity {_num(sp.get('value'))}{ci(sp.get('ci95'))} (p = {_p(sp.get('p_value_scene'))}): {sp.get('interpretation')}.",
    ]
    if v.get("signed") is None:
        lines.append(f"VAT: {v.get('reason') or 'undefined'}.")
    else:
        lines.append(
            f"VAT signed {_num(v['signed'])}{ci(v.get('ci95_signed'))}, absolute {_num(v['absolute'])}"
            f"{ci(v.get('ci95_absolute'))}; nVAT {_num(vat.get('nvat'))}."
        )
    return lines


def _reading() -> list[str]:
    return [
        "How to read it: `change` is the candidate minus the baseline over the same items (percentage "
        "points for rates; nats per token of mean log-perplexity under the baseline model for fluency; "
        "Likert points of a value's polarity-signed expression for values). `p` is the row's paired test "
        "(exact McNemar for rates, sign-flip permutation for scores, scene-level sign-flip for values), "
        "`Holm` the p adjusted over every row of the audit. `detectable` is the smallest loss the row "
        "would find with the policy's power at the strictest Holm level (alpha / comparisons): a pass "
        "says nothing about losses smaller than that. A row fails when the candidate is worse by more "
        "than `tolerated`, significantly after Holm; it passes when its interval rules out a loss beyond "
        "`tolerated`; otherwise it is inconclusive. A pass marked * is one whose detectable change exceeds "
        "`tolerated`: a loss of the tolerated size could have gone unseen at this n. (docs/audit.md)",
    ]


# ---------------------------------------------------------------- HTML
def _benefit(row: dict, x: float) -> float:
    """A change as benefit (right is better; for either-way rows, the change itself)."""
    return -x if row["direction"] == DOWN else x


def chart_svg(rows: list[dict], width: int = 820) -> str:
    """The tax chart: per row (grouped by panel) its change and 95% interval in units of its tolerated
    loss, right = better, a dot coloured by the row's verdict; dashed lines at the tolerated loss."""
    left, right_text, lim = 250, 150, 3.0
    x0, x1 = left, width - right_text
    row_h, head_h, top = 20, 24, 34

    def sx(t: float) -> float:
        t = max(-lim, min(lim, t))
        return x0 + (t + lim) / (2 * lim) * (x1 - x0)

    parts: list[str] = []
    y = top
    panels: list[str] = list(dict.fromkeys(r["panel"] for r in rows))
    for panel in panels:
        parts.append(f'<text x="8" y="{y + 16}" class="panel">{html.escape(panel)}</text>')
        y += head_h
        for r in [r for r in rows if r["panel"] == panel]:
            tol = r.get("max_loss") or 0.0
            scale = tol if tol > 0 else (r.get("detectable") or 1.0)
            c, ci = r.get("change"), r.get("ci95") or [None, None]
            colour = COLOURS.get(r["verdict"], "#555")
            cy = y + row_h / 2
            parts.append(f'<text x="16" y="{cy + 4}" class="lab">{html.escape(r["row"])}</text>')
            ticks = [-1.0] + ([1.0] if r["direction"] == EITHER else [])
            for t in ticks:
                parts.append(
                    f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{y + 2}" y2="{y + row_h - 2}" class="tol"/>'
                )
            if c is not None:
                if ci[0] is not None and ci[1] is not None:
                    a, b = sorted((_benefit(r, ci[0]) / scale, _benefit(r, ci[1]) / scale))
                    parts.append(
                        f'<line x1="{sx(a):.1f}" x2="{sx(b):.1f}" y1="{cy}" y2="{cy}" stroke="{colour}" '
                        'stroke-width="2"/>'
                    )
                t = _benefit(r, c) / scale
                title = html.escape(f"{r['panel']} / {r['row']}: {fmt_change(r)}; {r['verdict']}")
                parts.append(
                    f'<circle cx="{sx(t):.1f}" cy="{cy}" r="5" fill="{colour}" data-verdict="{r["verdict"]}">'
                    f"<title>{title}</title></circle>"
                )
                parts.append(
                    f'<text x="{x1 + 8}" y="{cy + 4}" class="val">{html.escape(fmt_change(r).split(" [")[0])}</text>'
                )
            y += row_h
    height = y + 34
    axis = [f'<line x1="{sx(0):.1f}" x2="{sx(0):.1f}" y1="{top - 6}" y2="{y}" class="zero"/>']
    for t in (-3, -2, -1, 0, 1, 2, 3):
        axis.append(f'<text x="{sx(t):.1f}" y="{y + 16}" class="tick" text-anchor="middle">{t:+d}</text>')
    axis.append(
        f'<text x="{(x0 + x1) / 2:.1f}" y="{y + 30}" class="tick" text-anchor="middle">change / tolerated loss '
        "(right: better; dashed: the tolerated loss; clipped at 3)</text>"
    )
    axis.append(f'<text x="{x0}" y="{top - 12}" class="tick">worse</text>')
    axis.append(f'<text x="{x1}" y="{top - 12}" class="tick" text-anchor="end">better</text>')
    return (
        f'<svg class="tax-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="tax chart">'
        + "".join(axis + parts)
        + "</svg>"
    )


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px}
.verdict{display:inline-block;padding:4px 10px;border-radius:4px;color:#fff;font-weight:600}
table.rows{border-collapse:collapse;font-size:13px;margin-top:8px}
table.rows th,table.rows td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
table.rows td.num{text-align:right;white-space:nowrap}
td.v-pass{color:#2e7d32;font-weight:600} td.v-fail{color:#c62828;font-weight:600}
td.v-inconclusive{color:#b07000;font-weight:600}
svg.tax-chart text{font-size:12px;fill:#222} svg.tax-chart text.panel{font-weight:600;font-size:13px}
svg.tax-chart .tol{stroke:#c62828;stroke-dasharray:3 2} svg.tax-chart .zero{stroke:#999}
svg.tax-chart text.tick{fill:#666;font-size:11px}
p.note{font-size:13px;color:#444;max-width:900px}
"""

# records the laid-out size of the chart and table on the page (read by the report's browser test)
_SCRIPT = """
window.addEventListener("load", function () {
  var svg = document.querySelector("svg.tax-chart");
  var box = svg ? svg.getBoundingClientRect() : null;
  var shown = Array.prototype.filter.call(document.querySelectorAll("table.rows tbody tr"),
    function (tr) { return tr.offsetHeight > 0; });
  document.body.setAttribute("data-layout", JSON.stringify({
    chart: box ? [Math.round(box.width), Math.round(box.height)] : null,
    marks: document.querySelectorAll("svg.tax-chart circle").length,
    rows: shown.length
  }));
});
"""


def html_report(audit: dict) -> str:
    """``report.html``: one self-contained page (inline style, SVG and a script that only measures the
    page), with the verdict, the tax chart and every row."""
    e = html.escape
    pol = audit["policy"]
    colour = COLOURS.get(audit["verdict"], "#555")
    head = (
        f"<h1>Audit: {e(audit['candidate']['description'])} against {e(audit['model'])}</h1>"
        f'<p><span class="verdict" style="background:{colour}">{e(audit["verdict"].upper())}</span> '
        f"exit status {audit['exit_status']}; profile {e(audit['profile'])}; {audit['comparisons']} comparisons, "
        f"Holm-corrected; policy {e(pol['source'])} (alpha {pol['alpha']:g}, power {pol['power']:g})</p>"
    )
    body = [head, "<h2>Tax chart</h2>", chart_svg(audit["rows"]), "<h2>Rows</h2>"]
    body.append(
        '<table class="rows"><thead><tr><th>panel</th><th>row</th><th>metric</th><th>n</th><th>baseline</th>'
        "<th>candidate</th><th>change [95% CI]</th><th>p</th><th>p (Holm)</th><th>detectable</th>"
        "<th>tolerated</th><th>verdict</th></tr></thead><tbody>"
    )
    for r in audit["rows"]:
        body.append(
            f"<tr><td>{e(r['panel'])}</td><td>{e(r['row'])}</td><td>{e(r['metric'])} ({e(_direction_text(r))})</td>"
            f'<td class="num">{r["n"]}</td><td class="num">{e(fmt_level(r, "baseline"))}</td>'
            f'<td class="num">{e(fmt_level(r, "candidate"))}</td><td>{e(fmt_change(r))}</td>'
            f'<td class="num">{_p(r.get("p"))}</td><td class="num">{_p(r.get("p_adj"))}</td>'
            f'<td class="num">{e(fmt_amount(r, r.get("detectable")))}</td>'
            f'<td class="num">{e(fmt_amount(r, r.get("max_loss")))}</td>'
            f'<td class="v-{e(r["verdict"])}" title="{e(r.get("reason") or "")}">{e(verdict_text(r))}</td></tr>'
        )
    body.append("</tbody></table>")
    if audit.get("vat"):
        body.append("<h2>Values: the target's VAT metrics</h2>")
        body += [f'<p class="note">{e(line)}</p>' for line in vat_lines(audit["vat"])]
    body += [f'<p class="note">{e(line)}</p>' for line in _reading()]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>aligntax audit: '
        f"{e(audit['verdict'])}</title><style>{_CSS}</style></head><body>"
        + "".join(body)
        + f"<script>{_SCRIPT}</script></body></html>\n"
    )


def write_reports(audit: dict, out: str | Path) -> tuple[Path, Path]:
    out = Path(out)
    md, page = out / "report.md", out / "report.html"
    write_text_atomic(md, markdown(audit))
    write_text_atomic(page, html_report(audit))
    return md, page
