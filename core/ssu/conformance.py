"""Conformance checks every backend must pass, run by ``ssu verify`` (and the test suite).

Each check opens the backend for a small problem inside its declared capabilities, drives it with
random inputs (never zeros) and compares against the float64 oracle through the backend-neutral
``read_state`` / ``write_state``. Tolerances come from :func:`ssu.oracle.tolerance`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import attrs

from . import oracle
from .config import Config
from .errors import InputError, SSUError
from .inputs import layer_weights, pick_slots, random_states, step_inputs
from .problem import Problem


class CheckFailure(AssertionError):
    """A conformance check found a wrong result."""


@attrs.frozen
class CheckResult:
    name: str
    problem: str
    passed: bool
    detail: str = ""


def open_backend(backend: str, problem: Problem, registry=None, options: Optional[dict] = None):
    """Open ``backend`` (with its option table ``options``) for ``problem``."""
    from .kernel import open_kernel

    config = Config(backend=backend, backends={backend: options} if options else {})
    return open_kernel(config, problem, registry=registry)


def _expect_close(what: str, actual, expected, tol: float) -> None:
    err = oracle.rel_error(actual, expected)
    if not err <= tol:
        raise CheckFailure(f"{what}: relative error {err:.3e} above tolerance {tol:.1e}")


def _prepared(kernel, gen, layers: int = 2):
    """A state with every slot of every layer set to a random value; returns (state, values)."""
    import torch

    p = kernel.problem
    (state,) = seeded_states((kernel,), p, gen, layers)
    every = torch.arange(p.num_slots, device=p.device)
    return state, [kernel.read_state(state, every, layer).clone() for layer in range(layers)]


def check_step(kernel, gen, *, with_options: bool = True) -> None:
    """One step (one commit if speculative) against the oracle: outputs of every row, pad rows
    included; new states of the batch; every other slot bit-identical. Without speculation only
    layer 1 is stepped and layer 0 must not change; with it (or when the backend's layers share
    their commit) every layer is stepped, as commit covers the whole group."""
    import torch

    p = kernel.problem
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, p.tokens_per_step)
    state, before = _prepared(kernel, gen)
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
        _expect_close(f"outputs of layer {layer}", oracle.with_token_axis(p, out), outs, tol)
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
        _expect_close(f"new states of layer {layer}", kernel.read_state(state, real, layer), states[rows, pick], tol)
    every = torch.arange(p.num_slots, device=p.device)
    others = torch.ones(p.num_slots, dtype=torch.bool, device=p.device)
    others[real] = False
    for layer in range(state.num_layers):
        now = kernel.read_state(state, every, layer)
        mask = others if layer in expected else torch.ones_like(others)
        if not torch.equal(now[mask], before[layer][mask]):
            changed = every[mask][(now[mask] != before[layer][mask]).flatten(1).any(1)].tolist()
            raise CheckFailure(f"slots {changed[:8]} of layer {layer} changed, but the step did not name them")


def check_decode(kernel, gen, steps: int = 4) -> None:
    """Several steps (with commits) in a row, the oracle following from the kernel's own states."""
    import torch

    p = kernel.problem
    tol = oracle.tolerance(p.state_dtype, p.input_dtype, p.tokens_per_step)
    state, before = _prepared(kernel, gen, layers=1)
    b = min(p.max_batch, p.num_slots)
    slots = pick_slots(p, b, gen)
    weights = layer_weights(p, gen)
    for _ in range(steps):
        start = kernel.read_state(state, slots, 0)
        inputs = step_inputs(p, slots, gen, weights=weights)
        states, outs = oracle.step_math64(p, start, inputs)
        out = kernel.step(state, layer=0, **inputs.kwargs())
        _expect_close("outputs", oracle.with_token_axis(p, out), outs, tol)
        pick = torch.zeros(b, dtype=torch.long, device=p.device)
        if p.speculative:
            accepted = torch.randint(1, p.tokens_per_step + 1, (b,), generator=gen, dtype=torch.int32).to(p.device)
            kernel.commit(state, slots, accepted)
            pick = accepted.long() - 1
        _expect_close("states", kernel.read_state(state, slots, 0), states[torch.arange(b, device=p.device), pick], tol)


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

    state, before = _prepared(kernel, gen)
    kernel.warmup(state)
    every = torch.arange(kernel.problem.num_slots, device=kernel.problem.device)
    for layer, values in enumerate(before):
        if not torch.equal(kernel.read_state(state, every, layer), values):
            raise CheckFailure(f"warmup changed the state of layer {layer}")


def check_bad_inputs(kernel, gen) -> None:
    """Wrong shapes, dtypes and layers raise ssu.InputError, and nothing is written."""
    import torch

    p = kernel.problem
    if not kernel.config.validate:
        return
    state, before = _prepared(kernel, gen, layers=1)
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
    every = torch.arange(p.num_slots, device=p.device)
    if not torch.equal(kernel.read_state(state, every, 0), before[0]):
        raise CheckFailure("a refused call wrote to the state")


def open_pair(backend: str, problem, options=None, registry=None):
    """The backend's kernel and a reference kernel for the same problem."""
    return open_backend(backend, problem, registry, options), open_backend("reference", problem, registry)


def seeded_states(kernels, problem, gen, layers=1):
    """Allocate a state per kernel, all slots of every layer set to the same random values."""
    import torch

    states = [k.allocate_state(num_layers=layers) for k in kernels]
    every = torch.arange(problem.num_slots, device=problem.device)
    for layer in range(layers):
        values = random_states(problem, problem.num_slots, gen)
        for k, s in zip(kernels, states):
            k.write_state(s, every, values, layer)
    return states


def _slot_rows(buffers: dict, num_slots: int) -> dict:
    """Each state buffer indexed by slot first: axis 1 of a per-layer buffer (dim >= 2), axis 0 of
    a 1-D one, its first ``num_slots`` rows (rows after them are backend-private, e.g. pad sinks)."""
    rows = {}
    for name, buf in buffers.items():
        if buf.dim() >= 2 and buf.shape[1] >= num_slots:
            rows[name] = buf[:, :num_slots].transpose(0, 1)
        elif buf.dim() == 1 and buf.shape[0] >= num_slots:
            rows[name] = buf[:num_slots]
    return rows


def compare_with_reference(backend: str, problem, gen, *, steps=1, batch=None, pad=0, index_dtype=None,
                           options=True, tokens=None, layers=1, backend_options=None, registry=None):
    """Drive ``backend`` and the reference through ``steps`` steps (and commits) with the same
    inputs, each step starting from the backend's own states; raise :class:`CheckFailure` unless
    outputs and states agree within :func:`ssu.oracle.tolerance` and every buffer row of the
    slots outside the batch is bit-identical afterwards. Returns the backend's kernel and state."""
    import torch

    index_dtype = torch.int32 if index_dtype is None else index_dtype
    tk, rk = open_pair(backend, problem, backend_options, registry)
    ts, rs = seeded_states((tk, rk), problem, gen, layers)
    b = batch or problem.max_batch
    slots = pick_slots(problem, b, gen, pad_rows=pad, index_dtype=index_dtype)
    real = slots[: b - pad].long()
    untouched = torch.ones(problem.num_slots, dtype=torch.bool, device=problem.device)
    untouched[real] = False
    raw_before = {name: rows[untouched].clone() for name, rows in _slot_rows(ts.buffers, problem.num_slots).items()}
    T = tokens or problem.tokens_per_step
    tol = oracle.tolerance(problem.state_dtype, problem.input_dtype, T)
    weights = [layer_weights(problem, gen, with_D=options, with_dt_bias=options) for _ in range(layers)]
    for _ in range(steps):
        for layer in range(layers):
            # both start every step from the backend's own (rounded) states, so that legitimate
            # rounding differences of earlier steps do not accumulate into the comparison
            rk.write_state(rs, real, tk.read_state(ts, real, layer), layer)
            inputs = step_inputs(problem, slots, gen, tokens=T, weights=weights[layer], with_z=options,
                                 dt_softplus=options)
            out_t = torch.full_like(inputs.x, float("nan"))
            tk.step(ts, out=out_t, layer=layer, **inputs.kwargs())
            out_r = rk.step(rs, layer=layer, **inputs.kwargs())
            _expect_close(f"outputs of layer {layer}", out_t, out_r, tol)
        if problem.speculative:
            accepted = torch.randint(1, T + 1, (b,), generator=gen, dtype=torch.int32).to(problem.device)
            tk.commit(ts, slots, accepted)
            rk.commit(rs, slots, accepted)
        for layer in range(layers):
            _expect_close(f"states of layer {layer}", tk.read_state(ts, real, layer), rk.read_state(rs, real, layer), tol)
    rows_after = _slot_rows(ts.buffers, problem.num_slots)
    for name, before in raw_before.items():
        if not torch.equal(rows_after[name][untouched], before):
            raise CheckFailure(f"buffer {name!r}: a slot outside the batch was touched")
    return tk, ts


def check_cuda_graph(kernel, gen) -> None:
    """On CUDA: a step of every layer (and the commit) captured in a CUDA graph and replayed gives
    bit-identical outputs and states to the same calls made eagerly. Skipped on other devices."""
    import torch

    p = kernel.problem
    if p.device_type != "cuda":
        return
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


def stochastic_rounding_bias(backend: str, gen, *, rows: int = 512, backend_options: Optional[dict] = None,
                             **shape) -> tuple[float, float, float]:
    """Bias of a backend's stochastically rounded fp16 state cache: ``rows`` sequences with the
    same state and inputs take one step; returns (mean |bias| of the backend's rounding, the same
    for round-to-nearest (the reference), mean |error| per sequence). Unbiased rounding has a
    bias well below round-to-nearest's while its per-sequence error stays non-zero. D and dt_bias
    are given in dt's dtype so that every kernel sees the same numbers."""
    import torch

    from .kernel import open_kernel

    fields = dict(num_slots=rows, max_batch=rows, **shape)
    fp16 = Problem(state_dtype="fp16", **fields)
    kernels = {"sr": open_kernel(Config(backend=backend, backends={backend: dict(backend_options or {},
                                                                                   stochastic_rounding=True)}), fp16),
               "rtn": open_kernel(Config(backend="reference"), fp16),
               "exact": open_kernel(Config(backend="reference"), Problem(state_dtype="fp32", **fields))}
    start = random_states(fp16, 1, gen).half().float().expand(rows, -1, -1, -1).contiguous()
    slots = torch.arange(rows, dtype=torch.int32, device=fp16.device)
    one = step_inputs(fp16, slots[:1], gen).kwargs()
    inputs = {k: (v.expand(rows, *v.shape[1:]).contiguous() if k in ("x", "dt", "B", "C", "z") else v)
              for k, v in one.items()}
    inputs.update(slots=slots, D=one["D"].to(one["dt"].dtype), dt_bias=one["dt_bias"].to(one["dt"].dtype))
    results = {}
    for name, kernel in kernels.items():
        state = kernel.allocate_state()
        kernel.write_state(state, slots.long(), start)
        kernel.step(state, **inputs)
        results[name] = kernel.read_state(state, slots.long())
    bias = (results["sr"] - results["exact"]).mean(0).abs().mean().item()
    bias_nearest = (results["rtn"] - results["exact"]).mean(0).abs().mean().item()
    spread = (results["sr"] - results["exact"]).abs().mean().item()
    return bias, bias_nearest, spread


#: check name -> (function(kernel, generator), what it checks)
CHECKS: dict[str, tuple[Callable, str]] = {
    "step": (check_step, "step vs oracle (D, z, dt_bias, softplus, pad row)"),
    "step-without-options": (lambda k, g: check_step(k, g, with_options=False),
                             "step vs oracle (no D, z, dt_bias, softplus)"),
    "decode": (check_decode, "decode of several steps"),
    "roundtrip": (check_roundtrip, "write_state/read_state round trip"),
    "warmup": (check_warmup, "warmup leaves the state intact"),
    "bad-inputs": (check_bad_inputs, "bad inputs raise InputError, write nothing"),
    "cuda-graph": (check_cuda_graph, "CUDA-graph replay equals eager calls (CUDA only)"),
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
        yield Problem(nheads=H, headdim=P, dstate=N, ngroups=G, state_dtype=state_dtype, input_dtype=inp,
                      num_slots=12, max_batch=5, device=device)
    if capabilities.speculative and capabilities.max_tokens_per_step > 1:
        T = min(3, capabilities.max_tokens_per_step)
        yield Problem(nheads=H, headdim=P, dstate=N, ngroups=G, state_dtype=sorted(capabilities.state_dtypes)[0],
                      input_dtype=inp, num_slots=12, max_batch=5, tokens_per_step=T, speculative=True, device=device)


def run_conformance(backend: str, *, device: str = "cpu", registry=None, seed: int = 0,
                    options: Optional[dict] = None) -> list[CheckResult]:
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
            results.append(CheckResult("open", problem.describe(), False, str(exc)))
            continue
        for check, what in CHECKS.values():
            gen = torch.Generator().manual_seed(seed)
            try:
                check(kernel, gen)
            except Exception as exc:  # a crashing backend is a failed check, not a crashed verify
                results.append(CheckResult(what, problem.describe(), False, f"{type(exc).__name__}: {exc}"))
            else:
                results.append(CheckResult(what, problem.describe(), True))
    return results
