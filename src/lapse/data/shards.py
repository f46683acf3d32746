"""Token shards: a tokenised corpus on disk, read through memory maps, sampled by step.

A shard folder holds ``shard_00000.bin``, ``shard_00001.bin``, ... (raw little-endian
``uint16`` when the vocabulary fits, else ``uint32``) and ``index.json``::

    {"format": "lapse-token-shards", "version": 1, "dtype": "uint16",
     "num_tokens": N, "num_documents": D, "eos_id": 256, "vocab_size": 258,
     "tokenizer": {...}, "shards": [{"file": "shard_00000.bin", "num_tokens": n,
                                     "doc_offsets": [0, 812, ...]}, ...]}

Each document is stored as its tokens followed by ``eos_id``; ``doc_offsets`` are the
positions where documents start within their shard. A document never spans two shards
(a new shard starts once the current one holds ``shard_tokens`` tokens), so neither does
a sampled window.

Writing is atomic: shards are written under temporary names and renamed into place only
when the whole corpus is done, ``index.json`` last; an interrupted write removes its
temporary files and leaves no final file behind.

Sampling (:class:`WindowSampler`): batch ``step`` is a pure function of ``(seed, step)``:
window starts are drawn from ``numpy.random.default_rng([seed, step])``, so a resumed run
sees exactly the batches the uninterrupted one would have.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from lapse.data.corpus import Document
from lapse.data.tokenizer import Tokenizer, tokenizer_info

INDEX_FILE = "index.json"
FORMAT = "lapse-token-shards"
VERSION = 1


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab <= 65535 ids), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def write_shards(
    documents: Iterable[Document],
    tokenizer: Tokenizer,
    out_dir: str | os.PathLike,
    *,
    shard_tokens: int = 1 << 28,
    batch_documents: int = 64,
    progress: bool = True,
    desc: str = "tokenising",
) -> Path:
    """Tokenise ``documents`` into a shard folder at ``out_dir``; returns its index path.

    Args:
        documents: ``(doc_id, text)`` pairs (see :mod:`lapse.data.corpus`).
        tokenizer: anything following :class:`~lapse.data.tokenizer.Tokenizer`.
        shard_tokens: a new shard starts once the current one holds this many tokens.
        batch_documents: documents handed to ``tokenizer.encode_batch`` at once.
        progress: show a tqdm bar (documents, with the token count).
    """
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    suffix = f".tmp-{os.getpid()}"
    shards: list[dict] = []
    temps: list[Path] = []
    current = None

    def open_shard():
        entry = {"file": f"shard_{len(shards):05d}.bin", "num_tokens": 0, "doc_offsets": []}
        shards.append(entry)
        temps.append(out_dir / (entry["file"] + suffix))
        return entry, temps[-1].open("wb")

    def add(ids: list[int]) -> None:
        nonlocal current
        entry, f = current
        if entry["num_tokens"] >= shard_tokens:
            f.close()
            current = entry, f = open_shard()
        tokens = np.asarray(ids, dtype=dtype)
        entry["doc_offsets"].append(entry["num_tokens"])
        f.write(tokens.tobytes())
        f.write(eos.tobytes())
        entry["num_tokens"] += len(tokens) + 1

    bar = tqdm(desc=desc, unit="doc", disable=not progress, dynamic_ncols=True)
    try:
        current = open_shard()
        batch: list[str] = []
        total = 0
        for _, text in documents:
            batch.append(text)
            if len(batch) == batch_documents:
                for ids in tokenizer.encode_batch(batch):
                    add(ids)
                    total += len(ids) + 1
                bar.update(len(batch))
                bar.set_postfix(tokens=total, refresh=False)
                batch = []
        for ids in tokenizer.encode_batch(batch) if batch else []:
            add(ids)
            total += len(ids) + 1
        bar.update(len(batch))
        bar.set_postfix(tokens=total)
        current[1].close()
        num_documents = sum(len(s["doc_offsets"]) for s in shards)
        if num_documents == 0:
            raise ValueError(f"no documents to write to {out_dir}")
        for temp in temps:
            # The data must be on disk before a rename makes it look complete.
            with temp.open("rb") as f:
                os.fsync(f.fileno())
        for entry, temp in zip(shards, temps, strict=True):
            os.replace(temp, out_dir / entry["file"])
        index = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": dtype.name,
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "num_documents": num_documents,
            "eos_id": tokenizer.eos_id,
            "vocab_size": tokenizer.vocab_size,
            "tokenizer": tokenizer_info(tokenizer),
            "shards": shards,
        }
        index_path = out_dir / INDEX_FILE
        index_temp = out_dir / (INDEX_FILE + suffix)
        temps.append(index_temp)
        index_temp.write_text(json.dumps(index) + "\n", encoding="utf-8")
        os.replace(index_temp, index_path)
        return index_path
    finally:
        bar.close()
        if current is not None:
            current[1].close()
        for temp in temps:
            temp.unlink(missing_ok=True)


class TokenShards:
    """A shard folder opened read-only: shards are memory maps, nothing is loaded whole."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        index_path = self.directory / INDEX_FILE
        if not index_path.exists():
            raise ValueError(f"no token shards at {self.directory} (missing {INDEX_FILE})")
        self.index = json.loads(index_path.read_text(encoding="utf-8"))
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise ValueError(f"{index_path} is not a {FORMAT} v{VERSION} index")
        self.dtype = np.dtype(self.index["dtype"])
        self.eos_id: int = self.index["eos_id"]
        self.vocab_size: int = self.index["vocab_size"]
        self.num_tokens: int = self.index["num_tokens"]
        self.num_documents: int = self.index["num_documents"]
        self.shards: list[np.memmap] = []
        self.doc_offsets: list[np.ndarray] = []
        for entry in self.index["shards"]:
            path = self.directory / entry["file"]
            expected = entry["num_tokens"] * self.dtype.itemsize
            if not path.exists() or path.stat().st_size != expected:
                raise ValueError(f"shard {path} is missing or not {expected} bytes long")
            self.shards.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(entry["num_tokens"],)))
            self.doc_offsets.append(np.asarray(entry["doc_offsets"], dtype=np.int64))

    def documents(self) -> Iterable[np.ndarray]:
        """Each document's tokens (without its trailing eos), in written order."""
        for tokens, offsets in zip(self.shards, self.doc_offsets, strict=True):
            ends = np.append(offsets[1:], len(tokens)) - 1
            for start, end in zip(offsets, ends, strict=True):
                yield np.asarray(tokens[start:end])

    def __repr__(self) -> str:
        return (
            f"TokenShards({str(self.directory)!r}, tokens={self.num_tokens}, "
            f"documents={self.num_documents}, dtype={self.dtype.name})"
        )


@dataclass(frozen=True, kw_only=True)
class WindowSampler:
    """Batches of fixed-length windows of ``seq_len + 1`` tokens, a pure function of step.

    ``x = window[:, :-1]``, ``y = window[:, 1:]`` (next-token labels), both int64
    ``[batch_size, seq_len]``. Window starts are uniform over every position where a
    full window fits inside one shard, or, with ``doc_aligned``, uniform over the
    documents whose start leaves room for a full window (the window may run on into the
    following documents, across their eos separators).
    """

    shards: TokenShards
    """The token shards to sample from."""
    seq_len: int
    """T, tokens per input row."""
    batch_size: int
    """B, rows per global batch (over all ranks)."""
    seed: int = 0
    """With the step, determines every batch."""
    doc_aligned: bool = False
    """Start windows at document starts only."""

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.batch_size <= 0:
            raise ValueError(
                f"seq_len and batch_size must be positive, got {self.seq_len}, {self.batch_size}"
            )
        window = self.seq_len + 1
        if self.doc_aligned:
            # Candidate starts: (shard, offset) of every document with room after it.
            shard_ids, starts = [], []
            for s, (tokens, offsets) in enumerate(
                zip(self.shards.shards, self.shards.doc_offsets, strict=True)
            ):
                ok = offsets[offsets + window <= len(tokens)]
                shard_ids.append(np.full(len(ok), s, dtype=np.int64))
                starts.append(ok)
            candidates = (np.concatenate(shard_ids), np.concatenate(starts))
            count = len(candidates[1])
        else:
            # Shard s offers len - window + 1 starts; count them cumulatively.
            per_shard = np.array([max(len(t) - window + 1, 0) for t in self.shards.shards], dtype=np.int64)
            candidates = np.cumsum(per_shard)
            count = int(candidates[-1]) if len(candidates) else 0
        if count == 0:
            longest = max((len(t) for t in self.shards.shards), default=0)
            raise ValueError(
                f"no window of seq_len + 1 = {window} tokens fits in {self.shards.directory} "
                f"(longest shard: {longest} tokens{', doc_aligned' if self.doc_aligned else ''})"
            )
        object.__setattr__(self, "_candidates", candidates)
        object.__setattr__(self, "_count", count)

    def starts(self, step: int) -> list[tuple[int, int]]:
        """``(shard, start)`` of each of the ``batch_size`` windows of batch ``step``."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        draws = np.random.default_rng([self.seed, step]).integers(0, self._count, size=self.batch_size)
        if self.doc_aligned:
            shard_ids, offsets = self._candidates
            return [(int(shard_ids[d]), int(offsets[d])) for d in draws]
        shard_ids = np.searchsorted(self._candidates, draws, side="right")
        before = np.concatenate([[0], self._candidates])[shard_ids]
        return [(int(s), int(d - b)) for s, d, b in zip(shard_ids, draws, before, strict=True)]

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step``: ``(x, y)`` int64 ``[batch_size // world_size, seq_len]``.

        With several ranks, rank ``r`` takes rows ``[r * b, (r + 1) * b)`` of the global
        batch, so the union over ranks is the single-process batch.
        """
        if world_size <= 0 or not 0 <= rank < world_size or self.batch_size % world_size:
            raise ValueError(f"rank {rank} / world_size {world_size} must split batch_size {self.batch_size}")
        rows = self.batch_size // world_size
        window = self.seq_len + 1
        picked = self.starts(step)[rank * rows : (rank + 1) * rows]
        windows = np.stack([self.shards.shards[s][start : start + window] for s, start in picked])  # [b, T+1]
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
