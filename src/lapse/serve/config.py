"""The settings of ``lapse serve`` (:func:`lapse.serve.command.run_serve`).

Kept apart from the server, which imports torch, uvicorn and starlette: the ``lapse``
command line builds its options from this module alone.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from lapse.generation.config import ModelSource
from lapse.generation.policies.options import PolicyName

PACKAGES = ("uvicorn", "starlette", "prometheus_client", "pydantic")
"""What the server imports beyond lapse's own requirements: the ``serve`` extra."""


def require_packages() -> None:
    """One ``ImportError`` naming the packages of :data:`PACKAGES` that are not installed."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"lapse serve needs {', '.join(missing)}: pip install 'lapse[serve]'")


@dataclass(kw_only=True)
class ServeConfig(ModelSource):
    """Serve a trained run (or a ``lapse export`` folder, or a pretrained Hugging Face model)
    over HTTP with OpenAI's completions API, every request under one eviction policy."""

    policy: PolicyName = "dense"
    """Eviction policy of every request (a request may change its budget, not its kind)."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0``: every interface)."""
    port: int = 8000
    """Port to listen on."""
    max_batch: int = 64
    """Requests decoded together (rows of the batch); more wait."""
    max_waiting: int = 256
    """Requests that may wait for a row; one more is answered 429 with Retry-After."""
    max_prefill_tokens: int = 2048
    """Prompt tokens prefilled between two decode steps (requests admitted whole, first come
    first served, at least one a step): bounds how long the running streams wait for new
    ones; a burst of short prompts is still admitted in one go."""
    kv_memory: float | None = None
    """GiB of KV pages shared by the running requests (keys, values and every per-slot
    pool); default: enough for ``max_batch`` requests of ``max_context`` tokens each."""
    kv_pages: int | None = None
    """Instead of ``--kv-memory``: the pages of the pool, per layer."""
    max_context: int | None = None
    """Longest prompt + completion of a request; default: the model's training context."""
    device: str = "auto"
    """``auto``: CUDA when available."""
    compile: bool = False
    """Compile the decode step (CUDA graphs on a GPU)."""
    served_model_name: str | None = None
    """The model name requests give and ``/v1/models`` lists; default: the folder's name."""
    log_level: str = "info"
    """uvicorn's log level (``warning`` hides the access log)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        for name in ("max_batch", "max_waiting", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.kv_memory is not None and self.kv_pages is not None:
            raise ValueError("give --kv-memory or --kv-pages, not both")
        if self.kv_memory is not None and not self.kv_memory > 0:
            raise ValueError(f"--kv-memory must be positive (GiB), got {self.kv_memory}")
        if self.kv_pages is not None and self.kv_pages < 1:
            raise ValueError(f"--kv-pages must be at least 1, got {self.kv_pages}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"--max-context must be at least 2 (a prompt token and a new one), got "
                             f"{self.max_context}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name is empty")

    def model_name(self) -> str:
        """The name requests give: ``--served-model-name``, else the model folder's (or file's)."""
        if self.served_model_name is not None:
            return self.served_model_name
        path = self.model if self.model is not None else self.hf
        return Path(path).resolve().name or str(path)
