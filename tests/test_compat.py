"""What lapse wrote before the architecture restructure still loads and computes
the same function: Hugging Face exports whose config names an ``arch`` (no attention or
block kind), and a training run folder. The fixtures were written by commit 16874c5
(tests/fixtures/before_restructure/README.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "before_restructure"


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_hf_export_from_before_loads_with_the_same_logits(arch):
    """The same function up to float32 rounding, which differs between CPUs (the fixtures'
    machine and an AVX-512 one here give different bits for FoX too, which has no
    positional table). RoPE's cos/sin now come from a float64 table (before: angles
    computed in float32 per call). Measured on these logits against the same model run in
    float64: transformer-llama 2.34e-6 saved, 2.36e-6 now, 1.67e-6 between the two;
    fox-pro 1.99e-6 saved, 2.04e-6 now, 1.79e-6 between the two (AVX-512). Allowed 5e-6,
    about 2x the float32 computation's own error."""
    from transformers import AutoModelForCausalLM

    import lapse.hf  # noqa: F401  (registers the Auto classes)

    saved = load_file(FIXTURES / "logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / f"hf-{arch}").eval()
    assert model.model.config.name == arch
    with torch.no_grad():
        logits = model(saved["ids"]).logits
    torch.testing.assert_close(logits, saved[f"logits-{arch}"], atol=5e-6, rtol=0)


def test_run_folder_from_before_loads(tmp_path):
    from lapse.eval.common import load_model

    run = shutil.copytree(FIXTURES / "run-fox-pro", tmp_path / "run")
    loaded = load_model(run)
    assert loaded.config.name == "fox-pro" and loaded.config.attention == "forgetting"
    ids = torch.randint(0, loaded.config.vocab_size, (1, 16))
    with torch.no_grad():
        logits, _ = loaded.model(ids)
    assert torch.isfinite(logits).all()


def test_run_folder_from_before_resumes(tmp_path):
    """``lapse resume`` continues a run written before the restructure (a checkpoint with
    no manifest, a config whose model names an ``arch``) for two more steps."""
    from lapse.train import resume

    run = shutil.copytree(FIXTURES / "run-fox-pro", tmp_path / "run")
    summary = resume(run, steps=4, progress=False)
    assert summary["step"] == 4
