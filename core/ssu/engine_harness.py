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
from .errors import InputError
from .harness import CheckFailure, expect_close, expect_rounded, real_slots
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

    def kwargs(self) -> dict:
        return attrs.asdict(self, recurse=False)


def _inputs(problem, lead: tuple, gen, *, expanded: bool, with_z: bool, weights: Optional[dict]) -> dict:
    """Random x, dt, B, C, z and a layer's weights for tensors whose leading dimensions are ``lead``
    (dt and the per-head weights expanded over P and N with stride 0 where ``expanded``)."""
    import torch

    from .dtypes import to_torch

    p = problem
    dtype = to_torch(p.input_dtype)
    weights = layer_weights(p, gen) if weights is None else weights

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(p.device)

    dt = (torch.rand(*lead, p.nheads, generator=gen) * 3.0 - 2.0).to(dtype).to(p.device)
    A, D, bias = weights["A"], weights.get("D"), weights.get("dt_bias")
    if expanded:
        dt = dt[..., None].expand(*dt.shape, p.headdim)
        A = A[:, None, None].expand(-1, p.headdim, p.dstate)
        D = None if D is None else D[:, None].expand(-1, p.headdim)
        bias = None if bias is None else bias[:, None].expand(-1, p.headdim)
    return dict(
        x=draw(*lead, p.nheads, p.headdim),
        dt=dt,
        A=A,
        B=draw(*lead, p.ngroups, p.dstate, scale=0.5),
        C=draw(*lead, p.ngroups, p.dstate, scale=0.5),
        D=D,
        z=draw(*lead, p.nheads, p.headdim) if with_z else None,
        dt_bias=bias,
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
) -> PackedCall:
    """A random valid ``packed`` call of ``sequences`` sequences and tables ``width`` wide (default
    the problem's tokens per step): each sequence ``lengths[n]`` tokens (random 0..width by
    default; 1 each without ``packed``, which passes no offsets) and ``accepted[n]`` accepted
    tokens (random 0..width; None: no counts). The last ``padded`` sequences start from the pad id,
    ``pad_cells`` destination cells of the others hold it. Each sequence owns its own row of
    slots; with ``own_destinations`` the destinations are another table of fresh slots, else the
    same table (what vLLM passes)."""
    import torch

    p = problem
    W = p.tokens_per_step if width is None else width
    index_dtype = index_dtype or torch.int32
    if not packed:
        lengths = [1] * sequences
    elif lengths is None:
        lengths = torch.randint(0, W + 1, (sequences,), generator=gen).tolist()
    if accepted is None and packed:
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
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=index_dtype)
    tokens = int(offsets[-1])
    call = PackedCall(
        slots=slots.to(index_dtype).to(p.device),
        dst_slots=dst.to(index_dtype).to(p.device) if own_destinations else None,
        num_accepted=None if accepted is None else torch.tensor(accepted, dtype=torch.int32, device=p.device),
        cu_seqlens=offsets.to(p.device) if packed else None,
        **_inputs(p, (tokens,), gen, expanded=expanded, with_z=with_z, weights=weights),
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
) -> VerifyCall:
    """A random valid ``verify`` call of ``rows`` rows of ``tokens`` tokens (default the problem's),
    the last ``padded`` of them pad rows; an intermediate-state buffer of ``buffer_dtype`` (None:
    none) with a row per call row (``buffer_rows``: given in a shuffled order, else the slots,
    the buffer then as many rows as the cache), and with ``parents`` a random tree (each token's
    parent one of the tokens before it; token 0's -1); ``steps`` a buffer row (default T + 1)."""
    import torch

    from .dtypes import to_torch

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
        buffer = buffer.to(to_torch(buffer_dtype)).to(p.device)
        if buffer_rows:
            order = torch.randperm(rows, generator=gen).to(index_dtype).to(p.device)
    tree = None
    if parents:
        tree = torch.full((rows, T), -1, dtype=torch.int64)
        for t in range(1, T):
            tree[:, t] = torch.randint(0, t, (rows,), generator=gen)
        tree = tree.to(p.device)
    return VerifyCall(
        slots=slots.to(index_dtype).to(p.device),
        update_state=update_state,
        buffer=buffer,
        buffer_rows=order,
        parents=tree,
        **_inputs(p, (rows, T), gen, expanded=expanded, with_z=with_z, weights=weights),
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


def _fault_named(kernel, fault: Optional[str], what: str) -> None:
    """After a call: with ``fault`` (a label of :func:`ssu.faults.engine_label`), ``check()`` must
    raise naming it; without, it must not raise (an InputError then propagates: a valid call
    refused)."""
    import re

    if fault is None:
        kernel.check()
        return
    try:
        kernel.check()
    except InputError as exc:
        if not re.search(rf"(?<![\w.]){re.escape(fault)}", str(exc)):
            raise CheckFailure(
                f"{what}: check() should name {fault}, but reported: {exc}", "engine/fault-key"
            ) from None
        return
    guards = "engine/packed-guards" if what.startswith("packed") else "engine/verify-guards"
    raise CheckFailure(f"{what}: {fault} was not recorded (check() raised nothing)", guards)


def check_packed(
    kernel, state, call: PackedCall, layer: int = 0, layers: int = 1, *, served_as=None, fault=None
) -> None:
    """Run ``call`` on ``layer`` of ``state`` and raise :class:`CheckFailure` where the outputs, the
    slots it writes (within the budgets) or any other slot or layer (bit for bit) are wrong. A call
    with a value the backend guards passes ``served_as`` (the valid call the spec serves it as: the
    oracle runs that) and ``fault`` (what ``check()`` must then name)."""
    import torch

    p = kernel.problem
    before = all_states(kernel, state, layers)
    served = call if served_as is None else served_as
    heads = _per_head(served)
    want_cache, want_out = oracle.packed_math64(
        before[layer], served.x, heads["dt"], heads["A"], served.B, served.C, served.slots.cpu(),
        pad_slot_id=p.pad_slot_id, dst_slots=None if served.dst_slots is None else served.dst_slots.cpu(),
        num_accepted=None if served.num_accepted is None else served.num_accepted.cpu(),
        cu_seqlens=None if served.cu_seqlens is None else served.cu_seqlens.cpu(), D=heads["D"], z=served.z,
        dt_bias=heads["dt_bias"], dt_softplus=served.dt_softplus,
    )  # fmt: skip
    out = kernel.packed_step(state, **call.kwargs(), layer=layer)
    _fault_named(kernel, fault, "packed call")
    owned = ~torch.isnan(want_out.flatten(1)[:, 0])
    W = call.slots.shape[1]
    expect_close("packed call: outputs", out[owned], want_out[owned], oracle.tolerances(p, W)[0])
    written = sorted(int(s) for s in torch.nonzero((want_cache != before[layer].double()).flatten(1).any(1)).flatten())
    after = all_states(kernel, state, layers)
    for other in range(layers):
        if other != layer and not torch.equal(after[other], before[other]):
            raise CheckFailure(f"packed call on layer {layer}: layer {other} changed", "layers/independent")
    _compare_states(kernel, "packed call", after[layer], want_cache, before[layer], written, W)


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
    want_cache, want_buffer, want_out = oracle.verify_math64(
        before[layer], served.x, heads["dt"], heads["A"], served.B, served.C, served.slots.cpu(),
        pad_slot_id=p.pad_slot_id, update_state=served.update_state, buffer=served.buffer,
        buffer_rows=None if served.buffer_rows is None else served.buffer_rows.cpu(),
        parents=None if served.parents is None else served.parents.cpu(), D=heads["D"], z=served.z,
        dt_bias=heads["dt_bias"], dt_softplus=served.dt_softplus,
    )  # fmt: skip
    try:
        out = kernel.verify_step(state, **call.kwargs(), layer=layer)
    except InputError:
        if refusable and (call.buffer is None or torch.equal(call.buffer, buffer_before)):
            return False
        raise
    _fault_named(kernel, fault, "verify call")
    T = call.x.shape[1]
    real = (served.slots != p.pad_slot_id).cpu()
    for row in unspecified:
        real[row] = False
    out_tol = oracle.tolerances(p, T)[0]
    if call.buffer is not None and call.parents is not None:  # parents come back rounded to the buffer
        out_tol = max(out_tol, oracle.state_tolerance(_dtype(call.buffer), T))
    expect_close("verify call: outputs", out[real], want_out[real], out_tol)
    if call.buffer is not None:
        rows = sorted(
            int(r) for r in torch.nonzero((want_buffer != buffer_before.double()).flatten(1).any(1)).flatten()
        )
        untouched = [r for r in range(call.buffer.shape[0]) if r not in rows]
        if not torch.equal(call.buffer[untouched], buffer_before[untouched]):
            raise CheckFailure("verify call: a buffer row the call does not write changed", "engine/verify-buffer-rows")
        steps = call.buffer[rows, :T]
        expect_close(
            "verify call: intermediate states",
            steps,
            want_buffer[rows, :T],
            oracle.state_tolerance(_dtype(call.buffer), T),
        )
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


def _dtype(t) -> str:
    from .dtypes import dtype_name

    return dtype_name(t.dtype)
