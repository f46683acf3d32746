"""``lapse bench decode`` as a CPU dry run: the table's rows and keys, policies over the
paged store, a trained run instead of a preset (timings on a CPU mean nothing; the GPU
figures are in BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lapse.bench.decode import DecodeBenchConfig, run

RUN = Path(__file__).parents[1] / "fixtures" / "before_restructure" / "run-fox-pro"
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(tmp_path, **kw) -> DecodeBenchConfig:
    base = dict(
        preset="tiny",
        archs=("fox-pro",),
        workloads=("2x24",),
        providers=("lapse",),
        steps=2,
        warmup=1,
        every=2,
        dtype="float32",
        device="cpu",
        bandwidth=1e11,
        out_dir=tmp_path,
        commit="test",
    )
    return DecodeBenchConfig(**{**base, **kw})


def test_dry_run_writes_rows_for_every_policy(tmp_path, monkeypatch):
    import lapse.bench.decode as bench

    monkeypatch.setattr(
        bench, "compiled_decode_one_token", lambda: bench.decode_one_token
    )  # no CUDA graphs on CPU
    results = run(
        _cfg(
            tmp_path,
            workloads=("2x96",),
            policies=("dense", "window", "acp", "h2o", "a2sf"),
            window=8,
            budget=0.5,
        )
    )
    (row,) = results["rows"]
    assert row["arch"] == "fox-pro" and row["lapse"] > 0 and row["limit"] > 0
    for policy in ("dense", "window", "acp", "h2o", "a2sf"):
        assert row[f"paged-{policy}"] > 0 and 0 < row[f"kv-{policy}"] <= 1.2
    assert row["kv-h2o"] < row["kv-dense"] and row["kv-window"] < row["kv-dense"]
    assert json.loads((tmp_path / "results.json").read_text())["env"]["commit"] == "test"
    assert "fox-pro" in (tmp_path / "results.md").read_text()


def test_a_trained_run_replaces_the_preset(tmp_path):
    results = run(_cfg(tmp_path, run=RUN, workloads=("1x40",)))
    (row,) = results["rows"]
    assert row["arch"].endswith("(run-fox-pro)") and results["env"]["run"] == str(RUN)
    assert f"trained run {RUN}" in (tmp_path / "results.md").read_text()
    with pytest.raises(FileNotFoundError, match="is not a run folder"):
        run(_cfg(tmp_path, run=tmp_path / "nope"))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="unknown providers"):
        DecodeBenchConfig(providers=("vllm",))
    with pytest.raises(ValueError, match="a workload is BxT"):
        DecodeBenchConfig(workloads=("8-4096",))
