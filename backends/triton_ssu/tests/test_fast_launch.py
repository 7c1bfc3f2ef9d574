"""The direct launch of kept Triton kernels: a key seen before launches the kept kernel with every
argument in signature order; anything that changes Triton's specialization (a dtype, an
alignment, an integer, an option, the device) goes through ``jit[grid]`` again."""

from __future__ import annotations

import pytest
import torch

from ssu_backend_triton import fast_launch


class FakeCompiled:
    packed_metadata = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class FakeJit:
    """``jit[grid](*args, **kwargs)`` compiles (a new handle per call) and launches."""

    arg_names = ["x_ptr", "n", "BLOCK", "EVEN"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log)

        return run


@pytest.fixture
def jit(monkeypatch):
    monkeypatch.setattr(fast_launch, "current_device", lambda: 0)
    fast_launch.forget()
    yield FakeJit()
    fast_launch.forget()


def test_a_key_seen_before_launches_the_kept_kernel_in_signature_order(jit):
    x = torch.zeros(8)
    first = fast_launch.launch(jit, (4, 1, 1), x, 8, EVEN=True, BLOCK=16, num_warps=2)
    second = fast_launch.launch(jit, (2, 1, 1), x, 8, EVEN=True, BLOCK=16, num_warps=2)
    assert second is first
    assert [entry[0] for entry in jit.log] == ["jit", "direct"]
    assert jit.log[1] == ("direct", (2, 1, 1), (x, 8, 16, True))  # the grid of this call; options left out


@pytest.mark.parametrize(
    "change",
    [
        dict(x=torch.zeros(8, dtype=torch.float16)),
        dict(x=torch.zeros(9)[1:]),  # 4 bytes past an aligned address
        dict(n=16),
        dict(BLOCK=32),
        dict(num_warps=4),
    ],
    ids=["dtype", "alignment", "integer", "constexpr", "option"],
)
def test_what_changes_the_specialization_goes_through_triton_again(jit, change):
    call = dict(x=torch.zeros(8), n=8, BLOCK=16, EVEN=True, num_warps=2)
    fast_launch.launch(jit, (1,), call["x"], call["n"], BLOCK=call["BLOCK"], EVEN=True, num_warps=call["num_warps"])
    call.update(change)
    fast_launch.launch(jit, (1,), call["x"], call["n"], BLOCK=call["BLOCK"], EVEN=True, num_warps=call["num_warps"])
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_another_device_goes_through_triton_again(jit, monkeypatch):
    x = torch.zeros(8)
    fast_launch.launch(jit, (1,), x, 8, BLOCK=16, EVEN=True)
    monkeypatch.setattr(fast_launch, "current_device", lambda: 1)
    fast_launch.launch(jit, (1,), x, 8, BLOCK=16, EVEN=True)
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_a_call_leaving_a_parameter_to_its_default_is_never_kept(jit):
    x = torch.zeros(8)
    for _ in range(2):
        fast_launch.launch(jit, (1,), x, 8, BLOCK=16)  # EVEN left out
    assert [entry[0] for entry in jit.log] == ["jit", "jit"]


def test_an_interpreted_launch_is_never_kept(jit, monkeypatch):
    monkeypatch.setattr(FakeJit, "__getitem__", lambda self, grid: lambda *a, **k: self.log.append("jit"))
    x = torch.zeros(8)
    for _ in range(2):
        assert fast_launch.launch(jit, (1,), x, 8, BLOCK=16, EVEN=True) is None
    assert jit.log == ["jit", "jit"]


class FakeJit2(FakeJit):
    arg_names = ["a_ptr", "b_ptr", "n", "m", "BLOCK"]


def test_the_positional_key_of_a_call_site_with_several_tensors(monkeypatch):
    monkeypatch.setattr(fast_launch, "current_device", lambda: 0)
    fast_launch.forget()
    jit = FakeJit2()
    a, b = torch.zeros(8), torch.zeros(8, dtype=torch.float16)
    fast_launch.launch(jit, (1,), a, b, 3, 4, BLOCK=8)
    fast_launch.launch(jit, (1,), a.clone(), b.clone(), 3, 4, BLOCK=8)  # other tensors, same key
    fast_launch.launch(jit, (1,), a, b.float(), 3, 4, BLOCK=8)  # another dtype
    fast_launch.launch(jit, (1,), a, torch.zeros(9)[1:], 3, 4, BLOCK=8)  # unaligned
    fast_launch.launch(jit, (1,), a, b, 3, 5, BLOCK=8)  # another integer
    fast_launch.launch(jit, (1,), a, None, 3, 4, BLOCK=8)  # no tensor where one was: Triton decides
    assert [entry[0] for entry in jit.log] == ["jit", "direct", "jit", "jit", "jit", "jit"]
    fast_launch.forget()


def test_a_grid_of_fewer_than_three_dimensions_is_padded_for_the_kept_kernel(jit):
    """jit[grid] pads a 1-D or 2-D grid with ones; CompiledKernel[grid] reads three dimensions."""
    x = torch.zeros(8)
    for _ in range(2):
        fast_launch.launch(jit, (5, 2), x, 8, BLOCK=16, EVEN=True)
    assert jit.log[1][:2] == ("direct", (5, 2, 1))
