"""The flashinfer backend's engine call forms (docs/spec.md, "Engine call forms"): vLLM's packed
call and SGLang's verify call, each FlashInfer's own form of it (``cu_seqlens`` with counts and
two-dimensional tables; an intermediate-state buffer), behind one guard launch
(:mod:`.engine_rows`) that hands FlashInfer only ids it may use.

What FlashInfer's form does not do itself, the callable does: a destination table is always
passed (FlashInfer writes only the last state without one), the state after a verify call's last
token is copied from the buffer into the cache when the call updates it (FlashInfer's SM90 kernel
writes only the buffer then). FlashInfer keeps the buffer in the cache's dtype, fully contiguous,
and follows no parent tokens: those calls are refused.
"""

from __future__ import annotations

import torch

from ssu.contract.errors import InputError

from .engine_rows import copy_last_states, packed_rows, verify_rows
from .rows import layer_rows
from .translate import WeightCache, per_head, tie_hdim


def engine_scratch(problem) -> dict:
    """Buffers of the guarded tables, allocated once per kernel, before any CUDA-graph capture."""
    b, T, dev = problem.max_batch, problem.tokens_per_step, problem.device
    scratch = {}
    for dtype in (torch.int32, torch.int64):
        scratch[dtype] = dict(
            read=torch.empty(b, T, dtype=dtype, device=dev),
            write=torch.empty(b, T, dtype=dtype, device=dev),
            rows=torch.empty(b, dtype=dtype, device=dev),
            verify_read=torch.empty(b, dtype=dtype, device=dev),
        )
    scratch["counts"] = torch.empty(b, dtype=torch.int32, device=dev)
    scratch["cu"] = torch.empty(b + 1, dtype=torch.int32, device=dev)
    scratch["rows_of_one"] = torch.arange(b + 1, dtype=torch.int32, device=dev)
    return scratch


class _Weights:
    """D (zeros when absent) and dt_bias in dt's dtype, as FlashInfer takes them (converted once per tensor)."""

    def __init__(self, zero_D) -> None:
        self.zero_D = zero_D
        self.converted = WeightCache()

    def __call__(self, dt, D, dt_bias):
        weight = dt.dtype
        D = self.zero_D[weight] if D is None else (D if D.dtype == weight else self.converted(per_head(D), weight))
        if dt_bias is not None and dt_bias.dtype != weight:
            dt_bias = self.converted(per_head(dt_bias), weight)
        return D, dt_bias


def make_packed(ctx):
    """vLLM's call (``ssu.contract.PackedStepFn``) through FlashInfer's cu_seqlens form."""
    from flashinfer.mamba import selective_state_update

    p, options = ctx.problem, ctx.options
    scratch = ctx.scratch["engine"]
    weights = _Weights(ctx.scratch["zero_D"])
    seed, record = ctx.scratch.get("seed"), ctx.faults

    def packed_step(
        state, x, dt, A, B, C, slots, dst_slots=None, num_accepted=None, cu_seqlens=None, D=None, z=None,
        dt_bias=None, dt_softplus=False, out=None, layer=0,
    ):  # fmt: skip
        if out is None:
            out = torch.empty_like(x)
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        W = slots.shape[1]
        buf = scratch[slots.dtype]
        read, write = buf["read"][:N, :W], buf["write"][:N, :W]
        counts = scratch["counts"][:N] if num_accepted is not None else None
        cu = scratch["cu"][: N + 1] if cu_seqlens is not None else None
        packed_rows(
            slots, slots if dst_slots is None else dst_slots, num_accepted, cu_seqlens, read, write, counts, cu, record,
            tokens=x.shape[0], num_slots=p.num_slots, pad=p.pad_slot_id,
        )  # fmt: skip
        D, dt_bias = weights(dt, D, dt_bias)
        if cu is None:  # one token a sequence: FlashInfer reads tables only with offsets, here 0, 1, ..., N
            cu = scratch["rows_of_one"][: N + 1]
        kwargs = dict(
            state=layer_rows(state)[layer].rows, x=x, B=B, C=C, z=z, **tie_hdim(p, dt, A, D, dt_bias, x),
            dt_softplus=dt_softplus, state_batch_indices=read, dst_state_batch_indices=write, pad_slot_id=-1,
            out=out, cu_seqlens=cu, num_accepted_tokens=counts, cache_steps=W, algorithm=options.algorithm,
        )  # fmt: skip
        if seed is not None:
            kwargs.update(rand_seed=seed, philox_rounds=options.philox_rounds)
        selective_state_update(**kwargs)
        if seed is not None:
            seed.add_(1)
        return out

    return packed_step


def make_verify(ctx):
    """SGLang's call (``ssu.contract.VerifyStepFn``) through FlashInfer's intermediate-buffer form."""
    from flashinfer.mamba import selective_state_update

    p, options = ctx.problem, ctx.options
    scratch = ctx.scratch["engine"]
    weights = _Weights(ctx.scratch["zero_D"])
    seed, record = ctx.scratch.get("seed"), ctx.faults

    def verify_step(
        state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0,
        update_state=True, buffer=None, buffer_rows=None, parents=None,
    ):  # fmt: skip
        if parents is not None:
            raise InputError(
                "parents: backend 'flashinfer' runs a verify call's tokens as a chain (FlashInfer follows no parent "
                "tokens); choose a backend that declares the 'tree' call form (reference, triton)"
            )
        target = layer_rows(state)[layer].rows
        if buffer is not None and (buffer.dtype != target.dtype or not buffer.is_contiguous()):
            layout = "" if buffer.is_contiguous() else ", not contiguous"
            raise InputError(
                f"buffer: backend 'flashinfer' keeps the intermediate states in the cache's dtype ({target.dtype}), "
                f"in a contiguous buffer; got {buffer.dtype}{layout}. Allocate it so, or choose a backend that takes "
                "any buffer (reference, triton)"
            )
        if out is None:
            out = torch.empty_like(x)
        b, T = x.shape[:2]
        buf = scratch[slots.dtype]
        read, rows = buf["verify_read"][:b], buf["rows"][:b]
        verify_rows(
            slots, buffer_rows, read, rows if buffer is not None else None, record, num_slots=p.num_slots,
            pad=p.pad_slot_id, buffer_rows=0 if buffer is None else buffer.shape[0],
        )  # fmt: skip
        D, dt_bias = weights(dt, D, dt_bias)
        kwargs = dict(
            state=target, x=x, B=B, C=C, z=z, **tie_hdim(p, dt, A, D, dt_bias, x), dt_softplus=dt_softplus,
            state_batch_indices=read, pad_slot_id=-1, out=out, algorithm=options.algorithm,
            disable_state_update=not update_state,
        )  # fmt: skip
        if buffer is not None:
            kwargs.update(
                intermediate_states_buffer=buffer, intermediate_state_indices=rows, cache_steps=buffer.shape[1]
            )
        if seed is not None:
            kwargs.update(rand_seed=seed, philox_rounds=options.philox_rounds)
        selective_state_update(**kwargs)
        if buffer is not None and update_state:  # the SM90 kernel writes only the buffer then
            copy_last_states(target, buffer, read, rows, T - 1)
        if seed is not None:
            seed.add_(1)
        return out

    return verify_step
