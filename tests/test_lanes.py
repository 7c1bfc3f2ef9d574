"""Lanes (plugin API 1.6, ``ssu.contract.LaneFn``) and cache lanes (1.7,
``ssu.contract.CacheLaneFn``): a kernel hands its backend's lanes out only where skipping the
step's per-call work keeps every guarantee the step gives, and the drop-in (and the transformers
patch) send a model's decode calls through them, taking the step whenever a lane declines."""

from __future__ import annotations

import weakref

import pytest
import torch

import ssu
from ssu.checking import oracle
from ssu.state import slot_state
from ssu.plugins.registry import default_registry

from fakes import small_problem
from test_engine_state import expected, mamba2_call

H, P, N, G = 4, 8, 16, 2


class Laned:
    """The reference's math, with a lane that runs the step for calls of the bound batch and
    counts what it is asked."""

    NAME = "laned"

    def __init__(self, api: str = ssu.PLUGIN_API_VERSION, guards_slots: bool = True, cache_lanes: bool = False) -> None:
        self.api, self.guards_slots, self.cache_lanes = api, guards_slots, cache_lanes
        self.bound: list = []  # the batch of each lane bound
        self.served = 0  # calls a lane served
        self.cache_bound: list = []  # the batch of each cache lane bound
        self.cache_served = 0  # calls a cache lane served
        self.cache_asked = 0  # calls a cache lane was asked to serve

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

        def cache_lane(state, layer, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False):
            batch, bound = x.shape[0], state.cache[layer]
            layout = (bound.shape, bound.stride(), bound.dtype)
            self.cache_bound.append(batch)

            def run(cache, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
                self.cache_asked += 1
                if x.shape[0] != batch or (cache.shape, cache.stride(), cache.dtype) != layout:
                    return None
                self.cache_served += 1
                target = slot_state.adopt(ctx.problem, (cache,), self.NAME)
                return step(target, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, None, 0)

            return run

        laned_step.lane = lane
        if self.cache_lanes:
            laned_step.cache_lane = cache_lane
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
    (entry,) = ssu.dropin.cache._adopted.values()
    assert entry.lanes == [] and entry.binds == ssu.dropin.LANE_BINDS
    ssu.dropin.clear()


@pytest.fixture
def cache_laned():
    """A :class:`Laned` with cache lanes (plugin API 1.7) in the process-wide registry."""
    plugin = Laned(cache_lanes=True)
    ssu.dropin.clear()
    default_registry().register(plugin)
    yield plugin
    default_registry().unregister(Laned.NAME)
    ssu.dropin.clear()


def test_a_cache_lane_serves_a_fresh_copy_of_the_cache_at_every_step(cache_laned, gen, monkeypatch):
    """What transformers does from 5.25: each decode step hands over a copy of the cache made just
    before it, and keeps that copy. After the first call no copy is adopted or checked again, every
    state and output matches the oracle, and the copies dropped are freed."""
    prepared = []
    prepare = ssu.dropin.cache._prepare
    monkeypatch.setattr(ssu.dropin.cache, "_prepare", lambda *a, **k: prepared.append(1) or prepare(*a, **k))
    config = ssu.Config(backend=Laned.NAME)
    cache = torch.randn(6, H, P, N, generator=gen)
    dropped = []
    for _ in range(5):
        before, cache = cache, cache.clone()
        call = mamba2_call(3, gen, tied=True)
        out = ssu.selective_state_update(cache, **call, dt_softplus=True, config=config)
        states, outs = expected(before, call, [0, 1, 2])
        assert oracle.rel_error(out, outs) < 1e-5 and oracle.rel_error(cache[:3], states) < 1e-5
        assert torch.equal(cache[3:], before[3:])
        dropped.append(weakref.ref(before))
        del before
    assert len(prepared) == 1 and cache_laned.cache_bound == [3] and cache_laned.cache_served == 4
    assert cache_laned.bound == [] and not ssu.dropin.cache._adopted
    assert all(ref() is None for ref in dropped)
    assert ssu.dropin.kernel_for(cache, config).backend == Laned.NAME


@pytest.mark.parametrize("change", ["more slots", "another pad id", "slot ids"])
def test_a_cache_lane_serves_only_its_layout_and_pad_id(cache_laned, gen, change):
    config = ssu.Config(backend=Laned.NAME)
    ssu.selective_state_update(
        torch.randn(6, H, P, N, generator=gen), **mamba2_call(3, gen, tied=True), dt_softplus=True, config=config
    )
    cache = torch.randn(7 if change == "more slots" else 6, H, P, N, generator=gen)
    before, call = cache.clone(), mamba2_call(3, gen, tied=True)
    extra = {"pad_slot_id": 99} if change == "another pad id" else {}
    if change == "slot ids":
        extra = {"state_batch_indices": torch.tensor([0, 1, 2], dtype=torch.int32)}
    out = ssu.selective_state_update(cache, **call, dt_softplus=True, config=config, **extra)
    states, outs = expected(before, call, [0, 1, 2])
    assert oracle.rel_error(out, outs) < 1e-5 and oracle.rel_error(cache[:3], states) < 1e-5
    assert cache_laned.cache_served == 0


def test_no_cache_lane_for_an_allocated_state_or_an_older_backend(gen):
    for plugin, adopted in [(Laned(cache_lanes=True), False), (Laned(api="1.6", cache_lanes=True), True)]:
        kernel = opened(plugin)
        if adopted:
            state = kernel.adopt_state(torch.randn(10, H, P, N, generator=gen))
        else:
            state = kernel.allocate_state()
        call = dict(mamba2_call(3, gen, tied=False), slots=torch.tensor([0, 4, 2], dtype=torch.int32))
        kernel.step(state, **call, dt_softplus=True)
        assert kernel.cache_lane(state, **call, dt_softplus=True) is None
        assert plugin.cache_bound == []
        assert kernel.lane(state, **call, dt_softplus=True) is not None  # its plain lane still
    default_registry().unregister(Laned.NAME)


def test_a_patched_model_decodes_through_cache_lanes(cache_laned, monkeypatch):
    """A transformers model through the patch: one adoption for the whole decode (the layers' caches,
    and the copies transformers from 5.25 makes of them at each step, share one layout), every
    later call through the cache lane, which the patched function tries itself (the drop-in is
    called once), the same tokens and states as transformers' own path."""
    pytest.importorskip("transformers")
    from ssu.integrations import hf_models
    from ssu.integrations import transformers as integration

    model = hf_models.random_model("nemotron_h", "tiny", 2)
    ids = torch.randint(0, 1024, (2, 6), generator=torch.Generator().manual_seed(0))
    own = hf_models.generate(model, ids, 5)
    prepared = []
    prepare = ssu.dropin.cache._prepare
    monkeypatch.setattr(ssu.dropin.cache, "_prepare", lambda *a, **k: prepared.append(1) or prepare(*a, **k))
    dropin_calls = []
    dropin = ssu.dropin.after_cache_lanes
    monkeypatch.setattr(
        ssu.dropin.cache, "after_cache_lanes", lambda *a, **k: dropin_calls.append(1) or dropin(*a, **k)
    )
    with integration.patch(model, backend=Laned.NAME) as patch:
        through = hf_models.generate(model, ids, 5)
    calls = 4 * len(patch.mixers)  # 4 decode steps per mixer
    assert len(prepared) == 1 and cache_laned.cache_served == calls - 1 and len(dropin_calls) == 1
    assert torch.equal(own.sequences, through.sequences)
    for a, b in zip(own.recurrent_states(), through.recurrent_states()):
        assert oracle.rel_error(b, a) <= oracle.state_tolerance("fp32")


def test_a_patched_call_every_cache_lane_declines_asks_each_once(cache_laned):
    """A decode of another batch size than the lanes were bound for: the patched function asks the
    bound cache lane, which declines, and goes on with the drop-in's step without asking it again."""
    pytest.importorskip("transformers")
    from ssu.integrations import hf_models
    from ssu.integrations import transformers as integration

    model = hf_models.random_model("nemotron_h", "tiny", 2)
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 1024, (2, 6), generator=gen), torch.randint(0, 1024, (3, 6), generator=gen)
    own = hf_models.generate(model, second, 3)
    with integration.patch(model, backend=Laned.NAME) as patch:
        hf_models.generate(model, first, 3)
        bound, asked = len(cache_laned.cache_bound), cache_laned.cache_asked
        through = hf_models.generate(model, second, 3)
    calls = 2 * len(patch.mixers)  # 2 decode steps per mixer
    assert bound == 1 and cache_laned.cache_bound[1:] == [3]  # one lane per batch size, bound once
    # the batch-2 lane declines every call of batch 3 once; from the second call the batch-3 lane
    # (bound after the first) serves, asked first
    assert cache_laned.cache_asked - asked == 1 + (calls - 1)
    assert torch.equal(own.sequences, through.sequences)
