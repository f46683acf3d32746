"""Evaluations under an eviction policy, on lapse models and a tiny random Hugging Face
LLaMA (GQA, fp32, CPU): streamed loss (chunked, token by token, Dense = the plain loss),
NIAH and lm-eval scoring under a policy (Dense = no policy), ``--hf`` on the command
line, and the errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lapse.cli import main
from lapse.eval.loss import per_position_loss
from lapse.eval.niah import Prompt, Trial, score_prompts
from lapse.eval.policy import check_fits, streamed_loss
from lapse.generation import (
    H2O,
    Dense,
    PolicyOptions,
    SinkWindow,
    decode_one_token,
    evict,
    paged_store_for,
    prefill,
)
from lapse.hf import use_lapse_attention
from lapse.models import Decoder, preset

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 2e-5  # float32 streamed against full forwards: measured ~2e-6 on CPU


def _lapse() -> Decoder:
    torch.manual_seed(0)
    return Decoder(preset("tiny", "transformer-llama", init_std=0.1)).eval()


def _llama(vocab: int = 128, context: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    use_lapse_attention(model)
    return model


def _windows(n: int = 2, length: int = 33) -> torch.Tensor:
    return torch.randint(2, 128, (n, length), generator=torch.Generator().manual_seed(1))


def _plain_loss(model, windows: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Decoder):
        return per_position_loss(model, windows)
    logits = model(windows[:, :-1]).logits.float()  # [N, T, V]
    return F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")


@pytest.mark.parametrize("kind", ["lapse", "hf-llama"])
def test_dense_streamed_equals_plain_loss(kind):
    model, windows, prefix = (_lapse() if kind == "lapse" else _llama()), _windows(), 9
    for chunk in (1, 5):
        r = streamed_loss(model, windows, Dense(), prefix=prefix, chunk=chunk)
        torch.testing.assert_close(r.loss, _plain_loss(model, windows)[:, prefix:], atol=ATOL, rtol=0)


def test_chunk_one_equals_lapse_token_by_token_decoding():
    """The oracle: lapse's own paged store, prefill, evict before every step, decode."""
    model, windows, prefix = _lapse(), _windows(), 9
    policy = H2O(budget=6, recent=2, sinks=1)
    r = streamed_loss(model, windows, policy, prefix=prefix)
    steps = windows.shape[1] - 1 - prefix
    store = paged_store_for(model, windows.shape[0], prefix, steps, policy)
    prefill(model, windows[:, :prefix], store)
    losses = []
    for i in range(steps):
        evict(model, store, policy)
        store.reserve(1)
        logits = decode_one_token(model, windows[:, prefix + i : prefix + i + 1], store)
        losses.append(F.cross_entropy(logits.float(), windows[:, prefix + i + 1], reduction="none"))
    torch.testing.assert_close(r.loss, torch.stack(losses, 1), atol=ATOL, rtol=0)
    assert (r.loss - r.dense_loss).abs().max() > 1e-3  # the budget bites


@pytest.mark.parametrize("kind", ["lapse", "hf-llama"])
def test_chunk_c_is_eviction_every_c_tokens(kind):
    """A chunk of c tokens with a pass before each equals token steps with a pass every c."""
    model, windows = (_lapse() if kind == "lapse" else _llama()), _windows()
    chunked = streamed_loss(model, windows, H2O(budget=6, recent=2, every=1), prefix=9, chunk=4)
    stepped = streamed_loss(model, windows, H2O(budget=6, recent=2, every=4), prefix=9, chunk=1)
    torch.testing.assert_close(chunked.loss, stepped.loss, atol=1e-6, rtol=0)
    every_token = streamed_loss(model, windows, H2O(budget=6, recent=2, every=1), prefix=9)
    assert (chunked.loss - every_token.loss).abs().max() > 1e-4


def test_hf_window_policy_measures():
    r = streamed_loss(_llama(), _windows(), SinkWindow(sinks=1, window=4, every=1), prefix=9)
    assert r.recall.shape == (2, 2, 23) and 0 < float(r.recall.min()) and float(r.recall.max()) <= 1 + 1e-6
    assert float(r.kl.mean()) > 0 and float(r.token_share.max()) < 0.5


def _prompts(n: int = 3, length: int = 20) -> list[Prompt]:
    g = torch.Generator().manual_seed(2)
    return [
        Prompt(ids=torch.randint(2, 128, (length,), generator=g).tolist(),
               answer_ids=torch.randint(2, 128, (2 + i % 2,), generator=g).tolist(), needle_start=3,
               needle_len=2, haystack_tokens=length - 4, trial=Trial(index=i, number=0, start_segment=0))
        for i in range(n)
    ]


def test_niah_scores_under_dense_equal_the_plain_path_and_run_under_h2o():
    model, prompts = _lapse(), _prompts()
    plain = score_prompts(model, prompts, "cpu")
    dense = score_prompts(model, prompts, "cpu", Dense())
    for a, b in zip(plain, dense, strict=True):
        assert a["generated_ids"] == b["generated_ids"] and a["exact_match"] == b["exact_match"]
        assert abs(a["answer_logprob"] - b["answer_logprob"]) < 1e-4
    h2o = score_prompts(_llama(), prompts, "cpu", H2O(budget=4, recent=2))
    assert all(len(s["generated_ids"]) == len(p.answer_ids) for s, p in zip(h2o, prompts, strict=True))


def test_lm_eval_under_dense_equals_no_policy(fox_run):
    from lapse.eval.lm_eval import LapseLM

    plain, dense = LapseLM(fox_run, batch_size=2), LapseLM(fox_run, batch_size=2, policy=Dense())
    h2o = LapseLM(fox_run, batch_size=2, policy=H2O(budget=2, recent=1, sinks=0))
    enc = plain.tok_encode
    requests = [(None, enc("def f(x):\n    return"), enc(" x + 1")),
                (None, [plain.eot_token_id], enc("import os")),
                (None, enc("for i in range(10):"), enc("\n    print(i)"))]
    for (a, ga), (b, gb) in zip(plain._loglikelihood_tokens(requests, disable_tqdm=True),
                                dense._loglikelihood_tokens(requests, disable_tqdm=True), strict=True):
        assert abs(a - b) < 1e-4 and ga == gb
    pruned = h2o._loglikelihood_tokens(requests, disable_tqdm=True)
    assert all(torch.isfinite(torch.tensor(s)) for s, _ in pruned)
    text = dense.generate_until([_Req(("def f(x):", {"until": ["\n\n"], "max_gen_toks": 6}))], True)
    assert text == plain.generate_until([_Req(("def f(x):", {"until": ["\n\n"], "max_gen_toks": 6}))], True)


class _Req:
    def __init__(self, args):
        self.args = args


def test_bad_input():
    with pytest.raises(ValueError, match="--budget must be positive"):
        PolicyOptions(policy="h2o", budget=0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)).eval()
    with pytest.raises(ValueError, match="gpt2"):
        check_fits(gpt2, H2O(budget=4, recent=2), 8, 16)
    with pytest.raises(ValueError, match="exceed the model's context of 64"):
        streamed_loss(_llama(), _windows(1, 80), Dense(), prefix=10)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        streamed_loss(_llama(), _windows(), Dense(), prefix=10, chunk=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny random LLaMA saved with a byte-level BPE tokenizer (an ``--hf`` folder)."""
    folder = tmp_path_factory.mktemp("llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["def f(x): return x + 1", "import os, sys"] * 10, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    _llama(vocab=bpe.get_vocab_size(), context=256).save_pretrained(folder)
    (folder / "corpus.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    return folder


def _corpus_args(llama_dir: Path) -> list[str]:
    """The folder's corpus.txt as the windows' corpus, half of it validation."""
    return ["corpus:corpus-config", "--corpus.kind", "text", "--corpus.paths", str(llama_dir / "corpus.txt"),
            "--corpus.val-fraction", "0.5"]


def test_cli_policy_loss_and_niah_on_an_hf_folder(llama_dir, tmp_path, capsys):
    corpus = _corpus_args(llama_dir)
    main(["eval", "policy-loss", "--hf", str(llama_dir), "--policy", "h2o", "--budget", "8", "--recent", "2",
          "--seq-len", "24", "--prefix", "12", "--num-sequences", "2", "--chunk", "2", "--no-progress",
          "--out-dir", str(tmp_path / "pl"), *corpus])
    r = json.loads((tmp_path / "pl" / "results.json").read_text())
    assert r["arch"] == "llama" and r["config"]["chunk"] == 2 and r["mean_loss"] > 0
    main(["eval", "niah", "--hf", str(llama_dir), "--policy", "window", "--window", "8", "--sinks", "2",
          "--context-lengths", "160", "--depths", "0.5", "--trials", "2", "--haystack",
          str(llama_dir / "corpus.txt"), "--no-progress", "--out-dir", str(tmp_path / "niah")])
    niah = json.loads((tmp_path / "niah" / "results.json").read_text())
    assert niah["models"][0]["policy"].startswith("SinkWindow") and len(niah["models"][0]["cells"]) == 1
    with pytest.raises(SystemExit):
        main(["eval", "niah", "--hf", str(llama_dir), "--context-lengths", "300", "--depths", "0.5",
              "--haystack", str(llama_dir / "corpus.txt"), "--no-progress",
              "--out-dir", str(tmp_path / "n2")])
    assert "exceed the model's context of 256" in capsys.readouterr().err


def test_per_position_loss_of_an_hf_model_equals_its_logits():
    model, windows = _llama(), _windows()
    logits = model(windows[:, :-1]).logits.float()  # [N, T, V]
    plain = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none")
    torch.testing.assert_close(per_position_loss(model, windows, logits_chunk=7), plain, atol=ATOL, rtol=0)


def test_cli_ppl_and_per_token_loss_on_an_hf_folder(llama_dir, tmp_path):
    corpus = _corpus_args(llama_dir)
    main(["eval", "ppl", "--hf", str(llama_dir), "--context-lengths", "16", "32", "--num-sequences", "2",
          "--smooth-window", "1", "--no-progress", "--out-dir", str(tmp_path / "ppl"), *corpus])
    dense = json.loads((tmp_path / "ppl" / "results.json").read_text())
    entry = dense["models"][0]
    assert entry["arch"] == "llama" and entry["max_seq_len"] == 256 and dense["policy"] is None
    assert [row["context_length"] for row in entry["lengths"]] == [16, 32]
    main(["eval", "per-token-loss", "--hf", str(llama_dir), "--seq-len", "32", "--num-sequences", "2",
          "--smooth-window", "1", "--policy", "dense", "--prefix", "8", "--no-progress",
          "--out-dir", str(tmp_path / "ptl"), *corpus])
    streamed = json.loads((tmp_path / "ptl" / "results.json").read_text())
    assert streamed["policy"].startswith("Dense")  # Dense streamed = the plain loss of the same windows
    np.testing.assert_allclose(streamed["models"][0]["loss"], entry["loss"], atol=ATOL)
