"""Document sources that need no network: each yields ``(doc_id, text)`` pairs.

Sources (``CorpusConfig.kind``):

- ``"python"`` (the default): the ``*.py`` files of the running interpreter's standard
  library and installed packages (``sysconfig`` paths ``stdlib``, ``purelib``,
  ``platlib``): real, long documents that every machine has. Directories are walked in
  sorted order, so the listing is deterministic; ids are ``"<root>/<relative posix path>"``
  (``"stdlib/json/decoder.py"``), which do not depend on where Python is installed.
- ``"text"``: text files, folders (searched recursively for ``patterns``) or glob patterns.
- ``"jsonl"``: JSON Lines files, one document per line in ``text_field``.
- ``"hf"``: a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (``load_from_disk``).

Train/validation split, by document: a document belongs to validation when the SHA-1 of
its id, read as a fraction of 2**160, is below ``val_fraction``. Membership is a property
of the id alone, so it does not change when files are added, removed or read in another
order. A ``datasets.DatasetDict`` with ``train`` and ``validation`` splits is used as it is.

When that would leave a side empty (one text file, a few documents), the split is by
ranges instead: the last ``val_fraction`` of each document's UTF-8 bytes (cut at a
character boundary; for the byte-level tokenizer these are token ranges) is validation,
the rest training. ``val_fraction = 0`` puts everything in training and nothing in
validation.

Text files that are not UTF-8 text (a NUL byte, or bytes that do not decode) are skipped
with a warning naming them, never decoded into replacement characters. Nothing is
downloaded: a missing path or a corpus with no documents is a ``ValueError`` naming what
was searched.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Document = tuple[str, str]
"""``(doc_id, text)``."""

Split = Literal["train", "validation", "all"]

DEFAULT_TEXT_PATTERNS = ("*.txt", "*.md")

DEFAULT_DATA_DIR = Path("runs/data")
"""Where :func:`lapse.data.prepare_data` caches tokenised corpora unless told otherwise
(here, beside the corpus settings, so configs that name it import no torch)."""


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Where the documents come from, how they split, and how many to read."""

    kind: Literal["python", "text", "jsonl", "hf"] = "python"
    """Source type; ``"python"`` is the local Python installation's source files."""
    paths: tuple[str, ...] = ()
    """Files, folders or glob patterns (``text``, ``jsonl``); one dataset folder (``hf``)."""
    patterns: tuple[str, ...] = DEFAULT_TEXT_PATTERNS
    """File-name patterns searched for inside folders (``text``)."""
    text_field: str = "text"
    """Field holding the document text (``jsonl``, ``hf``)."""
    val_fraction: float = 0.01
    """Share of documents (by hash of their id) in the validation split, or of each
    document's bytes when a split by document would leave a side empty; 0: no validation."""
    max_documents: int | None = None
    """Stop after this many documents (per split); ``None``: no limit."""
    max_bytes: int | None = None
    """Stop after this many UTF-8 bytes of text (per split; the last document is cut
    to fit); ``None``: no limit."""
    root: str | None = None
    """The folder relative ``paths`` are read from (``None``: the working directory).
    ``lapse train`` records its working directory here, so that a run resumes and evaluates
    from anywhere; documents keep the ids the paths give as written (the split hashes them)."""

    def __post_init__(self) -> None:
        if self.kind not in ("python", "text", "jsonl", "hf"):
            raise ValueError(f"kind must be 'python', 'text', 'jsonl' or 'hf', got {self.kind!r}")
        if isinstance(self.paths, str):
            raise TypeError(f"paths must be a tuple of strings, got the string {self.paths!r}")
        if self.kind != "python" and not self.paths:
            raise ValueError(f"kind={self.kind!r} needs at least one entry in paths")
        if self.kind == "python" and self.paths:  # they were ignored: the installation's sources ran
            raise ValueError(
                f"kind='python' (the Python installation's sources) reads no paths, got {list(self.paths)}: "
                "say what they hold with --corpus.kind text (or jsonl, hf)"
            )
        if self.kind == "hf" and len(self.paths) != 1:
            raise ValueError(f"kind='hf' takes exactly one dataset folder, got paths={self.paths!r}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        for name in ("max_documents", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")


def iter_documents(config: CorpusConfig, split: Split = "train") -> Iterator[Document]:
    """Documents of ``split`` from the source ``config`` describes, within its limits.

    Paths are checked now (a missing one raises ``ValueError`` here); a source that turns
    out to hold no documents for ``split`` raises ``ValueError`` when the iterator ends.
    """
    if split not in ("train", "validation", "all"):
        raise ValueError(f"split must be 'train', 'validation' or 'all', got {split!r}")
    skipped: list[Path] = []  # text files that are not text
    native = False  # an HF dataset's own split: used as it is
    if config.kind == "python":
        where = "the Python installation (" + ", ".join(str(p) for _, p in python_source_roots()) + ")"
        ids = (doc_id for doc_id, _ in list_python_sources("all"))

        def documents(part: Split) -> Iterator[Document]:
            return python_source_documents(split=part, val_fraction=config.val_fraction)

    elif config.kind == "text":
        files = [pair for entry in config.paths for pair in _text_files(entry, config.patterns, config.root)]
        where = f"{', '.join(config.paths)} (files matching {', '.join(config.patterns)})"
        ids = (doc_id for doc_id, path in files if not _looks_binary(path))

        def documents(part: Split) -> Iterator[Document]:
            return _split_filter(_read_text_files(files, skipped), part, config.val_fraction)

    elif config.kind == "jsonl":
        jsonl_files = _jsonl_files(config.paths, config.root)
        where = ", ".join(config.paths)
        ids = (doc_id for doc_id, _ in _jsonl_records(jsonl_files, config.text_field))

        def documents(part: Split) -> Iterator[Document]:
            return _split_filter(_jsonl_records(jsonl_files, config.text_field), part, config.val_fraction)

    else:
        where = config.paths[0]
        table = _hf_table(str(_rooted(config.paths[0], config.root)), config.text_field, split)
        native = table.native
        ids = (doc_id for doc_id, _ in _hf_rows(table, config.text_field))

        def documents(part: Split) -> Iterator[Document]:
            rows = _hf_rows(table, config.text_field)
            return rows if table.native else _split_filter(rows, part, config.val_fraction)

    def docs() -> Iterator[Document]:
        if split == "all" or native or split_by_document(ids, config.val_fraction):
            yield from documents(split)
            return
        for doc_id, text in documents("all"):
            if part := split_by_range(text, split, config.val_fraction):
                yield doc_id, part

    def describe() -> str:
        what = f"no documents in {where}" if split == "all" else f"no documents in split {split!r} of {where}"
        if skipped:
            names = ", ".join(str(p) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
            what += f"; {len(skipped)} file(s) skipped as not UTF-8 text: {names}"
        return what

    return _nonempty(limit_documents(docs(), config.max_documents, config.max_bytes), describe)


def split_by_document(ids: Iterable[str], val_fraction: float) -> bool:
    """Whether documents with these ids split by their hash into two non-empty sides
    (always, for ``val_fraction = 0``: validation is meant to be empty). Reads ``ids``
    only until a document of each side has been seen."""
    if val_fraction == 0:
        return True
    seen = set()
    for doc_id in ids:
        seen.add(in_validation(doc_id, val_fraction))
        if len(seen) == 2:
            return True
    return False


def split_by_range(text: str, split: Split, val_fraction: float) -> str:
    """The ``split`` part of one document split by ranges: validation is the last
    ``val_fraction`` of its UTF-8 bytes (at least one byte of a longer document), cut
    at a character boundary; training is the rest."""
    data = text.encode("utf-8")
    n_val = max(1, round(len(data) * val_fraction)) if len(data) > 1 else 0
    head = data[: len(data) - n_val].decode("utf-8", errors="ignore")
    return head if split == "train" else text[len(head) :]


def in_validation(doc_id: str, val_fraction: float) -> bool:
    """Whether ``doc_id`` falls in the validation split: SHA-1 of the id below the fraction."""
    digest = int.from_bytes(hashlib.sha1(doc_id.encode("utf-8")).digest(), "big")
    return digest < val_fraction * (1 << 160)


def limit_documents(
    docs: Iterable[Document], max_documents: int | None = None, max_bytes: int | None = None
) -> Iterator[Document]:
    """At most ``max_documents`` documents and ``max_bytes`` UTF-8 bytes of text.

    The document that would cross ``max_bytes`` is cut (at a character boundary) to fit.
    """
    count = used = 0
    for doc_id, text in docs:
        if max_documents is not None and count >= max_documents:
            return
        if max_bytes is not None:
            data = text.encode("utf-8")
            if used + len(data) > max_bytes:
                text = data[: max_bytes - used].decode("utf-8", errors="ignore")
                if text:
                    yield doc_id, text
                return
            used += len(data)
        count += 1
        yield doc_id, text


def python_source_roots() -> list[tuple[str, Path]]:
    """``(label, folder)`` of the interpreter's ``stdlib``, ``purelib`` and ``platlib``,
    without duplicates (``platlib`` is usually ``purelib``)."""
    paths = sysconfig.get_paths()
    roots: list[tuple[str, Path]] = []
    seen: set[str] = set()
    for label in ("stdlib", "purelib", "platlib"):
        path = paths.get(label)
        if path and os.path.isdir(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            roots.append((label, Path(path)))
    return roots


def list_python_sources(split: Split = "all", val_fraction: float = 0.01) -> Iterator[tuple[str, Path]]:
    """``(doc_id, path)`` of every ``*.py`` file under :func:`python_source_roots`, in a
    deterministic order (each folder sorted by name), without reading the files.

    A root nested in another (``site-packages`` inside ``stdlib`` on most installs) is
    walked once, under its own label; ``__pycache__`` and hidden folders are skipped.
    """
    roots = python_source_roots()
    real_roots = {os.path.realpath(path) for _, path in roots}
    for label, root in roots:
        skip = real_roots - {os.path.realpath(root)}
        for path in _walk_sorted(root, skip):
            doc_id = f"{label}/{path.relative_to(root).as_posix()}"
            if split == "all" or in_validation(doc_id, val_fraction) == (split == "validation"):
                yield doc_id, path


def python_source_documents(split: Split = "train", val_fraction: float = 0.01) -> Iterator[Document]:
    """Texts of :func:`list_python_sources`; unreadable and non-UTF-8 files are skipped."""
    for doc_id, path in list_python_sources(split, val_fraction):
        text = _read_text(path)
        if text:
            yield doc_id, text


def text_documents(
    paths: Iterable[str], patterns: Iterable[str] = DEFAULT_TEXT_PATTERNS
) -> Iterator[Document]:
    """Text files: each entry of ``paths`` is a file, a folder (searched recursively for
    ``patterns``, sorted) or a glob pattern (sorted matches). Ids are the file paths as
    found, relative to the folder for folder entries. Files that are not UTF-8
    text are skipped with a warning."""
    patterns = tuple(patterns)
    # Listed now, so a missing path fails at the call rather than at the first document.
    files = [(doc_id, path) for entry in paths for doc_id, path in _text_files(entry, patterns)]
    return _read_text_files(files, [])


def _read_text_files(files: list[tuple[str, Path]], skipped: list[Path]) -> Iterator[Document]:
    """The texts of ``files``; a file that is not UTF-8 text is skipped with a warning and
    appended to ``skipped``."""
    for doc_id, path in files:
        try:
            data = path.read_bytes()
        except OSError as e:
            warnings.warn(f"skipping {path}: {e.strerror}", stacklevel=2)
            skipped.append(path)
            continue
        text = _decode_text(data)
        if text is None:
            warnings.warn(f"skipping {path}: not a UTF-8 text file (binary?)", stacklevel=2)
            skipped.append(path)
        elif text:
            yield doc_id, text


def jsonl_documents(paths: Iterable[str], text_field: str = "text") -> Iterator[Document]:
    """One document per non-blank line of each JSON Lines file, taken from ``text_field``;
    ids are ``"<file name>:<line number>"``. Each entry of ``paths`` is a file, a folder
    (searched recursively for ``*.jsonl``, sorted) or a glob pattern. A line without the field,
    or a file that is not UTF-8, is a ``ValueError``."""
    return _jsonl_records(_jsonl_files(paths), text_field)


def corpus_files(config: CorpusConfig) -> list[Path]:
    """The files ``config`` reads (``text``, ``jsonl``; every file of an ``hf`` dataset
    folder); none for ``python``, whose sources belong to the installation."""
    if config.kind == "text":
        return [p for entry in config.paths for _, p in _text_files(entry, config.patterns, config.root)]
    if config.kind == "jsonl":
        return [path for _, path in _jsonl_files(config.paths, config.root)]
    if config.kind == "hf":
        folder = _existing(_rooted(config.paths[0], config.root))
        return sorted(p for p in folder.rglob("*") if p.is_file())
    return []


def _jsonl_files(paths: Iterable[str], root: str | None = None) -> list[tuple[str, Path]]:
    """``(name, path)`` of each JSON Lines file: a file entry's name (its documents' ids have
    always been ``<file name>:<line>``), a found file's path as :func:`_text_files` gives it."""
    return [(path.name if _rooted(entry, root).is_file() else name, path)
            for entry in paths for name, path in _text_files(entry, ("*.jsonl",), root)]


def _jsonl_records(files: list[tuple[str, Path]], text_field: str) -> Iterator[Document]:
    for name, path in files:
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not UTF-8 text ({e.reason})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from e
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise ValueError(f"{path}:{line_no}: no string field {text_field!r} in this record")
                if record[text_field]:
                    yield f"{name}:{line_no}", record[text_field]


def hf_documents(
    path: str, text_field: str = "text", split: Split = "train", val_fraction: float = 0.01
) -> Iterator[Document]:
    """Rows of a Hugging Face dataset saved at ``path`` (``datasets.load_from_disk``).

    A ``DatasetDict`` holding ``train`` and ``validation`` gives the requested split as it
    is; otherwise (a single ``Dataset``, or a dict with a ``train`` split only) rows are split
    by the hash of their id ``"<split name>:<row index>"``.
    """
    table = _hf_table(path, text_field, split)
    rows = _hf_rows(table, text_field)
    return rows if table.native else _split_filter(rows, split, val_fraction)


@dataclass(frozen=True)
class _HFTable:
    rows: object  # a datasets.Dataset
    name: str  # its split name, or "data"
    native: bool  # the requested split itself, not to be split again


def _hf_table(path: str, text_field: str, split: Split) -> _HFTable:
    folder = _existing(path)
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            f"reading the Hugging Face dataset at {folder} needs the `datasets` package: pip install datasets"
        ) from e
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError:  # datasets' word for a folder that save_to_disk did not write
        raise ValueError(
            f"{folder} is not a Hugging Face dataset saved with save_to_disk (corpus.kind='hf'); "
            "for a folder of text files pass --corpus.kind text"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        # its own splits only when it has both: splitting "train" by hash for validation
        # while reading "train" whole for training would put documents in both
        if split in loaded and {"train", "validation"} <= set(loaded):
            table = _HFTable(loaded[split], split, True)
        elif "train" in loaded:
            table = _HFTable(loaded["train"], "train", False)
        else:
            raise ValueError(
                f"dataset at {folder} has splits {sorted(loaded)}; expected {split!r} or 'train'"
            )
    else:
        table = _HFTable(loaded, "data", False)
    if text_field not in table.rows.column_names:
        raise ValueError(f"dataset at {folder} has columns {table.rows.column_names}, not {text_field!r}")
    return table


def _hf_rows(table: _HFTable, text_field: str) -> Iterator[Document]:
    return ((f"{table.name}:{i}", row[text_field]) for i, row in enumerate(table.rows) if row[text_field])


def _split_filter(docs: Iterable[Document], split: Split, val_fraction: float) -> Iterator[Document]:
    for doc_id, text in docs:
        if split == "all" or in_validation(doc_id, val_fraction) == (split == "validation"):
            yield doc_id, text


def _nonempty(docs: Iterator[Document], describe: Callable[[], str]) -> Iterator[Document]:
    empty = True
    for doc in docs:
        empty = False
        yield doc
    if empty:
        raise ValueError(f"empty corpus: {describe()}")


def _walk_sorted(folder: Path, skip: set[str]) -> Iterator[Path]:
    """``*.py`` files under ``folder`` in sorted order, depth first, without following
    symlinked folders (no cycles), skipping the real paths in ``skip``."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        if entry.is_dir(follow_symlinks=False):
            if os.path.realpath(entry.path) not in skip:
                yield from _walk_sorted(Path(entry.path), skip)
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def _rooted(entry: str | os.PathLike, root: str | None) -> Path:
    """``entry`` read from ``root`` when it is relative (and a root is given)."""
    return Path(entry) if root is None else Path(root) / entry


def _text_files(entry: str, patterns: tuple[str, ...], root: str | None = None) -> list[tuple[str, Path]]:
    """``(id, path)`` of the files ``entry`` names; the ids are the paths as written, relative to
    ``root`` when one reads them (a folder's: relative to it), so the split does not depend on
    where the corpus sits."""
    if glob.has_magic(entry):
        matches = sorted(Path(p) for p in glob.glob(entry, recursive=True, root_dir=root))
        files = [(p.as_posix(), _rooted(p, root)) for p in matches if _rooted(p, root).is_file()]
        if not files:
            raise ValueError(f"no files match the pattern {entry!r}")
        return files
    path = _existing(_rooted(entry, root))
    if path.is_file():
        return [(Path(entry).as_posix(), path)]
    files = sorted({p for pattern in patterns for p in path.rglob(pattern) if p.is_file()})
    if not files:
        raise ValueError(f"empty corpus: no files matching {list(patterns)} in {path}")
    return [(p.relative_to(path).as_posix(), p) for p in files]


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"corpus path does not exist: {path}")
    return path


def _read_text(path: Path) -> str | None:
    try:
        return _decode_text(path.read_bytes())
    except OSError:
        return None


def _decode_text(data: bytes) -> str | None:
    """``data`` as text, or ``None`` when it is not UTF-8 text (a NUL byte: binary)."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB (what ``grep`` and ``git`` check); unreadable counts."""
    try:
        with path.open("rb") as f:
            return b"\x00" in f.read(8192)
    except OSError:
        return True
