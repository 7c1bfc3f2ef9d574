"""Random, realistic SSU inputs for a problem (used by ``ssu run``, ``ssu verify``, ``ssu bench``,
warmup and tests), and the acceptance of a speculative step's drafts.

Values are drawn in fp32, then rounded to the problem's dtypes, so that a backend and the float64
oracle see exactly the same numbers. Magnitudes follow a trained Mamba2 layer: A in [-8, -1], raw
dt around -2..1 with softplus, unit-scale x, B, C and z. Never zeros.
"""

from __future__ import annotations

from typing import Optional

import attrs

from ..contract.dtypes import to_torch


@attrs.define
class StepInputs:
    """One step's tensors, named like the arguments of ``Kernel.step``."""

    x: object
    dt: object
    A: object
    B: object
    C: object
    slots: object
    D: object = None
    z: object = None
    dt_bias: object = None
    dt_softplus: bool = True

    def kwargs(self) -> dict:
        """The inputs as keyword arguments of a step call (tensors are not copied)."""
        return attrs.asdict(self, recurse=False)


def layer_weights(
    problem,
    generator,
    *,
    with_D: bool = True,
    with_dt_bias: bool = True,
    D_dtype: str = "fp32",
    dt_bias_dtype: Optional[str] = None,
) -> dict:
    """Per-head parameters of one layer: A (fp32); D (fp32 unless ``D_dtype``, as engines keep it)
    and dt_bias (in the input dtype unless ``dt_bias_dtype``, as models hold it), or None."""
    import torch

    H, dev = problem.nheads, problem.device
    A = -torch.empty(H).uniform_(1.0, 8.0, generator=generator)
    D = torch.randn(H, generator=generator).to(to_torch(D_dtype)) if with_D else None
    bias_dtype = to_torch(dt_bias_dtype or problem.input_dtype)
    dt_bias = torch.empty(H).uniform_(-3.0, 0.0, generator=generator).to(bias_dtype) if with_dt_bias else None
    return {k: (None if v is None else v.to(dev)) for k, v in {"A": A, "D": D, "dt_bias": dt_bias}.items()}


def step_inputs(
    problem,
    slots,
    generator,
    *,
    tokens: Optional[int] = None,
    weights: Optional[dict] = None,
    with_z: bool = True,
    dt_softplus: bool = True,
) -> StepInputs:
    """Random inputs for one step of a batch with the given ``slots`` tensor."""
    import torch

    p = problem
    b = slots.shape[0]
    T = p.tokens_per_step if tokens is None else tokens
    lead = (b, T) if p.multi_token else (b,)
    dt_lead = lead
    dtype = to_torch(p.input_dtype)
    weights = layer_weights(p, generator) if weights is None else weights

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(p.device)

    dt = torch.rand(*dt_lead, p.nheads, generator=generator) * 3.0 - 2.0
    if not dt_softplus:
        dt = dt.abs() * 0.1 + 0.01
    return StepInputs(
        x=draw(*lead, p.nheads, p.headdim),
        dt=dt.to(dtype).to(p.device),
        A=weights["A"],
        B=draw(*lead, p.ngroups, p.dstate, scale=0.5),
        C=draw(*lead, p.ngroups, p.dstate, scale=0.5),
        slots=slots,
        D=weights.get("D"),
        z=draw(*lead, p.nheads, p.headdim) if with_z else None,
        dt_bias=weights.get("dt_bias"),
        dt_softplus=dt_softplus,
    )


def random_states(problem, count: int, generator):
    """``count`` random fp32 states (count, H, P, N) of unit scale, on the problem's device."""
    import torch

    p = problem
    return torch.randn(count, p.nheads, p.headdim, p.dstate, generator=generator).to(p.device)


def usable_slots(problem) -> int:
    """Slots that can hold a sequence's state: all but a pad slot inside the cache."""
    return problem.num_slots - int(problem.pad_in_cache)


def pick_slots(problem, batch: int, generator, *, pad_rows: int = 0, index_dtype=None):
    """``batch`` distinct slots in random order (never a pad slot inside the cache), the last
    ``pad_rows`` of them pad ids."""
    import torch

    p = problem
    if batch - pad_rows > usable_slots(p):
        raise ValueError(f"batch {batch} needs {batch - pad_rows} distinct slots; the cache has {usable_slots(p)}")
    order = torch.randperm(p.num_slots, generator=generator)
    if p.pad_in_cache:
        order = order[order != p.pad_slot_id]
    real = order[: batch - pad_rows]
    slots = torch.cat([real, torch.full((pad_rows,), p.pad_slot_id)])
    return slots.to(index_dtype or torch.int32).to(p.device)


#: the chance that :func:`accepted_counts` keeps a draft token
P_ACCEPT = 0.7


def mean_accepted(tokens: int, p_accept: float = P_ACCEPT) -> float:
    """The mean of :func:`accepted_counts`: 1 + p + p^2 + ... + p^(tokens - 1)."""
    return sum(p_accept**j for j in range(tokens))


def accepted_counts(batch: int, tokens: int, gen, device, p_accept: float = P_ACCEPT):
    """Realistic acceptance for a speculative commit: each draft token is kept with probability
    ``p_accept`` until the first rejection, so num_accepted = 1 + the run of kept drafts
    (1..tokens), int32 on ``device``. ``ssu bench`` commits with it, and a backend's warmup should
    time with it too (a ring backend's flushes follow the accepted tokens)."""
    import torch

    kept = torch.rand(batch, tokens - 1, generator=gen) < p_accept
    return (1 + kept.int().cumprod(1).sum(1)).to(torch.int32).to(device)
