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
from pathlib import Path

import torch
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

from .config import GenerateConfig
from .generate import check_policy_fits, generate, paged_store_for, supports_paged
from .policies import Dense, Policy


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
    completions, tokens, seconds, held, dense, longest = [], 0, 0.0, 0, 0, 0
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
            longest = max(longest, out.shape[1] - ids.shape[1])
            progress.update(len(batch))
            if cfg.prompt is not None:
                print(flush=True)
    progress.close()
    return print_summary(tokens, seconds, held, dense, cfg.policy, policy,
                         page_size=getattr(store, "page_size", None), new_tokens=longest)


def print_summary(
    tokens: int,
    seconds: float,
    held: int,
    dense: int,
    name: str,
    policy: Policy,
    *,
    page_size: int | None = None,
    new_tokens: int | None = None,
) -> dict:
    """Prints the closing line (tokens/s, KV bytes held against a dense cache's; with
    ``page_size``, both counted in whole pages of a paged store: ``PagedStore.bytes_held`` and
    ``bytes_if_dense``); returns it as a dict. ``new_tokens``: the most a prompt generated,
    to say when the run ended before the policy's first pass after the prompt's cut (its
    share is then the prompt's cut alone)."""
    summary = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "kv_bytes": held,
        "kv_bytes_dense": dense,
        "kv_share": held / max(dense, 1),
        "policy": repr(policy),
    }
    pages = "" if page_size is None else f"; both in whole pages of {page_size} tokens"
    # the passes run before decode steps 0, every, 2 * every, ... (step 0: the prompt's cut)
    short = new_tokens is not None and not policy.keeps_all and new_tokens - 1 <= policy.every
    note = (f"; the prompt's cut only: the next pass comes after {policy.every} steps (--every), "
            f"this run made {max(new_tokens - 1, 0)}" if short else "")
    print(
        f"{tokens} tokens in {seconds:.2f} s: {summary['tokens_per_s']:.1f} tokens/s; KV held "
        f"{held / 2**20:.2f} MiB, {100 * summary['kv_share']:.1f}% of a dense cache ({name}{pages}{note})"
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
