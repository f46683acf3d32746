"""Cached decoding (``lapse.generation`` over ``lapse.kv.DenseStore``) against recomputing
the whole sequence (CPU).

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

from lapse.generation import (
    compiled_decode_one_token,
    decode_one_token,
    generate,
    prefill,
    sample,
    sample_rows,
)
from lapse.kv import DenseStore, GateState, ShiftState
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
    cache = DenseStore(model.config.n_layers, capacity=2)
    with torch.no_grad():
        full, _ = model(ids)
        parts, start = [], 0
        for n in chunks:
            logits, _ = model(ids[:, start : start + n], cache=cache)
            parts.append(logits)
            start += n
    assert cache.length == 12 and cache.k[0].shape[1] >= 12 and cache.seqlens.tolist() == [12, 12]
    atol = ATOL64 if dtype == torch.float64 else ATOL32
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_contents(arch):
    """What each layer keeps: keys/values for every position, ``c`` (FoX) in float64
    with ``GateState.c_last`` its last row, the last pre-shift projections (Pro)."""
    model = _model(arch)
    config = model.config
    forgetting = config.attention == "forgetting"
    ids = torch.randint(0, config.vocab_size, (2, 7))
    cache = DenseStore(config.n_layers, capacity=16)
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    assert cache.length == 8 and cache.seqlens.dtype == torch.int32 and cache.seqlens.tolist() == [8, 8]
    for i in range(config.n_layers):
        assert cache.k[i].shape == cache.v[i].shape == (2, 16, config.kv_heads, config.head_dim)
        assert set(cache.extras[i]) == ({"c"} if forgetting else set())
        if forgetting:
            c = cache.extras[i]["c"]
            assert c.shape == (2, 16, config.n_heads) and c.dtype == torch.float64
            assert torch.equal(cache.state(i, GateState).c_last, c[:, 7])
            assert (c[:, 1:8] <= c[:, :7]).all()  # log gates are <= 0
        shift = cache.state(i, ShiftState)
        assert (shift.k_prev is not None) == (config.block == "pro")
        if config.block == "pro":
            assert shift.k_prev.shape == shift.v_prev.shape == (2, 1, config.kv_heads, config.head_dim)
    if config.block == "pro":
        # the last pre-shift key projection of the first layer is W_k x_7 of the appended token
        block = model.blocks[0]
        x = block.attn_norm(model.embed(ids[:, :1]))
        expected = block.attn.k_proj(x).view(2, 1, config.kv_heads, config.head_dim)
        torch.testing.assert_close(cache.state(0, ShiftState).k_prev, expected.detach())


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decode_step_equals_eager(arch, compiled_step_matches_eager):
    """The decode step traces whole (``fullgraph=True``, no graph break) and computes what
    the eager step does. ``aot_eager``: the trace without code generation, so the test
    runs on any CPU in seconds; the GPU test below compiles with CUDA graphs."""
    model = _model(arch, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    eager, compiled = compiled_step_matches_eager(model, ids, 5, capacity=12, atol=ATOL32)
    assert compiled.seqlens.tolist() == eager.seqlens.tolist() == [11, 11] and compiled.length == 11


@pytest.mark.parametrize("arch", [*ARCHS, "castle"])
def test_fused_projections_step_equals_separate(arch):
    """Inside ``fused_projections`` a decode step multiplies with the concatenated q/k/v(/gate)
    and gate/up weights, and computes what the separate projections do; outside, nothing
    fused is used; a second entry after the weights changed snapshots the new weights
    into the same memory (a captured CUDA graph keeps reading it); with autograd on the
    separate projections run, so gradients reach them."""
    model = _model(arch, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    plain, fused = DenseStore(2, capacity=12), DenseStore(2, capacity=12)
    token = prefill(model, ids, plain).argmax(-1, keepdim=True)
    prefill(model, ids, fused)
    expected = decode_one_token(model, token, plain)
    with model.fused_projections(keep=True):
        attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
        assert attn.fused_in_proj is not None and mlp.fused_gate_up is not None
        got = decode_one_token(model, token, fused)
    # measured 0 on CPU for all five; on a GPU the blocking of the product may differ
    torch.testing.assert_close(got, expected, atol=ATOL32, rtol=0)
    assert attn.fused_in_proj is None and mlp.fused_gate_up is None
    address = attn._fused.weight.data_ptr()
    with torch.no_grad():
        attn.q_proj.weight.mul_(2)
    with model.fused_projections():
        assert attn.fused_in_proj.data_ptr() == address
        torch.testing.assert_close(attn.fused_in_proj[: attn.q_proj.out_features], attn.q_proj.weight)
        with torch.enable_grad():
            model(ids[:, :1])[0].sum().backward()
    assert attn.q_proj.weight.grad is not None and mlp.w_up.weight.grad is not None


def _change_weights(model: Decoder, change: str, ids: torch.Tensor) -> None:
    """Changes every layer's fused weights the way ``change`` names."""
    if change == "mul_":
        with torch.no_grad():
            for block in model.blocks:
                block.attn.q_proj.weight.mul_(2)
                block.attn.o_gate.weight.mul_(-1)
                block.mlp.w_up.weight.mul_(0.5)
    elif change == "to-float64":
        model.to(torch.float64)
    elif change == "load_state_dict":
        torch.manual_seed(1)
        model.load_state_dict(Decoder(preset("tiny", "fox-pro", init_std=0.1, n_kv_heads=2)).state_dict())
    else:  # an optimizer step (foreach: in place, one version bump per weight)
        with torch.enable_grad():
            model(ids)[0].square().mean().backward()
        torch.optim.SGD(model.parameters(), lr=1.0, foreach=True).step()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("change", ["mul_", "to-float64", "load_state_dict", "optimizer"])
def test_fused_projections_follow_weights_changed_inside(change, compiled):
    """Weights changed inside ``fused_projections(keep=True)``, after a fused step used the
    snapshot, are taken again before the next fused step: its logits equal a separate-
    projection model's with the new weights. float64; measured 0 for all eight (before
    the check, mul_ / load_state_dict / the optimizer step were off by 3.2 / 4.0 / 0.56 in
    logits of about 2.5; ``.to()`` converts the snapshot with the weights, 0 before too).
    The compiled step (``aot_eager``) is checked on the host before its call."""
    model = _model("fox-pro", torch.float32 if change == "to-float64" else torch.float64, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    step = compiled_decode_one_token(mode=None, backend="aot_eager") if compiled else decode_one_token
    with model.fused_projections(keep=True):
        warm = DenseStore(2, capacity=4)
        step(model, prefill(model, ids[:, :3], warm).argmax(-1, keepdim=True), warm)  # the snapshot in use
        _change_weights(model, change, ids)
        assert next(model.parameters()).dtype == torch.float64
        separate = Decoder(model.config).to(torch.float64).eval()
        separate.load_state_dict(model.state_dict())  # the snapshot is no state: not copied
        fused_store, plain_store = DenseStore(2, capacity=8), DenseStore(2, capacity=8)
        token = prefill(model, ids, fused_store).argmax(-1, keepdim=True)
        prefill(separate, ids, plain_store)
        got = step(model, token, fused_store)
        attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
        assert attn.fused_in_proj is not None and mlp.fused_gate_up is not None
    expected = decode_one_token(separate, token, plain_store)
    torch.testing.assert_close(got, expected, atol=ATOL64, rtol=0)


def test_fused_projections_skip_fsdp2_weights():
    """Under FSDP2 (``fully_shard``; one process, gloo) the weights are DTensor shards: nothing
    is fused (before, the snapshot was a DTensor and the first step failed with "mixed
    torch.Tensor and DTensor"), and the step equals the unsharded model's (float64,
    measured 0)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group yet")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _model("fox-pro", torch.float64, n_kv_heads=2)
    plain = _model("fox-pro", torch.float64, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model.blocks[0].attn.q_proj.weight, DTensor)
        stores = DenseStore(2, capacity=8), DenseStore(2, capacity=8)
        with torch.no_grad():
            model(ids, cache=stores[0])  # through FSDP's hooks (prefill() bypasses the root's)
        token = prefill(plain, ids, stores[1]).argmax(-1, keepdim=True)
        with model.fused_projections(keep=True):
            assert all(b.attn.fused_in_proj is None and b.mlp.fused_gate_up is None for b in model.blocks)
            got = decode_one_token(model, token, stores[0])
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got, decode_one_token(plain, token, stores[1]), atol=ATOL64, rtol=0)


def test_compiled_decode_step_scopes_the_recompile_limit():
    """Nine compiled entries of the decode step (nine batch sizes, automatic dynamic shapes
    off) under a process-wide limit of 8, ``fullgraph=True``: no error, because each call
    raises the limit inside ``torch._dynamo.config.patch``, which Dynamo reads when the call
    misses its cache (``torch.compile(decode_one_token, fullgraph=True)`` called the same
    way raises ``FailOnRecompileLimitHit`` at the ninth); the process-wide setting is the
    same after."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    model = _model("transformer-llama")
    vocab = model.config.vocab_size
    step = compiled_decode_one_token(mode=None, backend="aot_eager")
    torch._dynamo.reset()  # this test's entries alone
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with config.patch(name, 8), config.patch(automatic_dynamic_shapes=False):
        for batch in range(1, 10):
            ids = torch.randint(0, vocab, (batch, 3), generator=torch.Generator().manual_seed(0))
            store = DenseStore(2, capacity=4)
            step(model, prefill(model, ids, store).argmax(-1, keepdim=True), store)
        assert getattr(config, name) == 8
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 9  # the raw one fails at 9


def test_prefill_projects_only_the_last_position():
    model = _model("fox-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        full, _ = model(ids)
    logits = prefill(model, ids, DenseStore(2))
    assert logits.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(logits, full[:, -1], atol=ATOL32, rtol=0)


def test_store_reorder_keeps_rows():
    """Beam search: reordering the batch rows of the store equals decoding those rows."""
    model = _model("fox-pro")
    ids = torch.randint(0, model.config.vocab_size, (3, 5))
    store, ref = DenseStore(2, capacity=8), DenseStore(2, capacity=8)
    prefill(model, ids, store)
    prefill(model, ids[[2, 0]], ref)
    store.reorder(torch.tensor([2, 0]))
    token = ids[[2, 0], -1:]
    torch.testing.assert_close(decode_one_token(model, token, store), decode_one_token(model, token, ref))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sample_rows_draws_what_sample_draws_row_by_row(dtype):
    """Rows of every kind side by side (greedy, plain, top-k, top-p, both, k beyond the
    vocabulary; seeded or not): each seeded row's token equals ``sample`` on that row alone
    with a generator seeded alike, over many draws, and leaves its generator where ``sample``
    leaves it; greedy rows are the argmax."""
    v = 97
    params = [(0.0, None, None), (1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 7, 0.6),
              (1.0, 500, None), (0.0, 3, 0.5), (1.0, None, None)]
    seeded = [True, True, True, True, True, True, False, False]
    torch.manual_seed(0)
    gens = [torch.Generator().manual_seed(10 + i) if s else None for i, s in enumerate(seeded)]
    refs = [torch.Generator().manual_seed(10 + i) if s else None for i, s in enumerate(seeded)]
    for _ in range(50):
        logits = (3 * torch.randn(len(params), v)).to(dtype)
        drawn = sample_rows(logits, *zip(*params, strict=True), gens)
        assert drawn.shape == (len(params),) and drawn.dtype == torch.long
        for i, (t, k, p) in enumerate(params):
            if seeded[i] or t == 0:
                assert int(drawn[i]) == int(sample(logits[i : i + 1], t, k, refs[i], p)), i
    for g, ref in zip(gens, refs, strict=True):
        if g is not None:
            assert torch.equal(g.get_state(), ref.get_state())
    greedy = torch.randn(3, v)
    assert torch.equal(sample_rows(greedy, [0.0] * 3, [None] * 3, [None] * 3, [None] * 3), greedy.argmax(-1))


def test_cache_misuse_raises():
    model = _model("transformer-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    with pytest.raises(ValueError, match="cache has 3 layers but the model has 2"):
        model(ids, cache=DenseStore(3))
    with pytest.raises(TypeError, match="KVCache"):
        model(ids, cache=[None, None])
    cache = DenseStore(2)
    model(ids, cache=cache)
    with pytest.raises(ValueError, match="holds 2 sequences but input_ids has 1"):
        model(ids[:1], cache=cache)
    fox_cache = DenseStore(2)
    _model("fox-pro")(ids, cache=fox_cache)
    with pytest.raises(ValueError, match="another architecture"):
        model(ids, cache=fox_cache)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, ids, 0)
    with pytest.raises(ValueError, match="n_layers"):
        DenseStore(0)
    with pytest.raises(ValueError, match="compiled decode step needs the room"):
        generate(model, ids, 4, cache=DenseStore(2, capacity=5), compile=True)
    # out of the vocabulary (an embedding's bare IndexError), a policy by name (an AttributeError)
    v = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"token ids in \[0, {v}\) .* from 0 to {v + 3}"):
        generate(model, torch.tensor([[0, 1, v + 3]]), 2)
    with pytest.raises(ValueError, match="from -1 to"):
        generate(model, torch.tensor([[-1, 1]]), 2)
    assert generate(model, torch.tensor([[5, 6, 7], [5, 0, 0]]), 2, lengths=[3, 1]).shape == (2, 5)
    with pytest.raises(ValueError, match="token ids in"):  # the prefill embeds the padding too
        generate(model, torch.tensor([[5, 6, 7], [5, v + 9, 0]]), 2, lengths=[3, 1])
    with pytest.raises(TypeError, match="policy must be a Policy .* got 'h2o'"):
        generate(model, ids, 2, policy="h2o")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_cached_greedy_equals_uncached_on_cuda(arch):
    """The GPU paths: the Triton prefill and the Triton decode kernel reading the float64
    ``c`` cache (FoX), SDPA (Transformer), float32, against full recomputation; eager,
    then the decode step compiled with CUDA graphs (``reduce-overhead``)."""
    model = _model(arch).cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).cuda()
    expected, logits = _uncached_greedy(model, ids, 20)
    _assert_no_ties(logits)
    for compile in (False, True):
        got, cached_logits = generate(model, ids, 20, return_logits=True, compile=compile)
        err = (cached_logits - logits).abs().max().item()
        print(f"{arch} compile={compile}: max |cached - full| logits on CUDA {err:.2e}")
        assert torch.equal(got, expected)
        torch.testing.assert_close(cached_logits, logits, atol=GPU_ATOL32, rtol=0)


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    drawn = sample(logits, temperature=1.0, top_p=0.7, generator=g)  # 0.5 + 0.3 reach 0.7
    assert set(drawn.flatten().tolist()) == {0, 1}
    assert abs((drawn == 0).float().mean().item() - 0.5 / 0.8) < 0.05
    only = sample(logits, temperature=1.0, top_p=0.1, generator=g)  # the most likely token always stays
    assert set(only.flatten().tolist()) == {0}


def test_stop_tokens_end_each_sequence_and_the_loop():
    model = _model("fox-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    free = generate(model, ids, 30)
    stops = (int(free[0, 8]), int(free[1, 6]))  # sequence 0 stops by its 4th new token, 1 by its 2nd
    out = generate(model, ids, 30, stop_tokens=stops, check_every=4)
    for row in range(2):
        new = free[row, 5:].tolist()
        end = min(new.index(s) for s in stops if s in new) + 1
        assert out[row, 5 : 5 + end].tolist() == new[:end]
        assert (out[row, 5 + end :] == stops[0]).all()
    assert out.shape[1] <= 5 + 4 + 4  # both ended by step 4: the check at step 4 stopped the loop
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, ids, 3, temperature=1.0, top_p=0.0)


def test_fused_projections_after_inference_mode_and_a_failed_entry():
    """A snapshot made under ``torch.inference_mode`` is not written into outside it (a
    fresh one is made), and an entry that fails part-way leaves nothing fused."""
    model = _model("fox-pro")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        first = generate(model, ids, 3)
    assert torch.equal(generate(model, ids, 3), first)
    calls = [0]
    original = type(model.blocks[0].mlp).fuse_projections

    def failing(self, enabled=True, keep=True):
        calls[0] += 1
        if enabled and calls[0] == 2:
            raise RuntimeError("out of memory")
        original(self, enabled, keep)

    type(model.blocks[0].mlp).fuse_projections = failing
    try:
        with pytest.raises(RuntimeError, match="out of memory"), model.fused_projections():
            pass
    finally:
        type(model.blocks[0].mlp).fuse_projections = original
    assert all(b.attn.fused_in_proj is None and b.mlp.fused_gate_up is None for b in model.blocks)


def test_compiled_step_serves_models_of_different_head_dims(compiled_step_matches_eager):
    """Two models whose layers have different scales (head dims 16 and 64) compiled in one
    process: without ``specialize_float`` Dynamo turned the changed float into a symbolic
    input on the second compile, and the op's scale check failed to trace (found on the
    GPU, where the tests run in one process)."""
    for name in ("tiny", "small"):
        torch.manual_seed(0)
        model = Decoder(preset(name, "fox-llama", init_std=0.1)).eval()
        ids = torch.randint(0, model.config.vocab_size, (2, 5))
        compiled_step_matches_eager(model, ids, 2, atol=ATOL32)
