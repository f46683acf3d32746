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


def test_an_edited_corpus_makes_a_new_cache(tmp_path):
    """The cache's key holds the files' sizes and modification times: an edited or an added file
    is tokenised anew (the old tokens were trained on without a word)."""
    import os

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("first version. " * 300)
    corpus = CorpusConfig(kind="text", paths=(str(folder),), val_fraction=0.0)
    first = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data",
                        progress=False).directory == first.directory
    (folder / "a.txt").write_text("the second, longer version. " * 300)
    edited = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert edited.directory != first.directory and edited.train.num_tokens == 28 * 300 + 1
    stat = (folder / "a.txt").stat()
    (folder / "a.txt").write_text("the second, longer version? " * 300)  # same size, new time
    os.utime(folder / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data",
                        progress=False).directory not in (first.directory, edited.directory)
    (folder / "b.txt").write_text("an added file. " * 100)
    added = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert added.train.num_documents == 2
