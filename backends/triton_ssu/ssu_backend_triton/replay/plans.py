"""The plan space of ``triton-replay``: the default plan of a batch, the launch shapes, fold widths
and stepwise variants warmup times, the ``triton`` backend's options for the steps it serves, and
the tuning cache's key and entries of a plan (:mod:`.engine` tunes over them)."""

from __future__ import annotations

from typing import Optional

import triton

from .. import tuning
from ..options import TritonOptions
from .launch import Plan


#: batches below which the default plan writes the checkpoint every step (bytes are not the limit there)
RING_FROM_BATCH = 16


def default_plan(problem, options, batch: int) -> Plan:
    """A sound plan without tuning: tiles of about 1024 values (fewer rows when the batch is too
    small to fill the GPU), one program per tile, two warps; the window ``max_window`` from batch
    16, else 0 (or the ``window`` option when set)."""
    block_n = triton.next_power_of_2(problem.dstate)
    block_p = max(1, min(triton.next_power_of_2(problem.headdim), 1024 // block_n))
    while block_p > 2 and batch * problem.nheads * -(-problem.headdim // block_p) < tuning.MIN_PROGRAMS:
        block_p //= 2
    if options.window >= 0:
        window = options.window
    else:
        window = options.max_window if batch >= RING_FROM_BATCH else 0
    return Plan(block_p, 2, 1, 0, window, int(problem.device_type == "cuda" and options.programmatic_launch))


def candidate_shapes(problem) -> list[tuple[int, int, int, int]]:
    """(block_p, num_warps, tiles, stages) worth timing: one program per tile of 512 to 2048
    values with 1, 2 or 4 warps; or a program over a whole head, or half of one (its per-head
    weights computed once), its tiles of 1024 values pipelined 3 or 4 deep, or a whole head in
    tiles of 2048 (with a program per tile of 2048 and one warp: the shapes the triton backend's
    write-every-step kernel wins with)."""
    block_n = triton.next_power_of_2(problem.dstate)
    top = triton.next_power_of_2(problem.headdim)
    out = []
    for values, warps in ((1024, 1), (1024, 2), (2048, 1), (2048, 4), (512, 1)):
        out.append((max(1, min(top, values // block_n)), warps, 1, 0))
    block_p = max(1, min(top, 1024 // block_n))
    tiles = -(-problem.headdim // block_p)
    if tiles > 1:
        out += [(block_p, 2, tiles, 3), (block_p, 2, tiles, 4), (block_p, 1, tiles, 4)]
        if tiles % 2 == 0 and tiles > 2:
            out += [(block_p, 2, tiles // 2, 4), (2 * block_p, 2, tiles // 2, 4)]
    return sorted(set(out))


def fold_heads_choices(problem, options) -> list[int]:
    """Heads per program of the fold kernel worth timing (divisors of the heads per group): one,
    four and up to sixteen, or the ``fold_heads`` option (0: none)."""
    p = problem
    if options.fold_heads == 0:
        return []
    if options.fold_heads > 0:
        return [options.fold_heads]
    widest = max(h for h in range(1, 17) if p.heads_per_group % h == 0)
    return sorted({h for h in (1, 4) if p.heads_per_group % h == 0} | {widest})


def fold_plans(problem, options, plan: Plan, windows) -> list[Plan]:
    """``plan``'s launch shape with the fold kernel, for each window above 0 and each heads choice."""
    return [
        plan._replace(window=w, fold=h, stepwise=0)
        for w in windows
        if w > 0
        for h in fold_heads_choices(problem, options)
    ]


def stepwise_plans(problem, options, plans) -> list[Plan]:
    """The window-0 plans among ``plans`` again with stepwise outputs, for a speculative problem
    whose ``stepwise`` option is tuned (-1); else none."""
    if not problem.speculative or options.stepwise >= 0:
        return []
    return [plan._replace(stepwise=1) for plan in plans if plan.window == 0 and not plan.fold and not plan.stepwise]


def triton_options(options) -> TritonOptions:
    """The ``triton`` backend's options for the steps it serves here: the same launch-shape pins,
    tuning cache, tuning iterations and rounding; programmatic dependent launch tuned unless
    turned off."""
    o = options
    return TritonOptions(
        block_p=o.block_p,
        num_warps=o.num_warps,
        tiles_per_program=o.tiles_per_program,
        loop_stages=o.loop_stages,
        programmatic_launch="auto" if o.programmatic_launch else False,
        tuning_cache=o.tuning_cache,
        stochastic_rounding=o.stochastic_rounding,
        philox_rounds=o.philox_rounds,
        tune_iterations=o.tune_iterations,
    )


def plan_cache_key(problem, options, bucket: int, gpu: str, triton_version: str) -> str:
    """The tuning-cache key of one bucket: GPU, Triton version, kernel variant, shape, dtypes, window,
    and the launch-shape pins (a plan tuned under pins is never read by a run without them, nor
    the reverse)."""
    p, o = problem, options
    pins = f"|pin {o.block_p}:{o.num_warps}:{o.tiles_per_program}:{o.loop_stages}" if o.block_p or o.num_warps else ""
    return (
        f"{gpu}|triton {triton_version}|replay v14 W{o.max_window}|H{p.nheads} P{p.headdim} N{p.dstate} "
        f"G{p.ngroups}|state {p.state_dtype} input {p.input_dtype}|T{p.tokens_per_step}"
        f"{' spec' if p.speculative else ''}{' sr' if o.stochastic_rounding else ''}{pins}|batch {bucket}"
    )


def cached_plan(cached: dict, key: str) -> Optional[Plan]:
    """The plan stored under ``key``, or None when absent or malformed (then it is tuned again)."""
    entry = cached.get(key)
    plan = entry.get("plan") if isinstance(entry, dict) else None
    if isinstance(plan, list) and len(plan) == len(Plan._fields) and all(isinstance(v, int) and v >= 0 for v in plan):
        return Plan(*plan)
    return None
