"""Loss streamed under an eviction policy (``lapse.eval.policy``), its KL and attention-mass
recall, and ``lapse eval policy-loss`` on the fixture run (cpu-tiny FoX (Pro), two steps)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lapse.cli import main
from lapse.eval.loss import per_position_loss
from lapse.eval.policy import streamed_loss
from lapse.generation import H2O, ACPBoundary, Dense, SinkWindow
from lapse.models import Decoder, preset

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = Path(__file__).parents[1] / "fixtures" / "before_restructure" / "run-fox-pro"
# Dense() streamed loss against the full forward, float32: measured 1.4e-6 (fox-pro),
# 1.9e-6 (fox-llama, transformer-llama) on CPU; 10x margin.
ATOL = 2e-5


def _model(arch: str, **overrides) -> Decoder:
    torch.manual_seed(0)
    return Decoder(preset("tiny", arch, init_std=0.1, **overrides)).eval()


def _windows(n: int = 3, length: int = 41) -> torch.Tensor:
    return torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", ["fox-pro", "fox-llama", "transformer-llama"])
def test_dense_streamed_loss_equals_the_full_forward(arch):
    model, windows, prefix = _model(arch), _windows(), 13
    r = streamed_loss(model, windows, Dense(), prefix=prefix, batch_size=2)
    full = per_position_loss(model, windows)[:, prefix:]  # [N, S]
    assert r.positions.tolist() == list(range(prefix, windows.shape[1] - 1))
    torch.testing.assert_close(r.loss, full, atol=ATOL, rtol=0)
    torch.testing.assert_close(r.dense_loss, full, atol=ATOL, rtol=0)
    assert r.kl.abs().max() == 0
    torch.testing.assert_close(r.recall, torch.ones_like(r.recall))
    torch.testing.assert_close(r.token_share, torch.ones_like(r.token_share), atol=1e-12, rtol=0)


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_a_lapse_model_streams_past_its_training_context(arch):
    """Under a policy a lapse model runs past ``max_seq_len`` as the dense path does (it was
    refused; the results mark such lengths as extrapolation), equal to the full forward."""
    model, windows, prefix = _model(arch, max_seq_len=16), _windows(2, 41), 13
    r = streamed_loss(model, windows, Dense(), prefix=prefix)
    torch.testing.assert_close(r.loss, per_position_loss(model, windows)[:, prefix:], atol=ATOL, rtol=0)


@torch.no_grad()
def _dense_attention(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """The attention probabilities ``[B, H, T, T]`` of a 1-layer FoX (LLaMA block: no
    QK-norm, no KV-shift, no RoPE), from the weights: ``softmax_j(scale q_i.k_j + c_i - c_j)``
    over ``j <= i``, ``c`` the cumulative log forget gate."""
    attn = model.blocks[0].attn
    x = model.blocks[0].attn_norm(model.embed(ids)).double()  # [B, T, C]
    b, t, _ = x.shape
    h, d = attn.n_heads, attn.head_dim
    q = (x @ attn.q_proj.weight.double().T).view(b, t, h, d)
    k = (x @ attn.k_proj.weight.double().T).view(b, t, h, d)
    c = F.logsigmoid(x @ attn.fgate.weight.double().T + attn.fgate.bias.double()).cumsum(1)  # [B, T, H]
    logits = attn.scale * torch.einsum("bihd,bjhd->bhij", q, k) + (c.transpose(1, 2)[..., :, None]
                                                                     - c.transpose(1, 2)[..., None, :])
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, T, T]


@pytest.mark.parametrize("sinks", [0, 2])
def test_window_recall_is_the_dense_mass_on_the_kept_positions(sinks):
    """Budget 0 plus a window of w (evicting before every step): the query at position p
    sees the last w positions before it and its own, plus the sinks; the recall is the
    dense attention mass there, computed from the weights."""
    model = _model("fox-llama", n_layers=1)
    windows, prefix, w = _windows(2, 33), 10, 5
    r = streamed_loss(model, windows, SinkWindow(sinks=sinks, window=w, every=1), prefix=prefix)
    probs = _dense_attention(model, windows[:, :-1])  # [B, H, T, T]
    expected = torch.empty(2, len(r.positions), dtype=torch.float64)
    for s, p in enumerate(r.positions.tolist()):
        kept = torch.zeros(p + 1, dtype=torch.bool)
        kept[max(0, p - w) :] = True
        kept[:sinks] = True
        expected[:, s] = probs[:, :, p, : p + 1][..., kept].sum(-1).mean(1)
    assert r.recall.shape == (2, 1, len(r.positions))
    torch.testing.assert_close(r.recall[:, 0].double(), expected, atol=1e-5, rtol=0)
    assert expected.max() < 0.999  # the case cuts mass, so the check has teeth


@pytest.mark.parametrize(
    "policy", [H2O(budget=6, recent=2, sinks=1), ACPBoundary(eps=0.5, every=1)], ids=["h2o", "acp"]
)
def test_policies_hold_less_and_report_kl_and_recall(policy):
    """H2O drops attended tokens; ACP drops only keys it proves carry less than eps of any
    later row (SPEC section 3), so its recall stays at least 1 - eps."""
    model = _model("fox-pro", max_seq_len=128)
    r = streamed_loss(model, _windows(2, 81), policy, prefix=40)
    assert (r.token_share < 1).all() and (r.kv_share < 1).all()
    assert (r.recall > 0).all() and (r.recall <= 1 + 1e-6).all()
    assert (r.kl >= 0).all() and torch.isfinite(r.loss).all()
    if isinstance(policy, ACPBoundary):
        assert r.recall.min() >= 1 - policy.eps
    else:
        assert r.recall.mean() < 0.99 and r.kl.mean() > 0


def test_bad_input_raises():
    fox, llama = _model("fox-pro"), _model("transformer-llama")
    with pytest.raises(ValueError, match="prefix"):
        streamed_loss(fox, _windows(), Dense(), prefix=40)
    with pytest.raises(ValueError, match="ACPBoundary needs forgetting attention"):
        streamed_loss(llama, _windows(), ACPBoundary(), prefix=10)
    with pytest.raises(ValueError, match="token ids"):
        streamed_loss(fox, _windows() + 1000, Dense(), prefix=10)


@pytest.fixture
def run(tmp_path):
    return shutil.copytree(RUN, tmp_path / "run")


def _cli(run: Path, tmp_path: Path, *extra: str) -> None:
    main(["eval", "policy-loss", str(run), "--seq-len", "40", "--prefix", "16", "--num-sequences", "2",
          "--data-dir", str(tmp_path / "data"), "--out-dir", str(tmp_path / "out"), "--no-progress", *extra])


def test_the_default_folder_is_the_policys_and_is_not_overwritten(run, tmp_path, capsys):
    """``eval/policy-loss-<policy>/``: two policies' runs went to one folder, the second over
    the first."""
    args = ["eval", "policy-loss", str(run), "--seq-len", "40", "--prefix", "16", "--num-sequences", "1",
            "--data-dir", str(tmp_path / "data"), "--no-progress"]
    main([*args, "--policy", "window", "--window", "8"])
    main([*args, "--policy", "h2o", "--budget", "8", "--recent", "4"])
    for policy in ("window", "h2o"):
        saved = json.loads((run / "eval" / f"policy-loss-{policy}" / "results.json").read_text())
        assert saved["policy"] == policy
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--policy", "h2o"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {run / 'eval' / 'policy-loss-h2o'} holds an earlier evaluation (results.json): "
                   "--overwrite replaces it, --out-dir writes elsewhere"]


def test_cli_round_trip(run, tmp_path, capsys):
    _cli(run, tmp_path, "--policy", "window", "--window", "8", "--sinks", "2", "--every", "4")
    out = tmp_path / "out"
    assert "wrote results.json" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["policy"] == "window" and results["prefix"] == 16 and results["num_sequences"] == 2
    assert len(results["loss"]) == len(results["dense_loss"]) == len(results["positions"]) == 40 - 16
    assert 0 < results["recall"] <= 1 and results["mean_kl"] >= 0 and results["token_share"] < 1
    summary = (out / "summary.md").read_text()
    assert "| window |" in summary and "attention-mass recall" in summary
    assert (out / "policy_loss.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("--policy", "h2o", "--budget", "0"), "--budget must be positive"),
        (("--policy", "h2o", "--budget", "-3"), "--budget must be positive"),
        (("--policy", "window", "--prefix", "40"), "--prefix (40) must be below --seq-len (40)"),
    ],
    ids=["budget-0", "budget-negative", "prefix"],
)
def test_cli_bad_input_is_one_line(run, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        _cli(run, tmp_path, *args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_cli_policy_that_does_not_fit_and_missing_run(tmp_path, capsys):
    from lapse.hf import LapseForCausalLM

    llama = tmp_path / "llama"
    LapseForCausalLM.from_decoder(_model("transformer-llama")).save_pretrained(llama)
    for path, message in ((llama, "ACPBoundary needs forgetting attention"),
                          (tmp_path / "nowhere", "does not exist")):
        with pytest.raises(SystemExit):
            main(["eval", "policy-loss", str(path), "--policy", "acp", "--seq-len", "40", "--prefix", "16",
                  "--out-dir", str(tmp_path / "out"), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bars
        assert err.startswith("error: ") and message in err, err


def test_a_dcp_model_streams_without_a_recall_and_refuses_score_policies():
    """DCP's layers record no attention scores: the recall is NaN (its dense reference kept
    zeros, and 0/0 gave NaN under every policy, even Dense), the loss still equals the full
    forward, and H2O, which would rank every token at 0, is refused."""
    from lapse.eval.policy import nan_to_none
    from lapse.generation import DCPDrop

    model = _model("transformer-llama", attention="dcp", acp=False, n_kv_heads=2)
    windows, prefix = _windows(2, 30), 10
    full = per_position_loss(model, windows)[:, prefix:]
    for policy in (Dense(), DCPDrop(), SinkWindow(sinks=1, window=8)):
        r = streamed_loss(model, windows, policy, prefix=prefix)
        assert torch.isnan(r.recall).all() and nan_to_none(r.recall.double().mean()) is None
        assert torch.isfinite(r.loss).all() and torch.isfinite(r.kl).all()
        if isinstance(policy, Dense):
            torch.testing.assert_close(r.loss, full, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="ranks tokens by their attention scores"):
        streamed_loss(model, windows, H2O(budget=8, recent=2, per="layer"), prefix=prefix)
