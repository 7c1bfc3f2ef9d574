"""Lanes compiled to one C++ call (``csrc/lane.cpp``): what a lane of
:class:`~ssu_backend_triton.step_launches.StepLaunches` does per call, without its Python.

A lane's Python compares the call's tensors with one C++ guard, reads ten addresses, allocates the
output and hands 80-odd arguments to Triton's C launcher, which parses them all again: about 6
microseconds above the launch alone back to back on an H100's host, 10 or more inside a decode
step, where the code between two layers' calls leaves the host's caches cold. A compiled lane
keeps the kernel's parameters packed as the CUDA driver reads them, so a call checks the layouts
of its nine tensors, allocates the output, writes the addresses into their slots and calls
``cuLaunchKernelEx``: one C++ call from the caller's Python.

The extension is built with torch's C++ extension builder on first use (about 10 to 20 seconds,
once per machine and torch version; torch keeps the build, ``TORCH_EXTENSIONS_DIR`` says where)
and needs a C++ compiler and ninja. Where it cannot be built, :func:`module` says why once, in a
warning, and lanes stay in Python. The triton backend's ``compiled_lanes`` option turns it off.
"""

from __future__ import annotations

import ctypes
import struct
import warnings
from pathlib import Path
from typing import Optional, Sequence

#: the extension's module name (``PyInit_`` in ``csrc/lane.cpp``)
NAME = "ssu_triton_lane"
SOURCE = Path(__file__).with_name("csrc") / "lane.cpp"

_built = None  # the loaded extension
_failure: Optional[str] = None  # why it could not be built (then it is not tried again)
_driver: Optional[tuple] = None  # (cuLaunchKernelEx, cuGetErrorString) addresses

#: the 8-byte slot each scalar parameter type of a Triton signature fills, as a struct format
#: (the value in the low bytes; floats as Triton's launcher stores them)
SCALAR_FORMATS = {
    "i1": "<b",
    "i8": "<b",
    "i16": "<h",
    "i32": "<i",
    "i64": "<q",
    "u1": "<B",
    "u8": "<B",
    "u16": "<H",
    "u32": "<I",
    "u64": "<Q",
    "fp16": "<e",
    "bf16": "<f",  # its upper half (pack)
    "fp32": "<f",
    "f32": "<f",
    "fp64": "<d",
}


def failure() -> Optional[str]:
    """Why the extension could not be built, or None (built, or not tried yet)."""
    return _failure


def module():
    """The compiled extension, built on first use; None where it cannot be (one warning says why)."""
    global _built, _failure
    if _built is not None or _failure is not None:
        return _built
    try:
        import triton.backends.nvidia as nvidia
        from torch.utils import cpp_extension

        include = Path(nvidia.__file__).parent / "include"  # Triton's copy of cuda.h (types only)
        _built = cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            extra_include_paths=[str(include)],
            extra_cflags=["-O2"],
            with_cuda=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no CUDA backend in Triton, a torch it does not build with
        reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        _failure = reason
        warnings.warn(
            f"ssu backend 'triton': its compiled lanes could not be built ({reason}); lanes launch through "
            "Python (a few microseconds more of host time per call). A C++ compiler and ninja "
            "(`pip install ninja`) build them; `compiled_lanes = false` in [ssu.backends.triton] stops trying.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _built


def driver() -> Optional[tuple]:
    """The addresses of the CUDA driver's ``cuLaunchKernelEx`` and ``cuGetErrorString``
    (``libcuda.so.1``), or None without a CUDA driver."""
    global _driver
    if _driver is None:
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            _driver = (
                ctypes.cast(cuda.cuLaunchKernelEx, ctypes.c_void_p).value,
                ctypes.cast(cuda.cuGetErrorString, ctypes.c_void_p).value,
            )
        except (OSError, AttributeError):
            return None
    return _driver


def param_types(compiled) -> Optional[tuple]:
    """The types of a compiled kernel's arguments in launcher order (Triton's signature: ``*fp32``
    for a pointer, ``i32``, ``fp32``, ``constexpr`` for one its launcher drops), or None where the
    signature holds what a compiled lane does not pack (tensor descriptors, tuples)."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    types = tuple(signature.values())
    for ty in types:
        if not isinstance(ty, str) or not (ty == "constexpr" or ty.startswith("*") or ty in SCALAR_FORMATS):
            return None
    return types


def pack(types: Sequence[str], args: Sequence) -> Optional[tuple]:
    """The kernel's parameters as the driver reads them: one 8-byte slot per argument its launcher
    passes (every one but the ``constexpr`` ones), then Triton's two scratch pointers (null), and
    the slot of each argument, or None. ``args`` are the launcher's kernel arguments: a pointer as
    an integer address."""
    if len(types) != len(args):
        return None
    data, slot_of = bytearray(), {}
    for i, (ty, value) in enumerate(zip(types, args)):
        if ty == "constexpr":
            continue
        slot_of[i] = len(data) // 8
        if ty.startswith("*"):
            if not isinstance(value, int):
                return None
            data += struct.pack("<Q", value)
            continue
        try:
            if ty == "bf16":  # the upper half of the float32, as Triton's launcher truncates it
                raw = struct.pack("<f", value)[2:]
            else:
                raw = struct.pack(SCALAR_FORMATS[ty], value)
        except (struct.error, TypeError):
            return None
        data += raw + bytes(8 - len(raw))
    data += bytes(16)  # global and profile scratch: none
    return bytes(data), slot_of


def make(
    lib,
    launch: tuple,
    *,
    function: int,
    grid: tuple,
    metadata: tuple,
    pdl: bool,
    cooperative: bool,
    references: tuple,
    slots: tuple,
    softplus: bool,
    target=None,
    holds: tuple = (),
    functions: Optional[tuple] = None,
):
    """A compiled lane (``Lane`` of ``csrc/lane.cpp``), or None where this launch is not one it
    makes: ``launch`` is ``(packed parameters, slot of each argument)`` from :func:`pack`;
    ``metadata`` Triton's packed ``(num_warps, num_ctas, shared memory)``; ``references`` the
    nine inputs (target, x, dt, A, B, C, D, z, dt_bias) of the bound call, whose layouts later
    calls must have; ``slots`` which kernel arguments take each of those nine addresses and the
    output's (ten tuples of argument positions); ``target`` the tensor a lane bound to its state
    steps (its calls then omit it); ``holds`` what it keeps alive; ``functions`` the addresses of
    the launch and error-string functions (the driver's, :func:`driver`, unless given)."""
    functions = functions or driver()
    if functions is None:
        return None
    num_warps, num_ctas, shared = metadata
    if num_ctas != 1:
        return None
    values, slot_of = launch
    try:
        params = tuple(tuple(slot_of[position] for position in positions) for positions in slots)
    except KeyError:  # an address argument Triton dropped as a constant
        return None
    return lib.make_lane(
        functions[0],
        functions[1] or 0,
        function,
        tuple(grid),
        32 * num_warps,
        shared,
        bool(pdl),
        bool(cooperative),
        values,
        params,
        references,
        bool(softplus),
        target,
        holds,
    )
