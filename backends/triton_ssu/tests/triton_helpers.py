"""Helpers of the triton backend's tests."""

from __future__ import annotations


import torch

from ssu.checking.harness import compare_with_reference, open_pair, seeded_states  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = {  # (H, P, N, G) of docs/spec.md's models, plus N = 96
    "nemotron-h-8b": (128, 64, 128, 8),
    "nemotron-nano-9b-v2": (128, 80, 128, 8),
    "nemotron-h-56b": (256, 64, 256, 8),
    "granite-4.0-h": (128, 64, 128, 1),
    "n96": (64, 64, 96, 8),
}


def cuda_problem(shape="nemotron-h-8b", **fields):
    """A problem of one of :data:`SHAPES` on the GPU (fp32 state, bf16 inputs unless given)."""
    import ssu

    H, P, N, G = SHAPES[shape]
    base = dict(
        nheads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        state_dtype="fp32",
        input_dtype="bf16",
        num_slots=96,
        max_batch=64,
        device="cuda",
    )
    base.update(fields)
    return ssu.Problem(**base)


def compare_steps(problem, gen, *, kernel_options=None, **kwargs):
    """The triton backend against the reference (see ``ssu.checking.harness.compare_with_reference``)."""
    return compare_with_reference("triton", problem, gen, backend_options=kernel_options, **kwargs)


def launch_layer(
    ssm,
    cursor,
    layer,
    x,
    dt,
    A,
    B,
    C,
    slots,
    D,
    z,
    dt_bias,
    softplus,
    out,
    seed=None,
    *,
    pad_slot_id,
    heads_per_group,
    speculative,
    versions,
    block_p,
    num_warps,
    tiles=1,
    stages=0,
    maxnreg=0,
    pdl=0,
    branchless=0,
    dst_slots=None,
    faults=None,
):
    """One launch of the step kernel on layer ``layer`` of an allocated (L, S, K, H, P, N) state,
    with a fresh fault record unless given: the kernel as the tests inspect it."""
    from ssu.state import faults as fault_record
    from ssu_backend_triton.launch import StepConstants, launch
    from ssu_backend_triton.tuning import Schedule

    view = ssm[layer]
    consts = StepConstants(
        pad_slot_id, ssm.shape[1], heads_per_group, speculative, cursor is not None, versions, False, 10
    )
    record = fault_record.allocate(ssm.device) if faults is None else faults
    return launch(
        view,
        view,
        cursor,
        x,
        dt,
        A,
        B,
        C,
        slots,
        D,
        z,
        dt_bias,
        softplus,
        out,
        seed,
        dst_slots,
        record,
        consts,
        Schedule(block_p, num_warps, tiles, stages, maxnreg, pdl, branchless),
    )


def compiled_step_matches_reference(backend, problem, gen, options=None):
    """A step inside a ``torch.compile``-d function (the backend's custom op, traced through its
    fake implementation) against the reference: outputs and states. Returns the kernel, its
    state and the slots."""
    import ssu
    from ssu.checking.inputs import pick_slots, step_inputs

    kernel = ssu.open(ssu.Config(backend=backend, validate=False, backends={backend: options or {}}), problem)
    reference = ssu.open(ssu.Config(backend="reference"), problem)
    ts, rs = kernel.allocate_state(), reference.allocate_state()
    slots = pick_slots(problem, 3, gen)
    inputs = step_inputs(problem, slots, gen).kwargs()
    out = torch.empty_like(inputs["x"])

    def layer(x, dt, B, C, z):
        kernel.step(
            ts,
            x,
            dt,
            inputs["A"],
            B,
            C,
            slots,
            D=inputs["D"],
            z=z,
            dt_bias=inputs["dt_bias"],
            dt_softplus=True,
            out=out,
        )
        return out * 2

    compiled = torch.compile(layer, backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    got = compiled(inputs["x"], inputs["dt"], inputs["B"], inputs["C"], inputs["z"])
    want = reference.step(rs, **inputs) * 2
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(kernel.read_state(ts, slots), reference.read_state(rs, slots), rtol=1e-4, atol=1e-5)
    return kernel, ts, slots


def run_twice(script: str, cache, timeout: int = 600):
    """``script`` in two fresh Python processes sharing the Triton tuning cache file ``cache``:
    returns both completed processes (each checked to have exited 0)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SSU_TRITON_TUNING_CACHE=str(cache))
    runs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
        assert run.returncode == 0, run.stderr
        runs.append(run)
    return runs
