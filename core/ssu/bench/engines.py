"""ssu against the SSU kernel an engine runs today, on that engine's exact call: what ``ssu bench
--engine vllm|sglang`` measures.

Each cell (an engine's call form, a state dtype, a batch) builds the call as the engine's Mamba2
mixer makes it, with the engine's argument names: dt expanded over P, A over P and N, D and dt_bias
over P, all with stride 0; vLLM's (N, 1) tables with null block 0 for a decode step, and its packed
speculative call (``cu_seqlens``, (N, T) tables, ``num_accepted_tokens``); SGLang's slots with pad
id -1 for a decode step, and its verify call (x (b, T, H, P), an intermediate-state buffer in the
cache's dtype, EAGLE parent tokens, the cache left alone). The same keyword arguments go to the
engine's kernel and, for each ssu backend, to ``ssu.selective_state_update`` with that backend
configured, as the engine plugins call it. Before any timing, each ssu backend's outputs and
written states are compared with the engine kernel's on the same call (within the spec's error
budgets of both sides); then every contender is timed the same way: CUDA-graph replays of calls
that rotate over disjoint slot sets of one large cache (each graph spans at least
:data:`~ssu.bench.measure.COLD_BYTES` of state), the median.
"""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from .measure import COLD_BYTES, packed_lengths

#: each engine's call forms, as its mixer makes them
FORMS = {"vllm": ("decode", "speculative"), "sglang": ("decode", "verify")}
#: tokens a sequence of a speculative form carries (3 draft tokens)
SPECULATIVE_TOKENS = 4


@attrs.frozen
class Cell:
    """One measured cell: each contender's microseconds per call (the engine's kernel first), the
    bytes the call must move, and each ssu backend's largest relative differences from the
    engine's kernel (outputs, written states)."""

    engine: str
    form: str
    state_dtype: str
    batch: int
    tokens: int
    times: tuple  # ((contender, us), ...)
    floor_bytes: int
    differences: tuple  # ((backend, output, states), ...)

    def us(self, contender: str) -> Optional[float]:
        return dict(self.times).get(contender)

    def to_dict(self) -> dict:
        return dict(attrs.asdict(self), times=dict(self.times), differences={b: [o, s] for b, o, s in self.differences})


@attrs.frozen
class Calls:
    """The calls of one cell: the engine's cache (and buffer), one keyword set per slot set."""

    state: object
    sets: list
    buffer: object = None
    #: the bytes one call must move: each sequence's state read once, each state it writes written once
    floor_bytes: int = 0
    #: the cache rows the first call reads or writes, and the rows it writes (of the buffer for
    #: SGLang's verify call): what the check restores between contenders and compares
    touched: object = None
    written: object = None


def build(engine: str, form: str, shapes: dict, state_dtype: str, input_dtype: str, batch: int, device: str,
          *, cold_bytes: int = COLD_BYTES, seed: int = 0) -> Calls:  # fmt: skip
    """The calls of one cell (see the module's docstring); ``shapes`` holds nheads, headdim,
    dstate and ngroups."""
    import torch

    from ..contract.dtypes import state_slot_bytes, to_torch
    from ..checking.inputs import layer_weights
    from ..contract.problem import Problem

    H, P, N, G = (shapes[k] for k in ("nheads", "headdim", "dstate", "ngroups"))
    T = SPECULATIVE_TOKENS if form in ("speculative", "verify") else 1
    slot = state_slot_bytes(H, P, N, state_dtype)
    lengths = packed_lengths(batch, T) if form == "speculative" else [T] * batch
    writes = sum(lengths)
    sets = max(2, min(64, -(-cold_bytes // (writes * slot)))) if device.startswith("cuda") else 2
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed + 1)
    problem = Problem(nheads=H, headdim=P, dstate=N, ngroups=G, input_dtype=input_dtype, device=device)
    weights = layer_weights(problem, gen, D_dtype=input_dtype)
    A = weights["A"].float()[:, None, None].expand(H, P, N)
    D = weights["D"][:, None].expand(H, P)
    dt_bias = weights["dt_bias"][:, None].expand(H, P)
    dtype, sdtype = to_torch(input_dtype), to_torch(state_dtype)
    per_set = batch * T if engine == "vllm" else batch
    first = 1 if engine == "vllm" else 0  # vLLM's slot 0 is the null block
    state = torch.randn((first + sets * per_set, H, P, N), generator=dev_gen, device=device).to(sdtype)
    buffer = None
    if form == "verify":
        buffer = torch.randn((sets * batch, T, H, P, N), generator=dev_gen, device=device).to(sdtype)

    def rows(lead: tuple) -> dict:
        x = torch.randn((*lead, H, P), generator=dev_gen, device=device).to(dtype)
        dt = (torch.rand((*lead, H), generator=dev_gen, device=device) * 2 - 3).to(dtype)
        BC = torch.randn((2, *lead, G, N), generator=dev_gen, device=device).to(dtype)
        return dict(x=x, dt=dt[..., None].expand(*lead, H, P), B=BC[0], C=BC[1], out=torch.empty_like(x))

    calls, touched, written = [], [], []
    for s in range(sets):
        base = first + s * per_set
        call = dict(A=A, D=D, dt_bias=dt_bias, dt_softplus=True)
        if engine == "vllm":
            ids = torch.arange(base, base + per_set, dtype=torch.int32, device=device).view(batch, T)
            call.update(state_batch_indices=ids, dst_state_batch_indices=ids, null_block_id=0)
            touched.append(ids.reshape(-1).long())
            if form == "decode":
                call.update(rows((batch,)))
                written.append(ids[:, 0].long())
            else:
                cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
                counts = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32).to(device)
                call.update(rows((writes,)), cu_seqlens=cu, num_accepted_tokens=counts)
                keep = torch.arange(T, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
                written.append(ids[keep].long())
        else:
            slots = torch.arange(base, base + batch, dtype=torch.int32, device=device)
            call.update(state_batch_indices=slots, pad_slot_id=-1)
            touched.append(slots.long())
            if form == "decode":
                call.update(rows((batch,)))
                written.append(slots.long())
            else:
                parents = torch.full((batch, T), -1, dtype=torch.int64)
                for t in range(1, T):
                    parents[:, t] = torch.randint(0, t, (batch,), generator=gen)
                call.update(rows((batch, T)), disable_state_update=True, intermediate_states_buffer=buffer,
                            cache_steps=T, retrieve_parent_token=parents.to(device),
                            intermediate_state_indices=torch.arange(s * batch, (s + 1) * batch, dtype=torch.int32,
                                                                    device=device))  # fmt: skip
                written.append(torch.arange(s * batch, (s + 1) * batch, device=device))
        calls.append(call)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    io = writes * (2 * H * P + 2 * G * N + H) * itemsize  # x, out, B, C, dt per token
    floor = batch * slot + writes * slot + io
    return Calls(state, calls, buffer, floor, touched[0], written[0])


def compare(engine: str, form: str, calls: Calls, kernel: Callable, serve: Callable) -> tuple:
    """The largest relative differences (outputs, written states) between ``serve`` (an ssu
    contender) and ``kernel`` (the engine's) on the first call of ``calls``, each run from the same
    cache (and buffer) rows, which are put back after each."""
    from ..checking.oracle import rel_error

    call, state, buffer = calls.sets[0], calls.state, calls.buffer
    saved = state[calls.touched].clone()
    saved_buffer = None if buffer is None else buffer[calls.written].clone()
    results = []
    for fn in (kernel, serve):
        out = call["out"].clone().fill_(float("nan"))
        fn(state, **dict(call, out=out))
        results.append((out, (buffer if form == "verify" else state)[calls.written].clone()))
        state[calls.touched] = saved
        if buffer is not None:
            buffer[calls.written] = saved_buffer
    (theirs_out, theirs), (ours_out, ours) = results
    return _rel_error_by_rows(ours_out, theirs_out, rel_error), _rel_error_by_rows(ours, theirs, rel_error)


def _rel_error_by_rows(actual, expected, rel_error, rows: int = 32) -> float:
    """:func:`ssu.checking.oracle.rel_error` of two large tensors, taken ``rows`` leading rows at a time, so
    that no float64 copy of a whole cache is made (the states a batch of 512 writes over four
    tokens are several GB)."""
    import math

    if actual.shape != expected.shape:
        return rel_error(actual, expected)  # raises, naming the shapes
    if actual.dim() == 0 or actual.shape[0] <= rows:
        return rel_error(actual, expected)
    worst_diff, scale = 0.0, 1e-30
    for i in range(0, actual.shape[0], rows):
        a, e = actual[i : i + rows].double(), expected[i : i + rows].double()
        if not bool(a.isfinite().all()):
            return math.inf
        worst_diff = max(worst_diff, (a - e).abs().max().item())
        scale = max(scale, e.abs().max().item())
    return worst_diff / scale


def budgets(state_dtype: str, input_dtype: str, tokens: int) -> tuple:
    """How far two correct implementations may differ: twice the spec's budget of each side
    (output, states)."""
    from ..checking.oracle import output_tolerance, state_tolerance

    return 2 * output_tolerance(input_dtype, tokens), 2 * state_tolerance(state_dtype, tokens)


def drop_in(backend: str) -> Callable:
    """``ssu.selective_state_update`` with ``backend`` configured, as an engine plugin calls it."""
    from ..plugins.config import Config
    from ..dropin import selective_state_update

    config = Config(backend=backend)

    def call(state, x, dt, A, B, C, **kwargs):
        return selective_state_update(state, x, dt, A, B, C, config=config, **kwargs)

    return call


def table(cells: list, contenders: list, engine: str, ceiling: Optional[float]) -> str:
    """The cells as a table: per form, state dtype and batch, each contender's microseconds, each
    ssu backend's time over the engine kernel's, and (with a copy ceiling) each contender's share
    of the call's traffic floor."""
    head = ["form", "state", "batch"] + [f"{c} us" for c in contenders]
    ours = [c for c in contenders if c != engine]
    head += [f"{c}/{engine}" for c in ours]
    if ceiling:
        head += [f"{c} %floor" for c in contenders]
    rows = [head]
    for cell in cells:
        row = [cell.form, cell.state_dtype, str(cell.batch)]
        row += ["-" if cell.us(c) is None else f"{cell.us(c):.2f}" for c in contenders]
        base = cell.us(engine)
        row += ["-" if cell.us(c) is None or not base else f"{cell.us(c) / base:.3f}" for c in ours]
        if ceiling:
            floor_us = cell.floor_bytes / ceiling / 1e6
            row += ["-" if cell.us(c) is None else f"{100 * floor_us / cell.us(c):.0f}" for c in contenders]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)
