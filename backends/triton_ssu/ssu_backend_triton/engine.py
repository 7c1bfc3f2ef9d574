"""The per-kernel launcher: launch parameters per batch, the step callable, scratch runs.

``table[b]`` holds the :class:`~ssu_backend_triton.tuning.Schedule` used for a batch of ``b`` rows:
pinned by options, tuned by warmup (or loaded from the tuning cache at open), else the per-shape
default.
"""

from __future__ import annotations

import time

import torch
import triton

from ssu.state.slot_state import LayerViews, versions

from . import tuning
from .custom_op import step_op  # noqa: F401  (registers torch.ops.ssu_triton.step)
from .launch import StepConstants, launch
from .step_launches import StepLaunches


class Launcher:
    """Everything a step launch needs that does not change between calls: constants, tuned tiles, the op."""

    def __init__(self, ctx) -> None:
        p = self.problem = ctx.problem
        self.options = ctx.options
        self.versions = versions(p)
        self.seed = (ctx.scratch or {}).get("seed")
        self.faults = ctx.faults
        on_cuda = p.device_type == "cuda"
        self.gpu = torch.cuda.get_device_name(torch.device(p.device)) if on_cuda else "cpu-interpreter"
        self.triton_version = triton.__version__
        self.table: list = [None] * (p.max_batch + 1)
        self._scratch_cursor = None
        self._scratch_faults = None
        self._scratch_scale_sets: dict = {}
        self.tuned_us: dict = {}  # bucket -> microseconds of its schedule, as tuned (now or in the cache)
        for bucket in tuning.buckets(p.max_batch):
            self.set_bucket(bucket, self.pinned() or tuning.default_config(p, bucket))
        if on_cuda and self.pinned() is None:  # reuse what an earlier process tuned
            cached = tuning.read_cache(tuning.cache_path(self.options.tuning_cache))
            for bucket in tuning.buckets(p.max_batch):
                schedule = tuning.cached_schedule(cached, self.cache_key(bucket))
                if schedule is not None:
                    self.set_bucket(bucket, schedule)

    # launch parameters ---------------------------------------------------------------------------
    def pinned(self):
        """The schedule the options pin, or None (tuned or default per batch)."""
        o = self.options
        if not o.block_p and not o.num_warps:
            return None
        default = tuning.default_config(self.problem, self.problem.max_batch)
        block_p = o.block_p or default.block_p
        tiles = o.tiles_per_program or (-(-self.problem.headdim // block_p) if o.loop_stages else 1)
        return tuning.Schedule(
            block_p,
            o.num_warps or default.num_warps,
            tiles,
            o.loop_stages if tiles > 1 else 0,
            o.max_registers,
            default.pdl,
            default.branchless,
        )

    def set_bucket(self, bucket: int, config: tuning.Schedule) -> None:
        """Use ``config`` for every batch size in (bucket / 2, bucket] (with programmatic dependent
        launch and branch-free input loads as the options force them, if they do)."""
        if self.options.programmatic_launch != "auto":
            config = config._replace(pdl=int(self.options.programmatic_launch))
        if self.options.branchless_inputs != "auto":
            config = config._replace(branchless=int(self.options.branchless_inputs))
        for b in range(bucket // 2 + 1, min(bucket, self.problem.max_batch) + 1):
            self.table[b] = config

    def cache_key(self, bucket: int) -> str:
        """The tuning-cache key of one batch bucket on this GPU, Triton version and kernel variant."""
        return tuning.cache_key(self.problem, bucket, self.gpu, self.triton_version, self.options.stochastic_rounding)

    # the step ------------------------------------------------------------------------------------
    def constants(self, cursor: bool) -> StepConstants:
        """The scalar launch arguments fixed by the problem; ``cursor`` selects the versioned (allocated) layout."""
        p = self.problem
        return StepConstants(
            p.pad_slot_id,
            p.num_slots,
            p.heads_per_group,
            p.speculative,
            cursor,
            self.versions,
            self.options.stochastic_rounding,
            self.options.philox_rounds,
        )

    def make_step(self):
        """The step callable: no checks, no allocation but ``out`` when none is given, one launch
        (through the custom op when compiling; directly through Triton's launcher once the call's
        layout was seen, :class:`~ssu_backend_triton.step_launches.StepLaunches`)."""
        table = self.table
        seed = self.seed
        faults = self.faults
        consts = {True: self.constants(True), False: self.constants(False)}  # allocated / adopted speculative
        is_compiling = torch.compiler.is_compiling
        op = torch.ops.ssu_triton.step
        launches = StepLaunches(seed, faults, compiled=self.options.compiled_lanes)
        quantized = self.problem.quantized

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
            schedule = table[x.shape[0]]
            read, write = state.views[layer]
            scales = state.scales[layer] if quantized else None
            cursor = state.buffers.get("cursor")
            if is_compiling():
                op(
                    read,
                    None if write is read else write,
                    cursor,
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
                    list(consts[cursor is not None]),
                    list(schedule),
                    None if scales is None else scales.read,
                    None if scales is None or scales.write is scales.read else scales.write,
                )
            else:
                launches(
                    read,
                    write,
                    cursor,
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
                    dst_slots,
                    consts[cursor is not None],
                    schedule,
                    scales,
                )
            if seed is not None:
                seed.add_(1)
            return out

        def bind(state, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, cache):
            """:meth:`~ssu_backend_triton.step_launches.StepLaunches.lane` for ``state``'s ``layer``: None
            with stochastic rounding (its seed moves every step) or while compiling."""
            if seed is not None or is_compiling():
                return None
            read, write = state.views[layer]
            cursor = state.buffers.get("cursor")
            scales = state.scales[layer] if quantized else None
            return launches.lane(
                read, write, cursor, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, consts[cursor is not None],
                table[x.shape[0]], scales, cache,
            )  # fmt: skip

        def lane(state, layer, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False):
            """Plugin API 1.6's optional lane (``ssu.contract.LaneFn``): later one-token calls of
            this call's layout on ``state``'s ``layer`` and ``slots`` launched directly; None when
            this layout has not been launched yet."""
            return bind(state, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, None)

        def cache_lane(state, layer, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False):
            """Plugin API 1.7's optional cache lane (``ssu.contract.CacheLaneFn``): the lane for an
            adopted cache without row scales, taking the tensor to step first, so that it also
            serves other tensors of the adopted one's layout (a copy an engine makes of its cache
            before each step); None where ``state`` is not adopted."""
            if not state.adopted:
                return None
            return bind(state, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, state.cache[layer])

        step.launches = launches  # what it launches directly (benchmarks inspect it)
        step.lane = lane
        step.cache_lane = cache_lane
        return step

    # warmup helpers ------------------------------------------------------------------------------
    def tune(self, log) -> dict:
        """Warmup's tuning: per batch bucket, time the candidate schedules on scratch states (never
        a live state), keep the fastest; buckets found in the JSON cache are read, not timed; a
        pinned schedule is kept. Writes and returns the new cache entries."""
        p, o = self.problem, self.options
        path = tuning.cache_path(o.tuning_cache)
        cached = tuning.read_cache(path)
        fresh = {}
        configs = tuning.candidates(p)
        pinned = self.pinned()
        for bucket in tuning.buckets(p.max_batch):
            if pinned is not None:
                self.set_bucket(bucket, pinned)
                continue
            key = self.cache_key(bucket)
            schedule = tuning.cached_schedule(cached, key)
            if schedule is not None:
                self.set_bucket(bucket, schedule)
                us = cached[key].get("us")
                if isinstance(us, (int, float)):
                    self.tuned_us[bucket] = float(us)
                log(f"batch {bucket:5d}: tuned {schedule} from {path}")
                continue
            t0 = time.perf_counter()
            best = tuning.tune_bucket(
                p,
                bucket,
                self.run_scratch,
                configs,
                o.tune_iterations,
                log,
                try_pdl=o.programmatic_launch == "auto",
                try_branchless=o.branchless_inputs == "auto",
            )
            if best is None:
                log(f"batch {bucket:5d}: every candidate failed; keeping the default")
                continue
            config, us = best
            self.set_bucket(bucket, config)
            self.tuned_us[bucket] = us
            fresh[key] = {"config": list(config), "us": round(us, 2)}
            took = time.perf_counter() - t0
            log(f"batch {bucket:5d}: tuned {config}, {us:.1f} us ({len(configs)} candidates, {took:.1f} s)")
        tuning.write_cache(path, fresh)
        return fresh

    def run_scratch(
        self, config, ssm, slots, inputs, out, compile_only: bool = False, dst_slots=None, adopted: bool = False
    ) -> None:
        """One launch on scratch state ``ssm`` (S, K, H, P, N) with the given config (its own fault
        record: the scratch slots are all real); with ``compile_only``, its kernel compiled only.
        ``adopted`` (speculative problems) launches in an adopted cache's layout: version 0 read
        without a cursor, the drafts written to versions 1 to T."""
        p = self.problem
        cursor = None
        read, write = ssm, ssm
        scales = self._scratch_scales(ssm)
        if adopted:
            read, write = ssm[:, :1], ssm[:, 1:]
            scales = scales and LayerViews(scales.read[:, :1], scales.read[:, 1:])
        elif p.speculative:
            if self._scratch_cursor is None or self._scratch_cursor.numel() < ssm.shape[0] + 1:
                self._scratch_cursor = torch.zeros(ssm.shape[0] + 1, dtype=torch.int32, device=ssm.device)
            cursor = self._scratch_cursor
        if self._scratch_faults is None:
            self._scratch_faults = torch.zeros(1, dtype=torch.int64, device=ssm.device)
        consts = self.constants(cursor is not None)._replace(num_slots=ssm.shape[0], pad_slot_id=-1)
        launch(
            read,
            write,
            cursor,
            inputs.x,
            inputs.dt,
            inputs.A,
            inputs.B,
            inputs.C,
            slots,
            inputs.D,
            inputs.z,
            inputs.dt_bias,
            inputs.dt_softplus,
            out,
            self.seed,
            dst_slots,
            self._scratch_faults,
            consts,
            config,
            scales,
            compile_only=compile_only,
        )

    def _scratch_scales(self, ssm):
        """Row scales for a scratch state of an 8-bit cache (one set per scratch tensor, kept), or
        None for a floating-point cache."""
        if not self.problem.quantized:
            return None
        key = (ssm.data_ptr(), tuple(ssm.shape))
        scales = self._scratch_scale_sets.get(key)
        if scales is None:
            scales = torch.full(ssm.shape[:-1], 0.01, dtype=torch.float32, device=ssm.device)
            self._scratch_scale_sets = {key: scales}  # the latest scratch state's only
        return LayerViews(scales, scales)

    def compile_all(self) -> None:
        """Compile every configuration in the table for int32 and int64 slots (on scratch), with
        destination slots (one-token problems) and in an adopted cache's layout (speculative ones),
        so that CUDA-graph capture afterwards compiles nothing."""
        from ssu.checking.inputs import step_inputs

        p = self.problem
        gen = torch.Generator().manual_seed(0)
        ssm = torch.zeros(2, self.versions, p.nheads, p.headdim, p.dstate, device=p.device, dtype=self._state_dtype())
        configs = sorted(set(c for c in self.table if c is not None))
        for index_dtype in (torch.int32, torch.int64):
            slots = torch.tensor([0, -1], dtype=index_dtype, device=p.device)[: min(2, p.max_batch)]
            inputs = step_inputs(p, slots, gen)
            out = torch.empty_like(inputs.x)
            variants = [dict(adopted=True)] if p.speculative else [dict(dst_slots=slots)]
            runs = [(c, v) for c in configs for v in [{}, *variants]]
            tuning.compile_in_parallel(
                lambda c=c, v=v, s=slots, i=inputs, o=out: self.run_scratch(c, ssm, s, i, o, compile_only=True, **v)
                for c, v in runs
            )
            for config, variant in runs:
                self.run_scratch(config, ssm, slots, inputs, out, **variant)
        if p.device_type == "cuda":
            torch.cuda.synchronize()

    def _state_dtype(self):
        from ssu.contract.dtypes import to_torch

        return to_torch(self.problem.state_dtype)
