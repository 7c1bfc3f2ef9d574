"""The triton-replay backend against the reference on small problems (Triton's interpreter on the
CPU in CI; the real GPU when there is one): decodes long enough to flush several times, commits of
varying acceptance, pad rows, ring wrap-around, every flush window, adopted caches with sync,
destination slots, options and refusals."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.conformance import run_on
from ssu.checking.harness import compare_with_reference
from ssu.checking.inputs import step_inputs
from ssu_backend_triton import tuning
from ssu_backend_triton.replay import engine as replay_engine
from ssu_backend_triton.replay import layout as replay_layout
from ssu_backend_triton.replay import plans as replay_plans
from ssu_backend_triton.replay.launch import Plan

from triton_helpers import DEVICE, compiled_step_matches_reference

NAME = "triton-replay"


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


def compare(p, gen, backend_options=None, **kwargs):
    return compare_with_reference(NAME, p, gen, backend_options=backend_options, **kwargs)


def opened(p, **options):
    return ssu.open(ssu.Config(backend=NAME, backends={NAME: options}), p)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    H=st.sampled_from([2, 4]),
    G=st.sampled_from([1, 2]),
    P=st.sampled_from([4, 5, 8]),
    N=st.sampled_from([4, 12, 16]),
    state=st.sampled_from(["fp32", "bf16", "fp16"]),
    inp=st.sampled_from(["bf16", "fp16", "fp32"]),
    T=st.sampled_from([1, 1, 2, 3]),
    max_window=st.integers(3, 5),
    window=st.integers(0, 5),
    block_p=st.sampled_from([0, 2, 4]),
    tiles=st.integers(0, 2),
    stages=st.sampled_from([0, 2]),
    fold=st.sampled_from([0, 1, 2]),
    through=st.sampled_from(["triton", "replay"]),
    pad=st.integers(0, 1),
    options=st.booleans(),
    int64=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(
    H, G, P, N, state, inp, T, max_window, window, block_p, tiles, stages, fold, through, pad, options, int64, seed
):
    """Drawn shapes, dtypes, tokens, flush windows (0: every step, to the whole ring), launch
    shapes, the fold kernel (or none), the kernel of a table that writes through everywhere, pad
    rows and optional inputs, over a decode that flushes and wraps the ring."""
    gen = torch.Generator().manual_seed(seed)
    p = problem(
        nheads=H,
        ngroups=G,
        headdim=P,
        dstate=N,
        state_dtype=state,
        input_dtype=inp,
        tokens_per_step=T,
        speculative=T > 1,
        num_slots=6,
        max_batch=3,
    )
    pins = {"max_window": max_window, "window": min(window, max_window), "fold_heads": fold}
    pins["write_through_kernel"] = through
    if block_p:
        pins.update(block_p=block_p, num_warps=1, tiles_per_program=tiles, loop_stages=stages)
    compare(p, gen, pins, steps=7, pad=pad, options=options, index_dtype=torch.int64 if int64 else torch.int32)


@pytest.mark.parametrize(
    ("window", "fold", "state"),
    [
        pytest.param(0, 0, "bf16", marks=pytest.mark.slow),
        (3, 2, "fp32"),
        pytest.param(3, 1, "bf16", marks=pytest.mark.slow),
    ],
)
def test_speculative_decode_wraps_the_ring(window, fold, state, gen):
    """Two layers, T = 3 with commits of random acceptance over many steps: the ring's start goes
    round several times; the cursors of both layers move at each commit. With the fold kernel
    (``fold``: heads per program) the flushing rows are served by it: their rings folded, their
    outputs computed from the unrounded fold, their tokens appended; window 0 folds the accepted
    tokens at every step."""
    p = problem(tokens_per_step=3, speculative=True, state_dtype=state, headdim=6, dstate=12)
    options = {"max_window": 3, "window": window, "fold_heads": fold}
    kernel, state = compare(p, gen, options, steps=6, pad=1, layers=2)
    assert int(state.buffers["start"].max()) > 0  # the ring's start moved: flushes happened


@pytest.mark.parametrize(
    ("window", "fold"),
    [
        (0, 0),
        (0, 2),
        pytest.param(1, 0, marks=pytest.mark.slow),
        (1, 2),
        pytest.param(3, 0, marks=pytest.mark.slow),
        (3, 2),
    ],
)
def test_cursors_follow_the_flush_rule(window, fold, gen):
    """One-token steps: the ring count after each step is the rule's (append while count + 1 <=
    window, else fold everything), with the fold kernel or without, and every program of a row
    saw the same cursors."""
    p = problem()
    kernel = opened(p, max_window=3, window=window, fold_heads=fold)
    state = kernel.allocate_state()
    slots = torch.tensor([1, 5], dtype=torch.int32, device=DEVICE)
    count = 0
    for _ in range(7):
        kernel.step(state, **step_inputs(p, slots, gen).kwargs())
        count = count + 1 if count + 1 <= window else 0
        assert state.buffers["count"][0, slots.long()].tolist() == [count, count]
        assert state.buffers["ticket"].eq(0).all()
    assert state.buffers["count"][0, [0, 2, 3, 4, 6, 7]].eq(0).all()


@pytest.mark.slow
def test_buckets_with_and_without_a_window_share_slots(gen):
    """Batches of 16 (a bucket with window 3) leave tokens in the rings; batches of 2 (window 0:
    the write-every-step path) fold them first, then take the short path with empty rings. The
    outputs and logical states follow the reference throughout."""
    from ssu.checking.inputs import random_states
    from ssu.checking.oracle import rel_error, tolerances

    p = problem(max_batch=16, num_slots=20)
    kernel = opened(p, max_window=3)
    assert [kernel._ctx.memo["launcher"].table[b].window for b in (2, 16)] == [0, 3]
    ref = ssu.open(ssu.Config(backend="reference"), p)
    state, rstate = kernel.allocate_state(), ref.allocate_state()
    every = torch.arange(16, dtype=torch.int32, device=DEVICE)
    start = random_states(p, 16, gen)
    kernel.write_state(state, every, start)
    ref.write_state(rstate, every, start)
    out_tol, state_tol = tolerances(p)
    for batch in (16, 16, 2, 2, 16, 2, 2):
        inputs = step_inputs(p, every[:batch], gen).kwargs()
        out, expected = kernel.step(state, **inputs), ref.step(rstate, **inputs)
        assert rel_error(out, expected) <= out_tol
        assert rel_error(kernel.read_state(state, every), ref.read_state(rstate, every)) <= state_tol
    counts = state.buffers["count"][0, :16].tolist()
    assert counts[:2] == [0, 0] and set(counts[2:]) == {3}  # emptied by the window-0 steps; held


def _replay_launches(monkeypatch) -> list:
    """Record this backend's own step launches (the triton backend's are not recorded)."""
    seen = []
    original = replay_engine.launch

    def recording(*args, **kwargs):
        seen.append(args[-1])
        return original(*args, **kwargs)

    monkeypatch.setattr(replay_engine, "launch", recording)
    return seen


@pytest.mark.parametrize(("through", "adopt"), [("triton", False), ("triton", True), ("replay", False)])
def test_a_table_without_windows_runs_the_triton_kernel(through, adopt, monkeypatch, gen):
    """Window 0 in every bucket of a one-token problem: with ``write_through_kernel = "triton"``
    the steps are the triton backend's launches (its schedules; no ring is touched), with
    ``"replay"`` this backend's; both follow the reference, on allocated and adopted caches, with
    destinations, pad rows and pad id 0."""
    seen = _replay_launches(monkeypatch)
    p = problem(pad_slot_id=0)
    options = {"window": 0, "write_through_kernel": through}
    kernel, state = compare(p, gen, options, steps=3, pad=1, adopt=adopt, destinations=True)
    launcher = kernel._ctx.memo["launcher"]
    assert launcher.route[0] is (through == "triton")
    assert bool(seen) is (through == "replay")
    assert not state.record.ring_tokens
    assert state.buffers["count"].eq(0).all() and state.buffers["start"].eq(0).all()
    assert not opened(problem(tokens_per_step=2, speculative=True), window=2)._ctx.memo["launcher"].route[0]


@pytest.mark.slow
def test_rings_that_held_tokens_keep_the_replay_kernel(monkeypatch, gen):
    """A state stepped in a bucket with a window, then under a table that writes through
    everywhere: its rings may hold tokens, so this backend's kernel folds them (the reference
    agrees); a state that never held any takes the triton kernel."""
    from ssu.checking.inputs import random_states
    from ssu.checking.oracle import rel_error, tolerances

    seen = _replay_launches(monkeypatch)
    p = problem(max_batch=16, num_slots=20)
    kernel = opened(p, max_window=3)
    launcher = kernel._ctx.memo["launcher"]
    assert not launcher.route[0]
    ref = ssu.open(ssu.Config(backend="reference"), p)
    state, rstate, fresh = kernel.allocate_state(), ref.allocate_state(), kernel.allocate_state()
    every = torch.arange(16, dtype=torch.int32, device=DEVICE)
    start = random_states(p, 16, gen)
    kernel.write_state(state, every, start)
    ref.write_state(rstate, every, start)
    inputs = step_inputs(p, every, gen).kwargs()
    kernel.step(state, **inputs)
    ref.step(rstate, **inputs)
    assert state.record.ring_tokens and int(state.buffers["count"][0, :16].min()) == 1
    for bucket in tuning.buckets(p.max_batch):  # as warmup would leave it
        launcher.set_bucket(bucket, launcher.table[bucket]._replace(window=0))
    assert launcher.route[0]
    out_tol, state_tol = tolerances(p)
    seen.clear()
    inputs = step_inputs(p, every[:2], gen).kwargs()
    assert rel_error(kernel.step(state, **inputs), ref.step(rstate, **inputs)) <= out_tol
    assert rel_error(kernel.read_state(state, every), ref.read_state(rstate, every)) <= state_tol
    assert len(seen) == 1 and state.buffers["count"][0, :2].eq(0).all()
    kernel.step(fresh, **inputs)
    assert len(seen) == 1  # the fresh state went to the triton kernel


@pytest.mark.slow
def test_sync_of_every_slot_returns_a_state_to_the_triton_kernel(monkeypatch, gen):
    """An adopted state stepped in a bucket with a window, then under a table that writes through
    everywhere: a sync of some slots keeps this backend's kernel (other rings may hold tokens);
    a sync of every slot empties every ring, and the next step is the triton kernel's, in place on
    the engine's tensor, as the reference computes it."""
    from ssu.checking.inputs import random_states
    from ssu.checking.oracle import rel_error, tolerances

    seen = _replay_launches(monkeypatch)
    p = problem(max_batch=16, num_slots=20)
    kernel = opened(p, max_window=3)
    launcher = kernel._ctx.memo["launcher"]
    ref = ssu.open(ssu.Config(backend="reference"), p)
    every = torch.arange(16, dtype=torch.int32, device=DEVICE)
    cache = random_states(p, 20, gen).to(torch.float32)
    state, rstate = kernel.adopt_state(cache), ref.allocate_state()
    ref.write_state(rstate, torch.arange(20, dtype=torch.int32, device=DEVICE), cache)
    inputs = step_inputs(p, every, gen).kwargs()
    kernel.step(state, **inputs)
    ref.step(rstate, **inputs)
    for bucket in tuning.buckets(p.max_batch):
        launcher.set_bucket(bucket, launcher.table[bucket]._replace(window=0))
    kernel.sync(state, every[:4])
    assert state.record.ring_tokens
    kernel.sync(state)
    assert not state.record.ring_tokens and state.buffers["count"].eq(0).all()
    seen.clear()
    out_tol, state_tol = tolerances(p)
    inputs = step_inputs(p, every[:8], gen).kwargs()
    assert rel_error(kernel.step(state, **inputs), ref.step(rstate, **inputs)) <= out_tol
    assert not seen  # the triton backend's launch
    assert rel_error(cache[:16], ref.read_state(rstate, every)) <= state_tol


def test_tuning_a_table_without_windows_tunes_the_triton_schedules(monkeypatch):
    """Warmup of a table that already writes through everywhere tunes only the triton backend's
    schedules (so it never gains a window under a captured graph); with the window tuned, those
    schedules first (their times are the baseline), then the plans."""
    calls = []
    pinned = opened(problem(), window=0)._ctx.memo["launcher"]
    tuned = opened(problem(max_batch=16), tuning_cache="")._ctx.memo["launcher"]
    for launcher in (pinned, tuned):
        monkeypatch.setattr(launcher, "tune_plans", lambda log, baseline=None: calls.append(("plans", baseline)) or {})
        monkeypatch.setattr(launcher.write_through, "tune", lambda log: calls.append(("triton", None)) or {})
    pinned.tune(lambda _: None)
    assert calls == [("triton", None)]
    calls.clear()
    tuned.tune(lambda _: None)
    assert calls == [("triton", None), ("plans", tuned.write_through.tuned_us)]


@pytest.mark.parametrize("through_below", [32, 2])
def test_plans_with_a_window_are_timed_against_the_triton_kernel(through_below, monkeypatch):
    """Given the triton kernel's time per bucket, warmup times plans with a window only; a bucket
    where the triton kernel is faster writes through. All of them: the triton kernel serves every
    bucket and no write-every-step plan of this kernel is timed. Some: those buckets' own
    write-every-step plans are timed and the faster of them and the best windowed plan kept."""
    launcher = opened(problem(max_batch=16), max_window=3, tuning_cache="")._ctx.memo["launcher"]
    timed = []

    def fake_time(bucket, plans, log):
        timed.append((bucket, {q.window for q in plans}))
        return plans[0], (100.0 if plans[0].window else 50.0) * bucket

    monkeypatch.setattr(launcher, "time_plans", fake_time)
    buckets = tuning.buckets(16)
    baseline = {b: (1.0 if b < through_below else 1e9) for b in buckets}
    fresh = launcher.tune_plans(lambda _: None, baseline)
    assert {0} not in [w for b, w in timed if b >= through_below]
    windows = [launcher.table[b].window for b in buckets]
    assert windows == [0 if b < through_below else 3 for b in buckets]
    assert launcher.route[0] is (through_below > 16)
    zero_timed = sorted(b for b, w in timed if w == {0})
    assert zero_timed == ([] if through_below > 16 else [b for b in buckets if b < through_below])
    assert {k: v["plan"][4] for k, v in fresh.items()} == {launcher.cache_key(b): w for b, w in zip(buckets, windows)}


ODD_SIZES = sorted({*range(1, 66, 2), 9, 21, 100, 127, 129, 255, 257, 511, 513, 1000, 1023, 1025, 1099, 1100})


@pytest.mark.parametrize("regime", ["through-everywhere", "through-below-64", "windows-everywhere"])
def test_warmup_tunes_every_max_batch(regime, monkeypatch):
    """Warmup's tuning for every max_batch, odd ones and ones past a power of two included: the top
    bucket is larger than max_batch, and the table, the cache entries and the route must all take
    that bucket's plan from the rows it serves. Timing is faked (the triton kernel's schedules and
    this kernel's plans), so the walk is the bookkeeping alone."""

    def fake_schedules(problem, bucket, run, configs, iterations, log, **kwargs):
        return configs[0], 10.0 * bucket

    def fake_plans(bucket, plans, log):
        windowed = regime == "windows-everywhere" or (regime == "through-below-64" and bucket >= 64)
        return plans[-1], (1.0 if windowed else 1e6) * bucket

    monkeypatch.setattr(tuning, "tune_bucket", fake_schedules)
    for max_batch in ODD_SIZES:
        launcher = opened(problem(max_batch=max_batch, num_slots=max_batch + 1), tuning_cache="")._ctx.memo["launcher"]
        monkeypatch.setattr(launcher, "time_plans", fake_plans)
        fresh = launcher.tune(lambda _: None)
        top = tuning.buckets(max_batch)[-1]
        assert len(fresh) >= len(tuning.buckets(max_batch)), max_batch
        assert all(plan is not None for plan in launcher.table[1:]), max_batch
        # below batch 16 the default plans write through and no window is tried
        through = top < 16 or regime == "through-everywhere" or (regime == "through-below-64" and top < 64)
        assert launcher.route[0] is through, max_batch
        if not through:  # the top bucket's window, in the row of max_batch
            assert launcher.table[max_batch].window == launcher.options.max_window, max_batch


def test_commit_moves_counts_and_copies_no_state(gen):
    p = problem(tokens_per_step=3, speculative=True)
    kernel = opened(p, max_window=5)
    state = kernel.allocate_state(num_layers=2)
    slots = torch.tensor([1, 4], dtype=torch.int32, device=DEVICE)
    for layer in range(2):
        kernel.step(state, layer=layer, **step_inputs(p, slots, gen).kwargs())
    before = {k: v.clone() for k, v in state.buffers.items()}
    kernel.commit(state, slots, torch.tensor([3, 1], dtype=torch.int32, device=DEVICE))
    for name, value in state.buffers.items():
        if name != "count":
            assert torch.equal(value, before[name]), name
    assert state.buffers["count"][:, [1, 4]].tolist() == [[3, 1], [3, 1]]


@pytest.mark.parametrize("T", [1, 3])
def test_the_gram_kernel_writes_each_rows_products_and_appends_B(T, gen):
    """Before the step kernel, the gram kernel leaves each batch row's B . C products over the ring's
    positions and the step's tokens in the layer's own scratch, and appends the step's B rows."""
    p = problem(tokens_per_step=T, speculative=T > 1)
    kernel = opened(p, max_window=4, window=4)
    state = kernel.allocate_state(num_layers=2)
    grams = [v.gram for v in state.views]
    assert grams[0].data_ptr() != grams[1].data_ptr()
    assert "gram" not in state.buffers  # indexed by batch row, not slot
    slots = torch.tensor([5, 2, 7], dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second step finds tokens in the rings
        views = state.views[1]
        start, count = views.start[slots.long()].clone(), views.count[slots.long()].clone()
        ring_B = views.B_ring[slots.long()].float().clone()
        inputs = step_inputs(p, slots, gen)
        for layer in (0, 1):
            kernel.step(state, layer=layer, **inputs.kwargs())
        if T > 1:
            kernel.commit(state, slots, torch.full((3,), T, dtype=torch.int32, device=DEVICE))
        B, C = inputs.B.float(), inputs.C.float()
        if T == 1:
            B, C = B[:, None], C[:, None]
        L = views.B_ring.shape[-2]
        for row in range(3):
            k, s0 = int(count[row]), int(start[row])
            rows = [ring_B[row, :, (s0 + j) % L] for j in range(k)] + [B[row, t] for t in range(T)]
            # (G, positions, tokens): per group, each position's B row against each token's C
            expected = torch.stack([torch.stack([(b * C[row, t]).sum(-1) for t in range(T)], -1) for b in rows], -2)
            torch.testing.assert_close(grams[1][row, :, : k + T, :T], expected, rtol=1e-5, atol=1e-5)
            for t in range(T):  # the step's B rows joined the ring after its tokens
                ring_row = views.B_ring[int(slots[row]), :, (s0 + k + t) % L].float()
                torch.testing.assert_close(ring_row, B[row, t])


@pytest.mark.parametrize("state", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(
    ("T", "window", "fold", "adopt"),
    [
        (1, 3, 0, True),
        pytest.param(2, 3, 1, False, marks=pytest.mark.slow),
        pytest.param(1, 3, 1, False, marks=pytest.mark.slow),
        pytest.param(1, 0, 0, False, marks=pytest.mark.slow),  # the triton kernel serves every bucket
        pytest.param(2, 0, 0, True, marks=pytest.mark.slow),
    ],
)
def test_8_bit_checkpoints_with_row_scales(state, T, window, fold, adopt, gen):
    """An 8-bit checkpoint, dequantised with its row scales where read and quantised with fresh ones
    at each flush (in the step kernel, the fold kernel or the triton backend's kernel), allocated
    and adopted, over a decode that flushes and wraps the ring; pad rows and every slot outside the
    batch untouched, scales included."""
    p = problem(state_dtype=state, tokens_per_step=T, speculative=T > 1, num_slots=10, engine_state=adopt)
    options = dict(max_window=3, window=window, fold_heads=fold)
    compare(p, gen, backend_options=options, steps=6, pad=1, adopt=adopt)


@pytest.mark.parametrize(
    ("options", "checks"),
    [
        (dict(max_window=1), ("step",)),
        # no decode here: the kit's batches stay below 16, where this plan writes through, and the
        # 8-bit decodes that write through (one-token and speculative) are compared value by value in
        # test_8_bit_checkpoints_with_row_scales; the fold-kernel case runs the kit's decode with a window
        pytest.param(dict(max_window=3), ("step", "destinations", "adopted"), marks=pytest.mark.slow),
        pytest.param(
            dict(max_window=3, window=3, fold_heads=1), ("step", "decode"), marks=pytest.mark.slow, id="fold-kernel"
        ),
    ],
)
def test_8_bit_checkpoints_pass_the_kit_value_by_value(options, checks):
    """The conformance kit narrowed to 8-bit states: every value within half a step of its row's
    scale (for a speculative step, of the larger of its rows before and after the step); with a
    window of 1 a one-token step flushes every other step, and the decodes flush repeatedly."""
    from ssu.testing import assert_conformant

    assert_conformant(
        NAME,
        checks=checks,
        profile="smoke",
        max_examples=3,
        device=DEVICE,
        options=options,
        state_dtypes=["int8", "fp8_e4m3"],
    )


@pytest.mark.parametrize(
    ("pad_id", "T", "fold"),
    [
        pytest.param(-1, 1, 0, marks=pytest.mark.slow),
        pytest.param(0, 1, 1, marks=pytest.mark.slow),
        pytest.param(-1, 2, 0, marks=pytest.mark.slow),
        pytest.param(0, 2, 0, marks=pytest.mark.slow),
    ],
)
def test_adopted_caches_sync_and_destinations(pad_id, T, fold, gen):
    """An engine's cache (a view with a 2x slot stride) as the checkpoints: read_state exact after
    every step, the engine's tensor current after sync, destination slots (folded by the step
    kernel, or by the fold kernel), a null block as pad id."""
    p = problem(
        tokens_per_step=T, speculative=T > 1, engine_state=True, pad_slot_id=pad_id, num_slots=12, state_dtype="bf16"
    )
    compare(p, gen, {"max_window": 3, "fold_heads": fold}, steps=6, pad=1, layers=2, adopt=True, destinations=T == 1)


def test_sync_folds_the_ring_into_the_engine_tensor(gen):
    p = problem(engine_state=True)
    kernel = opened(p, max_window=4, window=4)
    assert kernel.needs_sync
    cache = torch.randn(p.num_slots, p.nheads, p.headdim, p.dstate, device=DEVICE)
    state = kernel.adopt_state(cache)
    slots = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        kernel.step(state, **step_inputs(p, slots, gen).kwargs())
    logical = kernel.read_state(state, slots.long())
    assert not torch.allclose(cache[slots.long()], logical)  # the ring holds three tokens
    kernel.sync(state, slots)
    assert torch.equal(cache[slots.long()], logical) and state.buffers["count"].eq(0).all()
    assert torch.equal(kernel.read_state(state, slots.long()), logical)


def test_stochastic_rounding_fp16(gen):
    compare(problem(state_dtype="fp16"), gen, {"stochastic_rounding": True, "philox_rounds": 7, "window": 0}, steps=3)


@pytest.mark.parametrize(
    "check", ["roundtrip", "warmup", "bad-inputs", "guarded-ids", "destinations", "adopted", "partial-commit"]
)
@pytest.mark.parametrize("T", [1, 2])
def test_conformance_checks(check, T, gen):
    """The conformance kit's checks on a small problem; each reports pass, or skips with a reason."""
    p = problem(tokens_per_step=T, speculative=T > 1, num_slots=12, engine_state=check == "adopted")
    try:
        run_on(opened(p, max_window=3), check, gen)
    except ssu.conformance.CheckSkipped:
        pass


def test_options_refusals_and_explain():
    with pytest.raises(ssu.BackendUnavailableError, match="max_window=2 is below tokens_per_step=3"):
        opened(problem(tokens_per_step=3, speculative=True), max_window=2)
    with pytest.raises(ssu.BackendUnavailableError, match="window=5 exceeds max_window=4"):
        opened(problem(), max_window=4, window=5)
    with pytest.raises(ssu.BackendUnavailableError, match="stochastic_rounding applies to an fp16"):
        opened(problem(), stochastic_rounding=True)
    with pytest.raises(ssu.BackendUnavailableError, match="dstate=512 exceeds 256"):
        opened(problem(dstate=512))
    with pytest.raises(ssu.ConfigError, match="max_window=17 is out of range"):
        opened(problem(), max_window=17)
    kernel = opened(problem(nheads=128, headdim=64, dstate=128, ngroups=8))
    # 16 rows of x (128 x 64 bf16), B (8 x 128 bf16), d and A d (2 x 128 fp32), three cursors
    assert "ring of 16 tokens: 0.30 MiB per slot and layer beside a 4.00 MiB state (+7.4 %)" in kernel.explain()


def test_default_plans_and_cached_plans():
    p = problem(nheads=128, headdim=64, dstate=128, ngroups=8, max_batch=256, device="cpu")
    options = opened(problem()).options
    assert replay_plans.default_plan(p, options, 8).window == 0
    assert replay_plans.default_plan(p, options, 64).window == options.max_window
    assert replay_plans.default_plan(p, options, 64).block_p * 128 == 1024
    cached = {"k": {"plan": [8, 2, 1, 0, 15, 1, 4, 0]}}
    assert replay_plans.cached_plan(cached, "k") == Plan(8, 2, 1, 0, 15, 1, 4, 0)
    old = {"k": {"plan": [8, 2, 1, 0, 15, 1, 4]}}  # a plan of fewer fields is tuned again
    for bad in (old, {"k": {"plan": [8, 2, 1, 0, -1, 0, 0, 0]}}, {"k": "x"}, {}):
        assert replay_plans.cached_plan(bad, "k") is None
    key = replay_plans.plan_cache_key(p, options, 64, "H200", "3.6.0")
    assert "replay v14 W15" in key and "batch 64" in key and "|T1|" in key
    pinned = replay_plans.plan_cache_key(p, attrs.evolve(options, block_p=8), 64, "H200", "3.6.0")
    assert pinned != key and "pin 8:0:0:0" in pinned
    assert len(replay_plans.candidate_shapes(p)) >= 4
    assert replay_plans.default_plan(p, options, 64).fold == 0


def test_fold_kernel_choices():
    """The fold kernel is timed with heads per program that divide the heads of a group, for
    one-token and speculative steps over any checkpoint dtype; the ``fold_heads`` option fixes or
    forbids it."""
    options = opened(problem()).options
    p = problem(nheads=128, headdim=64, dstate=128, ngroups=8, device="cpu")
    assert replay_plans.fold_heads_choices(p, options) == [1, 4, 16]
    assert replay_plans.fold_heads_choices(problem(nheads=24, ngroups=1, device="cpu"), options) == [1, 4, 12]
    spec = problem(tokens_per_step=2, speculative=True, device="cpu")
    assert replay_plans.fold_heads_choices(spec, options) == [1, 2]
    assert replay_plans.fold_heads_choices(attrs.evolve(spec, state_dtype="bf16"), options) == [1, 2]
    pinned = opened(problem(tokens_per_step=2, speculative=True, state_dtype="bf16"), fold_heads=2)
    assert pinned._ctx.memo["launcher"].table[1].fold == 2
    assert replay_plans.fold_heads_choices(p, attrs.evolve(options, fold_heads=0)) == []
    assert replay_plans.fold_heads_choices(p, attrs.evolve(options, fold_heads=2)) == [2]
    plans = replay_plans.fold_plans(p, options, Plan(8, 1, 8, 4, 0, 1), [0, 15])
    assert plans == [Plan(8, 1, 8, 4, 15, 1, h) for h in (1, 4, 16)]
    assert replay_plans.fold_plans(p, options, Plan(8, 1, 8, 4, 0, 1, 0, 1), [15])[0].stepwise == 0


def test_stepwise_plans_are_timed_for_speculative_window_0():
    """Warmup times each window-0 plan of a speculative problem again with stepwise outputs, unless
    the ``stepwise`` option fixes it; one-token problems and plans with a window get none."""
    options = opened(problem()).options
    spec = problem(nheads=128, headdim=64, dstate=128, ngroups=8, tokens_per_step=4, speculative=True, device="cpu")
    plans = [Plan(8, 1, 8, 4, 0, 1), Plan(8, 1, 8, 4, 15, 1), Plan(16, 4, 1, 0, 0, 1)]
    assert replay_plans.stepwise_plans(spec, options, plans) == [
        Plan(8, 1, 8, 4, 0, 1, 0, 1),
        Plan(16, 4, 1, 0, 0, 1, 0, 1),
    ]
    for fixed in (0, 1):
        assert replay_plans.stepwise_plans(spec, attrs.evolve(options, stepwise=fixed), plans) == []
    one = problem(nheads=128, headdim=64, dstate=128, ngroups=8, device="cpu")
    assert replay_plans.stepwise_plans(one, options, plans) == []
    pinned = opened(problem(tokens_per_step=2, speculative=True), window=0, stepwise=1)
    assert pinned._ctx.memo["launcher"].table[1].stepwise == 1
    with pytest.raises(ssu.ConfigError, match="stepwise"):
        opened(problem(), stepwise=2)


@pytest.mark.parametrize(
    ("state", "adopt", "window"),
    [
        ("fp32", False, 0),
        pytest.param("bf16", True, 0, marks=pytest.mark.slow),
        pytest.param("int8", False, 0, marks=pytest.mark.slow),
        pytest.param("fp32", False, 2, marks=pytest.mark.slow),
    ],
)
def test_stepwise_speculative_steps_match_reference(state, adopt, window, gen):
    """Speculative steps whose outputs come from applying each token to the tile in turn (no gram
    kernel): allocated and adopted checkpoints, 8-bit ones with their scales, commits of random
    acceptance over two layers, pad rows untouched. With a window the plan ignores ``stepwise``."""
    p = problem(
        tokens_per_step=3, speculative=True, state_dtype=state, headdim=6, dstate=12, num_slots=10, engine_state=adopt
    )
    options = {"max_window": 3, "window": window, "fold_heads": 0, "stepwise": 1}
    compare(p, gen, options, steps=6, pad=1, layers=2, adopt=adopt)


def test_stepwise_steps_fold_rings_longer_than_the_step(gen):
    """A slot whose ring holds more tokens than one step (left by a bucket with a window) is folded
    whole by a stepwise step of window 0: outputs and states match the reference's throughout."""
    p = problem(tokens_per_step=2, speculative=True, num_slots=8, max_batch=4)
    kernel = opened(p, max_window=3, fold_heads=0, stepwise=1)
    table = kernel._ctx.memo["launcher"].table
    table[1] = table[1]._replace(window=3)  # batch 1 leaves tokens in the ring
    table[2] = table[2]._replace(window=0, stepwise=1)
    ref = ssu.open(ssu.Config(backend="reference"), p)
    state, ref_state = kernel.allocate_state(), ref.allocate_state()
    every = torch.arange(p.num_slots, dtype=torch.int32, device=DEVICE)
    start = torch.randn(p.num_slots, p.nheads, p.headdim, p.dstate, generator=gen).to(DEVICE)
    kernel.write_state(state, every, start)
    ref.write_state(ref_state, every, start)
    one, two = (torch.tensor(s, dtype=torch.int32, device=DEVICE) for s in ([3], [3, 5]))
    counts = []
    for slots, accepted in ((one, 1), (one, 2), (two, 2), (two, 1), (two, 2)):
        inputs = step_inputs(p, slots, gen)
        taken = torch.full((len(slots),), accepted, dtype=torch.int32, device=DEVICE)
        out, ref_out = kernel.step(state, **inputs.kwargs()), ref.step(ref_state, **inputs.kwargs())
        kernel.commit(state, slots, taken)
        ref.commit(ref_state, slots, taken)
        counts.append(int(state.buffers["count"][0, 3]))
        torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(
            kernel.read_state(state, every), ref.read_state(ref_state, every), atol=1e-4, rtol=1e-4
        )
    # a ring of 3 tokens (more than T) folded by the stepwise step, which keeps only its accepted ones
    assert counts == [1, 3, 2, 1, 2]


def test_every_timed_plan_starts_from_the_same_staggered_cursors(monkeypatch):
    """Warmup times each plan from the same random cursors, counts within the plan's window: a
    plan that flushes every step (window 0) empties every ring, and a plan timed after it would
    otherwise flush no row and look cheap."""
    import ssu.measure.timing

    launcher = opened(problem(max_batch=2))._ctx.memo["launcher"]
    seen = []

    def run_once(launches, **_):
        for fn in launches:
            fn()
        return float(len(seen))

    def recording(state, plan, *args, **kwargs):
        seen.append((plan, state.buffers["count"].clone()))
        original(state, plan, *args, **kwargs)

    original = launcher.run_scratch
    monkeypatch.setattr(ssu.measure.timing, "graph_time_us", run_once)
    monkeypatch.setattr(tuning, "COLD_BYTES", 1)  # one slot set: one launch per plan
    monkeypatch.setattr(launcher, "run_scratch", recording)
    plans = [Plan(4, 1, 1, 0, 0, 0), Plan(4, 1, 1, 0, 3, 0), Plan(4, 1, 1, 0, 3, 0)]
    launcher.time_plans(2, plans, log=lambda _: None)
    firsts = [next(c for q, c in seen if q is plan) for plan in plans]
    assert int(firsts[0].max()) == 0  # window 0: the steady state holds no ring tokens
    assert 0 < int(firsts[1].max()) <= 3  # staggered within the window, not empty rings
    assert torch.equal(firsts[1], firsts[2])


def test_warmup_commits_realistic_acceptance(monkeypatch):
    """A speculative plan is timed with step and commit, the commit accepting what ``ssu bench``'s
    does (1 + a run of drafts kept with probability 0.7), not one token a step: a ring fills and
    flushes at the pace of the accepted tokens. Every plan sees the same counts."""
    import ssu.measure.timing

    launcher = opened(problem(max_batch=16, num_slots=16, tokens_per_step=4, speculative=True))._ctx.memo["launcher"]
    seen = []

    def run_once(launches, **_):
        for fn in launches:
            fn()
        return 1.0

    monkeypatch.setattr(ssu.measure.timing, "graph_time_us", run_once)
    monkeypatch.setattr(tuning, "COLD_BYTES", 1)  # one slot set: one launch per plan
    monkeypatch.setattr(replay_engine, "commit", lambda count, slots, accepted, *a, **k: seen.append(accepted.clone()))
    launcher.time_plans(16, [Plan(4, 1, 1, 0, 3, 0), Plan(4, 1, 1, 0, 0, 0)], log=lambda _: None)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert 1 <= int(seen[0].min()) and int(seen[0].max()) <= 4 and float(seen[0].float().mean()) > 1.5


def test_window_option_pins_every_bucket():
    p = problem(max_batch=64)
    kernel = opened(p, window=2, fold_heads=4)
    table = kernel._ctx.memo["launcher"].table
    assert {plan.window for plan in table[1:]} == {2}
    assert {plan.fold for plan in table[1:]} == {4}
    parts = kernel.traffic(64)  # the bucket's window: a checkpoint write every third step
    assert parts["checkpoint write"] == parts["checkpoint read"] / 3
    assert parts["ring read"] == 64 * replay_layout.token_bytes(p) * 1.0


def test_torch_compile_custom_op(gen):
    """The step inside torch.compile goes through torch.ops.ssu_triton.replay_step."""
    kernel, state, slots = compiled_step_matches_reference(NAME, problem(), gen, {"window": 3})
    assert int(state.buffers["count"][0, slots.long()].min()) == 1  # the token went into the ring


def test_dropin_refuses_a_backend_that_needs_sync():
    ssu.dropin.clear()
    p = problem()
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(p.num_slots, p.nheads, p.headdim, p.dstate, device=DEVICE)
    i = step_inputs(p, torch.arange(2, dtype=torch.int32, device=DEVICE), gen)
    with pytest.raises(ssu.BackendError, match="keeps state beside the engine's cache"):
        ssu.selective_state_update(cache, i.x, i.dt, i.A, i.B, i.C, config=ssu.Config(backend=NAME))
    ssu.dropin.clear()
