"""The ``aligntax`` model type of lm-evaluation-harness and ``aligntax lm-eval`` (extra ``lmeval``), on a
tiny random model saved to a folder and local tasks (tests/lmeval_tasks.py): unsteered it scores
exactly as lm-eval's own ``hf`` model; steered, every loglikelihood equals the one computed request by
request with the hooks' prompt boundary at the request's last context token; hooks are removed."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import aligntax  # noqa: E402
from aligntax.interventions import NoIntervention  # noqa: E402
from aligntax.interventions.base import SteerContext  # noqa: E402
from aligntax.lmeval.model import AligntaxLM  # noqa: E402
from lmeval_tasks import write_tasks  # noqa: E402
from tiny import hook_counts, save_tiny_bank, save_tiny_vectors, tiny_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TASKS = ["local_mc", "local_gen", "local_ppl"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny model folder (fp32), the local tasks, a vector folder and an energy bank."""
    root = tmp_path_factory.mktemp("lmeval")
    lm = tiny_lm("qwen2", hidden=32, layers=3)
    lm.model.save_pretrained(root / "model")
    lm.tokenizer.save_pretrained(root / "model")
    loaded = aligntax.load_model(str(root / "model"), dtype="fp32", device="cpu")
    return {
        "root": root,
        "model": root / "model",
        "lm": loaded,
        "tasks": TaskManager(include_path=str(write_tasks(root / "tasks"))),
        "vectors": save_tiny_vectors(loaded, root / "vectors"),
        "bank": save_tiny_bank(loaded, root / "bank", n=16, epochs=2),
    }


def evaluate(model, setup, tasks=TASKS, **kw):
    args = {} if not isinstance(model, str) else {"model_args": kw.pop("model_args")}
    res = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=setup["tasks"], batch_size=8, log_samples=True, **args, **kw
    )
    return res


def responses(res, task):
    """Per sample (in document order), lm-eval's raw responses."""
    return [s["resps"] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]


def ll(resp) -> float:
    """The log-likelihood of one response: ``(logprob, is_greedy)`` for loglikelihood, a bare float for
    loglikelihood_rolling."""
    value = resp[0]
    return float(value[0] if isinstance(value, tuple | list) else value)


def metrics(res):
    return {t: {k: v for k, v in m.items() if k not in ("alias", "name")} for t, m in res["results"].items()}


def test_unsteered_equals_lm_eval_hf(setup):
    """Same folder, same dtype: every per-sample response and every score is exactly hf's."""
    hf = evaluate("hf", setup, model_args=f"pretrained={setup['model']},dtype=float32,device=cpu")
    ours = evaluate("aligntax", setup, model_args=f"spec={setup['model']},dtype=fp32,device=cpu")
    for task in TASKS:
        assert responses(ours, task) == responses(hf, task), task
    assert metrics(ours) == metrics(hf)
    assert len(responses(ours, "local_mc")) == 20 and len(responses(ours, "local_gen")) == 10
    lls = [ll(r) for rows in responses(ours, "local_mc") for r in rows]
    assert len(lls) == 80 and len(set(lls)) > 40  # real, distinct log-likelihoods


def test_steered_path_without_steering_matches_hf(setup):
    """The steered code path (left-padded contexts, then continuation tokens as cached decode steps) with
    no steering gives hf's log-likelihoods and scores."""
    hf = evaluate(
        "hf",
        setup,
        ["local_mc", "local_ppl"],
        model_args=f"pretrained={setup['model']},dtype=float32,device=cpu",
    )
    model = AligntaxLM(lm=setup["lm"], intervention=NoIntervention(), batch_size=8)
    ours = evaluate(model, setup, ["local_mc", "local_ppl"])
    assert model.steered_forwards > 0
    for task in ("local_mc", "local_ppl"):
        a = torch.tensor([ll(r) for rows in responses(ours, task) for r in rows])
        b = torch.tensor([ll(r) for rows in responses(hf, task) for r in rows])
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert metrics(ours)["local_mc"] == metrics(hf)["local_mc"]


def reference_loglikelihood(lm, iv, context: list[int], continuation: list[int]) -> float:
    """One request alone, without padding or KV cache: the hooks attached with the prompt boundary at
    the last context token, one forward over context + continuation[:-1]."""
    seq = torch.tensor([context + continuation[:-1]])
    ctx = SteerContext(prompt_len=len(context))
    with torch.no_grad(), iv.attach(lm.model, ctx):
        logp = torch.log_softmax(lm.model(input_ids=seq).logits[0].float(), -1)
    pos = torch.arange(len(context) - 1, seq.shape[1])
    return float(logp[pos, torch.tensor(continuation)].sum())


@pytest.mark.parametrize("which", ["refusal-add", "els-horizon"])
def test_steered_loglikelihoods_land_on_each_rows_last_context_token(setup, which):
    lm = setup["lm"]
    if which == "refusal-add":
        iv = aligntax.load_intervention(setup["vectors"], lm, name="refusal-add", coeff=4.0)
    else:
        # every row steered (no row energy decision): the check is where each row's step lands
        iv = aligntax.load_intervention(setup["bank"], lm, eta=0.5, top_k=2, horizon=1, row_threshold="none")
    before = hook_counts(lm.model)
    model = AligntaxLM(lm=lm, intervention=iv, batch_size=8)
    steered = evaluate(model, setup, ["local_mc", "local_ppl", "local_gen"])
    assert hook_counts(lm.model) == before and "generate" not in vars(lm.model)
    plain = evaluate(AligntaxLM(lm=lm, batch_size=8), setup, ["local_mc", "local_ppl", "local_gen"])
    n_changed = 0
    for task in ("local_mc", "local_ppl"):
        for sample, unsteered in zip(
            sorted(steered["samples"][task], key=lambda s: s["doc_id"]), responses(plain, task), strict=True
        ):
            for args, resp, plain_resp in zip(sample["arguments"], sample["resps"], unsteered, strict=True):
                if task == "local_mc":
                    context, cont = model._encode_pair(*args)
                    expected = reference_loglikelihood(lm, iv, context, cont)
                else:  # rolling: one window, the prefix token as its context
                    tokens = model.tok_encode(args[0])
                    expected = reference_loglikelihood(lm, iv, [model.prefix_token_id], tokens)
                assert ll(resp) == pytest.approx(expected, abs=2e-4), (task, args)
                n_changed += abs(ll(resp) - ll(plain_resp)) > 1e-2
    assert n_changed >= 60  # the intervention does move (nearly) every score
    assert model.steered_forwards > 0
    gens = [r[0][0] for r in responses(steered, "local_gen")]
    assert len(gens) == 10 and all(isinstance(g, str) for g in gens)
    assert gens != [r[0][0] for r in responses(plain, "local_gen")]  # generate_until is steered too


def test_lm_eval_command_writes_run_folder(setup, tmp_path):
    from typer.testing import CliRunner

    from aligntax.cli import app

    out = tmp_path / "run"
    args = [
        "lm-eval",
        "--model",
        str(setup["model"]),
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--intervention",
        "refusal-add",
        "--vectors",
        str(setup["vectors"]),
        "--coeff",
        "4",
        "--compare",
        "--out",
        str(out),
        "--",
        "--tasks",
        "local_mc",
        "--include_path",
        str(setup["root"] / "tasks"),
        "--batch_size",
        "8",
        "--log_samples",
    ]
    before = hook_counts(setup["lm"].model)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "results.json").read_text())
    assert set(result["scores"]) == {"unsteered", "steered"}
    assert result["intervention"]["name"] == "refusal-add" and result["intervention"]["coeff"] == 4.0
    assert result["model_fingerprint"]["hidden_size"] == 32
    uns, st = result["scores"]["unsteered"]["local_mc"]["acc"], result["scores"]["steered"]["local_mc"]["acc"]
    assert result["tax"]["local_mc"]["acc"] == pytest.approx(st - uns)
    # the unsteered side is lm-eval's hf score of the same folder
    hf = evaluate(
        "hf", setup, ["local_mc"], model_args=f"pretrained={setup['model']},dtype=float32,device=cpu"
    )
    assert uns == hf["results"]["local_mc"]["acc,none"]
    assert (out / "samples_steered_local_mc.jsonl").is_file() and (out / "lm_eval_unsteered.json").is_file()
    assert "| local_mc | acc |" in (out / "report.md").read_text()
    assert hook_counts(setup["lm"].model) == before
    bad = CliRunner().invoke(
        app,
        [
            "lm-eval",
            "--model",
            str(setup["model"]),
            "--out",
            str(tmp_path / "x"),
            "--",
            "--tasks",
            "local_mc",
            "--model_args",
            "pretrained=x",
        ],
    )
    assert bad.exit_code == 2 and "--model" in bad.output


@pytest.mark.slow
def test_embedded_unsteered_equals_lm_eval_hf(setup):
    """The embedded 0.5B model: the aligntax model type scores 20 multiple-choice items exactly as lm-eval's
    hf model on the embedded model's cached folder, in bf16."""
    from aligntax.models.embedded import converted_dir, is_fetched

    name = "qwen2.5-coder-0.5b-instruct"
    if not is_fetched(name):
        pytest.skip("embedded model not fetched (run ./run setup)")
    hf = evaluate(
        "hf", setup, ["local_mc"], model_args=f"pretrained={converted_dir(name)},dtype=bfloat16,device=cpu"
    )
    ours = evaluate("aligntax", setup, ["local_mc"], model_args=f"spec=embedded:{name},dtype=bf16,device=cpu")
    assert responses(ours, "local_mc") == responses(hf, "local_mc")
    assert metrics(ours) == metrics(hf)
    assert metrics(ours)["local_mc"]["acc,none"] >= 0.5  # a real model knows capitals and small sums
