"""An els-lora adapter exported as a GGUF file, read back, against the hook-applied adapter.

    python bench/gguf_roundtrip.py --adapter runs/gguf/adapter --data orbench-hard-test --limit 100 \\
        --dtype fp32 --out runs/gguf/roundtrip-fp32

Writes ``OUT/model.gguf`` (``aligntax export --format gguf``; kept when it exists), reads it with
``gguf.GGUFReader`` (architecture, every expected tensor name, the chat template), loads it back through
transformers (``aligntax.load_model`` on the file) and compares greedy answers (``--max-new-tokens``, 48)
on the prompts of ``--data`` token by token: the model from the GGUF unsteered against the model it was
made from with the adapter applied by hooks, both in ``--dtype``. For reference, also the GGUF against
the unsteered model (how many answers the adapter changes). Writes ``OUT/results.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def expected_tensors(model) -> set[str]:
    """The llama.cpp names the model's weights get (``output`` only with an untied head)."""
    import gguf

    from aligntax.bundles.gguf import _ARCHS, _tied

    cfg = model.config
    arch = getattr(gguf.MODEL_ARCH, _ARCHS[cfg.model_type])
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    keys = [k for k in model.state_dict() if not (k == "lm_head.weight" and _tied(model))]
    return {names.get_name(k, try_suffixes=(".weight", ".bias")) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", required=True, help="an `aligntax els distill` folder")
    ap.add_argument("--data", default="orbench-hard-test")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", help="fp32 or bf16: the GGUF's matrices and both models")
    ap.add_argument("--lora-scale", type=float, default=1.0)
    ap.add_argument("--model", default=None, help="default: the adapter's model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from aligntax.bundles.export import export_lora_model
    from aligntax.bundles.gguf import greedy_agreement, read_summary
    from aligntax.data import load_prompts
    from aligntax.interventions.lora import ElsLora
    from aligntax.models import load_model

    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    adapter = Path(args.adapter)
    spec = args.model or json.loads((adapter / "els_lora.json").read_text())["fingerprint"]["spec"]
    lm = load_model(spec, dtype=args.dtype, device="cpu")
    path = out / "model.gguf"
    t0 = time.time()
    if not path.exists():
        export_lora_model(lm, adapter, path, scale=args.lora_scale, format="gguf")
    export_s = time.time() - t0
    summary = read_summary(path)
    names = set(summary["tensors"])
    want = expected_tensors(lm.model)
    prompts = [it.prompt for it in load_prompts(args.data)][: args.limit]
    back = load_model(str(path), dtype=args.dtype, device="cpu")
    iv = ElsLora.load(adapter, lm, scale=args.lora_scale)
    t0 = time.time()
    hooks = greedy_agreement(lm, back, prompts, args.max_new_tokens, args.batch_size, intervention=iv)
    res = {
        "adapter": str(adapter),
        "model": spec,
        "data": args.data,
        "dtype": args.dtype,
        "lora_scale": args.lora_scale,
        "gguf": {
            "bytes": path.stat().st_size,
            "architecture": summary["architecture"],
            "file_type": summary["file_type"],
            "tensors": len(names),
            "expected_tensors_present": want <= names,
            "unexpected_tensors": sorted(names - want),
            "chat_template_equal": summary["chat_template"] == lm.tokenizer.chat_template,
            "pre_tokenizer": summary["pre_tokenizer"],
            "n_tokens": summary["n_tokens"],
            "export_seconds": round(export_s, 1),
        },
        "gguf_vs_hooks": hooks,
        "compare_seconds": round(time.time() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")  # the comparison, before the control
    plain = greedy_agreement(lm, back, prompts, args.max_new_tokens, args.batch_size)
    res["gguf_vs_unsteered"] = {k: v for k, v in plain.items() if k != "first_difference"}
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
