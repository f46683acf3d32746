"""scripts/bench_all.sh: its commands, listed without running (a CPU), parse."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import tyro

from lapse.bench.config import AttentionBenchConfig, DecodeBenchConfig, TrainBenchConfig
from lapse.train.config import TRAIN_PRESETS, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
EVERY = "attention,train,decode,castle,dcp,fsdp,cpu"


def _listed(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/bench_all.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_every_lapse_command_parses():
    """``lapse bench`` commands write into a folder of their own; ``lapse train`` ones (the
    runs some tables time, those under torchrun too) parse against their preset."""
    listed = _listed("--list", "--only", EVERY)
    assert listed.returncode == 0, listed.stderr
    configs = {"attention": AttentionBenchConfig, "decode": DecodeBenchConfig, "train": TrainBenchConfig}
    benches = trainings = 0
    for line in listed.stdout.splitlines():
        words = shlex.split(line)
        at = next((i for i, w in enumerate(words) if w == "lapse.cli"), None)
        if at is None:
            continue
        command, *args = words[at + 1:]
        if command == "bench":
            assert "--out-dir" in args, line
            tyro.cli(configs[args[0]], args=args[1:])
            benches += 1
        elif command == "train":
            tyro.cli(TrainConfig, default=TRAIN_PRESETS[args[0]][1](), args=args[1:])
            trainings += 1
    assert benches >= 20 and trainings >= 8, listed.stdout


def test_groups_choose_the_commands():
    default = _listed("--list").stdout
    assert "bench attention" in default and "torch.distributed.run" not in default  # fsdp: two GPUs
    assert "kvpress_compare.py" not in default and "main.sh" not in default  # cpu: named alone
    castle = _listed("--list", "--only", "castle").stdout.splitlines()
    assert castle and all("castle" in line for line in castle)
    unknown = _listed("--only", "nothing")
    assert unknown.returncode == 2 and "no group nothing" in unknown.stderr
