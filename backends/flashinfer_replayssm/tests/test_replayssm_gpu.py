"""ReplaySSM on a real GPU (marker ``gpu``): long decodes against the reference, prefill hand-off,
CUDA graphs, warmup and the tuning cache. Every test uses H=128 P=64 N=128 G=8 with the default
max_window 15 so that the four FlashInfer modules (fp32/bf16 state x T=1/T=4; about 260 s of JIT
each) are shared with the benchmark; prebuild them with benchmarks/flashinfer_prebuild.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ssu
from ssu import conformance
from ssu.checking import oracle
from ssu.checking.harness import compare_with_reference
from ssu.checking.inputs import layer_weights, pick_slots, random_states, step_inputs

pytestmark = pytest.mark.gpu
NAME = "flashinfer-replayssm"
SHAPE = dict(nheads=128, headdim=64, dstate=128, ngroups=8, input_dtype="bf16", device="cuda")


def problem(state_dtype="fp32", tokens=1, **fields):
    return ssu.Problem(
        state_dtype=state_dtype,
        tokens_per_step=tokens,
        speculative=tokens > 1,
        **dict(dict(num_slots=40, max_batch=16), **SHAPE, **fields),
    )


def kernel(p, **options):
    return ssu.open(ssu.Config(backend=NAME, backends={NAME: dict(dict(autotune=False), **options)}), p)


@pytest.mark.parametrize(
    "state_dtype, tokens, algorithm",
    [
        ("fp32", 4, "monolith"),
        ("fp32", 4, "two-kernel"),
        ("bf16", 4, "auto"),
        ("fp32", 1, "auto"),
        ("bf16", 1, "two-kernel"),
    ],
)
def test_long_decode_matches_the_reference_at_every_step(state_dtype, tokens, algorithm, gen):
    """120 steps with random acceptance (many flushes per slot): outputs and read_state against
    the reference after every step; slots outside the batch bit-identical in every buffer."""
    compare_with_reference(
        NAME,
        problem(state_dtype, tokens),
        gen,
        steps=120,
        batch=16,
        pad=2,
        layers=2,
        backend_options=dict(algorithm=algorithm, autotune=False),
    )


def test_explicit_commit_without_speculation(gen):
    p = problem("bf16", 1)
    k, ref = kernel(p, commit_on_last_layer=False), ssu.open(ssu.Config(backend="reference"), p)
    state, rstate = k.allocate_state(2), ref.allocate_state(2)
    slots = pick_slots(p, 12, gen, pad_rows=1)
    real = slots[:11].long()
    weights = [layer_weights(p, gen) for _ in range(2)]
    ones = torch.ones(12, dtype=torch.int32, device="cuda")
    out_tol, state_tol = oracle.output_tolerance("bf16"), oracle.state_tolerance("bf16")
    for _ in range(40):
        for layer in range(2):
            ref.write_state(rstate, real, k.read_state(state, real, layer), layer)
            inputs = step_inputs(p, slots, gen, weights=weights[layer]).kwargs()
            got, want = k.step(state, layer=layer, **inputs), ref.step(rstate, layer=layer, **inputs)
            assert oracle.rel_error(got, want) <= out_tol
        k.commit(state, slots, ones)
        for layer in range(2):
            assert oracle.rel_error(k.read_state(state, real, layer), ref.read_state(rstate, real, layer)) <= state_tol


def test_prefill_hand_off_with_write_state(gen):
    """Mid-decode, new sequences arrive with prefilled states (write_state); their decode and the
    others' continue to match the reference."""
    p = problem("fp32", 4)
    k, ref = kernel(p), ssu.open(ssu.Config(backend="reference"), p)
    state, rstate = k.allocate_state(2), ref.allocate_state(2)
    slots = pick_slots(p, 16, gen)
    weights = [layer_weights(p, gen) for _ in range(2)]
    out_tol, state_tol = oracle.tolerances(p, 4, k.capabilities.state_precision)
    for step in range(30):
        if step in (7, 19):
            fresh = slots[step % 5 : step % 5 + 4].long()
            for layer in range(2):
                values = random_states(p, 4, gen)
                k.write_state(state, fresh, values, layer)
                ref.write_state(rstate, fresh, values, layer)
                assert torch.equal(k.read_state(state, fresh, layer), values)
        for layer in range(2):
            ref.write_state(rstate, slots.long(), k.read_state(state, slots.long(), layer), layer)
            inputs = step_inputs(p, slots, gen, weights=weights[layer]).kwargs()
            assert (
                oracle.rel_error(k.step(state, layer=layer, **inputs), ref.step(rstate, layer=layer, **inputs))
                <= out_tol
            )
        accepted = torch.randint(1, 5, (16,), generator=gen, dtype=torch.int32).cuda()
        k.commit(state, slots, accepted)
        ref.commit(rstate, slots, accepted)
        for layer in range(2):
            assert (
                oracle.rel_error(k.read_state(state, slots.long(), layer), ref.read_state(rstate, slots.long(), layer))
                <= state_tol
            )


@pytest.mark.parametrize("state_dtype, tokens", [("fp32", 4), ("fp32", 1)])
@pytest.mark.parametrize(
    "check",
    [
        "step",
        "decode",
        "roundtrip",
        "bad-inputs",
        "cuda-graph",
        "guarded-ids",
        "partial-commit",
        "warmup",
    ],
)
def test_conformance_checks(state_dtype, tokens, check, gen):
    """The shared checks (CUDA-graph capture of step + commit included) at the real shape."""
    try:
        # 40 steps: past the ring's window, so that checkpoint writes run
        conformance.run_on(kernel(problem(state_dtype, tokens)), check, gen, steps=40)
    except conformance.CheckSkipped as exc:  # e.g. partial commits without speculation
        pytest.skip(str(exc))


def test_warmup_leaves_everything_bit_identical_and_the_cache_is_reused(tmp_path, gen):
    """Warmup (JIT build, FlashInfer autotuning at max_batch) changes no byte of the state; its
    tuning is saved, and a second process loads it instead of tuning again."""
    cache = tmp_path / "tuning.json"
    p = problem("fp32", 1, max_batch=8)
    k = kernel(p, autotune=True, tuning_cache=str(cache))
    state = k.allocate_state(2)
    every = torch.arange(p.num_slots, device="cuda")
    for layer in range(2):
        k.write_state(state, every, random_states(p, p.num_slots, gen), layer)
    slots = pick_slots(p, 8, gen)
    for layer in range(2):  # some tokens in the rings
        k.step(state, layer=layer, **step_inputs(p, slots, gen).kwargs())
    before = {name: buf.clone() for name, buf in state.buffers.items()}
    k.warmup(state)
    for name, buf in state.buffers.items():
        assert torch.equal(buf, before[name]), f"warmup changed buffer {name!r}"
    assert k._ctx.memo.get("tuned") is True and cache.is_file()
    script = (
        f"import ssu\np = ssu.Problem(**{dict(SHAPE, num_slots=40, max_batch=8)!r})\n"
        f"k = ssu.open(ssu.Config(backend={NAME!r}, backends={{{NAME!r}: {{'tuning_cache': {str(cache)!r}}}}}), p)\n"
        "k.warmup(k.allocate_state())\nprint('TUNED', k._ctx.memo.get('tuned'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TUNED False" in done.stdout and "loaded from" in done.stderr, done.stderr[-3000:]
