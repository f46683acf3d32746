"""The training data of a run: tokenizer and token shards, built once and cached.

A corpus and a tokenizer choice map to one folder under ``TrainConfig.data_dir`` named by
a hash of both; it holds ``tokenizer/``, ``train/`` and ``validation/`` shard folders and
a ``ready.json`` written last, so a folder without it (an interrupted build) is rebuilt and
never read. Under ``torchrun`` rank 0 builds while the others wait at a barrier.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from lapse.data import (
    ByteTokenizer,
    CorpusConfig,
    Tokenizer,
    TokenShards,
    iter_documents,
    load_tokenizer,
    train_bpe,
    write_shards,
)
from lapse.files import write_json_atomic

from .config import TrainConfig

READY_FILE = "ready.json"
# A BPE is learned from the first this many bytes of the training split: merges settle
# long before, and the whole corpus of a GPU run would cost minutes.
BPE_TRAIN_BYTES = 64_000_000


@dataclass
class RunData:
    """What the trainer reads: the tokenizer and the two shard folders."""

    directory: Path
    tokenizer: Tokenizer
    train: TokenShards
    validation: TokenShards


def data_key(corpus: CorpusConfig, tokenizer: str, vocab_size: int) -> str:
    """Folder name of a (corpus, tokenizer) pair: readable prefix + hash of everything that
    changes the tokens (the Python installation too, for the default corpus)."""
    spec = {"corpus": asdict(corpus), "tokenizer": tokenizer}
    if tokenizer == "bpe":
        spec["vocab_size"] = vocab_size
    elif tokenizer != "byte":
        spec["tokenizer"] = str(Path(tokenizer).resolve())
    if corpus.kind == "python":
        spec["python"] = [sys.version, sys.prefix]
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
    kind = tokenizer if tokenizer in ("byte", "bpe") else "tok"
    return f"{corpus.kind}-{kind}-{digest}"


def prepare_data(cfg: TrainConfig, *, rank: int = 0, progress: bool = True) -> RunData:
    """The run's tokenizer and shards, built into ``cfg.data_dir`` unless already there.

    Raises ``ValueError`` for an empty corpus, a missing path, or a tokenizer with more ids
    than ``cfg.model.vocab_size``.
    """
    directory = Path(cfg.data_dir) / data_key(cfg.corpus, cfg.tokenizer, cfg.model.vocab_size)
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0 and not (directory / READY_FILE).exists():
        _build(cfg, directory, progress)
    if distributed:
        dist.barrier()
    tokenizer = load_tokenizer(directory / "tokenizer")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
            f"{cfg.model.vocab_size}; raise model.vocab_size"
        )
    return RunData(
        directory, tokenizer, TokenShards(directory / "train"), TokenShards(directory / "validation")
    )


def cached_with(cfg, tokenizer_path: Path | None) -> bool:
    """Whether ``cfg``'s data cache is complete and was tokenised by the tokenizer saved at
    ``tokenizer_path`` (the same files), so the training-time cache can be read as it is."""
    if tokenizer_path is None:
        return False
    cached = Path(cfg.data_dir) / data_key(cfg.corpus, cfg.tokenizer, cfg.model.vocab_size) / "tokenizer"
    if not (cached.parent / READY_FILE).exists() or not cached.is_dir():
        return False
    mine = {p.name: p.read_bytes() for p in Path(tokenizer_path).iterdir() if p.is_file()}
    theirs = {p.name: p.read_bytes() for p in cached.iterdir() if p.is_file()}
    return mine == theirs



def _build(cfg: TrainConfig, directory: Path, progress: bool) -> None:
    if directory.exists():  # left by an interrupted build: start again
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    tokenizer = _make_tokenizer(cfg)
    tokenizer.save(directory / "tokenizer")
    for split in ("train", "validation"):
        write_shards(
            iter_documents(cfg.corpus, split),
            tokenizer,
            directory / split,
            progress=progress,
            desc=f"tokenising {split}",
        )
    info = {
        "corpus": asdict(cfg.corpus),
        "tokenizer": cfg.tokenizer,
        "train_tokens": TokenShards(directory / "train").num_tokens,
        "validation_tokens": TokenShards(directory / "validation").num_tokens,
    }
    write_json_atomic(directory / READY_FILE, info)


def _make_tokenizer(cfg: TrainConfig) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "bpe":
        texts = _first_bytes((text for _, text in iter_documents(cfg.corpus, "train")), BPE_TRAIN_BYTES)
        return train_bpe(texts, vocab_size=cfg.model.vocab_size)
    return load_tokenizer(cfg.tokenizer)


def _first_bytes(texts, limit: int):
    used = 0
    for text in texts:
        used += len(text)
        yield text
        if used >= limit:
            return


__all__ = ["RunData", "cached_with", "data_key", "prepare_data"]
