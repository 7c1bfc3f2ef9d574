"""The launches of the ``triton-replay`` kernels: the step (eager, and as the custom op
``torch.ops.ssu_triton.replay_step`` that torch.compile traces) and the commit."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ssu.state.slot_kernels import pdl_capable

from ..launch import _strides, cdiv, kernel_call, next_power_of_2, quant_code
from .fold import fold_kernel
from .gram import gram_kernel
from .kernel import replay_kernel, ring_commit_kernel

#: rows of a fold kernel's tile (a matrix product needs at least 16), its warps, the pipeline
#: stages of its tile loop, and whether the step kernel runs beside it (programmatic launch)
FOLD_ROWS = 32
FOLD_WARPS = 4
FOLD_STAGES = 2
FOLD_CONCURRENT = True


class Plan(NamedTuple):
    """How one step is launched, per batch bucket: ``block_p`` rows of a head per tile,
    ``num_warps`` per program, ``tiles`` per program, the pipeline ``stages`` of a program's loop
    over its tiles (0: not pipelined), the flush ``window`` (ring tokens a step may leave unfolded:
    0 writes the checkpoint every step), ``pdl`` (programmatic dependent launch), ``fold``: the
    heads per program of the fold kernel that folds the rows that flush, launched before the step
    kernel (0: those rows fold inside the step kernel); ``stepwise``: a speculative step of window 0
    without the fold kernel computes its tokens' outputs by applying them to each tile one by one
    (no B . C products, no gram kernel; 0: from the gram kernel's products; other plans ignore it)."""

    block_p: int
    num_warps: int
    tiles: int = 1
    stages: int = 0
    window: int = 0
    pdl: int = 0
    fold: int = 0
    stepwise: int = 0


class ReplayConstants(NamedTuple):
    """What every launch of one kernel shares: from the problem and the options."""

    pad_slot_id: int
    num_slots: int
    heads_per_group: int
    speculative: bool
    ring: int
    stochastic: bool
    philox_rounds: int


def launch(
    views, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, seed, dst_slots, faults, consts, plan,
    compile_only=False,
):  # fmt: skip
    """Launch one step of one layer on ``views`` (:class:`~.layout.ReplayViews`) with ``plan``.
    Returns Triton's handle of the compiled step kernel. With ``compile_only`` the kernels are
    compiled (or queued for compilation, :func:`~.tuning.compile_in_parallel`), not run."""
    block_p, num_warps, tiles, stages, window, pdl, fold, stepwise = plan
    b = x.shape[0]
    multi = x.dim() == 4
    T = x.shape[1] if multi else 1
    H, P = x.shape[-2], x.shape[-1]
    N = B.shape[-1]
    lead = 2 if multi else 1
    xs = _strides(x, lead)
    dts = _strides(dt, lead)
    Bs = _strides(B, lead)
    Cs = _strides(C, lead)
    zs = _strides(z, lead) if z is not None else (0, 0, 0, 0)
    os_ = _strides(out, lead)
    ck = views.ck
    cks = ck.stride()
    scale = views.scale  # an 8-bit checkpoint's row scales (S, H, P), P contiguous; else None
    quant = quant_code(ck.dtype) if scale is not None else 0
    grid = (cdiv(P, block_p * tiles), H, b)
    pdl = bool(pdl) and pdl_capable(ck.device)
    folded = bool(fold)
    heads = math.gcd(fold, consts.heads_per_group) if folded else 1
    # programs of a row that take part in moving its cursors: the step kernel's, and where the row
    # flushes the fold kernel's (when it runs beside the step kernel)
    row_programs = grid[0] * H
    fold_programs = H // heads if folded and FOLD_CONCURRENT else 0
    args = (  # both kernels take the same arguments
        ck, views.x_ring, views.B_ring, views.d_ring, views.a_ring, views.start, views.count, views.ticket,
        x, dt, A, B, C, slots, dst_slots if dst_slots is not None else slots,
        D if D is not None else A, z if z is not None else x, dt_bias if dt_bias is not None else A,
        out, seed if seed is not None else slots, faults,
        consts.pad_slot_id, consts.num_slots, window, row_programs, fold_programs, cks[0], cks[1], cks[2],
        views.x_ring.stride(0), views.B_ring.stride(0), views.d_ring.stride(0),
        A.stride(0), 0 if D is None else D.stride(0), 0 if dt_bias is None else dt_bias.stride(0),
        *xs, *dts[:3], *Bs, *Cs, *zs, *os_,
        D is not None, z is not None, dt_bias is not None, bool(dt_softplus),
        scale if scale is not None else ck, *(scale.stride()[:2] if scale is not None else (0, 0)),
    )  # fmt: skip
    shared = dict(
        RING=consts.ring,
        HEADS_PER_GROUP=consts.heads_per_group,
        P=P,
        N=N,
        HAS_DST=dst_slots is not None,
        STOCHASTIC=consts.stochastic,
        PHILOX_ROUNDS=consts.philox_rounds,
        PDL=pdl,
        CONCURRENT=FOLD_CONCURRENT,
        QUANT=quant,
        launch_pdl=pdl,
    )
    write_through = window == 0 and T == 1 and not consts.speculative and not folded
    stepwise = bool(stepwise) and window == 0 and consts.speculative and not folded
    M, TP = next_power_of_2(consts.ring), next_power_of_2(T)
    gram = views.gram
    if not (write_through or stepwise):  # first: every row's B . C products, shared by the heads of a group
        kernel_call(gram_kernel, (B.shape[-2], b), compile_only)(
            gram, views.B_ring, views.start, views.count, B, C, slots,
            dst_slots if dst_slots is not None else slots, faults,
            consts.pad_slot_id, consts.num_slots, window, views.B_ring.stride(0), gram.stride(0), *Bs, *Cs,
            T=T, TP=TP, RING=consts.ring, M=M, N=N, BLOCK_N=next_power_of_2(N), SPECULATIVE=consts.speculative,
            HAS_DST=dst_slots is not None, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    if folded:  # then: the step kernel starts beside it (programmatic launch) and serves the other rows
        kernel_call(fold_kernel, (H // heads, b), compile_only)(
            *args,
            T=T,
            TQ=max(16, next_power_of_2(T)),
            SPECULATIVE=consts.speculative,
            M=max(16, next_power_of_2(consts.ring)),
            HEADS=heads,
            ROWS=FOLD_ROWS,
            STAGES=FOLD_STAGES,
            BLOCK_N=max(16, next_power_of_2(N)),
            num_warps=FOLD_WARPS,
            **shared,
        )
    return kernel_call(replay_kernel, grid, compile_only)(
        *args,
        gram,
        gram.stride(0),
        T=T,
        TP=TP,
        M=M,
        BLOCK_P=block_p,
        BLOCK_N=next_power_of_2(N),
        TILES=tiles,
        STAGES=stages if tiles > 1 else 0,
        SPECULATIVE=consts.speculative,
        FOLDED=folded,
        WRITE_THROUGH=write_through,
        STEPWISE=stepwise,
        num_warps=num_warps,
        **shared,
    )


def commit(count, slots, num_accepted, faults, *, tokens: int, pad_slot_id: int, num_slots: int, pdl: bool):
    """Add each row's accepted count to its slot's ring count in every layer of ``count`` (Ly, S):
    one launch, graph capturable."""
    b = slots.shape[0]
    block = min(1024, next_power_of_2(max(b, 1)))
    pdl = bool(pdl) and pdl_capable(count.device)
    return ring_commit_kernel[(cdiv(b, block),)](
        count,
        slots,
        num_accepted,
        faults,
        b,
        pad_slot_id,
        num_slots,
        count.shape[0],
        count.stride(0),
        T=tokens,
        BLOCK=block,
        PDL=pdl,
        launch_pdl=pdl,
    )


@torch.library.custom_op(
    "ssu_triton::replay_step",
    mutates_args=(
        "ck",
        "x_ring",
        "B_ring",
        "d_ring",
        "a_ring",
        "start",
        "count",
        "ticket",
        "gram",
        "scale",
        "out",
        "faults",
    ),  # fmt: skip
)
def replay_step_op(
    ck: torch.Tensor,
    x_ring: torch.Tensor,
    B_ring: torch.Tensor,
    d_ring: torch.Tensor,
    a_ring: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    ticket: torch.Tensor,
    gram: torch.Tensor,
    scale: Optional[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    dt_softplus: bool,
    out: torch.Tensor,
    seed: Optional[torch.Tensor],
    dst_slots: Optional[torch.Tensor],
    faults: torch.Tensor,
    consts: list[int],
    plan: list[int],
) -> None:
    """The step as an opaque op: it mutates the layer's checkpoints (and an 8-bit one's row scales),
    rings, cursors and gram rows, ``out`` and the fault record."""
    from .layout import ReplayViews

    views = ReplayViews(ck, x_ring, B_ring, d_ring, a_ring, start, count, ticket, gram, scale)
    launch(
        views,
        x,
        dt,
        A,
        B,
        C,
        slots,
        D,
        z,
        dt_bias,
        dt_softplus,
        out,
        seed,
        dst_slots,
        faults,
        ReplayConstants(*consts),
        Plan(*plan),
    )


@replay_step_op.register_fake
def _replay_step_fake(*args) -> None:
    return None
