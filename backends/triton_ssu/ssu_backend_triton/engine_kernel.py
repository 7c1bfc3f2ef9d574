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
def read_tile(base, scale_base, offs_p, offs_n, s_p, rows, N: tl.constexpr, QUANT: tl.constexpr):
    """A state tile in fp32 (rows ``offs_p`` below ``rows``; zeros elsewhere), dequantised for an 8-bit cache."""
    mask = (offs_p < rows)[:, None] & (offs_n < N)[None, :]
    tile = tl.load(base + offs_p[:, None] * s_p + offs_n[None, :], mask=mask, other=0.0)
    if QUANT > 0:
        scale = tl.load(scale_base + offs_p, mask=offs_p < rows, other=0.0)
        if QUANT % 2 == 1:
            values = int8_to_float(tile, QUANT)
        else:
            values = tile.to(tl.float32)
        return values * scale[:, None]
    return tile.to(tl.float32)


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
def apply_token(
    s, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, o_ptr, x_p, z_p, o_p, B_n, C_n, offs_p, offs_n, a, bias, d_skip,
    has_z, softplus, P: tl.constexpr, N: tl.constexpr,
):  # fmt: skip
    """One token on an fp32 tile: the decay and inflow, the output (skip and gate) stored at
    ``o_ptr``; returns the new tile. The pointers are the token's (its row, head and group)."""
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
    STOCHASTIC: tl.constexpr, PHILOX_ROUNDS: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """vLLM's packed call: one program per (block of P rows, head, sequence)."""
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.program_id(2)
    group = head // HEADS_PER_GROUP
    recorder = (pid_p == 0) & (head == 0)
    if HAS_CU:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
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
        count = tl.load(accepted_ptr + n).to(tl.int64)
        count_ok = offsets_ok & (count >= 0) & (count <= width)
        if recorder & offsets_ok & (count_ok == 0):
            engine_fault(faults_ptr, E_NUM_ACCEPTED, n, 0, count)
        column = tl.where(count_ok, tl.maximum(count - 1, 0), 0)
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
    s = read_tile(
        state_ptr + safe * s_slot + version * s_ver + head * s_head,
        scale_ptr + safe * sc_slot + version * sc_ver + head * sc_head,
        offs_p, offs_n, s_p, tl.where(real, P, 0), N, QUANT,
    )  # fmt: skip
    a, d_skip, bias = head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias)
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    for t in tl.static_range(T):
        if t < length:
            r = bos + t
            s = apply_token(
                s, x_ptr + r * x_r + head * x_h, dt_ptr + r * dt_r + head * dt_h,
                B_ptr + r * B_r + group * B_g, C_ptr + r * C_r + group * C_g, z_ptr + r * z_r + head * z_h,
                out_ptr + r * o_r + head * o_h, x_p, z_p, o_p, B_n, C_n, offs_p, offs_n, a, bias, d_skip,
                has_z, softplus, P, N,
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
    QUANT: tl.constexpr,
):  # fmt: skip
    """SGLang's verify call: one program per (block of P rows, head, row)."""
    pid_p = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.program_id(2)
    group = head // HEADS_PER_GROUP
    recorder = (pid_p == 0) & (head == 0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
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
            row = tl.load(rows_ptr + i).to(tl.int64)
        stored = real & (row >= 0) & (row < buffer_rows)
        if recorder & real & (stored == 0):
            engine_fault(faults_ptr, E_BUFFER_ROWS, i, 0, row)
        row = tl.where(stored, row, 0)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    base = state_ptr + safe * s_slot + version * s_ver + head * s_head
    scale_base = scale_ptr + safe * sc_slot + version * sc_ver + head * sc_head
    s = read_tile(base, scale_base, offs_p, offs_n, s_p, tl.where(real, P, 0), N, QUANT)
    a, d_skip, bias = head_terms(A_ptr, D_ptr, dt_bias_ptr, head, a_h, d_h, bias_h, has_d, has_dt_bias)
    held = tl.where(stored, P, 0)
    buffer_base = buffer_ptr + row * bf_row + head * bf_head
    for t in tl.static_range(T):
        if HAS_PARENTS and t > 0:
            parent = tl.load(parents_ptr + i * pa_b + t * pa_t).to(tl.int64)
            if recorder & stored & (parent >= t):
                engine_fault(faults_ptr, E_PARENTS, i, t, parent)
            if stored & (parent >= 0) & (parent < t - 1):  # the parent's state, as the buffer holds it
                tl.debug_barrier()
                s = read_tile(buffer_base + parent * bf_step, scale_base, offs_p, offs_n, bf_p, held, N, 0)
        s = apply_token(
            s, x_ptr + i * x_b + t * x_t + head * x_h, dt_ptr + i * dt_b + t * dt_t + head * dt_h,
            B_ptr + i * B_b + t * B_t + group * B_g, C_ptr + i * C_b + t * C_t + group * C_g,
            z_ptr + i * z_b + t * z_t + head * z_h, out_ptr + i * o_b + t * o_t + head * o_h, x_p, z_p, o_p, B_n,
            C_n, offs_p, offs_n, a, bias, d_skip, has_z, softplus, P, N,
        )  # fmt: skip
        if HAS_BUFFER:
            write_tile(s, buffer_base + t * bf_step, scale_base, offs_p, offs_n, bf_p, held, 0, 0, N, False, 1, 0)
    if UPDATE:
        seed = 0
        if STOCHASTIC:
            seed = tl.load(seed_ptr)
        write_tile(
            s, base, scale_base, offs_p, offs_n, s_p, tl.where(real, P, 0), seed,
            (safe * 65599 + head * P * N).to(tl.uint32), N, STOCHASTIC, PHILOX_ROUNDS, QUANT,
        )  # fmt: skip
