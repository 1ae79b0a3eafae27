"""The one place a generation source is picked from the command line's ``--backend`` and ``--ray``
(:class:`~aligntax.generation.source.GenerationSource`); everything below takes the source it is given."""

from __future__ import annotations

from aligntax.backends import check_backend
from aligntax.errors import AligntaxError
from aligntax.generation.source import GenerationSource


def generation_source(backend: str | None = None, ray=None) -> GenerationSource:
    """The source of ``backend`` (``"hf"``, the default, or ``"vllm"``; another name is refused), on Ray
    replicas when ``ray`` is given (a :class:`~aligntax.runs.distributed.RayConfig`, or
    :class:`~aligntax.runs.distributed.Replicas` already held). Nothing is loaded or started here."""
    from aligntax.backends.hf import HFSource

    name = check_backend(backend)
    if name == "vllm":
        from aligntax.backends.vllm.source import VllmSource

        local = VllmSource()
    else:
        local = HFSource()
    if ray is None:
        return local
    from aligntax.runs.distributed import RaySource

    return RaySource(ray, local)


def check_source(source: GenerationSource, backend: str | None) -> None:
    """A run generates with the backend its settings name (and its folder records)."""
    if source.backend != check_backend(backend):
        raise AligntaxError(
            f"The run's settings name the backend {check_backend(backend)!r}; its generation "
            f"source is {source.backend!r}."
        )
