"""Greedy tokens, logits and steering statistics of every steering intervention on tiny random models,
from two source trees, compared: a refactor of the steering code must not change them.

    git worktree add /tmp/before <commit>
    python bench/steering_equivalence.py /tmp/before .      # prints mismatches and the largest logit change

Each tree runs in its own process (``sys.path`` points at its ``src`` and ``tests``). Cases: ELS (plain,
per-position threshold, horizon, harm gate, gate ramp, row energy decision, all three, positions
"generated" and "all", layers 0 and 2), refusal-add, refusal-ablation, false-refusal-ablation and CAST;
on tiny Qwen2 and Llama models in fp32, with and without the KV cache, with and without a per-row mask
and strength, and through ``aligntax.generation.generate`` (batches of 5, finished rows dropped).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def record(repo: Path, out: Path) -> None:
    sys.path[:0] = [str(repo / "src"), str(repo / "tests")]
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    from aligntax.activations import capture
    from aligntax.energy.gate import HarmGate
    from aligntax.energy.model import EnergyModel
    from aligntax.generation import GenerationConfig, generate
    from aligntax.interventions.els import EnergySteering
    from aligntax.interventions.registry import make_intervention
    from tiny import PROMPTS, run_steered, save_tiny_vectors, tiny_lm

    res, tensors, hidden = {}, {}, 32
    for arch in ("qwen2", "llama"):
        lm = tiny_lm(arch, hidden=hidden, layers=3)

        def els(eta=2.0, layers=(1, 2), **kw):
            torch.manual_seed(1)
            models = {
                la: EnergyModel(hidden, [32, 16], layernorm=i % 2 == 0, dropout=0.15)
                for i, la in enumerate(layers)
            }
            return EnergySteering(models, eta=eta, steps=3, scale_by_norm=False, **kw)

        states = capture(lm, PROMPTS, [1], progress=False)
        h = states[1][:, None]
        torch.manual_seed(3)
        w = torch.randn(1, hidden)
        mu, sc = h.mean(0), h.std(0)
        s = (((h - mu) / sc) * w).sum(-1).mean(-1).sort().values
        gate = HarmGate([1], w, torch.full((1,), -float(s[1] + s[2]) / 2), mu, sc, fingerprint=lm.fingerprint)
        with torch.no_grad():  # the row energy: the first steered block's energy at the last prompt token
            rthr = float(els().models[1](states[1].float(), check=False).median())
        vec = Path(tempfile.mkdtemp())
        save_tiny_vectors(lm, vec)
        cases = {
            "els": els(),
            "els_thr": els(threshold=0.0),
            "els_h2": els(horizon=2),
            "els_gate": els(gate=gate),
            "els_ramp": els(gate=gate, gate_ramp=0.2),
            "els_row": els(row_threshold=rthr),
            "els_all3": els(gate=gate, row_threshold=rthr, horizon=1),
            "els_gen": els(positions="generated"),
            "els_allpos": els(positions="all", horizon=3),
            "els_l0": els(eta=1.5, layers=(0, 2)),
            **{
                name: make_intervention(name, lm, dir=str(vec))
                for name in ("refusal-add", "refusal-ablation", "false-refusal-ablation", "cast")
            },
        }
        for name, iv in cases.items():
            for cache in (True, False):
                for rows, strength in ((None, None), ([1, 0, 1, 1], [0.5, 1.0, 2.0, 1.0])):
                    key = f"{arch}/{name}/cache{int(cache)}/rows{int(rows is not None)}"
                    toks, logits, ctx, _ = run_steered(
                        lm, PROMPTS, iv, max_new_tokens=5, use_cache=cache, rows=rows, strength=strength
                    )
                    res[key] = {
                        "tokens": toks.tolist(),
                        "stats": json.loads(json.dumps(ctx.stats, default=str)),
                    }
                    tensors[key] = logits.contiguous()
            gens = generate(
                lm,
                PROMPTS * 3,
                GenerationConfig(max_new_tokens=6, batch_size=5),
                intervention=iv,
                progress=False,
            )
            res[f"{arch}/{name}/generate"] = {"tokens": [g.response for g in gens]}
    out.write_text(json.dumps(res))
    save_file(tensors, str(out) + ".safetensors")


def compare(a: Path, b: Path) -> int:
    from safetensors.torch import load_file

    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    ta, tb = load_file(str(a) + ".safetensors"), load_file(str(b) + ".safetensors")
    bad = 0
    worst = 0.0
    for key in ra:
        if ra[key]["tokens"] != rb[key]["tokens"]:
            print("tokens differ:", key)
            bad += 1
        if ra[key].get("stats") != rb[key].get("stats"):
            print("stats differ:", key)
            bad += 1
        if key in ta:
            worst = max(worst, float((ta[key] - tb[key]).abs().max()))
    print(f"{len(ra)} cases, {bad} mismatches, largest logit change {worst:.3g}")
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--record":
        record(Path(sys.argv[2]).resolve(), Path(sys.argv[3]))
        return 0
    before, after = (Path(x).resolve() for x in sys.argv[1:3])
    tmp = Path(tempfile.mkdtemp())
    for name, repo in (("before", before), ("after", after)):
        subprocess.run(
            [sys.executable, __file__, "--record", str(repo), str(tmp / f"{name}.json")],
            check=True,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
    return compare(tmp / "before.json", tmp / "after.json")


if __name__ == "__main__":
    raise SystemExit(main())
