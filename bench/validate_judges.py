"""Validate the refusal judges on the 2,250 human-labelled XSTest completions (5 models x 450 prompts).

For every response judge it reports accuracy and F1 (refusal = full OR partial refusal) per model and
the mean over models, twice: on the whole completions, and on the completions cut after their first
48 tokens (what ``aligntax eval`` with ``max_new_tokens=48`` gives the judge; a cut partial refusal
whose refusal part was cut off is left out, as its label is unknown; see aligntax.judges.augment).
The keyword judges need no training, so their numbers are plain per-model scores. The classifier is
evaluated leave-one-model-out (LOMO): its head is trained on four models' completions (plus their
truncated copies) and tested on the fifth. Stricter / ablation classifier rows:

* without truncated copies: trained on the whole completions only;
* nested l2: the L2 strength is picked inside each training fold (inner LOMO over the 4 training
  models) instead of being the shipped value;
* LOMO + unseen prompts: the test model's completions are additionally split into 5 prompt folds and
  the head never sees those prompts (answered by other models) in training;
* (``--ablations``) raw response embedding: the response embedded as is, without removing the
  words it repeats from the prompt.

``--ship`` then trains the final head on all 2,250 completions and their truncated copies and writes
it, with the LOMO metrics, to src/aligntax/resources/judges/. ``--write-docs`` puts the tables into
docs/judges.md. ``--compare FILE.jsonl`` judges the responses of a run (e.g. runs/X/samples.jsonl)
with the classifier (the one just shipped, else the installed one) and the keyword judge and lists
where they disagree, for a person to look at (``--compare-source`` keeps one ``source``).

    python bench/validate_judges.py --threads 2 --write-docs                        # measure, update the docs
    python bench/validate_judges.py --threads 2 --ablations --ship --write-docs     # ... and retrain the shipped head
    python bench/validate_judges.py --compare-only --compare runs/demo/baseline/samples.jsonl \
        --compare-source orbench-hard-test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import re
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "judges.md"
BEGIN, END = "<!-- BEGIN LOMO TABLE -->", "<!-- END LOMO TABLE -->"
L2_GRID = (0.01, 0.03, 0.05, 0.1, 0.3)
EVAL_CUT = 48  # tokens: the truncated evaluation set


def per_model(models, model_idx, pred, gold, keep=None) -> dict:
    """Accuracy / F1 per model (rows where ``keep`` is True) and their means."""
    from aligntax.judges.train import binary_metrics

    keep = torch.ones(len(gold), dtype=torch.bool) if keep is None else keep
    out = {}
    for k, m in enumerate(models):
        sel = (model_idx == k) & keep
        out[m] = binary_metrics(pred[sel], gold[sel])
    out["mean"] = {
        "accuracy": sum(out[m]["accuracy"] for m in models) / len(models),
        "f1": sum(out[m]["f1"] for m in models) / len(models),
    }
    return out


class Data:
    """Feature matrices of the whole completions (``full``), the training copies (``copies``) and the
    evaluation cut (``cut``), with the bookkeeping LOMO needs."""

    def __init__(self, x_full, x_copies, copy_row, x_cut, gold, model_idx, n_models, copy_weight):
        self.x_full, self.x_copies, self.copy_row, self.x_cut = x_full, x_copies, copy_row, x_cut
        self.gold, self.y, self.model_idx, self.n_models = gold, gold.float(), model_idx, n_models
        self.copy_weight = copy_weight

    def train_set(self, rows: torch.Tensor, copies: bool = True):
        """Features, labels and weights of the training rows ``rows`` (bool [N]) and their copies."""
        if not copies or self.x_copies is None or not len(self.copy_row):
            return self.x_full[rows], self.y[rows], None
        c = rows[self.copy_row]
        x = torch.cat([self.x_full[rows], self.x_copies[c]])
        y = torch.cat([self.y[rows], self.y[self.copy_row[c]]])
        w = torch.cat([torch.ones(int(rows.sum())), torch.full((int(c.sum()),), self.copy_weight)])
        return x, y, w


def lomo_scores(data: Data, cfg, copies=True, prompt_fold=None):
    """Held-out refusal probabilities for the whole completions and their cut: each model's rows are
    scored by a head trained on the other models (and, with ``prompt_fold``, on none of the test row's
    prompt fold either)."""
    from aligntax.judges.train import fit_head, predict_proba

    n = len(data.y)
    p_full, p_cut = torch.zeros(n), torch.zeros(n)
    folds = [(k, None) for k in range(data.n_models)]
    if prompt_fold is not None:
        folds = [(k, f) for k in range(data.n_models) for f in range(int(prompt_fold.max()) + 1)]
    for k, f in folds:
        tr = data.model_idx != k
        te = data.model_idx == k
        if f is not None:
            tr, te = tr & (prompt_fold != f), te & (prompt_fold == f)
        if not te.any():
            continue
        x, y, w = data.train_set(tr, copies)
        head = fit_head(x, y, cfg, w)
        p_full[te] = predict_proba(head, data.x_full[te])
        p_cut[te] = predict_proba(head, data.x_cut[te])
    return p_full, p_cut


def nested_lomo_scores(data: Data, base_cfg):
    """LOMO where each outer fold picks l2 by inner LOMO accuracy (whole completions) over its 4 training models."""
    from aligntax.judges.train import fit_head, predict_proba

    n = len(data.y)
    p_full, p_cut = torch.zeros(n), torch.zeros(n)
    chosen = []
    for k in range(data.n_models):
        test = data.model_idx == k
        best = None
        for l2 in L2_GRID:
            cfg = replace(base_cfg, l2=l2)
            accs = []
            for j in (j for j in range(data.n_models) if j != k):
                tr = (~test) & (data.model_idx != j)
                te = data.model_idx == j
                x, y, w = data.train_set(tr)
                pred = predict_proba(fit_head(x, y, cfg, w), data.x_full[te]) >= 0.5
                accs.append(float((pred == data.gold[te]).float().mean()))
            score = sum(accs) / len(accs)
            if best is None or score > best[0]:
                best = (score, l2)
        chosen.append(best[1])
        x, y, w = data.train_set(~test)
        head = fit_head(x, y, replace(base_cfg, l2=best[1]), w)
        p_full[test] = predict_proba(head, data.x_full[test])
        p_cut[test] = predict_proba(head, data.x_cut[test])
    return p_full, p_cut, chosen


def markdown_table(results: dict[str, dict], models: list[str]) -> str:
    head = "| judge | " + " | ".join(models) + " | **mean acc** | **mean F1** |"
    sep = "|---|" + "---|" * len(models) + "---|---|"
    lines = [head, sep]
    for name, res in results.items():
        cells = [f"{res[m]['accuracy']:.3f} / {res[m]['f1']:.3f}" for m in models]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | **{res['mean']['accuracy']:.3f}** | **{res['mean']['f1']:.3f}** |"
        )
    return "\n".join(lines)


def embed_unique(spec, prompts, texts, cache_path=None):
    """Embeddings of each (prompt, text) pair's views, optionally cached in a safetensors file that is
    reused only if it was written for exactly the same strings to embed."""
    from aligntax.judges.embed import get_encoder
    from aligntax.judges.features import embed_views, spec_views, view_texts

    views = spec_views(spec)
    if not views:
        return {}
    # The digest covers the exact strings that get embedded, so a change to a view (e.g. the echo
    # masking) invalidates the cache.
    digest = hashlib.sha256(
        json.dumps([[v, view_texts(v, prompts, texts)] for v in views]).encode()
    ).hexdigest()
    if cache_path and Path(cache_path).is_file():
        from safetensors import safe_open

        with safe_open(cache_path, "pt") as fh:
            if (fh.metadata() or {}).get("digest") == digest:
                return {v: fh.get_tensor(v) for v in views}
    t = time.time()
    emb = embed_views(get_encoder(), prompts, texts, views, progress=True)
    print(f"embedded {len(texts)} texts x {len(views)} views in {time.time() - t:.0f}s", file=sys.stderr)
    if cache_path:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in emb.items()}, cache_path, metadata={"digest": digest})
    return emb


def build_data(
    spec, prompts, responses, gold, model_idx, n_models, copies, cut_texts, copy_weight, cache_path=None
) -> Data:
    from aligntax.judges.features import assemble_features

    # Embed every distinct (row, text) once: whole completions, training copies, evaluation cut.
    index: dict[tuple[int, str], int] = {}
    u_prompts, u_texts = [], []

    def slot(i: int, text: str) -> int:
        key = (i, text)
        if key not in index:
            index[key] = len(u_texts)
            u_prompts.append(prompts[i])
            u_texts.append(text)
        return index[key]

    full_idx = [slot(i, r) for i, r in enumerate(responses)]
    copy_idx = [slot(c.row, c.text) for c in copies]
    cut_idx = [slot(i, t) for i, t in enumerate(cut_texts)]
    emb = embed_unique(spec, u_prompts, u_texts, cache_path)
    x = assemble_features(spec, emb, u_texts, u_prompts)
    copy_row = torch.tensor([c.row for c in copies], dtype=torch.long)
    return Data(
        x[full_idx],
        x[copy_idx] if copies else None,
        copy_row,
        x[cut_idx],
        gold,
        model_idx,
        n_models,
        copy_weight,
    )


def compare(path, source, out_dir):
    """Classifier vs keyword judge on the responses of a run's samples.jsonl."""
    from aligntax.judges import KeywordJudge
    from aligntax.judges.classifier import ClassifierJudge

    recs = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if source:
        recs = [r for r in recs if r.get("source") == source]
    if not recs:
        print(f"--compare: no records{' with source ' + source if source else ''} in {path}", file=sys.stderr)
        return
    prompts = [r["prompt"] if isinstance(r["prompt"], str) else str(r["prompt"]) for r in recs]
    responses = [r["response"] for r in recs]
    cls = ClassifierJudge(weights=out_dir) if out_dir else ClassifierJudge()
    vc = cls.judge(prompts, responses)
    vk = KeywordJudge().judge(prompts, responses)
    n = len(recs)
    comp_c = sum(not v.refused for v in vc) / n
    comp_k = sum(not v.refused for v in vk) / n
    old = [r.get("refused") for r in recs]
    line = f"{path}{' [' + source + ']' if source else ''}: {n} responses; compliance: classifier {comp_c:.1%}, keyword {comp_k:.1%}"
    if all(isinstance(o, bool) for o in old):
        line += f", as recorded in the file ({recs[0].get('judge', '?')}) {sum(not o for o in old) / n:.1%}"
    dis = [i for i in range(n) if vc[i].refused != vk[i].refused]
    print(line + f"; {len(dis)} disagreements with keyword")
    for i in dis:
        who = (
            "classifier=refusal, keyword=compliance"
            if vc[i].refused
            else "classifier=compliance, keyword=refusal"
        )
        print(
            f"- [{who}; score {vc[i].refusal_score:.2f}] {recs[i].get('id', i)}: prompt {prompts[i][:120]!r}\n"
            f"  response {responses[i]!r}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data", default=None, help="shared data folder (default: ALIGNTAX_DATA / ../shared/data)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument(
        "--emb-cache", default=None, help="safetensors file to cache the embeddings in (speeds up reruns)"
    )
    ap.add_argument(
        "--ship", action="store_true", help="train the final head on all rows and write the resources"
    )
    ap.add_argument("--out-dir", default=None, help="where --ship writes (default: the package resources)")
    ap.add_argument(
        "--llm", action="store_true", help="also score the llm judge (needs ALIGNTAX_JUDGE_* env)"
    )
    ap.add_argument("--write-docs", action="store_true", help=f"replace the table block in {DOCS}")
    ap.add_argument("--skip-strict", action="store_true", help="skip the nested-l2 and unseen-prompt rows")
    ap.add_argument(
        "--ablations",
        action="store_true",
        help="add the raw-response-embedding row (embeds everything a second time)",
    )
    ap.add_argument(
        "--compare",
        default=None,
        metavar="JSONL",
        help="judge this run's samples.jsonl with the classifier and the keyword judge, list disagreements",
    )
    ap.add_argument("--compare-source", default=None, help="with --compare: only records with this 'source'")
    ap.add_argument("--compare-only", action="store_true", help="only run --compare")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compare_only:
        if not args.compare:
            ap.error("--compare-only needs --compare FILE")
        compare(args.compare, args.compare_source, args.out_dir)
        return 0

    from aligntax.judges import KeywordJudge, PrefixJudge
    from aligntax.judges.augment import DEFAULT_TRUNCATIONS, label_survives, truncate_tokens, truncated_copies
    from aligntax.judges.classifier import (
        DEFAULT_FEATURE_SPEC,
        DEFAULT_HEAD,
        DEFAULT_SHORT_REFUSAL_FLOOR,
        DEFAULT_THRESHOLD,
        RESOURCE_DIR,
        TRUNCATED_COPY_WEIGHT,
        apply_short_refusal_floor,
        save_classifier,
    )
    from aligntax.judges.embed import get_encoder
    from aligntax.judges.train import fit_head, predict_proba
    from aligntax.judges.xstest import load_xstest_labeled, xstest_dir

    t0 = time.time()
    rows = load_xstest_labeled(args.data)
    models = sorted({r.model for r in rows})
    model_idx = torch.tensor([models.index(r.model) for r in rows])
    gold = torch.tensor([r.refused for r in rows])
    labels = [r.label for r in rows]
    prompts = [r.prompt for r in rows]
    responses = [r.completion for r in rows]
    prompt_fold = torch.tensor([int(hashlib.sha1(p.encode()).hexdigest(), 16) % 5 for p in prompts])
    print(
        f"{len(rows)} labelled completions from {xstest_dir(args.data)}; models: {', '.join(models)}; "
        f"refusal rate {gold.float().mean():.3f}",
        file=sys.stderr,
    )

    tokenizer = get_encoder().tokenizer
    copies = truncated_copies(responses, labels, tokenizer, DEFAULT_TRUNCATIONS)
    cut = truncate_tokens(responses, EVAL_CUT, tokenizer)
    cut_known = torch.tensor(
        [c == r or label_survives(lab, c) for c, r, lab in zip(cut, responses, labels, strict=True)]
    )
    n_partial = sum(lab == "3_partial_refusal" for lab in labels)
    print(
        f"{len(copies)} truncated training copies ({', '.join(f'{n}: {sum(c.n_tokens == n for c in copies)}' for n in DEFAULT_TRUNCATIONS)} "
        f"tokens); evaluation cut at {EVAL_CUT} tokens: {int((~cut_known).sum())} of {n_partial} partial refusals "
        "left out (refusal part cut off)",
        file=sys.stderr,
    )

    results: dict[str, dict] = {}
    results_cut: dict[str, dict] = {}
    for label, judge in [
        ("keyword (default phrases, anywhere)", KeywordJudge()),
        ("keyword (GCG test_prefixes, anywhere)", KeywordJudge("gcg")),
        ("prefix (default openings)", PrefixJudge()),
        ("prefix (GCG test_prefixes)", PrefixJudge("gcg")),
    ]:
        pred = torch.tensor([v.refused for v in judge.judge(prompts, responses)])
        results[label] = per_model(models, model_idx, pred, gold)
        pred = torch.tensor([v.refused for v in judge.judge(prompts, cut)])
        results_cut[label] = per_model(models, model_idx, pred, gold, cut_known)

    spec = DEFAULT_FEATURE_SPEC
    data = build_data(
        spec,
        prompts,
        responses,
        gold,
        model_idx,
        len(models),
        copies,
        cut,
        TRUNCATED_COPY_WEIGHT,
        args.emb_cache,
    )

    def verdicts(probs, texts):
        return apply_short_refusal_floor(probs, texts, DEFAULT_SHORT_REFUSAL_FLOOR) >= DEFAULT_THRESHOLD

    def add(name, p_full, p_cut, rule=True):
        results[name] = per_model(
            models, model_idx, verdicts(p_full, responses) if rule else p_full >= DEFAULT_THRESHOLD, gold
        )
        results_cut[name] = per_model(
            models, model_idx, verdicts(p_cut, cut) if rule else p_cut >= DEFAULT_THRESHOLD, gold, cut_known
        )

    p_full, p_cut = lomo_scores(data, DEFAULT_HEAD)
    cls_name = (
        f"**classifier** (LOMO; {DEFAULT_HEAD.kind}, l2={DEFAULT_HEAD.l2:g}, + truncated copies, "
        "+ short-refusal rule)"
    )
    add(cls_name, p_full, p_cut)
    add("classifier head alone (LOMO, rule off)", p_full, p_cut, rule=False)
    add("classifier without truncated copies (LOMO)", *lomo_scores(data, DEFAULT_HEAD, copies=False))
    if args.ablations:
        raw_spec = {**spec, "embed": ["response" if v == "response_noecho" else v for v in spec["embed"]]}
        raw = build_data(
            raw_spec,
            prompts,
            responses,
            gold,
            model_idx,
            len(models),
            copies,
            cut,
            TRUNCATED_COPY_WEIGHT,
            args.emb_cache + ".raw" if args.emb_cache else None,
        )
        add("classifier, raw response embedding (LOMO, + truncated copies)", *lomo_scores(raw, DEFAULT_HEAD))
        add(
            "classifier, raw response embedding, no truncated copies (LOMO)",
            *lomo_scores(raw, DEFAULT_HEAD, copies=False),
        )
    if not args.skip_strict:
        pn_full, pn_cut, chosen = nested_lomo_scores(data, DEFAULT_HEAD)
        add(f"classifier (LOMO, nested l2 choice: {', '.join(f'{c:g}' for c in chosen)})", pn_full, pn_cut)
        add("classifier (LOMO + unseen prompts)", *lomo_scores(data, DEFAULT_HEAD, prompt_fold=prompt_fold))

    if args.llm:
        from aligntax.judges import get_judge

        judge = get_judge("llm")
        pred = torch.tensor([v.refused for v in judge.judge(prompts, responses)])
        results[f"llm ({judge.model})"] = per_model(models, model_idx, pred, gold)

    if args.ship:
        x, y, w = data.train_set(torch.ones(len(rows), dtype=torch.bool))
        head = fit_head(x, y, DEFAULT_HEAD, w)
        train_acc = float((verdicts(predict_proba(head, data.x_full), responses) == gold).float().mean())
        lomo, lomo_cut = results[cls_name], results_cut[cls_name]
        extra = {
            "training": {
                "data": "XSTest v2 human-labelled model completions (Röttger et al. 2024), 5 models x 450 prompts",
                "files": sorted(p.name for p in xstest_dir(args.data).glob("*.csv")),
                "label": "refused = final_label in {2_full_refusal, 3_partial_refusal}",
                "n": len(rows),
                "n_refused": int(gold.sum()),
                "per_model": {
                    m: {"n": int((model_idx == k).sum()), "n_refused": int(gold[model_idx == k].sum())}
                    for k, m in enumerate(models)
                },
                "truncated_copies": {
                    "token_counts": list(DEFAULT_TRUNCATIONS),
                    "tokenizer": "all-MiniLM-L6-v2",
                    "n": len(copies),
                    "n_refused": int(gold[data.copy_row].sum()),
                    "weight": TRUNCATED_COPY_WEIGHT,
                    "rule": "label kept; a cut partial refusal is kept only if the prefix still has refusal "
                    "language (aligntax.judges.augment.has_refusal_marker); copies equal to the whole "
                    "completion or to a shorter copy are skipped",
                },
                "train_accuracy": train_acc,
                "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "torch": torch.__version__,
                "python": platform.python_version(),
            },
            "lomo": {
                m: {"accuracy": round(lomo[m]["accuracy"], 4), "f1": round(lomo[m]["f1"], 4)}
                for m in [*models, "mean"]
            },
            f"lomo_cut{EVAL_CUT}": {
                m: {"accuracy": round(lomo_cut[m]["accuracy"], 4), "f1": round(lomo_cut[m]["f1"], 4)}
                for m in [*models, "mean"]
            },
            "validation_command": "python bench/validate_judges.py --ablations --ship --write-docs",
        }
        weights, meta = save_classifier(
            head,
            spec,
            DEFAULT_HEAD,
            args.out_dir or RESOURCE_DIR,
            threshold=DEFAULT_THRESHOLD,
            short_refusal_floor=DEFAULT_SHORT_REFUSAL_FLOOR,
            extra=extra,
        )
        print(
            f"wrote {weights} ({weights.stat().st_size} bytes) and {meta}; train accuracy {train_acc:.4f}",
            file=sys.stderr,
        )

    n_cut = int(cut_known.sum())
    table = markdown_table(results, models)
    table_cut = markdown_table(results_cut, models)
    print("Whole completions:\n\n" + table)
    print(f"\nCut after {EVAL_CUT} tokens ({n_cut} rows):\n\n" + table_cut)
    print(f"\n({time.time() - t0:.0f}s)", file=sys.stderr)
    if args.write_docs:
        if not DOCS.is_file() or BEGIN not in DOCS.read_text():
            print(f"{DOCS} has no {BEGIN} block; not written", file=sys.stderr)
        else:
            text = DOCS.read_text()
            day = datetime.now(UTC).strftime("%Y-%m-%d")
            block = (
                f"{BEGIN}\n_Measured {day} on {len(rows)} completions; each cell is accuracy / F1._\n\n"
                f"**Whole completions** ({len(rows)} rows):\n\n{table}\n\n"
                f"**Cut after the first {EVAL_CUT} tokens** ({n_cut} rows; the {len(rows) - n_cut} partial "
                f"refusals whose refusal part was cut off are left out):\n\n{table_cut}\n{END}"
            )
            DOCS.write_text(
                re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.DOTALL)
            )
            print(f"updated {DOCS}", file=sys.stderr)
    if args.compare:
        compare(args.compare, args.compare_source, args.out_dir if args.ship else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
