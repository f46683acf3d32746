#!/usr/bin/env bash
# Issue 16, item 4: the compiled loss (prepare_blocks compiles lm_loss). Its GPU test, the
# loss alone eager against compiled at [1, 16384, 50304] bf16 (ms, peak GiB), then bench train
# with CUDA-graphed blocks (compare with the same variants at b1a15aa, docs/bench/session19).
# Carry .whl. Usage: COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu.sh bash scripts/gpu_issue16_s19_loss.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/issue16-s19-loss}"
mkdir -p "$OUT"
timeout 120 python3 -m pytest -q -s -m gpu tests/models/test_lm_loss.py -p no:cacheprovider --tb=short 2>&1 \
    | grep -E "^(E |FAILED|ERROR)|passed|failed|cuda:" | head -n 10
timeout 120 python3 - <<'PY'
import torch, triton
from lapse.models.decoder import lm_loss
torch.manual_seed(0)
logits = (3 * torch.randn(1, 16384, 50304, device="cuda")).to(torch.bfloat16).requires_grad_(True)
labels = torch.randint(0, 50304, (1, 16384), device="cuda")
for name, fn in (("eager", lm_loss), ("compiled", torch.compile(lm_loss))):
    def step():
        logits.grad = None
        fn(logits, labels).backward()
    step(); torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = triton.testing.do_bench(step, warmup=5, rep=50)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(f"loss {name}: fwd+bwd {ms:.3f} ms, extra peak {peak:.2f} GiB")
PY
timeout 300 python3 -m lapse.cli bench train --preset 125m --arch fox-pro --seq-len 16384 ${COMMIT:+--commit "$COMMIT"} \
    --variants acp-cudagraphs transformer-cudagraphs --steps 4 --warmup 2 --out-dir "$OUT/train-125m-16384" 2>&1 \
    | grep -E "^\| |Error|error"
