"""Compare a result computed in a float dtype with the same computation in float64.

    ref = dense_math(x.double())                      # float64, from the SAME (already rounded) inputs
    assert_close_to_float64(ours(x), ref, dtype=torch.float32, terms=vocab, name="grad_hidden")

Because both start from the same inputs, the difference is the rounding of the computation alone,
and its size follows from the dtype, not from another implementation's rounding (two fp32 paths
that sum in different orders can each be right and still differ by more than either's error).

The bound, for every element:

    |actual - reference| <= tolerance(dtype, terms) * max|reference|
    tolerance(dtype, terms) = ULPS * sqrt(terms) * eps(dtype)

eps(dtype) is the float spacing at 1 (2^-23 for float32, 2^-7 for bfloat16); `terms` is the number
of roundings in `dtype` that accumulate into one value: for a float32 computation, the length of the
longest sum the values pass through (a softmax over the vocabulary, a dot product over the hidden
size, a gradient summed over tokens); for bfloat16, whose matmuls and reductions accumulate in
float32 on CPU, the number of bfloat16 results in the chain (the fp32 sums add a negligible
sqrt(n) * 2^-23). The error of an n-term floating-point sum grows like
sqrt(n) unit roundoffs when the roundings are independent (Higham & Mary, "A new approach to
probabilistic rounding error analysis", 2019); ULPS = 4 is that bound's constant with a margin
(a sum of 300 terms exceeds it with probability below 1e-5). The scale is the tensor's largest
magnitude (a normwise bound), since near-zero entries made by cancellation carry the absolute
error of their inputs, not a relative one.
"""
from __future__ import annotations

import math

import torch

ULPS = 4.0


def tolerance(dtype: torch.dtype, terms: int = 1) -> float:
    """Relative (to the largest magnitude) rounding bound of a `dtype` computation in which `terms`
    roundings accumulate into each value."""
    if terms < 1:
        raise ValueError(f"terms must be >= 1, got {terms}")
    return ULPS * math.sqrt(terms) * torch.finfo(dtype).eps


def assert_close_to_float64(actual: torch.Tensor, reference: torch.Tensor, *, dtype: torch.dtype,
                            terms: int = 1, name: str = "value") -> float:
    """Asserts the bound above; returns the worst error as a fraction of the allowed one."""
    if reference.dtype != torch.float64:
        raise TypeError(f"{name}: the reference must be float64, got {reference.dtype}")
    if actual.shape != reference.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    error = (actual.detach().to(torch.float64) - reference).abs()
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    allowed = tolerance(dtype, terms) * scale
    worst = float(error.max()) if error.numel() else 0.0
    if not math.isfinite(worst) or worst > allowed:
        index = tuple(int(i) for i in torch.unravel_index(torch.argmax(error), error.shape)) if error.numel() else ()
        raise AssertionError(
            f"{name}: |{dtype} result - float64 reference| = {worst:.3g} at {index} exceeds "
            f"{allowed:.3g} = {ULPS:g} * sqrt({terms}) * eps({dtype}) * max|reference| ({scale:.3g})")
    return worst / allowed if allowed else 0.0
