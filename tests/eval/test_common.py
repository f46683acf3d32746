"""Loading models for evaluation, and evaluation windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lapse.eval import eval_windows, export_hf, load_model
from lapse.models.checkpoint import latest_checkpoint


def test_load_run_folder_checkpoint_folder_and_hf_folder(fox_run, tmp_path):
    a = load_model(fox_run)
    b = load_model(latest_checkpoint(fox_run))
    ids = torch.randint(0, 258, (1, 33))
    la, lb = a.model(ids)[0], b.model(ids)[0]
    assert torch.equal(la, lb) and a.tokenizer is not None and a.name == "run"
    export_hf(fox_run, tmp_path / "hf")
    c = load_model(tmp_path / "hf")
    assert torch.equal(c.model(ids)[0], la) and c.tokenizer is not None
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(auto(ids).logits, la)
    d = load_model(fox_run, acp=False, attn_backend="naive")
    assert not d.config.acp
    torch.testing.assert_close(d.model(ids)[0], la, atol=1e-5, rtol=0)  # T=33: ACP prunes nothing


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="no lapse model"):
        load_model(tmp_path)


def test_eval_windows_are_deterministic(fox_run):
    m = load_model(fox_run)
    w1 = eval_windows(m, 48, 3, seed=1)
    w2 = eval_windows(m, 48, 3, seed=1)
    w3 = eval_windows(m, 48, 3, seed=2)
    assert w1.shape == (3, 49) and w1.dtype == torch.int64
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)


def test_windows_of_a_bpe_model_use_its_own_tokenizer(tmp_path, eval_data_dir):
    """A BPE run evaluated from its run folder, a checkpoint folder and an exported HF
    folder, on another corpus: the same ids every way (the run's BPE, never a new one)."""
    from lapse.data import CorpusConfig
    from lapse.models import preset
    from lapse.train import train, train_preset

    run = tmp_path / "bpe-run"
    train(
        train_preset(
            "cpu-tiny",
            run_dir=run,
            data_dir=tmp_path / "data",
            tokenizer="bpe",
            steps=2,
            val_every=0,
            acp_stats_every=0,
            model=preset("tiny", "fox-pro", vocab_size=320, max_seq_len=64),
        )
    )
    text = tmp_path / "corpus"
    text.mkdir()
    for i in range(20):
        (text / f"doc{i}.txt").write_text(
            f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 40
        )
    corpus = CorpusConfig(kind="text", paths=(str(text),), val_fraction=0.5)
    export_hf(run, tmp_path / "hf")
    got = [
        eval_windows(load_model(p), 48, 2, corpus=corpus, data_dir=tmp_path / "eval-data")
        for p in (run, latest_checkpoint(run), tmp_path / "hf")
    ]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    ids = load_model(run).tokenizer.encode("the quick brown fox jumps over the lazy dog.")
    assert len(ids) < 40  # merges were learned: these are BPE ids, not bytes
    assert int(got[0].max()) >= 258  # and the windows hold merged tokens


def test_default_eval_dir(tmp_path):
    """A run's evaluations in RUN/eval/<name>; a checkpoint's in its run's eval/, named after
    it (not inside the checkpoint, which rotation deletes); ./eval/<name> without a model."""
    from lapse.eval.common import default_eval_dir

    run = tmp_path / "run"
    (run / "checkpoint-0000300").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    assert default_eval_dir(run, "ppl") == run / "eval" / "ppl"
    assert default_eval_dir(run / "checkpoint-0000300", "ppl") == run / "eval" / "ppl-checkpoint-0000300"
    assert default_eval_dir(None, "niah") == Path("eval") / "niah"
    lone = tmp_path / "checkpoint-0000001"  # a folder so named outside a run is a model folder
    assert default_eval_dir(lone, "acp") == lone / "eval" / "acp"


def test_an_export_folder_needs_a_corpus_and_says_only_that(fox_run, tmp_path):
    """An export has its tokenizer beside it: the error asks for a corpus alone (it also asked
    for a tokenizer); ``lapse eval dcp``, which takes no corpus, says it needs the run."""
    from lapse.eval.dcp import DcpStudyConfig, run_dcp_study

    export_hf(fox_run, tmp_path / "hf")
    with pytest.raises(ValueError, match="pass a corpus") as e:
        eval_windows(load_model(tmp_path / "hf"), 32, 2)
    assert "tokenizer" not in str(e.value)
    with pytest.raises(ValueError, match="draws from a run's own validation text"):
        run_dcp_study(DcpStudyConfig(runs=(tmp_path / "hf",), out_dir=tmp_path / "out"))


def test_export_never_writes_over_a_run_or_other_files(fox_run, tmp_path):
    """``lapse export`` writes a new or empty folder, or an earlier export with ``overwrite``;
    a training run (the source's own folder above all), a folder of other files and a file are
    refused before anything is written, and the run stays whole."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fox_run, run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    other = tmp_path / "other-run"
    shutil.copytree(fox_run, other)
    for target, message in ((other, "not empty and not a `lapse export`"), (run, "holds the model"),
                            (tmp_path, "holds the model")):
        with pytest.raises(ValueError, match=message):
            export_hf(run, target, overwrite=True)
    with pytest.raises(ValueError, match="holds the model"):  # a checkpoint's run folder
        export_hf(latest_checkpoint(run), run)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        export_hf(run, tmp_path / "file")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    (tmp_path / "empty").mkdir()
    export_hf(run, tmp_path / "empty")
    with pytest.raises(ValueError, match="--overwrite replaces it"):
        export_hf(run, tmp_path / "empty")
    export_hf(run, tmp_path / "empty", overwrite=True)
    assert load_model(tmp_path / "empty").tokenizer is not None
