"""Run the triton backend and the reference side by side on the same states and inputs."""

from __future__ import annotations

import torch

import ssu
from ssu import oracle
from ssu.inputs import layer_weights, pick_slots, random_states, step_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def open_pair(problem, **options):
    triton_kernel = ssu.open(ssu.Config(backend="triton", backends={"triton": options} if options else {}), problem)
    reference = ssu.open(ssu.Config(backend="reference"), problem)
    return triton_kernel, reference


def seeded_states(kernels, problem, gen, layers=1):
    """Allocate a state per kernel, all slots set to the same random values."""
    states = [k.allocate_state(num_layers=layers) for k in kernels]
    every = torch.arange(problem.num_slots, device=problem.device)
    for layer in range(layers):
        values = random_states(problem, problem.num_slots, gen)
        for k, s in zip(kernels, states):
            k.write_state(s, every, values, layer)
    return states


def compare_steps(problem, gen, *, steps=1, batch=None, pad=0, index_dtype=torch.int32, options=True,
                  tokens=None, layers=1, kernel_options=None, check_untouched=True):
    """Drive both backends through ``steps`` steps (and commits); assert close outputs and states
    and, for the triton state, untouched slots bit-identical in every version."""
    tk, rk = open_pair(problem, **(kernel_options or {}))
    ts, rs = seeded_states((tk, rk), problem, gen, layers)
    b = batch or problem.max_batch
    slots = pick_slots(problem, b, gen, pad_rows=pad, index_dtype=index_dtype)
    real = slots[: b - pad].long()
    untouched = torch.ones(problem.num_slots, dtype=torch.bool, device=problem.device)
    untouched[real] = False
    raw_before = ts.buffers["ssm"][:, untouched].clone()
    T = tokens or problem.tokens_per_step
    tol = oracle.tolerance(problem.state_dtype, problem.input_dtype, T)
    weights = [layer_weights(problem, gen, with_D=options, with_dt_bias=options) for _ in range(layers)]
    for _ in range(steps):
        for layer in range(layers):
            inputs = step_inputs(problem, slots, gen, tokens=T, weights=weights[layer], with_z=options,
                                 dt_softplus=options)
            out_t = torch.full_like(inputs.x, float("nan"))
            tk.step(ts, out=out_t, layer=layer, **inputs.kwargs())
            out_r = rk.step(rs, layer=layer, **inputs.kwargs())
            assert oracle.rel_error(out_t, out_r) <= tol, "outputs differ from the reference"
        if problem.speculative:
            accepted = torch.randint(1, T + 1, (b,), generator=gen, dtype=torch.int32).to(problem.device)
            tk.commit(ts, slots, accepted)
            rk.commit(rs, slots, accepted)
        for layer in range(layers):
            err = oracle.rel_error(tk.read_state(ts, real, layer), rk.read_state(rs, real, layer))
            assert err <= tol, f"states of layer {layer} differ from the reference by {err:.2e}"
    if check_untouched:
        assert torch.equal(ts.buffers["ssm"][:, untouched], raw_before), "a slot outside the batch was touched"
    return tk, ts
