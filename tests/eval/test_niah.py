"""Needle in a haystack: prompts, both scores on planted models, and the grid end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from lapse.data import ByteTokenizer
from lapse.eval.common import LoadedModel
from lapse.eval.niah import (
    NiahConfig,
    build_prompt,
    evaluate_model,
    load_haystack,
    make_trials,
    run_niah,
)

HAYSTACK = "".join(
    f"Line {i} of the haystack says something about item {i * 7 % 13}. It goes on a little.\n"
    if i % 5
    else f"def function_{i}(x):\n    return x * {i}\n\n"
    for i in range(400)
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def haystack_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("haystack") / "haystack.txt"
    path.write_text(HAYSTACK)
    return path


def _cfg(haystack: Path, tmp_path: Path, **overrides) -> NiahConfig:
    fields = dict(
        models=(tmp_path / "model",),
        context_lengths=(160, 300, 517),
        depths=(0.0, 0.3, 0.5, 1.0),
        haystack=haystack,
        trials=3,
        batch_size=2,
        device="cpu",
        progress=False,
    )
    return NiahConfig(**(fields | overrides))


class InductionCopier(nn.Module):
    """A planted model with the decoder's forward and cache interface: at every position it
    puts all its mass on the token that followed the longest earlier match of the context
    ending there (an idealised induction head), so it copies the needle's number when the
    query repeats the needle's words. ``wrong=True`` shifts every prediction by one id, so
    it never produces the right token."""

    def __init__(self, vocab_size: int = 258, wrong: bool = False):
        super().__init__()
        self.config = SimpleNamespace(n_layers=1, vocab_size=vocab_size)
        self.wrong = wrong

    lm_head = torch.nn.Identity()  # hidden_states are already the logits

    def forward(self, input_ids, labels=None, *, cache=None):
        return self.hidden_states(input_ids, cache=cache), None

    def hidden_states(self, input_ids, *, cache=None, lengths=None):
        ids = input_ids
        if cache is not None:
            # the store only has to remember the tokens; begin/advance keep its length right
            cache.begin(input_ids.shape[0], input_ids.shape[1], input_ids.device, lengths)
            ids = torch.cat([cache.tokens, input_ids], dim=1) if cache.length else input_ids
            cache.tokens = ids
            cache.advance()
        new = input_ids.shape[1]
        logits = torch.zeros(*input_ids.shape, self.config.vocab_size)  # [B, T, V]
        for row, seq in enumerate(ids.numpy()):
            t0 = len(seq) - new
            run = np.zeros(len(seq), dtype=np.int64)  # run[j]: match length of the contexts ending at t, j
            for t in range(len(seq)):
                same = np.zeros(len(seq), dtype=np.int64)
                same[:t] = seq[:t] == seq[t]
                run = same * (1 + np.concatenate([[0], run[:-1]]))
                if t >= t0:
                    best = int(run.max())
                    j = t - 1 - int(np.argmax(run[:t][::-1])) if best else -1  # the latest longest match
                    token = seq[j + 1] if best else 0
                    logits[row, t - t0, (token + self.wrong) % self.config.vocab_size] = 30.0
        return logits


def _planted(wrong: bool) -> LoadedModel:
    name = "never" if wrong else "copier"
    model = InductionCopier(wrong=wrong)
    return LoadedModel(model=model, tokenizer=ByteTokenizer(), name=name, path=Path(name))


@pytest.mark.parametrize("mode", ["standard", "easy"])
def test_planted_copier_scores_all_and_the_wrong_one_nothing(haystack_file, tmp_path, mode):
    cfg = _cfg(haystack_file, tmp_path, mode=mode, context_lengths=(160, 300), depths=(0.0, 0.5, 1.0))
    haystack = load_haystack(cfg)
    copier = evaluate_model(_planted(False), cfg, haystack)
    never = evaluate_model(_planted(True), cfg, haystack)
    assert len(copier["cells"]) == len(never["cells"]) == 6 and copier["complete"]
    for good, bad in zip(copier["cells"], never["cells"], strict=True):
        assert good["exact_match"] == 1.0 and bad["exact_match"] == 0.0
        assert good["answer_logprob"] > -1e-6  # mass 1 - 257 e^-30 on every answer token
        answer_tokens = good["trials"][0]["answer_tokens"]
        assert bad["answer_logprob"] < -29 * answer_tokens
        for trial in good["trials"]:
            assert trial["generated"] == trial["answer"] == f" {trial['number']}"


def test_prompts_have_the_length_and_the_needle_at_the_depth(haystack_file, tmp_path):
    # 3000 characters of haystack: the 9000-token prompts wrap around it several times
    cfg = _cfg(haystack_file, tmp_path, trials=6, context_lengths=(160, 1000, 9000), haystack_chars=3000)
    tok = ByteTokenizer()
    haystack = load_haystack(cfg)
    needle_lines = 0
    for trial in make_trials(cfg, haystack):
        needle = tok.encode(cfg.needle_text(trial.number) + "\n")
        for length in cfg.context_lengths:
            for depth in cfg.depths:
                p = build_prompt(cfg, tok, haystack, trial, length, depth)
                assert len(p.ids) == length
                assert p.ids[p.needle_start : p.needle_start + p.needle_len] == needle
                query_start = length - len(tok.encode(cfg.query_text()))
                assert tok.decode(p.ids[query_start:]) == cfg.query_text()
                hay = p.ids[: p.needle_start] + p.ids[p.needle_start + p.needle_len : query_start]
                assert len(hay) == p.haystack_tokens
                # a segment boundary, and no other boundary between it and the requested position
                assert p.needle_start == 0 or tok.decode(hay[: p.needle_start]).endswith(("\n", ". "))
                target = round(depth * p.haystack_tokens)
                between = tok.decode(hay[min(target, p.needle_start) : max(target, p.needle_start)])
                assert between.count("\n") + between.count(". ") <= 1
                needle_lines += 1
    assert needle_lines == 6 * 3 * 4


def test_deterministic_given_the_seed(haystack_file, tmp_path):
    cfg = _cfg(haystack_file, tmp_path, context_lengths=(200,), depths=(0.5,))
    haystack = load_haystack(cfg)
    a = evaluate_model(_planted(False), cfg, haystack)["cells"]
    b = evaluate_model(_planted(False), cfg, load_haystack(cfg))["cells"]
    c = evaluate_model(_planted(False), _cfg(haystack_file, tmp_path, context_lengths=(200,), depths=(0.5,),
                                             seed=1), haystack)["cells"]
    assert a == b
    assert [t["number"] for t in a[0]["trials"]] != [t["number"] for t in c[0]["trials"]]


def test_fox_run_end_to_end(fox_run, tmp_path):
    cfg = NiahConfig(
        models=(fox_run,),
        context_lengths=(128, 192),
        depths=(0.0, 0.5, 1.0),
        number_digits=3,
        trials=2,
        haystack_chars=50_000,  # the default haystack: the local Python sources
        out_dir=tmp_path / "niah",
        device="cpu",
        progress=False,
    )
    results = run_niah(cfg)
    saved = json.loads((tmp_path / "niah" / "results.json").read_text())
    assert saved == json.loads(json.dumps(results))
    (model,) = saved["models"]
    assert model["name"] == "run" and model["train_context"] == 64 and len(model["cells"]) == 6
    for cell in model["cells"]:
        assert 0.0 <= cell["exact_match"] <= 1.0 and cell["answer_logprob"] < 0
        assert len(cell["trials"]) == 2
    assert (tmp_path / "niah" / "niah.png").stat().st_size > 10_000
    summary = (tmp_path / "niah" / "summary.md").read_text()
    assert "![needle in a haystack](niah.png)" in summary and "| 50% |" in summary
    assert NiahConfig(models=(fox_run,)).out_dir == fox_run / "eval" / "niah"
    assert NiahConfig(models=(fox_run,), policy="window").out_dir == fox_run / "eval" / "niah-window"


def test_clear_errors(haystack_file, tmp_path, capsys):
    with pytest.raises(ValueError, match="haystack path does not exist"):
        _cfg(tmp_path / "no-such-file.txt", tmp_path)
    with pytest.raises(ValueError, match="strictly increasing"):
        _cfg(haystack_file, tmp_path, depths=(0.5, 0.0))
    with pytest.raises(ValueError, match="must contain"):
        _cfg(haystack_file, tmp_path, needle="The magic number is secret.")
    with pytest.raises(ValueError, match="placeholders"):
        _cfg(haystack_file, tmp_path, answer=" {answer}")
    with pytest.raises(ValueError, match="model path does not exist"):  # before a progress bar is drawn
        run_niah(_cfg(haystack_file, tmp_path, progress=True, out_dir=tmp_path / "out"))
    assert "niah" not in capsys.readouterr().err
    cfg = _cfg(haystack_file, tmp_path, context_lengths=(40,))
    with pytest.raises(ValueError, match="no room for the haystack"):
        evaluate_model(_planted(False), cfg, load_haystack(cfg))


def test_a_needle_off_its_depth_is_flagged(fox_run, tmp_path):
    """Where the haystack's segments are longer than its room, the needle lands at a boundary
    far from the depth asked: a warning, the landed depth per cell, and a note in the summary
    (the table said 50% for needles at 0)."""
    hay = tmp_path / "long-lines.txt"
    hay.write_text(("word " * 300 + "\n") * 20)  # 1,501-byte lines, no sentence ends
    cfg = NiahConfig(models=(fox_run,), context_lengths=(200,), depths=(0.0, 0.5), trials=1, haystack=hay,
                     out_dir=tmp_path / "niah", device="cpu", progress=False)
    with pytest.warns(UserWarning, match="the needle went to depth 0.00 on average, not 0.5"):
        results = run_niah(cfg)
    cells = results["models"][0]["cells"]
    assert [c["needle_depth"] for c in cells] == [0.0, 0.0]
    assert "200 at 50%: 0%" in (tmp_path / "niah" / "summary.md").read_text()


def test_a_policys_grid_has_its_own_folder_and_none_is_overwritten(fox_run, tmp_path, capsys):
    """``--policy window`` wrote over the run's plain ``eval/niah``, which ``lapse report`` then
    showed as the model's result; a second run replaced the first without a word."""
    import shutil

    from lapse.cli import main
    from lapse.eval.report import ReportConfig, build_report

    run = shutil.copytree(fox_run, tmp_path / "run", ignore=shutil.ignore_patterns("eval"))
    args = ["eval", "niah", "--models", str(run), "--context-lengths", "128", "--depths", "0.5",
            "--trials", "1", "--number-digits", "3", "--haystack-chars", "50000", "--device", "cpu",
            "--no-progress"]
    main(args)
    main([*args, "--policy", "window", "--window", "16"])
    plain, window = run / "eval" / "niah", run / "eval" / "niah-window"
    assert json.loads((plain / "results.json").read_text())["models"][0]["policy"] is None
    assert json.loads((window / "results.json").read_text())["models"][0]["policy"].startswith("SinkWindow(")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--policy", "window"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {window} holds an earlier evaluation (results.json): --overwrite replaces it, "
        "--out-dir writes elsewhere"
    ]
    main([*args, "--policy", "window", "--overwrite"])
    assert "window=1024" in json.loads((window / "results.json").read_text())["models"][0]["policy"]
    text = build_report(ReportConfig(runs=(run,))).read_text()
    assert "\n### niah\n" in text and "\n### niah-window: under the eviction policy `window`\n" in text
