"""The conformance checks of the engines' call forms (docs/spec.md, "Engine call forms"), for a
backend whose ``Capabilities.engine_calls`` names them.

Each drawn :class:`~.cases.Case` sets the head shapes, dtypes, pad id, index dtype, layout of the
per-head parameters, z and pad rows; the check opens a kernel of the case's backend for the form
(tables as wide as the backend allows, up to 4 tokens; enough slots for every sequence's row of
them; an adopted strided cache where the backend adopts) and runs a sequence of calls on two
layers, each against the float64 oracle (:mod:`ssu.engine_harness`), every slot and layer the
call does not write bit for bit, and a fault-free record. A third call passes an id outside the
cache where validation does not look, which must be served as the spec says and reported.
"""

from __future__ import annotations

import attrs

from .. import engine_harness, faults
from ..errors import InputError
from ..harness import CheckFailure, engine_cache, engine_scales, prepared
from .cases import Case

#: tokens per sequence of the engine calls the kit draws, at most
MAX_TOKENS = 4


def _opened(kernel, case: Case, form: str, sequences: int, tables: int):
    """A kernel of ``kernel``'s backend and config for ``form`` at the case's head shapes and
    dtypes, with slots for ``tables`` tables of ``sequences`` rows, and its state (two layers,
    adopted where the backend adopts, every slot random)."""
    import torch

    from ..kernel import open_kernel

    p = case.problem
    caps = kernel.capabilities
    W = max(1, min(MAX_TOKENS, caps.max_tokens_per_step))
    slots = tables * sequences * W + 3
    pad = p.pad_slot_id if p.pad_slot_id < 0 or not caps.any_pad_slot_id else (0 if p.pad_in_cache else slots + 2)
    problem = attrs.evolve(
        p, tokens_per_step=W, speculative=False, engine_calls={form}, num_slots=slots, max_batch=sequences,
        pad_slot_id=pad, engine_state=caps.adopt_state,
    )  # fmt: skip
    opened = open_kernel(kernel.config, problem, registry=kernel._registry)
    gen = torch.Generator().manual_seed(case.seed)
    if caps.adopt_state:
        cache, _ = engine_cache(problem, 2, gen, slot_stride=2)
        scales, _ = engine_scales(problem, 2, gen, slot_stride=2)
        state = opened.adopt_state(cache, scales=scales or None)
    else:
        state = prepared(opened, gen, 2)[0]
    return opened, state, gen


def _index(case: Case):
    import torch

    return torch.int64 if case.index_dtype == "int64" else torch.int32


def _fault_reported(kernel, arg: int, what: str) -> None:
    """``check()`` must raise for the call just made, naming the argument."""
    try:
        kernel.check()
    except InputError as exc:
        if faults.ENGINE_NAMES[arg] not in str(exc):
            raise CheckFailure(f"{what}: check() reported another fault: {exc}") from None
        return
    raise CheckFailure(f"{what}: the id outside the cache was not recorded (check() raised nothing)")


def check_packed_calls(kernel, case: Case, gen) -> None:
    """vLLM's packed call: mixed lengths (0 to W), counts 0 to W, padded sequences and pad cells,
    one table or two, tokens packed or one a sequence; then a destination outside the cache."""
    import torch

    sequences = max(1, min(case.batch, 3))
    opened, state, gen = _opened(kernel, case, "packed", sequences, 2)
    p = opened.problem
    for i, layer in enumerate((1, 0)):
        call = engine_harness.draw_packed(
            p, gen, sequences=sequences, packed=i == 0 or sequences == 1, padded=min(case.pad_rows, sequences),
            pad_cells=1 + i, own_destinations=i == 1, index_dtype=_index(case), expanded=case.tied, with_z=case.z,
        )  # fmt: skip
        engine_harness.check_packed(opened, state, call, layer, 2)
    call = engine_harness.draw_packed(p, gen, sequences=sequences, lengths=[1] * sequences, accepted=[1] * sequences,
                                      own_destinations=True, index_dtype=_index(case))  # fmt: skip
    call.dst_slots[0, 0] = p.num_slots + 11 if p.pad_slot_id != p.num_slots + 11 else p.num_slots + 12
    if opened.config.validate == "full":
        return
    before = [engine_harness.all_states(opened, state, 2)[layer] for layer in range(2)]
    opened.packed_step(state, **call.kwargs(), layer=0)
    _fault_reported(opened, faults.E_DST_SLOTS, "packed call with a destination outside the cache")
    others = torch.ones(p.num_slots, dtype=torch.bool)
    for n in range(1, sequences):
        others[call.dst_slots[n, 0].long().cpu()] = False
    after = engine_harness.all_states(opened, state, 2)
    if not torch.equal(after[0][others], before[0][others]) or not torch.equal(after[1], before[1]):
        raise CheckFailure("packed call with a destination outside the cache: a slot it does not write changed")


def check_verify_calls(kernel, case: Case, gen) -> None:
    """SGLang's verify call: a buffer in the cache's dtype in shuffled rows (the cache untouched),
    then the last state written without a buffer, then with a buffer (with ``tree`` a bf16 one,
    parents read back from it); then a slot outside the cache."""
    rows = max(1, min(case.batch, 3))
    opened, state, gen = _opened(kernel, case, "tree" if "tree" in kernel.capabilities.engine_calls else "verify",
                                 rows, 1)  # fmt: skip
    p = opened.problem
    tree = "tree" in p.engine_calls
    own = p.state_dtype if not p.quantized else "fp32"  # SGLang keeps the buffer in the cache's dtype
    calls = [
        dict(buffer_dtype=own, update_state=False),
        dict(buffer_dtype=None, update_state=True),
        dict(buffer_dtype="bf16" if tree else own, update_state=True, parents=tree, buffer_rows=False),
    ]
    for i, knobs in enumerate(calls):
        call = engine_harness.draw_verify(
            p, gen, rows=rows, padded=min(case.pad_rows, rows), index_dtype=_index(case), expanded=case.tied,
            with_z=case.z, **knobs,
        )  # fmt: skip
        engine_harness.check_verify(opened, state, call, i % 2, 2)
    if opened.config.validate == "full":
        return
    call = engine_harness.draw_verify(p, gen, rows=rows, update_state=True, buffer_dtype=own, index_dtype=_index(case))
    call.slots[0] = p.num_slots + 11 if p.pad_slot_id != p.num_slots + 11 else p.num_slots + 12
    before = engine_harness.all_states(opened, state, 2)
    opened.verify_step(state, **call.kwargs(), layer=0)
    _fault_reported(opened, faults.E_ROW_SLOTS, "verify call with a slot outside the cache")
    import torch

    after = engine_harness.all_states(opened, state, 2)
    others = torch.ones(p.num_slots, dtype=torch.bool)
    others[call.slots[1:].long().cpu()[call.slots[1:].cpu() != p.pad_slot_id]] = False
    if not torch.equal(after[0][others], before[0][others]) or not torch.equal(after[1], before[1]):
        raise CheckFailure("verify call with a slot outside the cache: a slot it does not write changed")
