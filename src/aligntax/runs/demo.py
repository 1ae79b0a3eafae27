"""``aligntax demo``: the whole over-refusal story on one model.

Baseline evaluation on held-out test sets, ELS training on train splits, a strength sweep on
validation splits, steered evaluation on the same test sets, and one report with the before/after
table and the Pareto plot. Every stage resumes from its folder.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aligntax.backends import LABELS
from aligntax.backends.hf import HFSource
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError, UsageError
from aligntax.generation.source import SourceSpec
from aligntax.interventions.els import DEFAULT_SETTINGS
from aligntax.interventions.selection import SELECTION, selection_record
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.reports.markdown import fmt_change, fmt_rate
from aligntax.runfolder import check_settings, run_lock, write_json_atomic, write_text_atomic
from aligntax.runs.els_score import sweep_iv_args
from aligntax.runs.els_sweep import CHOOSABLE, SweepConfig, run_sweep, sweep_settings
from aligntax.runs.els_train import ELSTrainConfig, prompt_domain, prompt_surprisal_domain, train_els
from aligntax.runs.eval import EvalConfig, run_eval
from aligntax.runs.sources import check_source, generation_source

HF = HFSource.backend

TEST_SETS = [
    "orbench-hard-test",
    "xstest-safe",
    "oktest",
    "xstest-unsafe",
    "jailbreakbench",
    "harmbench-test",
    # the JailbreakBench attack prompts (PAIR, JBC, random search, GCG, DSN): each attack and all together
    "jbb-attacks",
]
# the test-set Pareto plot's axes: mean compliance over the benign sets, mean refusal over the harmful ones
# (``source/label`` blocks of a results file)
PARETO_BENIGN = ["orbench-hard-test/benign", "xstest/benign", "oktest/benign"]
PARETO_HARMFUL = ["xstest/harmful", "jailbreakbench/harmful", "harmbench-test/harmful"]


@dataclass
class DemoConfig:
    """Settings of ``aligntax demo``. The defaults are the quick profile (the headline in a coffee break:
    fewer training prompts, successive halving in the sweep, the strongest baseline on the test sets);
    :func:`demo_config` with ``full=True`` gives the complete evaluation (:data:`FULL_PROFILE`)."""

    out: str = "runs/demo"
    full: bool = False  # which profile these settings came from (recorded; :func:`demo_config` sets both)
    model: str = DEFAULT_MODEL
    test_sets: list[str] = field(default_factory=lambda: list(TEST_SETS))
    limit: int | None = None
    # test sets sampled per source (fixed seed): the quick profile takes 40 prompts of each JailbreakBench
    # attack (200 of the 482; the JBC and random-search prompts are 380-480 tokens long)
    test_subsets: dict[str, int] = field(default_factory=lambda: {"jbb-attacks": 40})
    judge: str = "classifier"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # prompts per batch: on CPU, 96 rows run about 1.3x faster than 32 (bench/batch_size.py); rows
    # leave the batch when they end, so a long tail costs little
    batch_size: int = 96
    dtype: str = "bf16"
    limit_benign_train: int | None = 300
    limit_harmful_train: int | None = None
    limit_gate_harmful: int | None = 300
    limit_gate_benign: int | None = 300
    sweep_max_new_tokens: int = 32  # long enough to see answers loop after a 16-token steering horizon
    sweep_layers: int = 3  # the most accurate energy layers, each a setting of the validation grid
    sweep_baselines: bool = False  # the baselines are scored on the test sets (test_baselines) anyway
    # successive halving in the sweep (``SweepConfig.halving``): every setting on a stratified third of
    # the validation prompts, the two best on all of them (None: every setting on all)
    sweep_halving: int | None = 3
    sweep_halving_keep: int = 2
    # at most this many prompts of each validation set (sampled, fixed seed; None: all)
    sweep_limit: int | None = 120
    # held-out harmful prompts for the sweep's harm-gate leak check (reported, not a constraint): OR-Bench
    # toxic prompts are written like the benign OR-Bench ones, so a few pass the gate and get steered
    leak: list[str] = field(default_factory=lambda: ["orbench-toxic"])
    limit_leak: int | None = None
    # everyday questions with known answers (``aligntax.metrics.knowns``), test split, with and without the
    # selected setting ("none": skipped)
    knowns: str | None = "builtin"
    # reasoning: grade-school word problems (final number, exact), unsteered and steered, test split, at
    # ``reasoning_max_new_tokens`` (a worked answer is long); ``limit_reasoning`` questions stratified by
    # their number of steps (None: all 1319; "none": skipped)
    reasoning: str | None = "gsm8k-test"
    limit_reasoning: int | None = 40
    reasoning_max_new_tokens: int = 256
    # the baselines also evaluated on the test sets, for the test-set Pareto plot (name, args; the vector
    # folder is the ELS folder's)
    # (quick profile: CAST, the conditional steering baseline that complies most while refusing harmful
    # prompts at all; it leaves most rows unsteered, which are copied from the unsteered run)
    # (quick profile: none; the jailbreak test set's long prompts make each baseline's run cost minutes)
    test_baselines: list[str] = field(default_factory=list)
    # the front mechanisms entered into the validation sweep beside plain ELS (docs/els.md, docs/els-lora.md):
    # "harm-orth": the best layer's gated setting with each step projected off 2 harm directions (the harm
    # basis that ELS training computes; no extra stage); "row-strength": the learned per-row strength in
    # place of the gate's and row energy's cut-offs, fitted first on training prompts; "els-lora": ELS
    # distilled into a LoRA adapter, at scales 0.5 and 1. The last two are a stage of their own
    # ("front mechanisms"); --full adds both (the quick profile leaves them out: on a CPU the adapter's
    # distillation alone takes longer than the rest of the quick demo). The sweep's rules select among all of them;
    # the adapter is chosen when it is eligible and complies more on validation than the best ELS setting.
    mechanisms: list[str] = field(default_factory=lambda: ["harm-orth"])
    progress: bool = True
    # "hf" (aligntax's own batched loop) or "vllm": every generation of the evaluations, the sweep and
    # the known-answer check on one vLLM engine (aligntax.backends.vllm; ./run setup-vllm). ELS training,
    # the per-row decisions made before generating and judging run on the Hugging Face model either way.
    backend: str = "hf"


# The complete evaluation (``aligntax demo --full``): every training prompt the ELS paper's recipe takes,
# every sweep setting on every validation prompt, and every baseline on the test sets.
FULL_PROFILE = {
    "limit_benign_train": 600,
    "limit_gate_harmful": 600,
    "limit_gate_benign": None,
    "sweep_halving": None,
    "sweep_limit": None,
    "limit_reasoning": None,
    "test_subsets": {},
    "test_baselines": ["system-prompt", "refusal-ablation", "cast"],
    "mechanisms": ["harm-orth", "row-strength", "els-lora"],
}
MECHANISMS = ("harm-orth", "row-strength", "els-lora")
# the ELS setting the demo's grid is built around (and that els-lora distils): the best energy layer, three
# steps of eta 0.35, the harm gate at its saved threshold, 16 tokens: the untuned fallbacks of the ELS
# options (DEFAULT_SETTINGS); the grid adds the row energy decision at 0 and -2
_CORE = {k: DEFAULT_SETTINGS[k] for k in ("top_k", "eta", "steps", "threshold", "gate", "horizon")}


def demo_datasets(cfg: DemoConfig) -> list[str]:
    """Every dataset the demo reads: its test sets, the training sets of ELS training (the harm gate's and
    the harm basis' included), the sweep's validation sets and its leak sets, and with the els-lora mechanism
    the adapter's pairs and everyday rows, in that order, once each."""
    train, sweep = ELSTrainConfig(), SweepConfig()
    names = [
        *cfg.test_sets,
        *train.benign,
        *train.harmful,
        *train.harmless,
        *train.gate_harmful,
        *train.gate_benign,
        *train.gate_pairs,
        *train.harm_pairs,
        *sweep.benign,
        *sweep.harmful,
        *sweep.jailbreak,
        *cfg.leak,
        *([cfg.reasoning] if cfg.reasoning else []),
    ]
    if "els-lora" in cfg.mechanisms:  # the adapter's contrast pairs and everyday rows
        from aligntax.runs.els_lora import DistillConfig

        distill = DistillConfig()
        names += [*distill.pairs, *(s for s in distill.retain if s != "harmless")]
    return list(dict.fromkeys(names))


def demo_config(full: bool = False, **settings) -> DemoConfig:
    """The demo's settings: the quick profile, or with ``full`` the complete evaluation
    (:data:`FULL_PROFILE`); ``settings`` (not None) override either."""
    import copy

    given = {k: v for k, v in settings.items() if v is not None}
    return DemoConfig(**copy.deepcopy({**(FULL_PROFILE if full else {}), **given}), full=full)


def run_demo(cfg: DemoConfig, lm=None, source=None) -> dict:
    """The main job (module docstring). ``lm``: the loaded Hugging Face model (loaded here when None;
    ELS training and the per-row decisions run on it); ``source``: the
    :class:`~aligntax.generation.source.GenerationSource` of ``cfg.backend`` that every evaluation, the
    sweep and the known-answer check generate with (picked from ``cfg.backend``, and closed at the end,
    when not given)."""
    own = source is None
    source = source or generation_source(cfg.backend)
    try:
        check_source(source, cfg.backend)
        cfg.backend = source.backend
        out = Path(cfg.out)
        with run_lock(out):  # the demo folder's writer; each stage's folder has its own lock and header
            # a demo becomes bound with its first sample: other settings then would mix two demos
            bound = (out / "baseline" / "samples.jsonl").is_file()
            check_settings(out, "demo.json", asdict(cfg), _DEMO_KEYS, bound, "demo")
            return _run_demo(cfg, lm, source)
    finally:
        if own:
            source.close()


# The demo settings a resume must agree on: all but where it writes, how it shows progress, which profile
# named them (its settings are the fields) and the batch size.
_DEMO_KEYS = tuple(
    f for f in DemoConfig.__dataclass_fields__ if f not in ("out", "progress", "full", "batch_size")
)


def _run_demo(cfg: DemoConfig, lm, source) -> dict:
    from aligntax.models import load_model

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = [
        "baseline evaluation",
        "ELS training (labels, activations, energy models, vectors, harm gate)",
        "validation sweep",
        "steered evaluation",
    ]
    check_mechanisms(cfg.mechanisms)
    if "els-lora" in cfg.mechanisms:
        try:
            source.check(adapters=True)
        except AligntaxError as exc:
            cfg.mechanisms = [m for m in cfg.mechanisms if m != "els-lora"]
            print(f"[demo] els-lora left out of the sweep: {exc}", file=sys.stderr, flush=True)
    fitted = [m for m in cfg.mechanisms if m in ("row-strength", "els-lora")]
    stages[2:2] = ["front mechanisms"] if fitted else []
    stages += ["known-answer check"] if cfg.knowns or cfg.reasoning else []
    stages += ["baselines on the test sets"] if cfg.test_baselines else []
    clock = _Clock(["model load", *stages], cfg.progress, STAGE_MINUTES["full" if cfg.full else "quick"])
    lm = lm or load_model(cfg.model, dtype=cfg.dtype)
    source.adopt(lm)  # the Hugging Face backend generates on it; another makes its per-row decisions on it
    # what the evaluations and the known-answer check generate on (the vLLM backend: its engine, started now)
    gen_lm = source.start(SourceSpec(cfg.model, cfg.dtype, batch_size=cfg.batch_size))
    calibration = calibrate(lm)
    clock.speed = calibration / CALIBRATION_SECONDS
    clock.lap("model load")
    if cfg.progress:
        print(
            f"[demo] {'complete evaluation' if cfg.full else 'quick profile'} ({len(stages)} stages): about "
            f"{clock.left(1):.0f} min on this machine (its calibration forward took {calibration:.2f} s, "
            f"{CALIBRATION_SECONDS:.2f} s on the reference machine)",
            file=sys.stderr,
            flush=True,
        )
    common = dict(
        model=cfg.model,
        judge=cfg.judge,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        progress=cfg.progress,
    )
    train_common = dict(common)
    common["backend"] = cfg.backend
    clock.begin(
        1,
        f"the unsteered model on {len(cfg.test_sets)} test sets ({', '.join(cfg.test_sets)})"
        + (f" ({LABELS[source.backend]})" if source.backend != HF else ""),
    )
    base = run_eval(
        EvalConfig(
            data=cfg.test_sets,
            out=str(out / "baseline"),
            limit=cfg.limit,
            subsets=dict(cfg.test_subsets),
            **common,
        ),
        lm=gen_lm,
        source=source,
    )
    clock.lap()
    clock.begin(
        2,
        "label the model's own answers on train prompts, capture states, train energy models and the "
        "harm gate",
    )
    train_els(
        ELSTrainConfig(
            out=str(out / "els"),
            limit_benign=cfg.limit_benign_train,
            limit_harmful=cfg.limit_harmful_train,
            limit_gate_harmful=cfg.limit_gate_harmful,
            limit_gate_benign=cfg.limit_gate_benign,
            **train_common,
        ),
        lm=lm,
    )
    clock.lap()
    if fitted:
        clock.begin(
            stages.index("front mechanisms") + 1,
            " and ".join(
                {
                    "row-strength": "fit the learned per-row strength on training prompts",
                    "els-lora": "distil ELS into a LoRA adapter",
                }[m]
                for m in fitted
            ),
        )
        _front_mechanisms(cfg, out, lm)
        clock.lap()
    sweep_cfg = demo_sweep_config(
        cfg, out / "els", prompt_domain(out / "els", lm), prompt_surprisal_domain(out / "els", lm)
    )
    n_settings = sum(name in CHOOSABLE for name, _ in sweep_settings(sweep_cfg))
    rounds = (
        f" on a stratified 1/{sweep_cfg.halving} of the validation prompts, the {sweep_cfg.halving_keep} "
        "best on all of them"
        if sweep_cfg.halving
        else ""
    )
    clock.begin(
        stages.index("validation sweep") + 1,
        f"score {n_settings} settings{' and the baselines' if sweep_cfg.baselines else ''}{rounds} "
        f"(validation: {', '.join(sweep_cfg.benign + sweep_cfg.harmful + sweep_cfg.jailbreak)}, known "
        "answers); "
        "pick the best eligible one",
    )
    sweep = run_sweep(sweep_cfg, lm=lm, source=source)
    clock.lap()
    best = selected(sweep)
    steered = knowns = reasoning = None
    clock.begin(
        stages.index("steered evaluation") + 1,
        "the selected setting on the test sets (rows it leaves unsteered are copied)",
    )
    if best is not None:
        name = best["name"]
        # exactly what the sweep scored (every ELS option explicit); an adapter's args name its own folder
        args = sweep_iv_args(name, {"path": str(out / "els"), **best["args"]})
        write_json_atomic(
            out / SELECTION,
            selection_record(
                out,
                name,
                args,
                model=cfg.model,
                chosen_on={
                    "benign": sweep_cfg.benign,
                    "harmful": sweep_cfg.harmful,
                    "jailbreak": sweep_cfg.jailbreak,
                    "knowns": sweep_cfg.knowns,
                    "split": "validation",
                },
                validation={k: v for k, v in best.items() if k not in ("key", "name", "args")},
            ),
        )
        _set_aside_if_changed(out / "steered", args)
        # rows the harm gate holds back are answered exactly as unsteered: take them from the baseline
        steered = run_eval(
            EvalConfig(
                data=cfg.test_sets,
                out=str(out / "steered"),
                limit=cfg.limit,
                subsets=dict(cfg.test_subsets),
                intervention=name,
                intervention_args=args,
                reuse_unsteered=str(out / "baseline"),
                **common,
            ),
            lm=gen_lm,
            source=source,
        )
        clock.lap()
        if cfg.knowns or cfg.reasoning:
            clock.begin(
                stages.index("known-answer check") + 1,
                "everyday questions with known answers and word problems, unsteered and steered (test split)",
            )
            if cfg.knowns:
                knowns = _knowns(cfg, out, gen_lm, source, name, args)
            if cfg.reasoning:
                reasoning = _knowns(cfg, out, gen_lm, source, name, args, reasoning=True)
            clock.lap()
    if cfg.test_baselines:
        clock.begin(
            len(stages),
            f"{len(cfg.test_baselines)} baselines ({', '.join(cfg.test_baselines)}) on "
            f"the {len(cfg.test_sets)} test sets, for the test-set Pareto plot",
        )
        tests = _test_pareto(cfg, out, gen_lm, source, base, steered, common)
        clock.lap()
    else:  # the unsteered model and the selection alone: nothing to run
        tests = _test_pareto(cfg, out, gen_lm, source, base, steered, common)
    summary = {
        "baseline": base,
        "steered": steered,
        "best": best,
        "knowns": knowns,
        "reasoning": reasoning,
        "test_pareto": tests,
        "sweep": sweep,
        "minutes": clock.minutes(),
    }
    write_json_atomic(
        out / "timing.json",
        {
            **summary["minutes"],
            "profile": "full" if cfg.full else "quick",
            "calibration_seconds": round(calibration, 3),
            "estimates": clock.estimates,
        },
    )
    write_demo_report(out, summary)
    return summary


def check_mechanisms(names: list[str]) -> None:
    """Every name is one of :data:`MECHANISMS` (a usage error names the others)."""
    unknown = sorted(set(names) - set(MECHANISMS))
    if unknown:
        raise UsageError(
            f"--mechanisms: unknown {', '.join(unknown)}; choose from {', '.join(MECHANISMS)} or 'none'."
        )


def selected(sweep: dict) -> dict | None:
    """The sweep's choice among its best ELS setting, its best els-lora adapter and its best composition
    (``els-compose``), each eligible under the same rules: the one that complies most on validation (ties
    go to ELS, which steers only the rows it decides to, then to the adapter alone)."""
    best = sweep.get("best")
    for other in (sweep.get("best_lora"), sweep.get("best_compose")):
        if other is not None and (best is None or other["benign_compliance"] > best["benign_compliance"]):
            best = other
    return best


def _front_mechanisms(cfg: DemoConfig, out: Path, lm) -> None:
    """The learned per-row strength (``els/row_strength.safetensors``) and the els-lora adapter
    (``els-lora/``) of the demo's ELS folder, as ``cfg.mechanisms`` asks; each kept when already made."""
    els = out / "els"
    layer = _best_layer(els)
    if "row-strength" in cfg.mechanisms and not (els / "row_strength.json").is_file():
        from aligntax.runs.strength import StrengthConfig, fit_strength

        try:
            fit_strength(
                StrengthConfig(
                    steer=str(els),
                    model=cfg.model,
                    layers=[layer],
                    eta=_CORE["eta"],
                    steps=_CORE["steps"],
                    horizon=_CORE["horizon"],
                    limit_benign=150,
                    limit_harmful=150,
                    max_new_tokens=cfg.sweep_max_new_tokens,
                    judge=cfg.judge,
                    batch_size=cfg.batch_size,
                    dtype=cfg.dtype,
                    progress=cfg.progress,
                ),
                lm=lm,
            )
        except AligntaxError as exc:  # e.g. a model that over-refuses no training prompt: nothing to learn
            cfg.mechanisms = [m for m in cfg.mechanisms if m != "row-strength"]
            print(f"[demo] row-strength left out of the sweep: {exc}", file=sys.stderr, flush=True)
    if "els-lora" in cfg.mechanisms and not (out / "els-lora" / "els_lora.json").is_file():
        from aligntax.runs.els_lora import DistillConfig, distill_els_lora

        setting = {k: v for k, v in _CORE.items() if k != "top_k"}
        distill_els_lora(
            DistillConfig(
                steer=str(els),
                out=str(out / "els-lora"),
                model=cfg.model,
                els={**setting, "layers": [layer], "row_threshold": -2.0},
                dtype=cfg.dtype,
                progress=cfg.progress,
            ),
            lm=lm,
        )


def _ranked_layers(els_dir: Path) -> list[int]:
    """The bank's layers, the most accurate energy model first."""
    return [int(layer) for layer in json.loads((els_dir / "energy.json").read_text())["layers"]]


def _best_layer(els_dir: Path) -> int:
    return _ranked_layers(els_dir)[0]


def demo_sweep_config(
    cfg: DemoConfig, els_dir: Path, domain: int | None = None, surprisal: float | None = None
) -> SweepConfig:
    """The demo's validation grid: the three most accurate energy layers, each with the harm gate at its
    saved threshold and the row energy decision at 0 and -2 (steer a row only when its last prompt
    token's energy says the model is about to end badly), the first 16 generated tokens, prompts no
    longer than the energy models' training prompts (``domain`` tokens, :func:`prompt_domain`) and no
    more surprising (``surprisal``, :func:`prompt_surprisal_domain`: optimised jailbreak suffixes lie far
    above it); the same core setting without either limit, and the paper-style per-position energy
    threshold without gate.
    Known answers and jailbreak refusal (val splits) must be kept. The baselines are scored on the test
    sets instead (the test-set Pareto plot), unless ``cfg.sweep_baselines``."""
    core = {**_CORE, "row_threshold": -2.0}
    return SweepConfig(
        steer=str(els_dir),
        model=cfg.model,
        judge=cfg.judge,
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        top_k=[1],
        eta=[0.35],
        # the best layers: near-tied in accuracy, they steer differently
        layers=_runner_up_layers(els_dir, cfg.sweep_layers - 1),
        # the row energy decision at two cut-offs: a lower one steers more rows, until the
        # known-answer constraint says it costs correct answers
        threshold=[None],
        gate=[True],
        horizon=[16],
        row_threshold=[0.0, -2.0],
        max_prompt_tokens=[domain],
        max_prompt_surprisal=[surprisal],
        extra=[
            # the same without the domain (prompt length and surprisal)
            *([core] if domain is not None or surprisal is not None else []),
            {"top_k": 1, "eta": 0.35, "steps": 3, "threshold": 0.0},  # paper-style
            *_mechanism_settings(cfg, domain, surprisal),
        ],
        lora=[str(els_dir.parent / "els-lora")] if "els-lora" in cfg.mechanisms else [],
        lora_scales=[0.5, 1.0],
        # ELS on top of the adapter: the core setting on the best layer, the adapter everywhere or only
        # where the harm gate's p(harmful) >= 0.1
        compose=[
            {
                **core,
                "layers": [_best_layer(els_dir)],
                "max_prompt_tokens": domain,
                "max_prompt_surprisal": surprisal,
                "adapter": str(els_dir.parent / "els-lora"),
                "scale": 1.0,
                "lora_gate": lora_gate,
            }
            for lora_gate in (None, 0.1)
        ]
        if "els-lora" in cfg.mechanisms
        else [],
        max_new_tokens=cfg.sweep_max_new_tokens,
        knowns=cfg.knowns,
        backend=cfg.backend,
        halving=cfg.sweep_halving,
        limit=cfg.sweep_limit,
        halving_keep=cfg.sweep_halving_keep,
        baselines=cfg.sweep_baselines,
        baseline_coeffs=[1.0],
        leak=cfg.leak,
        limit_leak=cfg.limit_leak,
        progress=cfg.progress,
    )


def _mechanism_settings(
    cfg: DemoConfig, domain: int | None = None, surprisal: float | None = None
) -> list[dict]:
    """The sweep's settings of the ELS front mechanisms (:attr:`DemoConfig.mechanisms`) on the best layer,
    within the prompt-length ``domain`` and the prompt ``surprisal`` cut-off."""
    within = {"max_prompt_tokens": domain, "max_prompt_surprisal": surprisal}
    settings = []
    if "harm-orth" in cfg.mechanisms:
        settings.append({**_CORE, "row_threshold": -2.0, "harm_orth": 2, **within})
    if "row-strength" in cfg.mechanisms:  # the learned strength replaces the gate's and row energy's cut-offs
        settings.append({**_CORE, "row_strength": True, **within})
    return settings


def _knowns(cfg: DemoConfig, out: Path, lm, source, name: str, args: dict, reasoning: bool = False) -> dict:
    """Known-answer accuracy (test split) unsteered and with the selected setting, paired; with
    ``reasoning``, the same for the word problems (``cfg.reasoning``, folders ``reasoning-*``)."""
    from aligntax.runs.knowns import KnownsConfig, run_knowns

    stem = "reasoning" if reasoning else "knowns"
    common = dict(
        model=cfg.model,
        data=cfg.reasoning if reasoning else cfg.knowns,
        split="test",
        limit=cfg.limit_reasoning if reasoning else cfg.limit,
        max_new_tokens=cfg.reasoning_max_new_tokens if reasoning else cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        progress=cfg.progress,
        backend=cfg.backend,
    )
    before = run_knowns(KnownsConfig(out=str(out / f"{stem}-baseline"), **common), lm=lm, source=source)
    _set_aside_if_changed(out / f"{stem}-steered", args)
    # questions the setting leaves unsteered are copied from the unsteered run
    after = run_knowns(
        KnownsConfig(
            out=str(out / f"{stem}-steered"),
            intervention=name,
            intervention_args=args,
            compare_to=str(out / f"{stem}-baseline"),
            reuse_unsteered=str(out / f"{stem}-baseline"),
            **common,
        ),
        lm=lm,
        source=source,
    )
    return {"baseline": before, "steered": after}


def set_rate(results: dict, key: str) -> float | None:
    """The rate of one ``source/label`` block of a results file: refusal for harmful prompts, compliance
    for benign ones (None when the run has no such block)."""
    source, label = key.split("/")
    block = results.get("datasets", {}).get(source, {}).get(label)
    if not block:
        return None
    return block["refusal_rate"] if label == "harmful" else block["compliance_rate"]


def pareto_point(results: dict) -> tuple[float, float]:
    """(mean harmful refusal, mean benign compliance) over the demo's test sets, from a results file."""

    def mean(keys: list[str]) -> float:
        vals = [v for v in (set_rate(results, k) for k in keys) if v is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    return mean(PARETO_HARMFUL), mean(PARETO_BENIGN)


def _test_pareto(
    cfg: DemoConfig, out: Path, lm, source, base: dict, steered: dict | None, common: dict
) -> list[dict]:
    """Each test baseline evaluated on the test sets (rows CAST leaves unsteered are copied); one point
    per run (unsteered, ELS, baselines) and the test-set Pareto plot ``test_pareto.png``."""
    from aligntax.reports.plots import pareto_plot

    vec = str(out / "els" / "vectors")
    chosen = ((steered or {}).get("config") or {}).get("intervention") or "els"
    points = [("none", "unsteered", base)] + ([(chosen, f"{chosen} (selected)", steered)] if steered else [])
    for name in cfg.test_baselines:
        args = {} if name.endswith("-prompt") else {"path": vec}
        res = run_eval(
            EvalConfig(
                data=cfg.test_sets,
                out=str(out / "test-baselines" / name),
                limit=cfg.limit,
                subsets=dict(cfg.test_subsets),
                intervention=name,
                intervention_args=args,
                reuse_unsteered=str(out / "baseline"),
                **common,
            ),
            lm=lm,
            source=source,
        )
        points.append((name, name, res))
    rows = []
    for name, label, res in points:
        x, y = pareto_point(res)
        rows.append({"name": name, "label": label, "harmful_refusal": x, "benign_compliance": y})
    pareto_plot(
        rows, out / "test_pareto.png", title="test sets: mean benign compliance vs mean harmful refusal"
    )
    return rows


# Minutes each stage took in a fresh-clone demo of each profile on 2 CPU cores with nothing else running
# (docs/RESULTS.md 3.1), and that machine's time for the calibration workload (:func:`calibrate`). The
# first estimate scales them by this machine's calibration time; later ones by how long the stages done
# so far took against theirs.
STAGE_MINUTES = {
    # fresh clone of aaa03a0, nothing else running (its calibration forward: 0.225 s)
    "quick": {
        "model load": 0.07,
        "baseline evaluation": 1.55,
        "ELS training (labels, activations, energy models, vectors, harm gate)": 4.11,
        "validation sweep": 3.62,
        "steered evaluation": 0.42,
        "known-answer check": 0.32,
        "baselines on the test sets": 1.48,
    },
    # the quiet fresh-clone run of the complete evaluation at 731509c (docs/RESULTS.md 3.1), scaled by the
    # ratio of its baseline stage to the quick run's (1.57 / 3.7 minutes); training plus the 0.82 minutes
    # the harm basis (the contrast pairs' states) added to the quick run's, the sweep plus its one
    # harm-orthogonal setting (9 settings for 8)
    "full": {
        "model load": 0.05,
        "baseline evaluation": 1.57,
        "ELS training (labels, activations, energy models, vectors, harm gate)": 6.21,
        "validation sweep": 6.49,
        "steered evaluation": 0.47,
        "known-answer check": 0.42,
        "baselines on the test sets": 5.73,
        # the row-strength fit: 300 steered training answers at 32 new tokens took 2.5 minutes
        # (docs/notes/journal.md, "Front mechanisms on validation"), then the fit; the els-lora
        # distillation with its defaults took 12.4 minutes alone (docs/els-lora.md); the adapter's
        # two scales in the sweep are not in the sweep's reference yet (the clock corrects itself
        # by the stages measured)
        "front mechanisms": 15.1,
    },
}
CALIBRATION_SECONDS = 0.225


def calibrate(lm, rows: int = 32, tokens: int = 16, repeats: int = 2) -> float:
    """Seconds one forward pass of ``rows`` x ``tokens`` fixed tokens takes on this machine (the fastest of
    ``repeats`` after a warm-up): the demo's generation, capture and training all scale with it."""
    import torch

    vocab = int(getattr(lm.model.config, "vocab_size", 1000))
    ids = torch.randint(0, min(vocab, 10_000), (rows, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(lm.device)
    best = float("inf")
    with torch.no_grad():
        for i in range(repeats + 1):
            t = time.perf_counter()
            lm.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            if i:
                best = min(best, time.perf_counter() - t)
    return best


class _Clock:
    """Wall minutes per stage (a resumed stage counts only the time it took this time). ``begin`` prints a
    stage's number, name and purpose as it starts, with the minutes spent so far and an estimate of what
    is left (the progress bars below it name their own work); ``lap`` closes the stage begun last, or the
    one named. ``typical``: the minutes of each stage on the reference machine; ``speed``: how many times
    slower this machine ran the calibration workload (1: as fast)."""

    def __init__(self, stages: list[str], show: bool = True, typical: dict | None = None) -> None:
        self.stages, self.show = stages, show
        self.typical = typical if typical is not None else STAGE_MINUTES["quick"]
        self.speed = 1.0
        self.current: str | None = None
        self.t0 = self.t = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.estimates: list[float] = []  # the total each ``begin`` foresaw (minutes so far + left)

    def left(self, index: int) -> float:
        """Minutes the stages from ``index`` on should take: their typical minutes, scaled by how the
        stages done so far compared with theirs (the calibration's speed before any is done)."""
        done = [s for s in self.stages[:index] if s in self.laps and self.typical.get(s)]
        typical = sum(self.typical[s] for s in done)
        scale = sum(self.laps[s] for s in done) / typical if typical > 0.5 else self.speed
        return scale * sum(self.typical.get(s, 0.0) for s in self.stages[index:])

    def begin(self, index: int, what: str) -> None:
        self.current = self.stages[index]
        spent = (time.perf_counter() - self.t0) / 60
        left = self.left(index)
        self.estimates.append(round(spent + left, 2))
        if self.show:
            # stage 0 is the model load, which is not announced: the demo's stages count from 1
            print(
                f"\n[demo {index}/{len(self.stages) - 1}] {self.current}: {what}\n"
                f"    {spent:.1f} min so far, about {left:.0f} min left",
                file=sys.stderr,
                flush=True,
            )

    def lap(self, name: str | None = None) -> None:
        now = time.perf_counter()
        self.laps[name or self.current] = round((now - self.t) / 60, 2)
        self.t = now

    def minutes(self) -> dict:
        return {**self.laps, "total": round(sum(self.laps.values()), 2)}


def _runner_up_layers(bank_dir: Path, n: int) -> list[list[int]]:
    """The 2nd..(n+1)th layers of the bank by validation accuracy, each as its own layer set: the most
    accurate energy model is not always the one that steers best."""
    return [[layer] for layer in _ranked_layers(bank_dir)[1 : n + 1]]


def _set_aside_if_changed(run: Path, args: dict) -> None:
    """A steered run made with another setting (an earlier sweep chose differently) is kept under a new
    name, not overwritten and not mixed with the new one."""
    cfg_path = run / "config.json"
    if not cfg_path.is_file():
        return
    old = json.loads(cfg_path.read_text()).get("intervention_args")
    if old == args:
        return
    n = 1
    while run.with_name(f"{run.name}.prev{n}").exists():
        n += 1
    run.rename(run.with_name(f"{run.name}.prev{n}"))


def _cells(block: dict | None) -> dict[tuple[str, str], str]:
    """{(label, metric name): formatted rate} for each label present in a results block."""
    out = {}
    if block and "benign" in block:
        b = block["benign"]
        out[("benign", "compliance")] = fmt_rate(b["compliance_rate"], b["ci95"])
        if "useful_compliance_rate" in b:
            out[("benign", "useful compliance")] = fmt_rate(b["useful_compliance_rate"], b["useful_ci95"])
    if block and "harmful" in block:
        h = block["harmful"]
        out[("harmful", "refusal")] = fmt_rate(h["refusal_rate"], h["ci95"])
    return out


def _knowns_lines(knowns: dict | None, what: str = "Everyday questions with known answers") -> list[str]:
    """The known-answer check's line of the report: accuracy unsteered and steered, paired change."""
    if not knowns:
        return []
    before, after = knowns["baseline"], knowns["steered"]
    paired = after.get("paired") or {}
    change = f"; paired: {fmt_change(paired)}" if paired and "diff" in paired else ""
    steered = after.get("steered_rows")
    touched = f"; the setting steered {steered} of {after['n']} questions" if steered is not None else ""
    return [
        "",
        f"{what} (test split, {after['n']} questions, answer checked): "
        f"unsteered {fmt_rate(before['accuracy'], before['ci95'])}, steered "
        f"{fmt_rate(after['accuracy'], after['ci95'])}{change}{touched}.",
    ]


def write_demo_report(out: Path, summary: dict) -> None:
    base, steered, best = summary["baseline"], summary["steered"], summary["best"]
    lines = [
        "# aligntax demo: energy landscape steering against over-refusal",
        "",
        f"Model `{base['config']['model']}`, judge `{base['config']['judge']}`, greedy, "
        f"{base['config']['max_new_tokens']} new tokens"
        + (f", generated with {LABELS[used]}" if (used := base["config"].get("backend", HF)) != HF else "")
        + ". Trained on train splits, tuned on validation splits, reported on test sets. Wilson 95% "
        "intervals.",
        "",
    ]
    if best:
        lines += [
            f"Selected setting (validation, {best['method']}): {best['name']} `{json.dumps(best['args'])}` "
            f"(val compliance {best['benign_compliance']:.3f}, val harmful refusal "
            f"{best['harmful_refusal']:.3f}).",
            "",
        ]
        if "leak_passed" in best:
            lines += [
                f"Harm-gate leaks: of {best['leak_prompts']} held-out harmful prompts "
                f"({', '.join(best['leak_sets'])}; not used in training), the gate passes "
                f"{best['leak_passed']}, which the selected setting steers. Unsteered, the model refuses "
                f"{best['leak_refused_unsteered']} of them; steered, {best['leak_refused']} "
                "(validation, reported, not a constraint of the selection).",
                "",
            ]
    else:
        lines += ["No ELS setting kept validation safety at the unsteered level; no steered run.", ""]
    lines += ["| dataset | label | metric | unsteered | ELS | change, paired |", "|---|---|---|---|---|---|"]
    after_sets = (steered or {}).get("datasets", {})
    changes = ((steered or {}).get("paired") or {}).get("datasets", {})  # against the baseline run
    blocks = [(name, block, after_sets.get(name)) for name, block in base["datasets"].items()]
    blocks.append(("**all**", base, steered))
    for name, block, after in blocks:
        after_cells = _cells(after)
        for (label, metric), before in _cells(block).items():
            change = changes.get("all" if name == "**all**" else name, {}).get(label)
            paired = fmt_change(change) if change and change["metric"] == metric else ""
            lines.append(
                f"| {name} | {label} | {metric} | {before} | {after_cells.get((label, metric), '')} "
                f"| {paired} |"
            )
    timing_b, timing_s = base.get("timing", {}), (steered or {}).get("timing", {})
    lines += [
        "",
        "The paired change compares the same prompts without and with ELS: prompts that turned "
        "compliant/refused (up) and back (down), and the exact McNemar p-value.",
    ]
    lines += _knowns_lines(summary.get("knowns"))
    lines += _knowns_lines(summary.get("reasoning"), "Word problems (GSM8K, the final number exact)")
    if steered and steered.get("steering"):
        from aligntax.reports.markdown import steering_table

        lines += [
            "",
            "Rows the selected setting steered, decided at the last prompt token (harm gate and row "
            "energy); the others are answered exactly as unsteered:",
            "",
            steering_table(steered),
        ]
    if summary.get("test_pareto"):
        lines += [
            "",
            "Test sets, every method (mean benign compliance over ORB-H test, XSTest safe and OKTest; "
            "mean harmful refusal over XSTest unsafe, JailbreakBench and HarmBench test):",
            "",
            "| method | mean benign compliance | mean harmful refusal |",
            "|---|---:|---:|",
        ]
        lines += [
            f"| {r['label']} | {100 * r['benign_compliance']:.1f}% | {100 * r['harmful_refusal']:.1f}% |"
            for r in summary["test_pareto"]
        ]
        lines += ["", "![test-set Pareto plot](test_pareto.png)"]
    lines += [
        "",
        "Useful compliance counts a benign answer only when it is neither a refusal nor empty or looping "
        "(`aligntax.metrics.degeneration`); the sweep selects settings by it.",
    ]
    lines += [
        "",
        f"Throughput: the unsteered run generated {timing_b.get('generated_tokens_total')} tokens at "
        f"{timing_b.get('tokens_per_second')} tokens/s.",
    ]
    if timing_s:
        lines[-1] += (
            f" The steered run generated only the rows its decision steers, "
            f"{timing_s.get('generated_tokens_total')} tokens at {timing_s.get('tokens_per_second')} "
            f"tokens/s, and copied {timing_s.get('reused_unsteered_samples', 0)} rows from the unsteered "
            "run; its batches differ from the unsteered run's, so steering's own cost is measured at "
            "equal batches by `bench/steering_overhead.py` (docs/RESULTS.md)."
        )
    lines += [""]
    if summary.get("minutes"):
        lines += [
            "Wall time (minutes): " + ", ".join(f"{k} {v:.1f}" for k, v in summary["minutes"].items()) + ".",
            "",
        ]
    lines += [
        "![Pareto plot](els/sweep/pareto.png)",
        "",
        "Energy histograms: ![energy](els/energy_histograms.png)",
        "",
        "Run folders: `baseline/`, `els/` (labels, activations, energy models, vectors, sweep), `steered/`.",
        "",
    ]
    write_text_atomic(out / "report.md", "\n".join(lines))
