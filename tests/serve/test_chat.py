"""``/v1/chat/completions`` over ``lapse serve --hf``: a tiny random LLaMA folder with a
byte-level BPE tokenizer and a chat template (made here), converted to a lapse decoder."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from server_helpers import client, serving  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    from lapse.serve.command import build_server
    from lapse.serve.config import ServeConfig

    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog", "<|user|> hi <|assistant|>"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128, initializer_range=0.1, pad_token_id=0,
                                 eos_token_id=1, bos_token_id=None)).save_pretrained(folder)
    server = build_server(ServeConfig(hf=folder, device="cpu", max_batch=2, served_model_name="llama",
                                      policy="h2o", budget=16, recent=4, sinks=2))
    with serving(server.app) as url:
        yield url, tokenizer
    server.engine.stop()


def test_chat_is_the_completion_of_the_templated_prompt(chat_server):
    url, tokenizer = chat_server
    c = client(url)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
    chat = c.chat.completions.create(model="llama", messages=messages, max_tokens=12, temperature=1, seed=2)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    plain = c.completions.create(model="llama", prompt=list(ids), max_tokens=12, temperature=1, seed=2)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model="llama", messages=messages, max_tokens=12, temperature=1,
                                            seed=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == chat.choices[0].message.content
