"""Cached decoding (``lapse.generation``) against recomputing the whole sequence (CPU).

Cached generation must equal uncached generation token for token (litgpt's test), and
its logits must match the full forward's to rounding. Tolerances are measured, not
guessed: the tiny models (init_std 0.1, float32) were run cached, uncached and in
float64. The cached logits' error against float64 was at most 1.9e-6 (0.45-0.88x the
float32 full forward's own error, 1.8e-6 to 3.2e-6); cached against the float32 full
forward differed by at most 3.9e-6 over the four archs, MHA and GQA, prompts of 1 and 7.
In float64 the two agree to 1.2e-14. The tests allow 2e-5 (float32) and 1e-12 (float64).
"""

from __future__ import annotations

import pytest
import torch

from lapse.generation import DenseCache, LayerCache, generate, sample
from lapse.models import ARCHS, Decoder, preset

FOX_ARCHS = [a for a in ARCHS if a.startswith("fox")]
ATOL32 = 2e-5  # 5x the largest measured cached-vs-full difference (3.9e-6)
ATOL64 = 1e-12  # measured 1.2e-14
GPU_ATOL32 = 2e-5  # H100: measured 2.2e-6 to 4.5e-6 over the four archs (as on CPU)


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(arch: str, dtype=torch.float32, **overrides) -> Decoder:
    """A tiny model with init_std 0.1: logits of a few units, so greedy choices are not
    near-ties (the smallest top-2 gap seen in these tests is 5.7e-4, 100x the error)."""
    torch.manual_seed(0)
    return Decoder(preset("tiny", arch, init_std=0.1, **overrides)).to(dtype).eval()


@torch.no_grad()
def _uncached_greedy(model: Decoder, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding that recomputes the whole sequence for every new token."""
    steps = []
    for _ in range(n):
        logits, _ = model(ids)
        steps.append(logits[:, -1])
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids, torch.stack(steps, dim=1)  # [B, T + n], [B, n, V]


def _assert_no_ties(logits: torch.Tensor, gap: float = 1e-4) -> None:
    top2 = logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > gap, "greedy choice is a near-tie: the test would be fragile"


@pytest.mark.parametrize("prompt_len", [1, 7], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_greedy_equals_uncached(arch, kv_heads, prompt_len):
    """20 new tokens, batch 2: prompt lengths 1 and 7 put the prefix boundary (and the
    Pro KV-shift hand-over from the cache) at different places."""
    model = _model(arch, n_kv_heads=kv_heads)
    ids = torch.randint(0, model.config.vocab_size, (2, prompt_len))
    out, logits = generate(model, ids, 20, return_logits=True)
    ref_out, ref_logits = _uncached_greedy(model, ids, 20)
    _assert_no_ties(ref_logits)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL32, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "chunks", [(7, 5), (1, 1, 1, 9), (1, 6, 1, 4), (12,)], ids=["7+5", "1+1+1+9", "1+6+1+4", "12"]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_after_a_prefix_equal_the_full_forward(arch, chunks, dtype):
    """Prefill, then chunks of several tokens (queries aligned to the end of the keys)
    and single tokens, against one forward over all 12 tokens. Capacity 2: the
    buffers grow (reallocate) on the way, which must not lose anything."""
    model = _model(arch, dtype, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    cache = DenseCache(model.config.n_layers, capacity=2)
    with torch.no_grad():
        full, _ = model(ids)
        parts, start = [], 0
        for n in chunks:
            logits, _ = model(ids[:, start : start + n], cache=cache)
            parts.append(logits)
            start += n
    assert cache.length == 12 and cache.layers[0].k.shape[1] >= 12
    atol = ATOL64 if dtype == torch.float64 else ATOL32
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_contents(arch):
    """What each layer keeps: keys/values for every position, ``c`` (FoX) in float64
    with ``c_last`` its last row, the last pre-shift projections (Pro)."""
    model = _model(arch)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (2, 7))
    cache = DenseCache(config.n_layers, capacity=16)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    for layer in cache.layers:
        assert layer.length == 8
        assert layer.k.shape == layer.v.shape == (2, 16, config.kv_heads, config.head_dim)
        assert (layer.c is not None) == config.forget_gate
        if config.forget_gate:
            assert layer.c.shape == (2, 16, config.n_heads) and layer.c.dtype == torch.float64
            assert torch.equal(layer.c_last, layer.c[:, 7])
            assert (layer.c[:, 1:8] <= layer.c[:, :7]).all()  # log gates are <= 0
        assert (layer.k_prev is not None) == config.pro
        if config.pro:
            assert layer.k_prev.shape == layer.v_prev.shape == (2, 1, config.kv_heads, config.head_dim)
    if config.pro:
        # the last pre-shift key projection of the first layer is W_k x_7 of the appended token
        block = model.blocks[0]
        x = block.attn_norm(model.embed(ids[:, :1]))
        expected = block.attn.k_proj(x).view(2, 1, config.kv_heads, config.head_dim)
        torch.testing.assert_close(cache.layers[0].k_prev, expected.detach())


@pytest.mark.parametrize("arch", FOX_ARCHS)
def test_acp_model_decodes_densely(arch):
    """ACP prunes only in the full-sequence op; the decode step reads the whole cache.
    An acp=True model decoding with its cache equals the same weights without ACP,
    recomputed in full (prompts shorter than one ACP block: nothing to prune there)."""
    pruned = _model(arch, acp=True)
    dense = _model(arch)
    dense.load_state_dict(pruned.state_dict())
    ids = torch.randint(0, pruned.config.vocab_size, (2, 7))
    out, logits = generate(pruned, ids, 20, return_logits=True)
    ref_out, ref_logits = _uncached_greedy(dense, ids, 20)
    _assert_no_ties(ref_logits)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL32, rtol=0)


def test_sampling_with_cache_matches_uncached_sampling():
    model = _model("fox-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    out = generate(model, ids, 12, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    ref = ids
    with torch.no_grad():
        for _ in range(12):
            logits, _ = model(ref)
            ref = torch.cat([ref, sample(logits[:, -1], 0.8, 20, g)], dim=1)
    assert torch.equal(out, ref)
    assert not torch.equal(out, generate(model, ids, 12))  # not greedy


def test_sample_top_k_and_greedy():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits), torch.ones(500, 1, dtype=torch.long))
    drawn = sample(logits, temperature=1.0, top_k=2, generator=g)
    assert set(drawn.flatten().tolist()) == {1, 2}
    share = (drawn == 1).float().mean().item()  # p = e^3 / (e^3 + e^2) = 0.73
    assert abs(share - 0.731) < 0.06


def test_cache_misuse_raises():
    model = _model("transformer-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    with pytest.raises(ValueError, match="cache has 3 layers but the model has 2"):
        model(ids, cache=DenseCache(3))
    with pytest.raises(TypeError, match="DenseCache"):
        model(ids, cache=[LayerCache(), LayerCache()])
    cache = DenseCache(2)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="holds 2 sequences but input_ids has 1"):
        model(ids[:1], cache=cache)
    fox_cache = DenseCache(2)
    _model("fox-pro")(ids, cache=fox_cache)
    with pytest.raises(ValueError, match="another architecture"):
        model(ids, cache=fox_cache)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, 0)
    with pytest.raises(ValueError, match="n_layers"):
        DenseCache(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_greedy_equals_uncached_on_cuda(arch):
    """The GPU paths: the Triton prefill and the Triton decode kernel reading the float64
    ``c`` cache (FoX), SDPA (Transformer), float32, against full recomputation."""
    model = _model(arch).cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).cuda()
    expected, logits = _uncached_greedy(model, ids, 20)
    _assert_no_ties(logits)
    got, cached_logits = generate(model, ids, 20, return_logits=True)
    print(f"{arch}: max |cached - full| logits on CUDA {(cached_logits - logits).abs().max().item():.2e}")
    assert torch.equal(got, expected)
    torch.testing.assert_close(cached_logits, logits, atol=GPU_ATOL32, rtol=0)
