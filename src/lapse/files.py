"""Files written so that no reader, and no interrupted run, ever sees half of one: a
temporary name in the same folder, then an atomic rename."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader (or an
    interrupted run) never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text if text.endswith("\n") else text + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_figure(fig, path: str | Path, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically (PNG, Agg) and close it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def write_json_atomic(path: str | Path, obj, *, indent: int | None = 2) -> Path:
    """``obj`` as JSON (``default=str`` for paths and the like), atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=str))
