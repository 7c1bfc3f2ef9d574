"""The gram kernel of ``triton-replay``: per batch row and group, the dot products of every position's
B row with every output token's C, ``gram[m, t] = B_m . C_t``, launched before the step kernel.

A step's output weights (:mod:`.kernel`'s docstring) are ``exp(cum_m - cum_j) d_j gram[j,
t]``: the exponentials and d are per head, but the gram is shared by every head of a group and
every program of a head. Computed inside the step kernel, each of its programs loads the ring's B
rows of every position (``M x N`` values, more than its own checkpoint tile for a 2-byte state)
and reduces them against each token's C; here each (row, group) does it once and the step kernel's
programs load ``M x TP`` floats. The kernel also appends the step's own B rows to the ring where
the row appends its tokens (the step kernel appends x, d and a), so that the step kernel never
loads B at all unless its row folds.

It reads the row's slot and cursors exactly as the step kernel does (same flush rule), and writes
only the gram rows of its batch rows and ring rows past the ring's tokens, which no program of the
same step reads. With programmatic dependent launch it waits for the kernel before it (the previous
step moved the cursors), and the step kernel or the fold kernel after it waits for it in turn.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernel import flush_rule
from ..tiles import row_slots


@triton.jit(do_not_specialize=["pad_slot_id", "num_slots", "window"])
def gram_kernel(
    gram_ptr,
    Br_ptr,
    start_ptr,
    count_ptr,
    B_ptr,
    C_ptr,
    slots_ptr,
    dst_ptr,
    faults_ptr,
    pad_slot_id,
    num_slots,
    window,
    Br_slot,
    g_b,
    B_b,
    B_t,
    B_g,
    B_n,
    C_b,
    C_t,
    C_g,
    C_n,
    T: tl.constexpr,
    TP: tl.constexpr,
    RING: tl.constexpr,
    M: tl.constexpr,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPECULATIVE: tl.constexpr,
    HAS_DST: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (group, batch row): ``gram`` (rows, G, M, TP) fp32, position-major; B rows
    of the ring (S, G, RING, N)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    group = tl.program_id(0)
    row = tl.program_id(1)
    slot, valid, dst, dst_ok = row_slots(slots_ptr, dst_ptr, faults_ptr, row, False, pad_slot_id, num_slots, HAS_DST)
    safe = tl.where(valid, slot, 0)
    start = tl.load(start_ptr + safe, mask=valid, other=0)
    k = tl.load(count_ptr + safe, mask=valid, other=0)
    _, _, _, _, append = flush_rule(slot, dst, dst_ok, k, window, T, SPECULATIVE)

    offs_m = tl.arange(0, M)
    in_ring = offs_m < k
    in_new = (offs_m >= k) & (offs_m < k + T)
    tok = tl.where(in_new, offs_m - k, 0)
    ring_row = (start + offs_m) % RING
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    Br_base = Br_ptr + safe * Br_slot + group * (RING * N)
    B_ring = tl.load(
        Br_base + ring_row[:, None] * N + offs_n[None, :], mask=in_ring[:, None] & mask_n[None, :], other=0.0
    )
    B_new = tl.load(
        B_ptr + row * B_b + tok[:, None] * B_t + group * B_g + offs_n[None, :] * B_n,
        mask=in_new[:, None] & mask_n[None, :],
        other=0.0,
    )
    B_m = B_ring.to(tl.float32) + B_new.to(tl.float32)  # one of the two is zero at each position
    offs_t = tl.arange(0, TP)
    gram = tl.zeros((M, TP), dtype=tl.float32)
    for t in tl.static_range(T):
        C_tok = tl.load(C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n, mask=mask_n, other=0.0)
        dots = tl.sum(B_m * C_tok.to(tl.float32)[None, :], axis=1)
        gram = tl.where(offs_t[None, :] == t, dots[:, None], gram)
    tl.store(gram_ptr + row * g_b + group * (M * TP) + offs_m[:, None] * TP + offs_t[None, :], gram)
    if append:
        tl.store(Br_base + ring_row[:, None] * N + offs_n[None, :], B_new, mask=in_new[:, None] & mask_n[None, :])
