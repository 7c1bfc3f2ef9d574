"""The conformance checks of the engines' call forms (docs/spec.md, "Engine call forms"), for a
backend whose ``Capabilities.engine_calls`` names them.

Each drawn :class:`~.cases.Case` sets the head shapes, dtypes and pad id; the check opens a kernel
of the case's backend for the form (tables as wide as the backend allows, up to 4 tokens; enough
slots for every sequence's row of them; an adopted strided cache where the backend adopts) and
runs the case's schedule of calls (:mod:`.engine_draws`: every value of every knob of the form
the backend's capabilities allow) on two layers, each against the float64 oracle
(:mod:`ssu.checking.engine_harness`): every output, a given ``out``'s rows no sequence owns, every slot,
buffer row and layer the call does not write bit for bit, and a fault-free record. Then, where
validation does not look at values, each guarded value of the form in an otherwise valid call,
served as the spec says and named by ``check()`` with the record it must leave.
"""

from __future__ import annotations

import attrs

from ..checking import call_draws, engine_harness
from ..state import faults
from . import engine_draws
from ..checking.harness import engine_cache, engine_scales, prepared
from .cases import Case

#: tokens per sequence of the engine calls the kit draws, at most
MAX_TOKENS = 4


def _opened(kernel, case: Case, form: str, sequences: int, tables: int):
    """A kernel of ``kernel``'s backend and config for ``form`` at the case's head shapes and
    dtypes, with slots for ``tables`` tables of ``sequences`` rows, and its state (two layers,
    adopted where the backend adopts, every slot random)."""
    import torch

    from ..runtime.kernel import open_kernel

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


def _weights(problem, knobs: dict, gen) -> dict:
    from ..checking.inputs import layer_weights

    D, bias = knobs["D"], knobs["dt_bias"]
    return layer_weights(
        problem, gen, with_D=D != "none", with_dt_bias=bias != "none", D_dtype=D if D != "none" else "fp32",
        dt_bias_dtype=bias if bias != "none" else None,
    )  # fmt: skip


def _shared(problem, caps, knobs: dict, gen) -> dict:
    """draw_packed / draw_verify arguments of the knobs both forms share."""
    import torch

    return dict(
        index_dtype=torch.int64 if knobs["index dtype"] == "int64" else torch.int32,
        layout=knobs["inputs"],
        aligned=caps.contiguous_rows,
        out=knobs["out"] == "given",
        out_layout="contiguous" if caps.contiguous_rows else knobs["inputs"],  # contiguous_rows: one block
        expanded=knobs["per-head"] == "expanded",
        dt_dtype=knobs["dt"],
        with_z=knobs["z"] == "given",
        softplus=knobs["softplus"] == "yes",
        weights=_weights(problem, knobs, gen),
    )


def packed_call(problem, caps, knobs: dict, sequences: int, gen):
    """The packed call of one schedule entry (:func:`.engine_draws.packed_axes`)."""
    import torch

    W = problem.tokens_per_step
    packed = knobs["offsets"] == "given"
    lengths = None
    if knobs["lengths"] == "every sequence full":
        lengths = [W] * sequences
    elif knobs["lengths"] == "an empty sequence":
        lengths = torch.randint(1, W + 1, (sequences,), generator=gen).tolist()
        lengths[int(torch.randint(0, sequences, (1,), generator=gen))] = 0
    unowned = {"none": (0, 0), "leading": (2, 0), "trailing": (0, 3)}[knobs["unowned rows"]]
    if unowned != (0, 0):  # rows no sequence owns, within what N sequences of at most W tokens hold
        if lengths is None:
            lengths = torch.randint(0, W, (sequences,), generator=gen).tolist()
        room = sequences * W - sum(lengths)
        unowned = (min(unowned[0], room), min(unowned[1], room))
    return call_draws.draw_packed(
        problem, gen, sequences=sequences, packed=packed, lengths=lengths, counts=knobs["counts"] == "given",
        padded=1 if knobs["padded sequence"] == "yes" else 0, pad_cells=2 if knobs["pad cells"] == "yes" else 0,
        own_destinations=knobs["dst_slots"] != "none", table_layout=knobs["slot table"],
        dst_layout=knobs["dst_slots"] if knobs["dst_slots"] != "none" else None, unowned=unowned,
        **_shared(problem, caps, knobs, gen),
    )  # fmt: skip


def verify_call(problem, caps, knobs: dict, rows: int, gen):
    """The verify call of one schedule entry (:func:`.engine_draws.verify_axes`)."""
    T = problem.tokens_per_step
    buffer = None if knobs["buffer"] == "none" else knobs["buffer"]
    return call_draws.draw_verify(
        problem, gen, rows=rows, padded=1 if knobs["pad rows"] == "yes" else 0,
        update_state=knobs["update_state"] == "yes", buffer_dtype=buffer, buffer_rows=knobs["buffer_rows"] == "given",
        parents=knobs["parents"] == "given", steps=T + 2 if knobs["steps"] == "T + 2" else T,
        buffer_layout=knobs["buffer layout"], parents_layout=knobs["parents layout"],
        **_shared(problem, caps, knobs, gen),
    )  # fmt: skip


def schedule(kernel, form: str, problem, gen) -> list[dict]:
    """The calls a case draws of ``form`` (``packed`` or ``verify``): every knob's every value the
    backend's capabilities allow, in :func:`.engine_draws.covering` calls."""
    axes = engine_draws.packed_axes if form == "packed" else engine_draws.verify_axes
    return engine_draws.covering(axes(kernel.capabilities, problem), gen)


def check_packed_calls(kernel, case: Case, gen) -> None:
    """vLLM's packed call: the case's schedule (:func:`.engine_draws.packed_axes`: offsets and
    counts each given or not, one table or two in any layout, every index dtype, input layout,
    optional input and dtype, out given with rows no sequence owns, empty and full sequences,
    padded sequences and pad cells), each call against the oracle; then, where validation does not
    look at values, the guarded values (:func:`check_packed_guards`)."""
    sequences = max(2, min(case.batch, 3))
    opened, state, gen = _opened(kernel, case, "packed", sequences, 2)
    p = opened.problem
    for i, knobs in enumerate(schedule(opened, "packed", p, gen)):
        call = packed_call(p, opened.capabilities, knobs, sequences, gen)
        engine_harness.check_packed(opened, state, call, (i + 1) % 2, 2)
    if opened.config.validate != "full":
        check_packed_guards(opened, state, case, gen, sequences)


def check_packed_guards(opened, state, case: Case, gen, sequences: int) -> None:
    """Each value of a packed call that the spec guards ("What is refused, and what is guarded"),
    in a call otherwise valid: served as the spec says, with the record it must leave (argument,
    sequence, token and value), and everything the call must not write left bit for bit."""
    import torch

    p = opened.problem
    index = _index(case)
    W, pad, bad = p.tokens_per_step, p.pad_slot_id, _outside(p, index)
    n = int(torch.randint(0, sequences, (1,), generator=gen))
    full = dict(sequences=sequences, lengths=[W] * sequences, index_dtype=index, with_z=case.z)

    def guarded(call, served, arg: int, token: int, value, rule: str = "engine/packed-guards") -> None:
        fault = engine_harness.fault_label(arg, n, token, value)
        engine_harness.check_packed(opened, state, call, n % 2, 2, served_as=served, fault=fault, rule=rule)

    # a destination cell outside the cache, at the last token and before others: that token's
    # state is not written, the sequence's other tokens are
    for t in sorted({W - 1, int(torch.randint(0, W, (1,), generator=gen))}):
        call = call_draws.draw_packed(p, gen, accepted=[1] * sequences, own_destinations=True, **full)
        served = attrs.evolve(call, dst_slots=call.dst_slots.clone())
        served.dst_slots[n, t], call.dst_slots[n, t] = pad, bad
        guarded(call, served, faults.E_DST_SLOTS, t, bad)
    # the start cell outside the cache: the sequence is padded
    call = call_draws.draw_packed(p, gen, accepted=[W] * sequences, **full)
    served = attrs.evolve(call, slots=call.slots.clone())
    served.slots[n, W - 1], call.slots[n, W - 1] = pad, bad
    guarded(call, served, faults.E_SLOTS, W - 1, bad)
    # a count outside 0..W: the sequence is padded; recorded with tokens and without
    for count, length in ((W + 1, W), (-1, 0)):
        lengths = [W] * sequences
        lengths[n] = length
        call = call_draws.draw_packed(p, gen, accepted=[1] * sequences, **{**full, "lengths": lengths})
        served = attrs.evolve(call, slots=call.slots.clone(), num_accepted=call.num_accepted.clone())
        served.slots[n, 0], call.num_accepted[n] = pad, count
        guarded(call, served, faults.E_NUM_ACCEPTED, 0, count)
    # ids outside the cache in cells no token uses (past a sequence's tokens, a padded sequence's
    # destinations, an empty sequence's start cell): not used, so not checked, nothing recorded
    lengths = [W] * sequences
    lengths[n] = max(W - 1, 0)
    call = call_draws.draw_packed(p, gen, accepted=[1] * sequences, own_destinations=True, padded=1,
                                      **{**full, "lengths": lengths})  # fmt: skip
    served = attrs.evolve(call, dst_slots=call.dst_slots.clone(), slots=call.slots.clone())
    if W > 1:
        served.dst_slots[n, W - 1], call.dst_slots[n, W - 1] = pad, bad
    served.dst_slots[sequences - 1, 0], call.dst_slots[sequences - 1, 0] = pad, bad
    engine_harness.check_packed(opened, state, call, 0, 2, served_as=served, rule="engine/fault-table")
    lengths = [W] * sequences
    lengths[n] = 0
    call = call_draws.draw_packed(p, gen, accepted=[1] * sequences, **{**full, "lengths": lengths})
    served = attrs.evolve(call, slots=call.slots.clone())
    served.slots[n, 0], call.slots[n, 0] = pad, bad
    engine_harness.check_packed(opened, state, call, 1, 2, served_as=served, rule="engine/fault-table")
    # two guarded values in one call: the record keeps the smallest key (the argument's code first)
    if sequences > 1:
        m = (n + 1) % sequences
        call = call_draws.draw_packed(p, gen, accepted=[1] * sequences, own_destinations=True, **full)
        served = attrs.evolve(call, dst_slots=call.dst_slots.clone(), slots=call.slots.clone())
        served.dst_slots[min(n, m), 0], call.dst_slots[min(n, m), 0] = pad, bad
        served.slots[max(n, m), 0], call.slots[max(n, m), 0] = pad, bad
        fault = engine_harness.fault_label(faults.E_SLOTS, max(n, m), 0, bad)
        engine_harness.check_packed(opened, state, call, 0, 2, served_as=served, fault=fault, rule="guarded/key")
    # offsets that give a sequence more than W tokens, or do not ascend: recorded (token 0, the
    # sequence's end offset), no state of that sequence written
    for kind in ("long", "descending"):
        lengths = [max(W - 1, 1)] * sequences
        call = call_draws.draw_packed(p, gen, accepted=[1] * sequences, **{**full, "lengths": lengths})
        cu = call.cu_seqlens.clone()
        if kind == "long":
            cu[n + 1 :] += W + 1 - lengths[n]  # sequence n: W + 1 tokens, the others as they were
            extra = int(cu[-1]) - call.x.shape[0]
            call = attrs.evolve(call, cu_seqlens=cu, **_grown(call, extra))
        else:
            cu[n + 1] = cu[n] - 1 if int(cu[n]) > 0 else cu[n + 1]
            if int(cu[n + 1]) >= int(cu[n]):  # the first sequence starts at 0: end it before that
                cu[n + 1] = -1
        sequence_end = int(cu[n + 1])
        fault = engine_harness.fault_label(faults.E_CU_SEQLENS, n, 0, sequence_end)
        engine_harness.check_packed_sequence_dropped(opened, state, attrs.evolve(call, cu_seqlens=cu), n, fault,
                                                      n % 2, 2)  # fmt: skip


def _grown(call, extra: int) -> dict:
    """The token-major tensors of a packed call with ``extra`` more rows (random), for offsets that
    reach further."""
    import torch

    grown = {}
    for name in ("x", "dt", "B", "C", "z"):
        t = getattr(call, name)
        if t is None:
            continue
        expanded = t.stride(-1) == 0  # dt expanded over P
        base = t[..., 0] if expanded else t
        more = torch.randn((extra, *base.shape[1:]), generator=torch.Generator().manual_seed(extra))
        longer = torch.cat([base, more.to(t.dtype).to(t.device)])
        grown[name] = longer[..., None].expand(-1, *t.shape[1:]) if expanded else longer
    return grown


def check_verify_calls(kernel, case: Case, gen) -> None:
    """SGLang's verify call: the case's schedule (:func:`.engine_draws.verify_axes`: no buffer or
    one in fp32, bf16 or fp16 whatever the cache's dtype, in any layout, its rows given or the
    slots, steps past the tokens; parents in any layout, negative ones among them; the last state
    written or not; every index dtype, input layout, optional input and dtype, out given; pad
    rows), each call against the oracle, pad rows' outputs included. A backend may refuse a buffer
    that is not in the cache's dtype or not contiguous. Then, where validation does not look at
    values, the guarded values (:func:`check_verify_guards`)."""
    rows = max(2, min(case.batch, 3))
    form = "tree" if "tree" in kernel.capabilities.engine_calls else "verify"
    opened, state, gen = _opened(kernel, case, form, rows, 1)
    p = opened.problem
    own = p.state_dtype if not p.quantized else None
    for i, knobs in enumerate(schedule(opened, "verify", p, gen)):
        call = verify_call(p, opened.capabilities, knobs, rows, gen)
        refusable = knobs["buffer"] not in ("none", own) or knobs["buffer layout"] != "contiguous"
        engine_harness.check_verify(opened, state, call, i % 2, 2, refusable=refusable)
    if opened.config.validate != "full":
        check_verify_guards(opened, state, case, gen, rows)


def check_verify_guards(opened, state, case: Case, gen, rows: int) -> None:
    """Each value of a verify call that the spec guards, in a call otherwise valid: served as the
    spec says, with the record it must leave, and everything else left bit for bit."""
    import torch

    p = opened.problem
    own = p.state_dtype if not p.quantized else "fp32"  # SGLang keeps the buffer in the cache's dtype
    index = _index(case)
    bad = _outside(p, index)
    n = int(torch.randint(0, rows, (1,), generator=gen))
    call = call_draws.draw_verify(p, gen, rows=rows, update_state=True, buffer_dtype=own, index_dtype=index)
    served = attrs.evolve(call, slots=call.slots.clone())
    served.slots[n], call.slots[n] = p.pad_slot_id, bad  # served as a pad row
    fault = engine_harness.fault_label(faults.E_ROW_SLOTS, n, 0, bad)
    engine_harness.check_verify(opened, state, call, 0, 2, served_as=served, fault=fault)
    for row in (call.buffer.shape[0] + 2 if call.buffer is not None else rows + 2, -1):
        call = call_draws.draw_verify(p, gen, rows=rows, update_state=False, buffer_dtype=own, index_dtype=index)
        served = attrs.evolve(call, slots=call.slots.clone(), buffer_rows=call.buffer_rows.clone())
        served.slots[n] = p.pad_slot_id  # stores nothing, follows no parents; its outputs are unspecified
        call.buffer_rows[n] = row
        fault = engine_harness.fault_label(faults.E_BUFFER_ROWS, n, 0, row)
        engine_harness.check_verify(opened, state, call, 1, 2, served_as=served, fault=fault, unspecified=(n,))
    T = p.tokens_per_step
    if "tree" in p.engine_calls and T > 1:  # a parent at or after its token: recorded, not followed
        t = int(torch.randint(1, T, (1,), generator=gen))
        parent = int(torch.randint(t, T + 2, (1,), generator=gen))
        call = call_draws.draw_verify(p, gen, rows=rows, update_state=True, buffer_dtype=own, parents=True,
                                          index_dtype=index)  # fmt: skip
        served = attrs.evolve(call, parents=call.parents.clone())
        served.parents[n, t], call.parents[n, t] = -1, parent
        fault = engine_harness.fault_label(faults.E_PARENTS, n, t, parent)
        engine_harness.check_verify(opened, state, call, 0, 2, served_as=served, fault=fault,
                                    rule="engine/verify-parent-guard")  # fmt: skip
