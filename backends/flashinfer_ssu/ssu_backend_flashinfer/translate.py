"""From the canonical ssu call to FlashInfer's ``selective_state_update`` arguments.

FlashInfer wants per-head A, dt, D and dt_bias as broadcast views with stride 0 over the head
dimension (A (H, P, N), dt (b, [T,] H, P), D and dt_bias (H, P)), a D even when the model has
none, D and dt_bias in dt's dtype (converted once per weight tensor, see :class:`WeightCache`), and, for several tokens, destination rows per token.
:func:`fi_arguments` is a pure function so that a CPU test can check it against the installed
FlashInfer's real signature.
"""

from __future__ import annotations

import time
import weakref

import torch

from ssu.dtypes import to_torch
from ssu import slot_state
from ssu.slot_state import versions


def tie_hdim(problem, dt, A, D, dt_bias) -> dict:
    """dt, A, D and dt_bias as FlashInfer's "tie_hdim" views: per head, broadcast with stride 0
    over the head dimension (dt (b, [T,] H, P), A (H, P, N), D and dt_bias (H, P))."""
    H, P, N = problem.nheads, problem.headdim, problem.dstate
    return dict(dt=dt.unsqueeze(-1).expand(*dt.shape, P),
                A=A[:, None, None].expand(H, P, N),
                D=D[:, None].expand(H, P),
                dt_bias=None if dt_bias is None else dt_bias[:, None].expand(H, P))


def fi_arguments(problem, options, state_rows, x, dt, A, B, C, D, z, dt_bias, dt_softplus, out, read_rows,
                 dst_rows, seed) -> dict:
    """Keyword arguments of ``flashinfer.mamba.selective_state_update`` for one call."""
    kwargs = dict(
        state=state_rows,
        x=x,
        B=B,
        C=C,
        z=z,
        **tie_hdim(problem, dt, A, D, dt_bias),
        dt_softplus=dt_softplus,
        state_batch_indices=read_rows,
        pad_slot_id=problem.pad_slot_id,
        out=out,
        algorithm=options.algorithm,
    )
    if dst_rows is not None:
        kwargs.update(dst_state_batch_indices=dst_rows, cache_steps=x.shape[1])
    if seed is not None:
        kwargs.update(rand_seed=seed, philox_rounds=options.philox_rounds)
    return kwargs


def allocate_scratch(problem, options) -> dict:
    """Buffers allocated once per kernel, before any CUDA-graph capture."""
    p = problem
    dev = p.device
    scratch = {"zero_D": {dtype: torch.zeros(p.nheads, dtype=dtype, device=dev)
                          for dtype in {torch.float32, to_torch(p.input_dtype)}},
               "indices_for": None}
    if options.stochastic_rounding:
        scratch["seed"] = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(dev)
    if p.speculative:
        B, T = p.max_batch, p.tokens_per_step
        scratch["rows"] = {
            dtype: dict(valid=torch.empty(B, dtype=torch.bool, device=dev),
                        safe=torch.empty(B, dtype=dtype, device=dev),
                        cursor=torch.empty(B, dtype=torch.int32, device=dev),
                        read=torch.empty(B, dtype=dtype, device=dev),
                        base=torch.empty(B, dtype=dtype, device=dev),
                        dst=torch.empty(B, T, dtype=dtype, device=dev),
                        steps=torch.arange(1, T + 1, dtype=torch.int32, device=dev),
                        pad=torch.full((), p.pad_slot_id, dtype=dtype, device=dev),
                        sink=torch.full((), p.num_slots, dtype=dtype, device=dev))
            for dtype in (torch.int32, torch.int64)}
    return scratch


def speculative_rows(scratch, problem, cursor, slots, tokens: int):
    """Cache rows of a speculative step: read row ``slot*K + cursor`` (pad id for pad rows) and
    destination rows ``slot*K + (cursor + 1 + t) % K``. Written into scratch buffers with
    ``out=`` ops (no allocation, no host sync); computed once per step (reused by every layer
    until ``commit``)."""
    if scratch["indices_for"] is slots:
        b = slots.shape[0]
        buf = scratch["rows"][slots.dtype]
        return buf["read"][:b], buf["dst"][:b, :tokens]
    K = versions(problem)
    b = slots.shape[0]
    buf = scratch["rows"][slots.dtype]
    valid = torch.ne(slots, problem.pad_slot_id, out=buf["valid"][:b])
    safe = torch.where(valid, slots, buf["sink"], out=buf["safe"][:b])
    cur = torch.index_select(cursor, 0, safe, out=buf["cursor"][:b])
    base = torch.mul(safe, K, out=buf["base"][:b])
    read = torch.add(base, cur, out=buf["read"][:b])
    torch.where(valid, read, buf["pad"], out=read)
    dst = torch.add(cur.unsqueeze(1), buf["steps"][:tokens], out=buf["dst"][:b, :tokens])
    dst.remainder_(K).add_(base.unsqueeze(1))
    scratch["indices_for"] = slots
    return read, dst


class WeightCache:
    """FlashInfer needs D and dt_bias in dt's dtype. Per-head weights given in another dtype are
    converted once per tensor (and again only if modified in place), not once per call."""

    def __init__(self) -> None:
        self._entries: dict = {}

    def __call__(self, tensor, dtype):
        key = (id(tensor), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            return entry[2]
        result = tensor.to(dtype)
        self._entries = {k: e for k, e in self._entries.items() if e[0]() is not None}  # forget dead weights
        self._entries[key] = (weakref.ref(tensor), tensor._version, result)
        return result


def make_step(ctx):
    """The step callable of one kernel."""
    from flashinfer.mamba import selective_state_update

    p = ctx.problem
    options = ctx.options
    scratch = ctx.scratch
    zero_D = scratch["zero_D"]
    seed = scratch.get("seed")
    S, K, H, P, N = p.num_slots, versions(p), p.nheads, p.headdim, p.dstate
    speculative = p.speculative
    converted = WeightCache()

    def step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0):
        if out is None:
            out = torch.empty_like(x)
        weight = dt.dtype
        D = zero_D[weight] if D is None else (D if D.dtype == weight else converted(D, weight))
        if dt_bias is not None and dt_bias.dtype != weight:
            dt_bias = converted(dt_bias, weight)
        ssm = state.buffers["ssm"][layer]
        if speculative:
            read, dst = speculative_rows(scratch, p, state.buffers["cursor"], slots, x.shape[1])
            rows = ssm.view(S * K, H, P, N)
        else:
            read, dst, rows = slots, None, ssm.view(S, H, P, N)
        selective_state_update(**fi_arguments(p, options, rows, x, dt, A, B, C, D, z, dt_bias, dt_softplus, out,
                                              read, dst, seed))
        if seed is not None:
            seed.add_(1)
        return out

    return step


def module_is_cached(problem, options, index_dtype: str):
    """Whether FlashInfer's JIT cache already holds the module this problem needs (None: unknown,
    e.g. after a FlashInfer API change)."""
    try:
        from flashinfer.jit import mamba as jit_mamba

        major, _ = torch.cuda.get_device_capability(problem.device)
        gen = (jit_mamba.gen_selective_state_update_sm100_module if major >= 10 else
               jit_mamba.gen_selective_state_update_sm90_module if major >= 9 else
               jit_mamba.gen_selective_state_update_module)
        dtype = to_torch(problem.input_dtype)
        spec = gen(to_torch(problem.state_dtype), dtype, dtype, torch.float32, to_torch(index_dtype), None,
                   problem.headdim, problem.dstate, problem.tokens_per_step if problem.speculative else 1,
                   torch.int32, torch.int64, options.philox_rounds if options.stochastic_rounding else 0)
        return bool(spec.is_compiled)
    except Exception:
        return None


def warm_module(ctx, index_dtype: str) -> tuple:
    """Run one step on two scratch rows (never the live state) so that FlashInfer builds, or loads
    from its JIT cache, the module for this problem and ``index_dtype``. Returns (was it cached,
    a readable name of the module)."""
    import attrs

    from ssu.inputs import step_inputs
    from ssu.records import Context

    p = ctx.problem
    name = (f"state={p.state_dtype} input={p.input_dtype} dt={p.input_dtype} index={index_dtype} "
            f"T={p.tokens_per_step}{' stochastic-rounding' if ctx.options.stochastic_rounding else ''}")
    cached = module_is_cached(p, ctx.options, index_dtype)
    small = attrs.evolve(p, num_slots=2, max_batch=min(2, p.max_batch))
    state = slot_state.allocate(small, 1, "flashinfer")
    step = make_step(Context(small, ctx.options, ctx.spec, allocate_scratch(small, ctx.options)))
    slots = torch.tensor([0, p.pad_slot_id][: small.max_batch], dtype=to_torch(index_dtype), device=p.device)
    t0 = time.perf_counter()
    step(state, **step_inputs(small, slots, torch.Generator().manual_seed(0)).kwargs())
    torch.cuda.synchronize()
    if cached is None:
        cached = time.perf_counter() - t0 < 3.0
    return cached, name

