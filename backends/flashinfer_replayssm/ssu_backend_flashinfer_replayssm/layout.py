"""The ReplaySSM state of a group of layers, and its logical value (read, write, fold).

Buffers of a :class:`ssu.State` owned by this backend (Ly layers, S slots, L ring rows):

``ssm``         (Ly, S + 1, H, P, N) checkpoint, cache dtype; row S serves pad rows (stays zero)
``x_cache``     (Ly, S + 1, H, L, P) bf16: x of the tokens in the ring
``B_cache``     (Ly, S + 1, G, L, N) bf16: B of the tokens in the ring
``dt_cache``    (Ly, S + 1, H, L) fp32: d = softplus(dt + dt_bias) of the tokens in the ring
``ring_start``  (S + 2,) int32 and ``pnat`` (S + 2,) int32: the cursors of :mod:`.cursors`,
                shared by every layer of the group

The logical state of a slot is its checkpoint advanced by the ``pnat`` tokens of the ring that
start at ``ring_start`` (:func:`replay`, fp32 torch ops). The replay needs each layer's ``A``,
which the step records (a reference, per layer) in the group's :class:`GroupRecord`, the
state's ``record``.
"""

from __future__ import annotations

from typing import Optional

import attrs

from ssu.contract.dtypes import to_torch
from ssu.contract.errors import BackendError
from ssu.contract.records import State


@attrs.define(eq=False)
class GroupRecord:
    """Host-side facts about one state group that the device buffers do not hold: each layer's
    ``A`` (last seen by step) and, between a step and its commit, which layers were stepped with
    which slots (a pending flush has already rewritten those checkpoints)."""

    A: dict = attrs.field(factory=dict)
    pending_layers: set = attrs.field(factory=set)
    pending_slots: Optional[object] = None


def record(state: State) -> GroupRecord:
    """The group's host-side record, kept in ``State.record`` (made at allocation)."""
    return state.record


def allocate(problem, num_layers: int, ring: int, backend: str) -> State:
    """Allocate checkpoints, the per-slot rings of inputs and the cursors for ``num_layers`` layers."""
    import torch

    p = problem
    rows = p.num_slots + 1
    dev = p.device
    inp = to_torch(p.input_dtype)
    buffers = {
        "ssm": torch.zeros(num_layers, rows, p.nheads, p.headdim, p.dstate, dtype=to_torch(p.state_dtype), device=dev),
        "x_cache": torch.zeros(num_layers, rows, p.nheads, ring, p.headdim, dtype=inp, device=dev),
        "B_cache": torch.zeros(num_layers, rows, p.ngroups, ring, p.dstate, dtype=inp, device=dev),
        "dt_cache": torch.zeros(num_layers, rows, p.nheads, ring, dtype=torch.float32, device=dev),
        "ring_start": torch.zeros(p.num_slots + 2, dtype=torch.int32, device=dev),
        "pnat": torch.zeros(p.num_slots + 2, dtype=torch.int32, device=dev),
    }
    return State(backend, problem, num_layers, buffers, record=GroupRecord())


def replay(checkpoint, x_rows, B_rows, d_rows, A, start, count, ring: int, heads_per_group: int):
    """Advance ``checkpoint`` (b, H, P, N) fp32 by ``count[b]`` ring tokens starting at row
    ``start[b]``: s = s * exp(A d) + d x B^T per token, in fp32."""
    import torch

    s = checkpoint.float().clone()
    b = s.shape[0]
    if b == 0:
        return s
    steps = int(count.max().item())
    batch = torch.arange(b, device=s.device)
    A = A.float().to(s.device)
    for i in range(steps):
        row = (start.long() + i) % ring
        x = x_rows[batch, :, row].float()  # (b, H, P)
        Bg = B_rows[batch, :, row].float().repeat_interleave(heads_per_group, dim=1)  # (b, H, N)
        d = d_rows[batch, :, row].float()  # (b, H)
        nxt = s * torch.exp(A * d)[:, :, None, None] + (d[:, :, None] * x)[..., None] * Bg[:, :, None, :]
        live = (i < count).view(b, 1, 1, 1)
        s = torch.where(live, nxt, s)
    return s


def replay_counts(state: State, slots, layer: int, tokens: int, max_window: int):
    """How many ring tokens to replay onto each slot's checkpoint: ``pnat``, or 0 for a slot whose
    pending (uncommitted) step flushed, as that step already wrote the replayed checkpoint."""
    import torch

    count = state.buffers["pnat"][slots.long()]
    rec = state.record
    if rec is not None and layer in rec.pending_layers and rec.pending_slots is not None:
        stepped = torch.isin(slots.long(), rec.pending_slots.long().to(slots.device))
        flushed = stepped & (count + tokens > max_window)
        count = torch.where(flushed, torch.zeros_like(count), count)
    return count


def read(state: State, slots, layer: int, tokens: int, max_window: int):
    """The logical states of ``slots`` in ``layer``: fp32 (len(slots), H, P, N)."""
    p = state.problem
    idx = slots.long()
    buf = state.buffers
    count = replay_counts(state, slots, layer, tokens, max_window)
    checkpoint = buf["ssm"][layer, idx]
    if not bool((count > 0).any()):
        return checkpoint.float()
    A = record(state).A.get(layer)
    if A is None:
        raise BackendError(
            f"backend 'flashinfer-replayssm': layer {layer} has tokens in its ring but no step "
            "of this process recorded its A (needed to replay them); step the layer first"
        )
    return replay(
        checkpoint,
        buf["x_cache"][layer, idx],
        buf["B_cache"][layer, idx],
        buf["dt_cache"][layer, idx],
        A,
        buf["ring_start"][idx],
        count,
        buf["x_cache"].shape[3],
        p.heads_per_group,
    )


def write(state: State, slots, values, layer: int, tokens: int, max_window: int) -> None:
    """Install ``values`` as the logical states of ``slots`` in ``layer`` and reset their cursors.
    The cursors are shared by the group, so the other layers' rings of these slots are folded into
    their checkpoints first (their logical states stay the same, rounded to the cache dtype)."""
    idx = slots.long()
    buf = state.buffers
    ssm = buf["ssm"]
    if bool((buf["pnat"][idx] > 0).any()):
        for other in range(state.num_layers):
            if other != layer:
                ssm[other, idx] = read(state, slots, other, tokens, max_window).to(ssm.dtype)
    ssm[layer, idx] = values.to(device=ssm.device, dtype=ssm.dtype)
    buf["ring_start"][idx] = 0
    buf["pnat"][idx] = 0
    rec = state.record
    if rec is not None and rec.pending_slots is not None:
        rec.pending_layers.clear()
        rec.pending_slots = None
