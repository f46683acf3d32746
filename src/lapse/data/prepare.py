"""A corpus tokenised once and cached: the tokenizer and the train/validation token shards.

A corpus and a tokenizer choice map to one folder under ``data_dir`` named by a hash of
both; it holds ``tokenizer/``, ``train/`` and ``validation/`` shard folders (no
``validation/`` when ``val_fraction`` is 0) and a ``ready.json`` written last, so a
folder without it (an interrupted build) is rebuilt and never read. Under ``torchrun``
rank 0 builds while the others wait at a barrier.
Training reads the train split, evaluations the validation split, of the same cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from lapse.data.corpus import CorpusConfig, corpus_files, iter_documents
from lapse.data.shards import TokenShards, write_shards
from lapse.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from lapse.files import write_json_atomic

DEFAULT_DATA_DIR = Path("runs/data")
READY_FILE = "ready.json"
# A BPE is learned from the first this many bytes of the training split: merges settle
# long before, and the whole corpus of a GPU run would cost minutes.
BPE_TRAIN_BYTES = 64_000_000


@dataclass
class PreparedData:
    """The tokenizer and the two shard folders of a cached corpus."""

    directory: Path
    tokenizer: Tokenizer
    train: TokenShards
    validation: TokenShards | None
    """``None`` when the corpus has no validation split (``val_fraction = 0``)."""


def data_key(corpus: CorpusConfig, tokenizer: str, vocab_size: int) -> str:
    """Folder name of a (corpus, tokenizer) pair: readable prefix + hash of everything that
    changes the tokens: the corpus's files' paths, sizes and modification times (the Python
    installation for the default corpus)."""
    spec = {"corpus": asdict(corpus), "tokenizer": tokenizer}
    if tokenizer == "bpe":
        spec["vocab_size"] = vocab_size
    elif tokenizer != "byte":
        spec["tokenizer"] = str(Path(tokenizer).resolve())
    if corpus.kind == "python":
        spec["python"] = [sys.version, sys.prefix]
    else:  # the files as they are now: an edited or added file makes a new cache (not the old tokens)
        spec["files"] = [[str(p.resolve()), st.st_size, st.st_mtime_ns]
                         for p in corpus_files(corpus) for st in (p.stat(),)]
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]
    kind = tokenizer if tokenizer in ("byte", "bpe") else "tok"
    return f"{corpus.kind}-{kind}-{digest}"


def prepare_data(
    corpus: CorpusConfig,
    tokenizer: str,
    *,
    vocab_size: int,
    data_dir: str | Path = DEFAULT_DATA_DIR,
    rank: int = 0,
    progress: bool = True,
) -> PreparedData:
    """The tokenizer and shards of ``corpus``, built into ``data_dir`` unless already there.

    ``tokenizer``: ``"byte"``, ``"bpe"`` (learned on the training split, ``vocab_size``
    ids) or the path of a saved tokenizer. Raises ``ValueError`` for an empty corpus, a
    missing path, or a tokenizer with more ids than ``vocab_size``.
    """
    directory = Path(data_dir) / data_key(corpus, tokenizer, vocab_size)
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0 and not (directory / READY_FILE).exists():
        _build(corpus, tokenizer, vocab_size, directory, progress)
    if distributed:
        dist.barrier()
    loaded = load_tokenizer(directory / "tokenizer")
    if loaded.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {loaded.vocab_size} ids but model.vocab_size is "
            f"{vocab_size}; raise model.vocab_size"
        )
    validation = TokenShards(directory / "validation") if corpus.val_fraction > 0 else None
    return PreparedData(directory, loaded, TokenShards(directory / "train"), validation)


def cached_with(
    corpus: CorpusConfig,
    tokenizer: str,
    *,
    vocab_size: int,
    data_dir: str | Path,
    tokenizer_path: Path | None,
) -> bool:
    """Whether the cache of (``corpus``, ``tokenizer``) is complete and was tokenised by the
    tokenizer saved at ``tokenizer_path`` (the same files), so it can be read as it is."""
    if tokenizer_path is None:
        return False
    cached = Path(data_dir) / data_key(corpus, tokenizer, vocab_size) / "tokenizer"
    if not (cached.parent / READY_FILE).exists() or not cached.is_dir():
        return False
    mine = {p.name: p.read_bytes() for p in Path(tokenizer_path).iterdir() if p.is_file()}
    theirs = {p.name: p.read_bytes() for p in cached.iterdir() if p.is_file()}
    return mine == theirs


def _build(corpus: CorpusConfig, tokenizer: str, vocab_size: int, directory: Path, progress: bool) -> None:
    if directory.exists():  # left by an interrupted build: start again
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    made = _make_tokenizer(corpus, tokenizer, vocab_size)
    made.save(directory / "tokenizer")
    for split in ("train", "validation") if corpus.val_fraction > 0 else ("train",):
        write_shards(
            iter_documents(corpus, split),
            made,
            directory / split,
            progress=progress,
            desc=f"tokenising {split}",
        )
    info = {
        "corpus": asdict(corpus),
        "tokenizer": tokenizer,
        "train_tokens": TokenShards(directory / "train").num_tokens,
        "validation_tokens": TokenShards(directory / "validation").num_tokens
        if corpus.val_fraction > 0
        else 0,
    }
    write_json_atomic(directory / READY_FILE, info)


def _make_tokenizer(corpus: CorpusConfig, tokenizer: str, vocab_size: int) -> Tokenizer:
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer == "bpe":
        texts = _first_bytes((text for _, text in iter_documents(corpus, "train")), BPE_TRAIN_BYTES)
        return train_bpe(texts, vocab_size=vocab_size)
    return load_tokenizer(tokenizer)


def _first_bytes(texts, limit: int):
    used = 0
    for text in texts:
        used += len(text)
        yield text
        if used >= limit:
            return
