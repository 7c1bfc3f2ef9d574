"""8-bit state caches (int8, fp8_e4m3) with per-row scales: the rounding of a write, the
reference backend against the float64 statement over long decodes at a real shape, adopted engine
caches with their scales, and the refusals (bad scales, backends that lack the dtypes, the drop-in
call)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssu
from ssu.state import quant
from ssu.contract.dtypes import QMAX
from ssu.checking.inputs import layer_weights, random_states, step_inputs
from ssu.checking.oracle import rel_error, step_math64

from fakes import good_backend, small_problem

QUANTIZED = ("int8", "fp8_e4m3")


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(QUANTIZED),
    rows=st.integers(1, 6),
    n=st.integers(1, 64),
    magnitude=st.floats(1e-6, 1e4),
    seed=st.integers(0, 2**16),
)
def test_a_row_is_kept_within_half_a_step_of_its_own_scale(dtype, rows, n, magnitude, seed):
    values = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, scale = quant.quantize(values, dtype)
    assert q.dtype == ssu.contract.dtypes.to_torch(dtype) and scale.dtype == torch.float32 and scale.shape == (rows,)
    assert torch.allclose(scale, values.abs().amax(-1) / QMAX[dtype])
    error = (quant.dequantize(q, scale) - values).abs()
    if dtype == "int8":
        assert (error <= scale[:, None] * 0.5 * (1 + 1e-5) + 1e-30).all()
    else:  # e4m3: 3 mantissa bits, relative to each value; below its normal range, steps of 2^-9
        assert (error <= values.abs() * 2.0**-4 + scale[:, None] * 2.0**-9 + 1e-30).all()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_zero_row_has_a_zero_scale_and_a_scale_follows_its_row(dtype):
    values = torch.zeros(2, 8)
    values[1] = torch.linspace(-3.0, 3.0, 8)
    q, scale = quant.quantize(values, dtype)
    assert scale[0] == 0 and not q[0].float().any()
    _, smaller = quant.quantize(values * 0.01, dtype)
    assert torch.allclose(smaller[1], scale[1] * 0.01)  # shrinks with the row, and grows back
    assert torch.equal(quant.stored(values, dtype), quant.dequantize(q, scale))


#: largest relative error (rel_error) over 200 steps at the Nemotron-H-8B mixer shape, measured
#: with the reference backend against the float64 statement from the same start (docs/spec.md,
#: "Quantised states"): outputs, states
DECODE_BUDGET = {"int8": (3e-2, 2e-2), "fp8_e4m3": (1.2e-1, 1e-1)}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_200_step_decode_stays_within_the_stated_budget(dtype):
    """Errors accumulate over a decode from one quantised start (no re-feeding), against float64."""
    p = ssu.Problem(
        nheads=128, headdim=64, dstate=128, ngroups=8, state_dtype=dtype, input_dtype="bf16", num_slots=4, max_batch=2
    )
    kernel = ssu.open(ssu.Config(backend="reference"), p)
    state = kernel.allocate_state()
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 3], dtype=torch.int32)
    kernel.write_state(state, slots, random_states(p, 2, gen))
    exact = kernel.read_state(state, slots).double()
    weights = layer_weights(p, gen)
    worst_out = worst_state = 0.0
    for _ in range(200):
        inputs = step_inputs(p, slots, gen, weights=weights)
        states, outs = step_math64(p, exact, inputs)
        out = kernel.step(state, **inputs.kwargs())
        exact = states[:, -1]
        worst_out = max(worst_out, rel_error(out, outs[:, -1]))
        worst_state = max(worst_state, rel_error(kernel.read_state(state, slots), exact))
    out_budget, state_budget = DECODE_BUDGET[dtype]
    assert worst_out < out_budget and worst_state < state_budget, (worst_out, worst_state)


def quantized_problem(dtype="int8", **overrides):
    return small_problem(state_dtype=dtype, **overrides)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_an_adopted_cache_and_its_scales_are_stepped_in_place(dtype):
    p = quantized_problem(dtype, num_slots=6)
    kernel = ssu.open(ssu.Config(backend="reference"), p)
    gen = torch.Generator().manual_seed(1)
    values = random_states(p, p.num_slots, gen)
    cache, scales = quant.quantize(values, dtype)
    before_cache, before_scales = cache.clone(), scales.clone()
    state = kernel.adopt_state(cache, scales=scales)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    inputs = step_inputs(p, slots, gen)
    states, _ = step_math64(p, quant.dequantize(cache[slots.long()], scales[slots.long()]).double(), inputs)
    kernel.step(state, **inputs.kwargs())
    got = quant.dequantize(cache[slots.long()], scales[slots.long()])
    assert rel_error(got, states[:, -1]) < ssu.checking.oracle.tolerances(p)[1]
    others = torch.tensor([0, 2, 3, 5])
    assert torch.equal(cache[others], before_cache[others]) and torch.equal(scales[others], before_scales[others])
    assert not torch.equal(scales[slots.long()], before_scales[slots.long()])


@pytest.mark.parametrize(
    "scales, message",
    [
        (None, "keeps one fp32 scale per"),
        (torch.ones(6, 4, 8, dtype=torch.float16), "fp32"),
        (torch.ones(6, 4, 9), r"\(6, 4, 8\)"),
        ([torch.ones(6, 4, 8), torch.ones(6, 4, 8)], "2 layer\\(s\\) of scales for 1"),
        (torch.ones(6, 8, 4).transpose(1, 2), "contiguous"),
        (torch.ones(4 * 8 + 5).as_strided((6, 4, 8), (1, 8, 1)), "slots would overlap"),
        ("scales", "expected a \\(num_slots, H, P\\) fp32 tensor"),
        (torch.ones(6, 4, 8, device="meta"), "meta"),
    ],
    ids=["missing", "dtype", "shape", "layers", "strides", "overlapping", "type", "device"],
)
def test_bad_scales_are_refused_before_anything_is_written(scales, message):
    p = quantized_problem(num_slots=6)
    kernel = ssu.open(ssu.Config(backend="reference"), p)
    cache = torch.ones(6, 4, 8, 16, dtype=torch.int8)
    with pytest.raises(ssu.InputError, match=message):
        kernel.adopt_state(cache, scales=scales)
    assert torch.equal(cache, torch.ones_like(cache))


def test_a_float_cache_takes_no_scales():
    kernel = ssu.open(ssu.Config(backend="reference"), small_problem(num_slots=6))
    with pytest.raises(ssu.InputError, match="has no scales"):
        kernel.adopt_state(torch.zeros(6, 4, 8, 16), scales=torch.ones(6, 4, 8))


def test_a_backend_without_the_dtype_refuses_naming_those_that_serve_it(fake_site):
    fake_site.add("ssu-backend-good", {"good": "r_good"}, modules={"r_good": good_backend("good")})
    with pytest.raises(ssu.BackendUnavailableError) as caught:
        ssu.open(ssu.Config(backend="good"), quantized_problem(), registry=fake_site.registry())
    text = str(caught.value)
    assert "state dtype int8 not supported" in text
    assert "backends that serve this problem here: reference" in text


def test_the_drop_in_call_refuses_an_8_bit_cache_naming_the_way():
    state = torch.zeros(4, 2, 4, 8, dtype=torch.int8)
    with pytest.raises(ssu.InputError, match="kernel.adopt_state\\(cache, scales=...\\)"):
        ssu.selective_state_update(
            state,
            torch.randn(1, 2, 4),
            torch.rand(1, 2),
            -torch.rand(2),
            torch.randn(1, 1, 8),
            torch.randn(1, 1, 8),
            config=ssu.Config(backend="reference"),
        )


def test_ssu_run_shows_the_error_of_an_int8_state(capsys):
    from ssu.cli.main import main

    args = ["run", "--state-dtype", "int8", "--nheads", "8", "--headdim", "16", "--dstate", "32", "--ngroups", "2"]
    assert main([*args, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "state=int8" in out and "max error" in out and "result          OK" in out
    ratio = float(out.split("every written value within ")[1].split()[0])
    assert 0 < ratio <= 1  # the worst value against its own rounding bound


def test_a_decode_report_is_wrong_when_a_value_strays_from_its_rounding():
    """``ssu run``'s verdict holds 8-bit values to their rows' rounding, not only to the budget."""
    from ssu.cli.decode import DecodeReport

    p = small_problem(state_dtype="int8")
    report = DecodeReport("x", p, 1, 1, 1, 0, seconds=1.0, checked_layer_steps=1, out_tolerance=1, state_tolerance=1)
    assert report.ok
    report.max_rounding = 1.5
    assert not report.ok and "within 1.50 of what rounding to int8" in report.summary()


def test_ssu_bench_smoke_runs_8_bit_states_allocated_and_adopted(capsys):
    from ssu.cli.main import main

    shape = ["--nheads", "4", "--headdim", "8", "--dstate", "16", "--ngroups", "2"]
    args = ["bench", "--device", "cpu", "--state-dtype", "int8,fp8_e4m3", "--backends", "reference", "--batches", "2"]
    assert main([*args, "--adopt", *shape]) == 0
    out = capsys.readouterr().out
    for state in QUANTIZED:
        assert re.search(rf"^reference +{state} ", out, re.M) and re.search(
            rf"^reference\+adopted +{state} ", out, re.M
        )


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_patched_model_keeps_its_cache_as_an_8_bit_cache_would_hold_it(dtype):
    from ssu.integrations import hf_models
    from ssu.integrations import transformers as ssu_hf

    model = hf_models.random_model("nemotron_h", "tiny", 2)
    ids = hf_models.prompt_ids(model)
    with ssu_hf.patch(model, ssu.Config(backend="reference"), state_rounding=dtype):
        generation = hf_models.generate(model, ids, 3)
    for state in generation.recurrent_states():
        assert torch.equal(quant.stored(state, dtype), state)  # on the 8-bit grid of its row scales
    with pytest.raises(ssu.ConfigError, match="not an 8-bit state dtype"):
        ssu_hf.patch(model, ssu.Config(backend="reference"), state_rounding="bf16")


def test_ssu_compare_with_an_8_bit_cache_reports_token_agreement(capsys):
    from ssu.cli.main import main

    args = ["compare", "--arch", "mamba2", "--layers", "2", "--new-tokens", "4", "--backend", "reference"]
    assert main([*args, "--state-dtype", "int8", "--no-share"]) == 0
    out = capsys.readouterr().out
    assert "rounded after each step to an int8 cache's contents" in out and "tokens: 4/4 equal" in out


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_written_row_is_within_the_rounding_bound_and_truncation_is_not(dtype):
    """The kit's per-value bound (oracle.rounding_bound) holds for the rule's own rounding of rows
    that span many magnitudes; int8 rounded toward zero, or with one scale for a head, breaks it."""
    from ssu.checking.oracle import rounding_bound

    gen = torch.Generator().manual_seed(5)
    exact = torch.randn(3, 4, 16, 32, generator=gen, dtype=torch.float64)
    exact *= torch.logspace(-6, 2, 16, dtype=torch.float64)[None, None, :, None]  # rows of every size
    bound = rounding_bound(exact, dtype)
    assert ((quant.stored(exact.float(), dtype).double() - exact).abs() <= bound).all()
    if dtype == "int8":
        row = exact.abs().amax(-1, keepdim=True) / QMAX[dtype]
        head = exact.abs().amax(dim=(-2, -1), keepdim=True) / QMAX[dtype]
        for wrong in (torch.trunc(exact / row) * row, torch.round(exact / head) * head):
            assert ((wrong - exact).abs() > bound).any()


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_a_speculative_bound_covers_the_state_rounded_before_the_step(dtype):
    """A speculative step may round the state it started from and decay it by its accepted tokens
    (a checkpoint-and-ring backend): that error is measured against the larger of the two states'
    magnitudes (oracle.rounding_bound's ``start``). A row that shrank past its old scale breaks the
    narrower bound of the new state alone; a scale that never shrinks breaks both."""
    from ssu.checking.oracle import rounding_bound

    gen = torch.Generator().manual_seed(6)
    before = torch.randn(3, 4, 16, 32, generator=gen, dtype=torch.float64)
    before *= torch.logspace(-4, 1, 16, dtype=torch.float64)[None, None, :, None]
    decay = 0.8
    large = before.abs() > 0.5 * before.abs().amax(-1, keepdim=True)
    tokens = torch.where(large, -0.9 * decay * before, 0.0)  # the step's tokens cancel a row's largest values
    exact = decay * before + tokens
    rounded = decay * quant.stored(before.float(), dtype).double() + tokens
    assert ((rounded - exact).abs() <= rounding_bound(exact, dtype, start=before)).all()
    assert ((rounded - exact).abs() > rounding_bound(exact, dtype)).any()
    if dtype == "int8":  # the old, larger scale kept for the new row
        step = before.abs().amax(-1, keepdim=True) / QMAX[dtype]
        stale = torch.round(exact / (4 * step)) * (4 * step)
        assert ((stale - exact).abs() > rounding_bound(exact, dtype, start=before)).any()
