"""The table of conformance checks: each check's function, what it checks, which problems it
draws, when it cannot apply to a backend, and the rule a failure breaks; and :func:`run_on`, one
check on an opened kernel at the shapes a backend's own tests choose."""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from .cases import Case
from .checks import (
    check_bad_inputs,
    check_cuda_graph,
    check_decode,
    check_partial_commit,
    check_roundtrip,
    check_state_values,
    check_step,
    check_warmup,
)
from .engine_calls import check_packed_calls, check_verify_calls
from .expect import CheckSkipped
from .id_checks import check_adopted, check_destinations, check_guarded_ids
from .sequences import check_sequences


@attrs.frozen
class Check:
    """A conformance check: its function, what it checks, which problems it draws (``speculative``:
    only speculative ones, only one-token ones, or either), whether real model shapes run as
    explicit examples, why it cannot apply to a backend at all (``applies``: None if it can), and
    the rule (or group of rules, :mod:`.rules`) a failure breaks where the failure names none."""

    function: Callable
    what: str
    speculative: Optional[bool] = None
    real_shapes: bool = False
    applies: Callable = lambda capabilities, device: None
    rule: str = ""


def _needs(capability: str, why: str) -> Callable:
    return lambda caps, device: None if getattr(caps, capability) else why


def _serves(form: str) -> Callable:
    why = f"the backend does not declare the engine call form {form!r} (Capabilities.engine_calls)"
    return lambda caps, device: None if form in caps.engine_calls else why


def _on_cuda(caps, device: str):
    return None if str(device).startswith("cuda") else f"needs a CUDA device; this run is on {device}"


#: check name -> :class:`Check`
CHECKS: dict[str, Check] = {
    "step": Check(
        check_step, "one step (and commit) vs the oracle, every input option", real_shapes=True, rule="one-token"
    ),  # fmt: skip
    "decode": Check(
        check_decode,
        "a long decode of two states with commits of varying acceptance",
        real_shapes=True,
        rule="bookkeeping",
    ),  # fmt: skip
    "roundtrip": Check(check_roundtrip, "write_state/read_state round trip", rule="state-io"),
    "state-values": Check(
        check_state_values,
        "state values across the dtype's range; read results own their memory; stores round to nearest",
        rule="state-io",
    ),  # fmt: skip
    "sequences": Check(
        check_sequences,
        "steps, commits, sync, write_state, read_state and check mixed over layers and slots, faults between",
        rule="bookkeeping",
    ),
    "warmup": Check(check_warmup, "warmup leaves the state intact", rule="warmup/state-intact"),
    "bad-inputs": Check(check_bad_inputs, "bad inputs raise InputError, write nothing", rule="layout"),
    "cuda-graph": Check(check_cuda_graph, "CUDA-graph replay equals eager calls", applies=_on_cuda),
    "guarded-ids": Check(
        check_guarded_ids, "slot ids outside the cache served as pad rows and reported", rule="guarded"
    ),
    "destinations": Check(
        check_destinations,
        "steps that write dst_slots",
        speculative=False,
        real_shapes=True,
        applies=_needs("destination_slots", "the backend does not declare destination_slots"),
        rule="destinations",
    ),
    "adopted": Check(
        check_adopted,
        "an engine's cache adopted and stepped in place",
        real_shapes=True,
        applies=_needs("adopt_state", "the backend does not declare adopt_state"),
        rule="adopted",
    ),
    "partial-commit": Check(
        check_partial_commit,
        "a commit with a layer not stepped is refused",
        speculative=True,
        applies=_needs("speculative", "commits follow speculative steps; the backend declares none"),
        rule="commit/every-layer",
    ),
    "packed-calls": Check(
        check_packed_calls,
        "vLLM's packed call: per-token slots, counts, offsets",
        speculative=False,
        applies=_serves("packed"),
        rule="engine",
    ),
    "verify-calls": Check(
        check_verify_calls,
        "SGLang's verify call: intermediate states, parents",
        speculative=False,
        applies=_serves("verify"),
        rule="engine",
    ),
}


def case_for(problem, **knobs) -> Case:
    """A case for ``problem`` as engines call it: the whole batch with a pad row, every optional
    input, rows strided as slices of a projection; ``knobs`` override any field of :class:`Case`."""
    from ..checking.inputs import usable_slots

    batch = min(problem.max_batch, usable_slots(problem))
    fields = dict(layout="rows", dt_bias=problem.input_dtype, batch=batch, pad_rows=1 if batch >= 2 else 0, steps=8)
    return Case(problem, **dict(fields, **knobs))


def _case_on(kernel, **knobs) -> Case:
    """:func:`case_for` the kernel's problem, laid out as its capabilities need."""
    return case_for(kernel.problem, **dict(dict(aligned=kernel.capabilities.contiguous_rows), **knobs))


def run_on(kernel, check: str, gen, **knobs) -> None:
    """Run the check named ``check`` on an opened kernel with :func:`case_for` its problem (a
    backend's own tests use this at the shapes they care about); raises :class:`CheckFailure` or
    :class:`CheckSkipped`."""
    spec = CHECKS[check]
    why_not = spec.applies(kernel.capabilities, kernel.problem.device)
    if why_not:
        raise CheckSkipped(why_not)
    if spec.speculative is not None and spec.speculative != kernel.problem.speculative:
        raise CheckSkipped(f"check {check!r} applies to {'speculative' if spec.speculative else 'one-token'} problems")
    spec.function(kernel, _case_on(kernel, **knobs), gen)
