"""The engines' call forms (docs/spec.md, "Engine call forms") on the reference backend: vLLM's
packed call and SGLang's verify call against the float64 oracle on random calls (hypothesis:
shapes past powers of two, mixed lengths and counts, pad ids in any cell, trees, index dtypes,
strided caches, every state dtype, several layers and calls), their shape and value checks, the
device-side guard of what validation does not see, and the capability they need."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.checking import engine_harness, oracle
from ssu.state import faults
from ssu.checking.harness import engine_cache, engine_scales, prepared

from fakes import good_backend, small_problem

STATE_DTYPES = ("fp32", "bf16", "fp16", "int8", "fp8_e4m3")


def opened(problem, validate=True, backend="reference", registry=None):
    return ssu.open(ssu.Config(backend=backend, validate=validate), problem, registry=registry)


@st.composite
def problems(draw, form: str):
    """Small problems of the engine call forms: head shapes past powers of two, every dtype, any pad id."""
    G = draw(st.sampled_from([1, 2, 3]))
    H = G * draw(st.integers(1, 3))
    W = draw(st.integers(1, 4))
    slots = draw(st.integers(2 * 5 * W + 2, 2 * 5 * W + 6))
    pad = draw(st.sampled_from([-1, 0, slots, slots + 7]))
    return ssu.Problem(
        nheads=H,
        headdim=draw(st.integers(1, 9)),
        dstate=draw(st.sampled_from([1, 3, 8, 16, 17])),
        ngroups=G,
        state_dtype=draw(st.sampled_from(STATE_DTYPES)),
        input_dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
        num_slots=slots,
        max_batch=5,
        tokens_per_step=W,
        pad_slot_id=pad,
        engine_state=draw(st.booleans()),
        engine_calls={form},
    )


def state_of(kernel, gen, layers: int, stride: int):
    """An adopted engine cache (slots ``stride`` blocks apart) or an allocated state, every real
    slot of every layer random."""
    p = kernel.problem
    if p.engine_state:
        cache, _ = engine_cache(p, layers, gen, slot_stride=stride)
        scales, _ = engine_scales(p, layers, gen, slot_stride=stride)
        return kernel.adopt_state(cache, scales=scales or None)
    return prepared(kernel, gen, layers)[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems("packed"), st.data())
def test_packed_calls_match_the_oracle(problem, data):
    """vLLM's packed call, two calls in a row on random layers: outputs and written slots against
    the float64 oracle, every other slot and layer bit for bit."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    layers = data.draw(st.integers(1, 2))
    kernel = opened(problem, validate=data.draw(st.sampled_from([True, "full"])))
    state = state_of(kernel, gen, layers, data.draw(st.integers(1, 3)))
    for _ in range(2):
        n = data.draw(st.integers(1, 5))
        call = engine_harness.draw_packed(
            problem,
            gen,
            sequences=n,
            width=data.draw(st.integers(1, problem.tokens_per_step)),
            packed=data.draw(st.booleans()),
            padded=data.draw(st.integers(0, n)),
            pad_cells=data.draw(st.integers(0, 3)),
            own_destinations=data.draw(st.booleans()),
            index_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])),
            expanded=data.draw(st.booleans()),
            with_z=data.draw(st.booleans()),
        )
        engine_harness.check_packed(kernel, state, call, data.draw(st.integers(0, layers - 1)), layers)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems("tree"), st.data())
def test_verify_calls_match_the_oracle(problem, data):
    """SGLang's verify call, with and without a buffer, its rows and a tree of parents, writing
    the cache or not: outputs, buffer and slots against the float64 oracle, the rest bit for bit."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    layers = data.draw(st.integers(1, 2))
    kernel = opened(problem, validate=data.draw(st.sampled_from([True, "full"])))
    state = state_of(kernel, gen, layers, data.draw(st.integers(1, 3)))
    for _ in range(2):
        rows = data.draw(st.integers(1, 5))
        buffer = data.draw(st.sampled_from(["fp32", "bf16", "fp16", None]))
        call = engine_harness.draw_verify(
            problem,
            gen,
            rows=rows,
            tokens=data.draw(st.integers(1, problem.tokens_per_step)),
            padded=data.draw(st.integers(0, rows)),
            update_state=data.draw(st.booleans()),
            buffer_dtype=buffer,
            buffer_rows=data.draw(st.booleans()),
            parents=buffer is not None and data.draw(st.booleans()),
            index_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])),
            expanded=data.draw(st.booleans()),
            with_z=data.draw(st.booleans()),
        )
        engine_harness.check_verify(kernel, state, call, data.draw(st.integers(0, layers - 1)), layers)


def test_oracle_packed_agrees_with_the_step_it_generalises(gen):
    """The packed oracle with one token per sequence and its own slots is ssu's one-token step."""
    p = small_problem(tokens_per_step=1, engine_calls={"packed"})
    cache = torch.randn(p.num_slots, 4, 8, 16, generator=gen).double()
    call = engine_harness.draw_packed(p, gen, sequences=3, packed=False, expanded=False)
    new, out = oracle.packed_math64(
        cache, call.x, call.dt, call.A, call.B, call.C, call.slots, pad_slot_id=-1, D=call.D, z=call.z,
        dt_bias=call.dt_bias, dt_softplus=True,
    )  # fmt: skip
    slots = call.slots[:, 0].long()
    states, y = oracle.ssu_math64(
        cache[slots], call.x[:, None], call.dt[:, None], call.A, call.B[:, None], call.C[:, None], D=call.D,
        z=call.z[:, None], dt_bias=call.dt_bias, dt_softplus=True,
    )  # fmt: skip
    assert torch.equal(out, y[:, 0]) and torch.equal(new[slots], states[:, 0])


def test_oracle_verify_follows_parents_not_the_previous_token(gen):
    """A token whose parent is token 0 continues from the state after token 0: its output equals
    that of a chain of two tokens (0, t), not of 0..t."""
    p = small_problem(tokens_per_step=3, engine_calls={"tree"})
    cache = torch.randn(p.num_slots, 4, 8, 16, generator=gen).double()
    call = engine_harness.draw_verify(p, gen, rows=1, parents=True, expanded=False, buffer_rows=False)
    call.parents[0] = torch.tensor([-1, 0, 0])
    _, _, out = oracle.verify_math64(
        cache, call.x, call.dt, call.A, call.B, call.C, call.slots, pad_slot_id=-1, buffer=call.buffer,
        parents=call.parents, D=call.D, dt_bias=call.dt_bias, dt_softplus=True,
    )  # fmt: skip
    keep = [0, 2]
    slot = int(call.slots[0])
    _, chain = oracle.ssu_math64(
        cache[slot : slot + 1], call.x[:, keep], call.dt[:, keep], call.A, call.B[:, keep], call.C[:, keep],
        D=call.D, dt_bias=call.dt_bias, dt_softplus=True,
    )  # fmt: skip
    assert torch.allclose(out[0, 2], chain[0, 1], rtol=0, atol=1e-12)


# ---- the drop-in, with the engines' argument names ----------------------------------------------------------


def test_dropin_takes_vllms_speculative_call(gen):
    """vLLM's call as its mixer makes it: a strided cache, one table as source and destination,
    null block 0, counts, packed tokens, expanded per-head parameters, a given out."""
    p = small_problem(num_slots=24, tokens_per_step=4, pad_slot_id=0, engine_calls={"packed"}, engine_state=True)
    pages = torch.randn(24, 2, 4, 8, 16, generator=gen)
    cache = pages[:, 0]
    call = engine_harness.draw_packed(p, gen, sequences=4, padded=1, pad_cells=2, index_dtype=torch.int64)
    before = cache.clone().double()
    heads = engine_harness._per_head(call)
    want_cache, want_out = oracle.packed_math64(
        before, call.x, heads["dt"], heads["A"], call.B, call.C, call.slots, pad_slot_id=0,
        num_accepted=call.num_accepted, cu_seqlens=call.cu_seqlens, D=heads["D"], z=call.z,
        dt_bias=heads["dt_bias"], dt_softplus=True,
    )  # fmt: skip
    out = torch.empty_like(call.x)
    config = ssu.Config(backend="reference", validate="full")
    y = ssu.selective_state_update(
        cache, call.x, call.dt, call.A, call.B, call.C, call.D, call.z, call.dt_bias, True,
        state_batch_indices=call.slots, dst_state_batch_indices=call.slots, null_block_id=0, out=out,
        num_accepted_tokens=call.num_accepted, cu_seqlens=call.cu_seqlens, config=config,
    )  # fmt: skip
    assert y is out
    owned = ~torch.isnan(want_out[:, 0, 0])
    assert oracle.rel_error(out[owned], want_out[owned]) < oracle.output_tolerance("bf16", 4)
    assert oracle.rel_error(cache[1:], want_cache[1:]) < oracle.state_tolerance("fp32", 4)
    assert torch.equal(pages[:, 1], pages[:, 1].clone())  # the engine's other page data: never touched
    kernel = ssu.dropin.kernel_for(cache, config) or ssu.dropin.cache._adopted[(id(cache), id(config), "packed")].kernel
    assert kernel.problem.engine_calls == {"packed"} and kernel.problem.tokens_per_step == 4
    ssu.dropin.clear()


def test_dropin_takes_vllms_plain_decode_call_as_a_step(gen):
    """Without speculation vLLM passes (b, 1) tables and no counts: the one-token step on their
    column, by the step's kernel (no engine call form opened)."""
    cache = torch.randn(12, 4, 8, 16, generator=gen)
    want = cache.clone()
    table = torch.tensor([[3], [0], [7]], dtype=torch.int32)
    x, dt, B, C = torch.randn(3, 4, 8), torch.randn(3, 4), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    A = -torch.rand(4) - 1
    config = ssu.Config(backend="reference")
    out = ssu.selective_state_update(
        cache, x, dt, A, B, C, state_batch_indices=table, dst_state_batch_indices=table, null_block_id=0, config=config
    )
    ref = ssu.selective_state_update(
        want, x, dt, A, B, C, state_batch_indices=table[:, 0].contiguous(), pad_slot_id=0, config=config
    )
    assert torch.equal(out, ref) and torch.equal(cache, want)
    assert ssu.dropin.kernel_for(cache, config).problem.engine_calls == frozenset()
    ssu.dropin.clear()


def test_dropin_takes_sglangs_verify_call(gen):
    """SGLang's verify call: disable_state_update, a flat intermediate buffer with cache_steps, a
    tree of parents, buffer rows; the cache is untouched, the buffer holds every token's state."""
    p = small_problem(num_slots=12, tokens_per_step=4, engine_calls={"tree"}, engine_state=True)
    cache = torch.randn(12, 4, 8, 16, generator=gen)
    before = cache.clone()
    call = engine_harness.draw_verify(p, gen, rows=3, padded=1, parents=True, expanded=True)
    flat = torch.zeros(3 * 5 * 4 * 8 * 16)
    heads = engine_harness._per_head(call)
    _, want_buffer, want_out = oracle.verify_math64(
        before.double(), call.x, heads["dt"], heads["A"], call.B, call.C, call.slots, pad_slot_id=-1,
        update_state=False, buffer=flat.view(3, 5, 4, 8, 16), buffer_rows=call.buffer_rows, parents=call.parents,
        D=heads["D"], dt_bias=heads["dt_bias"], dt_softplus=True,
    )  # fmt: skip
    out = ssu.selective_state_update(
        cache, call.x, call.dt, call.A, call.B, call.C, call.D, None, call.dt_bias, True,
        state_batch_indices=call.slots, disable_state_update=True, intermediate_states_buffer=flat, cache_steps=5,
        retrieve_parent_token=call.parents, intermediate_state_indices=call.buffer_rows,
        config=ssu.Config(backend="reference", validate="full"),
    )  # fmt: skip
    assert torch.equal(cache, before)
    rows = call.buffer_rows[:2].long()
    assert oracle.rel_error(out[:2], want_out[:2]) < oracle.output_tolerance("bf16", 4)
    assert oracle.rel_error(flat.view(3, 5, 4, 8, 16)[rows, :4], want_buffer[rows, :4]) < 1e-6
    ssu.dropin.clear()


def test_dropin_sglang_call_writes_the_last_state_without_disable(gen):
    """Without disable_state_update the state after the last token goes to the row's slot."""
    cache = torch.randn(6, 4, 8, 16, generator=gen)
    before = cache.clone()
    x = torch.randn(2, 3, 4, 8)
    dt, B, C = torch.randn(2, 3, 4), torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    A = -torch.rand(4) - 1
    slots = torch.tensor([4, 1])
    out = ssu.selective_state_update(
        cache, x, dt, A, B, C, dt_softplus=True, state_batch_indices=slots, config=ssu.Config(backend="reference")
    )
    states, y = oracle.ssu_math64(before[slots], x, dt, A, B, C, dt_softplus=True)
    assert oracle.rel_error(out, y) < 1e-6 and oracle.rel_error(cache[slots], states[:, -1]) < 1e-6
    assert torch.equal(cache[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    ssu.dropin.clear()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_accepted_tokens=torch.ones(2, dtype=torch.int32), disable_state_update=True), "one call"),
        (dict(null_block_id=0, pad_slot_id=5), "two pad ids"),
        (dict(cache_steps=4), "without intermediate_states_buffer"),
        (dict(num_accepted_tokens=torch.ones(2, dtype=torch.int32), state_batch_indices=None), "needs"),
        (
            dict(num_accepted_tokens=torch.ones(2, dtype=torch.int32), state_batch_indices=torch.tensor([1, 2])),
            "(N, W)",
        ),
    ],
)
def test_dropin_refuses_mixed_or_incomplete_engine_calls(kwargs, message):
    cache = torch.randn(6, 4, 8, 16)
    before = cache.clone()
    args = (
        cache,
        torch.randn(2, 4, 8),
        torch.randn(2, 4),
        -torch.rand(4),
        torch.randn(2, 2, 16),
        torch.randn(2, 2, 16),
    )
    with pytest.raises(ssu.InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ssu.selective_state_update(*args, config=ssu.Config(backend="reference"), **kwargs)
    assert torch.equal(cache, before)
    ssu.dropin.clear()


# ---- what the checks refuse, before anything is written -------------------------------------------------------


def packed_setup(gen, **problem):
    p = small_problem(num_slots=24, max_batch=4, tokens_per_step=3, engine_calls={"packed"}, **problem)
    kernel = opened(p)
    state, _ = prepared(kernel, gen, 1)
    call = engine_harness.draw_packed(p, gen, sequences=3, lengths=[3, 1, 2], accepted=[1, 2, 3])
    return kernel, state, call


def unchanged(kernel, state, call_fn):
    from ssu.checking.harness import logical_states

    before = logical_states(kernel, state, 0).clone()
    call_fn()
    assert torch.equal(logical_states(kernel, state, 0), before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: dict(cu_seqlens=torch.tensor([0, 1, 2, 3, 6], dtype=torch.int32)), "3 rows for 4 sequences"),
        (lambda c: dict(slots=c.slots[:, :1]), "some sequence is longer"),
        (lambda c: dict(slots=c.slots[:, 0]), r"\(N, W\) table"),
        (lambda c: dict(num_accepted=c.num_accepted[:2]), "num_accepted"),
        (lambda c: dict(dst_slots=c.slots[:, :2]), "dst_slots"),
        (lambda c: dict(dst_slots=c.slots.long()), "one dtype"),
        (lambda c: dict(x=c.x[:, None]), r"\(tokens, H, P\)"),
        (lambda c: dict(B=c.B[:-1]), "B"),
        (lambda c: dict(cu_seqlens=c.cu_seqlens.float()), "cu_seqlens"),
        (lambda c: dict(slots=torch.cat([c.slots, c.slots], 1)), "6 columns"),
    ],
)
def test_packed_shapes_that_do_not_fit_are_refused_before_anything_is_written(gen, change, message):
    kernel, state, call = packed_setup(gen)
    kwargs = dict(call.kwargs(), **change(call))
    with pytest.raises(ssu.InputError, match=message):
        unchanged(kernel, state, lambda: kernel.packed_step(state, **kwargs))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: dict(cu_seqlens=torch.tensor([0, 3, 2, 6], dtype=torch.int32)), "ascending"),
        (lambda c: dict(cu_seqlens=torch.tensor([0, 4, 5, 6], dtype=torch.int32)), "at most 3"),
        (lambda c: dict(num_accepted=torch.tensor([1, 4, 1], dtype=torch.int32)), "expected 0 to 3"),
        (lambda c: dict(slots=torch.where(c.slots == c.slots[0, 0], 99, c.slots)), "not a slot"),
        (lambda c: dict(dst_slots=c.slots.flip(0)), "starts from"),
        (lambda c: dict(dst_slots=torch.full_like(c.slots, 5)), "written by both"),
    ],
)
def test_packed_values_are_refused_with_full_validation(gen, change, message):
    p = small_problem(num_slots=24, max_batch=4, tokens_per_step=3, engine_calls={"packed"})
    kernel = opened(p, validate="full")
    state, _ = prepared(kernel, gen, 1)
    call = engine_harness.draw_packed(p, gen, sequences=3, lengths=[3, 1, 2], accepted=[1, 2, 3])
    kwargs = dict(call.kwargs(), **change(call))
    with pytest.raises(ssu.InputError, match=message):
        unchanged(kernel, state, lambda: kernel.packed_step(state, **kwargs))


def verify_setup(gen, calls=("tree",), **draw):
    p = small_problem(num_slots=12, max_batch=4, tokens_per_step=3, engine_calls=set(calls))
    kernel = opened(p)
    state, _ = prepared(kernel, gen, 1)
    call = engine_harness.draw_verify(p, gen, rows=3, **draw)
    return kernel, state, call


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: dict(buffer=c.buffer[:, :2]), "2 steps a row for 3 tokens"),
        (lambda c: dict(parents=c.parents[:, :2]), "parents"),
        (lambda c: dict(parents=c.parents, buffer=None, buffer_rows=None), "pass intermediate_states_buffer"),
        (lambda c: dict(buffer_rows=c.buffer_rows, buffer=None), "without a buffer"),
        (lambda c: dict(buffer=c.buffer.transpose(3, 4).contiguous().transpose(3, 4)), "contiguous"),
        (lambda c: dict(buffer=c.buffer.to(torch.int8)), "buffer"),
        (lambda c: dict(x=c.x[:, 0]), r"\(batch, tokens, H, P\)"),
        (lambda c: dict(update_state=1), "update_state"),
    ],
)
def test_verify_shapes_that_do_not_fit_are_refused_before_anything_is_written(gen, change, message):
    kernel, state, call = verify_setup(gen, parents=True, update_state=True)
    kwargs = dict(call.kwargs(), **change(call))
    buffer = call.buffer.clone()
    with pytest.raises(ssu.InputError, match=message):
        unchanged(kernel, state, lambda: kernel.verify_step(state, **kwargs))
    assert torch.equal(call.buffer, buffer)


def test_parents_need_a_tree_kernel(gen):
    kernel, state, call = verify_setup(gen, calls=("verify",), parents=True)
    with pytest.raises(ssu.InputError, match="engine_calls=\\{'tree'\\}"):
        kernel.verify_step(state, **call.kwargs())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: dict(parents=torch.tensor([[-1, 1, 0]] * 3)), "parents\\[0, 1\\]"),
        (lambda c: dict(buffer_rows=torch.zeros(3, dtype=torch.int32)), "same buffer row"),
        (lambda c: dict(buffer_rows=torch.tensor([0, 1, 7], dtype=torch.int32)), "not a row"),
        (lambda c: dict(slots=torch.tensor([1, 1, 2], dtype=torch.int32)), "more than once"),
    ],
)
def test_verify_values_are_refused_with_full_validation(gen, change, message):
    p = small_problem(num_slots=12, max_batch=4, tokens_per_step=3, engine_calls={"tree"})
    kernel = opened(p, validate="full")
    state, _ = prepared(kernel, gen, 1)
    call = engine_harness.draw_verify(p, gen, rows=3, parents=True, update_state=True)
    kwargs = dict(call.kwargs(), **change(call))
    with pytest.raises(ssu.InputError, match=message):
        unchanged(kernel, state, lambda: kernel.verify_step(state, **kwargs))


def test_a_kernel_opened_without_a_form_says_how_to_open_one(gen):
    kernel = opened(small_problem())
    with pytest.raises(ssu.InputError, match="engine_calls=\\{'packed'\\}"):
        kernel.packed_step(None, None, None, None, None, None, None)
    with pytest.raises(ssu.InputError, match="'verify'"):
        kernel.verify_step(None, None, None, None, None, None, None)


# ---- the device-side guard: what validation does not look at is served as the spec says and recorded -----------


@pytest.mark.parametrize(
    ("change", "arg", "where"),
    [
        (lambda c: dict(cu_seqlens=torch.tensor([0, 3, 2, 6], dtype=torch.int32)), faults.E_CU_SEQLENS, (1, 0)),
        (lambda c: dict(num_accepted=torch.tensor([1, 7, 1], dtype=torch.int32)), faults.E_NUM_ACCEPTED, (1, 0)),
        (lambda c: dict(slots=torch.where(c.slots == c.slots[2, 2], 99, c.slots)), faults.E_SLOTS, (2, 2)),
        (lambda c: dict(dst_slots=torch.where(c.slots == c.slots[0, 1], -5, c.slots)), faults.E_DST_SLOTS, (0, 1)),
    ],
)
def test_packed_faults_are_recorded_and_named(gen, change, arg, where):
    """A refused value leaves every slot the spec says it leaves, and check() names the argument
    (with vLLM's name for it), the sequence and the token."""
    kernel, state, call = packed_setup(gen)
    kwargs = dict(call.kwargs(), **change(call))
    kernel.packed_step(state, **kwargs)
    key = int(kernel._ctx.faults)
    row, kind, value = faults.decode(key)
    assert kind == faults.ENGINE and row == faults.engine_row(arg, *where)
    with pytest.raises(ssu.InputError, match=faults.ENGINE_NAMES[arg]):
        kernel.check()
    kernel.check()  # cleared


def test_verify_faults_are_recorded_and_named(gen):
    kernel, state, call = verify_setup(gen, parents=True)
    parents = call.parents.clone()
    parents[1, 2] = 2
    kernel.verify_step(state, **dict(call.kwargs(), parents=parents))
    with pytest.raises(ssu.InputError, match=r"parents\[1, 2\] \(retrieve_parent_token\) = 2"):
        kernel.check()
    kernel.verify_step(state, **dict(call.kwargs(), slots=torch.tensor([1, 40, 2], dtype=torch.int32)))
    with pytest.raises(ssu.InputError, match=r"slots\[1\] \(state_batch_indices\) = 40"):
        kernel.check()


# ---- the capability -------------------------------------------------------------------------------------------


def test_a_backend_without_the_form_is_refused_naming_those_that_serve_it(fake_site):
    fake_site.add("ssu-backend-plain", {"plain": "plain_backend"}, modules={"plain_backend": good_backend("plain")})
    registry = fake_site.registry()
    p = small_problem(tokens_per_step=4, engine_calls={"packed"})
    with pytest.raises(ssu.BackendUnavailableError, match="engine call 'packed'.*serve this problem here: reference"):
        ssu.open(ssu.Config(backend="plain"), p, registry=registry)


def test_capabilities_of_engine_calls_need_guards_and_verify():
    with pytest.raises(ValueError, match="guards_slots"):
        ssu.Capabilities(engine_calls={"packed"})
    with pytest.raises(ValueError, match="needs 'verify'"):
        ssu.Capabilities(engine_calls={"tree"}, guards_slots=True)
    with pytest.raises(ValueError, match="unknown"):
        ssu.Capabilities(engine_calls={"eagle"}, guards_slots=True)
    with pytest.raises(ssu.ConfigError, match="unknown call form"):
        small_problem(engine_calls={"eagle"})
    assert small_problem(tokens_per_step=2, engine_calls={"tree"}).engine_calls == {"tree", "verify"}
    with pytest.raises(ssu.ConfigError, match="engine_calls"):
        small_problem(tokens_per_step=2)
