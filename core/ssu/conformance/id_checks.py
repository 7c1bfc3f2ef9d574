"""The conformance checks of slot ids and engines' caches: ids outside the cache served as pad
rows and recorded (guarded ids), steps that write destination slots, and an engine's cache
adopted and stepped in place."""

from __future__ import annotations

import attrs

from ..checking import oracle
from ..contract.errors import InputError
from ..checking.harness import (
    CheckFailure,
    batch_slots,
    cache_rows,
    engine_cache,
    engine_scales,
    expect_close,
    logical_states,
    prepared,
    real_slots,
)
from ..checking.inputs import pick_slots
from .cases import Case, step_call
from .expect import (
    CheckSkipped,
    budgets,
    draw_accepted,
    draw_slots,
    expect_no_fault,
    expect_states_close,
    expect_unchanged,
)


def _outside_ids(problem, count: int, index_dtype) -> list[int]:
    """``count`` ids that are neither a slot of the cache nor the pad id: below 0 and past the end;
    for int64 ids first one whose low 32 bits name slot 1 (or 0), which a backend that narrows
    ids to 32 bits would step as that slot."""
    import torch

    candidates = [-2, problem.num_slots, -7, problem.num_slots + 1000, -(2**31) + 5]
    if index_dtype == torch.int64:
        candidates.insert(0, 2**32 + min(1, problem.num_slots - 1))
    return [i for i in candidates if i != problem.pad_slot_id][:count]


def check_guarded_ids(kernel, case: Case, gen) -> None:
    """Slot ids outside the cache are served as pad rows: no state read or written (every slot
    bit-identical but the real rows'), their outputs from a zero state, and ``kernel.check()``
    names the first of them; a speculative commit with counts outside 1..T leaves those slots as
    they were and is reported too. One-token problems step layer 1 of two (layer 0 must not
    change); a speculative one, or one of a backend whose layers share their commit, has one
    layer, which its step (and commit) moves."""
    import torch

    p = kernel.problem
    if not kernel.config.validate and not kernel.capabilities.guards_slots:
        raise CheckSkipped("validate = false and the backend does not declare guards_slots: ids are not guarded")
    out_tol, state_tol = budgets(kernel)
    # a backend whose layers share their commit steps them all together: one layer here
    layer = 0 if p.speculative or kernel.capabilities.layers_share_commit else 1
    state, before = prepared(kernel, gen, layers=layer + 1)
    b = p.max_batch
    dtype = draw_slots(case, gen).dtype
    bad = _outside_ids(p, min(2, b), dtype)
    real = pick_slots(p, max(b - len(bad), 0), gen, index_dtype=dtype)
    slots = torch.cat([real, torch.tensor(bad, dtype=dtype, device=p.device)])
    inputs, call = step_call(attrs.evolve(case, batch=b, pad_rows=0), slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: len(real)] = before[layer][real.long()]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=layer, **call)
    expect_close(
        "outputs (rows with ids outside the cache from a zero state)",
        oracle.with_token_axis(p, out),
        outs,
        out_tol,
        "guarded/no-touch",
    )
    first = len(real)
    low = bad[0] - 2**32 if bad[0] >= 2**31 else bad[0]  # the key keeps an id's low 32 bits
    _names_fault(kernel, f"slots[{first}] = {low}", f"slots[{first}] = {bad[0]} lies outside the cache")
    if p.speculative and len(real):
        accepted = torch.ones(b, dtype=torch.int32, device=p.device)
        accepted[0] = 0 if len(real) == 1 or case.seed % 2 else p.tokens_per_step + 1
        kernel.commit(state, slots, accepted)
        count = int(accepted[0])
        _names_fault(kernel, f"num_accepted[0] = {count}", f"num_accepted[0] = {count} is outside 1..T",
                     "commit/count-recorded")  # fmt: skip
        moved = real[1:].long()
        rows = torch.arange(1, len(real), device=p.device)
        expect_states_close(
            kernel, "states after the commit", logical_states(kernel, state, 0)[moved], states[rows, 0], state_tol,
            rule="commit",
        )  # fmt: skip
        expect_unchanged(kernel, state, before, {0: moved}, "commit/count-guard")
    else:
        if not p.speculative:
            got = logical_states(kernel, state, layer)[real.long()]
            expect_states_close(
                kernel, "states of the real rows", got, states[: len(real), 0], state_tol, rule="one-token"
            )
        expect_unchanged(kernel, state, before, {layer: real.long()} if not p.speculative else {}, "guarded/no-touch")


def _names_fault(kernel, label: str, what: str, rule: str = "guarded/key") -> None:
    """``kernel.check()`` raises for the call just made, its message naming ``label`` (the
    argument, the row and the id of the smallest key), and then clears the record."""
    import re

    try:
        kernel.check()
    except InputError as exc:
        if not re.search(rf"(?<![\w.]){re.escape(label)}(?!\d)", str(exc)):
            raise CheckFailure(f"kernel.check() should name {label}, but reported: {exc}", rule) from None
    else:
        raise CheckFailure(f"{what}, but kernel.check() raised nothing", "guarded/recorded")
    expect_no_fault(kernel)


def check_destinations(kernel, case: Case, gen) -> None:
    """One-token steps that read ``slots`` and write ``dst_slots``: outputs and written states
    against the oracle, a row whose destination is the pad id writing nothing, a pad row whose
    destination is a real slot writing nothing, and every slot not written (the slots read
    included) bit-identical."""
    import torch

    p = kernel.problem
    b = min(case.batch, len(real_slots(p)) // 2)
    if b < 1:
        raise CheckSkipped("the cache is too small for distinct read and write slots")
    out_tol, state_tol = budgets(kernel)
    state, before = prepared(kernel, gen, layers=2)  # layer 1 stepped, layer 0 must not change
    pad = min(case.pad_rows, b - 1)
    dtype = draw_slots(case, gen).dtype
    slots, dst = batch_slots(p, b, pad, gen, dtype, True)
    if pad:  # a pad row whose destination is a real slot (one no row reads or writes): it writes nothing
        spare = [s for s in real_slots(p).tolist() if s not in slots.tolist() and s not in dst.tolist()]
        if spare:
            dst[b - 1] = spare[0]
    inputs, call = step_call(attrs.evolve(case, batch=b, pad_rows=pad), slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: b - pad] = before[1][slots[: b - pad].long()]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=1, dst_slots=dst, **call)
    expect_close("outputs", oracle.with_token_axis(p, out), outs, out_tol, "destinations")
    written = (dst != p.pad_slot_id) & (slots != p.pad_slot_id)
    targets = dst[written].long()
    got = logical_states(kernel, state, 1)[targets]
    expect_states_close(kernel, "states written to dst_slots", got, states[written, 0], state_tol, rule="destinations")
    expect_unchanged(kernel, state, before, {1: targets}, "pad/writes-nothing" if pad else "destinations/write-dst")
    expect_no_fault(kernel)
    if kernel.config.validate or kernel.capabilities.guards_slots:
        _destination_outside(kernel, state, case, slots, dst, pad, gen)


def _destination_outside(kernel, state, case: Case, slots, dst, pad: int, gen) -> None:
    """A step whose first row's destination lies outside the cache: that row writes nothing, the
    others write their destinations, and ``kernel.check()`` names ``dst_slots[0]``."""
    import torch

    p = kernel.problem
    b = slots.shape[0]
    bad = _outside_ids(p, 1, slots.dtype)[0]
    dst = dst.clone()
    dst[0] = bad
    before = [logical_states(kernel, state, layer).clone() for layer in range(state.num_layers)]
    inputs, call = step_call(attrs.evolve(case, batch=b, pad_rows=pad), slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: b - pad] = before[0][slots[: b - pad].long()]
    states, outs = oracle.step_math64(p, start, inputs)
    kernel.step(state, layer=0, dst_slots=dst, **call)
    low = bad - 2**32 if bad >= 2**31 else bad
    _names_fault(kernel, f"dst_slots[0] = {low}", f"dst_slots[0] = {bad} lies outside the cache",
                 "guarded/argument-code")  # fmt: skip
    written = (dst != p.pad_slot_id) & (slots != p.pad_slot_id)
    written[0] = False
    targets = dst[written].long()
    got = logical_states(kernel, state, 0)[targets]
    expect_states_close(kernel, "states written to dst_slots", got, states[written, 0], budgets(kernel)[1],
                  rule="destinations")  # fmt: skip
    expect_unchanged(kernel, state, before, {0: targets}, "guarded/no-touch")


def check_adopted(kernel, case: Case, gen) -> None:
    """An engine's cache (per layer a view into larger pages) adopted and stepped in place: the
    engine's tensors keep their storage and hold the oracle's states after the step (and commit),
    every other slot and the rest of the pages bit-identical; ``sync`` keeps them."""
    import torch

    p = kernel.problem
    out_tol, state_tol = budgets(kernel)
    layers = 2
    caches, pages = engine_cache(p, layers, gen)
    scales, scale_pages = engine_scales(p, layers, gen)
    pages_before = [page.clone() for page in pages]
    scale_pages_before = [page.clone() for page in scale_pages]
    state = kernel.adopt_state(caches, scales=scales or None)
    pointers = [c.data_ptr() for c in caches]
    b, pad = case.batch, case.pad_rows
    slots = draw_slots(case, gen)
    real = slots[: b - pad].long()
    expected = []
    for layer in range(layers):
        inputs, call = step_call(case, slots, gen)
        start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
        start[: b - pad] = cache_rows(p, caches[layer], scales and scales[layer], real)
        states, outs = oracle.step_math64(p, start, inputs)
        out = kernel.step(state, layer=layer, **call)
        expect_close(f"outputs of layer {layer}", oracle.with_token_axis(p, out), outs, out_tol)
        expected.append(states)
    pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
    if p.speculative:
        for layer in range(layers):
            if not torch.equal(caches[layer], pages_before[layer][:, 0]) or (
                scales and not torch.equal(scales[layer], scale_pages_before[layer][:, 0])
            ):
                raise CheckFailure(f"a speculative step changed the engine's cache of layer {layer} before commit")
        accepted = draw_accepted(case, gen)
        kernel.commit(state, slots, accepted)
        pick = accepted[: b - pad].long() - 1
    kernel.sync(state)
    rows = torch.arange(b - pad, device=p.device)
    others = torch.ones(p.num_slots, dtype=torch.bool, device=p.device)
    others[real] = False
    if p.pad_in_cache:
        others[p.pad_slot_id] = False  # a reserved null block: a backend may use it as a sink
    for layer in range(layers):
        if caches[layer].data_ptr() != pointers[layer] or state.cache[layer] is not caches[layer]:
            raise CheckFailure("the adopted state does not hold the engine's tensor any more")
        got = cache_rows(p, caches[layer], scales and scales[layer], real)
        expect_states_close(kernel, f"the engine's cache of layer {layer}", got, expected[layer][rows, pick], state_tol)
        for name, now, before in (("cache", pages, pages_before), ("scales", scale_pages, scale_pages_before)):
            if not now:
                continue
            if not torch.equal(now[layer][:, 1:], before[layer][:, 1:]):
                raise CheckFailure(f"data beside the slots in the engine's {name} pages of layer {layer} was written")
            if not torch.equal(now[layer][others, 0], before[layer][others, 0]):
                raise CheckFailure(f"slots of the engine's {name} of layer {layer} outside the batch changed")
    expect_no_fault(kernel)
