"""``lapse bench attention``'s CASTLE providers, dry-run on CPU at a tiny T: every
provider is built, checked against ``castle_attention(backend="torch")`` and run through
the timing path (the timer replaced by one call: ``do_bench`` needs CUDA); the Triton
provider runs under the interpreter (tests/conftest.py), in float16 (the interpreter's
bfloat16 dots are wrong, tests/ops/test_castle_triton.py)."""

from __future__ import annotations

import shlex

import pytest
import torch
import tyro

from lapse.bench import attention as bench
from lapse.bench.attention import CASTLE_PROVIDERS, AttentionBenchConfig
from lapse.bench.workloads import WorkloadSpec

pytestmark = pytest.mark.usefixtures("one_thread")


class _Progress:
    def set_postfix_str(self, s: str) -> None:
        pass

    def update(self, n: int) -> None:
        pass


@pytest.fixture
def one_call_timer(monkeypatch):
    def once(fn, cfg):
        fn()
        return 1.0

    monkeypatch.setattr(bench, "_time", once)


@pytest.mark.parametrize("kv_heads", [None, 2], ids=["MHA", "GQA"])
def test_castle_providers_check_and_run(one_call_timer, kv_heads):
    cfg = AttentionBenchConfig(seq_lens=(40,), tokens=80, heads=4, kv_heads=kv_heads, head_dim=16,
                               providers=CASTLE_PROVIDERS, castle_window=5, castle_naive_max_t=64)
    spec = WorkloadSpec(seq_len=40, tokens=80, heads=4, kv_heads=kv_heads, head_dim=16, dtype=torch.float16)
    result = bench.bench_workload(spec, cfg, _Progress(), device="cpu")
    rows = result["providers"]
    assert rows["castle-torch"]["check"] == {"status": "reference"}
    computed = [p for p in CASTLE_PROVIDERS if p not in ("castle-torch", "lookahead-keys-attention")]
    for name in computed:
        check = rows[name]["check"]
        assert check["status"] == "ok", (name, check)
        assert set(check["grad_rel_err"]) == {"dq_c", "dk_c", "dv_c", "dq_u", "dk_u", "dv_u"}
        assert check["out_rel_err"] < 1e-2
    for name in [*computed, "castle-torch"]:
        assert rows[name]["fwd"]["ms"] == rows[name]["fwd+bwd"]["ms"] == 1.0
    assert result["castle_reference_window_5"]["out_from"] == "castle-torch"
    # the public package: unavailable here (not a dependency), or no GQA, or checked
    lka = rows["lookahead-keys-attention"]
    assert "error" in lka or lka["check"]["status"] == "ok"
    if kv_heads is not None or "error" in lka:
        assert "not importable" in lka["error"] or "grouped-query" in lka["error"]
    table = bench.markdown_table(result, cfg.modes)
    assert "castle-swl-triton-parallel" in table and "fwd peak MiB" in table


def test_naive_is_skipped_above_its_length(one_call_timer):
    cfg = AttentionBenchConfig(seq_lens=(40,), tokens=40, heads=2, head_dim=16,
                               providers=("castle-naive",), castle_naive_max_t=32, modes=("fwd",))
    row = bench.bench_workload(cfg.specs()[0], cfg, _Progress(), device="cpu")["providers"]["castle-naive"]
    assert "skipped at T = 40 > --castle-naive-max-t 32" in row["error"] and "fwd" not in row


def test_lookahead_inputs_are_deterministic_and_shaped():
    from lapse.bench.workloads import make_workload

    wl = make_workload(WorkloadSpec(seq_len=8, tokens=16, heads=4, kv_heads=2, head_dim=16), device="cpu")
    a, b = bench.castle_lookahead(wl, 0), bench.castle_lookahead(wl, 0)
    assert [x.shape for x in a] == [wl.q.shape, wl.k.shape, wl.v.shape]
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not (a[0] == bench.castle_lookahead(wl, 1)[0]).all()


def test_command_round_trip_and_bad_window():
    cfg = AttentionBenchConfig(providers=("castle-triton", "castle-swl-triton", "sdpa"), castle_window=128,
                               castle_naive_max_t=1024, head_dim=128, heads=12)
    args = shlex.split(cfg.command())[3:]
    assert "--castle-window 128" in cfg.command()
    assert tyro.cli(AttentionBenchConfig, args=args) == cfg
    with pytest.raises(ValueError, match="castle_window must be >= 1"):
        AttentionBenchConfig(castle_window=0)
