"""Chat templating and left-padded batch encoding."""

from __future__ import annotations

from typing import Protocol

import torch

from aligntax.errors import AligntaxError


class MessageRewriter(Protocol):
    """What chat building needs of an intervention (:class:`aligntax.interventions.base.Intervention`):
    typed structurally so this module does not import the intervention layer above it."""

    def prepare_messages(self, messages: list[dict]) -> list[dict]: ...


def build_messages(
    prompt: str | list[dict], system: str | None = None, intervention: MessageRewriter | None = None
) -> list[dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages = [{"role": "system", "content": system}] + [m for m in messages if m["role"] != "system"]
    if intervention is not None:
        messages = intervention.prepare_messages(messages)
    return messages


def render_chat(tokenizer, messages: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise AligntaxError("This model's tokenizer has no chat template; chat generation needs one.")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode_chats(tokenizer, texts: list[str], device) -> dict[str, torch.Tensor]:
    """Tokenise already-templated texts with left padding (the template holds the special tokens)."""
    if tokenizer.padding_side != "left":
        tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
