"""``torch.ops.ssu_triton.step``: the kernel as a torch custom op, so that a step can sit inside a
``torch.compile``-d model. The fake implementation only declares the mutation of the state views,
``out`` and the fault record; the kernel itself stays opaque to the compiler."""

from __future__ import annotations

from typing import Optional

import torch

from ssu.state.slot_state import LayerViews

from .launch import StepConstants, launch
from .tuning import Schedule


@torch.library.custom_op(
    "ssu_triton::step", mutates_args=("read", "write", "out", "faults", "read_scale", "write_scale")
)
def step_op(
    read: torch.Tensor,
    write: Optional[torch.Tensor],
    cursor: Optional[torch.Tensor],
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    slots: torch.Tensor,
    D: Optional[torch.Tensor],
    z: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    dt_softplus: bool,
    out: torch.Tensor,
    seed: Optional[torch.Tensor],
    dst_slots: Optional[torch.Tensor],
    faults: torch.Tensor,
    consts: list[int],
    schedule: list[int],
    read_scale: Optional[torch.Tensor] = None,
    write_scale: Optional[torch.Tensor] = None,
) -> None:
    """``write`` (``write_scale``) is None when the step writes the view it reads (a custom op's
    arguments may not alias); the scales are an 8-bit cache's, else None."""
    launch(
        read,
        read if write is None else write,
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
        dt_softplus,
        out,
        seed,
        dst_slots,
        faults,
        StepConstants(*consts),
        Schedule(*schedule),
        None if read_scale is None else LayerViews(read_scale, read_scale if write_scale is None else write_scale),
    )


@step_op.register_fake
def _step_fake(
    read,
    write,
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
    dt_softplus,
    out,
    seed,
    dst_slots,
    faults,
    consts,
    schedule,
    read_scale=None,
    write_scale=None,
) -> None:
    return None
