"""The command line answers ``--help`` without importing what its commands run: torch,
transformers and triton take seconds on a small machine (``lapse --help`` took 4-8 s on 2
cores). The configs the parser needs live in modules that import none of them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers", "triton", "matplotlib", "lm_eval", "numpy")

EVERY_HELP = ["", "train", "train cpu-small", "train cpu-tiny", "train gpu-20m", "train 125m-16k", "resume",
              "bench", "bench attention", "bench decode", "bench train", "bench serve", "eval", "eval ppl",
              "eval per-token-loss", "eval policy-loss", "eval niah", "eval acp", "eval dcp", "eval lm-eval",
              "eval eviction", "generate", "serve", "export", "import", "report"]


def _imported(stderr: str) -> set[str]:
    """The top-level packages ``python -X importtime`` reports."""
    lines = [line.split("|")[-1] for line in stderr.splitlines() if line.startswith("import time:")]
    return {line.strip().split(".")[0] for line in lines}


@pytest.mark.parametrize("command",
                         ["", "train cpu-small", "bench attention", "eval ppl", "generate", "serve"],
                         ids=lambda c: c.replace(" ", "-") or "lapse")
def test_help_imports_none_of_what_the_commands_run(command):
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lapse.cli", *command.split(), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: lapse" in done.stdout
    imported = _imported(done.stderr)
    assert "lapse" in imported and "tyro" in imported  # the report is read right
    assert not imported & set(HEAVY)


def test_no_help_imports_what_the_commands_run():
    """Every command's and subcommand's ``--help`` in one process: what is in ``sys.modules``
    after all of them."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from lapse.cli import main

        codes = []
        for command in {EVERY_HELP!r}:
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    main([*command.split(), "--help"])
                except SystemExit as e:
                    codes.append(e.code)
        print(json.dumps({{"codes": codes, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result == {"codes": [0] * len(EVERY_HELP), "heavy": []}
