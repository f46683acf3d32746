"""Tokenizers that work offline, behind one small protocol (:class:`Tokenizer`).

- :class:`ByteTokenizer` (the default): ids 0-255 are the UTF-8 bytes, then the specials
  ``<eos>`` = 256 and ``<bos>`` = 257; ``vocab_size`` = 258. Saved as ``lapse_tokenizer.json``.
- :class:`HFTokenizer`: any ``tokenizers.Tokenizer`` (a ``tokenizer.json``), including the
  byte-level BPE that :func:`train_bpe` learns locally (specials ``<eos>`` = 0, ``<bos>`` = 1).
- :class:`TransformersTokenizer`: a local Hugging Face tokenizer folder, through
  ``transformers.AutoTokenizer`` (imported only when asked for, never downloading).

:func:`load_tokenizer` opens whichever a folder (or file) holds.

``encode`` never adds special tokens and treats text that spells a special token
(``"<eos>"``) as ordinary text; ``decode`` drops special tokens. So
``decode(encode(text)) == text`` for every string with the byte-level tokenizers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from lapse.files import write_json_atomic

BYTE_TOKENIZER_FILE = "lapse_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
EOS, BOS = "<eos>", "<bos>"
# Names models use for their end-of-text token, tried in order when a tokenizer.json does
# not say which of its special tokens ends a document.
EOS_CANDIDATES = (EOS, "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eos|>", "<|im_end|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer."""

    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are bytes, 256 is ``<eos>``, 257 is ``<bos>``."""

    eos_id = 256
    bos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # A window cut mid-character decodes to U+FFFD rather than failing.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        info = {
            "type": "byte",
            "vocab_size": self.vocab_size,
            "specials": {EOS: self.eos_id, BOS: self.bos_id},
        }
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(directory) / BYTE_TOKENIZER_FILE, info)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (loaded from a ``tokenizer.json`` or trained here)."""

    def __init__(self, tokenizer, eos_token: str | None = None) -> None:
        # Text spelling a special token stays text: only the shard writer inserts <eos>.
        tokenizer.encode_special_tokens = True
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        names = [eos_token] if eos_token is not None else list(EOS_CANDIDATES)
        ids = [tokenizer.token_to_id(name) for name in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"tokenizer has none of the end-of-text tokens {names}; pass eos_token=")
        self.eos_id = found[0]
        self.bos_id = tokenizer.token_to_id(BOS)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eos_token: str | None = None) -> HFTokenizer:
        import tokenizers

        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_token)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The Rust side encodes a batch on all cores.
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        path = Path(directory) / HF_TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        try:
            self.tokenizer.save(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class TransformersTokenizer:
    """A local Hugging Face tokenizer folder read by ``transformers.AutoTokenizer``."""

    def __init__(self, directory: str | os.PathLike) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError(f"loading the tokenizer folder {directory} needs `transformers`") from e
        self._take(AutoTokenizer.from_pretrained(str(directory), local_files_only=True), str(directory))

    @classmethod
    def wrap(cls, tokenizer, source: str = "the model") -> TransformersTokenizer:
        """One around a ``transformers`` tokenizer already loaded (a GGUF file's, say)."""
        self = cls.__new__(cls)
        self._take(tokenizer, source)
        return self

    def _take(self, tokenizer, source: str) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer of {source} defines no eos token")
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        self.tokenizer.save_pretrained(str(directory))


def train_bpe(
    texts: Iterable[str], vocab_size: int = 8192, *, min_frequency: int = 2, show_progress: bool = False
) -> HFTokenizer:
    """Learn a byte-level BPE on ``texts`` with the ``tokenizers`` library, locally.

    The vocabulary holds ``<eos>`` (id 0), ``<bos>`` (id 1), the 256 byte symbols, then
    merges up to ``vocab_size``; every string round-trips. Save it with ``.save(dir)``
    (writes ``dir/tokenizer.json``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258 (2 specials + 256 bytes), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tokenizer)


def load_tokenizer(path: str | os.PathLike, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer saved at ``path``: a folder holding ``lapse_tokenizer.json`` (byte
    level), a ``tokenizer.json`` file or a folder holding one, or a Hugging Face tokenizer
    folder (``tokenizer_config.json``; read with ``transformers`` when it is installed)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"tokenizer path does not exist: {path}")
    if path.is_file():
        if path.name == BYTE_TOKENIZER_FILE:
            return _load_byte(path)
        return HFTokenizer.from_file(path, eos_token)
    if (path / BYTE_TOKENIZER_FILE).exists():
        return _load_byte(path / BYTE_TOKENIZER_FILE)
    if (path / "tokenizer_config.json").exists() and _has_transformers():
        return TransformersTokenizer(path)
    if (path / HF_TOKENIZER_FILE).exists():
        return HFTokenizer.from_file(path / HF_TOKENIZER_FILE, eos_token)
    raise ValueError(
        f"no tokenizer in {path}: expected {BYTE_TOKENIZER_FILE}, {HF_TOKENIZER_FILE} "
        "or a Hugging Face tokenizer folder"
    )


def tokenizer_info(tokenizer: Tokenizer) -> dict:
    """A JSON-able description, stored in shard indexes so mismatches can be caught."""
    return {"class": type(tokenizer).__name__, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}


def _load_byte(path: Path) -> ByteTokenizer:
    info = json.loads(path.read_text(encoding="utf-8"))
    tokenizer = ByteTokenizer()
    expected = {EOS: tokenizer.eos_id, BOS: tokenizer.bos_id}
    if info.get("type") != "byte" or info.get("specials") != expected:
        raise ValueError(f"{path} is not a byte tokenizer of this version (expected specials {expected})")
    return tokenizer


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None
