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
    """:func:`ssu_math64` applied to a step's inputs (:class:`ssu.checking.inputs.StepInputs`) as a kernel
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


def packed_math64(cache, x, dt, A, B, C, slots, *, pad_slot_id, dst_slots=None, num_accepted=None,
                  cu_seqlens=None, D=None, z=None, dt_bias=None, dt_softplus=False):  # fmt: skip
    """vLLM's packed call (docs/spec.md, "Engine call forms") on a cache of logical states
    ``cache`` (num_slots, H, P, N), for a call whose ids, counts and offsets are all valid.

    ``x`` (tokens, H, P), ``dt`` (tokens, H), ``B``, ``C`` (tokens, G, N), ``z`` like x;
    ``cu_seqlens`` (N + 1,) or None (one token a sequence); ``slots``, ``dst_slots`` (N, W);
    ``num_accepted`` (N,) or None. Returns ``(cache, out)`` in float64: the cache after the call and
    the outputs (tokens, H, P), NaN in rows no sequence owns."""
    import torch

    f = torch.float64
    new = cache.to(f).clone()
    out = torch.full(x.shape, math.nan, dtype=f, device=x.device)
    tokens = x.shape[0]
    cu = list(range(tokens + 1)) if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]
    dst_slots = slots if dst_slots is None else dst_slots
    for n in range(len(cu) - 1):
        rows = list(range(cu[n], cu[n + 1]))
        if not rows:
            continue
        kept = 1 if num_accepted is None else int(num_accepted[n])
        first = int(slots[n, max(kept - 1, 0)])
        padded = first == pad_slot_id
        start = torch.zeros_like(new[:1]) if padded else cache.to(f)[first : first + 1]
        sel = torch.tensor(rows, device=x.device)

        def seq(t, sel=sel):
            return None if t is None else t[sel][None]

        states, y = ssu_math64(
            start, seq(x), seq(dt), A, seq(B), seq(C), D=D, z=seq(z), dt_bias=dt_bias, dt_softplus=dt_softplus
        )
        out[sel] = y[0]
        for t in range(len(rows)):
            target = int(dst_slots[n, t])
            if not padded and target != pad_slot_id:
                new[target] = states[0, t]
    return new, out


def verify_math64(cache, x, dt, A, B, C, slots, *, pad_slot_id, update_state=True, buffer=None, buffer_rows=None,
                  parents=None, D=None, z=None, dt_bias=None, dt_softplus=False):  # fmt: skip
    """SGLang's verify call (docs/spec.md, "Engine call forms") on a cache of logical states
    ``cache`` (num_slots, H, P, N), for a call whose ids and parents are all valid.

    ``x`` (b, T, H, P) and the other inputs with a token axis; ``buffer`` (rows, steps, H, P, N) or
    None; ``buffer_rows`` (b,) or None (the slots); ``parents`` (b, T) or None. Token t >= 1 of a
    row with a buffer row continues from the exact state after token ``parents[b, t]`` when that is
    one of 0..t-1. Returns ``(cache, buffer, out)`` in float64 (``buffer`` None without one)."""
    import torch

    f = torch.float64
    new = cache.to(f).clone()
    stored = None if buffer is None else buffer.to(f).clone()
    b, T = x.shape[:2]
    out = torch.empty(x.shape, dtype=f, device=x.device)
    for i in range(b):
        slot = int(slots[i])
        padded = slot == pad_slot_id
        row = None
        if stored is not None and not padded:
            row = slot if buffer_rows is None else int(buffer_rows[i])
        s = torch.zeros_like(new[:1]) if padded else cache.to(f)[slot : slot + 1]
        after = []
        for t in range(T):
            if t and row is not None and parents is not None and 0 <= int(parents[i, t]) < t:
                s = after[int(parents[i, t])]
            elif t:
                s = after[t - 1]

            def tok(v, i=i, t=t):
                return None if v is None else v[i : i + 1, t : t + 1]

            states, y = ssu_math64(
                s, tok(x), tok(dt), A, tok(B), tok(C), D=D, z=tok(z), dt_bias=dt_bias, dt_softplus=dt_softplus
            )
            after.append(states[:, 0])
            out[i, t] = y[0, 0]
            if row is not None:
                stored[row, t] = states[0, 0]
        if update_state and not padded:
            new[slot] = after[-1][0]
    return new, stored, out


#: unit roundoff of each dtype (half the distance between 1 and the next number)
EPS = {
    "fp32": 2.0**-24,
    "bf16": 2.0**-8,
    "fp16": 2.0**-11,
    "fp64": 2.0**-53,
    # quantised states (ssu.state.quant): half a step of a row's scale, relative to the row's largest
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

    from ..contract.dtypes import QMAX

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
