"""The training benchmark's step is the trainer's step (it may not import the trainer)."""

import pytest
import torch

from lapse.bench.training import optimizer_step
from lapse.models import Decoder, optimizer_groups, preset
from lapse.train.trainer import train_step


def test_the_benchmark_step_is_the_trainer_step():
    cfg = preset("tiny", "fox-pro", acp=True, vocab_size=128, max_seq_len=32)
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    results = []
    for step in (optimizer_step, train_step):
        torch.manual_seed(0)
        model = Decoder(cfg)
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
        if step is optimizer_step:
            loss = step(model, opt, x, y, 2)
        else:
            loss, _ = step(model, opt, x, y, 2, torch.device("cpu"), torch.bfloat16, 1.0)
        results.append((loss, model.state_dict()))
    (la, wa), (lb, wb) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_benchmark_dcp_step_is_the_trainer_dcp_step():
    from lapse.bench.training import dcp_penalty
    from lapse.train.config import DCPTrainConfig
    from lapse.train.dcp import DCPTraining, dcp_layers

    cfg = preset("tiny", "transformer-llama", attention="dcp", dcp_r=4, dcp_beta_init=-0.4, vocab_size=128,
                 max_seq_len=32)
    ids = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    results = []
    for step in (optimizer_step, train_step):
        torch.manual_seed(0)
        model = Decoder(cfg)
        opt = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
        if step is optimizer_step:
            penalty = dcp_penalty(model, 3.0, 0.5)
            loss = step(model, opt, x, y, 2, penalty)
            dropped = penalty.dropped / penalty.forwards
        else:
            dcp = DCPTraining(dcp_layers(model), DCPTrainConfig(gamma=0.5, alpha_start=3.0, alpha_end=3.0), 1,
                              torch.device("cpu"))
            dcp.set_step(0)
            loss, _ = step(model, opt, x, y, 2, torch.device("cpu"), torch.bfloat16, 1.0, dcp)
            dropped = dcp.take()[0]
        results.append((loss, dropped, model.state_dict()))
    (la, da, wa), (lb, db, wb) = results
    assert torch.equal(la, lb) and torch.equal(da, db)
    assert da.max() > 0  # beta < 0: the mask drops, so the penalty has something to move
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bench_train_runs_dcp_against_the_transformer_on_cpu(tmp_path):
    import json

    from lapse.bench.training import TrainBenchConfig, run

    cfg = TrainBenchConfig(
        preset="tiny", arch="transformer-llama", seq_len=32, batch_size=2, micro_batch_size=1, steps=1,
        warmup=0, variants=("transformer", "dcp"), dcp_r=4, out_dir=tmp_path,
    )
    rows = {r["variant"]: r for r in run(cfg)["rows"]}
    assert rows["dcp"]["speedup_vs_transformer"] > 0 and rows["transformer"]["speedup_vs_transformer"] == 1.0
    assert rows["dcp"]["transformer_reference"] == "transformer" and rows["dcp"]["speedup_vs_dense"] is None
    # the same softmax weights; at beta init (2) almost every keep probability is 1
    assert abs(rows["dcp"]["loss"] - rows["transformer"]["loss"]) < 1e-3 * rows["transformer"]["loss"]
    assert json.loads((tmp_path / "results.json").read_text())["rows"][1]["variant"] == "dcp"


def test_speedups_are_tokens_per_s_ratios_within_a_compile_mode():
    from lapse.bench.training import _add_speedups

    rows = [{"variant": v, "tokens_per_s": r} for v, r in (
        ("dense-compile", 100.0), ("acp-compile", 202.0), ("transformer-compile", 50.0), ("acp", 80.0),
        ("transformer", 40.0))]
    _add_speedups(rows)
    got = {r["variant"]: (r["speedup_vs_dense"], r["speedup_vs_transformer"]) for r in rows}
    assert got == {
        "dense-compile": (1.0, 2.0), "acp-compile": (2.02, 4.04), "transformer-compile": (0.5, 1.0),
        "acp": (None, 2.0), "transformer": (None, 1.0),  # no eager dense ran
    }
    assert [r["dense_reference"] for r in rows] == ["dense-compile"] * 3 + [None, None]


def test_bench_train_counts_the_flops_acp_does(tmp_path):
    """ACP's rows count its attention without the pruned tiles (TFLOP/s and MFU below the
    dense-equivalent ones, by the measured pruned share); dense rows count the same both ways;
    MFU is TFLOP/s over the given peak; the speed-ups are tokens/s ratios."""
    from lapse.bench.training import TrainBenchConfig, run
    from lapse.models import flops_per_token, preset

    cfg = TrainBenchConfig(
        preset="tiny", arch="fox-pro", seq_len=512, batch_size=1, micro_batch_size=1, steps=1, warmup=0,
        variants=("dense", "acp"), peak_tflops=0.001, out_dir=tmp_path,
    )
    result = run(cfg)
    rows = {r["variant"]: r for r in result["rows"]}
    dense, acp = rows["dense"], rows["acp"]
    assert acp["pruned"] > 0.1  # a fresh init's gates prune at this length
    model = preset("tiny", "fox-pro", acp=True, max_seq_len=512)
    assert acp["flops_per_token"] == flops_per_token(model, 512, pruned=acp["pruned"])
    assert acp["flops_per_token"] < acp["dense_flops_per_token"]
    assert dense["flops_per_token"] == dense["dense_flops_per_token"] == acp["dense_flops_per_token"]
    for r in (dense, acp):
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.001)
        assert r["dense_equivalent_tflops"] >= r["tflops"]
    assert acp["speedup_vs_dense"] == pytest.approx(acp["tokens_per_s"] / dense["tokens_per_s"])
    assert dense["speedup_vs_dense"] == 1.0 and acp["speedup_vs_transformer"] is None
    table = (tmp_path / "results.md").read_text()
    assert "| vs dense | vs transformer | TFLOP/s | MFU | dense-eq. TFLOP/s |" in table
    row = f"| acp | {acp['step_s']:.3f} | {acp['tokens_per_s']:,.0f} | {acp['speedup_vs_dense']:.2f}x | - |"
    assert row in table


def test_bench_train_refuses_bad_dcp_settings():
    import pytest

    from lapse.bench.training import TrainBenchConfig

    with pytest.raises(ValueError, match="dcp_gamma"):
        TrainBenchConfig(dcp_gamma=-1.0)
    with pytest.raises(ValueError, match="dcp_alpha"):
        TrainBenchConfig(dcp_alpha=0.5)


def test_bench_train_with_activation_checkpointing_takes_the_same_steps(tmp_path):
    """Checkpointed blocks recompute their activations in the backward: the same losses
    over two optimizer steps (the second one after an update), and the given commit kept."""
    from lapse.bench.training import TrainBenchConfig, run

    losses = {}
    for ckpt in (False, True):
        cfg = TrainBenchConfig(
            preset="tiny", arch="fox-pro", seq_len=32, batch_size=2, micro_batch_size=1, steps=2, warmup=0,
            variants=("dense",), activation_checkpointing=ckpt, commit="abc1234",
            out_dir=tmp_path / str(ckpt),
        )
        result = run(cfg)
        assert result["commit"] == "abc1234"
        losses[ckpt] = result["rows"][0]["loss"]
    assert losses[True] == losses[False], losses


def test_compile_modes_of_the_variants():
    from lapse.bench.config import VARIANTS
    from lapse.bench.training import MODES, _mode

    assert {"acp-cudagraphs", "transformer-cudagraphs", "dense-compile", "dcp"} <= set(VARIANTS)
    assert [MODES[_mode(v)] for v in ("acp", "acp-compile", "transformer-cudagraphs")] == [
        False, True, "reduce-overhead"]


def test_cuda_graphs_refuse_activation_checkpointing():
    from lapse.bench.training import TrainBenchConfig

    with pytest.raises(ValueError, match="acp-cudagraphs does not work with activation_checkpointing"):
        TrainBenchConfig(variants=("acp-compile", "acp-cudagraphs"), activation_checkpointing=True)


@pytest.mark.gpu
def test_cuda_graphs_take_the_same_steps_on_cuda(tmp_path):
    """The blocks replayed as CUDA graphs (``-cudagraphs``: torch.compile's reduce-overhead
    mode, the FoX op inside each block's graph) take the same steps as the compiled blocks
    without them: the same losses over three optimizer steps of two micro-batches, FoX Pro
    with ACP and the Transformer Pro (the graphed Transformer steps right after the graphed
    FoX, before an ungraphed step made its RoPE tables: a table made inside a graph was
    freed at the next step)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from lapse.bench.training import TrainBenchConfig, run

    cfg = TrainBenchConfig(
        preset="tiny", arch="fox-pro", seq_len=256, batch_size=2, micro_batch_size=1, steps=3, warmup=1,
        variants=("acp-compile", "acp-cudagraphs", "transformer-cudagraphs", "transformer-compile"),
        out_dir=tmp_path,
    )
    rows = {r["variant"]: r for r in run(cfg)["rows"]}
    for arch in ("acp", "transformer"):
        a, b = rows[f"{arch}-compile"]["loss"], rows[f"{arch}-cudagraphs"]["loss"]
        print(f"{arch} losses {a:.6f} {b:.6f}")
        assert abs(a - b) <= 1e-4 * abs(a), (arch, a, b)


def test_bench_train_profile_writes_a_table_and_a_trace_per_variant(tmp_path):
    import gzip
    import json

    from lapse.bench.training import TrainBenchConfig, run

    cfg = TrainBenchConfig(
        preset="tiny", seq_len=32, batch_size=2, micro_batch_size=1, steps=1, warmup=0,
        variants=("dense", "acp"), profile=True, out_dir=tmp_path,
    )
    run(cfg)
    text = (tmp_path / "profile.md").read_text()
    for name in ("dense", "acp"):
        assert f"## {name}" in text
        trace = json.loads(gzip.decompress((tmp_path / f"trace-{name}.json.gz").read_bytes()))
        assert any("ForgettingAttention" in e.get("name", "") for e in trace["traceEvents"])
    # the op that runs the attention is among the ops the table names
    assert "_ChunkedForgettingAttention" in text
