"""``lapse bench attention --profile`` and ``--sweep`` on a CPU: the profiler's table of each
timed call (the CPU's operators standing in for CUDA kernels), the FoX kernels' tile options
under the Triton interpreter (tests/conftest.py) checked against their table's outputs, the
pages beside results.md, and the flags through the command line."""

from __future__ import annotations

import json
import math
import shlex
import types

import pytest
import torch
import tyro

from lapse.bench import attention as bench
from lapse.bench import sweep as sweeping
from lapse.bench.config import AttentionBenchConfig
from lapse.bench.workloads import WorkloadSpec, make_workload

pytestmark = pytest.mark.usefixtures("one_thread")
PROGRESS = types.SimpleNamespace(set_postfix_str=lambda s: None, update=lambda n: None)


def _once(fn, cfg=None) -> float:
    fn()
    return 1.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the profile lists CUDA kernels")
def test_profile_lists_the_operators_of_each_timed_call(monkeypatch):
    monkeypatch.setattr(bench, "_time", _once)
    cfg = AttentionBenchConfig(seq_lens=(32,), tokens=64, heads=2, head_dim=16,
                               providers=("sdpa-default",), profile=True)
    spec = WorkloadSpec(seq_len=32, tokens=64, heads=2, head_dim=16, dtype=torch.float32)
    result = bench.bench_workload(spec, cfg, PROGRESS, device="cpu")
    for mode in ("fwd", "fwd+bwd"):
        prof = result["providers"]["sdpa-default"][mode]["profile"]
        assert prof["calls"] == bench.PROFILED_CALLS and "host_ms" not in prof  # host time: CUDA only
        assert any("scaled_dot_product" in name for name in prof["kernels"]), prof["kernels"]
        times = list(prof["kernels"].values())
        assert times == sorted(times, reverse=True) and math.isclose(prof["kernel_ms"], sum(times))
    page = bench.profile_markdown(result, cfg.modes)
    assert "### sdpa-default, fwd: timed 1.000 ms" in page and "### sdpa-default, fwd+bwd" in page
    assert "scaled_dot_product" in page


def test_profile_page_lists_the_longest_kernels_then_the_rest():
    kernels = {f"k{i}": float(40 - i) for i in range(bench.PROFILE_ROWS + 3)}
    prof = {"calls": 5, "kernels": kernels, "kernel_ms": sum(kernels.values()), "host_ms": 0.5}
    row = {"fwd": {"ms": 1000.0, "profile": prof}}
    page = bench.profile_markdown({"providers": {"lapse": row}}, ("fwd", "fwd+bwd"))
    assert "host 0.500 ms to issue it" in page
    assert f"| `k{bench.PROFILE_ROWS - 1}` |" in page and f"`k{bench.PROFILE_ROWS}`" not in page
    assert "| 3 more |" in page


@pytest.fixture
def two_options(monkeypatch):
    """One forward option that fits ACP's blocks and one that does not; one option each of the
    backward kernels."""
    monkeypatch.setattr(sweeping, "FWD_OPTIONS", [(64, 64, 4, 2), (64, 128, 4, 2)])
    monkeypatch.setattr(sweeping, "DKDV_OPTIONS", [(32, 64, 4, 2)])
    monkeypatch.setattr(sweeping, "DQ_OPTIONS", [(64, 32, 4, 2)])


def _workload():
    wl = make_workload(WorkloadSpec(seq_len=128, tokens=128, heads=2, head_dim=16, dtype=torch.float32),
                       device="cpu")
    return wl, torch.randn(wl.q.shape, generator=torch.Generator().manual_seed(1))


def test_sweep_checks_then_times_each_option(two_options):
    wl, d_out = _workload()
    rows = sweeping.sweep(wl, d_out, ("fwd", "bwd"), [None, "auto"], math.exp(-10), _once)
    got = [(r["kernel"], r["acp"], r["option"]) for r in rows]
    assert got == [
        ("fwd", False, "table"), ("fwd", False, "64 x 64, 4 warps, 2 stages"),
        ("fwd", False, "64 x 128, 4 warps, 2 stages"),
        ("bwd", False, "table"), ("bwd", False, "dK/dV 32 x 64, 4 warps, 2 stages"),
        ("bwd", False, "dQ 64 x 32, 4 warps, 2 stages"),
        ("fwd", True, "table"), ("fwd", True, "64 x 64, 4 warps, 2 stages"),  # 128-key tiles: dense only
        ("bwd", True, "table"), ("bwd", True, "dK/dV 32 x 64, 4 warps, 2 stages"),
        ("bwd", True, "dQ 64 x 32, 4 warps, 2 stages"),
    ]
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] == 1.0 and r["x_table"] == 1.0
        assert r["option"] == "table" or r["rel_diff"] < 1e-5, r  # float32: rounding only
    page = sweeping.sweep_markdown(rows)
    assert "### forward, dense" in page and "### backward (dK/dV, then dQ), ACP" in page
    assert "| dQ 64 x 32, 4 warps, 2 stages | 1.000 | 1.00 |" in page


def test_sweep_reports_an_option_that_leaves_outputs_unwritten(two_options, monkeypatch):
    """The outputs are NaN-filled before each option runs: one whose kernel skips tiles (here:
    writes nothing) is reported wrong, not timed."""
    from lapse.ops.forgetting import triton_fwd

    launch = triton_fwd.launch_fwd

    def skips_with_128_keys(*args, **kwargs):
        if (args[-1] or {}).get("BN") != 128:
            launch(*args, **kwargs)

    monkeypatch.setattr(triton_fwd, "launch_fwd", skips_with_128_keys)
    wl, d_out = _workload()
    rows = sweeping.sweep(wl, d_out, ("fwd",), [None], math.exp(-10), _once)
    bad = rows[-1]
    assert bad["option"] == "64 x 128, 4 warps, 2 stages"
    assert bad["error"].startswith("wrong:") and "ms" not in bad
    assert "| 64 x 128, 4 warps, 2 stages | n/a: wrong:" in sweeping.sweep_markdown(rows)


def test_run_writes_the_profile_and_sweep_pages_beside_the_results(monkeypatch, tmp_path):
    prof = {"calls": 5, "kernels": {"_fwd_kernel": 0.8}, "kernel_ms": 0.8, "host_ms": 0.3}
    swept = [{"kernel": "fwd", "acp": False, "option": "table", "config": {"BM": 64}, "ms": 1.0,
              "x_table": 1.0}]

    def fake_workload(spec, cfg, progress, device="cuda"):
        row = {"fwd": {"ms": 1.0, "tflops": 1.0, "profile": prof}, "notes": [], "check": {"status": "ok"}}
        return {"workload": spec.label, "spec": {}, "flops_fwd": 1.0, "providers": {"lapse": row},
                "fastest_softmax": {}, "sweep": swept}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_workload", fake_workload)
    monkeypatch.setattr(bench, "_free", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda: dict(device="cpu", torch="-", cuda="-", triton="-",
                                                           fla="-", lapse="-", date="-"))
    cfg = AttentionBenchConfig(seq_lens=(1024,), tokens=2048, providers=("lapse",), modes=("fwd",),
                               profile=True, sweep=("fwd",), out_dir=tmp_path)
    bench.run(cfg)
    profile = (tmp_path / "profile.md").read_text()
    assert "`lapse bench attention " in profile and "--profile --sweep fwd`" in profile
    assert "## T = 1024, B = 2" in profile and "`_fwd_kernel`" in profile
    assert "| table | 1.000 | 1.00 | |" in (tmp_path / "sweep.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["config"]["sweep"] == ["fwd"]


def test_the_flags_round_trip_through_the_command_line():
    cfg = AttentionBenchConfig(providers=("lapse-acp", "sdpa-default"), profile=True,
                               sweep=("bwd", "fwd", "bwd"))
    assert cfg.sweep == ("bwd", "fwd")
    assert cfg.command().endswith("--profile --sweep bwd fwd")
    assert tyro.cli(AttentionBenchConfig, args=shlex.split(cfg.command())[3:]) == cfg
    with pytest.raises(ValueError, match="name one of them in providers"):
        AttentionBenchConfig(providers=("sdpa-default",), sweep=("fwd",))
