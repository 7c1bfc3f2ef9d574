"""What the conformance checks share: the slots and acceptance counts a check draws, the error
budgets of a kernel's problem, and the comparisons that raise :class:`~ssu.checking.harness.CheckFailure`
naming the rule of :mod:`.rules` a wrong result breaks."""

from __future__ import annotations

from ..checking import oracle
from ..contract.errors import InputError
from ..checking.harness import CheckFailure, expect_close, expect_out, expect_rounded, logical_states
from ..checking.inputs import pick_slots
from .cases import Case


class CheckSkipped(Exception):
    """A check that cannot run here (its device or a capability is missing); the message says why."""


def draw_slots(case: Case, gen):
    import torch

    dtype = torch.int64 if case.index_dtype == "int64" else torch.int32
    return pick_slots(case.problem, case.batch, gen, pad_rows=case.pad_rows, index_dtype=dtype)


def expect_returned(case: Case, call: dict, result) -> None:
    """``out`` is what the step returns when given; otherwise the step allocates it in x's dtype
    and shape (docs/spec.md)."""
    expect_out("the step", call["out"] if case.out else None, call["x"], result)


def budgets(kernel) -> tuple[float, float]:
    """(output, state) budgets of the kernel's problem, its declared state precision included."""
    return oracle.tolerances(kernel.problem, None, kernel.capabilities.state_precision)


def expect_states_close(kernel, what: str, got, want, tol: float, start=None, rule: str = "") -> None:
    """New states within the state budget of the exact ones; for an 8-bit cache also each value
    within its own rounding (its row's scale), which a budget relative to the tensor cannot see.
    ``start``: the states a speculative step started from (:func:`ssu.checking.oracle.rounding_bound`)."""
    expect_close(what, got, want, tol, rule)
    if kernel.problem.quantized:
        expect_rounded(what, got, want, kernel.problem.state_dtype, start if kernel.problem.speculative else None)


def expect_no_fault(kernel) -> None:
    """A call with valid ids records no fault."""
    try:
        kernel.check()
    except InputError as exc:
        raise CheckFailure(f"kernel.check() reported a fault for valid slot ids: {exc}", "pad/any-id") from None


def draw_accepted(case: Case, gen):
    """A commit's counts: the first rows keep every token, the first only, and one between (so each
    kind is drawn by construction where the batch has the rows), the rest at random."""
    import torch

    p = case.problem
    T = p.tokens_per_step
    counts = torch.randint(1, T + 1, (case.batch,), generator=gen, dtype=torch.int32)
    fixed = [T, 1] + ([int(torch.randint(2, T, (1,), generator=gen))] if T > 2 else [])
    real = case.batch - case.pad_rows
    counts[: min(len(fixed), real)] = torch.tensor(fixed[:real], dtype=torch.int32)
    return counts.to(p.device)


def expect_unchanged(kernel, state, before, named: dict, rule: str = "layers") -> None:
    """Every slot of every layer as in ``before``, except the slots ``named[layer]`` (else a
    failure breaking ``rule``)."""
    import torch

    p = kernel.problem
    every = torch.arange(p.num_slots, device=p.device)
    for layer in range(state.num_layers):
        now = logical_states(kernel, state, layer)
        mask = torch.ones(p.num_slots, dtype=torch.bool, device=p.device)
        if layer in named:
            mask[named[layer]] = False
        if not torch.equal(now[mask], before[layer][mask]):
            changed = every[mask][(now[mask] != before[layer][mask]).flatten(1).any(1)].tolist()
            raise CheckFailure(f"slots {changed[:8]} of layer {layer} changed, but the step did not name them", rule)
