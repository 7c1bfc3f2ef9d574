"""Direct launches of the step kernel: a call whose layout was launched once goes straight through
Triton's C launcher with the kept argument tail (:class:`StepLaunches`), and the lanes that bind
one layout for the drop-in's later calls."""

from __future__ import annotations

import functools
import operator

import torch

from ssu.runtime import signatures

from . import compiled_lanes, fast_launch
from .kernel import ssu_kernel
from .launch import arguments, kernel_call

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

    def __init__(self, seed, faults, compiled: bool = False) -> None:
        self.seed = seed
        self.faults = faults
        #: whether lanes are compiled to one C++ call (:mod:`compiled_lanes`; the extension is built
        #: when the first lane is bound, and where it cannot be, lanes run in Python)
        self.compiled = compiled
        # the kernel's own tensors, allocated once: their addresses do not change
        self.seed_ptr = None if seed is None else seed.data_ptr()
        self.faults_ptr = faults.data_ptr()
        #: form -> [(layout guard, (C launch, fixed launcher arguments, grid x, y, z, kernel args after the
        #: pointers, the kernel's argument types or None))]
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
                c_launch, fixed, gx, gy, gz, tail, _ = kept
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
        that, the output's allocation and the launcher's own. Where the step's lanes are compiled
        (``compiled``), the lane is one C++ call doing all of that (:meth:`_compiled_lane`), and
        this Python lane serves only where none can be made. Its ``softplus`` is this call's
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
        c_launch, fixed, gx, gy, gz, tail, types = kept
        p_slots = slots.data_ptr()
        p_seed = p_slots if self.seed is None else self.seed_ptr
        p_rscale = p_wscale = p_slots
        if scales is not None:
            p_rscale, p_wscale = scales.read.data_ptr(), scales.write.data_ptr()
        if (p_slots | p_seed | p_rscale | p_wscale) & 15:
            return None
        p_faults = self.faults_ptr
        holds = (slots,) if cache is not None else (read, slots, scales)  # not the cache: the lane steps any copy
        if self.compiled and types is not None and (read.device.type != "cuda" or read.device.index == device):
            # fmt: off
            pointers = (0, 0, p_slots, 0, 0, 0, 0, 0, p_slots, p_slots, 0, 0, 0, 0, p_seed, p_faults, p_rscale,
                        p_wscale)
            # fmt: on
            references = (read if cache is None else cache, x, dt, A, B, C, D, z, dt_bias)
            bound_to = read if cache is None else None  # a cache lane takes the tensor to step per call
            lane = self._compiled_lane(kept, pointers, references, dt_softplus, bound_to, holds)
            if lane is not None:
                return lane
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
            run.holds = holds  # the tensors whose addresses it launches with
            return run
        bound = functools.partial(run, read)
        bound.holds = holds
        return bound

    def _compiled_lane(self, kept, pointers, references, softplus, target, holds):
        """The lane of :meth:`lane` compiled to one C++ call (:mod:`compiled_lanes`), or None where
        it makes none (then the Python lane serves): the kept launch's arguments packed once, the
        addresses of the call's tensors and output written into their slots per call."""
        lib = compiled_lanes.module()
        if lib is None:
            return None
        _, fixed, gx, gy, gz, tail, types = kept
        function, cooperative, pdl, _, _, metadata = fixed[:6]
        packed = compiled_lanes.pack(types, (*pointers, *tail))
        if packed is None:
            return None
        _, x, _, _, _, _, D, z, dt_bias = references
        slots = (
            (0, 1),  # the state read and written
            (3,) + ((11,) if z is None else ()),  # x (and z's place without z)
            (4,),
            (5,) + ((10,) if D is None else ()) + ((12,) if dt_bias is None else ()),  # A (and D's, dt_bias's)
            (6,),
            (7,),
            () if D is None else (10,),
            () if z is None else (11,),
            () if dt_bias is None else (12,),
            (13,),  # the output
        )
        try:
            lane = compiled_lanes.make(
                lib, packed, function=function, grid=(gx, gy, gz), metadata=metadata, pdl=pdl,
                cooperative=cooperative, references=references, slots=slots, softplus=softplus, target=target,
                holds=holds,
            )  # fmt: skip
        except (RuntimeError, TypeError, ValueError):  # a launch it cannot describe: the Python lane serves
            return None
        if lane is not None:
            lane.holds = holds
        return lane

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
        types = compiled_lanes.param_types(compiled) if self.compiled else None
        layouts.insert(0, (guard, (c_launch, fixed, *grid, tail, types)))
        del layouts[LAYOUTS_PER_FORM:]
