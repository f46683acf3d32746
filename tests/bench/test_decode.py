"""``lapse bench decode`` as a CPU dry run: the table's rows and keys, policies over the
paged store, a trained run instead of a preset, a DCP run on its validation text (timings
on a CPU mean nothing; the GPU figures are in BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lapse.bench.decode import DecodeBenchConfig, _prompts, run
from lapse.cli import main as cli_main
from lapse.data import WindowSampler, prepare_data
from lapse.models import preset
from lapse.models.checkpoint import read_run
from lapse.train import train, train_preset

RUN = Path(__file__).parents[1] / "fixtures" / "before_restructure" / "run-fox-pro"
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(tmp_path, **kw) -> DecodeBenchConfig:
    base = dict(
        preset="tiny",
        archs=("fox-pro",),
        workloads=("2x24",),
        providers=("lapse",),
        steps=2,
        warmup=1,
        every=2,
        dtype="float32",
        device="cpu",
        bandwidth=1e11,
        out_dir=tmp_path,
        commit="test",
    )
    if not kw.get("policies"):
        del base["every"]  # refused where no policy reads it
    return DecodeBenchConfig(**{**base, **kw})


def test_dry_run_writes_rows_for_every_policy(tmp_path, monkeypatch):
    import lapse.bench.decode as bench

    monkeypatch.setattr(
        bench, "compiled_decode_one_token", lambda: bench.decode_one_token
    )  # no CUDA graphs on CPU
    results = run(
        _cfg(
            tmp_path,
            workloads=("2x96",),
            policies=("dense", "window", "acp", "h2o", "a2sf"),
            window=8,
            budget=0.5,
        )
    )
    (row,) = results["rows"]
    assert row["arch"] == "fox-pro" and row["lapse"] > 0 and row["limit"] > 0
    for policy in ("dense", "window", "acp", "h2o", "a2sf"):
        assert row[f"paged-{policy}"] > 0 and 0 < row[f"kv-{policy}"] <= 1.2
    assert row["kv-h2o"] < row["kv-dense"] and row["kv-window"] < row["kv-dense"]
    assert json.loads((tmp_path / "results.json").read_text())["env"]["commit"] == "test"
    assert "fox-pro" in (tmp_path / "results.md").read_text()


def test_a_trained_run_replaces_the_preset(tmp_path):
    results = run(_cfg(tmp_path, run=RUN, workloads=("1x40",)))
    (row,) = results["rows"]
    assert row["arch"].endswith("(run-fox-pro)") and results["env"]["run"] == str(RUN)
    assert f"trained run {RUN}" in (tmp_path / "results.md").read_text()
    with pytest.raises(FileNotFoundError, match="is not a run folder"):
        run(_cfg(tmp_path, run=tmp_path / "nope"))


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory) -> Path:
    """A 2-step Transformer (LLaMA) run fine-tuned 2 steps into DCP (beta -0.3: the step
    mask drops a good share), as scripts/study_dcp.sh makes them on a GPU."""
    root = tmp_path_factory.mktemp("dcp-bench")
    model = preset("tiny", "transformer-llama", vocab_size=320, max_seq_len=64)
    common = dict(data_dir=root / "data", val_every=0, acp_stats_every=0)
    train(train_preset("cpu-tiny", run_dir=root / "base", steps=2, model=model, **common))
    args = f"train cpu-tiny --run-dir {root / 'dcp'} --data-dir {root / 'data'} --init-from {root / 'base'}"
    args += " --model.attention dcp --model.no-acp --model.dcp-beta-init -0.3 --model.dcp-r 8"
    cli_main(
        [*args.split(), "--dcp.gamma", "0.5", "--steps", "2", "--val-every", "0", "--checkpoint-every", "0"]
    )
    return root / "dcp"


def test_a_dcp_run_frees_what_it_drops_on_validation_prompts(tmp_path, dcp_run):
    """The paged steps traced whole (aot_eager: fullgraph, no code generation)."""
    cfg = _cfg(
        tmp_path,
        run=dcp_run,
        workloads=("2x40",),
        prompts="validation",
        policies=("dense", "acp", "dcp"),
        providers=("lapse-compile",),
        compile_backend="aot_eager",
    )
    results = run(cfg)
    (row,) = results["rows"]
    assert "dcp-llama" in row["arch"] and row["lapse-compile"] > 0
    assert "paged-acp" not in row  # no gates to read: skipped
    assert row["kv-dense"] > 0.9 and row["kv-dcp"] < 0.8 * row["kv-dense"]
    # the interaction keys and drop flags ride in the same pages: against a softmax model's
    # keys and values alone the share is larger
    assert row["kv-vs-softmax-dcp"] > row["kv-dcp"] and row["kv-vs-softmax-dense"] > 1
    assert results["env"]["prompts"] == "validation"
    assert "validation prompts" in (tmp_path / "results.md").read_text()
    saved = read_run(dcp_run)
    data = prepare_data(
        saved.corpus, saved.tokenizer, vocab_size=320, data_dir=saved.data_dir, progress=False
    )
    window = WindowSampler(shards=data.validation, seq_len=40, batch_size=2, seed=7).batch(0)[0]
    assert torch.equal(_prompts(cfg, saved.model, 2, 40, torch.device("cpu")), window)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="unknown providers"):
        DecodeBenchConfig(providers=("vllm",))
    with pytest.raises(ValueError, match="a workload is BxT"):
        DecodeBenchConfig(workloads=("8-4096",))
    with pytest.raises(ValueError, match="give --run"):
        DecodeBenchConfig(prompts="validation")
    with pytest.raises(ValueError, match=r"^--window is not used by --policies acp h2o; it sets the recent "
                       r"positions kept \(--policies window\)$"):
        DecodeBenchConfig(policies=("acp", "h2o"), window=8)
    with pytest.raises(ValueError, match="^--budget and --every are not used without --policies; "):
        DecodeBenchConfig(budget=0.5, every=4)
    DecodeBenchConfig(policies=("acp", "h2o"), budget=0.5, every=4)
    with pytest.raises(ValueError, match="^--window is not used by --policies acp"):  # typed at its default
        DecodeBenchConfig(policies=("acp",), window=1024)


def test_castle_fold_every_reaches_the_random_init_models():
    """``--castle-fold-every`` sets the deferred lookahead update of the CASTLE layers it
    builds; other architectures carry the field unused."""
    from lapse.bench.decode import _model
    from lapse.layers import CastleAttention

    cfg = DecodeBenchConfig(preset="gpu-20m", device="cpu", castle_fold_every=8)
    model_cfg, model = _model(cfg, "castle", 64, torch.device("cpu"), torch.float32)
    layers = [m for m in model.modules() if isinstance(m, CastleAttention)]
    assert model_cfg.castle_fold_every == 8 and layers
    assert all(m.fold_every == 8 for m in layers)
    model_cfg, _ = _model(cfg, "transformer-llama", 64, torch.device("cpu"), torch.float32)
    assert model_cfg.attention == "softmax"


def test_run_leaves_the_recompile_limit_as_it_was(tmp_path):
    """The bench raises Dynamo's recompile limit for its own compiles only."""
    config = torch._dynamo.config
    before = config.recompile_limit
    run(DecodeBenchConfig(preset="tiny", archs=("fox-pro",), workloads=("1x16",), providers=("lapse",),
                          steps=1, warmup=0, device="cpu", out_dir=tmp_path))
    assert config.recompile_limit == before
