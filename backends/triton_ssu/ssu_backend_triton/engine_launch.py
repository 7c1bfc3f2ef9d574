"""The engines' call forms on the triton backend: the callables its ``ssu_engine_call`` hook
returns (``ssu.contract.PackedStepFn``, ``ssu.contract.VerifyStepFn``), each one launch of a
kernel of :mod:`~ssu_backend_triton.engine_kernel` per call, with no allocation but an ``out`` not
given and no host synchronisation: CUDA-graph capturable.

The launch shape (rows of P per program, warps, prefetch, programmatic launch) is
:func:`default_shape`'s per problem and batch, or what the options pin (``block_p``,
``num_warps``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ssu.contract.dtypes import ITEMSIZE
from ssu.state.slot_kernels import pdl_capable
from ssu.state.slot_state import uses_cursor

from .engine_kernel import packed_kernel, verify_kernel
from .launch import cdiv, kernel_call, next_power_of_2, quant_code


class Shape(NamedTuple):
    """A launch shape of the engine call kernels: ``block_p`` rows of P per program, ``num_warps``;
    ``prefetch`` (1: every token's inputs and table cells loaded before the first store, see
    :mod:`~ssu_backend_triton.engine_kernel`) and ``pdl`` (1: programmatic dependent launch, where
    the GPU has it)."""

    block_p: int
    num_warps: int
    prefetch: int = 1
    pdl: int = 1


#: programs a launch of the engine call kernels should have at least, where the tile allows: about
#: sixteen per SM of an H100, below which a small batch leaves the GPU waiting on few long programs
MIN_PROGRAMS = 2048
#: the most tokens a sequence may carry for its inputs all to be loaded before the first store
#: (``prefetch``): with 8, the large tile's registers spill
PREFETCH_TOKENS = 4


def default_shape(problem, batch: int = 0) -> Shape:
    """A program of two warps per tile of about 2048 values (at least one row, at most all of P),
    the fastest of the shapes timed for both call forms on an H100 at T = 4 from batch 2 to 512
    with bf16 states and from batch 4 with fp32 ones; a 4-byte state whose batch (sequences or
    rows) gives fewer than :data:`MIN_PROGRAMS` such programs takes tiles of 4 rows instead (one
    warp per 1024 values), which timed 1 to 17 % faster at batches 1 and 2 (docs/benchmarks.md,
    "Against the engines' own kernels"). Every token's inputs are prefetched and the launch is
    programmatic (:class:`Shape`) where a sequence carries at most :data:`PREFETCH_TOKENS`."""
    width = next_power_of_2(problem.dstate)
    rows = min(next_power_of_2(max(1, 2048 // width)), next_power_of_2(problem.headdim))
    prefetch = int(problem.tokens_per_step <= PREFETCH_TOKENS)
    large = Shape(rows, 2, prefetch)
    if batch <= 0 or ITEMSIZE[problem.state_dtype] < 4:
        return large
    if cdiv(problem.headdim, rows) * problem.nheads * batch >= MIN_PROGRAMS:
        return large
    small = min(4, rows)
    return Shape(small, max(1, min(2, small * width // 1024)), prefetch)


class _Layer(NamedTuple):
    """One layer's state as a launch takes it: values, scales, the cursor of an allocated
    speculative state, and their strides."""

    values: object
    scales: object
    cursor: object
    strides: tuple


def _layer(state, layer: int, quantized: bool, placeholder) -> _Layer:
    values = state.views[layer].read
    scales = state.scales[layer].read if quantized else placeholder
    cursor = state.buffers["cursor"] if uses_cursor(state) else placeholder
    vs = values.stride()
    ss = scales.stride() if quantized else (0, 0, 0)
    return _Layer(values, scales, cursor, (vs[0], vs[1], vs[2], vs[3], ss[0], ss[1], ss[2]))


class EngineLaunches:
    """The engine call forms of one kernel: its problem's constants, the launch shapes, the
    kernel's fault record and (stochastic rounding) seed."""

    def __init__(self, ctx) -> None:
        p = self.problem = ctx.problem
        self.options = ctx.options
        self.faults = ctx.faults
        self.seed = (ctx.scratch or {}).get("seed")
        self.quantized = p.quantized
        prefetch = int(p.tokens_per_step <= PREFETCH_TOKENS)
        pinned = Shape(self.options.block_p, self.options.num_warps or 4, prefetch) if self.options.block_p else None
        self.pinned = pinned
        #: the launch shape of each batch (1..max_batch): pinned, or the default for that batch
        self.shapes = [pinned or default_shape(p, b) for b in range(p.max_batch + 1)]
        #: programmatic dependent launch where the shape asks for it and the GPU has it
        self.pdl = p.device_type == "cuda" and pdl_capable(torch.device(p.device))

    def _common(self, state, layer, A, D, dt_bias):
        p = self.problem
        here = self.faults
        lay = _layer(state, layer, self.quantized, here)
        consts = dict(
            HEADS_PER_GROUP=p.heads_per_group,
            P=p.headdim,
            N=p.dstate,
            BLOCK_N=next_power_of_2(p.dstate),
            CURSOR=uses_cursor(state),
            STOCHASTIC=self.options.stochastic_rounding,
            PHILOX_ROUNDS=self.options.philox_rounds,
            QUANT=quant_code(lay.values.dtype) if self.quantized else 0,
        )
        heads = (A.stride(0), 0 if D is None else D.stride(0), 0 if dt_bias is None else dt_bias.stride(0))
        return lay, consts, heads

    def packed(self):
        """vLLM's call (``ssu.contract.PackedStepFn``)."""
        p = self.problem
        faults, seed = self.faults, self.seed
        shapes, pdl = self.shapes, self.pdl

        def packed_step(
            state, x, dt, A, B, C, slots, dst_slots=None, num_accepted=None, cu_seqlens=None, D=None, z=None,
            dt_bias=None, dt_softplus=False, out=None, layer=0,
        ):  # fmt: skip
            if out is None:
                out = torch.empty_like(x)
            tokens = x.shape[0]
            N = tokens if cu_seqlens is None else cu_seqlens.shape[0] - 1
            W = slots.shape[1]
            dst = slots if dst_slots is None else dst_slots
            lay, consts, heads = self._common(state, layer, A, D, dt_bias)
            shape = shapes[min(N, p.max_batch)]
            zs = z.stride()[:3] if z is not None else (0, 0, 0)
            xs, os_ = x.stride(), out.stride()
            grid = (cdiv(p.headdim, shape.block_p), p.nheads, N)
            kernel_call(packed_kernel, grid)(
                lay.values, lay.scales, lay.cursor, x, dt, A, B, C, D if D is not None else A,
                z if z is not None else x, dt_bias if dt_bias is not None else A, out, slots, dst,
                num_accepted if num_accepted is not None else slots,
                cu_seqlens if cu_seqlens is not None else slots, faults, seed if seed is not None else faults,
                p.pad_slot_id, p.num_slots, tokens, W, *lay.strides, *heads,
                xs[0], xs[1], xs[2], dt.stride(0), dt.stride(1), *B.stride(), *C.stride(), *zs, *os_,
                slots.stride(0), slots.stride(1), dst.stride(0), dst.stride(1),
                D is not None, z is not None, dt_bias is not None, bool(dt_softplus),
                T=W, BLOCK_P=shape.block_p, HAS_CU=cu_seqlens is not None,
                HAS_ACCEPTED=num_accepted is not None, PREFETCH=bool(shape.prefetch), PDL=pdl and bool(shape.pdl),
                num_warps=shape.num_warps, launch_pdl=pdl and bool(shape.pdl), **consts,
            )  # fmt: skip
            if seed is not None:
                seed.add_(1)
            return out

        return packed_step

    def verify(self):
        """SGLang's call (``ssu.contract.VerifyStepFn``)."""
        p = self.problem
        faults, seed = self.faults, self.seed
        shapes, pdl = self.shapes, self.pdl

        def verify_step(
            state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0,
            update_state=True, buffer=None, buffer_rows=None, parents=None,
        ):  # fmt: skip
            if out is None:
                out = torch.empty_like(x)
            b, T = x.shape[0], x.shape[1]
            lay, consts, heads = self._common(state, layer, A, D, dt_bias)
            shape = shapes[min(b, p.max_batch)]
            zs = z.stride() if z is not None else (0, 0, 0, 0)
            bs = buffer.stride() if buffer is not None else (0, 0, 0, 0, 0)
            ps = parents.stride() if parents is not None else (0, 0)
            grid = (cdiv(p.headdim, shape.block_p), p.nheads, b)
            kernel_call(verify_kernel, grid)(
                lay.values, lay.scales, lay.cursor, x, dt, A, B, C, D if D is not None else A,
                z if z is not None else x, dt_bias if dt_bias is not None else A, out, slots,
                buffer if buffer is not None else x, buffer_rows if buffer_rows is not None else slots,
                parents if parents is not None else slots, faults, seed if seed is not None else faults,
                p.pad_slot_id, p.num_slots, 0 if buffer is None else buffer.shape[0], *lay.strides, *heads,
                *x.stride(), dt.stride(0), dt.stride(1), dt.stride(2), *B.stride(), *C.stride(), *zs, *out.stride(),
                bs[0], bs[1], bs[2], bs[3], ps[0], ps[1],
                D is not None, z is not None, dt_bias is not None, bool(dt_softplus),
                T=T, BLOCK_P=shape.block_p, HAS_BUFFER=buffer is not None, HAS_ROWS=buffer_rows is not None,
                HAS_PARENTS=parents is not None, UPDATE=bool(update_state), PREFETCH=bool(shape.prefetch),
                PDL=pdl and bool(shape.pdl), num_warps=shape.num_warps, launch_pdl=pdl and bool(shape.pdl), **consts,
            )  # fmt: skip
            if seed is not None and update_state:
                seed.add_(1)
            return out

        return verify_step
