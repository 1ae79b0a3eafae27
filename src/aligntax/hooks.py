"""The bottom of the steering stack: hook registration, hidden-state access in a decoder block's call,
and left-padded batches with position ids from the attention mask.

Torch only: this module imports nothing else of aligntax, so every layer above (activations,
generation, interventions) can use it without an import cycle. The old import paths
(``aligntax.interventions.base``, ``aligntax.activations.capture``) re-export these names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def hooks_attached(
    registrations: list[tuple[nn.Module, Callable[..., Any], bool]],
) -> Iterator[None]:
    """Register (module, hook, is_pre) hooks and remove them on exit, even after an exception."""
    handles = []
    try:
        for module, hook, is_pre in registrations:
            if is_pre:
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def replace_hidden_in_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], new_hidden: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return (args, kwargs) of a decoder block call with the hidden states replaced."""
    if args:
        return (new_hidden, *args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = new_hidden
    return args, kwargs


def hidden_from_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    h: torch.Tensor = args[0] if args else kwargs["hidden_states"]
    return h


_CACHE_KWARG: dict[type, str] = {}


def with_cache(model: nn.Module, cache: Any, **kwargs: Any) -> dict[str, Any]:
    """``kwargs`` plus the KV cache under the keyword ``model``'s forward takes it by: ``cache`` in recent
    transformers, ``past_key_values`` in earlier 5.x releases (which would silently ignore ``cache=``)."""
    kind = type(model)
    if kind not in _CACHE_KWARG:
        import inspect

        params = inspect.signature(kind.forward).parameters
        _CACHE_KWARG[kind] = "cache" if "cache" in params else "past_key_values"
    return {**kwargs, _CACHE_KWARG[kind]: cache}


def pad_left(
    seqs: list[list[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id sequences as a left-padded ``(input_ids, attention_mask)`` batch on ``device``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 0)
