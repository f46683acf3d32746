"""The `lapse` command, run in-process."""

import json
import shlex

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
