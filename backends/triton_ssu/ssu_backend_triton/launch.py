"""The launch of the Triton SSU kernel: launch constants, strides, grid and keyword arguments in
one place, shared by the eager step and the custom op that torch.compile traces."""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import torch

from ssu import signatures
from ssu.slot_kernels import pdl_capable

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
    views (:class:`ssu.slot_state.LayerViews`); ``schedule`` a
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


#: the kernel's leading parameters that take tensors (its pointers)
POINTERS = 18
#: torch's current CUDA device and that device's current stream, as Triton reads them
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _PythonLayout:
    """What a torch without C++ tensor guards compares instead: each tensor's sizes, strides, dtype
    and device, as Python values."""

    def __init__(self, *tensors) -> None:
        self.layout = self.of(tensors)

    @staticmethod
    def of(tensors) -> tuple:
        return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)

    def check(self, *tensors) -> bool:
        return self.of(tensors) == self.layout


def layout_guard(tensors):
    """An object whose ``check(*tensors)`` says whether other tensors have these tensors' exact
    sizes, strides, dtypes and devices: torch's C++ guards (about a third of the Python
    comparison's host time), else :class:`_PythonLayout`. A C++ guard never matches one tensor
    passed twice, nor a tensor that needs gradients where this one did not: such calls launch in
    full, never wrongly."""
    guards = signatures.tensor_guards()
    if guards is not None:
        try:
            return guards(
                *tensors,
                dynamic_dims_sizes=[list(t.shape) for t in tensors],
                dynamic_dims_strides=[list(t.stride()) for t in tensors],
            )
        except Exception:  # a torch whose guards take other arguments: the Python comparison
            pass
    return _PythonLayout(*tensors)


#: layouts kept per form of call (beyond it, the oldest is forgotten)
LAYOUTS_PER_FORM = 8


def _layout(device, read, write, cursor, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, dst_slots, consts,
            schedule, scales):  # fmt: skip
    """A call's *form* (:class:`StepLaunches`) and the tensors whose layout a kept launch is for,
    each once (a C++ guard never matches one tensor passed twice)."""
    tensors = (read, x, dt, A, B, C, slots, out)
    if write is not read:
        tensors += (write,)
    tensors += tuple([t for t in (cursor, dst_slots, D, z, dt_bias) if t is not None])
    if scales is not None:
        tensors += (scales.read,) if scales.write is scales.read else (scales.read, scales.write)
    form = (
        device,
        write is read,
        cursor is None,
        dst_slots is None,
        D is None,
        z is None,
        dt_bias is None,
        dt_softplus,
        None if scales is None else scales.write is scales.read,
        consts,
        schedule,
    )
    return form, tensors


class StepLaunches:
    """One kernel's step launches, each made directly through Triton's C launcher
    (:func:`fast_launch.direct`) once a call with the same *layout* was launched the usual way.

    An eager decode step launches one small kernel per layer; what it costs on the host, not the
    kernel, is then the SSU's share of a token. :func:`arguments` builds 70-odd arguments per call
    and ``jit[grid]`` or ``CompiledKernel[grid]`` add their own Python layers on top. Every
    argument but the pointers is fixed by the call's layout: its *form* (which optional inputs are
    given, which tensors are one, softplus, the constants, the schedule, the current device) and
    the sizes, strides, dtypes and devices of its tensors, which a C++ guard compares
    (:func:`layout_guard`). So a call whose layout was seen (and whose pointers are all 16-byte
    aligned, as Triton assumed when it compiled the kernel) passes the kept argument tail with its
    tensors' addresses, and nothing is rebuilt. Any other call goes through :func:`launch` and
    keeps the layout for next time (not in the interpreter, nor where :func:`fast_launch.direct`
    declines).
    """

    def __init__(self, seed, faults) -> None:
        self.seed = seed
        self.faults = faults
        # the kernel's own tensors, allocated once: their addresses do not change
        self.seed_ptr = None if seed is None else seed.data_ptr()
        self.faults_ptr = faults.data_ptr()
        #: form -> [(layout guard, (C launch, fixed launcher arguments, grid x, y, z, kernel args after the pointers))]
        self.direct = {}

    def __call__(
        self,
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
        dst_slots,
        consts,
        schedule,
        scales=None,
    ):
        """Launch one step of one layer (the arguments of :func:`arguments` but ``seed`` and
        ``faults``, which are this kernel's)."""
        device = _current_device() if _current_device is not None else None
        form, tensors = _layout(
            device, read, write, cursor, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, dst_slots, consts,
            schedule, scales,
        )  # fmt: skip
        kept = None
        for guard, entry in self.direct.get(form, ()):
            if guard.check(*tensors):
                kept = entry
                break
        if kept is not None:
            p_read, p_write, p_x, p_dt, p_A = (
                read.data_ptr(),
                write.data_ptr(),
                x.data_ptr(),
                dt.data_ptr(),
                A.data_ptr(),
            )
            p_B, p_C, p_slots, p_out = B.data_ptr(), C.data_ptr(), slots.data_ptr(), out.data_ptr()
            p_cursor = p_slots if cursor is None else cursor.data_ptr()
            p_dst = p_slots if dst_slots is None else dst_slots.data_ptr()
            p_D = p_A if D is None else D.data_ptr()
            p_z = p_x if z is None else z.data_ptr()
            p_dt_bias = p_A if dt_bias is None else dt_bias.data_ptr()
            p_seed = p_slots if self.seed is None else self.seed_ptr
            p_rscale = p_wscale = p_slots
            if scales is not None:
                p_rscale, p_wscale = scales.read.data_ptr(), scales.write.data_ptr()
            # fmt: off
            if not (p_read | p_write | p_cursor | p_x | p_dt | p_A | p_B | p_C | p_slots | p_dst | p_D | p_z
                    | p_dt_bias | p_out | p_seed | p_rscale | p_wscale) & 15:
                c_launch, fixed, gx, gy, gz, tail = kept
                c_launch(gx, gy, gz, _raw_stream(device), *fixed, p_read, p_write, p_cursor, p_x, p_dt, p_A, p_B, p_C,
                         p_slots, p_dst, p_D, p_z, p_dt_bias, p_out, p_seed, self.faults_ptr, p_rscale, p_wscale,
                         *tail)
                return
            # fmt: on
        grid, args, kwargs = arguments(
            read, write, cursor, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, self.seed, dst_slots,
            self.faults, consts, schedule, scales,
        )  # fmt: skip
        compiled = kernel_call(ssu_kernel, grid)(*args, **kwargs)
        if kept is None and compiled is not None and device is not None and _raw_stream is not None:
            self._keep(form, tensors, compiled, grid, args, kwargs)

    def lane(self, read, write, cursor, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, consts, schedule, scales,
             cache=None):  # fmt: skip
        """A launcher of later one-token calls of this one's layout on the same slots, taking only
        what changes between decode steps and returning the output it allocates, or None for a
        call it declines (another layout, a pointer not 16-byte aligned, another current device):
        then launch as usual. None where this call's layout has no direct launch kept (launch it
        first), or where the call reads and writes different views.

        Without ``cache`` it steps this call's state views, ``lane(x, dt, A, B, C, D, z, dt_bias,
        dt_softplus)`` (plugin API 1.6, ``ssu.contract.LaneFn``). With ``cache``, the engine tensor
        at whose address those views start (an adopted cache, no row scales), it takes the tensor
        to step first, ``lane(cache, x, ...)`` (``ssu.contract.CacheLaneFn``): any tensor of that
        one's sizes, strides, dtype and device, such as a copy an engine makes of its cache before
        each step, and it holds none of them.

        What :meth:`__call__` works out per call is worked out here once: the form, the kept
        launch, the addresses of the slots, scales and fault record. A call through the lane
        compares its tensors with one C++ guard and reads their addresses: the host time left is
        that, the output's allocation and the launcher's own. Its ``softplus`` is this call's
        ``dt_softplus``."""
        if _current_device is None or _raw_stream is None or write is not read or cursor is not None:
            return None
        if cache is not None and (scales is not None or cache.data_ptr() != read.data_ptr()):
            return None
        device = _current_device()
        out = torch.empty_like(x)
        form, tensors = _layout(
            device, read, write, cursor, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, None, consts,
            schedule, scales,
        )  # fmt: skip
        kept = next((entry for guard, entry in self.direct.get(form, ()) if guard.check(*tensors)), None)
        if kept is None:
            return None
        c_launch, fixed, gx, gy, gz, tail = kept
        p_slots = slots.data_ptr()
        p_seed = p_slots if self.seed is None else self.seed_ptr
        p_rscale = p_wscale = p_slots
        if scales is not None:
            p_rscale, p_wscale = scales.read.data_ptr(), scales.write.data_ptr()
        if (p_slots | p_seed | p_rscale | p_wscale) & 15:
            return None
        p_faults = self.faults_ptr
        no_D, no_z, no_bias = D is None, z is None, dt_bias is None
        given = [i for i, t in enumerate((x, dt, A, B, C, D, z, dt_bias)) if t is not None]
        pick = operator.itemgetter(*given)
        guard = layout_guard((read if cache is None else cache, *pick((x, dt, A, B, C, D, z, dt_bias))))
        check, empty_like, raw_stream = guard.check, torch.empty_like, _raw_stream
        every = len(given) == 8  # D, z and dt_bias all given (Mamba2 mixers pass them): no picking

        def run(target, x, dt, A, B, C, D, z, dt_bias, softplus):
            if (
                softplus != dt_softplus
                or (D is None) is not no_D
                or (z is None) is not no_z
                or (dt_bias is None) is not no_bias
                or _current_device() != device
                or not (
                    check(target, x, dt, A, B, C, D, z, dt_bias)
                    if every
                    else check(target, *pick((x, dt, A, B, C, D, z, dt_bias)))
                )
            ):
                return None
            out = empty_like(x)
            p_state, p_x, p_dt, p_A, p_B, p_C, p_out = (
                target.data_ptr(),
                x.data_ptr(),
                dt.data_ptr(),
                A.data_ptr(),
                B.data_ptr(),
                C.data_ptr(),
                out.data_ptr(),
            )
            p_D = p_A if no_D else D.data_ptr()
            p_z = p_x if no_z else z.data_ptr()
            p_dt_bias = p_A if no_bias else dt_bias.data_ptr()
            if (p_state | p_x | p_dt | p_A | p_B | p_C | p_D | p_z | p_dt_bias | p_out) & 15:
                return None
            # fmt: off
            c_launch(gx, gy, gz, raw_stream(device), *fixed, p_state, p_state, p_slots, p_x, p_dt, p_A, p_B, p_C,
                     p_slots, p_slots, p_D, p_z, p_dt_bias, p_out, p_seed, p_faults, p_rscale, p_wscale, *tail)
            # fmt: on
            return out

        if cache is not None:
            run.holds = (slots,)  # the tensors whose addresses it launches with: not the cache
            return run
        bound = functools.partial(run, read)
        bound.holds = (read, slots, scales)
        return bound

    def _keep(self, form, tensors, compiled, grid, args, kwargs) -> None:
        names = list(getattr(ssu_kernel, "arg_names", ()))
        if len(names) != len(args) + len([n for n in names[len(args) :] if n in kwargs]):
            return  # a keyword Triton gets that is not a kernel parameter: launch as Triton does
        if not all(isinstance(a, torch.Tensor) for a in args[:POINTERS]):
            return
        found = fast_launch.direct(compiled)
        if found is None:
            return
        c_launch, fixed = found
        grid = (*grid, 1, 1)[:3]
        tail = (*args[POINTERS:], *[kwargs[n] for n in names[len(args) :]])
        if len(self.direct) >= fast_launch.MAX_KEYS:
            self.direct.clear()
        guard = layout_guard(tensors)
        if not guard.check(*tensors):
            return  # a layout its own guard refuses (one tensor passed twice): kept, it would only evict others
        layouts = self.direct.setdefault(form, [])
        layouts.insert(0, (guard, (c_launch, fixed, *grid, tail)))
        del layouts[LAYOUTS_PER_FORM:]
