"""The reference backend's engine call forms (docs/spec.md, "Engine call forms"), in plain
PyTorch with fp32 arithmetic: vLLM's packed call and SGLang's verify call, on the states of the
versioned-slot layout (:mod:`ssu.state.slot_state`): an adopted engine cache or an allocated state, the
logical state of each slot read and written where it lives. Ids, counts, offsets and parents that
the spec refuses are served as it says and recorded in the kernel's fault record. Slow on purpose.
"""

from __future__ import annotations

import torch

from ..state import faults, quant, slot_state
from .math import per_head


class _Target:
    """Where one layer's logical states live: read and written in place (no drafts), an 8-bit
    cache with its row scales."""

    def __init__(self, state, layer: int) -> None:
        self.state = state
        self.view = state.views[layer].read
        self.scales = state.scales[layer].read if state.problem.quantized else None

    def read(self, ids):
        """fp32 states of the (real) slots ``ids``."""
        version = slot_state.current_version(self.state, ids)
        values = self.view[ids, version]
        if self.scales is not None:
            return quant.dequantize(values, self.scales[ids, version])
        return values.float()

    def write(self, ids, values) -> None:
        """Store fp32 ``values`` as the states of the (real, distinct) slots ``ids``, rounded."""
        if ids.numel() == 0:
            return
        version = slot_state.current_version(self.state, ids)
        if self.scales is not None:
            q, scale = quant.quantize(values, self.state.problem.state_dtype)
            self.view[ids, version] = q
            self.scales[ids, version] = scale
        else:
            self.view[ids, version] = values.to(self.view.dtype)


def _apply(problem, s, x, dt, B, C, A, D, z, dt_bias, dt_softplus):
    """Apply one token to fp32 states ``s`` (b, H, P, N): x (b, H, P), dt (b, H), B and C (b, G,
    N), z (b, H, P) or None. Returns (new states, outputs in fp32)."""
    hpg = problem.heads_per_group
    d = dt.float()
    if dt_bias is not None:
        d = d + dt_bias.float()
    if dt_softplus:
        d = torch.nn.functional.softplus(d)  # threshold 20: identity above
    decay = torch.exp(A.float() * d)
    xt = x.float()
    Bh = B.float().repeat_interleave(hpg, dim=1)
    Ch = C.float().repeat_interleave(hpg, dim=1)
    s = s * decay[:, :, None, None] + (d[:, :, None] * xt)[..., None] * Bh[:, :, None, :]
    y = (s * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.float()[:, None] * xt
    if z is not None:
        zt = z.float()
        y = y * zt * torch.sigmoid(zt)
    return s, y


def make_packed(ctx):
    """The ``packed`` call (:class:`ssu.contract.PackedStepFn`) of one kernel."""
    p = ctx.problem
    record = ctx.faults

    def packed_step(
        state, x, dt, A, B, C, slots, dst_slots=None, num_accepted=None, cu_seqlens=None, D=None, z=None,
        dt_bias=None, dt_softplus=False, out=None, layer=0,
    ):  # fmt: skip
        if out is None:
            out = torch.empty_like(x)
        dt, A, D, dt_bias = per_head(x, dt, A, D, dt_bias)
        dev = x.device
        tokens, W = x.shape[0], slots.shape[1]
        if cu_seqlens is None:
            N = tokens
            first = torch.arange(N, device=dev)
            length = torch.ones(N, dtype=torch.int64, device=dev)
            offsets_ok = torch.ones(N, dtype=torch.bool, device=dev)
        else:
            cu = cu_seqlens.long()
            N = cu.shape[0] - 1
            first, length = cu[:-1], cu[1:] - cu[:-1]
            offsets_ok = (first >= 0) & (length >= 0) & (length <= W) & (cu[1:] <= tokens)
            faults.record_engine(record, ~offsets_ok, cu[1:], faults.E_CU_SEQLENS)
        table = slots[:N].long()
        dst_table = table if dst_slots is None else dst_slots[:N].long()
        length = torch.where(offsets_ok, length, torch.zeros_like(length))
        if num_accepted is None:
            column = torch.zeros(N, dtype=torch.int64, device=dev)
            count_ok = torch.ones(N, dtype=torch.bool, device=dev)
        else:
            count = num_accepted.long()
            count_ok = (count >= 0) & (count <= W)
            faults.record_engine(record, offsets_ok & ~count_ok, count, faults.E_NUM_ACCEPTED)
            column = torch.where(count_ok, (count - 1).clamp(min=0), torch.zeros_like(count))
        start = table.gather(1, column[:, None])[:, 0]
        used = count_ok & (length > 0)
        bad_start = used & faults.outside(start, p.num_slots, p.pad_slot_id)
        cells = torch.zeros_like(table, dtype=torch.bool).scatter_(1, column[:, None], bad_start[:, None])
        faults.record_engine(record, cells, table, faults.E_SLOTS)
        real = used & slot_state.real_rows(p, start)
        target = _Target(state, layer)
        s = torch.zeros(N, p.nheads, p.headdim, p.dstate, dtype=torch.float32, device=dev)
        s[real] = target.read(start[real])
        steps = torch.arange(W, device=dev)
        active = steps[None, :] < length[:, None]  # (N, W): the tokens each sequence carries
        writes = active & real[:, None]
        bad_dst = writes & faults.outside(dst_table, p.num_slots, p.pad_slot_id)
        faults.record_engine(record, bad_dst, dst_table, faults.E_DST_SLOTS)
        writes = writes & slot_state.real_rows(p, dst_table)
        for t in range(W):
            live = active[:, t]
            if not bool(live.any()):
                break
            rows = (first + t).clamp(0, max(tokens - 1, 0))[live]
            new, y = _apply(
                p, s[live], x[rows], dt[rows], B[rows], C[rows], A, D, None if z is None else z[rows],
                dt_bias, dt_softplus,
            )  # fmt: skip
            s[live] = new
            out[rows] = y.to(out.dtype)
            keep = writes[:, t]
            target.write(dst_table[keep, t], s[keep])
        return out

    return packed_step


def make_verify(ctx):
    """The ``verify`` call (:class:`ssu.contract.VerifyStepFn`) of one kernel."""
    p = ctx.problem
    record = ctx.faults

    def verify_step(
        state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0,
        update_state=True, buffer=None, buffer_rows=None, parents=None,
    ):  # fmt: skip
        if out is None:
            out = torch.empty_like(x)
        dt, A, D, dt_bias = per_head(x, dt, A, D, dt_bias)
        b, T = x.shape[:2]
        ids = slots.long()
        bad = faults.outside(ids, p.num_slots, p.pad_slot_id)
        faults.record_engine(record, bad, ids, faults.E_ROW_SLOTS)
        real = slot_state.real_rows(p, ids)
        target = _Target(state, layer)
        s = torch.zeros(b, p.nheads, p.headdim, p.dstate, dtype=torch.float32, device=x.device)
        s[real] = target.read(ids[real])
        stored = torch.zeros(b, dtype=torch.bool, device=x.device)
        row = ids
        if buffer is not None:
            row = ids if buffer_rows is None else buffer_rows.long()
            stored = real & (row >= 0) & (row < buffer.shape[0])
            faults.record_engine(record, real & ~stored, row, faults.E_BUFFER_ROWS)
        if parents is not None:
            column = torch.arange(T, device=x.device)[None, :]
            wrong = stored[:, None] & (column >= 1) & (parents.long() >= column)
            faults.record_engine(record, wrong, parents, faults.E_PARENTS)
        for t in range(T):
            if t and parents is not None:
                parent = parents[:, t].long()
                follow = stored & (parent >= 0) & (parent < t - 1)
                if bool(follow.any()):  # the parent's state as the buffer holds it
                    s = s.clone()
                    s[follow] = buffer[row[follow], parent[follow]].float()
            s, y = _apply(
                p, s, x[:, t], dt[:, t], B[:, t], C[:, t], A, D, None if z is None else z[:, t], dt_bias, dt_softplus
            )
            out[:, t] = y.to(out.dtype)
            if buffer is not None and bool(stored.any()):
                buffer[row[stored], t] = s[stored].to(buffer.dtype)
        if update_state:
            target.write(ids[real], s[real])
        return out

    return verify_step
