"""Random engine calls and their check against the float64 oracle (docs/spec.md, "Engine call
forms"): what the conformance kit, the backends' tests and ``ssu bench`` share for vLLM's packed
call and SGLang's verify call.

A drawn call is valid (ids name slots or the pad id, offsets ascend, counts fit, parents precede
their tokens) and never writes a slot another of its sequences reads. :func:`check_packed` and
:func:`check_verify` run one call on a kernel's state and compare the outputs, every slot's
logical state (those the call writes against the oracle, the others bit for bit) and the buffer.
"""

from __future__ import annotations

from typing import Optional

import attrs

from . import oracle
from ..contract.errors import InputError
from .harness import CheckFailure, expect_close, expect_out, expect_rounded, real_slots
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


#: how the inputs of an engine call (x, dt, B, C, z and a given out) sit in memory: as allocated;
#: each token's row contiguous, the token stride free (slices of a projection, as engines pass
#: them); every dimension strided
INPUT_LAYOUTS = ("contiguous", "rows", "strided")
#: how an engine call's index tables (the packed call's slot and destination tables, a verify
#: call's parents) and a verify call's buffer sit in memory: as allocated; a view with strides of
#: its own (every other column of a wider table; buffer rows and steps further apart, each
#: (H, P, N) block contiguous); transposed storage (tables only)
TABLE_LAYOUTS = ("contiguous", "strided", "transposed")
BUFFER_LAYOUTS = ("contiguous", "strided")


def laid_out(t, layout: str, lead: int, *, aligned: bool = False):
    """``t``'s values in a new tensor of ``layout`` (:data:`INPUT_LAYOUTS`), its first ``lead``
    dimensions being the leading (token, or row and token) ones; with ``aligned`` each row of the
    "rows" layout starts at a multiple of 16 bytes (what ``contiguous_rows`` asks). The memory
    around the view is NaN, so a read past a row shows."""
    import math

    import torch

    from ..runtime.validation import contiguous_strides

    if t is None or layout == "contiguous":
        return t
    if layout == "rows":
        inner = t.shape[lead:]
        width = math.prod(inner)
        packet = max(16 // t.element_size(), 1)
        row = width + ((-width) % packet + packet if aligned else 3)
        lead_strides = tuple(row * v for v in contiguous_strides(t.shape[:lead]))
        big = torch.full((max(row * math.prod(t.shape[:lead]), 1),), float("nan"), dtype=t.dtype, device=t.device)
        view = big.as_strided(t.shape, lead_strides + contiguous_strides(inner))
        view.copy_(t)
        return view
    big = torch.full((*t.shape, 2), float("nan"), dtype=t.dtype, device=t.device)
    view = big[..., 0]
    view.copy_(t)
    return view


def table_laid_out(t, layout: str, fill: int):
    """An index table's values in a new tensor of ``layout`` (:data:`TABLE_LAYOUTS`); the cells
    around a strided view hold ``fill`` (an id outside the cache, which a misread then uses)."""
    import torch

    if t is None or layout == "contiguous":
        return t
    if layout == "transposed":
        return t.t().contiguous().t()
    rows, cols = t.shape
    big = torch.full((rows, 2 * cols + 1), fill, dtype=t.dtype, device=t.device)
    view = big[:, 1::2]
    view.copy_(t)
    return view


def buffer_laid_out(t, layout: str):
    """An intermediate-state buffer's values in a new tensor of ``layout`` (:data:`BUFFER_LAYOUTS`):
    "strided" takes every other row of a buffer with two steps more per row, so rows and steps
    have strides of their own while each (H, P, N) block stays contiguous; the memory around it
    is NaN."""
    import torch

    if t is None or layout == "contiguous":
        return t
    rows, steps = t.shape[:2]
    big = torch.full((2 * rows, steps + 2, *t.shape[2:]), float("nan"), dtype=t.dtype, device=t.device)
    view = big[::2, 1 : steps + 1]
    view.copy_(t)
    return view


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


def _per_head(call) -> dict:
    """The call's dt, A, D and dt_bias per head, as the oracle takes them."""
    dt, A, D, bias = call.dt, call.A, call.D, call.dt_bias
    if dt.dim() == call.x.dim():
        dt = dt[..., 0]
    if A.dim() == 3:
        A = A[:, 0, 0]
    if D is not None and D.dim() == 2:
        D = D[:, 0]
    if bias is not None and bias.dim() == 2:
        bias = bias[:, 0]
    return dict(dt=dt, A=A, D=D, dt_bias=bias)


def all_states(kernel, state, layers: int) -> list:
    """Every slot's logical state (fp32, zeros for a pad slot) of every layer."""
    from .harness import logical_states

    return [logical_states(kernel, state, layer).clone() for layer in range(layers)]


def _compare_states(kernel, what: str, got, want, before, written, tokens: int, carried=None) -> None:
    """The written slots against the oracle (an 8-bit cache value by value), the others bit for
    bit. ``carried``: the dtype of an intermediate-state buffer the states came back through (a
    verify call's parents), whose rounding the written states then carry as well."""
    import torch

    p = kernel.problem
    others = torch.ones(p.num_slots, dtype=torch.bool)
    others[written] = False
    if p.pad_in_cache:
        others[p.pad_slot_id] = False
    if not torch.equal(got[others], before[others]):
        moved = torch.nonzero((got[others] != before[others]).flatten(1).any(1)).flatten()
        slot = int(torch.nonzero(others).flatten()[moved[0]])
        raise CheckFailure(f"{what}: slot {slot}, which the call does not write, changed")
    if not written:
        return
    state_tol = oracle.tolerances(p, tokens, kernel.capabilities.state_precision)[1]
    if carried is not None and carried != "fp32":
        expect_close(f"{what}: written states", got[written], want[written].float(),
                     max(state_tol, oracle.state_tolerance(carried, tokens)))  # fmt: skip
    elif p.quantized:
        expect_rounded(f"{what}: written states", got[written], want[written], p.state_dtype)
    else:
        expect_close(f"{what}: written states", got[written], want[written].float(), state_tol)


def fault_label(arg: int, sequence: int, token: int, value: Optional[int] = None) -> str:
    """How ``check()`` names a guarded value of an engine call (:func:`ssu.state.faults.engine_label`),
    with the value its record holds (its low 32 bits, signed) where given."""
    from ..state import faults

    label = faults.engine_label(arg, sequence, token)
    if value is None:
        return label
    return f"{label} = {faults.decode(faults.encode(0, 0, int(value)))[2]}"


def _fault_named(kernel, fault: Optional[str], what: str, rule: str = "") -> None:
    """After a call: with ``fault`` (a label of :func:`fault_label`), ``check()`` must raise naming
    it (and its value, where the label holds one); without, it must not raise (an InputError then
    propagates: a valid call refused)."""
    import re

    if fault is None:
        kernel.check()
        return
    try:
        kernel.check()
    except InputError as exc:
        if not re.search(rf"(?<![\w.]){re.escape(fault)}(?![\w.])", str(exc)):
            raise CheckFailure(
                f"{what}: check() should name {fault}, but reported: {exc}", rule or "engine/fault-key"
            ) from None
        return
    guards = "engine/packed-guards" if what.startswith("packed") else "engine/verify-guards"
    raise CheckFailure(f"{what}: {fault} was not recorded (check() raised nothing)", rule or guards)


def check_packed(
    kernel, state, call: PackedCall, layer: int = 0, layers: int = 1, *, served_as=None, fault=None, rule: str = ""
) -> None:
    """Run ``call`` on ``layer`` of ``state`` and raise :class:`CheckFailure` where the outputs, the
    slots it writes (within the budgets) or any other slot or layer (bit for bit) are wrong. A call
    with a value the backend guards passes ``served_as`` (the valid call the spec serves it as: the
    oracle runs that) and ``fault`` (what ``check()`` must then name; ``rule``: the rule a wrong or
    missing record breaks)."""
    import torch

    p = kernel.problem
    before = all_states(kernel, state, layers)
    served = call if served_as is None else served_as
    heads = _per_head(served)
    reading = dict(
        pad_slot_id=p.pad_slot_id, dst_slots=None if served.dst_slots is None else served.dst_slots.cpu(),
        num_accepted=None if served.num_accepted is None else served.num_accepted.cpu(),
        cu_seqlens=None if served.cu_seqlens is None else served.cu_seqlens.cpu(), D=heads["D"], z=served.z,
        dt_bias=heads["dt_bias"], dt_softplus=served.dt_softplus,
    )  # fmt: skip

    def packed_oracle(**misread):
        args = (before[layer], served.x, heads["dt"], heads["A"], served.B, served.C, served.slots.cpu())
        return oracle.packed_math64(*args, **dict(reading, **misread))

    want_cache, want_out = packed_oracle()
    given = None if call.out is None else call.out.clone()
    out = kernel.packed_step(state, **call.kwargs(), layer=layer)
    _fault_named(kernel, fault, f"packed call ({describe(call)})", rule)
    expect_out(f"the packed call ({describe(call)})", call.out, call.x, out)
    owned = ~torch.isnan(want_out.flatten(1)[:, 0])
    W = call.slots.shape[1]
    misreadings = _misreadings(reading, lambda **m: packed_oracle(**m)[1], served.x)
    if reading["num_accepted"] is not None:
        misreadings.insert(0, ("engine/packed-start-column", "counts ignored (every sequence from column 0)",
                               lambda: packed_oracle(num_accepted=None)[1]))  # fmt: skip
    _expect_outputs(f"packed call ({describe(call)}): outputs", out, want_out, owned, oracle.tolerances(p, W)[0],
                    misreadings)  # fmt: skip
    if given is not None and not _same(out[~owned], given[~owned]):
        row = int(torch.nonzero(~owned).flatten()[0])
        raise CheckFailure(
            f"packed call ({describe(call)}): row {row} of the given out, which no sequence owns, was written",
            "engine/packed-unowned-out",
        )
    written = sorted(int(s) for s in torch.nonzero((want_cache != before[layer].double()).flatten(1).any(1)).flatten())
    after = all_states(kernel, state, layers)
    for other in range(layers):
        if other != layer and not torch.equal(after[other], before[other]):
            raise CheckFailure(f"packed call on layer {layer}: layer {other} changed", "layers/independent")
    _compare_states(kernel, "packed call", after[layer], want_cache, before[layer], written, W)


def check_packed_sequence_dropped(kernel, state, call: PackedCall, sequence: int, fault: str, layer: int = 0,
                                  layers: int = 1) -> None:  # fmt: skip
    """Run ``call``, whose offsets are wrong for ``sequence``, and raise :class:`CheckFailure`
    unless ``check()`` names ``fault``, no slot of that sequence's cells changed, and nothing
    outside the slots the tables name changed (on any layer): what the spec leaves a backend once
    offsets are wrong (the other results are unspecified)."""
    import torch

    p = kernel.problem
    before = all_states(kernel, state, layers)
    kernel.packed_step(state, **call.kwargs(), layer=layer)
    _fault_named(kernel, fault, f"packed call ({describe(call)})", "engine/packed-offsets-guard")
    after = all_states(kernel, state, layers)
    pad = torch.zeros(p.num_slots, dtype=torch.bool)  # a null block's contents mean nothing
    if p.pad_in_cache:
        pad[p.pad_slot_id] = True
    named, mine = pad.clone(), torch.zeros_like(pad)  # slots any table names; those of the sequence
    for table in (call.slots, call.dst_slots):
        if table is None:
            continue
        ids = table.cpu().long()
        inside = (ids >= 0) & (ids < p.num_slots)
        named[ids[inside]] = True
        mine[ids[sequence][inside[sequence]]] = True
    mine &= ~pad
    for other in range(layers):
        keep = (~named | mine) if other == layer else ~pad
        if not torch.equal(after[other][keep], before[other][keep]):
            moved = torch.nonzero((after[other] != before[other]).flatten(1).any(1) & keep).flatten().tolist()
            whose = f"sequence {sequence}'s" if mine[moved[0]] and other == layer else "no table's"
            raise CheckFailure(
                f"packed call ({describe(call)}) with wrong offsets for sequence {sequence}: slot {moved[0]} of "
                f"layer {other}, {whose}, changed",
                "engine/packed-offsets-guard",
            )


def check_verify(
    kernel,
    state,
    call: VerifyCall,
    layer: int = 0,
    layers: int = 1,
    *,
    served_as=None,
    fault=None,
    unspecified=(),
    refusable: bool = False,
    rule: str = "",
) -> bool:
    """Run ``call`` on ``layer`` of ``state`` and raise :class:`CheckFailure` where the outputs, the
    buffer rows it writes, the slots it writes, or anything else it must leave alone are wrong. A
    call with a value the backend guards passes ``served_as`` (the valid call the spec serves it
    as, sharing ``call``'s buffer), ``fault`` (what ``check()`` must name) and ``unspecified`` (rows
    whose outputs the spec leaves open). With ``refusable`` the backend may refuse the call with an
    InputError (a buffer dtype it does not take): False is returned then, True once checked."""
    import torch

    p = kernel.problem
    before = all_states(kernel, state, layers)
    served = call if served_as is None else served_as
    heads = _per_head(served)
    buffer_before = None if call.buffer is None else call.buffer.clone()
    reading = dict(
        pad_slot_id=p.pad_slot_id, update_state=served.update_state, buffer=served.buffer,
        buffer_rows=None if served.buffer_rows is None else served.buffer_rows.cpu(),
        parents=None if served.parents is None else served.parents.cpu(), D=heads["D"], z=served.z,
        dt_bias=heads["dt_bias"], dt_softplus=served.dt_softplus,
    )  # fmt: skip

    def verify_oracle(**misread):
        args = (before[layer], served.x, heads["dt"], heads["A"], served.B, served.C, served.slots.cpu())
        return oracle.verify_math64(*args, **dict(reading, **misread))

    want_cache, want_buffer, want_out = verify_oracle()
    try:
        out = kernel.verify_step(state, **call.kwargs(), layer=layer)
    except InputError:
        if refusable and (call.buffer is None or torch.equal(call.buffer, buffer_before)):
            return False
        raise
    _fault_named(kernel, fault, f"verify call ({describe(call)})", rule)
    expect_out(f"the verify call ({describe(call)})", call.out, call.x, out)
    T = call.x.shape[1]
    compared = torch.ones(call.x.shape[0], dtype=torch.bool)  # pad rows too: y from a zero state
    for row in unspecified:
        compared[row] = False
    out_tol = oracle.tolerances(p, T)[0]
    if call.buffer is not None and call.parents is not None:  # parents come back rounded to the buffer
        out_tol = max(out_tol, oracle.state_tolerance(_dtype(call.buffer), T))

    def misread(part: int) -> list:  # part 2: the outputs, 1: the intermediate states (their first T steps)
        def result(**m):
            return verify_oracle(**m)[part][:, :x_tokens] if part == 1 else verify_oracle(**m)[part]

        found = _misreadings(reading, result, served.x)
        if reading["parents"] is not None:
            found.insert(0, ("engine/verify-parents", "parents ignored (each token after the one before)",
                             lambda: result(parents=None)))  # fmt: skip
        return found

    x_tokens = served.x.shape[1]

    _expect_outputs(f"verify call ({describe(call)}): outputs", out, want_out, compared, out_tol, misread(2))
    if call.buffer is not None:
        rows = sorted(
            int(r) for r in torch.nonzero((want_buffer != buffer_before.double()).flatten(1).any(1)).flatten()
        )
        untouched = [r for r in range(call.buffer.shape[0]) if r not in rows]
        if not torch.equal(call.buffer[untouched], buffer_before[untouched]):
            raise CheckFailure("verify call: a buffer row the call does not write changed", "engine/verify-buffer-rows")
        state_tol = oracle.state_tolerance(_dtype(call.buffer), T)
        what = f"verify call ({describe(call)}): intermediate states"
        _expect_outputs(what, call.buffer[:, :T], want_buffer[:, :T], rows, state_tol, misread(1))
        if not torch.equal(call.buffer[rows, T:], buffer_before[rows, T:]):
            raise CheckFailure("verify call: buffer steps past the call's tokens changed", "engine/verify-step-index")
    after = all_states(kernel, state, layers)
    for other in range(layers):
        if other != layer and not torch.equal(after[other], before[other]):
            raise CheckFailure(f"verify call on layer {layer}: layer {other} changed", "layers/independent")
    stored = (served.slots != p.pad_slot_id).cpu()
    written = [int(s) for s in served.slots.cpu()[stored]] if served.update_state else []
    carried = _dtype(call.buffer) if call.buffer is not None and call.parents is not None else None
    _compare_states(kernel, "verify call", after[layer], want_cache, before[layer], sorted(written), T, carried)
    return True


def _misreadings(reading: dict, outputs, x) -> list:
    """Readings of a call's per-head inputs a backend may take instead of the spec's, each as (the
    rule it breaks, what it does, what it gives): softplus's flag the other way round, each of D,
    z and dt_bias given but left out, and no z taken as a gate of zeros. ``outputs(**misread)``:
    the oracle's result compared (outputs, or intermediate states)."""
    import torch

    found = [("one-token/softplus-flag", f"dt_softplus read as {not reading['dt_softplus']}",
              lambda: outputs(dt_softplus=not reading["dt_softplus"]))]  # fmt: skip
    for name in ("D", "z", "dt_bias"):
        if reading[name] is not None:
            found.append(("engine/optional-inputs", f"{name} left out", lambda name=name: outputs(**{name: None})))
    if reading["z"] is None:
        found.append(("engine/optional-inputs", "no z taken as a gate of zeros",
                      lambda: outputs(z=torch.zeros_like(x))))  # fmt: skip
    return found


def _expect_outputs(what: str, out, want, rows, tol: float, misreadings) -> None:
    """The outputs of ``rows`` within ``tol`` of the oracle's; else a failure naming the rule of the
    first misreading whose outputs they are (within the same budget), or the group ``engine``
    when none explains them (a wrong recurrence, which any rule of the call may break)."""
    try:
        expect_close(what, out[rows], want[rows], tol)
    except CheckFailure as failure:
        for rule, says, outputs in misreadings:
            if oracle.rel_error(out[rows], outputs()[rows]) <= tol:
                raise CheckFailure(f"{failure}; they match the call read with {says}", rule) from None
        raise CheckFailure(str(failure), "engine") from None


def _same(a, b) -> bool:
    """Bit for bit equal, NaN included."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def describe(call) -> str:
    """The knobs of an engine call in one line: which optional arguments it was given, how its
    tables, buffer and inputs are laid out, and its dtypes (what a failure names beside the case)."""

    def layout(t) -> str:
        if t is None:
            return "none"
        if t.is_contiguous():
            return "contiguous"
        if t.dim() == 2 and t.stride(0) == 1:
            return "transposed"
        return "strided " + "x".join(str(v) for v in t.stride())

    parts = []
    if isinstance(call, PackedCall):
        parts.append(f"tokens={call.x.shape[0]} sequences={call.slots.shape[0]} W={call.slots.shape[1]}")
        parts.append(
            "offsets=" + ("none" if call.cu_seqlens is None else ",".join(str(int(v)) for v in call.cu_seqlens.cpu()))
        )
        parts.append(
            "counts="
            + ("none" if call.num_accepted is None else ",".join(str(int(v)) for v in call.num_accepted.cpu()))
        )
        parts.append(f"slots={layout(call.slots)} {_dtype(call.slots)}")
        parts.append(f"dst_slots={layout(call.dst_slots)}")
    else:
        parts.append(f"rows={call.x.shape[0]} T={call.x.shape[1]} update_state={call.update_state}")
        parts.append(f"slots {_dtype(call.slots)}")
        if call.buffer is None:
            parts.append("buffer=none")
        else:
            parts.append(f"buffer={_dtype(call.buffer)} {layout(call.buffer)} rows={call.buffer.shape[0]}")
            parts.append("buffer_rows=" + ("slots" if call.buffer_rows is None else "given"))
        parts.append(f"parents={layout(call.parents)}")
    parts.append(f"inputs={layout(call.x)} {_dtype(call.x)}")
    parts.append(f"out={'given ' + layout(call.out) if call.out is not None else 'None'}")
    parts.append("per-head=" + ("expanded" if call.A.dim() == 3 else "(H,)"))
    for name in ("D", "dt_bias"):
        t = getattr(call, name)
        parts.append(f"{name}=" + ("none" if t is None else _dtype(t)))
    parts.append(f"z={'yes' if call.z is not None else 'no'} softplus={'yes' if call.dt_softplus else 'no'}")
    return " ".join(parts)


def _dtype(t) -> str:
    from ..contract.dtypes import dtype_name

    return dtype_name(t.dtype)
