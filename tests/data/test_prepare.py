"""A corpus tokenised once and cached (lapse.data.prepare)."""

from __future__ import annotations

from lapse.data import CorpusConfig, cached_with, prepare_data


def _book(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("".join(f"sentence number {i} of the only document.\n" for i in range(3000)))
    return book


def test_one_file_is_cached_once_with_both_splits(tmp_path):
    corpus = CorpusConfig(kind="text", paths=(str(_book(tmp_path)),))
    data = prepare_data(corpus, "byte", vocab_size=320, data_dir=tmp_path / "data", progress=False)
    assert data.train.num_documents == data.validation.num_documents == 1
    total = len(_book(tmp_path).read_bytes())
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
