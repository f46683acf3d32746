"""The Triton path as torch.library custom ops (``lapse.ops.forgetting.library``): what a
compiled FoX block calls instead of breaking its graph. On the CPU the kernels run under the
Triton interpreter (conftest); ``aot_eager`` traces and runs the graph without Inductor."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F

from lapse.models import Decoder, preset
from lapse.ops.forgetting import forgetting_attention
from lapse.ops.forgetting.library import compiled_forgetting_attention, fox_forward

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter shapes (CPU)")


def _inputs(b=2, t=150, hq=4, h=2, d=32, seed=0, rate=1.0):
    """q, k, v ``[B, T, H, D]`` float32 and log gates that decay fast enough for ACP to
    prune blocks of 64 at T 150."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hq, d, generator=g)
    k, v = (torch.randn(b, t, h, d, generator=g) for _ in range(2))
    lg = F.logsigmoid(-math.log(math.expm1(rate)) + 0.3 * torch.randn(b, t, hq, generator=g))
    return q, k, v, lg


@CPU_ONLY
@pytest.mark.parametrize("acp", [None, "auto", "bound"])
def test_custom_op_equals_the_public_op(acp):
    """Output and every gradient equal the public op's Triton path bit for bit (the same
    kernels), dense and with ACP (a bound from the data, or given per query head); with
    ACP some blocks are pruned, so the block starts go through the backward."""
    q, k, v, lg = _inputs()
    bound = torch.full((4,), 3.0) if acp == "bound" else None
    acp_arg = bound if acp == "bound" else acp
    grads = []
    for fn in (forgetting_attention, compiled_forgetting_attention):
        xs = [x.clone().requires_grad_() for x in (q, k, v, lg)]
        kw = dict(backend="triton") if fn is forgetting_attention else {}
        o = fn(*xs, acp=acp_arg, **kw)
        o.backward(torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o))
        grads.append([o.detach()] + [x.grad for x in xs])
    for a, b in zip(*grads, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if acp is not None:
        *_, starts = fox_forward(q, k, v, lg, 1 / math.sqrt(32), bound, acp == "auto", math.exp(-10))
        assert starts.shape == (2, 4, 3) and int(starts.max()) > 0  # pruned blocks exist


@CPU_ONLY
@pytest.mark.parametrize("acp", [None, "auto"])
def test_opcheck(acp):
    """torch.library.opcheck: the fake (meta) implementation's shapes and dtypes, the schema,
    and the autograd registration under AOT dispatch."""
    q, k, v, lg = (x.requires_grad_() for x in _inputs(b=1, t=70, hq=2, h=1, d=16))
    torch.library.opcheck(fox_forward, (q, k, v, lg, 0.25, None, acp == "auto", math.exp(-10)))


@CPU_ONLY
@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro"])
def test_compiled_block_is_one_graph_and_equals_eager(arch):
    """A compiled FoX block with ACP is one graph (no break at the attention) and its output
    and gradients equal the eager block's: FoX LLaMA takes the bound from the data
    (``"auto"``), FoX Pro from its QK-norm gains (a tensor)."""
    cfg = replace(preset("125m", arch, max_seq_len=256), d_model=64, n_heads=2, n_layers=1,
                  vocab_size=64, acp=True)
    torch.manual_seed(0)
    block = Decoder(cfg).blocks[0]
    block.attn.backend = "triton"
    with torch.no_grad():  # fast-decaying gates: ACP prunes at T 150
        block.attn.fgate.bias.fill_(-1.0)
    x = torch.randn(1, 150, 64)
    pos = torch.arange(150)[None]
    block.attn.collect_stats = True
    block(x, pos)
    assert float(block.attn.last_stats.pruned_fraction.mean()) > 0
    block.attn.collect_stats = False
    explained = dynamo.explain(block)(x, pos)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    results = []
    for run in (block, torch.compile(block, backend="aot_eager", fullgraph=True)):
        block.zero_grad()
        xi = x.clone().requires_grad_()
        out = run(xi, pos)
        out.backward(torch.sin(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        results.append([out.detach(), xi.grad] + [p.grad.clone() for p in block.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # statistics (the trainer's ACP steps) take the eager op: the compiled block, graph breaks
    # allowed, still returns the same output and records them
    block.attn.collect_stats, block.attn.last_stats = True, None
    out = torch.compile(block, backend="aot_eager")(x, pos)
    torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
    assert float(block.attn.last_stats.pruned_fraction.mean()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["fox-llama", "fox-pro"])
def test_inductor_block_on_cuda(arch):
    """On CUDA with Inductor (the trainer's compile): a FoX block with ACP in bf16 autocast is
    one graph and matches the eager block within bf16 rounding (Inductor fuses the norms and
    gates around the op differently)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = replace(preset("125m", arch, max_seq_len=2048), n_layers=1, acp=True)
    torch.manual_seed(0)
    block = Decoder(cfg).blocks[0].cuda()
    x = torch.randn(2, 1024, cfg.d_model, device="cuda")
    pos = torch.arange(1024, device="cuda")[None]
    results = []
    for run in (block, torch.compile(block, fullgraph=True)):
        block.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = run(xi, pos)
        out.float().pow(2).mean().backward()
        results.append([out.float().detach(), xi.grad] + [p.grad.float().clone() for p in block.parameters()])
    errors = [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(*results, strict=True)]
    print(f"{arch}: rel err output {errors[0]:.2e}, gradients up to {max(errors[1:]):.2e}")
    assert not any(r.isnan().any() for r in results[1])
    assert max(errors) < 2e-2


def test_compiled_path_rejects_a_float_bound():
    q, k, v, lg = _inputs(b=1, t=20, hq=2, h=2, d=16)
    with pytest.raises(ValueError, match="'auto' or a tensor"):
        compiled_forgetting_attention(q, k, v, lg, acp=2.0)
