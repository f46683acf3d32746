"""FoX's forward and backward on FlashAttention-4's Hopper kernels (fa4_fwd.py, fa4_bwd.py) against
the float64 oracle.

On the CPU: the float32 column terms against float64, their permutation for the forward against
the wgmma accumulator's column layout, ACP's block lists (the backward's and the forward's)
against brute force over every (query, key) pair, fa4_prep.py's Triton kernels (interpreter)
equal to those references bit for bit, and the path's choice (never on the CPU).
On a Hopper GPU with ``flash-attn-4`` installed (``-m gpu``; a machine without a package index
gets it from ``scripts/fetch_wheels.sh --fa4`` through ``scripts/gpu.sh``): the op's forward
and backward, with the backward through that kernel, held to test_forgetting_triton.py's rules
(the kernel's error at most 3x the naive computation's in the same dtype, plus a floor), at
awkward lengths and head dims, with the lse in the loss (its gradient path) and NaN-filled
gradient buffers; and FlashAttention-4's own backward (no ``score_mod``), which the subclass
must leave as it was.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_forgetting_triton import _compare, _inputs, _rel  # noqa: E402

from lapse.ops.forgetting import fa4_bwd, fa4_fwd, triton_ops  # noqa: E402
from lapse.ops.forgetting.common import validate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # fa4_prep's kernels: compiled, or the interpreter


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    """A FlashAttention-4 kernel that fails raises here instead of falling back to Triton, so that
    it fails its test (the fallback's own test turns this off)."""
    monkeypatch.setattr(triton_ops, "FA4_STRICT", True)


def test_column_terms_match_float64():
    g = torch.Generator().manual_seed(0)
    b, h, t = 2, 3, 1000
    log_f = torch.nn.functional.logsigmoid(torch.randn(b, h, t, generator=g) * 3 + 2).double()
    log_f[0, 0, 500] = -1000.0  # a closed gate at LOG_GATE_FLOOR
    c = log_f.cumsum(-1)
    c_hi = c.float()
    c_lo = (c - c_hi.double()).float()
    for tn, tm in ((128, 64), (128, 128)):
        d, shift = fa4_bwd.column_terms(c_hi, c_lo, t, tn, tm)
        j = torch.arange(t)
        kref = torch.clamp(j // tn * tn + tn - 1, max=t - 1)
        qref = torch.clamp(j // tm * tm + tm - 1, max=t - 1)
        assert d.shape == (b, h, -(-t // tn) * tn) and torch.all(d[..., t:] == 0)
        want_d, want_shift = c[..., kref] - c, c - c[..., qref]
        # float32 of the result: a relative 2^-24 of each value, and no cancellation error
        assert torch.allclose(d[..., :t].double(), want_d, rtol=2**-22, atol=1e-6)
        assert torch.allclose(shift.double(), want_shift, rtol=2**-22, atol=1e-6)


def _random_staircase(b, h, t, seed):
    """``block_start`` (any prefix of each 64-row block's key blocks, up to its diagonal block:
    staircases and more) and, by brute force, which (query, key) pairs it keeps causally
    (``[B, H, T, T]``)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-t // 64)
    block_start = (torch.rand(b, h, blocks, generator=g) * (torch.arange(blocks) + 1)).floor().to(torch.int32)
    rows, keys = torch.arange(t), torch.arange(t)
    kept = (keys[None, :] <= rows[:, None]) & (keys >= 64 * block_start[..., rows // 64, None])
    return block_start, kept


@pytest.mark.parametrize("t,tile_m", [(1000, 64), (1000, 128), (129, 128), (64, 64), (1, 128)])
def test_acp_blocks_visit_exactly_the_tiles_with_kept_pairs(t, tile_m):
    """Against brute force over every (query, key) pair: a query tile is listed for a key tile
    iff some query of it keeps some key of it causally (key <= query, key at or past 64 x its
    64-row block's start); listed ones are packed left, in increasing order."""
    b, h, tile_n = 2, 3, 128
    block_start, kept = _random_staircase(b, h, t, seed=t + tile_m)
    count, index = fa4_bwd.acp_blocks(block_start, t, tile_m, tile_n)
    m_tiles, n_tiles = -(-t // tile_m), -(-t // tile_n)
    pad_r, pad_k = m_tiles * tile_m - t, n_tiles * tile_n - t
    kept = torch.nn.functional.pad(kept, (0, pad_k, 0, pad_r))
    want = kept.view(b, h, m_tiles, tile_m, n_tiles, tile_n).any(5).any(3).transpose(-1, -2)  # [B, H, N, M]
    assert torch.equal(count, want.sum(-1, dtype=torch.int32))
    for i in range(b):
        for j in range(h):
            for n in range(n_tiles):
                listed = index[i, j, n, : count[i, j, n]].tolist()
                assert listed == torch.nonzero(want[i, j, n]).flatten().tolist()


@pytest.mark.parametrize("t,tile_n,tile_m", [(1000, 128, 64), (1, 128, 128), (129, 128, 128),
                                             (2500, 128, 64)])
def test_column_terms_kernel_equals_reference(t, tile_n, tile_m):
    from lapse.ops.forgetting import fa4_prep

    g = torch.Generator().manual_seed(t)
    c = torch.nn.functional.logsigmoid(torch.randn(2, 3, t, generator=g) + 1).double().cumsum(-1) * 50
    c_hi = c.float().to(DEVICE)
    c_lo = (c - c.float().double()).float().to(DEVICE)
    want = fa4_bwd.column_terms(c_hi, c_lo, t, tile_n, tile_m)
    got = fa4_prep.column_terms(c_hi, c_lo, t, tile_n, tile_m)
    for a, w in zip(got, want, strict=True):
        assert a.shape == w.shape and torch.equal(a, w)


@pytest.mark.parametrize("t,tile_m", [(1000, 64), (1000, 128), (129, 128), (1, 64), (20000, 64)])
def test_acp_blocks_kernel_equals_reference(t, tile_m):
    from lapse.ops.forgetting import fa4_prep

    g = torch.Generator().manual_seed(t + tile_m)
    blocks = -(-t // 64)
    block_start = (torch.rand(2, 2, blocks, generator=g) * (torch.arange(blocks) + 1)).floor().to(torch.int32)
    block_start = block_start.to(DEVICE)
    want = fa4_bwd.acp_blocks(block_start, t, tile_m, 128)
    got = fa4_prep.acp_blocks(block_start, t, tile_m, 128, 64)
    for a, w in zip(got, want, strict=True):
        assert a.shape == w.shape and torch.equal(a, w)


def test_permute_columns_puts_a_threads_columns_side_by_side():
    """In a tile of 128 keys, the thread of quad lane q holds columns 8 i + 2 q + e (the wgmma
    accumulator's layout): after the permutation they are the 32 values at 32 q."""
    t_pad = 256
    d = torch.arange(2 * t_pad, dtype=torch.float32).view(2, t_pad)
    got = fa4_fwd.permute_columns(d, 128)
    for tile in range(2):
        for q in range(4):
            cols = [tile * 128 + 8 * i + 2 * q + e for i in range(16) for e in range(2)]
            at = tile * 128 + 32 * q
            assert torch.equal(got[:, at: at + 32], d[:, cols])


@pytest.mark.parametrize("t,tile_m", [(1000, 128), (1000, 192), (129, 192), (64, 128), (1, 192),
                                      (5000, 192)])
def test_acp_key_tiles_visit_exactly_the_tiles_with_kept_pairs(t, tile_m):
    """The forward's lists against brute force: query tile m lists key tile n iff some query of
    it keeps some key of it causally, or n lies between two that do (the kernel walks a range);
    increasing, packed left."""
    b, h, tile_n = 2, 3, 128
    block_start, kept = _random_staircase(b, h, t, seed=t + tile_m)
    count, index = fa4_fwd.acp_key_tiles(block_start, t, tile_m, tile_n)
    m_tiles, n_tiles = -(-t // tile_m), -(-t // tile_n)
    kept = torch.nn.functional.pad(kept, (0, n_tiles * tile_n - t, 0, m_tiles * tile_m - t))
    some = kept.view(b, h, m_tiles, tile_m, n_tiles, tile_n).any(5).any(3)  # [B, H, M, N]
    for i in range(b):
        for j in range(h):
            for m in range(m_tiles):
                hit = torch.nonzero(some[i, j, m]).flatten().tolist()
                want = list(range(hit[0], hit[-1] + 1))
                # the staircase's rows keep a contiguous range: no tile between two is skipped
                assert len(want) == len(hit)
                assert count[i, j, m] == len(want)
                assert index[i, j, m, : len(want)].tolist() == want


@pytest.mark.parametrize("t,tile_m", [(1000, 128), (1000, 192), (1, 192), (20000, 192)])
def test_acp_key_tiles_kernel_equals_reference(t, tile_m):
    from lapse.ops.forgetting import fa4_prep

    g = torch.Generator().manual_seed(t)
    blocks = -(-t // 64)
    block_start = (torch.rand(2, 3, blocks, generator=g) * (torch.arange(blocks) + 1)).floor()
    block_start = block_start.to(torch.int32).to(DEVICE)
    want = fa4_fwd.acp_key_tiles(block_start, t, tile_m, 128)
    got = fa4_prep.acp_key_tiles(block_start, t, tile_m, 128, 64)
    for a, w in zip(got, want, strict=True):
        assert a.shape == w.shape and torch.equal(a, w)


@pytest.mark.parametrize("t,tile_n,tile_m", [(1000, 128, 128), (129, 128, 192), (2500, 128, 192)])
def test_column_terms_kernel_permuted_equals_reference(t, tile_n, tile_m):
    from lapse.ops.forgetting import fa4_prep

    g = torch.Generator().manual_seed(t)
    c = torch.nn.functional.logsigmoid(torch.randn(2, 3, t + 5, generator=g) * 3 + 2).double().cumsum(-1)
    c_hi = c.float()
    c_lo = (c - c_hi.double()).float()
    c_hi, c_lo = c_hi.to(DEVICE), c_lo.to(DEVICE)
    d, shift = fa4_bwd.column_terms(c_hi, c_lo, t, tile_n, tile_m)
    got_d, got_shift = fa4_prep.column_terms(c_hi, c_lo, t, tile_n, tile_m, permute="columns")
    assert torch.equal(got_d, fa4_fwd.permute_columns(d, tile_n)) and torch.equal(got_shift, shift)
    got_d, got_shift = fa4_prep.column_terms(c_hi, c_lo, t, tile_n, tile_m, permute="keys")
    assert torch.equal(got_d, fa4_bwd.permute_keys(d)) and torch.equal(got_shift, shift)


def test_permute_keys_puts_a_threads_keys_side_by_side():
    """In the backward's transposed tiles a thread holds keys g and g + 8 of each 16-key slab: after
    the permutation they are the pair at 2 g."""
    d = torch.arange(2 * 256, dtype=torch.float32).view(2, 256)
    got = fa4_bwd.permute_keys(d)
    for slab in range(16):
        for g in range(8):
            at = slab * 16 + 2 * g
            assert torch.equal(got[:, at: at + 2], d[:, [slab * 16 + g, slab * 16 + g + 8]])


def test_not_taken_on_the_cpu():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    p = validate(q, q, q, torch.zeros(1, 8, 2), None, None, "torch")
    assert not fa4_bwd.serves(q, p, None) and not fa4_fwd.serves(q, p, None)


@pytest.mark.parametrize("path", ["forward", "backward"])
def test_a_failing_fa4_kernel_falls_back_to_triton(path, monkeypatch):
    """Where FlashAttention-4's kernel fails (its compile, here a stand-in that raises), the call
    runs on the Triton kernels, warns once (a second call neither tries it nor warns), and that
    path stays off for the process; running out of memory is not its fault and propagates."""
    monkeypatch.setattr(triton_ops, "FA4_STRICT", False)
    mod = fa4_fwd if path == "forward" else fa4_bwd
    monkeypatch.setattr(mod, "ENABLED", True)
    monkeypatch.setattr(mod, "serves", lambda *a: mod.ENABLED)
    tries = []

    def broken(*a, **kw):
        tries.append(1)
        raise RuntimeError("stand-in for a compile failure")

    monkeypatch.setattr(mod, path, broken)
    q, k, v, lg, do = _inputs(1, 40, 40, 2, 2, 16, "mixed", torch.float32, "cpu", seed=3)
    with pytest.warns(RuntimeWarning, match=f"FoX's {path} on FlashAttention-4 failed") as record:
        _compare(q, k, v, lg, do, torch.float32)
        _compare(q, k, v, lg, do, torch.float32)
    assert mod.ENABLED is False and len(tries) == 1
    assert sum("FlashAttention-4 failed" in str(w.message) for w in record) == 1

    def out_of_memory(*a, **kw):
        raise torch.cuda.OutOfMemoryError("stand-in")

    monkeypatch.setattr(mod, "ENABLED", True)
    monkeypatch.setattr(mod, path, out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _compare(q, k, v, lg, do, torch.float32)
    assert mod.ENABLED is True


def _fa4_or_skip():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    if fa4_bwd._kernels() is None:
        pytest.skip(f"needs flash-attn-4 {fa4_bwd.FA4_VERSION} (scripts/fetch_wheels.sh --fa4, "
                    "then scripts/gpu.sh)")


FA4_CASES = [
    # (B, T, HQ, H, D, gate, dtype, acp)
    (2, 1000, 3, 3, 128, "mixed", torch.bfloat16, None),
    (1, 4096, 4, 4, 128, "mixed", torch.bfloat16, None),
    (2, 1024, 4, 4, 64, "fast", torch.bfloat16, None),
    (1, 129, 2, 2, 64, "mixed", torch.float16, None),
    (1, 1, 2, 2, 64, "mixed", torch.bfloat16, None),
    (1, 300, 2, 2, 96, "extreme", torch.bfloat16, None),
    (1, 2048, 2, 2, 64, "extreme", torch.bfloat16, None),
    # grouped-query heads: the gate is a query head's, dK and dV a key head's
    (2, 1000, 6, 2, 128, "mixed", torch.bfloat16, None),
    (1, 777, 4, 1, 64, "fast", torch.bfloat16, "auto"),
    # ACP: the backward visits the kept tiles only and masks the pruned half of a visited one
    (2, 1000, 3, 3, 128, "fast", torch.bfloat16, "auto"),
    (1, 4096, 4, 4, 128, "mixed", torch.bfloat16, "auto"),
    (2, 1024, 4, 4, 64, "fast", torch.bfloat16, "auto"),
    (1, 777, 2, 2, 64, "fast", torch.float16, "auto"),
    (1, 300, 2, 2, 96, "fast", torch.bfloat16, "auto"),
    (1, 2048, 2, 2, 64, "extreme", torch.bfloat16, "auto"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FA4_CASES, ids=[
    f"b{c[0]}t{c[1]}hq{c[2]}h{c[3]}d{c[4]}-{c[5]}-{c[6]}-{c[7]}".replace("torch.", "") for c in FA4_CASES])
def test_fa4_backward_gpu(case, monkeypatch):
    _fa4_or_skip()
    b, t, hq, h, d, gate, dtype, acp = case
    _check_paths(case, monkeypatch, forward_on_fa4=False, backward_on_fa4=True, seed=d + t)


def _check_paths(case, monkeypatch, forward_on_fa4, backward_on_fa4, seed):
    """One case through the op with each of its forward and backward on FlashAttention-4 or on
    Triton, checked to have gone where asked."""
    b, t, hq, h, d, gate, dtype, acp = case
    monkeypatch.setattr(fa4_fwd, "ENABLED", forward_on_fa4)
    monkeypatch.setattr(fa4_bwd, "ENABLED", backward_on_fa4)
    calls = []
    for mod, name in ((fa4_bwd, "backward"), (fa4_fwd, "forward")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    q, k, v, lg, do = _inputs(b, t, t, hq, h, d, gate, dtype, "cuda", seed=seed)
    _compare(q, k, v, lg, do, dtype, acp, None, True if acp and gate == "fast" else None)
    assert ("forward" in calls) == forward_on_fa4 and ("backward" in calls) == backward_on_fa4, calls
    assert (fa4_fwd.ENABLED, fa4_bwd.ENABLED) == (forward_on_fa4, backward_on_fa4)  # no fallback


# T 1 (a query tile's first key tile is its last), 2048 with ACP (the last visited tile is not tile 0)
FWD_CASES = [c for c in FA4_CASES if c[1] in (1000, 777, 129, 300, 1, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("backward_on_fa4", [True, False], ids=["bwd-fa4", "bwd-triton"])
@pytest.mark.parametrize("case", FWD_CASES, ids=[
    f"b{c[0]}t{c[1]}hq{c[2]}h{c[3]}d{c[4]}-{c[5]}-{c[6]}-{c[7]}".replace("torch.", "") for c in FWD_CASES])
def test_fa4_forward_gpu(case, backward_on_fa4, monkeypatch):
    """The opt-in forward on FlashAttention-4 (LAPSE_FA4_FWD=1), with either backward: the lse
    handed between them."""
    _fa4_or_skip()
    _check_paths(case, monkeypatch, True, backward_on_fa4, seed=case[4] + case[1] + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_fa4_without_score_mod_unchanged_gpu(d):
    """The subclasses replace FlashAttention-4's forward and backward classes for every caller:
    without FoX's score_mod they must still compute plain causal attention and its gradients."""
    _fa4_or_skip()
    interface = fa4_bwd._kernels()[0]
    assert fa4_fwd._kernels() is not None  # the forward's subclass in place too
    g = torch.Generator(device="cuda").manual_seed(d)
    q, k, v, do = (torch.randn(2, 777, 3, d, device="cuda", generator=g).bfloat16() for _ in range(4))
    scale = d**-0.5
    o, lse = interface._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)[:2]
    got = interface._flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=scale, causal=True)[:3]

    def sdpa_grads(dtype):
        xs = [x.to(dtype).transpose(1, 2).requires_grad_() for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*xs, is_causal=True, scale=scale)
        grads = torch.autograd.grad(out, xs, do.to(dtype).transpose(1, 2))
        return [out.detach().transpose(1, 2)] + [g.transpose(1, 2) for g in grads]

    want, base = sdpa_grads(torch.float64), sdpa_grads(torch.bfloat16)  # base: SDPA's own kernel in bf16
    for name, a, b, w in zip(("o", "dq", "dk", "dv"), [o, *got], base, want, strict=True):
        err, err_base = _rel(a, w), _rel(b, w)
        assert err <= 3 * err_base + 1e-3, f"{name}: {err:.2e} against SDPA's {err_base:.2e}"


@pytest.mark.gpu
def test_fa4_refuses_what_it_does_not_serve_gpu():
    """The calls FlashAttention-4's kernels cannot take go to Triton: float32, head dims outside
    64/96/128, packed sequences, query and key lengths that differ."""
    _fa4_or_skip()

    def takes(dtype=torch.bfloat16, d=64, tq=256, tk=256, cu=None):
        q = torch.zeros(1, tq, 2, d, dtype=dtype, device="cuda")
        kv = torch.zeros(1, tk, 2, d, dtype=dtype, device="cuda")
        p = validate(q, kv, kv, torch.zeros(1, tk, 2, device="cuda"), None, cu, "triton")
        return fa4_bwd.serves(q, p, None), fa4_fwd.serves(q, p, None), fa4_bwd.fits(q, p)

    fa4_fwd.ENABLED, before = True, fa4_fwd.ENABLED  # the forward is opt-in
    try:
        assert takes() == (True, True, True)
        cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
        for kwargs in ({"dtype": torch.float32}, {"d": 48}, {"d": 256}, {"tq": 1}, {"cu": cu}):
            assert takes(**kwargs) == (False, False, False), kwargs
    finally:
        fa4_fwd.ENABLED = before
