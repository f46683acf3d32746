"""ms per decode step of the lapse code from before the architecture restructure (issue 10),
timed the way ``lapse bench decode`` times the current code: the "before" column.

Run with the old source tree first on the path (it has ``lapse.generation.DenseCache``):
  git archive 16874c5 src/lapse | tar -x -C .bench_old
  PYTHONPATH=.bench_old/src python3 scripts/gpu_decode_before.py 8x4096 4x16384 2x32768
"""

import sys
import time

import torch

from lapse.generation import DenseCache, decode_one_token, prefill
from lapse.models import Decoder, preset

STEPS, WARMUP = 32, 4
assert "bench_old" in sys.modules["lapse"].__file__, "put the old tree first on PYTHONPATH"
for workload in sys.argv[1:]:
    batch, prompt = (int(x) for x in workload.split("x"))
    for arch in ("fox-pro", "transformer-pro", "transformer-llama"):
        torch.manual_seed(0)
        model = Decoder(preset("125m", arch, max_seq_len=prompt)).cuda().to(torch.bfloat16).eval()
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
        with torch.no_grad():
            cache = DenseCache(model.config.n_layers, capacity=prompt + WARMUP + STEPS + 1)
            token = prefill(model, ids, cache).argmax(-1, keepdim=True)
            for i in range(WARMUP + STEPS):
                if i == WARMUP:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                token = decode_one_token(model, token, cache).argmax(-1, keepdim=True)
            torch.cuda.synchronize()
        print(
            f"before {workload} {arch} lapse: {(time.perf_counter() - t0) / STEPS * 1e3:.3f} ms/step",
            flush=True,
        )
        del model, cache
        torch.cuda.empty_cache()
