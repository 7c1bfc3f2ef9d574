"""The launch of the Triton SSU kernel: launch constants, strides, grid and keyword arguments in
one place, shared by the eager step and the custom op that torch.compile traces."""

from __future__ import annotations

import functools
from typing import NamedTuple


from ssu.state.slot_kernels import pdl_capable

from . import fast_launch
from .kernel import ssu_kernel
from .interpreter import interpreting


def kernel_call(jit, grid, compile_only: bool = False):
    """The launch of a Triton kernel on ``grid``: on a GPU through :func:`fast_launch.launch` (the
    compiled kernel launched directly once its launch key was seen), in the interpreter
    ``jit[grid]``; with ``compile_only`` the same call compiles it instead (``jit.warmup`` on
    ``grid``), which is what :func:`~ssu_backend_triton.tuning.compile_in_parallel` queues."""
    if compile_only:
        return functools.partial(jit.warmup, grid=grid)
    if interpreting():
        return jit[grid]
    return functools.partial(fast_launch.launch, jit, grid)


#: the kernel's QUANT code of each 8-bit cache dtype (0: a floating-point cache)
QUANT_CODES = {"torch.int8": 1, "torch.float8_e4m3fn": 2}
#: added to the code in Triton's interpreter, which runs no inline PTX and whose e4m3 cast can
#: drop a carry (:func:`ssu_backend_triton.tiles.quantized_rows`)
QUANT_INTERPRETED = 2


def quant_code(dtype) -> int:
    """The kernel's QUANT code of an 8-bit cache dtype, here (interpreted or compiled)."""
    return QUANT_CODES[str(dtype)] + (QUANT_INTERPRETED if interpreting() else 0)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers: ``triton.cdiv`` without the constexpr-function wrapper
    that makes each call of it cost microseconds on the launch path."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at least ``n`` (n >= 1): ``triton.next_power_of_2``, plain."""
    return 1 << (n - 1).bit_length()


def _strides(t, lead: int):
    """Strides of a (b, [T,] ...) tensor as (b, t, rest...) with a zero token stride if absent (a
    per-head dt expanded over P keeps its head stride third; its P stride, 0, is not read)."""
    st = t.stride()
    return (st[0], 0) + st[1:] if lead == 1 else st


class StepConstants(NamedTuple):
    """What a kernel's every launch shares: from the problem, the state's layout and the options."""

    pad_slot_id: int
    num_slots: int
    heads_per_group: int
    speculative: bool
    cursor: bool  # speculative versions found through a cursor (an allocated state)
    versions: int
    stochastic: bool
    philox_rounds: int


def arguments(
    read,
    write,
    cursor,
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
    consts: StepConstants,
    schedule,
    scales=None,
):
    """The launch of one step of one layer as ``(grid, args, kwargs)`` of ``ssu_kernel[grid](*args,
    **kwargs)``: states read from ``read`` and written to ``write``, both (slots, versions, H, P, N)
    views (:class:`ssu.state.slot_state.LayerViews`); ``schedule`` a
    :class:`~ssu_backend_triton.tuning.Schedule`: ``block_p`` rows per tile, ``num_warps``,
    ``tiles`` per program and the ``stages`` of its pipelined loop (see the module docstring),
    ``maxnreg`` a cap on registers per thread (0: the compiler's choice; it sets how many
    programs, hence how many bytes in flight, fit on an SM), ``pdl`` for programmatic dependent
    launch (ignored below compute capability 9.0 and in the interpreter: the program lets the
    next kernel be scheduled at once and waits for the previous kernel to finish before it reads
    anything, so the launch of one step overlaps the drain of the kernel before it) and
    ``branchless`` (the optional inputs loaded with predicated loads instead of uniform
    branches). ``scales``: for an 8-bit cache, the (slots, versions, H, P) views its row scales
    are read from and written to (:attr:`ssu.State.scales`), else None. The kernel's first
    :data:`POINTERS` parameters are tensors, the rest integers, flags and constants."""
    block_p, num_warps, tiles, stages, maxnreg, pdl, branchless = schedule
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
    rs = read.stride()
    ws = write.stride()
    grid = (cdiv(P, block_p * tiles), H, b)
    pdl = bool(pdl) and pdl_capable(read.device)
    if scales is not None:
        read_scale, write_scale = scales
        rss, wss = read_scale.stride(), write_scale.stride()
        quant = quant_code(read.dtype)
    else:  # the scale parameters are not read: any tensor stands for them
        read_scale = write_scale = slots
        rss = wss = (0, 0, 0)
        quant = 0
    args = (
        read,
        write,
        cursor if cursor is not None else slots,
        x,
        dt,
        A,
        B,
        C,
        slots,
        dst_slots if dst_slots is not None else slots,
        D if D is not None else A,
        z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        out,
        seed if seed is not None else slots,
        faults,
        read_scale,
        write_scale,
        consts.pad_slot_id,
        consts.num_slots,
        rs[0],
        rs[1],
        ws[0],
        ws[1],
        rs[2],
        rs[3],
        A.stride(0),
        0 if D is None else D.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        xs[0],
        xs[1],
        xs[2],
        xs[3],
        dts[0],
        dts[1],
        dts[2],
        Bs[0],
        Bs[1],
        Bs[2],
        Bs[3],
        Cs[0],
        Cs[1],
        Cs[2],
        Cs[3],
        zs[0],
        zs[1],
        zs[2],
        zs[3],
        os_[0],
        os_[1],
        os_[2],
        os_[3],
        rss[0],
        rss[1],
        rss[2],
        wss[0],
        wss[1],
        wss[2],
        D is not None,
        z is not None,
        dt_bias is not None,
        bool(dt_softplus),
    )
    kwargs = dict(
        T=T,
        K=consts.versions,
        HEADS_PER_GROUP=consts.heads_per_group,
        P=P,
        N=N,
        BLOCK_P=block_p,
        BLOCK_N=next_power_of_2(N),
        EVEN_N=next_power_of_2(N) == N,
        TILES=tiles,
        STAGES=stages,
        SPECULATIVE=consts.speculative,
        CURSOR=consts.cursor,
        HAS_DST=dst_slots is not None,
        STOCHASTIC=consts.stochastic,
        PHILOX_ROUNDS=consts.philox_rounds,
        PDL=pdl,
        BRANCHLESS=bool(branchless),
        QUANT=quant,
        num_warps=num_warps,
        maxnreg=maxnreg or None,
        launch_pdl=pdl,
    )
    return grid, args, kwargs


def launch(*call, compile_only: bool = False):
    """Launch one step of one layer (:func:`arguments` takes the same arguments) through
    :func:`kernel_call`. Returns Triton's handle of the compiled kernel (its PTX and register count
    are what tests and the schedule probe inspect; None when interpreted). With ``compile_only``
    the kernel is compiled (or queued for compilation,
    :func:`~ssu_backend_triton.tuning.compile_in_parallel`), not run."""
    grid, args, kwargs = arguments(*call)
    return kernel_call(ssu_kernel, grid, compile_only)(*args, **kwargs)
