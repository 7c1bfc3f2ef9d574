"""Lanes (plugin API 1.6, ``ssu.contract.LaneFn``): a kernel hands its backend's lane out only
where skipping the step's per-call work keeps every guarantee the step gives, and the drop-in sends
a model's decode calls through it, taking the step whenever the lane declines."""

from __future__ import annotations

import pytest
import torch

import ssu
from ssu import oracle, slot_state
from ssu.registry import default_registry

from fakes import small_problem
from test_engine_state import expected, mamba2_call

H, P, N, G = 4, 8, 16, 2


class Laned:
    """The reference's math, with a lane that runs the step for calls of the bound batch and
    counts what it is asked."""

    NAME = "laned"

    def __init__(self, api: str = ssu.PLUGIN_API_VERSION, guards_slots: bool = True) -> None:
        self.api, self.guards_slots = api, guards_slots
        self.bound: list = []  # the batch of each lane bound
        self.served = 0  # calls a lane served

    @ssu.hookimpl
    def ssu_backend(self):
        return ssu.BackendSpec(
            name=self.NAME,
            api_version=self.api,
            factory=self.factory,
            capabilities=ssu.Capabilities(
                devices={"cpu"},
                adopt_state=True,
                guards_slots=self.guards_slots,
                tied_inputs=True,
                any_pad_slot_id=True,
            ),
        )

    def factory(self, ctx):
        from ssu.reference.math import make_step

        step = make_step(ctx)

        def laned_step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None,
                       layer=0, dst_slots=None):  # fmt: skip
            return step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)

        def lane(state, layer, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False):
            batch = x.shape[0]
            self.bound.append(batch)

            def run(x, dt, A, B, C, D, z, dt_bias, dt_softplus):
                if x.shape[0] != batch:
                    return None
                self.served += 1
                return step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, None, layer)

            return run

        laned_step.lane = lane
        return laned_step

    ssu_allocate_state = staticmethod(slot_state.ssu_allocate_state)
    ssu_adopt_state = staticmethod(slot_state.ssu_adopt_state)
    ssu_read_state = staticmethod(slot_state.ssu_read_state)
    ssu_write_state = staticmethod(slot_state.ssu_write_state)


@pytest.fixture
def laned():
    """A :class:`Laned` in the process-wide registry (the drop-in's), and no kernel kept."""
    plugin = Laned()
    ssu.dropin.clear()
    default_registry().register(plugin)
    yield plugin
    default_registry().unregister(Laned.NAME)
    ssu.dropin.clear()


def opened(plugin, validate=True):
    registry = default_registry()
    registry.unregister(Laned.NAME)
    registry.register(plugin)
    config = ssu.Config(backend=Laned.NAME, validate=validate)
    return ssu.open(config, small_problem(engine_state=True), registry=registry)


def kernel_lane(kernel, gen, **change):
    state = kernel.adopt_state(torch.randn(10, H, P, N, generator=gen))
    call = dict(mamba2_call(3, gen, tied=False), slots=torch.tensor([0, 4, 2], dtype=torch.int32))
    call.update(change)
    kernel.step(state, **call, dt_softplus=True)
    return kernel.lane(state, **call, dt_softplus=True)


def test_a_kernel_hands_out_its_backends_lane(laned, gen):
    assert kernel_lane(opened(laned), gen) is not None and laned.bound == [3]
    assert kernel_lane(opened(laned, validate=False), gen) is not None


@pytest.mark.parametrize(
    "why",
    ["validate full", "plugin API 1.5", "slot ids left to the core", "a backend without lanes"],
)
def test_no_lane_where_the_step_does_more_than_launch(laned, gen, why):
    """``validate = "full"`` checks slot values every call; a backend that leaves slot ids outside
    the cache to the core has them replaced before each validated step; a backend declaring an
    older plugin API never promised what a lane must do."""
    if why == "validate full":
        kernel = opened(laned, validate="full")
    elif why == "plugin API 1.5":
        kernel = opened(Laned(api="1.5"))
    elif why == "slot ids left to the core":
        kernel = opened(Laned(guards_slots=False))
    else:
        kernel = ssu.open(ssu.Config(backend="reference"), small_problem(engine_state=True))
    assert kernel_lane(kernel, gen) is None
    if why == "slot ids left to the core":  # without validation the core guards nothing anyway
        assert kernel_lane(opened(Laned(guards_slots=False), validate=False), gen) is not None


def test_a_lane_is_bound_only_for_a_call_that_passes_the_checks(laned, gen):
    kernel = opened(laned)
    state = kernel.adopt_state(torch.randn(10, H, P, N, generator=gen))
    call = dict(mamba2_call(3, gen, tied=False), slots=torch.tensor([0, 4, 2], dtype=torch.int32))
    call["x"] = call["x"].double()
    with pytest.raises(ssu.InputError, match="x"):
        kernel.lane(state, **call, dt_softplus=True)
    assert laned.bound == []


def test_the_dropin_steps_through_lanes_and_falls_back_to_the_step(laned, gen):
    config = ssu.Config(backend=Laned.NAME)
    cache = torch.randn(6, H, P, N, generator=gen)
    for batch in [3, 3, 3, 2, 3, 2]:
        before = cache.clone()
        call = mamba2_call(batch, gen, tied=True)
        out = ssu.selective_state_update(cache, **call, dt_softplus=True, config=config)
        states, outs = expected(before, call, list(range(batch)))
        assert oracle.rel_error(out, outs) < 1e-5 and oracle.rel_error(cache[:batch], states) < 1e-5
        assert torch.equal(cache[batch:], before[batch:])
    # a lane per batch, bound after each batch's first call; the other calls went through them
    assert laned.bound == [3, 2] and laned.served == 4


def test_calls_with_slot_ids_or_out_take_the_step(laned, gen):
    config = ssu.Config(backend=Laned.NAME)
    cache = torch.randn(6, H, P, N, generator=gen)
    ssu.selective_state_update(cache, **mamba2_call(3, gen, tied=True), dt_softplus=True, config=config)
    slots = torch.tensor([5, 1, 3], dtype=torch.int32)
    ssu.selective_state_update(
        cache, **mamba2_call(3, gen, tied=True), dt_softplus=True, state_batch_indices=slots, config=config
    )
    call = mamba2_call(3, gen, tied=True)
    out = torch.empty_like(call["x"])
    assert ssu.selective_state_update(cache, **call, dt_softplus=True, out=out, config=config) is out
    assert laned.bound == [3] and laned.served == 0


def test_a_kernel_without_lanes_is_asked_once(gen):
    ssu.dropin.clear()
    cache = torch.randn(6, H, P, N, generator=gen)
    for _ in range(3):
        ssu.selective_state_update(cache, **mamba2_call(3, gen, tied=True), dt_softplus=True)
    (entry,) = ssu.dropin._adopted.values()
    assert entry.lanes == [] and entry.binds == ssu.dropin.LANE_BINDS
    ssu.dropin.clear()
