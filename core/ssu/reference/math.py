"""The reference step: the equations of docs/spec.md in plain PyTorch, fp32 arithmetic, any device.

Within one step the T tokens of a sequence chain in fp32; each token's state is written to the
cache rounded to its dtype (round to nearest; an 8-bit cache quantised per row with a fresh scale,
:mod:`ssu.state.quant`). A row reads a zero state when its slot is the pad
id or outside the cache (the latter recorded in the kernel's fault record) and then writes no state;
a row with a real slot writes none when its destination is the pad id or outside the cache. Slow on
purpose: it is the oracle, not a contender.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..state import faults, quant, slot_state


def per_head(x, dt, A, D, dt_bias):
    """dt, A, D and dt_bias per head, also when given in Mamba2's expanded form (stride 0 along P
    and N): (b, [T,] H), (H,), (H,), (H,)."""
    if dt.dim() == x.dim():
        dt = dt[..., 0]
    if A.dim() == 3:
        A = A[:, 0, 0]
    if D is not None and D.dim() == 2:
        D = D[:, 0]
    if dt_bias is not None and dt_bias.dim() == 2:
        dt_bias = dt_bias[:, 0]
    return dt, A, D, dt_bias


def make_step(ctx):
    """Factory of the reference backend: the step callable for one kernel."""
    p = ctx.problem
    hpg = p.heads_per_group
    S, pad = p.num_slots, p.pad_slot_id
    speculative = p.speculative
    K = slot_state.versions(p)
    record = ctx.faults
    quantized = p.quantized

    def store(view, scale_view, rows, versions, values):
        """Write fp32 ``values`` to ``view[rows, versions]``, rounded to the cache (for an 8-bit
        cache quantised, their row scales to ``scale_view[rows, versions]``)."""
        if quantized:
            q, scale = quant.quantize(values, p.state_dtype)
            view[rows, versions] = q
            scale_view[rows, versions] = scale
        else:
            view[rows, versions] = values.to(view.dtype)

    def rows_of(ids, kind):
        """(real-row mask, ids made safe to index with) of ``ids``; ids outside the cache recorded."""
        if record is not None:
            faults.record(record, faults.outside(ids, S, pad), ids, kind)
        real = slot_state.real_rows(p, ids)
        return real, torch.where(real, ids, torch.zeros_like(ids)).long()

    def step(
        state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0, dst_slots=None
    ):
        if out is None:
            out = torch.empty_like(x)
        dt, A, D, dt_bias = per_head(x, dt, A, D, dt_bias)
        xs, dts, Bs, Cs = x, dt, B, C
        zs, outs = z, out
        if not speculative:  # give every tensor a token axis of length 1
            xs, dts, Bs, Cs = x[:, None], dt[:, None], B[:, None], C[:, None]
            zs = None if z is None else z[:, None]
            outs = out[:, None]
        views = state.views[layer]
        valid, idx = rows_of(slots, faults.SLOTS)
        if dst_slots is None:
            keep, dst = valid, idx
        else:
            keep, dst = rows_of(dst_slots, faults.DST_SLOTS)
            keep = keep & valid  # a pad row writes nothing
        cursor = slot_state.uses_cursor(state)
        cur = slot_state.current_version(state, idx) if cursor else torch.zeros_like(idx)
        scales = state.scales[layer] if quantized else None  # 8-bit rows' scales (ssu.state.quant)
        if quantized:
            s = quant.dequantize(views.read[idx, cur], scales.read[idx, cur])
        else:
            s = views.read[idx, cur].float()
        s[~valid] = 0.0  # a pad row reads a zero state
        Af = A.float()
        for t in range(xs.shape[1]):
            d = dts[:, t].float()
            if dt_bias is not None:
                d = d + dt_bias.float()
            if dt_softplus:
                d = F.softplus(d)  # threshold 20: identity above
            dA = torch.exp(Af * d)  # (b, H)
            xt = xs[:, t].float()  # (b, H, P)
            Bh = Bs[:, t].float().repeat_interleave(hpg, dim=1)  # (b, H, N)
            Ch = Cs[:, t].float().repeat_interleave(hpg, dim=1)
            s = s * dA[:, :, None, None] + (d[:, :, None] * xt)[..., None] * Bh[:, :, None, :]
            y = (s * Ch[:, :, None, :]).sum(-1)
            if D is not None:
                y = y + D.float()[:, None] * xt
            if zs is not None:
                zt = zs[:, t].float()
                y = y * zt * torch.sigmoid(zt)
            outs[:, t] = y.to(out.dtype)
            if speculative:  # token t's state: version (cursor + 1 + t) % K, or draft t of an adopted cache
                version = (cur + 1 + t) % K if cursor else torch.full_like(cur, t)
                store(views.write, scales and scales.write, dst[keep], version[keep], s[keep])
        if not speculative:
            store(views.write, scales and scales.write, dst[keep], torch.zeros_like(dst[keep]), s[keep])
        return out

    return step
