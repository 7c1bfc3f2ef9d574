"""The per-kernel launcher of ``triton-replay``: a :class:`~.launch.Plan` per batch, the step
callable, the commit, and warmup's tuning of plans on scratch states.

``table[b]`` holds the plan of a batch of ``b`` rows: pinned by options, tuned by warmup (or read
from the tuning cache at open), else the default. The flush window is part of the plan, so a
batch bucket where bytes are not the limit may write its checkpoints every step while a large one
keeps ``max_window`` tokens in the ring; the rule of each step depends only on the slot's cursors
and the step's window, so slots move freely between buckets.

Where every bucket of a one-token problem has window 0, no step appends to a ring: a state whose
rings have never held a token (its :class:`~.layout.RingRecord` says so) is then the
``triton`` backend's state exactly, and its steps are that backend's launches, with that
backend's own tuned schedules (option ``write_through_kernel``). The choice is made per problem,
once warmup has fixed the table, so that a CUDA graph captured afterwards stays valid: a table
that writes through everywhere is never tuned again into one with a window.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import triton

from .. import tuning
from ..engine import Launcher
from .launch import Plan, ReplayConstants, commit, launch, replay_step_op  # noqa: F401 (registers the op)
from .plans import (
    cached_plan,
    candidate_shapes,
    default_plan,
    fold_plans,
    plan_cache_key,
    stepwise_plans,
    triton_options,
)


class ReplayLauncher:
    """Everything a step launch needs that does not change between calls."""

    def __init__(self, ctx) -> None:
        p = self.problem = ctx.problem
        o = self.options = ctx.options
        self.ring = o.ring_length(p.tokens_per_step)
        self.seed = (ctx.scratch or {}).get("seed")
        self.faults = ctx.faults
        on_cuda = p.device_type == "cuda"
        self.gpu = torch.cuda.get_device_name(torch.device(p.device)) if on_cuda else "cpu-interpreter"
        self.pdl = bool(on_cuda and o.programmatic_launch)
        self.consts = ReplayConstants(
            p.pad_slot_id,
            p.num_slots,
            p.heads_per_group,
            p.speculative,
            self.ring,
            o.stochastic_rounding,
            o.philox_rounds,
        )
        # the triton backend's launcher, for the steps of a table that writes through everywhere
        self.write_through: Optional[Launcher] = None
        if not p.speculative and o.write_through_kernel == "triton":
            shim = SimpleNamespace(problem=p, options=triton_options(o), scratch=ctx.scratch, faults=ctx.faults)
            self.write_through = Launcher(shim)
        self.route = [False]  # whether steps on states with empty rings go to self.write_through
        self.table: list = [None] * (p.max_batch + 1)
        for bucket in tuning.buckets(p.max_batch):
            self.set_bucket(bucket, self.pinned(bucket) or default_plan(p, o, bucket))
        if on_cuda and not self.fully_pinned():
            cached = tuning.read_cache(tuning.cache_path(o.tuning_cache))
            for bucket in tuning.buckets(p.max_batch):
                plan = cached_plan(cached, self.cache_key(bucket))
                if plan is not None:
                    self.set_bucket(bucket, plan)
        # opened writing through everywhere: no step of this launcher ever fills a ring
        self.rings_unused = self.route[0]

    # plans ----------------------------------------------------------------------------------------
    def fully_pinned(self) -> bool:
        """Whether the options fix the launch shape and the window (nothing to tune)."""
        o = self.options
        return self.pinned(1) is not None and o.window >= 0

    def pinned(self, bucket: int) -> Optional[Plan]:
        """The plan the options pin for ``bucket``, or None."""
        o = self.options
        if not (o.block_p or o.num_warps):
            return None
        default = default_plan(self.problem, o, bucket)
        block_p = o.block_p or default.block_p
        tiles = o.tiles_per_program or 1
        stages = o.loop_stages if tiles > 1 else 0
        return Plan(block_p, o.num_warps or default.num_warps, tiles, stages, default.window, default.pdl)

    def set_bucket(self, bucket: int, plan: Plan) -> None:
        """Use ``plan`` for every batch size in (bucket / 2, bucket], with what the options force."""
        o = self.options
        if o.window >= 0:
            plan = plan._replace(window=o.window)
        if o.fold_heads >= 0:
            plan = plan._replace(fold=o.fold_heads)
        if o.stepwise >= 0:
            plan = plan._replace(stepwise=o.stepwise)
        plan = plan._replace(window=min(plan.window, o.max_window), pdl=int(self.pdl))
        for b in range(bucket // 2 + 1, min(bucket, self.problem.max_batch) + 1):
            self.table[b] = plan
        self.route[0] = self.write_through is not None and all(
            plan is not None and plan.window == 0 for plan in self.table[1:]
        )

    def cache_key(self, bucket: int) -> str:
        return plan_cache_key(self.problem, self.options, bucket, self.gpu, triton.__version__)

    # the step and the commit ------------------------------------------------------------------------
    def make_step(self):
        """The step callable: no checks, no allocation but ``out`` when none is given, one launch
        (through the custom op when compiling): the triton backend's step where the table writes
        through everywhere and the state's rings have never held a token, else this backend's."""
        table = self.table
        route = self.route
        triton_step = self.write_through.make_step() if self.write_through is not None else None
        seed = self.seed
        faults = self.faults
        consts = self.consts
        consts_list = list(consts)
        is_compiling = torch.compiler.is_compiling
        op = torch.ops.ssu_triton.replay_step

        def step(
            state,
            x,
            dt,
            A,
            B,
            C,
            slots,
            D=None,
            z=None,
            dt_bias=None,
            dt_softplus=False,
            out=None,
            layer=0,
            dst_slots=None,
        ):
            if out is None:
                out = torch.empty_like(x)
            plan = table[x.shape[0]]
            record = state.record
            if plan.window:
                record.ring_tokens = True
            elif route[0] and not record.ring_tokens:
                return triton_step(
                    record.checkpoints, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots
                )
            views = state.views[layer]
            if is_compiling():
                op(
                    *views,
                    x,
                    dt,
                    A,
                    B,
                    C,
                    slots,
                    D,
                    z,
                    dt_bias,
                    dt_softplus,
                    out,
                    seed,
                    dst_slots,
                    faults,
                    consts_list,
                    list(plan),
                )
            else:
                launch(
                    views, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, seed, dst_slots, faults, consts, plan
                )
            if seed is not None:
                seed.add_(1)
            return out

        return step

    def commit(self, state, slots, num_accepted) -> None:
        """Speculative commit: each accepted count added to its slot's ring count, every layer."""
        p = self.problem
        commit(
            state.buffers["count"],
            slots,
            num_accepted,
            self.faults,
            tokens=p.tokens_per_step,
            pad_slot_id=p.pad_slot_id,
            num_slots=p.num_slots,
            pdl=self.pdl,
        )

    # warmup ------------------------------------------------------------------------------------------
    def tune(self, log: Callable) -> dict:
        """Warmup's tuning; returns the new tuning-cache entries. A table that already writes
        through everywhere with the triton kernel keeps doing so: only that backend's schedules are
        tuned. Otherwise, when the flush window is tuned, those schedules first (their times are
        what a bucket without a window would take, if every bucket ends without one), then the
        plans (:meth:`tune_plans`)."""
        wt = self.write_through
        fresh = {}
        baseline = None
        if not self.route[0]:
            if wt is not None and self.options.window < 0 and not self.all_cached():
                fresh.update(wt.tune(log))
                baseline = wt.tuned_us
            fresh.update(self.tune_plans(log, baseline))
        if self.route[0]:
            log("every bucket writes its checkpoints every step: the triton kernel and its schedules serve them")
            if baseline is None:
                fresh.update(wt.tune(log))
        return fresh

    def all_cached(self) -> bool:
        """Whether the tuning cache holds a plan for every bucket."""
        cached = tuning.read_cache(tuning.cache_path(self.options.tuning_cache))
        return all(cached_plan(cached, self.cache_key(b)) is not None for b in tuning.buckets(self.problem.max_batch))

    def tune_plans(self, log: Callable, baseline: Optional[dict] = None) -> dict:
        """Time candidate plans per batch bucket on scratch states (never a live state); keep the
        fastest; return the new tuning-cache entries. Buckets in the cache are only read.

        With ``baseline`` (the triton kernel's microseconds per bucket), plans with a window are
        timed against it and this kernel's write-every-step plans only where needed: a bucket
        where the baseline wins takes window 0; if every bucket does, the triton kernel serves them
        all and nothing more is timed; else this kernel's window-0 plans are timed for those
        buckets (against their best plan with a window)."""
        p, o = self.problem, self.options
        path = tuning.cache_path(o.tuning_cache)
        cached = tuning.read_cache(path)
        fresh = {}
        if self.fully_pinned():
            return fresh
        windows = [o.window] if o.window >= 0 else sorted({0, o.max_window})
        through = {}  # buckets where writing through beat every plan with a window: that plan, or None
        for bucket in tuning.buckets(p.max_batch):
            plan = cached_plan(cached, self.cache_key(bucket))
            if plan is not None:
                self.set_bucket(bucket, plan)
                log(f"batch {bucket:5d}: tuned {tuple(plan)} from {path}")
                continue
            t0 = time.perf_counter()
            zero = baseline is None or bucket not in baseline
            best, count = self.tune_bucket(bucket, windows if zero else [w for w in windows if w > 0], log)
            if not zero and (best is None or baseline[bucket] < best[1]):
                through[bucket] = best
                self.set_bucket(bucket, (self.pinned(bucket) or default_plan(p, o, bucket))._replace(window=0))
                log(f"batch {bucket:5d}: writes through ({baseline[bucket]:.1f} us with the triton kernel)")
                continue
            if best is None:
                log(f"batch {bucket:5d}: every candidate failed; keeping the default")
                continue
            plan, us = best
            self.set_bucket(bucket, plan)
            fresh[self.cache_key(bucket)] = {"plan": list(plan), "us": round(us, 2)}
            took = time.perf_counter() - t0
            log(f"batch {bucket:5d}: tuned {tuple(plan)}, {us:.1f} us ({count} candidates, {took:.1f} s)")
        for bucket, windowed in through.items():
            if self.route[0]:  # the triton kernel serves every bucket
                plan = self.table[min(bucket, p.max_batch)]  # the top bucket may pass max_batch
                fresh[self.cache_key(bucket)] = {"plan": list(plan), "us": round(baseline[bucket], 2)}
                continue
            best, count = self.tune_bucket(bucket, [0], log)
            if windowed is not None and (best is None or windowed[1] < best[1]):
                best = windowed
            if best is not None:
                self.set_bucket(bucket, best[0])
                fresh[self.cache_key(bucket)] = {"plan": list(best[0]), "us": round(best[1], 2)}
                log(f"batch {bucket:5d}: tuned {tuple(best[0])}, {best[1]:.1f} us ({count} candidates)")
        tuning.write_cache(path, fresh)
        return fresh

    def tune_bucket(self, bucket: int, windows: list, log: Callable) -> tuple:
        """(fastest plan and its microseconds, or None; how many were timed) over every launch
        shape (or the pinned one) with each of ``windows`` (a speculative window 0 with and without
        stepwise outputs), and the fastest shape again with the fold kernel where it may serve."""
        p, o = self.problem, self.options
        pin = self.pinned(bucket)
        shapes = [pin[:4]] if pin is not None else candidate_shapes(p)
        plans = [Plan(*shape, window, int(self.pdl)) for shape in shapes for window in windows]
        plans += stepwise_plans(p, o, plans)
        best = self.time_plans(bucket, plans, log)
        extra = fold_plans(p, o, best[0], windows) if best is not None else []
        if extra:  # the fastest shape again, its flushing rows served by the fold kernel
            plans += extra
            folded = self.time_plans(bucket, extra, log)
            if folded is not None and folded[1] < best[1]:
                best = folded
        return best, len(plans)

    def time_plans(self, bucket: int, plans: list, log: Callable) -> Optional[tuple]:
        """(fastest plan, its microseconds) over ``plans`` for one bucket, timed with CUDA-graph
        replays on a scratch state whose slots sit at random points of their windows."""
        from ssu.checking.inputs import accepted_counts, step_inputs
        from ssu.measure.timing import graph_time_us

        from . import layout

        p = self.problem
        slot_bytes = p.state_bytes_per_slot() + layout.ring_bytes_per_slot(p, self.ring)
        sets = max(
            1, min(16, -(-tuning.COLD_BYTES // (slot_bytes * bucket)), tuning.SCRATCH_LIMIT // (slot_bytes * bucket))
        )
        scratch_problem = _scratch_problem(p, sets * bucket, bucket)
        state = layout.allocate(scratch_problem, 1, self.ring, "triton-replay")
        randomize(state, self.options, torch.Generator(device="cpu").manual_seed(bucket))
        # every plan starts from the same staggered cursors, its counts within its own window (a
        # plan that flushes every step empties every ring, and the plans timed after it would
        # otherwise flush no row at all)
        start, count = (state.buffers[name].clone() for name in ("start", "count"))
        gen = torch.Generator().manual_seed(bucket)
        slot_sets = [
            torch.arange(i * bucket, (i + 1) * bucket, dtype=torch.int32, device=p.device) for i in range(sets)
        ]
        inputs = [step_inputs(p, s, gen) for s in slot_sets]
        outs = [torch.empty_like(i.x) for i in inputs]
        record = torch.zeros(1, dtype=torch.int64, device=p.device)
        consts = self.consts._replace(num_slots=sets * bucket, pad_slot_id=-1)
        # each slot set commits the bench's realistic acceptance (a ring fills, and flushes, at the
        # pace of the accepted tokens); the same counts for every plan
        accepted = [accepted_counts(bucket, p.tokens_per_step, gen, p.device) for _ in slot_sets]
        s0, i0, o0 = slot_sets[0], inputs[0], outs[0]
        tuning.compile_in_parallel(
            lambda q=q: self.run_scratch(state, q, s0, i0, o0, record, consts, compile_only=True) for q in plans
        )
        best = None
        for plan in plans:
            state.buffers["start"].copy_(start)
            torch.remainder(count, plan.window + 1, out=state.buffers["count"])

            def run(plan=plan, s=None, i=None, o=None, a=None):
                self.run_scratch(state, plan, s, i, o, record, consts)
                if p.speculative:
                    commit(
                        state.buffers["count"],
                        s,
                        a,
                        record,
                        tokens=p.tokens_per_step,
                        pad_slot_id=-1,
                        num_slots=sets * bucket,
                        pdl=self.pdl,
                    )

            launches = [
                (lambda s=s, i=i, o=o, a=a, run=run: run(s=s, i=i, o=o, a=a))
                for s, i, o, a in zip(slot_sets, inputs, outs, accepted)
            ]
            try:
                us = graph_time_us(launches, replays=5, warmup=1, min_launches=self.options.tune_iterations)
            except Exception as exc:  # a plan the compiler rejects is skipped, not fatal
                log(f"  plan {tuple(plan)} failed: {type(exc).__name__}: {exc}")
                continue
            if best is None or us < best[1]:
                best = (plan, us)
        return best

    def run_scratch(self, state, plan, slots, inputs, out, record, consts, dst_slots=None, compile_only=False) -> None:
        """One launch of ``plan`` on layer 0 of a scratch state, with its own fault record (with
        ``compile_only``, its kernels compiled only)."""
        i = inputs
        launch(
            state.views[0], i.x, i.dt, i.A, i.B, i.C, slots, i.D, i.z, i.dt_bias, i.dt_softplus, out, self.seed,
            dst_slots, record, consts, plan, compile_only,
        )  # fmt: skip

    def compile_all(self) -> None:
        """Compile every plan of the table for int32 and int64 slots (on scratch), so that a CUDA
        graph captured afterwards compiles nothing; and the triton backend's schedules where they
        serve (this backend's plans then only for states stepped before, when the table had a
        window)."""
        if self.route[0]:
            self.write_through.compile_all()
            if self.rings_unused:
                return
        self.compile_plans()

    def compile_plans(self) -> None:
        """Compile every plan of the table (:meth:`compile_all`)."""
        from ssu.checking.inputs import step_inputs

        from . import layout

        p = self.problem
        scratch_problem = _scratch_problem(p, 2, 2)
        state = layout.allocate(scratch_problem, 1, self.ring, "triton-replay")
        gen = torch.Generator().manual_seed(0)
        record = torch.zeros(1, dtype=torch.int64, device=p.device)
        consts = self.consts._replace(num_slots=2, pad_slot_id=-1)
        plans = sorted(set(c for c in self.table if c is not None))
        for index_dtype in (torch.int32, torch.int64):
            slots = torch.tensor([0, -1], dtype=index_dtype, device=p.device)[: min(2, p.max_batch)]
            i = step_inputs(p, slots, gen)
            out = torch.empty_like(i.x)
            destinations = [None] if p.speculative else [None, slots]  # one-token steps may name destinations
            runs = [(plan, dst) for plan in plans for dst in destinations]
            tuning.compile_in_parallel(
                lambda q=q, d=d, s=slots, i=i, o=out: self.run_scratch(
                    state, q, s, i, o, record, consts, d, compile_only=True
                )
                for q, d in runs
            )
            for plan, dst in runs:
                self.run_scratch(state, plan, slots, i, out, record, consts, dst)
        if p.device_type == "cuda":
            torch.cuda.synchronize()


def _scratch_problem(problem, num_slots: int, max_batch: int):
    import attrs

    return attrs.evolve(problem, num_slots=num_slots, max_batch=max_batch, pad_slot_id=-1, engine_state=False)


def randomize(state, options, gen) -> None:
    """Random checkpoints and rings, every slot at a random point of its window (as in a running
    server, where sequences started at different times): for timing, never on a live state."""
    buf = state.buffers
    for name in ("ssm", "x_ring", "B_ring"):
        buf[name].copy_(torch.randn(buf[name].shape, generator=gen).to(buf[name].dtype))
    if "scale" in buf:  # an 8-bit checkpoint's row scales
        buf["scale"].copy_(torch.rand(buf["scale"].shape, generator=gen) * 0.01)
    d = torch.rand(buf["d_ring"].shape, generator=gen) * 0.1
    buf["d_ring"].copy_(d)
    buf["a_ring"].copy_(-d)
    L = buf["d_ring"].shape[-1]
    buf["start"].copy_(torch.randint(0, L, buf["start"].shape, generator=gen, dtype=torch.int32))
    buf["count"].copy_(torch.randint(0, options.max_window + 1, buf["count"].shape, generator=gen, dtype=torch.int32))
