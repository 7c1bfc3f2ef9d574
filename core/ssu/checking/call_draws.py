"""Random valid engine calls (docs/spec.md, "Engine call forms"): the records of vLLM's packed call
and SGLang's verify call, and their draws, which the conformance kit, the backends' tests and
``ssu bench`` share.

A drawn call is valid (ids name slots or the pad id, offsets ascend, counts fit, parents precede
their tokens) and never writes a slot another of its sequences reads; :mod:`.engine_harness`
runs it on a kernel and checks it against the float64 oracle.
"""

from __future__ import annotations

from typing import Optional

import attrs

from .call_layouts import buffer_laid_out, laid_out, table_laid_out
from .harness import real_slots
from .inputs import layer_weights


@attrs.define
class PackedCall:
    """The arguments of one ``packed`` call (``kernel.packed_step(state, **call.kwargs())``) and
    what the check needs to know of them."""

    x: object
    dt: object
    A: object
    B: object
    C: object
    slots: object
    dst_slots: object = None
    num_accepted: object = None
    cu_seqlens: object = None
    D: object = None
    z: object = None
    dt_bias: object = None
    dt_softplus: bool = True
    out: object = None

    def kwargs(self) -> dict:
        return attrs.asdict(self, recurse=False)


@attrs.define
class VerifyCall:
    """The arguments of one ``verify`` call (``kernel.verify_step(state, **call.kwargs())``)."""

    x: object
    dt: object
    A: object
    B: object
    C: object
    slots: object
    D: object = None
    z: object = None
    dt_bias: object = None
    dt_softplus: bool = True
    update_state: bool = True
    buffer: object = None
    buffer_rows: object = None
    parents: object = None
    out: object = None

    def kwargs(self) -> dict:
        return attrs.asdict(self, recurse=False)


def _inputs(
    problem, lead: tuple, gen, *, expanded: bool, with_z: bool, weights: Optional[dict],
    layout: str = "contiguous", aligned: bool = False, out: bool = False, dt_dtype: Optional[str] = None,
    softplus: bool = True, out_layout: Optional[str] = None,
) -> dict:  # fmt: skip
    """Random x, dt, B, C, z and a layer's weights for tensors whose leading dimensions are ``lead``
    (dt and the per-head weights expanded over P and N with stride 0 where ``expanded``), laid
    out as ``layout``; with ``out`` an output tensor like x, filled with NaN, laid out as
    ``out_layout`` (default ``layout``); dt in ``dt_dtype``
    (default x's). Without ``softplus`` dt and dt_bias are small and positive, so that their sum
    stays a time step."""
    import torch

    from ..contract.dtypes import to_torch

    p = problem
    dtype = to_torch(p.input_dtype)
    weights = layer_weights(p, gen) if weights is None else weights
    k = len(lead)

    def draw(*shape, scale=1.0):
        values = (torch.randn(*shape, generator=gen) * scale).to(dtype).to(p.device)
        return laid_out(values, layout, k, aligned=aligned)

    dt = torch.rand(*lead, p.nheads, generator=gen) * 3.0 - 2.0
    A, D, bias = weights["A"], weights.get("D"), weights.get("dt_bias")
    if not softplus:
        dt = dt.abs() * 0.1 + 0.01
        bias = None if bias is None else (bias.float().abs() * 0.02 + 0.01).to(bias.dtype)
    dt = laid_out(dt.to(to_torch(dt_dtype) if dt_dtype else dtype).to(p.device), layout, k, aligned=aligned)
    if expanded:
        dt = dt[..., None].expand(*dt.shape, p.headdim)
        A = A[:, None, None].expand(-1, p.headdim, p.dstate)
        D = None if D is None else D[:, None].expand(-1, p.headdim)
        bias = None if bias is None else bias[:, None].expand(-1, p.headdim)
    given = None
    if out:
        given = laid_out(torch.full((*lead, p.nheads, p.headdim), float("nan"), dtype=dtype, device=p.device),
                         out_layout or layout, k, aligned=aligned)  # fmt: skip
    return dict(
        x=draw(*lead, p.nheads, p.headdim),
        dt=dt,
        A=A,
        B=draw(*lead, p.ngroups, p.dstate, scale=0.5),
        C=draw(*lead, p.ngroups, p.dstate, scale=0.5),
        D=D,
        z=draw(*lead, p.nheads, p.headdim) if with_z else None,
        dt_bias=bias,
        out=given,
    )


def _shuffled_slots(problem, count: int, gen):
    """``count`` distinct real slots in random order (int64, on the CPU)."""
    import torch

    real = real_slots(problem).cpu()
    if count > real.numel():
        raise ValueError(f"the call needs {count} distinct slots; the cache has {real.numel()}")
    return real[torch.randperm(real.numel(), generator=gen)[:count]]


def draw_packed(
    problem,
    gen,
    *,
    sequences: int,
    width: Optional[int] = None,
    lengths: Optional[list] = None,
    accepted: Optional[list] = None,
    packed: bool = True,
    padded: int = 0,
    pad_cells: int = 0,
    own_destinations: bool = False,
    index_dtype=None,
    expanded: bool = True,
    with_z: bool = True,
    weights: Optional[dict] = None,
    counts: Optional[bool] = None,
    table_layout: str = "contiguous",
    dst_layout: Optional[str] = None,
    layout: str = "contiguous",
    aligned: bool = False,
    out: bool = False,
    unowned: tuple = (0, 0),
    softplus: bool = True,
    dt_dtype: Optional[str] = None,
    out_layout: Optional[str] = None,
) -> PackedCall:
    """A random valid ``packed`` call of ``sequences`` sequences and tables ``width`` wide (default
    the problem's tokens per step): each sequence ``lengths[n]`` tokens (random 0..width by
    default; 1 each without ``packed``, which passes no offsets) and ``accepted[n]`` accepted
    tokens (random 0..width; None: no counts, unless ``counts`` asks for them). The last ``padded``
    sequences start from the pad id, ``pad_cells`` destination cells of the others hold it. Each
    sequence owns its own row of slots; with ``own_destinations`` the destinations are another
    table of fresh slots, else the same table (what vLLM passes). The slot table is laid out as
    ``table_layout``, the destination table as ``dst_layout`` (default the same) and the inputs as
    ``layout``; ``out``: an output tensor is given, NaN-filled;
    ``unowned``: rows no sequence owns before the first sequence and after the last (offsets only);
    ``out_layout``: the given out's layout (default ``layout``)."""
    import torch

    p = problem
    W = p.tokens_per_step if width is None else width
    index_dtype = index_dtype or torch.int32
    if not packed:
        lengths = [1] * sequences
        unowned = (0, 0)
    elif lengths is None:
        lengths = torch.randint(0, W + 1, (sequences,), generator=gen).tolist()
    if accepted is None and (packed if counts is None else counts):
        accepted = torch.randint(0, W + 1, (sequences,), generator=gen).tolist()
    tables = 2 if own_destinations else 1
    ids = _shuffled_slots(p, tables * sequences * W, gen).view(tables, sequences, W)
    slots = ids[0].clone()
    dst = ids[1].clone() if own_destinations else slots  # vLLM passes one table as both
    for n in range(sequences - padded, sequences):
        slots[n, max((accepted[n] if accepted else 1) - 1, 0)] = p.pad_slot_id
    cells = [(n, t) for n in range(sequences - padded) for t in range(W)]
    for i in torch.randperm(len(cells), generator=gen)[:pad_cells].tolist():
        n, t = cells[i]
        column = max((accepted[n] if accepted else 1) - 1, 0)
        if own_destinations or t != column:  # the start cell of a shared table stays a slot
            dst[n, t] = p.pad_slot_id
    lead, trail = unowned
    offsets = torch.tensor([lead] + [lead + v for v in torch.tensor(lengths).cumsum(0).tolist()], dtype=index_dtype)
    tokens = int(offsets[-1]) + trail
    outside = p.num_slots + 3 if p.pad_slot_id != p.num_slots + 3 else p.num_slots + 4

    def table(t, layout):
        return table_laid_out(t.to(index_dtype).to(p.device), layout, outside)

    call = PackedCall(
        slots=table(slots, table_layout),
        dst_slots=table(dst, dst_layout or table_layout) if own_destinations else None,
        num_accepted=None if accepted is None else torch.tensor(accepted, dtype=index_dtype, device=p.device),
        cu_seqlens=offsets.to(p.device) if packed else None,
        dt_softplus=softplus,
        **_inputs(
            p,
            (tokens,),
            gen,
            expanded=expanded,
            with_z=with_z,
            weights=weights,
            layout=layout,
            aligned=aligned,
            out=out,
            dt_dtype=dt_dtype,
            softplus=softplus,
            out_layout=out_layout,
        ),  # fmt: skip
    )
    return call


def draw_verify(
    problem,
    gen,
    *,
    rows: int,
    tokens: Optional[int] = None,
    padded: int = 0,
    update_state: bool = False,
    buffer_dtype: Optional[str] = "fp32",
    buffer_rows: bool = True,
    parents: bool = False,
    steps: Optional[int] = None,
    index_dtype=None,
    expanded: bool = True,
    with_z: bool = False,
    weights: Optional[dict] = None,
    buffer_layout: str = "contiguous",
    parents_layout: str = "contiguous",
    layout: str = "contiguous",
    aligned: bool = False,
    out: bool = False,
    softplus: bool = True,
    dt_dtype: Optional[str] = None,
    out_layout: Optional[str] = None,
) -> VerifyCall:
    """A random valid ``verify`` call of ``rows`` rows of ``tokens`` tokens (default the problem's),
    the last ``padded`` of them pad rows; an intermediate-state buffer of ``buffer_dtype`` (None:
    none) with a row per call row (``buffer_rows``: given in a shuffled order, else the slots,
    the buffer then as many rows as the cache), and with ``parents`` a random tree (each token's
    parent one of the tokens before it, or a negative number: the token before it; token 0's, and
    a pad row's, any number, since no token reads them);
    ``steps`` a buffer row (default T + 1). The buffer is laid out as ``buffer_layout``, the parent
    table as ``parents_layout``, the inputs as ``layout``; ``out``: an output tensor is given,
    NaN-filled, laid out as ``out_layout`` (default ``layout``)."""
    import torch

    from ..contract.dtypes import to_torch

    p = problem
    T = p.tokens_per_step if tokens is None else tokens
    index_dtype = index_dtype or torch.int32
    slots = _shuffled_slots(p, rows, gen)
    slots[rows - padded :] = p.pad_slot_id
    buffer = order = None
    if buffer_dtype is not None:
        count = rows if buffer_rows else p.num_slots
        steps = T + 1 if steps is None else steps  # by default one step a row more than the call's tokens
        buffer = torch.randn(count, steps, p.nheads, p.headdim, p.dstate, generator=gen)
        buffer = buffer_laid_out(buffer.to(to_torch(buffer_dtype)).to(p.device), buffer_layout)
        if buffer_rows:
            order = torch.randperm(rows, generator=gen).to(index_dtype).to(p.device)
    tree = None
    if parents:
        tree = torch.full((rows, T), -1, dtype=torch.int64)
        for t in range(1, T):
            tree[:, t] = torch.randint(-2, t, (rows,), generator=gen)  # -2, -1: the token before
        # what no token reads, any value: token 0's parent, and every parent of a pad row
        tree[:, 0] = torch.randint(-2, T + 3, (rows,), generator=gen)
        tree[rows - padded :] = torch.randint(-2, T + 3, (padded, T), generator=gen)
        tree = table_laid_out(tree.to(index_dtype).to(p.device), parents_layout, T + 5)
    return VerifyCall(
        slots=slots.to(index_dtype).to(p.device),
        update_state=update_state,
        buffer=buffer,
        buffer_rows=order,
        parents=tree,
        dt_softplus=softplus,
        **_inputs(
            p,
            (rows, T),
            gen,
            expanded=expanded,
            with_z=with_z,
            weights=weights,
            layout=layout,
            aligned=aligned,
            out=out,
            dt_dtype=dt_dtype,
            softplus=softplus,
            out_layout=out_layout,
        ),  # fmt: skip
    )
