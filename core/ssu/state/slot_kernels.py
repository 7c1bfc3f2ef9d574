"""Triton kernels for the commit of the versioned-slot layout (:mod:`ssu.state.slot_state`): the cursor
move of an allocated state and the draft copy of an adopted cache, each one launch (a launch per
layer for the drafts), with the rows they refuse recorded in the kernel's fault record
(:mod:`ssu.state.faults`). The same rules as the torch implementation in :mod:`ssu.state.slot_state`, in
fewer launches: for backends that run where Triton does. Importing this module imports triton.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` without its constexpr-function wrapper (microseconds a call)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def pdl_capable(device) -> bool:
    """Programmatic dependent launch needs a CUDA GPU of compute capability 9.0 or newer (and
    Triton's interpreter has no such thing)."""
    if device.type != "cuda":
        return False
    import torch

    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _commit_rows(slots_ptr, accepted_ptr, faults_ptr, offs, batch, pad_slot_id, num_slots, T: tl.constexpr):
    """The rows of a commit that move (a real slot, 1 <= accepted <= T), and their slots and counts;
    the others, when their slot lies outside the cache or their count outside 1..T, recorded."""
    in_batch = offs < batch
    slot = tl.load(slots_ptr + offs, mask=in_batch, other=pad_slot_id).to(tl.int64)
    real = in_batch & (slot >= 0) & (slot < num_slots) & (slot != pad_slot_id)
    accepted = tl.load(accepted_ptr + offs, mask=real, other=1).to(tl.int64)
    counted = (accepted >= 1) & (accepted <= T)
    outside = in_batch & ((slot < 0) | (slot >= num_slots)) & (slot != pad_slot_id)
    keys = tl.where(
        outside,
        (offs.to(tl.int64) << 34) | (slot & 0xFFFFFFFF),
        (offs.to(tl.int64) << 34) | (2 << 32) | (accepted & 0xFFFFFFFF),
    )
    tl.atomic_min(faults_ptr + 0 * offs, keys, mask=outside | (real & ~counted))
    return real & counted, tl.where(real, slot, 0), accepted


@triton.jit(do_not_specialize=["batch", "pad_slot_id", "num_slots"])
def commit_kernel(
    cursor_ptr,
    slots_ptr,
    accepted_ptr,
    faults_ptr,
    batch,
    pad_slot_id,
    num_slots,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """cursor[slot] = (cursor[slot] + num_accepted) % K for every row that moves: one launch. With
    ``PDL``, as the step: the next kernel may be scheduled at once, nothing is read before the
    previous kernel (the step that read these cursors) has finished."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    moved, slot, accepted = _commit_rows(
        slots_ptr, accepted_ptr, faults_ptr, offs, batch, pad_slot_id, num_slots, K - 1
    )
    cur = tl.load(cursor_ptr + slot, mask=moved, other=0)
    tl.store(cursor_ptr + slot, ((cur + accepted) % K).to(cursor_ptr.dtype.element_ty), mask=moved)


def commit(cursor, slots, num_accepted, faults, *, pad_slot_id: int, num_slots: int, versions: int, pdl: bool = False):
    """Move the cursors of a speculative step's slots (a single launch, graph capturable), with
    programmatic dependent launch where ``pdl`` asks and the GPU has it (compute capability 9.0
    or newer), so that in a graph the commit and the next step do not each wait for a launch.
    Returns Triton's handle of the compiled kernel."""
    b = slots.shape[0]
    block = min(1024, _next_power_of_2(b))
    pdl = bool(pdl) and pdl_capable(cursor.device)
    return commit_kernel[(-(-b // block),)](
        cursor, slots, num_accepted, faults, b, pad_slot_id, num_slots, K=versions, BLOCK=block, PDL=pdl, launch_pdl=pdl
    )


@triton.jit(do_not_specialize=["batch", "pad_slot_id", "num_slots"])
def copy_drafts_kernel(
    cache_ptr,
    draft_ptr,
    slots_ptr,
    accepted_ptr,
    faults_ptr,
    batch,
    pad_slot_id,
    num_slots,
    c_slot,
    d_slot,
    d_ver,
    T: tl.constexpr,
    NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
    RECORD: tl.constexpr,
):
    """cache[slot] = draft[slot, accepted - 1] for the row of this program, if it moves; with
    ``RECORD`` (the first layer of the commit) the refused rows are recorded too."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    offs = row + tl.arange(0, 1)
    if RECORD:
        moved, slot, accepted = _commit_rows(
            slots_ptr, accepted_ptr, faults_ptr, offs, batch, pad_slot_id, num_slots, T
        )
    else:
        in_batch = offs < batch
        slot = tl.load(slots_ptr + offs).to(tl.int64)
        accepted = tl.load(accepted_ptr + offs).to(tl.int64)
        moved = in_batch & (slot >= 0) & (slot < num_slots) & (slot != pad_slot_id) & (accepted >= 1) & (accepted <= T)
        slot = tl.where(moved, slot, 0)
    moved = tl.sum(moved.to(tl.int32), axis=0) > 0
    slot = tl.sum(slot, axis=0)
    pick = tl.sum(tl.where(moved, accepted - 1, 0), axis=0)
    if moved:
        elems = block * BLOCK + tl.arange(0, BLOCK)
        mask = elems < NUMEL
        values = tl.load(draft_ptr + slot * d_slot + pick * d_ver + elems, mask=mask)
        tl.store(cache_ptr + slot * c_slot + elems, values, mask=mask)


def copy_drafts(cache, draft, slots, num_accepted, faults, *, pad_slot_id: int, num_slots: int, record: bool):
    """Commit of a speculative step on an adopted cache: one layer's accepted drafts copied into the
    engine's tensor (a launch per layer; graph capturable)."""
    b = slots.shape[0]
    numel = cache[0].numel()
    block = min(4096, _next_power_of_2(numel))
    grid = (b, -(-numel // block))
    return copy_drafts_kernel[grid](
        cache,
        draft,
        slots,
        num_accepted,
        faults,
        b,
        pad_slot_id,
        num_slots,
        cache.stride(0),
        draft.stride(0),
        draft.stride(1),
        T=draft.shape[1],
        NUMEL=numel,
        BLOCK=block,
        RECORD=record,
    )
