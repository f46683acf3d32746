"""The `lapse` command, run in-process (and once as a command line)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tyro

from lapse.bench.attention import AttentionBenchConfig
from lapse.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "resume", "export", "eval", "report", "bench"):
        assert command in out
    assert "demo" not in out


def test_bench_attention_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "attention", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--seq-lens", "--tokens", "--kv-heads", "--varlen", "--providers", "--modes"):
        assert flag in out


def test_resume_help_says_an_unset_flag_keeps_the_saved_setting(capsys, monkeypatch):
    """``lapse resume``'s on/off pairs (both of a pair showed "default: False") say that unset,
    the run keeps what it was saved with."""
    monkeypatch.setenv("COLUMNS", "200")  # one line a flag
    with pytest.raises(SystemExit) as e:
        main(["resume", "--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for flag in ("--progress", "--no-progress", "--compile", "--no-compile", "--cuda-graphs",
                 "--no-cuda-graphs"):
        line = next(x for x in lines if x.strip("│ ").startswith(flag + " "))
        assert "(unset: as saved)" in line and "default" not in line, line


@pytest.mark.parametrize(
    "cfg",
    [
        AttentionBenchConfig(),
        AttentionBenchConfig(heads=24, kv_heads=6, providers=("lapse", "sdpa"), modes=("fwd",)),
        AttentionBenchConfig(varlen=True, acp_bound="qk-norm", seed=2),
    ],
    ids=["default", "gqa", "varlen"],
)
def test_bench_command_reproduces_config(cfg):
    """The command recorded with the results parses back to the same configuration."""
    args = shlex.split(cfg.command())[3:]  # drop "lapse bench attention"
    assert tyro.cli(AttentionBenchConfig, args=args) == cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_without_cuda_says_so(tmp_path):
    with pytest.raises(SystemExit, match="CUDA"):
        main(
            [
                "bench",
                "attention",
                "--seq-lens",
                "64",
                "--tokens",
                "128",
                "--out-dir",
                str(tmp_path),
            ]
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_attention_smoke_gpu(tmp_path):
    """Every provider either gives a time or says why not; the JSON holds the numbers."""
    main(
        [
            "bench",
            "attention",
            "--seq-lens",
            "256",
            "--tokens",
            "1024",
            "--warmup-ms",
            "1",
            "--rep-ms",
            "5",
            "--out-dir",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "results.json").read_text())
    (workload,) = report["workloads"]
    for name, row in workload["providers"].items():
        assert "error" in row or all(
            "ms" in row[m] or "error" in row[m] for m in ("fwd", "fwd+bwd")
        ), name
    assert (tmp_path / "results.md").read_text().startswith("# lapse bench attention")


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "cpu-tiny", "--steps", "0"], "error: --steps: steps must be a positive integer, got 0"),
        (["train", "cpu-tiny", "--batch-size", "0"],
         "error: --batch-size: batch_size must be a positive integer, got 0"),
        (["train", "cpu-tiny", "--lr", "nan"], "error: --lr: lr must be a positive number, got nan"),
        (
            ["train", "cpu-tiny", "--corpus.kind", "text", "--corpus.paths", "/nonexistent/book.txt"],
            "error: corpus path '/nonexistent/book.txt' does not exist (corpus.kind='text')",
        ),
        (
            ["train", "cpu-tiny", "--run-dir", "/proc/nonexistent/run"],
            "error: cannot create the run folder /proc/nonexistent/run: No such file or directory",
        ),
        (
            ["resume", "/nonexistent/run"],
            "error: /nonexistent/run does not exist",
        ),
        (["export", "/nonexistent/run", "/tmp/out"], "error: model path does not exist: /nonexistent/run"),
        (["train", "cpu-tiny", "--model.n-heads", "3"],
         "error: --model.n-heads: n_heads (3) must divide d_model (64): the head dim is d_model / n_heads"),
        (["train", "cpu-tiny", "--corpus.val-fraction", "1.5"],
         "error: --corpus.val-fraction: val_fraction must be in [0, 1), got 1.5"),
    ],
    ids=["steps", "batch-size", "lr", "corpus-path", "run-dir", "resume", "export", "nested-model",
         "nested-corpus"],
)
def test_user_errors_are_one_line_and_exit_2(args, message, capsys, monkeypatch):
    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [message]


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        main(["train", "cpu-tiny", "--steps", "0", "--debug"])
    monkeypatch.setenv("LAPSE_DEBUG", "1")
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        main(["train", "cpu-tiny", "--steps", "0"])


def test_an_error_from_inside_a_library_keeps_its_traceback(monkeypatch):
    """The same exception types raised deep in a library (not by a lapse check) are bugs."""
    import lapse.train.trainer as trainer

    def broken(*args, **kwargs):
        return json.loads("{")  # json raises ValueError from its own code

    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    monkeypatch.setattr(trainer, "_run", broken)
    with pytest.raises(json.JSONDecodeError):
        main(["train", "cpu-tiny", "--steps", "1"])


def test_an_import_statement_that_fails_in_lapse_keeps_its_traceback(monkeypatch, tmp_path):
    """An ImportError lapse raises itself (a missing optional package: tests/hf/test_import.py)
    is one line; one that an import statement in lapse's code raised is a bug (a renamed
    module) and keeps its traceback."""
    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    monkeypatch.setitem(sys.modules, "lapse.hf", None)  # `from lapse.hf import ...` in run_import fails
    with pytest.raises(ImportError) as e:
        main(["import", "somewhere", "--out", str(tmp_path / "run")])
    assert e.value.name == "lapse.hf"


def test_the_command_line_prints_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LAPSE_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "lapse.cli", "train", "cpu-tiny", "--steps", "0"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: --steps: steps must be a positive integer, got 0\n"


def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(tmp_path):
    """A Ctrl-C while the command line's modules load is one line and status 130, not a
    traceback. Here the interrupt comes from an import hook, at the first config module the
    command line brings in."""
    env = {k: v for k, v in os.environ.items() if k != "LAPSE_DEBUG"}
    code = (
        "import runpy, sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'lapse.bench.config':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n"
        "sys.argv = ['lapse', 'train', 'cpu-tiny']\n"
        "runpy.run_module('lapse.cli', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "interrupted\n")


def test_the_first_signal_says_how_to_stop_at_once(capsys):
    """After a SIGTERM (a scheduler's), "Ctrl-C again" was wrong: it names the SIGINT that stops
    at once; a second SIGINT raises."""
    import signal

    from lapse.interrupt import StopFlag

    for first, hint in ((signal.SIGINT, "(Ctrl-C again to stop at once)"),
                        (signal.SIGTERM, "(a SIGINT (Ctrl-C) to stop at once)")):
        flag = StopFlag("stopping after this step")
        flag(first, None)
        assert capsys.readouterr().out == f"\n{first.name}: stopping after this step {hint}\n"
        assert flag.reason == first.name
        with pytest.raises(KeyboardInterrupt):
            flag(signal.SIGINT, None)


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "cpu-tiny", "--device", "cuda", "--no-progress"],
         "error: device 'cuda': no CUDA GPU is visible (pass --device cpu or auto)"),
        (["train", "cpu-tiny", "--device", "tpu", "--no-progress"],
         "error: unknown device 'tpu' (auto, cpu, cuda or cuda:N)"),
        (["bench", "decode"], "error: device 'cuda': no CUDA GPU is visible (pass --device cpu or auto)"),
    ],
    ids=["train-cuda", "train-unknown", "bench-decode"],
)
def test_a_device_this_machine_lacks_is_one_line(args, message, tmp_path, capsys, monkeypatch):
    """--device naming a GPU the machine does not have (or no device at all) stops before any
    model or run folder is made, with one line (it was a torch traceback)."""
    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main([*args, "--run-dir", str(run_dir)] if args[0] == "train" else args)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [message]
    assert not run_dir.exists()


def test_an_evaluation_of_a_hf_model_alone_writes_to_the_working_folder(tmp_path, monkeypatch):
    """With --hf and no lapse model the default output folder is ./eval/<name>/ (it raised a
    TypeError after lm-eval had written its results)."""
    from pathlib import Path

    from lapse.eval.common import output_folder
    from lapse.eval.config import LmEvalConfig

    monkeypatch.chdir(tmp_path)
    cfg = LmEvalConfig(hf=tmp_path, tasks=("lapse_tiny_mc",))
    assert output_folder({"results": {}}, cfg, "lm-eval") == Path("eval/lm-eval")


def test_ctrl_c_outside_a_training_step_is_one_line_and_exit_130(capsys, monkeypatch):
    """A second Ctrl-C while a stopped run writes its report, or one during an evaluation:
    ``interrupted`` and 130, as a shell reports it (it was a traceback and 1)."""
    import lapse.cli

    class Interrupted:
        def cli(self, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.delenv("LAPSE_DEBUG", raising=False)
    monkeypatch.setattr(lapse.cli, "_app", Interrupted)
    with pytest.raises(SystemExit) as e:
        main(["eval", "ppl"])
    assert e.value.code == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted"]
    with pytest.raises(SystemExit) as e:  # a second Ctrl-C in training says what it cost
        main(["train", "cpu-tiny"])
    assert e.value.code == 130
    assert capsys.readouterr().err.startswith("interrupted: the steps since the last checkpoint are lost")


def test_file_errors_the_standard_library_raises_for_lapse_are_one_line(tmp_path, capsys):
    """A data folder that cannot be made (``Path.mkdir``) and a negative seed are one ``error:``
    line (tracebacks); ``generate`` on a file or a folder that is no run says so (it said the
    folder "holds no checkpoint yet"); a prompts file that is not UTF-8 is a one-line error."""
    from lapse.generation.command import read_prompt_rows

    (tmp_path / "file").write_text("x")
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"prompt": "caf\\xe9"}\n'.replace(b"\\xe9", b"\xe9"))
    cases = [
        (["train", "cpu-tiny", "--data-dir", str(tmp_path / "file" / "data"),
          "--run-dir", str(tmp_path / "r")], "Not a directory"),
        (["train", "cpu-tiny", "--seed", "-1", "--run-dir", str(tmp_path / "s")],
         "seed must be in [0, 2**32)"),
        (["generate", str(tmp_path / "file"), "--prompt", "a"], "is a file, not a training run"),
        (["generate", str(tmp_path), "--prompt", "a"], "is a folder with no config.json, not a training run"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="p.jsonl is not UTF-8 text"):
        read_prompt_rows(bad)


def test_a_value_of_the_wrong_type_names_its_option(capsys):
    """``--lr abc`` said only "could not convert string to float: 'abc'"; a union's mismatch
    listed every type's error."""
    for args, line in ((["--lr", "abc"], "error: --lr: could not convert string to float: 'abc'"),
                       (["--seq-len", "1.5"], "error: --seq-len: no type matching {None}|INT could be "
                                              "instantiated from ['1.5'] (not a value of that type)")):
        with pytest.raises(SystemExit) as e:
            main(["train", "cpu-tiny", *args])
        assert e.value.code == 2 and capsys.readouterr().err.strip() == line


def test_an_os_error_deep_in_a_library_keeps_its_traceback():
    """Only the standard library's frames are skipped for a file error: installed packages
    (torch), which pyenv, conda and Docker's Python keep inside the standard library's folder,
    and lapse itself are not, so an error raised inside torch keeps its traceback."""
    import pathlib

    import lapse.cli
    from lapse.cli import _in_stdlib, _raised_by_lapse

    assert _in_stdlib(pathlib.Path(pathlib.__file__).resolve())
    assert not _in_stdlib(pathlib.Path(torch.__file__).resolve())
    assert not _in_stdlib(pathlib.Path(lapse.cli.__file__).resolve())
    try:
        torch.load("/nonexistent/lapse-test/weights.pt")
    except FileNotFoundError as e:
        assert not _raised_by_lapse(e)


def test_model_and_eps_options_take_either_spelling():
    """``--model``/``--models`` and ``--eps``/``--acp-eps`` are one option each wherever an
    evaluation or ``generate`` takes them (the commands differed: ``eval ppl --model X`` was a
    134-line "unrecognized options" box)."""
    from lapse.eval.acp import AcpEvalConfig
    from lapse.eval.eviction import EvictionStudyConfig
    from lapse.eval.loss import LossEvalConfig
    from lapse.eval.niah import NiahConfig
    from lapse.generation.command import GenerateConfig

    assert tyro.cli(LossEvalConfig, args=["--model", "a", "b"]).models == ("a", "b")
    niah = [tyro.cli(NiahConfig, args=[flag, "a"]).models for flag in ("--model", "--models")]
    assert niah[0] == niah[1] == (Path("a"),)
    acp = tyro.cli(AcpEvalConfig, args=["--models", "r", "--acp-eps", "0.01"])
    assert str(acp.model) == "r" and acp.eps == (0.01,)
    assert tyro.cli(EvictionStudyConfig, args=["r", "--acp-eps", "0.01"]).eps == (0.01,)
    for flag in ("--acp-eps", "--eps"):
        args = ["r", "--prompt", "x", "--policy", "acp", flag, "0.01"]  # acp reads it; others refuse it
        assert tyro.cli(GenerateConfig, args=args).eps == 0.01


HELP_COMMANDS = ["train cpu-tiny", "resume", "eval ppl", "eval per-token-loss", "eval niah", "eval acp",
                 "eval lm-eval", "eval eviction", "eval dcp", "eval policy-loss", "generate", "export",
                 "import", "bench attention", "bench train", "bench decode", "report"]


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_help_has_no_sphinx_roles(command, capsys):
    """The options' help comes from the config fields' docstrings; a Sphinx role there
    (``:func:`x```) printed as it is."""
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert not re.search(r":(func|data|attr|class|meth|mod):`", out), out
