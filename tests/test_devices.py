"""Launches run on the problem's device: with several GPUs visible, every step, commit and state
hook of a kernel for ``cuda:N`` runs with ``cuda:N`` current (Triton launches on the current
device); on one GPU, or the CPU, the step is the backend's callable itself."""

from __future__ import annotations

import pytest
import torch

import ssu
from ssu.contract import devices
from ssu.checking.inputs import step_inputs


class Recorder:
    """Stands in for ``ssu.contract.devices._cuda_device``: records the indices made current."""

    def __init__(self, real=None):
        self.entered: list[int] = []
        self.real = real

    def __call__(self, index):
        recorder = self

        class Guard:
            def __enter__(self):
                recorder.entered.append(index)
                self.inner = recorder.real(index) if recorder.real else None
                return self.inner.__enter__() if self.inner else None

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc) if self.inner else False

        return Guard()


def test_no_guard_on_the_cpu_without_an_index_or_with_one_gpu(monkeypatch):
    def fn(a, b=2):
        return a + b

    assert devices.on_device(fn, "cpu") is fn
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.on_device(fn, "cuda:0") is fn
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.on_device(fn, "cuda") is fn  # the current device by definition
    assert devices.launch_index("cuda:1") == 1 and devices.launch_index("cpu") is None


def test_with_two_gpus_the_call_runs_with_its_device_current(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(devices, "_cuda_device", recorder)

    def fn(a, b=2):
        """doc"""
        return a + b

    guarded = devices.on_device(fn, "cuda:1")
    assert guarded is not fn and guarded.__wrapped__ is fn and guarded.__doc__ == "doc"
    assert guarded(1, b=3) == 4 and guarded(2) == 4
    assert recorder.entered == [1, 1]
    with devices.current("cuda:1"):
        pass
    assert recorder.entered == [1, 1, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_kernel_launches_with_its_device_current(backend, monkeypatch):
    """One GPU seen as two: every launch of a kernel for cuda:0 enters cuda:0, and the results are
    those of the unguarded kernel."""
    if backend == "triton":
        pytest.importorskip("ssu_backend_triton")
    problem = ssu.Problem(
        nheads=8,
        headdim=16,
        dstate=32,
        ngroups=2,
        num_slots=6,
        max_batch=3,
        tokens_per_step=2,
        speculative=True,
        device="cuda:0",
    )
    gen = torch.Generator().manual_seed(5)
    inputs = step_inputs(problem, torch.tensor([4, 1, 2], dtype=torch.int32, device="cuda"), gen)
    values = torch.randn(6, 8, 16, 32, generator=gen).cuda()
    accepted = torch.tensor([1, 2, 2], dtype=torch.int32, device="cuda")

    def run(kernel):
        state = kernel.allocate_state(1)
        kernel.write_state(state, torch.arange(6, dtype=torch.int32, device="cuda"), values)
        out = kernel.step(state, **inputs.kwargs(), layer=0)
        kernel.commit(state, inputs.slots, accepted)
        return out.clone(), kernel.read_state(state, torch.arange(6, dtype=torch.int32, device="cuda"))

    config = ssu.Config(backend=backend)
    plain = run(ssu.open(config, problem))
    recorder = Recorder(real=torch.cuda.device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(devices, "_cuda_device", recorder)
    kernel = ssu.open(config, problem)
    guarded = run(kernel)
    assert kernel.step.__wrapped__ is not None and set(recorder.entered) == {0}
    assert len(recorder.entered) >= 5  # open, allocate, write, step, commit, read
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded))
