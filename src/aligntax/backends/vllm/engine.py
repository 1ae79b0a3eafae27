"""Offline generation with vLLM, steered per request, returning aligntax's ``Generation`` records.

:class:`VllmModel` starts a ``vllm.LLM`` in eager mode with the steering worker extension
(:mod:`aligntax.backends.vllm.worker`), registers steering presets (each a folder or intervention name
loaded once per worker) and generates: prompts are rendered with the model's chat template and
tokenised here, with the same tokenizer the Hugging Face backend uses, so both backends decode the
same token ids; each request carries its preset and strength in ``SamplingParams.extra_args``, and a
steered request's prefix-cache entries are salted per (preset, strength) (``cache_salt``), so steered
KV states are never shared with plain requests or other settings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aligntax.backends.vllm.steering import EXTRA_PROMPT_NLL, EXTRA_STEER, EXTRA_STRENGTH, MAX_STRENGTH
from aligntax.backends.vllm.worker import EXTENSION
from aligntax.errors import AligntaxError
from aligntax.generation.chat import build_messages, render_chat
from aligntax.generation.generate import Generation, GenerationConfig, truncate_at_stop

DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
}


def available() -> bool:
    """Whether vLLM can be imported here (``./run setup-vllm`` builds ``.venv-vllm`` with it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    if not available():
        raise AligntaxError(
            "The vLLM backend needs vLLM: run `./run setup-vllm` and use .venv-vllm/bin/aligntax."
        )


@dataclass
class VllmOptions:
    """Engine settings (CPU-sized defaults)."""

    max_model_len: int = 4096  # capped at the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # chunked prefill splits prompts longer than this
    enable_prefix_caching: bool = True
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE (whole GiB), when not set in the environment
    seed: int = 0


@dataclass
class ModelFacts:
    """What the intervention loaders read of a model (``fingerprint``, sizes), from its folder."""

    spec: str
    source: str
    tokenizer: object
    fingerprint: dict | None
    hidden_size: int | None
    num_layers: int | None
    max_positions: int | None = None


def resolve_source(spec: str) -> tuple[str, str]:
    """A model spec as vLLM loads it: ``(spec, folder or Hub id)``; embedded models are fetched."""
    from aligntax.models.spec import parse_spec

    ms = parse_spec(spec)
    if ms.kind == "embedded":
        from aligntax.models.embedded import fetch_embedded

        return ms.raw, str(fetch_embedded(ms.value))
    if ms.kind == "gguf":
        raise AligntaxError("The vLLM backend loads model folders and Hub ids, not .gguf files.")
    return ms.raw, ms.value


def folder_fingerprint(folder: str | Path, spec: str, dtype: str | None = None) -> dict | None:
    """:func:`aligntax.models.loader.model_fingerprint` read from a model folder's config and
    safetensors (no model built), of the weights as loaded in ``dtype`` (the digest rounds the
    embedding rows as that dtype holds them); None for a Hub id or a folder without safetensors."""
    import torch
    from safetensors import safe_open

    from aligntax.models.loader import embedding_digests

    folder = Path(folder)
    cfg_path = folder / "config.json"
    files = sorted(folder.glob("*.safetensors"))
    if not cfg_path.is_file() or not files:
        return None
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config") or cfg
    for f in files:
        with safe_open(str(f), "pt") as fh:
            name = next((k for k in fh.keys() if k.endswith("embed_tokens.weight")), None)  # noqa: SIM118
            if name is None:
                continue
            emb = fh.get_slice(name)
            vocab = int(emb.get_shape()[0])
            rows = emb[: min(64, vocab)]
            if dtype is not None:
                rows = rows.to(getattr(torch, DTYPES[dtype]))
            digest, exact = embedding_digests(rows)
            return {
                "spec": spec,
                "model_type": text.get("model_type", cfg.get("model_type")),
                "num_layers": int(text["num_hidden_layers"]),
                "hidden_size": int(text["hidden_size"]),
                "vocab_size": vocab,
                "embedding_digest": digest,
                "embedding_digest_dtype": exact,
                "dtype": str(rows.dtype).removeprefix("torch."),
            }
    return None


def model_facts(spec: str, dtype: str | None = None) -> ModelFacts:
    from transformers import AutoConfig, AutoTokenizer

    from aligntax.models.loader import prepare_tokenizer

    spec, source = resolve_source(spec)
    tok = AutoTokenizer.from_pretrained(source)
    prepare_tokenizer(tok)
    cfg = AutoConfig.from_pretrained(source)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    fp = folder_fingerprint(source, spec, dtype) if Path(source).is_dir() else None
    max_pos = getattr(text, "max_position_embeddings", None)
    return ModelFacts(
        spec,
        source,
        tok,
        fp,
        int(text.hidden_size),
        int(text.num_hidden_layers),
        int(max_pos) if max_pos else None,
    )


def engine_kwargs(source: str, dtype: str, options: VllmOptions, max_model_len: int) -> dict:
    """The engine arguments of both engines (``vllm.LLM`` and ``AsyncLLM``): eager mode (the steering
    hooks are Python), the steering worker extension, the model's own generation config left out
    (sampling settings come with each request). Sets ``VLLM_CPU_KVCACHE_SPACE`` unless it is set."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(options.kv_cache_gib)))
    extra = {}
    if options.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = options.max_num_batched_tokens
        extra["enable_chunked_prefill"] = True
    return dict(
        model=source,
        tokenizer=source,
        dtype=DTYPES[dtype],
        enforce_eager=True,
        worker_extension_cls=EXTENSION,
        max_model_len=max_model_len,
        max_num_seqs=options.max_num_seqs,
        enable_prefix_caching=options.enable_prefix_caching,
        seed=options.seed,
        generation_config="vllm",
        **extra,
    )


def _greedy_extras(source: str) -> dict:
    """Sampling settings of the model's generation config that the Hugging Face backend's greedy
    decoding applies (``model.generate`` honours them): the repetition penalty."""
    from transformers import GenerationConfig as HFGenerationConfig

    try:
        gc = HFGenerationConfig.from_pretrained(source)
    except OSError:
        return {}
    rp = getattr(gc, "repetition_penalty", None)
    return {"repetition_penalty": float(rp)} if rp not in (None, 1.0) else {}


def eos_ids(source: str, tok) -> set[int]:
    from transformers import GenerationConfig as HFGenerationConfig

    try:
        ids = HFGenerationConfig.from_pretrained(source).eos_token_id
    except OSError:
        ids = None
    ids = set(ids if isinstance(ids, list) else [ids]) | {tok.eos_token_id}
    return {int(i) for i in ids if i is not None}


class VllmModel:
    """A vLLM engine on an aligntax model spec, with steering presets (see the module docstring)."""

    def __init__(self, spec: str, dtype: str = "bf16", options: VllmOptions | None = None) -> None:
        require_vllm()
        from vllm import LLM

        if dtype not in DTYPES:
            raise AligntaxError(f"Unknown dtype '{dtype}'; use bf16, fp16 or fp32.")
        self.options = options = options or VllmOptions()
        self.facts = model_facts(spec, dtype)
        self.spec, self.source, self.tokenizer = self.facts.spec, self.facts.source, self.facts.tokenizer
        self.fingerprint = self.facts.fingerprint
        self.dtype = dtype
        self.max_model_len = min(options.max_model_len, self.facts.max_positions or options.max_model_len)
        self.llm = LLM(**engine_kwargs(self.source, dtype, options, self.max_model_len))
        self.eos_ids = eos_ids(self.source, self.tokenizer)
        self.greedy_extras = _greedy_extras(self.source)
        self.presets: dict[str, dict] = {}
        self.interventions: dict[str, object] = {}  # preset -> the intervention as built in this process
        # a Hugging Face copy of the model for the per-row decisions made before generating (loaded on
        # first need by aligntax.backends.vllm.evaluate, or set by a caller that holds one)
        self.hf = None

    def close(self) -> None:
        """Shut the engine's core (and its child process) down; the object is unusable afterwards."""
        import contextlib

        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()

    # ---- LoadedModel-like facts (for intervention loaders and run folders) ----------------------------
    @property
    def hidden_size(self) -> int | None:
        return self.facts.hidden_size

    @property
    def num_layers(self) -> int | None:
        return self.facts.num_layers

    # ---- steering presets -------------------------------------------------------------------------------
    def register(self, preset: str, source: str, /, **options) -> dict:
        """Load the intervention ``source`` (a folder or name; ``options`` as for
        :func:`aligntax.load_intervention`, e.g. ``name="refusal-ablation"``, ``eta=0.3``) in every worker
        as ``preset``. It is first built here against this model's fingerprint and sizes (a folder
        made for another model is refused). Returns its resolved config."""
        from aligntax.api import load_intervention

        return self.register_built(
            preset, source, load_intervention(source, self.facts, **dict(options)), options
        )

    def register_built(self, preset: str, source: str, local, options: dict) -> dict:
        """:meth:`register` with the intervention already built here from ``source`` and ``options``
        (``local``, kept in :attr:`interventions`): only the workers build it again."""
        if local.rewrites_messages():
            raise AligntaxError(
                f"Intervention '{local.name}' rewrites the chat messages: pass it to "
                "generate(intervention=...) instead of registering it."
            )
        configs = self.llm.collective_rpc("aligntax_register", args=(preset, str(source), dict(options)))
        self.presets[preset] = configs[0]
        self.interventions[preset] = local
        return configs[0]

    def summary(self) -> dict:
        """The workers' steering statistics per preset and any errors."""
        return self.llm.collective_rpc("aligntax_summary")[0]

    def trace(self, on: bool = True) -> list[tuple]:
        """Start/stop recording edited tokens (request id, position, layer, where); returns the record."""
        return [tuple(t) for t in self.llm.collective_rpc("aligntax_trace", args=(on,))[0]]

    # ---- generation ----------------------------------------------------------------------------------
    def surprisal_span(self, preset: str | None) -> tuple[int, int] | None:
        """The chat template's span to score each prompt's surprisal with, when preset ``preset``'s
        decision reads it (ELS ``max_prompt_surprisal``; None otherwise)."""
        from aligntax.interventions.kernels import nll_span

        local = self.interventions.get(preset) if preset is not None else None
        if local is None:
            return None
        return nll_span(local.kernel(self.facts.num_layers, self.facts.hidden_size))

    def prompt_nll(self, ids: Sequence[Sequence[int]], span: tuple[int, int]) -> list[float]:
        """Each chat-templated prompt's surprisal (:func:`aligntax.surprisal.logprob_nll`: the mean NLL of
        the user message's tokens) from the engine's own log-probabilities of the prompt tokens, in one
        unsteered call that generates a single token: what the Hugging Face backend's hooks score inside
        the prompt's forward."""
        from vllm import SamplingParams

        from aligntax.surprisal import logprob_nll

        if not ids:
            return []
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=0.0)
        outs = self.llm.generate([{"prompt_token_ids": list(x)} for x in ids], sp, use_tqdm=False)
        return [
            logprob_nll(own_logprobs(out.prompt_logprobs, x), span) for out, x in zip(outs, ids, strict=True)
        ]

    def encode(
        self, prompts: Sequence[str | list[dict]], system: str | None = None, intervention=None
    ) -> tuple[list[str], list[list[int]]]:
        """Chat-templated texts and their token ids, as the Hugging Face backend renders them."""
        texts = [render_chat(self.tokenizer, build_messages(p, system, intervention)) for p in prompts]
        return texts, [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def generate(
        self,
        prompts: Sequence[str | list[dict]],
        cfg: GenerationConfig | None = None,
        steer: str | None = None,
        strengths: Sequence[float] | None = None,
        steer_rows: Sequence[bool] | None = None,
        intervention=None,
        progress: bool = False,
        ignore_eos: bool = False,
    ) -> tuple[list[Generation], list[dict | None]]:
        """Generate for every prompt in one vLLM call (continuous batching). ``steer`` names a registered
        preset; ``strengths`` / ``steer_rows`` set each prompt's strength (0 / False: plain). An
        ``intervention`` that rewrites messages (a system prompt) is applied to them here. ``ignore_eos``
        generates exactly ``max_new_tokens`` tokens per prompt (benchmarks: the same work steered and
        not; the response still ends at the first end token, ``n_tokens`` counts every token). Returns the
        generations in input order and, per prompt, what the steering decided (None: not steered)."""
        from vllm import SamplingParams

        cfg = cfg or GenerationConfig()
        if steer is not None and steer not in self.presets:
            raise AligntaxError(
                f"Unknown steering preset {steer!r}; registered: {', '.join(self.presets) or 'none'}."
            )
        texts, ids = self.encode(prompts, cfg.system, intervention)
        too_long = [i for i, x in enumerate(ids) if len(x) + 1 > self.max_model_len]
        if too_long:
            raise AligntaxError(
                f"Prompt {too_long[0]} has {len(ids[too_long[0]])} tokens; the engine's "
                f"max_model_len is {self.max_model_len}."
            )
        scale = []
        for i in range(len(ids)):
            s = 0.0 if steer is None else float(strengths[i]) if strengths is not None else 1.0
            if steer_rows is not None and not steer_rows[i]:
                s = 0.0
            if not 0.0 <= s <= MAX_STRENGTH:
                raise AligntaxError(f"Strength {s} of prompt {i} is outside [0, {MAX_STRENGTH:g}].")
            scale.append(s)
        span = self.surprisal_span(steer)
        nll: dict[int, float] = {}
        if span is not None and cfg.max_new_tokens > 0:
            steered = [i for i, s in enumerate(scale) if s > 0]
            nll = dict(zip(steered, self.prompt_nll([ids[i] for i in steered], span), strict=True))
        reqs, params = [], []
        for i, x in enumerate(ids):
            s = scale[i]
            extra = {EXTRA_STEER: steer, EXTRA_STRENGTH: s} if steer is not None and s > 0 else None
            if extra is not None and i in nll:
                extra[EXTRA_PROMPT_NLL] = nll[i]
            prompt = {"prompt_token_ids": list(x)}
            if extra is not None:
                prompt["cache_salt"] = f"aligntax:{steer}:{s!r}"
            sp = dict(max_tokens=cfg.max_new_tokens, detokenize=False, extra_args=extra)
            if ignore_eos:
                sp["ignore_eos"] = True
            else:
                sp["stop_token_ids"] = sorted(self.eos_ids)
            if cfg.do_sample:
                sp.update(
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    seed=None if cfg.seed is None else cfg.seed + i,
                )
            else:
                sp.update(temperature=0.0, **self.greedy_extras)
            reqs.append(prompt)
            params.append(SamplingParams(**sp))
        if cfg.max_new_tokens <= 0:
            return [
                Generation(
                    prompt=p if isinstance(p, str) else t,
                    response="",
                    n_prompt_tokens=len(x),
                    n_tokens=0,
                    finish_reason="length",
                )
                for p, t, x in zip(prompts, texts, ids, strict=True)
            ], [None] * len(prompts)
        self.llm.collective_rpc("aligntax_records")  # drop records of earlier calls
        outputs = self.llm.generate(reqs, params, use_tqdm=progress)
        records = self.llm.collective_rpc("aligntax_records")[0] if steer is not None else {}
        by_external = {rid.rsplit("-", 1)[0]: r for rid, r in records.items()}
        gens, decided = [], []
        for p, text, x, out in zip(prompts, texts, ids, outputs, strict=True):
            row = list(out.outputs[0].token_ids)
            n, finish = len(row), "length"
            for j, t in enumerate(row):
                if t in self.eos_ids:
                    n, finish = j, "stop"
                    break
            resp = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            resp, stopped = truncate_at_stop(resp, cfg.stop)
            gens.append(
                Generation(
                    prompt=p if isinstance(p, str) else text,
                    response=resp.strip(),
                    n_prompt_tokens=len(x),
                    n_tokens=len(row) if ignore_eos else n,
                    finish_reason="stop" if stopped else finish,
                )
            )
            decided.append(by_external.get(out.request_id))
        return gens, decided


def own_logprobs(prompt_logprobs, ids: Sequence[int]) -> list[float | None]:
    """The log-probability of each prompt token given the tokens before it (``[0]``: None), from a vLLM
    output's ``prompt_logprobs`` (one mapping of token id to logprob per position)."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(ids):
        raise AligntaxError("The engine returned no log-probabilities for the prompt's tokens.")
    out: list[float | None] = [None]
    for p in range(1, len(ids)):
        entry = prompt_logprobs[p]
        lp = None if entry is None else entry.get(int(ids[p]))
        out.append(None if lp is None else float(getattr(lp, "logprob", lp)))
    return out


def prepare(vm: VllmModel, intervention: str | None, args: dict | None, preset: str = "steer"):
    """The intervention a command names, on ``vm`` (a :class:`VllmModel` or an
    :class:`~aligntax.backends.vllm.serving.AsyncVllm`), built once here: a steering method is
    registered as ``preset`` (returns ``(preset, None)``; the built intervention is
    ``vm.interventions[preset]``); one that rewrites messages is returned (``(None, intervention)``)."""
    from aligntax.interventions.options import split_path
    from aligntax.interventions.registry import make_intervention

    if not intervention or intervention == "none":
        return None, None
    args = dict(args or {})
    local = make_intervention(intervention, vm.facts, **args)
    if local.rewrites_messages():
        return None, local
    source, rest = split_path(args, intervention)
    if source is None:
        raise AligntaxError(f"Intervention '{intervention}' needs its folder (--steer or --vectors).")
    vm.register_built(preset, str(source), local, {"name": intervention, **rest})
    return preset, None
