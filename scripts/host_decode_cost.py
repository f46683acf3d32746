"""Host time per decode step of the Hugging Face path on the CPU (issue 15): a tiny random
Llama (16 layers of width 64, so the arithmetic is negligible), one thread, HF's
DynamicCache against lapse's EvictingCache (Dense, H2O). lapse's GPU decode against
kvpress is bound by the host (BENCHMARKS.md, "Fifth session"), which this isolates.
With a case name as argument, also a cProfile of that case.

    python scripts/host_decode_cost.py [lapse-dense]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lapse.generation.policies import H2O, Dense
from lapse.hf import CACHE_ARG, EvictingCache

BATCH, PROMPT, STEPS, WARMUP = 4, 256, 48, 4


def next_token(model, tok, cache):
    out = model(input_ids=tok, **{CACHE_ARG: cache}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def ms_per_step(model, ids, cache, profile: cProfile.Profile | None = None) -> float:
    tok = next_token(model, ids, cache)  # the prefill
    for _ in range(WARMUP):
        tok = next_token(model, tok, cache)
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        tok = next_token(model, tok, cache)
    ms = (time.perf_counter() - t0) / STEPS * 1e3
    if profile is not None:
        profile.disable()
    return ms


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT))
    room = PROMPT + WARMUP + STEPS + 8
    cases = {  # DynamicCache first: an EvictingCache switches the model's attention to lapse's
        "dynamic": lambda: DynamicCache(),
        "lapse-dense": lambda: EvictingCache(Dense(), model=model, max_context=room),
        "lapse-h2o": lambda: EvictingCache(H2O(budget=64, recent=8, every=16), model=model, max_context=room),
    }
    for name, make in cases.items():
        print(f"{name}: {ms_per_step(model, ids, make()):.2f} ms per step")
    if len(sys.argv) > 1:
        profile = cProfile.Profile()
        ms_per_step(model, ids, cases[sys.argv[1]](), profile)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
