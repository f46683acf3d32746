"""The trainer with its blocks replayed as CUDA graphs (``cuda_graphs``) against the
compiled blocks without them, on CUDA: the same curve through accumulation, validation
and ACP statistics steps; with activation checkpointing; for the Transformer (RoPE); and
for a DCP fine-tune (its sparsity term read from the layers after each forward). Skipped
without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lapse.models import preset
from lapse.train import read_metrics, train, train_preset
from lapse.train.config import DCPTrainConfig

pytestmark = pytest.mark.gpu


def _curves(root: Path, **overrides) -> dict[str, list[dict]]:
    records = {}
    for name, graphs in (("compiled", False), ("graphs", True)):
        cfg = train_preset(
            "cpu-tiny", run_dir=root / name, data_dir=root.parent / "data", device="cuda", steps=6,
            micro_batch_size=2, val_every=3, compile=True, cuda_graphs=graphs, progress=False,
            **{"acp_stats_every": 2, **overrides},
        )
        records[name] = read_metrics(Path(train(cfg)["run_dir"]))
    return records


def _same(records: dict[str, list[dict]], kinds: tuple[tuple[str, str], ...]) -> None:
    def of(name: str, kind: str, key: str) -> list[float]:
        return [r[key] for r in records[name] if r["kind"] == kind]

    for kind, key in kinds:
        a, b = of("compiled", kind, key), of("graphs", kind, key)
        print(kind, key, a, b)
        assert a and len(a) == len(b)
        # Same kernels, same order: equal up to float32 reassociation in the compiled graphs.
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), kind


@pytest.mark.parametrize("case", ["fox-pro", "checkpointing", "transformer"])
def test_cuda_graphs_follow_the_compiled_curve(tmp_path, case):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    overrides = {
        "fox-pro": {},
        "checkpointing": {"activation_checkpointing": True},
        "transformer": {"model": preset("tiny", "transformer-pro", vocab_size=320, max_seq_len=64),
                        "acp_stats_every": 0},
    }[case]
    kinds = (("train", "loss"), ("val", "loss")) + ((("acp", "pruned"),) if case != "transformer" else ())
    _same(_curves(tmp_path / case, **overrides), kinds)


def test_cuda_graphs_follow_the_compiled_dcp_finetune(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    source = tmp_path / "transformer"
    shape = dict(vocab_size=320, max_seq_len=64)
    train(train_preset(
        "cpu-tiny", run_dir=source, data_dir=tmp_path / "data", device="cuda", steps=2, val_every=0,
        acp_stats_every=0, progress=False, model=preset("tiny", "transformer-llama", **shape),
    ))
    dcp = preset("tiny", "transformer-llama", **shape, attention="dcp", dcp_r=8)

    records = _curves(
        tmp_path / "dcp", init_from=str(source), model=dcp, acp_stats_every=0,
        dcp=DCPTrainConfig(gamma=0.5, alpha_start=1.0, alpha_end=8.0),
    )
    _same(records, (("train", "loss"), ("train", "sparsity"), ("val", "loss")))
