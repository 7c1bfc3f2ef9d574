"""The oracle against the written math, and the reference backend against the oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssu
from ssu.checking import oracle
from ssu.contract.dtypes import to_torch
from ssu.checking.inputs import layer_weights, pick_slots, random_states, step_inputs

from fakes import small_problem


def scalar_math(state, x, dt, A, B, C, D, z, dt_bias, softplus):
    """docs/spec.md's equations element by element, in Python floats (one sequence, T tokens)."""
    T, H, P = len(x), len(x[0]), len(x[0][0])
    G, N = len(B[0]), len(B[0][0])
    s = [[[state[h][p][n] for n in range(N)] for p in range(P)] for h in range(H)]
    outs = []
    for t in range(T):
        out_t = []
        for h in range(H):
            g = h // (H // G)
            d = dt[t][h] + (dt_bias[h] if dt_bias is not None else 0.0)
            if softplus:
                d = d if d > 20 else math.log1p(math.exp(d))
            dA = math.exp(A[h] * d)
            row = []
            for p in range(P):
                acc = 0.0
                for n in range(N):
                    s[h][p][n] = s[h][p][n] * dA + d * x[t][h][p] * B[t][g][n]
                    acc += s[h][p][n] * C[t][g][n]
                y = acc + (D[h] * x[t][h][p] if D is not None else 0.0)
                if z is not None:
                    zz = z[t][h][p]
                    y = y * zz / (1 + math.exp(-zz))
                row.append(y)
            out_t.append(row)
        outs.append(out_t)
    return s, outs


@settings(max_examples=25, deadline=None)
@given(
    H=st.sampled_from([2, 4, 6]),
    G=st.sampled_from([1, 2]),
    P=st.integers(1, 3),
    N=st.integers(1, 4),
    T=st.integers(1, 3),
    options=st.booleans(),
    softplus=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_oracle_matches_the_written_math(H, G, P, N, T, options, softplus, seed):
    g = torch.Generator().manual_seed(seed)
    f = torch.float64
    state = torch.randn(1, H, P, N, generator=g, dtype=f)
    x = torch.randn(1, T, H, P, generator=g, dtype=f)
    dt = torch.randn(1, T, H, generator=g, dtype=f) * (10 if softplus else 0.3)
    A = -torch.rand(H, generator=g, dtype=f) * 4
    B = torch.randn(1, T, G, N, generator=g, dtype=f)
    C = torch.randn(1, T, G, N, generator=g, dtype=f)
    D = torch.randn(H, generator=g, dtype=f) if options else None
    z = torch.randn(1, T, H, P, generator=g, dtype=f) if options else None
    dt_bias = torch.randn(H, generator=g, dtype=f) if options else None
    if not softplus:
        dt = dt.abs()
    states, outs = oracle.ssu_math64(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus)
    s_ref, out_ref = scalar_math(
        state[0].tolist(),
        x[0].tolist(),
        dt[0].tolist(),
        A.tolist(),
        B[0].tolist(),
        C[0].tolist(),
        None if D is None else D.tolist(),
        None if z is None else z[0].tolist(),
        None if dt_bias is None else dt_bias.tolist(),
        softplus,
    )
    assert torch.allclose(states[0, -1], torch.tensor(s_ref, dtype=f), rtol=1e-12, atol=1e-12)
    assert torch.allclose(outs[0], torch.tensor(out_ref, dtype=f), rtol=1e-12, atol=1e-12)


def test_softplus_threshold():
    v = torch.tensor([-30.0, 0.0, 19.0, 20.0, 20.5, 50.0], dtype=torch.float64)
    got = oracle.softplus64(v)
    assert got[-1] == 50.0 and got[-2] == 20.5 and got[3] == pytest.approx(math.log1p(math.exp(20.0)))
    assert got[1] == pytest.approx(math.log(2.0))


problems = st.builds(
    lambda H, G, P, N, state, inp, T, slots: small_problem(
        nheads=H,
        ngroups=G,
        headdim=P,
        dstate=N,
        state_dtype=state,
        input_dtype=inp,
        num_slots=slots,
        max_batch=min(slots, 5),
        tokens_per_step=T,
        speculative=T > 1,
    ),
    H=st.sampled_from([2, 4, 8]),
    G=st.sampled_from([1, 2]),
    P=st.sampled_from([1, 5, 8]),
    N=st.sampled_from([1, 3, 16]),
    state=st.sampled_from(["fp32", "bf16", "fp16"]),
    inp=st.sampled_from(["fp32", "bf16", "fp16"]),
    T=st.integers(1, 4),
    slots=st.integers(2, 9),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    problem=problems,
    pad=st.integers(0, 2),
    options=st.booleans(),
    int64=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_reference_backend_matches_oracle(problem, pad, options, int64, seed, data):
    p = problem
    g = torch.Generator().manual_seed(seed)
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state(num_layers=2)
    every = torch.arange(p.num_slots)
    for layer in range(2):
        kernel.write_state(state, every, random_states(p, p.num_slots, g), layer)
    before = [kernel.read_state(state, every, layer) for layer in range(2)]
    b = data.draw(st.integers(1, p.max_batch))
    pad = min(pad, b - 1)
    slots = pick_slots(p, b, g, pad_rows=pad, index_dtype=torch.int64 if int64 else torch.int32)
    T = data.draw(st.integers(1, p.tokens_per_step))
    inputs = step_inputs(
        p,
        slots,
        g,
        tokens=T,
        weights=layer_weights(p, g, with_D=options, with_dt_bias=options),
        with_z=options,
        dt_softplus=options,
    )
    real = slots[: b - pad].long()
    start = torch.zeros(b, p.nheads, p.headdim, p.dstate)
    start[: b - pad] = before[1][real]
    states, outs = oracle.step_math64(p, start, inputs)
    out = kernel.step(state, layer=1, **inputs.kwargs())
    out_tol, state_tol = oracle.tolerances(p, T)
    assert oracle.rel_error(oracle.with_token_axis(p, out), outs) <= out_tol
    if p.speculative:
        assert torch.equal(kernel.read_state(state, every, 1), before[1])  # provisional until commit
        kernel.step(state, layer=0, **step_inputs(p, slots, g, tokens=T).kwargs())  # commit covers every layer
        accepted = torch.randint(1, T + 1, (b,), generator=g, dtype=torch.int32)
        kernel.commit(state, slots, accepted)
        pick = accepted[: b - pad].long() - 1
    else:
        pick = torch.zeros(b - pad, dtype=torch.long)
    want = states[torch.arange(b - pad), pick]
    got = kernel.read_state(state, real, 1)
    assert oracle.rel_error(got, want) <= state_tol
    # the cache holds the state rounded to its dtype
    assert torch.equal(got, got.to(to_torch(p.state_dtype)).float())
    untouched = torch.ones(p.num_slots, dtype=torch.bool)
    untouched[real] = False
    assert torch.equal(kernel.read_state(state, every, 1)[untouched], before[1][untouched])
    if not p.speculative:
        assert torch.equal(kernel.read_state(state, every, 0), before[0])
    assert torch.equal(kernel.read_state(state, every, 0)[untouched], before[0][untouched])


def test_commit_moves_cursors_only(gen):
    p = small_problem(speculative=True, tokens_per_step=3)
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state(num_layers=1)
    slots = torch.tensor([3, -1, 5], dtype=torch.int32)
    inputs = step_inputs(p, slots, gen)
    kernel.step(state, **inputs.kwargs())
    ssm = state.buffers["ssm"].clone()
    kernel.commit(state, slots, torch.tensor([2, 1, 3], dtype=torch.int32))
    assert torch.equal(state.buffers["ssm"], ssm)  # no state copied
    assert state.buffers["cursor"][[3, 5]].tolist() == [2, 3]


def test_pad_rows_output_uses_zero_state(gen):
    p = small_problem()
    kernel = ssu.open(ssu.Config(), p)
    state = kernel.allocate_state()
    every = torch.arange(p.num_slots)
    kernel.write_state(state, every, random_states(p, p.num_slots, gen))
    slots = torch.tensor([-1, 2], dtype=torch.int32)
    inputs = step_inputs(p, slots, gen)
    out = kernel.step(state, **inputs.kwargs())
    _, outs = oracle.ssu_math64(
        torch.zeros(1, p.nheads, p.headdim, p.dstate),
        inputs.x[:1, None],
        inputs.dt[:1, None],
        inputs.A,
        inputs.B[:1, None],
        inputs.C[:1, None],
        D=inputs.D,
        z=inputs.z[:1, None],
        dt_bias=inputs.dt_bias,
        dt_softplus=True,
    )
    assert oracle.rel_error(out[:1], outs[:, 0]) < 1e-5
