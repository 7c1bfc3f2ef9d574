"""FlashInfer's JIT modules: whether the one a problem needs is built, and building it.

FlashInfer compiles one module per (state, input, index dtype, P, N, T, rounding) on first use,
which takes a minute or more; warmup builds it on scratch rows, never the live state.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ssu.state import faults, slot_state
from ssu.contract.dtypes import to_torch

from .scratch import allocate_scratch
from .translate import make_step


def module_is_cached(problem, options, index_dtype: str) -> Optional[bool]:
    """Whether FlashInfer's JIT cache already holds the module this problem needs (None: unknown,
    e.g. after a FlashInfer API change)."""
    try:
        from flashinfer.jit import mamba as jit_mamba

        major, _ = torch.cuda.get_device_capability(problem.device)
        gen = (
            jit_mamba.gen_selective_state_update_sm100_module
            if major >= 10
            else jit_mamba.gen_selective_state_update_sm90_module
            if major >= 9
            else jit_mamba.gen_selective_state_update_module
        )
        dtype = to_torch(problem.input_dtype)
        spec = gen(
            to_torch(problem.state_dtype),
            dtype,
            dtype,
            torch.float32,
            to_torch(index_dtype),
            None,
            problem.headdim,
            problem.dstate,
            problem.tokens_per_step if problem.speculative else 1,
            torch.int32,
            torch.int64,
            options.philox_rounds if options.stochastic_rounding else 0,
        )
        return bool(spec.is_compiled)
    except Exception:
        return None


def warm_module(ctx, index_dtype: str) -> tuple:
    """Run one step on two scratch rows (never the live state) so that FlashInfer builds, or loads
    from its JIT cache, the module for this problem and ``index_dtype``. Returns (was it cached,
    a readable name of the module)."""
    import attrs

    from ssu.checking.inputs import step_inputs
    from ssu.contract.records import Context

    p = ctx.problem
    name = (
        f"state={p.state_dtype} input={p.input_dtype} dt={p.input_dtype} index={index_dtype} "
        f"T={p.tokens_per_step}{' stochastic-rounding' if ctx.options.stochastic_rounding else ''}"
    )
    cached = module_is_cached(p, ctx.options, index_dtype)
    small = attrs.evolve(p, num_slots=2, max_batch=min(2, p.max_batch), pad_slot_id=-1, engine_state=False)
    state = slot_state.allocate(small, 1, "flashinfer")
    step = make_step(
        Context(small, ctx.options, ctx.spec, allocate_scratch(small, ctx.options), faults=faults.allocate(p.device))
    )
    slots = torch.tensor([0, -1][: small.max_batch], dtype=to_torch(index_dtype), device=p.device)
    t0 = time.perf_counter()
    step(state, **step_inputs(small, slots, torch.Generator().manual_seed(0)).kwargs())
    torch.cuda.synchronize()
    if cached is None:
        cached = time.perf_counter() - t0 < 3.0
    return cached, name


def warm_engine_calls(ctx) -> list:
    """Run each engine call form of the problem once on scratch states (never the live one), so that
    FlashInfer builds, or loads from its JIT cache, their modules: the packed form's (T tokens, int32
    offsets and counts) and the verify form's (T tokens), for each index dtype of
    ``warmup_index_dtypes``. Returns a readable name of each."""
    import attrs

    from ssu.checking import engine_harness
    from ssu.contract.records import Context

    from .engine_forms import make_packed, make_verify

    p = ctx.problem
    small = attrs.evolve(p, num_slots=3 * p.tokens_per_step + 1, max_batch=2, pad_slot_id=-1, engine_state=False)
    scratch = allocate_scratch(small, ctx.options)
    names = []
    for index_dtype in ctx.options.warmup_index_dtypes:
        dtype = to_torch(index_dtype)
        small_ctx = Context(small, ctx.options, ctx.spec, scratch, faults=faults.allocate(p.device))
        state = slot_state.allocate(small, 1, "flashinfer")
        gen = torch.Generator().manual_seed(0)
        if "packed" in p.engine_calls:
            call = engine_harness.draw_packed(
                small, gen, sequences=2, lengths=[p.tokens_per_step, 1], index_dtype=dtype
            )
            make_packed(small_ctx)(state, **call.kwargs())
            names.append(f"packed T={p.tokens_per_step} index={index_dtype}")
        if "verify" in p.engine_calls:
            call = engine_harness.draw_verify(small, gen, rows=2, buffer_dtype=p.state_dtype, index_dtype=dtype)
            make_verify(small_ctx)(state, **call.kwargs())
            names.append(f"verify T={p.tokens_per_step} index={index_dtype}")
    torch.cuda.synchronize()
    return names
