"""A corpus tokenised once and cached (lapse.data.prepare)."""

from __future__ import annotations

from lapse.data import CorpusConfig, cached_with, prepare_data


def _book(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("".join(f"sentence number {i} of the only document.\n" for i in range(3000)))
    return book


def test_one_file_is_cached_once_with_both_splits(tmp_path):
    book = _book(tmp_path)
    corpus = CorpusConfig(kind="text", paths=(str(book),))
    data = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert data.train.num_documents == data.validation.num_documents == 1
    total = len(book.read_bytes())
    assert data.train.num_tokens + data.validation.num_tokens == total + 2  # + one eos each
    assert abs(data.validation.num_tokens - 0.01 * total) < 3
    again = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert again.directory == data.directory
    saved = data.directory / "tokenizer"
    assert cached_with(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", tokenizer_path=saved)


def test_no_validation_split_at_val_fraction_zero(tmp_path):
    corpus = CorpusConfig(kind="text", paths=(str(_book(tmp_path)),), val_fraction=0.0)
    data = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert data.validation is None and not (data.directory / "validation").exists()
    assert data.train.num_tokens == len(_book(tmp_path).read_bytes()) + 1


def test_an_edited_corpus_is_tokenised_again_for_a_new_run_only(tmp_path):
    """``ready.json`` records the files' sizes and times: a new training run tokenises an edited
    or an added file again (the old tokens were trained on without a word); a resumed run or an
    evaluation keeps the cache and is warned; a corpus that is gone leaves the cache as it is."""
    import os
    import shutil

    import pytest

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("first version. " * 300)
    corpus = CorpusConfig(kind="text", paths=(str(folder),), val_fraction=0.0)
    kw = dict(vocab_size=320, data_dir=tmp_path / "data", progress=False)
    first = prepare_data(corpus, "byte", **kw)
    assert prepare_data(corpus, "byte", rebuild_changed=True, **kw).train.num_tokens == 15 * 300 + 1
    (folder / "a.txt").write_text("the second, longer version. " * 300)
    with pytest.warns(UserWarning, match=r"the corpus changed since .* \(1 changed\)"):
        kept = prepare_data(corpus, "byte", **kw)
    assert kept.directory == first.directory and kept.train.num_tokens == 15 * 300 + 1
    assert prepare_data(corpus, "byte", rebuild_changed=True, **kw).train.num_tokens == 28 * 300 + 1
    stat = (folder / "a.txt").stat()
    (folder / "a.txt").write_text("the second, longer version? " * 300)  # same size, a new time
    os.utime(folder / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    (folder / "b.txt").write_text("an added file. " * 100)
    again = prepare_data(corpus, "byte", rebuild_changed=True, **kw)
    assert again.train.num_documents == 2 and again.directory == first.directory
    shutil.rmtree(folder)  # gone: the cache serves as it is, without a word
    assert prepare_data(corpus, "byte", **kw).train.num_documents == 2


def test_a_root_reads_relative_paths_and_keeps_their_ids(tmp_path, monkeypatch):
    """With ``root`` (what ``lapse train`` records), relative paths and globs are read from it
    and the documents keep the ids the paths give as written, so the split is the same from
    any working directory (absolute paths changed every id, and so the split)."""
    from lapse.data import iter_documents

    (tmp_path / "data").mkdir()
    for i in range(20):
        (tmp_path / "data" / f"f{i}.txt").write_text(f"document {i}\n")
    monkeypatch.chdir(tmp_path)
    here = CorpusConfig(kind="text", paths=("data/*.txt",), val_fraction=0.2)
    val = dict(iter_documents(here, "validation"))
    assert val and all(k.startswith("data/f") for k in val)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rooted = CorpusConfig(kind="text", paths=("data/*.txt",), val_fraction=0.2, root=str(tmp_path))
    assert dict(iter_documents(rooted, "validation")) == val
    one = CorpusConfig(kind="text", paths=("data/f3.txt",), root=str(tmp_path))
    assert list(iter_documents(one, "all")) == [("data/f3.txt", "document 3\n")]
