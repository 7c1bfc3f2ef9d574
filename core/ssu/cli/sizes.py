"""Whether a problem's sizes can run: ``--batch`` against ``--slots``, and the memory ``ssu run``
allocates (or one layer's state, for ``ssu explain``) against what the device has.

``ssu run`` and ``ssu explain`` share these checks so that explain never says a backend "would
serve" a problem that run refuses before it allocates. A refusal states its arithmetic: each
factor of the state's size with the option that sets it, and the parts that add up to the total.
"""

from __future__ import annotations

from typing import Optional

import attrs

from ..contract.errors import counted
from .usage import UsageError


def check_slots(problem, batch: int, pad_rows: Optional[int] = None) -> None:
    """The batch's real rows each need a distinct slot of the cache (all but a pad slot inside it).
    ``pad_rows`` is ``ssu run``'s option (None where the command has none)."""
    from ..checking.inputs import usable_slots

    real = batch - (pad_rows or 0)
    if real > usable_slots(problem):
        with_pad = "" if pad_rows is None else f" with --pad-rows {pad_rows}"
        raise UsageError(
            f"--batch {batch}{with_pad} needs {real} distinct slots; --slots {problem.num_slots} has "
            f"{usable_slots(problem)}: give --slots {real} or more"
        )


@attrs.frozen
class Footprint:
    """Bytes a decode run (:func:`ssu.cli.decode.decode_run`) holds at its peak, about, in its parts."""

    #: the state: every version of every slot and the sink row, of every layer
    state: int
    #: the fp32 random states one layer starts from (and their rounding), and the untouched slots'
    #: snapshots (up to 8 a layer) compared at the end
    copies: int
    #: a checked step's oracle: each layer's float64 states (T per row) and fp32 starting states,
    #: all held until the step is compared, and the oracle's own float64 working copies
    checks: int

    @property
    def total(self) -> int:
        return self.state + self.copies + self.checks


def footprint(problem, layers: int, *, checked: bool = True) -> Footprint:
    """What a decode run of ``layers`` layers holds (``checked=False``: ``--check-every 0``)."""
    from ..state.slot_state import versions

    p = problem
    elements = p.nheads * p.headdim * p.dstate
    per_layer = p.max_batch * elements * (8 * p.tokens_per_step + 4)
    return Footprint(
        state=layers * (p.num_slots + 1) * versions(p) * p.state_bytes_per_slot(),
        copies=2 * p.num_slots * elements * 4 + (layers + 1) * 8 * elements * 4,
        checks=(layers * per_layer + 2 * p.max_batch * elements * 8) if checked else 0,
    )


def state_factors(problem, layers: int) -> str:
    """The state's size as the product the options make: ``4 layers x 9 rows (8 slots and the
    sink row) x 5 versions (T + 1 for --tokens 4) x 4.0 MiB`` (a factor of 1 left out)."""
    from ..contract.devices import gib
    from ..state.slot_state import versions

    p = problem
    factors = [counted(layers, "layer")] if layers > 1 else []
    factors.append(f"{p.num_slots + 1} rows ({counted(p.num_slots, 'slot')} and the sink row)")
    if versions(p) > 1:
        factors.append(f"{versions(p)} versions (T + 1 for --tokens {p.tokens_per_step})")
    factors.append(f"{gib(p.state_bytes_per_slot())} a slot")
    return " x ".join(factors)


def _remedy(problem, options: tuple) -> str:
    named = list(options) + (["--tokens"] if problem.tokens_per_step > 1 else [])
    fewer = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
    return f"use fewer {fewer}, or smaller head shapes"


def check_run_memory(problem, layers: int, *, checked: bool = True) -> None:
    """``ssu run``'s allocations fit what the device has available now (where that can be told)."""
    from ..contract.devices import available_bytes, gib

    need = footprint(problem, layers, checked=checked)
    available = available_bytes(problem.device)
    if available is not None and need.total > available:
        checks = f", the checks' oracle copies {gib(need.checks)}" if need.checks else ""
        raise UsageError(
            f"this run needs about {gib(need.total)} but {problem.device} has {gib(available)} available: "
            f"its state, {state_factors(problem, layers)}, is {gib(need.state)}{checks}, its starting "
            f"states and untouched-slot copies {gib(need.copies)}; "
            + _remedy(problem, ("--layers", "--slots", "--batch"))
        )


def check_layer_fits(problem) -> None:
    """One layer's state (as :func:`footprint` counts it) fits the device's whole memory, where the
    device is here: a problem no backend could hold is refused rather than explained."""
    from ..contract.devices import gib, torch_device_availability, total_bytes

    if not torch_device_availability(problem.device).available:
        return  # every backend's verdict says the device is not here
    state = footprint(problem, 1).state
    total = total_bytes(problem.device)
    if total is not None and state > total:
        raise UsageError(
            f"one layer's state for this problem needs about {gib(state)} ({state_factors(problem, 1)}) "
            f"but {problem.device} has {gib(total)} in all; " + _remedy(problem, ("--slots",))
        )
