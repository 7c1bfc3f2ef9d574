"""The fold kernel of ``triton-replay``: the rows of a step that rewrite their checkpoint.

A flushing row folds tokens into its checkpoint: a one-token step every token of its ring and its
own, a speculative step the ring's tokens (its own stay in the ring, provisional until the
commit). Done inside the step kernel, that fold is a sequential loop over up to ``max_window + 1``
tokens in programs shaped for reading (small tiles, one warp), and those rows take several times as
long as the others. This kernel, launched just before the step kernel, does the fold of those rows
as one matrix product per tile,

    checkpoint' = exp(cum_F) checkpoint + (X * coef) @ B,    coef_j = exp(cum_F - cum_j) d_j

with ``X`` the tile's rows of x over the folded positions, ``B`` their B rows and ``cum`` the
running sum of A d (fp32 products and sums: ``input_precision="ieee"``), and stores the checkpoint
rounded once. For a one-token step it also stores the token's output from it (``y = checkpoint' .
C + D x``, gated by z), and the step kernel's programs of that row only move the cursors; for a
speculative step the step kernel then serves the row from the new checkpoint and an empty ring,
so that path is taken for fp32 checkpoints only (the outputs must come from the unrounded state).
This kernel reads the cursors and never writes them: the step kernel that follows sees the same
cursors, decides the same rows by the same rule and moves their cursors.

One program per ``HEADS`` heads of one group and one batch row, so that the positions' B rows are
loaded once for all of them; a row that does not flush costs its programs two loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .replay_kernel import flush_rule, head_terms
from .tiles import rounded_state, row_slots, softplus_dt


@triton.jit(do_not_specialize=["pad_slot_id", "num_slots", "window", "has_d", "has_z", "has_dt_bias", "softplus"])
def fold_kernel(
    ck_ptr,
    xr_ptr,
    Br_ptr,
    dr_ptr,
    ar_ptr,
    start_ptr,
    count_ptr,
    ticket_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    slots_ptr,
    dst_ptr,
    D_ptr,
    z_ptr,
    dt_bias_ptr,
    out_ptr,
    seed_ptr,
    faults_ptr,
    pad_slot_id,
    num_slots,
    window,
    ck_slot,
    ck_head,
    ck_p,
    xr_slot,
    Br_slot,
    dr_slot,
    a_h,
    d_h,
    bias_h,
    x_b,
    x_t,
    x_h,
    x_p,
    dt_b,
    dt_t,
    dt_h,
    B_b,
    B_t,
    B_g,
    B_n,
    C_b,
    C_t,
    C_g,
    C_n,
    z_b,
    z_t,
    z_h,
    z_p,
    o_b,
    o_t,
    o_h,
    o_p,
    has_d,
    has_z,
    has_dt_bias,
    softplus,
    T: tl.constexpr,
    SPECULATIVE: tl.constexpr,
    RING: tl.constexpr,
    M: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_DST: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (HEADS heads of a group, batch row); tiles of ROWS rows, M >= 16 positions.
    The arguments are ``replay_kernel``'s (the ticket and the token strides unused: a one-token step
    folds its only token, a speculative one none of its own)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    head0 = tl.program_id(0) * HEADS
    row = tl.program_id(1)
    group = head0 // HEADS_PER_GROUP
    slot, valid, dst, dst_ok = row_slots(slots_ptr, dst_ptr, faults_ptr, row, False, pad_slot_id, num_slots, HAS_DST)
    safe = tl.where(valid, slot, 0)
    start = tl.load(start_ptr + safe, mask=valid, other=0)
    k = tl.load(count_ptr + safe, mask=valid, other=0)
    owner, moved, flush, fold, append = flush_rule(slot, dst, dst_ok, k, window, T, SPECULATIVE)  # as the step kernel
    if flush:
        target = tl.where(moved, dst, safe)
        offs_m = tl.arange(0, M)
        in_ring = offs_m < k
        if SPECULATIVE:  # the ring's k tokens; the step's own are not folded
            is_new = offs_m < 0
            last = k - 1
        else:  # the ring's k tokens, then the step's one at position k
            is_new = offs_m == k
            last = k
        used = offs_m <= last
        ring_row = (start + offs_m) % RING
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        Br_base = Br_ptr + safe * Br_slot + group * (RING * N)
        B_m = tl.load(
            Br_base + ring_row[:, None] * N + offs_n[None, :], mask=in_ring[:, None] & mask_n[None, :], other=0.0
        ).to(tl.float32)
        if not SPECULATIVE:
            B_new = tl.load(B_ptr + row * B_b + group * B_g + offs_n * B_n, mask=mask_n, other=0.0).to(tl.float32)
            B_m = tl.where(is_new[:, None], B_new[None, :], B_m)
            C_row = tl.load(C_ptr + row * C_b + group * C_g + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
        rows = tl.arange(0, ROWS)
        seed = 0
        if STOCHASTIC:
            seed = tl.load(seed_ptr)
        for hh in range(0, HEADS):
            head = head0 + hh
            bias, d_skip = head_terms(dt_bias_ptr + head * bias_h, D_ptr + head * d_h, has_dt_bias, has_d)
            d_new = 0.0
            a_new = 0.0
            if not SPECULATIVE:
                d_new = softplus_dt(tl.load(dt_ptr + row * dt_b + head * dt_h).to(tl.float32) + bias, softplus)
                a_new = tl.load(A_ptr + head * a_h).to(tl.float32) * d_new
            d_base = dr_ptr + safe * dr_slot + head * RING
            a_base = ar_ptr + safe * dr_slot + head * RING
            d_m = tl.where(is_new, d_new, tl.load(d_base + ring_row, mask=in_ring, other=0.0))
            a_m = tl.where(is_new, a_new, tl.load(a_base + ring_row, mask=in_ring, other=0.0))
            cum = tl.cumsum(a_m, 0)
            cum_f = tl.sum(tl.where(offs_m == last, cum, 0.0), axis=0)
            coef = tl.where(used, tl.exp(cum_f - cum) * d_m, 0.0)
            decay = tl.exp(cum_f)
            read_base = ck_ptr + safe * ck_slot + head * ck_head
            write_base = ck_ptr + target * ck_slot + head * ck_head
            xr_base = xr_ptr + safe * xr_slot + head * (RING * P)
            x_base = x_ptr + row * x_b + head * x_h
            element = (target * 65599 + head * P * N).to(tl.uint32)
            for i in range(0, tl.cdiv(P, ROWS)):
                offs_p = i * ROWS + rows
                mask_p = offs_p < P
                tile = offs_p[:, None] * ck_p + offs_n[None, :]
                mask = mask_p[:, None] & mask_n[None, :]
                s0 = tl.load(read_base + tile, mask=mask, other=0.0).to(tl.float32)
                X = tl.load(
                    xr_base + ring_row[None, :] * P + offs_p[:, None],
                    mask=mask_p[:, None] & in_ring[None, :],
                    other=0.0,
                ).to(tl.float32)
                if not SPECULATIVE:
                    x_new = tl.load(x_base + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
                    X = tl.where(is_new[None, :], x_new[:, None], X)
                s = decay * s0 + tl.dot(X * coef[None, :], B_m, input_precision="ieee")
                stored = rounded_state(s, write_base, seed, element, offs_p, offs_n, N, STOCHASTIC, PHILOX_ROUNDS)
                tl.store(write_base + tile, stored, mask=mask)
                if not SPECULATIVE:  # the token's output, from the folded checkpoint
                    y = tl.sum(s * C_row[None, :], axis=1) + d_skip * x_new
                    if has_z:
                        zv = tl.load(z_ptr + row * z_b + head * z_h + offs_p * z_p, mask=mask_p, other=0.0)
                        zv = zv.to(tl.float32)
                        y = y * zv * tl.sigmoid(zv)
                    out_at = out_ptr + row * o_b + head * o_h + offs_p * o_p
                    tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=mask_p)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
