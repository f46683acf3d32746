"""``lapse eval acp``: ACP statistics two ways, the capture hooks, the files, determinism."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lapse.eval.acp import (
    AcpEvalConfig,
    _bimodality_coefficient,
    capture_heads,
    direct_pruned_fraction,
    direct_tile_pruning,
    gate_sums,
    run_acp,
)
from lapse.eval.common import load_model
from lapse.ops import forgetting_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(t: int, hq: int, h: int, seed: int):
    """Random q, k, v and gates with a head of each kind: no decay, strong decay, mild
    decay, and gates of 1 with a few hard resets (a sharp staircase)."""
    g = torch.Generator().manual_seed(seed)
    b, d = 2, 24
    q, k, v = (torch.randn(b, t, n, d, generator=g) for n in (hq, h, h))
    logits = torch.randn(b, t, hq, generator=g)
    centre = torch.tensor([8.0, -0.5, 2.0, 12.0])[:hq]
    log_f = torch.nn.functional.logsigmoid(logits + centre)  # [B, T, HQ]
    log_f[:, t // 3, -1] = -40.0
    log_f[:, (3 * t) // 4, -1] = -25.0
    return q, k, v, log_f


@pytest.mark.parametrize("bound", ["auto", "float", "tensor"])
@pytest.mark.parametrize("t,hq,h", [(200, 4, 4), (257, 4, 2), (192, 4, 4)], ids=lambda x: str(x))
def test_op_boundary_agrees_with_a_direct_tile_check_of_d(t, hq, h, bound):
    """The op's boundary indices (``AttentionStats``) against tile-by-tile maxima of ``D``
    with ``delta = -2U - log T + log eps`` written here from SPEC section 3."""
    q, k, v, log_f = _problem(t, hq, h, seed=t + hq)
    scale, eps = 1 / math.sqrt(q.shape[-1]), math.exp(-10)
    q64, k64 = q.double(), k.double().repeat_interleave(hq // h, dim=2)  # [B, T, HQ, D]
    logits = torch.einsum("bihd,bjhd->bhij", q64, k64) * scale  # [B, HQ, T, T]
    largest = logits.abs().amax((0, 2, 3))  # [HQ] max |scale q.k|: every bound must cover it
    if bound == "auto":
        u = q64.norm(dim=-1).amax(1) * k64.norm(dim=-1).amax(1) * scale  # [B, HQ]
        acp = "auto"
    elif bound == "float":
        acp = float(largest.max()) + 0.5
        u = torch.full((2, hq), acp, dtype=torch.float64)
    else:
        acp = (largest + torch.linspace(0.0, 2.0, hq, dtype=torch.float64)).float()  # [HQ]
        u = acp.double()[None].expand(2, hq)
    _, stats = forgetting_attention(q, k, v, log_f, acp=acp, acp_eps=eps, return_stats=True, backend="torch")
    c = torch.cumsum(log_f.double(), dim=1)  # [B, T, HQ]
    pruned_any = kept_any = False
    for bi in range(2):
        for hi in range(hq):
            delta = -2 * float(u[bi, hi]) - math.log(t) + math.log(eps)
            mask = direct_tile_pruning(c[bi, :, hi], delta)  # [M, N]
            assert torch.equal(mask.sum(1), stats.block_start[bi, hi].long()), (bi, hi)
            assert direct_pruned_fraction(mask, t=t) == pytest.approx(
                float(stats.pruned_fraction[bi, hi]), abs=1e-6
            )
            # the guarantee itself: every weight in a pruned tile is below eps / T
            d = c[bi, :, hi, None] - c[bi, None, :, hi]  # [T, T]
            s = (logits[bi, hi] + d).masked_fill(torch.ones(t, t).triu(1).bool(), -math.inf)
            a = torch.softmax(s, dim=-1)  # [T, T]
            pruned_pairs = mask.repeat_interleave(64, 0).repeat_interleave(64, 1)[:t, :t]
            assert float(torch.where(pruned_pairs, a, 0.0).max()) < eps / t
            pruned_any |= bool(mask.any())
            kept_any |= bool((~mask).tril(-1).any())
    assert pruned_any and kept_any  # the problem exercises both sides of the boundary


def test_capture_hooks_read_what_the_op_receives(fox_run, monkeypatch):
    import lapse.layers.forgetting as forgetting_layer

    seen = []
    real = forgetting_layer.forgetting_attention

    def spy(q, k, v, log_fgate, **kwargs):
        seen.append((q.detach().clone(), k.detach().clone(), log_fgate.detach().clone()))
        return real(q, k, v, log_fgate, **kwargs)

    monkeypatch.setattr(forgetting_layer, "forgetting_attention", spy)
    model = load_model(fox_run).model
    ids = torch.randint(0, 258, (2, 130), generator=torch.Generator().manual_seed(0))
    heads = [(0, 1), (1, 3), (1, 0)]
    with capture_heads(model, heads) as got, gate_sums(model) as (sums, counts), torch.no_grad():
        model(ids)
    group = model.config.n_heads // model.config.kv_heads
    for layer, head in heads:
        q, k, g = seen[layer]
        torch.testing.assert_close(got[(layer, head)]["q"], q[0, :, head], rtol=0, atol=0)
        torch.testing.assert_close(got[(layer, head)]["k"], k[0, :, head // group], rtol=0, atol=0)
        torch.testing.assert_close(got[(layer, head)]["log_fgate"], g[0, :, head], rtol=0, atol=0)
    torch.testing.assert_close(sums, torch.stack([s[2].double().sum((0, 1)) for s in seen]))
    assert counts[0] == 2 * 130


@pytest.fixture(scope="module")
def acp_eval(fox_run, tmp_path_factory):
    cfg = AcpEvalConfig(
        model=fox_run, seq_len=200, num_sequences=3, batch_size=2, seed=1,
        eps=(math.exp(-1), math.exp(-20)), out_dir=tmp_path_factory.mktemp("acp") / "a",
        device="cpu", progress=False,
    )
    return cfg, run_acp(cfg)


def test_fox_run_writes_every_file(acp_eval):
    cfg, r = acp_eval
    names = {"results.json", "summary.md", "heads.png", "layers.png", "eps.png"}
    names |= {m["file"] for m in r["maps"]}
    assert names <= {p.name for p in cfg.out_dir.iterdir()}
    assert len(r["maps"]) >= 1 and all(m["file"].startswith("head_L") for m in r["maps"])
    n_layers, n_heads = 2, 4
    assert np.array(r["pruned_per_head"]).shape == (n_layers, n_heads)
    assert sum(r["histogram"]) == n_layers * n_heads == r["local_heads"] + r["global_heads"]
    assert 0 <= r["pruned_fraction"] <= r["max_pruned_fraction"] < 1
    for m in r["maps"]:
        assert m["boundary_agrees"], m
        assert m["op_pruned_fraction"] == pytest.approx(m["direct_pruned_fraction"], abs=1e-6)
    summary = (cfg.out_dir / "summary.md").read_text()
    assert "![per-head pruning](heads.png)" in summary and "![effect of eps](eps.png)" in summary
    assert json.loads((cfg.out_dir / "results.json").read_text())["seq_len"] == 200


def test_eps_sweep_includes_the_models_eps_and_prunes_more_with_larger_eps(acp_eval):
    _, r = acp_eval
    rows = r["eps_sweep"]
    assert [row["eps"] for row in rows] == pytest.approx([math.exp(-1), math.exp(-10), math.exp(-20)])
    assert rows[0]["pruned"] >= rows[1]["pruned"] >= rows[-1]["pruned"]
    assert rows[0]["pruned"] > 0
    for row in rows:
        assert math.isfinite(row["loss"])
        assert row["loss_change"] == pytest.approx(row["loss"] - r["dense_loss"])
    # with eps = e^-20 nothing that matters is pruned: the loss is that of ACP off
    assert abs(rows[-1]["loss_change"]) < 1e-4


def test_same_seed_same_results(acp_eval, tmp_path):
    cfg, r = acp_eval
    again = run_acp(AcpEvalConfig(**{**cfg.__dict__, "out_dir": tmp_path / "b"}))
    strip = lambda d: {k: v for k, v in d.items() if k != "elapsed_s"}  # noqa: E731
    assert strip(again) == strip(r)


def test_an_earlier_evaluation_is_replaced_only_with_overwrite(acp_eval, tmp_path):
    """It was replaced without a word; with ``overwrite`` the maps of heads the new one does not
    draw go too (the new summary does not show them)."""
    import shutil

    cfg, r = acp_eval
    with pytest.raises(ValueError, match=f"^{cfg.out_dir} holds an earlier evaluation \\(results.json\\): "
                       "--overwrite replaces it"):
        run_acp(cfg)
    out = shutil.copytree(cfg.out_dir, tmp_path / "a")
    (out / "head_L9_H9.png").write_bytes(b"\x89PNG an earlier map")
    again = run_acp(AcpEvalConfig(**{**cfg.__dict__, "out_dir": out, "overwrite": True}))
    assert {p.name for p in out.glob("head_*.png")} == {m["file"] for m in again["maps"]}


def test_chosen_heads_and_errors(fox_run, tmp_path, monkeypatch):
    import lapse.eval.acp as acp
    from lapse.hf import LapseConfig, LapseForCausalLM
    from lapse.models import preset

    transformer = tmp_path / "transformer"
    LapseForCausalLM(LapseConfig.from_model_config(preset("tiny", "transformer-llama"))).save_pretrained(
        transformer
    )
    with pytest.raises(ValueError, match="forget gate"):
        run_acp(AcpEvalConfig(model=transformer, seq_len=128, progress=False))
    with pytest.raises(ValueError, match="does not exist"):
        run_acp(AcpEvalConfig(model=fox_run, seq_len=128, heads=((5, 0),), progress=False))
    with pytest.raises(ValueError, match="does not exist"):
        run_acp(AcpEvalConfig(model=tmp_path / "nope", seq_len=128, progress=False))
    with pytest.raises(ValueError, match="above 64"):
        AcpEvalConfig(model=fox_run, seq_len=64)
    with pytest.raises(ValueError, match=r"above 64 .* got the model's training context, 64; .*--seq-len"):
        run_acp(AcpEvalConfig(model=fox_run, progress=False))  # the run's own context is 64
    with pytest.raises(ValueError, match=r"eps must be in \(0, 1\)"):
        AcpEvalConfig(model=fox_run, eps=(0.5, 1.0))
    with pytest.raises(ValueError, match="pairs"):
        AcpEvalConfig(model=fox_run, heads=((0, 1, 2),))
    for name in ("_plot_heads", "_plot_layers", "_plot_eps"):  # drawn in test_fox_run_writes_every_file
        monkeypatch.setattr(acp, name, lambda r, path: path.name)
    r = run_acp(AcpEvalConfig(model=fox_run, seq_len=130, num_sequences=1, heads=((1, 2),), eps=(),
                              out_dir=tmp_path / "one", progress=False))
    assert [(m["layer"], m["head"]) for m in r["maps"]] == [(1, 2)] and len(r["eps_sweep"]) == 1
    assert (tmp_path / "one" / "head_L1_H2.png").exists()


def test_fox_llama_with_the_bound_from_data(fox_run, eval_data_dir, tmp_path, monkeypatch):
    """FoX (LLaMA) has no QK-norm: the op takes U from the largest query and key norms of
    each sequence (``acp="auto"``), and the drawn heads' boundaries must still agree."""
    import lapse.eval.acp as acp
    from lapse.data import CorpusConfig
    from lapse.hf import LapseConfig, LapseForCausalLM
    from lapse.models import preset

    llama = tmp_path / "fox-llama"
    config = preset("tiny", "fox-llama", vocab_size=320, max_seq_len=64)
    torch.manual_seed(0)  # the untrained weights: gates near 1/2, local heads that ACP prunes
    LapseForCausalLM(LapseConfig.from_model_config(config)).save_pretrained(llama)
    load_model(fox_run).tokenizer.save(llama / "tokenizer")
    for name in ("_plot_heads", "_plot_layers", "_plot_eps", "_plot_head_map"):
        monkeypatch.setattr(acp, name, lambda *args: args[-1].name)
    r = run_acp(AcpEvalConfig(
        model=llama, seq_len=257, num_sequences=2, eps=(), progress=False, data_dir=eval_data_dir,
        corpus=CorpusConfig(max_bytes=200_000), out_dir=tmp_path / "out",
    ))
    assert r["acp_bound"].startswith("data") and len(r["maps"]) == 2
    for m in r["maps"]:
        assert m["boundary_agrees"] and m["op_pruned_fraction"] > 0, m


def test_bimodality_coefficient_separates_two_modes_from_one():
    rng = np.random.default_rng(0)
    two = np.concatenate([rng.normal(0.05, 0.02, 50), rng.normal(0.9, 0.03, 50)])
    one = rng.normal(0.5, 0.1, 100)
    assert _bimodality_coefficient(two) > 5 / 9 > _bimodality_coefficient(one)
    assert _bimodality_coefficient(np.zeros(10)) is None
