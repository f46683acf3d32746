"""Loading models for evaluation, and evaluation windows."""

from __future__ import annotations

import pytest
import torch

from lapse.eval import eval_windows, export_hf, load_model
from lapse.train import latest_checkpoint


def test_load_run_folder_checkpoint_folder_and_hf_folder(fox_run, tmp_path):
    a = load_model(fox_run)
    b = load_model(latest_checkpoint(fox_run))
    ids = torch.randint(0, 258, (1, 33))
    la, lb = a.model(ids)[0], b.model(ids)[0]
    assert torch.equal(la, lb) and a.tokenizer is not None and a.name == "run"
    export_hf(fox_run, tmp_path / "hf")
    c = load_model(tmp_path / "hf")
    assert torch.equal(c.model(ids)[0], la) and c.tokenizer is not None
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(auto(ids).logits, la)
    d = load_model(fox_run, acp=False, attn_backend="naive")
    assert not d.config.acp
    torch.testing.assert_close(d.model(ids)[0], la, atol=1e-5, rtol=0)  # T=33: ACP prunes nothing


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="no lapse model"):
        load_model(tmp_path)


def test_eval_windows_are_deterministic(fox_run):
    m = load_model(fox_run)
    w1 = eval_windows(m, 48, 3, seed=1)
    w2 = eval_windows(m, 48, 3, seed=1)
    w3 = eval_windows(m, 48, 3, seed=2)
    assert w1.shape == (3, 49) and w1.dtype == torch.int64
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)
