"""``ssu.selective_state_update``: the SSU with the signature mamba_ssm made common, on the caller's
own state cache, through the configured backend.

Model code and engines call it as they call mamba_ssm's or FlashInfer's function::

    out = ssu.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                     state_batch_indices=slots, pad_slot_id=-1)

The first call for a problem (the state's and inputs' shapes and dtypes, the cache's size, the pad
id, the device) opens a kernel through the configured backend (``config``, else
:func:`ssu.load_config` with ``SSU_BACKEND``, read once), adopts ``state`` in place and warms the
kernel up (JIT, tuning): make that call before capturing a CUDA graph. Later calls find both in a
cache and go straight to ``kernel.step``, whose checks run once per input signature; a larger
batch than seen so far opens a kernel sized for it. A call without slot ids or ``out`` (a model's
decode call) goes through the kernel's lane for its layout where the backend offers one, bound
after the first such call went through the step: a cache lane (:meth:`ssu.Kernel.cache_lane`)
serves every tensor of the adopted one's layout, so a model that hands over a fresh copy of its
cache at each step (transformers from 5.25 does) is neither adopted nor checked again per step;
a lane of one tensor (:meth:`ssu.Kernel.lane`) serves that tensor. Per-head
parameters pass as they come, per head or expanded over P and N with stride 0 (Mamba2's
"tie_hdim"); parameters that really vary along P or N (Mamba-1 layers) are refused, naming the
argument.

Pad rows follow ssu's rule: a row whose slot is ``pad_slot_id`` reads a zero state, writes no
state and still writes its output row (mamba_ssm writes zeros there). A row whose id names no slot
of the cache (or, without slot ids, a row past the cache's last slot) is served as one and
recorded, and the first such call on a cache tensor warns (:class:`ssu.SSUWarning`; when the
record is read, and why not at every call on CUDA: ``ssu.dropin.cache._warn_ids_outside``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from . import cache
from .engines import engine_call

if TYPE_CHECKING:
    from torch import Tensor

    from ..plugins.config import Config


def selective_state_update(
    state: "Tensor",
    x: "Tensor",
    dt: "Tensor",
    A: "Tensor",
    B: "Tensor",
    C: "Tensor",
    D: Optional["Tensor"] = None,
    z: Optional["Tensor"] = None,
    dt_bias: Optional["Tensor"] = None,
    dt_softplus: bool = False,
    state_batch_indices: Optional["Tensor"] = None,
    dst_state_batch_indices: Optional["Tensor"] = None,
    pad_slot_id: int = -1,
    out: Optional["Tensor"] = None,
    *,
    null_block_id: Optional[int] = None,
    num_accepted_tokens: Optional["Tensor"] = None,
    cu_seqlens: Optional["Tensor"] = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional["Tensor"] = None,
    cache_steps: Optional[int] = None,
    retrieve_parent_token: Optional["Tensor"] = None,
    intermediate_state_indices: Optional["Tensor"] = None,
    config: Optional["Config"] = None,
) -> "Tensor":
    """One SSU step on ``state`` (num_slots, H, P, N), in place; returns ``out`` (b, H, P).

    x (b, H, P); dt (b, H) or (b, H, P) expanded; A (H,) or (H, P, N) expanded; B, C (b, G, N);
    D, dt_bias (H,) or (H, P) expanded; z like x. Row b reads slot ``state_batch_indices[b]``
    (slot b without them) and writes ``dst_state_batch_indices[b]`` (the slot it read without
    them); ``pad_slot_id`` marks padded rows, any integer (0 for a null block; ``null_block_id``
    is vLLM's name for it).

    The engines' speculative calls take their own keyword arguments (docs/spec.md, "Engine call
    forms"; :mod:`ssu.dropin.engines`): vLLM's with two-dimensional ``state_batch_indices`` and
    ``dst_state_batch_indices`` (N, W), ``num_accepted_tokens`` and tokens packed by
    ``cu_seqlens``; SGLang's with x (b, T, H, P), ``disable_state_update``,
    ``intermediate_states_buffer`` (with ``cache_steps``), ``intermediate_state_indices`` and
    ``retrieve_parent_token``.
    """
    try:  # free unless it raises: x and the slot ids are read before anything checks them
        engine = (
            num_accepted_tokens is not None
            or cu_seqlens is not None
            or null_block_id is not None
            or disable_state_update
            or intermediate_states_buffer is not None
            or retrieve_parent_token is not None
            or intermediate_state_indices is not None
            or cache_steps is not None
            or x.dim() == 4
            or (state_batch_indices is not None and state_batch_indices.dim() != 1)
            or (dst_state_batch_indices is not None and dst_state_batch_indices.dim() != 1)
        )
    except AttributeError:
        raise cache.not_a_tensor(
            x=x, state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices
        ) from None
    if engine:
        return engine_call(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dst_state_batch_indices,
            pad_slot_id, out, null_block_id=null_block_id, num_accepted_tokens=num_accepted_tokens,
            cu_seqlens=cu_seqlens, disable_state_update=disable_state_update,
            intermediate_states_buffer=intermediate_states_buffer, cache_steps=cache_steps,
            retrieve_parent_token=retrieve_parent_token, intermediate_state_indices=intermediate_state_indices,
            config=config,
        )  # fmt: skip
    plain = state_batch_indices is None and dst_state_batch_indices is None and out is None
    if plain:  # a model's decode call: the kernel's faster path for a layout seen before, if any
        for lane in cache._lanes.get((id(config), pad_slot_id), ()):
            y = lane(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
            if y is not None:
                return y
    return cache.after_cache_lanes(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dst_state_batch_indices,
        pad_slot_id, out, config=config,
    )  # fmt: skip
