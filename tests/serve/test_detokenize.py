"""The engine's incremental detokenization: each new token decodes with a few before it,
not the whole text again, and the text it gives at every token is the whole decode's."""

from __future__ import annotations

import pytest

from lapse.data.tokenizer import ByteTokenizer, train_bpe
from lapse.serve.engine import Job, _detokenize

TEXTS = ["def hello(world):\n    return 'héllo wörld' + \"naïve\"\n",
         "日本語のテキスト, emoji 🙂🚀 and ZWJ 👩‍💻 sequences",
         "  leading spaces,\ttabs\n\nand   runs   of   spaces  "]


def _bpe():
    return train_bpe([t * 20 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog"] * 50,
                     vocab_size=400, min_frequency=1)


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), _bpe()], ids=["byte", "bpe"])
@pytest.mark.parametrize("text", TEXTS, ids=["code", "cjk-emoji", "spaces"])
def test_each_token_gives_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    job = Job(rid="r", request=None, stops=[], loop=None, events=None)
    for i, token in enumerate(ids, 1):
        job.ids.append(token)
        assert _detokenize(tokenizer, job) == tokenizer.decode(ids[:i]), i
    assert job.text == text
    assert job.read == len(ids)  # ends on a whole character: every token decoded once more at most
