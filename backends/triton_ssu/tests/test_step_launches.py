"""The triton step's direct launches (``step_launches.StepLaunches``): a call whose layout was launched
before passes exactly the arguments a full launch would (its own tensors' addresses, the kept
tail), straight to the launcher; a call with another layout, or an unaligned pointer, is launched
in full; and :func:`fast_launch.direct` declines a Triton launcher it does not know.

Triton's compiled launcher needs a GPU, so the launcher and the compiled kernel are stand-ins that
record what they receive; the GPU tests launch the real one."""

from __future__ import annotations

import types
import weakref

import pytest
import torch

from ssu.runtime import signatures
from ssu_backend_triton import fast_launch, launch, step_launches
from ssu_backend_triton.launch import StepConstants, arguments, quant_code
from ssu_backend_triton.step_launches import POINTERS, StepLaunches
from ssu_backend_triton.tuning import Schedule

STREAM = 0x5EED
FIXED = ("function", False, True, None, None, "metadata", None, None, None)
CONSTS = StepConstants(-1, 6, 2, False, False, 1, False, 10)
SCHEDULE = Schedule(8, 4, 1, 0, 0, 0, 0)


class Recorder:
    """Stands in for ``kernel_call`` (full launches) and for the C launcher (direct ones)."""

    def __init__(self, direct_ok: bool = True) -> None:
        self.full: list = []
        self.direct: list = []
        self.direct_ok = direct_ok

    def kernel_call(self, jit, grid, compile_only=False):
        def run(*args, **kwargs):
            self.full.append((grid, args, kwargs))
            return types.SimpleNamespace()

        return run

    def c_launch(self, *args):
        self.direct.append(args)

    def find_direct(self, compiled):
        return (self.c_launch, FIXED) if self.direct_ok else None


@pytest.fixture(params=["C++ guards", "Python layouts"])
def recorder(request, monkeypatch):
    """The stand-ins, with layouts compared by torch's C++ guards and by the Python fallback."""
    if request.param == "Python layouts":
        monkeypatch.setattr(signatures, "tensor_guards", lambda: None)
    rec = Recorder()
    monkeypatch.setattr(step_launches, "kernel_call", rec.kernel_call)
    monkeypatch.setattr(fast_launch, "direct", rec.find_direct)
    monkeypatch.setattr(step_launches, "_current_device", lambda: 0)
    monkeypatch.setattr(step_launches, "_raw_stream", lambda device: STREAM)
    return rec


def make_call(gen, *, b=3, dtype=torch.bfloat16, z=True, strided_x=False, dst=False):
    """A one-token call's tensors on a (6, 1, 4, 16, 32) state, every one with fresh values."""
    H, P, N, G = 4, 16, 32, 2
    state = torch.randn(6, 1, H, P, N, generator=gen)
    x = torch.randn(b, H, 2 * P if strided_x else P, generator=gen).to(dtype)
    if strided_x:
        x = x[..., :P]
    return dict(
        read=state,
        write=state,
        cursor=None,
        x=x,
        dt=torch.randn(b, H, generator=gen).to(dtype),
        A=-torch.rand(H, generator=gen),
        B=torch.randn(b, G, N, generator=gen).to(dtype),
        C=torch.randn(b, G, N, generator=gen).to(dtype),
        slots=torch.randperm(6, generator=gen)[:b].to(torch.int32),
        D=torch.randn(H, generator=gen),
        z=torch.randn(b, H, P, generator=gen).to(dtype) if z else None,
        dt_bias=torch.randn(H, generator=gen),
        dt_softplus=True,
        out=torch.empty(b, H, P, dtype=dtype),
        dst_slots=torch.randperm(6, generator=gen)[:b].to(torch.int32) if dst else None,
        consts=CONSTS,
        schedule=SCHEDULE,
    )


def full_arguments(call, seed, faults):
    """What a full launch of ``call`` passes, in the kernel's parameter order."""
    grid, args, kwargs = arguments(**{k: v for k, v in call.items()}, seed=seed, faults=faults)
    names = launch.ssu_kernel.arg_names
    return grid, (*args, *[kwargs[n] for n in names[len(args) :]])


def test_a_layout_seen_before_launches_directly_with_the_same_arguments(recorder):
    gen = torch.Generator().manual_seed(1)
    faults = torch.zeros(1, dtype=torch.int64)
    launches = StepLaunches(None, faults)
    first = make_call(gen)
    launches(**first)
    assert len(recorder.full) == 1 and not recorder.direct
    for _ in range(3):
        call = make_call(gen)  # new tensors, same layout
        launches(**call)
        grid, expected = full_arguments(call, None, faults)
        got = recorder.direct[-1]
        assert got[:4] == (*grid, STREAM)
        assert got[4:13] == FIXED
        kernel_args = got[13:]
        assert len(kernel_args) == len(expected)
        assert kernel_args[:POINTERS] == tuple(t.data_ptr() for t in expected[:POINTERS])
        assert kernel_args[POINTERS:] == expected[POINTERS:]
    assert len(recorder.full) == 1 and len(recorder.direct) == 3


@pytest.mark.parametrize(
    "change",
    [
        dict(dtype=torch.float16),
        dict(b=2),
        dict(z=False),
        dict(strided_x=True),
        dict(dst=True),
        dict(schedule=Schedule(16, 4, 1, 0, 0, 1, 0)),
        dict(consts=CONSTS._replace(num_slots=7)),
        dict(dt_softplus=False),
    ],
    ids=lambda c: next(iter(c)),
)
def test_another_layout_is_launched_in_full(recorder, change):
    gen = torch.Generator().manual_seed(2)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    launches(**make_call(gen))
    layout_args = {k: v for k, v in change.items() if k in ("dtype", "b", "z", "strided_x", "dst")}
    call = make_call(gen, **layout_args)
    call.update({k: v for k, v in change.items() if k not in layout_args})
    launches(**call)
    assert len(recorder.full) == 2 and not recorder.direct
    launches(**call)  # and is kept in its turn
    assert len(recorder.direct) == 1


def test_an_unaligned_pointer_is_launched_in_full(recorder):
    gen = torch.Generator().manual_seed(3)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    launches(**make_call(gen))
    call = make_call(gen)
    shifted = torch.empty(call["out"].numel() + 1, dtype=call["out"].dtype)[1:].view(call["out"].shape)
    call["out"] = shifted  # same shape, strides and dtype, 2 bytes past an aligned address
    launches(**call)
    assert len(recorder.full) == 2 and not recorder.direct


def test_nothing_is_kept_where_direct_declines(recorder):
    recorder.direct_ok = False
    gen = torch.Generator().manual_seed(4)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    for _ in range(3):
        launches(**make_call(gen))
    assert len(recorder.full) == 3 and not recorder.direct and not launches.direct


def test_the_seed_and_fault_record_are_the_kernels_own(recorder):
    gen = torch.Generator().manual_seed(5)
    seed, faults = torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    launches = StepLaunches(seed, faults)
    launches(**make_call(gen))
    launches(**make_call(gen))
    pointers = recorder.direct[-1][13 : 13 + POINTERS]
    assert pointers[14] == seed.data_ptr() and pointers[15] == faults.data_ptr()


def c_launch(*args):
    return None


def fake_compiled(**runner):
    """A compiled kernel whose launcher is Triton 3.6's CudaLauncher in shape."""
    fields = dict(
        launch=c_launch, launch_cooperative_grid=False, launch_pdl=True, global_scratch_size=0, profile_scratch_size=0
    )
    return types.SimpleNamespace(
        run=types.SimpleNamespace(**{**fields, **runner}), function=7, packed_metadata=(4, 1, 0)
    )


def test_direct_takes_a_known_launcher(monkeypatch):
    monkeypatch.setattr(fast_launch, "_launcher_format", lambda: fast_launch.LAUNCHER_FORMAT)
    found, fixed = fast_launch.direct(fake_compiled())
    assert found is c_launch
    assert fixed == (7, False, True, None, None, (4, 1, 0), None, None, None)


@pytest.mark.parametrize(
    "why",
    ["another launcher format", "global scratch", "profile scratch", "launch hook", "no launcher"],
)
def test_direct_declines(monkeypatch, why):
    import triton

    monkeypatch.setattr(fast_launch, "_launcher_format", lambda: fast_launch.LAUNCHER_FORMAT)
    compiled = fake_compiled()
    if why == "another launcher format":
        monkeypatch.setattr(fast_launch, "_launcher_format", lambda: "iiiKKOOOO")
    elif why == "global scratch":
        compiled = fake_compiled(global_scratch_size=128)
    elif why == "profile scratch":
        compiled = fake_compiled(profile_scratch_size=64)
    elif why == "launch hook":
        hook = triton.knobs.runtime.launch_enter_hook
        if hasattr(hook, "add"):  # a chain of hooks
            hook.add(print)
            monkeypatch.setattr(hook, "calls", [print])
        else:
            monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", print)
    else:
        compiled = types.SimpleNamespace(run=object(), function=7, packed_metadata=())
    assert fast_launch.direct(compiled) is None


def test_an_8_bit_cache_passes_its_row_scales_and_keys_their_layout(recorder):
    from ssu.state.slot_state import LayerViews

    gen = torch.Generator().manual_seed(6)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))

    def call_with_scales():
        call = make_call(gen)
        call["read"] = call["write"] = (call["read"] * 20).to(torch.int8)
        scales = torch.rand(6, 1, 4, 16, generator=gen)
        return call, LayerViews(scales, scales)

    call, scales = call_with_scales()
    launches(**call, scales=scales)
    assert recorder.full[-1][2]["QUANT"] == quant_code(torch.int8)
    call, scales = call_with_scales()
    launches(**call, scales=scales)
    grid, args, kwargs = arguments(**call, seed=None, faults=launches.faults, scales=scales)
    pointers = recorder.direct[-1][13 : 13 + POINTERS]
    assert pointers[16] == scales.read.data_ptr() and pointers[17] == scales.write.data_ptr()
    assert recorder.direct[-1][13 + POINTERS :] == (
        *args[POINTERS:],
        *[kwargs[n] for n in launch.ssu_kernel.arg_names[len(args) :]],
    )
    launches(**make_call(gen))  # a floating-point cache: another layout
    assert len(recorder.full) == 2


@pytest.mark.parametrize("change", ["z is x", "D needs gradients"])
def test_a_tensor_passed_twice_or_needing_gradients_is_launched_right(recorder, change):
    """A call passing one tensor as two inputs, or one that needs gradients, after a layout kept
    for distinct tensors that need none: C++ guards never match it (a full launch), the Python
    comparison may (a direct one); either way it launches with its own arguments."""
    gen = torch.Generator().manual_seed(9)
    faults = torch.zeros(1, dtype=torch.int64)
    launches = StepLaunches(None, faults)
    launches(**make_call(gen))
    call = make_call(gen)
    if change == "z is x":
        call["z"] = call["x"]
    else:
        call["D"] = call["D"].clone().requires_grad_()
    counts = len(recorder.full), len(recorder.direct)
    launches(**call)
    grid, expected = full_arguments(call, None, faults)
    if len(recorder.direct) > counts[1]:
        got = recorder.direct[-1][13:]
    else:
        assert len(recorder.full) == counts[0] + 1
        _, args, kwargs = recorder.full[-1]
        got = (*args, *[kwargs[n] for n in launch.ssu_kernel.arg_names[len(args) :]])
        got = (*[t.data_ptr() for t in got[:POINTERS]], *got[POINTERS:])
    assert got == (*[t.data_ptr() for t in expected[:POINTERS]], *expected[POINTERS:])
    assert sum(len(kept) for kept in launches.direct.values()) <= 2  # nothing kept that evicts the rest


LANE_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus")


def lane_for(launches, call):
    """``launches.lane`` bound with ``call``'s state views, slots and constants."""
    fixed = {k: v for k, v in call.items() if k not in ("out", "dst_slots")}
    return launches.lane(scales=None, **fixed)


def test_a_lane_passes_what_the_direct_launch_passes(recorder):
    gen = torch.Generator().manual_seed(6)
    faults = torch.zeros(1, dtype=torch.int64)
    launches = StepLaunches(None, faults)
    first = make_call(gen)
    assert lane_for(launches, first) is None  # nothing launched in this layout yet
    launches(**first)
    lane = lane_for(launches, first)
    assert lane is not None
    for _ in range(3):
        call = make_call(gen)
        call.update(read=first["read"], write=first["write"], slots=first["slots"])  # the lane's own
        out = lane(*[call[k] for k in LANE_INPUTS])
        assert out.shape == call["x"].shape and out.dtype == call["x"].dtype
        via_lane = recorder.direct[-1]
        call["out"] = out
        launches(**call)  # the direct launch of the same call
        assert via_lane == recorder.direct[-1]
    assert len(recorder.full) == 1
    assert any(t is first["read"] for t in lane.holds) and any(t is first["slots"] for t in lane.holds)


def changed_call(gen, change: str) -> dict:
    """A call (of ``make_call(gen, z=False)``'s layout) with one ``change`` a lane bound for that
    layout must decline: another layout, z given, no softplus, an unaligned x, another dtype of
    dt, a D that needs gradients or is sparse (any other change: none)."""
    call = make_call(gen, z=False, b=2 if change == "another layout" else 3)
    if change == "z given":
        call["z"] = torch.randn(3, 4, 16, generator=gen).to(torch.bfloat16)
    if change == "no softplus":
        call["dt_softplus"] = False
    if change == "unaligned":
        x = call["x"]
        call["x"] = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
    if change == "another dtype":
        call["dt"] = call["dt"].float()
    if change == "needs gradients":
        call["D"] = call["D"].clone().requires_grad_()
    if change == "sparse":
        call["D"] = call["D"].to_sparse()
    return call


@pytest.mark.parametrize(
    "change",
    ["another layout", "z given", "no softplus", "unaligned", "another device"],
)
def test_a_lane_declines_what_it_was_not_bound_for(recorder, monkeypatch, change):
    gen = torch.Generator().manual_seed(7)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    first = make_call(gen, z=False)
    launches(**first)
    lane = lane_for(launches, first)
    call = changed_call(gen, change)
    if change == "another device":
        monkeypatch.setattr(step_launches, "_current_device", lambda: 1)
    assert lane(*[call[k] for k in LANE_INPUTS]) is None
    assert not recorder.direct


def test_no_lane_without_the_direct_launcher(recorder, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    call = make_call(gen)
    launches(**call)
    monkeypatch.setattr(step_launches, "_raw_stream", None)
    assert lane_for(launches, call) is None


def adopted_call(gen, cache, **kwargs):
    """``make_call``'s tensors with the state views of an adopted ``cache`` (num_slots, H, P, N)."""
    call = make_call(gen, **kwargs)
    view = cache.unsqueeze(1)
    call.update(read=view, write=view)
    return call


def test_a_cache_lane_steps_any_tensor_of_the_caches_layout(recorder):
    """A copy of the cache made before each step (as transformers does from 5.25) is launched at its
    own address with the kept launch; the lane keeps none of those tensors alive."""
    gen = torch.Generator().manual_seed(9)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    cache = torch.randn(6, 4, 16, 32, generator=gen)
    first = adopted_call(gen, cache)
    launches(**first)
    fixed = {k: v for k, v in first.items() if k not in ("out", "dst_slots")}
    lane = launches.lane(scales=None, cache=cache, **fixed)
    assert lane is not None
    copies = []
    for _ in range(3):
        copy = cache.clone()
        call = adopted_call(gen, copy)
        call["slots"] = first["slots"]
        out = lane(copy, *[call[k] for k in LANE_INPUTS])
        assert out is not None
        via_lane = recorder.direct[-1]
        call["out"] = out
        launches(**call)  # the direct launch of the same call on the copy's views
        assert via_lane == recorder.direct[-1]
        copies.append(weakref.ref(copy))
        del copy, call
    assert len(recorder.full) == 1
    others = [torch.randn(7, 4, 16, 32), torch.randn(6, 4, 32, 16).transpose(2, 3), cache.double()]
    for other in others:
        assert lane(other, *[first[k] for k in LANE_INPUTS]) is None
    assert all(t is not cache for t in lane.holds)
    del cache, first, fixed, others
    assert all(ref() is None for ref in copies)


def test_a_cache_lane_needs_the_views_of_its_cache_and_no_row_scales(recorder):
    gen = torch.Generator().manual_seed(10)
    launches = StepLaunches(None, torch.zeros(1, dtype=torch.int64))
    cache = torch.randn(6, 4, 16, 32, generator=gen)
    first = adopted_call(gen, cache)
    launches(**first)
    fixed = {k: v for k, v in first.items() if k not in ("out", "dst_slots")}
    assert launches.lane(scales=None, cache=cache.clone(), **fixed) is None  # not the views' tensor
    scales = types.SimpleNamespace(read=torch.ones(6, 1, 4, 16), write=None)
    scales.write = scales.read
    assert launches.lane(scales=scales, cache=cache, **fixed) is None
