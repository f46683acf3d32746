"""``lapse generate`` from the command line, on a small trained run (the fixture run of
tests/fixtures/before_restructure: cpu-tiny FoX (Pro), two steps)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from lapse.cli import main

RUN = Path(__file__).parents[1] / "fixtures" / "before_restructure" / "run-fox-pro"
SUMMARY = re.compile(
    r"^(\d+) tokens in [\d.]+ s: [\d.]+ tokens/s; KV held [\d.]+ MiB, ([\d.]+)% of a dense cache "
    r"\((\w+); both in whole pages of 16 tokens(; the prompt's cut only: .*)?\)$"
)
# the flags each policy reads (the others are refused)
FLAGS = {
    "dense": [],
    "window": ["--window", "8", "--sinks", "2"],
    "acp": [],
    "h2o": ["--budget", "0.5", "--recent", "4", "--sinks", "2"],
    "a2sf": ["--budget", "0.5", "--recent", "4", "--sinks", "2"],
}


@pytest.fixture
def run(tmp_path):
    return shutil.copytree(RUN, tmp_path / "run")


@pytest.mark.parametrize("policy", ["dense", "window", "acp", "h2o", "a2sf"])
def test_generate_streams_and_ends_with_one_summary_line(run, capsys, policy):
    main(
        [
            "generate",
            str(run),
            "--prompt",
            "def f(x):",
            "--max-new-tokens",
            "40",
            "--max-context",
            "64",
            "--policy",
            policy,
            *FLAGS[policy],
            "--every",
            "4",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("def f(x):")
    match = SUMMARY.match(lines[-1])
    assert match and match.group(3) == policy and match.group(4) is None, lines[-1]
    share = float(match.group(2))
    assert (share == 100.0) if policy == "dense" else (share < 100.0), lines[-1]


@pytest.mark.parametrize("policy", ["dense", "window"])
def test_a_run_that_evicts_nothing_holds_all_of_a_dense_cache(run, capsys, policy):
    """Both sides in whole pages: the dense policy, and a window run shorter than --every (one
    pass, the prompt's, which a short prompt survives), hold 100.0% (whole pages against exact
    tokens read 111.6%); the window run says that only the prompt was cut."""
    main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "40", "--max-context", "64",
          "--policy", policy, *FLAGS[policy]])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    match = SUMMARY.match(line)
    assert match and float(match.group(2)) == 100.0, line
    if policy == "dense":
        assert match.group(4) is None, line
    else:
        assert match.group(4) == ("; the prompt's cut only: the next pass comes after 64 steps (--every), "
                                  "this run made 39"), line


def test_prompts_file_in_jsonl_out(run, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("import os", "class A:")) + "\n")
    main(
        [
            "generate",
            str(run),
            "--prompts-file",
            str(prompts),
            "--max-new-tokens",
            "8",
            "--max-context",
            "64",
            "--temperature",
            "0.8",
            "--top-k",
            "20",
        ]
    )
    rows = [json.loads(line) for line in (tmp_path / "prompts.out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["import os", "class A:"] and all("completion" in r for r in rows)
    assert SUMMARY.match(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("policy", ["dense", "h2o"])
def test_prompts_file_batches_ragged_prompts_as_one_at_a_time(run, tmp_path, policy):
    """Greedy completions of prompts of different lengths, 3 per batch (a ragged batch and
    a last batch of 2), equal those made one prompt at a time."""
    prompts = tmp_path / "prompts.jsonl"
    texts = ["import os", "class A:", "def f(x):\n    return", "x", "for i in range(10):"]
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in texts) + "\n")
    outs = []
    for size in (1, 3):
        out = tmp_path / f"out{size}.jsonl"
        main(
            [
                "generate",
                str(run),
                "--prompts-file",
                str(prompts),
                "--out",
                str(out),
                "--batch-size",
                str(size),
                "--max-new-tokens",
                "12",
                "--max-context",
                "64",
                "--policy",
                policy,
                *(["--budget", "4", "--recent", "2", "--sinks", "1"] if policy == "h2o" else []),
            ]
        )
        outs.append([json.loads(line)["completion"] for line in out.read_text().splitlines()])
    assert outs[0] == outs[1] and len(outs[0]) == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "x" * 60, "--max-new-tokens", "10"],
         r"the prompt \(60 tokens\) \+ max_new_tokens \(10\) exceeds max_context \(64"),
        (["--prompt", "x", "--policy", "window", "--window", "0"], "window must be a positive integer"),
        (["--prompt", "x", "--policy", "h2o", "--budget", "4", "--recent", "8"], "must fit in the budget"),
        ([], "give exactly one of --prompt and --prompts-file"),
        (["--prompt", "x", "--policy", "h2o", "--budget", "2.5"], "budget above 1 counts tokens"),
        (["--prompt", "x" * 64], r"the prompt \(64 tokens\) leaves no room to generate in max_context"),
        (["--prompt", "x", "--max-context", "0"], "--max-context must be at least 2"),
        (["--prompt", "x" * 8, "--max-context", "8"],
         r"leaves no room to generate in --max-context \(8\): shorten it, or pass a larger --max-context"),
    ],
    ids=["empty", "too-long", "window-0", "budget", "no-prompt", "budget-fraction-above-1", "prompt-fills",
         "max-context-0", "max-context-given"],
)
def test_bad_input_is_one_line(run, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(run), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(message, err[0]), err


def test_missing_run_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(tmp_path / "nowhere"), "--prompt", "x"])
    assert e.value.code == 2
    assert "no such run or checkpoint folder" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["h2o", "a2sf", "window", "acp"])
def test_default_policy_fields_work_on_a_short_prompt(run, capsys, policy):
    main(
        [
            "generate",
            str(run),
            "--prompt",
            "def ",
            "--max-new-tokens",
            "40",
            "--max-context",
            "64",
            "--policy",
            policy,
            "--top-p",
            "0.9",
            "--temperature",
            "0.7",
        ]
    )
    assert SUMMARY.match(capsys.readouterr().out.strip().splitlines()[-1])


def test_top_p_out_of_range_is_one_line(run, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(run), "--prompt", "x", "--top-p", "2"])
    assert e.value.code == 2 and "--top-p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [(["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
                                           (["--top-k", "0"], "--top-k must be a positive integer, got 0")])
def test_sampling_values_are_checked_before_the_prompt_is_echoed(run, capsys, args, message):
    """They were checked by the sampler, after the model loaded and the prompt was printed:
    the error line came glued to it (``xerror: ...``)."""
    with pytest.raises(SystemExit) as e:
        main(["generate", str(run), "--prompt", "x", *args])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == "" and captured.err.splitlines() == [f"error: {message}"]


def test_generate_from_an_export_folder_writes_the_runs_text(run, tmp_path, capsys):
    """``lapse generate EXPORT`` (a ``lapse export`` folder) loads the decoder and lapse's
    tokenizer from it and writes, greedily, the run's own text (it was refused: transformers
    cannot read lapse's tokenizer)."""
    from lapse.hf import LapseConfig
    from lapse.models.checkpoint import EXPORT_MODEL_TYPE, is_export_folder

    assert LapseConfig.model_type == EXPORT_MODEL_TYPE
    export = tmp_path / "export"
    main(["export", str(run), str(export)])
    assert is_export_folder(export) and not is_export_folder(run)
    capsys.readouterr()
    texts = []
    for model in (run, export):
        main(["generate", str(model), "--prompt", "def f(x):", "--max-new-tokens", "24",
              "--max-context", "64"])
        texts.append(capsys.readouterr().out.strip().splitlines()[:-1])  # the summary line's time differs
    assert texts[0] == texts[1] and texts[0][0].startswith("def f(x):")


def _prompts(path, n):
    path.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(x):"}) + "\n" for i in range(n)))
    return path


def test_ctrl_c_keeps_the_finished_completions(run, tmp_path, capsys, monkeypatch):
    """Ctrl-C during ``--prompts-file`` writes the completions already finished, each with its
    prompt's row (the ``id`` kept), and says how many; it used to write nothing. The output's
    folder is made when missing."""
    from lapse.generation import command

    calls = []
    real = command.generate

    def generate(*a, **kw):  # the second batch is interrupted
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(command, "generate", generate)
    out = tmp_path / "new" / "out.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["generate", str(run), "--prompts-file", str(_prompts(tmp_path / "p.jsonl", 3)), "--out",
              str(out), "--batch-size", "1", "--max-new-tokens", "4", "--max-context", "64"])
    assert e.value.code == 130
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [0] and isinstance(rows[0]["completion"], str)
    assert "1 of 3 completions written to" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["out-is-input", "folder"])
def test_prompts_file_paths_are_checked_first(run, tmp_path, capsys, case):
    """``--out`` naming the prompts file itself (it was overwritten), and a folder as
    ``--prompts-file`` (it said "does not exist"): one line each, before the model loads."""
    prompts = _prompts(tmp_path / "p.jsonl", 2)
    args = ["--prompts-file", str(prompts), "--out", str(prompts)] if case == "out-is-input" else [
        "--prompts-file", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main(["generate", str(run), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("is the --prompts-file itself" in err[0] if case == "out-is-input"
                              else "is not a file" in err[0]), err
    assert prompts.read_text().count("prompt") == 2


def test_the_default_length_fits_the_context(run, capsys):
    """Without --max-new-tokens a run of context 64 generates up to what the prompt leaves (the
    default of 128 failed on every such run)."""
    main(["generate", str(run), "--prompt", "def f(x):"])
    match = SUMMARY.match(capsys.readouterr().out.strip().splitlines()[-1])
    assert match and 0 < int(match.group(1)) <= 64 - 9, match


def test_policy_flags_a_policy_does_not_use_are_refused():
    """``--policy acp --window 8`` ran acp as if --window were not given (a warning at most);
    ``--prefix`` without a policy too (lapse eval). A flag left at its default is no choice."""
    from lapse.eval.loss import PerTokenLossConfig
    from lapse.generation import PolicyOptions

    with pytest.raises(ValueError, match=r"^--budget is not used without --policy; it sets the tokens kept "
                       r"per head \(--policy h2o or a2sf\)$"):
        PolicyOptions(budget=0.1)
    with pytest.raises(ValueError, match=r"^--budget and --alpha are not used by --policy window; --budget "
                       r"sets .*; --alpha sets .* \(--policy a2sf\)$"):
        PolicyOptions(policy="window", budget=0.1, alpha=0.5)
    with pytest.raises(ValueError, match="^--prefix is not used without --policy; it sets how each window"):
        PerTokenLossConfig(models=("x",), prefix=8)
    PolicyOptions(policy="h2o", budget=0.1, recent=4, sinks=0, per="layer", every=2)
    left_out, given = PolicyOptions(policy="acp"), PolicyOptions(policy="acp", eps=math.exp(-10))
    assert left_out.make_policy() == given.make_policy()
    with pytest.raises(ValueError, match="^--window is not used by --policy acp"):  # typed at its default
        PolicyOptions(policy="acp", window=1024)


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        (["generate", str(RUN), "--prompt", "x"], ["--policy", "acp", "--window", "8"],
         "error: --window is not used by --policy acp; it sets the recent positions kept (--policy window)"),
        (["generate", str(RUN), "--prompt", "x"], ["--policy", "window", "--budget", "0.2"],
         "error: --budget is not used by --policy window; it sets the tokens kept per head "
         "(--policy h2o or a2sf)"),
        (["eval", "niah", "--models", str(RUN)], ["--eps", "0.01"],
         "error: --eps is not used without --policy; it sets the attention mass a row may lose "
         "(--policy acp)"),
        (["eval", "policy-loss", str(RUN)], ["--policy", "h2o", "--window", "8"],
         "error: --window is not used by --policy h2o; it sets the recent positions kept (--policy window)"),
        (["bench", "decode", "--device", "cpu"], ["--policies", "acp", "--budget", "0.3"],
         "error: --budget is not used by --policies acp; it sets the tokens kept per head "
         "(--policies h2o or a2sf)"),
    ],
    ids=["generate-acp-window", "generate-window-budget", "niah-no-policy", "policy-loss", "bench-decode"],
)
def test_an_unused_policy_flag_is_one_line_and_status_2(capsys, command, flags, message):
    with pytest.raises(SystemExit) as e:
        main([*command, *flags])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
