"""The triton-replay backend on a real GPU: model shapes over decodes that flush, a long decode
against the triton backend, CUDA graphs of step + commit, 8-bit checkpoints, warmup, the tuning
cache across processes, stochastic rounding. Skipped without CUDA (``-m gpu`` selects these)."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

import ssu
from ssu.checking import oracle
from ssu.conformance import run_on
from ssu.checking.harness import compare_with_reference, seeded_states, stochastic_rounding_bias
from ssu.checking.inputs import layer_weights, step_inputs

from triton_helpers import SHAPES, cuda_problem, run_twice

pytestmark = pytest.mark.gpu

NAME = "triton-replay"


def opened(p, **options):
    return ssu.open(ssu.Config(backend=NAME, backends={NAME: options}), p)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(("tokens", "fold"), [(1, 0), (1, 4), (4, 0), (4, 4)])
def test_model_shapes_match_reference(shape, state_dtype, tokens, fold, gen):
    """Decodes of 12 steps with a window of 5: every slot flushes twice, the ring wraps; with the
    fold kernel beside the step kernel and without."""
    p = cuda_problem(shape, state_dtype=state_dtype, tokens_per_step=tokens, speculative=tokens > 1)
    options = {"max_window": 5, "fold_heads": fold}
    compare_with_reference(NAME, p, gen, steps=12, pad=3, layers=2, backend_options=options, index_dtype=torch.int64)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_stepwise_speculative_steps_at_model_shapes(shape, state_dtype, gen):
    """Speculative steps of window 0 whose outputs come from applying each token to the tile in
    turn (no gram kernel), over two layers and commits of random acceptance."""
    p = cuda_problem(shape, state_dtype=state_dtype, tokens_per_step=4, speculative=True)
    options = {"max_window": 5, "window": 0, "fold_heads": 0, "stepwise": 1}
    compare_with_reference(NAME, p, gen, steps=12, pad=3, layers=2, backend_options=options)


def test_stepwise_steps_in_a_cuda_graph(gen):
    p = cuda_problem(tokens_per_step=4, speculative=True)
    run_on(opened(p, window=0, fold_heads=0, stepwise=1), "cuda-graph", gen)


@pytest.mark.parametrize(
    ("window", "fold", "through"),
    [(0, 0, "triton"), (0, 0, "replay"), (0, 16, "replay"), (7, 0, "triton"), (7, 16, "triton"), (15, 0, "triton"),
     (15, 16, "triton")],
)  # fmt: skip
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_flush_windows_at_model_shapes(window, fold, through, state_dtype, gen):
    """Every window pinned, with the fold kernel and without; window 0 through the triton kernel
    (``write_through_kernel``) and through this backend's own."""
    p = cuda_problem(state_dtype=state_dtype, max_batch=48)
    options = {"window": window, "fold_heads": fold, "write_through_kernel": through}
    compare_with_reference(NAME, p, gen, steps=18, pad=2, backend_options=options)


@pytest.mark.parametrize("fold", [0, 1])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_long_decode_matches_the_triton_backend(state_dtype, fold, gen):
    """200 one-token steps of the same inputs through both backends: the logical states agree
    within the state dtype's budget (each backend rounds its cache in its own rhythm)."""
    p = cuda_problem(state_dtype=state_dtype, num_slots=40, max_batch=32)
    config = {NAME: {"fold_heads": fold}}
    kernels = [ssu.open(ssu.Config(backend=name, backends=config), p) for name in ("triton", NAME)]
    states = seeded_states(kernels, p, gen)
    slots = torch.randperm(p.num_slots, generator=gen)[:32].int().cuda()
    weights = layer_weights(p, gen)
    for _ in range(200):
        inputs = step_inputs(p, slots, gen, weights=weights).kwargs()
        outs = [k.step(s, **inputs) for k, s in zip(kernels, states)]
        assert oracle.rel_error(outs[1], outs[0]) < 0.05
    got, want = (k.read_state(s, slots) for k, s in zip(kernels, states))
    _, budget = oracle.tolerances(p, 1, None)
    assert oracle.rel_error(got, want) < 4 * budget, oracle.rel_error(got, want)


@pytest.mark.parametrize(("tokens", "fold", "window"), [(1, 0, 3), (1, 4, 3), (4, 0, 3), (4, 2, 3), (1, 0, 0)])
def test_cuda_graph_capture_and_replay(tokens, fold, window, gen):
    """Step (every layer) and commit captured once, replayed; identical to eager, bit for bit
    (window 0: through the triton kernel)."""
    p = cuda_problem(tokens_per_step=tokens, speculative=tokens > 1, max_batch=48)
    run_on(opened(p, fold_heads=fold, window=window), "cuda-graph", gen)


@pytest.mark.parametrize("check", ["step", "decode", "guarded-ids", "destinations", "adopted", "bad-inputs"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_conformance_checks_at_model_shapes(check, tokens, gen):
    p = cuda_problem(
        tokens_per_step=tokens, speculative=tokens > 1, engine_state=check == "adopted", pad_slot_id=0, num_slots=160
    )
    try:
        run_on(opened(p), check, gen)
    except ssu.conformance.CheckSkipped:
        pass


@pytest.mark.parametrize("state_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("tokens", "fold"), [(1, 0), (1, 4), (4, 0)])
@pytest.mark.parametrize("check", ["step", "decode", "adopted"])
def test_8_bit_checkpoints_at_the_model_shape(check, tokens, fold, state_dtype, gen):
    """The kit's checks, value by value against each row's scale, for an 8-bit checkpoint at the
    Nemotron-H-8B shape, with a window that flushes within the decode, with the fold kernel and
    without (compiled: int8 values converted without conversion instructions, e4m3 by the packed
    cast)."""
    p = cuda_problem(
        state_dtype=state_dtype, tokens_per_step=tokens, speculative=tokens > 1, engine_state=check == "adopted"
    )
    try:
        run_on(opened(p, max_window=5, fold_heads=fold), check, gen)
    except ssu.conformance.CheckSkipped:
        pass


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_warmup_leaves_state_intact_within_a_minute(state_dtype, gen, tmp_path):
    """The first warmup (compile and tune, every bucket to 256; for a table that ends up writing
    through everywhere, the triton backend's schedules too) takes under 60 s and changes no buffer
    of the live state."""
    p = cuda_problem(state_dtype=state_dtype, max_batch=256, num_slots=300)
    kernel = opened(p, tuning_cache=str(tmp_path / "t.json"))
    (state,) = seeded_states((kernel,), p, gen, layers=2)
    before = {k: v.clone() for k, v in state.buffers.items()}
    t0 = time.perf_counter()
    kernel.warmup(state)
    took = time.perf_counter() - t0
    route = kernel._ctx.memo["launcher"].route[0]
    print(f"first warmup of triton-replay to batch 256, {state_dtype} state: {took:.1f} s (triton kernel: {route})")
    assert all(torch.equal(before[k], state.buffers[k]) for k in before)
    assert (tmp_path / "t.json").is_file()
    assert took < 60


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("max_batch, num_slots", [(9, 21), (3, 5), (17, 40)])
def test_warmup_with_a_max_batch_below_its_top_bucket(state_dtype, max_batch, num_slots, gen, tmp_path):
    """A max_batch that is no power of two (the top bucket holds more rows than the table has):
    warmup tunes it, then a step at max_batch matches the reference."""
    p = cuda_problem(state_dtype=state_dtype, max_batch=max_batch, num_slots=num_slots)
    kernel = opened(p, tuning_cache=str(tmp_path / "t.json"))
    state = kernel.allocate_state()
    kernel.warmup(state)
    assert all(plan is not None for plan in kernel._ctx.memo["launcher"].table[1:])
    compare_with_reference(NAME, p, gen, steps=3, backend_options={"tuning_cache": str(tmp_path / "t.json")})


SECOND_PROCESS = textwrap.dedent("""
    import torch, ssu
    p = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8, num_slots=80, max_batch=64, device="cuda")
    k = ssu.open(ssu.Config(backend="triton-replay"), p)
    k.warmup(k.allocate_state())
    print("TABLE", k._ctx.memo["launcher"].table[64])
""")


def test_tuned_plans_reused_by_a_second_process(tmp_path):
    first, second = run_twice(SECOND_PROCESS, tmp_path / "tuning.json")
    assert "candidates" in first.stderr
    assert "candidates" not in second.stderr and "from " in second.stderr
    assert first.stdout.split("TABLE")[1] == second.stdout.split("TABLE")[1]


def test_stochastic_rounding_is_unbiased(gen):
    bias, bias_nearest, spread = stochastic_rounding_bias(
        NAME,
        gen,
        backend_options={"window": 0, "write_through_kernel": "replay"},
        nheads=8,
        headdim=16,
        dstate=32,
        ngroups=1,
        input_dtype="fp32",
        device="cuda",
    )
    assert spread > 0
    assert bias < 0.5 * bias_nearest, (bias, bias_nearest)
