"""Can a harm gate trained on the allowed training prompts tell XSTest's safe prompts from its unsafe ones?

The ELS harm gate (``aligntax els train``) is a logistic probe of p(harmful) on the residual stream at
the last prompt token, trained on the training splits' prompt labels. This script refits the same probe
(standardised features, L2 1e-2, 5 folds, threshold at 99% out-of-fold recall of the harmful prompts)
on the same prompts of an ELS folder, at two prompt positions and their concatenation:

- ``last``: the last prompt token (what the gate reads; after the chat template's assistant header);
- ``inst``: the last token of the user's instruction, before the template's closing tokens (where
  Zhao et al. 2025 find harmfulness encoded apart from refusal);

and reports, per layer and position, the share of each evaluation set the probe passes (p below its
threshold: a row the gate would let ELS steer). Two diagnostics on XSTest (diagnostics only; nothing is
selected on them): the AUC of the probe's score between XSTest unsafe and safe prompts, and the share of
XSTest safe passed at the threshold that would hold back 97% of XSTest unsafe (an oracle threshold);
and, as an upper bound on what the states hold, the same two numbers for a probe fitted on XSTest itself
by 5-fold cross-validation.

With ``--pairs`` (e.g. the shipped ``contrast-pairs``: benign and harmful prompts sharing a sensitive word,
written for aligntax) the probe at the last prompt token is also refitted with those prompts added to its
training prompts, each weighted by each of ``--pairs-weights`` (what ``aligntax els train --gate-pairs``
does).

With ``--pairs-limit`` (e.g. ``0,104,250,500,all``) it draws a learning curve instead: the harm gate itself
(``train_harm_gate`` with the folder's settings: recall target, seed; at the folder's gate layer, or
``--curve-layers candidates``: picking among the candidate layers as ``els train`` does) refitted on the
gate's own training states, read back from the folder's activation caches, plus that many pairs of
``--pairs`` weighted ``gate_pairs_weight``. The pairs are drawn stratified by their ``kind`` (each kind's
pairs shuffled with ``--seed``; every smaller draw is part of the larger ones). Per draw: the layer the
gate picks, its threshold, the XSTest AUC (unsafe vs safe) and the shares of XSTest safe and unsafe and
of the held-out pairs (``--curve-val``, e.g. ``contrast-pairs-val``) it passes at that threshold. States
of the pairs and the evaluation prompts are cached under ``--out``.

    ALIGNTAX_DATA=../shared/data python bench/gate_transfer.py --els runs/demo/els --out runs/bench/gate_transfer
    ALIGNTAX_DATA=../shared/data python bench/gate_transfer.py --els runs/demo/els --layers 13,19 \
        --positions last --pairs contrast-pairs --pairs-weights 1,5 --out runs/bench/gate_transfer_pairs
    ALIGNTAX_DATA=../shared/data python bench/gate_transfer.py --els runs/demo/els --pairs contrast-pairs \
        --pairs-limit 0,104,250,500,all --out runs/bench/gate_pairs_curve
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

EVAL_SETS = [
    "xstest-safe",
    "xstest-unsafe",
    "oktest",
    "orbench-hard-test",
    "phtest-harmless-val",
    "orbench-hard-val",
    "harmful-val",
    "harmbench-val",
    "jailbreakbench",
    "harmbench-test",
]
POSITIONS = {"last": ("last",), "inst": ("inst",), "last+inst": ("last", "inst")}


def template_suffix(lm) -> int:
    """Tokens the chat template puts after the user's instruction (end of turn, assistant header)."""
    from aligntax.generation.chat import build_messages, render_chat

    text = render_chat(lm.tokenizer, build_messages("PROMPT", None, None))
    return len(
        lm.tokenizer(text[text.rindex("PROMPT") + len("PROMPT") :], add_special_tokens=False)["input_ids"]
    )


def states(
    lm, prompts: list[str], layers: list[int], suffix: int, desc: str
) -> dict[str, dict[int, torch.Tensor]]:
    """``{"last"|"inst": {layer: [N, d]}}`` from one forward pass per batch."""
    from aligntax.activations.capture import capture_seqs, chat_ids

    print(desc, flush=True)
    ids, _ = chat_ids(lm, prompts)
    acts, rows = capture_seqs(
        lm, ids, [len(s) - suffix - 1 for s in ids], layers, position="response", return_index=True
    )
    first = torch.ones(len(rows), dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    last = torch.ones(len(rows), dtype=torch.bool)
    last[:-1] = rows[1:] != rows[:-1]
    return {
        "inst": {layer: a[first] for layer, a in acts.items()},
        "last": {layer: a[last] for layer, a in acts.items()},
    }


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(score of a random ``pos`` > score of a random ``neg``)."""
    return float(
        (pos[:, None] > neg[None, :]).float().mean() + 0.5 * (pos[:, None] == neg[None, :]).float().mean()
    )


def oracle_pass(unsafe: torch.Tensor, safe: torch.Tensor, held: float = 0.97) -> float:
    """Share of ``safe`` scored below the score that holds back ``held`` of ``unsafe``."""
    t = float(unsafe.sort().values[int((1 - held) * len(unsafe))])
    return float((safe < t).float().mean())


def cv_logits(
    x: torch.Tensor,
    y: torch.Tensor,
    l2: float,
    folds: int = 5,
    seed: int = 0,
    sample_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    from aligntax.energy.gate import fit_standardised

    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    out = torch.empty(len(y))
    for i in range(folds):
        va = perm[i::folds]
        tr = torch.ones(len(y), dtype=torch.bool)
        tr[va] = False
        w, b, mu, sd = fit_standardised(
            x[tr], y[tr], l2, None if sample_weight is None else sample_weight[tr]
        )
        out[va] = ((x[va] - mu) / sd) @ w + b
    return out


def stratified_order(kinds: dict[str, str], seed: int) -> list[str]:
    """The pairs of ``kinds`` (pair -> kind) in an order whose every prefix holds each kind in proportion:
    each kind's pairs shuffled (seeded), then merged by their rank's share of their kind."""
    by_kind: dict[str, list[str]] = {}
    for pair, kind in kinds.items():
        by_kind.setdefault(kind, []).append(pair)
    keyed = []
    for kind, pairs in sorted(by_kind.items()):
        pairs = sorted(pairs)
        random.Random(f"{seed}:{kind}").shuffle(pairs)
        keyed += [((rank + 0.5) / len(pairs), kind, pair) for rank, pair in enumerate(pairs)]
    return [pair for _, _, pair in sorted(keyed)]


def pair_kinds(name: str, items: list) -> dict[str, str]:
    """Pair (category) -> kind for the items of the named pairs file (its ``kind`` column; "none" without)."""
    from aligntax.data.registry import dataset_path

    kind = {}
    for line in dataset_path(name).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            kind[row["id"]] = row.get("kind") or "none"
    return {it.category: kind.get(it.id, "none") for it in items}


def learning_curve(args, cfg, lm) -> None:
    """The gate refitted with growing draws of ``args.pairs`` (module docstring)."""
    from aligntax.data.api import load_prompt_sets
    from aligntax.energy import EnergyBank
    from aligntax.energy.gate import HarmGate, train_harm_gate
    from aligntax.runs.els_train import captured, gate_candidates, gate_extra_items, gate_items

    els, out = Path(args.els), Path(args.out)
    base = replace(cfg, gate_pairs=[], progress=True)
    items, harmless, extra = gate_items(base)
    if args.curve_layers == "candidates":
        cand = gate_candidates(
            EnergyBank.load(els), cfg.layers if cfg.layers is not None else range(lm.num_layers)
        )
    elif args.curve_layers == "gate":
        cand = HarmGate.load(els).layers
    else:
        cand = [int(x) for x in args.curve_layers.split(",")]
    print(
        f"gate: {len(items)} training, {len(harmless)} harmless, {len(extra)} extra prompts; layers {cand}",
        flush=True,
    )
    parts = [
        captured(lm, items, cand, els / "activations", base),
        captured(lm, harmless, cand, els / "activations_harmless", base),
    ]
    if extra:
        parts.append(captured(lm, extra, cand, els / "activations_gate", base))
    base_x = {layer: torch.cat([p[layer] for p in parts]) for layer in cand}
    base_y = [it.label == "harmful" for it in [*items, *harmless, *extra]]
    pairs = gate_extra_items(
        replace(cfg, gate_benign=[], gate_harmful=[], gate_pairs=[args.pairs]), [*items, *harmless, *extra]
    )
    pair_x = captured(lm, pairs, cand, out / "activations", base)
    kinds = pair_kinds(args.pairs, pairs)
    order = stratified_order(kinds, args.seed)
    rank = {pair: i for i, pair in enumerate(order)}
    sets = {
        name: load_prompt_sets([name])
        for name in ["xstest-safe", "xstest-unsafe", *([args.curve_val] if args.curve_val else [])]
    }
    ev = {name: captured(lm, its, cand, out / "activations", base) for name, its in sets.items()}
    weight = float(args.pairs_weights.split(",")[-1]) if args.pairs_weights_given else cfg.gate_pairs_weight
    limits = [len(order) if x.strip() == "all" else int(x) for x in args.pairs_limit.split(",")]

    rows = []
    for n in limits:
        n = min(n, len(order))
        take = torch.tensor([rank[it.category] < n for it in pairs])
        x = {layer: torch.cat([base_x[layer], pair_x[layer][take]]) for layer in cand}
        y = base_y + [it.label == "harmful" for it, t in zip(pairs, take.tolist(), strict=True) if t]
        sw = [1.0] * len(base_y) + [weight] * int(take.sum()) if n else None
        gate = train_harm_gate(
            x,
            y,
            layers=cand,
            seed=cfg.seed,
            recall=cfg.gate_recall,
            ensemble=cfg.gate_ensemble,
            sample_weight=sw,
        )
        logit = {name: gate.logit(gate.stack(s)) for name, s in ev.items()}
        t = float(torch.logit(torch.tensor(gate.threshold)))

        def passed(name: str, label: str | None = None, logit=logit, t=t) -> float:
            keep = torch.tensor([label is None or it.label == label for it in sets[name]])
            return round(float((logit[name][keep] < t).float().mean()), 4)

        row = {
            "pairs": n,
            "kinds": len({kinds[it.category] for it, k in zip(pairs, take.tolist(), strict=True) if k}),
            "layers": gate.layers,
            "threshold": round(gate.threshold, 4),
            "xstest_auc": round(auc(logit["xstest-unsafe"], logit["xstest-safe"]), 4),
            "xstest_safe_passed": passed("xstest-safe"),
            "xstest_unsafe_passed": passed("xstest-unsafe"),
        }
        if args.curve_val:
            lab = torch.tensor([it.label == "harmful" for it in sets[args.curve_val]])
            row |= {
                "val_benign_passed": passed(args.curve_val, "benign"),
                "val_harmful_passed": passed(args.curve_val, "harmful"),
                "val_auc": round(auc(logit[args.curve_val][lab], logit[args.curve_val][~lab]), 4),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)

    head = [
        "train pairs",
        "kinds",
        "gate layer",
        "threshold",
        "XSTest AUC unsafe vs safe",
        "XSTest safe passed",
        "XSTest unsafe passed",
        *(
            [f"{args.curve_val} benign passed", f"{args.curve_val} harmful passed", f"{args.curve_val} AUC"]
            if args.curve_val
            else []
        ),
    ]
    table = [
        [
            r["pairs"],
            r["kinds"],
            ",".join(map(str, r["layers"])),
            f"{r['threshold']:.3f}",
            f"{r['xstest_auc']:.3f}",
            f"{100 * r['xstest_safe_passed']:.1f}",
            f"{100 * r['xstest_unsafe_passed']:.1f}",
            *(
                [
                    f"{100 * r['val_benign_passed']:.1f}",
                    f"{100 * r['val_harmful_passed']:.1f}",
                    f"{r['val_auc']:.3f}",
                ]
                if args.curve_val
                else []
            ),
        ]
        for r in rows
    ]
    env = bl.environment(lm)
    md = "\n".join(
        [
            *bl.header(
                "Harm gate learning curve over contrast pairs",
                env,
                [
                    f"ELS folder {args.els}",
                    f"{len(base_y)} gate prompts besides the pairs ({sum(base_y)} harmful)",
                    f"pairs {args.pairs}: {len(order)}, weight {weight}, "
                    f"drawn stratified by kind, seed {args.seed}",
                ],
            ),
            "",
            "Shares in percent: prompts the gate passes at its threshold.",
            "",
            bl.md_table(head, table),
        ]
    )
    bl.write_outputs(
        args.out,
        "gate_pairs_curve",
        {
            "env": env,
            "els": args.els,
            "pairs": args.pairs,
            "n_pairs": len(order),
            "weight": weight,
            "seed": args.seed,
            "candidates": cand,
            "n_base": len(base_y),
            "n_base_harmful": sum(base_y),
            "rows": rows,
        },
        md,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--els", default="runs/demo/els", help="an aligntax els train folder (its gate's prompts)"
    )
    ap.add_argument("--layers", default="9,13,16,19")
    ap.add_argument("--out", default="runs/bench/gate_transfer")
    ap.add_argument("--positions", default=",".join(POSITIONS), help=f"of {', '.join(POSITIONS)}")
    ap.add_argument(
        "--pairs", default=None, help="contrast pairs added to the probe's training prompts (last token)"
    )
    ap.add_argument(
        "--pairs-weights", default="1,5", help="weights of each pair prompt, one probe per weight"
    )
    ap.add_argument(
        "--pairs-limit", default=None, help="learning curve: numbers of pairs, e.g. 0,104,250,500,all"
    )
    ap.add_argument(
        "--curve-val", default="contrast-pairs-val", help="held-out pairs scored on the curve ('': none)"
    )
    ap.add_argument("--seed", type=int, default=0, help="draws of the learning curve")
    ap.add_argument(
        "--curve-layers",
        default="gate",
        help="the curve's gate layers: 'gate' (the folder's gate's, "
        "held fixed), 'candidates' (the gate picks among them, as els train does) or a list",
    )
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    args.pairs_weights_given = "--pairs-weights" in sys.argv
    torch.set_num_threads(args.threads)

    from aligntax.config import load_config
    from aligntax.data.api import load_prompt_sets
    from aligntax.energy.gate import fit_standardised
    from aligntax.models import load_model
    from aligntax.runs.els_train import ELSTrainConfig, gate_extra_items, gate_items

    cfg = load_config(ELSTrainConfig, Path(args.els) / "train_config.json")
    if args.pairs_limit:
        if not args.pairs:
            ap.error("--pairs-limit needs --pairs")
        learning_curve(args, cfg, load_model(cfg.model, dtype=cfg.dtype))
        return
    items, harmless, extra = gate_items(cfg)
    train = [*items, *harmless, *extra]
    y = torch.tensor([it.label == "harmful" for it in train])
    layers = [int(x) for x in args.layers.split(",")]
    lm = load_model(cfg.model, dtype=cfg.dtype)
    suffix = template_suffix(lm)
    tr = states(lm, [it.prompt for it in train], layers, suffix, "capture gate training prompts")
    ev = {
        name: states(lm, [it.prompt for it in load_prompt_sets([name])], layers, suffix, f"capture {name}")
        for name in EVAL_SETS
    }
    variants = [(p, POSITIONS[p], None) for p in args.positions.split(",")]
    if args.pairs:
        # the pairs as els train --gate-pairs adds them: without prompts the gate already has
        pairs = gate_extra_items(
            replace(cfg, gate_benign=[], gate_harmful=[], gate_pairs=[args.pairs]), train
        )
        pair_states = states(lm, [it.prompt for it in pairs], layers, suffix, f"capture {args.pairs}")
        tr = {p: {layer: torch.cat([tr[p][layer], pair_states[p][layer]]) for layer in layers} for p in tr}
        y_pairs = torch.tensor([it.label == "harmful" for it in pairs])
        variants += [(f"last, {args.pairs} x{w}", ("last",), float(w)) for w in args.pairs_weights.split(",")]
    else:
        y_pairs = torch.zeros(0, dtype=torch.bool)
    n_train = len(y)
    y = torch.cat([y, y_pairs])

    rows = []
    for layer in layers:
        for pname, parts, pair_w in variants:

            def feat(s: dict, parts=parts, layer=layer) -> torch.Tensor:
                return torch.cat([s[p][layer] for p in parts], -1)

            keep = torch.arange(len(y)) < (
                len(y) if pair_w else n_train
            )  # without pairs: the gate's own prompts
            sw = (
                None
                if pair_w is None
                else torch.cat([torch.ones(n_train), torch.full((len(y_pairs),), pair_w)])
            )
            x_tr, y_tr = feat(tr)[keep], y[keep]
            oof = torch.sigmoid(cv_logits(x_tr, y_tr, 1e-2, sample_weight=sw))
            harm_p = oof[y_tr].sort().values
            threshold = min(0.5, float(harm_p[int(0.01 * len(harm_p))]))
            w, b, mu, sd = fit_standardised(x_tr, y_tr, 1e-2, sw)
            score = {name: ((feat(s) - mu) / sd) @ w + b for name, s in ev.items()}
            logit_t = float(torch.logit(torch.tensor(threshold)))
            row = {
                "layer": layer,
                "position": pname,
                "threshold": round(threshold, 4),
                "train_benign_passed_oof": round(
                    float((oof[:n_train][~y[:n_train]] < threshold).float().mean()), 4
                ),
                "passed": {name: round(float((s < logit_t).float().mean()), 4) for name, s in score.items()},
                "xstest_auc": round(auc(score["xstest-unsafe"], score["xstest-safe"]), 4),
                "xstest_safe_passed_oracle": round(
                    oracle_pass(score["xstest-unsafe"], score["xstest-safe"]), 4
                ),
            }
            if (
                pname == "last" and pair_w is None
            ):  # the states' own information: a probe fitted on XSTest, cross-validated
                x = torch.cat([feat(ev["xstest-safe"]), feat(ev["xstest-unsafe"])])
                yx = torch.cat(
                    [
                        torch.zeros(len(ev["xstest-safe"]["last"][layer])),
                        torch.ones(len(ev["xstest-unsafe"]["last"][layer])),
                    ]
                ).bool()
                cv = cv_logits(x, yx, 1e-1)
                row["in_xstest_cv_auc"] = round(auc(cv[yx], cv[~yx]), 4)
                row["in_xstest_cv_safe_passed_oracle"] = round(oracle_pass(cv[yx], cv[~yx]), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)

    head = [
        "layer",
        "position",
        "train benign passed",
        *EVAL_SETS,
        "XSTest AUC",
        "XSTest safe passed (oracle)",
        "in-XSTest AUC",
        "in-XSTest safe passed (oracle)",
    ]
    table = [
        [
            r["layer"],
            r["position"],
            f"{100 * r['train_benign_passed_oof']:.1f}",
            *(f"{100 * r['passed'][n]:.1f}" for n in EVAL_SETS),
            f"{r['xstest_auc']:.3f}",
            f"{100 * r['xstest_safe_passed_oracle']:.1f}",
            f"{r.get('in_xstest_cv_auc', '')}",
            f"{100 * r['in_xstest_cv_safe_passed_oracle']:.1f}" if "in_xstest_cv_auc" in r else "",
        ]
        for r in rows
    ]
    env = bl.environment(lm)
    md = "\n".join(
        [
            *bl.header(
                "Harm gate transfer to XSTest",
                env,
                [
                    f"ELS folder {args.els}",
                    f"{n_train} gate training prompts, {int(y[:n_train].sum())} harmful",
                ],
            ),
            "",
            "Shares in percent: prompts the probe passes at its threshold.",
            "",
            bl.md_table(head, table),
        ]
    )
    bl.write_outputs(
        args.out,
        "gate_transfer",
        {
            "env": env,
            "els": args.els,
            "layers": layers,
            "n_train": n_train,
            "n_train_harmful": int(y[:n_train].sum()),
            "pairs": args.pairs,
            "n_pairs": len(y_pairs),
            "rows": rows,
        },
        md,
    )


if __name__ == "__main__":
    main()
