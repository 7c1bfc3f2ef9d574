"""Timing one case the way the project reports numbers: CUDA-graph replays of many launches, each
on another slot set so that the L2 stays cold, the median of the replays.

With several tokens per step (speculative) a timed launch is a whole decode step of a one-layer
group: the step and the commit, with realistic acceptance (each draft kept with probability 0.7).
The slots of a checkpoint-and-ring backend (flashinfer-replayssm, triton-replay) start at random
points of their window (a running server), so that the time is the amortised one over a long decode.
``adopt`` times steps on an engine's adopted cache (a view with twice a slot's stride) instead of a
backend-owned state.

``call`` times an engine's call form instead of the step (docs/spec.md, "Engine call forms"), on
an adopted cache as the engines keep it: ``packed``, vLLM's call of up to T tokens a sequence
(:func:`packed_lengths`: most sequences carry all T, some fewer), each token's state written to
its own slot; ``verify``, SGLang's, T tokens a row, every token's state stored in an intermediate
buffer in the cache's dtype and the cache left alone. Their traffic floor is the same for every
backend: each sequence's state read once and each token's state written once.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Optional

import attrs

from ..measure import traffic as step_traffic
from ..contract.dtypes import state_slot_bytes
from ..contract.errors import SSUError, SSUWarning
from ..checking.inputs import accepted_counts, mean_accepted

#: each timed graph spans at least this many state bytes, so that the L2 (60 MB on an H200) stays cold
COLD_BYTES = 1 << 30


@attrs.frozen
class Case:
    """One measurement: a backend on one problem shape and batch."""

    backend: str
    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    state_dtype: str = "fp32"
    input_dtype: str = "bf16"
    tokens: int = 1
    batch: int = 1
    adopt: bool = False
    call: str = "step"  # or an engine call form: "packed", "verify"

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's state in one layer (an 8-bit cache's row scales included)."""
        return state_slot_bytes(self.nheads, self.headdim, self.dstate, self.state_dtype)

    @property
    def written(self) -> int:
        """States one call writes: a state per token (the packed form's :func:`packed_lengths`)."""
        if self.call == "packed":
            return sum(packed_lengths(self.batch, self.tokens))
        return self.batch * self.tokens

    @property
    def state_traffic(self) -> int:
        """Bytes a write-every-step kernel must move per step: each state read once and written
        once per token."""
        return self.slot_bytes * (self.batch + self.written)


def packed_lengths(batch: int, tokens: int) -> list:
    """The tokens of each sequence of a timed packed call: all ``tokens`` for three sequences in
    four, 1 to ``tokens - 1`` for every fourth (requests that kept fewer drafts, or none yet)."""
    if tokens == 1:
        return [1] * batch
    return [tokens if n % 4 != 3 else 1 + (n // 4) % (tokens - 1) for n in range(batch)]


@attrs.frozen
class Row:
    """A measured case: microseconds per step (the step and, when speculative, the commit)."""

    case: Case
    us: float
    commit_us: Optional[float] = None
    #: "graph" (CUDA-graph replays), "eager" (launches between CUDA events: a backend that does not
    #: declare cuda_graphs; includes host time), or the caller's timer ("custom")
    timing: str = "graph"
    #: the bytes the step must move, by part (:meth:`ssu.Kernel.traffic`), as (name, bytes) pairs
    traffic: tuple = ()

    @property
    def floor_bytes(self) -> float:
        """All bytes of :attr:`traffic` (0 when unknown)."""
        return step_traffic.total(dict(self.traffic))

    def floor_us(self, ceiling_tbps: float) -> Optional[float]:
        """The time the traffic floor takes at ``ceiling_tbps`` (None when unknown)."""
        return self.floor_bytes / ceiling_tbps / 1e6 if self.traffic and ceiling_tbps else None

    @property
    def tbps(self) -> float:
        """State bandwidth in TB/s: the bytes a write-every-step kernel must move, over the measured time."""
        return self.case.state_traffic / self.us / 1e6

    def to_dict(self) -> dict:
        """The row as JSON-ready values, rounded to the precision the measurement has."""
        return dict(
            attrs.asdict(self.case),
            us=round(self.us, 3),
            tbps=round(self.tbps, 4),
            commit_us=None if self.commit_us is None else round(self.commit_us, 3),
            timing=self.timing,
            traffic={name: int(b) for name, b in self.traffic},
        )


def _staggered_cursors(state, problem, options, gen) -> None:
    """ReplaySSM: every slot at a random point of its window (as in a running server, where
    sequences started at different times), so that each step flushes about 1/max_window of them."""
    import torch

    W = getattr(options, "max_window", 15)
    L = W + problem.tokens_per_step
    S = problem.num_slots
    buf = state.buffers
    if "pnat" in buf:  # flashinfer-replayssm: cursors shared by the group
        start, count, d = buf["ring_start"][:S], buf["pnat"][:S], buf["dt_cache"]
    else:  # triton-replay: cursors per layer, and the ring's log decays beside d
        start, count, d = buf["start"][..., :S], buf["count"][..., :S], buf["d_ring"]
    start.copy_(torch.randint(0, L, start.shape, generator=gen, dtype=torch.int32))
    count.copy_(torch.randint(0, W + 1, count.shape, generator=gen, dtype=torch.int32))
    d.abs_().mul_(0.1)
    if "a_ring" in buf:
        torch.neg(d, out=buf["a_ring"])


def measure(case: Case, config, *, device: str = "cuda", iterations: int = 40, timer: Optional[Callable] = None) -> Row:
    """Median microseconds of one decode step of ``case``; ``config`` (an :class:`ssu.Config`)
    gives the backend's options. ``timer(launches, min_launches=...)`` times a list of zero-argument
    launches (default: CUDA-graph replays, :func:`ssu.measure.timing.graph_time_us`)."""
    import torch

    from ..plugins.config import Config
    from ..checking.inputs import layer_weights, step_inputs
    from ..runtime.kernel import open_kernel
    from ..contract.problem import Problem
    from ..measure.timing import event_time_us, graph_time_us

    if case.call != "step":
        return _measure_call(case, config, device=device, iterations=iterations, timer=timer)
    timing = "custom" if timer is not None else "graph"
    spec = case.tokens > 1
    versions = case.tokens + 1 if spec else 1
    sets = max(2, min(64, -(-COLD_BYTES // (case.batch * case.slot_bytes * versions))))
    if device != "cuda" and not device.startswith("cuda"):
        sets = 2
    problem = Problem(
        nheads=case.nheads,
        headdim=case.headdim,
        dstate=case.dstate,
        ngroups=case.ngroups,
        state_dtype=case.state_dtype,
        input_dtype=case.input_dtype,
        num_slots=sets * case.batch,
        max_batch=case.batch,
        tokens_per_step=case.tokens,
        speculative=spec,
        device=device,
        engine_state=case.adopt,
    )
    kernel = open_kernel(Config(backend=case.backend, validate=False, backends=config.backends), problem)
    if timer is None:  # a step that cannot be captured is timed eagerly, and labelled so
        timing = "graph" if kernel.capabilities.cuda_graphs else "eager"
        timer = graph_time_us if timing == "graph" else event_time_us
    gen = torch.Generator().manual_seed(0)
    if case.adopt:
        from ..checking.harness import engine_cache, engine_scales

        cache_gen = cache_generator(device)
        caches, _ = engine_cache(problem, 1, cache_gen)
        scales, _ = engine_scales(problem, 1, cache_gen)
        state = kernel.adopt_state(caches, scales=scales or None)
    else:
        state = kernel.allocate_state(num_layers=1)
        for buf in state.buffers.values():
            if buf.is_floating_point():  # random values (an 8-bit float buffer through fp32)
                buf.copy_(torch.randn(buf.shape, device=buf.device))
        if "pnat" in state.buffers or "count" in state.buffers:
            _staggered_cursors(state, problem, kernel.options, gen)
    weights = layer_weights(problem, gen)
    perm = torch.randperm(problem.num_slots, generator=gen).to(torch.int32).to(device)
    slot_sets = [perm[i * case.batch : (i + 1) * case.batch].contiguous() for i in range(sets)]
    inputs = [step_inputs(problem, s, gen, weights=weights).kwargs() for s in slot_sets]
    outs = [torch.empty_like(i["x"]) for i in inputs]
    kernel.warmup(state)
    step = kernel.raw_step
    commit_us = None
    if spec:
        accepted = [accepted_counts(case.batch, case.tokens, gen, device) for _ in range(sets)]
        launches = [
            (lambda i=i, o=o, s=s, a=a: (step(state, out=o, layer=0, **i), kernel.commit(state, s, a)))
            for i, o, s, a in zip(inputs, outs, slot_sets, accepted)
        ]
        us = timer(launches, min_launches=iterations)
        if "pnat" not in state.buffers:  # the commit alone, with as many launches per graph
            commit_us = timer(
                [(lambda s=s, a=a: kernel.commit(state, s, a)) for s, a in zip(slot_sets, accepted)],
                min_launches=iterations,
            )
    else:
        launches = [(lambda i=i, o=o: step(state, out=o, layer=0, **i)) for i, o in zip(inputs, outs)]
        us = timer(launches, min_launches=iterations)
    try:
        traffic = kernel.traffic(case.batch, accepted=mean_accepted(case.tokens) if spec else None)
    except SSUError as exc:  # a broken account costs the floor column, not the measured time
        warnings.warn(f"{exc}; its rows show no traffic floor", SSUWarning, stacklevel=2)
        traffic = {}
    return Row(case, us, commit_us, timing, tuple(traffic.items()))


def _measure_call(case: Case, config, *, device: str, iterations: int, timer: Optional[Callable]) -> Row:
    """:func:`measure` of an engine call form (``case.call``) on an adopted cache."""
    import torch

    from ..checking import call_draws
    from ..plugins.config import Config
    from ..checking.harness import engine_cache, engine_scales
    from ..checking.inputs import layer_weights
    from ..runtime.kernel import open_kernel
    from ..contract.problem import Problem
    from ..measure.timing import event_time_us, graph_time_us
    from ..measure.traffic import io_bytes

    T = case.tokens
    per_set = case.batch * (T if case.call == "packed" else 1)
    sets = max(2, min(64, -(-COLD_BYTES // (case.written * case.slot_bytes))))
    if not device.startswith("cuda"):
        sets = 2
    problem = Problem(
        nheads=case.nheads, headdim=case.headdim, dstate=case.dstate, ngroups=case.ngroups,
        state_dtype=case.state_dtype, input_dtype=case.input_dtype, num_slots=sets * per_set, max_batch=case.batch,
        tokens_per_step=T, device=device, engine_state=True, engine_calls={case.call},
    )  # fmt: skip
    kernel = open_kernel(Config(backend=case.backend, validate=False, backends=config.backends), problem)
    timing = "custom" if timer is not None else ("graph" if kernel.capabilities.cuda_graphs else "eager")
    if timer is None:
        timer = graph_time_us if timing == "graph" else event_time_us
    gen = torch.Generator().manual_seed(0)
    cache_gen = cache_generator(device)
    caches, _ = engine_cache(problem, 1, cache_gen, slot_stride=1)
    scales, _ = engine_scales(problem, 1, cache_gen, slot_stride=1)
    state = kernel.adopt_state(caches, scales=scales or None)
    kernel.warmup(state)
    weights = layer_weights(problem, gen)
    if case.call == "packed":
        lengths = packed_lengths(case.batch, T)
        calls = [
            call_draws.draw_packed(
                problem, gen, sequences=case.batch, lengths=lengths,
                accepted=torch.randint(1, T + 1, (case.batch,), generator=gen).tolist(), with_z=False, weights=weights,
            )
            for _ in range(sets)
        ]  # fmt: skip
        run = kernel.packed_step
    else:
        buffer = "fp32" if problem.quantized else case.state_dtype
        calls = [
            call_draws.draw_verify(problem, gen, rows=case.batch, buffer_dtype=buffer, steps=T, weights=weights)
            for _ in range(sets)
        ]
        run = kernel.verify_step
    outs = [torch.empty_like(c.x) for c in calls]
    launches = [(lambda c=c, o=o: run(state, **dict(c.kwargs(), out=o))) for c, o in zip(calls, outs)]
    us = timer(launches, min_launches=iterations)
    io = io_bytes(problem, case.batch, with_z=False) * case.written // (case.batch * T)
    traffic = {
        "state read": case.batch * case.slot_bytes,
        "state write": case.written * case.slot_bytes,
        "inputs and outputs": io,
    }
    return Row(case, us, None, timing, tuple(traffic.items()))


def cache_generator(device: str):
    """A seeded generator on ``device`` for an adopted cache's random values: at a large batch the
    cache holds gigabytes, which the GPU draws in milliseconds and the host in tens of seconds."""
    import torch

    return torch.Generator(device=device).manual_seed(1)


def wall_time_us(launches, *, min_launches: int = 1, repeats: int = 5) -> float:
    """Median wall-clock microseconds per launch (a CPU has no CUDA graphs): for smoke runs only."""
    import statistics

    launches = list(launches)
    for fn in launches:
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for fn in launches:
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / len(launches))
    return statistics.median(samples)


def copy_ceiling_tbps(device: str = "cuda", nbytes: int = 1 << 30, timer: Optional[Callable] = None) -> float:
    """This GPU's read+write bandwidth: an elementwise in-place add over ``nbytes`` (three buffers
    rotated so the L2 holds none), in TB/s of bytes read plus bytes written (a cudaMemcpy-backed
    ``copy_`` reaches less on an H200 than an elementwise kernel)."""
    import torch

    from ..measure.timing import graph_time_us

    timer = graph_time_us if timer is None else timer
    n = nbytes // 4
    buffers = [torch.empty(n, dtype=torch.float32, device=device).normal_() for _ in range(3)]
    launches = [(lambda a=buffer: a.add_(1.0)) for buffer in buffers]
    us = timer(launches, min_launches=6)
    del buffers
    return 2 * nbytes / us / 1e6
