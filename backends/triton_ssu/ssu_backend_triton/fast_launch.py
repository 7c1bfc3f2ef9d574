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

from typing import Any

import torch

#: kept kernels per jit function are dropped beyond this many launch keys (never reached by a
#: serving process: a key changes only with the layout or the options of a call)
MAX_KEYS = 1024

_kept: dict = {}  # id(jit) -> {launch key: (compiled kernel, names of the keyword parameters in order)}
#: the device Triton compiles and launches for (its current CUDA device)
current_device = torch.cuda.current_device


def _key(args: tuple, kwargs: dict) -> tuple:
    """The launch key of a call (see the module docstring)."""
    parts = [current_device()]
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append((arg.dtype, arg.data_ptr() % 16 == 0))
        else:
            parts.append(arg)
    parts.extend(kwargs.items())
    return tuple(parts)


def _ordered_names(jit, args: tuple, kwargs: dict):
    """The names of the kernel's parameters after the positional ones, in signature order, when the
    keywords give each of them (else None: that key always goes through ``jit[grid]``)."""
    names = list(getattr(jit, "arg_names", ()))[len(args) :]
    return tuple(names) if names and all(name in kwargs for name in names) else None


def launch(jit, grid: tuple, *args: Any, **kwargs: Any):
    """``jit[grid](*args, **kwargs)``, with the kernel kept per launch key and launched directly on
    a later call with the same key; returns Triton's handle of the compiled kernel (None when
    interpreted)."""
    kept = _kept.setdefault(id(jit), {})
    key = _key(args, kwargs)
    entry = kept.get(key)
    if entry is not None:
        compiled, names = entry
        compiled[grid](*args, *[kwargs[name] for name in names])
        return compiled
    compiled = jit[grid](*args, **kwargs)
    names = _ordered_names(jit, args, kwargs)
    if compiled is not None and hasattr(compiled, "packed_metadata") and names is not None:
        if len(kept) >= MAX_KEYS:
            kept.clear()
        kept[key] = (compiled, names)
    return compiled


def forget() -> None:
    """Drop every kept kernel (tests; Triton's own cache still holds them)."""
    _kept.clear()
