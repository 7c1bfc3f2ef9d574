"""Experiment (GPU only, not used by the backend): the SSU step written in Triton's Gluon dialect,
where the register layout is explicit, to test whether the tile language's own layouts (16 lanes
sharing a state row, B and C redistributed through shared memory) are what keeps the triton
backend below a plain copy. Results: docs/benchmarks.md, sixth session. Gluon does not run in
Triton's interpreter.

Three program shapes, each checked against the backend's kernel by ``structure_probe.py``:

- ``ssu_gluon_kernel``: a program per tile of ``ROWS`` rows; a row's N values spread over
  ``LANES`` lanes of ``VEC`` 16-byte vectors each (so per-row work is repeated ``LANES`` times,
  not 16). ``PREFETCH`` loads the next token's inputs before this token's stores (else where they
  are used); ``MATH = False`` keeps the loads and stores and drops the arithmetic (the shape's
  copy ceiling); ``INDIRECT = False`` takes the slot from the batch row (no index loads).
- ``ssu_gluon_loop_kernel`` (T = 1): ``TILES`` tiles a program, the next tile loaded into
  registers before the current one is computed.
- ``ssu_gluon_pipe_kernel`` (T = 1): ``TILES`` tiles a program, ``STAGES - 1`` tiles ahead copied
  into shared memory with cp.async; each thread copies exactly the values it later reads, so no
  barrier is needed.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp

from ssu_backend_triton.kernel import _strides


@gluon.jit
def _gdc():
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _sequence(
    ssm_ptr, cursor_ptr, slots_ptr, pad_slot_id, layer_offset, s_slot, s_head, HEADS_PER_GROUP: gl.constexpr,
    P: gl.constexpr, SPECULATIVE: gl.constexpr, INDIRECT: gl.constexpr
):
    """Every kernel's prologue, as in the backend's kernel: which sequence, head and row block this
    program updates, its state's base pointer, the version it reads (speculative) and how many of
    its rows exist (0 for a pad row). ``INDIRECT = False`` (probe only) takes the slot from the
    batch row, with no index loads before the state's."""
    pid_p = gl.program_id(0)
    head = gl.program_id(1)
    row = gl.program_id(2)
    if INDIRECT:
        slot = gl.load(slots_ptr + row).to(gl.int64)
    else:
        slot = row.to(gl.int64)
    valid = slot != pad_slot_id
    safe_slot = gl.where(valid, slot, 0)
    if SPECULATIVE and INDIRECT:
        cur = gl.load(cursor_ptr + safe_slot).to(gl.int64)
    else:
        cur = 0
    base = ssm_ptr + layer_offset + safe_slot * s_slot + head * s_head
    return pid_p, head, row, head // HEADS_PER_GROUP, gl.where(valid, P, 0), cur, base


@gluon.jit
def _version(cur, t: gl.constexpr, K: gl.constexpr, SPECULATIVE: gl.constexpr):
    """Where token ``t``'s state goes: version ``(cur + 1 + t) % K`` when speculative, else the
    only one."""
    if SPECULATIVE:
        return (cur + 1 + t) % K
    else:
        return 0


@gluon.jit
def _copy_versions(base, s_ver, offsets, tile, mask, cur, T: gl.constexpr, K: gl.constexpr,
                   SPECULATIVE: gl.constexpr):
    """Without arithmetic (a copy ceiling): store the loaded ``tile`` to every version the step
    would write."""
    for t in gl.static_range(T):
        if SPECULATIVE or t == T - 1:
            gl.store(base + _version(cur, t, K, SPECULATIVE) * s_ver + offsets, tile, mask=mask)


@gluon.jit
def _tok(
    x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, offs_p, offs_n, mask_p, row, head, group, t, bias, x_b, x_t, x_h, x_p, dt_b,
    dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z, softplus
):
    d = gl.load(dt_ptr + row * dt_b + t * dt_t + head * dt_h).to(gl.float32) + bias
    if softplus:
        d = gl.where(d > 20.0, d, gl.log(1.0 + gl.exp(gl.minimum(d, 20.0))))
    x = gl.load(x_ptr + row * x_b + t * x_t + head * x_h + offs_p * x_p, mask=mask_p, other=0.0).to(gl.float32)
    zv = x
    if has_z:
        zv = gl.load(z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p, mask=mask_p, other=0.0).to(gl.float32)
    Bv = gl.load(B_ptr + row * B_b + t * B_t + group * B_g + offs_n * B_n).to(gl.float32)
    Cv = gl.load(C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n).to(gl.float32)
    return d, x, zv, Bv, Cv


@gluon.jit(do_not_specialize=["pad_slot_id", "has_d", "has_z", "has_dt_bias", "softplus"])
def ssu_gluon_kernel(
    ssm_ptr, cursor_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, slots_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr, pad_slot_id,
    layer_offset, s_slot, s_ver, s_head, s_p, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g,
    C_n, z_b, z_t, z_h, z_p, o_b, o_t, o_h, o_p, has_d, has_z, has_dt_bias, softplus, T: gl.constexpr, K: gl.constexpr,
    HEADS_PER_GROUP: gl.constexpr, P: gl.constexpr, N: gl.constexpr, ROWS: gl.constexpr, LANES: gl.constexpr,
    VEC: gl.constexpr, WARPS: gl.constexpr, SPECULATIVE: gl.constexpr, PDL: gl.constexpr, MATH: gl.constexpr = True,
    INDIRECT: gl.constexpr = True, PREFETCH: gl.constexpr = True
):
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    if PDL:
        _gdc()
    pid_p, head, row, group, state_rows, cur, base = _sequence(
        ssm_ptr, cursor_ptr, slots_ptr, pad_slot_id, layer_offset, s_slot, s_head, HEADS_PER_GROUP, P, SPECULATIVE,
        INDIRECT
    )
    offs_p = pid_p * ROWS + gl.arange(0, ROWS, layout=rows_l)
    offs_n = gl.arange(0, N, layout=cols_l)
    tile = gl.expand_dims(offs_p, 1) * s_p + gl.expand_dims(offs_n, 0)
    state_mask = gl.expand_dims(offs_p < state_rows, 1) & gl.expand_dims(offs_n < N, 0)
    s_raw = gl.load(base + cur * s_ver + tile, mask=state_mask, other=0.0)
    mask_p = offs_p < P

    a = gl.load(A_ptr + head).to(gl.float32)
    d_skip = 0.0
    if has_d:
        d_skip = gl.load(D_ptr + head).to(gl.float32)
    bias = 0.0
    if has_dt_bias:
        bias = gl.load(dt_bias_ptr + head).to(gl.float32)

    s = s_raw.to(gl.float32)
    if not MATH:  # the structure's ceiling: the same loads and stores, no arithmetic
        _copy_versions(base, s_ver, tile, s_raw, state_mask, cur, T, K, SPECULATIVE)
    elif not PREFETCH:  # each token's inputs where they are used (z after the state update)
        for t in gl.static_range(T):
            d = gl.load(dt_ptr + row * dt_b + t * dt_t + head * dt_h).to(gl.float32) + bias
            if softplus:
                d = gl.where(d > 20.0, d, gl.log(1.0 + gl.exp(gl.minimum(d, 20.0))))
            x = gl.load(x_ptr + row * x_b + t * x_t + head * x_h + offs_p * x_p, mask=mask_p, other=0.0).to(gl.float32)
            Bv = gl.load(B_ptr + row * B_b + t * B_t + group * B_g + offs_n * B_n).to(gl.float32)
            Cv = gl.load(C_ptr + row * C_b + t * C_t + group * C_g + offs_n * C_n).to(gl.float32)
            s = gl.fma(s, gl.exp(a * d), gl.expand_dims(d * x, 1) * gl.expand_dims(Bv, 0))
            y = gl.sum(s * gl.expand_dims(Cv, 0), axis=1)
            if has_d:
                y += d_skip * x
            if has_z:
                zv = gl.load(z_ptr + row * z_b + t * z_t + head * z_h + offs_p * z_p, mask=mask_p, other=0.0).to(
                    gl.float32
                )
                y = y * zv * (1 / (1 + gl.exp(-zv)))
            gl.store(
                out_ptr + row * o_b + t * o_t + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty), mask=mask_p
            )
            if SPECULATIVE or t == T - 1:
                gl.store(base + _version(cur, t, K, SPECULATIVE) * s_ver + tile, s.to(ssm_ptr.dtype.element_ty),
                         mask=state_mask)
    else:
        d, x, zv, Bv, Cv = _tok(
            x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, offs_p, offs_n, mask_p, row, head, group, 0, bias, x_b, x_t, x_h, x_p,
            dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z, softplus
        )
        for t in gl.static_range(T):
            s = gl.fma(s, gl.exp(a * d), gl.expand_dims(d * x, 1) * gl.expand_dims(Bv, 0))
            y = gl.sum(s * gl.expand_dims(Cv, 0), axis=1)
            if has_d:
                y += d_skip * x
            if has_z:
                y = y * zv * (1 / (1 + gl.exp(-zv)))
            if t + 1 < T:  # the next token's inputs before this token's stores, so that their latency overlaps
                d, x, zv, Bv, Cv = _tok(
                    x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, offs_p, offs_n, mask_p, row, head, group, t + 1, bias, x_b, x_t,
                    x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z,
                    softplus
                )
            gl.store(
                out_ptr + row * o_b + t * o_t + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty), mask=mask_p
            )
            if SPECULATIVE or t == T - 1:
                gl.store(base + _version(cur, t, K, SPECULATIVE) * s_ver + tile, s.to(ssm_ptr.dtype.element_ty),
                         mask=state_mask)


def _launch(
    kernel, grid, ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, pad_slot_id, warps, pdl,
    first=(), last=(), **constexprs
):
    """Launch one of the kernels above (or ``gluon_tma``'s) with the backend kernel's argument
    convention (same pointers, strides and flags; absent optional inputs replaced by harmless
    pointers), ``first`` before them and ``last`` after the flags."""
    lead = 2 if x.dim() == 4 else 1
    xs, dts, Bs, Cs = _strides(x, lead), _strides(dt, lead), _strides(B, lead), _strides(C, lead)
    zs = _strides(z, lead) if z is not None else (0, 0, 0, 0)
    os_ = _strides(out, lead)
    s = ssm.stride()
    return kernel[grid](
        *first, ssm, cursor if cursor is not None else slots, x, dt, A, B, C, slots,
        D if D is not None else A, z if z is not None else x, dt_bias if dt_bias is not None else A, out,
        pad_slot_id, layer * s[0], s[1], s[2], s[3], s[4], *xs, *dts, *Bs, *Cs, *zs, *os_,
        D is not None, z is not None, dt_bias is not None, bool(dt_softplus), *last,
        P=x.shape[-1], N=B.shape[-1], VEC=16 // ssm.element_size(), WARPS=warps, PDL=bool(pdl), num_warps=warps,
        launch_pdl=bool(pdl), **constexprs
    )


def launch_gluon(
    ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, *, pad_slot_id, heads_per_group,
    speculative, versions, rows, lanes, warps, pdl=0, math=True, indirect=True, prefetch=True
):
    grid = (triton.cdiv(x.shape[-1], rows), x.shape[-2], x.shape[0])
    return _launch(
        ssu_gluon_kernel, grid, ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, pad_slot_id,
        warps, pdl, T=x.shape[1] if x.dim() == 4 else 1, K=versions, HEADS_PER_GROUP=heads_per_group, ROWS=rows,
        LANES=lanes, SPECULATIVE=speculative, MATH=bool(math), INDIRECT=bool(indirect), PREFETCH=bool(prefetch)
    )


@gluon.jit(do_not_specialize=["pad_slot_id", "has_d", "has_z", "has_dt_bias", "softplus"])
def ssu_gluon_loop_kernel(
    ssm_ptr, cursor_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, slots_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr, pad_slot_id,
    layer_offset, s_slot, s_ver, s_head, s_p, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g,
    C_n, z_b, z_t, z_h, z_p, o_b, o_t, o_h, o_p, has_d, has_z, has_dt_bias, softplus, T: gl.constexpr, K: gl.constexpr,
    HEADS_PER_GROUP: gl.constexpr, P: gl.constexpr, N: gl.constexpr, ROWS: gl.constexpr, LANES: gl.constexpr,
    VEC: gl.constexpr, WARPS: gl.constexpr, SPECULATIVE: gl.constexpr, PDL: gl.constexpr, TILES: gl.constexpr,
    MATH: gl.constexpr = True
):
    """T = 1 only: TILES tiles a program, the next tile's state loaded (into registers) before the
    current one is computed."""
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    if PDL:
        _gdc()
    pid_p, head, row, group, state_rows, cur, base = _sequence(
        ssm_ptr, cursor_ptr, slots_ptr, pad_slot_id, layer_offset, s_slot, s_head, HEADS_PER_GROUP, P, False, True
    )
    rows = gl.arange(0, ROWS, layout=rows_l)
    offs_n = gl.arange(0, N, layout=cols_l)
    first = pid_p * (ROWS * TILES)
    offs_p = first + rows
    tile = gl.expand_dims(offs_p, 1) * s_p + gl.expand_dims(offs_n, 0)
    state_mask = gl.expand_dims(offs_p < state_rows, 1) & gl.expand_dims(offs_n < N, 0)
    s_next = gl.load(base + tile, mask=state_mask, other=0.0)
    if MATH:
        x_next = gl.load(x_ptr + row * x_b + head * x_h + offs_p * x_p, mask=offs_p < P, other=0.0)
        z_next = x_next
        if has_z:
            z_next = gl.load(z_ptr + row * z_b + head * z_h + offs_p * z_p, mask=offs_p < P, other=0.0)
        a = gl.load(A_ptr + head).to(gl.float32)
        d_skip = 0.0
        if has_d:
            d_skip = gl.load(D_ptr + head).to(gl.float32)
        bias = 0.0
        if has_dt_bias:
            bias = gl.load(dt_bias_ptr + head).to(gl.float32)
        d = gl.load(dt_ptr + row * dt_b + head * dt_h).to(gl.float32) + bias
        if softplus:
            d = gl.where(d > 20.0, d, gl.log(1.0 + gl.exp(gl.minimum(d, 20.0))))
        Bv = gl.load(B_ptr + row * B_b + group * B_g + offs_n * B_n).to(gl.float32)
        Cv = gl.load(C_ptr + row * C_b + group * C_g + offs_n * C_n).to(gl.float32)
        dA = gl.exp(a * d)
    for i in gl.static_range(TILES):
        s_raw = s_next
        offs_p = first + i * ROWS + rows
        tile = gl.expand_dims(offs_p, 1) * s_p + gl.expand_dims(offs_n, 0)
        state_mask = gl.expand_dims(offs_p < state_rows, 1) & gl.expand_dims(offs_n < N, 0)
        if MATH:
            x = x_next.to(gl.float32)
            zv = z_next.to(gl.float32)
        if i + 1 < TILES:
            nxt = offs_p + ROWS
            s_next = gl.load(
                base + gl.expand_dims(nxt, 1) * s_p + gl.expand_dims(offs_n, 0), mask=gl.expand_dims(nxt < state_rows,
                1) & gl.expand_dims(offs_n < N, 0), other=0.0
            )
            if MATH:
                x_next = gl.load(x_ptr + row * x_b + head * x_h + nxt * x_p, mask=nxt < P, other=0.0)
                if has_z:
                    z_next = gl.load(z_ptr + row * z_b + head * z_h + nxt * z_p, mask=nxt < P, other=0.0)
        if MATH:
            s = gl.fma(s_raw.to(gl.float32), dA, gl.expand_dims(d * x, 1) * gl.expand_dims(Bv, 0))
            y = gl.sum(s * gl.expand_dims(Cv, 0), axis=1)
            if has_d:
                y += d_skip * x
            if has_z:
                y = y * zv * (1 / (1 + gl.exp(-zv)))
            gl.store(out_ptr + row * o_b + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty), mask=offs_p < P)
            gl.store(base + tile, s.to(ssm_ptr.dtype.element_ty), mask=state_mask)
        else:
            gl.store(base + tile, s_raw, mask=state_mask)


def launch_gluon_loop(
    ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, *, pad_slot_id, heads_per_group,
    speculative, versions, rows, lanes, warps, tiles, pdl=0, math=True
):
    assert x.dim() == 3 and not speculative
    grid = (triton.cdiv(x.shape[-1], rows * tiles), x.shape[-2], x.shape[0])
    return _launch(
        ssu_gluon_loop_kernel, grid, ssm, slots, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out,
        pad_slot_id, warps, pdl, T=1, K=versions, HEADS_PER_GROUP=heads_per_group, ROWS=rows, LANES=lanes,
        SPECULATIVE=False, TILES=tiles, MATH=bool(math)
    )


@gluon.jit(do_not_specialize=["pad_slot_id", "has_d", "has_z", "has_dt_bias", "softplus"])
def ssu_gluon_pipe_kernel(
    ssm_ptr, cursor_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, slots_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr, pad_slot_id,
    layer_offset, s_slot, s_ver, s_head, s_p, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g,
    C_n, z_b, z_t, z_h, z_p, o_b, o_t, o_h, o_p, has_d, has_z, has_dt_bias, softplus, T: gl.constexpr, K: gl.constexpr,
    HEADS_PER_GROUP: gl.constexpr, P: gl.constexpr, N: gl.constexpr, ROWS: gl.constexpr, LANES: gl.constexpr,
    VEC: gl.constexpr, WARPS: gl.constexpr, SPECULATIVE: gl.constexpr, PDL: gl.constexpr, TILES: gl.constexpr,
    STAGES: gl.constexpr, MATH: gl.constexpr = True
):
    """T = 1 only: TILES tiles a program, STAGES - 1 tiles ahead copied into shared memory with
    cp.async; each thread copies exactly the values it later reads, so no barrier is needed."""
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(VEC, 1, 8, [1, 0])
    if PDL:
        _gdc()
    pid_p, head, row, group, state_rows, cur, base = _sequence(
        ssm_ptr, cursor_ptr, slots_ptr, pad_slot_id, layer_offset, s_slot, s_head, HEADS_PER_GROUP, P, False, True
    )
    rows = gl.arange(0, ROWS, layout=rows_l)
    offs_n = gl.arange(0, N, layout=cols_l)
    first = pid_p * (ROWS * TILES)
    smem = gl.allocate_shared_memory(ssm_ptr.dtype.element_ty, [STAGES, ROWS, N], smem_l)
    for i in gl.static_range(STAGES - 1):
        if i < TILES:
            pi = first + i * ROWS + rows
            _cp.async_copy_global_to_shared(
                smem.index(i), base + gl.expand_dims(pi, 1) * s_p + gl.expand_dims(offs_n, 0), mask=gl.expand_dims(pi <
                state_rows, 1) & gl.expand_dims(offs_n < N, 0)
            )
        _cp.commit_group()
    if MATH:
        a = gl.load(A_ptr + head).to(gl.float32)
        d_skip = 0.0
        if has_d:
            d_skip = gl.load(D_ptr + head).to(gl.float32)
        bias = 0.0
        if has_dt_bias:
            bias = gl.load(dt_bias_ptr + head).to(gl.float32)
        d = gl.load(dt_ptr + row * dt_b + head * dt_h).to(gl.float32) + bias
        if softplus:
            d = gl.where(d > 20.0, d, gl.log(1.0 + gl.exp(gl.minimum(d, 20.0))))
        Bv = gl.load(B_ptr + row * B_b + group * B_g + offs_n * B_n).to(gl.float32)
        Cv = gl.load(C_ptr + row * C_b + group * C_g + offs_n * C_n).to(gl.float32)
        dA = gl.exp(a * d)
    for i in gl.static_range(TILES):
        if i + STAGES - 1 < TILES:
            pj = first + (i + STAGES - 1) * ROWS + rows
            _cp.async_copy_global_to_shared(
                smem.index((i + STAGES - 1) % STAGES), base + gl.expand_dims(pj, 1) * s_p + gl.expand_dims(offs_n, 0),
                mask=gl.expand_dims(pj < state_rows, 1) & gl.expand_dims(offs_n < N, 0)
            )
        _cp.commit_group()
        offs_p = first + i * ROWS + rows
        tile = gl.expand_dims(offs_p, 1) * s_p + gl.expand_dims(offs_n, 0)
        state_mask = gl.expand_dims(offs_p < state_rows, 1) & gl.expand_dims(offs_n < N, 0)
        if MATH:
            x = gl.load(x_ptr + row * x_b + head * x_h + offs_p * x_p, mask=offs_p < P, other=0.0).to(gl.float32)
            zv = x
            if has_z:
                zv = gl.load(z_ptr + row * z_b + head * z_h + offs_p * z_p, mask=offs_p < P, other=0.0).to(gl.float32)
        _cp.wait_group(STAGES - 1)
        s_raw = smem.index(i % STAGES).load(layout)
        if MATH:
            s = gl.where(state_mask, s_raw.to(gl.float32), 0.0)
            s = gl.fma(s, dA, gl.expand_dims(d * x, 1) * gl.expand_dims(Bv, 0))
            y = gl.sum(s * gl.expand_dims(Cv, 0), axis=1)
            if has_d:
                y += d_skip * x
            if has_z:
                y = y * zv * (1 / (1 + gl.exp(-zv)))
            gl.store(out_ptr + row * o_b + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty), mask=offs_p < P)
            gl.store(base + tile, s.to(ssm_ptr.dtype.element_ty), mask=state_mask)
        else:
            gl.store(base + tile, s_raw, mask=state_mask)


def launch_gluon_pipe(
    ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, *, pad_slot_id, heads_per_group,
    speculative, versions, rows, lanes, warps, tiles, stages, pdl=0, math=True, maxnreg=0
):
    assert x.dim() == 3 and not speculative
    grid = (triton.cdiv(x.shape[-1], rows * tiles), x.shape[-2], x.shape[0])
    return _launch(
        ssu_gluon_pipe_kernel, grid, ssm, slots, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out,
        pad_slot_id, warps, pdl, T=1, K=versions, HEADS_PER_GROUP=heads_per_group, ROWS=rows, LANES=lanes,
        SPECULATIVE=False, TILES=tiles, STAGES=stages, MATH=bool(math), maxnreg=maxnreg or None
    )
