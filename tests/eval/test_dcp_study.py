"""``lapse eval dcp`` (the DCP study's report) on tiny runs made here: a 2-step Transformer
(LLaMA) and two 2-step DCP fine-tunes of it; the table, the plots and the drop pictures
are written, the numbers agree with the model, bad input fails in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lapse.cli import main as cli_main
from lapse.eval.common import load_model
from lapse.eval.dcp import DcpStudyConfig, dropped_at_last, evaluate, run_dcp_study

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dcp-study")
    data = ["--data-dir", str(root / "data"), "--corpus.max-bytes", "60000", "--seq-len", "32",
            "--device", "cpu"]
    cli_main(["train", "cpu-tiny", "--run-dir", str(root / "base"), "--model.arch", "transformer-llama",
              "--model.no-acp", "--steps", "2", "--val-every", "0", "--acp-stats-every", "0", *data])
    out = {"base": root / "base"}
    for gamma in ("0", "0.5"):
        out[gamma] = root / f"dcp-g{gamma}"
        cli_main(["train", "cpu-tiny", "--run-dir", str(out[gamma]), "--init-from", str(root / "base"),
                  "--model.attention", "dcp", "--model.no-acp", "--model.dcp-r", "8",
                  "--model.dcp-beta-init", "0.02", "--dcp.gamma", gamma, "--steps", "2", "--val-every", "2",
                  "--checkpoint-every", "0", *data])
    return out


def test_report_writes_the_table_plots_and_drops(runs, tmp_path):
    out = tmp_path / "report"
    cli_main(["eval", "dcp", str(runs["0.5"]), str(runs["0"]), "--base", str(runs["base"]),
              "--out-dir", str(out), "--num-sequences", "3", "--batch-size", "2", "--snippets", "2",
              "--snippet-tokens", "40", "--command", "pytest", "--commit", "abc1234", "--device", "cpu"])
    r = json.loads((out / "results.json").read_text())
    assert [x["gamma"] for x in r["runs"]] == [0.0, 0.5]  # sorted by gamma
    zero, half = r["runs"]
    assert zero["ppl_cost"] == 0.0 and half["ppl_cost"] == pytest.approx(half["ppl"] / zero["ppl"] - 1)
    for x in r["runs"]:
        assert x["ppl"] == pytest.approx(np.exp(x["loss"]))
        assert len(x["dropped_per_layer"]) == 2 and 0 <= x["dropped"] <= 1
        assert x["steps_done"] == 2 and x["alpha_final"] == 8.0 and x["train_val"]["step"] == 2
    assert half["dropped"] > 0  # beta 0.02: about half the pairs have z <= 0, so the products drop
    assert r["base"]["name"] == "base" and r["seq_len"] == 32 and r["unit"] == "nats per byte"
    assert r["commit"] == "abc1234" and r["command"] == "pytest" and r["shown"] == ["dcp-g0.5"]
    assert len(r["snippets"]) == 2
    for s in r["snippets"]:
        mask = np.array(s["models"]["dcp-g0.5"]["dropped"])
        assert mask.shape == (2, 40) and not mask[:, -1].any()  # a token never drops itself
        assert len(s["tokens"]) == 40 and s["text"]
    md = (out / "summary.md").read_text()
    assert "| 0.5 | 2/2 | 8.00 |" in md and "dense base (base)" in md and "`abc1234`" in md
    for name in ("ppl_vs_dropped.png", "dropped_per_layer.png", "drops_dcp-g0.5.png", "drops.html"):
        assert (out / name).stat().st_size > 0
    assert "snippet 1" in (out / "drops.html").read_text().lower()


def test_dropped_share_follows_beta(runs):
    """beta far above every logit keeps everything; far below drops every earlier token."""
    loaded = load_model(runs["0.5"])
    ids = torch.randint(0, 256, (2, 17))
    layers = [b.attn for b in loaded.model.blocks]
    for beta, share in ((1e4, 0.0), (-1e4, 1.0)):
        for layer in layers:
            layer.beta.data.fill_(beta)
        result = evaluate(loaded.model, ids, batch_size=1)
        assert result.dropped_per_layer == [share, share] and result.dropped_last_per_layer == [share, share]
        mask = dropped_at_last(loaded.model, ids[0])  # [L, T]
        assert mask[:, :-1].all() if share else not mask[:, :-1].any()
        assert not mask[:, -1].any()


def test_bad_input(runs, tmp_path):
    with pytest.raises(ValueError, match="not DCP"):
        run_dcp_study(DcpStudyConfig(runs=(runs["base"],), out_dir=tmp_path, snippets=0, device="cpu"))
    with pytest.raises(ValueError, match="share a gamma"):
        run_dcp_study(DcpStudyConfig(runs=(runs["0"], runs["0"]), out_dir=tmp_path, snippets=0,
                                     num_sequences=1, device="cpu"))
    with pytest.raises(ValueError, match="run folder does not exist"):
        DcpStudyConfig(runs=(tmp_path / "nowhere",), out_dir=tmp_path)
    with pytest.raises(SystemExit):
        cli_main(["eval", "dcp", str(runs["0"]), "--out-dir", str(tmp_path), "--show", "3"])


def test_snippets_fit_the_window_and_a_foreign_base_is_warned_of(runs, tmp_path, capsys):
    """The snippets take the window's length by default (a fixed 480 tokens would run past a
    context of 32); a --base the runs were not fine-tuned from is warned of."""
    out = tmp_path / "report"
    args = ["eval", "dcp", str(runs["0.5"]), "--out-dir", str(out), "--num-sequences", "2",
            "--batch-size", "2", "--snippets", "1", "--device", "cpu"]
    cli_main(args + ["--base", str(runs["base"])])
    assert "fine-tuned from" not in capsys.readouterr().err
    r = json.loads((out / "results.json").read_text())
    assert len(r["snippets"][0]["tokens"]) == 32
    cli_main(args + ["--base", str(runs["0"])])
    assert "dcp-g0.5 was fine-tuned from" in capsys.readouterr().err


def test_runs_that_cannot_be_compared_are_refused_before_any_evaluation(runs, tmp_path, monkeypatch):
    """Another tokenizer (the first run's windows would be fed to it as its own tokens: a wrong
    loss, or a crash in the plots after everything was evaluated), another depth, or a --show
    gamma no run has: refused before the first evaluation."""
    from lapse.data.tokenizer import ByteTokenizer
    from lapse.eval import dcp

    class OtherBytes(ByteTokenizer):
        def encode(self, text):
            return [min(b + 1, 255) for b in super().encode(text)]

    def never(*a, **k):
        raise AssertionError("evaluated before the checks")

    monkeypatch.setattr(dcp, "evaluate", never)
    plain = dcp.load_model

    def other_tokenizer(path, **kw):
        loaded = plain(path, **kw)
        if Path(path) == runs["0.5"]:
            loaded.tokenizer = OtherBytes()
        return loaded

    monkeypatch.setattr(dcp, "load_model", other_tokenizer)
    with pytest.raises(ValueError, match="use different tokenizers"):
        run_dcp_study(DcpStudyConfig(runs=(runs["0"], runs["0.5"]), out_dir=tmp_path, snippets=0,
                                     num_sequences=1, device="cpu"))
    with pytest.raises(ValueError, match="use different tokenizers"):  # --base's loss uses the windows too
        run_dcp_study(DcpStudyConfig(runs=(runs["0"],), base=runs["0.5"], out_dir=tmp_path, snippets=0,
                                     num_sequences=1, device="cpu"))

    def deeper(path, **kw):
        loaded = plain(path, **kw)
        if Path(path) == runs["0.5"]:
            loaded.model.config.n_layers += 1
        return loaded

    monkeypatch.setattr(dcp, "load_model", deeper)
    with pytest.raises(ValueError, match="the study compares runs of one model"):
        run_dcp_study(DcpStudyConfig(runs=(runs["0"], runs["0.5"]), out_dir=tmp_path, snippets=0,
                                     num_sequences=1, device="cpu"))
    monkeypatch.setattr(dcp, "load_model", plain)
    with pytest.raises(ValueError, match="show names gammas"):
        run_dcp_study(DcpStudyConfig(runs=(runs["0"], runs["0.5"]), out_dir=tmp_path, snippets=0,
                                     num_sequences=1, device="cpu", show=(3.0,)))


def test_a_second_study_in_one_folder_leaves_none_of_the_first_ones_drawings(runs, tmp_path, capsys):
    first = run_dcp_study(DcpStudyConfig(runs=(runs["0"], runs["0.5"]), out_dir=tmp_path, snippets=1,
                                         num_sequences=1, device="cpu", show=(0.0, 0.5)))
    assert {f"drops_{n}.png" for n in first["shown"]} <= {p.name for p in tmp_path.iterdir()}
    capsys.readouterr()
    second = run_dcp_study(DcpStudyConfig(runs=(runs["0.5"],), out_dir=tmp_path, snippets=1, num_sequences=1,
                                          device="cpu", show=(0.5,)))
    assert "replacing the earlier study" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("drops_*.png")) == [f"drops_{n}.png" for n in second["shown"]]
