"""Experiment (GPU only, Hopper or newer; not used by the backend): a persistent SSU step whose state
tiles arrive by TMA, to test whether a state stream that never waits for the arithmetic closes the
gap between the triton backend and its copy ceiling (docs/benchmarks.md, seventh session).

Each program loops over work items (one ``ROWS x N`` tile of one head of one sequence), the items
``pid, pid + programs, ...``. The tile of item ``k + STAGES - LAG`` is requested (one TMA copy into
a ring of ``STAGES`` shared-memory buffers, signalled through an mbarrier) before item ``k`` is
computed, so ``STAGES - LAG`` tiles a program are always in flight and cost neither registers nor
issue slots. Item ``k + 1``'s inputs (slot, cursor, dt, x, z, B, C, A, D, dt_bias: token 0's) are
loaded into registers before item ``k`` is computed, and the slot (and cursor) of the item to
request next before that, so no index load stands between two requests. States are written from
registers with 16-byte stores, as in the backend's kernel, or with ``TMA_STORE`` (T = 1) back
into the tile's buffer and out with one bulk copy, the buffer refilled ``LAG`` items later (once
that copy has read it). ``MATH = False`` keeps the copies and drops the arithmetic (this shape's
copy ceiling; with ``TMA_STORE`` the tile never enters registers).

Result (H200): every variant matched the backend's kernel bit for bit and was slower than it; even
the copies reached only 82 to 87 % of 4.26 TB/s at batch 32 and 128.

Needs the state cache contiguous along (P, N) (a TMA descriptor over its rows) and P a multiple of
``ROWS``. Gluon does not run in Triton's interpreter.
"""

from __future__ import annotations

import torch
from gluon_ssu import _copy_versions, _gdc, _launch, _version
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _where_item(j, H: gl.constexpr, TPH: gl.constexpr):
    """Item ``j`` -> (batch row, head, tile of the head)."""
    return j // (H * TPH), (j // TPH) % H, j % TPH


@gluon.jit
def _slot(slots_ptr, b, live, pad_slot_id):
    slot = gl.load(slots_ptr + b, mask=live, other=pad_slot_id).to(gl.int64)
    return slot, slot != pad_slot_id


@gluon.jit
def _cursor(cursor_ptr, slot, valid, SPECULATIVE: gl.constexpr):
    if SPECULATIVE:
        return gl.load(cursor_ptr + gl.where(valid, slot, 0), mask=valid, other=0).to(gl.int64)
    else:
        return slot * 0


@gluon.jit
def _request(desc, smem, bars, stage, j, live, slot, cur, layer_offset, s_slot, s_ver, s_head, s_p,
             H: gl.constexpr, N: gl.constexpr, ROWS: gl.constexpr, TPH: gl.constexpr, TILE_BYTES: gl.constexpr,
             pad_slot_id):
    """Ask for item ``j``'s state tile (the version ``cur`` of slot ``slot``; slot 0's for a pad
    row, whose values are then replaced by zeros) in buffer ``stage``."""
    _, head, tile = _where_item(j, H, TPH)
    safe = gl.where(slot != pad_slot_id, slot, 0)
    first = layer_offset + safe * s_slot + cur * s_ver + head * s_head + tile * ROWS * s_p
    bar = bars.index(stage)
    mbarrier.expect(bar, TILE_BYTES, pred=live)
    tma.async_copy_global_to_shared(desc, [(first // N).to(gl.int32), 0], bar, smem.index(stage), pred=live)


@gluon.jit
def _token(x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, rows, offs_n, b, head, group, t, live, x_b, x_t, x_h, x_p, dt_b, dt_t,
           dt_h, B_b, B_t, B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z):
    """Token ``t``'s raw inputs for an item (as stored; converted where used)."""
    d = gl.load(dt_ptr + b * dt_b + t * dt_t + head * dt_h, mask=live, other=0.0)
    x = gl.load(x_ptr + b * x_b + t * x_t + head * x_h + rows * x_p, mask=live & (rows >= 0), other=0.0)
    zv = gl.load(z_ptr + b * z_b + t * z_t + head * z_h + rows * z_p, mask=live & has_z & (rows >= 0), other=0.0)
    Bv = gl.load(B_ptr + b * B_b + t * B_t + group * B_g + offs_n * B_n, mask=live & (offs_n >= 0), other=0.0)
    Cv = gl.load(C_ptr + b * C_b + t * C_t + group * C_g + offs_n * C_n, mask=live & (offs_n >= 0), other=0.0)
    return d, x, zv, Bv, Cv


@gluon.jit(do_not_specialize=["pad_slot_id", "has_d", "has_z", "has_dt_bias", "softplus", "items"])
def ssu_tma_kernel(
    desc, ssm_ptr, cursor_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, slots_ptr, D_ptr, z_ptr, dt_bias_ptr, out_ptr,
    pad_slot_id, layer_offset, s_slot, s_ver, s_head, s_p, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n,
    C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, o_b, o_t, o_h, o_p, has_d, has_z, has_dt_bias, softplus, items,
    T: gl.constexpr, K: gl.constexpr, HEADS_PER_GROUP: gl.constexpr, H: gl.constexpr, P: gl.constexpr,
    N: gl.constexpr, ROWS: gl.constexpr, LANES: gl.constexpr, VEC: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr, SPECULATIVE: gl.constexpr, PDL: gl.constexpr, MATH: gl.constexpr,
    TILE_BYTES: gl.constexpr, TMA_STORE: gl.constexpr, LAG: gl.constexpr,
):
    """One step, persistent: this program's items ``pid, pid + programs, ...`` (module docstring)."""
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // LANES, LANES], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    TPH: gl.constexpr = P // ROWS
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    mine = (items - pid + programs - 1) // programs

    smem = gl.allocate_shared_memory(desc.dtype, [STAGES, ROWS, N], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    if PDL:
        _gdc()

    # the first STAGES - LAG requests
    for i in gl.static_range(STAGES - LAG):
        j = pid + i * programs
        b, head, tile = _where_item(j, H, TPH)
        slot, valid = _slot(slots_ptr, b, i < mine, pad_slot_id)
        cur = _cursor(cursor_ptr, slot, valid, SPECULATIVE)
        _request(desc, smem, bars, i, j, i < mine, slot, cur, layer_offset, s_slot, s_ver, s_head, s_p, H, N, ROWS,
                 TPH, TILE_BYTES, pad_slot_id)
    # the slot and cursor of the next request (item STAGES - LAG)
    j = pid + (STAGES - LAG) * programs
    b, head, tile = _where_item(j, H, TPH)
    next_slot, next_valid = _slot(slots_ptr, b, STAGES - LAG < mine, pad_slot_id)
    next_cur = _cursor(cursor_ptr, next_slot, next_valid, SPECULATIVE)

    rows = gl.arange(0, ROWS, layout=rows_l)
    offs_n = gl.arange(0, N, layout=cols_l)
    # item 0's inputs
    b, head, tile = _where_item(pid, H, TPH)
    slot, valid = _slot(slots_ptr, b, 0 < mine, pad_slot_id)
    cur = _cursor(cursor_ptr, slot, valid, SPECULATIVE)
    d, x, zv, Bv, Cv = _token(x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, tile * ROWS + rows, offs_n, b, head,
                              head // HEADS_PER_GROUP, 0, 0 < mine, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t,
                              B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z)
    a = gl.load(A_ptr + head)
    d_skip = gl.load(D_ptr + head, mask=has_d, other=0.0)
    bias = gl.load(dt_bias_ptr + head, mask=has_dt_bias, other=0.0)

    for k in range(mine):
        # every warp is done with the buffer of item k - LAG (and, with TMA stores, its store has
        # read it): refill it
        if TMA_STORE:
            tma.store_wait(LAG - 1)
        gl.thread_barrier()
        j_req = pid + (k + STAGES - LAG) * programs
        _request(desc, smem, bars, (k + STAGES - LAG) % STAGES, j_req, k + STAGES - LAG < mine, next_slot, next_cur,
                 layer_offset, s_slot, s_ver, s_head, s_p, H, N, ROWS, TPH, TILE_BYTES, pad_slot_id)
        b_r = (j_req + programs) // (H * TPH)
        next_slot, next_valid = _slot(slots_ptr, b_r, k + STAGES - LAG + 1 < mine, pad_slot_id)

        # item k + 1's inputs, into registers while item k is computed
        j1 = pid + (k + 1) * programs
        live1 = k + 1 < mine
        b1, head1, tile1 = _where_item(j1, H, TPH)
        slot1, valid1 = _slot(slots_ptr, b1, live1, pad_slot_id)
        d1, x1, z1, B1, C1 = _token(x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, tile1 * ROWS + rows, offs_n, b1, head1,
                                    head1 // HEADS_PER_GROUP, 0, live1, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t,
                                    B_g, B_n, C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z)
        a1 = gl.load(A_ptr + head1, mask=live1, other=0.0)
        d_skip1 = gl.load(D_ptr + head1, mask=live1 & has_d, other=0.0)
        bias1 = gl.load(dt_bias_ptr + head1, mask=live1 & has_dt_bias, other=0.0)

        # item k
        offs_p = tile * ROWS + rows
        tile_off = gl.expand_dims(offs_p, 1) * s_p + gl.expand_dims(offs_n, 0)
        base = ssm_ptr + layer_offset + gl.where(valid, slot, 0) * s_slot + head * s_head
        store_mask = gl.expand_dims((rows >= 0) & valid, 1) & gl.expand_dims(offs_n >= 0, 0)
        row_first = layer_offset + gl.where(valid, slot, 0) * s_slot + head * s_head + tile * ROWS * s_p
        mbarrier.wait(bars.index(k % STAGES), (k // STAGES) & 1)
        s_raw = smem.index(k % STAGES).load(layout)
        if MATH:
            s = gl.where(valid, s_raw.to(gl.float32), 0.0)
            group = head // HEADS_PER_GROUP
            for t in gl.static_range(T):
                df = d.to(gl.float32) + bias
                if softplus:
                    df = gl.where(df > 20.0, df, gl.log(1.0 + gl.exp(gl.minimum(df, 20.0))))
                xf = x.to(gl.float32)
                s = gl.fma(s, gl.exp(a * df), gl.expand_dims(df * xf, 1) * gl.expand_dims(Bv.to(gl.float32), 0))
                y = gl.sum(s * gl.expand_dims(Cv.to(gl.float32), 0), axis=1)
                if has_d:
                    y += d_skip * xf
                if has_z:
                    zf = zv.to(gl.float32)
                    y = y * zf * (1 / (1 + gl.exp(-zf)))
                if t + 1 < T:  # the next token's inputs before this token's stores
                    d, x, zv, Bv, Cv = _token(x_ptr, B_ptr, C_ptr, dt_ptr, z_ptr, offs_p, offs_n, b, head, group,
                                              t + 1, True, x_b, x_t, x_h, x_p, dt_b, dt_t, dt_h, B_b, B_t, B_g, B_n,
                                              C_b, C_t, C_g, C_n, z_b, z_t, z_h, z_p, has_z)
                gl.store(out_ptr + b * o_b + t * o_t + head * o_h + offs_p * o_p, y.to(out_ptr.dtype.element_ty))
                if SPECULATIVE or t == T - 1:
                    if TMA_STORE:  # T == 1: the new state back into the tile's buffer, then one bulk copy out
                        smem.index(k % STAGES).store(s.to(ssm_ptr.dtype.element_ty))
                        fence_async_shared()
                        gl.thread_barrier()
                        if valid:
                            tma.async_copy_shared_to_global(desc, [(row_first // N).to(gl.int32), 0],
                                                            smem.index(k % STAGES))
                    else:
                        gl.store(base + _version(cur, t, K, SPECULATIVE) * s_ver + tile_off,
                                 s.to(ssm_ptr.dtype.element_ty), mask=store_mask)
        elif TMA_STORE:
            if valid:
                tma.async_copy_shared_to_global(desc, [(row_first // N).to(gl.int32), 0], smem.index(k % STAGES))
        else:
            _copy_versions(base, s_ver, tile_off, s_raw, store_mask, cur, T, K, SPECULATIVE)

        # the cursor of the next request (its slot has long arrived), and rotate item k + 1 in
        next_cur = _cursor(cursor_ptr, next_slot, next_valid, SPECULATIVE)
        cur = _cursor(cursor_ptr, slot1, valid1, SPECULATIVE)
        b, head, tile, slot, valid = b1, head1, tile1, slot1, valid1
        d, x, zv, Bv, Cv, a, d_skip, bias = d1, x1, z1, B1, C1, a1, d_skip1, bias1

    if TMA_STORE:
        tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def launch_tma(ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, *, pad_slot_id,
               heads_per_group, speculative, versions, rows, lanes, warps, stages, ctas, pdl=1, math=1, maxnreg=0,
               tma_store=0, lag=1):
    """One step through ``ssu_tma_kernel`` on ``ctas`` programs per SM; ``tma_store`` (T = 1)
    writes the new state back into the tile's buffer and out with one bulk copy, refilling a
    buffer ``lag`` items after its use."""
    T = x.shape[1] if x.dim() == 4 else 1
    H, P, N = x.shape[-2], x.shape[-1], B.shape[-1]
    assert P % rows == 0, f"rows ({rows}) must divide P ({P}): pick a divisor"
    assert ssm.stride(-1) == 1 and ssm.stride(-2) == N, "the state cache must be contiguous along (P, N)"
    assert not tma_store or T == 1, "TMA stores handle T = 1 only: use tma_store=0 for speculative steps"
    assert 1 <= lag < stages, f"lag ({lag}) must be at least 1 and below stages ({stages})"
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[ssm.dtype]
    desc = TensorDescriptor.from_tensor(ssm.view(-1, N), [rows, N], gl.NVMMASharedLayout.get_default_for([rows, N], el))
    items = x.shape[0] * H * (P // rows)
    sms = torch.cuda.get_device_properties(ssm.device).multi_processor_count
    return _launch(
        ssu_tma_kernel, (min(items, sms * ctas),), ssm, cursor, layer, x, dt, A, B, C, slots, D, z, dt_bias,
        dt_softplus, out, pad_slot_id, warps, pdl, first=(desc,), last=(items,), T=T, K=versions,
        HEADS_PER_GROUP=heads_per_group, H=H, ROWS=rows, LANES=lanes, STAGES=stages, SPECULATIVE=bool(speculative),
        MATH=bool(math), TILE_BYTES=rows * N * ssm.element_size(), TMA_STORE=bool(tma_store), LAG=lag,
        maxnreg=maxnreg or None,
    )
