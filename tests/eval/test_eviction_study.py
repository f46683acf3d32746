"""The eviction study (``lapse eval eviction``) on the fixture FoX run: every variant at two
budgets on two prompt sets, one JSON each, the report over both, and bad input."""

from __future__ import annotations

import json

import pytest

from lapse.cli import main
from lapse.eval.eviction import EvictionStudyConfig, a2sf_vs_h2o, variants
from lapse.generation import A2SF, H2O, SinkWindow

pytestmark = pytest.mark.usefixtures("one_thread")


def test_variants_keep_the_same_tokens_per_head():
    cfg = EvictionStudyConfig(hf="x", budgets=(0.1, 0.5), alphas=(0.5, 0.9), prompt_len=100)
    got = variants(cfg)
    assert [v.label for v in got[:6]] == ["window", "h2o", "h2o-layer", "h2o-topk16", "a2sf-0.5", "a2sf-0.9"]
    for v in got:
        p = v.policy
        tokens = p.sinks + p.window if isinstance(p, SinkWindow) else p.budget
        assert tokens == round(v.budget * 100)
        if isinstance(p, A2SF):
            assert p.recent == tokens // 2 and p.every == (16 if v.label.startswith("h2o-topk") else 1)
    assert isinstance(got[1].policy, H2O) and got[2].policy.per == "layer"


def test_study_on_a_fox_run_writes_runs_and_report(fox_run, tmp_path):
    out = tmp_path / "study"
    args = [str(fox_run), "--families", "window", "h2o", "a2sf", "acp", "--budgets", "0.25", "0.5",
            "--alphas", "0.5", "--prompt-len", "32", "--steps", "6", "--num-sequences", "2",
            "--niah-trials", "0", "--out-dir", str(out)]
    main(["eval", "eviction", *args, "--set-name", "a"])
    main(["eval", "eviction", *args, "--set-name", "b", "--seed", "1"])
    runs = sorted(p.name for p in (out / "a").glob("*.json"))
    assert runs == ["a2sf-0.5-b0.25.json", "a2sf-0.5-b0.5.json", "acp-eps4.54e-05.json", "h2o-b0.25.json",
                    "h2o-b0.5.json", "window-b0.25.json", "window-b0.5.json"]
    r = json.loads((out / "a" / "h2o-b0.5.json").read_text())
    assert r["budget_tokens"] == 16 and 0 < r["recall"] <= 1 and r["mean_kl"] >= 0
    assert r["delta_loss"] == pytest.approx(r["mean_loss"] - r["dense_loss"])
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["sets"] == ["a", "b"] and len(verdict["comparisons"]) == 2 * 3  # 2 budgets x 3 measures
    summary = (out / "summary.md").read_text()
    assert "## ACP (no budget)" in summary and (out / "recall.png").exists()


def test_verdict_calls_ties_below_the_spread():
    def run(s, label, value):
        return {"set": s, "label": label, "budget": 0.1, "delta_loss": value}

    runs = [run("a", "h2o", 1.0), run("b", "h2o", 1.0), run("a", "a2sf-0.5", 0.5), run("b", "a2sf-0.5", 0.7)]
    (c,) = a2sf_vs_h2o(runs, ["a", "b"])["comparisons"]
    assert c["call"] == "a2sf" and c["spread"] == pytest.approx(0.2)  # mean -0.4, below zero in both
    runs[-1]["delta_loss"] = 1.05  # the sets disagree
    assert a2sf_vs_h2o(runs, ["a", "b"])["comparisons"][0]["call"] == "tie"
    one = a2sf_vs_h2o(runs[::2], ["a"])  # one set has no spread: a difference of 3e-8 was a call
    assert one["comparisons"][0]["call"] == "one set" and one["counts"]["one set"] == 1


def test_a_study_checks_every_family_first_and_keeps_to_one_model(fox_run, transformer_run, tmp_path,
                                                                 capsys):
    """A family that does not fit the model fails before any runs (window ran, then acp failed
    without a report); a second model's study into the same folder is refused (its numbers showed
    under the first model's name)."""
    import shutil

    out = tmp_path / "study"
    args = ["--budgets", "0.5", "--prompt-len", "32", "--steps", "4", "--num-sequences", "1",
            "--niah-trials", "0", "--out-dir", str(out)]
    with pytest.raises(SystemExit):
        main(["eval", "eviction", str(transformer_run), "--families", "window", "acp", *args])
    assert "ACP" in capsys.readouterr().err and not out.exists()
    main(["eval", "eviction", str(fox_run), "--families", "window", *args])
    assert "no call: one prompt set" in (out / "summary.md").read_text()
    other = tmp_path / "other"
    shutil.copytree(fox_run, other)
    for extra in ([], ["--prompt-len", "40"]):
        with pytest.raises(SystemExit):
            main(["eval", "eviction", str(other), "--families", "window", *args, *extra])
        assert "holds a study of" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "python").iterdir()) == ["window-b0.5.json"]


def test_bad_input():
    with pytest.raises(ValueError, match="budgets must be shares"):
        EvictionStudyConfig(hf="x", budgets=(0.0,))
    with pytest.raises(ValueError, match="at least 2 are needed"):
        EvictionStudyConfig(hf="x", budgets=(0.01,), prompt_len=100)
    with pytest.raises(ValueError, match="one of them"):
        EvictionStudyConfig()
