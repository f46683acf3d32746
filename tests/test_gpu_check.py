"""``scripts/gpu_check.sh`` on a CPU: its dry run lists the test shards and a smoke command
for every GPU command family README.md shows, the shards hold every collected gpu test
exactly once (balanced by recorded times), and a failing command is reported as such."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )


def collected_gpu_tests() -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.split("\n\n")[0].splitlines() if "::" in line]


def readme_gpu_command_families() -> set[str]:
    """``bench attention``, ``train``, ``eval ppl``, ...: what README's bash blocks run."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return {m[1] for b in blocks for m in re.finditer(r"lapse(?:\.cli)? (bench \w+|eval [\w-]+|\w+)", b)}


def test_dry_run_lists_balanced_shards_and_every_readme_command(tmp_path):
    ids = collected_gpu_tests()
    assert len(ids) > 100
    heavy = ids[len(ids) // 2]
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_seconds": {i: 1000.0 if i == heavy else 1.0 for i in ids}}))

    out = gpu_check("--dry-run", "--list-shards", "--shards", "3", "--durations", str(durations))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()

    assert [re.match(r"\s+(tests-\d/3)\s+\d+ tests", line)[1] for line in lines if "tests-" in line] == [
        "tests-1/3",
        "tests-2/3",
        "tests-3/3",
    ]
    shards = [line.split("\t") for line in lines if re.match(r"\d+\t", line)]
    assert sorted(i for _, i in shards) == sorted(ids)  # each once
    by_shard = {k: [i for s, i in shards if s == k] for k in ("1", "2", "3")}
    heavy_shard = next(k for k, shard in by_shard.items() if heavy in shard)
    assert by_shard[heavy_shard] == [heavy]  # a 1000 s test runs alone; the others share the rest
    light = [len(s) for k, s in by_shard.items() if k != heavy_shard]
    assert abs(light[0] - light[1]) <= max(light) // 4

    commands = {
        m[1]: m[2] for line in lines if (m := re.match(r"  ([a-z][\w-]+)\s+(?:\([^)]*\) )*(.*\S)$", line))
    }
    cli = " ".join(commands.values())
    missing = {f for f in readme_gpu_command_families() if f"lapse.cli {f} " not in cli}
    assert not missing, f"README runs these and gpu_check.sh does not: {missing}"
    assert "--policies dense window acp h2o a2sf" in commands["bench-decode-policies"]
    assert "--cuda-graphs" in commands["train-125m-16k-cuda-graphs"]
    acp = commands["generate-acp-compile"]
    assert "--compile" in acp and "--policy acp" in acp
    assert "--model.arch castle " in commands["train-castle"]
    assert "--model.attention dcp" in commands["train-dcp"]
    for name, command in commands.items():
        if name.startswith(("eval-", "generate-", "train-")):
            assert "--device cuda" in command, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the command would succeed")
def test_a_failing_command_is_reported_with_its_log(tmp_path):
    out_md = tmp_path / "gpu-check.md"
    out = gpu_check("--only", "commands", "--items", "train-gpu-20m", "--timeout", "120",
                    "--out", str(out_md), "--logs", str(tmp_path / "logs"), "--work", str(tmp_path / "work"))
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert re.search(r"^FAIL +\d+s  train-gpu-20m  \(exit status 2\)$", out.stdout, re.M), out.stdout
    assert "    | error: device 'cuda': no CUDA GPU is visible" in out.stdout
    md = out_md.read_text()
    assert "**1 of 1 items failed.**" in md
    assert "| train-gpu-20m | FAIL (exit status 2) |" in md
    assert "no CUDA device" in md  # the device column
    record = json.loads(out_md.with_suffix(".json").read_text())
    assert [(i["name"], i["status"]) for i in record["items"]] == [("train-gpu-20m", "FAIL")]
    assert (tmp_path / "logs" / "train-gpu-20m.log").exists()
