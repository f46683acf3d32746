"""Training data without a network: corpora, tokenizers, token shards, window sampling.

``lapse.data.corpus`` lists documents (the local Python installation's source files by
default), ``lapse.data.tokenizer`` turns them into ids (UTF-8 bytes by default, or a BPE
trained locally with the ``tokenizers`` library), ``lapse.data.shards`` stores the ids as
memory-mapped shards and samples training windows as a pure function of ``(seed, step)``;
``lapse.data.prepare`` builds and caches the shards of a (corpus, tokenizer) pair.
"""

from lapse.data.corpus import (
    CorpusConfig,
    Document,
    hf_documents,
    in_validation,
    iter_documents,
    jsonl_documents,
    limit_documents,
    list_python_sources,
    python_source_documents,
    text_documents,
)
from lapse.data.prepare import DEFAULT_DATA_DIR, PreparedData, cached_with, data_key, prepare_data
from lapse.data.shards import TokenShards, WindowSampler, token_dtype, write_shards
from lapse.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TransformersTokenizer,
    load_tokenizer,
    train_bpe,
)

__all__ = [
    "DEFAULT_DATA_DIR",
    "ByteTokenizer",
    "CorpusConfig",
    "Document",
    "HFTokenizer",
    "PreparedData",
    "TokenShards",
    "Tokenizer",
    "TransformersTokenizer",
    "WindowSampler",
    "cached_with",
    "data_key",
    "hf_documents",
    "in_validation",
    "iter_documents",
    "jsonl_documents",
    "limit_documents",
    "list_python_sources",
    "load_tokenizer",
    "prepare_data",
    "python_source_documents",
    "text_documents",
    "token_dtype",
    "train_bpe",
    "write_shards",
]
