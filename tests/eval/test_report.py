"""lapse report: one page from runs and their evaluations."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from lapse.eval.report import ReportConfig, build_report


def test_report_gathers_runs_and_relinks_images(fox_run, transformer_run, tmp_path):
    runs = []
    for name, src in (("fox", fox_run), ("transformer", transformer_run)):
        run = tmp_path / name
        shutil.copytree(src, run)
        shutil.rmtree(run / "eval", ignore_errors=True)  # other tests evaluate the shared runs
        runs.append(run)
    page = runs[0] / "eval" / "niah"
    page.mkdir(parents=True)
    (page / "grid.png").write_bytes(b"\x89PNG fake")
    (page / "summary.md").write_text("# Needle\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n![grid](grid.png)\n")
    out = build_report(ReportConfig(runs=tuple(runs), out=tmp_path / "reports" / "cmp.md"))
    text = out.read_text()
    assert "| fox | fox-pro |" in text and "| transformer | transformer-llama |" in text
    assert "#### Needle" in text  # demoted under "### niah" under "## fox"
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(links) == 3  # two training plots and the evaluation's grid
    for link in links:
        assert (out.parent / link).resolve().exists(), link
    assert "No evaluations yet" in text  # the transformer run has none


def test_report_errors_and_default_path(fox_run, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ReportConfig(runs=(tmp_path / "nope",))
    # a folder that is no training run (an evaluation's, a checkpoint's): it wrote a bogus page
    for folder in (tmp_path, next(fox_run.glob("checkpoint-*"))):
        with pytest.raises(ValueError, match="is not a training run"):
            ReportConfig(runs=(folder,))
    run = tmp_path / "r"
    shutil.copytree(fox_run, run)
    assert build_report(ReportConfig(runs=(run,))) == run / "eval" / "report.md"
    assert Path(run / "eval" / "report.md").exists()


def test_a_run_that_failed_before_its_first_step_shows_its_model(fox_run, tmp_path):
    """Without summary.json (a run that failed in its set-up) the table takes the architecture
    and ACP from config.json; it showed ``-``, ``0.00M`` and "off"."""
    run = tmp_path / "failed"
    run.mkdir()
    shutil.copy(fox_run / "config.json", run / "config.json")
    text = build_report(ReportConfig(runs=(run,), out=tmp_path / "r.md")).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| failed |"))
    assert row.startswith("| failed | fox-pro | - | on |"), row


def test_an_evaluation_under_a_policy_is_headed_as_such(fox_run, tmp_path):
    """Its folder's results.json names the policy (``config.policy``; lm-eval's ``lapse.policy``),
    also in a folder named as the plain one by an older lapse: it showed as the model's result."""
    run = tmp_path / "run"
    shutil.copytree(fox_run, run, ignore=shutil.ignore_patterns("eval"))
    pages = {
        "ppl": {"config": {"policy": None}},
        "ppl-h2o": {"config": {"policy": "h2o"}, "policy": "H2O(budget=0.2)"},
        "niah": {"config": {"policy": "window"}},  # written under a policy before the folders split
        "lm-eval-acp": {"config": {"policy": "ACPBoundary(eps=4.5e-05)"}, "lapse": {"policy": "acp"}},
        "acp": {"config": {"eps": [0.1]}},
    }
    for name, results in pages.items():
        (run / "eval" / name).mkdir(parents=True)
        (run / "eval" / name / "results.json").write_text(json.dumps(results))
        (run / "eval" / name / "summary.md").write_text(f"# {name}\n")
    text = build_report(ReportConfig(runs=(run,))).read_text()
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert headings == [
        "### acp",
        "### lm-eval-acp: under the eviction policy `acp`",
        "### niah: under the eviction policy `window`",
        "### ppl",
        "### ppl-h2o: under the eviction policy `h2o`",
    ]
