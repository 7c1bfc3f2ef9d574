"""Input validation: InputError naming the tensor, expected and actual, before anything is written;
checks cached per signature; switchable."""

from __future__ import annotations

import pytest
import torch

import ssu
from ssu.runtime import validation
from ssu.checking.inputs import pick_slots, random_states, step_inputs

from fakes import small_problem


@pytest.fixture
def setup(gen):
    p = small_problem(input_dtype="bf16")
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state(num_layers=2)
    every = torch.arange(p.num_slots)
    kernel.write_state(state, every, random_states(p, p.num_slots, gen))
    slots = pick_slots(p, 3, gen)
    return kernel, state, step_inputs(p, slots, gen).kwargs(), kernel.read_state(state, every).clone()


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda k: dict(k, x=k["x"].float()), r"x: expected dtype bf16, got fp32"),
        (
            lambda k: dict(k, x=k["x"][:, :2]),
            r"x: expected shape \(3, 4, 8\) \(batch, heads, headdim\), got \(3, 2, 8\)",
        ),
        (lambda k: dict(k, dt=k["dt"][:2]), r"dt: expected shape \(3, 4\), got \(2, 4\)"),
        (lambda k: dict(k, A=k["A"].double()), r"A: expected dtype fp32, got fp64"),
        (lambda k: dict(k, B=k["B"][..., :5]), r"B: expected shape \(3, 2, 16\), got \(3, 2, 5\)"),
        (lambda k: dict(k, C=k["C"].half()), r"C: expected dtype bf16, got fp16"),
        (lambda k: dict(k, slots=k["slots"].float()), r"slots: expected dtype int32 or int64, got fp32"),
        (lambda k: dict(k, slots=k["slots"].tolist()), r"slots: expected an int32 or int64 torch.Tensor, got list"),
        (lambda k: dict(k, D=torch.ones(5)), r"D: expected shape \(4\), got \(5,\)"),
        (lambda k: dict(k, z=k["z"][:1]), r"z: expected shape \(3, 4, 8\), got \(1, 4, 8\)"),
        (lambda k: dict(k, dt_softplus=1), r"dt_softplus: expected True or False"),
        (lambda k: dict(k, out=torch.empty(3, 4, 8)), r"out: expected dtype bf16, got fp32"),
        (lambda k: dict(k, out=torch.empty(1, 1, 1, dtype=torch.bfloat16).expand(3, 4, 8)), r"out: has a zero stride"),
        (lambda k: dict(k, x=k["x"].numpy() if False else "x"), r"x: expected a torch.Tensor"),
    ],
)
def test_bad_step_inputs(setup, change, pattern):
    kernel, state, good, before = setup
    with pytest.raises(ssu.InputError, match=pattern):
        kernel.step(state, layer=0, **change(good))
    assert torch.equal(kernel.read_state(state, torch.arange(kernel.problem.num_slots)), before)


def test_batch_larger_than_max_batch(setup, gen):
    kernel, state, good, _ = setup
    p = kernel.problem
    big = pick_slots(p, p.max_batch + 1, gen)
    with pytest.raises(ssu.InputError, match=r"slots: batch of 5 rows; expected 1 to 4 \(Problem.max_batch\)"):
        kernel.step(state, **step_inputs(p, big, gen).kwargs())


def test_layer_and_state_checks(setup, gen):
    kernel, state, good, _ = setup
    with pytest.raises(ssu.InputError, match=r"layer: expected an integer in \[0, 2\)"):
        kernel.step(state, layer=2, **good)
    other = ssu.open(ssu.Config(), small_problem(input_dtype="bf16", num_slots=11))
    with pytest.raises(ssu.InputError, match="state: it belongs to a kernel"):
        other.step(state, **good)
    with pytest.raises(ssu.InputError, match="state: expected the ssu.State"):
        kernel.step(state.buffers["ssm"], **good)


def test_commit_checks(setup, gen):
    kernel, state, good, _ = setup
    with pytest.raises(ssu.InputError, match="opened with speculative=False"):
        kernel.commit(state, good["slots"], torch.ones(3, dtype=torch.int32))
    p = small_problem(speculative=True, tokens_per_step=2)
    spec = ssu.open(ssu.Config(validate="full"), p)
    st = spec.allocate_state()
    slots = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ssu.InputError, match=r"num_accepted: expected shape \(2\), got \(3,\)"):
        spec.commit(st, slots, torch.ones(3, dtype=torch.int32))
    with pytest.raises(ssu.InputError, match=r"num_accepted\[1\] = 3: expected 1 to 2"):
        spec.commit(st, slots, torch.tensor([1, 3], dtype=torch.int32))


def test_read_write_checks(setup, gen):
    kernel, state, good, _ = setup
    p = kernel.problem
    with pytest.raises(ssu.InputError, match=r"slots\[0\] = 10: not a slot of this cache \(0..9\)"):
        kernel.read_state(state, torch.tensor([10]))
    with pytest.raises(ssu.InputError, match=r"slots\[0\] = -1: the pad id of this problem"):
        kernel.read_state(state, torch.tensor([-1]))
    with pytest.raises(ssu.InputError, match=r"slot\(s\) \[2\] appear more than once"):
        kernel.write_state(state, torch.tensor([2, 2]), random_states(p, 2, gen))
    with pytest.raises(ssu.InputError, match=r"values: expected shape \(2, 4, 8, 16\)"):
        kernel.write_state(state, torch.tensor([1, 2]), random_states(p, 3, gen))


def test_full_validation_checks_slot_values(gen):
    p = small_problem()
    kernel = ssu.open(ssu.Config(validate="full"), p)
    state = kernel.allocate_state()
    with pytest.raises(ssu.InputError, match=r"slots\[1\] = 99"):
        kernel.step(state, **step_inputs(p, torch.tensor([1, 99], dtype=torch.int32), gen).kwargs())
    with pytest.raises(ssu.InputError, match=r"slot\(s\) \[4\] appear more than once"):
        kernel.step(state, **step_inputs(p, torch.tensor([4, 4], dtype=torch.int32), gen).kwargs())


def test_checks_run_once_per_signature(setup, monkeypatch):
    kernel, state, good, _ = setup
    calls = []
    original = validation.Checker.step
    monkeypatch.setattr(validation.Checker, "step", lambda self, *a: calls.append(1) or original(self, *a))
    for _ in range(3):
        kernel.step(state, layer=0, **good)
    kernel.step(state, layer=1, **good)  # the layer is checked on every call, not by the full check
    assert len(calls) == 1
    kernel.step(state, layer=1, **dict(good, D=None))
    kernel.step(state, layer=1, **dict(good, x=good["x"].clone()))  # a new tensor of a seen signature
    assert len(calls) == 2


def test_validation_off_is_the_backend_callable(gen):
    kernel = ssu.open(ssu.Config(validate=False), small_problem())
    assert kernel.step is kernel.raw_step
    checked = ssu.open(ssu.Config(), small_problem())
    assert checked.step.__wrapped__ is checked.raw_step


def test_multi_token_shapes(gen):
    p = small_problem(speculative=True, tokens_per_step=3)
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state()
    good = step_inputs(p, torch.tensor([0, 1], dtype=torch.int32), gen).kwargs()
    kernel.step(state, **good)
    with pytest.raises(ssu.InputError, match=r"x: 4 tokens per sequence; expected 1 to 3"):
        kernel.step(state, **dict(good, x=torch.cat([good["x"], good["x"][:, :1]], 1)))
    with pytest.raises(ssu.InputError, match=r"x: expected shape \(2, \*, 4, 8\)"):
        kernel.step(state, **dict(good, x=good["x"][:, 0]))
