"""Sharing steering: bundles (a trained steering folder packed with a model card, saved, loaded from a
folder or the Hugging Face Hub, pushed to it) and vector steering baked into a model's weights."""

from aligntax.bundles.bundle import (
    Bundle,
    check_files,
    from_pretrained,
    load_bundle,
    push_to_hub,
    resolve_bundle,
    save_pretrained,
)

__all__ = [
    "Bundle",
    "check_files",
    "from_pretrained",
    "load_bundle",
    "push_to_hub",
    "resolve_bundle",
    "save_pretrained",
]
