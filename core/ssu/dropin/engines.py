"""The engines' speculative calls through the drop-in ``ssu.selective_state_update``, with the
engines' own argument names (docs/spec.md, "Engine call forms").

vLLM's form: ``state_batch_indices`` and ``dst_state_batch_indices`` as (N, W) tables (a column
per token), ``num_accepted_tokens`` (N,), tokens packed by ``cu_seqlens`` (N + 1,), the pad id as
``null_block_id``. SGLang's form: x (b, T, H, P), ``disable_state_update``,
``intermediate_states_buffer`` with ``cache_steps`` steps a row, ``intermediate_state_indices``,
``retrieve_parent_token``. Each call form opens a kernel of its own on the engine's cache
(``Problem.engine_calls``), adopted in place and warmed up by its first call, as the one-token
call does; later calls go straight to ``kernel.packed_step`` or ``kernel.verify_step``.

A vLLM decode call without speculation passes (b, 1) tables and no counts: it is the one-token
step on their only column.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..contract.errors import InputError
from . import cache

if TYPE_CHECKING:
    from torch import Tensor

    from ..plugins.config import Config

#: the drop-in's arguments of each engine's call form
VLLM_ARGUMENTS = ("num_accepted_tokens", "cu_seqlens", "null_block_id")
SGLANG_ARGUMENTS = (
    "disable_state_update",
    "intermediate_states_buffer",
    "cache_steps",
    "retrieve_parent_token",
    "intermediate_state_indices",
)


def call_form(
    x: "Tensor",
    state_batch_indices: Optional["Tensor"] = None,
    *,
    num_accepted_tokens: Optional["Tensor"] = None,
    cu_seqlens: Optional["Tensor"] = None,
    disable_state_update: bool = False,
    intermediate_states_buffer: Optional["Tensor"] = None,
    retrieve_parent_token: Optional["Tensor"] = None,
) -> str:
    """The form the drop-in serves a call as: ``"step"`` (one token a sequence, vLLM's (N, 1)
    tables included), ``"packed"`` (vLLM's speculative call), ``"verify"`` or ``"tree"`` (SGLang's,
    with parent tokens): for an engine plugin that remembers per form which calls it passes on."""
    if retrieve_parent_token is not None:
        return "tree"
    if disable_state_update or intermediate_states_buffer is not None or x.dim() == 4:
        return "verify"
    if num_accepted_tokens is not None or cu_seqlens is not None:
        return "packed"
    if state_batch_indices is not None and state_batch_indices.dim() == 2 and state_batch_indices.shape[1] != 1:
        return "packed"
    return "step"


def call_size(form: str, x: "Tensor", state_batch_indices=None, cu_seqlens=None) -> tuple[int, int]:
    """``(batch bucket, tokens)`` of a call of ``form`` (:func:`call_form`): what, besides its cache
    tensor and form, tells the problem the drop-in opens a kernel for (the cache fixes the rest),
    with the batch rounded up as the drop-in rounds it (:func:`ssu.dropin.cache.batch_bucket`). For
    an engine plugin that remembers which problems it passes on; reads shapes only."""
    if form == "packed":
        batch = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return cache.batch_bucket(batch), state_batch_indices.shape[-1]
    if form == "step":
        return cache.batch_bucket(x.shape[0]), 1
    return cache.batch_bucket(x.shape[0]), x.shape[1] if x.dim() == 4 else 1


def engine_call(
    state: "Tensor",
    x: "Tensor",
    dt: "Tensor",
    A: "Tensor",
    B: "Tensor",
    C: "Tensor",
    D: Optional["Tensor"],
    z: Optional["Tensor"],
    dt_bias: Optional["Tensor"],
    dt_softplus: bool,
    state_batch_indices: Optional["Tensor"],
    dst_state_batch_indices: Optional["Tensor"],
    pad_slot_id: int,
    out: Optional["Tensor"],
    *,
    null_block_id: Optional[int],
    num_accepted_tokens: Optional["Tensor"],
    cu_seqlens: Optional["Tensor"],
    disable_state_update: bool,
    intermediate_states_buffer: Optional["Tensor"],
    cache_steps: Optional[int],
    retrieve_parent_token: Optional["Tensor"],
    intermediate_state_indices: Optional["Tensor"],
    config: Optional["Config"],
) -> "Tensor":
    """The drop-in call of an engine's form (what :func:`ssu.selective_state_update` hands over
    when any of the engines' arguments is given, or x or the slot ids have another rank)."""
    given = dict(
        num_accepted_tokens=num_accepted_tokens is not None,
        cu_seqlens=cu_seqlens is not None,
        null_block_id=null_block_id is not None,
        disable_state_update=bool(disable_state_update),
        intermediate_states_buffer=intermediate_states_buffer is not None,
        cache_steps=cache_steps is not None,
        retrieve_parent_token=retrieve_parent_token is not None,
        intermediate_state_indices=intermediate_state_indices is not None,
    )
    vllm = [n for n in VLLM_ARGUMENTS if given[n]]
    sglang = [n for n in SGLANG_ARGUMENTS if given[n]]
    if vllm and sglang:
        raise InputError(
            f"{', '.join(vllm)} (vLLM's call form) and {', '.join(sglang)} (SGLang's) in one call; an engine passes "
            'the arguments of its own form only (docs/spec.md, "Engine call forms")'
        )
    pad = _pad_id(pad_slot_id, null_block_id)
    if sglang or (not vllm and hasattr(x, "dim") and x.dim() == 4):
        return _verify(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dst_state_batch_indices, pad,
            out, disable_state_update, intermediate_states_buffer, cache_steps, retrieve_parent_token,
            intermediate_state_indices, config,
        )  # fmt: skip
    return _packed(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dst_state_batch_indices, pad, out,
        num_accepted_tokens, cu_seqlens, config,
    )  # fmt: skip


def _pad_id(pad_slot_id: int, null_block_id: Optional[int]) -> int:
    """The call's pad id: ``null_block_id`` (vLLM's name) or ``pad_slot_id``, never two different ones."""
    if null_block_id is None:
        return pad_slot_id
    if pad_slot_id != -1 and pad_slot_id != null_block_id:
        raise InputError(
            f"null_block_id={null_block_id} and pad_slot_id={pad_slot_id}: two pad ids; null_block_id is vLLM's name "
            "for pad_slot_id: pass one of them"
        )
    return null_block_id


def _entry(state, x, B, pad: int, config, form: str, tokens: int, batch: int, params: tuple):
    """The adopted entry of ``state`` for ``form``, prepared (kernel opened, cache adopted) as needed;
    ``params`` the call's ``(dt, A, D, dt_bias)``."""
    entry = cache._adopted.get((id(state), id(config), form))
    if (
        entry is None
        or entry.tensor() is not state
        or batch > entry.max_batch
        or tokens > entry.kernel.problem.tokens_per_step
        or entry.pad_slot_id != pad
    ):
        entry = cache._prepare(state, x, B, pad, config, form=form, tokens=tokens, batch=batch, params=params)
    return entry


def _packed(
    state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, dst, pad, out, num_accepted, cu_seqlens, config
):  # fmt: skip
    """vLLM's form: the one-token step for (b, 1) tables without counts or offsets, else ``packed_step``."""
    import torch

    if slots is None:
        raise InputError(
            "state_batch_indices: vLLM's call form (num_accepted_tokens, cu_seqlens, two-dimensional tables) needs "
            "the (N, W) table of slot ids; pass it"
        )
    if not isinstance(slots, torch.Tensor) or slots.dim() != 2:
        got = f"shape {tuple(slots.shape)}" if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise InputError(
            f"state_batch_indices: vLLM's call form takes an (N, W) table, a row per sequence and a column per token "
            f"(W = 1 without speculation), got {got}"
        )
    if dst is not None and (not isinstance(dst, torch.Tensor) or dst.dim() != 2):
        got = f"shape {tuple(dst.shape)}" if isinstance(dst, torch.Tensor) else type(dst).__name__
        raise InputError(f"dst_state_batch_indices: expected an (N, W) table like state_batch_indices, got {got}")
    W = slots.shape[1]
    if num_accepted is None and cu_seqlens is None and W == 1:  # a plain decode call
        return cache.after_cache_lanes(
            state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots[:, 0], None if dst is None else dst[:, 0], pad,
            out, config=config,
        )  # fmt: skip
    batch = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    entry = _entry(state, x, B, pad, config, "packed", W, max(batch, 1), (dt, A, D, dt_bias))
    if dst is slots:
        dst = None
    return entry.kernel.packed_step(
        entry.state, x, dt, A, B, C, slots, dst, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus, out, 0
    )


def _verify(
    state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, slots, dst, pad, out, disable_state_update, buffer,
    cache_steps, parents, buffer_rows, config,
):  # fmt: skip
    """SGLang's form: ``verify_step`` (``tree`` with parent tokens)."""
    import torch

    if dst is not None:
        raise InputError(
            "dst_state_batch_indices: SGLang's call form writes the state after the last token back to the slot it "
            "read (or nowhere, with disable_state_update); destination slots are vLLM's form"
        )
    if x.dim() == 3:  # one token a row, as SGLang's own function takes it
        x, dt, B, C = x[:, None], dt[:, None], B[:, None], C[:, None]
        z = None if z is None else z[:, None]
        out = None if out is None else out[:, None]
        squeeze = True
    else:
        squeeze = False
    if slots is None:
        slots = cache._rows.get((x.shape[0], str(state.device)))
        if slots is None:
            slots = cache._rows[(x.shape[0], str(state.device))] = torch.arange(
                x.shape[0], dtype=torch.int32, device=state.device
            )
    buffer = _buffer(buffer, cache_steps, state)
    form = "tree" if parents is not None else "verify"
    entry = _entry(state, x, B, pad, config, form, x.shape[1], x.shape[0], (dt, A, D, dt_bias))
    y = entry.kernel.verify_step(
        entry.state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, 0, not disable_state_update, buffer,
        buffer_rows, parents,
    )  # fmt: skip
    return y[:, 0] if squeeze else y


def _buffer(buffer, cache_steps: Optional[int], state):
    """The intermediate-state buffer as (rows, steps, H, P, N): as given when it has that shape,
    else viewed so from its memory (SGLang's kernel addresses it that way), with ``cache_steps``
    steps a row."""
    if buffer is None:
        if cache_steps not in (None, 0):
            raise InputError("cache_steps: given without intermediate_states_buffer; pass the buffer, or leave it out")
        return None
    H, P, N = state.shape[1:]
    if buffer.dim() == 5 and tuple(buffer.shape[2:]) == (H, P, N) and cache_steps in (None, buffer.shape[1]):
        return buffer
    if not cache_steps:
        raise InputError(
            f"intermediate_states_buffer: shape {tuple(buffer.shape)} is not (rows, steps, H, P, N) for H={H} P={P} "
            f"N={N}; pass cache_steps (steps a row) to view it so"
        )
    block = cache_steps * H * P * N
    if not buffer.is_contiguous() or buffer.numel() % block:
        layout = "" if buffer.is_contiguous() else " (not contiguous)"
        raise InputError(
            f"intermediate_states_buffer: {buffer.numel()} values{layout} cannot be viewed as (rows, {cache_steps}, "
            f"{H}, {P}, {N}); pass a contiguous buffer of whole rows"
        )
    return buffer.view(-1, cache_steps, H, P, N)
