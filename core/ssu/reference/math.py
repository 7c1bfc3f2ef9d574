"""The reference step: SPEC.md's equations in plain PyTorch, fp32 arithmetic, any device.

Within one step the T tokens of a sequence chain in fp32; each token's state is written to the
cache rounded to its dtype (round to nearest). Slow on purpose: it is the oracle, not a contender.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import slot_state


def make_step(ctx):
    """Factory of the reference backend: the step callable for one kernel."""
    p = ctx.problem
    hpg = p.heads_per_group
    pad = p.pad_slot_id
    speculative = p.speculative
    K = slot_state.versions(p)

    def step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0):
        if out is None:
            out = torch.empty_like(x)
        xs, dts, Bs, Cs = x, dt, B, C
        zs, outs = z, out
        if not speculative:  # give every tensor a token axis of length 1
            xs, dts, Bs, Cs = x[:, None], dt[:, None], B[:, None], C[:, None]
            zs = None if z is None else z[:, None]
            outs = out[:, None]
        ssm = state.buffers["ssm"][layer]                      # (S, K, H, P, N)
        valid = slots != pad
        idx = torch.where(valid, slots, torch.zeros_like(slots)).long()
        cur = slot_state.current_version(state, idx)
        s = ssm[idx, cur].float()
        s[~valid] = 0.0                                         # a pad row reads a zero state
        rows = idx[valid]
        Af = A.float()
        for t in range(xs.shape[1]):
            d = dts[:, t].float()
            if dt_bias is not None:
                d = d + dt_bias.float()
            if dt_softplus:
                d = F.softplus(d)                               # threshold 20: identity above
            dA = torch.exp(Af * d)                              # (b, H)
            xt = xs[:, t].float()                               # (b, H, P)
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
            if speculative:
                dest = ((cur + 1 + t) % K)[valid]
                ssm[rows, dest] = s[valid].to(ssm.dtype)
        if not speculative:
            ssm[rows, 0] = s[valid].to(ssm.dtype)
        return out

    return step
