"""The Triton SSU kernel (written from docs/spec.md).

A program updates ``TILES`` tiles of ``BLOCK_P x N`` values of one head of one sequence: it reads
each tile of the slot's current state once, applies the step's T tokens in fp32 registers, writes
each token's state once and writes the outputs. States are read from one (slots, versions, H, P,
N) view and written to another (:class:`ssu.state.slot_state.LayerViews`): the same tensor for a state
the backend allocated (version ``(c + 1 + t) % K`` when speculative, in place otherwise), an
engine's adopted cache, or, for a speculative step on an adopted cache, draft ``t`` beside it.
Rows read from ``slots`` and write to ``dst_slots`` (the same slots when absent). A row whose slot
is the pad id, or lies outside the cache, reads a zero state and writes none; one whose destination
is either writes none; ids outside the cache are recorded in the kernel's fault record
(:mod:`ssu.state.faults`) by one program of the row. Two shapes, chosen per batch by
tuning: ``TILES = 1``, one program per tile, grid (P blocks, heads, batch), neighbouring programs
on neighbouring memory; ``TILES > 1``, a program loops over its tiles while Triton's pipeliner
copies the next ``STAGES - 1`` tiles into shared memory (cp.async): more bytes in flight per
register, and the per-sequence work (slot, dt, B, C) done once for all of them. The second is what
brings a bf16 state to the bandwidth limit: with a program per tile, a bf16 tile waits for its
loads in fp32-sized register budgets and the per-program work is paid per 2 KB.

An 8-bit cache (``QUANT`` 1 for int8, 2 for fp8 e4m3, 3 and 4 for them in Triton's interpreter) is
read with each row's fp32 scale and written with a fresh one: the row's largest magnitude over 127
or 448, its values rounded to nearest, ties to even (``ssu.state.quant`` states the same rule). An 8-bit
step has a quarter of an fp32 step's bytes to move, so its arithmetic must stay lean: no value
goes through a conversion instruction or a division (``tiles.quantized_rows``).
The scales have their own pointers and slot, version and head strides;
rows are contiguous in them.

Optional inputs (D, z, dt_bias) and softplus are runtime flags, not specialisations, so one
compiled kernel serves every combination. ``BRANCHLESS`` (a schedule choice) decides how: with
uniform branches around their loads and softplus, or with predicated loads and a select, so that
no branch separates a token's loads and the compiler can issue them together (fewer serialised
memory round trips, more registers live; the tuner keeps whichever is faster). With ``PDL`` the
kernel takes part in programmatic dependent launch: it reads nothing before the previous kernel
has finished, and lets the next one be scheduled as soon as it starts.

In the looping shape B and C are loaded straight into the tile's register layout (each lane
loads the columns it multiplies; the repeats hit L1) instead of once per program and then
redistributed through shared memory: that redistribution put barriers between the program's
first loads and its pipelined state copies, so the state reads started a memory round trip late.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import load_state, row_inputs, row_slots, token_inputs, update_rows


@triton.jit(do_not_specialize=["pad_slot_id", "num_slots", "has_d", "has_z", "has_dt_bias", "softplus"])
def ssu_kernel(
    read_ptr,
    write_ptr,
    cursor_ptr,
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
    rscale_ptr,
    wscale_ptr,
    pad_slot_id,
    num_slots,
    r_slot,
    r_ver,
    w_slot,
    w_ver,
    s_head,
    s_p,
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
    rs_slot,
    rs_ver,
    rs_head,
    ws_slot,
    ws_ver,
    ws_head,
    has_d,
    has_z,
    has_dt_bias,
    softplus,
    T: tl.constexpr,
    K: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
    SPECULATIVE: tl.constexpr,
    CURSOR: tl.constexpr,
    HAS_DST: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    PDL: tl.constexpr,
    BRANCHLESS: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program per (TILES blocks of P, head, batch row): load the state tile, run the T tokens, store outputs and
    state."""
    if PDL:  # programmatic dependent launch: let the next kernel be scheduled, then wait for the previous one
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    group = head // HEADS_PER_GROUP

    slot, valid, dst, dst_valid = row_slots(
        slots_ptr, dst_ptr, faults_ptr, row, (pid_p == 0) & (head == 0), pad_slot_id, num_slots, HAS_DST
    )
    safe_slot = tl.where(valid, slot, 0)
    state_rows = tl.where(valid, P, 0)
    write_rows = tl.where(dst_valid, P, 0)
    if CURSOR:
        cur = tl.load(cursor_ptr + safe_slot).to(tl.int64)
    else:
        cur = 0
    rbase = read_ptr + safe_slot * r_slot + head * s_head
    wbase = write_ptr + tl.where(dst_valid, dst, 0) * w_slot + head * s_head
    rscale = rscale_ptr + safe_slot * rs_slot + head * rs_head  # an 8-bit cache's row scales (QUANT)
    wscale = wscale_ptr + tl.where(dst_valid, dst, 0) * ws_slot + head * ws_head

    a = tl.load(A_ptr + head * a_h).to(tl.float32)
    if BRANCHLESS:
        d_skip = tl.load(D_ptr + head * d_h, mask=has_d, other=0.0).to(tl.float32)
        bias = tl.load(dt_bias_ptr + head * bias_h, mask=has_dt_bias, other=0.0).to(tl.float32)
    else:
        d_skip = 0.0
        if has_d:
            d_skip = tl.load(D_ptr + head * d_h).to(tl.float32)
        bias = 0.0
        if has_dt_bias:
            bias = tl.load(dt_bias_ptr + head * bias_h).to(tl.float32)
    seed = 0
    element = (dst * 65599 + head * P * N).to(tl.uint32)
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    offs_n = tl.arange(0, BLOCK_N)
    first = pid_p * (BLOCK_P * TILES)
    rows = tl.arange(0, BLOCK_P)
    # token 0's inputs for the first tile (dt, B and C serve every tile of the program)
    d0, x0, z0, B0, C0 = token_inputs(
        x_ptr,
        B_ptr,
        C_ptr,
        dt_ptr,
        z_ptr,
        first + rows,
        offs_n,
        row,
        head,
        group,
        0,
        bias,
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
        has_z,
        softplus,
        P,
        N,
        EVEN_N,
        BRANCHLESS,
        TILES > 1,
    )

    if TILES == 1:  # one program per tile
        s_raw, s_scale = load_state(
            rbase, rscale, cur, r_ver, rs_ver, s_p, first + rows, offs_n, state_rows, N, EVEN_N, QUANT
        )
        update_rows(
            write_ptr,
            x_ptr,
            B_ptr,
            C_ptr,
            dt_ptr,
            z_ptr,
            out_ptr,
            first + rows,
            offs_n,
            write_rows,
            wbase,
            cur,
            row,
            head,
            group,
            a,
            d_skip,
            bias,
            element,
            seed,
            s_raw,
            s_scale,
            x0,
            z0,
            d0,
            B0,
            C0,
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
            w_ver,
            s_p,
            wscale,
            ws_ver,
            has_d,
            has_z,
            softplus,
            T,
            K,
            P,
            N,
            EVEN_N,
            SPECULATIVE,
            CURSOR,
            STOCHASTIC,
            PHILOX_ROUNDS,
            BRANCHLESS,
            False,
            QUANT,
        )
    else:  # TILES tiles in a loop whose state loads Triton pipelines STAGES deep through shared memory
        for i in tl.range(0, TILES, num_stages=STAGES):
            offs_p = first + i * BLOCK_P + rows
            x_i, z_i = row_inputs(
                x_ptr, z_ptr, offs_p, row, head, 0, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, has_z, P, BRANCHLESS
            )
            s_raw, s_scale = load_state(
                rbase, rscale, cur, r_ver, rs_ver, s_p, offs_p, offs_n, state_rows, N, EVEN_N, QUANT
            )
            update_rows(
                write_ptr,
                x_ptr,
                B_ptr,
                C_ptr,
                dt_ptr,
                z_ptr,
                out_ptr,
                offs_p,
                offs_n,
                write_rows,
                wbase,
                cur,
                row,
                head,
                group,
                a,
                d_skip,
                bias,
                element,
                seed,
                s_raw,
                s_scale,
                x_i,
                z_i,
                d0,
                B0,
                C0,
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
                w_ver,
                s_p,
                wscale,
                ws_ver,
                has_d,
                has_z,
                softplus,
                T,
                K,
                P,
                N,
                EVEN_N,
                SPECULATIVE,
                CURSOR,
                STOCHASTIC,
                PHILOX_ROUNDS,
                BRANCHLESS,
                True,
                QUANT,
            )
