"""The conformance checks: each drives an opened kernel through one :class:`~.cases.Case` and
compares what it computed with the float64 oracle, through the backend-neutral ``read_state`` /
``write_state`` (:mod:`ssu.harness`), within the budgets of :func:`ssu.oracle.tolerances`.

A check raises :class:`~ssu.harness.CheckFailure` on a wrong result and :class:`CheckSkipped`
when the case does not apply to the backend (a capability it does not declare, validation off).
"""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from .. import oracle, quant
from ..errors import InputError
from ..harness import (
    CheckFailure,
    batch_slots,
    cache_rows,
    engine_cache,
    engine_scales,
    expect_close,
    expect_rounded,
    logical_states,
    prepared,
    real_slots,
)
from ..inputs import pick_slots, random_states, step_inputs
from .cases import Case, _laid_out, step_call
from .engine_calls import check_packed_calls, check_verify_calls


class CheckSkipped(Exception):
    """A check that cannot run here (its device or a capability is missing); the message says why."""


def _slots(case: Case, gen):
    import torch

    dtype = torch.int64 if case.index_dtype == "int64" else torch.int32
    return pick_slots(case.problem, case.batch, gen, pad_rows=case.pad_rows, index_dtype=dtype)


def _returned(case: Case, call: dict, result) -> None:
    """``out`` is what the step returns when given; otherwise the step allocates it in x's dtype
    and shape (docs/spec.md)."""
    x = call["x"]
    if case.out:
        if result is not call["out"]:
            raise CheckFailure("the step did not return the `out` tensor it was given")
    elif getattr(result, "dtype", None) != x.dtype or tuple(result.shape) != tuple(x.shape):
        got = (getattr(result, "dtype", type(result).__name__), tuple(getattr(result, "shape", ())))
        raise CheckFailure(
            f"with out=None the step returned {got}; expected x's dtype and shape {(x.dtype, tuple(x.shape))}"
        )


def _budgets(kernel) -> tuple[float, float]:
    """(output, state) budgets of the kernel's problem, its declared state precision included."""
    return oracle.tolerances(kernel.problem, None, kernel.capabilities.state_precision)


def _states_close(kernel, what: str, got, want, tol: float, start=None) -> None:
    """New states within the state budget of the exact ones; for an 8-bit cache also each value
    within its own rounding (its row's scale), which a budget relative to the tensor cannot see.
    ``start``: the states a speculative step started from (:func:`ssu.oracle.rounding_bound`)."""
    expect_close(what, got, want, tol)
    if kernel.problem.quantized:
        expect_rounded(what, got, want, kernel.problem.state_dtype, start if kernel.problem.speculative else None)


def _no_fault(kernel) -> None:
    """A call with valid ids records no fault."""
    try:
        kernel.check()
    except InputError as exc:
        raise CheckFailure(f"kernel.check() reported a fault for valid slot ids: {exc}") from None


def _accepted(case: Case, gen):
    import torch

    p = case.problem
    return torch.randint(1, p.tokens_per_step + 1, (case.batch,), generator=gen, dtype=torch.int32).to(p.device)


def _unchanged(kernel, state, before, named: dict) -> None:
    """Every slot of every layer as in ``before``, except the slots ``named[layer]``."""
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
            raise CheckFailure(f"slots {changed[:8]} of layer {layer} changed, but the step did not name them")


def check_step(kernel, case: Case, gen) -> None:
    """One step (one commit if speculative) against the oracle: outputs of every row, pad rows
    included, their dtype and the returned tensor; new states of the batch; every other slot
    bit-identical; no fault recorded. Without speculation only layer 1 is stepped and layer 0
    must not change; with it (or when the backend's layers share their commit) every layer is
    stepped, as commit covers the whole group."""
    import torch

    p = kernel.problem
    out_tol, state_tol = _budgets(kernel)
    state, before = prepared(kernel, gen)
    b, pad = case.batch, case.pad_rows
    slots = _slots(case, gen)
    real = slots[: b - pad].long()
    group = p.speculative or kernel.capabilities.layers_share_commit
    expected = {}
    for layer in range(state.num_layers) if group else [1]:
        inputs, call = step_call(case, slots, gen)
        start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
        start[: b - pad] = before[layer][real]
        states, outs = oracle.step_math64(p, start, inputs)
        result = kernel.step(state, layer=layer, **call)
        _returned(case, call, result)
        expect_close(f"outputs of layer {layer}", oracle.with_token_axis(p, result), outs, out_tol)
        if p.speculative and not torch.equal(kernel.read_state(state, real, layer), before[layer][real]):
            raise CheckFailure("a speculative step changed the logical state before commit")
        expected[layer] = states
    pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
    if p.speculative:
        accepted = _accepted(case, gen)
        kernel.commit(state, slots, accepted)
        pick = accepted[: b - pad].long() - 1
    rows = torch.arange(b - pad, device=p.device)
    for layer, states in expected.items():
        got = kernel.read_state(state, real, layer)
        started = before[layer][real]
        _states_close(kernel, f"new states of layer {layer}", got, states[rows, pick], state_tol, started)
    _unchanged(kernel, state, before, {layer: real for layer in expected})
    _no_fault(kernel)


def check_decode(kernel, case: Case, gen) -> None:
    """A long decode (``case.steps`` steps, commits of varying acceptance when speculative) of
    one layer, each step against the oracle started from the kernel's own state, so that cursor
    and ring wrap-arounds run; slots outside the batch stay bit-identical throughout."""
    import torch

    from .cases import weights

    p = kernel.problem
    if case.steps < 1:
        raise CheckSkipped("this profile runs no decode at real shapes")
    out_tol, state_tol = _budgets(kernel)
    state, before = prepared(kernel, gen, layers=1)
    slots = _slots(case, gen)
    b, pad = case.batch, case.pad_rows
    real = slots[: b - pad].long()
    w = weights(case, gen)
    rows = torch.arange(b - pad, device=p.device)
    for _ in range(case.steps):
        start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
        start[: b - pad] = kernel.read_state(state, real, 0)
        inputs, call = step_call(case, slots, gen, w)
        states, outs = oracle.step_math64(p, start, inputs)
        result = kernel.step(state, layer=0, **call)
        expect_close("outputs", oracle.with_token_axis(p, result), outs, out_tol)
        pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
        if p.speculative:
            accepted = _accepted(case, gen)
            kernel.commit(state, slots, accepted)
            pick = accepted[: b - pad].long() - 1
        got = kernel.read_state(state, real, 0)
        _states_close(kernel, "states", got, states[rows, pick], state_tol, start[: b - pad])
    _unchanged(kernel, state, before, {0: real})
    _no_fault(kernel)


def check_roundtrip(kernel, case: Case, gen) -> None:
    """write_state then read_state returns the values rounded to the cache dtype."""
    import torch

    p = kernel.problem
    state = kernel.allocate_state(num_layers=1)
    slots = pick_slots(p, min(len(real_slots(p)), 4), gen, index_dtype=_slots(case, gen).dtype)
    values = random_states(p, len(slots), gen)
    kernel.write_state(state, slots, values, 0)
    got = kernel.read_state(state, slots, 0)
    if p.quantized:  # the rule, with the reciprocal's freedom near ties that docs/spec.md allows
        off = quant.off_rule(got, values.to(got.device), p.state_dtype)
        if bool(off.any()):
            where = tuple(int(i) for i in torch.nonzero(off)[0])
            raise CheckFailure(
                f"read_state after write_state: value {where} reads {got[where].item():.6e}, which quantising "
                f"{values[where].item():.6e} to {p.state_dtype} with its row's scale (docs/spec.md, Quantised "
                "states) does not give"
            )
        return
    want = quant.stored(values, p.state_dtype)
    if not torch.equal(got, want):
        raise CheckFailure(f"read_state after write_state differs by {(got - want).abs().max().item():.3e}")


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

    from ..harness import seeded_states

    p = kernel.problem
    eager, graphed = seeded_states((kernel, kernel), p, gen, layers=2)
    kernel.warmup(graphed)
    slots = _slots(case, gen)
    calls = [step_call(attrs.evolve(case, out=True), slots, gen)[1] for _ in range(2)]
    eager_outs = [torch.empty_like(c["out"]) for c in calls]
    accepted = _accepted(case, gen)

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


def _outside_ids(problem, count: int) -> list[int]:
    """``count`` ids that are neither a slot of the cache nor the pad id: below 0 and past the end."""
    candidates = [-2, problem.num_slots, -7, problem.num_slots + 1000, -(2**31) + 5]
    return [i for i in candidates if i != problem.pad_slot_id][:count]


def check_guarded_ids(kernel, case: Case, gen) -> None:
    """Slot ids outside the cache are served as pad rows: no state read or written (every slot
    bit-identical but the real rows'), their outputs from a zero state, and ``kernel.check()``
    names the first of them; a speculative commit with counts outside 1..T leaves those slots as
    they were and is reported too."""
    import torch

    p = kernel.problem
    if not kernel.config.validate and not kernel.capabilities.guards_slots:
        raise CheckSkipped("validate = false and the backend does not declare guards_slots: ids are not guarded")
    out_tol, state_tol = _budgets(kernel)
    state, before = prepared(kernel, gen, layers=1)
    b = p.max_batch
    bad = _outside_ids(p, min(2, b))
    dtype = _slots(case, gen).dtype
    real = pick_slots(p, max(b - len(bad), 0), gen, index_dtype=dtype)
    slots = torch.cat([real, torch.tensor(bad, dtype=dtype, device=p.device)])
    inputs, call = step_call(attrs.evolve(case, batch=b, pad_rows=0), slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: len(real)] = before[0][real.long()]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=0, **call)
    expect_close(
        "outputs (rows with ids outside the cache from a zero state)", oracle.with_token_axis(p, out), outs, out_tol
    )
    first = len(real)
    try:
        kernel.check()
    except InputError as exc:
        if f"slots[{first}] = {bad[0]}" not in str(exc):
            raise CheckFailure(f"kernel.check() named the wrong row: {exc}") from None
    else:
        raise CheckFailure(f"slots[{first}] = {bad[0]} lies outside the cache, but kernel.check() raised nothing")
    _no_fault(kernel)  # cleared by the check that raised
    if p.speculative and len(real):
        accepted = torch.ones(b, dtype=torch.int32, device=p.device)
        accepted[0] = 0 if len(real) == 1 or case.seed % 2 else p.tokens_per_step + 1
        kernel.commit(state, slots, accepted)
        try:
            kernel.check()
        except InputError as exc:
            if "num_accepted[0]" not in str(exc) and "slots[" not in str(exc):
                raise CheckFailure(f"kernel.check() after the commit named the wrong row: {exc}") from None
        else:
            raise CheckFailure(
                f"num_accepted[0] = {int(accepted[0])} is outside 1..T, but kernel.check() raised nothing"
            )
        moved = real[1:].long()
        rows = torch.arange(1, len(real), device=p.device)
        _states_close(
            kernel, "states after the commit", logical_states(kernel, state, 0)[moved], states[rows, 0], state_tol
        )
        _unchanged(kernel, state, before, {0: moved})
    else:
        if not p.speculative:
            got = logical_states(kernel, state, 0)[real.long()]
            _states_close(kernel, "states of the real rows", got, states[: len(real), 0], state_tol)
        _unchanged(kernel, state, before, {0: real.long()} if not p.speculative else {})


def check_destinations(kernel, case: Case, gen) -> None:
    """One-token steps that read ``slots`` and write ``dst_slots``: outputs and written states
    against the oracle, a row whose destination is the pad id writing nothing, and every slot not
    written (the slots read included) bit-identical."""
    import torch

    p = kernel.problem
    b = min(case.batch, len(real_slots(p)) // 2)
    if b < 1:
        raise CheckSkipped("the cache is too small for distinct read and write slots")
    out_tol, state_tol = _budgets(kernel)
    state, before = prepared(kernel, gen, layers=1)
    pad = min(case.pad_rows, b - 1)
    dtype = _slots(case, gen).dtype
    slots, dst = batch_slots(p, b, pad, gen, dtype, True)
    inputs, call = step_call(attrs.evolve(case, batch=b, pad_rows=pad), slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: b - pad] = before[0][slots[: b - pad].long()]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=0, dst_slots=dst, **call)
    expect_close("outputs", oracle.with_token_axis(p, out), outs, out_tol)
    written = (dst != p.pad_slot_id) & (slots != p.pad_slot_id)
    targets = dst[written].long()
    got = logical_states(kernel, state, 0)[targets]
    _states_close(kernel, "states written to dst_slots", got, states[written, 0], state_tol)
    _unchanged(kernel, state, before, {0: targets})
    _no_fault(kernel)


def check_adopted(kernel, case: Case, gen) -> None:
    """An engine's cache (per layer a view into larger pages) adopted and stepped in place: the
    engine's tensors keep their storage and hold the oracle's states after the step (and commit),
    every other slot and the rest of the pages bit-identical; ``sync`` keeps them."""
    import torch

    p = kernel.problem
    out_tol, state_tol = _budgets(kernel)
    layers = 2
    caches, pages = engine_cache(p, layers, gen)
    scales, scale_pages = engine_scales(p, layers, gen)
    pages_before = [page.clone() for page in pages]
    scale_pages_before = [page.clone() for page in scale_pages]
    state = kernel.adopt_state(caches, scales=scales or None)
    pointers = [c.data_ptr() for c in caches]
    b, pad = case.batch, case.pad_rows
    slots = _slots(case, gen)
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
        accepted = _accepted(case, gen)
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
        _states_close(kernel, f"the engine's cache of layer {layer}", got, expected[layer][rows, pick], state_tol)
        for name, now, before in (("cache", pages, pages_before), ("scales", scale_pages, scale_pages_before)):
            if not now:
                continue
            if not torch.equal(now[layer][:, 1:], before[layer][:, 1:]):
                raise CheckFailure(f"data beside the slots in the engine's {name} pages of layer {layer} was written")
            if not torch.equal(now[layer][others, 0], before[layer][others, 0]):
                raise CheckFailure(f"slots of the engine's {name} of layer {layer} outside the batch changed")
    _no_fault(kernel)


def check_partial_commit(kernel, case: Case, gen) -> None:
    """With validation on, a commit that finds a layer of the group not stepped since the last
    commit is refused, naming it, and no committed state is lost."""
    import torch

    p = kernel.problem
    if not kernel.config.validate:
        raise CheckSkipped("validate = false: commits are not checked")
    state, before = prepared(kernel, gen)
    slots = _slots(attrs.evolve(case, pad_rows=0), gen)
    kernel.step(state, layer=1, **step_call(case, slots, gen)[1])
    accepted = torch.ones(case.batch, dtype=torch.int32, device=p.device)
    try:
        kernel.commit(state, slots, accepted)
    except InputError as exc:
        if "layer(s) [0]" not in str(exc):
            raise CheckFailure(f"the refusal does not name layer 0: {exc}") from None
    else:
        raise CheckFailure("a commit after stepping only layer 1 of 2 was accepted")
    _unchanged(kernel, state, before, {})


@attrs.frozen
class Check:
    """A conformance check: its function, what it checks, which problems it draws (``speculative``:
    only speculative ones, only one-token ones, or either), whether real model shapes run as
    explicit examples, and why it cannot apply to a backend at all (``applies``: None if it can)."""

    function: Callable
    what: str
    speculative: Optional[bool] = None
    real_shapes: bool = False
    applies: Callable = lambda capabilities, device: None


def _needs(capability: str, why: str) -> Callable:
    return lambda caps, device: None if getattr(caps, capability) else why


def _serves(form: str) -> Callable:
    why = f"the backend does not declare the engine call form {form!r} (Capabilities.engine_calls)"
    return lambda caps, device: None if form in caps.engine_calls else why


def _on_cuda(caps, device: str):
    return None if str(device).startswith("cuda") else f"needs a CUDA device; this run is on {device}"


#: check name -> :class:`Check`
CHECKS: dict[str, Check] = {
    "step": Check(check_step, "one step (and commit) vs the oracle, every input option", real_shapes=True),
    "decode": Check(check_decode, "a long decode with commits of varying acceptance", real_shapes=True),
    "roundtrip": Check(check_roundtrip, "write_state/read_state round trip"),
    "warmup": Check(check_warmup, "warmup leaves the state intact"),
    "bad-inputs": Check(check_bad_inputs, "bad inputs raise InputError, write nothing"),
    "cuda-graph": Check(check_cuda_graph, "CUDA-graph replay equals eager calls", applies=_on_cuda),
    "guarded-ids": Check(check_guarded_ids, "slot ids outside the cache served as pad rows and reported"),
    "destinations": Check(
        check_destinations,
        "steps that write dst_slots",
        speculative=False,
        real_shapes=True,
        applies=_needs("destination_slots", "the backend does not declare destination_slots"),
    ),
    "adopted": Check(
        check_adopted,
        "an engine's cache adopted and stepped in place",
        real_shapes=True,
        applies=_needs("adopt_state", "the backend does not declare adopt_state"),
    ),
    "partial-commit": Check(
        check_partial_commit,
        "a commit with a layer not stepped is refused",
        speculative=True,
        applies=_needs("speculative", "commits follow speculative steps; the backend declares none"),
    ),
    "packed-calls": Check(
        check_packed_calls,
        "vLLM's packed call: per-token slots, counts, offsets",
        speculative=False,
        applies=_serves("packed"),
    ),
    "verify-calls": Check(
        check_verify_calls,
        "SGLang's verify call: intermediate states, parents",
        speculative=False,
        applies=_serves("verify"),
    ),
}


def case_for(problem, **knobs) -> Case:
    """A case for ``problem`` as engines call it: the whole batch with a pad row, every optional
    input, rows strided as slices of a projection; ``knobs`` override any field of :class:`Case`."""
    from ..inputs import usable_slots

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
