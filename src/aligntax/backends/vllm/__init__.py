"""The vLLM backend: continuous batching with per-request steering (an optional install:
``./run setup-vllm`` builds ``.venv-vllm``). vLLM is imported only when an engine starts.

- :mod:`~aligntax.backends.vllm.steering`: the token-to-request mapping and the row kernels' edits
  inside vLLM's flat token batches (torch only);
- :mod:`~aligntax.backends.vllm.worker`: the worker extension that hooks the model vLLM runs;
- :mod:`~aligntax.backends.vllm.engine`: :class:`~aligntax.backends.vllm.engine.VllmModel`, offline
  generation returning aligntax's ``Generation`` records.
"""

from aligntax.backends.vllm.steering import EXTRA_STEER, EXTRA_STRENGTH, BatchSteering, parse_request

__all__ = ["EXTRA_STEER", "EXTRA_STRENGTH", "BatchSteering", "parse_request"]
