"""The state of the ``triton-replay`` backend: checkpoints, rings of recent inputs, cursors; and its
logical value (read, write, sync), in plain torch.

Buffers of a :class:`ssu.State` (Ly layers, S slots, L = max_window + T ring rows, input dtype
``inp``):

``ssm``      (Ly, S, H, P, N) checkpoints in the cache dtype (an allocated state; an adopted one has
             the engine's tensors in ``State.cache`` instead)
``scale``    (Ly, S, H, P) fp32, 8-bit checkpoints only: each row's scale (:mod:`ssu.state.quant`), rewritten
             with the row at every flush (an adopted cache's scales are the engine's own tensors)
``x_ring``   (Ly, S, H, L, P) inp: x of the tokens in the ring
``B_ring``   (Ly, S, G, L, N) inp: B of the tokens in the ring
``d_ring``   (Ly, S, H, L) fp32: d = dt after bias and softplus
``a_ring``   (Ly, S, H, L) fp32: A d, the token's log decay (so that the ring replays without A)
``start``    (Ly, S) int32: ring row of the oldest token not folded into the checkpoint
``count``    (Ly, S) int32: how many tokens the ring holds
``ticket``   (Ly, S) int32: programs of the running step that are done with the slot (zero between steps)

Beside them each layer's view holds ``gram`` (max_batch, G, M, TP) fp32, a step's scratch: B . C of
each batch row's positions and tokens (M and TP the powers of two from L and T, :mod:`.gram`).
It is indexed by batch row, not slot, so it is not among the buffers; per layer, so that steps of
different layers never share it.

The logical state of a slot is its checkpoint advanced by the ``count`` ring tokens from row
``start``: ``s = exp(a) s + d x B^T`` per token, in fp32 (:func:`read`). Each layer has its own
cursors, so layers are stepped independently and a step of one token moves its own layer's
cursors; a speculative commit moves every layer's.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from ssu.state import quant
from ssu.contract.dtypes import ITEMSIZE, dtype_name, to_torch
from ssu.contract.records import State
from ssu.state.slot_state import LayerViews

#: slots replayed at once by :func:`sync` (bounds its temporary memory)
SYNC_CHUNK = 64


class ReplayViews(NamedTuple):
    """One layer's tensors, as the kernel takes them: the checkpoints (S, H, P, N), any slot stride;
    the rings and cursors of that layer."""

    ck: object
    x_ring: object
    B_ring: object
    d_ring: object
    a_ring: object
    start: object
    count: object
    ticket: object
    gram: object
    scale: object = None


@attrs.define
class RingRecord:
    """Host-side facts of a state (``State.record``): ``ring_tokens``, whether a step of a bucket
    with a window has run on it (only then may a ring hold tokens); ``checkpoints``, the same
    checkpoint tensors as a state of the ``triton`` backend (views of shape (S, 1, H, P, N)), for
    the steps that the triton backend's kernel serves while every ring is empty
    (:mod:`.engine`)."""

    checkpoints: State
    ring_tokens: bool = False


def _record(problem, backend: str, checkpoints, scales) -> RingRecord:
    views = [(ck.unsqueeze(1),) * 2 for ck in checkpoints]
    scale_views = [LayerViews(sc.unsqueeze(1), sc.unsqueeze(1)) for sc in scales]
    return RingRecord(State(backend, problem, len(views), {}, views=views, scales=scale_views))


def ring_bytes_per_slot(problem, ring: int) -> int:
    """Bytes the rings and cursors add to one slot of one layer."""
    return ring * token_bytes(problem) + 3 * 4


def token_bytes(problem) -> int:
    """Ring bytes of one token in one slot and layer: x, B, d and a."""
    p = problem
    inp = ITEMSIZE[p.input_dtype]
    return p.nheads * p.headdim * inp + p.ngroups * p.dstate * inp + 2 * p.nheads * 4


def _side_buffers(problem, num_layers: int, ring: int) -> dict:
    import torch

    p = problem
    dev = p.device
    inp = to_torch(p.input_dtype)
    shape = (num_layers, p.num_slots)
    return {
        "x_ring": torch.zeros(*shape, p.nheads, ring, p.headdim, dtype=inp, device=dev),
        "B_ring": torch.zeros(*shape, p.ngroups, ring, p.dstate, dtype=inp, device=dev),
        "d_ring": torch.zeros(*shape, p.nheads, ring, dtype=torch.float32, device=dev),
        "a_ring": torch.zeros(*shape, p.nheads, ring, dtype=torch.float32, device=dev),
        "start": torch.zeros(shape, dtype=torch.int32, device=dev),
        "count": torch.zeros(shape, dtype=torch.int32, device=dev),
        "ticket": torch.zeros(shape, dtype=torch.int32, device=dev),
    }


def _grams(problem, num_layers: int, ring: int):
    """Each layer's gram scratch (module docstring)."""
    import torch

    p = problem
    M, TP = (1 << (n - 1).bit_length() for n in (ring, p.tokens_per_step))
    return torch.zeros(num_layers, p.max_batch, p.ngroups, M, TP, dtype=torch.float32, device=p.device)


def _views(buffers: dict, checkpoints, grams, scales) -> list:
    names = ("x_ring", "B_ring", "d_ring", "a_ring", "start", "count", "ticket")
    return [
        ReplayViews(ck, *(buffers[n][layer] for n in names), grams[layer], scales[layer] if len(scales) else None)
        for layer, ck in enumerate(checkpoints)
    ]


def _scale_views(scales) -> list:
    """``State.scales``: each layer's row scales, read and written in place."""
    return [LayerViews(sc, sc) for sc in scales]


def allocate(problem, num_layers: int, ring: int, backend: str) -> State:
    """Zero checkpoints, empty rings, for ``num_layers`` layers."""
    import torch

    p = problem
    buffers = _side_buffers(p, num_layers, ring)
    buffers["ssm"] = torch.zeros(
        num_layers, p.num_slots, p.nheads, p.headdim, p.dstate, dtype=to_torch(p.state_dtype), device=p.device
    )
    scales = ()
    if p.quantized:
        scales = buffers["scale"] = torch.zeros(buffers["ssm"].shape[:-1], dtype=torch.float32, device=p.device)
    views = _views(buffers, buffers["ssm"], _grams(p, num_layers, ring), scales)
    record = _record(p, backend, buffers["ssm"], scales)
    return State(backend, p, num_layers, buffers, views=views, scales=_scale_views(scales), record=record)


def adopt(problem, cache: tuple, ring: int, backend: str, scales: tuple = ()) -> State:
    """The engine's per-layer tensors as the checkpoints (an 8-bit cache's row scales with them),
    empty rings beside them."""
    buffers = _side_buffers(problem, len(cache), ring)
    views = _views(buffers, cache, _grams(problem, len(cache), ring), scales)
    return State(
        backend, problem, len(cache), buffers, cache=cache, views=views, scales=_scale_views(scales),
        record=_record(problem, backend, cache, scales),
    )  # fmt: skip


def replay(views: ReplayViews, idx, heads_per_group: int):
    """The logical states of slots ``idx`` (a long tensor): fp32 (len(idx), H, P, N)."""
    import torch

    s = checkpoint(views, idx)
    b = idx.shape[0]
    if b == 0:
        return s
    start = views.start[idx].long()
    count = views.count[idx].long()
    steps = int(count.max().item())
    ring = views.d_ring.shape[-1]
    H = s.shape[1]
    G = views.B_ring.shape[1]
    heads = torch.arange(H, device=s.device)[None, :]
    groups = torch.arange(G, device=s.device)[None, :]
    slots = idx[:, None]
    for i in range(steps):
        r = ((start + i) % ring)[:, None]
        x = views.x_ring[slots, heads, r].float()  # (b, H, P)
        B = views.B_ring[slots, groups, r].float().repeat_interleave(heads_per_group, dim=1)  # (b, H, N)
        d = views.d_ring[slots, heads, r]  # (b, H)
        a = views.a_ring[slots, heads, r]
        nxt = s * torch.exp(a)[:, :, None, None] + (d[:, :, None] * x)[..., None] * B[:, :, None, :]
        s = torch.where((i < count).view(b, 1, 1, 1), nxt, s)
    return s


def checkpoint(views: ReplayViews, idx):
    """The checkpoints of slots ``idx`` in fp32 (an 8-bit one dequantised with its row scales)."""
    if views.scale is not None:
        return quant.dequantize(views.ck[idx], views.scale[idx])
    return views.ck[idx].float()


def set_checkpoint(views: ReplayViews, idx, values) -> None:
    """Store ``values`` as the checkpoints of slots ``idx``: rounded to the cache dtype once, or for
    an 8-bit cache quantised with fresh row scales."""
    values = values.to(views.ck.device)
    if views.scale is not None:
        views.ck[idx], views.scale[idx] = quant.quantize(values, dtype_name(views.ck.dtype))
    else:
        views.ck[idx] = values.to(views.ck.dtype)


def read(state: State, slots, layer: int):
    """Hook body: the logical states of ``slots`` in ``layer``."""
    return replay(state.views[layer], slots.long(), state.problem.heads_per_group)


def _reset(views: ReplayViews, idx) -> None:
    views.start[idx] = 0
    views.count[idx] = 0
    views.ticket[idx] = 0


def write(state: State, slots, values, layer: int) -> None:
    """Hook body: ``values`` become the checkpoints of ``slots`` in ``layer``, their rings empty."""
    views = state.views[layer]
    idx = slots.long()
    set_checkpoint(views, idx, values)
    _reset(views, idx)


def sync(state: State, slots) -> None:
    """Fold the rings of ``slots`` (every slot when None) into the checkpoints of every layer, so
    that an adopted cache holds the logical states (rounded to the cache dtype once, as a flush
    rounds them); the rings are left empty. After every slot, no ring holds a token: the state's
    record says so, and a table that writes through everywhere may serve it with the ``triton``
    backend's kernel again (:mod:`.engine`)."""
    import torch

    for views in state.views:
        if slots is None:
            idx = torch.arange(views.count.shape[0], device=views.count.device)
        else:
            idx = slots.long().to(views.count.device)
        idx = idx[views.count[idx] > 0]
        for chunk in idx.split(SYNC_CHUNK):
            set_checkpoint(views, chunk, replay(views, chunk, state.problem.heads_per_group))
            _reset(views, chunk)
    if slots is None and state.record is not None:
        state.record.ring_tokens = False
