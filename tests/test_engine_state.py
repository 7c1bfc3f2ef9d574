"""Engines keep their own state cache: adopted tensors stepped in place, destination slots, any pad
id, and the drop-in ``ssu.selective_state_update`` with mamba_ssm's call shapes."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.checking import oracle
from ssu.checking.harness import compare_with_reference, engine_cache

from fakes import gpu_only_backend, small_problem

H, P, N, G = 4, 8, 16, 2


@pytest.fixture(autouse=True)
def fresh_dropin():
    ssu.dropin.clear()
    yield
    ssu.dropin.clear()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    state_dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    tokens=st.sampled_from([1, 1, 3]),
    destinations=st.booleans(),
    pad_id=st.sampled_from([-1, 0, 99]),
    layers=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_adopted_caches_match_the_reference(state_dtype, tokens, destinations, pad_id, layers, seed):
    p = small_problem(
        state_dtype=state_dtype,
        input_dtype="bf16",
        num_slots=12,
        max_batch=4,
        tokens_per_step=tokens,
        speculative=tokens > 1,
        pad_slot_id=pad_id,
        engine_state=True,
    )
    compare_with_reference(
        "reference",
        p,
        torch.Generator().manual_seed(seed),
        steps=3,
        pad=1,
        layers=layers,
        adopt=True,
        destinations=destinations and tokens == 1,
    )


def test_adopt_takes_one_tensor_a_stack_or_a_list(gen):
    p = small_problem(num_slots=6)
    kernel = ssu.open(ssu.Config(), p)
    stack = torch.zeros(3, 6, H, P, N)
    assert kernel.adopt_state(stack).num_layers == 3
    assert kernel.adopt_state(stack[0]).num_layers == 1
    state = kernel.adopt_state([stack[0], stack[2]])
    assert state.num_layers == 2 and state.cache[1].data_ptr() == stack[2].data_ptr()


@pytest.mark.parametrize(
    "cache, message",
    [
        (lambda: torch.zeros(6, H, P, N + 1), r"cache: expected shape \(6, 4, 8, 16\)"),
        (lambda: torch.zeros(6, H, P, N, dtype=torch.bfloat16), r"cache: expected dtype fp32, got bf16"),
        (lambda: torch.zeros(6, H, P, N, device="meta"), r"cache: expected a tensor on cpu"),
        (
            lambda: torch.zeros(6, H, N, P).transpose(2, 3),
            r"cache: each slot's \(heads, headdim, dstate\) block must be "
            r"contiguous",
        ),
        (
            lambda: torch.zeros(1, H, P, N).expand(6, -1, -1, -1),
            r"cache: a slot stride of 0 values is less than one "
            r"slot's 512: slots would overlap",
        ),
        (lambda: [torch.zeros(6, H, P, N), "not a tensor"], r"cache\[1\]: expected a torch.Tensor"),
        (lambda: [], r"cache: expected the engine's state tensor"),
    ],
)
def test_a_bad_cache_is_refused(cache, message):
    kernel = ssu.open(ssu.Config(), small_problem(num_slots=6))
    with pytest.raises(ssu.InputError, match=message):
        kernel.adopt_state(cache())


def test_a_backend_that_cannot_adopt_is_refused_at_open():
    from fakes import good_backend
    from ssu.plugins.registry import Registry

    namespace: dict = {}
    exec(good_backend("owner"), namespace)  # noqa: S102 - a test backend's source
    registry = Registry(entry_points=[], env={})
    registry.register(type("Plugin", (), {k: staticmethod(v) for k, v in namespace.items() if k.startswith("ssu_")})())
    with pytest.raises(
        ssu.BackendUnavailableError,
        match=r"stepping an engine's own cache in place "
        r"\(Problem.engine_state\) not supported",
    ):
        ssu.open(ssu.Config(backend="owner"), small_problem(engine_state=True), registry=registry)
    kernel = ssu.open(ssu.Config(backend="owner"), small_problem(), registry=registry)
    with pytest.raises(ssu.BackendError, match="cannot step an engine's cache in place"):
        kernel.adopt_state(torch.zeros(10, H, P, N))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(dst_slots=torch.tensor([5, 6, 7], dtype=torch.int32)), r"dst_slots: expected shape \(2\)"),
        (dict(dst_slots=torch.tensor([5, 6], dtype=torch.int64)), r"dst_slots: expected dtype int32"),
        (
            dict(dt=torch.randn(2, H, P).bfloat16()),
            r"dt: varies along its last 1 dimension\(s\) \(strides \(1,\), not 0\)",
        ),
        (dict(A=torch.randn(H, P, N)), r"A: varies along its last 2 dimension"),
    ],
)
def test_bad_step_arguments_are_refused_before_anything_is_written(change, message, gen):
    from ssu.checking.harness import logical_states, prepared
    from ssu.checking.inputs import step_inputs

    p = small_problem(input_dtype="bf16")
    kernel = ssu.open(ssu.Config(), p)
    state, before = prepared(kernel, gen)
    good = step_inputs(p, torch.tensor([1, 2], dtype=torch.int32), gen).kwargs()
    with pytest.raises(ssu.InputError, match=message):
        kernel.step(state, **dict(good, **change))
    assert torch.equal(logical_states(kernel, state, 0), before[0])


def test_destination_slots_are_refused_where_they_mean_nothing(gen):
    from ssu.checking.inputs import step_inputs

    p = small_problem(speculative=True, tokens_per_step=2)
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state()
    slots = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ssu.InputError, match="dst_slots: destination slots apply to one-token steps"):
        kernel.step(state, dst_slots=slots + 2, **step_inputs(p, slots, gen).kwargs())


# the drop-in call --------------------------------------------------------------------------------
def mamba2_call(b, gen, *, tied: bool, dtype=torch.float32):
    """The arguments a transformers Mamba2 mixer passes at decode (tied), or their per-head form."""
    x = torch.randn(b, H, P, generator=gen).to(dtype)
    dt = torch.randn(b, 1, H, generator=gen).to(dtype).transpose(1, 2)  # (b, H, 1)
    A = -torch.rand(H, generator=gen) - 1
    D, dt_bias = torch.randn(H, generator=gen), torch.rand(H, generator=gen) - 2
    B, C = (torch.randn(b, G, N, generator=gen).to(dtype) for _ in range(2))
    if tied:
        return dict(
            x=x,
            dt=dt.expand(-1, -1, P),
            A=A[:, None, None].expand(-1, P, N),
            B=B,
            C=C,
            D=D[:, None].expand(-1, P),
            dt_bias=dt_bias[:, None].expand(-1, P),
        )
    return dict(x=x, dt=dt[..., 0], A=A, B=B, C=C, D=D, dt_bias=dt_bias)


def expected(state, call, slots, z=None):
    """The oracle for one drop-in call: per row, (new state, output)."""
    per_head = dict(
        dt=call["dt"][..., 0] if call["dt"].dim() == 3 else call["dt"],
        A=call["A"][:, 0, 0] if call["A"].dim() == 3 else call["A"],
        D=call["D"][:, 0] if call["D"].dim() == 2 else call["D"],
        dt_bias=call["dt_bias"][:, 0] if call["dt_bias"].dim() == 2 else call["dt_bias"],
    )
    start = torch.stack(
        [state[s].float() if s >= 0 else torch.zeros_like(state[0], dtype=torch.float32) for s in slots]
    )
    states, outs = oracle.ssu_math64(
        start,
        call["x"][:, None],
        per_head["dt"][:, None],
        per_head["A"],
        call["B"][:, None],
        call["C"][:, None],
        D=per_head["D"],
        dt_bias=per_head["dt_bias"],
        dt_softplus=True,
        z=None if z is None else z[:, None],
    )
    return states[:, 0], outs[:, 0]


@pytest.mark.parametrize("tied", [True, False])
def test_dropin_steps_the_callers_cache_in_place(tied, gen):
    cache, _ = engine_cache(small_problem(num_slots=5), 1, gen)  # a view with a 2x slot stride
    cache = cache[0]
    pointer, before = cache.data_ptr(), cache.clone()
    call = mamba2_call(3, gen, tied=tied)
    out = ssu.selective_state_update(cache, **call, dt_softplus=True)
    states, outs = expected(before, call, [0, 1, 2])
    assert oracle.rel_error(out, outs) < 1e-5 and out.shape == call["x"].shape
    assert cache.data_ptr() == pointer and oracle.rel_error(cache[:3], states) < 1e-5
    assert torch.equal(cache[3:], before[3:])
    again = mamba2_call(3, gen, tied=tied)  # the second call finds its kernel and adopted state
    ssu.selective_state_update(cache, **again, dt_softplus=True)
    assert len(ssu.dropin.cache._kernels) == 1 and ssu.dropin.kernel_for(cache).problem.engine_state


@pytest.mark.parametrize("pad", [-1, 0, 99])
def test_dropin_indices_destinations_and_pad_ids(pad, gen):
    cache = torch.randn(8, H, P, N, generator=gen)
    before = cache.clone()
    call = mamba2_call(4, gen, tied=True)
    first = 1 if pad == 0 else 0  # slot 0 is the null block when the pad id is 0
    read = torch.tensor([first + 2, pad, first + 4, first + 5], dtype=torch.int32)
    write = torch.tensor([first + 6, first + 3, pad, first + 5], dtype=torch.int32)
    out = torch.empty_like(call["x"])
    got = ssu.selective_state_update(
        cache,
        **call,
        dt_softplus=True,
        state_batch_indices=read,
        dst_state_batch_indices=write,
        pad_slot_id=pad,
        out=out,
    )
    assert got is out
    states, outs = expected(before, call, [int(s) if s != pad else -1 for s in read])
    assert oracle.rel_error(out, outs) < 1e-5
    assert oracle.rel_error(cache[first + 6], states[0]) < 1e-5 and oracle.rel_error(cache[first + 5], states[3]) < 1e-5
    untouched = [s for s in range(8) if s not in (first + 6, first + 5)]
    assert torch.equal(cache[untouched], before[untouched])  # a pad row writes nothing; a pad destination neither


def test_dropin_follows_the_batch_and_the_config(gen, tmp_path, monkeypatch):
    cache = torch.randn(16, H, P, N, generator=gen)
    ssu.selective_state_update(cache, **mamba2_call(2, gen, tied=True), dt_softplus=True)
    assert ssu.dropin.kernel_for(cache).problem.max_batch == 2
    ssu.selective_state_update(cache, **mamba2_call(5, gen, tied=True), dt_softplus=True)
    assert ssu.dropin.kernel_for(cache).problem.max_batch == 8  # a larger batch: a kernel sized for it
    config = ssu.Config(validate="full")
    ssu.selective_state_update(cache, **mamba2_call(2, gen, tied=True), dt_softplus=True, config=config)
    assert ssu.dropin.kernel_for(cache, config).config.validate == "full"


def test_dropin_refuses_what_it_cannot_serve(gen):
    cache = torch.randn(4, H, P, N, generator=gen)
    before = cache.clone()
    with pytest.raises(ssu.InputError, match=r"pad_slot_id=0 is the slot of row 0 \(without state_batch_indices"):
        ssu.selective_state_update(cache, **mamba2_call(2, gen, tied=True), pad_slot_id=0)
    untied = dict(mamba2_call(2, gen, tied=True), D=torch.randn(H, P))
    with pytest.raises(ssu.InputError, match=r"D: varies along its last 1 dimension"):
        ssu.selective_state_update(cache, **untied)
    assert torch.equal(cache, before)
    with pytest.raises(ssu.InputError, match=r"x: expected a tensor \(batch, H, P\) .* Mamba-1"):
        ssu.selective_state_update(
            torch.randn(4, H, P, N), **dict(mamba2_call(2, gen, tied=True), x=torch.randn(2, H * P))
        )
    with pytest.raises(ssu.InputError, match=r"^state: fp64 is not a state cache dtype; use one of fp32, bf16, fp16"):
        ssu.selective_state_update(cache.double(), **mamba2_call(2, gen, tied=True))
    fresh = torch.randn(4, H, P, N, generator=gen)  # no kernel yet: the problem itself is refused
    with pytest.raises(ssu.InputError, match=r"^x: fp64 is not an input dtype"):
        ssu.selective_state_update(fresh, **dict(mamba2_call(2, gen, tied=True), x=torch.randn(2, H, P).double()))
    assert torch.equal(cache, before)


def test_a_mamba1_layers_call_is_not_served_and_opens_nothing(gen):
    """Mamba-1 shapes (vLLM's MambaMixer) and Mamba-1 parameters on Mamba2 shapes (SGLang's mamba1.py:
    one channel a head, A (dim, 1, N)) raise NotServedError before a kernel is opened or anything
    written: an engine plugin passes them on."""
    dim, slots = 12, torch.tensor([2, 0], dtype=torch.int32)
    state = torch.randn(4, dim, N, generator=gen)
    calls = {
        "vLLM": (state, torch.randn(2, dim), torch.randn(2, dim), -torch.rand(dim, N) - 1, torch.randn(2, N),
                 torch.randn(2, N)),
        "SGLang": (state[:, :, None].clone(), torch.randn(2, dim, 1), torch.randn(2, dim, 1),
                   (-torch.rand(dim, N) - 1)[:, None], torch.randn(2, 1, N), torch.randn(2, 1, N)),
    }  # fmt: skip
    for engine, (cache, x, dt, A, B, C) in calls.items():
        before = cache.clone()
        with pytest.raises(ssu.NotServedError, match="Mamba-1"):
            ssu.selective_state_update(cache, x, dt, A, B, C, dt_softplus=True, state_batch_indices=slots)
        assert torch.equal(cache, before) and not ssu.dropin.cache._kernels, engine
    assert issubclass(ssu.NotServedError, ssu.InputError)


def test_a_problem_no_backend_serves_is_refused_once(gen, monkeypatch):
    """The refusal is remembered per problem: the next cache tensor of that problem is refused
    without resolving again."""
    from ssu.runtime import kernel as kernel_module

    opened = []
    real = kernel_module.open_kernel

    def counting(config, problem, **kwargs):
        opened.append(problem)
        return real(config, problem, **kwargs)

    monkeypatch.setattr(kernel_module, "open_kernel", counting)
    config = ssu.Config(backend="gpu-only")
    name = ssu.register_backend(gpu_only_backend())
    try:
        for _ in range(2):
            cache = torch.randn(4, H, P, N, generator=gen)
            with pytest.raises(ssu.BackendUnavailableError, match="gpu-only"):
                ssu.selective_state_update(cache, **mamba2_call(2, gen, tied=True), config=config)
    finally:
        ssu.default_registry().unregister(name)
    assert len(opened) == 1


def test_dropin_forgets_a_cache_the_engine_dropped(gen):
    cache = torch.randn(4, H, P, N, generator=gen)
    ssu.selective_state_update(cache, **mamba2_call(2, gen, tied=True))
    assert len(ssu.dropin.cache._adopted) == 1
    del cache
    gc.collect()
    assert len(ssu.dropin.cache._adopted) == 0


def test_needs_sync_says_whether_the_engine_tensor_is_current():
    """The reference keeps the engine's tensor current after every step: nothing to sync."""
    p = ssu.Problem(nheads=2, headdim=4, dstate=8, ngroups=1, num_slots=4, max_batch=2, engine_state=True)
    assert not ssu.open(ssu.Config(backend="reference"), p).needs_sync
