"""The triton backend's engine call forms (docs/spec.md, "Engine call forms"): vLLM's packed call
and SGLang's verify call against the float64 oracle, in Triton's interpreter on small shapes (a
random walk of calls with the marker ``slow``), and on a GPU at model shapes, in CUDA graphs
(marker ``gpu``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.checking import engine_harness
from ssu.state import faults
from ssu.checking.harness import engine_cache, engine_scales, prepared

from triton_helpers import DEVICE, SHAPES, cuda_problem

ON_GPU = torch.cuda.is_available()


def problem(form, **fields):
    base = dict(
        nheads=4, headdim=6, dstate=12, ngroups=2, num_slots=40, max_batch=5, tokens_per_step=4, device=DEVICE,
        engine_calls={form},
    )  # fmt: skip
    base.update(fields)
    return ssu.Problem(**base)


def adopted(kernel, gen, layers=2, stride=2):
    p = kernel.problem
    cache, _ = engine_cache(p, layers, gen, slot_stride=stride)
    scales, _ = engine_scales(p, layers, gen, slot_stride=stride)
    return kernel.adopt_state(cache, scales=scales or None)


def opened(p, validate=True, **options):
    config = ssu.Config(backend="triton", validate=validate, backends={"triton": options} if options else {})
    return ssu.open(config, p)


@pytest.mark.parametrize("state_dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow), "int8"])
def test_packed_calls_match_the_oracle(state_dtype, gen):
    """vLLM's call on an adopted strided cache: mixed lengths (0 to W), counts, a padded sequence,
    pad cells, int64 tables; then one token a sequence without offsets on the other layer."""
    p = problem("packed", state_dtype=state_dtype, pad_slot_id=0, engine_state=True)
    kernel = opened(p, validate="full")
    state = adopted(kernel, gen)
    call = engine_harness.draw_packed(
        p, gen, sequences=5, lengths=[4, 0, 2, 3, 1], padded=1, pad_cells=2, index_dtype=torch.int64
    )
    engine_harness.check_packed(kernel, state, call, layer=1, layers=2)
    call = engine_harness.draw_packed(p, gen, sequences=3, packed=False, own_destinations=True, with_z=False)
    engine_harness.check_packed(kernel, state, call, layer=0, layers=2)


@pytest.mark.parametrize("state_dtype", ["fp32", pytest.param("fp8_e4m3", marks=pytest.mark.slow)])
def test_verify_calls_match_the_oracle(state_dtype, gen):
    """SGLang's call: a tree of parents read back from a bf16 buffer in shuffled rows, the cache left
    alone; then a chain writing the last state, its buffer rows the slots."""
    p = problem("tree", state_dtype=state_dtype, num_slots=12)
    kernel = opened(p, validate="full")
    state, _ = prepared(kernel, gen, 2)
    call = engine_harness.draw_verify(p, gen, rows=4, padded=1, buffer_dtype="bf16", parents=True, with_z=True)
    engine_harness.check_verify(kernel, state, call, layer=0, layers=2)
    call = engine_harness.draw_verify(p, gen, rows=3, tokens=3, update_state=True, buffer_rows=False)
    engine_harness.check_verify(kernel, state, call, layer=1, layers=2)


def test_engine_call_faults_are_recorded(gen):
    """Ids, counts and offsets validation does not look at are guarded in the kernel: served as
    the spec says, recorded, named by check()."""
    p = problem("packed", num_slots=24, tokens_per_step=3)
    kernel = opened(p)
    state, before = prepared(kernel, gen, 1)
    call = engine_harness.draw_packed(p, gen, sequences=3, lengths=[3, 1, 2], accepted=[1, 2, 3])
    bad = call.slots.clone()
    bad[1, 0] = 77  # the start cell of sequence 1 (count 2: column 1) is fine; its token 0 cell is not
    kernel.packed_step(state, **dict(call.kwargs(), dst_slots=bad))
    row, kind, value = faults.decode(int(kernel._ctx.faults))
    assert (row, kind, value) == (faults.engine_row(faults.E_DST_SLOTS, 1, 0), faults.ENGINE, 77)
    with pytest.raises(ssu.InputError, match=r"dst_slots\[1, 0\] \(dst_state_batch_indices\) = 77"):
        kernel.check()
    kernel.packed_step(state, **dict(call.kwargs(), cu_seqlens=torch.tensor([0, 3, 2, 6], dtype=torch.int32)))
    with pytest.raises(ssu.InputError, match=r"cu_seqlens\[1\]"):
        kernel.check()


@st.composite
def walks(draw):
    G = draw(st.sampled_from([1, 2]))
    return dict(
        nheads=G * draw(st.integers(1, 3)),
        headdim=draw(st.integers(1, 9)),
        dstate=draw(st.sampled_from([3, 8, 17])),
        ngroups=G,
        state_dtype=draw(st.sampled_from(["fp32", "bf16", "fp16", "int8", "fp8_e4m3"])),
        input_dtype=draw(st.sampled_from(["bf16", "fp32"])),
        pad_slot_id=draw(st.sampled_from([-1, 0, 45])),
        tokens_per_step=draw(st.integers(1, 3)),
    )


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(walks(), st.data())
def test_random_engine_calls_match_the_oracle(fields, data):
    """A random walk: a packed and a verify call on one kernel's adopted or allocated state."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    p = ssu.Problem(
        **fields, num_slots=40, max_batch=5, device=DEVICE, engine_state=data.draw(st.booleans()),
        engine_calls={"packed", "tree"},
    )  # fmt: skip
    kernel = opened(p)
    state = adopted(kernel, gen, 2, data.draw(st.integers(1, 2))) if p.engine_state else prepared(kernel, gen, 2)[0]
    n = data.draw(st.integers(1, 5))
    call = engine_harness.draw_packed(
        p, gen, sequences=n, padded=data.draw(st.integers(0, n)), pad_cells=data.draw(st.integers(0, 2)),
        own_destinations=data.draw(st.booleans()), index_dtype=data.draw(st.sampled_from([torch.int32, torch.int64])),
        expanded=data.draw(st.booleans()),
    )  # fmt: skip
    engine_harness.check_packed(kernel, state, call, data.draw(st.integers(0, 1)), 2)
    rows = data.draw(st.integers(1, 4))
    buffer = data.draw(st.sampled_from(["fp32", "bf16", None]))
    parents = buffer is not None and data.draw(st.booleans())
    call = engine_harness.draw_verify(
        p, gen, rows=rows, padded=data.draw(st.integers(0, rows)), update_state=data.draw(st.booleans()),
        buffer_dtype=buffer, buffer_rows=data.draw(st.booleans()), parents=parents,
    )  # fmt: skip
    engine_harness.check_verify(kernel, state, call, data.draw(st.integers(0, 1)), 2)


# ---- on a GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "fp16", "int8", "fp8_e4m3"])
def test_model_shapes_engine_calls(shape, state_dtype, gen):
    """Both call forms at every model shape and state dtype, on an adopted strided cache: vLLM's
    with 4 tokens (mixed lengths, pad cells, padded sequences), SGLang's with a tree."""
    p = cuda_problem(
        shape, state_dtype=state_dtype, tokens_per_step=4, num_slots=160, max_batch=16, pad_slot_id=0,
        engine_state=True, engine_calls={"packed", "tree"},
    )  # fmt: skip
    kernel = opened(p)
    state = adopted(kernel, gen)
    call = engine_harness.draw_packed(p, gen, sequences=16, padded=2, pad_cells=4, index_dtype=torch.int64)
    engine_harness.check_packed(kernel, state, call, layer=1, layers=2)
    call = engine_harness.draw_verify(p, gen, rows=12, padded=1, buffer_dtype=p.state_dtype if not p.quantized else
                                      "bf16", parents=True)  # fmt: skip
    engine_harness.check_verify(kernel, state, call, layer=0, layers=2)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["packed", "tree"])
def test_engine_calls_in_a_cuda_graph(form, gen):
    """A captured call replays with new inputs, counts, offsets and parents in the captured tensors."""
    p = cuda_problem(tokens_per_step=4, num_slots=160, max_batch=16, engine_state=True, engine_calls={form})
    kernel = opened(p)
    state = adopted(kernel, gen)
    draw = (
        (lambda: engine_harness.draw_packed(p, gen, sequences=16, lengths=[4] * 16))
        if form == "packed"
        else (lambda: engine_harness.draw_verify(p, gen, rows=16, parents=True))
    )
    call = draw()
    run = kernel.packed_step if form == "packed" else kernel.verify_step
    check = engine_harness.check_packed if form == "packed" else engine_harness.check_verify
    check(kernel, state, call, 0, 2)  # compiles, and checks eagerly once
    static = call
    out = torch.empty_like(static.x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(state, **dict(static.kwargs(), out=out), layer=0)
    for _ in range(2):
        fresh = draw()
        for name, value in fresh.kwargs().items():
            target = getattr(static, name)
            # new inputs into the captured tensors; an expanded one (per-head weights) keeps its values
            if isinstance(value, torch.Tensor) and value.shape == target.shape and 0 not in target.stride():
                target.copy_(value)
        replay = _Replay(graph, out)
        check(replay.kernel(kernel, form), state, static, 0, 2)


class _Replay:
    """A kernel stand-in whose call form replays a captured graph (the check's call becomes a replay)."""

    def __init__(self, graph, out) -> None:
        self.graph, self.out = graph, out

    def kernel(self, kernel, form):
        replay = self

        class Replayed:
            problem = kernel.problem
            capabilities = kernel.capabilities

            def __getattr__(self, name):
                return getattr(kernel, name)

            def packed_step(self, *args, **kwargs):
                replay.graph.replay()
                return replay.out

            verify_step = packed_step

        return Replayed()


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2, 4, 8, 32, 512])
def test_the_engine_calls_launch_shape(state_dtype, batch):
    """The large-batch tile (16 rows of P, two warps at N = 128) for a 2-byte state at every batch
    and for a 4-byte one from the batch that gives it MIN_PROGRAMS programs; below that, a 4-byte
    state takes tiles of 4 rows and one warp. Up to PREFETCH_TOKENS tokens a sequence every shape
    prefetches, above it none does; every shape asks for programmatic launch."""
    from ssu_backend_triton.engine_launch import MIN_PROGRAMS, PREFETCH_TOKENS, Shape, default_shape

    fields = dict(nheads=128, headdim=64, dstate=128, ngroups=8, state_dtype=state_dtype, input_dtype="bf16",
                  num_slots=8, max_batch=4, engine_calls={"packed"})  # fmt: skip
    p = ssu.Problem(tokens_per_step=PREFETCH_TOKENS, **fields)
    shape = default_shape(p, batch)
    if state_dtype == "bf16" or 4 * 128 * batch >= MIN_PROGRAMS:
        assert shape == Shape(16, 2, prefetch=1, pdl=1) == default_shape(p)
    else:
        assert shape == Shape(4, 1, prefetch=1, pdl=1)
    longer = ssu.Problem(tokens_per_step=PREFETCH_TOKENS + 1, **fields)
    assert default_shape(longer, batch)._replace(prefetch=1) == shape
    assert default_shape(longer, batch).prefetch == 0


@pytest.mark.parametrize("form", ["packed", "tree"])
def test_longer_sequences_stream_their_tokens(form, gen):
    """Sequences of more than PREFETCH_TOKENS tokens take the streaming path (each token's inputs
    loaded in its turn, a parent's state read back from the buffer): the same results."""
    from ssu_backend_triton.engine_launch import PREFETCH_TOKENS

    T = PREFETCH_TOKENS + 2
    if form == "packed":
        p = problem("packed", tokens_per_step=T, pad_slot_id=0, engine_state=True)
        kernel = opened(p, validate="full")
        state = adopted(kernel, gen)
        call = engine_harness.draw_packed(p, gen, sequences=4, lengths=[T, 0, 2, T - 1], padded=1, pad_cells=2)
        engine_harness.check_packed(kernel, state, call, layer=1, layers=2)
    else:
        p = problem("tree", tokens_per_step=T, num_slots=12)
        kernel = opened(p, validate="full")
        state, _ = prepared(kernel, gen, 2)
        call = engine_harness.draw_verify(p, gen, rows=3, padded=1, buffer_dtype="bf16", parents=True, with_z=True)
        engine_harness.check_verify(kernel, state, call, layer=0, layers=2)
