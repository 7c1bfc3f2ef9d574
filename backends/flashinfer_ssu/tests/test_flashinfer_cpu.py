"""FlashInfer backend logic that needs no GPU: options, availability, capability refusals, and our
call checked against the installed FlashInfer's real signature and stride rules."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest
import torch

import ssu
from ssu.state import faults, slot_state
from ssu.checking.inputs import pick_slots, step_inputs
from ssu_backend_flashinfer import availability, plugin, translate
from ssu_backend_flashinfer.scratch import allocate_scratch
from ssu_backend_flashinfer import rows as rows_mod
from ssu_backend_flashinfer.options import FlashInferOptions
from ssu.contract.options import build


def problem(**fields):
    base = dict(
        nheads=8, headdim=64, dstate=16, ngroups=2, state_dtype="fp32", input_dtype="bf16", num_slots=10, max_batch=4
    )
    base.update(fields)
    return ssu.Problem(**base)


def test_options_validation():
    assert build(FlashInferOptions, {"algorithm": "simple"}, "ssu.backends.flashinfer").algorithm == "simple"
    with pytest.raises(
        ssu.ConfigError, match="'diagonal' is not valid; use one of 'auto', 'simple', 'vertical', 'horizontal'"
    ):
        build(FlashInferOptions, {"algorithm": "diagonal"}, "ssu.backends.flashinfer")
    with pytest.raises(
        ssu.ConfigError, match=r"ssu\.backends\.flashinfer\.algoritm: unknown option \(did you mean 'algorithm'\?\)"
    ):
        build(FlashInferOptions, {"algoritm": "simple"}, "ssu.backends.flashinfer")
    with pytest.raises(ssu.ConfigError, match="philox_rounds=0 is out of range"):
        build(FlashInferOptions, {"philox_rounds": 0}, "ssu.backends.flashinfer")
    with pytest.raises(
        ssu.ConfigError,
        match=r"^ssu\.backends\.flashinfer\.warmup_index_dtypes=\['int16'\]: 'int16' is not a dtype ssu knows; use "
        "one of int32, int64$",
    ):
        build(FlashInferOptions, {"warmup_index_dtypes": ["int16"]}, "ssu.backends.flashinfer")
    with pytest.raises(ssu.ConfigError, match=r"warmup_index_dtypes=\['fp32'\]: fp32 is not a slot index dtype"):
        build(FlashInferOptions, {"warmup_index_dtypes": ["fp32"]}, "ssu.backends.flashinfer")
    with pytest.raises(ssu.ConfigError, match=r"warmup_index_dtypes=\[\] is not valid; use a non-empty list"):
        build(FlashInferOptions, {"warmup_index_dtypes": []}, "ssu.backends.flashinfer")
    spelled = {"warmup_index_dtypes": ["torch.int64", "int32", "int64"]}  # torch's names, as Problem takes them
    assert build(FlashInferOptions, spelled, "ssu.backends.flashinfer").warmup_index_dtypes == ("int64", "int32")


@pytest.mark.parametrize(
    "algo, cc, tokens, headdim, pattern",
    [
        ("vertical", (9, 0), 4, 64, r"needs SM100 \(Blackwell\); this GPU is SM90"),
        ("horizontal", (9, 0), 2, 64, r"needs SM100 \(Blackwell\); this GPU is SM90"),
        ("vertical", (8, 0), 1, 64, "needs SM90 or newer; this GPU is SM80"),
        ("vertical", (9, 0), 1, 40, "multiple of 16 and >= 48"),
        ("horizontal", (9, 0), 1, 80, "multiple of 64 and <= 256"),
    ],
)
def test_algorithm_refusals(algo, cc, tokens, headdim, pattern):
    p = problem(headdim=headdim, tokens_per_step=tokens, speculative=tokens > 1)
    reasons = plugin.algorithm_problems(p, FlashInferOptions(algorithm=algo), cc)
    assert len(reasons) == 1 and __import__("re").search(pattern, reasons[0])


@pytest.mark.parametrize(
    "algo, cc, tokens",
    [
        ("simple", (9, 0), 4),
        ("auto", (9, 0), 4),
        ("vertical", (9, 0), 1),
        ("horizontal", (9, 0), 1),
        ("vertical", (10, 0), 4),
    ],
)
def test_algorithm_accepted(algo, cc, tokens):
    p = problem(tokens_per_step=tokens, speculative=tokens > 1)
    assert plugin.algorithm_problems(p, FlashInferOptions(algorithm=algo), cc) == []


def test_stochastic_rounding_needs_fp16_state():
    verdict = plugin.ssu_supports(problem(), FlashInferOptions(stochastic_rounding=True))
    assert not verdict.ok and "fp16 state cache only" in verdict.reasons[0]


@pytest.mark.parametrize(
    "state_dtype, dstate, builds",
    [("fp32", 32, True), ("bf16", 32, False), ("bf16", 64, True), ("fp16", 32, False), ("int8", 64, False),
     ("int8", 96, True), ("fp8_e4m3", 64, False), ("fp8_e4m3", 128, True)],
)  # fmt: skip
def test_dstates_flashinfer_does_not_build_are_refused(state_dtype, dstate, builds):
    """FlashInfer's module fails to compile (a zero-sized register tile of its multi-token kernel)
    below dstate 64 for a 16-bit state and 128 for an 8-bit one: refused, naming what serves it."""
    verdict = plugin.ssu_supports(problem(state_dtype=state_dtype, dstate=dstate), FlashInferOptions())
    assert verdict.ok == builds, verdict.reasons
    if not builds:
        assert f"dstate {dstate}" in verdict.reasons[0] and "triton serves it" in verdict.reasons[0]


def test_availability_on_cpu_and_missing_library(monkeypatch):
    got = availability.flashinfer_availability("cpu")
    assert not got.available and "CUDA devices only" in got.reason
    real = importlib.metadata.version

    def fake_version(name):
        if name == "flashinfer-python":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    got = availability.flashinfer_availability("cuda")
    assert not got.available and got.remedy == "pip install 'flashinfer-python>=0.7.4'"
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.7.2")
    got = availability.flashinfer_availability("cuda")
    assert not got.available and "older than 0.7.4" in got.reason and "head dims 32 and 96" in got.reason


def test_missing_nvcc_is_reported(monkeypatch):
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(availability.shutil, "which", lambda name: None)
    monkeypatch.setattr(availability.Path, "is_file", lambda self: False)
    assert availability.find_nvcc() is None


def test_named_backend_on_cpu_is_refused_with_reason():
    with pytest.raises(ssu.BackendUnavailableError, match="FlashInfer runs on CUDA devices only"):
        ssu.open(ssu.Config(backend="flashinfer"), problem())


def _fi_signature():
    from flashinfer.mamba import selective_state_update

    return inspect.signature(selective_state_update)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("with_options", [True, False])
@pytest.mark.parametrize("adopted", [False, True])
def test_arguments_match_the_real_signature_and_stride_rules(tokens, with_options, adopted, gen):
    """Our call binds to the installed FlashInfer's selective_state_update and meets the layout
    rules its C++ checks (broadcast A, dt, D, dt_bias; contiguous heads; one index dtype)."""
    spec = tokens > 1
    p = problem(tokens_per_step=tokens, speculative=spec, pad_slot_id=0 if adopted else -1)
    options = FlashInferOptions(algorithm="simple")
    slots = pick_slots(p, 3, gen, pad_rows=1)
    inputs = step_inputs(p, slots, gen, with_z=with_options)
    if adopted:
        state = slot_state.adopt(p, (torch.zeros(p.num_slots, p.nheads, p.headdim, p.dstate),), "flashinfer")
    else:
        state = slot_state.allocate(p, 1, "flashinfer")
    scratch = allocate_scratch(p, options)
    dst_slots = None if spec else slots.flip(0)
    rows = rows_mod.guarded_rows(scratch, p, state, slots, dst_slots, faults.allocate("cpu"))
    target = rows_mod.layer_rows(state)[0]
    D = inputs.D.to(inputs.dt.dtype) if with_options else scratch["zero_D"][inputs.dt.dtype]
    dt_bias = inputs.dt_bias.to(inputs.dt.dtype) if with_options else None
    kwargs = translate.fi_arguments(
        p,
        options,
        target.rows,
        inputs.x,
        inputs.dt,
        inputs.A,
        inputs.B,
        inputs.C,
        D,
        inputs.z,
        dt_bias,
        True,
        torch.empty_like(inputs.x),
        rows.read,
        rows.dst,
        None,
        target.drafts,
    )
    bound = _fi_signature().bind(**kwargs)  # raises TypeError on a renamed or removed argument
    assert bound.arguments["algorithm"] == "simple"
    H, P, N = p.nheads, p.headdim, p.dstate
    assert kwargs["A"].shape == (H, P, N) and kwargs["A"].stride() == (1, 0, 0)
    assert kwargs["D"].shape == (H, P) and kwargs["D"].stride() == (1, 0)
    assert kwargs["dt"].shape == inputs.x.shape and kwargs["dt"].stride()[-2:] == (1, 0)
    if with_options:
        assert kwargs["dt_bias"].stride() == (1, 0) and kwargs["dt_bias"].dtype == kwargs["dt"].dtype
    assert kwargs["D"].dtype == kwargs["dt"].dtype
    assert kwargs["x"].stride(-2) == P and kwargs["x"].stride(-1) == 1
    assert kwargs["state"].stride()[1:] == (P * N, N, 1)
    if spec and adopted:
        assert kwargs["intermediate_states_buffer"].shape == (p.num_slots, tokens, H, P, N)
        assert kwargs["disable_state_update"] and kwargs["cache_steps"] == tokens
    elif spec:
        assert kwargs["dst_state_batch_indices"].shape == (3, tokens) and kwargs["cache_steps"] == tokens
    else:
        assert kwargs["dst_state_batch_indices"].shape == (3,) and "cache_steps" not in kwargs
    if "dst_state_batch_indices" in kwargs:
        assert kwargs["state_batch_indices"].dtype == kwargs["dst_state_batch_indices"].dtype


@pytest.mark.parametrize("triton_rows", [True, False])
def test_versioned_rows_and_their_reuse(triton_rows, gen):
    """The rows of a speculative step, by one Triton launch (in its interpreter here) or torch ops."""
    p = problem(tokens_per_step=3, speculative=True)
    state = slot_state.allocate(p, 1, "flashinfer")
    scratch = allocate_scratch(p, FlashInferOptions())
    scratch["triton_rows"] = triton_rows
    cursor = state.buffers["cursor"]
    cursor[4], cursor[7] = 2, 3
    slots = torch.tensor([4, -1, 7, 12], dtype=torch.int64)
    record = faults.allocate("cpu")
    read, dst = rows_mod.guarded_rows(scratch, p, state, slots, None, record)
    K = 4
    assert read.tolist() == [4 * K + 2, -1, 7 * K + 3, -1]  # slot 12 lies outside the cache: a pad row
    assert dst[0].tolist() == [4 * K + 3, 4 * K + 0, 4 * K + 1]
    assert dst[2].tolist() == [7 * K + 0, 7 * K + 1, 7 * K + 2]
    assert faults.decode(int(record)) == (3, faults.SLOTS, 12)
    again = rows_mod.guarded_rows(scratch, p, state, slots, None, record)  # reused until commit
    assert again.read.data_ptr() == read.data_ptr()
    slots[0] = 5  # modified in place: computed again
    assert rows_mod.guarded_rows(scratch, p, state, slots, None, record).read[0].item() == 5 * K


@pytest.mark.parametrize("triton_rows", [True, False])
def test_destination_rows_and_sinks(triton_rows, gen):
    """A destination that is the pad id (or outside the cache) sends the write to the sink row of
    an allocated state, or to the pad slot of an adopted cache; a pad row writes nowhere."""
    p = problem()
    scratch = allocate_scratch(p, FlashInferOptions())
    scratch["triton_rows"] = triton_rows
    record = faults.allocate("cpu")
    slots = torch.tensor([1, 2, -1, 3], dtype=torch.int32)
    dst = torch.tensor([5, -1, 6, 40], dtype=torch.int32)
    owned = slot_state.allocate(p, 1, "flashinfer")
    rows = rows_mod.guarded_rows(scratch, p, owned, slots, dst, record)
    assert rows.read.tolist() == [1, 2, -1, 3] and rows.dst.tolist() == [5, 10, 10, 10]
    assert faults.decode(int(record)) == (3, faults.DST_SLOTS, 40)
    p0 = problem(pad_slot_id=0)
    scratch = allocate_scratch(p0, FlashInferOptions())
    scratch["triton_rows"] = triton_rows
    adopted = slot_state.adopt(p0, (torch.zeros(10, 8, 64, 16),), "flashinfer")
    rows = rows_mod.guarded_rows(scratch, p0, adopted, slots.where(slots != -1, 0), dst.where(dst != -1, 0), record)
    # the pad row reads FlashInfer's pad id -1 (no row: it writes nothing); the pad slot 0 is the sink
    assert rows.read.tolist() == [1, 2, -1, 3] and rows.dst.tolist() == [5, 0, 0, 0]


def test_weights_converted_once_per_tensor():
    cache = translate.WeightCache()
    D = torch.randn(8)
    first = cache(D, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and cache(D, torch.bfloat16) is first
    D.mul_(2)  # modified in place: converted again
    again = cache(D, torch.bfloat16)
    assert again is not first and torch.equal(again, D.to(torch.bfloat16))


# the whole backend on the emulated kernel -----------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ssu.checking.harness import compare_with_reference  # noqa: E402


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    state_dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    tokens=st.sampled_from([1, 1, 3]),
    adopt=st.booleans(),
    destinations=st.booleans(),
    pad_id=st.sampled_from([-1, 0, 99]),
    index=st.sampled_from([torch.int32, torch.int64]),
    triton_rows=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_emulated_backend_matches_the_reference(
    emulated, state_dtype, tokens, adopt, destinations, pad_id, index, triton_rows, seed
):
    """The backend's rows (one Triton launch, or torch ops), guards, sinks, destinations and adopted
    caches around FlashInfer's documented kernel: outputs and states against the reference, every
    other slot untouched."""
    from unittest import mock

    from ssu_backend_flashinfer import rows_triton

    if adopt and destinations and not 0 <= pad_id < 12:
        pad_id = 0  # destinations on an adopted cache need its pad slot as the sink
    p = problem(
        nheads=4,
        headdim=32,
        dstate=32,
        state_dtype=state_dtype,
        num_slots=12,
        max_batch=4,
        tokens_per_step=tokens,
        speculative=tokens > 1,
        pad_slot_id=pad_id,
        engine_state=adopt,
    )
    gen = torch.Generator().manual_seed(seed)
    with mock.patch.object(rows_triton, "usable", lambda device_type: triton_rows):
        compare_with_reference(
            "flashinfer-emulated",
            p,
            gen,
            steps=3,
            pad=1,
            layers=2,
            index_dtype=index,
            registry=emulated,
            adopt=adopt,
            destinations=destinations and tokens == 1,
        )


def test_emulated_backend_is_conformant(emulated):
    from ssu.conformance import run_conformance

    results = run_conformance("flashinfer-emulated", registry=emulated, profile="quick")
    failed = [f"{r.check}: {r.failure}" for r in results if r.status == "fail"]
    assert not failed, "\n".join(failed)
    assert {r.check for r in results if r.status == "pass"} >= {
        "step",
        "decode",
        "adopted",
        "destinations",
        "guarded-ids",
        "partial-commit",
        "bad-inputs",
        "packed-calls",
        "verify-calls",
    }


def test_destination_slots_on_an_adopted_cache_need_a_sink(emulated, gen):
    p = problem(nheads=4, headdim=32, dstate=32, num_slots=8, engine_state=True)
    kernel = ssu.open(ssu.Config(backend="flashinfer-emulated"), p, registry=emulated)
    state = kernel.adopt_state(torch.zeros(8, 4, 32, 32))
    slots = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ssu.InputError, match="needs a sink row; an adopted cache has none unless the pad id names"):
        kernel.step(state, dst_slots=slots + 3, **step_inputs(p, slots, gen).kwargs())
