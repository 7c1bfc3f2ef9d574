"""Pieces of the Triton SSU kernel (:mod:`ssu_backend_triton.kernel`): per-token and per-row input
loads, the mask and load of a state tile, and the update of a tile's rows through the step's tokens.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_slots(slots_ptr, dst_ptr, faults_ptr, row, recorder, pad_slot_id, num_slots, HAS_DST: tl.constexpr):
    """The slot row ``row`` reads and the one it writes (``dst_ptr``'s with ``HAS_DST``), and
    whether each names a slot of the cache: a pad row, or an id outside the cache, reads a zero
    state and writes none; one whose destination is either writes none. The ``recorder`` program
    of the row records ids outside the cache in the fault record (:mod:`ssu.state.faults`).
    Returns (slot, valid, dst, dst_valid)."""
    slot = tl.load(slots_ptr + row).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots) & (slot != pad_slot_id)
    if HAS_DST:
        dst = tl.load(dst_ptr + row).to(tl.int64)
        dst_valid = valid & (dst >= 0) & (dst < num_slots) & (dst != pad_slot_id)  # a pad row writes nothing
    else:
        dst = slot
        dst_valid = valid
    if recorder:
        if ((slot < 0) | (slot >= num_slots)) & (slot != pad_slot_id):
            tl.atomic_min(faults_ptr, (row.to(tl.int64) << 34) | (slot & 0xFFFFFFFF))
        if HAS_DST:
            if ((dst < 0) | (dst >= num_slots)) & (dst != pad_slot_id):
                tl.atomic_min(faults_ptr, (row.to(tl.int64) << 34) | (1 << 32) | (dst & 0xFFFFFFFF))
    return slot, valid, dst, dst_valid


@triton.jit
def softplus_dt(d, softplus):
    """dt after bias and, where ``softplus`` is set, softplus (log(1 + e^d), d itself above 20), in fp32."""
    return tl.where(softplus & (d <= 20.0), tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)


@triton.jit
def gated(y, zv, has_z):
    """Outputs ``y`` times the gate ``z * sigmoid(z)`` of their rows' ``zv`` where z is given
    (``has_z``), else ``y`` as it is."""
    if has_z:
        y = y * zv * tl.sigmoid(zv)
    return y


@triton.jit
def rounded_state(
    s, dtype_ptr, seed, element, offs_p, offs_n, N: tl.constexpr, STOCHASTIC: tl.constexpr, PHILOX_ROUNDS: tl.constexpr
):
    """A state tile in fp32 rounded to the cache dtype of ``dtype_ptr``: to nearest, or with
    ``STOCHASTIC`` (an fp16 cache) by adding 13 random low bits (Philox, keyed by ``seed`` and each
    value's ``element`` index) and truncating."""
    if STOCHASTIC:
        noise = (
            tl.randint(seed, element + (offs_p[:, None] * N + offs_n[None, :]).to(tl.uint32), PHILOX_ROUNDS) & 0x1FFF
        )
        bits = s.to(tl.uint32, bitcast=True) + noise
        return bits.to(tl.float32, bitcast=True).to(tl.float16, fp_downcast_rounding="rtz")
    else:
        return s.to(dtype_ptr.dtype.element_ty)


@triton.jit
def quantized_rows(s, QUANT: tl.constexpr):
    """``(q, scale)`` of an fp32 state tile quantised per row (``ssu.state.quant``): ``scale`` the row's
    largest magnitude over QMAX (127 for int8, 448 for fp8 e4m3), ``q`` the row times QMAX over
    that magnitude (one approximate division a row, not an IEEE division a value), rounded to
    nearest, ties to even, in the cache dtype (``QUANT``: 1 int8, 2 fp8; 3 and 4 the same in
    Triton's interpreter).

    No value passes through the GPU's type-conversion units, which run at an eighth of its fp32
    rate and would bound an 8-bit step: an int8 value is rounded by adding 1.5 * 2^23 (the fp32 sum
    rounds to an integer, ties to even) and is the low byte of the sum's bits. fp8 takes the
    hardware's packed cast (round to nearest even, saturating at 448); in the interpreter, whose
    e4m3 cast can drop a carry, each value is first rounded to e4m3's grid in fp32 (adding and
    subtracting 1.5 times 2^23 steps of the value's binade), so that the cast is exact."""
    if QUANT % 2 == 1:
        qmax = 127.0
    else:
        qmax = 448.0
    absmax = tl.max(tl.abs(s), axis=1)
    scale = absmax * (1.0 / qmax)
    inv = tl.where(absmax > 0, tl.fdiv(qmax, absmax), 0.0)  # within 2 ulp: v stays below QMAX + 1/2
    v = s * inv[:, None]
    if QUANT % 2 == 1:
        q = (v + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
    else:
        if QUANT == 4:
            binade = (v.to(tl.uint32, bitcast=True) >> 23) & 0xFF
            binade = tl.maximum(binade, 127 - 6)  # below 2^-6, e4m3's subnormal spacing 2^-9
            magic = (((binade + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^23 * 2^(e-3)
            v = (v + magic) - magic
        q = v.to(tl.float8e4nv)
    return q, scale


@triton.jit
def int8_to_float(q, QUANT: tl.constexpr):
    """int8 values as fp32 without a conversion instruction: the bits of 1.5 * 2^23 + 128 + q, less
    1.5 * 2^23 + 128. Compiled (``QUANT`` 1), four values' sign bits are flipped in one logical
    operation and each biased byte is placed in the constant's low byte by one byte permute
    (inline PTX, which the interpreter cannot run: there, ``QUANT`` 3, by integer arithmetic). The
    PTX takes four values a thread, so a tile of fewer than four values a thread (a small P and N)
    takes the integer arithmetic compiled too."""
    if QUANT == 1 and q.numel >= 4 * tl.extra.cuda.num_threads():
        bits = tl.inline_asm_elementwise(
            """{
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B400000, 0x7650;
            prmt.b32 $1, t, 0x4B400000, 0x7651;
            prmt.b32 $2, t, 0x4B400000, 0x7652;
            prmt.b32 $3, t, 0x4B400000, 0x7653;
            }""",
            "=r,=r,=r,=r,r",
            [q],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        )
    else:
        bits = (q.to(tl.int32) + 128) | 0x4B400000
    return bits.to(tl.float32, bitcast=True) - 12583040.0


@triton.jit
def token_inputs(
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
        d = softplus_dt(d, softplus)
    else:
        if softplus:
            d = tl.where(d > 20.0, d, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))))
    x, zv = row_inputs(x_ptr, z_ptr, offs_p, row, head, t, x_b, x_t, x_h, x_p, z_b, z_t, z_h, z_p, has_z, P, BRANCHLESS)
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
def row_inputs(
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
def tile_mask(offs_p, offs_n, state_rows, N: tl.constexpr, EVEN_N: tl.constexpr):
    """Which values of a state tile exist: none of a pad row's (``state_rows`` 0), so it reads
    zeros and writes nothing."""
    if EVEN_N:  # no mask along N: the mask stays constant along rows and accesses stay vectorised
        return (offs_p < state_rows)[:, None]
    else:
        return (offs_p < state_rows)[:, None] & (offs_n < N)[None, :]


@triton.jit
def load_tile(base, cur, s_ver, s_p, offs_p, offs_n, state_rows, N: tl.constexpr, EVEN_N: tl.constexpr):
    """The state tile of rows ``offs_p`` as stored (no conversion: a bf16 tile waits in half the
    registers)."""
    return tl.load(
        base + cur * s_ver + offs_p[:, None] * s_p + offs_n[None, :],
        mask=tile_mask(offs_p, offs_n, state_rows, N, EVEN_N),
        other=0.0,
    )


@triton.jit
def load_state(
    base,
    scale_base,
    cur,
    s_ver,
    sc_ver,
    s_p,
    offs_p,
    offs_n,
    state_rows,
    N: tl.constexpr,
    EVEN_N: tl.constexpr,
    QUANT: tl.constexpr,
):
    """``(tile, row_scales)`` of rows ``offs_p``: the tile as stored and 1.0, or for an 8-bit cache
    (``QUANT``) its values in fp32 and each row's scale, which the update folds into the state's
    decay (one multiply a value fewer)."""
    tile = load_tile(base, cur, s_ver, s_p, offs_p, offs_n, state_rows, N, EVEN_N)
    if QUANT > 0:
        scale = tl.load(scale_base + cur * sc_ver + offs_p, mask=offs_p < state_rows, other=0.0)
        if QUANT % 2 == 1:
            tile = int8_to_float(tile, QUANT)
        else:
            tile = tile.to(tl.float32)
    else:
        scale = 1.0
    return tile, scale


@triton.jit
def update_rows(
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
    wscale_base,
    ws_ver,
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
    QUANT: tl.constexpr,
):
    """Update rows ``offs_p`` of one head of one sequence through the step's T tokens, from their
    loaded state tile ``s_raw`` (times ``s_scale``, each row's scale of an 8-bit cache) and token
    0's inputs (B and C vectors, or tiles with ``B_IN_TILE``), storing to ``wbase``
    (``write_rows`` 0: nowhere; with ``QUANT``, an 8-bit cache, each row quantised with a fresh
    scale stored to ``wscale_base``). Each later token's inputs are loaded before the earlier
    token's stores, so their latency overlaps (the compiler may not move a load past a store to
    memory it cannot prove distinct)."""
    mask_p = offs_p < P
    state_mask = tile_mask(offs_p, offs_n, write_rows, N, EVEN_N)
    tile = offs_p[:, None] * s_p + offs_n[None, :]
    s = s_raw.to(tl.float32)
    d, x, zv, Bv, Cv = d0, x0, z0, B0, C0
    for t in tl.static_range(T):
        # an explicit fma: the compiler could otherwise contract either product, so the
        # state's last bit would depend on the launch shape
        if B_IN_TILE:
            inflow = (d * x)[:, None] * Bv
        else:
            inflow = (d * x)[:, None] * Bv[None, :]
        if QUANT > 0 and t == 0:  # the rows' scales times the decay: dequantised in the same fma
            s = tl.fma(s, (s_scale * tl.exp(a * d))[:, None], inflow)
        else:
            s = tl.fma(s, tl.exp(a * d), inflow)
        if B_IN_TILE:
            y = tl.sum(s * Cv, axis=1)
        else:
            y = tl.sum(s * Cv[None, :], axis=1)
        if has_d:
            y += d_skip * x
        y = gated(y, zv, has_z)
        if t + 1 < T:
            d, x, zv, Bv, Cv = token_inputs(
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
            if SPECULATIVE and CURSOR:
                dest = (cur + 1 + t) % K  # the versions of an allocated state
            elif SPECULATIVE:
                dest = t  # the drafts beside an adopted cache
            else:
                dest = 0
            if QUANT > 0:
                q, scale = quantized_rows(s, QUANT)
                tl.store(wscale_base + dest * ws_ver + offs_p, scale, mask=offs_p < write_rows)
                stored = q
            else:
                stored = rounded_state(s, write_ptr, seed + t, element, offs_p, offs_n, N, STOCHASTIC, PHILOX_ROUNDS)
            tl.store(wbase + dest * w_ver + tile, stored, mask=state_mask)


# The strides stay specialised: their divisibility by 16 (with the views' 16-byte aligned data
# pointers) is what lets Triton prove that state tiles are 16-byte aligned and move them in 16-byte
# vectors. Left out of the specialisation, a bf16 state moved in 2-byte accesses at 128 registers a
# thread (65 % of the H200's bandwidth instead of 90 %).
