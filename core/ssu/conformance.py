"""Conformance checks every backend must pass, run by ``ssu verify`` (and the test suite).

Each check opens the backend for a problem inside its declared capabilities, drives it with random
inputs (never zeros) and compares against the float64 oracle through the backend-neutral
``read_state`` / ``write_state`` (:mod:`ssu.harness`). Tolerances come from
:func:`ssu.oracle.tolerance`. A check that does not apply (a capability the backend does not
declare, a device it is not on) raises :class:`CheckSkipped` with the reason.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import attrs

from . import oracle
from .errors import InputError, SSUError
from .harness import (
    CheckFailure,
    batch_slots,
    engine_cache,
    expect_close,
    logical_states,
    open_backend,
    prepared,
    real_slots,
    seeded_states,
)
from .inputs import layer_weights, pick_slots, random_states, step_inputs
from .problem import Problem

__all__ = ["CHECKS", "CheckFailure", "CheckResult", "CheckSkipped", "problems_for", "run_conformance"]


class CheckSkipped(Exception):
    """A check that cannot run here (its device or a capability is missing); the message says why."""


@attrs.frozen
class CheckResult:
    """One check on one problem: ``status`` is ``pass``, ``fail`` or ``skip`` (with why in ``detail``)."""

    name: str
    problem: str
    status: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        """Whether the check ran and passed (a skipped check has not passed)."""
        return self.status == "pass"


def check_step(kernel, gen, *, with_options: bool = True) -> None:
    """One step (one commit if speculative) against the oracle: outputs of every row, pad rows
    included; new states of the batch; every other slot bit-identical. Without speculation only
    layer 1 is stepped and layer 0 must not change; with it (or when the backend's layers share
    their commit) every layer is stepped, as commit covers the whole group."""
    import torch

    p = kernel.problem
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, p.tokens_per_step)
    state, before = prepared(kernel, gen)
    b = min(p.max_batch, p.num_slots)
    pad = 1 if b >= 2 else 0
    slots = pick_slots(p, b, gen, pad_rows=pad)
    real = slots[: b - pad].long()
    group = p.speculative or kernel.capabilities.layers_share_commit
    stepped = list(range(state.num_layers)) if group else [1]
    expected = {}
    for layer in stepped:
        weights = layer_weights(p, gen, with_D=with_options, with_dt_bias=with_options)
        inputs = step_inputs(p, slots, gen, weights=weights, with_z=with_options, dt_softplus=with_options)
        start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
        start[: b - pad] = before[layer][real]
        states, outs = oracle.step_math64(p, start, inputs)
        out = torch.full_like(inputs.x, float("nan"))
        kernel.step(state, out=out, layer=layer, **inputs.kwargs())
        expect_close(f"outputs of layer {layer}", oracle.with_token_axis(p, out), outs, tol)
        if p.speculative and not torch.equal(kernel.read_state(state, real, layer), before[layer][real]):
            raise CheckFailure("a speculative step changed the logical state before commit")
        expected[layer] = states
    if p.speculative:
        accepted = torch.randint(1, p.tokens_per_step + 1, (b,), generator=gen, dtype=torch.int32).to(p.device)
        kernel.commit(state, slots, accepted)
        pick = accepted[: b - pad].long() - 1
    else:
        pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
    rows = torch.arange(b - pad, device=p.device)
    for layer, states in expected.items():
        expect_close(f"new states of layer {layer}", kernel.read_state(state, real, layer), states[rows, pick], tol)
    _unchanged(kernel, state, before, {layer: real for layer in expected})


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


def check_decode(kernel, gen, steps: int = 4) -> None:
    """Several steps (with commits) in a row, the oracle following from the kernel's own states."""
    import torch

    p = kernel.problem
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, p.tokens_per_step)
    state, before = prepared(kernel, gen, layers=1)
    b = min(p.max_batch, p.num_slots)
    slots = pick_slots(p, b, gen)
    weights = layer_weights(p, gen)
    for _ in range(steps):
        start = kernel.read_state(state, slots, 0)
        inputs = step_inputs(p, slots, gen, weights=weights)
        states, outs = oracle.step_math64(p, start, inputs)
        out = kernel.step(state, layer=0, **inputs.kwargs())
        expect_close("outputs", oracle.with_token_axis(p, out), outs, tol)
        pick = torch.zeros(b, dtype=torch.long, device=p.device)
        if p.speculative:
            accepted = torch.randint(1, p.tokens_per_step + 1, (b,), generator=gen, dtype=torch.int32).to(p.device)
            kernel.commit(state, slots, accepted)
            pick = accepted.long() - 1
        expect_close("states", kernel.read_state(state, slots, 0), states[torch.arange(b, device=p.device), pick], tol)


def check_roundtrip(kernel, gen) -> None:
    """write_state then read_state returns the values rounded to the cache dtype."""
    import torch

    from .dtypes import to_torch

    p = kernel.problem
    state = kernel.allocate_state(num_layers=1)
    slots = pick_slots(p, min(p.num_slots, 4), gen)
    values = random_states(p, len(slots), gen)
    kernel.write_state(state, slots, values, 0)
    got = kernel.read_state(state, slots, 0)
    want = values.to(to_torch(p.state_dtype)).float()
    if not torch.equal(got, want):
        raise CheckFailure(f"read_state after write_state differs by {(got - want).abs().max().item():.3e}")


def check_warmup(kernel, gen) -> None:
    """Warmup leaves every state value exactly as it was."""
    import torch

    state, before = prepared(kernel, gen)
    kernel.warmup(state)
    for layer, values in enumerate(before):
        if not torch.equal(logical_states(kernel, state, layer), values):
            raise CheckFailure(f"warmup changed the state of layer {layer}")


def check_bad_inputs(kernel, gen) -> None:
    """Wrong shapes, dtypes and layers raise ssu.InputError, and nothing is written."""
    import torch

    p = kernel.problem
    if not kernel.config.validate:
        raise CheckSkipped("validate = false: no input is checked")
    state, before = prepared(kernel, gen, layers=1)
    slots = pick_slots(p, min(p.max_batch, p.num_slots), gen)
    good = step_inputs(p, slots, gen).kwargs()
    wrong_dtype = torch.float64
    cases = {
        "x with a wrong dtype": dict(good, x=good["x"].to(wrong_dtype)),
        "x with a wrong head count": dict(good, x=good["x"][..., :-1, :] if p.nheads > 1 else good["x"][..., :0]),
        "B with a wrong group count": dict(good, B=torch.cat([good["B"], good["B"]], dim=-2)),
        "slots as float": dict(good, slots=slots.float()),
        "A in bf16": dict(good, A=good["A"].to(torch.bfloat16)),
    }
    for what, kwargs in cases.items():
        try:
            kernel.step(state, layer=0, **kwargs)
        except InputError:
            pass
        else:
            raise CheckFailure(f"{what}: no ssu.InputError")
    try:
        kernel.step(state, layer=1, **good)
    except InputError:
        pass
    else:
        raise CheckFailure("layer out of range: no ssu.InputError")
    if not torch.equal(logical_states(kernel, state, 0), before[0]):
        raise CheckFailure("a refused call wrote to the state")


def check_cuda_graph(kernel, gen) -> None:
    """On CUDA: a step of every layer (and the commit) captured in a CUDA graph and replayed gives
    bit-identical outputs and states to the same calls made eagerly. Skipped on other devices."""
    import torch

    p = kernel.problem
    if p.device_type != "cuda":
        raise CheckSkipped(f"needs a CUDA device; this problem is on {p.device}")
    eager, graphed = seeded_states((kernel, kernel), p, gen, layers=2)
    kernel.warmup(graphed)
    b = min(p.max_batch, p.num_slots)
    slots = pick_slots(p, b, gen, pad_rows=1 if b >= 2 else 0)
    inputs = [step_inputs(p, slots, gen).kwargs() for _ in range(2)]
    outs = [torch.empty_like(i["x"]) for i in inputs]
    eager_outs = [torch.empty_like(i["x"]) for i in inputs]
    accepted = torch.randint(1, p.tokens_per_step + 1, (b,), generator=gen, dtype=torch.int32).to(p.device)

    def decode(state, out_list):
        for layer in range(2):
            kernel.step(state, out=out_list[layer], layer=layer, **inputs[layer])
        if p.speculative:
            kernel.commit(state, slots, accepted)

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


def check_guarded_ids(kernel, gen) -> None:
    """Slot ids outside the cache are served as pad rows: no state read or written (every slot
    bit-identical but the real rows'), their outputs from a zero state, and ``kernel.check()``
    names the first of them; a speculative commit with counts outside 1..T leaves those slots as
    they were and is reported too."""
    import torch

    p = kernel.problem
    if not kernel.config.validate and not kernel.capabilities.guards_slots:
        raise CheckSkipped("validate = false and the backend does not declare guards_slots: ids are not guarded")
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, p.tokens_per_step)
    state, before = prepared(kernel, gen, layers=1)
    b = p.max_batch
    bad = _outside_ids(p, min(2, b))
    real = pick_slots(p, max(b - len(bad), 0), gen)
    slots = torch.cat([real, torch.tensor(bad, dtype=real.dtype, device=p.device)])
    inputs = step_inputs(p, slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: len(real)] = before[0][real.long()]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=0, **inputs.kwargs())
    expect_close(
        "outputs (rows with ids outside the cache from a zero state)", oracle.with_token_axis(p, out), outs, tol
    )
    first = len(real)
    try:
        kernel.check()
    except InputError as exc:
        if f"slots[{first}] = {bad[0]}" not in str(exc):
            raise CheckFailure(f"kernel.check() named the wrong row: {exc}") from None
    else:
        raise CheckFailure(f"slots[{first}] = {bad[0]} lies outside the cache, but kernel.check() raised nothing")
    kernel.check()  # cleared
    if p.speculative and len(real):
        accepted = torch.ones(b, dtype=torch.int32, device=p.device)
        accepted[0] = 0 if len(real) == 1 or gen.initial_seed() % 2 else p.tokens_per_step + 1
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
        expect_close("states after the commit", logical_states(kernel, state, 0)[moved], states[rows, 0], tol)
        _unchanged(kernel, state, before, {0: moved})
    else:
        if not p.speculative:
            expect_close(
                "states of the real rows", logical_states(kernel, state, 0)[real.long()], states[: len(real), 0], tol
            )
        _unchanged(kernel, state, before, {0: real.long()} if not p.speculative else {})


def check_destinations(kernel, gen) -> None:
    """One-token steps that read ``slots`` and write ``dst_slots``: outputs and written states
    against the oracle, a row whose destination is the pad id writing nothing, and every slot not
    written (the slots read included) bit-identical."""
    import torch

    p = kernel.problem
    if not kernel.capabilities.destination_slots:
        raise CheckSkipped("the backend does not declare destination_slots")
    if p.speculative:
        raise CheckSkipped("destination slots apply to one-token steps")
    b = min(p.max_batch, len(real_slots(p)) // 2)
    if b < 1:
        raise CheckSkipped("the cache is too small for distinct read and write slots")
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, 1)
    state, before = prepared(kernel, gen, layers=1)
    pad = 1 if b >= 2 else 0
    slots, dst = batch_slots(p, b, pad, gen, None, True)
    inputs = step_inputs(p, slots, gen)
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
    start[: b - pad] = before[0][slots[: b - pad].long()]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=0, dst_slots=dst, **inputs.kwargs())
    expect_close("outputs", oracle.with_token_axis(p, out), outs, tol)
    written = (dst != p.pad_slot_id) & (slots != p.pad_slot_id)
    targets = dst[written].long()
    expect_close("states written to dst_slots", logical_states(kernel, state, 0)[targets], states[written, 0], tol)
    _unchanged(kernel, state, before, {0: targets})


def check_adopted(kernel, gen) -> None:
    """An engine's cache (per layer a view into larger pages) adopted and stepped in place: the
    engine's tensors keep their storage and hold the oracle's states after the step (and commit),
    every other slot and the rest of the pages bit-identical; ``sync`` keeps them."""
    import torch

    p = kernel.problem
    if not kernel.capabilities.adopt_state:
        raise CheckSkipped("the backend does not declare adopt_state")
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, p.tokens_per_step)
    layers = 2
    caches, pages = engine_cache(p, layers, gen)
    pages_before = [page.clone() for page in pages]
    state = kernel.adopt_state(caches)
    pointers = [c.data_ptr() for c in caches]
    b = min(p.max_batch, len(real_slots(p)))
    pad = 1 if b >= 2 else 0
    slots = pick_slots(p, b, gen, pad_rows=pad)
    real = slots[: b - pad].long()
    expected = []
    for layer in range(layers):
        inputs = step_inputs(p, slots, gen)
        start = torch.zeros(b, p.nheads, p.headdim, p.dstate, device=p.device)
        start[: b - pad] = caches[layer][real].float()
        states, outs = oracle.step_math64(p, start, inputs)
        out = kernel.step(state, layer=layer, **inputs.kwargs())
        expect_close(f"outputs of layer {layer}", oracle.with_token_axis(p, out), outs, tol)
        expected.append(states)
    pick = torch.zeros(b - pad, dtype=torch.long, device=p.device)
    if p.speculative:
        for layer in range(layers):
            if not torch.equal(caches[layer], pages_before[layer][:, 0]):
                raise CheckFailure(f"a speculative step changed the engine's cache of layer {layer} before commit")
        accepted = torch.randint(1, p.tokens_per_step + 1, (b,), generator=gen, dtype=torch.int32).to(p.device)
        kernel.commit(state, slots, accepted)
        pick = accepted[: b - pad].long() - 1
    kernel.sync(state)
    rows = torch.arange(b - pad, device=p.device)
    others = torch.ones(p.num_slots, dtype=torch.bool, device=p.device)
    others[real] = False
    for layer in range(layers):
        if caches[layer].data_ptr() != pointers[layer] or state.cache[layer] is not caches[layer]:
            raise CheckFailure("the adopted state does not hold the engine's tensor any more")
        expect_close(
            f"the engine's cache of layer {layer}", caches[layer][real].float(), expected[layer][rows, pick], tol
        )
        if not torch.equal(pages[layer][:, 1:], pages_before[layer][:, 1:]):
            raise CheckFailure(f"data beside the cache slots in the engine's pages of layer {layer} was written")
        if not torch.equal(caches[layer][others], pages_before[layer][others, 0]):
            raise CheckFailure(f"slots of the engine's cache of layer {layer} outside the batch changed")


def check_partial_commit(kernel, gen) -> None:
    """With validation on, a commit that finds a layer of the group not stepped since the last
    commit is refused, naming it, and no committed state is lost."""
    import torch

    p = kernel.problem
    if not p.speculative:
        raise CheckSkipped("commits follow speculative steps")
    if not kernel.config.validate:
        raise CheckSkipped("validate = false: commits are not checked")
    state, before = prepared(kernel, gen)
    b = min(p.max_batch, len(real_slots(p)))
    slots = pick_slots(p, b, gen)
    kernel.step(state, layer=1, **step_inputs(p, slots, gen).kwargs())
    accepted = torch.ones(b, dtype=torch.int32, device=p.device)
    try:
        kernel.commit(state, slots, accepted)
    except InputError as exc:
        if "layer(s) [0]" not in str(exc):
            raise CheckFailure(f"the refusal does not name layer 0: {exc}") from None
    else:
        raise CheckFailure("a commit after stepping only layer 1 of 2 was accepted")
    _unchanged(kernel, state, before, {})


#: check name -> (function(kernel, generator), what it checks)
CHECKS: dict[str, tuple[Callable, str]] = {
    "step": (check_step, "step vs oracle (D, z, dt_bias, softplus, pad row)"),
    "step-without-options": (
        lambda k, g: check_step(k, g, with_options=False),
        "step vs oracle (no D, z, dt_bias, softplus)",
    ),
    "decode": (check_decode, "decode of several steps"),
    "roundtrip": (check_roundtrip, "write_state/read_state round trip"),
    "warmup": (check_warmup, "warmup leaves the state intact"),
    "bad-inputs": (check_bad_inputs, "bad inputs raise InputError, write nothing"),
    "cuda-graph": (check_cuda_graph, "CUDA-graph replay equals eager calls"),
    "guarded-ids": (check_guarded_ids, "slot ids outside the cache served as pad rows and reported"),
    "destinations": (check_destinations, "steps that write dst_slots"),
    "adopted": (check_adopted, "an engine's cache adopted and stepped in place"),
    "partial-commit": (check_partial_commit, "a commit with a layer not stepped is refused"),
}


def problems_for(capabilities, device: str) -> Iterator[Problem]:
    """Small problems covering the dtypes and modes the backend declares."""

    def pick(options, values):
        return [v for v in values if options is None or v in options] or sorted(options)[:1]

    H = pick(capabilities.nheads, [8, 6, 4])[0]
    G = pick(capabilities.ngroups, [2, 1])[0]
    if H % G:
        G = 1
    P = pick(capabilities.headdims, [16, 80, 64])[0]
    N = pick(capabilities.dstates, [16, 96, 128])[0]
    inp = pick(capabilities.input_dtypes, ["bf16", "fp16", "fp32"])[0]
    for state_dtype in [d for d in ("fp32", "bf16", "fp16") if d in capabilities.state_dtypes]:
        yield Problem(
            nheads=H,
            headdim=P,
            dstate=N,
            ngroups=G,
            state_dtype=state_dtype,
            input_dtype=inp,
            num_slots=12,
            max_batch=5,
            device=device,
        )
    if capabilities.speculative and capabilities.max_tokens_per_step > 1:
        T = min(3, capabilities.max_tokens_per_step)
        yield Problem(
            nheads=H,
            headdim=P,
            dstate=N,
            ngroups=G,
            state_dtype=sorted(capabilities.state_dtypes)[0],
            input_dtype=inp,
            num_slots=12,
            max_batch=5,
            tokens_per_step=T,
            speculative=True,
            device=device,
        )


def run_conformance(
    backend: str, *, device: str = "cpu", registry=None, seed: int = 0, options: Optional[dict] = None
) -> list[CheckResult]:
    """Run every check on every problem of :func:`problems_for`; never raises for a failed check."""
    import torch

    from .registry import default_registry

    registry = default_registry() if registry is None else registry
    capabilities = registry.load(backend).spec.capabilities
    results = []
    for problem in problems_for(capabilities, device):
        try:
            kernel = open_backend(backend, problem, registry, options)
        except SSUError as exc:
            results.append(CheckResult("open", problem.describe(), "fail", str(exc)))
            continue
        for check, what in CHECKS.values():
            gen = torch.Generator().manual_seed(seed)
            try:
                check(kernel, gen)
            except CheckSkipped as exc:
                results.append(CheckResult(what, problem.describe(), "skip", str(exc)))
            except Exception as exc:  # a crashing backend is a failed check, not a crashed verify
                results.append(CheckResult(what, problem.describe(), "fail", f"{type(exc).__name__}: {exc}"))
            else:
                results.append(CheckResult(what, problem.describe(), "pass"))
    return results
