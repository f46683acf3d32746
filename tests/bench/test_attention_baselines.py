"""``lapse bench attention``'s softmax baselines and ratios:
the ratios are taken against the fastest softmax baseline that ran, per mode, and the
header names it; the SDPA providers run on CPU where SDPA has a CPU kernel (default,
flash) and are reported n/a with SDPA's reason where it has none (efficient, cuDNN)."""

from __future__ import annotations

import shlex
import sys
import types

import pytest
import torch
import tyro

from lapse.bench import attention as bench
from lapse.bench.attention import SOFTMAX_BASELINES, AttentionBenchConfig
from lapse.bench.workloads import WorkloadSpec, make_workload

pytestmark = pytest.mark.usefixtures("one_thread")


def _timed(fwd: float | None, fwd_bwd: float | None) -> dict:
    row: dict = {"notes": []}
    for mode, ms in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        row[mode] = {"error": "RuntimeError: no kernel"} if ms is None else {"ms": ms}
    return row


def _result(**rows: dict) -> dict:
    return {"providers": {name.replace("_", "-"): row for name, row in rows.items()}}


def test_ratios_use_the_fastest_baseline_of_each_mode():
    result = _result(
        lapse=_timed(3.0, 12.0),
        lapse_acp={**_timed(1.5, 5.0), "pruned": 0.6},
        sdpa_default=_timed(2.0, 7.0),
        sdpa_flash=_timed(2.5, 10.0),
        sdpa_efficient={"notes": [], "error": "NotAvailable: sdpa-efficient: SDPA refused"},
        sdpa_cudnn=_timed(1.9, None),  # fastest forward, its backward failed
    )
    bench._derive(result)
    assert result["fastest_softmax"] == {
        "fwd": {"provider": "sdpa-cudnn", "ms": 1.9},
        "fwd+bwd": {"provider": "sdpa-default", "ms": 7.0},
    }
    rows = result["providers"]
    assert rows["lapse"]["fwd"]["vs_fastest"] == pytest.approx(3.0 / 1.9)
    assert rows["lapse"]["fwd+bwd"]["vs_fastest"] == pytest.approx(12.0 / 7.0)
    assert rows["sdpa-default"]["fwd+bwd"]["vs_fastest"] == 1.0
    assert rows["lapse"]["fwd+bwd"]["vs_sdpa_flash"] == pytest.approx(12.0 / 10.0)
    assert "vs_fastest" not in rows["sdpa-cudnn"]["fwd+bwd"]
    assert rows["lapse-acp"]["fwd+bwd"]["efficiency"] == pytest.approx(12.0 * 0.4 / 5.0)

    table = bench.markdown_table(result, ("fwd", "fwd+bwd"))
    header = table.splitlines()[0]
    assert "fwd x fastest softmax (sdpa-cudnn)" in header
    assert "fwd+bwd x fastest softmax (sdpa-default)" in header
    lapse_cells = next(line for line in table.splitlines() if line.startswith("| lapse |")).split(" | ")
    assert lapse_cells[3] == f"{3.0 / 1.9:.2f}" and lapse_cells[7] == f"{12.0 / 7.0:.2f}"
    assert "sdpa-efficient: n/a: NotAvailable" in table


def test_graph_times_ratios_and_efficiency():
    """The CUDA-graph times get their own ratios (to the fastest baseline's graph time) and
    ACP efficiency, and a line each in the table's notes; a failed capture says why."""
    result = _result(
        lapse=_timed(3.0, 12.0),
        lapse_acp={**_timed(1.5, 6.0), "pruned": 0.6},
        sdpa_default=_timed(2.0, 7.0),
    )
    graph = {"lapse": (2.5, 11.0), "lapse-acp": (1.2, 5.0), "sdpa-default": (1.9, 6.8)}
    for name, (fwd, fwd_bwd) in graph.items():
        result["providers"][name]["fwd"]["graph_ms"] = fwd
        result["providers"][name]["fwd+bwd"]["graph_ms"] = fwd_bwd
    result["providers"]["sdpa-default"]["fwd+bwd"] = {"ms": 7.0, "graph_error": "RuntimeError: capture"}
    bench._derive(result)
    rows = result["providers"]
    assert rows["lapse"]["fwd"]["graph_vs_fastest"] == pytest.approx(2.5 / 1.9)
    assert "graph_vs_fastest" not in rows["lapse"]["fwd+bwd"]  # the baseline's capture failed
    assert rows["lapse-acp"]["fwd"]["graph_efficiency"] == pytest.approx(2.5 * 0.4 / 1.2)
    assert rows["lapse-acp"]["fwd+bwd"]["graph_efficiency"] == pytest.approx(11.0 * 0.4 / 5.0)
    assert rows["lapse-acp"]["fwd+bwd"]["efficiency"] == pytest.approx(12.0 * 0.4 / 6.0)
    table = bench.markdown_table(result, ("fwd", "fwd+bwd"))
    assert ("lapse-acp: replayed from a CUDA graph (GPU time, no launches): "
            f"fwd 1.200 ms ({1.2 / 1.9:.2f}x), efficiency {2.5 * 0.4 / 1.2:.2f}; "
            f"fwd+bwd 5.000 ms, efficiency {11.0 * 0.4 / 5.0:.2f}") in table
    assert "sdpa-default: replayed from a CUDA graph (GPU time, no launches): fwd 1.900 ms (1.00x); " \
        "fwd+bwd n/a: RuntimeError: capture" in table
    assert "CUDA-graph ratios are to the fastest softmax baseline's graph time: fwd sdpa-default" in table


def test_graph_ratios_take_the_fastest_baseline_under_the_graph():
    """Eager and graph times can rank two close baselines differently (FlashAttention-4 and
    cuDNN): each set of ratios takes its own fastest, and the notes name the graph's."""
    result = _result(lapse=_timed(3.0, 12.0), sdpa_default=_timed(2.0, 7.0), flash_attn_4=_timed(1.9, 6.0))
    for name, fwd in (("lapse", 2.8), ("sdpa-default", 1.8), ("flash-attn-4", 2.0)):
        result["providers"][name]["fwd"]["graph_ms"] = fwd
    bench._derive(result)
    rows = result["providers"]
    assert result["fastest_softmax"]["fwd"]["provider"] == "flash-attn-4"
    assert result["fastest_softmax_graph"]["fwd"] == {"provider": "sdpa-default", "ms": 1.8}
    assert rows["lapse"]["fwd"]["vs_fastest"] == pytest.approx(3.0 / 1.9)
    assert rows["lapse"]["fwd"]["graph_vs_fastest"] == pytest.approx(2.8 / 1.8)
    assert "graph time: fwd sdpa-default" in bench.markdown_table(result, ("fwd", "fwd+bwd"))


@pytest.mark.parametrize("fails", [False, True], ids=["captured", "capture-fails"])
def test_graph_ms_gives_captures_the_eager_ds_budget(fails, monkeypatch):
    """While ``_graph_ms`` captures, lapse's kept dS gets the eager budget (so graph and eager
    timings run the same kernels), restored afterwards; a failed capture is reported, not
    raised."""
    import contextlib

    from lapse.ops.forgetting import triton_bwd

    seen = []

    def fake_time_graphed(fn, cfg):
        seen.append(triton_bwd.DS_MAX_CAPTURED)
        if fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return 1.25

    monkeypatch.setattr(bench, "_time_graphed", fake_time_graphed)
    runner = types.SimpleNamespace(context=contextlib.nullcontext, forward=lambda: None,
                                   from_bthd=lambda d: d, grad_inputs=[])
    before = triton_bwd.DS_MAX_CAPTURED
    for mode in ("fwd", "fwd+bwd"):
        got = bench._graph_ms(runner, mode, torch.zeros(1), AttentionBenchConfig())
        assert got == ({"graph_error": "RuntimeError: operation not permitted when stream is capturing"}
                       if fails else {"graph_ms": 1.25})
    assert seen == [triton_bwd.DS_MAX_FRACTION] * 2 and triton_bwd.DS_MAX_CAPTURED == before
    assert triton_bwd.DS_MAX_FRACTION != before  # the test would pass vacuously otherwise
    cfg = AttentionBenchConfig(graph_times=True)
    assert cfg.command().endswith(" --graph-times")
    assert tyro.cli(AttentionBenchConfig, args=shlex.split(cfg.command())[3:]) == cfg


def test_no_baseline_ran():
    result = _result(lapse=_timed(3.0, 12.0), sdpa_flash=_timed(None, None))
    bench._derive(result)
    assert result["fastest_softmax"] == {}
    assert "vs_fastest" not in result["providers"]["lapse"]["fwd"]
    table = bench.markdown_table(result, ("fwd",))
    assert "fwd x fastest softmax (none ran)" in table.splitlines()[0]
    assert table.splitlines()[2].split(" | ")[3] == "n/a"


def test_sdpa_alias_and_default_providers():
    assert set(SOFTMAX_BASELINES) <= set(AttentionBenchConfig().providers)
    cfg = AttentionBenchConfig(providers=("lapse", "sdpa", "sdpa-flash", "sdpa-cudnn"))
    assert cfg.providers == ("lapse", "sdpa-flash", "sdpa-cudnn")
    assert "--providers lapse sdpa-flash sdpa-cudnn" in cfg.command()
    assert tyro.cli(AttentionBenchConfig, args=shlex.split(cfg.command())[3:]) == cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA every backend may run: the GPU run shows it")
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["MHA", "GQA"])
def test_sdpa_providers_on_cpu(monkeypatch, kv_heads):
    """Default and flash run (SDPA has CPU kernels) and compute causal softmax attention,
    i.e. forgetting attention with every log gate 0; efficient and cuDNN say why not."""
    from lapse.ops.forgetting import forgetting_attention

    monkeypatch.setattr(bench, "_time", lambda fn, cfg: (fn(), 1.0)[1])
    spec = WorkloadSpec(seq_len=24, tokens=48, heads=4, kv_heads=kv_heads, head_dim=16, dtype=torch.float32)
    cfg = AttentionBenchConfig(
        seq_lens=(24,), tokens=48, heads=4, kv_heads=kv_heads, head_dim=16, providers=SOFTMAX_BASELINES
    )
    progress = types.SimpleNamespace(set_postfix_str=lambda s: None, update=lambda n: None)
    result = bench.bench_workload(spec, cfg, progress, device="cpu")
    rows = result["providers"]
    for name in ("sdpa-default", "sdpa-flash"):
        assert rows[name]["fwd"]["ms"] == rows[name]["fwd+bwd"]["ms"] == 1.0, rows[name]
        assert rows[name]["check"]["status"] == "not comparable"
    for name in ("sdpa-efficient", "sdpa-cudnn"):
        assert rows[name]["error"].startswith(f"NotAvailable: {name}: SDPA refused"), rows[name]
        assert "fwd" not in rows[name]
    assert rows["flash-attn-4"]["error"] == "NotAvailable: flash-attn-4 runs on CUDA GPUs only"
    assert result["fastest_softmax"]["fwd"]["provider"] in ("sdpa-default", "sdpa-flash")

    wl = make_workload(spec, device="cpu")
    want = forgetting_attention(wl.q, wl.k, wl.v, torch.zeros_like(wl.log_fgate), backend="torch")
    for name in ("sdpa-default", "sdpa-flash"):
        r = bench.build_runner(name, wl, cfg)
        with r.context(), torch.no_grad():
            torch.testing.assert_close(r.to_bthd(r.forward()), want, atol=1e-5, rtol=1e-5)


def test_varlen_has_no_backend_choice():
    spec = WorkloadSpec(varlen=True, tokens=80, heads=4, head_dim=16, dtype=torch.float32)
    wl = make_workload(spec, device="cpu")
    cfg = AttentionBenchConfig(varlen=True, tokens=80, heads=4, head_dim=16)
    for name in ("sdpa-efficient", "sdpa-cudnn"):
        with pytest.raises(bench.NotAvailable, match="varlen_attn has no backend choice"):
            bench.build_runner(name, wl, cfg)


def test_a_run_cut_off_keeps_the_workloads_it_measured(monkeypatch, tmp_path):
    """The results files are written after every workload: a run stopped during its second
    workload (a time limit, a crash) leaves the first one's table and JSON."""
    calls = []

    def fake_workload(spec, cfg, progress, device="cuda"):
        calls.append(spec)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second workload never finishes
        return {"spec": spec.label, **_result(sdpa_default=_timed(1.0, 2.0), lapse=_timed(1.5, 3.0))}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_workload", fake_workload)
    monkeypatch.setattr(bench, "_free", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda: dict(device="cpu", torch="-", cuda="-", triton="-",
                                                           fla="-", lapse="-", date="-"))
    cfg = AttentionBenchConfig(seq_lens=(1024, 2048), tokens=4096, providers=("sdpa-default", "lapse"),
                               out_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        bench.run(cfg)
    import json

    report = json.loads((tmp_path / "results.json").read_text())
    assert [w["spec"] for w in report["workloads"]] == [calls[0].label]
    assert "T = 1024" in (tmp_path / "results.md").read_text()


def _fake_flash_attn_4(monkeypatch, calls):
    """A stand-in ``flash_attn.cute`` with FlashAttention-4's keyword names (4.0.0b36's, in its
    order; a misspelt keyword fails), computing causal softmax attention with SDPA and returning
    ``(out, lse)`` as 4.0 does."""
    F = torch.nn.functional

    def attend(q, k, v, scale):  # [B, T, H, D]; grouped K/V expanded
        group = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o.transpose(1, 2)

    def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False):
        calls.append(("dense", causal))
        return attend(q, k, v, softmax_scale), None

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False):
        calls.append(("varlen", causal, max_seqlen_q))
        assert torch.equal(cu_seqlens_q, cu_seqlens_k)
        cu = cu_seqlens_q.tolist()
        return torch.cat([attend(q[None, a:b], k[None, a:b], v[None, a:b], softmax_scale)[0]
                          for a, b in zip(cu[:-1], cu[1:], strict=False)]), None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setattr(bench, "_on_gpu", lambda x: True)


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
@pytest.mark.parametrize("kv_heads", [None, 2], ids=["MHA", "GQA"])
def test_flash_attn_4_provider_computes_causal_softmax(monkeypatch, varlen, kv_heads):
    """The FlashAttention-4 runner hands lapse's layout to flash_attn.cute (causal, the
    packed sequences through its varlen entry) and takes the output out of its (out, lse):
    forgetting attention with every log gate 0, forward and backward."""
    from lapse.ops.forgetting import forgetting_attention

    calls: list = []
    _fake_flash_attn_4(monkeypatch, calls)
    spec = WorkloadSpec(varlen=varlen, seq_len=24, tokens=80 if varlen else 48, heads=4, kv_heads=kv_heads,
                        head_dim=16, dtype=torch.float64)
    wl = make_workload(spec, device="cpu")
    cfg = AttentionBenchConfig(varlen=varlen, seq_lens=(24,), tokens=spec.tokens, heads=4, kv_heads=kv_heads,
                               head_dim=16, providers=("flash-attn-4",))
    r = bench.build_runner("flash-attn-4", wl, cfg)
    assert calls and all(c[1] is True for c in calls), calls
    assert calls[0][0] == ("varlen" if varlen else "dense")
    q, k, v = (x.detach().requires_grad_() for x in (wl.q, wl.k, wl.v))
    want = forgetting_attention(q, k, v, torch.zeros_like(wl.log_fgate), cu_seqlens=wl.cu_seqlens,
                                backend="torch")
    out = r.forward()
    torch.testing.assert_close(r.to_bthd(out), want)
    d_out = torch.randn_like(want)
    grads = torch.autograd.grad(out, r.grad_inputs, r.from_bthd(d_out))
    want_grads = torch.autograd.grad(want, (q, k, v), d_out)
    for g, w in zip(r.grad_to_bthd(list(grads)), want_grads, strict=True):
        torch.testing.assert_close(g.reshape(w.shape), w)


def test_flash_attn_4_provider_says_why_not():
    spec = WorkloadSpec(seq_len=24, tokens=48, heads=4, head_dim=16, dtype=torch.float32)
    wl = make_workload(spec, device="cpu")
    cfg = AttentionBenchConfig(seq_lens=(24,), tokens=48, heads=4, head_dim=16)
    with pytest.raises(bench.NotAvailable, match="flash-attn-4 runs on CUDA GPUs only"):
        bench.build_runner("flash-attn-4", wl, cfg)
    assert "flash-attn-4" in SOFTMAX_BASELINES and "flash-attn-4" in cfg.providers


def test_flex_flash_provider_says_why_not_on_cpu():
    spec = WorkloadSpec(seq_len=24, tokens=48, heads=4, head_dim=16, dtype=torch.float32)
    wl = make_workload(spec, device="cpu")
    cfg = AttentionBenchConfig(seq_lens=(24,), tokens=48, heads=4, head_dim=16, providers=("flex-flash",))
    assert cfg.providers == ("flex-flash",) and "flex-flash" in bench.GATED
    with pytest.raises(bench.NotAvailable, match="flex-flash runs on CUDA GPUs only"):
        bench.build_runner("flex-flash", wl, cfg)


def test_flash_attn_4_acp_hands_flash_attention_the_tiles_lapse_acp_visits(monkeypatch):
    """``flash-attn-4-acp`` (FlashAttention-4's block sparsity on ACP's tiles, the peer of
    lapse-acp's efficiency): the forward's lists visit, for each query tile, every key tile that
    holds a key ACP keeps for one of its rows, through the diagonal and nothing before; the
    backward's lists visit the same (query tile, key tile) pairs; the kernel is called causal,
    once before the timing. A stand-in ``flash_attn.cute`` records what it is given."""
    from lapse.ops.forgetting import ACP_BLOCK, common
    from lapse.ops.forgetting.pruning import triton_acp_block_start
    from lapse.ops.forgetting.triton_ops import triton_gate_cumsum

    calls: list = []
    _fake_flash_attn_4(monkeypatch, calls)
    cute = sys.modules["flash_attn.cute"]

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, block_sparse_tensors=None,
                        block_sparse_tensors_bwd=None):
        calls.append(("sparse", causal, block_sparse_tensors, block_sparse_tensors_bwd))
        return torch.zeros_like(q), None

    tile = types.SimpleNamespace(m_block_size=128, n_block_size=128)
    cute.flash_attn_func = flash_attn_func
    cute.interface = types.SimpleNamespace(_tile_size_fwd_sm90=lambda *a: tile,
                                           _tile_size_bwd_sm90=lambda *a: tile)
    sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    sparsity.BlockSparseTensorsTorch = lambda *lists, block_size: (lists, block_size)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", sparsity)
    monkeypatch.setattr(bench, "_on_hopper", lambda x: True)
    t = 640  # five tiles of 128; local heads keep a few 64-key blocks a row
    spec = WorkloadSpec(seq_len=t, tokens=2 * t, heads=4, head_dim=16, dtype=torch.float32)
    wl = make_workload(spec, device="cpu")
    cfg = AttentionBenchConfig(seq_lens=(t,), tokens=2 * t, heads=4, head_dim=16)
    assert "flash-attn-4-acp" in cfg.providers and bench.PRUNED["flash-attn-4-acp"] == "flash-attn-4"

    r = bench.build_runner("flash-attn-4-acp", wl, cfg)
    assert len(calls) == 1 and calls[0][1] is True  # the compile's call, before any timing
    (count, index, *full), size = calls[0][2]
    (bcount, bindex), bsize = calls[0][3]
    assert size == bsize == (128, 128) and not full[0].any()
    p = common.validate(wl.q, wl.k, wl.v, wl.log_fgate, None, None, "triton")
    starts = triton_acp_block_start("auto", cfg.acp_eps, wl.q, wl.k, *triton_gate_cumsum(wl.log_fgate, p), p)
    assert (starts > 0).any()  # the workload prunes: the lists are not the dense ones
    n = t // 128
    for b in range(2):
        for h in range(4):
            fwd_pairs, bwd_pairs = set(), set()
            for m in range(n):
                # the key tile of the first key ACP keeps for one of the tile's rows
                first = min(starts[b, h, 2 * m: 2 * m + 2].tolist()) * ACP_BLOCK // 128
                got = index[b, h, m, : count[b, h, m]].tolist()
                assert sorted(got) == list(range(first, m + 1)), (b, h, m, got)
                fwd_pairs |= {(m, j) for j in got}
            for j in range(n):
                bwd_pairs |= {(i, j) for i in bindex[b, h, j, : bcount[b, h, j]].tolist()}
            assert fwd_pairs == bwd_pairs
    r.forward()
    assert len(calls) == 2 and calls[1][2] is calls[0][2]  # the same lists every call


def test_flash_attn_4_acp_says_why_not():
    spec = WorkloadSpec(seq_len=24, tokens=48, heads=4, head_dim=16, dtype=torch.float32)
    cfg = AttentionBenchConfig(seq_lens=(24,), tokens=48, heads=4, head_dim=16)
    with pytest.raises(bench.NotAvailable, match="flash-attn-4 runs on CUDA GPUs only"):
        bench.build_runner("flash-attn-4-acp", make_workload(spec, device="cpu"), cfg)
    packed = WorkloadSpec(varlen=True, seq_len=24, tokens=80, heads=4, head_dim=16, dtype=torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "_on_gpu", lambda x: True)
        with pytest.raises(bench.NotAvailable, match="no block sparsity with packed sequences"):
            bench.build_runner("flash-attn-4-acp", make_workload(packed, device="cpu"), cfg)


def test_efficiency_of_each_pruned_provider_against_its_dense_one():
    """lapse-acp against lapse, flash-attn-4-acp against flash-attn-4, each with its own
    pruned share; the table shows both."""
    result = _result(lapse=_timed(2.5, 11.0), lapse_acp=_timed(1.2, 5.0), flash_attn_4=_timed(2.0, 8.0),
                     flash_attn_4_acp=_timed(1.0, 4.0))
    result["providers"]["lapse-acp"]["pruned"] = 0.6
    result["providers"]["flash-attn-4-acp"]["pruned"] = 0.6
    bench._derive(result)
    rows = result["providers"]
    assert rows["lapse-acp"]["fwd+bwd"]["efficiency"] == pytest.approx(11.0 * 0.4 / 5.0)
    assert rows["flash-attn-4-acp"]["fwd+bwd"]["efficiency"] == pytest.approx(8.0 * 0.4 / 4.0)
    assert rows["flash-attn-4-acp"]["fwd"]["efficiency"] == pytest.approx(2.0 * 0.4 / 1.0)
    assert result["fastest_softmax"]["fwd"]["provider"] == "flash-attn-4"  # never the sparse one
    table = bench.markdown_table(result, ("fwd", "fwd+bwd"))
    assert "| flash-attn-4-acp |" in table and f"fwd+bwd {8.0 * 0.4 / 4.0:.2f}" in table


def _tile_mask(count: torch.Tensor, index: torch.Tensor, rows: int, cols: int, t: int,
               by_rows: bool) -> torch.Tensor:
    """``[B, H, T, T]`` (queries, keys): True where a block-sparsity list visits the pair's tile.
    ``by_rows``: the lists are per query tile (``rows`` high) of key tiles (``cols`` wide), else
    per key tile of query tiles."""
    listed = (torch.arange(index.shape[-1], device=index.device) < count[..., None]).int()
    visited = torch.zeros(*count.shape, -(-t // (cols if by_rows else rows)), dtype=torch.int32,
                          device=index.device)
    visited.scatter_reduce_(-1, index.long(), listed, reduce="amax")
    if not by_rows:
        visited = visited.transpose(-1, -2)  # [B, H, query tiles, key tiles]
    return visited.bool().repeat_interleave(rows, -2)[..., :t, :].repeat_interleave(cols, -1)[..., :t]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attn_4_acp_visits_the_listed_tiles_only(head_dim):
    """On the GPU, with FlashAttention-4: ``flash-attn-4-acp``'s output is causal softmax attention
    over the key tiles its forward's lists visit, and its backward works on the tiles its own lists
    visit (those holding a pair ACP keeps, at the backward's tiles): with P = exp(S - lse) there (lse
    the forward's), dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = dS K s, dK = dS^T Q s.
    Without a gate the skipped pairs carry weight, so that is not the gradient of the output: this
    provider is a timing peer doing ACP's tile work. Reference in float32; T 640 is not a whole
    number of 128-key tiles."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    pytest.importorskip("flash_attn.cute")
    t, heads = 640, 4
    spec = WorkloadSpec(seq_len=t, tokens=2 * t, heads=heads, head_dim=head_dim)
    wl = make_workload(spec, device="cuda")
    cfg = AttentionBenchConfig(seq_lens=(t,), tokens=2 * t, heads=heads, head_dim=head_dim)
    captured = {}
    import flash_attn.cute as cute

    real = cute.flash_attn_func

    def spy(*args, **kwargs):
        captured.update(kwargs)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cute, "flash_attn_func", spy)
        r = bench.build_runner("flash-attn-4-acp", wl, cfg)
        out = r.forward()
    fwd, bwd = captured["block_sparse_tensors"], captured["block_sparse_tensors_bwd"]
    causal = torch.ones(t, t, dtype=torch.bool, device="cuda").tril()
    seen = _tile_mask(fwd.mask_block_cnt, fwd.mask_block_idx, *fwd.block_size, t, by_rows=True) & causal
    worked = _tile_mask(bwd.mask_block_cnt, bwd.mask_block_idx, *bwd.block_size, t, by_rows=False) & causal
    assert (causal & ~seen).any()  # ACP pruned tiles
    q, k, v = (x.detach().float().transpose(1, 2) for x in (wl.q, wl.k, wl.v))  # [B, H, T, D]
    s = spec.scale
    scores = q @ k.transpose(-1, -2) * s
    lse = scores.masked_fill(~seen, float("-inf")).logsumexp(-1, keepdim=True)
    o = (scores - lse).exp().masked_fill(~seen, 0) @ v
    d_out = torch.randn_like(out)
    do = d_out.float().transpose(1, 2)
    # the backward's weights exp(S - lse) on its own tiles: at D 64 a 128-row tile of it can cover
    # rows of a 192-row forward tile that did not visit its keys
    pw = (scores - lse).exp().masked_fill(~worked, 0)
    ds = pw * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    want = (o, ds @ k * s, ds.transpose(-1, -2) @ q * s, pw.transpose(-1, -2) @ do)
    got = (out, *torch.autograd.grad(out, r.grad_inputs, d_out))
    errors = [((g.float().transpose(1, 2) - w).norm() / w.norm()).item()
              for g, w in zip(got, want, strict=True)]
    print(f"D {head_dim}: relative errors of o, dq, dk, dv {errors}")
    assert max(errors) < 2e-2, errors  # the bench's check of outputs (bf16 against a float32 reference)
