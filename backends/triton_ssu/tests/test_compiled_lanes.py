"""Compiled lanes (``compiled_lanes``, ``csrc/lane.cpp``): a lane compiled to one C++ call launches
exactly what the direct launch of the same call passes Triton's launcher (the same function, grid,
block, shared memory and stream, every kernel argument packed as the driver reads it, the call's
addresses in their places), declines every call its Python lane declines, and keeps alive what it
launches with and nothing else.

The CUDA driver's launch is a stand-in here (a C function pointer that records what it receives):
the extension is built and called for real, on CPU tensors; the GPU tests launch the real kernel
through it."""

from __future__ import annotations

import ctypes
import inspect
import os
import shutil
import struct
import sys
import sysconfig
import types
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from ssu_backend_triton import compiled_lanes, fast_launch, launch, step_launches
from ssu_backend_triton.step_launches import StepLaunches

from test_step_launches import LANE_INPUTS, STREAM, adopted_call, changed_call, full_arguments, make_call

FIXED = (0xF00D, False, True, None, None, (4, 1, 2048), None, None, None)


class LaunchConfig(ctypes.Structure):
    """The leading fields of the driver's ``CUlaunchConfig``."""

    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


LAUNCH_EX = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p
)


def signature_of(args: tuple) -> dict:
    """Triton's signature of the step kernel for these arguments, as its JIT would specialize them."""
    fn = getattr(launch.ssu_kernel, "fn", launch.ssu_kernel)
    params = inspect.signature(fn).parameters
    signature = {}
    for name, arg in zip(params, args):
        if "constexpr" in str(params[name].annotation) or arg is None:
            signature[name] = "constexpr"
        elif isinstance(arg, torch.Tensor):
            signature[name] = "*fp32"
        elif isinstance(arg, bool):
            signature[name] = "i1"
        elif isinstance(arg, int):
            signature[name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    return signature


class Driver:
    """Stands in for Triton's full launch, its C launcher and the driver's ``cuLaunchKernelEx``."""

    def __init__(self) -> None:
        self.full: list = []
        self.direct: list = []
        self.launched: list = []  # (config fields, function, parameter bytes)
        self.slots = 0  # parameters a launch passes (read back from the driver's arguments)
        self.result = 0
        self.callback = LAUNCH_EX(self._launch)
        self.address = ctypes.cast(self.callback, ctypes.c_void_p).value

    def kernel_call(self, jit, grid, compile_only=False):
        def run(*args, **kwargs):
            self.full.append((grid, args, kwargs))
            ordered = (*args, *[kwargs[n] for n in launch.ssu_kernel.arg_names[len(args) :]])
            return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature_of(ordered)))

        return run

    def c_launch(self, *args):
        self.direct.append(args)

    def _launch(self, config, function, params, extra):
        c = config.contents
        fields = (c.grid_x, c.grid_y, c.grid_z, c.block_x, c.block_y, c.block_z, c.shared, c.stream, c.num_attrs)
        data = b"".join(ctypes.string_at(params[i], 8) for i in range(self.slots))
        self.launched.append((fields, function, data))
        return self.result


def toolchain_missing() -> str:
    """What a machine lacks to build a C++ extension at all (a compiler, Python's headers), or ""."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler})"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return "" if headers.exists() else f"no Python headers ({headers})"


@pytest.fixture
def driver(monkeypatch):
    """The stand-ins, with the compiled lanes' extension built for real (a build that fails where
    a compiler and Python's headers are present fails the test)."""
    lib = compiled_lanes.module()
    if lib is None and toolchain_missing():
        pytest.skip(f"the compiled lanes cannot be built here: {toolchain_missing()}")
    assert lib is not None, compiled_lanes.failure()
    d = Driver()
    d.lib = lib
    monkeypatch.setattr(step_launches, "kernel_call", d.kernel_call)
    monkeypatch.setattr(fast_launch, "direct", lambda compiled: (d.c_launch, FIXED))
    monkeypatch.setattr(step_launches, "_current_device", lambda: 0)
    monkeypatch.setattr(step_launches, "_raw_stream", lambda device: STREAM)
    monkeypatch.setattr(compiled_lanes, "driver", lambda: (d.address, 0))
    return d


def direct_params(d: Driver, types_: tuple) -> bytes:
    """The parameters the last direct launch passed, packed as the driver reads them."""
    packed, _ = compiled_lanes.pack(types_, d.direct[-1][13:])
    d.slots = len(packed) // 8
    return packed


def bound(d: Driver, launches: StepLaunches, call: dict, cache=None):
    fixed = {k: v for k, v in call.items() if k not in ("out", "dst_slots")}
    return launches.lane(scales=None, cache=cache, **fixed)


def compiled_lane(d: Driver, gen, **kwargs) -> tuple:
    """``(launches, first call, lane)``: a first call of ``make_call(gen, **kwargs)`` launched in full,
    then the lane of its layout, compiled."""
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64), compiled=True)
    first = make_call(gen, **kwargs)
    launches(**first)
    return launches, first, bound(d, launches, first)


def slot_count(types_: tuple) -> int:
    """The parameters a launch of a kernel of these argument types passes (with the two scratch pointers)."""
    return sum(ty != "constexpr" for ty in types_) + 2


def kernel_types(call: dict, seed, faults) -> tuple:
    _, args = full_arguments(call, seed, faults)
    return tuple(signature_of(args).values())


# packing -----------------------------------------------------------------------------------------
def test_pack_fills_a_slot_per_passed_argument_as_the_driver_reads_it():
    types_ = ("*fp32", "i32", "constexpr", "i1", "fp32", "bf16", "fp16", "i64", "u64", "fp64", "i8")
    args = (0x7F00_0000_1000, -5, 99, True, 1.5, -2.75, 0.5, -(2**40), 2**63 + 1, 2.25, -3)
    packed, slot_of = compiled_lanes.pack(types_, args)
    assert len(packed) == 8 * (len(types_) - 1) + 16  # no constexpr; Triton's two scratch pointers
    assert slot_of == {0: 0, 1: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 6, 8: 7, 9: 8, 10: 9}
    slot = [packed[8 * i : 8 * i + 8] for i in range(len(packed) // 8)]
    assert struct.unpack("<Q", slot[0])[0] == 0x7F00_0000_1000
    assert struct.unpack("<i", slot[1][:4])[0] == -5 and slot[1][4:] == bytes(4)
    assert slot[2] == b"\x01" + bytes(7)
    assert struct.unpack("<f", slot[3][:4])[0] == 1.5
    assert slot[4][:2] == struct.pack("<f", -2.75)[2:] and slot[4][2:] == bytes(6)  # bf16: the upper half
    assert struct.unpack("<e", slot[5][:2])[0] == 0.5
    assert struct.unpack("<q", slot[6])[0] == -(2**40)
    assert struct.unpack("<Q", slot[7])[0] == 2**63 + 1
    assert struct.unpack("<d", slot[8])[0] == 2.25
    assert struct.unpack("<b", slot[9][:1])[0] == -3
    assert slot[10] == slot[11] == bytes(8)


@pytest.mark.parametrize(
    "types_, args",
    [
        (("*fp32", "i32"), (16,)),  # one argument short
        (("*fp32",), (torch.zeros(1),)),  # a pointer not given as its address
        (("i32",), (2**31,)),  # out of its type's range
        (("fp32",), ("1.0",)),
    ],
    ids=["length", "pointer", "range", "float"],
)
def test_pack_refuses_what_it_cannot_pack(types_, args):
    assert compiled_lanes.pack(types_, args) is None


def test_param_types_refuses_descriptors_and_tuples():
    def compiled(signature):
        return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature))

    assert compiled_lanes.param_types(compiled({"a": "*fp32", "n": "i32", "k": "constexpr"})) == (
        "*fp32",
        "i32",
        "constexpr",
    )
    assert compiled_lanes.param_types(compiled({"a": "tensordesc<fp32[16, 16]>"})) is None
    assert compiled_lanes.param_types(compiled({"a": ("*fp32", "i32")})) is None
    assert compiled_lanes.param_types(types.SimpleNamespace()) is None


# lanes through the step's launches ---------------------------------------------------------------
def test_a_compiled_lane_launches_what_the_direct_launch_passes(driver):
    gen = torch.Generator().manual_seed(11)
    faults = torch.zeros(1, dtype=torch.int64)
    launches = StepLaunches(None, faults, compiled=True)
    first = make_call(gen)
    launches(**first)
    lane = bound(driver, launches, first)
    assert type(lane).__name__ == "Lane"
    types_ = kernel_types(first, None, faults)
    for _ in range(3):
        call = make_call(gen)
        call.update(read=first["read"], write=first["write"], slots=first["slots"])
        driver.slots = slot_count(types_)
        out = lane(*[call[k] for k in LANE_INPUTS])
        assert out.shape == call["x"].shape and out.dtype == call["x"].dtype and out.stride() == call["x"].stride()
        fields, function, data = driver.launched[-1]
        call["out"] = out
        launches(**call)  # the direct launch of the same call
        assert data == direct_params(driver, types_)
        gx, gy, gz = driver.direct[-1][:3]
        assert fields == (gx, gy, gz, 32 * 4, 1, 1, 2048, None, 1)  # four warps, PDL: one attribute
        assert function == 0xF00D
    assert len(driver.full) == 1
    assert any(t is first["read"] for t in lane.holds) and any(t is first["slots"] for t in lane.holds)


@pytest.mark.parametrize(
    "change", ["another layout", "z given", "no softplus", "unaligned", "another dtype", "needs gradients", "sparse"]
)
def test_a_compiled_lane_declines_what_it_was_not_bound_for(driver, change):
    gen = torch.Generator().manual_seed(12)
    _, _, lane = compiled_lane(driver, gen, z=False)
    assert type(lane).__name__ == "Lane"
    assert lane(*[changed_call(gen, change)[k] for k in LANE_INPUTS]) is None
    assert not driver.launched and not driver.direct


def test_a_compiled_cache_lane_steps_any_tensor_of_the_caches_layout(driver):
    gen = torch.Generator().manual_seed(13)
    faults = torch.zeros(1, dtype=torch.int64)
    launches = StepLaunches(None, faults, compiled=True)
    cache = torch.randn(6, 4, 16, 32, generator=gen)
    first = adopted_call(gen, cache)
    launches(**first)
    lane = bound(driver, launches, first, cache=cache)
    assert type(lane).__name__ == "Lane"
    types_ = kernel_types(first, None, faults)
    copies = []
    for _ in range(3):
        copy = cache.clone()
        call = adopted_call(gen, copy)
        call["slots"] = first["slots"]
        driver.slots = slot_count(types_)
        out = lane(copy, *[call[k] for k in LANE_INPUTS])
        assert out is not None
        data = driver.launched[-1][2]
        call["out"] = out
        launches(**call)
        assert data == direct_params(driver, types_)
        copies.append(weakref.ref(copy))
        del copy, call, out
    others = [torch.randn(7, 4, 16, 32), torch.randn(6, 4, 32, 16).transpose(2, 3), cache.double()]
    for other in others:
        assert lane(other, *[first[k] for k in LANE_INPUTS]) is None
    assert all(t is not cache for t in lane.holds)
    del cache, first, others
    assert all(ref() is None for ref in copies)


def test_a_compiled_lane_keeps_what_it_launches_with_alive_and_leaks_nothing(driver):
    launches, first, lane = compiled_lane(driver, torch.Generator().manual_seed(14))
    driver.slots = 1
    read, slots = weakref.ref(first["read"]), weakref.ref(first["slots"])
    args = [first[k] for k in LANE_INPUTS]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]  # True, None: shared, counted by everyone
    counts = [sys.getrefcount(a) for a in tensors]
    for _ in range(50):
        lane(*args)
    assert [sys.getrefcount(a) for a in tensors] == counts
    del first, args
    launches.direct.clear()
    driver.full.clear()  # the stand-ins keep what they were given
    assert read() is not None and slots() is not None  # the lane holds its state and slots
    del lane
    assert read() is None and slots() is None


def test_a_failed_launch_raises_with_the_drivers_code(driver):
    _, first, lane = compiled_lane(driver, torch.Generator().manual_seed(15))
    driver.result, driver.slots = 700, 1
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        lane(*[first[k] for k in LANE_INPUTS])
    with pytest.raises(TypeError, match="positional arguments"):
        lane(*[first[k] for k in LANE_INPUTS][:-1])


def test_the_python_lane_serves_where_no_compiled_lane_is_made(driver, monkeypatch):
    gen = torch.Generator().manual_seed(16)
    call = make_call(gen)
    for why in ("compiled lanes off", "not built", "no driver", "a signature it does not pack"):
        launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64), compiled=why != "compiled lanes off")
        if why == "not built":
            monkeypatch.setattr(compiled_lanes, "module", lambda: None)
        if why == "no driver":
            monkeypatch.setattr(compiled_lanes, "module", lambda: driver.lib)
            monkeypatch.setattr(compiled_lanes, "driver", lambda: None)
        if why == "a signature it does not pack":
            monkeypatch.setattr(compiled_lanes, "param_types", lambda compiled: None)
        launches(**call)
        lane = bound(driver, launches, call)
        assert lane is not None and type(lane).__name__ != "Lane", why
        lane(*[call[k] for k in LANE_INPUTS])
        assert not driver.launched


def test_a_build_that_fails_warns_once_and_leaves_python_lanes(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_lanes, "_built", None)
    monkeypatch.setattr(compiled_lanes, "_failure", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(RuntimeError: no C\+\+ compiler found\).*ninja"):
        assert compiled_lanes.module() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled_lanes.module() is None
    assert compiled_lanes.failure() == "RuntimeError: no C++ compiler found"
