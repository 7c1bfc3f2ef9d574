"""The Triton SSU kernel (written from docs/spec.md) and its launcher.

A program updates ``TILES`` tiles of ``BLOCK_P x N`` values of one head of one sequence: it reads
each tile of the slot's current state once, applies the step's T tokens in fp32 registers, writes
each token's state once and writes the outputs. States are read from one (slots, versions, H, P,
N) view and written to another (:class:`ssu.slot_state.LayerViews`): the same tensor for a state
the backend allocated (version ``(c + 1 + t) % K`` when speculative, in place otherwise), an
engine's adopted cache, or, for a speculative step on an adopted cache, draft ``t`` beside it.
Rows read from ``slots`` and write to ``dst_slots`` (the same slots when absent). A row whose slot
is the pad id, or lies outside the cache, reads a zero state and writes none; one whose destination
is writes none;
ids outside the cache are recorded in the kernel's fault record (:mod:`ssu.faults`) by one program
of the row. Two shapes, chosen per batch by
tuning: ``TILES = 1``, one program per tile, grid (P blocks, heads, batch), neighbouring programs
on neighbouring memory; ``TILES > 1``, a program loops over its tiles while Triton's pipeliner
copies the next ``STAGES - 1`` tiles into shared memory (cp.async): more bytes in flight per
register, and the per-sequence work (slot, dt, B, C) done once for all of them. The second is what
brings a bf16 state to the bandwidth limit: with a program per tile, a bf16 tile waits for its
loads in fp32-sized register budgets and the per-program work is paid per 2 KB.

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

from typing import NamedTuple

import triton
import triton.language as tl

from ssu.slot_kernels import pdl_capable


@triton.jit
def _token_inputs(
    x_ptr,
    B_ptr,
    C_ptr,
    dt_ptr,
    z_ptr,
    offs_p,
    offs_n,
    row,
    head,
    group,
    t,
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
    P: tl.constexpr,
    N: tl.constexpr,
    EVEN_N: tl.constexpr,
    BRANCHLESS: tl.constexpr,
    B_IN_TILE: tl.constexpr,
):
    """Token ``t``'s inputs for rows ``offs_p`` in fp32: (dt after bias and softplus, x, z, B, C),
    B and C as vectors of N, or with ``B_IN_TILE`` loaded as (rows, N) in the tile's layout."""
    d = tl.load(dt_ptr + row * dt_b + t * dt_t + head * dt_h).to(tl.float32) + bias
    if BRANCHLESS:
        d = tl.where(softplus & (d <= 20.0), tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    else:
        if softplus:
            d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))))
    x, zv = _row_inputs(
        x_ptr, z_ptr, offs_p, row, head, t, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, has_z, P, BRANCHLESS
    )
    B_ptrs = B_ptr + row * B_b + t * B_t + group * B_g + offs_n * B_n
    C_ptrs = C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n
    if B_IN_TILE:
        every_row = 0 * offs_p[:, None]  # the same B and C for each row, loaded where the row's lanes are
        Bv = tl.load(B_ptrs[None, :] + every_row, mask=(offs_n < N)[None, :], other=0.0).to(tl.float32)
        Cv = tl.load(C_ptrs[None, :] + every_row, mask=(offs_n < N)[None, :], other=0.0).to(tl.float32)
    elif EVEN_N:
        Bv = tl.load(B_ptrs).to(tl.float32)
        Cv = tl.load(C_ptrs).to(tl.float32)
    else:
        Bv = tl.load(B_ptrs, mask=offs_n < N, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptrs, mask=offs_n < N, other=0.0).to(tl.float32)
    return d, x, zv, Bv, Cv


@triton.jit
def _row_inputs(
    x_ptr,
    z_ptr,
    offs_p,
    row,
    head,
    t,
    x_b,
    x_t,
    x_h,
    x_p,
    z_b,
    z_t,
    z_h,
    z_p,
    has_z,
    P: tl.constexpr,
    BRANCHLESS: tl.constexpr,
):
    """Token ``t``'s x and z for rows ``offs_p`` (fp32; z zeros when absent)."""
    mask_p = offs_p < P
    x = tl.load(x_ptr + row * x_b + t * x_t + head * x_h + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
    z_ptrs = z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p
    if BRANCHLESS:
        zv = tl.load(z_ptrs, mask=mask_p & has_z, other=0.0).to(tl.float32)
    else:
        zv = tl.zeros_like(x)
        if has_z:
            zv = tl.load(z_ptrs, mask=mask_p, other=0.0).to(tl.float32)
    return x, zv


@triton.jit
def _state_mask(offs_p, offs_n, state_rows, N: tl.constexpr, EVEN_N: tl.constexpr):
    """Which values of a state tile exist: none of a pad row's (``state_rows`` 0), so it reads
    zeros and writes nothing."""
    if EVEN_N:  # no mask along N: the mask stays constant along rows and accesses stay vectorised
        return (offs_p < state_rows)[:, None]
    else:
        return (offs_p < state_rows)[:, None] & (offs_n < N)[None, :]


@triton.jit
def _load_tile(base, cur, s_ver, s_p, offs_p, offs_n, state_rows, N: tl.constexpr, EVEN_N: tl.constexpr):
    """The state tile of rows ``offs_p`` as stored (no conversion: a bf16 tile waits in half the
    registers)."""
    return tl.load(
        base + cur * s_ver + offs_p[:, None] * s_p + offs_n[None, :],
        mask=_state_mask(offs_p, offs_n, state_rows, N, EVEN_N),
        other=0.0,
    )


@triton.jit
def _rows(
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
    has_d,
    has_z,
    softplus,
    T: tl.constexpr,
    K: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPECULATIVE: tl.constexpr,
    CURSOR: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    BRANCHLESS: tl.constexpr,
    B_IN_TILE: tl.constexpr,
):
    """Update rows ``offs_p`` of one head of one sequence through the step's T tokens, from their
    loaded state tile ``s_raw`` and token 0's inputs (B and C vectors, or tiles with
    ``B_IN_TILE``), storing to ``wbase`` (``write_rows`` 0: nowhere). Each later token's inputs
    are loaded before the earlier token's stores, so their latency overlaps (the compiler may not
    move a load past a store to memory it cannot prove distinct)."""
    mask_p = offs_p < P
    state_mask = _state_mask(offs_p, offs_n, write_rows, N, EVEN_N)
    tile = offs_p[:, None] * s_p + offs_n[None, :]
    s = s_raw.to(tl.float32)
    d, x, zv, Bv, Cv = d0, x0, z0, B0, C0
    for t in tl.static_range(T):
        # an explicit fma: the compiler could otherwise contract either product, so the
        # state's last bit would depend on the launch shape
        if B_IN_TILE:
            s = tl.fma(s, tl.exp(a * d), (d * x)[:, None] * Bv)
            y = tl.sum(s * Cv, axis=1)
        else:
            s = tl.fma(s, tl.exp(a * d), (d * x)[:, None] * Bv[None, :])
            y = tl.sum(s * Cv[None, :], axis=1)
        if has_d:
            y += d_skip * x
        if has_z:
            y = y * zv * tl.sigmoid(zv)
        if t + 1 < T:
            d, x, zv, Bv, Cv = _token_inputs(
                x_ptr,
                B_ptr,
                C_ptr,
                dt_ptr,
                z_ptr,
                offs_p,
                offs_n,
                row,
                head,
                group,
                t + 1,
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
                B_IN_TILE,
            )
        tl.store(out_ptr + row * o_b + t * o_t + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty), mask=mask_p)
        if SPECULATIVE or t == T - 1:
            if STOCHASTIC:
                noise = (
                    tl.randint(seed + t, element + (offs_p[:, None] * N + offs_n[None, :]).to(tl.uint32), PHILOX_ROUNDS)
                    & 0x1FFF
                )
                bits = s.to(tl.uint32, bitcast=True) + noise
                stored = bits.to(tl.float32, bitcast=True).to(tl.float16, fp_downcast_rounding="rtz")
            else:
                stored = s.to(write_ptr.dtype.element_ty)
            if SPECULATIVE and CURSOR:
                dest = (cur + 1 + t) % K  # the versions of an allocated state
            elif SPECULATIVE:
                dest = t  # the drafts beside an adopted cache
            else:
                dest = 0
            tl.store(wbase + dest * w_ver + tile, stored, mask=state_mask)


# The strides stay specialised: their divisibility by 16 (with the views' 16-byte aligned data
# pointers) is what lets Triton prove that state tiles are 16-byte aligned and move them in 16-byte
# vectors. Left out of the specialisation, a bf16 state moved in 2-byte accesses at 128 registers a
# thread (65 % of the H200's bandwidth instead of 90 %).
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
):
    if PDL:  # programmatic dependent launch: let the next kernel be scheduled, then wait for the previous one
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2)
    group = head // HEADS_PER_GROUP

    slot = tl.load(slots_ptr + row).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots) & (slot != pad_slot_id)
    if HAS_DST:
        dst = tl.load(dst_ptr + row).to(tl.int64)
        dst_valid = valid & (dst >= 0) & (dst < num_slots) & (dst != pad_slot_id)  # a pad row writes nothing
    else:
        dst = slot
        dst_valid = valid
    if (pid_p == 0) & (head == 0):  # one program of the row records an id outside the cache
        if ((slot < 0) | (slot >= num_slots)) & (slot != pad_slot_id):
            tl.atomic_min(faults_ptr, (row.to(tl.int64) << 34) | (slot & 0xFFFFFFFF))
        if HAS_DST:
            if ((dst < 0) | (dst >= num_slots)) & (dst != pad_slot_id):
                tl.atomic_min(faults_ptr, (row.to(tl.int64) << 34) | (1 << 32) | (dst & 0xFFFFFFFF))
    safe_slot = tl.where(valid, slot, 0)
    state_rows = tl.where(valid, P, 0)
    write_rows = tl.where(dst_valid, P, 0)
    if CURSOR:
        cur = tl.load(cursor_ptr + safe_slot).to(tl.int64)
    else:
        cur = 0
    rbase = read_ptr + safe_slot * r_slot + head * s_head
    wbase = write_ptr + tl.where(dst_valid, dst, 0) * w_slot + head * s_head

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
    d0, x0, z0, B0, C0 = _token_inputs(
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
        s_raw = _load_tile(rbase, cur, r_ver, s_p, first + rows, offs_n, state_rows, N, EVEN_N)
        _rows(
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
        )
    else:  # TILES tiles in a loop whose state loads Triton pipelines STAGES deep through shared memory
        for i in tl.range(0, TILES, num_stages=STAGES):
            offs_p = first + i * BLOCK_P + rows
            x_i, z_i = _row_inputs(
                x_ptr, z_ptr, offs_p, row, head, 0, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, has_z, P, BRANCHLESS
            )
            s_raw = _load_tile(rbase, cur, r_ver, s_p, offs_p, offs_n, state_rows, N, EVEN_N)
            _rows(
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
            )


def _strides(t, lead: int):
    """Strides of a (b, [T,] ...) tensor as (b, t, rest...) with a zero token stride if absent (a
    per-head dt expanded over P keeps its head stride third; its P stride, 0, is not read)."""
    st = t.stride()
    return (st[0], 0) + st[1:] if lead == 1 else st


class StepConstants(NamedTuple):
    """What a kernel's every launch shares: from the problem, the state's layout and the options."""

    pad_slot_id: int
    num_slots: int
    heads_per_group: int
    speculative: bool
    cursor: bool  # speculative versions found through a cursor (an allocated state)
    versions: int
    stochastic: bool
    philox_rounds: int


def launch(
    read,
    write,
    cursor,
    x,
    dt,
    A,
    B,
    C,
    slots,
    D,
    z,
    dt_bias,
    dt_softplus,
    out,
    seed,
    dst_slots,
    faults,
    consts: StepConstants,
    schedule,
):
    """Launch one step of one layer: states read from ``read`` and written to ``write``, both
    (slots, versions, H, P, N) views (:class:`ssu.slot_state.LayerViews`); ``schedule`` a
    :class:`~ssu_backend_triton.tuning.Schedule`: ``block_p`` rows per tile, ``num_warps``,
    ``tiles`` per program and the ``stages`` of its pipelined loop (see the module docstring),
    ``maxnreg`` a cap on registers per thread (0: the compiler's choice; it sets how many
    programs, hence how many bytes in flight, fit on an SM), ``pdl`` for programmatic dependent
    launch (ignored below compute capability 9.0 and in the interpreter: the program lets the
    next kernel be scheduled at once and waits for the previous kernel to finish before it reads
    anything, so the launch of one step overlaps the drain of the kernel before it) and
    ``branchless`` (the optional inputs loaded with predicated loads instead of uniform
    branches). Returns Triton's handle of the compiled kernel (its PTX and register count are
    what tests and the schedule probe inspect)."""
    block_p, num_warps, tiles, stages, maxnreg, pdl, branchless = schedule
    b = x.shape[0]
    multi = x.dim() == 4
    T = x.shape[1] if multi else 1
    H, P = x.shape[-2], x.shape[-1]
    N = B.shape[-1]
    lead = 2 if multi else 1
    xs = _strides(x, lead)
    dts = _strides(dt, lead)
    Bs = _strides(B, lead)
    Cs = _strides(C, lead)
    zs = _strides(z, lead) if z is not None else (0, 0, 0, 0)
    os_ = _strides(out, lead)
    rs = read.stride()
    ws = write.stride()
    grid = (triton.cdiv(P, block_p * tiles), H, b)
    pdl = bool(pdl) and pdl_capable(read.device)
    return ssu_kernel[grid](
        read,
        write,
        cursor if cursor is not None else slots,
        x,
        dt,
        A,
        B,
        C,
        slots,
        dst_slots if dst_slots is not None else slots,
        D if D is not None else A,
        z if z is not None else x,
        dt_bias if dt_bias is not None else A,
        out,
        seed if seed is not None else slots,
        faults,
        consts.pad_slot_id,
        consts.num_slots,
        rs[0],
        rs[1],
        ws[0],
        ws[1],
        rs[2],
        rs[3],
        A.stride(0),
        0 if D is None else D.stride(0),
        0 if dt_bias is None else dt_bias.stride(0),
        xs[0],
        xs[1],
        xs[2],
        xs[3],
        dts[0],
        dts[1],
        dts[2],
        Bs[0],
        Bs[1],
        Bs[2],
        Bs[3],
        Cs[0],
        Cs[1],
        Cs[2],
        Cs[3],
        zs[0],
        zs[1],
        zs[2],
        zs[3],
        os_[0],
        os_[1],
        os_[2],
        os_[3],
        D is not None,
        z is not None,
        dt_bias is not None,
        bool(dt_softplus),
        T=T,
        K=consts.versions,
        HEADS_PER_GROUP=consts.heads_per_group,
        P=P,
        N=N,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N),
        EVEN_N=triton.next_power_of_2(N) == N,
        TILES=tiles,
        STAGES=stages,
        SPECULATIVE=consts.speculative,
        CURSOR=consts.cursor,
        HAS_DST=dst_slots is not None,
        STOCHASTIC=consts.stochastic,
        PHILOX_ROUNDS=consts.philox_rounds,
        PDL=pdl,
        BRANCHLESS=bool(branchless),
        num_warps=num_warps,
        maxnreg=maxnreg or None,
        launch_pdl=pdl,
    )
