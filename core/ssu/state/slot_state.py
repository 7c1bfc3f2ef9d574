"""The versioned-slot state layout shared by the ``reference``, ``triton`` and ``flashinfer``
backends, for states they allocate and for engine caches they adopt.

Allocated (:func:`allocate`), buffers of the :class:`~ssu.State`:

``ssm``     (L, num_slots + 1, K, H, P, N) in the cache dtype. K = 1 without speculation; with
            speculation K = T + 1 versions per slot. Row ``num_slots`` is a sink: a backend may
            send there the writes of rows that name no destination (its values mean nothing).
``cursor``  (num_slots + 1,) int32, speculative only: which version of each slot holds its logical
            state (shared by every layer of the group). The extra last entry absorbs pad rows, so
            commit needs no host-side filtering.
``scale``   (L, num_slots + 1, K, H, P) fp32, quantised state dtypes only: each row's scale
            (:mod:`ssu.state.quant`), versioned with the values.

A speculative step reads version ``c = cursor[slot]`` once and writes token ``t``'s state to
version ``(c + 1 + t) % K``; it never touches version ``c``, so the logical state does not change
until commit. ``commit`` then only moves the cursor: ``cursor[slot] = (c + num_accepted) % K``,
a few bytes per sequence and no state copy.

Adopted (:func:`adopt`): ``State.cache`` holds the engine's tensor of each layer, (num_slots, H,
P, N), any slot stride; steps read and write it in place. With speculation the step writes token
``t``'s state to ``draft`` (L, num_slots, T, H, P, N) instead, and ``commit`` copies draft
``num_accepted - 1`` into the engine's tensor: the engine's cache is current after every step
(one token) and every commit (speculative), so ``sync`` has nothing to do.

``State.views[layer]`` is a :class:`LayerViews`: the (slots, versions, H, P, N) tensors a step
reads from and writes to, so that every backend indexes both layouts the same way; for a quantised
state ``State.scales[layer]`` is the same for the (slots, versions, H, P) row scales (an adopted
cache's scales are the engine's own tensors, drafts get theirs beside them). Everything
here is plain torch: device agnostic, and ``commit`` is CUDA-graph capturable (no host
synchronisation).
"""

from __future__ import annotations

from typing import NamedTuple

from . import faults, quant
from ..contract.dtypes import to_torch
from ..contract.records import State


class LayerViews(NamedTuple):
    """Where one layer's step reads states from and writes them to, as (slots, versions, H, P, N)."""

    read: object
    write: object


def versions(problem) -> int:
    """K: how many versions of each slot's state an allocated state keeps."""
    return problem.tokens_per_step + 1 if problem.speculative else 1


def uses_cursor(state: State) -> bool:
    """Whether the state's speculative versions are found through ``cursor`` (allocated states)."""
    return "cursor" in state.buffers


def allocate(problem, num_layers: int, backend: str) -> State:
    """Allocate the versioned-slot state of ``num_layers`` layers: every slot, a sink row, the cursors."""
    import torch

    p = problem
    ssm = torch.zeros(
        num_layers,
        p.num_slots + 1,
        versions(p),
        p.nheads,
        p.headdim,
        p.dstate,
        dtype=to_torch(p.state_dtype),
        device=p.device,
    )
    buffers = {"ssm": ssm}
    if p.speculative:
        buffers["cursor"] = torch.zeros(p.num_slots + 1, dtype=torch.int32, device=p.device)
    views = [LayerViews(ssm[layer], ssm[layer]) for layer in range(num_layers)]
    scales = []
    if p.quantized:
        scale = buffers["scale"] = torch.zeros(ssm.shape[:-1], dtype=torch.float32, device=p.device)
        scales = [LayerViews(scale[layer], scale[layer]) for layer in range(num_layers)]
    return State(backend, p, num_layers, buffers, views=views, scales=scales)


def adopt(problem, cache: tuple, backend: str, scales: tuple = ()) -> State:
    """The engine's per-layer tensors (checked by the core) as a state, a quantised cache's row
    scales with them; speculative drafts (and their scales) beside."""
    import torch

    p = problem
    buffers = {}
    own = [t.unsqueeze(1) for t in cache]
    own_scales = [t.unsqueeze(1) for t in scales]
    scale_views = []
    if p.speculative:
        shape = (len(cache), p.num_slots, p.tokens_per_step, p.nheads, p.headdim, p.dstate)
        draft = buffers["draft"] = torch.zeros(shape, dtype=to_torch(p.state_dtype), device=p.device)
        views = [LayerViews(read, draft[layer]) for layer, read in enumerate(own)]
        if p.quantized:
            draft_scale = buffers["draft_scale"] = torch.zeros(shape[:-1], dtype=torch.float32, device=p.device)
            scale_views = [LayerViews(read, draft_scale[layer]) for layer, read in enumerate(own_scales)]
    else:
        views = [LayerViews(read, read) for read in own]
        scale_views = [LayerViews(read, read) for read in own_scales]
    return State(backend, p, len(cache), buffers, cache=cache, views=views, scales=scale_views)


def current_version(state: State, slots):
    """Version index holding the logical state of each slot (int64, like ``slots``)."""
    import torch

    if not uses_cursor(state):
        return torch.zeros_like(slots, dtype=torch.int64)
    return state.buffers["cursor"][slots.long()].long()


def read(state: State, slots, layer: int):
    """Logical states of ``slots`` (real slots only) as fp32 (len(slots), H, P, N)."""
    idx = slots.long()
    version = current_version(state, slots)
    values = state.views[layer].read[idx, version]
    if state.problem.quantized:
        return quant.dequantize(values, state.scales[layer].read[idx, version])
    return values.float()


def write(state: State, slots, values, layer: int) -> None:
    """Install ``values`` as the logical states of ``slots`` (real, distinct), rounded to the cache
    (quantised, for an 8-bit cache)."""
    view = state.views[layer].read
    idx = slots.long()
    version = current_version(state, slots)
    values = values.to(device=view.device)
    if state.problem.quantized:
        q, scale = quant.quantize(values, state.problem.state_dtype)
        view[idx, version] = q
        state.scales[layer].read[idx, version] = scale
    else:
        view[idx, version] = values.to(dtype=view.dtype)


def real_rows(problem, slots):
    """Boolean mask of the rows of ``slots`` that name a slot of the cache (not the pad id)."""
    return (slots >= 0) & (slots < problem.num_slots) & (slots != problem.pad_slot_id)


def commit_rows(problem, slots, num_accepted, record=None):
    """The rows a commit moves (a real slot, 1 <= num_accepted <= T); the others are recorded in
    ``record`` (a kernel's fault record) when given."""
    T = problem.tokens_per_step
    real = real_rows(problem, slots)
    counted = (num_accepted >= 1) & (num_accepted <= T)
    if record is not None:
        faults.record(record, faults.outside(slots, problem.num_slots, problem.pad_slot_id), slots, faults.SLOTS)
        faults.record(record, real & ~counted, num_accepted, faults.NUM_ACCEPTED)
    return real & counted


def commit(state: State, slots, num_accepted, record=None) -> None:
    """Keep each slot's first ``num_accepted`` tokens of the last step, for every layer: the
    cursor move of an allocated state, the draft copy of an adopted one."""
    p = state.problem
    moved = commit_rows(p, slots, num_accepted, record)
    if uses_cursor(state):
        _move_cursors(state, slots, num_accepted, moved)
    else:
        for layer in range(state.num_layers):
            for cache, drafts in draft_pairs(state, layer):
                copy_drafts(_bits(cache), _bits(drafts), slots, num_accepted, moved)


def draft_pairs(state: State, layer: int) -> list:
    """``(engine tensor, drafts)`` a commit copies accepted drafts between, for one layer of an
    adopted speculative state: the cache, and an 8-bit cache's row scales."""
    pairs = [(state.cache[layer], state.buffers["draft"][layer])]
    if state.problem.quantized:
        pairs.append((state.scales[layer].read[:, 0], state.buffers["draft_scale"][layer]))
    return pairs


def _bits(t):
    """An 8-bit float tensor as its bytes (torch copies and selects those on every device), any
    other tensor as it is: a draft is copied bit for bit."""
    import torch

    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _move_cursors(state: State, slots, num_accepted, moved) -> None:
    import torch

    cursor = state.buffers["cursor"]
    sink = state.problem.num_slots
    idx = torch.where(moved, slots, torch.full_like(slots, sink)).long()
    new = (cursor[idx] + num_accepted.to(cursor.dtype)) % versions(state.problem)
    cursor.index_put_((idx,), new.to(cursor.dtype))


def copy_drafts(cache, draft, slots, num_accepted, moved) -> None:
    """``cache[slot] = draft[slot, num_accepted - 1]`` for the rows ``moved``, with torch ops and no
    host synchronisation: the other rows repeat the first moved row's copy (the same slot and the
    same values, so the repeated writes agree), or rewrite slot 0 with its own value when no row
    moves."""
    import torch

    first = torch.argmax(moved.to(torch.int32))
    idx = torch.where(moved, slots, slots[first]).long()
    pick = torch.where(moved, num_accepted, num_accepted[first]).long().clamp(1, draft.shape[1]) - 1
    any_moved = moved.any()
    idx = torch.where(any_moved, idx, torch.zeros_like(idx))
    values = draft[idx.clamp(0, draft.shape[0] - 1), pick]
    values = torch.where(any_moved, values, cache[idx])
    cache.index_copy_(0, idx, values)


# Hook implementations for backends that use this layout. A backend's plugin module imports the
# ones it does not override, e.g. ``from ssu.state.slot_state import ssu_read_state, ssu_write_state``;
# pluggy registers them as that backend's own hooks.
from ..contract.hookspecs import hookimpl  # noqa: E402


@hookimpl
def ssu_allocate_state(ctx, num_layers):
    """The layout above for ``ctx.problem``, owned by backend ``ctx.spec.name``."""
    return allocate(ctx.problem, num_layers, ctx.spec.name)


@hookimpl
def ssu_adopt_state(ctx, cache, scales):
    """The engine's tensors (and a quantised cache's scales) in place, speculative drafts beside."""
    return adopt(ctx.problem, cache, ctx.spec.name, scales)


@hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    """Cursor move or draft copy with torch ops; refused rows recorded in ``ctx.faults``."""
    commit(state, slots, num_accepted, ctx.faults)


@hookimpl
def ssu_read_state(ctx, state, slots, layer):
    """Hook: copy the current states of ``slots`` out of one layer."""
    return read(state, slots, layer)


@hookimpl
def ssu_write_state(ctx, state, slots, values, layer):
    """Hook: overwrite the current states of ``slots`` in one layer."""
    write(state, slots, values, layer)
