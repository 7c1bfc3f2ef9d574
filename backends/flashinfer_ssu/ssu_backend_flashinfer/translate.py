"""From the canonical ssu call to FlashInfer's ``selective_state_update`` arguments.

FlashInfer wants per-head A, dt, D and dt_bias as broadcast views with stride 0 over the head
dimension (A (H, P, N), dt (b, [T,] H, P), D and dt_bias (H, P)), a D even when the model has
none, D and dt_bias in dt's dtype (converted once per weight tensor, see :class:`WeightCache`),
and cache rows: which row each batch row reads (the pad id: none, and then FlashInfer writes none
either), and for several tokens or destination slots which rows it writes.

The rows are guarded first (:func:`guarded_rows`): an id outside the cache becomes the pad id
(recorded in the kernel's fault record), and a row with a real slot whose destination is the pad
id, or outside the cache, writes to a sink: the sink row of an allocated state, or the pad slot of
an adopted cache whose pad id names one. They are computed into scratch buffers (no allocation,
no host synchronisation) by one Triton launch where Triton runs (:mod:`.rows_triton`), else by
torch ``out=`` ops, at the first layer of a step, and reused by its other layers while ``slots``
is the same tensor, unmodified; so a CUDA graph should hold whole decode steps (every layer and
the commit), as engines capture them.

:func:`fi_arguments` is a pure function so that a CPU test can check it against the installed
FlashInfer's real signature.
"""

from __future__ import annotations

import time
import weakref
from typing import NamedTuple, Optional

import torch

from ssu import faults, slot_state
from ssu.dtypes import to_torch
from ssu.errors import InputError
from ssu.slot_state import versions


def tie_hdim(problem, dt, A, D, dt_bias, x) -> dict:
    """dt, A, D and dt_bias as FlashInfer's "tie_hdim" views: per head, broadcast with stride 0
    over the head dimension (dt (b, [T,] H, P), A (H, P, N), D and dt_bias (H, P)); given in that
    form already (``Capabilities.tied_inputs``), they pass as they are."""
    H, P, N = problem.nheads, problem.headdim, problem.dstate
    return dict(
        dt=dt if dt.dim() == x.dim() else dt.unsqueeze(-1).expand(*dt.shape, P),
        A=A if A.dim() == 3 else A[:, None, None].expand(H, P, N),
        D=D if D.dim() == 2 else D[:, None].expand(H, P),
        dt_bias=None if dt_bias is None else dt_bias if dt_bias.dim() == 2 else dt_bias[:, None].expand(H, P),
    )


def per_head(t):
    """A per-head parameter given (H,) or expanded (H, P), as (H,)."""
    return t[:, 0] if t.dim() == 2 else t


def fi_arguments(
    problem,
    options,
    state_rows,
    x,
    dt,
    A,
    B,
    C,
    D,
    z,
    dt_bias,
    dt_softplus,
    out,
    read_rows,
    dst_rows,
    seed,
    drafts=None,
) -> dict:
    """Keyword arguments of ``flashinfer.mamba.selective_state_update`` for one call. ``drafts``
    (b-indexed by ``read_rows``, (slots, T, H, P, N)): a speculative step on an adopted cache,
    whose token states go there while the cache is left as it was."""
    kwargs = dict(
        state=state_rows,
        x=x,
        B=B,
        C=C,
        z=z,
        **tie_hdim(problem, dt, A, D, dt_bias, x),
        dt_softplus=dt_softplus,
        state_batch_indices=read_rows,
        pad_slot_id=problem.pad_slot_id,
        out=out,
        algorithm=options.algorithm,
    )
    if drafts is not None:
        kwargs.update(
            intermediate_states_buffer=drafts,
            intermediate_state_indices=read_rows,
            disable_state_update=True,
            cache_steps=x.shape[1],
        )
    elif dst_rows is not None:
        kwargs.update(dst_state_batch_indices=dst_rows)
        if x.dim() == 4:
            kwargs.update(cache_steps=x.shape[1])
    if seed is not None:
        kwargs.update(rand_seed=seed, philox_rounds=options.philox_rounds)
    return kwargs


def row_buffers(problem, dtype, dev) -> dict:
    """Scratch for guarding and computing one step's cache rows with ``out=`` ops."""
    b, T = problem.max_batch, problem.tokens_per_step
    flags = lambda: torch.empty(b, dtype=torch.bool, device=dev)  # noqa: E731
    return dict(
        real=flags(),
        dst_real=flags(),
        tmp=flags(),
        keys=torch.empty(b, dtype=torch.int64, device=dev),
        min_key=torch.empty(1, dtype=torch.int64, device=dev),
        row_keys=torch.arange(b, dtype=torch.int64, device=dev) << 34,
        read=torch.empty(b, dtype=dtype, device=dev),
        dst=torch.empty(b, dtype=dtype, device=dev),
        safe=torch.empty(b, dtype=dtype, device=dev),
        cursor=torch.empty(b, dtype=torch.int32, device=dev),
        base=torch.empty(b, dtype=dtype, device=dev),
        dst_t=torch.empty(b, T, dtype=dtype, device=dev),
        steps=torch.arange(1, T + 1, dtype=torch.int32, device=dev),
        pad=torch.full((), problem.pad_slot_id, dtype=dtype, device=dev),
        zero=torch.zeros((), dtype=dtype, device=dev),
        sink=torch.full((), problem.num_slots, dtype=dtype, device=dev),
        no_fault=torch.full((), faults.NO_FAULT, dtype=torch.int64, device=dev),
    )


def allocate_scratch(problem, options) -> dict:
    """Buffers allocated once per kernel, before any CUDA-graph capture."""
    p = problem
    dev = p.device
    from . import rows_triton

    scratch = {
        "zero_D": {
            dtype: torch.zeros(p.nheads, dtype=dtype, device=dev) for dtype in {torch.float32, to_torch(p.input_dtype)}
        },
        "rows_for": None,
        "triton_rows": rows_triton.usable(p.device_type),
        "rows": {dtype: row_buffers(p, dtype, dev) for dtype in (torch.int32, torch.int64)},
    }
    if options.stochastic_rounding:
        scratch["seed"] = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(dev)
    return scratch


def real_ids(buf, ids, num_slots: int, pad_slot_id: int, out):
    """``out`` = ids naming a slot of the cache (not the pad id), with ``out=`` ops."""
    torch.ge(ids, 0, out=out)
    torch.lt(ids, num_slots, out=buf["tmp"][: ids.shape[0]])
    torch.logical_and(out, buf["tmp"][: ids.shape[0]], out=out)
    torch.ne(ids, pad_slot_id, out=buf["tmp"][: ids.shape[0]])
    return torch.logical_and(out, buf["tmp"][: ids.shape[0]], out=out)


def record_outside(buf, record, ids, real, kind: int, pad_slot_id: int) -> None:
    """Lower the fault record with the rows of ``ids`` that are neither real nor the pad id."""
    b = ids.shape[0]
    bad = buf["tmp"][:b]
    torch.ne(ids, pad_slot_id, out=bad)
    torch.logical_xor(bad, real, out=bad)  # not the pad id and not real (real ids are never the pad id)
    keys = buf["keys"][:b]
    keys.copy_(ids)
    keys.bitwise_and_(0xFFFFFFFF).bitwise_or_(buf["row_keys"][:b]).bitwise_or_(kind << 32)
    torch.where(bad, keys, buf["no_fault"], out=keys)
    torch.amin(keys, 0, keepdim=True, out=buf["min_key"])
    torch.minimum(record, buf["min_key"], out=record)


class Rows(NamedTuple):
    """The cache rows of one step: read (b,), and written (b,) or (b, T), or None (FlashInfer's own)."""

    read: object
    dst: object


def guarded_rows(scratch, problem, state, slots, dst_slots, record) -> Rows:
    """The cache rows a step of ``state`` reads and writes, guarded (see the module docstring)."""
    dst_version = None if dst_slots is None else dst_slots._version
    cached = scratch["rows_for"]
    if (
        cached is not None
        and cached[0] is slots
        and cached[1] == slots._version
        and cached[2] is dst_slots
        and cached[3] == dst_version
        and cached[4] is state
    ):
        return cached[5]
    p = problem
    b = slots.shape[0]
    buf = scratch["rows"][slots.dtype]
    if scratch["triton_rows"]:
        rows = _triton_rows(buf, p, state, slots, dst_slots, record)
        scratch["rows_for"] = (slots, slots._version, dst_slots, dst_version, state, rows)
        return rows
    real = real_ids(buf, slots, p.num_slots, p.pad_slot_id, buf["real"][:b])
    record_outside(buf, record, slots, real, faults.SLOTS, p.pad_slot_id)
    if slot_state.uses_cursor(state):
        rows = _versioned_rows(buf, p, state.buffers["cursor"], slots, real)
    else:
        read = torch.where(real, slots, buf["pad"], out=buf["read"][:b])
        dst = None
        if dst_slots is not None:
            dst_real = real_ids(buf, dst_slots, p.num_slots, p.pad_slot_id, buf["dst_real"][:b])
            record_outside(buf, record, dst_slots, dst_real, faults.DST_SLOTS, p.pad_slot_id)
            sink = buf["pad"] if state.adopted else buf["sink"]
            torch.logical_and(dst_real, real, out=dst_real)
            dst = torch.where(dst_real, dst_slots, sink, out=buf["dst"][:b])
        rows = Rows(read, dst)
    scratch["rows_for"] = (slots, slots._version, dst_slots, dst_version, state, rows)
    return rows


def _triton_rows(buf, problem, state, slots, dst_slots, record) -> Rows:
    """:func:`guarded_rows` in one Triton launch (:mod:`.rows_triton`)."""
    from . import rows_triton

    b = slots.shape[0]
    p = problem
    cursor = state.buffers.get("cursor")
    read = buf["read"][:b]
    if cursor is not None:
        write = buf["dst_t"][:b]
    elif dst_slots is not None:
        write = buf["dst"][:b]
    else:
        write = None
    sink = p.pad_slot_id if state.adopted else p.num_slots
    rows_triton.launch(
        slots,
        dst_slots,
        cursor,
        read,
        write,
        record,
        num_slots=p.num_slots,
        pad_slot_id=p.pad_slot_id,
        pad_read=p.pad_slot_id,
        sink=sink,
        versions=versions(p),
        tokens=buf["dst_t"].shape[1],
    )
    return Rows(read, write)


def _versioned_rows(buf, problem, cursor, slots, real) -> Rows:
    """Rows of a speculative step on an allocated state, seen by FlashInfer as ``(num_slots + 1) *
    K`` rows: read ``slot * K + cursor`` (the pad id for pad rows) and token t's destination
    ``slot * K + (cursor + 1 + t) % K``."""
    K = versions(problem)
    b = slots.shape[0]
    safe = torch.where(real, slots, buf["sink"], out=buf["safe"][:b])
    cur = torch.index_select(cursor, 0, safe, out=buf["cursor"][:b])
    base = torch.mul(safe, K, out=buf["base"][:b])
    read = torch.add(base, cur, out=buf["read"][:b])
    torch.where(real, read, buf["pad"], out=read)
    T = buf["dst_t"].shape[1]
    dst = torch.add(cur.unsqueeze(1), buf["steps"][:T], out=buf["dst_t"][:b, :T])
    dst.remainder_(K).add_(base.unsqueeze(1))
    return Rows(read, dst)


class LayerRows(NamedTuple):
    """What FlashInfer is handed for one layer of a state: the rows it indexes, and the drafts of a
    speculative step on an adopted cache (else None)."""

    rows: object
    drafts: object


def layer_rows(state) -> tuple:
    """Per layer, FlashInfer's view of the state (computed once per state, kept in its record)."""
    if state.record is None:
        p = state.problem
        if state.adopted:
            drafts = state.buffers.get("draft")
            state.record = tuple(
                LayerRows(cache, None if drafts is None else drafts[layer]) for layer, cache in enumerate(state.cache)
            )
        else:
            ssm = state.buffers["ssm"]
            S1, K = p.num_slots + 1, versions(p)
            state.record = tuple(
                LayerRows(ssm[layer].view(S1 * K, p.nheads, p.headdim, p.dstate), None)
                for layer in range(state.num_layers)
            )
    return state.record


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


NO_SINK = (
    "dst_slots: backend 'flashinfer' writes a row's state wherever its destination points, so a row whose "
    "destination is the pad id needs a sink row; an adopted cache has none unless the pad id names a slot of "
    "it. Open the kernel with Problem(pad_slot_id=<a reserved slot>, e.g. 0 for a null block, as vLLM does), "
    "or step without dst_slots"
)


def make_step(ctx):
    """The step callable of one kernel."""
    from flashinfer.mamba import selective_state_update

    p = ctx.problem
    options = ctx.options
    scratch = ctx.scratch
    zero_D = scratch["zero_D"]
    seed = scratch.get("seed")
    record = ctx.faults
    converted = WeightCache()
    pad_in_cache = p.pad_in_cache

    def step(
        state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0, dst_slots=None
    ):
        if out is None:
            out = torch.empty_like(x)
        if dst_slots is not None and state.adopted and not pad_in_cache:
            raise InputError(NO_SINK)
        weight = dt.dtype
        D = zero_D[weight] if D is None else (D if D.dtype == weight else converted(per_head(D), weight))
        if dt_bias is not None and dt_bias.dtype != weight:
            dt_bias = converted(per_head(dt_bias), weight)
        target = layer_rows(state)[layer]
        rows = guarded_rows(scratch, p, state, slots, dst_slots, record)
        selective_state_update(
            **fi_arguments(
                p,
                options,
                target.rows,
                x,
                dt,
                A,
                B,
                C,
                D,
                z,
                dt_bias,
                dt_softplus,
                out,
                rows.read,
                rows.dst,
                seed,
                target.drafts,
            )
        )
        if seed is not None:
            seed.add_(1)
        return out

    return step


def commit(ctx, state, slots, num_accepted) -> None:
    """The cursor move of an allocated state, or the draft copy of an adopted one: Triton launches
    where Triton runs (:mod:`ssu.slot_kernels`), torch ops otherwise (:mod:`ssu.slot_state`)."""
    p = ctx.problem
    if ctx.scratch["triton_rows"]:
        from ssu import slot_kernels

        if slot_state.uses_cursor(state):
            slot_kernels.commit(
                state.buffers["cursor"],
                slots,
                num_accepted,
                ctx.faults,
                pad_slot_id=p.pad_slot_id,
                num_slots=p.num_slots,
                versions=versions(p),
            )
        else:
            for layer, cache in enumerate(state.cache):
                slot_kernels.copy_drafts(
                    cache,
                    state.buffers["draft"][layer],
                    slots,
                    num_accepted,
                    ctx.faults,
                    pad_slot_id=p.pad_slot_id,
                    num_slots=p.num_slots,
                    record=layer == 0,
                )
    else:
        slot_state.commit(state, slots, num_accepted, ctx.faults)
    ctx.scratch["rows_for"] = None  # the next step recomputes its cache rows


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

    from ssu.inputs import step_inputs
    from ssu.records import Context

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
