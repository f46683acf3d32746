"""scripts/bench_all.sh: its commands, listed without running (a CPU), parse."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import tyro

from lapse.bench.config import AttentionBenchConfig, DecodeBenchConfig, TrainBenchConfig

ROOT = Path(__file__).resolve().parents[2]
EVERY = "attention,train,decode,castle,dcp,fsdp,kvpress"


def _listed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/bench_all.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_every_bench_command_parses():
    listed = _listed("--list", "--only", EVERY)
    assert listed.returncode == 0, listed.stderr
    configs = {"attention": AttentionBenchConfig, "decode": DecodeBenchConfig, "train": TrainBenchConfig}
    parsed = 0
    for line in listed.stdout.splitlines():
        words = shlex.split(line)
        if words[1:4] == ["-m", "lapse.cli", "bench"]:
            assert "--out-dir" in words, line  # every table into a folder of its own
            tyro.cli(configs[words[4]], args=words[5:])
            parsed += 1
    assert parsed >= 20, listed.stdout


def test_groups_choose_the_commands():
    default = _listed("--list").stdout
    assert "bench attention" in default and "torch.distributed.run" not in default  # fsdp: two GPUs
    assert "kvpress_compare.py" not in default  # kvpress: another environment
    castle = _listed("--list", "--only", "castle").stdout.splitlines()
    assert castle and all("castle" in line for line in castle)
    unknown = _listed("--only", "nothing")
    assert unknown.returncode == 2 and "no group nothing" in unknown.stderr
