"""Checking the engines' call forms (docs/spec.md, "Engine call forms") before anything is written.

:func:`packed` and :func:`verify` check what a call's shapes, dtypes and devices say (once per
input signature, as the step's checks run); :func:`packed_values` and :func:`verify_values` check
what only the values say (offsets, ids, counts, parents, rows that collide), which synchronises
the host with the device and runs with ``validate = "full"`` only.
"""

from __future__ import annotations

from typing import Any

from ..contract.dtypes import FLOAT_STATE_DTYPES, dtype_name
from ..contract.errors import InputError
from .validation import Checker, contiguous_strides


def _inputs(checker: Checker, call: dict, lead: tuple, what: str) -> None:
    """x, dt, A, B, C, D, z, dt_bias, out and dt_softplus of a call whose token-bearing tensors
    start with the dimensions ``lead``."""
    p = checker.problem
    H, P, N, G = p.nheads, p.headdim, p.dstate, p.ngroups
    inp = (p.input_dtype,)
    wide = (p.input_dtype, "fp32") if p.input_dtype != "fp32" else ("fp32",)
    checker.tensor("x", call["x"], lead + (H, P), inp, what=what)
    checker.per_head("dt", call["dt"], lead + (H,), (P,), wide)
    checker.per_head("A", call["A"], (H,), (P, N), ("fp32",))
    checker.tensor("B", call["B"], lead + (G, N), inp)
    checker.tensor("C", call["C"], lead + (G, N), inp)
    for name in ("D", "dt_bias"):
        if call[name] is not None:
            checker.per_head(name, call[name], (H,), (P,), wide)
    for name in ("z", "out"):
        if call[name] is not None:
            checker.tensor(name, call[name], lead + (H, P), inp)
    out = call["out"]
    if out is not None and 0 in out.stride() and out.numel() > 1:
        raise InputError("out: has a zero stride (an expanded view); give a tensor that owns its memory")
    if not isinstance(call["dt_softplus"], bool):
        raise InputError(f"dt_softplus: expected True or False, got {call['dt_softplus']!r}")
    if checker.capabilities.contiguous_rows:
        checker.rows_layout(call, len(lead))
    if checker.capabilities.dt_bias_as_dt and call["dt_bias"] is not None:
        checker.dt_bias_dtype(call["dt"], call["dt_bias"])


def _index_table(checker: Checker, name: str, t: Any, shape: tuple, engine: str) -> None:
    """An id table or vector: a tensor of the backend's index dtypes on the kernel's device."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name} ({engine}): expected an int32 or int64 torch.Tensor, got {type(t).__name__}")
    checker.tensor(f"{name} ({engine})", t, shape, tuple(sorted(checker.index_dtypes)))


def packed(checker: Checker, call: dict) -> None:
    """Every shape check of a ``packed`` call (vLLM's): the tables (N, W) with W at most the
    problem's tokens per step, the counts (N,), the offsets (N + 1,), and the packed inputs."""
    import torch

    p = checker.problem
    checker.state(call["state"], call["layer"])
    slots, dst, accepted, offsets, x = (call[n] for n in ("slots", "dst_slots", "num_accepted", "cu_seqlens", "x"))
    if not isinstance(slots, torch.Tensor) or slots.dim() != 2:
        got = f"shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise InputError(
            f"slots (state_batch_indices): expected an (N, W) table of slot ids, a row per sequence and a column "
            f"per token, got {got}"
        )
    _index_table(checker, "slots", slots, (None, None), "state_batch_indices")
    rows, W = slots.shape
    if not 1 <= W <= p.tokens_per_step:
        raise InputError(
            f"slots (state_batch_indices): {W} columns; expected 1 to {p.tokens_per_step} (Problem.tokens_per_step, "
            "the most tokens a sequence carries): open the kernel with tokens_per_step >= the table's width"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise InputError(f"x: expected the packed tokens (tokens, H, P), got {got}")
    tokens = x.shape[0]
    if offsets is None:
        N = tokens
    else:
        _index_table(checker, "cu_seqlens", offsets, (None,), "cu_seqlens")
        checker.contiguous_vector("cu_seqlens", offsets)
        N = offsets.shape[0] - 1
        if N < 1:
            raise InputError("cu_seqlens: expected N + 1 offsets for N >= 1 sequences, got 1 or none")
    if not 1 <= N <= p.max_batch:
        raise InputError(f"{N} sequences in the call; expected 1 to {p.max_batch} (Problem.max_batch)")
    if rows < N:
        source = "cu_seqlens holds" if offsets is not None else "x holds"
        raise InputError(
            f"slots (state_batch_indices): {rows} rows for {N} sequences ({source} {N}); give a row per sequence"
        )
    if tokens > N * W:
        raise InputError(
            f"x: {tokens} tokens for {N} sequences of at most {W} tokens each (the tables' width): some sequence is "
            "longer than its slot table; widen the tables or pass fewer tokens"
        )
    if dst is not None:
        _index_table(checker, "dst_slots", dst, (None, W), "dst_state_batch_indices")
        if dst.shape[0] < N:
            raise InputError(f"dst_slots (dst_state_batch_indices): {dst.shape[0]} rows for {N} sequences")
        if dst.dtype != slots.dtype:
            raise InputError(
                f"dst_slots (dst_state_batch_indices): {dtype_name(dst.dtype)} while slots are "
                f"{dtype_name(slots.dtype)}; pass both tables in one dtype"
            )
    if accepted is not None:
        checker.tensor("num_accepted (num_accepted_tokens)", accepted, (N,), ("int32", "int64"))
        checker.contiguous_vector("num_accepted", accepted)
    _inputs(checker, call, (tokens,), " (tokens, heads, headdim): the tokens of every sequence, packed")


def verify(checker: Checker, call: dict) -> None:
    """Every shape check of a ``verify`` call (SGLang's): the rows' slots (b,), the tokens (b, T,
    ...), the buffer (rows, steps, H, P, N) with steps >= T, its rows (b,), the parents (b, T)."""
    import torch

    p = checker.problem
    checker.state(call["state"], call["layer"])
    b = checker.slots(call["slots"])
    x = call["x"]
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        checker.tensor("x", x, (b, None, p.nheads, p.headdim), (p.input_dtype,), what=" (batch, tokens, H, P)")
    T = x.shape[1]
    if not 1 <= T <= p.tokens_per_step:
        raise InputError(f"x: {T} tokens per row; expected 1 to {p.tokens_per_step} (Problem.tokens_per_step)")
    _inputs(checker, call, (b, T), " (batch, tokens, heads, headdim)")
    if not isinstance(call["update_state"], bool):
        raise InputError(f"update_state: expected True or False, got {call['update_state']!r}")
    buffer, rows, parents = call["buffer"], call["buffer_rows"], call["parents"]
    if buffer is not None:
        steps = "(rows, steps, H, P, N)"
        checker.tensor(
            "buffer (intermediate_states_buffer)",
            buffer,
            (None, None, p.nheads, p.headdim, p.dstate),
            FLOAT_STATE_DTYPES,
            what=f" {steps} in fp32, bf16 or fp16",
        )
        if buffer.shape[1] < T or buffer.shape[0] < 1:
            raise InputError(
                f"buffer (intermediate_states_buffer): {buffer.shape[1]} steps a row for {T} tokens (cache_steps "
                f"must be at least the tokens of the call), {buffer.shape[0]} rows"
            )
        inner = contiguous_strides(buffer.shape[2:])
        if buffer.stride()[2:] != inner:
            raise InputError(
                f"buffer (intermediate_states_buffer): each (H, P, N) block must be contiguous (strides {inner} after "
                f"the row's and the step's), got strides {buffer.stride()}"
            )
    if rows is not None:
        if buffer is None:
            raise InputError(
                "buffer_rows (intermediate_state_indices): given without a buffer; pass intermediate_states_buffer, "
                "or leave the rows out"
            )
        _index_table(checker, "buffer_rows", rows, (b,), "intermediate_state_indices")
        checker.contiguous_vector("buffer_rows", rows)
    if parents is not None:
        if "tree" not in p.engine_calls:
            raise InputError(
                "parents (retrieve_parent_token): this kernel was opened for verify calls without parent tokens; "
                "open it with Problem(engine_calls={'tree'})"
            )
        if buffer is None:
            raise InputError(
                "parents (retrieve_parent_token): a token continues from its parent's state as the intermediate-state "
                "buffer holds it; pass intermediate_states_buffer with the parents"
            )
        checker.tensor("parents (retrieve_parent_token)", parents, (b, T), ("int32", "int64"))


def _ids(p, values: list, where: str, engine: str) -> None:
    """Each id a slot of the cache or the pad id."""
    for cell, s in values:
        if s != p.pad_slot_id and not 0 <= s < p.num_slots:
            raise InputError(
                f"{where}{cell} ({engine}) = {s}: not a slot of this cache (0..{p.num_slots - 1}) nor the pad id "
                f"{p.pad_slot_id}"
            )


def packed_values(checker: Checker, call: dict) -> None:
    """The value checks of a ``packed`` call (synchronise): offsets ascending within the tokens and
    each sequence at most the tables' width, counts in 0..W, every id a sequence uses a slot or the
    pad id, the slots it writes distinct and none another sequence's start."""
    p = checker.problem
    slots, dst, accepted, offsets = (call[n] for n in ("slots", "dst_slots", "num_accepted", "cu_seqlens"))
    dst = slots if dst is None else dst
    tokens, W = call["x"].shape[0], slots.shape[1]
    if offsets is None:
        starts, lengths = list(range(tokens)), [1] * tokens
    else:
        cu = offsets.tolist()
        for n in range(len(cu) - 1):
            if not 0 <= cu[n] <= cu[n + 1] <= tokens or cu[n + 1] - cu[n] > W:
                raise InputError(
                    f"cu_seqlens[{n}:{n + 2}] = {cu[n : n + 2]}: sequence {n} must own rows inside the call's {tokens} "
                    f"tokens (offsets ascending) and at most {W} of them (the tables' width)"
                )
        starts, lengths = cu[:-1], [cu[n + 1] - cu[n] for n in range(len(cu) - 1)]
    N = len(starts)
    counts = [1] * N if accepted is None else accepted.tolist()
    for n, c in enumerate(counts):
        if not 0 <= c <= W:
            raise InputError(f"num_accepted[{n}] (num_accepted_tokens) = {c}: expected 0 to {W} (the tables' width)")
    table, dst_table = slots[:N].tolist(), dst[:N].tolist()
    first = [table[n][max(counts[n] - 1, 0)] for n in range(N)]
    _ids(
        p,
        [(f"[{n}, {max(counts[n] - 1, 0)}]", first[n]) for n in range(N) if lengths[n]],
        "slots",
        "state_batch_indices",
    )
    used = [n for n in range(N) if lengths[n] and first[n] != p.pad_slot_id]
    written = [(n, t, dst_table[n][t]) for n in used for t in range(lengths[n]) if dst_table[n][t] != p.pad_slot_id]
    _ids(p, [(f"[{n}, {t}]", s) for n, t, s in written], "dst_slots", "dst_state_batch_indices")
    owner: dict = {}
    for n in used:
        if first[n] in owner:
            raise InputError(f"slots: sequences {owner[first[n]]} and {n} start from the same slot {first[n]}")
        owner[first[n]] = n
    seen: dict = {}
    for n, t, s in written:
        if s in seen:
            raise InputError(f"dst_slots: slot {s} is written by both [{seen[s][0]}, {seen[s][1]}] and [{n}, {t}]")
        seen[s] = (n, t)
        if owner.get(s, n) != n:
            raise InputError(
                f"dst_slots[{n}, {t}] = {s}: the slot sequence {owner[s]} starts from; a call writes only slots "
                "that no other sequence of it reads"
            )


def verify_values(checker: Checker, call: dict) -> None:
    """The value checks of a ``verify`` call (synchronise): slots, buffer rows inside the buffer and
    distinct, each parent one of the tokens before its own."""
    p = checker.problem
    slots, buffer, rows, parents = (call[n] for n in ("slots", "buffer", "buffer_rows", "parents"))
    checker.slot_values(slots)
    ids = slots.tolist()
    real = [i for i, s in enumerate(ids) if s != p.pad_slot_id]
    if buffer is None:
        return
    targets = ids if rows is None else rows.tolist()
    name = "slots" if rows is None else "buffer_rows (intermediate_state_indices)"
    seen: dict = {}
    for i in real:
        r = targets[i]
        if not 0 <= r < buffer.shape[0]:
            raise InputError(
                f"{name}[{i}] = {r}: not a row of the intermediate-state buffer (0..{buffer.shape[0] - 1})"
            )
        if r in seen:
            raise InputError(f"{name}: rows {seen[r]} and {i} store their states in the same buffer row {r}")
        seen[r] = i
    if parents is not None:
        table = parents.tolist()
        for i in real:
            for t in range(1, len(table[i])):
                if table[i][t] >= t:
                    raise InputError(
                        f"parents[{i}, {t}] (retrieve_parent_token) = {table[i][t]}: a token's parent is one of the "
                        "tokens before it (or negative for the one before it)"
                    )
