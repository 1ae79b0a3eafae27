"""The vLLM backend's GPU checks: tensor parallelism, strength 0, where steering lands on every rank,
TP=N against TP=1, and what eager mode and steering cost next to CUDA graphs.

The steering hooks are Python, so the steered engine runs in eager mode (``enforce_eager=True``). With
tensor parallelism every worker holds a shard of the weights, but the residual stream entering a block
is whole on every rank, so every rank must make the same decision and the same edit. Each engine runs
in a child process of its own (a fresh engine; its GPU memory is freed when it ends):

- ``vectors`` (without ``--vectors``): refusal vectors, false-refusal vectors and a CAST condition of
  the model, computed with aligntax's own code (``compute_vectors``) from the last-prompt-token states
  of ``--vector-prompts`` prompts each of ``harmful-train``, ``harmless-train`` and
  ``orbench-hard-train``, on a Hugging Face copy of the model; without ``--steer`` also a small energy
  bank and harm gate (``device_map_split.make_artefacts``, a dozen prompts), registered as ``els`` (no
  gate) and ``els-gate`` (gate at 0.5), both with a horizon of 4 tokens: a check of the plumbing of ELS's
  edits and decision, not of ELS;
- ``main``: ``tensor_parallel_size=--tp``, eager, the presets registered (``refusal-add``,
  ``refusal-ablation``, ``cast`` from the vectors, and ``els``): checks 1 to 3,
  the answers of check 4 and the eager arms of check 5;
- ``reference``: a fresh engine with ``tensor_parallel_size=1``: the answers of check 4;
- ``graphs``: ``tensor_parallel_size=--tp`` with CUDA graphs (no ``enforce_eager``): the arm of check 5
  that shows what eager mode costs an unsteered user (the engine arguments are ``VllmModel``'s, with
  the tensor-parallel size added and eager mode off).

The checks, one row each with its verdict:

1. ``registration``: the engine runs ``--tp`` ranks; registering every preset returns one config per
   rank, all equal (read back with ``collective_rpc("aligntax_summary")``).
2. ``strength 0`` (per preset): greedy tokens of every prompt sent with the preset at strength 0 (in
   ``extra_args``, as a server request carries it) equal the plain ones, token for token.
3. ``trace`` (per preset): half the prompts steered, half plain, in one call, ``ignore_eos`` (every
   request generates ``--max-new-tokens`` tokens); every rank's trace (request, position, layer, site)
   is collected with ``collective_rpc("aligntax_trace")`` (``VllmModel.trace`` returns rank 0's only).
   On every rank, a steered request the decision passes is edited at exactly the positions
   ``kernels.edited`` names (the last prompt token and the first H generated tokens, or every position,
   by method) at each of the method's sites; a request the decision holds back (its record's strength 0)
   and every plain request are never edited; every rank records the same trace and the same decisions.
4. ``TP=N vs TP=1`` (plain and per preset): greedy answers of the two engines; the identical count is
   reported, not asserted (the reduction order differs); the keyword judge's refusal rate of TP=N minus
   TP=1 must lie within its 95% paired interval. With ``--tp 1`` it compares two fresh TP=1 engines.
5. ``timing``: ``--concurrency`` requests in one call, ``ignore_eos`` (every arm generates the same
   tokens), ``--repeats`` interleaved repetitions after a warm-up: unsteered with CUDA graphs, unsteered
   eager, and eager steered by each preset (every request at strength 1). Pass: steered / eager-unsteered
   <= 1.05 (median of per-repetition ratios); eager / graphs (ratio of medians) is reported.

The exit status is 1 when an asserted check fails. Without CUDA it says so and exits 0, unless
``--cpu-smoke``: the same code on the CPU with the embedded 0.5B model (or ``--model``), TP=1 (or
``--tp``: vLLM's CPU backend runs tensor parallelism too), no graphs arm, 4 prompts, 8 tokens; the
timing target is then reported, not asserted. On a GPU machine it needs vLLM's CUDA build (the worker
extension is written against 0.32.0, the version ``.venv-vllm`` pins) with aligntax installed:

    python bench/vllm_gpu.py --model Qwen/Qwen2.5-7B-Instruct --tp 2
    python bench/vllm_gpu.py --model /models/qwen7b --steer runs/els7b --tp 4
    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python bench/vllm_gpu.py --cpu-smoke

Expected output (``runs/bench/vllm_gpu.md``; every row ``pass``, timing rows ``pass`` or ``fail`` by the
target, the eager / graphs row ``info``):

    | check | preset | result | detail |
    | 1 registration | all | pass | <tp> ranks (engine tensor_parallel_size <tp>, asked <tp>), <k> presets, configs equal on every rank |
    | 2 strength 0 | <preset> | pass | <n>/<n> prompts token for token plain |
    | 3 trace | <preset> | pass | <s> steered (<h> held by the decision), <p> plain; <e> edits per rank; traces and decisions of the <tp> rank(s) equal |
    | 4 TP=<tp> vs TP=1 | plain, <preset> | pass | identical <i>/<n>; refusal <a> vs <b>, diff <d> (95% paired [<lo>, <hi>], +<g> -<l>) |
    | 5 timing | same work | pass | generated tokens per arm: eager [<t>], eager+<preset> [<t>], ... |
    | 5 timing | <preset> | pass | steered / eager <r> (target <= 1.05); steered rows <s> of <concurrency> |
    | 5 timing | eager / graphs | info | <r> (ratio of medians, <eager> s / <graphs> s) |

then the timing table (arms ``eager``, ``eager+<preset>``, ``graphs``: median s, tok/s, tokens) and
``PASS`` or ``FAIL: <the failed rows>``. Without CUDA:

    vllm_gpu: needs CUDA (tensor parallelism and CUDA graphs); --cpu-smoke runs the same code on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib as bl  # noqa: E402

NAME = "vllm_gpu"
TARGET = 1.05  # steered / eager-unsteered time
SMOKE = dict(
    model="embedded:qwen2.5-coder-0.5b-instruct",
    prompts=4,
    max_new_tokens=8,
    concurrency=4,
    repeats=1,
    vector_prompts=8,
    max_model_len=1024,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="Qwen/Qwen2.5-7B-Instruct",
        help="Hub id or model folder (default Qwen/Qwen2.5-7B-Instruct)",
    )
    p.add_argument("--dtype", default="bf16", help="default bf16")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the visible GPUs)")
    p.add_argument("--steer", default=None, help="an `aligntax els train` folder made for --model (adds ELS)")
    p.add_argument(
        "--vectors", default=None, help="a vector folder made for --model (default: computed here)"
    )
    p.add_argument(
        "--data",
        default="orbench-hard-test,harmful-test",
        help="comma-separated prompt sets, taken in equal shares (default orbench-hard-test,harmful-test)",
    )
    p.add_argument("--prompts", type=int, default=64, help="prompts of checks 2 to 4 (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    p.add_argument(
        "--concurrency", type=int, default=32, help="concurrent requests of the timing (default 32)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (default 3)")
    p.add_argument(
        "--vector-prompts",
        type=int,
        default=64,
        help="prompts per set for the vectors computed here (default 64)",
    )
    p.add_argument("--max-model-len", type=int, default=4096, help="default 4096")
    p.add_argument(
        "--phase-timeout", type=int, default=1800, help="seconds one engine's phase may run (default 1800)"
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run on the CPU: the embedded model, TP=1 unless --tp, no graphs arm, few prompts and tokens",
    )
    p.add_argument("--out", default=f"runs/bench/{NAME}.json", help=f"default runs/bench/{NAME}.json")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a child process: one engine's work
    p.add_argument("--phase-spec", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cpu_smoke:
        given = argv if argv is not None else sys.argv[1:]
        for key, value in SMOKE.items():
            flag = f"--{key.replace('_', '-')}"
            if not any(a == flag or a.startswith(f"{flag}=") for a in given):
                setattr(args, key, value)
    return args


# ------------------------------------------------------------------------------------------ child side
def start_engine(spec: dict, tp: int, eager: bool = True):
    """A ``VllmModel`` with ``tensor_parallel_size=tp`` (eager, or with CUDA graphs when not ``eager``).
    ``VllmModel`` has no option for either: they are added to the engine arguments it builds."""
    from aligntax.backends.vllm import engine

    base = engine.engine_kwargs

    def kwargs(*a, **kw) -> dict:
        out = base(*a, **kw)
        out["tensor_parallel_size"] = tp
        out["enforce_eager"] = eager
        return out

    engine.engine_kwargs = kwargs
    try:
        opts = engine.VllmOptions(
            max_model_len=spec["max_model_len"],
            max_num_seqs=max(spec["concurrency"], len(spec["prompts"])),
            enable_prefix_caching=False,
            kv_cache_gib=1,
        )  # the KV cache size: CPU only
        return engine.VllmModel(spec["model"], dtype=spec["dtype"], options=opts)
    finally:
        engine.engine_kwargs = base


def register_all(vm, presets: list[dict]) -> None:
    for p in presets:
        vm.register(p["name"], p["source"], **p["options"])


def submit(
    vm, ids: list[list[int]], asks: list[tuple[str, float] | None], max_tokens: int, ignore_eos: bool
) -> list[tuple[str, list[int]]]:
    """One ``llm.generate`` call, greedy, with the sampling settings of ``VllmModel.generate``; each
    request carries its preset and strength in ``extra_args`` (``asks[i]``; None: plain), strength 0
    included. Returns (request id, generated token ids) per prompt."""
    from vllm import SamplingParams

    from aligntax.backends.vllm.steering import EXTRA_STEER, EXTRA_STRENGTH

    reqs, params = [], []
    for x, ask in zip(ids, asks, strict=True):
        prompt = {"prompt_token_ids": list(x)}
        extra = None
        if ask is not None:
            extra = {EXTRA_STEER: ask[0], EXTRA_STRENGTH: float(ask[1])}
            if ask[1] > 0:
                prompt["cache_salt"] = f"aligntax:{ask[0]}:{float(ask[1])!r}"
        sp = dict(
            max_tokens=max_tokens, detokenize=False, extra_args=extra, temperature=0.0, **vm.greedy_extras
        )
        if ignore_eos:
            sp["ignore_eos"] = True
        else:
            sp["stop_token_ids"] = sorted(vm.eos_ids)
        reqs.append(prompt)
        params.append(SamplingParams(**sp))
    outs = vm.llm.generate(reqs, params, use_tqdm=False)
    return [(o.request_id, list(o.outputs[0].token_ids)) for o in outs]


def external_id(rid: str, known: set[str]) -> str:
    """The request id ``llm.generate`` gave back for the engine's internal id ``rid``."""
    return rid if rid in known else rid.rsplit("-", 1)[0]


def check_registration(vm, presets: list[dict], tp: int) -> dict:
    summaries = vm.llm.collective_rpc("aligntax_summary")
    configs = [
        {name: s["presets"].get(name, {}).get("config") for name in (p["name"] for p in presets)}
        for s in summaries
    ]
    engine_tp = vm.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    equal = all(c == configs[0] for c in configs) and all(v is not None for v in configs[0].values())
    return {
        "ranks": len(summaries),
        "engine_tp": engine_tp,
        "configs_equal": equal,
        "ok": len(summaries) == tp and engine_tp == tp and equal,
        "errors": [s["errors"] for s in summaries],
    }


def check_zero(vm, ids: list[list[int]], presets: list[dict], max_tokens: int) -> dict:
    plain = [t for _, t in submit(vm, ids, [None] * len(ids), max_tokens, False)]
    out = {}
    for p in presets:
        zero = [t for _, t in submit(vm, ids, [(p["name"], 0.0)] * len(ids), max_tokens, False)]
        same = sum(a == b for a, b in zip(plain, zero, strict=True))
        out[p["name"]] = {"same": same, "n": len(ids), "ok": same == len(ids)}
    return out


def expected_edits(kernel, prompt_len: int, fed: int) -> set[tuple[int, int, str]]:
    """(position, layer, site) the kernel edits for a request whose first ``fed`` positions went
    through the model."""
    from aligntax.interventions.kernels import edited

    return {
        (pos, s.layer, s.where)
        for s in kernel.sites
        for pos in range(fed)
        if edited(pos, prompt_len, kernel, s)
    }


def check_trace(vm, ids: list[list[int]], preset: dict, max_tokens: int) -> dict:
    """Check 3 for one preset: half the prompts steered, half plain, in one call, every rank's trace."""
    from aligntax.api import load_intervention

    kernel = load_intervention(preset["source"], vm.facts, **preset["options"]).kernel(
        vm.num_layers, vm.hidden_size
    )
    asks = [(preset["name"], 1.0) if (i // 2) % 2 == 0 else None for i in range(len(ids))]  # both prompt sets
    vm.llm.collective_rpc("aligntax_records")  # drop earlier records
    vm.llm.collective_rpc("aligntax_trace", args=(True,))
    outs = submit(vm, ids, asks, max_tokens, True)
    traces = vm.llm.collective_rpc("aligntax_trace", args=(False,))
    records = vm.llm.collective_rpc("aligntax_records")
    known = {rid for rid, _ in outs}
    problems: list[str] = []
    per_rank = []
    for rank, (trace, recs) in enumerate(zip(traces, records, strict=True)):
        got: dict[str, set] = {}
        for rid, pos, layer, where in trace:
            got.setdefault(external_id(rid, known), set()).add((int(pos), int(layer), str(where)))
        decided = {external_id(rid, known): r for rid, r in recs.items()}
        held = 0
        for (rid, toks), x, ask in zip(outs, ids, asks, strict=True):
            edits = got.pop(rid, set())
            if ask is None:
                if edits or rid in decided:
                    problems.append(f"rank {rank}: plain request {rid} edited at {len(edits)} tokens")
                continue
            if len(toks) != max_tokens:
                problems.append(f"rank {rank}: request {rid} made {len(toks)} tokens, not {max_tokens}")
            strength = (decided.get(rid) or {}).get("strength")
            if strength is None:
                problems.append(f"rank {rank}: steered request {rid} has no decision record")
                continue
            held += strength == 0
            want = expected_edits(kernel, len(x), len(x) + max_tokens - 1) if strength > 0 else set()
            if edits != want:
                problems.append(
                    f"rank {rank}: request {rid} (prompt {len(x)} tokens, strength {strength:g}): "
                    f"{len(edits - want)} unexpected edits (e.g. {sorted(edits - want)[:3]}), "
                    f"{len(want - edits)} missing (e.g. {sorted(want - edits)[:3]})"
                )
        if got:
            problems.append(f"rank {rank}: edits of unknown requests {sorted(got)[:3]}")
        per_rank.append({"edits": len(trace), "held": held})
    norm = [sorted((external_id(r, known), int(p), int(la), str(w)) for r, p, la, w in t) for t in traces]
    dec = [{external_id(r, known): v.get("strength") for r, v in recs.items()} for recs in records]
    ranks_equal = all(t == norm[0] for t in norm) and all(d == dec[0] for d in dec)
    if not ranks_equal:
        problems.append("the ranks recorded different traces or decisions")
    return {
        "ranks": len(traces),
        "steered": sum(a is not None for a in asks),
        "plain": sum(a is None for a in asks),
        "per_rank": per_rank,
        "ranks_equal": ranks_equal,
        "problems": problems[:20],
        "n_problems": len(problems),
        "ok": not problems,
    }


def answers(vm, prompts: list[str], presets: list[dict], max_tokens: int) -> dict[str, list[str]]:
    from aligntax.generation import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, batch_size=len(prompts))
    out = {"plain": [g.response for g in vm.generate(prompts, cfg)[0]]}
    for p in presets:
        out[p["name"]] = [g.response for g in vm.generate(prompts, cfg, steer=p["name"])[0]]
    return out


def timing(vm, prompts: list[str], arms: dict[str, str | None], max_tokens: int, repeats: int) -> dict:
    """Interleaved timed arms (name -> preset or None), ``ignore_eos``: every arm makes the same tokens."""
    from aligntax.generation import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, batch_size=len(prompts))

    def arm(steer):
        def run() -> dict:
            secs, (gens, decided) = bl.timed(lambda: vm.generate(prompts, cfg, steer=steer, ignore_eos=True))
            steered = sum(d is not None and (d.get("strength") or 0) > 0 for d in decided)
            return {
                "seconds": secs,
                "tokens": sum(g.n_tokens for g in gens),
                "rows": len(gens),
                "steered_rows": steered,
            }

        return run

    return bl.interleaved({name: arm(steer) for name, steer in arms.items()}, repeats, warmup=1)


def run_phase(phase: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"phase": phase}
    if phase == "vectors":
        result.update(make_vectors(spec))
    else:
        tp = spec["tp"] if phase in ("main", "graphs") else 1
        secs, vm = bl.timed(lambda: start_engine(spec, tp, eager=phase != "graphs"))
        result["engine_start_s"] = secs
        prompts, conc = spec["prompts"], spec["timing_prompts"]
        if phase == "graphs":
            result["timing"] = timing(vm, conc, {"graphs": None}, spec["max_new_tokens"], spec["repeats"])
        else:
            register_all(vm, spec["presets"])
            _, ids = vm.encode(prompts)
            if phase == "main":
                result["registration"] = check_registration(vm, spec["presets"], tp)
                result["zero"] = check_zero(vm, ids, spec["presets"], spec["max_new_tokens"])
                result["trace"] = {
                    p["name"]: check_trace(vm, ids, p, spec["max_new_tokens"]) for p in spec["presets"]
                }
            result["answers"] = answers(vm, prompts, spec["presets"], spec["max_new_tokens"])
            if phase == "main":
                arms = {"eager": None, **{f"eager+{p['name']}": p["name"] for p in spec["presets"]}}
                result["timing"] = timing(vm, conc, arms, spec["max_new_tokens"], spec["repeats"])
        result["summary"] = vm.summary()
        Path(spec["result"]).write_text(json.dumps(result, default=str))  # before a shutdown that could hang
        vm.close()
        return
    Path(spec["result"]).write_text(json.dumps(result, default=str))


def make_vectors(spec: dict) -> dict:
    """Refusal and false-refusal vectors and a CAST condition of the model (``compute_vectors``)."""
    import torch

    from aligntax.activations import capture
    from aligntax.interventions.vectors import compute_vectors

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm, load_s = bl.load_lm(spec["model"], spec["dtype"], device)
    n = spec["vector_prompts"]
    acts = {
        name: capture(lm, bl.load_prompt_texts(data, n), "all", progress=False)
        for name, data in (
            ("harmful", "harmful-train"),
            ("harmless", "harmless-train"),
            ("pseudo", "orbench-hard-train"),
        )
    }
    vs = compute_vectors(
        acts["harmful"],
        acts["harmless"],
        acts["pseudo"],
        fingerprint=lm.fingerprint,
        metadata={"made_by": "bench/vllm_gpu.py", "prompts_per_set": n},
    )
    vs.save(spec["out"])
    out = {
        "vectors": spec["out"],
        "layer": vs.metadata["layer"],
        "load_s": load_s,
        "cast": vs.metadata.get("cast"),
    }
    if spec.get("els_out"):
        from device_map_split import make_artefacts

        gate = max(1, lm.num_layers // 2)
        make_artefacts(lm, Path(spec["els_out"]), [gate - 1, gate])
        out.update(els=spec["els_out"], els_layers=[x for x in (gate, gate + 1) if x < lm.num_layers])
    return out


# ----------------------------------------------------------------------------------------- parent side
def child(phase: str, spec: dict, work: Path, timeout: int) -> dict | None:
    """Run ``phase`` in a child process (a fresh engine); its result, or None when it failed."""
    spec = {**spec, "result": str(work / f"{phase}.result.json")}
    path = work / f"{phase}.spec.json"
    path.write_text(json.dumps(spec))
    Path(spec["result"]).unlink(missing_ok=True)
    print(f"== {phase}", flush=True)
    try:
        rc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--phase-spec", str(path)],
            timeout=timeout,
        ).returncode
    except subprocess.TimeoutExpired:
        print(f"{phase}: timed out after {timeout} s", flush=True)
        rc = "timeout"
    if rc == "timeout" and Path(spec["result"]).is_file():
        print(f"{phase}: its results were written before the time ran out; using them", flush=True)
    elif rc != 0 or not Path(spec["result"]).is_file():
        print(f"{phase}: failed (exit status {rc})", flush=True)
        return None
    return json.loads(Path(spec["result"]).read_text())


def paired_interval(gained: int, lost: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wald interval of a paired difference of proportions, (gained - lost) / n."""
    d = (gained - lost) / n
    se = math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n
    return d - z * se, d + z * se


def compare_answers(tp_n: list[str], tp_1: list[str]) -> dict:
    from aligntax.judges.keyword import KeywordJudge
    from aligntax.metrics.rates import paired_change

    judge = KeywordJudge()
    change = paired_change([judge.is_refusal(r) for r in tp_1], [judge.is_refusal(r) for r in tp_n])
    lo, hi = paired_interval(change["gained"], change["lost"], change["n"])
    return {
        **change,
        "ci95": [lo, hi],
        "identical": sum(a == b for a, b in zip(tp_n, tp_1, strict=True)),
        "ok": lo <= 0.0 <= hi,
    }


def presets_of(args, vectors: str | None, made_els: dict | None) -> list[dict]:
    from aligntax.interventions.vectors import SteeringVectors

    out = []
    if vectors:
        vs = SteeringVectors.load(vectors)
        out += [
            {"name": m, "source": vectors, "options": {"name": m}}
            for m in ("refusal-add", "refusal-ablation")
        ]
        if "condition" in vs.vectors and vs.metadata.get("cast"):
            out.append({"name": "cast", "source": vectors, "options": {"name": "cast"}})
    if args.steer:
        out.append({"name": "els", "source": args.steer, "options": {}})
    elif made_els:
        # a small energy bank and harm gate made here (``device_map_split.make_artefacts``): the plumbing of
        # ELS's edits, horizon and decision and horizon, not ELS's quality
        # an ELS decision and horizon, not ELS's quality; with and without the harm gate (which may hold
        # back every prompt)
        common = {"layers": made_els["els_layers"], "eta": 0.5, "steps": 2, "horizon": 4}
        out += [
            {"name": "els", "source": made_els["els"], "options": {**common, "gate": "none"}},
            {"name": "els-gate", "source": made_els["els"], "options": {**common, "gate": 0.5}},
        ]
    return out


def prompt_texts(data: str, n: int) -> list[str]:
    """``n`` prompts in equal shares of the comma-separated sets, interleaved."""
    specs = [s.strip() for s in data.split(",") if s.strip()]
    shares = [bl.load_prompt_texts(s, (n + len(specs) - 1) // len(specs)) for s in specs]
    mixed = [p for group in zip(*shares, strict=True) for p in group]
    return mixed[:n]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.phase:
        run_phase(args.phase, args.phase_spec)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print(
            "vllm_gpu: needs CUDA (tensor parallelism and CUDA graphs); --cpu-smoke runs the same code on the CPU"
        )
        return 0
    if args.cpu_smoke:
        args.tp = args.tp or 1
        for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind")):
            os.environ.setdefault(key, value)
    tp = args.tp or torch.cuda.device_count()
    json_path, _ = bl.out_paths(args.out, NAME)
    work = json_path.parent / f"{NAME}-work"
    work.mkdir(parents=True, exist_ok=True)
    prompts = prompt_texts(args.data, args.prompts)
    base = {
        "model": args.model,
        "dtype": args.dtype,
        "tp": tp,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "max_model_len": args.max_model_len,
        "vector_prompts": args.vector_prompts,
        "cpu": args.cpu_smoke,
        "prompts": prompts,
        "timing_prompts": [prompts[i % len(prompts)] for i in range(args.concurrency)],
    }
    results: dict = {}
    vectors = args.vectors
    if vectors is None:
        made = {"out": str(work / "vectors"), "els_out": None if args.steer else str(work / "els")}
        results["vectors"] = child("vectors", {**base, **made}, work, args.phase_timeout)
        vectors = (results["vectors"] or {}).get("vectors")
    made_els = results.get("vectors") if (results.get("vectors") or {}).get("els") else None
    presets = presets_of(args, vectors, made_els)
    if not presets:
        print("vllm_gpu: no steering to check (the vectors were not made and no --steer was given)")
        return 1
    base["presets"] = presets
    for phase in ("main", "reference", *(() if args.cpu_smoke else ("graphs",))):
        results[phase] = child(phase, base, work, args.phase_timeout)
    rows, failed = table_rows(results, presets, tp, args.cpu_smoke)
    timings = {
        **(results.get("main") or {}).get("timing", {}),
        **(results.get("graphs") or {}).get("timing", {}),
    }
    summary = {name: bl.summarize(r) for name, r in timings.items()}
    env = bl.environment()
    env["vllm"] = __import__("vllm").__version__
    env["model"] = {
        "spec": args.model,
        "dtype": args.dtype,
        "device": "cpu" if args.cpu_smoke else f"{tp} x cuda",
    }
    els = args.steer or (made_els or {}).get("els")
    notes = [
        f"vllm {env['vllm']}, tensor-parallel size {tp}"
        + (" -- CPU SMOKE RUN (not a GPU result)" if args.cpu_smoke else ""),
        f"steering: {', '.join(p['name'] for p in presets)} (vectors {vectors}"
        + (f", ELS {els}{'' if args.steer else ', made here'})" if els else ")"),
        f"{len(prompts)} prompts of {args.data}, {args.max_new_tokens} new tokens, greedy; timing: "
        f"{args.concurrency} concurrent requests, ignore_eos, {args.repeats} repetitions after a warm-up; "
        "prefix cache off",
        *[
            f"{ph}: engine start {r['engine_start_s']:.1f} s"
            for ph, r in results.items()
            if r and "engine_start_s" in r
        ],
    ]
    verdict = "PASS" if not failed else "FAIL: " + "; ".join(failed)
    time_rows = [
        [
            name,
            s["median_s"],
            s.get("median_tok_s"),
            s["tokens"] if not isinstance(s["tokens"], list) else "varies",
        ]
        for name, s in summary.items()
    ]
    md = "\n".join(
        [
            *bl.header("vLLM backend GPU checks", env, notes),
            bl.md_table(["check", "preset", "result", "detail"], rows, align="llll"),
            "",
            bl.md_table(["arm", "median s", "tok/s", "tokens"], time_rows),
            "",
            verdict,
        ]
    )
    result = {
        "args": vars(args),
        "env": env,
        "presets": presets,
        "phases": results,
        "rows": rows,
        "summary": summary,
        "failed": failed,
    }
    bl.write_outputs(args.out, NAME, result, md)
    return 1 if failed else 0


def table_rows(results: dict, presets: list[dict], tp: int, smoke: bool) -> tuple[list[list], list[str]]:
    """The checks' rows (check, preset, result, detail) and the names of the failed ones."""
    rows: list[list] = []
    failed: list[str] = []

    def add(check: str, preset: str, ok: bool | None, detail: str) -> None:
        result = "info" if ok is None else "pass" if ok else "fail"
        rows.append([check, preset, result, detail])
        if ok is False:
            failed.append(f"{check} {preset}")

    main, ref, graphs = results.get("main"), results.get("reference"), results.get("graphs")
    if results.get("vectors", True) is None:
        add("0 vectors", "-", False, "the vectors phase failed")
    if main is None:
        add("1-3, 5", "all", False, "the TP=N engine's phase failed")
    else:
        reg = main["registration"]
        add(
            "1 registration",
            "all",
            reg["ok"],
            f"{reg['ranks']} ranks (engine tensor_parallel_size {reg['engine_tp']}, asked {tp}), {len(presets)} "
            f"presets, configs {'equal' if reg['configs_equal'] else 'DIFFER'} on every rank",
        )
        for p in presets:
            z = main["zero"][p["name"]]
            add("2 strength 0", p["name"], z["ok"], f"{z['same']}/{z['n']} prompts token for token plain")
        for p in presets:
            t = main["trace"][p["name"]]
            edits = sorted({r["edits"] for r in t["per_rank"]})
            held = t["per_rank"][0]["held"] if t["per_rank"] else 0
            detail = (
                f"{t['steered']} steered ({held} held by the decision), {t['plain']} plain; "
                f"{'/'.join(map(str, edits))} edits per rank; traces and decisions of the {t['ranks']} "
                f"rank(s) {'equal' if t['ranks_equal'] else 'DIFFER'}"
            )
            if t["problems"]:
                detail += f"; {t['n_problems']} problems, first: {t['problems'][0]}"
            add("3 trace", p["name"], t["ok"], detail)
    if main is None or ref is None:
        add(f"4 TP={tp} vs TP=1", "all", False, "an engine's phase failed")
    else:
        for arm in ["plain", *(p["name"] for p in presets)]:
            c = compare_answers(main["answers"][arm], ref["answers"][arm])
            results.setdefault("compare", {})[arm] = c
            add(
                f"4 TP={tp} vs TP=1",
                arm,
                c["ok"],
                f"identical {c['identical']}/{c['n']}; refusal {c['after']:.3f} vs {c['before']:.3f}, diff "
                f"{c['diff']:+.3f} (95% paired [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}], +{c['gained']} "
                f"-{c['lost']})",
            )
    if main is not None:
        runs = main["timing"]
        tokens = {name: {r["tokens"] for r in rs} for name, rs in runs.items()}
        add(
            "5 timing",
            "same work",
            len({t for ts in tokens.values() for t in ts}) == 1,
            "generated tokens per arm: " + ", ".join(f"{k} {sorted(v)}" for k, v in tokens.items()),
        )
        for p in presets:
            name = f"eager+{p['name']}"
            r = bl.paired_ratio(runs["eager"], runs[name])["median_paired"]
            steered = sorted({x["steered_rows"] for x in runs[name]})
            add(
                "5 timing",
                p["name"],
                None if smoke else r <= TARGET,
                f"steered / eager {r:.3f} (target <= {TARGET}{', not asserted in a smoke run' if smoke else ''}); "
                f"steered rows {'/'.join(map(str, steered))} of {runs[name][0]['rows']}",
            )
        if graphs is not None:
            eager = bl.median([r["seconds"] for r in runs["eager"]])
            graph = bl.median([r["seconds"] for r in graphs["timing"]["graphs"]])
            add(
                "5 timing",
                "eager / graphs",
                None,
                f"{eager / graph:.3f} (ratio of medians, {eager:.3f} s / {graph:.3f} s)",
            )
        elif smoke:
            add("5 timing", "eager / graphs", None, "no graphs arm in a smoke run")
        else:
            add("5 timing", "eager / graphs", False, "the graphs engine's phase failed")
    return rows, failed


if __name__ == "__main__":
    sys.exit(main())
