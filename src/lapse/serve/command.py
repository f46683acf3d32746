"""``lapse serve``: load the model and tokenizer as ``lapse generate`` does, put them behind
an :class:`~lapse.serve.engine.Engine` over a row batcher, and run uvicorn.

A run folder (or checkpoint, or ``lapse export`` folder) loads with its own tokenizer; an
``--hf`` model loads through :func:`lapse.hf.load_pretrained` and is converted to a lapse
decoder (:func:`lapse.hf.decoder_from_hf`), its tokenizer wrapped as a
:class:`~lapse.data.tokenizer.TransformersTokenizer` (its chat template serves
``/v1/chat/completions``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass

import torch

from lapse.generation.batching import RowBatcher, RowRequest
from lapse.generation.command import load_run_model
from lapse.generation.generate import check_policy_fits, prefill, supports_paged
from lapse.kv import PagedStore
from lapse.models.checkpoint import is_export_folder
from lapse.ops.backend import resolve_device

from .app import ServedModel, build_app
from .config import ServeConfig
from .engine import Engine
from .metrics import ServerMetrics

log = logging.getLogger("lapse.serve")


def load_model(cfg: ServeConfig, device: torch.device):
    """The lapse decoder (on ``device``, in eval mode) and tokenizer that ``cfg`` names."""
    if cfg.hf is not None:
        from lapse.data.tokenizer import TransformersTokenizer
        from lapse.hf import decoder_from_hf, load_pretrained

        hf_model, hf_tokenizer = load_pretrained(cfg.hf, cfg.gguf_file, device=device)
        decoder = decoder_from_hf(hf_model, share=True).to(device).eval()
        return decoder, TransformersTokenizer.wrap(hf_tokenizer, str(cfg.hf))
    if is_export_folder(cfg.model):
        from lapse.data import load_tokenizer
        from lapse.hf import LapseForCausalLM

        if not (cfg.model / "tokenizer").is_dir():
            raise ValueError(f"{cfg.model} has no tokenizer/ folder: was it written by `lapse export`?")
        decoder = LapseForCausalLM.from_pretrained(cfg.model).model
        return decoder.to(device).eval(), load_tokenizer(cfg.model / "tokenizer")
    return load_run_model(cfg.model, device)


def page_bytes(model, policy) -> int:
    """Bytes one page takes summed over the layers (keys, values and every per-slot pool the
    policy's store keeps), measured on a store that took a two-token prompt."""
    # the policy's own store shape refuses so short a prompt (a budget above it); the pools
    # depend only on the model and whether the policy keeps scores
    store = PagedStore(model.config.n_layers, max_context=2, pages=model.config.kv_heads,
                       score_decay=policy.score_decay)
    device = next(model.parameters()).device
    with torch.inference_mode():
        prefill(model, torch.zeros(1, 2, dtype=torch.long, device=device), store)
    return sum(pool[0].numel() * pool.element_size()
               for i in range(store.n_layers) if store.k[i] is not None
               for pool in (store.k[i], store.v[i], *store.extras[i].values()))


@contextlib.contextmanager
def _decoding(model, compile: bool):
    """The engine thread's torch state for its life: inference mode (grad mode is per
    thread) and the fused projections that ``generate`` decodes with."""
    with torch.inference_mode(), model.fused_projections(keep=compile):
        yield


@dataclass
class Server:
    """What :func:`build_server` made: the app to hand to uvicorn and the engine under it."""

    app: object
    engine: Engine
    model: ServedModel


def build_server(cfg: ServeConfig, loaded=None) -> Server:
    """The engine (started) and the app for ``cfg``; ``loaded``: the model and tokenizer
    instead of loading ``cfg``'s (tests)."""
    device = resolve_device(cfg.device)
    model, tokenizer = loaded if loaded is not None else load_model(cfg, device)
    policy = cfg.make_policy()
    if supports_paged(model) or not policy.keeps_all:
        check_policy_fits(model, policy)
    else:
        raise ValueError(f"a {model.config.name} model decodes over a DenseStore only: lapse serve needs "
                         "the paged store (its pages are what requests share)")
    max_context = cfg.max_context or model.config.max_seq_len
    pages = cfg.kv_pages
    if cfg.kv_memory is not None:
        pages = int(cfg.kv_memory * 2**30 // page_bytes(model, policy))
        if pages < 1:
            raise ValueError(f"--kv-memory {cfg.kv_memory} GiB holds no page of this model")
    batcher = RowBatcher(model, policy, rows=cfg.max_batch, pages=pages, max_context=max_context,
                         compile=cfg.compile)
    name = cfg.model_name()
    metrics = ServerMetrics(name)
    warm = cfg.compile or device.type == "cuda"  # compiled steps, graphs and Triton kernels
    engine = Engine(batcher, tokenizer, eos_id=tokenizer.eos_id, max_waiting=cfg.max_waiting,
                    max_prefill_tokens=cfg.max_prefill_tokens,
                    warmup=(lambda: warm_up(batcher)) if warm else None,
                    observer=metrics, setup=lambda: _decoding(model, cfg.compile)).start()
    served = ServedModel(name=name, max_context=max_context, vocab_size=model.config.vocab_size,
                         policy=policy, policy_name=cfg.policy, make_request=RowRequest)
    return Server(build_app(engine, tokenizer, served, metrics), engine, served)


def warm_up(batcher: RowBatcher) -> None:
    """One request through ``batcher``, then its row released: the decode step compiles and
    records its CUDA graph, the eviction pass its own (a request long enough for one pass),
    and the Triton kernels build, before the first client waits for them. A batcher that
    can take no such request is left cold (logged)."""
    policy = batcher.policy
    steps = min(2 if policy.keeps_all else policy.every + 2, batcher.max_context - 2)
    for length in (min(1024, batcher.max_context // 2), batcher.max_context - steps - 1):
        req = RowRequest([0] * max(length, 1), steps)
        try:
            batcher.check(req)
        except ValueError:
            continue
        if batcher.can_admit(req):
            break
    else:
        log.warning("no warm-up request fits this server: the first requests compile the decode step")
        return
    start = time.perf_counter()
    log.info("warming up: one request of %d + %d tokens through the decode step", len(req.prompt), steps)
    with warnings.catch_warnings():  # a policy's remarks on this made-up request are not the user's
        warnings.simplefilter("ignore")
        row, _ = batcher.admit(req)
        for _ in range(steps - 1):
            batcher.step()
        batcher.release(row)
    log.info("warmed up in %.1f s", time.perf_counter() - start)


def run_serve(cfg: ServeConfig) -> None:
    """Serves until Ctrl-C (uvicorn's shutdown), then stops the engine."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    server = build_server(cfg)
    log.info("serving %s (policy %s, %d rows, %d KV pages) on http://%s:%d/v1", server.model.name,
             cfg.policy, server.engine.batcher.rows, server.engine.batcher.pages_total(), cfg.host, cfg.port)
    try:
        uvicorn.run(server.app, host=cfg.host, port=cfg.port, log_level=cfg.log_level)
    finally:
        server.engine.stop()

