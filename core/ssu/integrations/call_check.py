"""``SSU_CHECK``: every call an engine plugin serves, checked against the float64 statement of the
math (:mod:`ssu.checking.oracle`), to debug a deployment or to test an engine's own calls end to end.

``SSU_CHECK=PATH`` appends one JSON line per served call to ``PATH`` (the engine, the call form,
its batch and tokens, the accepted counts of a speculative call, the relative errors of its
outputs, cache and buffer, and whether they are within the spec's error budgets); ``SSU_CHECK=1``
writes no file. Either way a call outside its budgets is logged as a warning. The plugins wrap
their call only where ``SSU_CHECK`` is set when they route: each checked call copies the cache
rows it names (and the whole intermediate-state buffer) and synchronises, which a CUDA graph cannot
capture (run the engine eagerly: vLLM's ``--enforce-eager``), so it is for debugging and tests,
never for serving.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Optional

ENV_CHECK = "SSU_CHECK"


def wanted() -> Optional[str]:
    """The value of ``SSU_CHECK`` where it asks for checks (None where unset, empty or ``0``)."""
    value = os.environ.get(ENV_CHECK, "").strip()
    return None if value in ("", "0") else value


def checking(serve: Callable, engine: str, logger: logging.Logger, where: str) -> Callable:
    """``serve`` (the drop-in call) wrapped: each call is served, then compared with the float64
    oracle on a copy of the cache rows it names; ``where`` is ``SSU_CHECK``'s value (a path, or
    ``1``)."""
    import torch

    path = None if where == "1" else where

    def checked(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None,
                dst_state_batch_indices=None, pad_slot_id=-1, out=None, **kwargs):  # fmt: skip
        pad = pad_slot_id if kwargs.get("null_block_id") is None else kwargs["null_block_id"]
        slots = state_batch_indices
        if slots is None:
            slots = torch.arange(x.shape[0], device=state.device)
        rows = _named(state, pad, slots, dst_state_batch_indices)
        before = state[rows].clone()
        buffer = kwargs.get("intermediate_states_buffer")
        buffer_before = None if buffer is None else buffer.clone()
        y = serve(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dst_state_batch_indices,
                  pad_slot_id, out, **kwargs)  # fmt: skip
        y = out if y is None else y
        kwargs["null_block_id"] = None
        record = measure(
            before, state[rows], y, x, dt, A, B, C, D, z, dt_bias, dt_softplus, _remap(slots, rows, pad, state),
            _remap(dst_state_batch_indices, rows, pad, state), -1, buffer_before, buffer, **kwargs,
        )  # fmt: skip
        record["engine"] = engine
        if not record["ok"]:
            logger.warning("ssu check: a %s call is outside the error budgets: %s", record["form"], record)
        if path is not None:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        return y

    return checked


def _named(state, pad: int, *tables):
    """The slots of the cache that the call's tables name (pad ids and ids outside the cache left
    out), ascending: the rows a check copies and compares."""
    import torch

    ids = torch.cat([t.reshape(-1).long() for t in tables if t is not None])
    ids = ids[(ids != pad) & (ids >= 0) & (ids < state.shape[0])]
    return torch.unique(ids)


def _remap(table, rows, pad: int, state):
    """``table`` with each slot id replaced by its position in ``rows`` (the copied rows); pad ids
    and ids outside the cache become -1, the pad id of the copy."""
    import torch

    if table is None:
        return None
    where = torch.full((state.shape[0],), -1, dtype=torch.long, device=table.device)
    where[rows] = torch.arange(rows.numel(), device=table.device)
    ids = table.long()
    inside = (ids != pad) & (ids >= 0) & (ids < state.shape[0])
    return torch.where(inside, where[ids.clamp(0, state.shape[0] - 1)], torch.full_like(ids, -1))


def _head(t):
    """A per-head parameter as (H,): as given, or its first element along its expanded dimensions."""
    if t is None or t.dim() == 1:
        return t
    return t[(slice(None),) + (0,) * (t.dim() - 1)]


def measure(before, state, y, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, dst, pad_slot_id, buffer_before,
            buffer, *, null_block_id=None, num_accepted_tokens=None, cu_seqlens=None, disable_state_update=False,
            cache_steps=None, retrieve_parent_token=None, intermediate_state_indices=None, **_) -> dict:  # fmt: skip
    """The record of one served call: what the oracle computes from ``before`` (the cache as the
    call found it) against what the call left in ``state``, ``y`` and ``buffer``."""
    import torch

    from ..checking import oracle
    from ..dropin.engines import _buffer, call_form
    from ..contract.dtypes import dtype_name

    form = call_form(x, slots, num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                     disable_state_update=disable_state_update, intermediate_states_buffer=buffer,
                     retrieve_parent_token=retrieve_parent_token)  # fmt: skip
    pad = pad_slot_id if null_block_id is None else null_block_id
    A, D, dt_bias = _head(A), _head(D), _head(dt_bias)
    if dt.dim() == x.dim():
        dt = dt[..., 0]
    common = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus)
    record: dict[str, Any] = dict(form=form, accepted=None, buffer=0.0)
    if form == "packed":
        exact_cache, exact_y = oracle.packed_math64(
            before, x, dt, A, B, C, slots, pad_slot_id=pad, dst_slots=dst, num_accepted=num_accepted_tokens,
            cu_seqlens=cu_seqlens, z=z, **common,
        )  # fmt: skip
        owned = ~torch.isnan(exact_y.flatten(1)[:, 0])
        record.update(out=oracle.rel_error(y[owned], exact_y[owned]), tokens=int(x.shape[0]))
        record["batch"] = int(slots.shape[0]) if cu_seqlens is None else int(cu_seqlens.shape[0] - 1)
        if num_accepted_tokens is not None:
            record["accepted"] = [int(v) for v in num_accepted_tokens.tolist()]
        tokens = slots.shape[1]
    elif form in ("verify", "tree"):
        one = x.dim() == 3
        tok = (lambda t: None if t is None else t[:, None]) if one else (lambda t: t)
        rows = slots.reshape(-1) if slots is not None else torch.arange(x.shape[0], device=x.device)
        view = None if buffer is None else _buffer(buffer, cache_steps, state)
        view_before = None if buffer_before is None else _buffer(buffer_before, cache_steps, state)
        exact_cache, exact_buffer, exact_y = oracle.verify_math64(
            before, tok(x), tok(dt), A, tok(B), tok(C), rows, pad_slot_id=pad, update_state=not disable_state_update,
            buffer=view_before, buffer_rows=intermediate_state_indices, parents=retrieve_parent_token, z=tok(z),
            **common,
        )  # fmt: skip
        record.update(out=oracle.rel_error(tok(y), exact_y), batch=int(x.shape[0]), tokens=int(tok(x).shape[1]))
        if view is not None:
            record["buffer"] = oracle.rel_error(view, exact_buffer)
        tokens = record["tokens"]
    else:
        rows = torch.arange(x.shape[0], device=x.device) if slots is None else slots.reshape(x.shape[0], -1)[:, 0]
        targets = rows if dst is None else dst.reshape(x.shape[0], -1)[:, 0]
        real = (rows != pad) & (rows >= 0) & (rows < before.shape[0])
        start = torch.zeros((x.shape[0],) + tuple(before.shape[1:]), dtype=torch.float64, device=x.device)
        start[real] = before[rows[real].long()].double()
        states, exact_y = oracle.ssu_math64(
            start, x[:, None], dt[:, None], A, B[:, None], C[:, None], z=None if z is None else z[:, None], **common
        )
        exact_cache = before.double().clone()
        writes = real & (targets != pad)
        exact_cache[targets[writes].long()] = states[writes, 0]
        record.update(out=oracle.rel_error(y, exact_y[:, 0]), batch=int(x.shape[0]), tokens=1)
        tokens = 1
    record["cache"] = oracle.rel_error(state, exact_cache)
    state_budget = oracle.state_tolerance(dtype_name(state.dtype), tokens)
    out_budget = oracle.output_tolerance(dtype_name(x.dtype), tokens)
    record["ok"] = record["out"] <= out_budget and max(record["cache"], record["buffer"]) <= state_budget
    return record
