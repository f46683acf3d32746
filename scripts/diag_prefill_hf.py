"""Where lapse's prefill of a Hugging Face model spends its time (issue 15's prefill target).

On the lent GPU kvpress's prefill of a random SmolLM2-135M at 4 x 4096 took 0.03-0.06 s,
lapse's 0.05-0.08 s (``docs/study/eviction/kvpress``). This times, on the same random
weights and prompts (median of ``--repeats`` after a warm-up):

- ``hf-sdpa``: the model's own forward with a ``DynamicCache`` (what kvpress's dense row runs);
- ``hf-evicting``: the same forward through ``lapse.hf.EvictingCache(Dense())`` (the
  ``"lapse_paged"`` attention: SDPA, then the prompt into the paged store);
- ``decoder-none``: the model converted to a lapse ``Decoder``, its forward without a cache;
- ``decoder-paged``: the converted model's ``prefill`` into a paged store (what the
  ``compiled`` mode of ``kvpress_compare.py`` times, before its cut);

then profiles ``decoder-paged`` and ``hf-evicting`` once each (the CUDA kernels by total
time, and the host time), to say what costs more than HF's forward.

    python scripts/diag_prefill_hf.py --shape smollm2-135m --num 4 --prompt 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_compare import random_llama  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeats: int) -> list[float]:
    """Seconds of ``repeats`` calls after a warm-up."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def _device_mallocs() -> int:
    """cudaMalloc calls of PyTorch's caching allocator so far (0 on the CPU)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


def _profile(fn, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        _sync()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def _sync_calls(tables: list[str], fns) -> None:
    """Appends, per function, the calls that waited for the device
    (``torch.cuda.set_sync_debug_mode("warn")``): file, line and message."""
    import warnings

    for name, fn in fns:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        tables.append(f"== synchronizing calls: {name}: {len(caught)}")
        tables += [f"{w.filename}:{w.lineno}: {str(w.message)[:120]}" for w in caught[:20]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--num", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("prefill-diag.json"))
    ap.add_argument("--no-profile", action="store_true", help="timings only (no profiles, no sync listing)")
    ap.add_argument("--after-decode", action="store_true",
                    help="only the HF prefills, before and after 16 decode steps under the window policy "
                         "(eviction compiled), as kvpress_compare.py runs them")
    args = ap.parse_args()
    from transformers import DynamicCache

    from lapse.eval.policy import next_logits, policy_cache
    from lapse.generation import H2O, Dense, SinkWindow, paged_store_for, prefill
    from lapse.hf import ATTENTION, register_attention
    from lapse.hf.convert import decoder_from_hf

    register_attention()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm, _ = random_llama(args.shape, ATTENTION, device, dtype, 0)
    converted = decoder_from_hf(lm).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, lm.config.vocab_size, (args.num, args.prompt), generator=g).to(device)
    total = args.prompt + 65
    dense = Dense(every=66)

    @torch.no_grad()
    def hf_sdpa():
        # "lapse_paged" with no EvictingCache in use is Hugging Face's SDPA
        lm(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def hf_evicting():
        next_logits(lm, ids, policy_cache(lm, dense, total))

    budget = args.prompt // 10
    window = SinkWindow(every=66, sinks=4, window=budget - 4)
    h2o = H2O(every=66, budget=budget, recent=budget // 2)

    @torch.no_grad()
    def hf_window():
        next_logits(lm, ids, policy_cache(lm, window, total))

    @torch.no_grad()
    def hf_h2o():
        next_logits(lm, ids, policy_cache(lm, h2o, total))

    @torch.no_grad()
    def decoder_none():
        converted.hidden_states(ids)

    @torch.no_grad()
    def decoder_paged():
        with converted.fused_projections(keep=True):
            prefill(converted, ids, paged_store_for(converted, args.num, args.prompt, 65, dense))

    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, shape=args.shape, num=args.num, prompt=args.prompt, seconds={})
    # each timed twice, in this order and back (a drift of the device or the allocator shows)
    runs = (("hf-sdpa", hf_sdpa), ("hf-evicting", hf_evicting), ("hf-window", hf_window), ("hf-h2o", hf_h2o),
            ("decoder-none", decoder_none), ("decoder-paged", decoder_paged))
    passes = (*runs, *runs[::-1])
    if args.after_decode:
        @torch.no_grad()
        def decode_window():  # what kvpress_compare.py's run does before its prefill repeats
            cache = policy_cache(lm, window, total)
            next_logits(lm, ids, cache)
            for i in range(16):
                next_logits(lm, ids[:, i : i + 1], cache)
            _sync()

        runs = runs[:3]
        passes = (*runs, ("decode-window", decode_window), *((f"{n}-after", f) for n, f in runs))
    result["samples"], result["device_mallocs"] = {}, {}
    for name, fn in passes:
        try:
            before = _device_mallocs()
            result["samples"].setdefault(name, []).extend(_timed(fn, args.repeats))
            # cudaMalloc calls of the caching allocator meanwhile (each can wait for the device)
            result["device_mallocs"].setdefault(name, []).append(_device_mallocs() - before)
            result["seconds"][name] = statistics.median(result["samples"][name])
        except Exception as e:  # noqa: BLE001 - report and go on
            result["seconds"][name] = f"{type(e).__name__}: {str(e)[:200]}"
    for name, times in result["samples"].items():
        ms = [1000 * t for t in times]
        passes = ", ".join(f"{statistics.median(ms[i : i + args.repeats]):.1f}"
                           for i in range(0, len(ms), args.repeats))
        mallocs = result["device_mallocs"].get(name, [])
        print(f"{name}: median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}, "
              f"n {len(ms)}); each pass {passes}; cudaMalloc calls per pass {mallocs}", flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    if args.no_profile:
        return
    tables = []
    for name, fn in (("decoder-paged", decoder_paged), ("hf-evicting", hf_evicting), ("hf-sdpa", hf_sdpa)):
        try:
            tables.append(f"== profile: {name}\n" + _profile(fn, 30))
        except Exception as e:  # noqa: BLE001
            tables.append(f"profile {name} failed: {e!r}")
        print(tables[-1], flush=True)
    if device == "cuda":  # every call that waits for the device, with where it came from
        try:
            _sync_calls(tables, (("decoder-paged", decoder_paged), ("hf-evicting", hf_evicting)))
        except Exception as e:  # noqa: BLE001 - a diagnosis: keep the timings and profiles
            tables.append(f"sync debug failed: {e!r}")
        print("\n".join(t for t in tables if not t.startswith("== profile")), flush=True)
    args.out.with_suffix(".txt").write_text("\n\n".join(tables))


if __name__ == "__main__":
    main()
