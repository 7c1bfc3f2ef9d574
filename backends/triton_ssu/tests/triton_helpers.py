"""Helpers of the triton backend's tests."""

from __future__ import annotations


import torch

from ssu.harness import compare_with_reference, open_pair, seeded_states  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def compare_steps(problem, gen, *, kernel_options=None, **kwargs):
    """The triton backend against the reference (see ``ssu.harness.compare_with_reference``)."""
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
    from ssu import faults as fault_record
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
