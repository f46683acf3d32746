"""Training data without a network: corpora, tokenizers, token shards, window sampling.

``lapse.data.corpus`` lists documents (the local Python installation's source files by
default), ``lapse.data.tokenizer`` turns them into ids (UTF-8 bytes by default, or a BPE
trained locally with the ``tokenizers`` library), ``lapse.data.shards`` stores the ids as
memory-mapped shards and samples training windows as a pure function of ``(seed, step)``;
``lapse.data.prepare`` builds and caches the shards of a (corpus, tokenizer) pair.

Each name loads with its submodule on first use: :class:`CorpusConfig` (``corpus``) imports
neither numpy nor torch.
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    ".corpus": ("DEFAULT_DATA_DIR", "CorpusConfig", "Document", "hf_documents", "in_validation",
                "iter_documents", "jsonl_documents", "limit_documents", "list_python_sources",
                "python_source_documents", "text_documents"),
    ".prepare": ("PreparedData", "cached_with", "data_key", "prepare_data"),
    ".shards": ("TokenShards", "WindowSampler", "token_dtype", "write_shards"),
    ".tokenizer": ("ByteTokenizer", "HFTokenizer", "Tokenizer", "TransformersTokenizer", "load_tokenizer",
                   "train_bpe"),
})
