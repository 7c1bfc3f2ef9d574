"""``independent``: a CPU backend of docs/spec.md written from the contract alone, in plain PyTorch.

It shares no code with ssu's own backends: not the reference math, not the versioned-slot
layout, not the quantiser, not the oracle. It uses only the public records (``ssu.BackendSpec``,
``ssu.Capabilities``, ``ssu.State``, ``ssu.hookimpl``, ``ssu.PLUGIN_API_VERSION``) and the dtype
names of :mod:`ssu.contract.dtypes`. It serves the whole contract: one-token and speculative steps (T up to
8) with commits, adopted engine caches, destination slots, any pad id, guarded ids with the fault
record, expanded per-head parameters, fp32/bf16/fp16/int8/fp8_e4m3 states, and the engine call
forms ``packed``, ``verify`` and ``tree``.

Its behaviour is spread over small named methods (:meth:`Independent.decay`,
:meth:`Independent.quantize_row`, :meth:`Independent.commit_rows`, ...) so that a mutant
(``mutants.py``) is a subclass that overrides one of them with one small bug.

State layout (allocated or adopted alike), per layer a :class:`LayerStore`:

- ``current`` (num_slots, H, P, N) in the cache dtype: the logical state of every slot. For an
  adopted cache this is the engine's tensor itself (any slot stride), stepped in place.
- ``current_scale`` (num_slots, H, P) fp32: an 8-bit cache's row scales (the engine's own for an
  adopted cache).
- ``drafts`` (num_slots, T, H, P, N) and ``draft_scale`` (num_slots, T, H, P), speculative only:
  the state after each token of the last step, rounded to the cache dtype. A speculative step
  writes only these; ``commit`` copies draft ``num_accepted - 1`` into ``current`` for every layer.

So ``current`` is the logical state after every one-token step and every commit; an adopted cache
is current without a ``sync``. Rows that store nothing are filtered out of every write, except
that when the pad id names a slot (a null block) they are sent there instead: the spec lets a
backend use the null block as a sink, and nothing ever reads it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

import ssu
from ssu.contract.dtypes import QMAX, to_torch

#: the argument field of a fault key (docs/spec.md, "Pad rows, and ids that name no slot")
SLOTS_ARGUMENT, DST_SLOTS_ARGUMENT, COUNT_ARGUMENT, ENGINE_ARGUMENT = 0, 1, 2, 3
#: the code of an engine call form's value in the row field of a key of argument 3
E_SLOT_TABLE, E_DST_TABLE, E_COUNTS, E_OFFSETS, E_PARENTS, E_BUFFER_ROWS, E_ROW_SLOTS = range(7)
#: bit positions of a key: row, argument, value; and of an engine row field: code, sequence, token
ROW_SHIFT, ARGUMENT_SHIFT, LOW_32_BITS = 34, 32, 0xFFFFFFFF
CODE_SHIFT, SEQUENCE_SHIFT, SEQUENCE_LIMIT, TOKEN_LIMIT = 26, 7, (1 << 19) - 1, (1 << 7) - 1
#: softplus(v) is v itself above this (docs/spec.md, "One token")
SOFTPLUS_THRESHOLD = 20.0


class LayerStore(NamedTuple):
    """Where one layer's states live (see the module docstring)."""

    current: torch.Tensor
    current_scale: Optional[torch.Tensor]
    drafts: Optional[torch.Tensor]
    draft_scale: Optional[torch.Tensor]


class Independent:
    """The backend's plugin object: register an instance with ``Registry.register``."""

    NAME = "independent"
    MAX_TOKENS = 8

    # hooks ------------------------------------------------------------------------------------
    @ssu.hookimpl
    def ssu_backend(self):
        return ssu.BackendSpec(
            name=self.NAME,
            api_version=ssu.PLUGIN_API_VERSION,
            factory=self.factory,
            capabilities=self.capabilities(),
            description="the SSU contract in plain PyTorch, written independently of ssu's own backends",
        )

    @ssu.hookimpl
    def ssu_allocate_state(self, ctx, num_layers):
        return self.allocate(ctx, num_layers)

    @ssu.hookimpl
    def ssu_adopt_state(self, ctx, cache, scales):
        return self.adopt(ctx, cache, scales)

    @ssu.hookimpl
    def ssu_commit(self, ctx, state, slots, num_accepted):
        self.commit(ctx, state, slots, num_accepted)

    @ssu.hookimpl
    def ssu_read_state(self, ctx, state, slots, layer):
        return self.read_state(ctx, state, slots, layer)

    @ssu.hookimpl
    def ssu_write_state(self, ctx, state, slots, values, layer):
        self.write_state(ctx, state, slots, values, layer)

    @ssu.hookimpl
    def ssu_warmup(self, ctx, state, step):
        self.warmup(ctx, state, step)

    @ssu.hookimpl
    def ssu_engine_call(self, ctx, form):
        return self.make_packed(ctx) if form == "packed" else self.make_verify(ctx)

    # declaration ------------------------------------------------------------------------------
    def capabilities(self):
        """Everything the contract offers, on the CPU."""
        return ssu.Capabilities(
            devices={"cpu"},
            state_dtypes={"fp32", "bf16", "fp16", "int8", "fp8_e4m3"},
            max_tokens_per_step=self.MAX_TOKENS,
            speculative=True,
            adopt_state=True,
            destination_slots=True,
            any_pad_slot_id=True,
            guards_slots=True,
            tied_inputs=True,
            engine_calls={"packed", "verify", "tree"},
        )

    def factory(self, ctx):
        """The step callable of one kernel, with the signature of ``ssu.contract.StepFn``."""
        backend = self

        def step(
            state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0,
            dst_slots=None,
        ):  # fmt: skip
            return backend.step(ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)

        return step

    def make_packed(self, ctx):
        """vLLM's packed call of one kernel (``ssu.contract.PackedStepFn``)."""
        backend = self

        def packed_step(
            state, x, dt, A, B, C, slots, dst_slots=None, num_accepted=None, cu_seqlens=None, D=None, z=None,
            dt_bias=None, dt_softplus=False, out=None, layer=0,
        ):  # fmt: skip
            return backend.packed_step(
                ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
                out, layer,
            )  # fmt: skip

        return packed_step

    def make_verify(self, ctx):
        """SGLang's verify call of one kernel (``ssu.contract.VerifyStepFn``), parents included."""
        backend = self

        def verify_step(
            state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0,
            update_state=True, buffer=None, buffer_rows=None, parents=None,
        ):  # fmt: skip
            return backend.verify_step(
                ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
                buffer_rows, parents,
            )  # fmt: skip

        return verify_step

    # states -----------------------------------------------------------------------------------
    def allocate(self, ctx, num_layers):
        """Zero states of ``num_layers`` layers in this backend's own tensors."""
        p = ctx.problem
        shape = (num_layers, p.num_slots, p.nheads, p.headdim, p.dstate)
        current = torch.zeros(shape, dtype=to_torch(p.state_dtype), device=p.device)
        buffers = {"current": current}
        if p.quantized:
            buffers["current_scale"] = torch.zeros(shape[:-1], dtype=torch.float32, device=p.device)
        buffers.update(self.draft_buffers(ctx, num_layers))
        scales = [buffers["current_scale"][layer] for layer in range(num_layers)] if p.quantized else []
        stores = [
            self.layer_store(buffers, layer, current[layer], scales[layer] if scales else None)
            for layer in range(num_layers)
        ]
        return ssu.State(ctx.spec.name, p, num_layers, buffers, views=stores, scales=scales)

    def adopt(self, ctx, cache, scales):
        """The engine's tensors as the current states, stepped in place; drafts beside them."""
        p = ctx.problem
        num_layers = len(cache)
        buffers = self.draft_buffers(ctx, num_layers)
        stores = [
            self.layer_store(buffers, layer, cache[layer], scales[layer] if p.quantized else None)
            for layer in range(num_layers)
        ]
        return ssu.State(ctx.spec.name, p, num_layers, buffers, cache=cache, views=stores, scales=scales)

    def draft_buffers(self, ctx, num_layers) -> dict:
        """The per-token drafts of a speculative state (none otherwise), owned by that state."""
        p = ctx.problem
        if not p.speculative:
            return {}
        shape = (num_layers, p.num_slots, p.tokens_per_step, p.nheads, p.headdim, p.dstate)
        buffers = {"drafts": torch.zeros(shape, dtype=to_torch(p.state_dtype), device=p.device)}
        if p.quantized:
            buffers["draft_scale"] = torch.zeros(shape[:-1], dtype=torch.float32, device=p.device)
        return buffers

    def layer_store(self, buffers, layer, current, current_scale) -> LayerStore:
        """One layer's :class:`LayerStore`: its current states and its slice of the drafts."""
        drafts = buffers["drafts"][layer] if "drafts" in buffers else None
        draft_scale = buffers["draft_scale"][layer] if "draft_scale" in buffers else None
        return LayerStore(current, current_scale, drafts, draft_scale)

    def store_of(self, state, layer) -> LayerStore:
        """The :class:`LayerStore` a call on ``layer`` of ``state`` reads and writes."""
        return state.views[layer]

    # rounding to the cache --------------------------------------------------------------------
    def round_to_cache(self, values, dtype):
        """A floating-point cache holds ``values`` rounded to nearest in its dtype."""
        return values.to(dtype)

    def row_scale(self, values, qmax):
        """One scale per row of N values: its largest magnitude over QMAX (0 for a zero row)."""
        return values.abs().amax(dim=-1) / qmax

    def to_grid(self, ratio, state_dtype, qmax):
        """``h / scale`` on the 8-bit grid: int8 rounds to nearest (ties to even) within +-127,
        fp8_e4m3 is the cast of the value clamped to +-448."""
        if state_dtype == "int8":
            return torch.round(ratio).clamp(-qmax, qmax).to(torch.int8)
        return ratio.clamp(-qmax, qmax).to(torch.float8_e4m3fn)

    def quantize_row(self, values, state_dtype):
        """``(q, scale)`` of fp32 rows ``values`` (..., N): docs/spec.md, "Quantised states"."""
        values = values.float()
        qmax = QMAX[state_dtype]
        scale = self.row_scale(values, qmax)
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        return self.to_grid(values / divisor[..., None], state_dtype, qmax), scale

    def dequantize_row(self, q, scale):
        """The fp32 values of 8-bit rows: ``q * scale``."""
        return q.float() * scale[..., None]

    # reading and writing slots ----------------------------------------------------------------
    def read_slot_state(self, p, store, idx):
        """fp32 current states of the real slots ``idx`` (int64)."""
        values = store.current[idx]
        if p.quantized:
            return self.dequantize_row(values, store.current_scale[idx])
        return values.float()

    def write_slot_state(self, p, store, idx, values):
        """Store ``values`` as the current states of the slots ``idx``, rounded to the cache."""
        if p.quantized:
            q, scale = self.quantize_row(values, p.state_dtype)
            store.current[idx] = q
            store.current_scale[idx] = scale
        else:
            store.current[idx] = self.round_to_cache(values, store.current.dtype)

    def write_draft(self, p, store, idx, token, values):
        """Store ``values`` as draft ``token`` of the slots ``idx``, rounded to the cache."""
        if p.quantized:
            q, scale = self.quantize_row(values, p.state_dtype)
            store.drafts[idx, token] = q
            store.draft_scale[idx, token] = scale
        else:
            store.drafts[idx, token] = self.round_to_cache(values, store.drafts.dtype)

    def start_states(self, p, store, ids, reads):
        """fp32 states the rows start from: their slot's current state, zero where ``reads`` is
        false (a pad row, an id outside the cache)."""
        s = torch.zeros(ids.shape[0], p.nheads, p.headdim, p.dstate, dtype=torch.float32, device=ids.device)
        idx = ids[reads].long()
        if idx.numel():
            s[reads] = self.read_slot_state(p, store, idx)
        return s

    def write_targets(self, p, ids, writes, values):
        """``(slots, values)`` of a write of the rows ``writes``: those rows alone, or, when the pad
        id names a slot, every row with the others sent to that null block (a sink)."""
        if p.pad_in_cache:
            sink = torch.full_like(ids, p.pad_slot_id)
            return torch.where(writes, ids, sink).long(), values
        return ids[writes].long(), values[writes]

    def store_states(self, p, store, ids, writes, values):
        """Write ``values`` of the rows ``writes`` to the current states of slots ``ids``."""
        idx, kept = self.write_targets(p, ids, writes, values)
        if idx.numel():
            self.write_slot_state(p, store, idx, kept)

    def store_drafts(self, p, store, ids, writes, token, values):
        """Write draft ``token`` of the rows ``writes`` (their slots ``ids``)."""
        idx = ids[writes].long()
        if idx.numel():
            self.write_draft(p, store, idx, token, values[writes])

    # slot ids and the fault record ------------------------------------------------------------
    def is_pad(self, p, ids):
        """Rows whose id is the problem's pad id (any integer)."""
        return ids == p.pad_slot_id

    def outside_cache(self, p, ids):
        """Ids that are neither a slot of the cache nor the pad id."""
        return ((ids < 0) | (ids >= p.num_slots)) & ~self.is_pad(p, ids)

    def names_slot(self, p, ids):
        """Ids that name a slot holding a sequence's state (not the pad id)."""
        return (ids >= 0) & (ids < p.num_slots) & ~self.is_pad(p, ids)

    def fault_key(self, rows, argument, values):
        """``row << 34 | argument << 32 | low 32 bits of the value`` (int64)."""
        low = values.to(torch.int64) & LOW_32_BITS
        return (rows.to(torch.int64) << ROW_SHIFT) | (argument << ARGUMENT_SHIFT) | low

    def record_fault(self, ctx, bad, rows, argument, values):
        """Lower the kernel's fault record to the smallest key of the rows ``bad``."""
        if bad.numel() == 0:
            return
        keys = self.fault_key(rows, argument, values)
        keys = torch.where(bad, keys, ctx.faults.expand_as(keys))
        torch.minimum(ctx.faults, keys.min().reshape(1), out=ctx.faults)

    def record_id_faults(self, ctx, ids, argument):
        """Record the rows of ``ids`` (a step's or a commit's vector) outside the cache."""
        p = ctx.problem
        rows = torch.arange(ids.shape[0], device=ids.device)
        self.record_fault(ctx, self.outside_cache(p, ids), rows, argument, ids)

    def engine_row(self, code, sequence, token):
        """The row field of an engine call's key: ``code << 26 | sequence << 7 | token``."""
        sequence = sequence.to(torch.int64).clamp(max=SEQUENCE_LIMIT)
        token = token.to(torch.int64).clamp(max=TOKEN_LIMIT)
        return (code << CODE_SHIFT) | (sequence << SEQUENCE_SHIFT) | token

    def record_engine_fault(self, ctx, bad, code, sequence, token, values):
        """Record values of an engine call refused where ``bad`` (argument 3)."""
        bad, sequence, token, values = torch.broadcast_tensors(bad, sequence, token, values)
        self.record_fault(ctx, bad, self.engine_row(code, sequence, token), ENGINE_ARGUMENT, values)

    # the math of one token --------------------------------------------------------------------
    def per_head(self, x, dt, A, D, dt_bias):
        """dt (b, [T,] H), A, D, dt_bias (H,), also from the expanded forms (stride 0 over P, N)."""
        if dt.dim() == x.dim():
            dt = dt[..., 0]
        if A.dim() == 3:
            A = A[:, 0, 0]
        if D is not None and D.dim() == 2:
            D = D[:, 0]
        if dt_bias is not None and dt_bias.dim() == 2:
            dt_bias = dt_bias[:, 0]
        return dt, A, D, dt_bias

    def group_of_head(self, p, device):
        """The group each head reads: ``h // (H / G)``."""
        return torch.arange(p.nheads, device=device) // (p.nheads // p.ngroups)

    def per_head_rows(self, p, BC):
        """B or C of one token (b, G, N) as each head reads it: (b, H, N), fp32."""
        return BC.float()[:, self.group_of_head(p, BC.device)]

    def softplus(self, v):
        """log(1 + e^v), and v itself above the threshold."""
        return torch.where(v > SOFTPLUS_THRESHOLD, v, torch.log1p(torch.exp(v.clamp(max=SOFTPLUS_THRESHOLD))))

    def effective_dt(self, dt, dt_bias, dt_softplus):
        """d = dt + dt_bias, through softplus when asked: (b, H) fp32."""
        d = dt.float()
        if dt_bias is not None:
            d = d + dt_bias.float()
        if dt_softplus:
            d = self.softplus(d)
        return d

    def decay(self, A, d):
        """exp(A[h] d): (b, H)."""
        return torch.exp(A.float() * d)

    def inflow(self, d, x, Bh):
        """d x[p] B[n]: (b, H, P, N)."""
        return (d[:, :, None] * x)[..., None] * Bh[:, :, None, :]

    def readout(self, s, Ch):
        """sum over n of s[p, n] C[n]: (b, H, P)."""
        return torch.einsum("bhpn,bhn->bhp", s, Ch)

    def skip(self, y, D, x):
        """y + D[h] x[p] (no D: y)."""
        return y if D is None else y + D.float()[None, :, None] * x

    def gate(self, y, z):
        """y z sigmoid(z) (no z: y)."""
        if z is None:
            return y
        zf = z.float()
        return y * (zf * torch.sigmoid(zf))

    def token_update(self, p, s, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
        """One token applied to fp32 states ``s`` (b, H, P, N): (new states, fp32 outputs)."""
        d = self.effective_dt(dt, dt_bias, dt_softplus)
        xf = x.float()
        s = self.decay(A, d)[:, :, None, None] * s + self.inflow(d, xf, self.per_head_rows(p, B))
        y = self.readout(s, self.per_head_rows(p, C))
        return s, self.gate(self.skip(y, D, xf), z)

    # the step ---------------------------------------------------------------------------------
    def output_for(self, x, out):
        """The given ``out``, or a new tensor of x's shape and dtype."""
        return torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out

    def with_token_axis(self, p, tensors):
        """Each tensor (or None) with a token axis: one-token inputs get one of length 1."""
        if p.multi_token:
            return tensors
        return [None if t is None else t.unsqueeze(1) for t in tensors]

    def emit_output(self, outs, token, y):
        """Output of ``token`` for every row, in the output's dtype."""
        outs[:, token] = y.to(outs.dtype)

    def rows_reading(self, ctx, slots):
        """Rows whose slot holds a state; ids outside the cache recorded (argument 0)."""
        self.record_id_faults(ctx, slots, SLOTS_ARGUMENT)
        return self.names_slot(ctx.problem, slots)

    def rows_writing(self, ctx, dst_slots):
        """Rows whose destination is a slot; destinations outside the cache recorded (argument 1)."""
        self.record_id_faults(ctx, dst_slots, DST_SLOTS_ARGUMENT)
        return self.names_slot(ctx.problem, dst_slots)

    def step_targets(self, ctx, slots, reads, dst_slots):
        """(slots written, rows that write): the row's own slot, or its destination; a row writes
        only if it read a state and its destination is a slot."""
        if dst_slots is None:
            return slots, reads
        return dst_slots, reads & self.rows_writing(ctx, dst_slots)

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        """docs/spec.md, "One token" and "Several tokens per sequence"."""
        p = ctx.problem
        out = self.output_for(x, out)
        dt, A, D, dt_bias = self.per_head(x, dt, A, D, dt_bias)
        xs, dts, Bs, Cs, zs, outs = self.with_token_axis(p, [x, dt, B, C, z, out])
        store = self.store_of(state, layer)
        reads = self.rows_reading(ctx, slots)
        targets, writes = self.step_targets(ctx, slots, reads, dst_slots)
        s = self.start_states(p, store, slots, reads)
        for t in range(xs.shape[1]):
            zt = None if zs is None else zs[:, t]
            s, y = self.token_update(p, s, xs[:, t], dts[:, t], A, Bs[:, t], Cs[:, t], D, zt, dt_bias, dt_softplus)
            self.emit_output(outs, t, y)
            if p.speculative:
                self.store_drafts(p, store, slots, writes, t, s)
        if not p.speculative:
            self.store_states(p, store, targets, writes, s)
        return out

    # commit -----------------------------------------------------------------------------------
    def commit_rows(self, ctx, slots, num_accepted):
        """Rows a commit moves: a real slot and 1 <= num_accepted <= T. Ids outside the cache
        (argument 0) and counts outside 1..T of real slots (argument 2) are recorded."""
        p = ctx.problem
        rows = torch.arange(slots.shape[0], device=slots.device)
        real = self.names_slot(p, slots)
        counted = (num_accepted >= 1) & (num_accepted <= p.tokens_per_step)
        self.record_fault(ctx, self.outside_cache(p, slots), rows, SLOTS_ARGUMENT, slots)
        self.record_fault(ctx, real & ~counted, rows, COUNT_ARGUMENT, num_accepted)
        return real & counted

    def choose_version(self, num_accepted, tokens):
        """The draft a commit keeps (of ``tokens``): the state after token ``num_accepted - 1``."""
        return num_accepted.long() - 1

    def commit_layer(self, p, store, idx, drafts):
        """``current[slot] = drafts[slot, draft]`` for one layer (values and scales, bit for bit)."""
        store.current[idx] = store.drafts[idx, drafts]
        if p.quantized:
            store.current_scale[idx] = store.draft_scale[idx, drafts]

    def commit(self, ctx, state, slots, num_accepted):
        """Keep each slot's first ``num_accepted`` tokens of the last step, in every layer."""
        p = ctx.problem
        moved = self.commit_rows(ctx, slots, num_accepted)
        if not p.speculative:
            return
        idx = slots[moved].long()
        if idx.numel() == 0:
            return
        self.keep_drafts(ctx, state, idx, self.choose_version(num_accepted[moved], p.tokens_per_step))

    def keep_drafts(self, ctx, state, idx, drafts):
        """Make draft ``drafts[i]`` of slot ``idx[i]`` its current state, in every layer."""
        for layer in range(state.num_layers):
            self.commit_layer(ctx.problem, self.store_of(state, layer), idx, drafts)

    # read, write, warmup ----------------------------------------------------------------------
    def read_state(self, ctx, state, slots, layer):
        """The logical (current) states of real ``slots``, fp32."""
        return self.read_slot_state(ctx.problem, self.store_of(state, layer), slots.long())

    def write_state(self, ctx, state, slots, values, layer):
        """Install ``values`` as the logical states of ``slots``, rounded to the cache."""
        self.write_slot_state(ctx.problem, self.store_of(state, layer), slots.long(), values)

    def warmup(self, ctx, state, step):
        """Nothing to compile: leaves everything as it is."""

    # vLLM's packed call -----------------------------------------------------------------------
    def packed_sequences(self, ctx, cu_seqlens, tokens, width):
        """(first row, token count, offsets valid) of each sequence. Without offsets sequence n
        owns row n; offsets that do not ascend within the tokens or give a sequence more than
        ``width`` tokens are recorded (code 3, the sequence's end offset) and that sequence
        carries no token."""
        dev = ctx.faults.device
        if cu_seqlens is None:
            first = torch.arange(tokens, device=dev)
            return first, torch.ones_like(first), torch.ones(tokens, dtype=torch.bool, device=dev)
        cu = cu_seqlens.long()
        first, end = cu[:-1], cu[1:]
        length = end - first
        valid = (first >= 0) & (length >= 0) & (length <= width) & (end <= tokens)
        sequence = torch.arange(first.shape[0], device=dev)
        self.record_engine_fault(ctx, ~valid, E_OFFSETS, sequence, torch.zeros_like(sequence), end)
        return first, torch.where(valid, length, torch.zeros_like(length)), valid

    def packed_start_column(self, ctx, num_accepted, sequences, width, valid):
        """(column of the start cell, count valid) of each sequence: ``max(count - 1, 0)``, column
        0 without counts; a count outside 0..W is recorded (code 2) and pads its sequence."""
        dev = ctx.faults.device
        if num_accepted is None:
            column = torch.zeros(sequences, dtype=torch.int64, device=dev)
            return column, torch.ones(sequences, dtype=torch.bool, device=dev)
        count = num_accepted.long()
        counted = (count >= 0) & (count <= width)
        sequence = torch.arange(sequences, device=dev)
        self.record_engine_fault(ctx, valid & ~counted, E_COUNTS, sequence, torch.zeros_like(sequence), count)
        column = torch.where(counted, (count - 1).clamp(min=0), torch.zeros_like(count))
        return column, counted

    def packed_start(self, ctx, table, column, has_tokens, sequence):
        """(start slot, real) of each sequence: the id in its start cell, and whether it names a
        slot; a start cell outside the cache of a sequence with tokens is recorded (code 0)."""
        p = ctx.problem
        start = table.gather(1, column[:, None])[:, 0]
        bad = has_tokens & self.outside_cache(p, start)
        self.record_engine_fault(ctx, bad, E_SLOT_TABLE, sequence, column, start)
        return start, has_tokens & self.names_slot(p, start)

    def packed_dst_cells(self, ctx, cells, live, real, sequence, token):
        """Sequences that store token ``token``'s state: those with that token (``live``) that are
        not padded (``real``) and whose cell names a slot; a cell outside the cache of such a
        sequence is recorded (code 1) and not written."""
        p = ctx.problem
        writing = live & real
        tokens = torch.full_like(sequence, token)
        self.record_engine_fault(ctx, writing & self.outside_cache(p, cells), E_DST_TABLE, sequence, tokens, cells)
        return writing & self.names_slot(p, cells)

    def packed_store(self, p, store, cells, keep, s, token, length):
        """Store each kept sequence's state after token ``token`` in its cell."""
        self.store_states(p, store, cells, keep, s)

    def packed_step(
        self, ctx, state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
        out, layer,
    ):  # fmt: skip
        """docs/spec.md, "Packed (vLLM)"."""
        p = ctx.problem
        out = self.output_for(x, out)
        dt, A, D, dt_bias = self.per_head(x, dt, A, D, dt_bias)
        tokens, width = x.shape[0], slots.shape[1]
        first, length, valid = self.packed_sequences(ctx, cu_seqlens, tokens, width)
        sequences = first.shape[0]
        table = slots[:sequences]
        dst_table = table if dst_slots is None else dst_slots[:sequences]
        column, counted = self.packed_start_column(ctx, num_accepted, sequences, width, valid)
        sequence = torch.arange(sequences, device=x.device)
        has_tokens = valid & counted & (length > 0)
        start, real = self.packed_start(ctx, table, column, has_tokens, sequence)
        store = self.store_of(state, layer)
        s = self.start_states(p, store, start, real)
        for t in range(width):
            live = t < length
            if not bool(live.any()):
                break
            rows = (first + t)[live]
            zt = None if z is None else z[rows]
            new, y = self.token_update(p, s[live], x[rows], dt[rows], A, B[rows], C[rows], D, zt, dt_bias, dt_softplus)
            s[live] = new
            out[rows] = y.to(out.dtype)
            cells = dst_table[:, t]
            keep = self.packed_dst_cells(ctx, cells, live, real, sequence, t)
            self.packed_store(p, store, cells, keep, s, t, length)
        return out

    # SGLang's verify call ---------------------------------------------------------------------
    def verify_rows(self, ctx, slots):
        """Rows whose slot holds a state; slots outside the cache are recorded (code 6)."""
        p = ctx.problem
        sequence = torch.arange(slots.shape[0], device=slots.device)
        bad = self.outside_cache(p, slots)
        self.record_engine_fault(ctx, bad, E_ROW_SLOTS, sequence, torch.zeros_like(sequence), slots)
        return self.names_slot(p, slots)

    def verify_final(self, p, store, slots, real, s, update_state, buffer, rows, stores, tokens):
        """With ``update_state``, each real row's slot takes the state after its last token."""
        if update_state:
            self.store_states(p, store, slots, real, s)

    def verify_buffer_rows(self, ctx, slots, real, buffer, buffer_rows):
        """(buffer row of each call row, rows that store): ``buffer_rows`` or the slots; a real
        row whose buffer row lies outside the buffer stores nothing and is recorded (code 5)."""
        if buffer is None:
            return None, torch.zeros_like(real)
        rows = (slots if buffer_rows is None else buffer_rows).long()
        inside = (rows >= 0) & (rows < buffer.shape[0])
        sequence = torch.arange(rows.shape[0], device=rows.device)
        self.record_engine_fault(ctx, real & ~inside, E_BUFFER_ROWS, sequence, torch.zeros_like(sequence), rows)
        return rows, real & inside

    def verify_parents(self, ctx, parents, stores, tokens):
        """(b, T): the token each token continues from as the buffer holds it, -1 for the token
        before it. Parents at or after their own token are recorded (code 4) and not followed;
        rows that store nothing follow none."""
        b = stores.shape[0]
        follow = torch.full((b, tokens), -1, dtype=torch.int64, device=stores.device)
        if parents is None:
            return follow
        parent = parents.long()
        token = torch.arange(tokens, device=stores.device)[None, :]
        sequence = torch.arange(b, device=stores.device)[:, None]
        later = stores[:, None] & (token >= 1) & (parent >= token)
        self.record_engine_fault(ctx, later, E_PARENTS, sequence, token, parent)
        taken = stores[:, None] & (token >= 1) & (parent >= 0) & (parent < token)
        return torch.where(taken, parent, follow)

    def continue_from(self, s, buffer, rows, parent):
        """States with the rows that follow a parent (``parent >= 0``) reloaded from the buffer."""
        chosen = parent >= 0
        if not bool(chosen.any()):
            return s
        s = s.clone()
        s[chosen] = buffer[rows[chosen], parent[chosen]].float()
        return s

    def store_intermediate(self, p, buffer, rows, stores, token, s):
        """``buffer[row, token]`` = the state after ``token``, rounded to the buffer's dtype (whatever
        the cache's, ``p.state_dtype``)."""
        if bool(stores.any()):
            buffer[rows[stores], token] = s[stores].to(buffer.dtype)

    def verify_step(
        self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer,
        buffer_rows, parents,
    ):  # fmt: skip
        """docs/spec.md, "Verify (SGLang)"."""
        p = ctx.problem
        out = self.output_for(x, out)
        dt, A, D, dt_bias = self.per_head(x, dt, A, D, dt_bias)
        b, tokens = x.shape[:2]
        real = self.verify_rows(ctx, slots)
        store = self.store_of(state, layer)
        s = self.start_states(p, store, slots, real)
        rows, stores = self.verify_buffer_rows(ctx, slots, real, buffer, buffer_rows)
        follow = self.verify_parents(ctx, parents, stores, tokens)
        for t in range(tokens):
            if t:
                s = self.continue_from(s, buffer, rows, follow[:, t])
            zt = None if z is None else z[:, t]
            s, y = self.token_update(p, s, x[:, t], dt[:, t], A, B[:, t], C[:, t], D, zt, dt_bias, dt_softplus)
            out[:, t] = y.to(out.dtype)
            if buffer is not None:
                self.store_intermediate(p, buffer, rows, stores, t, s)
        self.verify_final(p, store, slots, real, s, update_state, buffer, rows, stores, tokens)
        return out


class Deferred(Independent):
    """``independent`` with commits deferred, as a backend that keeps more than the logical state
    does: ``commit`` only notes, per layer and slot, which draft it keeps (``pending``, -1 for
    none); the draft is folded into ``current`` when that layer's slot is next stepped or read, or
    when ``sync`` asks for it, and ``write_state`` forgets it. An adopted cache is therefore
    current only after ``sync`` (the backend implements the hook). Same logical behaviour as
    :class:`Independent` everywhere; its mutants (``mutants.py``) break the bookkeeping."""

    NAME = "independent-deferred"

    @ssu.hookimpl
    def ssu_sync_state(self, ctx, state, slots):
        self.sync(ctx, state, slots)

    def draft_buffers(self, ctx, num_layers) -> dict:
        """The drafts, and the draft each slot's commit keeps but has not folded in yet."""
        buffers = super().draft_buffers(ctx, num_layers)
        if buffers:
            buffers["pending"] = torch.full((num_layers, ctx.problem.num_slots), -1, dtype=torch.int64,
                                            device=ctx.problem.device)  # fmt: skip
        return buffers

    def pending_of(self, state, layer):
        """Layer ``layer``'s (num_slots,) pending drafts, or None for a one-token state."""
        return state.buffers["pending"][layer] if "pending" in state.buffers else None

    def fold(self, ctx, state, layer, idx):
        """Fold the pending drafts of slots ``idx`` (int64) of one layer into ``current``."""
        pending = self.pending_of(state, layer)
        if pending is None or idx.numel() == 0:
            return
        idx = idx[pending[idx] >= 0]
        if idx.numel():
            self.commit_layer(ctx.problem, self.store_of(state, layer), idx, pending[idx])
            pending[idx] = -1

    def forget(self, state, layer, idx):
        """Drop the pending drafts of slots ``idx`` of one layer (their state is being replaced)."""
        pending = self.pending_of(state, layer)
        if pending is not None:
            pending[idx] = -1

    def fold_for_step(self, ctx, state, layer, slots):
        """Before a step of ``layer``: fold the pending drafts of the slots it reads."""
        real = slots[self.names_slot(ctx.problem, slots)].long()
        self.fold(ctx, state, layer, real)

    def step(self, ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots):
        self.fold_for_step(ctx, state, layer, slots)
        return super().step(ctx, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)

    def keep_drafts(self, ctx, state, idx, drafts):
        """Note, for every layer, the draft each moved slot keeps (folded in later)."""
        for layer in range(state.num_layers):
            self.pending_of(state, layer)[idx] = drafts

    def read_state(self, ctx, state, slots, layer):
        self.fold(ctx, state, layer, slots.long())
        return super().read_state(ctx, state, slots, layer)

    def write_state(self, ctx, state, slots, values, layer):
        self.forget(state, layer, slots.long())
        super().write_state(ctx, state, slots, values, layer)

    def sync(self, ctx, state, slots):
        """Fold the pending drafts of ``slots`` (every slot when None) in every layer."""
        every = torch.arange(ctx.problem.num_slots, device=ctx.problem.device)
        for layer in range(state.num_layers):
            self.fold(ctx, state, layer, every if slots is None else slots.long())
