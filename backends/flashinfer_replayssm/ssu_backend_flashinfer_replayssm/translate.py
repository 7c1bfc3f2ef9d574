"""From the canonical ssu call to FlashInfer's ``checkpointing_ssu``, and the step callable.

FlashInfer wants the token axis always (x (b, T, H, P)), per-head A, dt, D and dt_bias as
broadcast views with stride 0 over the head dimension (the flashinfer backend's ``tie_hdim``),
and D and dt_bias in one dtype (both are
given in fp32 here, converted once per weight tensor). Pad rows, and rows whose slot lies outside
the cache (recorded in the kernel's fault record), are pointed at the pad slot (row
``num_slots``, zero checkpoint, cursors at zero), so that they read a zero state and still get
their output row, as docs/spec.md asks; FlashInfer itself would skip them, so it is told a pad id
(-1) that no row carries. :func:`cs_arguments` is a pure function so that a CPU test can check it
against the installed FlashInfer's signature.
"""

from __future__ import annotations

import torch

from ssu.state import faults
from ssu.contract.errors import InputError
from ssu_backend_flashinfer.rows import real_ids, record_outside, row_buffers
from ssu_backend_flashinfer.translate import per_head, tie_hdim

from . import cursors, layout


def cs_arguments(
    problem, options, buffers, layer, x, dt, A, B, C, D, z, dt_bias, dt_softplus, out, rows, scratch_trio
) -> dict:
    """Keyword arguments of ``flashinfer.mamba.checkpointing_ssu`` for one call of ``layer``.

    ``x``, ``dt``, ``B``, ``C``, ``z`` and ``out`` carry the token axis; ``rows`` are the cache rows
    (pad rows already pointed at the pad slot); ``D`` and ``dt_bias`` are fp32 (or None)."""
    S1 = problem.num_slots + 1
    kwargs = dict(
        state=buffers["ssm"][layer],
        x_cache=buffers["x_cache"][layer],
        B_cache=buffers["B_cache"][layer],
        dt_cache=buffers["dt_cache"][layer],
        ring_start=buffers["ring_start"][:S1],
        prev_num_accepted_tokens=buffers["pnat"][:S1],
        x=x,
        B=B,
        C=C,
        out=out,
        z=z,
        **tie_hdim(problem, dt, A, D, dt_bias, x),
        dt_softplus=dt_softplus,
        state_batch_indices=rows,
        pad_slot_id=-1,  # every pad row already points at the pad slot
        algorithm=options.algorithm,
    )
    if scratch_trio is not None:
        b = x.shape[0]
        kwargs.update(cb_scaled=scratch_trio[0][:b], cumAdt_vec=scratch_trio[1][:b], cb_old=scratch_trio[2][:b])
    return kwargs


def allocate_scratch(problem, options, record=None) -> dict:
    """Buffers allocated once per kernel, before any CUDA-graph capture: FlashInfer's two-kernel
    scratch (unless ``algorithm = "monolith"``), the cache rows of a step per index dtype, a zero
    D, and ones (the accepted counts of a commit without speculation); plus the kernel's cursor
    update (``advance``, see :func:`make_advance`), which reports refused rows to ``record`` (the
    kernel's fault record; a private one when None)."""
    p = problem
    dev = p.device
    record = faults.allocate(dev) if record is None else record
    from ssu_backend_flashinfer import rows_triton

    scratch = {
        "trio": None,
        "rows_for": None,
        "triton_rows": rows_triton.usable(p.device_type),
        "rows": {
            dtype: dict(
                row_buffers(p, dtype, dev),
                pad_row=torch.full((), cursors.pad_slot(p.num_slots), dtype=dtype, device=dev),
            )
            for dtype in (torch.int32, torch.int64)
        },
        "zero_D": torch.zeros(p.nheads, dtype=torch.float32, device=dev),
        "ones": torch.ones(p.max_batch, dtype=torch.int32, device=dev),
        "advance": make_advance(p, options, record),
    }
    if options.algorithm != "monolith" and p.device_type == "cuda":
        from flashinfer.mamba import allocate_checkpointing_ssu_scratch

        scratch["trio"] = allocate_checkpointing_ssu_scratch(
            p.max_batch, p.nheads, p.tokens_per_step, options.max_window, torch.bfloat16, dev
        )
    return scratch


def cache_rows(scratch, problem, slots, record):
    """``slots`` with pad ids, and ids outside the cache (recorded in ``record``), replaced by the
    pad slot, written into scratch with ``out=`` ops (no allocation, no host sync); computed at the
    first layer after each commit and reused by the other layers of the step."""
    if scratch["rows_for"] is slots:
        return scratch["rows"][slots.dtype]["read"][: slots.shape[0]]
    b = slots.shape[0]
    buf = scratch["rows"][slots.dtype]
    rows = buf["read"][:b]
    if scratch["triton_rows"]:
        from ssu_backend_flashinfer import rows_triton

        rows_triton.launch(
            slots,
            None,
            None,
            rows,
            None,
            record,
            num_slots=problem.num_slots,
            pad_slot_id=problem.pad_slot_id,
            pad_read=cursors.pad_slot(problem.num_slots),
            sink=0,
        )
    else:
        real = real_ids(buf, slots, problem.num_slots, problem.pad_slot_id, buf["real"][:b])
        record_outside(buf, record, slots, real, faults.SLOTS, problem.pad_slot_id)
        torch.where(real, slots, buf["pad_row"], out=rows)
    scratch["rows_for"] = slots
    return rows


def make_advance(problem, options, record):
    """The cursor update of one commit, bound to this problem: Triton on CUDA when available.
    Rows with a slot outside the cache or a count outside 1..T move nothing and are recorded in
    ``record``."""
    impl = cursors.advance_triton if cursors.triton_usable(problem.device_type) else cursors.advance_torch
    fields = dict(
        tokens=problem.tokens_per_step,
        max_window=options.max_window,
        pad_slot_id=problem.pad_slot_id,
        num_slots=problem.num_slots,
    )

    def advance(state, slots, accepted) -> None:
        impl(state.buffers["ring_start"], state.buffers["pnat"], slots, accepted, record, **fields)

    return advance


def commit(scratch, advance, state, slots, accepted) -> None:
    """Move the group's cursors and forget what the step left pending."""
    advance(state, slots, accepted)
    scratch["rows_for"] = None
    rec = layout.record(state)
    rec.pending_layers.clear()
    rec.pending_slots = None


def make_step(ctx):
    """The step callable of one kernel."""
    from flashinfer.mamba import checkpointing_ssu
    from ssu_backend_flashinfer.translate import WeightCache

    p = ctx.problem
    options = ctx.options
    scratch = ctx.scratch
    zero_D = scratch["zero_D"]
    ones = scratch["ones"]
    trio = scratch["trio"]
    T = p.tokens_per_step
    multi = p.multi_token
    commits_itself = not p.speculative and options.commit_on_last_layer
    advance = scratch["advance"]
    record = ctx.faults
    converted = WeightCache()

    def step(
        state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0, dst_slots=None
    ):
        if out is None:
            out = torch.empty_like(x)
        if multi:
            if x.shape[1] != T:
                raise InputError(
                    f"x: {x.shape[1]} tokens per sequence; backend 'flashinfer-replayssm' is "
                    f"compiled for exactly tokens_per_step={T} (the ring holds max_window + T rows); "
                    f"pad the drafts to {T} tokens, or open a kernel with that tokens_per_step"
                )
            x4, dt3, B4, C4, z4, out4 = x, dt, B, C, z, out
        else:
            x4, dt3, B4, C4, out4 = x.unsqueeze(1), dt.unsqueeze(1), B.unsqueeze(1), C.unsqueeze(1), out.unsqueeze(1)
            z4 = None if z is None else z.unsqueeze(1)
        D = zero_D if D is None else (D if D.dtype == torch.float32 else converted(per_head(D), torch.float32))
        if dt_bias is not None and dt_bias.dtype != torch.float32:
            dt_bias = converted(per_head(dt_bias), torch.float32)
        rows = cache_rows(scratch, p, slots, record)
        checkpointing_ssu(
            **cs_arguments(
                p, options, state.buffers, layer, x4, dt3, A, B4, C4, D, z4, dt_bias, dt_softplus, out4, rows, trio
            )
        )
        rec = layout.record(state)
        rec.A[layer] = A if A.dim() == 1 else A[:, 0, 0]  # per head, also when given expanded (H, P, N)
        rec.pending_layers.add(layer)
        rec.pending_slots = slots
        if commits_itself and layer == state.num_layers - 1:
            commit(scratch, advance, state, slots, ones[: slots.shape[0]])
        return out

    return step
