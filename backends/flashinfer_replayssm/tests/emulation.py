"""A CPU stand-in for FlashInfer's ``checkpointing_ssu``, written from its documented contract
(docs/spec.md "ReplaySSM" and FlashInfer's docstring), so that every line of this backend around the
kernel (layout, pad slot, cursors, pending flushes, folds, commits) is tested in CI without a GPU.

It enforces the layout rules FlashInfer's C++ checks (shapes, broadcast strides, ring length),
then, per batch row: replays the slot's ``pnat`` ring tokens onto its checkpoint, applies the T
new tokens (outputs after each), appends them at ring rows ``(ring_start + pnat + i) % L``, and
writes the checkpoint (the state after the old tokens) only when ``pnat + T > max_window``.
The GPU tests check the real kernel against the reference the same way.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

import ssu
from ssu_backend_flashinfer_replayssm import plugin as real_plugin

NAME = "replayssm-emulated"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"checkpointing_ssu (emulated): {message}")


def checkpointing_ssu(
    state,
    x_cache,
    B_cache,
    dt_cache,
    ring_start,
    prev_num_accepted_tokens,
    x,
    dt,
    A,
    B,
    C,
    out,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    state_batch_indices=None,
    pad_slot_id=-1,
    algorithm="auto",
    cb_scaled=None,
    cumAdt_vec=None,
    cb_old=None,
    **unused,
):
    cache, H, P, N = state.shape
    b, T = x.shape[:2]
    G = B.shape[2]
    L = x_cache.shape[2]
    W = L - T
    _require(W <= 16 and T <= W, f"ring length {L} with T={T} gives max_window {W}")
    _require(state.stride()[1:] == (P * N, N, 1), "state heads must be contiguous")
    _require(x.shape == (b, T, H, P) and x.stride(2) == P, f"x shape {tuple(x.shape)}")
    _require(dt.shape == (b, T, H, P) and dt.stride(2) == 1 and dt.stride(3) == 0, "dt must be tie_hdim")
    _require(A.shape == (H, P, N) and A.stride() == (1, 0, 0) and A.dtype == torch.float32, "A must be tie_hdim fp32")
    _require(B.shape == (b, T, G, N) and C.shape == (b, T, G, N), "B, C shapes")
    _require(out.shape == x.shape and out.stride(2) == P, "out shape")
    _require(x_cache.shape == (cache, H, L, P) and B_cache.shape == (cache, G, L, N), "ring shapes")
    _require(dt_cache.shape == (cache, H, L) and dt_cache.dtype == torch.float32, "dt ring")
    _require(ring_start.shape == (cache,) and prev_num_accepted_tokens.shape == (cache,), "cursors: one per cache row")
    _require(ring_start.dtype == torch.int32 and prev_num_accepted_tokens.dtype == torch.int32, "cursors int32")
    for name, w in (("D", D), ("dt_bias", dt_bias)):
        if w is not None:
            _require(w.shape == (H, P) and w.stride() == (1, 0), f"{name} must be tie_hdim")
    if D is not None and dt_bias is not None:
        _require(D.dtype == dt_bias.dtype, "D and dt_bias dtypes must match")
    _require(algorithm in ("auto", "monolith", "two-kernel"), f"algorithm {algorithm!r}")
    _require(x.dtype == torch.bfloat16, "input must be bf16")
    hpg = H // G
    rows = torch.arange(b) if state_batch_indices is None else state_batch_indices.long()
    a = A[:, 0, 0].float()
    for i in range(b):
        c = int(rows[i])
        if c == pad_slot_id:
            continue
        _require(0 <= c < cache, f"cache row {c} out of range")
        r0, n = int(ring_start[c]), int(prev_num_accepted_tokens[c])
        _require(0 <= r0 < L and 0 <= n <= W, f"cursors of row {c}: ring_start={r0} pnat={n}")
        s = state[c].float()
        for k in range(n):
            row = (r0 + k) % L
            d = dt_cache[c, :, row]
            Bh = B_cache[c, :, row].float().repeat_interleave(hpg, 0)
            s = (
                s * torch.exp(a * d)[:, None, None]
                + (d[:, None] * x_cache[c, :, row].float())[..., None] * Bh[:, None, :]
            )
        replayed = s
        for t in range(T):
            d = dt[i, t, :, 0].float() + (0 if dt_bias is None else dt_bias[:, 0].float())
            if dt_softplus:
                d = torch.where(d > 20, d, F.softplus(d))
            xt = x[i, t].float()
            Bh = B[i, t].float().repeat_interleave(hpg, 0)
            Ch = C[i, t].float().repeat_interleave(hpg, 0)
            s = s * torch.exp(a * d)[:, None, None] + (d[:, None] * xt)[..., None] * Bh[:, None, :]
            y = (s * Ch[:, None, :]).sum(-1) + (0 if D is None else D.float() * xt)
            if z is not None:
                zt = z[i, t].float()
                y = y * zt * torch.sigmoid(zt)
            out[i, t] = y.to(out.dtype)
            row = (r0 + n + t) % L
            x_cache[c, :, row] = x[i, t]
            B_cache[c, :, row] = B[i, t]
            dt_cache[c, :, row] = d
        if n + T > W:
            state[c] = replayed.to(state.dtype)
    return out


@ssu.hookimpl
def _backend():
    spec = real_plugin.ssu_backend()
    import attrs

    return attrs.evolve(spec, name=NAME, capabilities=attrs.evolve(spec.capabilities, devices={"cpu"}))


@ssu.hookimpl
def _probe(device):
    return ssu.AVAILABLE


def emulated_plugin():
    """The real plugin's hooks, but named ``replayssm-emulated`` and running on the CPU."""
    hooks = {
        name: getattr(real_plugin, name)
        for name in dir(real_plugin)
        if name.startswith("ssu_") and callable(getattr(real_plugin, name))
    }
    hooks.update(ssu_backend=_backend, ssu_probe=_probe)
    return types.SimpleNamespace(__name__="replayssm_emulated", **hooks)
