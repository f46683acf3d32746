"""Triton is an optional dependency (pyproject's ``triton`` extra): lapse imports and runs its
models on the ``torch`` backend where it is missing."""

import os
import subprocess
import sys
import textwrap


def test_models_run_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton raises ImportError
        from dataclasses import replace

        import torch

        import lapse.cli  # noqa: F401
        from lapse.models import Decoder, preset

        for arch in ("fox-pro", "fox-llama", "transformer-pro"):
            model = Decoder(replace(preset("tiny", arch), vocab_size=64))
            ids = torch.randint(0, 64, (1, 16))
            logits, loss = model(ids, ids)
            loss.backward()
            assert logits.shape == (1, 16, 64)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
