"""The commit a benchmark's results record (no torch: the load generator imports it)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The checkout's ``HEAD`` (``-dirty`` when tracked files changed), ``None`` outside git."""
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None
