"""The fold kernel of ``triton-replay``: the rows of a step that rewrite their checkpoint.

A flushing row folds tokens into its checkpoint: a one-token step every token of its ring and its
own, a speculative step the ring's tokens (its own stay in the ring, provisional until the
commit). Done inside the step kernel, that fold is a sequential loop over up to ``max_window + 1``
tokens in programs shaped for reading (small tiles, one warp), and those rows take several times as
long as the others. This kernel serves those rows whole. Per tile it folds with one matrix product,

    checkpoint' = exp(cum_F) checkpoint + (X * coef) @ B,    coef_j = exp(cum_F - cum_j) d_j

with ``X`` the tile's rows of x over the folded positions, ``B`` their B rows and ``cum`` the
running sum of A d (fp32 products and sums: ``input_precision="ieee"``), stores the checkpoint
rounded once, and computes the step's outputs from the unrounded fold: a one-token step's
``y = checkpoint' . C + D x`` (gated by z); a speculative step's T outputs from ``checkpoint'``
and the step's own tokens, which it appends to the emptied ring as the step kernel appends them.

The step kernel serves every other row, and its programs of a flushing row only take part in
moving the cursors: the two kernels touch different rows, so with programmatic dependent launch
the step kernel starts as soon as every program of this one has (it does not wait for this
kernel to finish, and waits for it only before it ends). Both kernels decide the rows by the same
rule from the same cursors; the cursors are written by the last of both kernels' programs of a row
(:func:`move_cursors`). With ``CONCURRENT`` off (``launch.FOLD_CONCURRENT``, for the probe)
the step kernel waits for this one before it starts, and only the step kernel moves the cursors.
Measured, the overlap gains little on its own; the tile loop's pipelining is what pays
(docs/benchmarks.md, "The fold kernel").

One program per ``HEADS`` heads of one group and one batch row, so that the positions' B rows are
loaded once for all of them; a row that does not flush costs its programs the loads of its slot
and cursors, and no ticket.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel import RUNTIME_SCALARS, flush_rule, head_terms, move_cursors
from .tiles import load_checkpoint, store_checkpoint, store_token_output, store_token_outputs
from ..tiles import row_slots, softplus_dt


@triton.jit(do_not_specialize=RUNTIME_SCALARS)
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
    row_programs,
    fold_programs,
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
    scale_ptr,
    sc_slot,
    sc_head,
    T: tl.constexpr,
    TQ: tl.constexpr,
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
    CONCURRENT: tl.constexpr,
    STAGES: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program per (HEADS heads of a group, batch row); tiles of ROWS rows, M >= 16 positions,
    TQ >= 16 columns for the step's tokens. The arguments are ``replay_kernel``'s."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if CONCURRENT:  # the step kernel that follows may start now: it serves the other rows
            tl.extra.cuda.gdc_launch_dependents()
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
        offs_t = tl.arange(0, TQ)
        t_ok = offs_t < T
        new_row = (start + k + offs_t) % RING  # where a speculative step's tokens join the ring
        if SPECULATIVE:
            mask_tn = t_ok[:, None] & mask_n[None, :]
            B_at = B_ptr + row * B_b + offs_t[:, None] * B_t + group * B_g + offs_n[None, :] * B_n
            C_at = C_ptr + row * C_b + offs_t[:, None] * C_t + group * C_g + offs_n[None, :] * C_n
            B_new = tl.load(B_at, mask=mask_tn, other=0.0)
            C_new = tl.load(C_at, mask=mask_tn, other=0.0).to(tl.float32)
            gram = tl.dot(B_new.to(tl.float32), tl.trans(C_new), input_precision="ieee")  # (j, t): B_j . C_t
            if head0 % HEADS_PER_GROUP == 0:  # one program of the group appends the tokens' B
                tl.store(Br_base + new_row[:, None] * N + offs_n[None, :], B_new, mask=mask_tn)
        else:
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
            a_head = tl.load(A_ptr + head * a_h).to(tl.float32)
            d_new = 0.0
            a_new = 0.0
            if not SPECULATIVE:
                d_new = softplus_dt(tl.load(dt_ptr + row * dt_b + head * dt_h).to(tl.float32) + bias, softplus)
                a_new = a_head * d_new
            d_base = dr_ptr + safe * dr_slot + head * RING
            a_base = ar_ptr + safe * dr_slot + head * RING
            d_m = tl.where(is_new, d_new, tl.load(d_base + ring_row, mask=in_ring, other=0.0))
            a_m = tl.where(is_new, a_new, tl.load(a_base + ring_row, mask=in_ring, other=0.0))
            cum = tl.cumsum(a_m, 0)
            cum_f = tl.sum(tl.where(offs_m == last, cum, 0.0), axis=0)
            coef = tl.where(used, tl.exp(cum_f - cum) * d_m, 0.0)
            decay = tl.exp(cum_f)
            if SPECULATIVE:  # the step's tokens after the fold: weights (j, t) of token j in output t, decays
                d_tok = tl.load(dt_ptr + row * dt_b + offs_t * dt_t + head * dt_h, mask=t_ok, other=0.0)
                d_tok = tl.where(t_ok, softplus_dt(d_tok.to(tl.float32) + bias, softplus), 0.0)
                a_tok = a_head * d_tok
                cum_t = tl.cumsum(a_tok, 0)
                causal = (offs_t[:, None] <= offs_t[None, :]) & t_ok[None, :]
                weights = tl.where(causal, tl.exp(cum_t[None, :] - cum_t[:, None]) * d_tok[:, None] * gram, 0.0)
                decays = tl.exp(cum_t)
                tl.store(d_base + new_row, d_tok, mask=t_ok)
                tl.store(a_base + new_row, a_tok, mask=t_ok)
            read_base = ck_ptr + safe * ck_slot + head * ck_head
            write_base = ck_ptr + target * ck_slot + head * ck_head
            rscale_base = scale_ptr + safe * sc_slot + head * sc_head
            wscale_base = scale_ptr + target * sc_slot + head * sc_head
            xr_base = xr_ptr + safe * xr_slot + head * (RING * P)
            x_base = x_ptr + row * x_b + head * x_h
            z_base = z_ptr + row * z_b + head * z_h
            o_base = out_ptr + row * o_b + head * o_h
            element = (target * 65599 + head * P * N).to(tl.uint32)
            for i in tl.range(0, tl.cdiv(P, ROWS), num_stages=STAGES):
                offs_p = i * ROWS + rows
                mask_p = offs_p < P
                tile = offs_p[:, None] * ck_p + offs_n[None, :]
                mask = mask_p[:, None] & mask_n[None, :]
                s0 = load_checkpoint(read_base, rscale_base, tile, offs_p, mask, mask_p, QUANT)
                X = tl.load(
                    xr_base + ring_row[None, :] * P + offs_p[:, None],
                    mask=mask_p[:, None] & in_ring[None, :],
                    other=0.0,
                ).to(tl.float32)
                if not SPECULATIVE:
                    x_new = tl.load(x_base + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
                    X = tl.where(is_new[None, :], x_new[:, None], X)
                s = decay * s0 + tl.dot(X * coef[None, :], B_m, input_precision="ieee")
                store_checkpoint(
                    s, write_base, wscale_base, tile, offs_p, offs_n, mask, mask_p, seed, element, N, STOCHASTIC,
                    PHILOX_ROUNDS, QUANT,
                )  # fmt: skip
                if SPECULATIVE:  # the T outputs from the unrounded fold; the tokens' x join the ring
                    mask_pt = mask_p[:, None] & t_ok[None, :]
                    X_tok = tl.load(x_base + offs_t[None, :] * x_t + offs_p[:, None] * x_p, mask=mask_pt, other=0.0)
                    tl.store(xr_base + new_row[None, :] * P + offs_p[:, None], X_tok, mask=mask_pt)
                    X_tok = X_tok.to(tl.float32)
                    Y = tl.dot(s, tl.trans(C_new), input_precision="ieee") * decays[None, :]
                    Y += tl.dot(X_tok, weights, input_precision="ieee") + d_skip * X_tok
                    store_token_outputs(Y, z_base, o_base, offs_t, offs_p, z_t, z_p, o_t, o_p, mask_pt, has_z)
                else:  # the token's output, from the folded checkpoint
                    y = tl.sum(s * C_row[None, :], axis=1) + d_skip * x_new
                    store_token_output(y, z_base, o_base, offs_p, z_p, o_p, mask_p, has_z)
    if CONCURRENT:  # the cursors of a row that flushes, with the step kernel's programs of the row
        if flush:
            move_cursors(
                start_ptr, count_ptr, ticket_ptr, safe, start, k, owner, flush, append, window, row_programs,
                fold_programs, T, RING, SPECULATIVE,
            )  # fmt: skip
    if PDL:
        if not CONCURRENT:
            tl.extra.cuda.gdc_launch_dependents()
