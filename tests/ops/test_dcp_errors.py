"""Bad input to the DCP ops raises ValueError/TypeError naming the argument, before any
work. Each case starts from a valid call and breaks one thing; other devices are
simulated with the 'meta' device."""

from __future__ import annotations

import math

import pytest
import torch

from lapse.ops.dcp import (
    alpha_sigmoid,
    dcp_attention,
    dcp_sparsity,
    dcp_sparsity_loss,
    interaction_log_mask,
    interaction_log_mask_step,
    interaction_logits,
    log_alpha_sigmoid,
)

B, T, R, HQ, H, D = 2, 8, 4, 4, 2, 16


@pytest.mark.parametrize("fn", [alpha_sigmoid, log_alpha_sigmoid])
@pytest.mark.parametrize(
    "alpha, error, pattern",
    [
        (0.999, ValueError, "alpha must be a finite number >= 1"),
        (-1.0, ValueError, "alpha must be a finite number >= 1"),
        (math.nan, ValueError, "alpha must be a finite number >= 1"),
        (math.inf, ValueError, "alpha must be a finite number >= 1"),
        (True, TypeError, "alpha must be a python float"),
        ("2", TypeError, "alpha must be a python float"),
        (torch.tensor(2), TypeError, "a tensor alpha must be floating point"),
        (torch.tensor([2.0]), ValueError, "a tensor alpha must be 0-d"),
        (torch.tensor(2.0, device="meta"), ValueError, "alpha is on meta but x is on cpu"),
    ],
    ids=["below-1", "negative", "nan", "inf", "bool", "str", "tensor-int", "tensor-1d", "tensor-device"],
)
def test_bad_alpha(fn, alpha, error, pattern):
    with pytest.raises(error, match=pattern):
        fn(torch.zeros(3), alpha)


@pytest.mark.parametrize("x", [torch.arange(3), [0.0, 1.0]], ids=["int", "list"])
def test_bad_x(x):
    with pytest.raises(TypeError, match="x must be a"):
        alpha_sigmoid(x, 3.0)


def valid_mask():
    return dict(q_int=torch.randn(B, T, R), k_int=torch.randn(B, T, R), beta=2.0, alpha=3.0)


MASK_CASES = [
    ("r-zero", dict(q_int=torch.randn(B, T, 0), k_int=torch.randn(B, T, 0)), ValueError,
     "the interaction dim r must be positive"),
    ("r-differs", dict(k_int=torch.randn(B, T, R + 1)), ValueError, "must agree in batch and r"),
    ("batch-differs", dict(k_int=torch.randn(B + 1, T, R)), ValueError, "must agree in batch"),
    ("length-differs", dict(k_int=torch.randn(B, T + 1, R)), ValueError, "must have the same length"),
    ("rank2", dict(q_int=torch.randn(T, R)), ValueError, r"q_int must be \[batch, time, r\]"),
    ("int", dict(q_int=torch.zeros(B, T, R, dtype=torch.long)), TypeError,
     "q_int must be a floating-point tensor"),
    ("dtypes-differ", dict(k_int=torch.randn(B, T, R, dtype=torch.float64)), TypeError,
     "must share a dtype"),
    ("not-tensor", dict(k_int=[[0.0]]), TypeError, "k_int must be a torch.Tensor"),
    ("other-device", dict(k_int=torch.randn(B, T, R, device="meta")), ValueError,
     "k_int is on meta"),
    ("beta-vector", dict(beta=torch.tensor([1.0, 2.0])), ValueError, "beta must be a number"),
    ("beta-int-tensor", dict(beta=torch.tensor(1)), ValueError, "beta must be a number"),
    ("beta-str", dict(beta="2"), TypeError, "beta must be a number or a tensor"),
    ("alpha-below-1", dict(alpha=0.5), ValueError, "alpha must be a finite number >= 1"),
]


@pytest.mark.parametrize("name, change, error, pattern", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_bad_mask_input(name, change, error, pattern):
    a = {**valid_mask(), **change}
    with pytest.raises(error, match=pattern):
        interaction_log_mask(**a)
    if name != "alpha-below-1":
        a.pop("alpha")
        with pytest.raises(error, match=pattern):
            interaction_log_mask_step(**a)
        if name != "length-differs":  # logits take Tq != Tk (decode)
            with pytest.raises(error, match=pattern):
                interaction_logits(**a)


def valid_attention():
    return dict(q=torch.randn(B, T, HQ, D), k=torch.randn(B, T, H, D), v=torch.randn(B, T, H, D),
                log_i=torch.zeros(B, T, T).tril(), backend="torch")


ATTENTION_CASES = [
    ("log_i-shape", dict(log_i=torch.zeros(B, T, T + 1)), ValueError, r"log_i must be \[batch, T, T\]"),
    ("log_i-per-head", dict(log_i=torch.zeros(B, HQ, T, T)), ValueError, r"log_i must be \[batch, T, T\]"),
    ("log_i-bf16", dict(log_i=torch.zeros(B, T, T, dtype=torch.bfloat16)), TypeError,
     "log_i must be float32"),
    ("log_i-int", dict(log_i=torch.zeros(B, T, T, dtype=torch.long)), TypeError, "log_i must be float32"),
    ("q-int", dict(q=torch.zeros(B, T, HQ, D, dtype=torch.long)), TypeError, "q must be float16"),
    ("q-rank3", dict(q=torch.randn(B, T, D)), ValueError, r"q must be \[batch, time, heads"),
    ("heads-not-multiple", dict(k=torch.randn(B, T, 3, D), v=torch.randn(B, T, 3, D)), ValueError,
     "must be a multiple of key/value heads"),
    ("kv-length", dict(k=torch.randn(B, T - 1, H, D), v=torch.randn(B, T - 1, H, D)), ValueError,
     "DCP attention is square"),
    ("log_i-device", dict(log_i=torch.zeros(B, T, T, device="meta")), ValueError, "log_i is on meta"),
    ("backend-triton", dict(backend="triton"), ValueError, "backend must be one of"),
    ("scale-negative", dict(scale=-1.0), ValueError, "scale must be a positive finite number"),
]


@pytest.mark.parametrize("name, change, error, pattern", ATTENTION_CASES,
                         ids=[c[0] for c in ATTENTION_CASES])
def test_bad_attention_input(name, change, error, pattern):
    a = {**valid_attention(), **change}
    with pytest.raises(error, match=pattern):
        dcp_attention(**a)


@pytest.mark.parametrize("fn", [dcp_sparsity, dcp_sparsity_loss])
def test_bad_sparsity_input(fn):
    with pytest.raises(ValueError, match=r"log_i must be \[batch, T, T\]"):
        fn(torch.zeros(B, T, T + 1))
    with pytest.raises(TypeError, match="log_i must be float32 or float64"):
        fn(torch.zeros(B, T, T, dtype=torch.float16))
