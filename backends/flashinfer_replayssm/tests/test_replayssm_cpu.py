"""ReplaySSM backend logic that needs no GPU: the cursor rule against a plain ring model, options,
refusals, our call against the installed FlashInfer's real signature, and the whole backend
(layout, pad slot, commits, pending flushes, folds) with the kernel replaced by :mod:`emulation`."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.state import faults
from ssu.conformance import run_conformance
from ssu.checking.harness import compare_with_reference
from ssu.checking.inputs import layer_weights, pick_slots, random_states, step_inputs
from ssu.contract.options import build
from ssu_backend_flashinfer_replayssm import cursors, layout, plugin, translate
from ssu_backend_flashinfer_replayssm.options import ReplayOptions

from emulation import NAME

SECTION = "ssu.backends.flashinfer-replayssm"


def problem(**fields):
    base = dict(
        nheads=4,
        headdim=32,
        dstate=64,
        ngroups=2,
        state_dtype="fp32",
        input_dtype="bf16",
        num_slots=9,
        max_batch=4,
        device="cpu",
    )
    base.update(fields)
    if base.get("tokens_per_step", 1) > 1:
        base.setdefault("speculative", True)
    return ssu.Problem(**base)


# the cursor rule ------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 6), extra=st.integers(0, 10), data=st.data())
def test_cursor_rule_against_a_plain_ring(tokens, extra, data):
    """Tokens carry ids; a model ring records which id each row holds. After every step and commit
    the rows ring_start .. ring_start + pnat - 1 hold exactly the accepted tokens not yet folded
    into the checkpoint, in order; a step never appends over a row it replays; pnat <= max_window."""
    W = min(16, tokens + extra)
    L = W + tokens
    ring = [None] * L
    start = count = 0
    accepted_ids: list[int] = []
    folded = 0
    next_id = 0
    for accepted in data.draw(st.lists(st.integers(1, tokens), min_size=1, max_size=80)):
        replayed = {(start + k) % L for k in range(count)}
        appended = [(start + count + i) % L for i in range(tokens)]
        assert not replayed & set(appended), "a step would overwrite a row it replays"
        ids = list(range(next_id, next_id + tokens))
        next_id += tokens
        for row, token in zip(appended, ids):
            ring[row] = token
        if count + tokens > W:  # the kernel folds the old tokens into the checkpoint
            folded += count
        accepted_ids += ids[:accepted]
        start, count = cursors.advance_model(start, count, accepted, tokens, W)
        assert 0 <= count <= W and 0 <= start < L
        assert folded + count == len(accepted_ids)
        assert [ring[(start + k) % L] for k in range(count)] == accepted_ids[folded:]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 4),
    W=st.integers(4, 16),
    batch=st.integers(1, 9),
    pads=st.integers(0, 3),
    index=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_advance_implementations_match_the_rule(impl, tokens, W, batch, pads, index, data, monkeypatch):
    if impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        if not cursors.triton_usable("cpu"):
            pytest.skip("triton is not installed")
    S = 12
    L = W + tokens
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    ring_start = torch.randint(0, L, (S + 2,), generator=gen, dtype=torch.int32)
    pnat = torch.randint(0, W + 1, (S + 2,), generator=gen, dtype=torch.int32)
    ring_start[S:] = 0
    pnat[S:] = 0
    real = torch.randperm(S, generator=gen)[:batch]
    slots = torch.cat([real, torch.full((pads,), -1)]).to(index)
    # counts outside 1..T among them: refused, they keep no token, but a flushed ring still moves
    accepted = torch.randint(0, tokens + 2, (batch + pads,), generator=gen, dtype=torch.int32)
    want_start, want_pnat = ring_start.clone(), pnat.clone()
    for s, a in zip(real.tolist(), accepted.tolist()):
        want_start[s], want_pnat[s] = cursors.advance_model(int(ring_start[s]), int(pnat[s]), a, tokens, W)
    fn = cursors.advance_triton if impl == "triton" else cursors.advance_torch
    record = faults.allocate("cpu")
    fn(ring_start, pnat, slots, accepted, record, tokens=tokens, max_window=W, pad_slot_id=-1, num_slots=S)
    assert torch.equal(ring_start[: S + 1], want_start[: S + 1]) and torch.equal(pnat[: S + 1], want_pnat[: S + 1])
    assert ring_start[S] == 0 and pnat[S] == 0, "the pad slot's cursors moved"


# options and refusals -------------------------------------------------------------------------
def test_options_validation(monkeypatch, tmp_path):
    assert build(ReplayOptions, {"max_window": 8, "algorithm": "two-kernel"}, SECTION).max_window == 8
    with pytest.raises(ssu.ConfigError, match="max_window=17 is out of range"):
        build(ReplayOptions, {"max_window": 17}, SECTION)
    with pytest.raises(ssu.ConfigError, match="'fused' is not valid; use one of 'auto', 'monolith', 'two-kernel'"):
        build(ReplayOptions, {"algorithm": "fused"}, SECTION)
    with pytest.raises(ssu.ConfigError, match=r"max_windw: unknown option \(did you mean 'max_window'\?\)"):
        build(ReplayOptions, {"max_windw": 8}, SECTION)
    with pytest.raises(ssu.ConfigError, match="commit_on_last_layer"):
        build(ReplayOptions, {"commit_on_last_layer": "yes"}, SECTION)
    assert build(ReplayOptions, {"tuning_batches": [256, 64, 64]}, SECTION).tuning_batches == (64, 256)
    with pytest.raises(ssu.ConfigError, match="tuning_batches: expected a list of integers, got 128"):
        build(ReplayOptions, {"tuning_batches": 128}, SECTION)
    with pytest.raises(ssu.ConfigError, match=r"tuning_batches=\[0, 8\] is not valid; give a list of positive"):
        build(ReplayOptions, {"tuning_batches": [0, 8]}, SECTION)
    monkeypatch.setenv("SSU_REPLAYSSM_TUNING_CACHE", str(tmp_path / "env.json"))
    assert ReplayOptions().tuning_cache_path() == tmp_path / "env.json"
    assert ReplayOptions(tuning_cache=str(tmp_path / "t.json")).tuning_cache_path() == tmp_path / "t.json"
    monkeypatch.delenv("SSU_REPLAYSSM_TUNING_CACHE")
    assert ReplayOptions().tuning_cache_path().name == "flashinfer-replayssm-tuning.json"


def test_window_below_tokens_is_refused():
    verdict = plugin.ssu_supports(problem(tokens_per_step=4), ReplayOptions(max_window=3))
    assert not verdict.ok and "max_window=3 is below tokens_per_step=4" in verdict.reasons[0]


@pytest.mark.parametrize(
    "fields, why",
    [
        (dict(input_dtype="fp16"), "input dtype fp16 not supported"),
        (dict(headdim=80), "headdim=80 not supported"),
        (dict(dstate=96), "dstate=96 not supported"),
        (dict(tokens_per_step=17), "exceeds the maximum 16"),
    ],
)
def test_problems_outside_the_build_are_refused_with_the_reason(emulated, fields, why):
    with pytest.raises(ssu.SSUError, match=why):
        ssu.open(ssu.Config(backend=NAME), problem(**fields), registry=emulated)


def test_named_backend_on_cpu_is_refused_with_reason():
    with pytest.raises(ssu.BackendUnavailableError, match="FlashInfer runs on CUDA devices only"):
        ssu.open(ssu.Config(backend="flashinfer-replayssm"), problem())


# the call -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("with_options", [True, False])
def test_arguments_match_the_real_signature_and_stride_rules(tokens, with_options, gen):
    from flashinfer.mamba import checkpointing_ssu

    p = problem(tokens_per_step=tokens)
    options = ReplayOptions(max_window=6)
    state = layout.allocate(p, 2, options.ring_length(tokens), "x")
    slots = pick_slots(p, 3, gen, pad_rows=1)
    scratch = translate.allocate_scratch(p, options)
    rows = translate.cache_rows(scratch, p, slots, faults.allocate("cpu"))
    assert rows.tolist()[-1] == p.num_slots and rows.tolist()[:2] == slots.tolist()[:2]
    inputs = step_inputs(attrs_evolve(p, speculative=True), slots, gen, tokens=tokens, with_z=with_options)
    D = inputs.D if with_options else scratch["zero_D"]
    fake_trio = (torch.empty(4, 4, 32, 8), torch.empty(4, 4, 16), torch.empty(4, 4, 32, 4))
    kwargs = translate.cs_arguments(
        p,
        options,
        state.buffers,
        1,
        inputs.x,
        inputs.dt,
        inputs.A,
        inputs.B,
        inputs.C,
        D,
        inputs.z,
        inputs.dt_bias if with_options else None,
        True,
        torch.empty_like(inputs.x),
        rows,
        fake_trio,
    )
    inspect.signature(checkpointing_ssu).bind(**kwargs)  # raises TypeError on a renamed or removed argument
    H, P, N, S1 = p.nheads, p.headdim, p.dstate, p.num_slots + 1
    assert kwargs["A"].shape == (H, P, N) and kwargs["A"].stride() == (1, 0, 0)
    assert kwargs["D"].shape == (H, P) and kwargs["D"].stride() == (1, 0) and kwargs["D"].dtype == torch.float32
    assert kwargs["dt"].shape == inputs.x.shape and kwargs["dt"].stride()[-2:] == (1, 0)
    assert kwargs["state"].shape == (S1, H, P, N) and kwargs["state"].stride()[1:] == (P * N, N, 1)
    assert kwargs["x_cache"].shape == (S1, H, options.max_window + tokens, P)
    assert kwargs["ring_start"].shape == (S1,) and kwargs["prev_num_accepted_tokens"].shape == (S1,)
    assert kwargs["cb_scaled"].shape[0] == 3 and kwargs["algorithm"] == "auto"
    assert kwargs["x_cache"].data_ptr() == state.buffers["x_cache"][1].data_ptr()


def attrs_evolve(p, **changes):
    import attrs

    return attrs.evolve(p, **changes)


@pytest.mark.parametrize("triton_rows", [True, False])
def test_cache_rows_are_reused_until_commit(triton_rows, gen):
    p = problem()
    scratch = translate.allocate_scratch(p, ReplayOptions())
    scratch["triton_rows"] = triton_rows
    slots = torch.tensor([3, -1, 5], dtype=torch.int32)
    record = faults.allocate("cpu")
    first = translate.cache_rows(scratch, p, slots, record)
    assert first.tolist() == [3, p.num_slots, 5]
    assert translate.cache_rows(scratch, p, slots, record).data_ptr() == first.data_ptr()
    scratch["rows_for"] = None
    slots[0] = 4
    assert translate.cache_rows(scratch, p, slots, record).tolist() == [4, p.num_slots, 5]
    assert int(record) == faults.NO_FAULT


# the whole backend on the emulated kernel -----------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    state_dtype=st.sampled_from(["fp32", "bf16", "fp16"]),
    tokens=st.integers(1, 3),
    extra=st.integers(0, 3),
    layers=st.integers(1, 2),
    groups=st.sampled_from([1, 2]),
    pad=st.integers(0, 1),
    index=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_long_decodes_match_the_reference(emulated, state_dtype, tokens, extra, layers, groups, pad, index, seed):
    """Steps with random acceptance across many flushes: outputs and read_state against the
    reference at every step, every other slot's buffers bit-identical."""
    p = problem(state_dtype=state_dtype, tokens_per_step=tokens, ngroups=groups)
    gen = torch.Generator().manual_seed(seed)
    compare_with_reference(
        NAME,
        p,
        gen,
        steps=3 * (tokens + extra) + 2,
        batch=3,
        pad=pad,
        index_dtype=index,
        layers=layers,
        backend_options={"max_window": tokens + extra},
        registry=emulated,
    )


def test_conformance_suite_passes_on_the_emulated_kernel(emulated):
    results = run_conformance(NAME, device="cpu", registry=emulated, options={"max_window": 4}, profile="quick")
    failed = [f"{r.check}: {r.failure}" for r in results if r.status == "fail"]
    assert results and not failed, "\n".join(failed)
    passed = {r.check for r in results if r.status == "pass"}
    assert {"step", "decode", "guarded-ids", "partial-commit"} <= passed
    assert {r.check for r in results if r.status == "skip"} == {
        "cuda-graph",
        "destinations",
        "adopted",
        "packed-calls",
        "verify-calls",
    }
    step = next(r for r in results if r.check == "step")
    assert step.refused  # tokens beyond max_window = 4 are turned down by ssu_supports, not failed


def _open(emulated, p, **options):
    return ssu.open(ssu.Config(backend=NAME, backends={NAME: options}), p, registry=emulated)


def test_explicit_commit_without_speculation(emulated, gen):
    """commit_on_last_layer = false: the step leaves the cursors, kernel.commit(ones) moves them;
    with the default the step of the last layer commits and an explicit commit is refused."""
    p = problem(max_batch=3)
    ref = ssu.open(ssu.Config(backend="reference"), p, registry=emulated)
    for explicit in (True, False):
        kernel = _open(emulated, p, max_window=2, commit_on_last_layer=not explicit)
        state, rstate = kernel.allocate_state(2), ref.allocate_state(2)
        slots = pick_slots(p, 3, gen)
        weights = [layer_weights(p, gen) for _ in range(2)]
        for _ in range(5):
            for layer in range(2):
                inputs = step_inputs(p, slots, gen, weights=weights[layer]).kwargs()
                out = kernel.step(state, layer=layer, **inputs)
                want = ref.step(rstate, layer=layer, **inputs)
                assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2)
            pnat = state.buffers["pnat"].clone()
            ones = torch.ones(3, dtype=torch.int32)
            if explicit:
                kernel.commit(state, slots, ones)
                assert not torch.equal(pnat, state.buffers["pnat"])
            else:
                with pytest.raises(ssu.InputError, match="commit_on_last_layer = false"):
                    kernel.commit(state, slots, ones)
            for layer in range(2):
                got = kernel.read_state(state, slots.long(), layer)
                assert torch.allclose(got, ref.read_state(rstate, slots.long(), layer), rtol=1e-4, atol=1e-4)


def test_read_between_step_and_commit_is_the_old_state(emulated, gen):
    """A speculative step whose slots flush rewrites their checkpoints at once; until the commit
    read_state still returns the state before the step."""
    p = problem(tokens_per_step=2)
    kernel = _open(emulated, p, max_window=3)
    state = kernel.allocate_state(2)
    slots = pick_slots(p, 4, gen, pad_rows=1)
    real = slots[:3].long()
    weights = [layer_weights(p, gen) for _ in range(2)]
    flushed = False
    for _ in range(6):
        before = [kernel.read_state(state, real, layer) for layer in range(2)]
        flushing = bool((state.buffers["pnat"][real] + 2 > 3).any())
        for layer in range(2):
            kernel.step(state, layer=layer, **step_inputs(p, slots, gen, weights=weights[layer]).kwargs())
            for check in range(2):
                assert torch.allclose(kernel.read_state(state, real, check), before[check], rtol=1e-5, atol=1e-5)
        flushed |= flushing
        kernel.commit(state, slots, torch.tensor([2, 1, 2, 1], dtype=torch.int32))
    assert flushed


def test_write_state_folds_the_other_layers_and_resets_cursors(emulated, gen):
    p = problem(tokens_per_step=2)
    kernel = _open(emulated, p, max_window=6)
    state = kernel.allocate_state(2)
    slots = pick_slots(p, 3, gen)
    for layer in range(2):
        kernel.write_state(state, slots.long(), random_states(p, 3, gen), layer)
    weights = [layer_weights(p, gen) for _ in range(2)]
    for _ in range(2):
        for layer in range(2):
            kernel.step(state, layer=layer, **step_inputs(p, slots, gen, weights=weights[layer]).kwargs())
        kernel.commit(state, slots, torch.tensor([2, 1, 2], dtype=torch.int32))
    assert bool((state.buffers["pnat"][slots.long()] > 0).all())
    other = kernel.read_state(state, slots.long(), 1)
    values = random_states(p, 3, gen)
    kernel.write_state(state, slots.long(), values, 0)
    assert torch.equal(kernel.read_state(state, slots.long(), 0), values)
    assert torch.allclose(kernel.read_state(state, slots.long(), 1), other, rtol=1e-6, atol=1e-6)
    assert not state.buffers["pnat"][slots.long()].any() and not state.buffers["ring_start"][slots.long()].any()


def test_tokens_other_than_compiled_are_refused(emulated, gen):
    p = problem(tokens_per_step=3)
    kernel = _open(emulated, p, max_window=4)
    state = kernel.allocate_state(1)
    slots = pick_slots(p, 2, gen)
    with pytest.raises(ssu.InputError, match="exactly tokens_per_step=3"):
        kernel.step(state, **step_inputs(p, slots, gen, tokens=2).kwargs())


def test_tuning_file_entries_are_counted(tmp_path):
    """Warmup reports whether FlashInfer's tuning file really holds checkpointing_ssu results
    (on an H200 FlashInfer once left it unwritten), instead of claiming a save."""
    import json

    from ssu_backend_flashinfer_replayssm.warmup import saved_entries

    path = tmp_path / "tuning.json"
    assert saved_entries(path) == 0
    path.write_text("not json")
    assert saved_entries(path) == 0
    path.write_text(
        json.dumps(
            {
                "_metadata": {},
                "('checkpointing_ssu', 'CheckpointingSSURunner', ((8,),), ())": [
                    "CheckpointingSSURunner",
                    [1, 4, 16, 1],
                ],
                "('bf16_gemm', 'R', ((8,),), ())": ["R", 0],
            }
        )
    )
    assert saved_entries(path) == 1


def test_warmup_on_the_emulated_kernel_builds_and_leaves_the_state(emulated, gen, capsys):
    p = problem(tokens_per_step=2)
    kernel = _open(emulated, p, max_window=4)
    state = kernel.allocate_state(2)
    every = torch.arange(p.num_slots)
    for layer in range(2):
        kernel.write_state(state, every, random_states(p, p.num_slots, gen), layer)
    before = {name: buf.clone() for name, buf in state.buffers.items()}
    kernel.warmup(state)
    assert all(torch.equal(buf, before[name]) for name, buf in state.buffers.items())
    err = capsys.readouterr().err
    assert "loading or compiling" in err and "ready" in err and "no tuning on cpu" in err


def test_tactic_failures_are_captured_without_printing_flashinfer_debug_lines(capsys):
    """FlashInfer logs why a tactic failed to profile at debug level only; warmup collects those
    reasons (to quote the first) while its own handlers keep their level."""
    from flashinfer.jit.core import logger

    from ssu_backend_flashinfer_replayssm.warmup import tactic_failures

    level = logger.level
    logger.debug("cached as disabled")  # the logger caches its level answers
    with tactic_failures() as failures:
        logger.debug("[Autotuner]: Skipping tactic R (0, 0, 0, 1), due to failure while profiling: Ninja build failed")
        logger.debug("[Autotuner]: another debug line")
    assert failures == [
        "[Autotuner]: Skipping tactic R (0, 0, 0, 1), due to failure while profiling: Ninja build failed"
    ]
    assert "another debug line" not in capsys.readouterr().err
    assert logger.level == level and logger.isEnabledFor(logging.DEBUG) == (level <= logging.DEBUG)


@pytest.mark.parametrize("profiles", [False, True])
def test_tune_passes_the_tuning_batches_and_explains_its_outcome(monkeypatch, tmp_path, profiles):
    """``tune`` on a stand-in for FlashInfer's autotuner: the batches it profiles are
    ``tuning_batches`` up to ``max_batch``; a run in which every tactic fails says why (FlashInfer's
    first failure), one that profiles reports what it saved."""
    import contextlib
    import json
    import types

    import flashinfer
    from flashinfer.autotuner import AutoTuner
    from flashinfer.jit.core import logger

    from ssu_backend_flashinfer_replayssm import warmup

    cache = tmp_path / "tuning.json"
    seen = {}
    stats = AutoTuner.get().stats
    monkeypatch.setattr(stats, "tuned_op_successful_configs", dict(stats.tuned_op_successful_configs))

    def fake_call(ctx, batch, index_dtype, algorithm):
        seen["batch"] = batch

        def call():
            if profiles:
                stats.tuned_op_successful_configs[warmup.OP] = stats.tuned_op_successful_configs.get(warmup.OP, 0) + 1
                cache.write_text(json.dumps({f"('{warmup.OP}', 'R', ((8,),), ())": ["R", [0, 0, 0, 1]]}))
            else:
                logger.debug("[Autotuner]: Skipping tactic R (0, 0, 0, 1), due to failure while profiling: boom")

        return call

    @contextlib.contextmanager
    def fake_autotune(tune_mode, cache=None, tuning_buckets=None):
        seen["buckets"] = tuning_buckets
        yield

    monkeypatch.setattr(warmup, "private_call", fake_call)
    monkeypatch.setattr(warmup, "synchronize", lambda p: None)
    monkeypatch.setattr(flashinfer, "autotune", fake_autotune)
    ctx = types.SimpleNamespace(
        problem=types.SimpleNamespace(device_type="cuda", max_batch=16),
        options=ReplayOptions(tuning_batches=[8, 64], tuning_cache=str(cache)),
        memo={},
    )
    line = warmup.tune(ctx)
    assert seen == {"batch": 8, "buckets": (8,)}
    if profiles:
        assert ctx.memo["tuned"] is True and f"1 entry saved to {cache}" in line
    else:
        assert ctx.memo["tuned"] is False and "could not profile any checkpointing_ssu tactic for batches [8]" in line
        assert "failure while profiling: boom" in line


def test_traffic_counts_checkpoint_and_ring_bytes(emulated):
    """A flush folds the old tokens only: at window 4 and one token a step a row writes its
    checkpoint every fourth step and holds 2.5 ring tokens on average."""
    p = problem(nheads=4, headdim=32, dstate=64, ngroups=2)
    parts = _open(emulated, p, max_window=4).traffic(2)
    slot = 4 * 32 * 64 * 4
    token = 2 * (4 * 32 + 2 * 64) + 4 * 4
    assert parts["checkpoint read"] == 2 * slot and parts["checkpoint write"] == 2 * slot / 4
    assert parts["ring read"] == 2 * token * 2.5 and parts["ring write"] == 2 * token
