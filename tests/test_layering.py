"""The import order of docs/architecture.md, held by import-linter (pyproject.toml,
``[tool.importlinter]``): a lower package never imports a higher one, train, eval and
bench never import each other, and only lapse.hf imports transformers (but for the two
lazy imports the contract names)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_imports_point_down_the_layers():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.fail("lint-imports not found: install the test extra (pip install -e '.[test]')")
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken" in done.stdout
