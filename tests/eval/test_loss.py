"""Per-token loss and perplexity: known answers, streaming against the full computation,
determinism, outputs."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lapse.data import ByteTokenizer
from lapse.eval import eval_windows, load_model
from lapse.eval.loss import (
    PerTokenLossConfig,
    PplConfig,
    check_same_tokenizer,
    curve_summary,
    per_position_loss,
    run_per_token_loss,
    run_ppl,
    smooth,
)
from lapse.models import Decoder, preset
from lapse.models.checkpoint import file_digest, latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _uniform_run(fox_run, tmp_path):
    """A copy of ``fox_run`` whose lm_head is zero: every logit 0, the uniform distribution."""
    run = tmp_path / "uniform"
    shutil.copytree(fox_run, run)
    weights = latest_checkpoint(run) / "model.safetensors"
    state = load_file(weights)
    state["lm_head.weight"].zero_()
    save_file(state, weights)
    manifest = json.loads((weights.parent / "manifest.json").read_text())  # a deliberate edit: re-sign it
    manifest["files"]["model.safetensors"] = file_digest(weights)
    (weights.parent / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_uniform_model_gives_log_vocab_at_every_position(fox_run, tmp_path):
    model = Decoder(preset("tiny", "fox-pro", vocab_size=300)).eval()
    torch.nn.init.zeros_(model.lm_head.weight)
    windows = torch.randint(0, 300, (2, 38))
    loss = per_position_loss(model, windows, logits_chunk=8)
    assert loss.shape == (2, 37) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.full_like(loss, math.log(300)), atol=1e-6, rtol=0)

    run = _uniform_run(fox_run, tmp_path)
    r = run_per_token_loss(PerTokenLossConfig(models=(str(run),), seq_len=48, num_sequences=3,
                                              smooth_window=11, progress=False))
    v = load_model(run).config.vocab_size
    for key in ("loss", "smoothed"):
        np.testing.assert_allclose(r["models"][0][key], math.log(v), rtol=0, atol=1e-6)
    assert len(r["models"][0]["loss"]) == 48 and r["num_sequences"] == 3
    assert abs(r["models"][0]["slope_last_half"]) < 1e-9


def test_smoothing_edges_hand_computed():
    x = [0.0, 1.0, 4.0, 9.0, 16.0]  # i^2: not a line, so every window shows
    np.testing.assert_allclose(smooth(x, 3), [0, 5 / 3, 14 / 3, 29 / 3, 16])
    # window 5: the centre gets all five; i = 1, 3 shrink to width 3; the ends stay as they are
    np.testing.assert_allclose(smooth(x, 5), [0, 5 / 3, 6, 29 / 3, 16])
    np.testing.assert_allclose(smooth(x, 1), x)
    np.testing.assert_allclose(smooth(x, 101), [0, 5 / 3, 6, 29 / 3, 16])  # wider than the curve
    ramp = 2.0 + 0.5 * np.arange(9)
    np.testing.assert_allclose(smooth(ramp, 5), ramp)  # centred windows leave a line unchanged
    with pytest.raises(ValueError, match="odd"):
        smooth(x, 4)


def test_curve_summary_hand_computed():
    loss = 3.0 - 0.01 * np.arange(20)  # slope -0.01 everywhere
    s = curve_summary(loss)
    assert s["first_10pct"] == pytest.approx(np.mean(loss[:2]))
    assert s["last_10pct"] == pytest.approx(np.mean(loss[-2:]))
    assert s["slope_last_half"] == pytest.approx(-0.01)
    assert s["mean_loss"] == pytest.approx(loss.mean())


@pytest.mark.parametrize("seq_len,chunk", [(64, 7), (100, 1024)], ids=["T64-chunk7", "T100-beyond-context"])
def test_streaming_equals_full_cross_entropy(fox_run, transformer_run, seq_len, chunk):
    for run in (fox_run, transformer_run):
        m = load_model(run)
        windows = eval_windows(m, seq_len, 3, seed=4)  # [3, T + 1]
        logits, _ = m.model(windows[:, :-1])  # [3, T, V]
        full = F.cross_entropy(logits.float().transpose(1, 2), windows[:, 1:], reduction="none")  # [3, T]
        streamed = per_position_loss(m.model, windows, logits_chunk=chunk)
        torch.testing.assert_close(streamed, full, atol=2e-6, rtol=0)
        rows = torch.cat([per_position_loss(m.model, w[None], logits_chunk=chunk) for w in windows])
        torch.testing.assert_close(rows, full, atol=2e-6, rtol=0)  # one row at a time: the same


def test_two_models_overlaid_deterministic_with_outputs(fox_run, transformer_run, tmp_path):
    def run(seed, out, batch_size=1):
        cfg = PerTokenLossConfig(models=(str(fox_run), str(transformer_run)), seq_len=64, num_sequences=4,
                                 seed=seed, out_dir=out, batch_size=batch_size, progress=False)
        return run_per_token_loss(cfg)

    a = run(0, tmp_path / "a")
    b = run(0, tmp_path / "b", batch_size=3)
    c = run(1, tmp_path / "c")
    names = [e["name"] for e in a["models"]]
    assert len(set(names)) == 2  # both folders are called "run": the labels say which
    for ea, eb, ec in zip(a["models"], b["models"], c["models"], strict=True):
        np.testing.assert_allclose(ea["loss"], eb["loss"], rtol=0, atol=1e-6)
        assert ea["loss"] != ec["loss"]
    assert a["models"][0]["arch"] == "fox-pro" and a["models"][1]["arch"] == "transformer-llama"

    out = tmp_path / "a"
    saved = json.loads((out / "results.json").read_text())
    assert saved["num_sequences"] == 4 and len(saved["models"][1]["smoothed"]) == 64
    summary = (out / "summary.md").read_text()
    assert all(n in summary for n in names) and "per_token_loss.png" in summary
    import matplotlib.image

    png = out / "per_token_loss.png"
    image = matplotlib.image.imread(png)  # [H, W, 4]
    assert png.stat().st_size > 20_000 and image.shape[1] > 600
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 50  # lines, text, not a blank canvas


def test_limits_and_default_output_folder(fox_run, tmp_path):
    cfg = PerTokenLossConfig(models=(str(fox_run),), num_sequences=10, max_tokens=130, progress=False)
    r = run_per_token_loss(cfg)
    assert r["seq_len"] == 64 and r["num_sequences"] == 2  # the training context; 130 // 64 windows
    assert (fox_run / "eval" / "per-token-loss" / "per_token_loss.png").exists()
    # a checkpoint folder's evaluation goes to its run's eval/ (the run deletes the checkpoints it
    # rotates out, and with them what was written inside), named after the checkpoint
    checkpoint = next(fox_run.glob("checkpoint-*"))
    run_per_token_loss(PerTokenLossConfig(models=(str(checkpoint),), num_sequences=1, max_tokens=65,
                                          progress=False))
    assert (fox_run / "eval" / f"per-token-loss-{checkpoint.name}" / "per_token_loss.png").exists()
    assert not (checkpoint / "eval").exists()
    r = run_per_token_loss(PerTokenLossConfig(models=(str(fox_run),), seq_len=32, num_sequences=6,
                                              max_seconds=1e-9, out_dir=tmp_path, progress=False))
    assert r["num_sequences"] == 1 and "max_seconds" in r["stopped_early"]


def test_loss_at_a_position_does_not_depend_on_what_follows(fox_run, transformer_run):
    # what run_ppl relies on to read every context length off the longest windows
    for run in (fox_run, transformer_run):
        m = load_model(run)
        windows = eval_windows(m, 128, 2, seed=3)  # [2, 129]
        full = per_position_loss(m.model, windows)  # [2, 128]
        for t in (1, 40, 64):
            torch.testing.assert_close(per_position_loss(m.model, windows[:, : t + 1]), full[:, :t],
                                       atol=2e-6, rtol=0)


def test_ppl_marks_extrapolation(fox_run, transformer_run, tmp_path):
    cfg = PplConfig(models=(str(fox_run), str(transformer_run)), context_lengths=(128, 32, 64),
                    num_sequences=3, out_dir=tmp_path, progress=False)
    r = run_ppl(cfg)
    assert r["context_lengths"] == [32, 64, 128] and r["num_sequences"] == 3
    for e in r["models"]:
        assert [row["extrapolation"] for row in e["lengths"]] == [False, False, True]  # trained at 64
        for row in e["lengths"]:
            t = row["context_length"]
            assert row["mean_loss"] == pytest.approx(np.mean(e["loss"][:t]))
            assert row["ppl"] == pytest.approx(math.exp(row["mean_loss"]))
        assert len(e["loss"]) == 128 and e["lengths"][-1]["mean_loss"] == pytest.approx(e["mean_loss"])
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("extrapolation (trained at 64)") == 2
    assert (tmp_path / "ppl.png").stat().st_size > 20_000 and (tmp_path / "results.json").exists()
    r = run_ppl(PplConfig(models=(str(fox_run),), num_sequences=5, max_tokens=600, out_dir=tmp_path / "d",
                          progress=False))
    assert r["context_lengths"] == [32, 64, 128, 256] and r["num_sequences"] == 2  # 600 // 256 windows


def test_clear_errors(fox_run, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        run_per_token_loss(PerTokenLossConfig(models=(str(fox_run), str(tmp_path / "nope")), seq_len=8))
    with pytest.raises(ValueError, match="odd"):
        PerTokenLossConfig(models=(str(fox_run),), smooth_window=100)
    with pytest.raises(ValueError, match="non-empty tuple"):
        PerTokenLossConfig(models=str(fox_run))
    with pytest.raises(ValueError, match="positive integer"):
        PplConfig(models=(str(fox_run),), context_lengths=(64, 0))
    with pytest.raises(ValueError, match="2 entries for 1 models"):
        PplConfig(models=(str(fox_run),), names=("a", "b"))

    class OtherBytes(ByteTokenizer):
        def encode(self, text):
            return [b ^ 1 for b in super().encode(text)]

    a, b = load_model(fox_run), load_model(fox_run)
    b.tokenizer, b.name = OtherBytes(), "other"
    with pytest.raises(ValueError, match="different tokenizers"):
        check_same_tokenizer([a, b])


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test, whatever the runner started with (`nohup ... &`
    starts it ignored), and the runner's back afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_keeps_the_finished_windows(fox_run, tmp_path, monkeypatch, python_sigint):
    """A first Ctrl-C stops after the batch in flight and writes the windows finished (every
    model's sums whole); one during the first batch still finishes it. A second one stops at
    once."""
    import os
    import signal

    from lapse.eval import loss as loss_mod

    calls = []
    plain = loss_mod.per_position_loss

    def interrupted_at(at):
        def per_position(*a, **kw):
            calls.append(1)
            if len(calls) in at:
                os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
            return plain(*a, **kw)
        return per_position

    cfg = PerTokenLossConfig(models=(str(fox_run), str(fox_run)), names=("a", "b"), seq_len=32,
                             num_sequences=6, out_dir=tmp_path, overwrite=True, progress=False)
    monkeypatch.setattr(loss_mod, "per_position_loss", interrupted_at({3}))  # model a, second batch
    r = run_per_token_loss(cfg)
    assert r["num_sequences"] == 2 and r["stopped_early"] == "SIGINT after 2 of 6 sequences"
    assert len(calls) == 4  # both models ran the second batch
    import dataclasses

    full = run_per_token_loss(dataclasses.replace(cfg, num_sequences=2, out_dir=tmp_path / "f"))
    for got, want in zip(r["models"], full["models"], strict=True):  # the stopped run's sums are whole
        assert got["name"] == want["name"] and np.allclose(got["loss"], want["loss"], rtol=1e-12)
    assert "SIGINT after 2 of 6" in (tmp_path / "summary.md").read_text()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    calls.clear()
    monkeypatch.setattr(loss_mod, "per_position_loss", interrupted_at({1}))  # during the first batch
    assert run_per_token_loss(cfg)["num_sequences"] == 1
    calls.clear()
    monkeypatch.setattr(loss_mod, "per_position_loss", interrupted_at({1, 2}))  # twice: at once
    with pytest.raises(KeyboardInterrupt):
        run_per_token_loss(cfg)


def test_a_stopped_evaluation_exits_130_after_writing(tmp_path, capsys):
    """The CLI reports where a signal-stopped evaluation wrote, then exits 130 as an
    interrupted command does (it exited 0); a time limit's stop is a normal end."""
    from lapse.cli import _wrote

    cfg = PerTokenLossConfig(models=("x",), out_dir=tmp_path)
    with pytest.raises(SystemExit) as e:
        _wrote({"stopped_early": "SIGINT after 2 of 6 sequences", "out_dir": str(tmp_path)}, cfg, "ppl")
    assert e.value.code == 130 and "stopped early: SIGINT" in capsys.readouterr().err
    _wrote({"stopped_early": "max_seconds (1 s) after 2 of 6", "out_dir": str(tmp_path)}, cfg, "ppl")
    assert f"to {tmp_path}" in capsys.readouterr().out


def test_a_policys_results_go_beside_the_dense_ones(fox_run, tmp_path):
    """By default ``--policy window`` writes ``eval/per-token-loss-window/``: the dense run's
    ``eval/per-token-loss/`` stays (the policy's run replaced it)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(fox_run, run, ignore=shutil.ignore_patterns("eval"))  # other tests evaluate fox_run
    base = dict(models=(str(run),), seq_len=32, num_sequences=1, progress=False)
    run_per_token_loss(PerTokenLossConfig(**base))
    r = run_per_token_loss(PerTokenLossConfig(**base, policy="window", window=8, prefix=8))
    assert r["out_dir"] == str(run / "eval" / "per-token-loss-window")
    assert (run / "eval" / "per-token-loss" / "results.json").exists()
    assert json.loads((run / "eval" / "per-token-loss" / "results.json").read_text())["policy"] is None
    # a second run replaced the first without a word; now only with overwrite
    with pytest.raises(ValueError, match="per-token-loss holds an earlier evaluation .*: --overwrite "):
        run_per_token_loss(PerTokenLossConfig(**base))
    run_per_token_loss(PerTokenLossConfig(**base, overwrite=True))
