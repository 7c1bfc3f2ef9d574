"""``torch.ops.ssu_triton.step``: the kernel as a torch custom op, so that a step can sit inside a
``torch.compile``-d model. The fake implementation only declares the mutation of ``ssm`` and
``out``; the kernel itself stays opaque to the compiler."""

from __future__ import annotations

from typing import Optional

import torch

from .kernel import launch


@torch.library.custom_op("ssu_triton::step", mutates_args=("ssm", "out"))
def step_op(ssm: torch.Tensor, cursor: Optional[torch.Tensor], layer: int, x: torch.Tensor, dt: torch.Tensor,
            A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, slots: torch.Tensor, D: Optional[torch.Tensor],
            z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], dt_softplus: bool, out: torch.Tensor,
            seed: Optional[torch.Tensor], pad_slot_id: int, heads_per_group: int, speculative: bool, versions: int,
            block_p: int, num_warps: int, tiles: int, stages: int, maxnreg: int, pdl: int, branchless: int,
            stochastic: bool, philox_rounds: int) -> None:
    launch(ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, seed,
           pad_slot_id=pad_slot_id, heads_per_group=heads_per_group, speculative=speculative, versions=versions,
           block_p=block_p, num_warps=num_warps, tiles=tiles, stages=stages, maxnreg=maxnreg, pdl=pdl,
           branchless=branchless, stochastic=stochastic, philox_rounds=philox_rounds)


@step_op.register_fake
def _step_fake(ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, seed, pad_slot_id,
               heads_per_group, speculative, versions, block_p, num_warps, tiles, stages, maxnreg, pdl,
               branchless, stochastic, philox_rounds) -> None:
    return None
