"""The model card (``README.md`` with YAML front matter) of a steering bundle, and the measured rates it
carries, read from evaluation run folders (``results.json`` of ``aligntax eval``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from aligntax.errors import AligntaxError, DataError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(text: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_HUB_ID.match(text)) and not Path(text).expanduser().exists()


def hub_base_model(spec: str | None) -> str | None:
    """The Hub id a model spec names, if it names one (not an embedded model, a folder or a file)."""
    if not spec or spec.startswith("embedded:") or spec.endswith(".gguf"):
        return None
    return spec if is_hub_id(spec) else None


def front_matter(meta: dict) -> str:
    import yaml

    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True, width=100) + "---\n"


def read_front_matter(text: str) -> dict:
    """The YAML front matter of a model card (``{}`` without one)."""
    import yaml

    if not text.startswith("---\n"):
        return {}
    end = text.find("\n---\n", 4)
    if end < 0:
        raise DataError("The model card's front matter is not closed by '---'.")
    return yaml.safe_load(text[4:end]) or {}


# ---- measured rates ------------------------------------------------------------------------------------
@dataclass
class RunRates:
    """The rates one evaluation run measured, as ``results.json`` holds them (Wilson 95% intervals)."""

    run: str  # the run folder's name
    intervention: str  # "none" for an unsteered run
    data: list[str]
    judge: str
    max_new_tokens: int
    dtype: str
    overall: dict = field(default_factory=dict)  # {"benign": {...}, "harmful": {...}}
    datasets: dict = field(default_factory=dict)  # {dataset: {"benign"|"harmful": {...}}}

    def to_dict(self) -> dict:
        return {
            "run": self.run,
            "intervention": self.intervention,
            "data": self.data,
            "judge": self.judge,
            "max_new_tokens": self.max_new_tokens,
            "dtype": self.dtype,
            "overall": self.overall,
            "datasets": self.datasets,
        }


_KEEP = (
    "n",
    "compliance_rate",
    "ci95",
    "useful_compliance_rate",
    "useful_ci95",
    "degenerate_rate",
    "refusal_rate",
)


def _block(b: dict) -> dict:
    return {k: b[k] for k in _KEEP if k in b}


def read_run(run_dir: str | Path) -> tuple[RunRates, dict, dict]:
    """The rates of an evaluation run folder, its ``provenance.json`` and its ``intervention.json``."""
    run_dir = Path(run_dir)
    path = run_dir / "results.json"
    if not path.is_file():
        raise DataError(
            f"{run_dir} is not a finished evaluation run (no results.json); run `aligntax eval` first."
        )
    res = json.loads(path.read_text())
    cfg = res.get("config") or {}
    prov_path, iv_path = run_dir / "provenance.json", run_dir / "intervention.json"
    prov = json.loads(prov_path.read_text()) if prov_path.is_file() else {}
    iv = json.loads(iv_path.read_text()) if iv_path.is_file() else (res.get("intervention") or {})
    name = cfg.get("intervention") or ((iv or {}).get("name")) or "none"
    rates = RunRates(
        run=run_dir.name,
        intervention=name,
        data=list(cfg.get("data") or []),
        judge=str(cfg.get("judge")),
        max_new_tokens=int(cfg.get("max_new_tokens") or 0),
        dtype=str(cfg.get("dtype")),
        overall={k: _block(res[k]) for k in ("benign", "harmful") if isinstance(res.get(k), dict)},
        datasets={
            ds: {k: _block(v) for k, v in blocks.items()}
            for ds, blocks in (res.get("datasets") or {}).items()
        },
    )
    rates_fp = res.get("model_fingerprint") or prov.get("model_fingerprint") or {}
    return rates, {**prov, "model_fingerprint": rates_fp}, iv or {}


# ---- the card --------------------------------------------------------------------------------------------
def _pct(x) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}"


def _ci(ci) -> str:
    return "-" if not ci else f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def rates_table(runs: list[dict]) -> list[str]:
    lines = [
        "| run | intervention | dataset | prompts | n | rate (%) | 95% CI (Wilson) |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for r in runs:
        for ds, blocks in sorted(r["datasets"].items()):
            for label, b in sorted(blocks.items()):
                if label == "benign":
                    rate, ci, what = (
                        b.get("useful_compliance_rate", b.get("compliance_rate")),
                        b.get("useful_ci95", b.get("ci95")),
                        "benign: useful compliance",
                    )
                else:
                    rate, ci, what = b.get("refusal_rate"), b.get("ci95"), "harmful: refusal"
                lines.append(
                    f"| {r['run']} | {r['intervention']} | {ds} | {what} | {b.get('n')} | {_pct(rate)} | {_ci(ci)} |"
                )
    return lines


def render_card(manifest: dict) -> str:
    """``README.md`` of a bundle from its manifest (``bundle.json``)."""
    base = manifest["base_model"]
    method = manifest["method"]
    meta: dict = {"library_name": "aligntax"}
    if base.get("hub_id"):
        meta["base_model"] = base["hub_id"]
    meta["tags"] = ["aligntax", "steering", method]
    meta["aligntax"] = {
        "format": manifest["format"],
        "method": method,
        "base_model": base.get("spec"),
        "base_model_fingerprint": base.get("fingerprint"),
        "setting": manifest.get("setting"),
        "training_data": manifest.get("training_data"),
        "results": manifest.get("results") or [],
    }
    spec = base.get("spec") or "MODEL"
    model_arg = base.get("hub_id") or spec
    ref = manifest.get("repo_id") or "PATH_OR_REPO_ID"
    if method == "els":
        cli = f'aligntax bundle pull {ref} --out steer\naligntax generate "Where can I buy a can of coke?" --model {model_arg} --steer steer'
        cli += f"\naligntax eval --data xstest --model {model_arg} --steer steer --out runs/steered"
    elif method == "els-lora":
        scale = (manifest.get("setting") or {}).get("scale", 1.0)
        cli = (
            f"aligntax bundle pull {ref} --out steer\n"
            f"aligntax eval --data xstest --model {model_arg} --steer steer --lora-scale {scale:g} --out runs/steered\n"
            "# the adapter merged into the weights, for any server: a Hugging Face folder (vLLM, TGI) or one GGUF\n"
            f"aligntax export --intervention els-lora --steer steer --model {model_arg} --lora-scale {scale:g} --out merged\n"
            f"aligntax export --intervention els-lora --steer steer --model {model_arg} --lora-scale {scale:g} "
            "--format gguf --out merged.gguf   # llama.cpp, ollama"
        )
    else:
        cli = (
            f"aligntax bundle pull {ref} --out steer\n"
            f"aligntax eval --data xstest --model {model_arg} --intervention {method} --vectors steer --out runs/steered"
        )
    what = (
        "It is a LoRA adapter distilled from energy landscape steering (`aligntax els distill`), in peft's "
        "format: aligntax adds it by hooks (the model's weights are not changed), peft loads it, and "
        "`aligntax export` merges it into the weights for a plain inference server."
        if method == "els-lora"
        else "It steers the model's hidden states during generation; the model's weights are not changed."
    )
    body = [
        f"# {method} steering for {spec}",
        "",
        f"A steering bundle made with aligntax: `{method}` on `{spec}` (safetensors and JSON only). {what}",
        "",
        "## Load and steer",
        "",
        "```python",
        "import aligntax",
        f'lm = aligntax.load_model("{model_arg}")',
        f'iv = aligntax.load_intervention("{ref}", lm)  # a local folder or a Hub id',
        "with iv.apply(lm.model):  # then lm.model.generate(...) on chat-templated, left-padded prompts",
        "    ...",
        "```",
        "",
        "From the command line:",
        "",
        "```bash",
        cli,
        "```",
        "",
        "## Setting",
        "",
        "```json",
        json.dumps(manifest.get("setting"), indent=2, default=str),
        "```",
        "",
        "## Base model",
        "",
        f"`{spec}`"
        + (f" (Hub: `{base['hub_id']}`)" if base.get("hub_id") else "")
        + "; fingerprint (checked on load):",
        "",
        "```json",
        json.dumps(base.get("fingerprint"), indent=2),
        "```",
        "",
        "## Training data",
        "",
        "```json",
        json.dumps(manifest.get("training_data"), indent=2, default=str),
        "```",
        "",
    ]
    runs = manifest.get("results") or []
    body += ["## Measured rates", ""]
    if runs:
        body += [
            "Rates measured by the evaluation runs named below (`aligntax eval`, greedy decoding; benign: share of "
            "useful compliant answers, harmful: share of refusals; 95% Wilson intervals):",
            "",
        ]
        body += rates_table(runs)
        body += [""] + [
            f"- `{r['run']}`: {r['intervention']}, data {', '.join(r['data'])}, judge {r['judge']}, "
            f"{r['max_new_tokens']} new tokens, {r['dtype']}"
            for r in runs
        ]
    else:
        body += ["No evaluation run was given when this bundle was saved, so it carries no measured rates."]
    return front_matter(meta) + "\n" + "\n".join(body) + "\n"


def check_run_fingerprint(rates_fp: dict, bundle_fp: dict, run: str) -> None:
    from aligntax.artefacts import check_fingerprint

    if not rates_fp:
        raise AligntaxError(
            f"Run {run} records no model fingerprint, so its rates cannot be tied to this bundle's model."
        )
    check_fingerprint(rates_fp, bundle_fp, f"evaluation run {run}")
