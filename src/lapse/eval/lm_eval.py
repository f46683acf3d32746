"""lm-evaluation-harness on lapse models: the ``lapse`` model type and :func:`run_lm_eval`.

Importing this module registers :class:`LapseLM` with lm-eval (the ``lm_eval`` package)
under the name ``"lapse"``, so its tasks run on any model :func:`lapse.eval.load_model`
opens::

    import lapse.eval.lm_eval  # registers "lapse"
    import lm_eval

    lm_eval.simple_evaluate(model="lapse", model_args={"pretrained": "runs/cpu-small"},
                            tasks=["lapse_tiny_mc"], task_manager=...)

:func:`run_lm_eval` does that from an :class:`LmEvalConfig` (a typed config a CLI can
parse) and writes ``results.json`` and ``summary.md``. lm-eval itself does the prompting,
few-shot sampling and metrics; the adapter only answers its three request types:

- ``loglikelihood(context, continuation)``: ``(sum of log p(continuation tokens), is_greedy)``.
  lm-eval's ``TemplateLM`` tokenises ``context + continuation`` together and splits it;
  trailing whitespace of the context moves to the continuation (``"x ="`` + ``" 1"`` is
  scored for ``"x = "`` + ``"1"``), and an empty context becomes the ``<eos>`` that starts
  every training document. When the
  pair is longer than the model context ``L``, the context is cut from the left::

      tokens   c0 c1 c2 c3 c4 c5 x0 x1 x2    context c, continuation x, L = 6
      input          c2 c3 c4 c5 x0 x1       the last L + 1 tokens, less the very last
      scored                  1  1  1        the logits that predict x0 x1 x2

- ``loglikelihood_rolling(text)``: the log-likelihood of the whole text, every token
  predicted once, in lm-eval's disjoint windows of at most ``L`` tokens.
- ``generate_until(context, gen_kwargs)``: :func:`lapse.generation.generate` with a
  KV cache, in chunks of :data:`GEN_CHUNK` tokens, stopping at ``<eos>`` or at the
  first of the ``until`` strings (cut off the returned text).

Requests are scored in batches of ``batch_size`` sequences, longest first, right-padded:
the decoder is causal, so padding after a sequence cannot change its logits.

Tasks come from YAML files. The bundled ``lapse_tiny_*`` tasks (``lm_eval_tasks/``, 16
Python-completion questions) are an example and the tests' fixture. lm-eval resolves a
YAML's ``dataset_kwargs: data_files:`` from the *working directory*, but a
``!function`` from the YAML's own folder, so these tasks load their JSONL with a
``custom_dataset`` function beside the YAML (:func:`jsonl_dataset`): nothing is
downloaded, and the folder works from anywhere. The harness's own tasks
(``hellaswag``, ...) run too, when their datasets are in the local Hugging Face cache.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

try:
    import lm_eval.models  # noqa: F401  (the harness's own names first: see LapseLM)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lapse.eval.lm_eval needs lm-evaluation-harness: pip install 'lm_eval>=0.4.13,<0.5' "
        "(or lapse's test extra)"
    ) from e
from tqdm import tqdm

from lapse.eval.common import LoadedModel, check_out_dir, load_model
from lapse.eval.config import LmEvalConfig, _positive_int
from lapse.eval.lm import as_causal_lm, load_lm
from lapse.eval.policy import greedy_continuation, next_logits, streamed_loss
from lapse.files import write_text_atomic
from lapse.generation import Dense, Policy, generate
from lapse.hf import EvictingCache
from lapse.kv import DenseStore
from lapse.ops.backend import resolve_device

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
"""The bundled task YAMLs (``lapse_tiny_mc``, ``lapse_tiny_ppl``, ``lapse_tiny_gen``;
tag ``lapse_tiny``)."""
GEN_CHUNK = 16
"""Tokens generated between two checks for stop strings (``generate_until``)."""
DEFAULT_MAX_GEN_TOKS = 256
"""lm-eval's default generation length when a task gives no ``max_gen_toks``."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# lm_eval.api.registry.get_model imports the harness's model list only while the registry
# is empty; importing lm_eval.models above first keeps "hf" & co. findable after ours.
@register_model("lapse")
class LapseLM(TemplateLM):
    """A lapse model as an lm-eval ``LM``; lm-eval builds it from ``model_args``
    (``pretrained=PATH,batch_size=8,...``).

    Args:
        pretrained: a run folder, checkpoint folder or Hugging Face folder
            (:func:`lapse.eval.load_model`), or an already loaded :class:`LoadedModel`.
            Its tokenizer must have been saved beside it.
        device: where the model runs; default CUDA when available.
        batch_size: sequences per forward pass (an integer; lm-eval's ``auto`` is not
            supported).
        max_length: the context ``L`` requests are cut to (from the left); default the
            model's ``max_seq_len``.
        dtype: ``float32``, ``bfloat16`` or ``float16``; log-probabilities are taken in
            float32 either way.
        max_batch_size: accepted because lm-eval always passes it; unused.
        progress: show the scoring and generation loops' bars (``lapse eval lm-eval
            --no-progress`` turns them off).
    """

    def __init__(
        self,
        pretrained: str | Path | LoadedModel | None = None,
        *,
        hf: str | Path | None = None,
        gguf_file: str | None = None,
        policy: Policy | None = None,
        device: str | None = None,
        batch_size: int | str = 8,
        max_length: int | str | None = None,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        max_batch_size: int | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.progress = progress
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"policy must be a lapse.generation policy, got {type(policy).__name__}")
        self.batch_size = _positive_int("batch_size", batch_size)
        device = resolve_device("auto" if device is None else device)
        if isinstance(pretrained, LoadedModel):
            self.loaded = pretrained
            self.loaded.model.to(device=device, dtype=_DTYPES[dtype]).eval()
        elif hf is None:
            self.loaded = load_model(pretrained, device=device, dtype=_DTYPES[dtype])
        if hf is not None:  # a pretrained Hugging Face model: always through an EvictingCache
            pretrained_lm = load_lm(hf=hf, gguf_file=gguf_file, device=device, dtype=_DTYPES[dtype])
            self.loaded = LoadedModel(model=None, tokenizer=pretrained_lm.tokenizer, name=pretrained_lm.name,
                                      path=pretrained_lm.path)
            self.lm, policy = pretrained_lm.lm, policy or Dense()
        else:
            self.lm = None if policy is None else as_causal_lm(self.loaded.model)
        if self.loaded.tokenizer is None:
            raise ValueError(
                f"no tokenizer beside the model at {self.loaded.path}: lm-eval sends text, "
                "so save the tokenizer with the model"
            )
        self.model = self.loaded.model
        self.policy = policy
        self.tokenizer = self.loaded.tokenizer
        self._device = torch.device(device)
        config = self.loaded.config if self.lm is None else self.lm.config
        limit = config.max_position_embeddings if self.lm is not None else config.max_seq_len
        self._max_length = limit if max_length is None else _positive_int("max_length", max_length)
        self.dtype = dtype

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # lapse tokenizers never add special tokens: add_special_tokens changes nothing
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def get_model_info(self) -> dict:
        """What ``simple_evaluate`` adds to ``results["config"]``."""
        return {
            "lapse_model": self.loaded.name,
            "lapse_path": str(self.loaded.path),
            "max_length": self.max_length,
            "dtype": self.dtype,
            "policy": None if self.policy is None else repr(self.policy),
        }

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """``(sum log p, is_greedy)`` of each ``(key, context_ids, continuation_ids)``,
        in the order given; ``key`` is what the response cache stores it under."""
        # an empty continuation has probability 1 and needs no forward pass
        results: list[tuple[float, bool] | None] = [None if r[2] else (0.0, True) for r in requests]
        todo = [i for i, r in enumerate(requests) if r[2]]
        order = sorted(todo, key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        quiet = disable_tqdm or not self.progress
        bar = tqdm(total=len(todo), desc="lapse loglikelihood", disable=quiet, leave=False)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            windows = [self._window(requests[i][1], requests[i][2]) for i in chunk]
            for i, scored in zip(chunk, self._score(windows), strict=True):
                results[i] = scored
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], scored)
            bar.update(len(chunk))
        bar.close()
        return results

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The model input (at most ``L`` tokens, context cut from the left) and the
        continuation it must predict from its last ``len(continuation)`` positions."""
        if len(continuation) > self.max_length:
            raise ValueError(
                f"a continuation of {len(continuation)} tokens does not fit the model context "
                f"of {self.max_length}"
            )
        if not context:
            raise ValueError("a continuation needs at least one context token to be predicted from")
        tokens = (context + continuation)[-(self.max_length + 1) :]
        return tokens[:-1], continuation

    def _score(self, windows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        if self.policy is not None:
            return [self._score_under_policy(inp, target) for inp, target in windows]
        width = max(len(inp) for inp, _ in windows)
        batch = torch.full((len(windows), width), self.eot_token_id, dtype=torch.long)  # [B, T]
        for j, (inp, _) in enumerate(windows):
            batch[j, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        logits, _ = self.model(batch.to(self.device))  # [B, T, V]
        totals, greedy = [], []
        for j, (inp, target) in enumerate(windows):
            end = len(inp)
            logp = torch.log_softmax(logits[j, end - len(target) : end].float(), dim=-1)  # [N, V]
            target_ids = torch.tensor(target, device=logp.device)  # [N]
            totals.append(logp.gather(-1, target_ids[:, None]).sum())
            greedy.append((logp.argmax(dim=-1) == target_ids).all())
        # one read-back per batch
        return list(zip(torch.stack(totals).tolist(), torch.stack(greedy).tolist(), strict=True))

    def _score_under_policy(self, inp: list[int], target: list[int]) -> tuple[float, bool]:
        """``(sum log p, is_greedy)`` of ``target`` after its context, the context pruned to
        the policy's budget first (the A2SF protocol): the context less its last token is
        prefilled and cut, then the rest fed one token at a time (:func:`streamed_loss`).
        A one-token context has nothing to prune: its prediction comes from its prefill."""
        ids = torch.tensor([inp + target[-1:]], device=self.device)  # [1, n + 1]: context + continuation
        n, k = len(inp), len(target)
        logp, greedy = 0.0, True
        if n == k:  # a one-token context: the first continuation token from its prefill
            cache = EvictingCache(Dense(), model=self.lm, max_context=n)
            first = torch.log_softmax(next_logits(self.lm, ids[:, :1], cache)[0], dim=-1)  # [V]
            logp, greedy = float(first[target[0]]), int(first.argmax()) == target[0]
        if n >= 2:
            prefix = max(1, n - k)
            r = streamed_loss(self.lm, ids, self._policy_for(prefix, n), prefix=prefix, compare=False)
            logp, greedy = logp - float(r.loss.double().sum()), greedy and bool(r.greedy.all())
        return logp, greedy

    def _policy_for(self, prompt_len: int, total: int) -> Policy:
        """The policy, or ``Dense()`` for a request its budget holds whole (a short prompt:
        nothing to prune, which the budgeted policies refuse to run on)."""
        bound = self.policy.max_tokens(prompt_len)
        return Dense() if bound is not None and bound >= total else self.policy

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text (``Instance.args == (text,)``), the first token
        predicted from ``<eos>``, the rest in lm-eval's disjoint windows of ``L`` tokens."""
        owners, windows = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            rolling = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, rolling):
                owners.append(k)
                windows.append((None, context, continuation))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owners, scores, strict=True):
            totals[k] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """The continuation of each ``(context, gen_kwargs)``: greedy unless
        ``do_sample``; ``until`` (stop strings), ``max_gen_toks``, ``temperature`` and
        ``top_k`` are read, other keys are ignored. The context is cut from the left to
        leave room for ``max_gen_toks`` inside ``L`` (``max_gen_toks`` itself is capped
        at ``L - 1``). One request at a time: ``generate`` takes prompts of one length."""
        out = []
        args = [req.args for req in requests]
        quiet = disable_tqdm or not self.progress
        for context, gen_kwargs in tqdm(args, desc="lapse generate", disable=quiet, leave=False):
            text = self._generate_one(context, dict(gen_kwargs))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _generate_one(self, context: str, gen_kwargs: dict) -> str:
        until = gen_kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        max_new = min(int(gen_kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), self.max_length - 1)
        temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample") else 0.0
        top_k = gen_kwargs.get("top_k")
        ids = (self.tok_encode(context) or [self.prefix_token_id])[-(self.max_length - max_new) :]
        if self.policy is not None:  # greedy under the policy, then cut at the first stop
            prompt = torch.tensor([ids if len(ids) > 1 else [self.prefix_token_id, *ids]], device=self.device)
            policy = self._policy_for(prompt.shape[1] - 1, prompt.shape[1] + max_new - 1)
            new = greedy_continuation(self.lm, prompt, max_new, policy)[0].tolist()
            new = new[: new.index(self.eot_token_id)] if self.eot_token_id in new else new
            return _cut_at_stops(self.tok_decode(new), until)
        cache = DenseStore(self.loaded.config.n_layers, capacity=len(ids) + max_new)
        step_input = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        new: list[int] = []
        while len(new) < max_new:
            n = min(GEN_CHUNK, max_new - len(new))
            # the cache holds everything but the last sampled token: it is the next call's prompt
            seq = generate(self.model, step_input, n, temperature=temperature, top_k=top_k, cache=cache)
            new += seq[0, step_input.shape[1] :].tolist()
            step_input = seq[:, -1:]
            if self.eot_token_id in new:
                new = new[: new.index(self.eot_token_id)]
                break
            if any(s in self.tok_decode(new) for s in until):
                break
        return _cut_at_stops(self.tok_decode(new), until)


def _cut_at_stops(text: str, until: list[str]) -> str:
    for stop in until:
        text = text.split(stop, 1)[0]
    return text


def jsonl_dataset(path: str | Path, split: str = "test") -> dict:
    """``{split: datasets.Dataset}`` of the JSON lines in ``path``: what a task YAML's
    ``custom_dataset`` returns. Built in memory; nothing is cached or downloaded."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task data file does not exist: {path}")
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {split: datasets.Dataset.from_list(rows, split=split)}


def task_manager(tasks: Sequence[str], include_path: Path | None = None):
    """An lm-eval ``TaskManager`` that knows ``tasks``: the bundled and ``include_path``
    YAMLs, plus the harness's own only when a task is not among them (indexing its ~15k
    configs takes about 15 s). Raises ``ValueError`` naming unknown tasks."""
    from lm_eval.tasks import TaskManager

    paths = [TASKS_DIR] + ([Path(include_path)] if include_path is not None else [])
    manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=False)
    if any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=[str(p) for p in paths], include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        searched = ", ".join(str(p) for p in paths)
        raise ValueError(f"unknown lm-eval tasks {unknown}: not in {searched}, nor among the harness's")
    return manager


def run_lm_eval(cfg: LmEvalConfig) -> dict:
    """Runs ``cfg.tasks`` on ``cfg.model`` through ``lm_eval.simple_evaluate`` and writes
    ``results.json`` (lm-eval's results without the samples), ``summary.md`` (its metric
    tables) and, with ``log_samples``, ``samples_<task>.jsonl``. Returns what
    ``results.json`` holds."""
    import lm_eval

    out_dir = check_out_dir(cfg.resolved_out_dir, cfg.overwrite)
    manager = task_manager(cfg.tasks, cfg.include_path)
    model_args = {"pretrained": None if cfg.model is None else str(cfg.model), "dtype": cfg.dtype,
                  "hf": cfg.hf, "gguf_file": cfg.gguf_file, "policy": cfg.make_policy(),
                  "progress": cfg.progress}
    if cfg.max_length is not None:
        model_args["max_length"] = cfg.max_length
    start = time.perf_counter()
    with _quiet_git_hash():
        results = lm_eval.simple_evaluate(
            model="lapse",
            model_args=model_args,
            tasks=list(cfg.tasks),
            num_fewshot=cfg.num_fewshot,
            batch_size=cfg.batch_size,
            device=cfg.device,
            limit=cfg.limit,
            task_manager=manager,
            log_samples=cfg.log_samples,
            random_seed=cfg.seed,
            numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed,
            fewshot_random_seed=cfg.seed,
        )
    seconds = time.perf_counter() - start
    samples = results.pop("samples", {}) or {}
    results["lapse"] = {"lm_eval_version": lm_eval.__version__, "seconds": seconds, "policy": cfg.policy}
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=2, default=lm_utils.handle_non_serializable)
    write_text_atomic(out_dir / "results.json", text)
    written = {f"samples_{task}.jsonl" for task in samples}
    for stale in out_dir.glob("samples_*.jsonl"):  # an earlier evaluation's, of other tasks
        if stale.name not in written:
            stale.unlink()
    for task, rows in samples.items():
        lines = (json.dumps(row, default=lm_utils.handle_non_serializable) for row in rows)
        write_text_atomic(out_dir / f"samples_{task}.jsonl", "".join(line + "\n" for line in lines))
    write_text_atomic(out_dir / "summary.md", _summary(cfg, results, seconds))
    return json.loads(text)


@contextlib.contextmanager
def _quiet_git_hash():
    """Inside, lm-eval records the working directory's commit (``results["git_hash"]``) through
    :func:`_git_hash`: its own runs ``git describe`` with git's stderr on the terminal, so
    outside a git folder every evaluation printed ``fatal: not a git repository``."""
    import lm_eval.evaluator

    own = getattr(lm_eval.evaluator, "get_git_commit_hash", None)
    if own is None:  # a harness that records no commit this way
        yield
        return
    lm_eval.evaluator.get_git_commit_hash = _git_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = own


def _git_hash() -> str:
    """``git describe --always`` of the working directory, as lm-eval records it, with git's
    output captured; ``"unknown"`` outside a git folder or without git."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def _summary(cfg: LmEvalConfig, results: dict, seconds: float) -> str:
    name = results.get("config", {}).get("lapse_model", (cfg.model or cfg.hf).name)
    counts = ", ".join(
        f"{task} {n['effective']} of {n['original']}" for task, n in results.get("n-samples", {}).items()
    )
    lines = [
        f"# lm-eval: {name}",
        "",
        f"Model `{cfg.model or cfg.hf}`{_policy_words(results)}; tasks {', '.join(cfg.tasks)}; "
        f"documents: {counts}; "
        f"few-shot {cfg.num_fewshot if cfg.num_fewshot is not None else 'task default'}; "
        f"seed {cfg.seed}; lm-eval {results['lapse']['lm_eval_version']}; {_duration(seconds)}.",
        "",
        lm_utils.make_table(results).strip(),
        "",
    ]
    if results.get("groups"):
        lines += [lm_utils.make_table(results, "groups").strip(), ""]
    return "\n".join(lines)


def _policy_words(results: dict) -> str:
    policy = results.get("config", {}).get("policy")
    return "" if policy is None else f" under `{policy}` (each prompt pruned to its budget before the answer)"


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{math.floor(seconds / 60)} min {seconds % 60:.0f} s"
