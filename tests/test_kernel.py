"""The kernel object: lifecycle, scratch, warmup, explain, errors from misbehaving backends."""

from __future__ import annotations

import pytest
import torch

import ssu
from ssu.plugins.registry import Registry

from fakes import small_problem


def test_open_needs_a_problem():
    with pytest.raises(ssu.ConfigError, match="needs a Problem"):
        ssu.open(ssu.Config())
    with pytest.raises(ssu.ConfigError, match="must be an ssu.Config"):
        ssu.open({"backend": "reference"}, small_problem())


def test_allocate_state_checks_layers():
    kernel = ssu.open(ssu.Config(), small_problem())
    with pytest.raises(ssu.ConfigError, match="num_layers must be a positive integer"):
        kernel.allocate_state(num_layers=0)
    state = kernel.allocate_state(num_layers=3)
    assert state.num_layers == 3 and state.nbytes == 3 * (10 + 1) * 4 * 8 * 16 * 4  # a sink row per layer


def test_step_returns_and_fills_out(gen):
    from ssu.checking.inputs import step_inputs

    p = small_problem()
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state()
    inputs = step_inputs(p, torch.tensor([0, 1], dtype=torch.int32), gen)
    out = torch.full_like(inputs.x, float("nan"))
    assert kernel.step(state, out=out, **inputs.kwargs()) is out
    assert torch.isfinite(out).all()


def test_explain_and_repr():
    kernel = ssu.open(ssu.Config(), small_problem())
    assert "-> reference: selected" in kernel.explain()
    assert "reference" in repr(kernel)
    assert "reference: selected" in ssu.explain(ssu.Config(), small_problem())


class _Misbehaving:
    """Hooks returning the wrong things; the kernel must name the backend and the hook."""

    @ssu.hookimpl
    def ssu_backend(self):
        return ssu.BackendSpec(name="misbehaving", api_version="1.0", factory=lambda ctx: "not callable")

    @ssu.hookimpl
    def ssu_allocate_state(self, ctx, num_layers):
        return "not a state"

    @ssu.hookimpl
    def ssu_read_state(self, ctx, state, slots, layer):
        return None

    @ssu.hookimpl
    def ssu_write_state(self, ctx, state, slots, values, layer):
        return None


def test_misbehaving_factory_is_reported():
    registry = Registry(entry_points=[])
    registry.register(_Misbehaving())
    with pytest.raises(ssu.BackendError, match="'misbehaving': its factory returned str, not a step callable"):
        ssu.open(ssu.Config(backend="misbehaving"), small_problem(), registry=registry)


def test_scratch_hook_result_is_kept():
    class WithScratch(_Misbehaving):
        @ssu.hookimpl
        def ssu_backend(self):
            return ssu.BackendSpec(name="scratchy", api_version="1.0", factory=lambda ctx: lambda *a, **k: None)

        @ssu.hookimpl
        def ssu_allocate_scratch(self, ctx):
            return {"buffer": torch.empty(ctx.problem.max_batch)}

    registry = Registry(entry_points=[])
    registry.register(WithScratch())
    kernel = ssu.open(ssu.Config(backend="scratchy"), small_problem(), registry=registry)
    assert kernel.scratch["buffer"].shape == (4,)
    with pytest.raises(ssu.BackendError, match="hook ssu_allocate_state returned 'not a state'"):
        kernel.allocate_state()
