"""Driving a backend beside the reference and the float64 oracle: the helpers the conformance
checks (:mod:`ssu.conformance`) and the backends' own tests share.

Every comparison goes through the backend-neutral ``read_state`` / ``write_state``, so a backend with
an unusual layout is held to the same math; budgets come from :func:`ssu.checking.oracle.tolerances`.
"""

from __future__ import annotations

import attrs

from typing import Optional

from . import oracle
from ..plugins.config import Config
from .inputs import layer_weights, pick_slots, random_states, step_inputs
from ..contract.problem import Problem


class CheckFailure(AssertionError):
    """A conformance check found a wrong result; ``rule`` names the rule of docs/spec.md it breaks
    (an id of :mod:`ssu.conformance.rules`, a single rule or a group; empty: the check's own)."""

    def __init__(self, message: str, rule: str = "") -> None:
        super().__init__(message)
        self.rule = rule


def open_backend(backend: str, problem: Problem, registry=None, options: Optional[dict] = None):
    """Open ``backend`` (with its option table ``options``) for ``problem``."""
    from ..runtime.kernel import open_kernel

    config = Config(backend=backend, backends={backend: options} if options else {})
    return open_kernel(config, problem, registry=registry)


def open_pair(backend: str, problem, options=None, registry=None):
    """The backend's kernel and a reference kernel for the same problem."""
    return open_backend(backend, problem, registry, options), open_backend("reference", problem, registry)


def expect_close(what: str, actual, expected, tol: float, rule: str = "") -> None:
    """Raise CheckFailure, naming ``what`` (and ``rule``), when ``actual`` is further than ``tol``
    (relative) from ``expected``."""
    err = oracle.rel_error(actual, expected)
    if not err <= tol:
        raise CheckFailure(f"{what}: relative error {err:.3e} above tolerance {tol:.1e}", rule)


def expect_rounded(what: str, actual, expected, state_dtype: str, start=None, rule: str = "quantised") -> None:
    """Raise CheckFailure, naming ``what``, when a value of an 8-bit cache's state ``actual`` is
    further from ``expected`` than its rounding allows (:func:`ssu.checking.oracle.rounding_bound`; ``start``:
    the state a speculative step started from)."""
    import torch

    excess = oracle.rounding_excess(actual, expected, state_dtype, start)
    worst = excess.max().item() if excess.numel() else 0.0
    if not worst <= 1.0:
        where = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        off = actual[where].double().item() - expected[where].double().item()
        raise CheckFailure(
            f"{what}: value {where} is {off:.3e} from the exact state, {worst:.2f} times what "
            f"rounding to {state_dtype} with its row's own scale allows (docs/spec.md, Quantised states)",
            rule,
        )


def expect_out(what: str, given, x, result) -> None:
    """A given ``out`` is the tensor ``what`` returns; without one (``given`` None) it returns a new
    tensor of x's dtype and shape (docs/spec.md, "Shapes and names")."""
    if given is not None:
        if result is not given:
            raise CheckFailure(f"{what} did not return the `out` tensor it was given", "step/out-returned")
    elif getattr(result, "dtype", None) != x.dtype or tuple(getattr(result, "shape", ())) != tuple(x.shape):
        got = (getattr(result, "dtype", type(result).__name__), tuple(getattr(result, "shape", ())))
        raise CheckFailure(
            f"with out=None {what} returned {got}; expected x's dtype and shape {(x.dtype, tuple(x.shape))}",
            "step/out-none",
        )


def real_slots(problem):
    """The slots that hold sequences' states: every slot but a pad slot inside the cache (int64)."""
    import torch

    every = torch.arange(problem.num_slots, device=problem.device)
    return every[every != problem.pad_slot_id] if problem.pad_in_cache else every


def seeded_states(kernels, problem, gen, layers=1, *, states=None):
    """A state per kernel (allocated, unless ``states`` gives them), every real slot of every layer
    set to the same random values."""
    states = [k.allocate_state(num_layers=layers) for k in kernels] if states is None else list(states)
    real = real_slots(problem)
    for layer in range(layers):
        values = random_states(problem, len(real), gen)
        for k, s in zip(kernels, states):
            k.write_state(s, real, values, layer)
    return states


def logical_states(kernel, state, layer: int):
    """Every slot's logical state in ``layer``, (num_slots, H, P, N) fp32 (zeros for a pad slot)."""
    import torch

    p = kernel.problem
    real = real_slots(p)
    values = torch.zeros(p.num_slots, p.nheads, p.headdim, p.dstate, device=p.device)
    values[real] = kernel.read_state(state, real, layer)
    return values


def prepared(kernel, gen, layers: int = 2):
    """A state with every real slot of every layer set to a random value; returns (state, values)."""
    p = kernel.problem
    (state,) = seeded_states((kernel,), p, gen, layers)
    return state, [logical_states(kernel, state, layer).clone() for layer in range(layers)]


def slot_rows(buffers: dict, num_slots: int) -> dict:
    """Each state buffer indexed by slot first: axis 1 of a per-layer buffer (dim >= 2), axis 0 of
    a 1-D one, its first ``num_slots`` rows (rows after them are backend-private, e.g. pad sinks)."""
    rows = {}
    for name, buf in buffers.items():
        if buf.dim() >= 2 and buf.shape[1] >= num_slots:
            rows[name] = buf[:, :num_slots].transpose(0, 1)
        elif buf.dim() == 1 and buf.shape[0] >= num_slots:
            rows[name] = buf[:num_slots]
    return rows


def engine_cache(problem, layers: int, gen, slot_stride: int = 2):
    """An engine's cache as a serving engine holds it: per layer a (num_slots, H, P, N) view into
    pages of ``slot_stride`` slot blocks (the rest of each page the engine's own data), random
    (for a quantised state, random 8-bit rows: :func:`engine_scales` gives their scales), drawn
    on ``gen``'s device (a benchmark's cache of gigabytes draws on its GPU, not the host).
    Returns (the per-layer views, the pages)."""
    import torch

    from ..contract.dtypes import to_torch
    from ..state.quant import quantize

    p = problem
    pages = []
    for _ in range(layers):
        values = torch.randn(p.num_slots, slot_stride, p.nheads, p.headdim, p.dstate, generator=gen, device=gen.device)
        values = quantize(values, p.state_dtype)[0] if p.quantized else values.to(to_torch(p.state_dtype))
        pages.append(values.to(p.device))
    return [page[:, 0] for page in pages], pages


def engine_scales(problem, layers: int, gen, slot_stride: int = 2):
    """The fp32 row scales an engine keeps beside a quantised cache (:func:`engine_cache`), laid
    out the same way: per layer a (num_slots, H, P) view into pages, random and positive, drawn on
    ``gen``'s device. Returns (the per-layer views, the pages), both empty for a floating-point
    state."""
    import torch

    p = problem
    if not p.quantized:
        return [], []
    pages = [
        (torch.rand(p.num_slots, slot_stride, p.nheads, p.headdim, generator=gen, device=gen.device) * 0.02 + 0.005).to(
            p.device
        )
        for _ in range(layers)
    ]
    return [page[:, 0] for page in pages], pages


def cache_rows(problem, cache, scales, rows):
    """The fp32 states of ``rows`` of one layer of an engine's cache (dequantised with that
    layer's ``scales`` for a quantised state)."""
    from ..state.quant import dequantize

    if problem.quantized:
        return dequantize(cache[rows], scales[rows])
    return cache[rows].float()


def batch_slots(problem, b: int, pad: int, gen, index_dtype, destinations: bool):
    """(slots, dst_slots or None) for one step: with destinations, rows write to slots no row
    reads (two rows sharing a slot would race), one of them, when there are three or more, to the
    pad id."""
    import torch

    if not destinations:
        return pick_slots(problem, b, gen, pad_rows=pad, index_dtype=index_dtype), None
    both = pick_slots(problem, 2 * (b - pad), gen, index_dtype=index_dtype)
    pads = torch.full((pad,), problem.pad_slot_id, dtype=both.dtype, device=both.device)
    slots = torch.cat([both[: b - pad], pads])
    dst = torch.cat([both[b - pad :], pads.flip(0)])
    if b - pad >= 3:
        dst[1] = problem.pad_slot_id
    return slots, dst


def compare_with_reference(
    backend: str,
    problem,
    gen,
    *,
    steps=1,
    batch=None,
    pad=0,
    index_dtype=None,
    options=True,
    tokens=None,
    layers=1,
    backend_options=None,
    registry=None,
    adopt: bool = False,
    destinations: bool = False,
):
    """Drive ``backend`` and the reference through ``steps`` steps (and commits) with the same
    inputs, each step starting from the backend's own states; raise :class:`CheckFailure` unless
    outputs and states agree within :func:`ssu.checking.oracle.tolerances` and every buffer row of the
    slots outside the batch is bit-identical afterwards. Returns the backend's kernel and state.

    ``adopt``: the backend steps an engine's cache (:func:`engine_cache`) in place, checked to keep
    its storage and to hold the states after every step and commit, and the rest of the engine's
    pages untouched. ``destinations``: one-token steps read one set of slots and write another
    (:func:`batch_slots`); the sequences move to the written slots."""
    import torch

    index_dtype = torch.int32 if index_dtype is None else index_dtype
    # the reference keeps fp32 states, so that each step starts from exactly the backend's logical
    # state (a checkpoint-and-ring backend's is finer than its cache dtype between flushes)
    tk = open_backend(backend, problem, registry, backend_options)
    rk = open_backend("reference", attrs.evolve(problem, state_dtype="fp32"), registry)
    if adopt:
        caches, pages = engine_cache(problem, layers, gen)
        scales, scale_pages = engine_scales(problem, layers, gen)
        pointers = [c.data_ptr() for c in caches]
        adopted = tk.adopt_state(caches, scales=scales or None)
        ts, rs = seeded_states((tk, rk), problem, gen, layers, states=(adopted, rk.allocate_state(layers)))
        pages_after_seed = [page[:, 1:].clone() for page in pages + scale_pages]
    else:
        ts, rs = seeded_states((tk, rk), problem, gen, layers)
        scales = []
    b = batch or problem.max_batch
    named = torch.zeros(problem.num_slots, dtype=torch.bool, device=problem.device)
    if destinations:
        batches = [batch_slots(problem, b, pad, gen, index_dtype, True) for _ in range(steps)]
    else:
        batches = [batch_slots(problem, b, pad, gen, index_dtype, False)] * steps
    for slots, dst in batches:
        for ids in (slots, dst):
            if ids is not None:
                named[ids[(ids >= 0) & (ids < problem.num_slots)].long()] = True
    untouched = ~named
    if problem.pad_in_cache:
        untouched[problem.pad_slot_id] = False  # a reserved null block: a backend may use it as a sink
    raw_before = {name: rows[untouched].clone() for name, rows in slot_rows(ts.buffers, problem.num_slots).items()}
    cache_before = [c[untouched].clone() for c in (*ts.cache, *scales)]
    T = tokens or problem.tokens_per_step
    out_tol, state_tol = oracle.tolerances(problem, T, tk.capabilities.state_precision)
    weights = [layer_weights(problem, gen, with_D=options, with_dt_bias=options) for _ in range(layers)]
    for slots, dst in batches:
        real = slots[(slots >= 0) & (slots < problem.num_slots) & (slots != problem.pad_slot_id)].long()
        for layer in range(layers):
            # both start every step from the backend's own (rounded) states, so that legitimate
            # rounding differences of earlier steps do not accumulate into the comparison
            rk.write_state(rs, real, tk.read_state(ts, real, layer), layer)
            inputs = step_inputs(
                problem, slots, gen, tokens=T, weights=weights[layer], with_z=options, dt_softplus=options
            )
            out_t = torch.full_like(inputs.x, float("nan"))
            tk.step(ts, out=out_t, layer=layer, dst_slots=dst, **inputs.kwargs())
            out_r = rk.step(rs, layer=layer, dst_slots=dst, **inputs.kwargs())
            expect_close(f"outputs of layer {layer}", out_t, out_r, out_tol)
        if problem.speculative:
            accepted = torch.randint(1, T + 1, (b,), generator=gen, dtype=torch.int32).to(problem.device)
            tk.commit(ts, slots, accepted)
            rk.commit(rs, slots, accepted)
        written = (
            real
            if dst is None
            else dst[
                (dst >= 0) & (dst < problem.num_slots) & (dst != problem.pad_slot_id) & (slots != problem.pad_slot_id)
            ].long()
        )
        for layer in range(layers):
            want = rk.read_state(rs, written, layer)
            expect_close(f"states of layer {layer}", tk.read_state(ts, written, layer), want, state_tol)
            if adopt and not tk.needs_sync:
                got = cache_rows(problem, ts.cache[layer], scales and scales[layer], written)
                expect_close(f"the engine's cache of layer {layer}", got, want, state_tol)
    if adopt and tk.needs_sync and batches:  # the engine's tensors hold the states once synced
        tk.sync(ts)
        for layer in range(layers):
            want = rk.read_state(rs, written, layer)
            got = cache_rows(problem, ts.cache[layer], scales and scales[layer], written)
            expect_close(f"the engine's cache of layer {layer} after sync", got, want, state_tol)
    tk.check()
    rows_after = slot_rows(ts.buffers, problem.num_slots)
    for name, before in raw_before.items():
        if not torch.equal(rows_after[name][untouched], before):
            raise CheckFailure(f"buffer {name!r}: a slot outside the batch was touched")
    for i, (cache, before) in enumerate(zip((*ts.cache, *scales), cache_before)):
        what = "cache" if i < len(ts.cache) else "scales"
        if not torch.equal(cache[untouched], before):
            raise CheckFailure(
                f"the engine's {what} of layer {i % max(len(ts.cache), 1)}: a slot outside the batch was touched"
            )
    if adopt:
        if [c.data_ptr() for c in ts.cache] != pointers or any(a is not b for a, b in zip(ts.cache, caches)):
            raise CheckFailure("the adopted state does not hold the engine's tensors any more")
        for i, (page, before) in enumerate(zip(pages + scale_pages, pages_after_seed)):
            if not torch.equal(page[:, 1:], before):
                what = "page" if i < len(pages) else "scale page"
                raise CheckFailure(
                    f"the engine's {what} of layer {i % len(pages)}: data beside its cache slots was written"
                )
    return tk, ts


def stochastic_rounding_bias(
    backend: str, gen, *, rows: int = 512, backend_options: Optional[dict] = None, **shape
) -> tuple[float, float, float]:
    """Bias of a backend's stochastically rounded fp16 state cache: ``rows`` sequences with the
    same state and inputs take one step; returns (mean |bias| of the backend's rounding, the same
    for round-to-nearest (the reference), mean |error| per sequence). Unbiased rounding has a
    bias well below round-to-nearest's while its per-sequence error stays non-zero. D and dt_bias
    are given in dt's dtype so that every kernel sees the same numbers."""
    import torch

    from ..runtime.kernel import open_kernel

    fields = dict(num_slots=rows, max_batch=rows, **shape)
    fp16 = Problem(state_dtype="fp16", **fields)
    kernels = {
        "sr": open_kernel(
            Config(backend=backend, backends={backend: dict(backend_options or {}, stochastic_rounding=True)}), fp16
        ),
        "rtn": open_kernel(Config(backend="reference"), fp16),
        "exact": open_kernel(Config(backend="reference"), Problem(state_dtype="fp32", **fields)),
    }
    start = random_states(fp16, 1, gen).half().float().expand(rows, -1, -1, -1).contiguous()
    slots = torch.arange(rows, dtype=torch.int32, device=fp16.device)
    one = step_inputs(fp16, slots[:1], gen).kwargs()
    inputs = {
        k: (v.expand(rows, *v.shape[1:]).contiguous() if k in ("x", "dt", "B", "C", "z") else v) for k, v in one.items()
    }
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
