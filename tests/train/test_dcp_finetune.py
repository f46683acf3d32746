"""Fine-tuning a Transformer run into DCP with ``lapse train --init-from ... --dcp.*``
(CPU, tiny): the loss gets the sparsity term, alpha follows its schedule across a
resume, the share of context dropped is logged and plotted, bad options fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lapse.cli import main as cli_main
from lapse.models import preset
from lapse.models.checkpoint import latest_checkpoint, read_run
from lapse.train import read_metrics, train, train_preset
from lapse.train.config import DCPTrainConfig
from lapse.train.dcp import alpha_at

pytestmark = pytest.mark.usefixtures("one_thread")

DCP_PARAMS = ("qint_proj.weight", "kint_proj.weight", "beta")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A 2-step Transformer (LLaMA) run: the checkpoint DCP starts from."""
    root = tmp_path_factory.mktemp("dcp")
    model = preset("tiny", "transformer-llama", vocab_size=320, max_seq_len=64)
    train(train_preset(
        "cpu-tiny", run_dir=root / "transformer", data_dir=root / "data", steps=2, val_every=0,
        acp_stats_every=0, model=model,
    ))
    return root / "transformer"


def _finetune(source: Path, run_dir: Path, *extra: str) -> None:
    cli_main([
        "train", "cpu-tiny", "--run-dir", str(run_dir), "--data-dir", str(source.parent / "data"),
        "--init-from", str(source), "--model.attention", "dcp", "--model.no-acp",
        "--model.dcp-beta-init", "-0.3", "--model.dcp-r", "8",
        "--dcp.gamma", "0.5", "--dcp.alpha-start", "1", "--dcp.alpha-end", "8",
        "--steps", "3", "--val-every", "3", "--checkpoint-every", "0", *extra,
    ])


def test_alpha_schedule_is_a_cosine_from_start_to_end():
    cfg = DCPTrainConfig(alpha_start=1.0, alpha_end=8.0)
    alphas = [alpha_at(s, 11, cfg) for s in range(11)]
    assert alphas[0] == 1.0 and alphas[-1] == 8.0 and alphas[5] == pytest.approx(4.5)
    assert all(a < b for a, b in zip(alphas, alphas[1:], strict=False))
    assert alpha_at(0, 1, cfg) == 1.0


def test_finetune_logs_sparsity_and_resumes_exactly(source, tmp_path):
    """3 steps in one go against 2 steps, a stop and a resume: the same alphas, losses
    and final weights; the model starts from the Transformer's weights."""
    _finetune(source, tmp_path / "whole")
    _finetune(source, tmp_path / "split", "--stop-at-step", "2")
    cli_main(["resume", str(tmp_path / "split")])
    whole, split = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "split")
    train_w = [r for r in whole if r["kind"] == "train"]
    train_s = [r for r in split if r["kind"] == "train"]
    assert [r["alpha"] for r in train_w] == [r["alpha"] for r in train_s] == [1.0, 4.5, 8.0]
    assert [r["loss"] for r in train_w] == [r["loss"] for r in train_s]
    for r in train_w:
        assert len(r["sparsity_per_layer"]) == 2 and 0 <= r["sparsity"] <= 1 and r["sparsity_term"] >= 0
    # beta -0.3: the logistic sigmoid (alpha 1) never clips; alpha 8 clips below z = -1/7
    assert train_w[0]["sparsity"] == 0 and train_w[0]["sparsity_term"] > 0 and train_w[-1]["sparsity"] > 0.5
    val = [r for r in whole if r["kind"] == "val"]
    assert len(val) == 1 and val[0]["sparsity"] > 0.5  # the step mask: z < 0 mostly
    a = load_file(latest_checkpoint(tmp_path / "whole") / "model.safetensors")
    b = load_file(latest_checkpoint(tmp_path / "split") / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = read_run(tmp_path / "whole")
    assert saved.model.name == "dcp-llama" and saved.model.dcp_r == 8 and saved.model.vocab_size == 320
    assert saved.config["dcp"]["gamma"] == 0.5 and saved.config["init_from"] == str(source)
    report = (tmp_path / "whole" / "report.md").read_text()
    assert "DCP: gamma 0.5" in report and "DCP at inference" in report and "fine-tuned from" in report
    assert "mean kept weight of an earlier token" in report  # the soft mask, beside its exact zeros
    assert (tmp_path / "whole" / "loss.png").stat().st_size > 0
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["arch"] == "dcp-llama" and summary["dcp"]["alpha"] == [1.0, 8.0]


def test_interaction_only_trains_the_interaction_parameters_alone(source, tmp_path):
    _finetune(source, tmp_path / "run", "--dcp.interaction-only", "--val-every", "0")
    start = load_file(latest_checkpoint(source) / "model.safetensors")
    end = load_file(latest_checkpoint(tmp_path / "run") / "model.safetensors")
    changed = {k for k in end if k not in start or not torch.equal(start[k], end[k])}
    assert changed and all(k.endswith(DCP_PARAMS) for k in changed)
    assert set(end) - set(start) == {f"blocks.{i}.attn.{p}" for i in range(2) for p in DCP_PARAMS}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dcp.gamma", "-0.1"], "dcp.gamma (the sparsity weight) must be a finite number >= 0"),
        (["--dcp.alpha-start", "0.5"], "dcp.alpha_start must be a finite number >= 1"),
        (["--dcp.alpha-end", "nan"], "dcp.alpha_end must be a finite number >= 1"),
        (["--model.dcp-r", "0"], "dcp_r (the DCP interaction dim) must be a positive integer"),
    ],
    ids=["gamma", "alpha-start", "alpha-end", "r"],
)
def test_bad_dcp_options_fail_in_one_line(source, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        _finetune(source, tmp_path / "run", *args)
    assert e.value.code == 2
    err = capsys.readouterr().err  # tyro's box around the message: take its words
    assert message in " ".join(err.replace("|", " ").replace("\u2502", " ").split())


def test_dcp_needs_a_dcp_model_and_a_softmax_checkpoint(source, tmp_path, capsys):
    data = str(source.parent / "data")
    with pytest.raises(SystemExit):
        cli_main(["train", "cpu-tiny", "--run-dir", str(tmp_path / "a"), "--data-dir", data,
                  "--dcp.gamma", "0.1", "--steps", "1"])
    assert "error: the dcp options need a model with DCP attention" in capsys.readouterr().err
    fox = tmp_path / "fox"
    train(train_preset("cpu-tiny", run_dir=fox, data_dir=source.parent / "data", steps=1, val_every=0))
    with pytest.raises(SystemExit):
        cli_main(["train", "cpu-tiny", "--run-dir", str(tmp_path / "b"), "--data-dir", data,
                  "--init-from", str(fox), "--model.attention", "dcp", "--model.no-acp", "--steps", "1"])
    assert "error: DCP is fine-tuned from softmax attention" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", "cpu-tiny", "--init-from", str(tmp_path / "nowhere"), "--steps", "1"])
    assert "is not a run or checkpoint folder" in capsys.readouterr().err


def test_model_options_that_fine_tuning_drops_are_named(source, tmp_path, capsys):
    """``--init-from`` fine-tunes the source's model: a model option it therefore drops (here
    the width) is named in a warning (it was dropped without a word); DCP's own are kept."""
    _finetune(source, tmp_path / "plain")
    assert "ignored" not in capsys.readouterr().err
    _finetune(source, tmp_path / "wide", "--model.d-model", "128")
    err = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(err) == 1 and err[0].startswith("warning: --init-from ")
    assert err[0].endswith("fine-tunes its model: ignored --model.d-model 128 (transformer has 64)"), err


def test_init_from_names_a_dropped_tokenizer_and_refuses_an_export(source, tmp_path, capsys):
    """``--tokenizer`` is the source's too (it was dropped without a word); an export folder is
    named as one (it "held no checkpoint")."""
    from lapse.eval import export_hf

    _finetune(source, tmp_path / "bpe", "--tokenizer", "bpe")
    err = [line for line in capsys.readouterr().err.splitlines() if "ignored --tokenizer bpe" in line]
    assert len(err) == 1, err
    export_hf(source, tmp_path / "exported")
    with pytest.raises(SystemExit):
        cli_main(["train", "cpu-tiny", "--init-from", str(tmp_path / "exported"), "--steps", "1"])
    assert "is a `lapse export` folder: give the run it was exported from" in capsys.readouterr().err
