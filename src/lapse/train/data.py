"""The data of a training run: its corpus tokenised once and cached (:mod:`lapse.data.prepare`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lapse.data import PreparedData, cached_with
from lapse.data import prepare_data as prepare_corpus

from .config import TrainConfig


def prepare_data(cfg: TrainConfig, *, rank: int = 0, progress: bool = True,
                 new_run: bool = False) -> PreparedData:
    """The tokenizer and shards of ``cfg``'s corpus, built into ``cfg.data_dir`` unless
    already there (see :func:`lapse.data.prepare_data`); a ``new_run`` tokenises a corpus
    whose files changed since the cache was made again."""
    return prepare_corpus(
        cfg.corpus,
        cfg.tokenizer,
        vocab_size=cfg.model.vocab_size,
        data_dir=cfg.data_dir,
        rank=rank,
        progress=progress,
        rebuild_changed=new_run,
    )


def with_run_tokenizer(cfg: TrainConfig, saved: Path) -> TrainConfig:
    """``cfg`` for a resumed run whose tokenizer was saved at ``saved``: a BPE run reads its
    own saved tokenizer unless the data cache was made by it (learning the BPE again
    elsewhere could give other ids than the model learned)."""
    if cfg.tokenizer != "bpe" or not saved.is_dir():
        return cfg
    vocab_size, data_dir = cfg.model.vocab_size, cfg.data_dir
    if cached_with(cfg.corpus, cfg.tokenizer, vocab_size=vocab_size, data_dir=data_dir, tokenizer_path=saved):
        return cfg
    return replace(cfg, tokenizer=str(saved))


__all__ = ["prepare_data", "with_run_tokenizer"]
