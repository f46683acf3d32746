"""Inputs and comparisons shared by the CASTLE op tests (not a test module itself).

Errors are relative Frobenius norms against the float64 oracle (the parallel form).
STYLE principle 3: a backend's error may be at most 2x (o, lse) / 3x (gradients) the
error of the naive parallel form run in the backend's dtype, plus a floor for where the
baseline is itself at the dtype's rounding (one key per row: T = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lapse.ops.castle import castle_attention

NAMES = ("o", "lse", "dq_c", "dk_c", "dv_c", "dq_u", "dk_u", "dv_u")


@dataclass(frozen=True)
class Case:
    b: int = 1
    t: int = 63
    h: int = 2  # heads of q_c and q_u
    hc: int = 2  # heads of k_c, v_c
    hu: int = 2  # heads of k_u, v_u
    d: int = 48
    window: int | None = None
    lens: tuple[int, ...] | None = None  # packed lengths (cu_seqlens), b = 1

    @property
    def id(self) -> str:
        shape = f"B{self.b}-T{self.t}" if self.lens is None else "varlen" + "_".join(map(str, self.lens))
        return f"{shape}-H{self.h}-HC{self.hc}-HU{self.hu}-D{self.d}-W{self.window}"

    def cu_seqlens(self, device="cpu"):
        if self.lens is None:
            return None
        return torch.tensor([0, *torch.tensor(self.lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=device)


def make_inputs(case: Case, seed: int = 0, device="cpu"):
    """The six inputs (float32, O(1) entries), an output gradient and an lse gradient."""
    g = torch.Generator().manual_seed(seed)
    t = case.t if case.lens is None else sum(case.lens)
    heads = (case.h, case.hc, case.hc, case.h, case.hu, case.hu)
    xs = [torch.randn(case.b, t, hh, case.d, generator=g) for hh in heads]
    do = torch.randn(case.b, t, case.h, case.d, generator=g)
    dlse = torch.randn(case.b, case.h, t, generator=g)
    return [x.to(device) for x in xs], do.to(device), dlse.to(device)


def run(xs, do, dlse, dtype, backend, case: Case):
    """[o, lse, and the six input gradients] of one backend in ``dtype``; lse enters the
    loss too, so its gradient path is checked."""
    ys = [x.detach().to(dtype).requires_grad_() for x in xs]
    o, lse = castle_attention(*ys, window=case.window, cu_seqlens=case.cu_seqlens(xs[0].device),
                              return_lse=True, backend=backend)
    ((o.double() * do.double()).sum() + 0.1 * (lse.double() * dlse.double()).sum()).backward()
    return [o, lse] + [y.grad for y in ys]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def compare(case: Case, dtype, backend, floor: float, seed: int = 0, device="cpu",
            grad_floor: float = 0.0, ref_backend: str = "naive"):
    """Asserts the 2x / 3x rule for ``backend`` in ``dtype`` (``grad_floor`` added to the
    floor of the six gradients); returns the errors. ``ref_backend="torch"`` takes the
    float64 reference from the blocked torch path (equal to the naive one to 1e-12,
    test_castle_torch.py), which large GPU shapes need: the naive one is O(T^3)."""
    xs, do, dlse = make_inputs(case, seed, device)
    ref = run(xs, do, dlse, torch.float64, ref_backend, case)
    base = run(xs, do, dlse, dtype, "naive", case)
    got = run(xs, do, dlse, dtype, backend, case)
    errors = {}
    for name, a, b, r in zip(NAMES, got, base, ref, strict=True):
        assert a.shape == r.shape, name
        assert not torch.isnan(a).any(), f"{name} has NaN (an unwritten tile?)"
        err, err_base = rel(a, r), rel(b, r)
        factor, fl = (2.0, floor) if name in ("o", "lse") else (3.0, floor + grad_floor)
        assert err <= factor * err_base + fl, (
            f"{name}: {backend} error {err:.2e} > {factor} x baseline {err_base:.2e} + {fl:.0e}")
        errors[name] = (err, err_base)
    return errors


def time_ms(fn, reps: int = 5) -> float:
    """Milliseconds per call of ``fn`` on the GPU (one warm-up call, then ``reps``)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
