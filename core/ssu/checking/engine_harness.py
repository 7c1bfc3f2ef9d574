"""An engine call checked against the float64 oracle (docs/spec.md, "Engine call forms"): what the
conformance kit and the backends' tests run on a call of :mod:`.call_draws`.

:func:`check_packed` and :func:`check_verify` run one call on a kernel's state and compare the
outputs, every slot's logical state (those the call writes against the oracle, the others bit for
bit) and the buffer; a failure names the rule the outputs break and the call's knobs
(:func:`describe`). The drawing API (:mod:`.call_draws`, :mod:`.call_layouts`) is re-exported
here under its names.
"""

from __future__ import annotations

from typing import Optional

from . import oracle
from ..contract.errors import InputError
from .call_draws import PackedCall, VerifyCall, draw_packed, draw_verify
from .call_layouts import BUFFER_LAYOUTS, INPUT_LAYOUTS, TABLE_LAYOUTS, buffer_laid_out, laid_out, table_laid_out
from .harness import CheckFailure, expect_close, expect_out, expect_rounded

__all__ = [
    "BUFFER_LAYOUTS",
    "INPUT_LAYOUTS",
    "TABLE_LAYOUTS",
    "PackedCall",
    "VerifyCall",
    "all_states",
    "buffer_laid_out",
    "check_packed",
    "check_packed_sequence_dropped",
    "check_verify",
    "describe",
    "draw_packed",
    "draw_verify",
    "fault_label",
    "laid_out",
    "table_laid_out",
]


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
