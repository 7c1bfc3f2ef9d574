"""Warmup: FlashInfer's JIT build (minutes per module: progress is printed), then FlashInfer's
autotuning of ``checkpointing_ssu`` with one maximum-batch step, saved to the tuning cache file.

Both run on a private two-slot state made for the purpose, never on the live state: every slot,
ring row and cursor of the engine's state is untouched. FlashInfer profiles tactics on its own
compact arena (batch + 1 rows), so the results do not depend on the cache size and apply to the
live state; they are keyed by problem, batch bucket and GPU.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager

import attrs
import torch

from ssu.contract.dtypes import to_torch
from ssu.checking.inputs import step_inputs

from . import layout
from .translate import allocate_scratch, cs_arguments

OP = "checkpointing_ssu"
BUILD_SECONDS = 260  # one checkpointing module on the H200 development machine


def log(message: str) -> None:
    """Print one line to stderr, prefixed with the backend's name."""
    print(f"[ssu flashinfer-replayssm] {message}", file=sys.stderr, flush=True)


@contextmanager
def progress(what: str, every: float = 30.0):
    """Print a line every ``every`` seconds while the block runs (JIT builds take minutes)."""
    done = threading.Event()
    t0 = time.perf_counter()

    def tick():
        while not done.wait(every):
            log(f"{what}: still running ({time.perf_counter() - t0:.0f} s)")

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def synchronize(problem) -> None:
    """Wait for the problem's GPU (no-op elsewhere), so that timings and errors land where they belong."""
    if problem.device_type == "cuda":
        torch.cuda.synchronize(problem.device)


def module_name(problem, options, index_dtype: str) -> str:
    """The JIT module a problem needs, described by the template parameters it is built with."""
    p = problem
    return (
        f"state={p.state_dtype} input={p.input_dtype} dt={p.input_dtype} index={index_dtype} P={p.headdim} "
        f"N={p.dstate} heads/group={p.heads_per_group} groups={p.ngroups} T={p.tokens_per_step} "
        f"max_window={options.max_window}"
    )


def private_call(ctx, batch: int, index_dtype, algorithm: str):
    """A call of ``checkpointing_ssu`` on a fresh private state (one real slot and the pad slot)
    with ``batch`` rows, all of them pad rows except the first: returns a zero-argument callable."""
    from flashinfer.mamba import checkpointing_ssu

    p = ctx.problem
    small = attrs.evolve(p, num_slots=1, max_batch=batch, pad_slot_id=-1)  # its own pad slot, past the one real one
    options = attrs.evolve(ctx.options, algorithm=algorithm)
    state = layout.allocate(small, 1, options.ring_length(p.tokens_per_step), "private")
    scratch = allocate_scratch(small, options)
    rows = torch.full((batch,), 1, dtype=to_torch(index_dtype), device=p.device)  # the pad slot
    rows[0] = 0
    gen = torch.Generator().manual_seed(0)
    inputs = step_inputs(attrs.evolve(small, speculative=True), rows, gen, tokens=p.tokens_per_step)
    out = torch.empty_like(inputs.x)
    kwargs = cs_arguments(
        small,
        options,
        state.buffers,
        0,
        inputs.x,
        inputs.dt,
        inputs.A,
        inputs.B,
        inputs.C,
        inputs.D,
        inputs.z,
        inputs.dt_bias.float(),
        True,
        out,
        rows,
        scratch["trio"],
    )
    return lambda: checkpointing_ssu(**kwargs)


def build(ctx, index_dtype: str) -> float:
    """JIT-compile (or load from FlashInfer's JIT cache) the module for ``index_dtype``; seconds."""
    name = module_name(ctx.problem, ctx.options, index_dtype)
    call = private_call(ctx, 1, index_dtype, "monolith")
    log(f"module {name}: loading or compiling (a fresh compile takes about {BUILD_SECONDS} s on an H200 machine)")
    t0 = time.perf_counter()
    with progress(f"module {name}"):
        call()
        synchronize(ctx.problem)
    took = time.perf_counter() - t0
    log(f"module {name}: ready ({took:.1f} s)")
    return took


def saved_entries(path) -> int:
    """How many checkpointing_ssu results FlashInfer's tuning file holds (0 if none or unreadable)."""
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return 0
    return sum(OP in key for key in data) if isinstance(data, dict) else 0


@contextmanager
def tactic_failures(keep: int = 3):
    """Collect FlashInfer's reasons for tactics that failed while being profiled (it logs them at
    debug level only) without printing its other debug lines: yields a list of messages."""
    from flashinfer.jit.core import logger

    failures: list = []

    class Capture(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "Skipping tactic" in message and len(failures) < keep:
                failures.append(message[:600])

    level = logger.level
    handler_levels = [(h, h.level) for h in logger.handlers]
    for h, old in handler_levels:
        h.setLevel(max(old, level))  # the existing handlers print what they printed before
    capture = Capture(logging.DEBUG)
    logger.addHandler(capture)
    logger.setLevel(logging.DEBUG)
    getattr(logger, "_cache", {}).clear()  # its level cache: the logger is not in logging's registry
    try:
        yield failures
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
        getattr(logger, "_cache", {}).clear()
        for h, old in handler_levels:
            h.setLevel(old)


def tune(ctx) -> str:
    """FlashInfer's autotuning for ``algorithm = "auto"``: one maximum-batch call inside
    ``flashinfer.autotune(True, cache=...)``, which loads earlier results from the cache file
    (then nothing is re-tuned) and saves new ones. Returns a line saying which happened."""
    import flashinfer
    from flashinfer.autotuner import AutoTuner

    options = ctx.options
    if ctx.problem.device_type != "cuda":
        return f"no tuning on {ctx.problem.device}"
    if options.algorithm != "auto":
        return f"no tuning: algorithm = {options.algorithm!r} pins FlashInfer's kernel"
    if not options.autotune:
        return "no tuning (autotune = false): FlashInfer's built-in rule picks the kernel per call"
    path = options.tuning_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    existed = path.is_file()
    batches = [b for b in options.tuning_batches if b <= ctx.problem.max_batch] or None
    call = private_call(ctx, max(batches) if batches else ctx.problem.max_batch, "int32", "auto")
    stats = AutoTuner.get().stats
    # counts the batch buckets FlashInfer actually profiled (its "total" counter also counts
    # buckets answered from the loaded file)
    before = stats.tuned_op_successful_configs.get(OP)
    t0 = time.perf_counter()
    with progress("autotuning"), tactic_failures() as failures:
        with flashinfer.autotune(True, cache=str(path), tuning_buckets=tuple(batches) if batches else None):
            call()
        synchronize(ctx.problem)
    took = time.perf_counter() - t0
    profiled = stats.tuned_op_successful_configs.get(OP) != before
    ctx.memo["tuned"] = profiled
    which = f"batches {list(batches)}" if batches else f"batches up to {ctx.problem.max_batch}"
    if failures and not profiled:
        return (
            f"FlashInfer could not profile any {OP} tactic for {which} (first failure: {failures[0]}); "
            "steps use FlashInfer's built-in kernel choice, and the next process tries again. If the failure "
            "names a missing source under flashinfer/data/csrc, reinstall flashinfer-python with its data "
            'files; or set autotune = false (and algorithm = "monolith" on Hopper) to skip tuning'
        )
    if profiled:
        saved = saved_entries(path)  # FlashInfer saved on leaving the context (it refuses a foreign file)
        if not saved:
            return (
                f"tuned for {which} in {took:.1f} s, but FlashInfer's tuning file {path} holds no {OP} entry "
                "(FlashInfer does not save over a file from another environment; it logs a warning): the next "
                "process tunes again"
            )
        failed = f"; {len(failures)} tactic(s) failed to profile, first: {failures[0]}" if failures else ""
        entries = "entry" if saved == 1 else "entries"
        return f"tuned for {which} in {took:.1f} s; {saved} {entries} saved to {path}{failed}"
    source = f"loaded from {path}" if existed else "already tuned in this process"
    return f"tuning {source}, nothing re-tuned ({took:.1f} s)"
