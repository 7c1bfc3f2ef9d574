"""Nothing outside the named slots is ever touched, under the default config (``validate =
true``), and every refusal is one ``InputError`` raised before anything is written."""

from __future__ import annotations

import pytest
import torch

import ssu
from ssu.state import faults
from ssu.checking.harness import logical_states, prepared
from ssu.checking.inputs import pick_slots, step_inputs
from ssu.plugins.registry import Registry

from fakes import small_problem


def changed_slots(kernel, state, before, layer=0) -> list[int]:
    now = logical_states(kernel, state, layer)
    return (now != before[layer]).flatten(1).any(1).nonzero().flatten().tolist()


@pytest.mark.parametrize("bad", [-2, 12, 1000, -(2**31)])
def test_an_id_outside_the_cache_touches_nothing_and_is_reported(bad, gen):
    p = small_problem(num_slots=12)
    kernel = ssu.open(ssu.Config(), p)
    state, before = prepared(kernel, gen)
    slots = torch.tensor([3, bad, 5], dtype=torch.int32)
    kernel.step(state, **step_inputs(p, slots, gen).kwargs())
    with pytest.raises(
        ssu.InputError,
        match=rf"slots\[1\] = {bad}: neither a slot of this cache \(0..11\) nor the "
        r"pad id -1; that row was served as a pad row",
    ):
        kernel.check()
    kernel.check()  # the record was cleared
    assert changed_slots(kernel, state, before) == [3, 5]


def test_reads_and_writes_check_first(gen):
    p = small_problem()
    kernel = ssu.open(ssu.Config(), p)
    state, _ = prepared(kernel, gen)
    kernel.step(state, **step_inputs(p, torch.tensor([1, 99], dtype=torch.int32), gen).kwargs())
    with pytest.raises(ssu.InputError, match=r"slots\[1\] = 99"):
        kernel.read_state(state, torch.tensor([1]))


def test_full_validation_refuses_before_anything_is_written(gen):
    p = small_problem()
    kernel = ssu.open(ssu.Config(validate="full"), p)
    state, before = prepared(kernel, gen)
    for slots, message in (
        ([1, -2], r"slots\[1\] = -2: not a slot of this cache"),
        ([4, 4], r"slot\(s\) \[4\] appear more than once"),
    ):
        with pytest.raises(ssu.InputError, match=message):
            kernel.step(state, **step_inputs(p, torch.tensor(slots, dtype=torch.int32), gen).kwargs())
    assert changed_slots(kernel, state, before) == []


def test_duplicate_slots_touch_no_other_slot(gen):
    """A caller error (those rows' results are undefined), but every other slot stays as it was."""
    p = small_problem()
    kernel = ssu.open(ssu.Config(), p)
    state, before = prepared(kernel, gen)
    kernel.step(state, **step_inputs(p, torch.tensor([4, 4, 6], dtype=torch.int32), gen).kwargs())
    assert changed_slots(kernel, state, before) == [4, 6]


@pytest.mark.parametrize("validate", [True, "full"])
def test_a_commit_with_a_layer_not_stepped_is_refused(validate, gen):
    p = small_problem(speculative=True, tokens_per_step=3)
    kernel = ssu.open(ssu.Config(validate=validate), p)
    state, before = prepared(kernel, gen, layers=3)
    slots = pick_slots(p, 2, gen)
    for layer in (0, 2):
        kernel.step(state, layer=layer, **step_inputs(p, slots, gen).kwargs())
    with pytest.raises(
        ssu.InputError,
        match=r"commit: layer\(s\) \[1\] of this state were not stepped since the "
        r"last commit \(stepped: \[0, 2\]\).*Nothing was committed",
    ):
        kernel.commit(state, slots, torch.ones(2, dtype=torch.int32))
    for layer in range(3):
        assert changed_slots(kernel, state, before, layer) == []
    kernel.step(state, layer=1, **step_inputs(p, slots, gen).kwargs())
    kernel.commit(state, slots, torch.ones(2, dtype=torch.int32))  # every layer stepped: accepted
    with pytest.raises(ssu.InputError, match=r"layer\(s\) \[0, 1, 2\].*stepped: none"):
        kernel.commit(state, slots, torch.ones(2, dtype=torch.int32))


@pytest.mark.parametrize("count", [0, 4, -1])
def test_an_accepted_count_outside_one_to_t_leaves_the_slot_and_is_reported(count, gen):
    p = small_problem(speculative=True, tokens_per_step=3)
    kernel = ssu.open(ssu.Config(), p)
    state, before = prepared(kernel, gen, layers=1)
    slots = torch.tensor([2, 7], dtype=torch.int32)
    kernel.step(state, **step_inputs(p, slots, gen).kwargs())
    kernel.commit(state, slots, torch.tensor([count, 2], dtype=torch.int32))
    with pytest.raises(ssu.InputError, match=rf"num_accepted\[0\] = {count}: outside 1..3; that slot's state was left"):
        kernel.check()
    assert changed_slots(kernel, state, before) == [7]
    full = ssu.open(ssu.Config(validate="full"), p)
    state, _ = prepared(full, gen, layers=1)
    full.step(state, **step_inputs(p, slots, gen).kwargs())
    with pytest.raises(ssu.InputError, match=rf"num_accepted\[0\] = {count}: expected 1 to 3"):
        full.commit(state, slots, torch.tensor([count, 2], dtype=torch.int32))


def test_every_first_call_check_holds_on_later_signatures(gen):
    """A tensor on another device (meta, here) after good calls is an InputError, not torch's error."""
    p = small_problem()
    kernel = ssu.open(ssu.Config(), p)
    state, _ = prepared(kernel, gen)
    good = step_inputs(p, torch.tensor([1, 2], dtype=torch.int32), gen).kwargs()
    kernel.step(state, **good)
    kernel.step(state, **good)
    for name in ("x", "B", "A", "slots"):
        with pytest.raises(ssu.InputError, match=rf"{name}: expected a tensor on cpu .* got one on meta"):
            kernel.step(state, **dict(good, **{name: good[name].to("meta")}))


def test_the_python_signature_key_agrees(gen, monkeypatch):
    """Where torch has no C++ tensor guards the signatures are Python keys: the same refusals."""
    from ssu.runtime import signatures

    monkeypatch.setattr(signatures, "tensor_guards", lambda: None)
    test_every_first_call_check_holds_on_later_signatures(gen)


def test_the_core_guards_a_backend_that_does_not(gen):
    """A backend that does not declare guards_slots gets the ids replaced by the pad id first."""
    from fakes import good_backend

    namespace: dict = {}
    exec(good_backend("unguarded"), namespace)  # noqa: S102 - a test backend's source
    plugin = type("Plugin", (), {k: staticmethod(v) for k, v in namespace.items() if k.startswith("ssu_")})
    registry = Registry(entry_points=[], env={})
    registry.register(plugin())
    p = small_problem(num_slots=12)
    kernel = ssu.open(ssu.Config(backend="unguarded"), p, registry=registry)
    assert not kernel.capabilities.guards_slots
    state, before = prepared(kernel, gen)
    kernel.step(state, **step_inputs(p, torch.tensor([3, -2], dtype=torch.int32), gen).kwargs())
    assert faults.decode(int(kernel._ctx.faults)) == (1, faults.SLOTS, -2)
    with pytest.raises(ssu.InputError, match=r"slots\[1\] = -2"):
        kernel.check()
    assert changed_slots(kernel, state, before) == [3]


def test_a_pad_id_inside_the_cache_reserves_that_slot(gen):
    p = small_problem(num_slots=8, pad_slot_id=0)
    kernel = ssu.open(ssu.Config(), p)
    state, before = prepared(kernel, gen)
    kernel.step(state, **step_inputs(p, torch.tensor([0, 3], dtype=torch.int32), gen).kwargs())
    assert changed_slots(kernel, state, before) == [3]
    with pytest.raises(ssu.InputError, match=r"slots\[0\] = 0: the pad id of this problem"):
        kernel.read_state(state, torch.tensor([0]))
    assert list(pick_slots(p, 7, gen).sort().values) == list(range(1, 8))
