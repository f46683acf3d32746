"""The settings of the benchmarks: ``lapse bench attention`` (:mod:`.attention`), ``lapse
bench decode`` (:mod:`.decode`), ``lapse bench train`` (:mod:`.training`) and ``lapse bench
serve`` (:mod:`.serving`).

Kept apart from the benchmarks, which import torch: the ``lapse`` command line builds its
options from this module alone.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import urlsplit

import tyro

from lapse.generation.policies.options import unused_flags

if TYPE_CHECKING:
    from .workloads import WorkloadSpec

Provider = Literal[
    "lapse",
    "lapse-acp",
    "sdpa-default",
    "sdpa-flash",
    "sdpa-efficient",
    "sdpa-cudnn",
    "flash-attn-4",
    "flash-attn-4-acp",
    "flex",
    "flex-flash",
    "fla",
    "castle-triton",
    "castle-torch",
    "castle-naive",
    "castle-swl-triton",
    "castle-triton-parallel",
    "castle-swl-triton-parallel",
    "lookahead-keys-attention",
]
Mode = Literal["fwd", "fwd+bwd"]
SOFTMAX_BASELINES: tuple[Provider, ...] = (
    "sdpa-default", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flash-attn-4"
)
"""Causal softmax attention without a gate: the ratios are taken against the fastest."""
ATTENTION_PROVIDERS: tuple[Provider, ...] = (
    "lapse", "lapse-acp", *SOFTMAX_BASELINES, "flash-attn-4-acp", "flex", "fla"
)
"""The default providers (forgetting attention and its peers)."""
PROVIDER_ALIASES: dict[str, Provider] = {"sdpa": "sdpa-flash"}
"""Older names still accepted by --providers."""


@dataclass(kw_only=True)
class AttentionBenchConfig:
    """Time forgetting attention against its peers on the benchmark workload
    (``lapse.bench.workloads``)."""

    seq_lens: tuple[int, ...] = (4096, 8192, 16384)
    """Sequence lengths T, one workload each (B = tokens / T). Ignored with --varlen."""
    tokens: int = 32768
    """Tokens per batch, B x T."""
    heads: int = 24
    """Query heads HQ."""
    kv_heads: int | None = None
    """Key/value heads H (grouped-query attention when < heads); None means heads."""
    head_dim: int = 64
    """Head dim D."""
    varlen: bool = False
    """One packed workload of 8 sequences of mixed lengths summing to --tokens."""
    providers: tuple[Provider | Literal["sdpa"], ...] = ATTENTION_PROVIDERS
    """Providers to time (fla and flash-attn-4 are reported n/a when not importable); 'sdpa'
    means 'sdpa-flash'."""
    modes: tuple[Mode, ...] = ("fwd", "fwd+bwd")
    """What to time: the forward alone, and/or the forward followed by the backward."""
    acp_bound: Literal["auto", "qk-norm"] = "auto"
    """ACP bound U: 'auto' (from the largest query/key norms, measured inside the timed
    call: what a layer without a known bound pays), or 'qk-norm' (the known U = D * scale
    of unit-gain QK-norm, times the factor for 16-bit rounding of qk_norm_bound, passed as
    a float)."""
    acp_eps: float = math.exp(-10)
    """ACP's bound on the pruned attention mass per row."""
    castle_window: int = 512
    """CASTLE-SWL's lookahead window W (``castle-swl-triton``)."""
    castle_naive_max_t: int = 2048
    """``castle-naive`` (O(T^3), T x T buffers) runs only up to this sequence length."""
    warmup_ms: int = 25
    """do_bench warmup, in ms."""
    rep_ms: int = 100
    """do_bench measuring time, in ms."""
    graph_times: bool = False
    """Also time lapse and SDPA replayed from a CUDA graph: their kernels' GPU time, without
    the host's launches (an eager call whose launches take longer than its kernels measures
    the host; ACP's forward+backward at 4k comes near that). Opt-in: on an H200 the two
    timings agreed within 4% in all but two cells of the base workload."""
    profile: bool = False
    """Also run each timed call a few more times under ``torch.profiler`` and write
    profile.md beside results.md: per workload, provider and mode, every kernel's GPU time per
    call (on a CPU, every operator's own CPU time), their sum against the timed ms (the rest is
    time the GPU waited), and on CUDA the host's time to issue one call. Shows what a call
    spends outside its main kernels: small launches, passes ACP does not shrink, host gaps."""
    sweep: tuple[Literal["fwd", "bwd"], ...] = ()
    """Also time the FoX Triton kernels' tile options on each workload and write sweep.md
    beside results.md: ``fwd`` the forward kernel, ``bwd`` the dK/dV and the dQ kernel; dense
    where ``lapse`` is timed, with ACP where ``lapse-acp`` is; each option against its table's
    config (``triton_fwd.fwd_config``, ``triton_bwd.bwd_config``), its outputs checked against
    the table's first (``lapse.bench.sweep``). Minutes a workload: every option compiles."""
    seed: int = 0
    """Seed of the workload and of dO."""
    check: bool = True
    """Check every gated provider against FlexAttention before timing it."""
    check_tol: float = 2e-2
    """Largest relative error (Frobenius) of outputs allowed by the check."""
    grad_check_tol: float = 5e-2
    """Largest relative error of gradients (dq, dk, dv, dlog_fgate) allowed by the check."""
    out_dir: Path | None = None
    """Where results.json and results.md go; default runs/bench/attention/<workload>.
    Rewritten after every workload: a run cut off leaves the workloads it finished, in
    place of any earlier files there."""
    commit: str | None = None
    """Commit to record; default `git rev-parse HEAD` when that works."""

    def __post_init__(self) -> None:
        if not self.providers:
            raise ValueError("providers must name at least one provider")
        self.providers = tuple(dict.fromkeys(PROVIDER_ALIASES.get(p, p) for p in self.providers))
        if not self.modes:
            raise ValueError("modes must name at least one of 'fwd', 'fwd+bwd'")
        if not 0 < self.acp_eps < 1:
            raise ValueError(f"acp_eps must be in (0, 1), got {self.acp_eps}")
        if self.castle_window < 1:
            raise ValueError(f"castle_window must be >= 1, got {self.castle_window}")
        self.sweep = tuple(dict.fromkeys(self.sweep))
        if self.sweep and not {"lapse", "lapse-acp"} & set(self.providers):
            raise ValueError("sweep times the FoX kernels dense where 'lapse' is timed and with ACP where "
                             "'lapse-acp' is: name one of them in providers")
        for spec in self.specs():  # validates the shapes early
            del spec

    def specs(self) -> list[WorkloadSpec]:
        from .workloads import WorkloadSpec

        common = dict(tokens=self.tokens, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        if self.varlen:
            return [WorkloadSpec(varlen=True, **common)]
        return [WorkloadSpec(seq_len=t, **common) for t in self.seq_lens]

    def command(self) -> str:
        """The command line that reproduces this configuration."""
        parts = ["lapse bench attention"]
        if self.varlen:
            parts.append("--varlen")
        else:
            parts.append("--seq-lens " + " ".join(map(str, self.seq_lens)))
        parts.append(f"--tokens {self.tokens} --heads {self.heads}")
        if self.kv_heads is not None:
            parts.append(f"--kv-heads {self.kv_heads}")
        parts.append(f"--head-dim {self.head_dim}")
        parts.append("--providers " + " ".join(self.providers))
        parts.append("--modes " + " ".join(self.modes))
        parts.append(f"--acp-bound {self.acp_bound}")
        if self.acp_eps != math.exp(-10):
            parts.append(f"--acp-eps {self.acp_eps!r}")
        if self.castle_window != 512:
            parts.append(f"--castle-window {self.castle_window}")
        if self.castle_naive_max_t != 2048:
            parts.append(f"--castle-naive-max-t {self.castle_naive_max_t}")
        if (self.warmup_ms, self.rep_ms) != (25, 100):
            parts.append(f"--warmup-ms {self.warmup_ms} --rep-ms {self.rep_ms}")
        if self.seed:
            parts.append(f"--seed {self.seed}")
        if self.graph_times:
            parts.append("--graph-times")
        if self.profile:
            parts.append("--profile")
        if self.sweep:
            parts.append("--sweep " + " ".join(self.sweep))
        return " ".join(parts)


DECODE_PROVIDERS = ("lapse", "lapse-compile", "hf-llama-compile", "hf-llama-eager")
# the flags each timed policy reads (decode._policy passes them), and their values where not given
POLICY_FLAGS = {"dense": (), "window": ("window", "every"), "acp": ("every",), "h2o": ("budget", "every"),
                "a2sf": ("budget", "every"), "dcp": ("every",)}
POLICY_DEFAULTS = {"budget": 0.2, "window": 1024, "every": 16}


def _given(metavar: str, default) -> object:
    """A policy field's flag, ``None`` until given; its help names the value it stands for."""
    return tyro.conf.arg(metavar=metavar, help_behavior_hint=f"(default: {default})")


@dataclass(kw_only=True)
class DecodeBenchConfig:
    """What to time: model shapes, architectures, workloads, providers."""

    preset: str = "125m"
    """Model preset (random init) whose shapes are timed."""
    run: Path | None = None
    """A trained run folder (its newest intact checkpoint) timed instead of random-init
    presets (``archs`` and ``preset`` are then ignored): eviction policies such as
    ``acp`` evict what the trained gates forget, ``dcp`` what the trained interaction
    mask drops (a model fine-tuned with ``--model.attention dcp``)."""
    prompts: Literal["random", "validation"] = "random"
    """The prompts: uniform random tokens, or (``validation``, with ``run``) windows of the
    run's validation data, the text its gates and masks were trained on: what they keep
    or drop of random tokens says little about text."""
    archs: tuple[str, ...] = ("fox-pro", "transformer-pro")
    """Architectures of the lapse providers."""
    workloads: tuple[str, ...] = ("8x4096", "4x16384", "2x32768")
    """``BxT``: batch and prompt length."""
    providers: tuple[str, ...] = DECODE_PROVIDERS
    """Any of ``lapse``, ``lapse-compile``, ``hf-llama-compile``, ``hf-llama-eager``."""
    policies: tuple[str, ...] = ()
    """Eviction policies timed over the paged store, compiled (``dense``, ``window``,
    ``acp``, ``h2o``, ``a2sf`` with their defaults below), beside the dense store."""
    budget: Annotated[float | None, _given("FLOAT", POLICY_DEFAULTS["budget"])] = None
    """h2o / a2sf budget (share of the prompt)."""
    window: Annotated[int | None, _given("INT", POLICY_DEFAULTS["window"])] = None
    """window policy: recent positions kept (4 sinks)."""
    every: Annotated[int | None, _given("INT", POLICY_DEFAULTS["every"])] = None
    """Evict every this many steps (timed: eviction is part of the cost)."""
    steps: int = 32
    """Timed decode steps per measurement."""
    warmup: int = 4
    """Untimed steps first (compilation, CUDA-graph recording)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weights and activations."""
    device: str = "cuda"
    """Where to run (``cpu`` works, for a dry run)."""
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"
    """Of the compiled steps (``lapse-compile``, ``paged-*``) and eviction passes:
    ``aot_eager`` traces them (the steps whole, ``fullgraph``) without generating code or
    CUDA graphs, for a CPU dry run; ``inductor`` compiles the passes on CUDA only."""
    castle_fold_every: int | None = None
    """Random-init models: ``ModelConfig.castle_fold_every``, the deferred lookahead update
    of CASTLE models every this many steps (other architectures ignore it)."""
    bandwidth: float | None = None
    """HBM bytes/s for the limit; ``None``: from the device name (H100 3.35e12, H200 4.8e12)."""
    out_dir: Path = Path("runs/bench/decode")
    """Where ``results.json`` and ``results.md`` go."""
    commit: str | None = None
    """The commit to record; ``None``: ``git rev-parse`` of the working directory (on a
    machine that received a copy of the tree, pass the real one)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.providers) - set(DECODE_PROVIDERS))
        if unknown:
            raise ValueError(f"unknown providers {unknown}; valid: {DECODE_PROVIDERS}")
        unknown = sorted(set(self.policies) - set(POLICY_FLAGS))
        if unknown:
            raise ValueError(f"unknown policies {unknown}; valid: {tuple(POLICY_FLAGS)}")
        for w in self.workloads:
            parts = w.split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"a workload is BxT with positive integers (e.g. 8x4096), got {w!r}")
        if self.prompts == "validation" and self.run is None:
            raise ValueError("prompts='validation' reads a trained run's validation data: give --run")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        # None until given, so that one typed at its default value is refused too where no policy
        # reads it: it would time the policies as if it were not given
        unused = [name for name in POLICY_DEFAULTS if getattr(self, name) is not None
                  and not any(name in POLICY_FLAGS[p] for p in self.policies)]
        if unused:
            where = f"by --policies {' '.join(self.policies)}" if self.policies else "without --policies"
            raise ValueError(unused_flags(unused, where, POLICY_FLAGS, option="--policies"))

    def value(self, name: str):
        """Policy field ``name`` (``budget``, ``window``, ``every``) as given, else its default."""
        given = getattr(self, name)
        return POLICY_DEFAULTS[name] if given is None else given


# "transformer": the same sizes as a Transformer of the same block type (RoPE, SDPA with its
# default backend: cuDNN on an H100), freshly initialised: the reference for what the rest
# of the model costs. "dcp": that
# Transformer under DCP fine-tuning.
# "transformer-torchcp": that Transformer under torch's own context parallelism (--cp > 1).
# "-compile": torch.compile per block; "-cudagraphs": its reduce-overhead mode (CUDA graphs)
MODES = {"": False, "-compile": True, "-cudagraphs": "reduce-overhead"}
VARIANTS = (*(f"{v}{c}" for v in ("dense", "acp", "transformer", "dcp") for c in MODES),
            "transformer-torchcp", "transformer-torchcp-compile")


@dataclass(kw_only=True)
class TrainBenchConfig:
    """What to time: a model, its weights and data, the batch, the variants."""

    run: Path | None = None
    """A training run folder: its model config, last checkpoint and validation data. ``None``:
    a fresh ``preset`` model on random tokens."""
    preset: str = "125m"
    """Model preset when ``run`` is ``None``."""
    arch: Literal["fox-llama", "fox-pro", "transformer-llama", "transformer-pro"] = "fox-pro"
    """Architecture when ``run`` is ``None`` (``dense``/``acp`` need a FoX one; ``transformer``
    and ``dcp`` take its block type with softmax / DCP attention)."""
    seq_len: int = 16384
    """T, tokens per row."""
    batch_size: int = 8
    """Rows per optimizer step."""
    micro_batch_size: int = 1
    """Rows per forward/backward."""
    steps: int = 6
    """Timed steps per variant (in rounds: one step of each variant per round)."""
    warmup: int = 2
    """Untimed steps per variant first (autotuning, compilation, allocator growth)."""
    variants: tuple[str, ...] = ("dense", "acp")
    """Any of ``dense``, ``acp``, ``transformer`` (the same sizes with RoPE and SDPA, its default
    backend, instead of forgetting attention), ``dcp`` (that Transformer fine-tuned with DCP), each
    optionally with ``-compile`` (``torch.compile`` per block) or ``-cudagraphs`` (its
    ``reduce-overhead`` mode: each block's graph replayed as a CUDA graph); with ``cp`` > 1 on
    CUDA also ``transformer-torchcp`` (optionally ``-compile``): the ``transformer`` variant under
    torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``,
    its ring attention in place of SDPA) instead of lapse's."""
    cp: int = 1
    """Processes per row (context parallelism): each of ``cp`` processes holds two mirrored
    chunks of every row (``lapse.layers.ContextParallel``); run under ``torchrun
    --nproc-per-node N`` with ``N`` a multiple of ``cp``: ``N / cp`` data-parallel groups
    share each step's rows, and FSDP2 shards the weights over all ``N`` processes (``cp``
    1 under torchrun: plain FSDP2 data parallelism)."""
    cp_mode: Literal["head", "gather"] = "head"
    """How lapse's variants attend across the ``cp`` processes: ``head`` (an all-to-all over
    heads, as ``lapse train --cp`` by default) or ``gather`` (an all-gather of the keys,
    values and forget gates)."""
    acp_eps: float | None = None
    """ACP tolerance; ``None``: the model config's."""
    dcp_alpha: float = 4.0
    """The alpha-sigmoid's alpha in the ``dcp`` steps (not 1 or 2: those are closed forms)."""
    dcp_gamma: float = 0.1
    """DCP's sparsity weight in the ``dcp`` steps."""
    dcp_r: int = 64
    """DCP's interaction dim in the ``dcp`` steps."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward (what ``lapse train
    --activation-checkpointing`` does): less memory (760M at 16k fits), more FLOPs (MFU
    still counts the model's FLOPs once). Not with ``-cudagraphs`` variants."""
    profile: bool = False
    """After timing, one more step of each variant under ``torch.profiler`` (every process
    runs it; the first one records): ``profile.md`` beside results.md with the step's wall
    time, the device's busy time (the sum of its kernels) and the ops that took the most,
    and ``trace-VARIANT.json.gz`` (a Chrome trace) per variant."""
    commit: str | None = None
    """The commit to record; ``None``: ``git rev-parse`` of the working directory (on a
    machine that received a copy of the tree, pass the real one)."""
    lr: float = 1e-4
    """Learning rate of the timed steps (small: the weights barely move while timing)."""
    peak_tflops: float | None = None
    """One device's peak dense bf16 TFLOP/s, for MFU; ``None``: from the device name (no MFU
    when unknown, e.g. on a CPU: TFLOP/s are still shown)."""
    out_dir: Path = Path("runs/bench/train")
    """Where ``results.json`` and ``results.md`` go."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown:
            raise ValueError(f"unknown variants {unknown}; valid: {VARIANTS}")
        if not math.isfinite(self.dcp_alpha) or self.dcp_alpha < 1:
            raise ValueError(f"dcp_alpha must be a finite number >= 1, got {self.dcp_alpha!r}")
        if not math.isfinite(self.dcp_gamma) or self.dcp_gamma < 0:
            raise ValueError(f"dcp_gamma must be a finite number >= 0, got {self.dcp_gamma!r}")
        for name in ("seq_len", "batch_size", "micro_batch_size"):  # seq_len was named max_seq_len
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size {self.micro_batch_size} must divide batch_size {self.batch_size}"
            )
        if self.cp < 1:
            raise ValueError(f"cp must be a positive integer, got {self.cp}")
        if self.cp_mode not in ("head", "gather"):
            raise ValueError(f"cp_mode must be 'head' or 'gather', got {self.cp_mode!r}")
        torch_cp = [v for v in self.variants if v.startswith("transformer-torchcp")]
        if torch_cp and self.cp == 1:
            raise ValueError(f"{torch_cp[0]} is torch's context parallelism across processes: give "
                             "--cp N > 1 (under torchrun)")
        graphed = [v for v in self.variants if v.endswith("-cudagraphs")]
        if graphed and self.cp > 1:
            raise ValueError(f"{graphed[0]} does not run with cp > 1 (the graphs would hold FSDP's gathered "
                             "weights): use -compile")
        if graphed and self.activation_checkpointing:
            raise ValueError(
                f"{graphed[0]} does not work with activation_checkpointing (the graphs fail to record)"
            )


@dataclass(kw_only=True)
class ServeBenchConfig:
    """A load of streamed completions against ``lapse serve``, over HTTP only: a server already
    running at ``--url``, or one started here from ``--serve`` and stopped at the end."""

    url: Annotated[str | None, _given("URL", "http://127.0.0.1:8000")] = None
    """Base URL of a running server. Not with ``--serve``."""
    serve: str | None = None
    """Instead of ``--url``: the arguments of ``lapse serve`` (one string, e.g. ``"runs/fox
    --policy h2o --budget 0.2 --max-batch 16"``); the server runs as a subprocess on a free
    loopback port (its output in ``serve.log`` under ``--out-dir``) and is stopped at the end."""
    startup_timeout: float = 300.0
    """Seconds the started server may take to answer ``/health`` (loading, compiling)."""
    num_requests: int = 64
    """Requests sent."""
    faults: int = 0
    """Requests that fail on purpose, spread among the load, in turn: a body that is not JSON,
    an unknown policy in ``"lapse"``, ``max_tokens`` 0, a prompt over the context (each should
    get a 400), and a stream dropped after its first chunk. Reported with the answers they got,
    the 5xx answers of the whole run and the KV pages still held once the server is idle."""
    warmup: int = 1
    """Untimed requests sent first, one after another (the server's first steps compile its
    decode step and record its CUDA graph); not in the results."""
    prompt_len: int = 128
    """Prompt tokens of each request: ids drawn from 32..126 (printable ASCII, ids every byte
    and BPE tokenizer has)."""
    output_len: int = 128
    """``max_tokens`` of each request (fewer come back where the model ends its text)."""
    concurrency: Annotated[tuple[int, ...] | None, _given("INT [INT ...]", 8)] = None
    """At most this many requests in flight; several values: one load at each, against the
    same server, one after another (a column each in the table). Not with ``--rate``."""
    rate: float | None = None
    """Instead of ``--concurrency``: Poisson arrivals, this many requests per second on average."""
    temperature: float = 1.0
    """Sampling temperature; every request has a seed of its own (``--seed`` + its index)."""
    seed: int = 0
    """Seeds the prompts, the arrival times and the requests' sampling."""
    request_timeout: float = 600.0
    """Seconds a request may take before it counts as failed (``timeout``)."""
    metrics_interval: float = 0.2
    """Seconds between two reads of the server's ``/metrics`` (peak pages and running requests)."""
    out_dir: Path = Path("runs/bench/serve")
    """Where ``results.json`` and ``results.md`` go."""
    commit: str | None = None
    """The commit to record; ``None``: ``git rev-parse`` of the working directory."""

    def __post_init__(self) -> None:
        if self.url is not None and self.serve is not None:
            raise ValueError("give --url (a running server) or --serve (one to start), not both")
        parts = urlsplit(self.base_url())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http://HOST[:PORT], got {self.url!r}")
        if self.serve is not None:
            args = shlex.split(self.serve)
            if not args:
                raise ValueError("--serve is empty: give the arguments of lapse serve (a run folder first)")
            taken = [a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in ("--host", "--port")]
            if taken:
                raise ValueError(f"--serve may not set {taken[0]}: the benchmark picks a free loopback port")
        for name in ("num_requests", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.faults < 0:
            raise ValueError(f"faults must be at least 0, got {self.faults}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be at least 0, got {self.warmup}")
        if self.concurrency is not None and self.rate is not None:
            raise ValueError("give --concurrency or --rate, not both")
        if self.concurrency is not None and (not self.concurrency or min(self.concurrency) < 1):
            raise ValueError(f"concurrency must be one or more counts of at least 1, got {self.concurrency}")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a positive number of requests per second, got {self.rate}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("startup_timeout", "request_timeout", "metrics_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive (seconds), got {getattr(self, name)}")

    def base_url(self) -> str:
        """``--url`` without a trailing slash, or its default."""
        return (self.url or "http://127.0.0.1:8000").rstrip("/")

    def in_flight(self) -> int | None:
        """The concurrency limit of a load of one level (the first); ``None`` under ``--rate``."""
        return None if self.rate is not None else (self.concurrency or (8,))[0]

    def levels(self) -> list[ServeBenchConfig]:
        """One config per concurrency level (one under ``--rate``)."""
        if self.concurrency is None or len(self.concurrency) == 1:
            return [self]
        return [dataclasses.replace(self, concurrency=(c,)) for c in self.concurrency]
