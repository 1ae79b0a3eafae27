"""Vector steering baked into a model's weights: ``aligntax export``.

The result is a plain Hugging Face model folder (config, safetensors, tokenizer with its chat template,
generation config) that any ``AutoModelForCausalLM.from_pretrained`` loads and runs without aligntax.

- **Direction ablation** (``refusal-ablation``, ``false-refusal-ablation``), weight orthogonalisation
  (Arditi et al. 2024): for the unit direction ``r``, every matrix that writes into the residual stream
  (the token embeddings, each attention output projection, each MLP down projection, and their biases
  where present) becomes ``W - r r^T W``. No write into the stream then has a component along ``r``,
  so the stream never holds one: the edit is exactly ablating ``r`` from the residual stream at every
  position of every block's input, between its attention and its MLP, and at the last block's output.
  A model with tied input and output embeddings is untied (the LM head keeps the original matrix).
- **Activation addition** (``refusal-add``; ``refusal-addition`` is accepted too): ``coeff * v`` added to the states entering block
  ``L`` at every position is a bias on the last write of block ``L - 1``, its MLP down projection
  (Llama configs have ``mlp_bias``; Qwen2 and Mistral without a sliding window are Llama models with
  other fixed biases and are written as ``LlamaForCausalLM``), or, for ``L = 0``, an offset on every
  row of the embedding matrix. Qwen3 and Gemma have no MLP bias: only ``L = 0`` is exported for them.

Only architectures whose residual stream is written by exactly those modules are exported (Llama,
Mistral, Qwen2, Qwen3, Gemma); models with norms after the attention or MLP output (Gemma 2/3) are
refused, as are ELS and CAST, which decide from the state during generation and have no weight form.

``format="gguf"`` writes the same weights as one GGUF file for llama.cpp and ollama instead of the folder
(:mod:`aligntax.bundles.gguf`: Qwen2 and Llama, the tokenizer and chat template inside, the export
record under ``aligntax.export``).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from aligntax.errors import AligntaxError
from aligntax.models.layers import decoder_layers

__all__ = [
    "BAKEABLE",
    "FORMATS",
    "ExportInfo",
    "bake",
    "export_lora_model",
    "export_model",
    "hook_equivalent",
    "merge_lora",
]

FORMAT = "aligntax.export/1"
INFO_FILE = "aligntax_export.json"
FORMATS = ("hf", "gguf")  # a Hugging Face model folder, or one GGUF file
# method -> (name in aligntax.interventions.registry, vector kind, edit)
BAKEABLE = {
    "refusal-ablation": ("refusal-ablation", "refusal", "ablate"),
    "false-refusal-ablation": ("false-refusal-ablation", "false_refusal", "ablate"),
    "refusal-add": ("refusal-add", "refusal", "add"),
}
_REMOVED = {"refusal-addition": "refusal-add"}  # names removed in 0.2 -> the name now (CHANGELOG.md)
_STATEFUL = {
    "els": "ELS moves each state along the gradient of an energy model of that state, and decides per row "
    "(harm gate, row energy) at generation time",
    "cast": "CAST decides per row from the prompt's state at a condition layer whether to steer",
}
# residual stream written only by embed_tokens, self_attn.o_proj and mlp.down_proj of every block
_SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma")
# an addition at block L > 0 is a bias on the last write of block L - 1, its MLP down projection: Llama
# configs have an option for MLP biases; Qwen2 and Mistral (full attention) are Llama models with other
# fixed bias settings, written as LlamaForCausalLM; Qwen3 and Gemma have no MLP bias and are refused
_AS_LLAMA = ("qwen2", "mistral")
# extra norms around the sub-layer outputs: the writers into the stream are norms, not projections
_SANDWICH_NORMS = ("post_feedforward_layernorm", "pre_feedforward_layernorm")


@dataclass
class ExportInfo:
    """What an export baked in; written to ``aligntax_export.json`` beside the weights."""

    method: str
    vector: str
    layer: int
    coeff: float
    edit: str  # "ablate" or "add"
    writers: list[str] = field(default_factory=list)  # the parameters changed
    architecture: str = ""
    source_architecture: str = ""
    untied_embeddings: bool = False
    dtype: str = ""
    base_model: dict = field(default_factory=dict)  # fingerprint of the model the edit was made on
    vectors_fingerprint: dict = field(default_factory=dict)
    vector_norm: float = 0.0
    format: str = FORMAT


def canonical_method(method: str) -> str:
    """The export name of ``method``; a clear error for methods that cannot be baked into weights."""
    if method in _REMOVED:
        raise AligntaxError(f"'{method}' was removed in 0.2; use '{_REMOVED[method]}' (CHANGELOG.md).")
    if method in BAKEABLE or method == "els-lora":  # els-lora: merged by export_lora_model
        return method
    if method in _STATEFUL:
        raise AligntaxError(
            f"'{method}' cannot be baked into weights: {_STATEFUL[method]}, which no fixed weight "
            "edit reproduces. Share it as a steering bundle instead (aligntax bundle save)"
            + (
                ", or distil it into a LoRA adapter (aligntax els distill) and export that as els-lora."
                if method == "els"
                else "."
            )
        )
    raise AligntaxError(f"Cannot export '{method}'; exportable: {', '.join(BAKEABLE)}.")


def hook_equivalent(vectors_dir: str | Path, lm, method: str, layer: int | None = None, coeff: float = 1.0):
    """The hook-based intervention an export of ``method`` computes exactly: the registry's vector method
    with the same direction (``layer``), ``coeff``, every layer and every position. For an ablation that
    is :class:`~aligntax.interventions.vectors.DirectionAblation`, which removes the direction from every
    block's input, every attention output and the last block's output, as the orthogonalised weights do;
    for an addition, :class:`~aligntax.interventions.vectors.ActivationAddition` at the block's input."""
    from aligntax.interventions.registry import make_intervention

    name, _, _ = BAKEABLE[_vector_method(method)]
    return make_intervention(name, lm, dir=str(vectors_dir), layer=layer, coeff=coeff, positions="all")


def _vector_method(method: str) -> str:
    method = canonical_method(method)
    if method not in BAKEABLE:
        raise AligntaxError(f"'{method}' is not a vector method: export it with export_lora_model.")
    return method


def _check_architecture(model: nn.Module, method: str, edit: str, block: int) -> str:
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in _SUPPORTED:
        raise AligntaxError(
            f"Cannot export to weights for model type '{mt}': supported are {', '.join(_SUPPORTED)} "
            "(architectures whose residual stream is written only by the embeddings, the attention "
            "output projections and the MLP down projections)."
        )
    for i, blk in enumerate(decoder_layers(model)):
        if any(hasattr(blk, n) for n in _SANDWICH_NORMS):
            raise AligntaxError(
                f"Block {i} of this {mt} model normalises its sub-layer outputs before adding them "
                "to the residual stream, so no weight edit ablates or adds a direction exactly."
            )
        if not isinstance(
            getattr(getattr(blk, "self_attn", None), "o_proj", None), nn.Linear
        ) or not isinstance(getattr(getattr(blk, "mlp", None), "down_proj", None), nn.Linear):
            raise AligntaxError(f"Block {i} has no self_attn.o_proj / mlp.down_proj linear layers to edit.")
    if edit == "add" and block > 0:
        if mt in ("qwen3", "gemma"):
            raise AligntaxError(
                f"A {mt} model has no MLP bias (no config option for one), so an addition at the "
                f"input of block {block} has no exact weight form; only block 0 (the embeddings) "
                "can carry an addition for it."
            )
        if mt == "qwen2" and any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            raise AligntaxError(
                "This Qwen2 model uses sliding-window attention: it cannot be written as a Llama "
                "model with biases, so an addition at a block other than 0 cannot be exported."
            )
        if mt == "mistral" and getattr(cfg, "sliding_window", None) is not None:
            raise AligntaxError(
                "This Mistral model has a sliding window and no bias option: an addition at a block "
                "other than 0 cannot be exported exactly (a block-0 addition goes into the embeddings)."
            )
    return mt


def _as_llama(model: nn.Module) -> nn.Module:
    """A float32 ``LlamaForCausalLM`` computing what a Qwen2 / Mistral ``model`` (full attention) computes,
    with (zero) MLP biases, and attention biases for Qwen2 (zero on the output projection)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    src = model.config
    d = src.to_dict()
    keys = set(LlamaConfig().to_dict())
    kwargs = {
        k: v
        for k, v in d.items()
        if k in keys
        and k
        not in (
            "architectures",
            "model_type",
            "transformers_version",
            "attention_bias",
            "mlp_bias",
            "head_dim",
            "dtype",
        )
    }
    head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    attention_bias = src.model_type == "qwen2"  # q, k, v biases (o_proj's stays zero)
    cfg = LlamaConfig(**kwargs, head_dim=head_dim, attention_bias=attention_bias, mlp_bias=True)
    cfg.architectures = ["LlamaForCausalLM"]
    new = LlamaForCausalLM(cfg).float()
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    for name, p in new.named_parameters():
        if name not in state and name.endswith(".bias"):
            state[name] = torch.zeros(p.shape, dtype=torch.float32)
    missing, unexpected = new.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise AligntaxError(
            f"Cannot write this {src.model_type} model as Llama: missing {missing}, unexpected {unexpected}."
        )
    if cfg.tie_word_embeddings:
        new.tie_weights()
    new.generation_config = copy.deepcopy(model.generation_config)
    return new.eval()


def _enable_mlp_biases(model: nn.Module) -> None:
    """Give every MLP projection of a Llama model a (zero) bias and set ``mlp_bias`` in the config."""
    for blk in decoder_layers(model):
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(blk.mlp, name)
            if lin.bias is None:
                lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype))
    model.config.mlp_bias = True


def _untie(model: nn.Module) -> bool:
    """Give the LM head its own copy of the embedding matrix when the two are tied; True if they were."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not emb.weight and head.weight.data_ptr() != emb.weight.data_ptr():
        return False
    head.weight = nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None and text is not model.config:
        text.tie_word_embeddings = False
    return True


@torch.no_grad()
def _orthogonalise(lin: nn.Linear, r: torch.Tensor) -> None:
    """``W - r r^T W`` (and ``b - r r^T b``) for a linear layer writing into the stream (out = hidden)."""
    w = lin.weight
    w.sub_(torch.outer(r, r @ w))
    if lin.bias is not None:
        lin.bias.sub_(r * (r @ lin.bias))


def bake(
    model: nn.Module, method: str, vector: torch.Tensor, layer: int, coeff: float = 1.0
) -> tuple[nn.Module, ExportInfo]:
    """A float32 copy of ``model`` with ``method`` baked into its weights (``model`` is not changed).

    ``vector`` is the direction (ablation) or the added vector (addition, at the input of block
    ``layer``, scaled by ``coeff``). Returns the new model and what was changed."""
    method = _vector_method(method)
    _, kind, edit = BAKEABLE[method]
    n = len(decoder_layers(model))
    layer = int(layer) + n if int(layer) < 0 else int(layer)
    if not 0 <= layer < n:
        raise AligntaxError(f"Layer {layer} does not exist: the model has {n} layers.")
    v = vector.detach().float().cpu()
    if v.ndim != 1 or not torch.isfinite(v).all() or float(v.norm()) == 0:
        raise AligntaxError("The vector to bake in must be one finite, non-zero vector.")
    if edit == "ablate" and float(coeff) != 1.0:
        raise AligntaxError(
            f"Only a full ablation (coeff 1) has a weight form; got coeff {coeff}. Removing part of "
            "the component at every block input compounds across blocks, which no weight edit matches."
        )
    mt = _check_architecture(model, method, edit, layer)
    source_arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    info = ExportInfo(
        method=method,
        vector=kind,
        layer=layer,
        coeff=float(coeff),
        edit=edit,
        source_architecture=source_arch,
        vector_norm=float(v.norm()),
    )
    if edit == "add" and layer > 0 and mt in _AS_LLAMA:
        new = _as_llama(model)
    else:
        new = copy.deepcopy(model).float().eval()
    if v.shape[0] != new.config.hidden_size:
        raise AligntaxError(
            f"Vector has size {v.shape[0]}, the model's hidden size is {new.config.hidden_size}."
        )
    info.untied_embeddings = _untie(new)
    blocks = decoder_layers(new)
    names = {id(p): k for k, p in new.named_parameters()}
    emb = new.get_input_embeddings()
    with torch.no_grad():
        if edit == "ablate":
            r = v / v.norm()
            emb.weight.sub_(torch.outer(emb.weight @ r, r))
            changed = [emb.weight]
            for blk in blocks:
                for lin in (blk.self_attn.o_proj, blk.mlp.down_proj):
                    _orthogonalise(lin, r)
                    changed += [lin.weight] + ([lin.bias] if lin.bias is not None else [])
        elif layer == 0:
            scale = math.sqrt(new.config.hidden_size) if new.config.model_type == "gemma" else 1.0
            emb.weight.add_(float(coeff) * v / scale)  # Gemma multiplies the looked-up rows by sqrt(hidden)
            changed = [emb.weight]
        else:
            writer = blocks[layer - 1].mlp.down_proj
            if writer.bias is None:
                _enable_mlp_biases(new)
                names = {id(p): k for k, p in new.named_parameters()}
            writer.bias.add_(float(coeff) * v)
            changed = [writer.bias]
    info.writers = [names.get(id(p), "?") for p in changed]
    info.architecture = (getattr(new.config, "architectures", None) or [type(new).__name__])[0]
    return new, info


def export_model(
    lm,
    vectors_dir: str | Path,
    method: str,
    out: str | Path,
    layer: int | None = None,
    coeff: float = 1.0,
    dtype: str | torch.dtype | None = None,
    format: str = "hf",
) -> Path:
    """Write ``lm`` with the vector method ``method`` (vectors from ``vectors_dir``, checked against the
    model's fingerprint) baked into its weights as a Hugging Face model folder ``out`` (``format="gguf"``:
    as the GGUF file ``out``); returns ``out``.

    ``layer``: the vector's layer (default: the vector folder's chosen layer); for an addition also the
    block whose input receives it. ``dtype``: of the written weights (default: the model's)."""
    from aligntax.interventions.vectors import SteeringVectors
    from aligntax.models.loader import resolve_dtype

    method = _vector_method(method)
    _, kind, _ = BAKEABLE[method]
    vs = SteeringVectors.load(
        vectors_dir,
        expect_fingerprint=dict(lm.fingerprint) if lm.fingerprint else None,
        expect_hidden_size=lm.hidden_size,
    )
    layer = vs.default_layer(kind) if layer is None else int(layer)
    target = resolve_dtype(dtype) if dtype is not None else lm.dtype
    out = _check_out(out, format, lm.model)
    new, info = bake(lm.model, method, vs.get(kind, layer), layer, coeff)
    new = new.to(target)
    new.config.dtype = target
    info.dtype = str(target).replace("torch.", "")
    info.base_model = dict(lm.fingerprint or {})
    info.vectors_fingerprint = dict(vs.fingerprint)
    if format == "gguf":
        return _write_gguf(new, lm, out, asdict(info))
    out.mkdir(parents=True, exist_ok=True)
    new.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    (out / INFO_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")
    (out / "README.md").write_text(_card(info, lm.spec))
    return out


def _check_out(out: str | Path, format: str, model: nn.Module) -> Path:
    """The output path, refused when it is taken; for a GGUF file, also the architecture (before any work)."""
    out = Path(out)
    if format not in FORMATS:
        raise AligntaxError(f"Unknown export format '{format}'; use one of {', '.join(FORMATS)}.")
    if format == "gguf":
        from aligntax.bundles.gguf import check_model

        if out.suffix != ".gguf":
            raise AligntaxError(f"A GGUF export is one file: give --out a name ending in .gguf, not {out}.")
        if out.exists():
            raise AligntaxError(f"{out} exists; choose a new file for the exported model.")
        check_model(model)
        return out
    if out.exists() and any(out.iterdir()):
        raise AligntaxError(f"{out} exists and is not empty; choose a new folder for the exported model.")
    return out


def _write_gguf(new: nn.Module, lm, out: Path, info: dict) -> Path:
    from aligntax.bundles.gguf import write_gguf

    name = f"{lm.spec} + {info['method']}"
    return write_gguf(new, lm.tokenizer, out, dtype=new.dtype, name=name, info={"format": FORMAT, **info})


def _card(info: ExportInfo, spec: str) -> str:
    from aligntax.bundles.card import front_matter, hub_base_model

    meta = {"library_name": "transformers", "tags": ["aligntax", "steering", info.method]}
    base = hub_base_model(spec)
    if base:
        meta["base_model"] = base
    meta["aligntax"] = {"export": asdict(info)}
    what = (
        "the direction removed from every residual-stream write (weight orthogonalisation)"
        if info.edit == "ablate"
        else f"{info.coeff:g} x the vector added to the input of block {info.layer}"
    )
    return front_matter(meta) + (
        f"\n# {spec} with {info.method} baked in\n\n"
        f"Exported by aligntax from `{spec}`: {what}, using the `{info.vector}` vector of layer {info.layer}. "
        f"Architecture `{info.architecture}`, weights in {info.dtype}.\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(PATH)\ntokenizer = AutoTokenizer.from_pretrained(PATH)\n```\n\n"
        f"Changed parameters: {', '.join(info.writers[:6])}{' ...' if len(info.writers) > 6 else ''}\n"
    )


# ---- els-lora: the distilled adapter merged into the weights -------------------------------------------------
def merge_lora(model: nn.Module, iv) -> nn.Module:
    """A float32 copy of ``model`` with the :class:`~aligntax.interventions.lora.ElsLora` adapter ``iv``
    merged (``W + lora_scale * s * B @ A`` for every adapted Linear layer); ``model`` is not changed."""
    from aligntax.interventions.lora import check_modules

    check_modules(model, iv.weights, "the adapter")
    new = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        for name, delta in iv.merged_deltas().items():
            new.get_submodule(name).weight.add_(delta.to(new.get_submodule(name).weight.device))
    return new


def export_lora_model(
    lm,
    adapter_dir: str | Path,
    out: str | Path,
    scale: float | None = None,
    dtype: str | torch.dtype | None = None,
    format: str = "hf",
) -> Path:
    """Write ``lm`` with the els-lora adapter of ``adapter_dir`` (checked against the model) merged into its
    weights, at ``scale`` (default 1), as a plain Hugging Face model folder ``out`` (``format="gguf"``: as
    the GGUF file ``out``); returns ``out``. ``dtype``: of the written weights (default: the model's)."""
    from aligntax.interventions.lora import ElsLora
    from aligntax.models.loader import resolve_dtype

    iv = ElsLora.load(adapter_dir, lm, scale=scale)
    target = resolve_dtype(dtype) if dtype is not None else lm.dtype
    out = _check_out(out, format, lm.model)
    new = merge_lora(lm.model, iv).to(target)
    new.config.dtype = target
    info = {
        "format": FORMAT,
        "method": "els-lora",
        "edit": "merge",
        "lora_scale": iv.scale,
        "writers": sorted(f"{m}.weight" for m in iv.weights),
        "layers": iv.layers,
        "architecture": (getattr(new.config, "architectures", None) or [type(new).__name__])[0],
        "dtype": str(target).replace("torch.", ""),
        "base_model": dict(lm.fingerprint or {}),
        "adapter": {
            "path": str(adapter_dir),
            "sha256": iv.config()["adapter_sha256"],
            "source": (iv.meta.get("source") or {}).get("path"),
        },
    }
    if format == "gguf":
        return _write_gguf(new, lm, out, info)
    out.mkdir(parents=True, exist_ok=True)
    new.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    (out / "README.md").write_text(_lora_card(info, lm.spec))
    return out


def _lora_card(info: dict, spec: str) -> str:
    from aligntax.bundles.card import front_matter, hub_base_model

    meta = {"library_name": "transformers", "tags": ["aligntax", "steering", "els-lora"]}
    base = hub_base_model(spec)
    if base:
        meta["base_model"] = base
    meta["aligntax"] = {"export": info}
    return front_matter(meta) + (
        f"\n# {spec} with els-lora merged in\n\n"
        f"Exported by aligntax from `{spec}`: the LoRA adapter distilled from energy landscape steering "
        f"(`aligntax els distill`, adapter `{info['adapter']['path']}`) merged into blocks {info['layers']} at scale "
        f"{info['lora_scale']:g}. Architecture `{info['architecture']}`, weights in {info['dtype']}.\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(PATH)\ntokenizer = AutoTokenizer.from_pretrained(PATH)\n```\n"
    )
