"""The per-tile work of the replay step kernel (:mod:`~ssu_backend_triton.replay.kernel`): a
checkpoint tile read and stored (8-bit ones with their row scales), the outputs of a token or of
several, and the three ways a program takes a row's tile through a step: the ring's tokens folded
where the row flushes and the outputs from B . C products (:func:`ring_tiles`), the write-every-step
update of a one-token plan of window 0 (:func:`write_through_tiles`), and a speculative step's tokens
applied one by one (:func:`stepwise_tiles`). The kernel module's docstring states the rules."""

from __future__ import annotations

import triton
import triton.language as tl

from ..tiles import gated, int8_to_float, quantized_rows, rounded_state, softplus_dt


@triton.jit
def ring_tiles(
    read_base,
    write_base,
    rscale_base,
    wscale_base,
    xr_base,
    x_base,
    Br_base,
    B_row,
    C_row,
    z_base,
    o_base,
    ck_p,
    x_t,
    x_p,
    B_t,
    B_n,
    C_t,
    C_n,
    z_t,
    z_p,
    o_t,
    o_p,
    pid_p,
    state_rows,
    append,
    start,
    k,
    fold,
    ring_row,
    in_ring,
    in_new,
    tok,
    offs_m,
    offs_n,
    mask_n,
    weights,
    decays,
    d_m,
    a_m,
    d_skip,
    has_d,
    has_z,
    seed,
    element,
    T: tl.constexpr,
    TP: tl.constexpr,
    RING: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
    FOLD: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    QUANT: tl.constexpr,
):
    """The program's tiles: each tile's outputs from the checkpoint tile and the ring rows (the
    new tokens' x appended to the ring); with ``FOLD`` the first ``fold`` positions applied to
    the tile one by one and the tile stored, rounded (or quantised with fresh row scales), at
    ``write_base``. For one token every load of a tile comes before its first store (the compiler
    keeps memory operations in order where it cannot prove them apart), so that C, z and a flush's
    fold rows do not wait behind the ring append's store; for several tokens that order measured
    slower (fp32 at T = 4, batch 32: 118.0 against 109.5 us on an H100, registers held across the
    fold), so the append and the outputs are stored as soon as they are known."""
    rows = tl.arange(0, BLOCK_P)
    offs_t = tl.arange(0, TP)
    w0 = tl.sum(tl.where(offs_t[None, :] == 0, weights, 0.0), axis=1)
    decay0 = tl.sum(tl.where(offs_t == 0, decays, 0.0), axis=0)
    for i in tl.range(0, TILES, num_stages=STAGES):
        offs_p = (pid_p * TILES + i) * BLOCK_P + rows
        mask_p = offs_p < P
        tile = offs_p[:, None] * ck_p + offs_n[None, :]
        read_p = offs_p < state_rows
        s0 = load_checkpoint(read_base, rscale_base, tile, offs_p, read_p[:, None] & mask_n[None, :], read_p, QUANT)
        ring_mask = mask_p[:, None] & in_ring[None, :]
        new_mask = mask_p[:, None] & in_new[None, :]
        X_ring = tl.load(xr_base + ring_row[None, :] * P + offs_p[:, None], mask=ring_mask, other=0.0)
        X_new = tl.load(x_base + tok[None, :] * x_t + offs_p[:, None] * x_p, mask=new_mask, other=0.0)
        if append and T > 1:
            tl.store(xr_base + ring_row[None, :] * P + offs_p[:, None], X_new, mask=new_mask)
        X = X_ring.to(tl.float32) + X_new.to(tl.float32)  # (BLOCK_P, M): rows of the tile, positions
        if T == 1:  # every load of the tile before its first store
            C_tok = tl.load(C_row + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
            zv = tl.load(z_base + offs_p * z_p, mask=mask_p & has_z, other=0.0).to(tl.float32)
            y = decay0 * tl.sum(s0 * C_tok[None, :], axis=1) + tl.sum(X * w0[None, :], axis=1)
            if has_d:
                y += d_skip * tl.sum(tl.where(offs_m[None, :] == k, X, 0.0), axis=1)
            y = gated(y, zv, has_z)
        else:  # every token's output at once, (BLOCK_P, TP): the checkpoint's part per token, the ring's in one product
            Yc = tl.zeros((BLOCK_P, TP), dtype=tl.float32)
            for t in tl.static_range(T):
                C_tok = tl.load(C_row + t * C_t + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
                yc = tl.sum(s0 * C_tok[None, :], axis=1)
                Yc = tl.where(offs_t[None, :] == t, yc[:, None], Yc)
            Y = Yc * decays[None, :] + tl.sum(X[:, :, None] * weights[None, :, :], axis=1)
            out_mask = mask_p[:, None] & (offs_t[None, :] < T)
            if has_d:
                Xt = tl.load(x_base + offs_t[None, :] * x_t + offs_p[:, None] * x_p, mask=out_mask, other=0.0)
                Y += d_skip * Xt.to(tl.float32)
            store_token_outputs(Y, z_base, o_base, offs_t, offs_p, z_t, z_p, o_t, o_p, out_mask, has_z)
        if FOLD:
            s = s0
            for j in range(0, fold):
                in_r = j < k
                r = (start + j) % RING
                x_j = tl.load(
                    tl.where(in_r, xr_base + r * P, x_base + (j - k) * x_t) + offs_p * tl.where(in_r, 1, x_p),
                    mask=mask_p,
                    other=0.0,
                ).to(tl.float32)
                B_j = tl.load(
                    tl.where(in_r, Br_base + r * N, B_row + (j - k) * B_t) + offs_n * tl.where(in_r, 1, B_n),
                    mask=mask_n,
                    other=0.0,
                ).to(tl.float32)
                d_j = tl.sum(tl.where(offs_m == j, d_m, 0.0), axis=0)
                a_j = tl.sum(tl.where(offs_m == j, a_m, 0.0), axis=0)
                s = tl.fma(s, tl.exp(a_j), (d_j * x_j)[:, None] * B_j[None, :])
            store_checkpoint(
                s, write_base, wscale_base, tile, offs_p, offs_n, mask_p[:, None] & mask_n[None, :], mask_p, seed,
                element, N, STOCHASTIC, PHILOX_ROUNDS, QUANT,
            )  # fmt: skip
        if T == 1:
            tl.store(o_base + offs_p * o_p, y.to(o_base.dtype.element_ty), mask=mask_p)
            if append:
                tl.store(xr_base + ring_row[None, :] * P + offs_p[:, None], X_new, mask=new_mask)


@triton.jit
def load_checkpoint(base, scale_base, tile, offs_p, mask, row_ok, QUANT: tl.constexpr):
    """A checkpoint tile in fp32: as stored, or for an 8-bit checkpoint (``QUANT``) its values
    times each row's scale (a row not read is zero)."""
    raw = tl.load(base + tile, mask=mask, other=0.0)
    if QUANT > 0:
        scale = tl.load(scale_base + offs_p, mask=row_ok, other=0.0)
        if QUANT % 2 == 1:
            values = int8_to_float(raw, QUANT)
        else:
            values = raw.to(tl.float32)
        return values * scale[:, None]
    return raw.to(tl.float32)


@triton.jit
def store_checkpoint(
    s, base, scale_base, tile, offs_p, offs_n, mask, row_ok, seed, element, N: tl.constexpr,
    STOCHASTIC: tl.constexpr, PHILOX_ROUNDS: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Store an fp32 checkpoint tile: rounded to the cache dtype (:func:`~.tiles.rounded_state`),
    or for an 8-bit checkpoint quantised per row with a fresh scale (``ssu.state.quant``)."""
    if QUANT > 0:
        q, scale = quantized_rows(s, QUANT)
        tl.store(scale_base + offs_p, scale, mask=row_ok)
        tl.store(base + tile, q, mask=mask)
    else:
        stored = rounded_state(s, base, seed, element, offs_p, offs_n, N, STOCHASTIC, PHILOX_ROUNDS)
        tl.store(base + tile, stored, mask=mask)


@triton.jit
def store_token_output(y, z_base, o_base, offs_p, z_p, o_p, mask_p, has_z):
    """Store a tile's output of one token, (rows,) in fp32, gated by z where given."""
    if has_z:
        zv = tl.load(z_base + offs_p * z_p, mask=mask_p, other=0.0).to(tl.float32)
        y = gated(y, zv, has_z)
    tl.store(o_base + offs_p * o_p, y.to(o_base.dtype.element_ty), mask=mask_p)


@triton.jit
def store_token_outputs(Y, z_base, o_base, offs_t, offs_p, z_t, z_p, o_t, o_p, mask, has_z):
    """Store a tile's outputs of every token, (rows, tokens) in fp32, gated by z where given."""
    if has_z:
        Z = tl.load(z_base + offs_t[None, :] * z_t + offs_p[:, None] * z_p, mask=mask, other=0.0).to(tl.float32)
        Y = gated(Y, Z, has_z)
    tl.store(o_base + offs_t[None, :] * o_t + offs_p[:, None] * o_p, Y.to(o_base.dtype.element_ty), mask=mask)


@triton.jit
def token_scalars(
    dt_at,
    A_at,
    D_at,
    bias_at,
    B_row,
    B_n,
    C_row,
    C_n,
    has_d,
    has_dt_bias,
    softplus,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One token's per-head inputs for the write-every-step update, every load masked rather than
    branched on (so that they issue together): (d, exp(A d), D, B, C) in fp32."""
    bias = tl.load(bias_at, mask=has_dt_bias, other=0.0).to(tl.float32)
    d = softplus_dt(tl.load(dt_at).to(tl.float32) + bias, softplus)
    decay = tl.exp(tl.load(A_at).to(tl.float32) * d)
    d_skip = tl.load(D_at, mask=has_d, other=0.0).to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    Bv = tl.load(B_row + offs_n * B_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_row + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32)
    return d, decay, d_skip, Bv, Cv


@triton.jit
def write_through_tiles(
    read_base,
    write_base,
    ck_p,
    rscale_base,
    wscale_base,
    x_base,
    x_p,
    z_base,
    z_p,
    o_base,
    o_p,
    d,
    decay,
    d_skip,
    Bv,
    Cv,
    xr_base,
    Br_base,
    d_base,
    a_base,
    start,
    k,
    seed_ptr,
    element,
    pid_p,
    read_rows,
    write_rows,
    has_d,
    has_z,
    RING: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    QUANT: tl.constexpr,
):
    """A window-0 step of one token (inputs from :func:`token_scalars`), written back at
    ``write_base``: the ring's ``k`` tokens from row ``start`` folded into the checkpoint one by one
    (none once a slot has stepped here: only a slot that stepped in a bucket with a window has
    any), then the write-every-step update ``s = exp(A d) s + d x B^T``, ``y = s . C (+ D x, z
    gate)``. Reads checkpoint rows below ``read_rows`` (P for a row with a slot; a pad row's state
    is zero) and writes those below ``write_rows`` (P where the row flushes: every row with a
    slot); every row's outputs are stored. The first tile's loads are not held behind the cursors."""
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    seed = 0
    if STOCHASTIC:
        seed = tl.load(seed_ptr)
    rows = tl.arange(0, BLOCK_P)
    for i in tl.range(0, TILES, num_stages=STAGES):
        offs_p = (pid_p * TILES + i) * BLOCK_P + rows
        mask_p = offs_p < P
        read_p = offs_p < read_rows
        write_p = offs_p < write_rows
        tile = offs_p[:, None] * ck_p + offs_n[None, :]
        s = load_checkpoint(read_base, rscale_base, tile, offs_p, read_p[:, None] & mask_n[None, :], read_p, QUANT)
        x = tl.load(x_base + offs_p * x_p, mask=mask_p, other=0.0).to(tl.float32)
        zv = tl.load(z_base + offs_p * z_p, mask=mask_p & has_z, other=0.0).to(tl.float32)
        for j in range(0, k):  # ring tokens left by a bucket with a window
            r = (start + j) % RING
            x_j = tl.load(xr_base + r * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
            B_j = tl.load(Br_base + r * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            d_j = tl.load(d_base + r)
            s = tl.fma(s, tl.exp(tl.load(a_base + r)), (d_j * x_j)[:, None] * B_j[None, :])
        s = tl.fma(s, decay, (d * x)[:, None] * Bv[None, :])
        y = tl.sum(s * Cv[None, :], axis=1) + d_skip * x
        y = gated(y, zv, has_z)
        tl.store(o_base + offs_p * o_p, y.to(o_base.dtype.element_ty), mask=mask_p)
        store_checkpoint(
            s, write_base, wscale_base, tile, offs_p, offs_n, write_p[:, None] & mask_n[None, :], write_p, seed,
            element, N, STOCHASTIC, PHILOX_ROUNDS, QUANT,
        )  # fmt: skip


@triton.jit
def stepwise_tiles(
    read_base,
    write_base,
    ck_p,
    rscale_base,
    wscale_base,
    x_base,
    x_t,
    x_p,
    B_row,
    B_t,
    B_n,
    C_row,
    C_t,
    C_n,
    z_base,
    z_t,
    z_p,
    o_base,
    o_t,
    o_p,
    dt_base,
    dt_t,
    a_head,
    bias,
    d_skip,
    softplus,
    xr_base,
    Br_base,
    d_base,
    a_base,
    start,
    k,
    flush,
    head_appends,
    group_first,
    append,
    seed,
    element,
    pid_p,
    read_rows,
    has_z,
    T: tl.constexpr,
    RING: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    QUANT: tl.constexpr,
):
    """A speculative step of a window-0 plan with ``stepwise`` outputs: per tile, the ring's ``k``
    accepted tokens from row ``start`` folded into the checkpoint tile, which is stored (rounded,
    or quantised, once) where the row ``flush``-es, then the step's T tokens applied to the tile one
    by one in fp32 registers, each token's output taken from the state after it, as the
    write-every-step kernel does; no state after a new token is stored. It needs no B . C
    products, so no gram kernel runs before it. The step's tokens join the ring where the row
    ``append``-s, for the commit to count: x by every tile, d and A d by the head's first program
    (``head_appends``), B by that program where its head is the first of its group
    (``group_first``). After a window-0 step a ring holds at most T tokens, and those folds are
    unrolled with masks so that their loads issue together; a ring left longer by a bucket with a
    window folds the rest in a loop.

    A small batch is what this kernel serves, and there a step's time is its chain of dependent
    memory round trips. So every load of a tile comes before its first store (the compiler keeps
    memory operations in order where it cannot prove them apart): the step's dt, B and C once for
    all tiles, each tile's x and z, its checkpoint and ring rows; the ring appends reuse what was
    loaded. A step then waits for the slot id, the cursors and the ring rows, as a write-every-step
    step waits for the slot id, its cursor and its state, instead of once more per token."""
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.arange(0, BLOCK_P)
    ds = ()  # the step's d per token (fp32), and its B (as given, for the ring) and C (fp32) rows
    Bs = ()
    Cs = ()
    for t in tl.static_range(T):
        ds = ds + (softplus_dt(tl.load(dt_base + t * dt_t).to(tl.float32) + bias, softplus),)
        Bs = Bs + (tl.load(B_row + t * B_t + offs_n * B_n, mask=mask_n, other=0.0),)
        Cs = Cs + (tl.load(C_row + t * C_t + offs_n * C_n, mask=mask_n, other=0.0).to(tl.float32),)
    for i in tl.range(0, TILES, num_stages=STAGES):
        offs_p = (pid_p * TILES + i) * BLOCK_P + rows
        mask_p = offs_p < P
        read_p = offs_p < read_rows
        tile = offs_p[:, None] * ck_p + offs_n[None, :]
        xs = ()  # the tile's x per token (as given, for the ring) and z (fp32; zeros without z)
        zs = ()
        for t in tl.static_range(T):
            xs = xs + (tl.load(x_base + t * x_t + offs_p * x_p, mask=mask_p, other=0.0),)
            zs = zs + (tl.load(z_base + t * z_t + offs_p * z_p, mask=mask_p & has_z, other=0.0).to(tl.float32),)
        s = load_checkpoint(read_base, rscale_base, tile, offs_p, read_p[:, None] & mask_n[None, :], read_p, QUANT)
        for j in tl.static_range(T):  # a masked token (j >= k) leaves the tile as it is: exp(0) s + 0
            use = k > j
            r = (start + j) % RING
            x_j = tl.load(xr_base + r * P + offs_p, mask=offs_p < tl.where(use, P, 0), other=0.0).to(tl.float32)
            B_j = tl.load(Br_base + r * N + offs_n, mask=offs_n < tl.where(use, N, 0), other=0.0).to(tl.float32)
            d_j = tl.load(d_base + r, mask=use, other=0.0)
            a_j = tl.load(a_base + r, mask=use, other=0.0)
            s = tl.fma(s, tl.exp(a_j), (d_j * x_j)[:, None] * B_j[None, :])
        for j in range(T, k):  # tokens beyond T: left by a bucket with a window
            r = (start + j) % RING
            x_j = tl.load(xr_base + r * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
            B_j = tl.load(Br_base + r * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            s = tl.fma(s, tl.exp(tl.load(a_base + r)), (tl.load(d_base + r) * x_j)[:, None] * B_j[None, :])
        if flush:
            store_checkpoint(
                s, write_base, wscale_base, tile, offs_p, offs_n, mask_p[:, None] & mask_n[None, :], mask_p, seed,
                element, N, STOCHASTIC, PHILOX_ROUNDS, QUANT,
            )  # fmt: skip
        for t in tl.static_range(T):
            x = xs[t].to(tl.float32)
            s = tl.fma(s, tl.exp(a_head * ds[t]), (ds[t] * x)[:, None] * Bs[t].to(tl.float32)[None, :])
            y = tl.sum(s * Cs[t][None, :], axis=1) + d_skip * x
            y = gated(y, zs[t], has_z)
            tl.store(o_base + t * o_t + offs_p * o_p, y.to(o_base.dtype.element_ty), mask=mask_p)
            if append:
                tl.store(xr_base + ((start + k + t) % RING) * P + offs_p, xs[t], mask=mask_p)
    if head_appends:
        for t in tl.static_range(T):
            r = (start + k + t) % RING
            tl.store(d_base + r, ds[t])
            tl.store(a_base + r, a_head * ds[t])
            if group_first:
                tl.store(Br_base + r * N + offs_n, Bs[t], mask=mask_n)
