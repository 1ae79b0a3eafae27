"""OpenAI-compatible serving with per-request steering and dynamic batching.

``create_app(lm, intervention, model_name)`` builds the FastAPI app; ``serve(...)`` runs it with
uvicorn; ``aligntax.cli.serve.serve_command`` is the ``aligntax serve`` command.
"""

from aligntax.serve.app import create_app, default_model_name, serve
from aligntax.serve.engine import BatchEngine
from aligntax.serve.jobs import Job, SamplingParams
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.protocol import APIError, ChatCompletionRequest

__all__ = [
    "APIError",
    "BatchEngine",
    "ChatCompletionRequest",
    "Job",
    "SamplingParams",
    "ServeMetrics",
    "create_app",
    "default_model_name",
    "serve",
]
