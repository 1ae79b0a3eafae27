"""OpenAI-compatible serving with per-request steering and dynamic batching.

``create_app(lm, intervention, ServerSettings(...))`` builds the FastAPI app; ``serve(app)`` runs it with
uvicorn; ``aligntax.cli.serve.serve_command`` is the ``aligntax serve`` command. The pieces: settings
(every server setting declared once), security (the door), handler (what the routes ask), router (the
routes), app (the assembly); engine (batched decoding) behind the ServeEngine protocol of base.
"""

from aligntax.serve.app import create_app, default_model_name, serve
from aligntax.serve.engine import BatchEngine
from aligntax.serve.jobs import Job, SamplingParams
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.protocol import APIError, ChatCompletionRequest
from aligntax.serve.settings import ServerSettings

__all__ = [
    "APIError",
    "BatchEngine",
    "ChatCompletionRequest",
    "Job",
    "SamplingParams",
    "ServeMetrics",
    "ServerSettings",
    "create_app",
    "default_model_name",
    "serve",
]
