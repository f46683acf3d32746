"""The trainer with its blocks replayed as CUDA graphs (``cuda_graphs``) against the
compiled blocks without them, on CUDA: the same curve through accumulation, validation
and ACP statistics steps. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lapse.train import read_metrics, train, train_preset

pytestmark = pytest.mark.gpu


def test_cuda_graphs_follow_the_compiled_curve(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    records = {}
    for name, graphs in (("compiled", False), ("graphs", True)):
        cfg = train_preset(
            "cpu-tiny", run_dir=tmp_path / name, data_dir=tmp_path / "data", device="cuda", steps=6,
            micro_batch_size=2, val_every=3, acp_stats_every=2, compile=True, cuda_graphs=graphs,
            progress=False,
        )
        records[name] = read_metrics(Path(train(cfg)["run_dir"]))

    def of(name: str, kind: str, key: str) -> list[float]:
        return [r[key] for r in records[name] if r["kind"] == kind]

    for kind, key in (("train", "loss"), ("val", "loss"), ("acp", "pruned")):
        a, b = of("compiled", kind, key), of("graphs", kind, key)
        print(kind, a, b)
        assert a and len(a) == len(b)
        # Same kernels, same order: equal up to float32 reassociation in the compiled graphs.
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), kind
