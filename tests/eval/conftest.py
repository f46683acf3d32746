"""Shared fixtures of the evaluation tests: small models trained once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lapse.train import train, train_preset


@pytest.fixture(scope="session")
def eval_data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval-data")


def _trained(tmp_path_factory, data_dir: Path, name: str, **overrides) -> Path:
    run = tmp_path_factory.mktemp(name) / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add barrier stalls on a shared CPU
    try:
        train(train_preset("cpu-tiny", run_dir=run, data_dir=data_dir, steps=40, val_every=0,
                           acp_stats_every=0, checkpoint_every=0, **overrides))
    finally:
        torch.set_num_threads(threads)
    return run


@pytest.fixture(scope="session")
def fox_run(tmp_path_factory, eval_data_dir) -> Path:
    """A run folder: FoX (Pro) ``tiny`` with ACP (2 x 64, byte vocabulary, context 64),
    trained 40 steps on the local Python sources (a few seconds)."""
    return _trained(tmp_path_factory, eval_data_dir, "fox")


@pytest.fixture(scope="session")
def transformer_run(tmp_path_factory, eval_data_dir) -> Path:
    """The same as :func:`fox_run` for a Transformer (LLaMA)."""
    from lapse.models import preset

    model = preset("tiny", "transformer-llama", vocab_size=320, max_seq_len=64)
    return _trained(tmp_path_factory, eval_data_dir, "transformer", model=model)
