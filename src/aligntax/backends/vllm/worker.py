"""The vLLM worker extension that steers inside continuous batching.

vLLM mixes ``worker_extension_cls`` into its worker class; its methods are called on every worker with
``LLM.collective_rpc(name, args=...)``. :class:`SteeringExtension` keeps a
:class:`~aligntax.backends.vllm.steering.BatchSteering` per worker and registers, on the model the
worker runs (eager mode: ``enforce_eager=True``, so Python hooks run on every step):

- a forward pre-hook on the whole model, which maps the step's flat token batch to requests (the
  model runner's persistent batch order, ``query_start_loc``, the positions passed to the model, each
  request's prompt length) and reads each request's steering from ``SamplingParams.extra_args``;
- a forward pre-hook on each block that decides or edits (and a forward hook on the last block for a
  ``post`` site), which hand vLLM's ``(positions, hidden_states, residual)`` to the steering state.

Nothing else of vLLM is changed; the hooks are removed by :meth:`SteeringExtension.aligntax_detach`.
"""

from __future__ import annotations

from aligntax.backends.vllm.steering import BatchSteering, RequestSteer, StepBatch, parse_request
from aligntax.errors import AligntaxError

EXTENSION = "aligntax.backends.vllm.worker.SteeringExtension"


class SteeringExtension:
    """Mixed into vLLM's worker: every attribute is prefixed ``aligntax_`` (vLLM refuses clashes)."""

    def aligntax_state(self) -> BatchSteering:
        state = getattr(self, "_aligntax_steering", None)
        if state is None:
            state = self._aligntax_steering = BatchSteering()
            self._aligntax_handles = []
            self._aligntax_asks = {}
        return state

    def aligntax_model(self):
        return self.model_runner.get_model()

    def aligntax_register(self, name: str, source: str, options: dict | None = None) -> dict:
        """Load the intervention ``source`` (a steering folder or an intervention name, as
        :func:`aligntax.load_intervention` takes it, with ``options``) once, register its row kernel as
        preset ``name`` and (re)install the hooks. Returns the intervention's resolved config."""
        from aligntax.api import load_intervention
        from aligntax.models.layers import decoder_layers

        state = self.aligntax_state()
        iv = load_intervention(source, None, **dict(options or {}))
        if iv.rewrites_messages():
            raise AligntaxError(
                f"Intervention '{iv.name}' rewrites the chat messages; it is applied to the "
                "messages before generation, not registered as a steering preset."
            )
        model = self.aligntax_model()
        n = len(decoder_layers(model))
        if not iv.kernel_only:
            raise AligntaxError(
                f"Intervention '{iv.name}' acts through hooks of its own (an adapter's), which the vLLM "
                "backend does not run: use the Hugging Face backend."
            )
        kernel = iv.kernel(n, int(self.model_runner.model_config.get_hidden_size()))
        if kernel is None:
            raise AligntaxError(f"Intervention '{iv.name}' does not act on hidden states.")
        kernel.check(n)
        config = iv.config()
        state.register(name, kernel, config)
        self.aligntax_install()
        return config

    def aligntax_unregister(self, name: str) -> bool:
        """Drop preset ``name`` (and the live requests steered by it) and reinstall the hooks the other
        presets need; a request the engine still holds that asks for it runs unsteered from then on.
        Returns whether it was registered."""
        found = self.aligntax_state().unregister(name)
        self.aligntax_install()
        return found

    def aligntax_install(self) -> None:
        """(Re)register the hooks the registered presets need."""
        from aligntax.interventions.kernels import attention_module
        from aligntax.models.layers import decoder_layers

        state = self.aligntax_state()
        self.aligntax_detach()
        model = self.aligntax_model()
        blocks = decoder_layers(model)
        pre, post, attn = state.blocks()
        handles = [model.register_forward_pre_hook(self._aligntax_begin, with_kwargs=True)]
        for b in pre:
            handles.append(blocks[b].register_forward_pre_hook(_pre_hook(state, b), with_kwargs=True))
        for b in post:
            handles.append(blocks[b].register_forward_hook(_post_hook(state, b), with_kwargs=True))
        for b in attn:
            handles.append(
                attention_module(blocks[b], b).register_forward_hook(_attn_hook(state, b), with_kwargs=True)
            )
        self._aligntax_handles = handles

    def aligntax_detach(self) -> None:
        for h in getattr(self, "_aligntax_handles", []):
            h.remove()
        self._aligntax_handles = []

    def _aligntax_begin(self, module, args, kwargs):
        state = self.aligntax_state()
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        runner = self.model_runner
        batch = runner.input_batch
        n = int(batch.num_reqs)
        if positions is None or n == 0 or not state.presets:
            state.groups = []
            return None
        req_ids = list(batch.req_ids[:n])
        asks = self._aligntax_asks
        for rid in [r for r in asks if r not in runner.requests]:
            del asks[rid]
        wanted: list[RequestSteer | None] = []
        for rid in req_ids:
            if rid not in asks:
                params = runner.requests[rid].sampling_params
                try:
                    asks[rid] = parse_request(getattr(params, "extra_args", None), state.presets)
                except AligntaxError as exc:  # the client checks first; a bad request runs unsteered
                    state.errors.append(f"request {rid}: {exc}")
                    asks[rid] = None
            wanted.append(asks[rid])
        if not any(wanted) and not state.live:
            state.groups = []
            return None
        step = StepBatch.from_query_start_loc(
            req_ids,
            runner.query_start_loc.cpu[: n + 1].tolist(),
            batch.num_prompt_tokens[:n].tolist(),
            positions,
        )
        state.begin_step(step, wanted, runner.requests)
        return None

    def aligntax_trace(self, on: bool = True) -> list[tuple]:
        """Start (``on``) or stop recording every edited token as (request id, position, layer, where);
        returns what was recorded since the last call."""
        state = self.aligntax_state()
        out = list(state.trace or [])
        state.trace = [] if on else None
        return out

    def aligntax_records(self) -> dict[str, dict]:
        """Per request id decided since the last call: preset, strength, decision parts."""
        return self.aligntax_state().take_records()

    def aligntax_keep_records(self, on: bool = True) -> None:
        """Keep per-request decision records for :meth:`aligntax_records` (the default) or not (a server,
        which never reads them: they would grow with every request). Turning them off drops those kept."""
        state = self.aligntax_state()
        state.keep_records = bool(on)
        if not on:
            state.records = {}

    def aligntax_summary(self) -> dict:
        return self.aligntax_state().summary()


def _pre_hook(state: BatchSteering, layer: int):
    def hook(module, args, kwargs):
        if not state.groups:
            return None
        args = list(args)
        hidden = args[1] if len(args) > 1 else kwargs["hidden_states"]
        residual = args[2] if len(args) > 2 else kwargs.get("residual")
        out = state.pre_block(layer, hidden, residual)
        if out is None:
            return None
        hidden, residual = out
        if len(args) > 1:
            args[1] = hidden
        else:
            kwargs = {**kwargs, "hidden_states": hidden}
        if len(args) > 2:
            args[2] = residual
        elif "residual" in kwargs:
            kwargs = {**kwargs, "residual": residual}
        return tuple(args), kwargs

    return hook


def _post_hook(state: BatchSteering, layer: int):
    def hook(module, args, kwargs, output):
        if not state.groups:
            return None
        hidden, residual = output
        out = state.post_block(layer, hidden, residual)
        return None if out is None else out

    return hook


def _attn_hook(state: BatchSteering, layer: int):
    def hook(module, args, kwargs, output):
        if not state.groups:
            return None
        out = output[0] if isinstance(output, tuple) else output
        new = state.post_block(layer, out, None, where="attn")
        if new is None:
            return None
        return (new[0], *output[1:]) if isinstance(output, tuple) else new[0]

    return hook
