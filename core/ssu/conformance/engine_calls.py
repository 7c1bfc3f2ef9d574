"""The conformance checks of the engines' call forms (docs/spec.md, "Engine call forms"), for a
backend whose ``Capabilities.engine_calls`` names them.

Each drawn :class:`~.cases.Case` sets the head shapes, dtypes, pad id, index dtype, layout of the
per-head parameters, z and pad rows; the check opens a kernel of the case's backend for the form
(tables as wide as the backend allows, up to 4 tokens; enough slots for every sequence's row of
them; an adopted strided cache where the backend adopts) and runs a sequence of calls on two
layers, each against the float64 oracle (:mod:`ssu.engine_harness`), every slot and layer the
call does not write bit for bit, and a fault-free record. Then, where validation does not look at
values, calls with an id, a count or a buffer row outside what the cache, the table or the
buffer holds, each of which must be served as the spec says and named by ``check()``.
"""

from __future__ import annotations

import attrs

from .. import engine_harness, faults
from ..harness import engine_cache, engine_scales, prepared
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


def _outside(problem, index_dtype) -> int:
    """An id that is neither a slot of the cache nor the pad id; for int64 ids one whose low 32
    bits name slot 1, which a backend narrowing ids to 32 bits would use as that slot."""
    import torch

    if index_dtype == torch.int64:
        return 2**32 + 1
    return problem.num_slots + 11 if problem.pad_slot_id != problem.num_slots + 11 else problem.num_slots + 12


def check_packed_calls(kernel, case: Case, gen) -> None:
    """vLLM's packed call: mixed lengths (0 to W), counts 0 to W, padded sequences and pad cells,
    one table or two, tokens packed or one a sequence; then, where validation does not look at
    values, a destination cell of a sequence's last token, a start cell and a count outside what
    the cache and the table hold: each served as the spec says and named by ``check()``."""
    import torch

    sequences = max(2, min(case.batch, 3))
    opened, state, gen = _opened(kernel, case, "packed", sequences, 2)
    p = opened.problem
    index = _index(case)
    for i, layer in enumerate((1, 0)):
        padded = min(max(case.pad_rows, 1 - i), sequences - 1)  # the first call has a padded sequence
        call = engine_harness.draw_packed(
            p, gen, sequences=sequences, packed=i == 0, padded=padded, pad_cells=1 + i, own_destinations=i == 1,
            index_dtype=index, expanded=case.tied, with_z=case.z,
        )  # fmt: skip
        engine_harness.check_packed(opened, state, call, layer, 2)
    if opened.config.validate == "full":
        return
    W, pad, bad = p.tokens_per_step, p.pad_slot_id, _outside(p, index)
    n = int(torch.randint(0, sequences, (1,), generator=gen))
    full = dict(sequences=sequences, lengths=[W] * sequences, index_dtype=index, with_z=case.z)

    def guarded(call, served, arg: int, token: int) -> None:
        fault = faults.engine_label(arg, n, token)
        engine_harness.check_packed(opened, state, call, n % 2, 2, served_as=served, fault=fault)

    call = engine_harness.draw_packed(p, gen, accepted=[1] * sequences, own_destinations=True, **full)
    served = attrs.evolve(call, dst_slots=call.dst_slots.clone())
    served.dst_slots[n, W - 1], call.dst_slots[n, W - 1] = pad, bad  # that token's state is not written
    guarded(call, served, faults.E_DST_SLOTS, W - 1)
    call = engine_harness.draw_packed(p, gen, accepted=[W] * sequences, **full)
    served = attrs.evolve(call, slots=call.slots.clone())
    served.slots[n, W - 1], call.slots[n, W - 1] = pad, bad  # the start cell: the sequence is padded
    guarded(call, served, faults.E_SLOTS, W - 1)
    call = engine_harness.draw_packed(p, gen, accepted=[1] * sequences, **full)
    served = attrs.evolve(call, slots=call.slots.clone(), num_accepted=call.num_accepted.clone())
    served.slots[n, 0], call.num_accepted[n] = pad, W + 1  # a count past the table: the sequence is padded
    guarded(call, served, faults.E_NUM_ACCEPTED, 0)


def check_verify_calls(kernel, case: Case, gen) -> None:
    """SGLang's verify call: a buffer in the cache's dtype in shuffled rows (the cache untouched),
    then the last state written without a buffer, then with a buffer indexed by slot (with
    ``tree`` a bf16 one, parents read back from it), then with a bf16 buffer and no parents (the
    slot's state from the fp32 state, not the buffer's copy; skipped where the backend refuses
    that dtype); pad rows in each. Then, where validation does not look at values, a slot and a
    buffer row outside the cache and the buffer: served as the spec says and named by ``check()``."""
    import torch

    rows = max(2, min(case.batch, 3))
    opened, state, gen = _opened(kernel, case, "tree" if "tree" in kernel.capabilities.engine_calls else "verify",
                                 rows, 1)  # fmt: skip
    p = opened.problem
    tree = "tree" in p.engine_calls
    own = p.state_dtype if not p.quantized else "fp32"  # SGLang keeps the buffer in the cache's dtype
    index = _index(case)
    calls = [
        dict(buffer_dtype=own, update_state=False),
        dict(buffer_dtype=None, update_state=True),
        dict(buffer_dtype="bf16" if tree else own, update_state=True, parents=tree, buffer_rows=False),
    ]
    if own != "bf16":
        calls.append(dict(buffer_dtype="bf16", update_state=True))
    for i, knobs in enumerate(calls):
        padded = min(max(case.pad_rows, 1), rows - 1) if knobs["buffer_dtype"] else min(case.pad_rows, rows - 1)
        call = engine_harness.draw_verify(
            p, gen, rows=rows, padded=padded, index_dtype=index, expanded=case.tied, with_z=case.z, **knobs
        )
        engine_harness.check_verify(opened, state, call, i % 2, 2, refusable=i == 3)
    if opened.config.validate == "full":
        return
    bad = _outside(p, index)
    n = int(torch.randint(0, rows, (1,), generator=gen))
    call = engine_harness.draw_verify(p, gen, rows=rows, update_state=True, buffer_dtype=own, index_dtype=index)
    served = attrs.evolve(call, slots=call.slots.clone())
    served.slots[n], call.slots[n] = p.pad_slot_id, bad  # served as a pad row
    fault = faults.engine_label(faults.E_ROW_SLOTS, n, 0)
    engine_harness.check_verify(opened, state, call, 0, 2, served_as=served, fault=fault)
    call = engine_harness.draw_verify(p, gen, rows=rows, update_state=False, buffer_dtype=own, index_dtype=index)
    served = attrs.evolve(call, slots=call.slots.clone(), buffer_rows=call.buffer_rows.clone())
    served.slots[n] = p.pad_slot_id  # stores nothing, follows no parents; its outputs are unspecified
    call.buffer_rows[n] = call.buffer.shape[0] + 2
    fault = faults.engine_label(faults.E_BUFFER_ROWS, n, 0)
    engine_harness.check_verify(opened, state, call, 1, 2, served_as=served, fault=fault, unspecified=(n,))
