"""The lm-eval adapter: its scores against direct computations with the model, the bundled
tasks end to end through ``lm_eval.simple_evaluate``, and planted answer-key models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

lm_eval = pytest.importorskip("lm_eval")  # the `test` extra has it; a GPU machine may not

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model, model_registry  # noqa: E402

from lapse.eval.common import load_model  # noqa: E402
from lapse.eval.lm_eval import (  # noqa: E402
    TASKS_DIR,
    LapseLM,
    LmEvalConfig,
    jsonl_dataset,
    run_lm_eval,
    task_manager,
)
from lapse.generation import generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lm(fox_run) -> LapseLM:
    return LapseLM(pretrained=fox_run, device="cpu", batch_size=3)


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))  # the fixture's byte tokenizer


@torch.no_grad()
def _direct(model, context: list[int], continuation: list[int], max_len: int) -> tuple[float, bool]:
    """Sum of log-softmax at the continuation's positions, one unpadded sequence of at most
    ``max_len`` tokens, the context cut from the left."""
    tokens = (context + continuation)[-(max_len + 1) :]
    inp = tokens[:-1]
    logits, _ = model(torch.tensor([inp]))  # [1, T, V]
    logp = torch.log_softmax(logits[0].double(), dim=-1)  # [T, V]
    first = len(inp) - len(continuation)  # the position that predicts continuation[0]
    total, greedy = 0.0, True
    for j, token in enumerate(continuation):
        total += float(logp[first + j, token])
        greedy &= int(logp[first + j].argmax()) == token
    return total, greedy


def test_registered_beside_the_harness_models():
    assert get_model("lapse") is LapseLM
    assert "hf" in model_registry  # registering ours did not hide the harness's own names


def test_loglikelihood_equals_direct_computation(lm):
    model, max_len = lm.model, lm.max_length
    assert max_len == 64
    long_context = "\n".join(f"x{i} = {i} * 2" for i in range(30))  # ~300 bytes: cut from the left
    cases = [
        ("def add(a, b):\n    return", " a + b"),
        ("import numpy as ", "np"),  # lm-eval moves the trailing space into the continuation
        (long_context, "y = x1 + x2"),
        ("#", "!" * 60),  # continuation nearly fills the window: 3 context tokens are kept
        ("", "import os"),  # empty context: the continuation is predicted from <eos>
    ]
    got = lm.loglikelihood(_requests("loglikelihood", cases), disable_tqdm=True)
    eos = lm.tokenizer.eos_id
    expected = [
        _direct(model, _ids(cases[0][0]), _ids(cases[0][1]), max_len),
        _direct(model, _ids("import numpy as"), _ids(" np"), max_len),
        _direct(model, _ids(long_context), _ids("y = x1 + x2"), max_len),
        _direct(model, _ids("#"), _ids("!" * 60), max_len),
        _direct(model, [eos], _ids("import os"), max_len),
    ]
    for (ll, greedy), (ref, ref_greedy) in zip(got, expected, strict=True):
        assert ll == pytest.approx(ref, abs=1e-4)
        assert greedy == ref_greedy
    # batched and padded with shorter neighbours, or alone: the same scores
    alone = LapseLM(pretrained=lm.loaded, device="cpu", batch_size=1)
    single = alone.loglikelihood(_requests("loglikelihood", cases), disable_tqdm=True)
    assert [s for s, _ in single] == pytest.approx([s for s, _ in got], abs=1e-5)


def test_no_progress_hides_the_scoring_bar(lm, capsys):
    """``lapse eval lm-eval --no-progress`` (``progress=False``) hides lapse's bars; lm-eval's
    own ``disable_tqdm`` still works alone."""
    requests = _requests("loglikelihood", [("def f():\n    return", " 1")])
    lm.loglikelihood(requests)
    assert "lapse loglikelihood" in capsys.readouterr().err
    quiet = LapseLM(pretrained=lm.loaded, device="cpu", batch_size=3, progress=False)
    quiet.loglikelihood(requests)
    assert "lapse loglikelihood" not in capsys.readouterr().err
    assert LmEvalConfig(model=lm.loaded.path, tasks=("lapse_tiny_mc",), progress=False).progress is False


def test_is_greedy_true_for_the_models_own_continuation(lm):
    context = "def main():\n    return"
    out = generate(lm.model, torch.tensor([_ids(context)]), 6)[0, -6:].tolist()
    assert all(t < 128 for t in out), "the tiny model should continue in ASCII"
    continuation = bytes(out).decode()
    (ll, greedy), (ll_other, greedy_other) = lm.loglikelihood(
        _requests("loglikelihood", [(context, continuation), (context, "zzzzzz")]), disable_tqdm=True
    )
    assert greedy and not greedy_other
    assert ll > ll_other


def test_loglikelihood_rolling_scores_every_token_once(lm):
    text = "".join(f"value_{i} = compute({i}, scale=2)\n" for i in range(5))  # ~170 bytes, 3 windows
    ids, max_len, eos = _ids(text), lm.max_length, lm.tokenizer.eos_id
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,), ("short",)]), True)
    # lm-eval's windows: tokens [s, e) in chunks of L, each predicted from the L tokens of
    # <eos> + text that end just before e
    padded, total = [eos, *ids], 0.0
    for s in range(0, len(ids), max_len):
        e = min(s + max_len, len(ids))
        total += _direct(lm.model, padded[max(0, e - max_len) : s + 1], ids[s:e], max_len)[0]
    assert got[0] == pytest.approx(total, abs=1e-4)
    assert got[1] == pytest.approx(_direct(lm.model, [eos], _ids("short"), max_len)[0], abs=1e-4)


def test_generate_until_is_greedy_generation_cut_at_the_stop(lm):
    context = "class Model:\n    def "
    full_ids = generate(lm.model, torch.tensor([_ids(context)]), 40)[0, -40:].tolist()
    assert lm.tokenizer.eos_id not in full_ids
    full = lm.tokenizer.decode(full_ids)
    stop = full[20:22]  # found in the second chunk of GEN_CHUNK tokens
    got = lm.generate_until(
        _requests(
            "generate_until",
            [(context, {"max_gen_toks": 40}), (context, {"until": [stop], "max_gen_toks": 40})],
        ),
        disable_tqdm=True,
    )
    assert got == [full, full.split(stop, 1)[0]]


def test_bundled_tasks_end_to_end(fox_run, tmp_path):
    cfg = LmEvalConfig(model=fox_run, tasks=("lapse_tiny",), limit=6, batch_size=4, device="cpu",
                       out_dir=tmp_path / "lm-eval", log_samples=True)
    results = run_lm_eval(cfg)
    scores = results["results"]
    assert 0.0 <= scores["lapse_tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= scores["lapse_tiny_gen"]["exact_match,none"] <= 1.0
    assert scores["lapse_tiny_ppl"]["bits_per_byte,none"] > 0
    for task in ("lapse_tiny_mc", "lapse_tiny_ppl", "lapse_tiny_gen"):
        assert results["n-samples"][task] == {"original": 16, "effective": 6}
        samples = (cfg.out_dir / f"samples_{task}.jsonl").read_text().splitlines()
        assert len(samples) == 6
    assert json.loads((cfg.out_dir / "results.json").read_text()) == results
    summary = (cfg.out_dir / "summary.md").read_text()
    assert "lapse_tiny_mc" in summary and "|acc " in summary
    default = LmEvalConfig(model=fox_run, tasks=("lapse_tiny_mc",))
    assert default.resolved_out_dir == fox_run / "eval" / "lm-eval"


def test_few_shot_prompts_and_scores_are_deterministic_given_the_seed(fox_run, tmp_path, monkeypatch):
    import lm_eval.evaluator  # lm_eval loads it lazily: patched here even when run alone

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)  # see _answer_key_accuracy

    def samples(seed: int, name: str) -> list[dict]:
        cfg = LmEvalConfig(model=fox_run, tasks=("lapse_tiny_mc",), num_fewshot=2, limit=4, seed=seed,
                           device="cpu", out_dir=tmp_path / name)
        run_lm_eval(cfg)
        lines = (cfg.out_dir / "samples_lapse_tiny_mc.jsonl").read_text().splitlines()
        return [(row["arguments"], row["resps"]) for row in map(json.loads, lines)]

    first = samples(0, "a")
    assert first == samples(0, "b")
    assert [args for args, _ in first] != [args for args, _ in samples(1, "c")]  # other few-shot examples


class AnswerKey(nn.Module):
    """A planted model that has memorised one line per question (the question followed by
    one of its choices): wherever the input so far is a prefix of a memorised line it puts
    logit 10 on that line's next token, elsewhere all logits are 0. So a choice is likely
    exactly when it is the memorised one, and only if the adapter reads the logits at the
    positions that predict the continuation's tokens."""

    def __init__(self, config, lines: list[list[int]]):
        super().__init__()
        self.config, self.lines = config, lines

    def forward(self, input_ids, labels=None, cache=None):
        b, t = input_ids.shape
        logits = torch.zeros(b, t, self.config.vocab_size)  # [B, T, V]
        for row_index, row in enumerate(input_ids.tolist()):
            for line in self.lines:
                common = 0  # the length of the common prefix of the input row and the line
                while common < min(len(row), len(line)) and row[common] == line[common]:
                    common += 1
                for pos in range(min(common, len(line) - 1)):
                    logits[row_index, pos, line[pos + 1]] = 10.0
        return logits, None


def _answer_key_accuracy(fox_run, pick, monkeypatch) -> dict:
    # simple_evaluate records the environment through torch's collect_env, which runs
    # `pip list` (~2 s): not what these tests are about
    import lm_eval.evaluator  # lm_eval loads it lazily: patched here even when run alone

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    docs = jsonl_dataset(TASKS_DIR / "lapse_tiny.jsonl")["test"]
    assert len({doc["answer"] for doc in docs}) == 3, "the right answers must not all be at one index"
    loaded = load_model(fox_run)
    lines = [_ids(doc["question"] + doc["choices"][pick(doc)]) for doc in docs]
    loaded.model = AnswerKey(loaded.config, lines)
    lm = LapseLM(pretrained=loaded, device="cpu", batch_size=5)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["lapse_tiny_mc"], task_manager=task_manager(["lapse_tiny_mc"]),
        log_samples=False, bootstrap_iters=0,
    )
    assert results["n-samples"]["lapse_tiny_mc"]["effective"] == 16
    return results["results"]["lapse_tiny_mc"]


def test_answer_key_of_right_answers_scores_one(fox_run, monkeypatch):
    scores = _answer_key_accuracy(fox_run, lambda doc: doc["answer"], monkeypatch)
    assert scores["acc,none"] == 1.0 and scores["acc_norm,none"] == 1.0


def test_answer_key_of_wrong_answers_scores_zero(fox_run, monkeypatch):
    wrong = lambda doc: (doc["answer"] + 1) % len(doc["choices"])  # noqa: E731
    scores = _answer_key_accuracy(fox_run, wrong, monkeypatch)
    assert scores["acc,none"] == 0.0 and scores["acc_norm,none"] == 0.0


def test_missing_model_or_data_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-run"
    with pytest.raises(ValueError, match="model path does not exist"):
        LmEvalConfig(model=missing, tasks=("lapse_tiny_mc",))
    with pytest.raises(ValueError, match="model path does not exist"):
        lm_eval.simple_evaluate(model="lapse", model_args={"pretrained": str(missing)}, tasks=["x"])
    with pytest.raises(ValueError, match="task data file does not exist"):
        jsonl_dataset(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="tasks must be"):
        LmEvalConfig(model=tmp_path, tasks=())
    with pytest.raises(ValueError, match="batch_size"):
        LmEvalConfig(model=tmp_path, tasks=("lapse_tiny_mc",), batch_size=0)
    with pytest.raises(ValueError, match="include_path"):
        LmEvalConfig(model=tmp_path, tasks=("lapse_tiny_mc",), include_path=Path(tmp_path / "nope"))


def test_a_policys_results_have_their_own_folder_and_none_is_overwritten(fox_run, tmp_path, monkeypatch,
                                                                         capsys):
    """``--policy h2o`` wrote into the run's plain ``eval/lm-eval`` (its samples beside the old
    ones) and ``lapse report`` showed it as the model's result; a second plain run replaced
    the first without a word."""
    import shutil

    import lm_eval.evaluator

    from lapse.cli import main

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)  # see _answer_key_accuracy
    run = shutil.copytree(fox_run, tmp_path / "run", ignore=shutil.ignore_patterns("eval"))
    args = ["eval", "lm-eval", "--model", str(run), "--limit", "2", "--device", "cpu", "--no-progress"]
    main([*args, "--tasks", "lapse_tiny_mc"])
    main([*args, "--tasks", "lapse_tiny_mc", "--policy", "h2o", "--budget", "4", "--recent", "2",
          "--sinks", "0"])
    plain, h2o = run / "eval" / "lm-eval", run / "eval" / "lm-eval-h2o"
    assert json.loads((plain / "results.json").read_text())["lapse"]["policy"] is None
    assert json.loads((h2o / "results.json").read_text())["lapse"]["policy"] == "h2o"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--tasks", "lapse_tiny_ppl"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {plain} holds an earlier evaluation (results.json): --overwrite replaces it, "
        "--out-dir writes elsewhere"
    ]
    main([*args, "--tasks", "lapse_tiny_ppl", "--overwrite"])  # the earlier task's samples go with it
    assert sorted(p.name for p in plain.iterdir()) == ["results.json", "samples_lapse_tiny_ppl.jsonl",
                                                        "summary.md"]


def test_outside_a_git_folder_the_commit_is_unknown_without_a_word(fox_run, tmp_path, monkeypatch, capfd):
    """lm-eval's ``git describe`` wrote ``fatal: not a git repository`` to the terminal."""
    import lm_eval.evaluator

    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)  # see _answer_key_accuracy
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # git looks no higher
    results = run_lm_eval(LmEvalConfig(model=fox_run, tasks=("lapse_tiny_mc",), limit=2, device="cpu",
                                       out_dir=tmp_path / "out", progress=False))
    assert results["git_hash"] == "unknown"
    assert "fatal" not in capfd.readouterr().err
    assert lm_eval.evaluator.get_git_commit_hash.__module__ == "lm_eval.loggers.utils"  # put back
