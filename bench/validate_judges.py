"""Validate the refusal judges on the 2,250 human-labelled XSTest completions (5 models x 450 prompts).

For every response judge it reports accuracy and F1 (refusal = full OR partial refusal) per model and
the mean over models. The keyword judges need no training, so their numbers are plain per-model
scores. The classifier is evaluated leave-one-model-out (LOMO): its head is trained on four models'
completions and tested on the fifth. Two stricter classifier rows are also reported:

* nested l2: the L2 strength is picked inside each training fold (inner LOMO over the 4 training
  models) instead of being the shipped, LOMO-chosen value;
* LOMO + unseen prompts: the test model's completions are additionally split into 5 prompt folds and
  the head never sees those prompts (answered by other models) in training.

``--ship`` then trains the final head on all 2,250 completions and writes it, with the LOMO metrics,
to src/aligntax/resources/judges/. ``--write-docs`` puts the table into docs/judges.md.

    python bench/validate_judges.py --threads 2 --write-docs            # measure, update the docs
    python bench/validate_judges.py --threads 2 --ship --write-docs     # ... and retrain the shipped head
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "judges.md"
BEGIN, END = "<!-- BEGIN LOMO TABLE -->", "<!-- END LOMO TABLE -->"
L2_GRID = (0.01, 0.03, 0.05, 0.1, 0.3)


def per_model(models, model_idx, pred, gold) -> dict:
    from aligntax.judges.train import binary_metrics

    out = {}
    for k, m in enumerate(models):
        sel = model_idx == k
        out[m] = binary_metrics(pred[sel], gold[sel])
    out["mean"] = {"accuracy": sum(out[m]["accuracy"] for m in models) / len(models),
                   "f1": sum(out[m]["f1"] for m in models) / len(models)}
    return out


def lomo_scores(x, y, model_idx, n_models, cfg, prompt_fold=None):
    """Held-out refusal probabilities: each model's rows scored by a head trained on the other models
    (and, with ``prompt_fold``, on none of the test row's prompt fold either)."""
    from aligntax.judges.train import fit_head, predict_proba

    probs = torch.zeros(len(y))
    for k in range(n_models):
        test = model_idx == k
        if prompt_fold is None:
            probs[test] = predict_proba(fit_head(x[~test], y[~test], cfg), x[test])
            continue
        for f in range(int(prompt_fold.max()) + 1):
            tr = (~test) & (prompt_fold != f)
            te = test & (prompt_fold == f)
            if te.any():
                probs[te] = predict_proba(fit_head(x[tr], y[tr], cfg), x[te])
    return probs


def nested_lomo_scores(x, y, model_idx, n_models, base_cfg):
    """LOMO where each outer fold picks l2 by inner LOMO accuracy over its 4 training models."""
    from dataclasses import replace

    from aligntax.judges.train import fit_head, predict_proba

    probs = torch.zeros(len(y))
    chosen = []
    for k in range(n_models):
        test = model_idx == k
        inner = [j for j in range(n_models) if j != k]
        best = None
        for l2 in L2_GRID:
            cfg = replace(base_cfg, l2=l2)
            accs = []
            for j in inner:
                tr = (~test) & (model_idx != j)
                te = model_idx == j
                accs.append(float(((predict_proba(fit_head(x[tr], y[tr], cfg), x[te]) >= 0.5) == y[te].bool())
                                  .float().mean()))
            score = sum(accs) / len(accs)
            if best is None or score > best[0]:
                best = (score, l2)
        chosen.append(best[1])
        head = fit_head(x[~test], y[~test], replace(base_cfg, l2=best[1]))
        probs[test] = predict_proba(head, x[test])
    return probs, chosen


def markdown_table(results: dict[str, dict], models: list[str]) -> str:
    head = "| judge | " + " | ".join(models) + " | **mean acc** | **mean F1** |"
    sep = "|---|" + "---|" * len(models) + "---|---|"
    lines = [head, sep]
    for name, res in results.items():
        cells = [f"{res[m]['accuracy']:.3f} / {res[m]['f1']:.3f}" for m in models]
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | **{res['mean']['accuracy']:.3f}** | **{res['mean']['f1']:.3f}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="shared data folder (default: ALIGNTAX_DATA / ../shared/data)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--emb-cache", default=None,
                    help="safetensors file to cache the response embeddings in (speeds up reruns)")
    ap.add_argument("--ship", action="store_true", help="train the final head on all rows and write the resources")
    ap.add_argument("--out-dir", default=None, help="where --ship writes (default: the package resources)")
    ap.add_argument("--llm", action="store_true", help="also score the llm judge (needs ALIGNTAX_JUDGE_* env)")
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table block in {DOCS}")
    ap.add_argument("--skip-strict", action="store_true", help="skip the nested-l2 and unseen-prompt rows")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from aligntax.judges import KeywordJudge, PrefixJudge
    from aligntax.judges.classifier import (
        DEFAULT_FEATURE_SPEC,
        DEFAULT_HEAD,
        DEFAULT_SHORT_REFUSAL_FLOOR,
        DEFAULT_THRESHOLD,
        RESOURCE_DIR,
        apply_short_refusal_floor,
        save_classifier,
    )
    from aligntax.judges.embed import get_encoder
    from aligntax.judges.features import assemble_features, embed_views, spec_views
    from aligntax.judges.train import fit_head, predict_proba
    from aligntax.judges.xstest import load_xstest_labeled, xstest_dir

    t0 = time.time()
    rows = load_xstest_labeled(args.data)
    models = sorted({r.model for r in rows})
    model_idx = torch.tensor([models.index(r.model) for r in rows])
    gold = torch.tensor([r.refused for r in rows])
    prompts = [r.prompt for r in rows]
    responses = [r.completion for r in rows]
    prompt_fold = torch.tensor([int(hashlib.sha1(p.encode()).hexdigest(), 16) % 5 for p in prompts])
    print(f"{len(rows)} labelled completions from {xstest_dir(args.data)}; models: {', '.join(models)}; "
          f"refusal rate {gold.float().mean():.3f}", file=sys.stderr)

    results: dict[str, dict] = {}
    for label, judge in [("keyword (default phrases, anywhere)", KeywordJudge()),
                         ("keyword (GCG test_prefixes, anywhere)", KeywordJudge("gcg")),
                         ("prefix (default openings)", PrefixJudge()),
                         ("prefix (GCG test_prefixes)", PrefixJudge("gcg"))]:
        pred = torch.tensor([v.refused for v in judge.judge(prompts, responses)])
        results[label] = per_model(models, model_idx, pred, gold)

    # Classifier: embed once, then train/test heads on the feature matrix.
    spec = DEFAULT_FEATURE_SPEC
    views = spec_views(spec)
    emb = None
    if args.emb_cache and Path(args.emb_cache).is_file():
        from safetensors.torch import load_file

        cached = load_file(args.emb_cache)
        if all(v in cached and cached[v].shape[0] == len(rows) for v in views):
            emb = {v: cached[v] for v in views}
    if emb is None:
        t = time.time()
        emb = embed_views(get_encoder(), prompts, responses, views, progress=True)
        print(f"embedded {len(rows)} x {len(views)} views in {time.time() - t:.0f}s", file=sys.stderr)
        if args.emb_cache:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in emb.items()}, args.emb_cache)
    x = assemble_features(spec, emb, responses, prompts)
    y = gold.float()
    def verdicts(probs):
        return apply_short_refusal_floor(probs, responses, DEFAULT_SHORT_REFUSAL_FLOOR) >= DEFAULT_THRESHOLD

    probs = lomo_scores(x, y, model_idx, len(models), DEFAULT_HEAD)
    cls_name = f"**classifier** (LOMO; {DEFAULT_HEAD.kind}, l2={DEFAULT_HEAD.l2:g}, + short-refusal rule)"
    results[cls_name] = per_model(models, model_idx, verdicts(probs), gold)
    results["classifier head alone (LOMO, rule off)"] = per_model(models, model_idx, probs >= DEFAULT_THRESHOLD,
                                                                  gold)
    if not args.skip_strict:
        probs_n, chosen = nested_lomo_scores(x, y, model_idx, len(models), DEFAULT_HEAD)
        results[f"classifier (LOMO, nested l2 choice: {', '.join(f'{c:g}' for c in chosen)})"] = per_model(
            models, model_idx, verdicts(probs_n), gold)
        probs_p = lomo_scores(x, y, model_idx, len(models), DEFAULT_HEAD, prompt_fold=prompt_fold)
        results["classifier (LOMO + unseen prompts)"] = per_model(models, model_idx, verdicts(probs_p), gold)

    if args.llm:
        from aligntax.judges import get_judge

        judge = get_judge("llm")
        pred = torch.tensor([v.refused for v in judge.judge(prompts, responses)])
        results[f"llm ({judge.model})"] = per_model(models, model_idx, pred, gold)

    if args.ship:
        head = fit_head(x, y, DEFAULT_HEAD)
        train_acc = float((verdicts(predict_proba(head, x)) == gold).float().mean())
        lomo = results[cls_name]
        extra = {
            "training": {
                "data": "XSTest v2 human-labelled model completions (Röttger et al. 2024), 5 models x 450 prompts",
                "files": sorted(p.name for p in xstest_dir(args.data).glob("*.csv")),
                "label": "refused = final_label in {2_full_refusal, 3_partial_refusal}",
                "n": len(rows), "n_refused": int(gold.sum()),
                "per_model": {m: {"n": int((model_idx == k).sum()), "n_refused": int(gold[model_idx == k].sum())}
                              for k, m in enumerate(models)},
                "train_accuracy": train_acc,
                "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "torch": torch.__version__, "python": platform.python_version(),
            },
            "lomo": {m: {"accuracy": round(lomo[m]["accuracy"], 4), "f1": round(lomo[m]["f1"], 4)}
                     for m in [*models, "mean"]},
            "validation_command": "python bench/validate_judges.py --ship --write-docs",
        }
        weights, meta = save_classifier(head, spec, DEFAULT_HEAD, args.out_dir or RESOURCE_DIR,
                                        threshold=DEFAULT_THRESHOLD,
                                        short_refusal_floor=DEFAULT_SHORT_REFUSAL_FLOOR, extra=extra)
        print(f"wrote {weights} ({weights.stat().st_size} bytes) and {meta}; train accuracy {train_acc:.4f}",
              file=sys.stderr)

    table = markdown_table(results, models)
    print(table)
    print(f"\n({time.time() - t0:.0f}s)", file=sys.stderr)
    if args.write_docs:
        if not DOCS.is_file() or BEGIN not in DOCS.read_text():
            print(f"{DOCS} has no {BEGIN} block; not written", file=sys.stderr)
        else:
            text = DOCS.read_text()
            stamp = f"_Measured {datetime.now(UTC).strftime('%Y-%m-%d')} on {len(rows)} completions; each cell is accuracy / F1._"
            block = f"{BEGIN}\n{stamp}\n\n{table}\n{END}"
            DOCS.write_text(re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.DOTALL))
            print(f"updated {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
