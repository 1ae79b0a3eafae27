"""Runs sharded over Ray: replicas of the model as Ray actors, results streamed into one run folder.

``aligntax eval --ray [ADDRESS] --workers N`` (and ``aligntax els train --ray``, ``aligntax els sweep
--ray``) load the model once per replica (:class:`ModelReplica`, a Ray actor holding a GPU or some CPUs) and hand out work units with
Ray's own :class:`ray.util.ActorPool`:

- an evaluation's unit is one generation batch. The driver forms the batches exactly as one process
  would (prompts sorted by token length, :func:`~aligntax.generation.batching.length_batches`), so the
  replicas generate the same batches and, in float32, the same tokens; decisions made from the prompt
  (the ELS harm gate's records, CAST's condition, the rows copied from ``--reuse-unsteered``) are
  sharded over the replicas the same way;
- ELS training's label generation is an evaluation whose units also record each batch's prompt
  states (the prefill states the energy models train on) and send them back with the answers;
- a sweep's unit is one setting of the grid (every validation prompt, batched as one process does).

Replicas only generate; the driver judges each unit as it comes back and appends it to the run
folder (``samples.jsonl``, ``sweep.jsonl``), which therefore resumes like a run of one process: a
killed driver is started again with the same command. A replica that dies is restarted by Ray
(``max_restarts``) and its unfinished units are run again (``max_task_retries``); nothing is written
twice, since only the driver writes. See docs/ray.md.

Ray is optional (``pip install 'aligntax[ray]'``); nothing here imports it before a run asks for it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, replace

from aligntax.backends.hf import HFSource
from aligntax.errors import AligntaxError
from aligntax.generation.source import GenerationSource, SourceSpec, SweepGeneration


@dataclass
class RayConfig:
    """Where and how to run the replicas."""

    # None: the cluster RAY_ADDRESS names, else a new local one; "auto": the cluster this machine belongs
    # to; "HOST:6379" (a head node) or "ray://HOST:10001" (Ray client); "local": a new local cluster
    address: str | None = None
    workers: int | None = None  # replicas; None: as many as the cluster's free CPUs / GPUs allow
    cpus: float = 1.0  # CPUs per replica (also its torch threads)
    gpus: float | None = None  # GPUs per replica; None: 1 when the cluster has GPUs, else 0
    max_restarts: int = 3  # a replica that dies is restarted this many times; its units are run again


def import_ray():
    try:
        import ray
    except ImportError:
        raise AligntaxError(
            "Ray is not installed: pip install 'aligntax[ray]' (or 'ray[default]')."
        ) from None
    return ray


@contextmanager
def ray_connection(cfg: RayConfig) -> Iterator:
    """Connected to Ray for the ``with`` body: an existing connection of this process is used as it is;
    otherwise ``cfg.address`` is joined (or a local cluster started) and left again on exit."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    local = cfg.address == "local" or (cfg.address is None and not os.environ.get("RAY_ADDRESS"))
    kwargs = {"include_dashboard": False} if local else {}
    ray.init(address=cfg.address, logging_level="WARNING", **kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


class ModelReplica:
    """One replica of the model (a Ray actor): opens the replicas' own generation source (``local``:
    the Hugging Face backend or a vLLM engine in the actor) once, with an optional intervention, and
    answers work units. Every prefill state an intervention decides from is remembered for the
    actor's life (:func:`~aligntax.activations.decisions.remembered_prefill_states`), as one sweep
    process remembers them."""

    def __init__(
        self,
        model: str,
        dtype: str,
        device_map: str | None = None,
        threads: int | None = None,
        intervention: str | None = None,
        intervention_args: dict | None = None,
        local: GenerationSource | None = None,
        batch_size: int = 32,
    ) -> None:
        import torch

        from aligntax.activations.decisions import remembered_prefill_states

        if threads:
            torch.set_num_threads(threads)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # a vLLM engine runs inside this actor
        self.local = local or HFSource()
        spec = SourceSpec(model, dtype, intervention, dict(intervention_args or {}), batch_size, device_map)
        self._opened = self.local.open(spec)  # held for the actor's life
        self.gen = self._opened.__enter__()
        self.lm, self.iv = self.gen.lm, self.gen.intervention
        self._memo = remembered_prefill_states()
        self._memo.__enter__()

    def identity(self) -> dict:
        """The loaded model's fingerprint and the intervention's resolved settings (JSON values)."""
        import json

        iv = json.loads(json.dumps(self.iv.config(), default=str)) if self.iv is not None else None
        return {"fingerprint": dict(self.lm.fingerprint), "intervention": iv, "pid": os.getpid()}

    def lengths(self, prompts: list, system: str | None) -> list[int]:
        """Token length of each chat-templated prompt, as generation batches them."""
        return self.gen.prompt_lengths(prompts, system)

    def row_info(self, prompts: list, system: str | None, batch_size: int) -> list[dict] | None:
        decider = self.gen.decider()
        return decider.row_info(prompts, system, batch_size) if decider is not None else None

    def unsteered_rows(self, prompts: list, system: str | None, batch_size: int) -> list[bool] | None:
        decider = self.gen.decider()
        return decider.unsteered_rows(prompts, system, batch_size) if decider is not None else None

    def generate(
        self, unit: int, prompts: list, gen: dict, record: list[int] | None = None
    ) -> tuple[int, list[dict], dict | None]:
        """One work unit: the prompts of one generation batch; returns ``(unit, generations, states)``.
        With ``record`` (block indices, unsteered replicas only) ``states`` holds the residual stream
        entering those blocks at each prompt's last token, read in the prefill as
        :class:`~aligntax.activations.recorder.PrefillRecorder` reads it (``{layer: [rows, d]}``, rows
        in the prompts' order), shipped in the model's dtype when that loses nothing (bf16 / fp16
        states are half the bytes of float32 in the object store); else None."""
        from aligntax.generation import GenerationConfig

        rec = None
        if record is not None:
            from aligntax.activations.recorder import PrefillRecorder

            self.local.check(recorder=True)
            if self.iv is not None:
                raise AligntaxError("Prompt states are recorded only by unsteered replicas.")
            rec = PrefillRecorder(self.lm.model, record)
        out: list = [None] * len(prompts)
        for idx, gens in self.gen.iter_generate(
            prompts, GenerationConfig(**gen), progress=False, recorder=rec
        ):
            if rec is not None:
                rec.keep([str(i) for i in idx])
            for i, g in zip(idx, gens, strict=True):
                out[i] = asdict(g)
        if rec is None:
            return unit, out, None
        import torch

        order = torch.tensor([int(i) for i in rec.prompt_ids]).argsort()
        states = {}
        for layer, h in rec.states().items():
            h = h[order]
            small = h.to(self.lm.dtype)
            states[layer] = small if torch.equal(small.float(), h) else h
        return unit, out, states

    def call(self, unit: int, fn, *args) -> tuple:
        """Another kind of work unit: ``fn(lm, *args)`` (a module-level function, e.g. one setting of a
        sweep); returns ``(unit, result)``."""
        return unit, fn(self.lm, *args)


class Replicas:
    """The replicas of one run, started on first use (:meth:`start`) and killed on :meth:`close`."""

    def __init__(
        self,
        cfg: RayConfig,
        model: str,
        dtype: str,
        intervention: str | None = None,
        intervention_args: dict | None = None,
        device_map: str | None = None,
        local: GenerationSource | None = None,
        batch_size: int = 32,
    ) -> None:
        self.cfg = cfg
        self.local = local or HFSource()  # what each replica generates with
        # device_map "auto": each replica's model split over its GPUs (accelerate)
        self.spec = SourceSpec(
            model, dtype, intervention, dict(intervention_args or {}), batch_size, device_map
        )
        self.actors: list = []
        self.pool = None
        self.identity: dict = {}
        self._conn = None

    def start(self) -> Replicas:
        if self.actors:
            return self
        self._conn = ray_connection(self.cfg)
        ray = self._conn.__enter__()
        from ray.util import ActorPool

        resources = ray.cluster_resources()
        gpus = self.cfg.gpus if self.cfg.gpus is not None else (1.0 if resources.get("GPU", 0) >= 1 else 0.0)
        if self.spec.device_map and not gpus:
            raise AligntaxError(
                "--device-map splits a replica's model over its GPUs: give each replica "
                "GPUs (--worker-gpus), or leave --device-map out."
            )
        workers = self.cfg.workers
        if workers is None:
            workers = (
                int(resources.get("GPU", 0) // gpus)
                if gpus
                else int(resources.get("CPU", 1) // self.cfg.cpus)
            )
        if workers < 1:
            raise AligntaxError(
                f"The Ray cluster has no room for one replica ({self.cfg.cpus} CPUs, {gpus} GPUs "
                f"each; it has {resources.get('CPU', 0)} CPUs, {resources.get('GPU', 0)} GPUs)."
            )
        remote = ray.remote(ModelReplica).options(
            num_cpus=self.cfg.cpus, num_gpus=gpus, max_restarts=self.cfg.max_restarts, max_task_retries=-1
        )
        threads = max(1, int(self.cfg.cpus))
        sp = self.spec
        self.actors = [
            remote.remote(
                sp.model,
                sp.dtype,
                sp.device_map,
                threads,
                sp.intervention,
                sp.intervention_args,
                self.local,
                sp.batch_size,
            )
            for _ in range(workers)
        ]
        try:
            idents = ray.get([a.identity.remote() for a in self.actors])
        except ray.exceptions.RayActorError as exc:  # a replica could not load the model (or its backend)
            for a in self.actors:
                ray.kill(a)
            self.actors = []
            cause = getattr(exc, "error_msg", None) or str(exc)
            last = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
            raise AligntaxError(
                "A model replica could not start: " + (last[-1] if last else "unknown error")
            ) from None
        fps = {repr(sorted(i["fingerprint"].items())) for i in idents}
        if len(fps) != 1:
            raise AligntaxError(
                "The replicas loaded different models (fingerprints differ); give every node "
                "the same model files."
            )
        self.identity = idents[0]
        self.pool = ActorPool(self.actors)
        return self

    def close(self) -> None:
        if self._conn is None:
            return
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors, self.pool = [], None
        conn, self._conn = self._conn, None
        conn.__exit__(None, None, None)

    @property
    def workers(self) -> int:
        return len(self.actors)

    def map_unordered(self, call, units: Sequence) -> Iterator:
        """``call(actor, unit)`` (an actor method's ``.remote(...)``) for every unit, over the pool;
        results as they finish."""
        return self.pool.map_unordered(call, list(units))

    def put(self, value):
        """``value`` in Ray's object store, once for every unit that takes it."""
        import ray

        self.start()
        return ray.put(value)

    def map(self, call, units: Sequence) -> list:
        return list(self.pool.map(call, list(units)))

    def imap(self, call, units: Sequence) -> Iterator:
        """``call(actor, unit)`` for every unit, over the pool; results in the units' order, each as
        soon as it and those before it are done."""
        return self.pool.map(call, list(units))

    # ---- sharded per-prompt calls (results in the prompts' order) --------------------------------
    def _sharded(self, method: str, prompts: list, *args) -> list | None:
        if not prompts:
            return []
        size = -(-len(prompts) // max(1, self.workers))
        chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        parts = self.map(lambda a, c: getattr(a, method).remote(c, *args), chunks)
        if any(p is None for p in parts):
            return None
        return [x for p in parts for x in p]

    def lengths(self, prompts: list, system: str | None) -> list[int]:
        return self._sharded("lengths", prompts, system)

    # a decider (aligntax.activations.decisions): the intervention's per-row decisions, made on the replicas
    def row_info(self, prompts, system: str | None = None, batch_size: int = 32) -> list[dict] | None:
        return self._sharded("row_info", list(prompts), system, batch_size)

    def unsteered_rows(self, prompts, system: str | None = None, batch_size: int = 32) -> list[bool] | None:
        return self._sharded("unsteered_rows", list(prompts), system, batch_size)

    def iter_generate(
        self, prompts: Sequence, cfg, progress: bool = True, desc: str = "generate", recorder=None
    ) -> Iterator[tuple[list[int], list]]:
        """:func:`aligntax.generation.iter_generate` over the replicas: the same batches (sorted by
        length, the same caps, each batch's own seed), one work unit each; yields ``(indices,
        generations)`` as units finish. With ``recorder`` (a
        :class:`~aligntax.activations.recorder.PrefillRecorder` of this process) each replica records
        the prompt states of its batch and the recorder holds them when the batch is yielded, as
        after a batch generated here, for the caller to keep
        (:meth:`~aligntax.activations.recorder.PrefillRecorder.keep`)."""
        from tqdm.auto import tqdm

        from aligntax.generation import Generation
        from aligntax.generation.batching import length_batches

        prompts = list(prompts)
        lengths = self.lengths(prompts, cfg.system)
        order = sorted(range(len(prompts)), key=lambda i: (-lengths[i], i))
        spans = length_batches([lengths[i] for i in order], cfg.batch_size, cfg.max_batch_tokens)
        units = [order[s.start : s.stop] for s in spans]
        gens = [
            asdict(replace(cfg, seed=None if cfg.seed is None else cfg.seed + b)) for b in range(len(units))
        ]
        record = list(recorder.layers) if recorder is not None else None
        bar = tqdm(
            total=len(prompts), desc=f"{desc} ({self.workers} replicas)", disable=not progress, unit="prompt"
        )
        try:
            results = self.map_unordered(
                lambda a, b: a.generate.remote(b, [prompts[i] for i in units[b]], gens[b], record),
                range(len(units)),
            )
            for b, out, states in results:
                bar.update(len(out))
                if recorder is not None:
                    recorder.recorded(states)
                yield units[b], [Generation(**g) for g in out]
        finally:
            bar.close()


class RemoteModel:
    """The model the replicas hold, as the driver sees it: its spec and fingerprint."""

    def __init__(self, spec: str, fingerprint: dict) -> None:
        self.spec = spec
        self.fingerprint = fingerprint


class RemoteIntervention:
    """The replicas' intervention, as the driver sees it: its resolved settings (its per-prompt
    decisions are made on the replicas: :class:`Replicas` is the run's decider)."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.name = (replicas.identity.get("intervention") or {}).get("name", "none")

    def config(self) -> dict:
        return self.replicas.identity.get("intervention")


@contextmanager
def replicas_of(
    ray_cfg: RayConfig | None,
    model: str,
    dtype: str,
    intervention: str | None = None,
    intervention_args: dict | None = None,
    device_map: str | None = None,
    local: GenerationSource | None = None,
    batch_size: int = 32,
) -> Iterator[Replicas | None]:
    """The replicas of one run, started when first needed and killed on exit; None without
    ``ray_cfg``. ``local``: what each replica generates with (default: the Hugging Face backend; the
    vLLM source: a vLLM engine per replica, ``batch_size`` sequence slots)."""
    if ray_cfg is None:
        yield None
        return
    import_ray()
    reps = Replicas(ray_cfg, model, dtype, intervention, intervention_args, device_map, local, batch_size)
    reps.local.check(device_map=bool(device_map))
    try:
        yield reps
    finally:
        reps.close()


def started(replicas: Replicas) -> tuple[RemoteModel, RemoteIntervention | None]:
    """Start ``replicas``; the model and intervention the evaluation sees in their place."""
    replicas.start()
    model = RemoteModel(replicas.spec.model, replicas.identity["fingerprint"])
    return model, (RemoteIntervention(replicas) if replicas.spec.intervention else None)


class RaySession:
    """One run's generation on the replicas (a :class:`~aligntax.generation.source.SourceSession`): the
    replicas make the per-row decisions and generate; this process sees the model's fingerprint and
    the intervention's settings."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.lm, self.intervention = started(replicas)
        self.decided: dict[int, dict] = {}

    def decider(self) -> Replicas:
        return self.replicas

    def iter_generate(
        self, prompts: Sequence, cfg, progress: bool = True, desc: str = "generate", recorder=None
    ) -> Iterator[tuple[list[int], list]]:
        return self.replicas.iter_generate(prompts, cfg, progress=progress, desc=desc, recorder=recorder)

    def prompt_lengths(self, prompts: Sequence, system: str | None = None) -> list[int]:
        return self.replicas.lengths(list(prompts), system)

    def stats(self) -> dict:
        return {}  # the replicas' hooks keep theirs


class RaySource:
    """Runs on Ray replicas (``--ray``), each generating with the ``local`` source (default: the
    Hugging Face backend). ``cfg``: where and how to start them, or :class:`Replicas` already held by
    the caller (ELS training runs its label evaluation on its own), used as they are and left running."""

    def __init__(self, cfg: RayConfig | Replicas, local: GenerationSource | None = None) -> None:
        self.cfg = cfg
        self.local = cfg.local if isinstance(cfg, Replicas) else local or HFSource()
        self.backend = self.local.backend

    def check(
        self,
        *,
        recorder: bool = False,
        loaded_intervention: bool = False,
        loaded_model: bool = False,
        device_map: bool = False,
        adapters: bool = False,
    ) -> None:
        if loaded_model or loaded_intervention:
            raise AligntaxError(
                "A run on Ray loads the model on its replicas: give the model and intervention "
                "settings, not loaded objects."
            )
        self.local.check(recorder=recorder, device_map=device_map, adapters=adapters)

    def replicas(self, spec: SourceSpec):
        """The replicas of a run of ``spec`` (a context manager)."""
        if isinstance(self.cfg, Replicas):
            held = self.cfg.spec
            if (held.model, held.dtype, held.intervention or None) != (
                spec.model,
                spec.dtype,
                spec.intervention or None,
            ):
                raise AligntaxError(
                    f"The replicas hold {held.model} ({held.dtype}, intervention {held.intervention}), "
                    f"not the run's {spec.model} ({spec.dtype}, intervention "
                    f"{spec.intervention or None})."
                )
            return nullcontext(self.cfg)
        return replicas_of(
            self.cfg,
            spec.model,
            spec.dtype,
            spec.intervention,
            spec.intervention_args,
            spec.device_map,
            self.local,
            spec.batch_size,
        )

    @contextmanager
    def open(self, spec: SourceSpec, lm=None, intervention=None) -> Iterator[RaySession]:
        with self.replicas(spec) as reps:
            yield RaySession(reps)

    @contextmanager
    def sweep(self, spec: SourceSpec) -> Iterator[SweepGeneration]:
        if self.local.backend != HFSource.backend:
            raise AligntaxError(
                f"The {self.local.backend} backend runs the sweep's engine in this process: not with --ray."
            )
        with replicas_of(self.cfg, spec.model, spec.dtype, device_map=spec.device_map) as reps:
            yield SweepGeneration(lambda name, args: None, reps)

    def check_serving(self, *, device: str | None = None, max_latency_ms: float | None = None) -> None:
        raise AligntaxError("A server answers from one process, not from Ray replicas.")

    def serving(self, spec: SourceSpec, device: str | None = None, threads: int | None = None):
        self.check_serving()

    def start(self, spec: SourceSpec) -> None:
        """The replicas of each run load their own models."""

    def adopt(self, lm) -> None:
        """The replicas load their own models."""

    def close(self) -> None:
        """The replicas are killed when each run ends."""
