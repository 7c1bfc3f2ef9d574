"""The Triton kernels of the engines' call forms (docs/spec.md, "Engine call forms").

``packed_kernel`` serves vLLM's call: one program per (block of P rows, head, sequence) reads the
sequence's offsets, its accepted count and from them its start slot, loads that state tile once,
applies the sequence's tokens in fp32 registers and stores each token's state to the slot its
column of the destination table names (rounded to the cache dtype; an 8-bit cache quantised per
row with a fresh scale), and each token's output to its packed row. ``verify_kernel`` serves
SGLang's: one program per (block of P rows, head, row) applies the row's T tokens, stores the state
after each to the intermediate-state buffer, continues a token from its parent's state read back
from that buffer where a parent table says so, and writes the last state to the slot unless the
call leaves the cache untouched.

At a small batch a call is a chain of memory round trips, not a stream of bytes: a program that
loads its slot, then its state, then each token's inputs after the previous token's stores (the
compiler may not move a load past a store it cannot prove distinct) waits about twice per token.
With ``PREFETCH`` a program loads everything that depends on nothing loaded at once (offsets,
count, every cell of its rows of the tables, the head's terms, and for the verify call every
token's inputs and parents), picks the start cell from the cells, then loads the state with every
token's inputs before the first store; the verify call keeps the states a later token may take as
its parent in registers, rounded to the buffer's dtype as the buffer holds them, instead of reading
them back. Without it (sequences longer than the registers allow) each token's inputs are loaded in
its turn. With ``PDL`` a program takes part in programmatic dependent launch: it lets the next
kernel be scheduled and reads nothing before the previous kernel has finished.

Both guard what they read: an id that names neither a slot nor the pad id, an accepted count
outside 0..W, offsets that leave the call's tokens or exceed the tables' width, a parent at or
after its token, a buffer row outside the buffer; each is served as the spec says and recorded in
the kernel's fault record by the first program of its sequence (``ssu.state.faults``, kind 3). States
are read from and written to one (slots, versions, H, P, N) view (the logical state, in place);
an allocated speculative state's version of each slot comes from its cursor.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import int8_to_float, quantized_rows, rounded_state, softplus_dt

# the argument codes of an engine call's fault key (ssu.state.faults: engine_row, ENGINE, E_*), as
# constexpr: a compiled kernel reads no other module global
E_SLOTS, E_DST_SLOTS, E_NUM_ACCEPTED, E_CU_SEQLENS, E_PARENTS, E_BUFFER_ROWS, E_ROW_SLOTS = map(tl.constexpr, range(7))


@triton.jit
def engine_fault(faults_ptr, arg, n, t, value):
    """Lower the fault record with the key of argument ``arg``'s value at sequence ``n``, token ``t``."""
    n64 = tl.minimum(n.to(tl.int64), (1 << 19) - 1)
    t64 = tl.minimum(tl.full((), t, tl.int64), 127)
    row = (arg << 26) | (n64 << 7) | t64
    tl.atomic_min(faults_ptr, (row << 34) | (3 << 32) | (value.to(tl.int64) & 0xFFFFFFFF))


@triton.jit
def _is_slot(s, pad_slot_id, num_slots):
    return (s >= 0) & (s < num_slots) & (s != pad_slot_id)


@triton.jit
def _outside(s, pad_slot_id, num_slots):
    return ((s < 0) | (s >= num_slots)) & (s != pad_slot_id)


@triton.jit
def tile_raw(base, scale_base, offs_p, offs_n, s_p, rows, N: tl.constexpr, QUANT: tl.constexpr):
    """A state tile as stored (rows ``offs_p`` below ``rows``; zeros elsewhere) and, for an 8-bit
    cache, its rows' scales (else 1.0): loads only, so that the loads after it issue while it is
    in flight."""
    mask = (offs_p < rows)[:, None] & (offs_n < N)[None, :]
    tile = tl.load(base + offs_p[:, None] * s_p + offs_n[None, :], mask=mask, other=0.0)
    if QUANT > 0:
        scale = tl.load(scale_base + offs_p, mask=offs_p < rows, other=0.0)
    else:
        scale = 1.0
    return tile, scale


@triton.jit
def tile_values(tile, scale, QUANT: tl.constexpr):
    """A tile of :func:`tile_raw` in fp32, dequantised for an 8-bit cache."""
    if QUANT > 0:
        if QUANT % 2 == 1:
            values = int8_to_float(tile, QUANT)
        else:
            values = tile.to(tl.float32)
        return values * scale[:, None]
    return tile.to(tl.float32)


@triton.jit
def read_tile(base, scale_base, offs_p, offs_n, s_p, rows, N: tl.constexpr, QUANT: tl.constexpr):
    """A state tile in fp32 (rows ``offs_p`` below ``rows``; zeros elsewhere), dequantised for an 8-bit cache."""
    tile, scale = tile_raw(base, scale_base, offs_p, offs_n, s_p, rows, N, QUANT)
    return tile_values(tile, scale, QUANT)


@triton.jit
def write_tile(
    s, base, scale_base, offs_p, offs_n, s_p, rows, seed, element, N: tl.constexpr, STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Store an fp32 state tile (rows ``offs_p`` below ``rows``): rounded to the cache dtype, or an
    8-bit cache's values and fresh row scales."""
    mask = (offs_p < rows)[:, None] & (offs_n < N)[None, :]
    if QUANT > 0:
        q, scale = quantized_rows(s, QUANT)
        tl.store(scale_base + offs_p, scale, mask=offs_p < rows)
        tl.store(base + offs_p[:, None] * s_p + offs_n[None, :], q, mask=mask)
    else:
        stored = rounded_state(s, base, seed, element, offs_p, offs_n, N, STOCHASTIC, PHILOX_ROUNDS)
        tl.store(base + offs_p[:, None] * s_p + offs_n[None, :], stored, mask=mask)


@triton.jit
def token_raw(
    x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, x_p, z_p, B_n, C_n, offs_p, offs_n, live, has_z, P: tl.constexpr,
    N: tl.constexpr,
):  # fmt: skip
    """A token's inputs as stored, ``(dt, x, B, C, z)``, zeros where ``live`` is false (a token the
    sequence does not have) or z is absent: loads only. The pointers are the token's (its row,
    head and group)."""
    # masks as bounds (a scalar and'ed into a block mask is refused by Triton's interpreter)
    dt = tl.load(dt_ptr, mask=live, other=0.0)
    x = tl.load(x_ptr + offs_p * x_p, mask=offs_p < tl.where(live, P, 0), other=0.0)
    Bv = tl.load(B_ptr + offs_n * B_n, mask=offs_n < tl.where(live, N, 0), other=0.0)
    Cv = tl.load(C_ptr + offs_n * C_n, mask=offs_n < tl.where(live, N, 0), other=0.0)
    zv = tl.load(z_ptr + offs_p * z_p, mask=offs_p < tl.where(live & (has_z != 0), P, 0), other=0.0)
    return dt, x, Bv, Cv, zv


@triton.jit
def token_update(s, raw, a, bias, d_skip, has_z, softplus):
    """One token on an fp32 tile from its inputs as :func:`token_raw` loads them: the decay and
    inflow, and the output rows (skip and gate). Returns ``(the new tile, the outputs)``."""
    dt, x, Bv, Cv, zv = raw
    d = softplus_dt(dt.to(tl.float32) + bias, softplus)
    xf = x.to(tl.float32)
    s = tl.fma(s, tl.exp(a * d), (d * xf)[:, None] * Bv.to(tl.float32)[None, :])
    y = tl.sum(s * Cv.to(tl.float32)[None, :], axis=1) + d_skip * xf
    if has_z:
        zf = zv.to(tl.float32)
        y = y * zf * tl.sigmoid(zf)
    return s, y


@triton.jit
def apply_token(
    s, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, o_ptr, x_p, z_p, o_p, B_n, C_n, offs_p, offs_n, a, bias, d_skip,
    has_z, softplus, P: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    """One token on an fp32 tile, its inputs loaded here: the decay and inflow, the output (skip and
    gate) stored at ``o_ptr``; returns the new tile. The pointers are the token's (its row, head
    and group). The streaming path's token (without PREFETCH): fewer registers live."""
    mask_p = offs_p < P
    mask_n = offs_n < N
    d = softplus_dt(tl.load(dt_ptr).to(tl.float32) + bias, softplus)
    x = tl.load(x_ptr + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + offs_n * B_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
    s = tl.fma(s, tl.exp(a * d), (d * x)[:, None] * Bv[None, :])
    y = tl.sum(s * Cv[None, :], axis=1) + d_skip * x
    if has_z:
        zv = tl.load(z_ptr + offs_p * z_p, mask=mask_p, other=0.0).to(tl.float32)
        y = y * zv * tl.sigmoid(zv)
    tl.store(o_ptr + offs_p * o_p, y.to(o_ptr.dtype.element_ty), mask=mask_p)
    return s


@triton.jit
def head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias):
    """(A, D, dt_bias) of ``head`` in fp32; 0 for an absent D or dt_bias."""
    a = tl.load(A_ptr + head * a_h).to(tl.float32)
    d_skip = tl.load(D_ptr + head * d_h, mask=has_d, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head * bias_h, mask=has_dt_bias, other=0.0).to(tl.float32)
    return a, d_skip, bias


@triton.jit(do_not_specialize=["pad_slot_id", "num_slots", "tokens", "width", "has_d", "has_z", "has_dt_bias"])
def packed_kernel(
    state_ptr, scale_ptr, cursor_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr,
    slots_ptr, dst_ptr, accepted_ptr, cu_ptr, faults_ptr, seed_ptr,
    pad_slot_id, num_slots, tokens, width,
    s_slot, s_ver, s_head, s_p, sc_slot, sc_ver, sc_head, a_h, d_h, bias_h,
    x_r, x_h, x_p, dt_r, dt_h, B_r, B_g, B_n, C_r, C_g, C_n, z_r, z_h, z_p, o_r, o_h, o_p,
    sl_n, sl_t, ds_n, ds_t,
    has_d, has_z, has_dt_bias, softplus,
    T: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_CU: tl.constexpr, HAS_ACCEPTED: tl.constexpr, CURSOR: tl.constexpr,
    STOCHASTIC: tl.constexpr, PHILOX_ROUNDS: tl.constexpr, QUANT: tl.constexpr, PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """vLLM's packed call: one program per (block of P rows, head, sequence)."""
    if PDL:  # programmatic dependent launch: let the next kernel be scheduled, then wait for the previous one
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.program_id(2)
    group = head // HEADS_PER_GROUP
    recorder = (pid_p == 0) & (head == 0)
    # what depends on nothing loaded is loaded first, together: the offsets, the count and (PREFETCH)
    # every cell of the sequence's rows of both tables, the start cell picked from them once the
    # count is known instead of loaded then
    if HAS_CU:
        bos_id = tl.load(cu_ptr + n)
        eos_id = tl.load(cu_ptr + n + 1)
    if HAS_ACCEPTED and PREFETCH:
        count_id = tl.load(accepted_ptr + n)
    if PREFETCH:
        cells = ()
        for t in tl.static_range(T if HAS_ACCEPTED else 1):
            cells = cells + (tl.load(slots_ptr + n * sl_n + t * sl_t),)
        dsts = ()
        for t in tl.static_range(T):
            dsts = dsts + (tl.load(dst_ptr + n * ds_n + t * ds_t),)
        a, d_skip, bias = head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias)
    if HAS_CU:
        bos = bos_id.to(tl.int64)
        eos = eos_id.to(tl.int64)
    else:
        bos = n.to(tl.int64)
        eos = bos + 1
    length = eos - bos
    offsets_ok = (bos >= 0) & (length >= 0) & (length <= width) & (eos <= tokens)
    if recorder & (offsets_ok == 0):
        engine_fault(faults_ptr, E_CU_SEQLENS, n, 0, eos)
    length = tl.where(offsets_ok, length, 0)
    column = 0
    count_ok = offsets_ok
    if HAS_ACCEPTED:
        if not PREFETCH:
            count_id = tl.load(accepted_ptr + n)
        count = count_id.to(tl.int64)
        count_ok = offsets_ok & (count >= 0) & (count <= width)
        if recorder & offsets_ok & (count_ok == 0):
            engine_fault(faults_ptr, E_NUM_ACCEPTED, n, 0, count)
        column = tl.where(count_ok, tl.maximum(count - 1, 0), 0)
    if PREFETCH:
        start = cells[0]
        if HAS_ACCEPTED:
            for t in tl.static_range(1, T):
                start = tl.where(column == t, cells[t], start)
        start = start.to(tl.int64)
    else:
        start = tl.load(slots_ptr + n * sl_n + column * sl_t).to(tl.int64)
    used = count_ok & (length > 0)
    if recorder & used & _outside(start, pad_slot_id, num_slots):
        engine_fault(faults_ptr, E_SLOTS, n, column, start)
    real = used & _is_slot(start, pad_slot_id, num_slots)
    safe = tl.where(real, start, 0)
    version = 0
    if CURSOR:
        version = tl.load(cursor_ptr + safe).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    tile, scale = tile_raw(
        state_ptr + safe * s_slot + version * s_ver + head * s_head,
        scale_ptr + safe * sc_slot + version * sc_ver + head * sc_head,
        offs_p, offs_n, s_p, tl.where(real, P, 0), N, QUANT,
    )  # fmt: skip
    if PREFETCH:  # every token's inputs in flight with the state, before the first store
        inputs = ()
        for t in tl.static_range(T):
            r = bos + t
            inputs = inputs + (
                token_raw(
                    x_ptr + r * x_r + head * x_h, dt_ptr + r * dt_r + head * dt_h, B_ptr + r * B_r + group * B_g,
                    C_ptr + r * C_r + group * C_g, z_ptr + r * z_r + head * z_h, x_p, z_p, B_n, C_n, offs_p,
                    offs_n, t < length, has_z, P, N,
                ),
            )  # fmt: skip
    s = tile_values(tile, scale, QUANT)
    if not PREFETCH:
        a, d_skip, bias = head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias)
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    for t in tl.static_range(T):
        if t < length:
            r = bos + t
            if PREFETCH:
                s, y = token_update(s, inputs[t], a, bias, d_skip, has_z, softplus)
                tl.store(out_ptr + r * o_r + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty), mask=offs_p < P)
                dst = dsts[t].to(tl.int64)
            else:  # streaming: the token's loads here, its destination after its output
                s = apply_token(
                    s, x_ptr + r * x_r + head * x_h, dt_ptr + r * dt_r + head * dt_h, B_ptr + r * B_r + group * B_g,
                    C_ptr + r * C_r + group * C_g, z_ptr + r * z_r + head * z_h, out_ptr + r * o_r + head * o_h,
                    x_p, z_p, o_p, B_n, C_n, offs_p, offs_n, a, bias, d_skip, has_z, softplus, P, N,
                )  # fmt: skip
                dst = tl.load(dst_ptr + n * ds_n + t * ds_t).to(tl.int64)
            if recorder & real & _outside(dst, pad_slot_id, num_slots):
                engine_fault(faults_ptr, E_DST_SLOTS, n, t, dst)
            keep = real & _is_slot(dst, pad_slot_id, num_slots)
            target = tl.where(keep, dst, 0)
            dst_version = 0
            if CURSOR:
                dst_version = tl.load(cursor_ptr + target).to(tl.int64)
            write_tile(
                s, state_ptr + target * s_slot + dst_version * s_ver + head * s_head,
                scale_ptr + target * sc_slot + dst_version * sc_ver + head * sc_head, offs_p, offs_n, s_p,
                tl.where(keep, P, 0), seed + t, (target * 65599 + head * P * N).to(tl.uint32), N, STOCHASTIC,
                PHILOX_ROUNDS, QUANT,
            )  # fmt: skip


@triton.jit(do_not_specialize=["pad_slot_id", "num_slots", "buffer_rows", "has_d", "has_z", "has_dt_bias"])
def verify_kernel(
    state_ptr, scale_ptr, cursor_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr,
    slots_ptr, buffer_ptr, rows_ptr, parents_ptr, faults_ptr, seed_ptr,
    pad_slot_id, num_slots, buffer_rows,
    s_slot, s_ver, s_head, s_p, sc_slot, sc_ver, sc_head, a_h, d_h, bias_h,
    x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p,
    o_b, o_t, o_h, o_p, bf_row, bf_step, bf_head, bf_p, pa_b, pa_t,
    has_d, has_z, has_dt_bias, softplus,
    T: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_BUFFER: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_PARENTS: tl.constexpr,
    UPDATE: tl.constexpr, CURSOR: tl.constexpr, STOCHASTIC: tl.constexpr, PHILOX_ROUNDS: tl.constexpr,
    QUANT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """SGLang's verify call: one program per (block of P rows, head, row)."""
    if PDL:  # programmatic dependent launch: let the next kernel be scheduled, then wait for the previous one
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.program_id(2)
    group = head // HEADS_PER_GROUP
    recorder = (pid_p == 0) & (head == 0)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    # what depends on nothing loaded is loaded first, together: the row's slot and buffer row, and
    # (PREFETCH) its parents and every token's inputs
    slot_id = tl.load(slots_ptr + i)
    if HAS_BUFFER and HAS_ROWS and PREFETCH:
        row_id = tl.load(rows_ptr + i)
    if PREFETCH:
        parents = ()
        if HAS_PARENTS:
            for t in tl.static_range(T):
                parents = parents + (tl.load(parents_ptr + i * pa_b + t * pa_t),)
        inputs = ()
        for t in tl.static_range(T):
            inputs = inputs + (
                token_raw(
                    x_ptr + i * x_b + t * x_t + head * x_h, dt_ptr + i * dt_b + t * dt_t + head * dt_h,
                    B_ptr + i * B_b + t * B_t + group * B_g, C_ptr + i * C_b + t * C_t + group * C_g,
                    z_ptr + i * z_b + t * z_t + head * z_h, x_p, z_p, B_n, C_n, offs_p, offs_n, i >= 0, has_z, P, N,
                ),
            )  # fmt: skip
        a, d_skip, bias = head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias)
    slot = slot_id.to(tl.int64)
    if recorder & _outside(slot, pad_slot_id, num_slots):
        engine_fault(faults_ptr, E_ROW_SLOTS, i, 0, slot)
    real = _is_slot(slot, pad_slot_id, num_slots)
    safe = tl.where(real, slot, 0)
    version = 0
    if CURSOR:
        version = tl.load(cursor_ptr + safe).to(tl.int64)
    stored = real & (HAS_BUFFER != 0)
    row = safe
    if HAS_BUFFER:
        if HAS_ROWS:
            if not PREFETCH:
                row_id = tl.load(rows_ptr + i)
            row = row_id.to(tl.int64)
        stored = real & (row >= 0) & (row < buffer_rows)
        if recorder & real & (stored == 0):
            engine_fault(faults_ptr, E_BUFFER_ROWS, i, 0, row)
        row = tl.where(stored, row, 0)
    base = state_ptr + safe * s_slot + version * s_ver + head * s_head
    scale_base = scale_ptr + safe * sc_slot + version * sc_ver + head * sc_head
    s = read_tile(base, scale_base, offs_p, offs_n, s_p, tl.where(real, P, 0), N, QUANT)
    if not PREFETCH:
        a, d_skip, bias = head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias)
    held = tl.where(stored, P, 0)
    buffer_base = buffer_ptr + row * bf_row + head * bf_head
    kept = ()  # (PREFETCH) the states after tokens 0 to T - 3 as the buffer holds them, for the parents
    for t in tl.static_range(T):
        if HAS_PARENTS and t > 0:
            if PREFETCH:
                parent = parents[t].to(tl.int64)
            else:
                parent = tl.load(parents_ptr + i * pa_b + t * pa_t).to(tl.int64)
            if recorder & stored & (parent >= t):
                engine_fault(faults_ptr, E_PARENTS, i, t, parent)
            if PREFETCH:  # the parent's state from registers, rounded as the buffer holds it
                for j in tl.static_range(t - 1):
                    s = tl.where(stored & (parent == j), kept[j], s)
            else:
                if stored & (parent >= 0) & (parent < t - 1):  # the parent's state, as the buffer holds it
                    tl.debug_barrier()
                    s = read_tile(buffer_base + parent * bf_step, scale_base, offs_p, offs_n, bf_p, held, N, 0)
        if PREFETCH:
            s, y = token_update(s, inputs[t], a, bias, d_skip, has_z, softplus)
            tl.store(out_ptr + i * o_b + t * o_t + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty),
                     mask=offs_p < P)  # fmt: skip
        else:
            s = apply_token(
                s, x_ptr + i * x_b + t * x_t + head * x_h, dt_ptr + i * dt_b + t * dt_t + head * dt_h,
                B_ptr + i * B_b + t * B_t + group * B_g, C_ptr + i * C_b + t * C_t + group * C_g,
                z_ptr + i * z_b + t * z_t + head * z_h, out_ptr + i * o_b + t * o_t + head * o_h, x_p, z_p, o_p, B_n,
                C_n, offs_p, offs_n, a, bias, d_skip, has_z, softplus, P, N,
            )  # fmt: skip
        if HAS_BUFFER:
            write_tile(s, buffer_base + t * bf_step, scale_base, offs_p, offs_n, bf_p, held, 0, 0, N, False, 1, 0)
        if PREFETCH and HAS_PARENTS and t < T - 2:
            kept = kept + (s.to(buffer_ptr.dtype.element_ty).to(tl.float32),)
    if UPDATE:
        seed = 0
        if STOCHASTIC:
            seed = tl.load(seed_ptr)
        write_tile(
            s, base, scale_base, offs_p, offs_n, s_p, tl.where(real, P, 0), seed,
            (safe * 65599 + head * P * N).to(tl.uint32), N, STOCHASTIC, PHILOX_ROUNDS, QUANT,
        )  # fmt: skip
