"""Launching a compiled Triton kernel again without Triton's per-call dispatch.

``jit[grid](*args, **kwargs)`` binds every argument, computes its specialization (dtype and
16-byte alignment of each pointer, value class of each integer), builds a cache key from them and
looks the compiled kernel up: for the SSU kernel's 70-odd arguments that costs tens of
microseconds of host time per launch, several times the kernel itself at small batches, and it is
all an eager decode step pays (a CUDA graph replays the launch without it).

:func:`launch` keeps, per jit function, the kernel Triton compiled for each *launch key*: every
argument as it is (an integer, a flag, None, a constexpr, an option) and, for a tensor, its dtype
and whether its address is 16-byte aligned, with the current device. That key is finer than
Triton's specialization (which it determines), so a hit may launch the kept kernel directly
through ``CompiledKernel[grid]``; a miss, or an interpreted kernel, goes through ``jit[grid]`` as
before (compiling if needed) and keeps what it returns.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

#: kept kernels per jit function are dropped beyond this many launch keys (never reached by a
#: serving process: a key changes only with the layout or the options of a call)
MAX_KEYS = 1024

_kept: dict = {}  # id(jit) -> _Kept
#: the device Triton compiles and launches for (its current CUDA device)
current_device = torch.cuda.current_device


class _Kept:
    """One jit function's kept kernels, and where its calls pass tensors (found at the first call:
    a kernel's call site passes a tensor, and only a tensor, at the same positions every time)."""

    __slots__ = ("kernels", "tensors", "others", "count")

    def __init__(self, args: tuple) -> None:
        self.kernels: dict = {}  # launch key -> (compiled kernel, names of the keyword parameters in order)
        positions = [i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        rest = [i for i in range(len(args)) if i not in positions]
        self.tensors = operator.itemgetter(*positions) if len(positions) > 1 else None
        self.others = operator.itemgetter(*rest) if len(rest) > 1 else None
        self.count = len(args)

    def key(self, args: tuple, kwargs: dict) -> tuple:
        """The launch key of a call (see the module docstring)."""
        if self.tensors is None or self.others is None or len(args) != self.count:
            return (current_device(), *_slow_key(args), *kwargs.items())
        tensors = self.tensors(args)
        return (
            current_device(),
            *[t.dtype for t in tensors],
            *[t.data_ptr() & 15 == 0 for t in tensors],
            *self.others(args),
            *kwargs.items(),
        )


def _slow_key(args: tuple) -> list:
    return [(arg.dtype, arg.data_ptr() & 15 == 0) if isinstance(arg, torch.Tensor) else arg for arg in args]


def _ordered_names(jit, args: tuple, kwargs: dict):
    """The names of the kernel's parameters after the positional ones, in signature order, when the
    keywords give each of them (else None: that key always goes through ``jit[grid]``)."""
    names = list(getattr(jit, "arg_names", ()))[len(args) :]
    return tuple(names) if names and all(name in kwargs for name in names) else None


def launch(jit, grid: tuple, *args: Any, **kwargs: Any):
    """``jit[grid](*args, **kwargs)``, with the kernel kept per launch key and launched directly on
    a later call with the same key; returns Triton's handle of the compiled kernel (None when
    interpreted)."""
    kept = _kept.get(id(jit))
    if kept is None:
        kept = _kept[id(jit)] = _Kept(args)
    try:
        key = kept.key(args, kwargs)
    except (AttributeError, TypeError):  # a call that passes other kinds of arguments: Triton decides
        return jit[grid](*args, **kwargs)
    entry = kept.kernels.get(key)
    if entry is not None:
        compiled, names = entry
        if len(grid) < 3:  # CompiledKernel[grid] reads three dimensions; jit[grid] pads them with ones
            grid = (*grid, 1, 1)[:3]
        compiled[grid](*args, *[kwargs[name] for name in names])
        return compiled
    compiled = jit[grid](*args, **kwargs)
    names = _ordered_names(jit, args, kwargs)
    if names is not None and hasattr(compiled, "packed_metadata"):  # not an interpreted launch (None)
        if len(kept.kernels) >= MAX_KEYS:
            kept.kernels.clear()
        kept.kernels[key] = (compiled, names)
    return compiled


#: the arguments Triton's CUDA launcher (its compiled ``launch``) takes before the kernel's own, as
#: the ``PyArg_ParseTuple`` format Triton 3.6 builds it from: grid x, y, z, stream, function,
#: cooperative and PDL flags, global and profile scratch, packed metadata, launch metadata, enter
#: and exit hooks. :func:`direct` serves a Triton whose launcher declares exactly this, no other.
LAUNCHER_FORMAT = "iiiKKppOOOOOO"


def _launcher_format() -> Optional[str]:
    try:
        from triton.backends.nvidia import driver
    except Exception:  # no CUDA backend in this Triton
        return None
    return getattr(driver, "_BASE_ARGS_FORMAT", None)


def _hook_set(hook) -> bool:
    """A launch hook is set: a callable (Triton 3.6), or a chain of hooks holding one (later)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def direct(compiled) -> Optional[tuple]:
    """``(launch, fixed)`` to launch ``compiled`` (a CompiledKernel) through Triton's C launcher
    itself: ``launch(grid_x, grid_y, grid_z, stream, *fixed, *kernel_args)``, where a pointer
    argument may be the tensor's ``data_ptr()`` (an integer, which the launcher passes as it is).
    That skips the Python layers of ``CompiledKernel[grid]`` (current device and stream lookups,
    launch metadata, scratch allocation wrappers). None, for the caller to launch as Triton does,
    when the installed Triton's launcher takes other arguments (:data:`LAUNCHER_FORMAT`), the
    kernel needs scratch memory, or launch hooks (Triton's profiler) are set; hooks set later are
    not called for launches made this way."""
    if _launcher_format() != LAUNCHER_FORMAT:
        return None
    try:
        import triton

        runner = compiled.run  # loads the module and creates the launcher
        hooks = (triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook)
        function, metadata = compiled.function, compiled.packed_metadata
        c_launch = runner.launch
        flags = (bool(runner.launch_cooperative_grid), bool(runner.launch_pdl))
        scratch = (runner.global_scratch_size or 0, runner.profile_scratch_size or 0)
    except (AttributeError, ImportError):
        return None
    if any(_hook_set(hook) for hook in hooks) or any(scratch):
        return None
    return c_launch, (function, *flags, None, None, metadata, None, None, None)


def forget() -> None:
    """Drop every kept kernel (tests; Triton's own cache still holds them)."""
    _kept.clear()
