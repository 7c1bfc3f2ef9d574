"""The flashinfer backend's engine call forms (docs/spec.md, "Engine call forms") on the CPU: the
real hooks, guard launches (Triton's interpreter) and FlashInfer calls, with FlashInfer's kernel
replaced by :mod:`fi_emulation` (its SM90 semantics: packed tokens with tables and counts, an
intermediate buffer in the cache's dtype whose final state FlashInfer leaves out of the cache).
Against the float64 oracle, the rest bit for bit; ids outside the cache never reach the kernel
(the emulation raises on one)."""

from __future__ import annotations

import pytest
import torch

import ssu
from ssu.checking import engine_harness
from ssu.state import faults
from ssu.checking.harness import engine_cache, prepared

from ssu_backend_flashinfer import plugin


def problem(form, **fields):
    base = dict(
        nheads=4, headdim=32, dstate=32, ngroups=2, state_dtype="fp32", input_dtype="bf16", num_slots=40,
        max_batch=5, tokens_per_step=4, engine_calls={form},
    )  # fmt: skip
    base.update(fields)
    return ssu.Problem(**base)


def opened(p, registry, validate=True):
    return ssu.open(ssu.Config(backend="flashinfer-emulated", validate=validate), p, registry=registry)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_packed_calls(emulated, state_dtype, gen):
    """vLLM's call on an adopted strided cache (null block 0): mixed lengths, counts, a padded
    sequence, pad cells, int64 tables; then one token a sequence on an allocated state."""
    p = problem("packed", state_dtype=state_dtype, pad_slot_id=0, engine_state=True)
    kernel = opened(p, emulated, validate="full")
    cache, _ = engine_cache(p, 2, gen)
    state = kernel.adopt_state(cache)
    call = engine_harness.draw_packed(
        p, gen, sequences=5, lengths=[4, 0, 2, 3, 1], padded=1, pad_cells=2, index_dtype=torch.int64, with_z=False
    )
    engine_harness.check_packed(kernel, state, call, layer=1, layers=2)
    other = opened(problem("packed", state_dtype=state_dtype), emulated)
    state, _ = prepared(other, gen, 1)
    call = engine_harness.draw_packed(p, gen, sequences=3, packed=False, own_destinations=True)
    engine_harness.check_packed(other, state, call)


def test_verify_calls(emulated, gen):
    """SGLang's call: the buffer in shuffled rows with the cache untouched, then the last state
    written into the cache from the buffer (which FlashInfer's SM90 kernel leaves out), then a
    call without a buffer."""
    p = problem("verify", num_slots=12)
    kernel = opened(p, emulated, validate="full")
    state, _ = prepared(kernel, gen, 2)
    for knobs in (dict(update_state=False), dict(update_state=True, buffer_rows=False), dict(buffer_dtype=None)):
        call = engine_harness.draw_verify(
            p, gen, rows=4, padded=1, with_z=True, **dict(dict(buffer_dtype="fp32"), **knobs)
        )
        engine_harness.check_verify(kernel, state, call, layer=1, layers=2)


def test_ids_outside_the_cache_never_reach_flashinfer(emulated, gen):
    """A destination and a start slot outside the cache, a count past the table, offsets past the
    tokens: recorded and kept from FlashInfer (whose emulation would raise on any)."""
    p = problem("packed", num_slots=24, tokens_per_step=3)
    kernel = opened(p, emulated)
    state, _ = prepared(kernel, gen, 1)
    call = engine_harness.draw_packed(p, gen, sequences=3, lengths=[3, 1, 2], accepted=[1, 2, 3])
    for change, arg in (
        (dict(dst_slots=torch.where(call.slots == call.slots[0, 1], 77, call.slots)), faults.E_DST_SLOTS),
        (dict(slots=torch.where(call.slots == call.slots[2, 2], -9, call.slots)), faults.E_SLOTS),
        (dict(num_accepted=torch.tensor([1, 9, 1], dtype=torch.int32)), faults.E_NUM_ACCEPTED),
        (dict(cu_seqlens=torch.tensor([0, 3, 4, 9], dtype=torch.int32)), faults.E_CU_SEQLENS),
    ):
        kernel.packed_step(state, **dict(call.kwargs(), **change))
        row, kind, _ = faults.decode(int(kernel._ctx.faults))
        assert kind == faults.ENGINE and row >> 26 == arg
        with pytest.raises(ssu.InputError, match=faults.ENGINE_NAMES[arg]):
            kernel.check()
    v = opened(problem("verify", num_slots=12), emulated)
    state, _ = prepared(v, gen, 1)
    call = engine_harness.draw_verify(v.problem, gen, rows=3)
    v.verify_step(state, **dict(call.kwargs(), buffer_rows=torch.tensor([0, 5, 1], dtype=torch.int32)))
    with pytest.raises(ssu.InputError, match="intermediate_state_indices"):
        v.check()


def test_what_flashinfer_cannot_do_is_refused(emulated, gen):
    p = problem("verify", num_slots=12)
    kernel = opened(p, emulated)
    state, _ = prepared(kernel, gen, 1)
    call = engine_harness.draw_verify(p, gen, rows=2, buffer_dtype="bf16")
    with pytest.raises(ssu.InputError, match="cache's dtype"):
        kernel.verify_step(state, **call.kwargs())
    assert plugin.engine_call_problems(problem("packed", nheads=6, ngroups=2)) == [
        "the engine call forms with 3 heads per group: FlashInfer's multi-token kernel takes a power of two up to 64"
    ]
    assert "speculative" in plugin.engine_call_problems(problem("packed", speculative=True))[0]
    caps = plugin.ssu_backend().capabilities
    assert caps.engine_calls == {"packed", "verify"} and "tree" not in caps.engine_calls
