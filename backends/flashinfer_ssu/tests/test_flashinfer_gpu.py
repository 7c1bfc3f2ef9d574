"""The flashinfer backend on a real GPU against the reference: model shapes, hypothesis-drawn
batches and options, pad rows, speculative decoding with commits, CUDA graphs, stochastic
rounding, warmup and FlashInfer's JIT cache across processes. Skipped without CUDA.

Every distinct (state dtype, input dtype, headdim, dstate, tokens, index dtype) is a FlashInfer
module compiled on first use (about 26 s), so the shapes here are few and fixed; hypothesis draws
what varies within a module."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.conformance import run_on
from ssu.checking.harness import compare_with_reference, stochastic_rounding_bias

pytestmark = pytest.mark.gpu

MODULES = {  # name: (H, P, N, G, state dtype, tokens)
    "8b-fp32": (128, 64, 128, 8, "fp32", 1),
    "8b-bf16": (128, 64, 128, 8, "bf16", 1),
    "8b-fp32-T4": (128, 64, 128, 8, "fp32", 4),
    "9b-v2-p80": (128, 80, 128, 8, "fp32", 1),
    "56b-n256": (256, 64, 256, 8, "bf16", 1),
}


def cuda_problem(name, **fields):
    H, P, N, G, state, T = MODULES[name]
    base = dict(
        nheads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        state_dtype=state,
        input_dtype="bf16",
        num_slots=80,
        max_batch=48,
        tokens_per_step=T,
        speculative=T > 1,
        device="cuda",
    )
    base.update(fields)
    return ssu.Problem(**base)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_model_shapes_match_reference(name, gen):
    compare_with_reference("flashinfer", cuda_problem(name), gen, steps=3, pad=3, layers=2)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.integers(1, 48),
    pad=st.integers(0, 3),
    options=st.booleans(),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["8b-fp32", "8b-fp32-T4"]),
)
def test_hypothesis_batches_and_options(batch, pad, options, seed, name):
    gen = torch.Generator().manual_seed(seed)
    compare_with_reference(
        "flashinfer", cuda_problem(name), gen, steps=2, batch=batch, pad=min(pad, batch - 1), options=options
    )


@pytest.mark.parametrize("algorithm", ["simple", "vertical", "horizontal"])
def test_algorithms_one_token(algorithm, gen):
    compare_with_reference(
        "flashinfer", cuda_problem("8b-fp32"), gen, steps=2, pad=1, backend_options={"algorithm": algorithm}
    )


def test_sm100_algorithms_refused_at_open_on_hopper():
    if torch.cuda.get_device_capability()[0] >= 10:
        pytest.skip("this GPU runs them")
    with pytest.raises(ssu.BackendUnavailableError, match=r"needs SM100 \(Blackwell\); this GPU is SM90"):
        ssu.open(
            ssu.Config(backend="flashinfer", backends={"flashinfer": {"algorithm": "vertical"}}),
            cuda_problem("8b-fp32-T4"),
        )


@pytest.mark.parametrize("name", ["8b-fp32", "8b-fp32-T4"])
def test_cuda_graph_capture_and_replay(name, gen):
    """Step (every layer) and commit captured once, replayed; identical to eager, bit for bit."""
    run_on(ssu.open(ssu.Config(backend="flashinfer"), cuda_problem(name)), "cuda-graph", gen)


def test_stochastic_rounding_is_unbiased(gen):
    bias, bias_nearest, spread = stochastic_rounding_bias(
        "flashinfer", gen, nheads=8, headdim=64, dstate=128, ngroups=1, input_dtype="bf16", device="cuda"
    )
    assert spread > 0
    assert bias < 0.5 * bias_nearest, (bias, bias_nearest)


WARM = textwrap.dedent("""
    import ssu
    p = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8, state_dtype="fp32", input_dtype="bf16",
                    num_slots=8, max_batch=8, device="cuda")
    k = ssu.open(ssu.Config(backend="flashinfer"), p)
    state = k.allocate_state()
    k.warmup(state)
""")


def test_warmup_reports_the_jit_cache_in_a_second_process():
    first = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, timeout=600, env=os.environ)
    assert first.returncode == 0, first.stderr
    assert "module state=fp32 input=bf16" in first.stderr
    second = subprocess.run([sys.executable, "-c", WARM], capture_output=True, text=True, timeout=600, env=os.environ)
    assert second.returncode == 0, second.stderr
    assert "found in FlashInfer's JIT cache" in second.stderr


@pytest.mark.parametrize("name", ["8b-fp32", "8b-fp32-T4"])
def test_adopted_caches_and_destinations_at_model_shapes(name, gen):
    """An engine's cache (a view into pages twice a slot's size) stepped in place, speculative
    drafts through FlashInfer's intermediate-state buffer committed into it; one-token steps with
    destination slots (the null block 0 as pad id and sink, and a pad id outside the cache on an
    allocated state, whose sink row takes a pad destination's write)."""
    tokens = MODULES[name][5]
    compare_with_reference(
        "flashinfer",
        cuda_problem(name, engine_state=True, pad_slot_id=0, num_slots=160),
        gen,
        steps=3,
        pad=3,
        layers=2,
        adopt=True,
        destinations=tokens == 1,
    )  # slots no row reads
    if tokens == 1:
        compare_with_reference(
            "flashinfer", cuda_problem(name, pad_slot_id=-1, num_slots=160), gen, steps=2, pad=3, destinations=True
        )


@pytest.mark.parametrize("name", ["8b-fp32", "8b-fp32-T4"])
def test_ids_outside_the_cache(name, gen):
    run_on(ssu.open(ssu.Config(backend="flashinfer"), cuda_problem(name)), "guarded-ids", gen)


#: the head dims and dstates declared beyond the model shapes above, each a module of its own
AUDIT = [(32, 128), (96, 128), (128, 128), (64, 32), (64, 96)]


@pytest.mark.parametrize("headdim, dstate", AUDIT)
def test_declared_head_dims_and_dstates_build_and_match(headdim, dstate, gen):
    from ssu_backend_flashinfer.plugin import DSTATES, HEADDIMS

    assert headdim in HEADDIMS and dstate in DSTATES
    p = ssu.Problem(
        nheads=16,
        headdim=headdim,
        dstate=dstate,
        ngroups=2,
        state_dtype="fp32",
        input_dtype="bf16",
        num_slots=24,
        max_batch=8,
        device="cuda",
    )
    compare_with_reference("flashinfer", p, gen, steps=2, pad=1)


def test_an_undeclared_dstate_is_refused_at_open_with_the_alternatives():
    p = ssu.Problem(nheads=16, headdim=64, dstate=16, ngroups=2, num_slots=8, max_batch=4, device="cuda")
    with pytest.raises(
        ssu.BackendUnavailableError,
        match=r"dstate=16 not supported .*backends that serve this "
        r"problem here: .*triton",
    ):
        ssu.open(ssu.Config(backend="flashinfer"), p)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_engine_call_forms_at_the_model_shape(state_dtype, gen):
    """vLLM's packed call (4 tokens, mixed lengths, pad cells, a padded request, null block 0) and
    SGLang's verify call (buffer in the cache's dtype, the last state written from it) on an
    adopted strided cache, against the float64 oracle; then each in a CUDA graph."""
    from ssu.checking import engine_harness
    from ssu.checking.harness import engine_cache

    p = cuda_problem(
        "8b-fp32", state_dtype=state_dtype, tokens_per_step=4, speculative=False, num_slots=160, max_batch=16,
        pad_slot_id=0, engine_state=True, engine_calls={"packed", "verify"},
    )  # fmt: skip
    kernel = ssu.open(ssu.Config(backend="flashinfer"), p)
    cache, _ = engine_cache(p, 2, gen)
    state = kernel.adopt_state(cache)
    kernel.warmup(state)
    call = engine_harness.draw_packed(p, gen, sequences=16, padded=2, pad_cells=4, with_z=False)
    engine_harness.check_packed(kernel, state, call, layer=1, layers=2)
    call = engine_harness.draw_verify(p, gen, rows=12, padded=1, update_state=True, buffer_dtype=state_dtype)
    engine_harness.check_verify(kernel, state, call, layer=0, layers=2)
    for draw, run in (
        (lambda: engine_harness.draw_packed(p, gen, sequences=16, lengths=[4] * 16, with_z=False), kernel.packed_step),
        (lambda: engine_harness.draw_verify(p, gen, rows=16, buffer_dtype=state_dtype), kernel.verify_step),
    ):
        eager = draw()
        out = torch.empty_like(eager.x)
        run(state, **dict(eager.kwargs(), out=out))  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(state, **dict(eager.kwargs(), out=out))
        graph.replay()
        torch.cuda.synchronize()
        kernel.check()
