"""Corpora, tokenizers and token shards (CPU, no network)."""

import itertools
import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from lapse.data import (
    ByteTokenizer,
    CorpusConfig,
    TokenShards,
    WindowSampler,
    in_validation,
    iter_documents,
    list_python_sources,
    load_tokenizer,
    train_bpe,
    write_shards,
)
from lapse.data import shards as shards_module

UNICODE_TEXT = "naïve café: 日本語, emoji 😀, <eos> spelled out, tabs\t and\r\nnewlines\n"


def _docs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "δέλτα", "ε", "lambda", "x = 1", "def f():", "😀"]
    return [(f"doc{i}", " ".join(rng.choice(words, size=int(rng.integers(1, 40)))) + "\n") for i in range(n)]


@pytest.fixture
def text_folder(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("first document\n", encoding="utf-8")
    (folder / "sub" / "b.md").write_text("# second\n" + UNICODE_TEXT, encoding="utf-8")
    (folder / "c.py").write_text("not matched by the default patterns\n", encoding="utf-8")
    (folder / "bad.txt").write_bytes(b"\xff\xfe not utf-8 \x80")
    return folder


# Corpus


def test_default_listing_is_deterministic_and_split_is_disjoint():
    first = list(itertools.islice(list_python_sources("all"), 3000))
    again = list(itertools.islice(list_python_sources("all"), 3000))
    assert first == again
    assert len({doc_id for doc_id, _ in first}) == len(first)
    assert all(doc_id.endswith(".py") for doc_id, _ in first)
    # Each folder is listed in sorted order, so the ids of one root come out sorted.
    stdlib = [doc_id for doc_id, _ in first if doc_id.startswith("stdlib/")]
    assert stdlib and stdlib == sorted(stdlib, key=lambda d: d.split("/"))

    all_ids = {doc_id for doc_id, _ in list_python_sources("all", val_fraction=0.05)}
    train = {doc_id for doc_id, _ in list_python_sources("train", val_fraction=0.05)}
    val = {doc_id for doc_id, _ in list_python_sources("validation", val_fraction=0.05)}
    assert train.isdisjoint(val) and train | val == all_ids
    assert 0.02 < len(val) / len(all_ids) < 0.08
    # The split is a function of the id: a larger fraction only moves documents into validation.
    val_10 = {doc_id for doc_id, _ in list_python_sources("validation", val_fraction=0.10)}
    assert val < val_10


def test_default_corpus_limits():
    docs = list(iter_documents(CorpusConfig(max_documents=7)))
    assert len(docs) == 7 and all(text for _, text in docs)
    assert docs == list(iter_documents(CorpusConfig(max_documents=7)))

    docs = list(iter_documents(CorpusConfig(max_bytes=50_000)))
    assert sum(len(text.encode()) for _, text in docs) <= 50_000
    assert sum(len(text.encode()) for _, text in docs) > 45_000  # the last document is cut to fit

    val = list(iter_documents(CorpusConfig(max_documents=5), split="validation"))
    train_ids = {doc_id for doc_id, _ in iter_documents(CorpusConfig(max_documents=2000))}
    assert len(val) == 5 and train_ids.isdisjoint(doc_id for doc_id, _ in val)


def test_text_folder_source(text_folder):
    with pytest.warns(UserWarning, match="bad.txt: not a UTF-8 text file"):
        docs = dict(iter_documents(CorpusConfig(kind="text", paths=(str(text_folder),)), split="all"))
    assert docs == {"a.txt": "first document\n", "sub/b.md": "# second\n" + UNICODE_TEXT}
    py = dict(iter_documents(CorpusConfig(kind="text", paths=(str(text_folder / "*.py"),)), split="all"))
    assert list(py.values()) == ["not matched by the default patterns\n"]
    one = list(iter_documents(CorpusConfig(kind="text", paths=(str(text_folder / "a.txt"),)), split="all"))
    assert [text for _, text in one] == ["first document\n"]


def test_jsonl_source(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"body": f"document {i} {UNICODE_TEXT}", "n": i} for i in range(200)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    config = CorpusConfig(kind="jsonl", paths=(str(path),), text_field="body", val_fraction=0.2)
    train = list(iter_documents(config, "train"))
    val = list(iter_documents(config, "validation"))
    assert sorted(text for _, text in train + val) == sorted(r["body"] for r in rows)
    assert {d for d, _ in train}.isdisjoint(d for d, _ in val) and 10 < len(val) < 70
    limited = list(
        iter_documents(replace(config, max_documents=3))
    )
    assert limited == train[:3]

    with pytest.raises(ValueError, match="'text'"):
        list(iter_documents(CorpusConfig(kind="jsonl", paths=(str(path),))))


def test_missing_path_and_empty_corpus(tmp_path, text_folder):
    missing = tmp_path / "nowhere"
    for kind in ("text", "jsonl", "hf"):
        with pytest.raises(ValueError, match="nowhere"):
            iter_documents(CorpusConfig(kind=kind, paths=(str(missing),)))  # fails at the call
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty corpus.*empty"):
        iter_documents(CorpusConfig(kind="text", paths=(str(empty),)))
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty corpus.*blank.jsonl"):
        list(iter_documents(CorpusConfig(kind="jsonl", paths=(str(blank),))))
    with pytest.raises(ValueError, match="no files match"):
        iter_documents(CorpusConfig(kind="text", paths=(str(tmp_path / "*.nothing"),)))
    with pytest.raises(ValueError, match="needs at least one"):
        CorpusConfig(kind="text")


def test_one_text_file_splits_by_ranges(tmp_path):
    book = tmp_path / "book.txt"
    text = "".join(f"line {i}: naïve café 日本語\n" for i in range(2000))
    book.write_text(text, encoding="utf-8")
    config = CorpusConfig(kind="text", paths=(str(book),), val_fraction=0.05)
    (train,) = [t for _, t in iter_documents(config, "train")]
    (val,) = [t for _, t in iter_documents(config, "validation")]
    assert train + val == text  # the last 5% of the bytes, cut at a character boundary
    assert abs(len(val.encode()) - 0.05 * len(text.encode())) < 4


def test_few_documents_on_one_side_split_each_by_ranges(tmp_path):
    # Three files whose ids all hash into training at val_fraction 0.01.
    names = [n for n in (f"f{i}.txt" for i in range(40)) if not in_validation(n, 0.01)][:3]
    for name in names:
        (tmp_path / name).write_text(name * 100, encoding="utf-8")
    config = CorpusConfig(kind="text", paths=(str(tmp_path),), val_fraction=0.01)
    train = dict(iter_documents(config, "train"))
    val = dict(iter_documents(config, "validation"))
    assert sorted(train) == sorted(val) == sorted(names)
    assert all(train[n] + val[n] == n * 100 and len(val[n]) == 6 for n in names)


def test_val_fraction_zero_puts_everything_in_training(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("beta\n", encoding="utf-8")
    config = CorpusConfig(kind="text", paths=(str(tmp_path),), val_fraction=0.0)
    assert dict(iter_documents(config, "train")) == {"a.txt": "alpha\n", "b.txt": "beta\n"}
    with pytest.raises(ValueError, match="no documents in split 'validation'"):
        list(iter_documents(config, "validation"))


def test_binary_files_are_skipped_with_a_warning_naming_them(tmp_path):
    (tmp_path / "a.txt").write_text("text\n", encoding="utf-8")
    (tmp_path / "nul.txt").write_bytes(b"valid utf-8 \x00 but a NUL: binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    config = CorpusConfig(kind="text", paths=(str(tmp_path),), val_fraction=0.0)
    with pytest.warns(UserWarning) as caught:
        docs = dict(iter_documents(config, "train"))
    assert docs == {"a.txt": "text\n"}
    messages = sorted(str(w.message) for w in caught)
    assert "latin1.txt: not a UTF-8 text file" in messages[0] and "nul.txt" in messages[1]
    # nothing left: one error that says what was searched and what was skipped
    (tmp_path / "a.txt").unlink()
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"empty corpus.*2 file\(s\) skipped"):
        list(iter_documents(config, "train"))


def test_hf_dataset_with_a_train_split_only_splits_it_without_overlap(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"text": [f"row {i}" for i in range(300)]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "ds"))
    config = CorpusConfig(kind="hf", paths=(str(tmp_path / "ds"),), val_fraction=0.1)
    train = dict(iter_documents(config, "train"))
    val = dict(iter_documents(config, "validation"))
    assert set(train).isdisjoint(val) and len(train) + len(val) == 300 and val


def test_hf_source_without_datasets_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ValueError, match="pip install datasets"):
        iter_documents(CorpusConfig(kind="hf", paths=(str(tmp_path),)))



def test_hf_source_that_is_no_saved_dataset_is_a_clear_error(tmp_path):
    """A folder of text files given as kind "hf": datasets raises FileNotFoundError from deep
    inside (a traceback on the command line); lapse names the kind that would read it."""
    pytest.importorskip("datasets")
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ValueError, match="not a Hugging Face dataset saved with save_to_disk.*kind text"):
        list(iter_documents(CorpusConfig(kind="hf", paths=(str(tmp_path),))))


# Tokenizers


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE_TEXT)
    assert ids == list(UNICODE_TEXT.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == UNICODE_TEXT  # specials are dropped
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (258, 256, 257)
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteTokenizer) and loaded.encode(UNICODE_TEXT) == ids


def test_bpe_trains_round_trips_and_saves(tmp_path):
    texts = [text for _, text in _docs(300)]
    tok = train_bpe(texts, vocab_size=400)
    assert 258 < tok.vocab_size <= 400 and tok.eos_id == 0 and tok.bos_id == 1
    for text in [UNICODE_TEXT, *texts[:20], "", "  leading spaces", "unseen ☃ symbols ∮"]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids  # "<eos>" in the text stays text
        assert tok.decode(ids) == text
    assert len(tok.encode(texts[0])) < len(texts[0].encode())  # merges were learned
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = load_tokenizer(path)
        assert (loaded.vocab_size, loaded.eos_id) == (tok.vocab_size, tok.eos_id)
        assert loaded.encode(UNICODE_TEXT) == tok.encode(UNICODE_TEXT)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path / "..")


# Shards


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_shards_equal_the_tokenisation(tmp_path, kind):
    docs = _docs(120)
    tok = ByteTokenizer() if kind == "byte" else train_bpe([t for _, t in docs], vocab_size=300)
    # A small shard size forces several shards.
    write_shards(docs, tok, tmp_path / "shards", shard_tokens=1000, batch_documents=7, progress=False)
    shards = TokenShards(tmp_path / "shards")
    assert shards.dtype == np.uint16 and len(shards.shards) > 2
    assert shards.num_documents == len(docs)
    assert shards.num_tokens == sum(len(tok.encode(t)) + 1 for _, t in docs)
    for stored, (_, text) in zip(shards.documents(), docs, strict=True):
        assert stored.tolist() == tok.encode(text)
    for tokens, offsets in zip(shards.shards, shards.doc_offsets, strict=True):
        assert isinstance(tokens, np.memmap)
        assert offsets[0] == 0 and all(tokens[o - 1] == tok.eos_id for o in offsets[1:])
        assert tokens[-1] == tok.eos_id


def test_batches_are_deterministic_per_seed_and_step(tmp_path):
    tok = ByteTokenizer()
    write_shards(_docs(200), tok, tmp_path, shard_tokens=2000, progress=False)
    shards = TokenShards(tmp_path)
    sampler = WindowSampler(shards=shards, seq_len=33, batch_size=6, seed=1)
    x, y = sampler.batch(5)
    assert x.shape == y.shape == (6, 33) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
    for (s, start), row_x, row_y in zip(sampler.starts(5), x, y, strict=True):
        window = torch.from_numpy(shards.shards[s][start : start + 34].astype(np.int64))
        assert torch.equal(row_x, window[:-1]) and torch.equal(row_y, window[1:])

    again = WindowSampler(shards=TokenShards(tmp_path), seq_len=33, batch_size=6, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(sampler.batch(5), again.batch(5), strict=True))
    assert not torch.equal(sampler.batch(6)[0], x)
    assert not torch.equal(WindowSampler(shards=shards, seq_len=33, batch_size=6, seed=2).batch(5)[0], x)
    # Ranks take contiguous slices of the global batch.
    halves = [sampler.batch(5, rank=r, world_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), x)


def test_doc_aligned_windows_start_at_documents(tmp_path):
    tok = ByteTokenizer()
    write_shards(_docs(200), tok, tmp_path, shard_tokens=3000, progress=False)
    shards = TokenShards(tmp_path)
    sampler = WindowSampler(shards=shards, seq_len=64, batch_size=16, seed=0, doc_aligned=True)
    for step in range(10):
        for s, start in sampler.starts(step):
            assert start in set(shards.doc_offsets[s].tolist())
            assert start + 65 <= len(shards.shards[s])
    x, _ = sampler.batch(3)
    assert x.shape == (16, 64)
    with pytest.raises(ValueError, match="no window"):
        WindowSampler(shards=shards, seq_len=10**6, batch_size=1)


def test_interrupted_write_leaves_no_final_file(tmp_path, monkeypatch):
    def failing_docs():
        yield from _docs(50)
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-corpus

    out = tmp_path / "shards"
    with pytest.raises(KeyboardInterrupt):
        write_shards(
            failing_docs(), ByteTokenizer(), out, shard_tokens=500, batch_documents=8, progress=False
        )
    assert list(out.iterdir()) == []

    # Fails after the shards are complete, while the index is being written.
    def broken_dumps(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(shards_module.json, "dumps", broken_dumps)
    with pytest.raises(OSError, match="disk full"):
        write_shards(_docs(50), ByteTokenizer(), out, shard_tokens=500, progress=False)
    assert not (out / "index.json").exists()
    with pytest.raises(ValueError, match="no token shards"):
        TokenShards(out)


def test_jsonl_folders_globs_and_bad_bytes(tmp_path):
    """A folder (searched for ``*.jsonl``) and a glob pattern work as for ``text`` (a folder was
    an IsADirectoryError, a pattern "does not exist"); a file that is not UTF-8 is a one-line
    ``ValueError`` naming it (a UnicodeDecodeError traceback)."""
    folder = tmp_path / "rows"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text(json.dumps({"text": "alpha"}) + "\n")
    (folder / "sub" / "a.jsonl").write_text(json.dumps({"text": "beta"}) + "\n")
    (folder / "notes.txt").write_text("not read")
    for entry in (folder, folder / "**" / "*.jsonl"):
        docs = dict(iter_documents(CorpusConfig(kind="jsonl", paths=(str(entry),)), split="all"))
        assert sorted(docs.values()) == ["alpha", "beta"] and len(docs) == 2  # ids kept apart
    one = dict(iter_documents(CorpusConfig(kind="jsonl", paths=(str(folder / "a.jsonl"),)), split="all"))
    assert one == {"a.jsonl:1": "alpha"}  # a file's ids as before
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(json.dumps({"text": "ok"}).encode() + b'\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="latin.jsonl:2: not UTF-8 text"):
        list(iter_documents(CorpusConfig(kind="jsonl", paths=(str(bad),)), split="all"))


def test_paths_without_a_kind_are_refused():
    """``--corpus.paths`` with the default kind (the Python sources) was ignored: training ran on
    the installation's sources without a word."""
    with pytest.raises(ValueError, match="reads no paths.*--corpus.kind text"):
        CorpusConfig(paths=("book.txt",))
    from lapse.models.checkpoint import corpus_config_from_json  # a run saved before: it loads

    saved = corpus_config_from_json({"kind": "python", "paths": ["book.txt"], "patterns": ["*.txt"]})
    assert saved.kind == "python" and saved.paths == ()
