"""The versioned-slot state layout, shared by the ``reference`` and ``triton`` backends.

Buffers of a :class:`~ssu.State` in this layout:

``ssm``     (L, num_slots, K, H, P, N) in the cache dtype. K = 1 without speculation; with
            speculation K = T + 1 versions per slot.
``cursor``  (num_slots + 1,) int32, speculative only: which version of each slot holds its logical
            state (shared by every layer of the group). The extra last entry absorbs pad rows, so
            commit needs no host-side filtering.

A speculative step reads version ``c = cursor[slot]`` once and writes token ``t``'s state to
version ``(c + 1 + t) % K``; it never touches version ``c``, so the logical state does not change
until commit. ``commit`` then only moves the cursor: ``cursor[slot] = (c + num_accepted) % K``,
a few bytes per sequence and no state copy. Everything here is plain torch indexing: device
agnostic, and ``commit`` is CUDA-graph capturable (no host synchronisation).
"""

from __future__ import annotations

from .dtypes import to_torch
from .records import State


def versions(problem) -> int:
    """K: how many versions of each slot's state the layout keeps."""
    return problem.tokens_per_step + 1 if problem.speculative else 1


def allocate(problem, num_layers: int, backend: str) -> State:
    import torch

    p = problem
    ssm = torch.zeros(num_layers, p.num_slots, versions(p), p.nheads, p.headdim, p.dstate,
                      dtype=to_torch(p.state_dtype), device=p.device)
    buffers = {"ssm": ssm}
    if p.speculative:
        buffers["cursor"] = torch.zeros(p.num_slots + 1, dtype=torch.int32, device=p.device)
    return State(backend, p, num_layers, buffers)


def current_version(state: State, slots):
    """Version index holding the logical state of each slot (int64, like ``slots``)."""
    import torch

    if "cursor" not in state.buffers:
        return torch.zeros_like(slots, dtype=torch.int64)
    return state.buffers["cursor"][slots.long()].long()


def read(state: State, slots, layer: int):
    """Logical states of ``slots`` (no pad ids) as fp32 (len(slots), H, P, N)."""
    idx = slots.long()
    return state.buffers["ssm"][layer, idx, current_version(state, slots)].float()


def write(state: State, slots, values, layer: int) -> None:
    """Install ``values`` as the logical states of ``slots`` (no pad ids), rounded to the cache."""
    ssm = state.buffers["ssm"]
    idx = slots.long()
    ssm[layer, idx, current_version(state, slots)] = values.to(device=ssm.device, dtype=ssm.dtype)


def commit(state: State, slots, num_accepted) -> None:
    """Move each slot's cursor to the version after its ``num_accepted`` tokens (all layers)."""
    import torch

    cursor = state.buffers["cursor"]
    p = state.problem
    sink = p.num_slots
    idx = torch.where(slots == p.pad_slot_id, torch.full_like(slots, sink), slots).long()
    new = (cursor[idx] + num_accepted.to(cursor.dtype)) % versions(p)
    cursor.index_put_((idx,), new.to(cursor.dtype))


# Hook implementations for backends that use this layout. A backend's plugin module imports the
# ones it does not override, e.g. ``from ssu.slot_state import ssu_read_state, ssu_write_state``;
# pluggy registers them as that backend's own hooks.
from .hookspecs import hookimpl  # noqa: E402


@hookimpl
def ssu_allocate_state(ctx, num_layers):
    """The layout above for ``ctx.problem``, owned by backend ``ctx.spec.name``."""
    return allocate(ctx.problem, num_layers, ctx.spec.name)


@hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    """Cursor move with torch ops (no state copy)."""
    commit(state, slots, num_accepted)


@hookimpl
def ssu_read_state(ctx, state, slots, layer):
    return read(state, slots, layer)


@hookimpl
def ssu_write_state(ctx, state, slots, values, layer):
    write(state, slots, values, layer)
