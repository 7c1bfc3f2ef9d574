"""Guarded ids, recorded on the device: the step never pays a host synchronisation to refuse them.

A slot id outside ``[0, num_slots)`` that is not the pad id (in ``slots`` or ``dst_slots``), or an
accepted count outside ``1..T`` in ``commit``, would address memory outside the cache. Backends
that declare ``Capabilities.guards_slots`` treat such a row as a pad row (it reads a zero state,
writes no state, still writes its output row; a commit leaves that slot as it was) and lower the
kernel's fault record, ``Context.faults``. For a backend that does not, the core guards the
same rows itself, with a few torch operations before each validated step and commit
(:func:`guard`, :func:`guard_commit`). The record is one int64 on the problem's device holding the smallest
key of the rows refused so far, or :data:`NO_FAULT`. A key packs the row, which argument and the
low 32 bits of the value, so that the first offending row is reported exactly. The engine call
forms (docs/spec.md, "Engine call forms") key their refused values with kind :data:`ENGINE`, whose
row field names the argument, the sequence and the token (:func:`engine_key`).

:meth:`ssu.Kernel.check` reads the record (that synchronises), raises an :class:`~ssu.InputError`
naming the row, and clears it; ``read_state``, ``write_state``, ``warmup``, ``sync`` and
``adopt_state`` check first. ``validate = "full"`` refuses such ids before anything runs.
"""

from __future__ import annotations

from typing import Optional

#: the record's value when nothing was refused
NO_FAULT = (1 << 63) - 1
#: what a key's kind field names
KINDS = ("slots", "dst_slots", "num_accepted", "engine call")
SLOTS, DST_SLOTS, NUM_ACCEPTED, ENGINE = range(4)
_ROW_SHIFT, _KIND_SHIFT, _LOW32 = 34, 32, 0xFFFFFFFF
#: the arguments of an engine call form (docs/spec.md, "Engine call forms") a key of kind
#: :data:`ENGINE` names, with the engines' own names for them
ENGINE_ARGS = ("slots", "dst_slots", "num_accepted", "cu_seqlens", "parents", "buffer_rows", "slots")
ENGINE_NAMES = (
    "state_batch_indices",
    "dst_state_batch_indices",
    "num_accepted_tokens",
    "cu_seqlens",
    "retrieve_parent_token",
    "intermediate_state_indices",
    "state_batch_indices",
)
#: the packed call's tables (slots, destinations: a cell per token), counts and offsets; the parent
#: table, buffer rows and slot vector of a verify call
E_SLOTS, E_DST_SLOTS, E_NUM_ACCEPTED, E_CU_SEQLENS, E_PARENTS, E_BUFFER_ROWS, E_ROW_SLOTS = range(7)
#: an engine key's row field: the argument (3 bits), the sequence (19 bits), the token (7 bits)
_ARG_SHIFT, _SEQ_SHIFT, _SEQ_BITS, _TOKEN_BITS = 26, 7, 19, 7


def allocate(device):
    """A fresh record on ``device`` (one int64, :data:`NO_FAULT`)."""
    import torch

    return torch.full((1,), NO_FAULT, dtype=torch.int64, device=device)


def encode(row: int, kind: int, value: int) -> int:
    """The key of ``row`` refused for argument ``kind`` with ``value`` (smaller rows sort first)."""
    return (row << _ROW_SHIFT) | (kind << _KIND_SHIFT) | (value & _LOW32)


def decode(key: int) -> tuple[int, int, int]:
    """``(row, kind, value)`` of a key; the value as a signed 32-bit integer."""
    value = key & _LOW32
    if value >= 1 << 31:
        value -= 1 << 32
    return key >> _ROW_SHIFT, (key >> _KIND_SHIFT) & 3, value


def engine_row(arg: int, sequence: int, token: int = 0) -> int:
    """The row field of an engine call's key: which argument (:data:`ENGINE_ARGS`), the sequence
    (the row of a table) and the token (its column; 0 for a vector). Sequences past 2^19 and tokens
    past 127 share the last field value (the key still names the argument)."""
    sequence = min(sequence, (1 << _SEQ_BITS) - 1)
    token = min(token, (1 << _TOKEN_BITS) - 1)
    return (arg << _ARG_SHIFT) | (sequence << _SEQ_SHIFT) | token


def engine_key(arg: int, sequence: int, token: int, value: int) -> int:
    """The key of a refused value of an engine call: ``encode(engine_row(...), ENGINE, value)``."""
    return encode(engine_row(arg, sequence, token), ENGINE, value)


def record_engine(faults, bad, values, arg: int) -> None:
    """:func:`record` for an engine call's argument ``arg``: ``bad`` and ``values`` a vector (one
    per sequence) or an (N, W) table, keyed by sequence and token (torch ops, no synchronisation)."""
    import torch

    if bad.numel() == 0:
        return
    table = bad.dim() == 2
    n = torch.arange(bad.shape[0], device=bad.device, dtype=torch.int64)
    t = torch.arange(bad.shape[1] if table else 1, device=bad.device, dtype=torch.int64)
    n = n.clamp(max=(1 << _SEQ_BITS) - 1)
    t = t.clamp(max=(1 << _TOKEN_BITS) - 1)
    rows = (arg << _ARG_SHIFT) | (n[:, None] << _SEQ_SHIFT) | t[None, :]
    keys = (rows << _ROW_SHIFT) | (ENGINE << _KIND_SHIFT) | (values.reshape(rows.shape).to(torch.int64) & _LOW32)
    keys = torch.where(bad.reshape(rows.shape), keys, torch.full_like(keys, NO_FAULT))
    torch.minimum(faults, keys.amin().reshape(1), out=faults)


def record(faults, bad, values, kind: int) -> None:
    """Lower ``faults`` with the keys of the rows where ``bad`` (torch ops, any device, no host
    synchronisation): the implementation for backends written in torch and for the core's guard."""
    import torch

    rows = torch.arange(bad.shape[0], device=bad.device, dtype=torch.int64)
    keys = (rows << _ROW_SHIFT) | (kind << _KIND_SHIFT) | (values.to(torch.int64) & _LOW32)
    keys = torch.where(bad, keys, torch.full_like(keys, NO_FAULT))
    if keys.numel():
        torch.minimum(faults, keys.amin().reshape(1), out=faults)


def outside(ids, num_slots: int, pad_slot_id: int):
    """Boolean mask of the ids that are neither a slot of the cache nor the pad id."""
    return ((ids < 0) | (ids >= num_slots)) & (ids != pad_slot_id)


def message(key: int, problem) -> Optional[str]:
    """What was refused, and how to fix it (None for :data:`NO_FAULT`)."""
    if key == NO_FAULT:
        return None
    row, kind, value = decode(key)
    name = KINDS[kind]
    if kind == ENGINE:
        return _engine_message(row, value, problem)
    if kind == NUM_ACCEPTED:
        return (
            f"num_accepted[{row}] = {value}: outside 1..{problem.tokens_per_step}; that slot's state was "
            "left as it was before the step. Pass how many of the step's tokens each sequence keeps (at least "
            '1); validate = "full" refuses such counts before the commit runs'
        )
    return (
        f"{name}[{row}] = {value}: neither a slot of this cache (0..{problem.num_slots - 1}) nor the pad id "
        f"{problem.pad_slot_id}; that row was served as a pad row (no state read or written, its output from a "
        'zero state). Fix the caller\'s slot mapping; validate = "full" refuses such ids before the step runs'
    )


def guard(ids, problem, faults, kind: int):
    """``ids`` with every id that is neither a slot nor the pad id replaced by the pad id, the
    replaced rows recorded: what the core runs (torch ops, no host synchronisation) before each
    validated step of a backend that does not declare ``guards_slots``."""
    import torch

    bad = outside(ids, problem.num_slots, problem.pad_slot_id)
    record(faults, bad, ids, kind)
    return torch.where(bad, torch.full_like(ids, problem.pad_slot_id), ids)


def guard_commit(slots, num_accepted, problem, faults):
    """``(slots, num_accepted)`` for a commit of a backend that does not declare ``guards_slots``:
    a row whose id is neither a slot nor the pad id, or whose real slot comes with a count outside
    ``1..T``, becomes a pad row (the pad id, a count of 1) that the backend's commit passes over,
    and is recorded. What the core runs (torch ops, no host synchronisation) before each validated
    commit, so that such a backend never sees a count it could step past its drafts with."""
    import torch

    bad_ids = outside(slots, problem.num_slots, problem.pad_slot_id)
    real = (slots >= 0) & (slots < problem.num_slots) & (slots != problem.pad_slot_id)
    bad_counts = real & ((num_accepted < 1) | (num_accepted > problem.tokens_per_step))
    record(faults, bad_ids, slots, SLOTS)
    record(faults, bad_counts, num_accepted, NUM_ACCEPTED)
    dropped = bad_ids | bad_counts
    return (
        torch.where(dropped, torch.full_like(slots, problem.pad_slot_id), slots),
        torch.where(bad_counts, torch.ones_like(num_accepted), num_accepted),
    )


def engine_label(arg: int, sequence: int, token: int) -> str:
    """How a message names the refused value of an engine call: the argument's name, where in it
    (sequence and token for a table, else the row) and the engine's name for it, as in
    ``dst_slots[1, 2] (dst_state_batch_indices)``."""
    name, engine = ENGINE_ARGS[arg], ENGINE_NAMES[arg]
    where = f"{name}[{sequence}, {token}]" if arg in (E_SLOTS, E_DST_SLOTS, E_PARENTS) else f"{name}[{sequence}]"
    return f"{where} ({engine})"


def _engine_message(row: int, value: int, problem) -> str:
    """The message of a refused value of an engine call form (key of kind :data:`ENGINE`)."""
    arg = row >> _ARG_SHIFT
    n = (row >> _SEQ_SHIFT) & ((1 << _SEQ_BITS) - 1)
    t = row & ((1 << _TOKEN_BITS) - 1)
    if arg >= len(ENGINE_ARGS):
        return f"an engine call met a value it refused (argument code {arg}, sequence {n}, value {value})"
    label = f"{engine_label(arg, n, t)} = {value}"
    fix = 'validate = "full" refuses it before the call runs'
    if arg == E_ROW_SLOTS:
        return (
            f"{label}: neither a slot of this cache (0..{problem.num_slots - 1}) nor the pad id {problem.pad_slot_id}; "
            f"row {n} was served as a pad row (a zero state, nothing stored, its outputs written). Fix the engine's "
            f"slot ids; {fix}"
        )
    if arg == E_SLOTS:
        return (
            f"{label}: neither a slot of this cache (0..{problem.num_slots - 1}) nor the pad id {problem.pad_slot_id}; "
            f"sequence {n} was served as a padded one (a zero state, no state written, its outputs written). Fix the "
            f"engine's slot table; {fix}"
        )
    if arg == E_DST_SLOTS:
        return (
            f"{label}: neither a slot of this cache (0..{problem.num_slots - 1}) nor the pad id {problem.pad_slot_id}; "
            f"that token's state was not written. Fix the engine's slot table; {fix}"
        )
    if arg == E_NUM_ACCEPTED:
        return (
            f"{label}: outside 0..{problem.tokens_per_step} (the table's width at most); sequence {n} was served as "
            f"a padded one. Pass how many tokens of the previous step each sequence kept; {fix}"
        )
    if arg == E_CU_SEQLENS:
        return (
            f"{label}: sequence {n}'s offsets are not ascending within the call's tokens, or it has more tokens "
            f"than its slot table has columns; no state of sequence {n} was written, and the call's other results "
            f"are unspecified. Pass cumulative offsets (N + 1 of them, from 0, each sequence at most the table's "
            f"width); {fix}"
        )
    if arg == E_PARENTS:
        return (
            f"{label}: a parent at or after its own token {t}; token {t} continued from token {t - 1} instead. "
            f"A token's parent is one of the tokens before it (or negative for the one before it); {fix}"
        )
    return (
        f"{label}: not a row of the intermediate-state buffer; row {n} stored nothing in it, followed no "
        f"parents, and its outputs are unspecified. Pass buffer rows inside the buffer; {fix}"
    )
