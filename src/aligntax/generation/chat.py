"""Chat templating and left-padded batch encoding."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from aligntax.errors import AligntaxError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class MessageRewriter(Protocol):
    """What chat building needs of an intervention (:class:`aligntax.interventions.base.Intervention`):
    typed structurally so this module does not import the intervention layer above it."""

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]: ...


def build_messages(
    prompt: str | list[dict[str, Any]], system: str | None = None, intervention: MessageRewriter | None = None
) -> list[dict[str, Any]]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
    if intervention is not None:
        messages = intervention.prepare_messages(messages)
    return messages


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise AligntaxError("This model's tokenizer has no chat template; chat generation needs one.")
    text: str = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text


def encode_chats(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Tokenise already-templated texts with left padding (the template holds the special tokens)."""
    if tokenizer.padding_side != "left":
        tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
