"""Training data without a network: corpora, tokenizers, token shards, window sampling.

``lapse.data.corpus`` lists documents (the local Python installation's source files by
default), ``lapse.data.tokenizer`` turns them into ids (UTF-8 bytes by default, or a BPE
trained locally with the ``tokenizers`` library), ``lapse.data.shards`` stores the ids as
memory-mapped shards and samples training windows as a pure function of ``(seed, step)``.
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
    "ByteTokenizer",
    "CorpusConfig",
    "Document",
    "HFTokenizer",
    "TokenShards",
    "Tokenizer",
    "TransformersTokenizer",
    "WindowSampler",
    "hf_documents",
    "in_validation",
    "iter_documents",
    "jsonl_documents",
    "limit_documents",
    "list_python_sources",
    "load_tokenizer",
    "python_source_documents",
    "text_documents",
    "token_dtype",
    "train_bpe",
    "write_shards",
]
