"""8-bit state caches: how a state row is stored as 8-bit values and one fp32 scale.

A quantised state (``int8``, ``fp8_e4m3``) keeps, beside the 8-bit values, one fp32 scale per
(slot, head, row of P): the N values of a row share it. A row is written as

    scale = max |h| / QMAX          (QMAX: 127 for int8, 448 for fp8_e4m3; 0 for a row of zeros)
    q     = round_to_nearest(h / scale)   (int8: ties to even, within +-127; fp8: the cast)

and read as ``q * scale``. The scale is computed afresh from each row written: it grows and
shrinks with the row's largest magnitude at every write, so a row that decays keeps its full
8-bit resolution. A step dequantises the rows it reads, updates them in fp32 and quantises what it
writes; nothing else about the step changes.

Per-row scales cost 4 bytes per N values (3 % of an int8 state at N = 128) and bound a row's
error by its own largest value, where one scale per (slot, head) lets the largest row of a head
set the step of all its rows (docs/spec.md, "Quantised states", gives the measured errors).
"""

from __future__ import annotations

from ..contract.dtypes import QMAX, QUANTIZED_STATE_DTYPES, to_torch


def is_quantized(state_dtype: str) -> bool:
    """Whether states of this dtype are kept as 8-bit values with scales."""
    return state_dtype in QUANTIZED_STATE_DTYPES


def quantize(values, state_dtype: str):
    """``(q, scale)`` of ``values`` (..., N): q in the state dtype, one fp32 scale per row (...,)."""
    import torch

    values = values.float()
    qmax = QMAX[state_dtype]
    scale = values.abs().amax(dim=-1) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = values / safe[..., None]
    if state_dtype == "int8":
        q = torch.round(scaled).clamp_(-qmax, qmax).to(torch.int8)
    else:
        q = scaled.clamp(-qmax, qmax).to(to_torch(state_dtype))
    return q, scale


def dequantize(q, scale):
    """fp32 values of 8-bit rows ``q`` (..., N) with their scales (...,)."""
    return q.float() * scale[..., None]


def stored(values, state_dtype: str):
    """What a cache of ``state_dtype`` holds once ``values`` are written to it, read back as fp32
    (for a quantised dtype: quantised, then dequantised)."""
    if is_quantized(state_dtype):
        return dequantize(*quantize(values, state_dtype))
    return values.to(to_torch(state_dtype)).float()


#: how far from a tie (relative to h / scale) a quantised value may round to either neighbour: a
#: reciprocal ``QMAX / max|h|`` within a few units in the last place moves h / scale by no more
RECIPROCAL_MARGIN = 2.0**-20


def _rounded(x, state_dtype: str):
    """``x`` (float64) rounded to the 8-bit grid of ``state_dtype`` (int8: to nearest, ties to
    even, within +-127; fp8_e4m3: the cast), as float64."""
    import torch

    qmax = QMAX[state_dtype]
    if state_dtype == "int8":
        return torch.round(x).clamp(-qmax, qmax)
    return x.float().clamp(-qmax, qmax).to(to_torch(state_dtype)).double()


def off_rule(got, values, state_dtype: str):
    """Mask of the values of ``got`` (what a cache of 8-bit ``state_dtype`` reads back, fp32, after
    ``values`` were written) that the rule of docs/spec.md ("Quantised states") does not give: the
    row's scale ``max |h| / QMAX`` (in fp32), each value ``round(h / scale)`` read back as the fp32
    product ``q * scale``, where ``h / scale`` within :data:`RECIPROCAL_MARGIN` of a tie may round
    to either neighbour (a reciprocal within a few units in the last place), and nothing else."""
    import torch

    values = values.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / QMAX[state_dtype]
    x = values.double() / torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    g = got.float()
    ok = torch.zeros_like(g, dtype=torch.bool)
    for shift in (-RECIPROCAL_MARGIN, RECIPROCAL_MARGIN):
        q = _rounded(x + shift * x.abs(), state_dtype)
        ok |= g == (q.float() * scale)
    return ~ok
