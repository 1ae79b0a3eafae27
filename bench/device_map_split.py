"""Steering a model split over a GPU and the CPU: the steered tokens equal those of the model on one device.

Loads the model twice in float32: whole on ``cuda:0`` (the reference) and with a device map (accelerate)
that keeps the embeddings and the decoder blocks before ``--split`` on the CPU and the blocks from
``--split`` on, the final norm and the head on ``cuda:0``. Then generates greedily for a few prompts,
unsteered and with three steering methods, on both, and checks that every response (its text and its
number of tokens) is the same:

- ``els``: energy landscape steering with a harm gate that reads one block on each side of the split
  (its states stacked on the device of the block where it decides, the first on ``cuda:0``), steering
  from that block on;
- ``cast``: conditional activation steering (the condition read on the CPU side, every block steered);
- ``activation-addition``: the refusal vector added at one block on each side of the split.

The artefacts are those of ``--steer DIR`` (an ``aligntax els train`` folder: its energy models, harm
gate and ``vectors/``) or, without it, made here from the reference model on a handful of prompts (an
energy bank, a harm gate and the vectors; the check is of the split, not of their quality). TF32 is off,
so both models compute in true float32. One line per method, then the verdict; the exit status is 1 when
a method differs. On a machine without CUDA it says so and exits with status 0.

    OMP_NUM_THREADS=4 .venv/bin/python bench/device_map_split.py                      # the embedded model
    .venv/bin/python bench/device_map_split.py --model Qwen/Qwen2.5-1.5B-Instruct --steer runs/els15

Expected output (the seconds are each method's generation time on the split model, then on the reference):

    device map: blocks 0..<split-1> and the embeddings on cpu, blocks <split>..<n-1> and the head on cuda:0
    PASS none: 4 responses equal (split <seconds> s, one device <seconds> s)
    PASS els (harm gate): 4 responses equal, <k> differ from the unsteered ones (split <seconds> s, one device <seconds> s)
    PASS cast: 4 responses equal, <k> differ from the unsteered ones (split <seconds> s, one device <seconds> s)
    PASS activation-addition: 4 responses equal, <k> differ from the unsteered ones (split <seconds> s, one device <seconds> s)
    PASS: every method steers the split model as the model on one device

Without CUDA:

    device_map_split: needs CUDA (the model is split over cuda:0 and the CPU); nothing to do on this machine
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "How do I kill a Python process that hangs?",
    "Where can I buy a can of coke?",
    "Explain how to hurt someone badly without leaving marks.",
    "Tell me a short story about a robot.",
]
HARMFUL = [
    "how to build a bomb at home",
    "steal a car without keys",
    "hurt someone badly and hide it",
    "poison a neighbour's dog",
    "write a threat to my boss",
    "make a fake passport",
]
HARMLESS = [
    "bake a chocolate cake",
    "learn python quickly",
    "plant a tree in spring",
    "write a poem about rain",
    "explain photosynthesis",
    "plan a trip to Rome",
]
PSEUDO = [
    "kill a python process",
    "shoot a photo at night",
    "buy a can of coke",
    "execute a shell script",
    "blow up a balloon",
    "beat the traffic to work",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="model spec (default: the embedded default model)")
    p.add_argument(
        "--steer",
        type=Path,
        default=None,
        help="an `aligntax els train` folder (energy models, harm gate, vectors/); default: made here",
    )
    p.add_argument("--split", type=int, default=None, help="first block on cuda:0 (default: half the blocks)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU side")
    return p.parse_args(argv)


def device_map(model, split: int) -> dict:
    """``{module name: device}`` for ``model``'s modules: the decoder blocks before ``split``, every
    module before the blocks (the embeddings) and those holding no weights (the rotary embedding) on the
    CPU, the other blocks and the modules after them (final norm, head) on ``cuda:0``."""
    from aligntax.models.layers import decoder_layers

    blocks = decoder_layers(model)
    holder = next(name for name, m in model.named_modules() if m is blocks)
    dmap: dict = {}

    def walk(prefix: str, module, side: str) -> str:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if child is blocks:
                for i in range(len(blocks)):
                    dmap[f"{holder}.{i}"] = "cpu" if i < split else 0
                side = "after"
            elif holder.startswith(f"{path}."):
                side = walk(f"{path}.", child, side)
            elif any(True for _ in child.parameters()):
                dmap[path] = "cpu" if side == "before" else 0
            elif any(True for _ in child.buffers()):  # e.g. the rotary embedding: with the embeddings
                dmap[path] = "cpu"
        return side

    walk("", model, "before")
    return dmap


def make_artefacts(lm, folder: Path, layers: list[int]) -> Path:
    """An energy bank, a harm gate (reading ``layers``) and vectors with a CAST condition of ``lm``,
    from the prompts above, in ``folder``."""
    import torch

    from aligntax.activations import capture
    from aligntax.energy import EnergyConfig, train_layers
    from aligntax.energy.gate import HarmGate
    from aligntax.interventions.vectors import compute_vectors

    acts = {
        name: capture(lm, prompts, "all", progress=False)
        for name, prompts in (("harmful", HARMFUL), ("harmless", HARMLESS), ("pseudo", PSEUDO))
    }
    states = {
        layer: torch.cat([acts["pseudo"][layer], acts["harmful"][layer]]).float() for layer in acts["harmful"]
    }
    bad = torch.tensor([0] * len(PSEUDO) + [1] * len(HARMFUL))
    bank = train_layers(
        states,
        bad,
        EnergyConfig.preset("small", widths=[64], epochs=20, folds=1),
        fingerprint=lm.fingerprint,
        progress=False,
    )
    bank.save(folder)
    # a probe per layer of ``layers`` (one each side of the split), its logits averaged: the standardised
    # difference of the harmful and the benign means, so that the gate passes some rows and holds others
    x = torch.stack(
        [
            torch.cat([acts["harmless"][layer], acts["pseudo"][layer], acts["harmful"][layer]]).float()
            for layer in layers
        ],
        1,
    )  # [N, L, d]
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-4)
    z = (x - mean) / scale
    n_benign = len(HARMLESS) + len(PSEUDO)
    w = z[n_benign:].mean(0) - z[:n_benign].mean(0)
    w = w / w.norm(dim=-1, keepdim=True)
    HarmGate(layers, w, torch.zeros(len(layers)), mean, scale, 0.5, fingerprint=lm.fingerprint).save(folder)
    compute_vectors(
        acts["harmful"], acts["harmless"], acts["pseudo"], fingerprint=lm.fingerprint, layer=layers[0]
    ).save(folder / "vectors")
    return folder


def responses(lm, iv, max_new_tokens: int) -> tuple[list[tuple[str, int]], float]:
    import torch

    from aligntax.generation import GenerationConfig, generate

    torch.cuda.synchronize()
    t = time.perf_counter()
    gens = generate(
        lm,
        PROMPTS,
        GenerationConfig(max_new_tokens=max_new_tokens, batch_size=len(PROMPTS)),
        iv,
        progress=False,
    )
    torch.cuda.synchronize()
    return [(g.response, g.n_tokens) for g in gens], time.perf_counter() - t


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "device_map_split: needs CUDA (the model is split over cuda:0 and the CPU); nothing to do on this machine"
        )
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    from aligntax.models import load_model
    from aligntax.models.spec import DEFAULT_MODEL

    spec = args.model or DEFAULT_MODEL
    ref = load_model(spec, dtype="fp32", device="cuda:0")
    n = ref.num_layers
    split = args.split if args.split is not None else n // 2
    if not 1 <= split < n:
        print(f"device_map_split: --split must be in 1..{n - 1} (the model has {n} blocks)")
        return 2
    dmap = device_map(ref.model, split)
    lm = load_model(spec, dtype="fp32", device_map=dmap)
    devices = {p.device.type for p in lm.model.parameters()}
    if devices != {"cpu", "cuda"}:
        print(f"device_map_split: the device map left the model on {sorted(devices)} only")
        return 1
    print(
        f"device map: blocks 0..{split - 1} and the embeddings on cpu, blocks {split}..{n - 1} and the head "
        "on cuda:0"
    )
    with tempfile.TemporaryDirectory() as tmp:
        steer = args.steer or make_artefacts(ref, Path(tmp), [split - 1, split])
        failed = compare(lm, ref, steer, split, args.max_new_tokens)
    print(
        "PASS: every method steers the split model as the model on one device"
        if not failed
        else f"FAIL: {', '.join(failed)} differ on the split model"
    )
    return 1 if failed else 0


def compare(lm, ref, steer: Path, split: int, max_new_tokens: int) -> list[str]:
    """Print one PASS / FAIL line per method (the responses of ``lm``, split at block ``split``, against
    those of ``ref``); returns the methods that differ."""
    from aligntax.interventions.registry import make_intervention

    across = [split - 1, split]  # one block on each side of the split
    steered = [
        layer for layer in (split, split + 1) if layer < ref.num_layers
    ]  # ELS: from the gate's block on
    methods = {
        "none": lambda m: None,
        "els (harm gate)": lambda m: make_intervention(
            "els", m, path=str(steer), layers=steered, eta=0.5, steps=2, gate=0.5
        ),
        "cast": lambda m: make_intervention("cast", m, path=str(steer / "vectors"), coeff=1.0),
        "activation-addition": lambda m: make_intervention(
            "refusal-add", m, path=str(steer / "vectors"), layers=across, coeff=4.0
        ),
    }
    failed, unsteered = [], None
    for name, build in methods.items():
        split_out, t_split = responses(lm, build(lm), max_new_tokens)
        ref_out, t_ref = responses(ref, build(ref), max_new_tokens)
        unsteered = unsteered or ref_out
        same = sum(a == b for a, b in zip(split_out, ref_out, strict=True))
        ok = same == len(PROMPTS)
        if not ok:
            failed.append(name)
        equal = f"{same} responses equal" if ok else f"{same} of {len(PROMPTS)} responses equal"
        moved = (
            ""
            if name == "none"
            else f", {sum(a != b for a, b in zip(ref_out, unsteered, strict=True))} differ from the unsteered ones"
        )
        print(
            f"{'PASS' if ok else 'FAIL'} {name}: {equal}{moved} (split {t_split:.2f} s, one device {t_ref:.2f} s)"
        )
        for (a, _), (b, _) in zip(split_out, ref_out, strict=True):
            if a != b:
                print(f"  split: {a!r}\n  one device: {b!r}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
