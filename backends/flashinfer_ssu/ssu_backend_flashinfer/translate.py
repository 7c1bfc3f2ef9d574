"""From the canonical ssu call to FlashInfer's ``selective_state_update`` arguments.

FlashInfer wants per-head A, dt, D and dt_bias as broadcast views with stride 0 over the head
dimension (A (H, P, N), dt (b, [T,] H, P), D and dt_bias (H, P)), a D even when the model has
none, D and dt_bias in dt's dtype (converted once per weight tensor, see :class:`WeightCache`),
and cache rows: which row each batch row reads (the pad id: none, and then FlashInfer writes none
either), and for several tokens or destination slots which rows it writes.

The cache rows come from :mod:`.rows`.

:func:`fi_arguments` is a pure function so that a CPU test can check it against the installed
FlashInfer's real signature.
"""

from __future__ import annotations

import weakref

import torch

from ssu.state import slot_state
from ssu.contract.errors import InputError
from ssu.state.slot_state import versions

from .rows import flashinfer_pad, guarded_rows, layer_rows


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
        pad_slot_id=flashinfer_pad(problem),
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
    where Triton runs (:mod:`ssu.state.slot_kernels`), torch ops otherwise (:mod:`ssu.state.slot_state`)."""
    p = ctx.problem
    if ctx.scratch["triton_rows"]:
        from ssu.state import slot_kernels

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
