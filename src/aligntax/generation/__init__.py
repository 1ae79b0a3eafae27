"""Batched chat generation with left padding, interventions and progress bars."""

from aligntax.generation.chat import build_messages, encode_chats, render_chat
from aligntax.generation.first_token import first_token_refusal_score
from aligntax.generation.generate import Generation, GenerationConfig, generate, iter_generate, prompt_logits

__all__ = [
    "Generation",
    "GenerationConfig",
    "build_messages",
    "encode_chats",
    "first_token_refusal_score",
    "generate",
    "iter_generate",
    "prompt_logits",
    "render_chat",
]
