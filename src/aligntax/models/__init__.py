"""Model specs, the embedded models, loading and layer discovery."""

from aligntax.models.embedded import EMBEDDED_MODELS, EmbeddedModel, fetch_embedded
from aligntax.models.layers import decoder_layers, hidden_size, num_layers
from aligntax.models.loader import LoadedModel, load_model, model_info
from aligntax.models.spec import DEFAULT_MODEL, ModelSpec, parse_spec

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "LoadedModel",
    "ModelSpec",
    "decoder_layers",
    "fetch_embedded",
    "hidden_size",
    "load_model",
    "model_info",
    "num_layers",
    "parse_spec",
]
