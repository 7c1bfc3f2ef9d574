"""Small fixed scenarios that drive one backend through ``ssu.open`` and return what it computed,
so that a mutant's result can be compared with the ``independent`` backend's on the same call.

Nothing here uses the conformance kit. Each scenario opens a kernel for a small problem, sets every
real slot of every layer to fixed random states, makes one call (a step, a commit, an engine call,
a read or a write) with inputs drawn from a fixed seed, and returns an *observation*: a dict of the
outputs, the logical states of every slot of every layer, the engine's pages where a cache was
adopted, and the message of the fault record (``kernel.check()``). :func:`differs` compares two
observations.
"""

from __future__ import annotations

import importlib.metadata
import math
from typing import Optional

import torch

import ssu
from ssu.contract.dtypes import to_torch
from ssu.plugins.registry import GROUP, Registry

#: two observations differ when a tensor differs by more than this, relative to its largest value:
#: above every error budget of docs/spec.md for the fp32 problems the scenarios use, so a
#: difference this large from a conformant backend is an error of the other
RELATIVE = 1e-4


def registry_with(*plugins) -> Registry:
    """A registry holding the reference backend and the given plugin objects."""
    reference = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == "reference"]
    registry = Registry(entry_points=reference, env={})
    for plugin in plugins:
        registry.register(plugin)
    return registry


def problem(**fields) -> ssu.Problem:
    """A small problem: 4 heads in 2 groups, P = 3, N = 5, fp32 everywhere, 6 slots."""
    base = dict(nheads=4, headdim=3, dstate=5, ngroups=2, state_dtype="fp32", input_dtype="fp32",
                num_slots=6, max_batch=4)  # fmt: skip
    base.update(fields)
    return ssu.Problem(**base)


class Bench:
    """One kernel of backend ``name`` for ``p`` and its state, every real slot of every layer set
    to fixed random states (an adopted cache: random engine pages, two slot blocks a page)."""

    def __init__(self, registry, name: str, p: ssu.Problem, *, layers: int = 2, adopt: bool = False, seed: int = 0):
        self.p = p
        self.gen = torch.Generator().manual_seed(seed)
        self.kernel = ssu.open(ssu.Config(backend=name), p, registry=registry)
        self.pages = []
        self.scale_pages = []
        if adopt:
            for _ in range(layers):
                values = torch.randn(p.num_slots, 2, p.nheads, p.headdim, p.dstate, generator=self.gen)
                if p.quantized:
                    values = (values * 40).clamp(-100, 100)
                    values = values.round() if p.state_dtype == "int8" else values
                    self.scale_pages.append(torch.rand(p.num_slots, 2, p.nheads, p.headdim, generator=self.gen) + 0.5)
                self.pages.append(values.to(to_torch(p.state_dtype)))
            caches = [page[:, 0] for page in self.pages]
            scales = [page[:, 0] for page in self.scale_pages] or None
            self.state = self.kernel.adopt_state(caches, scales=scales)
        else:
            self.state = self.kernel.allocate_state(layers)
            real = self.real_slots()
            for layer in range(layers):
                values = torch.randn(len(real), p.nheads, p.headdim, p.dstate, generator=self.gen)
                self.kernel.write_state(self.state, real, values, layer)

    def real_slots(self):
        """Every slot but a pad slot inside the cache (int64)."""
        every = torch.arange(self.p.num_slots)
        return every[every != self.p.pad_slot_id] if self.p.pad_in_cache else every

    def ids(self, values, dtype=torch.int32):
        """A contiguous id vector (or table)."""
        return torch.tensor(values, dtype=dtype)

    def draw(self, *shape, scale: float = 1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(to_torch(self.p.input_dtype))

    def weights(self, *, D: bool = True, dt_bias: bool = True, tied: bool = False) -> dict:
        """A, D and dt_bias of one layer (fp32), expanded over P and N with ``tied``."""
        p = self.p
        A = -(torch.rand(p.nheads, generator=self.gen) * 2.0 + 0.5)
        Dv = torch.randn(p.nheads, generator=self.gen) if D else None
        bias = (torch.rand(p.nheads, generator=self.gen) - 0.5) if dt_bias else None
        if tied:
            A = A[:, None, None].expand(-1, p.headdim, p.dstate)
            Dv = None if Dv is None else Dv[:, None].expand(-1, p.headdim)
            bias = None if bias is None else bias[:, None].expand(-1, p.headdim)
        return dict(A=A, D=Dv, dt_bias=bias)

    def inputs(self, lead: tuple, *, z: bool = True, D: bool = True, dt_bias: bool = True, softplus: bool = True,
               dt: Optional[float] = None, tied: bool = False) -> dict:  # fmt: skip
        """x, dt, B, C, z and the weights for tensors whose leading dimensions are ``lead``;
        ``dt`` fixes every raw time step to that value."""
        p = self.p
        raw = torch.rand(*lead, p.nheads, generator=self.gen) - 0.5 if dt is None else torch.full((*lead, p.nheads), dt)
        raw = raw.to(to_torch(p.input_dtype))
        if tied:
            raw = raw[..., None].expand(*raw.shape, p.headdim)
        call = dict(
            x=self.draw(*lead, p.nheads, p.headdim),
            dt=raw,
            B=self.draw(*lead, p.ngroups, p.dstate, scale=0.5),
            C=self.draw(*lead, p.ngroups, p.dstate, scale=0.5),
            z=self.draw(*lead, p.nheads, p.headdim) if z else None,
            dt_softplus=softplus,
        )
        call.update(self.weights(D=D, dt_bias=dt_bias, tied=tied))
        return call

    def step_inputs(self, batch: int, **knobs) -> dict:
        p = self.p
        return self.inputs((batch, p.tokens_per_step) if p.speculative else (batch,), **knobs)

    def states(self) -> list:
        """Every slot's logical state (zeros for a pad slot) of every layer, fp32."""
        out = []
        real = self.real_slots()
        for layer in range(self.state.num_layers):
            values = torch.zeros(self.p.num_slots, self.p.nheads, self.p.headdim, self.p.dstate)
            values[real] = self.kernel.read_state(self.state, real, layer)
            out.append(values)
        return out

    def fault(self) -> Optional[str]:
        """The fault record's message (None: nothing recorded); clears it."""
        try:
            self.kernel.check()
        except ssu.InputError as exc:
            return str(exc)
        return None

    def observe(self, **values) -> dict:
        """``values``, the fault record, every layer's logical states and the engine's pages."""
        seen = dict(values)
        seen["fault"] = self.fault()
        seen["states"] = self.states()
        if self.pages:  # a null block's contents mean nothing (docs/spec.md): left out
            pages = [page.float() for page in self.pages] + [page.clone() for page in self.scale_pages]
            if self.p.pad_in_cache:
                for page in pages:
                    page[self.p.pad_slot_id] = 0.0
            seen["pages"] = pages
        return seen


def _slot_list(p, wanted):
    """``wanted`` with ``"pad"`` replaced by the problem's pad id."""
    return [p.pad_slot_id if s == "pad" else s for s in wanted]


def step(registry, name, *, problem_fields=None, slots=(4, 1, "pad", 2), dst=None, layer=1, out=True, layers=2,
         adopt=False, index=torch.int32, commit=None, layout="contiguous", seed=0, **knobs) -> dict:  # fmt: skip
    """One step of ``layer`` (and, with ``commit`` a list of counts, one commit), observed.
    ``layout``: "contiguous", "projection" (x a slice of a wider projection output), "transposed"
    (B and C transposed views), "token-rows" (x of a speculative step with its token rows apart)."""
    p = problem(**(problem_fields or {}))
    bench = Bench(registry, name, p, layers=layers, adopt=adopt, seed=seed)
    ids = bench.ids(_slot_list(p, slots), index)
    call = bench.step_inputs(len(ids), **knobs)
    call = _laid_out(call, layout)
    given = torch.full(call["x"].shape, math.nan, dtype=call["x"].dtype) if out else None
    dst_ids = None if dst is None else bench.ids(_slot_list(p, dst), index)
    result = bench.kernel.step(bench.state, **call, slots=ids, out=given, layer=layer, dst_slots=dst_ids)
    seen = dict(out=result, returned_given=(result is given) if out else None)
    if commit is not None:
        bench.kernel.commit(bench.state, ids, torch.tensor(commit, dtype=torch.int32))
    return bench.observe(**seen)


def _laid_out(call: dict, layout: str) -> dict:
    """The step's tensors as a view of the layout named (same values)."""
    if layout == "contiguous":
        return call
    call = dict(call)
    if layout == "projection":  # x: the first H*P columns of a wider projection output
        x = call["x"]
        wide = torch.zeros(*x.shape[:-2], x.shape[-2] * x.shape[-1] + 7, dtype=x.dtype)
        view = wide[..., : x.shape[-2] * x.shape[-1]].unflatten(-1, x.shape[-2:])
        view.copy_(x)
        call["x"] = view
    elif layout == "transposed":  # B and C: (b, N, G) tensors seen as (b, G, N)
        for name in ("B", "C"):
            t = call[name]
            call[name] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif layout == "token-rows":  # x (b, T, H, P) with each token's row 5 values longer than H*P
        x = call["x"]
        b, T, H, P = x.shape
        wide = torch.zeros(b, T, H * P + 5, dtype=x.dtype)
        view = wide[..., : H * P].unflatten(-1, (H, P))
        view.copy_(x)
        call["x"] = view
    else:
        raise ValueError(layout)
    return call


def speculative(registry, name, *, tokens=3, accepted=(2, 1, 1, 3), slots=(4, 1, "pad", 2), commit=True,
                problem_fields=None, **knobs) -> dict:  # fmt: skip
    """One speculative step of every layer of a two-layer state, then (with ``commit``) one commit."""
    fields = dict(tokens_per_step=tokens, speculative=True)
    fields.update(problem_fields or {})
    p = problem(**fields)
    bench = Bench(registry, name, p, layers=2, adopt=knobs.pop("adopt", False), seed=knobs.pop("seed", 0))
    ids = bench.ids(_slot_list(p, slots))
    layout = knobs.pop("layout", "contiguous")
    outs = []
    for layer in range(2):
        call = _laid_out(bench.step_inputs(len(ids), **knobs), layout)
        outs.append(bench.kernel.step(bench.state, **call, slots=ids, layer=layer))
    if commit:
        bench.kernel.commit(bench.state, ids, torch.tensor(accepted[: len(ids)], dtype=torch.int32))
    return bench.observe(outs=outs)


def _table(values, layout: str) -> torch.Tensor:
    """An (N, W) index table holding ``values`` (a contiguous tensor) as a view of the layout named:
    "contiguous", "transposed" (a (W, N) tensor seen as (N, W)) or "column-slice" (columns 1 to W
    of an (N, W + 3) tensor)."""
    if layout == "contiguous":
        return values
    if layout == "transposed":
        return values.t().contiguous().t()
    if layout == "column-slice":
        wide = torch.full((values.shape[0], values.shape[1] + 3), -7, dtype=values.dtype)
        view = wide[:, 1 : values.shape[1] + 1]
        view.copy_(values)
        return view
    raise ValueError(layout)


def _packed_rows(call: dict, layout: str) -> dict:
    """The packed tensors as views of the layout named: "contiguous", or "projection": x, B and C
    the column slices of one (tokens, H*P + 2*G*N + 5) projection output (vLLM's xBC), z and dt the
    leading columns of wider rows."""
    if layout == "contiguous":
        return call
    if layout != "projection":
        raise ValueError(layout)
    call = dict(call)
    x, B = call["x"], call["B"]
    tokens, xw, bw = x.shape[0], x[0].numel(), B[0].numel()
    wide = torch.zeros(tokens, xw + 2 * bw + 5, dtype=x.dtype)
    for name, start, width in (("x", 0, xw), ("B", xw, bw), ("C", xw + bw, bw)):
        view = wide[:, start : start + width].unflatten(-1, call[name].shape[1:])
        view.copy_(call[name])
        call[name] = view
    for name in ("z", "dt"):
        t = call[name]
        if t is not None:
            rows = torch.zeros(tokens, t[0].numel() + 3, dtype=t.dtype)
            view = rows[:, : t[0].numel()].unflatten(-1, t.shape[1:])
            view.copy_(t)
            call[name] = view
    return call


def _given_out(shape, dtype, out: Optional[str]):
    """The ``out`` a call is given: None, "given" (a NaN tensor) or "strided" (a NaN view whose
    rows of H*P values lie 3 values apart)."""
    if out is None:
        return None
    if out == "given":
        return torch.full(shape, math.nan, dtype=dtype)
    if out == "strided":
        row = shape[-2] * shape[-1]
        wide = torch.full((*shape[:-2], row + 3), math.nan, dtype=dtype)
        return wide[..., :row].unflatten(-1, shape[-2:])
    raise ValueError(out)


def packed(registry, name, *, lengths=(2, 0, 3, 1), accepted=(2, 1, 0, 3), table=None, dst_table=None,
           problem_fields=None, adopt=True, offsets=True, seed=0, cu=None, rows=None, index=torch.int32,
           table_layout="contiguous", dst_layout="contiguous", layout="contiguous", out="given", z=True, D=True,
           dt_bias=True, softplus=True) -> dict:  # fmt: skip
    """One vLLM packed call on layer 1 of a two-layer state: sequences of ``lengths`` tokens,
    tables 3 wide (default: each sequence's own row of slots), counts ``accepted``.
    ``cu``: the offsets themselves (default: from ``lengths``); ``rows``: the packed rows of the
    inputs (default: the last offset); ``index``: the dtype of the tables, counts and offsets;
    ``table_layout``, ``dst_layout``: the tables' views (:func:`_table`); ``layout``: the packed
    tensors' views (:func:`_packed_rows`); ``out``: see :func:`_given_out`; ``z``, ``D``,
    ``dt_bias``: whether each is given; ``softplus``: dt_softplus."""
    fields = dict(tokens_per_step=3, engine_calls={"packed"}, num_slots=16, engine_state=adopt)
    fields.update(problem_fields or {})
    p = problem(**fields)
    bench = Bench(registry, name, p, layers=2, adopt=adopt, seed=seed)
    N = len(lengths)
    if table is None:
        table = [[3 * n + t + 1 for t in range(3)] for n in range(N)]
    table = _table(bench.ids([_slot_list(p, row) for row in table], index), table_layout)
    dst = None if dst_table is None else _table(bench.ids([_slot_list(p, row) for row in dst_table], index), dst_layout)
    if cu is None:
        cu = [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    cu = torch.tensor(cu, dtype=index)
    call = bench.inputs((int(cu[-1]) if rows is None else rows,), z=z, D=D, dt_bias=dt_bias)
    call.pop("dt_softplus")
    call = _packed_rows(call, layout)
    given = _given_out(call["x"].shape, call["x"].dtype, out)
    result = bench.kernel.packed_step(
        bench.state, **call, slots=table, dst_slots=dst, num_accepted=None if accepted is None else
        torch.tensor(accepted, dtype=index), cu_seqlens=cu if offsets else None, dt_softplus=softplus, out=given,
        layer=1,
    )  # fmt: skip
    seen = dict(out=result)
    if given is not None:
        seen.update(returned_given=result is given, given=given.clone())
    return bench.observe(**seen)


def _buffer(shape, dtype, layout: str) -> torch.Tensor:
    """A verify buffer of ``shape`` filled with 7: "dense", "row-slice" (the first steps of a
    buffer two steps longer: rows further apart) or "step-gap" (every other block of a buffer twice
    as long: steps further apart); each (H, P, N) block contiguous."""
    rows, steps = shape[:2]
    if layout == "dense":
        return torch.full(shape, 7.0).to(dtype)
    if layout == "row-slice":
        return torch.full((rows, steps + 2, *shape[2:]), 7.0).to(dtype)[:, :steps]
    if layout == "step-gap":
        return torch.full((rows, steps, 2, *shape[2:]), 7.0).to(dtype)[:, :, 0]
    raise ValueError(layout)


def verify(registry, name, *, slots=(3, 0, "pad", 5), tokens=3, update_state=True, buffer="fp32", buffer_rows=None,
           parents=None, problem_fields=None, adopt=True, seed=0, index=torch.int32, buffer_layout="dense",
           parents_layout="contiguous", out=None, z=True, D=True, dt_bias=True, softplus=True) -> dict:  # fmt: skip
    """One SGLang verify call on layer 1 of a two-layer state, the buffer returned with the rest.
    ``index``: the dtype of slots and buffer rows; ``buffer_layout``: see :func:`_buffer`;
    ``parents_layout``: "contiguous" or "transposed" (a (T, b) tensor seen as (b, T)); ``out``:
    see :func:`_given_out`; ``z``, ``D``, ``dt_bias``: whether each is given; ``softplus``:
    dt_softplus."""
    fields = dict(tokens_per_step=tokens, engine_calls={"tree"}, num_slots=8, engine_state=adopt)
    fields.update(problem_fields or {})
    p = problem(**fields)
    bench = Bench(registry, name, p, layers=2, adopt=adopt, seed=seed)
    ids = bench.ids(_slot_list(p, slots), index)
    call = bench.inputs((len(ids), tokens), z=z, D=D, dt_bias=dt_bias, softplus=softplus)
    steps = tokens + 1
    rows = p.num_slots if buffer_rows is None else len(ids)
    store = None
    if buffer is not None:
        store = _buffer((rows, steps, p.nheads, p.headdim, p.dstate), to_torch(buffer), buffer_layout)
    if parents is not None:
        parents = torch.tensor(parents, dtype=torch.int64)
        parents = parents.t().contiguous().t() if parents_layout == "transposed" else parents
    given = _given_out(call["x"].shape, call["x"].dtype, out)
    result = bench.kernel.verify_step(
        bench.state, **call, slots=ids, layer=1, update_state=update_state, buffer=store,
        buffer_rows=None if buffer_rows is None else bench.ids(buffer_rows, index), parents=parents, out=given,
    )  # fmt: skip
    seen = dict(out=result, buffer=None if store is None else store.float())
    if given is not None:
        seen.update(returned_given=result is given, given=given.clone())
    return bench.observe(**seen)


def roundtrip(registry, name, *, slots=(4, 1), read_slots=None, layer=1, problem_fields=None, seed=0) -> dict:
    """write_state of fixed values to ``slots`` of ``layer``, then read_state of ``read_slots``
    (default the same slots)."""
    p = problem(**(problem_fields or {}))
    bench = Bench(registry, name, p, layers=2, seed=seed)
    ids = bench.ids(list(slots))
    values = torch.randn(len(ids), p.nheads, p.headdim, p.dstate, generator=bench.gen) * 3.0
    bench.kernel.write_state(bench.state, ids, values, layer)
    asked = ids if read_slots is None else bench.ids(list(read_slots))
    return bench.observe(read=bench.kernel.read_state(bench.state, asked, layer))


def state_values(registry, name, *, kind, problem_fields=None, seed=0) -> dict:
    """write_state and read_state on values that a plain round trip never meets: ``"large"``
    (rows near fp16's largest finite value), ``"zero-row"`` (a row of zeros), ``"shrinking"``
    (rows a million times smaller written over the slots' earlier values), ``"held"`` (a
    read_state result held while later calls write and read the same slots, a contiguous run), or
    ``"edited"`` (a read_state result edited, then the slots read again)."""
    p = problem(**(problem_fields or {}))
    bench = Bench(registry, name, p, layers=2, seed=seed)
    ids = bench.ids([1, 2, 3])
    values = torch.randn(len(ids), p.nheads, p.headdim, p.dstate, generator=bench.gen)
    if kind == "large":
        values = values / values.abs().amax() * 6.0e4
    elif kind == "zero-row":
        values[1, 2] = 0.0
    elif kind == "shrinking":
        bench.kernel.write_state(bench.state, ids, values * 1e3, 1)
        values = values * 1e-4
    if kind == "edited":
        bench.kernel.write_state(bench.state, ids, values, 1)
        bench.kernel.read_state(bench.state, ids, 1).fill_(7.0)
        return bench.observe(read=bench.kernel.read_state(bench.state, ids, 1))
    if kind == "held":
        bench.kernel.write_state(bench.state, ids, values, 1)
        held = bench.kernel.read_state(bench.state, ids, 1)
        bench.kernel.write_state(bench.state, ids, values * 2.0, 1)
        bench.kernel.read_state(bench.state, ids, 1)
        return bench.observe(read=held)
    bench.kernel.write_state(bench.state, ids, values, 1)
    return bench.observe(read=bench.kernel.read_state(bench.state, ids, 1))


def sequence(registry, name, *, calls, speculative=True, adopt=False, seed=0) -> dict:
    """A fixed sequence of calls on a three-layer state, each a string: ``"step S..."`` (every layer
    stepped with slots S, one-token, or speculative then committed with two tokens kept; a slot
    ``bad`` is an id outside the cache), ``"sync S..."`` (no S: every slot), ``"write L S..."``
    (new states into slots S of layer L) or ``"check"`` (the fault record's message kept).
    Every output, every message, and the states after a last ``sync`` of every slot, observed."""
    p = problem(tokens_per_step=3, speculative=True) if speculative else problem()
    bench = Bench(registry, name, p, layers=3, adopt=adopt, seed=seed)
    seen = []
    for call in calls:
        verb, *args = call.split()
        if verb == "step":
            ids = bench.ids([p.num_slots + 5 if a == "bad" else int(a) for a in args])
            seen += [bench.kernel.step(bench.state, **bench.step_inputs(len(ids)), slots=ids, layer=layer)
                     for layer in range(3)]  # fmt: skip
            if speculative:
                bench.kernel.commit(bench.state, ids, torch.full((len(ids),), 2, dtype=torch.int32))
        elif verb == "sync":
            bench.kernel.sync(bench.state, bench.ids([int(a) for a in args]) if args else None)
        elif verb == "write":
            ids = bench.ids([int(a) for a in args[1:]])
            values = torch.randn(len(ids), p.nheads, p.headdim, p.dstate, generator=bench.gen)
            bench.kernel.write_state(bench.state, ids, values, int(args[0]))
        else:
            seen.append(bench.fault())
    bench.kernel.sync(bench.state)
    return bench.observe(seen=seen)


def warmup(registry, name, *, problem_fields=None, seed=0) -> dict:
    """``kernel.warmup`` on a state whose every real slot holds a random state."""
    bench = Bench(registry, name, problem(**(problem_fields or {})), layers=2, seed=seed)
    bench.kernel.warmup(bench.state)
    return bench.observe()


def two_states(registry, name, *, seed=0) -> dict:
    """Two states of one speculative kernel: a step of each (other inputs), then the commit of the
    first; the first state's committed values."""
    p = problem(tokens_per_step=2, speculative=True)
    bench = Bench(registry, name, p, layers=1, seed=seed)
    other = bench.kernel.allocate_state(1)
    real = bench.real_slots()
    bench.kernel.write_state(other, real, torch.randn(len(real), p.nheads, p.headdim, p.dstate, generator=bench.gen))
    ids = bench.ids([1, 2])
    for state in (bench.state, other):
        bench.kernel.step(state, **bench.step_inputs(2), slots=ids, layer=0)
    bench.kernel.commit(bench.state, ids, torch.tensor([2, 1], dtype=torch.int32))
    return bench.observe()


def two_kernels(registry, name, *, seed=0) -> dict:
    """Two kernels of one backend object with the same H (6) and different G (1, then 3): one step
    on each; both observed."""
    seen = {}
    for groups in (1, 3):
        bench = Bench(registry, name, problem(nheads=6, ngroups=groups), layers=1, seed=seed)
        ids = bench.ids([1, 2])
        out = bench.kernel.step(bench.state, **bench.step_inputs(2), slots=ids, layer=0)
        seen[f"G={groups}"] = bench.observe(out=out)
    return seen


def output_kept(registry, name, *, seed=0) -> dict:
    """Two steps with ``out=None``; the first step's returned output, read after the second."""
    bench = Bench(registry, name, problem(), layers=1, seed=seed)
    ids = bench.ids([1, 2])
    first = bench.kernel.step(bench.state, **bench.step_inputs(2), slots=ids, layer=0)
    kept = first.clone()
    bench.kernel.step(bench.state, **bench.step_inputs(2), slots=ids, layer=0)
    return dict(first_unchanged=torch.equal(first, kept))


# comparing observations ---------------------------------------------------------------------
def differs(a, b, relative: float = RELATIVE) -> bool:
    """Whether two observations differ: a tensor by more than ``relative`` of its largest value
    (or in shape, dtype or where it holds NaN), anything else by ``!=``."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(differs(a[k], b[k], relative) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(differs(x, y, relative) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return True
        fa, fb = a.double(), b.double()
        if not torch.equal(torch.isnan(fa), torch.isnan(fb)):
            return True
        fa, fb = torch.nan_to_num(fa), torch.nan_to_num(fb)
        top = max(fb.abs().max().item() if fb.numel() else 0.0, 1e-30)
        return fb.numel() > 0 and (fa - fb).abs().max().item() > relative * top
    return a != b


def outcome(scenario, registry, name):
    """What ``scenario(registry, name)`` gives, or the type and first line of what it raised."""
    try:
        return scenario(registry, name)
    except Exception as exc:  # a mutant may crash where the base computes
        return f"raised {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
