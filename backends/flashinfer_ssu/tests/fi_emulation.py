"""A CPU stand-in for FlashInfer's ``selective_state_update``, written from its documented
contract and the rules its C++ checks, so that every line of this backend around the kernel
(cache rows, guards, sinks, destination slots, drafts of adopted caches, commits) is tested in CI
without a GPU.

It enforces the layout rules (broadcast A, dt, D and dt_bias; contiguous heads; D and dt_bias in
dt's dtype; one index dtype), then per batch row: a row whose read index is the pad id reads a
zero state and writes none; one token writes the state to its destination row (or the row it
read); several tokens write token t's state to ``dst_state_batch_indices[b, t]`` (a pad id there:
no write), or to the intermediate buffer at ``intermediate_state_indices[b]``, or the last
token's state to the row read. Unlike the real kernel, an index outside the cache raises: a
guard that let one through fails the tests instead of corrupting memory.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

import ssu
from ssu_backend_flashinfer import plugin as real_plugin

NAME = "flashinfer-emulated"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"selective_state_update (emulated): {message}")


def selective_state_update(
    state,
    x,
    dt,
    A,
    B,
    C,
    D,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    state_batch_indices=None,
    pad_slot_id=-1,
    state_scale=None,
    out=None,
    disable_state_update=False,
    intermediate_states_buffer=None,
    intermediate_state_indices=None,
    intermediate_state_scales=None,
    rand_seed=None,
    philox_rounds=10,
    cache_steps=0,
    algorithm="auto",
    dst_state_batch_indices=None,
    cu_seqlens=None,
    num_accepted_tokens=None,
    backend="auto",
):
    cache, H, P, N = state.shape
    _require(state.stride()[1:] == (P * N, N, 1), "state heads must be contiguous")
    if cu_seqlens is not None and x.dim() == 3:
        return _varlen(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, pad_slot_id, out,
            cache_steps, dst_state_batch_indices, cu_seqlens, num_accepted_tokens, intermediate_states_buffer,
        )  # fmt: skip
    multi = x.dim() == 4
    if not multi:
        x, dt, B, C = x[:, None], dt[:, None], B[:, None], C[:, None]
        z = None if z is None else z[:, None]
    b, T = x.shape[:2]
    G = B.shape[2]
    _require(dt.shape == (b, T, H, P) and dt.stride(-1) == 0, "dt must be tie_hdim")
    _require(A.shape == (H, P, N) and A.stride() == (1, 0, 0) and A.dtype == torch.float32, "A must be tie_hdim fp32")
    _require(D.shape == (H, P) and D.stride() == (1, 0) and D.dtype == dt.dtype, "D must be tie_hdim, dt's dtype")
    if dt_bias is not None:
        _require(dt_bias.shape == (H, P) and dt_bias.stride() == (1, 0) and dt_bias.dtype == dt.dtype, "dt_bias")
    _require(out is not None and out.is_contiguous(), "out contiguous")
    _require(
        not (intermediate_states_buffer is not None and dst_state_batch_indices is not None),
        "intermediate_states_buffer and dst_state_batch_indices are mutually exclusive",
    )
    if state_batch_indices is not None and dst_state_batch_indices is not None:
        _require(state_batch_indices.dtype == dst_state_batch_indices.dtype, "index dtypes must match")
    outs = out if multi else out[:, None]
    hpg = H // G
    a = A[:, 0, 0]
    for i in range(b):
        r = i if state_batch_indices is None else int(state_batch_indices[i])
        pad = r == pad_slot_id
        if not pad:
            _require(0 <= r < cache, f"read index {r} outside the cache of {cache} rows")
        s = torch.zeros(H, P, N) if pad else state[r].float()
        for t in range(T):
            d = dt[i, t, :, 0].float() + (0 if dt_bias is None else dt_bias[:, 0].float())
            if dt_softplus:
                d = torch.where(d > 20, d, F.softplus(d))
            xt = x[i, t].float()
            s = (
                s * torch.exp(a * d)[:, None, None]
                + (d[:, None] * xt)[..., None] * B[i, t].float().repeat_interleave(hpg, 0)[:, None, :]
            )
            y = (s * C[i, t].float().repeat_interleave(hpg, 0)[:, None, :]).sum(-1) + D[:, 0].float()[:, None] * xt
            if z is not None:
                zt = z[i, t].float()
                y = y * zt * torch.sigmoid(zt)
            outs[i, t] = y.to(out.dtype)
            if pad:
                continue
            if multi and dst_state_batch_indices is not None:
                w = int(dst_state_batch_indices[i, t])
                if w != pad_slot_id:
                    _require(0 <= w < cache, f"destination {w} outside the cache")
                    state[w] = s.to(state.dtype)
            elif multi and intermediate_states_buffer is not None:
                buffer = intermediate_states_buffer
                _require(buffer.is_contiguous() and buffer.dtype == state.dtype, "buffer contiguous, the state's dtype")
                w = r if intermediate_state_indices is None else int(intermediate_state_indices[i])
                steps = buffer.view(
                    -1, H, P, N
                )  # FlashInfer's SM90 kernel: cache_steps blocks a row, whatever the shape
                _require(0 <= w * cache_steps + t < steps.shape[0], f"buffer row {w} outside the buffer")
                steps[w * cache_steps + t] = s.to(buffer.dtype)
        if not pad and not multi and not disable_state_update:
            w = r if dst_state_batch_indices is None else int(dst_state_batch_indices[i])
            _require(0 <= w < cache, f"destination {w} outside the cache")
            state[w] = s.to(state.dtype)
        if (
            not pad
            and multi
            and dst_state_batch_indices is None
            and intermediate_states_buffer is None
            and not disable_state_update
        ):
            state[r] = s.to(state.dtype)
    return out


def _varlen(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, sbi, pad, out, cache_steps, dst, cu, accepted, buffer):
    """FlashInfer's packed form (x (tokens, H, P) with cu_seqlens), as its SM90 kernel runs it:
    sequence n starts from column max(accepted[n] - 1, 0) of its row of the table (a pad id there: a
    zero state and no writes), token t's state goes to dst[n, t] unless that is the pad id; without
    a destination table only the last state, back to the slot read. A sequence longer than
    cache_steps raises here (the real kernel overruns its shared memory)."""
    cache, H, P, N = state.shape
    _require(dt.dim() == 3 and dt.stride(-1) == 0, "dt must be (tokens, H, P) with stride 0 over P")
    _require(A.shape == (H, P, N) and A.stride() == (1, 0, 0), "A must be tie_hdim")
    _require(D.shape == (H, P) and D.stride() == (1, 0) and D.dtype == dt.dtype, "D must be tie_hdim, dt's dtype")
    _require(buffer is None, "the emulation serves no buffer with cu_seqlens")
    _require(cu.is_contiguous() and (accepted is None or accepted.is_contiguous()), "offsets and counts contiguous")
    _require(sbi is not None and (dst is None or dst.dtype == sbi.dtype), "index tables of one dtype")
    G = B.shape[1]
    hpg = H // G
    a = A[:, 0, 0]
    for n in range(cu.shape[0] - 1):
        bos, eos = int(cu[n]), int(cu[n + 1])
        if eos - bos <= 0:
            continue
        _require(eos - bos <= cache_steps, f"sequence {n} has {eos - bos} tokens, more than cache_steps={cache_steps}")
        _require(0 <= bos and eos <= x.shape[0], f"sequence {n}'s rows {bos}..{eos} outside x")
        column = 0 if accepted is None else max(int(accepted[n]) - 1, 0)
        _require(sbi.dim() == 1 or column < sbi.shape[1], f"start column {column} outside the table")
        r = int(sbi[n]) if sbi.dim() == 1 else int(sbi[n, column])
        padded = r == pad
        if not padded:
            _require(0 <= r < cache, f"read index {r} outside the cache of {cache} rows")
        s = torch.zeros(H, P, N) if padded else state[r].float()
        for t in range(eos - bos):
            i = bos + t
            d = dt[i, :, 0].float() + (0 if dt_bias is None else dt_bias[:, 0].float())
            if dt_softplus:
                d = torch.where(d > 20, d, F.softplus(d))
            xt = x[i].float()
            s = (
                s * torch.exp(a * d)[:, None, None]
                + (d[:, None] * xt)[..., None] * B[i].float().repeat_interleave(hpg, 0)[:, None, :]
            )
            y = (s * C[i].float().repeat_interleave(hpg, 0)[:, None, :]).sum(-1) + D[:, 0].float()[:, None] * xt
            if z is not None:
                y = y * z[i].float() * torch.sigmoid(z[i].float())
            out[i] = y.to(out.dtype)
            if padded:
                continue
            if dst is not None:
                w = int(dst[n, t]) if dst.dim() == 2 else int(dst[n])
                if w != pad:
                    _require(0 <= w < cache, f"destination {w} outside the cache")
                    state[w] = s.to(state.dtype)
            elif t == eos - bos - 1:
                state[r] = s.to(state.dtype)
    return out


@ssu.hookimpl
def _backend():
    import attrs

    spec = real_plugin.ssu_backend()
    return attrs.evolve(spec, name=NAME, capabilities=attrs.evolve(spec.capabilities, devices={"cpu"}))


@ssu.hookimpl
def _probe(device):
    return ssu.AVAILABLE


@ssu.hookimpl
def _supports(problem, options):
    return ssu.ACCEPT


def emulated_plugin():
    """The real plugin's hooks, but named ``flashinfer-emulated`` and running on the CPU."""
    hooks = {
        name: getattr(real_plugin, name)
        for name in dir(real_plugin)
        if name.startswith("ssu_") and callable(getattr(real_plugin, name))
    }
    hooks.update(ssu_backend=_backend, ssu_probe=_probe, ssu_supports=_supports)
    return types.SimpleNamespace(__name__="flashinfer_emulated", **hooks)
