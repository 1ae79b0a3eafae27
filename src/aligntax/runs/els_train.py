"""ELS training (``aligntax els train``): label the model's own behaviour, capture activations, train the
energy models, compute the vector baselines, the harm gate and the harm basis.

Every stage writes into one folder and resumes: labels are an evaluation run (``labels/samples.jsonl``),
activations are safetensors shards skipped by prompt id, and a bank trained with the same settings is
kept. The validation sweep that tunes the steering strength is :mod:`aligntax.runs.els_sweep`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from aligntax.data.registry import find_dataset
from aligntax.defaults import DEFAULT_MAX_NEW_TOKENS
from aligntax.errors import AligntaxError
from aligntax.models.spec import DEFAULT_MODEL
from aligntax.runfolder import check_settings, run_lock, write_json_atomic, write_text_atomic
from aligntax.runs.eval import EvalConfig, activation_id, load_prompt_sets, run_eval, sampled
from aligntax.runs.jsonl import read_jsonl


@dataclass
class ELSTrainConfig:
    """Settings of ``aligntax els train``."""

    out: str = "runs/els"
    model: str = DEFAULT_MODEL
    # over-refusal prompts of two styles (OR-Bench-Hard and PHTest, written against other chat models), so
    # that the energy models learn "about to refuse a benign request" rather than one benchmark's style
    benign: list[str] = field(default_factory=lambda: ["orbench-hard-train", "phtest-harmless-train"])
    harmful: list[str] = field(default_factory=lambda: ["harmful-train"])
    harmless: list[str] = field(default_factory=lambda: ["harmless-train"])  # for the vector baselines
    limit_benign: int | None = 600  # per set
    limit_harmful: int | None = None
    limit_harmless: int | None = 300
    # harm gate: a benign-vs-harmful probe (labels from the prompt sets, no judge), trained on the benign and
    # harmful prompts above, the harmless ones, and these extra harmful prompts (captured, not generated).
    # The extra sets differ in form on purpose: OR-Bench toxic is written like OR-Bench-Hard (so the probe
    # learns harm, not style), StrongREJECT and MaliciousInstruct hold short requests, Do-Not-Answer holds
    # harmful *questions* (stereotypes, arguments for discrimination) that the imperative sets lack.
    gate: bool = True
    gate_harmful: list[str] = field(
        default_factory=lambda: ["orbench-toxic", "strongreject", "maliciousinstruct", "do-not-answer"]
    )
    limit_gate_harmful: int | None = 600  # per set, sampled
    # extra benign prompts for the gate (beyond the benign and harmless ones above; duplicates dropped):
    # every benign look-alike of the training splits, so that the probe passes the styles it must pass
    gate_benign: list[str] = field(default_factory=lambda: ["orbench-hard-train", "phtest-harmless-train"])
    limit_gate_benign: int | None = None  # per set, sampled
    # contrast pairs for the gate (benign and harmful prompts sharing a sensitive word, labels from the
    # file; e.g. the shipped ``contrast-pairs``), each prompt weighted ``gate_pairs_weight`` times in the
    # fit: none of the sets above pairs "kill a stuck process" with "kill my coworker", so a gate trained
    # on them alone scores benign prompts with a violent word as harmful (docs/RESULTS.md 3.4)
    gate_pairs: list[str] = field(default_factory=list)
    gate_pairs_weight: float = 5.0
    # the gate's threshold: the probability above which this share of the harmful training prompts falls
    # out of fold (capped at 0.5); None: 0.5. A harmful prompt the gate lets through may be steered out
    # of its refusal, so the gate is tuned for recall on the harmful side.
    gate_recall: float | None = 0.99
    # also try the mean of one probe per candidate layer (kept when its cross-validated balanced accuracy
    # is higher): off, since on the embedded model it passed more benign prompts but also more harmful
    # questions out of distribution (docs/RESULTS.md section 3.7)
    gate_ensemble: bool = False
    # the harm basis (harm_basis.safetensors): per block, the harmful-minus-benign mean difference and the
    # top directions of these contrast pairs' differences, up to harm_k directions (what ELS steps are
    # projected off with harm_orth); [] : the per-prompt differences instead of pairs
    harm_pairs: list[str] = field(default_factory=lambda: ["contrast-pairs"])
    harm_k: int = 8
    layers: list[int] | None = None  # None: every layer
    objective: str = "logistic"
    preset: str = "small"  # "small" or "paper"
    # rank the layers by validation accuracy averaged over this many disjoint 20% folds (the kept model is
    # fold 0's): with one split, bf16 rounding of the states alone reordered nearly tied layers
    energy_folds: int = 5
    epochs: int = 60
    lr: float = 1e-3
    judge: str = "classifier"
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    batch_size: int = 32
    dtype: str = "bf16"
    seed: int = 0
    progress: bool = True

    def energy_config(self, **overrides):
        """The :class:`~aligntax.energy.EnergyConfig` of the energy models these settings train."""
        from aligntax.energy import EnergyConfig

        return EnergyConfig.preset(
            self.preset,
            **{
                "objective": self.objective,
                "epochs": self.epochs,
                "lr": self.lr,
                "seed": self.seed,
                "folds": self.energy_folds,
                **overrides,
            },
        )


def train_els(cfg: ELSTrainConfig, lm=None, ray=None) -> dict:
    """Run the whole training pipeline; returns the training summary also written to ``report.md``.

    With ``ray`` (a :class:`~aligntax.runs.distributed.RayConfig`) the label generation, and the prompt
    states recorded during it, run on replicas of the model over Ray (the batches one process forms,
    one work unit each); this process judges, writes the same files, and loads the model afterwards
    for the remaining, cheaper stages."""
    if ray is not None and lm is not None:
        raise AligntaxError(
            "ELS training on Ray loads the model on its replicas: give the model, not a loaded one."
        )
    out = Path(cfg.out)
    with run_lock(out):  # one writer per ELS folder (its labels run has its own lock too)
        # bound once the label run has a sample: other settings then would mix two trainings
        bound = (out / "labels" / "samples.jsonl").is_file()
        check_settings(out, "train_config.json", asdict(cfg), _TRAIN_KEYS, bound, "ELS training")
        return _train_els(cfg, out, lm, ray)


# The training settings a resume must agree on: all but where it writes, the progress bars and the
# batch size.
_TRAIN_KEYS = tuple(
    f for f in ELSTrainConfig.__dataclass_fields__ if f not in ("out", "progress", "batch_size")
)


def _train_els(cfg: ELSTrainConfig, out: Path, lm, ray) -> dict:
    from aligntax.models import load_model

    if ray is None:
        lm = lm or load_model(cfg.model, dtype=cfg.dtype)
    t0 = time.perf_counter()
    steps: dict[str, float] = {}  # wall seconds per step

    def lap(name: str) -> None:
        steps[name] = round(time.perf_counter() - t0 - sum(steps.values()), 1)

    # 1. the model's own greedy behaviour, judged
    layers = cfg.layers if cfg.layers is not None else "all"
    lm, benign, harmful, refused, y = _labelled(cfg, lm, out, layers, ray)
    items = [*benign, *harmful]
    lap("labels")

    # 2. residual stream entering each block at the last prompt token (rows the label run did not
    # generate now, e.g. after a resume, are captured here)
    acts = captured(lm, items, layers, out / "activations", cfg)
    lap("activations")

    # 3. one energy model per layer (kept when a bank trained with the same settings is already there)
    bank = _energy_bank(cfg, lm, out, acts, y, (benign, harmful), refused)
    lap("energy models")

    # 4. vectors for the baselines: refusal (harmful - harmless), false refusal (pseudo-harmful - harmless)
    harmless = load_prompt_sets(cfg.harmless, cfg.limit_harmless)
    h_acts = captured(lm, harmless, layers, out / "activations_harmless", cfg)
    _vectors(lm, out, items, acts, h_acts, bank)
    lap("vectors")

    # 5. the harm gate, read at or before the best energy layers so that it decides before steering
    if cfg.gate:
        _train_gate(cfg, lm, out, items, acts, harmless, h_acts, bank)
        lap("harm gate")

    # 6. the harm basis that ELS steps may be projected off (harm_orth)
    harm_basis(cfg, lm, out, items, acts, harmless, h_acts).save(out)
    lap("harm basis")

    summary = {
        "layers": bank.summary(),
        "n_states": int(len(y)),
        "n_bad": int(y.sum()),
        "seconds": round(time.perf_counter() - t0, 1),
        "step_seconds": steps,
        "config": asdict(cfg),
    }
    write_json_atomic(out / "train_summary.json", summary, default=str)
    _write_train_report(out, bank, summary)
    return summary


def _labelled(cfg: ELSTrainConfig, lm, out: Path, layers, ray=None) -> tuple:
    """Step 1 of :func:`train_els`: the label run (``labels``, its prompt states recorded into
    ``activations``) on the training prompts, judged. Returns the model (loaded here after a run on
    Ray), the benign and the harmful items, whether each item was refused, and the state labels."""
    from aligntax.models import load_model

    label_cfg = EvalConfig(
        data=[],
        out=str(out / "labels"),
        model=cfg.model,
        judge=cfg.judge,
        max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        dtype=cfg.dtype,
        progress=cfg.progress,
    )
    benign, harmful = training_items(cfg)
    if not benign or not harmful:
        raise AligntaxError("ELS training needs both benign (over-refusal) and harmful prompts.")
    label_cfg.data = [*cfg.benign, *cfg.harmful]
    _label_run(label_cfg, lm, [*benign, *harmful], layers, out / "activations", ray)
    lm = lm or load_model(cfg.model, dtype=cfg.dtype)
    refused, y = judged_labels(out / "labels", [*benign, *harmful])
    return lm, benign, harmful, refused, y


def _energy_bank(cfg: ELSTrainConfig, lm, out: Path, acts: dict, y, parts: tuple, refused: list):
    """Step 3 of :func:`train_els`: one energy model per layer on the states ``acts`` labelled ``y``
    (``parts``: the benign and the harmful items), saved with its histograms; a bank already in ``out``
    trained with the same settings is kept."""
    from aligntax.energy import plot_energy_histograms, train_layers

    benign, harmful = parts
    items = [*benign, *harmful]
    ecfg = cfg.energy_config()
    bank = _existing_bank(out, ecfg, lm, len(y)) or train_layers(
        acts,
        y,
        ecfg,
        fingerprint=lm.fingerprint,
        progress=cfg.progress,
        metadata={
            "benign": cfg.benign,
            "harmful": cfg.harmful,
            "judge": cfg.judge,
            "position": "last",
            "n_benign": len(benign),
            "n_harmful": len(harmful),
            "benign_refused": sum(r for r, it in zip(refused, items, strict=True) if it.label == "benign"),
            "harmful_refused": sum(r for r, it in zip(refused, items, strict=True) if it.label == "harmful"),
        },
    )
    bank.save(out)
    plot_energy_histograms(bank, acts, y, out / "energy_histograms.png", layers=bank.top(6))
    return bank


def _vectors(lm, out: Path, items: list, acts: dict, h_acts: dict, bank) -> None:
    """Step 4 of :func:`train_els`: the baselines' vectors (refusal: harmful - harmless; false refusal:
    pseudo-harmful - harmless), saved in ``vectors``."""
    from aligntax.interventions.vectors import compute_vectors

    is_h = torch.tensor([it.label == "harmful" for it in items])
    vectors = compute_vectors(
        {lay: a[is_h] for lay, a in acts.items()},
        h_acts,
        {lay: a[~is_h] for lay, a in acts.items()},
        fingerprint=lm.fingerprint,
        layer=bank.layers[0],
    )
    vectors.save(out / "vectors")


def _label_run(label_cfg: EvalConfig, lm, items: list, layers, activations: Path, ray=None) -> None:
    """The label generation (an evaluation run in ``label_cfg.out``), in this process with ``lm`` or on
    replicas of the model over Ray (``ray``). The prefill of the label generation already computes the
    states the energy models train on: they are recorded there (on the replicas, and sent back) instead
    of running the prompts through the model a second time, and appended to ``activations``."""
    from aligntax.activations.recorder import PrefillRecorder
    from aligntax.runs.distributed import replicas_of, started

    with replicas_of(ray, label_cfg.model, label_cfg.dtype) as replicas:
        # the model the states are recorded from: here, or the replicas' (its block count and fingerprint)
        source = lm if replicas is None else started(replicas)[0]
        blocks = lm.model if replicas is None else source.fingerprint["num_layers"]
        sink = (source, activations, label_cfg.system)  # each batch's states stored before its samples
        recorder = PrefillRecorder(blocks, layers, sink) if label_cfg.system is None else None
        run_eval(label_cfg, lm=lm, items=items, recorder=recorder, ray=replicas)
        if recorder is not None:
            recorder.save(source, activations, label_cfg.system)


def captured(lm, items, layers, folder: Path, cfg: ELSTrainConfig) -> dict[int, torch.Tensor]:
    """Last-prompt-token states of ``items`` (captured into ``folder``, or read back from it), one row per
    item in their order, ``{layer: [N, d]}``."""
    from aligntax.activations import capture_to_cache

    ids = [activation_id(it) for it in items]
    cache = capture_to_cache(
        lm,
        [it.prompt for it in items],
        ids,
        layers,
        folder,
        labels=[it.label for it in items],
        batch_size=cfg.batch_size,
        progress=cfg.progress,
    )
    return in_item_order(cache, items)


def training_items(cfg: ELSTrainConfig) -> tuple[list, list]:
    """The benign and the harmful prompts the energy models learn from, in training order."""
    return load_prompt_sets(cfg.benign, cfg.limit_benign), load_prompt_sets(cfg.harmful, cfg.limit_harmful)


def _training_prompts(folder: str | Path) -> list[str]:
    """The benign and harmful training prompts of ELS folder ``folder`` (its ``train_config.json``)."""
    from aligntax.config import load_config

    cfg = load_config(ELSTrainConfig, Path(folder) / "train_config.json")
    prompts = [it.prompt for part in training_items(cfg) for it in part]
    if not prompts:
        raise AligntaxError(f"{folder}: no training prompts to measure.")
    return prompts


def prompt_domain(folder: str | Path, lm) -> int:
    """The longest chat-templated prompt, in tokens of ``lm``'s tokenizer, that the energy models of ELS
    folder ``folder`` learned from (its benign and harmful training prompts): beyond it a prompt is
    outside what they have seen (the ELS option ``max_prompt_tokens``)."""
    from aligntax.activations.capture import chat_ids

    return max(chat_ids(lm, _training_prompts(folder))[1])


# The share of the training prompts inside the surprisal domain (ELS ``max_prompt_surprisal``): the cut-off
# is their 99% quantile, so one natural prompt in a hundred may lie above it (docs/RESULTS.md 3.7).
SURPRISAL_QUANTILE = 0.99


def prompt_surprisal_domain(folder: str | Path, lm, quantile: float = SURPRISAL_QUANTILE) -> float:
    """The ``quantile`` of the prompt surprisal (nats per user token under ``lm``,
    :func:`aligntax.activations.decisions.prompt_surprisal`) of the benign and harmful training prompts
    of ELS folder ``folder``: above it a prompt reads unlike anything the energy models learned from (the ELS option ``max_prompt_surprisal``),
    e.g. an optimised jailbreak suffix. The nearest rank, so the cut-off is one prompt's value."""
    from aligntax.activations.decisions import prompt_surprisal
    from aligntax.surprisal import nearest_rank

    if not 0.0 < quantile <= 1.0:
        raise AligntaxError(f"The surprisal quantile must lie in (0, 1]; got {quantile}.")
    return round(nearest_rank(prompt_surprisal(lm, _training_prompts(folder)), quantile), 4)


def in_item_order(cache, items) -> dict[int, torch.Tensor]:
    """``{layer: [N, d]}``: one row of ``cache`` per item, in the items' order."""
    order = {pid: i for i, pid in enumerate(cache.prompt_ids)}
    idx = torch.tensor([order[activation_id(it)] for it in items])
    return {layer: cache[layer][idx] for layer in cache.layers}


def judged_labels(labels_dir: Path, items) -> tuple[list[bool], torch.Tensor]:
    """Per item: refused by the judge in the label run, and its good (0) / bad (1) state label."""
    from aligntax.energy import state_labels

    judged = {(r["source"], r["id"]): r for r in read_jsonl(labels_dir / "samples.jsonl")}
    refused = [bool(judged[(it.source, it.id)]["refused"]) for it in items]
    return refused, state_labels([it.label for it in items], refused)


def training_states(folder: str | Path) -> tuple[ELSTrainConfig, dict[int, torch.Tensor], torch.Tensor]:
    """What the energy models of an ``aligntax els train`` folder were trained on, read back without the
    model: its settings, the states ``{layer: [N, d]}`` and their good/bad labels, in training order."""
    from aligntax.activations.cache import ActivationCache
    from aligntax.config import load_config

    folder = Path(folder)
    cfg = load_config(ELSTrainConfig, folder / "train_config.json")
    items = [item for part in training_items(cfg) for item in part]
    _, y = judged_labels(folder / "labels", items)
    return cfg, in_item_order(ActivationCache.load(folder / "activations"), items), y


def _train_gate(cfg: ELSTrainConfig, lm, out: Path, items, acts: dict, harmless, h_acts: dict, bank) -> None:
    """Step 5 of :func:`train_els`: the harm gate (``gate.json``), a benign-vs-harmful probe on the
    :func:`gate_candidates` layers over the training, harmless and :func:`gate_extra_items` prompts (the
    extra ones captured into ``activations_gate``), contrast pairs weighted by :func:`gate_weights`."""
    from aligntax.energy.gate import train_harm_gate

    cand = gate_candidates(bank, acts)
    extra = gate_extra_items(cfg, [*items, *harmless])
    x = {layer: [acts[layer], h_acts[layer]] for layer in cand}
    y = [it.label == "harmful" for it in items] + [it.label == "harmful" for it in harmless]
    if extra:
        g_acts = captured(lm, extra, cand, out / "activations_gate", cfg)
        for layer in cand:
            x[layer].append(g_acts[layer])
        y += [it.label == "harmful" for it in extra]
    weight = gate_weights(cfg, extra)
    gate = train_harm_gate(
        {layer: torch.cat(v) for layer, v in x.items()},
        y,
        layers=cand,
        seed=cfg.seed,
        fingerprint=lm.fingerprint,
        recall=cfg.gate_recall,
        ensemble=cfg.gate_ensemble,
        sample_weight=None if weight is None else [1.0] * (len(y) - len(extra)) + weight,
        metadata={
            "benign": [*cfg.benign, *cfg.harmless, *cfg.gate_benign],
            "harmful": [*cfg.harmful, *cfg.gate_harmful],
            **(
                {"pairs": cfg.gate_pairs, "pairs_weight": cfg.gate_pairs_weight} if weight is not None else {}
            ),
        },
    )
    gate.save(out)


def harm_basis(cfg: ELSTrainConfig, lm, out: Path, items, acts: dict, harmless, h_acts: dict):
    """The folder's :class:`~aligntax.energy.front.HarmBasis`: harmful training prompts against every
    benign-labelled one (the over-refusal look-alikes and the harmless instructions, as the gate counts
    them), and the differences of ``cfg.harm_pairs`` (captured into ``activations_pairs``)."""
    from aligntax.energy.front import compute_harm_basis, pair_states

    is_h = torch.tensor([it.label == "harmful" for it in items])
    layers = sorted(acts)
    harmful = {layer: acts[layer][is_h] for layer in layers}
    benign = {layer: torch.cat([acts[layer][~is_h], h_acts[layer]]) for layer in layers if layer in h_acts}
    pairs = None
    pair_items = load_prompt_sets(cfg.harm_pairs, None) if cfg.harm_pairs else []
    if pair_items:
        p_acts = captured(lm, pair_items, layers, out / "activations_pairs", cfg)
        pairs = {layer: pair_states(pair_items, p_acts[layer]) for layer in layers}
    return compute_harm_basis(
        {k: v for k, v in harmful.items() if k in benign},
        benign,
        pairs,
        cfg.harm_k,
        fingerprint=lm.fingerprint,
        metadata={
            "harmful": cfg.harmful,
            "benign": [*cfg.benign, *cfg.harmless],
            "pairs": list(cfg.harm_pairs),
        },
    )


def harm_basis_for_folder(
    steer: str | Path,
    lm=None,
    pairs: list[str] | None = None,
    k: int | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    dtype: str | None = None,
):
    """Compute and save the harm basis of an existing ``aligntax els train`` folder (made before it was
    part of training) from its recorded states; only the contrast pairs (and states a resumed folder
    lacks) run through the model. Returns the basis."""
    from aligntax.config import load_config
    from aligntax.models import load_model

    folder = Path(steer)
    cfg = load_config(ELSTrainConfig, folder / "train_config.json")
    cfg.progress = progress
    if pairs is not None:
        cfg.harm_pairs = list(pairs)
    if k is not None:
        cfg.harm_k = int(k)
    if batch_size is not None:
        cfg.batch_size = int(batch_size)
    if dtype is not None:
        cfg.dtype = dtype
    with run_lock(folder):  # the ELS folder's one writer
        lm = lm or load_model(cfg.model, dtype=cfg.dtype)
        items = [item for part in training_items(cfg) for item in part]
        layers = cfg.layers if cfg.layers is not None else "all"
        acts = captured(lm, items, layers, folder / "activations", cfg)
        harmless = load_prompt_sets(cfg.harmless, cfg.limit_harmless)
        h_acts = captured(lm, harmless, layers, folder / "activations_harmless", cfg)
        basis = harm_basis(cfg, lm, folder, items, acts, harmless, h_acts)
        basis.save(folder)
    return basis


def gate_candidates(bank, layers) -> list[int]:
    """The layers the harm gate chooses among: of ``layers``, those from a third of the way to the
    shallowest of the bank's three best energy layers up to it."""
    last = min(bank.top(3))
    return [layer for layer in sorted(layers) if last // 3 <= layer <= last]


def gate_items(cfg: ELSTrainConfig) -> tuple[list, list, list]:
    """The harm gate's prompts under ``cfg``, in the order training stacks their states: the training
    items (benign, then harmful), the harmless ones, and :func:`gate_extra_items`."""
    items = [item for part in training_items(cfg) for item in part]
    harmless = load_prompt_sets(cfg.harmless, cfg.limit_harmless)
    return items, harmless, gate_extra_items(cfg, [*items, *harmless])


def gate_weights(cfg: ELSTrainConfig, extra: list) -> list[float] | None:
    """Per prompt of ``extra`` (:func:`gate_extra_items`), its weight in the gate's fit: ``gate_pairs_weight``
    for the contrast pairs, 1 for the others; None without pairs (every prompt counts once)."""
    if not cfg.gate_pairs:
        return None
    if not (cfg.gate_pairs_weight > 0 and math.isfinite(cfg.gate_pairs_weight)):
        raise AligntaxError(f"gate_pairs_weight must be a positive number; got {cfg.gate_pairs_weight}.")
    pairs = {(it.source, it.id) for it in load_prompt_sets(cfg.gate_pairs)}
    return [cfg.gate_pairs_weight if (it.source, it.id) in pairs else 1.0 for it in extra]


def gate_extra_items(cfg: ELSTrainConfig, seen_items) -> list:
    """The harm gate's prompts beyond the training and harmless ones (``seen_items``): ``gate_benign`` and
    ``gate_harmful``, each sampled to its limit, then every prompt of ``gate_pairs``, without those already
    seen. A named validation split (``contrast-pairs-val``) is refused as ``gate_pairs``."""
    held_out = [
        name for name in cfg.gate_pairs if (spec := find_dataset(name)) is not None and spec.split == "val"
    ]
    if held_out:
        raise AligntaxError(
            f"gate_pairs {', '.join(held_out)}: a validation split is held out for measuring the "
            "gate (bench/gate_transfer.py); train it on the train split (contrast-pairs)."
        )
    seen = {(it.source, it.id) for it in seen_items}
    sets = [
        (cfg.gate_benign, cfg.limit_gate_benign),
        (cfg.gate_harmful, cfg.limit_gate_harmful),
        (cfg.gate_pairs, None),
    ]
    return [
        it
        for specs, limit in sets
        for spec in specs
        for it in sampled(load_prompt_sets([spec], None), limit, cfg.seed)
        if (it.source, it.id) not in seen
    ]


def _existing_bank(out: Path, ecfg, lm, n_states: int):
    from aligntax.energy import EnergyBank

    if not (out / "energy.json").is_file():
        return None
    try:
        bank = EnergyBank.load(out, expect_fingerprint=lm.fingerprint, expect_hidden_size=lm.hidden_size)
    except AligntaxError:
        return None
    same = bank.config.to_dict() == ecfg.to_dict() and bank.metadata.get("n_states", n_states) == n_states
    return bank if same else None


def _write_train_report(out: Path, bank, summary: dict) -> None:
    lines = [
        "# ELS training",
        "",
        f"- states: {summary['n_states']} ({summary['n_bad']} undesirable)",
        f"- wall time: {summary['seconds']} s ("
        + ", ".join(f"{k} {v} s" for k, v in summary["step_seconds"].items())
        + ")",
        "",
        "Layers ranked by validation accuracy"
        + (f" (mean over {bank.config.folds} folds)" if bank.config.folds > 1 else "")
        + ":",
        "",
        "| rank | layer | val acc | val AUROC | median norm |",
        "|---:|---:|---:|---:|---:|",
    ]
    for rank, layer in enumerate(bank.layers, start=1):
        m = bank.metrics(layer)
        norm = bank.median_norm(layer)
        lines.append(
            f"| {rank} | {layer} | {m.get('val_acc', m.get('acc', float('nan'))):.3f} | "
            f"{m.get('val_auroc', m.get('auroc', float('nan'))):.3f} | "
            f"{norm if norm is None else round(norm, 1)} |"
        )
    lines += ["", "![energy histograms](energy_histograms.png)", ""]
    write_text_atomic(out / "report.md", "\n".join(lines))
