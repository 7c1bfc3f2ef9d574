"""The Triton kernels of the ``triton-replay`` backend (written from docs/spec.md, "ReplaySSM").

Per slot and layer the state is a checkpoint plus a ring of the inputs of the last tokens not yet
folded into it (x, B, and per head d and a = A d), with cursors ``start`` (the ring row of the
oldest such token) and ``count``. A step of T tokens reads the checkpoint once and treats the
ring's ``count`` tokens followed by its own T as one sequence of positions ``0 .. count + T - 1``.
With ``cum`` the running sum of ``a`` over that sequence, the output of the token at position m is

    y_m = exp(cum_m) (checkpoint . C_m) + sum over j <= m of exp(cum_m - cum_j) d_j (B_j . C_m) x_j

so a program computes the small per-head weights ``exp(cum_m - cum_j) d_j (B_j . C_m)`` once and
then, per tile of the checkpoint, one matrix-vector product and a weighted sum of ring rows. The
products ``B_j . C_m`` are shared by every program of a group's heads: the gram kernel
(:mod:`.gram`), launched first, computes them once per batch row and group, and appends the
step's B rows to the ring; a program here loads them (``M x TP`` floats) instead of every
position's B row. The checkpoint is rewritten only when the ring would overflow the step's
``window`` (the flush policy of its batch bucket): then the folded tokens are applied to the tile
one by one, in fp32, as the write-every-step kernel does, and the result rounded to the cache
dtype once. An 8-bit checkpoint (``QUANT``) is read as its values times each row's scale and
written with fresh row scales (``ssu.state.quant``'s rule), wherever a kernel here writes one.

Flush rules (``window`` W, ``count`` k):

- one token, no speculation: if ``k + 1 > W`` every token (the ring's and the new one) is folded
  and the ring empties; else the token is appended (``count = k + 1``). W = 0 writes the
  checkpoint every step and never touches the ring: the write-every-step kernel.
- speculative (T tokens, provisional): the new tokens are appended after the ring's; if
  ``k + T > W`` the ring's k tokens are folded (``start += k``, ``count = 0``). The commit then
  adds each sequence's accepted count to ``count``. The logical state (checkpoint advanced by the
  ring's ``count`` tokens) is the same before and after a step, as the contract asks.
- a one-token step into another slot (``dst_slots``): everything folded into the destination's
  checkpoint, its ring emptied; the source slot is left as it was.

With ``FOLDED`` (a plan that names the fold kernel, :mod:`.fold`, launched just before) the
step kernel is compiled without a fold of its own, and the rows that flush are served whole by
that kernel (fold, checkpoint, outputs, a speculative step's appended tokens): their programs here
only take part in moving the cursors. The two kernels serve different rows, so with programmatic
dependent launch this one does not wait for the fold kernel before it starts, only before it ends.

With ``WRITE_THROUGH`` (a one-token step whose plan has window 0 and no fold kernel) every row
flushes, and the kernel is compiled with only the write-every-step update of each tile: a ring
that still holds tokens (its slot stepped before in a bucket with a window) is folded into the
tile token by token first, and is empty afterwards.

With ``STEPWISE`` (a speculative step whose plan has window 0, no fold kernel and ``stepwise``
outputs) no gram kernel runs: each tile folds the ring's accepted tokens, is stored where it
flushes, and then takes the step's T tokens one by one, each output read from the state after its
token (:func:`stepwise_tiles`). It reads a checkpoint once and writes it once, where the
write-every-step kernel of the ``triton`` backend writes T states; a small batch, where the
launches and the dependent chain of a step are the limit, is what it serves.

Every program of a row reads the row's cursors first; a row whose cursors change takes a ticket
(an atomic count per slot and layer) when it is done, and the last program of the row (of the step
kernel, and of the fold kernel where the row flushes) writes the new cursors and resets the
ticket: no program can see the cursors move under it, and a row whose cursors stay
(write-every-step in steady state) takes no ticket at all. New ring rows never overlap the rows
being read (``count + T <= max_window + T``, the ring length).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ssu.state.slot_kernels import _commit_rows

from .tiles import ring_tiles, stepwise_tiles, token_scalars, write_through_tiles
from ..tiles import row_slots, softplus_dt

#: the step and fold kernels' scalar arguments that change between calls: compiled as values, not
#: specialised on (a new pad id or window never compiles anew)
RUNTIME_SCALARS = [
    "pad_slot_id", "num_slots", "window", "row_programs", "fold_programs", "has_d", "has_z", "has_dt_bias", "softplus"
]  # fmt: skip


@triton.jit
def flush_rule(slot, dst, dst_ok, k, window, T: tl.constexpr, SPECULATIVE: tl.constexpr):
    """The flush rule of a row whose ring holds ``k`` tokens (module docstring): whether the row's
    own slot takes the step (``owner``), whether it is a one-token step into another slot
    (``moved``), whether the checkpoint is rewritten (``flush``), how many positions are folded
    (``fold``) and whether the new tokens join the ring (``append``). The step kernel and the fold
    kernel both decide by it, so that they agree on every row."""
    owner = dst_ok & (dst == slot)
    moved = dst_ok & (dst != slot)
    if SPECULATIVE:
        flush = owner & (k > 0) & (k + T > window)
        fold = k
        append = owner
    else:
        flush = moved | (owner & (k + T > window))
        fold = k + T
        append = owner & (k + T <= window)
    return owner, moved, flush, fold, append


@triton.jit
def head_terms(bias_at, D_at, has_dt_bias, has_d):
    """A head's dt bias and skip coefficient D in fp32, 0 for the inputs not given."""
    bias = 0.0
    if has_dt_bias:
        bias = tl.load(bias_at).to(tl.float32)
    d_skip = 0.0
    if has_d:
        d_skip = tl.load(D_at).to(tl.float32)
    return bias, d_skip


@triton.jit(do_not_specialize=RUNTIME_SCALARS)
def replay_kernel(
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
    gram_ptr,
    g_b,
    T: tl.constexpr,
    TP: tl.constexpr,
    RING: tl.constexpr,
    M: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
    SPECULATIVE: tl.constexpr,
    HAS_DST: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    FOLDED: tl.constexpr,
    WRITE_THROUGH: tl.constexpr,
    STEPWISE: tl.constexpr,
    PDL: tl.constexpr,
    CONCURRENT: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program per (TILES tiles of BLOCK_P rows, head, batch row). Ring buffers of the layer:
    x (S, H, RING, P), B (S, G, RING, N), d and a (S, H, RING), cursors and tickets (S,); an 8-bit
    checkpoint's row scales (S, H, P) (``QUANT``, ``tiles.quantized_rows``'s code; 0: none)."""
    if PDL:  # programmatic dependent launch: let the next kernel be scheduled, then wait for the previous one
        tl.extra.cuda.gdc_launch_dependents()
        if not (FOLDED and CONCURRENT):  # beside the fold kernel, which has waited: they serve different rows
            tl.extra.cuda.gdc_wait()
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    group = head // HEADS_PER_GROUP

    if WRITE_THROUGH:  # the token's inputs do not depend on the cursors: their loads issue first, without branches
        wt = token_scalars(
            dt_ptr + row * dt_b + head * dt_h, A_ptr + head * a_h, D_ptr + head * d_h, dt_bias_ptr + head * bias_h,
            B_ptr + row * B_b + group * B_g, B_n, C_ptr + row * C_b + group * C_g, C_n,
            has_d, has_dt_bias, softplus, N, BLOCK_N,
        )  # fmt: skip
    slot, valid, dst, dst_ok = row_slots(
        slots_ptr, dst_ptr, faults_ptr, row, (pid_p == 0) & (head == 0), pad_slot_id, num_slots, HAS_DST
    )
    safe = tl.where(valid, slot, 0)
    start = tl.load(start_ptr + safe, mask=valid, other=0)
    k = tl.load(count_ptr + safe, mask=valid, other=0)
    owner, moved, flush, fold, append = flush_rule(slot, dst, dst_ok, k, window, T, SPECULATIVE)
    target = tl.where(moved, dst, safe)

    if WRITE_THROUGH:  # every row flushes: the write-every-step update, any ring tokens folded first
        write_through_tiles(
            ck_ptr + safe * ck_slot + head * ck_head, ck_ptr + target * ck_slot + head * ck_head, ck_p,
            scale_ptr + safe * sc_slot + head * sc_head, scale_ptr + target * sc_slot + head * sc_head,
            x_ptr + row * x_b + head * x_h, x_p, z_ptr + row * z_b + head * z_h, z_p,
            out_ptr + row * o_b + head * o_h, o_p, *wt, xr_ptr + safe * xr_slot + head * (RING * P),
            Br_ptr + safe * Br_slot + group * (RING * N), dr_ptr + safe * dr_slot + head * RING,
            ar_ptr + safe * dr_slot + head * RING, start, k, seed_ptr,
            (target * 65599 + head * P * N).to(tl.uint32), pid_p, tl.where(valid, P, 0), tl.where(flush, P, 0),
            has_d, has_z,
            RING, P, N, BLOCK_P, BLOCK_N, TILES, STAGES, STOCHASTIC, PHILOX_ROUNDS, QUANT,
        )  # fmt: skip
    elif STEPWISE:  # speculative, window 0: the ring's tokens folded, the step's applied one by one
        a_head = tl.load(A_ptr + head * a_h).to(tl.float32)
        bias, d_skip = head_terms(dt_bias_ptr + head * bias_h, D_ptr + head * d_h, has_dt_bias, has_d)
        seed = 0
        if STOCHASTIC:
            seed = tl.load(seed_ptr)
        stepwise_tiles(
            ck_ptr + safe * ck_slot + head * ck_head, ck_ptr + target * ck_slot + head * ck_head, ck_p,
            scale_ptr + safe * sc_slot + head * sc_head, scale_ptr + target * sc_slot + head * sc_head,
            x_ptr + row * x_b + head * x_h, x_t, x_p, B_ptr + row * B_b + group * B_g, B_t, B_n,
            C_ptr + row * C_b + group * C_g, C_t, C_n, z_ptr + row * z_b + head * z_h, z_t, z_p,
            out_ptr + row * o_b + head * o_h, o_t, o_p, dt_ptr + row * dt_b + head * dt_h, dt_t,
            a_head, bias, d_skip, softplus,
            xr_ptr + safe * xr_slot + head * (RING * P), Br_ptr + safe * Br_slot + group * (RING * N),
            dr_ptr + safe * dr_slot + head * RING, ar_ptr + safe * dr_slot + head * RING,
            start, k, flush, append & (pid_p == 0), (head % HEADS_PER_GROUP) == 0, append,
            seed, (target * 65599 + head * P * N).to(tl.uint32), pid_p, tl.where(valid, P, 0), has_z,
            T, RING, P, N, BLOCK_P, BLOCK_N, TILES, STAGES, STOCHASTIC, PHILOX_ROUNDS, QUANT,
        )  # fmt: skip
    else:
        if FOLDED:  # the fold kernel serves the rows that flush; their programs here only move the cursors
            serve = flush == 0
        else:
            serve = flush | True
        if serve:
            # the sequence of positions: the ring's k tokens, then the step's T
            offs_m = tl.arange(0, M)
            in_ring = offs_m < k
            in_new = (offs_m >= k) & (offs_m < k + T)
            tok = tl.where(in_new, offs_m - k, 0)
            ring_row = (start + offs_m) % RING
            a_head = tl.load(A_ptr + head * a_h).to(tl.float32)
            bias, d_skip = head_terms(dt_bias_ptr + head * bias_h, D_ptr + head * d_h, has_dt_bias, has_d)
            d_new = softplus_dt(
                tl.load(dt_ptr + row * dt_b + tok * dt_t + head * dt_h, mask=in_new, other=0.0).to(tl.float32) + bias,
                softplus,
            )
            d_base = dr_ptr + safe * dr_slot + head * RING
            a_base = ar_ptr + safe * dr_slot + head * RING
            d_m = tl.where(in_ring, tl.load(d_base + ring_row, mask=in_ring, other=0.0), tl.where(in_new, d_new, 0.0))
            a_m = tl.where(
                in_ring, tl.load(a_base + ring_row, mask=in_ring, other=0.0), tl.where(in_new, a_head * d_new, 0.0)
            )
            cum = tl.cumsum(a_m, 0)
            offs_n = tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            Br_base = Br_ptr + safe * Br_slot + group * (RING * N)
            # per output token t (position k + t): weights of every earlier position from the gram
            # kernel's B . C products (:mod:`.gram`), and the checkpoint's decay
            offs_t = tl.arange(0, TP)
            grams = tl.load(gram_ptr + row * g_b + group * (M * TP) + offs_m[:, None] * TP + offs_t[None, :])
            weights = tl.zeros((M, TP), dtype=tl.float32)
            decays = tl.zeros((TP,), dtype=tl.float32)
            for t in tl.static_range(T):
                gram = tl.sum(tl.where(offs_t[None, :] == t, grams, 0.0), axis=1)
                m = k + t
                cum_m = tl.sum(tl.where(offs_m == m, cum, 0.0), axis=0)
                w = tl.where(offs_m <= m, tl.exp(cum_m - cum) * d_m * gram, 0.0)
                weights = tl.where(offs_t[None, :] == t, w[:, None], weights)
                decays = tl.where(offs_t == t, tl.exp(cum_m), decays)

            # several tokens: d and a join the ring as soon as they are known (storing them after the
            # tiles, as for one token below, measured slower at T = 4)
            if T > 1 and append & (pid_p == 0):
                tl.store(d_base + ring_row, d_m, mask=in_new)
                tl.store(a_base + ring_row, a_m, mask=in_new)

            seed = 0
            if STOCHASTIC:
                seed = tl.load(seed_ptr)
            element = (target * 65599 + head * P * N).to(tl.uint32)
            read_base = ck_ptr + safe * ck_slot + head * ck_head
            write_base = ck_ptr + target * ck_slot + head * ck_head
            xr_base = xr_ptr + safe * xr_slot + head * (RING * P)
            x_base = x_ptr + row * x_b + head * x_h
            state_rows = tl.where(valid, P, 0)
            args = (
                read_base, write_base, scale_ptr + safe * sc_slot + head * sc_head,
                scale_ptr + target * sc_slot + head * sc_head, xr_base, x_base, Br_base,
                B_ptr + row * B_b + group * B_g, C_ptr + row * C_b + group * C_g, z_ptr + row * z_b + head * z_h,
                out_ptr + row * o_b + head * o_h,
                ck_p, x_t, x_p, B_t, B_n, C_t, C_n, z_t, z_p, o_t, o_p,
                pid_p, state_rows, append, start, k, fold, ring_row, in_ring, in_new, tok, offs_m,
                offs_n, mask_n,
                weights, decays, d_m, a_m, d_skip, has_d, has_z, seed, element,
            )  # fmt: skip
            if FOLDED:  # the rows served here read the checkpoint only
                ring_tiles(*args, T, TP, RING, P, N, BLOCK_P, TILES, STAGES, False, STOCHASTIC, PHILOX_ROUNDS, QUANT)
            elif flush:  # the rows that rewrite their checkpoint: one pass that folds and stores
                ring_tiles(*args, T, TP, RING, P, N, BLOCK_P, TILES, 0, True, STOCHASTIC, PHILOX_ROUNDS, QUANT)
            else:  # the others read the checkpoint only, with the tile loads pipelined STAGES deep
                ring_tiles(*args, T, TP, RING, P, N, BLOCK_P, TILES, STAGES, False, STOCHASTIC, PHILOX_ROUNDS, QUANT)
            # the new tokens' d and a join the ring (one program of the head; the gram kernel appends
            # B); for one token after the tiles, so that no tile load waits behind these stores
            if T == 1 and append & (pid_p == 0):
                tl.store(d_base + ring_row, d_m, mask=in_new)
                tl.store(a_base + ring_row, a_m, mask=in_new)

    move_cursors(
        start_ptr, count_ptr, ticket_ptr, safe, start, k, owner, flush, append, window, row_programs,
        fold_programs, T, RING, SPECULATIVE,
    )  # fmt: skip
    if moved & (pid_p == 0) & (head == 0):  # the destination's ring is empty: its checkpoint holds everything
        tl.store(start_ptr + dst, 0)
        tl.store(count_ptr + dst, 0)
    if PDL:
        if FOLDED and CONCURRENT:  # this grid completes after the fold kernel, as a kernel after it expects
            tl.extra.cuda.gdc_wait()


@triton.jit
def move_cursors(
    start_ptr, count_ptr, ticket_ptr, safe, start, k, owner, flush, append, window, row_programs, fold_programs,
    T: tl.constexpr, RING: tl.constexpr, SPECULATIVE: tl.constexpr,
):  # fmt: skip
    """The cursors after the step (module docstring), written by the last program of the row when
    they change: the step kernel's ``row_programs`` programs, and where the row flushes the fold
    kernel's ``fold_programs`` (0 when it does not run beside the step kernel). Each takes a ticket
    once it is done with the row, so that no program sees the cursors move under it; the fold
    kernel's programs of a row that does not flush take none (they touch nothing of it). A row
    whose cursors stay (write-every-step in steady state) takes no ticket at all."""
    if SPECULATIVE:
        changed = flush
        new_start = (start + k) % RING
        new_count = k * 0
    else:
        changed = owner & ((k + T <= window) | (k > 0) | (start != 0))
        new_start = tl.where(append, start, 0)
        new_count = tl.where(append, k + T, 0)
    if changed:
        ticket = tl.atomic_add(ticket_ptr + safe, 1, sem="acq_rel")
        if ticket == row_programs + tl.where(flush, fold_programs, 0) - 1:
            tl.store(start_ptr + safe, new_start)
            tl.store(count_ptr + safe, new_count)
            tl.store(ticket_ptr + safe, 0)


@triton.jit(do_not_specialize=["batch", "pad_slot_id", "num_slots", "num_layers", "layer_stride"])
def ring_commit_kernel(
    count_ptr,
    slots_ptr,
    accepted_ptr,
    faults_ptr,
    batch,
    pad_slot_id,
    num_slots,
    num_layers,
    layer_stride,
    T: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """count[layer, slot] += num_accepted for every layer and every row that moves: one launch;
    rows with a slot outside the cache or a count outside 1..T move nothing and are recorded."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    moves, slot, accepted = _commit_rows(slots_ptr, accepted_ptr, faults_ptr, offs, batch, pad_slot_id, num_slots, T)
    for layer in range(0, num_layers):
        ptrs = count_ptr + layer * layer_stride + slot
        count = tl.load(ptrs, mask=moves, other=0)
        tl.store(ptrs, (count + accepted).to(count_ptr.dtype.element_ty), mask=moves)
