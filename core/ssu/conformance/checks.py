"""The conformance checks of steps, decodes and the state's life: each drives an opened kernel
through one :class:`~.cases.Case` and compares what it computed with the float64 oracle, through
the backend-neutral ``read_state`` / ``write_state`` (:mod:`ssu.checking.harness`), within the budgets of
:func:`ssu.checking.oracle.tolerances`. The checks of slot ids and engines' caches are in
:mod:`.id_checks`, those of the engines' call forms in :mod:`.engine_calls`, the table of them all
in :mod:`.catalogue`.

A check raises :class:`~ssu.checking.harness.CheckFailure` on a wrong result and :class:`~.expect.CheckSkipped`
when the case does not apply to the backend (a capability it does not declare, validation off).
"""

from __future__ import annotations

import attrs

from ..checking import oracle
from ..state import quant
from ..contract.errors import InputError
from ..checking.harness import CheckFailure, expect_close, logical_states, prepared, real_slots
from ..checking.inputs import pick_slots, random_states, step_inputs
from .cases import Case, _laid_out, step_call
from .expect import (
    CheckSkipped,
    budgets,
    draw_accepted,
    draw_slots,
    expect_no_fault,
    expect_returned,
    expect_states_close,
    expect_unchanged,
)


def check_step(kernel, case: Case, gen) -> None:
    """One step (one commit if speculative) against the oracle: outputs of every row, pad rows
    included, their dtype and the returned tensor, which no later call writes; new states of the
    batch; every other slot bit-identical; no fault recorded. Without speculation layer 1 is
    stepped twice and layer 0 must not change; with it (or when the backend's layers share their
    commit) every layer is stepped, as commit covers the whole group."""
    import torch

    p = kernel.problem
    out_tol, state_tol = budgets(kernel)
    state, before = prepared(kernel, gen)
    b, pad = case.batch, case.pad_rows
    slots = draw_slots(case, gen)
    real = slots[: b - pad].long()
    group = p.speculative or kernel.capabilities.layers_share_commit
    math = "spec" if p.speculative else "one-token"
    expected = {}
    returned = []  # each call's result with a copy of it: a later call must not write what an earlier returned
    for layer in range(state.num_layers) if group else [1, 1]:
        inputs, call = step_call(case, slots, gen)
        start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
        start[: b - pad] = before[layer][real] if layer not in expected else kernel.read_state(state, real, layer)
        states, outs = oracle.step_math64(p, start, inputs)
        result = kernel.step(state, layer=layer, **call)
        expect_returned(case, call, result)
        expect_close(f"outputs of layer {layer}", oracle.with_token_axis(p, result), outs, out_tol, math)
        if p.speculative and not torch.equal(kernel.read_state(state, real, layer), before[layer][real]):
            raise CheckFailure("a speculative step changed the logical state before commit", "spec/step-leaves-state")
        for earlier, copy in returned:
            if earlier is result or not torch.equal(earlier, copy):
                raise CheckFailure("a later step wrote the output tensor an earlier one returned", "step/out-none")
        returned.append((result, result.clone()))
        expected[layer] = states
    pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
    if p.speculative:
        accepted = draw_accepted(case, gen)
        kernel.commit(state, slots, accepted)
        pick = accepted[: b - pad].long() - 1
    rows = torch.arange(b - pad, device=p.device)
    for layer, states in expected.items():
        got = kernel.read_state(state, real, layer)
        started = before[layer][real]
        expect_states_close(kernel, f"new states of layer {layer}", got, states[rows, pick], state_tol, started,
                      "commit" if p.speculative else math)  # fmt: skip
    expect_unchanged(kernel, state, before, {layer: real for layer in expected}, "layers" if case.pad_rows == 0 else "")
    expect_no_fault(kernel)


def check_decode(kernel, case: Case, gen) -> None:
    """A long decode (``case.steps`` steps) of two states of one kernel, two layers each: every
    step calls each layer of each state, then commits each state when speculative (acceptance
    varying), so that what a backend keeps between calls (drafts, cursors, rings) is tested per
    state. Between steps the batch moves over a pool of slots, as sequences finish and start.
    Each call against the oracle started from the kernel's own state; slots outside the pool stay
    bit-identical throughout."""
    import torch

    from .cases import weights

    p = kernel.problem
    if case.steps < 1:
        raise CheckSkipped("this profile runs no decode at real shapes")
    out_tol, state_tol = budgets(kernel)
    b, pad = case.batch, case.pad_rows
    states = [prepared(kernel, gen, layers=2) for _ in range(2)]
    dtype = draw_slots(case, gen).dtype
    pool = pick_slots(p, min(len(real_slots(p)), b - pad + 2), gen, index_dtype=dtype)
    pads = torch.full((pad,), p.pad_slot_id, dtype=dtype, device=p.device)
    w = [weights(case, gen) for _ in range(2)]
    rows = torch.arange(b - pad, device=p.device)
    math = "spec" if p.speculative else "one-token"
    for step in range(case.steps):
        batches = []
        for which, (state, _) in enumerate(states):
            order = torch.randperm(len(pool), generator=gen)[: b - pad].to(p.device)
            slots = torch.cat([pool[order], pads])
            real = slots[: b - pad].long()
            expected = []
            for layer in range(2):
                start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
                start[: b - pad] = kernel.read_state(state, real, layer)
                inputs, call = step_call(case, slots, gen, w[layer])
                new, outs = oracle.step_math64(p, start, inputs)
                result = kernel.step(state, layer=layer, **call)
                where = f"step {step}, state {which}, layer {layer}: outputs"
                expect_close(where, oracle.with_token_axis(p, result), outs, out_tol, math)
                expected.append((new, start[: b - pad]))
            batches.append((slots, real, expected))
        for which, ((state, _), (slots, real, expected)) in enumerate(zip(states, batches)):
            pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
            if p.speculative:
                accepted = draw_accepted(case, gen)
                kernel.commit(state, slots, accepted)
                pick = accepted[: b - pad].long() - 1
            for layer, (new, start) in enumerate(expected):
                got = kernel.read_state(state, real, layer)
                where = f"step {step}, state {which}, layer {layer}: states"
                expect_states_close(
                    kernel, where, got, new[rows, pick], state_tol, start, "commit" if p.speculative else math
                )
    for state, before in states:
        expect_unchanged(kernel, state, before, {0: pool.long(), 1: pool.long()})
    expect_no_fault(kernel)


def check_roundtrip(kernel, case: Case, gen) -> None:
    """write_state then read_state returns the values rounded to the cache dtype, each layer its
    own (two layers written with different values, in the reverse order they are read)."""
    p = kernel.problem
    state = kernel.allocate_state(num_layers=2)
    slots = pick_slots(p, min(len(real_slots(p)), 4), gen, index_dtype=draw_slots(case, gen).dtype)
    written = [random_states(p, len(slots), gen) for _ in range(2)]
    for layer in (1, 0):
        kernel.write_state(state, slots, written[layer], layer)
    for layer, values in enumerate(written):
        _expect_stored(p, kernel.read_state(state, slots, layer), values, f"layer {layer}")


def check_warmup(kernel, case: Case, gen) -> None:
    """Warmup leaves every state value exactly as it was."""
    import torch

    state, before = prepared(kernel, gen)
    kernel.warmup(state)
    for layer, values in enumerate(before):
        if not torch.equal(logical_states(kernel, state, layer), values):
            raise CheckFailure(f"warmup changed the state of layer {layer}")


def _refused(kernel, state, what: str, call: dict) -> None:
    try:
        kernel.step(state, **call)
    except InputError:
        return
    raise CheckFailure(f"{what}: no ssu.InputError")


def check_bad_inputs(kernel, case: Case, gen) -> None:
    """Wrong shapes, dtypes, devices, layers and layouts raise ssu.InputError, and nothing is written:
    strided slot ids, and the layouts and dtypes the backend declares it cannot take."""
    import torch

    p = kernel.problem
    caps = kernel.capabilities
    if not kernel.config.validate:
        raise CheckSkipped("validate = false: no input is checked")
    state, before = prepared(kernel, gen, layers=1)
    b = max(case.batch, 2) if p.max_batch >= 2 and len(real_slots(p)) >= 2 else 1
    slots = pick_slots(p, b, gen)
    good = dict(step_inputs(p, slots, gen).kwargs(), layer=0)
    cases = {
        "x with a wrong dtype": dict(good, x=good["x"].to(torch.float64)),
        "x with a wrong head count": dict(good, x=good["x"][..., :-1, :] if p.nheads > 1 else good["x"][..., :0]),
        "B with a wrong group count": dict(good, B=torch.cat([good["B"], good["B"]], dim=-2)),
        "slots as float": dict(good, slots=slots.float()),
        "A in bf16": dict(good, A=good["A"].to(torch.bfloat16)),
        "x on another device": dict(good, x=good["x"].to("meta")),
        "layer out of range": dict(good, layer=1),
    }
    if b >= 2:
        spread = torch.stack([slots, slots], 1)[:, 0]  # the same ids, stride 2
        cases["slot ids as a strided vector"] = dict(good, slots=spread)
    if caps.contiguous_rows:
        wide = torch.stack([good["x"], good["x"]], -1)[..., 0]  # every stride doubled
        cases["x strided inside its rows (declared contiguous_rows)"] = dict(good, x=wide)
        rows_apart = _laid_out(good["x"], "rows", 2 if p.multi_token else 1)  # rows 3 values apart
        cases["x rows not 16-byte aligned (declared contiguous_rows)"] = dict(good, x=rows_apart)
    if caps.dt_bias_as_dt and p.input_dtype != "fp32":
        cases["an fp32 dt_bias with a narrower dt (declared dt_bias_as_dt)"] = dict(
            good, dt_bias=torch.ones(p.nheads, device=p.device)
        )
    for what, call in cases.items():
        _refused(kernel, state, what, call)
    if not torch.equal(logical_states(kernel, state, 0), before[0]):
        raise CheckFailure("a refused call wrote to the state")


def check_cuda_graph(kernel, case: Case, gen) -> None:
    """On CUDA: a step of every layer (and the commit) captured in a CUDA graph and replayed gives
    bit-identical outputs and states to the same calls made eagerly."""
    import torch

    from ..checking.harness import seeded_states

    p = kernel.problem
    eager, graphed = seeded_states((kernel, kernel), p, gen, layers=2)
    kernel.warmup(graphed)
    slots = draw_slots(case, gen)
    calls = [step_call(attrs.evolve(case, out=True), slots, gen)[1] for _ in range(2)]
    eager_outs = [torch.empty_like(c["out"]) for c in calls]
    accepted = draw_accepted(case, gen)

    def decode(state, outs):
        for layer in range(2):
            kernel.step(state, layer=layer, **dict(calls[layer], out=outs[layer]))
        if p.speculative:
            kernel.commit(state, slots, accepted)

    outs = [c["out"] for c in calls]
    decode(graphed, outs)  # first calls (validation, lazy work) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(graphed, outs)
    decode(eager, eager_outs)
    for _ in range(3):
        graph.replay()
        decode(eager, eager_outs)
    torch.cuda.synchronize()
    if not all(torch.equal(a, b) for a, b in zip(outs, eager_outs)):
        raise CheckFailure("outputs of CUDA-graph replays differ from eager calls")
    for name, buf in graphed.buffers.items():
        if not torch.equal(buf, eager.buffers[name]):
            raise CheckFailure(f"buffer {name!r} after CUDA-graph replays differs from eager calls")


def check_partial_commit(kernel, case: Case, gen) -> None:
    """With validation on, a commit that finds a layer of the group not stepped since the last
    commit is refused, naming it, and no committed state is lost."""
    import torch

    p = kernel.problem
    if not kernel.config.validate:
        raise CheckSkipped("validate = false: commits are not checked")
    state, before = prepared(kernel, gen)
    slots = draw_slots(attrs.evolve(case, pad_rows=0), gen)
    kernel.step(state, layer=1, **step_call(case, slots, gen)[1])
    accepted = torch.ones(case.batch, dtype=torch.int32, device=p.device)
    try:
        kernel.commit(state, slots, accepted)
    except InputError as exc:
        if "layer(s) [0]" not in str(exc):
            raise CheckFailure(f"the refusal does not name layer 0: {exc}") from None
    else:
        raise CheckFailure("a commit after stepping only layer 1 of 2 was accepted")
    expect_unchanged(kernel, state, before, {})


def _expect_stored(p, got, values, what: str, rule: str = "") -> None:
    """``got``, read back after ``write_state`` of ``values``, is what the rounding of docs/spec.md
    gives (a float cache: to nearest, exactly, else a failure breaking ``rule``; an 8-bit one: each
    value by its row's own scale, with the reciprocal's freedom near ties that docs/spec.md allows)."""
    import torch

    if p.quantized:
        off = quant.off_rule(got, values.to(got.device), p.state_dtype)
        if bool(off.any()):
            where = tuple(int(i) for i in torch.nonzero(off)[0])
            zero_row = not bool(values[where[:-1]].abs().amax() > 0)
            raise CheckFailure(
                f"read_state after write_state, {what}: value {where} reads {got[where].item():.6e}, which "
                f"quantising {values[where].item():.6e} to {p.state_dtype} with its row's own scale (docs/spec.md, "
                "Quantised states) does not give",
                "quantised/row-scale" if zero_row else "quantised",
            )
        return
    want = quant.stored(values, p.state_dtype).to(got.device)
    if not torch.equal(got, want):
        where = tuple(int(i) for i in torch.nonzero(got != want)[0])
        raise CheckFailure(
            f"read_state after write_state, {what}: value {where} reads {got[where].item():.6e}; "
            f"{values[where].item():.9e} rounded to nearest in {p.state_dtype} is {want[where].item():.6e}",
            rule,
        )


def _installed(kernel, state, slots, values, layer: int, what: str) -> None:
    """``write_state`` of ``values`` then ``read_state``: :func:`_expect_stored`."""
    kernel.write_state(state, slots, values, layer)
    _expect_stored(kernel.problem, kernel.read_state(state, slots, layer), values, what, "state-io/write-rounding")


def _extremes(p, values, gen):
    """``values`` with rows across the state dtype's range: near fp16's largest finite value, far
    past fp32's precision of bf16's, and (8-bit) a row of zeros and rows a million times smaller."""
    import torch

    values = values.clone()
    flat = values.view(-1, p.dstate)
    rows = flat.shape[0]
    picks = torch.randperm(rows, generator=gen)
    big = {"fp16": 6.0e4, "bf16": 1.0e30, "fp32": 1.0e30}.get(p.state_dtype, 1.0e3)
    k = max(rows // 4, 1)
    flat[picks[:k]] *= big / flat[picks[:k]].abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    if rows > 1:
        flat[picks[k : 2 * k]] *= 1e-6
    if p.quantized:
        flat[picks[-1]] = 0.0
    return values


def check_state_values(kernel, case: Case, gen) -> None:
    """What the state hooks hold beyond one round trip: ``write_state`` stores values across the
    state dtype's range (fp16 near its largest value, 8-bit zero rows, rows far smaller than the
    slot's previous occupant, whose scale must not stay); ``read_state``'s results own their memory
    (edited, they change no state; held, no later call changes them), contiguous runs of slots
    included; and, on a float16 or bfloat16 cache, a step's stored states are the round-to-nearest
    of the exact ones, without bias (a store that truncates stays inside the budget of one step but
    drifts over a decode)."""
    import torch

    p = kernel.problem
    state = kernel.allocate_state(num_layers=2)
    real = real_slots(p)
    n = min(len(real), 4)
    index = draw_slots(case, gen).dtype
    slots = pick_slots(p, n, gen, index_dtype=index)
    run = real[:n].to(index)  # a contiguous ascending run: a backend returning a view of it shows
    layer = 1
    values = _extremes(p, random_states(p, n, gen) * 1e3, gen)
    _installed(kernel, state, slots, values, layer, "rows across the dtype's range")
    _installed(kernel, state, slots, random_states(p, n, gen) * 1e-4, layer, "rows far smaller than the last")
    for ids in (slots, run):
        kernel.write_state(state, ids, random_states(p, n, gen), layer)
        held = kernel.read_state(state, ids, layer)
        kept = held.clone()
        edited = kernel.read_state(state, ids, layer)
        edited.fill_(float("nan"))
        if not torch.equal(kernel.read_state(state, ids, layer), kept):
            raise CheckFailure("editing a tensor read_state returned changed the state", "state-io/read-owns")
        kernel.write_state(state, ids, random_states(p, n, gen), layer)
        kernel.read_state(state, ids, layer)
        if not torch.equal(held, kept):
            raise CheckFailure(
                "a tensor read_state returned changed when later calls wrote and read the same slots",
                "state-io/read-owns",
            )
    if p.state_dtype not in ("bf16", "fp16") or p.multi_token or p.speculative:
        return
    if kernel.capabilities.state_precision is not None or getattr(kernel.options, "stochastic_rounding", False):
        return
    mantissa = {"bf16": 7, "fp16": 10}[p.state_dtype]
    tiny = torch.finfo(torch.bfloat16 if p.state_dtype == "bf16" else torch.float16).tiny
    signed, count = 0.0, 0
    b = min(n, p.max_batch)
    stepped = slots[:b]
    step_case = attrs.evolve(case, batch=b, pad_rows=0, out=True)
    for _ in range(16):
        start = kernel.read_state(state, stepped, layer)
        inputs, call = step_call(step_case, stepped, gen)
        states, _ = oracle.step_math64(p, start, inputs)
        exact = states.reshape(b, -1, p.nheads, p.headdim, p.dstate)[:, -1].double()
        kernel.step(state, layer=layer, **call)
        got = kernel.read_state(state, stepped, layer).double()
        normal = exact.abs() >= tiny * 2
        ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 1 - mantissa)
        err = ((got - exact) / ulp * exact.sign())[normal]
        signed += float(err.sum())
        count += int(err.numel())
        if count >= 4096:
            break
    if count >= 256 and abs(signed / count) > 0.1:
        raise CheckFailure(
            f"a step's stored states lean {'toward' if signed < 0 else 'away from'} zero: {signed / count:+.3f} of a "
            f"unit in the last place on average over {count} values (rounding to nearest leans none)",
            "one-token/store-rounding",
        )
