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
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from lapse.data.corpus import DEFAULT_DATA_DIR, CorpusConfig, corpus_files, iter_documents
from lapse.data.shards import TokenShards, write_shards
from lapse.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from lapse.files import write_json_atomic

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
    changes the tokens (the Python installation too, for the default corpus). The files'
    contents are not in it: ``ready.json`` records their sizes and times (:func:`prepare_data`)."""
    spec = {"corpus": asdict(corpus), "tokenizer": tokenizer}
    if corpus.root is None:  # the key of a corpus read from the working directory, as before roots
        del spec["corpus"]["root"]
    if tokenizer == "bpe":
        spec["vocab_size"] = vocab_size
    elif tokenizer != "byte":
        spec["tokenizer"] = str(Path(tokenizer).resolve())
    if corpus.kind == "python":
        spec["python"] = [sys.version, sys.prefix]
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
    rebuild_changed: bool = False,
) -> PreparedData:
    """The tokenizer and shards of ``corpus``, built into ``data_dir`` unless already there.

    ``tokenizer``: ``"byte"``, ``"bpe"`` (learned on the training split, ``vocab_size``
    ids) or the path of a saved tokenizer. Raises ``ValueError`` for an empty corpus, a
    missing path, or a tokenizer with more ids than ``vocab_size``.

    The cache records its files' sizes and modification times (``ready.json``). Where they
    changed since, the cache is built again with ``rebuild_changed`` (a new training run:
    an edited corpus was trained on as its old tokens), else used with a warning (a resumed
    run or an evaluation keeps the tokens the run saw). Files that are gone leave the cache
    as it is.
    """
    directory = Path(data_dir) / data_key(corpus, tokenizer, vocab_size)
    distributed = dist.is_available() and dist.is_initialized()
    if rank == 0 and (directory / READY_FILE).exists():
        changed = _files_changed(corpus, directory)
        if changed and rebuild_changed:
            print(f"the corpus changed since {directory} was made ({changed}): tokenising it again",
                  flush=True)
            _build(corpus, tokenizer, vocab_size, directory, progress)
        elif changed:
            warnings.warn(f"the corpus changed since {directory} was made ({changed}); its tokens are "
                          "those of the files as they were", stacklevel=2)
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


def _fingerprint(corpus: CorpusConfig) -> list[list] | None:
    """``[path, size, mtime_ns]`` of each file the corpus reads; ``None`` for the Python
    sources, or when a file cannot be listed (a corpus that is gone)."""
    if corpus.kind == "python":
        return None
    try:
        return [[str(p), st.st_size, st.st_mtime_ns] for p in corpus_files(corpus) for st in (p.stat(),)]
    except (OSError, ValueError):
        return None


def _files_changed(corpus: CorpusConfig, directory: Path) -> str | None:
    """What changed in the corpus's files since the cache in ``directory`` was made (``None``:
    nothing, nothing known, or the files are gone)."""
    then = json.loads((directory / READY_FILE).read_text()).get("files")
    if then is None:  # a cache made before the fingerprint: nothing to compare
        return None
    now = _fingerprint(corpus)
    if now is None or now == then:
        return None
    before, after = {f[0]: f[1:] for f in then}, {f[0]: f[1:] for f in now}
    parts = [f"{len(after.keys() - before.keys())} added", f"{len(before.keys() - after.keys())} removed",
             f"{sum(after[k] != before[k] for k in after.keys() & before.keys())} changed"]
    return ", ".join(p for p in parts if not p.startswith("0 "))


def _build(corpus: CorpusConfig, tokenizer: str, vocab_size: int, directory: Path, progress: bool) -> None:
    if directory.exists():  # left by an interrupted build: start again
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    files = _fingerprint(corpus)  # before reading: a file edited during the build shows next time
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
        "files": files,
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
