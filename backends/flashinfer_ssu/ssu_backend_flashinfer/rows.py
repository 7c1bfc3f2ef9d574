"""The cache rows FlashInfer reads and writes in one step.

The rows are guarded first (:func:`guarded_rows`): an id outside the cache becomes the pad id
(recorded in the kernel's fault record), and a row with a real slot whose destination is the pad
id, or outside the cache, writes to a sink: the sink row of an allocated state, or the pad slot of
an adopted cache whose pad id names one. They are computed into scratch buffers (no allocation,
no host synchronisation) by one Triton launch where Triton runs (:mod:`.rows_triton`), else by
torch ``out=`` ops, at the first layer of a step, and reused by its other layers while ``slots``
is the same tensor, unmodified; so a CUDA graph should hold whole decode steps (every layer and
the commit), as engines capture them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ssu.state import faults, slot_state
from ssu.state.slot_state import versions


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
        pad=torch.full((), flashinfer_pad(problem), dtype=dtype, device=dev),
        pad_slot=torch.full((), problem.pad_slot_id, dtype=dtype, device=dev),
        zero=torch.zeros((), dtype=dtype, device=dev),
        sink=torch.full((), problem.num_slots, dtype=dtype, device=dev),
        no_fault=torch.full((), faults.NO_FAULT, dtype=torch.int64, device=dev),
    )


def flashinfer_pad(problem) -> int:
    """The pad id FlashInfer is handed with the rows: the problem's when negative, else -1. The
    rows are this backend's (``slot * K + version`` for a speculative state it allocated), so a pad
    id of 0 or more could equal a real row there, and FlashInfer would skip that row; -1 is no
    row. Pad rows of every layout read -1 (a zero state, nothing written)."""
    return problem.pad_slot_id if problem.pad_slot_id < 0 else -1


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
            sink = buf["pad_slot"] if state.adopted else buf["sink"]
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
        pad_read=flashinfer_pad(p),
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
