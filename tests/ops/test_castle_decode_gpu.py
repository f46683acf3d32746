"""The fused CASTLE decode step on a GPU (``pytest -m gpu``): the Triton kernel against the
torch reference at the 125M model's shapes (7 heads of 64, B = 8, ~4k held slots, bf16
caches, float32 ``u``), a CUDA-graph compiled step of a CASTLE model against its eager
step, and a printed timing (kernel against the reference). Skipped without CUDA.

Tolerances: both paths run float32 arithmetic on the same bf16 inputs, so they differ only
in the order of sums (the interpreter measured 1e-6 relative at most; 1e-5 here leaves
room for the GPU's fused multiply-adds at 4k slots); ``o`` is rounded to bf16 (2^-9).
"""

from __future__ import annotations

import copy

import pytest
import torch
from castle_cases import rel, time_ms

from lapse.ops.castle import castle_decode_step

pytestmark = pytest.mark.gpu

B, H, D = 8, 7, 64


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _step_inputs(capacity: int, lens: list[int], hc: int = H, seed: int = 0):
    """Random bf16 caches with NaN past each length (u float32), and the new token."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    b = len(lens)
    n = torch.tensor(lens, dtype=torch.int32, device="cuda")
    unused = (torch.arange(capacity, device="cuda")[None, :] >= n[:, None])[:, :, None, None]
    cache = dict(
        u_cache=torch.where(unused, float("nan"), randn(b, capacity, H, D, dtype=torch.float32)),
        qu_cache=torch.where(unused, float("nan"), randn(b, capacity, H, D)),
        k_c_cache=torch.where(unused, float("nan"), randn(b, capacity, hc, D)),
        v_c_cache=torch.where(unused, float("nan"), randn(b, capacity, hc, D)),
    )
    new = dict(q_c=randn(b, H, D), k_u=randn(b, hc, D), v_u=randn(b, hc, D))
    return new, cache, n


def _run(new, cache, n, window, backend, u=None):
    u = cache["u_cache"].clone() if u is None else u
    o, lse = castle_decode_step(new["q_c"], new["k_u"], new["v_u"], u, cache["qu_cache"],
                                cache["k_c_cache"], cache["v_c_cache"], n, window=window,
                                return_lse=True, check_values=False, backend=backend)
    return o, lse, u


@pytest.mark.parametrize("window", [None, 128], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("hc", [H, 1], ids=lambda h: f"HC{h}")
def test_kernel_equals_reference_at_125m_shapes(window, hc):
    lens = [4096, 4097, 1, 3000, 4160, 129, 4095, 2048]
    new, cache, n = _step_inputs(4160, lens, hc)
    o_ref, lse_ref, u_ref = _run(new, cache, n, window, "torch")
    o, lse, u = _run(new, cache, n, window, "triton")
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < 4e-3 and rel(lse, lse_ref) < 1e-5
    for i, m in enumerate(lens):
        assert rel(u[i, :m], u_ref[i, :m]) < 1e-5
        assert torch.isnan(u[i, m:]).all(), "a slot past the length was written"


def test_compiled_cuda_graph_step_equals_eager():
    """A tiny CASTLE-SWL model in bf16: compiled_decode_one_token (Inductor, CUDA graphs)
    calls the kernel and gives the eager step's logits, token after token: its distance
    to the same model in float32 at most twice the eager bf16 step's (on an H100 the two
    bf16 steps differed by 1.2e-2 relative, Inductor rounding elsewhere than eager)."""
    from lapse.generation import compiled_decode_one_token, decode_one_token, prefill
    from lapse.kv import DenseStore
    from lapse.models import Decoder, preset

    torch.manual_seed(0)
    model = Decoder(preset("tiny", "castle-swl", castle_window=4, init_std=0.1)).cuda().bfloat16().eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 9), device="cuda")
    layers = model.config.n_layers
    model32 = copy.deepcopy(model).float()
    eager, compiled = DenseStore(layers, capacity=32), DenseStore(layers, capacity=32)
    full = DenseStore(layers, capacity=32)
    step = compiled_decode_one_token()
    token_e = prefill(model, ids, eager).argmax(-1, keepdim=True)
    prefill(model, ids, compiled)
    prefill(model32, ids, full)
    for _ in range(8):
        logits_e = decode_one_token(model, token_e, eager).float()
        logits_c = step(model, token_e, compiled).float()
        logits_32 = decode_one_token(model32, token_e, full)
        assert rel(logits_c, logits_32) <= 2 * rel(logits_e, logits_32) + 1e-3
        token_e = logits_e.argmax(-1, keepdim=True)
    assert compiled.seqlens.tolist() == eager.seqlens.tolist() == [17, 17, 17]


@pytest.mark.parametrize("window", [None, 128], ids=lambda w: f"W{w}")
def test_kernel_speed_report(window):
    """Not a benchmark (``lapse bench decode`` owns those): one layer's step at the 125M
    shapes, B = 8 at 4096 held slots of a 4160 capacity, and the bytes it must move (u
    read and written, q^U, k^C, v^C read; SWL: u written and q^U read for W rows only)."""
    new, cache, n = _step_inputs(4160, [4096] * B)
    u = cache["u_cache"].clone()
    kernel = time_ms(lambda: _run(new, cache, n, window, "triton", u), reps=20)
    torch_ms = time_ms(lambda: _run(new, cache, n, window, "torch", u), reps=20)
    rows = B * 4096
    changed = rows if window is None else B * window
    moved = rows * H * D * (4 + 2 + 2 + 2) + changed * H * D * (4 + 2)
    print(f"W={window}: triton {kernel * 1e3:.0f} us ({moved / kernel / 1e6:.0f} GB/s of the "
          f"{moved / 2**20:.0f} MiB it must move), torch reference {torch_ms * 1e3:.0f} us")
