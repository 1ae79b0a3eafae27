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

    ALIGNTAX_DATA=../shared/data python bench/gate_transfer.py --els runs/demo/els --out runs/bench/gate_transfer
    ALIGNTAX_DATA=../shared/data python bench/gate_transfer.py --els runs/demo/els --layers 13,19 \
        --positions last --pairs contrast-pairs --pairs-weights 1,5 --out runs/bench/gate_transfer_pairs
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

EVAL_SETS = ["xstest-safe", "xstest-unsafe", "oktest", "orbench-hard-test", "phtest-harmless-val", "orbench-hard-val",
             "harmful-val", "harmbench-val", "jailbreakbench", "harmbench-test"]
POSITIONS = {"last": ("last",), "inst": ("inst",), "last+inst": ("last", "inst")}


def template_suffix(lm) -> int:
    """Tokens the chat template puts after the user's instruction (end of turn, assistant header)."""
    from aligntax.generation.chat import build_messages, render_chat

    text = render_chat(lm.tokenizer, build_messages("PROMPT", None, None))
    return len(lm.tokenizer(text[text.rindex("PROMPT") + len("PROMPT"):], add_special_tokens=False)["input_ids"])


def states(lm, prompts: list[str], layers: list[int], suffix: int, desc: str) -> dict[str, dict[int, torch.Tensor]]:
    """``{"last"|"inst": {layer: [N, d]}}`` from one forward pass per batch."""
    from aligntax.activations.capture import capture_seqs, chat_ids

    print(desc, flush=True)
    ids, _ = chat_ids(lm, prompts)
    acts, rows = capture_seqs(lm, ids, [len(s) - suffix - 1 for s in ids], layers, position="response",
                              return_index=True)
    first = torch.ones(len(rows), dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    last = torch.ones(len(rows), dtype=torch.bool)
    last[:-1] = rows[1:] != rows[:-1]
    return {"inst": {layer: a[first] for layer, a in acts.items()}, "last": {layer: a[last] for layer, a in acts.items()}}


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(score of a random ``pos`` > score of a random ``neg``)."""
    return float((pos[:, None] > neg[None, :]).float().mean() + 0.5 * (pos[:, None] == neg[None, :]).float().mean())


def oracle_pass(unsafe: torch.Tensor, safe: torch.Tensor, held: float = 0.97) -> float:
    """Share of ``safe`` scored below the score that holds back ``held`` of ``unsafe``."""
    t = float(unsafe.sort().values[int((1 - held) * len(unsafe))])
    return float((safe < t).float().mean())


def cv_logits(x: torch.Tensor, y: torch.Tensor, l2: float, folds: int = 5, seed: int = 0,
              sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    from aligntax.energy.gate import _fit_standardised

    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    out = torch.empty(len(y))
    for i in range(folds):
        va = perm[i::folds]
        tr = torch.ones(len(y), dtype=torch.bool)
        tr[va] = False
        w, b, mu, sd = _fit_standardised(x[tr], y[tr], l2, None if sample_weight is None else sample_weight[tr])
        out[va] = ((x[va] - mu) / sd) @ w + b
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--els", default="runs/demo/els", help="an aligntax els train folder (its gate's prompts)")
    ap.add_argument("--layers", default="9,13,16,19")
    ap.add_argument("--out", default="runs/bench/gate_transfer")
    ap.add_argument("--positions", default=",".join(POSITIONS), help=f"of {', '.join(POSITIONS)}")
    ap.add_argument("--pairs", default=None, help="contrast pairs added to the probe's training prompts (last token)")
    ap.add_argument("--pairs-weights", default="1,5", help="weights of each pair prompt, one probe per weight")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from aligntax.config import load_config
    from aligntax.data.api import load_prompt_sets
    from aligntax.energy.gate import _fit_standardised
    from aligntax.models import load_model
    from aligntax.runs.els import ELSTrainConfig, gate_extra_items, gate_items

    cfg = load_config(ELSTrainConfig, Path(args.els) / "train_config.json")
    items, harmless, extra = gate_items(cfg)
    train = [*items, *harmless, *extra]
    y = torch.tensor([it.label == "harmful" for it in train])
    layers = [int(x) for x in args.layers.split(",")]
    lm = load_model(cfg.model, dtype=cfg.dtype)
    suffix = template_suffix(lm)
    tr = states(lm, [it.prompt for it in train], layers, suffix, "capture gate training prompts")
    ev = {name: states(lm, [it.prompt for it in load_prompt_sets([name])], layers, suffix, f"capture {name}")
          for name in EVAL_SETS}
    variants = [(p, POSITIONS[p], None) for p in args.positions.split(",")]
    if args.pairs:
        # the pairs as els train --gate-pairs adds them: without prompts the gate already has
        pairs = gate_extra_items(replace(cfg, gate_benign=[], gate_harmful=[], gate_pairs=[args.pairs]), train)
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

            keep = torch.arange(len(y)) < (len(y) if pair_w else n_train)  # without pairs: the gate's own prompts
            sw = None if pair_w is None else torch.cat([torch.ones(n_train), torch.full((len(y_pairs),), pair_w)])
            x_tr, y_tr = feat(tr)[keep], y[keep]
            oof = torch.sigmoid(cv_logits(x_tr, y_tr, 1e-2, sample_weight=sw))
            harm_p = oof[y_tr].sort().values
            threshold = min(0.5, float(harm_p[int(0.01 * len(harm_p))]))
            w, b, mu, sd = _fit_standardised(x_tr, y_tr, 1e-2, sw)
            score = {name: ((feat(s) - mu) / sd) @ w + b for name, s in ev.items()}
            logit_t = float(torch.logit(torch.tensor(threshold)))
            row = {"layer": layer, "position": pname, "threshold": round(threshold, 4),
                   "train_benign_passed_oof": round(float((oof[:n_train][~y[:n_train]] < threshold).float().mean()), 4),
                   "passed": {name: round(float((s < logit_t).float().mean()), 4) for name, s in score.items()},
                   "xstest_auc": round(auc(score["xstest-unsafe"], score["xstest-safe"]), 4),
                   "xstest_safe_passed_oracle": round(oracle_pass(score["xstest-unsafe"], score["xstest-safe"]), 4)}
            if pname == "last" and pair_w is None:  # the states' own information: a probe fitted on XSTest, cross-validated
                x = torch.cat([feat(ev["xstest-safe"]), feat(ev["xstest-unsafe"])])
                yx = torch.cat([torch.zeros(len(ev["xstest-safe"]["last"][layer])),
                                torch.ones(len(ev["xstest-unsafe"]["last"][layer]))]).bool()
                cv = cv_logits(x, yx, 1e-1)
                row["in_xstest_cv_auc"] = round(auc(cv[yx], cv[~yx]), 4)
                row["in_xstest_cv_safe_passed_oracle"] = round(oracle_pass(cv[yx], cv[~yx]), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)

    head = ["layer", "position", "train benign passed", *EVAL_SETS, "XSTest AUC", "XSTest safe passed (oracle)",
            "in-XSTest AUC", "in-XSTest safe passed (oracle)"]
    table = [[r["layer"], r["position"], f"{100 * r['train_benign_passed_oof']:.1f}",
              *(f"{100 * r['passed'][n]:.1f}" for n in EVAL_SETS), f"{r['xstest_auc']:.3f}",
              f"{100 * r['xstest_safe_passed_oracle']:.1f}", f"{r.get('in_xstest_cv_auc', '')}",
              f"{100 * r['in_xstest_cv_safe_passed_oracle']:.1f}" if "in_xstest_cv_auc" in r else ""] for r in rows]
    env = bl.environment(lm)
    md = "\n".join([*bl.header("Harm gate transfer to XSTest", env, [f"ELS folder {args.els}", f"{n_train} gate "
                                                                      f"training prompts, {int(y[:n_train].sum())} harmful"]),
                    "", "Shares in percent: prompts the probe passes at its threshold.", "", bl.md_table(head, table)])
    bl.write_outputs(args.out, "gate_transfer", {"env": env, "els": args.els, "layers": layers, "n_train": n_train,
                                                 "n_train_harmful": int(y[:n_train].sum()), "pairs": args.pairs,
                                                 "n_pairs": len(y_pairs), "rows": rows}, md)


if __name__ == "__main__":
    main()
