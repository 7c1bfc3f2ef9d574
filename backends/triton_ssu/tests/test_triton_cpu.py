"""The triton backend against the reference on small hypothesis-drawn problems (Triton's
interpreter on the CPU in CI; the real GPU when there is one), options, availability, tuning."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.testing import CHECK_NAMES
from ssu_backend_triton import tuning

from triton_helpers import DEVICE, compare_steps, compiled_step_matches_reference


def problem(**fields):
    base = dict(
        nheads=4,
        headdim=8,
        dstate=16,
        ngroups=2,
        state_dtype="fp32",
        input_dtype="bf16",
        num_slots=8,
        max_batch=4,
        device=DEVICE,
    )
    base.update(fields)
    return ssu.Problem(**base)


problems = st.builds(
    lambda H, G, P, N, state, inp, T, batch: problem(
        nheads=H,
        ngroups=G,
        headdim=P,
        dstate=N,
        state_dtype=state,
        input_dtype=inp,
        num_slots=batch + 3,
        max_batch=batch,
        tokens_per_step=T,
        speculative=T > 1,
    ),
    H=st.sampled_from([2, 4]),
    G=st.sampled_from([1, 2]),
    P=st.sampled_from([4, 5, 8, 16]),
    N=st.sampled_from([4, 12, 16]),
    state=st.sampled_from(["fp32", "bf16", "fp16"]),
    inp=st.sampled_from(["bf16", "fp16", "fp32"]),
    T=st.sampled_from([1, 1, 2, 3]),
    batch=st.integers(1, 4),
)


schedules = st.one_of(
    st.none(),
    st.builds(
        lambda block_p, warps, tiles, stages, pdl, branchless: {
            "block_p": block_p,
            "num_warps": warps,
            "tiles_per_program": tiles,
            "loop_stages": stages,
            "programmatic_launch": pdl,  # ignored on CPU
            "branchless_inputs": branchless,
        },
        block_p=st.sampled_from([1, 2, 4, 8]),
        warps=st.sampled_from([1, 2]),
        tiles=st.integers(0, 3),
        stages=st.sampled_from([0, 2, 3]),
        pdl=st.booleans(),
        branchless=st.booleans(),
    ),
)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=problems,
    pad=st.integers(0, 1),
    options=st.booleans(),
    int64=st.booleans(),
    seed=st.integers(0, 2**16),
    schedule=schedules,
    data=st.data(),
)
def test_matches_reference(p, pad, options, int64, seed, schedule, data):
    """Drawn shapes, dtypes, options, pad rows, accepted counts and launch schedules (the default
    per shape, or pinned tiles, warps, tiles per program, pipeline stages and either way of loading
    the optional inputs)."""
    gen = torch.Generator().manual_seed(seed)
    pad = min(pad, p.max_batch - 1)
    tokens = data.draw(st.integers(1, p.tokens_per_step))
    compare_steps(
        p,
        gen,
        steps=2,
        pad=pad,
        options=options,
        tokens=tokens,
        index_dtype=torch.int64 if int64 else torch.int32,
        kernel_options=schedule,
    )


def test_non_power_of_two_shapes_and_layers(gen):
    compare_steps(problem(headdim=10, dstate=12, nheads=6, ngroups=3, num_slots=9), gen, steps=2, layers=2, pad=1)


@pytest.mark.slow
def test_speculative_decode_with_commits(gen):
    p = problem(tokens_per_step=4, speculative=True, state_dtype="bf16")
    compare_steps(p, gen, steps=5, pad=1, layers=2)


def test_commit_copies_no_state(gen):
    from ssu.checking.inputs import step_inputs

    p = problem(tokens_per_step=3, speculative=True)
    kernel = ssu.open(ssu.Config(backend="triton"), p)
    state = kernel.allocate_state()
    slots = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    kernel.step(state, **step_inputs(p, slots, gen).kwargs())
    before = state.buffers["ssm"].clone()
    kernel.commit(state, slots, torch.tensor([3, 1], dtype=torch.int32, device=DEVICE))
    assert torch.equal(state.buffers["ssm"], before)


def test_stochastic_rounding_fp16(gen):
    p = problem(state_dtype="fp16")
    compare_steps(p, gen, steps=2, kernel_options={"stochastic_rounding": True, "philox_rounds": 7})


def test_options_and_refusals():
    with pytest.raises(ssu.BackendUnavailableError, match="stochastic_rounding applies to an fp16 state cache only"):
        ssu.open(ssu.Config(backend="triton", backends={"triton": {"stochastic_rounding": True}}), problem())
    with pytest.raises(ssu.ConfigError, match=r"ssu\.backends\.triton\.block_p=3 is not valid"):
        ssu.open(ssu.Config(backend="triton", backends={"triton": {"block_p": 3}}), problem())
    with pytest.raises(ssu.ConfigError, match=r"philox_rounds=11 is out of range; use 1 to 10"):
        ssu.open(ssu.Config(backend="triton", backends={"triton": {"philox_rounds": 11}}), problem())
    with pytest.raises(ssu.BackendUnavailableError, match="dstate=1024 exceeds 512"):
        ssu.open(ssu.Config(backend="triton"), problem(dstate=1024))
    with pytest.raises(ssu.ConfigError, match=r"max_registers=16 is too few registers; use 0 .* or 32 to 255"):
        ssu.open(ssu.Config(backend="triton", backends={"triton": {"max_registers": 16}}), problem())
    with pytest.raises(ssu.ConfigError, match=r"programmatic_launch.*true or false or one of 'auto'"):
        ssu.open(ssu.Config(backend="triton", backends={"triton": {"programmatic_launch": "yes"}}), problem())
    with pytest.raises(ssu.ConfigError, match=r"branchless_inputs.*true or false or one of 'auto'"):
        ssu.open(ssu.Config(backend="triton", backends={"triton": {"branchless_inputs": 2}}), problem())


@pytest.mark.parametrize("setting, pdl", [("auto", int(DEVICE == "cuda")), (True, 1), (False, 0)])
def test_programmatic_launch_option(setting, pdl):
    """``programmatic_launch`` forces PDL on or off in every schedule, pinned or not; ``auto``
    leaves it to the defaults and the tuner (on for a GPU, off on the CPU, where it is
    meaningless anyway)."""
    for pins in ({}, {"block_p": 4, "num_warps": 1}):
        options = {"programmatic_launch": setting, "tuning_cache": "", **pins}  # no schedules tuned earlier
        kernel = ssu.open(ssu.Config(backend="triton", backends={"triton": options}), problem())
        assert {s.pdl for s in kernel._ctx.memo["launcher"].table[1:]} == {pdl}


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_branchless_inputs_option(setting):
    """``branchless_inputs`` forces either way of loading the optional inputs in every schedule,
    pinned or not; ``auto`` leaves it to the defaults (branch-free for an fp32 state with several
    tokens) and the tuner."""
    for fields in (
        {},
        {"state_dtype": "bf16", "tokens_per_step": 2, "speculative": True},
        {"tokens_per_step": 2, "speculative": True},
    ):
        expected = (
            int(fields.get("tokens_per_step", 1) > 1 and "state_dtype" not in fields)
            if setting == "auto"
            else int(setting)
        )
        for pins in ({}, {"block_p": 4, "num_warps": 1}):
            options = {"branchless_inputs": setting, "tuning_cache": "", **pins}  # no schedules tuned earlier
            kernel = ssu.open(ssu.Config(backend="triton", backends={"triton": options}), problem(**fields))
            assert {s.branchless for s in kernel._ctx.memo["launcher"].table[1:]} == {expected}


def test_pinned_launch_parameters(gen):
    compare_steps(problem(), gen, kernel_options={"block_p": 2, "num_warps": 1, "max_registers": 96})


@pytest.mark.parametrize("headdim, tiles, stages", [(8, 0, 2), (10, 0, 3), (12, 2, 4), (10, 2, 0)])
def test_programs_looping_over_pipelined_tiles(headdim, tiles, stages, gen):
    """Programs looping over several tiles (a whole head with tiles 0; a partial last tile when 4
    rows do not divide the head; a pipelined or a plain loop)."""
    p = problem(headdim=headdim, tokens_per_step=2, speculative=True)
    compare_steps(
        p,
        gen,
        steps=2,
        pad=1,
        kernel_options={"block_p": 4, "num_warps": 2, "tiles_per_program": tiles, "loop_stages": stages},
    )


def test_cpu_needs_the_interpreter(monkeypatch):
    from ssu_backend_triton.plugin import ssu_probe

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    availability = ssu_probe("cpu")
    assert not availability.available and "TRITON_INTERPRET=1" in availability.remedy


def test_missing_triton_is_reported(monkeypatch):
    import importlib.util

    from ssu_backend_triton.plugin import ssu_probe

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    availability = ssu_probe("cuda")
    assert not availability.available and availability.remedy == "pip install triton"


def test_tuning_helpers(tmp_path, monkeypatch):
    p = problem(nheads=128, headdim=80, dstate=128, ngroups=8, max_batch=100, device="cpu")
    assert tuning.buckets(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert tuning.buckets(1) == [1]
    block_p, warps, tiles, stages, maxnreg, pdl, branchless = tuning.default_config(p, 64)
    assert block_p * tuning.next_pow2(p.dstate) <= 1024
    assert (warps, tiles, stages, maxnreg, pdl, branchless) == (1, 1, 0, 0, 0, 0)
    assert tuning.default_config(attrs.evolve(p, tokens_per_step=4, speculative=True), 64).branchless == 1
    bf16 = attrs.evolve(p, state_dtype="bf16")
    assert tuning.default_config(bf16, 64) == (8, 2, 10, 4, 0, 0, 0)  # a whole head (80 rows) per program
    assert tuning.default_config(bf16, 4) == (8, 2, 5, 4, 0, 0, 0)  # half a head: enough programs for the GPU
    assert tuning.default_config(attrs.evolve(bf16, nheads=8, ngroups=1), 1).tiles == 1  # too few programs to loop
    bf16_t4 = tuning.default_config(attrs.evolve(bf16, tokens_per_step=4, speculative=True), 64)
    assert bf16_t4.tiles == 1 and bf16_t4.branchless == 0
    assert tuning.default_config(attrs.evolve(bf16, device="cuda"), 64).pdl == 1  # ignored below sm_90
    schedules = tuning.candidates(p)
    assert {s.stages for s in schedules} == {0, 3, 4} and {s.tiles for s in schedules} == {1, 5, 10}
    assert {s.tiles for s in tuning.candidates(attrs.evolve(p, tokens_per_step=4, speculative=True))} == {1}
    assert {s.maxnreg for s in schedules} == {0, 96, 128}
    assert all(s.block_p * 128 // (32 * s.num_warps) >= 32 for s in schedules if s.maxnreg)
    assert all(s.tiles * s.block_p < p.headdim + s.block_p for s in schedules)

    def looping(q):  # (values a tile, values a thread) of the looping candidates
        return {(s.block_p * 128, s.block_p * 128 // (32 * s.num_warps)) for s in tuning.candidates(q) if s.tiles > 1}

    assert max(looping(bf16)) == (2048, 32)
    assert (4096, 64) in looping(attrs.evolve(p, state_dtype="int8"))  # more values share a tile's row work
    path = tmp_path / "cache.json"
    tuning.write_cache(path, {"a": {"config": [8, 4, 1, 0, 96, 1, 1]}})
    tuning.write_cache(path, {"b": {"config": [16, 4, 1, 0, 96, 1]}, "c": "junk"})
    cached = tuning.read_cache(path)
    assert set(cached) == {"a", "b", "c"}
    assert tuning.cached_schedule(cached, "a") == tuning.Schedule(8, 4, 1, 0, 96, pdl=1, branchless=1)
    assert [tuning.cached_schedule(cached, k) for k in ("b", "c", "d")] == [None, None, None]  # re-tuned
    path.write_text("{not json")
    assert tuning.read_cache(path) == {}
    monkeypatch.setenv("SSU_TRITON_TUNING_CACHE", str(tmp_path / "env.json"))
    assert tuning.cache_path(None) == tmp_path / "env.json"
    assert tuning.cache_path("") is None
    monkeypatch.delenv("SSU_TRITON_TUNING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.cache_path(None) == tmp_path / "ssu" / "triton-tuning.json"


@pytest.mark.parametrize("branchless_faster", [True, False])
@pytest.mark.parametrize("try_branchless", [True, False])
def test_tuner_trials(monkeypatch, branchless_faster, try_branchless):
    """``tune_bucket`` times every candidate, then its winner the other way of loading the
    inputs (when asked), then its fastest few again in interleaved rounds, and keeps the best
    median; no PDL trial where launches ignore PDL (the CPU). Timing is faked: this checks the
    tuner's choices, not the kernel."""
    import ssu.measure.timing

    timed = []

    def faked_us(config):
        return 10.0 + config.block_p + (-1.0 if branchless_faster else 1.0) * config.branchless

    def fake_time(launches, **kw):
        launches[0]()  # records which config this timing is for
        return faked_us(timed[-1])

    monkeypatch.setattr(ssu.measure.timing, "graph_time_us", fake_time)
    p = problem(device="cpu")
    configs = [tuning.Schedule(4, 1), tuning.Schedule(2, 1), tuning.Schedule(8, 2)]
    best, us = tuning.tune_bucket(
        p, 2, lambda config, *a: timed.append(config), configs, 3, lambda msg: None, try_branchless=try_branchless
    )
    trial = [tuning.Schedule(2, 1, branchless=1)] if try_branchless else []
    first = configs + trial
    assert timed[: len(first)] == first  # no PDL trial on the CPU
    finalists = sorted(dict.fromkeys(first), key=faked_us)[: tuning.FINALISTS]
    assert timed[len(first) :] == finalists * tuning.FINAL_ROUNDS
    expected = tuning.Schedule(2, 1, branchless=int(try_branchless and branchless_faster))
    assert best == expected and us == 12.0 + (-1.0 if expected.branchless else 0.0)


def _tune_into(path: str, rank: int, entries: int) -> None:
    for i in range(entries):
        tuning.write_cache(Path(path), {f"rank {rank} bucket {i}": {"config": [8, 4, 1, 0, 96, 1, 1], "us": 1.0}})


def test_ranks_tuning_at_once_keep_every_entry(tmp_path):
    """Four processes writing the tuning cache at once (the ranks of one job): no entry lost, the
    file whole JSON throughout."""
    import multiprocessing

    path = tmp_path / "tuning.json"
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_tune_into, args=(str(path), rank, 30)) for rank in range(4)]
    for r in ranks:
        r.start()
    for r in ranks:
        r.join(180)
        assert r.exitcode == 0
    cached = tuning.read_cache(path)
    assert set(cached) == {f"rank {r} bucket {i}" for r in range(4) for i in range(30)}


def test_torch_compile_custom_op(gen):
    """The step inside torch.compile goes through torch.ops.ssu_triton.step (fake impl traced)."""
    compiled_step_matches_reference("triton", problem(), gen)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    state=st.sampled_from(["fp32", "bf16"]),
    T=st.sampled_from([1, 1, 3]),
    destinations=st.booleans(),
    pad_id=st.sampled_from([-1, 0, 99]),
    int64=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_adopted_caches_destinations_and_pad_ids(state, T, destinations, pad_id, int64, seed):
    """An engine's cache (a view with a 2x slot stride) stepped in place, speculative drafts
    committed into it, destination slots, pad ids outside and inside the cache."""
    p = problem(
        state_dtype=state,
        num_slots=11,
        max_batch=4,
        tokens_per_step=T,
        speculative=T > 1,
        pad_slot_id=pad_id,
        engine_state=True,
    )
    compare_steps(
        p,
        torch.Generator().manual_seed(seed),
        steps=3,
        pad=1,
        layers=2,
        adopt=True,
        destinations=destinations and T == 1,
        index_dtype=torch.int64 if int64 else torch.int32,
    )


@pytest.mark.parametrize("state", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(
    "T, adopt, destinations",
    [
        (1, True, True),
        pytest.param(1, False, True, marks=pytest.mark.slow),
        pytest.param(2, False, False, marks=pytest.mark.slow),
        pytest.param(2, True, False, marks=pytest.mark.slow),
    ],
)
def test_8_bit_states_with_row_scales(state, T, adopt, destinations, gen):
    """An 8-bit cache: rows dequantised with their scales, updated, quantised with fresh scales
    (allocated and adopted, with destinations, speculative drafts committed), against the
    reference; pad rows and slots outside the batch untouched, scales included."""
    p = problem(
        state_dtype=state,
        num_slots=11,
        tokens_per_step=T,
        speculative=T > 1,
        engine_state=adopt,
    )
    compare_steps(p, gen, steps=2, pad=1, adopt=adopt, destinations=destinations)


@pytest.mark.parametrize("state", ["int8", "fp8_e4m3"])
def test_8_bit_states_in_programs_that_loop_over_tiles(state, gen):
    """The schedule an 8-bit state takes from batch 8 on a GPU: programs looping over pipelined
    tiles, each tile's rows with their own scales."""
    p = problem(state_dtype=state, headdim=16, dstate=32, nheads=2, ngroups=1, num_slots=6, max_batch=3)
    options = dict(block_p=4, num_warps=1, tiles_per_program=4, loop_stages=4)
    compare_steps(p, gen, steps=2, pad=1, kernel_options=options)


@pytest.mark.parametrize(
    "checks",
    [("step", "destinations", "adopted"), pytest.param(("decode",), marks=pytest.mark.slow)],
    ids=["step", "decode"],
)
def test_8_bit_states_pass_the_kit_value_by_value(checks):
    """The conformance kit narrowed to 8-bit states: every written value within half a step of
    its own row's scale of the exact state (oracle.rounding_bound), as well as the budgets."""
    from ssu.testing import assert_conformant

    assert_conformant(
        "triton",
        checks=checks,
        profile="smoke",
        max_examples=3,
        device=DEVICE,
        state_dtypes=["int8", "fp8_e4m3"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECK_NAMES)
def test_passes_each_check_of_the_kit_at_the_smoke_profile(check):
    """Every check of the conformance kit at the smoke profile, on every state dtype the backend
    declares: what ``pytest --ssu-backend triton --ssu-profile smoke`` runs (each check draws the
    same cases alone as in a whole run), a test per check. Without CUDA the cuda-graph check
    cannot run and says so; every other check passes."""
    from ssu.testing import assert_conformant
    from ssu.testing.checks import CheckSkipped

    if check == "cuda-graph" and DEVICE == "cpu":
        with pytest.raises(CheckSkipped, match="cuda-graph"):
            assert_conformant("triton", checks=[check], profile="smoke", device=DEVICE)
        return
    assert_conformant("triton", checks=[check], profile="smoke", device=DEVICE)


def test_destination_slots_on_an_allocated_state(gen):
    compare_steps(problem(num_slots=11, pad_slot_id=0), gen, steps=3, pad=1, destinations=True)


@pytest.mark.parametrize("speculative", [False, True])
def test_compile_all_covers_destinations_and_adopted_layouts(speculative, monkeypatch):
    """Warmup's compile pass launches every configuration of the table, for both index dtypes,
    plain and in the variant a live step may also take: with destination slots (one token), in an
    adopted cache's layout (speculative); so that a CUDA graph captured afterwards compiles
    nothing. The launches run (here in the interpreter) on scratch."""
    p = problem(tokens_per_step=3 if speculative else 1, speculative=speculative, max_batch=2)
    launcher = ssu.open(ssu.Config(backend="triton", backends={"triton": {"block_p": 4, "num_warps": 1}}), p)
    launcher = launcher._ctx.memo["launcher"]
    seen = []
    original = launcher.run_scratch

    def recording(config, ssm, slots, inputs, out, compile_only=False, dst_slots=None, adopted=False):
        if not compile_only:
            seen.append((slots.dtype, dst_slots is not None, adopted))
        original(config, ssm, slots, inputs, out, compile_only, dst_slots, adopted)

    monkeypatch.setattr(launcher, "run_scratch", recording)
    launcher.compile_all()
    variant = (False, True) if speculative else (True, False)
    assert set(seen) == {(dtype, *v) for dtype in (torch.int32, torch.int64) for v in ((False, False), variant)}


def test_ids_outside_the_cache_in_the_kernel(gen):
    """The kernel's own guard (no core guard: the backend declares guards_slots): rows with ids
    outside the cache are pad rows and the first is recorded; commits with counts outside 1..T too."""
    from ssu.conformance import run_on

    for fields in ({}, {"tokens_per_step": 3, "speculative": True}, {"engine_state": True}):
        kernel = ssu.open(ssu.Config(backend="triton"), problem(num_slots=9, **fields))
        assert kernel.capabilities.guards_slots
        run_on(kernel, "guarded-ids", gen)


def test_dropin_through_triton(gen):
    from ssu.checking import oracle

    ssu.dropin.clear()
    cache = torch.randn(6, 4, 8, 16, generator=gen, device=DEVICE)
    before = cache.clone()
    x = torch.randn(3, 4, 8, generator=gen).bfloat16().to(DEVICE)
    dt = torch.randn(3, 4, generator=gen).bfloat16().to(DEVICE)
    A = (-torch.rand(4, generator=gen) - 1).to(DEVICE)
    B, C = (torch.randn(3, 2, 16, generator=gen).bfloat16().to(DEVICE) for _ in range(2))
    D = torch.randn(4, generator=gen).to(DEVICE)
    out = ssu.selective_state_update(
        cache,
        x,
        dt[:, :, None].expand(-1, -1, 8),
        A[:, None, None].expand(-1, 8, 16),
        B,
        C,
        D[:, None].expand(-1, 8),
        dt_softplus=True,
        config=ssu.Config(backend="triton"),
    )
    states, outs = oracle.ssu_math64(
        before[:3], x[:, None], dt[:, None], A, B[:, None], C[:, None], D=D, dt_softplus=True
    )
    assert oracle.rel_error(out[:, None], outs) < oracle.output_tolerance("bf16")
    assert oracle.rel_error(cache[:3], states[:, 0]) < oracle.state_tolerance("fp32")
    assert torch.equal(cache[3:], before[3:])
    ssu.dropin.clear()


def test_the_kernel_quantises_with_the_contract_s_qmax():
    """The kernel spells QMAX as literals (constexpr code cannot read ssu.contract.dtypes): they must be the
    contract's."""
    import inspect

    from ssu.contract.dtypes import QMAX
    from ssu_backend_triton import tiles

    source = inspect.getsource(getattr(tiles.quantized_rows, "fn", tiles.quantized_rows))  # the Python function
    assert f"qmax = {float(QMAX['int8'])}" in source and f"qmax = {float(QMAX['fp8_e4m3'])}" in source
