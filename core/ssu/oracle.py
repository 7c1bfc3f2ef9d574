"""An independent float64 statement of docs/spec.md's math, written for clarity, not speed.

Used to test the reference backend (and, through it, every other one) and by ``ssu run`` to check
the chosen backend along a decode. It works on plain tensors: no kernel, no state layout.
"""

from __future__ import annotations

import math
from typing import Optional


def softplus64(v):
    """softplus(v) = log(1 + exp(v)), and v itself above 20 (docs/spec.md)."""
    import torch

    return torch.where(v > 20.0, v, torch.log1p(torch.exp(torch.clamp(v, max=20.0))))


def ssu_math64(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False):
    """Apply T tokens to states.

    ``state`` (b, H, P, N); ``x`` (b, T, H, P); ``dt`` (b, T, H); ``B``, ``C`` (b, T, G, N);
    ``A``, ``D``, ``dt_bias`` (H,); ``z`` like x. Returns ``(states, out)``: the state after each
    token (b, T, H, P, N) and the outputs (b, T, H, P), all float64.
    """
    import torch

    f = torch.float64
    b, T, H, P = x.shape
    G = B.shape[2]
    group_of_head = torch.arange(H, device=x.device) // (H // G)  # head h reads group h // (H/G)
    s = state.to(f)
    states, outs = [], []
    for t in range(T):
        d = dt[:, t].to(f) + (0.0 if dt_bias is None else dt_bias.to(f))
        if dt_softplus:
            d = softplus64(d)
        decay = torch.exp(A.to(f) * d)  # (b, H)
        Bt = B[:, t].to(f)[:, group_of_head]  # (b, H, N)
        Ct = C[:, t].to(f)[:, group_of_head]
        xt = x[:, t].to(f)  # (b, H, P)
        s = decay[:, :, None, None] * s + torch.einsum("bh,bhp,bhn->bhpn", d, xt, Bt)
        y = torch.einsum("bhpn,bhn->bhp", s, Ct)
        if D is not None:
            y = y + D.to(f)[None, :, None] * xt
        if z is not None:
            zt = z[:, t].to(f)
            y = y * zt / (1.0 + torch.exp(-zt))
        states.append(s)
        outs.append(y)
    return torch.stack(states, 1), torch.stack(outs, 1)


def with_token_axis(problem, t):
    """A call's (b, ...) tensor as (b, T, ...): one-token problems get a token axis of length 1,
    speculative ones already have it (``None`` stays ``None``)."""
    return t if problem.multi_token or t is None else t[:, None]


def step_math64(problem, start, inputs):
    """:func:`ssu_math64` applied to a step's inputs (:class:`ssu.inputs.StepInputs`) as a kernel
    of ``problem`` receives them, from fp32/float64 states ``start`` (b, H, P, N)."""

    def tok(t):
        return with_token_axis(problem, t)

    return ssu_math64(
        start,
        tok(inputs.x),
        tok(inputs.dt),
        inputs.A,
        tok(inputs.B),
        tok(inputs.C),
        D=inputs.D,
        z=tok(inputs.z),
        dt_bias=inputs.dt_bias,
        dt_softplus=inputs.dt_softplus,
    )


#: unit roundoff of each dtype (half the distance between 1 and the next number)
EPS = {
    "fp32": 2.0**-24,
    "bf16": 2.0**-8,
    "fp16": 2.0**-11,
    "fp64": 2.0**-53,
    # quantised states (ssu.quant): half a step of a row's scale, relative to the row's largest
    # value (int8), and e4m3's unit roundoff (fp8)
    "int8": 0.5 / 127,
    "fp8_e4m3": 2.0**-4,
}


def _budget(u: float, tokens: int) -> float:
    return 4.0 * max(u, 2.0**-20) * math.sqrt(max(tokens, 1)) + 1e-5


def state_tolerance(state_dtype: str, tokens: int = 1) -> float:
    """Relative error (``rel_error``) a correct backend's new states stay under (docs/spec.md,
    "Error budgets"): ``4 u sqrt(T) + 1e-5`` with ``u`` the unit roundoff of the state dtype (at
    least 2^-20).

    Inputs are rounded to their dtypes before both sides see them, so a state computed in fp32
    from them differs from the float64 one only by fp32 arithmetic and the rounding to the cache
    dtype: an fp32 state is held to fp32 rounding whatever the input dtype."""
    return _budget(EPS[state_dtype], tokens)


def output_tolerance(input_dtype: str, tokens: int = 1) -> float:
    """Relative error a correct backend's outputs stay under: ``4 u sqrt(T) + 1e-5`` with ``u`` the
    unit roundoff of the output dtype (x's, at least 2^-20). Outputs come from the fp32 state
    before it is rounded to the cache, so the state dtype does not enter."""
    return _budget(EPS[input_dtype], tokens)


def tolerances(problem, tokens: Optional[int] = None, state_precision: Optional[str] = None) -> tuple[float, float]:
    """(output, state) budgets of ``problem`` for a step of ``tokens`` tokens (default: its T);
    ``state_precision`` (a backend's ``Capabilities.state_precision``) widens the state budget to
    that dtype's rounding when it is coarser than the state dtype."""
    T = problem.tokens_per_step if tokens is None else tokens
    state = problem.state_dtype
    if state_precision is not None and EPS[state_precision] > EPS[state]:
        state = state_precision
    return output_tolerance(problem.input_dtype, T), state_tolerance(state, T)


def rounding_bound(expected, state_dtype: str, start=None):
    """Per value, how far an 8-bit cache may hold a state from ``expected`` (float64, rows along
    the last axis) once written (docs/spec.md, "Quantised states"): half a step of the row's own
    scale (int8: the row's largest magnitude over 127), or half e4m3's spacing at the value's
    magnitude (fp8_e4m3: 2^-4 of the value, at least 2^-10 of a scale step), widened by 2^-10 of
    itself for reciprocals within a few ulp, plus 2^-17 of the tensor's largest value for the fp32
    arithmetic that produced the state. Per value, unlike :func:`rel_error`: a wrong scale (one
    per head, a scale that never shrinks) or rounding toward zero keeps a small row within a budget
    relative to the whole tensor, not within this one.

    ``start`` (the state a speculative step started from, same shape): the magnitudes are the
    larger of the two states' per value, since such a step may round the state it starts from and
    apply its accepted tokens afterwards (a checkpoint-and-ring backend folds its ring into the
    checkpoint before the step's tokens; docs/spec.md, "Quantised states")."""
    import torch

    from .dtypes import QMAX

    e = expected.to(torch.float64)
    magnitude = e.abs() if start is None else torch.maximum(e.abs(), start.to(torch.float64).abs())
    row_step = magnitude.amax(dim=-1, keepdim=True) / QMAX[state_dtype]
    if state_dtype == "int8":
        half = 0.5 * row_step.expand_as(e)
    else:
        half = torch.maximum(magnitude * 2.0**-4, row_step * 2.0**-10)
    top = e.abs().max().item() if e.numel() else 0.0
    return half * (1.0 + 2.0**-10) + 2.0**-17 * top


def rounding_excess(actual, expected, state_dtype: str, start=None):
    """Per value, how far ``actual`` (an 8-bit cache's state, read back) is from ``expected`` in
    units of :func:`rounding_bound`: at most 1 everywhere when the cache holds it as the rule allows."""
    import torch

    e = expected.to(torch.float64)
    return (actual.to(torch.float64) - e).abs() / rounding_bound(e, state_dtype, start)


def rel_error(actual, expected) -> float:
    """max |a - e| / max(max |e|, tiny): one number per tensor, robust to tiny entries."""
    import torch

    a = actual.to(torch.float64)
    e = expected.to(torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape {tuple(a.shape)} vs {tuple(e.shape)}")
    if not torch.isfinite(a).all():
        return math.inf
    scale = max(e.abs().max().item(), 1e-30) if e.numel() else 1.0
    return (a - e).abs().max().item() / scale if e.numel() else 0.0
